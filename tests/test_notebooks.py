"""The tutorial notebooks are specifications too: each one runs top to bottom without a cell
error (their cells assert the worked examples), what they compute is then recomputed
independently in the same kernel (`CHECKS`), and the committed files are stripped of
outputs and are exactly what `notebooks/build.py` generates from its cell sources.

The notebooks run in a fresh kernel of *this* interpreter (the test's virtual environment),
whatever `python3` kernelspec the machine has installed, with a temporary working directory,
and with XLA's default compile options (`conftest.default_compile_env`), as a user's kernel
runs them.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import nbformat
import pytest
from conftest import default_compile_env
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


# Run after each notebook, in its kernel: the numbers the notebook shows, recomputed
# independently (float64 NumPy, closed forms) from the notebook's own variables.
CHECKS = {
    "01_fp8_mismatch": r"""
# sequence log-ratios of T i.i.d. N(-s^2/2, s^2) token log-ratios: std s*sqrt(T) (4096 draws:
# a std's relative sampling error is ~1/sqrt(2*4096) = 1.1%; 6% allows > 5 sigma)
np.testing.assert_allclose(seq_std, sigma * np.sqrt(lengths), rtol=0.06)
# and the sequence ESS ratio tends to exp(-s^2 T) (lognormal weights) while token ESS stays ~1
np.testing.assert_allclose(seq_ess[:4], np.exp(-(sigma**2) * np.array(lengths[:4])), atol=0.03)
assert seq_ess[-1] < 0.2 and min(token_ess) > 0.99
# the mismatch table: d = logp_train - logp_rollout over the sampled tokens, in float64
d = (np.asarray(logp_train, np.float64) - np.asarray(rollout.logp_plain, np.float64))[mask]
shown = ais_jax.mismatch_metrics(logp_train, rollout.logp_plain, rollout.mask)
np.testing.assert_allclose(float(shown["mismatch/mean_abs"]), np.abs(d).mean(), rtol=1e-5)
np.testing.assert_allclose(float(shown["mismatch/k1"]), -d.mean(), rtol=1e-4, atol=1e-7)
r = np.exp(d)
np.testing.assert_allclose(float(shown["mismatch/ess_ratio_raw"]),
                           r.sum() ** 2 / (r.size * (r**2).sum()), rtol=1e-5)
assert 0.005 < np.abs(d).mean() < 0.5, np.abs(d).mean()  # FP8 moves log-probs, a little
np.testing.assert_array_equal(d_BT[mask], np.asarray(logp_train - rollout.logp_plain)[mask])
""",
    "02_ais_walkthrough": r"""
# sweeps 1 (section 3a: the mismatch grows along it) and 3 (3c): every row the notebook
# plotted, against the float64 reference (tests/references.py) computed from the log-ratios and
# advantages the notebook drew, not from the library's logged components
import references

assert np.all(np.diff(d_bar) > 0)
sweep_1 = [s * z - s**2 / 2 for s in sigmas]
sweep_3 = [sigma * (c * z_abs_a + np.sqrt(1 - c**2) * noise) - sigma**2 / 2 for c in corrs]
shown = [diagnose(log_ratio) for log_ratio in sweep_1] + rows  # rows: sweep 3, as plotted
for log_ratio, row in zip(sweep_1 + sweep_3, shown, strict=True):
    ref = references.ais(advantages, log_ratio.astype(np.float32), np.zeros((B, T)), mask)
    # float32 statistics: 1e-5, as tests/test_ais.py's reference test
    for key in ("mismatch", "alpha_mis", "alpha_ess", "alpha_var", "var_ratio", "alpha"):
        np.testing.assert_allclose(row[f"ais/{key}"], ref[key], rtol=1e-5, atol=1e-5, err_msg=key)
alphas = np.array([row["ais/alpha"] for row in shown])
assert alphas.min() < 0.1 and alphas.max() > 0.5  # the sweeps move alpha across its range
""",
    "03_train_tiny": r"""
# what the run wrote is what the notebook plotted and printed: one metrics row per GRPO step,
# the held-out evaluation at step 0 and at the end, and the summary's figures taken from them
import numpy as np

assert steps == list(range(1, cfg.steps + 1)), steps
evals = [json.loads(line) for line in (out_dir / "eval.jsonl").read_text().splitlines()]
assert evals[0]["step"] == 0 and evals[-1]["step"] == cfg.steps
assert summary["initial/eval/accuracy"] == evals[0]["eval/accuracy"]
assert summary["eval/accuracy"] == evals[-1]["eval/accuracy"]
rewards = np.array([r["reward/mean"] for r in rows])
window = min(10, len(rows))  # run_log.SUMMARY_WINDOW
np.testing.assert_allclose(summary["reward/last"], rewards[-window:].mean(), rtol=1e-12)
assert ((0 <= rewards) & (rewards <= 1)).all()
""",
}


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    tests = str(Path(__file__).resolve().parent)  # the checks import tests/references.py
    nb.cells.append(nbformat.v4.new_code_cell(f"import sys\nsys.path.insert(0, {tests!r})"))
    nb.cells.append(nbformat.v4.new_code_cell(CHECKS[path.stem]))
    nb.cells.append(nbformat.v4.new_code_cell("import sys\nprint(sys.executable)"))
    client = NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        kernel_manager_class=_ThisInterpreter,
        resources={"metadata": {"path": str(tmp_path)}},  # the kernel's working directory
    )
    # raises CellExecutionError, with the traceback, at the first failing cell
    client.execute(env=default_compile_env())
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
