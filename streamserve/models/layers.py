"""The small ops of a Llama-family block, as torch reference code (the CPU path)."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from streamserve.models.cpu_kernels import pack_quantized, pack_weight, packed_rows, release_freed_memory
from streamserve.models.quantized import BLOCKS

if TYPE_CHECKING:
    from streamserve.lora.step import LoRAStep


class RMSNorm(nn.Module):
    """RMSNorm; with `residual`, adds it first and also returns the sum (the new residual). A
    float32 weight on a lower-precision input scales in float32 and rounds once (Gemma's)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        # streamserve_kernels.norm on the Triton path, the C kernel (cpu_kernels.py) on the CPU
        self.kernels = None

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if self.kernels is not None:  # one fused kernel; with a residual, in place on both
            if residual is None:
                return self.kernels.rms_norm(x, self.weight, self.eps)
            return self.kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
            residual = x
        if x.dtype == torch.float32:
            # rsqrt(mean(x^2) + eps) as sqrt(n) * rsqrt(sum(x^2) + n * eps): five small ops,
            # where F.rms_norm's composite CPU path runs a dozen.
            n = x.shape[-1]
            scale = torch.linalg.vecdot(x, x).unsqueeze(-1).add_(n * self.eps).rsqrt_().mul_(n ** 0.5)
            out = (x * scale).mul_(self.weight)
        else:  # normalise in float32, scale in the model dtype (as Hugging Face does for Llama) ...
            normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
            if self.weight.dtype == torch.float32:  # ... or, Gemma's (1 + w) kept so, in float32
                out = (normed * self.weight).to(x.dtype)
            else:
                out = self.weight * normed.to(x.dtype)
        return out if residual is None else (out, residual)


class Linear(nn.Module):
    """A linear layer that may also keep other copies of its weight, read in its place by the
    steps that pass `low_precision` (`ForwardContext.low_precision`; the runner decides which).

    On the CPU with the C kernels (cpu_kernels.py), the weight is packed in panels (`packed`,
    in the checkpoint's dtype: bfloat16 copies of a bfloat16 checkpoint, which computes in
    float32) and `gemm` reads it for inputs of up to `packed_max_rows` rows: every step, unless
    the CPU has native half-precision GEMMs (AMX), whose torch GEMMs then read a row-major
    half-size copy (`low_precision_weight`) for the larger steps. Without the C kernels, a
    half-size row-major copy serves torch for steps of a few tokens, which are bound by reading
    the weights. A layer loaded from a GGUF file may also keep its blocks (`quantized`),
    smaller still, read by the quantized GEMV for up to `quant_max_rows` rows. On the GPU, a
    one-row input may go to `gemv` (the runner sets it where the Triton kernel beats torch's).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.low_precision_weight: Optional[torch.Tensor] = None
        self.packed = None  # models.cpu_kernels.PackedWeight
        self.gemm: Optional[Callable] = None
        self.packed_max_rows = 0
        self.quantized = None  # models.cpu_kernels.PackedQuant
        self.quant_gemv: Optional[Callable] = None
        self.quant_max_rows = 0
        self.gemv: Optional[Callable] = None  # (x, weight, bias) for one-row inputs (GPU: streamserve_kernels.gemv)
        self.lora_key = ""  # its name in the model: a LoRA adapter's weights for it are kept under it

    def keep_copies(self, dtype: torch.dtype, gemm=None, packed_max_rows: int = 0, row_major: bool = True,
                    drop_full: bool = False) -> None:
        """Keep `dtype` copies of the weight: packed for `gemm(x, packed)` (cpu_kernels:
        CpuKernels.gemm) for inputs of at most `packed_max_rows` rows when `gemm` is given, and
        row-major for torch when `row_major`; with `drop_full`, only the copies (every call must
        then pass low_precision). A layer that holds only quantized blocks keeps none."""
        if self.only_quantized:
            return
        copy = self.weight.detach().to(dtype)
        if gemm is not None:
            self.packed, self.gemm, self.packed_max_rows = pack_weight(copy), gemm, packed_max_rows
        self.low_precision_weight = copy.contiguous() if row_major else None
        if drop_full:
            self.weight = nn.Parameter(torch.empty(0), requires_grad=False)
            del copy  # (the weight itself where it was in `dtype` already: let it go before the trim)
            release_freed_memory()  # (layer by layer: the copies do not pile up on the weights' freed pages)

    def keep_quantized(self, weight, gemv, max_rows: int, only: bool = False) -> None:
        """Read `weight` (a QuantizedWeight of this layer's shape), packed for `gemv(x, packed)`
        (cpu_kernels: pack_quantized, CpuKernels.quant_gemv), for low-precision inputs of at most
        `max_rows` rows; with `only`, for every low-precision input, in place of the weight and
        any copy of it (which go: the layer then holds the blocks' bytes alone)."""
        blocks, (_, block_bytes) = weight.blocks, BLOCKS[weight.kind]
        if (blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_contiguous()
                or blocks.shape[1] % block_bytes or weight.shape != (self.out_features, self.in_features)):
            raise ValueError(f"{weight.kind} blocks {blocks.dtype} {tuple(blocks.shape)} do not hold a "
                             f"{(self.out_features, self.in_features)} layer's weight")
        self.quantized, self.quant_gemv, self.quant_max_rows = pack_quantized(weight), gemv, max_rows
        if only:
            self.quant_max_rows = sys.maxsize
            self.weight = nn.Parameter(torch.empty(0), requires_grad=False)
            self.packed = self.low_precision_weight = None
            release_freed_memory()

    @property
    def only_quantized(self) -> bool:
        """Whether the layer holds its quantized blocks alone (keep_quantized's `only`)."""
        return self.quantized is not None and self.packed is None and self.weight.numel() == 0

    def replace_copies(self, replace: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Put `replace(t)` (the same values, held elsewhere) in place of each copy t it keeps:
        packed, quantized, row-major, in that order."""
        if self.packed is not None:
            self.packed = self.packed._replace(panels=replace(self.packed.panels))
        if self.quantized is not None:
            self.quantized = self.quantized._replace(rows=replace(self.quantized.rows))
        if self.low_precision_weight is not None:
            self.low_precision_weight = replace(self.low_precision_weight)

    def forward(self, x: torch.Tensor, low_precision: bool = False) -> torch.Tensor:
        if low_precision:
            rows, w = x.shape[0], self.low_precision_weight
            if self.quantized is not None and rows <= self.quant_max_rows and x.dtype == torch.float32:
                out = self.quant_gemv(x, self.quantized)
            elif self.packed is not None and rows <= self.packed_max_rows and x.dtype == torch.float32:
                out = self.gemm(x, self.packed)
            elif w is not None:
                out = F.linear(x.to(w.dtype), w).to(x.dtype)
            else:
                out = None
            if out is not None:
                return out if self.bias is None else out + self.bias
        if self.weight.numel() == 0:
            raise RuntimeError("this layer keeps only copies of its weight: call it with low_precision")
        if self.gemv is not None and x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous():
            return self.gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class PackedEmbedding(nn.Module):
    """A tied embedding read from its head's packed copy (Linear.packed): the same values as
    the checkpoint's (the copy is in its dtype), so its float32 weight need not be kept. `rows`:
    the lookup (CpuKernels.packed_rows, in C), else torch's indexing (cpu_kernels.packed_rows)."""

    def __init__(self, packed, rows: Optional[Callable] = None) -> None:
        super().__init__()
        self.packed = packed
        self.rows = rows or packed_rows

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.rows(self.packed, input_ids)


class UpcastEmbedding(nn.Embedding):
    """An embedding held in a checkpoint's 16-bit dtype whose rows come out in `dtype` (the
    float32 the CPU computes in): the same values as a float32 copy's, in half its memory."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__(weight.shape[0], weight.shape[1], _weight=weight)
        self.weight.requires_grad_(False)
        self.out_dtype = dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight).to(self.out_dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


# LlamaArch.hidden_act -> the MLP's gate (GELU exact, or its tanh form: Gemma's)
GATES = {"silu": silu_and_mul, "gelu": gelu_and_mul, "gelu_tanh": gelu_tanh_and_mul}


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[dict]) -> torch.Tensor:
    """Rotary inverse frequencies, with Llama-3-style, linear or YaRN scaling."""
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    inv_freq = 1.0 / pos_freqs
    kind = rope_kind(scaling)
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_scale(inv_freq, scaling)
    if kind == "yarn":
        return _yarn_scale(pos_freqs, head_dim, theta, scaling)
    if kind == "longrope":  # its short factors: the context is the original one (context_length)
        return 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * pos_freqs)
    raise ValueError(f"rope scaling {kind!r} is not supported (supported: default, linear, llama3, yarn, longrope)")


def rope_kind(scaling: Optional[dict]) -> str:
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    return "longrope" if kind == "su" else kind  # (Phi-3's first configs' name for it)


def rope_attention_factor(scaling: Optional[dict]) -> float:
    """What YaRN and LongRoPE multiply the rotary cos and sin by (so each score by its square):
    the config's attention_factor, else YaRN's 0.1 ln(factor) + 1, or with DeepSeek's mscale and
    mscale_all_dim the ratio of two such, and LongRoPE's sqrt(1 + ln(factor) / ln(original
    context)); 1 for the other kinds (transformers' rules)."""
    kind = rope_kind(scaling)
    if kind not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if kind == "longrope":
        factor = float(scaling["factor"])
        return math.sqrt(1 + math.log(factor) / math.log(scaling["original_max_position_embeddings"])) \
            if factor > 1 else 1.0
    factor, mscale, mscale_all_dim = float(scaling["factor"]), scaling.get("mscale"), scaling.get("mscale_all_dim")

    def get(m: float = 1.0) -> float:
        return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0
    return get(mscale) / get(mscale_all_dim) if mscale and mscale_all_dim else get()


def _yarn_scale(pos_freqs: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN's frequencies (pos_freqs: theta ** (2i / head_dim), the unscaled ones' inverses): the fastest
    dimensions as they were, the slowest divided by the factor, a linear ramp between the
    dimensions that turn beta_fast and beta_slow times over the original context (computed as
    transformers does, so that the tables agree)."""
    factor, original = float(scaling["factor"]), scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_turning(turns: float) -> float:  # the dimension whose frequency turns `turns` times
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_turning(beta_fast), dim_turning(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # the share of each dimension's own frequency
    return 1.0 / (factor * pos_freqs) * (1 - kept) + 1.0 / pos_freqs * kept


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
    """Neox-style rotary embedding (rotate halves), cos/sin cached for every position, over the
    leading `head_dim` dims of each head (fewer than the head's own for a partial rotary)."""

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: Optional[dict]) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.theta = theta
        self.scaling = scaling
        self.register_buffer("cos_sin_cache", torch.empty(0), persistent=False)
        self.kernel = None  # streamserve_kernels.rotary.rotary_embedding on the Triton path

    def build_cache(self, device: torch.device, dtype: torch.dtype) -> None:
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling)
        t = torch.arange(self.max_position, dtype=torch.int64).float()
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        # rotate_half(x) * sin == roll(x, D/2) * sin_signed, with the first half of sin negated.
        sin_signed = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
        factor = rope_attention_factor(self.scaling)  # (YaRN's; 1 for the rest)
        cos_sin = torch.stack((emb.cos() * factor, sin_signed * factor), dim=1)
        # [max_position, 2, head_dim], computed in float32 then cast (as Hugging Face does).
        self.cos_sin_cache = cos_sin.to(device=device, dtype=dtype)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token cos and signed sin, [T, 1, D] each: computed once per step."""
        cos_sin = self.cos_sin_cache[positions]
        return cos_sin[:, 0].unsqueeze(1), cos_sin[:, 1].unsqueeze(1)

    def for_step(self, positions: torch.Tensor) -> "Rotate":
        """rotate(qk [T, Hq + Hkv, D], Hq) -> qk rotated by this step's positions."""
        if self.kernel is not None:
            return KernelRotate(self.kernel, positions, self.cos_sin_cache)
        cos, sin = self.cos_sin(positions)  # once per step, shared by every layer
        return lambda qk, num_q_heads: apply_rotary(qk, cos, sin)


class KernelRotate(NamedTuple):
    """A step's rotary through the Triton kernel (in place): what an attention backend that
    rotates as it writes the cache takes instead (ForwardContext.attend)."""

    kernel: Callable
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor

    def __call__(self, qk: torch.Tensor, num_q_heads: int) -> torch.Tensor:
        self.kernel(self.positions, qk[:, :num_q_heads], qk[:, num_q_heads:], self.cos_sin_cache)
        return qk


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] -> x * cos + rotate_half(x) * sin, over the leading R dims of each head where
    cos and sin are [T, 1, R] (a partial rotary: the rest pass as they are)."""
    rotated = cos.shape[-1]
    if rotated < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rotated], cos, sin_signed), x[..., rotated:]), -1)
    return torch.addcmul(x * cos, x.roll(rotated // 2, dims=-1), sin_signed)


# attention(layer_idx, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq * D]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# rotate(qk [T, Hq + Hkv, D], Hq) -> qk with rotary embedding applied (RotaryEmbedding.for_step)
Rotate = Callable[[torch.Tensor, int], torch.Tensor]


@dataclass
class ForwardContext:
    """What one step's forward pass needs besides the tokens, passed to every layer
    (no module state outlives the step)."""

    attention: AttentionFn
    rotate: Rotate
    low_precision: bool = False
    lora: Optional["LoRAStep"] = None  # the step's LoRA adapters (lora/step.py), if any
    rotate_local: Optional[Rotate] = None  # Gemma 3's windowed layers' rotary (their own base)

    def attend(self, layer_idx: int, qk: torch.Tensor, v: torch.Tensor, num_q_heads: int,
               rotate: Optional[Rotate]) -> torch.Tensor:
        """Attention over q and k (qk [T, Hq + Hkv, D]) rotated by `rotate` (None: as they are)
        and v; where the backend rotates as it writes the cache (rotate_and_attend, the Triton
        path's), one kernel does both."""
        fused = getattr(self.attention, "rotate_and_attend", None)
        if isinstance(rotate, KernelRotate) and fused is not None:
            return fused(layer_idx, qk[:, :num_q_heads], qk[:, num_q_heads:], v, rotate.positions,
                         rotate.cos_sin_cache)
        if rotate is not None:
            qk = rotate(qk, num_q_heads)
        return self.attention(layer_idx, qk[:, :num_q_heads], qk[:, num_q_heads:], v)

    def linear(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        """layer(x), and the step's adapters of that layer added to their requests' rows."""
        out = layer(x, self.low_precision)
        return out if self.lora is None else self.lora.add(layer.lora_key, x, out)
