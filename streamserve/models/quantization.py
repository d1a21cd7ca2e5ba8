"""Quantized Hugging Face checkpoints: config.json's quantization_config, read at load.

vLLM serves AWQ, GPTQ, compressed-tensors (llm-compressor's) and FP8 checkpoints with kernels
of their own. Here each quantized linear layer's weight is dequantized as it is read, into the
dtype the model computes in, so every path (the C step, torch, Triton and its CUDA graphs)
runs such a model unchanged; and where the weight is 4-bit integers in groups of a multiple
of 32 (or symmetric 8-bit ones), it is also regrouped into GGUF's blocks (Q4_0 where the zero
is the middle, Q4_1 otherwise, Q8_0), which the CPU's quantized GEMV reads for the smallest
steps as it reads a GGUF's (models/quantized.py): a 4-bit checkpoint's decode then reads
about a third of bfloat16's bytes.

Activations are not quantized: a W8A8 checkpoint (int8 or FP8 activations in vLLM) computes
them in the model's dtype, as transformers does with its quantization turned off.

Each layout, as the tools that write it lay it out (the weight W is [out, in]):

- AWQ (AutoAWQ's GEMM version): `qweight` int32 [in, out / 8], eight 4-bit values a word in
  the order 0, 2, 4, 6, 1, 3, 5, 7 of their columns; `qzeros` int32 [in / group, out / 8]
  the same way; `scales` [in / group, out]. W = (q - zero) * scale, transposed.
- GPTQ (AutoGPTQ's, GPTQModel's): `qweight` int32 [in * bits / 32, out], values packed along
  `in` from the lowest bits; `qzeros` [groups, out * bits / 32] packed along `out`, each one
  less than the zero (checkpoint_format "gptq"; "gptq_v2" stores the zero itself); `scales`
  [groups, out]; `g_idx` [in], the group of each input (act-order's are not contiguous).
- compressed-tensors: `weight_packed` int32 [out, in * bits / 32] packed along `in` (value
  + 2^(bits-1), lowest bits first), `weight_shape`; or `weight` int8 / float8_e4m3fn as it is;
  `weight_scale` of one value, one a row, one a group of a row, or one a block;
  `weight_zero_point` (asymmetric) packed along `out` the same way; `weight_g_idx`.
- FP8 (`quant_method: "fp8"`, Qwen3's and DeepSeek's FP8 checkpoints): `weight`
  float8_e4m3fn and `weight_scale_inv`, one a block of `weight_block_size`. W = weight * it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional, Union

import torch

from streamserve.models.quantized import QuantizedWeight

METHODS = ("awq", "gptq", "compressed-tensors", "fp8")
# vLLM's names of its kernels for these (--quantization awq_marlin ...): the same checkpoints
ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq", "compressed_tensors": "compressed-tensors"}
# compressed-tensors' formats whose weights this reads (and those it refuses name themselves)
CT_FORMATS = ("pack-quantized", "naive-quantized", "int-quantized", "float-quantized")
# tensors of a quantized layer that scale its activations or its KV cache, which are not quantized here
DROPPED = ("input_scale", "output_scale", "k_scale", "v_scale", "q_scale", "kv_scale")
# the parts a quantized layer's weight is stored as (one of the first group marks it quantized)
MARKS = ("qweight", "weight_packed", "weight_scale", "weight_scale_inv")
PARTS = MARKS + ("qzeros", "scales", "g_idx", "weight_shape", "weight_zero_point", "weight_g_idx", "weight")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column of each 4-bit value of an AWQ word


def quantization_config(hf_config: dict) -> Optional[dict]:
    """config.json's quantization_config (compressed-tensors' earlier checkpoints: compression_config)."""
    return hf_config.get("quantization_config") or hf_config.get("compression_config")


def checkpoint_method(hf_config: dict, asked: Optional[str], from_gguf: bool = False) -> Optional[str]:
    """The checkpoint's quantization method (None: not quantized, or a GGUF's conversion),
    checked against `asked` (--quantization) and against what this reads; a sentence where it
    cannot be served."""
    config = quantization_config(hf_config)
    method = config.get("quant_method") if isinstance(config, dict) else None
    method = ALIASES.get(method, method)
    if asked == "gguf" and from_gguf:  # (vLLM's name for a GGUF file's quantization: models/quantized.py)
        return None
    if asked is not None and ALIASES.get(asked, asked) != method:
        have = (f"is quantized with {method!r}" if method else "is a GGUF file's" if from_gguf
                else "is not quantized")
        raise ValueError(f"quantization {asked!r} was asked for, but the checkpoint {have} (this server "
                         "reads a checkpoint's own quantization and quantizes nothing itself)")
    if method is None:
        return None
    if method not in METHODS:
        raise ValueError(f"the checkpoint's quantization method {method!r} is not supported: "
                         f"its quantization_config must be one of {', '.join(METHODS)}")
    check = {"awq": _check_awq, "gptq": _check_gptq, "compressed-tensors": _check_ct, "fp8": _check_fp8}
    check[method](config)
    return method


def _check_awq(config: dict) -> None:
    if str(config.get("version", "gemm")).lower() != "gemm" or config.get("bits", 4) != 4:
        raise ValueError(f"AWQ checkpoints are read in AutoAWQ's 4-bit GEMM layout; this one is version "
                         f"{config.get('version')!r}, {config.get('bits')} bits")


def _check_gptq(config: dict) -> None:
    # GPTQModel's per-layer overrides ("+:regex": {"bits": 8, ...}) may set other widths
    overrides = [o for o in (config.get("dynamic") or {}).values() if isinstance(o, dict) and "bits" in o]
    for bits in [config.get("bits", 4)] + [o["bits"] for o in overrides]:
        if bits not in (4, 8):
            raise ValueError(f"GPTQ checkpoints of 4 or 8 bits are read; this one has {bits}")
    if config.get("is_marlin_format"):
        raise ValueError("GPTQ checkpoints saved in Marlin's layout (is_marlin_format) are not read")
    if config.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ's checkpoint_format {config.get('checkpoint_format')!r} is not read "
                         "(gptq and gptq_v2 are)")


def _check_ct(config: dict) -> None:
    groups = config.get("config_groups") or {}
    for name, group in groups.items():
        weights = group.get("weights")
        if not weights:  # a group of activations or of the KV cache only, which are not quantized here
            continue
        fmt = group.get("format") or config.get("format")
        kind, bits = weights.get("type", "int"), weights.get("num_bits")
        if fmt not in CT_FORMATS:
            raise ValueError(f"compressed-tensors' format {fmt!r} (group {name!r}) is not read; "
                             f"these are: {', '.join(CT_FORMATS)}")
        # (float8 weights without quantized activations are written naive-quantized)
        readable = {("int", 4): ("pack-quantized", "naive-quantized"),
                    ("int", 8): ("pack-quantized", "naive-quantized", "int-quantized"),
                    ("float", 8): ("float-quantized", "naive-quantized")}
        if fmt not in readable.get((kind, bits), ()):
            raise ValueError(f"compressed-tensors' {kind} weights of {bits} bits in format {fmt!r} "
                             f"(group {name!r}) are not read: int4, int8 and float8 ones are")
    sparsity = config.get("sparsity_config") or {}
    if sparsity and (sparsity.get("format", "dense") != "dense" or sparsity.get("targets")):
        # (llm-compressor notes a dense model's sparsity as "format": "dense": nothing to read)
        raise ValueError("compressed-tensors' sparse checkpoints are not read")
    if config.get("transform_config"):
        raise ValueError("compressed-tensors' transforms (rotations of the weights) are not read")


def _check_fp8(config: dict) -> None:
    if str(config.get("fmt", "e4m3")).lower() != "e4m3":
        raise ValueError(f"FP8 checkpoints of format e4m3 are read; this one is {config.get('fmt')!r}")


@dataclass
class IntWeight:
    """A [rows, cols] weight as unsigned integers of `bits` with a scale and a zero (on the same
    unsigned scale) per row and group of columns: W[r, c] = (q[r, c] - zero[r, g]) * scale[r, g],
    g = g_idx[c], or c // (cols / groups) where g_idx is None."""

    bits: int
    q: torch.Tensor  # uint8 [rows, cols]
    scale: torch.Tensor  # float32 [rows, groups]
    zero: torch.Tensor  # int16 [rows, groups]
    g_idx: Optional[torch.Tensor] = None  # int64 [cols]

    def group_of_columns(self) -> torch.Tensor:
        cols, groups = self.q.shape[1], self.scale.shape[1]
        if self.g_idx is not None:
            return self.g_idx
        return torch.arange(cols) // (cols // groups)

    def dequantize(self) -> torch.Tensor:
        g = self.group_of_columns()
        return (self.q.to(torch.float32) - self.zero[:, g].to(torch.float32)) * self.scale[:, g]

    def blocks(self) -> Optional[QuantizedWeight]:
        """The weight as GGUF blocks of 32 for the quantized GEMV, or None where it is no such:
        4-bit (Q4_0 where every zero is 8, else Q4_1) or symmetric 8-bit (Q8_0), in contiguous
        groups of a multiple of 32, with scales in float16's normal range. (The blocks' scales
        are float16: a float32 scale, and Q4_1's minimum -zero * scale, rounded to within 2^-11.)"""
        rows, cols = self.q.shape
        groups = self.scale.shape[1]
        middle = 1 << (self.bits - 1)
        symmetric = bool((self.zero == middle).all())
        if cols % 32 or (cols // groups) % 32 or cols % groups or (self.bits == 8 and not symmetric):
            return None
        if self.g_idx is not None and not torch.equal(self.g_idx, torch.arange(cols) // (cols // groups)):
            return None
        scale = self.scale.half()  # (a float16 or bfloat16 scale as it is; a float32 one within 2^-11)
        if not (torch.isfinite(scale).all() and ((scale.float() - self.scale).abs() <= self.scale.abs() / 2048).all()):
            return None
        per_block = (cols // groups) // 32
        d = scale.repeat_interleave(per_block, dim=1).reshape(rows, cols // 32, 1)
        q = self.q.reshape(rows, cols // 32, 32)
        if self.bits == 8:
            values = (q.to(torch.int16) - middle).to(torch.int8).view(torch.uint8)
            parts, kind = [d.view(torch.uint8).reshape(rows, cols // 32, 2), values], "q8_0"
        else:
            nibbles = q[:, :, :16] | (q[:, :, 16:] << 4)  # GGUF's: value j low, value j + 16 high
            parts, kind = [d.view(torch.uint8).reshape(rows, cols // 32, 2)], "q4_0"
            if not symmetric:
                zero = self.zero.repeat_interleave(per_block, dim=1).reshape(rows, cols // 32, 1)
                m = (-(zero.to(torch.float32)) * d.float()).half()
                parts.append(m.view(torch.uint8).reshape(rows, cols // 32, 2))
                kind = "q4_1"
            parts.append(nibbles)
        return QuantizedWeight(kind, torch.cat(parts, dim=2).reshape(rows, -1).contiguous())


# -- unpacking ----------------------------------------------------------------


def unpack_int32(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words of 32 / bits values each, lowest bits first -> uint8 [..., words * 32 / bits]
    (a word's bytes read lowest first: a little-endian machine's, as every one torch runs on)."""
    as_bytes = packed.contiguous().reshape(-1).view(torch.uint8)  # (flat: a [n, 1] one may have strides of n)
    if bits == 8:
        return as_bytes.reshape(*packed.shape[:-1], -1)
    return torch.stack((as_bytes & 0xF, as_bytes >> 4), dim=-1).reshape(*packed.shape[:-1], -1)


def _awq(parts: dict[str, torch.Tensor], config: dict) -> IntWeight:
    order = torch.tensor(AWQ_ORDER)
    inverse = torch.argsort(order)  # column c of a word is its value inverse[c]

    def unpack(words: torch.Tensor) -> torch.Tensor:
        values = unpack_int32(words, 4).reshape(words.shape[0], -1, 8)
        return values[:, :, inverse].reshape(words.shape[0], -1)

    q = unpack(parts["qweight"]).T.contiguous()  # [out, in]
    scale = parts["scales"].to(torch.float32).T.contiguous()
    if "qzeros" in parts:
        zero = unpack(parts["qzeros"]).T.to(torch.int16).contiguous()
    else:  # zero_point false: symmetric about 8
        zero = torch.full_like(scale, 8, dtype=torch.int16)
    return IntWeight(4, q, scale, zero)


def _gptq(parts: dict[str, torch.Tensor], config: dict) -> IntWeight:
    # the layer's own width (GPTQModel's "dynamic" may override the config's): zeros per output
    bits = parts["qzeros"].shape[1] * 32 // parts["scales"].shape[1]
    if bits not in (4, 8):
        raise ValueError(f"{bits}-bit layer ({tuple(parts['qzeros'].shape)} zeros for "
                         f"{parts['scales'].shape[1]} outputs): 4 and 8 bits are read")
    words = parts["qweight"]  # [in * bits / 32, out], packed along in
    per_word = 32 // bits
    q = unpack_int32(words.T.contiguous(), bits)  # [out, in]
    zero = unpack_int32(parts["qzeros"], bits).to(torch.int16)  # [groups, out (padded to the word)]
    scale = parts["scales"].to(torch.float32)
    zero = zero[:, :scale.shape[1]]
    if config.get("checkpoint_format", "gptq") == "gptq":
        zero = zero + 1  # (v1 stores each zero less one)
    cols = words.shape[0] * per_word
    g_idx = parts.get("g_idx")
    if g_idx is None:  # (in order: the config's group size, which need not divide the inputs)
        group_size = config.get("group_size", 128)
        g_idx = torch.arange(cols) // (cols if group_size in (None, -1) else group_size)
    g_idx = g_idx.to(torch.int64)
    if g_idx.shape[0] != cols:
        raise ValueError(f"GPTQ g_idx has {g_idx.shape[0]} entries for {cols} inputs")
    return IntWeight(bits, q, scale.T.contiguous(), zero.T.contiguous(), g_idx)


def _ct_int(parts: dict[str, torch.Tensor]) -> IntWeight:
    scale = parts["weight_scale"].to(torch.float32)
    if "weight_packed" in parts:
        rows, cols = (int(v) for v in parts["weight_shape"].tolist())
        packed = parts["weight_packed"]
        bits = packed.shape[1] * 32 // cols if cols else 4
        if bits not in (4, 8):
            raise ValueError(f"compressed-tensors weight of {bits} bits ({tuple(packed.shape)} words for "
                             f"{cols} columns): int4 and int8 are read")
        q = unpack_int32(packed, bits)[:, :cols]  # value + 2^(bits-1)
    else:  # int8 as it is
        bits = 8
        q = (parts["weight"].to(torch.int16) + 128).to(torch.uint8)
        rows, cols = q.shape
    scale = _per_row(scale, rows, cols)
    middle = 1 << (bits - 1)
    zero_point = parts.get("weight_zero_point")
    if zero_point is None:
        zero = torch.full(scale.shape, middle, dtype=torch.int16)
    elif zero_point.dtype == torch.int32 and zero_point.shape[0] != rows:  # packed along rows
        zero = unpack_int32(zero_point.T.contiguous(), bits)[:, :rows].T.to(torch.int16)
    else:
        zero = zero_point.to(torch.int16).reshape(scale.shape) + middle
    g_idx = parts.get("weight_g_idx")
    return IntWeight(bits, q, scale, zero.contiguous(), g_idx.to(torch.int64) if g_idx is not None else None)


def _per_row(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A tensor's, a row's or a row's groups' scales as [rows, groups]."""
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(rows, 1).contiguous()
    scale = scale.reshape(scale.shape[0], -1)
    if scale.shape[0] != rows or cols % scale.shape[1]:
        raise ValueError(f"a scale of shape {tuple(scale.shape)} fits no grouping of a [{rows}, {cols}] weight")
    return scale


def _scaled(weight: torch.Tensor, scale: torch.Tensor, block: Optional[list]) -> torch.Tensor:
    """A float8 weight times its scale: one value, one a row, one a group of a row, or one a
    block of `block` (as the scale's shape says)."""
    w = weight.to(torch.float32)
    rows, cols = w.shape
    scale = scale.to(torch.float32)
    if scale.dim() == 2 and scale.shape[0] != rows and scale.numel() > 1:  # blocks
        if not block:  # (the scales' shape does not say it: 1000 rows in blocks of 128 have 8, as of 125)
            raise ValueError(f"a block scale of shape {tuple(scale.shape)} for a [{rows}, {cols}] weight, "
                             "but the checkpoint's config gives no one block size")
        b_rows, b_cols = block
        if (-(-rows // b_rows), -(-cols // b_cols)) != tuple(scale.shape):
            raise ValueError(f"a block scale of shape {tuple(scale.shape)} does not fit a [{rows}, {cols}] "
                             f"weight in blocks of {b_rows}x{b_cols}")
        full = scale.repeat_interleave(b_rows, 0)[:rows].repeat_interleave(b_cols, 1)[:, :cols]
        return w * full
    per_row = _per_row(scale, rows, cols)
    return w * per_row.repeat_interleave(cols // per_row.shape[1], dim=1)


# -- reading a checkpoint -------------------------------------------------------


def quantized_names(names: Iterable[str]) -> dict[str, tuple]:
    """Of a quantized checkpoint's tensor `names`, the weights stored quantized, by the names they
    load as (".weight"): name -> () (LlamaForCausalLM.quantized_layers' form, kinds unknown)."""
    quantized = {}
    for name in names:
        prefix, _, part = name.rpartition(".")
        if part in MARKS:
            quantized[f"{prefix}.weight"] = ()
    return quantized


class Dequantizer:
    """Turns a quantized checkpoint's tensors, as they are read, into the plain ones the model
    loads: each quantized layer's parts, once all have come, as one float32 `.weight` (and its
    GGUF blocks, in `blocks`, when `keep_blocks`); everything else as it is.

    With `blocks_only` (the CPU's --cpu-weights quantized), a layer whose weights all become
    blocks of one kind and row width gives those alone, no `.weight` (its name goes into
    `unread`): "a layer" as the model fuses them, `fused(prefix)` naming the checkpoint layers
    that make up prefix's (q, k and v; gate and up), which wait for each other."""

    def __init__(self, method: str, config: dict, names: Iterable[str], keep_blocks: bool,
                 blocks_only: bool = False, fused: Optional[Callable[[str], list[str]]] = None) -> None:
        self.method, self.config, self.keep_blocks = method, config, keep_blocks
        self.blocks: dict[str, QuantizedWeight] = {}
        self.blocks_only, self.fused = blocks_only and keep_blocks, fused or (lambda prefix: [prefix])
        self.unread: set[str] = set()
        self.waiting: dict[str, IntWeight] = {}  # (blocks_only: layers whose fused siblings have not come)
        # each quantized layer's parts, from the checkpoint's names (its shards may split them)
        found: dict[str, set[str]] = {}
        for name in names:
            prefix, _, part = name.rpartition(".")
            if part in PARTS or part in DROPPED:
                found.setdefault(prefix, set()).add(part)
        self.expected = {prefix: parts for prefix, parts in found.items() if parts & set(MARKS)}
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self.block_shape = self._block_shape()

    def _block_shape(self) -> Optional[list]:
        if self.method == "fp8":
            return self.config.get("weight_block_size")
        shapes = {tuple((g.get("weights") or {}).get("block_structure") or ())
                  for g in (self.config.get("config_groups") or {}).values()} - {()}
        return list(shapes.pop()) if len(shapes) == 1 else None

    def __call__(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in tensors:
            prefix, _, part = name.rpartition(".")
            if part in DROPPED and prefix not in self.expected:  # (an attention's KV cache scales)
                continue
            if prefix not in self.expected or part not in self.expected[prefix]:  # (a bias: as it is)
                yield name, tensor
                continue
            parts = self.pending.setdefault(prefix, {})
            parts[part] = tensor
            if len(parts) == len(self.expected[prefix]):
                del self.pending[prefix]
                yield from self.layer(prefix, parts)
        for prefix in list(self.waiting):  # (a sibling that never came is the pending error's below)
            if not self.pending:
                yield f"{prefix}.weight", self.weight(prefix, self.waiting.pop(prefix))
        if self.pending:
            prefix, parts = next(iter(self.pending.items()))
            raise ValueError(f"the checkpoint's quantized layer {prefix!r} lacks "
                             f"{sorted(self.expected[prefix] - set(parts))}")

    def layer(self, prefix: str, parts: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """What the model loads of a quantized layer once its parts have come."""
        ints, siblings = self.ints(prefix, parts), self.fused(prefix)
        # (a fused layer whose parts are not all quantized reads its weight whole; so does one whose
        # fused() is empty: a head tied to the embedding)
        if (not isinstance(ints, IntWeight) or not self.blocks_only or not siblings
                or not all(p in self.expected for p in siblings)):
            yield f"{prefix}.weight", self.weight(prefix, ints)
            return
        self.waiting[prefix] = ints
        if not all(p in self.waiting for p in siblings):
            return
        held = [self.waiting.pop(p) for p in siblings]
        blocks = [ints.blocks() for ints in held]
        if all(b is not None for b in blocks) and len({(b.kind, b.blocks.shape[1]) for b in blocks}) == 1:
            for p, b in zip(siblings, blocks):
                self.blocks[f"{p}.weight"] = b
                self.unread.add(f"{p}.weight")
            return
        for p, ints in zip(siblings, held):
            yield f"{p}.weight", self.weight(p, ints)

    def ints(self, prefix: str, parts: dict[str, torch.Tensor]) -> Union["IntWeight", torch.Tensor]:
        """A layer's integers (IntWeight), or its float weight where the format stores floats (FP8)."""
        try:
            if self.method == "fp8" or (self.method == "compressed-tensors" and "weight" in parts
                                        and parts["weight"].is_floating_point()):
                scale = parts.get("weight_scale_inv", parts.get("weight_scale"))
                return _scaled(parts["weight"], scale, self.block_shape)
            read = {"awq": _awq, "gptq": _gptq}.get(self.method)
            return read(parts, self.config) if read else _ct_int(parts)
        except (KeyError, RuntimeError, IndexError, ValueError) as exc:
            raise ValueError(f"cannot read the quantized layer {prefix!r} ({', '.join(sorted(parts))}) "
                             f"as {self.method}: {exc}") from exc

    def weight(self, prefix: str, ints: Union["IntWeight", torch.Tensor]) -> torch.Tensor:
        """The layer's float32 weight (its blocks kept too, where `keep_blocks` and it has them)."""
        if not isinstance(ints, IntWeight):
            return ints
        if self.keep_blocks:
            blocks = ints.blocks()
            if blocks is not None:
                self.blocks[f"{prefix}.weight"] = blocks
        return ints.dequantize()


def describe(method: str, config: dict) -> str:
    """A line for the log: the method and what its settings say."""
    keys = ("bits", "group_size", "zero_point", "desc_act", "sym", "weight_block_size", "format")
    said = ", ".join(f"{k} {config[k]}" for k in keys if k in config and config[k] is not None)
    return f"{method}" + (f" ({said})" if said else "")
