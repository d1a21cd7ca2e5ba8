"""AsyncEngine: the engine on its own thread, streamed deltas on the event loop."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import pytest

from streamserve import LLM, SamplingParams, StructuredOutputsParams
from streamserve.config import Config
from streamserve.engine import structured_output as so
from streamserve.frontend.async_engine import AsyncEngine, EngineDeadError
from live_server import record_aborts, slow_steps

PROMPTS = ["The quick brown fox", "Paris is the capital of", "hello world", "def add(a, b):",
           "Once upon a time", "Streaming servers send", "user assistant", "Caf\u00e9 \U0001f600"]


def make_engine(model_dir: str, **settings) -> AsyncEngine:
    return AsyncEngine(Config.from_kwargs(model=model_dir, dtype="float32", kv_cache_memory="16MiB", **settings))


# the engine thread's loop both ways: each step read back before the next, or one step ahead
SCHEDULING = pytest.mark.parametrize("async_scheduling", ["off", "on"])


async def collect(engine: AsyncEngine, prompt: str, params: SamplingParams):
    ids = engine.renderer.encode(prompt)
    text, tokens, finish = "", [], None
    async for delta in engine.generate(ids, params, prompt=prompt):
        for sample in delta.outputs:
            text += sample.text
            tokens += sample.token_ids
            finish = sample.finish_reason or finish
    return text, tokens, finish


@SCHEDULING
def test_concurrent_streams_equal_offline_results(llama_dir, async_scheduling):
    params = SamplingParams(temperature=0, max_tokens=24, stop=["zz"])
    offline = LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB").generate(PROMPTS, params, use_tqdm=False)

    async def main():
        engine = make_engine(llama_dir, async_scheduling=async_scheduling)
        engine.start()
        await engine.wait_ready()
        results = await asyncio.gather(*(collect(engine, p, params) for p in PROMPTS))
        await engine.shutdown()
        return results

    for (text, tokens, finish), expected in zip(asyncio.run(main()), offline):
        assert text == expected.outputs[0].text
        assert tokens == expected.outputs[0].token_ids
        assert finish == expected.outputs[0].finish_reason


def test_one_loop_callback_per_step(llama_dir):
    async def main():
        engine = make_engine(llama_dir)
        engine.start()
        await engine.wait_ready()
        loop = asyncio.get_running_loop()
        calls = []
        original = loop.call_soon_threadsafe

        def counting(callback, *args, **kwargs):
            calls.append(getattr(callback, "__name__", ""))
            return original(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counting
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        await asyncio.gather(*(collect(engine, p, params) for p in PROMPTS))
        await engine.shutdown()
        return calls.count("_on_step"), engine.num_steps

    callbacks, steps = asyncio.run(main())
    assert steps >= 16 and callbacks == steps


@SCHEDULING
def test_closing_a_stream_aborts_it_and_frees_its_blocks(llama_dir, async_scheduling):
    async def main():
        engine = make_engine(llama_dir, async_scheduling=async_scheduling)
        engine.start()
        await engine.wait_ready()
        kv = engine.engine_core.scheduler.kv_cache_manager
        aborted = record_aborts(engine)
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        for _ in range(5):
            stream = engine.generate(engine.renderer.encode("hello " * 20), params)
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == 2:
                    break
            await stream.aclose()
        for _ in range(200):  # the engine frees them within a step
            if kv.num_free_blocks == kv.num_blocks and not engine.engine_core.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        free = (kv.num_free_blocks, kv.num_blocks)
        # And it still serves.
        text, tokens, _ = await collect(engine, "hello", SamplingParams(temperature=0, max_tokens=4))
        await engine.shutdown()
        return free, tokens, aborted

    (free, total), tokens, aborted = asyncio.run(main())
    assert free == total and len(tokens) == 4
    assert len(set(aborted)) == 5  # each closed stream aborted, none left to run its 400 tokens


def test_bad_requests_fail_alone(llama_dir):
    async def main():
        engine = make_engine(llama_dir)
        engine.start()
        await engine.wait_ready()
        with pytest.raises(ValueError, match="max_model_len"):
            async for _ in engine.generate([5] * 600, SamplingParams()):
                pass
        with pytest.raises(ValueError, match="outside the vocabulary"):
            async for _ in engine.generate([10**6], SamplingParams()):
                pass
        result = await collect(engine, "hello", SamplingParams(temperature=0, max_tokens=3))
        await engine.shutdown()
        return result

    assert len(asyncio.run(main())[1]) == 3


def test_request_ids_are_the_callers_and_engine_ids_are_never_reused(llama_dir):
    """A caller's id may look like an engine id ("a#0-0" beside "a" with n=2) and be used
    again once its request ends; outputs still on their way for an aborted "x" do not reach
    the next "x" (engine ids carry a serial); an id in use is refused; a generated id steps
    over one a caller took."""
    async def main():
        engine = make_engine(llama_dir)
        engine.start()
        await engine.wait_ready()
        ids = engine.renderer.encode("hello world")

        async def run(rid, params, prompt=ids):
            return [d async for d in engine.generate(prompt, params, request_id=rid)]

        a = asyncio.create_task(run("a", SamplingParams(n=2, max_tokens=30, ignore_eos=True)))
        taken = asyncio.create_task(run("req-0", SamplingParams(max_tokens=30, ignore_eos=True)))
        await asyncio.sleep(0)  # both registered
        lookalike = await asyncio.wait_for(run("a#0-0", SamplingParams(max_tokens=4, ignore_eos=True)), 30)
        with pytest.raises(ValueError, match="already in use"):
            await run("a", SamplingParams(max_tokens=4))
        generated = await asyncio.wait_for(run(None, SamplingParams(max_tokens=4)), 30)
        outputs = await asyncio.wait_for(a, 30)
        await asyncio.wait_for(taken, 30)

        slow_steps(engine, 0.2)
        old = engine.generate([5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=50), request_id="x")
        await anext(old)  # it runs
        time.sleep(0.6)  # the loop busy: the engine thread finishes a step for "x" meanwhile
        await old.aclose()  # aborted: the id is free, that step's output still on its way
        again = await run("x", SamplingParams(temperature=0, max_tokens=1), [9, 10, 11])
        fresh = await run("y", SamplingParams(temperature=0, max_tokens=1), [9, 10, 11])
        await engine.shutdown()
        return lookalike, generated, outputs, again, fresh

    lookalike, generated, outputs, again, fresh = asyncio.run(main())
    tokens = lambda deltas: [t for d in deltas for s in d.outputs for t in s.token_ids]  # noqa: E731
    assert len(tokens(lookalike)) == 4 and lookalike[-1].finished
    assert generated[0].request_id != "req-0" and generated[-1].finished
    assert outputs[-1].finished and len(tokens(outputs)) == 60
    assert tokens(again) == tokens(fresh)  # not "x"'s old tokens


def test_a_model_that_fails_to_load_is_reported(llama_dir, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(llama_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not safetensors")

    async def main():
        engine = make_engine(str(broken))
        engine.start()
        with pytest.raises(EngineDeadError, match="failed to load"):
            await engine.wait_ready()
        assert not engine.is_ready
        with pytest.raises(EngineDeadError):
            async for _ in engine.generate([5], SamplingParams()):
                pass

    asyncio.run(main())


def failing_once(runner):
    """Make the runner's next forward pass raise (as an out-of-memory error would)."""
    real = runner.execute_model
    calls = []

    def execute(scheduler_output):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected failure")
        return real(scheduler_output)

    runner.execute_model = execute


def test_a_failed_step_serves_none_of_its_blocks_from_the_prefix_cache(llama_dir):
    """Scheduling registers a step's full blocks for the prefix cache before their KV is
    written: after the step fails, the same prompt is computed afresh, not read from blocks
    that hold nothing (it once came back as garbage)."""
    from streamserve.engine.core import StepFailed

    prompt = {"prompt_token_ids": list(range(5, 45))}  # two and a half blocks
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB").generate([prompt], params, use_tqdm=False)
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB")
    failing_once(llm.engine_core.model_runner)
    with pytest.raises(StepFailed):
        llm.generate([prompt], params, use_tqdm=False)
    kv = llm.engine_core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks and not llm.engine_core.has_unfinished_requests()
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == expected[0].outputs[0].token_ids


def test_a_failed_step_fails_its_own_requests_only(llama_dir):
    """One sequence at a time: the request in the failing step gets a server error; the one
    still waiting for the slot runs to its end afterwards."""
    from streamserve.frontend.async_engine import EngineStepError

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def main():
        engine = AsyncEngine(Config.from_kwargs(model=llama_dir, dtype="float32", kv_cache_memory="16MiB",
                                                max_num_seqs=1))
        engine.start()
        await engine.wait_ready()
        failing_once(engine.engine_core.model_runner)
        drain, waited = engine._drain_inbox, []

        def both_at_once(core):  # the engine takes both requests in, before the failing step
            if engine._inbox and not waited:
                while len(engine._inbox) < 2:
                    time.sleep(0.001)
                waited.append(len(engine._inbox))
            return drain(core)

        engine._drain_inbox = both_at_once
        results = await asyncio.gather(collect(engine, "hello world", params),
                                       collect(engine, "Paris is the capital of", params),
                                       return_exceptions=True)
        await engine.shutdown()
        return results, waited

    (first, second), waited = asyncio.run(main())
    assert waited == [2]
    assert isinstance(first, EngineStepError) and "injected failure" in str(first)
    text, tokens, finish = second
    assert len(tokens) == 6 and finish == "length"


def test_shutdown_does_not_wait_for_a_model_still_loading(llama_dir):
    """Ctrl-C while the model loads (a first-use conversion can take a while) ends the server
    at once rather than after the load."""
    import threading

    from live_server import held_config

    release = threading.Event()

    async def main():
        engine = AsyncEngine(held_config(llama_dir, release, 60))
        engine.start()
        await asyncio.sleep(0.1)
        await asyncio.wait_for(engine.shutdown(), 10)  # not the 60 s the load would take
        release.set()

    asyncio.run(main())


def test_structured_outputs_token_texts_are_read_ahead(llama_dir):
    """The server reads structured output's token texts on a thread of its own once the model
    is ready, not in the first structured request's step."""
    async def main():
        engine = make_engine(llama_dir)
        engine.start()
        await engine.wait_ready()
        for _ in range(200):
            if engine.engine_core.scheduler._vocabulary is not None:
                break
            await asyncio.sleep(0.05)
        built = engine.engine_core.scheduler._vocabulary
        await engine.shutdown()
        return built

    assert asyncio.run(main()) is not None


def test_a_regexs_token_trie_is_built_off_the_engine_thread(llama_dir, monkeypatch):
    """Masks of regex states walk a trie of the tokens (0.05-0.4 s to build on SmolLM2's
    vocabulary): generate builds it on a thread of its own before the request reaches the
    engine, whose steps would stall every stream while it built one."""
    built = []
    original = so._ClassTrie.__init__
    monkeypatch.setattr(so._ClassTrie, "__init__",
                        lambda self, *args: built.append(threading.current_thread().name) or original(self, *args))
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[a-f]{2,4}$"}},
              "required": ["code"]}
    requests = [StructuredOutputsParams(regex="(red|blue)-[0-9]{2}"), StructuredOutputsParams(json=schema)]

    async def main():
        engine = make_engine(llama_dir)
        engine.start()
        await engine.wait_ready()
        texts = [await collect(engine, "hello", SamplingParams(temperature=1.0, seed=1, max_tokens=30,
                                                                structured_outputs=s)) for s in requests]
        await engine.shutdown()
        return texts

    (regex_text, _, _), (json_text, _, _) = asyncio.run(main())
    assert re.fullmatch("(red|blue)-[0-9]{2}", regex_text)
    assert len(built) == 2 and "streamserve-engine" not in built, built


def test_the_regexes_a_structure_may_walk_are_found_wherever_they_sit():
    schema = {"$defs": {"node": {"type": "object", "properties": {
        "tag": {"anyOf": [{"type": "string", "pattern": "^[a-z]+$"}, {"type": "null"}]},
        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
        "type": "object", "properties": {"root": {"$ref": "#/$defs/node"}, "id": {"type": "string", "maxLength": 3}}}
    found = so.regexes(so.start_states(StructuredOutputsParams(json=schema, thinking="may")))
    assert sorted(regex.pattern for regex, in_string in found if in_string) == ["[\\s\\S]{0,3}", "^[a-z]+$"]
    assert {regex.pattern for regex, in_string in so.regexes(so.start_states(
        StructuredOutputsParams(regex="a+", thinking="inside")))} == {"a+"}
    assert so.regexes(so.start_states(StructuredOutputsParams(json_object=True))) == set()
