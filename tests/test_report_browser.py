"""report.html and compare.html in headless Chromium with the network cut: the page must render every
chart from the embedded plotly.js, log no console error, and show hostile token text as text."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dflash_doctor.report.comparison import compare_runs, write_compare_reports
from dflash_doctor.report import render_reports
from fixture_runs import HOSTILE_TOKEN_TEXT, make_fixture_run

# playwright drives Chromium; a test install without it skips this module with the reason (CONTRIBUTING.md)
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is installed by scripts/setup-dev.sh with Chromium"
)
PlaywrightTimeoutError, sync_playwright = sync_api.TimeoutError, sync_api.sync_playwright

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture(scope="module")
def browser():
    if shutil.which(CHROMIUM) is None:
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (the browser tests need it)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()


def open_offline(browser, path: Path):
    """Open ``path`` with every non-file request aborted; returns (page, console errors, blocked urls)."""
    context = browser.new_context(offline=True)
    blocked: list[str] = []

    def block_network(route):
        if route.request.url.startswith("file://"):
            route.continue_()
        else:
            blocked.append(route.request.url)
            route.abort()

    context.route("**/*", block_network)
    page = context.new_page()
    errors: list[str] = []
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("dialog", lambda dialog: (errors.append(f"dialog opened: {dialog.message}"), dialog.dismiss()))
    page.goto(path.resolve().as_uri(), wait_until="load")
    try:  # newPlot draws asynchronously; the assertions below report what did not render
        page.wait_for_function(
            "() => Array.from(document.querySelectorAll('.plotly-graph-div')).every(d => d.querySelector('.main-svg'))",
            timeout=15_000,
        )
    except PlaywrightTimeoutError:
        pass
    return page, errors, blocked


def _charts_rendered(page) -> tuple[int, int]:
    return page.evaluate(
        "() => [document.querySelectorAll('.plotly-graph-div').length,"
        " Array.from(document.querySelectorAll('.plotly-graph-div')).filter(d => d.querySelector('.main-svg')).length]"
    )


def test_report_html_renders_offline_with_hostile_token_as_text(browser, tmp_path):
    run_dir = make_fixture_run(tmp_path / "run", hostile_token=True)
    (html_path,) = render_reports(run_dir, formats=("html",))
    page, errors, blocked = open_offline(browser, html_path)
    num_charts, num_rendered = _charts_rendered(page)
    assert num_charts == 10 and num_rendered == num_charts  # 6 acceptance and sweep charts, 4 "Why rejected"
    assert errors == [] and blocked == []
    # the hostile string is a token's visible text, and no <script> element came from it
    hostile_spans = page.evaluate(
        "(t) => Array.from(document.querySelectorAll('.viewer .tok')).filter(s => s.textContent === t).length",
        HOSTILE_TOKEN_TEXT,
    )
    assert hostile_spans == 1
    assert page.evaluate("() => document.querySelectorAll('.viewer script').length") == 0
    title = page.evaluate(
        "(t) => Array.from(document.querySelectorAll('.viewer .tok')).find(s => s.textContent === t).title",
        HOSTILE_TOKEN_TEXT,
    )
    assert "target prob" in title and HOSTILE_TOKEN_TEXT in title
    page.context.close()


def test_empty_run_report_renders_every_chart_placeholder(browser, tmp_path):
    run_dir = make_fixture_run(tmp_path / "empty", num_requests=0, with_sweep=False)
    (html_path,) = render_reports(run_dir, formats=("html",))
    page, errors, blocked = open_offline(browser, html_path)
    num_charts, num_rendered = _charts_rendered(page)
    assert num_charts == 6 and num_rendered == num_charts  # no "Why rejected" charts without drafted tokens
    assert errors == [] and blocked == []
    assert "No drafted tokens recorded" in page.inner_text("body")
    page.context.close()


def test_compare_html_renders_offline(browser, tmp_path):
    base = make_fixture_run(tmp_path / "base", seed=0)
    new = make_fixture_run(tmp_path / "new", seed=0, degrade=0.4)
    paths = write_compare_reports(compare_runs(base, new), tmp_path / "cmp")
    html_path = next(p for p in paths if p.suffix == ".html")
    page, errors, blocked = open_offline(browser, html_path)
    num_charts, num_rendered = _charts_rendered(page)
    assert num_charts >= 2 and num_rendered == num_charts
    assert errors == [] and blocked == []
    assert "REGRESSION" in page.inner_text("#verdict")
    page.context.close()
