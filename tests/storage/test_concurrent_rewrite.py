"""Readers see one version of the dataset while writers replace it.

* An open lists the directory, reads the records and lists again: it uses a snapshot of the
  committed version of every shard, tries again when a commit changed something in between,
  and says that a writer is committing when that keeps happening.
* A reader keeps reading the version it opened after the dataset is rewritten: memory maps
  and held descriptors stay valid across the renames; a file opened (or reopened by the LRU)
  after the rewrite is checked to be the one listed (device, inode, size), or the read fails
  with :class:`DatasetChangedError`, never returning bytes of another version.
* ``verify`` while a writer commits checks the files it listed, lists again for a shard
  recommitted before it read it, and says that a writer is committing rather than report a
  sound dataset as corrupt.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from shard_kinds import KINDS, expected, read, storage, write

from guideloom_pipes import StreamDataset
from guideloom_pipes.cli import verify as cli_verify
from guideloom_pipes.cli.main import main
from guideloom_pipes.storage import DatasetChangedError, StaleWriteWarning, base, commit, listing
from guideloom_pipes.storage.io import MmapIO, PosixPreadIO, SeekIO

# (these tests change shard files behind the manifest's back: its StaleManifestWarning is
# the expected fallback, asserted where it matters, and would flood the report)
pytestmark = pytest.mark.filterwarnings(
    "ignore::guideloom_pipes.storage.errors.StaleManifestWarning"
)

OLD = {0: list(range(0, 7)), 1: list(range(100, 103)), 2: list(range(200, 209))}
NEW = {0: list(range(1000, 1002)), 1: list(range(1100, 1111)), 2: list(range(1200, 1205))}
BACKENDS = [MmapIO(), PosixPreadIO(), SeekIO()]


def read_shard(kind: str, reader: Any, shard: int) -> list[Any]:
    """Shard ``shard``'s values as ``expected(kind, {0: values})`` shows them."""
    start = int(sum(reader.length(k) for k in range(shard)))
    count = reader.length(shard)
    if kind == "document":
        return list(reader.read_many(np.arange(start, start + count)))
    data = reader.read(start, count)
    return [int(v) for v in data["tokens"]] if kind == "stream" else list(data)


# An open while a writer commits --------------------------------------------------------


@pytest.mark.listing  # states what an open that lists the directory does
def test_an_open_whose_records_changed_while_it_listed_lists_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write("stream", tmp_path, OLD)
    real = listing._read_local
    calls = []

    def read_local(path: str) -> bytes:
        if not calls:  # a writer commits between the listing and the first record read
            write("stream", tmp_path, NEW)
        calls.append(path)
        return real(path)

    monkeypatch.setattr(listing, "_read_local", read_local)
    assert read("stream", tmp_path) == expected("stream", NEW)
    assert len(calls) > len(OLD)  # the records were read again


@pytest.mark.listing  # states what an open that lists the directory does
def test_an_open_during_commit_after_commit_says_a_writer_is_committing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write("stream", tmp_path, OLD)
    real = listing._read_local
    versions = [NEW, OLD]

    def read_local(path: str) -> bytes:
        versions.reverse()
        write("stream", tmp_path, versions[0])  # every listing sees a new commit
        return real(path)

    monkeypatch.setattr(listing, "_read_local", read_local)
    monkeypatch.setattr(listing.time, "sleep", lambda seconds: None)
    with pytest.raises(DatasetChangedError, match="a writer is committing to this dataset"):
        read("stream", tmp_path)


@pytest.mark.parametrize("kind", KINDS)
def test_opens_racing_a_writer_that_commits_over_and_over_see_each_shard_old_or_new(
    tmp_path: Path, kind: str
) -> None:
    write(kind, tmp_path, OLD)
    done = threading.Event()

    def rewrite() -> None:
        for round_ in range(40):
            write(kind, tmp_path, NEW if round_ % 2 == 0 else OLD)
        done.set()

    writer = threading.Thread(target=rewrite)
    writer.start()
    opens = reads = 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", StaleWriteWarning)
            while not done.is_set() or not opens:
                writing = not done.is_set()
                try:
                    with storage(kind, tmp_path).sync_reader() as reader:
                        for shard in range(3):  # a commit is atomic per shard, not per dataset
                            try:
                                got = read_shard(kind, reader, shard)
                            except DatasetChangedError:
                                continue  # replaced between this open and the shard's read
                            assert got in (
                                expected(kind, {0: OLD[shard]}),
                                expected(kind, {0: NEW[shard]}),
                            )
                            reads += 1
                except DatasetChangedError as error:
                    # the open itself: a commit landed in every one of its listings, which
                    # a writer committing back to back can do for as long as the machine
                    # lets it run; only while it writes, and saying so
                    assert writing, error
                    assert "a writer is committing to this dataset" in str(error)
                    continue
                opens += 1
    finally:
        writer.join()
    assert reads > 0


# A reader open while the dataset is rewritten ---------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS, ids=repr)
@pytest.mark.parametrize("kind", KINDS)
def test_an_open_reader_reads_the_old_version_or_says_the_dataset_was_replaced(
    tmp_path: Path, kind: str, backend: Any
) -> None:
    write(kind, tmp_path, OLD)
    store = storage(kind, tmp_path)
    store.read_interface = backend
    with store.sync_reader() as reader:
        assert read_shard(kind, reader, 0) == expected(kind, {0: OLD[0]})  # shard 0 open
        write(kind, tmp_path, NEW)
        assert read_shard(kind, reader, 0) == expected(kind, {0: OLD[0]})  # still the old
        for shard in (1, 2):  # opened after the rewrite: never the new bytes
            with pytest.raises(DatasetChangedError, match=f"shard 000000{shard} of .*replaced"):
                read_shard(kind, reader, shard)
        assert reader.total_length == len(expected(kind, OLD))
    assert read(kind, tmp_path, backend) == expected(kind, NEW)  # a new reader: the new one


@pytest.mark.parametrize("backend", [PosixPreadIO(), SeekIO()], ids=repr)
@pytest.mark.parametrize("kind", KINDS)
def test_a_descriptor_reopened_by_the_lru_after_a_rewrite_is_refused(
    tmp_path: Path, kind: str, backend: Any
) -> None:
    write(kind, tmp_path, OLD)
    store = storage(kind, tmp_path)
    store.read_interface = backend
    with store.sync_reader() as reader:
        for files in reader._files.values():  # one descriptor per file kind: evict at once
            files.max_open, files._never_evicts = 1, False
        for shard in range(3):
            assert read_shard(kind, reader, shard) == expected(kind, {0: OLD[shard]})
        write(kind, tmp_path, NEW)
        assert read_shard(kind, reader, 2) == expected(kind, {0: OLD[2]})  # still open
        with pytest.raises(DatasetChangedError, match="Open the dataset again"):
            read_shard(kind, reader, 0)  # closed by the LRU, reopened: another file now


@pytest.mark.filterwarnings("ignore:this writer of .* remain above it:UserWarning")
def test_a_reader_of_a_shard_being_rolled_forward_follows_its_file_to_the_canonical_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from guideloom_pipes.storage import commit

    write("stream", tmp_path, OLD)
    readers: list[Any] = []

    def fault(step: str, target: str) -> None:  # open a reader while the record names .v2
        if step == "link" and not readers:
            reader = storage("stream", tmp_path).sync_reader()
            reader.open()
            readers.append(reader)

    monkeypatch.setattr(commit, "_fault", fault)
    write("stream", tmp_path, {0: NEW[0]})
    monkeypatch.undo()
    with readers[0] as reader:  # its shard 0 file is now only at the canonical name
        assert read_shard("stream", reader, 0) == NEW[0]
        assert read_shard("stream", reader, 1) == OLD[1]


@pytest.mark.filterwarnings("ignore:this writer of .* remain above it:UserWarning")
def test_a_loader_running_while_the_dataset_is_rewritten_delivers_only_old_samples(
    tmp_path: Path,
) -> None:
    pytest.importorskip("torch")
    from guideloom_pipes import StatefulDataLoader

    length = 4
    old = {k: list(range(k * 1000, k * 1000 + 40)) for k in range(6)}
    write("stream", tmp_path, old)
    stream = [v for k in sorted(old) for v in old[k]]
    dataset = StreamDataset(storage("stream", tmp_path), length)
    loader = StatefulDataLoader(
        dataset,
        lambda samples: [np.asarray(s["tokens"]).tolist() for s in samples],
        local_batch_size=3,
        num_workers=2,
        parallel_method="thread",
        prefetch=1,
    )
    delivered, refused = 0, False
    try:
        with loader:
            for number, batch in enumerate(loader):
                if number == 0:
                    write("stream", tmp_path, {k: [-1] * 13 for k in range(3)})  # fewer
                for sample in batch:
                    position = delivered * length
                    assert sample == stream[position : position + length]
                    delivered += 1
    except DatasetChangedError as error:
        assert "replaced" in str(error)
        refused = True
    assert delivered >= 3
    assert refused or delivered == len(stream) // length


# verify while a writer commits ------------------------------------------------------------


def listed(kind: str, path: Path) -> Any:
    """The listing an open of ``path`` takes now."""
    store = storage(kind, path)
    return listing.discover(store._resolve_io(), store.dir, store.suffixes)


def verify_with_listings(
    monkeypatch: pytest.MonkeyPatch, path: Path, listings: list[Any], *args: str
) -> int:
    """``guideloom-pipes verify path``, its first listings being ``listings`` (taken
    earlier, as a verify that listed just before a writer's commit would have)."""

    real = cli_verify.discover
    monkeypatch.setattr(
        cli_verify, "discover", lambda *a: listings.pop(0) if listings else real(*a)
    )
    return main(["verify", str(path), *args])


@pytest.mark.listing  # states what an open that lists the directory does
@pytest.mark.filterwarnings("ignore:this writer of .* remain above it:UserWarning")
@pytest.mark.parametrize("kind", KINDS)
def test_verify_listing_just_before_a_writer_recommits_checks_the_new_version_and_exits_0(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    write(kind, tmp_path, OLD)
    before = listed(kind, tmp_path)
    write(kind, tmp_path, {1: NEW[1]})  # committed between verify's listing and its reads
    assert verify_with_listings(monkeypatch, tmp_path, [before]) == 0
    out = capsys.readouterr().out
    assert "problem:" not in out and out.startswith("sound: 3 shards")


@pytest.mark.listing  # states what an open that lists the directory does
@pytest.mark.filterwarnings("ignore:this writer of .* remain above it:UserWarning")
@pytest.mark.parametrize("kind", KINDS)
def test_verify_listing_a_commit_before_it_rolled_forward_reads_the_files_it_listed(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:

    write(kind, tmp_path, OLD)
    during: list[Any] = []

    def fault(step: str, target: str) -> None:  # the record names 0000001.v2.*: list now
        if step == "link" and not during:
            during.append(listed(kind, tmp_path))

    monkeypatch.setattr(commit, "_fault", fault)
    write(kind, tmp_path, {1: NEW[1]})  # then the commit finishes: the .v2 names are gone
    monkeypatch.undo()
    assert ".v2." in during[0].file_name(1, storage(kind, tmp_path).suffixes[0])
    assert verify_with_listings(monkeypatch, tmp_path, during) == 0
    assert capsys.readouterr().out.startswith("sound: 3 shards, ")


@pytest.mark.filterwarnings("ignore:this writer of .* remain above it:UserWarning")
def test_verify_says_a_writer_is_committing_when_a_shard_changes_at_every_listing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:

    write("stream", tmp_path, OLD)
    real = cli_verify.discover
    versions = [NEW, OLD]

    def discover(*args: Any) -> Any:
        found = real(*args)
        versions.reverse()
        write("stream", tmp_path, {1: versions[0][1]})  # recommitted after every listing
        return found

    monkeypatch.setattr(cli_verify, "discover", discover)
    assert main(["verify", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "problem:" not in out
    assert "note: shard(s) 0000001 were recommitted by a writer each time verify read" in out
    assert "a writer is committing to this dataset right now" in out
    assert "no problems found, but not every shard could be verified" in out
    assert main(["verify", str(tmp_path), "--strict"]) == 1


@pytest.mark.filterwarnings("ignore:this writer of .* remain above it:UserWarning")
def test_verify_that_cannot_list_while_a_writer_commits_says_so_and_does_not_fail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    write("stream", tmp_path, OLD)
    real = listing._read_local
    versions = [NEW, OLD]

    held: list[Any] = []  # the replaced files stay open: their inode numbers are not reused

    def read_local(path: str) -> bytes:
        versions.reverse()
        held.extend(open(f, "rb") for f in tmp_path.iterdir() if f.is_file())  # noqa: SIM115
        write("stream", tmp_path, {1: versions[0][1]})  # a commit in every listing
        return real(path)

    monkeypatch.setattr(listing, "_read_local", read_local)
    monkeypatch.setattr(listing.time, "sleep", lambda seconds: None)
    try:
        assert main(["verify", str(tmp_path)]) == 0
    finally:
        for file in held:
            file.close()
    out = capsys.readouterr().out
    assert "problem:" not in out
    assert "a writer is committing to this dataset right now" in out
    assert "nothing was verified" in out
    assert main(["verify", str(tmp_path), "--strict"]) == 1


@pytest.mark.listing  # states what an open that lists the directory does
@pytest.mark.filterwarnings("ignore:this writer of .* remain above it:UserWarning")
def test_storage_verify_checks_a_shard_recommitted_after_its_listing_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:

    write("stream", tmp_path, OLD)
    stale = [listed("stream", tmp_path)]
    write("stream", tmp_path, {1: NEW[1]})
    real = base.discover
    monkeypatch.setattr(base, "discover", lambda *a: stale.pop(0) if stale else real(*a))
    with (
        storage("stream", tmp_path).sync_reader() as reader,  # the stale listing
        pytest.raises(DatasetChangedError, match=r"shard\(s\) 0000001 .* recommitted"),
    ):
        reader.verify()  # its version is gone: not a checksum mismatch
    stale.append(listed("stream", tmp_path))
    write("stream", tmp_path, {1: OLD[1]})
    assert storage("stream", tmp_path).verify()["shards"] == 3  # listed again, sound


REWRITER = """
import os, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from shard_kinds import write
path, stop = Path({path!r}), {stop!r}
for round_ in range(100_000):
    write("stream", path, {{1: range(round_ % 7 * 100, round_ % 7 * 100 + 100)}})
    if round_ == 0:
        print("ready", flush=True)
    if os.path.exists(stop):
        break
"""


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_verify_while_another_process_recommits_a_shard_never_fails_a_sound_dataset(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:

    tests = Path(__file__).resolve().parents[1]
    data, stop = tmp_path / "data", tmp_path / "stop"
    # 16 MB in shard 0, so that each verify checksums for a while before it reaches shard 1,
    # which the other process recommits (same size, new bytes) as fast as it can
    write("stream", data, {0: range(4_000_000), 1: OLD[1], 2: OLD[2]})
    child = subprocess.Popen(
        [sys.executable, "-c", REWRITER.format(tests=str(tests), path=str(data), stop=str(stop))],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tests.parent)},
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        statuses = [main(["verify", str(data)]) for _ in range(30)]
        out = capsys.readouterr().out
    finally:
        stop.touch()
        child.wait(60)
    assert "problem:" not in out
    assert statuses == [0] * 30


@pytest.mark.parametrize("backend", BACKENDS, ids=repr)
def test_a_shard_replaced_between_its_check_and_its_open_is_refused(
    tmp_path: Path, backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer may replace a shard's file after a reader checked the path and before it
    opened it: the file the reader opened is compared with the one the open listed, and
    refused, never read as the old version."""
    write("stream", tmp_path, OLD)
    store = storage("stream", tmp_path)
    store.read_interface = backend
    with store.sync_reader() as reader:
        resolved = type(reader._files[".in_band.bin"].backend)
        real = resolved.reader

        def replaced_first(self: Any, path: Any) -> Any:
            opened = real(self, path)
            original = opened.open

            def open_after_a_rewrite() -> None:
                stand_in = Path(f"{path}.new")
                stand_in.write_bytes(Path(path).read_bytes()[::-1])  # the same size
                os.replace(stand_in, path)
                original()

            opened.open = open_after_a_rewrite
            return opened

        monkeypatch.setattr(resolved, "reader", replaced_first)
        with pytest.raises(DatasetChangedError, match=r"shard 0000001 of .*replaced"):
            read_shard("stream", reader, 1)
