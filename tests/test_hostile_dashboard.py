"""The dashboard against hostile runs (the class "dashboard and readers"), through AppTest (no browser).

* Every string a page takes from a run directory, tune.json or an upload reaches Streamlit's Markdown (bodies,
  labels, ``help=`` tooltips, expander labels) only escaped: each page is driven on a run whose every string
  field, class name and request id spells an image, a link or HTML, and no rendered Markdown source may hold
  live markup (tests/test_dashboard_escaping.py does the same for the Production page's server labels).
* One run.json with a null field in the runs folder is one refused run named in the sidebar; the others render.
* A damaged zip upload is one sentence in the sidebar; the session's upload folder goes when the session does.
"""

from __future__ import annotations

import gc
import io
import json
import shutil
import zipfile
from pathlib import Path
from typing import Any

import pytest
from streamlit.testing.v1 import AppTest

from dashboard_app import open_app
from fixture_runs import make_fixture_run
from test_dashboard_escaping import _LIVE_MARKUP

from dflash_doctor.app import data
from dflash_doctor.errors import UsageError

#: One string per Markdown hazard: an image that fetches, a link, raw HTML, and blank lines that end a code span.
HOSTILE = (
    "x\n\n![x](http://127.0.0.1:9/pixel-md.png) [click](http://evil.example/) <img src=http://127.0.0.1:9/h.png>"
    "\n\n`code` **bold**"
)
#: Fields whose values are a fixed vocabulary the record refuses otherwise (a check status, a finding severity...).
_VOCABULARY = {"schema_version", "status", "severity", "kind", "estimate", "confidence", "created_at", "source"}
#: Element types whose text Streamlit shows as text (code blocks, st.text, JSON, tables, charts).
_PLAIN = {"code", "text", "json", "arrow_data_frame", "plotly_chart", "html"}
PAGES = ("overview", "rejection", "positions", "deviations", "tokens", "sweep", "compare")


def _hostile_strings(value: Any, key: str = "") -> Any:
    """``value`` with every string leaf outside :data:`_VOCABULARY` replaced by :data:`HOSTILE`."""
    if isinstance(value, dict):
        return {k: v if k in _VOCABULARY else _hostile_strings(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_hostile_strings(v, key) for v in value]
    return HOSTILE if isinstance(value, str) else value


@pytest.fixture(scope="module")
def hostile_runs(tmp_path_factory) -> dict[str, Path]:
    """Two runs whose class names and request ids are hostile and whose run.json strings all are."""
    root = tmp_path_factory.mktemp("hostile-runs")
    classes = ("![c](http://127.0.0.1:9/class.png)", "<img src=http://127.0.0.1:9/c2.png>", "[k](http://evil.example/)")
    runs = {"root": root}
    for name, seed in (("new", 0), ("base", 1)):
        run = make_fixture_run(root / name, seed=seed, num_requests=6, classes=classes)
        meta = json.loads((run / "run.json").read_text())
        meta = {**_hostile_strings(meta), "created_at": meta["created_at"]}
        (run / "run.json").write_text(json.dumps(meta))
        runs[name] = run
    return runs


def _markdown_sources(at: AppTest) -> list[str]:
    """Every Markdown source the page hands Streamlit: bodies, labels and tooltips of every element and block."""
    found: list[str] = []

    def strings(message) -> None:
        for descriptor, value in message.ListFields():
            if descriptor.name in ("body", "label", "help", "placeholder") and isinstance(value, str):
                found.append(value)
            elif hasattr(value, "ListFields"):
                strings(value)
            elif descriptor.message_type is not None:  # a repeated message field
                for item in value:
                    strings(item)

    def walk(node) -> None:
        if getattr(node, "type", None) not in _PLAIN and getattr(node, "proto", None) is not None:
            strings(node.proto)
        for child in getattr(node, "children", {}).values():
            walk(child)

    walk(at._tree)
    return found


@pytest.mark.parametrize("page", PAGES)
def test_every_page_renders_hostile_run_strings_as_text(monkeypatch, hostile_runs, page):
    at = open_app(monkeypatch, hostile_runs["root"], hostile_runs["new"], page)
    sources = _markdown_sources(at)
    carrying = [text for text in sources if "127.0.0.1" in text or "evil" in text or "bold" in text]
    assert carrying, sources  # the hostile values are on the page
    for text in carrying:
        assert not _LIVE_MARKUP.search(text) and "\n\n" not in text, f"live markup on {page}: {text!r}"


def test_the_recommended_k_tooltip_is_escaped(monkeypatch, hostile_runs):
    at = open_app(monkeypatch, hostile_runs["root"], hostile_runs["new"], "overview")
    tooltip = next(m.proto.help for m in at.metric if m.label == "Recommended K (overall)")
    assert "pixel-md" in tooltip and not _LIVE_MARKUP.search(tooltip), tooltip


def _tune_result(setting: str) -> dict[str, Any]:
    """A tune.json `tune` wrote (tests/fixtures/tune-result-2026-12-04), its engine settings, a server's warning and a
    recommendation's reason replaced by hostile text."""
    result = json.loads(
        (Path(__file__).parent / "fixtures" / "tune-result-2026-12-04" / "concurrency" / "tune.json").read_text()
    )
    result["servers"][0]["warning"] = HOSTILE
    result["recommendation"]["1"]["overall"]["reason"] = HOSTILE
    result["engine_settings"] = {"vllm": setting, "sglang": HOSTILE}
    return result


def test_tune_page_shows_engine_settings_as_text(monkeypatch, tmp_path):
    runs = tmp_path / "runs"
    (runs / "tune").mkdir(parents=True)
    (runs / "tune" / "tune.json").write_text(json.dumps(_tune_result("x\n\n![x](http://127.0.0.1:9/pixel-md.png)\n\n")))
    at = open_app(monkeypatch, runs, page="tune")
    codes = [element.value for element in at.code]
    assert any("pixel-md" in code for code in codes), codes  # the setting is shown, as a code block
    for text in _markdown_sources(at):
        assert not _LIVE_MARKUP.search(text) and "\n\n" not in text, f"live markup on the Tune page: {text!r}"


# ----------------------------------------------------------------------------- one bad run among good ones


@pytest.mark.parametrize(
    "field, value",
    [("created_at", None), ("models.target.revision_or_hash", None), ("summary.overall.acceptance_rate_per_pos", None)],
)
def test_one_bad_run_is_one_refused_run_and_the_others_render(monkeypatch, tmp_path, field, value):
    runs = tmp_path / "runs"
    good = make_fixture_run(runs / "good", num_requests=6)
    make_fixture_run(runs / "other", num_requests=6, seed=1)
    bad = shutil.copytree(good, runs / "bad")
    meta = json.loads((bad / "run.json").read_text())
    node = meta
    *parents, last = field.split(".")
    for key in parents:
        node = node[key]
    node[last] = value
    (bad / "run.json").write_text(json.dumps(meta))
    for page in PAGES:
        at = open_app(monkeypatch, runs, good, page)  # open_app asserts no exception on the page
        sidebar = " ".join(str(element.value) for element in at.sidebar.caption)
        assert "1 folder(s) skipped" in sidebar and "bad" in sidebar and field in sidebar.replace("\\_", "_"), sidebar
        labels = [label.split()[0] for label in at.sidebar.selectbox[0].options]
        assert labels == ["other", "good"] or labels == ["good", "other"], labels


# ----------------------------------------------------------------------------- uploads


def _zip(files: dict[str, bytes], method: int = zipfile.ZIP_DEFLATED) -> bytearray:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=method) as archive:
        for name, payload in files.items():
            archive.writestr(name, payload)
    return bytearray(buffer.getvalue())


def _damaged_zip(files: dict[str, bytes], how: str) -> bytes:
    """A zip of ``files`` damaged the way a transfer, another zip tool or a hostile user damages one.

    Offsets are the zip format's: a local header (PK\\x03\\x04) has its flags at +6, method at +8, name and extra
    lengths at +26 and data at +30+lengths; a central directory entry (PK\\x01\\x02) has flags at +8, method at +10,
    compressed size at +20 and size at +24."""
    stored = how in ("bad crc",)
    raw = _zip(files, zipfile.ZIP_STORED if stored else zipfile.ZIP_DEFLATED)
    local, central = raw.find(b"PK\x03\x04"), raw.find(b"PK\x01\x02")
    name_length, extra_length = (int.from_bytes(raw[at : at + 2], "little") for at in (local + 26, local + 28))
    data = local + 30 + name_length + extra_length
    if how == "corrupt deflate":
        raw[data : data + 8] = bytes(b ^ 0xFF for b in raw[data : data + 8])
    elif how == "bad crc":
        raw[data] ^= 0x01
    elif how == "encrypted":
        raw[local + 6] |= 1
        raw[central + 8] |= 1
    elif how.startswith("method "):
        for offset in (local + 8, central + 10):
            raw[offset : offset + 2] = int(how.split()[1]).to_bytes(2, "little")
    elif how == "central directory size lie":
        raw[central + 24 : central + 28] = (100).to_bytes(4, "little")
    elif how == "central directory offset lie":
        raw[central + 42 : central + 46] = (10**6).to_bytes(4, "little")
    return bytes(raw)


DAMAGES = [
    "corrupt deflate",
    "bad crc",
    "encrypted",
    "method 99",
    "method 97",
    "method 12",
    "central directory size lie",
    "central directory offset lie",
]


@pytest.fixture(scope="module")
def run_files(tmp_path_factory) -> dict[str, bytes]:
    run = make_fixture_run(tmp_path_factory.mktemp("upload") / "run", num_requests=3)
    return {f"run/{path.name}": path.read_bytes() for path in sorted(run.iterdir()) if path.is_file()}


@pytest.mark.parametrize("how", DAMAGES)
def test_a_damaged_zip_upload_is_one_sentence(tmp_path, run_files, how):
    with pytest.raises(UsageError) as raised:
        data.save_upload([("run.zip", _damaged_zip(run_files, how))], tmp_path / "dest")
    message = raised.value.message
    assert message.startswith("run.zip ") and message.endswith(".") and "\n" not in message, message


def _upload_script() -> None:
    import streamlit as st

    from dflash_doctor.app import ui

    ui._register_upload([(name, payload) for name, payload in st.session_state["files"]])


def test_a_damaged_zip_upload_shows_its_sentence_in_the_app(run_files):
    at = AppTest.from_function(_upload_script, default_timeout=60)
    at.session_state["files"] = [("run.zip", _damaged_zip(run_files, "encrypted"))]
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert len(at.error) == 1 and "cannot be unpacked" in at.error[0].value


def test_the_upload_folder_goes_with_its_session(run_files):
    at = AppTest.from_function(_upload_script, default_timeout=60)
    at.session_state["files"] = [("run.zip", bytes(_zip(run_files)))]
    at.run()
    folder = at.session_state["upload_dir"].path
    assert (folder / "run-1" / "run.json").is_file()
    del at
    gc.collect()
    assert not folder.exists()
