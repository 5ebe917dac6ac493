"""The tutorial notebooks are specifications too: each one runs top to bottom without a cell
error (their cells assert the worked examples), and the committed files are stripped of
outputs and are exactly what `notebooks/build.py` generates from its cell sources.

The notebooks run in a fresh kernel of *this* interpreter (the test's virtual environment),
whatever `python3` kernelspec the machine has installed, with a temporary working directory.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 600


def _build_module():
    spec = importlib.util.spec_from_file_location("notebooks_build", NOTEBOOK_DIR / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _ThisInterpreter(KernelManager):
    """Starts the ipykernel with `sys.executable`, ignoring the kernelspec's argv."""

    def format_kernel_cmd(self, extra_arguments: list[str] | None = None) -> list[str]:
        connection_file = os.path.realpath(self.connection_file)
        return [
            sys.executable,
            "-m",
            "ipykernel_launcher",
            "-f",
            connection_file,
            *(extra_arguments or []),
        ]


def test_the_three_notebooks_exist():
    assert [p.name for p in NOTEBOOKS] == [
        "01_fp8_mismatch.ipynb",
        "02_ais_walkthrough.ipynb",
        "03_train_tiny.ipynb",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stripped(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name} cell {i} has outputs"
            assert cell.execution_count is None, f"{path.name} cell {i} has an execution count"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_opens_with_a_story(path):
    first = nbformat.read(path, as_version=4).cells[0]
    assert first.cell_type == "markdown" and first.source.startswith("# ")


def test_notebooks_equal_build_output():
    build = _build_module()
    assert sorted(build.NOTEBOOKS) == [p.name for p in NOTEBOOKS]
    stale = [p.name for p in NOTEBOOKS if p.read_text() != build.render(p.name)]
    assert not stale, f"{stale} differ from notebooks/build.py; run `python notebooks/build.py`"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("import sys\nprint(sys.executable)"))
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        kernel_manager_class=_ThisInterpreter,
        resources={"metadata": {"path": str(tmp_path)}},  # the kernel's working directory
    )
    client.execute()  # raises CellExecutionError, with the traceback, at the first failing cell
    errors = [
        (i, o.ename, o.evalue)
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code"
        for o in cell.outputs
        if o.output_type == "error"
    ]
    assert not errors
    printed = "".join(o.get("text", "") for o in nb.cells[-1].outputs).strip()
    assert printed == sys.executable, "the notebook kernel ran another interpreter"
