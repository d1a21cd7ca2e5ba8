"""The engine's CPU time per decode step, without the model: scheduler, input preparation, output.

On a GPU the model's step at small batches takes about a millisecond, so whatever the engine
spends in Python around it decides how much of the GPU's speed a user sees (the CPU and the
GPU take turns: the next step is scheduled only after this step's tokens are known). This
script times exactly that part on the CPU: requests are added and stepped as usual, but
the model never runs; each step's "sampled" tokens are random. The columns: schedule,
prepare (the runner's inputs and attention metadata), update (the scheduler takes the
tokens), text (detokenising and the streamed deltas, which the server's event loop does).

    python scripts/bench_step_overhead.py                     # batches 1, 64, 256, context ~512
    python scripts/bench_step_overhead.py --backend torch     # the CPU attention path's metadata
    python scripts/bench_step_overhead.py --batches 1 8 --context 2000
    python scripts/bench_step_overhead.py --model smollm2-135m-instruct   # its real tokenizer

The Triton backend's metadata is built on the CPU as it would be on a GPU (no kernel runs).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # lets kernel_backend=triton start on the CPU

sys.path.insert(0, os.path.dirname(__file__))
from bench_throughput import make_workload, random_shaped  # noqa: E402


def measure(model: str, backend: str, batch: int, context: int, steps: int) -> dict[str, float]:
    from streamserve import LLM, SamplingParams
    from streamserve.engine.scheduler_output import ModelRunnerOutput

    llm = LLM(model, dtype="float32", load_format="dummy", kernel_backend=backend, max_num_seqs=batch,
              max_model_len=context + steps + 64, max_num_batched_tokens=max(8192, context + 64),
              kv_cache_memory="16GiB")  # mapped lazily: untouched pages cost nothing
    core, processor = llm.engine_core, llm.output_processor
    sched, runner = core.scheduler, core.model_runner
    params = SamplingParams(temperature=0, max_tokens=steps + 32, ignore_eos=True)
    for prompt, _ in make_workload(batch, core.vocab_size, 0, context - 16, context, 1, 1):
        llm._add_request(None, prompt, params, stream=True)  # streamed, as the server's are
    rng = random.Random(0)

    def step() -> tuple[float, float, float, float]:
        t0 = time.perf_counter()
        so = sched.schedule()
        t1 = time.perf_counter()
        runner._update_states(so)
        runner._prepare_inputs(so)
        t2 = time.perf_counter()
        ids = [r for r, n in so.num_scheduled_tokens.items()
               if sched.requests[r].num_computed_tokens == sched.requests[r].num_tokens]
        tokens = [rng.randrange(100, core.vocab_size) for _ in ids]  # "sampled"
        for req_id, token in zip(ids, tokens):  # what execute_model does after sampling
            runner.requests[req_id].token_ids.append(token)
        t3 = time.perf_counter()
        outputs = sched.update_from_output(so, ModelRunnerOutput(ids, [[t] for t in tokens]))
        t4 = time.perf_counter()
        processor.process_outputs(outputs)
        return t1 - t0, t2 - t1, t4 - t3, time.perf_counter() - t4

    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        step()  # read the prompts
    assert len(sched.running) == batch, "the KV cache holds fewer sequences than the batch"
    for _ in range(5):
        step()
    totals = [0.0] * 4
    for _ in range(steps):
        for i, t in enumerate(step()):
            totals[i] += t
    core.abort_requests(list(sched.requests))
    schedule, prepare, update, text = (t / steps * 1e6 for t in totals)
    return dict(schedule=schedule, prepare=prepare, update=update, text=text,
                total=schedule + prepare + update + text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model folder (default: random SmolLM2-135M-shaped)")
    parser.add_argument("--backend", default="triton", choices=["triton", "torch"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    model = args.model or random_shaped(
        os.path.join(os.path.expanduser("~/.cache/streamserve"), "bench-smollm2-shape"))
    print(f"CPU time per decode step, {args.backend} backend, context ~{args.context}, {args.steps} steps (us)")
    print(f"{'batch':>6} {'schedule':>9} {'prepare':>9} {'update':>9} {'text':>9} {'total':>9} {'per request':>12}")
    for batch in args.batches:
        r = measure(model, args.backend, batch, args.context, args.steps)
        print(f"{batch:6d} {r['schedule']:9.0f} {r['prepare']:9.0f} {r['update']:9.0f} {r['text']:9.0f} "
              f"{r['total']:9.0f} {r['total'] / batch:12.2f}", flush=True)


if __name__ == "__main__":
    main()
