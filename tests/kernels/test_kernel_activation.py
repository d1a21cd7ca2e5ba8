"""streamserve_kernels/activation.py against its reference, and the reference against the engine's."""

from __future__ import annotations

import pytest
import torch

from kernel_batches import TOLERANCE, randn, rel_err
from streamserve_kernels.activation import silu_and_mul, silu_and_mul_ref
from streamserve.models.layers import silu_and_mul as engine_silu_and_mul


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_silu_and_mul_matches_reference_and_engine(gen, device, dtype):
    x = randn(gen, 6, 2 * 80, dtype=dtype, device=device) * 3  # 80: a masked tail
    out = torch.full((6, 80), float("nan"), dtype=dtype, device=device)

    assert silu_and_mul(x, out=out) is out

    ref = silu_and_mul_ref(x)
    assert rel_err(out, ref) < TOLERANCE[dtype]
    assert rel_err(ref, engine_silu_and_mul(x)) < TOLERANCE[dtype]
