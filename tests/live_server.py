"""A streamserve server inside the test process, on a free port."""

from __future__ import annotations

import threading
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


def held_config(model_dir: str, release: threading.Event, seconds: float) -> Callable[[], Config]:
    """An AsyncEngine config builder that first waits (up to `seconds`) for `release`: a model
    still being resolved or loaded."""
    def build() -> Config:
        release.wait(seconds)
        return Config.from_kwargs(model=model_dir, dtype="float32", kv_cache_memory="16MiB")
    return build
