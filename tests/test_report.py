"""Exported reports of a fixture run: golden report.json / report.md, junit.xml shape, Markdown
escaping, edge-case runs, and `dflash-doctor report` exit codes. (Browser checks of report.html
live in test_report_browser.py.)"""

from __future__ import annotations

import json
import math
import os
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_doctor.cli import app
from dflash_doctor.report import FILENAMES, FORMATS, parse_formats, render_json, render_markdown, render_reports
from dflash_doctor.errors import UsageError
from dflash_doctor.rundir.load import load_run
from fixture_runs import HOSTILE_TOKEN_TEXT, make_fixture_run

GOLDEN_DIR = Path(__file__).parent / "golden"
REFRESH_ENV = "DFLASH_DOCTOR_REFRESH_GOLDEN"
FLOAT_REL_TOL = 1e-6
MARKDOWN_NUMBER_ABS_TOL = 0.011  # one unit in the last printed decimal (2 decimals), plus rounding
_NUMBER = re.compile(r"-?\d+\.\d+")


@pytest.fixture(scope="module")
def fixture_run(tmp_path_factory) -> Path:
    # a fixed folder name: it is the run name inside report.json / report.md
    return make_fixture_run(tmp_path_factory.mktemp("runs") / "fixture-run", seed=0)


def _refresh_or_read(name: str, text: str) -> str:
    path = GOLDEN_DIR / name
    if os.environ.get(REFRESH_ENV) == "1":
        path.write_text(text, encoding="utf-8")
    return path.read_text(encoding="utf-8")


def _assert_close(actual, expected, where="$"):
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and sorted(actual) == sorted(expected), f"{where}: keys differ"
        for key in expected:
            _assert_close(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), f"{where}: lengths differ"
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_close(a, e, f"{where}[{i}]")
    elif isinstance(expected, float) and not isinstance(actual, bool):
        assert isinstance(actual, (int, float)) and math.isclose(
            actual, expected, rel_tol=FLOAT_REL_TOL, abs_tol=1e-12
        ), f"{where}: {actual} != {expected}"
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def test_golden_refresh_switch_is_off():
    assert os.environ.get(REFRESH_ENV) != "1", (
        f"unset {REFRESH_ENV}: it rewrites the golden files instead of checking them"
    )


def test_report_json_matches_golden(fixture_run):
    actual = json.loads(render_json(load_run(fixture_run)))
    expected = json.loads(_refresh_or_read("report.json", render_json(load_run(fixture_run))))
    _assert_close(actual, expected)


def test_report_md_matches_golden(fixture_run):
    actual = render_markdown(load_run(fixture_run))
    expected = _refresh_or_read("report.md", actual)
    assert _NUMBER.split(actual) == _NUMBER.split(expected), (
        "report.md text (numbers aside) differs from tests/golden/report.md"
    )
    for a, e in zip(_NUMBER.findall(actual), _NUMBER.findall(expected), strict=True):
        assert abs(float(a) - float(e)) <= MARKDOWN_NUMBER_ABS_TOL, f"report.md number {a} != golden {e}"


def test_report_json_keys_are_sorted_and_verdict_follows_checks(fixture_run):
    text = render_json(load_run(fixture_run))
    payload = json.loads(text)
    assert list(payload) == sorted(payload)
    assert payload["verdict"] == "fail"  # the fixture has a failing layer_offset check
    assert payload["check_counts"] == {"pass": 1, "warn": 1, "fail": 1, "skip": 1, "error": 1}
    assert (
        payload["summary"]["by_class"]["math"]["mean_acceptance_length"]
        > payload["summary"]["by_class"]["chat"]["mean_acceptance_length"]
    )


def test_junit_has_the_shape_ci_tools_parse(fixture_run, tmp_path):
    (path,) = render_reports(fixture_run, formats=("junit",), out_dir=tmp_path)
    root = ET.parse(path).getroot()
    checks = load_run(fixture_run).meta["checks"]
    assert root.tag == "testsuites"
    suites = root.findall("testsuite")
    assert len(suites) == 1
    suite = suites[0]
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == [c["id"] for c in checks]
    assert all(c.get("classname") and c.get("time") is not None for c in cases)
    for element in (root, suite):
        assert int(element.get("tests")) == len(cases)
        assert int(element.get("failures")) == sum(1 for c in cases if c.find("failure") is not None)
        assert int(element.get("errors")) == sum(1 for c in cases if c.find("error") is not None)
        assert int(element.get("skipped")) == sum(1 for c in cases if c.find("skipped") is not None)
    by_name = {c.get("name"): c for c in cases}
    for check in checks:
        case = by_name[check["id"]]
        children = {child.tag for child in case} - {"system-out"}
        expected = {"fail": {"failure"}, "error": {"error"}, "skip": {"skipped"}}.get(check["status"], set())
        assert children == expected, check["id"]
    assert "fix: Shift target_layer_ids" in by_name["layer_offset"].find("failure").text


def test_markdown_escapes_untrusted_text(tmp_path):
    run_dir = make_fixture_run(tmp_path / "hostile", num_requests=3)
    meta_path = run_dir / "run.json"
    meta = json.loads(meta_path.read_text())
    meta["checks"][1]["findings"][0]["message"] = f"token {HOSTILE_TOKEN_TEXT} | <img src=x onerror=alert(1)>"
    meta_path.write_text(json.dumps(meta))
    text = render_markdown(load_run(run_dir))
    assert "<script>" not in text and "<img" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt; \\| &lt;img" in text


def test_empty_run_and_run_without_sweep_render_every_format(tmp_path):
    for name, kwargs in (("empty", dict(num_requests=0)), ("nosweep", dict(with_sweep=False))):
        run_dir = make_fixture_run(tmp_path / name, **kwargs)
        paths = render_reports(run_dir, out_dir=tmp_path / f"{name}-out")
        assert [p.name for p in paths] == [FILENAMES[f] for f in FORMATS]
        markdown = (tmp_path / f"{name}-out" / "report.md").read_text()
        assert "No K sweep in this run" in markdown
        html = (tmp_path / f"{name}-out" / "report.html").read_text()
        assert "This run has no K sweep" in html and 'id="chart-speedup-by-k"' in html


def test_html_embeds_plotly_once_and_escapes_tokens(fixture_run, tmp_path):
    (path,) = render_reports(fixture_run, formats=("html",), out_dir=tmp_path)
    html = path.read_text()
    assert html.count("plotly.js v") == 1  # the bundle's banner: embedded once, not per chart
    assert not re.search(r"<script[^>]+src=", html)
    assert HOSTILE_TOKEN_TEXT not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html


def cdn_script_tag() -> str:
    """The tag a page loading plotly.js from its CDN must carry: the installed plotly's bundle version,
    pinned by that bundle's SHA-256 (subresource integrity), computed here independently of the renderer."""
    import base64
    import hashlib

    import plotly.offline

    bundle = plotly.offline.get_plotlyjs().encode("utf-8")
    integrity = "sha256-" + base64.b64encode(hashlib.sha256(bundle).digest()).decode()
    return (
        f'<script charset="utf-8" src="https://cdn.plot.ly/plotly-{plotly.offline.get_plotlyjs_version()}.min.js" '
        f'integrity="{integrity}" crossorigin="anonymous"></script>'
    )


def test_plotly_cdn_links_plotly_js_instead_of_embedding_it(fixture_run, tmp_path):
    for source in ("inline", "cdn"):
        result = CliRunner().invoke(
            app, ["report", str(fixture_run), "--format", "html", "--plotly", source, "--out", str(tmp_path / source)]
        )
        assert result.exit_code == 0, result.output
    inline, cdn = ((tmp_path / source / "report.html").read_text() for source in ("inline", "cdn"))
    assert len(inline.encode()) > 4_000_000 and len(cdn.encode()) < 500_000  # the 4.6 MB bundle is the difference
    assert re.findall(r"<script[^>]*\bsrc=[^>]*></script>", cdn) == [cdn_script_tag()]  # one script tag loads plotly.js
    assert "plotly.js v" not in cdn and inline.count("plotly.js v") == 1
    assert cdn.count("Plotly.newPlot(") == inline.count("Plotly.newPlot(") > 0  # the same charts either way


def test_plotly_source_is_a_doctor_toml_key_validated_before_any_work(tmp_path):
    from dflash_doctor.inputs.config import build_config

    toml = tmp_path / "doctor.toml"
    toml.write_text('plotly = "cdn"\n')
    assert build_config(toml).plotly == "cdn" and build_config(toml, plotly="inline").plotly == "inline"
    with pytest.raises(UsageError, match="--plotly 'web' is not a plotly.js source; use inline or cdn."):
        build_config(plotly="web")


def test_parse_formats_accepts_lists_and_refuses_unknown_names():
    assert parse_formats("md, html,md") == ("md", "html")
    with pytest.raises(UsageError, match="--format pdf"):
        parse_formats("html,pdf")


def test_report_cli_writes_requested_formats(fixture_run, tmp_path):
    result = CliRunner().invoke(app, ["report", str(fixture_run), "--format", "md,junit", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["junit.xml", "report.md"]


@pytest.mark.parametrize(
    "args", [["report", "{missing}"], ["report", "{run}", "--format", "pdf"], ["report", "{run}", "--plotly", "web"]]
)
def test_report_cli_bad_input_exits_2_with_one_sentence(fixture_run, tmp_path, args):
    args = [a.format(missing=tmp_path / "nope", run=fixture_run) for a in args]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "Error" in result.output
