"""The server in this process (aiohttp runner + client): many concurrent streams, and
streams the client abandons, which must give their KV blocks back."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from live_server import fail_step, held_config, record_aborts, slow_steps, start
from streamserve.frontend.async_engine import AsyncEngine
from streamserve.server.app import HANDLING, app_runner, drain


async def stream_text(session: aiohttp.ClientSession, url: str, body: dict) -> str:
    text = ""
    async with session.post(url + "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status == 200
        async for line in r.content:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    return text


def test_32_concurrent_streams_equal_their_non_streamed_results(llama_dir):
    prompts = [f"{word} number {i}" for i, word in enumerate(["hello", "Paris", "the fox", "def"] * 8)]

    async def main():
        runner, engine, url = await start(llama_dir)
        async with aiohttp.ClientSession() as session:
            bodies = [{"prompt": p, "max_tokens": 20, "temperature": 0} for p in prompts]
            streamed = await asyncio.gather(*(stream_text(session, url, b) for b in bodies))
            whole = []
            for b in bodies:
                async with session.post(url + "/v1/completions", json=b) as r:
                    whole.append((await r.json())["choices"][0]["text"])
        await runner.cleanup()
        return streamed, whole

    streamed, whole = asyncio.run(main())
    assert streamed == whole and any(whole)


def test_abandoned_streams_are_aborted_and_free_their_blocks(llama_dir):
    async def main():
        runner, engine, url = await start(llama_dir)
        core = engine.engine_core
        kv = core.scheduler.kv_cache_manager
        aborted = record_aborts(engine)
        body = {"prompt": "hello " * 30, "max_tokens": 300, "temperature": 0, "ignore_eos": True,
                "stream": True}
        async with aiohttp.ClientSession() as session:
            for _ in range(3):
                responses = [await session.post(url + "/v1/completions", json=body) for _ in range(6)]
                for r in responses:
                    assert r.status == 200
                    await r.content.readline()  # the first chunk arrived: the request runs
                    r.close()  # the client goes away mid-stream
        for _ in range(500):
            if not engine.engine_core.has_unfinished_requests() and kv.num_free_blocks == kv.num_blocks:
                break
            await asyncio.sleep(0.02)
        result = (kv.num_free_blocks, kv.num_blocks, engine.engine_core.has_unfinished_requests(),
                  len(set(aborted)))
        await runner.cleanup()
        return result

    free, total, busy, num_aborted = asyncio.run(main())
    assert num_aborted == 18  # every abandoned stream was aborted, none ran to its end
    assert free == total and not busy


def parse_metrics(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def test_metrics_count_what_was_served(llama_dir):
    """After two requests, the counters hold exactly what was served; scraped while a third
    runs, one request is running and part of the KV cache in use."""
    prompts = ("hello world " * 3, "hello world " * 3 + "again")

    async def main():
        runner, engine, url = await start(llama_dir)
        async with aiohttp.ClientSession() as session:
            for prompt in prompts:
                await stream_text(session, url, {"prompt": prompt, "max_tokens": 5, "temperature": 0,
                                                 "ignore_eos": True})
            async with session.get(url + "/metrics") as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
                text = await r.text()
            slow_steps(engine, 0.005)
            body = {"prompt": "x " * 40, "max_tokens": 300, "ignore_eos": True, "stream": True}
            async with session.post(url + "/v1/completions", json=body) as running:
                await running.content.readline()
                async with session.get(url + "/metrics") as r:
                    during = await r.text()
                running.close()
        await runner.cleanup()
        return text, during, [len(engine.renderer.encode(p)) for p in prompts]

    text, during, prompt_lengths = asyncio.run(main())
    values, during = parse_metrics(text), parse_metrics(during)
    name = llama_dir
    assert values[f'streamserve:generation_tokens_total{{model_name="{name}"}}'] == 10
    assert values[f'streamserve:request_success_total{{finished_reason="length",model_name="{name}"}}'] == 2
    assert values[f'streamserve:time_to_first_token_seconds_count{{model_name="{name}"}}'] == 2
    assert values[f'streamserve:inter_token_latency_seconds_count{{model_name="{name}"}}'] == 8
    assert values[f'streamserve:e2e_request_latency_seconds_count{{model_name="{name}"}}'] == 2
    assert values[f'streamserve:request_queue_time_seconds_count{{model_name="{name}"}}'] == 2
    assert values[f'streamserve:num_requests_running{{model_name="{name}"}}'] == 0
    assert values[f'streamserve:kv_cache_usage_perc{{model_name="{name}"}}'] == 0
    assert values[f'streamserve:prefix_cache_hits_total{{model_name="{name}"}}'] > 0
    assert values[f'streamserve:prompt_tokens_total{{model_name="{name}"}}'] == sum(prompt_lengths)
    assert during[f'streamserve:num_requests_running{{model_name="{name}"}}'] == 1
    assert 0 < during[f'streamserve:kv_cache_usage_perc{{model_name="{name}"}}'] < 1


def test_keepalive_comments_and_body_limit(llama_dir):
    async def main():
        runner, engine, url = await start(llama_dir, sse_keepalive_seconds=0.0005, max_request_bytes=2048)
        # The tiny model's steps can come faster than the keep-alive interval (one C call each on
        # the CPU): a 5 ms pause before every step makes the gaps between tokens certain.
        slow_steps(engine, 0.005)
        async with aiohttp.ClientSession() as session:
            body = {"prompt": "hello", "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
            async with session.post(url + "/v1/completions", json=body) as r:
                raw = (await r.read()).decode()
            async with session.post(url + "/v1/completions", json={"prompt": "x" * 5000}) as r:
                too_big = (r.status, await r.json())
            # the same limit on a websocket frame: one within it is served, a larger one closes
            # the socket with 1009 (it was read whatever its size, up to aiohttp's 4 MiB)
            async with session.ws_connect(url + "/v1/ws") as ws:
                def frame(request_id: str) -> str:  # the id's length sets the frame's
                    return json.dumps({"type": "request", "id": request_id, "endpoint": "completions",
                                       "body": {"max_tokens": 2, "prompt": "hello"}}, separators=(",", ":"))

                request_id = "a" * (2048 - len(frame("")))
                assert len(frame(request_id)) == 2048
                await ws.send_bytes(frame(request_id).encode())  # as binary: refused, the socket stays
                await ws.send_str(frame(request_id))
                frames = [await ws.receive_json(timeout=60) for _ in range(2)]
                while frames[-1]["type"] != "done":
                    frames.append(await ws.receive_json(timeout=60))
                await ws.send_str(frame(request_id + "a"))
                closed = await ws.receive(timeout=60)
        await runner.cleanup()
        return raw, too_big, frames, (closed.type, ws.close_code)

    raw, (status, error), ws_frames, ws_closed = asyncio.run(main())
    assert ws_frames[0]["type"] == "error" and ws_frames[0]["error"]["message"] == "send JSON text frames"
    assert [f["type"] for f in ws_frames[1:]] == ["chunk"] * (len(ws_frames) - 2) + ["done"]
    assert ws_closed == (aiohttp.WSMsgType.CLOSE, 1009)
    frames = raw.split("\n\n")
    assert ": keep-alive" in frames
    data = [f for f in frames if f.startswith("data: ")]
    assert data[-1] == "data: [DONE]" and len(data) > 2
    assert all(f in ("", ": keep-alive") or f.startswith("data: ") for f in frames)
    assert status == 413 and set(error["error"]) == {"message", "type", "param", "code"}


def test_websocket_two_streams_a_cancel_and_bad_frames(llama_dir):
    async def main():
        runner, engine, url = await start(llama_dir)
        kv = engine.engine_core.scheduler.kv_cache_manager
        frames: list[dict] = []
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 12,
                    "temperature": 0}) as r:
                expected = (await r.json())["choices"][0]["message"]["content"]
            async with session.ws_connect(url + "/v1/ws") as ws:
                await ws.send_str("{not json")
                await ws.send_json({"type": "request", "id": "x", "endpoint": "nope", "body": {}})
                await ws.send_json({"type": "request", "id": "a", "endpoint": "chat.completions", "body": {
                    "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 12,
                    "temperature": 0}})
                await ws.send_json({"type": "request", "id": "b", "endpoint": "completions", "body": {
                    "prompt": "hello " * 20, "max_tokens": 400, "ignore_eos": True}})
                done = set()
                cancel_sent = False
                while done != {"a", "b"}:
                    frame = await ws.receive_json(timeout=60)
                    frames.append(frame)
                    if frame["type"] == "chunk" and frame["id"] == "b" and not cancel_sent:
                        await ws.send_json({"type": "cancel", "id": "b"})
                        cancel_sent = True
                    if frame["type"] == "done":
                        done.add(frame["id"])
                # The socket is still open and serves another request.
                await ws.send_json({"type": "request", "id": "c", "endpoint": "completions",
                                    "body": {"prompt": "hi", "max_tokens": 2}})
                while True:
                    frame = await ws.receive_json(timeout=60)
                    if frame["type"] == "done" and frame["id"] == "c":
                        break
        for _ in range(200):
            if kv.num_free_blocks == kv.num_blocks:
                break
            await asyncio.sleep(0.01)
        free = (kv.num_free_blocks, kv.num_blocks)
        await runner.cleanup()
        return frames, expected, free

    frames, expected, (free, total) = asyncio.run(main())
    errors = [f for f in frames if f["type"] == "error"]
    assert [e["id"] for e in errors] == [None, "x"]
    assert "not valid JSON" in errors[0]["error"]["message"] and errors[1]["error"]["param"] == "endpoint"
    chunks_a = [f["data"] for f in frames if f["type"] == "chunk" and f["id"] == "a"]
    assert chunks_a[0]["object"] == "chat.completion.chunk"
    assert chunks_a[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks_a if c["choices"]) == expected
    done = {f["id"]: f for f in frames if f["type"] == "done"}
    assert done["b"].get("cancelled") is True and "cancelled" not in done["a"]
    b_tokens = sum(1 for f in frames if f["type"] == "chunk" and f["id"] == "b")
    assert b_tokens < 100  # cancelled long before its 400 tokens
    assert free == total


def test_websocket_authenticates_with_a_first_auth_frame(llama_dir):
    async def main():
        runner, engine, url = await start(llama_dir, api_key="sekret")
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(url + "/v1/ws") as ws:
                request = {"type": "request", "id": "a", "endpoint": "completions",
                           "body": {"prompt": "hi", "max_tokens": 2}}
                await ws.send_json(request)
                refused = await ws.receive_json(timeout=30)
                await ws.send_json({"type": "auth", "api_key": "wrong"})
                wrong = await ws.receive_json(timeout=30)
                await ws.send_json({"type": "auth", "api_key": "sekret"})
                ok = await ws.receive_json(timeout=30)
                await ws.send_json(request)
                kinds = []
                while not kinds or kinds[-1] != "done":
                    kinds.append((await ws.receive_json(timeout=30))["type"])
        await runner.cleanup()
        return refused, wrong, ok, kinds

    refused, wrong, ok, kinds = asyncio.run(main())
    assert refused["type"] == "error" and refused["error"]["code"] == "invalid_api_key"
    assert wrong["type"] == "error" and ok == {"type": "auth", "ok": True}
    assert kinds[0] == "chunk" and kinds[-1] == "done"


def test_health_says_loading_until_the_model_is_resolved_and_loaded(llama_dir):
    """The config (model resolution: fetch, convert) is built on the engine thread, so the
    server answers while it happens."""
    import threading

    from streamserve.config import ServerConfig

    release = threading.Event()

    async def main():
        engine = AsyncEngine(held_config(llama_dir, release, 30))
        runner = app_runner(engine, ServerConfig(), "tiny")
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/health") as r:
                loading = (r.status, await r.json())
            async with session.post(url + "/v1/completions", json={"prompt": "hi"}) as r:
                early = (r.status, (await r.json())["error"]["type"])
            async with session.get(url + "/v1/models") as r:
                early_models = r.status
            release.set()
            await engine.wait_ready()
            async with session.get(url + "/health") as r:
                ready = (r.status, await r.json())
            async with session.get(url + "/v1/models") as r:
                models = (await r.json())["data"][0]
        await runner.cleanup()
        return loading, early, early_models, ready, models

    loading, early, early_models, ready, models = asyncio.run(main())
    assert loading == (503, {"status": "loading"})
    assert early == (503, "service_unavailable") and early_models == 503
    assert ready == (200, {"status": "ok"})
    assert models["id"] == "tiny" and models["max_model_len"] == 512


def test_an_engine_failure_mid_stream_is_sent_in_band_and_the_engine_survives(llama_dir):
    async def main():
        runner, engine, url = await start(llama_dir)
        core = engine.engine_core
        fail_step(engine, 4)
        async with aiohttp.ClientSession() as session:
            body = {"prompt": "hello", "max_tokens": 30, "temperature": 0, "ignore_eos": True, "stream": True}
            async with session.post(url + "/v1/completions", json=body) as r:
                raw = (await r.read()).decode()
            after = await stream_text(session, url, {"prompt": "hello", "max_tokens": 3, "temperature": 0})
        kv = core.scheduler.kv_cache_manager
        free = (kv.num_free_blocks, kv.num_blocks)
        await runner.cleanup()
        return raw, after, free

    raw, after, (free, total) = asyncio.run(main())
    frames = [f for f in raw.split("\n\n") if f]
    assert frames[-1] == "data: [DONE]"
    error = json.loads(frames[-2][6:])["error"]
    assert error["type"] == "server_error" and "Traceback" not in raw and "injected" not in raw
    assert after  # the next request is served
    assert free == total


def test_closing_a_websocket_aborts_its_requests(llama_dir):
    async def main():
        runner, engine, url = await start(llama_dir)
        core = engine.engine_core
        aborted = record_aborts(engine)
        kv = core.scheduler.kv_cache_manager
        async with aiohttp.ClientSession() as session:
            ws = await session.ws_connect(url + "/v1/ws")
            for rid in ("a", "b"):
                await ws.send_json({"type": "request", "id": rid, "endpoint": "completions", "body": {
                    "prompt": "hello " * 20, "max_tokens": 400, "ignore_eos": True}})
            seen = set()
            while seen != {"a", "b"}:
                seen.add((await ws.receive_json(timeout=30))["id"])
            await ws.close()
        for _ in range(300):
            if not core.has_unfinished_requests() and kv.num_free_blocks == kv.num_blocks:
                break
            await asyncio.sleep(0.01)
        result = (len(set(aborted)), kv.num_free_blocks == kv.num_blocks)
        await runner.cleanup()
        return result

    assert asyncio.run(main()) == (2, True)


def test_sse_bytes_with_aiohttps_client(llama_dir):
    async def main():
        runner, engine, url = await start(llama_dir)
        async with aiohttp.ClientSession() as session:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            async with session.post(url + "/v1/chat/completions", json=body) as r:
                headers, raw = dict(r.headers), await r.read()
        await runner.cleanup()
        return headers, raw

    headers, raw = asyncio.run(main())
    assert headers["Content-Type"] == "text/event-stream"
    assert headers["Cache-Control"] == "no-cache" and headers["X-Accel-Buffering"] == "no"
    assert raw.endswith(b"\n\ndata: [DONE]\n\n")
    frames = raw[:-len(b"data: [DONE]\n\n")].split(b"\n\n")[:-1]
    objects = [json.loads(f.removeprefix(b"data: ")) for f in frames]
    assert all(f.startswith(b"data: {") for f in frames)
    assert all(f == b"data: " + json.dumps(o, separators=(",", ":"), ensure_ascii=False).encode()
               for f, o in zip(frames, objects))  # compact JSON, one object per frame
    assert objects[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [o["choices"][0]["finish_reason"] for o in objects[1:-1]][-1] == "length"
    assert objects[-1]["choices"] == [] and objects[-1]["usage"]["completion_tokens"] == 3
    assert len({o["id"] for o in objects}) == 1 and objects[0]["object"] == "chat.completion.chunk"


def test_a_drain_waits_for_a_call_not_yet_in_the_engine(llama_dir):
    """A call past its checks but not yet in the engine when the drain begins (here held
    0.5 s on its way) is waited for, not cut off for having no engine request yet; a call
    that comes after is refused with a 503."""
    async def main():
        runner, engine, url = await start(llama_dir)
        generate, done = engine.generate, []

        async def late(*args, **kwargs):
            await asyncio.sleep(0.5)
            async for delta in generate(*args, **kwargs):
                yield delta
            done.append(True)

        engine.generate = late
        async with aiohttp.ClientSession() as session:
            call = asyncio.ensure_future(session.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 5}))
            for _ in range(200):  # until the call is being handled (held on its way to the engine)
                if runner.app[HANDLING][0]:
                    break
                await asyncio.sleep(0.01)
            left = await drain(runner.app, 30)
            finished_first = bool(done)
            async with await call as r:
                result = (r.status, (await r.json())["choices"][0]["finish_reason"])
            async with session.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 5}) as r:
                refused = (r.status, (await r.json())["error"]["type"])
        await runner.cleanup()
        return left, finished_first, result, refused

    left, finished_first, result, refused = asyncio.run(main())
    assert left == 0 and finished_first and result == (200, "length")
    assert refused == (503, "service_unavailable")


def test_a_request_of_a_lower_priority_value_takes_the_seat_of_a_running_stream(llama_dir):
    """--scheduling-policy priority with one seat: a priority-0 request sent while a priority-5
    stream runs is answered while that stream waits (preempted), which then runs to its end."""

    async def main():
        runner, engine, url = await start(llama_dir, scheduling_policy="priority", max_num_seqs=1)
        slow_steps(engine, 0.01)
        async with aiohttp.ClientSession() as session:
            low = await session.post(url + "/v1/completions", json={
                "prompt": "hello " * 10, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}, "priority": 5})
            assert low.status == 200
            await low.content.readline()  # it runs
            async with session.post(url + "/v1/completions", json={
                    "prompt": "Paris", "max_tokens": 5, "temperature": 0, "priority": 0}) as r:
                high = await r.json()
            preempted_meanwhile = engine.engine_core.scheduler.num_preemptions
            low_running = engine.engine_core.has_unfinished_requests()
            usage = None
            async for line in low.content:
                line = line.decode().strip()
                if line.startswith("data: {"):
                    usage = json.loads(line[6:]).get("usage") or usage
        await runner.cleanup()
        return high, preempted_meanwhile, low_running, usage

    high, preempted, low_running, usage = asyncio.run(main())
    assert high["usage"]["completion_tokens"] == 5
    assert preempted >= 1 and low_running  # it took the stream's seat, and the stream went on after
    assert usage["completion_tokens"] == 200


def test_a_schema_or_regex_is_compiled_off_the_event_loop(llama_dir, monkeypatch):
    """What a request holds its output to is compiled on a thread of its own before the loop
    builds the request (a large one is most of a second of Python): over HTTP, the websocket
    and the Responses API alike; a bad one is still a 400 naming it, and a body with nothing to
    compile does not wait for the compile thread."""
    import threading

    from streamserve.server import protocol

    threads = []
    compile_ = protocol.structured_outputs
    monkeypatch.setattr(protocol, "structured_outputs",
                        lambda body: threads.append(threading.current_thread()) or compile_(body))

    async def main():
        runner, engine, url = await start(llama_dir)
        loop_thread = threading.current_thread()
        fmt = {"structured_outputs": {"regex": "(ab|cd){2,5}"}}
        try:
            async with aiohttp.ClientSession() as session:
                async with session.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 12, **fmt}) as r:
                    assert r.status == 200
                    assert (await r.json())["choices"][0]["text"][:2] in ("ab", "cd")
                async with session.post(url + "/v1/responses", json={
                        "input": "x", "max_output_tokens": 16,
                        "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "integer"}}}}) as r:
                    assert r.status == 200
                async with session.ws_connect(url + "/v1/ws") as ws:
                    await ws.send_json({"type": "request", "id": "a", "endpoint": "completions",
                                        "body": {"prompt": "x", "max_tokens": 4, **fmt}})
                    while (frame := await ws.receive_json(timeout=60))["type"] not in ("done", "error"):
                        pass
                    assert frame["type"] == "done"
                async with session.post(url + "/v1/completions", json={
                        "prompt": "x", "structured_outputs": {"regex": "(?=a)"}}) as r:
                    assert r.status == 400 and "lookahead" in (await r.json())["error"]["message"]
                for nothing in ({"response_format": {"type": "text"}}, {"tool_choice": "none"},
                                {"response_format": {"type": "json_object"}}):
                    async with session.post(url + "/v1/chat/completions", json={
                            "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **nothing}) as r:
                        assert r.status == 200
                # a completions body's tool_choice is no chat's: ignored, as it was, not compiled
                async with session.post(url + "/v1/completions", json={
                        "prompt": "x", "max_tokens": 2, "tool_choice": "required"}) as r:
                    assert r.status == 200
        finally:
            await runner.cleanup()
        return loop_thread

    loop_thread = asyncio.run(main())
    # each request's first compile ran on another thread, the loop's own call finding it cached;
    # the one it could not compile was refused from there (a failure is not cached: not twice)
    # (and the four with nothing to compile read their bodies on the loop alone)
    assert [t is loop_thread for t in threads] == [False, True] * 3 + [False] + [True] * 4
