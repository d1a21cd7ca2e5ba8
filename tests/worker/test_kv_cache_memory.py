"""The CPU KV cache's memory: pages the OS fills as they are first written, the first blocks
written at start-up (so that the first request's step does not pay for them)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Run in a fresh process: in a long-lived one, calloc may hand out recycled heap memory, which
# it zeroes (and so makes resident) whole.
SCRIPT = """
import os, struct, sys
from streamserve import LLM

def resident(address):
    # /proc/self/pagemap's bit 63: readable without privileges, unlike the frame numbers
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(address // os.sysconf("SC_PAGE_SIZE") * 8)
        return bool(struct.unpack("<Q", f.read(8))[0] >> 63)

runner = LLM(sys.argv[1], kv_cache_memory="256MiB", max_num_batched_tokens=64).engine_core.model_runner
first = 64 // runner.block_size  # the blocks a first step of 64 tokens gets
for cache in runner.kv_caches:
    assert cache.shape[1] > 1000 * first  # (so that the middle blocks lie megabytes from the first)
    for kv in cache:  # K, then V
        print(int(resident(kv[0].data_ptr())), int(resident(kv[first - 1].data_ptr())),
              int(resident(kv[len(kv) // 2].data_ptr())))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="needs Linux's /proc/self/pagemap")
def test_cpu_kv_cache_holds_the_first_blocks_and_not_the_rest(llama_dir):
    out = subprocess.run([sys.executable, "-c", SCRIPT, llama_dir], capture_output=True, text=True, check=True).stdout
    rows = out.split("\n")[:-1]
    assert rows and all(row == "1 1 0" for row in rows), out
