"""Type hints reach user code: mypy, run on a user's script outside the repository, finds the
installed package and reports a misuse of it.

The README installs the package editable with ``--config-settings editable_mode=compat``: a
plain ``.pth`` entry that puts the checkout on ``sys.path``, which mypy follows. setuptools'
default editable mode installs an import hook instead, which mypy cannot see (it then
reports ``guideloom_pipes`` as missing).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

#: mypy on a user's script takes about 16 s on 2 cores (more than 10 s: slow)
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent

USER_SCRIPT = """\
from pathlib import Path

import numpy as np

from guideloom_pipes import StreamDataset, StreamNumpyFormat, StreamStorage

storage = StreamStorage(Path("data"), StreamNumpyFormat(np.dtype([("tokens", "<i4")])))
dataset = StreamDataset(storage, sequence_length="2048")
reveal_type(storage)
reveal_type(dataset)
with storage.sync_writer() as writer:
    reveal_type(writer)
    writer.append("0", {"tokens": np.arange(3)})
"""

LOADER_SCRIPT = """\
import numpy as np
import torch

from guideloom_pipes import StatefulDataLoader


def collate(samples: list[int]) -> torch.Tensor:
    return torch.tensor(samples)


untyped = StatefulDataLoader(np.arange(10), local_batch_size=2)  # no annotation needed
loader = StatefulDataLoader(np.arange(10), collate, local_batch_size=2)
for batch in loader:
    reveal_type(batch)
for batch in loader.steps(3):
    batch.no_such_method()
"""


@pytest.fixture(scope="module")
def mypy_output(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """mypy's lines for each user script (one run for both: mypy reads torch's hints once)."""
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed here (pip install -e '.[dev]')")
    spec = importlib.util.find_spec("guideloom_pipes")
    if spec is None or spec.origin is None or not Path(spec.origin).is_relative_to(ROOT):
        pytest.skip("guideloom_pipes is not installed from this checkout (README: setup)")
    workdir = tmp_path_factory.mktemp("user_scripts")
    assert not workdir.is_relative_to(ROOT)
    scripts = {"user_script.py": USER_SCRIPT, "user_loader.py": LOADER_SCRIPT}
    for name, text in scripts.items():
        (workdir / name).write_text(text, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH")}
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "--no-error-summary", *scripts],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    lines = done.stdout.splitlines()
    return {name: "\n".join(line for line in lines if line.startswith(name)) for name in scripts}


def test_mypy_finds_the_package_from_a_users_script_and_reports_a_misuse(mypy_output):
    out = mypy_output["user_script.py"]
    assert "import-not-found" not in out and "import-untyped" not in out, (
        "mypy cannot find guideloom_pipes from a script outside the checkout: install it as "
        "the README does (pip install -e . --config-settings editable_mode=compat)\n" + out
    )
    assert (
        'Argument "sequence_length" to "StreamDataset" has incompatible type "str"; '
        'expected "int"' in out
    ), out
    assert 'Revealed type is "guideloom_pipes.storage.stream.StreamStorage' in out, out
    assert 'Revealed type is "guideloom_pipes.datasets.StreamDataset' in out, out
    assert 'Revealed type is "guideloom_pipes.storage.stream.StreamWriter"' in out, out
    assert 'Argument 1 to "append" of "StreamWriter" has incompatible type "str"' in out, out


def test_batches_have_the_type_the_collate_fn_returns(mypy_output):
    pytest.importorskip("torch")
    out = mypy_output["user_loader.py"]
    assert "var-annotated" not in out, out  # a loader without a collate_fn needs no annotation
    assert out.count('Revealed type is "torch._tensor.Tensor"') == 1, out
    assert '"Tensor" has no attribute "no_such_method"' in out, out
