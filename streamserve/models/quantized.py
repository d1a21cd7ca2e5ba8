"""A GGUF model's quantized weights, kept as they are for the CPU's smallest steps.

A GGUF file is converted once into a Hugging Face directory (gguf_convert.py), with its
weights dequantized; that is what transformers reads and what most steps compute with.
But a step of a token or two is bound by reading the weights, and GGUF's blocks are 2-3.5x
smaller than even bfloat16 copies: the conversion also keeps the Q4_0, Q4_1, Q8_0 and
Q4_K matrices' blocks as they are (BLOCKS_FILE, beside the weights; other types have only the
dequantized path), and for those steps the CPU kernels read them, regrouped eight blocks at a
time at load (cpu_kernels.pack_quantized): the weights' exact values, against activations
rounded to int16 per block of 32 (csrc/cpu_kernels.c).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

# GGUF block type -> (weights, bytes) a block
BLOCKS = {"q4_0": (32, 18), "q4_1": (32, 20), "q8_0": (32, 34), "q4_k": (256, 144)}
# where each type's blocks keep their float16 scales (d, and Q4_1's m or Q4_K's dmin); the
# 32-weight types' weights follow them
SCALE_OFFSETS = {"q4_0": [0], "q4_1": [0, 2], "q8_0": [0], "q4_k": [0, 2]}
BLOCKS_FILE = "gguf-blocks.safetensors"


@dataclass
class QuantizedWeight:
    """A [rows, cols] weight as GGUF blocks: uint8 [rows, cols / weights * bytes] (BLOCKS[kind])."""

    kind: str
    blocks: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        rows, row_bytes = self.blocks.shape
        weights, size = BLOCKS[self.kind]
        return rows, row_bytes // size * weights

    @staticmethod
    def stacked(parts: list["QuantizedWeight"]) -> Optional["QuantizedWeight"]:
        """The parts' rows one after another (a fused layer), or None unless all are one kind."""
        if len({p.kind for p in parts}) != 1 or len({p.blocks.shape[1] for p in parts}) != 1:
            return None
        return QuantizedWeight(parts[0].kind, torch.cat([p.blocks for p in parts]).contiguous())

    @staticmethod
    def random(kind: str, rows: int, cols: int, generator: torch.Generator) -> "QuantizedWeight":
        """Random blocks (for tests and benchmarks): any bytes, but float16 scales of +-0.001 to 0.1."""
        weights, size = BLOCKS[kind]
        blocks = torch.randint(0, 256, (rows, cols // weights, size), dtype=torch.uint8, generator=generator)
        for offset in SCALE_OFFSETS[kind]:
            scale = torch.empty(rows, cols // weights).uniform_(0.001, 0.1, generator=generator)
            scale *= torch.randint(0, 2, scale.shape, generator=generator) * 2 - 1
            blocks[:, :, offset:offset + 2] = scale.half().view(torch.uint8).reshape(rows, cols // weights, 2)
        return QuantizedWeight(kind, blocks.reshape(rows, -1).contiguous())

    def dequantize(self) -> torch.Tensor:
        """The float32 weight (the reference the kernels are tested against)."""
        import gguf

        qtype = gguf.GGMLQuantizationType[self.kind.upper()]
        return torch.from_numpy(gguf.quants.dequantize(self.blocks.numpy(), qtype).reshape(self.shape))


def save_blocks(path: str, weights: dict[str, QuantizedWeight]) -> None:
    from safetensors.torch import save_file

    save_file({name: w.blocks for name, w in weights.items()}, path,
              metadata={"kinds": json.dumps({name: w.kind for name, w in weights.items()})})


def _from_blocks_file(model_dir: str, read: Callable) -> dict:
    """read(file, name, kind) for each tensor of a GGUF conversion's blocks file, by Hugging Face
    name, or {} where it has none."""
    from safetensors import safe_open

    path = os.path.join(model_dir, BLOCKS_FILE)
    if not os.path.isfile(path):
        return {}
    with safe_open(path, framework="pt") as f:
        kinds = json.loads(f.metadata()["kinds"])
        return {name: read(f, name, kinds[name]) for name in f.keys()}


def quantized_shapes(model_dir: str) -> dict[str, tuple[str, int, int]]:
    """What a GGUF conversion kept, without reading it: Hugging Face name -> (kind, rows, bytes a
    row), or {}."""
    return _from_blocks_file(model_dir, lambda f, name, kind: (kind, *f.get_slice(name).get_shape()))


def read_quantized(model_dir: str) -> dict[str, QuantizedWeight]:
    """The blocks a GGUF conversion kept (Hugging Face name -> QuantizedWeight), or {}."""
    return _from_blocks_file(model_dir, lambda f, name, kind: QuantizedWeight(kind, f.get_tensor(name)))
