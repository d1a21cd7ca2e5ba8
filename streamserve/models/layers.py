"""The small ops of a Llama-family block, as torch reference code (the CPU path)."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm; with `residual`, adds it first and also returns the sum (the new residual)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[dict]) -> torch.Tensor:
    """Rotary inverse frequencies, with Llama-3-style or linear scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_scale(inv_freq, scaling)
    raise ValueError(f"rope scaling {kind!r} is not supported (supported: default, linear, llama3)")


def _llama3_scale(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves), cos/sin cached for every position."""

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: Optional[dict]) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.theta = theta
        self.scaling = scaling
        self.register_buffer("cos_sin_cache", torch.empty(0), persistent=False)

    def build_cache(self, device: torch.device, dtype: torch.dtype) -> None:
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling)
        t = torch.arange(self.max_position, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        # [max_position, 2, head_dim]: cos then sin, computed in float32 then cast (as HF does).
        self.cos_sin_cache = torch.stack((emb.cos(), emb.sin()), dim=1).to(device=device, dtype=dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hkv, D] -> rotated copies."""
        cos_sin = self.cos_sin_cache[positions]
        cos, sin = cos_sin[:, 0].unsqueeze(1), cos_sin[:, 1].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
