"""The command line: flags generated from Config, one prompt through the engine."""

from __future__ import annotations

import subprocess
import sys

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
