"""LoRA adapters over HTTP: --lora-modules served as models of their own (listed in
/v1/models, named in a request's model), loaded and unloaded at run time where
VLLM_ALLOW_RUNTIME_LORA_UPDATING is true, every bad request refused with its status."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from typing import Iterator

import aiohttp
import openai
import pytest
from live_server import LiveServer, serve_in_thread
from lora_adapters import build_adapter, merge_adapter
from parity import hf_reference, parity_prompts

PROMPT = parity_prompts()[2]


@pytest.fixture(scope="module")
def adapters(model_dirs, tmp_path_factory) -> dict[str, tuple[str, str]]:
    root, model = tmp_path_factory.mktemp("lora-api"), model_dirs["llama"]
    made = {}
    for name, seed in (("sql", 1), ("poet", 2)):
        path = build_adapter(str(root / name), model, rank=4, seed=seed)
        made[name] = (path, merge_adapter(model, path, str(root / f"{name}-merged")))
    return made


@pytest.fixture(scope="module")
def server(model_dirs, adapters) -> Iterator[LiveServer]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        yield from serve_in_thread(model_dirs["llama"], served_model_name="tiny", enable_lora=True,
                                   lora_modules=[f"sql={adapters['sql'][0]}"])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def post(url: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def greedy_ids(client, model: str) -> list[int]:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0,
                                    extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    assert out.model == model
    return [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]


def test_models_lists_each_adapter_as_the_models_child(client, adapters):
    models = client.models.list().data
    assert [(m.id, m.parent) for m in models] == [("tiny", None), ("sql", "tiny")]
    assert models[1].root == adapters["sql"][0]


def test_a_request_naming_an_adapter_runs_through_it(client, model_dirs, adapters):
    assert greedy_ids(client, "sql") == hf_reference(adapters["sql"][1], 3, 8)[2][0]
    assert greedy_ids(client, "tiny") == hf_reference(model_dirs["llama"], 3, 8)[2][0]
    chat = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.model == "sql"
    chunks = list(client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, stream=True))
    assert {c.model for c in chunks} == {"sql"}
    base = client.embeddings.create(model="tiny", input="hello").data[0].embedding
    through = client.embeddings.create(model="sql", input="hello")
    assert through.model == "sql" and through.data[0].embedding != base


def test_the_responses_api_and_the_websocket_name_adapters_too(server, client, adapters):
    response = client.responses.create(model="sql", input="hi", max_output_tokens=4)
    assert response.model == "sql" and response.status in ("completed", "incomplete")

    async def over_websocket() -> list[dict]:
        async with aiohttp.ClientSession() as session, session.ws_connect(server.url + "/v1/ws") as ws:
            await ws.send_json({"type": "request", "id": "a", "endpoint": "completions", "body": {
                "model": "sql", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "logprobs": 0, "return_tokens_as_token_ids": True}})
            await ws.send_json({"type": "request", "id": "b", "endpoint": "completions",
                                "body": {"model": "nope", "prompt": "hi"}})
            frames = []
            while sum(f["type"] in ("done", "error") for f in frames) < 2:
                frames.append(await ws.receive_json(timeout=60))
            return frames
    frames = asyncio.run(over_websocket())
    tokens = [int(t.removeprefix("token_id:")) for f in frames if f["type"] == "chunk" and f["id"] == "a"
              for c in f["data"]["choices"] if c.get("logprobs") for t in c["logprobs"]["tokens"]]
    assert tokens == hf_reference(adapters["sql"][1], 3, 8)[2][0]
    error = next(f for f in frames if f["type"] == "error")
    assert error["id"] == "b" and error["error"]["type"] == "not_found_error"


def test_an_unknown_model_is_a_404_naming_the_served_ones(client):
    with pytest.raises(openai.NotFoundError, match="'tiny', 'sql'"):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)


def test_adapters_load_and_unload_at_run_time(server, client, adapters):
    load, unload = server.url + "/v1/load_lora_adapter", server.url + "/v1/unload_lora_adapter"
    path = adapters["poet"][0]
    assert post(load, {"lora_name": "poet", "lora_path": path}) == (
        200, "Success: LoRA adapter 'poet' added successfully.")
    assert [m.id for m in client.models.list().data] == ["tiny", "sql", "poet"]
    assert greedy_ids(client, "poet") == hf_reference(adapters["poet"][1], 3, 8)[2][0]
    status, text = post(load, {"lora_name": "poet", "lora_path": path})
    assert status == 400 and "already been loaded" in text
    assert post(unload, {"lora_name": "poet"}) == (200, "Success: LoRA adapter 'poet' removed successfully.")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="poet", prompt="hi", max_tokens=2)
    status, text = post(unload, {"lora_name": "poet"})
    assert status == 404 and json.loads(text)["error"]["type"] == "not_found_error"
    # what it cannot load, each a 400 that says why
    for body, why in (({"lora_name": "x", "lora_path": "/nowhere"}, "not a directory"),
                      ({"lora_name": "x"}, "lora_path"),
                      ({"lora_path": path}, "lora_name"),
                      ({"lora_name": "tiny", "lora_path": path}, "served model's name")):
        status, text = post(load, body)
        assert status == 400 and why in json.loads(text)["error"]["message"], (body, text)
    assert [m.id for m in client.models.list().data] == ["tiny", "sql"]


def test_requests_in_flight_finish_on_an_adapter_unloaded_under_them(server, client, adapters):
    path = adapters["poet"][0]
    assert post(server.url + "/v1/load_lora_adapter", {"lora_name": "poet2", "lora_path": path})[0] == 200
    core = server.engine.engine_core
    step = core.step
    core.step = lambda: time.sleep(0.02) or step()  # 24 tokens: about half a second
    try:
        stream = client.completions.create(model="poet2", prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True, "logprobs": 0,
                                                       "return_tokens_as_token_ids": True})
        chunks = iter(stream)
        first = next(chunks)
        with urllib.request.urlopen(server.url + "/metrics", timeout=30) as response:
            metrics = response.read().decode()
        assert 'lora_requests_info{max_lora="4",running_lora_adapters="poet2",waiting_lora_adapters=""}' in metrics
        assert post(server.url + "/v1/unload_lora_adapter", {"lora_name": "poet2"})[0] == 200
        rest = list(chunks)
    finally:
        core.step = step
    tokens = [int(t.removeprefix("token_id:")) for c in [first] + rest for t in (c.choices[0].logprobs.tokens
                                                                                if c.choices[0].logprobs else [])]
    assert len(rest) > 10 and rest[-1].choices[0].finish_reason == "length"
    assert tokens == hf_reference(adapters["poet"][1], 3, 24)[2][0]  # all through the adapter


def test_without_runtime_updating_the_routes_are_absent(model_dirs, adapters, monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    for live in serve_in_thread(model_dirs["llama"], enable_lora=True):
        status, _ = post(live.url + "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": adapters["sql"][0]})
        assert status == 404


def test_several_served_model_names_all_reach_the_model(model_dirs):
    """--served-model-name a b (as vLLM takes several): a request may name any, the response
    names the first; /v1/models lists each."""
    from streamserve.cli import build_parser, config_kwargs

    assert config_kwargs(build_parser().parse_args(["--served-model-name", "a", "b"]))["served_model_name"] == ["a", "b"]
    for live in serve_in_thread(model_dirs["llama"], served_model_name=["tiny", "tiny-alias"]):
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
        out = client.completions.create(model="tiny-alias", prompt="hi", max_tokens=2)
        assert out.model == "tiny"
        with pytest.raises(openai.NotFoundError, match="'tiny', 'tiny-alias'"):
            client.completions.create(model="other", prompt="hi", max_tokens=2)


def test_a_lora_module_in_json_may_name_its_base_model(model_dirs, adapters):
    """--lora-modules' JSON form, as vLLM takes it: base_model_name is the adapter's parent in
    /v1/models (the served model where it gives none); a bad entry is refused by name."""
    from streamserve.lora.request import parse_module

    path = adapters["poet"][0]
    assert parse_module(f"poet={path}") == ("poet", path, None)
    for bad in ('{"name": "x"}', '{"name": "x", "path": "/p", "base_model_name": 3}', "{oops", "x"):
        with pytest.raises(ValueError, match="lora_modules entry"):
            parse_module(bad)
    modules = [json.dumps({"name": "poet", "path": path, "base_model_name": "org/base"}), f"plain={path}"]
    for live in serve_in_thread(model_dirs["llama"], served_model_name="tiny", enable_lora=True, lora_modules=modules):
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        assert [(m.id, m.parent) for m in client.models.list().data] == [
            ("tiny", None), ("poet", "org/base"), ("plain", "tiny")]
