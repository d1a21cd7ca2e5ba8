"""Random LoRA adapters in PEFT's format for the tiny models, and the model they make merged
(W + scale * B A, the reference a LoRA run must match)."""

from __future__ import annotations

import json
import math
import os
import shutil
from typing import Optional, Sequence

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _linears(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model, {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def build_adapter(path: str, model_dir: str, rank: int = 8, targets: Sequence[str] = ALL_TARGETS, seed: int = 0,
                  alpha: Optional[float] = None, rslora: bool = False, layers: Optional[Sequence[int]] = None,
                  std: float = 0.2, **config) -> str:
    """A random adapter of `model_dir` in `path` (adapter_config.json, adapter_model.safetensors):
    rank `rank` on every module named in `targets` (of `layers`, else all). B is not zero (as
    a trained adapter's is not), so the adapter changes the outputs."""
    from safetensors.torch import save_file

    _, linears = _linears(model_dir)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, module in linears.items():
        parts = name.split(".")
        if parts[-1] not in targets or name == "lm_head":
            continue
        if layers is not None and int(parts[2]) not in layers:
            continue
        out_f, in_f = module.weight.shape
        tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * std
        tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * std
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": alpha if alpha is not None else 2 * rank,
                   "target_modules": list(targets), "use_rslora": rslora, "bias": "none",
                   "base_model_name_or_path": model_dir, "task_type": "CAUSAL_LM", **config}, f)
    return path


def merge_adapter(model_dir: str, adapter_dir: str, out_dir: str) -> str:
    """`model_dir` with the adapter merged into its weights, saved in `out_dir` (tokenizer too)."""
    from safetensors.torch import load_file

    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        config = json.load(f)
    tensors = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    model, linears = _linears(model_dir)
    with torch.no_grad():
        for key, a in tensors.items():
            if not key.endswith("lora_A.weight"):
                continue
            name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = tensors[key.replace("lora_A", "lora_B")]
            r = a.shape[0]
            alpha = config.get("alpha_pattern", {}).get(name.split(".")[-1], config["lora_alpha"])
            scale = alpha / (math.sqrt(r) if config.get("use_rslora") else r)
            linears[name].weight += scale * (b @ a)
    model.save_pretrained(out_dir, safe_serialization=True)
    for file in os.listdir(model_dir):
        if file.startswith("tokenizer") or file in ("special_tokens_map.json", "chat_template.jinja"):
            shutil.copy(os.path.join(model_dir, file), out_dir)
    return out_dir
