"""Renderer: text and chat messages -> token IDs (the tokenizer and its chat template)."""

from __future__ import annotations

from typing import Any, Optional

from transformers import AutoTokenizer, PreTrainedTokenizerBase

Message = dict[str, Any]


def load_tokenizer(path: str) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers raises many kinds here; say what and where
        raise ValueError(f"cannot load a tokenizer from {path!r}: {exc}") from exc


class Renderer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer

    @property
    def eos_token_id(self) -> Optional[int]:
        return self.tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    def render_chat(self, messages: list[Message], add_generation_prompt: bool = True,
                    chat_template_kwargs: Optional[dict] = None) -> str:
        """The conversation as the prompt text the model was trained on."""
        if not messages:
            raise ValueError("messages is empty: give at least one message")
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("this model's tokenizer has no chat template; use a plain prompt")
        from jinja2 import TemplateError

        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                **(chat_template_kwargs or {}))
        except TemplateError as exc:  # the template's own raise_exception(...), e.g. roles out of turn
            raise ValueError(f"the chat template refused these messages: {exc}") from None

    def encode_chat(self, messages: list[Message], add_generation_prompt: bool = True,
                    chat_template_kwargs: Optional[dict] = None) -> list[int]:
        # The template already holds any BOS it wants: do not add special tokens twice.
        text = self.render_chat(messages, add_generation_prompt, chat_template_kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False)
