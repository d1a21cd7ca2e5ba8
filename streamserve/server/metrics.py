"""GET /metrics: Prometheus text with vLLM's metric names under the `streamserve:` prefix.

Engine state (running and waiting requests, KV usage, prefix-cache and preemption
counts) is read from the engine when scraped; request timings are observed on the loop
as each request's deltas arrive.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Iterator, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from streamserve.frontend.async_engine import AsyncEngine
from streamserve.outputs import RequestOutput

logger = logging.getLogger(__name__)

P = "streamserve:"
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                    2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class _EngineCollector:
    """Reads the engine's own counters at scrape time (plain ints read across threads)."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name

    def collect(self) -> Iterator:
        core = self.engine.engine_core
        labels = ["model_name"]
        running = GaugeMetricFamily(P + "num_requests_running", "Requests in the running batch", labels=labels)
        waiting = GaugeMetricFamily(P + "num_requests_waiting", "Requests waiting to be scheduled", labels=labels)
        usage = GaugeMetricFamily(P + "kv_cache_usage_perc", "Share of KV blocks in use (0-1)", labels=labels)
        queries = CounterMetricFamily(P + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache", labels=labels)
        hits = CounterMetricFamily(P + "prefix_cache_hits", "Prompt tokens served from the prefix cache", labels=labels)
        preemptions = CounterMetricFamily(P + "num_preemptions", "Requests preempted for KV space", labels=labels)
        if core is not None:
            scheduler = core.scheduler
            pool = scheduler.kv_cache_manager.block_pool
            running.add_metric([self.model_name], len(scheduler.running))
            waiting.add_metric([self.model_name], len(scheduler.waiting))
            usage.add_metric([self.model_name], pool.usage())
            queries.add_metric([self.model_name], pool.prefix_cache_queries)
            hits.add_metric([self.model_name], pool.prefix_cache_hits)
            preemptions.add_metric([self.model_name], scheduler.num_preemptions)
        yield from (running, waiting, usage, queries, hits, preemptions)
        if core is not None and core.scheduler.proposer is not None:
            yield from self._spec_decode(core.scheduler)
        if core is not None and core.loras is not None:
            yield self._lora_info(core)

    def _spec_decode(self, scheduler) -> Iterator[CounterMetricFamily]:
        """vLLM's speculative decoding counters: steps that checked a request's guesses, the
        guesses checked, those kept, and those kept at each position (0 first)."""
        labels = ["model_name"]
        for name, text, value in (
                ("spec_decode_num_drafts", "Guesses checked for a request by a step", scheduler.spec_num_drafts),
                ("spec_decode_num_draft_tokens", "Guessed tokens checked", scheduler.spec_num_draft_tokens),
                ("spec_decode_num_accepted_tokens", "Guessed tokens kept", scheduler.spec_num_accepted_tokens)):
            family = CounterMetricFamily(P + name, text, labels=labels)
            family.add_metric([self.model_name], value)
            yield family
        per_pos = CounterMetricFamily(P + "spec_decode_num_accepted_tokens_per_pos",
                                      "Guessed tokens kept at each position", labels=labels + ["position"])
        for position, value in enumerate(list(scheduler.spec_accepted_per_pos)):
            per_pos.add_metric([self.model_name, str(position)], value)
        yield per_pos

    @staticmethod
    def _lora_info(core) -> GaugeMetricFamily:
        """vLLM's lora_requests_info: the adapters of the running and the waiting requests (names,
        comma-separated) and max_loras as labels, the scrape's time as its value."""
        info = GaugeMetricFamily(P + "lora_requests_info", "Running and waiting LoRA adapters",
                                 labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        scheduler = core.scheduler  # (copies taken in one C call each: the engine thread changes them)
        names = [",".join(sorted({r.lora.name for r in requests if r.lora is not None}))
                 for requests in (list(scheduler.running), list(scheduler.waiting))]
        info.add_metric(names + [str(scheduler.max_loras)], time.time())
        return info


class Metrics:
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        labels = ["model_name"]
        reg = dict(labelnames=labels, registry=self.registry)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens processed", **reg)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated", **reg)
        self.request_success = Counter(P + "request_success", "Finished requests by reason",
                                       labelnames=labels + ["finished_reason"], registry=self.registry)
        hist = dict(labelnames=labels, registry=self.registry, buckets=_LATENCY_BUCKETS)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token", **hist)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time between output tokens", **hist)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to last token", **hist)
        self.queue = Histogram(P + "request_queue_time_seconds", "Arrival to first scheduled", **hist)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self, num_prompt_tokens: int) -> "RequestTracker":
        self.prompt_tokens.labels(self.model_name).inc(num_prompt_tokens)
        return RequestTracker(self)


class RequestTracker:
    """Timings of one request, fed each delta it streams."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics
        self.arrival = time.monotonic()
        self.last: Optional[float] = None

    def observe(self, delta: RequestOutput) -> None:
        now = time.monotonic()
        name = self.m.model_name
        new_tokens = sum(len(s.token_ids) for s in delta.outputs)
        if new_tokens:
            self.m.generation_tokens.labels(name).inc(new_tokens)
            if self.last is None:
                self.m.ttft.labels(name).observe(now - self.arrival)
                if "queue_time" in delta.metrics:
                    self.m.queue.labels(name).observe(delta.metrics["queue_time"])
            else:
                for _ in range(new_tokens):
                    self.m.itl.labels(name).observe((now - self.last) / new_tokens)
            self.last = now
        for s in delta.outputs:
            if s.finish_reason is not None:
                self.m.request_success.labels(name, s.finish_reason).inc()
        if delta.finished:
            self.m.e2e.labels(name).observe(now - self.arrival)


def log_stats_interval() -> float:
    """Seconds between the stats lines (STREAMSERVE_LOG_STATS_INTERVAL, as vLLM's VLLM_LOG_STATS_INTERVAL)."""
    return float(os.environ.get("STREAMSERVE_LOG_STATS_INTERVAL", "10"))


async def log_stats(engine: AsyncEngine, interval: float) -> None:
    """vLLM's periodic stats lines, from the engine's counters (plain ints read across threads),
    every `interval` seconds in which the engine had work: prompt and generation throughput,
    running and waiting requests, KV cache use and prefix cache hit rate over the interval; and
    with speculative decoding, how many guesses were checked and kept (each position's share)."""
    try:
        await engine.wait_ready()
    except Exception:  # (reported by /health and the command line)
        return
    scheduler = engine.engine_core.scheduler
    pool = scheduler.kv_cache_manager.block_pool

    def counters() -> tuple:
        return (time.monotonic(), scheduler.num_prompt_tokens_computed, scheduler.num_generated_tokens,
                pool.prefix_cache_queries, pool.prefix_cache_hits, scheduler.spec_num_drafts,
                scheduler.spec_num_draft_tokens, scheduler.spec_num_accepted_tokens,
                list(scheduler.spec_accepted_per_pos))

    last = counters()
    while True:
        await asyncio.sleep(interval)
        now = counters()
        seconds, prompt, generated, queries, hits, drafts, drafted, accepted = (
            now[i] - last[i] for i in range(8))
        running, waiting = len(scheduler.running), len(scheduler.waiting)
        if prompt or generated or running or waiting:
            logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                        "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                        prompt / seconds, generated / seconds, running, waiting, 100 * pool.usage(),
                        100 * hits / queries if queries else 0.0)
            if drafts:
                per_pos = ", ".join(f"{(a - b) / drafts:.3f}" for a, b in zip(now[8], last[8]))
                logger.info("SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s, "
                            "Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens, "
                            "Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
                            1 + accepted / drafts, accepted / seconds, drafted / seconds, accepted, drafted, per_pos,
                            100 * accepted / drafted)  # (a request checked guesses: at least one)
        last = now
