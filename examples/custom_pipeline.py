"""A loading pipeline of your own from guideloom_pipes stages and torchdata nodes, checkpointed.

Builds the standard stages by hand, adds a ``torchdata.nodes.Mapper`` transform in the
middle, checkpoints with ``torchdata.nodes.Loader.state_dict()`` mid-epoch, and shows that a
freshly built pipeline resumed from that state delivers the identical next batch. Run::

    python custom_pipeline.py
"""

import tempfile
from pathlib import Path

import numpy as np
import torch
import torchdata.nodes as tn

from guideloom_pipes import StreamDataset, StreamNumpyFormat, StreamStorage
from guideloom_pipes.pipes import (
    Collate,
    Prefetcher,
    RankPositions,
    ReadSamples,
    Shuffle,
    close_pipeline,
)

SEQUENCE_LENGTH = 8


def write_dataset(directory):
    """Two shards of 50 samples of 8 tokens (token k is k)."""
    storage = StreamStorage(directory, StreamNumpyFormat(np.dtype([("tokens", "<i4")])))
    with storage.sync_writer() as writer:
        for shard in range(2):
            start = shard * 50 * SEQUENCE_LENGTH
            writer.append(shard, {"tokens": np.arange(start, start + 50 * SEQUENCE_LENGTH)})
    return storage


def shift_for_next_token(samples):
    """A user transform: (input, target) pairs for next-token prediction."""
    return [(s["tokens"][:-1], s["tokens"][1:]) for s in samples]


def collate(pairs):
    inputs = torch.from_numpy(np.stack([p[0] for p in pairs]))
    targets = torch.from_numpy(np.stack([p[1] for p in pairs]))
    return {"inputs": inputs, "targets": targets}


def build(dataset, rank=0, world_size=2):
    node = RankPositions(len(dataset), 4, rank=rank, world_size=world_size, drop_last=True)
    node = Shuffle(node, seed=1234)  # GuideLoom's shuffled order
    node = ReadSamples(node, dataset, num_workers=2)  # whole batches read by 2 threads
    node = tn.Mapper(node, shift_for_next_token)  # torchdata's own node, in the middle
    node = Collate(node, collate)
    return Prefetcher(node, 2)  # two finished batches wait ahead


def main():
    with tempfile.TemporaryDirectory() as tmp:
        dataset = StreamDataset(write_dataset(Path(tmp) / "tokens"), SEQUENCE_LENGTH)

        loader = tn.Loader(build(dataset))
        it = iter(loader)
        for step in range(3):
            batch = next(it)
            print(f"step {step}: first input row {batch['inputs'][0].tolist()}")
        state = loader.state_dict()  # what was delivered; prefetched batches do not count
        expected = next(it)
        close_pipeline(loader.root)

        resumed = tn.Loader(build(dataset))
        resumed.load_state_dict(state)
        batch = next(iter(resumed))
        same = all(torch.equal(batch[key], expected[key]) for key in ("inputs", "targets"))
        print(f"resumed batch matches: {same}")
        close_pipeline(resumed.root)


if __name__ == "__main__":
    main()
