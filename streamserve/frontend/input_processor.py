"""InputProcessor: a prompt and its SamplingParams -> validated EngineCoreRequests."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional, Union

from streamserve.config import Config
from streamserve.engine.request import EngineCoreRequest, validate_prompt
from streamserve.frontend.renderer import Renderer
from streamserve.sampling_params import SamplingParams

# A prompt: text, token IDs, or vLLM's {"prompt": ...} / {"prompt_token_ids": [...]} dicts.
PromptType = Union[str, list[int], dict[str, Any]]


class InputProcessor:
    def __init__(self, config: Config, renderer: Renderer, vocab_size: int) -> None:
        self.max_model_len = config.model.max_model_len
        self.renderer = renderer
        self.vocab_size = vocab_size

    def tokenize(self, prompt: PromptType) -> tuple[Optional[str], list[int]]:
        """(prompt text or None, prompt token IDs)."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, self.renderer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            return None, self._check_ids(prompt)
        raise TypeError(f"a prompt must be a string, a list of token IDs or a dict, not {type(prompt).__name__}")

    def _check_ids(self, ids: Any) -> list[int]:
        ids = list(ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise TypeError("prompt token IDs must be integers")
        return ids

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        validate_prompt(prompt_token_ids, params, self.max_model_len, self.vocab_size)

    def process(self, child_ids: list[str], prompt_token_ids: list[int],
                params: SamplingParams, arrival_time: Optional[float] = None) -> list[EngineCoreRequest]:
        """One engine request per sample; with a seed, sample k draws from seed + k (mod 2^64)."""
        self.validate(prompt_token_ids, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        eos = self.renderer.eos_token_id
        requests = []
        for k, child_id in enumerate(child_ids):
            child_params = params
            if params.seed is not None and k:
                child_params = dataclasses.replace(params, seed=(params.seed + k) % 2 ** 64)
            requests.append(EngineCoreRequest(child_id, prompt_token_ids, child_params, eos, arrival))
        return requests
