"""Training on the corpora a team already has: a Megatron-LM indexed dataset blended with a
Parquet table of token ids, read in place, no conversion.

Writes the two small corpora with the real tools (megatron-core's ``IndexedDatasetBuilder``:
``uint16`` tokens, what ``preprocess_data.py`` writes for a small vocabulary; pyarrow: a
``list<int32>`` column ``input_ids``, what a Hugging Face tokenizing pipeline writes), opens
them as ``MegatronIndexedStorage`` and ``ParquetStorage``, cuts each into windows
(``StreamDataset``), blends them 70/30 (``MixtureDataset``; ``dtype="int32"`` makes the
Megatron corpus's tokens the Parquet one's dtype, which a blend requires), and trains a toy
next-token model for a few steps with two worker threads. Halfway it checkpoints; a new
loader resumes from that state and delivers the very batches the first one delivered after
it. Run::

    python train_on_corpora.py

Needs megatron-core and pyarrow (``pip install 'guideloom-pipes[corpora-test]'``, or
``pip install megatron-core pyarrow``); without them it says which is missing and exits.
"""

import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

from guideloom_pipes import (
    MegatronIndexedStorage,
    MixtureDataset,
    ParquetStorage,
    StatefulDataLoader,
    StreamDataset,
)

VOCABULARY = 1000
EOS = 0
SEQUENCE_LENGTH = 32
BATCH = 8
STEPS = 8


def need_extras():
    """megatron-core's ``indexed_dataset`` and pyarrow, or exit naming what to install."""
    missing = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (its optional fused kernels are missing on CPU)
            from megatron.core.datasets import indexed_dataset
    except ImportError as error:
        indexed_dataset = None
        missing.append(f"megatron-core ({error})")
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as error:
        pyarrow = None
        missing.append(f"pyarrow ({error})")
    if missing:
        sys.exit(
            f"this example writes its corpora with the real tools, and needs "
            f"{' and '.join(missing)}: pip install megatron-core pyarrow (or "
            f"pip install 'guideloom-pipes[corpora-test]')"
        )
    return indexed_dataset, pyarrow


def random_documents(seed, count):
    """``count`` documents of 5-80 token ids, each ending with EOS."""
    rng = np.random.default_rng(seed)
    return [
        np.append(rng.integers(1, VOCABULARY, int(rng.integers(5, 80))), EOS) for _ in range(count)
    ]


def write_megatron(prefix, indexed_dataset):
    """``PREFIX.bin`` / ``PREFIX.idx`` of uint16 tokens, by megatron-core's own builder."""
    builder = indexed_dataset.IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for document in random_documents(1, 300):
        builder.add_item(torch.from_numpy(document))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")
    return prefix


def write_parquet(path, pyarrow):
    """A Parquet table, a row per document: ``input_ids`` (int32 lists) and a ``url``."""
    documents = random_documents(2, 200)
    table = pyarrow.table(
        {
            "input_ids": pyarrow.array(
                [d.tolist() for d in documents], pyarrow.list_(pyarrow.int32())
            ),
            "url": [f"https://example.com/{k}" for k in range(len(documents))],
        }
    )
    pyarrow.parquet.write_table(table, path, row_group_size=50)
    return path


def blend(root, indexed_dataset, pyarrow):
    web = MegatronIndexedStorage(
        write_megatron(root / "web_text_document", indexed_dataset), dtype="int32"
    )
    code = ParquetStorage(write_parquet(root / "code.parquet", pyarrow), "input_ids")
    print("corpora:", web, "and", code)
    return MixtureDataset(
        {"web": StreamDataset(web, SEQUENCE_LENGTH), "code": StreamDataset(code, SEQUENCE_LENGTH)},
        {"web": 0.7, "code": 0.3},
        seed=0,
    )


def loader(mixture):
    return StatefulDataLoader(
        mixture,
        local_batch_size=BATCH,
        shuffle=True,
        shuffle_seed=42,
        num_workers=2,
        prefetch=2,
        device="cpu",
    )


def main():
    indexed_dataset, pyarrow = need_extras()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCABULARY, 32), torch.nn.Linear(32, VOCABULARY))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with tempfile.TemporaryDirectory() as tmp:
        mixture = blend(Path(tmp), indexed_dataset, pyarrow)
        component, _ = mixture.locate(np.arange(len(mixture)))
        shares = np.bincount(component, minlength=2) / len(mixture)
        print(f"windows: {len(mixture)}, web {shares[0]:.2f}, code {shares[1]:.2f}")
        state, after = None, []
        with loader(mixture) as first:
            for step, batch in enumerate(first.steps(STEPS)):
                if step == 0:
                    print("tokens:", batch["tokens"].dtype, tuple(batch["tokens"].shape))
                tokens = batch["tokens"].long()
                logits = model(tokens[:, :-1])
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, VOCABULARY), tokens[:, 1:].reshape(-1)
                )
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                print(f"step {step}: loss {loss.item():.3f}")
                if step == STEPS // 2 - 1:
                    state = first.state_dict()  # what was delivered: resume at the next batch
                elif step >= STEPS // 2:
                    after.append(tokens)

        # a new job: the same corpora opened again, a loader with the same arguments, the state
        with loader(mixture) as second:
            second.load_state_dict(state)
            resumed = [batch["tokens"].long() for batch in second.steps(STEPS - STEPS // 2)]
        same = len(resumed) == len(after) and all(map(torch.equal, resumed, after))
        print("resumed batches match:", same)


if __name__ == "__main__":
    main()
