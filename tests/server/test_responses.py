"""POST /v1/responses (OpenAI's Responses API) against the official openai client: each
response is the chat completion of the same conversation, reshaped; stored ones are read
back and gone on from."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import aiohttp
import openai
import orjson
import pytest

from live_server import fail_step, start, start_server
from streamserve.server.responses import ResponseStore

CITY = {"type": "object", "properties": {"city": {"enum": ["Rome", "Paris"]}}, "required": ["city"],
        "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city", "parameters": CITY}


@pytest.fixture(scope="module")
def server(model_dirs):
    proc, url = start_server(model_dirs["llama"], "--served-model-name", "tiny", "--responses-memory", "8KiB")
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def no_spaces(model_dirs) -> dict[str, int]:
    """A bias that keeps a random model's JSON short: no whitespace tokens."""
    from transformers import AutoTokenizer

    from streamserve.engine import structured_output as so

    texts = so.token_texts(AutoTokenizer.from_pretrained(model_dirs["llama"]), 400)
    return {str(t): -100 for t, text in enumerate(texts) if text and text.isspace()}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def chat(client, messages: list[dict], **kwargs):
    return client.chat.completions.create(model="tiny", messages=messages, temperature=0, **kwargs)


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_response_is_the_chat_completion_of_its_input(client):
    """instructions are the system message, input the user's; max_output_tokens cuts it as
    max_tokens would (status incomplete, the reason given)."""
    reply = client.responses.create(model="tiny", instructions="Be brief.", input="hello world", temperature=0,
                                    max_output_tokens=12)
    expected = chat(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello world"}],
                    max_tokens=12)
    assert reply.object == "response" and reply.id.startswith("resp_") and reply.model == "tiny"
    assert reply.output_text == expected.choices[0].message.content
    assert [item.type for item in reply.output] == ["message"] and reply.output[0].role == "assistant"
    assert reply.usage.input_tokens == expected.usage.prompt_tokens
    assert reply.usage.output_tokens == expected.usage.completion_tokens == 12
    assert reply.usage.total_tokens == expected.usage.total_tokens
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.output[0].status == "incomplete" and reply.instructions == "Be brief."
    again = client.responses.create(model="tiny", instructions="Be brief.", input="hello world", temperature=0,
                                    max_output_tokens=12)
    assert again.usage.input_tokens_details.cached_tokens > 0  # its prompt's blocks came from the prefix cache


def test_the_stream_sends_openais_events_in_order(client):
    kwargs = dict(model="tiny", input=[{"role": "user", "content": [{"type": "input_text", "text": "hi "},
                                                                    {"type": "input_text", "text": "there"}]}],
                  temperature=0, max_output_tokens=8)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * deltas + [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete"]
    assert deltas >= 1 and [e.sequence_number for e in events] == list(range(len(events)))
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events if e.type.startswith("response.output_text"))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-4].text == whole.output_text
    final = events[-1].response
    assert final.status == "incomplete" and final.output_text == text and final.usage.output_tokens == 8
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id
    # the SDK's own accumulator, on a response that stops (vLLM's stop field, passed on)
    with client.responses.stream(**kwargs, extra_body={"stop": [text[-1]]}) as stream:
        list(stream)
        completed = stream.get_final_response()
    assert completed.status == "completed" and text.startswith(completed.output_text)


def test_previous_response_id_goes_on_from_the_stored_conversation(client, server):
    first = client.responses.create(model="tiny", instructions="Be brief.", input="hello", temperature=0,
                                    max_output_tokens=6)
    second = client.responses.create(model="tiny", previous_response_id=first.id, input="and then?",
                                     temperature=0, max_output_tokens=6)
    # the earlier input and output, not its instructions (as OpenAI has it)
    expected = chat(client, [{"role": "user", "content": "hello"},
                             {"role": "assistant", "content": first.output_text},
                             {"role": "user", "content": "and then?"}], max_tokens=6)
    assert second.output_text == expected.choices[0].message.content
    assert second.usage.input_tokens == expected.usage.prompt_tokens and second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    status, error = post(server + "/v1/responses", {"input": "x", "previous_response_id": first.id})
    assert status == 404 and error["error"]["param"] == "previous_response_id"
    unstored = client.responses.create(model="tiny", input="hi", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    # the server keeps the newest within --responses-memory (8KiB: a few of these)
    ids = [client.responses.create(model="tiny", input="hi", max_output_tokens=1).id for _ in range(10)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert [client.responses.retrieve(i).id for i in ids[-2:]] == ids[-2:]


def test_a_named_function_is_called_and_its_output_read(client, no_spaces):
    """tool_choice naming a function: one function_call item (as the chat's tool call);
    streamed, its arguments in pieces; its output goes back as a function_call_output item."""
    reply = client.responses.create(model="tiny", input="Weather in Rome?", tools=[WEATHER], temperature=0,
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40,
                                    extra_body={"logit_bias": no_spaces})
    expected = chat(client, [{"role": "user", "content": "Weather in Rome?"}], max_tokens=40, logit_bias=no_spaces,
                    tools=[{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description",
                                                                                     "parameters")}}],
                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = reply.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.arguments == expected.choices[0].message.tool_calls[0].function.arguments
    assert json.loads(call.arguments)["city"] in ("Rome", "Paris") and reply.status == "completed"
    events = list(client.responses.create(model="tiny", input="Weather in Rome?", tools=[WEATHER], temperature=0,
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          max_output_tokens=40, stream=True, extra_body={"logit_bias": no_spaces}))
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(pieces) == done[0].arguments == call.arguments and len(done) == 1
    result = client.responses.create(model="tiny", previous_response_id=reply.id, tools=[WEATHER],
                                     tool_choice="none", temperature=0, max_output_tokens=5,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "sunny"}])
    assert [item.type for item in result.output] == ["message"] and result.output_text


def test_text_then_calls_with_the_hermes_parser_are_items_one_after_another(model_dirs):
    """With --tool-call-parser hermes, a reply of text and two <tool_call> blocks (the model
    held to it by vLLM's choice) is a message item and two function_call items, each done
    before the next is added, streamed and not; passed back as input with the calls'
    outputs, they read as the chat's one assistant turn with its text and both calls."""
    proc, url = start_server(model_dirs["llama"], "--served-model-name", "tiny", "--tool-call-parser", "hermes")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        block = '<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{}"}}}}\n</tool_call>'
        reply = "Let me look." + block.format("Rome") + "\n" + block.format("Paris")
        kwargs = dict(model="tiny", input="Weather?", tools=[WEATHER], temperature=0, max_output_tokens=200,
                      extra_body={"structured_outputs": {"choice": [reply]}})
        whole = client.responses.create(**kwargs)
        assert [(i.type, getattr(i, "arguments", None)) for i in whole.output] == [
            ("message", None), ("function_call", '{"city": "Rome"}'), ("function_call", '{"city": "Paris"}')]
        assert whole.output_text == "Let me look." and whole.status == "completed"
        with client.responses.stream(**kwargs) as stream:
            events = list(stream)
            streamed = stream.get_final_response()
        assert [(i.type, i.id.split("_")[0], getattr(i, "arguments", None)) for i in streamed.output] == \
            [(i.type, i.id.split("_")[0], getattr(i, "arguments", None)) for i in whole.output]
        opened = []  # each item is done before the next is added
        for e in events:
            if e.type == "response.output_item.added":
                assert not opened
                opened.append(e.output_index)
            elif e.type == "response.output_item.done":
                assert opened == [e.output_index]
                opened.pop()
        outputs = [{"type": "function_call_output", "call_id": i.call_id, "output": "sunny"} for i in whole.output[1:]]
        again = client.responses.create(model="tiny", tools=[WEATHER], tool_choice="none", max_output_tokens=1,
                                        input=[{"role": "user", "content": "Weather?"},
                                               *[i.model_dump() for i in whole.output], *outputs])
        calls = [{"id": i.call_id, "type": "function", "function": {"name": i.name, "arguments": i.arguments}}
                 for i in whole.output[1:]]
        expected = chat(client, [{"role": "user", "content": "Weather?"},
                                 {"role": "assistant", "content": "Let me look.", "tool_calls": calls},
                                 *[{"role": "tool", "tool_call_id": o["call_id"], "content": "sunny"} for o in outputs]],
                        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": CITY}}],
                        tool_choice="none", max_tokens=1)
        assert again.usage.input_tokens == expected.usage.prompt_tokens
        going_on = client.responses.create(model="tiny", previous_response_id=whole.id, input=outputs, tools=[WEATHER],
                                           tool_choice="none", max_output_tokens=1)
        assert going_on.usage.input_tokens == expected.usage.prompt_tokens
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_text_format_holds_the_output_to_a_schema(client, no_spaces):
    reply = client.responses.create(model="tiny", input="Which city?", temperature=0, max_output_tokens=40,
                                    extra_body={"logit_bias": no_spaces},
                                    text={"format": {"type": "json_schema", "name": "city", "schema": CITY}})
    assert json.loads(reply.output_text)["city"] in ("Rome", "Paris")
    assert reply.text.format.type == "json_schema"


def test_logprobs_come_when_included(client):
    reply = client.responses.create(model="tiny", input="hello", temperature=0, max_output_tokens=4,
                                    include=["message.output_text.logprobs"], top_logprobs=2)
    expected = chat(client, [{"role": "user", "content": "hello"}], max_tokens=4, logprobs=True, top_logprobs=2)
    got = reply.output[0].content[0].logprobs
    want = expected.choices[0].logprobs.content
    assert [(lp.token, round(lp.logprob, 4), len(lp.top_logprobs)) for lp in got] == \
        [(lp.token, round(lp.logprob, 4), 2) for lp in want]
    assert client.responses.create(model="tiny", input="hello", max_output_tokens=2).output[0].content[0].logprobs == []
    events = list(client.responses.create(model="tiny", input="hello", temperature=0, max_output_tokens=4, stream=True,
                                          include=["message.output_text.logprobs"], top_logprobs=2))
    added = [e for e in events if e.type == "response.content_part.added"]
    assert added[0].part.logprobs == [] and added[0].part.text == ""
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [(lp.token, lp.logprob) for lp in streamed] == [(lp.token, lp.logprob) for lp in got]


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input"),
    ({"input": [{"role": ["user"], "content": "x"}]}, "input"),
    ({"input": [{"role": {"a": 1}, "content": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"parallel_tool_calls": "x"}, "parallel_tool_calls"),
    ({"user": [1]}, "user"),
    ({"max_output_tokens": "5"}, "max_output_tokens"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
    ({"tools": [WEATHER]}, "tool_choice"),  # "auto" needs --tool-call-parser, as in chat
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"text": {"format": {"type": "yaml"}}}, "text"),
    ({"text": {"format": {"type": "json_schema", "schema": CITY}}}, "text"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "string", "pattern": "(?i)a"}}}},
     "text"),
    ({"input": "hi " * 600}, "input"),
    ({"max_output_tokens": 600}, "max_output_tokens"),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"instructions": ["x"]}, "instructions"),
    ({"stream": "yes"}, "stream"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(server, body, param):
    status, error = post(server + "/v1/responses", {"input": "hi", **body})
    assert status == 400 and error["error"]["param"] == param, error


def test_the_model_must_be_the_served_one(server):
    status, error = post(server + "/v1/responses", {"model": "gpt-4o", "input": "hi"})
    assert status == 404 and error["error"]["code"] == "model_not_found"


def test_the_store_keeps_the_newest_within_its_bytes():
    """Counted as their JSON: the oldest (least lately read) go first; one larger than the
    whole budget is not kept; a budget of 0 keeps none."""
    size = len(orjson.dumps({"response": {"id": "0"}, "conversation": [], "input_items": []}))
    store = ResponseStore(3 * size)
    for i in range(3):
        store.put({"id": str(i)}, [], [])
    store.get("0")  # read: now the newest
    store.put({"id": "3"}, [], [])
    assert list(store.items) == ["2", "0", "3"] and store.used == 3 * size
    store.put({"id": "big"}, [{"role": "user", "content": "x" * 3 * size}], [])
    assert "big" not in store.items and store.used == 3 * size
    store.delete("2")
    assert list(store.items) == ["0", "3"] and store.used == 2 * size
    assert store.get("3") == {"response": {"id": "3"}, "conversation": [], "input_items": []}
    empty = ResponseStore(0)
    empty.put({"id": "a"}, [], [])
    assert not empty.items


def test_input_items_list_a_responses_own_input_a_page_at_a_time(client, server):
    reply = client.responses.create(model="tiny", max_output_tokens=1, input=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call", "id": "fc_mine", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}])
    page = client.responses.input_items.list(reply.id)  # newest first
    assert [(i.type, getattr(i, "role", None)) for i in page.data] == [
        ("function_call_output", None), ("function_call", None), ("message", "user"), ("message", "developer")]
    assert page.data[1].id == "fc_mine" and page.data[0].output == "sunny" and page.data[2].content[0].text == "hi"
    ids = [i.id for i in page.data][::-1]
    first = client.responses.input_items.list(reply.id, order="asc", limit=2)
    assert [i.id for i in first.data] == ids[:2] and first.has_more and first.last_id == ids[1]
    rest = client.responses.input_items.list(reply.id, order="asc", after=ids[1])
    assert [i.id for i in rest.data] == ids[2:] and not rest.has_more
    assert [i.id for i in client.responses.input_items.list(reply.id, order="asc", limit=100)] == ids  # the SDK pages
    later = client.responses.create(model="tiny", previous_response_id=reply.id, input="and?", max_output_tokens=1)
    assert [i.content[0].text for i in client.responses.input_items.list(later.id).data] == ["and?"]  # its own only
    for query, param in (("?limit=0", "limit"), ("?order=up", "order"), ("?after=nope", "after")):
        with urllib.request.urlopen(server + f"/v1/responses/{reply.id}/input_items") as r:
            assert r.status == 200
        try:
            urllib.request.urlopen(server + f"/v1/responses/{reply.id}/input_items{query}")
            raise AssertionError(query)
        except urllib.error.HTTPError as e:
            assert e.code == 400 and json.loads(e.read())["error"]["param"] == param


def test_a_stream_that_breaks_ends_with_an_error_event_and_a_failed_response(llama_dir):
    """An engine failure mid-stream: an error event and response.failed (no traceback sent);
    the response is not stored, and the next one is served."""
    async def main():
        runner, engine, url = await start(llama_dir)
        fail_step(engine, 4)
        async with aiohttp.ClientSession() as session:
            body = {"input": "hello", "max_output_tokens": 30, "temperature": 0, "ignore_eos": True, "stream": True}
            async with session.post(url + "/v1/responses", json=body) as r:
                raw = (await r.read()).decode()
            events = [json.loads(frame.split("\ndata: ", 1)[1]) for frame in raw.split("\n\n") if frame]
            async with session.get(url + "/v1/responses/" + events[0]["response"]["id"]) as r:
                stored = r.status
            async with session.post(url + "/v1/responses", json={"input": "hi", "max_output_tokens": 2}) as r:
                after = (r.status, (await r.json())["status"])
        await runner.cleanup()
        return raw, events, stored, after

    raw, events, stored, after = asyncio.run(main())
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["code"] == "server_error" and "Traceback" not in raw and "injected" not in raw
    assert events[-1]["response"]["status"] == "failed" and events[-1]["response"]["error"]["code"] == "server_error"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert stored == 404 and after == (200, "incomplete")


def test_defaults_a_client_may_send_are_taken(server):
    """tool_choice "auto" with no tools, reasoning settings all null, explicit nulls: a plain
    text response (OpenAI takes them so)."""
    status, reply = post(server + "/v1/responses", {"input": "hi", "tool_choice": "auto", "tools": [],
                                                    "reasoning": {"effort": None, "summary": None}, "user": None,
                                                    "store": None, "parallel_tool_calls": None, "max_output_tokens": 2})
    assert status == 200 and reply["tool_choice"] == "auto" and reply["store"] is True
    assert reply["parallel_tool_calls"] is True and [i["type"] for i in reply["output"]] == ["message"]
