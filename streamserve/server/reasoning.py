"""Reasoning outputs (vLLM's --reasoning-parser): a chat reply's <think> ... </think> block
apart from its content.

Reasoning models (DeepSeek-R1 and its distills, QwQ, Qwen3) think in a <think> block before
they answer. With --reasoning-parser, a chat's message carries that block's text as
`reasoning` (and under vLLM's earlier name, `reasoning_content`, which DeepSeek's own API
uses) and the rest as `content`; streamed, each delta carries what is new of either. The
tags themselves are in neither.

Where the block begins: a template may open it in the prompt (DeepSeek-R1's ends the prompt
with "<think>\\n", Qwen3's thinking-only models too), so the reply starts inside it; else a
reply that opens with <think> (whitespace before it aside) thinks, as Qwen3 does by default.
Qwen3's enable_thinking false closes an empty block in the prompt: the reply is all content.
One rule serves every parser name, streamed or not: what comes before </think> inside the
block is reasoning, even where the reply ends (max_tokens) before the block closes.

Tool calls are read out of the content only (a call written while thinking is no call).
"""

from __future__ import annotations

from typing import Any, Optional

PARSERS = ("deepseek_r1", "qwen3")  # vLLM's names; they read <think> blocks alike here
START, END = "<think>", "</think>"
BEFORE, THINKING, CONTENT = range(3)


def opens_thinking(prompt_tail: str) -> bool:
    """Whether the prompt (its last characters are enough) leaves a <think> block open."""
    return prompt_tail.rfind(START) > prompt_tail.rfind(END)


class ReasoningReader:
    """One choice's reply split as it comes: `feed` the text, get (reasoning, content) that
    is new; `close` at the end for what was held back (a tag's first characters, or the
    whitespace before where a block might have opened). `reasoning` and `content` are the
    whole reply's."""

    def __init__(self, thinking: bool) -> None:
        self.state = THINKING if thinking else BEFORE
        self.held = ""
        self.reasoning = ""
        self.content = ""

    def feed(self, text: str) -> tuple[str, str]:
        text, self.held = self.held + text, ""
        reasoning = content = ""
        while text:
            if self.state == BEFORE:
                stripped = text.lstrip()
                if stripped.startswith(START):  # the reply opens a block: the whitespace is dropped
                    self.state, text = THINKING, stripped[len(START):]
                elif not stripped or START.startswith(stripped):  # not known yet: held
                    self.held = text
                    break
                else:
                    self.state = CONTENT
            elif self.state == THINKING:
                at = text.find(END)
                if at >= 0:
                    reasoning += text[:at]
                    self.state, text = CONTENT, text[at + len(END):]
                else:
                    keep = _partial_tag(text, END)
                    reasoning += text[:len(text) - keep]
                    self.held = text[len(text) - keep:]
                    break
            else:
                content += text
                break
        self.reasoning += reasoning
        self.content += content
        return reasoning, content

    def close(self) -> tuple[str, str]:
        held, self.held = self.held, ""
        if self.state == THINKING:
            self.reasoning += held
            return held, ""
        self.content += held
        return "", held


def _partial_tag(text: str, tag: str) -> int:
    """How many of the text's last characters begin the tag (held back: it may follow)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def reasoning_fields(text: Optional[str]) -> dict[str, Any]:
    """A message's or delta's reasoning, under both of vLLM's names (None: none)."""
    return {"reasoning": text, "reasoning_content": text}
