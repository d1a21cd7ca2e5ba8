"""How long a stream stalls while other requests' regexes compile: a streamed completion's
largest gap between chunks while requests with new (uncached) regexes arrive, with their
compiles on a thread of their own (app.compile_ahead) and, for the baseline, on the event loop
(compile_ahead turned off in this process), rounds alternating.

    python scripts/bench_compile_stall.py [--model DIR] [--requests 4] [--rounds 3]

Each regex, ([^\\n]{1,N}\\n){1,30} for a fresh N from 100 up, takes 60-90 ms of Python to
compile (a schema or regex may take up to a few hundred ms).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import time

import aiohttp

from streamserve.config import Config
from streamserve.frontend.async_engine import AsyncEngine
from streamserve.server import app as app_module
from streamserve.server.app import app_runner

REGEX = r"([^\n]{1,%d}\n){1,30}"  # a fresh N from 100 up: 60-90 ms each to compile (none cached)


async def one_round(session, url: str, n: int, fresh) -> float:
    """The stream's largest gap between chunks (s) while n structured requests arrive."""
    body = {"prompt": "Once upon a time", "max_tokens": 160, "ignore_eos": True, "stream": True}
    times = []
    async with session.post(url + "/v1/completions", json=body) as r:
        others = None
        async for line in r.content:
            if line.startswith(b"data:"):
                times.append(time.perf_counter())
                if len(times) == 20:  # well into the stream
                    others = asyncio.gather(*(session.post(url + "/v1/completions", json={
                        "prompt": "x", "max_tokens": 1, "structured_outputs": {"regex": REGEX % next(fresh)}})
                        for _ in range(n)))
        responses = await others
        assert all(resp.status == 200 for resp in responses), [resp.status for resp in responses]
    return max(b - a for a, b in zip(times, times[1:]))


async def main(args) -> None:
    config = Config.from_kwargs(model=args.model)
    engine = AsyncEngine(config)
    runner = app_runner(engine, config.server, config.served_model_name)
    await runner.setup()
    from aiohttp import web
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    await engine.wait_ready()
    ahead = app_module.compile_ahead
    fresh = itertools.count(100)

    async def on_loop(request, body):  # the baseline: _Call compiles on the loop
        return None
    gaps = {"on a thread": [], "on the loop": []}
    async with aiohttp.ClientSession() as session:
        await one_round(session, url, 1, fresh)  # warm up
        for _ in range(args.rounds):
            for name, fn in (("on a thread", ahead), ("on the loop", on_loop)):
                app_module.compile_ahead = fn
                gaps[name].append(await one_round(session, url, args.requests, fresh))
    app_module.compile_ahead = ahead
    await runner.cleanup()
    for name, values in gaps.items():
        print(f"compiles {name:12s}: the stream's largest gap {statistics.median(values) * 1000:6.0f} ms "
              f"(median of {args.rounds} rounds; each {', '.join(f'{v * 1000:.0f}' for v in values)})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--requests", type=int, default=4, help="structured requests arriving mid-stream")
    parser.add_argument("--rounds", type=int, default=3)
    asyncio.run(main(parser.parse_args()))
