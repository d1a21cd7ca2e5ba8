"""Kernel tests run on the CPU through Triton's interpreter.

triton 3.9 reads TRITON_INTERPRET when `@triton.jit` decorates a function (knobs.runtime.interpret),
so the variable must be set before triton and the kernel modules are imported. This file is
imported before the test modules beside it; should triton or a kernel module have been imported
earlier in the session (by another test directory), they are reloaded here so that their jit
functions become interpreted ones.

STREAMSERVE_KERNEL_TEST_DEVICE=cuda runs the same tests compiled on a GPU instead.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import zlib

import pytest
import torch

DEVICE = os.environ.get("STREAMSERVE_KERNEL_TEST_DEVICE", "cpu")

if importlib.util.find_spec("triton") is None:
    collect_ignore_glob = ["test_*.py"]
elif DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton" in sys.modules:
        # Imported earlier in this session: its own jit helpers (tl.cdiv, tl.max, tl.sum ...)
        # were decorated for compilation. Redecorate them, then the kernels, for the interpreter.
        import triton
        import triton.language
        from triton.runtime.interpreter import InterpretedFunction

        triton.knobs.runtime.interpret = True
        if not isinstance(triton.language.cdiv, InterpretedFunction):
            for module in (triton.language.standard, triton.language.random, triton.language):
                importlib.reload(module)
        for name in [n for n in sys.modules if n.startswith("streamserve_kernels.")]:
            importlib.reload(sys.modules[name])

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def device() -> str:
    return DEVICE


@pytest.fixture
def gen(request) -> torch.Generator:
    """Fresh random inputs for every case, reproducible from the test's id."""
    g = torch.Generator()
    g.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    return g
