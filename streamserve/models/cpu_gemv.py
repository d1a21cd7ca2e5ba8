"""The CPU's small-step GEMV (csrc/gemv.c): half-size weights, float32 vectors and results.

Built once per machine with the system C compiler into `$STREAMSERVE_CACHE/kernels`
(a second or two), then loaded with ctypes. Where it cannot be used (not x86-64 with
AVX2, no compiler, `STREAMSERVE_CPU_GEMV=0`), `load()` returns None and the layers
keep using torch's own GEMMs. The shared library links the OpenMP runtime that torch
has already loaded, so both share one thread pool and `torch.set_num_threads`.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from typing import Callable, Optional

import torch

logger = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "gemv.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]

Gemv = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _usable() -> Optional[str]:
    """Why the kernel cannot run here, or None when it can."""
    if os.environ.get("STREAMSERVE_CPU_GEMV", "1") == "0":
        return "STREAMSERVE_CPU_GEMV=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"{platform.machine()} is not x86-64"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return "the CPU has no AVX2"
    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")):
        return "no C compiler (cc) found"
    return None


def _build(compiler: str) -> str:
    from streamserve.models.resolve import cache_dir

    with open(SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(source + " ".join([compiler, *FLAGS, platform.node()]).encode()).hexdigest()[:16]
    out_dir = os.path.join(cache_dir(), "kernels")
    target = os.path.join(out_dir, f"gemv-{key}.so")
    if os.path.exists(target):
        return target
    os.makedirs(out_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, SOURCE, "-o", tmp], check=True, capture_output=True, text=True)
        os.replace(tmp, target)  # atomic: two processes building at once both end up with one file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@lru_cache(maxsize=None)
def load() -> Optional[dict[torch.dtype, Gemv]]:
    """{weight dtype: gemv(x [M, K] float32, w [N, K]) -> [M, N] float32}, or None."""
    reason = _usable()
    if reason is None:
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        try:
            lib = ctypes.CDLL(_build(compiler))
        except (OSError, subprocess.CalledProcessError) as exc:
            reason = f"building {SOURCE} failed: {getattr(exc, 'stderr', None) or exc}"
    if reason is not None:
        logger.info("CPU GEMV kernel not used (%s): small steps use torch's GEMMs", reason)
        return None
    kernels = {}
    for dtype, name in ((torch.bfloat16, "gemv_bf16"), (torch.float16, "gemv_f16")):
        fn = getattr(lib, name)
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3
        fn.restype = None
        kernels[dtype] = _wrap(fn)
    return kernels


def _wrap(fn) -> Gemv:
    def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        (m, k), n = x.shape, w.shape[0]
        y = torch.empty(m, n)
        fn(x.data_ptr(), w.data_ptr(), y.data_ptr(), m, n, k)
        return y
    return gemv
