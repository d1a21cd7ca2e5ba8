"""Which checkpoint architectures streamserve runs, and how each differs from Llama."""

from __future__ import annotations

from streamserve.models.llama import LlamaArch, LlamaForCausalLM

# architecture name in config.json -> (q/k/v projections carry a bias, per-head q/k RMSNorm)
_ARCHITECTURES = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
    "Phi3ForCausalLM": (False, False),  # Llama's layers, its q/k/v and gate/up stored fused
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def build_model(hf_config: dict) -> LlamaForCausalLM:
    """An unloaded model for this config, or a clear error for an unknown architecture."""
    act = hf_config.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # the kernels (C, Triton) all compute SiLU-and-mul
        raise ValueError(f"hidden_act {act!r} is not supported: streamserve runs SiLU-gated MLPs")
    rope = hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    partial = hf_config.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0
    if partial != 1.0:  # (Phi-4-mini's 0.75) the kernels rotate every dimension of a head
        raise ValueError(f"partial_rotary_factor {partial} is not supported: streamserve rotates whole heads")
    archs = hf_config.get("architectures") or []
    for name in archs:
        if name in _ARCHITECTURES:
            qkv_bias, qk_norm = _ARCHITECTURES[name]
            return LlamaForCausalLM(LlamaArch.from_hf_config(hf_config, qkv_bias, qk_norm))
    raise ValueError(f"model architecture {archs or '(none given)'} is not supported; "
                     f"streamserve runs {', '.join(supported_architectures())}")
