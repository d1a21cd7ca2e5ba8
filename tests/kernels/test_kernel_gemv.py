"""streamserve_kernels/gemv.py against its reference and torch's product, at every launch setting
the runner may choose, on shapes that fill the blocks and shapes that leave tails."""

from __future__ import annotations

import pytest
import torch

from kernel_batches import TOLERANCE, randn, rel_err
from streamserve_kernels.gemv import CONFIGS, gemv, gemv_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n, k", [(64, 1024), (37, 300)], ids=["even", "tails"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_gemv_matches_reference(gen, device, dtype, n, k, with_bias):
    x = randn(gen, 1, k, dtype=dtype, device=device)
    w = randn(gen, n, k, dtype=dtype, device=device)
    bias = randn(gen, n, dtype=dtype, device=device) if with_bias else None
    ref = gemv_ref(x, w, bias)
    assert rel_err(ref, torch.nn.functional.linear(x.float(), w.float(),
                                                   None if bias is None else bias.float())) < TOLERANCE[dtype]
    for block_n, block_k, warps in CONFIGS:
        out = torch.full((1, n), float("nan"), dtype=dtype, device=device)
        assert gemv(x, w, bias, out=out, block_n=block_n, block_k=block_k, num_warps=warps) is out
        assert rel_err(out, ref) < TOLERANCE[dtype], (block_n, block_k, warps)


def test_gemv_refuses_what_it_cannot_read(device):
    w = torch.zeros(8, 16, device=device)
    with pytest.raises(ValueError, match="x \\[1, K\\]"):
        gemv(torch.zeros(2, 16, device=device), w)
    with pytest.raises(ValueError, match="contiguous rows"):
        gemv(torch.zeros(1, 16, device=device), torch.zeros(16, 8, device=device).t())  # [8, 16], column-major


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n, k", [(64, 1024), (37, 300)], ids=["even", "tails"])
def test_gated_gemv_is_the_product_of_silu_and_mul(gen, device, dtype, n, k):
    """gated=True: the down projection of a SiLU MLP, over the gate_up output [1, 2K]; the same
    values, rounding included, as silu_and_mul's kernel and then the plain GEMV."""
    from streamserve_kernels.activation import silu_and_mul

    gate_up = randn(gen, 1, 2 * k, dtype=dtype, device=device) * 3
    w = randn(gen, n, k, dtype=dtype, device=device)
    bias = randn(gen, n, dtype=dtype, device=device)
    ref = gemv_ref(gate_up, w, bias, gated=True)
    for block_n, block_k, warps in CONFIGS[:3]:
        out = torch.full((1, n), float("nan"), dtype=dtype, device=device)
        gemv(gate_up, w, bias, out=out, block_n=block_n, block_k=block_k, num_warps=warps, gated=True)
        assert rel_err(out, ref) < TOLERANCE[dtype], (block_n, block_k, warps)
        apart = gemv(silu_and_mul(gate_up), w, bias, block_n=block_n, block_k=block_k, num_warps=warps)
        assert torch.equal(out, apart)
    with pytest.raises(ValueError, match="x \\[1, 2K\\]"):
        gemv(gate_up[:, :k], w, gated=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n, k", [(64, 1024), (37, 300)], ids=["even", "tails"])
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "first-layer"])
def test_normed_gemv_is_the_norm_then_the_product(gen, device, dtype, n, k, with_residual):
    """normed_gemv: a layer's RMSNorm (after the residual add) and the product after it in one
    kernel, against the reference and against the norm's kernel then the GEMV; the new
    residual comes out whole, and neither input is written."""
    from streamserve_kernels.norm import fused_add_rms_norm, rms_norm
    from streamserve_kernels.gemv import normed_gemv, normed_gemv_ref

    x = randn(gen, 1, k, dtype=dtype, device=device) * 2
    residual = randn(gen, 1, k, dtype=dtype, device=device) if with_residual else None
    norm_weight = randn(gen, k, dtype=dtype, device=device)
    w, bias = randn(gen, n, k, dtype=dtype, device=device), randn(gen, n, dtype=dtype, device=device)
    x0, r0 = x.clone(), None if residual is None else residual.clone()
    ref, ref_total = normed_gemv_ref(x, residual, norm_weight, 1e-6, w, bias)
    for block_n, block_k, warps in CONFIGS[:3]:
        out, total = normed_gemv(x, residual, norm_weight, 1e-6, w, bias, block_n=block_n, block_k=block_k,
                                 num_warps=warps)
        assert rel_err(out, ref) < TOLERANCE[dtype], (block_n, block_k, warps)
        assert rel_err(total, ref_total) < TOLERANCE[dtype] and torch.equal(x, x0)
        assert residual is None and total is x or torch.equal(residual, r0)
        normed, new_residual = (rms_norm(x, norm_weight, 1e-6), x) if residual is None else \
            fused_add_rms_norm(x.clone(), residual.clone(), norm_weight, 1e-6)
        apart = gemv(normed, w, bias, block_n=block_n, block_k=block_k, num_warps=warps)
        assert rel_err(out, apart) < TOLERANCE[dtype] / 10 and torch.equal(total, new_residual)
