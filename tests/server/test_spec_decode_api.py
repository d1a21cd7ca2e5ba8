"""Speculative decoding behind the server: --speculative-config read from the command line, a
streamed request's text equal to its whole one's, vLLM's spec_decode counters in /metrics, and
the periodic stats lines in the log."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from live_server import slow_steps, start
from test_streaming import parse_metrics, stream_text

from streamserve.cli import build_parser, config_kwargs
from streamserve.config import Config

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def test_the_flag_takes_vllms_json(llama_dir):
    args = build_parser().parse_args(["--model", llama_dir, "--speculative-config", json.dumps(SPEC)])
    speculative = Config.from_kwargs(**config_kwargs(args)).scheduler.speculative
    assert (speculative.method, speculative.num_speculative_tokens, speculative.prompt_lookup_max,
            speculative.prompt_lookup_min) == ("ngram", 4, 3, 1)
    with pytest.raises(ValueError, match="only \"ngram\""):
        Config.from_kwargs(model=llama_dir, speculative_config={"method": "eagle", "num_speculative_tokens": 2})


def test_streams_and_metrics(llama_dir):
    body = {"prompt": [5, 6, 7, 5, 6, 7, 5], "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "allowed_token_ids": [5, 6, 7]}

    async def main():
        runner, engine, url = await start(llama_dir, speculative_config=SPEC)
        async with aiohttp.ClientSession() as session:
            streamed = await stream_text(session, url, body)
            async with session.post(url + "/v1/completions", json=body) as r:
                whole = await r.json()
            async with session.get(url + "/metrics") as r:
                metrics = parse_metrics(await r.text())
        await runner.cleanup()
        return streamed, whole, metrics

    streamed, whole, metrics = asyncio.run(main())
    assert streamed == whole["choices"][0]["text"]
    assert whole["usage"]["completion_tokens"] == 40
    label = f'{{model_name="{llama_dir}"}}'
    checked = metrics[f"streamserve:spec_decode_num_draft_tokens_total{label}"]
    kept = metrics[f"streamserve:spec_decode_num_accepted_tokens_total{label}"]
    assert 0 < kept <= checked and metrics[f"streamserve:spec_decode_num_drafts_total{label}"] > 0
    per_pos = [metrics[f'streamserve:spec_decode_num_accepted_tokens_per_pos_total{{model_name="{llama_dir}",'
                       f'position="{i}"}}'] for i in range(4)]
    assert sum(per_pos) == kept and per_pos == sorted(per_pos, reverse=True)


def test_the_periodic_stats_lines(llama_dir, caplog, monkeypatch):
    """vLLM's stats lines while requests run (every STREAMSERVE_LOG_STATS_INTERVAL seconds):
    throughput, queues, caches and, with speculative decoding, the guesses kept; none once idle,
    and none at all with --disable-log-stats."""
    import logging

    monkeypatch.setenv("STREAMSERVE_LOG_STATS_INTERVAL", "0.05")
    caplog.set_level(logging.INFO, logger="streamserve.server.metrics")
    body = {"prompt": [5, 6, 7, 5, 6, 7, 5], "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "allowed_token_ids": [5, 6, 7]}

    async def main(**settings):
        runner, engine, url = await start(llama_dir, **settings)
        slow_steps(engine, 0.002)  # the stream lasts several intervals
        async with aiohttp.ClientSession() as session:
            await stream_text(session, url, body)
        await asyncio.sleep(0.3)
        idle = len(caplog.records)
        await asyncio.sleep(0.3)  # idle: no more lines
        assert len(caplog.records) == idle
        await runner.cleanup()

    asyncio.run(main(speculative_config=SPEC))
    lines = [r.getMessage() for r in caplog.records]
    stats = [line for line in lines if line.startswith("Avg prompt throughput")]
    spec = [line for line in lines if line.startswith("SpecDecoding metrics")]
    assert stats and spec and any("Running: 1 reqs" in line for line in stats)
    assert "Per-position acceptance rate" in spec[0] and "Mean acceptance length" in spec[0]
    caplog.clear()
    asyncio.run(main(disable_log_stats=True))
    assert not [r for r in caplog.records if r.getMessage().startswith(("Avg prompt", "SpecDecoding"))]
