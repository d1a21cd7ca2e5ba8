"""The Llama family (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 1-3, SmolLM3, Granite, OLMo 2) as one
module, for a flat token batch.

Inputs are one flat batch of tokens from many requests (no padding between
them). Attention is whatever callable the runner passes in for the step: it
writes this layer's K/V into the paged cache and attends over it, so the model
itself holds no per-step state.

Weights are fused where the checkpoint keeps them apart: q/k/v into one
`qkv_proj` and gate/up into one `gate_up_proj`, so a layer is four GEMMs (Phi-3's
checkpoints store them fused so already).

Gemma differs in small ways, each a field of LlamaArch: its norms scale by (1 + weight) (folded
into the weights as they load), its embedding is scaled by sqrt(hidden), its MLP is GELU-gated;
Gemma 2 and 3 add a norm after attention and around the MLP (`sandwich_norms`), their own
attention scale, sliding-window layers (`layer_windows`, Gemma 3's with their own rotary base),
and Gemma 2 tanh soft-caps its attention scores and final logits. SmolLM3 leaves every fourth
layer's q and k unrotated (`rotary_layers`); Granite multiplies its embedding, its attention
scores and its residual branches by constants, and divides its logits by one. OLMo 2 norms
attention's and the MLP's outputs rather than their inputs, and q and k over all heads at once.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Union

import torch
from torch import nn

from streamserve.models.layers import (GATES, AttentionFn, ForwardContext, Linear, PackedEmbedding, RMSNorm,
                                       RotaryEmbedding, rope_kind)
from streamserve.lora.adapter import LoRATarget
from streamserve.lora.step import LoRAStep
from streamserve.models.quantized import QuantizedWeight

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LlamaArch:
    """The shape of a checkpoint, read from its config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    o_bias: bool = False  # Llama's and Qwen3's attention_bias (Qwen2's covers q, k and v only)
    mlp_bias: bool = False
    hidden_act: str = "silu"  # the gate's activation: silu, or gelu (exact) or gelu_tanh (Gemma)
    norm_offset: bool = False  # the checkpoint's norms scale by 1 + weight (Gemma)
    embed_scale: float = 1.0  # the embedding's rows times this (Gemma: sqrt(hidden))
    sandwich_norms: bool = False  # norms after attention and before and after the MLP (Gemma 2, 3)
    attn_scale: Optional[float] = None  # the scores' scale, if not head_dim ** -0.5
    layer_windows: tuple[int, ...] = ()  # per layer: the keys it sees (0: all), or () for all layers
    local_rope_theta: Optional[float] = None  # the rotary base of the windowed layers, if their own (Gemma 3)
    attn_softcap: Optional[float] = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: Optional[float] = None  # the same for the logits
    rotary_layers: tuple[bool, ...] = ()  # per layer: whether it rotates q and k, or () for all (SmolLM3's)
    residual_scale: float = 1.0  # attention's and the MLP's outputs times this as they join the residual (Granite)
    logits_scaling: float = 1.0  # the logits divided by this (Granite)
    rotary_dim: int = 0  # the leading dims of each head the rotary turns, or 0 for all (Phi-4-mini's 3/4)
    qk_norm_whole: bool = False  # q and k each normed over all their heads at once, not head by head (OLMo 2)
    post_norms: bool = False  # norms after attention and the MLP, none before (OLMo 2)

    @classmethod
    def from_hf_config(cls, cfg: dict, qkv_bias: bool = False, qk_norm: bool = False, gemma: int = 0,
                       windowed: Union[bool, str] = True, nope: bool = False, granite: bool = False,
                       olmo2: bool = False, olmo3: bool = False) -> "LlamaArch":
        """`gemma`: the Gemma generation (1-3) the checkpoint is, else 0; `windowed`: whether the
        architecture reads config.json's sliding_window (False: ignores it; "opt_in": only with
        use_sliding_window, as Qwen's); `nope`: some layers rotate nothing (SmolLM3's
        no_rope_layers); `granite`: Granite's multipliers of the embedding, the attention scores
        and the residual branches, and its logits' divisor; `olmo2`: OLMo 2's norms (q and k
        normed whole; attention's and the MLP's outputs normed, their inputs not); `olmo3`: OLMo 3's
        windows (every fourth layer full), whose layers rotate by the base unscaled, the full
        layers alone by config.json's scaling."""
        heads = cfg["num_attention_heads"]
        rope_params = cfg.get("rope_parameters") or {}
        local_theta = None
        if "full_attention" in rope_params:  # one set per layer type (transformers 5's Gemma 3)
            local_theta = (rope_params.get("sliding_attention") or {}).get("rope_theta")
            rope_params = rope_params["full_attention"] or {}
        elif gemma == 3:
            local_theta = cfg.get("rope_local_base_freq", 10000.0)
            rope_params = {"rope_theta": 1000000.0, **rope_params}  # (Gemma3TextConfig's default)
        scaling = cfg.get("rope_scaling") or (rope_params if rope_kind(rope_params) != "default" else None)
        if rope_kind(scaling) in ("yarn", "longrope"):  # (transformers' defaults: the context the config names)
            scaling = {**scaling, "original_max_position_embeddings": original_context(cfg, scaling)}
        if rope_kind(scaling) == "longrope" and not scaling.get("factor"):  # (its attention factor's)
            scaling["factor"] = cfg.get("max_position_embeddings", 2048) / scaling["original_max_position_embeddings"]
        theta = cfg.get("rope_theta") or rope_params.get("rope_theta") or (500000.0 if olmo3 else 10000.0)
        if olmo3 and local_theta is None:  # (a config.json of one rope_scaling: the windowed layers' is plain)
            local_theta = theta
        if gemma:  # transformers' Gemma runs GELU's tanh form where a config says "gelu" (Gemma 1's do)
            act = cfg.get("hidden_activation") or (cfg.get("hidden_act") if gemma == 1 else None) or "gelu_tanh"
            act = "gelu_tanh" if act == "gelu" else act
        else:
            act = cfg.get("hidden_act") or "silu"
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        partial = cfg.get("partial_rotary_factor") or (scaling or rope_params).get("partial_rotary_factor") or 1.0
        rotary_dim = int(head_dim * partial)
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"partial_rotary_factor {partial} turns {rotary_dim} of the head's {head_dim} dims: "
                             "streamserve rotates an even number, at least 2")
        scalar = cfg.get("query_pre_attn_scalar") if gemma >= 2 else None
        if gemma >= 2:
            cfg = {"sliding_window": 4096, **cfg}  # (Gemma2Config's and Gemma3TextConfig's default)
        if olmo3:
            cfg = {"sliding_window": 4096, "rms_norm_eps": 1e-5, **cfg}  # (Olmo3Config's defaults)
        if nope and cfg.get("use_sliding_window") and not cfg.get("layer_types"):
            # (SmolLM3Config's: the layers without rotary are the windowed ones)
            cfg = {**cfg, "layer_types": ["full_attention" if r else "sliding_attention"
                                          for r in (rotary_layers(cfg) or [True] * cfg["num_hidden_layers"])]}
        every = 2 if gemma == 2 else 6 if gemma == 3 else 4 if olmo3 else 0
        windows = sliding_windows(cfg, every, windowed == "opt_in") \
            if windowed else ()
        fields = dict(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position=context_length(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias or bool(cfg.get("attention_bias", False)),
            qk_norm=qk_norm or olmo2,
            qk_norm_whole=olmo2,
            post_norms=olmo2,
            o_bias=bool(cfg.get("attention_bias", False)) and not qkv_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            hidden_act=ACTIVATIONS.get(act, act),
            norm_offset=gemma > 0,
            embed_scale=cfg["hidden_size"] ** 0.5 if gemma else 1.0,
            sandwich_norms=gemma >= 2,
            attn_scale=float(scalar) ** -0.5 if scalar else None,
            layer_windows=windows,
            local_rope_theta=float(local_theta) if local_theta and any(windows) else None,
            attn_softcap=cfg.get("attn_logit_softcapping") if gemma else None,
            final_softcap=cfg.get("final_logit_softcapping") if gemma else None,
            rotary_layers=rotary_layers(cfg) if nope else (),
            rotary_dim=rotary_dim if rotary_dim < head_dim else 0,
        )
        if granite:
            fields.update(cls._granite(cfg))
        return cls(**fields)

    @staticmethod
    def _granite(cfg: dict) -> dict:
        """Granite's multipliers (GraniteConfig's defaults: 1)."""
        return dict(embed_scale=float(cfg.get("embedding_multiplier", 1.0)),
                    attn_scale=float(cfg.get("attention_multiplier", 1.0)),
                    residual_scale=float(cfg.get("residual_multiplier", 1.0)),
                    logits_scaling=float(cfg.get("logits_scaling", 1.0)))

    @property
    def scale(self) -> float:
        """The attention scores' scale."""
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    def window(self, layer_idx: int) -> int:
        """The keys layer `layer_idx` attends to before each query's own position and it (0: all)."""
        return self.layer_windows[layer_idx] if self.layer_windows else 0

    @property
    def rotated_dims(self) -> int:
        """The leading dims of each head the rotary turns."""
        return self.rotary_dim or self.head_dim

    def rotates(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` rotates its queries and keys (SmolLM3's every fourth does not)."""
        return self.rotary_layers[layer_idx] if self.rotary_layers else True


# config.json's activation names the gates compute -> the gate (layers.GATES; GELU's tanh form
# goes by three names)
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
               "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh"}


def sliding_windows(cfg: dict, every: int, opt_in: bool = False) -> tuple[int, ...]:
    """Each layer's sliding window (0 for a full-attention layer), or () when none has one: as
    config.json's layer_types say, else every `every`-th layer full (Gemma 2: 2, Gemma 3: 6), else
    Qwen2's layers from max_window_layers on (where use_sliding_window), else all (Mistral, Phi-3).
    `opt_in` (Qwen's): none unless use_sliding_window."""
    window = cfg.get("sliding_window")
    n = cfg["num_hidden_layers"]
    if not window or cfg.get("use_sliding_window") is False or (opt_in and not cfg.get("use_sliding_window")):
        return ()
    window = int(window)
    types = cfg.get("layer_types")
    if types:
        if len(types) != n:
            raise ValueError(f"layer_types names {len(types)} layers, the model has {n}")
        windows = [window if kind == "sliding_attention" else 0 for kind in types]
    elif every or cfg.get("sliding_window_pattern"):
        every = cfg.get("sliding_window_pattern") or every
        windows = [0 if (i + 1) % every == 0 else window for i in range(n)]
    elif "max_window_layers" in cfg:  # Qwen2's: windows only with use_sliding_window
        if not cfg.get("use_sliding_window"):
            return ()
        windows = [window if i >= cfg["max_window_layers"] else 0 for i in range(n)]
    else:
        windows = [window] * n
    return tuple(windows) if any(windows) else ()


def context_length(cfg: dict) -> int:
    """The longest sequence config.json allows: max_position_embeddings, or with YaRN scaling
    its original context times its factor (vLLM's rule), or with LongRoPE its original context
    (streamserve runs its short factors, which transformers runs up to there: past it,
    transformers turns to the long factors for the whole sequence, which a paged cache written
    under the short ones cannot follow)."""
    length = int(cfg.get("max_position_embeddings") or 2048)
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    rope = rope.get("full_attention", rope)  # (one set per layer type: the full layers')
    if rope_kind(rope) == "yarn" and rope.get("factor"):
        length = int(float(original_context(cfg, rope)) * float(rope["factor"]))
    elif rope_kind(rope) == "longrope":
        length = min(length, int(original_context(cfg, rope)))
    return length


def original_context(cfg: dict, rope: dict) -> int:
    """The context a scaled rotary was trained for: its original_max_position_embeddings, or
    config.json's (Phi-3 keeps it there), or max_position_embeddings."""
    return (rope.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
            or cfg.get("max_position_embeddings") or 2048)


def rotary_layers(cfg: dict) -> tuple[bool, ...]:
    """SmolLM3's layers that rotate q and k: as config.json's no_rope_layers flags them (1:
    rotates), else all but every no_rope_layer_interval-th (4); () when all do."""
    n = cfg["num_hidden_layers"]
    flags = cfg.get("no_rope_layers")
    if flags is None:
        every = cfg.get("no_rope_layer_interval") or 4
        flags = [(i + 1) % every != 0 for i in range(n)]
    if len(flags) != n:
        raise ValueError(f"no_rope_layers names {len(flags)} layers, the model has {n}")
    flags = tuple(bool(f) for f in flags)
    return () if all(flags) else flags


class LlamaAttention(nn.Module):
    def __init__(self, arch: LlamaArch, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size = arch.num_heads * arch.head_dim
        self.kv_size = arch.num_kv_heads * arch.head_dim
        self.qkv_proj = Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = Linear(self.q_size, arch.hidden_size, bias=arch.o_bias)
        self.qk_norm_whole = arch.qk_norm_whole  # (OLMo 2's: over [T, H * D], before the heads part)
        q_width, k_width = (self.q_size, self.kv_size) if arch.qk_norm_whole else (arch.head_dim, arch.head_dim)
        self.q_norm = RMSNorm(q_width, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(k_width, arch.rms_norm_eps) if arch.qk_norm else None
        # a windowed layer of Gemma 3 rotates by its own base (ForwardContext.rotate_local)
        self.local_rope = arch.local_rope_theta is not None and arch.window(layer_idx) > 0
        self.rotates = arch.rotates(layer_idx)  # (SmolLM3's every fourth layer does not)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.attend(ctx.linear(self.qkv_proj, x), ctx)

    def attend(self, qkv: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """From the QKV projection's output on."""
        heads = self.num_heads + self.num_kv_heads
        # q and k side by side as [T, Hq + Hkv, D]: normed and rotated in one go.
        qk = qkv[:, :self.q_size + self.kv_size].view(-1, heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm_whole:
            q, k = qkv[:, :self.q_size], qkv[:, self.q_size:self.q_size + self.kv_size]
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), 1).view(-1, heads, self.head_dim)
        elif self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, :self.num_heads]), self.k_norm(qk[:, self.num_heads:])), 1)
        rotate = (ctx.rotate_local if self.local_rope else ctx.rotate) if self.rotates else None
        return ctx.linear(self.o_proj, ctx.attend(self.layer_idx, qk, v, self.num_heads, rotate))


class LlamaMLP(nn.Module):
    def __init__(self, arch: LlamaArch) -> None:
        super().__init__()
        self.gate_up_proj = Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=arch.mlp_bias)
        self.down_proj = Linear(arch.intermediate_size, arch.hidden_size, bias=arch.mlp_bias)
        # (SiLU's: streamserve_kernels.activation.silu_and_mul under use_kernels)
        self.act = GATES[arch.hidden_act]
        # (gate_up [1, 2I], weight, bias) -> down_proj(act(gate_up)) in one kernel, for one-row
        # steps (the runner sets it on the GPU where it wins: streamserve_kernels.gemv.choose_gated)
        self.gated_down: Optional[Callable] = None

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.down(ctx.linear(self.gate_up_proj, x), ctx)

    def down(self, gate_up: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """From the gate_up projection's output on."""
        if self.gated_down is not None and ctx.lora is None and gate_up.shape[0] == 1 and gate_up.is_contiguous():
            return self.gated_down(gate_up, self.down_proj.weight, self.down_proj.bias)
        return ctx.linear(self.down_proj, self.act(gate_up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: LlamaArch, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(arch, layer_idx)
        self.mlp = LlamaMLP(arch)
        # OLMo 2 norms no input: attention's and the MLP's outputs are normed before their adds
        self.input_layernorm = None if arch.post_norms else RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        # Gemma 2 and 3: attention's output is normed before the residual add, and the MLP's
        # input and output each (post_attention_layernorm is then the first of those three)
        self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
        if arch.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        if arch.sandwich_norms or arch.post_norms:
            self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.residual_scale = arch.residual_scale  # (Granite's residual_multiplier)
        # (x, residual, norm weight, eps, weight, bias) -> (the product of the normed row, the new
        # residual) in one kernel, for one-row steps: each norm and the projection after it (the
        # runner sets them on the GPU where they win, streamserve_kernels.gemv.choose_normed;
        # only a layer of two plain pre-norms takes them, plain_norms; either may be set alone)
        self.normed_qkv: Optional[Callable] = None
        self.normed_gate_up: Optional[Callable] = None

    @property
    def plain_norms(self) -> bool:
        """Whether its norms are Llama's alone: one before attention, one before the MLP, each
        after the residual add, nothing scaled."""
        return (self.input_layernorm is not None and self.pre_feedforward_layernorm is None
                and self.post_feedforward_layernorm is None and self.residual_scale == 1.0)

    def norms(self) -> list[RMSNorm]:
        return [n for n in (self.input_layernorm, self.post_attention_layernorm, self.pre_feedforward_layernorm,
                            self.post_feedforward_layernorm) if n is not None]

    def forward(self, hidden: torch.Tensor, residual: Optional[torch.Tensor], ctx: ForwardContext):
        """(hidden, residual) -> the next layer's: the residual stream is their sum."""
        if ((self.normed_qkv is not None or self.normed_gate_up is not None) and ctx.lora is None
                and hidden.shape[0] == 1 and hidden.is_contiguous()):
            return self._one_row(hidden, residual, ctx)
        if self.input_layernorm is None:  # OLMo 2: x + norm(attention(x)), then + norm(mlp(that))
            x = hidden if residual is None else hidden + residual
            x = x + self.post_attention_layernorm(self.self_attn(x, ctx))
            return self.post_feedforward_layernorm(self.mlp(x, ctx)), x
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, ctx)
        if self.pre_feedforward_layernorm is None:
            if self.residual_scale != 1.0:
                hidden = hidden * self.residual_scale
            hidden, residual = self.post_attention_layernorm(hidden, residual)
            hidden = self.mlp(hidden, ctx)
            return (hidden * self.residual_scale if self.residual_scale != 1.0 else hidden), residual
        hidden, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(hidden), residual)
        return self.post_feedforward_layernorm(self.mlp(hidden, ctx)), residual

    def _one_row(self, hidden: torch.Tensor, residual: Optional[torch.Tensor], ctx: ForwardContext):
        """forward for one row, a norm in the kernel of the projection after it where that is set
        (normed_qkv, normed_gate_up; a layer of plain_norms)."""
        attn, mlp = self.self_attn, self.mlp
        qkv, residual = self._normed_product(self.normed_qkv, self.input_layernorm, attn.qkv_proj, hidden,
                                             residual, ctx)
        gate_up, residual = self._normed_product(self.normed_gate_up, self.post_attention_layernorm,
                                                 mlp.gate_up_proj, attn.attend(qkv, ctx), residual, ctx)
        return mlp.down(gate_up, ctx), residual

    @staticmethod
    def _normed_product(fused: Optional[Callable], norm: RMSNorm, linear: nn.Module, hidden: torch.Tensor,
                        residual: Optional[torch.Tensor], ctx: ForwardContext):
        """(linear(norm(hidden + residual)), the new residual): in one kernel where `fused` is set."""
        if fused is not None:
            return fused(hidden, residual, norm.weight, norm.eps, linear.weight, linear.bias)
        if residual is None:
            return ctx.linear(linear, norm(hidden)), hidden
        normed, residual = norm(hidden, residual)
        return ctx.linear(linear, normed), residual


class LlamaForCausalLM(nn.Module):
    # checkpoint name piece -> (fused parameter, shard index)
    STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
               "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, arch: LlamaArch) -> None:
        super().__init__()
        self.arch = arch
        self.rotary = RotaryEmbedding(arch.rotated_dims, arch.max_position, arch.rope_theta, arch.rope_scaling)
        # Gemma 3's windowed layers: their own base, unscaled
        self.rotary_local = (RotaryEmbedding(arch.rotated_dims, arch.max_position, arch.local_rope_theta, None)
                             if arch.local_rope_theta is not None else None)
        # its weight given, so that it is not drawn at random: load_model builds on the meta device,
        # where torch's normal_ imports torch._dynamo (1.5-2 s of the start-up) to fill nothing
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size,
                                         _weight=torch.empty(arch.vocab_size, arch.hidden_size))
        self.layers = nn.ModuleList(LlamaDecoderLayer(arch, i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = Linear(arch.hidden_size, arch.vocab_size)
        self.tie_weights()
        for name, module in self.named_modules():
            if isinstance(module, Linear):
                module.lora_key = name
        # a quantized checkpoint's weights as GGUF blocks (Hugging Face name -> QuantizedWeight),
        # which the loader fills where the CPU's quantized GEMV will read them (models/quantization.py)
        self.checkpoint_blocks: dict = {}
        self.unread_weights: frozenset = frozenset()  # (load_model's blocks_only: what went to the blocks alone)

    def tie_weights(self) -> None:
        """Tied: the head is a Linear sharing the embedding's weight (re-tie after moves)."""
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn,
                low_precision: bool = False, lora: Optional[LoRAStep] = None) -> torch.Tensor:
        """Hidden states after the final norm, one row per input token; `lora`: the step's
        adapters, added to the linear layers' outputs of their requests' rows."""
        ctx = ForwardContext(attention, self.rotary.for_step(positions), low_precision, lora,
                             self.rotary_local.for_step(positions) if self.rotary_local is not None else None)
        hidden = self.embed(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, ctx)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings, a fresh tensor; Gemma's scaled by sqrt(hidden) (the scale in the
        model's dtype, as transformers takes it), Granite's by its embedding_multiplier (a float)."""
        hidden = self.embed_tokens(input_ids)
        scale = self.arch.embed_scale
        if scale != 1.0:
            hidden.mul_(torch.tensor(scale, dtype=hidden.dtype) if self.arch.norm_offset else scale)
        return hidden

    def compute_logits(self, hidden: torch.Tensor, low_precision: bool = False) -> torch.Tensor:
        logits = self.lm_head(hidden, low_precision)
        if self.arch.logits_scaling != 1.0:
            logits = logits / self.arch.logits_scaling
        cap = self.arch.final_softcap
        return logits if not cap else torch.tanh(logits / cap).mul_(cap)

    def rotaries(self) -> list[RotaryEmbedding]:
        return [r for r in (self.rotary, self.rotary_local) if r is not None]

    def use_kernels(self) -> None:
        """Run the small ops with the Triton kernels of streamserve_kernels (the GPU path):
        RMSNorm fused with the residual add, rotary in place, SiLU-and-mul. The q/k norms
        of Qwen3 (over [T, H, D] views) stay torch ops."""
        from streamserve_kernels import activation, norm, rotary

        for r in self.rotaries():
            r.kernel = rotary.rotary_embedding
        self.use_norm_kernels(norm)
        for layer in self.layers:
            if self.arch.hidden_act == "silu":
                layer.mlp.act = activation.silu_and_mul

    def use_norm_kernels(self, kernels) -> None:
        """Layer norms through `kernels.rms_norm` / `kernels.fused_add_rms_norm`: Triton's
        (streamserve_kernels.norm) or the CPU's C kernel (models/cpu_kernels.py, float32)."""
        self.norm.kernels = kernels
        for layer in self.layers:
            for norm in layer.norms():
                norm.kernels = kernels

    def keep_copies(self, dtype: torch.dtype, gemm=None, packed_max_rows: int = 0, row_major: bool = True,
                    drop_full: bool = False, rows=None) -> None:
        """Keep `dtype` copies of every linear weight (Linear.keep_copies): packed for the C GEMM
        `gemm` when given, for up to `packed_max_rows` rows, and row-major for torch when
        `row_major`. With `drop_full` (every step reads the copies), free the full-precision
        weights; a tied embedding's too where the head's packed copy can serve its lookups
        (through `rows`, CpuKernels.packed_rows, when given)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.keep_copies(dtype, gemm, packed_max_rows, row_major,
                                   drop_full and module.weight is not self.embed_tokens.weight)
        if drop_full and self.arch.tie_word_embeddings and self.lm_head.packed is not None:
            self.embed_tokens = PackedEmbedding(self.lm_head.packed, rows)
            self.lm_head.weight = nn.Parameter(torch.empty(0), requires_grad=False)

    def copies(self) -> list[torch.Tensor]:
        """The copies every linear layer keeps (Linear.replace_copies), layer by layer in the
        order a step reads them."""
        kept: list[torch.Tensor] = []
        for module in self.modules():
            if isinstance(module, Linear):
                module.replace_copies(lambda t: kept.append(t) or t)
        return kept

    def move_copies(self, place: Callable[[list[torch.Tensor]], Iterable[torch.Tensor]]) -> None:
        """Hand `copies()` to `place`, which returns them held elsewhere, in order
        (cpu_kernels.onto_huge_pages: one at a time), and keep those instead, each as it comes."""
        kept = self.copies()
        if not kept:
            return
        placed = iter(place(kept))
        del kept  # (the list is place's now: it may let each original go as it yields its copy)
        for module in self.modules():
            if isinstance(module, Linear):
                module.replace_copies(lambda t: next(placed))
        if isinstance(self.embed_tokens, PackedEmbedding):
            self.embed_tokens.packed = self.lm_head.packed

    def quantized_layers(self, kinds: dict[str, tuple]) -> dict[str, list[str]]:
        """The linear layers whose checkpoint tensors all have blocks of one kind and row width
        (`kinds`: Hugging Face name -> (kind, bytes a row of blocks)): layer name -> those names,
        its parts in order (q, k, v; gate, up) or the one fused tensor a checkpoint may hold (Phi-3)."""
        pieces = self.fused_pieces()
        found = {}
        for name, module in self.named_modules():
            if not isinstance(module, Linear):
                continue
            prefix, _, last = name.rpartition(".")
            if name == "lm_head":
                names = ["model.embed_tokens.weight" if self.arch.tie_word_embeddings else "lm_head.weight"]
            else:
                names = [f"model.{prefix}.{piece}.weight" for piece in pieces.get(last, [last])]
                if not all(n in kinds for n in names):  # stored fused (Phi-3)
                    names = [f"model.{name}.weight"]
            if all(n in kinds for n in names) and len({kinds[n] for n in names}) == 1:
                found[name] = names
        return found

    def keep_quantized(self, weights: dict, gemvs: dict, max_rows: int, only: bool = False) -> list[str]:
        """Give each linear layer whose checkpoint tensors are all in `weights` (Hugging Face
        name -> QuantizedWeight, one kind) its blocks, read by `gemvs[kind]` for steps of at
        most `max_rows` rows, or with `only` for every step, in place of its weight (but a head
        tied to the embedding keeps that). Takes (pops) from `weights` what it gives, so that each
        original goes once its layer has packed it. Returns the layers that got them."""
        modules = dict(self.named_modules())
        kept = []
        for name, names in self.quantized_layers({n: (w.kind, w.blocks.shape[1]) for n, w in weights.items()}).items():
            stacked = QuantizedWeight.stacked([weights.pop(n) for n in names])
            if stacked.kind in gemvs:
                tied = name == "lm_head" and self.arch.tie_word_embeddings
                modules[name].keep_quantized(stacked, gemvs[stacked.kind], max_rows, only and not tied)
                kept.append(name)
        return kept

    # -- LoRA --------------------------------------------------------------------

    def lora_targets(self) -> dict[str, LoRATarget]:
        """Each checkpoint module an adapter may name ("layers.0.self_attn.q_proj", or a fused
        "...qkv_proj" as Phi-3 stores it) -> where its adapter goes (any linear layer but the head)."""
        targets = {}
        layers = {m.lora_key: m for m in self.modules() if isinstance(m, Linear) and m.lora_key != "lm_head"}
        for key, layer in layers.items():
            targets[key] = LoRATarget(key, 0, layer.out_features, layer.in_features, layer.out_features)
            prefix, _, fused = key.rpartition(".")
            pieces = self.fused_pieces().get(fused, [])
            if pieces:
                sizes = self.shard_sizes(fused)
                for shard, piece in enumerate(pieces):
                    targets[f"{prefix}.{piece}"] = LoRATarget(key, sum(sizes[:shard]), sizes[shard], layer.in_features,
                                                              layer.out_features)
        return targets

    # -- weights ---------------------------------------------------------------

    def shard_sizes(self, fused: str) -> list[int]:
        a = self.arch
        if fused == "qkv_proj":
            return [a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim]
        return [a.intermediate_size, a.intermediate_size]

    def _destination(self, name: str) -> tuple[str, Optional[int]]:
        """Where checkpoint tensor `name` (its "model." dropped) goes: the parameter's name, and
        its shard of a fused parameter (q, k, v; gate, up), or None for all of it."""
        for piece, (fused, shard) in self.STACKED.items():
            if f".{piece}." in name:
                return name.replace(piece, fused), shard
        return name, None

    @classmethod
    def fused_pieces(cls) -> dict[str, list[str]]:
        """Each fused layer's checkpoint pieces, in order: qkv_proj's q, k, v; gate_up_proj's gate, up."""
        pieces: dict[str, list[str]] = {}
        for piece, (fused, _) in sorted(cls.STACKED.items(), key=lambda item: item[1]):
            pieces.setdefault(fused, []).append(piece)
        return pieces

    def fused_siblings(self, prefix: str) -> list[str]:
        """The checkpoint layers (names without ".weight") that make up the fused layer `prefix`
        goes into, in order: q, k, v or gate, up; or prefix alone."""
        head, _, last = prefix.rpartition(".")
        if last not in self.STACKED:
            return [prefix]
        return [f"{head}.{piece}" for piece in self.fused_pieces()[self.STACKED[last][0]]]

    def _mark_loaded(self, loaded: set[str], target: str, offset_rows: Optional[int]) -> None:
        """Count parameter `target`'s shard as loaded (_check_complete's keys): all of a fused
        parameter's where a checkpoint stores it fused (Phi-3)."""
        fused = target.split(".")[-2]
        if offset_rows is None and fused in ("qkv_proj", "gate_up_proj"):
            loaded.update(f"{target}#{shard}" for shard in range(len(self.shard_sizes(fused))))
        else:
            loaded.add(f"{target}#{offset_rows}")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], skipped: Iterable[str] = ()) -> None:
        """Copy checkpoint tensors (HF names) into the fused parameters; fail on gaps. `skipped`:
        weights left unread on purpose (layers that keep only their quantized blocks, which they
        are given after), counted as loaded (read once `weights` is done)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        stored_head = None
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.arch.tie_word_embeddings:
                stored_head = tensor  # tied: the embedding serves as the head, unless this differs
                continue
            target, offset_rows = self._destination(name)
            if target not in params:
                if name.endswith(".bias") and not tensor.any():
                    continue  # a zero bias of a layer that has none (GPTQ's writers add them; vLLM skips them too)
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            param = params[target]
            if offset_rows is None:
                dest = param.data
            else:
                sizes = self.shard_sizes(target.split(".")[-2])
                start = sum(sizes[:offset_rows])
                dest = param.data.narrow(0, start, sizes[offset_rows])
            if dest.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(dest.shape)}")
            dest.copy_(tensor)
            if self.arch.norm_offset and target.endswith("norm.weight"):
                dest += 1.0  # Gemma's norms scale by 1 + weight
            self._mark_loaded(loaded, target, offset_rows)
        for name in skipped:  # (after the weights: a quantized checkpoint's are known as they are read)
            self._mark_loaded(loaded, *self._destination(name.removeprefix("model.")))
        embedding = self.embed_tokens.weight
        if stored_head is not None and not torch.equal(stored_head.to(embedding.dtype), embedding.data):
            logger.warning("the checkpoint ties its head to the embedding but stores a different "
                           "lm_head.weight: reading that, untied (as transformers 5 does)")
            self.arch = dataclasses.replace(self.arch, tie_word_embeddings=False)
            self.lm_head.weight = nn.Parameter(stored_head.to(embedding.dtype).to(embedding.device).clone(),
                                               requires_grad=False)
            loaded.add("lm_head.weight#None")
        self._check_complete(loaded)

    def _check_complete(self, loaded: set[str]) -> None:
        missing = []
        for name, _ in self.named_parameters():
            fused = name.split(".")[-2] if name.endswith(".weight") or name.endswith(".bias") else ""
            if fused in ("qkv_proj", "gate_up_proj"):
                shards = range(len(self.shard_sizes(fused)))
                if not all(f"{name}#{s}" in loaded for s in shards):
                    missing.append(name)
            elif f"{name}#None" not in loaded:
                missing.append(name)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
