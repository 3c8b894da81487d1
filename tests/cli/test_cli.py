"""The ``guideloom-pipes`` command line, run as a user runs it (a subprocess): exit statuses
and output for a sound dataset, GuideLoom-written fixtures, and each corruption the readers
refuse (gap, truncation, wrong dtype, half-written shard, checksum mismatch)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from remote_servers import fault_proxy, need_modules, nginx_server

from guideloom_pipes import (
    DocumentPickleFormat,
    DocumentStorage,
    StreamNumpyFormat,
    StreamStorage,
)

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "data" / "guideloom-1.1"
DTYPE = np.dtype([("tokens", "<i4")])


def cli(*args: object, path: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [path, str(ROOT)]))}
    return subprocess.run(
        [sys.executable, "-m", "guideloom_pipes", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def _write(path: Path, shards: int = 3, dtype: np.dtype = DTYPE) -> Path:
    with StreamStorage(path, StreamNumpyFormat(dtype)).sync_writer() as writer:
        for shard in range(shards):
            writer.append(shard, {"tokens": np.arange(100 * shard, 100 * shard + 100)})
    return path


@pytest.fixture
def sound(tmp_path: Path) -> Path:
    return _write(tmp_path / "tokens")


def _one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


# --- a sound dataset ---------------------------------------------------------------------------


def test_info_describes_a_sound_stream(sound: Path) -> None:
    done = cli("info", sound, "--sequence-length", 16)
    assert done.returncode == 0, done.stderr
    assert "kind:      stream (StreamStorage), written by guideloom_pipes" in done.stdout
    assert "shards:    3" in done.stdout
    assert "elements:  300" in done.stdout
    assert "samples:   18 (sequence length 16)" in done.stdout
    assert "0000002  committed" in done.stdout


def test_info_json_is_one_object_for_scripts(sound: Path) -> None:
    facts = json.loads(cli("info", sound, "--json", "-L", 10).stdout)
    assert facts["kind"] == "stream"
    assert facts["dtype"] == [["tokens", "<i4"]]
    assert (facts["shards"], facts["elements"], facts["samples"]) == (3, 300, 30)
    assert facts["bytes"] == 1200
    assert [s["state"] for s in facts["shard_list"]] == ["committed"] * 3


def test_info_of_documents_counts_documents(tmp_path: Path) -> None:
    with DocumentStorage(tmp_path, DocumentPickleFormat()).sync_writer() as writer:
        for i in range(5):
            writer.append(i % 2, {"id": i})
    facts = json.loads(cli("info", tmp_path, "--json").stdout)
    assert (facts["kind"], facts["format"], facts["documents"]) == (
        "document",
        "DocumentPickleFormat",
        5,
    )


def test_verify_of_a_sound_dataset_exits_0(sound: Path) -> None:
    done = cli("verify", sound)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith("sound: 3 shards, 3 files")


def test_verify_json_reports_what_it_checked(sound: Path) -> None:
    report = json.loads(cli("verify", sound, "--json").stdout)
    assert report["sound"] and report["checksummed"]
    assert (report["files"], report["bytes"], report["exit_status"]) == (3, 1200, 0)


def test_verify_shows_progress_as_plain_lines_without_tqdm(sound: Path, tmp_path: Path) -> None:
    blocked = tmp_path / "no-tqdm"
    (blocked / "tqdm").mkdir(parents=True)
    (blocked / "tqdm" / "__init__.py").write_text("raise ImportError('tqdm blocked')\n")
    done = cli("verify", sound, "--progress", "always", path=str(blocked))
    assert done.returncode == 0
    assert "verifying done: 1.2 KiB of 1.2 KiB (100%)" in done.stderr


def test_verify_shows_a_tqdm_bar_when_tqdm_is_installed(sound: Path) -> None:
    pytest.importorskip("tqdm")
    done = cli("verify", sound, "--progress", "always")
    assert done.returncode == 0
    assert "verifying: 100%" in done.stderr


def test_verify_shows_no_progress_on_a_small_dataset_by_default(sound: Path) -> None:
    assert "verifying" not in cli("verify", sound).stderr


def test_head_prints_the_first_samples_one_line_each(sound: Path) -> None:
    done = cli("head", sound, "-n", 2, "--sequence-length", 3)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["0\ttokens=[0,1,2]", "1\ttokens=[3,4,5]"]


def test_head_defaults_to_5_samples_and_json_is_one_object_a_line(sound: Path) -> None:
    lines = cli("head", sound, "--json", "-L", 2).stdout.splitlines()
    assert [json.loads(line) for line in lines] == [
        {"index": i, "tokens": [2 * i, 2 * i + 1]} for i in range(5)
    ]


def test_head_with_a_sequence_length_longer_than_the_data_is_exit_2_naming_both(
    sound: Path,
) -> None:
    done = cli("head", sound, "-L", 1000)
    assert done.returncode == 2
    line = _one_line_error(done)
    assert "--sequence-length 1000" in line and "300 elements" in line
    assert "pass -L 300 or less" in line
    assert cli("head", sound, "-L", 300).stdout.count("\n") == 1


def _documents(path: Path, *documents: object) -> Path:
    with DocumentStorage(path, DocumentPickleFormat()).sync_writer() as writer:
        for document in documents:
            writer.append(0, document)
    return path


def test_head_cuts_long_fields_at_200_characters_saying_how_many_were_cut(
    tmp_path: Path,
) -> None:
    path = _documents(tmp_path / "docs", "x" * 75_874, {"ids": list(range(1000)), "n": 3})
    first, second = cli("head", path).stdout.splitlines()
    assert first == "0\tvalue=" + "x" * 200 + "...[75,674 more characters; --full shows all]"
    ids = json.dumps(list(range(1000)), separators=(",", ":"))
    assert second == (
        f"1\tids={ids[:200]}...[{len(ids) - 200:,} more characters; --full shows all]\tn=3"
    )
    full = cli("head", path, "--full").stdout.splitlines()
    assert full == ["0\tvalue=" + "x" * 75_874, f"1\tids={ids}\tn=3"]
    whole = [json.loads(line) for line in cli("head", path, "--json").stdout.splitlines()]
    assert whole[0]["value"] == "x" * 75_874 and whole[1]["ids"] == list(range(1000))


def test_head_prints_text_documents_as_text_on_one_line(tmp_path: Path) -> None:
    path = _documents(tmp_path / "docs", "héllo\twörld\nline 2 \\ end", {"text": "naïve"})
    assert cli("head", path).stdout.splitlines() == [
        "0\tvalue=héllo\\twörld\\nline 2 \\\\ end",
        "1\ttext=naïve",
    ]


def test_the_console_script_runs_the_same_command_line(sound: Path) -> None:
    script = shutil.which("guideloom-pipes", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("the package is not installed (pip install -e .)")
    done = subprocess.run([script, "info", str(sound), "--json"], capture_output=True, text=True)
    assert json.loads(done.stdout)["shards"] == 3


# --- GuideLoom-written data (no commit records) ------------------------------------------------


def test_info_of_guideloom_data_without_dtype_says_to_pass_it_and_exits_0() -> None:
    done = cli("info", FIXTURES / "stream")
    assert done.returncode == 0
    assert "written by GuideLoom (no commit records)" in done.stdout
    assert "dtype unknown: pass --dtype" in done.stdout
    assert "shards:    3" in done.stdout
    assert "bytes:     550" in done.stdout


def test_info_of_guideloom_data_with_dtype_counts_elements_and_samples() -> None:
    dtype = "tokens:int32,loss_mask:uint8"
    facts = json.loads(cli("info", FIXTURES / "stream", "--dtype", dtype, "-L", 5, "--json").stdout)
    assert (facts["elements"], facts["samples"]) == (37 + 50 + 23, 22)


def test_head_of_guideloom_data_needs_dtype_exit_2() -> None:
    done = cli("head", FIXTURES / "stream")
    assert done.returncode == 2
    assert "pass --dtype" in _one_line_error(done)


def test_head_of_guideloom_data_with_dtype_decodes_its_fields() -> None:
    expected = json.loads((FIXTURES / "expected.json").read_text())["stream"]["windows"]["1"]
    done = cli("head", FIXTURES / "stream", "--dtype", "tokens:int32,loss_mask:uint8", "-L", 1)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[1] == (
        f"1\ttokens={expected[1]['tokens']}\tloss_mask={expected[1]['loss_mask']}".replace(" ", "")
    )


def test_head_of_guideloom_documents_unpickles_them() -> None:
    done = cli("head", FIXTURES / "document", "-n", 2, "--json")
    assert [json.loads(line)["id"] for line in done.stdout.splitlines()] == [0, 1]


def test_head_of_a_guideloom_stream_with_metadata_shows_the_payloads() -> None:
    done = cli("head", FIXTURES / "stream_meta", "--dtype", "int32", "-n", 1, "-L", 4, "--json")
    sample = json.loads(done.stdout)
    assert sample["tokens"] == [0, 1, 2, 3]
    assert sample["payloads"] == ["doc:0/chunk:0", "doc:1/chunk:0"]


@pytest.mark.parametrize("kind", ["stream", "document", "stream_meta"])
def test_verify_of_guideloom_data_checks_what_it_can_and_exits_0(kind: str) -> None:
    done = cli("verify", FIXTURES / kind)
    assert done.returncode == 0, done.stdout
    assert "no commit records: no checksums" in done.stdout


def test_verify_strict_of_guideloom_data_exits_1() -> None:
    assert cli("verify", FIXTURES / "document", "--strict").returncode == 1


def test_a_kind_the_files_do_not_have_is_refused_for_recorded_data(sound: Path) -> None:
    done = cli("info", sound, "--kind", "document")
    assert done.returncode == 2
    assert "pass --kind stream" in _one_line_error(done)


# --- corruptions the readers refuse ------------------------------------------------------------


def _problems(done: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in done.stdout.splitlines() if line.startswith("problem: ")]


def test_verify_reports_a_gap(sound: Path) -> None:
    for path in sound.glob("0000001.*"):
        path.unlink()
    done = cli("verify", sound)
    assert done.returncode == 1
    (problem,) = _problems(done)
    assert "shard 0000001 is missing" in problem and "Rewrite the missing shard" in problem


def test_verify_reports_a_truncated_file(sound: Path) -> None:
    path = sound / "0000001.in_band.bin"
    path.write_bytes(path.read_bytes()[:-4])
    done = cli("verify", sound)
    assert done.returncode == 1
    (problem,) = _problems(done)
    assert "0000001.in_band.bin" in problem and "truncated" in problem
    assert "rewrite shard 1" in problem


def _copy_in_shard_1(sound: Path, elsewhere: Path, dtype: str) -> None:
    """Shard 1 of ``sound`` replaced by a shard of ``dtype`` written elsewhere and copied in
    by hand (a writer refuses to mix dtypes)."""
    other = StreamStorage(elsewhere, StreamNumpyFormat(np.dtype([("tokens", dtype)])))
    with other.sync_writer() as writer:
        writer.append(1, {"tokens": np.arange(10, dtype=dtype)})
    for name in ("0000001.in_band.bin", "0000001.shard.json"):
        shutil.copy(elsewhere / name, sound / name)


def test_verify_reports_a_shard_of_another_dtype(sound: Path, tmp_path: Path) -> None:
    _copy_in_shard_1(sound, tmp_path / "other", "<i2")
    done = cli("verify", sound)
    assert done.returncode == 1
    (problem,) = _problems(done)
    assert "shard 0000001" in problem and "was written with dtype" in problem


def test_verify_reports_a_half_written_shard(sound: Path) -> None:
    (sound / "0000002.shard.json").unlink()  # its data is there, its commit never happened
    done = cli("verify", sound)
    assert done.returncode == 1
    (problem,) = _problems(done)
    assert "shard 0000002" in problem and "no commit record" in problem
    assert "Rewrite shard 2" in problem


def test_verify_reports_a_checksum_mismatch(sound: Path) -> None:
    path = sound / "0000000.in_band.bin"
    data = bytearray(path.read_bytes())
    data[5] ^= 0xFF
    path.write_bytes(bytes(data))
    done = cli("verify", sound)
    assert done.returncode == 1
    (problem,) = _problems(done)
    assert "0000000.in_band.bin fails its checksum" in problem
    assert "rewrite shard 0" in problem


def test_verify_reports_every_bad_shard_on_its_own_line(sound: Path) -> None:
    for shard in (0, 2):
        path = sound / f"{shard:07d}.in_band.bin"
        data = bytearray(path.read_bytes())
        data[0] ^= 1
        path.write_bytes(bytes(data))
    (sound / "0000001.in_band.bin").write_bytes(b"")
    report = json.loads(cli("verify", sound, "--json").stdout)
    assert sorted(p["shard"] for p in report["problems"]) == [0, 1, 2]
    assert report["exit_status"] == 1


def test_info_of_a_dataset_mixing_dtypes_exits_1_and_names_the_shards_that_differ(
    sound: Path, tmp_path: Path
) -> None:
    _copy_in_shard_1(sound, tmp_path / "other", "<u2")
    done = cli("info", sound)
    assert done.returncode == 1, done.stdout
    assert "mixed:     the shards' commit records name different kinds or dtypes" in done.stdout
    assert '  shards 0000000, 0000002: stream [["tokens", "<i4"]]' in done.stdout
    assert '  shards 0000001: stream [["tokens", "<u2"]]' in done.stdout
    facts = json.loads(cli("info", sound, "--json").stdout)
    assert [(g["dtype"], g["shards"]) for g in facts["mixed"]] == [
        ([["tokens", "<i4"]], [0, 2]),
        ([["tokens", "<u2"]], [1]),
    ]
    assert cli("info", _write(tmp_path / "one_dtype"), "--json").returncode == 0


def test_info_still_describes_a_damaged_dataset(sound: Path) -> None:
    (sound / "0000002.shard.json").unlink()
    facts = json.loads(cli("info", sound, "--json").stdout)
    assert [s["state"] for s in facts["shard_list"]] == ["committed", "committed", "uncommitted"]


# --- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["info", "verify", "head", "recover"])
def test_a_missing_path_is_exit_2_with_one_line_naming_it(tmp_path: Path, command: str) -> None:
    done = cli(command, tmp_path / "nope")
    assert done.returncode == 2
    line = _one_line_error(done)
    assert str(tmp_path / "nope") in line and "does not exist" in line


@pytest.mark.parametrize("command", ["info", "verify", "head", "recover"])
@pytest.mark.parametrize("holding", ["nothing", "other files"])
def test_a_directory_that_is_not_a_dataset_is_exit_2(
    tmp_path: Path, command: str, holding: str
) -> None:
    if holding == "other files":
        (tmp_path / "notes.txt").write_text("x")
        (tmp_path / "sub").mkdir()
    done = cli(command, tmp_path)
    assert done.returncode == 2
    assert "is not a dataset" in _one_line_error(done)
    assert sorted(p.name for p in tmp_path.iterdir()) == (
        [] if holding == "nothing" else ["notes.txt", "sub"]
    )


def test_recover_of_a_directory_with_only_a_dead_writers_files_cleans_it(tmp_path: Path) -> None:
    (tmp_path / "0000000.in_band.bin.tmp").write_bytes(b"half")
    done = cli("recover", tmp_path, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["cleaned"] == [0]


@pytest.mark.parametrize(
    "args",
    [
        ("info", "http://127.0.0.1:1/data"),
        ("info", "s3://bucket/data"),
        ("recover", "http://127.0.0.1:1/data"),
        ("head", "http://127.0.0.1:1/data", "--dtype", "int33"),
        # an unknown protocol is known as one only where fsspec is installed (without it
        # every URL is the missing dependency's error, exit 1, which says what to install)
        pytest.param(
            ("verify", "nosuch://bucket/data", "--kind", "stream"),
            marks=pytest.mark.skipif(
                importlib.util.find_spec("fsspec") is None, reason="needs fsspec"
            ),
        ),
    ],
)
def test_usage_errors_on_a_url_are_exit_2_before_anything_is_read(args: tuple[str, ...]) -> None:
    """Nothing listens on port 1: a command that read the URL would retry for seconds and
    exit 1 with a network error; a usage error is refused first."""
    done = cli(*args)
    assert done.returncode == 2, done.stderr
    line = _one_line_error(done)
    assert "transient" not in line and "with --kind" not in line
    assert args[1] in line or "--dtype 'int33'" in line


@pytest.mark.remote
@pytest.mark.parametrize("command", ["info", "recover"])
def test_info_and_recover_of_a_url_are_exit_2_without_asking_a_failing_server(
    sound: Path, tmp_path: Path, command: str
) -> None:
    """nginx serves the dataset behind a proxy that answers 503 to every request: reading
    it would retry for seconds, then exit 1. The command cannot read a URL at all, so it
    is refused with exit 2 and the server is never asked."""
    need_modules("aiohttp")
    (tmp_path / "nginx").mkdir()
    with nginx_server(tmp_path / "nginx") as http:
        shutil.copytree(sound, http.root / "tokens")
        with fault_proxy(http.port, lambda n: "503") as proxy:
            done = cli(command, f"{proxy.url}/tokens")
            assert done.returncode == 2, done.stderr
            assert "is a URL" in _one_line_error(done)
            assert proxy.log == []


def test_verify_lists_the_entries_it_ignored_and_stays_sound(sound: Path) -> None:
    (sound / "notes.txt").write_text("about this data")
    (sound / ".DS_Store").write_bytes(b"\0")
    (sound / "sub").mkdir()
    (sound / "0000000.out_of_band.bin").write_bytes(b"")  # a file of another kind
    (sound / ".guideloom_pipes-create.lock").write_bytes(b"")  # ours: a killed create run's
    done = cli("verify", sound)
    assert done.returncode == 0, done.stdout
    assert (
        "note: ignored 4 entries that are not shard files of this dataset (readers ignore "
        "them too): .DS_Store, 0000000.out_of_band.bin, notes.txt, sub/"
    ) in done.stdout.splitlines()
    assert done.stdout.splitlines()[-1].startswith("sound: 3 shards")
    report = json.loads(cli("verify", sound, "--json").stdout)
    assert report["ignored"] == [".DS_Store", "0000000.out_of_band.bin", "notes.txt", "sub/"]
    assert report["exit_status"] == 0 and report["sound"]
    assert (
        json.loads(cli("verify", _write(sound.parent / "clean"), "--json").stdout)["ignored"] == []
    )


def test_bad_usage_is_exit_2_with_one_line() -> None:
    done = cli("info")
    assert done.returncode == 2
    assert "DIR" in _one_line_error(done)
    assert cli("frobnicate", ".").returncode == 2


def test_a_bad_dtype_is_exit_2_naming_the_fix() -> None:
    done = cli("head", FIXTURES / "stream", "--dtype", "int33")
    assert done.returncode == 2
    assert "--dtype int32" in _one_line_error(done)


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    done = cli("info", tmp_path / "nope", "--debug")
    assert done.returncode == 2
    assert "Traceback" in done.stderr


# --- recover -----------------------------------------------------------------------------------


def test_recover_removes_what_a_dead_writer_left_and_keeps_committed_data(sound: Path) -> None:
    stale = sound / "0000001.in_band.bin.tmp"
    stale.write_bytes(b"half")
    (sound / "0000001.shard.json.tmp").write_bytes(b"")  # its lock, no longer held
    before = {
        p.name: p.read_bytes()
        for p in sound.glob("*")
        if p.is_file() and not p.name.endswith(".tmp")
    }
    dry = cli("recover", sound, "--dry-run")
    assert dry.returncode == 0
    assert "shard 0000001: would remove its temporary files" in dry.stdout
    assert stale.exists()
    done = cli("recover", sound, "--json")
    assert json.loads(done.stdout)["cleaned"] == [1]
    assert not stale.exists()
    after = {p.name: p.read_bytes() for p in sound.glob("*") if p.is_file()}
    assert after == before
    assert cli("recover", sound).stdout.strip() == f"nothing to recover in {sound}"


def test_recover_leaves_a_shard_a_live_writer_holds(sound: Path) -> None:
    writer = StreamStorage(sound, StreamNumpyFormat(DTYPE)).sync_writer()
    try:
        writer.append(1, {"tokens": np.arange(3)})  # holds shard 1's lock, has a .tmp file
        done = cli("recover", sound, "--json")
        assert json.loads(done.stdout)["held"] == [1]
        assert (sound / "0000001.in_band.bin.tmp").exists()
    finally:
        writer.abort()


def test_a_stream_with_metadata_of_ours_verifies_and_shows_its_payloads(tmp_path: Path) -> None:
    from guideloom_pipes import StreamWithMetaStorage
    from tests.storage_formats import ChunkMetaFormat

    with StreamWithMetaStorage(tmp_path, ChunkMetaFormat()).sync_writer() as writer:
        writer.append(0, {"doc": 0, "tokens": [1, 2, 3], "chunk_ids": [0, 0, 1]})
        writer.append(1, {"doc": 1, "tokens": [4, 5], "chunk_ids": [0, 0]})
    assert cli("verify", tmp_path).returncode == 0
    facts = json.loads(cli("info", tmp_path, "--json").stdout)
    assert (facts["kind"], facts["elements"], facts["payloads"]) == ("stream_meta", 5, 3)
    sample = json.loads(cli("head", tmp_path, "-L", 3, "-n", 1, "--json").stdout)
    assert sample["tokens"] == [1, 2, 3]
    assert sample["payloads"] == ["doc:0/chunk:0", "doc:0/chunk:1"]


def test_the_command_line_never_imports_torch(sound: Path) -> None:
    code = (
        "import sys\n"
        "from guideloom_pipes.cli import main\n"
        f"for command in ('info', 'verify', 'head'):\n"
        f"    assert main([command, {str(sound)!r}]) == 0\n"
        "assert 'torch' not in sys.modules, 'the CLI imported torch'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
