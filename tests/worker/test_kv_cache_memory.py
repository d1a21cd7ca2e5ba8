"""The CPU path's memory: the KV cache's pages the OS fills as they are first written, the first
blocks written at start-up (so that the first request's step does not pay for them); the caches
and the weights' copies every step streams through in mappings advised for huge pages."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Run in a fresh process, whose pages are its own to read: one that has made other engines
# before may have touched pages of the same addresses.
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


HUGE_PAGES_SCRIPT = """
import sys
from streamserve import LLM

def advised(address):
    # /proc/self/smaps: the mapping holding `address`, and whether its VmFlags have hg (MADV_HUGEPAGE)
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low <= address < high
            elif inside and head == "VmFlags:":
                return "hg" in line.split()
    raise AssertionError(f"no mapping holds {address:#x}")

runner = LLM(sys.argv[1], kv_cache_memory="64MiB").engine_core.model_runner
copies = runner.model.copies()
print(len(copies), runner.c_kernels is not None)
print(all(advised(t.data_ptr()) and advised(t.data_ptr() + t.nbytes - 1) for t in copies + runner.kv_caches))
print(all(t.data_ptr() % 64 == 0 for t in copies), all(t.data_ptr() % (2 << 20) == 0 for t in runner.kv_caches))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's /proc/self/smaps")
def test_cpu_weight_copies_and_kv_caches_are_advised_for_huge_pages(llama_dir):
    out = subprocess.run([sys.executable, "-c", HUGE_PAGES_SCRIPT, llama_dir], capture_output=True, text=True,
                         check=True).stdout.split("\n")
    copies, kernels = out[0].split()
    if kernels == "True":  # every linear layer keeps packed copies for the C GEMM
        assert int(copies) > 0, out
    assert out[1:3] == ["True", "True True"], out
