"""The aiohttp app: OpenAI-compatible completions and chat completions, streamed over SSE.

Routes: GET /health, GET /version, GET /metrics, GET /v1/models, POST /v1/completions,
POST /v1/chat/completions, POST /v1/responses with GET and DELETE /v1/responses/{id}
(responses.py), POST /v1/embeddings (embeddings.py), POST /v1/score and /v1/rerank (scoring.py),
POST /tokenize, POST /detokenize, and
GET / with GET /static/*:
the chat page (streamserve/static/), which talks to GET /v1/ws (websocket.py). One
middleware turns every exception into OpenAI's error body with the right status; no stack
trace reaches a client.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import hmac
import logging
import pathlib
import time
import uuid
from typing import Any, AsyncIterator, Callable, Iterable, NamedTuple, Optional, TypeVar

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

import streamserve
from streamserve.config import ServerConfig
from streamserve.frontend.async_engine import AsyncEngine, EngineDeadError
from streamserve.lora.adapter import LoRAAdapter
from streamserve.outputs import CompletionOutput, Logprob, RequestOutput
from streamserve.sampling_params import ParamError
from streamserve.server import protocol
from streamserve.server.metrics import Metrics, log_stats, log_stats_interval
from streamserve.server.protocol import APIError, bad_request
from streamserve.server.reasoning import ReasoningReader, opens_thinking, reasoning_fields
from streamserve.server.tools import ToolCallReader, tool_calling, tools_for_template

T = TypeVar("T")
logger = logging.getLogger(__name__)

class Serving(NamedTuple):
    """What the app knows before the model is loaded."""

    server: ServerConfig
    model_name: str  # the name responses give the model
    created: int  # when the app was built (unix seconds): /v1/models' "created"
    names: tuple[str, ...]  # every name a request may give it (--served-model-name's several)


ENGINE = web.AppKey("engine", AsyncEngine)
READY_LOG = web.AppKey("ready_log", asyncio.Task)
STATS_LOG = web.AppKey("stats_log", asyncio.Task)  # the periodic stats lines (log_stats)
METRICS = web.AppKey("metrics", Metrics)
CONFIG = web.AppKey("serving", Serving)
DRAINING = web.AppKey("draining", asyncio.Event)  # set on shutdown: new requests are refused
# the API calls being handled (POSTs, and websocket streams): a drain waits for them, so a
# request read just before the signal is not cut off for having not reached the engine yet
HANDLING = web.AppKey("handling", list)  # [count]
SOCKETS = web.AppKey("websockets", set)  # the open websocket.py _Sockets, closed (1001) on shutdown
# what a handler still running when the drain ends (or at a second signal) gets to finish its writes
HANDLER_GRACE_SECONDS = 1.0
# a request's key: its streamed response has begun (web.RequestKey where aiohttp has it, >= 3.12)
STARTED = web.RequestKey("response_started", bool) if hasattr(web, "RequestKey") else "streamserve.started"

STATIC_DIR = pathlib.Path(__file__).resolve().parent.parent / "static"
# The chat page runs only its own scripts and talks only to this server: no inline script,
# no other origin, so text that slipped into the DOM as HTML still could not run.
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
                "object-src 'none'; base-uri 'none'; frame-ancestors 'none'",
                "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


@web.middleware
async def counting_middleware(request: web.Request, handler):
    """Counts the POSTs being handled (every API call that generates is one), for `drain`."""
    if request.method != "POST":
        return await handler(request)
    request.app[HANDLING][0] += 1
    try:
        return await handler(request)
    finally:
        request.app[HANDLING][0] -= 1


@web.middleware
async def errors_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except APIError as exc:
        return json_response(exc.body(), exc.status)
    except EngineDeadError as exc:  # the server shutting down cut the request off
        return json_response(unavailable(exc).body(), 503)
    except web.HTTPException as exc:  # aiohttp's own (404 route, 405 method, 413 body size)
        kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
        message = exc.text if exc.status == 413 and exc.text else exc.reason
        return json_response(APIError(exc.status, message, type=kind).body(), exc.status)
    except Exception:
        logger.exception("unhandled error on %s", request.path)
        if request.get(STARTED):  # a stream or websocket already answered: aiohttp closes it
            raise
        return json_response(APIError(500, "internal server error", type="server_error").body(), 500)


def build_app(engine: AsyncEngine, server: ServerConfig, model_name: str) -> web.Application:
    """The app; it listens while `engine` loads (on_startup starts the loading)."""
    app = web.Application(middlewares=[counting_middleware, errors_middleware],
                          client_max_size=server.max_request_bytes)
    app[CONFIG] = Serving(server, model_name, int(time.time()), tuple(server.served_model_name or [model_name]))
    app[ENGINE] = engine
    app[METRICS] = Metrics(engine, model_name)
    app[DRAINING] = asyncio.Event()
    app[HANDLING] = [0]
    app[SOCKETS] = set()
    app.router.add_get("/", chat_page)
    app.router.add_get("/static/{name}", static_file)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/version", version)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    from streamserve.server import embeddings, lora, responses, scoring, websocket  # they import this module's helpers
    lora.add_routes(app)
    embeddings.add_routes(app)
    scoring.add_routes(app)
    responses.add_routes(app)
    websocket.add_routes(app)

    async def on_startup(app: web.Application) -> None:
        engine.start()
        app[READY_LOG] = asyncio.create_task(_log_when_ready(model_name, engine))
        if not server.disable_log_stats:
            app[STATS_LOG] = asyncio.create_task(log_stats(engine, log_stats_interval()))

    async def on_cleanup(app: web.Application) -> None:
        if STATS_LOG in app:
            app[STATS_LOG].cancel()
        await engine.shutdown()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


def app_runner(engine: AsyncEngine, server: ServerConfig, model_name: str) -> web.AppRunner:
    """The runner to serve build_app's app with. A handler whose client disconnects is
    cancelled (aiohttp's handler_cancellation, off by default since 3.9): a request that is
    not streamed is aborted then too, as a stream is when its next write fails. Its cleanup
    gives the handlers still running HANDLER_GRACE_SECONDS, then cancels them (`drain` first
    lets the requests in flight finish)."""
    return web.AppRunner(build_app(engine, server, model_name), handler_cancellation=True,
                         shutdown_timeout=HANDLER_GRACE_SECONDS)


async def drain(app: web.Application, timeout: float, cut: Optional[asyncio.Event] = None) -> int:
    """Refuse new requests (503) and wait up to `timeout` seconds (or until `cut` is set) for
    those in flight to finish: in the engine, and API calls still on their way to it; how
    many engine requests are still running."""
    app[DRAINING].set()
    engine = app[ENGINE]
    deadline = time.monotonic() + timeout

    def busy() -> bool:
        return bool(engine.num_in_flight or app[HANDLING][0] or any(s.tasks for s in app[SOCKETS]))

    while busy() and time.monotonic() < deadline and not (cut is not None and cut.is_set()):
        await asyncio.sleep(0.05)
    return engine.num_in_flight


async def _log_when_ready(model_name: str, engine: AsyncEngine) -> None:
    try:
        await engine.wait_ready()
    except Exception:  # reported by /health, and by the command line, which then exits
        return
    config = engine.config
    runner = engine.engine_core.model_runner
    tokens = runner.num_blocks * config.cache.block_size
    logger.info("ready: model %s (%s), dtype %s (computing in %s), device %s, %d KV blocks "
                "(%d tokens, %s), up to %.1f sequences of max_model_len %d at once",
                model_name, config.model.model, config.model.torch_dtype, runner.dtype,
                config.device.device, runner.num_blocks, tokens, str(runner.kv_dtype).removeprefix("torch."),
                tokens / config.model.max_model_len,
                config.model.max_model_len)
    if config.model.sampling_defaults:  # (as vLLM says so)
        logger.info("sampling defaults from the model's generation config, for requests that leave them unset: "
                    "%s (--generation-config vllm turns them off)", config.model.sampling_defaults)


async def chat_page(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "index.html", headers=PAGE_HEADERS)


async def static_file(request: web.Request) -> web.FileResponse:
    """A file directly in streamserve/static/; anything else is a 404 like any other."""
    try:
        path = (STATIC_DIR / request.match_info["name"]).resolve()
    except ValueError:  # a NUL in the name
        raise web.HTTPNotFound() from None
    if path.parent != STATIC_DIR or not path.is_file():
        raise web.HTTPNotFound()
    return web.FileResponse(path, headers={"X-Content-Type-Options": "nosniff"})


async def health(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if engine.load_error is not None:
        return json_response({"status": "error", "error": str(engine.load_error)}, 503)
    if not engine.is_ready:
        return json_response({"status": "loading"}, 503)
    if request.app[DRAINING].is_set():
        return json_response({"status": "shutting down"}, 503)
    return json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[METRICS].render(),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})


async def version(request: web.Request) -> web.Response:
    return json_response({"version": streamserve.__version__})


async def models(request: web.Request) -> web.Response:
    check_api_key(request)
    check_ready(request)
    serving, engine = request.app[CONFIG], request.app[ENGINE]
    config = engine.config.model

    def card(name: str, root: str, parent: Optional[str]) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": serving.created, "owned_by": "streamserve",
                "root": root, "parent": parent, "max_model_len": config.max_model_len}
    # the LoRA adapters after the model, each its child (as vLLM lists them)
    adapters = engine.loras.adapters() if engine.loras is not None else []
    return json_response({"object": "list", "data": [card(name, config.source or config.model, None)
                                                     for name in serving.names]
                          + [card(a.name, a.path, a.base_model_name or serving.model_name) for a in adapters]})


def api_key_ok(request: web.Request, given: Optional[str] = None) -> bool:
    """True without --api-key, or when the key came as `Authorization: Bearer KEY` or `given`."""
    key = request.app[CONFIG].server.api_key
    if key is None:
        return True
    header = request.headers.get("Authorization", "")
    sent = given if given is not None else header[7:] if header.startswith("Bearer ") else None
    return sent is not None and hmac.compare_digest(sent.encode(), key.encode())  # in constant time


def check_api_key(request: web.Request) -> None:
    if not api_key_ok(request):
        raise APIError(401, "missing or wrong API key", type="authentication_error",
                       code="invalid_api_key")


async def read_body(request: web.Request) -> dict[str, Any]:
    check_api_key(request)
    return check_body(request, parse_json(await request.read()))


def parse_json(raw: bytes | str) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    return body


def check_ready(request: web.Request) -> None:
    engine = request.app[ENGINE]
    if request.app[DRAINING].is_set():
        raise APIError(503, "the server is shutting down", type="service_unavailable")
    if not engine.is_ready:
        raise APIError(503, "the model is still loading" if engine.load_error is None else
                       "the engine failed to load", type="service_unavailable")


def check_body(request: web.Request, body: dict[str, Any]) -> dict[str, Any]:
    """The checks every generation body passes: engine ready, known model."""
    check_ready(request)
    served_adapter(request, body.get("model"))
    return body


def served_adapter(request: web.Request, model: Any) -> Optional[LoRAAdapter]:
    """The LoRA adapter a body's model names; None for the served model (or none named). A name
    that is neither is a 404."""
    served = request.app[CONFIG].names
    if model is None or model in served:
        return None
    loras = request.app[ENGINE].loras
    adapter = loras.get(model) if loras is not None and isinstance(model, str) else None
    if adapter is None:
        names = list(served) + ([a.name for a in loras.adapters()] if loras is not None else [])
        raise APIError(404, f"the model '{model}' does not exist; this server serves "
                       + ", ".join(f"'{name}'" for name in names),
                       param="model", type="not_found_error", code="model_not_found")
    return adapter


async def tokenize(request: web.Request) -> web.Response:
    """{"prompt": text} or {"messages": [...]} -> {"tokens", "count", "max_model_len"}, and with
    "return_token_strs": true, as in vLLM, "token_strs": each token as the vocabulary spells it."""
    body = await read_body(request)
    renderer = request.app[ENGINE].renderer
    strs = body.get("return_token_strs", False)
    if not isinstance(strs, bool):
        raise bad_request("'return_token_strs' must be a boolean", "return_token_strs")
    if "messages" in body:
        tokens = encode_chat(request.app[ENGINE], body, tools_for_template(body))
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad_request("'prompt' (a string) or 'messages' is required", "prompt")
        tokens = renderer.encode(prompt)
    reply = {"tokens": tokens, "count": len(tokens),
             "max_model_len": request.app[ENGINE].config.model.max_model_len}
    if strs:
        reply["token_strs"] = request.app[ENGINE].tokenizer.convert_ids_to_tokens(tokens)
    return json_response(reply)


def request_priority(engine: AsyncEngine, body: dict[str, Any]) -> int:
    """The body's vLLM priority (0 if none): lower runs first under --scheduling-policy priority."""
    priority = body.get("priority", 0)
    try:
        engine.input_processor.check_priority(priority)
    except ParamError as exc:
        raise bad_request(str(exc), exc.param) from None
    return priority


def encode_chat(engine: AsyncEngine, body: dict[str, Any], tools: Optional[list[dict[str, Any]]]) -> list[int]:
    """A chat body's messages (and checked tools) through the chat template, as its options
    say, to token IDs."""
    messages, options = protocol.chat_messages(body), protocol.chat_options(body)
    try:
        return engine.renderer.encode_chat(messages, options.add_generation_prompt, options.chat_template_kwargs,
                                           options.continue_final_message, tools)
    except ValueError as exc:  # the template's refusal is about the messages
        raise bad_request(str(exc), exc.param if isinstance(exc, ParamError) else "messages") from None


async def detokenize(request: web.Request) -> web.Response:
    """{"tokens": [ids]} -> {"prompt": text}."""
    body = await read_body(request)
    tokens = body.get("tokens")
    vocab = request.app[ENGINE].engine_core.vocab_size
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                               and 0 <= t < vocab for t in tokens):
        raise bad_request(f"'tokens' must be a list of token IDs in [0, {vocab})", "tokens")
    return json_response({"prompt": request.app[ENGINE].tokenizer.decode(tokens)})


def _token_name(token_id: int, lp: Logprob, as_ids: bool) -> str:
    """A logprob's token as the response names it: its text, or with vLLM's
    return_tokens_as_token_ids "token_id:N" (tokens that are no whole text told apart)."""
    return f"token_id:{token_id}" if as_ids else lp.decoded_token or ""


def _chat_logprob(entry: dict[int, Logprob], n: int, as_ids: bool = False) -> dict[str, Any]:
    """One chat token's logprob entry: the sampled token (first in `entry`) and its top n."""
    sampled = next(iter(entry.items()))
    top = sorted(((t, lp) for t, lp in entry.items() if lp.rank <= n), key=lambda item: item[1].rank)[:n]
    shape = lambda t, lp: {"token": _token_name(t, lp, as_ids), "logprob": lp.logprob,  # noqa: E731
                           "bytes": list(lp.token_bytes if lp.token_bytes is not None
                                         else (lp.decoded_token or "").encode())}
    return {**shape(*sampled), "top_logprobs": [shape(t, lp) for t, lp in top]}


def _top_by_text(entry: dict[int, Logprob], as_ids: bool = False) -> dict[str, float]:
    """Completions' top_logprobs, keyed by text (or "token_id:N"): where tokens decode alike,
    the sampled token (first in `entry`) keeps its own value, then the better-ranked one."""
    top: dict[str, float] = {}
    for token_id, lp in entry.items():
        top.setdefault(_token_name(token_id, lp, as_ids), lp.logprob)
    return top


class _Call:
    """One request on its way: its prompts (a completions batch has several; choice
    p * n + k is sample k of prompt p, as vLLM numbers them), params, and how to shape
    its chunks."""

    def __init__(self, request: web.Request, body: dict[str, Any], chat: bool) -> None:
        serving = request.app[CONFIG]
        self.engine = request.app[ENGINE]
        max_model_len = self.engine.config.model.max_model_len
        self.metrics = request.app[METRICS]
        self.chat = chat
        self.lora = served_adapter(request, body.get("model"))  # (it may have gone since check_body)
        self.model = serving.model_name if self.lora is None else self.lora.name
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        protocol.refuse_unsupported(body)
        self.stream, self.include_usage, self.continuous_usage = protocol.stream_options(body)
        self.keepalive = serving.server.sse_keepalive_seconds
        # (text or None, token IDs) per prompt
        self.prompts: list[tuple[Optional[str], list[int]]] = []
        tools = tools_for_template(body) if chat else None  # checked once, for the template and the calls
        if chat:
            self.prompts.append((None, encode_chat(self.engine, body, tools)))
        else:
            for prompt in protocol.completion_prompts(body):
                self.prompts.append((prompt, self.engine.renderer.encode(prompt)) if isinstance(prompt, str)
                                    else (None, prompt))
        self.echo = protocol.echo_setting(body, chat)
        self.priority = request_priority(self.engine, body)
        self.tokens_as_ids = body.get("return_tokens_as_token_ids") or False  # (vLLM's)
        if not isinstance(self.tokens_as_ids, bool):
            raise bad_request("'return_tokens_as_token_ids' must be a boolean", "return_tokens_as_token_ids")
        # echo with max_tokens 0 (scoring a text): the prompt alone comes back; one token is
        # generated, as vLLM does, and left out of the response
        self.echo_only = self.echo and type(body.get("max_tokens")) is int and body["max_tokens"] == 0
        if self.echo_only:
            body = {**body, "max_tokens": 1}
        self.max_tokens_given = any(body.get(key) is not None for key in ("max_tokens", "max_completion_tokens"))
        self.params = protocol.sampling_params(body, serving.server.max_n,
                                               default_max_tokens=None if chat else 16,
                                               logprobs=protocol.logprobs_setting(body, chat),
                                               defaults=self.engine.config.model.sampling_defaults)
        self.beam = protocol.beam_search(body, self.params)  # vLLM's use_beam_search, or None
        # tool_choice "required" or a named function: the output is held to the calls' schema
        self.tool_calling = tool_calling(body, tools, serving.server.tool_call_parser) if chat else None
        if (self.tool_calling is not None and self.tool_calling.parser == "mistral"
                and body.get("skip_special_tokens") is None):  # (as vLLM's mistral parser asks)
            # the newer Mistral models' calls, [TOOL_CALLS]name[ARGS]{...}, are told by their special tokens
            self.params = dataclasses.replace(self.params, skip_special_tokens=False)
        if self.tool_calling is not None and self.tool_calling.structured is not None:
            if self.params.structured_outputs is not None:
                raise bad_request("a tool call is JSON of its own: give 'tool_choice' or 'response_format' / "
                                  "'structured_outputs', not both", "tool_choice")
            try:
                self.params = dataclasses.replace(self.params, structured_outputs=self.tool_calling.structured)
            except ParamError as exc:
                raise bad_request(str(exc), exc.param) from None
        if self.beam is not None and self.params.structured_outputs is not None:
            raise bad_request("a tool_choice that holds the reply to its calls is not supported with use_beam_search",
                              "tool_choice")
        # vLLM's prompt_logprobs field: the prompt's logprobs in the response, in vLLM's shape
        self.prompt_logprobs_field = self.params.prompt_logprobs  # (its top N) or None
        if self.prompt_logprobs_field is not None and self.stream and chat:  # (as in vLLM)
            raise bad_request("'prompt_logprobs' is not available when streaming a chat", "prompt_logprobs")
        if self.echo and self.params.logprobs is not None:  # the echoed prompt's logprobs too
            self.params = dataclasses.replace(
                self.params, prompt_logprobs=max(self.params.prompt_logprobs or 0, self.params.logprobs))
        self.cached_tokens = [0] * len(self.prompts)  # per prompt, as the engine reports them
        self.num_choices = len(self.prompts) * self.params.n
        if self.num_choices > serving.server.max_choices:
            raise bad_request(f"{len(self.prompts)} prompts x n={self.params.n} is {self.num_choices} choices: "
                              f"at most {serving.server.max_choices} (--max-choices)", "prompt")
        self._check_prompts(max_model_len)
        # --reasoning-parser: a chat reply's <think> block apart (reasoning.py), the reply
        # starting inside it where the prompt opened it
        self.reasoning = chat and serving.server.reasoning_parser is not None
        self.thinking = self.reasoning and opens_thinking(self.engine.tokenizer.decode(self.prompts[0][1][-16:]))
        structured = self.params.structured_outputs
        if self.reasoning and structured is not None:  # the thinking is free, the answer held (as in vLLM)
            structured = dataclasses.replace(structured, thinking="inside" if self.thinking else "may")
            self.params = dataclasses.replace(self.params, structured_outputs=structured)

    def _check_prompts(self, max_model_len: int) -> None:
        """Refuse a prompt the engine cannot run (naming it in a batch); give echoed token-ID
        prompts their text."""
        for p, (text, ids) in enumerate(self.prompts):
            which = f"prompt {p} of the batch: " if len(self.prompts) > 1 else ""
            try:  # first: a prompt too long by itself is the prompt's fault, whatever max_tokens
                text, ids = self.engine.input_processor.truncate(text, ids, self.params)
                self.engine.input_processor.validate(ids, self.params)
            except ParamError as exc:  # a chat's prompt is its messages
                raise bad_request(which + str(exc),
                                  "messages" if self.chat and exc.param == "prompt" else exc.param) from None
            # (a default that does not fit is cut to the room left, by the engine, as vLLM cuts it)
            if self.max_tokens_given and self.params.max_tokens > max_model_len - len(ids):
                raise bad_request(f"{which}the prompt has {len(ids)} tokens and max_tokens is "
                                  f"{self.params.max_tokens}: together they exceed max_model_len ({max_model_len})",
                                  "max_tokens")
            if self.echo and text is None:  # token IDs (or a truncated prompt), valid by now
                text = self.engine.tokenizer.decode(ids)
            self.prompts[p] = (text, ids)

    def prompt_text(self, choice: int) -> Optional[str]:
        return self.prompts[choice // self.params.n][0]

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The engine's deltas for every prompt as they come (observed for /metrics on the
        way through), their choices numbered across the batch."""
        n = self.params.n
        streams = [self._observed(p, text, ids) for p, (text, ids) in enumerate(self.prompts)]
        if len(streams) == 1:
            async with contextlib.aclosing(streams[0]) as deltas:
                async for delta in deltas:
                    yield delta
            return
        async with contextlib.aclosing(merged(streams)) as deltas:
            async for p, delta in deltas:
                delta.outputs = [dataclasses.replace(s, index=p * n + s.index) for s in delta.outputs]
                yield delta

    async def _observed(self, p: int, text: Optional[str], ids: list[int]) -> AsyncIterator[RequestOutput]:
        tracker = self.metrics.tracker(len(ids))
        if self.beam is not None:  # one delta, once the search ends
            delta = await self._beam_search(text, ids)
            tracker.observe(delta)
            yield delta
            return
        generate = self.engine.generate(ids, self.params, prompt=text, priority=self.priority, lora=self.lora)
        async with contextlib.aclosing(generate) as deltas:
            async for delta in deltas:
                tracker.observe(delta)
                self.cached_tokens[p] = max(self.cached_tokens[p], delta.num_cached_tokens or 0)
                if self.echo_only:  # the generated token left out
                    delta.outputs = [dataclasses.replace(s, text="", token_ids=[],
                                                         logprobs=None if s.logprobs is None else [])
                                     for s in delta.outputs]
                yield delta

    async def _beam_search(self, text: Optional[str], ids: list[int]) -> RequestOutput:
        """A prompt's n best beams as one finished delta (max_tokens none given: what room it leaves)."""
        params = self.beam
        if self.params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=self.engine.config.model.max_model_len - len(ids))
        beams = await self.engine.beam_search(ids, params, self.priority, self.lora)
        return RequestOutput(self.id, text, ids, [CompletionOutput(k, beam.text, beam.tokens[len(ids):],
                                                                   beam.cum_logprob, None, beam.finish_reason)
                                                  for k, beam in enumerate(beams)], finished=True)

    def message(self, text: str) -> dict[str, Any]:
        """A chat choice's message: the text, or the tool calls it makes; with a reasoning
        parser, its reasoning apart (and content null where it has none)."""
        if self.reasoning:
            thinker = ReasoningReader(self.thinking)
            thinker.feed(text)
            thinker.close()
            text = thinker.content
        if self.tool_calling is None:
            message = {"role": "assistant", "content": text if text or not self.reasoning else None}
        else:
            reader = ToolCallReader(self.tool_calling)
            reader.feed(text)
            reader.close()
            message = reader.message()
        if self.reasoning:
            message.update(reasoning_fields(thinker.reasoning or None))
        return message

    def finish_reason(self, reason: Optional[str], calls: bool = True) -> Optional[str]:
        """A choice's finish reason: "tool_calls" where tool_choice "required" ended its calls,
        or "auto" made some (`calls`), as vLLM and OpenAI say it; a named call's stays "stop",
        as in vLLM."""
        if reason == "stop" and self.tool_calling is not None and self.tool_calling.name is None and calls:
            return "tool_calls"
        return reason

    def chunk(self, choices: list[dict[str, Any]], usage: Optional[dict] = None) -> dict[str, Any]:
        obj = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            obj["usage"] = usage
        return obj

    def logprobs(self, entries: Optional[list[dict[int, Logprob]]], text_offset: int) -> Optional[dict]:
        """OpenAI's logprobs object for these tokens (chat or completions shape)."""
        if entries is None:
            return None
        n, as_ids = self.params.logprobs or 0, self.tokens_as_ids
        if self.chat:
            return {"content": [_chat_logprob(entry, n, as_ids) for entry in entries]}
        tokens, offsets = [], []
        for entry in entries:
            offsets.append(text_offset)
            token_id, sampled = next(iter(entry.items()))
            tokens.append(_token_name(token_id, sampled, as_ids))
            text_offset += len(sampled.decoded_token or "")
        logprobs = [next(iter(e.values())).logprob for e in entries]
        return {"tokens": tokens, "token_logprobs": logprobs,
                "top_logprobs": [None if lp is None else _top_by_text(e, as_ids) for e, lp in zip(entries, logprobs)],
                "text_offset": offsets}

    def prompt_entries(self, delta: RequestOutput) -> tuple[int, list[dict[int, Logprob]]]:
        """(prompt index, its tokens' logprob entries) of a delta that carries its prompt's
        logprobs: the first token's has no logprob (null), as OpenAI's echo gives it."""
        p = delta.outputs[0].index // self.params.n
        first = delta.prompt_token_ids[0]
        text = self.engine.output_processor.decoder.decode([first], False)
        return p, [{first: Logprob(None, None, text)}] + [_top(e, self.params.logprobs or 0)
                                                           for e in delta.prompt_logprobs[1:]]

    def scored(self, delta: RequestOutput) -> Optional[list]:
        """The prompt_logprobs field for a delta that carries its prompt's logprobs, if asked for."""
        if self.prompt_logprobs_field is None:
            return None
        return [None if e is None else _top(e, self.prompt_logprobs_field) for e in delta.prompt_logprobs]

    def usage(self, completion_tokens: int, prompt_index: Optional[int] = None) -> dict[str, Any]:
        """Usage of every prompt (or of the one at `prompt_index`) with these completion tokens;
        prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache held, as OpenAI
        reports them."""
        which = range(len(self.prompts)) if prompt_index is None else [prompt_index]
        prompt_tokens = sum(len(self.prompts[p][1]) for p in which)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens[p] for p in which)}}


async def compile_ahead(request: web.Request, body: dict[str, Any], chat: bool) -> None:
    """Compile what a body holds its output to (a schema, a regex, choices, a tool's parameters)
    on the compile thread, into the caches that _Call then finds it in: a large one is up to
    ~0.7 s of Python, which on the loop would stall every stream; on a thread the loop keeps its
    turns (the interpreter switches every few ms). One it cannot compile is refused from here,
    with the 400 _Call would give (a failure is not cached: _Call would compile it again). A
    tool_choice is a chat's only."""
    calls = chat and (body.get("tool_choice") == "required" or isinstance(body.get("tool_choice"), dict))
    if not calls and not protocol.compiles_output(body):
        return
    parser = request.app[CONFIG].server.tool_call_parser

    def compile_() -> Optional[APIError]:
        try:
            protocol.structured_outputs(body)
            if calls:
                tool_calling(body, tools_for_template(body), parser)
        except APIError as exc:
            return exc
        except Exception:  # (_Call says what is wrong, on the loop)
            pass
        return None
    error = await asyncio.get_running_loop().run_in_executor(_COMPILER, compile_)
    if error is not None:
        raise error


# one thread for compile_ahead: compiles one at a time, so that the loop shares the interpreter
# with one of them, not with as many as arrive at once
_COMPILER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="streamserve-compile")


async def new_call(request: web.Request, body: dict[str, Any], chat: bool) -> "_Call":
    await compile_ahead(request, body, chat)
    return _Call(request, body, chat)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, await new_call(request, await read_body(request), chat=False))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, await new_call(request, await read_body(request), chat=True))


async def _serve(request: web.Request, call: _Call) -> web.StreamResponse:
    if call.stream:
        return await _stream(request, call)
    n = call.num_choices
    texts, finish, tokens = [""] * n, [None] * n, [0] * n
    logprobs: list[Optional[list]] = [None if call.params.logprobs is None else [] for _ in range(n)]
    echoed: dict[int, list] = {}  # prompt index -> its logprob entries (echo with logprobs)
    scored: dict[int, list] = {}  # prompt index -> its prompt logprobs (the prompt_logprobs field)
    async with contextlib.aclosing(call.outputs()) as outputs:
        async for delta in outputs:
            if delta.prompt_logprobs is not None:
                p, entries = call.prompt_entries(delta)
                echoed[p], scored[p] = entries, call.scored(delta)
            for s in delta.outputs:
                texts[s.index] += s.text
                tokens[s.index] += len(s.token_ids)
                finish[s.index] = s.finish_reason or finish[s.index]
                if s.logprobs is not None:
                    logprobs[s.index] += s.logprobs
    if call.chat:
        messages = [call.message(text) for text in texts]
        choices = [{"index": i, "message": messages[i], "logprobs": call.logprobs(logprobs[i], 0),
                    "finish_reason": call.finish_reason(finish[i], bool(messages[i].get("tool_calls")))}
                   for i in range(n)]
        kind = "chat.completion"
    else:
        choices = [{"index": i, "text": (call.prompt_text(i) if call.echo else "") + texts[i],
                    "logprobs": call.logprobs(None if logprobs[i] is None else
                                              (echoed.get(i // call.params.n, []) if call.echo else [])
                                              + logprobs[i], 0),
                    "finish_reason": finish[i]} for i in range(n)]
        kind = "text_completion"
        if call.prompt_logprobs_field is not None:
            for c in choices:
                c["prompt_logprobs"] = _vllm_prompt_logprobs(scored.get(c["index"] // call.params.n))
    body = {"id": call.id, "object": kind, "created": call.created, "model": call.model, "choices": choices,
            "usage": call.usage(sum(tokens))}
    if call.chat and call.prompt_logprobs_field is not None:
        body["prompt_logprobs"] = _vllm_prompt_logprobs(scored.get(0))
    return json_response(body)


def _top(entry: dict[int, Logprob], n: int) -> dict[int, Logprob]:
    """A position's entry cut to its own token (first) and the top n (the engine computed the
    larger of echo's and the prompt_logprobs field's N)."""
    return {t: lp for j, (t, lp) in enumerate(entry.items()) if j == 0 or lp.rank <= n}


def _vllm_prompt_logprobs(entries: Optional[list]) -> Optional[list[Optional[dict[str, dict[str, Any]]]]]:
    """vLLM's prompt_logprobs: None for the first token, then {token_id: {logprob, rank,
    decoded_token}} per token (the token itself, then the top N)."""
    if entries is None:
        return None
    return [None if entry is None else
            {str(tid): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
             for tid, lp in entry.items()} for entry in entries]


async def merged(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """The items of several streams as each comes, with its stream's position. Closing this
    (or an error in one) closes every stream."""
    pending = {asyncio.ensure_future(anext(stream)): k for k, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.get):
                k = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[k]))] = k
                yield k, item
    finally:  # first let the reads in flight end, then close the streams
        await _settle(pending)
        for stream in streams:
            await stream.aclose()


async def _settle(tasks: Iterable[asyncio.Future]) -> None:
    """Cancel these reads and wait for them to end; an error in one is not news."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks)
    for task in tasks:
        if not task.cancelled():
            task.exception()


async def _with_keepalive(outputs: AsyncIterator[RequestOutput], every: float,
                          response: web.StreamResponse) -> AsyncIterator[RequestOutput]:
    """The outputs, with an SSE comment written whenever `every` seconds pass without one
    (so proxies keep an idle stream open while the request waits)."""
    pending = asyncio.ensure_future(anext(outputs))
    try:
        while True:
            done, _ = await asyncio.wait({pending}, timeout=every)
            if not done:
                await response.write(b": keep-alive\n\n")
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            yield item
            pending = asyncio.ensure_future(anext(outputs))
    finally:  # `outputs` may be closed next: first let the read in flight end
        await _settle([pending])


async def _chunks(call: _Call, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[dict[str, Any]]:
    """The stream's chunk objects, as OpenAI sends them: the role first (chat), the text
    deltas, one finish_reason per choice, then the usage chunk when asked for. With
    continuous usage, each chunk holds one choice and that choice's usage so far (its
    prompt's tokens, its own completion tokens), as vLLM sends them."""
    n = call.num_choices
    completion_tokens, text_offsets = [0] * n, [0] * n
    readers = None if call.tool_calling is None else [ToolCallReader(call.tool_calling) for _ in range(n)]
    thinkers = [ReasoningReader(call.thinking) for _ in range(n)] if call.reasoning else None

    def chunks(choices: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if not call.continuous_usage:
            return [call.chunk(choices)] if choices else []
        return [call.chunk([c], call.usage(completion_tokens[c["index"]], c["index"] // call.params.n))
                for c in choices]

    if call.chat:  # the first chunk of each choice carries the role
        for chunk in chunks([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None} for i in range(n)]):
            yield chunk
    elif call.echo and call.params.logprobs is None:  # echo: the prompt comes first
        for chunk in chunks([{"index": i, "text": call.prompt_text(i), "logprobs": None, "finish_reason": None}
                             for i in range(n)]):
            yield chunk
    async for delta in outputs:
        if delta.prompt_logprobs is not None:  # the prompt's logprobs first: echoed, and/or the field
            for chunk in chunks(_scored_prompt_choices(call, delta, text_offsets)):
                yield chunk
        choices = []
        for s in delta.outputs:
            completion_tokens[s.index] += len(s.token_ids)
            if not s.text and s.finish_reason is None and not s.logprobs:
                continue
            choice = {"index": s.index, "logprobs": call.logprobs(s.logprobs, text_offsets[s.index]),
                      "finish_reason": s.finish_reason}
            text_offsets[s.index] += sum(len(next(iter(e.values())).decoded_token or "")
                                         for e in s.logprobs or ())
            text, thought = s.text, ""
            if thinkers is not None:  # the reasoning apart; the content goes on
                thought, text = thinkers[s.index].feed(text)
                if s.finish_reason is not None:
                    thought, text = (a + b for a, b in zip((thought, text), thinkers[s.index].close()))
            if readers is not None:
                reader = readers[s.index]
                choice["delta"] = reader.feed(text)
                if s.finish_reason is not None:  # what the reader held back, then the reason
                    rest = reader.close()
                    if "content" in rest:
                        choice["delta"]["content"] = choice["delta"].get("content", "") + rest["content"]
                    if "tool_calls" in rest:  # (pythonic's, read whole at the end)
                        choice["delta"]["tool_calls"] = choice["delta"].get("tool_calls", []) + rest["tool_calls"]
                    choice["finish_reason"] = call.finish_reason(s.finish_reason, bool(reader.calls))
            elif call.chat:
                choice["delta"] = {"content": text} if text else {}
            else:
                choice["text"] = text
            if thought:
                choice["delta"] = {**reasoning_fields(thought), **choice["delta"]}
            choices.append(choice)
        for chunk in chunks(choices):
            yield chunk
    if call.include_usage:
        yield call.chunk([], usage=call.usage(sum(completion_tokens)))


def _scored_prompt_choices(call: _Call, delta: RequestOutput, text_offsets: list[int]) -> list[dict[str, Any]]:
    """A stream's first choices for the prompt whose logprobs `delta` carries: the echoed
    prompt with its logprobs (echo with logprobs), and/or vLLM's prompt_logprobs field."""
    p, entries = call.prompt_entries(delta)
    scored = _vllm_prompt_logprobs(call.scored(delta))
    echo = call.echo and call.params.logprobs is not None
    if not echo and scored is None:
        return []
    firsts = []
    for i in range(p * call.params.n, (p + 1) * call.params.n):
        first = {"index": i, "text": "", "logprobs": None, "finish_reason": None}
        if echo:
            first.update(text=call.prompt_text(i), logprobs=call.logprobs(entries, 0))
            text_offsets[i] = sum(map(len, first["logprobs"]["tokens"]))
        if scored is not None:
            first["prompt_logprobs"] = scored
        firsts.append(first)
    return firsts


def unavailable(exc: EngineDeadError) -> APIError:
    return APIError(503, str(exc), type="service_unavailable")


def in_band_error(exc: Exception, what: str) -> APIError:
    """An error met after a stream started, as the error to send inside it."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return unavailable(exc)
    if isinstance(exc, (ValueError, TypeError)):
        return bad_request(str(exc))
    logger.error("error while streaming %s", what, exc_info=exc)
    return APIError(500, "internal server error", type="server_error")


async def prepare(request: web.Request, response: web.StreamResponse) -> None:
    """Send the headers of a response that streams (SSE, a websocket): from then on the
    errors middleware cannot answer with an error status."""
    await response.prepare(request)
    request[STARTED] = True


async def _stream(request: web.Request, call: _Call) -> web.StreamResponse:
    return await stream_sse(request, call, lambda outputs: _chunks(call, outputs),
                            lambda obj: b"data: " + orjson.dumps(obj) + b"\n\n", lambda error: [error.body()],
                            end=b"data: [DONE]\n\n")


async def stream_sse(request: web.Request, call: _Call,
                     frames: Callable[[AsyncIterator[RequestOutput]], AsyncIterator[dict[str, Any]]],
                     encode: Callable[[dict[str, Any]], bytes],
                     failed: Callable[[APIError], list[dict[str, Any]]], end: bytes = b"") -> web.StreamResponse:
    """A call's SSE stream: `frames` of its outputs (kept alive with comments while idle),
    each written as `encode` makes it; an error after the headers is sent in-band as the
    frames `failed` makes of it; then `end`. A client that leaves has the request aborted."""
    response = web.StreamResponse(headers=SSE_HEADERS)
    await prepare(request, response)
    async with contextlib.aclosing(call.outputs()) as outputs, \
            contextlib.aclosing(_with_keepalive(outputs, call.keepalive, response)) as kept:
        try:
            async for frame in frames(kept):
                await response.write(encode(frame))
        except ConnectionResetError:
            return response  # the client left: closing `outputs` aborts the request
        except Exception as exc:  # after the headers: report in-band, then end the stream
            with contextlib.suppress(ConnectionResetError):
                for frame in failed(in_band_error(exc, call.id)):
                    await response.write(encode(frame))
    with contextlib.suppress(ConnectionResetError):  # all sent but the end: nothing to abort
        if end:
            await response.write(end)
        await response.write_eof()
    return response
