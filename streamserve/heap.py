"""Python's cyclic garbage collector around a model's load.

A load builds some 600k objects that live as long as the engine (torch's and transformers'
modules, the model, the tokenizer), and every full pass of the collector walks all of them.
On a 2-core machine a server's start-up ran eight such passes, of 0.03-0.45 s each, ~1.9 s in
all; and a full pass once serving holds the GIL, so stalls every stream, for 0.3-0.45 s.
So the load runs with the collector off, and a server, which keeps its engine to the end,
collects once afterwards and freezes what is left (`freeze_loaded`).
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic collection inside; the collector is on again after if it was before. Objects
    are still freed when nothing refers to them; cycles made meanwhile wait for the next pass."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def freeze_loaded() -> None:
    """Collect the load's cycles once (0.4-0.8 s), move every object left to the permanent
    generation (gc.freeze), which later passes skip (they walk what serving allocated, not the
    loaded heap), and turn the collector on (python -m streamserve starts with it off). A cycle
    of frozen objects is never collected until `gc.unfreeze()`."""
    gc.collect()
    gc.freeze()
    gc.enable()
