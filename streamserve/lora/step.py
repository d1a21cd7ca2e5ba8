"""LoRAStep: one step's adapters, added to the output of each linear layer they adapt.

A step's rows are its requests' tokens side by side (decodes, then prefill chunks); the
rows of each adapter's requests take `B (A x)` on top of the base layer's output (B holds
the scale already, adapter.py). An adapter whose rows lie in one run is a slice, so its
GEMMs read x in place; scattered rows are gathered and added back by index.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F

from streamserve.lora.adapter import LoRAAdapter

Rows = Union[slice, torch.Tensor]


class LoRAStep:
    def __init__(self, groups: list[tuple[Rows, LoRAAdapter]], row_lists: list[tuple[np.ndarray, LoRAAdapter]]) -> None:
        self.groups = groups  # for torch: each adapter's rows, a slice or an index tensor
        self.row_lists = row_lists  # for the C step (cpu_kernels.StepForward): its rows, int64, ascending

    def add(self, layer_key: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (the layer's output for x) with each adapter's delta added to its rows, in place."""
        for rows, adapter in self.groups:
            pair = adapter.weights.get(layer_key)
            if pair is None:
                continue
            a, b = pair
            if isinstance(rows, slice):
                out[rows].add_(F.linear(F.linear(x[rows], a), b))
            else:
                out.index_add_(0, rows, F.linear(F.linear(x.index_select(0, rows), a), b))
        return out

    @classmethod
    def for_rows(cls, runs: Sequence[tuple[Optional[LoRAAdapter], int]], device: torch.device) -> Optional["LoRAStep"]:
        """The step whose rows are `runs` in order: (a request's adapter or None, its rows); None
        when no row has an adapter."""
        spans: dict[LoRAAdapter, list[tuple[int, int]]] = {}
        start = 0
        for adapter, n in runs:
            if adapter is not None:
                spans_of = spans.setdefault(adapter, [])
                if spans_of and spans_of[-1][1] == start:  # continues the run before it
                    spans_of[-1] = (spans_of[-1][0], start + n)
                else:
                    spans_of.append((start, start + n))
            start += n
        if not spans:
            return None
        groups: list[tuple[Rows, LoRAAdapter]] = []
        row_lists: list[tuple[np.ndarray, LoRAAdapter]] = []
        for adapter, runs_of in spans.items():
            index = np.concatenate([np.arange(s, e, dtype=np.int64) for s, e in runs_of])
            row_lists.append((index, adapter))
            groups.append((slice(*runs_of[0]) if len(runs_of) == 1 else torch.from_numpy(index).to(device), adapter))
        return cls(groups, row_lists)
