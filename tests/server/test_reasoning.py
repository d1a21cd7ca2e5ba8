"""--reasoning-parser: a chat reply's <think> block as the message's reasoning, apart from its
content, streamed or not; the reader on its own against every way a reply can be cut."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from live_server import scripted_replies, serve_in_thread
from streamserve.config import ServerConfig
from streamserve.server.reasoning import ReasoningReader, opens_thinking

# the tiny models' template, opening a <think> block in the prompt when asked to
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% if think %}<think>\n{% endif %}"
            "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
            "{% endif %}")  # (and as Qwen3's, an empty closed block for enable_thinking false)
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("reply, thinking, reasoning, content", [
    ("<think>plan it</think>\n\nthe answer", False, "plan it", "\n\nthe answer"),
    ("\n <think>plan</think>ok", False, "plan", "ok"),  # whitespace before the block is dropped
    ("the answer <think>not a block</think>", False, "", "the answer <think>not a block</think>"),
    ("plan it</think>the answer", True, "plan it", "the answer"),  # the prompt opened the block
    ("<think>cut short by max_tokens", False, "cut short by max_tokens", ""),
    ("still thinking </thi", True, "still thinking </thi", ""),
    ("  ", False, "", "  "),
    ("<thin", False, "", "<thin"),
    ("", True, "", ""),
])
def test_the_reader_splits_a_reply_alike_however_it_comes(reply, thinking, reasoning, content):
    for cuts in {(), *((i,) for i in range(len(reply) + 1)), *((i, j) for i in range(len(reply)) for j in (i + 1, i + 3))}:
        reader, got = ReasoningReader(thinking), ["", ""]
        pieces = [reply[a:b] for a, b in zip((0, *cuts), (*cuts, len(reply)))]
        for piece in pieces:
            for i, part in enumerate(reader.feed(piece)):
                got[i] += part
        for i, part in enumerate(reader.close()):
            got[i] += part
        assert got == [reasoning, content] == [reader.reasoning, reader.content], pieces


def test_the_prompt_opens_a_block_only_when_its_last_tag_is_an_opening_one():
    assert opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3's enable_thinking false
    assert not opens_thinking("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="reasoning_parser"):
        ServerConfig(reasoning_parser="granite")


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "think.jinja"
    template.write_text(TEMPLATE)
    yield from serve_in_thread(model_dirs["llama"], served_model_name="tiny", reasoning_parser="qwen3",
                               chat_template=str(template), tool_call_parser="hermes")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def ask(client, stream: bool = False, **extra):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Think first."}],
                                          max_tokens=60, temperature=0, stream=stream, extra_body=extra)


@pytest.mark.parametrize("reply, extra, reasoning, content", [
    ("<think>plan it</think>\n\nthe answer", {}, "plan it", "\n\nthe answer"),  # the reply opens the block
    ("plan it</think>the answer", {"chat_template_kwargs": {"think": True}}, "plan it", "the answer"),  # the prompt did
    ("just the answer", {}, None, "just the answer"),
])
def test_a_reply_gives_its_reasoning_apart_streamed_or_not(server, client, reply, extra, reasoning, content):
    with scripted_replies(server.engine, reply):
        message = ask(client, **extra).choices[0].message.model_dump()
        streamed = {"reasoning": "", "reasoning_content": "", "content": ""}
        for chunk in ask(client, stream=True, **extra):
            for key in streamed:
                streamed[key] += chunk.choices[0].delta.model_dump().get(key) or "" if chunk.choices else ""
    assert (message["reasoning"], message["reasoning_content"], message["content"]) == (reasoning, reasoning, content)
    assert streamed == {"reasoning": reasoning or "", "reasoning_content": reasoning or "", "content": content}


def test_a_reply_still_thinking_has_no_content_and_calls_come_from_the_content_only(server, client):
    with scripted_replies(server.engine, "<think>" + "and then " * 40):
        cut = ask(client).choices[0]  # max_tokens ends it inside the block
    assert cut.finish_reason == "length" and cut.message.content is None
    assert cut.message.model_dump()["reasoning"].startswith("and then")
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    with scripted_replies(server.engine, f"<think>{call}</think>{call}"):
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Call f."}],
                                               max_tokens=200, temperature=0, tools=[TOOL])
    message = reply.choices[0].message
    assert message.model_dump()["reasoning"] == call  # written while thinking: no call
    assert [c.function.name for c in message.tool_calls] == ["f"] and reply.choices[0].finish_reason == "tool_calls"


def test_a_response_gives_its_reasoning_as_a_reasoning_item(server, client):
    """The Responses API: a reasoning item (its text as reasoning_text content) before the
    message, streamed as reasoning_text events the openai client reads; handed back as input,
    the reasoning item is listed and the next turn goes on."""
    kwargs = dict(model="tiny", input="Think first.", max_output_tokens=40, temperature=0)
    with scripted_replies(server.engine, "<think>plan it well</think>the answer"):
        response = client.responses.create(**kwargs)
        events = list(client.responses.create(**kwargs, stream=True))
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and message.type == "message" and reasoning.status == "completed"
    assert reasoning.content[0].text == "plan it well" and response.output_text == "the answer"
    assert 0 < response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "plan it well"
    assert events[-1].response.output[0].content[0].text == "plan it well"
    follow = client.responses.create(model="tiny", max_output_tokens=4, input=[
        {"role": "user", "content": "Think first."}, reasoning.model_dump(exclude_none=True),
        {"role": "assistant", "content": response.output_text}, {"role": "user", "content": "Again."}])
    listed = client.responses.input_items.list(follow.id)
    assert [item.type for item in listed.data][::-1] == ["message", "reasoning", "message", "message"]


def test_structured_output_holds_the_answer_and_leaves_the_thinking_free(server, client):
    """As vLLM: under a reasoning parser the think block is free and the structure holds what
    follows it."""
    user = [{"role": "user", "content": "Answer in JSON."}]
    fmt = {"type": "json_object"}
    with scripted_replies(server.engine, 'not json at all </think>{"a": 1}'):  # the structure lets it through
        held = client.chat.completions.create(model="tiny", messages=user, max_tokens=40, temperature=0,
                                              response_format=fmt, extra_body={"chat_template_kwargs": {"think": True}})
    message = held.choices[0].message.model_dump()
    assert (message["reasoning"], message["content"], held.choices[0].finish_reason) == (
        "not json at all ", '{"a": 1}', "stop")
    # a random model thinks on to max_tokens, in no JSON, where JSON mode alone would have begun with "{"
    thinking = client.chat.completions.create(model="tiny", messages=user, max_tokens=12, temperature=0,
                                              response_format=fmt, extra_body={"chat_template_kwargs": {"think": True}})
    message = thinking.choices[0].message.model_dump()
    assert message["content"] is None and message["reasoning"] and not message["reasoning"].startswith("{")
    answer = client.chat.completions.create(  # no block opened, none written: JSON from the start
        model="tiny", messages=user, max_tokens=40, temperature=0, response_format=fmt)
    assert answer.choices[0].message.content.lstrip().startswith("{")


def test_a_responses_logprobs_are_its_messages_tokens_only(server, client):
    with scripted_replies(server.engine, "<think>plan it well</think>the answer"):
        response = client.responses.create(model="tiny", input="Think first.", max_output_tokens=40, temperature=0,
                                           include=["message.output_text.logprobs"], top_logprobs=1)
    text = response.output[1].content[0]
    assert "".join(lp.token for lp in text.logprobs) == "the answer<|im_end|>"  # (and its end, as without reasoning)
    assert text.text == "the answer"


def test_a_malformed_reasoning_item_is_a_400(server):
    for content in (1, "text", [1], [{"text": 5}], {"text": "x"}):
        body = {"model": "tiny", "input": [{"type": "reasoning", "content": content}, {"role": "user", "content": "x"}]}
        request = urllib.request.Request(server.url + "/v1/responses", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as raised:
            urllib.request.urlopen(request)
        assert raised.value.code == 400 and json.loads(raised.value.read())["error"]["param"] == "input", content


def test_a_responses_reasoning_effort_none_asks_the_template_for_no_thinking(server, client):
    """OpenAI's reasoning settings, taken where the server reads reasoning: effort "none" is
    Qwen3's enable_thinking false (an empty block closed in the prompt); the response says what
    was asked; a setting it does not know is a 400."""
    kwargs = dict(model="tiny", input="Think first.", max_output_tokens=4, temperature=0)
    plain = client.responses.create(**kwargs)
    for effort in ("none", "high"):
        response = client.responses.create(**kwargs, reasoning={"effort": effort, "summary": "auto"})
        closed = len(server.engine.tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False))
        assert response.usage.input_tokens == plain.usage.input_tokens + (closed if effort == "none" else 0)
        assert response.reasoning.effort == effort and response.reasoning.summary == "auto"
    for reasoning in ({"effort": "extreme"}, {"summary": "long"}, {"budget": 5}, "high"):
        with pytest.raises(openai.BadRequestError, match="reasoning"):
            client.responses.create(**kwargs, reasoning=reasoning)
