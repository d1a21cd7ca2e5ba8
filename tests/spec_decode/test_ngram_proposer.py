"""The n-gram proposer against a plain Python statement of its rule, and its edges."""

from __future__ import annotations

import random

import pytest

from streamserve.config import SpeculativeConfig
from streamserve.spec_decode.ngram_proposer import NgramProposer


def reference(tokens: list[int], k: int, low: int, high: int) -> list[int]:
    """The longest n in [low, high] whose last n tokens occurred earlier (ending before the last
    token): the k tokens after its first occurrence."""
    for n in range(min(high, len(tokens) - 1), low - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []


def proposer(k: int = 4, low: int = 1, high: int = 3) -> NgramProposer:
    return NgramProposer(SpeculativeConfig("ngram", k, high, low))


def test_the_longest_ngram_wins_and_its_first_occurrence_is_followed():
    p = proposer(k=3, low=1, high=3)
    # "2 3" occurs at 1 and 6; "9 2 3" only at 0: the 3-gram's continuation is taken
    assert p.propose([9, 2, 3, 4, 8, 8, 2, 3, 5, 9, 2, 3], bytearray(), 3) == [4, 8, 8]
    assert p.propose([1, 2, 3, 1, 2], bytearray(), 3) == [3, 1, 2]  # stops at the end of the tokens
    assert p.propose([1, 2, 3, 4], bytearray(), 3) == []  # nothing repeats
    assert p.propose([7], bytearray(), 3) == []
    assert p.propose([5, 5], bytearray(), 3) == [5]
    assert proposer(low=2, high=2).propose([1, 2, 3, 2], bytearray(), 4) == []  # only "3 2" counts


def test_a_match_across_two_tokens_bytes_is_passed_over():
    """The history holds int32s: 7 << 16 is bytes 00 00 07 00, so 7's bytes (07 00 00 00) occur
    at byte 2 of it and the zero after it, which is no token 7."""
    one = proposer(low=1, high=1)
    assert one.propose([7 << 16, 0, 5, 7], bytearray(), 2) == []
    assert one.propose([7 << 16, 0, 7, 3, 7], bytearray(), 2) == [3, 7]  # the aligned one, after it


@pytest.mark.parametrize("seed", range(4))
def test_it_matches_the_rule_as_tokens_come(seed):
    """Random sequences over small alphabets, grown a token at a time with one history (as a
    request's), against the reference at every length."""
    rng = random.Random(seed)
    low = rng.randint(1, 3)
    high = rng.randint(low, 5)
    k = rng.randint(1, 6)
    p = proposer(k, low, high)
    history = bytearray()
    tokens = []
    alphabet = [rng.randrange(1 << 20) for _ in range(rng.randint(2, 6))]
    for _ in range(300):
        tokens.append(rng.choice(alphabet))
        assert p.propose(tokens, history, k) == reference(tokens, k, low, high)


def test_k_caps_the_guess():
    assert proposer(k=8).propose([1, 2, 3, 4, 5, 6, 1], bytearray(), 2) == [2, 3]


@pytest.mark.parametrize("given, message", [
    ({"method": "eagle", "num_speculative_tokens": 3}, "only \"ngram\""),
    ({"method": "ngram"}, "num_speculative_tokens (None) must be an integer in [1, 32]"),
    ({"method": "ngram", "num_speculative_tokens": 33}, "in [1, 32]"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 0}, "prompt_lookup_max (0) must be"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min (4) must be <= prompt_lookup_max (2)"),
    ({"method": "ngram", "num_speculative_tokens": 3, "model": "x"}, "'model' not among"),
    ({"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 0}, "disable_by_batch_size (0) must"),
])
def test_bad_configs_are_refused_clearly(given, message):
    with pytest.raises(ValueError, match=None) as info:
        SpeculativeConfig.from_dict(given)
    assert message in str(info.value)


def test_lookup_defaults_follow_vllm():
    read = lambda **kw: SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2, **kw})  # noqa: E731
    assert (read().prompt_lookup_max, read().prompt_lookup_min) == (5, 5)
    assert (read(prompt_lookup_max=4).prompt_lookup_min, read(prompt_lookup_min=2).prompt_lookup_max) == (4, 2)
