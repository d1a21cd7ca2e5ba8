"""Which checkpoint architectures streamserve runs, and how each differs from Llama."""

from __future__ import annotations

from streamserve.models.layers import GATES
from streamserve.models.llama import ACTIVATIONS, LlamaArch, LlamaForCausalLM

# architecture name in config.json -> (q/k/v projections carry a bias, per-head q/k RMSNorm,
# Gemma's generation or 0, whether config.json's sliding_window is read: transformers' Llama
# ignores it, Qwen's read it only with use_sliding_window)
_ARCHITECTURES = {
    "LlamaForCausalLM": (False, False, 0, False),
    "MistralForCausalLM": (False, False, 0, True),
    "Qwen2ForCausalLM": (True, False, 0, "opt_in"),
    "Qwen3ForCausalLM": (False, True, 0, "opt_in"),
    "Phi3ForCausalLM": (False, False, 0, True),  # Llama's layers, its q/k/v and gate/up stored fused
    "GemmaForCausalLM": (False, False, 1, False),
    "Gemma2ForCausalLM": (False, False, 2, True),
    "Gemma3ForCausalLM": (False, True, 3, True),  # the text-only checkpoints (270M, 1B)
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def build_model(hf_config: dict) -> LlamaForCausalLM:
    """An unloaded model for this config, or a clear error for an unknown architecture."""
    rope = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    partial = hf_config.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0
    if partial != 1.0:  # (Phi-4-mini's 0.75) the kernels rotate every dimension of a head
        raise ValueError(f"partial_rotary_factor {partial} is not supported: streamserve rotates whole heads")
    archs = hf_config.get("architectures") or []
    for name in archs:
        if name in _ARCHITECTURES:
            qkv_bias, qk_norm, gemma, windowed = _ARCHITECTURES[name]
            arch = LlamaArch.from_hf_config(hf_config, qkv_bias, qk_norm, gemma, windowed)
            if arch.hidden_act not in GATES:
                key = "hidden_activation" if gemma >= 2 else "hidden_act"
                raise ValueError(f"{key} {arch.hidden_act!r} is not supported: streamserve runs MLPs gated by "
                                 + ", ".join(sorted(ACTIVATIONS)))
            return LlamaForCausalLM(arch)
    raise ValueError(f"model architecture {archs or '(none given)'} is not supported; "
                     f"streamserve runs {', '.join(supported_architectures())}")
