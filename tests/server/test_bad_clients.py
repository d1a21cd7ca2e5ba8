"""Clients that send what they should not, or leave early: each gets its own clear error
(or is simply aborted), and nobody else is touched."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import shutil
import socket
import struct

import aiohttp

from live_server import record_aborts, slow_steps, start


def long_body(**extra) -> dict:
    return {"prompt": "hello " * 10, "max_tokens": 120, "temperature": 0, "ignore_eos": True, **extra}


async def read_stream(response: aiohttp.ClientResponse) -> list[dict]:
    frames = []
    async for line in response.content:
        line = line.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            frames.append(json.loads(line[6:]))
    return frames


async def settle(engine) -> tuple[int, int, bool]:
    """(free KV blocks, all blocks, requests left) once the engine has gone idle."""
    kv = engine.engine_core.scheduler.kv_cache_manager
    for _ in range(500):
        if not engine.engine_core.has_unfinished_requests() and kv.num_free_blocks == kv.num_blocks:
            break
        await asyncio.sleep(0.02)
    return kv.num_free_blocks, kv.num_blocks, engine.engine_core.has_unfinished_requests()


def test_a_seed_out_of_range_is_refused_and_harms_no_one(llama_dir):
    """A seed must fit 64 bits; sample k of n draws from seed + k, wrapping at 2^64 (it once
    overflowed inside the engine step and failed every request running with it)."""
    async def main():
        runner, engine, url = await start(llama_dir)
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/completions", json=long_body(stream=True)) as stream:
                await stream.content.readline()  # it runs
                async with session.post(url + "/v1/completions", json={
                        "prompt": "x", "max_tokens": 3, "seed": 2 ** 64, "temperature": 1}) as r:
                    too_big = (r.status, await r.json())
                sample = {"prompt": "x", "max_tokens": 8, "temperature": 1, "ignore_eos": True}
                async with session.post(url + "/v1/completions", json={**sample, "seed": 2 ** 64 - 1, "n": 2}) as r:
                    wrapped = (r.status, await r.json())
                alone = []
                for seed in (2 ** 64 - 1, 0):
                    async with session.post(url + "/v1/completions", json={**sample, "seed": seed}) as r:
                        alone.append((await r.json())["choices"][0]["text"])
                frames = await read_stream(stream)
        await runner.cleanup()
        return too_big, wrapped, alone, frames

    (status, error), (ok, body), alone, frames = asyncio.run(main())
    assert status == 400 and "seed" in error["error"]["message"]
    assert ok == 200 and [c["text"] for c in body["choices"]] == alone  # seeds 2^64 - 1, then 0
    assert alone[0] != alone[1]
    assert not any("error" in f for f in frames) and frames[-1]["choices"][0]["finish_reason"] == "length"


def test_the_chat_templates_own_error_is_a_400(llama_dir, tmp_path):
    """A template that refuses a conversation (raise_exception, as Mistral's does when the
    roles do not alternate) is the client's error: 400 over HTTP and /tokenize, an error frame
    over a websocket, which stays open."""
    model = tmp_path / "strict"
    shutil.copytree(llama_dir, model)
    (model / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('conversations start with the user') }}"
        "{% endif %}{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    bad = {"messages": [{"role": "assistant", "content": "x"}], "max_tokens": 2}

    async def main():
        runner, engine, url = await start(str(model))
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/chat/completions", json=bad) as r:
                chat = (r.status, await r.json())
            async with session.post(url + "/tokenize", json={"messages": bad["messages"]}) as r:
                tokenize = (r.status, await r.json())
            async with session.ws_connect(url + "/v1/ws") as ws:
                await ws.send_json({"type": "request", "id": "a", "endpoint": "chat.completions", "body": bad})
                refused = await ws.receive_json(timeout=30)
                await ws.send_json({"type": "request", "id": "b", "endpoint": "completions",
                                    "body": {"prompt": "hi", "max_tokens": 2}})
                frames = [await ws.receive_json(timeout=30)]
                while frames[-1]["type"] != "done":
                    frames.append(await ws.receive_json(timeout=30))
        await runner.cleanup()
        return chat, tokenize, refused, frames

    (status, error), (tok_status, tok_error), refused, frames = asyncio.run(main())
    assert status == 400 and "conversations start with the user" in error["error"]["message"]
    assert error["error"]["param"] == "messages"
    assert tok_status == 400 and "conversations start with the user" in tok_error["error"]["message"]
    assert refused["type"] == "error" and refused["id"] == "a" and refused["error"]["type"] == "invalid_request_error"
    assert frames[-1] == {"type": "done", "id": "b"}


def test_bad_websocket_frames_leave_the_socket_and_its_streams_alone(llama_dir):
    """A cancel whose id is not a string, or a request whose prompt IDs are out of range
    (with echo, which decodes them), gets an error frame; the stream already running goes
    on to its end, not cancelled."""
    async def main():
        runner, engine, url = await start(llama_dir)
        frames: list[dict] = []
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(url + "/v1/ws") as ws:
                await ws.send_json({"type": "request", "id": "long", "endpoint": "completions",
                                    "body": long_body()})
                await ws.send_json({"type": "cancel", "id": ["long"]})
                await ws.send_json({"type": "cancel", "id": {"a": 1}})
                await ws.send_json({"type": "request", "id": "echo", "endpoint": "completions",
                                    "body": {"prompt": [-5], "echo": True, "max_tokens": 2}})
                while not frames or frames[-1] != {"type": "done", "id": "long"}:
                    frames.append(await ws.receive_json(timeout=60))
        await runner.cleanup()
        return frames

    frames = asyncio.run(main())
    errors = [f for f in frames if f["type"] == "error"]
    assert [e["id"] for e in errors] == [None, None, "echo"]
    assert errors[2]["error"]["param"] == "prompt"
    chunks = [f["data"] for f in frames if f["type"] == "chunk" and f["id"] == "long"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_echo_of_token_ids_out_of_range_is_a_400(llama_dir):
    async def main():
        runner, engine, url = await start(llama_dir)
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/completions", json={"prompt": [-5], "echo": True}) as r:
                result = (r.status, await r.json())
        await runner.cleanup()
        return result

    status, error = asyncio.run(main())
    assert status == 400 and error["error"]["param"] == "prompt"


def test_a_request_that_is_not_streamed_is_aborted_when_its_client_leaves(llama_dir):
    async def main():
        runner, engine, url = await start(llama_dir)
        slow_steps(engine, 0.005)  # its 400 tokens take at least 2 s
        aborted = record_aborts(engine)
        async with aiohttp.ClientSession() as session:
            with contextlib.suppress(asyncio.TimeoutError):
                await session.post(url + "/v1/completions", json=long_body(max_tokens=400, n=4),
                                   timeout=aiohttp.ClientTimeout(total=0.5))
        left = await settle(engine)
        await runner.cleanup()
        return left, aborted

    (free, total, busy), aborted = asyncio.run(main())
    assert free == total and not busy
    assert len(set(aborted)) == 4  # every sample aborted, none ran to its end


def test_leaving_a_stream_that_only_had_keepalives_aborts_it_quietly(llama_dir, caplog):
    """A stream still waiting for a slot (only keep-alive comments so far) whose client
    leaves: the request is aborted, with no error logged (the read in flight used to be left
    running while the outputs were closed under it)."""
    async def main():
        runner, engine, url = await start(llama_dir, max_num_seqs=1, sse_keepalive_seconds=0.05)
        slow_steps(engine, 0.005)  # the busy request holds the one slot a while
        aborted = record_aborts(engine)
        async with aiohttp.ClientSession() as session:
            busy = asyncio.ensure_future(session.post(url + "/v1/completions", json=long_body(max_tokens=200)))
            await asyncio.sleep(0.2)
            async with session.post(url + "/v1/completions", json=long_body(stream=True, max_tokens=400)) as waiting:
                assert (await waiting.content.readline()).startswith(b": keep-alive")
                await waiting.content.readline()
                waiting.close()
            await asyncio.sleep(0.3)
            (await busy).close()  # the busy one ran to its end
        left = await settle(engine)
        await runner.cleanup()
        return left, aborted

    with caplog.at_level(logging.ERROR):
        (free, total, busy), aborted = asyncio.run(main())
    assert free == total and not busy
    assert len(aborted) == 1  # the waiting one, never run
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_only_the_servers_own_pages_may_open_its_websocket(llama_dir):
    """Browsers let any site open a websocket to localhost and read it: a page of another
    origin is refused (403) unless --allowed-origins names it; clients with no Origin (not
    browsers) and the server's own page are let in. A NUL in a static file name is a 404."""
    async def main():
        results = {}
        for allowed in (None, "https://chat.example, http://other:9"):
            runner, engine, url = await start(llama_dir, allowed_origins=allowed)
            async with aiohttp.ClientSession() as session:
                for name, origin in ((None, None), ("own", url), ("evil", "https://evil.example"),
                                     ("chat", "https://chat.example")):
                    try:
                        async with session.ws_connect(url + "/v1/ws", origin=origin) as ws:
                            await ws.send_json({"type": "request", "id": "a", "endpoint": "completions",
                                                "body": {"prompt": "hi", "max_tokens": 1}})
                            results[allowed, name] = (await ws.receive_json(timeout=30))["type"]
                    except aiohttp.WSServerHandshakeError as exc:
                        results[allowed, name] = exc.status
                async with session.get(url + "/static/chat.js%00") as r:
                    results["nul"] = r.status
            await runner.cleanup()
        return results

    results = asyncio.run(main())
    assert results["nul"] == 404
    for allowed in (None, "https://chat.example, http://other:9"):
        assert results[allowed, None] == results[allowed, "own"] == "chunk"
        assert results[allowed, "evil"] == 403
    assert results[None, "chat"] == 403
    assert results["https://chat.example, http://other:9", "chat"] == "chunk"


def test_leaving_a_batch_aborts_every_prompt_in_it(llama_dir, caplog):
    """A completions batch (3 prompts, n=2) whose client leaves after the first chunk, streamed
    or not: all six samples are aborted and their blocks freed, with no error logged."""
    async def main():
        runner, engine, url = await start(llama_dir)
        slow_steps(engine, 0.005)
        aborted = record_aborts(engine)
        batch = long_body(prompt=["hello " * 10, "world " * 12, [5, 6, 7]], n=2, max_tokens=400)
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/completions", json={**batch, "stream": True}) as stream:
                assert stream.status == 200 and (await stream.content.readline()).startswith(b"data: {")
                stream.close()
            left_streamed, num_streamed = await settle(engine), len(set(aborted))
            with contextlib.suppress(asyncio.TimeoutError):
                await session.post(url + "/v1/completions", json=batch, timeout=aiohttp.ClientTimeout(total=0.5))
            left = await settle(engine)
        await runner.cleanup()
        return left_streamed, left, num_streamed, len(set(aborted))

    with caplog.at_level(logging.ERROR):
        left_streamed, left, num_streamed, num_aborted = asyncio.run(main())
    for free, total, busy in (left_streamed, left):
        assert free == total and not busy
    assert (num_streamed, num_aborted) == (6, 12)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_a_websocket_client_that_resets_with_frames_unanswered_logs_no_error(llama_dir, caplog):
    """A client that sends many frames needing an answer and then resets its connection: the
    server reads the frames still buffered, and the answers it can no longer send are dropped,
    not logged as errors of the server's own (they were, with a traceback each)."""
    async def main():
        runner, engine, url = await start(llama_dir)
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        key = base64.b64encode(os.urandom(16)).decode()
        writer.write((f"GET /v1/ws HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                      f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 101")
        payload = b'{"type": "nope"}'
        mask = os.urandom(4)
        frame = bytes([0x81, 0x80 | len(payload)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        writer.write(frame * 2000)
        await writer.drain()
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
        writer.transport.abort()
        await asyncio.sleep(0.5)
        async with aiohttp.ClientSession() as session:
            async with session.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as r:
                status = r.status
        await runner.cleanup()
        return status

    with caplog.at_level(logging.ERROR):
        status = asyncio.run(main())
    assert status == 200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
