"""End to end: `dflash-doctor dashboard` serves the real app; headless Chromium opens every page.

Needs Debian's chromium at /usr/bin/chromium and the playwright Python package (never
`playwright install`). Screenshots land in test-artifacts/dashboard/ for a human to look at.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fixture_runs import HOSTILE_TOKEN_TEXT, make_fixture_run
from local_servers import free_port, wait_until_answering
from telemetry_fixtures import write_watch

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
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts" / "dashboard"
SERVER_START_TIMEOUT_S = 90
PAGE_TIMEOUT_MS = 60_000

# url path -> text that must be visible once the page has rendered, and whether it draws a chart
PAGES = {
    "": ("Verdict:", True),
    "rejection": ("Drill into a class", True),
    "positions": ("Weakest slot", True),
    "deviations": ("Costliest first rejections", True),
    "tokens": ("Draft candidates vs target candidates", True),
    "sweep": ("Recommended K per class", True),
    "compare": ("regression", True),
    "head_to_head": ("No head-to-head under", False),  # none in this folder: the page says how to write one
}
# pages about something other than the open run (head-to-heads are folders of runs, picked on the page)
NOT_ABOUT_THE_OPEN_RUN = {"head_to_head"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The CLI serving a folder with a healthy run and a degraded one (opened first: newest name)."""
    root = tmp_path_factory.mktemp("served")
    make_fixture_run(root / "a-base", seed=0, num_requests=12)
    make_fixture_run(root / "b-degraded", seed=1, num_requests=12, degrade=0.35)
    with serving(root) as started:
        yield started


@contextlib.contextmanager
def serving(root: Path):
    """`dflash-doctor dashboard ROOT` on a free port: (url, process, log), stopped on exit."""
    port = free_port()
    log = root / "server.log"  # a file, not a pipe: a full pipe would stall the server mid-test
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from dflash_doctor.cli import main; main()",
            "dashboard",
            str(root),
            "--port",
            str(port),
        ],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    not_started = wait_until_answering(f"{url}/_stcore/health", process, SERVER_START_TIMEOUT_S)
    if not_started is not None:
        os.killpg(process.pid, signal.SIGTERM)
        pytest.fail(f"dashboard did not start: {not_started}: {log.read_text()}")
    try:
        yield url, process, log
    finally:
        os.killpg(process.pid, signal.SIGTERM)  # the CLI and its Streamlit child share this new session
        process.wait(timeout=20)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).is_file(), f"{CHROMIUM} missing: apt-get install -y chromium"
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield chromium
        chromium.close()


def open_page(browser, url: str, path: str, must_see: str):
    page = browser.new_page(
        viewport={"width": 1440, "height": 2400}
    )  # Streamlit scrolls inside the page: a tall window shows it all
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    page.goto(f"{url}/{path}", timeout=PAGE_TIMEOUT_MS)
    page.get_by_text(must_see).first.wait_for(timeout=PAGE_TIMEOUT_MS)
    return page, dialogs


def settle_and_shoot(page, name: str, expect_chart: bool) -> None:
    if expect_chart:
        page.locator(".main-svg").first.wait_for(timeout=PAGE_TIMEOUT_MS)
    page.wait_for_timeout(800)  # let plotly finish its transition before the screenshot
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def test_cli_prints_the_url(server):
    url, process, log = server
    assert process.poll() is None
    assert log.read_text().splitlines()[0].startswith(f"dflash-doctor dashboard: {url}")


@pytest.mark.parametrize("path", list(PAGES))
def test_every_page_renders_in_chromium(server, browser, path):
    url, _, _ = server
    must_see, expect_chart = PAGES[path]
    page, dialogs = open_page(browser, url, path, must_see)
    settle_and_shoot(page, path or "overview", expect_chart)
    body = page.inner_text("body")
    assert ("b-degraded" in body) != (path in NOT_ABOUT_THE_OPEN_RUN)  # a run page's header names the open run
    assert page.locator('[data-testid="stException"]').count() == 0  # Streamlit's box for an uncaught error
    if expect_chart:
        assert page.locator(".main-svg").count() >= 1
    assert dialogs == []
    page.close()


def test_hostile_token_text_shows_as_text_in_the_token_view(server, browser):
    url, _, _ = server
    page, dialogs = open_page(browser, url, "tokens", "Draft candidates vs target candidates")
    picker = page.get_by_label("Request (lowest tau first)")  # Streamlit's selectbox input
    picker.click()
    picker.fill("math-0000")
    page.keyboard.press("Enter")
    chips = page.locator(".dd-tokens")
    chips.get_by_text(HOSTILE_TOKEN_TEXT).first.wait_for(timeout=PAGE_TIMEOUT_MS)
    assert page.locator(".dd-tokens script").count() == 0
    settle_and_shoot(page, "tokens-hostile", True)
    assert dialogs == []
    page.close()


def test_compare_page_highlights_the_regression(server, browser):
    url, _, _ = server
    page, _ = open_page(browser, url, "compare", "regression")
    banner = page.get_by_text("regression(s) at K=").first
    assert banner.is_visible()
    assert "tau" in banner.inner_text() and "→" in banner.inner_text()
    page.close()


def test_production_page_refreshes_while_the_watch_writes(browser, tmp_path):
    """The page shows what the watch wrote after it was opened, with no reload and no click: only the
    fragment's timer reruns it (Streamlit reruns nothing else when a data file changes)."""
    watch = write_watch(tmp_path / "runs" / "watch", [0.6, 0.35, 0.2, 0.1], baseline_tau=3.0, num_units=2)
    with serving(tmp_path / "runs") as (url, _, _):
        page, dialogs = open_page(browser, url, "production", "4 alert(s)")
        write_watch(watch, [0.6, 0.35, 0.2, 0.1], baseline_tau=3.0, num_units=5)  # the watch went on
        page.get_by_text("10 alert(s)").first.wait_for(timeout=PAGE_TIMEOUT_MS)
        assert page.locator('[data-testid="stException"]').count() == 0 and dialogs == []
        page.close()


def test_production_page_renders_server_labels_as_text(browser, tmp_path):
    """A model name from a server's /metrics (and a source note) is text on the Production page: the image
    it spells is never fetched and the link it spells is never rendered, in alerts, series and notes."""
    import http.server
    import threading

    hits: list[str] = []

    class Pixel(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    pixel = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Pixel)
    threading.Thread(target=pixel.serve_forever, daemon=True).start()
    port = pixel.server_address[1]
    hostile = [
        f"![x](http://127.0.0.1:{port}/pixel)",
        "[click](http://evil.example/)",
        f"<img src=http://127.0.0.1:{port}/html>",
        "**bold** `code` $x$ <b>html</b>",
        "https://evil.example/autolink",
    ]
    write_watch(
        tmp_path / "runs" / "watch",
        [0.6, 0.35, 0.2, 0.1],
        baseline_tau=3.0,
        num_units=2,
        model=" ".join(hostile),
        notes=(" ".join(hostile),),
    )
    try:
        with serving(tmp_path / "runs") as (url, _, _):
            page, dialogs = open_page(browser, url, "production", "alert(s)")
            page.wait_for_timeout(1500)
            assert page.locator('[data-testid="stException"]').count() == 0 and dialogs == []
            for expander in page.locator('[data-testid="stExpander"] summary').all():
                expander.click()  # open every alert: its message carries the model name too
            page.wait_for_timeout(1000)
            # shown as the text it is (a zero-width space after the scheme keeps the URL from being linked)
            assert page.get_by_text("[click](http:\u200b//evil.example/)").count() > 0
            assert page.locator('a[href*="evil.example"]').count() == 0
            assert page.locator(f'img[src*="{port}"]').count() == 0
            assert page.locator("b:text('html')").count() == 0
            assert hits == []
            page.close()
    finally:
        pixel.shutdown()
