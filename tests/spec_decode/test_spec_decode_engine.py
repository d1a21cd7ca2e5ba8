"""Speculative decoding in the engine: whatever the guesses, a request's tokens are those it
would sample without them. Greedy outputs match token for token (logprobs too) with guesses
kept and refused, under penalties and bad words (which read the guesses before each row); a
sampled output's distribution matches; stop strings, the prefix cache and seeds hold."""

from __future__ import annotations

import numpy as np
import pytest
from parity import assert_same_greedy, hf_reference, parity_prompts

from streamserve import LLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPTS = [{"prompt_token_ids": p} for p in parity_prompts()]
# Held to three tokens, the tiny random model's greedy text repeats itself soon: guesses come true.
FEW = [5, 6, 7]


@pytest.fixture(scope="module")
def engines(llama_dir):
    make = lambda **kw: LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB", max_num_seqs=256,  # noqa: E731
                            max_num_batched_tokens=4096, **kw)
    spec = make(speculative_config=SPEC)
    spec.engine_core.scheduler.SPEC_MAX_PAUSE_DOUBLINGS = 0  # no pause after misses: every guess is checked
    return make(), spec


def guesses(llm: LLM) -> tuple[int, int]:
    scheduler = llm.engine_core.scheduler
    return scheduler.spec_num_draft_tokens, scheduler.spec_num_accepted_tokens


def test_greedy_outputs_match_transformers(engines, llama_dir):
    _, spec = engines
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)
    before = guesses(spec)
    assert_same_greedy(spec.generate(PROMPTS, params, use_tqdm=False), hf_reference(llama_dir, 9, 32))
    assert guesses(spec)[0] > before[0]


@pytest.mark.parametrize("extra", [
    {},
    {"repetition_penalty": 1.5, "frequency_penalty": 0.3, "presence_penalty": 0.2},
    {"bad_words_token_ids": [[5, 6], [7, 7, 5]]},
    {"logit_bias": {6: 1.5}, "top_k": 1, "temperature": 0.7},  # top_k 1: greedy through the sampling path
    {"min_tokens": 40, "ignore_eos": False, "stop_token_ids": [5]},  # 5 banned for 40 tokens, then it stops
], ids=["plain", "penalties", "bad-words", "bias-top-k", "min-tokens"])
def test_greedy_outputs_match_without_speculation(engines, extra):
    plain, spec = engines
    params = SamplingParams(**{"temperature": 0, "max_tokens": 48, "ignore_eos": True, "logprobs": 2,
                               "allowed_token_ids": FEW, **extra})
    before = guesses(spec)
    want = plain.generate(PROMPTS, params, use_tqdm=False)
    got = spec.generate(PROMPTS, params, use_tqdm=False)
    checked, kept = np.subtract(guesses(spec), before)
    assert 0 < kept < checked  # guesses were both kept and refused
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
        assert len(a.outputs[0].logprobs) == len(b.outputs[0].token_ids)
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert list(x) == list(y)  # the token, then the same top 2
            assert max(abs(x[t].logprob - y[t].logprob) for t in x) < 1e-4


@pytest.mark.parametrize("structure", [
    {"regex": "(abc )+"},
    {"json": {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["abc", "xyz"]},
                                                        "maxItems": 8}}, "required": ["tags"]}},
    {"choice": ["abc abc abc", "xyz"]},
], ids=["regex", "json", "choice"])
def test_structured_outputs_guess_only_what_their_structure_allows(engines, structure, caplog):
    """A structured request's guesses stop at the first its structure does not allow (the
    prompts hold "abc" followed by what the structure refuses), each row is masked by the states
    after the guesses before it, and the tokens are those without guessing."""
    from streamserve.sampling_params import StructuredOutputsParams

    plain, spec = engines
    params = SamplingParams(temperature=0, max_tokens=40, logprobs=0,
                            structured_outputs=StructuredOutputsParams(**structure))
    prompts = ["abc xyz abc abc", '{"tags": ["abc", "abc", "qq"]}', "abc abc abc"]
    before = guesses(spec)
    want = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert guesses(spec)[1] > before[1]
    assert "cannot follow" not in caplog.text  # no guess was walked past what its structure allows


def test_a_sampled_outputs_distribution_is_unchanged(engines):
    """3000 samples of 8 tokens each way: at each position, each token's frequency matches
    (a difference of 0.06 is over 5 standard errors)."""
    plain, spec = engines
    prompt = {"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6]}
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, allowed_token_ids=FEW)
    before = guesses(spec)
    freqs = []
    for llm in (plain, spec):
        tokens = np.array([o.outputs[0].token_ids for o in llm.generate([prompt] * 3000, params, use_tqdm=False)])
        freqs.append(np.stack([(tokens == t).mean(axis=0) for t in FEW]))
    checked, kept = np.subtract(guesses(spec), before)
    assert kept > 1000 and checked > kept
    assert np.abs(freqs[0] - freqs[1]).max() < 0.06, (freqs[0].round(3), freqs[1].round(3))


def test_a_seeded_request_samples_what_it_would_without_guessing(engines, llama_dir):
    """A seed draws each token by its position, so a seeded request's tokens are its tokens
    without guessing, whatever its steps' guesses and neighbours: here also beside unseeded
    requests in steps of 8 tokens, which cut its guesses short."""
    plain, spec = engines
    seeded = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, allowed_token_ids=FEW, seed=11)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS[:3], seeded, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS[:3], seeded, use_tqdm=False)] == want
    tight = LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB", max_num_batched_tokens=8, speculative_config=SPEC)
    unseeded = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, allowed_token_ids=FEW)
    outputs = tight.generate(PROMPTS[:6], [seeded, unseeded] * 3, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs[::2]] == want[:1] + [
        o.outputs[0].token_ids for o in plain.generate(PROMPTS[2:6:2], seeded, use_tqdm=False)]
    assert guesses(tight)[1] > 0


def test_a_stop_string_inside_the_kept_guesses_cuts_the_output_there(engines):
    """Stop strings taken from the plain output's text at many places: each cuts the output (its
    tokens and logprobs) where it cuts the plain engine's, wherever it falls among a step's kept
    guesses."""
    plain, spec = engines
    params = dict(temperature=0, max_tokens=48, ignore_eos=True, logprobs=0, allowed_token_ids=FEW)
    text = plain.generate(PROMPTS[5], SamplingParams(**params), use_tqdm=False)[0].outputs[0].text
    stops = sorted({text[i:i + 3] for i in range(4, len(text) - 3, 2)})
    assert len(stops) >= 3
    for stop in stops:
        p = SamplingParams(**params, stop=[stop])
        want = plain.generate(PROMPTS[5], p, use_tqdm=False)[0].outputs[0]
        got = spec.generate(PROMPTS[5], p, use_tqdm=False)[0].outputs[0]
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == \
            (want.text, want.token_ids, "stop", stop)
        assert len(got.logprobs) == len(got.token_ids)


def test_the_prefix_cache_serves_blocks_written_beside_guesses(engines):
    """A prompt that is an earlier request's prompt and output reads that output's blocks from
    the cache (their KV written in steps that checked guesses) and continues as without them."""
    plain, spec = engines
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, allowed_token_ids=FEW)
    prompt = PROMPTS[3]["prompt_token_ids"]
    first = spec.generate(PROMPTS[3], params, use_tqdm=False)[0].outputs[0].token_ids
    longer = {"prompt_token_ids": prompt + first}
    got = spec.generate(longer, params, use_tqdm=False)[0]
    assert got.num_cached_tokens > len(prompt)
    assert got.outputs[0].token_ids == plain.generate(longer, params, use_tqdm=False)[0].outputs[0].token_ids


def test_a_small_pool_preempts_and_the_tokens_hold(llama_dir):
    """Nine requests in a pool of 16 blocks: they preempt one another, guesses take blocks and
    give back those of the guesses refused (the runner's block table cut to match), and every
    request's tokens are those without guessing."""
    make = lambda **kw: LLM(llama_dir, dtype="float32", num_gpu_blocks_override=16, max_model_len=256, **kw)  # noqa: E731
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, allowed_token_ids=FEW)
    plain, spec = make(), make(speculative_config=SPEC)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in spec.generate(PROMPTS, params, use_tqdm=False)] == want
    scheduler = spec.engine_core.scheduler
    assert scheduler.num_preemptions > 0 and 0 < guesses(spec)[1] < guesses(spec)[0]
    assert scheduler.kv_cache_manager.num_free_blocks == 16


def test_lora_requests_guess_through_their_adapters(llama_dir, tmp_path):
    """Guesses of requests through a LoRA adapter are read through it (a chunk's rows grouped by
    adapter, in the C step and op by op): every other prompt through it, the tokens are those
    without guessing."""
    from lora_adapters import build_adapter

    from streamserve import LoRARequest

    lora = LoRARequest("a", 1, build_adapter(str(tmp_path / "a"), llama_dir, rank=8, seed=3))
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, allowed_token_ids=FEW)
    per_prompt = [lora if i % 2 else None for i in range(len(PROMPTS))]
    for eager in (False, True):
        make = lambda **kw: LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB", enable_lora=True,  # noqa: E731
                                enforce_eager=eager, **kw)
        plain, spec = make(), make(speculative_config=SPEC)
        want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False, lora_request=per_prompt)]
        got = [o.outputs[0].token_ids for o in spec.generate(PROMPTS, params, use_tqdm=False, lora_request=per_prompt)]
        assert got == want and guesses(spec)[1] > 0
