"""Decode steps reading the weights' copies from huge pages against the same copies on the heap,
in one process, step by step alternating (the machine's noise hits both alike).

    python scripts/ab_huge_pages.py                          # the default model, batch 1
    python scripts/ab_huge_pages.py --batch 4 --steps 400

The runner puts every linear layer's copies in one mapping advised for transparent huge pages
(cpu_kernels.onto_huge_pages). Here a second one-call C step is built over ordinary clones of
them (torch's allocator: 4 KB pages unless THP_MEM_ALLOC_ENABLE is set), and the engine's decode
steps run through either in turn; each C step keeps the tensors it points into.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from bench_throughput import make_workload, start_decoding  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=400, help="decode steps through each")
    args = parser.parse_args()

    from streamserve import LLM
    from streamserve.models import cpu_kernels
    from streamserve.worker.model_runner import C_STEP_MAX_TOKENS

    llm = LLM(args.model, kv_cache_memory="2GiB")
    core, runner = llm.engine_core, llm.engine_core.model_runner
    if runner.c_step is None:
        raise SystemExit("the one-call C step does not run here (no C kernels, or --enforce-eager)")
    if core.config.model.max_model_len < args.prompt_len + 2 * args.steps + 10:
        raise SystemExit("fewer steps: a request would end before they are done")
    start_decoding(llm, make_workload(args.batch, core.vocab_size, 1, args.prompt_len, args.prompt_len,
                                      2 * args.steps + 10, 2 * args.steps + 10))
    huge = runner.c_step
    runner.model.move_copies(lambda tensors: [t.clone() for t in tensors])
    cpu_kernels.release_freed_memory()
    heap = cpu_kernels.StepForward(runner.c_kernels, runner.model, runner.kv_caches, C_STEP_MAX_TOKENS,
                                   runner.quant_max_tokens, runner.bf16_dot)
    times: dict[str, list[float]] = {"huge pages": [], "heap": []}
    for i in range(2 * args.steps):
        name = list(times)[(i + i // 2) % 2]  # huge, heap, heap, huge, ...: each order as often
        runner.c_step = huge if name == "huge pages" else heap
        start = time.perf_counter()
        core.step()
        times[name].append((time.perf_counter() - start) * 1000)
    for name, ms in times.items():
        ms.sort()
        print(f"{name:10s} p10 {ms[len(ms) // 10]:6.2f} ms, p50 {ms[len(ms) // 2]:6.2f} ms a step")
    p10, p50 = ([times[name][len(times[name]) * q // 10] for name in times] for q in (1, 5))
    print(f"batch {args.batch}, context ~{args.prompt_len}: heap / huge pages = {p10[1] / p10[0]:.3f} (p10), "
          f"{p50[1] / p50[0]:.3f} (p50)")


if __name__ == "__main__":
    main()
