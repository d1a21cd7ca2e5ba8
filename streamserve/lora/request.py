"""LoRARequest: what LLM.generate(lora_request=...) takes, as vLLM's (vllm.lora.request); and
the --lora-modules entries that name adapters for the server."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import NamedTuple, Optional


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


class LoRAModule(NamedTuple):
    """A --lora-modules entry: the adapter's name, its directory, and the model /v1/models names
    as its parent (vLLM's base_model_name; None: the served model)."""

    name: str
    path: str
    base_model_name: Optional[str] = None


def parse_module(spec: str) -> LoRAModule:
    """The entry `name=path` or `{"name": ..., "path": ..., "base_model_name": ...}` (vLLM's two
    forms; base_model_name optional)."""
    if spec.lstrip().startswith("{"):
        try:
            module = json.loads(spec)
        except ValueError as exc:
            raise ValueError(f"lora_modules entry {spec!r} is not JSON: {exc}") from None
        if not isinstance(module, dict) or not isinstance(module.get("name"), str) \
                or not isinstance(module.get("path"), str) \
                or not isinstance(module.get("base_model_name") or "", str):
            raise ValueError(f"lora_modules entry {spec!r} must hold a 'name' and a 'path' (strings), and may "
                             "hold a 'base_model_name' (a string)")
        return LoRAModule(module["name"], module["path"], module.get("base_model_name") or None)
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"lora_modules entry {spec!r} must be name=path or JSON {{\"name\": ..., \"path\": ...}}")
    return LoRAModule(name, path)
