"""The ``guideloom-pipes`` command line (also ``python -m guideloom_pipes``): the argument
parser of ``info``, ``verify``, ``head``, ``recover``, ``index`` and ``convert``, and the exit
statuses.
An error is one line on stderr naming the path and the fix, never a traceback unless ``--debug``:
exit status 2 for bad usage or a path that is missing or not a dataset, 1 for a dataset
that is not sound (or another failure), 0 otherwise."""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from guideloom_pipes.cli import convert, head, index, info, recover, verify
from guideloom_pipes.cli.dataset import KINDS, UsageError
from guideloom_pipes.parallel.converting import DEFAULT_SHARD_DOCUMENTS, DEFAULT_SHARD_TOKENS

#: exit statuses
OK, NOT_SOUND, USAGE = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see {self.prog} --help)")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command."""
    parser = _Parser(
        prog="guideloom-pipes",
        description="Look inside, check and repair guideloom_pipes / GuideLoom 1.1 datasets.",
        epilog="exit status: 0 ok, 1 dataset not sound (or another failure), 2 bad usage or "
        "a path that is missing or not a dataset",
    )
    common = _Parser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    common.add_argument("--json", action="store_true", help="machine-readable output")
    typed = _Parser(add_help=False)
    typed.add_argument(
        "--dtype",
        help="stream dtype of data without commit records (GuideLoom's): int32, "
        "tokens:int32,loss_mask:uint8, or a JSON field list",
    )
    typed.add_argument("--kind", choices=KINDS, help="the kind of dataset (default: detected)")
    typed.add_argument(
        "--column",
        help="the column of a Parquet table to read (default: input_ids or tokens, a list of "
        "integers; else text, a string)",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.required = True
    _add_info(commands, [common, typed])
    _add_verify(commands, [common, typed])
    _add_head(commands, [common, typed])
    _add_recover(commands, [common])
    _add_index(commands, [common, typed])
    _add_convert(commands, [common])
    return parser


def _add_info(commands: Any, parents: list[argparse.ArgumentParser]) -> None:
    """The ``info`` command: what a dataset holds."""
    p = commands.add_parser(
        "info",
        parents=parents,
        help="what a dataset holds",
        description="Kind, format, dtype, shards, elements or documents, bytes, and the "
        "commit state of each shard.",
    )
    p.add_argument("path", metavar="DIR")
    p.add_argument("--sequence-length", "-L", type=_positive, help="also count samples of L")
    p.set_defaults(run=info.run)


def _add_verify(commands: Any, parents: list[argparse.ArgumentParser]) -> None:
    """The ``verify`` command: every open check and every checksum."""
    p = commands.add_parser(
        "verify",
        parents=parents,
        help="check a dataset: every open check and every checksum",
        description="Every check a reader makes on open, for every shard, then every file's "
        "CRC-32. Exit status 0 when sound, 1 when not.",
    )
    p.add_argument("path", metavar="DIR")
    p.add_argument(
        "--strict", action="store_true", help="exit 1 on data that has no checksums to verify"
    )
    p.add_argument(
        "--progress",
        choices=("auto", "always", "never"),
        default="auto",
        help="progress on stderr (auto: datasets of 64 MiB and more)",
    )
    p.set_defaults(run=verify.run)


def _add_head(commands: Any, parents: list[argparse.ArgumentParser]) -> None:
    """The ``head`` command: the first samples, decoded."""
    p = commands.add_parser(
        "head",
        parents=parents,
        help="print the first samples",
        description="The first samples, decoded: one line each (index<TAB>field=value).",
    )
    p.add_argument("path", metavar="DIR")
    p.add_argument("-n", type=int, default=5, help="samples to print (default 5)")
    p.add_argument(
        "--sequence-length",
        "-L",
        type=_positive,
        help=f"elements per stream sample (default {head.DEFAULT_SEQUENCE_LENGTH})",
    )
    p.add_argument(
        "--full",
        action="store_true",
        help=f"print every field whole (default: cut at {head.FIELD_CHARACTERS} characters, "
        f"saying how many were cut; --json is always whole)",
    )
    p.set_defaults(run=head.run)


def _add_recover(commands: Any, parents: list[argparse.ArgumentParser]) -> None:
    """The ``recover`` command: clean up after writers that stopped."""
    p = commands.add_parser(
        "recover",
        parents=parents,
        help="clean up after writers that stopped",
        description="Roll interrupted commits forward, finish interrupted removals, remove "
        "temporary files and stale locks, for shards no live writer holds. Committed data is "
        "never touched.",
    )
    p.add_argument("path", metavar="DIR")
    p.add_argument("--dry-run", action="store_true", help="say what would be done, do nothing")
    p.set_defaults(run=recover.run)


def _add_index(commands: Any, parents: list[argparse.ArgumentParser]) -> None:
    """The ``index`` command: write a dataset's manifest."""
    p = commands.add_parser(
        "index",
        parents=parents,
        help="write a dataset's manifest, so that it opens in constant time",
        description="List the dataset directory, make every check an open makes, and write "
        ".guideloom-manifest/manifest.bin: opens then read it instead of listing the "
        "directory and every commit record. For datasets written by GuideLoom or before "
        "manifests, or whose manifest a change by another tool made stale. An object "
        "store's URL (s3://...) is indexed in place, with each file's ETag; for an HTTP(S) "
        "server, index the directory it serves.",
    )
    p.add_argument("path", metavar="DIR|URL")
    p.set_defaults(run=index.run)


def _add_convert(commands: Any, parents: list[argparse.ArgumentParser]) -> None:
    """The ``convert`` command: a corpus written as a dataset of ours."""
    p = commands.add_parser(
        "convert",
        parents=parents,
        help="write a corpus (ours, Megatron, .npy, Parquet tokens or text) as a dataset of ours",
        description="Write SRC (anything info reads: a dataset of ours, a Megatron prefix, .npy "
        "files, Parquet tables of token ids or of text) into DST as a stream of token ids (or "
        "documents, --documents), text tokenized on the way, in parallel. Rerun the same "
        "command to resume: committed shards are skipped.",
    )
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST")
    p.add_argument(
        "--tokenizer", metavar="TOKENIZER_JSON", help="a Hugging Face tokenizer.json (text)"
    )
    p.add_argument(
        "--dtype", help="output token dtype (default: the source's; text: uint16 if it fits)"
    )
    p.add_argument(
        "--eos-id",
        metavar="ID_OR_TOKEN",
        help="appended to each document: a token id, or a token of the tokenizer (</s>)",
    )
    p.add_argument("--documents", action="store_true", help="write documents, not a stream")
    p.add_argument("--column", help="the column of a Parquet table (default: detected)")
    p.add_argument("--workers", type=_positive, help="worker processes (default: one per CPU)")
    p.add_argument(
        "--dask",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="run on a Dask cluster: its scheduler's address, or none for a local one",
    )
    p.add_argument(
        "--shard-documents",
        type=_positive,
        default=DEFAULT_SHARD_DOCUMENTS,
        help=f"most documents per shard (default {DEFAULT_SHARD_DOCUMENTS})",
    )
    p.add_argument(
        "--shard-tokens",
        type=_positive,
        default=DEFAULT_SHARD_TOKENS,
        help=f"most tokens per shard of a stream without documents (default "
        f"{DEFAULT_SHARD_TOKENS})",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress on stderr")
    p.add_argument("--no-resume", action="store_true", help="rewrite every shard")
    p.set_defaults(run=convert.run)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args_list
    try:
        args = build_parser().parse_args(args_list)
        return int(args.run(args))
    except UsageError as error:
        if debug:
            traceback.print_exc()
        print(f"guideloom-pipes: error: {_one_line(error)}", file=sys.stderr)
        return USAGE
    except KeyboardInterrupt:
        print("guideloom-pipes: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `| head` closed the pipe: not an error of ours
        sys.stderr.close()
        return OK
    except Exception as error:
        if debug:
            traceback.print_exc()
        hint = "" if debug else " (rerun with --debug for the traceback)"
        print(
            f"guideloom-pipes: error: {type(error).__name__}: {_one_line(error)}{hint}",
            file=sys.stderr,
        )
        return NOT_SOUND


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
