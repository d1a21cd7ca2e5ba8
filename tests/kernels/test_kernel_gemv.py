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


def test_cold_copies_pass_twice_the_l2_between_two_reads_of_a_copy():
    from streamserve_kernels.gemv import cold_copies

    mib = 2 ** 20
    assert cold_copies(8 * mib, 50 * mib) == 13  # an o_proj of a 1B model on an H200's 50 MiB
    assert cold_copies(64 * mib, 50 * mib) == 2
    assert cold_copies(501 * mib, 50 * mib) == 1  # the head: read whole, it leaves nothing behind
    assert cold_copies(16 * 1024, 50 * mib) == cold_copies(0, 50 * mib) == 64  # tiny: a bounded number


@pytest.mark.parametrize("winner", ["apart", "fused"])
def test_choosers_time_each_candidate_on_the_weight_they_are_handed(gen, device, monkeypatch, winner):
    """choose, choose_gated and choose_normed build candidates that read the weight each timed
    call hands them (a cold copy on the GPU), and hand back the winner's settings. Here the
    timing (CUDA graphs) is replaced by one call of each on a copy, checked against the reference."""
    from streamserve_kernels import gemv as gemv_module
    from streamserve_kernels.activation import silu_and_mul

    w = randn(gen, 40, 128, dtype=torch.float32, device=device)
    ran = []

    def fake_timed(candidates, weight, iters):
        times = {}
        for name, fn in candidates.items():
            out = fn(weight.clone())
            ran.append((name, out[0] if isinstance(out, tuple) else out))
            times[name] = 1.0 if (name in ("torch", "unfused")) == (winner == "apart") else 2.0 + len(times)
        return times
    monkeypatch.setattr(gemv_module, "_timed", fake_timed)
    configs = ((4, 64, 2), (8, 32, 4))

    fn, times = gemv_module.choose(w, configs=configs)
    assert set(times) == {"torch", *configs} and len(ran) == 3
    torch_out = ran[0][1]
    assert all(rel_err(out, torch_out) < TOLERANCE[torch.float32] for _, out in ran[1:])
    x = randn(gen, 1, 128, dtype=torch.float32, device=device)
    if winner == "apart":
        assert fn is None
    else:
        assert fn.keywords == dict(block_n=4, block_k=64, num_warps=2)
        assert rel_err(fn(x, w), gemv_ref(x, w)) < TOLERANCE[torch.float32]

    down = randn(gen, 40, 64, dtype=torch.float32, device=device)
    fn, _ = gemv_module.choose_gated(down, None, lambda x, w: gemv(silu_and_mul(x), w), configs=configs)
    gate_up = randn(gen, 1, 128, dtype=torch.float32, device=device)
    if winner == "fused":
        assert rel_err(fn(gate_up, down, None), gemv_ref(gate_up, down, gated=True)) < TOLERANCE[torch.float32]

    norm_weight = 1 + randn(gen, 128, dtype=torch.float32, device=device)
    ran.clear()
    fn, _ = gemv_module.choose_normed(w, None, norm_weight, 1e-5, lambda x, w: gemv(x, w), configs=configs)
    assert len(ran) == 3
    residual = randn(gen, 1, 128, dtype=torch.float32, device=device)
    if winner == "fused":
        out, new_residual = fn(x, residual, norm_weight, 1e-5, w, None)
        ref, ref_residual = gemv_module.normed_gemv_ref(x, residual, norm_weight, 1e-5, w)
        assert rel_err(out, ref) < TOLERANCE[torch.float32] and torch.equal(new_residual, ref_residual)
