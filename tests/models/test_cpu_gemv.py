"""The CPU GEMV kernel (half-size weights, float32 vectors) against float32 math, and a
bfloat16 model whose small steps run on it against transformers."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from parity import check_parity
from streamserve import LLM
from streamserve.models import cpu_gemv
from streamserve.worker.model_runner import choose_dtypes

kernels = cpu_gemv.load()
needs_kernel = pytest.mark.skipif(kernels is None, reason="the CPU GEMV kernel does not build here "
                                  "(needs x86-64 with AVX2 and a C compiler)")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 4, 5, 16])
@pytest.mark.parametrize("n,k", [(37, 577), (64, 64), (5, 7)])
def test_kernel_matches_float32(dtype, m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen).to(dtype)
    y = kernels[dtype](x, w)
    ref = x.double() @ w.double().t()
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5


@needs_kernel
def test_kernel_reads_strided_input():
    x = torch.randn(8, 64)[::2]  # every other row: not contiguous
    w = torch.randn(16, 64).to(torch.bfloat16)
    torch.testing.assert_close(kernels[torch.bfloat16](x, w), x @ w.float().t(), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def bf16_llama_dir(llama_dir, tmp_path_factory):
    """The tiny Llama with its weights rounded to bfloat16 and saved so."""
    import shutil
    path = tmp_path_factory.mktemp("bf16") / "llama"
    shutil.copytree(llama_dir, path)
    weights = load_file(str(path / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return str(path)


@needs_kernel
def test_bfloat16_model_small_steps_match_transformers(bf16_llama_dir):
    """Prefill runs the float32 GEMMs, every decode step the kernel over the bfloat16
    copies: transformers in float32 on the same (bfloat16-valued) weights is the oracle."""
    if choose_dtypes(torch.bfloat16, torch.device("cpu"))[1] is None:
        pytest.skip("this CPU computes bfloat16 natively: no low-precision copies")
    llm = LLM(bf16_llama_dir, dtype="bfloat16", kv_cache_memory="32MiB")
    runner = llm.engine_core.model_runner
    assert runner.use_low_precision and runner.model.lm_head.gemv is kernels[torch.bfloat16]
    check_parity(llm, bf16_llama_dir)
