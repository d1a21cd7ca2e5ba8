"""The kernels also compile for the GPU (sm_90), checked on a machine without one."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(importlib.util.find_spec("triton.backends.nvidia") is None,
                    reason="triton's NVIDIA backend is not installed")
def test_kernels_compile_for_sm90():
    # A separate process: this one runs triton in interpreter mode.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "compile_sm90.py"), "bf16"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("compiled")
