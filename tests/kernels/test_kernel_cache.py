"""streamserve_kernels/cache.py: reshape_and_cache against its reference."""

from __future__ import annotations

import pytest
import torch

from kernel_batches import randn
from streamserve_kernels.cache import reshape_and_cache, reshape_and_cache_ref


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reshape_and_cache_writes_each_slot_and_skips_padding(gen, device, dtype, block_size):
    hkv, d, num_blocks = 3, 64, 6
    # Two sequences' slots crossing block boundaries, interleaved with padding (-1).
    slots = [block_size - 2, block_size - 1, 3 * block_size, -1, 3 * block_size + 1, 5 * block_size + 7, -1]
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    # K and V as views into a fused qkv tensor, as the model hands them over.
    qkv = randn(gen, len(slots), 9 + 2 * hkv, d, dtype=dtype, device=device)
    k, v = qkv[:, 9:9 + hkv], qkv[:, 9 + hkv:]
    cache = torch.full((2, num_blocks, block_size, hkv, d), float("nan"), dtype=dtype, device=device)
    expected = cache.clone()

    reshape_and_cache(k, v, cache, slot_mapping)

    reshape_and_cache_ref(k, v, expected, slot_mapping)
    torch.testing.assert_close(cache, expected, rtol=0, atol=0, equal_nan=True)
    assert (~cache.isnan()).sum().item() == 2 * 5 * hkv * d  # five real tokens, nothing else written
    flat = cache.view(2, -1, hkv, d)
    assert torch.equal(flat[0, 3 * block_size + 1], k[4]) and torch.equal(flat[1, 3 * block_size + 1], v[4])
