"""POST /v1/responses: OpenAI's Responses API, over the chat path.

A Responses body becomes a chat body (instructions and input items -> messages; text.format
-> response_format; flat function tools -> chat tools; max_output_tokens -> max_tokens), runs
as one streamed chat (app._Call, app._chunks), and its chunks become the Response's output
items: one "message" item per run of text (output_text, with logprobs when `include` asks),
one "function_call" item per tool call. Streamed, the same as OpenAI's events:
response.created, response.in_progress, then per item output_item.added,
content_part.added / output_text.delta ... (or function_call_arguments.delta ...), the
.done events, and response.completed (response.incomplete when max_output_tokens cut it, an
error event and response.failed when it broke).

Responses are stored (`store`, true by default, as OpenAI has it) in memory, the last
--max-stored-responses of them: GET /v1/responses/{id} returns one, DELETE forgets it, and
`previous_response_id` goes on from one's conversation (its input and output; not its
instructions, as OpenAI has it). What this server cannot do is refused with a 400: inputs
other than text, function calls and their outputs; tools other than functions; background
runs, reasoning settings, conversations, prompt templates and truncation "auto".
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections import OrderedDict
from typing import Any, AsyncIterator, Optional

import orjson
from aiohttp import web

from streamserve.outputs import RequestOutput
from streamserve.server.app import (CONFIG, SSE_HEADERS, _Call, _chunks, _with_keepalive, check_api_key,
                                    in_band_error, json_response, prepare, read_body)
from streamserve.server.protocol import APIError, bad_request

LOGPROBS = "message.output_text.logprobs"
# vLLM's sampling extras, passed on to the chat body as they are
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "logit_bias",
             "skip_special_tokens", "chat_template_kwargs", "parallel_tool_calls")
# the chat body's fields that the Responses body names otherwise
_CHAT_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text",
               "logprobs": "include"}
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


class ResponseStore:
    """The last `size` stored responses, oldest dropped first: each one's object and the
    conversation it ends (chat messages: its input, then its output)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        if self.size == 0:
            return
        self.items[response["id"]] = (response, conversation)
        while len(self.items) > self.size:
            self.items.popitem(last=False)

    def get(self, response_id: str, param: Optional[str] = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        found = self.items.get(response_id)
        if found is None:
            raise APIError(404, f"no stored response with id {response_id!r} (this server keeps the last "
                           f"{self.size}, in memory)", param=param, type="not_found_error")
        self.items.move_to_end(response_id)
        return found


RESPONSES = web.AppKey("responses", ResponseStore)


def _text_parts(content: Any, where: str) -> str:
    """A message's content: a string, or input_text / output_text parts (their texts joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise bad_request(f"{where}.content must be a string or a list of input_text parts (this server reads "
                      "text only)", "input")


def input_messages(items: Any) -> list[dict[str, Any]]:
    """The input (a string, or a list of items) as chat messages: messages, function calls
    (an assistant's tool_calls, consecutive ones in one message) and their outputs (tool
    messages)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("'input' must be a string or a non-empty list of items", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in _ROLES:
            messages.append({"role": _ROLES[item["role"]], "content": _text_parts(item.get("content"), where)})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise bad_request(f"{where}: a function_call needs string 'call_id', 'name' and 'arguments'", "input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}: a function_call_output needs a string 'call_id'", "input")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text_parts(item.get("output"), where)})
        elif kind == "message":
            raise bad_request(f"{where}.role must be 'user', 'assistant', 'system' or 'developer'", "input")
        else:
            raise bad_request(f"{where}: this server reads input items of type 'message', 'function_call' and "
                              f"'function_call_output', not {kind!r}", "input")
    return messages


def _tools(body: dict[str, Any]) -> dict[str, Any]:
    """The chat body's tools and tool_choice for the Responses body's flat function tools."""
    tools, choice, chat = body.get("tools"), body.get("tool_choice"), {}
    if tools is not None:
        if not isinstance(tools, list):
            raise bad_request("'tools' must be a list of function tools", "tools")
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                raise bad_request(f"tools[{i}]: this server runs function tools only ({{\"type\": \"function\", "
                                  "\"name\": ..., \"parameters\": {...}}})", "tools")
        if tools:
            chat["tools"] = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                               if t.get(k) is not None}} for t in tools]
    if choice is not None:
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                                  "\"name\": ...}", "tool_choice")
            choice = {"type": "function", "function": {"name": choice["name"]}}
        if choice != "none" or chat:  # "none" with no tools: nothing to choose from, nothing asked
            chat["tool_choice"] = choice
    return chat


def _text_format(body: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The chat body's response_format for text.format ({"type": "text"}, "json_object", or
    "json_schema" with its name and schema at the top)."""
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict):
        raise bad_request("'text' must be an object, as {\"format\": {\"type\": \"json_schema\", ...}}", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("'text.format' must be an object: {\"type\": \"text\"}, \"json_object\" or "
                          "\"json_schema\"", "text")
    kind = fmt.get("type")
    if kind == "json_schema":
        if not isinstance(fmt.get("name"), str) or not isinstance(fmt.get("schema"), dict):
            raise bad_request("'text.format' json_schema takes {\"type\": \"json_schema\", \"name\": ..., "
                              "\"schema\": {...}}", "text")
        return {"type": "json_schema", "json_schema": {"name": fmt["name"], "schema": fmt["schema"]}}
    if kind not in ("text", "json_object"):
        raise bad_request(f"'text.format' type {kind!r} is not supported: give 'text', 'json_object' (JSON mode) "
                          "or 'json_schema'", "text")
    return {"type": kind}


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for key, what in (("background", "background runs"), ("conversation", "conversations"),
                      ("prompt", "prompt templates"), ("max_tool_calls", "a limit on tool calls")):
        if body.get(key) not in (None, False):
            raise bad_request(f"'{key}': this server does not support {what}", key)
    if body.get("reasoning") not in (None, {}):
        raise bad_request("'reasoning': this server has no reasoning settings", "reasoning")
    if body.get("truncation") not in (None, "disabled"):
        raise bad_request("'truncation' must be 'disabled': an input too long for the context is refused",
                          "truncation")
    include = body.get("include") or []
    if not isinstance(include, list) or any(x != LOGPROBS for x in include):
        raise bad_request(f"'include' may hold {LOGPROBS!r} only", "include")
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
            for k, v in metadata.items())):
        raise bad_request("'metadata' must map at most 16 keys (up to 64 characters) to strings (up to 512)",
                          "metadata")
    for key in ("store", "stream"):
        if not isinstance(body.get(key, False), bool):
            raise bad_request(f"'{key}' must be a boolean", key)


class ResponsesRequest:
    """A Responses body, checked, and the chat body it runs as."""

    def __init__(self, body: dict[str, Any], store: ResponseStore) -> None:
        _refuse_unsupported(body)
        self.body = body
        self.stream = body.get("stream", False)
        self.store = body.get("store", True)
        self.logprobs = LOGPROBS in (body.get("include") or [])
        earlier: list[dict[str, Any]] = []
        previous = body.get("previous_response_id")
        if previous is not None:
            if not isinstance(previous, str):
                raise bad_request("'previous_response_id' must be a string", "previous_response_id")
            earlier = store.get(previous, "previous_response_id")[1]
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise bad_request("'instructions' must be a string", "instructions")
        # the conversation this response goes on from, then its output, is what a later one reads
        self.conversation = earlier + input_messages(body.get("input"))
        system = [{"role": "system", "content": instructions}] if instructions else []
        chat = {"model": body.get("model"), "messages": system + self.conversation, "stream": True,
                "stream_options": {"include_usage": True}, **_tools(body)}
        chat.update({k: body[k] for k in _SAMPLING if body.get(k) is not None})
        if body.get("max_output_tokens") is not None:
            chat["max_tokens"] = body["max_output_tokens"]
            if isinstance(chat["max_tokens"], int) and chat["max_tokens"] < 1:
                raise bad_request("'max_output_tokens' must be at least 1", "max_output_tokens")
        fmt = _text_format(body)
        if fmt is not None:
            chat["response_format"] = fmt
        if self.logprobs:
            chat["logprobs"], chat["top_logprobs"] = True, body.get("top_logprobs") or 0
        elif body.get("top_logprobs"):
            raise bad_request(f"'top_logprobs' needs 'include': [{LOGPROBS!r}]", "top_logprobs")
        self.chat = chat


class ResponseBuilder:
    """A response's object and its stream's events, from the chat chunks of its one choice."""

    def __init__(self, request: ResponsesRequest, call: _Call) -> None:
        self.request, self.call = request, call
        body = request.body
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self.message: Optional[int] = None  # the output index of the message item being written
        self.pending_logprobs: list[dict[str, Any]] = []  # tokens' logprobs whose text has not come yet
        self.calls: dict[int, int] = {}  # a chat tool call's index -> its item's output index
        self.cached_tokens = 0
        self.response: dict[str, Any] = {
            "id": "resp_" + uuid.uuid4().hex, "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "background": False, "error": None, "incomplete_details": None,
            "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata") or {}, "model": call.model, "output": [],
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"), "reasoning": None,
            "store": request.store, "temperature": body.get("temperature", 1.0),
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto" if body.get("tools") else "none"),
            "tools": body.get("tools") or [], "top_p": body.get("top_p", 1.0),
            "top_logprobs": body.get("top_logprobs"), "truncation": "disabled", "usage": None,
            "user": body.get("user")}

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def snapshot(self) -> dict[str, Any]:
        return {**self.response, "output": [dict(item) for item in self.items]}

    async def counted(self, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """The engine's deltas, noting the prompt tokens the prefix cache held (for usage)."""
        async for delta in outputs:
            self.cached_tokens = delta.num_cached_tokens or self.cached_tokens
            yield delta

    async def events(self, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        """The stream's events; at the end self.response is the whole response."""
        yield self.event("response.created", response=self.snapshot())
        yield self.event("response.in_progress", response=self.snapshot())
        finish, usage = None, None
        async for chunk in chunks:
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                delta = choice.get("delta", {})
                for event in self._text(delta.get("content") or "", (choice.get("logprobs") or {}).get("content")):
                    yield event
                for call in delta.get("tool_calls") or ():
                    for event in self._tool_call(call):
                        yield event
                finish = choice.get("finish_reason") or finish
        incomplete = finish == "length"
        for event in self._close_message(incomplete):
            yield event
        for index in self.calls.values():
            for event in self._close_call(index, incomplete):
                yield event
        self.response.update(self.snapshot(), status="incomplete" if incomplete else "completed",
                             usage=self._usage(usage))
        if incomplete:
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        yield self.event("response.incomplete" if incomplete else "response.completed", response=self.response)

    def failed(self, error: APIError) -> list[dict[str, Any]]:
        """The events that end a stream that broke: the error, then the failed response."""
        self.response.update(self.snapshot(), status="failed",
                             error={"code": error.code or error.type, "message": error.message})
        return [self.event("error", code=error.code or error.type, message=error.message, param=error.param),
                self.event("response.failed", response=self.response)]

    def conversation(self) -> list[dict[str, Any]]:
        """The conversation this response ends: its input's, then its output as messages."""
        messages = list(self.request.conversation)
        for item in self.response["output"]:
            if item["type"] == "message":
                messages.append({"role": "assistant", "content": item["content"][0]["text"]})
            else:
                call = {"id": item["call_id"], "type": "function",
                        "function": {"name": item["name"], "arguments": item["arguments"]}}
                if messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                    messages[-1]["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        return messages

    def _text(self, text: str, logprobs: Optional[list[dict[str, Any]]]) -> list[dict[str, Any]]:
        if self.request.logprobs and logprobs:
            self.pending_logprobs += logprobs
        if not text:
            return []
        events = []
        if self.message is None:
            self.message = len(self.items)
            self.items.append({"type": "message", "id": "msg_" + uuid.uuid4().hex, "status": "in_progress",
                               "role": "assistant", "content": []})
            events.append(self.event("response.output_item.added", output_index=self.message,
                                     item=dict(self.items[self.message])))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self.items[self.message]["content"] = [part]
            events.append(self.event("response.content_part.added", **self._where(), part=dict(part)))
        part = self.items[self.message]["content"][0]
        part["text"] += text
        part["logprobs"] += self.pending_logprobs
        events.append(self.event("response.output_text.delta", **self._where(), delta=text,
                                 logprobs=self.pending_logprobs))
        self.pending_logprobs = []
        return events

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[self.message]["id"], "output_index": self.message, "content_index": 0}

    def _close_message(self, incomplete: bool) -> list[dict[str, Any]]:
        if self.message is None:
            return []
        item, where = self.items[self.message], self._where()
        part = item["content"][0]
        part["logprobs"] += self.pending_logprobs
        item["status"] = "incomplete" if incomplete else "completed"
        self.message, self.pending_logprobs = None, []
        return [self.event("response.output_text.done", **where, text=part["text"], logprobs=part["logprobs"]),
                self.event("response.content_part.done", **where, part=dict(part)),
                self.event("response.output_item.done", output_index=where["output_index"], item=dict(item))]

    def _tool_call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """A chat tool-call delta: a new call (it has an id) opens an item (closing the message
        before it), a later one adds to its arguments."""
        events, arguments = [], call.get("function", {}).get("arguments") or ""
        if "id" in call:
            events += self._close_message(False)
            index = self.calls[call["index"]] = len(self.items)
            self.items.append({"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": call["id"],
                               "name": call["function"]["name"], "arguments": "", "status": "in_progress"})
            events.append(self.event("response.output_item.added", output_index=index, item=dict(self.items[index])))
        index = self.calls[call["index"]]
        if arguments:
            self.items[index]["arguments"] += arguments
            events.append(self.event("response.function_call_arguments.delta", item_id=self.items[index]["id"],
                                     output_index=index, delta=arguments))
        return events

    def _close_call(self, index: int, incomplete: bool) -> list[dict[str, Any]]:
        item = self.items[index]
        item["status"] = "incomplete" if incomplete else "completed"
        return [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                           name=item["name"], arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=index, item=dict(item))]

    def _usage(self, usage: Optional[dict[str, int]]) -> Optional[dict[str, Any]]:
        if usage is None:
            return None
        return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": self.cached_tokens},
                "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"]}


async def create_response(request: web.Request) -> web.StreamResponse:
    store = request.app[RESPONSES]
    wanted = ResponsesRequest(await read_body(request), store)
    try:
        call = _Call(request, wanted.chat, chat=True)
    except APIError as exc:  # a chat field's error, named as the Responses body names it
        exc.param = _CHAT_NAMES.get(exc.param, exc.param)
        raise
    builder = ResponseBuilder(wanted, call)
    if wanted.stream:
        response = await _stream(request, call, builder)
    else:
        async with contextlib.aclosing(call.outputs()) as outputs:
            async for _ in builder.events(_chunks(call, builder.counted(outputs))):
                pass
        response = json_response(builder.response)
    if wanted.store and builder.response["status"] in ("completed", "incomplete"):
        store.put(builder.response, builder.conversation())
    return response


async def _stream(request: web.Request, call: _Call, builder: ResponseBuilder) -> web.StreamResponse:
    response = web.StreamResponse(headers=SSE_HEADERS)
    await prepare(request, response)
    send = lambda e: response.write(b"event: %s\ndata: %s\n\n" % (e["type"].encode(), orjson.dumps(e)))  # noqa: E731
    async with contextlib.aclosing(call.outputs()) as outputs, \
            contextlib.aclosing(_with_keepalive(outputs, call.keepalive, response)) as kept:
        try:
            async for event in builder.events(_chunks(call, builder.counted(kept))):
                await send(event)
        except ConnectionResetError:
            return response  # the client left: closing `outputs` aborts the request
        except Exception as exc:  # after the headers: report in-band, then end the stream
            with contextlib.suppress(ConnectionResetError):
                for event in builder.failed(in_band_error(exc, builder.response["id"])):
                    await send(event)
    with contextlib.suppress(ConnectionResetError):
        await response.write_eof()
    return response


async def get_response(request: web.Request) -> web.Response:
    check_api_key(request)
    return json_response(request.app[RESPONSES].get(request.match_info["response_id"])[0])


async def delete_response(request: web.Request) -> web.Response:
    check_api_key(request)
    store, response_id = request.app[RESPONSES], request.match_info["response_id"]
    store.get(response_id)
    del store.items[response_id]
    return json_response({"id": response_id, "object": "response", "deleted": True})


def add_routes(app: web.Application) -> None:
    app[RESPONSES] = ResponseStore(app[CONFIG].server.max_stored_responses)
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
