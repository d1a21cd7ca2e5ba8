"""streamserve_kernels/norm.py against its reference, and the reference against the engine's RMSNorm."""

from __future__ import annotations

import pytest
import torch

from kernel_batches import TOLERANCE, randn, rel_err
from streamserve_kernels.norm import fused_add_rms_norm, rms_norm, rms_norm_ref
from streamserve.models.layers import RMSNorm

DTYPES = [torch.float32, torch.bfloat16]
HIDDEN = 96  # not a power of two: the kernel's masked tail


def weight(gen, dtype, device):
    return (1 + 0.1 * randn(gen, HIDDEN, dtype=torch.float32, device="cpu")).to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_matches_reference(gen, device, dtype):
    x = randn(gen, 7, HIDDEN, dtype=dtype, device=device) * 3
    w = weight(gen, dtype, device)
    x_before = x.clone()
    out = torch.full_like(x, float("nan"))

    assert rms_norm(x, w, 1e-6, out=out) is out

    assert rel_err(out, rms_norm_ref(x, w, 1e-6)) < TOLERANCE[dtype]
    assert torch.equal(x, x_before)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_rms_norm_updates_both_in_place(gen, device, dtype):
    x = randn(gen, 7, HIDDEN, dtype=dtype, device=device)
    residual = randn(gen, 7, HIDDEN, dtype=dtype, device=device) * 4
    w = weight(gen, dtype, device)
    ref_out, ref_residual = rms_norm_ref(x, w, 1e-5, residual=residual)

    out, new_residual = fused_add_rms_norm(x, residual, w, 1e-5)

    assert out is x and new_residual is residual
    assert rel_err(residual, ref_residual) < TOLERANCE[dtype]
    assert rel_err(x, ref_out) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reference_matches_the_engine_rms_norm(gen, device, dtype):
    x = randn(gen, 5, HIDDEN, dtype=dtype, device=device)
    residual = randn(gen, 5, HIDDEN, dtype=dtype, device=device)
    norm = RMSNorm(HIDDEN, 1e-6).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(weight(gen, dtype, device))
        engine_out, engine_residual = norm(x, residual)
        engine_plain = norm(x)

    ref_out, ref_residual = rms_norm_ref(x, norm.weight.detach(), 1e-6, residual=residual)
    assert torch.equal(ref_residual, engine_residual)
    assert rel_err(ref_out, engine_out) < TOLERANCE[dtype]
    assert rel_err(rms_norm_ref(x, norm.weight.detach(), 1e-6), engine_plain) < TOLERANCE[dtype]
