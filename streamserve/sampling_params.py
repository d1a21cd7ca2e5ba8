"""SamplingParams: how one request's tokens are chosen and when it stops (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

MAX_LOGPROBS = 20
# A temperature below this samples greedily (as in vLLM): dividing by it would overflow.
GREEDY_BELOW = 1e-5


class ParamError(ValueError):
    """A setting the engine cannot run with; `param` names it (the API's error "param")."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrained decoding (vLLM's names), one of: `json`, a JSON schema (a dict or its text)
    that the output is one value of (the OpenAI API's response_format {"type": "json_schema"});
    `choice`, strings the output is exactly one of; `regex`, a regular expression the output
    matches whole; `json_object=True`, the output is one JSON object (response_format
    {"type": "json_object"}). It ends with EOS once it is whole. What a schema may say:
    engine/structured_output.py; a regex: engine/regex.py."""

    json: Optional[Union[str, dict]] = None
    choice: Optional[list[str]] = None
    json_object: bool = False
    regex: Optional[str] = None
    # A reasoning model's <think> block before it (the server sets this under --reasoning-parser):
    # "inside" (the prompt opened it) or "may" (the reply may open one); the block's text is
    # free, the structure starts after its </think> (as vLLM holds only the answer to it).
    thinking: Optional[str] = None
    # Derived: the recognizer's states before the output (structured_output.start_states), made
    # once here for every request of these params
    states: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        from streamserve.engine.structured_output import SchemaError, start_states

        given = [self.json is not None, self.choice is not None, self.json_object is not False,
                 self.regex is not None]
        if sum(given) != 1:
            raise ParamError("structured_outputs takes one of json (a JSON schema), choice (a list of strings), "
                             "regex (a regular expression) or json_object=True", "structured_outputs")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ParamError("regex must be a string (a regular expression)", "structured_outputs")
        if self.thinking not in (None, "inside", "may"):
            raise ParamError("thinking must be 'inside', 'may' or None", "structured_outputs")
        if type(self.json_object) is not bool:
            raise ParamError("json_object must be true or false", "structured_outputs")
        if self.choice is not None and not (isinstance(self.choice, list) and self.choice
                                            and all(isinstance(c, str) and c for c in self.choice)):
            raise ParamError("choice must be a non-empty list of non-empty strings", "structured_outputs")
        try:  # (a schema or regex it cannot hold an output to is refused here)
            object.__setattr__(self, "states", start_states(self))
        except SchemaError as exc:
            raise ParamError(str(exc), "structured_outputs") from None


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    # the logprob of each prompt token given those before it, with the top N (vLLM's)
    prompt_logprobs: Optional[int] = None
    logit_bias: Optional[dict[int, float]] = None  # token ID -> added to its logit (-100 bans it)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: Optional[StructuredOutputsParams] = None
    # the embeddings API's: the request also returns its last prompt token's final hidden
    # state, L2-normalised (vLLM's last-token pooling), from the step that reads that token
    embed: bool = False
    # with embed, the score API's classifier (classifier_from_token): in place of the embedding,
    # that token's logits at these token IDs
    pool_token_ids: Optional[list[int]] = None
    # vLLM's: only these token IDs may be sampled
    allowed_token_ids: Optional[list[int]] = None
    # vLLM's: words never generated. The InputProcessor reads each as tokens (with and without a
    # leading space) into bad_words_token_ids; a token that would complete one is not sampled.
    bad_words: Optional[list[str]] = None
    bad_words_token_ids: Optional[list[list[int]]] = field(default=None, repr=False)
    # vLLM's: only the prompt's last k tokens are read (-1: the last max_model_len)
    truncate_prompt_tokens: Optional[int] = None

    # Derived: the stop strings as a list, the stop token ids as a set.
    stop_list: list[str] = field(init=False, repr=False)
    stop_token_set: frozenset[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.stop_list = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, name)
            if not (ids is None or isinstance(ids, (list, tuple)) and all(_is_token_id(t) for t in ids)):
                raise ParamError(f"{name} must be a list of non-negative integers", name)
        self.stop_token_set = frozenset(self.stop_token_ids or ())
        self._validate()

    def _validate(self) -> None:
        checks = [  # (holds, the field it is about, the message if not)
            (self.n >= 1, "n", f"n must be >= 1, got {self.n}"),
            (self.seed is None or (isinstance(self.seed, int) and -2 ** 63 <= self.seed < 2 ** 64),
             "seed", f"seed must be in [-2^63, 2^64) (a 64-bit integer), got {self.seed}"),
            (-2.0 <= self.presence_penalty <= 2.0,
             "presence_penalty", f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0,
             "frequency_penalty", f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.repetition_penalty > 0.0,
             "repetition_penalty", f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (self.temperature >= 0.0, "temperature", f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0 or self.top_k == -1,
             "top_k", f"top_k must be 0 or -1 (off) or a positive count, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}"),
            (self.max_tokens is None or self.max_tokens >= 1,
             "max_tokens", f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             "min_tokens", f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             "logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             "prompt_logprobs", f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"),
            (all(isinstance(s, str) and s for s in self.stop_list),
             "stop", "stop must be a non-empty string or a list of non-empty strings"),
            (self.logit_bias is None or all(
                _is_token_id(t) and isinstance(b, (int, float)) and -100 <= b <= 100
                for t, b in self.logit_bias.items()),
             "logit_bias", "logit_bias must map token IDs (non-negative integers) to biases in [-100, 100]"),
            (self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
             "structured_outputs", "structured_outputs must be a StructuredOutputsParams"),
            (self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
             "allowed_token_ids", "allowed_token_ids must list at least one token ID"),
            (self.allowed_token_ids is None or self.structured_outputs is None,
             "allowed_token_ids", "give allowed_token_ids or structured outputs, not both"),
            (self.bad_words is None or isinstance(self.bad_words, (list, tuple)) and all(
                isinstance(w, str) and w.strip() for w in self.bad_words),
             "bad_words", "bad_words must be a list of strings, each with more than whitespace"),
            (self.bad_words_token_ids is None or isinstance(self.bad_words_token_ids, (list, tuple)) and all(
                isinstance(ids, (list, tuple)) and ids and all(map(_is_token_id, ids))
                for ids in self.bad_words_token_ids),
             "bad_words", "bad_words_token_ids must be a list of non-empty lists of token IDs"),
            (self.truncate_prompt_tokens is None or _is_int(self.truncate_prompt_tokens)
             and (self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1),
             "truncate_prompt_tokens", "truncate_prompt_tokens must be a positive count of tokens, or -1 "
             f"(max_model_len), got {self.truncate_prompt_tokens}"),
            (self.structured_outputs is None or not (self.min_tokens or self.ignore_eos),
             "min_tokens" if self.min_tokens else "ignore_eos",
             "structured output ends with EOS once the output is whole: it takes neither min_tokens nor ignore_eos"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise ParamError(message, param)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def reads_tokens_on_host(self) -> bool:
        """Whether a step that samples for it must come back to the host before the next step is
        scheduled (async scheduling): its sampling reads its tokens there (penalties, bad words,
        min_tokens, a seed drawn by position), its structure's state follows each token, or the
        step's logprobs or embedding are read there."""
        return (self.has_penalties or bool(self.bad_words_token_ids) or self.min_tokens > 0
                or self.seed is not None or self.logprobs is not None or self.prompt_logprobs is not None
                or self.structured_outputs is not None or self.embed)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_id(value) -> bool:
    return _is_int(value) and value >= 0


# An embedding request's settings: read the prompt, pool its last token, one token sampled
# (and dropped) to finish it
EMBEDDING = SamplingParams(max_tokens=1, temperature=0.0, embed=True)


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams, for LLM.beam_search (frontend/beam_search.py)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ParamError(f"{name} must be an integer >= 1, got {value!r}", name)
        if self.beam_width > MAX_LOGPROBS // 2:  # (each step reads 2 * beam_width logprobs)
            raise ParamError(f"beam_width must be at most {MAX_LOGPROBS // 2}, got {self.beam_width}", "beam_width")
        if isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, (int, float)):
            raise ParamError(f"length_penalty must be a number, got {self.length_penalty!r}", "length_penalty")

    def step_params(self) -> SamplingParams:
        """What each beam's one-token request asks: the likeliest 2 * beam_width next tokens."""
        return SamplingParams(max_tokens=1, logprobs=2 * self.beam_width, temperature=self.temperature,
                              ignore_eos=True)
