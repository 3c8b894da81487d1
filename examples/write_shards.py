"""Write the small sharded token dataset that ``train_distributed.py`` reads.

Four shards of four 4-token samples each (sixteen samples, tokens 0..63 in order, so sample
``i`` is ``[4i, 4i+1, 4i+2, 4i+3]``), as one ``<i4`` field ``tokens``, written to
``data/sharded-tokens`` under the current directory. Run::

    python write_shards.py
"""

from pathlib import Path

import numpy as np

from guideloom import StreamNumpyFormat, StreamStorage

SEQUENCE_LENGTH = 4
SAMPLES_PER_SHARD = 4
NUM_SHARDS = 4


def main():
    storage = StreamStorage(
        Path("data/sharded-tokens"), StreamNumpyFormat(np.dtype([("tokens", "<i4")]))
    )
    tokens_per_shard = SAMPLES_PER_SHARD * SEQUENCE_LENGTH
    with storage.sync_writer() as writer:
        for shard in range(NUM_SHARDS):
            start = shard * tokens_per_shard
            tokens = np.arange(start, start + tokens_per_shard, dtype="<i4")
            writer.append(shard, {"tokens": tokens})
    print(
        f"wrote {NUM_SHARDS} shards of {SAMPLES_PER_SHARD} samples of {SEQUENCE_LENGTH} tokens "
        "to data/sharded-tokens"
    )


if __name__ == "__main__":
    main()
