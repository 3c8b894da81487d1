"""Test-suite wide settings: the torch-free mode.

The storage, format, dataset and shuffle layers need only numpy, and their tests run on
Pythons without torch (tox envs ``torchfree-py310``/``-py312``/``-py313``). The rule:

* A test module that needs torch or torchdata (directly, or through ``StatefulDataLoader``,
  ``guideloom_pipes.loader`` or ``guideloom_pipes.pipes``) starts with::

      import pytest

      pytest.importorskip("torch")

      import torch  # and the rest of its imports

  (ruff allows imports after that call). A single test in an otherwise torch-free module
  calls ``pytest.importorskip("torch")`` in its body instead.
* Every other test must pass without torch.

``GUIDELOOM_PIPES_TORCH_FREE=1`` selects that mode: torch and torchdata then cannot be
imported even where they are installed, so ``GUIDELOOM_PIPES_TORCH_FREE=1 python -m pytest``
in the development venv shows what the torch-free envs will see. Without it, a missing
torch is an error rather than a quiet skip of every loader test.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import multiprocessing
import multiprocessing.forkserver
import os
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest
from remote_servers import HttpServer, S3Server, moto_server, need_modules, nginx_server

TORCH_FREE = os.environ.get("GUIDELOOM_PIPES_TORCH_FREE") == "1"
_BLOCKED = ("torch", "torchdata")


class _BlockTorch(importlib.abc.MetaPathFinder):
    """Makes ``import torch`` / ``import torchdata`` fail as on a Python without them."""

    def find_spec(
        self, fullname: str, path: object = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname.partition(".")[0] in _BLOCKED:
            raise ModuleNotFoundError(
                f"No module named {fullname!r} (GUIDELOOM_PIPES_TORCH_FREE=1)", name=fullname
            )
        return None


def pytest_configure(config: pytest.Config) -> None:
    if TORCH_FREE:
        loaded = sorted(m for m in sys.modules if m.partition(".")[0] in _BLOCKED)
        if loaded:
            raise pytest.UsageError(f"torch-free mode, but already imported: {loaded}")
        sys.meta_path.insert(0, _BlockTorch())
    elif importlib.util.find_spec("torch") is None:
        raise pytest.UsageError(
            "torch is not installed in this environment. Install it (README: Tests), or set "
            "GUIDELOOM_PIPES_TORCH_FREE=1 to run only the tests that need no torch."
        )
    else:
        _preload_torch_in_the_fork_server()


#: What the fork server imports before it forks the loaders' worker processes (with torch).
FORK_SERVER_PRELOAD = ("torch", "guideloom_pipes.pipes.workers.process_main")


def _preload_torch_in_the_fork_server() -> None:
    """Have Python's fork server (one per test process) import torch before it starts.

    The loader preloads the modules of the dataset and ``collate_fn`` of the *first* pool of
    worker processes (the fork server starts then, and its preloads are fixed from there on).
    Which test starts it first depends on the order (``-n 2`` deals tests to two processes),
    and where that test's dataset and collate need no torch, every later worker process of
    that test process imports torch itself (seconds per pool, hundreds of pools). Preloaded
    here, a worker is a fork of a process that has torch, whatever the order. The loader still
    adds its own preloads to this list; that preload is tested in ``pipes/test_results.py``,
    and that a worker's own modules import no torch in a fresh process in
    ``pipes/test_pipes.py``. Tests that need workers of a fresh interpreter use ``spawn``.
    """
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return
    server = multiprocessing.forkserver._forkserver
    if getattr(server, "_forkserver_pid", None) is not None:
        return  # started already: its preloads are fixed
    current = list(getattr(server, "_preload_modules", None) or ["__main__"])
    multiprocessing.set_forkserver_preload(
        current + [name for name in FORK_SERVER_PRELOAD if name not in current]
    )


def pytest_report_header(config: pytest.Config) -> str:
    if TORCH_FREE:
        return "torch-free mode: modules that need torch are skipped"
    return "torch available"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # the docs' blocks that read from S3 run against moto on loopback: remote tests too
    for item in items:
        if "docs_s3" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.remote)


@pytest.fixture(autouse=True)
def _writers_keep_no_manifest(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Tests marked ``listing`` state what an open that lists the directory does (every
    check at open, temporaries named, races with writers): their writers write no manifest,
    so their datasets open by listing, as one written by GuideLoom or before manifests."""
    if request.node.get_closest_marker("listing") is not None:
        from guideloom_pipes.storage.writer import ShardWriterBase

        monkeypatch.setattr(ShardWriterBase, "_keeps_manifest", False)
    yield


# --- servers on loopback for the remote tests (remote_servers.py) -------------------------------


@pytest.fixture(scope="module")
def http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    """nginx serving an empty directory of its own (``server.root``) to a module's tests."""
    need_modules("aiohttp")
    with nginx_server(tmp_path_factory.mktemp("nginx")) as server:
        yield server


@pytest.fixture(scope="module")
def s3(request: pytest.FixtureRequest) -> Iterator[S3Server]:
    """moto's S3 server, holding the test module's empty bucket ``BUCKET``."""
    with moto_server() as server:
        server.filesystem().mkdir(request.module.BUCKET)
        yield server
