"""Async scheduling (async_scheduling on): each step is scheduled and launched before the step
before is read back, its decodes reading the tokens that step samples on the device. On the
CPU nothing overlaps, but every piece of the bookkeeping runs: the outputs must be those of
waiting for each step, token for token, through stops, max_tokens, preemption, the prefix
cache, aborts, failures and the sampling settings that make a step wait."""

from __future__ import annotations

import pytest
from parity import parity_prompts

from streamserve import LLM
from streamserve.config import Config
from streamserve.engine.core import StepFailed
from streamserve.engine.request import EngineCoreRequest, Request
from streamserve.engine.scheduler import Scheduler
from streamserve.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from streamserve.sampling_params import SamplingParams

PROMPTS = [{"prompt_token_ids": p} for p in parity_prompts()]


def engine(model_dir: str, mode: str, **kwargs) -> LLM:
    settings = {"dtype": "float32", "kv_cache_memory": "16MiB", "max_num_batched_tokens": 24, "max_num_seqs": 4,
                **kwargs}
    return LLM(model_dir, async_scheduling=mode, **settings)


def carried_rows(llm: LLM) -> list[int]:
    """Filled as the engine runs: per step that read tokens in flight, how many rows did."""
    runner, counts = llm.engine_core.model_runner, []
    carried = runner._carried_ids

    def counting(decodes, computed, flight):
        ids, carry = carried(decodes, computed, flight)
        counts.append(sum(p == len(s.token_ids) for s, p in zip(decodes, computed)))
        return ids, carry
    runner._carried_ids = counting
    return counts


def outputs(llm: LLM, prompts, params) -> list:
    """Per prompt: its tokens, finish and stop reasons, and logprobs (to 4 places: the steps'
    batches differ, and with them the last bits of a row's sums)."""
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason,
             [sorted((t, round(lp.logprob, 4), lp.rank) for t, lp in entry.items())
              for entry in o.outputs[0].logprobs or []])
            for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_idle(llm: LLM) -> None:
    """Nothing held once all is done: every block free, no request state, no token in flight."""
    core = llm.engine_core
    assert core.in_flight is None and core.model_runner.in_flight is None
    assert core.scheduler.kv_cache_manager.num_free_blocks == core.model_runner.num_blocks
    assert not core.scheduler.requests and not core.scheduler.running and not core.scheduler.waiting


def mixed_params(greedy: list[list[int]]) -> list[SamplingParams]:
    """A setting per prompt: greedy to max_tokens, to a stop token (one its greedy output holds,
    from `greedy`), to max_tokens 1; sampled with a seed; and those that make a step wait
    (penalties, logprobs, min_tokens, bad words); a logit bias over allowed tokens."""
    stop = [tokens[4] for tokens in greedy]
    return [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop[1]]),
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0.9, top_k=20, max_tokens=9, seed=11),
        SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.4, presence_penalty=2.0),
        SamplingParams(temperature=0, max_tokens=8, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=14, min_tokens=6, stop_token_ids=[stop[6]]),
        SamplingParams(temperature=0, max_tokens=11, stop_token_ids=[stop[7]], logit_bias={stop[7]: -1.0},
                       allowed_token_ids=[stop[7], 7, 9, 11]),
        SamplingParams(temperature=0, max_tokens=7, bad_words_token_ids=[[stop[8]]], ignore_eos=True),
    ]


def greedy_tokens(llm: LLM) -> list[list[int]]:
    return [out for out, *_ in outputs(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))]


def test_outputs_are_those_of_waiting_for_each_step(llama_dir):
    sync, ahead = engine(llama_dir, "off"), engine(llama_dir, "on")
    params = mixed_params(greedy_tokens(sync))
    counts = carried_rows(ahead)
    want = outputs(sync, PROMPTS, params)
    assert outputs(ahead, PROMPTS, params) == want
    assert any(reason == "stop" for _, reason, _, _ in want) and any(r == "length" for _, r, _, _ in want)
    assert counts and max(counts) > 1, "no step read its tokens in flight"
    assert_idle(ahead)
    # the same prompts again: their blocks now come from the prefix cache
    hits = ahead.engine_core.scheduler.kv_cache_manager.block_pool.prefix_cache_hits
    assert outputs(ahead, PROMPTS, params) == want
    assert ahead.engine_core.scheduler.kv_cache_manager.block_pool.prefix_cache_hits > hits
    assert_idle(ahead)


@pytest.mark.parametrize("setting", [
    lambda greedy: {"repetition_penalty": 1.4, "presence_penalty": 2.0},
    # each prompt's greedy 4th and 5th tokens as a bad word: the 5th is banned right after the 4th
    lambda greedy: {"bad_words_token_ids": [tokens[3:5] for tokens in greedy]},
    # each prompt's greedy 9th token stops it, but not before 8 tokens
    lambda greedy: {"min_tokens": 8, "stop_token_ids": [tokens[8] for tokens in greedy]},
    lambda greedy: {"temperature": 0.9, "seed": 5},
], ids=["penalties", "bad-words", "min-tokens", "seed"])
def test_every_request_under_a_setting_that_makes_its_steps_wait(llama_dir, setting):
    """Each setting whose sampling reads the tokens on the host, on every prompt (the steps
    that hold them are read back before the next is scheduled; were they not, the last token
    would be missing from what they read)."""
    sync = engine(llama_dir, "off")
    params = SamplingParams(**{"temperature": 0, "max_tokens": 10, **setting(greedy_tokens(sync))})
    want = outputs(sync, PROMPTS, params)
    assert outputs(engine(llama_dir, "on"), PROMPTS, params) == want


def test_structured_output_steps_wait_for_their_tokens(llama_dir):
    """JSON mode's mask for a step follows the token before it: a step that holds such a request
    is read back before the next is scheduled, and the outputs are those of waiting each step."""
    from streamserve import StructuredOutputsParams

    params = SamplingParams(temperature=0, max_tokens=24, structured_outputs=StructuredOutputsParams(json_object=True))
    texts = ["hello", "a list", "{", "the weather", "x", "numbers: 1, 2"]
    want = [o.outputs[0].text for o in engine(llama_dir, "off").generate(texts, params, use_tqdm=False)]
    assert [o.outputs[0].text for o in engine(llama_dir, "on").generate(texts, params, use_tqdm=False)] == want


@pytest.mark.parametrize("settings", [{"enforce_eager": True}, {"num_gpu_blocks_override": 12}],
                         ids=["op-by-op", "preempting"])
def test_outputs_hold_op_by_op_and_under_preemption(llama_dir, settings):
    """Op by op (no C step), and with a pool so small that running requests are preempted while
    their tokens are in flight (they start again once those are in)."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    want = outputs(engine(llama_dir, "off", **settings), PROMPTS, params)
    ahead = engine(llama_dir, "on", **settings)
    counts = carried_rows(ahead)
    assert outputs(ahead, PROMPTS, params) == want
    assert counts
    if "num_gpu_blocks_override" in settings:
        assert ahead.engine_core.scheduler.num_preemptions > 0
    assert_idle(ahead)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_preempted_with_a_token_in_flight(llama_dir, policy):
    """A pool so small that requests are preempted every few steps, some with their last token in
    flight (it finishes them while they wait), under either policy (the priority one preempts for
    a waiting request that outranks a running one, then starts it in the same step)."""
    params = [SamplingParams(temperature=0, max_tokens=3 + 4 * (i % 5), ignore_eos=True) for i in range(len(PROMPTS))]
    priority = [(i * 7) % 4 for i in range(len(PROMPTS))] if policy == "priority" else None
    settings = {"num_gpu_blocks_override": 10, "scheduling_policy": policy}

    def run(llm: LLM) -> list:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False, priority=priority)]
    want = run(engine(llama_dir, "off", **settings))
    ahead = engine(llama_dir, "on", **settings)
    assert run(ahead) == want
    assert ahead.engine_core.scheduler.num_preemptions > 0
    assert_idle(ahead)


def ahead_scheduler(llama_dir: str, num_blocks: int, **kwargs) -> Scheduler:
    config = Config.from_kwargs(model=llama_dir, dtype="float32", async_scheduling="on", block_size=16, **kwargs)
    return Scheduler(config, num_blocks)


def request(rid: str, prompt_len: int, max_tokens: int, start: int, priority: int = 0) -> Request:
    return Request(rid, list(range(start, start + prompt_len)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   2, max_model_len=512, arrival_time=float(start), priority=priority)


def read_back(sched: Scheduler, out: SchedulerOutput, token: int = 7) -> list:
    """The step's output as a runner gives it: `token` for each request it samples for."""
    return sched.update_from_output(out, ModelRunnerOutput(out.sampling_req_ids, [[token]] * len(out.sampling_req_ids)))


def test_preempted_while_its_last_token_is_in_flight(llama_dir):
    """C's one token is in flight when the next step preempts it (it holds the pool's last
    block, which B needs): that token finishes it while it waits, and it leaves the queue."""
    sched = ahead_scheduler(llama_dir, 4, enable_prefix_caching=False)
    for req in (request("A", 16, 8, 10), request("B", 16, 8, 100), request("C", 16, 1, 200)):
        sched.add_request(req)
    first = sched.schedule()  # each prompt fills one block; each samples
    assert first.sampling_req_ids == ["A", "B", "C"]
    second = sched.schedule()  # A takes the free block; B's is C's, preempted with its token in flight
    assert second.preempted_req_ids == ["C"] and list(second.num_scheduled_tokens) == ["A", "B"]
    assert sched.requests["C"].num_pending == 1 and list(sched.waiting) == [sched.requests["C"]]
    outputs = read_back(sched, first)
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("A", None), ("B", None), ("C", "length")]
    assert not sched.waiting and "C" not in sched.requests
    read_back(sched, second)
    kv = sched.kv_cache_manager
    assert {rid: len(blocks) for rid, blocks in kv.req_to_blocks.items()} == {"A": 2, "B": 2}


def test_a_waiting_request_with_a_token_in_flight_starts_after_it_is_in(llama_dir):
    """Preempted with its token in flight, it starts no sooner than the step after that token
    is read (from the waiting queue, and as the head the priority policy would make room for)."""
    for policy in ("fcfs", "priority"):
        sched = ahead_scheduler(llama_dir, 16, scheduling_policy=policy)
        sched.add_request(request("A", 16, 8, 10, priority=1))
        first = sched.schedule()
        a = sched.requests["A"]
        sched.running.remove(a)
        sched._preempt(a)  # (as a step scheduled meanwhile would)
        sched.add_request(request("B", 16, 8, 100, priority=0))
        second = sched.schedule()
        assert list(second.num_scheduled_tokens) == (["B"] if policy == "priority" else [])
        read_back(sched, first)
        third = sched.schedule()
        # its prompt and its token read back (the prompt's block from the prefix cache)
        assert "A" in third.num_scheduled_tokens and sched.requests["A"].num_computed_tokens == 17


def test_the_priority_policy_makes_no_room_for_a_request_with_a_token_in_flight(llama_dir):
    """A, preempted with its token in flight, outranks the running R and would take its seat:
    R is not preempted for it, since A cannot start before its token is in."""
    sched = ahead_scheduler(llama_dir, 16, scheduling_policy="priority")
    sched.add_request(request("A", 16, 8, 10, priority=0))
    sched.add_request(request("R", 16, 8, 100, priority=1))
    first = sched.schedule()
    a = sched.requests["A"]
    sched.running.remove(a)
    sched._preempt(a)  # (as a step scheduled meanwhile would)
    sched.max_num_seqs = 1  # (one seat: R's)
    second = sched.schedule()
    assert second.preempted_req_ids == [] and list(second.num_scheduled_tokens) == ["R"]
    read_back(sched, first)
    read_back(sched, second)
    third = sched.schedule()  # now A takes R's seat
    assert third.preempted_req_ids == ["R"] and list(third.num_scheduled_tokens) == ["A"]


def test_a_step_is_launched_before_the_one_before_is_read(llama_dir):
    """The order of the runner's calls: launch the next, then read back the last; a step with a
    request that reads its tokens on the host is read back before the next is launched; the
    launch after a request's last token schedules nothing for it (its max_tokens is known)."""
    ahead = engine(llama_dir, "on")
    runner, calls = ahead.engine_core.model_runner, []
    launch, collect = runner.launch, runner.collect
    runner.launch = lambda so: calls.append(("launch", dict(so.num_scheduled_tokens))) or launch(so)
    runner.collect = lambda step: calls.append(("collect", [s.req_id for s in step.samplers])) or collect(step)
    ahead.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    tokens = [len(p["prompt_token_ids"]) for p in PROMPTS[:1]]
    assert [kind for kind, _ in calls] == ["launch", "launch", "collect", "launch", "collect", "launch", "collect",
                                           "collect"]
    assert [list(c.values()) for kind, c in calls if kind == "launch"] == [tokens, [1], [1], []]
    calls.clear()
    ahead.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=1),
                   use_tqdm=False)
    assert [kind for kind, _ in calls] == ["launch", "collect"] * 3


def test_aborting_a_request_in_flight(llama_dir):
    """Aborted while its token is in flight: the step that reads it back skips it, its blocks
    and state go, the others finish as they would have."""
    sync, ahead = engine(llama_dir, "off"), engine(llama_dir, "on")
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = outputs(sync, PROMPTS[:3], params)
    core = ahead.engine_core
    for i, prompt in enumerate(PROMPTS[:4]):
        core.add_request(EngineCoreRequest(str(i), prompt["prompt_token_ids"], params, None, 0.0))
    got: dict[str, list[int]] = {}
    steps = 0
    while core.has_unfinished_requests():
        for out in core.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps += 1
        if steps == 6:
            assert "3" in core.scheduler.requests and core.in_flight is not None
            core.abort_requests(["3"])
    assert [got[str(i)] for i in range(3)] == [tokens for tokens, *_ in want]
    assert_idle(ahead)


def test_a_failed_launch_fails_both_steps_and_the_engine_goes_on(llama_dir):
    ahead = engine(llama_dir, "on")
    core, runner = ahead.engine_core, ahead.engine_core.model_runner
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i in range(2):
        core.add_request(EngineCoreRequest(f"r{i}", PROMPTS[i]["prompt_token_ids"][:5], params, None, 0.0))
    core.step()  # launches both
    launch = runner.launch
    runner.launch = lambda so: (_ for _ in ()).throw(RuntimeError("injected"))
    with pytest.raises(StepFailed) as failure:
        core.step()
    assert sorted(failure.value.request_ids) == ["r0", "r1"]
    runner.launch = launch
    assert_idle(ahead)
    want = outputs(engine(llama_dir, "off"), PROMPTS[:2], params)
    assert outputs(ahead, PROMPTS[:2], params) == want
    assert_idle(ahead)


def test_the_last_tokens_of_the_context(llama_dir):
    """A prompt three tokens short of max_model_len: three tokens, and no step past the end."""
    prompt = [{"prompt_token_ids": list(range(3, 64 - 3 + 3))[:61]}]
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    want = outputs(engine(llama_dir, "off", max_model_len=64), prompt, params)
    ahead = engine(llama_dir, "on", max_model_len=64)
    assert outputs(ahead, prompt, params) == want and len(want[0][0]) == 3
    assert_idle(ahead)


def test_the_setting(llama_dir):
    assert Config.from_kwargs(model=llama_dir, device="cpu").scheduler.async_scheduling == "off"  # auto on the CPU
    with pytest.raises(ValueError, match="auto, on or off"):
        Config.from_kwargs(model=llama_dir, async_scheduling="yes")
    with pytest.raises(ValueError, match="speculative decoding"):
        Config.from_kwargs(model=llama_dir, async_scheduling="on",
                           speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    spec = Config.from_kwargs(model=llama_dir, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert not spec.scheduler.runs_ahead
