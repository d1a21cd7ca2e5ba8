"""Config: keyword routing, model directory checks, limits, sizes, dtypes, architectures."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from streamserve import LLM
from streamserve.config import CacheConfig, Config, DeviceConfig, ModelConfig, SchedulerConfig, parse_size


def write_config(path, **changes) -> str:
    """A directory holding only config.json (enough for ModelConfig): the tiny Llama's,
    with `changes` applied (a value of None deletes the key)."""
    os.makedirs(path, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 384,
           "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
           "dtype": "float32"}
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    return str(path)


@pytest.fixture
def model_dir(tmp_path) -> str:
    return write_config(tmp_path / "model")


# -- routing ------------------------------------------------------------------------


def test_from_kwargs_routes_each_field_to_its_part(model_dir):
    cfg = Config.from_kwargs(model=model_dir, dtype="bfloat16", max_model_len=100, seed=7,
                             block_size=32, enable_prefix_caching=False, kv_cache_memory="1GiB",
                             num_gpu_blocks_override=12, max_num_seqs=8, max_num_batched_tokens=64,
                             device="cpu")
    assert isinstance(cfg.model, ModelConfig) and isinstance(cfg.cache, CacheConfig)
    assert isinstance(cfg.scheduler, SchedulerConfig) and isinstance(cfg.device, DeviceConfig)
    assert (cfg.model.model, cfg.model.dtype, cfg.model.max_model_len, cfg.model.seed) == \
        (model_dir, "bfloat16", 100, 7)
    assert cfg.model.torch_dtype == torch.bfloat16
    assert cfg.model.tokenizer == model_dir  # defaults to the model's directory
    assert (cfg.cache.block_size, cfg.cache.enable_prefix_caching, cfg.cache.num_gpu_blocks_override) == \
        (32, False, 12)
    assert cfg.cache.kv_cache_bytes() == 1024**3
    assert (cfg.scheduler.max_num_seqs, cfg.scheduler.max_num_batched_tokens) == (8, 64)
    assert cfg.device.device == "cpu" and cfg.device.torch_device == torch.device("cpu")


def test_from_kwargs_defaults(model_dir):
    cfg = Config.from_kwargs(model=model_dir)
    assert cfg.model.max_model_len == 512  # the model's max_position_embeddings
    assert cfg.model.seed == 0 and cfg.model.dtype == "auto"
    assert cfg.cache.block_size == 16 and cfg.cache.enable_prefix_caching
    assert cfg.scheduler.max_num_seqs == 256
    assert cfg.device.device in ("cpu", "cuda")
    assert cfg.scheduler.max_num_batched_tokens == {"cpu": 256, "cuda": 2048}[cfg.device.device]


def test_the_step_budget_defaults_by_device(model_dir):
    """256 tokens on the CPU (a step there of 2048 prompt tokens holds every stream for
    seconds), 2048 on CUDA; a given budget is kept."""
    assert Config.from_kwargs(model=model_dir, device="cpu").scheduler.max_num_batched_tokens == 256
    assert Config.from_kwargs(model=model_dir, device="cpu",
                              max_num_batched_tokens=4096).scheduler.max_num_batched_tokens == 4096
    scheduler = SchedulerConfig()
    scheduler.resolve("cuda:1")
    assert scheduler.max_num_batched_tokens == 2048


def test_every_field_is_a_keyword_of_one_part():
    names = [f.name for fields in Config.part_fields().values() for f in fields]
    assert len(names) == len(set(names))
    assert {"model", "gguf_file", "tokenizer", "chat_template", "dtype", "quantization", "cpu_weights", "max_model_len", "seed", "block_size",
            "enable_prefix_caching", "kv_cache_memory", "gpu_memory_utilization",
            "num_gpu_blocks_override", "kv_cache_dtype", "max_num_seqs", "scheduling_policy",
            "max_num_batched_tokens", "speculative_config", "async_scheduling", "device", "kernel_backend",
            "enforce_eager", "load_format", "generation_config", "override_generation_config", "hf_overrides",
            "host", "port", "served_model_name", "api_key", "max_n", "max_choices", "max_request_bytes",
            "sse_keepalive_seconds", "allowed_origins", "shutdown_timeout", "responses_memory",
            "tool_call_parser", "reasoning_parser", "disable_log_stats", "enable_lora", "lora_modules", "max_loras",
            "max_lora_rank", "max_cpu_loras"} == set(names)
    # The values read from the checkpoint are not settings.
    assert "hf_config" not in names and "torch_dtype" not in names and "sampling_defaults" not in names


def test_lora_settings_are_checked(model_dir):
    with pytest.raises(ValueError, match="--enable-lora"):
        Config.from_kwargs(model=model_dir, lora_modules=["a=/x"])
    with pytest.raises(TypeError, match="lora_modules must be a list of strings"):
        Config.from_kwargs(model=model_dir, enable_lora=True, lora_modules="a=/x")
    with pytest.raises(ValueError, match="max_loras"):
        Config.from_kwargs(model=model_dir, max_loras=0)
    assert Config.from_kwargs(model=model_dir, enable_lora=True, lora_modules=["a=/x"]).lora.lora_modules == ["a=/x"]


def test_unknown_keyword_is_a_type_error_naming_it(model_dir):
    with pytest.raises(TypeError, match="'max_num_sequences'"):
        Config.from_kwargs(model=model_dir, max_num_sequences=4)
    with pytest.raises(TypeError, match="'hf_config'"):
        Config.from_kwargs(model=model_dir, hf_config={})


def test_llm_passes_unknown_keywords_on_as_type_error(model_dir):
    with pytest.raises(TypeError, match="'tensor_parallel'"):
        LLM(model_dir, tensor_parallel=2)


# -- the model directory ---------------------------------------------------------------


def test_model_that_is_not_a_directory(tmp_path):
    missing = str(tmp_path / "does-not-exist")
    with pytest.raises(ValueError, match="is neither a local directory, a .gguf file nor a hub ID") as info:
        Config.from_kwargs(model=missing)
    assert missing in str(info.value) and "smollm2-135m-instruct" in str(info.value)
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"x")
    with pytest.raises(ValueError, match="is a file but not a .gguf file"):
        Config.from_kwargs(model=str(a_file))


def test_directory_without_config_json(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has neither config.json nor a .gguf file"):
        Config.from_kwargs(model=str(tmp_path / "empty"))


def test_user_home_is_expanded(tmp_path, monkeypatch):
    write_config(tmp_path / "home" / "m")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = Config.from_kwargs(model="~/m")
    assert cfg.model.model == str(tmp_path / "home" / "m")


# -- max_model_len --------------------------------------------------------------------------


def test_max_model_len_above_the_model_context(model_dir):
    assert Config.from_kwargs(model=model_dir, max_model_len=512).model.max_model_len == 512
    with pytest.raises(ValueError, match=r"max_model_len \(513\).*context length \(512\)"):
        Config.from_kwargs(model=model_dir, max_model_len=513)
    with pytest.raises(ValueError, match="max_model_len"):
        Config.from_kwargs(model=model_dir, max_model_len=0)


def test_a_sliding_window_does_not_cap_the_context(tmp_path):
    """Its layers attend within the window past it (they used to attend fully, so the window capped
    max_model_len)."""
    on = write_config(tmp_path / "on", sliding_window=256)
    assert Config.from_kwargs(model=on).model.max_model_len == 512


@pytest.mark.parametrize("config, windows", [
    ({"sliding_window": 256}, (256, 256, 256, 256)),  # Mistral's, Phi-3's: every layer
    ({"sliding_window": None}, ()),
    ({"sliding_window": 256, "use_sliding_window": False}, ()),
    ({"sliding_window": 256, "max_window_layers": 2}, ()),  # Qwen2's, without use_sliding_window
    ({"sliding_window": 256, "max_window_layers": 2, "use_sliding_window": True}, (0, 0, 256, 256)),
    ({"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"] * 2}, (8, 0, 8, 0)),
    ({"sliding_window": 8, "layer_types": ["full_attention"] * 4}, ()),
    ({"sliding_window": 8, "sliding_window_pattern": 2}, (8, 0, 8, 0)),  # Gemma 3's older configs
])
def test_each_layers_sliding_window_as_transformers_reads_it(config, windows):
    from streamserve.models.llama import sliding_windows

    assert sliding_windows({"num_hidden_layers": 4, **config}, 0) == windows


def test_which_architectures_read_the_sliding_window():
    """As transformers: Mistral's layers (and Phi-3's, Gemma 2's and 3's; Qwen2's where
    use_sliding_window) attend within config.json's sliding_window; Llama's ignore it."""
    from streamserve.models.registry import build_model

    cfg = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "vocab_size": 100, "sliding_window": 32}
    with torch.device("meta"):
        assert build_model({**cfg, "architectures": ["MistralForCausalLM"]}).arch.layer_windows == (32, 32)
        assert build_model({**cfg, "architectures": ["LlamaForCausalLM"]}).arch.layer_windows == ()
        # Qwen2's only with use_sliding_window (Qwen2Config's default is off)
        assert build_model({**cfg, "architectures": ["Qwen2ForCausalLM"]}).arch.layer_windows == ()
        qwen = {**cfg, "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True}
        assert build_model(qwen).arch.layer_windows == (32, 32)


def test_gemmas_window_patterns_without_layer_types():
    from streamserve.models.llama import sliding_windows

    cfg = {"num_hidden_layers": 7, "sliding_window": 16}
    assert sliding_windows(cfg, 2) == (16, 0, 16, 0, 16, 0, 16)  # Gemma 2: every other layer full
    assert sliding_windows(cfg, 6) == (16, 16, 16, 16, 16, 0, 16)  # Gemma 3: every sixth
    with pytest.raises(ValueError, match="layer_types names 2 layers, the model has 7"):
        sliding_windows({**cfg, "layer_types": ["full_attention"] * 2}, 0)


def test_smollm3s_layers_without_rotary_and_granites_multipliers_as_transformers_reads_them():
    """SmolLM3: no_rope_layers flags the layers that rotate, else every fourth does not (its
    config's no_rope_layer_interval); with use_sliding_window and no layer_types, those are the
    windowed ones. Granite: its four multipliers, 1 where unset; other architectures read none."""
    from transformers import SmolLM3Config

    from streamserve.models.registry import build_model

    cfg = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4,
           "vocab_size": 100}
    smol = {**cfg, "architectures": ["SmolLM3ForCausalLM"]}
    with torch.device("meta"):
        arch = build_model(smol).arch
        assert arch.rotary_layers == (True, True, True, False) * 2 and not arch.rotates(3) and arch.rotates(4)
        assert arch.rotary_layers == tuple(map(bool, SmolLM3Config(**cfg).no_rope_layers))
        assert build_model({**smol, "no_rope_layers": [1] * 8}).arch.rotary_layers == ()
        assert build_model({**smol, "no_rope_layer_interval": 2}).arch.rotary_layers == (True, False) * 4
        windowed = {**smol, "use_sliding_window": True, "sliding_window": 32}
        expected = SmolLM3Config(**{k: v for k, v in windowed.items() if k != "architectures"})
        assert build_model(windowed).arch.layer_windows == tuple(
            32 if t == "sliding_attention" else 0 for t in expected.layer_types) == (0, 0, 0, 32) * 2
        with pytest.raises(ValueError, match="no_rope_layers names 2 layers, the model has 8"):
            build_model({**smol, "no_rope_layers": [1, 0]})
        assert build_model({**cfg, "architectures": ["LlamaForCausalLM"], "no_rope_layers": [0] * 8}
                           ).arch.rotary_layers == ()

        granite = {**cfg, "architectures": ["GraniteForCausalLM"], "embedding_multiplier": 12.0,
                   "attention_multiplier": 0.015625, "residual_multiplier": 0.22, "logits_scaling": 8.0}
        arch = build_model(granite).arch
        assert (arch.embed_scale, arch.scale, arch.residual_scale, arch.logits_scaling) == (12.0, 0.015625, 0.22, 8.0)
        arch = build_model({**cfg, "architectures": ["GraniteForCausalLM"]}).arch
        assert (arch.embed_scale, arch.scale, arch.residual_scale, arch.logits_scaling) == (1.0, 1.0, 1.0, 1.0)
        arch = build_model({**granite, "architectures": ["LlamaForCausalLM"]}).arch
        assert (arch.embed_scale, arch.scale, arch.residual_scale, arch.logits_scaling) == (1.0, 0.25, 1.0, 1.0)


# -- cache settings ------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 8, 16, 32, 128])
def test_block_size_powers_of_two_are_fine(model_dir, size):
    assert Config.from_kwargs(model=model_dir, block_size=size).cache.block_size == size


@pytest.mark.parametrize("size", [0, -16, 3, 24, 48, 100])
def test_block_size_must_be_a_power_of_two(model_dir, size):
    with pytest.raises(ValueError, match=rf"block_size \({size}\) must be a power of two"):
        Config.from_kwargs(model=model_dir, block_size=size)


@pytest.mark.parametrize("value", [0.0, -0.1, 1.01, 2.0])
def test_gpu_memory_utilization_out_of_range(model_dir, value):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        Config.from_kwargs(model=model_dir, gpu_memory_utilization=value)


@pytest.mark.parametrize("value", [0.05, 0.5, 1.0])
def test_gpu_memory_utilization_in_range(model_dir, value):
    assert Config.from_kwargs(model=model_dir, gpu_memory_utilization=value).cache.gpu_memory_utilization == value


def test_scheduler_limits_must_be_positive(model_dir):
    with pytest.raises(ValueError, match="max_num_seqs"):
        Config.from_kwargs(model=model_dir, max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Config.from_kwargs(model=model_dir, max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="num_gpu_blocks_override"):
        Config.from_kwargs(model=model_dir, num_gpu_blocks_override=0)
    with pytest.raises(ValueError, match=r"responses_memory \(-1\) must be a size >= 0"):
        Config.from_kwargs(model=model_dir, responses_memory="-1")
    with pytest.raises(ValueError, match="as a size in bytes"):
        Config.from_kwargs(model=model_dir, responses_memory="lots")
    assert Config.from_kwargs(model=model_dir, responses_memory="0").server.responses_memory == "0"
    with pytest.raises(ValueError, match=r"shutdown_timeout \(-1.0\) must be >= 0"):
        Config.from_kwargs(model=model_dir, shutdown_timeout=-1.0)


@pytest.mark.parametrize("text, expected", [
    ("4GiB", 4 * 1024**3),
    ("4 GiB", 4 * 1024**3),
    ("4gib", 4 * 1024**3),
    ("4Gi", 4 * 1024**3),
    ("512MiB", 512 * 1024**2),
    ("512MB", 512 * 1000**2),
    ("512M", 512 * 1000**2),
    ("1.5GiB", int(1.5 * 1024**3)),
    ("64KiB", 64 * 1024),
    ("2TB", 2 * 1000**4),
    ("100B", 100),
    ("2000000000", 2_000_000_000),
    ("1e9", 10**9),
    (123456, 123456),
    (4 * 1024**3, 4 * 1024**3),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["lots", "4XB", "GiB", "", "4 G i B"])
def test_parse_size_rejects_nonsense(text):
    with pytest.raises(ValueError, match="as a size in bytes"):
        parse_size(text)


def test_kv_cache_memory_setting(model_dir):
    cfg = Config.from_kwargs(model=model_dir, kv_cache_memory="4GiB")
    assert cfg.cache.kv_cache_bytes() == 4 * 1024**3
    cfg = Config.from_kwargs(model=model_dir, kv_cache_memory="512MB")
    assert cfg.cache.kv_cache_bytes() == 512 * 1000**2
    cfg = Config.from_kwargs(model=model_dir, kv_cache_memory=1 << 20)
    assert cfg.cache.kv_cache_bytes() == 1 << 20
    # Unset: a quarter of free RAM, between 64 MiB and 4 GiB.
    default = Config.from_kwargs(model=model_dir).cache.kv_cache_bytes()
    assert 64 * 1024**2 <= default <= 4 * 1024**3
    for bad in (0, "0MiB", -5, "-5"):
        with pytest.raises(ValueError, match="kv_cache_memory"):
            Config.from_kwargs(model=model_dir, kv_cache_memory=bad)
    with pytest.raises(ValueError, match="as a size in bytes"):
        Config.from_kwargs(model=model_dir, kv_cache_memory="plenty")


def test_kv_cache_dtype_setting(model_dir):
    assert Config.from_kwargs(model=model_dir).cache.kv_cache_dtype == "auto"
    assert Config.from_kwargs(model=model_dir, kv_cache_dtype="float16").cache.kv_cache_dtype == "float16"
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8' must be auto, float32 or float16"):
        Config.from_kwargs(model=model_dir, kv_cache_dtype="fp8")


def test_cpu_weights_setting(model_dir):
    from streamserve.cli import build_parser

    assert Config.from_kwargs(model=model_dir).model.cpu_weights == "auto"
    assert Config.from_kwargs(model=model_dir, cpu_weights="quantized").model.cpu_weights == "quantized"
    with pytest.raises(ValueError, match="cpu_weights 'int4' must be auto, quantized or copies"):
        Config.from_kwargs(model=model_dir, cpu_weights="int4")
    assert build_parser().parse_args(["--cpu-weights", "copies"]).cpu_weights == "copies"


def test_kv_cache_smaller_than_one_sequence(llama_dir, caplog):
    """The tiny Llama's KV is 8 KiB per 16-token block: 64 KiB is 128 tokens, under its context
    of 512. Asked for 512, that is refused; left to the model, max_model_len becomes the 128 the
    cache holds (a 128k-context model on a CPU's cache starts), said in the log, and a
    128-token sequence runs."""
    from streamserve import SamplingParams

    with pytest.raises(ValueError, match="fewer than one sequence of max_model_len"):
        LLM(llama_dir, dtype="float32", kv_cache_memory="64KiB", max_model_len=512, device="cpu")
    with caplog.at_level("WARNING"):
        llm = LLM(llama_dir, dtype="float32", kv_cache_memory="64KiB", device="cpu")
    assert llm.config.model.max_model_len == 128 and llm.engine_core.model_runner.num_blocks == 8
    assert "does not fit the KV cache of 128 tokens: serving max_model_len 128" in caplog.text
    out = llm.generate([[5] * 100], SamplingParams(max_tokens=28, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 28
    with pytest.raises(ValueError, match="the prompt has 129 tokens, but max_model_len is 128"):
        llm.generate([[5] * 129], SamplingParams(max_tokens=1), use_tqdm=False)
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="64KiB", max_model_len=128, device="cpu")
    assert llm.engine_core.model_runner.num_blocks == 8


# -- dtype -------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
@pytest.mark.parametrize("name, expected", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                            ("float16", torch.float16)])
def test_auto_dtype_is_the_checkpoint_dtype(tmp_path, key, name, expected):
    other = "torch_dtype" if key == "dtype" else "dtype"
    path = write_config(tmp_path / "m", **{key: name, other: None})
    assert Config.from_kwargs(model=path).model.torch_dtype == expected
    assert Config.from_kwargs(model=path, dtype="auto").model.torch_dtype == expected


def test_auto_dtype_without_one_in_the_checkpoint_is_float32(tmp_path):
    path = write_config(tmp_path / "m", dtype=None)
    assert Config.from_kwargs(model=path).model.torch_dtype == torch.float32


@pytest.mark.parametrize("name, expected", [("float32", torch.float32), ("float", torch.float32),
                                            ("float16", torch.float16), ("half", torch.float16),
                                            ("bfloat16", torch.bfloat16)])
def test_explicit_dtype_overrides_the_checkpoint(tmp_path, name, expected):
    path = write_config(tmp_path / "m", dtype="bfloat16")
    assert Config.from_kwargs(model=path, dtype=name).model.torch_dtype == expected


@pytest.mark.parametrize("name", ["float64", "fp8", "int8", "bf16", ""])
def test_bad_dtype_names_fail(model_dir, name):
    with pytest.raises(ValueError, match=rf"dtype '{name}' is not one of auto"):
        Config.from_kwargs(model=model_dir, dtype=name)


# -- device -----------------------------------------------------------------------------------


def test_device_values(model_dir):
    assert Config.from_kwargs(model=model_dir, device="cpu").device.torch_device.type == "cpu"
    auto = Config.from_kwargs(model=model_dir, device="auto").device.device
    assert auto == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="device 'tpu'"):
        Config.from_kwargs(model=model_dir, device="tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_a_value_error(model_dir):
    with pytest.raises(ValueError, match="no CUDA device"):
        Config.from_kwargs(model=model_dir, device="cuda")


# -- architectures -------------------------------------------------------------------------------


def _copy_with_architectures(src: str, dst: str, architectures) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    if architectures is None:
        cfg.pop("architectures", None)
    else:
        cfg["architectures"] = architectures
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    return dst


def test_unsupported_architecture_lists_the_supported_ones(llama_dir, tmp_path):
    path = _copy_with_architectures(llama_dir, str(tmp_path / "gpt2"), ["GPT2LMHeadModel"])
    with pytest.raises(ValueError) as info:
        LLM(path, dtype="float32", kv_cache_memory="32MiB", device="cpu")
    message = str(info.value)
    assert "GPT2LMHeadModel" in message and "not supported" in message
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in message


def test_missing_architectures_is_a_clear_error(llama_dir, tmp_path):
    path = _copy_with_architectures(llama_dir, str(tmp_path / "none"), None)
    with pytest.raises(ValueError, match=r"\(none given\).*LlamaForCausalLM"):
        LLM(path, dtype="float32", kv_cache_memory="32MiB", device="cpu")


def test_a_supported_name_later_in_the_list_is_used(llama_dir, tmp_path):
    path = _copy_with_architectures(llama_dir, str(tmp_path / "both"),
                                    ["SomethingElse", "LlamaForCausalLM"])
    llm = LLM(path, dtype="float32", kv_cache_memory="32MiB", device="cpu")
    assert llm.engine_core.vocab_size == 384



def test_kernel_backend_defaults_and_checks(monkeypatch):
    cpu = DeviceConfig(device="cpu")
    assert cpu.kernel_backend == "torch" and not cpu.use_cuda_graphs
    with pytest.raises(ValueError, match="must be auto, torch or triton"):
        DeviceConfig(device="cpu", kernel_backend="cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        DeviceConfig(device="cpu", kernel_backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert DeviceConfig(device="cpu", kernel_backend="triton", enforce_eager=True).kernel_backend == "triton"


def test_keywords_of_the_wrong_type_are_named(model_dir):
    """LLM(...) keywords arrive unchecked by argparse: a wrong type is a TypeError naming the
    setting, not one from deep inside a comparison; a torch dtype is taken as vLLM takes it."""
    for kwargs, message in [({"block_size": "16"}, "block_size must be int, got '16'"),
                            ({"max_num_seqs": None}, "max_num_seqs must be int"),
                            ({"seed": None}, "seed must be int"), ({"device": None}, "device must be str"),
                            ({"kv_cache_memory": 1.5}, "kv_cache_memory must be str or int or None")]:
        with pytest.raises(TypeError, match=message):
            Config.from_kwargs(model=model_dir, **kwargs)
    assert Config.from_kwargs(model=model_dir, dtype=torch.float32).model.dtype == "float32"
    assert Config.from_kwargs(model=model_dir, kv_cache_memory=1 << 20, gpu_memory_utilization=1).cache
