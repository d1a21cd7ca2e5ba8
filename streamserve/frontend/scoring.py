"""What vLLM's score and rerank APIs pair up and how they score a pair, shared by LLM.score and
the server's /v1/score and /v1/rerank.

A pair's score is the cosine similarity of the two texts' embeddings (their last tokens' final
hidden states, L2-normalised: frontend's embedding requests), as vLLM scores with an embedding
model: what Qwen3-Embedding and its kind are trained for. Each distinct text is embedded once.

Where config.json (or --hf-overrides) names `classifier_from_token`, as vLLM's conversion of
Qwen3-Reranker and its kind reads it, the model is a cross-encoder instead: each pair is one
prompt (the tokenizer's encoding of the two texts as a pair), and its score is read from the
logits of its last token: with two tokens ["no", "yes"], sigmoid(yes - no), the second's
probability between the two; with one, its sigmoid.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional, Sequence

import numpy as np


def score_pairs(num_1: int, num_2: int) -> list[tuple[int, int]]:
    """(i, j) for each pair to score: the one first text against each second one, or the
    texts pairwise where both sides have as many (vLLM's 1:1, 1:N and N:N)."""
    if num_1 < 1 or num_2 < 1:
        raise ValueError("both sides need at least one text")
    if num_1 == 1:
        return [(0, j) for j in range(num_2)]
    if num_1 != num_2:
        raise ValueError(f"text_1 has {num_1} texts and text_2 {num_2}: give one text_1, or as many as text_2")
    return [(i, i) for i in range(num_1)]


def distinct_pairs(texts_1: Sequence[str], texts_2: Sequence[str], pairs: list[tuple[int, int]]
                   ) -> tuple[list[str], list[tuple[int, int]]]:
    """(each distinct text once, in order; each pair as indices into those): what an embedding
    score embeds, and which of its vectors each pair compares."""
    distinct = list(dict.fromkeys([*texts_1, *texts_2]))
    at = {text: k for k, text in enumerate(distinct)}
    return distinct, [(at[texts_1[i]], at[texts_2[j]]) for i, j in pairs]


def cosine_scores(vectors: Sequence[Sequence[float]], pairs: list[tuple[int, int]]) -> list[float]:
    """The cosine similarity of vectors[i] and vectors[j] for each (i, j)."""
    rows = np.asarray(vectors, dtype=np.float64)
    rows = rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)
    return [float(rows[i] @ rows[j]) for i, j in pairs]


def classifier_token_ids(tokenizer, hf_config: dict, vocab_size: int) -> Optional[list[int]]:
    """The IDs of config.json's classifier_from_token (one token or two), or None without it."""
    tokens = hf_config.get("classifier_from_token")
    if tokens is None:
        return None
    if not isinstance(tokens, list) or not 1 <= len(tokens) <= 2 or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"classifier_from_token must list one token or two (['no', 'yes']), got {tokens!r}")
    vocab = tokenizer.get_vocab()
    ids = [vocab.get(t) for t in tokens]
    if any(i is None or not 0 <= i < vocab_size for i in ids):
        raise ValueError(f"classifier_from_token {tokens!r}: not each a token of the model's vocabulary")
    return ids


def pair_prompts(tokenizer, texts_1: Sequence[str], texts_2: Sequence[str], pairs: list[tuple[int, int]]
                 ) -> list[list[int]]:
    """A cross-encoder's prompt for each pair (i, j): the tokenizer's encoding of texts_1[i] and
    texts_2[j] as a pair, each distinct text tokenized once (a query against a thousand
    documents is read once, not a thousand times)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # (a tokenizer without a fast backend: pair by pair)
        return [list(tokenizer(texts_1[i], text_pair=texts_2[j])["input_ids"]) for i, j in pairs]
    encoded: dict[str, Any] = {}

    def encode(text: str):
        if text not in encoded:
            encoded[text] = backend.encode(text, add_special_tokens=False)
        return encoded[text]
    return [backend.post_process(encode(texts_1[i]), encode(texts_2[j]), True).ids for i, j in pairs]


def classifier_score(logits: Sequence[float]) -> float:
    """The score of the classifier tokens' logits: sigmoid of the one, or of the second less the
    first. (The model's logits: after Granite's divisor and Gemma 2's cap, where a model has them.)"""
    x = logits[0] if len(logits) == 1 else logits[1] - logits[0]
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def matryoshka_check(hf_config: dict, dimensions) -> None:
    """Raise ValueError unless `dimensions` is a size the model's embeddings may be cut to: its
    config.json (or --hf-overrides) says it was trained so (is_matryoshka, or the
    matryoshka_dimensions it lists), as vLLM requires (cutting another model's vector loses
    what it meant)."""
    if not isinstance(dimensions, numbers.Integral) or isinstance(dimensions, bool) or dimensions < 1:
        raise ValueError(f"dimensions must be an integer >= 1, got {dimensions!r}")
    listed = hf_config.get("matryoshka_dimensions")
    if not hf_config.get("is_matryoshka") and not listed:
        raise ValueError("this model was not trained for shorter embeddings (no is_matryoshka or "
                         "matryoshka_dimensions in its config.json; --hf-overrides can say so)")
    if listed and dimensions not in listed:
        raise ValueError(f"this model's embeddings may be cut to {listed} dimensions, not {dimensions}")


def cut(vector: list[float], dimensions: Optional[int]) -> list[float]:
    """The vector's first `dimensions` values, L2-normalised again (the vector itself where None)."""
    if dimensions is None or int(dimensions) >= len(vector):
        return vector
    dimensions = int(dimensions)
    head = np.asarray(vector[:dimensions], dtype=np.float64)
    return (head / max(float(np.linalg.norm(head)), 1e-12)).tolist()
