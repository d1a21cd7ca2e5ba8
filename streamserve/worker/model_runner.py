"""ModelRunner: turn a SchedulerOutput into one flat batch, run the model, sample.

The batch has no padding between requests. Decodes (one query token) come first so
attention can treat them as one padded group; prefill chunks follow. Logits are
computed only for the last scheduled token of each request whose gap closes this
step: a chunk that leaves part of its prompt unread samples nothing. A request that
reads guessed tokens (speculative decoding) is laid out as a chunk, its last token then
the guesses, and samples at every row of it; it keeps the guesses up to the first that
differs from the token its row sampled, plus that token (or the last row's, all kept).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import sys
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import numpy as np
import torch

from streamserve.config import Config
from streamserve.engine.scheduler_output import ModelRunnerOutput, SchedulerOutput
from streamserve.lora.step import LoRAStep
from streamserve.models import cpu_kernels
from streamserve.models.layers import Linear
from streamserve.models.loader import checkpoint_names, load_model
from streamserve.models.quantization import quantized_names
from streamserve.models.quantized import BLOCKS, quantized_shapes, read_quantized
from streamserve.models.registry import build_model
from streamserve.worker.attention import AttentionMetadata, PrefillChunk, TorchPagedAttention
from streamserve.worker.block_table import BlockTable
from streamserve.worker.cuda_graphs import DecodeGraphs, capture_sizes
from streamserve.worker.request_state import DraftRow, RequestState
from streamserve.worker.triton_attention import TritonAttentionMetadata, TritonPagedAttention
from streamserve.worker.sampler import Sampler
from streamserve.worker.staging import HostStaging

logger = logging.getLogger(__name__)

# Without the C kernels, steps of at most this many tokens read the half-size weight copies
# (see choose_dtypes) through torch's emulated bfloat16 GEMMs.
LOW_PRECISION_MAX_TOKENS = 16
# With them, a step of at most C_STEP_MAX_TOKENS tokens runs in one C call (StepForward),
# decodes and prefill chunks alike, through the same kernels as the op-by-op path (which
# takes the larger steps): one call saves ~0.1 s of op-by-op work on a step of 256 tokens.
C_STEP_MAX_TOKENS = 256
# Steps of at most this many tokens read a GGUF model's quantized blocks (models/quantized.py),
# where it has them: the quantized GEMV reads 2-3.5x fewer bytes than the other copies but
# spends more arithmetic per weight. On a 2-core AVX2 machine (Zen 3, 2026-12-01, against the
# packed GEMM over the same weights in one process) Q4_1 / Q4_0 are 2.4x / 1.8x the bfloat16
# GEMM at one token, 1.25x at four, 0.9-1.0x at eight; Q8_0 and Q4_K (Llama-3.2-1B's shapes)
# 1.3-1.4x at four. Against float32 weights they are 1.5-1.7x at eight.
# On a 2-core Zen 5 EPYC (AVX-512, 2026-12-02), with the bf16 panels prefetched far ahead and the
# quantized pairs taken in 512-bit vectors, the default model's decode step read from the blocks
# at batch 3 1.18-1.38x and at batch 4 1.14-1.22x faster than from the bfloat16 copies, and 0.75-0.9x
# at batch 5 (`scripts/profile_step.py`, alternating runs; `ab_cpu_kernels.py --kernel gemv-step
# --both` compares the two kernels alone).
# On a 2-core Sapphire Rapids Xeon (2026-12-03, where the small steps read their weights as
# several streams a thread: csrc, several_streams), the bfloat16 copies won at batch 4 instead,
# 1.11-1.25x (`ab_cpu_kernels.py --kernel gemv-step --both --rows 4`, three runs over two hours),
# and the blocks at batch 3, 1.16-1.18x.
QUANT_MAX_TOKENS = 4  # where the layers keep half-size copies
QUANT_MAX_TOKENS_SEVERAL_STREAMS = 3  # likewise, where small steps read several streams a thread
QUANT_MAX_TOKENS_FLOAT32 = 8  # where they read float32 weights (a float32 checkpoint)
# --cpu-weights auto: quantized layers hold their blocks alone where their copies would take more
# than this share of the machine's memory
QUANTIZED_ONLY_SHARE = 0.25
# The most KV splits a decode sequence gets in the Triton split-KV kernel (its workspace size).
MAX_DECODE_SPLITS = 16
# Prompt logprobs take the head over this many prompt rows at a time: a 2048-token chunk at
# once would be [2048, vocab] float32 logits and their log-softmax (0.8 GB at SmolLM2's 49152).
PROMPT_LOGPROBS_ROWS = 256


def total_memory_bytes() -> int:
    """The memory this process may use: the machine's (4 GiB where the OS does not say), or less
    where its cgroup (a container's limit) allows less."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 4 << 30
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):  # v2, v1
        try:
            with open(path, encoding="ascii") as f:
                limit = f.read().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
    return total


def native_half_gemms(dtype: torch.dtype) -> bool:
    """Whether this CPU runs bfloat16 / float16 GEMMs natively (AVX512-BF16 or AMX,
    AVX512-FP16), rather than emulating them. oneDNN's float16 check asks for the hardware;
    its bfloat16 one says yes for any AVX-512 CPU, where it converts to float32 and back: on
    a 2-core AVX-512 Xeon without AVX512-BF16 (2026-12-01) torch's bfloat16 GEMMs ran at a
    third of the C GEMM's speed, so the CPU's own flags decide."""
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    cpu = torch.cpu
    hardware = (getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()
                or getattr(cpu, "_is_amx_tile_supported", lambda: False)())
    return hardware and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def choose_dtypes(dtype: torch.dtype, device: torch.device,
                  c_kernels: bool) -> tuple[torch.dtype, Optional[torch.dtype], bool]:
    """(compute dtype, half-size weight dtype or None, whether the CPU has native GEMMs in it).

    A bfloat16 / float16 checkpoint on the CPU computes in float32 (its values are exact in
    float32) from half-size copies of its weights: with the C kernels (`c_kernels`: they
    load, on the torch backend), packed copies that the C GEMM reads for every step (and,
    on a CPU with native half GEMMs (AMX) where the C GEMM does not take that dtype's dot
    products itself, row-major ones torch reads for the larger steps);
    without them, row-major copies torch reads for the small steps, which are bound by
    reading the weights, and float32 weights for the rest (where the CPU only emulates half
    precision, several times slower). Without the C kernels a CPU with native half GEMMs
    computes in the checkpoint's dtype throughout.
    """
    if device.type != "cpu" or dtype == torch.float32:
        return dtype, None, False
    native = native_half_gemms(dtype)
    if native and not c_kernels:
        return dtype, None, False
    return torch.float32, dtype, native


@dataclass
class CStepInputs:
    """A CPU step for StepForward: per token, its slot; per sequence (decodes first), its
    tokens' rows (query_start_loc [S + 1]), its block table row ([S, blocks of the longest])
    and its length after the step; all int64."""

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor


class GraphDecodeInputs(NamedTuple):
    """A pure-decode step for DecodeGraphs.replay, as host arrays: per token, its slot (int64),
    its sequence's length after the step and block table row ([B, blocks of the longest]),
    both int32."""

    slot_mapping: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray


class LaunchedStep:
    """A step whose work is queued on the device (ModelRunner.launch), for ModelRunner.collect
    to read back: its sampling rows and their tokens on the device, and what was read on the
    host already (logprobs, prompt logprobs, embeddings). Under async scheduling the tokens
    also come back through a pinned buffer on their own, so that reading them waits for this
    step's work and not for the next step's queued behind it; and `rows` says where each
    request's token is, for the next step's decodes to read it on the device."""

    __slots__ = ("samplers", "tokens", "logprobs", "prompt_logprobs", "embeddings", "spec", "host", "ready", "rows")

    def __init__(self, samplers: list, tokens: Optional[torch.Tensor] = None, logprobs: Optional[list] = None,
                 prompt_logprobs: Optional[dict] = None, embeddings: Optional[dict] = None,
                 spec: Optional[dict] = None) -> None:
        self.samplers, self.tokens, self.logprobs = samplers, tokens, logprobs
        self.prompt_logprobs, self.embeddings, self.spec = prompt_logprobs, embeddings, spec
        self.host: Optional[torch.Tensor] = None
        self.ready: Optional[torch.cuda.Event] = None
        self.rows: dict[str, int] = {}

    def read_ahead(self) -> None:
        """Queue the tokens' copy to the host now (async scheduling), and note each row's request."""
        self.rows = {state.req_id: i for i, state in enumerate(self.samplers)}
        if self.tokens.is_cuda:
            self.host = torch.empty(self.tokens.shape, dtype=self.tokens.dtype, pin_memory=True)
            self.host.copy_(self.tokens, non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()

    def token_list(self) -> list[int]:
        if self.ready is None:
            return self.tokens.tolist()
        self.ready.synchronize()
        return self.host.tolist()


class ModelRunner:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.device = config.device.torch_device
        if self.device.type == "cuda" and self.device.index is not None:
            # Triton launches on the thread's current device; this thread builds and steps the engine
            torch.cuda.set_device(self.device)
        kernels = cpu_kernels.load() if self.device.type == "cpu" else None
        # The C kernels (norms, attention, the one-call step) serve float32 steps on the torch backend.
        c_ok = kernels is not None and config.device.kernel_backend == "torch"
        self.dtype, low_precision, native_half = choose_dtypes(config.model.torch_dtype, self.device, c_ok)
        self.block_size = config.cache.block_size
        # the bytes a weight's copies take, where the C kernels read copies: a packed one in the
        # checkpoint's dtype (float32 for a float32 one), and a row-major one too where torch's native
        # half GEMMs take the larger steps (below)
        two_copies = native_half and not (low_precision == torch.bfloat16 and kernels is not None
                                          and kernels.bf16_dot_min_rows > 0)
        copy_bytes = (4 if low_precision is None else 2) * (2 if two_copies else 1)
        # Whether the layers that have quantized blocks hold them alone (--cpu-weights): for a GGUF
        # conversion decided before loading, so that those layers' weights are never read
        self.quantized_only: Optional[bool] = None
        self.unread_layers: set[str] = set()  # (the layers whose weights those are)
        unread: frozenset = frozenset()
        if c_ok and self.dtype == torch.float32 and config.model.cpu_weights != "copies":
            shapes = quantized_shapes(config.model.model)
            if shapes:  # a GGUF conversion: its blocks are known, and the weights of those that serve alone go unread
                layers = self._plan_quantized_only(
                    config.model, {name: (kind, row_bytes) for name, (kind, _, row_bytes) in shapes.items()}, copy_bytes)
                if self.quantized_only:
                    self.unread_layers = set(layers)
                    unread = frozenset(name for names in layers.values() for name in names)
            elif config.model.quantization is not None:  # a quantized checkpoint: its layers show as they are read
                self._plan_quantized_only(config.model, quantized_names(checkpoint_names(config.model.model)),
                                          copy_bytes)
        # (with the C kernels, a 16-bit checkpoint's linear weights are kept only as packed copies
        # in its dtype, below: they are loaded in it)
        self.model = load_model(config.model, self.device, self.dtype, keep_blocks=c_ok and self.dtype == torch.float32,
                                linear_dtype=low_precision if c_ok else None, skip=unread,
                                blocks_only=bool(self.quantized_only))
        if self.model.unread_weights:  # (a quantized checkpoint's layers that went to their blocks alone)
            layers = self.model.quantized_layers({name: () for name in self.model.unread_weights})
            self.unread_layers = set(layers)
        self.to_device = HostStaging(self.device)  # numpy array -> device tensor
        self.low_precision_max_tokens = 0  # steps up to this many tokens read the weight copies
        self.c_kernels = kernels if c_ok and self.dtype == torch.float32 else None
        if self.c_kernels is not None:
            self.model.use_norm_kernels(kernels)
        arch = self.model.arch
        # the distinct sliding windows of the layers
        self.windows = sorted(set(arch.layer_windows) - {0})
        # whether attention takes the C kernels (they take the windows and Gemma 2's soft cap)
        self.cpu_attention = self.c_kernels is not None and cpu_kernels.fits_decode_attention(
            arch.num_heads, arch.num_kv_heads, arch.head_dim)
        # A bfloat16 checkpoint, where the C kernels take bfloat16 dot products (AVX512-BF16): the
        # GEMM of its larger steps and its prefill attention do (x, q, K, V rounded to bfloat16).
        self.bf16_dot = (self.c_kernels is not None and low_precision == torch.bfloat16
                         and self.c_kernels.bf16_dot_min_rows > 0)
        self.quant_max_tokens = (
            QUANT_MAX_TOKENS_FLOAT32 if low_precision is None
            else QUANT_MAX_TOKENS_SEVERAL_STREAMS if self.c_kernels is not None and self.c_kernels.several_streams
            else QUANT_MAX_TOKENS)
        # The quantized blocks: a checkpoint's, held already; a GGUF's, read here where the layers
        # will hold them alone, else after the copies are made (the layers take each as they use it)
        blocks = (self._quantized_blocks(config.model.model)
                  if self.c_kernels is not None and (self.quantized_only or self.model.checkpoint_blocks) else {})
        if self.quantized_only and not blocks:  # (a checkpoint none of whose layers had blocks: FP8's)
            self.quantized_only = False
        if self.quantized_only is None:
            self.quantized_only = bool(blocks) and self._choose_quantized_only(
                config.model.cpu_weights, [w.shape for w in blocks.values()], copy_bytes)
        if self.quantized_only:  # (first: these layers' weights go before the others' copies are made)
            kept = self._keep_quantized(blocks, half_copies=low_precision is not None, only=True)
            if not self.unread_layers <= set(kept):
                raise RuntimeError(f"layers whose weights were left unread got no quantized blocks: "
                                   f"{sorted(self.unread_layers - set(kept))}")
        if self.c_kernels is not None:
            # Every step reads packed copies (in the checkpoint's dtype) through the C GEMM, but
            # where torch's native half-precision GEMMs (AMX) take the GEMMs of more than
            # C_STEP_MAX_TOKENS rows from row-major copies; either way the float32 weights go
            # (a tied embedding's lookups then read the head's packed copy). Where the C GEMM
            # takes bfloat16 dot products itself (AVX512-BF16), it matched oneDNN's on 2000-token
            # steps (and with AMX's tiles, oneDNN's AMX GEMMs from 256 rows, beating them below),
            # so a bfloat16 checkpoint keeps no row-major copies.
            copy = low_precision or torch.float32
            native = native_half and not self.bf16_dot
            self.model.keep_copies(copy, self.c_kernels.gemm[copy], C_STEP_MAX_TOKENS if native else sys.maxsize,
                                   row_major=native, drop_full=True, rows=self.c_kernels.packed_rows)
            self.low_precision_max_tokens = sys.maxsize
            name = str(copy).removeprefix("torch.")
            logger.info("computing in float32 from packed %s weights, read by the C GEMM (%d-bit vectors%s) for %s",
                        name, self.c_kernels.vector_bits,
                        f"; bfloat16 dot products from {self.c_kernels.bf16_dot_min_rows} rows, and in the "
                        "prefill attention" + (f"; AMX's tiles from {self.c_kernels.amx_min_rows} rows"
                                               if self.c_kernels.amx_min_rows else "") if self.bf16_dot else "",
                        f"steps of at most {C_STEP_MAX_TOKENS} tokens and by torch's native {name} GEMMs above"
                        if native else "every step")
        elif low_precision is not None:  # (choose_dtypes: a CPU with native half GEMMs computes in them)
            self.low_precision_max_tokens = LOW_PRECISION_MAX_TOKENS
            half = str(low_precision).removeprefix("torch.")
            logger.info("computing in float32, with %s weight copies read by torch for steps of at most %d tokens",
                        half, LOW_PRECISION_MAX_TOKENS)
            self.model.keep_copies(low_precision)
        if self.c_kernels is not None and not self.quantized_only:
            blocks = blocks or self._quantized_blocks(config.model.model)
            if blocks:
                self._keep_quantized(blocks, half_copies=low_precision is not None)
        del blocks  # (what the layers did not take)
        if self.device.type == "cpu":
            self.model.move_copies(cpu_kernels.onto_huge_pages)
            cpu_kernels.release_freed_memory()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.triton = config.device.kernel_backend == "triton"
        self.workspace = None
        if self.triton:
            from streamserve_kernels.attention import DecodeWorkspace

            self.model.use_kernels()
            if self.device.type == "cuda":
                self._choose_gemv()
            # rows for every decode batch, a captured graph's padding rows included
            max_num_seqs = config.scheduler.max_num_seqs
            rows = max(max_num_seqs, capture_sizes(max_num_seqs)[-1])
            self.workspace = DecodeWorkspace.allocate(rows, self.num_heads, self.head_dim, MAX_DECODE_SPLITS,
                                                      self.device)
        self.kv_dtype = self._choose_kv_dtype(config.cache.kv_cache_dtype, low_precision)
        self.num_blocks = self._determine_num_blocks()
        # One tensor per layer: [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim].
        shape = (2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        # the blocks a first step's tokens get (the free queue hands out the lowest first)
        first_blocks = -(-config.scheduler.max_num_batched_tokens // self.block_size)
        self.kv_caches = [self._zeros(shape, first_blocks) for _ in range(arch.num_layers)]
        # On the CPU, steps of up to C_STEP_MAX_TOKENS tokens run in one C call (what CUDA graphs are on a GPU).
        self.c_step: Optional[cpu_kernels.StepForward] = None
        if self.c_kernels is not None and not config.device.enforce_eager:
            reason = cpu_kernels.StepForward.unsupported(self.model, self.kv_caches)
            if reason is None:
                self.c_step = cpu_kernels.StepForward(self.c_kernels, self.model, self.kv_caches, C_STEP_MAX_TOKENS,
                                                      self.quant_max_tokens, self.bf16_dot)
            else:
                logger.info("every step runs op by op: the C step cannot run this model (%s)", reason)
        self.graphs: Optional[DecodeGraphs] = None
        if config.device.use_cuda_graphs:
            self.graphs = self.make_decode_graphs()
            self.graphs.capture()
        self.sampler = Sampler(self.device, config.model.seed, self.to_device, kernels, self._kernel_argmax())
        self.requests: dict[str, RequestState] = {}
        self.num_embedding_requests = 0  # of those, with SamplingParams.embed (their steps pool)
        self.num_lora_requests = 0  # of those, with a LoRA adapter (their steps group their rows by it)
        self.block_table = BlockTable(config.scheduler.max_num_seqs,
                                      -(-config.model.max_model_len // self.block_size))
        # async scheduling (config.scheduler.runs_ahead): the step launched and not read back,
        # whose tokens the next step's decodes read on the device
        self.in_flight: Optional[LaunchedStep] = None

    def _kernel_argmax(self) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
        """Greedy decoding's argmax through the Triton kernel, on a GPU's Triton path (where
        torch's takes 27 us of a 128256-token row: streamserve_kernels.sampling)."""
        if not (self.triton and self.device.type == "cuda"):
            return None
        from streamserve_kernels.sampling import argmax

        return argmax

    def _choose_gemv(self) -> None:
        """Batch-1 products through the Triton GEMV for the half-precision weight shapes where,
        timed here once per shape, it beats torch's (streamserve_kernels.gemv.choose)."""
        from streamserve_kernels import gemv

        chosen: dict[tuple, tuple] = {}
        for module in self.model.modules():
            w = getattr(module, "weight", None)
            if not isinstance(module, Linear) or w is None or w.dim() != 2 or w.dtype not in (
                    torch.bfloat16, torch.float16) or w.device.type != "cuda" or not w.is_contiguous():
                continue
            key = _weight_key(module)
            if key not in chosen:
                chosen[key] = gemv.choose(w, module.bias)
            module.gemv = chosen[key][0]
        for (shape, _, _), (fn, times) in chosen.items():
            best = min(times, key=times.get)
            logger.info("one-row product [1, %d] x [%d, %d]^T: %s (%.1f us; torch's %.1f us)", shape[1], *shape,
                        "torch's" if fn is None else f"the Triton GEMV {best}", times[best], times["torch"])
        self._choose_fused(set(chosen))

    def _choose_fused(self, takes: set) -> None:
        """The one-row kernels that fold a small op into the product after (or before) it, where,
        timed here once per shape against the op's kernel and then the layer's product, they
        win: SiLU-and-mul into the down projection (LlamaMLP.gated_down); each norm of a layer of
        plain pre-norms into the projection after it (LlamaDecoderLayer.normed_qkv,
        normed_gate_up). `takes`: the (shape, dtype, bias) keys of the weights the GEMV takes
        (_choose_gemv)."""
        from streamserve_kernels import gemv
        from streamserve_kernels.activation import silu_and_mul

        fused: dict[tuple, tuple] = {}

        def pick(kind: str, linear: Linear, choose):
            key = _weight_key(linear)
            if key not in takes:
                return None
            if (kind, key) not in fused:
                fused[kind, key] = choose(linear.weight, linear.bias)
            return fused[kind, key][0]

        def product(linear: Linear) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
            """(x, weight) -> the one-row product the layer takes, on that weight."""
            fn = linear.gemv or torch.nn.functional.linear
            return lambda x, w: fn(x, w, linear.bias)

        for layer in self.model.layers:
            mlp, attn = layer.mlp, layer.self_attn
            if self.model.arch.hidden_act == "silu":
                down = product(mlp.down_proj)
                mlp.gated_down = pick("SiLU-and-mul, then", mlp.down_proj, lambda w, b, down=down: gemv.choose_gated(
                    w, b, lambda x, w: down(silu_and_mul(x), w)))
            if layer.plain_norms:
                layer.normed_qkv, layer.normed_gate_up = (
                    pick("RMSNorm, then", linear, lambda w, b, norm=norm, linear=linear: gemv.choose_normed(
                        w, b, norm.weight, norm.eps, product(linear))) for norm, linear in (
                        (layer.input_layernorm, attn.qkv_proj), (layer.post_attention_layernorm, mlp.gate_up_proj)))
        for (kind, (shape, _, _)), (fn, times) in fused.items():
            best = min(times, key=times.get)
            logger.info("one-row step: %s [1, %d] x [%d, %d]^T: %s (%.1f us; apart %.1f us)", kind, shape[1], *shape,
                        "apart" if fn is None else f"in the Triton GEMV's kernel {best}", times[best],
                        times["unfused"])

    def _quantized_blocks(self, model_dir: str) -> dict:
        """The quantized blocks of a model converted from GGUF, or of a quantized checkpoint
        (models/quantization.py): Hugging Face name -> QuantizedWeight, or {}."""
        weights = read_quantized(model_dir)
        self.blocks_origin = "GGUF's" if weights else "checkpoint's"
        weights = weights or self.model.checkpoint_blocks
        self.model.checkpoint_blocks = {}  # (the layers take what they read)
        return weights

    def _plan_quantized_only(self, model_config, kinds: dict, copy_bytes: int) -> dict[str, list[str]]:
        """Decide self.quantized_only before the model loads (so that the layers that will hold
        only their blocks are never read into weights), from the sizes of the layers whose
        checkpoint weights `kinds` names as quantized (as LlamaForCausalLM.quantized_layers takes
        them; for a quantized checkpoint, all of them: which get blocks shows only as they are
        read). Returns those layers (a head tied to the embedding left out)."""
        with torch.device("meta"):
            model = build_model(model_config.hf_config)
        layers = model.quantized_layers(kinds)
        if model.arch.tie_word_embeddings:
            layers.pop("lm_head", None)
        modules = dict(model.named_modules())
        sizes = [(modules[name].out_features, modules[name].in_features) for name in layers]
        self.quantized_only = self._choose_quantized_only(model_config.cpu_weights, sizes, copy_bytes)
        return layers

    def _choose_quantized_only(self, asked: str, sizes: list, copy_bytes: int) -> bool:
        """Whether the layers that have quantized blocks hold them alone (--cpu-weights): where
        asked, or for "auto" where their copies of `copy_bytes` bytes a weight would take more
        than QUANTIZED_ONLY_SHARE of the machine's memory. Steps of more than a few tokens read
        the blocks more slowly than copies (scripts/bench_quantized.py --cpu-weights quantized
        copies): a small model keeps both; a large one, whose copies are what would not fit,
        keeps its blocks alone."""
        if asked != "auto":
            return asked == "quantized"
        copies, memory = sum(rows * cols for rows, cols in sizes) * copy_bytes, total_memory_bytes()
        only = copies > QUANTIZED_ONLY_SHARE * memory
        logger.info("--cpu-weights auto: %s (their copies would take %.2f GiB, this process may have %.1f GiB)",
                    "the quantized layers hold their blocks alone" if only else "the quantized layers keep copies too",
                    copies / 2**30, memory / 2**30)
        return only

    def _keep_quantized(self, weights: dict, half_copies: bool, only: bool = False) -> list[str]:
        """Give the linear layers their quantized `weights` (`half_copies`: the other steps read
        16-bit copies; `only`: every step reads the blocks, the layers keep nothing else); returns
        the layers that took them."""
        if half_copies and {w.kind for w in weights.values()} == {"q8_0"}:
            # Q8_0's blocks save half of bfloat16's bytes, not three quarters: a 1B-shaped W8A8
            # bfloat16 checkpoint decoded 1.41-1.47x bfloat16's speed from them at batch 1 and 1.29x
            # at 2, but 1.01x at 3 and 4, where the copies gave 1.08x and 0.97x (scripts/
            # bench_quantized.py --shape olmo2-1b --formats w8a8-int8 --cpu-weights quantized
            # copies, Zen 4, 2026-12-04; the 135M shape 1.43x at 2, 0.90x at 4)
            self.quant_max_tokens = min(self.quant_max_tokens, 2)
        # (larger steps' strips of dequantized rows take bfloat16 dot products where the packed GEMM does)
        gemvs = {kind: functools.partial(gemv, bf16=self.bf16_dot) for kind, gemv in self.c_kernels.quant_gemv.items()}
        kept = self.model.keep_quantized(weights, gemvs, self.quant_max_tokens, only)
        if kept:
            self.low_precision_max_tokens = max(self.low_precision_max_tokens,
                                                sys.maxsize if only else self.quant_max_tokens)
        total = sum(isinstance(m, Linear) for m in self.model.modules())
        origin = self.blocks_origin
        if only:
            alone = sum(isinstance(m, Linear) and m.only_quantized for m in self.model.modules())
            logger.info("every step reads the %s quantized blocks of %d of %d linear layers (those of %s "
                        "tensors; --cpu-weights), which keep no other copy", origin, alone, total,
                        ", ".join(kind.upper() for kind in BLOCKS))
        else:
            logger.info("steps of at most %d tokens read the %s quantized blocks of %d of %d linear layers "
                        "(those of %s tensors)", self.quant_max_tokens, origin, len(kept), total,
                        ", ".join(kind.upper() for kind in BLOCKS))
        return kept

    # -- sizing ------------------------------------------------------------------

    def _choose_kv_dtype(self, asked: str, low_precision: Optional[torch.dtype]) -> torch.dtype:
        """The KV cache's dtype for --kv-cache-dtype `asked`: the compute dtype, except where the
        C kernels compute a 16-bit checkpoint in float32 ("auto" then takes float16: half the
        bytes that the decode attention of a long context is bound by, like llama.cpp's default)."""
        if asked == "auto":
            return torch.float16 if self.c_kernels is not None and low_precision is not None else self.dtype
        dtype = getattr(torch, asked)
        if dtype != self.dtype and self.c_kernels is None:
            raise ValueError(f"kv_cache_dtype {asked} differs from the {str(self.dtype).removeprefix('torch.')} "
                             f"the model computes in, which only the CPU's C kernels (torch backend) can read")
        return dtype

    def kv_bytes_per_block(self) -> int:
        return 2 * self.model.arch.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.kv_dtype.itemsize

    def _determine_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            num_blocks = cache.num_gpu_blocks_override
        elif self.device.type == "cuda":
            num_blocks = self._gpu_budget_bytes() // self.kv_bytes_per_block()
        else:
            num_blocks = cache.kv_cache_bytes() // self.kv_bytes_per_block()
        max_len = self.config.model.max_model_len
        if num_blocks * self.block_size < max_len and self.config.model.max_model_len_derived and num_blocks:
            # the model's own context, which no one asked for, does not fit: serve what does
            more = ("more blocks with --num-gpu-blocks-override" if cache.num_gpu_blocks_override is not None
                    else "more memory with --kv-cache-memory / --gpu-memory-utilization")
            logger.warning("the model's context of %d tokens does not fit the KV cache of %d tokens: serving "
                           "max_model_len %d (give the cache %s, or set --max-model-len)", max_len,
                           num_blocks * self.block_size, num_blocks * self.block_size, more)
            self.config.model.max_model_len = max_len = num_blocks * self.block_size
        if num_blocks * self.block_size < max_len:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks ({num_blocks * self.block_size} tokens), "
                f"fewer than one sequence of max_model_len ({max_len}) tokens: give the cache more "
                "memory (kv_cache_memory / gpu_memory_utilization) or lower max_model_len")
        return num_blocks

    def _gpu_budget_bytes(self) -> int:
        """GPU memory left for KV after the weights, the peak of the largest step (measured by
        running it) and, with CUDA graphs, as much again for the graphs' memory pool."""
        peak = self._profile_peak_bytes()
        free, total = torch.cuda.mem_get_info(self.device)
        reserve = peak * (2 if self.config.device.use_cuda_graphs else 1)
        budget = int(total * self.config.cache.gpu_memory_utilization) - (total - free) - reserve
        logger.info("GPU memory: %.2f GiB in use after loading, step peak %.2f GiB, KV budget %.2f GiB",
                    (total - free) / 2 ** 30, peak / 2 ** 30, max(0, budget) / 2 ** 30)
        return max(0, budget)

    @torch.inference_mode()
    def _profile_peak_bytes(self) -> int:
        """Run the largest step the scheduler may send (max_num_batched_tokens prompt tokens in
        sequences of at most max_model_len, then logits and sampling for max_num_seqs rows, and
        their guesses' rows with speculative decoding)
        against a scratch KV cache; return the memory it took at its peak."""
        sched, bs = self.config.scheduler, self.block_size
        tokens, max_len = sched.max_num_batched_tokens, self.config.model.max_model_len
        lens = [max_len] * (tokens // max_len) + ([tokens % max_len] if tokens % max_len else [])
        # Sequence i holds the consecutive blocks first[i], first[i] + 1, ...
        num_blocks = [-(-n // bs) for n in lens]
        first = np.cumsum([0] + num_blocks)
        tables = np.zeros((len(lens), max(num_blocks)), dtype=np.int64)
        for i, nb in enumerate(num_blocks):
            tables[i, :nb] = np.arange(first[i], first[i] + nb)
        shape = (2, int(first[-1]), bs, self.num_kv_heads, self.head_dim)
        scratch = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in self.model.layers]
        positions = np.concatenate([np.arange(n) for n in lens])
        slots = self.to_device(np.repeat(first[:-1] * bs, lens) + positions)
        ids = torch.zeros(tokens, dtype=torch.int64, device=self.device)
        meta = self._attention_metadata(slots, tables, np.array(lens), 0, 0, [(n, 0) for n in lens])
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        hidden = self.model(ids, self.to_device(positions), self._attention(meta, scratch))
        # a row per sequence, or with speculative decoding one per guess too
        guesses = 0 if sched.speculative is None else sched.speculative.num_speculative_tokens
        rows = min(sched.max_num_seqs * (1 + guesses), tokens)
        logits = self.model.compute_logits(hidden[:rows])
        torch.softmax(logits.float(), -1).argmax(-1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del scratch, hidden, logits
        torch.cuda.empty_cache()
        return peak

    def _zeros(self, shape: tuple[int, ...], first_blocks: int) -> torch.Tensor:
        """A zeroed KV tensor (of kv_dtype). On the CPU it comes from an anonymous mapping
        (cpu_kernels.huge_pages), so the OS hands out zero pages as they are first touched: a
        large cache costs nothing at start-up and holds only as much RAM as it has used. (Zeros
        matter: a masked slot must not hold NaN.) Its `first_blocks` blocks are written now: the
        OS zero-fills a page at its first write (2 MB at once on huge pages), which on the
        default model's 60 caches (2026-12-01, 4.3 GB in all) cost the first request's first
        step ~130 ms."""
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        kv = cpu_kernels.huge_pages(math.prod(shape) * self.kv_dtype.itemsize).view(self.kv_dtype).view(shape)
        kv[:, :first_blocks].zero_()
        return kv

    # -- one step ----------------------------------------------------------------

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.collect(self.launch(so))

    def launch(self, so: SchedulerOutput) -> LaunchedStep:
        """Queue the step's work on the device, up to its sampled tokens (read back by collect)."""
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return LaunchedStep([])
        input_ids, positions, meta, logits_indices, samplers, prompt_rows, lora, carry = self._prepare_inputs(so)
        with torch.inference_mode():
            if isinstance(meta, CStepInputs):  # (with the step's LoRA adapters, where it has any)
                hidden = self.c_step(input_ids, meta.slot_mapping, meta.query_start_loc, meta.block_tables,
                                     meta.seq_lens, lora)
            elif lora is not None:  # op by op, the adapters added to their rows (never a graph)
                hidden = self.model(input_ids, positions, self._attention(meta, self.kv_caches),
                                    self._reads_copies(len(input_ids)), lora)
            elif isinstance(meta, GraphDecodeInputs):  # a pure-decode step: a captured graph
                hidden = self.graphs.replay(input_ids, positions, *meta, carry)
            else:
                hidden = self.model(input_ids, positions, self._attention(meta, self.kv_caches),
                                    self._reads_copies(len(input_ids)))
            prompt_logprobs = self._prompt_logprobs(hidden, prompt_rows) if prompt_rows else None
            if not samplers:
                return LaunchedStep([], prompt_logprobs=prompt_logprobs)
            # the head by the rows sampled: a long prefill chunk still samples one row
            rows = hidden if logits_indices is None else hidden[logits_indices]
            logits = self.model.compute_logits(rows, self._reads_copies(len(rows)))
            embeddings = self._embeddings(rows, logits, samplers) if self.num_embedding_requests else None
            masks = so.allowed_token_masks
            tokens, logprobs = self.sampler.sample(logits, samplers, _row_masks(samplers, masks) if masks else None)
        step = LaunchedStep(samplers, tokens, logprobs, prompt_logprobs, embeddings, so.scheduled_spec_decode_tokens)
        if self.config.scheduler.runs_ahead:
            step.read_ahead()
            self.in_flight = step
        return step

    def collect(self, step: LaunchedStep) -> ModelRunnerOutput:
        """A launched step's output, its tokens read back (and appended to its requests)."""
        if self.in_flight is step:
            self.in_flight = None
        samplers = step.samplers
        if not samplers:
            return ModelRunnerOutput([], [], prompt_logprobs=step.prompt_logprobs)
        tokens, logprobs = step.token_list(), step.logprobs
        if step.spec:
            output = self._kept_guesses(samplers, tokens, logprobs, step.spec)
            output.prompt_logprobs, output.embeddings = step.prompt_logprobs, step.embeddings
            return output
        for state, token in zip(samplers, tokens):
            state.token_ids.append(token)
        return ModelRunnerOutput([s.req_id for s in samplers], [[t] for t in tokens],
                                 None if logprobs is None else [None if lp is None else [lp] for lp in logprobs],
                                 step.prompt_logprobs, step.embeddings)

    def abandon(self) -> None:
        """Forget the step in flight (async scheduling), whose requests failed: none reads its tokens."""
        self.in_flight = None

    @staticmethod
    def _kept_guesses(rows: list, tokens: list[int], logprobs: Optional[list], spec: dict[str, list[int]]
                      ) -> ModelRunnerOutput:
        """The step's output where some requests checked guesses (their rows follow each other,
        the first being the request itself): each keeps its guesses up to the first that differs
        from its row's sampled token, and then that token; the rest sample one token each. (A
        row's token is drawn from the distribution after the guesses before it; keeping it only
        while the guesses agree draws each kept token from the distribution that sampling it
        alone would have, so speculation changes no output's distribution.)"""
        req_ids, sampled, lps = [], [], None if logprobs is None else []
        i = 0
        while i < len(rows):
            state = rows[i]
            drafts = spec.get(state.req_id)
            n = 1
            if drafts is not None:
                while n <= len(drafts) and tokens[i + n - 1] == drafts[n - 1]:
                    n += 1
            kept = tokens[i:i + n]
            state.token_ids += kept
            req_ids.append(state.req_id)
            sampled.append(kept)
            if lps is not None:
                lps.append(None if logprobs[i] is None else logprobs[i:i + n])
            i += 1 if drafts is None else len(drafts) + 1
        return ModelRunnerOutput(req_ids, sampled, lps)

    def _embeddings(self, rows: torch.Tensor, logits: torch.Tensor, samplers: list[RequestState]
                    ) -> dict[str, list[float]]:
        """The sampled rows of requests with SamplingParams.embed (a prompt's last token: the
        first row such a request samples), L2-normalised; or where the request names
        pool_token_ids, its logits at those IDs (read before the sampler touches them)."""
        which = [j for j, s in enumerate(samplers) if s.params.embed]
        if not which:
            return {}
        pooled = {samplers[j].req_id: logits[j, samplers[j].params.pool_token_ids].float().tolist()
                  for j in which if samplers[j].params.pool_token_ids}
        which = [j for j in which if not samplers[j].params.pool_token_ids]
        if which:
            vectors = torch.nn.functional.normalize(rows[which].float(), dim=-1).cpu()
            pooled.update((samplers[j].req_id, vector.tolist()) for j, vector in zip(which, vectors))
        return pooled

    def _prompt_logprobs(self, hidden: torch.Tensor, prompt_rows: list) -> dict[str, tuple[int, list]]:
        """req_id -> (first position, the TokenLogprobs of the prompt tokens those positions
        predict), from the head over just those rows."""
        rows, targets = self.to_device(np.array([r[0] for r in prompt_rows], dtype=np.int64)), \
            self.to_device(np.array([r[1] for r in prompt_rows], dtype=np.int64))
        counts = [state.params.prompt_logprobs for _, _, state, _ in prompt_rows]
        entries = []
        for start in range(0, len(prompt_rows), PROMPT_LOGPROBS_ROWS):  # [rows, vocab] float32 a slice at a time
            part = slice(start, start + PROMPT_LOGPROBS_ROWS)
            logits = self.model.compute_logits(hidden[rows[part]], self._reads_copies(len(counts[part]))).float()
            entries += self.sampler.logprobs(logits, targets[part], counts[part])
        result: dict[str, tuple[int, list]] = {}
        for (_, _, state, position), entry in zip(prompt_rows, entries):
            result.setdefault(state.req_id, (position, []))[1].append(entry)
        return result

    def _reads_copies(self, rows: int) -> bool:
        """Whether GEMMs over this many rows read the weights' copies (packed, or half-size), or a
        GGUF model's blocks (each Linear takes those up to its quant_max_rows)."""
        return rows <= self.low_precision_max_tokens

    def forget(self, finished_req_ids) -> None:
        """Drop what is kept of requests that finished (or were aborted)."""
        for req_id in finished_req_ids:
            self._forget(req_id)

    def _update_states(self, so: SchedulerOutput) -> None:
        self.forget(so.finished_req_ids)
        for req_id in so.preempted_req_ids:
            self._forget(req_id)
        for req_id, num_blocks in so.trimmed_block_counts.items():
            state = self.requests.get(req_id)
            if state is not None:
                self.block_table.truncate(state.row, num_blocks)
        for new in so.scheduled_new_reqs:
            # a seeded request's generator, seeded afresh for each token it samples (sampler.py):
            # nothing of it outlives the request's state, a preemption included
            generator = None if new.sampling_params.seed is None else torch.Generator(device=self.device)
            self.requests[new.req_id] = RequestState(new, generator, self.block_table.add(new.block_ids))
            self.num_embedding_requests += new.sampling_params.embed
            self.num_lora_requests += new.lora is not None
        cached = so.scheduled_cached_reqs
        for req_id, block_ids, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                                   cached.num_computed_tokens):
            state = self.requests[req_id]
            if block_ids:
                self.block_table.append(state.row, block_ids)
            state.num_computed_tokens = num_computed

    def _forget(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self.block_table.remove(state.row)
            self.num_embedding_requests -= state.params.embed
            self.num_lora_requests -= state.lora is not None

    def _prepare_inputs(self, so: SchedulerOutput):
        self.to_device.begin_step()
        bs, table = self.block_size, self.block_table.table
        decodes: list[RequestState] = []
        prefills: list[tuple[RequestState, int]] = []
        for req_id, n in so.num_scheduled_tokens.items():
            state = self.requests[req_id]
            if n == 1:
                decodes.append(state)
            else:
                prefills.append((state, n))
        lora = None  # the rows' LoRA adapters, where a request has one
        if self.num_lora_requests:
            lora = LoRAStep.for_rows([(s.lora, 1) for s in decodes] + [(s.lora, n) for s, n in prefills], self.device)

        # Decodes first: arrays over their rows of the persistent block table.
        nd = len(decodes)
        computed = [s.num_computed_tokens for s in decodes]
        pos = np.array(computed, dtype=np.int64)
        blocks, offsets = np.divmod(pos, bs)
        carry = None  # (async scheduling) the tokens, in flight, that decode rows read
        if self.in_flight is None:
            ids = [np.array([s.token_ids[p] for s, p in zip(decodes, computed)], dtype=np.int64)]
        else:
            ids, carry = self._carried_ids(decodes, computed, self.in_flight)
        positions, seq_lens, rows = [pos], [pos + 1], [s.row for s in decodes]
        slots = [table[rows, blocks] * bs + offsets]
        max_decode_len = max(computed, default=0) + 1
        # A decode row samples unless it reads a prompt token alone (a chunk of one); one that
        # reads a token in flight has it yet to come (p = len(token_ids)).
        logits_indices = [i for i, (s, p) in enumerate(zip(decodes, computed)) if p + 1 >= len(s.token_ids)]
        samplers = decodes if len(logits_indices) == nd else [decodes[i] for i in logits_indices]
        # Rows whose logits score the next prompt token, for requests that ask for prompt logprobs:
        # (row, that token, request, position)
        prompt_rows: list[tuple[int, int, RequestState, int]] = []
        if len(logits_indices) != nd:  # some decode rows read a prompt token alone
            prompt_rows += [(i, s.token_ids[p + 1], s, p) for i, (s, p) in enumerate(zip(decodes, computed))
                            if s.params.prompt_logprobs is not None and p + 1 < s.num_prompt_tokens]

        if not prefills and lora is None and self._replays(nd):  # host arrays for the graph's buffers
            meta = GraphDecodeInputs(slots[0], seq_lens[0].astype(np.int32),
                                     table[rows, :-(-max_decode_len // bs)].astype(np.int32))
            every_row = len(logits_indices) == nd
            return (ids[0], pos, meta, None if every_row else self.to_device(np.array(logits_indices, dtype=np.int64)),
                    samplers, prompt_rows, None, carry)

        chunks: list[tuple[int, int]] = []  # (rows, context before)
        start = nd
        spec = so.scheduled_spec_decode_tokens
        for state, n in prefills:
            ctx = state.num_computed_tokens
            p = np.arange(ctx, ctx + n, dtype=np.int64)
            drafts = spec.get(state.req_id) if spec else None
            if drafts is not None:  # its last token, then its guesses: every row samples
                ids.append(np.array([state.token_ids[ctx], *drafts], dtype=np.int64))
                logits_indices.extend(range(start, start + n))
                samplers += _draft_rows(state, drafts)
            else:
                ids.append(np.asarray(state.token_ids[ctx:ctx + n], dtype=np.int64))
            positions.append(p)
            slots.append(table[state.row, p // bs] * bs + p % bs)
            seq_lens.append(np.array([ctx + n]))
            rows.append(state.row)
            chunks.append((n, ctx))
            if state.params.prompt_logprobs is not None:
                prompt_rows += [(start + q - ctx, state.token_ids[q + 1], state, q)
                                for q in range(ctx, min(ctx + n, state.num_prompt_tokens - 1))]
            if drafts is None and ctx + n == len(state.token_ids):
                logits_indices.append(start + n - 1)
                samplers.append(state)
            start += n

        max_len = max([max_decode_len] + [ctx + n for n, ctx in chunks])
        width = -(-max_len // bs)
        positions = _cat(positions)
        if self.c_step is not None and start <= C_STEP_MAX_TOKENS:
            meta = CStepInputs(self.to_device(_cat(slots)), self.to_device(query_start_loc(nd, chunks)),
                               self.to_device(table[rows, :width]), self.to_device(_cat(seq_lens)))
        else:
            meta = self._attention_metadata(self.to_device(_cat(slots)), table[rows, :width], _cat(seq_lens), nd,
                                            max_decode_len, chunks)
        input_ids = self.to_device(_cat(ids))
        if carry is not None:
            carry(input_ids)
        return (input_ids, self.to_device(positions), meta,
                self.to_device(np.array(logits_indices, dtype=np.int64)), samplers, prompt_rows, lora, None)

    def _carried_ids(self, decodes: list[RequestState], computed: list[int], flight: LaunchedStep
                     ) -> tuple[list[np.ndarray], Optional[Callable[[torch.Tensor], None]]]:
        """The decodes' token IDs (async scheduling), 0 in the rows whose token the step in flight
        samples, and what writes those into the IDs on the device: one copy where those rows lead
        in the same order as in that step (a steady batch), else a gather by row."""
        ids, dst, src = [], [], []
        where = flight.rows
        for i, (s, p) in enumerate(zip(decodes, computed)):
            if p < len(s.token_ids):
                ids.append(s.token_ids[p])
            else:
                ids.append(0)
                dst.append(i)
                src.append(where[s.req_id])
        ids = [np.array(ids, dtype=np.int64)]
        if not dst:
            return ids, None
        tokens, n = flight.tokens, len(dst)
        if dst[-1] == n - 1 and dst == src:  # rows 0..n-1 from rows 0..n-1
            return ids, lambda input_ids: input_ids[:n].copy_(tokens[:n])
        dst_rows, src_rows = self.to_device(np.array(dst, dtype=np.int64)), self.to_device(np.array(src, dtype=np.int64))
        return ids, lambda input_ids: input_ids.index_copy_(0, dst_rows, tokens.index_select(0, src_rows))

    def _replays(self, num_decodes: int) -> bool:
        """Whether a step of num_decodes decodes alone is one a captured graph (or, on the CPU,
        its buffers) serves; the C step comes first where there is one."""
        return self.graphs is not None and self.c_step is None and num_decodes <= self.graphs.max_batch

    # -- attention metadata, per backend -------------------------------------------

    def _attention(self, meta, kv_caches: list[torch.Tensor]):
        arch = self.model.arch
        if self.triton:
            return TritonPagedAttention(kv_caches, meta, self.num_heads, self.num_kv_heads, self.head_dim,
                                        self.workspace, arch.scale, arch.layer_windows, arch.attn_softcap)
        return TorchPagedAttention(kv_caches, meta, self.num_heads, self.num_kv_heads, self.head_dim,
                                   self.c_kernels, self.bf16_dot, arch.scale, arch.layer_windows, arch.attn_softcap)

    def _attention_metadata(self, slot_mapping: torch.Tensor, tables: np.ndarray, seq_lens: np.ndarray,
                            nd: int, max_decode_len: int, chunks: list[tuple[int, int]]):
        """The step's sequences, decodes first, as the backend's metadata: their block tables
        ([B, blocks of the longest], int64, 0 past a sequence's blocks), their lengths after
        this step; of the first nd (the decodes) the longest; then each prefill chunk's rows
        and the context before it."""
        bs, loc = self.block_size, query_start_loc(nd, chunks)
        if self.triton:
            from streamserve_kernels.attention import choose_num_splits

            num_splits = choose_num_splits(max_decode_len, nd, self.num_kv_heads, MAX_DECODE_SPLITS) if nd else 1
            return TritonAttentionMetadata(
                slot_mapping=slot_mapping, query_start_loc=self.to_device(loc.astype(np.int32)),
                seq_lens=self.to_device(seq_lens.astype(np.int32)), block_tables=self.to_device(tables.astype(np.int32)),
                num_decodes=nd, max_query_len=max([1] + [n for n, _ in chunks]), num_splits=num_splits)
        meta = AttentionMetadata(slot_mapping=slot_mapping, num_decodes=nd,
                                 decode_block_tables=None, decode_mask=None, prefills=[])
        if chunks and self.cpu_attention:  # the C kernel takes every chunk at once
            meta.prefill_query_start_loc = self.to_device(loc[nd:] - nd)
            meta.prefill_block_tables = self.to_device(np.ascontiguousarray(tables[nd:]))
            meta.prefill_seq_lens = self.to_device(seq_lens[nd:])
        else:
            for i, (n, ctx) in enumerate(chunks):
                blocks = self.to_device(tables[nd + i, :-(-(ctx + n) // bs)])
                meta.prefills.append(PrefillChunk(int(loc[nd + i]), int(loc[nd + i + 1]), ctx, blocks))
        if nd:  # the decodes' tables, as wide as the longest needs
            max_blocks = -(-max_decode_len // bs)
            meta.decode_block_tables = self.to_device(np.ascontiguousarray(tables[:nd, :max_blocks]))
            if self.cpu_attention:  # the C kernel stops at each length itself
                meta.decode_seq_lens = self.to_device(seq_lens[:nd])
            else:
                meta.decode_mask, meta.decode_window_masks = self._decode_masks(seq_lens[:nd], max_blocks)
        return meta

    # -- CUDA graphs -----------------------------------------------------------------

    def make_decode_graphs(self) -> DecodeGraphs:
        """Static buffers and (on CUDA) graphs for pure-decode steps, see cuda_graphs.py."""
        from streamserve_kernels.attention import choose_num_splits

        max_len = self.config.model.max_model_len
        max_blocks_per_seq = -(-max_len // self.block_size)

        def forward(input_ids, positions, meta):
            return self.model(input_ids, positions, self._attention(meta, self.kv_caches))

        return DecodeGraphs(forward, capture_sizes(self.config.scheduler.max_num_seqs), max_blocks_per_seq,
                            lambda b: choose_num_splits(max_len, b, self.num_kv_heads, MAX_DECODE_SPLITS),
                            self.device, self.to_device)

    def _decode_masks(self, seq_lens: np.ndarray, max_blocks: int
                      ) -> tuple[Optional[torch.Tensor], dict[int, Optional[torch.Tensor]]]:
        """Additive masks hiding the slots past each decode's length: for the layers without a
        window, and per sliding window of the model's (those before its last `window` slots
        too); None where no row has such slots. The lengths go to the device once."""
        width = max_blocks * self.block_size
        lens = slots = None

        def mask(window: int) -> Optional[torch.Tensor]:
            nonlocal lens, slots
            if (seq_lens == width).all() and (not window or (seq_lens <= window).all()):
                return None
            if lens is None:
                lens, slots = self.to_device(seq_lens)[:, None], torch.arange(width, device=self.device)
            visible = slots < lens
            if window:
                visible &= slots >= lens - window
            out = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
            out.masked_fill_(~visible, float("-inf"))
            return out.view(len(seq_lens), 1, 1, -1)

        return mask(0), {w: mask(w) for w in self.windows}


def _weight_key(linear: Linear) -> tuple:
    """What the one-row choices are made once for: the weight's shape and dtype, and whether
    the layer has a bias."""
    return tuple(linear.weight.shape), linear.weight.dtype, linear.bias is not None


def _row_masks(rows: list, masks: dict[str, np.ndarray]) -> list[Optional[np.ndarray]]:
    """Each sampler row's structured-output mask: its request's, or where the request checks
    guesses (a [rows, vocab] mask) the one for its place among them."""
    taken: dict[str, int] = {}
    out = []
    for row in rows:
        mask = masks.get(row.req_id)
        if mask is not None and mask.ndim == 2:
            j = taken.get(row.req_id, 0)
            taken[row.req_id] = j + 1
            mask = mask[j]
        out.append(mask)
    return out


def _draft_rows(state: RequestState, drafts: list[int]) -> list:
    """The sampler's rows for a request checking guesses: the request itself at every row,
    unless its penalties or bad words read its tokens, its min_tokens counts them, or its seed
    draws by position (then each row after the first sees the guesses before it as sampled)."""
    params = state.params
    if (params.has_penalties or params.bad_words_token_ids or params.seed is not None
            or params.min_tokens > len(state.token_ids) - state.num_prompt_tokens):
        return [state] + [DraftRow(state, drafts[:j]) for j in range(1, len(drafts) + 1)]
    return [state] * (len(drafts) + 1)


def query_start_loc(nd: int, chunks: list[tuple[int, int]]) -> np.ndarray:
    """Where each sequence's rows start in the flat batch, and the end (int64 [S + 1]): nd
    decodes of one row, then the prefill chunks of (rows, context before)."""
    loc = np.arange(nd + 1 + len(chunks), dtype=np.int64)
    if chunks:
        loc[nd + 1:] = nd + np.cumsum([n for n, _ in chunks])
    return loc


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)
