"""The transformers oracle shared by the parity tests: greedy tokens and their log-softmax."""

from __future__ import annotations

import functools
import random

import torch

from streamserve import LLM, SamplingParams

NEW_TOKENS = 32


def parity_prompts() -> list[list[int]]:
    """9 prompts of 3 to 70 tokens; several share a 40-token prefix, two share 20."""
    rng = random.Random(1234)
    draw = lambda n: [rng.randrange(3, 380) for _ in range(n)]  # noqa: E731
    shared40, shared20 = draw(40), draw(20)
    return [draw(3), shared40 + draw(5), draw(17), shared40 + draw(30), shared20 + draw(1),
            draw(64), shared40 + draw(12), shared20 + draw(9), draw(70)]


@functools.lru_cache(maxsize=None)
def hf_reference(model_dir: str, num_prompts: int = 9, new_tokens: int = NEW_TOKENS
                 ) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy tokens and their log-softmax, one prompt at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    refs = []
    for prompt in parity_prompts()[:num_prompts]:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=0)
        tokens = out.sequences[0, len(prompt):].tolist()
        logprobs = [torch.log_softmax(step[0].float(), -1)[t].item()
                    for step, t in zip(out.logits, tokens)]
        refs.append((tokens, logprobs))
    return refs


@functools.lru_cache(maxsize=None)
def hf_prompt_logprobs(model_dir: str, num_prompts: int = 9, dtype: torch.dtype = torch.float32) -> list[list[float]]:
    """transformers' log-softmax of each parity prompt's tokens after the first, given the ones
    before (the model run in `dtype`)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    refs = []
    for prompt in parity_prompts()[:num_prompts]:
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0, :-1]
        refs.append(torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist())
    return refs


def prompt_token_logprobs(output, prompt: list[int]) -> list[float]:
    """A request's prompt logprobs (run with prompt_logprobs=0): each prompt token's after the first."""
    return [entry[t].logprob for entry, t in zip(output.prompt_logprobs[1:], prompt[1:])]


def check_prompt_logprobs(llm: LLM, model_dir: str, tol: float, num_prompts: int = 9) -> None:
    """The parity prompts' prompt logprobs (teacher-forced: no greedy choice can tip a near tie
    one way) within `tol` of transformers'."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    prompts = parity_prompts()[:num_prompts]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i, (prompt, output, ref) in enumerate(zip(prompts, outputs, hf_prompt_logprobs(model_dir, num_prompts))):
        got = prompt_token_logprobs(output, prompt)
        worst = max(abs(a - b) for a, b in zip(got, ref))
        assert len(got) == len(ref) and worst < tol, f"prompt {i}: prompt logprobs differ by up to {worst:.2g}"


def check_parity(llm: LLM, model_dir: str, num_prompts: int = 9, new_tokens: int = NEW_TOKENS,
                 logprob_tol: float = 1e-4) -> None:
    """The first `num_prompts` parity prompts, `new_tokens` each: tokens identical, logprobs
    within `logprob_tol`."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": p} for p in parity_prompts()[:num_prompts]]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    refs = hf_reference(model_dir, num_prompts, new_tokens)
    assert len(outputs) == num_prompts
    assert_same_greedy(outputs, refs, logprob_tol)


def tokens_and_logprobs(output) -> tuple[list[int], list[float]]:
    """A request's first sample: its tokens and each one's logprob (run with logprobs=0)."""
    sample = output.outputs[0]
    return sample.token_ids, [sample.logprobs[j][t].logprob for j, t in enumerate(sample.token_ids)]


def assert_same_greedy(outputs, refs: list[tuple[list[int], list[float]]], logprob_tol: float = 1e-4) -> None:
    """Each output's tokens identical to its reference's, logprobs within `logprob_tol`."""
    assert len(outputs) == len(refs)
    for i, (output, (ref_tokens, ref_logprobs)) in enumerate(zip(outputs, refs)):
        tokens, logprobs = tokens_and_logprobs(output)
        assert tokens == ref_tokens, f"prompt {i}: tokens differ"
        worst = max(abs(a - b) for a, b in zip(logprobs, ref_logprobs))
        assert worst < logprob_tol, f"prompt {i}: logprobs differ by up to {worst:.2g}"
