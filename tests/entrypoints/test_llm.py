"""The offline API, LLM.generate / LLM.chat, on the tiny random Llama: prompt forms,
per-prompt params, ordering, text, chat, n, seeds, stops, logprobs, errors, no leaks."""

from __future__ import annotations

import json
import random
import shutil
from typing import Optional

import pytest

from streamserve import LLM, SamplingParams
from streamserve.outputs import RequestOutput

PROMPTS = ["Hello world", "The quick brown fox", "Paris is the capital of", "Once upon a time",
           "def add(a, b):", "Streaming servers send"]


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(llama_dir, dtype="float32", kv_cache_memory="32MiB")


@pytest.fixture(scope="module")
def small_llm(llama_dir) -> LLM:
    """max_model_len of 32, for the length limits."""
    return LLM(llama_dir, dtype="float32", max_model_len=32, num_gpu_blocks_override=8)


@pytest.fixture(scope="module")
def tok(llm):
    return llm.get_tokenizer()


def greedy(max_tokens: int = 16, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def only(outputs: list[RequestOutput]):
    assert len(outputs) == 1
    assert len(outputs[0].outputs) == 1
    return outputs[0].outputs[0]


def assert_clean(llm: LLM) -> None:
    """Nothing queued, nothing tracked, every KV block back in the pool."""
    assert not llm.engine_core.has_unfinished_requests()
    assert not llm.output_processor.has_unfinished_requests()
    assert llm.output_processor.child_to_sample == {}
    kv = llm.engine_core.scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks == llm.engine_core.model_runner.num_blocks
    assert kv.req_to_blocks == {}


def chat_ids(tok, conversation) -> list[int]:
    ids = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


_greedy_cache: dict = {}


def reference(llm: LLM, prompt: str, n: int = 24) -> list[int]:
    """The prompt's greedy tokens (EOS ignored), computed once."""
    key = (id(llm), prompt, n)
    if key not in _greedy_cache:
        _greedy_cache[key] = only(llm.generate(prompt, greedy(n), use_tqdm=False)).token_ids
    return _greedy_cache[key]


# -- prompt forms and params -------------------------------------------------------


def test_generate_accepts_every_prompt_form(llm, tok):
    a, b = PROMPTS[0], PROMPTS[1]
    ids_a, ids_b = tok.encode(a), tok.encode(b)
    ref_a, ref_b = reference(llm, a, 8), reference(llm, b, 8)
    p = greedy(8)

    out = llm.generate(a, p, use_tqdm=False)
    assert only(out).token_ids == ref_a
    assert out[0].prompt == a and out[0].prompt_token_ids == ids_a

    out = llm.generate([a, b], p, use_tqdm=False)
    assert [o.prompt for o in out] == [a, b]
    assert [o.outputs[0].token_ids for o in out] == [ref_a, ref_b]

    out = llm.generate(ids_a, p, use_tqdm=False)  # one prompt as token IDs
    assert only(out).token_ids == ref_a
    assert out[0].prompt is None and out[0].prompt_token_ids == ids_a

    out = llm.generate([ids_a, ids_b], p, use_tqdm=False)
    assert [o.prompt_token_ids for o in out] == [ids_a, ids_b]
    assert [o.outputs[0].token_ids for o in out] == [ref_a, ref_b]

    out = llm.generate({"prompt_token_ids": ids_b}, p, use_tqdm=False)
    assert only(out).token_ids == ref_b and out[0].prompt_token_ids == ids_b

    out = llm.generate([{"prompt_token_ids": ids_a}, {"prompt": b}], p, use_tqdm=False)
    assert [o.prompt_token_ids for o in out] == [ids_a, ids_b]
    assert out[1].prompt == b
    assert [o.outputs[0].token_ids for o in out] == [ref_a, ref_b]

    assert llm.generate([], p, use_tqdm=False) == []
    assert_clean(llm)


def test_default_sampling_params_give_16_tokens(llm):
    out = only(llm.generate(PROMPTS[2], use_tqdm=False))
    # Unless the random model happens to emit EOS, the default max_tokens (16) applies.
    assert len(out.token_ids) == 16 or out.finish_reason == "stop"
    assert len(out.token_ids) <= 16


def test_one_sampling_params_per_prompt(llm):
    params = [greedy(3), greedy(7), greedy(5, logprobs=0)]
    out = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [3, 7, 5]
    assert [o.outputs[0].finish_reason for o in out] == ["length"] * 3
    assert out[0].outputs[0].logprobs is None and len(out[2].outputs[0].logprobs) == 5
    assert [o.outputs[0].token_ids for o in out] == [reference(llm, PROMPTS[i])[:n]
                                                     for i, n in enumerate((3, 7, 5))]


def test_wrong_number_of_sampling_params_is_a_value_error(llm):
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate(PROMPTS[:3], [greedy(2), greedy(2)], use_tqdm=False)
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate(PROMPTS[0], [greedy(2), greedy(2)], use_tqdm=False)
    assert_clean(llm)


def test_outputs_come_back_in_input_order(llm, tok):
    # The second prompt finishes first, the first last.
    prompts = [PROMPTS[3], PROMPTS[4], PROMPTS[5]]
    params = [greedy(12), greedy(2), greedy(7)]
    out = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in out] == prompts
    assert [o.prompt_token_ids for o in out] == [tok.encode(p) for p in prompts]
    assert [len(o.outputs[0].token_ids) for o in out] == [12, 2, 7]
    assert len({o.request_id for o in out}) == 3
    assert all(o.finished for o in out)


def test_greedy_text_is_the_decoded_tokens(llm, tok):
    out = llm.generate(PROMPTS, greedy(24), use_tqdm=False)
    for o in out:
        c = o.outputs[0]
        assert c.index == 0
        assert len(c.token_ids) == 24 and c.finish_reason == "length" and c.stop_reason is None
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
        assert c.logprobs is None and c.cumulative_logprob is None
    # Batched greedy equals one-at-a-time greedy.
    assert [o.outputs[0].token_ids for o in out] == [reference(llm, p) for p in PROMPTS]


# -- chat ---------------------------------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "hello world"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "what is the answer"},
     {"role": "assistant", "content": "Paris"}, {"role": "user", "content": "and Germany?"}],
]


def test_chat_one_conversation(llm, tok):
    out = llm.chat(CONVERSATIONS[0], greedy(6), use_tqdm=False)
    ids = chat_ids(tok, CONVERSATIONS[0])
    assert out[0].prompt_token_ids == ids
    assert out[0].prompt == tok.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=True,
                                                    tokenize=False)
    assert out[0].prompt.endswith("<|im_start|>assistant\n")
    assert only(out).token_ids == only(llm.generate({"prompt_token_ids": ids}, greedy(6),
                                                    use_tqdm=False)).token_ids


def test_chat_continues_the_final_message_and_passes_template_variables(llm, tok):
    """continue_final_message leaves the last (assistant) message open for the model to go
    on with; chat_template_kwargs reach the template as variables, but not as the
    renderer's own settings."""
    conversation = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "Hello the"}]
    out = llm.chat(conversation, greedy(4), use_tqdm=False, add_generation_prompt=False,
                   continue_final_message=True)
    assert out[0].prompt == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nHello the"
    for bad in (dict(continue_final_message=True),  # with add_generation_prompt
                dict(chat_template_kwargs={"tokenize": True}), dict(chat_template_kwargs={"messages": []})):
        with pytest.raises(ValueError):
            llm.chat(conversation, greedy(1), use_tqdm=False, **bad)
    user = llm.chat(CONVERSATIONS[0], greedy(1), use_tqdm=False, add_generation_prompt=False,
                    continue_final_message=True)  # any last message, as vLLM takes it
    assert user[0].prompt == "<|im_start|>user\nhello world"
    template = tok.chat_template
    tok.chat_template = "{% if greeting %}{{ greeting }} {% endif %}{{ messages[0]['content'] }}"
    try:
        assert llm.chat(CONVERSATIONS[0], greedy(1), use_tqdm=False,
                        chat_template_kwargs={"greeting": "Dear"})[0].prompt == "Dear hello world"
    finally:
        tok.chat_template = template


def test_chat_passes_tools_and_tool_calls_to_the_template(llm, tok):
    """`tools` reach the template; an assistant's tool call arguments given as JSON text reach
    it as an object (templates write them with tojson)."""
    conversation = [{"role": "user", "content": "hi"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    template = tok.chat_template
    tok.chat_template = ("{% for t in tools %}{{ t.function.name }};{% endfor %}"
                         "{% for c in messages[1].tool_calls %}{{ c.function.name }}({{ c.function.arguments.x }})"
                         "{% endfor %}")
    try:
        assert llm.chat(conversation, greedy(1), use_tqdm=False, tools=tools)[0].prompt == "f;f(1)"
    finally:
        tok.chat_template = template


def test_chat_list_of_conversations(llm, tok):
    out = llm.chat(CONVERSATIONS, greedy(4), use_tqdm=False)
    assert len(out) == 2
    assert [o.prompt_token_ids for o in out] == [chat_ids(tok, c) for c in CONVERSATIONS]
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)
    # Per-conversation params too.
    out = llm.chat(CONVERSATIONS, [greedy(2), greedy(5)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [2, 5]


# -- n and seeds --------------------------------------------------------------------------


def _fresh_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 370) for _ in range(n)]


def test_n_samples_share_the_prompt_kv(llm):
    prompt = _fresh_prompt(40, seed=101)
    pool = llm.engine_core.scheduler.kv_cache_manager.block_pool
    hits_before = pool.prefix_cache_hits
    params = SamplingParams(n=2, seed=7, temperature=1.0, max_tokens=8, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert len(out) == 1 and out[0].prompt_token_ids == prompt
    samples = out[0].outputs
    assert [s.index for s in samples] == [0, 1]
    assert all(len(s.token_ids) == 8 and s.finish_reason == "length" for s in samples)
    assert samples[0].token_ids != samples[1].token_ids
    # Sample 1 took the two full prompt blocks sample 0 had just filled.
    assert out[0].num_cached_tokens == 32
    assert pool.prefix_cache_hits - hits_before == 32
    # Sample k draws from seed + k.
    for k in (0, 1):
        single = only(llm.generate({"prompt_token_ids": prompt},
                                   SamplingParams(seed=7 + k, temperature=1.0, max_tokens=8,
                                                  ignore_eos=True), use_tqdm=False))
        assert single.token_ids == samples[k].token_ids
    # And the whole thing repeats.
    again = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert [s.token_ids for s in again.outputs] == [s.token_ids for s in samples]
    assert_clean(llm)


def test_same_seed_same_output_whatever_the_batch(llm):
    sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=20, ignore_eos=True)
    alone = only(llm.generate(PROMPTS[0], sp, use_tqdm=False))
    assert len(set(alone.token_ids)) > 5
    batch = llm.generate(
        [PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[3]],
        [SamplingParams(temperature=1.0, max_tokens=30), sp,
         SamplingParams(temperature=0.8, top_k=5, seed=9, max_tokens=10),
         SamplingParams(temperature=0, max_tokens=3)], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone.token_ids
    assert batch[1].outputs[0].text == alone.text
    other = only(llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, seed=4321, max_tokens=20,
                                                          ignore_eos=True), use_tqdm=False))
    assert other.token_ids != alone.token_ids


def test_unseeded_sampling_varies_between_calls(llm):
    sp = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    a = only(llm.generate(PROMPTS[0], sp, use_tqdm=False)).token_ids
    b = only(llm.generate(PROMPTS[0], sp, use_tqdm=False)).token_ids
    assert a != b


# -- stops --------------------------------------------------------------------------------


def _stop_candidate(text: str, limit: int, length: int = 3) -> Optional[tuple[int, str]]:
    """(i, s): an ASCII alphanumeric substring of `text` first occurring at i >= 1,
    ending by `limit`."""
    for i in range(1, limit - length + 1):
        s = text[i:i + length]
        if s.isascii() and s.isalnum() and text.find(s) == i:
            return i, s
    return None


def _stop_case(llm, tok, n=24):
    for prompt in PROMPTS:
        tokens = reference(llm, prompt, n)
        full = tok.decode(tokens, skip_special_tokens=True)
        limit = len(tok.decode(tokens[:n - 2], skip_special_tokens=True))
        found = _stop_candidate(full, limit)
        if found:
            return prompt, tokens, full, found
    pytest.fail("no usable stop string in the greedy outputs")


def test_stop_string_cuts_the_text_before_it(llm, tok):
    prompt, tokens, full, (i, s) = _stop_case(llm, tok)
    for stop in (s, [s], ["never-in-output-\u2603", s]):
        c = only(llm.generate(prompt, greedy(24, stop=stop), use_tqdm=False))
        assert c.text == full[:i]
        assert c.finish_reason == "stop" and c.stop_reason == s
        assert len(c.token_ids) < 24 and c.token_ids == tokens[:len(c.token_ids)]
        assert s in tok.decode(c.token_ids, skip_special_tokens=True)
    assert_clean(llm)


def test_include_stop_str_in_output_keeps_it(llm, tok):
    prompt, tokens, full, (i, s) = _stop_case(llm, tok)
    c = only(llm.generate(prompt, greedy(24, stop=s, include_stop_str_in_output=True), use_tqdm=False))
    assert c.text == full[:i + len(s)]
    assert c.finish_reason == "stop" and c.stop_reason == s


def test_earliest_of_several_stop_strings_wins(llm, tok):
    prompt, tokens, full, (i, s) = _stop_case(llm, tok)
    later = _stop_candidate(full[i + len(s):], len(full) - i - len(s), length=2)
    assert later is not None
    j, t = later
    assert full.find(t) >= i + len(s)  # t first occurs after s
    c = only(llm.generate(prompt, greedy(24, stop=[t, s]), use_tqdm=False))
    assert c.stop_reason == s and c.text == full[:i]


def test_stop_string_completed_by_the_last_allowed_token_still_reports_stop(llm, tok):
    """When the token that completes a stop string is also the max_tokens-th token, the
    text is cut at the stop string, so (as in vLLM) the finish reason is "stop" with the
    stop string as stop_reason, not "length"."""
    for prompt in PROMPTS:
        tokens = reference(llm, prompt, 24)
        for n in range(24, 4, -1):
            full = tok.decode(tokens[:n], skip_special_tokens=True)
            prev = tok.decode(tokens[:n - 1], skip_special_tokens=True)
            s = full[-2:]
            if (full.startswith(prev) and len(full) > len(prev) and s.isascii() and s.isalnum()
                    and full.find(s) == len(full) - 2):
                break
        else:
            continue
        break
    else:
        pytest.fail("no usable stop string at the end of a greedy output")
    c = only(llm.generate(prompt, greedy(n, stop=s), use_tqdm=False))
    assert c.token_ids == tokens[:n]
    assert c.text == full[:-2]
    assert (c.finish_reason, c.stop_reason) == ("stop", s)


def _stop_token_case(llm, tok):
    for prompt in PROMPTS:
        tokens = reference(llm, prompt, 24)
        for k in range(2, 20):
            text = tok.decode([tokens[k]], skip_special_tokens=True)
            if tokens.index(tokens[k]) == k and text.strip() and text.isascii() and text.isprintable():
                return prompt, tokens, k
    pytest.fail("no usable stop token")


def test_stop_token_ids_end_the_request(llm, tok):
    prompt, tokens, k = _stop_token_case(llm, tok)
    stop = tokens[k]
    c = only(llm.generate(prompt, greedy(24, stop_token_ids=[stop]), use_tqdm=False))
    assert c.token_ids == tokens[:k + 1]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert_clean(llm)


def test_stop_token_text_is_left_out_unless_asked_for(llm, tok):
    """vLLM leaves the text of a stop_token_ids token out of `text` (it keeps the id in
    token_ids), unless include_stop_str_in_output is set."""
    prompt, tokens, k = _stop_token_case(llm, tok)
    stop = tokens[k]
    kept = only(llm.generate(prompt, greedy(24, stop_token_ids=[stop], include_stop_str_in_output=True),
                             use_tqdm=False))
    assert kept.text == tok.decode(tokens[:k + 1], skip_special_tokens=True)
    c = only(llm.generate(prompt, greedy(24, stop_token_ids=[stop]), use_tqdm=False))
    assert c.token_ids == tokens[:k + 1]
    assert c.text == tok.decode(tokens[:k], skip_special_tokens=True)


def test_max_tokens_ends_with_length(llm):
    c = only(llm.generate(PROMPTS[1], greedy(5), use_tqdm=False))
    assert len(c.token_ids) == 5
    assert (c.finish_reason, c.stop_reason) == ("length", None)


def test_max_tokens_none_fills_max_model_len(small_llm):
    prompt = _fresh_prompt(28, seed=5)
    c = only(small_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                                use_tqdm=False))
    assert len(c.token_ids) == 4 and c.finish_reason == "length"
    # A prompt one short of the limit gets exactly one token.
    c = only(small_llm.generate([prompt + [7, 8, 9]], greedy(16), use_tqdm=False))
    assert len(c.token_ids) == 1 and c.finish_reason == "length"
    assert_clean(small_llm)


# -- logprobs ------------------------------------------------------------------------------


def test_logprobs_three(llm, tok):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=16, logprobs=3, ignore_eos=True)
    c = only(llm.generate(PROMPTS[2], params, use_tqdm=False))
    assert len(c.logprobs) == len(c.token_ids) == 16
    saw_outside_top3 = False
    total = 0.0
    for token, entry in zip(c.token_ids, c.logprobs):
        assert token in entry
        sampled = entry[token]
        top = sorted((lp for tid, lp in entry.items() if lp.rank <= 3), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top] == [1, 2, 3]
        values = [lp.logprob for lp in top]
        assert values == sorted(values, reverse=True) and values[0] <= 0.0
        assert sum(2.718281828 ** v for v in values) <= 1.0 + 1e-5
        assert sampled.logprob <= values[0] + 1e-6
        if sampled.rank > 3:
            saw_outside_top3 = True
            assert len(entry) == 4
        else:
            assert len(entry) == 3
            assert top[sampled.rank - 1].logprob == pytest.approx(sampled.logprob)
        for tid, lp in entry.items():
            assert lp.decoded_token == tok.decode([tid])
        total += sampled.logprob
    assert c.cumulative_logprob == pytest.approx(total, abs=1e-4)
    # The random model is flat enough that a hot sample leaves the top 3 at least once.
    assert saw_outside_top3


def test_greedy_logprobs_rank_first_and_zero_gives_only_the_sampled_token(llm):
    c = only(llm.generate(PROMPTS[3], greedy(6, logprobs=3), use_tqdm=False))
    for token, entry in zip(c.token_ids, c.logprobs):
        assert entry[token].rank == 1 and len(entry) == 3
        assert entry[token].logprob == max(lp.logprob for lp in entry.values())
    z = only(llm.generate(PROMPTS[3], greedy(6, logprobs=0), use_tqdm=False))
    assert z.token_ids == c.token_ids
    assert [list(e) for e in z.logprobs] == [[t] for t in z.token_ids]
    assert [e[t].logprob for e, t in zip(z.logprobs, z.token_ids)] == pytest.approx(
        [e[t].logprob for e, t in zip(c.logprobs, c.token_ids)], abs=1e-5)


# -- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", ["", [[]], {"prompt_token_ids": []}, {"prompt": ""}],
                         ids=["str", "ids", "ids-dict", "text-dict"])
def test_empty_prompt_is_a_value_error(llm, prompt):
    with pytest.raises(ValueError, match="empty"):
        llm.generate(prompt, greedy(2), use_tqdm=False)
    assert_clean(llm)


def test_prompt_at_or_over_max_model_len_is_a_value_error(small_llm):
    for n in (32, 40):
        with pytest.raises(ValueError, match=rf"{n} tokens.*max_model_len is 32"):
            small_llm.generate([_fresh_prompt(n, seed=n)], greedy(2), use_tqdm=False)
    assert_clean(small_llm)


@pytest.mark.parametrize("bad", [384, 10**6, -1])
def test_out_of_vocab_token_id_is_a_value_error(llm, bad):
    with pytest.raises(ValueError, match=rf"{bad}.*vocabulary"):
        llm.generate([[5, 6, bad, 7]], greedy(2), use_tqdm=False)
    assert_clean(llm)


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"stop": ""}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**kwargs)


def test_a_bad_prompt_in_a_batch_leaves_nothing_behind(llm):
    before = only(llm.generate(PROMPTS[0], greedy(4), use_tqdm=False)).token_ids
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([PROMPTS[0], PROMPTS[1], [1, 2, 999]], greedy(4), use_tqdm=False)
    assert_clean(llm)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([PROMPTS[0], ""], SamplingParams(n=2, seed=1, max_tokens=3), use_tqdm=False)
    assert_clean(llm)
    assert only(llm.generate(PROMPTS[0], greedy(4), use_tqdm=False)).token_ids == before


def test_out_of_vocab_stop_token_id_with_min_tokens_is_not_an_engine_crash(llm):
    """stop_token_ids are checked only to be >= 0. With min_tokens, the sampler bans
    them by indexing the logits, so an id past the vocabulary raised IndexError from
    inside an engine step. Either refuse it up front (ValueError naming
    stop_token_ids) or run the request; never crash the step."""
    params = SamplingParams(temperature=0, max_tokens=4, min_tokens=2, stop_token_ids=[10**6],
                            ignore_eos=True)
    try:
        out = llm.generate(PROMPTS[0], params, use_tqdm=False)
    except ValueError as exc:
        assert "stop_token_ids" in str(exc)
    else:
        assert only(out).token_ids == reference(llm, PROMPTS[0])[:4]
    assert_clean(llm)


# -- progress bar and the end state ----------------------------------------------------


def test_use_tqdm_shows_a_progress_bar(llm, capsys):
    out = llm.generate(PROMPTS[:2], greedy(3), use_tqdm=True)
    assert [len(o.outputs[0].token_ids) for o in out] == [3, 3]
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "2/2" in err


def test_no_kv_blocks_leak(llm, small_llm):
    """Runs last in this module: after everything above, the pools are whole again."""
    assert_clean(llm)
    assert_clean(small_llm)


def test_the_generation_configs_other_eos_ids_stop_a_request(llm, llama_dir, tmp_path):
    """A model whose generation_config.json lists several EOS IDs (Llama 3's, Qwen2.5's):
    each stops a request as a stop token does (unless ignore_eos), as vLLM makes them."""
    prompt, plain = "The quick brown fox", SamplingParams(max_tokens=6, temperature=0)
    first = llm.generate(prompt, plain, use_tqdm=False)[0].outputs[0].token_ids[0]
    model = tmp_path / "several-eos"
    shutil.copytree(llama_dir, model)
    config = json.loads((model / "generation_config.json").read_text())
    config["eos_token_id"] = [llm.get_tokenizer().eos_token_id, first]
    (model / "generation_config.json").write_text(json.dumps(config))
    several = LLM(str(model), dtype="float32", kv_cache_memory="16MiB")
    out = several.generate(prompt, plain, use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.text, out.finish_reason, out.stop_reason) == ([first], "", "stop", first)
    ignoring = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert len(several.generate(prompt, ignoring, use_tqdm=False)[0].outputs[0].token_ids) == 6
    with_min = SamplingParams(max_tokens=6, temperature=0, min_tokens=2)
    assert several.generate(prompt, with_min, use_tqdm=False)[0].outputs[0].token_ids[0] != first


def test_a_chat_template_of_ones_own_serves_a_model_that_has_none(tmp_path, llama_dir):
    """A tokenizer without a template: chats are refused, naming --chat-template; given one
    (a file, or inline), it renders the conversation. A template that does not parse, or a
    value that is neither a file nor a template, is refused when the engine is configured."""
    from streamserve.config import Config

    bare = str(tmp_path / "bare")
    shutil.copytree(llama_dir, bare)
    with open(bare + "/tokenizer_config.json") as f:
        config = json.load(f)
    config.pop("chat_template", None)
    with open(bare + "/tokenizer_config.json", "w") as f:
        json.dump(config, f)
    for name in ("chat_template.jinja", "chat_template.json"):
        (tmp_path / "bare" / name).unlink(missing_ok=True)
    conversation = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="has no chat template.*--chat-template"):
        LLM(bare, dtype="float32", kv_cache_memory="8MiB").chat(conversation, use_tqdm=False)
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    path = tmp_path / "t.jinja"
    path.write_text(template)
    for given in (str(path), template):
        llm = LLM(bare, dtype="float32", kv_cache_memory="8MiB", chat_template=given)
        assert llm.renderer.render_chat(conversation) == "<user>hi<assistant>"
        out = llm.chat(conversation, SamplingParams(max_tokens=2), use_tqdm=False)[0]
        assert out.prompt_token_ids == llm.get_tokenizer().encode("<user>hi<assistant>", add_special_tokens=False)
    with pytest.raises(ValueError, match="does not parse as Jinja"):
        Config.from_kwargs(model=bare, chat_template="{% for m in messages %}")
    with pytest.raises(ValueError, match="is neither a file nor a Jinja template"):
        Config.from_kwargs(model=bare, chat_template=str(tmp_path / "missing.jinja"))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # Qwen3-Embedding's architecture
def test_embed_is_the_last_tokens_final_hidden_state_normalised(model_dirs, arch):
    """LLM.embed: transformers' last_hidden_state at the last token, L2-normalised (vLLM's
    last-token pooling), whole or read in chunks, from the prefix cache or not, and beside
    requests that generate (which are unchanged by it)."""
    import torch
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(model_dirs[arch], dtype=torch.float32).eval()
    prompts = ["hello world", "The quick brown fox jumps over the lazy dog. " * 4, "hi"]
    for settings in ({}, {"max_num_batched_tokens": 16}):
        llm = LLM(model_dirs[arch], dtype="float32", kv_cache_memory="16MiB", **settings)
        first = llm.embed(prompts, use_tqdm=False)
        again = llm.embed(prompts, use_tqdm=False)  # their full blocks now come from the prefix cache
        for out, repeat in zip(first, again):
            with torch.no_grad():
                hidden = hf(torch.tensor([out.prompt_token_ids])).last_hidden_state[0, -1]
            expected = torch.nn.functional.normalize(hidden, dim=-1)
            assert torch.allclose(torch.tensor(out.outputs.embedding), expected, atol=1e-5)
            assert repeat.outputs.embedding == pytest.approx(out.outputs.embedding, abs=1e-6)
    alone = llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert llm.engine_core.model_runner.num_embedding_requests == 0  # the finished ones forgotten
    mixed = llm.generate(prompts[:2] + prompts[:2], [SamplingParams(temperature=0, max_tokens=8)] * 2
                         + [SamplingParams(max_tokens=1, temperature=0, embed=True)] * 2, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone]
    assert [o.embedding is None for o in mixed] == [True, True, False, False]


def test_score_is_the_cosine_of_the_texts_embeddings(llm):
    """LLM.score (vLLM's, with an embedding model): one text against each of a list, or two lists
    pairwise; each score the cosine similarity of the two texts' LLM.embed vectors (computed
    here by torch), a text against itself 1; lists of other lengths, or no text, refused."""
    import torch

    texts = ["hello world", "The quick brown fox", "hi there", "hello world"]
    vectors = {t: torch.tensor(o.outputs.embedding, dtype=torch.float64)
               for t, o in zip(texts, llm.embed(texts, use_tqdm=False))}

    def cosine(a, b):
        return float(torch.nn.functional.cosine_similarity(vectors[a], vectors[b], dim=0))

    one_to_many = llm.score("hello world", texts, use_tqdm=False)
    assert [o.outputs.score for o in one_to_many] == pytest.approx([cosine("hello world", t) for t in texts], abs=1e-6)
    assert one_to_many[0].outputs.score == pytest.approx(1.0, abs=1e-6) and one_to_many[1].outputs.score < 0.999
    tok = llm.get_tokenizer()
    assert one_to_many[1].prompt_token_ids == tok.encode("hello world") + tok.encode("The quick brown fox")
    pairwise = llm.score(texts[:2], texts[2:], use_tqdm=False)
    assert [o.outputs.score for o in pairwise] == pytest.approx([cosine(texts[0], texts[2]), cosine(texts[1], texts[3])],
                                                                abs=1e-6)
    with pytest.raises(ValueError, match="text_1 has 2 texts and text_2 3"):
        llm.score(texts[:2], texts[:3], use_tqdm=False)
    with pytest.raises(ValueError, match="LLM.score takes texts"):
        llm.score("hi", [], use_tqdm=False)
    with pytest.raises(ValueError, match="LLM.score takes texts"):
        llm.score("", "hi", use_tqdm=False)


def test_a_cross_encoder_scores_each_pair_from_its_last_tokens_logits(llama_dir):
    """classifier_from_token (config.json's, here through hf_overrides; vLLM's conversion of
    Qwen3-Reranker): each pair one prompt, the tokenizer's pair encoding, its score sigmoid(l_b -
    l_a) of the last token's logits at the two tokens (sigmoid(l_a) with one), as transformers
    computes them; beside requests that generate, which it leaves unchanged. Tokens outside the
    vocabulary, or three, are refused at start."""
    import math

    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB",
              hf_overrides={"classifier_from_token": ["Ġis", "Ġthe"]})
    tok = llm.get_tokenizer()
    a, b = tok.convert_tokens_to_ids(["Ġis", "Ġthe"])
    query, docs = "What is the capital of France?", ["Paris is the capital of France.", "Cats sleep a lot.", "hi"]

    def expected(text_1, text_2, tokens):
        ids = tok(text_1, text_pair=text_2)["input_ids"]
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].double()
        x = logits[tokens[0]] if len(tokens) == 1 else logits[tokens[1]] - logits[tokens[0]]
        return 1 / (1 + math.exp(-float(x))), ids

    scored = llm.score(query, docs, use_tqdm=False)
    for out, doc in zip(scored, docs):
        score, ids = expected(query, doc, [a, b])
        assert out.outputs.score == pytest.approx(score, abs=1e-5) and out.prompt_token_ids == ids
    assert len({round(o.outputs.score, 6) for o in scored}) == 3
    pairwise = llm.score(docs[:2], docs[1:], use_tqdm=False)
    assert [o.outputs.score for o in pairwise] == pytest.approx(
        [expected(docs[0], docs[1], [a, b])[0], expected(docs[1], docs[2], [a, b])[0]], abs=1e-5)
    alone = LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB")
    greedy = SamplingParams(temperature=0, max_tokens=8)
    assert [o.outputs[0].token_ids for o in llm.generate(docs, greedy, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in alone.generate(docs, greedy, use_tqdm=False)]
    one = LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB",
              hf_overrides={"classifier_from_token": ["Ġthe"]})
    assert one.score(query, docs[0], use_tqdm=False)[0].outputs.score == pytest.approx(
        expected(query, docs[0], [b])[0], abs=1e-5)
    vocab = llm.engine_core.vocab_size
    for bad in ({"embed": True, "pool_token_ids": [vocab]}, {"embed": True, "pool_token_ids": []},
                {"pool_token_ids": [a]}):  # out of the vocabulary, none, without embed: refused, the engine unharmed
        with pytest.raises(ValueError, match="pool_token_ids must be token IDs"):
            llm.generate(docs[0], SamplingParams(max_tokens=1, **bad), use_tqdm=False)
    assert llm.score(query, docs[0], use_tqdm=False)[0].outputs.score == pytest.approx(scored[0].outputs.score)
    for tokens, match in ((["Ġis", "nope-token"], "not each a token"), (["Ġis", "Ġthe", "is"], "one token or two")):
        with pytest.raises(ValueError, match=match):
            LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB", hf_overrides={"classifier_from_token": tokens})


# -- vLLM's allowed_token_ids, bad_words and truncate_prompt_tokens -----------------------------


def test_allowed_token_ids_hold_every_sampled_token(llm):
    allowed = [5, 17, 230, 383]
    for params in (greedy(12, allowed_token_ids=allowed),
                   SamplingParams(temperature=1.5, seed=2, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed)):
        out = only(llm.generate("Hello world", params, use_tqdm=False))
        assert len(out.token_ids) == 12 and set(out.token_ids) <= set(allowed)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate("Hello world", greedy(allowed_token_ids=[10 ** 7]), use_tqdm=False)
    with pytest.raises(ValueError, match="at least one"):
        greedy(allowed_token_ids=[])
    assert_clean(llm)


def contains(ids: list[int], part: list[int]) -> bool:
    return any(ids[i:i + len(part)] == part for i in range(len(ids) - len(part) + 1))


def test_bad_words_never_appear_in_the_output(llm, tok):
    free = only(llm.generate(PROMPTS[2], greedy(24), use_tqdm=False))
    # words of the greedy output: one token's text and two tokens' text
    words = [tok.decode(free.token_ids[3:4]).strip() or "x", tok.decode(free.token_ids[8:10]).strip() or "y"]
    sequences = llm.input_processor.bad_words_token_ids(words)
    assert sequences and any(contains(free.token_ids, ids) for ids in sequences)
    banned = only(llm.generate(PROMPTS[2], greedy(24, bad_words=words), use_tqdm=False))
    assert len(banned.token_ids) == 24
    assert not any(contains(banned.token_ids, ids) for ids in sequences)
    # each is tokenized as it begins a text and, where that differs, after a space
    assert sequences[0] == tok.encode(words[0], add_special_tokens=False)
    with pytest.raises(ValueError, match="bad_words"):
        greedy(bad_words=["  "])
    assert_clean(llm)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm, small_llm, tok):
    ids = tok.encode(" ".join(PROMPTS), add_special_tokens=False)
    assert len(ids) > 20
    out = llm.generate(ids, greedy(8, truncate_prompt_tokens=10), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-10:]
    assert out.outputs[0].token_ids == only(llm.generate(ids[-10:], greedy(8), use_tqdm=False)).token_ids
    text_out = llm.generate(" ".join(PROMPTS), greedy(8, truncate_prompt_tokens=10), use_tqdm=False)[0]
    assert text_out.prompt_token_ids == tok.encode(" ".join(PROMPTS))[-10:]
    short = llm.generate("Hello world", greedy(4, truncate_prompt_tokens=500), use_tqdm=False)[0]
    assert short.prompt == "Hello world"  # nothing cut: the text stays
    # a prompt longer than max_model_len (32) runs from its last tokens
    long_ids = (ids * 3)[:60]
    assert only(small_llm.generate(long_ids, greedy(4, truncate_prompt_tokens=20), use_tqdm=False)).token_ids
    with pytest.raises(ValueError, match="max_model_len"):
        small_llm.generate(long_ids, greedy(4, truncate_prompt_tokens=33), use_tqdm=False)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        greedy(truncate_prompt_tokens=0)
    # -1 keeps max_model_len tokens: room for an embedding, which generates nothing
    embedded = small_llm.embed([long_ids], use_tqdm=False, truncate_prompt_tokens=-1)[0]
    assert embedded.prompt_token_ids == long_ids[-32:]
    assert embedded.outputs.embedding == pytest.approx(
        small_llm.embed([long_ids[-32:]], use_tqdm=False)[0].outputs.embedding, abs=1e-6)
    assert_clean(llm)
    assert_clean(small_llm)


def test_priorities_reach_the_scheduler_under_the_priority_policy(llama_dir, llm):
    ranked = LLM(llama_dir, dtype="float32", kv_cache_memory="8MiB", max_num_seqs=1, scheduling_policy="priority")
    ids = [ranked._add_request(None, ranked.input_processor.tokenize(p)[1], greedy(6), priority=rank)
           for p, rank in zip(PROMPTS[:3], (2, -1, 0))]
    assert [r.priority for r in ranked.engine_core.scheduler.waiting] == [-1, 0, 2]
    outputs = ranked._run_engine(ids, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [
        o.outputs[0].token_ids for o in llm.generate(PROMPTS[:3], greedy(6), use_tqdm=False)]
    again = ranked.generate(PROMPTS[:2], greedy(3), use_tqdm=False, priority=[5, 1])
    assert len(again) == 2 and all(len(o.outputs[0].token_ids) == 3 for o in again)
    with pytest.raises(ValueError, match="one per prompt"):
        ranked.generate(PROMPTS[:2], greedy(3), use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="scheduling-policy priority"):  # off by default, as in vLLM
        llm.generate(PROMPTS[:1], greedy(3), use_tqdm=False, priority=[1])
    assert llm.generate(PROMPTS[:1], greedy(3), use_tqdm=False, priority=[0])
    assert_clean(ranked)
    assert_clean(llm)


def test_bad_words_token_ids_are_checked_like_every_other_list_of_ids(llm):
    for ids in ([[10 ** 6]], [[]], [[-1]], [5]):
        with pytest.raises(ValueError, match="bad_words"):
            llm.generate("Hello", greedy(3, bad_words=["x"], bad_words_token_ids=ids), use_tqdm=False)
    assert_clean(llm)
