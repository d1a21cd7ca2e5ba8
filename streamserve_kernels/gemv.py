"""One row times a weight matrix: x [1, K] @ w[N, K]^T (+ bias) -> [1, N], the product of a
batch-1 decode step.

At one row a linear layer only streams its weight, and cuBLAS's kernels for it are latency
bound on the small matrices of a 1B model (on an H200, 2026-12-04: 5.9 us for a 2048 x 2048
bfloat16 matrix, a third of the copy bandwidth). Here each program takes BLOCK_N rows of w
and walks K in BLOCK_K columns, multiplying in float32 and summing once at the end; the
result is rounded to x's dtype once, as cuBLAS rounds it. Which launch settings win depends
on the device and the shape, so `choose` times them against torch's product on the shapes
a model has, and the runner uses this kernel only where it wins (models/layers.Linear.gemv).
On Hopper and later it launches with programmatic dependent launch, reading its first tile of
the weight while the kernel before it still runs (launch.py; on an H200 on 2026-12-04 a
batch-1 step of a 1B model took 0.94 ms with it and 0.97 ms without).
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from streamserve_kernels.launch import let_next_launch, pdl, wait_for_inputs

# (BLOCK_N, BLOCK_K, num_warps) tried by `choose`
CONFIGS = ((8, 512, 4), (16, 512, 4), (4, 1024, 4), (16, 256, 4), (32, 256, 8))
MAX_COPIES = 64  # of a weight, timed cold (cold_copies)


@triton.jit
def _load(ptr, mask, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=mask, other=0.0)


@triton.jit
def _total(x_ptr, r_ptr, idx, mask, HAS_RESIDUAL: tl.constexpr, EVEN: tl.constexpr):
    """x[idx] (+ residual[idx], rounded to the residual's dtype: fused_add_rms_norm's new
    residual) in float32."""
    x = _load(x_ptr + idx, mask, EVEN).to(tl.float32)
    if HAS_RESIDUAL:
        return (x + _load(r_ptr + idx, mask, EVEN).to(tl.float32)).to(r_ptr.dtype.element_ty).to(tl.float32)
    else:
        return x


@triton.jit
def _row(x_ptr, r_ptr, nw_ptr, inv_rms, idx, K, mask, GATED: tl.constexpr, NORMED: tl.constexpr,
         HAS_RESIDUAL: tl.constexpr, ROUND_NORMED: tl.constexpr, EVEN: tl.constexpr):
    """The product's input at idx in float32 (`mask`: where idx < K, unless EVEN). GATED: x is
    gate then up, [2K], and this is silu(gate) * up, each product rounded to x's dtype as
    activation.silu_and_mul rounds them. NORMED: rms_norm(x + residual) * the norm's weight,
    rounded as norm.fused_add_rms_norm rounds it (inv_rms: the row's, from a first pass)."""
    if GATED:
        gate = _load(x_ptr + idx, mask, EVEN)
        up = _load(x_ptr + K + idx, mask, EVEN).to(tl.float32)
        g = gate.to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
        return (silu * up).to(gate.dtype).to(tl.float32)
    elif NORMED:
        normed = _total(x_ptr, r_ptr, idx, mask, HAS_RESIDUAL, EVEN) * inv_rms
        if ROUND_NORMED:
            normed = normed.to(x_ptr.dtype.element_ty).to(tl.float32)
        weight = _load(nw_ptr + idx, mask, EVEN).to(tl.float32)
        return (normed * weight).to(x_ptr.dtype.element_ty).to(tl.float32)
    else:
        return _load(x_ptr + idx, mask, EVEN).to(tl.float32)


@triton.jit
def _gemv_kernel(x_ptr, r_ptr, nw_ptr, new_r_ptr, w_ptr, bias_ptr, out_ptr, N, K, stride_wn, eps,
                 HAS_BIAS: tl.constexpr, GATED: tl.constexpr, NORMED: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                 ROUND_NORMED: tl.constexpr, EVEN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PDL: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    # the first tile of the weight (no kernel writes it) before waiting for the kernel before (launch.py)
    w_first = _load(w_rows + cols[None, :], (rows < N)[:, None] & (cols < K)[None, :], EVEN)
    wait_for_inputs(PDL)
    let_next_launch(PDL)
    inv_rms = 0.0
    if NORMED:  # a first pass over the row for its sum of squares; the first program writes the new residual
        squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
        first = tl.program_id(0) == 0
        for k in range(0, K, BLOCK_K):
            ok = (k + cols) < K
            total = _total(x_ptr, r_ptr, k + cols, ok, HAS_RESIDUAL, EVEN)
            squares += total * total
            if HAS_RESIDUAL:
                tl.store(new_r_ptr + k + cols, total.to(new_r_ptr.dtype.element_ty), mask=ok & first)
        inv_rms = tl.rsqrt(tl.sum(squares, 0) / K + eps)
    x = _row(x_ptr, r_ptr, nw_ptr, inv_rms, cols, K, cols < K, GATED, NORMED, HAS_RESIDUAL, ROUND_NORMED, EVEN)
    acc = w_first.to(tl.float32) * x[None, :]
    for k in range(BLOCK_K, K, BLOCK_K):
        ok = (k + cols) < K
        w = _load(w_rows + (k + cols)[None, :], (rows < N)[:, None] & ok[None, :], EVEN)
        x = _row(x_ptr, r_ptr, nw_ptr, inv_rms, k + cols, K, ok, GATED, NORMED, HAS_RESIDUAL, ROUND_NORMED, EVEN)
        acc += w.to(tl.float32) * x[None, :]
    out = tl.sum(acc, 1)
    if HAS_BIAS:
        out += tl.load(bias_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty), mask=rows < N)


def gemv(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
         block_n: int = 8, block_k: int = 512, num_warps: int = 4, gated: bool = False) -> torch.Tensor:
    """x [1, K] (contiguous), w [N, K] (rows contiguous), bias [N] or None -> out [1, N] in x's dtype.
    gated: x is [1, 2K], a gate_up projection's output, and the product is silu_and_mul(x)'s
    (the down projection of a SiLU MLP, the activation read on the fly: one launch less)."""
    k = w.shape[1] * (2 if gated else 1)
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != k or not x.is_contiguous() or w.stride(1) != 1:
        raise ValueError(f"gemv takes x [1, {'2K' if gated else 'K'}] contiguous and w [N, K] with contiguous "
                         f"rows, got {tuple(x.shape)} and {tuple(w.shape)}")
    return _launch(x, None, None, None, 0.0, w, bias, out, block_n, block_k, num_warps, gated)


def normed_gemv(x: torch.Tensor, residual: Optional[torch.Tensor], norm_weight: torch.Tensor, eps: float,
                w: torch.Tensor, bias: Optional[torch.Tensor] = None, block_n: int = 8, block_k: int = 512,
                num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's RMSNorm (after the residual add) and the product that follows it, for one row:
    (rms_norm(x + residual) * norm_weight @ w^T (+ bias) [1, N], x + residual [1, K]), rounded as
    norm.fused_add_rms_norm and then gemv round them. x and residual [1, K] contiguous and left
    as they are: the new residual is a new tensor (residual None: no add, and x is returned as it)."""
    k = w.shape[1]
    for name, t in (("x", x), ("residual", residual)):
        if t is not None and (t.dim() != 2 or t.shape != (1, k) or not t.is_contiguous()):
            raise ValueError(f"normed_gemv takes {name} [1, {k}] contiguous, got {tuple(t.shape)}")
    if norm_weight.shape != (k,) or w.stride(1) != 1:
        raise ValueError(f"norm weight {tuple(norm_weight.shape)} and w {tuple(w.shape)} do not fit x [1, {k}]")
    new_residual = x if residual is None else torch.empty_like(residual)
    out = _launch(x, residual, norm_weight, new_residual, eps, w, bias, None, block_n, block_k, num_warps, False)
    return out, new_residual


def _launch(x, residual, norm_weight, new_residual, eps, w, bias, out, block_n, block_k, num_warps, gated):
    n, k = w.shape
    if out is None:
        out = torch.empty(1, n, dtype=x.dtype, device=x.device)
    normed = norm_weight is not None
    dependent = pdl(x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, residual if residual is not None else x, norm_weight if normed else x,
        new_residual if residual is not None else x, w, bias if bias is not None else x, out, n, k, w.stride(0), eps,
        HAS_BIAS=bias is not None, GATED=gated, NORMED=normed, HAS_RESIDUAL=residual is not None,
        ROUND_NORMED=normed and norm_weight.dtype != torch.float32, EVEN=n % block_n == 0 and k % block_k == 0,
        BLOCK_N=block_n, BLOCK_K=block_k, PDL=dependent, num_warps=num_warps, **({"launch_pdl": True} if dependent else {}))
    return out


def gemv_ref(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
             gated: bool = False) -> torch.Tensor:
    """Plain torch, in float32, rounded once to x's dtype (gated: of silu_and_mul_ref(x))."""
    if gated:
        from streamserve_kernels.activation import silu_and_mul_ref

        x = silu_and_mul_ref(x)
    out = x.float() @ w.float().t()
    return (out if bias is None else out + bias.float()).to(x.dtype)


def normed_gemv_ref(x: torch.Tensor, residual: Optional[torch.Tensor], norm_weight: torch.Tensor, eps: float,
                    w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch: norm.rms_norm_ref, then gemv_ref."""
    from streamserve_kernels.norm import rms_norm_ref

    normed, total = (rms_norm_ref(x, norm_weight, eps), x) if residual is None else \
        rms_norm_ref(x, norm_weight, eps, residual)
    return gemv_ref(normed, w, bias), total


def choose(w: torch.Tensor, bias: Optional[torch.Tensor] = None, iters: int = 20,
           configs=CONFIGS) -> tuple[Optional[Callable], dict]:
    """The fastest of torch's one-row product and `gemv` at each of `configs` on w's shape:
    (a callable (x, w, bias) -> out for gemv's winner, or None where torch's wins,
    {setting: microseconds a product}). Each is timed as `iters` products captured in one CUDA
    graph, as a decode step replays them (a launch from Python costs more than either kernel
    takes on a small matrix: on an H200, 2026-12-04, 18 us a launched product against 6 us one
    in a graph), each on a copy of w that is not in L2 (cold_copies), as a step reads it."""
    x = torch.randn(1, w.shape[1], dtype=w.dtype, device=w.device)
    candidates = {"torch": lambda w: torch.nn.functional.linear(x, w, bias)}
    for block_n, block_k, warps in configs:
        candidates[(block_n, block_k, warps)] = functools.partial(
            gemv, x, bias=bias, block_n=block_n, block_k=block_k, num_warps=warps)
    return _fastest(candidates, "torch", w, iters)


def choose_gated(w: torch.Tensor, bias: Optional[torch.Tensor],
                 unfused: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 iters: int = 20, configs=CONFIGS) -> tuple[Optional[Callable], dict]:
    """Likewise for a SiLU MLP's down projection: `unfused(gate_up, w)` (the activation's
    kernel, then the product the layer would take) against gemv(gated=True) at each of
    `configs`, which reads gate and up and computes the activation in every program: (a
    callable (gate_up, w, bias) -> out for the fused winner, or None where unfused wins,
    {setting: microseconds})."""
    x = torch.randn(1, 2 * w.shape[1], dtype=w.dtype, device=w.device)
    candidates = {"unfused": lambda w: unfused(x, w)}
    for block_n, block_k, warps in configs:
        candidates[(block_n, block_k, warps)] = functools.partial(
            gemv, x, bias=bias, block_n=block_n, block_k=block_k, num_warps=warps, gated=True)
    fn, times = _fastest(candidates, "unfused", w, iters)
    return None if fn is None else functools.partial(fn, gated=True), times


def choose_normed(w: torch.Tensor, bias: Optional[torch.Tensor], norm_weight: torch.Tensor, eps: float,
                  linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], iters: int = 20,
                  configs=CONFIGS) -> tuple[Optional[Callable], dict]:
    """Likewise for a layer's first product after its RMSNorm: the norm's kernel (with the
    residual add, in place) and then `linear(normed, w)` (the product the layer would take)
    against normed_gemv at each of `configs`, which reads the row and computes the norm in every
    program: (a callable (x, residual, norm_weight, eps, w, bias) -> (out, new residual) for the
    fused winner, or None where apart wins, {setting: microseconds})."""
    from streamserve_kernels.norm import fused_add_rms_norm

    x, residual = (torch.randn(1, w.shape[1], dtype=w.dtype, device=w.device) for _ in range(2))
    candidates = {"unfused": lambda w: linear(fused_add_rms_norm(x, residual, norm_weight, eps)[0], w)}
    for block_n, block_k, warps in configs:
        candidates[(block_n, block_k, warps)] = functools.partial(
            normed_gemv, x, residual, norm_weight, eps, bias=bias, block_n=block_n, block_k=block_k,
            num_warps=warps)
    return _fastest(candidates, "unfused", w, iters, normed_gemv)


def cold_copies(weight_bytes: int, l2_bytes: int) -> int:
    """How many copies of a weight a timing cycles through so that none is still in L2 when it
    comes round again (as in a decode step, which streams gigabytes between two reads of a
    layer's weight): enough that twice the L2 is read between two reads of one copy, at most
    MAX_COPIES (a weight that small takes a few microseconds however it is read)."""
    return max(1, min(MAX_COPIES, -(-2 * l2_bytes // max(1, weight_bytes))))


def _fastest(candidates: dict, baseline: str, w: torch.Tensor, iters: int,
             kernel: Callable = gemv) -> tuple[Optional[Callable], dict]:
    """Time each candidate (_timed): (`kernel` at the fastest one's settings, or None where
    `baseline` is fastest, {name: microseconds a call})."""
    times = _timed(candidates, w, iters)
    best = min(times, key=times.get)
    if best == baseline:
        return None, times
    block_n, block_k, warps = best
    return functools.partial(kernel, block_n=block_n, block_k=block_k, num_warps=warps), times


def _timed(candidates: dict, w: torch.Tensor, iters: int) -> dict:
    """{name: microseconds a call} for each candidate (a callable of the weight), timed as
    calls captured in one CUDA graph (`iters`, or one for each of w's cold_copies where there are
    more), each reading the next copy."""
    device = w.device
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    copies = [w] + [w.clone() for _ in range(cold_copies(w.numel() * w.element_size(), l2_bytes) - 1)]
    iters = max(iters, len(copies))
    times = {}
    for name, fn in candidates.items():
        fn(w)  # compiles, outside the capture
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(iters):
                fn(copies[i % len(copies)])
        graph.replay()  # warm
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            graph.replay()
        end.record()
        end.synchronize()
        times[name] = start.elapsed_time(end) * 1e3 / (3 * iters)
        del graph
    return times
