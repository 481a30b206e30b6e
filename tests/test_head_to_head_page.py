"""The head-to-head as a decision page: head_to_head.html / .md (and the dashboard's page) carry the verdict per
class with the setting to type in each engine, the costs with their spread, tau and the per-position curves,
each sub-run's checks with a link to its report, command, date, machine and tool version, and no absolute
path; the terminal's line per speculator says its verdict word and what warned or failed, and the exit code
follows --fail-on over every sub-run."""

from __future__ import annotations

import html
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from cli_helpers import invoke, pair_args
from dashboard_app import open_app
from dflash_doctor.checks.speculative_k import SpeculativeKCheck
from dflash_doctor.report.head_to_head import (
    check_verdict,
    describe_sub_runs,
    engine_settings,
    html_page,
    markdown,
    sub_run_line,
    write_head_to_head,
)
from dflash_doctor.errors import UsageError
from dflash_doctor.rundir.load import read_run_meta
from dflash_doctor.rundir.run_record import ModelInfo, RunMeta, RunRecord
from dflash_doctor.rundir.status import CheckResult
from dflash_doctor.rundir.tables import HEAD_TO_HEAD_JSON, RUN_JSON
from dflash_doctor.rundir.writer import write_run_json
from dflash_doctor.stats.head_to_head import HeadToHead, read_head_to_head

HOSTILE = "<script>alert(1)</script>](http://tracker.example/p.png)"


def _row(name: str, k: int, speedup: float, low: float, high: float) -> dict:
    return {
        "speculator": name,
        "best_k": k,
        "tau": 2.5,
        "tau_ci": [2.4, 2.6],
        "speedup": speedup,
        "speedup_ci": [low, high],
        "speedup_by_k": {str(k): speedup},
        "acceptance_rate_per_pos": [0.8, 0.6, 0.4],
        "num_drafts": 50,
    }


def _verdict(text: str, decisive: bool, winner: str | None = "eagle3") -> dict:
    return {
        "winner": winner,
        "runner_up": "ngram" if winner else None,
        "ratio": 1.4,
        "ratio_ci": [1.2, 1.6],
        "decisive": decisive,
        "text": text,
    }


def _head_to_head(root: Path, checks: dict[str, list[tuple[str, str]]]) -> dict:
    """A head-to-head of an EAGLE-3 head (decisive overall, undecided for code) and n-gram lookup, with each
    sub-run's run.json under ``root`` as the pipeline leaves them before the pages are written (complete
    records: describe_sub_runs reads them through the typed reader every view uses)."""
    kinds = {
        "eagle3": ("eagle3", str(root.parent / "models" / "head")),
        "ngram": ("ngram", "ngram:prompt_lookup_min=2,prompt_lookup_max=5"),
    }
    target = str(root.parent / "models" / "target")
    for name, (kind, draft) in kinds.items():
        facts = {"prompt_lookup_min": 2, "prompt_lookup_max": 5} if kind == "ngram" else {}
        record = RunRecord(
            meta=RunMeta(command="check", tool_version="9.9.9", created_at="2026-12-01T10:00:00+00:00"),
            models={
                "target": ModelInfo(target, "sha256:target", "bfloat16", "cuda", "target"),
                "draft": ModelInfo(draft, "sha256:draft", "bfloat16", "cuda", kind, facts=facts),
            },
            environment={"platform": "Linux-test", "python": "3.11.7", "torch": "2.13.0", "gpu": "NVIDIA H200"},
            config={
                "target": target,
                "draft": draft,
                "workload": "demo",
                "k": [1, 2, 3, 4],
                "max_new_tokens": 64,
                "seed": 0,
                "device": "cuda",
                "classes": [],
            },
            checks=[CheckResult(i, s, f"{i} said {s}") for i, s in checks[name]],
        )
        write_run_json(root / name, record.to_json())
    return {
        "speculators": [
            {"name": name, "draft": draft, "kind": kind, "run_dir": str(root / name)}
            for name, (kind, draft) in kinds.items()
        ],
        "costs": {
            "source": "measured",
            "device": "cuda",
            "t_decode_s": 0.02,
            "t_verify_s": {"3": 0.025},
            "t_draft_s": {"eagle3": {"3": 0.004}, "ngram": {"3": 0.0001}},
            "t_decode_s_ci": [0.019, 0.021],
            "t_verify_s_ci": {"3": [0.024, 0.026]},
            "t_draft_s_ci": {"eagle3": {"3": [0.0039, 0.0041]}, "ngram": {"3": [0.00009, 0.00011]}},
            "timing_violations": [],
        },
        "scopes": {
            "overall": {
                "rows": [_row("eagle3", 3, 1.9, 1.7, 2.1), _row("ngram", 3, 1.3, 1.2, 1.4)],
                "verdict": _verdict("overall: deploy eagle3 at K=3 (1.90x [1.70, 2.10])", True),
            },
            "code": {
                "rows": [_row("eagle3", 2, 1.2, 0.9, 1.5), _row("ngram", 4, 1.1, 0.9, 1.3)],
                "verdict": _verdict("for code: no clear winner: eagle3 leads at K=2", False),
            },
        },
    }


@pytest.fixture
def page(tmp_path):
    root = tmp_path / "runs" / "h2h"
    data = _head_to_head(
        root,
        {
            "eagle3": [("acceptance", "warn"), ("eagle3-config", "warn"), ("lossless", "pass")],
            "ngram": [("lossless", "pass"), ("timing", "pass")],
        },
    )
    described = describe_sub_runs(root, HeadToHead.from_json(data))
    write_head_to_head(root, described)
    return root, described


def test_a_warned_sub_run_is_named_warn_with_its_check_ids():
    verdict, flagged = check_verdict(
        [("lossless", "pass"), ("acceptance", "warn"), ("eagle3-config", "fail"), ("x", "skip")]
    )
    assert (verdict, flagged) == ("fail", ["eagle3-config", "acceptance"])
    assert (
        sub_run_line("eagle3", *check_verdict([("acceptance", "warn"), ("lossless", "pass")]))
        == "eagle3: warn (acceptance)"
    )
    assert sub_run_line("ngram", *check_verdict([("lossless", "pass")])) == "ngram: pass"


def test_the_html_page_links_each_report_and_holds_costs_settings_checks_and_provenance(page):
    root, data = page
    text = (root / "head_to_head.html").read_text()
    for name in ("eagle3", "ngram"):
        assert f"href='{name}/report.html'" in text
    assert "decode 20.0 ms [19.0, 21.0]" in text and "K=3 4.000 ms [3.900, 4.100]" in text  # costs with their spread
    assert "<polyline" in text  # the curves, drawn offline
    assert "2026-12-01T10:00:00+00:00" in text and "NVIDIA H200" in text and "9.9.9" in text
    assert "acceptance (warn): acceptance said warn; eagle3-config (warn)" in text
    # the decisive verdict's setting per engine, at the verdict's K, for the EAGLE-3 head
    assert "to deploy eagle3 at K=3:" in text
    assert html.escape('"method": "eagle3"') in text and html.escape('"num_speculative_tokens": 3') in text
    assert "--speculative-algorithm EAGLE3" in text and "--speculative-num-draft-tokens 4" in text
    # the undecided class names the leader's setting as a choice, not a decision
    assert "if you deploy the leader anyway (eagle3 at K=2; not decided):" in text
    assert (
        "dflash-doctor check --target ../models/target --draft ../models/head --max-new-tokens 64 --k 1-4 --device cuda"
        in text
    )
    saved = read_head_to_head(root)
    assert saved == data and saved.speculators[0].sub_run is not None and saved.speculators[0].sub_run.verdict == "warn"


def test_a_relative_out_links_each_report_from_the_head_to_head_folder(tmp_path, monkeypatch):
    """`--out runs/h2h` names the sub-runs from the working folder (runs/h2h/eagle3); the page lies in
    runs/h2h, so its links must read eagle3/report.html, not runs/h2h/eagle3/report.html; a `--target`
    typed relative to the working folder is named from the head-to-head folder in the commands too."""
    monkeypatch.chdir(tmp_path)
    root = Path("runs") / "h2h"
    data = _head_to_head(root, {"eagle3": [], "ngram": []})
    (tmp_path / "models" / "target").mkdir(parents=True)
    record = json.loads((root / "ngram" / RUN_JSON).read_text())
    record["config"]["target"] = "models/target"
    (root / "ngram" / RUN_JSON).write_text(json.dumps(record))
    described = describe_sub_runs(root, HeadToHead.from_json(data))
    runs = {s.name: s.sub_run for s in described.speculators if s.sub_run}
    assert [(r.folder, r.report) for r in runs.values()] == [
        ("eagle3", "eagle3/report.html"),
        ("ngram", "ngram/report.html"),
    ]
    assert "--target ../../models/target " in runs["ngram"].command


def _not_a_record(path: Path) -> None:
    path.write_text(json.dumps(["not", "a", "run", "record"]))


def _older_record(path: Path) -> None:  # an untyped run.json of schema 1, before the typed run record
    record = json.loads(path.read_text())
    record["schema_version"] = 1
    path.write_text(json.dumps(record))


def _check_without_status(path: Path) -> None:
    record = json.loads(path.read_text())
    del record["checks"][0]["status"]
    path.write_text(json.dumps(record))


@pytest.mark.parametrize("spoil", [_not_a_record, _older_record, _check_without_status])
def test_a_sub_run_whose_run_json_is_not_a_run_record_is_the_readers_one_sentence(tmp_path, spoil):
    """A sub-run's run.json that is there but unreadable is answered as every view answers it (the loader's
    UsageError naming the file and the fix), not described from whatever keys it happens to hold; a sub-run
    with no run.json at all is still left undescribed."""
    root = tmp_path / "h2h"
    data = _head_to_head(root, {"eagle3": [("lossless", "pass")], "ngram": [("lossless", "pass")]})
    spoil(root / "eagle3" / RUN_JSON)
    with pytest.raises(UsageError) as expected:
        read_run_meta(root / "eagle3")
    with pytest.raises(UsageError) as caught:
        describe_sub_runs(root, HeadToHead.from_json(data))
    assert str(caught.value) == str(expected.value)
    assert str(root / "eagle3" / RUN_JSON) in str(caught.value) and "re-run" in str(caught.value)
    (root / "eagle3" / RUN_JSON).unlink()
    described = describe_sub_runs(root, HeadToHead.from_json(data))
    assert [s.sub_run is not None for s in described.speculators] == [False, True]


def test_no_page_carries_an_absolute_path(page):
    root, _ = page
    for name in ("head_to_head.html", "head_to_head.md"):
        text = (root / name).read_text()
        assert str(root.parent.parent) not in text, name
        assert not re.search(r"(?<![\w.])/(tmp|home|work|Users|root)/", text), name


def test_the_settings_count_k_as_the_single_checks_advice_does():
    """vLLM and llama.cpp count the drafted tokens, SGLang the anchor too: the same numbers as speculative-k's fix."""
    for k in (1, 3, 7):
        fix = SpeculativeKCheck._fix("overall", k)
        numbers = re.findall(
            r"num_speculative_tokens=(\d+).*--speculative-num-draft-tokens (\d+).*--spec-draft-n-max (\d+)", fix
        )[0]
        dflash = engine_settings("dflash", "x", {}, k)
        assert f'"num_speculative_tokens": {numbers[0]}' in dflash["vLLM"]
        assert f"--speculative-num-draft-tokens {numbers[1]}" in dflash["SGLang"]
        assert f"--spec-draft-n-max {numbers[2]}" in dflash["llama.cpp"]
    ngram = engine_settings("ngram", "ngram", {"prompt_lookup_min": 2, "prompt_lookup_max": 5, "max_model_len": 9}, 4)
    assert json.loads(ngram["vLLM"].split("'")[1]) == {
        "method": "ngram",
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 5,
        "num_speculative_tokens": 4,
    }
    assert json.loads(engine_settings("mtp", "mtp", {}, 2)["vLLM"].split("'")[1]) == {
        "method": "mtp",
        "num_speculative_tokens": 2,
    }
    assert "serve it with vLLM" in ngram["SGLang"]


def test_hostile_names_stay_text_in_both_pages(tmp_path):
    root = tmp_path / "h2h"
    data = _head_to_head(root, {"eagle3": [(HOSTILE, "warn")], "ngram": [("lossless", "pass")]})
    for speculator in data["speculators"]:
        speculator["name"] = speculator["name"] + HOSTILE
    for scope in data["scopes"].values():
        for row in scope["rows"]:
            row["speculator"] += HOSTILE
        scope["verdict"]["winner"] += HOSTILE
    described = describe_sub_runs(root, HeadToHead.from_json(data))
    page_html, page_md = html_page(described), markdown(described)
    assert "<script>" not in page_html and "&lt;script&gt;" in page_html
    assert "<script>" not in page_md and "](http" not in page_md


def test_the_dashboard_page_shows_the_settings_sub_runs_and_commands(page, tmp_path, monkeypatch):
    root, data = page
    shown = tmp_path / "dashboard" / "h2h"
    shown.mkdir(parents=True)
    (shown / HEAD_TO_HEAD_JSON).write_text((root / HEAD_TO_HEAD_JSON).read_text())
    app = open_app(monkeypatch, shown.parent, page="head_to_head")
    code = "\n".join(str(block.value) for block in app.code)
    assert '"method": "eagle3"' in code and "--speculative-num-draft-tokens 4" in code
    assert "dflash-doctor check --target ../models/target" in code
    assert "20.0 ms [19.0, 21.0]" in code
    runs = app.dataframe[1].value
    assert runs["verdict"].tolist() == ["warn", "pass"]
    assert runs["report"].tolist() == ["eagle3/report.html", "ngram/report.html"]


@pytest.fixture(scope="module")
def cli_run(tiny_dir, tmp_path_factory):
    """One head-to-head of the tiny pair's DFlash draft and n-gram lookup, priced with a profile, --fail-on warn."""
    root = tmp_path_factory.mktemp("h2h_page")
    profile = root / "costs.json"
    profile.write_text(
        json.dumps({"t_decode_s": 0.010, "t_verify_s": {"1": 0.011, "2": 0.012}, "t_draft_s": {"1": 0.001, "2": 0.002}})
    )
    result = invoke(
        "check",
        *pair_args(
            tiny_dir,
            tiny_dir / "dflash",
            "--draft",
            "ngram:prompt_lookup_min=1,prompt_lookup_max=3",
            "--cost-profile",
            profile,
            "--k",
            "1-2",
            "--fail-on",
            "warn",
            "--out",
            root / "h2h",
        ),
    )
    return root / "h2h", result


def test_the_terminal_names_each_sub_runs_verdict_and_the_exit_code_follows_fail_on(cli_run):
    root, result = cli_run
    verdicts = {}
    for name in ("dflash", "ngram"):
        record = json.loads((root / name / RUN_JSON).read_text())
        verdict, flagged = check_verdict((c["id"], c["status"]) for c in record["checks"])
        verdicts[name] = verdict
        assert f"{sub_run_line(name, verdict, flagged)}: {root / name}/report.html" in " ".join(result.output.split())
    assert "checks pass" not in result.output
    assert any(v in ("warn", "fail") for v in verdicts.values()), verdicts  # the tiny pair's acceptance is poor
    assert result.exit_code == 1, result.output  # a warning anywhere with --fail-on warn


def test_the_written_page_links_each_sub_run_of_a_real_head_to_head(cli_run):
    root, _ = cli_run
    text = (root / "head_to_head.html").read_text()
    for name in ("dflash", "ngram"):
        assert f"href='{name}/report.html'" in text and (root / name / "report.html").is_file()
    assert str(root) not in text and str(root) not in (root / "head_to_head.md").read_text()
    data = read_head_to_head(root)
    assert [s.sub_run.verdict for s in data.speculators if s.sub_run is not None] == [
        check_verdict((c["id"], c["status"]) for c in json.loads((root / n / RUN_JSON).read_text())["checks"])[0]
        for n in ("dflash", "ngram")
    ]


def test_a_copied_page_still_renders_without_the_sub_run_facts(page):
    """A head-to-head whose sub-runs were not there to describe (no sub-run facts) still renders: the pages
    leave those sections out."""
    _, data = page
    older = replace(data, speculators=[replace(s, sub_run=None) for s in data.speculators])
    assert "Sub-runs" not in html_page(older) and "Verdict" in markdown(older)
