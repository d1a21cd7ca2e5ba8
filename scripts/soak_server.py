"""Soak a running streamserve with a mix of good, bad and abandoned requests at once.

Workers loop for --seconds, each picking one of: streamed chats and completions (some cut
off after a few chunks), n > 1 with logprobs and echo, requests whose client times out,
JSON-schema (with patterns and lengths), choice, regex and tool-call outputs, prompt_logprobs,
vLLM's allowed_token_ids / bad_words / truncate_prompt_tokens / priority, beam search, long prompts sharing a prefix,
responses (/v1/responses, streamed and not, and ones going on from them), embeddings,
websockets closed mid-stream or sent bad frames, tokenize/detokenize, and bad bodies that
must get a 400. Afterwards the engine must go idle with no KV block held (/metrics) and
still serve. With --pid, the server's resident memory before and after (run twice: memory
that keeps growing round after round is a leak). Exits 1 on any problem.

    python -m streamserve --port 8091 --num-gpu-blocks-override 96 --max-model-len 1024 &
    python scripts/soak_server.py --url http://127.0.0.1:8091 --seconds 150 --workers 24 --pid $!

A small KV cache (--num-gpu-blocks-override) makes requests preempt each other too. With
--priority (the server started with --scheduling-policy priority), requests carry random
priorities, and waiting ones of a lower value preempt running ones. Where /v1/models lists LoRA
adapters, requests name the model or one of them at random; with --lora-path, workers also
load that adapter under new names, stream through it and unload it mid-stream.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import re
import time
from typing import Optional

import aiohttp

WORDS = "the cat sat on a mat while rain fell over quiet hills and rivers ran toward the sea".split()
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
PATTERNED = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{2,4}$"},
                                              "note": {"type": "string", "maxLength": 12}},
             "required": ["code", "note"]}
REGEX = r"(yes|no), because [a-z ]{1,30}\."
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


class Soak:
    def __init__(self, url: str, models: list[str], priority: bool = False, lora_path: Optional[str] = None) -> None:
        self.url, self.models, self.priority, self.lora_path = url, models, priority, lora_path
        self.counts: collections.Counter = collections.Counter()
        self.problems: list[tuple] = []

    @property
    def model(self) -> str:
        """The model, or one of its LoRA adapters (those /v1/models lists), at random."""
        return random.choice(self.models)

    def text(self, n: int) -> str:
        return " ".join(random.choice(WORDS) for _ in range(n))

    def chat(self, **kw) -> dict:
        return {"model": self.model, "messages": [{"role": "user", "content": self.text(random.randint(3, 40))}],
                "max_tokens": random.randint(1, 48), "temperature": random.choice([0, 0.7, 1.0]), **kw}

    def completion(self, **kw) -> dict:
        body = {"model": self.model, "prompt": self.text(random.randint(1, 60)), "max_tokens": random.randint(1, 48),
                "temperature": random.choice([0, 0.8]), **kw}
        if self.priority:
            body.setdefault("priority", random.randint(-2, 2))
        return body

    def bad_bodies(self) -> list[tuple[str, dict]]:
        c, m = "/v1/completions", "/v1/chat/completions"
        return [(c, self.completion(max_tokens=-1)), (c, self.completion(temperature=-3)),
                (c, self.completion(n=0)), (c, self.completion(top_p=7)), (c, self.completion(prompt="")),
                (c, self.completion(logprobs=99)), (c, self.completion(prompt=[[10 ** 9]])),
                (c, self.completion(prompt=self.text(5000), max_tokens=5)), (c, self.completion(stop=[1, 2])),
                (c, self.completion(logit_bias={"abc": 1})), (c, self.completion(max_tokens=10 ** 9)),
                (c, self.completion(model="no-such-model")), (m, self.chat(messages=[]))]

    def expect(self, what: str, status, want, detail="") -> None:
        self.counts[what] += 1
        if status != want:
            self.problems.append((what, status, str(detail)[:300]))

    async def post(self, s, path: str, body: dict, timeout: Optional[float] = None) -> tuple[int, str]:
        kw = {"timeout": aiohttp.ClientTimeout(total=timeout)} if timeout else {}
        async with s.post(self.url + path, json=body, **kw) as r:
            return r.status, await r.text()

    async def stream(self, s, path: str, body: dict, cut: Optional[int] = None) -> int:
        """Reads an SSE stream to [DONE] (or leaves after `cut` chunks); its HTTP status."""
        async with s.post(self.url + path, json=body) as r:
            if r.status != 200:
                self.problems.append(("stream refused", r.status, (await r.text())[:300]))
                return r.status
            chunks, done, finish = 0, False, None
            async for line in r.content:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                frame = json.loads(data)
                if "error" in frame:
                    self.problems.append(("in-band error", path, frame))
                    return r.status
                for choice in frame.get("choices", []):
                    finish = choice.get("finish_reason") or finish
                chunks += 1
                if cut is not None and chunks >= cut:
                    return r.status
            if not done or finish is None:
                self.problems.append(("stream without [DONE] or a finish reason", path, done, finish))
            return r.status

    async def one(self, s) -> None:
        kind = random.randrange(23)
        if kind == 21 and not self.lora_path:
            kind = 0
        if kind == 0:
            self.expect("chat stream", await self.stream(s, "/v1/chat/completions", self.chat(stream=True)), 200)
        elif kind == 1:
            await self.stream(s, "/v1/completions", self.completion(stream=True, max_tokens=48), cut=random.randint(1, 5))
            self.counts["stream left early"] += 1
        elif kind == 2:
            status, t = await self.post(s, "/v1/completions",
                                        self.completion(n=3, logprobs=2, echo=random.random() < 0.5))
            self.expect("n=3 with logprobs", status, 200, t)
            if status == 200 and len(json.loads(t)["choices"]) != 3:
                self.problems.append(("n=3 gave", t[:300]))
        elif kind == 3:
            try:
                await self.post(s, "/v1/chat/completions", self.chat(max_tokens=64), timeout=random.uniform(0.05, 0.5))
                self.counts["ended before its client's timeout"] += 1
            except asyncio.TimeoutError:
                self.counts["client timed out"] += 1
        elif kind == 4:
            status, t = await self.post(s, "/v1/chat/completions", self.chat(max_tokens=80, response_format={
                "type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}))
            self.expect("json schema", status, 200, t)
            choice = json.loads(t)["choices"][0] if status == 200 else {}
            if choice.get("finish_reason") == "stop":
                json.loads(choice["message"]["content"])
        elif kind == 5:
            options = ["yes", "no", "maybe"]
            status, t = await self.post(s, "/v1/completions", self.completion(structured_outputs={"choice": options}))
            self.expect("choice", status, 200, t)
            choice = json.loads(t)["choices"][0] if status == 200 else {}
            if choice.get("finish_reason") == "stop" and choice["text"] not in options:
                self.problems.append(("choice gave", choice["text"]))
        elif kind == 6:
            path, body = random.choice(self.bad_bodies())
            status, t = await self.post(s, path, body)
            self.expect("bad body", status, 404 if body["model"] == "no-such-model" else 400, (body, t))
        elif kind == 7:
            async with s.post(self.url + "/v1/completions", data=b"{not json") as r:
                self.expect("bad JSON", r.status, 400, await r.text())
        elif kind == 8:
            async with s.ws_connect(self.url + "/v1/ws") as ws:
                for i in range(3):
                    await ws.send_str(json.dumps({"type": "request", "id": str(i), "endpoint": "chat.completions",
                                                  "body": self.chat(max_tokens=40)}))
                leave_after = random.randint(1, 6)
                async for _ in ws:
                    leave_after -= 1
                    if leave_after == 0:
                        break
                if random.random() < 0.5:
                    await ws.send_str(json.dumps({"type": "cancel", "id": "1"}))
            self.counts["websocket closed mid-stream"] += 1
        elif kind == 9:
            async with s.ws_connect(self.url + "/v1/ws") as ws:
                await ws.send_str(json.dumps({"type": "request", "id": "a", "endpoint": "completions",
                                              "body": self.completion(max_tokens=8)}))
                await ws.send_str("garbage")
                await ws.send_str(json.dumps({"type": "request", "id": "b", "endpoint": "nope", "body": {}}))
                kinds = []
                async for msg in ws:
                    frame = json.loads(msg.data)
                    kinds.append(frame["type"])
                    if frame["type"] == "done":
                        break
            self.expect("websocket with bad frames", kinds[-1:] + [kinds.count("error")], ["done", 2], kinds)
        elif kind == 10:
            status, t = await self.post(s, "/tokenize", {"model": self.model, "prompt": self.text(10)})
            self.expect("tokenize", status, 200, t)
            status, t = await self.post(s, "/detokenize", {"model": self.model, "tokens": json.loads(t)["tokens"]})
            self.expect("detokenize", status, 200, t)
        elif kind == 11:
            status, t = await self.post(s, "/v1/completions", self.completion(prompt_logprobs=1, max_tokens=4))
            self.expect("prompt_logprobs", status, 200, t)
        elif kind == 12:
            status, t = await self.post(s, "/v1/chat/completions",
                                        self.chat(max_tokens=60, tools=TOOLS, tool_choice="required"))
            self.expect("tool_choice required", status, 200, t)
        elif kind == 13:
            status = await self.stream(s, "/v1/chat/completions", self.chat(
                stream=True, n=2, logprobs=True, top_logprobs=3, stream_options={"include_usage": True}))
            self.expect("chat stream n=2", status, 200)
        elif kind == 14:  # long prompts sharing a prefix: prefix-cache hits, and preemption under a small cache
            status, t = await self.post(s, "/v1/completions", {"model": self.model, "prompt": "shared " * 300 +
                                                               self.text(5), "max_tokens": 16, "temperature": 0})
            self.expect("long prompt, shared prefix", status, 200, t)
        elif kind == 15:
            status = await self.stream(s, "/v1/completions", self.completion(
                stream=True, ignore_eos=True, max_tokens=64, min_tokens=10, stop=["."]))
            self.expect("completion stream", status, 200)
        elif kind == 16:  # a response, then one going on from it
            body = {"model": self.model, "input": self.text(10), "max_output_tokens": random.randint(1, 32)}
            status, t = await self.post(s, "/v1/responses", body)
            self.expect("response", status, 200, t)
            if status == 200:
                status, t = await self.post(s, "/v1/responses", {**body, "previous_response_id": json.loads(t)["id"]})
                self.expect("response going on", status, 200, t)
        elif kind == 19:  # a regex, or a schema with a pattern and a length, streamed or not
            if random.random() < 0.5:
                body = self.completion(max_tokens=40, structured_outputs={"regex": REGEX})
                status, t = await self.post(s, "/v1/completions", body)
                self.expect("regex", status, 200, t)
                choice = json.loads(t)["choices"][0] if status == 200 else {}
                if choice.get("finish_reason") == "stop" and not re.fullmatch(REGEX, choice["text"]):
                    self.problems.append(("regex gave", choice["text"]))
            else:
                fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PATTERNED}}
                status = await self.stream(s, "/v1/chat/completions",
                                           self.chat(stream=True, max_tokens=60, response_format=fmt))
                self.expect("patterned schema stream", status, 200)
        elif kind == 20:  # vLLM's sampling extras
            body = self.completion(allowed_token_ids=random.sample(range(1000), 20), max_tokens=8)
            if random.random() < 0.5:
                body = self.completion(bad_words=random.sample(WORDS, 3), truncate_prompt_tokens=random.randint(1, 20))
            status, t = await self.post(s, "/v1/completions", body)
            self.expect("allowed ids / bad words / truncation", status, 200, t)
        elif kind == 21:  # a LoRA adapter loaded, streamed through, unloaded once it streams
            name = f"soak-{random.randrange(10 ** 9)}"
            status, t = await self.post(s, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": self.lora_path})
            self.expect("LoRA load", status, 200, t)
            body = {"model": name, "prompt": self.text(20), "max_tokens": 32, "stream": True, "ignore_eos": True}
            async with s.post(self.url + "/v1/completions", json=body) as r:
                self.expect("LoRA stream", r.status, 200)
                lines = [line async for line in _first_data(r.content)]
                status, t = await self.post(s, "/v1/unload_lora_adapter", {"lora_name": name})
                self.expect("LoRA unload mid-stream", status, 200, t)
                lines += [line.strip() async for line in r.content if line.startswith(b"data:")]
            if lines[-1:] != [b"data: [DONE]"] or b'"length"' not in b"".join(lines):
                self.problems.append(("LoRA stream unloaded under it ended with", lines[-2:]))
            status, _ = await self.post(s, "/v1/completions", {"model": name, "prompt": "hi", "max_tokens": 1})
            self.expect("LoRA unloaded: a 404", status, 404)
        elif kind == 22:  # beam search, streamed or not, left early at times
            n = random.randint(1, 4)
            body = self.completion(use_beam_search=True, n=n, max_tokens=random.randint(1, 12),
                                   length_penalty=random.choice([0.5, 1.0, 2.0]), temperature=0)
            if random.random() < 0.3:
                status = await self.stream(s, "/v1/completions", {**body, "stream": True})
                self.expect("beam search stream", status, 200)
            else:
                try:
                    status, t = await self.post(s, "/v1/completions", body, timeout=random.choice([None, 0.2]))
                    self.expect("beam search", status, 200, t)
                    if status == 200 and len(json.loads(t)["choices"]) != n:
                        self.problems.append(("beam search gave", t[:200]))
                except asyncio.TimeoutError:
                    self.counts["beam search left early"] += 1
        elif kind == 18:  # embeddings of a few inputs at once, left early at times
            body = {"model": self.model, "input": [self.text(random.randint(1, 40)) for _ in range(random.randint(1, 4))]}
            try:
                status, t = await self.post(s, "/v1/embeddings", body, timeout=random.choice([None, 0.05]))
                self.expect("embeddings", status, 200, t)
                if status == 200 and len(json.loads(t)["data"]) != len(body["input"]):
                    self.problems.append(("embeddings gave", t[:200]))
            except asyncio.TimeoutError:
                self.counts["embeddings left early"] += 1
        else:  # a streamed response, left early or read to its last event
            cut = random.choice([None, random.randint(1, 6)])
            async with s.post(self.url + "/v1/responses", json={"model": self.model, "input": self.text(10),
                                                                "stream": True, "max_output_tokens": 40}) as r:
                events = []
                async for line in r.content:
                    if line.startswith(b"event: "):
                        events.append(line[7:].strip().decode())
                        if cut is not None and len(events) >= cut:
                            break
            self.counts["streamed response"] += 1
            if cut is None and events[-1:] not in (["response.completed"], ["response.incomplete"]):
                self.problems.append(("streamed response ended with", events[-3:]))

    async def worker(self, s, end: float) -> None:
        while time.time() < end:
            try:
                await self.one(s)
            except (aiohttp.ClientError, ValueError, KeyError) as exc:
                self.problems.append(("client saw", repr(exc)))

    async def metric(self, s, name: str) -> Optional[float]:
        async with s.get(self.url + "/metrics") as r:
            text = await r.text()
        found = re.search(r"^streamserve:%s\{[^}]*\} ([0-9.e+-]+)$" % name, text, re.M)
        return float(found.group(1)) if found else None

    async def idle(self, s, seconds: float = 60) -> dict:
        """The engine's gauges once idle (or after `seconds`)."""
        names = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
        for _ in range(int(seconds)):
            gauges = {n: await self.metric(s, n) for n in names}
            if all(v == 0 for v in gauges.values()):
                break
            await asyncio.sleep(1)
        gauges["num_preemptions_total"] = await self.metric(s, "num_preemptions_total")
        return gauges


async def _first_data(content):
    """The SSE body's lines up to its first data line."""
    async for line in content:
        if line.startswith(b"data:"):
            yield line.strip()
            return


def rss_mib(pid: Optional[int]) -> Optional[float]:
    if pid is None:
        return None
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


async def main(args) -> int:
    async with aiohttp.ClientSession() as s:
        async with s.get(args.url + "/v1/models") as r:
            soak = Soak(args.url, [m["id"] for m in (await r.json())["data"]], args.priority, args.lora_path)
        before = rss_mib(args.pid)
        end = time.time() + args.seconds
        await asyncio.gather(*(soak.worker(s, end) for _ in range(args.workers)))
        gauges = await soak.idle(s)
        status, _ = await soak.post(s, "/v1/completions", soak.completion(max_tokens=5))
    print(f"{sum(soak.counts.values())} requests in {args.seconds:.0f} s:",
          ", ".join(f"{k} {v}" for k, v in sorted(soak.counts.items())))
    print("afterwards:", ", ".join(f"{k} {v:g}" for k, v in gauges.items()), f"| a new request: HTTP {status}")
    if args.pid is not None:
        print(f"server resident memory: {before:.0f} -> {rss_mib(args.pid):.0f} MiB")
    for problem in soak.problems[:40]:
        print("problem:", *problem)
    idle = all(gauges[n] == 0 for n in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"))
    print(f"{len(soak.problems)} problems; engine {'idle' if idle else 'NOT idle'}")
    return 0 if idle and status == 200 and not soak.problems else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--workers", type=int, default=24)
    parser.add_argument("--pid", type=int, help="the server's process ID, to report its resident memory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--priority", action="store_true",
                        help="the server runs --scheduling-policy priority: requests carry random priorities")
    parser.add_argument("--lora-path", help="a LoRA adapter's directory: the server runs with --enable-lora and "
                                           "VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, and workers load it under new "
                                           "names, stream through it and unload it mid-stream")
    args = parser.parse_args()
    random.seed(args.seed)
    raise SystemExit(asyncio.run(main(args)))
