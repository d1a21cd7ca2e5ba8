"""NgramProposer: a decoding request's next tokens guessed from its own tokens (prompt lookup).

The request's last n tokens (n from prompt_lookup_max down to prompt_lookup_min) are looked
for earlier in its prompt and output; at the first place they occur, the tokens that followed
them there are the guess (at most k). Text that quotes its prompt (an edit of code, a summary,
an extraction) or repeats itself continues as it did before, and those guesses are right.

The search runs over the request's tokens as 4-byte integers in a bytearray grown as tokens
come (`bytearray.find` is C): 3-15 us a request at 2048 tokens, where the same loop in Python
takes about a millisecond. A match found at an offset that is no multiple of 4 straddles
two tokens and is passed over.
"""

from __future__ import annotations

from array import array

from streamserve.config import SpeculativeConfig

_WIDTH = array("i").itemsize  # bytes per token ID in the searched history


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.max_n, self.min_n = config.prompt_lookup_max, config.prompt_lookup_min

    def propose(self, tokens: list[int], history: bytearray, k: int) -> list[int]:
        """At most k tokens to follow `tokens`, or none where no n-gram of its end occurred
        before. `history`: the request's tokens seen so far as packed integers (a prefix of
        `tokens`, extended here)."""
        num_tokens = len(tokens)
        seen = len(history) // _WIDTH
        if seen < num_tokens:
            history += array("i", tokens[seen:]).tobytes()
        end = (num_tokens - 1) * _WIDTH  # an occurrence must end before the last token
        # The shortest n-gram first: where it never occurred, no longer one did (one scan).
        shortest = self._find(history, num_tokens, self.min_n, end)
        if shortest < 0:
            return []
        for n in range(min(self.max_n, num_tokens - 1), self.min_n, -1):
            at = self._find(history, num_tokens, n, end)
            if at >= 0:
                return tokens[at + n:at + n + k]
        return tokens[shortest + self.min_n:shortest + self.min_n + k]

    @staticmethod
    def _find(history: bytearray, num_tokens: int, n: int, end: int) -> int:
        """The first token index where the last n tokens occur, ending before byte `end`; or -1."""
        if n >= num_tokens:
            return -1
        needle = bytes(history[(num_tokens - n) * _WIDTH:])
        at = history.find(needle, 0, end)
        while at > 0 and at % _WIDTH:
            at = history.find(needle, at + 1, end)
        return at // _WIDTH if at >= 0 else -1
