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
