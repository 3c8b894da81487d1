"""Tokenise a directory of text files in parallel into a stream dataset, then describe it.

Each file is one document: its bytes are its tokens (byte-level, 0..255), followed by an EOS
token (256), so documents are separated by EOS in the stream. File ``k`` (in sorted order)
becomes shard ``k``, written by a pool of worker processes with ``write_parallel``; running
the script again skips the files that did not change. Then ``guideloom-pipes info`` describes
the result.

    python examples/tokenize_corpus.py [CORPUS_DIR] [DATASET_DIR]

Without arguments it writes a small demo corpus to ``corpus/`` and the dataset to
``data/corpus-tokens/`` (relative to the current directory).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from guideloom_pipes import StreamNumpyFormat, StreamStorage, write_parallel
from guideloom_pipes.cli import main as cli

EOS = 256  # one past the byte values
DTYPE = np.dtype([("tokens", "<i4")])


def tokenize(path: str) -> Iterator[dict[str, np.ndarray]]:
    """One text file -> its records: the byte-level tokens of the document, then EOS."""
    data = Path(path).read_bytes()
    tokens = np.empty(len(data) + 1, dtype=np.int32)
    tokens[:-1] = np.frombuffer(data, dtype=np.uint8)
    tokens[-1] = EOS
    yield {"tokens": tokens}


def demo_corpus(directory: Path) -> None:
    """A few small text files to tokenise."""
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(8):
        lines = [f"Document {i}, line {j}: the quick brown fox jumps.\n" for j in range(5 + i)]
        (directory / f"doc{i:02d}.txt").write_text("".join(lines))


def main(argv: list[str]) -> None:
    corpus = Path(argv[0]) if argv else Path("corpus")
    out = Path(argv[1]) if len(argv) > 1 else Path("data/corpus-tokens")
    if not argv:
        demo_corpus(corpus)
    files = sorted(str(p) for p in corpus.glob("*.txt"))
    storage = StreamStorage(out, StreamNumpyFormat(DTYPE))
    report = write_parallel(storage, files, tokenize, max_workers=2)
    print(f"first run: {report}")
    again = write_parallel(storage, files, tokenize, max_workers=2, progress=False)
    print(f"second run: {again}")
    cli(["info", str(out), "--sequence-length", "64"])


if __name__ == "__main__":  # worker processes import this file: keep the work under this guard
    main(sys.argv[1:])
