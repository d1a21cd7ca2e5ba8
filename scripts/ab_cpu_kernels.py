"""A/B of builds of the CPU kernels (streamserve/models/csrc/cpu_kernels.c) in one process,
alternating call by call, so that a shared machine's drift hits every build alike.

    python scripts/ab_cpu_kernels.py --variant HEAD --variant streamserve/models/csrc/cpu_kernels.c
    python scripts/ab_cpu_kernels.py --kernel gemv --quant q4_1 --rows 1,4 --variant HEAD~ --variant HEAD
    python scripts/ab_cpu_kernels.py --kernel attention --context 3500 --variant HEAD --variant /tmp/v.c
    python scripts/ab_cpu_kernels.py --kernel gemv-step --rows 1 --variant HEAD~ --variant HEAD
    python scripts/ab_cpu_kernels.py --kernel gemv-step --dtype bfloat16 --rows 8 --variant HEAD~ --variant HEAD
    python scripts/ab_cpu_kernels.py --kernel gemv-step --both --rows 3 --variant HEAD

Each variant is a C file or a git revision (its csrc/cpu_kernels.c), built into a library of its
own with the flags cpu_kernels.py uses; every variant must have the current kernels' interface
(the Python side packs the weights once, for all). A workload is one decode step's worth of calls:
`gemv`, every linear weight of a SmolLM2-shaped model (30 layers of fused QKV, O, gate/up and
down, and the head) through the quantized GEMV (`--quant`: the layers in that type, the head in
Q8_0, as the default model stores them) or the packed GEMM (`--dtype`); `attention`, the decode
attention of 30 layers' float16 (or `--kv-dtype float32`) caches (9 query heads on 3 KV heads
of 64, blocks of 16, each sequence's in order unless `--scattered`), so that the step reads its
K and V from memory. Prints each variant's best and median seconds and
its median's ratio to the first's. The times include the Python wrappers' cost per call (tens of
microseconds, the same for every variant, so ratios come out a little smaller than the kernels').
`gemv-step` runs the `gemv` workload's quantized GEMVs (Q4_1 layers, the Q8_0 head), or with
`--dtype bfloat16` its packed bfloat16 GEMMs (up to 256 rows), or with `--both` each variant both
ways (which of the two a step of --rows tokens should read: model_runner.QUANT_MAX_TOKENS), from C instead
(scripts/ab_gemv_step.c: no Python between calls, as in the C step); where a change is in how a
call walks its rows, the Python wrappers' time and the idle thread between calls can hide it.
Give the same variant twice to see this machine's noise (an A/A pair within a few percent says
the run can tell such a difference).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's streamserve, whatever is installed
from streamserve.models import cpu_kernels  # noqa: E402
from streamserve.models.quantized import BLOCKS, QuantizedWeight  # noqa: E402

SOURCE = "streamserve/models/csrc/cpu_kernels.c"  # in the repository, for `git show REV:SOURCE`
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M: fused QKV, O, gate/up, down
LAYERS, VOCAB, HQ, HKV, D, BS = 30, 49152, 9, 3, 64, 16


def build(variant: str, out_dir: str, index: int) -> cpu_kernels.CpuKernels:
    """The kernels built from a C file, or from a git revision's copy of the source."""
    lib = build_library(variant, out_dir, index)
    try:
        return cpu_kernels.CpuKernels(ctypes.CDLL(lib))
    except AttributeError as exc:
        raise SystemExit(f"{variant} does not have the current kernels' interface ({exc})")


def build_library(variant: str, out_dir: str, index: int) -> str:
    """The path of the shared library built from a C file or a git revision's source."""
    if os.path.isfile(variant):
        path = variant
    else:
        path = os.path.join(out_dir, f"variant{index}.c")
        text = subprocess.run(["git", "show", f"{variant}:{SOURCE}"], cwd=ROOT, check=True, capture_output=True).stdout
        with open(path, "wb") as f:
            f.write(text)
    lib = os.path.join(out_dir, f"variant{index}.so")
    subprocess.run([cpu_kernels._compiler(), *cpu_kernels.FLAGS, path, "-o", lib], check=True)
    return lib


def gemv_workload(args, gen: torch.Generator):
    """(bytes read, a function running one pass with given kernels)."""
    weights = [(n, k) for _ in range(LAYERS) for n, k in SHAPES] + [(VOCAB, 576)]
    xs = {k: torch.randn(args.rows, k, generator=gen) for _, k in SHAPES}
    if args.quant:
        kinds = [args.quant] * (len(weights) - 1) + ["q8_0"]
        packed = [cpu_kernels.pack_quantized(QuantizedWeight.random(kind, n, k, gen))
                  for kind, (n, k) in zip(kinds, weights)]
        size = sum(p.rows.numel() for p in packed)
        return size, lambda kernels: [kernels.quant_gemv[p.kind](xs[p.in_features], p) for p in packed]
    dtype = getattr(torch, args.dtype)
    panels = [cpu_kernels.pack_weight(torch.randn(n, k, generator=gen).to(dtype)) for n, k in weights]
    size = sum(p.panels.numel() * p.panels.element_size() for p in panels)
    return size, lambda kernels: [kernels.gemm[dtype](xs[p.panels.shape[1]], p) for p in panels]


def attention_workload(args, gen: torch.Generator):
    blocks = -(-args.context // BS)
    # on huge pages, as the runner's caches are (cpu_kernels.huge_pages), then filled
    caches, dtype = [], getattr(torch, args.kv_dtype)
    for _ in range(LAYERS):
        shape = (2, args.batch * blocks, BS, HKV, D)
        cache = cpu_kernels.huge_pages(dtype.itemsize * int(np.prod(shape))).view(dtype).view(shape)
        cache.copy_(torch.randn(cache.shape, generator=gen) * 0.3)
        caches.append(cache)
    order = torch.randperm(args.batch * blocks, generator=gen) if args.scattered else torch.arange(args.batch * blocks)
    tables = order.view(args.batch, blocks)
    lens = torch.full((args.batch,), args.context, dtype=torch.int64)
    q = torch.randn(args.batch, HQ, D, generator=gen)
    size = sum(c.numel() * c.element_size() for c in caches) * args.context / (blocks * BS)
    return size, lambda kernels: [kernels.paged_decode_attention(q, c, tables, lens, D ** -0.5) for c in caches]


def gemv_step(args) -> int:
    """The gemv workload from C: scripts/ab_gemv_step.c over each variant's library."""
    if args.dtype not in (None, "bfloat16") or args.quant not in ("q4_1", None):
        raise SystemExit("--kernel gemv-step times the default model's blocks (Q4_1 layers, the Q8_0 head) "
                         "or its bfloat16 weights (--dtype bfloat16)")
    if args.both and args.dtype:
        raise SystemExit("--both times the blocks and the bfloat16 weights itself: no --dtype")
    with tempfile.TemporaryDirectory() as out_dir:
        libs = [build_library(v, out_dir, i) for i, v in enumerate(args.variant)]
        harness = os.path.join(out_dir, "ab_gemv_step")
        subprocess.run([cpu_kernels._compiler(), "-O2", os.path.join(ROOT, "scripts", "ab_gemv_step.c"),
                        "-ldl", "-o", harness], check=True)
        what = ("q4_1 layers and the q8_0 head, then packed bfloat16 weights" if args.both
                else "packed bfloat16 weights" if args.dtype else "q4_1 layers and the q8_0 head")
        print(f"gemv-step: {what}, {args.rows} rows, from C, {args.rounds} rounds")
        runs = [lib for lib in libs for _ in range(2)] if args.both else libs
        flags = ",".join("0,1" for _ in libs) if args.both else "1" if args.dtype else "0"
        env = {**os.environ, "M": str(args.rows), "PASSES": str(args.rounds), "BF16": flags}
        run = subprocess.run([harness, *runs], env=env, capture_output=True, text=True)
        if run.returncode:
            raise SystemExit(f"ab_gemv_step failed: {run.stderr.strip()}")
        out = run.stdout
    for lib, variant in zip(libs, args.variant):
        out = out.replace(lib, f"{variant:{len(lib)}s}")
    print(out, end="")
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", action="append", required=True, help="a C file or a git revision (repeat)")
    parser.add_argument("--kernel", choices=["gemv", "gemv-step", "attention"], default="gemv")
    parser.add_argument("--quant", choices=list(BLOCKS), default="q4_1", help="gemv: GGUF blocks of this type")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"],
                        help="gemv: the packed GEMM over weights of this dtype instead of GGUF blocks")
    parser.add_argument("--rows", type=int, default=1, help="gemv: tokens in the step")
    parser.add_argument("--batch", type=int, default=1, help="attention: sequences")
    parser.add_argument("--context", type=int, default=2048, help="attention: keys each sequence reads")
    parser.add_argument("--kv-dtype", choices=["float16", "float32"], default="float16", help="attention: the caches'")
    parser.add_argument("--scattered", action="store_true",
                        help="attention: the blocks in random order (else each sequence's in order, as a prompt's)")
    parser.add_argument("--both", action="store_true",
                        help="gemv-step: each variant's q4_1 blocks and its packed bfloat16 GEMM, alternating")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    if args.dtype:
        args.quant = None
    if args.kernel == "gemv-step":
        return gemv_step(args)
    if args.both:
        raise SystemExit("--both is for --kernel gemv-step")
    with tempfile.TemporaryDirectory() as out_dir:
        builds = [build(v, out_dir, i) for i, v in enumerate(args.variant)]
        gen = torch.Generator().manual_seed(0)
        size, run = (gemv_workload if args.kernel == "gemv" else attention_workload)(args, gen)
        times: list[list[float]] = [[] for _ in builds]
        for _ in range(args.rounds + 2):  # the first two rounds warm up and are dropped
            for i, kernels in enumerate(builds):
                start = time.perf_counter()
                run(kernels)
                times[i].append(time.perf_counter() - start)
    what = (f"{args.kernel}: {args.quant or args.dtype}, {args.rows} rows" if args.kernel == "gemv"
            else f"attention: batch {args.batch}, context {args.context}, {args.kv_dtype} KV"
            f"{', scattered blocks' if args.scattered else ''}")
    print(f"{what}, {size / 1e6:.0f} MB read a pass, {torch.get_num_threads()} threads, {args.rounds} rounds")
    first = statistics.median(times[0][2:])
    for variant, t in zip(args.variant, times):
        median = statistics.median(t[2:])
        print(f"  {variant:40s} best {min(t[2:]) * 1e3:7.2f} ms  median {median * 1e3:7.2f} ms "
              f"({size / median / 1e9:5.1f} GB/s)  {first / median:5.2f}x the first")


if __name__ == "__main__":
    sys.exit(main())
