"""OutputProcessor: engine outputs -> text, stop strings, finish reasons, RequestOutputs.

A request with n > 1 is n engine requests ("child" ids `<id>#<k>`) that the
processor gathers back into one RequestOutput with n CompletionOutputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from transformers import PreTrainedTokenizerBase

from streamserve.engine.request import EngineCoreOutput
from streamserve.frontend.detokenizer import IncrementalDetokenizer
from streamserve.outputs import CompletionOutput, Logprob, RequestOutput
from streamserve.sampling_params import SamplingParams


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}#{index}"


@dataclass
class _Sample:
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[dict[int, Logprob]]] = None
    cumulative_logprob: Optional[float] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None


@dataclass
class _ParentState:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    samples: list[_Sample]
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, _ParentState] = {}
        self.child_to_sample: dict[str, tuple[_ParentState, _Sample]] = {}

    def add_request(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                    params: SamplingParams) -> list[str]:
        """Track a request; returns the engine (child) request ids to submit."""
        samples = [_Sample(i, IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params),
                           logprobs=[] if params.logprobs is not None else None,
                           cumulative_logprob=0.0 if params.logprobs is not None else None)
                   for i in range(params.n)]
        parent = _ParentState(request_id, prompt, prompt_token_ids, samples)
        self.parents[request_id] = parent
        child_ids = [child_request_id(request_id, i, params.n) for i in range(params.n)]
        for child_id, sample in zip(child_ids, samples):
            self.child_to_sample[child_id] = (parent, sample)
        return child_ids

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; returns its unfinished engine request ids, to abort."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return []
        child_ids = [c for c, (p, _) in self.child_to_sample.items() if p is parent]
        for child_id in child_ids:
            del self.child_to_sample[child_id]
        return child_ids

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def process_outputs(self, outputs: list[EngineCoreOutput]
                        ) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's outputs. Returns the RequestOutputs that finished, and the
        engine request ids to abort because a stop string ended them."""
        finished: list[RequestOutput] = []
        to_abort: list[str] = []
        for out in outputs:
            entry = self.child_to_sample.get(out.request_id)
            if entry is None:
                continue
            parent, sample = entry
            parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
            sample.token_ids.extend(out.new_token_ids)
            if out.new_logprobs is not None and sample.logprobs is not None:
                self._add_logprobs(sample, out)
            stop = sample.detokenizer.update(out.new_token_ids, out.finish_reason)
            if stop is not None:  # a stop string wins over the engine's own reason
                if out.finish_reason is None:
                    to_abort.append(out.request_id)
                sample.finish_reason, sample.stop_reason = "stop", stop
            elif out.finish_reason is not None:
                sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
            if sample.finish_reason is not None:
                del self.child_to_sample[out.request_id]
                if parent.finished:
                    del self.parents[parent.request_id]
                    finished.append(self.make_request_output(parent))
        return finished, to_abort

    def _add_logprobs(self, sample: _Sample, out: EngineCoreOutput) -> None:
        for token, lp in zip(out.new_token_ids, out.new_logprobs):
            entry = {token: Logprob(lp.sampled_logprob, lp.sampled_rank, self.tokenizer.decode([token]))}
            for rank, (tid, val) in enumerate(zip(lp.top_token_ids, lp.top_logprobs), start=1):
                entry.setdefault(tid, Logprob(val, rank, self.tokenizer.decode([tid])))
            sample.logprobs.append(entry)
            sample.cumulative_logprob += lp.sampled_logprob

    def make_request_output(self, parent: _ParentState) -> RequestOutput:
        outputs = [CompletionOutput(s.index, s.detokenizer.output_text, list(s.token_ids),
                                    s.cumulative_logprob, s.logprobs, s.finish_reason, s.stop_reason)
                   for s in parent.samples]
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outputs,
                             parent.finished, parent.num_cached_tokens)
