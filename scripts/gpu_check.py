"""The device check for the GPU path: one call on a CUDA machine, under 8 minutes.

    python scripts/gpu_check.py                 # writes gpu-check.md / .json under $OUT (or --out)
    TRITON_INTERPRET=1 python scripts/gpu_check.py --smoke --device cpu   # the script itself, tiny sizes

Needs only torch, triton and transformers (no orjson, gguf or pytest): run from a checkout
with PYTHONPATH=. when streamserve is not installed. Sections, each failing on its own, cheapest first; the table is rewritten under --out after
every row (a run killed at its time limit keeps all it measured); none starts after --budget
seconds, and the decode section's engines and batch sizes stop DECODE_RESERVE seconds before --limit
(the caller's time limit):
  1. device-to-device copy bandwidth (bytes read + bytes written per second by a large copy);
  2. every kernel against its torch reference, float32 and bfloat16; the runner's pinned
     staging buffer;
  3. the paged decode attention kernel alone at batch 64, context 4096: bytes of K and V
     read per second against the copy bandwidth, at the engine's launch settings and a few
     others (warps, splits) to tune them by;
  4. greedy parity with transformers on a tiny random Llama (float32), with CUDA graphs
     and with enforce_eager, with n-gram speculative decoding (its steps of guesses run
     eagerly beside the graphs), and with every other prompt of a batch through a random LoRA
     adapter (against the model with it merged into its weights); then tiny Gemma 2, Gemma 3,
     SmolLM3, Granite, Phi-4-mini and OLMo 2 models (sliding windows, soft-capped scores, their own
     rotary, a layer without rotary, Granite's multipliers, a partial rotary, OLMo 2's norms) with
     graphs;
  5. decode throughput of a Llama-3.2-1B-shaped model (random weights, bfloat16) at
     batch 1, 8, 64, 256, graphs (first: the figures the targets need) then eager, each mode
     failing on its own (the tokens a timed step made, checked against the batch: every request
     outlives the steps that read the prompts and the timed ones); the KV cache the memory
     profile sized; at batch 1 the fraction of the bandwidth floor (weight bytes + KV bytes read
     per step) / step time / copy bandwidth, and the batch-1 graph's replay alone (the GPU's
     share of the step, the head not in it) against the floor of what it reads; batch 1 again in an
     engine whose kernels launch without programmatic dependent launch, against the one with it.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from typing import Optional

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts"), os.path.join(ROOT, "tests"),
                os.path.join(ROOT, "tests", "kernels")]

LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096,
                tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5,
                rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
# seconds before --limit in which the decode section builds no engine and starts no batch size
# (the graphs engine's start-up, 35 graphs captured, or a batch of 256 with its 64 prefill steps)
DECODE_RESERVE = 90.0
TINY_SHAPE = dict(LLAMA_1B, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)


class Report:
    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.on_add = lambda: None  # main: rewrite the table under --out

    def add(self, section: str, item: str, value: str, target: str = "", ok=None) -> None:
        self.rows.append(dict(section=section, item=item, value=value, target=target,
                              ok=None if ok is None else bool(ok)))
        mark = "" if ok is None else ("PASS" if ok else "FAIL")
        print(f"[{section}] {item}: {value} {target} {mark}".rstrip(), flush=True)
        self.on_add()

    def markdown(self, header: list[str]) -> str:
        lines = header + ["", "| section | item | value | target | result |", "|---|---|---|---|---|"]
        for r in self.rows:
            result = "" if r["ok"] is None else ("pass" if r["ok"] else "**FAIL**")
            lines.append(f"| {r['section']} | {r['item']} | {r['value']} | {r['target']} | {result} |")
        return "\n".join(lines) + "\n"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, iters: int, warmup: int = 3) -> float:
    """Seconds per call."""
    for _ in range(warmup):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - start) / iters


# -- 1. copy bandwidth ------------------------------------------------------------------

def copy_bandwidth(report: Report, device: torch.device, smoke: bool) -> float:
    n = (16 if smoke else 2048) * 2 ** 20
    src, dst = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    src.fill_(1)
    seconds = timed(lambda: dst.copy_(src), device, iters=3 if smoke else 20)
    bandwidth = 2 * n / seconds
    report.add("bandwidth", f"copy of {n / 2 ** 20:.0f} MiB (read + write)", f"{bandwidth / 1e9:.0f} GB/s")
    return bandwidth


# -- 2. kernels against their references ------------------------------------------------

def kernel_checks(report: Report, device: torch.device, smoke: bool) -> None:
    from kernel_batches import TOLERANCE, make_paged_batch, randn, rel_err
    from streamserve.models.layers import RotaryEmbedding
    from streamserve_kernels import activation, attention, cache, gemv, norm, rotary

    dev = device.type
    gen = torch.Generator().manual_seed(0)
    heads_list = [(9, 3, 64), (32, 8, 64)] if not smoke else [(9, 3, 64)]
    for dtype in (torch.float32, torch.bfloat16):
        tol = TOLERANCE[dtype]
        name = str(dtype).replace("torch.", "")

        def check(item: str, err: float) -> None:
            report.add("kernels", f"{item} {name}", f"rel err {err:.1e}", f"< {tol:g}", err < tol)

        # every head layout plain; then the first with Gemma 2's sliding window and capped scores
        variants = [(h, 0, 0.0) for h in heads_list] + [(heads_list[0], 16, 50.0)]
        for block_size in (16, 32):
            for (hq, hkv, d), window, softcap in variants:
                extra = dict(window=window, softcap=softcap)
                what = f"bs{block_size} {hq}q/{hkv}kv" + (f" window {window} softcap {softcap:g}" if window else "")
                seqs = [(0, 1), (block_size - 1, 1), (5 * block_size + 3, 1), (0, 37), (block_size - 7, 20),
                        (3 * block_size, 5)]
                b = make_paged_batch(gen, seqs, hq, hkv, d, block_size, dtype, dev, num_padding=3)
                ref = attention.paged_attention_ref(b.q, b.kv_cache, b.query_start_loc, b.seq_lens,
                                                    b.block_tables, d ** -0.5, **extra)
                out = torch.full_like(b.q, float("nan"))
                attention.paged_attention(b.q, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_tables,
                                          d ** -0.5, b.max_query_len, out=out, **extra)
                n = b.num_real_tokens
                check(f"paged_attention mixed {what}", rel_err(out[:n], ref[:n]))
                # Split-KV decode over long contexts, through a workspace allocated once.
                ctx = [700, 33, 1200, 1] if not smoke else [70, 33, 1]
                d_batch = make_paged_batch(gen, [(c, 1) for c in ctx], hq, hkv, d, block_size, dtype, dev)
                ws = attention.DecodeWorkspace.allocate(8, hq, d, 16, device)
                out = torch.full_like(d_batch.q, float("nan"))
                attention.paged_decode_attention(d_batch.q, d_batch.kv_cache, d_batch.seq_lens,
                                                 d_batch.block_tables, d ** -0.5, 8, ws, out=out, **extra)
                ref = attention.paged_attention_ref(d_batch.q, d_batch.kv_cache, d_batch.query_start_loc,
                                                    d_batch.seq_lens, d_batch.block_tables, d ** -0.5, **extra)
                check(f"paged_decode_attention 8 splits {what}", rel_err(out, ref))
        # reshape_and_cache with padding slots
        b = make_paged_batch(gen, [(5, 20), (0, 3)], 4, 2, 64, 16, dtype, dev, num_padding=4, write_step_kv=False)
        expected = b.kv_cache.clone()
        cache.reshape_and_cache_ref(b.k, b.v, expected, b.slot_mapping)
        cache.reshape_and_cache(b.k, b.v, b.kv_cache, b.slot_mapping)
        same = torch.equal(torch.nan_to_num(b.kv_cache, 7.0), torch.nan_to_num(expected, 7.0))
        report.add("kernels", f"reshape_and_cache {name}", "identical" if same else "differs", "identical", same)
        # rotary and the cache write in one kernel: the same q and cache as the two kernels apart
        rope = RotaryEmbedding(64, 4096, 500000.0, LLAMA_1B["rope_scaling"])
        rope.build_cache(device, dtype)
        positions = torch.randint(0, 4096, (len(b.slot_mapping),), generator=gen).to(dev)
        q, kv_cache = randn(gen, len(b.slot_mapping), 4, 64, dtype=dtype, device=dev), b.kv_cache.clone()
        apart_q, apart_k, apart_cache = q.clone(), b.k.clone(), b.kv_cache.clone()
        rotary.rotary_embedding_and_cache(positions, q, b.k.clone(), b.v, rope.cos_sin_cache, kv_cache, b.slot_mapping)
        rotary.rotary_embedding(positions, apart_q, apart_k, rope.cos_sin_cache)
        cache.reshape_and_cache(apart_k, b.v, apart_cache, b.slot_mapping)
        same = torch.equal(q, apart_q) and torch.equal(torch.nan_to_num(kv_cache, 7.0), torch.nan_to_num(apart_cache, 7.0))
        report.add("kernels", f"rotary_embedding_and_cache (padding slots) {name}", "identical to the two apart"
                   if same else "differs", "identical", same)
        # norms, rotary, activation
        x, res = randn(gen, 33, 2048, dtype=dtype, device=dev), randn(gen, 33, 2048, dtype=dtype, device=dev)
        w = randn(gen, 2048, dtype=dtype, device=dev)
        ref_out, ref_res = norm.rms_norm_ref(x, w, 1e-5, residual=res)
        out, new_res = norm.fused_add_rms_norm(x.clone(), res.clone(), w, 1e-5)
        check("fused_add_rms_norm", max(rel_err(out, ref_out), rel_err(new_res, ref_res)))
        check("rms_norm", rel_err(norm.rms_norm(x, w, 1e-5), norm.rms_norm_ref(x, w, 1e-5)))
        if dtype != torch.float32:  # Gemma's norms: a float32 weight (1 + w), scaled in float32, rounded once
            wf = w.float()
            ref_out, ref_res = norm.rms_norm_ref(x, wf, 1e-5, residual=res)
            out, new_res = norm.fused_add_rms_norm(x.clone(), res.clone(), wf, 1e-5)
            check("fused_add_rms_norm, float32 weight", max(rel_err(out, ref_out), rel_err(new_res, ref_res)))
        positions = torch.randint(0, 4096, (33,), generator=gen).to(dev)
        q, k = randn(gen, 33, 32, 64, dtype=dtype, device=dev), randn(gen, 33, 8, 64, dtype=dtype, device=dev)
        ref_q, ref_k = (rotary.rotary_embedding_ref(positions, t, rope.cos_sin_cache) for t in (q, k))
        rotary.rotary_embedding(positions, q, k, rope.cos_sin_cache)
        # the kernel's rotation, given a Llama-3-scaled cache (the scaling itself: parity, tests/models)
        check("rotary_embedding (llama3-scaled cos/sin)", max(rel_err(q, ref_q), rel_err(k, ref_k)))
        gu = randn(gen, 33, 2 * 8192, dtype=dtype, device=dev)
        check("silu_and_mul", rel_err(activation.silu_and_mul(gu), activation.silu_and_mul_ref(gu)))
        # the batch-1 product at each launch setting the runner may choose, a shape with tails too
        # (and gated: a SiLU MLP's down projection, the activation read on the fly from gate_up)
        down = (256, 512) if smoke else (2048, 8192)
        for n, k, gated in ((3072, 2048, False), (1000, 300, False), (*down, True), (1000, 300, True)):
            x = randn(gen, 1, 2 * k if gated else k, dtype=dtype, device=dev)
            w, bias = randn(gen, n, k, dtype=dtype, device=dev), randn(gen, n, dtype=dtype, device=dev)
            ref = gemv.gemv_ref(x, w, bias, gated=gated)
            errs = [rel_err(gemv.gemv(x, w, bias, out=torch.full_like(ref, float("nan")), block_n=bn, block_k=bk,
                                      num_warps=warps, gated=gated), ref) for bn, bk, warps in gemv.CONFIGS]
            check(f"gemv{' gated' if gated else ''} [1, {2 * k if gated else k}] x [{n}, {k}]^T + bias, "
                  f"{len(errs)} settings", max(errs))
        # (and normed: a layer's RMSNorm, after the residual add, in the kernel of the product after it)
        for n, k, with_residual in ((3072, 2048, True), (1000, 300, False)):
            x, nw = randn(gen, 1, k, dtype=dtype, device=dev), randn(gen, k, dtype=dtype, device=dev)
            residual = randn(gen, 1, k, dtype=dtype, device=dev) if with_residual else None
            w, bias = randn(gen, n, k, dtype=dtype, device=dev), randn(gen, n, dtype=dtype, device=dev)
            ref, ref_total = gemv.normed_gemv_ref(x, residual, nw, 1e-5, w, bias)
            runs = [gemv.normed_gemv(x, residual, nw, 1e-5, w, bias, block_n=bn, block_k=bk, num_warps=warps)
                    for bn, bk, warps in gemv.CONFIGS]
            check(f"normed gemv [1, {k}]{' + residual' if with_residual else ''} x [{n}, {k}]^T + bias, "
                  f"{len(runs)} settings", max(max(rel_err(out, ref), rel_err(total, ref_total)) for out, total in runs))
    pdl_chain_check(report, device, smoke)
    staging_check(report, device)


def pdl_chain_check(report: Report, device: torch.device, smoke: bool) -> None:
    """A chain of kernels as a decode layer has them (the norm, two products, SiLU-and-mul, a
    gated product, back into the row it started from), eight times over in one CUDA graph,
    launched with programmatic dependent launch: the row it ends with, against the same kernels
    launched eagerly without it. Each kernel reads its predecessor's output as that finishes,
    so a read before the wait (streamserve_kernels/launch.py) shows as a different row."""
    from streamserve_kernels import activation, gemv, launch, norm

    item = "programmatic dependent launch: a layer's chain of kernels x 8 in a CUDA graph"
    if not launch.pdl(device):
        report.add("kernels", item, "PDL is not used here")
        return
    h, i = (256, 512) if smoke else (2048, 8192)
    gen = torch.Generator().manual_seed(1)
    w_in, w_up = (torch.randn(n, k, generator=gen).div(k ** 0.5).to(device, torch.bfloat16)
                  for n, k in ((h, h), (2 * i, h)))
    w_down = torch.randn(h, i, generator=gen).div(i ** 0.5).to(device, torch.bfloat16)
    nw = torch.ones(h, dtype=torch.bfloat16, device=device)
    start = torch.randn(1, h, generator=gen).to(device, torch.bfloat16)
    row, normed, mid, up, act = (torch.empty(1, n, dtype=torch.bfloat16, device=device) for n in (h, h, h, 2 * i, i))

    def chain() -> None:
        for _ in range(8):
            norm.rms_norm(row, nw, 1e-5, out=normed)
            gemv.gemv(normed, w_in, out=mid)
            gemv.gemv(mid, w_up, out=up)
            activation.silu_and_mul(up, out=act)
            gemv.gemv(act, w_down, out=mid)
            gemv.gemv(up, w_down, out=row, gated=True)
            row.add_(mid)

    with launch.disabled():
        row.copy_(start)
        chain()
        expected = row.clone()
    row.copy_(start)
    chain()  # compiles the PDL variants, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    same = True
    for _ in range(20):
        row.copy_(start)
        graph.replay()
        same &= bool(torch.equal(row, expected))
    report.add("kernels", item, "identical" if same else "different", "identical", same)


def staging_check(report: Report, device: torch.device) -> None:
    """The runner's pinned staging buffer: every array arrives intact, also when the buffer
    wraps around within a step and when an array is larger than the whole buffer. The GPU
    is kept busy before each step's copies, so they wait in the stream while the next step
    writes the buffer: without the guard on reuse, the early arrays would arrive changed."""
    import numpy as np

    from streamserve.worker.staging import HostStaging

    staging = HostStaging(device, capacity=4096)
    sizes = [(100, np.int64), (37, np.int32), (300, np.int64), (2000, np.int32), (200, np.int64)]
    sent, arrived = [], []
    for step in range(4):
        staging.begin_step()
        if device.type == "cuda":
            torch.cuda._sleep(20_000_000)  # about 10 ms of GPU time ahead of the copies
        arrays = [np.arange(step, step + n, dtype=dt) * (i + 1) for i, (n, dt) in enumerate(sizes)]
        sent += arrays
        arrived += [staging(a) for a in arrays]
    same = all(o.dtype == torch.from_numpy(a).dtype and np.array_equal(o.cpu().numpy(), a)
               for o, a in zip(arrived, sent))
    report.add("kernels", "host staging (pinned, non-blocking, wrapping)", "intact" if same else "corrupted",
               "intact", same)


# -- 4. greedy parity with transformers --------------------------------------------------

# transformers' own attention code, the reference for every architecture: on CUDA, transformers
# 5.17 picks sdpa for Gemma 2, which drops its soft-capped scores (2 of 4 prompts differed from
# eager there on 2026-12-04, where the engine matched eager on all 4; 5.25 refuses sdpa for it)
REFERENCE = dict(attn_implementation="eager")
PARITY_PROMPTS = [[3 + (i * 7 + j * 13) % 300 for j in range(n)] for i, n in enumerate((5, 40, 17, 90))]


def hf_greedy(model_dir: str, device: torch.device, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens for each prompt, float32 on `device`."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **REFERENCE).to(device).eval()
    hf.generation_config.eos_token_id = None
    expected = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        with torch.no_grad():
            seq = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0)
        expected.append(seq[0, len(p):].tolist())
    del hf
    free_memory()
    return expected


def parity(report: Report, device: torch.device, work: str, smoke: bool) -> None:
    from tiny_models import build_model

    model_dir = build_model(os.path.join(work, "tiny-llama"), "llama", seed=0)
    prompts = PARITY_PROMPTS
    new_tokens = 8 if smoke else 24
    expected = hf_greedy(model_dir, device, prompts, new_tokens)
    for eager, speculative in ((False, None), (True, None), (False, SPECULATIVE)):
        name = "eager" if eager else "graphs" + (", speculative decoding" if speculative else "")
        try:  # a failure of the graphs engine keeps the eager check
            outs, replays, (checked, kept) = greedy_run(model_dir, device, eager, prompts, new_tokens, speculative)
        except Exception as exc:
            traceback.print_exc()
            report.add("parity", f"tiny Llama float32, {name}: failed",
                       f"{type(exc).__name__}: {str(exc)[:300]}", ok=False)
            continue
        finally:
            free_memory()  # greedy_run's engine is gone with its frame
        same = sum(o == e for o, e in zip(outs, expected))
        mode = name if eager else f"{name} ({replays}" + (
            f"; {kept} of {checked} guesses kept)" if speculative else ")")
        report.add("parity", f"tiny Llama float32, {mode}", f"{same}/{len(prompts)} prompts identical",
                   "all identical", same == len(prompts) and (not speculative or checked > 0))


def kin_parity(report: Report, device: torch.device, work: str, smoke: bool) -> None:
    """Llama's kin on the graphs engine: tiny Gemma 2 (every other layer windowed to 16 keys,
    soft-capped scores and logits), Gemma 3 (windows with their own rotary base, q/k norms,
    sandwich norms), SmolLM3 (a layer without rotary), Granite (its multipliers), Phi-4-mini
    (a rotary over part of each head), OLMo 2 (norms after attention and the MLP, q and k
    normed over all heads) and OLMo 3 (OLMo 2's layers windowed, the full ones alone scaled), on
    prompts longer than the window: transformers' greedy tokens; then
    quantized checkpoints (quantized_parity)."""
    from tiny_models import build_model

    new_tokens = 8 if smoke else 24
    for arch, what in (("gemma2", "windows of 16, capped scores"), ("gemma3", "windows of 16, own rotary"),
                       ("smollm3", "a layer without rotary"), ("granite", "scaled residuals and logits"),
                       ("phi4", "a rotary over 3/4 of each head"), ("olmo2", "norms after, q/k normed whole"),
                       ("olmo3", "windows of 16, YaRN on full layers only")):
        model_dir = build_model(os.path.join(work, f"tiny-{arch}"), arch, seed=0)
        graphs_parity_row(report, device, f"tiny {arch} float32 ({what})", model_dir, model_dir, new_tokens)
    quantized_parity(report, device, work, new_tokens)


def graphs_parity_row(report: Report, device: torch.device, label: str, model_dir: str, reference_dir: str,
                      new_tokens: int) -> None:
    """One parity row: `model_dir` on the graphs engine against transformers' greedy tokens on
    `reference_dir` (a failure of the engine is the row's value)."""
    expected = hf_greedy(reference_dir, device, PARITY_PROMPTS, new_tokens)
    try:
        outs, replays, _ = greedy_run(model_dir, device, False, PARITY_PROMPTS, new_tokens)
    except Exception as exc:
        traceback.print_exc()
        report.add("parity", f"{label}: failed", f"{type(exc).__name__}: {str(exc)[:300]}", ok=False)
        return
    finally:
        free_memory()
    same = sum(o == e for o, e in zip(outs, expected))
    report.add("parity", f"{label}, graphs ({replays})", f"{same}/{len(PARITY_PROMPTS)} prompts identical",
               "all identical", same == len(PARITY_PROMPTS))


def quantized_parity(report: Report, device: torch.device, work: str, new_tokens: int) -> None:
    """Quantized checkpoints of a tiny Qwen2 (AWQ 4-bit with zeros; GPTQ 4-bit act-order),
    dequantized as they load onto the device, on the graphs engine: transformers' greedy tokens
    on the dequantized weights."""
    import quantized_checkpoints as qc
    from tiny_models import build_model

    src = build_model(os.path.join(work, "tiny-qwen2"), "qwen2", seed=0)
    for fmt, write in (("AWQ 4-bit", lambda d: qc.write_awq(src, d)),
                       ("GPTQ 4-bit act-order", lambda d: qc.write_gptq(src, d, sym=False, desc_act=True))):
        path = os.path.join(work, "tiny-qwen2-" + fmt.split()[0].lower())
        reference = qc.reference_dir(src, path + "-reference", write(path))
        graphs_parity_row(report, device, f"tiny qwen2 {fmt} (dequantized at load)", path, reference, new_tokens)


def lora_parity(report: Report, device: torch.device, work: str, smoke: bool) -> None:
    """A batch of prompts, every other one through a random LoRA adapter, on the graphs engine
    (the adapter's steps run eagerly): each as transformers' greedy tokens on the model, or on
    the model with the adapter merged into its weights."""
    from transformers import AutoModelForCausalLM

    from lora_adapters import build_adapter, merge_adapter
    from streamserve import LLM, LoRARequest, SamplingParams
    from tiny_models import build_model

    model_dir = os.path.join(work, "tiny-llama")
    if not os.path.isdir(model_dir):
        build_model(model_dir, "llama", seed=0)
    adapter = build_adapter(os.path.join(work, "lora"), model_dir, rank=8, seed=1)
    merged = merge_adapter(model_dir, adapter, os.path.join(work, "lora-merged"))
    prompts = [[3 + (i * 11 + j * 5) % 300 for j in range(n)] for i, n in enumerate((7, 33, 12, 70))]
    new_tokens = 8 if smoke else 24
    expected = []
    for i, p in enumerate(prompts):
        hf = AutoModelForCausalLM.from_pretrained(merged if i % 2 else model_dir, dtype=torch.float32,
                                                  **REFERENCE).to(device).eval()
        ids = torch.tensor([p], device=device)
        with torch.no_grad():
            seq = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0, eos_token_id=None)
        expected.append(seq[0, len(p):].tolist())
        del hf
    llm = LLM(model_dir, device=str(device), dtype="float32", kernel_backend="triton", enable_lora=True,
              num_gpu_blocks_override=512, max_num_seqs=8)
    lora = LoRARequest("random", 1, adapter)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True), use_tqdm=False,
                        lora_request=[lora if i % 2 else None for i in range(len(prompts))])
    same = sum(o.outputs[0].token_ids == e for o, e in zip(outs, expected))
    report.add("parity", "tiny Llama float32, every other prompt through a LoRA adapter",
               f"{same}/{len(prompts)} prompts identical", "all identical", same == len(prompts))
    del llm


# n-gram speculative decoding for the parity row that checks it: steps of guesses run eagerly
# (each request's last token and guesses as a chunk), pure decodes replay the graphs
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}


def greedy_run(model_dir: str, device: torch.device, eager: bool, prompts: list[list[int]],
               new_tokens: int, speculative: Optional[dict] = None) -> tuple[list[list[int]], str, tuple[int, int]]:
    """(each prompt's greedy tokens, how many decode steps replayed a graph (and of those, how
    many read tokens in flight: async scheduling), (guesses checked, kept)) from a fresh engine
    with a fixed small cache (a share of the GPU would be millions of the tiny model's blocks)."""
    from streamserve import LLM, SamplingParams

    llm = LLM(model_dir, device=str(device), dtype="float32", enforce_eager=eager, speculative_config=speculative,
              kernel_backend="triton", num_gpu_blocks_override=512, max_num_seqs=8)  # 4 graphs, not 35
    graphs = llm.engine_core.model_runner.graphs
    replays = []
    if graphs is not None:
        original = graphs.replay
        graphs.replay = lambda ids, *rest: replays.append(rest[-1] is not None) or original(ids, *rest)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)
    scheduler = llm.engine_core.scheduler
    return ([o.outputs[0].token_ids for o in outs], f"{len(replays)} replays, {sum(replays)} reading tokens in flight",
            (scheduler.spec_num_draft_tokens, scheduler.spec_num_accepted_tokens))


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- 5. decode throughput ------------------------------------------------------------------

def write_model_dir(work: str, shape: dict) -> str:
    """config.json of the shape plus a tokenizer; the weights come from load_format=dummy."""
    from tiny_models import build_model

    tiny = build_model(os.path.join(work, "tok-source"), "llama", seed=1)
    path = os.path.join(work, "llama-shape")
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(tiny):
        if not name.endswith(".safetensors") and name != "config.json":
            shutil.copy(os.path.join(tiny, name), path)
    config = dict(shape, architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype="bfloat16",
                  bos_token_id=1, eos_token_id=2, hidden_act="silu")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def decode_steps(llm, batch: int, context: int, steps: int) -> tuple[float, float]:
    """(seconds a decode step takes, tokens a step made) with `batch` requests of `context`
    prompt tokens decoding. Each may generate up to the rest of max_model_len: reading the
    prompts takes many steps at large batches (256 x 512 tokens at 2048 a step: 64), in which
    the requests read first already decode, and none may finish before the timed steps end."""
    from bench_throughput import make_workload, start_decoding

    core, sched = llm.engine_core, llm.engine_core.scheduler
    room = llm.config.model.max_model_len - context
    start_decoding(llm, make_workload(batch, core.vocab_size, batch, context, context, room, room))
    for _ in range(3):
        core.step()  # warm
    made = 0
    start = time.perf_counter()
    for _ in range(steps):
        made += sum(len(o.new_token_ids) for o in core.step())  # .tolist() in the sampler: a sync a step
    seconds = (time.perf_counter() - start) / steps
    core.abort_requests([r.request_id for r in list(sched.running) + list(sched.waiting)])
    while core.has_unfinished_requests():
        core.step()
    return seconds, made / steps


def throughput(report: Report, device: torch.device, work: str, copy_bw: float, smoke: bool,
               deadline: float) -> None:
    """deadline: past it, no engine is built and no batch size starts."""
    shape = TINY_SHAPE if smoke else LLAMA_1B
    model_dir = write_model_dir(work, shape)
    batches = (1, 8) if smoke else (1, 8, 64, 256)
    context, steps = (32, 4) if smoke else (512, 32)
    step_time: dict[tuple[bool, int], float] = {}
    for eager in (False, True):  # graphs first: the batch-1 targets need only them
        mode = "eager" if eager else "graphs"
        if time.perf_counter() > deadline:
            report.add("decode", f"{mode}: skipped", "out of time", ok=False)
            continue
        try:  # a failure of one mode (graphs have never been captured here) keeps the other's figures
            decode_mode(report, device, model_dir, shape, eager, batches, context, steps, copy_bw, deadline,
                        step_time)
        except Exception as exc:
            traceback.print_exc()
            report.add("decode", f"{mode}: failed", f"{type(exc).__name__}: {str(exc)[:300]}", ok=False)
        free_memory()
        if not eager and (False, 1) in step_time and time.perf_counter() < deadline:
            try:
                without_pdl(report, device, model_dir, shape, context, steps, step_time)
            except Exception as exc:
                traceback.print_exc()
                report.add("decode", "without PDL: failed", f"{type(exc).__name__}: {str(exc)[:300]}", ok=False)
            free_memory()
    if (True, 1) in step_time and (False, 1) in step_time:
        speedup = step_time[True, 1] / step_time[False, 1]
        report.add("decode", "batch 1: graphs vs eager", f"{speedup:.2f}x", ">= 2x", speedup >= 2)
    for b in batches[1:]:
        if (True, b) in step_time and (False, b) in step_time:
            report.add("decode", f"batch {b}: graphs vs eager", f"{step_time[True, b] / step_time[False, b]:.2f}x")


def decode_mode(report: Report, device: torch.device, model_dir: str, shape: dict, eager: bool,
                batches: tuple[int, ...], context: int, steps: int, copy_bw: float, deadline: float,
                step_time: dict[tuple[bool, int], float]) -> None:
    """One engine (CUDA graphs, or enforce_eager) at each batch size, into step_time[eager, batch]."""
    mode = "eager" if eager else "graphs"
    start = time.perf_counter()
    llm = decode_llm(model_dir, device, shape, eager, max(batches))
    report.add("decode", f"start-up ({mode})", f"{time.perf_counter() - start:.2f} s")
    runner = llm.engine_core.model_runner
    kv_bytes_total = sum(t.numel() * t.element_size() for t in runner.kv_caches)
    report.add("decode", f"KV cache ({mode})",
               f"{runner.num_blocks} blocks, {kv_bytes_total / 2 ** 30:.1f} GiB of "
               f"{torch.cuda.get_device_properties(device).total_memory / 2 ** 30:.0f} GiB"
               if device.type == "cuda" else f"{runner.num_blocks} blocks")
    for b in batches:
        if time.perf_counter() > deadline:
            report.add("decode", f"batch {b} ({mode}): skipped", "out of time", ok=False)
            continue
        seconds, made = decode_steps(llm, b, context, steps)
        step_time[eager, b] = seconds
        report.add("decode", f"batch {b} ({mode}), context {context}",
                   f"{made / seconds:.0f} tok/s ({seconds * 1e3:.2f} ms/step, {made:.1f} tokens a step)",
                   f"{b} tokens a step", abs(made - b) < 0.5)
    if not eager and 1 in batches and llm.engine_core.runs_ahead and time.perf_counter() < deadline:
        # the same engine at batch 1 with each step read back before the next is scheduled
        seconds = with_scheduling(llm, False, lambda: decode_steps(llm, 1, context, steps)[0])
        report.add("decode", "batch 1 (graphs), async scheduling off",
                   f"{seconds * 1e3:.2f} ms/step: async scheduling's step takes {step_time[False, 1] / seconds:.0%} "
                   "of it")
    if not eager and (False, 1) in step_time:
        model = runner.model
        weight_bytes = sum(m.weight.numel() * m.weight.element_size() for name, m in model.named_modules()
                           if hasattr(m, "weight") and m.weight is not None and name != "embed_tokens")
        head_bytes = model.lm_head.weight.numel() * model.lm_head.weight.element_size()
        arch = model.arch
        kv_bytes = 2 * arch.num_layers * (context + steps // 2) * arch.num_kv_heads * arch.head_dim * 2
        floor = (weight_bytes + kv_bytes) / copy_bw
        fraction = floor / step_time[False, 1]
        report.add("decode", "batch 1 (graphs): bandwidth floor reached",
                   f"{fraction:.0%} ({(weight_bytes + kv_bytes) / 2 ** 30:.2f} GiB read per step, "
                   f"floor {floor * 1e3:.2f} ms)", ">= 60%", fraction >= 0.6)
        if runner.graphs is not None and 1 in runner.graphs.graphs:
            # The GPU's share of the step: the batch-1 forward's graph alone (no logits, no
            # sampling, no Python), against the floor of what it reads (all but the head);
            # the rest of the step is the head, the engine's CPU time and the sampler.
            # one row's inputs in the graph's buffers first (the last step left a larger graph's
            # there): no slot to write, the keys of a context as long as the timed steps' mean
            # (replaying it over another size's packing read out of bounds, 2026-12-04)
            seq_len = context + steps // 2
            blocks = np.arange(-(-seq_len // runner.block_size), dtype=np.int32)[None]
            runner.graphs.replay(np.array([3]), np.array([seq_len - 1]), np.array([-1]),
                                 np.array([seq_len], dtype=np.int32), blocks)
            replay = timed(runner.graphs.graphs[1].replay, device, iters=50)
            forward_floor = (weight_bytes - head_bytes + kv_bytes) / copy_bw
            report.add("decode", "batch 1: graph replay alone (forward only, no head)",
                       f"{replay * 1e3:.3f} ms of the {step_time[False, 1] * 1e3:.3f} ms step: "
                       f"{forward_floor / replay:.0%} of its bandwidth floor ({forward_floor * 1e3:.2f} ms)")


def decode_llm(model_dir: str, device: torch.device, shape: dict, eager: bool, max_num_seqs: int):
    """The engine the decode section times: the Triton path, bfloat16, random weights."""
    from streamserve import LLM

    return LLM(model_dir, device=str(device), dtype="bfloat16", load_format="dummy", enforce_eager=eager,
               kernel_backend="triton", max_model_len=min(2048, shape["max_position_embeddings"]),
               max_num_seqs=max_num_seqs, gpu_memory_utilization=0.45, kv_cache_memory="256MiB")


def without_pdl(report: Report, device: torch.device, model_dir: str, shape: dict, context: int, steps: int,
                step_time: dict[tuple[bool, int], float]) -> None:
    """Batch 1 (graphs) in an engine whose kernels launch without programmatic dependent launch
    (streamserve_kernels/launch.py), against the same with it (step_time[False, 1])."""
    from streamserve_kernels import launch

    item = "batch 1 (graphs), without programmatic dependent launch"
    if not launch.pdl(device):
        report.add("decode", item, "PDL is not used here")
        return
    with launch.disabled():
        llm = decode_llm(model_dir, device, shape, False, 1)
        seconds = decode_steps(llm, 1, context, steps)[0]
    report.add("decode", item,
               f"{seconds * 1e3:.2f} ms/step: the step with it takes {step_time[False, 1] / seconds:.0%} of it")
    del llm


def with_scheduling(llm, ahead: bool, run):
    """run() with async scheduling on or off (`ahead`) in this engine, then as it was; the batch
    in flight, if any, is read back at each switch (its outputs dropped)."""
    core = llm.engine_core

    def switch(on: bool) -> None:
        core.read_back_in_flight()
        core.config.scheduler.async_scheduling = "on" if on else "off"
    was = core.runs_ahead
    switch(ahead)
    try:
        return run()
    finally:
        switch(was)


# -- 3. the decode attention kernel alone ---------------------------------------------------

def attention_bandwidth(report: Report, device: torch.device, copy_bw: float, smoke: bool) -> None:
    from streamserve_kernels.attention import DecodeWorkspace, choose_num_splits, paged_decode_attention

    batch, context, hq, hkv, d, bs = (64, 4096, 32, 8, 64, 16) if not smoke else (4, 64, 4, 2, 64, 16)
    dtype = torch.bfloat16
    blocks_per_seq = context // bs
    num_blocks = batch * blocks_per_seq
    kv = torch.randn(2, num_blocks, bs, hkv, d, device=device, dtype=dtype)
    tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, hq, d, device=device, dtype=dtype)
    out = torch.empty_like(q)
    chosen = choose_num_splits(context, batch, hkv, 16)
    ws = DecodeWorkspace.allocate(batch, hq, d, max(chosen, 4), device)
    kv_bytes = 2 * batch * context * hkv * d * kv.element_size()
    # the engine's settings (4 warps, the chosen splits) against the target; then a few others,
    # as figures to tune the launch by
    settings = [(4, chosen)] + [(w, s) for w in (4, 8) for s in (1, 2, 4) if (w, s) != (4, chosen)]
    for warps, splits in settings if not smoke else settings[:2]:
        seconds = timed(lambda: paged_decode_attention(q, kv, seq_lens, tables, d ** -0.5, splits, ws, out=out,
                                                       num_warps=warps), device, iters=3 if smoke else 50)
        achieved = kv_bytes / seconds
        item = f"decode kernel, batch {batch}, context {context}, {hq}q/{hkv}kv, {splits} splits, {warps} warps"
        value = f"{achieved / 1e9:.0f} GB/s = {achieved / copy_bw:.0%} of copy bandwidth ({seconds * 1e6:.0f} us)"
        if (warps, splits) == (4, chosen):
            report.add("attention", item + " (the engine's)", value, ">= 70%", achieved / copy_bw >= 0.7)
        else:
            report.add("attention", item, value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT") or ".", help="folder for gpu-check.md/.json")
    parser.add_argument("--no-pdl", action="store_true",
                        help="launch every kernel without programmatic dependent launch (streamserve_kernels/launch.py)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (to check the script on the CPU)")
    parser.add_argument("--budget", type=float, default=300.0,
                        help="seconds: no section starts after this (default 300)")
    parser.add_argument("--limit", type=float, default=450.0,
                        help="seconds the whole run may take (the caller's time limit): the decode section "
                             f"builds no engine and starts no batch size in the last {DECODE_RESERVE:.0f} "
                             "(default 450)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("on the CPU the kernels run only under TRITON_INTERPRET=1")
    import triton

    from streamserve_kernels import launch

    launch.ENABLED = not args.no_pdl
    started = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    header = [f"# GPU check, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
              "", f"- device: {name}", f"- torch {torch.__version__}, triton {triton.__version__}, "
              f"python {platform.python_version()}",
              f"- command: `python scripts/gpu_check.py{' --smoke' if args.smoke else ''}"
              f"{'' if args.device == 'cuda' else ' --device ' + args.device}{' --no-pdl' if args.no_pdl else ''}`"]
    report = Report()
    report.on_add = lambda: write("running")
    copy_bw = None
    work = tempfile.mkdtemp(prefix="gpu-check-")
    os.makedirs(args.out, exist_ok=True)

    def write(status: str) -> str:
        """The table so far, under --out (after every row): a run killed at its time limit still
        leaves its numbers."""
        text = report.markdown(header + [f"- {status}: {time.perf_counter() - started:.0f} s"])
        with open(os.path.join(args.out, "gpu-check.md"), "w") as f:
            f.write(text)
        with open(os.path.join(args.out, "gpu-check.json"), "w") as f:
            json.dump({"header": header, "status": status, "rows": report.rows}, f, indent=1)
        return text

    sections = [("bandwidth", lambda: copy_bandwidth(report, device, args.smoke)),
                ("kernels", lambda: kernel_checks(report, device, args.smoke)),
                ("attention", lambda: attention_bandwidth(report, device, copy_bw, args.smoke)),
                ("parity", lambda: parity(report, device, work, args.smoke)),
                ("lora", lambda: lora_parity(report, device, work, args.smoke)),
                ("kin", lambda: kin_parity(report, device, work, args.smoke)),
                ("decode", lambda: throughput(report, device, work, copy_bw, args.smoke,
                                              started + args.limit - DECODE_RESERVE))]
    for section, run in sections:
        t = time.perf_counter()
        if t - started > args.budget:
            report.add(section, "skipped", f"out of time (--budget {args.budget:.0f} s)", ok=False)
            continue
        try:
            result = run()
            if section == "bandwidth":
                copy_bw = result
        except Exception as exc:  # one broken section must not hide the others' numbers
            traceback.print_exc()
            report.add(section, "section failed", f"{type(exc).__name__}: {str(exc)[:300]}", ok=False)
        print(f"-- {section}: {time.perf_counter() - t:.1f} s", flush=True)
        try:  # after a sticky CUDA error this raises too: the rows so far are written all the same
            free_memory()
        except Exception as exc:
            report.add(section, "freeing its memory failed", f"{type(exc).__name__}: {str(exc)[:300]}", ok=False)
        write(f"running, after {section}")
    text = write("total")
    shutil.rmtree(work, ignore_errors=True)
    print("\n" + text)
    failed = [r for r in report.rows if r["ok"] is False]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
