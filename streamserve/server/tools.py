"""Tool calls (the chat API's `tools` and `tool_choice`), as vLLM makes them without a parser.

A chat's tools go to the chat template (as `tools`). With tool_choice "none" the reply is
text. With a named function ({"type": "function", "function": {"name": ...}}) the output is
held to that function's parameters schema (engine/structured_output.py) and becomes one
call, its text the call's arguments; with "required", to a JSON array of one or more (one with parallel_tool_calls false)
{"name": ..., "parameters": {...}} objects, each becoming a call (its arguments the text the
model wrote for them). The message then has `tool_calls` and no content; the finish reason
is "tool_calls" once "required"'s calls end, a named call's stays "stop", as in vLLM. "auto" needs a
parser of each model family's own tool-call format, which this server does not have: it is
refused, as vLLM refuses it without --enable-auto-tool-choice.

Streamed, a named call's arguments go out as the text comes, the call's id, type and name on
its first delta; with "required" each call goes out whole as soon as its object closes.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from streamserve.engine.structured_output import MAX_SCHEMA_DEPTH, MAX_STATES
from streamserve.sampling_params import ParamError, StructuredOutputsParams
from streamserve.server.protocol import bad_request, nesting_depth

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
NO_PARAMETERS = {"type": "object", "additionalProperties": False}  # a function that takes none: {}
# "required" reads as many alternatives at once as it has tools (all begin with "{"); the
# recognizer keeps at most MAX_STATES states, so more tools than that could not all be called
MAX_REQUIRED_TOOLS = MAX_STATES
# JSON levels of a tools list: a schema level takes two (properties, then the property's schema)
MAX_TOOLS_DEPTH = 2 * MAX_SCHEMA_DEPTH + 4


@dataclass(frozen=True)
class ToolCalling:
    """How a reply becomes tool calls: the named function's `name`, or None for "required";
    `structured`: what the output is held to."""

    name: Optional[str]
    structured: StructuredOutputsParams


def tools_for_template(body: dict[str, Any]) -> Optional[list[dict[str, Any]]]:
    """The request's tools, checked (each {"type": "function", "function": {"name", ...}}), or None."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not tools:
        raise bad_request("'tools' must be a non-empty list of functions", "tools")
    if nesting_depth(tools, MAX_TOOLS_DEPTH + 1) > MAX_TOOLS_DEPTH:
        raise bad_request(f"'tools' nests deeper than {MAX_TOOLS_DEPTH} levels", "tools")
    names = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not _NAME.fullmatch(function["name"]):
            raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} with "
                              "a name of 1-64 letters, digits, '_' or '-'", "tools")
        if not isinstance(function.get("parameters") or {}, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema (an object)", "tools")
        if function["name"] in names:
            raise bad_request(f"tools[{i}]: two tools are named {function['name']!r}", "tools")
        names.add(function["name"])
    return tools


def tool_calling(body: dict[str, Any]) -> Optional[ToolCalling]:
    """What tool_choice asks of the reply (None: text)."""
    if body.get("functions") or body.get("function_call") not in (None, "none"):
        raise bad_request("the deprecated 'functions' and 'function_call' are not supported: give 'tools' and "
                          "'tool_choice'", "functions")
    tools = tools_for_template(body)
    choice = body.get("tool_choice", "none" if tools is None else "auto")
    if choice == "none":
        return None
    if tools is None:
        raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
    if choice == "auto":
        raise bad_request("tool_choice 'auto' needs a parser of the model's own tool-call format, which this "
                          "server does not have: give 'required', a named function or 'none'", "tool_choice")
    functions = {tool["function"]["name"]: _parameters(tool["function"]) for tool in tools}
    if choice == "required":
        if len(functions) > MAX_REQUIRED_TOOLS:
            raise bad_request(f"tool_choice 'required' takes at most {MAX_REQUIRED_TOOLS} tools (a named function "
                              "any number)", "tools")
        alternatives = [{"type": "object", "properties": {"name": {"const": name}, "parameters": _moved(params, i)},
                         "required": ["name", "parameters"]} for i, (name, params) in enumerate(functions.items())]
        schema, name = {"type": "array", "minItems": 1, "items": {"anyOf": alternatives}}, None
        if body.get("parallel_tool_calls") is False:
            schema["maxItems"] = 1
    else:
        function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or name not in functions:
            raise bad_request("'tool_choice' must be 'none', 'required', or {\"type\": \"function\", \"function\": "
                              "{\"name\": ...}} naming one of the tools", "tool_choice")
        schema = functions[name]
    try:
        return ToolCalling(name, StructuredOutputsParams(json=schema))
    except ParamError as exc:
        raise bad_request(f"a tool's parameters: {exc}", "tools") from None


def _parameters(function: dict[str, Any]) -> Any:
    """A function's parameters schema: none given (or null) is no parameters, {} any object."""
    parameters = function.get("parameters")
    if parameters is None:
        return NO_PARAMETERS
    return parameters or {"type": "object"}


_SCHEMA_MAPS = ("properties", "$defs", "definitions")  # keywords whose values map names to schemas
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf")
_SCHEMAS = ("items", "additionalProperties")


def _moved(schema: Any, i: int) -> Any:
    """A tool's parameters schema, its $refs (#/...) pointing where it sits in "required"'s
    schema: only where schemas are (values, as in const, enum or default, stay as given)."""
    if not isinstance(schema, dict):
        return schema
    moved = dict(schema)
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        moved["$ref"] = f"#/items/anyOf/{i}/properties/parameters{ref[1:]}"
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            moved[key] = {name: _moved(s, i) for name, s in schema[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            moved[key] = [_moved(s, i) for s in schema[key]]
    for key in _SCHEMAS:
        if key in schema:
            moved[key] = _moved(schema[key], i)
    return moved


@dataclass
class ToolCallReader:
    """One choice's output read as tool calls, as it comes: `feed` the text, get the calls'
    deltas (OpenAI's stream shape, each with its index among the choice's calls)."""

    calling: ToolCalling
    text: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)  # whole calls so far
    _read: int = 0  # how far "required"'s array has been read

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.text += text
        if self.calling.name is not None:  # the text is the one call's arguments
            if not self.calls:
                self.calls.append(_call(self.calling.name, text))
                return [dict(self.calls[0], index=0, function=dict(self.calls[0]["function"]))]
            if not text:
                return []
            self.calls[0]["function"]["arguments"] += text
            return [{"index": 0, "function": {"arguments": text}}]
        deltas = []
        decoder = json.JSONDecoder()
        while True:  # the array's next whole element, if it has come
            at = len(self.text) - len(self.text[self._read:].lstrip(" \t\n\r[,"))
            try:
                element, end = decoder.raw_decode(self.text, at)
                # the arguments as the model wrote them (re-encoding could change them: a lone
                # surrogate escape or 1e999 does not survive json.loads and json.dumps)
                start = self.text.index('"parameters"', at) + len('"parameters"')
                start = len(self.text) - len(self.text[start:].lstrip(" \t\n\r:"))
                _, stop = decoder.raw_decode(self.text, start)
            except (ValueError, RecursionError):
                return deltas
            self._read = end
            call = _call(element["name"], self.text[start:stop])
            self.calls.append(call)
            deltas.append(dict(call, index=len(self.calls) - 1))


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": arguments}}
