"""``python -m guideloom_pipes.bench``: runs ``cli.main``."""

from __future__ import annotations

import sys

from guideloom_pipes.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
