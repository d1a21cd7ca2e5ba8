"""The runner's persistent block table: rows follow the scheduler's blocks exactly."""

from __future__ import annotations

import numpy as np

from streamserve import LLM, SamplingParams
from streamserve.engine.request import RequestStatus
from streamserve.worker.block_table import BlockTable


def test_rows_are_reused_and_cleared():
    bt = BlockTable(2, 4)
    a = bt.add([5, 6])
    b = bt.add([7])
    assert a != b
    bt.append(b, [8, 9])
    assert bt.table[b].tolist() == [7, 8, 9, 0]
    bt.remove(a)
    assert bt.table[a].tolist() == [0, 0, 0, 0]
    c = bt.add([1])
    assert c == a and bt.table[c].tolist() == [1, 0, 0, 0]


def test_more_rows_than_planned_grow_the_table():
    bt = BlockTable(1, 2)
    rows = [bt.add([i]) for i in range(3)]
    assert sorted(rows) == [0, 1, 2]
    assert [bt.table[r, 0] for r in rows] == [0, 1, 2]


def test_rows_match_the_scheduler_through_preemption_and_prefix_hits(llama_dir):
    # 12 blocks of 16 tokens for 6 requests that want about 30: preemption and recompute,
    # and shared prompt prefixes taken from the cache.
    llm = LLM(llama_dir, dtype="float32", max_model_len=128, num_gpu_blocks_override=12)
    core = llm.engine_core
    kv, runner = core.scheduler.kv_cache_manager, core.model_runner
    shared = [(7 * i) % 400 + 3 for i in range(40)]
    for i in range(6):
        prompt = shared + [i + 3] * (5 + 3 * i) if i % 2 else [(11 * i + j) % 400 + 3 for j in range(30)]
        llm._add_request(None, prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    checked = 0
    while core.has_unfinished_requests():
        core.step()
        for req_id, request in core.scheduler.requests.items():
            if request.status != RequestStatus.RUNNING:
                continue
            row = runner.requests[req_id].row
            blocks = kv.get_block_ids(req_id)
            assert runner.block_table.table[row, :len(blocks)].tolist() == blocks
            assert not runner.block_table.table[row, len(blocks):].any()
            checked += 1
        rows = [s.row for s in runner.requests.values()]
        assert len(set(rows)) == len(rows)
    assert checked > 50
    assert core.scheduler.num_preemptions > 0 and kv.block_pool.prefix_cache_hits > 0
    # Every row is either free (and zero) or held by a request the runner still knows.
    bt = runner.block_table
    assert len(bt.free_rows) + len(runner.requests) == len(bt.num_blocks)
    assert not np.any(bt.table[bt.free_rows])
