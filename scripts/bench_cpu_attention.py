"""The CPU decode attention: the C kernel on a float32 and on a float16 cache against the torch
path, one layer's call, same process.

    python scripts/bench_cpu_attention.py

SmolLM2's head layout (9 query heads on 3 KV heads, head_dim 64), KV in blocks of 16 scattered
over the pool; each row is timed as the lower quartile of repeated calls. The same layer's cache
is read again and again, so the larger rows come from the CPU's caches more than in a real step
(whose 30 layers' caches do not fit): there the float16 cache gains more.
"""

from __future__ import annotations

import time

import torch

from streamserve.models import cpu_kernels
from streamserve.worker.attention import AttentionMetadata, TorchPagedAttention

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
    print("batch context  C, float32 KV  C, float16 KV    torch path  torch / C float32 / float16")
    for batch, ctx in [(1, 32), (1, 512), (1, 1500), (1, 4000), (8, 1500), (64, 512)]:
        c_kernel, c_half, torch_path = setup(batch, ctx)
        n = 200 if batch * ctx < 20000 else 30
        tc, th, tt = quartile(c_kernel, n), quartile(c_half, n), quartile(torch_path, n)
        print(f"{batch:5d} {ctx:7d} {tc * 1e6:11.0f} us {th * 1e6:11.0f} us {tt * 1e6:10.0f} us "
              f"{tt / tc:10.1f}x {tt / th:8.1f}x", flush=True)


if __name__ == "__main__":
    main()
