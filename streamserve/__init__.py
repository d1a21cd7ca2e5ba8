"""streamserve: a fast LLM inference server in one Python process."""

from streamserve.entrypoints.llm import LLM
from streamserve.outputs import CompletionOutput, Logprob, RequestOutput
from streamserve.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob",
           "__version__"]
