"""One row times a weight matrix: x [1, K] @ w[N, K]^T (+ bias) -> [1, N], the product of a
batch-1 decode step.

At one row a linear layer only streams its weight, and cuBLAS's kernels for it are latency
bound on the small matrices of a 1B model (on an H200, 2026-12-04: 5.9 us for a 2048 x 2048
bfloat16 matrix, a third of the copy bandwidth). Here each program takes BLOCK_N rows of w
and walks K in BLOCK_K columns, multiplying in float32 and summing once at the end; the
result is rounded to x's dtype once, as cuBLAS rounds it. Which launch settings win depends
on the device and the shape, so `choose` times them against torch's product on the shapes
a model has, and the runner uses this kernel only where it wins (models/layers.Linear.gemv).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import triton
import triton.language as tl

# (BLOCK_N, BLOCK_K, num_warps) tried by `choose`
CONFIGS = ((8, 512, 4), (16, 512, 4), (4, 1024, 4), (16, 256, 4), (32, 256, 8))


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, N, K, stride_wn,
                 HAS_BIAS: tl.constexpr, EVEN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN:
            w = tl.load(w_rows + (k + cols)[None, :])
            x = tl.load(x_ptr + k + cols)
        else:
            ok = (k + cols) < K
            w = tl.load(w_rows + (k + cols)[None, :], mask=(rows < N)[:, None] & ok[None, :], other=0.0)
            x = tl.load(x_ptr + k + cols, mask=ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    out = tl.sum(acc, 1)
    if HAS_BIAS:
        out += tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=rows < N)


def gemv(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
         block_n: int = 8, block_k: int = 512, num_warps: int = 4) -> torch.Tensor:
    """x [1, K] (contiguous), w [N, K] (rows contiguous), bias [N] or None -> out [1, N] in x's dtype."""
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != w.shape[1] or not x.is_contiguous() or w.stride(1) != 1:
        raise ValueError(f"gemv takes x [1, K] contiguous and w [N, K] with contiguous rows, "
                         f"got {tuple(x.shape)} and {tuple(w.shape)}")
    n, k = w.shape
    if out is None:
        out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, bias if bias is not None else x, out, n, k, w.stride(0),
        HAS_BIAS=bias is not None, EVEN=n % block_n == 0 and k % block_k == 0,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps)
    return out


def gemv_ref(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Plain torch, in float32, rounded once to x's dtype."""
    out = x.float() @ w.float().t()
    return (out if bias is None else out + bias.float()).to(x.dtype)


def choose(w: torch.Tensor, bias: Optional[torch.Tensor] = None, iters: int = 20,
           configs=CONFIGS) -> tuple[Optional[Callable], dict]:
    """The fastest of torch's one-row product and `gemv` at each of `configs` on w's shape:
    (a callable (x, w, bias) -> out for gemv's winner, or None where torch's wins,
    {setting: microseconds a product}). Each is timed as `iters` products captured in one CUDA
    graph, as a decode step replays them: a launch from Python costs more than either kernel
    takes on a small matrix (on an H200, 2026-12-04: 18 us a launched product against 6 us
    one in a graph)."""
    x = torch.randn(1, w.shape[1], dtype=w.dtype, device=w.device)
    candidates = {"torch": lambda: torch.nn.functional.linear(x, w, bias)}
    for block_n, block_k, warps in configs:
        candidates[(block_n, block_k, warps)] = functools.partial(
            gemv, x, w, bias, block_n=block_n, block_k=block_k, num_warps=warps)
    times = {}
    for name, fn in candidates.items():
        fn()  # compiles, outside the capture
        torch.cuda.synchronize(w.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                fn()
        graph.replay()  # warm
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            graph.replay()
        end.record()
        end.synchronize()
        times[name] = start.elapsed_time(end) * 1e3 / (3 * iters)
        del graph
    best = min(times, key=times.get)
    if best == "torch":
        return None, times
    block_n, block_k, warps = best
    return functools.partial(gemv, block_n=block_n, block_k=block_k, num_warps=warps), times
