"""Quantized Hugging Face checkpoints (models/quantization.py): AWQ, GPTQ, compressed-tensors and
FP8, each dequantized as its own tools dequantize it, served with transformers' tokens on those
weights, and the 4-bit and 8-bit ones read as GGUF blocks by the CPU's smallest steps."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import quantized_checkpoints as qc
from parity import check_parity
from streamserve import LLM
from streamserve.models.loader import checkpoint_names, iterate_safetensors
from streamserve.models.quantization import Dequantizer, IntWeight, checkpoint_method, unpack_int32
from tiny_models import build_model


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> str:
    """A tiny Qwen2 (biases on q, k and v) whose layers the checkpoints quantize."""
    return build_model(str(tmp_path_factory.mktemp("quant") / "qwen2"), "qwen2", seed=3)


def dequantized(path: str, keep_blocks: bool = False):
    """What the loader reads from a quantized checkpoint: plain tensors by name, and the blocks."""
    config = json.load(open(os.path.join(path, "config.json")))
    method = checkpoint_method(config, None)
    dequantize = Dequantizer(method, config["quantization_config"], checkpoint_names(path), keep_blocks)
    return dict(dequantize(iterate_safetensors(path))), dequantize.blocks


def quantized_names(tensors: dict) -> set:
    return {n for n in tensors if qc.is_quantized(n)}


# -- the layouts, against their own tools -------------------------------------------


@pytest.mark.parametrize("zero_point", [True, False])
def test_awq_reads_as_compressed_tensors_autoawq_converter_reads_it(src, tmp_path, zero_point):
    """The AutoAWQ GEMM layout (values in the order 0, 2, 4, 6, 1, 3, 5, 7 of a word), checked
    against compressed-tensors' converter of AutoAWQ checkpoints, which vLLM's project keeps."""
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    path = str(tmp_path / "awq")
    want = qc.write_awq(src, path, zero_point=zero_point)
    got, _ = dequantized(path)
    converter = AutoAWQConverter(group_size=32, zero_point=zero_point)
    tensors = converter.process(load_file(os.path.join(path, "model.safetensors")))
    converted = str(tmp_path / "converted")
    os.makedirs(converted)
    save_file(tensors, os.path.join(converted, "model.safetensors"))
    config = {"quantization_config": {"config_groups": {"group_0": {"weights": {
        "num_bits": 4, "type": "int", "symmetric": not zero_point, "strategy": "group", "group_size": 32}}}}}
    json.dump(config, open(os.path.join(converted, "config.json"), "w"))
    reference = qc.compressed_tensors_reference(converted)
    assert set(reference) == set(want) == quantized_names(got) and len(want) == 14
    for name, weight in reference.items():  # (it multiplies in the scales' float16: ours rounded so)
        assert torch.equal(got[name].half(), weight.half()), name
        assert torch.equal(got[name], want[name]), name


def test_gptq_packs_inputs_from_the_lowest_bits_and_stores_zeros_less_one():
    """One hand-made GPTQ word: inputs 0-7 of output 0 hold 0-7 from the lowest bits up; the
    zeros word holds outputs 0-7's zeros less one (v1), so output j's zero is j + 1."""
    from streamserve.models.quantization import _gptq

    word = 0x76543210
    parts = {"qweight": torch.tensor([[word] * 8], dtype=torch.int32),  # [8 inputs / 8, 8 outputs]
             "qzeros": torch.tensor([[word]], dtype=torch.int32),  # [1 group, 8 outputs / 8]
             "scales": torch.full((1, 8), 0.5, dtype=torch.float16)}
    w = _gptq(parts, {"bits": 4}).dequantize()  # [out, in]
    want = (torch.arange(8)[None, :] - (torch.arange(8)[:, None] + 1)) * 0.5
    assert torch.equal(w, want.float())
    v2 = _gptq(parts, {"bits": 4, "checkpoint_format": "gptq_v2"}).dequantize()
    assert torch.equal(v2, ((torch.arange(8)[None, :] - torch.arange(8)[:, None]) * 0.5).float())
    assert unpack_int32(torch.tensor([[0x04030201]], dtype=torch.int32), 8).tolist() == [[1, 2, 3, 4]]
    # without g_idx, the config's group size, which need not divide the inputs: 8 in groups of 3
    groups = {**parts, "qzeros": torch.tensor([[word]] * 3, dtype=torch.int32),
              "scales": torch.tensor([[0.5] * 8, [1.0] * 8, [2.0] * 8], dtype=torch.float16)}
    w3 = _gptq(groups, {"bits": 4, "group_size": 3}).dequantize()
    assert torch.equal(w3, want.float() * torch.tensor([1.0, 1, 1, 2, 2, 2, 4, 4]))


@pytest.mark.parametrize("settings", [{}, {"sym": False, "desc_act": True}, {"bits": 8}, {"sym": False, "v2": True},
                                      {"dynamic": {"+:.*mlp.down_proj": {"bits": 8}}}],
                         ids=["4bit-sym", "4bit-act-order", "8bit", "v2", "dynamic-8bit-down"])
def test_gptq_layers_read_as_written(src, tmp_path, settings):
    want = qc.write_gptq(src, str(tmp_path / "gptq"), **settings)
    got, _ = dequantized(str(tmp_path / "gptq"))
    assert set(want) == quantized_names(got) and len(want) == 14
    for name, weight in want.items():
        assert torch.equal(got[name], weight), name


def test_fp8_reads_as_transformers_dequantizes_it(src, tmp_path):
    """Qwen3's and DeepSeek's FP8 layout, against transformers' own dequantization of it (which
    it does on a machine without a GPU)."""
    from transformers import AutoModelForCausalLM

    path = str(tmp_path / "fp8")
    qc.write_fp8(src, path)
    got, blocks = dequantized(path, keep_blocks=True)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    theirs = dict(hf.named_parameters())
    assert len(quantized_names(got)) == 14 and not blocks  # (no GEMV reads float8)
    for name in quantized_names(got):
        assert torch.equal(got[name], theirs[name].float()), name


CT_SCHEMES = ["W4A16", "W4A16_ASYM", "W8A16", "W8A8", "FP8", "FP8_DYNAMIC", "FP8_BLOCK", "FP8_DYNAMIC-weights"]


@pytest.mark.parametrize("scheme", CT_SCHEMES)
def test_compressed_tensors_reads_as_it_dequantizes(src, tmp_path, scheme):
    """llm-compressor's checkpoints, written by compressed-tensors itself: pack-quantized int4
    (symmetric, and with packed zero points), int8, int-quantized W8A8, float-quantized FP8 a
    tensor, a row and a block, and FP8 weights alone (which it writes naive-quantized)."""
    path = str(tmp_path / scheme)
    qc.write_compressed_tensors(src, path, scheme.removesuffix("-weights"), weights_only=scheme.endswith("-weights"))
    if scheme.endswith("-weights"):
        assert json.load(open(os.path.join(path, "config.json")))["quantization_config"]["format"] == "naive-quantized"
    got, _ = dequantized(path)
    reference = qc.compressed_tensors_reference(path)
    assert set(reference) == quantized_names(got) and len(reference) == 14
    for name, weight in reference.items():
        assert torch.equal(got[name], weight), name
    assert not any(n.endswith(("_scale", "_zero_point", "_shape", "_packed")) for n in got)


def test_a_layer_split_across_shards_is_read_once_whole(src, tmp_path):
    """A sharded checkpoint may keep a layer's qweight in one file and its scales in another."""
    path = str(tmp_path / "awq")
    want = qc.write_awq(src, path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    os.remove(os.path.join(path, "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[1::2], "model-00002-of-00002.safetensors": names[0::2]}
    for shard, members in shards.items():
        save_file({n: tensors[n] for n in members}, os.path.join(path, shard), metadata={"format": "pt"})
    weight_map = {n: shard for shard, members in shards.items() for n in members}
    json.dump({"weight_map": weight_map}, open(os.path.join(path, "model.safetensors.index.json"), "w"))
    got, _ = dequantized(path)
    for name, weight in want.items():
        assert torch.equal(got[name], weight), name


# -- blocks ---------------------------------------------------------------------------


@pytest.mark.parametrize("bits,symmetric,kind", [(4, True, "q4_0"), (4, False, "q4_1"), (8, True, "q8_0")])
def test_int_weights_become_the_gguf_blocks_that_decode_to_them(bits, symmetric, kind):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=gen)
    q, scale, zero = qc.quantize_groups(w, bits, 64, symmetric)
    ints = IntWeight(bits, q, scale.float(), zero.to(torch.int16))
    blocks = ints.blocks()
    assert blocks.kind == kind and blocks.shape == (48, 128)
    exact = ints.dequantize()
    if kind == "q4_1":  # its minimum -zero * scale rounded to float16
        bound = (zero.float() * scale.float()).repeat_interleave(64, 1) / 2048
        assert ((blocks.dequantize() - exact).abs() <= bound).all()
    else:
        assert torch.equal(blocks.dequantize(), exact)
    # what no block holds: act-order groups, groups of 16, asymmetric 8-bit, float16's overflow
    shuffled = IntWeight(bits, q, scale.float(), zero.to(torch.int16), torch.randperm(128, generator=gen) // 64)
    assert shuffled.blocks() is None
    q16, scale16, zero16 = qc.quantize_groups(w, bits, 16, symmetric)
    assert IntWeight(bits, q16, scale16.float(), zero16.to(torch.int16)).blocks() is None
    assert IntWeight(8, q, scale.float(), zero.to(torch.int16) + 1).blocks() is None
    assert IntWeight(bits, q, scale.float() * 1e7, zero.to(torch.int16)).blocks() is None


# -- served -------------------------------------------------------------------------


def quantized_model(src: str, root, fmt: str) -> tuple[str, dict]:
    """Write `fmt`; return its path and the dequantized weights transformers runs as the oracle."""
    path = str(root / fmt)
    if fmt.startswith("ct-"):
        qc.write_compressed_tensors(src, path, fmt.removeprefix("ct-"))
        return path, qc.compressed_tensors_reference(path)
    if fmt == "fp8":
        qc.write_fp8(src, path)
        return path, {n: w for n, w in dequantized(path)[0].items() if qc.is_quantized(n)}
    writers = {"awq": lambda: qc.write_awq(src, path), "gptq": lambda: qc.write_gptq(src, path),
               "gptq-act-order": lambda: qc.write_gptq(src, path, sym=False, desc_act=True)}
    return path, writers[fmt]()


@pytest.mark.parametrize("fmt", ["awq", "gptq-act-order", "ct-W4A16_ASYM", "ct-W8A8", "ct-FP8_BLOCK", "fp8"])
def test_a_quantized_checkpoint_serves_transformers_tokens_on_its_weights(src, tmp_path, fmt, monkeypatch):
    """Greedy tokens and logprobs as transformers gives them on the dequantized weights (every
    step reading them: the blocks, whose GEMV rounds activations to int16, are the next test's)."""
    from streamserve.worker import model_runner

    for name in ("QUANT_MAX_TOKENS", "QUANT_MAX_TOKENS_SEVERAL_STREAMS", "QUANT_MAX_TOKENS_FLOAT32"):
        monkeypatch.setattr(model_runner, name, 0)
    path, weights = quantized_model(src, tmp_path, fmt)
    reference = qc.reference_dir(src, str(tmp_path / "reference"), weights)
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB", max_num_seqs=8)
    assert llm.config.model.quantization == fmt.split("-")[0].replace("ct", "compressed-tensors")
    check_parity(llm, reference, num_prompts=6, new_tokens=12)


@pytest.mark.parametrize("fmt,kind,enforce_eager", [("awq", "q4_1", False), ("gptq", "q4_0", False),
                                                    ("ct-W8A8", "q8_0", False), ("awq", "q4_1", True)])
def test_small_steps_read_a_quantized_checkpoints_blocks(src, tmp_path, fmt, kind, enforce_eager):
    from streamserve.models import cpu_kernels
    from streamserve.models.layers import Linear

    if cpu_kernels.load() is None:
        pytest.skip("the CPU kernels do not build here")
    path, weights = quantized_model(src, tmp_path, fmt)
    reference = qc.reference_dir(src, str(tmp_path / "reference"), weights)
    # one sequence at a time: every decode step is a single token, which reads the blocks
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB", enforce_eager=enforce_eager, max_num_seqs=1)
    runner = llm.engine_core.model_runner
    linears = {name: m for name, m in runner.model.named_modules() if isinstance(m, Linear)}
    assert {(m.quantized.kind if m.quantized else None) for name, m in linears.items() if name != "lm_head"} == {kind}
    assert linears["lm_head"].quantized is None and not runner.model.checkpoint_blocks
    assert (runner.c_step is None) == enforce_eager
    # the same tokens; logprobs within what the GEMV's int16 activations (and Q4_1's float16
    # minimum) move them by
    check_parity(llm, reference, num_prompts=3, new_tokens=12, logprob_tol=1e-2)


# -- refusals -----------------------------------------------------------------------


@pytest.mark.parametrize("quantization_config,message", [
    ({"quant_method": "bitsandbytes"}, "'bitsandbytes' is not supported"),
    ({"quant_method": "awq", "version": "gemv", "bits": 4}, "version 'gemv'"),
    ({"quant_method": "gptq", "bits": 3}, "this one has 3"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"format": "nvfp4-pack-quantized", "weights": {
        "num_bits": 4, "type": "float"}}}}, "format 'nvfp4-pack-quantized' (group 'g') is not read"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {"weights": {
        "num_bits": 2, "type": "int"}}}}, "int weights of 2 bits"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "this one is 'e5m2'"),
    ({"quant_method": "gptq", "bits": 4, "dynamic": {"+:.*down_proj": {"bits": 2}}}, "this one has 2"),
    ({"quant_method": "gptq", "bits": 4, "is_marlin_format": True}, "Marlin's layout"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}, "sparsity_config": {
        "format": "sparse-24-bitmask", "targets": ["Linear"]}}, "sparse checkpoints are not read"),
])
def test_what_cannot_be_read_is_refused_up_front(src, tmp_path, quantization_config, message):
    path = str(tmp_path / "bad")
    qc._copy_model_files(src, path, quantization_config)
    with pytest.raises(ValueError) as err:
        LLM(path, dtype="float32", kv_cache_memory="16MiB")
    assert message in str(err.value)


def test_the_quantization_setting_names_the_checkpoints_method(src, tmp_path):
    """vLLM's --quantization: its kernels' names (awq_marlin) name the same checkpoints, gguf a
    GGUF file's; a method the checkpoint is not quantized with is refused, by the name asked
    for, as is asking to quantize a plain one."""
    from streamserve.config import ModelConfig

    path = str(tmp_path / "awq")
    qc.write_awq(src, path)
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB", quantization="awq_marlin")
    assert llm.config.model.quantization == "awq"
    with pytest.raises(ValueError, match="'gptq_marlin' was asked for, but the checkpoint is quantized with 'awq'"):
        LLM(path, dtype="float32", kv_cache_memory="16MiB", quantization="gptq_marlin")
    with pytest.raises(ValueError, match="'fp8' was asked for, but the checkpoint is not quantized"):
        LLM(src, dtype="float32", kv_cache_memory="16MiB", quantization="fp8")
    with pytest.raises(ValueError, match="'gguf' was asked for, but the checkpoint is not quantized"):
        ModelConfig(model=src, quantization="gguf")
    assert ModelConfig(quantization="gguf").quantization is None  # (the default model is a GGUF file)
    with pytest.raises(ValueError, match="'awq' was asked for, but the checkpoint is a GGUF file's"):
        ModelConfig(quantization="awq")


def test_a_layer_missing_a_part_is_named(src, tmp_path):
    path = str(tmp_path / "gptq")
    qc.write_gptq(src, path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.scales"]
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"cannot read the quantized layer 'model.layers.1.mlp.up_proj'"):
        LLM(path, dtype="float32", kv_cache_memory="16MiB")


@pytest.mark.parametrize("fmt", ["awq", "ct-W8A8", "gptq-act-order", "fp8"])
def test_a_checkpoints_layers_may_hold_their_blocks_alone(src, tmp_path, monkeypatch, fmt):
    """--cpu-weights quantized: a checkpoint's layers whose weights become blocks (AWQ's Q4_1,
    W8A8's Q8_0) hold those alone and are never dequantized into weights; the tokens are those of
    --cpu-weights copies (whose prefill reads the exact weights' bfloat16 copies). Layers without blocks (GPTQ with act-order's shuffled groups, FP8) read
    their weights as before."""
    from parity import assert_same_greedy, tokens_and_logprobs
    from streamserve import SamplingParams
    from streamserve.models import cpu_kernels

    if cpu_kernels.load() is None:
        pytest.skip("the CPU kernels do not build here")
    path, _ = quantized_model(src, tmp_path, fmt)
    prompts, params = [list(range(3, 30)), [5, 6, 7]], SamplingParams(temperature=0, max_tokens=5, logprobs=0)
    args = dict(dtype="bfloat16", kv_cache_memory="16MiB")
    expected = [tokens_and_logprobs(o) for o in LLM(path, cpu_weights="copies", **args).generate(prompts, params)]
    dequantized_layers, dequantize = [], IntWeight.dequantize
    monkeypatch.setattr(IntWeight, "dequantize", lambda self: dequantized_layers.append(1) or dequantize(self))
    llm = LLM(path, cpu_weights="quantized", **args)
    runner = llm.engine_core.model_runner
    alone = {n for n, m in runner.model.named_modules() if getattr(m, "only_quantized", False)}
    if fmt in ("awq", "ct-W8A8"):
        assert runner.quantized_only and not dequantized_layers
        assert alone == runner.unread_layers and len(alone) == 4 * runner.model.arch.num_layers
    else:
        assert not runner.quantized_only and not alone and not runner.model.unread_weights
    # (within what the blocks' float16 scales and Q4_1's minimum, -zero * scale rounded to float16,
    # each within 2^-11 of the checkpoint's, move the prefill's logprobs on this tiny random model)
    assert_same_greedy(llm.generate(prompts, params, use_tqdm=False), expected, logprob_tol=3e-2)


def test_an_8bit_checkpoints_blocks_serve_steps_of_two_tokens_beside_bfloat16_copies(src, tmp_path):
    """Q8_0's blocks save half of bfloat16's bytes: beside bfloat16 copies they pay at one or two
    tokens only (model_runner._keep_quantized), where 4-bit blocks serve steps of up to a few."""
    from streamserve.models import cpu_kernels

    if cpu_kernels.load() is None:
        pytest.skip("the CPU kernels do not build here")
    steps = {}
    for fmt in ("ct-W8A8", "awq"):
        path, _ = quantized_model(src, tmp_path, fmt)
        for dtype in ("bfloat16", "float32"):
            runner = LLM(path, dtype=dtype, kv_cache_memory="16MiB").engine_core.model_runner
            steps[fmt, dtype] = runner.quant_max_tokens
    assert steps["ct-W8A8", "bfloat16"] == 2 and steps["awq", "bfloat16"] in (3, 4)
    assert steps["ct-W8A8", "float32"] == steps["awq", "float32"] == 8


def test_what_published_checkpoints_add_is_read_past(src, tmp_path):
    """compressed-tensors' earlier key (compression_config), a dense model's sparsity note, a
    group of activations only, its KV cache scales (k_scale, v_scale, the earlier kv_scale: the
    cache is kept in the model's dtype here); GPTQ writers' zero biases on layers that have none
    (vLLM skips them too). A bias that is not zero has no place, and is refused."""
    path = str(tmp_path / "ct")
    qc.write_compressed_tensors(src, path, "W4A16")
    config = json.load(open(os.path.join(path, "config.json")))
    config["compression_config"] = config.pop("quantization_config")
    # llm-compressor's note of a dense model's sparsity, and a group of the attention's activations
    config["compression_config"]["sparsity_config"] = {"format": "dense", "global_sparsity": 12.5, "targets": [],
                                                       "sparsity_structure": "unstructured", "ignore": []}
    config["compression_config"]["config_groups"]["group_1"] = {
        "targets": ["LlamaAttention"], "weights": None, "input_activations": {"num_bits": 8, "type": "float"}}
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    tensors = load_file(os.path.join(path, "model.safetensors"))
    for layer in range(2):
        for name in ("k_scale", "v_scale", "kv_scale"):
            tensors[f"model.layers.{layer}.self_attn.{name}"] = torch.tensor(0.05)
        tensors[f"model.layers.{layer}.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    reference = qc.reference_dir(src, str(tmp_path / "reference"), qc.compressed_tensors_reference(path))
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB")
    assert llm.config.model.quantization == "compressed-tensors"
    check_parity(llm, reference, num_prompts=2, new_tokens=8, logprob_tol=1e-2)
    tensors["model.layers.1.self_attn.o_proj.bias"][3] = 0.5
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="'layers.1.self_attn.o_proj.bias' has no place in the model"):
        LLM(path, dtype="float32", kv_cache_memory="16MiB")


def test_a_lora_adapter_on_a_quantized_checkpoint(src, tmp_path, monkeypatch):
    """vLLM serves LoRA adapters over AWQ and GPTQ models: an adapter of the original model on its
    AWQ checkpoint gives transformers' tokens on the dequantized weights with the adapter merged;
    and one sequence at a time, each decode step reading the blocks with the adapter added, each
    token's logprob is transformers' for that token (teacher-forced: the blocks' int16
    activations may tip a near tie)."""
    from transformers import AutoModelForCausalLM

    from lora_adapters import build_adapter, merge_adapter
    from parity import assert_same_greedy, hf_reference, parity_prompts, tokens_and_logprobs
    from streamserve import LoRARequest, SamplingParams
    from streamserve.worker import model_runner

    path, weights = quantized_model(src, tmp_path, "awq")
    reference = qc.reference_dir(src, str(tmp_path / "reference"), weights)
    adapter = build_adapter(str(tmp_path / "adapter"), src, rank=8, seed=1)
    merged = merge_adapter(reference, adapter, str(tmp_path / "merged"))
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    prompts = [p for p in parity_prompts()[:3]]
    lora = LoRARequest("a", 1, adapter)

    def run(**kwargs):
        llm = LLM(path, dtype="float32", kv_cache_memory="16MiB", enable_lora=True, **kwargs)
        return llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False, lora_request=lora)

    with monkeypatch.context() as patch:  # the dequantized weights only
        for name in ("QUANT_MAX_TOKENS", "QUANT_MAX_TOKENS_SEVERAL_STREAMS", "QUANT_MAX_TOKENS_FLOAT32"):
            patch.setattr(model_runner, name, 0)
        assert_same_greedy(run(), hf_reference(merged, 3, 12))
    hf = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, run(max_num_seqs=1)):
        tokens, logprobs = tokens_and_logprobs(output)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert (want - torch.tensor(logprobs)).abs().max() < 1e-2
