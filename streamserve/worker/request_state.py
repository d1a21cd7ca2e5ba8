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
