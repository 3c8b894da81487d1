"""The underscore is a boundary: no module of ``guideloom_pipes`` imports a private name
(``_name``) or a private module (``_module``) of another folder.

A name that another folder needs is public in its module (and documented there); a private
name is free to change with the folder that owns it. Dunder names (``__version__``) are not
private. Imports inside functions count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "guideloom_pipes"
TOP = PACKAGE.name


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _folder_of(path: Path) -> tuple[str, ...]:
    """The importing module's folder, as a package path (``("guideloom_pipes", "pipes")``)."""
    return (TOP, *path.relative_to(PACKAGE).parent.parts)


def private_imports(path: Path) -> list[str]:
    """``file:line name`` of each private name or module imported from another folder."""
    folder = _folder_of(path)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = folder[: len(folder) - (node.level - 1)]
                target = (*base, *(node.module.split(".") if node.module else ()))
            else:
                target = tuple((node.module or "").split("."))
            if target[0] != TOP:
                continue
            for alias in node.names:
                module_path = (*target, alias.name)
                # ``from pkg.folder import name``: name is a module of that folder or a name
                # of its __init__; either way it belongs to the folder ``target``, unless
                # ``target`` is itself a module (then the folder is its parent)
                is_module = (PACKAGE.parent.joinpath(*target)).is_dir()
                owner = target if is_module else target[:-1]
                if owner == folder:
                    continue
                parts = module_path if is_module else (*target, alias.name)
                if any(_private(part) for part in parts[1:]):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {'.'.join(parts)}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = tuple(alias.name.split("."))
                if parts[0] != TOP or parts[:-1] == folder:
                    continue
                if any(_private(part) for part in parts[1:]):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {alias.name}")
    return found


def test_no_module_imports_a_private_name_of_another_folder() -> None:
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) for hit in private_imports(path)]
    assert not found, "make these names public where they are defined:\n" + "\n".join(found)


def test_the_check_sees_private_imports_across_folders_and_allows_them_within(monkeypatch) -> None:
    # The checker itself, on a file placed in guideloom_pipes/loader/ (as the package sees it).
    module = PACKAGE / "loader" / "_checked_here.py"
    text = (
        "from guideloom_pipes.pipes.read import _ours, ReadSamples\n"  # private name: reported
        "from guideloom_pipes.pipes import _hidden\n"  # private module of pipes/: reported
        "from guideloom_pipes.loader.settings import _int_arg\n"  # own folder: allowed
        "from .settings import _Setting\n"  # own folder, relative: allowed
        "from ..storage import names\n"  # public: allowed
        "from guideloom_pipes import __version__\n"  # dunder: allowed
        "def f():\n"
        "    import guideloom_pipes.storage._secret\n"  # inside a function: reported
    )
    original = Path.read_text

    def read_text(self: Path, *args, **kwargs) -> str:
        return text if self == module else original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    assert private_imports(module) == [
        "loader/_checked_here.py:1 guideloom_pipes.pipes.read._ours",
        "loader/_checked_here.py:2 guideloom_pipes.pipes._hidden",
        "loader/_checked_here.py:8 guideloom_pipes.storage._secret",
    ]
