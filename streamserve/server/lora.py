"""Loading and unloading LoRA adapters while serving (vLLM's POST /v1/load_lora_adapter and
/v1/unload_lora_adapter), present only where VLLM_ALLOW_RUNTIME_LORA_UPDATING is true (as in
vLLM: any client with the API key may then make the server read a directory of its disk).

An adapter is read on a thread of its own, never the event loop or the engine thread; once
loaded, requests name it as their model. Unloading refuses new requests for it while those
in flight finish on it (lora/registry.py).
"""

from __future__ import annotations

import asyncio
import logging
import os

from aiohttp import web

from streamserve.lora.registry import LoRARegistry
from streamserve.server.app import CONFIG, ENGINE, check_api_key, check_ready, parse_json
from streamserve.server.protocol import APIError, bad_request

logger = logging.getLogger(__name__)


def runtime_updating_allowed() -> bool:
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").strip().lower() in ("1", "true")


def add_routes(app: web.Application) -> None:
    if runtime_updating_allowed():
        app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)


async def _body(request: web.Request) -> tuple[LoRARegistry, dict, str]:
    """The registry, the body and its lora_name, checked."""
    check_api_key(request)
    check_ready(request)
    body = parse_json(await request.read())
    loras = request.app[ENGINE].loras
    if loras is None:
        raise bad_request("this server serves no LoRA adapters: start it with --enable-lora")
    name = body.get("lora_name")
    if not isinstance(name, str) or not name.strip():
        raise bad_request("'lora_name' (a non-empty string) is required", "lora_name")
    return loras, body, name


async def load_lora_adapter(request: web.Request) -> web.Response:
    """{"lora_name", "lora_path"}: read the adapter and serve it under that name."""
    loras, body, name = await _body(request)
    path = body.get("lora_path")
    if not isinstance(path, str) or not path:
        raise bad_request("'lora_path' (the adapter's directory, on the server) is required", "lora_path")
    if name in request.app[CONFIG].names:
        raise bad_request(f"'{name}' is the served model's name: give the adapter another", "lora_name")
    try:
        adapter = await asyncio.to_thread(loras.load, name, path)
    except ValueError as exc:
        raise bad_request(str(exc), "lora_name" if "already been loaded" in str(exc) else "lora_path") from None
    logger.info("LoRA adapter %r loaded: rank %d, %d layers, %.1f MB, from %s", name, adapter.rank,
                len(adapter.weights), adapter.nbytes / 1e6, path)
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    """{"lora_name"}: refuse new requests for the adapter (those in flight finish on it)."""
    loras, _, name = await _body(request)
    if not loras.remove(name):
        raise APIError(404, f"the LoRA adapter '{name}' cannot be found", param="lora_name",
                       type="not_found_error")
    logger.info("LoRA adapter %r unloaded", name)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
