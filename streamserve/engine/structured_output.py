"""Structured output: JSON mode (`response_format: {"type": "json_object"}`).

A request whose SamplingParams.structured_outputs asks for a JSON object may only sample
tokens whose text keeps its output a prefix of one JSON object (RFC 8259, at most
MAX_WHITESPACE whitespace characters in a row, so a model cannot idle in whitespace); once
the object closes, only its EOS or stop token IDs, which end it, as with vLLM's grammars.

The grammar is a character-level recognizer whose state is an immutable tuple; a token is
allowed from a state when the recognizer accepts each character of its text. The scheduler
keeps each request's state (in the Request, so preemption loses nothing), asks this module
for the allowed tokens of the requests that sample in a step, and advances the state with
each sampled token. The masks are cached by the part of the state a token can reach (the
mode, the whitespace run, and the top of the bracket stack down to the most closing
brackets any token holds), so a step mostly looks up masks it has already built.
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from typing import Optional

import numpy as np

logger = logging.getLogger(__name__)

MAX_WHITESPACE = 64  # whitespace characters in a row, anywhere outside strings
MASK_CACHE_SIZE = 1024  # masks kept (bytes each: the vocabulary size)

# Modes. A state is (mode, stack, aux, whitespace run): stack holds the open brackets
# ("{" / "["), aux the mode's detail (a string's kind, a literal's rest, hex digits left).
(TOP, VALUE, ARRAY_FIRST, OBJECT_FIRST, KEY, COLON, AFTER_VALUE, DONE, STRING, ESCAPE, UNICODE,
 NUM_MINUS, NUM_ZERO, NUM_INT, FRAC_FIRST, FRAC, EXP_FIRST, EXP_SIGN, EXP, LITERAL) = range(20)
KEY_STRING, VALUE_STRING = 0, 1
State = tuple  # (mode, stack: str, aux, whitespace: int)
START: State = (TOP, "", None, 0)

_WHITESPACE = frozenset(" \t\n\r")
_WS_MODES = frozenset({TOP, VALUE, ARRAY_FIRST, OBJECT_FIRST, KEY, COLON, AFTER_VALUE})
_ESCAPES = frozenset('"\\/bfnrt')
_HEX = frozenset("0123456789abcdefABCDEF")
_DIGITS = frozenset("0123456789")
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}


def step(state: State, ch: str) -> Optional[State]:
    """The state after one more character, or None where the JSON object cannot go on so."""
    mode, stack, aux, ws = state
    if mode == STRING:
        if ch == '"':
            return (COLON if aux == KEY_STRING else AFTER_VALUE), stack, None, 0
        if ch == "\\":
            return ESCAPE, stack, aux, 0
        return state if ch >= " " else None
    if ch in _WHITESPACE and mode in _WS_MODES:
        return (mode, stack, aux, ws + 1) if ws < MAX_WHITESPACE else None
    if mode == TOP:
        return (OBJECT_FIRST, "{", None, 0) if ch == "{" else None
    if mode in (VALUE, ARRAY_FIRST):
        if ch == "]" and mode == ARRAY_FIRST:
            return _close(stack)
        return _value(stack, ch)
    if mode == OBJECT_FIRST and ch == "}":
        return _close(stack)
    if mode in (OBJECT_FIRST, KEY):
        return (STRING, stack, KEY_STRING, 0) if ch == '"' else None
    if mode == COLON:
        return (VALUE, stack, None, 0) if ch == ":" else None
    if mode == AFTER_VALUE:
        if ch == ",":
            return (KEY if stack[-1] == "{" else VALUE), stack, None, 0
        if ch == ("}" if stack[-1] == "{" else "]"):
            return _close(stack)
        return None
    if mode == ESCAPE:
        if ch == "u":
            return UNICODE, stack, (aux, 4), 0
        return (STRING, stack, aux, 0) if ch in _ESCAPES else None
    if mode == UNICODE:
        kind, left = aux
        if ch not in _HEX:
            return None
        return (STRING, stack, kind, 0) if left == 1 else (UNICODE, stack, (kind, left - 1), 0)
    if mode == LITERAL:
        if ch != aux[0]:
            return None
        return (AFTER_VALUE, stack, None, 0) if len(aux) == 1 else (LITERAL, stack, aux[1:], 0)
    if mode == DONE:
        return None
    return _number(mode, stack, ch)


def _value(stack: str, ch: str) -> Optional[State]:
    if ch == "{":
        return OBJECT_FIRST, stack + "{", None, 0
    if ch == "[":
        return ARRAY_FIRST, stack + "[", None, 0
    if ch == '"':
        return STRING, stack, VALUE_STRING, 0
    if ch == "-":
        return NUM_MINUS, stack, None, 0
    if ch == "0":
        return NUM_ZERO, stack, None, 0
    if ch in _DIGITS:
        return NUM_INT, stack, None, 0
    rest = _LITERALS.get(ch)
    return (LITERAL, stack, rest, 0) if rest else None


def _close(stack: str) -> State:
    stack = stack[:-1]
    return (AFTER_VALUE, stack, None, 0) if stack else (DONE, "", None, 0)


def _number(mode: int, stack: str, ch: str) -> Optional[State]:
    digit = ch in _DIGITS
    if mode == NUM_MINUS:
        return (NUM_ZERO if ch == "0" else NUM_INT, stack, None, 0) if digit else None
    if mode in (FRAC_FIRST, EXP_SIGN):
        return (FRAC if mode == FRAC_FIRST else EXP, stack, None, 0) if digit else None
    if mode == EXP_FIRST:
        if ch in "+-":
            return EXP_SIGN, stack, None, 0
        return (EXP, stack, None, 0) if digit else None
    if digit and mode != NUM_ZERO:
        return mode, stack, None, 0
    if ch == "." and mode in (NUM_ZERO, NUM_INT):
        return FRAC_FIRST, stack, None, 0
    if ch in "eE" and mode in (NUM_ZERO, NUM_INT, FRAC):
        return EXP_FIRST, stack, None, 0
    # the number ends here (at NUM_ZERO, NUM_INT, FRAC or EXP): the character follows a value
    return step((AFTER_VALUE, stack, None, 0), ch)


def advance(state: Optional[State], text: str) -> Optional[State]:
    """The state after `text`, or None where the text cannot follow."""
    for ch in text:
        if state is None:
            return None
        state = step(state, ch)
    return state


class JsonVocabulary:
    """Each token's text and the masks of allowed tokens, for one tokenizer."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.texts = token_texts(tokenizer, vocab_size)
        # Tokens that inside a string stay inside it (no quote, backslash or control character):
        # allowed there without a check. The others, and everything outside strings, are checked.
        plain, special = np.zeros(vocab_size, dtype=np.bool_), []
        # first character -> second character ("" for one-character tokens) -> token IDs
        self.by_prefix: dict[str, dict[str, list[int]]] = {}
        most_closers = 0
        for token_id, text in enumerate(self.texts):
            if not text:
                continue
            if '"' in text or "\\" in text or min(text) < " ":
                special.append(token_id)
            else:
                plain[token_id] = True
            self.by_prefix.setdefault(text[0], {}).setdefault(text[1:2], []).append(token_id)
            most_closers = max(most_closers, text.count("}") + text.count("]"))
        self.plain_in_string, self.special = plain, special
        self.stack_depth = most_closers + 1  # what of the stack a token can reach
        self.masks: OrderedDict[tuple, np.ndarray] = OrderedDict()

    def allowed(self, state: State, eos_token_id: Optional[int], stop_token_ids: frozenset[int]) -> np.ndarray:
        """A [vocab_size] bool mask of the tokens allowed from `state` (not to be written); once
        the object is whole, the request's EOS and stop token IDs."""
        mode, stack, aux, ws = state
        if mode == DONE:
            mask = np.zeros(self.vocab_size, dtype=np.bool_)
            ends = [*stop_token_ids, *(() if eos_token_id is None else (eos_token_id,))]
            mask[[t for t in ends if 0 <= t < self.vocab_size]] = True
            return mask
        key = (mode, stack[-self.stack_depth:], len(stack) > self.stack_depth, aux, ws)
        mask = self.masks.get(key)
        if mask is None:
            mask = self._build(state)
            self.masks[key] = mask
            if len(self.masks) > MASK_CACHE_SIZE:
                self.masks.popitem(last=False)
        else:
            self.masks.move_to_end(key)
        return mask

    def after(self, state: State, token_id: int) -> State:
        """The state after a sampled token. One the mask did not allow (never, while masks
        apply) ends the object where it stands: the request stops rather than go on astray."""
        if state[0] == DONE:
            return state  # the EOS or stop token that ends the request
        after = advance(state, self.texts[token_id]) if 0 <= token_id < self.vocab_size else None
        if after is None:
            logger.error("JSON mode: token %d (%r) cannot follow the output; stopping the request",
                         token_id, self.texts[token_id] if 0 <= token_id < self.vocab_size else None)
            return (DONE, "", None, 0)
        return after

    def _build(self, state: State) -> np.ndarray:
        if state[0] == STRING:
            mask = self.plain_in_string.copy()
            candidates = self.special
        else:
            mask = np.zeros(self.vocab_size, dtype=np.bool_)
            candidates = []
            for first, by_second in self.by_prefix.items():
                after = step(state, first)
                if after is not None:
                    candidates += [t for second, ids in by_second.items()
                                   if not second or step(after, second) is not None for t in ids]
        texts = self.texts
        for token_id in candidates:
            mask[token_id] = advance(state, texts[token_id]) is not None
        return mask


def token_texts(tokenizer, vocab_size: int) -> list[str]:
    """The text each token adds after others (a SentencePiece token's leading space too, as
    the text after a preceding "a" shows); "" (never allowed) for special tokens, IDs past the
    tokenizer, and SentencePiece's non-ASCII byte-fallback tokens (<0x80> and up): its decoder
    turns a run of bytes that is not whole UTF-8 into U+FFFD, ASCII bytes after them too, so a
    quote written as <0x22> after a lone <0xC3> would not be a quote. (Byte-level BPE decodes
    only the broken bytes so: its partial-character tokens stay, as U+FFFD, inside strings.)"""
    special = set(tokenizer.all_special_ids) | {
        token_id for token_id, added in tokenizer.added_tokens_decoder.items() if added.special}
    anchor = tokenizer.convert_tokens_to_ids(tokenizer.tokenize("a"))[-1:]
    base = tokenizer.decode(anchor)
    known = min(vocab_size, len(tokenizer))
    pairs = tokenizer.batch_decode([anchor + [token_id] for token_id in range(known)])
    texts = [text[len(base):] if text.startswith(base) else tokenizer.decode([token_id])
             for token_id, text in enumerate(pairs)]
    pieces = tokenizer.convert_ids_to_tokens(list(range(known)))
    for token_id, piece in enumerate(pieces):
        byte = _BYTE_PIECE.fullmatch(piece or "")
        if byte and int(byte.group(1), 16) >= 0x80:
            texts[token_id] = ""
    for token_id in special:
        if token_id < known:
            texts[token_id] = ""
    return texts + [""] * (vocab_size - known)


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
