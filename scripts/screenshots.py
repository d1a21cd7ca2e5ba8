"""Screenshots of the chat page mid-conversation, for the README.

    python scripts/screenshots.py [--model smollm2-135m-instruct] [--out docs]

Starts `python -m streamserve` on a free port with the model (by default the default
model), opens the page in headless Chromium at a desktop width (1280x800, light colour
scheme) and a phone width (390x844, dark), holds a short conversation, and captures the
page while the last reply streams: docs/chat-desktop.png and docs/chat-phone.png. Needs
Chromium on PATH (`apt-get install chromium`) and Playwright (`pip install -e '.[test]'`).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import NamedTuple

from playwright.sync_api import Browser, Page, expect, sync_playwright

EARLIER = "What is the capital of France?"
QUESTION = "Write a Python function that reverses a string."
FOLLOW_UP = "Now explain how it works, step by step."


class Shot(NamedTuple):
    name: str
    width: int
    height: int
    color_scheme: str


SHOTS = [Shot("chat-desktop.png", 1280, 800, "light"), Shot("chat-phone.png", 390, 844, "dark")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, server: subprocess.Popen, log_path: str, seconds: float = 600) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"the server exited ({server.returncode}):\n{pathlib.Path(log_path).read_text()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.5)
    sys.exit(f"the server was not ready after {seconds:.0f} s")


def send(page: Page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def finished(page: Page) -> None:
    expect(page.locator(".message.assistant").last.locator(".stats")).to_be_visible(timeout=120_000)


def converse_and_capture(browser: Browser, url: str, shot: Shot, path: str) -> None:
    context = browser.new_context(viewport={"width": shot.width, "height": shot.height},
                                  color_scheme=shot.color_scheme)
    page = context.new_page()
    page.goto(url + "/")
    expect(page.locator("#status")).to_have_text("Connected", timeout=60_000)
    page.click("#toggle-settings")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "120")
    page.click("#toggle-settings")
    send(page, EARLIER)
    finished(page)
    if page.locator("#toggle-sidebar").is_visible():  # a phone: the sidebar slides in
        page.click("#toggle-sidebar")
    page.click("#new-chat")
    send(page, QUESTION)
    finished(page)
    send(page, FOLLOW_UP)
    # Mid-reply: some text is in, the cursor still blinks and Stop is shown.
    expect(page.locator(".message.assistant.streaming .body")).to_have_text(
        re.compile(r"[\s\S]{160}"), timeout=120_000)
    page.screenshot(path=path, animations="disabled")
    page.click("#stop")
    finished(page)
    context.close()
    print(f"wrote {path} ({os.path.getsize(path) // 1024} KiB)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs"))
    args = parser.parse_args()
    chromium = shutil.which("chromium")
    if chromium is None:
        sys.exit("Chromium is not on PATH: apt-get install chromium")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    server = subprocess.Popen([sys.executable, "-m", "streamserve", "--model", args.model,
                               "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(url, server, log.name)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium, headless=True)
            for shot in SHOTS:
                converse_and_capture(browser, url, shot, os.path.join(args.out, shot.name))
            browser.close()
    finally:
        server.terminate()
        server.wait(30)
        os.unlink(log.name)


if __name__ == "__main__":
    main()
