"""JSON mode: the recognizer against Python's json module, the masks against a check of every
token, and requests through the engine that may only say JSON."""

import json
import random

import numpy as np
import pytest

from streamserve import LLM, SamplingParams, StructuredOutputsParams
from streamserve.engine import structured_output as so
from streamserve.frontend.renderer import load_tokenizer
from streamserve.sampling_params import ParamError

JSON = StructuredOutputsParams(json_object=True)


def complete(text: str) -> bool:
    state = so.advance(so.START, text)
    return state is not None and state[0] == so.DONE


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.choice([True, False, None])
    if kind == 1:
        return rng.choice([0, -7, 12345678901234, 0.5, -1.25e-7, 3e20])
    if kind in (2, 3):
        return "".join(rng.choice('ab"\\/\n\t\u00e9\u4f60\U0001f600 \x01') for _ in range(rng.randrange(6)))
    if kind == 4:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {f"k{i}": random_value(rng, depth + 1) for i in range(rng.randrange(4))}


def test_every_prefix_of_a_json_object_is_accepted_and_only_the_whole_completes():
    rng = random.Random(0)
    for case in range(300):
        value = {f"key {i}": random_value(rng) for i in range(rng.randrange(4))}
        text = json.dumps(value, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 2]),
                          separators=rng.choice([None, (",", ":")]))
        state = so.START
        for i, ch in enumerate(text):
            assert state is not None and state[0] != so.DONE, (text, i)
            state = so.step(state, ch)
        assert state is not None and state[0] == so.DONE, text
        assert json.loads(text) == value


def test_the_recognizer_completes_exactly_what_json_loads_reads_as_an_object():
    """Random strings over JSON's characters: complete <=> json.loads gives a dict (with no
    whitespace after it, none of Python's NaN/Infinity, and whitespace runs of at most 32)."""
    rng = random.Random(1)
    pieces = ['{', '}', '[', ']', '"', ':', ',', ' ', '\n', '0', '1', '-', '.', 'e', '+', 'a', '\\', 'u',
              'true', 'null', 'fals', '"a"', '"b":', '1.5', '\\n', '\\u00e9', '\x01']
    agree = done = 0
    for case in range(20000):
        text = "{" + "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 9)))
        try:
            expected = isinstance(json.loads(text), dict) and not text[-1].isspace()
        except ValueError:
            expected = False
        assert complete(text) == expected, repr(text)
        agree += 1
        done += expected
    assert done > 100  # the cases did reach whole objects


@pytest.mark.parametrize("text", ['[1]', '"a"', '{"a":01}', '{"a": 1,}', '{"a" 1}', '{"a": "x\ny"}',
                                  '{"a": trux', '{"a": 1.}', '{"a": -}', "{'a': 1}", '{"a": 1}}', '{"a": "\\x"}',
                                  '{"a": "\\u12g4"}', '{"a": NaN}', '{,}', '{"a": 1e}'])
def test_what_cannot_be_a_json_object_is_refused(text):
    assert so.advance(so.START, text) is None


def test_whitespace_runs_are_capped():
    assert so.advance(so.START, "{" + " " * so.MAX_WHITESPACE) is not None
    assert so.advance(so.START, "{" + " " * (so.MAX_WHITESPACE + 1)) is None
    assert complete('{"a": "' + " " * 100 + '"}')  # inside strings, any number


@pytest.fixture(scope="module")
def vocabulary(llama_dir):
    return so.JsonVocabulary(load_tokenizer(llama_dir), 400)  # the model's rows past the tokenizer too


def test_masks_match_a_check_of_every_token(vocabulary):
    stops = (2, frozenset())
    for prefix in ['', '{', '{"', '{"a', '{"a"', '{"a":', '{"a": 1', '{"a": [', '{"a": [tr', '{"a": "\\',
                   '{"a": "\\u0', '{"a": {"b": [1, {"c": ', '{' + ' ' * so.MAX_WHITESPACE, '{"a": 1.5e']:
        state = so.advance(so.START, prefix)
        expected = np.array([bool(text) and so.advance(state, text) is not None for text in vocabulary.texts])
        mask = vocabulary.allowed(state, *stops)
        assert (mask == expected).all(), (prefix, [vocabulary.texts[i] for i in np.flatnonzero(mask != expected)])
        assert vocabulary.allowed(state, *stops) is mask  # cached
    done = so.advance(so.START, "{}")
    assert np.flatnonzero(vocabulary.allowed(done, 2, frozenset({7}))).tolist() == [2, 7]
    assert np.flatnonzero(vocabulary.allowed(done, None, frozenset({7}))).tolist() == [7]
    assert vocabulary.texts[2] == "" and vocabulary.texts[399] == ""  # special, and past the tokenizer


def test_a_mask_cached_by_its_stack_top_serves_deeper_stacks(vocabulary):
    """Keys hold the stack's top down to the most closing brackets any token has: states that
    differ below it share a mask, and it is the right one for each."""
    deep = [so.advance(so.START, '{"a": ' + "[" * k + '{"b": {"c": {"d": ') for k in (5, 6)]
    assert len(deep[0][1]) > vocabulary.stack_depth
    assert vocabulary.allowed(deep[0], 2, frozenset()) is vocabulary.allowed(deep[1], 2, frozenset())
    shallow = so.advance(so.START, '{"a": {')
    closes = [i for i, t in enumerate(vocabulary.texts) if t == "}"]
    assert vocabulary.allowed(shallow, 2, frozenset())[closes].all()


def test_json_mode_output_is_json_and_ends_with_eos(llama_dir):
    """Forced to close ('}' favoured), the object ends, then only EOS may follow: "{}" and
    "stop". Without JSON mode the same bias writes '}' on and on."""
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB")
    tok = llm.get_tokenizer()
    close, open_ = tok.convert_tokens_to_ids("}"), tok.convert_tokens_to_ids("{")
    bias = {close: 100.0, open_: 50.0}
    out = llm.generate("hello", SamplingParams(max_tokens=8, temperature=0, logit_bias=bias,
                                               structured_outputs=JSON), use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason) == ("{}", "stop")
    assert out.token_ids[-1] == tok.eos_token_id and len(out.token_ids) == 3
    free = llm.generate("hello", SamplingParams(max_tokens=8, temperature=0, logit_bias=bias),
                        use_tqdm=False)[0].outputs[0]
    assert free.text == "}" * 8


def test_sampled_json_mode_outputs_stay_json(llama_dir):
    """A random model sampling freely: every output is a prefix of a JSON object, and the ones
    that stopped are whole objects. Logprobs are those of the constrained distribution."""
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB")
    params = [SamplingParams(max_tokens=60, temperature=1.5, seed=seed, logprobs=2, structured_outputs=JSON)
              for seed in range(24)]
    outs = llm.generate(["hello"] * 24, params, use_tqdm=False)
    stopped = 0
    for out in (o.outputs[0] for o in outs):
        assert so.advance(so.START, out.text) is not None, out.text
        if out.finish_reason == "stop":
            stopped += 1
            assert isinstance(json.loads(out.text), dict)
        for token, entry in zip(out.token_ids, out.logprobs):
            assert entry[token].logprob > -100 and min(lp.logprob for lp in entry.values()) >= -9999.0
    assert stopped >= 1


def test_json_mode_refuses_what_would_fight_it():
    for kwargs in ({"min_tokens": 3}, {"ignore_eos": True}):
        with pytest.raises(ParamError):
            SamplingParams(structured_outputs=JSON, **kwargs)
    with pytest.raises(ParamError, match="json_object=True"):
        StructuredOutputsParams()


def test_a_preempted_json_request_keeps_its_place_in_the_object(llama_dir):
    """The recognizer's state lives in the scheduler's Request: preempted and recomputed,
    seeded JSON-mode requests write what they write with room to spare."""
    params = [SamplingParams(max_tokens=120, temperature=1.3, seed=s, structured_outputs=JSON) for s in range(12)]
    roomy = LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB")
    tight = LLM(llama_dir, dtype="float32", num_gpu_blocks_override=24, max_model_len=256)
    expected = [o.outputs[0].text for o in roomy.generate(["hello there"] * 12, params, use_tqdm=False)]
    assert [o.outputs[0].text for o in tight.generate(["hello there"] * 12, params, use_tqdm=False)] == expected
    assert tight.engine_core.scheduler.num_preemptions > 0


def test_sentencepiece_byte_fallback_keeps_only_ascii_bytes():
    """SentencePiece's decoder turns a run of byte tokens that is not whole UTF-8 into U+FFFD,
    ASCII bytes after it too: <0xC3> then <0x22> is no quote. Non-ASCII byte tokens are never
    allowed; ASCII ones are their character; leading spaces count."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    words = ["\u2581", "{", "}", '"', ":", "a", "\u2581a", '\u2581"', "\u00e9"]
    sp = Tokenizer(models.Unigram([(p, 0.0) for p in pieces] + [(w, -1.0) for w in words], unk_id=0,
                                  byte_fallback=True))
    sp.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    sp.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    sp.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    tok = PreTrainedTokenizerFast(tokenizer_object=sp, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    texts = so.token_texts(tok, 280)
    byte = {b: 3 + b for b in range(256)}
    assert texts[byte[0x22]] == '"' and texts[byte[0x0A]] == "\n"
    assert texts[byte[0xC3]] == texts[byte[0xA9]] == "" and texts[0] == texts[2] == ""
    by_piece = dict(zip(tok.convert_ids_to_tokens(list(range(len(tok)))), texts))
    assert by_piece['\u2581"'] == ' "' and by_piece["\u00e9"] == "\u00e9" and by_piece["a"] == "a"


def test_json_mode_needs_an_end(llama_dir):
    """Without EOS or stop token IDs nothing could follow the closed object: refused, not left
    to sample from an all-ruled-out row."""
    from streamserve.engine.request import EngineCoreRequest

    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB")
    with pytest.raises(ParamError, match="EOS"):
        llm.engine_core.validate(EngineCoreRequest("x", [5, 6], SamplingParams(structured_outputs=JSON), None, 0.0))
    llm.engine_core.validate(EngineCoreRequest("x", [5, 6], SamplingParams(structured_outputs=JSON,
                                                                           stop_token_ids=[7]), None, 0.0))
