"""A streamserve server inside the test process, on a free port (start), or in a process of
its own (start_server)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Callable

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
