"""Neox-style rotary embedding (rotate halves, as Hugging Face Llama), applied to q and k in place.

positions      [T] int
q, k           [T, Hq, D] and [T, Hkv, D]; rows and heads may be strided (q and k are views
               into the fused qkv), the last dim contiguous
cos_sin_cache  [max_position, 2, R]: streamserve.models.layers.RotaryEmbedding.cos_sin_cache,
               [p, 0] = cos(p * f) and [p, 1] = (-sin(p * f), sin(p * f)) over the halves, with
               the inverse frequencies f already Llama-3 (or linearly, or YaRN) scaled; R <= D,
               the leading dims of each head that turn (a partial rotary: the rest stay)

x1, x2 = halves of x's first R dims:  x1' = x1 * cos - x2 * sin,  x2' = x2 * cos + x1 * sin
(in float32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from streamserve_kernels.cache import check_write, write_token


@triton.jit
def _rotate_heads(x_ptr, stride_h, num_heads, cos, sin_lo, sin_hi, offs, half_mask,
                  HALF: tl.constexpr, HEADS_PAD: tl.constexpr):
    heads = tl.arange(0, HEADS_PAD)
    mask = (heads[:, None] < num_heads) & half_mask[None, :]
    lo_ptr = x_ptr + heads[:, None] * stride_h + offs[None, :]
    x1 = tl.load(lo_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(lo_ptr + HALF, mask=mask, other=0.0).to(tl.float32)
    # sin_lo holds -sin (the signed cache), sin_hi +sin.
    tl.store(lo_ptr, (x1 * cos[None, :] + x2 * sin_lo[None, :]).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(lo_ptr + HALF, (x2 * cos[None, :] + x1 * sin_hi[None, :]).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(positions_ptr, q_ptr, k_ptr, cache_ptr, num_q_heads, num_k_heads,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_cp, stride_cs,
                   HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                   Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr):
    # One program per token: its cos/sin row is read once for all of its q and k heads.
    _rotate_token(tl.program_id(0).to(tl.int64), positions_ptr, q_ptr, k_ptr, cache_ptr, num_q_heads, num_k_heads,
                  stride_qt, stride_qh, stride_kt, stride_kh, stride_cp, stride_cs,
                  HALF, HALF_PAD, Q_HEADS_PAD, K_HEADS_PAD)


@triton.jit
def _rotary_cache_kernel(positions_ptr, q_ptr, k_ptr, v_ptr, cache_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                         num_q_heads, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_cp, stride_cs, stride_cb, stride_ct, stride_ch,
                         NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                         Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr):
    # One program per token: rotate its q and k heads in place, then write its k and v to its slot.
    token = tl.program_id(0).to(tl.int64)
    _rotate_token(token, positions_ptr, q_ptr, k_ptr, cache_ptr, num_q_heads, NUM_KV_HEADS,
                  stride_qt, stride_qh, stride_kt, stride_kh, stride_cp, stride_cs,
                  HALF, HALF_PAD, Q_HEADS_PAD, K_HEADS_PAD)
    tl.debug_barrier()  # (the rotated k, stored by some of the program's threads, is read by others)
    write_token(token, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ct, stride_ch,
                NUM_KV_HEADS, HEAD_DIM, K_HEADS_PAD, HEAD_DIM_PAD, BLOCK_SIZE)


@triton.jit
def _rotate_token(token, positions_ptr, q_ptr, k_ptr, cache_ptr, num_q_heads, num_k_heads,
                  stride_qt, stride_qh, stride_kt, stride_kh, stride_cp, stride_cs,
                  HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                  Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr):
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs = tl.arange(0, HALF_PAD)
    half_mask = offs < HALF
    row = cache_ptr + pos * stride_cp
    cos = tl.load(row + offs, mask=half_mask, other=0.0).to(tl.float32)
    sin_lo = tl.load(row + stride_cs + offs, mask=half_mask, other=0.0).to(tl.float32)
    sin_hi = tl.load(row + stride_cs + HALF + offs, mask=half_mask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, num_q_heads, cos, sin_lo, sin_hi, offs, half_mask,
                  HALF, Q_HEADS_PAD)
    _rotate_heads(k_ptr + token * stride_kt, stride_kh, num_k_heads, cos, sin_lo, sin_hi, offs, half_mask,
                  HALF, K_HEADS_PAD)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> None:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place by each token's position."""
    half = _check(q, k, cos_sin_cache)
    if q.shape[0] == 0:
        return
    num_q_heads = q.shape[1]
    _rotary_kernel[(q.shape[0],)](
        positions, q, k, cos_sin_cache, num_q_heads, k.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0), cos_sin_cache.stride(1),
        HALF=half, HALF_PAD=triton.next_power_of_2(half),
        Q_HEADS_PAD=triton.next_power_of_2(num_q_heads), K_HEADS_PAD=triton.next_power_of_2(k.shape[1]),
        num_warps=4)


def rotary_embedding_and_cache(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor,
                               slot_mapping: torch.Tensor) -> None:
    """rotary_embedding(positions, q, k, cos_sin_cache), then cache.reshape_and_cache(k, v,
    kv_cache, slot_mapping), in one launch: one program a token rotates its heads and writes
    its K and V to its slot."""
    half = _check(q, k, cos_sin_cache)
    check_write(k, v, kv_cache, slot_mapping)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _rotary_cache_kernel[(num_tokens,)](
        positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, num_q_heads,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0), cos_sin_cache.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=kv_cache.shape[2], HALF=half, HALF_PAD=triton.next_power_of_2(half),
        Q_HEADS_PAD=triton.next_power_of_2(num_q_heads), K_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        num_warps=4)


def _check(q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor) -> int:
    """The rotated half-width R / 2, once q, k and the cache are seen to fit."""
    num_tokens, num_q_heads, head_dim = q.shape
    if k.dim() != 3 or k.shape[0] != num_tokens or k.shape[2] != head_dim or head_dim % 2:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, H, D] with one even D")
    rotated = cos_sin_cache.shape[-1]
    if (cos_sin_cache.dim() != 3 or cos_sin_cache.shape[1] != 2 or rotated % 2 or not 0 < rotated <= head_dim
            or cos_sin_cache.stride(2) != 1):
        raise ValueError(f"cos_sin_cache must be [max_position, 2, R] with an even R <= {head_dim} "
                         f"(RotaryEmbedding.cos_sin_cache), got {tuple(cos_sin_cache.shape)}")
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError("q and k must be contiguous in their last dim")
    return rotated // 2


def rotary_embedding_ref(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """Plain torch, out of place, for one of q or k: [T, H, D] rotated over its first R dims
    (the cache's), in x's dtype."""
    rotated = cos_sin_cache.shape[-1]
    half = rotated // 2
    rows = cos_sin_cache[positions.long()].float()  # [T, 2, R]
    cos, sin = rows[:, 0, None, :half], rows[:, 1, None, half:]  # [T, 1, R/2], sin positive
    x1, x2 = x[..., :half].float(), x[..., half:rotated].float()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rotated:].float()), dim=-1).to(x.dtype)
