"""The Sampler's choice of tokens on CPU logits: the torch path against the C kernels'
(worker/sampler.py), in one process, calls alternating, for greedy and sampled settings.

    python scripts/bench_sampler.py
    python scripts/bench_sampler.py --batch 1 16 64 --vocab 49152

Logits are random normal times --spread (1: flat, thousands of tokens inside top-p 0.9; larger:
peaked, as a language model's are); each row has 300 prompt and 100 output tokens (random), which
the penalties read; each figure is the best of --repeats calls.
"""

from __future__ import annotations

import argparse
import time

import torch

from streamserve.engine.scheduler_output import NewRequestData
from streamserve.sampling_params import SamplingParams
from streamserve.worker.request_state import RequestState
from streamserve.worker.sampler import Sampler, _cpu_kernels

SETTINGS = [{"temperature": 0.0}, {"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9},
            {"temperature": 0.7, "top_k": 50}, {"temperature": 1.0, "min_p": 0.05},
            {"temperature": 0.7, "repetition_penalty": 1.1},
            {"temperature": 0.7, "frequency_penalty": 0.5, "presence_penalty": 0.5},
            {"temperature": 0.7, "logprobs": 5}]
PROMPT, OUTPUT = 300, 100  # each row's tokens, for the penalties


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--spread", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if _cpu_kernels() is None:
        raise SystemExit("the CPU kernels do not build here: nothing to compare")
    cpu = torch.device("cpu")
    paths = {"torch": Sampler(cpu, 0, kernels=None), "C": Sampler(cpu, 0)}
    for batch in args.batch:
        logits = torch.randn(batch, args.vocab, generator=torch.Generator().manual_seed(batch)) * args.spread
        for setting in SETTINGS:
            params = SamplingParams(**setting)
            tokens = torch.randint(0, args.vocab, (batch, PROMPT + OUTPUT), generator=torch.Generator().manual_seed(1))
            rows = [RequestState(NewRequestData(str(i), tokens[i].tolist(), PROMPT, params, None, block_ids=[],
                                                num_computed_tokens=0), None) for i in range(batch)]
            best = {name: float("inf") for name in paths}
            for _ in range(args.repeats):
                for name, sampler in paths.items():
                    start = time.perf_counter()
                    sampler(logits, rows)
                    best[name] = min(best[name], time.perf_counter() - start)
            print(f"batch {batch:3d} {str(setting):70s} torch {best['torch'] * 1e3:8.2f} ms   "
                  f"C {best['C'] * 1e3:7.2f} ms   {best['torch'] / best['C']:6.1f}x")


if __name__ == "__main__":
    main()
