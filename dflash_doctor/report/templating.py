"""The jinja2 environments of every exported view, and the number formats they share.

HTML templates autoescape everything (token text, prompts and check evidence come from models and
users: untrusted). Markdown has no autoescape of its own, so the Markdown environment escapes every
``{{ expression }}`` through :func:`markdown_cell` (HTML-special characters, table pipes, newlines):
GitHub renders raw HTML inside Markdown, so a token ``<img onerror=...>`` would otherwise become markup
in a PR comment.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import jinja2
from markupsafe import Markup
from dflash_doctor.report.sanitize import inert

TEMPLATE_PACKAGE = "dflash_doctor"
TEMPLATE_DIR = "data/templates"
MISSING = "n/a"


def _is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and not math.isfinite(value))


def fmt(value: Any, digits: int = 2) -> str:
    """A number with ``digits`` decimals; ``n/a`` for None/NaN (undefined ratios in run.json are null)."""
    return MISSING if _is_missing(value) else f"{float(value):.{digits}f}"


def pct(value: Any, digits: int = 1) -> str:
    return MISSING if _is_missing(value) else f"{100.0 * float(value):.{digits}f}%"


def ci(interval: Any, digits: int = 2) -> str:
    """``[lo, hi]`` formatted, or ``n/a`` when the interval is missing."""
    if not interval or any(_is_missing(v) for v in interval):
        return MISSING
    lo, hi = interval
    return f"[{float(lo):.{digits}f}, {float(hi):.{digits}f}]"


def signed(value: Any, digits: int = 2) -> str:
    return MISSING if _is_missing(value) else f"{float(value):+.{digits}f}"


def token(text: Any) -> str:
    """A token's text as a quoted literal, so spaces, newlines and empty strings stay visible."""
    return repr("" if text is None else str(text))


def markdown_cell(value: Any) -> Any:
    """Escape one interpolated value for a Markdown table or paragraph (``finalize`` of the md env)."""
    if value is None:
        return ""
    if isinstance(value, Markup):
        return value
    text = inert(value)  # control characters shown as escapes (report/sanitize.py)
    # "](" is where an inline link or image ends its text: "]\\(" keeps ``![x](http://tracker/p.png)`` a string
    # (no request to that host when the report is viewed) while brackets of intervals stay as they are
    for raw, escaped in (("&", "&amp;"), ("<", "&lt;"), (">", "&gt;"), ("|", "\\|"), ("`", "\\`"), ("](", "]\\(")):
        text = text.replace(raw, escaped)
    return " ".join(text.split("\n"))


def _register(env: jinja2.Environment) -> jinja2.Environment:
    env.filters.update(fmt=fmt, pct=pct, ci=ci, signed=signed, token=token)
    env.trim_blocks = True
    env.lstrip_blocks = True
    return env


def html_text(value: Any) -> Any:
    """Untrusted text of an HTML expression made inert before autoescape (``finalize`` of the html env):
    control characters shown as escapes; markup built by us (:class:`Markup`) and non-text values pass."""
    return inert(value) if isinstance(value, str) and not isinstance(value, Markup) else value


@lru_cache(maxsize=None)
def html_env() -> jinja2.Environment:
    """Environment for ``*.html`` templates: autoescape always on, control characters inert."""
    return _register(
        jinja2.Environment(
            loader=jinja2.PackageLoader(TEMPLATE_PACKAGE, TEMPLATE_DIR),
            autoescape=True,
            finalize=html_text,
            undefined=jinja2.StrictUndefined,
        )
    )


@lru_cache(maxsize=None)
def markdown_env() -> jinja2.Environment:
    """Environment for ``*.md`` templates: every expression goes through :func:`markdown_cell`."""
    return _register(
        jinja2.Environment(
            loader=jinja2.PackageLoader(TEMPLATE_PACKAGE, TEMPLATE_DIR),
            autoescape=False,
            finalize=markdown_cell,
            undefined=jinja2.StrictUndefined,
            keep_trailing_newline=True,
        )
    )
