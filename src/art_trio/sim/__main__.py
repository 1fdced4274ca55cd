"""``python -m art_trio.sim``: the same as ``art-trio simulate``."""

import sys

from art_trio.sim.cli import main

sys.exit(main())
