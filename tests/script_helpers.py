"""Running a script of the tests in a subprocess, as a user runs one: this checkout first on
its path, torch allowed (``GUIDELOOM_PIPES_TORCH_FREE`` unset)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_script(command: list[str], cwd: Path, timeout: float = 300) -> str:
    """Run ``command`` in ``cwd``; its stdout. Fails the test, with both outputs, if it
    exits with an error."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("GUIDELOOM_PIPES_TORCH_FREE", None)
    result = subprocess.run(
        command, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout, check=False
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result.stdout
