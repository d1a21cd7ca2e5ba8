"""GGUF as a model source: a tiny random Llama written to GGUF here (with llama.cpp's Q/K
permutation and quantized tensors), loaded by streamserve and by transformers."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from streamserve import LLM, SamplingParams
from streamserve.models.gguf_convert import reverse_permute

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

# Hugging Face tensor name piece -> llama.cpp's, and the type each is stored as.
_NAMES = {"self_attn.q_proj": ("attn_q", Q.Q8_0), "self_attn.k_proj": ("attn_k", Q.F16),
          "self_attn.v_proj": ("attn_v", Q.Q4_0), "self_attn.o_proj": ("attn_output", Q.Q4_1),
          "mlp.gate_proj": ("ffn_gate", Q.BF16), "mlp.up_proj": ("ffn_up", Q.Q8_0),
          "mlp.down_proj": ("ffn_down", Q.F32), "input_layernorm": ("attn_norm", Q.F32),
          "post_attention_layernorm": ("ffn_norm", Q.F32)}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: interleave the two rotary halves of each head's rows."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def every_matrix(qtype) -> dict:
    """_NAMES with every layer matrix stored as `qtype` (the norms stay F32)."""
    return {piece: (cpp, Q.F32 if "norm" in piece else qtype) for piece, (cpp, _) in _NAMES.items()}


def write_gguf(hf_dir: str, path: str, types: dict = _NAMES, embedding=Q.F32, arch: str = "llama",
               sliding_window: int = 0) -> None:
    """As llama.cpp's convert_hf_to_gguf.py writes `arch` ("llama", "qwen2": with its biases,
    no q/k permutation and no vocab_size key; "phi3", its q/k/v and gate/up fused; "gemma",
    "gemma2", "gemma3": the norms stored as 1 + w, the head size and Gemma 2's caps written;
    "granite", Llama's with its four multipliers written; "smollm3", Llama's)."""
    from safetensors.numpy import load_file
    from transformers import AutoTokenizer

    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    tensors = load_file(os.path.join(hf_dir, "model.safetensors"))
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    rope = cfg.get("rope_parameters") or {}
    writer.add_rope_freq_base(cfg.get("rope_theta") or (rope.get("full_attention") or rope)["rope_theta"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    writer.add_rope_dimension_count(int(head_dim * cfg.get("partial_rotary_factor", 1.0)))
    if arch.startswith("gemma"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if arch == "granite":
        writer.add_embedding_scale(cfg["embedding_multiplier"])
        writer.add_residual_scale(cfg["residual_multiplier"])
        writer.add_attention_scale(cfg["attention_multiplier"])
        writer.add_logit_scale(cfg["logits_scaling"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if (cfg.get("rope_scaling") or rope).get("rope_type") == "llama3":  # llama.cpp's rope_freqs
        writer.add_tensor("rope_freqs.weight", llama_cpp_rope_freqs(cfg.get("rope_scaling") or rope, head_dim,
                                                                    rope.get("rope_theta") or cfg.get("rope_theta")))
    if rope.get("rope_type") == "longrope":  # as llama.cpp's converter writes Phi-3.5's and Phi-4-mini's
        original = cfg["original_max_position_embeddings"]
        scale = cfg["max_position_embeddings"] / original
        writer.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(scale) / np.log(original))))
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    if rope.get("rope_type") == "yarn":  # as llama.cpp's converter writes Qwen's
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if arch == "llama":
        writer.add_vocab_size(cfg["vocab_size"])
    if sliding_window:
        writer.add_sliding_window(sliding_window)
    tok = AutoTokenizer.from_pretrained(hf_dir)
    vocab = json.loads(tok.backend_tokenizer.to_str())["model"]
    tokens = sorted(vocab["vocab"], key=vocab["vocab"].get)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), cfg["vocab_size"])]  # the embedding's rows
    specials = set(tok.all_special_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default" if arch == "llama" else arch)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in vocab["merges"]])
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_pad_token_id(tok.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tok.chat_template)
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    add(writer, "token_embd.weight", tensors["model.embed_tokens.weight"], embedding)
    shift = 1.0 if arch.startswith("gemma") else 0.0  # llama.cpp stores Gemma's norms as 1 + w
    writer.add_tensor("output_norm.weight", tensors["model.norm.weight"] + shift)
    if not cfg.get("tie_word_embeddings"):
        add(writer, "output.weight", tensors["lm_head.weight"], Q.Q8_0)
    for i in range(cfg["num_hidden_layers"]):
        for hf_piece, (cpp_piece, qtype) in types.items():
            w = tensors[f"model.layers.{i}.{hf_piece}.weight"].astype(np.float32)
            if cpp_piece == "attn_q" and arch in _PERMUTED:
                w = permute(w, heads)
            elif cpp_piece == "attn_k" and arch in _PERMUTED:
                w = permute(w, kv_heads)
            elif "norm" in cpp_piece:
                w = w + shift
            add(writer, f"blk.{i}.{cpp_piece}.weight", w, qtype)
            if f"model.layers.{i}.{hf_piece}.bias" in tensors:
                writer.add_tensor(f"blk.{i}.{cpp_piece}.bias", tensors[f"model.layers.{i}.{hf_piece}.bias"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def llama_cpp_rope_freqs(rope: dict, head_dim: int, theta: float) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter writes as rope_freqs for Llama 3's scaling."""
    import math

    factor, low, high = rope["factor"], rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old = rope.get("original_max_position_embeddings", 8192)
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


_PERMUTED = ("llama", "granite", "smollm3")  # llama.cpp's converter permutes these Q/K rows (its LlamaModel's)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """[rows, k] float32 -> Q4_K blocks [rows, k / 256 * 144] (the gguf package writes no
    K-quants): per sub-block of 32, its range over 15 steps, the steps and minima as 6-bit
    multiples of the block's float16 d and dmin."""
    rows, k = w.shape
    sub = w.reshape(rows, k // 256, 8, 32).astype(np.float32)
    low, high = np.minimum(sub.min(-1), 0), sub.max(-1)
    step, minimum = (high - low) / 15, -low
    d = np.maximum(step.max(-1, keepdims=True) / 63, 1e-4).astype(np.float16)
    dmin = np.maximum(minimum.max(-1, keepdims=True) / 63, 1e-4).astype(np.float16)
    sc = np.clip(np.round(step / d.astype(np.float32)), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(minimum / dmin.astype(np.float32)), 0, 63).astype(np.uint8)
    scale = (d.astype(np.float32) * sc)[..., None]
    q = np.clip(np.round((sub + (dmin.astype(np.float32) * mn)[..., None]) / scale), 0, 15).astype(np.uint8)
    packed = np.empty((rows, k // 256, 12), np.uint8)  # as llama.cpp's get_scale_min_k4 reads them
    packed[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    packed[..., 4:8] = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:] & 0xF) | ((mn[..., 4:] & 0xF) << 4)
    pairs = q.reshape(rows, k // 256, 4, 2, 32)  # sub-blocks 2j, 2j + 1: low and high nibbles
    qs = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).reshape(rows, k // 256, 128)
    blocks = np.concatenate([d.view(np.uint8).reshape(rows, -1, 2), dmin.view(np.uint8).reshape(rows, -1, 2),
                             packed, qs], axis=-1)
    return blocks.reshape(rows, -1)


def add(writer, name: str, w: np.ndarray, qtype) -> None:
    w = w.astype(np.float32)
    if qtype == Q.F16:
        writer.add_tensor(name, w.astype(np.float16))
    elif qtype == Q.F32:
        writer.add_tensor(name, w)
    elif qtype == Q.Q4_K:
        writer.add_tensor(name, quantize_q4_k(w), raw_dtype=qtype)
    else:
        writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)


def tiny_gguf(root, hidden_size: int = 64, intermediate_size: int = 128, **kwargs) -> str:
    from tiny_models import build_model

    hf_dir = build_model(str(root / "hf"), "llama", seed=7, tie_word_embeddings=True,
                         rope_scaling=None, hidden_size=hidden_size, intermediate_size=intermediate_size)
    path = str(root / "tiny-llama.gguf")
    write_gguf(hf_dir, path, **kwargs)
    return path


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory) -> str:
    return tiny_gguf(tmp_path_factory.mktemp("gguf"))


@pytest.fixture(scope="module")
def q4_1_path(tmp_path_factory) -> str:
    # as the default model (SmolLM2-135M-Instruct.Q4_1.gguf) is stored: Q4_1 layers, a Q8_0 embedding
    return tiny_gguf(tmp_path_factory.mktemp("gguf-q4_1"), types=every_matrix(Q.Q4_1), embedding=Q.Q8_0)


@pytest.fixture(scope="module")
def q4_k_path(tmp_path_factory) -> str:  # K-quants need rows of a multiple of 256 weights
    return tiny_gguf(tmp_path_factory.mktemp("gguf-q4_k"), hidden_size=256, intermediate_size=512,
                     types=every_matrix(Q.Q4_K), embedding=Q.Q4_K)


def test_q4_k_writer_round_trips():
    w = np.random.default_rng(0).standard_normal((3, 512)).astype(np.float32)
    back = gguf.quants.dequantize(quantize_q4_k(w), Q.Q4_K).reshape(w.shape)
    assert np.abs(back - w).max() < 0.2 * np.abs(w).max()  # 4 bits: within a step or so


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STREAMSERVE_CACHE", str(tmp_path / "cache"))


def test_reverse_permute_undoes_llama_cpp():
    w = np.arange(8 * 6 * 3, dtype=np.float32).reshape(8 * 3, 6)
    assert np.array_equal(reverse_permute(permute(w, 3), 3), w)


def greedy_against_transformers(path: str, llm: LLM) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(path)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    prompts = ["The quick brown fox", "Paris is the capital of", "hello world", "def add(a, b):"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                           use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        ids = tok(prompt, return_tensors="pt").input_ids
        assert output.prompt_token_ids == ids[0].tolist()
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                          pad_token_id=tok.pad_token_id)[0, ids.shape[1]:].tolist()
        assert output.outputs[0].token_ids == ref


def test_greedy_tokens_match_transformers_on_the_same_gguf(gguf_path):
    greedy_against_transformers(gguf_path, LLM(gguf_path, dtype="float32", kv_cache_memory="16MiB"))


@pytest.mark.parametrize("kinds,enforce_eager", [(("q4_1", "q8_0"), False), (("q4_1", "q8_0"), True),
                                                 (("q4_k", "q4_k"), False)])  # the one-call C step, and op by op
def test_small_steps_read_the_quantized_blocks(kinds, enforce_eager, request):
    from streamserve.models import cpu_kernels
    from streamserve.models.layers import Linear

    if cpu_kernels.load() is None:
        pytest.skip("the CPU kernels do not build here")
    path = request.getfixturevalue(f"{kinds[0]}_path")
    # one sequence at a time: every decode step is a single token, which reads the blocks
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB", enforce_eager=enforce_eager, max_num_seqs=1)
    runner = llm.engine_core.model_runner
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert {(m.quantized.kind if m.quantized else None) for m in linears if m is not runner.model.lm_head} == {kinds[0]}
    assert runner.model.lm_head.quantized.kind == kinds[1]  # the tied embedding's blocks
    assert (runner.c_step is None) == enforce_eager
    greedy_against_transformers(path, llm)


def test_directory_plus_file_name_and_chat_template(gguf_path):
    folder, name = os.path.split(gguf_path)
    llm = LLM(folder, gguf_file=name, dtype="float32", kv_cache_memory="16MiB")
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    text = llm.get_tokenizer().decode(out.prompt_token_ids)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_conversion_happens_once(gguf_path):
    from streamserve.models.resolve import resolve_model

    first = resolve_model(gguf_path, None, torch.float32)
    stamp = os.path.getmtime(os.path.join(first, "model.safetensors"))
    assert resolve_model(gguf_path, None, torch.float32) == first
    assert os.path.getmtime(os.path.join(first, "model.safetensors")) == stamp
    config = json.load(open(os.path.join(first, "config.json")))
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]
    bf16 = resolve_model(gguf_path, None, torch.bfloat16)
    assert bf16 != first and json.load(open(os.path.join(bf16, "config.json")))["torch_dtype"] == "bfloat16"


def test_conversion_keeps_the_blocks_as_they_are(gguf_path):
    """The Q4_0 / Q4_1 / Q8_0 matrices' blocks, byte for byte, beside the dequantized weights
    (which they decode to), with the Q/K permutation undone; F16 / BF16 / F32 tensors have none."""
    from safetensors.torch import load_file

    from streamserve.models.quantized import read_quantized
    from streamserve.models.resolve import resolve_model

    folder = resolve_model(gguf_path, None, torch.float32)
    blocks, weights = read_quantized(folder), load_file(os.path.join(folder, "model.safetensors"))
    kinds = {name.split(".", 3)[3]: w.kind for name, w in blocks.items() if name.startswith("model.layers.0.")}
    assert kinds == {"self_attn.q_proj.weight": "q8_0", "self_attn.v_proj.weight": "q4_0",
                     "self_attn.o_proj.weight": "q4_1", "mlp.up_proj.weight": "q8_0"}
    for name, w in blocks.items():
        assert torch.equal(w.dequantize(), weights[name]), name


def test_two_processes_converting_at_once_leave_one_whole_conversion(gguf_path, tmp_path):
    """Each writes its own directory and moves it into place (they once shared one '.partial'
    directory and removed each other's work, leaving no weights behind a complete marker)."""
    import subprocess
    import sys

    # Each, its conversion half written (before the weights), waits until the other's is too.
    script = """if True:
        import os, sys, time, torch
        import safetensors.torch
        from streamserve.models.resolve import resolve_model
        save, barrier = safetensors.torch.save_file, sys.argv[2]

        def wait_then_save(*args, **kwargs):
            if not os.path.exists(os.path.join(barrier, str(os.getpid()))):
                open(os.path.join(barrier, str(os.getpid())), "w").close()
                deadline = time.time() + 120
                while len(os.listdir(barrier)) < 2 and time.time() < deadline:
                    time.sleep(0.01)
            return save(*args, **kwargs)

        safetensors.torch.save_file = wait_then_save
        print(resolve_model(sys.argv[1], None, torch.float32))
    """
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    env = {**os.environ, "STREAMSERVE_CACHE": str(tmp_path / "shared")}
    procs = [subprocess.Popen([sys.executable, "-c", script, gguf_path, str(barrier)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert len(os.listdir(barrier)) == 2  # both converted: neither found the other's conversion done
    folder = outs[0][0].strip()
    assert outs[1][0].strip() == folder
    assert {"config.json", "model.safetensors"} <= set(os.listdir(folder))
    assert [d for d in os.listdir(os.path.dirname(folder)) if ".partial" in d] == []
    LLM(folder, dtype="float32", kv_cache_memory="16MiB")  # it loads


def test_a_conversion_removes_what_killed_ones_left(gguf_path, tmp_path):
    from streamserve.models.gguf_convert import convert_gguf

    out = tmp_path / "model"
    dead, running = tmp_path / "model.partial-999999999-abcd", tmp_path / f"model.partial-{os.getpid()}-ef01"
    for d in (dead, running, tmp_path / "model.partial"):
        d.mkdir()
    convert_gguf(gguf_path, str(out), torch.float32)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", running.name]


def test_a_qwen2_gguf_as_llama_cpp_writes_it_matches_transformers(tmp_path):
    """llama.cpp writes no qwen2.vocab_size: the embedding's rows give it (the conversion
    wrote "vocab_size": null, and loading failed); biases, no q/k un-permutation."""
    from parity import check_parity
    from tiny_models import build_model

    hf_dir = build_model(str(tmp_path / "qwen2"), "qwen2", seed=3, tie_word_embeddings=True)
    path = str(tmp_path / "qwen2.gguf")
    write_gguf(hf_dir, path, every_matrix(Q.F32), arch="qwen2")
    check_parity(LLM(path, dtype="float32", kv_cache_memory="16MiB"), hf_dir, num_prompts=3, new_tokens=8)


def test_a_gguf_with_yarn_scaling_matches_transformers(tmp_path):
    """llama.cpp's YaRN keys (rope.scaling.type yarn, its factor and original context) read back
    as the checkpoint's rope_scaling: the stretched context and transformers' tokens."""
    from parity import check_parity
    from streamserve.models.gguf_convert import hf_config
    from tiny_models import build_model

    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}
    hf_dir = build_model(str(tmp_path / "qwen2"), "qwen2", seed=3, max_position_embeddings=32, rope_parameters=rope,
                         tie_word_embeddings=True)
    path = str(tmp_path / "qwen2.gguf")
    write_gguf(hf_dir, path, every_matrix(Q.F32), arch="qwen2")
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB")
    assert llm.config.model.max_model_len == 128
    check_parity(llm, hf_dir, num_prompts=4, new_tokens=8)
    meta = {"general.architecture": "qwen2", "qwen2.attention.head_count": 4, "qwen2.embedding_length": 64,
            "qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0, "qwen2.context_length": 512,
            "qwen2.rope.scaling.attn_factor": 0.5, "qwen2.rope.scaling.yarn_beta_fast": 16.0}
    assert hf_config(meta, tied=True, dtype=torch.float32, vocab_size=100)["rope_scaling"] == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "beta_fast": 16.0,
        "attention_factor": pytest.approx(0.5 * (0.1 * np.log(4.0) + 1))}
    assert hf_config({**meta, "qwen2.rope.scaling.yarn_attn_factor": 1.25}, tied=True, dtype=torch.float32,
                     vocab_size=100)["rope_scaling"]["attention_factor"] == 1.25
    with pytest.raises(ValueError, match="yarn_log_multiplier"):
        hf_config({**meta, "qwen2.rope.scaling.yarn_log_multiplier": 0.1}, tied=True, dtype=torch.float32)


def test_a_phi3_gguf_with_its_fused_tensors_matches_transformers(tmp_path):
    """llama.cpp's phi3 GGUF keeps q/k/v in one attn_qkv and gate/up in one ffn_up (gate
    first): read into the fused parameters, their blocks kept for small steps as they are;
    its layers attend within its sliding window, which does not cap the context."""
    from streamserve.models.layers import Linear
    from tiny_models import build_model

    hf_dir = build_model(str(tmp_path / "phi3"), "phi3", seed=5)
    path = str(tmp_path / "phi3.gguf")
    types = {"self_attn.qkv_proj": ("attn_qkv", Q.Q8_0), "self_attn.o_proj": ("attn_output", Q.Q4_1),
             "mlp.gate_up_proj": ("ffn_up", Q.Q4_1), "mlp.down_proj": ("ffn_down", Q.Q8_0),
             "input_layernorm": ("attn_norm", Q.F32), "post_attention_layernorm": ("ffn_norm", Q.F32)}
    write_gguf(hf_dir, path, types, arch="phi3", sliding_window=256)
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB", max_num_seqs=1)
    runner = llm.engine_core.model_runner
    assert llm.engine_core.config.model.max_model_len == 512 and runner.windows == [256]
    kept = {name: m.quantized.kind for name, m in runner.model.named_modules()
            if isinstance(m, Linear) and m.quantized is not None}
    if runner.c_kernels is not None:
        assert kept["layers.0.self_attn.qkv_proj"] == "q8_0" and kept["layers.1.mlp.gate_up_proj"] == "q4_1"
    greedy_against_transformers(path, llm)


def test_a_llama3_gguf_with_rope_freqs_matches_transformers(tmp_path):
    """Llama 3.1's and 3.2's GGUFs keep their rotary scaling as llama.cpp's rope_freqs (a divisor
    per frequency), not as keys: read back as the rope_scaling that gives them (they were
    refused): the tiny Llama's (factor 8 over 64 positions), greedy tokens and logprobs as
    transformers'; Llama 3.1-8B's and 3.2-1B's exactly; divisors no Llama 3 scaling gives, refused."""
    from parity import check_parity
    from streamserve.models.gguf_convert import llama3_scaling
    from tiny_models import build_model

    hf_dir = build_model(str(tmp_path / "llama"), "llama", seed=7)
    path = str(tmp_path / "llama.gguf")
    write_gguf(hf_dir, path, every_matrix(Q.F32))
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB")
    rope = json.load(open(os.path.join(llm.config.model.model, "config.json")))["rope_scaling"]
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0
    check_parity(llm, hf_dir, num_prompts=5, new_tokens=12)
    for factor in (8.0, 32.0):  # Llama 3.1's, Llama 3.2's
        shipped = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}
        for head_dim in (64, 128):
            assert llama3_scaling(llama_cpp_rope_freqs(shipped, head_dim, 500000.0).tolist(), 500000.0,
                                  head_dim) == shipped
    assert llama3_scaling([1.0] * 32, 500000.0, 64) is None
    for bad in ([1.0, 3.0, 1.0, 8.0] * 8, [0.5] * 32, [1.0] * 16 + [0.25] * 16):  # (divisors under 1 too)
        with pytest.raises(ValueError, match="no Llama 3 rope scaling"):
            llama3_scaling(bad, 500000.0, 64)
    with pytest.raises(ValueError, match="rope_freqs hold 24 factors, its heads of 64 turn 32"):
        llama3_scaling([1.0] * 24, 500000.0, 64)


def test_a_phi4_mini_gguf_with_longrope_and_a_partial_rotary_matches_transformers(tmp_path):
    """llama.cpp's phi3 GGUF of a Phi-4-mini: rope.dimension_count under the head size (a partial
    rotary), LongRoPE's factors as rope_factors_short / rope_factors_long tensors with its
    original context and attention factor in the metadata: read back as the checkpoint's config
    (the context the original one), greedy tokens and logprobs as transformers'."""
    from parity import check_parity
    from tiny_models import build_model

    hf_dir = build_model(str(tmp_path / "phi4"), "phi4", seed=5)
    path = str(tmp_path / "phi4.gguf")
    types = {"self_attn.qkv_proj": ("attn_qkv", Q.F32), "self_attn.o_proj": ("attn_output", Q.F32),
             "mlp.gate_up_proj": ("ffn_up", Q.F32), "mlp.down_proj": ("ffn_down", Q.F32),
             "input_layernorm": ("attn_norm", Q.F32), "post_attention_layernorm": ("ffn_norm", Q.F32)}
    write_gguf(hf_dir, path, types, arch="phi3")
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB")
    converted = json.load(open(os.path.join(llm.config.model.model, "config.json")))
    shipped = json.load(open(os.path.join(hf_dir, "config.json")))["rope_parameters"]
    assert converted["partial_rotary_factor"] == 0.75 and llm.config.model.max_model_len == 128
    assert converted["rope_scaling"]["short_factor"] == pytest.approx(shipped["short_factor"])
    assert converted["rope_scaling"]["long_factor"] == pytest.approx(shipped["long_factor"])
    check_parity(llm, hf_dir, num_prompts=5, new_tokens=12)


def test_a_phi3_gguf_of_microsofts_kind_keeps_its_window_and_stops_at_its_turns_end(tmp_path):
    """Microsoft's own Phi-3 4k GGUF predates llama.cpp's sliding_window key: its 2047-token
    window is assumed (attention beyond it is what the model never saw); its EOS is
    <|endoftext|> while chat turns end with <|end|>, which generation_config.json lists as an
    EOS too. A rotary over part of each head reads as partial_rotary_factor."""
    from types import SimpleNamespace

    from streamserve.models.gguf_convert import _write_generation_config, hf_config

    meta = {"general.architecture": "phi3", "phi3.attention.head_count": 32, "phi3.embedding_length": 3072,
            "phi3.feed_forward_length": 8192, "phi3.block_count": 32, "phi3.context_length": 4096,
            "phi3.rope.dimension_count": 96, "tokenizer.ggml.eos_token_id": 32000}
    config = hf_config(meta, tied=False, dtype=torch.bfloat16, vocab_size=32064)
    assert config["sliding_window"] == 2047 and config["architectures"] == ["Phi3ForCausalLM"]
    assert hf_config({**meta, "phi3.attention.sliding_window": 262144}, False, torch.bfloat16, 32064)[
        "sliding_window"] == 262144
    assert hf_config({**meta, "phi3.rope.dimension_count": 72}, False, torch.bfloat16, 32064)[
        "partial_rotary_factor"] == 0.75
    vocab = {"<|endoftext|>": 32000, "<|assistant|>": 32001, "<|end|>": 32007, "<|user|>": 32010}
    _write_generation_config(str(tmp_path), config, meta, SimpleNamespace(get_vocab=lambda: vocab))
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {"eos_token_id": [32000, 32007]}
    (tmp_path / "generation_config.json").unlink()
    _write_generation_config(str(tmp_path), config, meta, SimpleNamespace(get_vocab=lambda: {"a": 1}))
    assert not (tmp_path / "generation_config.json").exists()  # the EOS alone: nothing to add


_GEMMA_NAMES = {"self_attn.q_proj": ("attn_q", Q.F32), "self_attn.k_proj": ("attn_k", Q.F32),
                "self_attn.v_proj": ("attn_v", Q.F32), "self_attn.o_proj": ("attn_output", Q.F32),
                "mlp.gate_proj": ("ffn_gate", Q.F32), "mlp.up_proj": ("ffn_up", Q.F32),
                "mlp.down_proj": ("ffn_down", Q.F32), "input_layernorm": ("attn_norm", Q.F32)}
_SANDWICH_NAMES = {"post_attention_layernorm": ("post_attention_norm", Q.F32),
                   "pre_feedforward_layernorm": ("ffn_norm", Q.F32),
                   "post_feedforward_layernorm": ("post_ffw_norm", Q.F32)}


@pytest.mark.parametrize("arch", ["gemma", "gemma2", "gemma3"])
def test_a_gemma_gguf_is_the_checkpoint_it_was_written_from(tmp_path, arch):
    """llama.cpp's gemma, gemma2 and gemma3 GGUFs (float32 here, so the conversion is exact):
    norms stored as 1 + w, Gemma 1's two norms a layer (ffn_norm the MLP's input norm, as
    Llama's), Gemma 2's and 3's four (ffn_norm then the second of them), q/k norms, Gemma 2's
    caps, their windows (every other layer, every sixth full) and the attention scale llama.cpp
    assumes (the head size): greedy tokens and logprobs as transformers' on the Hugging Face
    checkpoint. (Gemma 1's tokenizer comes through the fallback reader: transformers reads no
    gemma GGUF config.)"""
    from parity import check_parity
    from tiny_models import build_model

    overrides = {"gemma": {}, "gemma2": {"query_pre_attn_scalar": 16},
                 "gemma3": {"query_pre_attn_scalar": 16, "num_hidden_layers": 6, "layer_types": None,
                            "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                "full_attention": {"rope_type": "default", "rope_theta": 1e6}}}}
    hf_dir = build_model(str(tmp_path / arch), arch, seed=3, **overrides[arch])
    names = dict(_GEMMA_NAMES, **(_SANDWICH_NAMES if arch != "gemma" else
                                  {"post_attention_layernorm": ("ffn_norm", Q.F32)}))
    if arch == "gemma3":
        names.update({"self_attn.q_norm": ("attn_q_norm", Q.F32), "self_attn.k_norm": ("attn_k_norm", Q.F32)})
    path = str(tmp_path / f"{arch}.gguf")
    write_gguf(hf_dir, path, names, arch=arch, sliding_window=0 if arch == "gemma" else 16)
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB")
    converted = json.load(open(os.path.join(llm.config.model.model, "config.json")))
    assert converted["architectures"] == [{"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                                           "gemma3": "Gemma3ForCausalLM"}[arch]]
    windows = llm.engine_core.model_runner.model.arch.layer_windows
    assert windows == {"gemma": (), "gemma2": (16, 0, 16), "gemma3": (16,) * 5 + (0,)}[arch]
    check_parity(llm, hf_dir, num_prompts=5, new_tokens=12)


def test_an_olmo2_gguf_is_the_checkpoint_it_was_written_from(tmp_path):
    """llama.cpp's olmo2 GGUF: no norms before attention and the MLP, post_attention_norm and
    post_ffw_norm after them, q and k norms over all heads; Q and K not permuted; its tokenizer
    through the fallback reader (transformers reads no olmo2 GGUF config): greedy tokens and
    logprobs as transformers' on the Hugging Face checkpoint."""
    from parity import check_parity
    from tiny_models import build_model

    hf_dir = build_model(str(tmp_path / "olmo2"), "olmo2", seed=3, tie_word_embeddings=True)  # (no Q8_0 head)
    names = {piece: entry for piece, entry in every_matrix(Q.F32).items() if "layernorm" not in piece}
    names.update({"self_attn.q_norm": ("attn_q_norm", Q.F32), "self_attn.k_norm": ("attn_k_norm", Q.F32),
                  "post_attention_layernorm": ("post_attention_norm", Q.F32),
                  "post_feedforward_layernorm": ("post_ffw_norm", Q.F32)})
    path = str(tmp_path / "olmo2.gguf")
    write_gguf(hf_dir, path, names, arch="olmo2")
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB")
    converted = json.load(open(os.path.join(llm.config.model.model, "config.json")))
    assert converted["architectures"] == ["Olmo2ForCausalLM"]
    from streamserve.models.gguf_convert import hf_config  # llama.cpp writes OLMo 3 as olmo2, windowed: refused
    meta = {"general.architecture": "olmo2", "olmo2.attention.head_count": 4, "olmo2.embedding_length": 64,
            "olmo2.attention.sliding_window": 4096}
    with pytest.raises(ValueError, match="an OLMo 3"):
        hf_config(meta, tied=True, dtype=torch.float32, vocab_size=100)
    check_parity(llm, hf_dir, num_prompts=5, new_tokens=12)


@pytest.mark.parametrize("arch", ["granite", "smollm3"])
def test_granite_and_smollm3_ggufs_are_the_checkpoints_they_were_written_from(tmp_path, arch):
    """llama.cpp's granite GGUF (its multipliers as embedding_scale, residual_scale,
    attention.scale and logit_scale) and smollm3 GGUF (whose every fourth layer rotates nothing,
    which llama.cpp assumes, the file saying nothing of it), read with their tokenizer though
    transformers reads neither architecture's GGUF config: greedy tokens and logprobs as
    transformers' on the Hugging Face checkpoint."""
    from transformers import AutoTokenizer

    from parity import check_parity
    from tiny_models import build_model

    overrides = {"granite": {}, "smollm3": {"num_hidden_layers": 4, "no_rope_layers": None}}
    hf_dir = build_model(str(tmp_path / arch), arch, seed=3, **overrides[arch])
    path = str(tmp_path / f"{arch}.gguf")
    write_gguf(hf_dir, path, every_matrix(Q.F32), arch=arch)
    llm = LLM(path, dtype="float32", kv_cache_memory="16MiB")
    converted = json.load(open(os.path.join(llm.config.model.model, "config.json")))
    assert converted["architectures"] == [{"granite": "GraniteForCausalLM", "smollm3": "SmolLM3ForCausalLM"}[arch]]
    model_arch = llm.engine_core.model_runner.model.arch
    if arch == "granite":
        assert (model_arch.embed_scale, model_arch.scale, model_arch.residual_scale, model_arch.logits_scaling) == \
            pytest.approx((12.0, 0.0625, 0.22, 8.0))
    else:
        assert model_arch.rotary_layers == (True, True, True, False)
    tokenizer = llm.get_tokenizer()
    assert tokenizer.encode("The quick brown fox") == AutoTokenizer.from_pretrained(hf_dir).encode("The quick brown fox")
    check_parity(llm, hf_dir, num_prompts=5, new_tokens=12)


def test_gemma_gguf_metadata_as_llama_cpp_reads_it():
    """What a Gemma GGUF leaves unsaid, llama.cpp assumes: the scale of sqrt(head size), but
    sqrt(hidden / heads) for the 27B models (told by their layers), Gemma 2's caps of 50 and 30
    where absent, Gemma 3's windowed layers' rotary base of 10000; a per-layer window pattern
    where the file has one."""
    from streamserve.models.gguf_convert import hf_config

    def meta(arch, layers, **extra):
        return {"general.architecture": arch, f"{arch}.attention.head_count": 32, f"{arch}.embedding_length": 4608,
                f"{arch}.feed_forward_length": 36864, f"{arch}.block_count": layers,
                f"{arch}.attention.key_length": 128, f"{arch}.attention.sliding_window": 4096,
                **{f"{arch}.{k}": v for k, v in extra.items()}}

    big = hf_config(meta("gemma2", 46), tied=True, dtype=torch.bfloat16, vocab_size=256000)
    assert big["query_pre_attn_scalar"] == 144 and big["hidden_activation"] == "gelu_pytorch_tanh"
    assert (big["attn_logit_softcapping"], big["final_logit_softcapping"]) == (50.0, 30.0)
    small = hf_config(meta("gemma2", 42, attn_logit_softcapping=40.0), True, torch.bfloat16, 256000)
    assert small["query_pre_attn_scalar"] == 128 and small["attn_logit_softcapping"] == 40.0
    g3 = hf_config(meta("gemma3", 62, **{"attention.sliding_window_pattern": [True, False] * 31}), True,
                   torch.bfloat16, 262144)
    assert g3["query_pre_attn_scalar"] == 144 and g3["rope_local_base_freq"] == 10000.0
    assert g3["layer_types"][:3] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert g3["architectures"] == ["Gemma3ForCausalLM"] and g3["sliding_window"] == 4096
