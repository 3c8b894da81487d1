"""The ``guideloom-pipes`` command line: ``info``, ``verify``, ``head`` and ``recover`` of a
dataset directory (see ``docs/cli.md``). numpy only: it never imports torch."""

from guideloom_pipes.cli.main import main

__all__ = ["main"]
