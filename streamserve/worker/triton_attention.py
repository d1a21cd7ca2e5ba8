"""Paged attention with the Triton kernels of streamserve_kernels: the GPU backend.

Same contract as TorchPagedAttention (attention.py): one callable per step, called once
per layer with that layer's q, k, v; the cache layout is the same. Per layer:
  1. reshape_and_cache writes every scheduled token's K and V to its slot (slot -1,
     a padding row of a CUDA graph, writes nothing); or, through rotate_and_attend, the
     rotary kernel rotates q and k and writes them in the same launch;
  2. the decode rows (first in the batch) go to the split-KV decode kernel, which
     reduces its splits through a workspace allocated once, so it can be captured;
  3. the prefill chunks go to the mixed-batch kernel, causal within each chunk and
     reading the earlier part of the sequence from the cache.
Importing this module imports no triton (the CPU path never does); the first
TritonPagedAttention does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch



@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, -1 for a padding row
    query_start_loc: torch.Tensor  # [B + 1] int32: sequence i owns rows [qsl[i], qsl[i+1])
    seq_lens: torch.Tensor  # [B] int32: cached context + this step's rows (0: padding)
    block_tables: torch.Tensor  # [B, max_blocks] int32
    num_decodes: int  # the first num_decodes sequences have one row each
    max_query_len: int  # the longest prefill chunk (1 when there is none)
    num_splits: int  # KV splits per decode sequence


class TritonPagedAttention:
    def __init__(self, kv_caches: list[torch.Tensor], metadata: TritonAttentionMetadata,
                 num_heads: int, num_kv_heads: int, head_dim: int, workspace, scale: Optional[float] = None,
                 windows: tuple[int, ...] = (), softcap: Optional[float] = None) -> None:
        """scale, windows, softcap: as TorchPagedAttention takes them."""
        from streamserve_kernels import attention, cache, rotary

        self.write, self.mixed, self.decode = (cache.reshape_and_cache, attention.paged_attention,
                                               attention.paged_decode_attention)
        self.rotate_write = rotary.rotary_embedding_and_cache
        self.kv_caches = kv_caches
        self.meta = metadata
        self.num_heads, self.head_dim = num_heads, head_dim
        self.scale = scale if scale is not None else head_dim ** -0.5
        self.windows, self.softcap = windows, softcap or 0.0
        self.workspace = workspace

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.write(k, v, self.kv_caches[layer_idx], self.meta.slot_mapping)
        return self._attend(layer_idx, q)

    def rotate_and_attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
        """As a call, q and k first rotated (in place) by the rotary kernel, which also writes the
        cache: one launch where there were two (ForwardContext.attend)."""
        self.rotate_write(positions, q, k, v, cos_sin_cache, self.kv_caches[layer_idx], self.meta.slot_mapping)
        return self._attend(layer_idx, q)

    def _attend(self, layer_idx: int, q: torch.Tensor) -> torch.Tensor:
        """Attention over the cache, this step's K and V written to it."""
        cache, meta = self.kv_caches[layer_idx], self.meta
        num_tokens, nd = q.shape[0], meta.num_decodes
        window = self.windows[layer_idx] if self.windows else 0
        out = torch.empty(num_tokens, self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        if nd:
            self.decode(q[:nd], cache, meta.seq_lens[:nd], meta.block_tables[:nd], self.scale,
                        meta.num_splits, self.workspace, out=out[:nd], window=window, softcap=self.softcap)
        if num_tokens > nd:
            self.mixed(q, cache, meta.query_start_loc[nd:], meta.seq_lens[nd:], meta.block_tables[nd:],
                       self.scale, meta.max_query_len, out=out, window=window, softcap=self.softcap)
        return out.view(num_tokens, self.num_heads * self.head_dim)
