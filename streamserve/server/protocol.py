"""OpenAI request bodies -> (prompt, SamplingParams), and the one error shape.

Every client mistake becomes an APIError with an HTTP status and OpenAI's error body
{"error": {"message", "type", "param", "code"}}; nothing else reaches a client.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from streamserve.sampling_params import (MAX_LOGPROBS, BeamSearchParams, ParamError, SamplingParams,
                                         StructuredOutputsParams)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 type: str = "invalid_request_error", code: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: Optional[str] = None) -> APIError:
    return APIError(400, message, param)


# body field -> (SamplingParams field, accepted types)
_NUMBER = (int, float)
_FIELDS = {
    "n": ("n", (int,)), "temperature": ("temperature", _NUMBER), "top_p": ("top_p", _NUMBER),
    "top_k": ("top_k", (int,)), "min_p": ("min_p", _NUMBER), "seed": ("seed", (int,)),
    "presence_penalty": ("presence_penalty", _NUMBER),
    "frequency_penalty": ("frequency_penalty", _NUMBER),
    "repetition_penalty": ("repetition_penalty", _NUMBER),
    "stop_token_ids": ("stop_token_ids", (list,)), "ignore_eos": ("ignore_eos", (bool,)),
    "min_tokens": ("min_tokens", (int,)), "skip_special_tokens": ("skip_special_tokens", (bool,)),
    "include_stop_str_in_output": ("include_stop_str_in_output", (bool,)),
    "prompt_logprobs": ("prompt_logprobs", (int,)),
    "allowed_token_ids": ("allowed_token_ids", (list,)), "bad_words": ("bad_words", (list,)),
    "truncate_prompt_tokens": ("truncate_prompt_tokens", (int,)),
}


def _must_be(key: str, what: str, value: Any, integer: bool = True) -> APIError:
    """The 400 for a field of the wrong type (`what`). orjson reads an integer beyond 64 bits as a
    float: where an integer was asked for, such a value is named out of range."""
    if integer and isinstance(value, float) and abs(value) >= 2 ** 63:
        return bad_request(f"'{key}' must be {what}; {value:g} is out of range", key)
    return bad_request(f"'{key}' must be {what}", key)


def sampling_params(body: dict[str, Any], max_n: int, default_max_tokens: Optional[int],
                    logprobs: Optional[int] = None, defaults: Optional[dict[str, Any]] = None) -> SamplingParams:
    """Validate the sampling fields of a completions or chat body; `defaults`: SamplingParams
    keywords for the fields it leaves unset (the model's generation config), whose max_tokens
    caps the body's (or its default), as vLLM takes the least of them."""
    defaults = dict(defaults or {})
    cap = defaults.pop("max_tokens", None)
    kwargs: dict[str, Any] = {**defaults, "logprobs": logprobs}
    for key, (name, types) in _FIELDS.items():
        value = body.get(key)
        if value is None:
            continue
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            raise _must_be(key, " or ".join(t.__name__ for t in types), value, int in types)
        kwargs[name] = value
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int):
                raise _must_be(key, "an integer", value)
            kwargs["max_tokens"] = value
            break
    else:
        kwargs["max_tokens"] = default_max_tokens
    if cap is not None:
        kwargs["max_tokens"] = cap if kwargs["max_tokens"] is None else min(kwargs["max_tokens"], cap)
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict) or not all(
                isinstance(k, str) and k.isascii() and k.isdigit() and isinstance(v, _NUMBER)
                and not isinstance(v, bool) for k, v in bias.items()):
            raise bad_request("'logit_bias' must map token IDs (as strings) to numbers", "logit_bias")
        kwargs["logit_bias"] = {int(k): float(v) for k, v in bias.items()}
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise bad_request("'stop' must be a non-empty string or a list of them", "stop")
        kwargs["stop"] = stop
    kwargs["structured_outputs"] = structured_outputs(body)
    if kwargs.get("n", 1) > max_n:
        raise bad_request(f"'n' must be at most {max_n} (the server's --max-n)", "n")
    try:
        return SamplingParams(**kwargs)
    except ParamError as exc:
        raise bad_request(str(exc), exc.param) from None


# vLLM's earlier names for structured_outputs' fields (grammar is refused there)
_GUIDED = {"guided_json": "json", "guided_choice": "choice", "guided_regex": "regex", "guided_grammar": "grammar"}


_COMPILED = ("json", "regex", "choice")  # the structured_outputs fields compiled before use


def compiles_output(body: dict[str, Any]) -> bool:
    """Whether the body holds its output to something compiled: a JSON schema, a regex or choices
    (by response_format, structured_outputs or an earlier guided_* field)."""
    fmt, so = body.get("response_format"), body.get("structured_outputs")
    return (isinstance(fmt, dict) and fmt.get("type") == "json_schema"
            or isinstance(so, dict) and any(so.get(key) is not None for key in _COMPILED)
            or any(body.get(key) is not None for key, kind in _GUIDED.items() if kind in _COMPILED))


def structured_outputs(body: dict[str, Any]) -> Optional[StructuredOutputsParams]:
    """What the output is held to: OpenAI's response_format ({"type": "text"}, "json_object"
    or "json_schema" with {"json_schema": {"name", "schema"}}) or vLLM's structured_outputs
    ({"json": schema}, {"choice": [...]} or {"json_object": true}; or its earlier guided_json /
    guided_choice); None: free text."""
    fmt, extra = body.get("response_format"), body.get("structured_outputs")
    legacy = [key for key in _GUIDED if body.get(key) is not None]  # older vLLM's guided_* fields
    if legacy:
        if extra is not None or len(legacy) > 1:
            raise bad_request(f"give one of 'structured_outputs', {', '.join(map(repr, _GUIDED))}", legacy[0])
        extra = {_GUIDED[legacy[0]]: body[legacy[0]]}
    if fmt is not None and extra is not None:
        raise bad_request("give 'response_format' or 'structured_outputs', not both", "structured_outputs")
    if extra is not None:
        param = "structured_outputs"
        unknown = sorted(set(extra) - {"json", "choice", "json_object", "regex"}) if isinstance(extra, dict) else None
        if unknown is None or unknown:
            raise bad_request("'structured_outputs' takes one of 'json' (a JSON schema), 'choice' (a list of "
                              "strings), 'regex' (a regular expression) or 'json_object': true"
                              + (f", not {', '.join(unknown)}" if unknown else ""), param)
        kwargs = extra
    elif fmt is None:
        return None
    else:
        param = "response_format"
        if not isinstance(fmt, dict):
            raise bad_request("'response_format' must be an object: {\"type\": \"text\"}, \"json_object\" "
                              "(JSON mode) or \"json_schema\"", param)
        kind = fmt.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            kwargs = {"json_object": True}
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or "schema" not in spec:
                raise bad_request("'response_format' json_schema takes {\"json_schema\": {\"name\": ..., "
                                  "\"schema\": {...}}}", param)
            if not isinstance(spec["schema"], (dict, bool)):
                raise bad_request("'response_format.json_schema.schema' must be a JSON schema (an object)", param)
            kwargs = {"json": spec["schema"]}
        else:
            raise bad_request(f"'response_format' {kind!r} is not supported: give {{\"type\": \"text\"}}, "
                              "\"json_object\" (JSON mode) or \"json_schema\"", param)
    try:
        return StructuredOutputsParams(**kwargs)
    except ParamError as exc:
        raise bad_request(str(exc), param) from None


def logprobs_setting(body: dict[str, Any], chat: bool) -> Optional[int]:
    """How many top logprobs to return per token (None: no logprobs). Completions take
    'logprobs': N; chat takes 'logprobs': true and 'top_logprobs': N."""
    value, top = body.get("logprobs"), body.get("top_logprobs")
    if not chat:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise _must_be("logprobs", "an integer", value)
        return value
    if value is not None and not isinstance(value, bool):
        raise bad_request("'logprobs' must be a boolean", "logprobs")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_LOGPROBS:
            raise bad_request(f"'top_logprobs' must be an integer in [0, {MAX_LOGPROBS}]", "top_logprobs")
        if not value:
            raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if value else None


def refuse_unsupported(body: dict[str, Any]) -> None:
    """OpenAI fields this server cannot honour: refused, rather than quietly ignored (other
    unknown fields are ignored, as vLLM does)."""
    if body.get("suffix"):
        raise bad_request("'suffix' (insertion) is not supported", "suffix")
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise bad_request("'best_of' is not supported: every sample is returned (use 'n')", "best_of")


# what beam search cannot take (vLLM's takes none of them either): refused, not ignored
_NOT_WITH_BEAMS = ("logprobs", "top_logprobs", "prompt_logprobs", "stop", "stop_token_ids", "min_tokens",
                   "response_format", "structured_outputs", "guided_json", "guided_choice", "guided_regex",
                   "logit_bias", "allowed_token_ids", "bad_words")


def beam_search(body: dict[str, Any], params: SamplingParams) -> Optional[BeamSearchParams]:
    """vLLM's use_beam_search: n beams (the n best returned), length_penalty; None without it.
    max_tokens is params' (None: the room each prompt leaves, filled in per prompt)."""
    use = body.get("use_beam_search", False)
    if not isinstance(use, bool):
        raise bad_request("'use_beam_search' must be a boolean", "use_beam_search")
    if not use:
        return None
    for key in _NOT_WITH_BEAMS:
        if body.get(key) not in (None, False, [], {}):
            raise bad_request(f"'{key}' is not supported with use_beam_search", key)
    penalty = body.get("length_penalty", 1.0)
    if isinstance(penalty, bool) or not isinstance(penalty, _NUMBER):
        raise _must_be("length_penalty", "a number", penalty, integer=False)
    try:
        return BeamSearchParams(beam_width=params.n, max_tokens=params.max_tokens or 1,
                                ignore_eos=params.ignore_eos, temperature=params.temperature,
                                length_penalty=float(penalty),
                                include_stop_str_in_output=params.include_stop_str_in_output)
    except ParamError as exc:
        raise bad_request(str(exc).replace("beam_width", "n (the beams)"), "n") from None


def echo_setting(body: dict[str, Any], chat: bool) -> bool:
    echo = body.get("echo", False)
    if not echo:
        return False
    if chat:
        raise bad_request("'echo' is a completions field", "echo")
    if not isinstance(echo, bool):
        raise bad_request("'echo' must be a boolean", "echo")
    return True


def stream_options(body: dict[str, Any]) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage): usage in a last chunk, and with vLLM's
    'continuous_usage_stats' also in every chunk (the tokens so far)."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False, False
    if not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    flags = [options.get(key) for key in ("include_usage", "continuous_usage_stats")]
    flags = [False if flag is None else flag for flag in flags]  # null: the default, as vLLM takes it
    if not all(isinstance(flag, bool) for flag in flags):
        raise bad_request("'stream_options' takes booleans", "stream_options")
    return stream, flags[0], flags[0] and flags[1]


def completion_prompts(body: dict[str, Any]) -> list[str | list[int]]:
    """The completions 'prompt': a string, a list of token IDs, or a batch (a list of
    strings or of token-ID lists), each prompt as a string or its token IDs."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_ids(prompt):
        batch = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        batch = prompt
    elif prompt is None or prompt == []:
        raise bad_request("'prompt' is required and must not be empty", "prompt")
    else:
        raise bad_request("'prompt' must be a string, a list of token IDs, or a list of either", "prompt")
    if not all(batch):
        raise bad_request("'prompt' is empty" if len(batch) == 1 else "a prompt in the batch is empty", "prompt")
    return batch


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


class ChatOptions(NamedTuple):
    """How the chat template renders the messages (vLLM's fields)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None


def chat_options(body: dict[str, Any]) -> ChatOptions:
    """'continue_final_message' goes on with the last (assistant) message, and then adds no
    generation prompt unless asked to; 'chat_template_kwargs' are the template's variables
    (Qwen3's enable_thinking, for one)."""
    flags = {}
    for key in ("add_generation_prompt", "continue_final_message"):
        value = body.get(key)
        if value is not None and not isinstance(value, bool):
            raise bad_request(f"'{key}' must be a boolean", key)
        flags[key] = value
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    go_on = bool(flags["continue_final_message"])
    add = flags["add_generation_prompt"]
    return ChatOptions(not go_on if add is None else add, go_on, kwargs)


def nesting_depth(value: Any, limit: int) -> int:
    """How deep lists and objects nest in `value` (1: a flat one), counted up to `limit`."""
    depth, level = 0, [value]
    while depth < limit:
        containers = [item for item in level if isinstance(item, (list, dict))]
        if not containers:
            break
        depth += 1
        level = [v for c in containers for v in (c.values() if isinstance(c, dict) else c)]
    return depth


MAX_TOOL_CALL_DEPTH = 64


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    result = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a 'role'", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad_request(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if content is None:  # as in OpenAI's API, only an assistant's (with tool calls) may go without
            if m["role"] != "assistant":
                raise bad_request(f"messages[{i}].content is required: a string or a list of text parts",
                                  "messages")
            content = ""
        if not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string or a list of text parts", "messages")
        message = {"role": m["role"], "content": content}
        for key, kind in (("name", str), ("tool_call_id", str), ("tool_calls", list)):
            if m.get(key) is not None:
                if not isinstance(m[key], kind):
                    raise bad_request(f"messages[{i}].{key} must be a {'list' if kind is list else 'string'}",
                                      "messages")
                message[key] = m[key]
        if nesting_depth(message.get("tool_calls"), MAX_TOOL_CALL_DEPTH + 1) > MAX_TOOL_CALL_DEPTH:
            raise bad_request(f"messages[{i}].tool_calls nest deeper than {MAX_TOOL_CALL_DEPTH} levels", "messages")
        for call in message.get("tool_calls", ()):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise bad_request(f"messages[{i}].tool_calls: each must be {{\"type\": \"function\", "
                                  "\"function\": {\"name\": ..., \"arguments\": ...}}", "messages")
        result.append(message)
    return result
