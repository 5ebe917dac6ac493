"""Training checkpoints with orbax: train state + a JSON record (data iterator, step), and the
run's config.yaml (`write_config`), which says what the checkpoints are of: a run resumes
under it, changing only what `config.check_resume` allows (`resume_config`).

The record holds the grain iterator state, whose bytes are stored as ``{"__bytes__": hex}``
(`to_record` / `from_record`).

Orbax writes each step into a temporary folder and renames it only when every file is on
disk, so a run killed in the middle of a save leaves a `*.orbax-checkpoint-tmp-*` folder that
is never listed as a step: a half-written checkpoint is never picked up. A checkpoint that is
listed but cannot be read (files deleted or truncated afterwards) raises `UnreadableCheckpoint`
naming its path and ending in advice, which each command replaces with its own remedy
(`UnreadableCheckpoint.advise`); ``fallback=True`` restores the newest readable one instead
and says which steps it passed over. A checkpoint whose arrays have other names or shapes than
the state to restore (a different model or training setup) is a `CheckpointError` listing the
differences, found from the checkpoint's metadata before any array is read.

A save that fails (a full disk, a file-size limit, a read-only file system) is one
`CheckpointError` naming the step's folder and the reason. orbax's worker threads each report
the failure too (absl and asyncio log records, "Event loop is closed" from tensorstore
callbacks, and asyncio's "Task was destroyed but it is pending!" with "coroutine ... was never
awaited" for writes that had not started when the save's loop closed): those echoes are held
back during the save and, once it has failed, dropped for the rest of the process. A restored
checkpoint whose floating-point arrays hold NaN or infinity is restored with a
warning naming the checkpoint and the arrays.

A restore reads every array at once (a task per array, in an event loop that orbax makes and
closes for the call), and the first read that fails ends the call. The reads still in flight
are cancelled and awaited before that loop closes (`_reads_end_with_their_loop`). Left
pending, they finished later in tensorstore's threads, posting into the closed loop
("RuntimeError: Event loop is closed"), or were collected at exit, where orbax turns the
closing of each suspended read into an exception of its own ("Exception ignored in: <coroutine
object _read_array_index_and_device_put>"): tracebacks after the command's one error line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy as preservation

from ais_jax.config import TrainConfig, check_resume, describe_changes, dump_config, load_config
from ais_jax.io.hf import CheckpointError
from ais_jax.io.paths import safe_path, write_atomic

log = logging.getLogger(__name__)


class UnreadableCheckpoint(CheckpointError):
    """Checkpoints that are listed but cannot be read: ``failed``, their steps (newest first),
    and ``others``, the directory's other steps. The message is ``problem`` then ``advice``,
    the library's; a command replaces the advice with its own remedy (`advise`)."""

    def __init__(self, problem: str, *, failed: list[int], others: list[int], advice: str):
        super().__init__(f"{problem} {advice}".strip())
        self.problem, self.failed, self.others = problem, failed, others

    def advise(self, advice: str) -> UnreadableCheckpoint:
        """The same error with ``advice`` in place of the library's."""
        return UnreadableCheckpoint(
            self.problem, failed=self.failed, others=self.others, advice=advice
        )


def steps_words(steps: list[int]) -> str:
    """``"steps 0, 2"`` or ``"step 0"``: checkpoints named in advice (``steps`` not empty)."""
    return f"step{'s' if len(steps) > 1 else ''} {', '.join(str(s) for s in steps)}"


class Checkpointer:
    """Save/restore ``(state pytree, json dict)`` pairs under ``directory/<step>``."""

    def __init__(self, directory: str | Path, *, max_to_keep: int | None = 3):
        self.directory = Path(directory).absolute()
        self._manager = ocp.CheckpointManager(
            self.directory,
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),  # for item_metadata
                "record": ocp.JsonCheckpointHandler(),
            },
            options=ocp.CheckpointManagerOptions(
                # the newest max_to_keep, and step 0 (the warm start, which later runs and
                # `ais-jax compare --start RUN@0` branch from) always
                preservation_policy=None
                if max_to_keep is None
                else preservation.AnyPreservationPolicy(
                    [preservation.LatestN(max_to_keep), preservation.CustomSteps([0])]
                ),
                create=True,
                enable_async_checkpointing=False,
            ),
        )

    def steps(self) -> list[int]:
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: Any, record: dict[str, Any]) -> None:
        if step in self.steps():  # a step re-run after `fallback` passed over its bad checkpoint
            log.warning("Overwriting checkpoint %s.", self.directory / str(step))
            self._manager.delete(step)
        try:
            with _held_back_echoes():
                self._manager.save(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardSave(state), record=ocp.args.JsonSave(record)
                    ),
                    force=True,
                )
                self._manager.wait_until_finished()
        except Exception as e:  # orbax/tensorstore raise ValueError, OSError, RuntimeError...
            if jax.process_count() == 1:  # never listed; free its space (best effort: writes
                # still in flight in orbax's threads may leave some of it)
                for tmp in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
                    shutil.rmtree(tmp, ignore_errors=True)
            newest = [s for s in self.steps() if s != step]
            kept = (
                f"the newest complete checkpoint is step {newest[-1]}"
                if newest
                else ("there is no complete checkpoint yet")
            )
            raise CheckpointError(
                f"Checkpoint {self.directory / str(step)} could not be written: "
                f"{_reason(e)}; {kept}."
            ) from None

    def restore(
        self, template: Any, step: int | None = None, *, fallback: bool = False
    ) -> tuple[int, Any, dict[str, Any]]:
        """Restore ``step`` (default: the latest) onto ``template``'s structure and shardings.

        Returns ``(step, state, record)``. A checkpoint that cannot be read is an
        `UnreadableCheckpoint`; ``fallback`` (with no ``step``) tries the older ones first.
        """
        steps = self.steps()
        if not steps:
            raise CheckpointError(f"No checkpoint to resume from in {self.directory}.")
        if step is not None and step not in steps:
            raise CheckpointError(
                f"No checkpoint for step {step} in {self.directory}; available steps: {steps}."
            )
        if step is not None:
            candidates = [step]
        elif fallback:
            candidates = steps[::-1]
        else:
            candidates = steps[-1:]
        failures = []
        for s in candidates:
            with _reads_end_with_their_loop():
                self._check_shapes(s, template)
                try:
                    with _held_back_echoes():  # a damaged file fails every read that touches it
                        out = self._manager.restore(
                            s,
                            args=ocp.args.Composite(
                                state=ocp.args.StandardRestore(template),
                                record=ocp.args.JsonRestore(),
                            ),
                        )
                except Exception as e:  # orbax/tensorstore raise many types for damaged files
                    failures.append(
                        f"{self.directory / str(s)}: {type(e).__name__}: "
                        f"{str(e).splitlines()[0][:200] if str(e) else ''}"
                    )
                    continue
            if failures:
                log.warning("Skipped unreadable checkpoint(s): %s", "; ".join(failures))
            bad = nonfinite(out.state)
            if bad:
                log.warning(
                    "Checkpoint %s holds non-finite values (NaN or inf) in %s; what is "
                    "computed from them will be NaN.",
                    self.directory / str(s),
                    ", ".join(bad[:6])
                    + (f" and {len(bad) - 6} more arrays" if len(bad) > 6 else ""),
                )
            return s, out.state, dict(out.record)
        failed = candidates  # every one, or it would have returned
        others = [s for s in steps if s not in failed]
        if fallback and step is None:
            advice = ""
        elif step is None:
            advice = "Pass fallback=True (--resume-fallback) to use an older one."
        else:
            advice = f"Restore another step: {others}." if others else "There is no other step."
        raise UnreadableCheckpoint(
            "Checkpoint could not be read (corrupt or truncated): " + "; ".join(failures) + ".",
            failed=failed,
            others=others,
            advice=advice,
        )

    def _check_shapes(self, step: int, template: Any) -> None:
        """A `CheckpointError` if the arrays stored for ``step`` are not those of ``template``
        (names and shapes); silent when the metadata itself is unreadable (restore reports it)."""
        try:
            stored = _shapes(self._manager.item_metadata(step)["state"])
        except Exception:  # a damaged checkpoint: the restore that follows names the problem
            return
        wanted = _shapes(template)
        diffs = [
            f"{k}: stored {stored[k]}, expected {v}"
            if k in stored
            else f"{k}: not in the checkpoint"
            for k, v in wanted.items()
            if stored.get(k) != v
        ]
        diffs += [f"{k}: not expected" for k in stored if k not in wanted]
        if diffs:
            more = f" ... ({len(diffs)} differences)" if len(diffs) > 4 else ""
            raise CheckpointError(
                f"Checkpoint {self.directory / str(step)} does not match the model and training "
                f"setup of this config: {'; '.join(diffs[:4])}{more}. Resume with the config the "
                "run was trained with (config.yaml in the run directory)."
            )


def write_config(cfg: TrainConfig, out: str | os.PathLike) -> Path:
    """``out/config.yaml``: the resolved configuration of the run in ``out``, written atomically."""
    Path(out).mkdir(parents=True, exist_ok=True)
    path = safe_path(out, "config.yaml")
    write_atomic(path, dump_config(cfg))
    return path


def resume_config(cfg: TrainConfig, out: str | os.PathLike, *, write: bool = True) -> None:
    """Resuming the run in ``out`` under ``cfg``: a ValueError naming every setting that differs
    from the run's config.yaml and may not change on resume (`config.check_resume`); the
    changes allowed (`config.RESUMABLE`) are written to config.yaml (if ``write``) and logged.
    Nothing to check when the directory has no config.yaml."""
    path = safe_path(out, "config.yaml")
    if not path.is_file():
        return
    changes = check_resume(load_config(path), cfg, path)
    if changes and write:
        write_config(cfg, out)
        log.info("--resume: %s updated (%s).", path, describe_changes(changes, "before", "now"))


def to_record(state: Any) -> Any:
    """A grain iterator state as JSON (bytes become ``{"__bytes__": hex}``)."""
    if isinstance(state, bytes):
        return {"__bytes__": state.hex()}
    if isinstance(state, dict):
        return {k: to_record(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return [to_record(v) for v in state]
    return state


def from_record(state: Any) -> Any:
    """The inverse of `to_record`."""
    if isinstance(state, dict):
        if set(state) == {"__bytes__"}:
            return bytes.fromhex(state["__bytes__"])
        return {k: from_record(v) for k, v in state.items()}
    if isinstance(state, list):
        return [from_record(v) for v in state]
    return state


def _shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    """``{"train/params/embed": (V, D), ...}`` for a state pytree or orbax's metadata tree."""

    def name(k):
        return str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(name(k) for k in path): tuple(leaf.shape) for path, leaf in leaves}


def nonfinite(tree: Any) -> list[str]:
    """``["train/params/embed (3 of 2496 values)", ...]``: the floating-point arrays of
    ``tree`` that hold NaN or infinity (counted on the devices; a collective with several
    processes, like any computation on global arrays)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    found = []
    for path, leaf in leaves:
        if not hasattr(leaf, "dtype") or not jnp.issubdtype(leaf.dtype, jnp.floating):
            continue
        count = int(jnp.sum(~jnp.isfinite(leaf)))
        if count:
            name = "/".join(
                str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path
            )
            found.append(f"{name} ({count} of {leaf.size} values)")
    return found


_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


def _reason(e: Exception) -> str:
    """Why a save failed, in a few words: the OS error when there is one (tensorstore puts its
    code in the message), else the first line of the message, cut at 200 characters."""
    errno_ = getattr(e, "errno", None)
    match = _OS_ERROR_CODE.search(str(e))
    if errno_ is None and match:
        errno_ = int(match.group(1))
    if errno_ is not None:
        import errno as codes

        hint = ""
        if errno_ in (codes.ENOSPC, codes.EFBIG, codes.EDQUOT):
            hint = " (the disk is full or a file-size limit was reached: free space or raise it)"
        return f"{os.strerror(errno_)}{hint}"
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    return first[:200]


class _Hold(logging.Filter):
    """Holds back every record of a logger (for a save that may fail)."""

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record):
        self.records.append(record)
        return False


_NOISE = (
    # asyncio, for the other writes of a failed save: "Task exception was never retrieved" and,
    # for the future that gathers them, "_GatheringFuture exception was never retrieved"
    "exception was never retrieved",
    "raised an exception",  # orbax: "_SignalingThread.run() raised an exception: ..."
    # asyncio, for a write task whose loop the failed save closed before the task first ran
    "Task was destroyed but it is pending",
)
# ...and that task's coroutine, closed unstarted, warns (when the task is collected)
_NEVER_AWAITED = r"coroutine '.*' was never awaited"


class _DropEchoes(logging.Filter):
    """After a failed save: drop the late echoes of that failure from orbax's threads."""

    def filter(self, record):
        return not any(n in str(record.msg) for n in _NOISE)


def _dropping_loop_closed(previous):
    """An unraisable hook that drops tensorstore's late "Event loop is closed" callbacks of a
    failed save and passes everything else to ``previous``."""

    def hook(unraisable):
        if not (
            isinstance(unraisable.exc_value, RuntimeError)
            and "Event loop is closed" in str(unraisable.exc_value)
        ):
            previous(unraisable)

    hook.drops_loop_closed = True
    return hook


@contextlib.contextmanager
def _held_back_echoes():
    """orbax reports one failed write (or read) from every thread that took part (absl and
    asyncio log records with tracebacks, and tensorstore callbacks into an event loop already
    closed, which reach `sys.unraisablehook`) before the save (restore) raises. Hold them back
    during the call; if it succeeds, pass them on; if it fails, drop them (and their late
    arrivals): the error raised says it once."""
    loggers = [logging.getLogger("absl"), logging.getLogger("asyncio")]
    hold, held_unraisable = _Hold(), []
    previous_hook = sys.unraisablehook
    for logger in loggers:
        logger.addFilter(hold)
    sys.unraisablehook = held_unraisable.append
    failed = True
    try:
        yield
        failed = False
    finally:
        for logger in loggers:
            logger.removeFilter(hold)
        sys.unraisablehook = previous_hook
        if failed:
            for logger in loggers:
                if not any(isinstance(f, _DropEchoes) for f in logger.filters):
                    logger.addFilter(_DropEchoes())
            if not getattr(sys.unraisablehook, "drops_loop_closed", False):
                sys.unraisablehook = _dropping_loop_closed(sys.unraisablehook)
            warnings.filterwarnings("ignore", _NEVER_AWAITED, RuntimeWarning)
        else:
            for record in hold.records:
                logging.getLogger(record.name).handle(record)
            for u in held_unraisable:
                previous_hook(u)


class _DrainingLoop(asyncio.SelectorEventLoop):
    """An event loop that, when closed, first cancels the tasks still pending on it and waits
    for them to end (as `asyncio.run` does, which orbax's `run_sync` does not use)."""

    def close(self) -> None:
        if self.is_running() or self.is_closed():
            return super().close()  # a running loop refuses to close: asyncio's error
        try:
            pending = asyncio.all_tasks(self)
            for task in pending:
                task.cancel()
            if pending:  # each ends (cancelled, or with orbax's error for its read) and is
                # retrieved here; a cancelled tensorstore read never calls back
                self.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        finally:
            super().close()


class _DrainingLoops(asyncio.AbstractEventLoopPolicy):
    """The event loop policy ``base``, except that the loops it makes are `_DrainingLoop`s."""

    def __init__(self, base: asyncio.AbstractEventLoopPolicy):
        self.base = base

    def get_event_loop(self):
        return self.base.get_event_loop()

    def set_event_loop(self, loop):
        self.base.set_event_loop(loop)

    def new_event_loop(self):
        return _DrainingLoop()

    def get_child_watcher(self):
        return self.base.get_child_watcher()

    def set_child_watcher(self, watcher):
        self.base.set_child_watcher(watcher)


@contextlib.contextmanager
def _reads_end_with_their_loop():
    """orbax reads a checkpoint in an event loop of its own (``asyncio.new_event_loop``), which
    it closes as soon as the first read fails, with the other reads still in flight. While
    this block runs, the loops made are `_DrainingLoop`s: the reads left behind are cancelled
    and awaited before their loop closes, so none reports later, from tensorstore's threads
    or at exit. The current policy is kept for everything else (the current loop of each
    thread) and is back once the block ends. (asyncio deprecates policies from Python 3.14
    and removes them in 3.16, where this needs another way in.)"""
    base = asyncio.get_event_loop_policy()
    if isinstance(base, _DrainingLoops):  # a restore within a restore
        yield
        return
    asyncio.set_event_loop_policy(_DrainingLoops(base))
    try:
        yield
    finally:
        asyncio.set_event_loop_policy(base)
