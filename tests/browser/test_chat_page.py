"""The chat page (streamserve/static/) in headless Chromium against a live server: replies
stream in, Stop cancels and frees the KV blocks, conversations survive a reload, model
output is never HTML, server errors and dropped sockets show on the page, the API key
goes in the socket's first frame, and the layout holds on a phone and in the dark."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from typing import Callable

from live_server import record_aborts
from streamserve.server.app import PAGE_HEADERS

WS = re.compile(r".*/v1/ws$")
SETTING_IDS = {"system": "#system-prompt", "temperature": "#temperature", "top_p": "#top-p",
               "max_tokens": "#max-tokens"}


def expect(locator):
    # Imported here: without Playwright the module still loads, and the browser fixture
    # says why its tests skip (or fail, under CI).
    from playwright.sync_api import expect

    return expect(locator)


def connected(page) -> None:
    expect(page.locator("#status")).to_have_text("Connected")
    expect(page.locator("#send")).to_be_enabled()


def settings(page, **values) -> None:
    """Fill settings through the settings panel."""
    page.click("#toggle-settings")
    for name, value in values.items():
        page.fill(SETTING_IDS[name], str(value))
    page.click("#toggle-settings")
    expect(page.locator("#settings")).to_be_hidden()


def send(page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def reply(page):
    return page.locator(".message.assistant").last


def stored_chats(page) -> list[dict]:
    return page.evaluate("JSON.parse(localStorage.getItem('streamserve.chats'))")


def http(url: str, body: dict | None = None) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def metric(text: str, name: str) -> float:
    match = re.search(rf"^streamserve:{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert match, f"{name} is not in /metrics"
    return float(match.group(1))


AT_LEAST_20_CHARACTERS = re.compile(r"[\s\S]{20}")


def pipe(ws, to_page: Callable[[dict], dict] = lambda frame: frame) -> None:
    """Route the page's socket `ws` to the server, adding ignore_eos to requests (as
    open_page's script does for a real socket) and passing what the server sends through
    `to_page`."""
    upstream = ws.connect_to_server()

    def to_server(message: str) -> None:
        frame = json.loads(message)
        if frame["type"] == "request":
            frame["body"]["ignore_eos"] = True
        upstream.send(json.dumps(frame))

    ws.on_message(to_server)
    upstream.on_message(lambda message: ws.send(json.dumps(to_page(json.loads(message)))))


def idle(server) -> bool:
    """/metrics says: no request running or waiting, no KV block in use."""
    text = http(server.url + "/metrics")[2].decode()
    return metric(text, "num_requests_running") == metric(text, "num_requests_waiting") == 0 \
        and metric(text, "kv_cache_usage_perc") == 0


def wait_until(condition, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# Records, at every change under #messages, the last reply's text length and whether Send
# was disabled and Stop shown, and the tag of every element added anywhere in the page.
RECORD = """() => {
  window.__log = []; window.__added = [];
  const send = document.getElementById('send'), stop = document.getElementById('stop');
  new MutationObserver((records) => {
    for (const r of records) for (const n of r.addedNodes) if (n.nodeType === 1) {
      window.__added.push(n.tagName);
      for (const d of n.querySelectorAll('*')) window.__added.push(d.tagName);
    }
    const bodies = document.querySelectorAll('.message.assistant .body');
    if (bodies.length) window.__log.push([bodies[bodies.length - 1].textContent.length,
                                          send.disabled, !stop.hidden]);
  }).observe(document.body, {subtree: true, childList: true, characterData: true});
}"""


def test_the_page_and_its_assets_are_served_with_a_strict_policy(server):
    status, headers, body = http(server.url + "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert headers["Content-Security-Policy"] == PAGE_HEADERS["Content-Security-Policy"]
    assert b'src="static/chat.js"' in body and b"<script>" not in body  # no inline script
    for asset, kind in [("chat.js", "javascript"), ("markdown.js", "javascript"), ("chat.css", "text/css")]:
        status, headers, _ = http(f"{server.url}/static/{asset}")
        assert status == 200 and kind in headers["Content-Type"], asset
    for missing in ("nope.js", "..%2Fserver%2Fapp.py", "%2e%2e%2f__init__.py", "..%5C__init__.py"):
        status, _, body = http(f"{server.url}/static/{missing}")
        assert status == 404 and json.loads(body)["error"]["type"] == "not_found_error", missing


# Hands the page's socket messages to its handler at most one per 15 ms, in order: the tiny
# model can stream 200 tokens faster than a loaded machine's browser draws two frames, and
# the page renders once a frame, so unpaced a reply may show up whole in one update.
PACE_MESSAGES = """{
  const onmessage = Object.getOwnPropertyDescriptor(WebSocket.prototype, 'onmessage');
  let next = 0;
  Object.defineProperty(WebSocket.prototype, 'onmessage', {
    configurable: true,
    get() { return onmessage.get.call(this); },
    set(handler) {
      onmessage.set.call(this, (event) => {
        next = Math.max(performance.now(), next + 15);
        setTimeout(() => handler.call(this, event), next - performance.now());
      });
    },
  });
}"""


def test_a_reply_streams_in_token_by_token_with_its_statistics(server, open_page):
    sent = []

    def before(page):
        page.add_init_script(PACE_MESSAGES)
        page.on("websocket", lambda ws: ws.on("framesent", lambda payload: sent.append(json.loads(payload))))

    page = open_page(server, before=before)
    expect(page.locator("#model-name")).to_have_text(server.model_name)
    # 200 tokens, paced: at least 3 s of stream, which spans many of the page's frames
    settings(page, system="Be brief.", temperature=0, top_p=0.9, max_tokens=200)
    expect(page.locator("#settings-model")).to_have_text(server.model_name)
    expect(page.locator("#max-model-len")).to_have_text("4096")
    page.evaluate(RECORD)
    page.fill("#input", "hello")
    page.press("#input", "Shift+Enter")  # a new line, not a send
    page.locator("#input").press_sequentially("world")
    assert page.input_value("#input") == "hello\nworld" and page.locator(".message").count() == 0
    page.press("#input", "Enter")
    expect(reply(page).locator(".stats .finish")).to_have_text("length")
    stats = reply(page).locator(".stats")
    expect(stats.locator(".tokens")).to_have_text("200 tokens")  # the usage chunk's count
    expect(stats.locator(".ttft")).to_have_text(re.compile(r"^TTFT \d+\.\d\d s$"))
    expect(stats.locator(".rate")).to_have_text(re.compile(r"^\d+\.\d tok/s$"))
    expect(page.locator("#send")).to_be_enabled()
    expect(page.locator("#stop")).to_be_hidden()
    expect(page.locator(".message.user .body")).to_have_text("hello\nworld")

    final = len(reply(page).locator(".body").text_content())
    log = page.evaluate("window.__log")
    growing = sorted({n for n, _, _ in log if 0 < n < final})
    assert len(growing) >= 2, log  # the text grew over at least two updates before its end
    # While the reply streamed, Send was disabled and Stop shown.
    assert all(disabled and stop for n, disabled, stop in log if 0 < n < final), log
    # The settings went into the request, and the page shows what the server answers the
    # same request outside the socket.
    request = sent[0]["body"]
    assert request == {"messages": [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "hello\nworld"}],
                       "temperature": 0, "top_p": 0.9, "max_tokens": 200,
                       "stream_options": {"include_usage": True}, "ignore_eos": True}
    del request["stream_options"]  # (only for streams)
    _, _, body = http(server.url + "/v1/chat/completions", request)
    expected = json.loads(body)["choices"][0]["message"]["content"]
    assert stored_chats(page)[0]["messages"][1]["content"] == expected


def test_stop_ends_the_stream_and_the_kv_pool_returns_to_full(server, open_page):
    page = open_page(server)  # max tokens left blank: the reply may fill the 4096-token context
    kv = server.engine.engine_core.scheduler.kv_cache_manager
    aborted = record_aborts(server.engine)
    send(page, "tell me a long story")
    expect(page.locator("#stop")).to_be_visible()
    expect(reply(page).locator(".body")).to_have_text(AT_LEAST_20_CHARACTERS)
    assert kv.num_free_blocks < kv.num_blocks  # the request holds blocks
    page.click("#stop")
    expect(reply(page).locator(".stats .finish")).to_have_text("cancelled")
    expect(page.locator("#stop")).to_be_hidden()
    expect(page.locator("#send")).to_be_enabled()
    text = reply(page).locator(".body").text_content()
    assert text and reply(page).locator(".error").count() == 0  # the partial reply stays

    wait_until(lambda: idle(server) and kv.num_free_blocks == kv.num_blocks)
    assert kv.num_free_blocks == kv.num_blocks and len(aborted) == 1  # aborted, not run to its end
    _, _, body = http(server.url + "/metrics")
    assert metric(body.decode(), "num_requests_waiting") == 0
    assert reply(page).locator(".body").text_content() == text  # nothing came after the stop
    tokens = int(reply(page).locator(".stats .tokens").text_content().split()[0])
    assert 0 < tokens < 2000  # stopped long before the context was full
    stored = stored_chats(page)[0]["messages"][1]
    assert stored["content"] and stored["stats"]["finish"] == "cancelled" and stored["error"] is None


def test_conversations_survive_a_reload_and_can_be_deleted(server, open_page):
    page = open_page(server)
    settings(page, max_tokens=6)
    send(page, "first question")
    expect(reply(page).locator(".stats .finish")).to_have_text("length")
    page.click("#new-chat")
    expect(page.locator(".message")).to_have_count(0)
    send(page, "second question")
    expect(reply(page).locator(".stats .finish")).to_have_text("length")
    titles = page.locator("#chat-list .open")
    expect(titles).to_have_text(["second question", "first question"])  # newest first

    page.reload()
    connected(page)
    expect(titles).to_have_text(["second question", "first question"])
    expect(page.locator("#chat-list li.current .open")).to_have_text("second question")
    expect(page.locator(".message.user .body")).to_have_text(["second question"])
    expect(page.locator("#max-tokens")).to_have_value("6")  # settings are kept too
    titles.nth(1).click()
    expect(page.locator(".message.user .body")).to_have_text(["first question"])
    expect(reply(page).locator(".stats .tokens")).to_have_text("6 tokens")

    page.click("#chat-list li:first-child .delete")  # deletes "second question"
    expect(titles).to_have_text(["first question"])
    page.reload()
    connected(page)
    expect(titles).to_have_text(["first question"])
    assert [c["title"] for c in stored_chats(page)] == ["first question"]


XSS_TEXT = ["<img src=x onerror=alert(1)>", "<script>alert(2)</script>", "<svg onload=alert(4)>"]
XSS_REPLY = ("Here is **bold <b>x</b>** and *italic* and `inline <img src=x onerror=alert(3)>`.\n\n"
             f"{XSS_TEXT[0]}\n\n- item {XSS_TEXT[1]}\n- second\n\n1. one\n2. two\n\n"
             "```python\nprint('<script>alert(5)</script>')\n```\n"
             f"After the code {XSS_TEXT[2]}")


def test_model_output_renders_markdown_and_never_html(server, open_page):
    """The server's reply text is swapped for XSS strings and Markdown on its way to the
    page, three characters a chunk, so tags arrive split across chunks."""
    dialogs = []
    pieces = [XSS_REPLY[i:i + 3] for i in range(0, len(XSS_REPLY), 3)]

    def to_page(frame: dict) -> dict:
        if frame["type"] == "chunk":
            for choice in frame["data"]["choices"]:
                if choice["delta"].get("content"):
                    choice["delta"]["content"] = pieces.pop(0) if pieces else ""
        return frame

    def before(page):
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        page.route_web_socket(WS, lambda ws: pipe(ws, to_page))

    page = open_page(server, before=before)
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    settings(page, max_tokens=3 * len(pieces))  # some tokens are bytes of a character: no text
    page.evaluate(RECORD)
    send(page, XSS_TEXT[0] + " " + XSS_TEXT[1])
    expect(reply(page).locator(".stats .finish")).to_have_text("length")

    assert not dialogs
    added = set(page.evaluate("window.__added"))
    assert not added & {"IMG", "SCRIPT", "SVG", "B", "IFRAME"}, added
    messages = page.locator("#messages")
    assert messages.locator("img, script, svg, b, iframe").count() == 0
    expect(page.locator(".message.user .body")).to_have_text(XSS_TEXT[0] + " " + XSS_TEXT[1])
    expect(page.locator("#chat-list .open")).to_have_text([XSS_TEXT[0] + " " + XSS_TEXT[1]])
    body = reply(page).locator(".body")
    for text in XSS_TEXT:
        expect(body).to_contain_text(text)
    expect(body.locator("strong")).to_have_text("bold <b>x</b>")
    expect(body.locator("em")).to_have_text("italic")
    expect(body.locator("p > code")).to_have_text("inline <img src=x onerror=alert(3)>")
    expect(body.locator("ul > li")).to_have_text(["item " + XSS_TEXT[1], "second"])
    expect(body.locator("ol > li")).to_have_text(["one", "two"])
    code = "print('<script>alert(5)</script>')"
    expect(body.locator(".code-block pre code")).to_have_text(code)
    expect(body.locator(".code-block .code-lang")).to_have_text("python")
    assert "monospace" in body.locator("pre code").evaluate("e => getComputedStyle(e).fontFamily")
    body.locator(".code-block .copy").click()
    expect(body.locator(".code-block .copy")).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == code

    page.reload()  # the stored reply renders the same way
    connected(page)
    expect(reply(page).locator(".body .code-block pre code")).to_have_text(code)
    assert messages.locator("img, script, svg, b, iframe").count() == 0 and not dialogs


def test_a_server_error_shows_in_the_conversation(server, open_page):
    sent = []
    page = open_page(server, before=lambda page: page.on(
        "websocket", lambda ws: ws.on("framesent", lambda payload: sent.append(json.loads(payload)))))
    settings(page, max_tokens=100000)
    send(page, "hello")
    error = reply(page).locator(".error")
    expect(error).to_contain_text("together they exceed max_model_len (4096)")
    expect(reply(page).locator(".stats .finish")).to_have_text("error")
    expect(page.locator("#send")).to_be_enabled()
    settings(page, max_tokens=4)  # the page goes on: the next message gets its reply
    send(page, "hello again")
    expect(reply(page).locator(".stats .finish")).to_have_text("length")
    # The failed turn is kept with its error, and not sent back as history.
    chat = stored_chats(page)[0]
    assert chat["messages"][1]["error"].startswith("the prompt has")
    assert [m["role"] for m in chat["messages"]] == ["user", "assistant", "user", "assistant"]
    requests = [f["body"] for f in sent if f["type"] == "request"]
    assert [r["max_tokens"] for r in requests] == [100000, 4]
    assert requests[1]["messages"] == [{"role": "user", "content": "hello again"}]


def test_the_page_asks_for_the_api_key_and_sends_it_in_the_first_frame(keyed_server, open_page):
    urls, sent = [], []

    def before(page):
        page.on("request", lambda r: urls.append(r.url))
        page.on("websocket", lambda ws: (urls.append(ws.url),
                                         ws.on("framesent", lambda payload: sent.append(payload))))

    page = open_page(keyed_server, wait_connected=False, before=before)
    dialog = page.locator("#key-dialog")
    expect(dialog).to_be_visible()
    expect(page.locator("#status")).to_have_text("API key needed")
    page.fill("#api-key", "wrong")
    page.press("#api-key", "Enter")
    expect(page.locator("#key-message")).to_have_text("That key was refused; try again.")
    expect(dialog).to_be_visible()
    page.fill("#api-key", "sekret")
    page.press("#api-key", "Enter")
    connected(page)
    expect(dialog).to_be_hidden()
    settings(page, max_tokens=5)
    send(page, "hello")
    expect(reply(page).locator(".stats .finish")).to_have_text("length")

    assert json.loads(sent[0]) == {"type": "auth", "api_key": "sekret"}
    assert json.loads(sent[1])["type"] == "request"
    assert urls and not [u for u in urls if "sekret" in u]  # never in a URL
    assert page.evaluate("sessionStorage.getItem('streamserve.apiKey')") == "sekret"
    assert "sekret" not in json.dumps(page.evaluate("({...localStorage})"))
    page.reload()  # the key is kept for this tab
    connected(page)
    expect(dialog).to_be_hidden()


def test_a_dropped_socket_reconnects_with_backoff_and_says_so(server, open_page):
    routes = []

    def route(ws):  # a pipe to the server, which the test can cut
        pipe(ws)
        routes.append(ws)

    page = open_page(server, before=lambda page: page.route_web_socket(WS, route))
    page.evaluate("""() => { window.__status = [];
        const s = document.getElementById('status');
        new MutationObserver(() => window.__status.push(s.textContent))
            .observe(s, {childList: true, characterData: true, subtree: true}); }""")
    aborted = record_aborts(server.engine)
    send(page, "a long reply, cut short")
    expect(reply(page).locator(".body")).to_have_text(AT_LEAST_20_CHARACTERS)
    routes[0].close()
    expect(reply(page).locator(".error")).to_have_text("The connection dropped; the reply stopped here.")
    expect(reply(page).locator(".stats .finish")).to_have_text("disconnected")
    assert reply(page).locator(".body").text_content()  # the partial reply stays
    connected(page)
    statuses = page.evaluate("window.__status")
    assert statuses[0] == "Disconnected: reconnecting in 0.5 s (try 1)", statuses
    assert statuses[-1] == "Connected" and len(routes) == 2
    settings(page, max_tokens=4)
    send(page, "and now?")  # the new socket serves
    expect(reply(page).locator(".stats .finish")).to_have_text("length")
    kv = server.engine.engine_core.scheduler.kv_cache_manager
    wait_until(lambda: idle(server) and kv.num_free_blocks == kv.num_blocks)
    assert kv.num_free_blocks == kv.num_blocks and len(aborted) == 1  # the dropped socket's request


def no_horizontal_scroll(page) -> bool:
    return page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")


def in_view(page, selector: str) -> bool:
    box = page.locator(selector).bounding_box()
    size = page.viewport_size
    return box is not None and box["x"] >= 0 and box["y"] >= 0 and \
        box["x"] + box["width"] <= size["width"] and box["y"] + box["height"] <= size["height"]


def test_phone_and_desktop_layouts_in_light_and_dark(server, open_page):
    phone = open_page(server, viewport={"width": 390, "height": 844}, color_scheme="dark",
                      is_mobile=True, has_touch=True)
    settings(phone, max_tokens=30)
    send(phone, "a message on a phone " * 6)
    expect(reply(phone).locator(".stats .finish")).to_have_text("length")
    assert no_horizontal_scroll(phone)
    for selector in ("#input", "#send", "#toggle-sidebar", "#status"):
        assert in_view(phone, selector), selector
    expect(phone.locator("#sidebar")).not_to_be_in_viewport()  # it waits off-screen
    phone.click("#toggle-sidebar")
    expect(phone.locator("#backdrop")).to_be_visible()
    expect(phone.locator("#new-chat")).to_be_in_viewport(ratio=1)
    phone.click("#backdrop", position={"x": 370, "y": 400})  # beside the sidebar
    expect(phone.locator("#sidebar")).not_to_be_in_viewport()
    dark = phone.evaluate("getComputedStyle(document.body).backgroundColor")
    text = phone.evaluate("getComputedStyle(document.body).color")
    assert dark == "rgb(22, 24, 28)" and text == "rgb(228, 231, 235)"

    desktop = open_page(server, viewport={"width": 1280, "height": 800}, color_scheme="light")
    assert in_view(desktop, "#new-chat") and not desktop.locator("#toggle-sidebar").is_visible()
    assert desktop.evaluate("getComputedStyle(document.body).backgroundColor") == "rgb(255, 255, 255)"
    assert no_horizontal_scroll(desktop)


def test_code_fences_as_commonmark_reads_them(server, open_page):
    """An info string after the language (```js title="a.js"), longer fences holding a ```
    example, and a ``` line with text after it (not a closing fence) render as code blocks,
    and what follows the block renders as Markdown again."""
    page = open_page(server)
    blocks = page.evaluate("""async () => {
        const { renderMarkdown } = await import("/static/markdown.js");
        const text = "```js title=\\"a.js\\"\\nconst x = a*b*c;\\n```\\n\\nAfter **done**.\\n\\n" +
                     "````md\\n```py\\nx = 1\\n```\\n````\\n\\n``` \\nkeep\\n``` trailing\\n```\\nend";
        const root = document.createElement("div");
        root.appendChild(renderMarkdown(text));
        return {
            langs: [...root.querySelectorAll(".code-lang")].map(e => e.textContent),
            code: [...root.querySelectorAll("pre code")].map(e => e.textContent),
            strong: [...root.querySelectorAll("p strong")].map(e => e.textContent),
            paragraphs: [...root.querySelectorAll(":scope > p")].map(e => e.textContent),
        };
    }""")
    assert blocks["langs"] == ["js", "md", ""]
    assert blocks["code"] == ["const x = a*b*c;", "```py\nx = 1\n```", "keep\n``` trailing"]
    assert blocks["strong"] == ["done"] and blocks["paragraphs"] == ["After done.", "end"]


def test_lists_nest_by_indentation(server, open_page):
    """An item indented two or more past its list's items opens a list inside the item
    above it; a less indented one returns to the list at its depth; a new kind of marker at
    the same depth starts a new list; an indented plain line continues the item."""
    page = open_page(server)
    html = page.evaluate("""async () => {
        const { renderMarkdown } = await import("/static/markdown.js");
        const text = "1. fruit\\n   - apple\\n   - pear\\n     ripe\\n      * soft\\n2. veg\\n\\t- leek\\n" +
                     "3. end\\n- other";
        const root = document.createElement("div");
        root.appendChild(renderMarkdown(text));
        return root.innerHTML;
    }""")
    assert html == ('<ol><li>fruit<ul><li>apple</li><li>pear<br>ripe<ul><li>soft</li></ul></li></ul></li>'
                    '<li>veg<ul><li>leek</li></ul></li><li>end</li></ol><ul><li>other</li></ul>')


def test_two_tabs_keep_each_others_conversations(server, open_page):
    """Tab A's reply streams (its end held back) while tab B starts and finishes another
    chat; when A's reply ends and A saves, B's chat is still stored."""
    held = []

    def hold_done(ws):
        upstream = ws.connect_to_server()
        ws.on_message(lambda message: upstream.send(message))
        upstream.on_message(lambda message: held.append(message) if json.loads(message)["type"] == "done"
                            else ws.send(message))
        held.append(ws)  # held[0]: the route, to send the frames on later

    a = open_page(server, before=lambda page: page.route_web_socket(WS, hold_done))
    settings(a, max_tokens=8)  # stored for both tabs
    b = a.context.new_page()
    b.goto(server.url + "/")
    connected(b)
    send(a, "chat from tab A")
    for _ in range(600):  # A's reply came, all but its "done" (the waits let Playwright deliver it)
        if len(held) > 1:
            break
        a.wait_for_timeout(50)
    b.click("#new-chat")
    send(b, "chat from tab B")
    expect(reply(b).locator(".stats .finish")).not_to_be_empty()
    held[0].send(held[1])  # A's reply ends now
    expect(reply(a).locator(".stats .finish")).not_to_be_empty()
    titles = lambda page: sorted(c["title"] for c in stored_chats(page))  # noqa: E731
    assert titles(a) == titles(b) == ["chat from tab A", "chat from tab B"]
    expect(a.locator("#chat-list .open")).to_have_count(2)


def test_a_growing_reply_renders_as_the_whole_does_keeping_what_is_settled(server, open_page):
    """A reply streamed in pieces renders (renderGrowing) exactly as the whole text does; the
    blocks before the last blank line outside a fence are built once and kept (the same nodes
    from frame to frame), not rebuilt every frame."""
    page = open_page(server)
    result = page.evaluate("""async () => {
        const { renderAll, renderGrowing } = await import("/static/markdown.js");
        const text = "# Title\\n\\nSome **bold** text\\nand more.\\n\\n- one\\n- two\\n  more of two\\n\\n" +
                     "```py\\nx = 1\\n\\ny = 2\\n```\\n\\n1. first\\n  - inner\\n    - deeper\\n\\n3. third\\n\\n~~~\\nopen fence, blank:\\n\\n" +
                     "still code\\n~~~\\nlast *words*";
        const growing = document.createElement("div"), whole = document.createElement("div");
        let firstNode = null, kept = true;
        for (let i = 1; i <= text.length; i += 1 + (i % 5)) {
            renderGrowing(growing, text.slice(0, i));
            if (i > 12 && firstNode === null) firstNode = growing.firstChild;
            else if (firstNode !== null) kept &&= growing.firstChild === firstNode;
        }
        renderGrowing(growing, text);
        renderAll(whole, text);
        return { same: growing.innerHTML === whole.innerHTML, kept, html: growing.innerHTML };
    }""")
    assert result["same"], result["html"]
    assert result["kept"]


def test_a_replys_reasoning_shows_apart_as_plain_text(thinking_server, open_page):
    """--reasoning-parser: the reasoning streams into a "Thinking" disclosure above the reply,
    as text (never markup), and stays with the conversation across a reload."""
    page = open_page(thinking_server)
    settings(page, max_tokens=12, temperature=0)
    send(page, "think about it")
    expect(reply(page).locator(".stats .finish")).to_have_text("length")
    thought = reply(page).locator(".reasoning .thought")
    expected = http(thinking_server.url + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "think about it"}], "max_tokens": 12, "temperature": 0,
        "ignore_eos": True})[2]
    message = json.loads(expected)["choices"][0]["message"]
    assert message["reasoning"] and message["content"] is None  # (the random model never closed the block)
    expect(thought).to_have_text(message["reasoning"])
    expect(reply(page).locator(".reasoning summary")).to_have_text("Thinking")
    assert reply(page).locator(".reasoning .thought *").count() == 0  # text, not markup
    assert stored_chats(page)[0]["messages"][1]["reasoning"] == message["reasoning"]
    page.reload()
    connected(page)
    expect(reply(page).locator(".reasoning .thought")).to_have_text(message["reasoning"])


def test_a_server_with_lora_adapters_lets_the_page_choose_one(chat_model_dir, open_page, tmp_path_factory):
    """With LoRA adapters served, the settings offer the model and each adapter; a reply comes
    from the one chosen (the request names it; the model itself is named by none), and the
    choice outlives a reload. A server of one model shows no choice."""
    from live_server import serve_in_thread
    from lora_adapters import build_adapter

    adapter = build_adapter(str(tmp_path_factory.mktemp("page-lora") / "sql"), chat_model_dir, rank=4)
    sent = []

    def before(page):
        page.on("websocket", lambda ws: ws.on("framesent", lambda payload: sent.append(json.loads(payload))))

    for live in serve_in_thread(chat_model_dir, enable_lora=True, lora_modules=[f"sql={adapter}"]):
        page = open_page(live, before=before)
        settings(page, max_tokens=8)
        page.click("#toggle-settings")
        expect(page.locator("#model-choice")).to_be_visible()
        options = page.locator("#model-select option")
        expect(options).to_have_text([live.model_name, f"sql (adapter of {live.model_name})"])
        page.select_option("#model-select", "sql")
        expect(page.locator("#model-name")).to_have_text("sql")
        expect(page.locator("#settings-model")).to_have_text("sql")
        page.click("#toggle-settings")
        send(page, "hello")
        expect(reply(page).locator(".stats .finish")).to_have_text("length")
        assert sent[-1]["body"]["model"] == "sql"
        page.reload()
        connected(page)
        expect(page.locator("#model-name")).to_have_text("sql")
        page.click("#toggle-settings")
        page.select_option("#model-select", live.model_name)
        page.click("#toggle-settings")
        send(page, "again")
        expect(reply(page).locator(".stats .finish")).to_have_text("length")
        assert "model" not in sent[-1]["body"]


def test_a_server_of_one_model_offers_no_choice(server, open_page):
    page = open_page(server)
    page.click("#toggle-settings")
    expect(page.locator("#model-choice")).to_be_hidden()
    expect(page.locator("#settings-model")).to_have_text(server.model_name)
