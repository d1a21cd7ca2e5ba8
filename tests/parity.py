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


def check_parity(llm: LLM, model_dir: str, num_prompts: int = 9, new_tokens: int = NEW_TOKENS) -> None:
    """The first `num_prompts` parity prompts, `new_tokens` each: tokens identical, logprobs
    within 1e-4."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": p} for p in parity_prompts()[:num_prompts]]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    refs = hf_reference(model_dir, num_prompts, new_tokens)
    assert len(outputs) == num_prompts
    assert_same_greedy(outputs, refs)


def tokens_and_logprobs(output) -> tuple[list[int], list[float]]:
    """A request's first sample: its tokens and each one's logprob (run with logprobs=0)."""
    sample = output.outputs[0]
    return sample.token_ids, [sample.logprobs[j][t].logprob for j, t in enumerate(sample.token_ids)]


def assert_same_greedy(outputs, refs: list[tuple[list[int], list[float]]]) -> None:
    """Each output's tokens identical to its reference's, logprobs within 1e-4."""
    assert len(outputs) == len(refs)
    for i, (output, (ref_tokens, ref_logprobs)) in enumerate(zip(outputs, refs)):
        tokens, logprobs = tokens_and_logprobs(output)
        assert tokens == ref_tokens, f"prompt {i}: tokens differ"
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) < 1e-4, f"prompt {i}: logprobs differ"
