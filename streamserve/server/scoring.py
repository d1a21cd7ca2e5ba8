"""POST /v1/score and /v1/rerank: vLLM's score and rerank APIs (the rerank one in Jina's and
Cohere's shape, as vLLM serves it also at /rerank and /v2/rerank), by embedding similarity.

Each distinct text of a call is embedded as /v1/embeddings embeds it (its last token's final
hidden state, L2-normalised) and a pair scores the cosine similarity of its two texts'
embeddings (frontend/scoring.py), as vLLM scores with an embedding model such as
Qwen3-Embedding. The texts run at once, batched with everything else.

/v1/score takes `text_1` and `text_2`, each a string or a list of them: one text_1 against each
text_2, or the two lists pairwise (as long as each other); `data` lists the pairs' scores in
that order. /v1/rerank takes a `query` and `documents` (strings, or Jina's {"text": ...}
objects), and returns the documents' `results` best first, each with its index among the
documents, its `relevance_score` and (unless `return_documents` is false) its text; `top_n` > 0
keeps the first n. Both take vLLM's `truncate_prompt_tokens` and `priority`, and a LoRA
adapter's name as `model`.

A cross-encoder (config.json's or --hf-overrides' classifier_from_token, as vLLM serves
Qwen3-Reranker) scores each pair as one prompt instead, from its last token's logits at those
tokens (frontend/scoring.py).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from aiohttp import web

from streamserve.frontend.scoring import classifier_score, cosine_scores, distinct_pairs, pair_prompts, score_pairs
from streamserve.server.app import CONFIG, ENGINE, json_response, request_priority, read_body, served_adapter
from streamserve.server.embeddings import embed, embedding_params, prepared
from streamserve.server.protocol import APIError, bad_request


def _texts(value: Any, param: str, objects: bool = False) -> list[str]:
    """A string, or a non-empty list of them (with `objects`, Jina's {"text": ...} too), as a
    list of non-empty strings."""
    items = [value] if isinstance(value, str) else value
    what = "a string or a list of strings" + (" or of {\"text\": ...} objects" if objects else "")
    if not isinstance(items, list) or not items:
        raise bad_request(f"'{param}' must be {what}, not empty", param)
    texts = []
    for item in items:
        if objects and isinstance(item, dict) and set(item) == {"text"}:
            item = item["text"]
        if not isinstance(item, str):
            raise bad_request(f"'{param}' must be {what}", param)
        if not item:
            raise bad_request(f"'{param}' holds an empty text", param)
        texts.append(item)
    return texts


async def _similarities(request: web.Request, body: dict[str, Any], texts_1: list[str], texts_2: list[str],
                        pairs: list[tuple[int, int]], names: tuple[str, str]) -> tuple[list[float], int, str]:
    """(each pair's score, the tokens read, the model's name) for pairs of (index into texts_1,
    index into texts_2): their embeddings' cosine, or a cross-encoder's score of each pair read
    as one prompt. `names`: the body's fields of texts_1 and texts_2, for errors."""
    engine, serving = request.app[ENGINE], request.app[CONFIG]
    params, priority = embedding_params(body), request_priority(engine, body)
    lora = served_adapter(request, body.get("model"))
    name = serving.model_name if lora is None else lora.name
    classifier = engine.input_processor.classifier_token_ids
    distinct, indexed = distinct_pairs(texts_1, texts_2, pairs)
    count = len(pairs) if classifier is not None else len(distinct)
    if count > serving.server.max_choices:  # (before any tokenizing)
        raise bad_request(f"{count} {'pairs' if classifier is not None else 'distinct texts'}: at most "
                          f"{serving.server.max_choices} a request (--max-choices)")
    if classifier is not None:
        params = dataclasses.replace(params, pool_token_ids=classifier)
        inputs = pair_prompts(engine.tokenizer, texts_1, texts_2, pairs)
        where = [(names[1], j, len(texts_2)) for _, j in pairs]  # (a prompt too long: its document's)
    else:
        inputs = distinct
        first = set(texts_1)
        where = [(names[0], texts_1.index(t), len(texts_1)) if t in first else (names[1], texts_2.index(t), len(texts_2))
                 for t in distinct]
    prompts = []
    for x, (field, k, of) in zip(inputs, where):
        try:
            prompts += prepared(engine, [x], params, field)
        except APIError as exc:
            raise bad_request(f"{field} {k}: {exc.message}" if of > 1 else exc.message, exc.param) from None
    vectors = await embed(engine, prompts, params, priority, lora)
    tokens = sum(len(ids) for _, ids in prompts)
    if classifier is not None:
        return [classifier_score(v) for v in vectors], tokens, name
    return cosine_scores(vectors, indexed), tokens, name


async def create_score(request: web.Request) -> web.Response:
    body = await read_body(request)
    texts_1, texts_2 = _texts(body.get("text_1"), "text_1"), _texts(body.get("text_2"), "text_2")
    try:
        pairs = score_pairs(len(texts_1), len(texts_2))
    except ValueError as exc:
        raise bad_request(str(exc), "text_1") from None
    scores, tokens, model = await _similarities(request, body, texts_1, texts_2, pairs, ("text_1", "text_2"))
    return json_response({
        "id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
        "data": [{"index": k, "object": "score", "score": score} for k, score in enumerate(scores)],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}})


async def create_rerank(request: web.Request) -> web.Response:
    body = await read_body(request)
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise bad_request("'query' must be a non-empty string", "query")
    documents = _texts(body.get("documents"), "documents", objects=True)
    top_n = body.get("top_n")
    if top_n is not None and (not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0):
        raise bad_request("'top_n' must be an integer >= 0 (0: every document)", "top_n")
    keep = body.get("return_documents", True)
    if not isinstance(keep, bool):
        raise bad_request("'return_documents' must be a boolean", "return_documents")
    scores, tokens, model = await _similarities(request, body, [query], documents, score_pairs(1, len(documents)),
                                                ("query", "documents"))
    order = sorted(range(len(documents)), key=lambda k: -scores[k])[:top_n or None]
    results = [{"index": k, **({"document": {"text": documents[k]}} if keep else {}), "relevance_score": scores[k]}
               for k in order]
    return json_response({"id": f"rerank-{uuid.uuid4().hex}", "model": model, "usage": {"total_tokens": tokens},
                          "results": results})


def add_routes(app: web.Application) -> None:
    for path in ("/score", "/v1/score"):
        app.router.add_post(path, create_score)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.router.add_post(path, create_rerank)
