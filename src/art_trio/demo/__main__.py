"""``python -m art_trio.demo``: the same as ``art-trio demo``."""

import sys

from .cli import main

sys.exit(main())
