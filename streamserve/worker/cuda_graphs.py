"""CUDA graphs for pure-decode steps.

At start-up the model's forward pass for a batch of B decode tokens is captured once
per padded size B in capture_sizes(); a decode step of n <= B tokens then copies its
inputs into the static buffers, marks rows n..B as padding (no slot to write, a
sequence length of 0 so attention reads nothing and writes zeros) and replays the
graph: one launch instead of a few hundred. The inputs come as host arrays and reach
the buffers in two copies through the pinned staging buffer: the token IDs, positions,
slots and lengths packed into one array, and the block tables. Mixed or larger batches
run eagerly.

On the CPU there is nothing to capture: `replay` runs the same forward on the same
static buffers, which is how the padding logic is tested without a GPU.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import numpy as np
import torch
from tqdm import tqdm

from streamserve.worker.staging import HostStaging
from streamserve.worker.triton_attention import TritonAttentionMetadata

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8, up to the first size that holds max_num_seqs (at most 512)."""
    sizes = [1, 2, 4] + list(range(8, MAX_CAPTURE_SIZE + 1, 8))
    return sizes[:next((i + 1 for i, s in enumerate(sizes) if s >= max_num_seqs), len(sizes))]


# forward(input_ids [B], positions [B], metadata) -> hidden [B, H]
Forward = Callable[[torch.Tensor, torch.Tensor, TritonAttentionMetadata], torch.Tensor]


class DecodeGraphs:
    def __init__(self, forward: Forward, sizes: list[int], max_blocks_per_seq: int,
                 num_splits: Callable[[int], int], device: torch.device, staging: HostStaging) -> None:
        self.forward = forward
        self.sizes = sizes
        self.num_splits = num_splits  # batch size -> KV splits per sequence, fixed per graph
        self.device = device
        self.staging = staging
        n = sizes[-1]
        # A step's token IDs, positions, slots (int64) and sequence lengths (int32) for a graph
        # of b rows lie packed in the first _packed_len(b) elements, so one copy brings them.
        self.packed = torch.zeros(_packed_len(n), dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def buffers(self, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids, positions, slot_mapping, seq_lens) of the graph of b rows: views of packed."""
        return _unpacked(self.packed, b, torch.int32)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _run(self, b: int) -> torch.Tensor:
        input_ids, positions, slot_mapping, seq_lens = self.buffers(b)
        meta = TritonAttentionMetadata(
            slot_mapping=slot_mapping, query_start_loc=self.query_start_loc[:b + 1],
            seq_lens=seq_lens, block_tables=self.block_tables[:b], num_decodes=b,
            max_query_len=1, num_splits=self.num_splits(b))
        return self.forward(input_ids, positions, meta)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, all in one memory pool."""
        if self.device.type != "cuda":
            return
        start, (free_before, _) = time.perf_counter(), torch.cuda.mem_get_info(self.device)
        pool = torch.cuda.graph_pool_handle()
        for b in tqdm(list(reversed(self.sizes)), desc="Capturing CUDA graphs", unit="graph"):
            self.buffers(b)[2].fill_(-1)  # (its warm-up writes no slot)
            self._run(b)  # warm up: compiles the Triton kernels for this shape before capture
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self._run(b)
            self.graphs[b] = graph
        torch.cuda.synchronize(self.device)
        free_after, _ = torch.cuda.mem_get_info(self.device)
        logger.info("captured %d CUDA graphs (decode batches %d..%d) in %.1f s, using %.0f MiB",
                    len(self.graphs), self.sizes[0], self.sizes[-1], time.perf_counter() - start,
                    (free_before - free_after) / 2 ** 20)

    def padded_size(self, n: int) -> int:
        return next(b for b in self.sizes if b >= n)

    @torch.inference_mode()
    def replay(self, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray,
               seq_lens: np.ndarray, block_tables: np.ndarray,
               carry: Optional[Callable[[torch.Tensor], None]] = None) -> torch.Tensor:
        """Hidden states [n, H] for n <= max_batch decode tokens (the arrays' first dim, on the
        host): two copies in (the packed rows, the block tables), then one launch. `carry`
        writes into the token IDs' buffer, once they are in, those that are on the device
        already (async scheduling: the tokens sampled by the step before, still in flight)."""
        n, b = len(input_ids), self.padded_size(len(input_ids))
        packed = np.zeros(_packed_len(b), dtype=np.int64)
        ids, pos, slots, lens = _unpacked(packed, b, np.int32)
        ids[:n], pos[:n], slots[:n], lens[:n] = input_ids, positions, slot_mapping, seq_lens
        slots[n:] = -1  # padding rows: write no slot, read no key (length 0)
        self.staging.copy_into(self.packed[:len(packed)], packed)
        self.staging.copy_into(self.block_tables[:n, :block_tables.shape[1]], block_tables)
        if carry is not None:
            carry(self.packed[:n])
        if b in self.graphs:
            self.graphs[b].replay()
            return self.outputs[b][:n]
        return self._run(b)[:n]


def _packed_len(b: int) -> int:
    """int64 elements of b rows' packed inputs: three int64 arrays and one int32 array."""
    return 3 * b + -(-b // 2)


def _unpacked(packed, b: int, int32):
    """The packed inputs of b rows (an int64 numpy array or tensor) as views: token IDs,
    positions, slots, then the lengths as `int32` (np.int32 or torch.int32)."""
    return packed[:b], packed[b:2 * b], packed[2 * b:3 * b], packed[3 * b:_packed_len(b)].view(int32)[:b]
