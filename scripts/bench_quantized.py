"""Decode speed of a quantized checkpoint against its bfloat16 original, on the CPU.

A random model of one of bench_throughput's shapes is written in bfloat16 and then as GPTQ
(4-bit, symmetric: Q4_0 blocks), AWQ (4-bit with zeros: Q4_1) and compressed-tensors W8A8
(Q8_0), in groups of 128 as the published checkpoints have them (64 where 128 does not
divide the layers' inputs). Each is loaded beside the
bfloat16 model; then, round after round, the same requests decode on each of the two in turn
(alternating, so that the machine's noise falls on both alike), and the script prints output
tokens/s and the ratio to bfloat16's.

    python scripts/bench_quantized.py                          # SmolLM2-135M's shape
    python scripts/bench_quantized.py --shape olmo2-1b --rounds 2 --batch 1 4
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)


def write_formats(src: str, root: str, group: int) -> dict[str, str]:
    import quantized_checkpoints as qc

    paths = {"bf16": src}
    writers = {"gptq-4bit": lambda d: qc.write_gptq(src, d, group=group),
               "awq-4bit": lambda d: qc.write_awq(src, d, group=group),
               "w8a8-int8": lambda d: qc.write_compressed_tensors(src, d, "W8A8")}
    for name, write in writers.items():
        path = os.path.join(root, name)
        if not os.path.isfile(os.path.join(path, "config.json")):
            write(path)
        paths[name] = path
    return paths


def decode_rate(llm, batch: int, tokens: int, vocab: int) -> float:
    from streamserve import SamplingParams

    prompts = [{"prompt_token_ids": [3 + (i * 7 + j * 13) % (vocab - 3) for j in range(16)]} for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def main() -> None:
    from bench_throughput import SHAPES, random_shaped

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64, help="output tokens a request")
    parser.add_argument("--formats", nargs="+", default=["gptq-4bit", "awq-4bit", "w8a8-int8"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="requests decoding at once")
    args = parser.parse_args()

    from streamserve import LLM

    root = os.path.join(os.path.expanduser("~/.cache/streamserve"), f"bench-quant-{args.shape}")
    src = random_shaped(os.path.join(root, "bf16"), args.shape)
    dims = SHAPES[args.shape][1]
    # the largest of 128, 64, 32 that divides every layer's inputs (SmolLM2's 576 takes 64)
    group = next(g for g in (128, 64, 32) if dims["hidden_size"] % g == 0 and dims["intermediate_size"] % g == 0)
    paths = write_formats(src, os.path.join(root, f"group{group}"), group)
    vocab = dims["vocab_size"]
    base = LLM(paths.pop("bf16"), kv_cache_memory="256MiB", max_model_len=512)
    decode_rate(base, 1, 8, vocab)  # warm-up
    for name, path in [(f, paths[f]) for f in args.formats]:  # one at a time beside bfloat16's (a 1B model's load peaks at 8 GB)
        llm = LLM(path, kv_cache_memory="256MiB", max_model_len=512)
        decode_rate(llm, 1, 8, vocab)
        for batch in args.batch:
            rates: dict[str, list[float]] = {"bf16": [], name: []}
            for _ in range(args.rounds):
                rates["bf16"].append(decode_rate(base, batch, args.tokens, vocab))
                rates[name].append(decode_rate(llm, batch, args.tokens, vocab))
            ratio = statistics.median(rates[name]) / statistics.median(rates["bf16"])
            print(f"{args.shape} batch {batch}: {name:10s} x{ratio:.2f} bf16's: " + "; ".join(
                f"{n} {statistics.median(r):.1f} tok/s ({', '.join(f'{x:.1f}' for x in r)})" for n, r in rates.items()),
                flush=True)
        del llm
        gc.collect()

if __name__ == "__main__":
    main()
