"""Every ```python block of README.md and docs/ runs, as a new user would run it.

Each block runs alone, in a fresh Python process, in an empty temporary working directory.
An HTML comment on the line before a fence (invisible on GitHub and on the docs site) says
otherwise; several directives may share one comment, separated by ``;``:

``<!-- continues -->``
    the block continues the one before it on the same page: the two run as one script (one
    namespace, one process), as a reader who ran the first would run the second.
``<!-- continues in a new process -->``
    the block runs after the one before it, in the same working directory (its files are
    there) but in a new process: what a restarted program sees (the tutorial's resume).
``<!-- needs: cuda -->``, ``<!-- needs: s3 -->``, ``<!-- needs: dask -->``,
``<!-- needs: megatron -->``, ``<!-- needs: parquet -->``, ``<!-- needs: tokenizers -->``
    the block needs what this machine may not have (a GPU, the ``[dask]`` extra,
    megatron-core, pyarrow, Hugging Face tokenizers); without it
    the block is skipped, and the skip, with its reason, is listed in the test report
    (``-rs``). An ``s3`` block runs against moto's S3 server started here (``docs_s3``),
    its credentials and endpoint in the environment (``AWS_ENDPOINT_URL``, ...).
``<!-- run: torchrun -->``
    the block is a training script: it runs as ``torchrun --standalone --nproc-per-node=2``
    (on CPU).
``<!-- file: train.py -->``
    the block is a file the page tells you to save: it is written into the working directory
    under that name (not run), and joins the chain of the block before it, so that the blocks
    after it can run it (the tutorial's training script).

Bash and other blocks are not run. A chain of blocks joined by ``continues`` is one test,
named after its page and the lines of its first and last block. The script of a chain keeps
each block on its own line numbers (everything else blank), so a traceback's line number is
the Markdown file's.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
_COMMENT = re.compile(r"^\s*<!--(?P<body>.*?)-->\s*$")
_NEEDS = {"cuda", "s3", "dask", "megatron", "parquet", "tokenizers"}
_TORCH_WORDS = re.compile(
    r"\bimport torch\b|\bfrom torch\b|StatefulDataLoader|collate_packed|pad_collate|"
    r"guideloom_pipes\.pipes|\bfrom guideloom_pipes import pipes\b"
)
_TIMEOUT_S = 240
TORCH_FREE = os.environ.get("GUIDELOOM_PIPES_TORCH_FREE") == "1"


@dataclass
class Block:
    page: Path
    first_line: int  # 1-based line of the block's first code line
    code: str
    continues: str | None = None  # None, "namespace" or "process"
    needs: set[str] = field(default_factory=set)
    torchrun: bool = False
    file: str | None = None  # written into the working directory under this name, not run

    @property
    def name(self) -> str:
        return f"{_rel(self.page)}:{self.first_line}"


def _rel(page: Path) -> str:
    return page.relative_to(ROOT).as_posix() if page.is_relative_to(ROOT) else str(page)


def _directives(comment: str, where: str) -> Block:
    block = Block(Path(), 0, "")
    for raw in comment.split(";"):
        directive = " ".join(raw.split())
        if directive == "continues":
            block.continues = "namespace"
        elif directive == "continues in a new process":
            block.continues = "process"
        elif directive.startswith("needs:"):
            need = directive.removeprefix("needs:").strip()
            if need not in _NEEDS:
                raise ValueError(f"{where}: unknown need {need!r} (known: {sorted(_NEEDS)})")
            block.needs.add(need)
        elif directive == "run: torchrun":
            block.torchrun = True
        elif directive.startswith("file:"):
            name = directive.removeprefix("file:").strip()
            if not name or "/" in name or name.startswith("."):
                raise ValueError(f"{where}: 'file:' needs a plain file name, got {name!r}")
            block.file = name
        else:
            raise ValueError(
                f"{where}: unknown directive {directive!r} before a python block (known: "
                "continues, continues in a new process, needs: "
                "cuda|s3|dask|megatron|parquet|tokenizers, run: torchrun, file: NAME)"
            )
    return block


def python_blocks(page: Path) -> list[Block]:
    """The ```python blocks of one Markdown page, with the directives before each."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, indent = match["fence"], match["indent"]
        language = match["info"].strip().split(" ")[0].lower() if match["info"].strip() else ""
        end = i + 1
        while end < len(lines) and not (
            lines[end].strip().startswith(fence) and not lines[end].strip().strip(fence[0])
        ):
            end += 1
        if language in ("python", "py"):
            before = i - 1
            while before >= 0 and not lines[before].strip():
                before -= 1
            comment = _COMMENT.match(lines[before]) if before >= 0 else None
            where = f"{_rel(page)}:{i + 1}"
            block = _directives(comment["body"], where) if comment else Block(Path(), 0, "")
            block.page, block.first_line = page, i + 2
            block.code = "\n".join(
                line[len(indent) :] if line.startswith(indent) else line
                for line in lines[i + 1 : end]
            )
            if block.file and blocks:
                block.continues = block.continues or "process"
            if block.continues and not blocks:
                raise ValueError(f"{where}: the first python block of a page continues nothing")
            blocks.append(block)
        i = end + 1
    return blocks


def chains() -> list[list[Block]]:
    """Blocks grouped into the chains that run together (a block and those continuing it)."""
    out: list[list[Block]] = []
    for page in PAGES:
        for block in python_blocks(page):
            if block.continues:
                out[-1].append(block)
            else:
                out.append([block])
    return out


def _chain_id(chain: list[Block]) -> str:
    first, last = chain[0], chain[-1]
    return first.name if len(chain) == 1 else f"{first.name}-{last.first_line}"


def _script(blocks: list[Block]) -> str:
    """The blocks on their own Markdown line numbers, every other line blank."""
    lines: list[str] = []
    for block in blocks:
        lines.extend([""] * (block.first_line - 1 - len(lines)))
        lines.extend(block.code.splitlines())
    return "\n".join(lines) + "\n"


def _processes(chain: list[Block]) -> list[list[Block]]:
    steps: list[list[Block]] = []
    for block in chain:
        if block.continues == "namespace" and not steps[-1][0].file:
            steps[-1].append(block)
        else:
            steps.append([block])
    return steps


def _skip_reason(chain: list[Block]) -> str | None:
    needs = set().union(*(block.needs for block in chain))
    if TORCH_FREE and any(_TORCH_WORDS.search(block.code) for block in chain):
        return "needs torch (GUIDELOOM_PIPES_TORCH_FREE=1)"
    if "cuda" in needs:
        if importlib.util.find_spec("torch") is None:
            return "needs CUDA (no torch here)"
        import torch

        if not torch.cuda.is_available():
            return "needs CUDA: no CUDA device here (runs in the device check when one is lent)"
    if "dask" in needs and importlib.util.find_spec("distributed") is None:
        return "needs Dask: pip install -e '.[dask]'"
    if "megatron" in needs and importlib.util.find_spec("megatron") is None:
        return "needs megatron-core: pip install -e '.[corpora-test]'"
    if "parquet" in needs and importlib.util.find_spec("pyarrow") is None:
        return "needs pyarrow: pip install -e '.[parquet]'"
    if "tokenizers" in needs and importlib.util.find_spec("tokenizers") is None:
        return "needs tokenizers: pip install -e '.[tokenizers]'"
    return None


@pytest.fixture(scope="session")
def docs_s3() -> Iterator[dict[str, str]]:
    """For ``needs: s3`` blocks: moto's S3 server on loopback holding the bucket the pages
    name, ``my-bucket``, with a token dataset at ``corpora/tokens`` (written through our own
    URL writer); the environment variables that point s3fs at it."""
    import numpy as np
    from remote_servers import moto_server

    from guideloom_pipes import StreamNumpyFormat, StreamStorage

    with moto_server() as server:
        server.filesystem().mkdir("my-bucket")
        storage = StreamStorage(
            "s3://my-bucket/corpora/tokens",
            StreamNumpyFormat(np.dtype([("tokens", "<i4")])),
            storage_options=server.options(),
        )
        with storage.sync_writer() as writer:
            for shard in range(2):
                writer.append(shard, {"tokens": np.arange(shard << 16, (shard + 1) << 16)})
        yield server.environment()


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("GUIDELOOM_PIPES_TORCH_FREE", None)
    return env


_CHAINS = chains()


def test_every_page_is_collected():
    names = {_rel(page) for page in PAGES}
    assert "README.md" in names
    assert any(name.startswith("docs/") for name in names)


def test_directives_join_blocks_and_keep_the_pages_line_numbers(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# t\n\n```python\na = 1\n```\n\n<!-- continues -->\n```python\nb = a\n```\n"
        "<!-- continues in a new process; needs: cuda -->\n\n```python\nc = 2\n```\n"
        "```bash\nls\n```\n",
        encoding="utf-8",
    )
    blocks = python_blocks(page)
    assert [(b.first_line, b.continues, b.needs) for b in blocks] == [
        (4, None, set()),
        (9, "namespace", set()),
        (14, "process", {"cuda"}),
    ]
    script = _script(blocks[:2]).splitlines()
    assert (script[3], script[8]) == ("a = 1", "b = a")
    assert [len(step) for step in _processes(blocks)] == [2, 1]


def test_an_unknown_directive_is_refused(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- continue -->\n```python\npass\n```\n", encoding="utf-8")
    with pytest.raises(ValueError, match="unknown directive 'continue'"):
        python_blocks(page)


#: Chains that take more than 10 s alone (the tutorial tokenizes, trains, is killed and
#: resumes): marked slow, run by ``-m slow``.
_SLOW_PAGES = ("tutorial.md",)
_PARAMS = [
    pytest.param(
        chain,
        id=_chain_id(chain),
        marks=[pytest.mark.slow] if chain[0].page.name in _SLOW_PAGES else [],
    )
    for chain in _CHAINS
]


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("chain", _PARAMS)
def test_python_block_runs(
    chain: list[Block], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    reason = _skip_reason(chain)
    if reason:
        pytest.skip(f"{_chain_id(chain)}: {reason}")
    extra_env = None
    if any("s3" in block.needs for block in chain):
        extra_env = request.getfixturevalue("docs_s3")
    for number, blocks in enumerate(_processes(chain)):
        page = blocks[0].page
        if blocks[0].file:
            (tmp_path / blocks[0].file).write_text(blocks[0].code + "\n", encoding="utf-8")
            continue
        script = tmp_path / f"{page.stem.replace('-', '_')}_md_{number}.py"
        script.write_text(_script(blocks), encoding="utf-8")
        if any(block.torchrun for block in blocks):
            args = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node=2",
                str(script),
            ]
        else:
            args = [sys.executable, str(script)]
        done = subprocess.run(
            args,
            cwd=tmp_path,
            env=_env(extra_env),
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
            check=False,
        )
        lines = ", ".join(str(block.first_line) for block in blocks)
        if done.returncode != 0:
            pytest.fail(
                f"the python block(s) of {page.relative_to(ROOT)} at line(s) {lines} failed (exit "
                f"{done.returncode}); line numbers in the traceback are the page's "
                f"({script.name} line N = line N of the page)\n"
                f"--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-6000:]}",
                pytrace=False,
            )
