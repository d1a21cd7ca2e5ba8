"""Greedy decoding's choice: the argmax of each row of logits, read in their own dtype.

torch's argmax of one row of a 128256-token vocabulary is one reduction kernel that takes
27 us on an H200 (2026-12-04, run 6's profile of a batch-1 step), after a 4 us cast of the
bfloat16 logits to float32: together, 3% of that step. Here a first kernel takes the
vocabulary in blocks across programs, each writing its block's largest value and that
value's first index, and a second one reduces those per row: two short launches.

The choice is torch.argmax's to the index: the first index of the largest value, a NaN
counting as larger than any number (its first NaN, if a row has one), and 0 for a row that is
-inf throughout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # vocabulary entries a program of the first pass takes


@triton.jit
def _first_largest(values, index, nan, limit):
    """(largest, its first index, any NaN) of a block: a NaN's first index where there is one."""
    has_nan = tl.max(nan.to(tl.int32), 0) > 0
    numbers = tl.where(nan, float("-inf"), values)
    largest = tl.max(numbers, 0)
    first = tl.min(tl.where(tl.where(has_nan, nan, numbers == largest), index, limit), 0)
    return largest, first, has_nan


@triton.jit
def _argmax_blocks_kernel(x_ptr, value_ptr, index_ptr, nan_ptr, V, stride_x, num_blocks, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    inside = cols < V
    x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=float("-inf")).to(tl.float32)
    largest, first, has_nan = _first_largest(x, cols, (x != x) & inside, V)
    out = row * num_blocks + block
    tl.store(value_ptr + out, largest)
    tl.store(index_ptr + out, first)
    tl.store(nan_ptr + out, has_nan.to(tl.int8))


@triton.jit
def _argmax_rows_kernel(value_ptr, index_ptr, nan_ptr, out_ptr, num_blocks, V, BLOCKS_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blocks = tl.arange(0, BLOCKS_PAD)
    ok = blocks < num_blocks
    at = row * num_blocks + blocks
    largest = tl.load(value_ptr + at, mask=ok, other=float("-inf"))
    index = tl.load(index_ptr + at, mask=ok, other=V)
    nan = tl.load(nan_ptr + at, mask=ok, other=0) > 0
    # each block's value is a number (a block's NaN shows in its flag); the blocks are in order,
    # so the first index among the winners is the row's first
    has_nan = tl.max(nan.to(tl.int32), 0) > 0
    best = tl.max(largest, 0)
    first = tl.min(tl.where(tl.where(has_nan, nan, (largest == best) & ok), index, V), 0)
    tl.store(out_ptr + row, first.to(tl.int64))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] (any float dtype) -> int64 [B], as logits.argmax(-1)."""
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"argmax takes logits [B, V] with V > 0, got {tuple(logits.shape)}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(vocab))
    num_blocks = triton.cdiv(vocab, block)
    value = torch.empty(rows * num_blocks, dtype=torch.float32, device=logits.device)
    index = torch.empty(rows * num_blocks, dtype=torch.int32, device=logits.device)
    nan = torch.empty(rows * num_blocks, dtype=torch.int8, device=logits.device)
    _argmax_blocks_kernel[(rows, num_blocks)](logits, value, index, nan, vocab, logits.stride(0), num_blocks,
                                              BLOCK=block, num_warps=8)
    _argmax_rows_kernel[(rows,)](value, index, nan, out, num_blocks, vocab,
                                 BLOCKS_PAD=max(2, triton.next_power_of_2(num_blocks)), num_warps=1)
    return out


def argmax_ref(logits: torch.Tensor) -> torch.Tensor:
    """Plain torch."""
    return logits.argmax(dim=-1)
