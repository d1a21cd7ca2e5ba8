"""Quantized checkpoints of the tiny models, in the layouts vLLM reads, and their references.

Each writer quantizes a tiny model's linear layers (not its head) and saves them as that format
stores them; `reference_dir` saves a plain model whose weights are the dequantized ones as the
format's own tools compute them, for transformers to run as the oracle. compressed-tensors'
checkpoints are written by compressed-tensors itself; AWQ's are checked against its AutoAWQ
converter (tests/models/test_quantization.py)."""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def linear_weights(src: str) -> dict[str, torch.Tensor]:
    """The model's weights (one file) by name."""
    return load_file(os.path.join(src, "model.safetensors"))


def is_quantized(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in QUANTIZED


def quantize_groups(w: torch.Tensor, bits: int, group: int, symmetric: bool):
    """Min-max quantization of each row's groups of `group` columns: unsigned q [rows, cols]
    (uint8), float16 scale and int zero [rows, cols / group], W ~ (q - zero) * scale."""
    rows, cols = w.shape
    g = w.float().reshape(rows, cols // group, group)
    top = (1 << bits) - 1
    if symmetric:
        scale = (g.abs().amax(-1) / (top // 2)).clamp(min=1e-5).half()
        zero = torch.full(scale.shape, (top + 1) // 2, dtype=torch.int32)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / top).clamp(min=1e-5).half()
        zero = (-lo / scale.float()).round().clamp(0, top).to(torch.int32)
    q = (g / scale.float()[..., None]).round() + zero[..., None]
    return q.clamp(0, top).to(torch.uint8).reshape(rows, cols), scale, zero


def dequantize_groups(q, scale, zero, g_idx=None) -> torch.Tensor:
    cols, groups = q.shape[1], scale.shape[1]
    g = g_idx if g_idx is not None else torch.arange(cols) // (cols // groups)
    return (q.float() - zero[:, g].float()) * scale[:, g].float()


def pack_along_last(values: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """Unsigned values [..., n] into int32 words of 32 / bits, the first lowest (or value k of a
    word from column order[k])."""
    per = 32 // bits
    v = values.to(torch.int64).reshape(*values.shape[:-1], -1, per)
    if order is not None:
        v = v[..., list(order)]
    word = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for k in range(per):
        word |= v[..., k] << (bits * k)
    return word.to(torch.int64).where(word < 2 ** 31, word - 2 ** 32).to(torch.int32)


def _copy_files(src: str, dst: str) -> None:
    """`src`'s files but its weights (config, tokenizer, ...) into `dst`."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if name != "model.safetensors" and os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), dst)


def _copy_model_files(src: str, dst: str, quantization_config: dict) -> None:
    _copy_files(src, dst)
    config = json.load(open(os.path.join(src, "config.json")))
    config["quantization_config"] = quantization_config
    json.dump(config, open(os.path.join(dst, "config.json"), "w"), indent=1)


def reference_dir(src: str, dst: str, weights: dict[str, torch.Tensor]) -> str:
    """A plain copy of `src` whose weights `weights` replace (transformers' oracle)."""
    tensors = linear_weights(src)
    tensors.update({k: v.to(tensors[k].dtype).contiguous() for k, v in weights.items()})
    _copy_files(src, dst)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def write_gguf_layout(src: str, dst: str, dtype: torch.dtype = torch.bfloat16) -> str:
    """`src` laid out as a GGUF conversion is (the default model's layout, models/quantized.py):
    random Q4_1 blocks for every linear weight but the embedding, beside their values
    dequantized to `dtype`."""
    from streamserve.models.quantized import BLOCKS_FILE, QuantizedWeight, save_blocks

    weights = linear_weights(src)
    gen = torch.Generator().manual_seed(0)
    blocks = {name: QuantizedWeight.random("q4_1", *w.shape, gen) for name, w in weights.items()
              if w.dim() == 2 and "embed" not in name}
    weights.update({name: q.dequantize().to(dtype) for name, q in blocks.items()})
    _copy_files(src, dst)
    save_file(weights, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    save_blocks(os.path.join(dst, BLOCKS_FILE), blocks)
    return dst


def write_awq(src: str, dst: str, group: int = 32, zero_point: bool = True) -> dict[str, torch.Tensor]:
    """AutoAWQ's GEMM layout; returns the dequantized weights (W = (q - zero) * scale)."""
    from streamserve.models.quantization import AWQ_ORDER

    out, dequantized = {}, {}
    for name, w in linear_weights(src).items():
        if not is_quantized(name):
            out[name] = w
            continue
        prefix = name.removesuffix(".weight")
        q, scale, zero = quantize_groups(w, 4, group, symmetric=not zero_point)
        out[f"{prefix}.qweight"] = pack_along_last(q.T.contiguous(), 4, AWQ_ORDER)  # [in, out / 8]
        if zero_point:
            out[f"{prefix}.qzeros"] = pack_along_last(zero.T.contiguous(), 4, AWQ_ORDER)
        out[f"{prefix}.scales"] = scale.T.contiguous()
        dequantized[name] = dequantize_groups(q, scale, zero)
    _copy_model_files(src, dst, {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": zero_point,
                                 "version": "gemm", "modules_to_not_convert": None})
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dequantized


def write_gptq(src: str, dst: str, bits: int = 4, group: int = 32, sym: bool = True, desc_act: bool = False,
               v2: bool = False, dynamic: dict = None) -> dict[str, torch.Tensor]:
    """GPTQ's layout (v1: each zero stored less one); with desc_act, each layer's inputs taken
    in a shuffled order into the groups, as act-order leaves them; `dynamic`, GPTQModel's
    per-layer overrides ({"+:regex": {"bits": 8}}). Returns the dequantized weights."""
    import re

    out, dequantized = {}, {}
    gen = torch.Generator().manual_seed(7)
    layer_bits = bits
    for name, w in linear_weights(src).items():
        if not is_quantized(name):
            out[name] = w
            continue
        prefix = name.removesuffix(".weight")
        bits = next((o["bits"] for k, o in (dynamic or {}).items() if re.match(k[2:], prefix)), layer_bits)
        cols = w.shape[1]
        perm = torch.randperm(cols, generator=gen) if desc_act else torch.arange(cols)
        g_idx = torch.empty(cols, dtype=torch.int64)
        g_idx[perm] = torch.arange(cols) // group  # input perm[i] falls in group i // group
        q_p, scale, zero = quantize_groups(w[:, perm], bits, group, symmetric=sym)
        q = torch.empty_like(q_p)
        q[:, perm] = q_p
        out[f"{prefix}.qweight"] = pack_along_last(q.contiguous(), bits).T.contiguous()  # [in * bits / 32, out]
        stored = zero if v2 else zero - 1
        out[f"{prefix}.qzeros"] = pack_along_last((stored & ((1 << bits) - 1)).T.contiguous(), bits)
        out[f"{prefix}.scales"] = scale.T.contiguous()
        out[f"{prefix}.g_idx"] = g_idx.to(torch.int32)
        dequantized[name] = dequantize_groups(q, scale, zero, g_idx)
    config = {"quant_method": "gptq", "bits": layer_bits, "group_size": group, "desc_act": desc_act, "sym": sym,
              "checkpoint_format": "gptq_v2" if v2 else "gptq", "dynamic": dynamic}
    _copy_model_files(src, dst, config)
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dequantized


def write_fp8(src: str, dst: str, block: tuple[int, int] = (16, 32)) -> None:
    """The FP8 layout of Qwen3's and DeepSeek's checkpoints: float8_e4m3fn weights, a float32
    weight_scale_inv a block."""
    out = {}
    for name, w in linear_weights(src).items():
        if not is_quantized(name):
            out[name] = w
            continue
        rows, cols = w.shape
        b0, b1 = block
        blocks = w.float().reshape(rows // b0, b0, cols // b1, b1)
        scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-8)
        q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(rows, cols)
        out[name] = q
        out[name.removesuffix(".weight") + ".weight_scale_inv"] = scale
    _copy_model_files(src, dst, {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                 "weight_block_size": list(block)})
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})


def write_compressed_tensors(src: str, dst: str, scheme: str, group: int = 32, fmt: str = None,
                             weights_only: bool = False, dtype: torch.dtype = torch.float32) -> None:
    """compressed-tensors' own writing of `scheme` (one of its presets: W4A16, W4A16_ASYM,
    W8A16, W8A8, FP8, FP8_DYNAMIC, FP8_BLOCK; `weights_only`: without its activations), with
    min-max scales (llm-compressor calibrates them; the layout is the same), its other tensors
    and scales in `dtype` (llm-compressor keeps the model's, bfloat16 for most)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationStatus, apply_quantization_config,
                                                 preset_name_to_scheme)
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    spec = preset_name_to_scheme(scheme, ["Linear"])
    if spec.weights.group_size:
        spec.weights.group_size = group
    if spec.weights.block_structure:
        spec.weights.block_structure = [group, group]
    if weights_only:
        spec.input_activations = None
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": spec}, ignore=["lm_head"]))
    args = spec.weights
    for module in model.modules():
        if not hasattr(module, "weight_scale"):
            continue
        w = module.weight.data.float()
        rows, cols = w.shape
        if args.strategy == "group":
            g = w.reshape(rows, cols // group, group)
            lo, hi = g.amin(-1), g.amax(-1)
        elif args.strategy == "channel":
            lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        elif args.strategy == "block":
            g = w.reshape(rows // group, group, cols // group, group)
            lo, hi = g.amin(dim=(1, 3)), g.amax(dim=(1, 3))
        else:
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        scale, zero = calculate_qparams(lo, hi, args)
        module.weight_scale.data = scale.to(module.weight_scale.dtype).reshape(module.weight_scale.shape)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data = zero.to(module.weight_zero_point.dtype).reshape(module.weight_zero_point.shape)
        module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(model, fmt)
    compressor.compress_model(model)
    model.to(dtype)  # (the packed integers stay as they are)
    model.config.dtype = dtype
    model.save_pretrained(dst)
    compressor.update_config(dst)
    for name in os.listdir(src):
        if name.startswith("tok") or name.endswith(".jinja") or name.startswith("special"):
            shutil.copy(os.path.join(src, name), dst)


def compressed_tensors_reference(dst: str) -> dict[str, torch.Tensor]:
    """compressed-tensors' own dequantization of each quantized weight of a checkpoint it wrote
    (its unpacking and its dequantize, with the scale's dtype as it computes)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from compressed_tensors.quantization import QuantizationArgs

    config = json.load(open(os.path.join(dst, "config.json")))
    config = config.get("quantization_config") or config["compression_config"]
    args = QuantizationArgs(**config["config_groups"]["group_0"]["weights"])
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    out = {}
    for name in tensors:
        if not name.endswith(".weight_scale"):
            continue
        prefix = name.removesuffix(".weight_scale")
        scale = tensors[name]
        if f"{prefix}.weight_packed" in tensors:
            shape = torch.Size(tensors[f"{prefix}.weight_shape"].tolist())
            q = unpack_from_int32(tensors[f"{prefix}.weight_packed"], args.num_bits, shape)
        else:
            q = tensors[f"{prefix}.weight"]
        zero = tensors.get(f"{prefix}.weight_zero_point")
        if zero is not None and zero.dtype == torch.int32 and zero.shape[0] != scale.shape[0]:
            zero = unpack_from_int32(zero, args.num_bits, scale.shape, packed_dim=0)
        out[f"{prefix}.weight"] = dequantize(q, scale, zero, args=args, dtype=torch.float32)
    return out
