"""Pretraining data: packed documents from three corpora, blended, loaded in steps, resumed.

Writes three small corpora (a token stream whose documents end with an EOS token, a second
stream, and a document storage), packs each into windows with document boundaries
(``PackedDataset``), blends them 60/30/10 (``MixtureDataset``), and trains for a number of
steps (``loader.steps(n)``) with the inputs of flash-attention's varlen kernels
(``collate_packed``: ``cu_seqlens``, ``max_seqlen``). Halfway it checkpoints, then a fresh
loader on another world size resumes from that state and delivers the same samples as the
uninterrupted run. Then an annealing run (a ``WeightSchedule``: more code in its last steps,
read in order) is stopped and restarted on another world size with other weights: each corpus
goes on from where it stood, no window read twice. Run::

    python mix_and_pack.py
"""

import tempfile
from pathlib import Path

import numpy as np

from guideloom_pipes import (
    DocumentPickleFormat,
    DocumentStorage,
    MixtureDataset,
    PackedDataset,
    StatefulDataLoader,
    StreamNumpyFormat,
    StreamStorage,
    WeightSchedule,
    collate_packed,
)

EOS = 0
SEQUENCE_LENGTH = 16
STEPS = 6
GLOBAL_BATCH = 4


def write_stream(directory, first_token, documents):
    """A token stream of ``documents`` documents, each ending with EOS."""
    rng = np.random.default_rng(first_token)
    pieces = []
    for _ in range(documents):
        length = int(rng.integers(3, 30))
        pieces += [np.arange(first_token, first_token + length), [EOS]]
    storage = StreamStorage(directory, StreamNumpyFormat(np.dtype([("tokens", "<i4")])))
    with storage.sync_writer() as writer:
        writer.append(0, {"tokens": np.concatenate(pieces)})
    return storage


def write_documents(directory, documents):
    """A document storage of token lists (no EOS stored: PackedDataset appends it)."""
    storage = DocumentStorage(directory, DocumentPickleFormat())
    with storage.sync_writer() as writer:
        for k in range(documents):
            writer.append(k % 2, list(range(5000, 5000 + 4 + k % 11)))
    return storage


def corpora(root):
    """The three corpora, packed into windows of SEQUENCE_LENGTH tokens."""
    web = PackedDataset(write_stream(root / "web", 1000, 60), SEQUENCE_LENGTH, eos_token=EOS)
    code = PackedDataset(write_stream(root / "code", 3000, 40), SEQUENCE_LENGTH, eos_token=EOS)
    books = PackedDataset(
        write_documents(root / "books", 50), SEQUENCE_LENGTH, eos_token=EOS, seed=7
    )
    return {"web": web, "code": code, "books": books}


def blend(components, weights):
    return MixtureDataset(
        components,
        weights,
        seed=1234,
        num_samples=STEPS * GLOBAL_BATCH,  # the run's length: every step reads new draws
    )


def loader(mixture, world_size, rank, shuffle=True):
    return StatefulDataLoader(
        mixture,
        collate_packed,
        local_batch_size=GLOBAL_BATCH // world_size,
        rank=rank,
        world_size=world_size,
        shuffle=shuffle,
        shuffle_seed=42 if shuffle else None,
        device="cpu",
    )


def first_tokens(batch):
    return batch["tokens"][:, 0].tolist()


def main():
    with tempfile.TemporaryDirectory() as tmp:
        components = corpora(Path(tmp))
        mixture = blend(components, {"web": 0.6, "code": 0.3, "books": 0.1})
        component, index = mixture.locate(np.arange(8))
        names = [mixture.names[c] for c in component.tolist()]
        print("positions 0-7 come from", list(zip(names, index.tolist())))

        # The uninterrupted run, one rank.
        whole = [first_tokens(b) for b in loader(mixture, 1, 0).steps(STEPS)]
        batch = next(loader(mixture, 1, 0).steps(1))
        print("cu_seqlens of the first batch:", batch["cu_seqlens"].tolist())
        print("max_seqlen:", batch["max_seqlen"])

        # Half the steps on one rank, a checkpoint, the rest on two ranks.
        first = loader(mixture, 1, 0)
        head = [first_tokens(b) for b in first.steps(STEPS // 2)]
        state = first.state_dict()
        print("checkpoint after", STEPS // 2, "steps:", state)
        ranks = [loader(mixture, 2, rank) for rank in range(2)]
        for rank_loader in ranks:
            rank_loader.load_state_dict(state)
        per_rank = [[first_tokens(b) for b in r.steps(STEPS - STEPS // 2)] for r in ranks]
        tail = [
            [row for pair in zip(zero, one) for row in pair]  # rank batches interleaved
            for zero, one in zip(*per_rank)
        ]
        print("resumed steps match:", head + tail == whole)
        anneal_and_restart(components)


def anneal_and_restart(components):
    """More code in the last third of the run (positions: step s starts at s * GLOBAL_BATCH),
    read in order; stopped after 3 steps and restarted on 2 ranks with more books."""
    schedule = WeightSchedule(
        [
            (0, {"web": 0.6, "code": 0.3, "books": 0.1}),
            (4 * GLOBAL_BATCH, {"web": 0.3, "code": 0.6, "books": 0.1}),
        ]
    )
    first = loader(blend(components, schedule), 1, 0, shuffle=False)
    for _ in first.steps(3):  # train_step(batch)
        pass
    state = first.state_dict()
    print("weights history at position", state["observation_offset"], state["mixture"]["history"])
    more_books = blend(components, {"web": 0.4, "code": 0.2, "books": 0.4})
    ranks = [loader(more_books, 2, rank, shuffle=False) for rank in range(2)]
    for rank_loader in ranks:
        rank_loader.load_state_dict(state)
        for _ in rank_loader.steps(STEPS - 3):  # train_step(batch)
            pass
    # which window of which corpus each position of the run read: no window twice
    component, index = more_books.locate(np.arange(STEPS * GLOBAL_BATCH))
    read = list(zip(component.tolist(), index.tolist()))
    print("windows read twice after the restart:", len(read) - len(set(read)))


# -- best-fit packing (issue 30) ------------------------------------------------------------
# packing="best_fit" fits whole documents into windows (a document that fits is never cut)
# and pads the rest of each window with pad_token: a sequence of its own in cu_seqlens,
# labelled -100. See docs/packing.md#best-fit-packing.

PAD = -1


def best_fit():
    with tempfile.TemporaryDirectory() as tmp:
        books = PackedDataset(
            write_documents(Path(tmp) / "books", 50),
            SEQUENCE_LENGTH,
            eos_token=EOS,
            seed=7,
            packing="best_fit",
            pad_token=PAD,
        )
        batch = next(loader(books, 1, 0).steps(1))
        print("best fit:", len(books), "windows of whole documents")
        print("best-fit padding in the first batch:", int((batch["tokens"] == PAD).sum()))
        print("best-fit cu_seqlens:", batch["cu_seqlens"].tolist())


# -- end of best-fit packing ----------------------------------------------------------------


if __name__ == "__main__":
    main()
    best_fit()
