"""python -m streamserve"""

import sys

from streamserve.cli import main

sys.exit(main())
