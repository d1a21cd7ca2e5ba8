"""Tool calls (the chat API's `tools` and `tool_choice`), as vLLM makes them without a parser.

A chat's tools go to the chat template (as `tools`). With tool_choice "none" the reply is
text. With a named function ({"type": "function", "function": {"name": ...}}) the output is
held to that function's parameters schema (engine/structured_output.py) and becomes one
call, its text the call's arguments; with "required", to a JSON array of one or more (one with parallel_tool_calls false)
{"name": ..., "parameters": {...}} objects, each becoming a call (its arguments the text the
model wrote for them). The message then has `tool_calls` and no content; the finish reason
is "tool_calls" once "required"'s calls end, a named call's stays "stop", as in vLLM. "auto"
needs a parser of the model family's own tool-call format: with --tool-call-parser hermes the
reply is free text in which <tool_call>{"name": ..., "arguments": ...}</tool_call> blocks are
calls (as Qwen2.5 and Hermes models write them), with --tool-call-parser llama3_json a reply
that begins with {"name": ..., "parameters": ...} objects (after <|python_tag|>, where special
tokens are kept; several apart by ";") is calls, as Llama 3.1-3.3 write them, and any other
reply content, with --tool-call-parser pythonic a reply that is a Python list of calls,
[get_weather(city="Rome", days=2), get_time()], as Llama 3.2 and 4 write them, is those calls
(their keyword arguments, Python literals, as JSON) and any other reply content, and with
--tool-call-parser mistral a reply that is a JSON array of {"name": ..., "arguments": ...}
objects (after [TOOL_CALLS], where special tokens are kept), as Mistral's models write them, or
in the newer models' form [TOOL_CALLS]name[ARGS]{...} (one per call; its special tokens kept, as
vLLM keeps them for this parser, unless the request sets skip_special_tokens; text before
the first [TOOL_CALLS] is content), is those calls, and with --tool-call-parser granite a reply
that is a JSON array of {"name": ..., "arguments": ...} objects (after <|tool_call|>, where
special tokens are kept, or <tool_call>), as Granite 3's models write them, is those calls;
without one it is refused, as vLLM refuses it without --enable-auto-tool-choice.

Streamed, a named call's arguments go out as the text comes, the call's id, type and name on
its first delta; with "required" each call goes out whole as soon as its object closes, with
"auto" as soon as its block closes (the text around it as content; whitespace between calls,
and what could begin a tag, held back until it is plain which it is); pythonic's reply, where
it begins with "[", is held back whole until it ends (only then is it plain whether it is a
list of calls), and streams as content from its first character otherwise; so is granite's and mistral's,
whose reply may also be content up to a [TOOL_CALLS] (streamed as it comes) and calls from there
(read at the end).
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass
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
    """How a reply becomes tool calls: the named function's `name`, or None for "required" or
    "auto"; `structured`: what the output is held to (None: "auto", free text in which
    `parser` finds the calls)."""

    name: Optional[str]
    structured: Optional[StructuredOutputsParams]
    parser: Optional[str] = None


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


def tool_calling(body: dict[str, Any], tools: Optional[list[dict[str, Any]]],
                 parser: Optional[str] = None) -> Optional[ToolCalling]:
    """What tool_choice asks of the reply (None: text). `tools`: the body's, as tools_for_template
    checked them; `parser`: the server's tool-call format ("hermes", "llama3_json", "pythonic",
    "mistral", "granite"), without which "auto" cannot be."""
    if body.get("functions") or body.get("function_call") not in (None, "none"):
        raise bad_request("the deprecated 'functions' and 'function_call' are not supported: give 'tools' and "
                          "'tool_choice'", "functions")
    choice = body.get("tool_choice", "none" if tools is None else "auto")
    if choice == "none":
        return None
    if tools is None:
        raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
    if choice == "auto":
        if parser is None:
            raise bad_request("tool_choice 'auto' needs a parser of the model's own tool-call format: start the "
                              "server with --tool-call-parser hermes (for models that write <tool_call>...), "
                              "llama3_json (Llama 3.1-3.3), pythonic (Llama 3.2 and 4) or mistral, or give "
                              "'required', a named function or 'none'",
                              "tool_choice")
        return ToolCalling(None, None, parser)
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


class ToolCallReader:
    """One choice's output read as tool calls, as it comes: `feed` the text, get the stream's
    delta for it ({"tool_calls": [...]}, each call with its index among the choice's, and
    {"content": ...} where text is left over), `close` at the end for what was held back;
    `calls` and `content` are the whole message's."""

    def __init__(self, calling: ToolCalling) -> None:
        self.calling = calling
        self.text = ""
        self.calls: list[dict[str, Any]] = []
        self.content = ""
        self._read = 0  # how far the text has been read
        self._spaces = ""  # whitespace held back: between calls it is no content
        self._plain = False  # llama3_json: the reply turned out to be text, not calls
        self._object: Optional[_ObjectEnd] = None  # the call object being read (llama3_json, "required")
        self._close_from = 0  # hermes: where the search for the open block's </tool_call> goes on
        self._held = False  # mistral: its calls' part has begun, held to the close

    def feed(self, text: str) -> dict[str, Any]:
        self.text += text
        if self.calling.parser == "llama3_json":
            return self._llama3_json()
        if self.calling.parser == "mistral":
            return self._mistral()
        if self.calling.parser in _WHOLE_REPLY:
            return self._whole_reply()
        if self.calling.parser is not None:
            return self._hermes()
        if self.calling.name is not None:  # the text is the one call's arguments
            if not self.calls:
                self.calls.append(_call(self.calling.name, text))
                return {"tool_calls": [dict(self.calls[0], index=0, function=dict(self.calls[0]["function"]))]}
            if not text:
                return {}
            self.calls[0]["function"]["arguments"] += text
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
        calls = []
        while True:  # "required"'s array: its next whole element, if it has come
            at = _ELEMENT_GAP.match(self.text, self._read).end()
            if self.text[at:at + 1] != "{":
                return self._delta("", calls)
            if self._object is None or self._object.start != at:
                self._object = _ObjectEnd(at)
            element = _object_members(self.text, at) if self._object.end(self.text) is not None else None
            if element is None:
                return self._delta("", calls)
            self._read = element["}"]
            calls.append(self._add(json.loads(element["name"]), element["parameters"]))

    def close(self) -> dict[str, Any]:
        """The delta of what was held back: the rest of the text (an unclosed <tool_call>, or
        a tag's first characters) as content, and the trailing whitespace unless there were
        calls."""
        if self.calling.parser is None:
            return {}
        rest, self._read = self.text[self._read:], len(self.text)
        if self.calling.parser == "llama3_json" and self.calls and not self._plain and not rest.strip(_BETWEEN):
            rest = ""  # the separators after the last call
        if self.calling.parser in _WHOLE_REPLY and not self._plain:
            calls = _WHOLE_REPLY[self.calling.parser](rest)
            if calls is not None:
                self._spaces = ""
                return self._delta("", [self._add(name, arguments) for name, arguments in calls])
        content = self._text(rest)
        if not self.calls:
            content, self.content, self._spaces = content + self._spaces, self.content + self._spaces, ""
        return self._delta(content, [])

    def message(self) -> dict[str, Any]:
        if self.calling.parser is not None and not self.calls:
            return {"role": "assistant", "content": self.content}
        return {"role": "assistant", "content": self.content or None, "tool_calls": self.calls}

    def _hermes(self) -> dict[str, Any]:
        content, calls = "", []
        while True:
            i = self.text.find(_OPEN, self._read)
            if i < 0:  # text, but for the first characters of a tag at the end
                end = len(self.text) - _tag_start(self.text, self._read)
                content += self._text(self.text[self._read:end])
                self._read = end
                return self._delta(content, calls)
            # (where the last feed's search for the end stopped: a long call is searched once)
            j = self.text.find(_CLOSE, max(i + len(_OPEN), self._close_from))
            content += self._text(self.text[self._read:i])
            if j < 0:  # a call begun: wait for its end
                self._read = i
                self._close_from = len(self.text) - len(_CLOSE) + 1
                return self._delta(content, calls)
            self._close_from = 0
            self._read = j + len(_CLOSE)
            call = _hermes_call(self.text[i + len(_OPEN):j])
            if call is None:  # not a call after all: the model's text
                content += self._text(self.text[i:self._read])
                continue
            self._spaces = ""  # whitespace before a call is no content
            calls.append(self._add(*call))

    def _llama3_json(self) -> dict[str, Any]:
        """Llama 3's JSON calls: a reply that begins (after <|python_tag|>, where special tokens
        are kept) with {"name": ..., "parameters": ...} objects, one or more, apart by ";" or
        whitespace, is calls; one that begins otherwise, or whose objects are no calls, is
        content, whole. An object is held back until it closes."""
        calls: list[dict[str, Any]] = []
        while not self._plain:
            at = _SEPARATORS.match(self.text, self._read).end()
            if self.text.startswith(_PYTHON_TAG, at):
                at += len(_PYTHON_TAG)
            begun = self.text[at:at + len(_PYTHON_TAG)]
            if not begun or len(begun) < len(_PYTHON_TAG) and _PYTHON_TAG.startswith(begun):
                return self._delta("", calls)  # nothing yet, or a tag begun: wait
            element = None
            if self.text[at] == "{":
                if self._object is None or self._object.start != at:
                    self._object = _ObjectEnd(at)
                end = self._object.end(self.text)  # (read on from where it stopped: no text twice)
                if end is None:  # an object on its way (or no JSON: text at the close)
                    return self._delta("", calls)
                element = _object_members(self.text, at)
            call = None if element is None or element["}"] != end else _hermes_call(self.text[at:end])
            if call is None:  # text: everything from here on (the calls before it stand)
                self._plain = True
                break
            self._read = element["}"]
            self._spaces = ""
            calls.append(self._add(*call))
        content = self._text(self.text[self._read:])
        self._read = len(self.text)
        return self._delta(content, calls)

    def _whole_reply(self) -> dict[str, Any]:
        """pythonic and granite: a reply that begins with "[" (after whitespace, or its opener:
        Llama 4's <|python_start|>, Granite's <|tool_call|> or <tool_call>) may be a list of calls:
        held back, to be read whole at the close. Any other is content."""
        if not self._plain:
            rest = self.text.lstrip()
            for tag in _OPENERS[self.calling.parser]:  # each opener in turn, as the close reads them
                if len(rest) < len(tag) and tag.startswith(rest):
                    return {}  # nothing yet, or an opener begun: wait
                rest = rest.removeprefix(tag).lstrip()
            if rest[:1] in ("[", ""):
                return {}
            self._plain = True
        content = self._text(self.text[self._read:])
        self._read = len(self.text)
        return self._delta(content, [])

    def _mistral(self) -> dict[str, Any]:
        """mistral: a reply that begins with "[" (after whitespace) is held back whole, as
        pythonic's; any other streams as content up to a [TOOL_CALLS] (the characters that could
        begin one held back), from which the rest is held, to be read at the close as calls
        (or as content where it is none)."""
        if self._held:
            return {}
        at = self.text.find(_TOOL_CALLS, self._read)
        if at >= 0:
            self._held = True
        elif self._read == 0 and self.text.lstrip()[:1] in ("[", ""):
            return {}  # the array form, or not known yet: held whole
        else:
            at = len(self.text) - _partial_suffix(self.text, self._read, _TOOL_CALLS)
        content = self._text(self.text[self._read:at])
        self._read = at
        return self._delta(content, [])

    def _text(self, text: str) -> str:
        """Content as it comes, but for its trailing whitespace, held back until more content
        comes (then it is content) or a call does (then it is not): so where the text was cut
        into pieces changes nothing."""
        text = self._spaces + text
        body = text.rstrip()
        self._spaces = text[len(body):]
        self.content += body
        return body

    def _add(self, name: str, arguments: str) -> dict[str, Any]:
        self.calls.append(_call(name, arguments))
        return dict(self.calls[-1], index=len(self.calls) - 1)

    @staticmethod
    def _delta(content: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = calls
        return delta


_PYTHON_START, _PYTHON_END = "<|python_start|>", "<|python_end|>"  # Llama 4's, where special tokens are kept


def _pythonic_calls(text: str) -> Optional[list[tuple[str, str]]]:
    """(name, JSON arguments) of each call of a reply that is one Python list of calls with
    keyword arguments whose values are literals ([f(a=1, b="x"), g()]); None for any other
    reply (no list, a positional argument, a value that is an expression or no JSON)."""
    body = text.strip().removeprefix(_PYTHON_START).removesuffix(_PYTHON_END).strip()
    if not body.startswith("["):
        return None
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for call in tree.elts:
            if (not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args
                    or any(k.arg is None for k in call.keywords) or not _NAME.fullmatch(call.func.id)):
                return None
            arguments = json.dumps({k.arg: ast.literal_eval(k.value) for k in call.keywords},
                                   ensure_ascii=False, allow_nan=False)
            if not _encodable(arguments):  # a lone surrogate, from an escape
                return None
            calls.append((call.func.id, arguments))
        return calls
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


def _mistral_calls(text: str) -> Optional[list[tuple[str, str]]]:
    """(name, arguments) of each call of a reply that is one JSON array of {"name": ...,
    "arguments": {...}} objects (after [TOOL_CALLS], where special tokens are kept), as Mistral's
    models write them, each read as hermes reads its block's (arguments as written, or a JSON
    string's value), and only an object taken as arguments; or of a reply in the newer form
    [TOOL_CALLS]name[ARGS]{...}[TOOL_CALLS]...; None for any other reply."""
    body = text.strip()
    if body.startswith(_TOOL_CALLS):
        body = body[len(_TOOL_CALLS):].lstrip()
        if not body.startswith("["):
            return _mistral_args_calls(text.strip())
    return _json_array_calls(body)


def _granite_calls(text: str) -> Optional[list[tuple[str, str]]]:
    """(name, arguments) of each call of a reply that is one JSON array of {"name": ...,
    "arguments": {...}} objects after <|tool_call|> (where special tokens are kept) or
    <tool_call>, or none, as Granite 3's models write them; None for any other reply."""
    body = text.strip()
    for tag in _OPENERS["granite"]:
        body = body.removeprefix(tag).lstrip()
    return _json_array_calls(body)


def _json_array_calls(body: str) -> Optional[list[tuple[str, str]]]:
    """(name, arguments) of each object of `body`, one JSON array of {"name": ..., "arguments":
    {...}} objects, each read as hermes reads its block's (arguments as written, or a JSON
    string's value), and only an object taken as arguments; None for anything else."""
    if not body.startswith("["):
        return None
    calls, at = [], _BLANK.match(body, 1).end()
    while True:
        members = _object_members(body, at)
        if members is None or set(members) != {"name", "arguments", "}"}:
            return None
        call = _members_call(members)
        try:
            if call is None or not isinstance(json.loads(call[1]), dict):
                return None
        except (ValueError, RecursionError):
            return None
        calls.append(call)
        at = _BLANK.match(body, members["}"]).end()
        if body[at:at + 1] != ",":
            return calls if body[at:] == "]" else None
        at = _BLANK.match(body, at + 1).end()


def _mistral_args_calls(body: str) -> Optional[list[tuple[str, str]]]:
    """(name, arguments) of each [TOOL_CALLS]name[ARGS]{...} of a reply made of those alone (also
    with a [CALL_ID]id before [ARGS], or no [ARGS] before the object, as vLLM reads them;
    arguments a JSON object, as written); None where anything else is in it."""
    calls, at, decoder = [], 0, json.JSONDecoder()
    while at < len(body):
        if not body.startswith(_TOOL_CALLS, at):
            return None
        name = _MISTRAL_NAME.match(body, at + len(_TOOL_CALLS))
        if name is None:
            return None
        at = name.end()
        if body.startswith(_CALL_ID, at):  # an id up to [ARGS]
            at = body.find(_ARGS, at)
            if at < 0:
                return None
        if body.startswith(_ARGS, at):
            at += len(_ARGS)
        at = _BLANK.match(body, at).end()
        try:
            value, end = decoder.raw_decode(body, at)
        except (ValueError, RecursionError):
            return None
        arguments = body[at:end]
        if not isinstance(value, dict) or not _encodable(arguments):
            return None
        calls.append((name.group(1), arguments))
        at = _BLANK.match(body, end).end()
    return calls or None


def _partial_suffix(text: str, start: int, tag: str) -> int:
    """How many of text's last characters (from `start` on) could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


_TOOL_CALLS, _ARGS, _CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"  # Mistral's, where special tokens are kept
_MISTRAL_NAME = re.compile(r"[ \t\n\r]*([A-Za-z0-9_-]{1,64})[ \t\n\r]*")
# the parsers that read a reply whole, at its end: text -> its calls, or None where it is content
_WHOLE_REPLY = {"pythonic": _pythonic_calls, "mistral": _mistral_calls, "granite": _granite_calls}
# what may come before the list of calls of a reply read whole (each text's own, as the model
# writes it where special tokens are kept)
_OPENERS = {"pythonic": (_PYTHON_START,), "granite": ("<|tool_call|>", "<tool_call>")}


def _hermes_call(block: str) -> Optional[tuple[str, str]]:
    """(name, arguments) of a <tool_call> block's {"name": ..., "arguments": ...} (Llama's
    "parameters" too; arguments as written, or a JSON string's value), or None where the block
    is not one whole such object (then it stays the model's text)."""
    block = block.strip(" \t\n\r")
    call = _object_members(block, 0)
    if call is None or call["}"] != len(block):
        return None
    return _members_call(call)


def _members_call(call: dict[str, Any]) -> Optional[tuple[str, str]]:
    """(name, arguments) of a call object's members as _object_members reads them (Llama's
    "parameters" for "arguments" too), or None where they make no call."""
    name = _string(call.get("name"))
    arguments = call.get("arguments", call.get("parameters"))
    if name is None or not _NAME.fullmatch(name) or arguments is None:
        return None
    if arguments.startswith('"'):  # arguments written as a JSON string: its value, if it is text
        value = _string(arguments)
        if value is not None and _encodable(value):
            arguments = value
    return name, arguments


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate, from an escape
        return False
    return True


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"  # (Llama 3's: a reply of calls may begin with it)
_BETWEEN = " \t\n\r;"  # what may lie before and between Llama 3's JSON calls
_SEPARATORS = re.compile(r"[ \t\n\r;]*")
_ELEMENT_GAP = re.compile(r"[ \t\n\r\[,]*")  # before an element of "required"'s array
_BLANK = re.compile(r"[ \t\n\r]*")
_STRUCTURE = re.compile(r'[\\"{}\[\]]')  # the characters that move a JSON scan's state


class _ObjectEnd:
    """Where a JSON object that begins at `start` ends, sought as its text comes: each call reads
    on from where the last stopped (inside a string or not, how deep, an escape pending), so a
    long object costs its length once, not once per piece."""

    def __init__(self, start: int) -> None:
        self.start, self.pos, self.depth, self.in_string, self.skip_at = start, start, 0, False, -1

    def end(self, text: str) -> Optional[int]:
        """The index after the object's closing brace, or None while it has not come."""
        for match in _STRUCTURE.finditer(text, self.pos):
            i, ch = match.start(), match.group()
            if i == self.skip_at:  # the character an escape takes
                continue
            if self.in_string:
                if ch == "\\":
                    self.skip_at = i + 1
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            else:  # } or ]
                self.depth -= 1
                if self.depth == 0:
                    self.pos = i + 1
                    return i + 1
        self.pos = len(text)
        return None


def _tag_start(text: str, start: int) -> int:
    """How many of the text's last characters (from `start` on) could begin a <tool_call>."""
    for k in range(min(len(_OPEN) - 1, len(text) - start), 0, -1):
        if text.endswith(_OPEN[:k]):
            return k
    return 0


def _object_members(text: str, at: int) -> Optional[dict[str, Any]]:
    """The JSON object at text[at:] as {key: its value's text as written}, with "}" the index
    after it; None where no whole object is there. The values' own text: re-encoding could
    change them (a lone surrogate escape or 1e999 does not survive json.loads and dumps)."""
    decoder = json.JSONDecoder()
    skip = lambda i: _BLANK.match(text, i).end()  # noqa: E731
    try:
        if text[at:at + 1] != "{":
            return None
        members, i = {}, skip(at + 1)
        if text[i:i + 1] == "}":
            return {"}": i + 1}
        while True:
            key, i = decoder.raw_decode(text, i)
            i = skip(i)
            if not isinstance(key, str) or text[i:i + 1] != ":":
                return None
            start = skip(i + 1)
            _, i = decoder.raw_decode(text, start)
            members[key] = text[start:i]
            i = skip(i)
            if text[i:i + 1] == "}":
                members["}"] = i + 1
                return members
            if text[i:i + 1] != ",":
                return None
            i = skip(i + 1)
    except (ValueError, RecursionError):
        return None


def _string(text: Optional[str]) -> Optional[str]:
    """A JSON string's value (None for anything else)."""
    try:
        value = json.loads(text) if text else None
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, str) else None


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": arguments}}
