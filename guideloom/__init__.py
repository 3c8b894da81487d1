"""``guideloom``: GuideLoom 1.1's import name, served by :mod:`guideloom_pipes`.

Code written for GuideLoom runs unchanged::

    from guideloom import StreamStorage, StreamNumpyFormat
    from guideloom.io import MmapIO
    import guideloom.types

Every name and every submodule is the very object :mod:`guideloom_pipes` has:
``guideloom.X.Y`` *is* ``guideloom_pipes.X.Y`` (same module, same classes, so ``isinstance``
and pickles work across both names). Three module paths exist only in GuideLoom and live in
this package as files of their own, re-exporting our classes: ``guideloom.dataset``,
``guideloom.storage_format`` and ``guideloom.pytorch``. ``__version__`` is the GuideLoom API
level this package reproduces (``guideloom_pipes.GUIDELOOM_VERSION``);
``guideloom_pipes.__version__`` is our own.

Importing ``guideloom`` does not import torch; ``StatefulDataLoader`` and ``pipes`` load it on
first use, as in :mod:`guideloom_pipes`. Do not install this package next to GuideLoom itself:
both provide ``guideloom``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

import guideloom_pipes as _pipes
from guideloom_pipes import GUIDELOOM_VERSION as GUIDELOOM_VERSION
from guideloom_pipes import DocumentDataset as DocumentDataset
from guideloom_pipes import DocumentPickleFormat as DocumentPickleFormat
from guideloom_pipes import DocumentStorage as DocumentStorage
from guideloom_pipes import StreamDataset as StreamDataset
from guideloom_pipes import StreamNumpyFormat as StreamNumpyFormat
from guideloom_pipes import StreamStorage as StreamStorage
from guideloom_pipes import StreamWithMetaStorage as StreamWithMetaStorage
from guideloom_pipes import io as io
from guideloom_pipes import types as types

if TYPE_CHECKING:
    from guideloom_pipes import StatefulDataLoader as StatefulDataLoader
    from guideloom_pipes import pipes as pipes

__version__ = GUIDELOOM_VERSION

_ALIAS = __name__  # "guideloom"
_TARGET = _pipes.__name__  # "guideloom_pipes"


class _AliasLoader(importlib.abc.Loader):
    """Loads ``guideloom.<sub>`` as the module object ``guideloom_pipes.<sub>``."""

    def __init__(self, real_name: str) -> None:
        self._real_name = real_name
        self._real_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self._real_name)
        self._real_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system stamps the alias spec on the module between create_module and
        # this call; give the module its own spec back so it keeps one identity (reload,
        # pickling, tracebacks all see guideloom_pipes.<sub>).
        module.__spec__ = self._real_spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Finds ``guideloom.<sub>`` wherever ``guideloom_pipes.<sub>`` exists.

    It sits first on ``sys.meta_path``: an alias package shares ``__path__`` with its
    target, so the path finder would otherwise load a second copy of each file.
    Finding does not import the target; loading does (so ``importlib.util.find_spec``
    on a torch-backed submodule does not import torch).
    """

    def find_spec(
        self,
        fullname: str,
        path: Any = None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(_ALIAS + "."):
            return None
        real_name = _TARGET + fullname[len(_ALIAS) :]
        real_spec = importlib.util.find_spec(real_name)
        if real_spec is None:
            return None
        return importlib.machinery.ModuleSpec(
            fullname,
            _AliasLoader(real_name),
            is_package=real_spec.submodule_search_locations is not None,
        )


def _install_finder() -> None:
    # By name, not isinstance: a reloaded ``guideloom`` defines a new _AliasFinder class.
    if not any(type(finder).__name__ == _AliasFinder.__name__ for finder in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())


_install_finder()


def __getattr__(name: str) -> Any:
    # The lazy names (StatefulDataLoader, pipes) and submodules imported after this module.
    if not name.startswith("_"):
        try:
            return getattr(_pipes, name)
        except AttributeError:
            pass
    raise AttributeError(f"module {_ALIAS!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = list(_pipes.__all__)  # the same public names
