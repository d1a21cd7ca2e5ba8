from __future__ import annotations

from streamserve.engine.kv_cache_manager import KVCacheManager
from streamserve.engine.request import Request
from streamserve.sampling_params import SamplingParams


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), None, max_model_len=1024)


def admit(kv: KVCacheManager, request: Request) -> int:
    """What the scheduler does for a waiting request: look up, allocate, start."""
    hits, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, hits) is not None
    request.num_computed_tokens = request.num_tokens
    return num_hit


def test_shared_prefix_is_computed_once_and_blocks_are_shared():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True)
    a = req("a", list(range(10)))  # blocks [0-3] [4-7] [8,9]
    b = req("b", list(range(8)) + [50, 51, 52])
    assert admit(kv, a) == 0
    assert admit(kv, b) == 8
    a_blocks, b_blocks = kv.req_to_blocks["a"], kv.req_to_blocks["b"]
    assert a_blocks[:2] == b_blocks[:2] and a_blocks[2] is not b_blocks[2]
    assert [blk.ref_cnt for blk in a_blocks[:2]] == [2, 2]
    assert kv.num_free_blocks == 16 - 4
    kv.free(a)
    assert [blk.ref_cnt for blk in b_blocks[:2]] == [1, 1]
    kv.free(b)
    assert kv.num_free_blocks == 16


def test_different_prefix_does_not_hit():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True)
    admit(kv, req("a", list(range(8)) + [1]))
    assert admit(kv, req("b", [99] + list(range(1, 8)) + [1])) == 0
    # Same tokens in the second block but a different first block: the chain differs.


def test_freed_blocks_are_hit_again_until_evicted():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=True)
    a = req("a", list(range(9)))
    admit(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 4
    b = req("b", list(range(9)))
    assert admit(kv, b) == 8  # both full blocks came back from the free queue
    kv.free(b)
    # A request that needs every block evicts them all.
    c = req("c", list(range(100, 116)))
    assert admit(kv, c) == 0
    kv.free(c)
    assert admit(kv, req("d", list(range(9)))) == 0


def test_allocate_slots_refuses_without_changing_anything():
    kv = KVCacheManager(num_blocks=2, block_size=4, enable_caching=True)
    r = req("a", list(range(12)))
    assert kv.allocate_slots(r, 12) is None
    assert kv.num_free_blocks == 2 and "a" not in kv.req_to_blocks


def test_no_leak_after_finish_and_abort_with_caching_off():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    reqs = [req(str(i), list(range(i, i + 7))) for i in range(3)]
    for r in reqs:
        assert admit(kv, r) == 0
    assert kv.num_free_blocks == 2
    for r in reqs:
        kv.free(r)
    assert kv.num_free_blocks == 8
    assert all(b.block_hash is None for b in kv.block_pool.blocks)
