"""What beam search costs: LLM.beam_search at widths 1, 2 and 4 against greedy generate of the
same prompt and length, in one process (the engine's steps are shared by a search's beams;
each step re-reads every beam's partial last KV block: frontend/beam_search.py).

    python scripts/bench_beam_search.py [--model DIR] [--tokens 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from streamserve import LLM, BeamSearchParams, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(args.model, kv_cache_memory="512MiB", max_model_len=1024)
    prompt = {"prompt_token_ids": list(range(1000, 1064))}
    runs = {"greedy": lambda: llm.generate(prompt, SamplingParams(temperature=0, max_tokens=args.tokens,
                                                                  ignore_eos=True), use_tqdm=False)}
    for width in (1, 2, 4):
        runs[f"beam width {width}"] = (lambda w: lambda: llm.beam_search(
            prompt, BeamSearchParams(beam_width=w, max_tokens=args.tokens, ignore_eos=True)))(width)
    for run in runs.values():  # warm up
        run()
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - start)
    base = statistics.median(seconds["greedy"])
    for name, values in seconds.items():
        s = statistics.median(values)
        print(f"{name:14s} {args.tokens} tokens in {s * 1000:7.0f} ms ({s / base:.1f}x greedy; median of {args.rounds})")


if __name__ == "__main__":
    main()
