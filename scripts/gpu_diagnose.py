"""What the device check's failing rows are made of, on a CUDA machine (one call, about a minute).

    PYTHONPATH=. python3 scripts/gpu_diagnose.py --out "$OUT"

1. gemma2 parity: each prompt's greedy tokens from transformers (its default attention and
   eager, on the GPU and on the CPU) and from the engine (graphs, enforce_eager, the torch
   backend), with the first token where each differs from transformers' eager tokens on the
   GPU and that reference's gap between its top two logits there;
2. the batch-1 decode step of the Llama-3.2-1B shape (graphs): the CPU time of each phase of
   an engine step (schedule, inputs, replay, head, sampler, update), with and without a sync
   after each phase, and the GPU kernels of a step (torch.profiler);
3. each of the model's matrix shapes at one row (torch.matmul, bfloat16) against the copy
   bandwidth.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time
import traceback
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_check as gc_  # noqa: E402

LOG: list[str] = []


def say(line: str = "") -> None:
    print(line, flush=True)
    LOG.append(line)


def first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), -1 if len(a) == len(b) else min(len(a), len(b)))


def hf_tokens(model_dir: str, device: torch.device, attn: str, new_tokens: int) -> tuple[list[list[int]], list]:
    from transformers import AutoModelForCausalLM

    kwargs = {} if attn == "default" else {"attn_implementation": attn}
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs).to(device).eval()
    hf.generation_config.eos_token_id = None
    outs, gaps = [], []
    for p in gc_.PARITY_PROMPTS:
        ids = torch.tensor([p], device=device)
        with torch.no_grad():
            seq = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              do_sample=False, pad_token_id=0)
            logits = hf(seq[:, :-1]).logits[0, len(p) - 1:].float()
        top = logits.topk(2, dim=-1).values
        outs.append(seq[0, len(p):].tolist())
        gaps.append((top[:, 0] - top[:, 1]).tolist())
    say(f"  transformers {attn} on {device}: attn_implementation={hf.config._attn_implementation}")
    del hf
    return outs, gaps


def gemma2(device: torch.device, work: str) -> None:
    from streamserve import LLM, SamplingParams
    from tiny_models import build_model

    say("## gemma2 parity")
    model_dir = build_model(os.path.join(work, "tiny-gemma2"), "gemma2", seed=0)
    new_tokens = 24
    ref, gaps = hf_tokens(model_dir, device, "eager", new_tokens)
    runs = {"hf default gpu": hf_tokens(model_dir, device, "default", new_tokens)[0],
            "hf eager cpu": hf_tokens(model_dir, torch.device("cpu"), "eager", new_tokens)[0]}
    for name, kwargs in (("engine graphs", dict(kernel_backend="triton")),
                         ("engine eager", dict(kernel_backend="triton", enforce_eager=True)),
                         ("engine torch backend", dict(kernel_backend="torch", enforce_eager=True))):
        try:
            llm = LLM(model_dir, device=str(device), dtype="float32", num_gpu_blocks_override=512, max_num_seqs=8,
                      **kwargs)
            outs = llm.generate([{"prompt_token_ids": p} for p in gc_.PARITY_PROMPTS],
                                SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True), use_tqdm=False)
            runs[name] = [o.outputs[0].token_ids for o in outs]
            del llm
        except Exception:
            say(traceback.format_exc())
        gc_.free_memory()
    for name, outs in runs.items():
        diffs = [first_diff(o, r) for o, r in zip(outs, ref)]
        at = [f"{d} (gap {g[d]:.2e})" if d >= 0 else "same" for d, g in zip(diffs, gaps)]
        say(f"  {name:22s} vs hf eager gpu: " + "; ".join(at))
    say("  hf eager gpu smallest top-2 gaps per prompt: " + ", ".join(f"{min(g):.2e}" for g in gaps))


def step_phases(device: torch.device, work: str, copy_bw: float) -> None:
    from torch.profiler import ProfilerActivity, profile

    from bench_throughput import make_workload, start_decoding
    from streamserve import LLM

    say("## batch-1 decode step, Llama-3.2-1B shape, graphs")
    model_dir = gc_.write_model_dir(work, gc_.LLAMA_1B)
    llm = LLM(model_dir, device=str(device), dtype="bfloat16", load_format="dummy", kernel_backend="triton",
              max_model_len=2048, max_num_seqs=8, gpu_memory_utilization=0.45, kv_cache_memory="256MiB")
    core = llm.engine_core
    runner, sched = core.model_runner, core.scheduler
    chosen = {(tuple(m.weight.shape), str(getattr(m.gemv, "keywords", None))) for m in runner.model.modules()
              if hasattr(m, "gemv")}
    say("  one-row products chosen: " + "; ".join(f"{s}: {g}" for s, g in sorted(chosen)))
    start_decoding(llm, make_workload(1, core.vocab_size, 1, 512, 512, 1000, 1000))
    for _ in range(5):
        core.step()
    steps = 50
    t = time.perf_counter()
    for _ in range(steps):
        core.step()
    say(f"  step: {(time.perf_counter() - t) / steps * 1e3:.3f} ms")

    times: dict[str, float] = defaultdict(float)
    synced = [False]

    def wrap(obj, name: str, label: str):
        original = getattr(obj, name)

        def timed_call(*args, **kwargs):
            t0 = time.perf_counter()
            out = original(*args, **kwargs)
            if synced[0]:
                torch.cuda.synchronize(device)
            times[label] += time.perf_counter() - t0
            return out
        setattr(obj, name, timed_call)

    wrap(sched, "schedule", "schedule")
    wrap(runner, "_prepare_inputs", "prepare_inputs")
    wrap(runner.graphs, "replay", "graph replay (launch)")
    wrap(runner.model, "compute_logits", "head")
    wrap(runner.sampler, "sample", "sampler")
    wrap(runner, "collect", "read back (its wait)")
    wrap(sched, "update_from_output", "update_from_output")
    for ahead, sync in ((True, False), (False, False), (False, True)):
        synced[0] = sync
        times.clear()
        t = time.perf_counter()
        gc_.with_scheduling(llm, ahead, lambda: [core.step() for _ in range(steps)])
        total = (time.perf_counter() - t) / steps
        say(f"  phases, async scheduling {'on' if ahead else 'off'}, "
            f"{'with a sync after each' if sync else 'CPU time, no added sync'}: step {total * 1e3:.3f} ms")
        for k, v in times.items():
            say(f"    {k:28s} {v / steps * 1e3:.3f} ms")
        say(f"    {'the rest (step() itself)':28s} {(total - sum(times.values()) / steps) * 1e3:.3f} ms")
    synced[0] = False
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            core.step()
        torch.cuda.synchronize(device)
    table = prof.key_averages().table(sort_by="device_time_total", row_limit=30)
    say(table)
    say(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    replay = gc_.timed(runner.graphs.graphs[1].replay, device, iters=100)
    say(f"  graph[1] replay alone: {replay * 1e3:.3f} ms")
    rows = torch.randn(1, 2048, device=device, dtype=torch.bfloat16)
    head = gc_.timed(lambda: runner.model.compute_logits(rows), device, iters=100)
    say(f"  head alone (1 row): {head * 1e3:.3f} ms")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            runner.graphs.graphs[1].replay()
        torch.cuda.synchronize(device)
    say(prof.key_averages().table(sort_by="device_time_total", row_limit=20))
    del llm
    gc_.free_memory()

    say("## one-row matrix products (bfloat16): torch's, and the Triton GEMV's launch settings")
    from streamserve_kernels import gemv

    sweep = [(bn, bk, w) for bn in (2, 4, 8, 16, 32) for bk in (128, 256, 512, 1024) for w in (2, 4, 8)
             if bn * bk <= 16384]
    for k, n in ((2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048), (2048, 128256)):
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
        _, times = gemv.choose(w, iters=100, configs=sweep)
        ranked = sorted(times, key=times.get)
        say(f"  [1, {k}] x [{n}, {k}]^T ({w.numel() * 2 / 2 ** 20:.0f} MiB): torch {times['torch']:.1f} us "
            f"({w.numel() * 2 / times['torch'] / 1e3 / copy_bw * 1e9:.0%} of copy bandwidth); best: "
            + ", ".join(f"{c} {times[c]:.1f} us ({w.numel() * 2 / times[c] / 1e3 / copy_bw * 1e9:.0%})"
                        for c in ranked[:5]))
    from streamserve_kernels.activation import silu_and_mul

    w = torch.randn(2048, 8192, device=device, dtype=torch.bfloat16)
    apart = functools.partial(gemv.gemv, block_n=2, block_k=1024, num_warps=4)  # (run 4's best for this shape)
    _, times = gemv.choose_gated(w, None, lambda x, w: apart(silu_and_mul(x), w), iters=100, configs=sweep)
    ranked = sorted(times, key=times.get)
    say(f"  SiLU-and-mul then [1, 8192] x [2048, 8192]^T: apart (the activation's kernel, then the GEMV at "
        f"(2, 1024, 4)) {times['unfused']:.1f} us; fused, best: "
        + ", ".join(f"{c} {times[c]:.1f} us" for c in ranked[:5]))
    norm_weight = torch.ones(2048, device=device, dtype=torch.bfloat16)
    for n, best in ((3072, (4, 512, 2)), (16384, (4, 1024, 4))):  # (run 4's best GEMV for each)
        w = torch.randn(n, 2048, device=device, dtype=torch.bfloat16)
        apart = functools.partial(gemv.gemv, block_n=best[0], block_k=best[1], num_warps=best[2])
        _, times = gemv.choose_normed(w, None, norm_weight, 1e-5, lambda x, w, apart=apart: apart(x, w), iters=100,
                                      configs=sweep)
        ranked = sorted(times, key=times.get)
        say(f"  RMSNorm (+ residual) then [1, 2048] x [{n}, 2048]^T: apart (the norm's kernel, then the GEMV at "
            f"{best}) {times['unfused']:.1f} us; fused, best: " + ", ".join(f"{c} {times[c]:.1f} us" for c in ranked[:5]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT") or ".")
    parser.add_argument("--only", default="kernels,gemma2,step")
    parser.add_argument("--device", default="cuda", help="cpu: the gemma2 part alone, to check the script")
    args = parser.parse_args()
    device = torch.device(args.device)
    copy_bw = gc_.copy_bandwidth(gc_.Report(), device, smoke=False)
    work = tempfile.mkdtemp(prefix="gpu-diagnose-")
    report = gc_.Report()
    report.on_add = lambda: say(str(report.rows[-1]))
    for name, fn in (("kernels", lambda: gc_.kernel_checks(report, device, smoke=False)),
                     ("gemma2", lambda: gemma2(device, work)), ("step", lambda: step_phases(device, work, copy_bw))):
        if name in args.only:
            try:
                fn()
            except Exception:
                say(traceback.format_exc())
            with open(os.path.join(args.out, "gpu-diagnose.txt"), "w") as f:
                f.write("\n".join(LOG) + "\n")


if __name__ == "__main__":
    main()
