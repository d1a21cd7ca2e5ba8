"""Time the CPU's packed GEMM against torch's float32 GEMM on a model's weight shapes.

    python scripts/bench_gemv.py                       # SmolLM2-135M's shapes, bfloat16 copies
    python scripts/bench_gemv.py --rows 1,4,16,64,128 --layers 8
    python scripts/bench_gemv.py --quant q4_1 --rows 1,2,3,4,8   # GGUF blocks (head: Q8_0)
    python scripts/bench_gemv.py --quant q4_k --hidden 2048 --intermediate 8192 --heads 32 \
        --kv-heads 8 --vocab 128256 --layers 4                      # Llama-3.2-1B's shapes

Every linear weight of the model (30 layers of fused QKV, O, gate/up and down, and the head)
as random tensors; for each number of rows (tokens in the step), one pass over all of them
through the kernel (half-size weights, packed as the runner packs them) and through F.linear
on float32 copies (what the CPU path ran before the packed GEMM served every step, and still
the fallback without the C kernels), best of a few, in the same process. Prints milliseconds,
the kernel's GB/s of weights read and GFLOP/s, and the ratio. With --quant, also the quantized
GEMV over the same weights as GGUF blocks (the layers in that type, the head in Q8_0, as the
default model stores them), and its ratio to the kernel: QUANT_MAX_TOKENS should sit where
that ratio nears 1.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from streamserve.models import cpu_kernels
from streamserve.models.quantized import BLOCKS, QuantizedWeight


def best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--quant", choices=list(BLOCKS), help="also time GGUF blocks of this type "
                        "(random blocks; the K-quants need the model's dimensions to be multiples of 256)")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    kernels = cpu_kernels.load()
    if kernels is None:
        raise SystemExit("the CPU kernels do not build here (see the log)")
    dtype = getattr(torch, args.dtype)
    gemm = kernels.gemm[dtype]
    h, qkv = args.hidden, (args.heads + 2 * args.kv_heads) * args.head_dim
    shapes = [(qkv, h), (args.heads * args.head_dim, h), (2 * args.intermediate, h), (h, args.intermediate)]
    gen = torch.Generator().manual_seed(0)
    half = [torch.randn(n, k, generator=gen).to(dtype) for _ in range(args.layers) for n, k in shapes]
    half.append(torch.randn(args.vocab, h, generator=gen).to(dtype))
    full = [w.float() for w in half]
    packed = [cpu_kernels.pack_weight(w) for w in half]
    weight_bytes = sum(w.numel() * w.element_size() for w in half)
    params = sum(w.numel() for w in half)
    quant = []
    if args.quant:
        kinds = [args.quant] * (len(half) - 1) + ["q8_0"]
        quant = [(kernels.quant_gemv[kind], cpu_kernels.pack_quantized(QuantizedWeight.random(kind, *w.shape, gen)))
                 for kind, w in zip(kinds, full)]
        print(f"GGUF blocks: {sum(p.rows.numel() for _, p in quant) / 1e6:.0f} MB")
    print(f"{len(half)} weights, {weight_bytes / 1e6:.0f} MB in {args.dtype}, {torch.get_num_threads()} threads, "
          f"{kernels.vector_bits}-bit kernel vectors"
          + (f", bfloat16 dot products from {kernels.bf16_dot_min_rows} rows" if kernels.bf16_dot_min_rows else ""))
    print(f"{'rows':>5} {'kernel':>10} {'GB/s':>6} {'GFLOP/s':>8} {'F.linear fp32':>14} {'ratio':>6}"
          + (f" {args.quant:>10} {'vs kernel':>9}" if quant else ""))
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=gen) for k in {k for _, k in shapes}}
        kernel = best_of(lambda: [gemm(xs[w.shape[1]], p) for w, p in zip(half, packed)], args.repeats)
        linear = best_of(lambda: [F.linear(xs[w.shape[1]], w) for w in full], args.repeats)
        line = (f"{m:5d} {kernel * 1e3:8.1f}ms {weight_bytes / kernel / 1e9:6.1f} "
                f"{2 * params * m / kernel / 1e9:8.1f} {linear * 1e3:12.1f}ms {linear / kernel:6.2f}")
        if quant:
            blocks = best_of(lambda: [fn(xs[w.shape[1]], b) for (fn, b), w in zip(quant, half)], args.repeats)
            line += f" {blocks * 1e3:8.1f}ms {kernel / blocks:9.2f}"
        print(line)


if __name__ == "__main__":
    main()
