"""Paged attention with torch ops: the CPU backend.

The KV cache of one layer is a tensor [2, num_blocks, block_size, num_kv_heads, head_dim]
(K then V), in the compute dtype or float16 (--kv-cache-dtype; the CPU's default for a
16-bit checkpoint computed in float32), read back as float32. Token slot s lives at block s // block_size, offset s % block_size.

Each step's flat batch is ordered decodes first (one query token each), then
prefill chunks. Per layer:
  1. every scheduled token's K and V are written to its slot (before any read, so
     a request may read blocks another request writes in the same step);
  2. the decodes attend together: their blocks are gathered into one padded
     [B, L] context and masked past each sequence's length (or, in float32 where the
     C kernels load, read in place by models/csrc/cpu_kernels.c);
  3. each prefill chunk attends causally to its earlier tokens (from the cache)
     and to itself (or, where the C kernels load, all chunks at once, read in place).

A layer with a sliding window W (Mistral, Gemma 2 and 3) lets the query at position p see keys
p - W + 1 .. p; Gemma 2's scores go through cap * tanh(scores / cap) before the softmax, which
torch's fused attention cannot do, so its layers take the plain product (`_attend`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    query_start: int  # rows of the flat batch: [query_start, query_end)
    query_end: int
    num_computed_tokens: int  # context already in the cache before this chunk
    block_ids: torch.Tensor  # the blocks covering the whole sequence so far


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decodes: int
    decode_block_tables: Optional[torch.Tensor]  # [num_decodes, max_blocks] int64
    # [num_decodes, 1, 1, max_blocks * block_size] additive; None when no row needs masking
    decode_mask: Optional[torch.Tensor]
    prefills: list[PrefillChunk]  # each chunk, unless the C kernel takes them (prefill_seq_lens set)
    # [num_decodes] int64: set when the decodes go through the C kernel (which needs no mask)
    decode_seq_lens: Optional[torch.Tensor] = None
    # set when the prefill chunks go through the C kernel, as it takes them (int64): their rows
    # from the first after the decodes ([chunks + 1]), block tables and lengths after the step
    prefill_query_start_loc: Optional[torch.Tensor] = None
    prefill_block_tables: Optional[torch.Tensor] = None
    prefill_seq_lens: Optional[torch.Tensor] = None
    # per sliding window of the model's layers: decode_mask that also hides the keys before it
    decode_window_masks: Optional[dict[int, Optional[torch.Tensor]]] = None


class TorchPagedAttention:
    """The per-step attention callable the model calls once per layer."""

    def __init__(self, kv_caches: list[torch.Tensor], metadata: AttentionMetadata,
                 num_heads: int, num_kv_heads: int, head_dim: int, kernels=None, bf16_dot: bool = False,
                 scale: Optional[float] = None, windows: tuple[int, ...] = (), softcap: Optional[float] = None) -> None:
        """scale: the scores' (default head_dim ** -0.5); windows: each layer's sliding window
        (0: none), or () for none; softcap: the scores' tanh cap, if any."""
        self.kv_caches = kv_caches
        self.kernels = kernels  # models.cpu_kernels.CpuKernels, for the decodes with decode_seq_lens
        self.bf16_dot = bf16_dot  # whether the C prefill attention takes bfloat16 dot products
        self.meta = metadata
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.group = num_heads // num_kv_heads
        self.scale = scale if scale is not None else head_dim ** -0.5
        self.windows, self.softcap = windows, softcap
        self.window = 0  # the current layer's

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        cache = self.kv_caches[layer_idx]
        self.window = self.windows[layer_idx] if self.windows else 0
        write_kv(cache, k, v, self.meta.slot_mapping)
        nd, prefills = self.meta.num_decodes, self.meta.prefills
        if not prefills and self.meta.prefill_seq_lens is None:  # the common pure-decode step: no output to fill
            return self._decode(q, cache)
        out = torch.empty(q.shape[0], self.num_heads * self.head_dim, dtype=q.dtype, device=q.device)
        if nd:
            out[:nd] = self._decode(q[:nd], cache)
        if self.meta.prefill_seq_lens is not None:
            out[nd:] = self.kernels.paged_prefill_attention(
                q[nd:], cache, self.meta.prefill_query_start_loc, self.meta.prefill_block_tables,
                self.meta.prefill_seq_lens, self.scale, self.bf16_dot, self.window, self.softcap)
            return out
        for chunk in prefills:
            rows = slice(chunk.query_start, chunk.query_end)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], cache, chunk)
        return out

    def _decode(self, q: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        b = q.shape[0]
        tables = self.meta.decode_block_tables  # [B, nb], flattened for index_select
        if self.meta.decode_seq_lens is not None:
            return self.kernels.paged_decode_attention(q, cache, tables, self.meta.decode_seq_lens, self.scale,
                                                       self.window, self.softcap)
        # [B * nb, bs, Hkv, D] -> [B, Hkv, L, D]
        shape = (b, -1, self.num_kv_heads, self.head_dim)
        k = cache[0].index_select(0, tables.view(-1)).view(shape).transpose(1, 2).to(q.dtype)
        v = cache[1].index_select(0, tables.view(-1)).view(shape).transpose(1, 2).to(q.dtype)
        qh = q.reshape(b, self.num_heads, 1, self.head_dim)
        mask = self.meta.decode_window_masks[self.window] if self.window else self.meta.decode_mask
        return self._attend(qh, k, v, mask, False).reshape(b, self.num_heads * self.head_dim)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 cache: torch.Tensor, chunk: PrefillChunk) -> torch.Tensor:
        n = q.shape[0]
        ctx = chunk.num_computed_tokens
        if ctx == 0 and cache.dtype == q.dtype and (not self.window or n <= self.window):
            mask, causal = None, True
        else:
            # The whole sequence so far from the cache (this chunk was just written; read back
            # from a float16 cache even when it is the first, as every later read sees it).
            seq_len = ctx + n
            k = cache[0].index_select(0, chunk.block_ids).flatten(0, 1)[:seq_len].to(q.dtype)
            v = cache[1].index_select(0, chunk.block_ids).flatten(0, 1)[:seq_len].to(q.dtype)
            # Query j sits at position ctx + j and sees keys 0 .. ctx + j (from ctx + j - W + 1 in a window).
            mask = torch.ones(n, seq_len, dtype=torch.bool, device=q.device).tril(diagonal=ctx)
            if self.window:
                mask.triu_(diagonal=ctx - self.window + 1)
            causal = False
        # [1, H, n, D]: with a batch dimension torch runs its flash kernel on the CPU; without
        # one it fell back to the math path (a 512-token chunk: 27 -> 12 ms a layer)
        out = self._attend(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, causal)
        return out[0].transpose(0, 1).reshape(n, self.num_heads * self.head_dim)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                causal: bool) -> torch.Tensor:
        """q [B, Hq, n, D] over k, v [B, Hkv, L, D]; mask: boolean (True: seen) or additive."""
        if not self.softcap:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.scale,
                                                  enable_gqa=self.group > 1)
        if self.group > 1:
            k, v = k.repeat_interleave(self.group, 1), v.repeat_interleave(self.group, 1)
        # (the softmax in float32, as transformers' eager attention takes it)
        scores = torch.tanh((q @ k.transpose(-1, -2)).float().mul_(self.scale / self.softcap)).mul_(self.softcap)
        if causal:
            mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        if mask is not None and mask.dtype == torch.bool:
            scores.masked_fill_(~mask, float("-inf"))
        elif mask is not None:
            scores += mask
        return scores.softmax(-1).to(v.dtype) @ v


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store each token's K and V at its slot (reshape_and_cache). Into a float16 cache of a
    float32 step, values are held to float16's finite range first (as the C step writes them)."""
    if cache.dtype != k.dtype:
        top = torch.finfo(cache.dtype).max
        k, v = k.clamp(-top, top).to(cache.dtype), v.clamp(-top, top).to(cache.dtype)
    cache[0].view(-1, k.shape[1], k.shape[2]).index_copy_(0, slot_mapping, k)
    cache[1].view(-1, v.shape[1], v.shape[2]).index_copy_(0, slot_mapping, v)
