"""The training job: `run_training`, what `ais-jax train` runs, and `make_run`.

`run_training` is three parts: `_start_or_resume` (a fresh run's SFT warm start, step-0
evaluation and checkpoint, or the restore of the newest checkpoint), `_rl_steps` (each step
logged by `run_log.RunLog`, checkpointed and evaluated on schedule) and `_summarize`. It drives
a `run.Run` (`make_run`), whatever the model family: the same metrics, checkpoints, resume,
plots and run directory for all.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from tqdm import tqdm

from ais_jax.config import TrainConfig
from ais_jax.io.checkpoint import resume_config, write_config
from ais_jax.io.paths import claim_run_dir
from ais_jax.io.provenance import provenance
from ais_jax.io.run_log import RunLog, accuracy_words, forget_set_aside
from ais_jax.parallel import sharding as shd
from ais_jax.train import preemption
from ais_jax.train.run import Run

log = logging.getLogger(__name__)


def make_run(cfg: TrainConfig, out: str | Path) -> Run:
    """The `Run` of ``cfg`` (any family: its kind's `train.Estimator`), writing to ``out``."""
    return Run(cfg, out)


def run_training(
    cfg: TrainConfig,
    out: str | Path,
    *,
    resume: bool = False,
    fallback: bool = False,
    show_progress: bool = True,
    initial_params: Any = None,
    on_step: Callable[[dict[str, float]], None] | None = None,
) -> dict[str, Any]:
    """SFT warm start (fresh runs), then ``cfg.steps`` RL steps with checkpoints, metrics,
    TensorBoard, a progress bar, plots and a held-out evaluation. Returns the summary.

    ``initial_params`` (float32 trainer params) replace a fresh run's SFT warm start.
    ``on_step(row)`` runs after each RL step's row, checkpoint and evaluation (when due). The
    run holds ``out``'s lock (`paths.claim_run_dir`). Inside `preemption.graceful_stop` a SIGINT
    or SIGTERM ends the run after the current step and its checkpoint."""
    out = Path(out)
    shd.initialize_distributed(cfg.distributed)  # before any other JAX call
    try:
        with claim_run_dir(out, jax.process_index()):
            stack = provenance()  # at the start: the code and versions this run was launched with
            run = make_run(cfg, out)
            # Multi-host: every process computes every phase and saves its checkpoint shards
            # (``out`` must be storage they share); process 0 alone writes the config, metrics,
            # TensorBoard events, plots and summary, and shows progress.
            run_log = RunLog(out, primary=run.host == 0)
            progress = show_progress and run_log.primary
            try:
                summary = _start_or_resume(run, run_log, resume, fallback, progress, initial_params)
                run_log.open_events(purge=int(run.state.step) + 1 if resume else None)
                _rl_steps(run, run_log, progress, on_step)
                return _summarize(run, run_log, summary, stack, resume)
            except BaseException:
                # the events so far on disk; a failing write here (the full disk that may have
                # raised) is left to the error being raised, not to an atexit traceback
                with contextlib.suppress(OSError):
                    run_log.close()
                raise
    finally:
        forget_set_aside(out)


def _start_or_resume(
    run: Run, run_log: RunLog, resume: bool, fallback: bool, progress: bool, initial_params
) -> dict[str, Any]:
    """Continue from the newest checkpoint (``resume``, if there is one), or start: the SFT warm
    start (or ``initial_params``), the step-0 evaluation and checkpoint. Returns the summary
    entries of the start (none when resumed)."""
    cfg, out = run.cfg, run.out
    if not resume and run.checkpointer.steps():
        raise ValueError(
            f"{out} already holds checkpoints (steps {run.checkpointer.steps()}); "
            "pass --resume to continue that run, or choose another --out."
        )
    if resume and run.checkpointer.latest_step() is not None:
        resume_config(cfg, out, write=run_log.primary)
        start = run.restore(fallback=fallback)
        run_log.resume(start)
        log.info("Resumed from %s at step %d", run.checkpointer.directory, start)
        return {}
    if resume:
        log.warning("--resume: no checkpoint in %s; starting a new run.", out)
    if run_log.primary:
        write_config(cfg, out)
    run_log.start()
    bar = tqdm(total=cfg.sft.steps, desc="SFT", disable=not progress, leave=False)
    t0 = time.perf_counter()
    if initial_params is None:

        def sft_progress(i, n, loss):  # a signal stops the run here, before any checkpoint
            preemption.stop_point(out)
            bar.update(i - bar.n)
            bar.set_postfix(loss=loss)

        losses = run.sft(sft_progress)
    else:
        losses, run.state = [], run.phases.init(initial_params)
    bar.close()
    summary = {"sft/final_loss": losses[-1] if losses else None}
    summary["time/sft_s"] = time.perf_counter() - t0
    if cfg.loss.kl_coef > 0:
        # a copy: `update` donates run.state, which would delete an aliased reference
        run.ref_params = jax.tree_util.tree_map(jnp.copy, run.state.params)
    initial = run.evaluate()
    summary.update({f"initial/{k}": v for k, v in initial.items()})
    if progress:
        tqdm.write(f"Start (after the warm start): {accuracy_words(initial)}")
    run_log.evaluation(0, initial, events=False)
    run_log.started(summary)
    run.save()
    preemption.stop_point(out, 0)
    return summary


def _rl_steps(run: Run, run_log: RunLog, progress: bool, on_step) -> None:
    """RL steps up to ``cfg.steps``: each one's row logged, then its checkpoint and evaluation
    when due, ``on_step(row)``, and a stop point (a signal: checkpoint this step, then stop)."""
    cfg = run.cfg
    bar = tqdm(total=cfg.steps, initial=int(run.state.step), desc="GRPO", disable=not progress)
    while int(run.state.step) < cfg.steps:
        row = run.step()
        step = row["step"]
        run_log.step(row)
        saved = step % cfg.checkpoint_every == 0 or step == cfg.steps
        if saved:
            run.save()
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
            run_log.evaluation(step, run.evaluate())
        bar.update(1)
        shown = {"reward": row["reward/mean"], **run_log.held_out, "alpha": row["ais/alpha"]}
        bar.set_postfix({**shown, "ess": row["ais/ess_ratio_truncated"]})
        if on_step is not None:
            on_step(row)
        preemption.stop_point(run.out, step, save=None if saved else run.save, close=run_log.close)
    bar.close()


def _summarize(run: Run, run_log: RunLog, summary: dict, stack: dict, resume: bool) -> dict:
    """The final evaluation, then (process 0) summary.json and the plots (`RunLog.finish`)."""
    final = run.evaluate()
    summary = {**summary, **final, "steps": int(run.state.step)}
    run_log.evaluation(summary["steps"], final, events=("eval/accuracy",), final=True)
    run_log.close()
    return run_log.finish(summary, stack, resume=resume) if run_log.primary else summary
