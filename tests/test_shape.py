"""The package's shape stays readable: no module over 500 lines, no class over 400, no
function over 80 (the benchmark, ``guideloom_pipes/bench``, aside). Numpy- and torch-free:
it reads the source."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "guideloom_pipes"
LIMITS = {"module": 500, "class": 400, "function": 80}


def oversized(root: Path) -> list[str]:
    """``path: kind name (lines)`` for each module, class and function of ``root`` (a
    folder of modules) longer than :data:`LIMITS`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if "bench" in path.relative_to(root).parts:
            continue
        source = path.read_text()
        lines = len(source.splitlines())
        name = path.relative_to(root.parent)
        if lines > LIMITS["module"]:
            found.append(f"{name}: module ({lines} lines)")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                kind = "class"
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                kind = "function"
            else:
                continue
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > LIMITS[kind]:
                found.append(f"{name}: {kind} {node.name} ({length} lines)")
    return found


def test_no_module_class_or_function_is_over_its_limit() -> None:
    assert oversized(PACKAGE) == []


def test_the_check_sees_a_long_module_class_and_function(tmp_path: Path) -> None:
    root = tmp_path / "pkg"
    root.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(81))
    (root / "long.py").write_text(
        f"def f():\n{body}\n\n\nclass C:\n" + "    a = 1\n" * 400 + "\n" * 100
    )
    (root / "bench").mkdir()
    (root / "bench" / "free.py").write_text("\n" * 600)
    assert oversized(root) == [
        "pkg/long.py: module (585 lines)",
        "pkg/long.py: function f (82 lines)",
        "pkg/long.py: class C (401 lines)",
    ]
