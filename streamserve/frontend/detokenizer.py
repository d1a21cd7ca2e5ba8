"""Incremental detokenisation and stop strings: the one detokeniser.

Tokens are turned into text a few at a time: decode a window that starts a
little before the new tokens and keep what the window adds beyond its old end.
While the window's text ends in U+FFFD, a character's bytes are still arriving
over several tokens, so nothing is emitted yet.

Stop strings: the text is cut before the first match (or after it with
include_stop_str_in_output). While a stop string could still be completing, the
last len(longest stop) - 1 characters are held back from `stream_delta`.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional

from transformers import PreTrainedTokenizerBase

from streamserve.sampling_params import SamplingParams

# Prompt tokens kept as left context, so the first output token decodes with its
# leading space as it would mid-sentence.
_CONTEXT_TOKENS = 5


class TextDecoder:
    """How one tokenizer turns IDs into text here, as fast as it can be done exactly.

    A `tokenizers`-backed tokenizer without clean-up of tokenization spaces decodes to
    exactly what its backend returns, so the backend is called directly (a third of the
    time of transformers' decode), and incremental decoding runs in the backend's own
    DecodeStream, which keeps the same window as the Python loop below, in Rust.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        backend = getattr(tokenizer, "_tokenizer", None)
        if backend is None or not hasattr(backend, "decode") or getattr(
                tokenizer, "clean_up_tokenization_spaces", True):
            backend = None
        self.tokenizer = tokenizer
        self.backend = backend
        self.decode: Callable[[list[int], bool], str] = (
            (lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)) if backend is not None
            else (lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)))
        self._stream_type = _decode_stream_type() if backend is not None else None

    def token_bytes(self, token_id: int, text: str) -> bytes:
        """The bytes token `token_id` (decoded alone: `text`) stands for. A token that holds
        part of a character's UTF-8 decodes alone to U+FFFD; its own bytes are read from its
        vocabulary entry: a byte-level BPE's (GPT-2, Llama 3, Qwen) byte-to-character map
        undone, or SentencePiece's byte fallback (<0xE9>)."""
        if "\ufffd" not in text:
            return text.encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                with contextlib.suppress(ValueError):
                    return bytes([int(piece[3:5], 16)])
            if piece and all(c in _BYTE_LEVEL for c in piece):
                return bytes(_BYTE_LEVEL[c] for c in piece)
        return text.encode()

    def stream(self, context_ids: list[int], skip_special_tokens: bool):
        """A DecodeStream primed with `context_ids`, or None where there is none to use. A
        context that ends inside a character is one: DecodeStream would not take its text as
        already emitted, and would send it along with the first output text."""
        if self._stream_type is None or self.decode(context_ids, skip_special_tokens).endswith("\ufffd"):
            return None
        return self._stream_type(ids=list(context_ids), skip_special_tokens=skip_special_tokens)


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's character for each byte, inverted: printable Latin-1 bytes stand for
    themselves, the other 68 for U+0100 onwards, in byte order (GPT-2's bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


_BYTE_LEVEL = _byte_level_alphabet()


def _decode_stream_type():
    """tokenizers' DecodeStream, where it takes initial ids (tokenizers >= 0.22), else None."""
    try:
        from tokenizers.decoders import DecodeStream

        DecodeStream(ids=[], skip_special_tokens=False)
        return DecodeStream
    except (ImportError, TypeError):
        return None


class IncrementalDetokenizer:
    def __init__(self, decoder: TextDecoder, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.decoder = decoder
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = params.stop_list
        self.include_stop = params.include_stop_str_in_output
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        # Stop strings must end after the text of the first min_tokens tokens (vLLM's rule).
        self.min_tokens = params.min_tokens
        self.num_tokens = 0
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        # The window: text is decoded from ids[prefix_offset:]; ids[:read_offset] are emitted.
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stream = self.decoder.stream(self.ids, self.skip_special_tokens)
        self.output_text = ""
        self.num_streamed_chars = 0
        self.stop_reason: Optional[str] = None

    def _decode(self, ids: list[int]) -> str:
        return self.decoder.decode(ids, self.skip_special_tokens)

    def update(self, new_token_ids: list[int], finish_reason: Optional[str] = None) -> Optional[str]:
        """Add tokens; return the stop string if one now matches (the text is then final).
        A stop string must end after the text of the first min_tokens tokens.

        Once finished, bytes of an incomplete character are flushed as U+FFFD. A
        request the engine stopped (EOS or a stop token id) leaves that last
        token out of the text, unless include_stop_str_in_output."""
        finished = finish_reason is not None
        self.num_tokens += len(new_token_ids)
        if finish_reason == "stop" and not self.include_stop:
            new_token_ids = new_token_ids[:-1]
        if self.stream is not None:
            delta = self._stream_delta(new_token_ids)
            if finished and self.read_offset < len(self.ids):  # a character left incomplete
                delta = (delta or "") + (self._window_delta(True) or "")
        else:
            self.ids.extend(new_token_ids)
            delta = self._window_delta(finished)
        if not delta:
            return None
        new_from = len(self.output_text)
        self.output_text += delta
        if self.num_tokens <= self.min_tokens or not self.stop:
            return None
        return self._check_stop(new_from)

    def _stream_delta(self, new_token_ids: list[int]) -> Optional[str]:
        """The backend's DecodeStream takes the tokens; the offsets follow its window. (It takes
        them one at a time: an update of several tokens (guesses kept, with speculative decoding) may
        emit text one update earlier than the Python window would.)"""
        pieces = []
        for i, token in enumerate(new_token_ids):
            try:
                piece = self.stream.step(self.decoder.backend, token)
            except Exception:  # the stream refused its window: the Python loop goes on from here
                self.stream = None
                self.ids.extend(new_token_ids[i:])
                pieces.append(self._window_delta(False) or "")
                break
            self.ids.append(token)
            if piece is not None:
                pieces.append(piece)
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return "".join(pieces) if pieces else None

    def _window_delta(self, finished: bool) -> Optional[str]:
        """What decoding the window adds beyond its emitted part; None while that ends in an
        incomplete character (unless finished: then it goes out as U+FFFD)."""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not finished):
            return None
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text):]

    def _check_stop(self, new_from: int) -> Optional[str]:
        """The first stop string that ends in the text from `new_from` on (vLLM's rule: one
        that begins in earlier text, of the first min_tokens tokens too, counts)."""
        best: Optional[tuple[int, str]] = None
        for s in self.stop:
            idx = self.output_text.find(s, max(0, new_from - len(s) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self.output_text = self.output_text[:idx + len(s) if self.include_stop else idx]
        self.stop_reason = s
        return s

    def stream_delta(self, finished: bool) -> str:
        """Text not yet streamed, less what a stop string might still claim."""
        end = len(self.output_text)
        if not finished and self.stop:
            end = max(self.num_streamed_chars, end - self.holdback)
        delta = self.output_text[self.num_streamed_chars:end]
        self.num_streamed_chars = end
        return delta
