"""Specifications of the `ais-jax` command line (cli.py), run in-process through `main(argv)`.

One tiny run is trained once (into an empty directory with `--resume`, which must start it
fresh) and then evaluated, sampled and exported. A user's mistake ends with exit status 2 and
a one-line error naming what is wrong, never a traceback.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from training_run import TINY_RUN

from ais_jax.cli.main import main
from ais_jax.config import TrainConfig, dump_config, from_dict, load_config
from ais_jax.io.hf import load_hf
from ais_jax.train.run import Run

# The same one-layer run as tests/test_train.py's default arm, so one process compiles it once.
TINY = TINY_RUN


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture(scope="module")
def config_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("config") / "tiny.yaml"
    path.write_text(dump_config(from_dict(TrainConfig, TINY)))
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory, config_file):
    """``ais-jax train --resume`` into a directory that does not exist yet."""
    out = tmp_path_factory.mktemp("runs") / "tiny"
    records, stdout = _Records(), io.StringIO()
    logger = logging.getLogger("ais_jax")
    logger.addHandler(records)
    try:
        with contextlib.redirect_stdout(stdout):
            code = main(
                [
                    "train",
                    "--config",
                    str(config_file),
                    "--out",
                    str(out),
                    "--resume",
                    "--no-progress",
                ]
            )
    finally:
        logger.removeHandler(records)
    return dict(out=out, code=code, stdout=stdout.getvalue(), records=records.records)


def error_line(capsys) -> str:
    """The one error line of a failed command (and no traceback)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if " error: " in ln]
    assert len(lines) == 1, err
    return lines[0]


# ---- train --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_train_writes_the_outputs(trained, config_file):
    out = trained["out"]
    assert trained["code"] == 0
    assert load_config(out / "config.yaml") == load_config(config_file)
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(v) for r in rows for v in r.values())
    assert list((out / "tb").glob("events.out.tfevents.*"))
    assert {p.name for p in (out / "plots").glob("*.png")} >= {"reward.png", "ais.png"}
    summary = json.loads((out / "summary.json").read_text())
    assert json.loads(trained["stdout"]) == summary
    assert summary["steps"] == 4 and math.isfinite(summary["eval/accuracy"])
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir()) == [0, 4]


@pytest.mark.slow
def test_resume_of_an_empty_directory_starts_fresh_with_a_warning(trained):
    warnings = [r.getMessage() for r in trained["records"] if r.levelno == logging.WARNING]
    assert any("no checkpoint" in w and str(trained["out"]) in w for w in warnings), warnings
    summary = json.loads((trained["out"] / "summary.json").read_text())
    assert "initial/eval/accuracy" in summary and "sft/final_loss" in summary  # SFT ran


@pytest.mark.slow
def test_train_into_a_finished_run_without_resume_is_refused(trained, config_file, capsys):
    before = (trained["out"] / "metrics.jsonl").read_text()
    code = main(
        ["train", "--config", str(config_file), "--out", str(trained["out"]), "--no-progress"]
    )
    assert code == 2
    line = error_line(capsys)
    assert "already holds checkpoints" in line and "--resume" in line
    assert (trained["out"] / "metrics.jsonl").read_text() == before


# ---- eval, sample, export-hf --------------------------------------------------------------------


@pytest.mark.slow
def test_eval_of_a_finished_run_matches_its_summary(trained, capsys):
    """`eval`'s greedy draws and first sample are the run's final evaluation's (same prompts,
    batch and keys), so Run.evaluate's metrics come out equal; the default out file holds
    one row per example."""
    capsys.readouterr()
    assert main(["eval", "--run", str(trained["out"])]) == 0
    result = json.loads(capsys.readouterr().out)
    summary = json.loads((trained["out"] / "summary.json").read_text())
    for key in ("eval/accuracy", "eval/reward", "eval/sampled_accuracy", "eval/examples"):
        assert result[key] == summary[key], key
    assert (result["k"], result["examples"], result["step"]) == (4, 8, 4)
    assert result["temperature"] == 1.0 and result["confidence"] == 0.95
    assert result["pass@1"]["value"] == summary["eval/accuracy"]
    out = trained["out"] / "eval" / "step4-heldout-k4-t1.jsonl"
    assert result["outputs"] == str(out)
    assert len(out.read_text().splitlines()) == 8
    assert main(["eval", "--run", str(trained["out"]), "--examples", "3", "--k", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["eval/examples"] == 3


@pytest.mark.slow
def test_eval_at_k_rows_reproduce_the_printed_metrics(trained, tmp_path, capsys):
    """pass@1, mean@k, maj@k and pass@k recomputed from the per-example JSONL (by NumPy and
    an explicit vote) equal the printed ones; the intervals are Wilson / Student t."""
    out = tmp_path / "rows.jsonl"
    argv = ["eval", "--run", str(trained["out"]), "--k", "3", "--temperature", "1.5"]
    capsys.readouterr()
    assert main([*argv, "--out", str(out)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["temperature"] == 1.5 and result["outputs"] == str(out)
    rows = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert len(rows) == result["examples"] == 8
    greedy_N = np.array([r["greedy"]["correct"] for r in rows])
    correct_NK = np.array([[s["correct"] for s in r["samples"]] for r in rows])
    assert correct_NK.shape == (8, 3)
    for r in rows:
        assert r["prompt"] and r["ground_truth"] and isinstance(r["greedy"]["response"], str)
        answers = [s["answer"] for s in r["samples"]]
        votes = {a: answers.count(a) for a in answers if a is not None}
        if not votes:
            assert r["majority"] == {"answer": None, "votes": 0, "correct": False}
            continue
        top = max(votes.values())
        first = next(a for a in answers if votes.get(a) == top)  # ties: sampled first
        assert (r["majority"]["answer"], r["majority"]["votes"]) == (first, top)
        assert r["majority"]["correct"] == r["samples"][answers.index(first)]["correct"]
    maj_N = np.array([r["majority"]["correct"] for r in rows])
    assert result["pass@1"]["value"] == greedy_N.mean()
    assert result["mean@3"]["value"] == pytest.approx(correct_NK.mean(axis=1).mean(), abs=1e-12)
    assert result["maj@3"]["value"] == maj_N.mean()
    assert result["pass@3"]["value"] == correct_NK.any(axis=1).mean()
    assert result["pass@1"]["interval"] == "wilson" and result["mean@3"]["interval"] == "t"
    assert "Wilson" in result["intervals"]["maj@3"] and "t" in result["intervals"]["mean@3"]
    for name in ("pass@1", "maj@3", "pass@3"):
        assert result[name]["low"] <= result[name]["value"] <= result[name]["high"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--k", "0"], ["--k 0", "[1, 2**31)"]),
        (["--temperature", "0"], ["--temperature 0", "> 0"]),
        (["--data", "/nonexistent.jsonl"], ["'/nonexistent.jsonl'", "not a file"]),
    ],
)
def test_eval_option_errors(trained, capsys, argv, fragments):
    assert main(["eval", "--run", str(trained["out"]), *argv]) == 2
    line = error_line(capsys)
    for fragment in fragments:
        assert fragment in line, line


@pytest.mark.slow
def test_eval_data_needs_a_file_task(trained, tmp_path, capsys):
    data = tmp_path / "test.jsonl"
    data.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    assert main(["eval", "--run", str(trained["out"]), "--data", str(data)]) == 2
    line = error_line(capsys)
    assert "'arithmetic' is generated" in line and "gsm8k, math" in line


@pytest.mark.slow
def test_sample_from_a_finished_run(trained, capsys):
    argv = [
        "sample",
        "--run",
        str(trained["out"]),
        "--prompt",
        "12+3=",
        "--n",
        "3",
        "--max-new-tokens",
        "5",
        "--seed",
        "1",
    ]
    capsys.readouterr()
    assert main(argv) == 0
    first = capsys.readouterr().out
    lines = [json.loads(ln) for ln in first.splitlines()]
    assert len(lines) == 3
    for line in lines:
        assert line["prompt"] == "12+3=" and isinstance(line["response"], str)
        assert len(line["response"]) <= 5
        assert math.isfinite(line["logp"]) and line["logp"] <= 0
    assert main(argv) == 0
    assert capsys.readouterr().out == first  # the seed fixes the samples


@pytest.mark.slow
def test_sample_with_a_character_outside_the_vocabulary(trained, capsys):
    code = main(["sample", "--run", str(trained["out"]), "--prompt", "12+3=?"])
    assert code == 2
    assert "'?'" in error_line(capsys)


@pytest.mark.slow
def test_export_hf_round_trips_the_params(trained, tmp_path, capsys):
    hf_dir = tmp_path / "hf"
    assert main(["export-hf", "--run", str(trained["out"]), "--to", str(hf_dir)]) == 0
    assert str(hf_dir) in capsys.readouterr().out
    assert (hf_dir / "config.json").is_file() and (hf_dir / "model.safetensors").is_file()

    run = Run(load_config(trained["out"] / "config.yaml"), trained["out"])
    assert run.restore() == 4
    saved = jax.device_get(run.state.params)  # float32 master weights, saved as float32
    config, params = load_hf(hf_dir, dtype=jnp.float32)
    assert config == run.model_config
    flat, tree = jax.tree_util.tree_flatten(params)
    flat_saved, tree_saved = jax.tree_util.tree_flatten(saved)
    assert tree == tree_saved
    for got, want in zip(flat, flat_saved, strict=True):
        assert want.dtype == np.float32 and np.abs(want).max() > 0
        np.testing.assert_array_equal(np.asarray(got), want, strict=True)
    _, params_bf16 = load_hf(hf_dir)  # the default dtype: bfloat16
    for got, want in zip(jax.tree_util.tree_leaves(params_bf16), flat_saved, strict=True):
        np.testing.assert_array_equal(np.asarray(got), want.astype(jnp.bfloat16), strict=True)


# ---- user errors: exit status 2, one line -------------------------------------------------------


def test_missing_model_checkpoint_directory(config_file, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(
        [
            "train",
            "--config",
            str(config_file),
            "--set",
            "model.checkpoint=/nonexistent",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 2
    line = error_line(capsys)
    assert "'/nonexistent'" in line and "does not exist" in line
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["--set", "rollout.group_size=1"], ["rollout.group_size=1", ">= 2"]),
        (["--set", "rollout.fromat=bf16"], ["'rollout.fromat'", "valid keys in rollout"]),
        (["--set", "rollout.top_p"], ["--set 'rollout.top_p'", "section.key=value"]),
        (["--set", "rollout.format=fp8"], ["rollout.format='fp8'", "'float8_e4m3fn'"]),
        (["--set", "correction.method=is"], ["correction.method='is'", "'ais'"]),
        (
            ["--config", "/nonexistent/config.yaml"],
            ["'/nonexistent/config.yaml'", "does not exist"],
        ),
    ],
)
def test_bad_config_is_one_line_and_exit_status_2(tmp_path, capsys, argv, fragments):
    assert main(["train", *argv, "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    line = error_line(capsys)
    assert line.startswith("ais-jax train: error: ")
    for fragment in fragments:
        assert fragment in line, line


def test_eval_of_a_directory_that_is_not_a_run(tmp_path, capsys):
    assert main(["eval", "--run", str(tmp_path)]) == 2
    line = error_line(capsys)
    assert str(tmp_path) in line and "not a training run directory" in line


@pytest.mark.slow
def test_console_script_reports_errors_without_a_traceback(tmp_path):
    """The installed `ais-jax` entry point, as a user runs it."""
    script = Path(sys.executable).parent / "ais-jax"
    assert script.is_file(), script
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [str(script), "train", "--set", "rollout.group_size=1", "--out", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("ais-jax train: error: rollout.")


@pytest.mark.slow
def test_resume_without_config_continues_the_runs_own_config(trained, tmp_path, capsys):
    """`train --out DIR --resume` reads DIR/config.yaml, not the embedded quickstart."""
    import shutil

    run_dir = tmp_path / "copy"
    shutil.copytree(trained["out"], run_dir)
    code = main(["train", "--out", str(run_dir), "--resume", "--set", "steps=5", "--no-progress"])
    assert code == 0, capsys.readouterr().err
    rows = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    resumed = load_config(run_dir / "config.yaml")  # the run's config, with the new length
    assert resumed.model.num_layers == 1 and resumed.steps == 5


@pytest.mark.slow
def test_resume_under_another_config_is_refused_naming_the_settings(
    trained, config_file, tmp_path, capsys
):
    """`train --config X --resume` where X is another experiment than the run's config.yaml
    (here: another learning rate and seed) is one error line naming both settings and their
    values; nothing in the run directory changes."""
    import shutil

    run_dir = tmp_path / "copy"
    shutil.copytree(trained["out"], run_dir)
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    other = tmp_path / "other.yaml"
    cfg = from_dict(TrainConfig, TINY)
    other.write_text(
        dump_config(
            dataclasses.replace(
                cfg, seed=7, optim=dataclasses.replace(cfg.optim, learning_rate=0.5)
            )
        )
    )
    capsys.readouterr()
    argv = ["train", "--config", str(other), "--out", str(run_dir), "--resume", "--no-progress"]
    assert main(argv) == 2
    line = error_line(capsys)
    assert f"optim.learning_rate: 0.001 in {run_dir / 'config.yaml'}, 0.5 given" in line
    assert "seed: 0 in" in line and "may change only steps" in line
    after = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file() and p.name != ".lock"}
    assert after == {p: b for p, b in before.items() if p.name != ".lock"}


def test_plot_smoothing_is_a_trailing_mean():
    from ais_jax.analysis.plots import trailing_mean

    values = [0.0, 1.0, 5.0, 2.0, 7.0]
    expected = [np.mean(values[max(0, i - 2) : i + 1]) for i in range(len(values))]
    np.testing.assert_allclose(trailing_mean(values, 3), expected)
    assert trailing_mean(values, 1) == values


def _parsers(parser, path=()):
    """``(argv prefix, parser)`` for the top-level parser and every subcommand, read from the
    parser itself so a new subcommand is covered without editing this test."""
    import argparse

    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def test_help_of_every_command_renders(capsys):
    from ais_jax.cli.main import build_parser

    found = list(_parsers(build_parser()))
    assert {p[0] for p, _ in found if p} >= {"train", "eval", "sample", "compare", "plan"}
    for path, _ in found:
        for flag in ("--help", "-h"):
            assert main([*path, flag]) == 0, (path, flag)
            out, err = capsys.readouterr()
            assert out.startswith(f"usage: ais-jax {' '.join(path)}".rstrip()), (path, out[:80])
            assert err == "" and "%%" not in out, (path, err, out)


def test_top_level_help_lists_one_line_per_command(capsys):
    from ais_jax.cli.main import build_parser

    commands = [p[0] for p, _ in _parsers(build_parser()) if len(p) == 1]
    assert main(["--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name in commands:
        (line,) = [ln for ln in lines if ln.split()[:1] == [name]]
        assert len(line.split()) > 2, line  # the help text on the command's own line


def test_version_names_the_package_and_jax(capsys):
    from importlib import metadata

    from ais_jax import __version__

    for flag in ("--version", "-V"):
        assert main([flag]) == 0
        out = capsys.readouterr().out.strip()
        assert out == (
            f"ais-jax {__version__} (jax {metadata.version('jax')}, "
            f"jaxlib {metadata.version('jaxlib')})"
        )
