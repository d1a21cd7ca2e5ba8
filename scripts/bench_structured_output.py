"""What structured output costs: building token masks, and whole requests held to a schema.

    python scripts/bench_structured_output.py --model smollm2-135m-instruct

1. The vocabulary's token texts (read once, at the first structured request) and the masks
   of a set of JSON-mode and schema states, each built from scratch (they are cached after).
   Then regex states (vLLM's regex, a string's pattern or maxLength): the masks through the
   per-regex token trie (built once per regex: timed apart) against each token walked a
   character at a time, the same states in this process.
2. The same batch of chat requests through LLM.generate free, then held to a JSON schema
   (greedy, ignore_eos off, max_tokens each), in this process one after the other: output
   tokens/s of each and their ratio. The texts differ (the schema steers them), so the ratio
   is of tokens per second, not of whole runs.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from streamserve import LLM, SamplingParams, StructuredOutputsParams
from streamserve.engine import structured_output as so

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string"}, "country": {"type": "string"}, "population": {"type": "integer"},
    "landmarks": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    "kind": {"enum": ["capital", "town", "village"]}}, "required": ["city", "country", "population"]}
JSON_PREFIXES = ['', '{', '{"a": ', '{"a": [', '{"a": "x', '{"a": {"b": [1, {"c": ', '{"a": 1.5e']
SCHEMA_PREFIXES = ['', '{', '{"ci', '{"city": ', '{"city": "Paris", ', '{"city": "P", "country": "F", "population": 1',
                   '{"city": "P", "country": "F", "population": 1, "landmarks": [']


REGEX_CASES = [  # (name, start, prefixes: one state each)
    ("regex date", so.start_regex(r"\d{4}-\d{2}-\d{2}"), ["", "2", "20", "2024-", "2024-0", "2024-01-3"]),
    ("regex words", so.start_regex(r"[A-Za-z ,.]{1,200}"), ["", "H", "Hello", "Hello wor", "Hello world, and"]),
    ("string maxLength", so.start(so.compile_schema({"type": "string", "maxLength": 300})),
     ['"', '"a', '"ab', '"abc d', '"abc de f']),
    ("string pattern", so.start(so.compile_schema({"type": "string", "pattern": "^[a-z]+(-[a-z]+)*$"})),
     ['"', '"ab', '"ab-', '"ab-c']),
    ("regex of 36 classes", so.start_regex("(" + "|".join("abcdefghijklmnopqrstuvwxyz0123456789") + "){1,40}"),
     ["", "a", "ab1", "ab1z"]),
]


def time_regex_masks(vocabulary: so.Vocabulary) -> None:
    for name, start, prefixes in REGEX_CASES:
        states = [so.advance(start, prefix)[0] for prefix in prefixes]
        regex = states[0][2][0]
        t = time.perf_counter()
        vocabulary._trie(regex, plain=states[0][0] == so.STRING)
        trie = time.perf_counter() - t
        t = time.perf_counter()
        masks = [vocabulary._build(state) for state in states]
        by_trie = (time.perf_counter() - t) / len(states)
        t = time.perf_counter()
        walked = [np.array([bool(text) and "\ufffd" not in text and so.advance((state,), text) is not None
                            for text in vocabulary.texts]) for state in states]  # (no piece of a character)
        by_token = (time.perf_counter() - t) / len(states)
        assert all((m == w).all() for m, w in zip(masks, walked))
        print(f"{name} masks: {len(states)} states, trie {1e3 * trie:.0f} ms once, then {1e3 * by_trie:.1f} ms "
              f"a mask; token by token {1e3 * by_token:.1f} ms ({by_token / by_trie:.0f}x)")


def time_masks(vocabulary: so.Vocabulary, start: so.States, prefixes: list[str]) -> list[float]:
    times = []
    for prefix in prefixes:
        state = so.advance(start, prefix)[0]
        t = time.perf_counter()
        vocabulary._build(state)
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    llm = LLM(args.model)
    tokenizer = llm.get_tokenizer()
    t = time.perf_counter()
    vocabulary = so.Vocabulary(tokenizer, llm.engine_core.vocab_size)
    print(f"token texts of {vocabulary.vocab_size} tokens: {time.perf_counter() - t:.2f} s")
    for name, start, prefixes in (("JSON mode", so.START, JSON_PREFIXES),
                                  ("schema", so.start(so.compile_schema(SCHEMA)), SCHEMA_PREFIXES)):
        times = time_masks(vocabulary, start, prefixes)
        print(f"{name} masks: {len(times)} states, {1e3 * sum(times) / len(times):.1f} ms mean, "
              f"{1e3 * max(times):.1f} ms max")
    time_regex_masks(vocabulary)

    cities = ["Paris", "Rome", "Tokyo", "Cairo", "Lima", "Oslo", "Delhi", "Quito"]
    conversations = [[{"role": "user", "content": f"Describe {cities[i % len(cities)]} as JSON."}]
                     for i in range(args.requests)]
    free = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    held = SamplingParams(max_tokens=args.max_tokens, temperature=0,
                          structured_outputs=StructuredOutputsParams(json=SCHEMA))
    llm.chat(conversations[:2], held, use_tqdm=False)  # warm-up: the vocabulary, the first masks
    rates = {}
    for name, params in (("free", free), ("schema", held), ("free", free), ("schema", held)):
        t = time.perf_counter()
        outs = llm.chat(conversations, params, use_tqdm=False)
        elapsed = time.perf_counter() - t
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rates.setdefault(name, []).append(tokens / elapsed)
        print(f"{name:6}: {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:.1f} tok/s")
    ratio = [s / f for s, f in zip(rates["schema"], rates["free"])]
    print("schema / free tok/s: " + ", ".join(f"{r:.2f}" for r in ratio))


if __name__ == "__main__":
    main()
