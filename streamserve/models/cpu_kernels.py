"""The CPU path's C kernels (csrc/cpu_kernels.c): the GEMM every step runs over weights
packed in panels (`pack_weight`), the GEMV over GGUF's quantized blocks for the smallest
steps, RMSNorm (with the residual add) in one call, decode and prefill attention read straight
from the paged KV cache, and a whole step of up to a few hundred tokens in one call (`StepForward`).

Built once per machine with the system C compiler into `$STREAMSERVE_CACHE/kernels`
(a second or two), then loaded with ctypes, which releases the GIL during each call.
Where they cannot be used (not x86-64 with AVX2, no compiler, `STREAMSERVE_CPU_KERNELS=0`),
`load()` returns None and the layers keep using torch ops. The shared library links the
OpenMP runtime that torch has already loaded, so both share one thread pool and
`torch.set_num_threads`.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import mmap
import os
import platform
import shutil
import subprocess
import tempfile
import weakref
from functools import lru_cache
from typing import Callable, Iterator, NamedTuple, Optional

import numpy as np
import torch
import torch.nn.functional as F

from streamserve.models.quantized import BLOCKS, SCALE_OFFSETS, QuantizedWeight

logger = logging.getLogger(__name__)

SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "cpu_kernels.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-lm"]

Gemv = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

PANEL = 16  # rows of w a panel of the packed layout holds (csrc: PANEL)
# The KV caches the decode attention and the C step read: float16 halves the bytes a long
# context's attention reads (the runner's choice for 16-bit checkpoints: ModelRunner.kv_dtype).
KV_CACHE_DTYPES = (torch.float32, torch.float16)


class PackedWeight(NamedTuple):
    """A linear weight [N, K] as the C GEMM reads it (pack_weight): `panels` [ceil(N / 16), K, 16],
    bfloat16 ones [ceil(N / 16), ceil(K / 2), 16, 2]."""

    panels: torch.Tensor
    out_features: int
    in_features: int

    @property
    def dtype(self) -> torch.dtype:
        return self.panels.dtype


def packed_shape(n: int, k: int, dtype: torch.dtype) -> tuple[int, ...]:
    """The panels' shape for a weight [n, k] of `dtype` (pack_weight)."""
    panels = -(-n // PANEL)
    return (panels, -(-k // 2), PANEL, 2) if dtype == torch.bfloat16 else (panels, k, PANEL)


def pack_weight(w: torch.Tensor) -> PackedWeight:
    """w [N, K] (float32, bfloat16 or float16) in panels of 16 rows, k-major, the last padded
    with zero rows: the 16 weights of one k of a panel lie side by side, in row order; bfloat16
    ones in pairs of k (k, k + 1) a row, an odd K padded with a zero column (csrc/cpu_kernels.c:
    the layout AMX's tiles and VDPBF16PS read as it lies)."""
    n, k = w.shape
    shape = packed_shape(n, k, w.dtype)
    padded = torch.zeros(shape[0] * PANEL, shape[1] * (2 if w.dtype == torch.bfloat16 else 1), dtype=w.dtype)
    padded[:n, :k] = w
    packed = padded.view(shape[0], PANEL, shape[1], -1).transpose(1, 2).contiguous()
    return PackedWeight(packed.view(shape), n, k)


def packed_rows(w: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the weight `w` packs, as float32 [len(ids), K] (an embedding lookup)."""
    rows = w.panels[ids // PANEL, :, ids % PANEL]  # [len, K] or, bfloat16, [len, K / 2, 2]
    return rows.reshape(len(ids), -1)[:, :w.in_features].float()


class PackedQuant(NamedTuple):
    """A QuantizedWeight's blocks as the quantized GEMV reads them (pack_quantized): uint8 `rows`
    [N, bytes a row], each row its blocks regrouped eight at a time."""

    kind: str
    rows: torch.Tensor
    in_features: int


GROUP = 8  # blocks of 32 a group (csrc: QGROUP)


def _pairs(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Two blocks' bytes [..., B] as the GEMV reads a pair: in chunks of 8 bytes, one of each in
    turn (widened to int16, each 16 fill a vector whose low half is the first block's)."""
    return torch.stack([first.unflatten(-1, (-1, 8)), second.unflatten(-1, (-1, 8))], -2).flatten(-3)


def _group(scales: list[torch.Tensor], qs: torch.Tensor) -> torch.Tensor:
    """Groups of n blocks [rows, groups, n, ...] as the GEMV reads them: a header of 8 float16
    lanes per scale (block j < n / 2 in lane j, block n / 2 + j in lane 4 + j, zeros in the
    others), then the blocks' weights in pairs j, n / 2 + j (_pairs)."""
    rows, groups, n = qs.shape[:3]
    h = n // 2
    lanes = [j if j < h else 4 + j - h for j in range(n)]
    header = torch.zeros(rows, groups, len(scales), GROUP, 2, dtype=torch.uint8)
    for i, scale in enumerate(scales):
        header[:, :, i, lanes] = scale
    return torch.cat([header.flatten(2), _pairs(qs[:, :, :h], qs[:, :, h:]).flatten(2)], 2)


def pack_quantized(weight: QuantizedWeight) -> PackedQuant:
    """GGUF's blocks regrouped for the quantized GEMV (csrc/cpu_kernels.c: "GGUF's quantized
    blocks"): per row, groups of 8 blocks of 32 weights, the row's block count padded to an even
    one with a zero block and its last group holding what is left. Q4_K's super-block of 256 is
    such a group: its 16 bytes of scales, then its 8 sub-blocks as 4-bit blocks of 32 (GGUF packs
    sub-blocks 2j and 2j + 1 into the low and high nibbles of the same 32 bytes)."""
    (rows, cols), size = weight.shape, BLOCKS[weight.kind][1]
    blocks = weight.blocks.view(rows, -1, size)
    if weight.kind == "q4_k":
        qs = blocks[:, :, 16:].reshape(rows, -1, 4, 1, 32)
        subs = torch.cat([qs & 15, qs >> 4], 3).reshape(rows, -1, 8, 32)  # sub-block s, weights 0-31
        nibbles = subs[..., :16] | (subs[..., 16:] << 4)
        packed = torch.cat([blocks[:, :, :16], _pairs(nibbles[:, :, :4], nibbles[:, :, 4:]).flatten(2)], 2)
        return PackedQuant(weight.kind, packed.reshape(rows, -1).contiguous(), cols)
    if blocks.shape[1] % 2:
        blocks = torch.cat([blocks, torch.zeros(rows, 1, size, dtype=torch.uint8)], 1)
    full = blocks.shape[1] // GROUP * GROUP
    parts = []
    for part, n in ((blocks[:, :full], GROUP), (blocks[:, full:], blocks.shape[1] - full)):
        if n:
            part = part.reshape(rows, -1, n, size)
            offsets = SCALE_OFFSETS[weight.kind]
            scales = [part[..., at:at + 2] for at in offsets]
            parts.append(_group(scales, part[..., 2 * len(offsets):]).reshape(rows, -1))
    return PackedQuant(weight.kind, torch.cat(parts, 1).contiguous(), cols)


HUGE_PAGE = 2 << 20  # bytes of an x86-64 transparent huge page


def huge_pages(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] of zeros, starting on a 2 MB boundary, in an anonymous mapping advised for
    transparent huge pages (MADV_HUGEPAGE: Linux backs it with 2 MB pages where its THP setting is
    "madvise" or "always"). The OS hands the pages out as they are first touched, zeroed, so an
    untouched part costs no RAM. A stream over 4 KB pages misses the TLB at every page: a decode
    step's GEMVs read their weights 1.1x faster from huge pages (docs/design.md, "Huge pages")."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps `mapping` alive
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def onto_huge_pages(tensors: list[torch.Tensor]) -> Iterator[torch.Tensor]:
    """Copies of `tensors` (CPU, contiguous) side by side in one huge_pages mapping, each
    starting on a 64-byte boundary: the weights a step streams through, read as one run.
    Yielded one at a time, each original taken out of the list as it is copied: a caller that
    puts each copy in its original's place as it comes (LlamaForCausalLM.move_copies) frees the
    originals as the mapping fills, so the weights are not held twice (a 1B model's load
    peaked 2.4 GB higher when they were)."""
    sizes = [-(-t.numel() * t.element_size() // 64) * 64 for t in tensors]
    arena, start, freed = huge_pages(sum(sizes)), 0, 0
    tensors.reverse()  # (popped from the end: the first first)
    for size in sizes:
        t = tensors.pop()
        copy = arena[start:start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        copy.copy_(t)
        del t
        start += size
        yield copy
        freed += size
        if freed >= 1 << 28:  # (the originals' pages handed back as they go, not at the end)
            release_freed_memory()
            freed = 0


def release_freed_memory() -> None:
    """Return the C heap's freed memory to the OS (glibc's malloc_trim; elsewhere nothing): a
    model's weights, copied and repacked at load, leave hundreds of MB free in it that glibc
    would otherwise keep in the process's resident memory."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


def _usable() -> Optional[str]:
    """Why the kernel cannot run here, or None when it can."""
    if os.environ.get("STREAMSERVE_CPU_KERNELS", "1") == "0":
        return "STREAMSERVE_CPU_KERNELS=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"{platform.machine()} is not x86-64"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return "the CPU has no AVX2"
    if not _compiler():
        return "no C compiler (cc) found"
    return None


def _compiler() -> Optional[str]:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(compiler: str, flags: tuple[str, ...] = ()) -> str:
    """The shared library's path, built with FLAGS and `flags` unless this machine has it already."""
    from streamserve.models.resolve import cache_dir

    flags = [*FLAGS, *flags]
    with open(SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(source + " ".join([compiler, *flags, platform.node()]).encode()).hexdigest()[:16]
    out_dir = os.path.join(cache_dir(), "kernels")
    target = os.path.join(out_dir, f"cpu_kernels-{key}.so")
    if os.path.exists(target):
        return target
    os.makedirs(out_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, SOURCE, "-o", tmp], check=True, capture_output=True, text=True)
        os.replace(tmp, target)  # atomic: two processes building at once both end up with one file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class CpuKernels:
    """gemm[dtype](x [M, K] float32, w: PackedWeight of dtype) -> [M, N] float32, x @ w.T, for
    bfloat16, float16 and float32 weights; quant_gemv[kind](x, blocks) likewise for a QuantizedWeight's
    blocks (models/quantized.py: BLOCKS), in integers for a few vectors and from
    quant_dequantized_min_rows[bf16] on through its rows dequantized as they are read (to
    bfloat16 with `bf16=True` where the build has AVX512-BF16, else to float32); rms_norm / fused_add_rms_norm with
    streamserve_kernels.norm's interface (float32, [T, H] contiguous), so RMSNorm takes either
    as its `kernels`;
    paged_decode_attention and paged_prefill_attention for TorchPagedAttention's decode rows
    and prefill chunks (float32). vector_bits: 512 where the build has the AVX-512 code (the
    GEMM's tiles, the prefill attention's lanes), else 256. bf16_dot_min_rows: where the build
    has AVX512-BF16, from how many rows of x the bfloat16 GEMM rounds them to bfloat16 and
    takes bfloat16 dot products (twice the FMAs' arithmetic: csrc, gemm_packed_bf16), else 0.
    amx_min_rows: likewise where the build has AMX and Linux gave this process its tiles, from how
    many rows it takes them (the same arithmetic, several times faster), else 0."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.vector_bits: int = lib.cpu_kernels_vector_bits()
        self.bf16_dot_min_rows: int = lib.cpu_kernels_bf16_dot_min_rows()
        self.amx_min_rows: int = lib.cpu_kernels_amx_min_rows()
        # from how many vectors quant_gemv dequantizes its rows, with bf16=True and without
        dequantized = lib.cpu_kernels_quant_dequantized_min_rows
        dequantized.argtypes, dequantized.restype = [ctypes.c_long], ctypes.c_int
        self.quant_dequantized_min_rows = {bf16: dequantized(int(bf16)) for bf16 in (True, False)}
        # whether small steps read their weights as several streams a thread (csrc: several_streams)
        self.several_streams = bool(lib.cpu_kernels_several_streams())
        self.gemm: dict[torch.dtype, Callable[[torch.Tensor, PackedWeight], torch.Tensor]] = {}
        for dtype, name in ((torch.bfloat16, "gemm_packed_bf16"), (torch.float16, "gemm_packed_f16"),
                            (torch.float32, "gemm_packed_f32")):
            fn = getattr(lib, name)
            fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3
            fn.restype = None
            self.gemm[dtype] = _wrap_gemm(fn, dtype)
        self.quant_gemv: dict[str, Gemv] = {}
        row_bytes = lib.cpu_kernels_quant_row_bytes
        row_bytes.argtypes, row_bytes.restype = [ctypes.c_long] * 2, ctypes.c_long
        for kind in BLOCKS:
            fn = getattr(lib, f"gemv_{kind}")
            fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 4
            fn.restype = ctypes.c_int
            self.quant_gemv[kind] = _wrap_quant_gemv(fn, kind, lambda k, t=_QUANT_KINDS[kind]: row_bytes(t, k))
        self._rows = lib.packed_rows
        self._rows.argtypes = [ctypes.c_void_p] + [ctypes.c_long] * 3 + [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
        self._rows.restype = ctypes.c_int
        self._norm = lib.rms_norm_f32
        self._norm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 2 + [ctypes.c_float]
        self._norm.restype = None
        self._decode = lib.paged_decode_attention
        self._decode.argtypes = ([ctypes.c_void_p, ctypes.c_long] + [ctypes.c_void_p] * 5
                                 + [ctypes.c_long] * 6 + [ctypes.c_float, ctypes.c_long, ctypes.c_long, ctypes.c_float])
        self._decode.restype = None
        self._prefill = lib.paged_prefill_attention
        self._prefill.argtypes = ([ctypes.c_void_p, ctypes.c_long] + [ctypes.c_void_p] * 6
                                  + [ctypes.c_long] * 6 + [ctypes.c_float] + [ctypes.c_long] * 3 + [ctypes.c_float])
        self._prefill.restype = ctypes.c_int
        self._sample = lib.sample_rows
        self._sample.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long] + [ctypes.c_void_p] * 6
        self._sample.restype = ctypes.c_int
        self._penalties = lib.apply_penalties
        self._penalties.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long] + [ctypes.c_void_p] * 6
        self._penalties.restype = ctypes.c_int
        self._logprobs = lib.token_logprobs
        self._logprobs.argtypes = ([ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p,
                                    ctypes.c_long] + [ctypes.c_void_p] * 4)
        self._logprobs.restype = None

    def packed_rows(self, w: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
        """packed_rows (an embedding lookup from a packed copy) in C: the same float32 rows."""
        ids = ids.to(torch.int64).contiguous()
        if ids.dim() != 1 or w.dtype not in _WEIGHT_DTYPES or not w.panels.is_contiguous():
            raise ValueError(f"packed_rows takes ids [n] and contiguous float32, bfloat16 or float16 panels; got "
                             f"ids {tuple(ids.shape)}, panels {w.dtype}")
        out = torch.empty(ids.shape[0], w.in_features)
        if self._rows(w.panels.data_ptr(), _WEIGHT_DTYPES[w.dtype], w.out_features, w.in_features,
                      ids.data_ptr(), ids.shape[0], out.data_ptr()):
            raise IndexError(f"a token id is outside the embedding's {w.out_features} rows")
        return out

    def paged_decode_attention(self, q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                               seq_lens: torch.Tensor, scale: float, window: int = 0,
                               softcap: Optional[float] = None) -> torch.Tensor:
        """q [B, Hq, D] or [B, Hq * D] float32 (rows may be strided, as slices of the fused QKV
        output are), cache [2, num_blocks, block_size, Hkv, D] float32 or float16, block_tables
        [B, W] and seq_lens [B] int64 -> [B, Hq * D]: each row's single query against its sequence's keys
        (its last `window` keys, with a sliding window > 0; scores softcap * tanh(score / softcap)
        with a soft cap, Gemma 2's).
        The tables must cover each sequence's length (the runner builds them so)."""
        num_heads, out = self._check_attention(q, cache, block_tables, seq_lens, q.shape[0])
        _, _, block_size, num_kv_heads, head_dim = cache.shape
        self._decode(q.data_ptr(), q.stride(0), cache[0].data_ptr(), cache[1].data_ptr(),
                     block_tables.data_ptr(), seq_lens.data_ptr(), out.data_ptr(),
                     q.shape[0], num_heads, num_kv_heads, head_dim, block_size, block_tables.shape[1], scale,
                     cache.dtype == torch.float16, max(window, 0), softcap or 0.0)
        return out

    def paged_prefill_attention(self, q: torch.Tensor, cache: torch.Tensor, query_start_loc: torch.Tensor,
                                block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                                bf16_dot: bool = False, window: int = 0,
                                softcap: Optional[float] = None) -> torch.Tensor:
        """Causal attention of S sequences' query rows: sequence s's are rows query_start_loc[s] ..
        query_start_loc[s + 1] - 1 of q (as for paged_decode_attention), at the last positions
        before seq_lens[s], each over its keys up to its own position, through row s of block_tables
        [S, W] (int64; its keys, this chunk's included, already in the cache) -> [N, Hq * D].
        With `bf16_dot`, where the build has AVX512-BF16 (bf16_dot_min_rows) and head_dim is a
        multiple of 16, both products take bfloat16 dot products (q, K, V and the softmax's weights
        rounded to bfloat16; the sums and the softmax stay float32). With a sliding `window` > 0,
        each row sees only its last `window` keys; `softcap` as paged_decode_attention's."""
        n_seqs = seq_lens.shape[0]
        num_heads, out = self._check_attention(q, cache, block_tables, seq_lens, n_seqs)
        loc = query_start_loc.tolist()
        lens = seq_lens.tolist()
        if (query_start_loc.dtype != torch.int64 or len(loc) != n_seqs + 1 or loc[0] != 0
                or loc[-1] != q.shape[0] or any(not 0 < b - a <= n for a, b, n in zip(loc, loc[1:], lens))):
            raise ValueError(f"query_start_loc must be int64 [S + 1], from 0 to the {q.shape[0]} query rows, "
                             f"each sequence's rows at most its length; got {query_start_loc.dtype} {loc} "
                             f"for lengths {lens}")
        _, _, block_size, num_kv_heads, head_dim = cache.shape
        query_start_loc = query_start_loc.contiguous()
        if self._prefill(q.data_ptr(), q.stride(0), cache[0].data_ptr(), cache[1].data_ptr(),
                         query_start_loc.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(), out.data_ptr(),
                         n_seqs, num_heads, num_kv_heads, head_dim, block_size, block_tables.shape[1], scale,
                         cache.dtype == torch.float16, bf16_dot, max(window, 0), softcap or 0.0):
            raise MemoryError("the CPU prefill attention found no memory for its scratch")
        return out

    @staticmethod
    def _check_attention(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, n_seqs: int) -> tuple[int, torch.Tensor]:
        """(query heads, the output) for the attention kernels' inputs; ValueError for any they cannot
        read. The block tables' contents are not checked: they must cover each sequence's length with
        block IDs inside the cache (the runner builds them so; the C step checks its own)."""
        num_kv_heads, head_dim = cache.shape[3:]
        num_heads = q.shape[1] if q.dim() == 3 else q.shape[1] // head_dim
        heads_packed = q.stride(-1) == 1 and (q.dim() == 2 or q.stride(1) == head_dim)
        if (q.dtype != torch.float32 or cache.dtype not in KV_CACHE_DTYPES or not heads_packed
                or not cache.is_contiguous() or not fits_decode_attention(num_heads, num_kv_heads, head_dim)
                or block_tables.dtype != torch.int64 or not block_tables.is_contiguous()
                or seq_lens.dtype != torch.int64 or not seq_lens.is_contiguous()
                or block_tables.shape[0] != n_seqs or seq_lens.shape[0] != n_seqs):
            raise ValueError(f"the CPU attention kernels cannot read q {q.dtype} {tuple(q.shape)}, "
                             f"cache {cache.dtype} {tuple(cache.shape)}, tables {block_tables.dtype} "
                             f"{tuple(block_tables.shape)}, seq_lens {seq_lens.dtype} {tuple(seq_lens.shape)}")
        return num_heads, torch.empty(q.shape[0], num_heads * head_dim)

    def sample(self, logits: torch.Tensor, temperature: np.ndarray, min_p: np.ndarray, top_k: np.ndarray,
               top_p: np.ndarray, u: np.ndarray) -> torch.Tensor:
        """One token per row of logits [B, V] (float32) -> int64 [B]: the argmax where temperature
        is 0, else a draw from softmax(logits / temperature) after min_p, then top_k, then top_p
        over what min_p kept (0, 0 and 1: off), the inverse CDF at u (in [0, 1)); per row, float32
        arrays but top_k (int64). The Sampler's torch path in a few passes over each row."""
        logits = logits.contiguous()
        rows, vocab = logits.shape
        args = [np.ascontiguousarray(a, dtype=t) for a, t in ((temperature, np.float32), (min_p, np.float32),
                                                               (top_k, np.int64), (top_p, np.float32),
                                                               (u, np.float32))]
        if logits.dtype != torch.float32 or any(a.shape != (rows,) for a in args):
            raise ValueError(f"sample takes float32 logits [B, V] and one value per row; got {logits.dtype} "
                             f"{tuple(logits.shape)} and {[a.shape for a in args]}")
        out = torch.empty(rows, dtype=torch.int64)
        if self._sample(logits.data_ptr(), rows, vocab, *(a.ctypes.data for a in args), out.data_ptr()):
            raise MemoryError("the C sampler found no memory for its scratch")
        return out

    def apply_penalties(self, logits: torch.Tensor, ids: np.ndarray, offsets: np.ndarray, prompt_len: np.ndarray,
                        rep: np.ndarray, freq: np.ndarray, pres: np.ndarray) -> None:
        """The Sampler's penalties on logits [B, V] (float32, contiguous), in place: row b's tokens
        are ids[offsets[b]:offsets[b + 1]] (int64), its prompt's the first prompt_len[b]; rep, freq
        and pres (float32) per row, as Sampler.apply_penalties takes them."""
        rows, vocab = logits.shape
        ints = [np.ascontiguousarray(a, dtype=np.int64) for a in (ids, offsets, prompt_len)]
        floats = [np.ascontiguousarray(a, dtype=np.float32) for a in (rep, freq, pres)]
        if (logits.dtype != torch.float32 or not logits.is_contiguous() or ints[1].shape != (rows + 1,)
                or ints[1][0] != 0 or ints[1][-1] != len(ints[0]) or np.any(np.diff(ints[1]) < ints[2])
                or any(a.shape != (rows,) for a in [ints[2], *floats])):
            raise ValueError("apply_penalties takes contiguous float32 logits [B, V], int64 token IDs, offsets "
                             "[B + 1] from 0 to their count and prompt lengths within each row's, and one "
                             "float32 of each penalty per row")
        if self._penalties(logits.data_ptr(), rows, vocab, *(a.ctypes.data for a in ints + floats)):
            raise MemoryError("the C penalties found no memory for their counts")

    def token_logprobs(self, logits: torch.Tensor, tokens: np.ndarray, top_n: np.ndarray
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """log_softmax's view of rows of logits [B, V] (float32): for each row whose top_n (int64)
        is >= 0, its token's logprob and rank (1 + the tokens of higher logprob) and its top_n best
        tokens' IDs and logprobs, best first -> (chosen [B], rank [B], top IDs [B, max], top logprobs
        [B, max]); rows with top_n -1 are left as zeros."""
        logits = logits.contiguous()
        rows, vocab = logits.shape
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        top_n = np.ascontiguousarray(top_n, dtype=np.int64)
        if (logits.dtype != torch.float32 or tokens.shape != (rows,) or top_n.shape != (rows,)
                or np.any((tokens < 0) | (tokens >= vocab)) or np.any(top_n > vocab)):
            raise ValueError(f"token_logprobs takes float32 logits [B, V], a token below V and a count of at most "
                             f"V per row; got {logits.dtype} {tuple(logits.shape)}, {tokens}, {top_n}")
        max_n = max(int(top_n.max(initial=0)), 1)
        chosen, rank = np.zeros(rows, dtype=np.float32), np.zeros(rows, dtype=np.int64)
        top_ids, top_vals = np.zeros((rows, max_n), dtype=np.int64), np.zeros((rows, max_n), dtype=np.float32)
        self._logprobs(logits.data_ptr(), rows, vocab, tokens.ctypes.data, top_n.ctypes.data, max_n,
                       chosen.ctypes.data, rank.ctypes.data, top_ids.ctypes.data, top_vals.ctypes.data)
        return chosen, rank, top_ids, top_vals

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        _check_rows(x)
        out = torch.empty_like(x)
        self._norm(x.data_ptr(), None, weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)
        return out

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """In place on both: residual += x; x = rmsnorm(residual) * weight. Returns (x, residual)."""
        _check_rows(x)
        _check_rows(residual)
        self._norm(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), x.data_ptr(),
                   x.shape[0], x.shape[1], eps)
        return x, residual


def fits_decode_attention(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the C decode attention's on-stack accumulators hold this head layout."""
    return num_heads % num_kv_heads == 0 and num_heads <= 256 and num_heads * head_dim <= 16384


def _check_rows(x: torch.Tensor) -> None:
    if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous() or x.device.type != "cpu":
        raise ValueError(f"the CPU RMSNorm kernel takes contiguous float32 [T, H] CPU tensors, "
                         f"got {x.dtype} {tuple(x.shape)}")


@lru_cache(maxsize=None)
def load() -> Optional[CpuKernels]:
    """The kernels, built on first use; None where they cannot run (the log says why)."""
    reason = _usable()
    if reason is None:
        try:
            lib = ctypes.CDLL(_build(_compiler()))
        except (OSError, subprocess.CalledProcessError) as exc:
            reason = f"building {SOURCE} failed: {getattr(exc, 'stderr', None) or exc}"
    if reason is not None:
        logger.info("CPU kernels not used (%s): the CPU path uses torch ops only", reason)
        return None
    return CpuKernels(lib)


@lru_cache(maxsize=None)
def built_with(flags: tuple[str, ...]) -> CpuKernels:
    """The kernels built with extra compiler flags, for tests and benchmarks: e.g. ("-mno-avx512f",)
    on a CPU with AVX-512 runs the 256-bit code other CPUs run."""
    return CpuKernels(ctypes.CDLL(_build(_compiler(), flags)))


def _wrap_gemm(fn, dtype: torch.dtype):
    def gemm(x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
        x = x.contiguous()
        m, k = x.shape
        if (x.dtype != torch.float32 or w.dtype != dtype or w.in_features != k
                or w.panels.shape != packed_shape(w.out_features, k, dtype)):
            raise ValueError(f"the packed GEMM for {dtype} takes float32 x [M, K] and {dtype} panels "
                             f"{list(packed_shape(w.out_features, k, dtype))}; got x {x.dtype} {tuple(x.shape)}, "
                             f"panels {w.dtype} {tuple(w.panels.shape)}")
        if k % 2 and dtype == torch.bfloat16:  # the pairs' padding column, against a zero of x's
            x, k = torch.nn.functional.pad(x, (0, 1)), k + 1
        y = torch.empty(m, w.out_features)
        fn(x.data_ptr(), w.panels.data_ptr(), y.data_ptr(), m, w.out_features, k)
        return y
    return gemm


def _wrap_quant_gemv(fn, kind: str, row_bytes: Callable[[int], int]) -> Gemv:
    block_weights = BLOCKS[kind][0]

    def gemv(x: torch.Tensor, w: PackedQuant, bf16: bool = False) -> torch.Tensor:
        """x @ w.T; `bf16`: from quant_dequantized_min_rows[True] vectors on, bfloat16 dot products
        where the build takes them (a bfloat16 model's arithmetic), else float32."""
        x = x.contiguous()
        (m, k), n = x.shape, w.rows.shape[0]
        if (x.dtype != torch.float32 or k % block_weights or w.kind != kind or w.in_features != k
                or w.rows.dtype != torch.uint8 or not w.rows.is_contiguous() or w.rows.shape[1] != row_bytes(k)):
            raise ValueError(f"the quantized GEMV takes float32 x [M, K] (K a multiple of {block_weights}) and "
                             f"{kind} rows of K weights packed by pack_quantized; got x {x.dtype} {tuple(x.shape)}, "
                             f"{w.kind} rows {w.rows.dtype} {tuple(w.rows.shape)} of {w.in_features} weights")
        y = torch.empty(m, n)
        if fn(x.data_ptr(), w.rows.data_ptr(), y.data_ptr(), m, n, k, int(bf16)):
            raise MemoryError("the quantized GEMV found no memory for its int16 activations or its strips")
        return y
    return gemv


# -- a small step in one call ------------------------------------------------------------

# the C side's WEIGHT_* codes
_WEIGHT_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_QUANT_KINDS = {"q4_0": 3, "q4_1": 4, "q8_0": 5, "q4_k": 6}


class _Weight(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("type", ctypes.c_long)]


_LINEARS = ("qkv", "o", "gate_up", "down")


class _StepLayer(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_void_p) for name in ("input_norm", "post_norm")]
                + [(name, _Weight * 2) for name in _LINEARS]
                + [(name, ctypes.c_void_p) for name in ("qkv_bias", "q_norm", "k_norm", "k_cache", "v_cache")]
                + [("window", ctypes.c_long)]
                + [(name, ctypes.c_void_p) for name in ("pre_ff_norm", "post_ff_norm", "cos_sin")]
                + [("no_rope", ctypes.c_long)])


class _StepModel(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_long) for name in (
        "num_layers", "hidden", "intermediate", "num_heads", "num_kv_heads", "head_dim", "block_size",
        "max_position", "num_slots", "quant_max_tokens", "kv_half", "bf16_dot", "gelu", "rotary_dim",
        "post_norms", "qk_norm_whole")]
        + [("eps", ctypes.c_float), ("scale", ctypes.c_float), ("softcap", ctypes.c_float),
           ("residual_scale", ctypes.c_float),
           ("final_norm", ctypes.c_void_p),
           ("cos_sin", ctypes.c_void_p), ("layers", ctypes.POINTER(_StepLayer))])


class _LoRAPair(ctypes.Structure):
    _fields_ = [("a", _Weight), ("b", _Weight), ("rank", ctypes.c_long)]


class _LoRALayer(ctypes.Structure):
    _fields_ = [("pair", _LoRAPair * len(_LINEARS))]


class _StepLoRA(ctypes.Structure):
    _fields_ = [("num_groups", ctypes.c_long), ("rows", ctypes.c_void_p), ("offsets", ctypes.c_void_p),
                ("layers", ctypes.POINTER(ctypes.POINTER(_LoRALayer)))]


class StepForward:
    """A step of up to `max_tokens` tokens through a Llama-family model (models/llama.py) in one
    C call: `step_forward_f32` runs every layer with the same GEMM, RMSNorm and attention
    kernels the Python path calls, and the small ops between them (bias, q/k norms, rotary,
    the KV cache write, SiLU-and-mul) in C, without returning to Python in between. Each
    token attends over its sequence's cache up to its own position (the whole step's keys are
    written first): the decodes through paged_decode_attention, the prefill chunks through
    paged_prefill_attention.

    Built once the KV caches exist: the C side keeps pointers to the weights (each Linear's
    packed copy, and its GGUF blocks, read by steps of at most
    `quant_max_tokens` tokens, where it has those) and to the caches, and this object keeps
    them alive.
    `unsupported(model, kv_caches)` says why a model cannot run this way."""

    def __init__(self, kernels: CpuKernels, model, kv_caches: list[torch.Tensor], max_tokens: int,
                 quant_max_tokens: int = 0, bf16_dot: bool = False) -> None:
        reason = self.unsupported(model, kv_caches)
        if reason:
            raise ValueError(f"the C step cannot run this model: {reason}")
        arch, self.model, self.max_tokens = model.arch, model, max_tokens
        self._fn = kernels.lib.step_forward_f32
        self._fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_long] * 3 + [ctypes.c_void_p] * 2
        self._fn.restype = ctypes.c_int
        self._keep: list[torch.Tensor] = []  # every tensor the C side points into

        def ptr(t: Optional[torch.Tensor]) -> Optional[int]:
            if t is None:
                return None
            self._keep.append(t)
            return t.data_ptr()

        def weights(linear):
            if linear.only_quantized:  # (its blocks for every step)
                return (_Weight * 2)((ptr(linear.quantized.rows), _QUANT_KINDS[linear.quantized.kind]), (None, 0))
            pair = (_Weight * 2)((ptr(linear.packed.panels), _WEIGHT_DTYPES[linear.packed.dtype]), (None, 0))
            if linear.quantized is not None:
                pair[1] = _Weight(ptr(linear.quantized.rows), _QUANT_KINDS[linear.quantized.kind])
            return pair

        layers = (_StepLayer * arch.num_layers)()
        for i, (entry, layer, cache) in enumerate(zip(layers, model.layers, kv_caches)):
            attn = layer.self_attn
            entry.window = arch.window(i)
            entry.pre_ff_norm = ptr(getattr(layer.pre_feedforward_layernorm, "weight", None))
            entry.post_ff_norm = ptr(getattr(layer.post_feedforward_layernorm, "weight", None))
            entry.cos_sin = ptr(model.rotary_local.cos_sin_cache if attn.local_rope else None)
            entry.no_rope = not attn.rotates
            entry.input_norm = ptr(getattr(layer.input_layernorm, "weight", None))  # (none: OLMo 2's)
            entry.post_norm = ptr(layer.post_attention_layernorm.weight)
            entry.qkv, entry.o = weights(attn.qkv_proj), weights(attn.o_proj)
            entry.gate_up, entry.down = weights(layer.mlp.gate_up_proj), weights(layer.mlp.down_proj)
            entry.qkv_bias = ptr(attn.qkv_proj.bias)
            entry.q_norm = ptr(attn.q_norm.weight if attn.q_norm is not None else None)
            entry.k_norm = ptr(attn.k_norm.weight if attn.k_norm is not None else None)
            entry.k_cache, entry.v_cache = ptr(cache[0]), ptr(cache[1])
        self._layers = layers
        self._model = _StepModel(
            num_layers=arch.num_layers, hidden=arch.hidden_size, intermediate=arch.intermediate_size,
            num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
            block_size=kv_caches[0].shape[2], max_position=model.rotary.cos_sin_cache.shape[0],
            num_slots=kv_caches[0].shape[1] * kv_caches[0].shape[2],
            quant_max_tokens=quant_max_tokens, kv_half=kv_caches[0].dtype == torch.float16, bf16_dot=bf16_dot,
            gelu=arch.hidden_act == "gelu_tanh", rotary_dim=arch.rotated_dims, post_norms=arch.post_norms,
            qk_norm_whole=arch.qk_norm_whole,
            eps=arch.rms_norm_eps, scale=arch.scale, softcap=arch.attn_softcap or 0.0,
            residual_scale=arch.residual_scale, final_norm=ptr(model.norm.weight),
            cos_sin=ptr(model.rotary.cos_sin_cache), layers=layers)
        self._model_ref = ctypes.byref(self._model)
        per_token = kernels.lib.step_scratch_floats
        per_token.argtypes, per_token.restype = [ctypes.c_void_p], ctypes.c_long
        # the step's activations, allocated once (an 8B model at 256 tokens needs ~64 MB)
        self._scratch = torch.empty(max_tokens * per_token(self._model_ref))
        # each LoRA adapter's pairs as the C side reads them, packed as the weights are: built
        # for its first step here, gone with the adapter
        self._lora_layers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def _adapter_layers(self, adapter) -> tuple:
        """(_LoRALayer array, the tensors it points into) for a LoRAAdapter (lora/adapter.py)."""
        kept = self._lora_layers.get(adapter)
        if kept is None:
            tensors: list[torch.Tensor] = []
            layers = (_LoRALayer * len(self.model.layers))()
            for entry, layer in zip(layers, self.model.layers):
                linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                           layer.mlp.down_proj)
                for pair, linear in zip(entry.pair, linears):
                    weights = adapter.weights.get(linear.lora_key)
                    if weights is None:
                        continue
                    a, b = (w.float().cpu() for w in weights)
                    if a.shape[0] % 2:  # an odd rank: a zero row of a and column of b (bfloat16 pairs)
                        a, b = F.pad(a, (0, 0, 0, 1)), F.pad(b, (0, 1))
                    dtype = linear.packed.dtype if linear.packed is not None else torch.float32
                    packed_a, packed_b = pack_weight(a.to(dtype)).panels, pack_weight(b.to(dtype)).panels
                    tensors += [packed_a, packed_b]
                    pair.a = _Weight(packed_a.data_ptr(), _WEIGHT_DTYPES[dtype])
                    pair.b = _Weight(packed_b.data_ptr(), _WEIGHT_DTYPES[dtype])
                    pair.rank = a.shape[0]
            kept = self._lora_layers[adapter] = (layers, tensors)
        return kept

    def _step_lora(self, lora) -> tuple:
        """(_StepLoRA, what it points into) for a LoRAStep (lora/step.py)."""
        groups = lora.row_lists
        rows = np.ascontiguousarray(np.concatenate([r for r, _ in groups]), dtype=np.int64)
        offsets = np.cumsum([0] + [len(r) for r, _ in groups]).astype(np.int64)
        layers = [self._adapter_layers(adapter)[0] for _, adapter in groups]
        pointers = (ctypes.POINTER(_LoRALayer) * len(layers))(
            *(ctypes.cast(layer, ctypes.POINTER(_LoRALayer)) for layer in layers))
        step = _StepLoRA(len(groups), rows.ctypes.data, offsets.ctypes.data, pointers)
        return step, (rows, offsets, pointers, layers)

    @staticmethod
    def unsupported(model, kv_caches: list[torch.Tensor]) -> Optional[str]:
        """Why `model` with these caches cannot take the C step, or None when it can."""
        arch = model.arch
        if arch.hidden_act not in ("silu", "gelu_tanh"):
            return f"its MLP is gated by {arch.hidden_act}"
        if not fits_decode_attention(arch.num_heads, arch.num_kv_heads, arch.head_dim) or arch.head_dim % 2:
            return f"heads {arch.num_heads}/{arch.num_kv_heads} of {arch.head_dim}"
        if arch.rotated_dims % 2 or any(r.cos_sin_cache.shape[-1] != arch.rotated_dims for r in model.rotaries()):
            return f"its rotary turns {arch.rotated_dims} dims, its tables hold another number"
        if any(t.dtype not in KV_CACHE_DTYPES or t.dtype != kv_caches[0].dtype or t.device.type != "cpu"
               or not t.is_contiguous() for t in kv_caches):
            return "its KV caches are not all contiguous float32 or all float16 on the CPU"
        floats = [r.cos_sin_cache for r in model.rotaries()] + [model.norm.weight]
        for layer in model.layers:
            attn = layer.self_attn
            floats += [norm.weight for norm in layer.norms()]
            floats += [t for t in (attn.qkv_proj.bias,) if t is not None]
            if (attn.q_norm is None) != (attn.k_norm is None):
                return "it norms q or k alone"
            floats += [norm.weight for norm in (attn.q_norm, attn.k_norm) if norm is not None]
            linears = (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            packed = [lin for lin in linears if not lin.only_quantized]
            if any(lin.packed is None or lin.packed.dtype not in _WEIGHT_DTYPES for lin in packed) \
                    or any(lin.bias is not None for lin in linears[1:]):
                return ("its linear weights are not all packed float32, bfloat16 or float16 or quantized blocks, "
                        "without bias")
            if any(lin.packed.dtype == torch.bfloat16 and lin.in_features % 2 for lin in packed):
                return "a bfloat16 weight has an odd number of columns (the C GEMM reads them in pairs)"
        if any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() for t in floats):
            return "it does not compute in float32 on the CPU"
        return None

    def __call__(self, input_ids: torch.Tensor, slot_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, lora=None) -> torch.Tensor:
        """Hidden states after the final norm, [B, hidden], for B <= max_tokens tokens: per token
        its slot (slot_mapping [B]); per sequence (the decodes first) as paged_prefill_attention
        takes them: its tokens' rows (query_start_loc [S + 1]), its blocks (block_tables [S, W])
        and its length after the step (seq_lens [S]); all contiguous int64. Inputs that would
        reach outside the caches or the rotary table raise ValueError before anything is computed.
        lora: the step's LoRAStep (lora/step.py), its adapters added to their rows' linear layers."""
        b, n_seqs = input_ids.shape[0], seq_lens.shape[0]
        shapes = ((slot_mapping, (b,)), (query_start_loc, (n_seqs + 1,)), (seq_lens, (n_seqs,)))
        if (not 0 < b <= self.max_tokens or block_tables.dim() != 2 or block_tables.shape[0] != n_seqs
                or any(t.shape != shape for t, shape in shapes)
                or any(t.dtype != torch.int64 or not t.is_contiguous() for t, _ in (*shapes, (block_tables, 0)))):
            raise ValueError(f"the C step takes 1 to {self.max_tokens} tokens with contiguous int64 slots [B], "
                             f"query_start_loc [S + 1], block tables [S, W] and lengths [S]; got {b} tokens, "
                             f"{n_seqs} lengths, query_start_loc {tuple(query_start_loc.shape)}, "
                             f"block tables {block_tables.dtype} {tuple(block_tables.shape)}")
        step_lora = None
        if lora is not None:
            if any(int(r.max()) >= b for r, _ in lora.row_lists):
                raise ValueError(f"a LoRA adapter's row is past the step's {b} tokens")
            step_lora, kept = self._step_lora(lora)  # (kept: alive through the call)
        hidden = self.model.embed(input_ids)  # a fresh [B, H] tensor: the step works in it
        rc = self._fn(self._model_ref, hidden.data_ptr(), slot_mapping.data_ptr(), query_start_loc.data_ptr(),
                      block_tables.data_ptr(), seq_lens.data_ptr(), b, n_seqs, block_tables.shape[1],
                      self._scratch.data_ptr(), None if step_lora is None else ctypes.byref(step_lora))
        if rc == -5:
            raise MemoryError("a kernel of the C step found no memory for its scratch")
        if rc:
            raise ValueError({-1: f"a position is past the model's {self._model.max_position} (rotary table)",
                              -2: f"a slot is past the KV cache's {self._model.num_slots}",
                              -3: "a sequence has no tokens or more than its length, a length is past its "
                                  "block-table row, or query_start_loc does not run from 0 to the tokens",
                              -4: "a block ID is past the KV cache"}[rc])
        return hidden
