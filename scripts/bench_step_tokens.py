"""What a step of n tokens of one sequence costs against a one-token step: the price of
checking n - 1 drafted tokens in speculative decoding (docs/design.md).

One prompt is read in chunks of n (LLM.generate with max_num_batched_tokens n, prefix
caching off), for each n in turn, rounds alternating; the time per step is the call's time
over its steps.

    python scripts/bench_step_tokens.py --model smollm2-135m-instruct --rounds 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 3, 4, 5], help="tokens a step")
    parser.add_argument("--prompt-len", type=int, default=240)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()

    from streamserve import LLM, SamplingParams

    llms = {n: LLM(args.model, max_num_batched_tokens=n, enable_prefix_caching=False, kv_cache_memory="256MiB")
            for n in args.tokens}
    times: dict[int, list[float]] = {n: [] for n in llms}
    for round_ in range(args.rounds):
        prompt = [int(t) for t in np.random.RandomState(round_).randint(100, 40000, size=args.prompt_len)]
        for n, llm in llms.items():
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
            times[n].append((time.perf_counter() - start) / -(-args.prompt_len // n) * 1000)
    base = statistics.median(times[args.tokens[0]])
    for n, per_step in times.items():
        print(f"{n} tokens a step: {' '.join(f'{t:.2f}' for t in per_step)} ms; "
              f"median {statistics.median(per_step) / base:.2f}x the {args.tokens[0]}-token step")


if __name__ == "__main__":
    main()
