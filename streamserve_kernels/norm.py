"""RMSNorm, alone or fused with the residual add, rounded as streamserve.models.layers.RMSNorm does.

x [T, H] (rows may be strided, last dim contiguous), weight [H]. The sum of squares and the
normalisation run in float32; the normalised value is rounded to x's dtype before the weight
multiplies it (as Hugging Face does for Llama), unless the weight is float32 where x is not
(Gemma's, 1 + w kept in float32: transformers scales in float32 and rounds once), and the
residual sum is rounded to the residual's dtype before it is normalised (it is what the next
layer adds to).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from streamserve_kernels.launch import let_next_launch, pdl


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, n_cols, eps,
                     stride_x, stride_r, stride_o,
                     HAS_RESIDUAL: tl.constexpr, ROUND_NORMED: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    # One program per row; in place is safe since a row is read whole before it is written.
    let_next_launch(PDL)  # (the product after it reads its weight meanwhile: launch.py)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        total = x + tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        total = total.to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_r + cols, total, mask=mask)
        x = total.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / n_cols + eps)
    normed = x * inv_rms
    if ROUND_NORMED:
        normed = normed.to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out = rmsnorm(x) * weight, x [..., H] left unchanged; returns out (x's shape and dtype)."""
    rows = x.reshape(-1, x.shape[-1])
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(rows, None, weight, out.view(-1, x.shape[-1]), eps)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """In place, both [T, H]: residual += x; x = rmsnorm(residual) * weight. Returns (x, residual),
    the same tensors, in the order streamserve's RMSNorm(x, residual) returns them."""
    if x.dim() != 2 or residual.shape != x.shape:
        raise ValueError(f"x and residual must both be [T, H], got {tuple(x.shape)} and {tuple(residual.shape)}")
    _launch(x, residual, weight, x, eps)
    return x, residual


def _launch(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor,
            out: torch.Tensor, eps: float) -> None:
    n_rows, n_cols = x.shape
    if weight.shape != (n_cols,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden size {n_cols}")
    if x.stride(1) != 1 or out.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("rms_norm needs rows contiguous in their last dim")
    if n_rows == 0:
        return
    block = triton.next_power_of_2(n_cols)
    _rms_norm_kernel[(n_rows,)](
        x, residual if residual is not None else x, weight, out, n_cols, eps,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        HAS_RESIDUAL=residual is not None, ROUND_NORMED=weight.dtype != torch.float32, BLOCK=block,
        PDL=pdl(x.device), num_warps=min(16, max(1, block // 256)))


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: Optional[torch.Tensor] = None):
    """Plain torch, out of place: rmsnorm(x) * weight, or with `residual`
    (rmsnorm(x + residual) * weight, x + residual)."""
    if residual is not None:
        x = (x.float() + residual.float()).to(residual.dtype)
    xf = x.float()
    normed = xf / xf.pow(2).mean(-1, keepdim=True).add(eps).sqrt()
    if weight.dtype != torch.float32:
        normed = normed.to(x.dtype)
    out = (normed.float() * weight.float()).to(x.dtype)
    return out if residual is None else (out, x)
