"""The scheduler on its own: a fake runner samples token 7 for every request that catches up."""

from __future__ import annotations

import pytest

from streamserve.config import Config
from streamserve.engine.request import Request, RequestStatus
from streamserve.engine.scheduler import Scheduler
from streamserve.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from streamserve.sampling_params import SamplingParams

EOS = 2


def make_scheduler(model_dir: str, num_blocks: int = 64, **kwargs) -> Scheduler:
    kwargs.setdefault("enable_prefix_caching", False)
    config = Config.from_kwargs(model=model_dir, dtype="float32", **kwargs)
    return Scheduler(config, num_blocks)


def make_request(rid: str, prompt_len: int, max_tokens: int, start: int = 10, **params) -> Request:
    params.setdefault("ignore_eos", True)
    return Request(rid, list(range(start, start + prompt_len)),
                   SamplingParams(max_tokens=max_tokens, **params), EOS, max_model_len=512)


def fake_run(sched: Scheduler, out: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    """Sample `token` for each scheduled request whose gap closed this step."""
    ids = [rid for rid in out.num_scheduled_tokens
           if sched.requests[rid].num_computed_tokens == sched.requests[rid].num_tokens]
    return ModelRunnerOutput(ids, [[token]] * len(ids))


def run_step(sched: Scheduler, token: int = 7):
    out = sched.schedule()
    return out, sched.update_from_output(out, fake_run(sched, out, token))


def test_the_documented_schedule(llama_dir):
    sched = make_scheduler(llama_dir, max_num_batched_tokens=8)
    for req in (make_request("A", 5, 3), make_request("B", 12, 2), make_request("C", 3, 4)):
        sched.add_request(req)
    steps, finished_at = [], {}
    step = 0
    while sched.has_unfinished_requests():
        step += 1
        out, outputs = run_step(sched)
        steps.append(dict(out.num_scheduled_tokens))
        for o in outputs:
            if o.finish_reason:
                finished_at[o.request_id] = step
    assert steps == [{"A": 5, "B": 3}, {"A": 1, "B": 7}, {"A": 1, "B": 2, "C": 3},
                     {"B": 1, "C": 1}, {"C": 1}, {"C": 1}]
    assert finished_at == {"A": 3, "B": 4, "C": 6}
    assert sched.kv_cache_manager.num_free_blocks == 64


def test_max_num_seqs_caps_the_batch(llama_dir):
    sched = make_scheduler(llama_dir, max_num_seqs=2)
    for rid in "ABC":
        sched.add_request(make_request(rid, 4, 2))
    out, _ = run_step(sched)
    assert list(out.num_scheduled_tokens) == ["A", "B"]


def test_preemption_takes_the_newest_running_request(llama_dir):
    # 4 blocks of 16 tokens; A and B each need 2 blocks once they pass 16 tokens.
    sched = make_scheduler(llama_dir, num_blocks=4, block_size=16, enable_prefix_caching=True)
    sched.add_request(make_request("A", 16, 40))
    sched.add_request(make_request("B", 16, 40, start=100))
    sched.add_request(make_request("C", 16, 40, start=200))
    run_step(sched)  # A, B, C prefill: 3 blocks (each prompt is exactly one block)
    assert sched.kv_cache_manager.num_free_blocks == 1
    out, _ = run_step(sched)  # A takes the last block; B then needs one: C is preempted
    assert out.preempted_req_ids == ["C"]
    assert sched.requests["C"].status == RequestStatus.PREEMPTED
    assert sched.waiting[0].request_id == "C" and sched.requests["C"].num_computed_tokens == 0
    assert sched.num_preemptions == 1
    while sched.has_unfinished_requests():
        run_step(sched)
    assert sched.kv_cache_manager.num_free_blocks == 4
    # /metrics' prefix-cache counters: each prompt looked up once, at its first admission (C's
    # return from preemption is not a new query, nor its own blocks found again a hit)
    pool = sched.kv_cache_manager.block_pool
    assert (pool.prefix_cache_queries, pool.prefix_cache_hits) == (48, 0)


def ranked(rid: str, priority: int, arrival: float, prompt_len: int = 16, max_tokens: int = 40,
           start: int = 10) -> Request:
    return Request(rid, list(range(start, start + prompt_len)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   EOS, max_model_len=512, arrival_time=arrival, priority=priority)


def test_the_priority_policy_starts_waiting_requests_by_rank(llama_dir):
    sched = make_scheduler(llama_dir, max_num_seqs=1, scheduling_policy="priority")
    for rid, priority, arrival in (("A", 1, 0.0), ("B", 0, 2.0), ("C", 0, 1.0), ("D", -5, 3.0)):
        sched.add_request(ranked(rid, priority, arrival, prompt_len=4, max_tokens=2))
    started = []
    while sched.has_unfinished_requests():
        out, _ = run_step(sched)
        started += [r.req_id for r in out.scheduled_new_reqs]
    assert started == ["D", "C", "B", "A"]  # lower priority first, then the earlier arrival
    fcfs = make_scheduler(llama_dir, max_num_seqs=1)  # (the default policy ignores priorities)
    for rid, priority, arrival in (("A", 1, 0.0), ("B", 0, 2.0)):
        fcfs.add_request(ranked(rid, priority, arrival, prompt_len=4, max_tokens=2))
    assert [r.req_id for r in fcfs.schedule().scheduled_new_reqs] == ["A"]


def test_the_priority_policy_preempts_the_lowest_ranked_running_request(llama_dir):
    # as in the test above, but C (the newest) outranks B: B is the one preempted
    sched = make_scheduler(llama_dir, num_blocks=4, block_size=16, scheduling_policy="priority")
    for rid, priority, arrival, start in (("A", 0, 0.0, 10), ("B", 2, 1.0, 100), ("C", 1, 2.0, 200)):
        sched.add_request(ranked(rid, priority, arrival, start=start))
    run_step(sched)
    out, _ = run_step(sched)  # A, then C, take blocks (served by rank): B is preempted
    assert out.preempted_req_ids == ["B"] and list(out.num_scheduled_tokens) == ["A", "C"]
    assert sched.waiting[0].request_id == "B" and sched.num_preemptions == 1
    while sched.has_unfinished_requests():
        run_step(sched)
    assert sched.kv_cache_manager.num_free_blocks == 4


@pytest.mark.parametrize("limit", ["seats", "blocks"])
def test_a_waiting_request_takes_the_place_of_a_running_one_it_outranks(llama_dir, limit):
    """No seat under max_num_seqs, or too few free blocks: the last running request of a higher
    priority value gives its place; one of the same priority does not."""
    settings = dict(max_num_seqs=2) if limit == "seats" else dict(num_blocks=5, block_size=16)
    sched = make_scheduler(llama_dir, scheduling_policy="priority", **settings)
    size = 16 if limit == "seats" else 24  # (two blocks each: two such fit the pool, with one block spare)
    sched.add_request(ranked("A", 1, 0.0, prompt_len=size))
    sched.add_request(ranked("B", 1, 1.0, prompt_len=size, start=100))
    run_step(sched)
    sched.add_request(ranked("C", 1, 2.0, prompt_len=size, start=200))  # the same priority: it waits
    out, _ = run_step(sched)
    assert not out.preempted_req_ids and set(out.num_scheduled_tokens) == {"A", "B"}
    sched.add_request(ranked("D", 0, 3.0, prompt_len=size, start=300))  # it outranks B
    out, _ = run_step(sched)
    assert out.preempted_req_ids == ["B"]
    assert [r.req_id for r in out.scheduled_new_reqs] == ["D"]
    assert [r.request_id for r in sched.waiting] == ["B", "C"]
    while sched.has_unfinished_requests():
        run_step(sched)
    assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_blocks


def test_abort_frees_blocks_at_any_point(llama_dir):
    sched = make_scheduler(llama_dir, max_num_batched_tokens=8)
    sched.add_request(make_request("A", 20, 5))
    sched.add_request(make_request("B", 4, 5))
    run_step(sched)  # A mid-prefill
    assert sched.abort_request("A")
    assert sched.abort_request("B")  # B still waiting
    assert not sched.abort_request("A")
    assert sched.kv_cache_manager.num_free_blocks == 64
    out = sched.schedule()
    assert out.finished_req_ids == {"A", "B"} and out.total_num_scheduled_tokens == 0


@pytest.mark.parametrize("params,tokens,num_emitted,reason,stop_reason", [
    (dict(max_tokens=3), [7, 7, 7, 7], 3, "length", None),
    (dict(max_tokens=9, ignore_eos=False), [7, EOS, 7], 2, "stop", None),
    (dict(max_tokens=3, ignore_eos=True), [7, EOS, 7], 3, "length", None),
    (dict(max_tokens=9, stop_token_ids=[5]), [7, 5, 7], 2, "stop", 5),
    (dict(max_tokens=9, ignore_eos=False, min_tokens=3), [EOS, EOS, EOS, EOS], 3, "stop", None),
    (dict(max_tokens=9, stop_token_ids=[5], min_tokens=2), [5, 5, 7], 2, "stop", 5),
])
def test_finish_conditions(llama_dir, params, tokens, num_emitted, reason, stop_reason):
    sched = make_scheduler(llama_dir)
    sched.add_request(make_request("A", 4, **params))
    emitted = []
    for token in tokens:
        _, outputs = run_step(sched, token)
        emitted.append(outputs[0])
        if outputs[0].finish_reason:
            break
    assert len(emitted) == num_emitted
    assert emitted[-1].finish_reason == reason and emitted[-1].stop_reason == stop_reason
    assert all(o.finish_reason is None for o in emitted[:-1])
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.num_free_blocks == 64


def test_max_model_len_caps_output(llama_dir):
    sched = make_scheduler(llama_dir, max_model_len=10)
    sched.add_request(Request("A", [10] * 7, SamplingParams(max_tokens=100, ignore_eos=True),
                              EOS, max_model_len=10))
    n = 0
    while sched.has_unfinished_requests():
        _, outputs = run_step(sched)
        n += len(outputs)
    assert n == 3 and outputs[-1].finish_reason == "length"


def test_prefix_cache_hit_skips_cached_tokens(llama_dir):
    sched = make_scheduler(llama_dir, enable_prefix_caching=True, block_size=16)
    shared = list(range(10, 10 + 40))  # 2 full blocks + 8 tokens
    sched.add_request(Request("A", shared, SamplingParams(max_tokens=1), EOS, 512))
    run_step(sched)
    sched.add_request(Request("B", shared + [99, 98], SamplingParams(max_tokens=1), EOS, 512))
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"B": 42 - 32}
    assert out.scheduled_new_reqs[0].num_computed_tokens == 32
    # A prompt that is exactly cached still computes its last token.
    sched.add_request(Request("C", shared[:32], SamplingParams(max_tokens=1), EOS, 512))
    out, _ = run_step(sched)
    assert out.num_scheduled_tokens == {"C": 16}  # the last block is recomputed, not 0 tokens
    assert sched.kv_cache_manager.num_free_blocks == 64


# -- speculative decoding: guesses scheduled, checked and stepped back over -------------------

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}


def guessing_request(rid: str = "A", max_tokens: int = 20, **params) -> Request:
    """Its prompt repeats: once it samples 3, "2 3" occurred before, followed by 4 1 2."""
    params.setdefault("ignore_eos", True)
    return Request(rid, [1, 2, 3, 4, 1, 2], SamplingParams(max_tokens=max_tokens, **params), EOS, max_model_len=512)


def step_with(sched: Scheduler, tokens: dict[str, list[int]]):
    """One step whose scheduled requests that sample (their gap closes) give these tokens."""
    out = sched.schedule()
    ids = [rid for rid in out.num_scheduled_tokens
           if sched.requests[rid].num_computed_tokens >= sched.requests[rid].num_tokens]
    return out, sched.update_from_output(out, ModelRunnerOutput(ids, [tokens[rid] for rid in ids]))


def test_guesses_are_scheduled_checked_and_the_wrong_ones_stepped_back_over(llama_dir):
    sched = make_scheduler(llama_dir, speculative_config=SPEC)
    sched.add_request(guessing_request())
    step_with(sched, {"A": [3]})
    request = sched.requests["A"]
    assert request.spec_token_ids == [4, 1, 2]
    out, outputs = step_with(sched, {"A": [4, 1, 9]})  # rows 1 and 2 agree, row 3 samples 9
    assert out.num_scheduled_tokens == {"A": 4} and out.scheduled_spec_decode_tokens == {"A": [4, 1, 2]}
    assert out.total_num_scheduled_tokens == 4
    assert outputs[0].new_token_ids == [4, 1, 9]
    assert request.output_token_ids == [3, 4, 1, 9]
    assert request.num_computed_tokens == request.num_tokens - 1  # the KV of guess "2" is not kept
    assert (sched.spec_num_drafts, sched.spec_num_draft_tokens, sched.spec_num_accepted_tokens) == (1, 3, 2)
    assert sched.spec_accepted_per_pos == [1, 1, 0]
    assert request.spec_token_ids == []  # 9 never occurred before
    out, _ = step_with(sched, {"A": [5]})
    assert out.num_scheduled_tokens == {"A": 1} and out.scheduled_spec_decode_tokens == {}


def test_guesses_fit_the_budget_and_the_tokens_left(llama_dir):
    sched = make_scheduler(llama_dir, speculative_config=SPEC, max_num_batched_tokens=2)
    sched.add_request(guessing_request())
    while not sched.requests["A"].output_token_ids:
        step_with(sched, {"A": [3]})
    out, _ = step_with(sched, {"A": [4, 1]})
    assert out.scheduled_spec_decode_tokens == {"A": [4]}  # the budget holds one guess
    sched = make_scheduler(llama_dir, speculative_config=SPEC)
    sched.add_request(guessing_request(max_tokens=3))
    step_with(sched, {"A": [3]})
    assert sched.requests["A"].spec_token_ids == [4]  # 2 tokens left: one guess and the row after it
    _, outputs = step_with(sched, {"A": [4, 1]})
    assert outputs[0].new_token_ids == [4, 1] and outputs[0].finish_reason == "length"


def test_a_stop_among_the_kept_tokens_ends_the_request_there(llama_dir):
    sched = make_scheduler(llama_dir, speculative_config=SPEC)
    sched.add_request(guessing_request(stop_token_ids=[1]))
    step_with(sched, {"A": [3]})
    _, outputs = step_with(sched, {"A": [4, 1, 2, 8]})
    assert outputs[0].new_token_ids == [4, 1]
    assert (outputs[0].finish_reason, outputs[0].stop_reason) == ("stop", 1)
    assert not sched.has_unfinished_requests() and sched.kv_cache_manager.num_free_blocks == 64


def test_preemption_drops_the_guesses(llama_dir):
    sched = make_scheduler(llama_dir, speculative_config=SPEC)
    sched.add_request(guessing_request())
    step_with(sched, {"A": [3]})
    sched._preempt(sched.running.pop())
    assert sched.requests["A"].spec_token_ids == []


def test_no_block_is_cached_on_the_strength_of_a_guess(llama_dir):
    """Guesses that reach past a block's end do not register that block for the prefix cache;
    the tokens kept, once they fill it, do, under their own hash."""
    from streamserve.engine.kv_cache_manager import hash_block_tokens

    sched = make_scheduler(llama_dir, speculative_config=SPEC, enable_prefix_caching=True, block_size=16)
    prompt = [1, 2, 3, 4, 5, 6, 7] * 2
    sched.add_request(Request("A", prompt, SamplingParams(max_tokens=20, ignore_eos=True), EOS, max_model_len=512))
    step_with(sched, {"A": [1]})
    request, kv = sched.requests["A"], sched.kv_cache_manager
    assert request.spec_token_ids == [2, 3, 4]
    out, _ = step_with(sched, {"A": [9]})  # reads positions 14-17; the first guess is wrong
    assert out.num_scheduled_tokens == {"A": 4}
    assert kv.num_cached_blocks.get("A", 0) == 0 and request.num_computed_tokens == 15
    step_with(sched, {"A": [5]})  # position 15 read: block 0 holds 16 real tokens now
    assert kv.num_cached_blocks["A"] == 1
    real = tuple(prompt + [1, 9])
    assert kv.block_pool.get_cached_block(hash_block_tokens(None, real)) is kv.req_to_blocks["A"][0]


def test_guesses_come_after_every_running_token_and_every_start(llama_dir):
    """Guesses take only what is left of the budget once every running request has its token
    and the waiting ones have started: they never starve anyone."""
    sched = make_scheduler(llama_dir, speculative_config=SPEC, max_num_batched_tokens=9)
    sched.add_request(guessing_request("A"))
    sched.add_request(make_request("B", 3, 20))
    step_with(sched, {"A": [3], "B": [9]})
    assert sched.requests["A"].spec_token_ids == [4, 1, 2]
    sched.add_request(make_request("C", 5, 20))
    out, _ = step_with(sched, {"A": [4, 1], "B": [9], "C": [9]})
    # A's and B's tokens (2), C's prompt (5): 2 of the 9 are left, for A's first two guesses
    assert out.num_scheduled_tokens == {"A": 3, "B": 1, "C": 5}
    assert out.scheduled_spec_decode_tokens == {"A": [4, 1]}


def test_guesses_that_do_not_fit_the_pool_are_dropped_not_preempting(llama_dir):
    """A's next token fits the one block of the pool, its guesses would need a second: the
    guesses go, and A is not preempted for them."""
    sched = make_scheduler(llama_dir, speculative_config=SPEC, num_blocks=1, block_size=8)
    sched.add_request(guessing_request())
    step_with(sched, {"A": [3]})
    assert sched.requests["A"].spec_token_ids == [4, 1, 2]  # positions 7-9: 8 and 9 in a second block
    out, _ = step_with(sched, {"A": [4]})
    assert out.num_scheduled_tokens == {"A": 1} and not out.preempted_req_ids
    assert out.scheduled_spec_decode_tokens == {} and sched.num_preemptions == 0


def test_misses_in_a_row_pause_the_guessing(llama_dir):
    sched = make_scheduler(llama_dir, speculative_config=SPEC)
    sched.add_request(guessing_request(max_tokens=60))
    request = sched.requests["A"]
    sched.proposer.propose = lambda tokens, history, k: [1, 2]  # it would guess at every step
    guessed = []
    step_with(sched, {"A": [3]})
    for _ in range(24):  # every guess misses: the rows sample 8
        out, _ = step_with(sched, {"A": [8]})
        guessed.append(bool(out.scheduled_spec_decode_tokens))
    # a miss; another, then 1 step without; another, 3 without; 7; 15 (at most)
    assert guessed == [True, True, False, True, False, False, False, True] + [False] * 7 + [True] + [False] * 8
    assert request.spec_misses == 5


def test_blocks_taken_for_refused_guesses_go_back_at_once(llama_dir):
    """A's guesses take a block they then do not fill: it goes back after the step (the runner
    told to cut its row there), so that B's next token finds it and nobody is preempted."""
    sched = make_scheduler(llama_dir, speculative_config=SPEC, num_blocks=4, block_size=4)
    sched.add_request(guessing_request("A"))
    sched.add_request(make_request("B", 3, 20, start=50))
    step_with(sched, {"A": [3], "B": [9]})  # A: 7 tokens in 2 blocks, B: 4 in 1
    kv = sched.kv_cache_manager
    out, _ = step_with(sched, {"A": [8], "B": [9]})  # A's guesses 4 1 2 (positions 7-9) all refused
    assert out.scheduled_spec_decode_tokens == {"A": [4, 1, 2]}
    assert len(kv.req_to_blocks["A"]) == 2 and kv.num_free_blocks == 1  # its third block is back
    out, _ = step_with(sched, {"A": [5], "B": [9]})  # B's 6th token needs a second block
    assert out.trimmed_block_counts == {"A": 2} and not out.preempted_req_ids and sched.num_preemptions == 0


def test_no_guessing_while_more_requests_than_disable_by_batch_size_are_unfinished(llama_dir):
    sched = make_scheduler(llama_dir, speculative_config={**SPEC, "disable_by_batch_size": 1})
    sched.add_request(guessing_request("A"))
    sched.add_request(make_request("B", 3, 2))
    step_with(sched, {"A": [3], "B": [9]})
    assert sched.requests["A"].spec_token_ids == []  # two unfinished
    step_with(sched, {"A": [4], "B": [9]})  # B finishes (max_tokens 2)
    assert "B" not in sched.requests
    step_with(sched, {"A": [1]})  # A alone: it guesses again
    assert sched.requests["A"].spec_token_ids == [2, 3, 4]
