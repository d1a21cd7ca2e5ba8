"""The model's generation_config.json gives the sampling defaults of requests that leave them
unset (vLLM's --generation-config auto), overridden by --override-generation-config, off with
--generation-config vllm."""

from __future__ import annotations

import json
import os
import shutil
import urllib.request

import openai
import pytest
from live_server import serve_in_thread

from streamserve import LLM, SamplingParams
from streamserve.config import Config


def _tokens(url: str, messages: list) -> int:
    request = urllib.request.Request(url + "/tokenize", json.dumps({"messages": messages}).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())["count"]


@pytest.fixture(scope="module")
def greedy_model(llama_dir, tmp_path_factory) -> str:
    """The tiny model, its generation config asking for top_k 1 (greedy whatever the
    temperature) and 20 new tokens."""
    path = str(tmp_path_factory.mktemp("genconfig") / "llama")
    shutil.copytree(llama_dir, path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": 2, "do_sample": True, "temperature": 1.0, "top_k": 1, "max_new_tokens": 20}, f)
    return path


def test_the_settings_read_and_check_the_defaults(greedy_model, tmp_path):
    config = lambda **kw: Config.from_kwargs(model=greedy_model, **kw).model.sampling_defaults  # noqa: E731
    assert config() == {"temperature": 1.0, "top_k": 1, "max_tokens": 20}
    assert config(generation_config="vllm") == {}
    assert config(override_generation_config={"top_p": 0.5, "top_k": 3}) == {
        "temperature": 1.0, "top_k": 3, "max_tokens": 20, "top_p": 0.5}
    assert config(generation_config="vllm", override_generation_config={"min_p": 0.1}) == {"min_p": 0.1}
    os.makedirs(tmp_path / "other")
    with open(tmp_path / "other" / "generation_config.json", "w") as f:
        json.dump({"repetition_penalty": 1.1}, f)
    assert config(generation_config=str(tmp_path / "other")) == {"repetition_penalty": 1.1}
    for kw, message in [({"generation_config": str(tmp_path)}, "neither auto, vllm nor"),
                        ({"override_generation_config": {"beams": 2}}, "'beams' not among"),
                        ({"override_generation_config": {"temperature": -1}}, "temperature")]:
        with pytest.raises(ValueError, match=message):
            config(**kw)
    with pytest.raises(TypeError, match="override_generation_config must be dict"):
        config(override_generation_config="{}")


def test_llm_generate_without_params_takes_the_models_defaults(greedy_model):
    llm = LLM(greedy_model, dtype="float32", kv_cache_memory="16MiB")
    assert llm.get_default_sampling_params().top_k == 1
    default, = llm.generate("hello world", use_tqdm=False)
    greedy, = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert default.outputs[0].token_ids == greedy.outputs[0].token_ids
    assert len(default.outputs[0].token_ids) == 20 or default.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("setting", ["auto", "vllm"])
def test_a_request_that_leaves_them_unset_gets_them(greedy_model, setting):
    for live in serve_in_thread(greedy_model, generation_config=setting):
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        body = dict(model=live.model_name, prompt="hello world", n=3)
        extra = {"ignore_eos": True}
        texts = {c.text for c in client.completions.create(max_tokens=16, extra_body=extra, **body).choices}
        if setting == "auto":  # top_k 1: three samples alike, the greedy reply
            greedy = client.completions.create(max_tokens=16, temperature=0, extra_body=extra, **body).choices[0].text
            assert texts == {greedy}
            chat = client.chat.completions.create(model=live.model_name, messages=[{"role": "user", "content": "hi"}],
                                                  extra_body={"ignore_eos": True})
            assert chat.usage.completion_tokens == 20  # max_new_tokens, where the chat gives none
            # it caps what a request gives, and a completions' default (16) stays (the least of them, as in vLLM)
            capped = client.completions.create(model=live.model_name, prompt="hi", max_tokens=50, extra_body=extra)
            assert capped.usage.completion_tokens == 20
            assert client.completions.create(model=live.model_name, prompt="hi", extra_body=extra).usage.completion_tokens == 16
            # a long chat is cut to the room it leaves, not refused
            for k in range(100, 200):  # a chat of 493-510 tokens: room for fewer than 20
                messages = [{"role": "user", "content": "word " * k}]
                if 493 <= _tokens(live.url, messages) <= 510:
                    break
            long = client.chat.completions.create(model=live.model_name, extra_body=extra, messages=messages)
            assert 0 < long.usage.completion_tokens < 20 and long.choices[0].finish_reason == "length"
            response = client.responses.create(model=live.model_name, input="hi")
            assert (response.temperature, response.max_output_tokens) == (1.0, 20)
            # a field the request gives wins over the default
            free = client.completions.create(max_tokens=16, extra_body={**extra, "top_k": -1}, **body)
            assert len({c.text for c in free.choices}) == 3
        else:
            assert len(texts) == 3
