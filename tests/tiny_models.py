"""Tiny random Llama-family models, saved as real Hugging Face directories.

Each has config.json, safetensors weights and a byte-level BPE tokenizer with a
ChatML chat template, so the whole loading path runs as it does for a real model.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "Once upon a time, there was a small model that wanted to speak.",
    "def add(a, b):\n    return a + b\n",
    "Streaming servers send tokens one at a time to many clients at once.",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u4f60\u597d\u4e16\u754c \U0001f600 \U0001f680 emoji and CJK text.",
    "user assistant system hello world what is the answer to this question",
] * 20

VOCAB_SIZE = 384


def build_tokenizer(path: str) -> None:
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - 8, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
                                   unk_token=None, pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def _config(arch: str, **overrides):
    from transformers import (Gemma2Config, Gemma3TextConfig, GemmaConfig, GraniteConfig, LlamaConfig, MistralConfig,
                              Olmo2Config, Olmo3Config, Phi3Config, Qwen2Config, Qwen3Config, SmolLM3Config)

    kwargs = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, initializer_range=0.15, eos_token_id=2, bos_token_id=None,
                  pad_token_id=0, torch_dtype="float32")
    if arch == "llama":
        # Tied embeddings and Llama-3 rope scaling.
        kwargs.update(tie_word_embeddings=True, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    elif arch == "mistral":
        kwargs.update(tie_word_embeddings=False, sliding_window=None)
    elif arch == "qwen2":
        kwargs.update(tie_word_embeddings=False, use_sliding_window=False)
    elif arch == "qwen3":
        kwargs.update(tie_word_embeddings=True, head_dim=32, use_sliding_window=False)
    elif arch == "phi3":  # its checkpoint stores q/k/v and gate/up fused
        kwargs.update(tie_word_embeddings=False, sliding_window=None, original_max_position_embeddings=512)
    elif arch == "phi4":  # Phi-4-mini's: a Phi-3 whose rotary turns 3/4 of each head, tied, LongRoPE
        kwargs.update(tie_word_embeddings=True, sliding_window=None, original_max_position_embeddings=128,
                      partial_rotary_factor=0.75, rope_parameters={
                          "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.5],
                          "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]})
    elif arch == "gemma":
        kwargs.update(tie_word_embeddings=True, head_dim=16)
    elif arch == "gemma2":  # a window of 16 in every other layer, soft-capped scores and logits
        kwargs.update(tie_word_embeddings=True, head_dim=16, num_hidden_layers=3, sliding_window=16,
                      query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)
    elif arch == "gemma3":  # q/k norms, windows of 16 with their own rotary base
        kwargs.update(tie_word_embeddings=True, head_dim=16, num_hidden_layers=3, sliding_window=16,
                      query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention",
                                                             "sliding_attention"],
                      rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                       "full_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    elif arch == "smollm3":  # the middle layer rotates nothing
        kwargs.update(tie_word_embeddings=True, num_hidden_layers=3, no_rope_layers=[1, 0, 1],
                      rope_theta=2000000.0, use_sliding_window=False)
    elif arch == "granite":  # its multipliers, as Granite 3's are
        kwargs.update(tie_word_embeddings=True, embedding_multiplier=12.0, attention_multiplier=0.0625,
                      residual_multiplier=0.22, logits_scaling=8.0)
    elif arch == "olmo2":  # norms after attention and the MLP, q and k normed over all heads
        kwargs.update(tie_word_embeddings=False)
    elif arch == "olmo3":  # OLMo 2's layers, three in four windowed to 16; YaRN on the full layer only
        kwargs.update(tie_word_embeddings=False, num_hidden_layers=4, sliding_window=16, rope_parameters={
            "full_attention": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256,
                               "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    else:
        raise ValueError(arch)
    kwargs.update(overrides)
    kind = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
            "phi3": Phi3Config, "phi4": Phi3Config, "gemma": GemmaConfig, "gemma2": Gemma2Config, "gemma3": Gemma3TextConfig,
            "smollm3": SmolLM3Config, "granite": GraniteConfig, "olmo2": Olmo2Config, "olmo3": Olmo3Config}
    return kind[arch](**kwargs)


ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "phi4", "gemma", "gemma2", "gemma3", "smollm3", "granite",
         "olmo2", "olmo3")


def build_model(path: str, arch: str, seed: int = 0, max_shard_size: Optional[str] = None,
                **overrides) -> str:
    """Write a tiny random `arch` model (and tokenizer) into `path`; return `path`."""
    from transformers import AutoModelForCausalLM

    os.makedirs(path, exist_ok=True)
    torch.manual_seed(seed)
    config = _config(arch, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # make the biases (Qwen2's q/k/v, attention_bias, mlp_bias) matter: not zeros
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_(0, 0.1)
        if arch.startswith("gemma") or arch.startswith("olmo"):  # and Gemma's (1 + weight) and OLMo 2's norms: not
            # the zeros (ones) they start as
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0.0 if arch.startswith("gemma") else 1.0, 0.2)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    build_tokenizer(path)
    return path
