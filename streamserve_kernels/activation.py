"""SiLU-and-mul for the fused gate_up projection: [T, 2I] -> silu(gate) * up, [T, I].

silu(gate) is computed in float32 and rounded to the input dtype before the product, as
streamserve.models.layers.silu_and_mul (F.silu(gate) * up) rounds it.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from streamserve_kernels.launch import let_next_launch, pdl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr):
    let_next_launch(PDL)  # (the product after it reads its weight meanwhile: launch.py)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [T, 2I] (gate then up, last dim contiguous) -> out [T, I] in x's dtype."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [T, 2I], contiguous in its last dim, got {tuple(x.shape)}")
    num_tokens, n_cols = x.shape[0], x.shape[1] // 2
    if out is None:
        out = torch.empty(num_tokens, n_cols, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(n_cols))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(n_cols, block))](
        x, out, n_cols, x.stride(0), out.stride(0), BLOCK=block, PDL=pdl(x.device), num_warps=4)
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Plain torch: gate * sigmoid(gate) in float32, rounded, times up."""
    gate, up = x.float().chunk(2, dim=-1)
    silu = (gate * torch.sigmoid(gate)).to(x.dtype).float()
    return (silu * up).to(x.dtype)
