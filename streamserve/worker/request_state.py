"""What the model runner keeps of each request between steps."""

from __future__ import annotations

from typing import Optional

import torch

from streamserve.engine.scheduler_output import NewRequestData
from streamserve.sampling_params import SamplingParams


class RequestState:
    __slots__ = ("req_id", "token_ids", "num_prompt_tokens", "params", "eos_token_id",
                 "row", "num_computed_tokens", "generator", "allowed_mask", "lora")

    def __init__(self, new: NewRequestData, generator: Optional[torch.Generator], row: int = -1) -> None:
        self.req_id = new.req_id
        self.token_ids: list[int] = list(new.token_ids)  # prompt + output, grows as we sample
        self.num_prompt_tokens = new.num_prompt_tokens
        self.params: SamplingParams = new.sampling_params
        self.eos_token_id = new.eos_token_id
        self.row = row  # its row of the runner's BlockTable (which holds its block IDs)
        self.num_computed_tokens = new.num_computed_tokens
        self.generator = generator
        self.lora = new.lora  # its LoRA adapter, or None
        self.allowed_mask = None  # allowed_token_ids as a mask, built by the sampler when first needed

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


class DraftRow:
    """A row of a step that checks a request's guessed tokens (speculative decoding) whose
    logits follow `drafts`, the guesses before it: to the sampler, the request as it would be had
    it sampled those (its penalties, bad words and min_tokens count them, its seed draws for the
    position after them)."""

    __slots__ = ("state", "token_ids")

    def __init__(self, state: RequestState, drafts: list[int]) -> None:
        self.state = state
        self.token_ids = state.token_ids + drafts

    @property
    def req_id(self) -> str:
        return self.state.req_id

    @property
    def params(self) -> SamplingParams:
        return self.state.params

    @property
    def num_prompt_tokens(self) -> int:
        return self.state.num_prompt_tokens

    @property
    def eos_token_id(self) -> Optional[int]:
        return self.state.eos_token_id

    @property
    def generator(self) -> Optional[torch.Generator]:
        return self.state.generator

    @property
    def allowed_mask(self):
        return self.state.allowed_mask

    @allowed_mask.setter
    def allowed_mask(self, mask) -> None:
        self.state.allowed_mask = mask

    prompt_token_ids = RequestState.prompt_token_ids
    output_token_ids = RequestState.output_token_ids
