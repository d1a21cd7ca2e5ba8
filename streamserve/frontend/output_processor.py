"""OutputProcessor: engine outputs -> text, stop strings, finish reasons, RequestOutputs.

A request is n engine requests ("child" ids `<id>#<serial>-<k>`, the serial new for each
request: outputs still on their way for an aborted request match no later one of the same
id) that the processor gathers back into one RequestOutput with n CompletionOutputs.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from transformers import PreTrainedTokenizerBase

from streamserve.engine.request import EngineCoreOutput
from streamserve.frontend.detokenizer import IncrementalDetokenizer, TextDecoder
from streamserve.outputs import CompletionOutput, Logprob, RequestOutput
from streamserve.sampling_params import SamplingParams


class ProcessedOutputs(NamedTuple):
    finished: list[RequestOutput]  # whole outputs of the requests that finished this step
    deltas: list[RequestOutput]  # for streamed requests: only what is new since the last delta
    to_abort: list[str]  # engine request ids a stop string ended


@dataclass
class _Sample:
    index: int
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[dict[int, Logprob]]] = None
    cumulative_logprob: Optional[float] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[int | str] = None
    num_streamed_tokens: int = 0
    finish_streamed: bool = False


@dataclass
class _ParentState:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    samples: list[_Sample]
    stream: bool = False
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    # [None, then one {token: Logprob} per prompt token after the first] when asked for
    prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None
    prompt_logprobs_streamed: bool = False
    embedding: Optional[list[float]] = None
    num_unfinished: int = field(init=False)  # samples without a finish reason yet

    def __post_init__(self) -> None:
        self.num_unfinished = len(self.samples)

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.decoder = TextDecoder(tokenizer)
        self.parents: dict[str, _ParentState] = {}
        self.child_to_sample: dict[str, tuple[_ParentState, _Sample]] = {}
        self._serials = itertools.count()

    def add_request(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
                    params: SamplingParams, stream: bool = False) -> list[str]:
        """Track a request; returns the engine (child) request ids to submit. A streamed
        request also gets a delta RequestOutput each step it changes. An id in use is refused."""
        if request_id in self.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        samples = [_Sample(i, IncrementalDetokenizer(self.decoder, prompt_token_ids, params),
                           logprobs=[] if params.logprobs is not None else None,
                           cumulative_logprob=0.0 if params.logprobs is not None else None)
                   for i in range(params.n)]
        parent = _ParentState(request_id, prompt, prompt_token_ids, samples, stream,
                              prompt_logprobs=None if params.prompt_logprobs is None else [None])
        self.parents[request_id] = parent
        serial = next(self._serials)
        child_ids = [f"{request_id}#{serial}-{k}" for k in range(params.n)]
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

    def parent_of(self, child_id: str) -> Optional[str]:
        """The request an unfinished engine request belongs to."""
        entry = self.child_to_sample.get(child_id)
        return None if entry is None else entry[0].request_id

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Apply one step's outputs."""
        finished: list[RequestOutput] = []
        to_abort: list[str] = []
        touched: dict[str, _ParentState] = {}
        for out in outputs:
            entry = self.child_to_sample.get(out.request_id)
            if entry is None:
                continue
            parent, sample = entry
            if parent.stream:
                touched[parent.request_id] = parent
            parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
            if out.queue_time is not None:
                parent.metrics.setdefault("queue_time", out.queue_time)
            new_token_ids, new_logprobs = out.new_token_ids, out.new_logprobs
            if len(new_token_ids) > 1 and sample.detokenizer.stop:
                # several tokens (guesses kept): a stop string may end before the last, whose
                # tokens after it are dropped as if never sampled
                stop, kept = self._update_token_by_token(sample.detokenizer, new_token_ids, out.finish_reason)
                new_token_ids = new_token_ids[:kept]
                new_logprobs = None if new_logprobs is None else new_logprobs[:kept]
            else:
                stop = sample.detokenizer.update(new_token_ids, out.finish_reason)
            sample.token_ids.extend(new_token_ids)
            if new_logprobs is not None and sample.logprobs is not None:
                self._add_logprobs(sample, new_token_ids, new_logprobs)
            if out.new_prompt_logprobs is not None and parent.prompt_logprobs is not None:
                for lp in out.new_prompt_logprobs:
                    token = parent.prompt_token_ids[len(parent.prompt_logprobs)]
                    parent.prompt_logprobs.append(self._entry(token, lp))
            if out.embedding is not None:
                parent.embedding = out.embedding
            if stop is not None:  # a stop string wins over the engine's own reason
                if out.finish_reason is None:
                    to_abort.append(out.request_id)
                sample.finish_reason, sample.stop_reason = "stop", stop
            elif out.finish_reason is not None:
                sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
            if sample.finish_reason is not None:
                del self.child_to_sample[out.request_id]
                parent.num_unfinished -= 1
                if parent.finished:
                    del self.parents[parent.request_id]
                    finished.append(self.make_request_output(parent))
        deltas = [self._make_delta_output(p) for p in touched.values()]
        return ProcessedOutputs(finished, [d for d in deltas if d.outputs], to_abort)

    def _make_delta_output(self, parent: _ParentState) -> RequestOutput:
        """What each sample gained since its last delta: text (less what a stop string
        may still claim), token ids, logprobs, and the finish reason once."""
        outputs = []
        for s in parent.samples:
            done = s.finish_reason is not None
            start, end = s.num_streamed_tokens, len(s.token_ids)
            text = s.detokenizer.stream_delta(done)
            if start == end and not text and (not done or s.finish_streamed):
                continue
            s.num_streamed_tokens = end
            s.finish_streamed = done
            outputs.append(CompletionOutput(
                s.index, text, s.token_ids[start:end], s.cumulative_logprob,
                None if s.logprobs is None else s.logprobs[start:end],
                s.finish_reason, s.stop_reason))
        prompt_logprobs = None
        if (outputs and parent.prompt_logprobs is not None and not parent.prompt_logprobs_streamed
                and len(parent.prompt_logprobs) == len(parent.prompt_token_ids)):
            prompt_logprobs, parent.prompt_logprobs_streamed = parent.prompt_logprobs, True  # once, whole
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outputs,
                             parent.finished, parent.num_cached_tokens, dict(parent.metrics), prompt_logprobs,
                             parent.embedding)

    @staticmethod
    def _update_token_by_token(detokenizer: IncrementalDetokenizer, token_ids: list[int],
                               finish_reason: Optional[str]) -> tuple[Optional[str], int]:
        """The detokenizer's update a token at a time, up to one that completes a stop string:
        (that stop string or None, the tokens taken)."""
        for n, token in enumerate(token_ids, 1):
            stop = detokenizer.update([token], finish_reason if n == len(token_ids) else None)
            if stop is not None:
                return stop, n
        return None, len(token_ids)

    def _add_logprobs(self, sample: _Sample, token_ids: list[int], logprobs: list) -> None:
        for token, lp in zip(token_ids, logprobs):
            sample.logprobs.append(self._entry(token, lp))
            sample.cumulative_logprob += lp.sampled_logprob

    def _entry(self, token: int, lp) -> dict[int, Logprob]:
        """One position's {token: Logprob}: the token there first, then the top N."""
        entry = {token: self._logprob(token, lp.sampled_logprob, lp.sampled_rank)}
        for rank, (tid, val) in enumerate(zip(lp.top_token_ids, lp.top_logprobs), start=1):
            if tid not in entry:
                entry[tid] = self._logprob(tid, val, rank)
        return entry

    def _logprob(self, token: int, value: float, rank: int) -> Logprob:
        text = self.decoder.decode([token], False)
        return Logprob(value, rank, text, self.decoder.token_bytes(token, text))

    def make_request_output(self, parent: _ParentState) -> RequestOutput:
        outputs = [CompletionOutput(s.index, s.detokenizer.output_text, list(s.token_ids),
                                    s.cumulative_logprob, s.logprobs, s.finish_reason, s.stop_reason)
                   for s in parent.samples]
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outputs,
                             parent.finished, parent.num_cached_tokens, dict(parent.metrics),
                             parent.prompt_logprobs, parent.embedding)
