"""Scheduler: each step, decide how many tokens of each request the model reads.

There are no phases. A request's gap is `num_tokens - num_computed_tokens`: a
fresh prompt's gap is its length (read in chunks under the token budget), a
decoding request's gap is 1 (the token it just sampled), and a prompt whose
leading blocks are cached starts with a smaller gap. Each step closes gaps under
`max_num_batched_tokens` and `max_num_seqs`: running requests first, in order,
then waiting ones, first come first served. When the KV pool runs dry, the newest
running request is preempted: its blocks go back and it returns to the front of
the waiting queue, to be recomputed (through the prefix cache where it can).

Under the priority policy (vLLM's --scheduling-policy priority) both queues are kept in
rank order, (priority, arrival time), lower first: the running requests are served in
that order and the last of them is the one preempted; the waiting ones start in that
order. A waiting request of a lower priority value than the last running one also takes
its place when it could not start beside it (no seat under max_num_seqs, or too few free
blocks for its first chunk).

With speculative decoding (spec_decode/), a decoding request that has guesses for its next
tokens reads them after its last token in the same step. They come last: from the budget and
the free blocks left once every running request has its token and the waiting ones have
started, and none in a step that had to preempt (guesses that do not fit are dropped; the
blocks taken for guesses that are refused go back as soon as the step is over, so guesses
never cause a preemption); the step samples a token at every one of those rows,
and the request keeps the guesses up to the first its row disagrees with, plus that row's
token: its num_computed_tokens steps back over the rest, whose KV is written over later.

Under async scheduling (core.py) a step is scheduled before the last one's tokens are back: a
request that samples in a step counts one token in flight (Request.num_pending) until that
step's output is read, and its gap includes it; one whose token in flight is its last
(max_tokens, or the end of max_model_len) is not scheduled again; a request preempted with its
token in flight starts again no sooner than that token is in (and leaves the queue if it
finishes it); a block is registered for the prefix cache once its tokens are known.

A waiting request through a LoRA adapter that would make the running batch's adapters more
than max_loras is passed over for this step, keeping its place, and so are the LoRA requests
behind it (the model's own still start): its turn comes once the running adapters drain.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from typing import Callable, Optional

import numpy as np

from streamserve.config import Config
from streamserve.engine.kv_cache_manager import KVCacheManager
from streamserve.engine.request import EngineCoreOutput, Request, RequestStatus
from streamserve.engine.structured_output import Vocabulary
from streamserve.engine.scheduler_output import (CachedRequestData, ModelRunnerOutput,
                                                 NewRequestData, SchedulerOutput)
from streamserve.spec_decode.ngram_proposer import NgramProposer


class Scheduler:
    # A request whose guesses all missed m steps in a row pauses its guessing for 2^(m - 1) - 1
    # steps, m - 1 at most this (15 steps); 0: it never pauses.
    SPEC_MAX_PAUSE_DOUBLINGS = 4

    def __init__(self, config: Config, num_blocks: int,
                 vocabulary: Optional[Callable[[], Vocabulary]] = None) -> None:
        # structured output's token texts and masks, built when a first request asks for them
        self.make_vocabulary = vocabulary
        self._vocabulary: Optional[Vocabulary] = None
        self._vocabulary_lock = threading.Lock()  # the server builds it ahead, on a thread of its own
        self.max_num_seqs = config.scheduler.max_num_seqs
        self.max_num_batched_tokens = config.scheduler.max_num_batched_tokens
        self.max_model_len = config.model.max_model_len
        self.by_priority = config.scheduler.scheduling_policy == "priority"
        self.max_loras = config.lora.max_loras
        # async scheduling: a step is scheduled while the last one runs, its requests' tokens in
        # flight (runs_ahead, read from here each step)
        self.scheduler_config = config.scheduler
        self.kv_cache_manager = KVCacheManager(num_blocks, config.cache.block_size,
                                               config.cache.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()
        self.trimmed_block_counts: dict[str, int] = {}  # for the runner at the next step
        self.num_preemptions = 0
        # the server's periodic stats: prompt tokens scheduled (cache hits not counted), tokens sampled
        self.num_prompt_tokens_computed = self.num_generated_tokens = 0
        speculative = config.scheduler.speculative
        self.proposer = None if speculative is None else NgramProposer(speculative)
        # with more unfinished requests than this, nobody guesses (vLLM's disable_by_batch_size)
        self.spec_max_batch = None if speculative is None else speculative.disable_by_batch_size
        # speculative decoding's counts (vLLM's spec_decode metrics): steps that checked guesses,
        # guesses checked, guesses kept, and guesses kept at each position
        self.spec_num_drafts = self.spec_num_draft_tokens = self.spec_num_accepted_tokens = 0
        self.spec_accepted_per_pos = [0] * (0 if speculative is None else speculative.num_speculative_tokens)

    # -- intake ---------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.structured_state is not None:
            self.vocabulary()
        self.requests[request.request_id] = request
        self._enqueue(request)

    def abort_request(self, request_id: str) -> bool:
        """Finish a request at any point and return its blocks. False if unknown."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED_ABORTED
        self._free(request)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # -- one step ---------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        cached = CachedRequestData()
        guessing: list[tuple[int, Request]] = []  # (place in `cached`, running request with guesses)
        new_reqs: list[NewRequestData] = []
        preempted: list[Request] = []
        kv = self.kv_cache_manager
        if self.by_priority:
            self.running.sort(key=_rank)
            self._make_room(preempted, budget)
        short = False  # the running requests ran the pool dry: nobody starts this step
        sampling: list[str] = []  # async scheduling: the requests that sample this step
        waits = False  # (one of them is read back before the next step)
        runs_ahead = self.scheduler_config.runs_ahead

        # 1. Running requests first, oldest first (by rank, under the priority policy). (The
        # scheduled tokens count as computed from here on: the step runs them.) Preemption
        # takes from the end, never a request this loop has already scheduled.
        i, running = 0, self.running
        while i < len(running) and budget > 0:
            request = running[i]
            num_computed, pending = request.num_computed_tokens, request.num_pending
            if pending and request.num_output_tokens + pending >= request.max_tokens:
                i += 1  # (async scheduling) the token in flight is its last
                continue
            num_new = min(len(request.all_token_ids) + pending - num_computed, budget)
            new_blocks = kv.allocate_slots(request, num_new)
            while new_blocks is None:
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim)
                short = True
                if victim is request:
                    break
                new_blocks = kv.allocate_slots(request, num_new)
            if new_blocks is None:
                break
            if request.spec_token_ids:  # (a decode's: its gap is 1)
                guessing.append((len(cached.req_ids), request))
            if num_computed < request.num_prompt_tokens:
                self.num_prompt_tokens_computed += min(num_new, request.num_prompt_tokens - num_computed)
            num_scheduled[request.request_id] = num_new
            cached.req_ids.append(request.request_id)
            cached.new_block_ids.append([b.block_id for b in new_blocks] if new_blocks else [])
            cached.num_computed_tokens.append(num_computed)
            request.num_computed_tokens = num_computed + num_new
            if runs_ahead:
                waits |= self._in_flight(request, sampling)
            budget -= num_new
            i += 1

        # 2. Waiting requests, first come first served (by rank, under the priority policy),
        # unless the running ones were short of blocks. One whose LoRA adapter would be one
        # adapter too many (max_loras) is passed over, keeping its place; and so is every LoRA
        # request after it, whatever its adapter, so that the running adapters drain and its
        # turn comes (the model's own requests still start).
        loras: Optional[set] = None  # the adapters running, once a waiting request has one
        passed_over: list[Request] = []
        while (self.waiting and budget > 0 and not short
               and len(self.running) < self.max_num_seqs):
            request = self.waiting[0]
            if request.num_pending:  # (async scheduling) preempted with its token in flight: next step
                break
            if request.lora is not None:
                if loras is None:
                    loras = self._running_loras()
                if passed_over or self._lora_blocked(request, loras):
                    passed_over.append(self.waiting.popleft())
                    continue
            hit_blocks, num_hit = kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit, budget)
            if kv.allocate_slots(request, num_new, hit_blocks) is None:
                break
            self.waiting.popleft()
            self.running.append(request)
            if loras is not None and request.lora is not None:
                loras.add(request.lora)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:  # its first admission (not a preempted one's return)
                request.num_cached_tokens = num_hit
                request.first_scheduled_time = time.monotonic()
                kv.record_prefix_lookup(request.num_tokens, num_hit)
            num_scheduled[request.request_id] = num_new
            if num_hit < request.num_prompt_tokens:
                self.num_prompt_tokens_computed += min(num_new, request.num_prompt_tokens - num_hit)
            new_reqs.append(NewRequestData(
                request.request_id, list(request.all_token_ids), request.num_prompt_tokens,
                request.sampling_params, request.eos_token_id,
                kv.get_block_ids(request.request_id), num_hit, request.lora))
            request.num_computed_tokens += num_new
            if runs_ahead:
                waits |= self._in_flight(request, sampling)
            budget -= num_new
        self.waiting.extendleft(reversed(passed_over))

        # 3. Guesses (speculative decoding), from what is left of the budget and of the pool
        # once every running request has its token and the waiting ones have started; none
        # where the running ones ran the pool dry (its blocks are for the preempted to return).
        spec_tokens = self._schedule_guesses(guessing, 0 if short else budget, cached,
                                             num_scheduled) if guessing else {}
        budget -= sum(map(len, spec_tokens.values()))

        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids=[r.request_id for r in preempted],
            allowed_token_masks=self._allowed_token_masks(num_scheduled, spec_tokens),
            scheduled_spec_decode_tokens=spec_tokens,
            trimmed_block_counts=self.trimmed_block_counts,
            sampling_req_ids=sampling,
            waits_for_tokens=waits,
        )
        self.finished_req_ids = set()
        if self.trimmed_block_counts:
            self.trimmed_block_counts = {}
        return output

    @staticmethod
    def _in_flight(request: Request, sampling: list[str]) -> bool:
        """(async scheduling) Where the step closes the request's gap, count the token it samples
        as in flight and add it to `sampling`; whether the step must then be read back before
        the next is scheduled (its sampling reads the tokens on the host)."""
        if request.num_computed_tokens != request.num_tokens + request.num_pending:
            return False
        request.num_pending += 1
        sampling.append(request.request_id)
        return request.reads_tokens_on_host

    def _schedule_guesses(self, guessing: list[tuple[int, Request]], budget: int, cached: CachedRequestData,
                          num_scheduled: dict[str, int]) -> dict[str, list[int]]:
        """Add the running requests' guesses to the step, in order, while the budget lasts and
        the pool has blocks for them (a guess that does not fit is dropped: it never preempts
        anyone; the blocks of those refused go back after the step). Every one's guesses are
        used up. Returns req_id -> the guesses scheduled."""
        kv, spec_tokens = self.kv_cache_manager, {}
        for place, request in guessing:
            drafts, request.spec_token_ids = request.spec_token_ids[:budget], []
            if not drafts:
                continue
            new_blocks = kv.allocate_slots(request, len(drafts), None, len(drafts))
            if new_blocks is None:
                continue
            if new_blocks:
                cached.new_block_ids[place] = cached.new_block_ids[place] + [b.block_id for b in new_blocks]
            num_scheduled[request.request_id] += len(drafts)
            request.num_computed_tokens += len(drafts)
            spec_tokens[request.request_id] = drafts
            budget -= len(drafts)
        return spec_tokens

    def vocabulary(self) -> Vocabulary:
        """Structured output's token texts and masks, built for the first request that asks."""
        if self._vocabulary is None:
            if self.make_vocabulary is None:
                raise ValueError("structured output needs the tokenizer: this scheduler was built without one")
            with self._vocabulary_lock:
                if self._vocabulary is None:
                    self._vocabulary = self.make_vocabulary()
        return self._vocabulary

    def _allowed_token_masks(self, num_scheduled: dict[str, int],
                             spec_tokens: dict[str, list[int]]) -> dict[str, np.ndarray]:
        """The structured-output requests that sample this step (their gap closes): what each may
        sample; for one that checks guesses, a [1 + guesses, vocab] mask, a row for each of its
        rows (the states after the guesses before it, made with the guesses: _structured_guesses)."""
        masks: dict[str, np.ndarray] = {}
        vocabulary = self._vocabulary
        if vocabulary is None:  # no structured request yet: no per-step loop
            return masks
        for req_id in num_scheduled:
            request = self.requests[req_id]
            if request.structured_state is None:
                continue
            drafts = spec_tokens.get(req_id)
            if drafts:  # (its rows' masks, made with its guesses)
                masks[req_id] = np.stack(request.spec_masks[:len(drafts) + 1])
            elif request.num_computed_tokens == request.num_tokens:
                masks[req_id] = vocabulary.allowed(request.structured_state, request.eos_token_id,
                                                   request.sampling_params.stop_token_set)
        return masks

    def _make_room(self, preempted: list[Request], budget: int) -> None:
        """The priority policy: while the first waiting request has a lower priority value than
        the last running one and could not start beside it, that one is preempted."""
        kv, waiting, running = self.kv_cache_manager, self.waiting, self.running
        while waiting and running and waiting[0].priority < running[-1].priority:
            head = waiting[0]
            if head.num_pending:  # (async scheduling) it starts no sooner than the next step
                return
            if head.lora is not None and self._lora_blocked(head, self._running_loras()):
                return  # it would be passed over (max_loras) whatever is preempted: preempt none
            if len(running) < self.max_num_seqs:
                hit_blocks, num_hit = kv.get_computed_blocks(head)
                if kv.can_allocate(head, min(head.num_tokens - num_hit, budget), hit_blocks):
                    return
            victim = running.pop()
            self._preempt(victim)
            preempted.append(victim)

    def _running_loras(self) -> set:
        return {r.lora for r in self.running if r.lora is not None}

    def _lora_blocked(self, request: Request, loras: set) -> bool:
        """Whether the request's adapter would be one too many beside the running ones'."""
        return request.lora not in loras and len(loras) >= self.max_loras

    def _enqueue(self, request: Request, front: bool = False) -> None:
        """Into the waiting queue: at its back (a preempted request at its front), or at its
        place by rank under the priority policy."""
        if self.by_priority:
            bisect.insort(self.waiting, request, key=_rank)
        elif front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request, front=True)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, finish what is done, free it, report every change."""
        outputs: list[EngineCoreOutput] = []
        logprobs, requests, embeddings = runner_output.logprobs, self.requests, runner_output.embeddings
        prompt_logprobs = self._new_prompt_logprobs(runner_output.prompt_logprobs) \
            if runner_output.prompt_logprobs else {}
        any_finished = False
        for req_id in scheduler_output.sampling_req_ids:  # (async scheduling) their tokens are here
            request = requests.get(req_id)
            if request is not None:
                request.num_pending -= 1
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        preempted_status = RequestStatus.PREEMPTED
        for i, (req_id, tokens) in enumerate(zip(runner_output.req_ids, runner_output.sampled_token_ids)):
            request = requests.get(req_id)
            if request is None:  # aborted while the step ran (or, async, finished by the step before)
                continue
            # (async scheduling: preempted by the step scheduled since, it waits with its token to come)
            preempted = request.status is preempted_status
            num_accepted = len(tokens) - 1  # (the guesses its rows agreed with, before a stop cuts them)
            if len(tokens) == 1:  # (the common step: one token, no slicing)
                finished = self._append_token(request, tokens[0])
            else:
                tokens, finished = self._append_tokens(request, tokens)
            self.num_generated_tokens += len(tokens)
            drafts = spec_tokens.get(req_id) if spec_tokens else None
            if drafts is not None:
                self._count_accepted(request, len(drafts), num_accepted)
                # the rows after the last guess kept hold KV of guesses that were wrong; the
                # blocks only those took go back to the pool (they must not wait for the next
                # guesses and leave others short)
                refused = len(drafts) + 1 - len(tokens)
                if refused and not finished:
                    request.num_computed_tokens -= refused
                    kept = self.kv_cache_manager.trim(request, request.num_tokens)
                    if kept is not None:
                        self.trimmed_block_counts[req_id] = kept
            if self.proposer is not None and not finished and (self.spec_max_batch is None
                                                               or len(requests) <= self.spec_max_batch):
                self._propose(request)
            queue_time = None
            if len(request.output_token_ids) == len(tokens) and request.first_scheduled_time is not None:
                queue_time = request.first_scheduled_time - request.arrival_time
            lps = None if logprobs is None else logprobs[i]
            outputs.append(EngineCoreOutput(
                req_id, tokens, None if lps is None else lps[:len(tokens)],
                request.status.finish_reason if finished else None,
                request.stop_reason, request.num_cached_tokens, queue_time, prompt_logprobs.pop(req_id, None),
                None if embeddings is None else embeddings.get(req_id)))
            if finished:
                any_finished = True
                del self.requests[req_id]
                self._free(request)
                if preempted:
                    self.waiting.remove(request)
        if any_finished:
            self.running = [r for r in self.running if not r.status.finished]
        for req_id, entries in prompt_logprobs.items():  # of prompt chunks that sampled nothing yet
            outputs.append(EngineCoreOutput(req_id, [], None, None, None, requests[req_id].num_cached_tokens,
                                            new_prompt_logprobs=entries))
        return outputs

    def _append_token(self, request: Request, token: int) -> bool:
        """Append a sampled token (its structure's state follows it); whether it ends the request."""
        request.append_output_token(token)
        if request.structured_state is not None:
            request.structured_state = self._vocabulary.after(request.structured_state, token)
        return request.check_stop()

    def _append_tokens(self, request: Request, tokens: list[int]) -> tuple[list[int], bool]:
        """Append several tokens (a step that checked guesses), up to one that ends the request:
        (the tokens appended, whether it finished)."""
        for n, token in enumerate(tokens, 1):
            if self._append_token(request, token):
                return tokens[:n], True
        return tokens, False

    def _count_accepted(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """Count a step's check of a request's guesses. Where it kept none for the second time
        in a row, the request pauses its guessing for 1 step, then (more misses in a row) 3, 7
        and 15: a step of guesses costs more than a step of one token, and text that does not
        repeat itself keeps missing."""
        if num_accepted:
            request.spec_misses = 0
        else:
            request.spec_misses += 1
            request.spec_pause = (1 << min(request.spec_misses - 1, self.SPEC_MAX_PAUSE_DOUBLINGS)) - 1
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_drafts
        self.spec_num_accepted_tokens += num_accepted
        per_pos = self.spec_accepted_per_pos
        for pos in range(num_accepted):
            per_pos[pos] += 1

    def _propose(self, request: Request) -> None:
        """Guess the request's next tokens for the next step to check (spec_decode/): at most
        num_speculative_tokens, and one fewer than the tokens it may still emit; one under
        structured output only what its structure allows."""
        request.spec_token_ids = []
        if request.spec_pause:
            request.spec_pause -= 1
            return
        params = request.sampling_params
        room = request.max_tokens - len(request.output_token_ids) - 1
        if room < 1 or params.embed:
            return
        drafts = self.proposer.propose(request.all_token_ids, request.token_history,
                                       min(room, self.proposer.num_speculative_tokens))
        if drafts and request.structured_state is not None:
            drafts = self._structured_guesses(request, drafts)
        request.spec_token_ids = drafts

    def _structured_guesses(self, request: Request, drafts: list[int]) -> list[int]:
        """A structured-output request's guesses up to the first its structure does not allow
        there (no row could sample it), and the masks of its rows (the states after the guesses
        before each), kept for the step that checks them. An EOS or stop token allowed ends them."""
        vocabulary, state = self.vocabulary(), request.structured_state
        eos, stops = request.eos_token_id, request.sampling_params.stop_token_set
        masks = [vocabulary.allowed(state, eos, stops)]  # row 0's: the state before any guess
        for n, token in enumerate(drafts):
            if not masks[-1][token]:
                drafts = drafts[:n]
                break
            if token == eos or token in stops:  # (the row after it, if kept, samples nothing kept)
                masks.append(masks[-1])
                drafts = drafts[:n + 1]
                break
            state = vocabulary.after(state, token)
            masks.append(vocabulary.allowed(state, eos, stops))
        request.spec_masks = masks
        return drafts

    def _new_prompt_logprobs(self, computed: dict[str, tuple[int, list]]) -> dict[str, list]:
        """The prompt logprobs not reported yet (a preempted request computes some again)."""
        new = {}
        for req_id, (first, entries) in computed.items():
            request = self.requests.get(req_id)
            if request is None:
                continue
            fresh = entries[max(0, request.num_prompt_logprobs - first):]
            if fresh and first <= request.num_prompt_logprobs:
                request.num_prompt_logprobs += len(fresh)
                new[req_id] = fresh
        return new

    def _free(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)


def _rank(request: Request) -> tuple[int, float]:
    """The priority policy's order: lower priority values first, then first come."""
    return request.priority, request.arrival_time
