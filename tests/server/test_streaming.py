"""The server in this process (aiohttp runner + client): many concurrent streams, and
streams the client abandons, which must give their KV blocks back."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from streamserve.config import Config
from streamserve.frontend.async_engine import AsyncEngine
from streamserve.server.app import build_app


async def start(model_dir: str, **settings):
    config = Config.from_kwargs(model=model_dir, dtype="float32", kv_cache_memory="32MiB", **settings)
    engine = AsyncEngine(config)
    runner = web.AppRunner(build_app(config, engine))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    await engine.wait_ready()
    return runner, engine, f"http://127.0.0.1:{port}"


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
        aborted: list[str] = []
        abort = core.abort_requests
        core.abort_requests = lambda ids: (aborted.extend(ids), abort(ids))
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


def test_metrics_count_what_was_served(llama_dir):
    async def main():
        runner, engine, url = await start(llama_dir)
        async with aiohttp.ClientSession() as session:
            for prompt in ("hello world " * 3, "hello world " * 3 + "again"):
                await stream_text(session, url, {"prompt": prompt, "max_tokens": 5, "temperature": 0,
                                                 "ignore_eos": True})
            async with session.get(url + "/metrics") as r:
                assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
                text = await r.text()
        await runner.cleanup()
        return text

    text = asyncio.run(main())
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
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
    assert values[f'streamserve:prompt_tokens_total{{model_name="{name}"}}'] > 0


def test_keepalive_comments_and_body_limit(llama_dir):
    async def main():
        runner, engine, url = await start(llama_dir, sse_keepalive_seconds=0.0005, max_request_bytes=2048)
        async with aiohttp.ClientSession() as session:
            body = {"prompt": "hello", "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
            async with session.post(url + "/v1/completions", json=body) as r:
                raw = (await r.read()).decode()
            async with session.post(url + "/v1/completions", json={"prompt": "x" * 5000}) as r:
                too_big = (r.status, await r.json())
        await runner.cleanup()
        return raw, too_big

    raw, (status, error) = asyncio.run(main())
    frames = raw.split("\n\n")
    assert ": keep-alive" in frames
    data = [f for f in frames if f.startswith("data: ")]
    assert data[-1] == "data: [DONE]" and len(data) > 2
    assert all(f in ("", ": keep-alive") or f.startswith("data: ") for f in frames)
    assert status == 413 and set(error["error"]) == {"message", "type", "param", "code"}
