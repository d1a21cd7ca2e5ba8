"""LoRA adapters: read from PEFT's files (adapter.py), kept by name (registry.py), and added
to the linear layers of the steps that hold their requests (step.py). LoRARequest
(request.py) names one for LLM.generate."""

from streamserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
