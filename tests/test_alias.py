"""The ``guideloom`` alias: GuideLoom code runs unchanged on the very objects of guideloom_pipes."""

from __future__ import annotations

import importlib
import importlib.util
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import guideloom
import guideloom_pipes

REPO = Path(__file__).resolve().parents[1]
PACKAGE_DIR = REPO / "guideloom_pipes"
LAZY_NAMES = {"DataLoader", "StatefulDataLoader", "collate_packed", "pad_collate", "pipes"}  # torch
TORCH_MODULES = ("torch", "torchdata")


def _submodule_names() -> list[str]:
    """Every module of guideloom_pipes below the top, as ``X`` or ``X.Y`` (from the files)."""
    names = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(PACKAGE_DIR).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts and parts[-1] != "__main__":
            names.append(".".join(parts))
    return names


def _import_or_skip(name: str) -> object:
    """Import ``name``; skip when only a missing torch stands in the way."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if (error.name or "").partition(".")[0] in TORCH_MODULES:
            pytest.skip(f"{name} needs torch: {error}")
        raise


def _run(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter that finds this checkout first."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
        check=False,
    )


def _assert_ran(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"


# --- names -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", sorted(set(guideloom_pipes.__all__) - LAZY_NAMES - {"__version__"})
)
def test_public_name_is_the_same_object(name: str) -> None:
    assert getattr(guideloom, name) is getattr(guideloom_pipes, name)


@pytest.mark.parametrize("name", sorted(LAZY_NAMES))
def test_torch_backed_name_is_the_same_object(name: str) -> None:
    pytest.importorskip("torch")
    assert getattr(guideloom, name) is getattr(guideloom_pipes, name)


def test_version_is_the_guideloom_api_level() -> None:
    assert guideloom.__version__ == guideloom_pipes.GUIDELOOM_VERSION == "1.1.0"


def test_all_lists_the_same_names_as_guideloom_pipes() -> None:
    assert sorted(guideloom.__all__) == sorted(guideloom_pipes.__all__)


def test_spec_public_names_are_importable_without_torch() -> None:
    from guideloom import (  # noqa: F401
        DocumentDataset,
        DocumentPickleFormat,
        DocumentStorage,
        StreamDataset,
        StreamNumpyFormat,
        StreamStorage,
        StreamWithMetaStorage,
        __version__,
        io,
        types,
    )

    assert io.SeekIO is guideloom_pipes.io.SeekIO


def test_unknown_attribute_is_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = guideloom.no_such_name  # type: ignore[attr-defined]


def test_private_names_of_guideloom_pipes_are_not_reexported() -> None:
    with pytest.raises(AttributeError):
        _ = guideloom._LAZY  # type: ignore[attr-defined]


def test_dir_lists_the_public_names() -> None:
    assert set(guideloom.__all__) <= set(dir(guideloom))


# --- submodules ------------------------------------------------------------------------


@pytest.mark.parametrize("sub", _submodule_names())
def test_submodule_is_the_same_module_object(sub: str) -> None:
    real = _import_or_skip(f"guideloom_pipes.{sub}")
    alias = importlib.import_module(f"guideloom.{sub}")
    assert alias is real
    assert sys.modules[f"guideloom.{sub}"] is real


@pytest.mark.parametrize("sub", _submodule_names())
def test_submodule_keeps_its_own_name_and_spec(sub: str) -> None:
    _import_or_skip(f"guideloom_pipes.{sub}")
    module = importlib.import_module(f"guideloom.{sub}")
    assert module.__name__ == f"guideloom_pipes.{sub}"
    assert module.__spec__ is not None
    assert module.__spec__.name == f"guideloom_pipes.{sub}"


def test_import_statement_forms() -> None:
    import guideloom.io
    import guideloom.types
    from guideloom.io import MmapIO, PosixPreadIO, SeekIO
    from guideloom.types import StreamStorageFormat

    assert guideloom.io is guideloom_pipes.io
    assert guideloom.types is guideloom_pipes.types
    assert (MmapIO, PosixPreadIO, SeekIO) == (
        guideloom_pipes.io.MmapIO,
        guideloom_pipes.io.PosixPreadIO,
        guideloom_pipes.io.SeekIO,
    )
    assert StreamStorageFormat is guideloom_pipes.types.StreamStorageFormat


def test_nested_import_statement_forms() -> None:
    # (a block of its own: ruff sorts guideloom.io, which has a stub file, apart from these)
    import guideloom.storage.stream
    from guideloom.storage import stream

    assert (
        stream
        is guideloom.storage.stream
        is importlib.import_module("guideloom_pipes.storage.stream")
    )


def test_no_module_is_loaded_twice() -> None:
    for sub in _submodule_names():
        try:
            importlib.import_module(f"guideloom.{sub}")
        except ModuleNotFoundError as error:
            if (error.name or "").partition(".")[0] not in TORCH_MODULES:
                raise
    for name, module in list(sys.modules.items()):
        if name.startswith("guideloom."):
            assert module is sys.modules["guideloom_pipes." + name.removeprefix("guideloom.")]


def test_missing_submodule_is_module_not_found() -> None:
    with pytest.raises(ModuleNotFoundError) as raised:
        importlib.import_module("guideloom.no_such_module")
    assert raised.value.name == "guideloom.no_such_module"


def test_missing_nested_submodule_is_module_not_found() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("guideloom.storage.no_such_module")


def test_find_spec_of_alias_mirrors_the_real_module() -> None:
    spec = importlib.util.find_spec("guideloom.storage")
    assert spec is not None
    assert spec.submodule_search_locations is not None
    assert importlib.util.find_spec("guideloom.no_such_module") is None


# --- classes behave as one -------------------------------------------------------------


def test_objects_built_through_either_name_are_instances_of_both(tmp_path: Path) -> None:
    import guideloom.storage.stream

    dtype = np.dtype([("tokens", "<i4"), ("loss_mask", "u1")])
    storage = guideloom.StreamStorage(tmp_path, guideloom.StreamNumpyFormat(dtype))
    assert isinstance(storage, guideloom_pipes.StreamStorage)
    assert isinstance(storage, guideloom.storage.stream.StreamStorage)
    with storage.sync_writer() as writer:
        writer.append(0, {"tokens": np.arange(6, dtype="<i4"), "loss_mask": np.ones(6, "u1")})
    dataset = guideloom_pipes.StreamDataset(storage, 3)
    assert isinstance(dataset, guideloom.StreamDataset)
    with dataset.sync_reader() as reader:
        assert reader[1]["tokens"].tolist() == [3, 4, 5]


def test_objects_pickle_under_the_guideloom_pipes_name() -> None:
    fmt = guideloom.StreamNumpyFormat(np.dtype([("tokens", "<i4")]))
    data = pickle.dumps(fmt)
    assert b"guideloom_pipes" in data
    assert isinstance(pickle.loads(data), guideloom_pipes.StreamNumpyFormat)


# --- torch stays out -------------------------------------------------------------------

_NO_TORCH = "assert not [m for m in sys.modules if m.split('.')[0] in ('torch', 'torchdata')]"


@pytest.mark.parametrize("module", ["guideloom", "guideloom_pipes"])
def test_import_does_not_import_torch(module: str) -> None:
    _assert_ran(_run(f"import sys, {module}; {_NO_TORCH}"))


def test_submodule_imports_do_not_import_torch() -> None:
    code = f"""
        import sys
        import guideloom.io, guideloom.types, guideloom.storage, guideloom.datasets
        import guideloom.formats, guideloom.shuffle
        from guideloom.io import MmapIO
        from guideloom.types import StreamStorageFormat
        {_NO_TORCH}
    """
    _assert_ran(_run(code))


def test_storage_use_does_not_import_torch() -> None:
    code = f"""
        import sys, tempfile
        from pathlib import Path
        import numpy as np
        from guideloom import (DocumentDataset, DocumentPickleFormat, DocumentStorage,
                               StreamDataset, StreamNumpyFormat, StreamStorage)
        from guideloom.io import MmapIO, PosixPreadIO, SeekIO

        with tempfile.TemporaryDirectory() as d:
            dtype = np.dtype([("tokens", "<i4")])
            stream = StreamStorage(Path(d, "s"), StreamNumpyFormat(dtype))
            with stream.sync_writer() as w:
                w.append(0, {{"tokens": np.arange(10, dtype="<i4")}})
            docs = DocumentStorage(Path(d, "d"), DocumentPickleFormat())
            with docs.sync_writer() as w:
                w.append(0, {{"text": "hello"}})
            for io in (None, MmapIO(), PosixPreadIO(), SeekIO()):
                s = StreamStorage(Path(d, "s"), StreamNumpyFormat(dtype), io)
                with StreamDataset(s, 4).sync_reader() as r:
                    assert r[1]["tokens"].tolist() == [4, 5, 6, 7]
                with DocumentDataset(docs).sync_reader() as r:
                    assert r[0] == {{"text": "hello"}}
        {_NO_TORCH}
    """
    _assert_ran(_run(code))


def test_find_spec_of_a_torch_backed_submodule_does_not_import_torch() -> None:
    _assert_ran(
        _run(
            f"import sys, importlib.util; importlib.util.find_spec('guideloom.loader'); {_NO_TORCH}"
        )
    )


def test_stateful_data_loader_loads_torch_on_first_use() -> None:
    pytest.importorskip("torch")
    code = f"""
        import sys, guideloom
        {_NO_TORCH}
        loader_class = guideloom.StatefulDataLoader
        assert "torch" in sys.modules
        import guideloom_pipes.loader
        assert loader_class is guideloom_pipes.loader.StatefulDataLoader
        from guideloom import StatefulDataLoader
        assert StatefulDataLoader is loader_class
    """
    _assert_ran(_run(code))


def test_reload_through_the_alias_reloads_the_real_module() -> None:
    code = """
        import importlib, guideloom.shuffle, guideloom_pipes.shuffle
        assert importlib.reload(guideloom.shuffle) is guideloom_pipes.shuffle
        reloaded = importlib.reload(importlib.import_module("guideloom"))
        import sys
        finders = [f for f in sys.meta_path if type(f).__name__ == "_AliasFinder"]
        assert len(finders) == 1, finders
        import guideloom.formats, guideloom_pipes.formats
        assert guideloom.formats is guideloom_pipes.formats
    """
    _assert_ran(_run(code))


@pytest.mark.parametrize(
    ("module", "names"),
    [
        ("guideloom.dataset", ["StreamDataset", "DocumentDataset"]),
        ("guideloom.storage_format", ["StreamNumpyFormat", "DocumentPickleFormat"]),
        ("guideloom.storage", ["StreamStorage", "StreamWithMetaStorage", "DocumentStorage"]),
    ],
)
def test_guideloom_module_paths_export_the_same_classes(module: str, names: list[str]) -> None:
    imported = importlib.import_module(module)
    for name in names:
        assert getattr(imported, name) is getattr(guideloom_pipes, name)


def test_guideloom_pytorch_module_path_exports_the_loader() -> None:
    pytest.importorskip("torch")
    from guideloom.pytorch import StatefulDataLoader

    assert StatefulDataLoader is guideloom_pipes.StatefulDataLoader
