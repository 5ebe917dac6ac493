"""Paired comparison of rollout precisions and corrections: arms x RL seeds from one start.

An *arm* is a rollout number format and a correction, written ``<fmt>`` or ``<fmt>+<method>``:

    fmt      bf16 | fp8 (float8_e4m3fn) | fp8e5 (float8_e5m2) | fp6 (float6_e3m2fn)
             | fp6e2 (float6_e2m3fn) | fp4 (float4_e2m1fn)
    method   tis | ais | mis            (bare <fmt>: no correction)

e.g. ``bf16,fp8,fp4,fp4+tis,fp4+ais,fp4+mis`` (the default). Every arm trains the same model
on the same task and budget; only ``rollout.format`` and ``correction.method`` differ.

Design, so that arm differences are differences of the RL phase and nothing else:

- **One start.** The SFT warm start (seed ``cfg.seed``) runs once; its float32 parameters are
  saved under ``out/start/`` and every arm and every RL seed starts from them, bit for bit (the
  hash of the parameters each run received is in its ``start.json`` and in results.json).
  ``vary_sft=True`` runs one SFT per RL seed instead (shared by that seed's arms);
  ``start="RUN_DIR[@STEP]"`` takes the start from a checkpoint of an existing training run.
- **RL seeds** ``cfg.seed .. cfg.seed + seeds - 1`` set the prompt order and rollout keys; an
  arm's seed ``k`` and the reference arm's seed ``k`` form a pair.
- **One held-out set**, the same for every arm and seed (`data.eval_examples`), evaluated at
  step 0, every ``eval_every`` steps and at the end (each run's ``eval.jsonl``).
- **Resumable.** Re-running with the same ``out`` skips the runs that finished (their
  ``summary.json`` exists), resumes the ones that were interrupted from their checkpoints, and
  reuses the saved start; a different configuration or start is refused. A run whose newest
  checkpoint cannot be read is an error naming the folder to delete before re-running: that
  checkpoint (the run resumes from its previous one) or the run (it trains again).
- Arms run in one process, so the jitted phases compiled for one arm serve every arm and seed
  with the same settings.

Statistics (`ais_jax.analysis.stats`): per arm, the mean over seeds with a 95% t-interval; per arm
against the reference arm (the first listed: bf16 by default), the paired difference over seeds
with a 95% t-interval, for the final greedy and sampled accuracy and the greedy-accuracy area
under the curve over training (`stats.area_under_curve`, the time-averaged accuracy). The same
paired differences within each rollout format (`contrast_pairs`: ``fp8+ais - fp8+tis``,
``fp8+tis - fp8``, ...). Each difference states the smallest true difference its design detects
(`stats.minimum_detectable_difference`, power 0.8, from the spread of its per-seed
differences), and each arm the token ESS of the first and the last tenth of its RL steps.

Outputs under ``out/``:

    config.yaml               the base configuration (arms change format, correction, seed)
    start/                    params.npz (or seed<k>.npz) + .json (hash, source), plan.json
    <arm>/seed<k>/            one `job.run_training` directory per arm and seed, + start.json
    results.json              config, arms, per-seed results, intervals, paired differences,
                              provenance (strict JSON: a non-finite number is null)
    results.md                the tables
    accuracy.png              held-out accuracy over steps per arm (mean, band, every seed)
    diagnostics.png           ESS, alpha, mismatch and entropy over steps per arm
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ais_jax.analysis import stats
from ais_jax.analysis.plots import plot_arm_curves, read_metrics
from ais_jax.config import (
    LEVEL_METHODS,
    TrainConfig,
    changed_settings,
    describe_changes,
    dump_config,
    load_config,
)
from ais_jax.io.paths import safe_path, strict_json

__all__ = [
    "DEFAULT_ARMS",
    "FORMATS",
    "METHODS",
    "Arm",
    "contrast_pairs",
    "format_results",
    "load_params",
    "params_digest",
    "parse_arm",
    "parse_arms",
    "run_comparison",
    "save_params",
    "summarize",
    "start_from_checkpoint",
]

log = logging.getLogger(__name__)

FORMATS = {
    "bf16": "bf16",
    "fp8": "float8_e4m3fn",
    "fp8e5": "float8_e5m2",
    "fp6": "float6_e3m2fn",
    "fp6e2": "float6_e2m3fn",
    "fp4": "float4_e2m1fn",
    "fp8tok": "float8_e4m3fn",
}
# formats whose arm sets its own activation scaling (the others keep the base config's)
ACT_SCALING = {"fp8tok": "token"}
METHODS = ("tis", "ais", "mis")
DEFAULT_ARMS = "bf16,fp8,fp4,fp4+tis,fp4+ais,fp4+mis"
CONFIDENCE = 0.95
POWER = 0.8  # of the smallest detectable difference each paired table states
# per-seed values compared against the reference arm
PAIRED = {
    "final/accuracy": "final greedy acc.",
    "final/sampled_accuracy": "final sampled acc.",
    "auc/accuracy": "greedy acc. AUC",
}
DIAGNOSTICS = {
    "ais/ess_ratio_truncated": "ESS ratio (token)",
    "ais/alpha": "AIS alpha",
    "ais/mismatch": "mean |logp_train - logp_rollout|",
    "policy/entropy": "token entropy",
}


# ---- arms ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Arm:
    """One arm: its name (``fp4+ais``), ``rollout.format`` and ``correction.method``, and the
    ``rollout.act_scaling`` it sets (None: the base config's; ``fp8tok``: per-token)."""

    name: str
    format: str
    method: str
    act_scaling: str | None = None

    @property
    def dirname(self) -> str:
        return self.name.replace("+", "_")

    def config(self, cfg: TrainConfig, seed: int) -> TrainConfig:
        """``cfg`` with this arm's rollout format and correction, and RL seed ``seed``. The
        base config's ``correction.level`` is the level of the arms that weight by one (tis,
        mis); the other arms have none and keep the default."""
        level = cfg.correction.level if self.method in LEVEL_METHODS else "token"
        scaling = self.act_scaling or cfg.rollout.act_scaling
        return dataclasses.replace(
            cfg,
            seed=seed,
            rollout=dataclasses.replace(cfg.rollout, format=self.format, act_scaling=scaling),
            correction=dataclasses.replace(cfg.correction, method=self.method, level=level),
        )


def contrast_pairs(arms: Sequence[Arm]) -> list[tuple[str, str]]:
    """The paired contrasts within one rollout format: every arm minus each arm of the same
    format listed before it, the reference arm excluded (its pairs are the main table's).

    >>> contrast_pairs(parse_arms("bf16,fp8,fp8+tis,fp8+ais,fp4"))
    [('fp8+tis', 'fp8'), ('fp8+ais', 'fp8'), ('fp8+ais', 'fp8+tis')]
    """
    rest = list(arms[1:])
    return [
        (a.name, b.name)
        for i, a in enumerate(rest)
        for b in rest[:i]
        if a.name.partition("+")[0] == b.name.partition("+")[0]
    ]


def _grammar() -> str:
    return (
        f"an arm is FORMAT or FORMAT+METHOD with FORMAT one of {list(FORMATS)} and METHOD one "
        f"of {list(METHODS)} (a bare FORMAT has no correction), e.g. fp4+ais"
    )


def parse_arm(text: str) -> Arm:
    """``"fp4+ais"`` -> ``Arm("fp4+ais", "float4_e2m1fn", "ais")``; ``"fp8"`` -> method none.

    >>> parse_arm("fp8")
    Arm(name='fp8', format='float8_e4m3fn', method='none', act_scaling=None)
    """
    name = text.strip().lower()
    fmt, plus, method = name.partition("+")
    if fmt not in FORMATS or (plus and method not in METHODS):
        raise ValueError(f"Unknown arm(s) [{text.strip()!r}]; {_grammar()}.")
    return Arm(name, FORMATS[fmt], method if plus else "none", ACT_SCALING.get(fmt))


def parse_arms(spec: str | Sequence[str] | None = None) -> list[Arm]:
    """Comma-separated (or a list of) arm names -> `Arm` s, in order; None: `DEFAULT_ARMS`.

    Every bad name is reported at once, and an arm may be listed only once.

    >>> [a.name for a in parse_arms("bf16, fp4+tis")]
    ['bf16', 'fp4+tis']
    """
    if spec is None:
        spec = DEFAULT_ARMS
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    names = [n.strip() for n in names if n.strip()]
    if not names:
        raise ValueError(f"No arms given; {_grammar()}.")
    unknown, arms = [], []
    for name in names:
        try:
            arms.append(parse_arm(name))
        except ValueError:
            unknown.append(name)
    if unknown:
        raise ValueError(f"Unknown arm(s) {unknown}; {_grammar()}.")
    seen = [a.name for a in arms]
    twice = sorted({n for n in seen if seen.count(n) > 1})
    if twice:
        raise ValueError(f"Arm(s) {twice} listed more than once in {seen}.")
    return arms


# ---- start parameters ---------------------------------------------------------------------------


def _flat(params: Any) -> dict[str, np.ndarray]:
    import jax
    from flax.traverse_util import flatten_dict

    return {k: np.asarray(v) for k, v in flatten_dict(jax.device_get(params), sep="/").items()}


def params_digest(params: Any) -> str:
    """SHA-256 over every leaf's name, dtype, shape and bytes (in name order): equal digests
    mean bit-identical parameter trees."""
    h = hashlib.sha256()
    for name, leaf in sorted(_flat(params).items()):
        h.update(f"{name}:{leaf.dtype.str}:{leaf.shape};".encode())
        h.update(np.ascontiguousarray(leaf).tobytes())
    return h.hexdigest()


def save_params(path: str | Path, params: Any) -> Path:
    """Write a (nested-dict) parameter tree to ``path`` as ``.npz`` (leaf names ``a/b/c``),
    atomically: a file that exists is complete."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        np.savez(f, **_flat(params))
    os.replace(tmp, path)
    return path


def load_params(path: str | Path) -> dict:
    """The tree `save_params` wrote (host NumPy arrays, bit-identical)."""
    from flax.traverse_util import unflatten_dict

    with np.load(path) as z:
        return unflatten_dict({k: z[k] for k in z.files}, sep="/")


def parse_start(spec: str) -> tuple[Path, int | None]:
    """``"RUN_DIR@STEP"`` -> ``(RUN_DIR, STEP)``; ``"RUN_DIR"`` -> ``(RUN_DIR, None)`` (latest).

    >>> parse_start("runs/a@20")
    (PosixPath('runs/a'), 20)
    """
    head, at, tail = spec.rpartition("@")
    if at and tail.isdigit():
        return Path(head), int(tail)
    return Path(spec), None


def start_from_checkpoint(cfg: TrainConfig, spec: str) -> tuple[dict, dict[str, Any]]:
    """The trainer params of checkpoint ``RUN_DIR[@STEP]`` (latest step by default) of a
    training run, restored through that run's own `Run` (its ``config.yaml``) and
    `Checkpointer`. Returns ``(host params, {"run", "step"})``; the run's model must be
    ``cfg.model``."""
    import jax

    from ais_jax.io.checkpoint import UnreadableCheckpoint, steps_words
    from ais_jax.io.hf import CheckpointError
    from ais_jax.train.job import make_run

    run_dir, step = parse_start(spec)
    if not (run_dir / "config.yaml").is_file():
        raise CheckpointError(
            f"--start {spec}: {run_dir} is not a training run directory (no config.yaml)."
        )
    run_cfg = load_config(run_dir / "config.yaml")
    if run_cfg.model != cfg.model:
        raise ValueError(
            f"--start {spec}: that run's model {run_cfg.model} is not the comparison's "
            f"model {cfg.model}."
        )
    run = make_run(run_cfg, run_dir)
    try:
        step, restored, _ = run.checkpointer.restore(run.checkpoint_template(), step)
    except UnreadableCheckpoint as e:
        raise e.advise(
            f"Start from another of its checkpoints with --start {run_dir}@STEP "
            f"({steps_words(e.others)})."
            if e.others
            else f"It is {run_dir}'s only checkpoint."
        ) from None
    return jax.device_get(restored["train"].params), {"run": str(run_dir), "step": step}


def _sft_params(cfg: TrainConfig, seed: int, show_progress: bool) -> tuple[Any, dict]:
    """The SFT warm start of ``cfg`` with seed ``seed`` (host params, {"sft_seed", "sft_loss"})."""
    import jax
    from tqdm import tqdm

    from ais_jax.train.job import make_run

    with tempfile.TemporaryDirectory() as tmp:  # Run wants a directory; SFT writes nothing
        run = make_run(dataclasses.replace(cfg, seed=seed), tmp)
        bar = tqdm(total=cfg.sft.steps, desc=f"SFT seed {seed}", disable=not show_progress)
        losses = run.sft(lambda i, n, loss: (bar.update(i - bar.n), bar.set_postfix(loss=loss)))
        bar.close()
        params = jax.device_get(run.state.params)
    return params, {"sft_seed": seed, "sft_loss": losses[-1] if losses else None}


class _Starts:
    """The start parameters of the comparison in ``out/start/``, made on first use and reused
    by every later run (and by a re-run of the comparison)."""

    def __init__(self, cfg, out: Path, *, vary_sft: bool, start: str | None, show_progress):
        self.cfg, self.dir = cfg, safe_path(out, "start")
        self.vary_sft, self.start, self.show_progress = vary_sft, start, show_progress
        self._cache: tuple[str, Any, str] | None = None
        self.plan = {"vary_sft": vary_sft, "start": start}
        self.plan_file = self.dir / "plan.json"
        if self.plan_file.is_file():
            old = json.loads(self.plan_file.read_text())
            if old != self.plan:
                raise ValueError(
                    f"{out} holds a comparison started with {_describe_plan(old)}, not "
                    f"{_describe_plan(self.plan)}; use the same start options or another --out."
                )

    def name(self, seed: int) -> str:
        return f"seed{seed}" if self.vary_sft else "params"

    def get(self, seed: int) -> tuple[str, Any, str]:
        """``(name, host params, sha256)`` of the start of RL seed ``seed``."""
        name = self.name(seed)
        if self._cache is not None and self._cache[0] == name:
            return self._cache
        params_file, info_file = self.dir / f"{name}.npz", self.dir / f"{name}.json"
        if params_file.is_file() and info_file.is_file():
            params, info = load_params(params_file), json.loads(info_file.read_text())
            digest = params_digest(params)
            if digest != info["sha256"]:
                raise ValueError(
                    f"{params_file} does not hold the start recorded in {info_file} (hash "
                    f"{digest[:12]} != {info['sha256'][:12]}); delete both to make it again."
                )
        else:
            t0 = time.perf_counter()
            if self.start is not None:
                params, info = start_from_checkpoint(self.cfg, self.start)
                info = {"source": "checkpoint", **info}
            else:
                sft_seed = seed if self.vary_sft else self.cfg.seed
                params, info = _sft_params(self.cfg, sft_seed, self.show_progress)
                info = {"source": "sft", **info}
            # the runs start from what was saved, so a re-run starts from the same bits
            self.dir.mkdir(parents=True, exist_ok=True)
            if not self.plan_file.is_file():
                self.plan_file.write_text(json.dumps(self.plan))
            save_params(params_file, params)
            params = load_params(params_file)
            digest = params_digest(params)
            info_file.write_text(json.dumps(_strict({**info, "sha256": digest}), indent=2))
            log.info(
                "start %s: %s (%.1f s)", name, _describe_source(info), time.perf_counter() - t0
            )
        self._cache = (name, params, digest)
        return self._cache

    def info(self) -> dict[str, Any]:
        found = sorted(self.dir.glob("*.json"))
        return {p.stem: json.loads(p.read_text()) for p in found if p.stem != "plan"}


def _describe_plan(plan: dict) -> str:
    if plan.get("start"):
        return f"--start {plan['start']}"
    return "one SFT per seed (--vary-sft)" if plan.get("vary_sft") else "one shared SFT start"


def _describe_source(info: dict) -> str:
    if info.get("source") == "checkpoint":
        return f"checkpoint step {info['step']} of {info['run']}"
    return f"SFT seed {info.get('sft_seed')} (final loss {info.get('sft_loss')})"


# ---- the comparison -----------------------------------------------------------------------------


def run_comparison(
    cfg: TrainConfig,
    out: str | Path,
    *,
    seeds: int = 5,
    arms: str | Sequence[str] | None = None,
    vary_sft: bool = False,
    start: str | None = None,
    show_progress: bool = True,
) -> str:
    """Train every arm for RL seeds ``cfg.seed .. cfg.seed + seeds - 1`` from one start; write
    results.json, results.md and the plots under ``out`` and return the markdown.

    ``arms``: names as in `parse_arms` (default `DEFAULT_ARMS`); the first is the reference of
    the paired differences. ``vary_sft``: one SFT per seed instead of one for all.
    ``start``: ``"RUN_DIR[@STEP]"``, start from that training run's checkpoint instead of SFT.
    One log line per finished run (arm, seed, start -> final greedy accuracy, time).
    """
    from ais_jax.io.checkpoint import UnreadableCheckpoint
    from ais_jax.train.job import run_training

    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {seeds}.")
    if vary_sft and start is not None:
        raise ValueError("--vary-sft and --start exclude each other: a checkpoint is one start.")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    chosen = parse_arms(arms)
    _check_config(cfg, out)  # config.yaml is written with the first run or start
    starts = _Starts(cfg, out, vary_sft=vary_sft, start=start, show_progress=show_progress)
    seed_list = list(range(cfg.seed, cfg.seed + seeds))
    total, done = len(seed_list) * len(chosen), 0
    for seed in seed_list:
        for arm in chosen:
            done += 1
            run_dir = safe_path(out, arm.dirname, f"seed{seed}")
            if (run_dir / "summary.json").is_file():
                log.info(
                    "[%d/%d] %s seed %d: finished earlier, skipped", done, total, arm.name, seed
                )
                continue
            t0 = time.perf_counter()
            if not (out / "config.yaml").is_file():
                (out / "config.yaml").write_text(dump_config(cfg))
            if _has_checkpoint(run_dir):  # interrupted: continue from its own checkpoints
                try:
                    run_training(
                        arm.config(cfg, seed), run_dir, resume=True, show_progress=show_progress
                    )
                except UnreadableCheckpoint as e:
                    raise e.advise(_damaged_run_advice(e, run_dir, arm, seed)) from None
            else:
                name, params, digest = starts.get(seed)
                run_dir.mkdir(parents=True, exist_ok=True)
                (run_dir / "start.json").write_text(json.dumps({"start": name, "sha256": digest}))
                run_training(
                    arm.config(cfg, seed),
                    run_dir,
                    initial_params=params,
                    show_progress=show_progress,
                )
            record = _run_record(run_dir, seed)
            log.info(
                "[%d/%d] %s seed %d: greedy acc. %.1f%% -> %.1f%%, %.1f s",
                done,
                total,
                arm.name,
                seed,
                100 * record["start/accuracy"],
                100 * record["final/accuracy"],
                time.perf_counter() - t0,
            )
    results = _strict(_collect(cfg, out, chosen, seed_list, starts.info()))
    (out / "results.json").write_text(json.dumps(results, indent=2, allow_nan=False))
    table = format_results(results)
    (out / "results.md").write_text(table + "\n")
    _plot(out, chosen, seed_list, cfg)
    return table


def _check_config(cfg: TrainConfig, out: Path) -> None:
    """Refuse if ``out/config.yaml`` holds another configuration than ``cfg``."""
    path = out / "config.yaml"
    if not path.is_file():
        return
    # read through load_config: a setting added since has its default on both sides
    changes = changed_settings(load_config(path).to_dict(), cfg.to_dict())
    if changes:
        raise ValueError(
            f"{out} holds a comparison with another configuration ({describe_changes(changes)}); "
            f"continue it with --config {path}, or choose another --out."
        )


def _damaged_run_advice(e, run_dir: Path, arm: Arm, seed: int) -> str:
    """What to do when the newest checkpoint of an interrupted run (`UnreadableCheckpoint`
    ``e``) cannot be read: delete it, or the whole run, and run the comparison again."""
    again = "then run the comparison again with the same --out"
    if not e.others:
        return f"Delete {run_dir} to train {arm.name} seed {seed} again, {again}."
    damaged = ", ".join(str(run_dir / "checkpoints" / str(s)) for s in e.failed)
    return (
        f"Delete {damaged} to resume {arm.name} seed {seed} from step {max(e.others)} (or "
        f"{run_dir} to train it again), {again}."
    )


def _has_checkpoint(run_dir: Path) -> bool:
    folder = run_dir / "checkpoints"
    return folder.is_dir() and any(p.name.isdigit() for p in folder.iterdir())


# ---- results ------------------------------------------------------------------------------------


def _mean(rows: list[dict], key: str, reduce=np.mean) -> float:
    values = [r[key] for r in rows if key in r and r[key] is not None]
    return float(reduce(values)) if values else math.nan


def _tenth(rows: list) -> int:
    """How many steps "the first / last tenth of training" is: at least one."""
    return max(1, len(rows) // 10)


def _eval_rows(run_dir: Path) -> list[dict]:
    rows = {r["step"]: r for r in read_metrics(run_dir / "eval.jsonl")}  # last row of a step
    return [rows[s] for s in sorted(rows)]


def _run_record(run_dir: Path, seed: int) -> dict[str, Any]:
    """One finished run's numbers: start / final / AUC accuracies and step-metric summaries."""
    summary = json.loads((run_dir / "summary.json").read_text())
    evals = _eval_rows(run_dir)
    rows = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").is_file() else []
    start_file = run_dir / "start.json"
    first = evals[0] if evals and evals[0]["step"] == 0 else {}
    steps = [r["step"] for r in evals]
    return {
        "seed": seed,
        "start_sha256": json.loads(start_file.read_text())["sha256"]
        if start_file.is_file()
        else None,
        "start/accuracy": first.get("eval/accuracy", math.nan),
        "start/sampled_accuracy": first.get("eval/sampled_accuracy", math.nan),
        "final/accuracy": summary["eval/accuracy"],
        "final/sampled_accuracy": summary["eval/sampled_accuracy"],
        "auc/accuracy": stats.area_under_curve(steps, [r["eval/accuracy"] for r in evals]),
        "auc/sampled_accuracy": stats.area_under_curve(
            steps, [r["eval/sampled_accuracy"] for r in evals]
        ),
        "ess/mean": _mean(rows, "ais/ess_ratio_truncated"),
        "ess/min": _mean(rows, "ais/ess_ratio_truncated", np.min),
        "ess/first": _mean(rows[: _tenth(rows)], "ais/ess_ratio_truncated"),
        "ess/last": _mean(rows[-_tenth(rows) :], "ais/ess_ratio_truncated"),
        "alpha/mean": _mean(rows, "ais/alpha"),
        "mismatch/mean": _mean(rows, "ais/mismatch"),
        "entropy/mean": _mean(rows, "policy/entropy"),
        "reward/mean": _mean(rows, "reward/mean"),
        "steps": summary.get("steps"),
        "eval_steps": steps,
    }


def _collect(cfg, out: Path, arms: list[Arm], seeds: list[int], start_info: dict) -> dict:
    from ais_jax.io.provenance import provenance

    runs = {
        a.name: [_run_record(safe_path(out, a.dirname, f"seed{s}"), s) for s in seeds] for a in arms
    }
    return {
        "config": cfg.to_dict(),
        "arms": [dataclasses.asdict(a) for a in arms],
        "reference": arms[0].name,
        "seeds": seeds,
        "confidence": CONFIDENCE,
        "start": start_info,
        "runs": runs,
        **summarize(runs, arms),
        "provenance": provenance(),
    }


def summarize(runs: dict[str, list[dict]], arms: Sequence[Arm]) -> dict[str, Any]:
    """The statistics of per-seed records ``runs[arm][k]`` (seed k of every arm is one pair):
    ``summary`` (mean and interval per arm and number), ``paired`` (every arm minus the first,
    on `PAIRED`'s numbers) and ``contrasts`` (`contrast_pairs`), each difference with the
    smallest one the design detects at power `POWER` (``detectable``)."""
    numeric = [k for k, v in runs[arms[0].name][0].items() if isinstance(v, float)]
    summary = {
        arm: {k: stats.mean_ci([r[k] for r in records], CONFIDENCE).to_dict() for k in numeric}
        for arm, records in runs.items()
    }

    def differences(a: str, b: str) -> dict[str, dict]:
        out = {}
        for k in PAIRED:
            d = stats.paired_difference(
                [r[k] for r in runs[a]], [r[k] for r in runs[b]], CONFIDENCE
            )
            std = d.std_error * math.sqrt(d.n)
            mde = stats.minimum_detectable_difference(std, d.n, POWER, CONFIDENCE)
            out[k] = {**d.to_dict(), "detectable": mde}
        return out

    return {
        "summary": summary,
        "paired": {a.name: differences(a.name, arms[0].name) for a in arms[1:]},
        "contrasts": {f"{a} - {b}": differences(a, b) for a, b in contrast_pairs(arms)},
        "power": POWER,
    }


def _strict(x: Any) -> Any:
    """``x`` with every non-finite float (and NumPy scalar) replaced by None, for strict JSON."""
    return strict_json(x)[0]


def _plot(out: Path, arms: list[Arm], seeds: list[int], cfg: TrainConfig) -> None:
    def rows(arm: Arm, name: str) -> list[list[dict]]:
        return [read_metrics(safe_path(out, arm.dirname, f"seed{s}", name)) for s in seeds]

    plot_arm_curves(
        {a.name: rows(a, "eval.jsonl") for a in arms},
        ["eval/accuracy", "eval/sampled_accuracy"],
        out / "accuracy.png",
        seed_lines=True,
        marker="o",
        titles={
            "eval/accuracy": "held-out accuracy, greedy",
            "eval/sampled_accuracy": "held-out accuracy, sampled",
        },
    )
    metrics = {a.name: rows(a, "metrics.jsonl") for a in arms}
    plot_arm_curves(
        metrics,
        list(DIAGNOSTICS),
        out / "diagnostics.png",
        window=max(1, min(20, cfg.steps // 10)),
        ncols=2,
        titles=DIAGNOSTICS,
    )


# ---- the markdown -------------------------------------------------------------------------------


def _ci(e: dict, scale: float = 100.0, digits: int = 1, sign: bool = False) -> str:
    """``"52.9 [41.2, 64.6]"`` (the interval left out where it is undefined: one seed)."""
    if e["mean"] is None or not math.isfinite(e["mean"]):
        return "n/a"
    f = f"{{:{'+' if sign else ''}.{digits}f}}"
    text = f.format(scale * e["mean"])
    if e["low"] is not None and math.isfinite(e["low"]):
        text += f" [{f.format(scale * e['low'])}, {f.format(scale * e['high'])}]"
    return text


def _num(x: Any, digits: int) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{x:.{digits}f}"


def format_results(results: dict) -> str:
    """results.md: the setup, a row per arm (mean and 95% interval over seeds), the paired
    differences against the reference arm, every seed's values, and the provenance line."""
    c, ref, seeds = results["config"], results["reference"], results["seeds"]
    arms = results["arms"]
    pct = int(round(100 * results["confidence"]))
    start = results["start"]
    first = next(iter(start.values()), {})
    if first.get("source") == "checkpoint":
        origin = f"every arm and seed starts from checkpoint step {first['step']} of {first['run']}"
    elif len(start) > 1:
        origin = "each seed's arms start from that seed's own SFT warm start"
    else:
        origin = f"every arm and seed starts from one SFT warm start (seed {first.get('sft_seed')})"
    t = c["task"]
    lines = [
        f"Task `{t['name']}` {t['options'] or ''}, {c['steps']} RL steps, "
        f"{c['rollout']['prompts_per_step']}x{c['rollout']['group_size']} rollouts/step, "
        f"max_new_tokens {c['rollout']['max_new_tokens']}; {len(seeds)} RL seed(s) "
        f"{seeds[0]}..{seeds[-1]}; {origin}. Held-out accuracy of the BF16 policy on the same "
        f"{t['eval_examples']} prompts for every run (never trained on); AUC = mean accuracy "
        f"over training (trapezoid over the evaluated steps: "
        f"{', '.join(map(str, results['runs'][ref][0]['eval_steps']))}). "
        f"Mean over seeds [{pct}% t-interval].",
        "",
        "| arm | rollout | correction | final acc. % (greedy) | sampled acc. % | greedy acc. AUC % "
        "| start acc. % greedy / sampled | ESS ratio mean (min) | alpha mean | mean abs dlogp "
        "| entropy |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for arm in arms:
        s, records = results["summary"][arm["name"]], results["runs"][arm["name"]]
        ess_min = min((r["ess/min"] for r in records if r["ess/min"] is not None), default=None)
        lines.append(
            f"| {arm['name']} | {arm['format']} | {arm['method']} "
            f"| {_ci(s['final/accuracy'])} | {_ci(s['final/sampled_accuracy'])} "
            f"| {_ci(s['auc/accuracy'])} "
            f"| {_ci(s['start/accuracy'])} / {_ci(s['start/sampled_accuracy'])} "
            f"| {_num(s['ess/mean']['mean'], 4)} ({_num(ess_min, 4)}) "
            f"| {_num(s['alpha/mean']['mean'], 3)} | {_num(s['mismatch/mean']['mean'], 4)} "
            f"| {_num(s['entropy/mean']['mean'], 3)} |"
        )
    power = results.get("power")
    detectable = (
        f"; detectable = the smallest true Δ final greedy accuracy that a two-sided paired "
        f"t-test at level {1 - results['confidence']:.2f} finds with power {power:g}, given "
        f"the spread of these {len(seeds)} seeds' differences."
        if power
        else "."
    )

    def pair_rows(title: str, pairs: dict) -> list[str]:
        header = f"| {title} | " + " | ".join(f"Δ {v}" for v in PAIRED.values())
        rows = [
            header + (" | detectable" if power else "") + " | better / worse |",
            "|---|" + "---|" * (len(PAIRED) + (2 if power else 1)),
        ]
        for name, diffs in pairs.items():
            d = diffs["final/accuracy"]["values"]
            better = sum(v is not None and v > 0 for v in d)
            worse = sum(v is not None and v < 0 for v in d)
            cells = " | ".join(_ci(diffs[k], sign=True) for k in PAIRED)
            if power:
                mde = diffs["final/accuracy"].get("detectable")
                cells += f" | {_num(None if mde is None else 100 * mde, 1)}"
            rows.append(f"| {name} | {cells} | {better} / {worse} |")
        return rows

    if results["paired"]:
        lines += [
            "",
            f"Paired differences against the reference arm **{ref}** (the first arm listed): "
            f"arm minus {ref} on the same seed, in percentage points, mean over seeds "
            f"[{pct}% t-interval]; better / worse = seeds where the arm's final greedy accuracy "
            f"is above / below {ref}'s{detectable}",
            "",
            *pair_rows(f"arm − {ref}", results["paired"]),
        ]
    if results.get("contrasts"):
        lines += [
            "",
            "Paired differences within a rollout format (each arm minus each arm of the same "
            "format listed before it), as above:",
            "",
            *pair_rows("contrast", results["contrasts"]),
        ]
    if all("ess/first" in r for records in results["runs"].values() for r in records):
        lines += [
            "",
            "Token ESS ratio (truncated) over training: mean over the first and the last tenth "
            f"of the RL steps [{pct}% t-interval over seeds]:",
            "",
            "| arm | first tenth | last tenth | last − first |",
            "|---|---|---|---|",
        ]
        for arm in arms:
            records = results["runs"][arm["name"]]
            first = [r["ess/first"] for r in records]
            last = [r["ess/last"] for r in records]
            if any(v is None or not math.isfinite(v) for v in first + last):
                continue
            cells = [stats.mean_ci(x, results["confidence"]).to_dict() for x in (first, last)] + [
                stats.paired_difference(last, first, results["confidence"]).to_dict()
            ]
            lines.append(
                f"| {arm['name']} | {_ci(cells[0], 1, 4)} | {_ci(cells[1], 1, 4)} "
                f"| {_ci(cells[2], 1, 4, sign=True)} |"
            )
    lines += [
        "",
        "Every seed (final greedy / final sampled / greedy AUC, %):",
        "",
        "| arm | " + " | ".join(f"seed {s}" for s in seeds) + " |",
        "|---|" + "---|" * len(seeds),
    ]
    for arm in arms:
        cells = [
            " / ".join(
                _num(None if r[k] is None else 100 * r[k], 1)
                for k in ("final/accuracy", "final/sampled_accuracy", "auc/accuracy")
            )
            for r in results["runs"][arm["name"]]
        ]
        lines.append(f"| {arm['name']} | " + " | ".join(cells) + " |")
    p = results["provenance"]
    v = p["versions"]
    lines += [
        "",
        f"jax {v.get('jax')}, jaxlib {v.get('jaxlib')}, commit {p.get('commit')}, "
        f"{p['device_count']} x {p['device_kind']} ({p['platform']}), CPU {p['cpu']}.",
    ]
    return "\n".join(lines)
