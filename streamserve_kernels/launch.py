"""Programmatic dependent launch (PDL), on Hopper and later GPUs.

A decode step at batch 1 is a chain of short kernels, and each one-row product (gemv) spends
its first microseconds waiting for the kernel before it to finish and for its own programs to
start. Launched with PDL, a product's programs start while the kernel before it runs (once
that kernel's programs have all begun and let it, `let_next_launch`), read their first tile
of the weight, which no kernel writes, and only then wait for the kernel before to finish and
its writes to be seen (`wait_for_inputs`) before they read their input or write anything.

`pdl(device)` says whether the kernels use it there: a CUDA device of compute capability 9
or more, with triton's grid dependency control, while ENABLED (scripts/gpu_check.py turns it
off to time a step without it). The instructions are never compiled elsewhere; the
interpreter (TRITON_INTERPRET=1) never sees them.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

ENABLED = True


def pdl(device: torch.device) -> bool:
    """Whether the kernels on `device` launch with PDL and take its instructions (their PDL constexpr)."""
    return ENABLED and device.type == "cuda" and _supported(device.index)


@contextlib.contextmanager
def disabled():
    """Kernels launched within launch without PDL (ENABLED as it was after)."""
    global ENABLED
    was, ENABLED = ENABLED, False
    try:
        yield
    finally:
        ENABLED = was


@functools.lru_cache(maxsize=None)
def _supported(index) -> bool:
    gdc = getattr(getattr(getattr(tl, "extra", None), "cuda", None), "gdc_wait", None)
    return gdc is not None and torch.cuda.get_device_capability(index)[0] >= 9


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """Wait for the kernel before to finish, its writes seen (a kernel launched with PDL, before
    it reads what another kernel wrote or writes anything)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def let_next_launch(PDL: tl.constexpr):
    """Let the next kernel, if launched with PDL, start its programs (they wait_for_inputs)."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
