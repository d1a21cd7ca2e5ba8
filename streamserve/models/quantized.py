"""A GGUF model's quantized weights, kept as they are for the CPU's smallest steps.

A GGUF file is converted once into a Hugging Face directory (gguf_convert.py), with its
weights dequantized; that is what transformers reads and what most steps compute with.
But a step of a token or two is bound by reading the weights, and GGUF's blocks are 2-3.5x
smaller than even bfloat16 copies: the conversion also keeps the Q4_0, Q4_1 and Q8_0
matrices' blocks as they are (BLOCKS_FILE, beside the weights; other types have only the
dequantized path), and for those steps the CPU kernels read them: the weights' exact
values, against activations rounded to int16 per block of 32 (csrc/cpu_kernels.c).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

import torch

# GGUF block type -> bytes per block of 32 weights (the kernels' layout is GGUF's own)
BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34}
BLOCKS_FILE = "gguf-blocks.safetensors"


@dataclass
class QuantizedWeight:
    """A [rows, cols] weight as GGUF blocks: uint8 [rows, cols / 32 * BLOCK_BYTES[kind]]."""

    kind: str
    blocks: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        rows, row_bytes = self.blocks.shape
        return rows, row_bytes // BLOCK_BYTES[self.kind] * 32

    @staticmethod
    def stacked(parts: list["QuantizedWeight"]) -> Optional["QuantizedWeight"]:
        """The parts' rows one after another (a fused layer), or None unless all are one kind."""
        if len({p.kind for p in parts}) != 1 or len({p.blocks.shape[1] for p in parts}) != 1:
            return None
        return QuantizedWeight(parts[0].kind, torch.cat([p.blocks for p in parts]).contiguous())

    def dequantize(self) -> torch.Tensor:
        """The float32 weight (the reference the kernels are tested against)."""
        import gguf

        qtype = gguf.GGMLQuantizationType[self.kind.upper()]
        return torch.from_numpy(gguf.quants.dequantize(self.blocks.numpy(), qtype).reshape(self.shape))


def save_blocks(path: str, weights: dict[str, QuantizedWeight]) -> None:
    from safetensors.torch import save_file

    save_file({name: w.blocks for name, w in weights.items()}, path,
              metadata={"kinds": json.dumps({name: w.kind for name, w in weights.items()})})


def read_quantized(model_dir: str) -> dict[str, QuantizedWeight]:
    """The blocks a GGUF conversion kept (Hugging Face name -> QuantizedWeight), or {}."""
    from safetensors import safe_open

    path = os.path.join(model_dir, BLOCKS_FILE)
    if not os.path.isfile(path):
        return {}
    with safe_open(path, framework="pt") as f:
        kinds = json.loads(f.metadata()["kinds"])
        return {name: QuantizedWeight(kinds[name], f.get_tensor(name)) for name in f.keys()}
