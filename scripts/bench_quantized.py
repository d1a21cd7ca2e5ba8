"""Decode speed of a quantized checkpoint against its bfloat16 original, on the CPU.

A random model of one of bench_throughput's shapes is written in bfloat16 and then as GPTQ
(4-bit, symmetric: Q4_0 blocks), AWQ (4-bit with zeros: Q4_1) and compressed-tensors W8A8
(Q8_0), in groups of 128 as the published checkpoints have them (64 where 128 does not
divide the layers' inputs). Each is loaded beside the
bfloat16 model; then, round after round, the same requests decode on each of the two in turn
(alternating, so that the machine's noise falls on both alike), and the script prints output
tokens/s and the ratio to bfloat16's.

With --cpu-weights quantized copies, each format is loaded twice, its layers holding their
blocks alone and with 16-bit copies beside them (--cpu-weights), and the two decode beside
bfloat16's; --prompt N also times a prefill of N tokens (one request, one output token) the
same way. Each model's line gives the bytes its weights and copies hold.

    python scripts/bench_quantized.py                          # SmolLM2-135M's shape
    python scripts/bench_quantized.py --shape olmo2-1b --rounds 2 --batch 1 4
    python scripts/bench_quantized.py --shape olmo2-1b --formats awq-4bit --cpu-weights quantized copies \
        --batch 1 8 32 --prompt 512
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, HERE)


def write_formats(src: str, root: str, group: int) -> dict[str, str]:
    import quantized_checkpoints as qc
    import torch

    paths = {"bf16": src}
    writers = {"gptq-4bit": lambda d: qc.write_gptq(src, d, group=group),
               "awq-4bit": lambda d: qc.write_awq(src, d, group=group),
               # (in bfloat16, as llm-compressor keeps a bfloat16 model: float32 before 2026-12-04)
               "w8a8-int8": lambda d: qc.write_compressed_tensors(src, d, "W8A8", dtype=torch.bfloat16)}
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


PREFILLS = itertools.count()


def prefill_rate(llm, tokens: int, vocab: int) -> float:
    """Prompt tokens/s of one request of `tokens` tokens that outputs one (a prompt no earlier
    call had: its first token differs, so nothing of it is in the prefix cache)."""
    from streamserve import SamplingParams

    first = next(PREFILLS)
    prompt = {"prompt_token_ids": [3 + (first + j * 13) % (vocab - 3) for j in range(tokens)]}
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return tokens / (time.perf_counter() - start)


def weight_bytes(llm) -> int:
    """The bytes of the model's tensors: weights, their copies and quantized blocks (each storage once)."""
    from streamserve.models.layers import Linear

    model = llm.engine_core.model_runner.model
    tensors = list(model.parameters()) + list(model.buffers())
    for module in model.modules():
        if isinstance(module, Linear):
            module.replace_copies(lambda t: tensors.append(t) or t)
    seen = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def main() -> None:
    from bench_throughput import SHAPES, random_shaped

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64, help="output tokens a request")
    parser.add_argument("--formats", nargs="+", default=["gptq-4bit", "awq-4bit", "w8a8-int8"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="requests decoding at once")
    parser.add_argument("--cpu-weights", nargs="+", default=["auto"], choices=["auto", "quantized", "copies"],
                        help="load each format so (--cpu-weights), each beside the others")
    parser.add_argument("--prompt", type=int, default=0, help="also time a prefill of this many tokens")
    args = parser.parse_args()

    from streamserve import LLM

    root = os.path.join(os.path.expanduser("~/.cache/streamserve"), f"bench-quant-{args.shape}")
    src = random_shaped(os.path.join(root, "bf16"), args.shape)
    dims = SHAPES[args.shape][1]
    # the largest of 128, 64, 32 that divides every layer's inputs (SmolLM2's 576 takes 64)
    group = next(g for g in (128, 64, 32) if dims["hidden_size"] % g == 0 and dims["intermediate_size"] % g == 0)
    paths = write_formats(src, os.path.join(root, f"group{group}"), group)
    vocab = dims["vocab_size"]
    max_len = max(512, args.prompt + 16)
    base = LLM(paths.pop("bf16"), kv_cache_memory="256MiB", max_model_len=max_len)
    decode_rate(base, 1, 8, vocab)  # warm-up
    print(f"{args.shape} bf16: weights hold {weight_bytes(base) / 2**30:.2f} GiB", flush=True)
    for name in args.formats:  # one at a time beside bfloat16's (a 1B model's load peaks at 8 GB)
        llms = {}
        for how in args.cpu_weights:
            label = name if len(args.cpu_weights) == 1 else f"{name} {how}"
            llms[label] = LLM(paths[name], kv_cache_memory="256MiB", max_model_len=max_len, cpu_weights=how)
            decode_rate(llms[label], 1, 8, vocab)
            print(f"{args.shape} {label}: weights hold {weight_bytes(llms[label]) / 2**30:.2f} GiB", flush=True)
        runs = [(f"batch {batch}", lambda llm, b=batch: decode_rate(llm, b, args.tokens, vocab), "output")
                for batch in args.batch]
        if args.prompt:
            for llm in [base, *llms.values()]:
                prefill_rate(llm, args.prompt, vocab)  # (the first step of a size is slower)
            runs.append((f"prefill {args.prompt}", lambda llm: prefill_rate(llm, args.prompt, vocab), "prompt"))
        for what, run, unit in runs:
            rates: dict[str, list[float]] = {"bf16": [], **{label: [] for label in llms}}
            for _ in range(args.rounds):
                rates["bf16"].append(run(base))
                for label, llm in llms.items():
                    rates[label].append(run(llm))
            base_rate = statistics.median(rates["bf16"])
            print(f"{args.shape} {what}: " + "; ".join(
                f"{n} {statistics.median(r):.1f} {unit} tok/s x{statistics.median(r) / base_rate:.2f} "
                f"({', '.join(f'{x:.1f}' for x in r)})" for n, r in rates.items()), flush=True)
        del llms
        gc.collect()


if __name__ == "__main__":
    main()
