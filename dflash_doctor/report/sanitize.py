"""Text from users and models made inert for each output format.

Class names, request ids, prompts, token text, model paths and the check messages quoting them come
from users and models: untrusted. Each format has its own hazard:

* terminal: ESC / CSI / OSC sequences retitle the window, clear the screen or hide text, and Rich reads
  ``[...]`` as markup: :func:`for_terminal`;
* JUnit XML: XML 1.0 has no escape for most control characters (``\\x00``, ``\\x1b``...), so one of them
  makes the whole file unreadable to the CI: :func:`for_xml`;
* Markdown: see :func:`dflash_doctor.report.templating.markdown_cell` (HTML-special characters, pipes,
  backticks), which applies :func:`inert` first;
* HTML and the dashboard escape markup themselves (jinja autoescape, Streamlit); JSON escapes control
  characters itself.

Nothing is deleted: a control character is shown as its escape (``\\x1b``), so the evidence stays
readable and exact.
"""

from __future__ import annotations

import re
from typing import Any

from rich.markup import escape

# C0 controls except tab and newline, DEL, C1 controls; surrogates and U+FFFE/U+FFFF (not XML characters)
_NOT_INERT = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff\ufffe\uffff]")


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def inert(value: Any) -> str:
    """``value`` as text with every control character (and every character XML cannot hold) written as
    its escape: ``"a\\x1b[31m"`` shows as ``a\\x1b[31m`` and colours nothing."""
    return _NOT_INERT.sub(_escaped, "" if value is None else str(value))


def for_terminal(value: Any) -> str:
    """Untrusted text for a Rich console or table cell: inert, with Rich markup escaped."""
    return escape(inert(value))


def for_xml(value: Any) -> str:
    """Untrusted text for an XML attribute or text node (ElementTree escapes ``<&>"`` itself)."""
    return inert(value)


# Markdown's punctuation that can start markup inside a sentence: a link or image ([ ]), emphasis (* _ ~),
# code (`), HTML (< >), a table cell (|), Streamlit's $ math, and the escape itself
_MARKDOWN_SPECIALS = re.compile(r"([\\`*_\[\]<>|~$&])")


def for_markdown_text(value: Any) -> str:
    """Untrusted text inside a Markdown sentence (the dashboard's captions, boxes and expander labels):
    inert, every markup character backslash-escaped, and on one line. A bare URL is broken by a zero-width
    space after its scheme's colon (and inside ``www.``): Streamlit's Markdown links every ``http://`` and
    ``www.`` it finds in the rendered text, past backslash escapes and character references alike (Chromium
    showed both as links), and the reader still sees the same characters."""
    escaped = " ".join(_MARKDOWN_SPECIALS.sub(r"\\\1", inert(value)).split("\n"))
    return escaped.replace("://", ":\u200b//").replace("www.", "www\u200b.")
