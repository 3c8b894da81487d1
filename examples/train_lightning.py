"""Train with PyTorch Lightning on ``guideloom_pipes.DataLoader``, stop mid-epoch, resume.

Reads the shards ``write_shards.py`` wrote (run it first, in the same folder), with torch's
``DataLoader`` call and our import. Lightning saves the loader's ``state_dict()`` in its
checkpoints, so ``fit(ckpt_path=...)`` goes on with the batch after the last one trained:

    python write_shards.py
    python train_lightning.py          # 2 epochs, stopping after step 5, then resuming

It prints each step's batch (``step=N: [...]``): the resumed run's steps 6.. are the
uninterrupted run's. Needs ``pip install lightning``.
"""

from pathlib import Path

import lightning as L
import numpy as np
import torch

from guideloom_pipes import DataLoader, StreamDataset, StreamNumpyFormat, StreamStorage

STOP = 5


def collate(samples):
    return torch.from_numpy(np.stack([sample["tokens"] for sample in samples])).long()


class TinyModel(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 8)
        self.head = torch.nn.Linear(8, 64)

    def training_step(self, batch, index):
        print(f"step={self.global_step + 1}: {batch.tolist()}")
        logits = self.head(self.embed(batch[:, :-1]))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader():
    storage = StreamStorage(
        Path("data/sharded-tokens"), StreamNumpyFormat(np.dtype([("tokens", "<i4")]))
    )
    # torch's DataLoader call; generator= makes the shuffled order of the epochs after a
    # resumed one repeat too (the loader's state restores it; Lightning's checkpoints do
    # not hold torch's global generator)
    return DataLoader(
        StreamDataset(storage, sequence_length=4),
        batch_size=2,
        shuffle=True,
        num_workers=2,
        collate_fn=collate,
        generator=torch.Generator().manual_seed(42),
    )


def trainer(**limits):
    return L.Trainer(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir="lightning-run",
        **limits,
    )


def main():
    L.seed_everything(0, verbose=False)
    checkpoint = L.pytorch.callbacks.ModelCheckpoint(
        dirpath="lightning-run/checkpoints", every_n_train_steps=STOP, save_top_k=-1
    )
    print(f"-- training, stopping after step {STOP}")
    trainer(max_steps=STOP, callbacks=[checkpoint]).fit(TinyModel(), loader())

    print("-- resuming from the checkpoint of that step")
    L.seed_everything(0, verbose=False)
    resumed = trainer(max_epochs=2, enable_checkpointing=False)
    resumed.fit(TinyModel(), loader(), ckpt_path=checkpoint.best_model_path or None)


if __name__ == "__main__":
    main()
