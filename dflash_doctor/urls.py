"""URLs as the tool stores and shows them: credentials written into a URL (``http://user:pw@host``) serve the
request they came with and nothing else, so every URL that reaches a message, a log, run.json or a table goes
through :func:`shown`. The foundation layer, because inputs (config files) and sources (the HTTP client, watch)
both need it.
"""

from __future__ import annotations

import urllib.parse


def without_userinfo(url: str) -> tuple[str, tuple[str, str] | None]:
    """The URL without ``user:password@`` and those credentials (None when it has none)."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, None
    host = parts.netloc.rpartition("@")[2]
    auth = (urllib.parse.unquote(parts.username or ""), urllib.parse.unquote(parts.password or ""))
    return urllib.parse.urlunsplit(parts._replace(netloc=host)), auth


def shown(url: str) -> str:
    """A URL as messages show it: without its query and without credentials."""
    return without_userinfo(url.split("?")[0])[0]
