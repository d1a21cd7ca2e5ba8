"""A LoRA adapter as PEFT saves one, read into the shapes the model's fused layers take.

A PEFT adapter directory holds `adapter_config.json` (r, lora_alpha, use_rslora, ...) and
`adapter_model.safetensors` (or `.bin`), whose tensors are named after the checkpoint's
modules: `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` [r, in] and
`...lora_B.weight` [out, r]. A layer's output gains `scale * B (A x)`, scale being
lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA).

The model fuses q/k/v and gate/up (models/llama.py), so an adapter's pieces of one fused
layer become one pair: A stacked [r_q + r_k + r_v, in] and B [out, r_q + r_k + r_v], each
piece's B (times its scale) in its rows and its rank's columns, zeros elsewhere; a layer's
step then adds B (A x) with two small GEMMs whatever the pieces.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch

_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")
_ids = itertools.count(1)


class LoRATarget(NamedTuple):
    """Where a checkpoint module's adapter goes: the fused layer (its Linear.lora_key), the
    rows of its output the module is, and the layer's input and output sizes."""

    layer: str
    row_start: int
    rows: int
    in_features: int
    out_features: int


@dataclass(eq=False)
class LoRAAdapter:
    """One loaded adapter: `weights` maps a layer's lora_key to (A [R, in], B [out, R] scaled),
    in the dtype and on the device the model computes in. `id` is unique in the process (a
    prefix-cache key: the same prompt's KV differs under each adapter)."""

    name: str
    path: str
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    base_model_name: Optional[str] = None  # /v1/models' parent for it (None: the served model)
    id: int = field(default_factory=lambda: next(_ids))

    @property
    def cache_root(self) -> int:
        """The parent hash of the first KV block of its requests' prompts."""
        return hash(("streamserve-lora", self.id))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def read_adapter(path: str, name: str, targets: dict[str, LoRATarget], max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> LoRAAdapter:
    """Load the PEFT adapter in directory `path` for a model whose modules are `targets`
    (LlamaForCausalLM.lora_targets); refuse, naming what is wrong, what it cannot run."""
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter {name!r}: {path!r} is not a directory")
    config_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"LoRA adapter {name!r}: {path!r} holds no adapter_config.json (PEFT's format)")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"LoRA adapter {name!r}: cannot read adapter_config.json: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {name!r}: adapter_config.json is not a JSON object")
    _check_config(name, config)
    tensors = _read_tensors(name, path)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key) if isinstance(tensor, torch.Tensor) else None
        if match is None:
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA A or B weight of a linear "
                             "layer (embedding, head, bias and DoRA adapters are not supported)")
        pairs.setdefault(match["module"], {})[match["which"]] = tensor
    if not pairs:
        raise ValueError(f"LoRA adapter {name!r}: its weights file holds no LoRA tensors")
    pieces: dict[str, list[tuple[LoRATarget, torch.Tensor, torch.Tensor]]] = {}
    rank = 0
    for module, pair in sorted(pairs.items()):
        target = targets.get(module)
        if target is None:
            what = module.rsplit(".", 1)[-1]
            raise ValueError(f"LoRA adapter {name!r}: module {module!r} is not a linear layer it can adapt "
                             f"({what}; supported: the attention's and the MLP's projections)")
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: module {module!r} has lora_{''.join(pair)} alone")
        a, b = pair["A"], pair["B"]
        r = a.shape[0] if a.dim() == 2 else 0
        if r < 1 or b.dim() != 2 or a.shape[1] != target.in_features or b.shape != (target.rows, r):
            raise ValueError(f"LoRA adapter {name!r}: module {module!r} has lora_A {tuple(a.shape)} and lora_B "
                             f"{tuple(b.shape)}; the model expects [r, {target.in_features}] and [{target.rows}, r]: "
                             "is it an adapter of another model?")
        if r > max_rank:
            raise ValueError(f"LoRA adapter {name!r}: rank {r} (module {module!r}) is greater than "
                             f"max_lora_rank ({max_rank}): start with a larger --max-lora-rank")
        rank = max(rank, r)
        scale = _alpha(name, config, module) / (math.sqrt(r) if config.get("use_rslora") else r)
        pieces.setdefault(target.layer, []).append((target, a, b * scale))
    weights = {}
    for layer, parts in pieces.items():
        total = sum(a.shape[0] for _, a, _ in parts)
        stacked_b = torch.zeros(parts[0][0].out_features, total, dtype=torch.float32)
        col = 0
        for target, a, b in parts:
            stacked_b[target.row_start:target.row_start + target.rows, col:col + a.shape[0]] = b
            col += a.shape[0]
        stacked_a = torch.cat([a.float() for _, a, _ in parts])
        weights[layer] = (stacked_a.to(device=device, dtype=dtype).contiguous(),
                          stacked_b.to(device=device, dtype=dtype).contiguous())
    return LoRAAdapter(name, path, rank, weights)


def _check_config(name: str, config: dict) -> None:
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: peft_type {peft_type!r} is not LORA")
    if config.get("use_dora"):
        raise ValueError(f"LoRA adapter {name!r}: DoRA adapters (use_dora) are not supported")
    if config.get("fan_in_fan_out"):
        raise ValueError(f"LoRA adapter {name!r}: fan_in_fan_out (GPT-2's Conv1D layers) is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r}: bias {config['bias']!r} is not supported (only 'none')")
    if config.get("modules_to_save"):
        raise ValueError(f"LoRA adapter {name!r}: modules_to_save {config['modules_to_save']} (whole layers "
                         "trained beside the adapter) are not supported")


def _alpha(name: str, config: dict, module: str) -> float:
    """lora_alpha, or the alpha_pattern entry naming this module: as PEFT matches a key, a
    regular expression the module's whole name ("model.layers.1.self_attn.q_proj") ends with
    after a dot (or is)."""
    patterns = config.get("alpha_pattern") or {}
    if not isinstance(patterns, dict):
        raise ValueError(f"LoRA adapter {name!r}: alpha_pattern is not an object")
    alpha = config.get("lora_alpha", 8)  # (PEFT's default)
    for key, value in patterns.items():
        try:
            if re.match(rf"(.*\.)?({key})$", "model." + module):
                alpha = value
                break
        except re.error as exc:
            raise ValueError(f"LoRA adapter {name!r}: alpha_pattern key {key!r} is not a regular expression: "
                             f"{exc}") from None
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"LoRA adapter {name!r}: alpha {alpha!r} (module {module!r}) is not a number")
    return float(alpha)


def _read_tensors(name: str, path: str) -> dict[str, torch.Tensor]:
    safetensors_path = os.path.join(path, "adapter_model.safetensors")
    bin_path = os.path.join(path, "adapter_model.bin")
    try:
        if os.path.isfile(safetensors_path):
            from safetensors.torch import load_file

            return load_file(safetensors_path)
        if os.path.isfile(bin_path):
            return torch.load(bin_path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a damaged or foreign file: say which
        raise ValueError(f"LoRA adapter {name!r}: cannot read its weights: {exc}") from None
    raise ValueError(f"LoRA adapter {name!r}: {path!r} holds neither adapter_model.safetensors nor adapter_model.bin")
