"""BlockTable: every running request's KV block IDs, one row each, kept between steps.

A request takes a row when the runner first sees it and gives it back when it finishes or
is preempted; a step only appends the blocks the scheduler added (after cutting off those
it took back from guesses that were refused). The step's block
tables and slots then come out of numpy indexing over these rows instead of a Python
loop over every request's list each step. Entries past a row's blocks are 0.
"""

from __future__ import annotations

import numpy as np


class BlockTable:
    def __init__(self, max_rows: int, max_blocks_per_seq: int) -> None:
        self.table = np.zeros((max_rows, max_blocks_per_seq), dtype=np.int64)
        self.num_blocks = [0] * max_rows
        self.free_rows = list(range(max_rows - 1, -1, -1))

    def add(self, block_ids: list[int]) -> int:
        """A row holding `block_ids`."""
        if not self.free_rows:  # more live requests than max_num_seqs: grow rather than fail
            old = len(self.num_blocks)
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self.num_blocks += [0] * old
            self.free_rows = list(range(2 * old - 1, old - 1, -1))
        row = self.free_rows.pop()
        self.append(row, block_ids)
        return row

    def append(self, row: int, block_ids: list[int]) -> None:
        n = self.num_blocks[row]
        self.table[row, n:n + len(block_ids)] = block_ids
        self.num_blocks[row] = n + len(block_ids)

    def truncate(self, row: int, num_blocks: int) -> None:
        """Keep the row's first num_blocks blocks (the scheduler took the rest back)."""
        self.table[row, num_blocks:self.num_blocks[row]] = 0
        self.num_blocks[row] = num_blocks

    def remove(self, row: int) -> None:
        self.table[row, :self.num_blocks[row]] = 0
        self.num_blocks[row] = 0
        self.free_rows.append(row)
