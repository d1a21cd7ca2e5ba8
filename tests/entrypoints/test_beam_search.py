"""Beam search (vLLM's LLM.beam_search, and use_beam_search over HTTP): the engine's beams
are those of the same search run on transformers' logits; width 1 is greedy; EOS ends a
beam, and length_penalty ranks the ends."""

from __future__ import annotations

import openai
import pytest
import torch
from live_server import serve_in_thread
from parity import parity_prompts

from streamserve import LLM, BeamSearchParams, SamplingParams
from streamserve.frontend.beam_search import BeamSearch
from streamserve.outputs import Logprob


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB")


def hf_beam_search(model_dir: str, prompt: list[int], width: int, max_tokens: int, length_penalty: float,
                   eos: int) -> list[tuple[list[int], float]]:
    """The same search on transformers' next-token log-softmax: each beam's 2 * width likeliest
    tokens, EOS completing a beam, the others ranked by cumulative logprob / length ** penalty."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    score = lambda b: b[1] / ((len(b[0]) - (b[0][-1] == eos)) ** length_penalty)  # noqa: E731
    beams, completed = [(prompt, 0.0)], []
    for _ in range(max_tokens):
        candidates = []
        for tokens, cum in beams:
            with torch.no_grad():
                logprobs = torch.log_softmax(model(torch.tensor([tokens])).logits[0, -1].float(), -1)
            top = torch.topk(logprobs, 2 * width)
            for token, value in zip(top.indices.tolist(), top.values.tolist()):
                (completed if token == eos else candidates).append((tokens + [token], cum + value))
        beams = sorted(candidates, key=score, reverse=True)[:width]
        if not beams:
            break
    return sorted(completed + beams, key=score, reverse=True)[:width]


@pytest.mark.parametrize("width, penalty", [(1, 1.0), (2, 1.0), (4, 0.5)])
def test_beams_are_those_of_the_same_search_on_transformers(llm, llama_dir, width, penalty):
    prompts = parity_prompts()[:3]
    params = BeamSearchParams(beam_width=width, max_tokens=6, length_penalty=penalty)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, output in zip(prompts, outputs):
        ref = hf_beam_search(llama_dir, prompt, width, 6, penalty, eos=2)
        assert [s.tokens for s in output.sequences] == [tokens for tokens, _ in ref]
        assert max(abs(s.cum_logprob - cum) for s, (_, cum) in zip(output.sequences, ref)) < 1e-4
        best = output.sequences[0]
        assert best.text == llm.tokenizer.decode(best.tokens, skip_special_tokens=True)  # (the prompt's too, as vLLM)


def test_width_one_is_greedy_and_wider_scores_no_worse(llm):
    prompt = {"prompt_token_ids": parity_prompts()[5]}
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0),
                          use_tqdm=False)[0].outputs[0]
    one = llm.beam_search(prompt, BeamSearchParams(beam_width=1, max_tokens=8, ignore_eos=True))[0].sequences[0]
    assert one.tokens[-8:] == greedy.token_ids
    cum = sum(entry[t].logprob for entry, t in zip(greedy.logprobs, greedy.token_ids))
    wide = llm.beam_search(prompt, BeamSearchParams(beam_width=4, max_tokens=8, ignore_eos=True))[0].sequences
    assert len(wide) == 4 and wide[0].cum_logprob >= cum - 1e-5
    assert llm.engine_core.scheduler.kv_cache_manager.usage() == 0 and not llm.engine_core.has_unfinished_requests()


def _entry(pairs: dict[int, float]) -> dict[int, Logprob]:
    return {t: Logprob(v, r) for r, (t, v) in enumerate(pairs.items(), 1)}


def test_eos_ends_a_beam_and_length_penalty_ranks_the_ends():
    """A hand-made search (EOS is 9): step 1 gives beams [1] and [2]; step 2 ends [1] with EOS
    and grows [2]. The ended beam's length leaves out its EOS; its text too, unless
    include_stop_str_in_output."""
    for penalty, include in ((1.0, False), (0.0, True)):
        search = BeamSearch([7, 7], BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=penalty,
                                                     include_stop_str_in_output=include), frozenset({9}))
        search.advance([_entry({1: -0.1, 2: -0.2, 3: -3.0, 4: -4.0})])
        assert search.prompts() == [[7, 7, 1], [7, 7, 2]]
        search.advance([_entry({9: -0.5, 5: -2.0, 6: -2.1, 8: -2.2}), _entry({5: -0.3, 6: -0.4, 9: -5.0, 8: -6.0})])
        assert search.done
        best = search.result(lambda ids: ",".join(map(str, ids)))
        # ended [1, EOS]: -0.6 over 3 tokens (EOS left out); going [2, 5]: -0.5 over 4; [2, 6]: -0.6 over 4
        if penalty == 1.0:  # -0.125 beats -0.15 and -0.2
            assert [(b.tokens[2:], b.finish_reason, b.text) for b in best] == [([2, 5], "length", "2,5"),
                                                                                ([2, 6], "length", "2,6")]
        else:  # no length penalty: -0.5, then -0.6 (the ended beam first among the ties, as it came first)
            assert [(b.tokens[2:], b.finish_reason, b.text) for b in best] == [([2, 5], "length", "2,5"),
                                                                                ([1, 9], "stop", "1,9")]


def test_use_beam_search_over_http(llama_dir, llm):
    prompt = parity_prompts()[2]
    expected = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(beam_width=3, max_tokens=6))[0]
    for live in serve_in_thread(llama_dir):
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model=live.model_name, prompt=prompt, max_tokens=6, n=3,
                                        extra_body={"use_beam_search": True})
        assert [c.text for c in out.choices] == [llm.tokenizer.decode(s.tokens[len(prompt):], skip_special_tokens=True)
                                                  for s in expected.sequences]
        assert [c.finish_reason for c in out.choices] == [s.finish_reason for s in expected.sequences]
        assert out.usage.completion_tokens == sum(len(s.tokens) - len(prompt) for s in expected.sequences)
        stream = client.chat.completions.create(model=live.model_name, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=5, n=2, stream=True, extra_body={"use_beam_search": True})
        finishes = {c.index: c.finish_reason for chunk in stream for c in chunk.choices if c.finish_reason}
        assert set(finishes) == {0, 1}
        for extra, param in (({"logprobs": 2}, "logprobs"), ({"stop": ["x"]}, "stop"), ({"n": 11}, "n"),
                             ({"length_penalty": "long"}, "length_penalty"), ({"use_beam_search": 1}, "use_beam_search")):
            body = {"use_beam_search": True, "n": 2, **{k: v for k, v in extra.items()}}
            with pytest.raises(openai.BadRequestError, match=param):
                client.completions.create(model=live.model_name, prompt="hi", max_tokens=4,
                                          extra_body={k: v for k, v in body.items() if k not in ("logprobs", "stop", "n")},
                                          **{k: v for k, v in body.items() if k in ("logprobs", "stop", "n")})
