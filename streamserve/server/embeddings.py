"""POST /v1/embeddings: OpenAI's embeddings API, by last-token pooling.

Each input runs as one request with SamplingParams.embed (sampling_params.EMBEDDING): the
engine reads the prompt, and the step that reads its last token hands back that token's
final hidden state, L2-normalised, as vLLM pools decoder models (what Qwen3-Embedding and
its kind are trained for; any model served gets the same pooling). The inputs of one call
run at once, batched by the scheduler with everything else. `encoding_format` "float" (the
default) or "base64" (little-endian float32, what the openai client asks for); `dimensions`
cuts each vector to its first n values, normalised again, where the model was trained for it
(config.json's is_matryoshka or matryoshka_dimensions, as vLLM requires; Qwen3-Embedding is
trained so, and --hf-overrides '{"is_matryoshka": true}' says it where config.json does not).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
from typing import Any, Optional

import numpy as np
from aiohttp import web

from streamserve.frontend.scoring import cut, matryoshka_check
from streamserve.sampling_params import EMBEDDING, ParamError, SamplingParams
from streamserve.server import protocol
from streamserve.server.app import CONFIG, ENGINE, json_response, merged, read_body, request_priority, served_adapter
from streamserve.server.protocol import APIError, bad_request


def embedding_params(body: dict[str, Any]) -> SamplingParams:
    """EMBEDDING, with vLLM's truncate_prompt_tokens where the body gives it."""
    try:
        return dataclasses.replace(EMBEDDING, truncate_prompt_tokens=body.get("truncate_prompt_tokens"))
    except ParamError as exc:
        raise bad_request(str(exc), exc.param) from None


def _inputs(body: dict[str, Any], engine, limit: int, params: SamplingParams
            ) -> list[tuple[Optional[str], list[int]]]:
    """(text or None, token IDs) per input: a string, token IDs, or a list of either; each cut
    to its last params.truncate_prompt_tokens tokens where that is set."""
    try:
        inputs = protocol.completion_prompts({"prompt": body.get("input")})
    except APIError as exc:
        message = exc.message.replace("'prompt'", "'input'").replace("a prompt", "an input")
        raise bad_request(message.replace("prompt", "input"), "input") from None
    if len(inputs) > limit:
        raise bad_request(f"{len(inputs)} inputs: at most {limit} a request (--max-choices)", "input")
    return prepared(engine, inputs, params, "input")


def prepared(engine, inputs: list, params: SamplingParams, param: str) -> list[tuple[Optional[str], list[int]]]:
    """(text or None, token IDs) of each input (a string or token IDs), cut to its last
    params.truncate_prompt_tokens tokens where that is set and checked against the model's
    length and vocabulary; a 400 naming `param` (and the input, where there are several)."""
    prompts = [(x, engine.renderer.encode(x)) if isinstance(x, str) else (None, x) for x in inputs]
    for i, (text, ids) in enumerate(prompts):
        try:
            prompts[i] = engine.input_processor.truncate(text, ids, params)
            engine.input_processor.validate(prompts[i][1], params)
        except ParamError as exc:
            message = f"{param} {i}: {exc}" if len(prompts) > 1 else str(exc)
            raise bad_request(message, param if exc.param == "prompt" else exc.param) from None
    return prompts


async def embed(engine, prompts: list[tuple[Optional[str], list[int]]], params: SamplingParams, priority: int,
                lora) -> list[list[float]]:
    """Each prompt's embedding, the prompts run at once (aborted where the client leaves)."""
    vectors: list[Optional[list[float]]] = [None] * len(prompts)
    streams = [engine.generate(ids, params, prompt=text, priority=priority, lora=lora) for text, ids in prompts]
    async with contextlib.aclosing(merged(streams)) as deltas:  # closed early (the client left): aborted
        async for i, delta in deltas:
            vectors[i] = delta.embedding or vectors[i]
    return vectors


async def create_embeddings(request: web.Request) -> web.Response:
    body = await read_body(request)
    engine, serving = request.app[ENGINE], request.app[CONFIG]
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise bad_request("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None:
        try:
            matryoshka_check(engine.config.model.hf_config, dimensions)
        except ValueError as exc:
            raise bad_request(f"'dimensions': {exc}", "dimensions") from None
    params, priority = embedding_params(body), request_priority(engine, body)
    lora = served_adapter(request, body.get("model"))
    prompts = _inputs(body, engine, serving.server.max_choices, params)
    vectors = [cut(v, dimensions) for v in await embed(engine, prompts, params, priority, lora)]
    data = [{"object": "embedding", "index": i,
             "embedding": vector if fmt == "float" else
             base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()}
            for i, vector in enumerate(vectors)]
    tokens = sum(len(ids) for _, ids in prompts)
    return json_response({"object": "list", "data": data, "model": serving.model_name if lora is None else lora.name,
                          "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/embeddings", create_embeddings)
