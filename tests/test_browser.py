"""The memory estimator in a real browser: JupyterLab headless, Debian's Chromium driven by Playwright.

Skipped, with the reason, where Chromium or Playwright is missing; `.ci/run` installs
Chromium so CI always runs it. The screenshot lands in test-output/browser/.
"""

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SHOTS = ROOT / "test-output" / "browser"

try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - depends on the environment
    sync_playwright = None

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="Chromium not installed (Debian package 'chromium'; .ci/run installs it)"),
    pytest.mark.skipif(sync_playwright is None, reason="playwright (Python) not installed; `make` installs it"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(base: str, token: str, seconds: float = 90) -> bool:
    """True once the JupyterLab server at ``base`` answers, False if it has not within ``seconds``."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
            return True
        except OSError:
            time.sleep(0.5)
    return False


@pytest.fixture
def lab(tmp_path):
    """A headless JupyterLab on a copy of the lessons (the committed notebooks are never touched)."""
    shutil.copytree(ROOT / "notebooks", tmp_path / "notebooks")
    port, token = _free_port(), "kvlessons-browser-test"
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
           f"--IdentityProvider.token={token}", f"--notebook-dir={tmp_path / 'notebooks'}"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    if not _answers(base, token):
        proc.terminate()
        pytest.fail("JupyterLab did not start: " + (tmp_path / "lab.log").read_text()[-2000:])
    yield base, token
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_estimator_slider_updates_the_total_in_a_browser(lab):
    """Run lesson 02 in JupyterLab, set the estimator's context to 8,192 tokens, and read 8 GiB."""
    base, token = lab
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"],
        )
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(120_000)
        page.goto(f"{base}/lab/tree/02_memory_math.ipynb?token={token}")
        page.locator(".jp-Notebook").first.wait_for()
        page.get_by_text("Python 3 (ipykernel) | Idle").wait_for()  # the kernel is up before we run anything
        page.get_by_role("menuitem", name="Run", exact=True).click()
        page.get_by_text("Run All Cells", exact=True).click()
        view = page.locator(".widget-html-content", has_text="Estimated KV cache").first
        view.wait_for(state="attached")  # JupyterLab renders off-screen cells lazily: attach, then scroll to it
        view.scroll_into_view_if_needed()
        assert "4 GiB" in view.inner_text()  # the default: 32 layers, 8 KV heads, 128 wide, 4,096 tokens, 8 sequences
        slider = page.locator(".widget-slider", has=page.locator("label", has_text="seq_len")).first
        readout = slider.locator(".widget-readout")
        readout.scroll_into_view_if_needed()
        readout.click()
        page.keyboard.press("Control+A")
        page.keyboard.type("8192")
        page.keyboard.press("Enter")
        page.wait_for_function(
            "() => [...document.querySelectorAll('.widget-html-content')].some(e => e.innerText.includes('8,192 tokens'))"
        )
        text = view.inner_text()
        view.scroll_into_view_if_needed()
        page.screenshot(path=str(SHOTS / "estimator-8192.png"))
        browser.close()
    assert "Estimated KV cache: 8 GiB for 8 sequences of 8,192 tokens" in text


def test_make_lab_opens_the_learners_own_copies(tmp_path):
    """`make lab` (its real recipe, on a copy of the course) writes student/ and opens JupyterLab there: the
    lessons with their exercises unsolved, and the solved lessons one click away in solutions/."""
    course = tmp_path / "course"
    shutil.copytree(ROOT, course, ignore=shutil.ignore_patterns(".venv", ".git", "student", "_site", "test-output", "__pycache__"))
    port, token = _free_port(), "kvlessons-lab-test"
    # A stamp newer than every copied file: make must see the environment as installed. (With an older one it
    # would run the install recipe, and `pip install -e` the copy into this very environment.)
    stamp = tmp_path / "installed.stamp"
    stamp.touch()
    cmd = ["make", "-C", str(course), "lab", f"BIN={Path(sys.executable).parent}", f"STAMP={stamp}",
           f"LAB_PORT={port}", f"LAB_ARGS=--IdentityProvider.token={token}"]
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        if not _answers(base, token):
            pytest.fail("make lab did not start JupyterLab: " + (tmp_path / "lab.log").read_text()[-2000:])
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                        args=["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"])
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(120_000)
            page.goto(f"{base}/lab?token={token}")
            listing = page.locator(".jp-DirListing-item")
            listing.filter(has_text="01_why_caching_works.ipynb").first.wait_for()
            listing.filter(has_text="solutions").first.wait_for()  # the solved lessons, one click away
            page.goto(f"{base}/lab/tree/01_why_caching_works.ipynb?token={token}")
            page.locator(".jp-Notebook").first.wait_for()
            page.get_by_text("Your turn", exact=False).first.wait_for(state="attached")  # an unsolved exercise
            SHOTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SHOTS / "make-lab-student-01.png"))
            browser.close()
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
