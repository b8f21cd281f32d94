"""``python -m tokenloom``: the same as the ``tokenloom`` command."""

import sys

from tokenloom.entrypoints.cli import main

sys.exit(main())
