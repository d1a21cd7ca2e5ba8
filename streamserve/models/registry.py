"""Which checkpoint architectures streamserve runs, and how each differs from Llama."""

from __future__ import annotations

from streamserve.models.layers import GATES
from streamserve.models.llama import ACTIVATIONS, LlamaArch, LlamaForCausalLM

# architecture name in config.json -> how it differs from Llama (LlamaArch.from_hf_config's
# keywords): q/k/v projections with a bias, per-head q/k RMSNorm, Gemma's generation, whether
# config.json's sliding_window is read (transformers' Llama ignores it, Qwen's and SmolLM3's read
# it only with use_sliding_window), SmolLM3's layers without rotary, Granite's multipliers, OLMo 2's norms (and OLMo 3's windows)
_ARCHITECTURES = {
    "LlamaForCausalLM": dict(windowed=False),
    "MistralForCausalLM": dict(),
    "Qwen2ForCausalLM": dict(qkv_bias=True, windowed="opt_in"),
    "Qwen3ForCausalLM": dict(qk_norm=True, windowed="opt_in"),
    "Phi3ForCausalLM": dict(),  # Llama's layers, its q/k/v and gate/up stored fused
    "GemmaForCausalLM": dict(gemma=1, windowed=False),
    "Gemma2ForCausalLM": dict(gemma=2),
    "Gemma3ForCausalLM": dict(qk_norm=True, gemma=3),  # the text-only checkpoints (270M, 1B)
    "SmolLM3ForCausalLM": dict(windowed="opt_in", nope=True),
    "GraniteForCausalLM": dict(windowed=False, granite=True),  # Granite 3's dense models
    "Olmo2ForCausalLM": dict(windowed=False, olmo2=True),
    # OLMo 2's layers, three in four windowed, the full ones alone scaled (YaRN, for the long contexts)
    "Olmo3ForCausalLM": dict(olmo2=True, olmo3=True),
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def build_model(hf_config: dict) -> LlamaForCausalLM:
    """An unloaded model for this config, or a clear error for an unknown architecture."""
    archs = hf_config.get("architectures") or []
    if hf_config.get("model_type") == "olmo3":  # (vLLM's Olmo3Config names it Olmo2ForCausalLM in memory)
        archs = ["Olmo3ForCausalLM"]
    for name in archs:
        if name in _ARCHITECTURES:
            kind = _ARCHITECTURES[name]
            arch = LlamaArch.from_hf_config(hf_config, **kind)
            if arch.hidden_act not in GATES:
                key = "hidden_activation" if kind.get("gemma", 0) >= 2 else "hidden_act"
                raise ValueError(f"{key} {arch.hidden_act!r} is not supported: streamserve runs MLPs gated by "
                                 + ", ".join(sorted(ACTIVATIONS)))
            return LlamaForCausalLM(arch)
    raise ValueError(f"model architecture {archs or '(none given)'} is not supported; "
                     f"streamserve runs {', '.join(supported_architectures())}")
