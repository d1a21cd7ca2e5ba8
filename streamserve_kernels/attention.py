"""Paged attention over the engine's KV cache: a mixed-batch kernel and a split-KV decode kernel.

Layouts (the same as streamserve/worker/attention.py):

  q               [T, Hq, D]    the step's flat batch; rows may be strided (a view into qkv),
                                the last dim must be contiguous
  kv_cache        [2, num_blocks, block_size, Hkv, D]   one layer, K then V; token slot s
                                lives at block s // block_size, offset s % block_size
  query_start_loc [B + 1] int   rows of sequence i: [query_start_loc[i], query_start_loc[i+1])
  seq_lens        [B] int       tokens of sequence i after this step (cached context + its query rows)
  block_tables    [B, max_blocks] int   physical blocks of each sequence, in order

Query row j of sequence i sits at position seq_lens[i] - query_len + j and sees keys
0 .. that position (with a sliding `window` W > 0, only the last W of them: position - W + 1 ..
position), its scores scaled by `scale` (and with `softcap` c > 0 mapped to c * tanh(score / c),
Gemma 2's): the context before the chunk comes from the cache, and the chunk's
own K/V must already have been written there (reshape_and_cache runs first). Query head h
reads KV head h // (Hq // Hkv).

Rows of q outside every sequence (padding at the end of a graph-captured batch) are never
written by `paged_attention`. A sequence with seq_len 0 in `paged_decode_attention` gets zeros.

With the engine's order (decodes first), a step can send its first num_decodes rows to
`paged_decode_attention` (split-KV, for long contexts) and the rest to `paged_attention` with
query_start_loc[num_decodes:], seq_lens[num_decodes:], block_tables[num_decodes:] and the
whole q and out: sequences may start at any row. `paged_attention` alone handles both kinds too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from streamserve_kernels.launch import let_next_launch, pdl

LOG2E = 1.4426950408889634


# -- shared device helpers ---------------------------------------------------------------------


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # The CPU interpreter (triton 3.9) multiplies bfloat16 tiles as their raw uint16 bits, so
    # there the operands go up to float32 first: exact, as bfloat16 values fit in float32.
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _attend_range(acc, m_i, l_i, q, q_pos, table_ptr, k_ptr, v_ptr, kv_start, kv_end,
                  stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, window, cap_log2e, offs_d, d_mask,
                  BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr,
                  PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Online softmax of the q tile [M, D] over keys [kv_start, kv_end), TILE_N at a time.

    k_ptr / v_ptr already point at this program's KV head; table_ptr at its block-table row.
    Scores are in log2 units (qk_scale includes log2(e); with SOFTCAP, qk_scale is scale / cap
    and the score is tanh of that times cap_log2e); m_i starts finite (-1e30), so a row that
    sees no key in a tile keeps p = 0 and alpha = 1 instead of turning into NaN. window > 0
    hides the keys at or before q_pos - window.
    """
    offs_n = tl.arange(0, TILE_N)
    for start in range(kv_start, kv_end, TILE_N):
        pos = start + offs_n
        in_range = pos < kv_end
        block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
        within = (pos % BLOCK_SIZE).to(tl.int64)
        # K as [D, TILE_N] so the scores are one dot; V as [TILE_N, D].
        k = tl.load(k_ptr + (block * stride_kb + within * stride_kt)[None, :] + offs_d[:, None],
                    mask=in_range[None, :] & d_mask[:, None], other=0.0)
        s = _dot(q, k, PRECISION, UPCAST) * qk_scale
        if SOFTCAP:  # tanh(x) as 2 sigmoid(2x) - 1
            s = (2.0 * tl.sigmoid(2.0 * s) - 1.0) * cap_log2e
        if CAUSAL:
            visible = in_range[None, :] & (pos[None, :] <= q_pos[:, None])
        else:
            visible = in_range[None, :] & (q_pos[:, None] >= 0)
        visible = visible & ((pos[None, :] > q_pos[:, None] - window) | (window == 0))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + (block * stride_vb + within * stride_vt)[:, None] + offs_d[None, :],
                    mask=in_range[:, None] & d_mask[None, :], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _find_seq(query_start_loc_ptr, q_tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose query tiles hold global tile q_tile.

    Sequence i's tiles start at query_start_loc[i] // BLOCK_Q + i: an upper bound on the tiles
    before it, so the grid (T // BLOCK_Q + B tiles) depends on the batch shape only.
    """
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= q_tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# -- mixed batch: prefill chunks and decodes in one launch -------------------------------------


@triton.jit
def _paged_attention_kernel(
        out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
        num_seqs, qk_scale, window, cap_log2e,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
        SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # One program: BLOCK_Q query tokens of one sequence x the GROUP query heads of one KV head,
    # as BLOCK_M = BLOCK_Q * GROUP (+ padding) rows, so every K/V tile is loaded once per group.
    q_tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, q_tile, num_seqs, BLOCK_Q)
    if seq < 0:  # a tile before the first sequence (query_start_loc[0] > 0: a slice of the batch)
        return
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tile_in_seq = q_tile - (q_start // BLOCK_Q + seq)
    if tile_in_seq * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    q_idx = tile_in_seq * BLOCK_Q + offs_m // GROUP  # query token within the chunk
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m // GROUP < BLOCK_Q) & (q_idx < q_len)
    q_pos = tl.where(row_ok, ctx_len + q_idx, -1)
    row = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_mask[None, :], other=0.0)

    # Keys up to the last query row of this tile (in a window, from the first row's first).
    kv_end = tl.minimum(seq_len, ctx_len + (tile_in_seq + 1) * BLOCK_Q)
    kv_start = 0
    if window > 0:
        kv_start = tl.maximum(ctx_len + tile_in_seq * BLOCK_Q - window + 1, 0)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend_range(
        acc, m_i, l_i, q, q_pos, block_tables_ptr + seq.to(tl.int64) * stride_bt,
        k_cache_ptr + kv_head * stride_kh, v_cache_ptr + kv_head * stride_vh, kv_start, kv_end,
        stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, window, cap_log2e, offs_d, d_mask,
        BLOCK_SIZE, TILE_N, True, SOFTCAP, PRECISION, UPCAST)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_mask[None, :])


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                    max_query_len: int, out: Optional[torch.Tensor] = None,
                    tile_n: Optional[int] = None, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Attention for one flat batch of prefill chunks and decodes (layouts: module docstring).

    `max_query_len` (a host int the runner knows) only picks the tile shape: 16-row tiles when
    every sequence is a decode, 64-row tiles otherwise. Returns `out` ([T, Hq, D], q's dtype);
    no allocation happens when it is given.
    """
    _check_layouts(q, kv_cache, block_tables)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    group = num_heads // num_kv_heads
    out = _output(q, out)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_m = max(16 if max_query_len <= 1 else 64, triton.next_power_of_2(group))
    block_q = block_m // group
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _paged_attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        num_seqs, *_score_args(scale, window, softcap),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_SIZE=block_size, TILE_N=tile_n or _tile_n(block_size),
        SOFTCAP=softcap > 0, PRECISION=_precision(q), UPCAST=q.device.type == "cpu", num_warps=4)
    return out


# -- decode with the KV range split across programs (flash-decoding) --------------------------


@dataclass
class DecodeWorkspace:
    """Scratch for split-KV decode, allocated once (so a captured graph can reuse it).

    partial_out [max_num_seqs, Hq, max_splits, D] float32: each split's normalised output;
    lse         [max_num_seqs, Hq, max_splits]    float32: its log2-sum-exp2 of the scores
                (-inf for a split that saw no key);
    arrived     [max_num_seqs, Hq]                int32: per (sequence, KV head), how many of its
                splits have written theirs (the last one merges them and sets it back to 0).
    """

    partial_out: torch.Tensor
    lse: torch.Tensor
    arrived: torch.Tensor

    @classmethod
    def allocate(cls, max_num_seqs: int, num_heads: int, head_dim: int, max_splits: int,
                 device: torch.device | str) -> "DecodeWorkspace":
        return cls(torch.empty(max_num_seqs, num_heads, max_splits, head_dim, dtype=torch.float32, device=device),
                   torch.empty(max_num_seqs, num_heads, max_splits, dtype=torch.float32, device=device),
                   torch.zeros(max_num_seqs, num_heads, dtype=torch.int32, device=device))

    @property
    def max_num_seqs(self) -> int:
        return self.lse.shape[0]

    @property
    def max_splits(self) -> int:
        return self.lse.shape[2]


def choose_num_splits(max_seq_len: int, num_seqs: int, num_kv_heads: int, max_splits: int,
                      tokens_per_split: int = 256, target_programs: int = 264) -> int:
    """Splits per sequence: enough programs to fill the GPU (about two per SM on an H100/H200),
    but no split shorter than `tokens_per_split`, and at most the workspace's `max_splits`.
    (On an H200, 2026-12-04, batch 64 of context 4096 on 8 KV heads, 512 programs in one split:
    run 6, with a second kernel merging splits, read its keys and values at 68% of the copy
    bandwidth in one split and 87% in two; run 8, the splits merged in the split kernel, at 80%
    in one and 70% in two. Four programs an SM, two splits there, was tried in runs 7 and 8.)"""
    by_length = -(-max_seq_len // tokens_per_split)
    by_occupancy = -(-target_programs // max(1, num_seqs * num_kv_heads))
    return max(1, min(max_splits, by_length, by_occupancy))


@triton.jit
def _decode_split_kernel(
        out_ptr, part_ptr, lse_ptr, arrived_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
        num_splits, qk_scale, window, cap_log2e,
        stride_qt, stride_qh, stride_ot, stride_oh,
        stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_at,
        stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_bt,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, SPLIT: tl.constexpr, SOFTCAP: tl.constexpr,
        PRECISION: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr, GROUP_PAD: tl.constexpr,
        SPLITS_PAD: tl.constexpr):
    let_next_launch(PDL)  # (the output projection reads its weight meanwhile: launch.py)
    # One program: one sequence's single query token x the GROUP heads of one KV head (rows
    # padded to BLOCK_M >= 16 for tl.dot) over one split of its keys. When split, the last of a
    # (sequence, KV head)'s programs to finish merges their outputs (no second launch).
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Each sequence splits the keys it sees (its last `window` in a window) into num_splits
    # tile-aligned pieces, so one grid (and one captured graph) serves any context length.
    first = 0
    if window > 0:
        first = tl.maximum(seq_len - window, 0)
    split_len = tl.cdiv(tl.cdiv(seq_len - first, num_splits), TILE_N) * TILE_N
    kv_start = first + split * split_len
    kv_end = tl.minimum(kv_start + split_len, seq_len)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    row_ok = offs_m < GROUP
    head = kv_head * GROUP + offs_m
    io_mask = row_ok[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + seq * stride_qt + head[:, None] * stride_qh + offs_d[None, :], mask=io_mask, other=0.0)
    q_pos = tl.where(row_ok, seq_len - 1, -1)

    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend_range(
        acc, m_i, l_i, q, q_pos, block_tables_ptr + seq * stride_bt,
        k_cache_ptr + kv_head * stride_kh, v_cache_ptr + kv_head * stride_vh, kv_start, kv_end,
        stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, 0, cap_log2e, offs_d, d_mask,
        BLOCK_SIZE, TILE_N, False, SOFTCAP, PRECISION, UPCAST)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if SPLIT:
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_ptr + seq * stride_pt + head[:, None] * stride_ph + split * stride_ps + offs_d[None, :],
                 out, mask=io_mask)
        tl.store(lse_ptr + seq * stride_lt + head * stride_lh + split, lse, mask=row_ok)
        # Every thread's stores, then one arrival (release: the stores before it are seen by the
        # program that acquires it last), as a grid-wide sync takes it.
        tl.debug_barrier()
        arrival = arrived_ptr + seq * stride_at + kv_head
        if tl.atomic_add(arrival, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
            tl.store(arrival, 0)  # (for the next launch, which starts after this one ends)
            _merge_splits(out_ptr, part_ptr, lse_ptr, seq, kv_head, num_splits, stride_ot, stride_oh, stride_pt,
                          stride_ph, stride_ps, stride_lt, stride_lh, GROUP, GROUP_PAD, HEAD_DIM, HEAD_DIM_PAD,
                          SPLITS_PAD)
    else:
        tl.store(out_ptr + seq * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _merge_splits(out_ptr, part_ptr, lse_ptr, seq, kv_head, num_splits, stride_ot, stride_oh, stride_pt,
                  stride_ph, stride_ps, stride_lt, stride_lh, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """out = sum_s 2^(lse_s - max) * partial_s / sum_s 2^(lse_s - max), for a KV head's GROUP
    query heads, every split read in one load [SPLITS_PAD, GROUP_PAD, HEAD_DIM_PAD] (one wait
    on L2, not one a split). The loads skip L1 (.cg): the other programs' stores reach L2, not
    this SM's L1."""
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    head = kv_head * GROUP + offs_g
    lse_mask = (offs_s[:, None] < num_splits) & (offs_g[None, :] < GROUP)
    lse = tl.load(lse_ptr + seq * stride_lt + head[None, :] * stride_lh + offs_s[:, None], mask=lse_mask,
                  other=float("-inf"), cache_modifier=".cg")
    part = tl.load(part_ptr + seq * stride_pt + head[None, :, None] * stride_ph + offs_s[:, None, None] * stride_ps
                   + offs_d[None, None, :], mask=lse_mask[:, :, None] & (offs_d < HEAD_DIM)[None, None, :],
                   other=0.0, cache_modifier=".cg")
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # no key at all (a padding sequence): zeros
    w = tl.exp2(lse - m[None, :])
    total = tl.sum(w, 0)
    merged = tl.sum(part * w[:, :, None], 0) / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(out_ptr + seq * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             merged.to(out_ptr.dtype.element_ty), mask=(offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :])


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, seq_lens: torch.Tensor,
                           block_tables: torch.Tensor, scale: float, num_splits: int,
                           workspace: Optional[DecodeWorkspace] = None, out: Optional[torch.Tensor] = None,
                           tile_n: Optional[int] = None, num_warps: int = 4, window: int = 0,
                           softcap: float = 0.0) -> torch.Tensor:
    """Decode attention, one query token per sequence: q [B, Hq, D] (row i is sequence i),
    seq_lens [B], block_tables [B, max_blocks]; returns out [B, Hq, D].

    Each sequence's keys are split into `num_splits` pieces (see choose_num_splits), merged
    with log-sum-exp through `workspace` by the last of each (sequence, KV head)'s programs.
    With `workspace` and `out` given the call allocates nothing and launches a grid fixed by
    (B, Hkv, num_splits): safe to capture in a CUDA graph. num_splits == 1 writes `out` directly, without the workspace.
    `num_warps` (and `tile_n`, the keys a program takes at once) are the split kernel's launch
    settings, there to be tuned (scripts/gpu_check.py times a few).
    """
    _check_layouts(q, kv_cache, block_tables)
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    group = num_heads // num_kv_heads
    out = _output(q, out)
    if num_seqs == 0:
        return out
    split = num_splits > 1
    if split and workspace is None:
        workspace = DecodeWorkspace.allocate(num_seqs, num_heads, head_dim, num_splits, q.device)
    if split and (num_seqs > workspace.max_num_seqs or num_splits > workspace.max_splits
                  or workspace.lse.shape[1] != num_heads or workspace.partial_out.shape[3] != head_dim
                  or workspace.arrived.shape != workspace.lse.shape[:2]):
        raise ValueError(f"decode workspace {tuple(workspace.partial_out.shape)} is too small for "
                         f"{num_seqs} sequences x {num_heads} heads x {num_splits} splits x head_dim {head_dim}")
    # (unused when not split)
    part, lse, arrived = (workspace.partial_out, workspace.lse, workspace.arrived) if split else (out, out, out)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    head_dim_pad = triton.next_power_of_2(head_dim)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        out, part, lse, arrived, q, k_cache, v_cache, block_tables, seq_lens,
        num_splits, *_score_args(scale, window, softcap),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        part.stride(0), part.stride(1), part.stride(2) if split else 0, lse.stride(0), lse.stride(1),
        arrived.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_M=max(16, triton.next_power_of_2(group)), BLOCK_SIZE=block_size,
        TILE_N=tile_n or _tile_n(block_size), SPLIT=split, SOFTCAP=softcap > 0,
        PRECISION=_precision(q), UPCAST=q.device.type == "cpu", PDL=pdl(q.device),
        GROUP_PAD=max(2, triton.next_power_of_2(group)), SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
        num_warps=num_warps)
    return out


def _score_args(scale: float, window: int, softcap: float) -> tuple[float, int, float]:
    """The kernels' (qk_scale, window, cap_log2e) for a scale, sliding window and soft cap."""
    if window < 0 or softcap < 0:
        raise ValueError(f"window ({window}) and softcap ({softcap}) must be >= 0")
    if softcap > 0:
        return scale / softcap, window, softcap * LOG2E
    return scale * LOG2E, window, 0.0


def _tile_n(block_size: int) -> int:
    return max(64, block_size)


def _precision(q: torch.Tensor) -> str:
    # float32 stays float32 (tl.dot would otherwise round its inputs to tf32).
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _output(q: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.stride(2) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} and contiguous in its last dim, got {tuple(out.shape)}")
    return out


def _check_layouts(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor) -> None:
    if q.dim() != 3 or kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"expected q [T, Hq, D] and kv_cache [2, blocks, block_size, Hkv, D], "
                         f"got {tuple(q.shape)} and {tuple(kv_cache.shape)}")
    if q.shape[1] % kv_cache.shape[3] or q.shape[2] != kv_cache.shape[4]:
        raise ValueError(f"q heads/head_dim {tuple(q.shape[1:])} do not fit the cache's "
                         f"{tuple(kv_cache.shape[3:])}")
    if q.stride(2) != 1 or kv_cache.stride(4) != 1 or block_tables.stride(1) != 1:
        raise ValueError("q, kv_cache and block_tables must be contiguous in their last dim")


# -- reference ---------------------------------------------------------------------------------


def paged_attention_ref(q: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                        window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Plain torch, one sequence at a time, in float32; rows outside every sequence are zero."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = starts[i], starts[i + 1]
        if hi == lo:
            continue
        blocks = block_tables[i, :math.ceil(seq_len / block_size)].long()
        k = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        v = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", q[lo:hi].float(), k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        q_pos = torch.arange(seq_len - (hi - lo), seq_len, device=q.device)
        keys = torch.arange(seq_len, device=q.device)[None, :]
        hidden = keys > q_pos[:, None]
        if window:
            hidden |= keys <= q_pos[:, None] - window
        probs = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)
        out[lo:hi] = torch.einsum("hqk,khd->qhd", probs, v)
    return out.to(q.dtype)
