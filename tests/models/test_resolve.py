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
