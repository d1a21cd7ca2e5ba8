"""The quantized GEMV's two ways for a step of M vectors, against the packed GEMM of the same weights.

csrc/cpu_kernels.c takes a quantized layer's product in integers for a few vectors and, from
quant_dequantized_min_rows on, through its rows dequantized as they are read (bfloat16 strips
where the model computes in bfloat16 and the CPU has AVX512-BF16, else float32 panels). This
builds the kernels twice, the dequantizing way forced from 1 vector and forced off, and times
each beside the packed GEMM over the dequantized weights (bfloat16, or float32 with
--float32), call by call alternating, and prints the medians and ratios: where the threshold
should lie, and what a layer that keeps only its blocks (--cpu-weights quantized) costs.

    python scripts/bench_quant_strips.py --shape 2048x2048 --kind q4_1 --rows 4 8 16 64 256
    python scripts/bench_quant_strips.py --float32 --flags=-mno-avx512f   # the AVX2 build
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="2048x2048", help="N x K of the weight")
    parser.add_argument("--kind", default="q4_1", choices=["q4_0", "q4_1", "q8_0", "q4_k"])
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 8, 16, 64, 256], help="vectors a call")
    parser.add_argument("--float32", action="store_true", help="a float32 model's arithmetic (bf16=False)")
    parser.add_argument("--flags", default="", help="extra compiler flags for both builds, e.g. -mno-avx512f")
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()

    from streamserve.models import cpu_kernels
    from streamserve.models.quantized import QuantizedWeight

    extra = tuple(args.flags.split())
    dequantizing = cpu_kernels.built_with(("-DQUANT_STRIP_MIN_ROWS=1", "-DQUANT_PANEL_MIN_ROWS=1", *extra))
    integer = cpu_kernels.built_with(("-DQUANT_STRIP_MIN_ROWS=1000000", "-DQUANT_PANEL_MIN_ROWS=1000000", *extra))
    n, k = (int(v) for v in args.shape.split("x"))
    weight = QuantizedWeight.random(args.kind, n, k, torch.Generator().manual_seed(0))
    packed = cpu_kernels.pack_quantized(weight)
    dense_dtype = torch.float32 if args.float32 else torch.bfloat16
    dense = cpu_kernels.pack_weight(weight.dequantize().to(dense_dtype))
    bf16 = not args.float32
    as_built = cpu_kernels.built_with(extra) if extra else cpu_kernels.load()
    print(f"{args.kind} {n}x{k}, {'float32' if args.float32 else 'bfloat16'} arithmetic, flags {extra or '-'}: "
          f"this build dequantizes from {as_built.quant_dequantized_min_rows[bf16]} vectors")
    for m in args.rows:
        x = torch.randn(m, k)
        calls = {"dequantized": lambda: dequantizing.quant_gemv[args.kind](x, packed, bf16=bf16),
                 "integer": lambda: integer.quant_gemv[args.kind](x, packed, bf16=bf16),
                 "dense": lambda: dequantizing.gemm[dense_dtype](x, dense)}
        times: dict[str, list[float]] = {name: [] for name in calls}
        for call in calls.values():
            call()
        for _ in range(args.reps):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
        med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(f"M {m:4d}: dequantized {med['dequantized']:.3f} ms, integer {med['integer']:.3f} ms, "
              f"dense {med['dense']:.3f} ms; dequantized x{med['integer'] / med['dequantized']:.2f} the integer "
              f"tiles' speed, x{med['dense'] / med['dequantized']:.2f} the dense GEMM's", flush=True)


if __name__ == "__main__":
    main()
