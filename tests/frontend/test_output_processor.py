"""Streaming text: incremental detokenisation and stop strings, one token at a time."""

from __future__ import annotations

from typing import Optional

import pytest
from transformers import AutoTokenizer

from streamserve.engine.request import EngineCoreOutput
from streamserve.frontend.detokenizer import TextDecoder
from streamserve.frontend.output_processor import OutputProcessor
from streamserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tok(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


def stream(tok, text: str, params: SamplingParams, finish_at: Optional[int] = None):
    """Feed `text`'s tokens one per step; return (deltas, final output, aborted ids)."""
    ids = tok.encode(text)
    proc = OutputProcessor(tok)
    [child] = proc.add_request("r", None, [1, 2, 3], params, stream=True)
    deltas, final, aborted = [], None, []
    last = len(ids) - 1 if finish_at is None else finish_at
    for i, t in enumerate(ids[:last + 1]):
        out = proc.process_outputs([EngineCoreOutput(child, [t], None, "length" if i == last else None,
                                                     None, 0)])
        deltas += [d.outputs[0].text for d in out.deltas]
        aborted += out.to_abort
        if out.finished:
            final = out.finished[0]
            break
    return deltas, final, aborted, ids


@pytest.mark.parametrize("text", ["Caf\u00e9 na\u00efve \u4f60\u597d\u4e16\u754c \U0001f600\U0001f680 done",
                                  "\U0001f600\U0001f600 emoji first", "plain ascii text only"])
def test_deltas_add_up_to_the_text_and_never_split_a_character(tok, text):
    deltas, final, _, ids = stream(tok, text, SamplingParams(max_tokens=100))
    assert len(ids) > 3
    assert "".join(deltas) == tok.decode(ids) == final.outputs[0].text
    assert not any("\ufffd" in d for d in deltas)
    assert len([d for d in deltas if d]) >= 3  # it really streamed


def test_a_stop_string_is_never_sent_even_in_part(tok):
    text = "hello world, the quick brown fox"
    deltas, final, aborted, _ = stream(tok, text, SamplingParams(max_tokens=100, stop=["quick"]))
    assert final.outputs[0].text == "hello world, the "
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == "quick"
    assert aborted == ["r#0-0"]  # the engine request ends as soon as the stop string matches
    sent = ""
    for d in deltas:
        sent += d
        assert "q" not in sent  # no piece of "quick" ever went out
    assert sent == "hello world, the "


def test_include_stop_str_in_output(tok):
    deltas, final, _, _ = stream(tok, "hello world, the quick brown fox",
                                 SamplingParams(max_tokens=100, stop=["quick"], include_stop_str_in_output=True))
    assert "".join(deltas) == final.outputs[0].text == "hello world, the quick"


def test_stop_strings_are_not_looked_for_in_the_first_min_tokens_tokens(tok):
    """As vLLM does: below min_tokens no stop ends the request, stop strings included: a stop
    string must end after the text of those first tokens."""
    text = "a b a b a b c"
    ids = tok.encode(text)
    assert [tok.decode(ids[:i]) for i in (1, 3)] == ["a", "a b a"]  # one token a word
    _, final, _, _ = stream(tok, text, SamplingParams(max_tokens=100, stop=["a"], min_tokens=3))
    out = final.outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == ("a b a b ", "stop", "a")
    # one that begins in the first min_tokens' text and ends after it counts
    _, final, _, _ = stream(tok, text, SamplingParams(max_tokens=100, stop=["a b"], min_tokens=3))
    assert (final.outputs[0].text, final.outputs[0].stop_reason) == ("a b ", "a b")
    _, final, _, _ = stream(tok, text, SamplingParams(max_tokens=100, stop=["a"], min_tokens=len(ids)))
    assert final.outputs[0].text == text and final.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("skip", [False, True])
def test_fast_decode_gives_what_the_tokenizer_gives(tok, skip):
    import random

    from streamserve.frontend.detokenizer import TextDecoder

    decode = TextDecoder(tok).decode
    rng = random.Random(0)
    special = tok.all_special_ids
    assert special
    for _ in range(200):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 12))] + special[:rng.randint(0, 1)]
        rng.shuffle(ids)
        assert decode(ids, skip) == tok.decode(ids, skip_special_tokens=skip)


TEXTS = ["Caf\u00e9 na\u00efve \u4f60\u597d\u4e16\u754c \U0001f600\U0001f680 done", "\U0001f600\U0001f600 emoji first"]


class WatchedStream:
    """A DecodeStream that counts its steps (and fails at step `fail_at`, as a DecodeStream
    refusing its window does)."""

    made: list["WatchedStream"] = []

    def __init__(self, inner, fail_at: Optional[int] = None):
        self.inner, self.fail_at, self.calls = inner, fail_at, 0
        WatchedStream.made.append(self)

    def step(self, backend, token):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("InvalidPrefix")
        return self.inner.step(backend, token)


def watch_streams(monkeypatch, fail_at: Optional[int] = None) -> list[WatchedStream]:
    from streamserve.frontend.detokenizer import TextDecoder

    real = TextDecoder.stream
    WatchedStream.made = []
    monkeypatch.setattr(TextDecoder, "stream", lambda self, ids, skip: WatchedStream(real(self, ids, skip), fail_at))
    return WatchedStream.made


def test_the_decode_stream_is_used_and_streams_what_the_python_window_streams(tok, monkeypatch):
    from streamserve.frontend.detokenizer import TextDecoder

    made = watch_streams(monkeypatch)
    with_stream = [stream(tok, t, SamplingParams(max_tokens=100))[0] for t in TEXTS]
    assert [w.calls for w in made] == [len(tok.encode(t)) for t in TEXTS]  # every token went through it
    monkeypatch.setattr(TextDecoder, "stream", lambda self, ids, skip: None)
    without = [stream(tok, t, SamplingParams(max_tokens=100))[0] for t in TEXTS]
    assert with_stream == without


@pytest.mark.parametrize("use_stream", [True, False])
def test_finishing_inside_a_character_flushes_it_as_a_replacement_character(tok, monkeypatch, use_stream):
    from streamserve.frontend.detokenizer import TextDecoder

    made = watch_streams(monkeypatch)
    if not use_stream:
        monkeypatch.setattr(TextDecoder, "stream", lambda self, ids, skip: None)
    ids = tok.encode("ok \U0001f600")
    # the last token that leaves the emoji's bytes incomplete
    cut = max(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    deltas, final, _, _ = stream(tok, "ok \U0001f600", SamplingParams(max_tokens=100), finish_at=cut - 1)
    assert final.outputs[0].text == tok.decode(ids[:cut]) == "".join(deltas)
    assert final.outputs[0].text.endswith("\ufffd")
    assert bool(made and made[0].calls) == use_stream


def test_a_decode_stream_that_fails_hands_over_to_the_python_window(tok, monkeypatch):
    made = watch_streams(monkeypatch, fail_at=4)
    for text in TEXTS:
        deltas, final, _, ids = stream(tok, text, SamplingParams(max_tokens=100))
        assert "".join(deltas) == tok.decode(ids) == final.outputs[0].text
        assert not any("\ufffd" in d for d in deltas)
    assert [w.calls for w in made] == [4, 4]  # each failed at its 4th token, and was used no more


def test_a_prompt_ending_inside_a_character_does_not_leak_into_the_output(tok, monkeypatch):
    from streamserve.frontend.detokenizer import TextDecoder

    ids = tok.encode("The answer is \u4e16\u754c ok")
    # the prompt ends after the first token of a character split over several tokens
    cut = min(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))

    def output_text() -> str:
        proc = OutputProcessor(tok)
        [child] = proc.add_request("r", None, ids[:cut], SamplingParams(max_tokens=100))
        for i, t in enumerate(ids[cut:]):
            last = i == len(ids) - cut - 1
            out = proc.process_outputs([EngineCoreOutput(child, [t], None, "length" if last else None, None, 0)])
        return out.finished[0].outputs[0].text

    with_stream = output_text()
    monkeypatch.setattr(TextDecoder, "stream", lambda self, ids, skip: None)
    assert with_stream == output_text()
    assert "answer" not in with_stream and with_stream.endswith(" ok")


@pytest.mark.parametrize("text", ["Caf\u00e9 \u4f60\u597d \U0001f600", "plain"])
def test_token_bytes_rebuild_the_text_where_tokens_split_a_character(tok, text):
    """A token holding part of a character decodes alone to U+FFFD; its bytes (chat logprobs'
    "bytes") are its own piece of the UTF-8, so the pieces join into the text."""
    decoder = TextDecoder(tok)
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [decoder.token_bytes(t, decoder.decode([t], False)) for t in ids]
    assert b"".join(pieces) == text.encode()
    assert any("\ufffd" in decoder.decode([t], False) for t in ids) == (text != "plain")


def test_token_bytes_read_sentencepiece_byte_fallback():
    """SentencePiece vocabularies hold a character they lack as byte tokens named <0xNN>."""
    class Vocab:  # what TextDecoder reads of a tokenizer without a `tokenizers` backend
        clean_up_tokenization_spaces = False
        pieces = {1: "<0xE4>", 2: "\u2581hello"}

        def decode(self, ids, skip_special_tokens=False):
            return "\ufffd" if ids == [1] else " hello"

        def convert_ids_to_tokens(self, token_id):
            return self.pieces[token_id]

    decoder = TextDecoder(Vocab())
    assert decoder.token_bytes(1, decoder.decode([1], False)) == b"\xe4"
    assert decoder.token_bytes(2, decoder.decode([2], False)) == b" hello"
