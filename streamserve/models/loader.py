"""Load a model's weights from a local Hugging Face directory (safetensors, sharded or not)."""

from __future__ import annotations

import glob
import json
import logging
import os
from typing import Iterator, Optional

import torch
from safetensors import safe_open
from torch import nn

from streamserve.config import ModelConfig
from streamserve.models.layers import Linear, RMSNorm, UpcastEmbedding
from streamserve.models.llama import LlamaForCausalLM
from streamserve.models.quantization import Dequantizer, describe, quantization_config
from streamserve.models.quantized import BLOCKS_FILE
from streamserve.models.registry import build_model

logger = logging.getLogger(__name__)


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, s) for s in shards]
    # (a GGUF conversion's quantized blocks are not weights of the model: models/quantized.py)
    files = sorted(f for f in glob.glob(os.path.join(model_dir, "*.safetensors"))
                   if os.path.basename(f) != BLOCKS_FILE)
    if not files:
        raise ValueError(f"model directory {model_dir!r} has no *.safetensors weights")
    return files


def checkpoint_names(model_dir: str) -> list[str]:
    """Every tensor's name, without reading the tensors."""
    names = []
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            names.extend(f.keys())
    return names


def iterate_safetensors(model_dir: str, skip: frozenset = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of the checkpoint's safetensors files, but those named in `skip` (left unread)."""
    for path in safetensors_files(model_dir):
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    if name not in skip:
                        yield name, f.get_tensor(name)
        except Exception as exc:  # safetensors' own error type: a truncated or corrupt file
            if isinstance(exc, (ValueError, TypeError)):
                raise
            raise ValueError(f"cannot read {path}: {exc}") from exc


@torch.no_grad()
def fill_random(model: torch.nn.Module, seed: int) -> None:
    """Weights of the right shape and a plausible scale (load_format="dummy", as vLLM's):
    norms at 1, everything else uniform in +-0.02 / sqrt(fan_in / 64), so activations stay finite."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            bound = 0.02 * min(1.0, (64 / param.shape[-1]) ** 0.5) if param.dim() > 1 else 0.02
            param.uniform_(-bound, bound, generator=gen)


def load_model(model_config: ModelConfig, device: torch.device, dtype: torch.dtype,
               keep_blocks: bool = False, linear_dtype: Optional[torch.dtype] = None,
               skip: frozenset = frozenset(), blocks_only: bool = False) -> LlamaForCausalLM:
    """Build the model on `device` in `dtype` and fill in its weights: a quantized checkpoint's
    dequantized (models/quantization.py), their GGUF blocks in `model.checkpoint_blocks` where
    `keep_blocks` (the CPU's quantized GEMV reads them). With `linear_dtype`, the linear layers'
    weights and the embedding are held in that dtype instead, the embedding's rows upcast as
    they are looked up: where the runner keeps only copies of them in it (a 16-bit checkpoint on
    the CPU's C kernels), so that loading takes half of float32's memory. `skip`: the weights of
    a GGUF conversion's layers that will hold only its blocks, left unread (their parameters are
    never written, so their pages are never touched). `blocks_only`: likewise for a quantized
    checkpoint's layers that turn out to have blocks (Dequantizer's), their names then in
    `model.unread_weights`."""
    with torch.device("meta"):
        model = build_model(model_config.hf_config)
    # each tensor allocated in place of its meta one, uninitialised, floating ones in `dtype`: what
    # to_empty(device).to(dtype) does, where to_empty's empty_like of a meta tensor goes through
    # torch's Python refs, which import sympy (0.7-0.9 s of the start-up)
    model = model._apply(lambda t: torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype,
                                               device=device))
    if linear_dtype is not None:
        for module in model.modules():
            if isinstance(module, Linear):
                # (empty, as the float32 ones were: converting those would read 4 bytes a weight for nothing)
                module.weight = nn.Parameter(torch.empty_like(module.weight, dtype=linear_dtype), requires_grad=False)
        model.embed_tokens = UpcastEmbedding(torch.empty_like(model.embed_tokens.weight, dtype=linear_dtype), dtype)
    model.tie_weights()
    if model.arch.norm_offset or model.arch.post_norms:  # Gemma's and OLMo 2's norms scale in float32
        for norm in model.modules():
            if isinstance(norm, RMSNorm):
                norm.weight.data = norm.weight.data.float()
    if model_config.load_format == "dummy":
        fill_random(model, model_config.seed)
    elif model_config.quantization is not None:
        config = quantization_config(model_config.hf_config)
        logger.info("reading a checkpoint quantized with %s, its weights dequantized to %s",
                    describe(model_config.quantization, config), str(linear_dtype or dtype).removeprefix("torch."))
        dequantize = Dequantizer(model_config.quantization, config, checkpoint_names(model_config.model), keep_blocks,
                                 blocks_only, fused=lambda prefix: [] if prefix == "lm_head" and model.arch.tie_word_embeddings
                                 else model.fused_siblings(prefix))
        model.load_weights(dequantize(iterate_safetensors(model_config.model)), skipped=dequantize.unread)
        model.checkpoint_blocks, model.unread_weights = dequantize.blocks, frozenset(dequantize.unread)
    else:
        model.load_weights(iterate_safetensors(model_config.model, skip), skipped=skip)
    for rotary in model.rotaries():
        rotary.build_cache(device, dtype)
    return model.eval().requires_grad_(False)
