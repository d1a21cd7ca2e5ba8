"""streamserve: a fast LLM inference server in one Python process."""

from streamserve.outputs import CompletionOutput, Logprob, RequestOutput
from streamserve.lora.request import LoRARequest
from streamserve.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "LoRARequest", "SamplingParams", "BeamSearchParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob",
           "__version__"]


def __getattr__(name: str):
    """LLM, imported on first use: it brings in torch and transformers (seconds), which
    `python -m streamserve` imports only once it has turned the collector off (__main__.py)."""
    if name == "LLM":
        from streamserve.entrypoints.llm import LLM
        return LLM
    raise AttributeError(f"module 'streamserve' has no attribute {name!r}")
