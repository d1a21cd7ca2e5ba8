"""InputProcessor: a prompt and its SamplingParams -> validated EngineCoreRequests."""

from __future__ import annotations

import dataclasses
import json
import os
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
        # The model's other end-of-sequence tokens (Llama 3's <|eom_id|>, ...): stop tokens
        # of every request that does not ignore EOS, as vLLM makes them.
        self.extra_eos_ids = frozenset(t for t in eos_token_ids(config.model.model, config.model.hf_config)
                                       if t != renderer.eos_token_id and 0 <= t < vocab_size)

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
        if self.extra_eos_ids and not params.ignore_eos and not self.extra_eos_ids <= params.stop_token_set:
            params = dataclasses.replace(params, stop_token_ids=sorted(params.stop_token_set | self.extra_eos_ids))
        requests = []
        for k, child_id in enumerate(child_ids):
            child_params = params
            if params.seed is not None and k:
                child_params = dataclasses.replace(params, seed=(params.seed + k) % 2 ** 64)
            if params.prompt_logprobs is not None and k:  # one sample scores the prompt for all
                child_params = dataclasses.replace(child_params, prompt_logprobs=None)
            requests.append(EngineCoreRequest(child_id, prompt_token_ids, child_params, eos, arrival))
        return requests


def eos_token_ids(model_dir: str, hf_config: dict[str, Any]) -> list[int]:
    """The end-of-sequence token IDs the model's generation_config.json lists (config.json's
    where it has none): one ID or several."""
    ids = hf_config.get("eos_token_id")
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                ids = json.load(f).get("eos_token_id", ids)
        except (OSError, ValueError, AttributeError):
            pass  # unreadable: the tokenizer's EOS still stops every request
    ids = ids if isinstance(ids, list) else [ids]
    return [t for t in ids if isinstance(t, int) and not isinstance(t, bool)]
