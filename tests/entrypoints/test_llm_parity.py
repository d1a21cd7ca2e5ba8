"""The real oracle: greedy tokens and logprobs identical to transformers, per architecture,
also when the prompt is read in chunks and when the KV pool forces preemption."""

from __future__ import annotations

import pytest

from streamserve import LLM
from parity import check_parity
from tiny_models import ARCHS


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_parity(model_dirs, arch):
    llm = LLM(model_dirs[arch], dtype="float32", kv_cache_memory="32MiB")
    check_parity(llm, model_dirs[arch])
    # The shared prefixes were served from the prefix cache.
    assert llm.engine_core.scheduler.kv_cache_manager.block_pool.prefix_cache_hits > 0
    assert llm.engine_core.scheduler.kv_cache_manager.num_free_blocks == llm.engine_core.model_runner.num_blocks


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_parity_with_chunked_prefill(model_dirs, arch):
    llm = LLM(model_dirs[arch], dtype="float32", kv_cache_memory="32MiB", max_num_batched_tokens=24)
    check_parity(llm, model_dirs[arch])


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_parity_with_preemption(model_dirs, arch):
    # 10 blocks of 16 tokens, while the 9 requests want about 40 blocks at their longest.
    llm = LLM(model_dirs[arch], dtype="float32", max_model_len=128, num_gpu_blocks_override=10)
    check_parity(llm, model_dirs[arch])
    scheduler = llm.engine_core.scheduler
    assert scheduler.num_preemptions > 0
    assert scheduler.kv_cache_manager.num_free_blocks == 10
