"""The layers of the package (docs/architecture.md), enforced.

Every module of ``guideloom_pipes`` belongs to one layer; a module may import its own layer
and those below it, never one above (lazy imports inside functions count too). The layers
below ``pipes`` import without torch. A new module must be given its layer in ``LAYERS``:
the test fails for a module it does not know.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "guideloom_pipes"

#: Layer of each module prefix, lowest first (docs/architecture.md, "Layers").
LAYERS: dict[str, int] = {
    "guideloom_pipes.types": 0,
    "guideloom_pipes.checks": 0,
    # (standard library only: the tools and the corpora's scans show progress with it)
    "guideloom_pipes.progress": 0,
    "guideloom_pipes.storage": 1,
    "guideloom_pipes.io": 1,
    "guideloom_pipes.formats": 2,
    # read-only storages of other tools' corpora: a stream storage with a format of ours
    "guideloom_pipes.storage.corpora": 2,
    "guideloom_pipes.batch": 2,
    "guideloom_pipes.datasets": 3,
    "guideloom_pipes.dataset_readers": 3,
    "guideloom_pipes.reader_base": 3,
    "guideloom_pipes.mixture": 3,
    "guideloom_pipes.mixture_schedule": 3,
    "guideloom_pipes.mixture_reader": 3,
    "guideloom_pipes.mixture_routing": 3,
    "guideloom_pipes.mixture_weights": 3,
    "guideloom_pipes.packing": 3,
    "guideloom_pipes.packing_columns": 3,
    "guideloom_pipes.packing_index": 3,
    "guideloom_pipes.packing_plan": 3,
    "guideloom_pipes.packing_reader": 3,
    "guideloom_pipes.shuffle": 3,
    "guideloom_pipes.opening": 3,
    "guideloom_pipes.opening_corpora": 3,
    "guideloom_pipes.tokenizing": 3,
    "guideloom_pipes.parallel": 4,
    "guideloom_pipes.cli": 4,
    "guideloom_pipes.__main__": 4,
    "guideloom_pipes.pipes": 5,
    "guideloom_pipes.loader": 6,
    "guideloom_pipes.bench": 7,
}
#: The package's front door re-exports every layer up to the loader (the torch-backed ones
#: lazily): importing it counts as importing the loader's layer.
FACADE = "guideloom_pipes"
#: Highest layer that must import with torch blocked (the tools: the CLI, write_parallel).
TORCH_FREE_UP_TO = 4
#: Modules of torch layers that worker processes import, so they stay torch-free too (and
#: ``get_worker_info``'s, which a torch-free dataset may ask).
TORCH_FREE_EXTRA = (
    "guideloom_pipes.pipes.workers.process_main",
    "guideloom_pipes.pipes.workers.transport",
    "guideloom_pipes.pipes.worker_info",
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _layer(module: str) -> int | None:
    """The layer of ``module`` (its longest prefix in LAYERS), or None if unplaced."""
    prefixes = [p for p in LAYERS if module == p or module.startswith(p + ".")]
    return LAYERS[max(prefixes, key=len)] if prefixes else None


def _imports(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every ``guideloom_pipes`` import in a file."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            # ``from guideloom_pipes import pipes`` names a submodule, not an attribute
            names = [f"{target}.{alias.name}" for alias in node.names]
            found += [
                (node.lineno, name if name.removesuffix(".*") in _modules() else target)
                for name in names
            ]
    return [(line, name) for line, name in found if name.partition(".")[0] == FACADE]


def test_every_module_has_a_layer() -> None:
    unplaced = [name for name in _modules() if name != FACADE and _layer(name) is None]
    assert not unplaced, f"give these modules a layer in LAYERS: {unplaced}"


def test_no_module_imports_a_layer_above_its_own() -> None:
    upward = []
    for module, path in _modules().items():
        if module == FACADE:
            continue
        own = _layer(module)
        assert own is not None
        for line, target in _imports(module, path):
            theirs = LAYERS["guideloom_pipes.loader"] if target == FACADE else _layer(target)
            if theirs is not None and theirs > own:
                upward.append(f"{module}:{line} (layer {own}) imports {target} (layer {theirs})")
    assert not upward, "\n".join(upward)


def test_the_layer_check_sees_an_upward_import(tmp_path: Path) -> None:
    # The checker itself: a storage module importing the loader is reported.
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from guideloom_pipes.loader import StatefulDataLoader\n")
    imported = _imports("guideloom_pipes.storage.bad", bad)
    assert imported == [(2, "guideloom_pipes.loader")]
    assert _layer(imported[0][1]) > _layer("guideloom_pipes.storage.bad")  # type: ignore[operator]


def test_the_lower_layers_import_with_torch_blocked() -> None:
    lower = [m for m in _modules() if (_layer(m) or 0) <= TORCH_FREE_UP_TO or m == FACADE]
    modules = [*lower, *TORCH_FREE_EXTRA, "guideloom", "guideloom.dataset", "guideloom.io"]
    code = f"""
import importlib, importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "torchdata"):
            raise ModuleNotFoundError(f"blocked: {{name}}", name=name)
        return None

sys.meta_path.insert(0, Block())
for name in {modules!r}:
    importlib.import_module(name)
import guideloom_pipes
assert guideloom_pipes.get_worker_info() is None  # (asks torch only where it is imported)
print(len({modules!r}))
"""
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == len(modules)


@pytest.mark.parametrize("module", sorted(_modules()))
def test_every_module_opens_with_a_docstring_saying_its_job(module: str) -> None:
    tree = ast.parse(_modules()[module].read_text())
    docstring = ast.get_docstring(tree)
    assert docstring and len(docstring.split()) >= 5, f"{module} needs a docstring of its job"
