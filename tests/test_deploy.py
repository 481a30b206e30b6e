"""deploy/: the Prometheus rules under Debian's real ``promtool`` and the Grafana dashboard's structure.

* ``promtool check rules`` and ``promtool test rules`` on the shipped unit tests (deploy/prometheus/tests),
  whose input series include alerts that must fire and series that must stay quiet.
* The recording rules agree with the doctor's own readers (telemetry/server_metrics.py) on the captured real
  vLLM, SGLang and llama.cpp metric text: each capture becomes counters growing linearly from 0, and
  the rules' tau and per-position rates must equal the reader's.
* A rule file with a broken threshold fails its promtool test (the tests can fail).
* The dashboard: unique panel ids, the datasource variable on every query, every expression parses
  (promtool) and names only recorded series, engine metrics or the exporter's gauges.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from dflash_doctor.telemetry.counts import SeriesKey
from dflash_doctor.telemetry.server_metrics import read_exposition
from dflash_doctor.telemetry.exposition import parse_exposition
from telemetry_fixtures import DATA

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
RULES = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "dflash-doctor.json"
METRIC_NAME = re.compile(r"\b((?:dflash|vllm|sglang|llamacpp):[A-Za-z0-9_:]+|dflash_doctor_[a-z_]+)")


def promtool(*args: str, cwd: Path = RULES) -> subprocess.CompletedProcess:
    binary = shutil.which("promtool")
    if binary is None:
        raise RuntimeError(
            "promtool is not on PATH; install Debian's package: apt-get install prometheus (.ci/run does)"
        )
    return subprocess.run([binary, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def recorded_names() -> set[str]:
    groups = yaml.safe_load((RULES / "recording.rules.yml").read_text())["groups"]
    return {rule["record"] for group in groups for rule in group["rules"]}


def test_rule_files_pass_promtool_check():
    result = promtool("check", "rules", "recording.rules.yml", "alert.rules.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 21 rules found" in result.stdout and "SUCCESS: 9 rules found" in result.stdout


@pytest.mark.parametrize("test_file", ["engines.test.yml", "exporter.test.yml"])
def test_rule_unit_tests_pass(test_file):
    result = promtool("test", "rules", f"tests/{test_file}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_a_broken_threshold_fails_the_unit_tests(tmp_path):
    """The exporter tests expect DFlashDoctorNotEvaluating after 10 minutes without an evaluation; at an
    hour's threshold promtool must report the missing alert."""
    (tmp_path / "tests").mkdir()
    alerts = (RULES / "alert.rules.yml").read_text()
    assert "dflash_doctor_last_evaluation_timestamp_seconds > 600" in alerts
    (tmp_path / "alert.rules.yml").write_text(
        alerts.replace(
            "dflash_doctor_last_evaluation_timestamp_seconds > 600",
            "dflash_doctor_last_evaluation_timestamp_seconds > 3600",
        )
    )
    shutil.copy(RULES / "tests" / "exporter.test.yml", tmp_path / "tests")
    result = promtool("test", "rules", "tests/exporter.test.yml", cwd=tmp_path)
    assert result.returncode != 0
    assert "DFlashDoctorNotEvaluating" in result.stdout + result.stderr


def _round(value: float, step: float = 0.001) -> float:
    """PromQL's round(x, step), with its arithmetic (Prometheus promql/functions.go funcRound)."""
    inverse = 1 / step
    return math.floor(value * inverse + 0.5) / inverse


def _series(labels: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


@pytest.mark.parametrize(
    ("capture", "engine", "class_label", "job"),
    [
        ("vllm_metrics_good.txt", "vllm", None, "vllm"),
        ("sglang_metrics.txt", "sglang", "cls", "sglang"),
        ("llamacpp_metrics.txt", "llamacpp", None, "qwen3-llama"),
    ],
)
def test_recording_rules_agree_with_the_doctors_reader(tmp_path, capture, engine, class_label, job):
    """Counters grow linearly from 0 to the captured value over 10 minutes, so a 5m rate ratio equals the
    whole-capture ratio the reader computes; gauges hold their captured value."""
    expo = parse_exposition((DATA / capture).read_text())
    reading = read_exposition(expo, server_kind=engine, default_model=job, class_label=class_label)
    input_series = []
    for sample in expo.samples:
        values = f"0+{sample.value / 10!r}x10" if sample.name.endswith("_total") else f"{sample.value!r}+0x10"
        input_series.append({"series": sample.name + _series({**sample.labels, "job": job}), "values": values})

    def labels_of(key: SeriesKey, **extra: str) -> str:
        labels = {"serving_engine": engine, "model_name": key.model, **extra}
        if key.cls != "all":
            labels["cls"] = key.cls
        return _series(labels)

    tau_samples, per_pos_samples = [], []
    for key, counts in reading.counts.items():
        if counts.mean_acceptance_length is not None:
            tau_samples.append({"labels": labels_of(key), "value": _round(counts.mean_acceptance_length)})
        for position, rate in enumerate(counts.acceptance_rate_per_pos or []):
            per_pos_samples.append({"labels": labels_of(key, position=str(position)), "value": _round(rate)})
    assert tau_samples, f"the reader found no tau in {capture}"
    expr_tests = [
        {"expr": "round(dflash:mean_acceptance_length:rate5m, 0.001)", "eval_time": "10m", "exp_samples": tau_samples}
    ]
    if per_pos_samples:
        expr_tests.append(
            {
                "expr": "round(dflash:acceptance_rate_per_pos:rate5m, 0.001)",
                "eval_time": "10m",
                "exp_samples": per_pos_samples,
            }
        )
    test_file = tmp_path / "agreement.test.yml"
    test_file.write_text(
        yaml.safe_dump(
            {
                "rule_files": [str(RULES / "recording.rules.yml")],
                "evaluation_interval": "30s",
                "tests": [{"interval": "1m", "input_series": input_series, "promql_expr_test": expr_tests}],
            }
        )
    )
    result = promtool("test", "rules", str(test_file), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def _panels() -> list[dict]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def test_dashboard_panels_have_unique_ids_and_use_the_datasource_variable():
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("serving_engine", "model_name"):
        assert variables[name]["datasource"]["uid"] == "${datasource}"
    queried = [p for p in _panels() if p.get("targets")]
    assert queried, "the dashboard has no query panels"
    for panel in queried:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
    kinds = {p["type"] for p in _panels()}
    assert {"timeseries", "stat", "alertlist"} <= kinds


def _exporter_metric_names() -> set[str]:
    from dflash_doctor.telemetry.exporter import VerdictGauges

    return VerdictGauges().metric_names


def test_dashboard_expressions_parse_and_name_existing_series(tmp_path):
    """Every expression (Grafana variables replaced) goes through promtool's PromQL parser, and every
    metric it names is a recorded series, an engine metric the readers know, or an exporter gauge."""
    known = recorded_names() | _exporter_metric_names() | {"sglang:spec_accept_length"}
    rules, named = [], set()
    for panel in _panels():
        for target in panel.get("targets", []):
            expr = target["expr"]
            named |= set(METRIC_NAME.findall(re.sub(r'"[^"]*"', '""', expr)))
            rules.append({"record": f"panel_{panel['id']}_{target['refId']}", "expr": re.sub(r"\$\w+", ".*", expr)})
    unknown = named - known
    assert not unknown, f"dashboard queries name series nothing produces: {sorted(unknown)}"
    assert recorded_names() - named <= {
        "dflash:spec_decode_accepted_tokens:rate5m",
        "dflash:spec_decode_draft_tokens:rate5m",
        "dflash:spec_decode_accepted_tokens_per_pos:rate5m",
        "dflash:acceptance_rate_per_pos:avg6h_offset1h",
    }
    (tmp_path / "panels.rules.yml").write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    result = promtool("check", "rules", "panels.rules.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def _watch_options() -> set[str]:
    import typer.main

    from dflash_doctor.cli import app

    group = typer.main.get_command(app)
    command = group.get_command(typer.Context(group), "watch")  # type: ignore[attr-defined] (the root is a group)
    return {opt for param in command.params for opt in param.opts}


def _flags(args: list[str]) -> set[str]:
    return {arg.split("=", 1)[0] for arg in args if arg.startswith("--")}


def test_service_examples_use_real_watch_flags():
    """The systemd unit and the Kubernetes sidecar run `watch` with flags it has (a renamed flag breaks them)."""
    unit = (DEPLOY / "systemd" / "dflash-doctor-watch.service").read_text().replace("\\\n", " ")
    (exec_start,) = [line.split("=", 1)[1] for line in unit.splitlines() if line.startswith("ExecStart=")]
    unit_args = exec_start.split()
    assert unit_args[1] == "watch"
    manifest = yaml.safe_load((DEPLOY / "kubernetes" / "vllm-with-watch-sidecar.yaml").read_text())
    (sidecar,) = [c for c in manifest["spec"]["template"]["spec"]["containers"] if c["name"] == "dflash-doctor"]
    assert sidecar["args"][0] == "watch"
    options = _watch_options()
    for args in (unit_args, sidecar["args"]):
        assert {"--exporter-port", "--exporter-address", "--on-alert"} <= _flags(args)
        assert _flags(args) <= options, _flags(args) - options
    port = next(int(a.split("=")[1]) for a in sidecar["args"] if a.startswith("--exporter-port="))
    assert {"name": "doctor-metrics", "containerPort": port} in sidecar["ports"]
    assert manifest["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == str(port)


@pytest.mark.parametrize(
    "alert, acts", [("collapse", True), ("fallback", True), ("acceptance-drop", False), ("drafting-stopped", False)]
)
def test_restart_hook_acts_only_on_collapse_and_fallback(tmp_path, alert, acts):
    """The shipped hook under sh, with `logger` and `sudo` replaced by recorders on PATH."""
    calls = tmp_path / "calls"
    for name in ("logger", "sudo"):
        stub = tmp_path / name
        stub.write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\n')
        stub.chmod(0o755)
    env = {
        "PATH": f"{tmp_path}:/usr/bin:/bin",
        "DFLASH_DOCTOR_ALERT": alert,
        "DFLASH_DOCTOR_MODEL": "qwen3-8b",
        "DFLASH_DOCTOR_MESSAGE": "tau 1.02",
        "DFLASH_DOCTOR_ADVICE": "vLLM: --speculative-config ...",
    }
    result = subprocess.run(
        ["sh", str(DEPLOY / "hooks" / "restart-vllm-without-speculation.sh")], env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    recorded = calls.read_text().splitlines() if calls.exists() else []
    if acts:
        assert recorded[-2:] == [
            "sudo -n /usr/bin/cp /etc/vllm/spec-off.env /etc/vllm/spec.env",
            "sudo -n /usr/bin/systemctl restart vllm.service",
        ]
    else:
        assert recorded == []
