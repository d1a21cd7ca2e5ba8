"""python -m streamserve"""

import gc
import sys

# No collector passes over the imports and the load (heap.py): the server's engine collects
# once and freezes the loaded heap, then turns the collector on (AsyncEngine's freeze_heap).
gc.disable()

from streamserve.cli import main  # noqa: E402

sys.exit(main())
