"""A training loop under Hugging Face Accelerate on ``guideloom_pipes.DataLoader``, run by
``torchrun --nproc-per-node=2`` (CPU, gloo), recording each batch each process trains on,
one JSON line per step, in ``OUT/TAG-rankR.txt``.

    torchrun --nproc-per-node=2 accelerate_script.py OUT TAG --mode M [--stop K] [--resume]

``--mode ours``: our loader, sharded by a ``DistributedSampler`` and registered for
checkpointing (``accelerator.register_for_checkpointing``): it reads with our stages.
``--mode prepared``: our loader given to ``accelerator.prepare``, which rebuilds it as its
own (torch's reader underneath), resumed as Accelerate resumes one
(``accelerator.skip_first_batches`` with the steps the epoch had trained).
``--stop K`` saves the state after step ``K`` (``accelerator.save_state``) and stops;
``--resume`` loads it in this new process (``accelerator.load_state``) and goes on.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DistributedSampler

from guideloom_pipes import DataLoader

SAMPLES = 24  # (divisible by 2 processes x batch size 3: no process is padded)
EPOCHS = 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("tag")
    parser.add_argument("--mode", choices=["ours", "prepared"], default="ours")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--stop", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    # (a prepared loader's shuffled order repeats from its seed and epoch only with
    # Accelerate's seedable sampler: what its skip_first_batches resume needs)
    config = DataLoaderConfiguration(use_seedable_sampler=args.mode == "prepared")
    accelerator = Accelerator(cpu=True, dataloader_config=config)
    torch.manual_seed(3)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    dataset = list(range(SAMPLES))
    sampler = None
    if args.mode == "ours":
        sampler = DistributedSampler(
            dataset,
            num_replicas=accelerator.num_processes,
            rank=accelerator.process_index,
            shuffle=True,
            seed=7,
        )
        loader = DataLoader(dataset, batch_size=3, sampler=sampler, num_workers=args.workers)
        model, optimizer = accelerator.prepare(model, optimizer)
        accelerator.register_for_checkpointing(loader)
    else:
        loader = DataLoader(dataset, batch_size=3, shuffle=True, num_workers=args.workers)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state_dir = os.path.join(args.out, "state")
    start, skip = 0, 0
    if args.resume:
        accelerator.load_state(state_dir)
        if args.mode == "ours":
            start = loader.state_dict()["epoch"]
        else:  # (Accelerate's way: the steps of the epoch trained, skipped again)
            start, skip = _where(state_dir)
    record = os.path.join(args.out, f"{args.tag}-rank{accelerator.process_index}.txt")
    reader = getattr(loader, "base_dataloader", loader)  # (what reads: Accelerate's own)
    with open(record.replace(".txt", "-loader.txt"), "w") as file:
        file.write(f"{type(reader).__module__}.{type(reader).__qualname__}\n")
    step = 0
    for epoch in range(start, EPOCHS):
        if sampler is not None:
            sampler.set_epoch(epoch)
        elif hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        epoch_loader = loader
        if skip:
            epoch_loader, skip = accelerator.skip_first_batches(loader, skip), 0
        for in_epoch, batch in enumerate(epoch_loader, 1):
            with open(record, "a") as file:
                file.write(json.dumps([epoch, batch.tolist()]) + "\n")
            loss = model(batch.float().unsqueeze(1)).sum()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step == args.stop:
                if accelerator.is_main_process:
                    with open(os.path.join(args.out, "where.txt"), "w") as file:
                        file.write(f"{epoch} {in_epoch}")
                accelerator.save_state(state_dir)
                return
    accelerator.wait_for_everyone()


def _where(state_dir: str) -> tuple[int, int]:
    with open(os.path.join(os.path.dirname(state_dir), "where.txt")) as file:
        epoch, steps = file.read().split()
    return int(epoch), int(steps)


if __name__ == "__main__":
    main()
