"""LLM: the offline Python API, vLLM-compatible.

    from streamserve import LLM, SamplingParams
    llm = LLM(model="path/to/hf-dir")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=32))

The engine runs in the calling thread: add every request, then step until done.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Optional, Sequence, Union

from tqdm.auto import tqdm

from streamserve.config import Config
from streamserve.engine.core import EngineCore
from streamserve.frontend.input_processor import InputProcessor, PromptType
from streamserve.frontend.output_processor import OutputProcessor
from streamserve.frontend.renderer import Message, Renderer, load_tokenizer
from streamserve.frontend.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, check_step_output
from streamserve.heap import collector_paused
from streamserve.lora.adapter import LoRAAdapter
from streamserve.lora.request import LoRARequest
from streamserve.frontend.scoring import (classifier_score, cosine_scores, cut, distinct_pairs, matryoshka_check,
                                          pair_prompts, score_pairs)
from streamserve.outputs import (EmbeddingOutput, EmbeddingRequestOutput, RequestOutput, ScoringOutput,
                                 ScoringRequestOutput)
from streamserve.sampling_params import EMBEDDING, SamplingParams


class LLM:
    def __init__(self, model: Optional[str] = None, **kwargs: Any) -> None:
        with collector_paused():  # heap.py: the collector's passes over what a load builds
            self.config = Config.from_kwargs(model=model, **kwargs)
            self.tokenizer = load_tokenizer(self.config.model.tokenizer, self.config.model.chat_template)
            self.renderer = Renderer(self.tokenizer)
            self.engine_core = EngineCore(self.config, self.tokenizer)
        self.input_processor = InputProcessor(self.config, self.renderer, self.engine_core.vocab_size)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate takes without SamplingParams: the model's generation_config.json's
        sampling defaults (temperature, top_p, ...; generation_config), else SamplingParams()."""
        return SamplingParams(**self.config.model.sampling_defaults)

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = True, priority: Optional[Sequence[int]] = None,
                 lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None) -> list[RequestOutput]:
        """priority: one per prompt, lower first, under the priority scheduling policy (vLLM's).
        lora_request: the LoRA adapter (LoRARequest(name, int id, path); enable_lora) every
        prompt runs through, or one per prompt (None: the model alone)."""
        prompt_list = _as_prompt_list(prompts)
        params_list = self._params_per_prompt(sampling_params, len(prompt_list))
        priorities = [0] * len(prompt_list) if priority is None else list(priority)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompt_list)} prompts: give one per prompt")
        loras = self._loras_per_prompt(lora_request, len(prompt_list))
        request_ids = []
        try:
            for prompt, params, rank, lora in zip(prompt_list, params_list, priorities, loras):
                text, ids = self.input_processor.truncate(*self.input_processor.tokenize(prompt), params)
                request_ids.append(self._add_request(text, ids, params, priority=rank, lora=lora))
            return self._run_engine(request_ids, use_tqdm)
        except BaseException:
            self._abort(request_ids)
            raise

    def chat(self, messages: Union[list[Message], list[list[Message]]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: Optional[dict] = None,
             continue_final_message: bool = False, tools: Optional[list[dict]] = None) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them (with
        continue_final_message, the model goes on with the last, assistant message; set
        add_generation_prompt to False then, as vLLM asks). `tools`: the functions the model
        may call, for templates that describe them (OpenAI's shape)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conversation in conversations:
            text = self.renderer.render_chat(conversation, add_generation_prompt, chat_template_kwargs,
                                             continue_final_message, tools)
            prompts.append({"prompt": text, "prompt_token_ids":
                            self.tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def beam_search(self, prompts: Union[PromptType, Sequence[PromptType]], params: BeamSearchParams,
                    lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: per prompt, the params.beam_width best sequences
        (frontend/beam_search.py); each sequence's tokens and text hold the prompt's first, as
        vLLM gives them."""
        prompt_list = _as_prompt_list(prompts)
        loras = self._loras_per_prompt(lora_request, len(prompt_list))
        searches = []
        for prompt in prompt_list:
            _, ids = self.input_processor.tokenize(prompt)
            room = self.config.model.max_model_len - len(ids)
            if params.max_tokens > room:
                raise ValueError(f"the prompt has {len(ids)} tokens and max_tokens is {params.max_tokens}: together "
                                 f"they exceed max_model_len ({self.config.model.max_model_len})")
            searches.append(BeamSearch(ids, params, self.input_processor.eos_token_ids))
        step = params.step_params()
        bar = tqdm(total=params.max_tokens, desc="Beam search", disable=not use_tqdm, dynamic_ncols=True)
        with bar:
            while not all(s.done for s in searches):
                live = [(s, lora) for s, lora in zip(searches, loras) if not s.done]
                request_ids = []
                try:
                    for search, lora in live:
                        request_ids += [self._add_request(None, p, step, lora=lora) for p in search.prompts()]
                    outputs = iter(self._run_engine(request_ids, use_tqdm=False))
                except BaseException:
                    self._abort(request_ids)
                    raise
                for search, _ in live:
                    search.advance([check_step_output(next(outputs).outputs[0].logprobs) for _ in search.beams])
                bar.update(1)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        return [BeamSearchOutput(s.result(decode, with_prompt=True)) for s in searches]

    def embed(self, prompts: Union[PromptType, Sequence[PromptType]], use_tqdm: bool = True,
              truncate_prompt_tokens: Optional[int] = None,
              lora_request: Union[LoRARequest, Sequence[Optional[LoRARequest]], None] = None,
              dimensions: Optional[int] = None, pooling_params: Any = None) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding: its last token's final hidden state, L2-normalised (vLLM's
        LLM.embed with last-token pooling, which decoder embedding models such as
        Qwen3-Embedding are trained for); truncate_prompt_tokens k: of its last k tokens
        (-1: max_model_len); lora_request: as generate's; dimensions n: the first n values,
        normalised again, for a model trained for that (config.json's is_matryoshka or
        matryoshka_dimensions); pooling_params: vLLM's PoolingParams (or any object with a
        `dimensions`), whose dimensions are read the same way."""
        if dimensions is None and pooling_params is not None:
            dimensions = getattr(pooling_params, "dimensions", None)
        if dimensions is not None:
            matryoshka_check(self.config.model.hf_config, dimensions)
        params = dataclasses.replace(EMBEDDING, truncate_prompt_tokens=truncate_prompt_tokens)
        return [EmbeddingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(cut(o.embedding, dimensions)))
                for o in self.generate(prompts, params, use_tqdm, lora_request=lora_request)]

    def score(self, data_1: Union[str, Sequence[str]], data_2: Union[str, Sequence[str]], use_tqdm: bool = True,
              truncate_prompt_tokens: Optional[int] = None, lora_request: Optional[LoRARequest] = None
              ) -> list[ScoringRequestOutput]:
        """Each pair's score, the cosine similarity of its texts' embeddings (LLM.embed's), as
        vLLM's LLM.score scores with an embedding model: the one data_1 text against each of
        data_2, or the two lists pairwise (as long as each other). Each distinct text is
        embedded once. A cross-encoder (config.json's classifier_from_token, Qwen3-Reranker's
        as vLLM reads it) reads each pair as one prompt and scores its last token's logits
        (frontend/scoring.py)."""
        texts_1, texts_2 = ([d] if isinstance(d, str) else list(d) for d in (data_1, data_2))
        if not texts_1 or not texts_2 or not all(isinstance(t, str) and t for t in texts_1 + texts_2):
            raise ValueError("LLM.score takes texts: a non-empty string or a list of them on each side")
        pairs = score_pairs(len(texts_1), len(texts_2))
        classifier = self.input_processor.classifier_token_ids
        if classifier is not None:
            params = dataclasses.replace(EMBEDDING, truncate_prompt_tokens=truncate_prompt_tokens,
                                         pool_token_ids=classifier)
            prompts = pair_prompts(self.tokenizer, texts_1, texts_2, pairs)
            outs = self.generate(prompts, params, use_tqdm, lora_request=lora_request)
            return [ScoringRequestOutput(o.request_id, o.prompt_token_ids, ScoringOutput(classifier_score(o.embedding)))
                    for o in outs]
        distinct, pairs = distinct_pairs(texts_1, texts_2, pairs)
        embedded = self.embed(distinct, use_tqdm, truncate_prompt_tokens, lora_request)
        scores = cosine_scores([e.outputs.embedding for e in embedded], pairs)
        return [ScoringRequestOutput(f"{embedded[i].request_id}_{embedded[j].request_id}",
                                     embedded[i].prompt_token_ids + embedded[j].prompt_token_ids, ScoringOutput(score))
                for (i, j), score in zip(pairs, scores)]

    def _loras_per_prompt(self, lora_request, n: int) -> list[Optional[LoRAAdapter]]:
        """Each prompt's adapter, read the first time its LoRARequest comes."""
        requests = [lora_request] * n if lora_request is None or isinstance(lora_request, LoRARequest) \
            else list(lora_request)
        if len(requests) != n:
            raise ValueError(f"got {len(requests)} LoRA requests for {n} prompts: give one, or one per prompt")
        if any(r is not None for r in requests) and self.engine_core.loras is None:
            raise ValueError("a lora_request needs LoRA adapters turned on: LLM(..., enable_lora=True)")
        for r in requests:
            if r is not None and not isinstance(r, LoRARequest):
                raise TypeError(f"lora_request must be a LoRARequest or None, got {r!r}")
        return [None if r is None else self.engine_core.loras.for_request(r) for r in requests]

    def _params_per_prompt(self, sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts: give one, or one per prompt")
        return params

    def _add_request(self, text: Optional[str], ids: list[int], params: SamplingParams,
                     stream: bool = False, priority: int = 0, lora: Optional[LoRAAdapter] = None) -> str:
        request_id = str(next(self._counter))
        self.input_processor.validate(ids, params)
        self.input_processor.check_priority(priority)
        child_ids = self.output_processor.add_request(request_id, text, ids, params, stream)
        for request in self.input_processor.process(child_ids, ids, params, priority=priority, lora=lora):
            self.engine_core.add_request(request)
        return request_id

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        with bar:
            while self.engine_core.has_unfinished_requests():
                processed = self.output_processor.process_outputs(self.engine_core.step())
                if processed.to_abort:
                    self.engine_core.abort_requests(processed.to_abort)
                for output in processed.finished:
                    results[output.request_id] = output
                    bar.update(1)
        return [results[rid] for rid in request_ids]

    def _abort(self, request_ids: list[str]) -> None:
        """Drop everything a failed generate() call had queued."""
        for rid in request_ids:
            self.engine_core.abort_requests(self.output_processor.abort_request(rid))


def _as_prompt_list(prompts: Union[PromptType, Sequence[PromptType]]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token IDs
    return prompts
