"""Reliability specifications: crashes, bad input, numerical extremes and what inputs may do.

1. Crash and resume. `ais-jax train` is SIGKILLed at seeded random points of three kinds -- at
   the start of a rollout, at the start of an update, and inside a checkpoint write (files on
   disk, folder not committed) -- and resumed after each kill; the finished run's metrics
   (less ``time/*``) and final train state equal, bitwise on CPU, those of one uninterrupted
   run, and the half-written checkpoint is never listed or loaded. (tests/test_train.py covers
   one kill at a step boundary and damaged checkpoints with ``--resume-fallback``.)
2. Bad input ends in one line ``ais-jax <command>: error: ...`` and exit status 2 -- never a
   traceback from JAX, orbax or grain -- for the cases tests/test_cli.py does not already run
   through the command line: data files, prompts that do not fit, tokenizers and checkpoints
   that do not belong to the model, reward functions that fail, meshes.
3. Numerical extremes: a non-finite minibatch is skipped and counted, never applied; all-equal
   rewards give a finite no-op step; +-1e4 log-ratios stay finite; FP8/FP4 rollout copies of
   zero, huge and subnormal weights stay finite.
4. Inputs never execute code or write outside the run directory: an AST scan of the package for
   pickle, eval/exec, unsafe YAML, torch.load and np.load(allow_pickle=True); weights are read
   from safetensors only; `paths.safe_path` refuses ``..``.
5. Operating a run, with real processes, signals, locks and file-size limits: an --out that is a
   file or read-only, a second writer on one --out (refused while the first lives, never after
   a SIGKILL), SIGINT/SIGTERM (the step is finished and checkpointed, one line says how to
   resume, 130/143; a second SIGINT stops at once), a full disk (one line, no thread
   tracebacks, resumable), YAML alias bombs and duplicate keys, numbers out of range, NaN in
   printed or written JSON (null, with a warning saying where), and damaged or reused run
   directories (torn last lines, a missing newest checkpoint, old rows kept until replaced).

The subprocess runs share a persistent compilation cache (JAX_COMPILATION_CACHE_DIR), so only
the first of them compiles: the rest take seconds.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import errno
import functools
import gc
import json
import logging
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from training_run import TINY_RUN

import ais_jax
from ais_jax import grpo
from ais_jax.cli.main import main
from ais_jax.config import (
    CorrectionConfig,
    MeshConfig,
    OptimConfig,
    RolloutConfig,
    TrainConfig,
    dump_config,
    from_dict,
    load_config,
)
from ais_jax.io.checkpoint import Checkpointer, write_config
from ais_jax.io.hf import CheckpointError, load_hf, save_hf
from ais_jax.io.paths import safe_path, write_json
from ais_jax.io.run_log import append_jsonl
from ais_jax.models import init_params
from ais_jax.models.qwen3 import ModelConfig
from ais_jax.nn.quant import QArray, linear
from ais_jax.parallel.sharding import make_mesh
from ais_jax.tasks import Arithmetic, Example, RewardError, make_task
from ais_jax.tasks import catalog as task_catalog
from ais_jax.train.data import score_responses
from ais_jax.train.run import Run
from ais_jax.train.step import Batch, make_phases, score, sync_rollout_params

WORKER = Path(__file__).with_name("reliability_worker.py")
MODEL = {
    "num_layers": 1,
    "hidden_size": 32,
    "num_heads": 2,
    "num_kv_heads": 1,
    "head_dim": 16,
    "intermediate_size": 64,
}
# 40 SFT steps make one-digit sums answerable sometimes, so rewards differ within groups and the
# RL steps have gradients: the resumed-equals-uninterrupted comparison is not one of zeros.
CRASH = {
    **TINY_RUN,
    "steps": 6,
    "checkpoint_every": 2,
    "model": MODEL,
    "task": {**TINY_RUN["task"], "eval_examples": 4},
}
# For command-line errors: a run that would be quick if it ever got going.
QUICK = {
    "steps": 2,
    "model": MODEL,
    "task": {"options": {"ops": ["+"], "min_digits": 1, "max_digits": 1}, "eval_examples": 2},
    "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4, "max_prompt_len": 8},
    "sft": {"steps": 2, "batch_size": 4},
}


def config_from(base: dict, **sections) -> TrainConfig:
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return from_dict(TrainConfig, data)


def yaml_file(path: Path, cfg: TrainConfig) -> Path:
    path.write_text(dump_config(cfg))
    return path


def read_rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def cli_error(capsys, argv: list[str], *fragments: str) -> str:
    """``main(argv)`` exits 2 with exactly one ``ais-jax <command>: error:`` line on stderr that
    holds every fragment, and no traceback."""
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ": error: " in ln]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"ais-jax {argv[0]}: error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    return lines[0]


# ==== 1. crash and resume =========================================================================

# The default plan, [rollout 2, update 4, checkpoint 6], resumes from three different checkpoints
# (0: right after SFT, 2 and 4); AIS_JAX_TEST_KILL_SEED=<n> runs another plan.
KILL_SEED = int(os.environ.get("AIS_JAX_TEST_KILL_SEED", "20260519"))


def kill_plan(seed: int, steps: int, every: int) -> list[tuple[str, int]]:
    """One kill per phase at seeded random RL steps (1-based), in order: a rollout after at
    least one step ran, a later update, then the checkpoint write of a later save."""
    rng = random.Random(seed)
    rollout = rng.randint(2, steps - 3)
    update_ = rng.randint(rollout + 1, steps - 1)
    save = rng.choice([s for s in range(every, steps + 1, every) if s >= update_])
    return [("rollout", rollout), ("update", update_), ("checkpoint", save)]


@pytest.fixture(scope="module")
def worker_env(tmp_path_factory) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "AIS_JAX_TEST_KILL_AT"}
    return env | {
        "JAX_PLATFORMS": "cpu",
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path_factory.mktemp("jax_cache")),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }


def train_in_subprocess(argv, env, kill_at: str | None = None) -> subprocess.CompletedProcess:
    env = env | ({"AIS_JAX_TEST_KILL_AT": kill_at} if kill_at else {})
    return subprocess.run(
        [sys.executable, str(WORKER), "train", *argv, "--no-progress"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=600,
    )


def train_state(cfg: TrainConfig, out: Path, step: int):
    """Params, optimizer state, step and skip count of checkpoint ``step``, on the host."""
    run = Run(cfg, out)
    _, restored, _ = run.checkpointer.restore(run.checkpoint_template(), step)
    return jax.device_get(restored["train"])


def test_kill_plan_covers_every_phase_in_order():
    for seed in range(50):
        plan = kill_plan(seed, steps=6, every=2)
        assert [p for p, _ in plan] == ["rollout", "update", "checkpoint"]
        steps = [s for _, s in plan]
        assert 2 <= steps[0] < steps[1] <= steps[2] <= 6 and steps[2] % 2 == 0, plan


@pytest.mark.slow
def test_sigkill_at_random_phases_then_resume_is_bitwise_the_uninterrupted_run(
    worker_env, tmp_path
):
    """Three SIGKILLs (rollout, update, checkpoint write), each followed by ``--resume`` from the
    newest committed checkpoint, end with the metrics and train state of an uninterrupted run."""
    cfg = from_dict(TrainConfig, CRASH)
    config_file = yaml_file(tmp_path / "config.yaml", cfg)
    saves = list(range(cfg.checkpoint_every, cfg.steps + 1, cfg.checkpoint_every))

    reference = tmp_path / "reference"
    proc = train_in_subprocess(["--config", str(config_file), "--out", str(reference)], worker_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref_rows = read_rows(reference)
    learned = [r["step"] for r in ref_rows if r["train/grad_norm"] > 0 and r["reward/std"] > 0]
    assert len(learned) >= 3, ref_rows  # the comparison below is not one of no-op steps

    out = tmp_path / "killed"
    argv = ["--config", str(config_file), "--out", str(out)]
    plan = kill_plan(KILL_SEED, cfg.steps, cfg.checkpoint_every)
    resume_at = None  # the newest committed checkpoint: where the next run must resume
    for i, (phase, step) in enumerate(plan):
        resume = ["--resume"] if i else []
        proc = train_in_subprocess([*argv, *resume], worker_env, kill_at=f"{phase}:{step}")
        where = f"kill {i + 1} of {plan}"
        assert proc.returncode == -signal.SIGKILL, f"{where}: {proc.stderr[-3000:]}"
        if resume_at is not None:
            assert f"Resumed from {out / 'checkpoints'} at step {resume_at}" in proc.stderr, where
        # what is on disk: committed checkpoints before the kill, rows up to the last step done
        committed = [0] + [s for s in saves if s < step]
        resume_at = committed[-1]
        done = step if phase == "checkpoint" else step - 1
        assert [r["step"] for r in read_rows(out)] == list(range(1, done + 1)), where
        if phase == "checkpoint":  # every array written, the folder not yet committed
            partial = out / "checkpoints" / f"{step}.orbax-checkpoint-tmp"
            written = [p for p in partial.rglob("*") if p.is_file()]
            assert any(p.parent.name == "d" for p in written), f"{where}: no arrays in {partial}"
        kept = sorted({0, *committed[-3:]})  # step 0 (the warm start) and the newest three
        assert Checkpointer(out / "checkpoints").steps() == kept, where

    proc = train_in_subprocess([*argv, "--resume"], worker_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"at step {resume_at}" in proc.stderr  # not the half-written checkpoint
    assert Checkpointer(out / "checkpoints").steps() == [0, *saves[-3:]]

    strip = lambda r: {k: v for k, v in r.items() if not k.startswith("time/")}  # noqa: E731
    assert [strip(r) for r in read_rows(out)] == [strip(r) for r in ref_rows]
    # a run killed before its end wrote no summary: the start's entries come from start_summary.json
    got_summary, ref_summary = (
        json.loads((d / "summary.json").read_text()) for d in (out, reference)
    )
    start = {k: v for k, v in ref_summary.items() if k.startswith(("initial/", "sft/"))}
    assert start["sft/final_loss"] is not None and any(k.startswith("initial/") for k in start)
    assert {k: got_summary.get(k) for k in start} == start
    assert got_summary["time/sft_s"] > 0
    assert "are not recorded" not in proc.stderr
    got, want = train_state(cfg, out, cfg.steps), train_state(cfg, reference, cfg.steps)
    flat_got, tree_got = jax.tree_util.tree_flatten(got)
    flat_want, tree_want = jax.tree_util.tree_flatten(want)
    assert tree_got == tree_want
    for a, b in zip(flat_got, flat_want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), strict=True)
    first = train_state(cfg, reference, saves[-3])
    assert not np.array_equal(first.params["embed"], want.params["embed"])  # training moved them


def test_resume_with_another_model_shape_names_the_difference(tmp_path, capsys):
    """A run directory's checkpoint restored under a config that builds other arrays: one
    line naming the checkpoint and the first differing arrays, not "corrupt or truncated"."""
    cfg = config_from(QUICK)
    out = tmp_path / "run"
    Run(cfg, out).save()  # step 0, as a fresh run leaves it before its first RL step
    other = yaml_file(
        tmp_path / "other.yaml", config_from(QUICK, model={"hidden_size": 64, "head_dim": 32})
    )
    line = cli_error(
        capsys,
        ["train", "--config", str(other), "--out", str(out), "--resume", "--no-progress"],
        str(out / "checkpoints" / "0"),
        "train/params/embed: stored (78, 32), expected (78, 64)",
        "config.yaml",
    )
    assert "corrupt" not in line
    kl = yaml_file(tmp_path / "kl.yaml", config_from(QUICK, loss={"kl_coef": 0.1}))
    cli_error(
        capsys,
        ["train", "--config", str(kl), "--out", str(out), "--resume", "--no-progress"],
        "ref/embed: not in the checkpoint",
    )


def test_eval_of_a_run_without_checkpoints(tmp_path, capsys):
    out = tmp_path / "run"
    write_config(config_from(QUICK), out)
    (out / "checkpoints").mkdir()
    cli_error(capsys, ["eval", "--run", str(out)], "No checkpoint to resume from in", str(out))


# ==== 2. bad input at the command line ============================================================

GSM = [
    {"question": "1+1=", "answer": "1+1=2\n#### 2"},
    {"question": "2+2=", "answer": "#### 4"},
]


def write_jsonl(path: Path, lines: list[str | bytes]) -> Path:
    path.write_bytes(b"\n".join(x if isinstance(x, bytes) else x.encode() for x in lines) + b"\n")
    return path


@pytest.fixture
def quick_config(tmp_path) -> Path:
    return yaml_file(tmp_path / "quick.yaml", config_from(QUICK))


def train_argv(config_file: Path, out: Path, *sets: str) -> list[str]:
    return ["train", "--config", str(config_file), "--out", str(out), "--no-progress"] + [
        x for s in sets for x in ("--set", s)
    ]


def gsm8k_set(path: Path, **options) -> list[str]:
    opts = ", ".join(f"{k}: {v}" for k, v in {"path": f"'{path}'", **options}.items())
    return ["task.name=gsm8k", f"task.options={{{opts}}}"]


@pytest.mark.parametrize(
    "lines, fragments",
    [
        ([], ["data.jsonl is empty: no JSON lines"]),
        (["", "   "], ["data.jsonl is empty: no JSON lines"]),
        (
            [json.dumps(GSM[0]), "", '{"question": "3+3=", "answer": "6"}'],
            ["data.jsonl:3: key 'answer' has no '#### <final answer>' marker", "on_error='skip'"],
        ),
        ([json.dumps(GSM[0]), '{"question": "3+3="'], ["data.jsonl:2: invalid JSON"]),
        (
            [json.dumps(GSM[0]), b'{"question": "\xff3+3=", "answer": "#### 6"}'],
            ["data.jsonl:2: not UTF-8 text (byte 0xff at offset 14)"],
        ),
    ],
    ids=["no-lines", "blank-lines", "no-answer-marker", "invalid-json", "not-utf8"],
)
def test_bad_jsonl_file_stops_the_run_with_file_and_line(
    tmp_path, capsys, quick_config, lines, fragments
):
    """Loading stops at the first malformed line (``on_error='raise'``, the default): dropping
    lines silently would change the data and the evaluation denominator. Nothing is written."""
    path = tmp_path / "data.jsonl"
    if lines:
        write_jsonl(path, lines)
    else:
        path.write_bytes(b"")
    out = tmp_path / "run"
    cli_error(capsys, train_argv(quick_config, out, *gsm8k_set(path)), *fragments)
    assert not out.exists()


def test_skipping_malformed_lines_is_asked_for_in_the_config(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [json.dumps(GSM[0]), "{oops", json.dumps(GSM[1])])
    cfg = load_config(None, gsm8k_set(path, on_error="skip"))
    with pytest.warns(UserWarning, match=r"data.jsonl: skipped 1 malformed line\(s\): line 2 "):
        task = make_task(cfg.task.name, **cfg.task.options)
    assert [ex.answer for ex in task.examples] == ["2", "4"]


@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_jsonl_path_that_is_not_a_file(tmp_path, capsys, quick_config, kind):
    path = tmp_path / "data.jsonl"
    if kind == "directory":
        path.mkdir()
    message = "does not exist" if kind == "missing" else "is not a file"
    cli_error(
        capsys, train_argv(quick_config, tmp_path / "run", *gsm8k_set(path)), str(path), message
    )


@pytest.mark.parametrize(
    "sets, fragments",
    [
        (["task.name=sodoku"], ["unknown task 'sodoku'", "'sudoku'"]),
        (["task.options.digits=2"], ["unknown argument(s) ['digits'] for task 'arithmetic'"]),
        (["model.preset=qwen9"], ["Unknown model preset 'qwen9'", "'qwen3-8b'"]),
        (["model.num_kv_heads=3"], ["num_heads (2) must be a multiple of num_kv_heads (3)"]),
        (
            ["task.options={a: [1"],
            ["--set 'task.options={a: [1'", "not valid YAML", "line 1, column 7"],
        ),
        # prompts are "<bos>d+d=", 5 tokens; demonstrations are "d" or "dd" then <eos>
        (["rollout.max_prompt_len=4"], ["A prompt has 5 tokens", "rollout.max_prompt_len=4"]),
        (["rollout.max_prompt_len=4", "sft.steps=0"], ["A prompt has 5 tokens"]),
        (["rollout.max_new_tokens=1"], ["A demonstration has", "max_new_tokens=1;"]),
        (["mesh.fsdp=3"], ["mesh data=-1,fsdp=3,tensor=1", "(3) does not divide the device"]),
        (["mesh.tensor=0"], ["mesh.tensor=0 is invalid: must be >= 1 or -1 (fill)"]),
    ],
    ids=[
        "task-name",
        "task-option",
        "preset",
        "heads",
        "set-yaml",
        "prompt-too-long",
        "prompt-too-long-eval",
        "demonstration-too-long",
        "mesh-does-not-divide-devices",
        "mesh-axis-zero",
    ],
)
def test_bad_setting_found_when_the_run_is_built(tmp_path, capsys, quick_config, sets, fragments):
    cli_error(capsys, train_argv(quick_config, tmp_path / "run", *sets), *fragments)


def test_invalid_yaml_file_is_one_line_with_its_position(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("rollout: {format: bf16\nsteps: [1, 2\n")
    cli_error(
        capsys,
        ["train", "--config", str(path), "--out", str(tmp_path / "run")],
        f"Config file {path} is not valid YAML",
        "line 2, column 6",
    )


def test_text_outside_the_tokenizer_vocabulary(tmp_path, capsys, quick_config):
    path = write_jsonl(
        tmp_path / "data.jsonl", [json.dumps({"question": "What is 1+1?", "answer": "#### 2"})]
    )
    cli_error(
        capsys,
        train_argv(quick_config, tmp_path / "run", *gsm8k_set(path)),
        "character '?' at position 11",
    )


# -- reward functions ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class BrokenReward:
    """One-digit sums whose reward function raises, or returns ``value``."""

    name: str = "broken"
    value: float | None = None

    def sample(self, rng: random.Random) -> Example:
        return Arithmetic(ops=("+",), min_digits=1, max_digits=1).sample(rng)

    def reward(self, example: Example, response: str) -> float:
        if self.value is None:
            raise ZeroDivisionError("bug in the reward")
        return self.value


@pytest.mark.parametrize(
    "value, fragment",
    [
        (None, "raised ZeroDivisionError('bug in the reward')"),
        (math.nan, "returned nan"),
        (math.inf, "returned inf"),
        ("one", "raised ValueError"),
    ],
)
def test_reward_function_failures_name_task_prompt_and_response(value, fragment):
    examples = [Example(prompt="1+2=", answer="3", demonstration="3")] * 2
    with pytest.raises(RewardError) as err:
        score_responses(BrokenReward(value=value), examples, ["3", "x\ny"])
    message = str(err.value)
    assert "\n" not in message
    assert "task 'broken'" in message and fragment in message and "'1+2='" in message
    assert isinstance(err.value, RuntimeError)  # still a RuntimeError for older callers


@pytest.mark.slow
def test_reward_function_raising_mid_run_is_one_line_at_the_cli(
    tmp_path, capsys, quick_config, monkeypatch
):
    monkeypatch.setitem(task_catalog.TASKS, "broken", BrokenReward)
    cli_error(
        capsys,
        train_argv(
            quick_config, tmp_path / "run", "task.name=broken", "task.options={}", "sft.steps=0"
        ),
        "Reward function of task 'broken' raised ZeroDivisionError('bug in the reward')",
        "on prompt '",
    )


# -- Hugging Face checkpoints and tokenizers at the command line -----------------------------------


def write_word_tokenizer(folder: Path, num_words: int, eos: bool = True) -> None:
    """Word ``str(i)`` is id ``i``; with ``eos``, ``<eos>`` is id ``num_words`` and named in
    generation_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {str(i): i for i in range(num_words)} | ({"<eos>": num_words} if eos else {})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    if eos:
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": num_words}))


def hf_config(vocab_size: int = 32) -> ModelConfig:
    return ModelConfig.preset("tiny", vocab_size=vocab_size, **MODEL)


@pytest.fixture
def hf_dir(tmp_path) -> Path:
    """A tiny random Qwen3 directory (32 ids, <eos> = 31) written by `save_hf`, no torch."""
    config = hf_config()
    path = save_hf(tmp_path / "hf", config, init_params(config, jax.random.key(0)))
    write_word_tokenizer(path, 31)
    return path


def _wrong_shape(path: Path) -> str:
    import safetensors.numpy

    file = path / "model.safetensors"
    tensors = safetensors.numpy.load_file(str(file))
    tensors["model.layers.0.mlp.up_proj.weight"] = np.zeros((64, 16), np.float32)
    safetensors.numpy.save_file(tensors, str(file), metadata={"format": "pt"})
    return "tensor 'model.layers.0.mlp.up_proj.weight' has shape (64, 16), expected (64, 32)"


def _other_architecture(path: Path) -> str:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral")
    (path / "config.json").write_text(json.dumps(cfg))
    return "unsupported architecture 'MistralForCausalLM'"


def _empty(path: Path) -> str:
    for f in path.iterdir():
        f.unlink()
    return "config.json is missing"


def _big_tokenizer(path: Path) -> str:
    write_word_tokenizer(path, 95)
    return "Tokenizer vocabulary (96 ids) is larger than the model's vocab_size (32)"


def _eos_outside(path: Path) -> str:
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 40}))
    return "Tokenizer special id(s) {'eos_id': 40, 'pad_id': 40} are outside"


def _no_eos(path: Path) -> str:
    (path / "generation_config.json").unlink()
    write_word_tokenizer(path, 31, eos=False)
    return "tokenizer.json: no end-of-sequence token"


def _pickle_only(path: Path) -> str:
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    return "No *.safetensors file"


def _generation_config_not_json(path: Path) -> str:
    (path / "generation_config.json").write_text('{"eos_token_id": ')
    return f"{path / 'generation_config.json'} is not valid JSON"


def _generation_config_not_utf8(path: Path) -> str:
    (path / "generation_config.json").write_bytes(b"\x89PNG\r\n")
    return f"{path / 'generation_config.json'} is not UTF-8 text (byte 0x89 at offset 0)"


def _generation_config_a_list(path: Path) -> str:
    (path / "generation_config.json").write_text("[31]")
    return f"{path / 'generation_config.json'} must hold a JSON object, got list"


def _eos_not_an_id(path: Path) -> str:
    (path / "generation_config.json").write_text('{"eos_token_id": "<eos>"}')
    return "generation_config.json: eos_token_id must be a token id or a list of token ids"


@pytest.mark.parametrize(
    "breaker",
    [
        _empty,
        _wrong_shape,
        _other_architecture,
        _big_tokenizer,
        _eos_outside,
        _no_eos,
        _pickle_only,
        _generation_config_not_json,
        _generation_config_not_utf8,
        _generation_config_a_list,
        _eos_not_an_id,
    ],
    ids=lambda f: f.__name__.strip("_"),
)
def test_model_checkpoint_that_cannot_be_used(tmp_path, capsys, quick_config, hf_dir, breaker):
    fragment = breaker(hf_dir)
    sets = [f"model.checkpoint={hf_dir}"]
    cli_error(capsys, train_argv(quick_config, tmp_path / "run", *sets), fragment)


# -- meshes and compare ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (
            ["--mesh", "data=1,fsdp=8,tensor=1", "--batch", "60"],
            ["batch=60 is not divisible by mesh data x fsdp = 8"],
        ),
        (["--mesh", "data=1,fsdp=0,tensor=1"], ["mesh.fsdp=0 is invalid", ">= 1 or -1"]),
        (["--mesh", "data=-1"], ["data=-1 needs a device count"]),
        (["--mesh", "pipeline=2"], ["'pipeline=2' must look like AXIS=INT"]),
    ],
    ids=["batch-not-divisible", "zero-axis", "fill-without-devices", "unknown-axis"],
)
def test_bad_mesh_for_plan(capsys, argv, fragments):
    cli_error(capsys, ["plan", "--model", "qwen3-0.6b", *argv], *fragments)


def test_compare_arm_names_cannot_be_paths(tmp_path, capsys):
    out = tmp_path / "cmp"
    cli_error(
        capsys,
        ["compare", "--arms", "bf16,../../escape", "--out", str(out), "--no-progress"],
        "Unknown arm(s) ['../../escape']",
    )
    assert list(out.iterdir()) == []


# ==== 3. numerical extremes =======================================================================

N, P, T = 8, 4, 5  # rows (2 prompts x G=4), prompt length, response length
TINY_LM = ModelConfig.preset("tiny", vocab_size=32, **MODEL)
OPTIM = OptimConfig(learning_rate=1e-3, weight_decay=0.01)


@functools.cache
def _phases():
    """The production phases of a 4-step run with `OPTIM` and AIS, on this process's device."""
    cfg = TrainConfig(steps=4, optim=OPTIM, correction=CorrectionConfig(method="ais"))
    return make_phases(make_mesh(MeshConfig()), cfg, TINY_LM)


@pytest.fixture(scope="module")
def batch_and_params():
    """A rollout batch of random tokens (last response token is padding) scored by the model,
    with distinct rewards in each group of 4."""
    params = init_params(TINY_LM, jax.random.key(0))
    rng = np.random.default_rng(0)
    prompts = jnp.asarray(rng.integers(3, 32, (N, P)), jnp.int32)
    tokens = jnp.asarray(rng.integers(3, 32, (N, T)), jnp.int32)
    mask = jnp.asarray(np.arange(T)[None, :].repeat(N, 0) < T - 1)
    logp, _ = score(
        params, TINY_LM, prompts, jnp.ones((N, P), bool), tokens, mask, jnp.float32(1.0)
    )
    rewards = jnp.asarray([0.0, 1.0, 0.5, 0.0, 1.0, 1.0, 0.0, 0.25], jnp.float32)
    batch = Batch(
        prompt_tokens=prompts,
        prompt_mask=jnp.ones((N, P), bool),
        tokens=tokens,
        mask=mask,
        logp_rollout=logp + 0.01,
        logp_old=logp,
        advantages=grpo.group_advantages(rewards, 4),
    )
    return batch, params


def run_update(params, batch: Batch):
    """One update from a fresh optimizer state; returns (state before, state after, metrics),
    all on the host (`update` donates its input state)."""
    state = _phases().init(params)
    before = jax.device_get(state)
    after, metrics = _phases().update(state, batch, jax.random.key(1))
    return before, jax.device_get(after), {k: float(v) for k, v in jax.device_get(metrics).items()}


def assert_tree_equal(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), strict=True)


def assert_all_finite(tree):
    for x in jax.tree_util.tree_leaves(tree):
        assert np.isfinite(np.asarray(x, np.float32)).all()


@pytest.mark.slow
@pytest.mark.parametrize("field", ["advantages", "logp_rollout", "logp_old"])
def test_non_finite_minibatch_is_skipped_and_counted(batch_and_params, field):
    batch, params = batch_and_params
    value = getattr(batch, field)
    poisoned = value.at[3].set(jnp.nan) if value.ndim == 1 else value.at[3, 0].set(jnp.nan)
    before, after, metrics = run_update(params, batch.replace(**{field: poisoned}))
    assert_tree_equal(after.params, before.params)
    assert_tree_equal(after.opt_state, before.opt_state)  # Adam's count and moments too
    assert metrics["train/skipped_steps"] == 1 and metrics["train/skipped"] == 1
    assert int(after.skipped) == 1 and int(after.step) == 1  # the RL step itself is counted


@pytest.mark.slow
def test_non_finite_value_under_padding_changes_nothing(batch_and_params):
    batch, params = batch_and_params
    _, clean, clean_metrics = run_update(params, batch)
    junk = batch.replace(
        logp_rollout=batch.logp_rollout.at[:, T - 1].set(jnp.nan),
        logp_old=batch.logp_old.at[:, T - 1].set(jnp.inf),
    )
    _, after, metrics = run_update(params, junk)
    assert metrics["train/skipped_steps"] == 0 and clean_metrics["train/grad_norm"] > 0
    assert_tree_equal(after.params, clean.params)
    assert metrics == clean_metrics


@pytest.mark.slow
def test_identical_rewards_give_zero_advantages_and_a_decay_only_step(batch_and_params):
    batch, params = batch_and_params
    advantages = grpo.group_advantages(jnp.full((N,), 0.7, jnp.float32), 4)
    np.testing.assert_array_equal(np.asarray(advantages), 0.0)
    before, after, metrics = run_update(params, batch.replace(advantages=advantages))
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["train/grad_norm"] == 0 and metrics["train/skipped_steps"] == 0
    adam = after.opt_state[1][0]
    assert_tree_equal(adam.mu, jax.tree_util.tree_map(np.zeros_like, adam.mu))
    assert_tree_equal(adam.nu, jax.tree_util.tree_map(np.zeros_like, adam.nu))
    lr, wd = OPTIM.learning_rate, OPTIM.weight_decay
    for got, p in zip(
        jax.tree_util.tree_leaves(after.params),
        jax.tree_util.tree_leaves(before.params),
        strict=True,
    ):
        np.testing.assert_allclose(got, p - np.float32(lr * wd) * p, rtol=1e-6, atol=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("field", ["logp_rollout", "logp_old"])
def test_log_ratio_extremes_stay_finite(batch_and_params, field):
    """+-1e4 between rollout and trainer log-probs (rho_rt) or between the policy and its
    pre-update copy (rho_on): log-ratios are clipped before exp, the step is taken, and every
    metric and parameter is finite."""
    batch, params = batch_and_params
    sign = jnp.where(jnp.arange(N)[:, None] % 2 == 0, 1.0, -1.0)
    extreme = batch.logp_old + sign * 1e4
    _, after, metrics = run_update(params, batch.replace(**{field: extreme}))
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["train/skipped_steps"] == 0
    assert_all_finite(after.params)
    assert_all_finite(after.opt_state)
    if field == "logp_rollout":  # a real step: the weights are capped at C, not dropped
        assert metrics["train/grad_norm"] > 0
        assert metrics["is/weight_max"] <= CorrectionConfig().clip
    else:  # the log-ratios saturate their finite clip range (and the PPO clip): no gradient
        assert metrics["train/grad_norm"] == 0 and metrics["loss/clip_frac_low"] > 0


def _extreme_params() -> dict:
    """Trainer params whose linear weights are all-zero (q), huge (k, 1e30), float32
    subnormal (v) and mixed tiny/huge (o), built in NumPy (XLA on CPU flushes subnormal
    results of its own arithmetic)."""
    params = jax.device_get(init_params(TINY_LM, jax.random.key(0)))
    layers = dict(params["layers"])
    layers["q_proj"] = np.zeros_like(layers["q_proj"])
    layers["k_proj"] = np.where(layers["k_proj"] > 0, 1e30, -1e30).astype(np.float32)
    layers["v_proj"] = (layers["v_proj"] * np.float32(1e-39)).astype(np.float32)
    o = layers["o_proj"].copy()
    o[..., 0, 0], o[..., 1, 1] = 1e30, 1e-40
    layers["o_proj"] = o
    return {**params, "layers": layers}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"])
def test_rollout_copy_of_extreme_weights_stays_finite(fmt):
    params = _extreme_params()
    assert (np.abs(params["layers"]["v_proj"]) < np.finfo(np.float32).tiny).all()
    rollout = sync_rollout_params(params, RolloutConfig(format=fmt))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 32)), jnp.float32)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):  # every input dim is D = H*E = 32
        q = rollout["layers"][name]
        assert isinstance(q, QArray)
        codes, scale = np.asarray(q.quant.astype(jnp.float32)), np.asarray(q.scale)
        assert np.isfinite(codes).all() and np.isfinite(scale).all() and (scale > 0).all(), name
        assert np.isfinite(np.asarray(q.dequantize())).all(), name
        y = linear(x, QArray(quant=q.quant[0], scale=q.scale[0], fmt=q.fmt))
        assert np.isfinite(np.asarray(y)).all(), name
    np.testing.assert_array_equal(np.asarray(rollout["layers"]["q_proj"].dequantize()), 0.0)
    huge = np.asarray(rollout["layers"]["k_proj"].dequantize())
    np.testing.assert_allclose(np.abs(huge), 1e30, rtol=2**-7)  # bf16 rounding, then the grid
    assert np.abs(np.asarray(rollout["layers"]["o_proj"].dequantize())).max() > 1e29


# ==== 4. what inputs may do =======================================================================

PACKAGE = Path(ais_jax.__file__).parent
UNSAFE_MODULES = {
    "pickle",
    "_pickle",
    "cPickle",
    "dill",
    "cloudpickle",
    "marshal",
    "shelve",
    "joblib",
    "torch",
}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def unsafe_constructs(source: str) -> list[str]:
    """Imports of deserializers that run code, and calls that execute or unpickle input.

    An AST walk, so comments, docstrings and string literals never count."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
            )
            found += [
                f"line {node.lineno}: import {n}"
                for n in names
                if n.split(".")[0] in UNSAFE_MODULES
            ]
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        last = name.rsplit(".", 1)[-1]
        keywords = {k.arg: k.value for k in node.keywords}
        loader = keywords.get("Loader", node.args[1] if len(node.args) > 1 else None)
        if name in {"eval", "exec", "builtins.eval", "builtins.exec", "__import__"}:
            found.append(f"line {node.lineno}: {name}()")
        elif name.startswith("yaml.") and last in {
            "load",
            "load_all",
            "unsafe_load",
            "unsafe_load_all",
            "full_load",
            "full_load_all",
        }:
            if not (
                last in {"load", "load_all"}
                and loader is not None
                and _dotted(loader).endswith("SafeLoader")
            ):
                found.append(f"line {node.lineno}: {name}() without a SafeLoader")
        elif name.endswith("torch.load") or name.split(".")[0] in UNSAFE_MODULES:
            found.append(f"line {node.lineno}: {name}()")
        elif last == "load" and name.split(".")[0] in {"np", "numpy", "jnp", "onp"}:
            pickle = keywords.get("allow_pickle")
            if pickle is not None and not (isinstance(pickle, ast.Constant) and not pickle.value):
                found.append(f"line {node.lineno}: {name}(allow_pickle=...)")
    return found


def test_scanner_finds_each_construct_and_ignores_comments_and_strings():
    bad = """
import pickle
from dill import loads
import torch.serialization
eval("1")
exec("x = 1")
yaml.load(text)
yaml.load(text, Loader=yaml.Loader)
yaml.unsafe_load(text)
torch.load("w.pt")
np.load("w.npy", allow_pickle=True)
np.load("w.npy", allow_pickle=flag)
pickle.loads(blob)
"""
    assert len(unsafe_constructs(bad)) == 12, unsafe_constructs(bad)
    fine = '''
"""Never pickle.load(...) or eval(...); yaml.load(x) is unsafe."""
# torch.load(path) and np.load(f, allow_pickle=True) are not used here
yaml.safe_load(text)
yaml.load(text, Loader=yaml.SafeLoader)
np.load("w.npy")
np.load("w.npy", allow_pickle=False)
model.eval()
jax.jit(f).lower(x).compile()
message = "eval(" + "exec("
'''
    assert unsafe_constructs(fine) == []


def test_package_never_unpickles_or_executes_input():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 20 and PACKAGE / "io" / "hf.py" in files
    found = {str(f.relative_to(PACKAGE)): unsafe_constructs(f.read_text()) for f in files}
    assert {k: v for k, v in found.items() if v} == {}


def test_weights_are_read_from_safetensors_only(hf_dir):
    """Files in other formats beside the weights are never opened; without a safetensors
    file, the error lists what is there and says why it is not read."""
    config, params = load_hf(hf_dir, dtype=jnp.float32)
    for name in ("pytorch_model.bin", "model.pt", "model.npz", "model.pkl", "flax_model.msgpack"):
        (hf_dir / name).write_bytes(b"\x80\x04not a pickle the loader would ever open")
    again = load_hf(hf_dir, dtype=jnp.float32)
    assert again[0] == config
    assert_tree_equal(again[1], params)
    (hf_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"No \*\.safetensors file.*no pickle.*model\.pkl"):
        load_hf(hf_dir)


@pytest.mark.parametrize(
    "parts",
    [("..",), ("../x",), ("a", "..", "..", "x"), ("checkpoints/../../x",), ("/etc/passwd",)],
)
def test_safe_path_refuses_paths_that_leave_the_run_directory(tmp_path, parts):
    with pytest.raises(ValueError, match="leaves the run directory"):
        safe_path(tmp_path / "run", *parts)


def test_safe_path_keeps_paths_inside_and_allows_links(tmp_path):
    out = tmp_path / "run"
    assert safe_path(out, "checkpoints", "3") == out / "checkpoints" / "3"
    assert safe_path(out, "a/../b") == out / "a/../b"
    assert safe_path(out) == out
    assert safe_path("runs/../x", "tb") == Path("runs/../x/tb")  # --out itself is the user's
    out.mkdir()
    (out / "checkpoints").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    assert safe_path(out, "checkpoints", "3") == out / "checkpoints" / "3"  # a link the user made


def test_run_outputs_are_under_the_run_directory(tmp_path):
    out = tmp_path / "run"
    run = Run(config_from(QUICK), out)
    assert run.checkpointer.directory == (out / "checkpoints").absolute()
    run.save()
    write_config(run.cfg, out)
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written and all(p.is_relative_to(out) for p in written)


# ==== 5. operating a run ==========================================================================
# Where a run may write, two runs on one directory, signals, full disks, hostile YAML, numbers
# out of range, non-finite outputs and damaged run directories. Processes, signals, locks and
# file-size limits are real: subprocesses of reliability_worker.py, os.kill, fcntl.flock and
# RLIMIT_FSIZE (``ulimit -f``).

# A run that would go on for a long time: the tests stop it.
LONG = ["--set", "steps=100000", "--set", "checkpoint_every=1000"]
# What a clean failure never prints, from any thread.
NOISE = (
    "Traceback",
    "KeyboardInterrupt",
    "ERROR:absl",
    "Task exception",
    "exception was never retrieved",
    "Task was destroyed",
    "was never awaited",
    "Event loop is closed",
    "Exception in thread",
    "Exception ignored",
)


def assert_no_noise(err: str) -> None:
    for noise in NOISE:
        assert noise not in err, err[-3000:]


def start_training(argv, env, err_file: Path, prefix=()) -> subprocess.Popen:
    """``ais-jax train ARGV`` in the background (after the command ``prefix``), stderr to
    ``err_file``."""
    return subprocess.Popen(
        [*prefix, sys.executable, str(WORKER), "train", *argv, "--no-progress"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=err_file.open("w"),
    )


def complete_rows(out: Path, name: str = "metrics.jsonl") -> int:
    path = out / name
    return path.read_text().count("\n") if path.exists() else 0


def wait_until(condition, proc: subprocess.Popen, err_file: Path, what: str, timeout=300.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"exited ({proc.returncode}) before {what}: {err_file.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no {what} after {timeout} s: {err_file.read_text()[-3000:]}")
        time.sleep(0.02)


def strict_loads(text: str):
    """`json.loads` that refuses NaN and Infinity (not JSON)."""

    def refuse(token):
        raise ValueError(f"non-JSON token {token}")

    return json.loads(text, parse_constant=refuse)


def strict_rows(path: Path) -> list[dict]:
    return [strict_loads(line) for line in path.read_text().splitlines()]


# -- where a run may write -------------------------------------------------------------------------


def test_out_that_is_a_file_or_under_one(tmp_path, capsys, quick_config):
    file = tmp_path / "notes.txt"
    file.write_text("keep me")
    cli_error(capsys, train_argv(quick_config, file), f"--out {str(file)!r} is an existing file")
    cli_error(
        capsys, train_argv(quick_config, file / "run"), "cannot be created", "Not a directory"
    )
    assert file.read_text() == "keep me"


def unprivileged() -> list[str]:
    """A command prefix under which file permissions hold: root loses CAP_DAC_OVERRIDE."""
    if os.geteuid() != 0:
        return []
    if not shutil.which("setpriv"):
        pytest.skip("running as root without setpriv: permissions cannot be enforced")
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]


@pytest.mark.slow
def test_out_in_a_read_only_directory(tmp_path, quick_config, worker_env):
    """A new --out under a read-only directory, and an existing read-only --out."""
    prefix = unprivileged()
    parent = tmp_path / "ro"
    (parent / "old").mkdir(parents=True)
    for d in (parent / "old", parent):
        d.chmod(0o555)
    try:
        for out, fragment in (
            (parent / "new", "cannot be created (Permission denied"),
            (parent / "old", "is not writable (Permission denied"),
        ):
            argv = ["--config", str(quick_config), "--out", str(out), "--no-progress"]
            proc = subprocess.run(
                [*prefix, sys.executable, str(WORKER), "train", *argv],
                env=worker_env,
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert proc.returncode == 2, proc.stderr
            assert_no_noise(proc.stderr)
            last = proc.stderr.strip().splitlines()[-1]
            assert last.startswith(f"ais-jax train: error: --out {str(out)!r} "), last
            assert fragment in last, last
        assert sorted(p.name for p in parent.iterdir()) == ["old"]
    finally:
        for d in (parent, parent / "old"):
            d.chmod(0o755)


def test_export_hf_to_an_existing_file(tmp_path, capsys):
    out = tmp_path / "run"
    Run(config_from(QUICK), out).save()
    write_config(config_from(QUICK), out)
    file = tmp_path / "model"
    file.write_text("not a directory")
    cli_error(
        capsys,
        ["export-hf", "--run", str(out), "--to", str(file)],
        f"{str(file)!r} is an existing file, not a directory",
    )
    assert file.read_text() == "not a directory"


# -- two runs, one directory -----------------------------------------------------------------------


@pytest.mark.slow
def test_second_writer_is_refused_and_a_killed_runs_lock_does_not_block_resume(
    tmp_path, capsys, quick_config, worker_env
):
    out, err = tmp_path / "run", tmp_path / "first.err"
    first = start_training(
        ["--config", str(quick_config), "--out", str(out), *LONG], worker_env, err
    )
    try:
        wait_until(lambda: complete_rows(out) >= 2, first, err, "two RL steps")
        holder = f"pid {first.pid} on host "
        busy = f"--out {str(out)!r} is in use by another ais-jax run ({holder}"
        cli_error(capsys, ["train", "--out", str(out), "--resume", "--no-progress"], busy)
        cli_error(capsys, train_argv(quick_config, out), busy)  # before "already holds checkpoints"
    finally:
        first.kill()  # SIGKILL: the kernel drops its lock, the lock file stays
        first.wait()
    steps = [r["step"] for r in read_rows(out)]
    assert steps == list(range(1, len(steps) + 1))  # nobody else wrote here
    assert (out / ".lock").exists()
    proc = train_in_subprocess(["--out", str(out), "--resume", "--set", "steps=1"], worker_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"Resumed from {out / 'checkpoints'} at step 0" in proc.stderr


# -- SIGINT and SIGTERM ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_finishes_the_step_saves_it_and_says_how_to_resume(
    tmp_path, quick_config, worker_env, sig
):
    """The step under way is finished and checkpointed (the schedule would not have saved it:
    checkpoint_every=1000), one line says how to resume, exit status 128 + signal."""
    out, err = tmp_path / "run", tmp_path / "train.err"
    proc = start_training(
        ["--config", str(quick_config), "--out", str(out), *LONG], worker_env, err
    )
    wait_until(lambda: complete_rows(out) >= 2, proc, err, "two RL steps")
    proc.send_signal(sig)
    assert proc.wait(timeout=120) == 128 + sig
    text = err.read_text()
    assert_no_noise(text)
    step = len(read_rows(out))
    name = signal.Signals(sig).name
    assert text.strip().splitlines()[-1] == (
        f"ais-jax train: Stopped by {name} after step {step}, checkpoint saved in "
        f"{out / 'checkpoints' / str(step)}; resume with: ais-jax train --out {out} --resume"
    )
    assert Checkpointer(out / "checkpoints").steps() == [0, step]
    assert [r["step"] for r in read_rows(out)] == list(range(1, step + 1))
    if sig == signal.SIGTERM:  # and the resume takes it from there
        proc = train_in_subprocess(
            ["--out", str(out), "--resume", "--set", f"steps={step + 1}"], worker_env
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"Resumed from {out / 'checkpoints'} at step {step}" in proc.stderr
        assert [r["step"] for r in read_rows(out)] == list(range(1, step + 2))


@pytest.mark.slow
def test_second_ctrl_c_stops_at_once(tmp_path, quick_config, worker_env):
    """Both SIGINTs arrive during the held-out evaluation after step 2 (thousands of prompts):
    the first asks for a stop after it, the second ends the process there, without a
    checkpoint of step 2; the newest checkpoint (step 0) is where a resume starts."""
    out, err = tmp_path / "run", tmp_path / "train.err"
    slow_eval = ["--set", "eval_every=2", "--set", "task.eval_examples=6000"]
    argv = ["--config", str(quick_config), "--out", str(out), *LONG, *slow_eval]
    proc = start_training(argv, worker_env, err)
    wait_until(lambda: complete_rows(out) >= 2, proc, err, "two RL steps")
    proc.send_signal(signal.SIGINT)
    wait_until(lambda: "finishing the current step" in err.read_text(), proc, err, "the first")
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    text = err.read_text()
    assert_no_noise(text)
    assert text.strip().splitlines()[-1] == (
        "ais-jax: second SIGINT: stopping now, without a checkpoint; resume from the newest "
        f"one with: ais-jax train --out {out} --resume"
    )
    assert Checkpointer(out / "checkpoints").steps() == [0]
    assert complete_rows(out, "eval.jsonl") == 1  # the evaluation of step 2 never finished


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_sigterm_to_one_host_stops_every_host_after_the_same_step(
    tmp_path, quick_config, worker_env
):
    """Two processes (one CPU device each) train one run; the scheduler preempts host 1 only.
    JAX's preemption notice reaches host 0 too: both finish the same step, both write their
    shards of its checkpoint, both exit 143 with the same line."""
    out, port = tmp_path / "run", free_port()
    procs, errs = [], []
    for pid in (0, 1):
        distributed = {
            "enabled": "true",
            "coordinator_address": f"localhost:{port}",
            "num_processes": "2",
            "process_id": str(pid),
        }
        sets = [x for k, v in distributed.items() for x in ("--set", f"distributed.{k}={v}")]
        errs.append(tmp_path / f"host{pid}.err")
        argv = ["--config", str(quick_config), "--out", str(out), *LONG, *sets]
        argv += ["--set", "mesh.data=-1", "--set", "sft.steps=0"]  # one compile less
        procs.append(start_training(argv, worker_env, errs[-1]))
    try:
        wait_until(lambda: complete_rows(out) >= 2, procs[0], errs[0], "two RL steps", 600)
        procs[1].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    texts = [e.read_text() for e in errs]
    assert codes == [143, 143], texts
    step = len(read_rows(out))
    for text in texts:
        assert_no_noise(text)
        assert (
            text.strip()
            .splitlines()[-1]
            .startswith(
                f"ais-jax train: Stopped by SIGTERM after step {step}, checkpoint saved in "
            )
        ), text[-2000:]
    assert Checkpointer(out / "checkpoints").steps() == [0, step]


# -- full disks ------------------------------------------------------------------------------------


def file_size_limit(kib: int) -> list[str]:
    """A command prefix: ``ulimit -f KIB`` then the command (a write past it fails, EFBIG)."""
    return ["bash", "-c", 'ulimit -f "$0" && exec "$@"', str(kib)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "kib, fragment",
    [
        # step 0's checkpoint metadata alone is 13-16 KB (its array files, 0.2-15 KB each, are
        # grouped by however tensorstore batched the writes)
        (8, "Checkpoint {ckpt}/0 could not be written: File too large"),
        (48, "error: File too large: "),  # the checkpoints fit; TensorBoard events or metrics not
    ],
    ids=["checkpoint", "events-or-metrics"],
)
def test_full_disk_is_one_line_and_the_run_resumes_once_there_is_room(
    tmp_path, quick_config, worker_env, kib, fragment
):
    out, err = tmp_path / "run", tmp_path / "train.err"
    argv = ["--config", str(quick_config), "--out", str(out), "--set", "steps=400"]
    # reads the shared compilation cache, writes none of it (the limit would truncate entries)
    env = worker_env | {"JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": str(2**62)}
    proc = start_training(argv, env, err, prefix=file_size_limit(kib))
    assert proc.wait(timeout=300) == 2
    text = err.read_text()
    assert_no_noise(text)
    last = text.strip().splitlines()[-1]
    assert (
        last.startswith("ais-jax train: error: ")
        and fragment.format(ckpt=out.absolute() / "checkpoints") in last
    ), text[-3000:]
    assert "disk is full or a file-size limit was reached" in last
    saved = Checkpointer(out / "checkpoints").steps()  # never the half-written one
    proc = train_in_subprocess(
        ["--out", str(out), "--resume", "--set", f"steps={(saved or [0])[-1] + 1}"], worker_env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [r["step"] for r in strict_rows(out / "metrics.jsonl")]
    assert steps == list(range(1, len(steps) + 1)) and steps


@pytest.mark.slow
def test_a_failed_save_drops_the_late_echoes_of_its_writes(caplog):
    """Each write of a failed orbax save fails on its own thread's event loop, and asyncio logs
    every exception nobody retrieved (the writes' tasks' and the future gathering them) when the
    object is collected, which can be after the save has raised; a write task that had not
    started when its loop closed is logged as destroyed while pending, and its coroutine warns
    that it was never awaited. Those echoes are dropped once a save failed; the error the save
    raises says it once. (The full-disk test above meets them by chance; this one makes them.)"""
    from ais_jax.io import checkpoint

    def unretrieved_failure() -> None:
        loop = asyncio.new_event_loop()

        async def write():
            raise ValueError("OUT_OF_RANGE: Error writing: File too large")

        gathering = asyncio.gather(loop.create_task(write()))
        loop.run_until_complete(asyncio.sleep(0.01))
        assert gathering.done()
        unstarted = loop.create_task(write())
        loop.close()
        del gathering, unstarted
        gc.collect()

    echoes = (
        "_GatheringFuture exception was never retrieved",
        "Task was destroyed but it is pending!",
    )
    never_awaited = "coroutine 'test_a_failed_save_drops_the_late_echoes_of_its_writes."
    loggers = [logging.getLogger(name) for name in ("absl", "asyncio")]
    hook, filters = sys.unraisablehook, [list(logger.filters) for logger in loggers]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for logger in loggers:  # as before any save failed in this process
                logger.filters[:] = [
                    f for f in logger.filters if not isinstance(f, checkpoint._DropEchoes)
                ]
            unretrieved_failure()  # logged, and warned
            assert all(echo in caplog.text for echo in echoes), caplog.text
            assert [str(w.message) for w in caught if never_awaited in str(w.message)]
            caplog.clear()
            caught.clear()
            with pytest.raises(OSError), checkpoint._held_back_echoes():
                raise OSError(errno.EFBIG, "File too large")
            unretrieved_failure()
            assert not any(echo in caplog.text for echo in echoes), caplog.text
            assert not [str(w.message) for w in caught if "never awaited" in str(w.message)]
            logging.getLogger("asyncio").error("an unrelated error")
            assert "an unrelated error" in caplog.text
            warnings.warn("an unrelated warning", RuntimeWarning, stacklevel=1)
            assert [w for w in caught if str(w.message) == "an unrelated warning"]
    finally:
        sys.unraisablehook = hook
        for logger, kept in zip(loggers, filters, strict=True):
            logger.filters[:] = kept


# -- YAML ------------------------------------------------------------------------------------------


def test_yaml_alias_bomb_is_refused_without_expanding_it(tmp_path, capsys):
    """A "billion laughs" config: 9 levels of 9 aliases, 9**9 strings once expanded."""
    lines = ["a0: &a0 [" + ", ".join(["lol"] * 9) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join([*lines, "steps: *a8"]) + "\n")
    t0 = time.perf_counter()
    line = cli_error(
        capsys,
        ["train", "--config", str(path), "--out", str(tmp_path / "run")],
        f"Config file {path} is not valid YAML",
        "aliases expand to more than 100000 values",
    )
    assert time.perf_counter() - t0 < 10 and len(line) < 400
    cli_error(capsys, train_argv(path, tmp_path / "run"), "aliases expand")
    cli_error(
        capsys,
        ["train", "--set", "task.options=&x {a: [*x]}", "--out", str(tmp_path / "run")],
        "an alias refers to the node that contains it",
    )
    assert not (tmp_path / "run").exists()


def test_yaml_duplicate_key_names_the_key_and_both_lines(tmp_path, capsys):
    path = tmp_path / "dup.yaml"
    path.write_text("steps: 5\nrollout:\n  group_size: 4\n  group_size: 8\n")
    cli_error(
        capsys,
        ["train", "--config", str(path), "--out", str(tmp_path / "run")],
        "duplicate key 'group_size' (first given at line 3) at line 4",
    )
    path.write_text("rollout: &r {group_size: 4}\nsft:\n  <<: {steps: 3}\n  steps: 4\n")
    assert load_config(path).sft.steps == 4  # a merge key is overridden on purpose: allowed


@pytest.mark.parametrize(
    "setting, fragments",
    [
        ("rollout.format=" + "x" * 100_000, ["rollout.format='xxx", "...", "allowed: ['bf16'"]),
        ("steps=" + "[" * 50 + "]" * 50, ["steps=[[[", "wrong type"]),
        ("steps=" + "9" * 5000, ["an integer of 5000 characters is too long to read"]),
        ("task.options={max_digits: " + "9" * 4000 + "}", ["an integer of about 4000 digits"]),
        ("x" * 10_000 + "=1", ["Unknown config key(s) ['xxx", "..."]),
    ],
    ids=["long-string", "deep-list", "long-int", "huge-int", "long-key"],
)
def test_error_messages_quote_at_most_about_200_characters_of_a_value(
    tmp_path, capsys, setting, fragments
):
    line = cli_error(
        capsys, ["train", "--set", setting, "--out", str(tmp_path / "run")], *fragments
    )
    assert len(line) < 600, len(line)


# -- numbers out of range --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, fragments",
    [
        (["train", "--set", "seed=" + "9" * 30], ["seed=" + "9" * 30, "[0, 2**32)"]),
        (["train", "--set", "seed=-1"], ["seed=-1 is invalid", "[0, 2**32)"]),
        (["train", "--set", "task.options.max_digits=5000"], ["max_digits=5000", "[1, 100]"]),
        (["train", "--set", "model.hidden_size=0"], ["model.hidden_size=0 is invalid"]),
        (["plan", "--seq", "-5"], ["--seq -5 is invalid: must be an integer in [1, 2**31)"]),
        (["plan", "--batch", "0"], ["--batch 0 is invalid"]),
        (["plan", "--seq", "5x"], ["argument --seq: invalid int value: '5x'"]),
        (["sample", "--run", "r", "--prompt", "1", "--n", "0"], ["--n 0 is invalid"]),
        (["sample", "--run", "r", "--prompt", "1", "--seed", str(2**32)], ["--seed 4294967296"]),
        (["sample", "--run", "r", "--prompt", "1", "--temperature", "nan"], ["--temperature nan"]),
        (["sample", "--run", "r", "--prompt", "1", "--max-new-tokens", "0"], ["--max-new-tokens"]),
        (["eval", "--run", "r", "--examples", "-3"], ["--examples -3 is invalid"]),
        (["compare", "--seeds", "0"], ["--seeds 0 is invalid"]),
    ],
    ids=[
        "seed-30-digits",
        "seed-negative",
        "max-digits",
        "hidden-size",
        "plan-seq",
        "plan-batch",
        "plan-seq-not-int",
        "sample-n",
        "sample-seed",
        "sample-temperature",
        "sample-tokens",
        "eval-examples",
        "compare-seeds",
    ],
)
def test_numbers_out_of_range_are_named_with_what_is_allowed(tmp_path, capsys, argv, fragments):
    if argv[0] in ("train", "compare"):
        argv = [*argv, "--out", str(tmp_path / "run"), "--no-progress"]
    cli_error(capsys, argv, *fragments)
    assert not (tmp_path / "run").exists()


# -- non-finite numbers in what the project writes -------------------------------------------------


@pytest.mark.slow
def test_sample_from_non_finite_weights_prints_strict_json_and_says_where(tmp_path, capsys, caplog):
    cfg = config_from(QUICK)
    out = tmp_path / "run"
    run = Run(cfg, out)
    params = jax.device_get(run.state.params)
    params["embed"] = np.full_like(params["embed"], np.nan)
    run.state = run.state.replace(params=jax.device_put(params))
    run.save()
    write_config(cfg, out)
    capsys.readouterr()
    argv = ["sample", "--run", str(out), "--prompt", "1+1=", "--n", "2", "--max-new-tokens", "2"]
    assert main(argv) == 0
    rows = [strict_loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 2 and all(r["logp"] is None for r in rows), rows
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        f"Checkpoint {(out / 'checkpoints').absolute() / '0'} holds non-finite values" in w
        and "train/params/embed (" in w
        for w in warnings
    ), warnings
    assert any("sample 0: non-finite ['logp'] printed as null" in w for w in warnings), warnings


def test_json_the_run_writes_is_strict_and_non_finite_values_are_named(tmp_path, caplog):
    metrics, summary = tmp_path / "metrics.jsonl", tmp_path / "summary.json"
    append_jsonl(metrics, {"step": 3, "loss": math.nan, "ais/alpha": -math.inf, "ok": 1.0})
    append_jsonl(metrics, {"step": 4, "loss": np.float32("nan"), "ok": np.float32(2.0)})
    assert strict_rows(metrics) == [
        {"step": 3, "loss": None, "ais/alpha": None, "ok": 1.0},
        {"step": 4, "loss": None, "ok": 2.0},
    ]
    write_json(summary, {"eval/accuracy": 0.5, "reward/last": math.inf, "steps": 4})
    assert strict_loads(summary.read_text()) == {
        "eval/accuracy": 0.5,
        "reward/last": None,
        "steps": 4,
    }
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"{metrics}: step 3: non-finite ['loss', 'ais/alpha'] written as null." in warnings
    assert f"{summary}: non-finite ['reward/last'] written as null." in warnings


# -- damaged or reused run directories -------------------------------------------------------------


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, worker_env) -> Path:
    """A QUICK run of 4 steps: checkpoints 0, 2, 4, held-out evaluations at 0, 2, 4. Tests copy
    it before changing anything."""
    folder = tmp_path_factory.mktemp("finished")
    config = yaml_file(folder / "quick.yaml", config_from(QUICK))
    out = folder / "run"
    sets = ["steps=4", "checkpoint_every=2", "eval_every=2"]
    argv = ["--config", str(config), "--out", str(out), *[a for s in sets for a in ("--set", s)]]
    proc = train_in_subprocess(argv, worker_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_torn_last_lines_and_a_missing_newest_checkpoint_resume_cleanly(
    finished_run, tmp_path, worker_env
):
    out = Path(shutil.copytree(finished_run, tmp_path / "run"))
    shutil.rmtree(out / "checkpoints" / "4")
    for name in ("metrics.jsonl", "eval.jsonl"):
        with (out / name).open("a") as f:
            f.write('{"step": 5, "reward/me')  # a run killed in the middle of a write
    (out / "summary.json").write_text('{"initial/eval/accuracy": 0.')
    (out / "start_summary.json").write_text('{"sft/final_loss": 1.')
    proc = train_in_subprocess(["--out", str(out), "--resume"], worker_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_no_noise(proc.stderr)
    assert f"{out / 'metrics.jsonl'}:5: dropped a torn last line" in proc.stderr
    assert f"{out / 'eval.jsonl'}:4: dropped a torn last line" in proc.stderr
    assert f"{out / 'summary.json'} is not readable JSON" in proc.stderr
    assert f"{out / 'start_summary.json'} is not readable JSON" in proc.stderr
    assert [r["step"] for r in strict_rows(out / "metrics.jsonl")] == [1, 2, 3, 4]
    assert [r["step"] for r in strict_rows(out / "eval.jsonl")] == [0, 2, 4]
    summary = strict_loads((out / "summary.json").read_text())
    assert summary["steps"] == 4
    start = strict_rows(out / "eval.jsonl")[0]  # the start's accuracy outlives its summary
    assert summary["initial/eval/accuracy"] == start["eval/accuracy"]
    assert f"its accuracy is taken from {out / 'eval.jsonl'}" in proc.stderr


@pytest.mark.slow
def test_damaged_line_before_the_last_is_named_not_dropped(finished_run, tmp_path, capsys):
    out = Path(shutil.copytree(finished_run, tmp_path / "run"))
    shutil.rmtree(out / "checkpoints" / "4")
    lines = (out / "metrics.jsonl").read_text().splitlines()
    lines[1] = lines[1][:20]
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    cli_error(
        capsys,
        ["train", "--out", str(out), "--resume", "--no-progress"],
        f"{out / 'metrics.jsonl'}:2: not a metrics row",
        "fix or delete that line",
    )
    assert (out / "metrics.jsonl").read_text() == "\n".join(lines) + "\n"


@pytest.mark.slow
def test_fresh_run_into_an_old_run_directory_keeps_the_old_rows_until_replaced(
    finished_run, tmp_path, capsys, monkeypatch, worker_env
):
    """The checkpoints were deleted, the rows were not: a fresh run that fails at once leaves
    them as they were; one that writes rows moves them to <name>.old first."""
    out = Path(shutil.copytree(finished_run, tmp_path / "run"))
    shutil.rmtree(out / "checkpoints")
    old = {n: (out / n).read_text() for n in ("metrics.jsonl", "eval.jsonl")}
    monkeypatch.setitem(task_catalog.TASKS, "broken", BrokenReward)
    config = yaml_file(tmp_path / "quick.yaml", config_from(QUICK))
    cli_error(
        capsys,
        train_argv(config, out, "task.name=broken", "task.options={}", "sft.steps=0"),
        "Reward function of task 'broken' raised",
    )
    assert {n: (out / n).read_text() for n in old} == old
    assert not list(out.glob("*.old*"))
    proc = train_in_subprocess(["--config", str(config), "--out", str(out)], worker_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name, text in old.items():
        assert (out / f"{name}.old").read_text() == text
        assert f"{out / name}: the rows of an earlier run in this directory moved to" in proc.stderr
    assert [r["step"] for r in read_rows(out)] == [1, 2]


@pytest.mark.parametrize(
    "content, fragment",
    [
        (b"\xff\xfe steps: 3\n", "is not UTF-8 text (byte 0xff at offset 0)"),
        (b"- steps\n- 3\n", "the config must be a mapping, got list"),
    ],
    ids=["not-utf8", "a-list"],
)
def test_config_file_problems_name_the_file(tmp_path, capsys, content, fragment):
    path = tmp_path / "config.yaml"
    path.write_bytes(content)
    cli_error(
        capsys, ["train", "--config", str(path), "--out", str(tmp_path / "r")], str(path), fragment
    )
