"""What a run records as it goes, besides checkpoints: its rows, TensorBoard events and summary.

    metrics.jsonl   one strict-JSON object per RL step (`append_jsonl`)
    eval.jsonl      one per held-out evaluation (step 0, every eval_every steps, the end)
    tb/             TensorBoard events (`EventWriter`)
    start_summary.json
                    the start's entries: warm-start loss and time, step-0 accuracy
                    (`RunLog.started`), which a run resumed after a crash puts in its summary
    summary.json    start and end accuracy, reward, time per phase and step, peak memory,
                    provenance (`RunLog.finish`; `describe` says it in words)
    plots/          PNG plots of metrics.jsonl (plots.py)

`RunLog` is what process 0 of a run writes; on every other process its writes are no-ops.
On resume the row files are cut back to the checkpoint's step (`truncate_rows`: a torn last
line, from a kill mid-write or a full disk, is dropped with a warning; a damaged earlier line
is an error naming file and line) and written again from there, and TensorBoard hides the
events of the re-run steps. A fresh run into a directory an earlier run left keeps that run's
rows until it writes its own first one (`set_aside_on_first_write`); then they move to
``<name>.old``. An I/O error of TensorBoard's writer thread (a full disk) is raised at the next
write as an OSError naming the directory, not printed as a thread traceback.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np

from ais_jax.io.paths import dumps_strict, safe_path, write_atomic, write_json
from ais_jax.io.provenance import device_peak_gib, host_peak_gib

__all__ = [
    "PHASES",
    "EventWriter",
    "RunLog",
    "accuracy_words",
    "append_jsonl",
    "describe",
    "forget_set_aside",
    "set_aside_on_first_write",
    "truncate_rows",
]

log = logging.getLogger(__name__)
SUMMARY_WINDOW = 10  # reward/first and reward/last: mean of the first and last steps (<= 10)
PHASES = ("rollout", "score", "update", "reward", "sync")  # a step's time/<phase>_s, in order


class RunLog:
    """The files a run appends to as it goes, under ``out``; writes only if ``primary``."""

    def __init__(self, out: Path, *, primary: bool):
        self.out, self.primary = Path(out), primary
        self.metrics, self.evals = safe_path(out, "metrics.jsonl"), safe_path(out, "eval.jsonl")
        self.events: EventWriter | None = None
        self.held_out: dict[str, str] = {}  # the latest greedy accuracy, for the progress bar

    def start(self) -> None:
        """A fresh run: an earlier run's rows here move aside at the first new row."""
        if self.primary:
            set_aside_on_first_write(self.metrics)
            set_aside_on_first_write(self.evals)

    def resume(self, step: int) -> None:
        """A run resumed from the checkpoint of ``step``: drop the rows after it."""
        if self.primary:
            truncate_rows(self.metrics, step)
            truncate_rows(self.evals, step)

    def open_events(self, purge: int | None) -> None:
        """TensorBoard events; ``purge``: hide the events of steps from there on (a resume)."""
        if self.primary:
            self.events = EventWriter(safe_path(self.out, "tb"), purge)

    def step(self, row: dict[str, float]) -> None:
        """An RL step's row: a line of metrics.jsonl and a TensorBoard scalar per key."""
        if self.primary:
            append_jsonl(self.metrics, row)
            for k, v in row.items():
                if k != "step":
                    self.events.add_scalar(k, v, row["step"])

    def evaluation(self, step: int, evaluation: dict[str, float], events=True, final=False) -> None:
        """An evaluation's row of eval.jsonl and its TensorBoard scalars: every key, those
        ``events`` names, or none (False). The ``final`` row replaces one for the same step (a
        run resumed after its final evaluation writes it again)."""
        self.held_out = {"held-out acc": f"{100 * evaluation['eval/accuracy']:.1f}%"}
        if not self.primary:
            return
        if final:
            truncate_rows(self.evals, step - 1)
        append_jsonl(self.evals, {"step": step, **evaluation})
        for k, v in evaluation.items():
            if events is True or (events and k in events):
                self.events.add_scalar(k, v, step)

    def started(self, entries: dict[str, Any]) -> None:
        """start_summary.json: the summary entries of the start, kept for a resume's summary."""
        if self.primary:
            write_json(safe_path(self.out, "start_summary.json"), entries)

    def close(self) -> None:
        if self.events is not None:
            self.events, events = None, self.events
            events.close()

    def finish(self, summary: dict[str, Any], provenance: dict, *, resume: bool) -> dict:
        """Write summary.json: ``summary`` plus reward at the start and end of RL (mean of the
        first and last `SUMMARY_WINDOW` steps, at most half the run), time per phase and the
        median step (its first step, which compiles, left out), from metrics.jsonl; this
        process's peak host memory and, off CPU, the accelerator's (a resumed run's are those of
        the process that finished it); and ``provenance``. A resumed run takes the start's
        entries from start_summary.json (a run older than that file: from its first summary, or its
        accuracy alone from eval.jsonl). And the plots of metrics.jsonl."""
        from ais_jax.analysis.plots import plot_run

        rows = _read_rows(self.metrics)
        summary = dict(summary)
        if rows:
            window = max(1, min(SUMMARY_WINDOW, len(rows) // 2))  # single steps are noisy
            summary["reward/first"] = float(np.mean([r["reward/mean"] for r in rows[:window]]))
            summary["reward/last"] = float(np.mean([r["reward/mean"] for r in rows[-window:]]))
            for phase in PHASES:
                summary[f"time/{phase}_s_total"] = sum(r[f"time/{phase}_s"] for r in rows)
            step_s = [sum(r[f"time/{phase}_s"] for phase in PHASES) for r in rows]
            summary["time/step_s_median"] = float(np.median(step_s[1:] or step_s))
            plot_run(self.metrics, safe_path(self.out, "plots"))
        summary["memory/host_peak_gib"] = host_peak_gib()
        summary["memory/device_peak_gib"] = device_peak_gib()
        path = safe_path(self.out, "summary.json")
        if resume:
            first = _read_json(safe_path(self.out, "start_summary.json"))
            if not first:
                kept = ("initial/", "sft/", "time/sft")
                first = {k: v for k, v in _read_json(path).items() if k.startswith(kept)}
            if not any(k.startswith("initial/") for k in first):
                first.update(self._start_evaluation())  # an older run that crashed
            summary = {**first, **summary}
        summary["provenance"] = provenance
        write_json(path, summary)
        return summary

    def _start_evaluation(self) -> dict[str, Any]:
        """``initial/`` entries from eval.jsonl's step-0 row, for a run that predates
        start_summary.json resumed after a crash (its first process wrote no summary); the warm
        start's loss and time are in no file and are left out, with a warning."""
        start = next((r for r in _read_rows(self.evals) if r.get("step") == 0), None)
        if start is None:
            log.warning("%s has no step-0 row: the summary lacks the start's accuracy.", self.evals)
            return {}
        log.warning(
            "%s: no summary of the run's start; its accuracy is taken from %s, its SFT loss and "
            "time are not recorded.",
            self.out,
            self.evals,
        )
        return {f"initial/{k}": v for k, v in start.items() if k != "step"}


def accuracy_words(evaluation: dict[str, float]) -> str:
    """``"62.5% of 200 held-out prompts answered correctly (greedy), 40.0% with one sample
    each"``."""
    return (
        f"{100 * evaluation['eval/accuracy']:.1f}% of {int(evaluation['eval/examples'])} "
        f"held-out prompts answered correctly (greedy), "
        f"{100 * evaluation['eval/sampled_accuracy']:.1f}% with one sample each"
    )


def describe(summary: dict[str, Any]) -> str:
    """The outcome of a run in words: held-out accuracy before and after RL, and the change."""
    end = f"After {summary['steps']} GRPO steps: {accuracy_words(summary)}."
    if "initial/eval/accuracy" not in summary:
        return end
    start = {k.removeprefix("initial/"): v for k, v in summary.items() if k.startswith("initial/")}
    change = 100 * (summary["eval/accuracy"] - start["eval/accuracy"])
    return (
        f"Before RL (after the warm start): {accuracy_words(start)}.\n{end}\n"
        f"GRPO changed greedy held-out accuracy by {change:+.1f} points."
    )


def _read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a row file (metrics.jsonl, eval.jsonl); [] if there is none yet."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line]


def _read_json(path: Path) -> dict[str, Any]:
    """The start_summary.json or summary.json a resumed run reads; {} if it is missing, and with a
    warning naming the file if it is damaged (the new summary does without it)."""
    if not path.exists():
        return {}
    try:
        prev = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        log.warning("%s is not readable JSON (%s); the summary does without it.", path, e)
        return {}
    return prev if isinstance(prev, dict) else {}


# ---- row files ----------------------------------------------------------------------------------


def append_jsonl(path: str | os.PathLike, row: dict[str, Any]) -> None:
    """Append ``row`` as one line of strict JSON (a non-finite value is written as null, with a
    warning naming the file, the step and the keys); an OSError names ``path``."""
    path = Path(path)
    text, bad = dumps_strict(row)
    if bad:
        log.warning("%s: step %s: non-finite %s written as null.", path, row.get("step"), bad)
    _set_aside_before_first_write(path)
    try:
        with path.open("a") as f:
            f.write(text + "\n")
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None


def truncate_rows(path: str | os.PathLike, step: int) -> None:
    """Keep the rows of ``path`` up to ``step`` (a resumed run writes the later ones again). A
    torn last line (a run killed mid-write, a full disk) is dropped with a warning; a damaged
    line before it is a ValueError naming the file and line. The file is replaced in one
    rename, so a kill here loses nothing."""
    path = Path(path)
    if not path.exists():
        return
    try:
        lines = path.read_text().splitlines()
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read ({e}); move it away to resume.") from None
    numbered = [(i, line) for i, line in enumerate(lines, 1) if line.strip()]
    keep = []
    for n, (i, line) in enumerate(numbered):
        try:
            row = json.loads(line)
            row_step = row["step"]
            if not isinstance(row_step, int):
                raise TypeError("step is not an integer")
        except (ValueError, KeyError, TypeError) as e:
            if n == len(numbered) - 1:
                log.warning("%s:%d: dropped a torn last line (%s).", path, i, e)
                break
            raise ValueError(
                f"{path}:{i}: not a metrics row ({e}); fix or delete that line to resume."
            ) from None
        if row_step <= step:
            keep.append(line)
    write_atomic(path, "".join(line + "\n" for line in keep))


# Row files of an earlier run that a fresh run in the same directory replaces at its first row.
_SET_ASIDE: set[Path] = set()


def set_aside_on_first_write(path: str | os.PathLike) -> None:
    """If ``path`` exists, move it to ``<name>.old`` (``.old2``, ...) just before the first
    `append_jsonl` to it, so an earlier run's rows are kept, not mixed with or deleted by a
    new run's."""
    path = Path(path)
    if path.exists():
        _SET_ASIDE.add(path.absolute())


def forget_set_aside(out: str | os.PathLike) -> None:
    """Drop the pending `set_aside_on_first_write` marks under ``out`` (its run has ended)."""
    out = Path(out).absolute()
    _SET_ASIDE.difference_update({p for p in _SET_ASIDE if p.is_relative_to(out)})


def _set_aside_before_first_write(path: Path) -> None:
    if path.absolute() not in _SET_ASIDE:
        return
    _SET_ASIDE.discard(path.absolute())
    old = path.with_name(path.name + ".old")
    n = 1
    while old.exists():
        n += 1
        old = path.with_name(f"{path.name}.old{n}")
    if path.exists():
        path.rename(old)
        log.warning("%s: the rows of an earlier run in this directory moved to %s.", path, old)


# ---- TensorBoard --------------------------------------------------------------------------------


class EventWriter:
    """TensorBoard events (tensorboardX's `SummaryWriter`, which writes from a thread of its
    own). An I/O error of that thread (a full disk) is raised at the next `add_scalar` as an
    OSError naming the directory, instead of a thread traceback on stderr and, once its queue
    filled up, a hang."""

    def __init__(self, logdir: Path, purge_step: int | None):
        SummaryWriter = _summary_writer_class()
        _catch_event_thread_errors()
        _EVENT_ERRORS.clear()
        self.logdir = logdir
        self._writer = SummaryWriter(str(logdir), purge_step=purge_step, max_queue=1000)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._check()
        self._writer.add_scalar(tag, value, step)

    def close(self) -> None:
        self._check()
        try:
            self._writer.close()
        except OSError as e:
            self._fail(e)
        self._check()

    def _check(self) -> None:
        if _EVENT_ERRORS:
            self._fail(_EVENT_ERRORS.pop())

    def _fail(self, e: OSError):
        # mark the event files closed, or tensorboardX's atexit hook flushes them again
        for file_writer in (getattr(self._writer, "all_writers", None) or {}).values():
            if getattr(file_writer, "event_writer", None) is not None:
                file_writer.event_writer._closed = True
        raise OSError(e.errno, e.strerror, str(self.logdir)) from None


_EVENT_ERRORS: list[OSError] = []


def _summary_writer_class() -> type:
    """tensorboardX's `SummaryWriter`, imported only by runs that log, and without torch.

    tensorboardX imports torch at import time when it is installed, only to accept torch
    tensors (we log Python floats), which costs seconds at every run's start. Unless
    torch is already loaded, it is hidden for the duration of the import (a ``None`` entry in
    `sys.modules` makes ``import torch`` raise ImportError, which tensorboardX handles)."""
    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


def _catch_event_thread_errors() -> None:
    """Route OSErrors of tensorboardX's writer threads to `_EVENT_ERRORS` (once per process;
    every other thread exception goes to the previous `threading.excepthook`)."""
    previous = threading.excepthook
    if getattr(previous, "catches_event_errors", False):
        return

    def hook(args):
        if type(args.thread).__name__ == "_EventLoggerThread" and isinstance(
            args.exc_value, OSError
        ):
            _EVENT_ERRORS.append(args.exc_value)
            return
        previous(args)

    hook.catches_event_errors = True
    threading.excepthook = hook
