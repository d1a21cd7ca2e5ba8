"""The CPU attention kernels on a float32 and on a float16 cache against the torch path, one
layer's call, same process: the decodes (paged_decode_attention), then a prefill chunk of 256
rows after a context (paged_prefill_attention; the torch path runs SDPA on the gathered keys).

    python scripts/bench_cpu_attention.py

SmolLM2's head layout (9 query heads on 3 KV heads, head_dim 64), KV in blocks of 16 scattered
over the pool; each row is timed as the lower quartile of repeated calls. The same layer's cache
is read again and again, so the larger rows come from the CPU's caches more than in a real step
(whose 30 layers' caches do not fit): there the float16 cache gains more. The prefill rows also
print the float16 kernel's GFLOP/s (4 * heads * head_dim flops per query-key pair the causal mask keeps),
and where the CPU has AVX512-BF16, the float16 kernel taking bfloat16 dot products (a bfloat16
checkpoint's prefill chunks) and its speed-up.
"""

from __future__ import annotations

import time

import torch

from streamserve.models import cpu_kernels
from streamserve.worker.attention import AttentionMetadata, PrefillChunk, TorchPagedAttention

HQ, HKV, D, BS = 9, 3, 64, 16


def setup(batch: int, ctx: int):
    gen = torch.Generator().manual_seed(batch * ctx)
    num_blocks = batch * -(-ctx // BS)
    cache = torch.randn(2, num_blocks, BS, HKV, D, generator=gen)
    width = -(-ctx // BS)
    tables = torch.randperm(num_blocks, generator=gen).view(batch, width)
    q = torch.randn(batch, HQ, D, generator=gen)
    lens = torch.full((batch,), ctx, dtype=torch.int64)
    visible = torch.arange(width * BS)[None] < lens[:, None]
    mask = (None if ctx % BS == 0
            else torch.zeros(visible.shape).masked_fill_(~visible, float("-inf")).view(batch, 1, 1, -1))
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.int64), batch, tables, mask, [])
    torch_path = TorchPagedAttention([cache], meta, HQ, HKV, D)
    kernels = cpu_kernels.load()
    half = cache.half()
    return (lambda: kernels.paged_decode_attention(q, cache, tables, lens, D ** -0.5),
            lambda: kernels.paged_decode_attention(q, half, tables, lens, D ** -0.5),
            lambda: torch_path._decode(q, cache))


def setup_prefill(ctx: int, rows: int = 256):
    """A chunk of `rows` query rows after `ctx` tokens of context, its keys already written."""
    gen = torch.Generator().manual_seed(ctx)
    width = -(-(ctx + rows) // BS)
    cache = torch.randn(2, width, BS, HKV, D, generator=gen)
    table = torch.randperm(width, generator=gen)
    q = torch.randn(rows, HQ, D, generator=gen)
    chunk = PrefillChunk(0, rows, ctx, table)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.int64), 0, None, None, [chunk])
    torch_path = TorchPagedAttention([cache], meta, HQ, HKV, D)
    k, v = (cache[i].index_select(0, table).flatten(0, 1)[ctx:] for i in (0, 1))
    kernels, half = cpu_kernels.load(), cache.half()
    starts, lens, tables = torch.tensor([0, rows]), torch.tensor([ctx + rows]), table[None].contiguous()
    return (lambda: kernels.paged_prefill_attention(q, cache, starts, tables, lens, D ** -0.5),
            lambda: kernels.paged_prefill_attention(q, half, starts, tables, lens, D ** -0.5),
            lambda: torch_path._prefill(q, k, v, cache, chunk),
            lambda: kernels.paged_prefill_attention(q, half, starts, tables, lens, D ** -0.5, bf16_dot=True))


def quartile(fn, n: int) -> float:
    fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 4]


def main() -> None:
    if cpu_kernels.load() is None:
        raise SystemExit("the CPU kernels do not load here (the log says why)")
    print(f"{cpu_kernels.load().vector_bits}-bit kernel vectors (the prefill lanes; the decode kernel's are 256-bit)\n")
    print("batch context  C, float32 KV  C, float16 KV    torch path  torch / C float32 / float16")
    for batch, ctx in [(1, 32), (1, 512), (1, 1500), (1, 4000), (8, 1500), (64, 512)]:
        c_kernel, c_half, torch_path = setup(batch, ctx)
        n = 200 if batch * ctx < 20000 else 30
        tc, th, tt = quartile(c_kernel, n), quartile(c_half, n), quartile(torch_path, n)
        print(f"{batch:5d} {ctx:7d} {tc * 1e6:11.0f} us {th * 1e6:11.0f} us {tt * 1e6:10.0f} us "
              f"{tt / tc:10.1f}x {tt / th:8.1f}x", flush=True)
    dot = cpu_kernels.load().bf16_dot_min_rows > 0
    print("\n rows context  C, float32 KV  C, float16 KV    torch path  torch / C float32 / float16  GFLOP/s"
          + ("  float16 KV, bf16 dot  speed-up" if dot else ""))
    rows = 256
    for ctx in [0, 256, 768, 1792, 3840]:
        c_kernel, c_half, torch_path, c_dot = setup_prefill(ctx, rows)
        n = 40 if ctx < 1000 else 10
        tc, th, tt = quartile(c_kernel, n), quartile(c_half, n), quartile(torch_path, n)
        flops = 4 * HQ * D * (rows * ctx + rows * (rows + 1) / 2)
        line = (f"{rows:5d} {ctx:7d} {tc * 1e3:11.2f} ms {th * 1e3:11.2f} ms {tt * 1e3:10.2f} ms "
                f"{tt / tc:10.2f}x {tt / th:8.2f}x {flops / th / 1e9:8.1f}")
        if dot:  # (AVX512-BF16: what a bfloat16 checkpoint's prefill chunks take)
            td = quartile(c_dot, n)
            line += f" {td * 1e3:17.2f} ms {th / td:8.2f}x"
        print(line, flush=True)


if __name__ == "__main__":
    main()
