"""Text from a server or a run file is escaped for Markdown on every dashboard surface (AppTest, no
browser): a model name from /metrics that spells an image or a link reaches Streamlit's Markdown only
with its markup backslash-escaped, in the Production page's caption, alert banner, expander labels,
alert messages and source notes. tests/test_dashboard_browser.py holds the same in a real Chromium."""

from __future__ import annotations

import re

import pytest

from dashboard_app import open_app
from telemetry_fixtures import write_watch

#: Hostile labels, one per Markdown construct that could fetch, link or restyle.
HOSTILE = [
    "![x](http://127.0.0.1:9/pixel)",
    "[click](http://evil.example/)",
    "<img src=http://127.0.0.1:9/html>",
    "<a href='http://evil.example/'>a</a>",
    "**bold** __under__ ~~strike~~",
    "`code` $x^2$",
    "| table | cell |",
    "line\nbreak # heading",
    "\\[escaped\\](http://evil.example/)",
    "https://evil.example/autolink www.evil.example",
]

#: Markup that survived escaping: a link or image target, an HTML tag, emphasis, code, math, a table cell, a heading.
_LIVE_MARKUP = re.compile(
    r"(?<!\\)\]\(|(?<!\\)<[a-z/]|(?<!\\)\*\*bold|(?<!\\)__under|(?<!\\)~~strike|(?<!\\)`code|(?<!\\)\$x|(?<!\\)\| "
    r"table|\n# heading|https?://evil|(?<!\\)www\.evil"
)
_WORDS = ("evil", "127.0.0.1", "bold", "code", "cell", "heading", "escaped")


def _markdown_sources(at) -> list[str]:
    sources = [
        element.value
        for kind in ("markdown", "caption", "error", "warning", "info", "success")
        for element in getattr(at, kind)
    ]
    sources += [expander.label for expander in at.expander]
    return sources


@pytest.mark.parametrize("label", HOSTILE)
def test_production_page_escapes_server_labels(monkeypatch, tmp_path, label):
    runs = tmp_path / "runs"
    watch = write_watch(
        runs / "watch",
        [0.6, 0.35, 0.2, 0.1],
        baseline_tau=3.0,
        num_units=2,
        model=label,
        notes=(f"source note {label}",),
    )
    at = open_app(monkeypatch, runs, watch, "production")
    sources = _markdown_sources(at)
    carrying = [text for text in sources if any(word in text for word in _WORDS)]
    assert len(carrying) >= 3, sources  # the label is shown: alert banner, expander labels, messages, notes
    for text in carrying:
        assert not _LIVE_MARKUP.search(text), f"live markup from a server label in {text!r}"
