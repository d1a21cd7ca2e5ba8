"""Request: the engine's view of one sequence, and what crosses the engine's edges.

A request's life is two counters (DESIGN.md, "The scheduler has no phases"):
`num_tokens` (prompt + output so far) and `num_computed_tokens` (how many of those
have KV in the cache). The scheduler closes the gap; the request samples a token
each time the gap closes.
"""

from __future__ import annotations

import enum
import time
from typing import NamedTuple, Optional

from streamserve.engine.scheduler_output import TokenLogprobs
from streamserve.lora.adapter import LoRAAdapter
from streamserve.sampling_params import ParamError, SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything from here on is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> Optional[str]:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class EngineCoreRequest(NamedTuple):
    """What the front end hands the engine: token IDs and how to sample them."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: Optional[int]
    arrival_time: float
    priority: int = 0  # under the priority policy, lower runs first
    lora: Optional[LoRAAdapter] = None  # the adapter it runs through (lora/), if any


class EngineCoreOutput(NamedTuple):
    """One request's news from one step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: Optional[list[TokenLogprobs]]
    finish_reason: Optional[str]
    stop_reason: Optional[int | str]
    num_cached_tokens: int
    # Seconds from arrival to first being scheduled; on a request's first output only.
    queue_time: Optional[float] = None
    # Prompt logprobs computed this step, in order: the first predicts prompt token 1, ...
    new_prompt_logprobs: Optional[list[TokenLogprobs]] = None
    embedding: Optional[list[float]] = None  # SamplingParams.embed's, from the step that read the prompt


def validate_prompt(prompt_token_ids: list[int], params: SamplingParams,
                    max_model_len: int, vocab_size: int) -> None:
    """Refuse what the engine cannot run, with the numbers in the message."""
    n = len(prompt_token_ids)
    if n == 0:
        raise ParamError("the prompt is empty: give at least one token", "prompt")
    if n > max_model_len or n == max_model_len and not params.embed:  # (an embedding generates nothing)
        raise ParamError(f"the prompt has {n} tokens, but max_model_len is {max_model_len}"
                         + ("" if params.embed else ": there is no room to generate"), "prompt")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ParamError(f"prompt token ID {bad[0]} is outside the vocabulary [0, {vocab_size})", "prompt")
    for field, ids in (("stop_token_ids", params.stop_token_set), ("logit_bias", params.logit_bias or ()),
                       ("allowed_token_ids", params.allowed_token_ids or ()),
                       ("bad_words", [t for word in params.bad_words_token_ids or () for t in word])):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ParamError(f"{field}: {bad[0]} is outside the vocabulary [0, {vocab_size})", field)


class Request:
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "eos_token_id",
                 "arrival_time", "max_tokens", "all_token_ids", "output_token_ids",
                 "num_computed_tokens", "num_cached_tokens", "status", "stop_reason",
                 "block_hashes", "num_preemptions", "first_scheduled_time", "num_prompt_logprobs",
                 "structured_state", "priority", "lora", "spec_token_ids", "token_history",
                 "spec_misses", "spec_pause", "spec_masks", "num_pending", "reads_tokens_on_host")

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, eos_token_id: Optional[int],
                 max_model_len: int, arrival_time: Optional[float] = None, priority: int = 0,
                 lora: Optional[LoRAAdapter] = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.lora = lora
        # Output is capped by max_tokens and by the room left in max_model_len.
        room = max_model_len - len(self.prompt_token_ids)
        asked = sampling_params.max_tokens
        self.max_tokens = room if asked is None else min(asked, room)
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # set when first scheduled: prefix-cache hit length
        self.status = RequestStatus.WAITING
        self.stop_reason: Optional[int | str] = None
        self.block_hashes: list[int] = []  # one per full block of all_token_ids, chained
        self.num_preemptions = 0
        self.first_scheduled_time: Optional[float] = None
        self.num_prompt_logprobs = 0  # prompt logprobs reported so far (of num_prompt_tokens - 1)
        # structured output: the recognizer's states after the output so far (structured_output.py)
        structured = sampling_params.structured_outputs
        self.structured_state = None if structured is None else structured.states
        # speculative decoding: the tokens guessed to follow (checked by the next step), and the
        # tokens as packed integers that the n-gram lookup searches (spec_decode/)
        self.spec_token_ids: list[int] = []
        self.token_history = bytearray()
        self.spec_misses = 0  # steps in a row whose guesses were all refused
        self.spec_pause = 0  # steps left before it guesses again (after misses)
        self.spec_masks: list = []  # structured output: its rows' masks, the guesses before each read
        # async scheduling: tokens sampled by a step in flight, not appended yet (0 or 1), and
        # whether a step that samples for it must be read back before the next is scheduled
        self.num_pending = 0
        self.reads_tokens_on_host = sampling_params.reads_tokens_on_host

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether prompt positions must still be computed for their logprobs (so none may
        come from the prefix cache)."""
        return (self.sampling_params.prompt_logprobs is not None
                and self.num_prompt_logprobs < self.num_prompt_tokens - 1)

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest, max_model_len: int) -> "Request":
        return cls(req.request_id, req.prompt_token_ids, req.sampling_params,
                   req.eos_token_id, max_model_len, req.arrival_time, req.priority, req.lora)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self) -> bool:
        """Set a finished status if the last sampled token ends the request."""
        params = self.sampling_params
        n = len(self.output_token_ids)
        last = self.output_token_ids[-1]
        if n >= params.min_tokens:
            if last == self.eos_token_id and not params.ignore_eos:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.stop_token_set:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if n >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False
