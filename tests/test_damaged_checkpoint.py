"""A damaged checkpoint under every command that reads one (`ais-jax train --resume`, `eval`,
`sample --run`, `export-hf`, `compare` resuming a run or starting from one): exit status 2 and
one error line on stderr and nothing else, never a traceback,
ending in a remedy that command has; and `--step` picks another checkpoint.

The commands run in subprocesses (`WORKER`), so stderr is the real one, tracebacks printed at
exit included. orbax reads every array of a checkpoint at once and stops at the first failure;
the tracebacks came from the reads still in flight then (checkpoint.py), a race: eval runs 10
times in one process, and every command runs once with its reads held, which makes the race
certain.

One tiny run (steps 0 and 1) is trained once; each test damages a copy of it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from training_run import TINY_RUN

from ais_jax.cli.main import main
from ais_jax.config import TrainConfig, dump_config, from_dict
from ais_jax.experiments.compare import parse_arm

pytestmark = pytest.mark.slow  # every test reads a run the module fixture trains

ARM = parse_arm("bf16")
# ``python -c WORKER ARGV`` is ``ais-jax ARGV``, $REPEAT times over in one process (default
# once). With $HELD_READS set, every array read that succeeds is held in flight (in tensorstore,
# as by a slow disk) for 0.5 s, so the damaged array's read fails while the others are still
# running, as it does by chance on a busy machine; each held read adds a line to the file
# $HELD_READS names, so a test knows that the race did happen.
WORKER = """
import os, sys, threading

if os.environ.get("HELD_READS"):
    import tensorstore as ts
    from orbax.checkpoint._src.serialization import serialization

    read = serialization._read_shard

    async def held(*args, **kwargs):
        shard = await read(*args, **kwargs)
        with open(os.environ["HELD_READS"], "a") as f:
            f.write("held\\n")
        promise, released = ts.Promise.new()
        threading.Timer(0.5, promise.set_result, (None,)).start()
        await released
        return shard

    serialization._read_shard = held

from ais_jax.cli.main import main

statuses = {main(sys.argv[1:]) for _ in range(int(os.environ.get("REPEAT", "1")))}
sys.exit(statuses.pop() if len(statuses) == 1 else 99)
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    """A finished run of the bf16 arm of ``base.yaml`` (checkpoints of steps 0 and 1), that
    base config (what `compare` is run with) and its seed."""
    tmp = tmp_path_factory.mktemp("damaged")
    sft = {**TINY_RUN["sft"], "steps": 4}  # what it learns does not matter here
    base = from_dict(TrainConfig, {**TINY_RUN, "steps": 1, "checkpoint_every": 1, "sft": sft})
    (tmp / "base.yaml").write_text(dump_config(base))
    (tmp / "run.yaml").write_text(dump_config(ARM.config(base, base.seed)))
    out = tmp / "run"
    argv = ["train", "--config", str(tmp / "run.yaml"), "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir()) == [0, 1]
    return {"run": out, "base": tmp / "base.yaml", "seed": base.seed}


def damaged_copy(trained, to: Path) -> Path:
    """A copy of the trained run whose newest checkpoint (step 1) has its largest array file
    cut in half: that array cannot be read, the others can."""
    run = Path(shutil.copytree(trained["run"], to))
    data = [p for p in (run / "checkpoints" / "1" / "state").rglob("*") if p.parent.name == "d"]
    largest = max(data, key=lambda p: p.stat().st_size)
    largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 2])
    return run


def start(argv, tmp_path: Path, *, held: bool = False, repeat: int = 1):
    """`WORKER` running ``ais-jax ARGV`` ``repeat`` times, with reads held if ``held``; returns
    the process and the file its held reads are counted in."""
    held_file = tmp_path / f"held-{os.urandom(4).hex()}"
    env = {**os.environ, "REPEAT": str(repeat), "HELD_READS": str(held_file) if held else ""}
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, *map(str, argv)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, held_file


def finish(started) -> tuple[int, str, int]:
    """``(exit status, stderr, reads held)`` of a process from `start`."""
    proc, held_file = started
    _, err = proc.communicate(timeout=300)
    held = len(held_file.read_text().splitlines()) if held_file.exists() else 0
    return proc.returncode, err, held


def error_line(command: str, status: int, err: str) -> str:
    """The one line a damaged checkpoint makes ``command`` print, checked: exit status 2 and
    nothing else on stderr."""
    assert status == 2, err[-3000:]
    lines = err.splitlines()
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith(f"ais-jax {command}: error: Checkpoint could not be read"), lines
    assert "checkpoints/1:" in lines[0], lines
    return lines[0]


def test_eval_says_one_line_naming_step_every_time(trained, tmp_path):
    """10 runs as they come (one process) and one with the race made certain: one line each,
    ending in --step and the run's other checkpoint, not in train's --resume-fallback."""
    run = damaged_copy(trained, tmp_path / "run")
    argv = ["eval", "--run", run, "--examples", "4"]
    as_they_come, raced = start(argv, tmp_path, repeat=10), start(argv, tmp_path, held=True)
    status, err, _ = finish(as_they_come)
    lines = err.splitlines()
    assert len(lines) == 10, err[-3000:]  # one line a run (the array named may differ)
    status_raced, err_raced, held = finish(raced)
    assert held > 0, "no read was held: HELD_READS no longer reaches orbax's reads"
    remedy = f"Pick another checkpoint with --step N ({run} also has step 0)."
    checked = [error_line("eval", status, line) for line in lines]
    for line in [*checked, error_line("eval", status_raced, err_raced)]:
        assert line.endswith(remedy) and "fallback" not in line, line


@pytest.mark.parametrize("command", ["train", "sample", "export-hf", "compare", "compare-start"])
def test_every_reader_says_one_line_with_its_own_remedy(trained, tmp_path, command):
    """Each command once, with the race made certain (`HELD_READS`)."""
    run = damaged_copy(trained, tmp_path / "run")
    base = ["--config", trained["base"], "--arms", ARM.name, "--seeds", "1", "--no-progress"]
    out_dir = None
    if command == "train":
        argv = ["train", "--out", run, "--resume", "--no-progress"]
        out_dir = run
        remedy = f"Add --resume-fallback to resume from the newest readable one of {run}'s other "
        remedy += "checkpoints (step 0)."
    elif command == "sample":
        argv = ["sample", "--run", run, "--prompt", "1+1=", "--n", "1"]
        remedy = f"Pick another checkpoint with --step N ({run} also has step 0)."
    elif command == "export-hf":
        argv = ["export-hf", "--run", run, "--to", tmp_path / "hf"]
        remedy = f"Pick another checkpoint with --step N ({run} also has step 0)."
    elif command == "compare":  # an interrupted comparison whose one run has a damaged checkpoint
        out_dir = tmp_path / "compare"
        seed_dir = out_dir / ARM.dirname / f"seed{trained['seed']}"
        seed_dir.parent.mkdir(parents=True)
        run.rename(seed_dir)
        (seed_dir / "summary.json").unlink()
        argv = ["compare", *base, "--out", out_dir]
        remedy = (
            f"Delete {seed_dir}/checkpoints/1 to resume {ARM.name} seed {trained['seed']} from "
            f"step 0 (or {seed_dir} to train it again), then run the comparison again with the "
            "same --out."
        )
    else:
        out_dir = tmp_path / "compare"
        argv = ["compare", *base, "--start", run, "--out", out_dir]
        remedy = f"Start from another of its checkpoints with --start {run}@STEP (step 0)."
    status, err, held = finish(start(argv, tmp_path, held=True))
    line = error_line(argv[0], status, err)
    assert line.endswith(remedy), line
    assert held > 0, "no read was held: HELD_READS no longer reaches orbax's reads"
    if command != "train":
        assert "fallback" not in line, line


def test_step_picks_another_checkpoint(trained, tmp_path, capsys):
    """``--step 0`` reads the older, intact checkpoint of a run whose newest is damaged (eval
    and export-hf); a step with no checkpoint is one line naming those there are."""
    run = damaged_copy(trained, tmp_path / "run")
    assert main(["eval", "--run", str(run), "--step", "0", "--examples", "2", "--k", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["step"] == 0 and result["examples"] == 2, result
    assert Path(result["outputs"]).name.startswith("step0-"), result
    assert main(["export-hf", "--run", str(run), "--step", "0", "--to", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").is_file()
    capsys.readouterr()
    assert main(["eval", "--run", str(run), "--step", "7"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"ais-jax eval: error: --step 7 is invalid: {run} has checkpoints of steps 0, 1."
    ]
