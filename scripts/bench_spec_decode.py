"""What n-gram speculative decoding (--speculative-config) buys: the same greedy chats on one
engine without it and on one with it, alternating in one process, with the acceptance rate
and whether the outputs match.

The default prompts ask the default model to rewrite text it is given (a code edit, a copy), the
work prompt lookup is for; `--prompts free` asks for new text, where guesses are seldom right and
what a step of guesses costs shows; `--prompts extract` asks for JSON under a schema (structured output)
quoting the text it is given.

    python scripts/bench_spec_decode.py [--model DIR] [--tokens 128] [--batch 1] [--rounds 3]
        [--k 2 4] [--lookup-max 3] [--lookup-min 1] [--prompts quote|free|extract] [--no-pause-too]
"""

from __future__ import annotations

import argparse
import statistics
import time

from streamserve import LLM, SamplingParams
from streamserve.sampling_params import StructuredOutputsParams

CODE = '''def mean(values):
    total = 0
    count = 0
    for value in values:
        total += value
        count += 1
    return total / count


def variance(values):
    m = mean(values)
    total = 0
    for value in values:
        total += (value - m) ** 2
    return total / len(values)
'''
TEXT = ("The river rises in the hills to the north and runs south through a wide valley of farms and "
        "small towns. In spring it floods the low fields; in late summer it is shallow enough to cross on foot. "
        "The old stone bridge at the market town was built in the fourteenth century and still carries traffic.")
QUOTE = [f"Rename the function `mean` to `average` everywhere in this code, and output the whole code:\n\n{CODE}",
         f"Copy this paragraph exactly, word for word:\n\n{TEXT}",
         f"Add a docstring to each function of this code and output the whole code:\n\n{CODE}",
         f"Repeat the following text twice:\n\n{TEXT}"]
# Extraction under a JSON schema (structured output): the values are the text's own words.
EXTRACT = [f"Extract from this text, as JSON, what it says of the river, the seasons and the bridge, quoting "
           f"its words:\n\n{TEXT}",
           f"Extract from this code, as JSON, each function's name and its whole source:\n\n{CODE}"]
EXTRACT_SCHEMA = {"type": "object", "properties": {"facts": {"type": "array", "items": {
    "type": "object", "properties": {"subject": {"type": "string"}, "quote": {"type": "string"}},
    "required": ["subject", "quote"]}, "maxItems": 4}}, "required": ["facts"]}
FREE = ["Write a short story about a lighthouse keeper.", "Explain how a refrigerator works.",
        "List ten ideas for a birthday party.", "Describe the water cycle."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1, help="chats at once (the prompts repeated)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4], help="num_speculative_tokens to try")
    parser.add_argument("--lookup-max", type=int, default=3)
    parser.add_argument("--lookup-min", type=int, default=1)
    parser.add_argument("--prompts", choices=("quote", "free", "extract"), default="quote",
                        help="extract: under a JSON schema (structured output)")
    parser.add_argument("--no-pause-too", action="store_true",
                        help="also each k with no pause in guessing after misses (Scheduler.SPEC_MAX_PAUSE_DOUBLINGS 0)")
    args = parser.parse_args()
    common = dict(kv_cache_memory="512MiB", max_model_len=2048)
    engines = {"plain": LLM(args.model, **common)}
    for k in args.k:
        engines[f"k={k}"] = LLM(args.model, speculative_config={
            "method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": args.lookup_max,
            "prompt_lookup_min": args.lookup_min}, **common)
        if args.no_pause_too:
            engines[f"k={k}np"] = LLM(args.model, speculative_config=engines[f"k={k}"].config.scheduler.speculative_config,
                                      **common)
            engines[f"k={k}np"].engine_core.scheduler.SPEC_MAX_PAUSE_DOUBLINGS = 0
    prompts = {"quote": QUOTE, "free": FREE, "extract": EXTRACT}[args.prompts]
    chats = [[{"role": "user", "content": prompts[i % len(prompts)]}] for i in range(args.batch)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, structured_outputs=StructuredOutputsParams(
        json=EXTRACT_SCHEMA) if args.prompts == "extract" else None)
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    texts, tokens = {}, {}
    for name, llm in engines.items():  # warm up
        llm.chat(chats, params, use_tqdm=False)
    for _ in range(args.rounds):
        for name, llm in engines.items():
            scheduler = llm.engine_core.scheduler
            before = scheduler.spec_num_draft_tokens, scheduler.spec_num_accepted_tokens
            start = time.perf_counter()
            outputs = llm.chat(chats, params, use_tqdm=False)
            seconds[name].append(time.perf_counter() - start)
            texts[name] = [o.outputs[0].text for o in outputs]
            tokens[name] = sum(len(o.outputs[0].token_ids) for o in outputs)
            seconds.setdefault(name + " drafts", []).append(
                (scheduler.spec_num_draft_tokens - before[0], scheduler.spec_num_accepted_tokens - before[1]))
    base = statistics.median(seconds["plain"])
    for name in engines:
        s = statistics.median(seconds[name])
        drafts = seconds[name + " drafts"][-1]
        rate = f", {drafts[1]}/{drafts[0]} guesses kept" if drafts[0] else ""
        same = "same text" if texts[name] == texts["plain"] else "TEXT DIFFERS"
        print(f"{name:6s} {tokens[name]} tokens in {s * 1000:7.0f} ms: {tokens[name] / s:6.1f} tokens/s, "
              f"{base / s:.2f}x plain (median of {args.rounds}){rate}; {same}")


if __name__ == "__main__":
    main()
