"""Beam search over the engine, as vLLM runs it: in the front end, one token at a time.

Each step asks the engine for one token of every live beam (max_tokens 1) with the
2 * beam_width likeliest next tokens' logprobs; every beam + token is a candidate, scored by
its cumulative logprob; a candidate ending in EOS is complete, the best beam_width of the
others go on. After max_tokens steps (or once no beam goes on) the beams and the complete
ones are ranked by cumulative logprob / length ** length_penalty (the length counts the
prompt, less a final EOS, as vLLM counts it) and the best beam_width returned. The beams of a
step share their prompt's KV blocks, and each its own earlier ones, through the prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from streamserve.outputs import SampleLogprobs
from streamserve.sampling_params import BeamSearchParams


@dataclass
class BeamSearchSequence:
    """A beam: its tokens (the prompt's, then its own), each own token's logprobs (that
    position's top 2 * beam_width), the sum of its tokens' logprobs, and, once returned,
    its text."""

    tokens: list[int]
    logprobs: SampleLogprobs = field(default_factory=list)
    cum_logprob: float = 0.0
    text: Optional[str] = None
    finish_reason: Optional[str] = None  # "stop" (it ended with EOS) or "length"


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]


class BeamSearch:
    """One prompt's search: `prompts()` are this step's beams' token lists, `advance(entries)`
    takes each one's next-token logprobs ({token_id: Logprob}), `result()` the best at the end."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: frozenset) -> None:
        self.params, self.eos = params, eos_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)
        self.beams = [BeamSearchSequence(list(prompt_token_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.steps = 0

    @property
    def done(self) -> bool:
        return not self.beams or self.steps >= self.params.max_tokens

    def prompts(self) -> list[list[int]]:
        return [beam.tokens for beam in self.beams]

    def advance(self, entries: list[dict]) -> None:
        candidates = []
        for beam, entry in zip(self.beams, entries):
            for token, logprob in entry.items():
                child = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [entry],
                                           beam.cum_logprob + logprob.logprob)
                if token in self.eos and not self.params.ignore_eos:
                    child.finish_reason = "stop"
                    self.completed.append(child)
                else:
                    candidates.append(child)
        candidates.sort(key=self.score, reverse=True)
        self.beams = candidates[:self.params.beam_width]
        self.steps += 1

    def result(self, decode, with_prompt: bool = False) -> list[BeamSearchSequence]:
        """The best beam_width, each with its text: decode(token IDs) of its own tokens (less a
        final EOS unless include_stop_str_in_output), after the prompt's with `with_prompt` (as
        vLLM's LLM.beam_search gives it)."""
        for beam in self.beams:
            beam.finish_reason = "length"
        best = sorted(self.completed + self.beams, key=self.score, reverse=True)[:self.params.beam_width]
        for beam in best:
            tokens = beam.tokens if with_prompt else beam.tokens[self.num_prompt_tokens:]
            if beam.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                tokens = tokens[:-1]
            beam.text = decode(tokens)
        return best

    def score(self, beam: BeamSearchSequence) -> float:
        length = len(beam.tokens) - (beam.tokens[-1] in self.eos)
        return beam.cum_logprob / (length ** self.params.length_penalty)


def check_step_output(entries: Optional[SampleLogprobs]) -> dict:
    """A beam's one-token output's logprobs entry (it asked for them: there is one)."""
    if not entries:
        raise RuntimeError("a beam's step came back without its logprobs")
    return entries[0]
