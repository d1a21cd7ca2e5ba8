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


def test_onto_huge_pages_lets_each_original_go_as_it_yields_its_copy():
    """The load's peak: each original leaves the list as its copy is made, so a caller putting
    the copies in place one by one holds the weights once, not twice."""
    import gc
    import weakref

    import torch

    from streamserve.models.cpu_kernels import onto_huge_pages

    originals = [torch.randn(64, 100), torch.arange(300, dtype=torch.int32), torch.randn(7).bfloat16()]
    values = [t.clone() for t in originals]
    alive = [weakref.ref(t) for t in originals]
    tensors = list(originals)
    del originals
    copies = []
    for i, copy in enumerate(onto_huge_pages(tensors)):
        gc.collect()
        assert len(tensors) == len(values) - i - 1 and alive[i]() is None  # (the list held the last reference)
        copies.append(copy)
    assert all(torch.equal(c, v) and c.dtype == v.dtype and c.data_ptr() % 64 == 0 for c, v in zip(copies, values))


def test_a_16_bit_checkpoint_is_loaded_in_its_dtype_and_computes_in_float32(tmp_path, monkeypatch):
    """On the C kernels a bfloat16 checkpoint's linear weights are loaded as bfloat16 (their
    packed copies are all that is kept) and its embedding stays bfloat16, its rows upcast as
    they are looked up: the same tokens and logprobs, to the bit, as loading it in float32 gave."""
    import torch
    from safetensors.torch import load_file, save_file

    from streamserve import LLM, SamplingParams
    from streamserve.models.layers import PackedEmbedding, UpcastEmbedding
    from streamserve.worker import model_runner
    from tiny_models import build_model

    def run(path: str):
        llm = LLM(path, dtype="bfloat16", kv_cache_memory="32MiB")
        params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": [5 + i * 7 % 300 for i in range(n)]} for n in (3, 20, 41)],
                               params, use_tqdm=False)
        got = [(o.outputs[0].token_ids, [[(t, e.logprob) for t, e in d.items()] for d in o.outputs[0].logprobs])
               for o in outputs]
        return llm.engine_core.model_runner, got

    path = build_model(str(tmp_path / "qwen2"), "qwen2")  # untied
    weights = load_file(f"{path}/model.safetensors")
    save_file({k: v.bfloat16() for k, v in weights.items()}, f"{path}/model.safetensors", metadata={"format": "pt"})
    runner, got = run(path)
    if runner.c_kernels is None:
        pytest.skip("the CPU kernels do not build here")
    embedding = runner.model.embed_tokens
    assert isinstance(embedding, UpcastEmbedding) and embedding.weight.dtype == torch.bfloat16
    assert torch.equal(embedding(torch.tensor([5, 9])), weights["model.embed_tokens.weight"][[5, 9]].bfloat16().float())
    assert runner.model.layers[0].mlp.down_proj.weight.numel() == 0  # (only its packed copy)
    load = model_runner.load_model
    monkeypatch.setattr(model_runner, "load_model", lambda *a, linear_dtype=None, **k: load(*a, **k))
    float32_runner, want = run(path)
    assert type(float32_runner.model.embed_tokens) is torch.nn.Embedding and got == want
    monkeypatch.undo()
    tied = LLM(build_model(str(tmp_path / "llama"), "llama"), dtype="bfloat16", kv_cache_memory="32MiB")
    assert isinstance(tied.engine_core.model_runner.model.embed_tokens, PackedEmbedding)
