"""JSON mode: the recognizer against Python's json module, the masks against a check of every
token, and requests through the engine that may only say JSON."""

import json
import re
import random

import numpy as np
import pytest

from streamserve import LLM, SamplingParams, StructuredOutputsParams
from streamserve.engine import structured_output as so
from streamserve.frontend.renderer import load_tokenizer
from streamserve.sampling_params import ParamError

JSON = StructuredOutputsParams(json_object=True)


def complete(text: str, start=so.START) -> bool:
    return so.is_complete(so.advance(start, text))


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
        states = so.START
        for i, ch in enumerate(text):
            assert states and not so.is_complete(states), (text, i)
            states = so.advance(states, ch)
        assert so.is_complete(states), text
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
    return so.Vocabulary(load_tokenizer(llama_dir), 400)  # the model's rows past the tokenizer too


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
    assert len(deep[0][0][1]) > vocabulary.stack_depth
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


# ---- JSON schemas and choices -------------------------------------------------------------

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                      "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": ["string", "null"]},
                                      "c": {"const": {"x": [1, 2]}}, "d": {"type": "boolean"}},
     "required": ["d"], "additionalProperties": False},
    {"anyOf": [{"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}},
                "required": ["kind", "r"]},
               {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "integer"}},
                "required": ["kind", "side"]}]},
    {"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"},
                                                        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                        "required": ["v"]}},
     "$ref": "#/$defs/node"},
    {"type": "array", "items": {"type": "object", "additionalProperties": {"type": "integer"}},
     "minItems": 1, "maxItems": 3},
    {"enum": [1, 12, "x", None, True]},
    {"type": "integer"},
    {"type": "object", "properties": {"when": {"type": "string", "format": "date-time", "title": "When"},
                                      "any": {}, "n": {"oneOf": [{"type": "integer"}, {"type": "null"}]}}},
    {"type": ["string", "integer"], "enum": ["a", 1.5, 2.0, True]},
    {"enum": [3, 4], "const": 3},
]


def random_walk(states, alphabet: str, rng: random.Random, limit: int = 400):
    """Characters the recognizer accepts, at random, until it may stop (or `limit`): the text."""
    text = ""
    closers = set('"}]0123456789el')
    while len(text) < limit:
        if so.is_complete(states) and rng.random() < 0.3:
            return text
        options = [c for c in alphabet if so.advance(states, c)]
        if not options:
            return text
        urgent = [c for c in options if c in closers]
        ch = rng.choice(urgent if urgent and len(text) > 60 and rng.random() < 0.7 else options)
        states = so.advance(states, ch)
        text += ch
    return text


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_what_a_schema_lets_through_is_valid_under_it(index):
    """Random walks through the recognizer: every whole output is JSON that the jsonschema
    package validates against the schema."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = SCHEMAS[index]
    start = so.start(so.compile_schema(schema))
    alphabet = sorted(set(json.dumps(schema)) | set('{}[]",: \n0123456789-.eE+truefalsnxy\\'))
    rng = random.Random(index)
    whole = 0
    for _ in range(150):
        text = random_walk(start, alphabet, rng)
        if complete(text, start):
            whole += 1
            jsonschema.validate(json.loads(text), schema)
    assert whole >= 30


@pytest.mark.parametrize("index, text, ok", [
    (0, '{"name": "bob", "age": 3}', True),
    (0, json.dumps({"name": "x", "age": -1, "tags": ["a", "b"]}, indent=2), True),
    (0, '{"name": "x", "age": 1, "tags": []}', True),
    (0, '{"age": 3, "name": "bob"}', False),  # out of the schema's order
    (0, '{"name": "bob"}', False),  # a required property missing
    (0, '{"name": "bob", "age": 3.5}', False),
    (0, '{"name": "bob", "age": 3, "tags": ["a", "b", "a"]}', False),  # maxItems
    (0, '{"name": "bob", "age": 3, "x": 1}', False),  # not listed
    (0, '{"name": "bob", "name": "bob", "age": 3}', False),
    (1, '{"d": true}', True),
    (1, '{"a": -1.5e3, "b": null, "c": {"x":[1,2]}, "d": false}', True),
    (1, '{"c": {"x": [1, 2]}, "d": false}', False),  # a const is written compactly
    (2, '{"kind": "square", "side": 2}', True),
    (2, '{"kind": "circle", "r": 0.5}', True),
    (2, '{"kind": "circle", "side": 2}', False),
    (3, '{"v": 1, "kids": [{"v": 2, "kids": []}, {"v": 3}]}', True),
    (3, '{"v": 1, "kids": [{"kids": []}]}', False),
    (4, '[{"a": 1, "b": 2}, {}]', True),
    (4, '[]', False),
    (4, '[{"a": "1"}]', False),
    (5, '12', True), (5, '1', True), (5, '"x"', True), (5, 'null', True), (5, '2', False),
    (6, '-42', True), (6, '4.2', False), (6, '04', False),
    (7, '{}', True), (7, '{"when": "2026-11-30", "any": [{"k": null}], "n": 5}', True),
    (8, '"a"', True), (8, '2.0', True), (8, '1', False), (8, '"b"', False),  # the type filters the enum
    (9, '3', True), (9, '4', False),  # const within the enum
])
def test_a_schema_admits_its_values_in_order(index, text, ok):
    start = so.start(so.compile_schema(SCHEMAS[index]))
    assert complete(text, start) == ok, text


@pytest.mark.parametrize("schema, words", [
    ({"type": "string", "pattern": "a(?=b)"}, "lookahead"), ({"type": "string", "pattern": 5}, "must be a string"),
    ({"type": "string", "pattern": "a{5}", "maxLength": 3}, "no text matches both"),
    ({"type": "string", "minLength": 3, "maxLength": 2}, "more than maxLength"),
    ({"type": "string", "minLength": -1}, "non-negative integer"),
    ({"type": "string", "maxLength": 10 ** 6}, "maxLength 1000000 is past what is supported"),
    ({"type": "integer", "minimum": 0}, "'minimum'"),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": True}, "additionalProperties beside"),
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]}, "'b'"),
    ({"$ref": "#/$defs/missing"}, "points at nothing"),
    ({"$ref": "https://example.com/s.json"}, "within the schema"),
    ({"type": "array", "items": [{}, {}]}, "tuples"),
    ({"type": "array", "minItems": 3, "maxItems": 2}, "no array fits"),
    ({"type": "thing"}, "unknown type"),
    ({"enum": []}, "a list of 1 to"), ({"enum": ["a"], "type": "integer"}, "no value satisfies"),
    ({"enum": list(range(2000))}, "a list of 1 to"),
    ({"type": "object", "properties": {f"p{i}": {} for i in range(20000)}}, "more than 1024 properties"),
    ({"type": "object", "properties": {"a": {}}, "const": {"a": 1}}, "const beside properties"),
    ({"$ref": "#"}, "refers only to itself"), ({"anyOf": [{"$ref": "#"}]}, "refers only to itself"),
    ({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/b"}]}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
     "refers only to itself"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "use anyOf"),
    ({"oneOf": [{"type": "string"}, {}]}, "use anyOf"),
    ({"oneOf": [{"type": "object", "properties": {"a": {}}}, {"type": "object", "properties": {"b": {}}}]}, "use anyOf"),
    ({"oneOf": [{"enum": [1, 2]}, {"const": 1.0}]}, "use anyOf"),
    ({"$defs": {"a": [{"type": "string"}]}, "$ref": "#/$defs/a/\u00b2"}, "points at nothing"),
    ({"type": "object", "additionalProperties": 0}, "true, false or a schema"),
    ("[" * 100000, "nests deeper"),
    ({"allOf": [{"type": "string"}, {"type": "null"}]}, "one schema only"),
    ({"$ref": "#", "type": "string"}, "beside other keywords"),
    ("{not json", "not JSON"),
])
def test_what_a_schema_says_that_cannot_be_held_to_is_refused(schema, words):
    with pytest.raises(ParamError, match=re.escape(words)):
        StructuredOutputsParams(json=schema)


def test_structured_outputs_asks_for_exactly_one_thing():
    for kwargs in ({}, {"json": {}, "choice": ["a"]}, {"json_object": True, "choice": ["a"]}):
        with pytest.raises(ParamError, match="one of"):
            StructuredOutputsParams(**kwargs)
    for choice in ([], ["a", ""], "ab", [1]):
        with pytest.raises(ParamError, match="choice"):
            StructuredOutputsParams(choice=choice)


def test_a_choice_that_another_extends_may_end_or_go_on():
    start = so.start_choice(["yes", "yes please", "no"])
    assert complete("yes", start) and complete("yes please", start) and complete("no", start)
    assert not complete("yes p", start) and so.advance(start, "maybe") is None
    assert so.advance(start, " yes") is None  # plain text: no whitespace of its own


def test_a_schema_state_mask_matches_a_check_of_every_token(vocabulary):
    """Masks of schema states (a listed key half written, a union of two objects both alive, a
    top-level number that may end) against every token checked; the request's ends where the
    output may stop."""
    stops = (2, frozenset())
    cases = [(0, '{"na'), (0, '{"name": "bob", '), (2, '{'), (2, '{"kind": "'), (5, '1'), (6, '-3'), (3, '{"v": 1, "kids": [')]
    for index, prefix in cases:
        states = so.advance(so.start(so.compile_schema(SCHEMAS[index])), prefix)
        expected = np.array([bool(text) and so.advance(states, text) is not None for text in vocabulary.texts])
        expected[2] = so.is_complete(states)
        mask = vocabulary.allowed(states, *stops)
        assert (mask == expected).all(), (prefix, [vocabulary.texts[i] for i in np.flatnonzero(mask != expected)])
    assert len(so.advance(so.start(so.compile_schema(SCHEMAS[2])), "{")) == 2  # both objects alive


def test_a_schema_is_compiled_once_for_requests_alike():
    a = so.start_states(StructuredOutputsParams(json=SCHEMAS[3]))
    b = so.start_states(StructuredOutputsParams(json=json.dumps(SCHEMAS[3])))
    assert a == b and a[0][2] is b[0][2]


def test_schema_and_choice_outputs_through_the_engine(llama_dir):
    """A random model sampling under a schema of closed values writes outputs the jsonschema
    package validates, ended with EOS; under a choice, one of the choices."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 30]},
                                               "list": {"type": "array", "items": {"type": "null"}, "maxItems": 3}},
              "required": ["ok", "n"]}
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB")
    texts = so.token_texts(llm.get_tokenizer(), 400)
    no_spaces = {t: -100.0 for t, text in enumerate(texts) if text and text.isspace()}  # a random model idles in them
    structured = StructuredOutputsParams(json=schema)
    params = [SamplingParams(max_tokens=80, temperature=1.0, seed=seed, structured_outputs=structured,
                             logit_bias=no_spaces) for seed in range(8)]
    for out in (o.outputs[0] for o in llm.generate(["hello"] * 8, params, use_tqdm=False)):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
    choices = ["red", "green", "blue"]
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=0, n=6,
                            structured_outputs=StructuredOutputsParams(choice=choices))
    outs = llm.generate("hello", params, use_tqdm=False)[0].outputs
    assert all(o.text in choices and o.finish_reason == "stop" for o in outs), [o.text for o in outs]


def test_deep_nesting_of_schemas_is_refused_not_a_crash():
    deep: dict = {}
    for _ in range(2000):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ParamError, match="nests deeper"):
        StructuredOutputsParams(json=deep)
    with pytest.raises(ParamError, match="true or false"):
        StructuredOutputsParams(json_object=0)


@pytest.mark.parametrize("schema, text", [
    ({"oneOf": [{"type": "integer"}, {"type": "null"}]}, "null"),
    ({"oneOf": [{"type": "object", "properties": {"kind": {"const": "a"}, "x": {"type": "integer"}},
                 "required": ["kind"]},
                {"type": "object", "properties": {"kind": {"const": "b"}}, "required": ["kind"]}]}, '{"kind": "b"}'),
    ({"$defs": {"r": {"type": "array", "items": {"$ref": "#"}}}, "$ref": "#/$defs/r"}, "[[], [[]]]"),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"type": "array", "items": {"$ref": "#/$defs/a"}}},
      "$ref": "#/$defs/a"}, "[[[]]]"),
])
def test_disjoint_one_ofs_and_chains_of_refs_compile(schema, text):
    """oneOf whose alternatives cannot both fit (they begin differently, or a required const
    tells them apart); a $ref to a $ref still being compiled is what it refers to."""
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(json.loads(text), schema)
    assert complete(text, so.start(so.compile_schema(schema)))


def test_alike_alternatives_nested_deep_keep_a_bounded_number_of_states(vocabulary):
    """Two alternatives that begin alike, recursing: the states alive would double with each
    level; they stay at MAX_STATES, and what is left still reads only valid output."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"anyOf": [{"type": "array", "items": {"$ref": "#"}}, {"type": "array", "items": {"$ref": "#"}}]}
    start = so.start(so.compile_schema(schema))
    states = so.advance(start, "[" * 20)
    assert 1 < len(states) <= so.MAX_STATES
    assert vocabulary.allowed(states, 2, frozenset()).any()
    text = "[" * 20 + "]" * 20
    assert complete(text, start)
    jsonschema.validate(json.loads(text), schema)


# -- regular expressions: vLLM's structured_outputs regex, and a string's pattern / length ----


def test_a_regex_output_is_a_prefix_until_it_matches_whole():
    start = so.start_states(StructuredOutputsParams(regex=r"\d{4}-\d{2}-\d{2}( \w+)?"))
    assert complete("2024-01-31", start) and complete("2024-01-31 noon", start)
    assert so.advance(start, "2024-01-3") is not None and not complete("2024-01-3", start)
    assert so.advance(start, "2024-1-") is None and so.advance(start, " 2024") is None
    for regex, words in (("a(?=b)", "lookahead"), (r"(a)\1", "backreference"), ("a{3,2}", "min repeat greater than max"), (5, "string")):
        with pytest.raises(ParamError, match=re.escape(words)):
            StructuredOutputsParams(regex=regex)
    with pytest.raises(ParamError, match="one of"):
        StructuredOutputsParams(regex="a", choice=["a"])


@pytest.mark.parametrize("schema, text, ok", [
    ({"type": "string", "pattern": "^[a-z]+$", "minLength": 2, "maxLength": 4}, '"abcd"', True),  # both hold
    ({"type": "string", "pattern": "^[a-z]+$", "minLength": 2, "maxLength": 4}, '"abcde"', False),
    ({"type": "string", "pattern": "^[a-z]+$", "minLength": 2, "maxLength": 4}, '"a"', False),
    ({"type": "string", "pattern": "^[a-z]+$", "minLength": 2, "maxLength": 4}, '"aB"', False),
    ({"type": "string", "pattern": "", "maxLength": 4}, '""', True),
    ({"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"}, '"bob@example.com"', True),
    ({"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"}, '"bob@example.co"', False),
    ({"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"}, '"Bob@example.com"', False),
    ({"type": "string", "pattern": "a\nb|\"q\"|\\\\"}, '"a\\nb"', True),  # escapes are read as their characters
    ({"type": "string", "pattern": "a\nb|\"q\"|\\\\"}, '"\\"q\\""', True),
    ({"type": "string", "pattern": "a\nb|\"q\"|\\\\"}, '"\\\\"', True),
    ({"type": "string", "pattern": "a\nb|\"q\"|\\\\"}, '"a\\u000ab"', True),
    ({"type": "string", "pattern": "\u00e9+"}, '"\u00e9\\u00e9"', True),
    ({"type": "string", "pattern": "\\d+"}, '"12a"', False),
    ({"type": "string", "minLength": 2, "maxLength": 3}, '"ab"', True),
    ({"type": "string", "minLength": 2, "maxLength": 3}, '"a\\"c"', True),
    ({"type": "string", "minLength": 2, "maxLength": 3}, '"a"', False),
    ({"type": "string", "minLength": 2, "maxLength": 3}, '"abcd"', False),
    ({"type": "string", "maxLength": 1}, '"\\ud83d\\ude00"', False),  # a surrogate is half a character
    ({"type": "string", "maxLength": 1}, '"\U0001f600"', True),
    ({"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}\\d{3}$"},
                                       "tag": {"type": "string", "maxLength": 2}}, "required": ["id"]},
     '{"id": "AB123", "tag": "xy"}', True),
    ({"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{2}\\d{3}$"}}}, '{"id": "AB12"}', False),
])
def test_a_strings_pattern_and_length_hold_its_text(schema, text, ok):
    start = so.start(so.compile_schema(schema))
    assert complete(text, start) == ok, text
    if ok:  # and the value is one the schema admits, by JSON Schema's own reading
        jsonschema = pytest.importorskip("jsonschema")
        jsonschema.validate(json.loads(text), schema)


def test_regex_and_pattern_masks_match_a_check_of_every_token(vocabulary):
    stops = (2, frozenset())
    cases = [(so.start_states(StructuredOutputsParams(regex=r"(yes|no)[.!]?|\d{1,3}")), ["", "y", "ye", "yes", "4"]),
             (so.start(so.compile_schema({"type": "object", "properties": {
                 "w": {"type": "string", "pattern": "^[a-z ]{0,12}$"}}, "required": ["w"]})),
              ['{"w": "', '{"w": "ab c', '{"w": "abcdefghijkl', '{"w": "a\\'])]
    for start, prefixes in cases:
        for prefix in prefixes:
            states = so.advance(start, prefix)
            expected = np.array([bool(text) and so.advance(states, text) is not None for text in vocabulary.texts])
            expected[2] = so.is_complete(states)
            mask = vocabulary.allowed(states, *stops)
            assert (mask == expected).all(), (prefix, [vocabulary.texts[i] for i in np.flatnonzero(mask != expected)])


def test_regex_and_pattern_outputs_through_the_engine(llama_dir):
    """A random model sampling under a regex writes text that re.fullmatch takes, ended with EOS;
    under a schema with a pattern and lengths, JSON that jsonschema validates."""
    jsonschema = pytest.importorskip("jsonschema")
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB")
    regex = r"(red|green|blue)-\d{2,3}"
    params = [SamplingParams(max_tokens=30, temperature=1.0, seed=seed,
                             structured_outputs=StructuredOutputsParams(regex=regex)) for seed in range(6)]
    for out in (o.outputs[0] for o in llm.generate(["hello"] * 6, params, use_tqdm=False)):
        assert re.fullmatch(regex, out.text) and out.finish_reason == "stop", out.text
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[a-f0-9]{4}$"},
                                               "name": {"type": "string", "minLength": 1, "maxLength": 6}},
              "required": ["code", "name"], "additionalProperties": False}
    texts = so.token_texts(llm.get_tokenizer(), 400)
    no_spaces = {t: -100.0 for t, text in enumerate(texts) if text and text.isspace()}
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=seed, logit_bias=no_spaces,
                             structured_outputs=StructuredOutputsParams(json=schema)) for seed in range(6)]
    for out in (o.outputs[0] for o in llm.generate(["hello"] * 6, params, use_tqdm=False)):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


def test_a_patterned_strings_escape_begins_only_where_its_character_could_follow():
    """Every state a patterned string reaches can be finished: an escape begins only where the
    regex takes another character, and each hex digit of \\u only where the codes it leaves
    open hold one the regex takes (not a surrogate: half a character)."""
    letters = so.start(so.compile_schema({"type": "string", "pattern": "^[a-z]{0,2}$"}))
    assert so.advance(letters, '"\\u006') is not None and complete('"\\u0061\\u007a"', letters)
    for dead in ('"\\uB', '"\\u01', '"\\u0041', '"ab\\', '"\\n'):
        assert so.advance(letters, dead) is None, dead
    anything = so.start(so.compile_schema({"type": "string", "maxLength": 1}))
    assert so.advance(anything, '"\\uD8') is None and so.advance(anything, '"\\uD7') is not None
    assert so.advance(anything, '"x\\') is None and complete('"\\t"', anything)


# -- a reasoning model's <think> block before the structure (--reasoning-parser) ---------------


def test_a_think_block_is_free_and_the_structure_starts_after_it():
    inside = so.start_states(StructuredOutputsParams(json_object=True, thinking="inside"))
    assert complete('plan: {not json} < </th </think>{"a": 1}', inside)
    assert not complete('{"a": 1}', inside)  # still thinking: no end yet
    assert so.advance(inside, 'x</think>[1]') is None  # after the block, the structure holds
    may = so.start_states(StructuredOutputsParams(regex="ab+", thinking="may"))
    assert complete("abb", may) and complete(" \n<think>x</think>ab", may)  # it opens one, or not
    assert so.advance(may, "x<think>") is None and not complete("<think>ab", may)
    with pytest.raises(ParamError, match="thinking"):
        StructuredOutputsParams(json_object=True, thinking="yes")


def test_think_block_masks_match_a_check_of_every_token(vocabulary):
    stops = (2, frozenset())
    inside = so.start_states(StructuredOutputsParams(json=SCHEMAS[0], thinking="inside"))
    may = so.start_states(StructuredOutputsParams(json_object=True, thinking="may"))
    for start, prefix in [(inside, ""), (inside, "some thought <"), (inside, "a </thi"), (inside, "x</think>"),
                          (may, ""), (may, " <th"), (may, "<think>hm")]:
        states = so.advance(start, prefix)
        expected = np.array([bool(text) and so.advance(states, text) is not None for text in vocabulary.texts])
        expected[2] = so.is_complete(states)
        mask = vocabulary.allowed(states, *stops)
        assert (mask == expected).all(), (prefix, [vocabulary.texts[i] for i in np.flatnonzero(mask != expected)])


def test_a_patterns_keywords_without_a_type_hold_strings_and_let_other_values_pass():
    for schema, wrong in (({"pattern": "^[a-z]+$"}, '"A"'), ({"minLength": 2}, '"a"')):
        start = so.start(so.compile_schema(schema))
        assert complete('"abc"', start) and complete("5", start) and complete('{"k": [true]}', start)
        assert not complete(wrong, start)
    nested = so.start(so.compile_schema({"type": "object", "properties": {"id": {"pattern": "^[0-9]{3}$"}},
                                         "required": ["id"]}))
    assert complete('{"id": "123"}', nested) and complete('{"id": 7}', nested) and not complete('{"id": "abc"}', nested)


def test_regexes_of_the_same_classes_share_a_trie_and_tries_stay_within_their_budget(vocabulary, monkeypatch):
    a, b = so.compile_regex("[a-z]+"), so.compile_regex("[a-z]{3}x?")
    c = so.compile_regex("[a-z]{2,9}")
    assert vocabulary._trie(a, plain=False) is vocabulary._trie(c, plain=False)  # the same classes
    assert vocabulary._trie(b, plain=False) is not vocabulary._trie(a, plain=False)  # ("x" is a class of its own)
    monkeypatch.setattr(so, "TRIE_CACHE_NODES", 1)  # over budget: only the newest stays
    vocabulary._trie(so.compile_regex("[0-9]+"), plain=True)
    assert len(vocabulary.tries) == 1 and vocabulary.trie_nodes == len(next(iter(vocabulary.tries.values())).children)


def test_a_regex_never_allows_a_piece_of_a_character(vocabulary):
    """Byte-level BPE's tokens of part of a character read as U+FFFD: a regex would count each
    as a character, so regex and patterned-string states leave them out (plain strings keep
    them: JSON takes the whole character they make)."""
    pieces = np.array(["\ufffd" in text for text in vocabulary.texts])
    assert pieces.any()
    stops = (2, frozenset())
    for start, prefix in ((so.start_regex(r"[\s\S]{0,5}"), ""),
                          (so.start(so.compile_schema({"type": "string", "maxLength": 5})), '"')):
        assert not (vocabulary.allowed(so.advance(start, prefix), *stops) & pieces).any()
    plain = so.advance(so.start(so.compile_schema({"type": "string"})), '"')
    assert (vocabulary.allowed(plain, *stops) & pieces).any()
