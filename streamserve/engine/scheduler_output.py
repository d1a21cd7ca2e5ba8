"""What crosses between the scheduler and the model runner, each way, once a step.

The worker imports this module, never the scheduler itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import numpy as np

from streamserve.lora.adapter import LoRAAdapter
from streamserve.sampling_params import SamplingParams


class TokenLogprobs(NamedTuple):
    """Logprobs at one sampled position: the sampled token's, then the top-N."""

    sampled_logprob: float
    sampled_rank: int
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class NewRequestData:
    """A request the model runner has no state for yet (first time, or resumed
    after preemption): everything it needs to run it."""

    req_id: str
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_id: Optional[int]
    block_ids: list[int]
    num_computed_tokens: int
    lora: Optional[LoRAAdapter] = None


@dataclass
class CachedRequestData:
    """Requests the runner already holds: only what changed."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens to read this step, in batch order (running, then new).
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the runner must forget before this step (finished, aborted, preempted).
    finished_req_ids: set[str]
    preempted_req_ids: list[str]
    # structured output: req_id -> [vocab] bool mask of the tokens it may sample this step
    # (read-only); [1 + guesses, vocab] for a request checking guesses, a mask for each row
    allowed_token_masks: dict[str, np.ndarray] = field(default_factory=dict)
    # speculative decoding: req_id -> the guessed tokens it reads after its last one (its
    # num_scheduled_tokens counts them); each row samples, and the guesses up to the first
    # that differs from its row's token are kept
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # req_id -> how many of its blocks it keeps: the scheduler took back the rest (taken for
    # guesses refused since the last step), before this step's new_block_ids
    trimmed_block_counts: dict[str, int] = field(default_factory=dict)
    # async scheduling: the requests this step samples for, each counted as having one token in
    # flight until the step's output is read (Request.num_pending); and whether one of them must
    # be read back before the next step is scheduled (SamplingParams.reads_tokens_on_host)
    sampling_req_ids: list[str] = field(default_factory=list)
    waits_for_tokens: bool = False


@dataclass
class ModelRunnerOutput:
    """The requests that sampled this step, in batch order, with their tokens: one each, or
    with speculative decoding up to one more than its guesses."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: Optional[list[Optional[list[TokenLogprobs]]]] = None  # per request: one per token, or None
    # req_id -> (first prompt position scored, its TokenLogprobs and the next ones'): position
    # p scores prompt token p + 1
    prompt_logprobs: Optional[dict[str, tuple[int, list[TokenLogprobs]]]] = None
    # req_id -> the embedding of a request with SamplingParams.embed that sampled this step
    embeddings: Optional[dict[str, list[float]]] = None
