"""Profile decode steps of the engine: step time and the ops that take it (torch.profiler).

    python scripts/profile_step.py                    # batch 1, random SmolLM2-shaped Llama, bf16
    python scripts/profile_step.py --batch 64 --prompt-len 300
    python scripts/profile_step.py --enforce-eager    # the op-by-op path (no one-call C step)

On the CPU a step of up to 256 tokens runs its layers in one C call, which the profiler
sees as none of its ops: the op time it lists is what remains around it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
from bench_throughput import make_workload, random_shaped, start_decoding  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed")
    parser.add_argument("--rows", type=int, default=25, help="ops listed")
    parser.add_argument("--enforce-eager", action="store_true", help="every step op by op")
    args = parser.parse_args()

    from streamserve import LLM

    model = args.model or random_shaped(
        os.path.join(os.path.expanduser("~/.cache/streamserve"), "bench-smollm2-shape"))
    llm = LLM(model, dtype=args.dtype, kv_cache_memory="2GiB", enforce_eager=args.enforce_eager)
    core = llm.engine_core
    # enough tokens that no request finishes while the last prompts are still being read (the
    # first ones decode meanwhile), nor before the profiled steps are done
    max_len = core.config.model.max_model_len
    steps = min(args.steps + 10 + args.batch * args.prompt_len, max_len - args.prompt_len)
    start_decoding(llm, make_workload(args.batch, core.vocab_size, 1, args.prompt_len, args.prompt_len,
                                      steps, steps))
    if len(core.scheduler.running) != args.batch:
        raise SystemExit(f"{len(core.scheduler.running)} of {args.batch} requests are decoding "
                         f"(max_model_len {max_len}, KV blocks {core.model_runner.num_blocks})")
    core.step()
    start = time.perf_counter()
    for _ in range(args.steps):
        core.step()
    per_step = (time.perf_counter() - start) / args.steps
    print(f"batch {args.batch}, context ~{args.prompt_len}: {per_step * 1000:.1f} ms per decode step "
          f"({args.batch / per_step:.1f} tok/s)")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            core.step()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events) / 5 / 1000
    print(f"profiled: {total:.1f} ms of op time per step")
    for e in events[:args.rows]:
        print(f"  {e.key[:48]:48s} {e.self_cpu_time_total / 5 / 1000:8.2f} ms {e.count // 5:6d} calls")


if __name__ == "__main__":
    main()
