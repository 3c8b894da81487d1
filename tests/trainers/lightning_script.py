"""One ``Trainer.fit`` on ``guideloom_pipes.DataLoader`` (a script: Lightning's ``ddp``
strategy starts its other ranks by running this command line again), recording each
batch each rank trains on, one JSON line per step, in ``OUT/TAG-rankR.txt``.

    python lightning_script.py OUT TAG --workers W --devices D [--stop K] [--resume CKPT]

``--stop K`` stops after step ``K`` with a checkpoint of it in ``OUT/ckpt/``; ``--resume``
continues from such a checkpoint to the end of the run (2 epochs).
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

import lightning as L
import torch

from guideloom_pipes import DataLoader

SAMPLES = 24  # (divisible by 2 ranks x batch size 3: no rank is padded)
EPOCHS = 2


class Recorder(L.LightningModule):
    """Trains nothing; writes each batch it is given to its rank's file."""

    def __init__(self, out: str, tag: str) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.out, self.tag = out, tag

    def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
        path = os.path.join(self.out, f"{self.tag}-rank{self.global_rank}.txt")
        with open(path, "a") as file:
            file.write(json.dumps([self.current_epoch, batch.tolist()]) + "\n")
        return self.layer(batch.float().unsqueeze(1)).sum() * 0.0

    def on_train_epoch_start(self) -> None:
        loader = self.trainer.train_dataloader
        path = os.path.join(self.out, f"{self.tag}-rank{self.global_rank}-loader.txt")
        with open(path, "a") as file:
            sampler = type(loader.sampler)
            file.write(f"{type(loader).__module__}.{type(loader).__qualname__} ")
            file.write(f"{sampler.__module__}.{sampler.__qualname__}\n")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("tag")
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--stop", type=int, default=0)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")  # (Lightning's advice on workers, logging, ...)
    L.seed_everything(11, verbose=False)
    # (generator=: the order of the epochs after a resumed one comes from it, restored by
    # the loader's state; Lightning's checkpoints do not hold torch's global generator)
    loader = DataLoader(
        list(range(SAMPLES)),
        batch_size=3,
        shuffle=True,
        num_workers=args.workers,
        generator=torch.Generator().manual_seed(5),
    )
    callbacks = []
    limits: dict[str, int] = {"max_epochs": EPOCHS}
    if args.stop:
        limits = {"max_steps": args.stop}
        callbacks.append(
            L.pytorch.callbacks.ModelCheckpoint(
                dirpath=os.path.join(args.out, "ckpt"),
                every_n_train_steps=args.stop,
                save_top_k=-1,
            )
        )
    trainer = L.Trainer(
        default_root_dir=os.path.join(args.out, args.tag),
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(args.stop),
        callbacks=callbacks,
        **limits,
    )
    trainer.fit(Recorder(args.out, args.tag), loader, ckpt_path=args.resume)


if __name__ == "__main__":
    main()
