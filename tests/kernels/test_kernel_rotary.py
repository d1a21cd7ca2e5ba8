"""streamserve_kernels/rotary.py against its reference, on the engine's Llama-3-scaled cos/sin cache."""

from __future__ import annotations

import pytest
import torch

from kernel_batches import TOLERANCE, randn, rel_err
from streamserve_kernels.rotary import rotary_embedding, rotary_embedding_ref
from streamserve.models.layers import RotaryEmbedding, apply_rotary

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.mark.parametrize("rotated", [64, 48], ids=["whole", "partial"])  # (Phi-4-mini turns 3/4 of a head)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rotary_in_place_on_qkv_views(gen, device, dtype, rotated):
    hq, hkv, d = 9, 3, 64
    rope = RotaryEmbedding(rotated, max_position=512, theta=500000.0, scaling=LLAMA3)
    rope.build_cache(torch.device(device), dtype)
    positions = torch.tensor([0, 1, 63, 64, 200, 511, 0], device=device)  # last: a padding row
    qkv = randn(gen, len(positions), hq + 2 * hkv, d, dtype=dtype, device=device)
    before = qkv.clone()
    q, k = qkv[:, :hq], qkv[:, hq:hq + hkv]

    rotary_embedding(positions, q, k, rope.cos_sin_cache)

    ref_q = rotary_embedding_ref(positions, before[:, :hq], rope.cos_sin_cache)
    ref_k = rotary_embedding_ref(positions, before[:, hq:hq + hkv], rope.cos_sin_cache)
    assert rel_err(q, ref_q) < TOLERANCE[dtype]
    assert rel_err(k, ref_k) < TOLERANCE[dtype]
    assert torch.equal(qkv[:, hq + hkv:], before[:, hq + hkv:])  # v untouched
    assert torch.equal(q[0], before[0, :hq])  # position 0 is the identity
    cos, sin = rope.cos_sin(positions)
    assert rel_err(ref_q, apply_rotary(before[:, :hq], cos, sin)) < TOLERANCE[dtype]
    assert torch.equal(q[..., rotated:], before[:, :hq, rotated:])  # a partial rotary's rest untouched


@pytest.mark.parametrize("rotated", [64, 48], ids=["whole", "partial"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
def test_rotary_and_cache_write_in_one_kernel(gen, device, dtype, rotated, block_size):
    """rotary_embedding_and_cache: the same q and cache, bit for bit, as rotary_embedding and
    then reshape_and_cache; a padding row (slot -1) writes nothing."""
    from streamserve_kernels.cache import reshape_and_cache
    from streamserve_kernels.rotary import rotary_embedding_and_cache

    hq, hkv, d = 9, 3, 64
    rope = RotaryEmbedding(rotated, max_position=512, theta=500000.0, scaling=LLAMA3)
    rope.build_cache(torch.device(device), dtype)
    positions = torch.tensor([0, 1, 63, 64, 200, 511, 0], device=device)
    slots = torch.tensor([5, 17, 3 * block_size, 3 * block_size + 1, 40, 2 * block_size - 1, -1], device=device)
    qkv = randn(gen, len(positions), hq + 2 * hkv, d, dtype=dtype, device=device)
    cache = torch.full((2, 6, block_size, hkv, d), float("nan"), dtype=dtype, device=device)
    apart_qkv, apart_cache = qkv.clone(), cache.clone()

    rotary_embedding_and_cache(positions, qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:], rope.cos_sin_cache,
                               cache, slots)
    rotary_embedding(positions, apart_qkv[:, :hq], apart_qkv[:, hq:hq + hkv], rope.cos_sin_cache)
    reshape_and_cache(apart_qkv[:, hq:hq + hkv], apart_qkv[:, hq + hkv:], apart_cache, slots)
    assert torch.equal(qkv[:, :hq], apart_qkv[:, :hq])
    assert torch.equal(cache.nan_to_num(7.0), apart_cache.nan_to_num(7.0))
    written = cache.view(2, -1, hkv, d)[:, slots[:-1]]
    assert not written.isnan().any() and cache.isnan().sum() == cache.numel() - written.numel()
