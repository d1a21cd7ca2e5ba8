"""The CPU's C kernels: the packed GEMM (float32 vectors, weights packed in panels) against float64 math,
RMSNorm against the torch layer, and half-precision models whose steps run on the packed GEMM
against transformers (the float32 parity tests run the C RMSNorm throughout)."""

from __future__ import annotations

import contextlib
import gc
import sys
import weakref

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import quantized_checkpoints
from parity import (assert_same_greedy, check_parity, check_prompt_logprobs, hf_prompt_logprobs, parity_prompts,
                    prompt_token_logprobs, tokens_and_logprobs)
from streamserve import LLM, SamplingParams
from streamserve.models import cpu_kernels, layers, loader
from streamserve.models.layers import PackedEmbedding, RMSNorm
from streamserve.models.quantized import BLOCKS, QuantizedWeight
from streamserve.worker import model_runner

kernels = cpu_kernels.load()
needs_kernel = pytest.mark.skipif(kernels is None, reason="the CPU kernels do not build here "
                                  "(needs x86-64 with AVX2 and a C compiler)")


def cpuinfo(field: str) -> list[str]:
    """The values /proc/cpuinfo gives `field`, a line (a processor) each; none without the file."""
    try:
        with open("/proc/cpuinfo") as f:
            return [line.split(":", 1)[1].strip() for line in f if line.startswith(field)]
    except OSError:
        return []


def cpu_flags() -> set[str]:
    return {flag for value in cpuinfo("flags") for flag in value.split()}


def cpu_vendor() -> str:
    return next(iter(cpuinfo("vendor_id")), "")


def has_avx512() -> bool:
    return "avx512f" in cpu_flags()


def has_bf16_dot() -> bool:
    return "avx512_bf16" in cpu_flags()


def has_amx() -> bool:
    return {"amx_tile", "amx_bf16", "avx512_bf16"} <= cpu_flags()


# The build without the bfloat16 dot products where this CPU has them: its GEMM keeps x in
# float32 at every size, so a model's outputs match transformers' float32 ones to 1e-4.
FLOAT32_X = ("-mno-avx512bf16",) if kernels is not None and has_bf16_dot() else ()

# The kernels as this CPU builds them, and where that is the 512-bit code (the packed GEMM's
# tiles, the prefill attention's lanes), the 256-bit code too, and where that takes bfloat16
# dot products, the 512-bit code without them.
BUILDS = [pytest.param((), id="native")] + (
    [pytest.param(("-mno-avx512f",), id="avx2")] if kernels is not None and has_avx512() else []) + (
    [pytest.param(FLOAT32_X, id="avx512")] if FLOAT32_X else [])


def built(flags: tuple[str, ...]) -> cpu_kernels.CpuKernels:
    return cpu_kernels.built_with(flags) if flags else kernels


@needs_kernel
@pytest.mark.parametrize("build", BUILDS)
def test_each_build_runs_the_code_it_is_tested_for(build):
    """The native build of an AVX-512 CPU has the 512-bit code and the -mno-avx512f one the 256-bit
    code, and only the native build of an AVX512-BF16 CPU takes bfloat16 dot products (and of an
    AMX one, AMX's tiles), so the tests of every build test each."""
    assert built(build).vector_bits == (256 if not has_avx512() or "-mno-avx512f" in build else 512)
    assert built(build).bf16_dot_min_rows == (6 if has_bf16_dot() and not build else 0)
    assert built(build).amx_min_rows == (8 if has_amx() and not build else 0)


@needs_kernel
@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
# tiles of 6 (AVX2) or 12 (AVX-512) vectors and what is left; (AVX2) blocks of 96 and what is left
@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 7, 11, 12, 16, 25, 97])
# whole panels of 16 rows, a part-filled last one, a lone part-filled one; (AVX-512: single panels
# for at most 12 vectors or while there are fewer than two pairs a thread, else pairs: m from 16 on)
# a pair whose second panel is part-filled (40, 33), a whole lone panel after pairs (48), and pairs
# then a lone one-column panel (129)
@pytest.mark.parametrize("n,k", [(37, 577), (64, 64), (5, 7), (16, 1), (40, 33), (48, 64), (33, 9), (129, 33)])
def test_packed_gemm_matches_float64(build, dtype, m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen).to(dtype)
    assert_packed_gemm(built(build), x, w)


@contextlib.contextmanager
def streams(lib: cpu_kernels.CpuKernels, several: bool):
    """lib's small steps read their weights as several streams a thread, or as one (csrc:
    several_streams, which the CPU's vendor chooses), within the block."""
    before = lib.lib.cpu_kernels_several_streams()
    lib.lib.cpu_kernels_set_several_streams(int(several))
    try:
        yield
    finally:
        lib.lib.cpu_kernels_set_several_streams(before)


@needs_kernel
def test_several_streams_on_intel_only():
    assert kernels.lib.cpu_kernels_several_streams() == (cpu_vendor() == "GenuineIntel")


@needs_kernel
@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("several", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 2, 4, 12])
# (AVX-512) enough panels for pairs (two a thread), the last pair's second part-filled (200) or a
# lone part-filled panel after them (129)
@pytest.mark.parametrize("n,k", [(200, 64), (129, 33)])
def test_packed_gemm_reads_as_one_stream_or_several(build, several, dtype, m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen).to(dtype)
    lib = built(build)
    with streams(lib, several):
        assert_packed_gemm(lib, x, w)


def assert_packed_gemm(lib: cpu_kernels.CpuKernels, x: torch.Tensor, w: torch.Tensor) -> None:
    """lib's packed GEMM of x [m, k] and w [n, k] matches float64 math on x as that size of step
    takes it: rounded to bfloat16 where the GEMM takes bfloat16 dot products (or AMX's tiles, the
    same arithmetic), else as it is."""
    (m, k), n = x.shape, w.shape[0]
    packed = cpu_kernels.pack_weight(w)
    assert packed.panels.shape == cpu_kernels.packed_shape(n, k, w.dtype) and packed.out_features == n
    y = lib.gemm[w.dtype](x, packed)
    # the bfloat16 dot products take x rounded to bfloat16, and nothing else rounded
    dot = w.dtype == torch.bfloat16 and lib.bf16_dot_min_rows and m >= lib.bf16_dot_min_rows
    ref = (x.bfloat16() if dot else x).double() @ w.double().t()
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5


@pytest.mark.skipif(kernels is None or not kernels.amx_min_rows, reason="the CPU has no AMX (or Linux did not "
                    "give this process its tiles)")
# a part-filled tile of rows, one, a part-filled second, two, two and part of a third, more than a pass of 512 rows
@pytest.mark.parametrize("m", [8, 13, 16, 17, 31, 32, 33, 47, 97, 530])
# one panel, a part-filled one, pairs of panels, a pair then a lone panel, a lone part-filled
# panel after pairs; one tile of k (32) and several; a K that is no multiple of 32 (the dot products)
@pytest.mark.parametrize("n,k", [(16, 64), (5, 32), (48, 32), (37, 96), (129, 576), (64, 48)])
def test_amx_gemm_matches_float64(m, n, k):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    assert_packed_gemm(kernels, torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen).bfloat16())


@needs_kernel
def test_packed_gemm_reads_strided_input_and_refuses_a_mismatch():
    x = torch.randn(8, 64)[::2]  # every other row: not contiguous
    weight = torch.randn(16, 64).to(torch.bfloat16)
    w = cpu_kernels.pack_weight(weight)
    torch.testing.assert_close(kernels.gemm[torch.bfloat16](x, w), x @ weight.float().t(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="packed GEMM"):
        kernels.gemm[torch.float16](x, w)  # panels of another dtype
    with pytest.raises(ValueError, match="packed GEMM"):
        kernels.gemm[torch.bfloat16](torch.randn(4, 63), w)  # another K


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("cols", [9, 10])
@pytest.mark.parametrize("lookup", ["torch", "c"])
def test_packed_rows_are_the_weights_rows(dtype, cols, lookup):
    """Both lookups (torch's indexing; the C kernel's, which the runner gives a tied embedding):
    exactly the weight's rows, from any panel and place, an odd K's last column included."""
    if lookup == "c" and kernels is None:
        pytest.skip("the C kernels do not build here")
    rows_of = cpu_kernels.packed_rows if lookup == "torch" else kernels.packed_rows
    w = torch.randn(37, cols).to(dtype)
    ids = torch.tensor([0, 7, 8, 15, 16, 36, 36, 23])
    rows = rows_of(cpu_kernels.pack_weight(w), ids)
    assert rows.dtype == torch.float32 and torch.equal(rows, w[ids].float())
    # many rows: the C lookup's threads split them
    ids = torch.randint(0, 37, (9000,), generator=torch.Generator().manual_seed(cols))
    assert torch.equal(rows_of(cpu_kernels.pack_weight(w), ids), w[ids].float())


@needs_kernel
def test_packed_rows_in_c_refuse_ids_outside_the_weight():
    packed = cpu_kernels.pack_weight(torch.randn(37, 9).bfloat16())  # its last panel pads rows 37-47
    for bad in (37, 47, -1):
        with pytest.raises(IndexError, match="outside the embedding's 37 rows"):
            kernels.packed_rows(packed, torch.tensor([3, bad]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_pack_weight_layout(dtype):
    """Row n, column k of w at panel n // 16, row k, place n % 16; bfloat16: at panel n // 16,
    pair k // 2, place n % 16, half k % 2 (an odd K's last pair padded with a zero); the last
    panel's rows past N are zeros."""
    w = torch.randn(37, 9).to(dtype)
    panels = cpu_kernels.pack_weight(w).panels
    for n in range(48):
        want = w[n] if n < 37 else torch.zeros(9, dtype=dtype)
        if dtype == torch.bfloat16:
            assert torch.equal(panels[n // 16, :, n % 16].flatten(), torch.cat([want, want.new_zeros(1)])), n
        else:
            assert torch.equal(panels[n // 16, :, n % 16], want), n


def quantized(kind: str, n: int, k: int, seed: int) -> QuantizedWeight:
    return QuantizedWeight.random(kind, n, k, torch.Generator().manual_seed(seed))


# rows of w one at a time (1-2 vectors), or in threes and 1 or 2 left (3 on); rows of whole groups of 8 blocks of 32 (Q4_K's only kind),
# and groups of 8 then 1 (padded with a zero block: 288), 4 (384), 5 (416) or 6 (448) blocks, or
# only 1 (32) or 5 (160)
QUANT_SHAPES = [(kind, n, k) for kind in BLOCKS
                for n, k in [(37, 512), (6, 256), (5, 768), (4, 288), (4, 384), (7, 416), (2, 448), (5, 32), (3, 160)]
                if k % BLOCKS[kind][0] == 0]


# the quantized GEMV's builds: on an AVX-512 CPU the native one (with 512-bit pairs where it has
# AVX512-BW and AVX512-VNNI) and the AVX2 one
QUANT_BUILDS = BUILDS[:2]


@needs_kernel
@pytest.mark.parametrize("build", QUANT_BUILDS)
@pytest.mark.parametrize("kind,n,k", QUANT_SHAPES)
# tiles of 4 vectors, and what is left; one or two vectors, rows of w one at a time (one stream a
# thread) or in threes (several); dequantized rows (quant_dequantized_min_rows): with bfloat16
# dot products (bf16, where the build has them) from 8 vectors on, strips in tiles of 4 vectors
# by 3 rows and what is left of either; in float32 from 64 on, panels
@pytest.mark.parametrize("m,several,bf16", [(1, False, False), (1, True, False), (2, False, False),
                                            (2, True, False), (3, None, False), (4, None, False),
                                            (5, None, False), (7, None, True), (8, None, False), (8, None, True),
                                            (13, None, True), (66, None, False)])
def test_quantized_kernel_matches_the_dequantized_weight(kind, m, several, n, k, build, bf16):
    weight = quantized(kind, n, k, seed=m * 1000 + n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
    x[0, :32] = 0.0  # a block of zeros (its int16 scale is 0)
    x[-1, 5] = 1e4  # an outlier: its block loses precision, no other does
    lib = built(build)
    with streams(lib, several) if several is not None else contextlib.nullcontext():
        y = lib.quant_gemv[kind](x, cpu_kernels.pack_quantized(weight), bf16=bf16)
    assert_quantized_product(lib, x, weight, y, bf16)


def assert_quantized_product(lib: cpu_kernels.CpuKernels, x: torch.Tensor, weight: QuantizedWeight,
                             y: torch.Tensor, bf16: bool) -> None:
    """y is x @ w.T for the blocks' exact weights w, as the kernel for x's size computes it
    (`bf16`: as asked of it)."""
    m, n = x.shape[0], weight.shape[0]
    w = weight.dequantize().double()
    assert y.shape == (m, n) and y.dtype == torch.float32
    magnitude = x.double().abs() @ w.abs().t()
    if m >= lib.quant_dequantized_min_rows[bf16]:
        # Strips of dequantized rows: exactly the weights (rounded to bfloat16 where the build
        # takes bfloat16 dot products, and x with them), then float32 sums.
        if bf16 and lib.bf16_dot_min_rows:
            x, w = x.bfloat16(), w.bfloat16()
        ref = x.double() @ w.double().t()
        assert ((y.double() - ref).abs() <= 1e-5 * magnitude + 1e-6).all()
        return
    ref = x.double() @ w.t()
    # The kernel's only error besides float32 rounding: each block of x as int16 times its scale,
    # off by at most half a step (its largest magnitude / 32767 / 2) per value.
    step = x.reshape(m, -1, 32).abs().amax(-1).double() / 32767
    bound = torch.einsum("mb,nbj->mn", step / 2, w.abs().reshape(n, -1, 32))
    assert ((y.double() - ref).abs() <= bound + 1e-5 * magnitude + 1e-6).all()


@needs_kernel
@pytest.mark.parametrize("build", QUANT_BUILDS)
@pytest.mark.parametrize("kind", list(BLOCKS))
@pytest.mark.parametrize("bf16", [False, True], ids=["f32", "bf16"])
def test_quantized_kernel_takes_many_strips(kind, build, bf16):
    """bfloat16: rows of 4096 weights fill a strip's scratch at 24 rows: 53 rows are several
    strips and a last one of 5 (a tile of 3 rows and one of 2), each thread taking its own;
    30 vectors, tiles of 4 and 2 left. float32: panels of 16 rows (in pairs with AVX-512), the
    last of 5, against 70 vectors (tiles of 12, or 6, and what is left)."""
    lib = built(build)
    weight = quantized(kind, 53, 4096, seed=7)
    m = 30 if bf16 and lib.bf16_dot_min_rows else 70
    assert m >= lib.quant_dequantized_min_rows[bf16]
    x = torch.randn(m, 4096, generator=torch.Generator().manual_seed(3))
    y = lib.quant_gemv[kind](x, cpu_kernels.pack_quantized(weight), bf16=bf16)
    assert_quantized_product(lib, x, weight, y, bf16)


@needs_kernel
@pytest.mark.parametrize("kind", list(BLOCKS))
def test_packed_quantized_rows_hold_the_blocks_bytes(kind):
    """pack_quantized's rows are as long as the C side reads (cpu_kernels_quant_row_bytes): a
    whole group as many bytes as GGUF's blocks, a row's last group a header and its pairs."""
    weights, size = BLOCKS[kind]
    for k in ((256, 512, 2048) if kind == "q4_k" else (32, 64, 160, 256, 288, 576, 1536)):
        packed = cpu_kernels.pack_quantized(quantized(kind, 3, k, seed=k))
        blocks = -(-(k // 32) // 2) * 2  # padded to an even count
        tail = blocks % 8
        header = 32 if kind == "q4_1" else 16
        pair = 64 if kind == "q8_0" else 32
        expect = blocks // 8 * (header + 4 * pair) + (header + tail // 2 * pair if tail else 0)
        assert packed.rows.shape == (3, expect) and packed.in_features == k, k
        if kind == "q4_k" or k % 256 == 0:
            assert expect == k // weights * size


@needs_kernel
@pytest.mark.parametrize("kind", list(BLOCKS))
def test_quantized_kernel_keeps_tiny_blocks_and_propagates_nan(kind):
    """A block of activations near 1e-36 keeps its values (32767 / its largest overflowed to
    inf, and every value became -32768: the sign flipped); a NaN or inf activation makes the
    outputs it reaches NaN, or at least not finite (they came out finite, from saturated int16s)."""
    weight = quantized(kind, 3, 256, seed=1)
    packed = cpu_kernels.pack_quantized(weight)
    w = weight.dequantize().double()
    x = torch.rand(2, 256, generator=torch.Generator().manual_seed(2)) * 1e-36
    ref = x.double() @ w.t()
    y = kernels.quant_gemv[kind](x, packed).double()
    assert ((y - ref).abs().max() / ref.abs().max()).item() < 1e-2
    for m, bf16 in ((3, False), (kernels.quant_dequantized_min_rows[True] + 1, True),
                    (kernels.quant_dequantized_min_rows[False] + 1, False)):  # the integer tiles, then dequantized rows
        x = torch.randn(m, 256)
        x[0, 3], x[1, 40] = float("nan"), float("inf")
        y = kernels.quant_gemv[kind](x, packed, bf16=bf16)
        # (the strips' sums take inf as torch does: inf times each weight, so +-inf or NaN)
        assert y[0].isnan().all() and not y[1].isfinite().any() and y[2:].isfinite().all()


@needs_kernel
def test_quantized_kernel_refuses_what_it_cannot_read():
    packed = cpu_kernels.pack_quantized(quantized("q4_1", 4, 64, seed=0))
    gemv = kernels.quant_gemv["q4_1"]
    for x, w in ((torch.randn(2, 48), packed), (torch.randn(2, 64), packed._replace(rows=packed.rows[:, :-1])),
                 (torch.randn(2, 64).double(), packed), (torch.randn(2, 64), packed._replace(rows=packed.rows.float())),
                 (torch.randn(2, 64), packed._replace(kind="q4_0")),
                 (torch.randn(2, 96), packed._replace(in_features=96))):
        with pytest.raises(ValueError, match="quantized GEMV takes"):
            gemv(x, w)


@needs_kernel
@pytest.mark.parametrize("rows,hidden", [(1, 576), (3, 64), (5, 37), (300, 256)])
def test_rms_norm_matches_the_torch_layer(rows, hidden):
    gen = torch.Generator().manual_seed(rows * hidden)
    layer = RMSNorm(hidden, 1e-5)
    layer.weight.data = torch.randn(hidden, generator=gen)
    x, residual = torch.randn(rows, hidden, generator=gen), torch.randn(rows, hidden, generator=gen)
    with torch.no_grad():
        ref_alone, (ref_out, ref_residual) = layer(x), layer(x, residual)
    torch.testing.assert_close(kernels.rms_norm(x, layer.weight, 1e-5), ref_alone, rtol=1e-5, atol=1e-5)
    x_in, res_in = x.clone(), residual.clone()
    out, new_residual = kernels.fused_add_rms_norm(x_in, res_in, layer.weight, 1e-5)
    assert out is x_in and new_residual is res_in  # in place, like the Triton kernel
    torch.testing.assert_close(new_residual, ref_residual, rtol=0, atol=0)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_rms_norm_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="contiguous float32"):
        kernels.rms_norm(torch.randn(4, 8).t(), torch.ones(4), 1e-5)


def scattered_tables(lens: list[int], block_size: int, gen: torch.Generator) -> tuple[int, torch.Tensor]:
    """Block tables [len(lens), blocks of the longest] for sequences of these lengths, their blocks
    scattered over a pool with 7 to spare: (the pool's size, the tables; 0 past a sequence's blocks)."""
    num_blocks = sum(-(-n // block_size) for n in lens) + 7
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lens), -(-max(lens) // block_size), dtype=torch.int64)
    used = 0
    for i, n in enumerate(lens):
        nb = -(-n // block_size)
        tables[i, :nb] = order[used:used + nb]
        used += nb
    return num_blocks, tables


@needs_kernel
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 1, 32), (6, 3, 48), (2, 2, 20),
                                                             (80, 1, 16)])  # 80 query heads on one KV head
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("lens", [[1, 15, 16, 3 * 32 + 5, 70, 0],  # 0: a row that sees no key
                                  [1000, 0]])  # few rows: the keys split into chunks, merged after
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_decode_attention_matches_the_torch_path(num_heads, num_kv_heads, head_dim, block_size, lens, cache_dtype):
    """Against the torch path on the same cache (a float16 one read back as float32), for query
    heads per KV head in threes and the rest, head sizes in 32s, 8s and the rest."""
    from streamserve.worker.attention import AttentionMetadata, TorchPagedAttention

    gen = torch.Generator().manual_seed(num_heads * head_dim + block_size)
    num_blocks, tables = scattered_tables(lens, block_size, gen)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
    width = tables.shape[1]
    # q as the fused QKV output's first columns: strided rows
    qkv = torch.randn(len(lens), (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    q = qkv[:, :num_heads * head_dim].view(len(lens), num_heads, head_dim)
    seq_lens = torch.tensor(lens)
    out = kernels.paged_decode_attention(q, cache, tables, seq_lens, head_dim ** -0.5)
    assert out.shape == (len(lens), num_heads * head_dim)
    assert torch.equal(out[-1], torch.zeros(num_heads * head_dim))
    visible = torch.arange(width * block_size)[None, :] < seq_lens[:-1, None]
    mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf")).view(len(lens) - 1, 1, 1, -1)
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.int64), num_decodes=len(lens) - 1,
                             decode_block_tables=tables[:-1], decode_mask=mask, prefills=[])
    ref = TorchPagedAttention([cache], meta, num_heads, num_kv_heads, head_dim)._decode(q[:-1], cache)
    torch.testing.assert_close(out[:-1], ref, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 1, 32)])
@pytest.mark.parametrize("lens", [[1, 15, 16, 101, 70, 0], [1000, 0]])
@pytest.mark.parametrize("window, softcap", [(7, None), (40, None), (0, 1.5), (7, 1.5)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_decode_attention_in_a_sliding_window_matches_the_torch_path(num_heads, num_kv_heads, head_dim, lens,
                                                                     window, softcap, cache_dtype):
    """With a sliding window (Mistral's, Gemma's), each row sees its last `window` keys: a window
    inside one block, across blocks, wider than the short rows; the long row's window split into
    chunks merged after. With a soft cap (Gemma 2's) the scores are cap * tanh(score / cap)."""
    from streamserve.worker.attention import AttentionMetadata, TorchPagedAttention

    gen = torch.Generator().manual_seed(num_heads + window)
    block_size = 16
    q_scale = 4.0 if softcap else 1.0  # (scores large enough for the cap to bend them)
    num_blocks, tables = scattered_tables(lens, block_size, gen)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(cache_dtype)
    q = torch.randn(len(lens), num_heads, head_dim, generator=gen) * q_scale
    seq_lens = torch.tensor(lens)
    out = kernels.paged_decode_attention(q, cache, tables, seq_lens, 0.1, window, softcap)
    assert torch.equal(out[-1], torch.zeros(num_heads * head_dim))
    slots = torch.arange(tables.shape[1] * block_size)[None, :]
    lens_ = seq_lens[:-1, None]
    mask = torch.zeros(len(lens) - 1, slots.shape[1]).masked_fill_(
        (slots >= lens_) | (slots < lens_ - window) if window else slots >= lens_, float("-inf")).view(len(lens) - 1, 1, 1, -1)
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.int64), num_decodes=len(lens) - 1,
                             decode_block_tables=tables[:-1], decode_mask=mask, prefills=[],
                             decode_window_masks={window: mask})
    torch_path = TorchPagedAttention([cache], meta, num_heads, num_kv_heads, head_dim, scale=0.1, windows=(window,),
                                     softcap=softcap)
    torch_path.window = window
    ref = torch_path._decode(q[:-1], cache)
    torch.testing.assert_close(out[:-1], ref, rtol=1e-5, atol=1e-5)
    full = kernels.paged_decode_attention(q, cache, tables, seq_lens, 0.1)
    assert not torch.allclose(full[:-1], out[:-1])


@needs_kernel
@pytest.mark.parametrize("key", [2, 18])  # in a vector of 8 keys, or in the tile's scalar tail
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_decode_attention_propagates_a_nan_score(key, cache_dtype):
    """A NaN key makes its row's output NaN, as torch's softmax does, wherever the key sits
    (a NaN in a vector of 8 came out as weight e^-87: the key silently dropped)."""
    hq, d, bs = 2, 16, 16
    cache = torch.randn(2, 2, bs, 1, d, generator=torch.Generator().manual_seed(0)).to(cache_dtype)
    cache[0, key // bs, key % bs, 0, 0] = float("nan")
    q = torch.randn(2, hq, d)
    out = kernels.paged_decode_attention(q, cache, torch.tensor([[0, 1], [1, 0]]), torch.tensor([20, 20]),
                                         d ** -0.5)
    assert out.isnan().all()  # row 1 reads the blocks the other way round: its NaN key is the other


@needs_kernel
def test_decode_attention_refuses_what_it_cannot_read():
    cache = torch.zeros(2, 4, 16, 2, 64)
    tables, lens = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="cannot read"):
        kernels.paged_decode_attention(torch.zeros(1, 4, 64, dtype=torch.bfloat16), cache, tables, lens, 1.0)
    with pytest.raises(ValueError, match="cannot read"):
        kernels.paged_decode_attention(torch.zeros(1, 64, 4).transpose(1, 2), cache, tables, lens, 1.0)


@needs_kernel
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 1, 32), (6, 3, 48), (2, 2, 20),
                                                             (32, 2, 8), (80, 1, 16)])  # 16 and 80 query heads a KV head
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("chunks", [[(0, 5), (40, 1), (37, 100), (0, 100), (300, 70), (0, 1)],
                                    # few tasks for the threads: each takes a chunk of the keys too,
                                    [(2000, 4), (700, 2)],
                                    [(0, 80)]],  # where the first rows see none of the later chunks
                         ids=["mixed", "few-rows-long-context", "rows-across-key-chunks"])
@pytest.mark.parametrize("build", BUILDS)
def test_prefill_attention_matches_the_torch_path(num_heads, num_kv_heads, head_dim, block_size, cache_dtype,
                                                  chunks, build):
    """Prefill chunks (context before, rows) of many sizes, with and without earlier context, in
    one call, against the torch path's SDPA per chunk on the same cache; the slots no sequence
    wrote hold NaN, so a key read past a query's own position shows."""
    for got, want, _ in prefill_attention_and_reference(built(build), False, num_heads, num_kv_heads, head_dim,
                                                        block_size, cache_dtype, chunks):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_kernel
# (AMX's tiles where head_dim is a multiple of 32: a pair of lane vectors and a lone one, 1 to 6
# vectors a task, two tiles of head_dim at once and four)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (6, 3, 48), (2, 2, 20), (4, 1, 32),
                                                             (8, 2, 128)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("chunks", [[(0, 5), (40, 1), (37, 100), (0, 100), (300, 70), (0, 1)], [(2000, 4), (700, 2)]],
                         ids=["mixed", "few-rows-long-context"])
def test_prefill_attention_takes_bfloat16_dot_products_where_asked_and_built(num_heads, num_kv_heads, head_dim,
                                                                             cache_dtype, chunks):
    """With bf16_dot, where the build has AVX512-BF16 and head_dim is a multiple of 16 (or AMX
    and a multiple of 32, whose tiles take the same products), the output is the torch path's on
    q (scaled), K and V rounded to bfloat16, up to the softmax weights' own rounding; elsewhere it
    is the float32 kernel's, exactly."""
    dot = kernels.bf16_dot_min_rows > 0 and head_dim % 16 == 0
    for got, want, want_rounded in prefill_attention_and_reference(kernels, True, num_heads, num_kv_heads, head_dim,
                                                                   16, cache_dtype, chunks):
        if dot:
            torch.testing.assert_close(got, want_rounded, rtol=0, atol=5e-3)
            assert (got - want).abs().max() > 1e-4  # (so not the float32 kernel's)
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def prefill_attention_and_reference(lib, bf16_dot, num_heads, num_kv_heads, head_dim, block_size, cache_dtype,
                                    chunks, window: int = 0, softcap=None):
    """For each chunk: the kernel's output (one call for all chunks), the torch path's SDPA on the
    same cache, and the torch path's on q (scaled), K and V rounded to bfloat16; with a sliding
    `window`, both seeing only each row's last `window` keys."""
    from streamserve.worker.attention import AttentionMetadata, PrefillChunk, TorchPagedAttention, write_kv

    gen = torch.Generator().manual_seed(num_heads * head_dim + block_size)
    lens = [ctx + n for ctx, n in chunks]
    num_blocks, tables = scattered_tables(lens, block_size, gen)
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan")).to(cache_dtype)
    for i, n in enumerate(lens):
        pos = torch.arange(n)
        slots = tables[i, pos // block_size] * block_size + pos % block_size
        write_kv(cache, *torch.randn(2, n, num_kv_heads, head_dim, generator=gen), slots)
    rows = sum(n for _, n in chunks)
    starts = torch.tensor([0, *torch.tensor([n for _, n in chunks]).cumsum(0).tolist()])
    # q as the fused QKV output's first columns: strided rows
    qkv = torch.randn(rows, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    q = qkv[:, :num_heads * head_dim].view(rows, num_heads, head_dim)
    scale = head_dim ** -0.5
    if softcap:
        q = q * 4  # (scores large enough for the cap to bend them)
    out = lib.paged_prefill_attention(q, cache, starts, tables, torch.tensor(lens), scale, bf16_dot, window, softcap)

    prefills = [PrefillChunk(a, b, ctx, tables[i, :-(-(ctx + b - a) // block_size)])
                for i, ((ctx, _), a, b) in enumerate(zip(chunks, starts[:-1].tolist(), starts[1:].tolist()))]
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.int64), num_decodes=0,
                             decode_block_tables=None, decode_mask=None, prefills=prefills)
    rounded_cache, rounded_q = cache.bfloat16().float(), (q * scale).bfloat16().float() / scale
    for chunk in prefills:  # its K and V as the torch path takes them (it reads back the earlier ones)
        rows = slice(chunk.query_start, chunk.query_end)
        refs = []
        for c, qc in ((cache, q), (rounded_cache, rounded_q)):
            k, v = (c[i].index_select(0, chunk.block_ids).flatten(0, 1)[chunk.num_computed_tokens:][:rows.stop - rows.start]
                    for i in (0, 1))
            torch_path = TorchPagedAttention([c], meta, num_heads, num_kv_heads, head_dim, windows=(window,),
                                             softcap=softcap)
            torch_path.window = window
            refs.append(torch_path._prefill(qc[rows], k.float(), v.float(), c, chunk))
        yield out[rows], *refs


@needs_kernel
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 1, 32), (8, 2, 128)])
@pytest.mark.parametrize("window, softcap", [(5, None), (40, None), (300, None), (0, 1.5), (40, 1.5)])
@pytest.mark.parametrize("build", BUILDS)
def test_prefill_attention_in_a_sliding_window_matches_the_torch_path(num_heads, num_kv_heads, head_dim, window,
                                                                      softcap, build):
    """With a sliding window, each row sees its last `window` keys: windows inside a task's rows,
    across them, and wider than most contexts; chunks with and without context before, and few
    rows after a long one (its keys split into chunks, merged after); float32 products, and
    bfloat16 ones where built (against the torch path on the rounded inputs). With a soft cap
    (Gemma 2's), the scores are cap * tanh(score / cap)."""
    chunks = [(0, 5), (40, 1), (37, 100), (0, 100), (300, 70), (2000, 4)]
    lib = built(build)
    # and a lone short chunk after a long context: too few tasks for the threads, so its keys
    # (the window's) are split into chunks, merged after
    for batch in (chunks, [(2000, 4)]):
        for got, want, _ in prefill_attention_and_reference(lib, False, num_heads, num_kv_heads, head_dim, 16,
                                                            torch.float16, batch, window, softcap):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if lib.bf16_dot_min_rows > 0 and head_dim % 16 == 0:
        for got, _, want_rounded in prefill_attention_and_reference(lib, True, num_heads, num_kv_heads, head_dim, 16,
                                                                    torch.float16, chunks, window, softcap):
            torch.testing.assert_close(got, want_rounded, rtol=0, atol=5e-3)


@needs_kernel
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("build", BUILDS)
def test_prefill_attention_masks_the_keys_past_each_row(cache_dtype, build):
    """A NaN key turns the rows at and after its position NaN (as torch's softmax does) and no
    row before it: the keys a row must not see are masked, not merely weighted down."""
    hq, d, bs, n, key = 3, 16, 16, 40, 21
    cache = torch.randn(2, 3, bs, 1, d, generator=torch.Generator().manual_seed(0)).to(cache_dtype)
    cache[0, 1, key - bs, 0, 3] = float("nan")  # block 1 holds keys 16-31 (the table lists 2, 1, 0)
    table = torch.tensor([[2, 1, 0]])
    out = built(build).paged_prefill_attention(torch.randn(n, hq, d), cache, torch.tensor([0, n]), table,
                                               torch.tensor([n]), d ** -0.5)
    assert out[:key].isfinite().all() and out[key:].isnan().all()


@needs_kernel
def test_prefill_attention_refuses_what_it_cannot_read():
    cache = torch.zeros(2, 4, 16, 2, 64)
    q, tables, lens = torch.zeros(3, 4, 64), torch.zeros(1, 2, dtype=torch.int64), torch.tensor([20])
    for starts in ([0, 2], [0, 4], [1, 3], [0, 3, 3]):  # rows left over or missing, not from 0, a sequence of none
        with pytest.raises(ValueError, match="query_start_loc"):
            kernels.paged_prefill_attention(q, cache, torch.tensor(starts), tables, lens, 1.0)
    with pytest.raises(ValueError, match="query_start_loc"):  # more rows than the sequence's length
        kernels.paged_prefill_attention(q, cache, torch.tensor([0, 3]), tables, torch.tensor([2]), 1.0)
    with pytest.raises(ValueError, match="cannot read"):
        kernels.paged_prefill_attention(q.half(), cache, torch.tensor([0, 3]), tables, lens, 1.0)


@needs_kernel
def test_float32_model_uses_the_c_norm_and_attention(llama_dir, monkeypatch):
    """Op by op (enforce_eager), a float32 model's layers call the C RMSNorm and attention."""
    from streamserve import SamplingParams

    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="8MiB", enforce_eager=True)
    runner = llm.engine_core.model_runner
    assert runner.model.layers[0].input_layernorm.kernels is kernels and runner.c_step is None
    calls = []
    for name in ("paged_decode_attention", "paged_prefill_attention"):
        monkeypatch.setattr(type(kernels), name, lambda self, q, *rest, real=getattr(type(kernels), name):
                            calls.append((real.__name__, q.shape[0])) or real(self, q, *rest))
    llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    num_layers = len(llm.engine_core.model_runner.model.layers)
    # both prompts' chunks in one call a layer, then three decode steps of both rows
    assert calls == [("paged_prefill_attention", 5)] * num_layers + [("paged_decode_attention", 2)] * 3 * num_layers


def test_a_kv_cache_dtype_only_the_c_kernels_read_is_refused_without_them(llama_dir, monkeypatch):
    """float16 KV under float32 compute is read by the C kernels alone: without them (here: as
    where they do not build) the runner says so rather than fail in the first step."""
    monkeypatch.setattr(model_runner.cpu_kernels, "load", lambda: None)
    with pytest.raises(ValueError, match="kv_cache_dtype float16 differs from the float32 the model computes in"):
        LLM(llama_dir, dtype="float32", kv_cache_memory="8MiB", kv_cache_dtype="float16")
    runner = LLM(llama_dir, dtype="float32", kv_cache_memory="8MiB").engine_core.model_runner
    assert runner.kv_dtype == torch.float32 and runner.c_kernels is None


@needs_kernel
def test_float32_model_takes_a_float16_kv_cache_when_asked(llama_dir):
    """--kv-cache-dtype float16 on a float32 model: the prompt logprobs stay close to those of
    the float32 cache, and the C step and the op-by-op path agree on them (the torch path reads
    even a first chunk's keys back from the cache, rounded as every later read sees them: from
    its own float32 keys it differed by 1.5e-3)."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    prompt = {"prompt_token_ids": list(range(3, 80))}
    runs = {}
    for kv, eager in (("float32", False), ("float16", False), ("float16", True)):
        llm = LLM(llama_dir, dtype="float32", kv_cache_memory="8MiB", kv_cache_dtype=kv, enforce_eager=eager)
        assert llm.engine_core.model_runner.kv_dtype == getattr(torch, kv)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        runs[kv, eager] = prompt_token_logprobs(out, prompt["prompt_token_ids"])
    assert max(abs(a - b) for a, b in zip(runs["float32", False], runs["float16", False])) < 1e-2
    assert runs["float32", False] != runs["float16", False]  # the cache really was float16
    assert max(abs(a - b) for a, b in zip(runs["float16", False], runs["float16", True])) < 2e-4


@needs_kernel
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # the q/k/v bias; the per-head q/k norms
def test_small_steps_in_one_c_call_match_op_by_op(model_dirs, arch, monkeypatch):
    """By default every step of at most C_STEP_MAX_TOKENS tokens runs as one C call
    (StepForward), prefill chunks too, and larger steps op by op: the tokens and logprobs
    equal the op-by-op run's (the transformers parity tests check the default path on every
    architecture, with chunked prefill, prefix caching and preemption)."""
    from streamserve import SamplingParams

    monkeypatch.setattr(model_runner, "C_STEP_MAX_TOKENS", 64)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    prompts = [[5, 6, 7], [8, 9], list(range(3, 40)),
               list(range(100, 165)),  # 65 tokens: over the token limit
               list(range(200, 250))]
    eager = LLM(model_dirs[arch], dtype="float32", kv_cache_memory="8MiB", enforce_eager=True)
    expected = eager.generate(prompts, params, use_tqdm=False)
    llm = LLM(model_dirs[arch], dtype="float32", kv_cache_memory="8MiB")
    sizes = []
    real = cpu_kernels.StepForward.__call__
    monkeypatch.setattr(cpu_kernels.StepForward, "__call__",
                        lambda self, ids, *rest: sizes.append(len(ids)) or real(self, ids, *rest))
    outputs = [out for prompt in ([prompts[:3]] + [[p] for p in prompts[3:]])
               for out in llm.generate(prompt, params, use_tqdm=False)]
    # the three short prompts' step (42 tokens: 3 + 2 + 37), 11 decode steps of all three; the
    # 65-token prompt's step ran op by op, then its 11 decode steps; the 50-token prompt's step
    assert sizes == [42] + [3] * 11 + [1] * 11 + [50] + [1] * 11
    assert_same_greedy(outputs, [tokens_and_logprobs(want) for want in expected])


@needs_kernel
def test_c_step_refuses_what_would_reach_outside_its_tables(llama_dir):
    runner = LLM(llama_dir, dtype="float32", kv_cache_memory="8MiB").engine_core.model_runner
    step, past = runner.c_step, runner.model.rotary.cos_sin_cache.shape[0]
    one, table = torch.zeros(1, dtype=torch.int64), torch.zeros(1, 1, dtype=torch.int64)
    starts = torch.tensor([0, 1])
    slots, many = runner.num_blocks * runner.block_size, step.max_tokens + 1
    wide = torch.zeros(1, -(-past // runner.block_size) + 1, dtype=torch.int64)
    before = [c.clone() for c in runner.kv_caches]
    for args, match in [((one, one, starts, wide, one + past + 1), "position is past"),
                        ((one, torch.tensor([slots]), starts, table, one + 1), "slot is past"),
                        ((one, one, starts, table, one + runner.block_size + 1), "length is past"),
                        ((one, one, starts, table, one), "more than its length"),  # a token at position -1
                        ((one, one, torch.tensor([0, 2]), table, one + 2), "query_start_loc"),
                        ((one.repeat(2), one.repeat(2), torch.tensor([0, 0, 2]), table.repeat(2, 1),
                          one.repeat(2) + 2), "no tokens"),
                        ((one, one, starts, table + runner.num_blocks, one + 1), "block ID is past"),
                        # an ID whose slots' offset overflows int64 (it wrapped past the check once)
                        ((one, one, starts, table + 2 ** 63 // runner.block_size + runner.num_blocks, one + 1),
                         "block ID is past"),
                        ((one, one, starts, table.int(), one + 1), "contiguous int64"),
                        ((one, one, torch.tensor([0]), table, one + 1), "query_start_loc"),
                        ((one.repeat(many), one.repeat(many), torch.tensor([0, many]), table, one + many),
                         f"1 to {step.max_tokens} tokens")]:
        with pytest.raises(ValueError, match=match):
            step(*args)
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches))  # nothing written


def rounded_copy(model_dir: str, path, dtype: torch.dtype) -> str:
    """A copy of the model at `path` with its weights rounded to `dtype` and saved so."""
    import shutil
    shutil.copytree(model_dir, path)
    weights = load_file(str(path / "model.safetensors"))
    save_file({k: v.to(dtype) for k, v in weights.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return str(path)


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def half_llama_dir(request, llama_dir, tmp_path_factory):
    """The tiny Llama with its weights rounded to bfloat16 or float16 and saved so: (dir, dtype)."""
    dtype = request.param
    return rounded_copy(llama_dir, tmp_path_factory.mktemp(str(dtype).split(".")[-1]) / "llama", dtype), dtype


@needs_kernel
def test_half_precision_model_small_steps_match_transformers(half_llama_dir, monkeypatch):
    """On a CPU that emulates half-precision GEMMs, every step reads the packed half-size
    copies through the C GEMM (steps of a few tokens in one C call) and the float32 weights
    are freed: transformers in float32 on the same (rounded) weights is the oracle (with a
    float32 KV cache: the default float16 one is test_float16_kv_cache_...)."""
    path, dtype = half_llama_dir
    monkeypatch.setattr(model_runner, "native_half_gemms", lambda dtype: False)
    lib = built(FLOAT32_X)  # (float32 arithmetic throughout: the dot products are the next test's)
    monkeypatch.setattr(cpu_kernels, "load", lambda: lib)
    llm = LLM(path, dtype=str(dtype).split(".")[-1], kv_cache_memory="32MiB", kv_cache_dtype="float32")
    runner = llm.engine_core.model_runner
    assert runner.kv_dtype == torch.float32
    assert runner.dtype == torch.float32 and runner.low_precision_max_tokens == sys.maxsize and runner.c_step is not None
    down = runner.model.layers[0].mlp.down_proj
    assert down.weight.numel() == 0 and down.low_precision_weight is None and down.packed.dtype == dtype
    head = runner.model.lm_head
    assert head.gemm is lib.gemm[dtype]
    # the tied embedding's lookups read the head's packed copy: no float32 weight is left
    assert isinstance(runner.model.embed_tokens, PackedEmbedding) and head.weight.numel() == 0
    assert runner.model.embed_tokens.rows == lib.packed_rows  # in C
    assert not any(p.dtype == torch.float32 and p.dim() == 2 and p.numel() for p in runner.model.parameters())
    check_parity(llm, path)


@needs_kernel
@pytest.mark.skipif(not has_bf16_dot(), reason="the bfloat16 dot products need AVX512-BF16")
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["c-step", "op-by-op"])
def test_bfloat16_dot_products_cost_less_accuracy_than_computing_in_bfloat16(llama_dir, tmp_path, enforce_eager):
    """Where the C kernels take bfloat16 dot products (the GEMM of the steps of
    bf16_dot_min_rows tokens and up, every parity prompt's prefill but one, and the prefill
    attention), a bfloat16 checkpoint's prompt logprobs move from transformers' float32 ones,
    on average less than transformers' own bfloat16 run moves, and at worst about as much (on
    this random model; on SmolLM2, a third as much on average: docs/design.md)."""
    path = rounded_copy(llama_dir, tmp_path / "bf16", torch.bfloat16)
    reference, bf16_rows = hf_prompt_logprobs(path), hf_prompt_logprobs(path, dtype=torch.bfloat16)
    prompts = parity_prompts()
    llm = LLM(path, dtype="bfloat16", kv_cache_memory="32MiB", enforce_eager=enforce_eager)
    runner = llm.engine_core.model_runner
    assert runner.bf16_dot and runner.c_kernels.bf16_dot_min_rows == 6
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    ours = [prompt_token_logprobs(output, p) for output, p in zip(outputs, prompts)]

    def moved(rows: list[list[float]]) -> torch.Tensor:
        return torch.tensor([abs(a - b) for row, ref in zip(rows, reference) for a, b in zip(row, ref)])

    assert 0 < moved(ours).mean() < moved(bf16_rows).mean() and moved(ours).max() < 1.5 * moved(bf16_rows).max()


@needs_kernel
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["c-step", "op-by-op"])
def test_float16_kv_cache_is_the_default_for_a_half_checkpoint(half_llama_dir, enforce_eager, monkeypatch):
    """A 16-bit checkpoint computed in float32 keeps its KV cache in float16 (half the memory:
    twice the blocks in the same budget), through the C step and through the torch ops alike:
    the prompt logprobs stay within 1e-2 of transformers' in float32."""
    path, dtype = half_llama_dir
    monkeypatch.setattr(model_runner, "native_half_gemms", lambda dtype: False)
    monkeypatch.setattr(cpu_kernels, "load", lambda: built(FLOAT32_X))
    name = str(dtype).split(".")[-1]
    llm = LLM(path, dtype=name, kv_cache_memory="32MiB", enforce_eager=enforce_eager)
    runner = llm.engine_core.model_runner
    assert runner.kv_dtype == torch.float16 and all(c.dtype == torch.float16 for c in runner.kv_caches)
    assert (runner.c_step is None) == enforce_eager
    full = LLM(path, dtype=name, kv_cache_memory="32MiB", kv_cache_dtype="float32").engine_core.model_runner
    assert runner.num_blocks == 2 * full.num_blocks
    check_prompt_logprobs(llm, path, tol=1e-2)


@pytest.mark.skipif(not cpu_flags(), reason="no /proc/cpuinfo to read the CPU's flags from")
def test_native_bfloat16_gemms_need_the_hardware():
    """oneDNN calls bfloat16 supported on any AVX-512 CPU (emulated there, 3x slower than the C
    GEMM): only AVX512-BF16 or AMX counts as native."""
    assert model_runner.native_half_gemms(torch.bfloat16) == bool({"avx512_bf16", "amx_tile"} & cpu_flags())


@needs_kernel
@pytest.mark.parametrize("build", [pytest.param((), id="native")] + (
    [pytest.param(FLOAT32_X, id="float32-x")] if FLOAT32_X else []))
def test_native_half_gemms_serve_the_large_steps(half_llama_dir, build, monkeypatch):
    """Where the CPU has native half-precision GEMMs (AMX), steps too large for the C step
    read row-major half-size copies through torch (the float32 weights are freed), small
    steps still run in one C call; the op-by-op run (enforce_eager) gives the same tokens.
    Where the C GEMM takes bfloat16 dot products itself, it serves a bfloat16 checkpoint's
    large steps too, and no row-major copies are kept."""
    import torch.nn.functional as F

    path, dtype = half_llama_dir
    name = str(dtype).split(".")[-1]
    lib = built(build)
    row_major = not (dtype == torch.bfloat16 and lib.bf16_dot_min_rows)
    monkeypatch.setattr(cpu_kernels, "load", lambda: lib)
    monkeypatch.setattr(model_runner, "native_half_gemms", lambda dtype: True)
    monkeypatch.setattr(model_runner, "C_STEP_MAX_TOKENS", 64)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    prompts = [list(range(100, 200)), [5, 6, 7]]  # one step of 103 tokens (over 64), then decode steps
    expected = LLM(path, dtype=name, kv_cache_memory="32MiB", enforce_eager=True).generate(
        prompts, params, use_tqdm=False)
    llm = LLM(path, dtype=name, kv_cache_memory="32MiB")
    runner = llm.engine_core.model_runner
    assert runner.dtype == torch.float32 and runner.low_precision_max_tokens == sys.maxsize and runner.c_step is not None
    down = runner.model.layers[0].mlp.down_proj
    assert down.weight.numel() == 0  # float32 copy freed
    weights, real = [], F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, *rest: weights.append((x.shape[0], w.dtype)) or real(x, w, *rest))
    outputs = llm.generate(prompts, params, use_tqdm=False)
    if row_major:
        assert down.low_precision_weight.dtype == dtype
        assert (103, dtype) in weights and all(w == dtype for _, w in weights)
    else:
        assert down.low_precision_weight is None and not weights
    assert_same_greedy(outputs, [tokens_and_logprobs(want) for want in expected])


@needs_kernel
@pytest.mark.parametrize("half_llama_dir", [torch.bfloat16], indirect=True, ids=["bf16"])
@pytest.mark.parametrize("eager", [False, True], ids=["c-step", "op-by-op"])
def test_quantized_layers_hold_their_blocks_alone(half_llama_dir, eager, tmp_path, monkeypatch):
    """--cpu-weights quantized: the layers with blocks keep nothing else (no weight, no copy:
    a GGUF conversion's weights for them are not even read), and every step reads the blocks, its prefill's strips of rows dequantized as they are read;
    the tokens are those of the layers that keep 16-bit copies too (--cpu-weights copies,
    whose larger steps read the copies: the same bfloat16 weights), in the C step and op by op.
    auto chooses the blocks alone where the copies would take more than a quarter of memory."""
    from streamserve.models.layers import Linear

    source, dtype = half_llama_dir
    path = quantized_checkpoints.write_gguf_layout(source, str(tmp_path / "converted"), dtype)
    prompts = [list(range(5, 40)), [5, 6, 7], [9] * 12]  # prefills of 50 tokens (strips), then decodes of 3
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    monkeypatch.setattr(model_runner, "native_half_gemms", lambda dtype: False)  # this machine's kind
    args = dict(dtype="bfloat16", kv_cache_memory="32MiB", enforce_eager=eager)
    copies = LLM(path, cpu_weights="copies", **args)
    expected = [tokens_and_logprobs(o) for o in copies.generate(prompts, params, use_tqdm=False)]
    copies_bytes = sum(t.numel() * t.element_size() for t in copies.engine_core.model_runner.model.copies())
    del copies
    read, iterate = [], loader.iterate_safetensors
    monkeypatch.setattr(loader, "iterate_safetensors",
                        lambda *a: ((n, t) for n, t in iterate(*a) if not read.append(n)))
    originals, read_blocks = [], model_runner.read_quantized

    def read_quantized(model_dir):
        blocks = read_blocks(model_dir)
        originals.extend(weakref.ref(w.blocks) for w in blocks.values())
        return blocks
    alive, onto_huge_pages = [], cpu_kernels.onto_huge_pages

    def moved(tensors):  # (the copies' move, where the load peaks)
        gc.collect()
        alive.append(sum(ref() is not None for ref in originals))
        return onto_huge_pages(tensors)
    packing, pack_quantized = [], layers.pack_quantized

    def pack(weight):
        gc.collect()
        packing.append(sum(ref() is not None for ref in originals))
        return pack_quantized(weight)
    monkeypatch.setattr(model_runner, "read_quantized", read_quantized)
    monkeypatch.setattr(cpu_kernels, "onto_huge_pages", moved)
    monkeypatch.setattr(layers, "pack_quantized", pack)
    llm = LLM(path, cpu_weights="quantized", **args)
    # each block the file held went once its layer had packed it, so none is left for the copies' move
    # (while a layer packs, the parts it took are gone and only later layers' remain)
    assert originals and packing == sorted(set(packing), reverse=True) and packing[0] < len(originals)
    assert packing[-1] <= 2 and alive == [0]
    runner = llm.engine_core.model_runner
    assert runner.quantized_only and (runner.c_step is None) == eager
    # the layers that hold only their blocks had their weights left unread
    assert read and not any(n.endswith("proj.weight") for n in read)
    assert runner.unread_layers == {n for n, m in runner.model.named_modules() if isinstance(m, Linear)} - {"lm_head"}
    linears = {name: m for name, m in runner.model.named_modules() if isinstance(m, Linear)}
    for name, layer in linears.items():
        # (the tiny Llama's head is tied to the embedding, which has no blocks)
        assert layer.only_quantized == (name != "lm_head"), name
        if name != "lm_head":
            assert layer.weight.numel() == 0 and layer.low_precision_weight is None
    held = sum(t.numel() * t.element_size() for t in runner.model.copies())
    assert held < copies_bytes * 0.7  # (the head's copy stays: it is the embedding's too)
    assert_same_greedy(llm.generate(prompts, params, use_tqdm=False), expected, logprob_tol=1e-3)
    del llm
    if not eager:
        monkeypatch.setattr(model_runner, "total_memory_bytes", lambda: 4 * copies_bytes)
        assert not LLM(path, **args).engine_core.model_runner.quantized_only
        monkeypatch.setattr(model_runner, "total_memory_bytes", lambda: 2 * copies_bytes)
        assert LLM(path, **args).engine_core.model_runner.quantized_only


@needs_kernel
def test_gguf_blocks_load_where_only_the_half_copies_are_kept(half_llama_dir, tmp_path, monkeypatch):
    """A GGUF conversion (half-precision weights + the blocks, the default model's layout) on
    a CPU with native half GEMMs, which keeps only the half copies: the blocks are checked
    against the copies' shape (reading the freed float32 weight's shape crashed start-up) and
    serve the small steps, as where the float32 weights are kept; blocks of another shape
    are refused."""
    from streamserve.models.layers import Linear

    source, dtype = half_llama_dir
    path = quantized_checkpoints.write_gguf_layout(source, str(tmp_path / "converted"), dtype)
    gen = torch.Generator().manual_seed(0)
    name = str(dtype).split(".")[-1]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    monkeypatch.setattr(model_runner, "native_half_gemms", lambda dtype: False)  # this machine's kind
    expected = LLM(str(path), dtype=name, kv_cache_memory="32MiB").generate([[5, 6, 7]], params, use_tqdm=False)
    monkeypatch.setattr(model_runner, "native_half_gemms", lambda dtype: True)
    llm = LLM(str(path), dtype=name, kv_cache_memory="32MiB")
    runner = llm.engine_core.model_runner
    down = runner.model.layers[0].mlp.down_proj
    assert down.weight.numel() == 0 and down.quantized is not None and runner.c_step is not None
    # steps of up to 3 tokens read the blocks where small steps read several streams a thread, 4 elsewhere
    assert down.quant_max_rows == runner.quant_max_tokens == (3 if runner.c_kernels.several_streams else 4)
    assert_same_greedy(llm.generate([[5, 6, 7]], params, use_tqdm=False),
                       [tokens_and_logprobs(want) for want in expected])
    with pytest.raises(ValueError, match="do not hold"):
        down.keep_quantized(QuantizedWeight.random("q4_1", down.out_features, 32, gen), None, 2)
    layer = Linear(64, 8, bias=False)
    bad = QuantizedWeight("q4_1", torch.zeros(8, 2 * 20 + 3, dtype=torch.uint8))  # not whole blocks
    with pytest.raises(ValueError, match="do not hold"):
        layer.keep_quantized(bad, None, 2)


# -- the sampler's choice in C -------------------------------------------------------------------


def c_draws(logits: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    """The C sampler's token for one row at n evenly spaced u in [0, 1): how often each token
    comes out is its probability to within 1 / n (the inverse CDF), with no randomness."""
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    rows = logits.expand(n, -1).contiguous()

    def col(value, dtype):
        return np.full(n, value, dtype=dtype)
    tokens = kernels.sample(rows, col(params.temperature, np.float32), col(params.min_p, np.float32),
                            col(params.top_k, np.int64), col(params.top_p, np.float32), u.numpy())
    return torch.bincount(tokens, minlength=logits.shape[0]).double() / n


@needs_kernel
@pytest.mark.parametrize("vocab", [37, 49152])  # a vector's tail; SmolLM2's vocabulary (chunks, bins)
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.3, top_k=20), SamplingParams(temperature=0.5, min_p=0.05),
    SamplingParams(temperature=1.0, min_p=0.02, top_k=50, top_p=0.8), SamplingParams(temperature=2.0, top_p=0.3),
], ids=["plain", "top_p", "top_k", "min_p", "all-three", "hot-top_p"])
@pytest.mark.parametrize("spread", [1.0, 4.0])  # flat (thousands of tokens matter) and peaked logits
def test_c_sampler_draws_the_torch_paths_distribution(vocab, params, spread):
    """Each token's share of the draws over a grid of u is its probability after the torch path's
    filters (softmax(logits / T) after min_p, then top_k and top_p), to within the grid's step:
    the same support (nothing the torch path drops is drawn) and the same weights."""
    from streamserve.worker.request_state import RequestState
    from streamserve.engine.scheduler_output import NewRequestData
    from streamserve.worker.sampler import Sampler

    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(vocab + int(spread))) * spread
    row = RequestState(NewRequestData("r", [0], 1, params, None, block_ids=[], num_computed_tokens=0), None)
    expected = Sampler(torch.device("cpu"), seed=0, kernels=None)._filtered_probs(
        logits[None] / params.temperature, [row])[0].double()
    n = 20000
    observed = c_draws(logits, params, n)
    assert set(observed.nonzero().flatten().tolist()) <= set(expected.nonzero().flatten().tolist())
    assert (observed - expected).abs().max() <= 1.5 / n + 1e-5
    if expected.max() < 0.5:  # flat enough that a grid of 20000 reaches many tokens
        assert (observed > 0).sum() >= min(50, (expected > 1.5 / n).sum())


@needs_kernel
@pytest.mark.parametrize("vocab", [16, 49152])  # top_p over every token; over the few above its floor
def test_c_sampler_top_p_cuts_inside_a_bin(vocab):
    """Two tokens in one bin of the histogram (probabilities 0.152 and 0.151), top_p 0.7: the mass
    before the first (0.65) is below it, before the second (0.802) not, so the first stays and the
    second goes, whichever way keep_top_p takes (a long peaked row drops its tail first)."""
    probs = torch.full((vocab,), 0.047 / (vocab - 4))
    probs[:4] = torch.tensor([0.4, 0.25, 0.152, 0.151])
    observed = c_draws(probs.log(), SamplingParams(temperature=1.0, top_p=0.7), 20000)
    assert set(observed.nonzero().flatten().tolist()) == {0, 1, 2}
    torch.testing.assert_close(observed[:3], torch.tensor([0.4, 0.25, 0.152], dtype=torch.float64) / 0.802,
                               atol=2e-4, rtol=0)


@needs_kernel
@pytest.mark.parametrize("vocab", [16, 49152])  # top_k over every token; over the few above a floor
def test_c_sampler_top_k_cuts_inside_a_bin(vocab):
    """The third and fourth largest in one bin of the histogram (logits -0.95 and -0.96), top_k 3:
    the third stays and the fourth goes, whichever way keep_top_k takes."""
    logits = torch.full((vocab,), -30.0)
    logits[:4] = torch.tensor([0.0, -0.5, -0.95, -0.96])
    observed = c_draws(logits, SamplingParams(temperature=1.0, top_k=3), 20000)
    assert set(observed.nonzero().flatten().tolist()) == {0, 1, 2}
    torch.testing.assert_close(observed[:3], torch.softmax(logits[:3].double(), -1), atol=2e-4, rtol=0)


@needs_kernel
def test_c_sampler_edges():
    """Greedy rows take the first largest logit (a NaN first, as torch.argmax); ties at top_k's
    cut keep the lower indices; a row whose logits are all -inf but one draws that one; u just
    below 1 still lands on a token that stays."""
    def one(x, temperature=1.0, min_p=0.0, top_k=0, top_p=1.0, u=0.5):
        x = torch.tensor(x, dtype=torch.float32)[None]
        return kernels.sample(x, np.array([temperature], np.float32), np.array([min_p], np.float32),
                              np.array([top_k], np.int64), np.array([top_p], np.float32),
                              np.array([u], np.float32)).item()

    row = [0.0] * 40
    row[17] = row[33] = 2.0
    assert one(row, temperature=0.0) == 17
    row[25] = float("nan")
    assert one(row, temperature=0.0) == 25
    flat = [1.0] * 20
    assert {one(flat, top_k=3, u=u) for u in (0.0, 0.2, 0.5, 0.9, 0.9999)} == {0, 1, 2}
    masked = [float("-inf")] * 30
    masked[12] = -3.0
    assert {one(masked, u=u) for u in (0.0, 0.5, 0.99999994)} == {12}
    assert one([float("-inf")] * 9, u=0.3) == 0  # nothing finite: the argmax (the first)
    peaked = [5.0, 1.0, 0.0, -1.0] + [-9.0] * 12
    assert one(peaked, top_p=0.5, u=0.99999994) == 0  # top_p keeps only the first
    assert one(peaked, u=np.nextafter(np.float32(1), np.float32(0))) in range(16)
    # an infinite temperature (validation admits it) weighs every finite logit alike; -inf stays out
    assert {one(masked[:11] + [0.0, 7.0], temperature=float("inf"), top_p=0.9, u=u) for u in (0.1, 0.9)} == {11, 12}
