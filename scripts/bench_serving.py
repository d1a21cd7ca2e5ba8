"""Serving benchmark for any OpenAI-compatible server: streamed completions at a fixed
concurrency or a Poisson request rate.

Reports time to first token (TTFT), time per output token after the first (TPOT),
inter-token latency (ITL, between stream chunks), end-to-end latency (mean, p50, p99)
and output tokens/s; writes them as JSON. With --offline-model, also runs the same
requests through LLM.generate in this process (after the server run, so the two do not
share the CPU) and prints the served/offline ratio.

    python -m streamserve --model M --port 8000 &
    python scripts/bench_serving.py --url http://127.0.0.1:8000 --concurrency 32 --offline-model M
    python scripts/bench_serving.py --temperature 0.7 --top-p 0.9   # sampled, as chats are

Greedy by default (temperature 0), which times the model alone; a chat client samples.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import aiohttp


def make_requests(n: int, vocab: int, seed: int, prompt_len: tuple[int, int], output_len: tuple[int, int]):
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_len))], rng.randint(*output_len))
            for _ in range(n)]


async def one_request(session, url: str, model: str, prompt: list[int], max_tokens: int, sampling: dict) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, **sampling,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    chunk_times, tokens = [], 0
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for line in r.content:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if obj.get("usage"):
                tokens = obj["usage"]["completion_tokens"]
            elif obj["choices"] and obj["choices"][0].get("text"):
                chunk_times.append(time.perf_counter())
    end = time.perf_counter()
    ttft = chunk_times[0] - start if chunk_times else end - start
    itl = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    tpot = (end - start - ttft) / (tokens - 1) if tokens > 1 else 0.0
    return {"ttft": ttft, "itl": itl, "tpot": tpot, "e2e": end - start, "tokens": tokens}


async def run(args, requests) -> dict:
    # a connection per request: a server may close a kept-alive one as the next request goes
    # out on it (llama-server closes them after a few requests), and that request would be lost
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                     connector=aiohttp.TCPConnector(force_close=True)) as session:
        async with session.get(args.url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        sem = asyncio.Semaphore(args.concurrency or len(requests))
        rng = random.Random(args.seed)

        async def limited(prompt, max_tokens):
            async with sem:
                return await one_request(session, args.url, model, prompt, max_tokens, sampling(args))

        start = time.perf_counter()
        tasks = []
        for prompt, max_tokens in requests:
            tasks.append(asyncio.create_task(limited(prompt, max_tokens)))
            if args.request_rate:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    return summarize(results, elapsed)


def sampling(args) -> dict:
    return {"temperature": args.temperature, "top_p": args.top_p}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))] if values else 0.0


def summarize(results: list[dict], elapsed: float) -> dict:
    out = {"requests": len(results), "elapsed_s": elapsed,
           "output_tokens": sum(r["tokens"] for r in results)}
    out["output_tok_s"] = out["output_tokens"] / elapsed
    series = {"ttft": [r["ttft"] for r in results], "tpot": [r["tpot"] for r in results],
              "itl": [x for r in results for x in r["itl"]], "e2e": [r["e2e"] for r in results]}
    for name, values in series.items():
        out[name] = {"mean_ms": 1000 * statistics.fmean(values) if values else 0.0,
                     "p50_ms": 1000 * pct(values, 50), "p99_ms": 1000 * pct(values, 99)}
    return out


def offline(model: str, dtype: str, requests, settings: dict) -> float:
    from streamserve import LLM, SamplingParams

    llm = LLM(model, dtype=dtype)
    llm.generate([{"prompt_token_ids": p} for p, _ in requests[:2]],
                 SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p, _ in requests],
                           [SamplingParams(**settings, max_tokens=m, ignore_eos=True) for _, m in requests],
                           use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32, help="0: all at once (or by --request-rate)")
    parser.add_argument("--request-rate", type=float, default=0.0, help="Poisson arrivals per second (0: off)")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(64, 256))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 128))
    parser.add_argument("--vocab", type=int, default=49152, help="prompt token IDs are drawn below this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--offline-model", default=None, help="also run LLM.generate on this model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--json", default="bench_serving.json")
    args = parser.parse_args()
    requests = make_requests(args.num_prompts, args.vocab, args.seed, tuple(args.prompt_len),
                             tuple(args.output_len))
    result = asyncio.run(run(args, requests))
    print(f"served: {result['output_tokens']} tokens in {result['elapsed_s']:.1f} s = "
          f"{result['output_tok_s']:.1f} tok/s")
    for name in ("ttft", "tpot", "itl", "e2e"):
        r = result[name]
        print(f"  {name:5s} mean {r['mean_ms']:8.1f} ms   p50 {r['p50_ms']:8.1f} ms   p99 {r['p99_ms']:8.1f} ms")
    if args.offline_model:
        result["offline_tok_s"] = offline(args.offline_model, args.dtype, requests, sampling(args))
        result["served_over_offline"] = result["output_tok_s"] / result["offline_tok_s"]
        print(f"offline LLM.generate: {result['offline_tok_s']:.1f} tok/s; served / offline = "
              f"{result['served_over_offline']:.2f}")
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
