"""``python -m guideloom_pipes``: the ``guideloom-pipes`` command line (info, verify, head,
recover of a dataset directory)."""

import sys

from guideloom_pipes.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
