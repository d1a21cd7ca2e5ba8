"""LoRARequest: what LLM.generate(lora_request=...) takes, as vLLM's (vllm.lora.request); and
the --lora-modules entries that name adapters for the server."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's LoRARequest: an adapter by name, a unique positive integer ID, and its directory
    (what LLM.generate(lora_request=...) takes)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id ({self.lora_int_id!r}) must be an integer >= 1")
        if not self.lora_path:
            raise ValueError(f"LoRA request {self.lora_name!r} names no lora_path")


def parse_module(spec: str) -> tuple[str, str]:
    """(name, path) out of `name=path` or `{"name": ..., "path": ...}` (vLLM's two forms)."""
    if spec.lstrip().startswith("{"):
        try:
            module = json.loads(spec)
        except ValueError as exc:
            raise ValueError(f"lora_modules entry {spec!r} is not JSON: {exc}") from None
        if not isinstance(module, dict) or not isinstance(module.get("name"), str) \
                or not isinstance(module.get("path"), str):
            raise ValueError(f"lora_modules entry {spec!r} must hold a 'name' and a 'path' (strings)")
        return module["name"], module["path"]
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"lora_modules entry {spec!r} must be name=path or JSON {{\"name\": ..., \"path\": ...}}")
    return name, path
