"""The command line: flags generated from Config, one prompt through the engine."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from typing import NamedTuple

import aiohttp

from live_server import free_port, held_config, start_server
from streamserve import LLM, SamplingParams
from streamserve.cli import build_parser, config_kwargs
from streamserve.config import Config


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "streamserve", *args], capture_output=True,
                          text=True, timeout=300)


def test_every_config_field_has_a_flag():
    help_text = build_parser().format_help()
    for fields in Config.part_fields().values():
        for f in fields:
            name = f.name.replace("_", "-")
            assert f"--{name}" in help_text or f"--no-{name}" in help_text, f.name


def test_flags_become_config_kwargs():
    args = build_parser().parse_args(["--prompt", "x", "--model", "m", "--max-num-seqs", "7",
                                      "--no-enable-prefix-caching", "--kv-cache-memory", "1GiB"])
    kwargs = config_kwargs(args)
    assert kwargs["model"] == "m" and kwargs["max_num_seqs"] == 7
    assert kwargs["enable_prefix_caching"] is False and kwargs["kv_cache_memory"] == "1GiB"
    assert kwargs["block_size"] == 16 and kwargs["max_num_batched_tokens"] is None  # the device's default
    assert config_kwargs(build_parser().parse_args(["-q", "awq_marlin"]))["quantization"] == "awq_marlin"  # (vLLM's)


def test_prompt_is_completed_greedily(llama_dir):
    result = run_cli("--model", llama_dir, "--dtype", "float32", "--kv-cache-memory", "16MiB",
                     "--prompt", "The quick brown fox", "--max-tokens", "6")
    assert result.returncode == 0, result.stderr
    llm = LLM(llama_dir, dtype="float32", kv_cache_memory="16MiB")
    expected = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=6),
                            use_tqdm=False)[0].outputs[0].text
    assert result.stdout == expected + "\n"


def test_a_bad_model_path_is_one_clear_line(tmp_path):
    result = run_cli("--model", str(tmp_path / "nowhere"), "--prompt", "hi")
    assert result.returncode == 2
    assert result.stderr.strip().startswith("streamserve: error: model")
    assert "Traceback" not in result.stderr


def test_the_server_with_a_bad_model_exits_with_one_clear_line(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = run_cli("--model", str(tmp_path / "nowhere"), "--port", str(port))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("streamserve: error: model")
    assert "Traceback" not in result.stderr


def test_a_busy_port_is_one_clear_line_before_any_loading(llama_dir, tmp_path):
    """The port is bound before the weights are read: with a checkpoint that cannot be read,
    the busy port is what is reported (loading first would report the checkpoint)."""
    import shutil
    import socket

    broken = tmp_path / "broken"
    shutil.copytree(llama_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        result = run_cli("--model", str(broken), "--port", str(s.getsockname()[1]))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("streamserve: error: cannot listen on 127.0.0.1:")
    assert "cannot read" not in result.stderr


def test_unreadable_files_and_sizes_are_one_clear_line(tmp_path, llama_dir):
    """A truncated checkpoint or GGUF, an infinite size, an empty API key: errors that name
    the problem (no traceback)."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(llama_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    gguf_file = tmp_path / "cut.gguf"
    gguf_file.write_bytes(b"GGUF" + bytes(996))
    for args, message in [(("--model", str(broken)), "cannot read"),
                          (("--model", str(gguf_file)), "cut.gguf"),
                          (("--model", llama_dir, "--kv-cache-memory", "inf"), "as a size in bytes")]:
        result = run_cli(*args, "--prompt", "hi")
        assert result.returncode == 2 and "Traceback" not in result.stderr, (args, result.stderr)
        assert result.stderr.strip().splitlines()[-1].startswith("streamserve: error:"), (args, result.stderr)
        assert message in result.stderr.strip().splitlines()[-1], (args, result.stderr)
    result = run_cli("--model", llama_dir, "--api-key", "")
    assert result.returncode == 2 and "api_key is empty" in result.stderr


def test_flags_that_would_be_ignored_are_refused(llama_dir, tmp_path):
    """--gguf-file names a file inside a --model directory: with a .gguf --model (or none) it
    would be ignored; an empty --served-model-name would fall back to --model unseen."""
    for args, message in [(("--model", str(tmp_path / "m.gguf"), "--gguf-file", "x.gguf", "--prompt", "hi"),
                           "gguf_file 'x.gguf' names a .gguf file inside"),
                          (("--gguf-file", "x.gguf", "--prompt", "hi"), "gguf_file 'x.gguf' names"),
                          (("--model", llama_dir, "--served-model-name", ""), "served_model_name is empty")]:
        result = run_cli(*args)
        assert result.returncode == 2 and "Traceback" not in result.stderr, (args, result.stderr)
        assert message in result.stderr.strip().splitlines()[-1], (args, result.stderr)


def test_lora_modules_take_several_and_bad_ones_are_one_clear_line(llama_dir, tmp_path):
    args = build_parser().parse_args(["--enable-lora", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}'])
    assert config_kwargs(args)["lora_modules"] == ["a=/x", '{"name": "b", "path": "/y"}']
    port = str(free_port())
    for args, message in [(("--lora-modules", "a=/x", "--prompt", "hi"), "add --enable-lora"),
                          (("--enable-lora", "--lora-modules", "a", "--port", port), "must be name=path"),
                          (("--enable-lora", "--lora-modules", f"tiny={tmp_path}", "--served-model-name", "tiny",
                            "--port", port), "takes the served model's name"),
                          (("--enable-lora", "--lora-modules", f"a={tmp_path}", "--port", port),
                           "holds no adapter_config.json")]:
        result = run_cli("--model", llama_dir, "--dtype", "float32", "--kv-cache-memory", "16MiB", *args)
        assert result.returncode == 2 and "Traceback" not in result.stderr, (args, result.stderr)
        assert message in result.stderr.strip().splitlines()[-1], (args, result.stderr)


class Stopped(NamedTuple):
    data: list[str]  # the stream's SSE data lines
    ws_frames: list[dict]  # the busy websocket's JSON frames
    closed: aiohttp.WSMessage  # what the idle websocket got last
    refused: bool  # a new connection was refused
    rc: int
    log: str


async def _stream_across_sigterm(proc, url: str, signals: int, **extra) -> tuple:
    body = {"prompt": "hello", "max_tokens": 450, "n": 8, "ignore_eos": True, "stream": True, **extra}
    async with aiohttp.ClientSession() as session:
        idle = await session.ws_connect(url + "/v1/ws")
        busy = await session.ws_connect(url + "/v1/ws")
        await busy.send_json({"type": "request", "id": "w", "endpoint": "completions", "body": body})
        async with session.post(url + "/v1/completions", json=body) as r:
            lines = [(await r.content.readline()).decode().strip()]
            assert (await busy.receive_json(timeout=30))["type"] == "chunk"
            for _ in range(signals):
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.2)
            lines += [line.decode().strip() async for line in r.content]
        frames = [json.loads(msg.data) async for msg in busy if msg.type == aiohttp.WSMsgType.TEXT]
        closed = await idle.receive(timeout=30)
        try:
            await session.get(url + "/health")
            refused = False
        except aiohttp.ClientConnectionError:
            refused = True
    return [line for line in lines if line.startswith("data:")], frames, closed, refused


def stopped_server(model_dir: str, signals: int, **extra) -> Stopped:
    """A server with a long stream, a websocket stream and an idle websocket open, sent
    `signals` SIGTERMs once the streams have begun."""
    proc, url = start_server(model_dir, "--shutdown-timeout", "60")
    try:
        seen = asyncio.run(_stream_across_sigterm(proc, url, signals, **extra))
        rc = proc.wait(timeout=60)
    finally:
        proc.kill()
    return Stopped(*seen, rc, proc.stdout.read())


def test_sigterm_lets_the_requests_in_flight_finish_then_exits(llama_dir):
    """SIGTERM: the listening socket closes at once; the stream and the websocket's stream in
    flight run to their ends; an idle websocket is told the server is going away (1001);
    the process exits 0."""
    run = stopped_server(llama_dir, 1)
    assert run.rc == 0 and run.refused, run.log
    assert run.data[-1] == "data: [DONE]"
    finishes = [c["finish_reason"] for line in run.data[:-1] for c in json.loads(line[6:])["choices"]
                if c["finish_reason"]]
    assert finishes == ["length"] * 8
    assert run.ws_frames[-1] == {"type": "done", "id": "w"}
    assert sum(1 for f in run.ws_frames if f["type"] == "chunk"
               for c in f["data"]["choices"] if c["finish_reason"] == "length") == 8
    assert run.closed.type == aiohttp.WSMsgType.CLOSE and run.closed.data == aiohttp.WSCloseCode.GOING_AWAY
    assert "SIGTERM: taking no new connections or requests" in run.log and "cutting off" not in run.log


def test_a_second_sigterm_cuts_the_requests_off(llama_dir):
    """A second SIGTERM ends the streams in flight at once, each with an in-band 503."""
    run = stopped_server(llama_dir, 2, max_tokens=480)
    assert run.rc == 0 and run.refused, run.log
    assert run.data[-1] == "data: [DONE]"
    assert json.loads(run.data[-2][6:])["error"] == {"message": "the server is shutting down",
                                                     "type": "service_unavailable", "param": None, "code": None}
    assert run.ws_frames[-1] == {"type": "done", "id": "w"}
    assert run.ws_frames[-2]["type"] == "error" and run.ws_frames[-2]["error"]["type"] == "service_unavailable"
    assert run.closed.type == aiohttp.WSMsgType.CLOSE and run.closed.data == aiohttp.WSCloseCode.GOING_AWAY
    assert "SIGTERM again: cutting off the requests in flight" in run.log
    assert "cutting off the 2 requests still running" in run.log


def test_a_signal_while_the_model_loads_stops_at_once(llama_dir):
    """SIGTERM before the model is ready: nothing is in flight, so the server stops at once
    and says the engine was still loading (the command then exits without the interpreter's
    teardown, which would abort on the loading thread)."""
    from streamserve.cli import _serve
    from streamserve.config import ServerConfig

    release = threading.Event()  # never set: the load stays held (a daemon thread, gone at exit)

    async def main():
        asyncio.get_running_loop().call_later(0.5, os.kill, os.getpid(), signal.SIGTERM)
        return await _serve(ServerConfig(port=0), "tiny", held_config(llama_dir, release, 3600))

    assert asyncio.run(main()) == (0, True)
