"""KV cache write (reshape_and_cache): each scheduled token's K and V into its slot.

key, value    [T, Hkv, D]   rows may be strided (views into qkv); last dim contiguous
kv_cache      [2, num_blocks, block_size, Hkv, D]   one layer, K then V
slot_mapping  [T] int       slot s = block * block_size + offset; -1 (padding) writes nothing
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
        key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
        stride_kt, stride_kh, stride_vt, stride_vh,
        stride_cb, stride_ct, stride_ch,
        NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    # One program per token, all its KV heads at once.
    write_token(tl.program_id(0).to(tl.int64), key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ct, stride_ch,
                NUM_KV_HEADS, HEAD_DIM, HEADS_PAD, HEAD_DIM_PAD, BLOCK_SIZE)


@triton.jit
def write_token(token, key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ct, stride_ch,
                NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr,
                HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """A token's K and V, every KV head, into its slot (none for slot -1); also rotary's, after it rotates."""
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    keep = slot >= 0  # (-1: padding; masked rather than returned from: this is inlined into callers)
    slot = tl.maximum(slot, 0)
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM) & keep
    k = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    dest = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + offs_h[:, None] * stride_ch \
        + offs_d[None, :]
    tl.store(k_cache_ptr + dest, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dest, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Write key[t] and value[t] to slot slot_mapping[t] of kv_cache (in place)."""
    check_write(key, value, kv_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=kv_cache.shape[2], num_warps=1)


def check_write(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Refuse a K/V write (reshape_and_cache, rotary's) whose tensors do not fit each other."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or kv_cache.dim() != 5 or tuple(kv_cache.shape[3:]) != (num_kv_heads, head_dim):
        raise ValueError(f"key/value {tuple(key.shape)}/{tuple(value.shape)} do not fit "
                         f"kv_cache {tuple(kv_cache.shape)}")
    if key.stride(2) != 1 or value.stride(2) != 1 or kv_cache.stride(4) != 1:
        raise ValueError("key, value and kv_cache must be contiguous in their last dim")
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")


def reshape_and_cache_ref(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
    """Plain torch: the same write, one block/offset pair per kept token."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = kv_cache.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[0, blocks, offsets] = key[keep].to(kv_cache.dtype)
    kv_cache[1, blocks, offsets] = value[keep].to(kv_cache.dtype)
