"""LoRARegistry: the adapters an engine has loaded, by name (what a request's model names).

The registry reads an adapter's files on the caller's thread (the server's loads run on a
thread of their own, never the event loop or the engine thread) and keeps it until it is
removed. A request holds its adapter itself, from the front end to the model runner, so
removing one (POST /v1/unload_lora_adapter) refuses new requests for it while those in
flight finish on it; its memory goes with the last of them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional

import torch

from streamserve.config import LoRAConfig
from streamserve.lora.adapter import LoRAAdapter, read_adapter
from streamserve.lora.request import LoRARequest, parse_module


class LoRARegistry:
    def __init__(self, config: LoRAConfig, model, dtype: torch.dtype, device: torch.device) -> None:
        """model: a LlamaForCausalLM (its lora_targets)."""
        self.config = config
        self._targets = model.lora_targets()
        self._dtype, self._device = dtype, device
        self._by_name: dict[str, LoRAAdapter] = {}
        # LLM's LoRARequests by lora_int_id, the most recently used last (at most max_cpu_loras)
        self._by_request_id: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._lock = threading.Lock()

    def read(self, name: str, path: str) -> LoRAAdapter:
        """The adapter at `path`, read (a ValueError says what is wrong) but not registered."""
        if not isinstance(name, str) or not name.strip():
            raise ValueError("a LoRA adapter needs a name (a non-empty string)")
        if not isinstance(path, str) or not path:
            raise ValueError(f"LoRA adapter {name!r} needs a path (its directory)")
        try:
            return read_adapter(path, name, self._targets, self.config.max_lora_rank, self._dtype, self._device)
        except ValueError:
            raise
        except Exception as exc:  # what its checks did not foresee: still the adapter's fault, and a 400
            raise ValueError(f"LoRA adapter {name!r} cannot be read: {type(exc).__name__}: {exc}") from exc

    def load(self, name: str, path: str, base_model_name: Optional[str] = None) -> LoRAAdapter:
        """Read the adapter at `path` and serve it as `name` (a ValueError if that name is taken);
        base_model_name: the parent /v1/models gives it (None: the served model)."""
        if self.get(name) is not None:
            raise ValueError(f"the LoRA adapter {name!r} has already been loaded")
        adapter = self.read(name, path)
        adapter.base_model_name = base_model_name
        with self._lock:
            if name in self._by_name:  # loaded meanwhile by another caller
                raise ValueError(f"the LoRA adapter {name!r} has already been loaded")
            self._by_name[name] = adapter
        return adapter

    def load_modules(self, specs: list[str]) -> list[LoRAAdapter]:
        """--lora-modules: each `name=path` or JSON {"name": ..., "path": ..., "base_model_name": ...}."""
        return [self.load(*parse_module(spec)) for spec in specs]

    def get(self, name: str) -> Optional[LoRAAdapter]:
        with self._lock:
            return self._by_name.get(name)

    def remove(self, name: str) -> bool:
        with self._lock:
            return self._by_name.pop(name, None) is not None

    def adapters(self) -> list[LoRAAdapter]:
        with self._lock:
            return list(self._by_name.values())

    def for_request(self, request: LoRARequest) -> LoRAAdapter:
        """LLM's LoRARequest: its adapter, read the first time its lora_int_id comes (again if
        the ID comes back with another name or path, or after max_cpu_loras others pushed it
        out; requests still running on it keep it)."""
        adapter = self._by_request_id.get(request.lora_int_id)
        if adapter is None or (adapter.name, adapter.path) != (request.lora_name, request.lora_path):
            adapter = self._by_request_id[request.lora_int_id] = self.read(request.lora_name, request.lora_path)
        self._by_request_id.move_to_end(request.lora_int_id)
        while len(self._by_request_id) > self.config.max_cpu_loras:
            self._by_request_id.popitem(last=False)
        return adapter
