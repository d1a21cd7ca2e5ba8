"""A streamserve server inside the test process, on a free port (start; serve_in_thread, its
loop on a thread of its own, for synchronous clients), or in a process of its own
(start_server); and ways to bend its engine (slow, failing or scripted steps)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Callable, Iterator, NamedTuple

import torch
from aiohttp import web

from streamserve.config import Config
from streamserve.frontend.async_engine import AsyncEngine
from streamserve.server.app import app_runner


async def start(model_dir: str, **settings) -> tuple[web.AppRunner, AsyncEngine, str]:
    """(runner, engine, base URL) of a ready server; `await runner.cleanup()` stops it."""
    config = Config.from_kwargs(model=model_dir, dtype="float32", kv_cache_memory="32MiB", **settings)
    engine = AsyncEngine(config)
    runner = app_runner(engine, config.server, config.served_model_name)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    await engine.wait_ready()
    return runner, engine, f"http://127.0.0.1:{port}"


class LiveServer(NamedTuple):
    url: str
    engine: AsyncEngine
    model_name: str


def serve_in_thread(model_dir: str, **settings) -> Iterator[LiveServer]:
    """A server on a free port, its loop on a thread of its own (for a synchronous client,
    such as Playwright's sync API or the openai client, on this thread); stopped after the
    yield."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="live-server", daemon=True)
    thread.start()
    runner, engine, url = asyncio.run_coroutine_threadsafe(start(model_dir, **settings), loop).result(120)
    try:
        yield LiveServer(url, engine, model_dir)
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


class _ScriptedSampler:
    """The runner's sampler, but each request's n-th token is the script's n-th (then EOS)."""

    def __init__(self, sampler, script: list[int], eos: int) -> None:
        self.sampler, self.script, self.eos = sampler, script, eos

    def sample(self, logits, rows, allowed=None):
        drawn, logprobs = self.sampler.sample(logits, rows, allowed)
        tokens = []
        for row in rows:
            n = len(row.token_ids) - row.num_prompt_tokens
            tokens.append(self.script[n] if n < len(self.script) else self.eos)
        return torch.tensor(tokens, dtype=drawn.dtype, device=drawn.device), logprobs

    def __getattr__(self, name):
        return getattr(self.sampler, name)


@contextlib.contextmanager
def scripted_replies(engine: AsyncEngine, text: str) -> Iterator[None]:
    """Within it, every request the engine runs replies `text` (its tokens, then EOS), as a
    model that says so would: for what a random model would not write by chance."""
    runner = engine.engine_core.model_runner
    sampler = runner.sampler
    runner.sampler = _ScriptedSampler(sampler, engine.tokenizer.encode(text, add_special_tokens=False),
                                      engine.renderer.eos_token_id)
    try:
        yield
    finally:
        runner.sampler = sampler


def record_aborts(engine: AsyncEngine) -> list[str]:
    """The IDs of the requests the engine core aborts from now on (filled as it does)."""
    core, aborted = engine.engine_core, []
    abort = core.abort_requests
    core.abort_requests = lambda ids: (aborted.extend(ids), abort(ids))
    return aborted


def slow_steps(engine: AsyncEngine, seconds: float) -> None:
    """Make each engine step take at least `seconds` longer (requests that run a while)."""
    core = engine.engine_core
    step = core.step
    core.step = lambda: time.sleep(seconds) or step()


def fail_step(engine: AsyncEngine, at: int) -> None:
    """Make the engine's `at`-th step from now on raise (an injected failure)."""
    core = engine.engine_core
    step, calls = core.step, []

    def flaky_step():
        calls.append(1)
        if len(calls) == at:
            raise RuntimeError("injected failure")
        return step()

    core.step = flaky_step


def held_config(model_dir: str, release: threading.Event, seconds: float) -> Callable[[], Config]:
    """An AsyncEngine config builder that first waits (up to `seconds`) for `release`: a model
    still being resolved or loaded."""
    def build() -> Config:
        release.wait(seconds)
        return Config.from_kwargs(model=model_dir, dtype="float32", kv_cache_memory="16MiB")
    return build


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: str, *extra: str):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "streamserve", "--model", model_dir, "--dtype", "float32",
                             "--kv-cache-memory", "16MiB", "--port", str(port), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(proc.stdout.read())
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not become healthy")
