"""Triton kernels for the GPU path, each with a plain-torch reference beside it.

    attention   paged_attention (a mixed batch of prefill chunks and decodes),
                paged_decode_attention + DecodeWorkspace + choose_num_splits (split-KV decode)
    cache       reshape_and_cache (K/V of the step's tokens into their slots)
    norm        rms_norm, fused_add_rms_norm
    rotary      rotary_embedding (q and k in place)
    activation  silu_and_mul
    gemv        gemv, normed_gemv (one-row products, the batch-1 step's)
    sampling    argmax (greedy decoding's choice)

Those submodules import triton; this package imports nothing, so `import streamserve_kernels`
works where triton is not installed, and the CPU path compiles nothing.
"""

from __future__ import annotations

import importlib.util


def triton_available() -> bool:
    """Whether the kernel submodules can be imported here."""
    return importlib.util.find_spec("triton") is not None
