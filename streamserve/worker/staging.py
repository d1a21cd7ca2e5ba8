"""HostStaging: a step's small index arrays reach the GPU without a stall per array.

`torch.from_numpy(a).to("cuda")` copies from pageable memory, which CUDA does
synchronously, each time: a step's half-dozen such copies (token IDs, positions, slots,
sequence lengths, block tables, ...) cost more than the kernels of a small decode step.
Here each array is written into a pinned buffer and copied with non_blocking=True, so
the copies queue behind each other on the stream and the CPU goes on. There are two such
buffers, a step's arrays in one and the next step's in the other: a step starts with
`begin_step()`, which waits until the copies of the step before the last have read its
buffer before it is written again. By then they have, even under async scheduling, where a
step is laid out while the last one runs (its copies, the sampler's among them, queued
behind that step's forward): the step before the last has been read back.

On the CPU there is nothing to copy: `__call__` returns the array's own memory.
"""

from __future__ import annotations

import numpy as np
import torch

_ALIGN = 64


class HostStaging:
    def __init__(self, device: torch.device, capacity: int = 4 << 20) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self.capacity = capacity
        self.offset = 0
        if self.pinned:
            self.pinned_memory = [torch.empty(capacity, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
            self.hosts = [t.numpy() for t in self.pinned_memory]
            self.events = [torch.cuda.Event(), torch.cuda.Event()]
            self.read = [False, False]  # whether copies have read the buffer since it was last waited for
            self.which = 0
            self.host_np, self.copied = self.hosts[0], self.events[0]

    def begin_step(self) -> None:
        """The next step's arrays go to the other buffer, once the copies that read it are done."""
        self.offset = 0
        if not self.pinned:
            return
        self.which ^= 1
        self.host_np, self.copied = self.hosts[self.which], self.events[self.which]
        if self.read[self.which]:
            self.copied.synchronize()
            self.read[self.which] = False

    def __call__(self, array: np.ndarray) -> torch.Tensor:
        if not self.pinned:
            return torch.from_numpy(array).to(self.device)
        staged = self._stage(np.ascontiguousarray(array))
        if staged is None:  # larger than the whole buffer: a plain (synchronous) copy
            return torch.from_numpy(array).to(self.device)
        return self._copied(staged.to(self.device, non_blocking=True))

    def copy_into(self, dst: torch.Tensor, array: np.ndarray) -> None:
        """dst.copy_(array) the same way, with no device tensor in between (a CUDA graph's
        static buffer, say)."""
        staged = self._stage(np.ascontiguousarray(array)) if self.pinned else None
        if staged is None:
            dst.copy_(torch.from_numpy(np.ascontiguousarray(array)))
        else:
            self._copied(dst.copy_(staged, non_blocking=True))

    def _stage(self, array: np.ndarray):
        """The array written into the pinned buffer, as a tensor over it (None: it does not fit)."""
        n = array.nbytes
        if self.offset + n > self.capacity:
            if n > self.capacity:
                return None
            self.copied.synchronize()  # every copy so far has read the buffer: start again at 0
            self.offset = 0
        start = self.offset
        self.offset = -(-(start + n) // _ALIGN) * _ALIGN
        view = self.host_np[start:start + n].view(array.dtype).reshape(array.shape)
        view[...] = array
        return torch.from_numpy(view)

    def _copied(self, out: torch.Tensor) -> torch.Tensor:
        self.copied.record(torch.cuda.current_stream(self.device))  # the stream the copy went on
        self.read[self.which] = True
        return out
