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


def test_a_float32_weight_scales_a_bfloat16_row_in_float32(gen, device):
    """Gemma's norms (1 + w, kept in float32): the kernel and the engine's RMSNorm take
    transformers' Gemma order, rmsnorm(x) * w in float32 rounded once, not Llama's (rmsnorm(x)
    rounded to bfloat16 first)."""
    x = randn(gen, 5, HIDDEN, dtype=torch.bfloat16, device=device) * 3
    residual = randn(gen, 5, HIDDEN, dtype=torch.bfloat16, device=device)
    w = weight(gen, torch.float32, device)
    xf = (x.float() + residual.float()).to(torch.bfloat16).float()
    gemma = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w).to(torch.bfloat16)
    norm = RMSNorm(HIDDEN, 1e-6).to(device)
    with torch.no_grad():
        norm.weight.copy_(w)
        engine_out, engine_residual = norm(x, residual)
    out, new_residual = fused_add_rms_norm(x.clone(), residual.clone(), w, 1e-6)
    ref_out, _ = rms_norm_ref(x, w, 1e-6, residual=residual)
    for got in (engine_out, out, ref_out):
        assert rel_err(got, gemma) < TOLERANCE[torch.bfloat16]
    llama = rms_norm_ref(x, w.bfloat16(), 1e-6, residual=residual)[0]
    assert rel_err(engine_out, gemma) < rel_err(llama, gemma)
    assert rel_err(new_residual, engine_residual) < TOLERANCE[torch.bfloat16]
