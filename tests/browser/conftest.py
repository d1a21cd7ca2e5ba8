"""The chat page in headless Chromium: Debian's `chromium` driven by Playwright (no browser
download), against live servers on free ports, each on its own event-loop thread, with a
tiny random model whose context is long enough that a reply can be stopped mid-stream.

Without Chromium or Playwright the tests skip, except under CI (CI set), where .ci/run
installs both and their absence is a failure.
"""

from __future__ import annotations

import os
import shutil
from typing import Callable, Iterator, Optional

import pytest

from live_server import LiveServer, serve_in_thread
from tiny_models import build_model

CONTEXT = 4096  # tokens: about 15 s of tiny-model reply, so Stop lands mid-stream
TIMEOUT_MS = 30_000


def _missing(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; under CI it must be there (.ci/run installs it)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import expect, sync_playwright
    except ImportError:
        _missing("the browser tests need playwright: pip install -e '.[test]'")
    path = shutil.which("chromium")
    if path is None:
        _missing("the browser tests need Chromium on PATH: apt-get install chromium")
    expect.set_options(timeout=TIMEOUT_MS)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=path, headless=True)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory) -> str:
    return build_model(str(tmp_path_factory.mktemp("chat") / "llama"), "llama", seed=0,
                       max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def server(chat_model_dir) -> Iterator[LiveServer]:
    yield from serve_in_thread(chat_model_dir)


@pytest.fixture(scope="module")
def keyed_server(chat_model_dir) -> Iterator[LiveServer]:
    yield from serve_in_thread(chat_model_dir, api_key="sekret")


# The random model may end a reply with its EOS token at any point, and the tests count
# tokens and stop replies mid-stream: every request the page sends asks for ignore_eos
# (an extra field of the body; the page itself never sends it).
IGNORE_EOS = """{
  const send = WebSocket.prototype.send;
  WebSocket.prototype.send = function (data) {
    const frame = JSON.parse(data);
    if (frame.type === 'request') frame.body.ignore_eos = true;
    return send.call(this, JSON.stringify(frame));
  };
}"""


@pytest.fixture
def open_page(browser) -> Iterator[Callable]:
    """open_page(server, before=None, **context options) -> a page at the server's chat page,
    in a fresh browser context (empty storage); before(page) runs before it loads. After the test: no uncaught script error and no
    Content-Security-Policy violation happened on any of them."""
    contexts, problems = [], []

    def open_(server: LiveServer, wait_connected: bool = True,
              before: Optional[Callable] = None, **options):
        context = browser.new_context(**options)
        contexts.append(context)
        context.add_init_script(IGNORE_EOS)
        page = context.new_page()
        page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
        page.on("console", lambda msg: problems.append(f"console: {msg.text}")
                if "Content Security Policy" in msg.text else None)
        if before is not None:  # listeners and routes, in place before the page loads
            before(page)
        page.goto(server.url + "/")
        if wait_connected:
            _wait_connected(page)
        return page

    yield open_
    for context in contexts:
        context.close()
    assert not problems


def _wait_connected(page) -> None:
    from playwright.sync_api import expect

    expect(page.locator("#status")).to_have_text("Connected")
    expect(page.locator("#send")).to_be_enabled()


# the tiny models' chat template, but opening a <think> block in every prompt: a random model
# then thinks for its whole reply (it writes no </think> but by chance)
THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")


@pytest.fixture(scope="module")
def thinking_server(chat_model_dir) -> Iterator[LiveServer]:
    yield from serve_in_thread(chat_model_dir, reasoning_parser="qwen3", chat_template=THINKING_TEMPLATE)
