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

Items are written one at a time: each is done before the next is added. Responses are stored
(`store`, true by default, as OpenAI has it) in memory, as JSON, the newest within
--responses-memory: GET /v1/responses/{id} returns one, GET .../input_items lists its input,
DELETE forgets it, and `previous_response_id` goes on from one's conversation (its input and
output; not its instructions, as OpenAI has it). What this server cannot do is refused with a
400: inputs other than text, function calls, their outputs and reasoning; tools other than
functions; background runs, reasoning settings without --reasoning-parser, conversations,
prompt templates and truncation "auto". With --reasoning-parser, the reply's thinking is a
reasoning item (reasoning.py), and effort "none" asks the template for no thinking.
The usage counts the prompt tokens read from the prefix cache as cached_tokens; there is no
separate account of tokens written to it (cache_write_tokens is 0).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections import OrderedDict
from typing import Any, AsyncIterator, Optional

import orjson
from aiohttp import web

from streamserve.config import parse_size
from streamserve.server.app import CONFIG, _Call, _chunks, check_api_key, json_response, new_call, read_body, stream_sse
from streamserve.server.protocol import APIError, bad_request

LOGPROBS = "message.output_text.logprobs"
# vLLM's sampling extras, passed on to the chat body as they are
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
             "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "logit_bias",
             "skip_special_tokens", "chat_template_kwargs", "parallel_tool_calls", "structured_outputs",
             "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "priority")
# the chat body's fields that the Responses body names otherwise
_CHAT_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text",
               "logprobs": "include"}
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


class ResponseStore:
    """The newest stored responses within `budget` bytes (oldest dropped first): each one's
    object, the conversation it ends (chat messages: its input, then its output) and its input
    items, kept as JSON, so what they hold is what they cost."""

    def __init__(self, budget: int) -> None:
        self.budget, self.used = budget, 0
        self.items: OrderedDict[str, bytes] = OrderedDict()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]],
            input_items: list[dict[str, Any]]) -> None:
        blob = orjson.dumps({"response": response, "conversation": conversation, "input_items": input_items})
        if len(blob) > self.budget:
            return
        self.items[response["id"]] = blob
        self.used += len(blob)
        while self.used > self.budget:
            self.used -= len(self.items.popitem(last=False)[1])

    def get(self, response_id: str, param: Optional[str] = None) -> dict[str, Any]:
        """{"response", "conversation", "input_items"} of a stored response."""
        blob = self.items.get(response_id)
        if blob is None:
            raise APIError(404, f"no stored response with id {response_id!r} (this server keeps the newest "
                           "within --responses-memory, in memory)", param=param, type="not_found_error")
        self.items.move_to_end(response_id)
        return orjson.loads(blob)

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        self.used -= len(self.items.pop(response_id))


RESPONSES = web.AppKey("responses", ResponseStore)


def _text_parts(content: Any, where: str) -> str:
    """A message's content: a string, or input_text / output_text (or refusal) parts, their
    texts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        texts = [p.get("refusal" if p.get("type") == "refusal" else "text") for p in content
                 if p.get("type") in ("input_text", "output_text", "refusal")]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            return "".join(texts)
    raise bad_request(f"{where} must be a string or a list of input_text parts (this server reads text only)",
                      "input")


def _add_call(messages: list[dict[str, Any]], call_id: str, name: str, arguments: str) -> None:
    """A function call as a tool call of the assistant message before it (one turn), or of a
    new one."""
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def read_input(items: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The input (a string, or a list of items), checked, as chat messages (messages; function
    calls as an assistant's tool_calls, consecutive ones in one message; their outputs as tool
    messages) and as the items GET .../input_items lists, each with an id (the client's, where
    it gave one)."""
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    elif not isinstance(items, list) or not items:
        raise bad_request("'input' must be a string or a non-empty list of items", "input")
    messages: list[dict[str, Any]] = []
    listed: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        role = item.get("role") if kind == "message" else None
        given = item.get("id") if kind is not None and isinstance(item.get("id"), str) else None
        if isinstance(role, str) and role in _ROLES:
            content = _text_parts(item.get("content"), where + ".content")
            if role == "assistant" and messages and messages[-1]["role"] == "assistant" \
                    and "tool_calls" not in messages[-1]:
                messages[-1]["content"] += content  # one turn's text, in parts
            else:
                messages.append({"role": _ROLES[role], "content": content})
            part = {"type": "output_text", "text": content, "annotations": []} if role == "assistant" else \
                {"type": "input_text", "text": content}
            listed.append({"type": "message", "id": given or "msg_" + uuid.uuid4().hex, "role": role,
                           "status": "completed", "content": [part]})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise bad_request(f"{where}: a function_call needs string 'call_id', 'name' and 'arguments'", "input")
            _add_call(messages, item["call_id"], item["name"], item["arguments"])
            listed.append({"type": "function_call", "id": given or "fc_" + uuid.uuid4().hex,
                           "call_id": item["call_id"], "name": item["name"], "arguments": item["arguments"],
                           "status": "completed"})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}: a function_call_output needs a string 'call_id'", "input")
            output = _text_parts(item.get("output"), where + ".output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
            listed.append({"type": "function_call_output", "id": given or "fco_" + uuid.uuid4().hex,
                           "call_id": item["call_id"], "output": output, "status": "completed"})
        elif kind == "reasoning":  # an earlier reply's reasoning handed back: listed, not read (chat
            # templates leave earlier turns' thinking out)
            parts = item.get("content") or []
            texts = [part.get("text") if isinstance(part, dict) else None for part in parts] \
                if isinstance(parts, list) else [None]
            if not all(isinstance(t, str) for t in texts):
                raise bad_request(f"{where}: a reasoning item's content is a list of {{\"type\": \"reasoning_text\", "
                                  "\"text\": ...}} parts", "input")
            listed.append({"type": "reasoning", "id": given or "rs_" + uuid.uuid4().hex, "summary": [],
                           "content": [{"type": "reasoning_text", "text": t} for t in texts], "status": "completed"})
        elif kind == "message":
            raise bad_request(f"{where}.role must be 'user', 'assistant', 'system' or 'developer'", "input")
        else:
            raise bad_request(f"{where}: this server reads input items of type 'message', 'function_call', "
                              f"'function_call_output' and 'reasoning', not {kind!r}", "input")
    return messages, listed


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
        if chat or choice not in ("none", "auto"):  # without tools, these two ask for nothing
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


_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_SUMMARIES = ("auto", "concise", "detailed")


def _reasoning(body: dict[str, Any], parser: bool) -> Optional[dict[str, Any]]:
    """The body's reasoning settings (None: none), taken where the server reads reasoning
    (--reasoning-parser): effort "none" asks the template for no thinking (Qwen3's
    enable_thinking false); the other efforts leave the model to its own; a summary is not
    written (the reasoning item holds the reasoning's text)."""
    reasoning = body.get("reasoning")
    if reasoning is None or isinstance(reasoning, dict) and all(v is None for v in reasoning.values()):
        return None
    if not parser:
        raise bad_request("'reasoning': this server reads no reasoning (start it with --reasoning-parser)", "reasoning")
    if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary", "generate_summary"} \
            or reasoning.get("effort") not in (None, *_EFFORTS) \
            or any(reasoning.get(k) not in (None, *_SUMMARIES) for k in ("summary", "generate_summary")):
        raise bad_request(f"'reasoning' takes 'effort' (one of {', '.join(_EFFORTS)}) and 'summary' (one of "
                          f"{', '.join(_SUMMARIES)})", "reasoning")
    return {"effort": reasoning.get("effort"), "summary": reasoning.get("summary") or reasoning.get("generate_summary")}


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for key, what in (("background", "background runs"), ("conversation", "conversations"),
                      ("prompt", "prompt templates"), ("max_tool_calls", "a limit on tool calls")):
        if body.get(key) not in (None, False):
            raise bad_request(f"'{key}': this server does not support {what}", key)
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
    for key, kind, what in (("store", bool, "a boolean"), ("stream", bool, "a boolean"),
                            ("parallel_tool_calls", bool, "a boolean"), ("user", str, "a string")):
        if body.get(key) is not None and not isinstance(body[key], kind):
            raise bad_request(f"'{key}' must be {what}", key)


class ResponsesRequest:
    """A Responses body, checked, and the chat body it runs as."""

    def __init__(self, body: dict[str, Any], store: ResponseStore, reasoning_parser: bool = False) -> None:
        _refuse_unsupported(body)
        self.reasoning = _reasoning(body, reasoning_parser)
        self.body = body
        self.stream = bool(body.get("stream"))
        self.store = body.get("store") is not False
        self.logprobs = LOGPROBS in (body.get("include") or [])
        earlier: list[dict[str, Any]] = []
        previous = body.get("previous_response_id")
        if previous is not None:
            if not isinstance(previous, str):
                raise bad_request("'previous_response_id' must be a string", "previous_response_id")
            earlier = store.get(previous, "previous_response_id")["conversation"]
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise bad_request("'instructions' must be a string", "instructions")
        # the conversation this response goes on from, then its output, is what a later one reads
        messages, self.input_items = read_input(body.get("input"))
        self.conversation = earlier + messages
        system = [{"role": "system", "content": instructions}] if instructions else []
        chat = {"model": body.get("model"), "messages": system + self.conversation, "stream": True,
                "stream_options": {"include_usage": True}, **_tools(body)}
        chat.update({k: body[k] for k in _SAMPLING if body.get(k) is not None})
        if self.reasoning is not None and self.reasoning["effort"] == "none":
            kwargs = chat.get("chat_template_kwargs", {})
            if isinstance(kwargs, dict):  # (where it is not, the chat's check names it)
                chat["chat_template_kwargs"] = {"enable_thinking": False, **kwargs}
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
    """A response's object and its stream's events, from the chat chunks of its one choice.
    One output item is open at a time (`self.open`): reasoning (--reasoning-parser) opens a
    reasoning item, text a message item, a tool call a function_call item, each closing the
    one before."""

    def __init__(self, request: ResponsesRequest, call: _Call) -> None:
        self.request, self.call = request, call
        body = request.body
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        self.open: Optional[int] = None  # the output index of the item being written
        self.pending_logprobs: list[dict[str, Any]] = []  # tokens' logprobs whose text has not come yet
        self.calls: dict[int, int] = {}  # a chat tool call's index -> its item's output index
        self.response: dict[str, Any] = {
            "id": "resp_" + uuid.uuid4().hex, "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "background": False, "error": None, "incomplete_details": None,
            "instructions": body.get("instructions"), "max_output_tokens": call.params.max_tokens,
            "metadata": body.get("metadata") or {}, "model": call.model, "output": [],
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "previous_response_id": body.get("previous_response_id"), "reasoning": request.reasoning,
            "store": request.store, "temperature": call.params.temperature,
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "top_p": call.params.top_p, "top_logprobs": body.get("top_logprobs"),
            "truncation": "disabled", "usage": None, "user": body.get("user")}

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def snapshot(self) -> dict[str, Any]:
        return {**self.response, "output": [dict(item) for item in self.items]}

    async def events(self, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        """The stream's events; at the end self.response is the whole response."""
        yield self.event("response.created", response=self.snapshot())
        yield self.event("response.in_progress", response=self.snapshot())
        finish, usage = None, None
        async for chunk in chunks:
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                delta = choice.get("delta", {})
                for event in self._reasoning(delta.get("reasoning") or ""):
                    yield event
                logprobs = (choice.get("logprobs") or {}).get("content")
                if self.call.reasoning and not delta.get("content") and (
                        delta.get("reasoning") or self.open is None or self.items[self.open]["type"] != "message"):
                    logprobs = None  # the thinking's tokens (its tags too): the message's logprobs are its text's
                for event in self._text(delta.get("content") or "", logprobs):
                    yield event
                for call in delta.get("tool_calls") or ():
                    for event in self._tool_call(call):
                        yield event
                finish = choice.get("finish_reason") or finish
        incomplete = finish == "length"
        for event in self._close(incomplete):
            yield event
        self.response.update(self.snapshot(), status="incomplete" if incomplete else "completed",
                             usage=self._usage(usage))
        if incomplete:
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        yield self.event("response.incomplete" if incomplete else "response.completed", response=self.response)

    def failed(self, error: APIError) -> list[dict[str, Any]]:
        """The events that end a stream that broke: the error, then the failed response (its
        error code one of OpenAI's: server_error, or invalid_prompt for the request's fault)."""
        code = "server_error" if error.status >= 500 else "invalid_prompt"
        self.response.update(self.snapshot(), status="failed", error={"code": code, "message": error.message})
        return [self.event("error", code=error.code or error.type, message=error.message, param=error.param),
                self.event("response.failed", response=self.response)]

    def conversation(self) -> list[dict[str, Any]]:
        """The conversation this response ends: its input's, then its output as one assistant
        message (its text, and its function calls as tool calls)."""
        messages = list(self.request.conversation) + [{"role": "assistant", "content": ""}]
        for item in self.response["output"]:
            if item["type"] == "message":
                messages[-1]["content"] += item["content"][0]["text"]
            elif item["type"] == "function_call":  # (reasoning: templates leave earlier turns' out)
                _add_call(messages, item["call_id"], item["name"], item["arguments"])
        return messages if messages[-1]["content"] or "tool_calls" in messages[-1] else messages[:-1]

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        events = self._open_part({"type": "reasoning", "id": "rs_" + uuid.uuid4().hex, "summary": [],
                                  "status": "in_progress"}, {"type": "reasoning_text", "text": ""})
        self.items[self.open]["content"][0]["text"] += text
        return events + [self.event("response.reasoning_text.delta", **self._where(), delta=text)]

    def _open_part(self, item: dict[str, Any], part: dict[str, Any]) -> list[dict[str, Any]]:
        """Where the open item is not of item's type: it is closed, and item opened with one
        content part, part."""
        if self.open is not None and self.items[self.open]["type"] == item["type"]:
            return []
        events = self._close(False)
        self.open = len(self.items)
        self.items.append({**item, "content": []})
        events.append(self.event("response.output_item.added", output_index=self.open, item=dict(self.items[-1])))
        events.append(self.event("response.content_part.added", **self._where(), part=dict(part)))
        self.items[-1]["content"] = [part]
        return events

    def _text(self, text: str, logprobs: Optional[list[dict[str, Any]]]) -> list[dict[str, Any]]:
        if self.request.logprobs and logprobs:
            self.pending_logprobs += logprobs
        if not text:
            return []
        events = self._open_part({"type": "message", "id": "msg_" + uuid.uuid4().hex, "status": "in_progress",
                                  "role": "assistant"},
                                 {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        part = self.items[self.open]["content"][0]
        part["text"] += text
        part["logprobs"] = part["logprobs"] + self.pending_logprobs
        events.append(self.event("response.output_text.delta", **self._where(), delta=text,
                                 logprobs=self.pending_logprobs))
        self.pending_logprobs = []
        return events

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.items[self.open]["id"], "output_index": self.open, "content_index": 0}

    def _tool_call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """A chat tool-call delta: a new call (it has an id) opens an item, a later one adds to
        its arguments."""
        events, arguments = [], call.get("function", {}).get("arguments") or ""
        if "id" in call:
            self.pending_logprobs = []  # the call's own tokens': a call has none
            events += self._close(False)
            index = self.open = self.calls[call["index"]] = len(self.items)
            item = {"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": call["id"],
                    "name": call["function"]["name"], "arguments": "", "status": "in_progress"}
            self.items.append(item)
            events.append(self.event("response.output_item.added", output_index=index, item=dict(item)))
        index = self.calls[call["index"]]
        if arguments:
            self.items[index]["arguments"] += arguments
            events.append(self.event("response.function_call_arguments.delta", item_id=self.items[index]["id"],
                                     output_index=index, delta=arguments))
        return events

    def _close(self, incomplete: bool) -> list[dict[str, Any]]:
        """The events that end the open item, if there is one."""
        if self.open is None:
            return []
        index, item = self.open, self.items[self.open]
        item["status"] = "incomplete" if incomplete else "completed"
        if item["type"] == "function_call":
            events = [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                 name=item["name"], arguments=item["arguments"])]
        elif item["type"] == "reasoning":
            where, part = self._where(), item["content"][0]
            events = [self.event("response.reasoning_text.done", **where, text=part["text"]),
                      self.event("response.content_part.done", **where, part=dict(part))]
        else:
            where, part = self._where(), item["content"][0]
            part["logprobs"] = part["logprobs"] + self.pending_logprobs
            self.pending_logprobs = []
            events = [self.event("response.output_text.done", **where, text=part["text"], logprobs=part["logprobs"]),
                      self.event("response.content_part.done", **where, part=dict(part))]
        self.open = None
        return events + [self.event("response.output_item.done", output_index=index, item=dict(item))]

    def _usage(self, usage: Optional[dict[str, int]]) -> Optional[dict[str, Any]]:
        """The usage, its reasoning tokens counted by reading the reasoning's text again (its
        tags aside)."""
        if usage is None:
            return None
        encode = self.call.engine.tokenizer.encode
        reasoning = sum(len(encode(item["content"][0]["text"], add_special_tokens=False))
                        for item in self.items if item["type"] == "reasoning")
        return {"input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                                         "cache_write_tokens": 0},
                "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": usage["total_tokens"]}


async def create_response(request: web.Request) -> web.StreamResponse:
    store = request.app[RESPONSES]
    wanted = ResponsesRequest(await read_body(request), store,
                              request.app[CONFIG].server.reasoning_parser is not None)
    try:
        call = await new_call(request, wanted.chat, chat=True)
    except APIError as exc:  # a chat field's error, named as the Responses body names it
        exc.param = _CHAT_NAMES.get(exc.param, exc.param)
        for chat_name, name in (("max_tokens", "max_output_tokens"), ("response_format", "text.format")):
            exc.message = exc.message.replace(f"'{chat_name}'", f"'{name}'")
        raise
    builder = ResponseBuilder(wanted, call)
    if wanted.stream:  # OpenAI's events, no [DONE]; a step that broke ends with error and response.failed
        response = await stream_sse(request, call, lambda outputs: builder.events(_chunks(call, outputs)),
                                    _event, builder.failed)
    else:
        async with contextlib.aclosing(call.outputs()) as outputs:
            async for _ in builder.events(_chunks(call, outputs)):
                pass
        response = json_response(builder.response)
    if wanted.store and builder.response["status"] in ("completed", "incomplete"):
        store.put(builder.response, builder.conversation(), wanted.input_items)
    return response


def _event(event: dict[str, Any]) -> bytes:
    return b"event: %s\ndata: %s\n\n" % (event["type"].encode(), orjson.dumps(event))


async def get_response(request: web.Request) -> web.Response:
    check_api_key(request)
    return json_response(request.app[RESPONSES].get(request.match_info["response_id"])["response"])


async def list_input_items(request: web.Request) -> web.Response:
    """A stored response's input items, a page at a time: `order` (desc, the default, or
    asc), `limit` (1-100, 20), `after` / `before` an item's id."""
    check_api_key(request)
    items = request.app[RESPONSES].get(request.match_info["response_id"])["input_items"]
    query = request.query
    if query.get("order", "desc") not in ("asc", "desc"):
        raise bad_request("'order' must be 'asc' or 'desc'", "order")
    if query.get("order", "desc") == "desc":
        items.reverse()
    limit = query.get("limit", "20")
    if not (limit.isdigit() and 1 <= int(limit) <= 100):
        raise bad_request("'limit' must be an integer in [1, 100]", "limit")
    ids = [item["id"] for item in items]
    for key in ("after", "before"):
        if key in query and query[key] not in ids:
            raise bad_request(f"'{key}': no input item {query[key]!r} in this response", key)
    start = ids.index(query["after"]) + 1 if "after" in query else 0
    end = ids.index(query["before"]) if "before" in query else len(items)
    page = items[start:min(end, start + int(limit))]
    return json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                          "last_id": page[-1]["id"] if page else None, "has_more": start + len(page) < end})


async def delete_response(request: web.Request) -> web.Response:
    check_api_key(request)
    response_id = request.match_info["response_id"]
    request.app[RESPONSES].delete(response_id)
    return json_response({"id": response_id, "object": "response", "deleted": True})


def add_routes(app: web.Application) -> None:
    app[RESPONSES] = ResponseStore(parse_size(app[CONFIG].server.responses_memory))
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_get("/v1/responses/{response_id}/input_items", list_input_items)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
