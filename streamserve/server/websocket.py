"""GET /v1/ws: many streamed requests at once on one websocket, as JSON text frames.

client -> server
  {"type": "request", "id": "<client's id>", "endpoint": "chat.completions" | "completions",
   "body": {<the POST body>}}                      always streamed
  {"type": "cancel", "id": "..."}
  {"type": "auth", "api_key": "..."}               first frame, when the server has --api-key
                                                   and no Authorization header came
server -> client
  {"type": "chunk", "id": "...", "data": <exactly what an SSE data line would carry>}
  {"type": "done", "id": "..."}                    with "cancelled": true after a cancel
  {"type": "error", "id": "..." | null, "error": {message, type, param, code}}
A bad frame or request gets an error frame; the socket stays open. A frame larger than
--max-request-bytes (the limit of an HTTP body, which gets 413) closes the socket with code
1009, message too big: the rest of such a frame is never read. Protocol-level ping/pong
(heartbeat) keeps idle sockets alive through proxies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Optional
from urllib.parse import urlsplit

import orjson
from aiohttp import WSCloseCode, WSMsgType, web

from streamserve.server.app import (CONFIG, HANDLER_GRACE_SECONDS, SOCKETS, _Call, _chunks, api_key_ok, new_call,
                                    check_body, in_band_error, parse_json, prepare)
from streamserve.server.protocol import APIError, bad_request

logger = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 20.0
_ENDPOINTS = {"chat.completions": True, "completions": False}


class _Socket:
    def __init__(self, request: web.Request, ws: web.WebSocketResponse) -> None:
        self.request, self.ws = request, ws
        self.tasks: dict[str, asyncio.Task] = {}
        self.lock = asyncio.Lock()  # one frame at a time from the per-request tasks
        self.authenticated = api_key_ok(request)

    async def send(self, frame: dict[str, Any]) -> None:
        """Send one frame; one for a client that has already gone is dropped (the read loop
        ends on the lost connection and cancels the client's requests)."""
        async with self.lock:
            if not self.ws.closed:
                with contextlib.suppress(ConnectionResetError):  # the transport closed under us
                    await self.ws.send_str(orjson.dumps(frame).decode())

    async def error(self, request_id: Optional[str], exc: APIError) -> None:
        await self.send({"type": "error", "id": request_id, **exc.body()})

    async def internal_error(self, request_id: Optional[str], what: str) -> None:
        """A frame broke something unforeseen (the exception being handled): logged, and the
        client told, under the request's id where it has one; the socket stays open."""
        logger.exception("unhandled error on %s", what)
        await self.error(request_id, APIError(500, "internal server error", type="server_error"))

    async def handle(self, raw: str) -> None:
        try:
            frame = parse_json(raw)
        except APIError as exc:
            return await self.error(None, exc)
        kind, request_id = frame.get("type"), frame.get("id")
        if not self.authenticated:
            if kind == "auth" and isinstance(frame.get("api_key"), str) \
                    and api_key_ok(self.request, frame["api_key"]):
                self.authenticated = True
                return await self.send({"type": "auth", "ok": True})
            return await self.error(None, APIError(401, "send {\"type\": \"auth\", \"api_key\": ...} "
                                                   "with the right key first", type="authentication_error",
                                                   code="invalid_api_key"))
        if not isinstance(request_id, str):
            request_id = None  # not one a client could have given a request
        if kind == "cancel":
            task = self.tasks.get(request_id)
            if task is None:
                return await self.error(request_id, bad_request(f"no running request with id {frame.get('id')!r}",
                                                                "id"))
            task.cancel()
            return
        if kind != "request":
            return await self.error(request_id, bad_request("'type' must be 'request', 'cancel' or 'auth'", "type"))
        if not request_id:
            return await self.error(None, bad_request("a request needs a non-empty string 'id'", "id"))
        if request_id in self.tasks:
            return await self.error(request_id, bad_request(f"id {request_id!r} is already running", "id"))
        endpoint, body = frame.get("endpoint"), frame.get("body")
        try:
            if endpoint not in _ENDPOINTS:
                raise bad_request("'endpoint' must be 'chat.completions' or 'completions'", "endpoint")
            if not isinstance(body, dict):
                raise bad_request("'body' must be an object", "body")
            call = await new_call(self.request, check_body(self.request, {**body, "stream": True}), _ENDPOINTS[endpoint])
        except APIError as exc:
            return await self.error(request_id, exc)
        except Exception:  # the request's own failure: its id, so the client can end it
            return await self.internal_error(request_id, f"starting websocket request {request_id!r}")
        self.tasks[request_id] = asyncio.create_task(self.run(request_id, call))

    async def run(self, request_id: str, call: _Call) -> None:
        cancelled = False
        try:
            async with contextlib.aclosing(call.outputs()) as outputs:
                async for chunk in _chunks(call, outputs):
                    await self.send({"type": "chunk", "id": request_id, "data": chunk})
        except asyncio.CancelledError:
            cancelled = True  # closing `outputs` above aborted the request in the engine
        except Exception as exc:
            await self.error(request_id, in_band_error(exc, call.id))
        finally:
            self.tasks.pop(request_id, None)
        done = {"type": "done", "id": request_id}
        if cancelled:
            done["cancelled"] = True
        await self.send(done)

    async def close(self) -> None:
        for task in list(self.tasks.values()):
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)


def origin_allowed(request: web.Request) -> bool:
    """Whether the page that opens this socket may. Browsers apply no same-origin rule to
    websockets: without this, any site a user visits could drive (and read) a server on their
    machine. A client that sends no Origin is not a browser page."""
    origin = request.headers.get("Origin")
    if origin is None:
        return True
    allowed = request.app[CONFIG].server.allowed_origins
    extra = {o.strip().rstrip("/") for o in allowed.split(",")} if allowed else set()
    return "*" in extra or origin in extra or urlsplit(origin).netloc == request.host


async def websocket(request: web.Request) -> web.WebSocketResponse:
    if not origin_allowed(request):
        raise APIError(403, f"origin {request.headers['Origin']!r} may not open this websocket "
                       "(see --allowed-origins)", type="permission_error")
    # aiohttp refuses a message of max_msg_size bytes or more: frames of up to the limit pass
    ws = web.WebSocketResponse(heartbeat=HEARTBEAT_SECONDS,
                               max_msg_size=request.app[CONFIG].server.max_request_bytes + 1)
    await prepare(request, ws)
    sock = _Socket(request, ws)
    request.app[SOCKETS].add(sock)
    try:
        async for msg in ws:
            if msg.type == WSMsgType.BINARY:
                await sock.error(None, bad_request("send JSON text frames"))
            elif msg.type == WSMsgType.TEXT:
                try:
                    await sock.handle(msg.data)
                except Exception:
                    await sock.internal_error(None, "a websocket frame")
    finally:
        request.app[SOCKETS].discard(sock)
        await sock.close()
    return ws


async def _close_sockets(app: web.Application) -> None:
    """On shutdown, after the drain: each open socket's streams get a moment to send their
    last frames (those cut off, their error), then the socket is told the server is going away."""
    sockets = list(app[SOCKETS])
    tasks = [task for sock in sockets for task in sock.tasks.values()]
    if tasks:
        await asyncio.wait(tasks, timeout=HANDLER_GRACE_SECONDS)
    for sock in sockets:
        await sock.ws.close(code=WSCloseCode.GOING_AWAY, message=b"the server is shutting down")


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/ws", websocket)
    app.on_shutdown.append(_close_sockets)
