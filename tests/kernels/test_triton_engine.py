"""The engine on its Triton path, run on the CPU through Triton's interpreter (conftest.py):
the model's small ops, the cache writes and attention all go through streamserve_kernels,
and greedy decoding still matches transformers token for token. The same with the static
buffers of the CUDA-graph runner, whose padding rows must change nothing."""

from __future__ import annotations

import pytest
import torch

from parity import check_parity
from streamserve import LLM
from streamserve.worker.triton_attention import TritonAttentionMetadata

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run of the GPU path")


def triton_llm(model_dir: str, **kwargs) -> LLM:
    llm = LLM(model_dir, dtype="float32", kernel_backend="triton", kv_cache_memory="16MiB", **kwargs)
    runner = llm.engine_core.model_runner
    assert runner.triton and runner.model.layers[0].input_layernorm.kernels is not None
    return llm


def test_triton_path_matches_transformers_with_mixed_steps(model_dirs, monkeypatch):
    # A token budget of 24 puts decodes and prefill chunks into the same steps.
    llm = triton_llm(model_dirs["llama"], max_num_batched_tokens=24)
    runner = llm.engine_core.model_runner
    seen = []
    original = runner._attention
    monkeypatch.setattr(runner, "_attention", lambda meta, caches: seen.append(meta) or original(meta, caches))
    from streamserve.worker.triton_attention import TritonPagedAttention

    calls = {"rotate_and_attend": 0, "__call__": 0}
    for name in calls:
        original_method = getattr(TritonPagedAttention, name)
        monkeypatch.setattr(TritonPagedAttention, name, lambda self, *args, name=name, method=original_method: (
            calls.__setitem__(name, calls[name] + 1), method(self, *args))[1])
    check_parity(llm, model_dirs["llama"], num_prompts=5, new_tokens=6)
    # every layer rotates as it writes the cache, in one kernel (ForwardContext.attend)
    assert calls["rotate_and_attend"] and not calls["__call__"]
    assert all(isinstance(m, TritonAttentionMetadata) for m in seen)
    assert any(0 < m.num_decodes < m.query_start_loc.shape[0] - 1 for m in seen), "no mixed step ran"


def test_decode_graph_buffers_pad_without_effect(model_dirs):
    llm = triton_llm(model_dirs["qwen3"])
    runner = llm.engine_core.model_runner
    runner.graphs = runner.make_decode_graphs()  # on the CPU: the static buffers, replayed eagerly
    replays = []
    original = runner.graphs.replay
    runner.graphs.replay = lambda ids, *rest: replays.append(len(ids)) or original(ids, *rest)
    check_parity(llm, model_dirs["qwen3"], num_prompts=3, new_tokens=6)
    assert replays and any(runner.graphs.padded_size(n) > n for n in replays), "no padded decode step"
    scheduler = llm.engine_core.scheduler
    assert scheduler.kv_cache_manager.num_free_blocks == runner.num_blocks



def test_async_scheduling_carries_the_tokens_into_the_graph_buffers(model_dirs):
    """Async scheduling on the GPU path: a pure-decode step's token IDs reach the graph's
    buffer from the host, and then (a copy on the device) those the step in flight samples;
    the greedy tokens are still transformers'."""
    from parity import hf_reference, parity_prompts
    from streamserve import SamplingParams

    llm = triton_llm(model_dirs["llama"], async_scheduling="on")
    runner = llm.engine_core.model_runner
    runner.graphs = runner.make_decode_graphs()
    carried = []
    original = runner.graphs.replay
    runner.graphs.replay = lambda ids, *rest: carried.append(rest[-1] is not None) or original(ids, *rest)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in parity_prompts()[:3]]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == [tokens for tokens, _ in hf_reference(model_dirs["llama"], 3, 6)]
    assert carried and all(carried)


@pytest.mark.parametrize("fused", [("gated",), ("normed_qkv",), ("normed_gate_up",),
                                   ("gated", "normed_qkv", "normed_gate_up")], ids="+".join)
def test_one_row_steps_through_the_fused_kernels(model_dirs, fused):
    """With SiLU-and-mul fused into the down projection's GEMV, and each norm into the projection
    after it, either alone or both (what the runner chooses on a GPU where each wins), one-row
    decode steps give the
    tokens and logprobs of the kernels apart. (The norms' weights drawn at random, the same in
    both engines: the tiny Llama's are ones, under which one norm's weight would pass for
    another's.)"""
    import functools

    from parity import parity_prompts
    from streamserve import SamplingParams
    from streamserve_kernels.gemv import gemv, normed_gemv

    engines = [triton_llm(model_dirs["llama"]) for _ in range(2)]
    for llm in engines:
        gen = torch.Generator().manual_seed(7)
        for name, param in llm.engine_core.model_runner.model.named_parameters():
            if name.endswith("norm.weight"):
                param.data.copy_(1 + 0.3 * torch.randn(param.shape, generator=gen))
    calls = set()

    def counted(kind, kernel):
        return lambda *args: calls.add(kind) or kernel(*args)
    for layer in engines[1].engine_core.model_runner.model.layers:
        assert layer.plain_norms
        if "gated" in fused:
            layer.mlp.gated_down = counted("gated", functools.partial(gemv, block_n=4, block_k=64, gated=True))
        for kind in ("normed_qkv", "normed_gate_up"):
            if kind in fused:
                setattr(layer, kind, counted(kind, functools.partial(normed_gemv, block_n=4, block_k=64)))
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0)
    apart, together = ([llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0]
                        for p in parity_prompts()[:2]] for llm in engines)
    assert calls == set(fused)
    for a, b in zip(apart, together):
        assert a.token_ids == b.token_ids
        assert max(abs(x[t].logprob - y[t].logprob) for t, x, y in zip(a.token_ids, a.logprobs, b.logprobs)) < 1e-4


def test_the_largest_graph_fits_the_decode_workspace(model_dirs):
    """max_num_seqs 3 is captured as a graph of 4 rows (the capture sizes go 1, 2, 4, 8, ...):
    the split-KV workspace holds those 4 rows, padding included (it had 3, so capturing that
    graph, the first one captured, failed at start-up)."""
    llm = triton_llm(model_dirs["llama"], max_num_seqs=3)
    runner = llm.engine_core.model_runner
    graphs = runner.make_decode_graphs()
    assert graphs.max_batch == 4 and graphs.num_splits(4) > 1
    with torch.inference_mode():
        graphs._run(graphs.max_batch)  # what capture() runs first on CUDA


def test_lora_steps_run_eagerly_beside_graph_replays(model_dirs, tmp_path):
    """On the GPU path a step that holds a LoRA request runs eagerly (the adapters' GEMMs are
    not in the captured graphs), and still matches the merged model; the model's own pure
    decode steps replay."""
    from lora_adapters import build_adapter, merge_adapter
    from parity import assert_same_greedy, hf_reference, parity_prompts
    from streamserve import LoRARequest, SamplingParams

    model = model_dirs["llama"]
    adapter = build_adapter(str(tmp_path / "a"), model, rank=4, seed=5)
    merged = merge_adapter(model, adapter, str(tmp_path / "merged"))
    llm = triton_llm(model, enable_lora=True)
    runner = llm.engine_core.model_runner
    runner.graphs = runner.make_decode_graphs()
    replays = []
    original = runner.graphs.replay
    runner.graphs.replay = lambda ids, *rest: replays.append(len(ids)) or original(ids, *rest)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": p} for p in parity_prompts()[:2]]
    through = llm.generate(prompts, params, use_tqdm=False, lora_request=LoRARequest("a", 1, adapter))
    assert_same_greedy(through, hf_reference(merged, 2, 6))
    assert not replays
    assert_same_greedy(llm.generate(prompts, params, use_tqdm=False), hf_reference(model, 2, 6))
    assert replays


def import_gpu_check(monkeypatch):
    """scripts/gpu_check.py as a module (sys.path restored after the test)."""
    import importlib
    import os

    scripts = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "scripts")
    monkeypatch.syspath_prepend(scripts)
    return importlib.import_module("gpu_check")


def test_steps_that_check_guesses_run_eagerly_and_keep_the_output(model_dirs):
    """Speculative decoding on the GPU path: a step that checks guesses (a chunk of each such
    request's last token and its guesses) runs eagerly through the Triton kernels, the pure
    decode steps replay the graph buffers, and the greedy tokens are the torch path's without
    guessing."""
    from parity import parity_prompts
    from streamserve import SamplingParams

    model = model_dirs["llama"]
    llm = triton_llm(model, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                "prompt_lookup_max": 2, "prompt_lookup_min": 1})
    runner = llm.engine_core.model_runner
    runner.graphs = runner.make_decode_graphs()
    replays = []
    original = runner.graphs.replay
    runner.graphs.replay = lambda ids, *rest: replays.append(len(ids)) or original(ids, *rest)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, allowed_token_ids=[5, 6, 7])
    prompts = [{"prompt_token_ids": p} for p in parity_prompts()[:3]]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    plain = LLM(model, dtype="float32", kv_cache_memory="16MiB")
    assert got == [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert llm.engine_core.scheduler.spec_num_accepted_tokens > 0 and replays


def test_the_gpu_checks_lora_row_on_the_cpu(tmp_path, monkeypatch):
    """scripts/gpu_check.py's LoRA parity row, run here through Triton's interpreter (tiny
    sizes): the batch with an adapter on every other prompt matches transformers."""
    gpu_check = import_gpu_check(monkeypatch)
    report = gpu_check.Report()
    gpu_check.lora_parity(report, torch.device("cpu"), str(tmp_path), smoke=True)
    assert [(r["value"], r["ok"]) for r in report.rows] == [("4/4 prompts identical", True)]


def test_the_gpu_checks_parity_rows_on_the_cpu(tmp_path, monkeypatch):
    """scripts/gpu_check.py's parity rows (the engine, eager, and with speculative decoding),
    through Triton's interpreter at tiny sizes: each matches transformers."""
    gpu_check = import_gpu_check(monkeypatch)
    report = gpu_check.Report()
    gpu_check.parity(report, torch.device("cpu"), str(tmp_path), smoke=True)
    assert [(r["value"], r["ok"]) for r in report.rows] == [("4/4 prompts identical", True)] * 3
    assert "guesses kept" in report.rows[2]["item"]


def test_the_gpu_checks_kin_rows_on_the_cpu(tmp_path, monkeypatch):
    """scripts/gpu_check.py's parity rows of Gemma 2 and Gemma 3 (windows, capped scores, their
    own rotary), SmolLM3 (a layer without rotary), Granite (its multipliers), Phi-4-mini (a
    partial rotary), OLMo 2 (its norms) and OLMo 3 (its windows), and a tiny Qwen2's AWQ and GPTQ
    checkpoints, through Triton's interpreter at tiny sizes: each matches transformers."""
    gpu_check = import_gpu_check(monkeypatch)
    report = gpu_check.Report()
    gpu_check.kin_parity(report, torch.device("cpu"), str(tmp_path), smoke=True)
    assert [(r["value"], r["ok"]) for r in report.rows] == [("4/4 prompts identical", True)] * 9
    assert "GPTQ" in report.rows[-1]["item"]


def test_gemma3s_windows_in_mixed_and_graph_buffer_steps_on_the_triton_path(model_dirs):
    """Gemma 3 (windows with their own rotary base, q/k norms) through the kernels, in mixed
    steps and graph-buffer decode steps padded past the batch, on prompts longer than the
    window: transformers' tokens."""
    arch = "gemma3"
    llm = triton_llm(model_dirs[arch], max_num_batched_tokens=24)
    runner = llm.engine_core.model_runner
    runner.graphs = runner.make_decode_graphs()
    replays = []
    original = runner.graphs.replay
    runner.graphs.replay = lambda ids, *rest: replays.append(len(ids)) or original(ids, *rest)
    check_parity(llm, model_dirs[arch], num_prompts=4, new_tokens=6)
    assert replays
