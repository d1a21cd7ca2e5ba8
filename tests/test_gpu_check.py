"""scripts/gpu_check.py's decode rows, on the CPU: what they time is a step of the whole batch."""

from __future__ import annotations

import importlib
import os

from tiny_models import build_model

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")


def test_decode_rows_time_every_request_of_the_batch(tmp_path, monkeypatch):
    """Reading the prompts takes several steps (as 256 prompts of 512 tokens do at CUDA's 2048
    tokens a step), in which the requests read first already decode: every request must still
    be decoding through the timed steps, so that a step makes one token for each."""
    from streamserve import LLM

    monkeypatch.syspath_prepend(SCRIPTS)  # sys.path is restored after the test (gpu_check adds to it too)
    gpu_check = importlib.import_module("gpu_check")
    llm = LLM(build_model(str(tmp_path / "llama"), "llama", seed=0), max_num_batched_tokens=24,
              max_model_len=256, kv_cache_memory="16MiB")
    batch, steps = 6, 8
    seconds, made = gpu_check.decode_steps(llm, batch, context=40, steps=steps)
    assert seconds > 0 and made == batch
    assert not llm.engine_core.has_unfinished_requests()  # aborted after the timed steps


def test_decode_rows_with_async_scheduling_and_without(tmp_path, monkeypatch):
    """Under async scheduling each timed step still returns a token for every request (the
    batch before's), and the check switches the engine to waiting for each step and back in the
    middle of decoding (the batch in flight read back at each switch)."""
    from streamserve import LLM

    monkeypatch.syspath_prepend(SCRIPTS)
    gpu_check = importlib.import_module("gpu_check")
    llm = LLM(build_model(str(tmp_path / "llama"), "llama", seed=0), max_num_batched_tokens=24,
              max_model_len=256, kv_cache_memory="16MiB", async_scheduling="on")
    core = llm.engine_core
    assert gpu_check.decode_steps(llm, 4, context=20, steps=6)[1] == 4
    stepped = []
    from bench_throughput import make_workload, start_decoding

    start_decoding(llm, make_workload(3, core.vocab_size, 3, 20, 20, 100, 100))
    core.step()
    assert core.in_flight is not None
    made = gpu_check.with_scheduling(llm, False, lambda: [stepped.append(core.in_flight) or
                                                          len(core.step()) for _ in range(4)])
    assert made == [3] * 4 and stepped == [None] * 4
    assert core.runs_ahead and core.in_flight is None and core.scheduler.scheduler_config.runs_ahead
    assert len(core.step()) == 0 and len(core.step()) == 3  # ahead again: the first launches, the next reads
    core.abort_requests(list(core.scheduler.requests))
    while core.has_unfinished_requests():
        core.step()
