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
from streamserve.frontend.scoring import classifier_token_ids
from streamserve.lora.adapter import LoRAAdapter
from streamserve.sampling_params import ParamError, SamplingParams

# A prompt: text, token IDs, or vLLM's {"prompt": ...} / {"prompt_token_ids": [...]} dicts.
PromptType = Union[str, list[int], dict[str, Any]]


class InputProcessor:
    def __init__(self, config: Config, renderer: Renderer, vocab_size: int) -> None:
        self.max_model_len = config.model.max_model_len
        self.by_priority = config.scheduler.scheduling_policy == "priority"
        self.renderer = renderer
        self.vocab_size = vocab_size
        # The model's other end-of-sequence tokens (Llama 3's <|eom_id|>, ...): stop tokens
        # of every request that does not ignore EOS, as vLLM makes them.
        self.extra_eos_ids = frozenset(t for t in eos_token_ids(config.model.model, config.model.hf_config)
                                       if t != renderer.eos_token_id and 0 <= t < vocab_size)
        # a cross-encoder's (config.json's classifier_from_token): the score API reads these logits
        self.classifier_token_ids = classifier_token_ids(renderer.tokenizer, config.model.hf_config, vocab_size)

    @property
    def eos_token_ids(self) -> frozenset:
        """Every token that ends a reply: the tokenizer's EOS and generation_config's."""
        eos = self.renderer.eos_token_id
        return self.extra_eos_ids | ({eos} if eos is not None else set())

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

    def truncate(self, text: Optional[str], ids: list[int], params: SamplingParams
                 ) -> tuple[Optional[str], list[int]]:
        """The prompt cut to its last params.truncate_prompt_tokens tokens (vLLM's; -1: the last
        max_model_len): its text is then None (what is left is no longer that text)."""
        keep = params.truncate_prompt_tokens
        if keep is None:
            return text, ids
        if keep > self.max_model_len:
            raise ParamError(f"truncate_prompt_tokens ({keep}) must be at most max_model_len "
                             f"({self.max_model_len})", "truncate_prompt_tokens")
        keep = self.max_model_len if keep == -1 else keep
        return (text, ids) if len(ids) <= keep else (None, ids[-keep:])

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's reading of bad_words: each word's tokens as it would begin the text and, where
        that differs in its first token only, after a space (as it would follow a word)."""
        encode = self.renderer.tokenizer.encode
        sequences: list[list[int]] = []
        for word in words:
            bare = encode(word.lstrip(), add_special_tokens=False)
            spaced = encode(" " + word.lstrip(), add_special_tokens=False)
            sequences.append(bare)
            if len(spaced) == len(bare) and spaced[0] != bare[0]:
                sequences.append(spaced)
            if max(bare + spaced) >= self.vocab_size:  # (a tokenizer larger than the model)
                raise ParamError(f"bad word {word!r} has a token past the model's vocabulary", "bad_words")
        return sequences

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        validate_prompt(prompt_token_ids, params, self.max_model_len, self.vocab_size)
        ids = params.pool_token_ids
        if ids is not None and (not params.embed or not isinstance(ids, (list, tuple)) or not ids or any(
                not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.vocab_size for i in ids)):
            raise ParamError(f"pool_token_ids must be token IDs (0 to {self.vocab_size - 1}), with embed",
                             "pool_token_ids")

    def check_priority(self, priority: Any) -> None:
        """A request's priority: an integer, other than 0 only under the priority policy (as in vLLM)."""
        if not isinstance(priority, int) or isinstance(priority, bool) or not -2 ** 63 <= priority < 2 ** 63:
            raise ParamError("priority must be an integer (a 64-bit one)", "priority")
        if priority and not self.by_priority:
            raise ParamError(f"priority {priority} asks for priority scheduling, which is off: "
                             "start with --scheduling-policy priority", "priority")

    def process(self, child_ids: list[str], prompt_token_ids: list[int], params: SamplingParams,
                arrival_time: Optional[float] = None, priority: int = 0,
                lora: Optional[LoRAAdapter] = None) -> list[EngineCoreRequest]:
        """One engine request per sample; with a seed, sample k draws from seed + k (mod 2^64).
        lora: the adapter every sample runs through."""
        self.validate(prompt_token_ids, params)
        self.check_priority(priority)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        eos = self.renderer.eos_token_id
        if self.extra_eos_ids and not params.ignore_eos and not self.extra_eos_ids <= params.stop_token_set:
            params = dataclasses.replace(params, stop_token_ids=sorted(params.stop_token_set | self.extra_eos_ids))
        if params.bad_words and params.bad_words_token_ids is None:
            params = dataclasses.replace(params, bad_words_token_ids=self.bad_words_token_ids(params.bad_words))
        requests = []
        for k, child_id in enumerate(child_ids):
            child_params = params
            if params.seed is not None and k:
                child_params = dataclasses.replace(params, seed=(params.seed + k) % 2 ** 64)
            if params.prompt_logprobs is not None and k:  # one sample scores the prompt for all
                child_params = dataclasses.replace(child_params, prompt_logprobs=None)
            requests.append(EngineCoreRequest(child_id, prompt_token_ids, child_params, eos, arrival, priority,
                                              lora))
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
