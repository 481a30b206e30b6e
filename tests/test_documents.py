"""The repository's Markdown stands alone: every relative link reaches a file in the repository and, where
it names one, a heading of that file; and nothing points a reader to notes the repository does not hold.

Read from ``git ls-files`` (what a clone has), so a page that exists only on one machine counts as missing.
Anchors follow GitHub's rule: the heading lowercased, characters other than letters, digits, ``-``, ``_``
and spaces dropped, spaces made ``-``, and ``-1``, ``-2``... added to repeated headings.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", flags=re.MULTILINE | re.DOTALL)
# notes the project was planned from, which a clone does not have
OUTSIDE_NOTES = re.compile(r"\b(DESIGN|ENGINES|REFERENCE|STYLE)\.md\b")


def _tracked(pattern: str) -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-z", "--", pattern], cwd=REPO, capture_output=True, check=True).stdout
    return [REPO / name for name in listed.decode().split("\0") if name]


def github_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings of ``markdown`` (fenced code is not headings)."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for line in FENCE.sub("", markdown).splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading is None:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1)).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_github_anchors_follow_githubs_rule():
    page = (
        "# dflash-doctor\n## The run directory\n```\n# not a "
        "heading\n```\n## `tune` on vLLM: K x load\n## GPU\n## GPU\n"
    )
    assert github_anchors(page) == {"dflash-doctor", "the-run-directory", "tune-on-vllm-k-x-load", "gpu", "gpu-1"}


# the documents a reader follows links in; a recorded program output under tests/fixtures/ links the sub-run folders
# it was written beside, which are not kept
MARKDOWN = [path for path in _tracked("*.md") if not path.is_relative_to(REPO / "tests" / "fixtures")]


@pytest.mark.parametrize("page", MARKDOWN, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_reaches_a_file_and_heading_of_the_repository(page):
    tracked = {path.resolve() for path in _tracked(".")}
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page.resolve()
        if linked.is_dir() and any(p.is_relative_to(linked) for p in tracked):
            continue
        if linked not in tracked:
            broken.append(f"{target}: no such file in the repository")
        elif anchor and linked.suffix == ".md" and anchor not in github_anchors(linked.read_text(encoding="utf-8")):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, broken


def test_no_file_points_to_notes_outside_the_repository():
    texts = [path for pattern in ("*.md", "*.py", "*.sh", "*.toml") for path in _tracked(pattern)]
    pointing = [
        f"{path.relative_to(REPO)}:{number}"
        for path in texts
        if path != Path(__file__).resolve()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if OUTSIDE_NOTES.search(line)
    ]
    assert not pointing, pointing


# words that point outside the repository: the tracker's issues ("issue 49", "the issue's case", "Issue-12"), the
# lent development machines ("lent", "leases") and absolute paths of a development machine's home or work folders
OUTSIDE_WORDS = re.compile(
    r"\bissues?[- ]?#?\d+\b|\bthe issue'?s\b|\bthis issue\b|\blease[sd]?\b|\blent\b"
    r"|(?<![\w.~$/-])/(home|work|Users|root)/",
    flags=re.IGNORECASE,
)


def test_outside_words_are_found_in_any_case():
    for line in (
        "Issue-12 rules",
        "see ISSUE 49",
        "the Issue's case",
        "a lease of the machine",
        "/work/main/x",
        "/home/me",
    ):
        assert OUTSIDE_WORDS.search(line), line
    for line in ("vllm-project/vllm#41559", "transformers #45307", "~/.cache/dflash-doctor", "issues a warning"):
        assert not OUTSIDE_WORDS.search(line), line


def test_no_file_or_shipped_json_speaks_of_issues_leases_or_a_machines_paths():
    """Markdown, code, scripts, TOML and every JSON file shipped in the package (demo cards and logs included)."""
    texts = [
        path for pattern in ("*.md", "*.py", "*.sh", "*.toml", "dflash_doctor/**.json") for path in _tracked(pattern)
    ]
    assert any(path.suffix == ".json" for path in texts)  # the shipped demo logs are read
    found = [
        f"{path.relative_to(REPO)}:{number}: {match.group(0)}"
        for path in texts
        if path != Path(__file__).resolve()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        for match in [OUTSIDE_WORDS.search(line)]
        if match
    ]
    assert not found, found
