"""The real oracle: greedy tokens and logprobs identical to transformers, per architecture,
also when the prompt is read in chunks and when the KV pool forces preemption."""

from __future__ import annotations

import pytest

from streamserve import LLM
from parity import check_parity
from tiny_models import ARCHS


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_parity(model_dirs, arch):
    llm = LLM(model_dirs[arch], dtype="float32", kv_cache_memory="32MiB")
    check_parity(llm, model_dirs[arch])
    # The shared prefixes were served from the prefix cache.
    assert llm.engine_core.scheduler.kv_cache_manager.block_pool.prefix_cache_hits > 0
    assert llm.engine_core.scheduler.kv_cache_manager.num_free_blocks == llm.engine_core.model_runner.num_blocks


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_parity_with_chunked_prefill(model_dirs, arch):
    llm = LLM(model_dirs[arch], dtype="float32", kv_cache_memory="32MiB", max_num_batched_tokens=24)
    check_parity(llm, model_dirs[arch])


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_parity_with_preemption(model_dirs, arch):
    # 10 blocks of 16 tokens, while the 9 requests want about 40 blocks at their longest.
    llm = LLM(model_dirs[arch], dtype="float32", max_model_len=128, num_gpu_blocks_override=10)
    check_parity(llm, model_dirs[arch])
    scheduler = llm.engine_core.scheduler
    assert scheduler.num_preemptions > 0
    assert scheduler.kv_cache_manager.num_free_blocks == 10


def prompt_logprobs_from_transformers(model_dir: str, prompt: list[int], top: int):
    """transformers' float32 logprob of each prompt token after the first, and its top `top`."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        raw = model(torch.tensor([prompt])).logits[0, :-1].log_softmax(-1)
    chosen = raw.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    return chosen.tolist(), raw.topk(top, dim=-1).indices.tolist()


@pytest.mark.parametrize("settings", [{}, {"max_num_batched_tokens": 24},  # whole, or in chunks of a step
                                      {"max_model_len": 128, "num_gpu_blocks_override": 8}],  # preempted
                         ids=["whole", "chunked", "preempted"])
def test_prompt_logprobs_are_transformers(model_dirs, settings, monkeypatch):
    """prompt_logprobs (vLLM's): None, then each prompt token's logprob given those before it,
    with the top N, as transformers scores them; the same for a prompt read in chunks, one
    whose blocks are in the prefix cache (its positions are computed again), n=2 (one sample
    scores it), and a request preempted midway."""
    from streamserve import SamplingParams

    from streamserve.worker import model_runner

    monkeypatch.setattr(model_runner, "PROMPT_LOGPROBS_ROWS", 16)  # the head over a few slices
    llm = LLM(model_dirs["llama"], dtype="float32", kv_cache_memory="32MiB", **settings)
    prompt = [3 + (i * 37) % 300 for i in range(60)]
    want, want_top = prompt_logprobs_from_transformers(model_dirs["llama"], prompt, 3)
    others = [{"prompt_token_ids": [5 + (i * 11 + j) % 200 for j in range(40)]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3, n=2, ignore_eos=True)
    plain = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for _ in range(2):  # the second time its blocks are cached
        outputs = llm.generate([{"prompt_token_ids": prompt}] + others, [params] + [plain] * 4, use_tqdm=False)
        got = outputs[0].prompt_logprobs
        assert got[0] is None and len(got) == len(prompt)
        for entry, token, logprob, top in zip(got[1:], prompt[1:], want, want_top):
            first = next(iter(entry))
            assert first == token and abs(entry[token].logprob - logprob) < 1e-4
            assert set(top) <= set(entry)
        assert all(o.prompt_logprobs is None for o in outputs[1:])
    kv = llm.engine_core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    if "num_gpu_blocks_override" in settings:
        assert llm.engine_core.scheduler.num_preemptions > 0


@pytest.mark.parametrize("arch, setting", [("llama", "attention_bias"), ("llama", "mlp_bias"),
                                           ("qwen3", "attention_bias")])
def test_biases_as_transformers_places_them(tmp_path, arch, setting):
    """attention_bias puts a bias on o_proj too (Llama, Qwen3; Qwen2's covers q, k, v only);
    Llama's mlp_bias on gate, up and down: the checkpoint's biases, random, all read."""
    from tiny_models import build_model

    path = build_model(str(tmp_path / arch), arch, **{setting: True})
    check_parity(LLM(path, dtype="float32", kv_cache_memory="32MiB"), path, num_prompts=3, new_tokens=8)


def test_a_gelu_gated_llama_runs_and_other_activations_are_refused(tmp_path):
    """hidden_act as transformers reads it: Llama's MLP gated by GELU runs (as Gemma's is), an
    activation no path computes is refused by name."""
    from tiny_models import build_model

    path = build_model(str(tmp_path / "gelu"), "llama", hidden_act="gelu")
    check_parity(LLM(path, dtype="float32", kv_cache_memory="32MiB"), path, num_prompts=3, new_tokens=8)
    path = build_model(str(tmp_path / "relu"), "llama", hidden_act="relu")
    with pytest.raises(ValueError, match="hidden_act 'relu' is not supported"):
        LLM(path, dtype="float32", kv_cache_memory="32MiB")


@pytest.mark.parametrize("settings", [{}, {"max_num_batched_tokens": 24},
                                      {"max_model_len": 128, "num_gpu_blocks_override": 10}],
                         ids=["whole", "chunked", "preempted"])
def test_sliding_window_parity(tmp_path, settings):
    """Mistral with a window of 16 keys in every layer, on prompts and replies past it: each query
    sees only its last 16 keys, as in transformers, whether the prompt is read whole, in chunks
    or again after preemption."""
    from tiny_models import build_model

    path = build_model(str(tmp_path / "mistral"), "mistral", sliding_window=16)
    llm = LLM(path, dtype="float32", kv_cache_memory="32MiB", **settings)
    runner = llm.engine_core.model_runner
    assert runner.windows == [16]
    # the C kernels (and the one-call C step) take the windows where they load
    assert runner.cpu_attention == (runner.c_kernels is not None)
    assert (runner.c_step is not None) == (runner.c_kernels is not None)
    check_parity(llm, path)


def test_rotaries_the_kernels_do_not_compute_are_refused(tmp_path):
    """A partial rotary over an odd number of dims, a rope scaling of a kind streamserve does not
    compute ('dynamic'): refused, not run wrong; Phi-3's fused checkpoint tensors with one
    missing are named."""
    import json

    from safetensors.torch import load_file, save_file

    from tiny_models import build_model

    path = build_model(str(tmp_path / "partial"), "phi3")
    with open(path + "/config.json") as f:
        config = json.load(f)
    config["rope_parameters"]["partial_rotary_factor"] = 0.7  # 11 of 16 dims
    with open(path + "/config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="partial_rotary_factor 0.7 turns 11 of the head's 16 dims"):
        LLM(path, dtype="float32", kv_cache_memory="32MiB")
    config["rope_parameters"]["partial_rotary_factor"] = 1.0
    config["rope_scaling"] = {"type": "dynamic", "factor": 2.0}
    with open(path + "/config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="rope scaling 'dynamic' is not supported"):
        LLM(path, dtype="float32", kv_cache_memory="32MiB")
    config["rope_scaling"] = None
    with open(path + "/config.json", "w") as f:
        json.dump(config, f)
    weights = load_file(path + "/model.safetensors")
    del weights["model.layers.1.mlp.gate_up_proj.weight"]
    save_file(weights, path + "/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"checkpoint lacks 1 tensors, e.g. \['layers.1.mlp.gate_up_proj.weight'\]"):
        LLM(path, dtype="float32", kv_cache_memory="32MiB")


def test_a_tied_checkpoint_with_its_own_head_reads_that_head(tmp_path):
    """tie_word_embeddings, but the checkpoint stores an lm_head.weight of its own: read
    untied, as transformers 5 does (the embedding used to serve as the head regardless)."""
    import torch
    from safetensors.torch import load_file, save_file

    from tiny_models import build_model

    path = build_model(str(tmp_path / "tied"), "llama")  # the tiny Llama is tied
    weights = load_file(f"{path}/model.safetensors")
    weights["lm_head.weight"] = torch.randn_like(weights["model.embed_tokens.weight"])
    save_file(weights, f"{path}/model.safetensors", metadata={"format": "pt"})
    llm = LLM(path, dtype="float32", kv_cache_memory="32MiB")
    model = llm.engine_core.model_runner.model
    assert model.lm_head.weight is not model.embed_tokens.weight
    check_parity(llm, path, num_prompts=3, new_tokens=8)


def test_gemmas_norms_stay_float32_in_a_bfloat16_model(model_dirs):
    """Gemma's norms scale by 1 + w: loaded into a bfloat16 model (the GPU's), their weights are
    kept float32 with the 1 added there (1 + w in bfloat16 lost up to 4e-3 of each), so the norm
    scales in float32 and rounds once, as transformers' does; the rest is bfloat16."""
    import torch
    from safetensors.torch import load_file

    from streamserve.config import Config
    from streamserve.models.loader import load_model

    path = model_dirs["gemma3"]
    model = load_model(Config.from_kwargs(model=path).model, torch.device("cpu"), torch.bfloat16)
    stored = load_file(f"{path}/model.safetensors")
    norm = model.layers[0].pre_feedforward_layernorm.weight
    assert norm.dtype == torch.float32 and model.layers[0].self_attn.q_norm.weight.dtype == torch.float32
    assert torch.equal(norm, stored["model.layers.0.pre_feedforward_layernorm.weight"].float() + 1)
    assert model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("arch", ["gemma", "gemma2", "gemma3", "smollm3", "granite", "phi4", "olmo2", "olmo3"])
def test_steps_of_llamas_kin_run_in_one_c_call(model_dirs, arch):
    """Where the C kernels load, Gemma's, Gemma 2's, Gemma 3's, SmolLM3's, Granite's, Phi-4-mini's
    and OLMo 2's steps take the one-call C step (Gemma's GELU gate, sandwich norms, scaled
    embedding, Gemma 2's soft-capped scores, Gemma 3's windowed layers' own rotary table;
    SmolLM3's layers without rotary; Granite's scaled residual branches; Phi-4-mini's rotary over
    part of each head; OLMo 2's norms after attention and the MLP and of q and k over all heads;
    OLMo 3's windowed layers, rotated unscaled), and match transformers as the op-by-op path does."""
    llm = LLM(model_dirs[arch], dtype="float32", kv_cache_memory="32MiB", max_num_batched_tokens=24)
    runner = llm.engine_core.model_runner
    if runner.c_kernels is None:
        pytest.skip("the C kernels do not load here")
    assert runner.c_step is not None
    calls = []
    original = runner.c_step.__call__
    runner.c_step = lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)
    check_parity(llm, model_dirs[arch], num_prompts=5, new_tokens=12)
    assert calls


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "smollm3", "granite", "phi4", "olmo2", "olmo3"])
def test_llamas_kin_on_the_torch_path_without_the_c_kernels(model_dirs, monkeypatch, arch):
    """Where the C kernels do not load, the decodes' window masks (the runner's, one per window
    of the model's), the plain product of Gemma 2's capped scores, SmolLM3's unrotated layers,
    Granite's multipliers, Phi-4-mini's partial rotary, OLMo 2's norms and OLMo 3's windows match
    transformers too."""
    from streamserve.worker import model_runner

    monkeypatch.setattr(model_runner.cpu_kernels, "load", lambda: None)
    llm = LLM(model_dirs[arch], dtype="float32", kv_cache_memory="32MiB", max_num_batched_tokens=24)
    runner = llm.engine_core.model_runner
    assert runner.c_kernels is None and not runner.cpu_attention
    assert runner.windows == ([16] if arch.startswith("gemma") or arch == "olmo3" else [])
    check_parity(llm, model_dirs[arch], num_prompts=5, new_tokens=12)


@pytest.mark.parametrize("rope", [
    {"factor": 4.0, "original_max_position_embeddings": 64},  # Qwen's long-context setting
    {"factor": 2.0, "beta_fast": 16, "beta_slow": 2, "truncate": False},  # no original: max_position_embeddings
    {"factor": 8.0, "original_max_position_embeddings": 64, "mscale": 0.7, "mscale_all_dim": 1.0},  # DeepSeek's
    {"factor": 3.0, "original_max_position_embeddings": 64, "attention_factor": 1.25},
], ids=["qwen", "betas", "mscale", "attention-factor"])
def test_yarn_rope_scaling_matches_transformers(tmp_path, rope):
    """YaRN (rope_type "yarn", as Qwen's models are told to add for long contexts): the rotary
    frequencies and the factor on cos and sin as transformers computes them, so greedy tokens
    and logprobs on prompts past the original context match; the context stretches to the
    original one times the factor (vLLM's rule)."""
    import torch
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from streamserve.models.layers import rope_attention_factor, rope_inv_freq
    from tiny_models import build_model

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, **rope}
    path = build_model(str(tmp_path / "yarn"), "qwen3", seed=4, max_position_embeddings=64, rope_parameters=rope)
    llm = LLM(path, dtype="float32", kv_cache_memory="32MiB")
    assert llm.config.model.max_model_len == int(rope.get("original_max_position_embeddings", 64) * rope["factor"])
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](Qwen3Config.from_pretrained(path), "cpu")
    scaling = llm.engine_core.model_runner.model.arch.rope_scaling
    assert torch.equal(rope_inv_freq(32, 10000.0, scaling), inv_freq)
    assert rope_attention_factor(scaling) == pytest.approx(factor, rel=1e-12) and factor != 1.0
    check_parity(llm, path, num_prompts=6, new_tokens=12)


def test_hf_overrides_turn_yarn_on_over_config_json(tmp_path):
    """vLLM's hf_overrides, each key replacing config.json's: YaRN's rope_scaling beside a Qwen3's
    own rope_parameters (their rope_theta kept) runs as the checkpoint that ships them does; a
    value that is no object is refused."""
    from tiny_models import build_model

    plain = build_model(str(tmp_path / "plain"), "qwen3", seed=4, max_position_embeddings=64,
                        rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    shipped = build_model(str(tmp_path / "yarn"), "qwen3", seed=4, max_position_embeddings=64,
                          rope_parameters={**yarn, "rope_theta": 5000.0})
    llm = LLM(plain, dtype="float32", kv_cache_memory="32MiB", hf_overrides={"rope_scaling": yarn})
    assert llm.config.model.hf_config["rope_scaling"] == yarn
    assert llm.config.model.hf_config["rope_parameters"] == {"rope_type": "default", "rope_theta": 5000.0}
    assert llm.config.model.max_model_len == 256
    check_parity(llm, shipped, num_prompts=4, new_tokens=12)
    old = LLM(plain, dtype="float32", kv_cache_memory="32MiB",  # the older spelling, "type", in either place
              hf_overrides={"rope_parameters": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                                "rope_theta": 5000.0}})
    assert old.engine_core.model_runner.model.arch.rope_scaling["factor"] == 4.0
    check_parity(old, shipped, num_prompts=2, new_tokens=8)
    with pytest.raises(TypeError, match="hf_overrides must be dict"):
        LLM(plain, hf_overrides='{"max_position_embeddings": 32}')


def test_an_olmo3_config_of_one_rope_scaling_scales_its_full_layers_alone(tmp_path):
    """OLMo 3's config.json as transformers 4 wrote it: one rope_scaling (YaRN) and one rope_theta,
    which transformers applies to the full-attention layers only, the windowed ones rotating by
    the plain base: the same tokens as transformers."""
    import json

    from tiny_models import build_model

    path = build_model(str(tmp_path / "olmo3"), "olmo3")
    config = json.load(open(f"{path}/config.json"))
    rope = config.pop("rope_parameters")
    rope["full_attention"].pop("rope_theta")
    # (OLMo 3's own base: transformers 5 reads this format's rope_theta for the full layers alone, the
    # windowed ones taking Olmo3Config's default, which it is)
    config["rope_theta"] = 500000.0
    config["rope_scaling"] = {**rope["full_attention"], "factor": 8.0, "original_max_position_embeddings": 64}
    json.dump(config, open(f"{path}/config.json", "w"))
    llm = LLM(path, dtype="float32", kv_cache_memory="32MiB")
    model = llm.engine_core.model_runner.model
    assert model.arch.local_rope_theta == 500000.0 and model.arch.rope_scaling["rope_type"] == "yarn"
    assert model.arch.max_position == 512
    check_parity(llm, path, num_prompts=5, new_tokens=12)


def test_an_olmo3_config_missing_keys_takes_olmo3s_defaults():
    """Olmo3Config's defaults where config.json leaves a key out (a window of 4096 on three layers
    in four, eps 1e-5, base 500000), and model_type olmo3 under OLMo 2's architecture name (as
    vLLM's Olmo3Config rewrites it) is still OLMo 3."""
    from streamserve.models.registry import build_model as build

    config = dict(architectures=["Olmo2ForCausalLM"], model_type="olmo3", vocab_size=64, hidden_size=32,
                  intermediate_size=64, num_hidden_layers=4, num_attention_heads=2, max_position_embeddings=8192,
                  rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 1024})
    arch = build(config).arch
    assert arch.layer_windows == (4096, 4096, 4096, 0) and arch.rms_norm_eps == 1e-5
    assert arch.rope_theta == arch.local_rope_theta == 500000.0 and arch.rope_scaling["rope_type"] == "yarn"
    assert arch.post_norms and arch.qk_norm_whole
