"""GGUF -> a normal Hugging Face model directory (config.json, safetensors, tokenizer).

A GGUF file is converted once, into the cache, so later starts load safetensors in
seconds. Tensors are dequantized with the `gguf` package (F32, F16, BF16, Q8_0, Q4_0,
Q4_1 and the other types it reads), llama.cpp's tensor names are mapped to Hugging
Face's (Phi-3's fused attn_qkv and ffn_up to its fused qkv_proj and gate_up_proj), the
row permutation that llama.cpp's converter applies to Llama's Q and K projections is undone,
and so is the 1 it adds to Gemma's norm weights (Hugging Face's hold w, the norm scales by 1 + w).
Config comes from the GGUF metadata; the tokenizer and its chat template from the GGUF's
tokenizer fields (through transformers' GGUF tokenizer reader).
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import shutil
import uuid
from typing import Any, Optional

import numpy as np
import torch
from tqdm.auto import tqdm

from streamserve.models.quantized import BLOCKS, BLOCKS_FILE, QuantizedWeight, save_blocks

# GGUF architecture -> (Hugging Face architecture, model_type, Q/K rows permuted by llama.cpp)
ARCHS = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
    "phi3": ("Phi3ForCausalLM", "phi3", False),
    "gemma": ("GemmaForCausalLM", "gemma", False),
    "gemma2": ("Gemma2ForCausalLM", "gemma2", False),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text", False),
    "granite": ("GraniteForCausalLM", "granite", True),
    "smollm3": ("SmolLM3ForCausalLM", "smollm3", True),  # (every fourth layer unrotated: both assume it)
    "olmo2": ("Olmo2ForCausalLM", "olmo2", False),
}
# Granite's multipliers, as llama.cpp's converter names them -> config.json's
_GRANITE_SCALES = {"embedding_scale": "embedding_multiplier", "residual_scale": "residual_multiplier",
                   "attention.scale": "attention_multiplier", "logit_scale": "logits_scaling"}
_GEMMA = {"gemma", "gemma2", "gemma3"}
_SANDWICHED = {"gemma2", "gemma3"}  # the Gemmas with norms around attention's output and the MLP
_POST_NORMED = _SANDWICHED | {"olmo2"}  # the architectures whose post_attention_norm / post_ffw_norm are those
# Gemma 2's and 3's norms around attention and the MLP: ffn_norm is the MLP's input norm there
_SANDWICH_TENSORS = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                     "post_ffw_norm": "post_feedforward_layernorm"}
# GGUF architectures whose ffn_up holds the gate and up projections fused (gate first), as
# their Hugging Face checkpoints' gate_up_proj does; their attn_qkv holds q, k and v
_FUSED_UP = {"phi3"}

# llama.cpp tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "attn_qkv": "self_attn.qkv_proj",
}
_GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight",
                   "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}

MARKER = "streamserve-gguf-source.json"
# tokens that end a chat turn, which llama.cpp also stops at (by their text) where the GGUF's
# EOS is another (Microsoft's Phi-3 file: EOS <|endoftext|>, turns end with <|end|>)
_END_OF_TURN = ("<|end|>", "<|eot_id|>", "<|im_end|>", "<end_of_turn>")


def read_metadata(reader) -> dict[str, Any]:
    """GGUF key/value fields as Python values (strings decoded, arrays of numbers as lists)."""
    import gguf

    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if not field.types:
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.STRING:
            meta[key] = bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
        elif kind == gguf.GGUFValueType.ARRAY:
            if len(field.types) > 1 and field.types[1] == gguf.GGUFValueType.STRING:
                continue  # token lists: the tokenizer reader handles those
            meta[key] = [field.parts[i].tolist()[0] for i in field.data]
        else:
            meta[key] = field.parts[field.data[0]].tolist()[0]
    return meta


def hf_config(meta: dict[str, Any], tied: bool, dtype: torch.dtype, vocab_size: Optional[int] = None
              ) -> dict[str, Any]:
    """The config.json of a GGUF's metadata; `vocab_size` (the embedding's rows) where the
    metadata has none, as llama.cpp writes Qwen2's."""
    arch = meta.get("general.architecture")
    if arch not in ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; streamserve reads "
                         f"{', '.join(sorted(ARCHS))} GGUF files")
    hf_arch, model_type, _ = ARCHS[arch]
    get = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    heads = get("attention.head_count")
    hidden = get("embedding_length")
    config = {
        "architectures": [hf_arch], "model_type": model_type,
        "hidden_size": hidden, "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"), "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length", hidden // heads),
        "max_position_embeddings": get("context_length", 2048),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0),
        "vocab_size": get("vocab_size") or vocab_size,
        "tie_word_embeddings": tied,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if arch in _GEMMA:
        config.update(_gemma_config(arch, get, config))
    if arch == "granite":
        config.update({name: get(key) for key, name in _GRANITE_SCALES.items() if get(key) is not None})
    window = get("attention.sliding_window")
    if not window and arch == "phi3" and config["max_position_embeddings"] <= 4096:
        window = 2047  # the 4k models' own, in files written before llama.cpp stored it (Microsoft's)
    if window:  # (a Phi-3's layers attend within it; transformers' Llama, as llama.cpp's, ignores it)
        config["sliding_window"] = window
    if arch == "olmo2" and (get("attention.sliding_window") or get("attention.sliding_window_pattern")):
        # (llama.cpp writes OLMo 3 as olmo2, with windowed layers of their own rotary)
        raise ValueError("this olmo2 GGUF has sliding-window layers (an OLMo 3): streamserve runs OLMo 3 from its "
                         "Hugging Face checkpoint, not yet from llama.cpp's conversion of it")
    rotary = get("rope.dimension_count")
    if rotary and rotary != config["head_dim"]:  # (Phi-4-mini's turns 3/4 of each head)
        config["partial_rotary_factor"] = rotary / config["head_dim"]
    scaling = get("rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    elif scaling == "yarn":
        config["rope_scaling"] = _yarn_config(get, config["max_position_embeddings"])
    elif scaling not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported (supported: none, linear, yarn)")
    return config


def _yarn_config(get, context: int) -> dict[str, Any]:
    """YaRN's rope_scaling as llama.cpp reads it from a GGUF: the factor, the original context
    (the file's context where it names none), the betas where given, and its yarn_attn_factor
    (Hugging Face's attention_factor) or else its attn_factor, which llama.cpp multiplies into
    YaRN's own 0.1 ln(factor) + 1."""
    factor = float(get("rope.scaling.factor"))
    rope = {"rope_type": "yarn", "factor": factor,
            "original_max_position_embeddings": get("rope.scaling.original_context_length") or context}
    for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if get(f"rope.scaling.{key}") is not None:
            rope[name] = get(f"rope.scaling.{key}")
    attn_factor = get("rope.scaling.attn_factor")
    if get("rope.scaling.yarn_attn_factor") is not None:  # (the Hugging Face config's attention_factor)
        rope["attention_factor"] = get("rope.scaling.yarn_attn_factor")
    elif attn_factor is not None and attn_factor != 1.0:
        rope["attention_factor"] = attn_factor * (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    if get("rope.scaling.yarn_log_multiplier"):
        raise ValueError("GGUF rope.scaling.yarn_log_multiplier (DeepSeek's YaRN) is not supported")
    return rope


_ROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")  # LongRoPE's, as llama.cpp keeps them
_ROPE_TENSORS = _ROPE_FACTORS + ("rope_freqs.weight",)  # (Llama 3's): read into config.json's rope_scaling


def llama3_scaling(freq_factors: list[float], theta: float, head_dim: int) -> Optional[dict[str, Any]]:
    """Llama 3.1's rope_scaling (factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings) that divides each rotary frequency by the factor llama.cpp
    keeps for it in rope_freqs: None where every one is 1. The factors fix only the two
    wavelengths between which the scaling ramps (original / low, original / high), so low is
    taken as 1 (Llama's) and high sought among Llama's 4 and a few others, each checked
    against every factor; a GGUF whose factors no Llama 3 scaling gives is refused."""
    from streamserve.models.layers import rope_inv_freq

    want = np.asarray(freq_factors, dtype=np.float64)
    if want.shape != (head_dim // 2,):
        raise ValueError(f"this GGUF's rope_freqs hold {want.size} factors, its heads of {head_dim} turn "
                         f"{head_dim // 2} frequencies")
    if np.allclose(want, 1.0):
        return None
    factor = float(want.max())
    freqs = rope_inv_freq(head_dim, theta, None).double().numpy()
    x = freqs / (2 * math.pi)  # 1 / wavelength
    medium = np.flatnonzero((want > 1.0 + 1e-6) & (want < factor * (1 - 1e-6)))
    for high in (4.0, 2.0, 8.0, 3.0, 16.0, 1.5, 32.0):
        if medium.size:  # the ramp: (original x - 1) / (high - 1) = (1 / f - 1 / factor) / (1 - 1 / factor)
            k = medium[0]
            smooth = (1 / want[k] - 1 / factor) / (1 - 1 / factor)
            original = (smooth * (high - 1) + 1) / x[k]
            if abs(original - round(original)) <= 1e-4 * original:  # (the float32 factors' rounding)
                original = round(original)
        else:  # no dim on the ramp: any original between the last unscaled and the first scaled
            unscaled, scaled = x[want <= 1.0 + 1e-6], x[want >= factor * (1 - 1e-6)]
            if not unscaled.size or not scaled.size:
                break
            original = math.sqrt(high / unscaled.min() / scaled.max())
        rope = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": high,
                "original_max_position_embeddings": original}
        got = freqs / rope_inv_freq(head_dim, theta, rope).double().numpy()
        if np.allclose(got, want, rtol=1e-4, atol=0):
            return rope
    raise ValueError("this GGUF's rope_freqs are no Llama 3 rope scaling that streamserve can reproduce")


def _longrope_config(meta: dict[str, Any], factors: dict[str, list[float]], config: dict[str, Any]) -> dict[str, Any]:
    """LongRoPE's rope_scaling (Phi-3's 128k models, Phi-3.5-mini, Phi-4-mini) from the factors
    llama.cpp keeps as tensors, its original context and attention factor from the metadata."""
    if len(factors) != 2:
        raise ValueError(f"this GGUF carries {', '.join(factors)} without its pair: LongRoPE needs both")
    arch = meta["general.architecture"]
    rope = {"rope_type": "longrope", "short_factor": factors["rope_factors_short.weight"],
            "long_factor": factors["rope_factors_long.weight"],
            "original_max_position_embeddings": meta.get(f"{arch}.rope.scaling.original_context_length")
            or config["max_position_embeddings"]}
    if meta.get(f"{arch}.rope.scaling.attn_factor") is not None:
        rope["attention_factor"] = meta[f"{arch}.rope.scaling.attn_factor"]
    return rope


def _gemma_config(arch: str, get, config: dict[str, Any]) -> dict[str, Any]:
    """What a Gemma's config.json holds beyond a Llama's, as llama.cpp reads its GGUF: GELU's
    tanh form; the attention scale's sqrt(head_dim), but sqrt(hidden / heads) for the 27B
    models (which llama.cpp tells by their layers: Gemma 2's 46, Gemma 3's 62); Gemma 2's soft
    caps; Gemma 3's windowed layers' rotary base (10000 where the file keeps none); the
    windowed layers, where the file lists them."""
    extra: dict[str, Any] = {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh"}
    if arch in _SANDWICHED:  # (Gemma 1's scale is sqrt(head_dim) alone)
        big = config["num_hidden_layers"] == (46 if arch == "gemma2" else 62)
        extra["query_pre_attn_scalar"] = (config["hidden_size"] // config["num_attention_heads"] if big
                                          else config["head_dim"])
    if arch == "gemma2":
        extra["attn_logit_softcapping"] = get("attn_logit_softcapping", 50.0)
        extra["final_logit_softcapping"] = get("final_logit_softcapping", 30.0)
    if arch == "gemma3":
        extra["rope_local_base_freq"] = get("rope.freq_base_swa", 10000.0)
    pattern = get("attention.sliding_window_pattern")
    if isinstance(pattern, list):  # a flag per layer: windowed or not
        extra["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    elif pattern:
        extra["sliding_window_pattern"] = pattern
    return extra


def reverse_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation: it interleaved the two rotary halves of each head."""
    rows, cols = w.shape
    return w.reshape(num_heads, rows // num_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def hf_name(name: str, arch: str = "llama") -> str:
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and arch in _POST_NORMED and parts[2] in _SANDWICH_TENSORS:
        return f"model.layers.{parts[1]}.{_SANDWICH_TENSORS[parts[2]]}.{parts[3]}"
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_TENSORS:
        piece = "mlp.gate_up_proj" if parts[2] == "ffn_up" and arch in _FUSED_UP else _LAYER_TENSORS[parts[2]]
        return f"model.layers.{parts[1]}.{piece}.{parts[3]}"
    raise ValueError(f"GGUF tensor {name!r} has no place in a Llama-family model")


def convert_gguf(gguf_path: str, out_dir: str, dtype: torch.dtype = torch.bfloat16) -> str:
    """Write the converted model into `out_dir` (replaced whole); return `out_dir`. Written
    first into a directory of this process's own, then moved into place: two processes
    converting at once both end up with one whole conversion."""
    remove_abandoned(out_dir)
    tmp_dir = f"{out_dir}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        _write_conversion(gguf_path, tmp_dir, dtype)
        if not is_converted(gguf_path, out_dir, dtype):  # else another process just did it
            shutil.rmtree(out_dir, ignore_errors=True)
            try:
                os.replace(tmp_dir, out_dir)
            except OSError:
                if not is_converted(gguf_path, out_dir, dtype):
                    raise
    except Exception as exc:  # a truncated or odd file too: say which, in one line
        kind = "" if isinstance(exc, ValueError) else f"{type(exc).__name__}: "
        raise ValueError(f"cannot convert {gguf_path}: {kind}{exc}") from exc
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir


def remove_abandoned(target: str) -> None:
    """Remove what writers killed midway left beside `target` (target.partial-PID[-*], a
    directory or a file, PID no longer running; or the single .partial of earlier versions)."""
    for path in glob.glob(glob.escape(target) + ".partial*"):
        pid = path[len(target):].removeprefix(".partial").lstrip("-").split("-")[0]
        if pid.isdigit():
            try:
                os.kill(int(pid), 0)
                continue  # still converting
            except ProcessLookupError:
                pass
            except PermissionError:  # another user's, running
                continue
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.remove(path)


def _write_conversion(gguf_path: str, tmp_dir: str, dtype: torch.dtype) -> None:
    import gguf
    from safetensors.torch import save_file

    reader = gguf.GGUFReader(gguf_path)
    meta = read_metadata(reader)
    names = {t.name for t in reader.tensors}
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    config = hf_config(meta, tied="output.weight" not in names, dtype=dtype,
                       vocab_size=None if embedding is None else int(embedding.shape[-1]))
    factors = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1).tolist()
               for t in reader.tensors if t.name in _ROPE_TENSORS}
    if "rope_freqs.weight" in factors:
        config["rope_scaling"] = llama3_scaling(factors.pop("rope_freqs.weight"), config["rope_theta"],
                                                config["head_dim"])
    if factors:
        config["rope_scaling"] = _longrope_config(meta, factors, config)
    permuted = ARCHS[meta["general.architecture"]][2]
    os.makedirs(tmp_dir)
    tensors: dict[str, torch.Tensor] = {}
    blocks: dict[str, QuantizedWeight] = {}
    for t in tqdm(reader.tensors, desc=f"Converting {os.path.basename(gguf_path)}", unit="tensor"):
        if t.name in _ROPE_TENSORS:
            continue  # (in config.json's rope_scaling)
        name = hf_name(t.name, meta["general.architecture"])

        def unpermuted(rows: np.ndarray) -> np.ndarray:
            if permuted and name.endswith("q_proj.weight"):
                return reverse_permute(rows, config["num_attention_heads"])
            if permuted and name.endswith("k_proj.weight"):
                return reverse_permute(rows, config["num_key_value_heads"])
            return rows

        # GGUF shapes list the fastest-varying dimension first: reverse for numpy.
        array = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        if meta["general.architecture"] in _GEMMA and name.endswith("norm.weight"):
            array = array - 1.0  # llama.cpp stores Gemma's norms as 1 + w
        tensors[name] = torch.from_numpy(np.require(unpermuted(array), np.float32, ["C", "W"])).to(dtype)
        kind = t.tensor_type.name.lower()
        if kind in BLOCKS and array.ndim == 2:  # kept as they are too, whole rows moved
            rows = np.array(unpermuted(np.asarray(t.data).reshape(array.shape[0], -1)))
            blocks[name] = QuantizedWeight(kind, torch.from_numpy(rows))
    save_file(tensors, os.path.join(tmp_dir, "model.safetensors"), metadata={"format": "pt"})
    save_blocks(os.path.join(tmp_dir, BLOCKS_FILE), blocks)
    with open(os.path.join(tmp_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    _write_generation_config(tmp_dir, config, meta, _convert_tokenizer(gguf_path, tmp_dir, meta))
    with open(os.path.join(tmp_dir, MARKER), "w", encoding="utf-8") as f:
        json.dump(source_stamp(gguf_path, dtype), f)


def _write_generation_config(out_dir: str, config: dict[str, Any], meta: dict[str, Any], tokenizer) -> None:
    """generation_config.json's EOS IDs where a chat turn ends on a token other than the EOS:
    the GGUF's eot_token_id, and the end-of-turn tokens its vocabulary holds."""
    ids = [config["eos_token_id"]] if isinstance(config.get("eos_token_id"), int) else []
    vocab = tokenizer.get_vocab()
    eot = meta.get("tokenizer.ggml.eot_token_id")
    for token in ([eot] if isinstance(eot, int) else []) + [vocab[t] for t in _END_OF_TURN if t in vocab]:
        if token not in ids:
            ids.append(token)
    if len(ids) > 1:
        with open(os.path.join(out_dir, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump({"eos_token_id": ids}, f, indent=2)


def _convert_tokenizer(gguf_path: str, out_dir: str, meta: dict[str, Any]):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    where = dict(pretrained_model_name_or_path=os.path.dirname(os.path.abspath(gguf_path)),
                 gguf_file=os.path.basename(gguf_path))
    try:
        tok = AutoTokenizer.from_pretrained(**where)
    except ValueError:  # an architecture whose config transformers cannot read from GGUF (granite,
        tok = PreTrainedTokenizerFast.from_pretrained(**where)  # smollm3): the tokenizer alone
    template = meta.get("tokenizer.chat_template")
    if template:
        tok.chat_template = template
    tok.save_pretrained(out_dir)
    return tok


def source_stamp(gguf_path: str, dtype: torch.dtype) -> dict[str, Any]:
    """What a converted directory was made from: a changed file means a new conversion."""
    st = os.stat(gguf_path)
    return {"path": os.path.abspath(gguf_path), "size": st.st_size, "mtime": int(st.st_mtime),
            "dtype": str(dtype), "blocks": BLOCKS_FILE}


def is_converted(gguf_path: str, out_dir: str, dtype: torch.dtype) -> bool:
    try:
        with open(os.path.join(out_dir, MARKER), encoding="utf-8") as f:
            return json.load(f) == source_stamp(gguf_path, dtype)
    except (OSError, ValueError):
        return False
