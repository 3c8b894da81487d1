"""Fine-tuning on whole documents: padded batches made by worker processes, checkpointed, resumed.

Writes a document storage of prompt/response samples (each a dict of ``input_ids`` and
``labels``, whose prompt part is -100 so the loss skips it), reads it shuffled with two
worker *processes* (unpickling documents is Python work: processes do it beside the
training step instead of taking the GIL from it), pads each batch with ``pad_collate``
(``input_ids`` with 0, ``labels`` with -100, lengths rounded up to a multiple of 8, an
attention mask), trains a toy model for a few steps, checkpoints, and resumes in a new
loader that delivers the very batches the first one delivered after the checkpoint. Run::

    python finetune_documents.py

Worker processes import this script, so its top-level code sits under the
``__name__ == "__main__"`` guard.
"""

import functools
import tempfile
from pathlib import Path

import numpy as np
import torch

from guideloom_pipes import DocumentPickleFormat, DocumentStorage, StatefulDataLoader, pad_collate

VOCABULARY = 200
IGNORE = -100
STEPS = 6


def write_samples(directory, count):
    """``count`` prompt/response samples in two shards: prompts of ids 1-99, responses of
    ids 100-199; only the response is learned."""
    rng = np.random.default_rng(0)
    storage = DocumentStorage(directory, DocumentPickleFormat())
    with storage.sync_writer() as writer:
        for k in range(count):
            prompt = rng.integers(1, 100, int(rng.integers(3, 12))).tolist()
            response = rng.integers(100, VOCABULARY, int(rng.integers(2, 9))).tolist()
            writer.append(
                k * 2 // count,
                {"input_ids": prompt + response, "labels": [IGNORE] * len(prompt) + response},
            )
    return storage


def loader(storage):
    collate = functools.partial(
        pad_collate, pad_value={"input_ids": 0, "labels": IGNORE}, pad_to_multiple_of=8
    )
    return StatefulDataLoader.from_storage(
        storage,
        collate,
        local_batch_size=4,
        shuffle=True,
        shuffle_seed=7,
        num_workers=2,
        parallel_method="process",
        prefetch=2,
        device="cpu",
    )


def main():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCABULARY, 32), torch.nn.Linear(32, VOCABULARY))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with tempfile.TemporaryDirectory() as tmp:
        storage = write_samples(Path(tmp) / "samples", 40)
        state, after = None, []
        with loader(storage) as first:
            for step, batch in enumerate(first.steps(STEPS)):
                if step == 0:
                    print("batch fields:", sorted(batch))
                    print("input_ids shape:", tuple(batch["input_ids"].shape))
                    print("lengths:", batch["lengths"].tolist())
                # predict each next token; padding and prompts are skipped (labels -100)
                logits = model(batch["input_ids"][:, :-1])
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, VOCABULARY),
                    batch["labels"][:, 1:].reshape(-1),
                    ignore_index=IGNORE,
                )
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                print(f"step {step}: loss {loss.item():.3f}")
                if step == STEPS // 2 - 1:
                    state = first.state_dict()  # what was delivered: resume at the next batch
                    print("checkpoint after", STEPS // 2, "steps:", state)
                elif step >= STEPS // 2:
                    after.append(batch["input_ids"])  # (a batch stays valid while held)

        # a new job: a loader made with the same arguments, then the checkpoint
        with loader(storage) as second:
            second.load_state_dict(state)
            resumed = [batch["input_ids"] for batch in second.steps(STEPS - STEPS // 2)]
        same = len(resumed) == len(after) and all(map(torch.equal, resumed, after))
        print("resumed batches match:", same)


if __name__ == "__main__":
    main()
