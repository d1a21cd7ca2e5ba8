"""The HTTP server against the official openai client and raw aiohttp requests."""

from __future__ import annotations

import json
import re
import time
import urllib.request

import openai
import pytest

from live_server import start_server
from parity import prompt_token_logprobs
from streamserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def server(model_dirs):
    proc, url = start_server(model_dirs["llama"], "--served-model-name", "tiny")
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(model_dirs):
    return LLM(model_dirs["llama"], dtype="float32", kv_cache_memory="16MiB")


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    with urllib.request.urlopen(server + "/health") as r:
        assert json.loads(r.read()) == {"status": "ok"}


def test_completion_matches_the_offline_engine(client, offline):
    result = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=12,
                                       temperature=0)
    expected = offline.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=12),
                                use_tqdm=False)[0]
    assert result.object == "text_completion" and result.model == "tiny"
    assert result.choices[0].text == expected.outputs[0].text
    assert result.choices[0].finish_reason == expected.outputs[0].finish_reason
    assert result.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert result.usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_chat_stream_equals_chat(client):
    messages = [{"role": "user", "content": "hello world"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=16,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_continuous_usage_puts_the_tokens_so_far_in_every_chunk(client, server):
    chunks = list(client.completions.create(
        model="tiny", prompt="hello world", max_tokens=8, temperature=0, stream=True, echo=True,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 8 and len(set(counts)) > 2
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}
    assert chunks[-1].choices == []
    # a batch with n: each chunk one choice, with its prompt's tokens and its own tokens so far
    prompts = ["hello world", "one two three four five six"]
    lengths = [client.completions.create(model="tiny", prompt=p, max_tokens=1).usage.prompt_tokens for p in prompts]
    chunks = list(client.completions.create(
        model="tiny", prompt=prompts, n=2, max_tokens=5, temperature=0, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    seen: dict[int, list[int]] = {}
    for c in chunks[:-1]:
        [choice] = c.choices
        assert c.usage.prompt_tokens == lengths[choice.index // 2]
        seen.setdefault(choice.index, []).append(c.usage.completion_tokens)
    assert sorted(seen) == [0, 1, 2, 3] and all(v == sorted(v) and v[-1] == 5 for v in seen.values())
    assert chunks[-1].usage.prompt_tokens == sum(lengths) and chunks[-1].usage.completion_tokens == 20
    plain = list(client.completions.create(model="tiny", prompt="hello", max_tokens=3, stream=True,
                                           stream_options={"include_usage": True}))
    assert [c.usage is None for c in plain] == [True] * (len(plain) - 1) + [False]
    status, error = post(server + "/v1/completions", {"prompt": "hi", "stream": True,
                                                      "stream_options": {"continuous_usage_stats": 1}})
    assert status == 400 and error["error"]["param"] == "stream_options"
    nulls = list(client.completions.create(model="tiny", prompt="hello", max_tokens=2, stream=True,
                                           stream_options={"include_usage": None, "continuous_usage_stats": None}))
    assert all(c.usage is None for c in nulls)  # null: the default, as vLLM takes it


def test_n_samples_and_stop(client):
    result = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10,
                                       temperature=1.0, n=2, seed=5)
    assert sorted(c.index for c in result.choices) == [0, 1]
    alone = [client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10,
                                       temperature=1.0, seed=seed).choices[0].text for seed in (5, 6)]
    assert [c.text for c in result.choices] == alone and alone[0] != alone[1]  # sample k: seed 5 + k
    greedy = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0)
    text = greedy.choices[0].text
    stop = next((text[i:i + 2] for i in range(1, len(text) - 1)
                 if text[i:i + 2].strip() and text.find(text[i:i + 2]) == i), None)
    if stop is None:
        pytest.skip("greedy text too short to pick a stop string")
    stopped = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10,
                                        temperature=0, stop=[stop])
    assert stopped.choices[0].text == text[:text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_a_batch_of_prompts_numbers_its_choices_prompt_by_prompt(client, offline):
    """A completions batch (strings and token-ID lists) with n=2: choice p * 2 + k is sample
    k of prompt p, each as the prompt alone gives it; usage counts every prompt; streamed,
    the same texts, echo per choice, each choice finishing once."""
    ids = offline.get_tokenizer().encode("A long time ago")
    prompts = ["The quick brown fox", ids, "Once"]
    kwargs = dict(model="tiny", max_tokens=6, temperature=0, n=2)
    whole = client.completions.create(prompt=prompts, **kwargs)
    alone = [client.completions.create(prompt=p, **kwargs) for p in prompts]
    assert [c.index for c in whole.choices] == list(range(6))
    assert [c.text for c in whole.choices] == [c.text for a in alone for c in a.choices]
    assert whole.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert whole.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    texts, finishes, usage = [""] * 6, [0] * 6, None
    for chunk in client.completions.create(prompt=prompts, stream=True, echo=True,
                                           stream_options={"include_usage": True}, **kwargs):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += c.text
            finishes[c.index] += c.finish_reason is not None
    echoes = ["The quick brown fox", offline.get_tokenizer().decode(ids), "Once"]
    assert texts == [echoes[i // 2] + c.text for i, c in enumerate(whole.choices)]
    assert finishes == [1] * 6 and usage.total_tokens == whole.usage.total_tokens


def test_a_bad_prompt_in_a_batch_refuses_the_batch(server):
    cases = [["hi", 5], ["hi", ""], ["hi", []], ["hi", [10 ** 6]], ["hi", "x " * 5000]]
    for prompt in cases:
        status, error = post(server + "/v1/completions", {"prompt": prompt, "max_tokens": 2})
        assert status == 400 and error["error"]["param"] in ("prompt", "max_tokens"), (prompt, error)
    status, error = post(server + "/v1/completions", {"prompt": ["hi", [10 ** 6]]})
    assert error["error"]["message"].startswith("prompt 1 of the batch: "), error
    status, error = post(server + "/v1/completions", {"prompt": ["hi"] * 65, "n": 16, "max_tokens": 1})
    assert status == 400 and error["error"]["param"] == "prompt" and "1040 choices" in error["error"]["message"]


def test_bad_requests_raise_the_clients_errors(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="hi", temperature=-1)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], top_p=0)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="other", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="exceed max_model_len"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=10_000)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="tiny", messages=[])


def test_raw_sse_framing(server):
    body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0,
                       "stream": True}).encode()
    request = urllib.request.Request(server + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as r:
        assert r.headers["Content-Type"] == "text/event-stream"
        assert r.headers["Cache-Control"] == "no-cache" and r.headers["X-Accel-Buffering"] == "no"
        raw = r.read().decode()
    frames = raw.split("\n\n")
    assert frames[-1] == "" and frames[-2] == "data: [DONE]"
    for frame in frames[:-2]:
        assert frame.startswith("data: ")
        obj = json.loads(frame[6:])
        assert obj["object"] == "text_completion" and len(obj["choices"]) == 1


def test_malformed_json_is_400(server):
    request = urllib.request.Request(server + "/v1/completions", data=b"{not json",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request)
    assert info.value.code == 400
    error = json.loads(info.value.read())["error"]
    assert set(error) == {"message", "type", "param", "code"} and "not valid JSON" in error["message"]


def test_api_key(model_dirs):
    proc, url = start_server(model_dirs["llama"], "--api-key", "sekret")
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
        assert len(good.completions.create(model=good.models.list().data[0].id, prompt="hi",
                                           max_tokens=2).choices) == 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_tokenize_and_detokenize(server, offline):
    tok = offline.get_tokenizer()
    status, result = post(server + "/tokenize", {"prompt": "hello world"})
    assert status == 200 and result["tokens"] == tok.encode("hello world") and result["count"] == len(result["tokens"])
    messages = [{"role": "user", "content": "hi"}]
    status, chat = post(server + "/tokenize", {"messages": messages})
    assert chat["tokens"] == tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)
    status, text = post(server + "/detokenize", {"tokens": result["tokens"]})
    assert status == 200 and text == {"prompt": "hello world"}
    status, error = post(server + "/detokenize", {"tokens": [10**7]})
    assert status == 400 and error["error"]["param"] == "tokens"


def test_the_errors_name_what_was_wrong(server, offline):
    """A fresh-user audit's findings: a message without content a 400 unless an assistant's (it
    ran as an empty message), a non-object response_format named as such (it said
    None), an integer beyond 64 bits (which orjson reads as a float) out of range rather than
    not an integer, a prompt too long by itself blamed on the prompt (it named max_tokens, which
    the client had not sent), the default max_tokens named as the default, --max-n named;
    /v1/models' creation time a real one (it was 0); /tokenize's return_token_strs (vLLM's)."""
    with urllib.request.urlopen(server + "/v1/models") as r:
        model = json.loads(r.read())["data"][0]
    assert time.time() - 3600 < model["created"] <= time.time()
    max_len = model["max_model_len"]
    user = [{"role": "user", "content": "x"}]
    status, error = post(server + "/v1/chat/completions", {"messages": [{"role": "user"}]})
    assert status == 400 and error["error"]["message"] == ("messages[0].content is required: a string or a "
                                                           "list of text parts")
    status, _ = post(server + "/v1/chat/completions", {"max_tokens": 1, "messages": [
        *user, {"role": "assistant", "tool_calls": [{"type": "function", "function": {
            "name": "f", "arguments": "{}"}}]}, {"role": "tool", "content": "1"}]})
    assert status == 200
    status, error = post(server + "/v1/chat/completions", {"messages": user, "response_format": "json"})
    assert status == 400 and error["error"]["param"] == "response_format"
    assert "must be an object" in error["error"]["message"]
    for field in ("max_tokens", "seed", "logprobs"):
        status, error = post(server + "/v1/completions", {"prompt": "hi", field: 10 ** 23})
        assert status == 400 and error["error"]["param"] == field
        assert "1e+23 is out of range" in error["error"]["message"], error
    status, error = post(server + "/v1/completions", {"prompt": "hi", "max_tokens": 2.5})
    assert error["error"]["message"] == "'max_tokens' must be an integer"
    status, error = post(server + "/v1/completions", {"prompt": [5] * max_len})
    assert status == 400 and error["error"]["param"] == "prompt", error
    # the default max_tokens (16) is cut to the room the prompt leaves, as vLLM cuts it; one given is not
    status, result = post(server + "/v1/completions", {"prompt": [5] * (max_len - 10), "ignore_eos": True})
    assert status == 200 and result["usage"]["completion_tokens"] == 10, result
    assert result["choices"][0]["finish_reason"] == "length"
    status, error = post(server + "/v1/completions", {"prompt": [5] * (max_len - 10), "max_tokens": 16})
    assert "max_tokens is 16:" in error["error"]["message"]
    status, error = post(server + "/v1/completions", {"prompt": "hi", "n": 17})
    assert "(the server's --max-n)" in error["error"]["message"]
    tok = offline.get_tokenizer()
    status, result = post(server + "/tokenize", {"prompt": "hello world", "return_token_strs": True})
    assert status == 200 and result["token_strs"] == tok.convert_ids_to_tokens(tok.encode("hello world"))
    status, result = post(server + "/tokenize", {"prompt": "hello world"})
    assert "token_strs" not in result
    status, error = post(server + "/tokenize", {"prompt": "hi", "return_token_strs": "yes"})
    assert status == 400 and error["error"]["param"] == "return_token_strs"


def test_chat_goes_on_with_the_final_message(server, client, offline):
    """continue_final_message: the reply continues the last assistant message, as a
    completion of the template's text up to it does (add_generation_prompt off unless set);
    /tokenize takes the same fields; the wrong combinations are 400s naming the field."""
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Hello the"}]
    ids = offline.get_tokenizer().apply_chat_template(messages, continue_final_message=True,
                                                      tokenize=True, return_dict=False)
    status, tokenized = post(server + "/tokenize", {"messages": messages, "continue_final_message": True})
    assert status == 200 and tokenized["tokens"] == ids
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                           extra_body={"continue_final_message": True,
                                                       "chat_template_kwargs": {"enable_thinking": False}})
    completion = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    assert reply.choices[0].message.content == completion.choices[0].text
    user = [{"role": "user", "content": "x"}]
    for body, param in [({"messages": messages, "continue_final_message": True, "add_generation_prompt": True},
                         "continue_final_message"),
                        ({"messages": user, "continue_final_message": "yes"}, "continue_final_message"),
                        ({"messages": user, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
                        ({"messages": user, "chat_template_kwargs": ["x"]}, "chat_template_kwargs")]:
        status, error = post(server + "/v1/chat/completions", body)
        assert status == 400 and error["error"]["param"] == param, (body, error)


def test_echo_with_logprobs_scores_the_prompt(client, offline):
    """echo + logprobs (how evaluation harnesses score a text): the prompt's tokens come first,
    the first with null logprobs, the rest with the engine's prompt logprobs; streamed, the
    same, the echoed prompt in the first chunk of each choice."""
    prompt = "The quick brown fox jumps over"
    ids = offline.get_tokenizer().encode(prompt)
    expected = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2),
                                use_tqdm=False)[0]
    result = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                       logprobs=2)
    lp = result.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = prompt_token_logprobs(expected, ids)
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:len(ids)], want)) < 1e-5
    assert all(len(top) >= 2 for top in lp.top_logprobs[1:])
    assert "".join(lp.tokens) == result.choices[0].text and result.choices[0].text.startswith(prompt)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    streamed = {"text": "", "tokens": [], "token_logprobs": []}
    for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                           logprobs=2, stream=True):
        for c in chunk.choices:
            streamed["text"] += c.text
            if c.logprobs:
                streamed["tokens"] += c.logprobs.tokens
                streamed["token_logprobs"] += c.logprobs.token_logprobs
    assert streamed == {"text": result.choices[0].text, "tokens": lp.tokens, "token_logprobs": lp.token_logprobs}


def test_echo_scores_a_text_alone_and_each_count_is_its_own(server, client):
    """echo with max_tokens 0 returns the prompt alone, scored (how harnesses score a text; one
    token is generated and left out, as vLLM does); with logprobs and prompt_logprobs both
    set, the echoed tops follow logprobs and the field follows prompt_logprobs."""
    prompt = "The quick brown fox"
    status, body = post(server + "/v1/completions", {"prompt": prompt, "echo": True, "max_tokens": 0,
                                                      "logprobs": 0, "prompt_logprobs": 3})
    assert status == 200
    choice = body["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == prompt and lp["token_logprobs"][0] is None
    assert all(len(top) == 1 for top in lp["top_logprobs"][1:])  # its own token only: logprobs 0
    assert all(1 <= len(entry) <= 4 for entry in choice["prompt_logprobs"][1:])  # the token + top 3
    assert any(len(entry) >= 3 for entry in choice["prompt_logprobs"][1:])
    streamed = list(client.completions.create(model="tiny", prompt=prompt, echo=True, max_tokens=0, logprobs=0,
                                              stream=True))
    assert "".join(c.text for c in streamed for c in c.choices) == prompt
    assert [c.finish_reason for c in streamed for c in c.choices if c.finish_reason] == ["length"]


def test_the_prompt_logprobs_field_is_vllms(server, client, offline):
    """vLLM's prompt_logprobs field: in each completions choice (the choice's prompt; streamed,
    in a first chunk of each choice), at the top of a chat response; None first, then
    {token_id: {logprob, rank, decoded_token}} with the token itself and the top N; refused
    when streaming a chat, as vLLM does."""
    prompt = "The quick brown fox"
    expected = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1),
                                use_tqdm=False)[0].prompt_logprobs
    status, body = post(server + "/v1/completions", {"prompt": [prompt, "hi"], "max_tokens": 2, "temperature": 0,
                                                      "prompt_logprobs": 1, "n": 2})
    assert status == 200
    got = body["choices"][1]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(expected)
    for mine, theirs in zip(got[1:], expected[1:]):
        token = next(iter(theirs))
        assert next(iter(mine)) == str(token) and abs(mine[str(token)]["logprob"] - theirs[token].logprob) < 1e-5
        assert all(set(v) == {"logprob", "rank", "decoded_token"} for v in mine.values()) and len(mine) <= 2
    assert len(body["choices"][2]["prompt_logprobs"]) == len(offline.get_tokenizer().encode("hi"))
    status, chat = post(server + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}],
                                                           "max_tokens": 1, "prompt_logprobs": 0})
    assert status == 200 and chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 3
    status, error = post(server + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}],
                                                            "prompt_logprobs": 1, "stream": True})
    assert status == 400 and error["error"]["param"] == "prompt_logprobs"  # as in vLLM
    # streamed: a first chunk per choice carries its prompt's
    firsts = {}
    for chunk in client.completions.create(model="tiny", prompt=[prompt, "hi"], max_tokens=2, temperature=0,
                                           n=2, stream=True, extra_body={"prompt_logprobs": 1}):
        for c in chunk.choices:
            if getattr(c, "prompt_logprobs", None) is not None:
                assert c.index not in firsts and c.text == ""
                firsts[c.index] = c.prompt_logprobs
    assert sorted(firsts) == [0, 1, 2, 3] and firsts[1] == firsts[0] == body["choices"][0]["prompt_logprobs"]


def test_completion_logprobs_match_the_engine(client, offline):
    result = client.completions.create(model="tiny", prompt="hello world", max_tokens=6, temperature=0,
                                       logprobs=2)
    expected = offline.generate("hello world", SamplingParams(temperature=0, max_tokens=6, logprobs=2),
                                use_tqdm=False)[0].outputs[0]
    lp = result.choices[0].logprobs
    want = [entry[t].logprob for entry, t in zip(expected.logprobs, expected.token_ids)]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.token_logprobs == pytest.approx(want, abs=1e-5)
    assert all(2 <= len(top) <= 3 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_tokens_as_token_ids_name_each_logprobs_token_by_its_id(server, client, offline):
    """vLLM's return_tokens_as_token_ids: "token_id:N" for the tokens and top tokens, completions
    and chat alike; the text and its offsets are as without it."""
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2)
    expected = offline.generate("hello world", params, use_tqdm=False)[0].outputs[0]
    named = [f"token_id:{t}" for t in expected.token_ids]
    plain = client.completions.create(model="tiny", prompt="hello world", max_tokens=6, temperature=0, logprobs=2)
    result = client.completions.create(model="tiny", prompt="hello world", max_tokens=6, temperature=0, logprobs=2,
                                       extra_body={"return_tokens_as_token_ids": True})
    lp = result.choices[0].logprobs
    assert lp.tokens == named and result.choices[0].text == plain.choices[0].text
    assert lp.text_offset == plain.choices[0].logprobs.text_offset
    assert all(name in top for name, top in zip(named, lp.top_logprobs))
    assert all(key.startswith("token_id:") for top in lp.top_logprobs for key in top)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"return_tokens_as_token_ids": True})
    for entry in chat.choices[0].logprobs.content:
        assert re.fullmatch(r"token_id:\d+", entry.token)
        assert all(re.fullmatch(r"token_id:\d+", top.token) for top in entry.top_logprobs)
    status, error = post(server + "/v1/completions", {"prompt": "hi", "return_tokens_as_token_ids": "yes"})
    assert status == 400 and error["error"]["param"] == "return_tokens_as_token_ids"


def test_chat_logprobs_streamed_and_not(client):
    messages = [{"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                           logprobs=True, top_logprobs=2)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
               for c in content)
    assert all(c.logprob == c.top_logprobs[0].logprob for c in content)  # greedy: the best token
    streamed = [c for chunk in client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
        stream=True) if chunk.choices and chunk.choices[0].logprobs
        for c in chunk.choices[0].logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model="tiny", messages=messages, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model="tiny", prompt="hi", logprobs=21)


def test_echo_puts_the_prompt_first(client):
    plain = client.completions.create(model="tiny", prompt="hello world", max_tokens=5, temperature=0)
    echoed = client.completions.create(model="tiny", prompt="hello world", max_tokens=5, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text == "hello world" + plain.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="hello world", max_tokens=5, temperature=0, echo=True, stream=True) if c.choices)
    assert streamed == echoed.choices[0].text


def test_more_bad_requests_are_400_with_the_field_named(server):
    cases = [({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
             ({"prompt": "hi", "n": 17}, "n"), ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
             ({"prompt": "hi", "temperature": "hot"}, "temperature"), ({"prompt": ""}, "prompt"),
             ({"prompt": "hi", "stop_token_ids": [[1]]}, "stop_token_ids"),
             ({"prompt": "hi", "stop_token_ids": [10 ** 6]}, "stop_token_ids"),
             ({"prompt": "hi", "seed": -2 ** 63 - 1}, "seed"),
             ({"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
             ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
             ({"prompt": "hi", "logit_bias": {"1000000": 1}}, "logit_bias"),
             ({"prompt": "hi", "top_p": 0}, "top_p"), ({"prompt": "hi", "min_p": 2}, "min_p"),
             ({"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
             ({"prompt": "hi", "priority": 1}, "priority"),  # (the server runs first come, first served)
             ({"prompt": "hi", "priority": "1"}, "priority"), ({"prompt": "hi", "priority": 2 ** 63}, "priority"),
             ({"prompt": [10 ** 6]}, "prompt"),
             # what the server cannot honour is refused, not quietly ignored
             ({"prompt": "hi", "suffix": "end"}, "suffix"), ({"prompt": "hi", "best_of": 3}, "best_of")]
    for body, param in cases:
        status, error = post(server + "/v1/completions", body)
        assert status == 400 and error["error"]["param"] == param, (body, error)
    user = [{"role": "user", "content": "x"}]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    deep: dict = {}
    for _ in range(300):
        deep = {"type": "object", "properties": {"a": deep}}
    for body, param in [({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
                        ({"messages": [{"role": "user", "content": "x " * 5000}]}, "messages"),
                        ({"logit_bias": {"1000000": -1}}, "logit_bias"),
                        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                         "response_format"),
                        ({"response_format": {"type": "json_schema", "json_schema": {
                            "name": "x", "schema": {"type": "string", "pattern": "a(?=b)"}}}}, "response_format"),
                        ({"structured_outputs": {"regex": "a(?=b)"}}, "structured_outputs"),
                        ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs"),
                        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
                        ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "text"}},
                         "structured_outputs"),
                        ({"guided_regex": "(a"}, "structured_outputs"),
                        ({"guided_json": {}, "guided_choice": ["a"]}, "guided_json"),
                        ({"response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens"),
                        ({"tools": [tool]}, "tool_choice"), ({"tools": [tool], "tool_choice": "auto"}, "tool_choice"),
                        ({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "g"}}},
                         "tool_choice"),
                        ({"tool_choice": "required"}, "tool_choice"), ({"tools": [{"type": "function"}]}, "tools"),
                        ({"tools": [tool, tool], "tool_choice": "required"}, "tools"),
                        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
                            "type": "string", "pattern": "\\1"}}}], "tool_choice": "required"}, "tools"),
                        ({"tools": [tool], "tool_choice": "required", "response_format": {"type": "json_object"}},
                         "tool_choice"),
                        ({"functions": [{"name": "f"}]}, "functions"),
                        ({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": ["f"]}}},
                         "tool_choice"),
                        ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(65)],
                          "tool_choice": "required"}, "tools"),
                        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": deep}}]}, "tools"),
                        ({"messages": [{"role": "assistant", "tool_calls": [
                            {"function": {"name": "f", "arguments": deep}}]}]}, "messages"),
                        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "x"}]}]}, "messages")]:
        status, error = post(server + "/v1/chat/completions", {"messages": user, **body})
        assert status == 400 and error["error"]["param"] == param, (body, error)
    status, _ = post(server + "/v1/chat/completions", {"messages": user, "max_tokens": 1, "tools": [tool],
                                                       "tool_choice": "none", "response_format": {"type": "text"}})
    assert status == 200


def test_logit_bias_bans_and_forces_tokens(client, offline):
    """-100 makes a token unpickable, +100 all but certain; served as LLM.generate gives it."""
    first = offline.generate("hello world", SamplingParams(max_tokens=1, temperature=0),
                             use_tqdm=False)[0].outputs[0].token_ids[0]
    for bias, temperature in (({first: -100.0}, 0.0), ({42: 100.0}, 1.0)):
        params = SamplingParams(max_tokens=6, temperature=temperature, seed=3, logit_bias=bias)
        expected = offline.generate("hello world", params, use_tqdm=False)[0].outputs[0]
        served = client.completions.create(model="tiny", prompt="hello world", max_tokens=6, seed=3,
                                           temperature=temperature,
                                           logit_bias={str(k): v for k, v in bias.items()})
        assert served.choices[0].text == expected.text
        if temperature == 0:
            assert expected.token_ids[0] != first
        else:
            assert expected.token_ids == [42] * 6


def test_json_mode_answers_in_json_streamed_and_not(client, offline):
    """response_format json_object: a JSON object, ended with EOS ("stop"); with '}' favoured
    the object closes at once; sampled freely, every output is a prefix of one; streamed, the
    same text."""
    from streamserve.engine import structured_output as so

    tok = {t: offline.get_tokenizer().convert_tokens_to_ids(t) for t in "{}"}
    bias = {str(tok["}"]): 100, str(tok["{"]): 50}
    user = [{"role": "user", "content": "Describe a cat in JSON."}]
    fmt = {"type": "json_object"}
    reply = client.chat.completions.create(model="tiny", messages=user, max_tokens=8, temperature=0,
                                           logit_bias=bias, response_format=fmt)
    assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == ("{}", "stop")
    sampled = client.chat.completions.create(model="tiny", messages=user, max_tokens=40, temperature=1.5, n=8,
                                             seed=3, response_format=fmt)
    for choice in sampled.choices:
        assert so.advance(so.START, choice.message.content) is not None, choice.message.content
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
    stream = client.chat.completions.create(model="tiny", messages=user, max_tokens=40, temperature=1.5, seed=3,
                                            n=8, response_format=fmt, stream=True)
    texts = ["" for _ in range(8)]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [c.message.content for c in sampled.choices]
    completion = client.completions.create(model="tiny", prompt="cat:", max_tokens=8, temperature=0,
                                           logit_bias=bias, extra_body={"response_format": fmt})
    assert completion.choices[0].text == "{}"


def test_json_schema_and_choice_hold_the_output(client, offline):
    """response_format json_schema: the reply is JSON the jsonschema package validates against
    the schema, ended with EOS, streamed the same; vLLM's structured_outputs choice on
    completions: one of the choices."""
    jsonschema = pytest.importorskip("jsonschema")
    from streamserve.engine import structured_output as so

    schema = {"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}, "legs": {"type": "integer"},
                                               "wild": {"type": ["boolean", "null"]}},
              "required": ["pet", "legs", "wild"]}
    texts = so.token_texts(offline.get_tokenizer(), 400)
    bias = {str(t): -100 for t, text in enumerate(texts) if text and (text.isspace() or text.isdigit())}
    fmt = {"type": "json_schema", "json_schema": {"name": "animal", "schema": schema, "strict": True}}
    user = [{"role": "user", "content": "Describe a cat."}]
    reply = client.chat.completions.create(model="tiny", messages=user, max_tokens=60, temperature=1.0, seed=5,
                                           n=4, logit_bias=bias, response_format=fmt)
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)
    stream = client.chat.completions.create(model="tiny", messages=user, max_tokens=60, temperature=1.0, seed=5,
                                            n=4, logit_bias=bias, response_format=fmt, stream=True)
    streamed = ["" for _ in range(4)]
    for chunk in stream:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == [c.message.content for c in reply.choices]
    choices = ["yes", "no", "maybe"]
    for extra in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        completion = client.completions.create(model="tiny", prompt="Is it?", max_tokens=10, temperature=1.0,
                                               seed=1, n=5, extra_body=extra)
        assert all(c.text in choices and c.finish_reason == "stop" for c in completion.choices)
    regex = r"(cat|dog)-\d{2}"  # vLLM's regex (and its earlier guided_regex), streamed too
    for extra in ({"structured_outputs": {"regex": regex}}, {"guided_regex": regex}):
        completion = client.completions.create(model="tiny", prompt="Is it?", max_tokens=10, temperature=1.0,
                                               seed=1, n=5, extra_body=extra)
        assert all(re.fullmatch(regex, c.text) and c.finish_reason == "stop" for c in completion.choices)
        stream = client.completions.create(model="tiny", prompt="Is it?", max_tokens=10, temperature=1.0,
                                           seed=1, n=5, extra_body=extra, stream=True)
        streamed = ["" for _ in range(5)]
        for chunk in stream:
            for choice in chunk.choices:
                streamed[choice.index] += choice.text
        assert streamed == [c.text for c in completion.choices]
    pattern = {"type": "object", "properties": {"tag": {"type": "string", "pattern": "^[a-z]{3}$"}},
               "required": ["tag"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "tagged", "schema": pattern}}
    reply = client.chat.completions.create(model="tiny", messages=user, max_tokens=30, temperature=1.0, seed=2,
                                           n=3, logit_bias=bias, response_format=fmt)
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), pattern)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                             "parameters": {"type": "object", "properties": {
                                                 "city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer"}},
                                                 "required": ["city", "days"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "$defs": {"zone": {"enum": ["UTC", "CET"]}}, "type": "object",
    "properties": {"zone": {"$ref": "#/$defs/zone"}}, "required": ["zone"]}}}


def _short_numbers(offline) -> dict[str, int]:
    """A bias that keeps a random model's JSON short: no whitespace, single digits."""
    from streamserve.engine import structured_output as so

    texts = so.token_texts(offline.get_tokenizer(), 400)
    return {str(t): -100 for t, text in enumerate(texts) if text and (text.isspace() or text.isdigit())}


def _streamed_calls(stream) -> dict[int, list[dict]]:
    """A stream's tool-call deltas put together, per choice: [{"id", "name", "arguments"}]."""
    calls: dict[int, list[dict]] = {}
    for chunk in stream:
        for choice in chunk.choices:
            assert not choice.delta.content
            for delta in choice.delta.tool_calls or ():
                mine = calls.setdefault(choice.index, [])
                if delta.index == len(mine):
                    mine.append({"id": delta.id, "name": delta.function.name, "arguments": ""})
                mine[delta.index]["arguments"] += delta.function.arguments or ""
    return calls


def test_a_named_tool_choice_calls_that_function(client, offline):
    """tool_choice naming a function: one call, its arguments JSON its parameters schema
    admits, no content; streamed, the same call in pieces (id and name on the first)."""
    jsonschema = pytest.importorskip("jsonschema")
    user = [{"role": "user", "content": "Weather in Rome?"}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(model="tiny", messages=user, max_tokens=60, temperature=1.0, seed=2, n=3, tools=[WEATHER, TIME],
                  tool_choice=choice, logit_bias=_short_numbers(offline))
    reply = client.chat.completions.create(**kwargs)
    for c in reply.choices:
        assert c.message.content is None and c.finish_reason == "stop" and len(c.message.tool_calls) == 1
        call = c.message.tool_calls[0]
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    streamed = _streamed_calls(client.chat.completions.create(**kwargs, stream=True))
    assert [[(c["name"], c["arguments"]) for c in streamed[i]] for i in range(3)] == \
        [[("get_weather", c.message.tool_calls[0].function.arguments)] for c in reply.choices]
    assert all(streamed[i][0]["id"].startswith("call_") for i in range(3))


def test_tool_choice_required_makes_one_or_more_calls(client, offline):
    """"required": a JSON array of calls, each to one of the tools with arguments its schema
    admits (a $ref inside a tool's parameters still finds its $defs); streamed, each whole."""
    jsonschema = pytest.importorskip("jsonschema")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    user = [{"role": "user", "content": "Weather and time?"}]
    kwargs = dict(model="tiny", messages=user, max_tokens=120, temperature=1.0, seed=1, n=4, tools=[WEATHER, TIME],
                  tool_choice="required", logit_bias=_short_numbers(offline))
    reply = client.chat.completions.create(**kwargs)
    names = set()
    for c in reply.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None and c.message.tool_calls
        for call in c.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
            names.add(call.function.name)
    assert names == set(schemas)  # both tools were called, somewhere
    streamed = _streamed_calls(client.chat.completions.create(**kwargs, stream=True))
    assert [[(c["name"], c["arguments"]) for c in streamed[i]] for i in range(4)] == \
        [[(t.function.name, t.function.arguments) for t in c.message.tool_calls] for c in reply.choices]


def test_a_conversation_with_tool_calls_and_results_is_rendered(server, client):
    """An assistant message carrying tool_calls (content null) and the tool's reply go to
    the chat template, the calls' arguments as objects."""
    messages = [{"role": "user", "content": "Weather in Rome?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 1}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, tools=[WEATHER],
                                           tool_choice="none")
    assert reply.choices[0].message.content is not None and not reply.choices[0].message.tool_calls


def test_tool_call_arguments_are_the_text_the_model_wrote(server):
    """"required"'s arguments are the model's own text of them, not re-encoded (a lone
    surrogate escape or 1e999 would not survive json.loads and json.dumps); a deep JSON
    argument string in an earlier message is passed on as text, not a 500."""
    from streamserve.engine import structured_output as so
    from streamserve.server.tools import ToolCallReader, tool_calling, tools_for_template

    body = {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string"}, "x": {"type": "number"},
                                         "c": {"const": {"$ref": "#/keep"}}}}}}], "tool_choice": "required"}
    calling = tool_calling(body, tools_for_template(body))
    text = '[{"name": "f", "parameters": {"s": "\\udddd]", "x": 1e999, "c": {"$ref":"#/keep"}}},{"name":"f","parameters":{}}]'
    assert so.is_complete(so.advance(so.start_states(calling.structured), text))  # what the decoder may write
    reader = ToolCallReader(calling)
    for i in range(0, len(text), 3):  # fed in pieces, as a stream comes
        reader.feed(text[i:i + 3])
    assert [c["function"]["arguments"] for c in reader.calls] == [
        '{"s": "\\udddd]", "x": 1e999, "c": {"$ref":"#/keep"}}', "{}"]
    status, _ = post(server + "/v1/chat/completions", {
        "messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[" * 100000}}]}],
        "max_tokens": 1})
    assert status == 200


def test_parallel_tool_calls_false_makes_one_call():
    from streamserve.engine import structured_output as so
    from streamserve.server.tools import tool_calling, tools_for_template

    tools = [{"type": "function", "function": {"name": "f"}}]
    for parallel, two_ok in ((None, True), (False, False)):
        body = {"tools": tools, "tool_choice": "required", "parallel_tool_calls": parallel}
        start = so.start_states(tool_calling(body, tools_for_template(body)).structured)
        assert so.is_complete(so.advance(start, '[{"name": "f", "parameters": {}}]'))
        assert so.is_complete(so.advance(start, '[{"name": "f", "parameters": {}}, {"name": "f", "parameters": {}}]')) \
            == two_ok


HERMES = [  # (text, content, calls as (name, arguments))
    ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
     "Let me check.", [("get_weather", '{"city": "Rome"}')]),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"arguments": "{\\"x\\": 1}", "name": "b"}'
     '</tool_call>\n', None, [("a", "{}"), ("b", '{"x": 1}')]),
    ("Hello <tool", "Hello <tool", []),
    ("<tool_call>not json</tool_call> and text", "<tool_call>not json</tool_call> and text", []),
    ('ok <tool_call>{"name": "a", "arguments": {"s": "\\udddd", "n": 1e999}}', 'ok <tool_call>{"name": "a", '
     '"arguments": {"s": "\\udddd", "n": 1e999}}', []),
    ('<tool_call>{"name": "a", "arguments": {"s": "\\udddd", "n": 1e999}}</tool_call>', None,
     [("a", '{"s": "\\udddd", "n": 1e999}')]),
    ("  spaced  ", "  spaced  ", []),
    ('Let me check.\n<tool_call>{"name": "f", "arguments": {}}</tool_call> \n', "Let me check.", [("f", "{}")]),
    ('A<tool_call>{"name": "f", "arguments": {}}</tool_call> \nthen B\n', "A \nthen B", [("f", "{}")]),
    ('<tool_call>{"name": "f", "arguments": {}} and more</tool_call>',
     '<tool_call>{"name": "f", "arguments": {}} and more</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": {}}{"name": "g", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "f", "arguments": {}}{"name": "g", "arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "\ud800", "arguments": {}}</tool_call>', '<tool_call>{"name": "\ud800", "arguments": {}}'
     '</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": "\udc00"}</tool_call>', None, [("f", '"\udc00"')]),
    ('<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>', None, [("f", '{"a": 1}')]),
    ('<tool_call>{"name": "f"}</tool_call>', '<tool_call>{"name": "f"}</tool_call>', []),
]


@pytest.mark.parametrize("text, content, calls", HERMES)
def test_the_hermes_parser_reads_calls_whole_and_in_pieces(text, content, calls):
    """--tool-call-parser hermes: <tool_call>{"name", "arguments"}</tool_call> blocks become
    calls (arguments as written; a JSON string's value), the rest content; a block that is
    no call, or not closed, stays text. Fed in pieces, the deltas add up to the same."""
    _check_parser("hermes", text, content, calls)


LLAMA3 = [  # (text, content, calls as (name, arguments))
    ('{"name": "get_weather", "parameters": {"city": "Rome"}}', None, [("get_weather", '{"city": "Rome"}')]),
    ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}\n', None,
     [("a", "{}"), ("b", '{"x": 1}')]),
    (' \n{"name": "a", "parameters": {"q": "}{"}}\n{"name": "b", "parameters": {}};', None, [("a", '{"q": "}{"}'), ("b", "{}")]),
    ("The weather is fine.", "The weather is fine.", []),
    ('Sure: {"name": "a", "parameters": {}}', 'Sure: {"name": "a", "parameters": {}}', []),
    ('{"answer": 42}', '{"answer": 42}', []),
    ('{"name": "a", "parameters": {}} and then text', " and then text", [("a", "{}")]),
    ('{"name": "a", "parameters": {"unfinished": ', '{"name": "a", "parameters": {"unfinished": ', []),
    ('{not json at all}', '{not json at all}', []),
    ("<|python_", "<|python_", []),
    ("  ", "  ", []),
]


@pytest.mark.parametrize("text, content, calls", LLAMA3)
def test_the_llama3_json_parser_reads_calls_whole_and_in_pieces(text, content, calls):
    """--tool-call-parser llama3_json: a reply that begins with {"name", "parameters"} objects
    (after <|python_tag|>; apart by ";" or whitespace) is calls; one that begins otherwise, or
    with JSON that is no call, is content; text after the calls is content. Fed in pieces,
    the deltas add up to the same."""
    _check_parser("llama3_json", text, content, calls)


PYTHONIC = [  # (text, content, calls as (name, arguments))
    ('[get_weather(city="Rome", days=2)]', None, [("get_weather", '{"city": "Rome", "days": 2}')]),
    ("  [a(x=[1, 2.5, None], y={'k': True}), b()]\n", None, [("a", '{"x": [1, 2.5, null], "y": {"k": true}}'),
                                                          ("b", "{}")]),
    ('<|python_start|>[f(s="é ]) [")]<|python_end|>', None, [("f", '{"s": "é ]) ["}')]),
    ("The weather is fine.", "The weather is fine.", []),
    ("[1] is a reference.", "[1] is a reference.", []),
    ('[f("positional")]', '[f("positional")]', []),
    ("[f(x=1 + 2)]", "[f(x=1 + 2)]", []),
    ("[f(x=float('nan'))]", "[f(x=float('nan'))]", []),
    ("[f(x=1)] and more", "[f(x=1)] and more", []),
    ("[f(x=1), ", "[f(x=1), ", []),
    ("[os.system(x=1)]", "[os.system(x=1)]", []),
    ('[f(s="\\udddd")]', '[f(s="\\udddd")]', []),
    ("[f(n=1e999)]", "[f(n=1e999)]", []),
    ("[]", "[]", []),
    ("  ", "  ", []),
    ("<|python_", "<|python_", []),
]


@pytest.mark.parametrize("text, content, calls", PYTHONIC)
def test_the_pythonic_parser_reads_a_list_of_calls_whole_and_in_pieces(text, content, calls):
    """--tool-call-parser pythonic: a reply that is one Python list of calls with keyword
    arguments whose values are literals is those calls (arguments as JSON); any other reply,
    or one with anything else in it, is content. Fed in pieces, the deltas add up to the same."""
    _check_parser("pythonic", text, content, calls)


MISTRAL = [  # (text, content, calls as (name, arguments))
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}]', None,
     [("get_weather", '{"city": "Rome", "days": 2}')]),
    (' [{"name": "a", "arguments": {"q": "]["}}, {"name": "b", "arguments": "{\\"x\\": 1}"}]\n', None,
     [("a", '{"q": "]["}'), ("b", '{"x": 1}')]),
    ("The weather is fine.", "The weather is fine.", []),
    ("[1] is a reference.", "[1] is a reference.", []),
    ('[{"name": "a"}]', '[{"name": "a"}]', []),
    ('[{"name": "a", "arguments": [1]}]', '[{"name": "a", "arguments": [1]}]', []),
    ('[{"name": "a", "arguments": {}}] and more', '[{"name": "a", "arguments": {}}] and more', []),
    ('[{"name": "a", "arguments": {', '[{"name": "a", "arguments": {', []),
    ('[{"name": "a", "arguments": "{not json"}]', '[{"name": "a", "arguments": "{not json"}]', []),
    ('[{"name": "a", "arguments": {}, "id": 1}]', '[{"name": "a", "arguments": {}, "id": 1}]', []),
    ('[{"name": "a", "arguments": {"s": "\\udddd", "n": 1e999}}]', None, [("a", '{"s": "\\udddd", "n": 1e999}')]),
    ("[]", "[]", []),
    # the newer models' form: [TOOL_CALLS]name[ARGS]{...} a call
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "days": 2}', None, [("get_weather", '{"city": "Rome", "days": 2}')]),
    ('[TOOL_CALLS]a[ARGS]{"q": "[TOOL"}[TOOL_CALLS]b[ARGS]{}\n', None, [("a", '{"q": "[TOOL"}'), ("b", "{}")]),
    ('[TOOL_CALLS]a[ARGS]{"x": 1} and more', '[TOOL_CALLS]a[ARGS]{"x": 1} and more', []),
    ('[TOOL_CALLS]a[ARGS][1]', '[TOOL_CALLS]a[ARGS][1]', []),
    ('[TOOL_CALLS]a b[ARGS]{}', '[TOOL_CALLS]a b[ARGS]{}', []),
    ('[TOOL_CALLS]a[ARGS]{}[ARGS]{}', '[TOOL_CALLS]a[ARGS]{}[ARGS]{}', []),
    ('[TOOL_CALLS]a[ARGS]{"s": "\\udddd"}', None, [("a", '{"s": "\\udddd"}')]),
    ('[TOOL_CALLS]a[ARGS]{', '[TOOL_CALLS]a[ARGS]{', []),
    # the markers' text inside arguments; an id before [ARGS]; no [ARGS]; text before the calls
    ('[TOOL_CALLS][{"name": "say", "arguments": {"text": "a [ARGS] b"}}]', None, [("say", '{"text": "a [ARGS] b"}')]),
    ('[TOOL_CALLS]say[ARGS]{"text": "use [ARGS] or [TOOL_CALLS]"}', None,
     [("say", '{"text": "use [ARGS] or [TOOL_CALLS]"}')]),
    ('[TOOL_CALLS]a[CALL_ID]Ab12cD34e[ARGS]{"x": 1}', None, [("a", '{"x": 1}')]),
    ('[TOOL_CALLS]a{"x": 1}[TOOL_CALLS]b {}', None, [("a", '{"x": 1}'), ("b", "{}")]),
    ('Let me check. [TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}', "Let me check.",
     [("get_weather", '{"city": "Rome"}')]),
    ("See [TOOL_CALLS] here", "See [TOOL_CALLS] here", []),
    ("Ends with [TOOL_CA", "Ends with [TOOL_CA", []),
]


@pytest.mark.parametrize("text, content, calls", MISTRAL)
def test_the_mistral_parser_reads_a_json_array_of_calls_whole_and_in_pieces(text, content, calls):
    """--tool-call-parser mistral: a reply that is one JSON array of {"name", "arguments"}
    objects (after [TOOL_CALLS]), or [TOOL_CALLS]name[ARGS]{...} calls, is those calls, and text
    before a [TOOL_CALLS] content; any other reply is content. Fed in pieces, the deltas add up
    to the same."""
    _check_parser("mistral", text, content, calls)


GRANITE = [  # (text, content, calls as (name, arguments))
    ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}]', None,
     [("get_weather", '{"city": "Rome", "days": 2}')]),
    (' <tool_call>[{"name": "a", "arguments": {"q": "]["}}, {"name": "b", "arguments": "{\\"x\\": 1}"}]\n', None,
     [("a", '{"q": "]["}'), ("b", '{"x": 1}')]),
    ('[{"name": "a", "arguments": {}}]', None, [("a", "{}")]),  # the special token skipped
    ('<|tool_call|> <tool_call>[{"name": "a", "arguments": {}}]', None, [("a", "{}")]),  # both openers
    ("The weather is fine.", "The weather is fine.", []),
    ("[1] is a reference.", "[1] is a reference.", []),
    ('<|tool_call|>[{"name": "a"}]', '<|tool_call|>[{"name": "a"}]', []),
    ('<|tool_call|>{"name": "a", "arguments": {}}', '<|tool_call|>{"name": "a", "arguments": {}}', []),
    ('<|tool_call|>[{"name": "a", "arguments": {}}] and more', '<|tool_call|>[{"name": "a", "arguments": {}}] and more',
     []),
    ('<|tool_call|>[{"name": "a", "arguments": {', '<|tool_call|>[{"name": "a", "arguments": {', []),
    ("<|tool_", "<|tool_", []),
    ("<tool", "<tool", []),
    ("<tool_call> is a tag", "<tool_call> is a tag", []),
    ("  ", "  ", []),
]


@pytest.mark.parametrize("text, content, calls", GRANITE)
def test_the_granite_parser_reads_a_json_array_of_calls_whole_and_in_pieces(text, content, calls):
    """--tool-call-parser granite: a reply that is one JSON array of {"name", "arguments"}
    objects (after <|tool_call|> or <tool_call>, or none) is those calls; any other reply is
    content. Fed in pieces, the deltas add up to the same."""
    _check_parser("granite", text, content, calls)


def _check_parser(parser: str, text: str, content, calls) -> None:
    import random

    from streamserve.server.tools import ToolCallReader, ToolCalling

    whole = ToolCallReader(ToolCalling(None, None, parser))
    whole.feed(text)
    whole.close()
    message = whole.message()
    assert message["content"] == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])] == calls
    rng = random.Random(0)
    for _ in range(20):
        reader, at, streamed, deltas = ToolCallReader(ToolCalling(None, None, parser)), 0, "", []
        while at < len(text):
            step = rng.randint(1, 4)
            deltas.append(reader.feed(text[at:at + step]))
            at += step
        deltas.append(reader.close())
        streamed = "".join(d.get("content", "") for d in deltas)
        assert streamed == (content or "")
        assert [c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", [])] == [a for _, a in calls]


def test_tool_choice_auto_with_the_hermes_parser(model_dirs):
    """A server started with --tool-call-parser hermes takes tool_choice "auto": a reply
    that writes a <tool_call> block is a call (finish reason tool_calls), streamed the same;
    one that does not is text. (The model is held to each reply by a choice.)"""
    proc, url = start_server(model_dirs["llama"], "--served-model-name", "tiny", "--tool-call-parser", "hermes")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        block = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>'
        user = [{"role": "user", "content": "Weather in Rome?"}]
        for reply, calls in ((block, 1), ("It is sunny.", 0)):
            kwargs = dict(model="tiny", messages=user, max_tokens=200, temperature=0, tools=[WEATHER],
                          extra_body={"structured_outputs": {"choice": [reply]}})
            out = client.chat.completions.create(**kwargs).choices[0]
            assert out.finish_reason == ("tool_calls" if calls else "stop")
            if calls:
                assert out.message.content is None
                assert [(t.function.name, t.function.arguments) for t in out.message.tool_calls] == \
                    [("get_weather", '{"city": "Rome", "days": 2}')]
            else:
                assert out.message.content == reply and not out.message.tool_calls
            streamed = _streamed_calls(client.chat.completions.create(**kwargs, stream=True)) if calls else {}
            assert [(c["name"], c["arguments"]) for c in streamed.get(0, [])] == \
                [(t.function.name, t.function.arguments) for t in out.message.tool_calls or []]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.parametrize("parser, calls", [
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}; {"name": "get_time", "parameters": {}}'),
    ("pythonic", '[get_weather(city="Rome", days=2), get_time()]'),
    ("mistral", '[{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}, {"name": "get_time", "arguments": {}}]'),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "days": 2}[TOOL_CALLS]get_time[ARGS]{}'),
    ("granite", '<tool_call>[{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}, '
                '{"name": "get_time", "arguments": {}}]'),
])
def test_tool_choice_auto_with_the_llama3_json_pythonic_mistral_and_granite_parsers(model_dirs, parser, calls):
    """--tool-call-parser llama3_json (two JSON calls apart by ";"), pythonic (a Python list of
    two calls), mistral (a JSON array of two, or the newer [TOOL_CALLS]name[ARGS]{...}) and granite
    (a JSON array after <tool_call>): the reply is two calls, streamed the same (pythonic's,
    mistral's and granite's in the last chunk, read whole at the end); a reply of text is content. mistral keeps the special tokens in the text (the
    newer form is told by them) unless the request says otherwise. (The model is held to each
    reply by a choice.)"""
    from live_server import serve_in_thread

    for live in serve_in_thread(model_dirs["llama"], served_model_name="tiny", tool_call_parser=parser):
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        user = [{"role": "user", "content": "Weather and time in Rome?"}]
        for reply, want in ((calls, [("get_weather", '{"city": "Rome", "days": 2}'), ("get_time", "{}")]),
                            ("It is sunny.", [])):
            kwargs = dict(model="tiny", messages=user, max_tokens=200, temperature=0, tools=[WEATHER, TIME],
                          extra_body={"structured_outputs": {"choice": [reply]}})
            out = client.chat.completions.create(**kwargs).choices[0]
            assert out.finish_reason == ("tool_calls" if want else "stop")
            assert [(t.function.name, t.function.arguments) for t in out.message.tool_calls or []] == want
            assert out.message.content == (None if want else reply)
            if want:
                streamed = _streamed_calls(client.chat.completions.create(**kwargs, stream=True))
                assert [(c["name"], c["arguments"]) for c in streamed[0]] == want
        from transformers import AutoTokenizer

        special = AutoTokenizer.from_pretrained(model_dirs["llama"]).convert_tokens_to_ids("<|im_start|>")
        for skip in (None, True):  # a reply of one special token (of the tiny tokenizer's)
            out = client.chat.completions.create(
                model="tiny", messages=user, max_tokens=1, temperature=0, tools=[WEATHER],
                logit_bias={str(special): 100}, extra_body={} if skip is None else {"skip_special_tokens": skip})
            kept = parser == "mistral" and skip is None
            assert (out.choices[0].message.content or "") == ("<|im_start|>" if kept else "")


def test_usage_counts_the_prompt_tokens_read_from_the_prefix_cache(client):
    """prompt_tokens_details.cached_tokens, as OpenAI reports them: none the first time, the
    prompt's whole cached blocks (16 tokens each) the second, streamed or not."""
    messages = [{"role": "user", "content": "a prompt that no other test sends, " * 6}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1).usage
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1).usage
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, stream=True,
                                                 stream_options={"include_usage": True}))
    assert first.prompt_tokens_details.cached_tokens == 0
    cached = again.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.prompt_tokens and cached % 16 == 0
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached


def test_embeddings_are_the_offline_engines(client, server, offline):
    """/v1/embeddings through the openai client (which asks for base64) and as floats: each
    input's vector as LLM.embed gives it, in order, for strings and token IDs; the usage
    counts the inputs' tokens; what cannot be done is a 400 naming the field."""
    texts = ["hello world", "The quick brown fox", "hi"]
    expected = [o.outputs.embedding for o in offline.embed(texts, use_tqdm=False)]
    reply = client.embeddings.create(model="tiny", input=texts)
    assert [d.index for d in reply.data] == [0, 1, 2] and reply.model == "tiny"
    for d, want in zip(reply.data, expected):
        assert d.embedding == pytest.approx(want, abs=1e-5)
    ids = offline.get_tokenizer().encode("hello world")
    one = client.embeddings.create(model="tiny", input=ids, encoding_format="float")
    assert one.data[0].embedding == pytest.approx(expected[0], abs=1e-5)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(
        len(offline.get_tokenizer().encode(t)) for t in texts)
    for body, param in (({"input": []}, "input"), ({"input": ""}, "input"), ({"input": [[10 ** 6]]}, "input"),
                        ({"input": "x " * 600}, "input"), ({"input": "x", "dimensions": 8}, "dimensions"),  # (no MRL)
                        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
                        ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                        ({"input": "x", "truncate_prompt_tokens": "8"}, "truncate_prompt_tokens"),
                        ({"input": "x", "truncate_prompt_tokens": 10 ** 6}, "truncate_prompt_tokens")):
        status, error = post(server + "/v1/embeddings", body)
        assert status == 400 and error["error"]["param"] == param, (body, error)
    # vLLM's truncate_prompt_tokens: the last max_model_len tokens of a longer input (-1), or the last k
    long = offline.get_tokenizer().encode("x " * 600)
    max_len = offline.config.model.max_model_len
    for k, kept in ((-1, max_len), (7, 7)):
        reply = client.embeddings.create(model="tiny", input=long, extra_body={"truncate_prompt_tokens": k})
        assert reply.usage.prompt_tokens == kept
        assert reply.data[0].embedding == pytest.approx(
            offline.embed([long[-kept:]], use_tqdm=False)[0].outputs.embedding, abs=1e-5)


def test_matryoshka_dimensions_cut_the_embeddings(model_dirs):
    """dimensions (OpenAI's; vLLM's for matryoshka models): where config.json (here
    --hf-overrides) says the model was trained for it, each vector's first n values, normalised
    again, as LLM.embed(dimensions=n) gives them; a size matryoshka_dimensions does not list, or
    none that is a positive integer, is a 400."""
    import numpy as np

    from live_server import serve_in_thread

    overrides = {"is_matryoshka": True, "matryoshka_dimensions": [16, 32]}
    offline = LLM(model_dirs["llama"], dtype="float32", kv_cache_memory="16MiB", hf_overrides=overrides)
    full = offline.embed(["hello world"], use_tqdm=False)[0].outputs.embedding
    cut = offline.embed(["hello world"], use_tqdm=False, dimensions=16)[0].outputs.embedding
    head = np.asarray(full[:16])
    assert len(full) == 64 and cut == pytest.approx((head / np.linalg.norm(head)).tolist(), abs=1e-6)
    with pytest.raises(ValueError, match=r"may be cut to \[16, 32\] dimensions, not 8"):
        offline.embed(["hi"], use_tqdm=False, dimensions=8)
    from types import SimpleNamespace  # vLLM's PoolingParams(dimensions=16), and numpy's integers

    for given in ({"pooling_params": SimpleNamespace(dimensions=16)}, {"dimensions": np.int64(16)}):
        assert offline.embed(["hello world"], use_tqdm=False, **given)[0].outputs.embedding == cut
    for live in serve_in_thread(model_dirs["llama"], served_model_name="tiny", hf_overrides=overrides):
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        reply = client.embeddings.create(model="tiny", input="hello world", dimensions=16)
        assert reply.data[0].embedding == pytest.approx(cut, abs=1e-5)
        for bad in (8, 0, "16", True):
            status, error = post(live.url + "/v1/embeddings", {"input": "x", "dimensions": bad})
            assert status == 400 and error["error"]["param"] == "dimensions", (bad, error)


def test_score_and_rerank_are_the_offline_engines(server, offline):
    """/v1/score (vLLM's; also /score): one text_1 against each text_2, or pairwise, each the
    pair's LLM.score; /v1/rerank (also /rerank and /v2/rerank, Jina's and Cohere's shape): the
    documents best first with their indices and texts, top_n of them; usage counts each distinct
    text's tokens once; bad bodies are 400s naming the field."""
    texts = ["hello world", "The quick brown fox", "hi there"]
    expected = [o.outputs.score for o in offline.score("hello world", texts, use_tqdm=False)]
    for path in ("/v1/score", "/score"):
        status, reply = post(server + path, {"model": "tiny", "text_1": "hello world", "text_2": texts})
        assert status == 200 and reply["object"] == "list" and reply["model"] == "tiny"
        assert [d["index"] for d in reply["data"]] == [0, 1, 2] and {d["object"] for d in reply["data"]} == {"score"}
        assert [d["score"] for d in reply["data"]] == pytest.approx(expected, abs=1e-5)
    tokens = sum(len(offline.get_tokenizer().encode(t)) for t in texts)  # "hello world" once
    assert reply["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}
    status, reply = post(server + "/v1/score", {"text_1": texts[:2], "text_2": texts[1:]})
    pairwise = [o.outputs.score for o in offline.score(texts[:2], texts[1:], use_tqdm=False)]
    assert status == 200 and [d["score"] for d in reply["data"]] == pytest.approx(pairwise, abs=1e-5)

    order = sorted(range(3), key=lambda k: -expected[k])
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        status, reply = post(server + path, {"model": "tiny", "query": "hello world", "documents": texts})
        assert status == 200 and reply["model"] == "tiny" and reply["usage"] == {"total_tokens": tokens}
        assert [r["index"] for r in reply["results"]] == order
        assert [r["document"]["text"] for r in reply["results"]] == [texts[k] for k in order]
        assert [r["relevance_score"] for r in reply["results"]] == pytest.approx(sorted(expected, reverse=True),
                                                                                 abs=1e-5)
    status, reply = post(server + "/v1/rerank", {"query": "hello world", "top_n": 2, "return_documents": False,
                                                 "documents": [{"text": t} for t in texts]})
    assert status == 200 and [r["index"] for r in reply["results"]] == order[:2]
    assert all("document" not in r for r in reply["results"])
    for path, body, param in (
            ("/v1/score", {"text_1": "a"}, "text_2"), ("/v1/score", {"text_1": [], "text_2": "a"}, "text_1"),
            ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_1"),
            ("/v1/score", {"text_1": "a", "text_2": [""]}, "text_2"),
            ("/v1/score", {"text_1": "a", "text_2": [1, 2]}, "text_2"),
            ("/v1/score", {"text_1": "a", "text_2": "x " * 600}, "text_2"),
            ("/v1/rerank", {"query": "x " * 600, "documents": ["a"]}, "query"),
            ("/v1/rerank", {"query": "a", "documents": [f"b{k}" for k in range(2000)]}, None),  # past --max-choices
            ("/v1/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
            ("/v1/score", {"text_1": "a", "text_2": "b", "model": "nope"}, "model"),
            ("/v1/rerank", {"documents": ["a"]}, "query"), ("/v1/rerank", {"query": "a"}, "documents"),
            ("/v1/rerank", {"query": "a", "documents": [{"txt": "b"}]}, "documents"),
            ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
            ("/v1/rerank", {"query": "a", "documents": ["b"], "return_documents": "no"}, "return_documents")):
        status, error = post(server + path, body)
        assert status == (404 if param == "model" else 400) and error["error"]["param"] == param, (body, error)
    status, error = post(server + "/v1/score", {"text_1": "a", "text_2": ["b", "x " * 600]})
    assert status == 400 and error["error"]["message"].startswith("text_2 1: ")


def test_a_cross_encoders_score_and_rerank_are_the_offline_engines(model_dirs):
    """With classifier_from_token (--hf-overrides here, as vLLM serves Qwen3-Reranker), /v1/score
    and /v1/rerank score each pair as one prompt, as LLM.score does; usage counts the pairs'
    tokens."""
    from live_server import serve_in_thread

    overrides = {"classifier_from_token": ["Ġis", "Ġthe"]}
    offline = LLM(model_dirs["llama"], dtype="float32", kv_cache_memory="16MiB", hf_overrides=overrides)
    query, docs = "What is the capital of France?", ["Paris is the capital of France.", "Cats sleep a lot.", "hi"]
    expected = offline.score(query, docs, use_tqdm=False)
    scores = [o.outputs.score for o in expected]
    for live in serve_in_thread(model_dirs["llama"], served_model_name="tiny", hf_overrides=overrides):
        status, reply = post(live.url + "/v1/score", {"text_1": query, "text_2": docs})
        assert status == 200 and [d["score"] for d in reply["data"]] == pytest.approx(scores, abs=1e-5)
        tokens = sum(len(o.prompt_token_ids) for o in expected)
        assert reply["usage"]["prompt_tokens"] == tokens
        status, reply = post(live.url + "/v1/rerank", {"query": query, "documents": docs, "top_n": 2})
        assert status == 200 and reply["usage"] == {"total_tokens": tokens}
        assert [r["index"] for r in reply["results"]] == sorted(range(3), key=lambda k: -scores[k])[:2]


def test_vllms_allowed_token_ids_bad_words_and_truncation_are_served(client, server, offline):
    """allowed_token_ids, bad_words and truncate_prompt_tokens (vLLM's extras) served as LLM.generate
    runs them, in completions and chats; bad values are 400s naming the field."""
    tok = offline.get_tokenizer()
    prompt = "The quick brown fox jumps over the lazy dog and"
    free = offline.generate(prompt, SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)[0].outputs[0]
    extras = [{"allowed_token_ids": [3, 50, 77, 120]}, {"bad_words": [tok.decode(free.token_ids[1:2]).strip() or "x"]},
              {"truncate_prompt_tokens": 4}]
    for extra in extras:
        expected = offline.generate(prompt, SamplingParams(max_tokens=10, temperature=0, **extra),
                                    use_tqdm=False)[0]
        served = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                           extra_body=extra)
        assert served.choices[0].text == expected.outputs[0].text, extra
        assert served.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert expected.outputs[0].token_ids != free.token_ids or len(expected.prompt_token_ids) == 4
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                          max_tokens=6, temperature=0, extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5
    for body, param in (({"allowed_token_ids": []}, "allowed_token_ids"),
                        ({"allowed_token_ids": [10 ** 6]}, "allowed_token_ids"),
                        ({"allowed_token_ids": "5"}, "allowed_token_ids"),
                        ({"allowed_token_ids": [5], "response_format": {"type": "json_object"}}, "allowed_token_ids"),
                        ({"bad_words": "x"}, "bad_words"), ({"bad_words": [1]}, "bad_words"),
                        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
                        ({"truncate_prompt_tokens": 10 ** 6}, "truncate_prompt_tokens")):
        status, error = post(server + "/v1/completions", {"prompt": prompt, **body})
        assert status == 400 and error["error"]["param"] == param, (body, error)


def test_the_bodies_compiled_off_the_loop_are_those_with_a_schema_regex_or_choices():
    """compile_ahead sends a body to the compile thread when its output is held to a compiled
    structure, under any of the fields that name one."""
    from streamserve.server.protocol import compiles_output

    schema = {"type": "object"}
    for body in ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
                 {"structured_outputs": {"json": schema}}, {"structured_outputs": {"regex": "a+"}},
                 {"structured_outputs": {"choice": ["a"]}}, {"guided_json": schema}, {"guided_regex": "a"},
                 {"guided_choice": ["a"]}):
        assert compiles_output(body), body
    for body in ({}, {"response_format": {"type": "json_object"}}, {"structured_outputs": {"json_object": True}},
                 {"guided_grammar": "root ::= x"}, {"structured_outputs": "json"}, {"response_format": "text"}):
        assert not compiles_output(body), body
