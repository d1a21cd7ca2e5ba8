"""--reasoning-parser: a chat reply's <think> block as the message's reasoning, apart from its
content, streamed or not; the reader on its own against every way a reply can be cut."""

from __future__ import annotations

import re

import openai
import pytest

from live_server import start_server
from streamserve.config import ServerConfig
from streamserve.server.reasoning import ReasoningReader, opens_thinking

# the tiny models' template, opening a <think> block in the prompt when asked to
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% if think %}<think>\n{% endif %}{% endif %}")
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
def client(model_dirs, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "think.jinja"
    template.write_text(TEMPLATE)
    proc, url = start_server(model_dirs["llama"], "--served-model-name", "tiny", "--reasoning-parser", "qwen3",
                             "--chat-template", str(template), "--tool-call-parser", "hermes")
    yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    proc.terminate()
    proc.wait(timeout=30)


def ask(client, regex: str, stream: bool = False, **extra):
    """A reply the random model writes to the regex (so that it has a block to read)."""
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Think first."}], max_tokens=40, temperature=1.0,
        seed=3, n=3, stream=stream, extra_body={"structured_outputs": {"regex": regex}, **extra})


@pytest.mark.parametrize("regex, extra", [
    (r"<think>[a-z ]{1,12}</think>\n[a-z ]{1,12}", {}),  # the reply opens the block
    (r"[a-z ]{1,12}</think>[a-z ]{1,12}", {"chat_template_kwargs": {"think": True}}),  # the prompt did
])
def test_a_reply_gives_its_reasoning_apart_streamed_or_not(client, regex, extra):
    reply = ask(client, regex, **extra)
    for choice in reply.choices:
        message = choice.message.model_dump()
        opened = "" if extra else "<think>"  # (by the reply itself, else by the prompt)
        assert re.fullmatch(regex, opened + message["reasoning"] + "</think>" + message["content"]), message
        assert message["reasoning"] == message["reasoning_content"] and message["reasoning"].strip()
        assert "think>" not in message["content"]
    streamed = [{"reasoning": "", "reasoning_content": "", "content": ""} for _ in range(3)]
    for chunk in ask(client, regex, stream=True, **extra):
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            for key in streamed[choice.index]:
                streamed[choice.index][key] += delta.get(key) or ""
    assert streamed == [{key: c.message.model_dump()[key] for key in streamed[0]} for c in reply.choices]


def test_a_reply_still_thinking_has_no_content_and_calls_come_from_the_content_only(client):
    cut = ask(client, r"<think>[a-z]{60}</think>ok")  # max_tokens ends it inside the block
    for choice in cut.choices:
        assert choice.finish_reason == "length"
        assert choice.message.content is None and choice.message.model_dump()["reasoning"]
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Call f."}], max_tokens=200, temperature=0, tools=[TOOL],
        extra_body={"structured_outputs": {"regex": re.escape(f"<think>{call}</think>{call}")}})
    message = reply.choices[0].message
    assert message.model_dump()["reasoning"] == call  # written while thinking: no call
    assert [c.function.name for c in message.tool_calls] == ["f"] and reply.choices[0].finish_reason == "tool_calls"


def test_a_response_gives_its_reasoning_as_a_reasoning_item(client):
    """The Responses API: a reasoning item (its text as reasoning_text content) before the
    message, streamed as reasoning_text events the openai client reads; handed back as input,
    the reasoning item is listed and the next turn goes on."""
    regex = r"<think>[a-z ]{1,12}</think>[a-z ]{1,12}"
    kwargs = dict(model="tiny", input="Think first.", max_output_tokens=40, temperature=1.0,
                  extra_body={"seed": 3, "structured_outputs": {"regex": regex}})
    response = client.responses.create(**kwargs)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and message.type == "message" and reasoning.status == "completed"
    assert re.fullmatch(regex, "<think>" + reasoning.content[0].text + "</think>" + response.output_text)
    assert 0 < response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == reasoning.content[0].text == next(
        e.text for e in events if e.type == "response.reasoning_text.done")
    assert events[-1].response.output[0].content[0].text == thought
    follow = client.responses.create(model="tiny", max_output_tokens=4, input=[
        {"role": "user", "content": "Think first."}, reasoning.model_dump(exclude_none=True),
        {"role": "assistant", "content": response.output_text}, {"role": "user", "content": "Again."}])
    listed = client.responses.input_items.list(follow.id)
    assert [item.type for item in listed.data][::-1] == ["message", "reasoning", "message", "message"]


def test_structured_output_holds_the_answer_and_leaves_the_thinking_free(client):
    """As vLLM: under a reasoning parser the think block is free and the structure holds what
    follows it. (The random model thinks on to max_tokens, in no JSON, where JSON mode alone
    would have begun with "{".)"""
    user = [{"role": "user", "content": "Answer in JSON."}]
    thinking = client.chat.completions.create(
        model="tiny", messages=user, max_tokens=12, temperature=0, response_format={"type": "json_object"},
        extra_body={"chat_template_kwargs": {"think": True}})
    message = thinking.choices[0].message.model_dump()
    assert message["content"] is None and message["reasoning"] and not message["reasoning"].startswith("{")
    answer = client.chat.completions.create(  # no block opened, none written: JSON from the start
        model="tiny", messages=user, max_tokens=40, temperature=0, response_format={"type": "json_object"})
    assert answer.choices[0].message.content.lstrip().startswith("{")
