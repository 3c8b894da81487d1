import os
from pathlib import Path

import numpy as np
import torch

from guideloom import StatefulDataLoader, StreamNumpyFormat, StreamStorage


def collate(samples):
    return torch.from_numpy(np.stack([sample["tokens"] for sample in samples]))


def main():
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    storage = StreamStorage(
        Path("data/sharded-tokens"), StreamNumpyFormat(np.dtype([("tokens", "<i4")]))
    )
    with StatefulDataLoader.from_storage(
        storage,
        collate,
        sequence_length=4,
        device=torch.device("cpu"),
        local_batch_size=2,
        rank=rank,
        world_size=world_size,
        shuffle=True,
        shuffle_seed=42,
        num_workers=2,
        parallel_method="thread",
        prefetch=2,
    ) as loader:
        for batch in loader:
            assert batch.shape == (2, 4)
            print(f"rank={rank}: {batch.tolist()}")


if __name__ == "__main__":
    main()
