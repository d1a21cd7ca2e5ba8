"""What vLLM's score and rerank APIs pair up and how they score a pair, shared by LLM.score and
the server's /v1/score and /v1/rerank.

A pair's score is the cosine similarity of the two texts' embeddings (their last tokens' final
hidden states, L2-normalised: frontend's embedding requests), as vLLM scores with an embedding
model: what Qwen3-Embedding and its kind are trained for. Each distinct text is embedded once.
"""

from __future__ import annotations

from typing import Sequence

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


def cosine_scores(vectors: Sequence[Sequence[float]], pairs: list[tuple[int, int]]) -> list[float]:
    """The cosine similarity of vectors[i] and vectors[j] for each (i, j)."""
    rows = np.asarray(vectors, dtype=np.float64)
    rows = rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)
    return [float(rows[i] @ rows[j]) for i, j in pairs]
