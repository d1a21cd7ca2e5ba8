"""What the user gets back: RequestOutput and CompletionOutput (vLLM's names and fields)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

# One position's logprobs: {token_id: Logprob}, the sampled token first.
SampleLogprobs = list[dict[int, "Logprob"]]


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: Optional[str] = None
    token_bytes: Optional[bytes] = None  # its bytes: a piece of a character's UTF-8 decodes to U+FFFD


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[SampleLogprobs] = None
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort"
    stop_reason: Optional[int | str] = None  # the stop token id or stop string that matched

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    # with SamplingParams.prompt_logprobs: None for the first prompt token, then per token its
    # {token_id: Logprob} (itself first, then the top N); in a stream, on one delta, whole
    prompt_logprobs: Optional[SampleLogprobs] = None
    # with SamplingParams.embed: the prompt's embedding (its last token's final hidden state,
    # L2-normalised), once read
    embedding: Optional[list[float]] = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """LLM.embed's result for one prompt (vLLM's name and fields)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """LLM.score's result for one pair (vLLM's name and fields): the pair's prompt token IDs
    are its two texts', one after the other, as vLLM gives them for an embedding score."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
