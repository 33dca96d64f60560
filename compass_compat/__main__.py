"""``python -m compass_compat``: see :mod:`compass_compat.cli` (importing the package applied the patch)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
