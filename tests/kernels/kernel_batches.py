"""Random paged batches for the kernel tests, and how their outputs are compared."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from streamserve_kernels.cache import reshape_and_cache_ref

# Largest |kernel - reference| over largest |reference|.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).abs().max() / ref.abs().max()).item()


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


@dataclass
class PagedBatch:
    """One step: sequences given as (cached context, query rows), then `num_padding` padding rows.

    The KV cache is NaN everywhere no sequence has written, block 0 included (never handed
    out, so a masked table entry read as block 0 shows), so any read past a sequence's end
    turns its output into NaN. The context K/V is already in the cache; the step's own K/V
    (k, v, one row per query row) is written there only when the batch is made with
    `write_step_kv`.
    """

    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D]
    v: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, Hkv, D]
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int64, unused entries 0
    slot_mapping: torch.Tensor  # [T] int64, -1 on padding rows
    max_query_len: int
    num_real_tokens: int


def make_paged_batch(gen: torch.Generator, seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int,
                     head_dim: int, block_size: int, dtype: torch.dtype, device: str,
                     num_padding: int = 0, write_step_kv: bool = True) -> PagedBatch:
    blocks_per_seq = [math.ceil((ctx + n) / block_size) for ctx, n in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    # Blocks 1.. in a shuffled order, so a sequence's blocks are neither contiguous nor sorted.
    pool = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"),
                          dtype=dtype, device=device)
    tables = torch.zeros(len(seqs), max(blocks_per_seq) + 1, dtype=torch.int64)
    starts, slots, ks, vs = [0], [], [], []
    for i, ((ctx, n), nb) in enumerate(zip(seqs, blocks_per_seq)):
        tables[i, :nb] = torch.tensor([pool.pop() for _ in range(nb)])
        pos = torch.arange(ctx + n)
        seq_slots = (tables[i, pos // block_size] * block_size + pos % block_size).to(device)
        k = randn(gen, ctx + n, num_kv_heads, head_dim, dtype=dtype, device=device)
        v = randn(gen, ctx + n, num_kv_heads, head_dim, dtype=dtype, device=device)
        reshape_and_cache_ref(k[:ctx], v[:ctx], kv_cache, seq_slots[:ctx])
        starts.append(starts[-1] + n)
        slots.append(seq_slots[ctx:])
        ks.append(k[ctx:])
        vs.append(v[ctx:])
    slots.append(torch.full((num_padding,), -1, dtype=torch.int64, device=device))
    ks.append(randn(gen, num_padding, num_kv_heads, head_dim, dtype=dtype, device=device))
    vs.append(randn(gen, num_padding, num_kv_heads, head_dim, dtype=dtype, device=device))
    num_tokens = starts[-1] + num_padding
    batch = PagedBatch(
        q=randn(gen, num_tokens, num_heads, head_dim, dtype=dtype, device=device),
        k=torch.cat(ks), v=torch.cat(vs), kv_cache=kv_cache,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([ctx + n for ctx, n in seqs], dtype=torch.int32, device=device),
        block_tables=tables.to(device), slot_mapping=torch.cat(slots),
        max_query_len=max(n for _, n in seqs), num_real_tokens=starts[-1])
    if write_step_kv:
        reshape_and_cache_ref(batch.k, batch.v, kv_cache, batch.slot_mapping)
    return batch
