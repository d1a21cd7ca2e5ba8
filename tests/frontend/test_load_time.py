"""What a load costs beyond the model: no torch._dynamo or sympy imported, the tokenizer's
class chosen without transformers' AutoConfig, and the collector's passes over the loaded heap."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import shutil
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from streamserve.config import Config
from streamserve.frontend.async_engine import AsyncEngine
from streamserve.frontend.renderer import load_tokenizer, tokenizer_choice_config
from streamserve.heap import collector_paused

TEXT = "Hello <|im_end|> w\u00f6rld\n  123 print('x')"


def _variant(tmp_path, llama_dir: str, model_type: str, tokenizer_class, **extra) -> str:
    """The tiny llama's tokenizer files, declaring `tokenizer_class`, beside a config.json of `model_type`."""
    d = tmp_path / f"{model_type}-{tokenizer_class}"
    d.mkdir()
    for name in os.listdir(llama_dir):
        if name.startswith("tokenizer"):
            shutil.copy(os.path.join(llama_dir, name), d / name)
    declared = json.loads((d / "tokenizer_config.json").read_text())
    declared.pop("tokenizer_class", None)
    if tokenizer_class is not None:
        declared["tokenizer_class"] = tokenizer_class
    declared.update(extra)
    (d / "tokenizer_config.json").write_text(json.dumps(declared))
    (d / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": ["LlamaForCausalLM"]}))
    return str(d)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("tokenizer_class", ["TokenizersBackend", "PreTrainedTokenizerFast", "LlamaTokenizerFast",
                                             "Qwen2Tokenizer", "GPT2Tokenizer"])
def test_the_tokenizer_chosen_is_autotokenizers_own(tmp_path, llama_dir, model_type, tokenizer_class):
    # transformers' own rules by model type (qwen2's hub classes overridden, a ByteLevel file
    # declared as LlamaTokenizer loaded as TokenizersBackend) still hold
    path = _variant(tmp_path, llama_dir, model_type, tokenizer_class)
    assert tokenizer_choice_config(path) is not None
    ours, theirs = load_tokenizer(path), AutoTokenizer.from_pretrained(path, local_files_only=True)
    assert type(ours) is type(theirs)
    assert ours.encode(TEXT) == theirs.encode(TEXT)
    assert (ours.eos_token_id, ours.chat_template) == (theirs.eos_token_id, theirs.chat_template)


def test_autotokenizer_reads_the_config_itself_unless_the_class_is_named_without_code(tmp_path, llama_dir):
    assert tokenizer_choice_config(_variant(tmp_path, llama_dir, "llama", None)) is None
    remote = _variant(tmp_path, llama_dir, "mistral", "TokenizersBackend", auto_map={"AutoTokenizer": ["a.B", None]})
    assert tokenizer_choice_config(remote) is None
    assert tokenizer_choice_config(str(tmp_path / "missing")) is None
    assert tokenizer_choice_config("org/name") is None
    unnamed = _variant(tmp_path, llama_dir, "qwen2", None)
    assert type(load_tokenizer(unnamed)) is type(AutoTokenizer.from_pretrained(unnamed, local_files_only=True))


def test_a_load_imports_neither_dynamo_sympy_nor_the_model_types_configuration(llama_dir):
    probe = ("import sys; from streamserve import LLM; "
             f"llm = LLM({llama_dir!r}, dtype='float32', kv_cache_memory='16MiB'); "
             "assert llm.generate('hi', use_tqdm=False)[0].outputs[0].token_ids; "
             "print(sorted(m for m in ('torch._dynamo', 'sympy', 'transformers.models.llama.configuration_llama') "
             "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_collector_is_paused_inside_and_as_it_was_after():
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with collector_paused():
            assert not gc.isenabled()
            raise RuntimeError("a failed load")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # one who had turned it off keeps it off
    finally:
        gc.enable()


@pytest.mark.parametrize("freeze", [False, True])
def test_a_serving_engine_freezes_the_loaded_heap_until_shutdown(llama_dir, freeze):
    async def main():
        engine = AsyncEngine(Config.from_kwargs(model=llama_dir, dtype="float32", kv_cache_memory="16MiB"),
                             freeze_heap=freeze)
        engine.start()
        await engine.wait_ready()
        frozen = gc.get_freeze_count()
        await engine.shutdown()
        return frozen

    gc.unfreeze()
    try:
        frozen = asyncio.run(main())
        assert (frozen > 10_000) == freeze, frozen
        assert gc.get_freeze_count() == 0  # handed back: cycles among them can be collected
        assert gc.isenabled()
    finally:
        gc.unfreeze()
