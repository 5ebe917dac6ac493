"""Stopping a run on SIGINT (Ctrl-C) or SIGTERM (how schedulers preempt) without losing work.

Inside `graceful_stop()` (the ``ais-jax train`` and ``ais-jax compare`` commands enter it) the
first SIGINT or SIGTERM only sets a flag. The trainer looks at the flag at *stop points*
(`stop_requested`): after every RL step, after the step-0 checkpoint and every few SFT steps.
At a stop point after an RL step it writes a checkpoint of that step (if the schedule has not
just written one) and raises `Interrupted`, which the command line turns into one line saying
how to resume and exit status 128 + signal (130 for SIGINT, 143 for SIGTERM). A second signal
stops the process at once (``os._exit``), like a SIGKILL: the newest committed checkpoint is
where ``--resume`` continues.

Multi-host: a signal usually reaches one host (the one being preempted), and every host must
write the same step. At each stop point every process contributes its flag to one
`multihost_utils.process_allgather` (a few bytes), so all of them see the same answer and stop
after the same step and write the same checkpoint. SIGTERM is JAX's: `jax.distributed.
initialize` installs the coordination service's preemption notifier, which catches SIGTERM (and
the scheduler's other preemption notices) and tells every host; after each RL step every
process also asks `multihost_utils.reached_preemption_sync_point(step)` (what orbax's
``CheckpointManager.reached_preemption`` asks), which is true on all of them at the same step,
the step after the newest one any host had finished when the notice came. A second SIGTERM
does not stop a multi-host process at once (the notifier only records it); a second SIGINT
does.

Outside `graceful_stop()` (a notebook, a library caller) no handler is installed and
`stop_requested` is always None: Ctrl-C keeps its usual meaning there.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = [
    "GracefulStop",
    "Interrupted",
    "graceful_stop",
    "resume_hint",
    "stop_point",
    "stop_requested",
]

SIGNALS = (signal.SIGINT, signal.SIGTERM)


def resume_hint(out: str | os.PathLike) -> str:
    """The command that continues the run in ``out`` (``ais-jax compare`` replaces it)."""
    return _hint(out)


def _train_hint(out) -> str:
    import shlex

    return f"ais-jax train --out {shlex.quote(str(out))} --resume"


_hint = _train_hint


def set_resume_hint(fn) -> None:
    """``fn(out) -> str``: the resume command the messages give (``ais-jax compare`` sets its
    own, since it resumes every unfinished arm)."""
    global _hint
    _hint = fn or _train_hint


class Interrupted(Exception):
    """The run stopped at a stop point after a signal; ``checkpoint`` is the step saved (None
    when the run stopped before its first checkpoint)."""

    def __init__(self, signum: int, out: Path, checkpoint: int | None):
        self.signum, self.out, self.checkpoint = signum, Path(out), checkpoint
        name = signal.Signals(signum).name
        if checkpoint is None:
            what = f"Stopped by {name} in the warm start, before the first checkpoint"
        else:
            what = (
                f"Stopped by {name} after step {checkpoint}, checkpoint saved in "
                f"{self.out / 'checkpoints' / str(checkpoint)}"
            )
        super().__init__(f"{what}; resume with: {resume_hint(self.out)}")

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


class GracefulStop:
    """The flag the signal handler sets; `requested` is the same on every process."""

    def __init__(self, out: str | os.PathLike | None = None):
        self.signum: int | None = None
        # the run being trained, for the second-signal message
        self.out: Path | None = None if out is None else Path(out)

    def handler(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:  # the second signal: stop now
            how = f" with: {resume_hint(self.out)}" if self.out is not None else ""
            _say(
                f"ais-jax: second {name}: stopping now, without a checkpoint; resume from the "
                f"newest one{how}"
            )
            os._exit(128 + signum)
        self.signum = signum
        _say(
            f"ais-jax: {name}: finishing the current step and writing a checkpoint (send it "
            "again to stop at once)."
        )

    def requested(self, step: int | None = None) -> int | None:
        """The signal that asked the run to stop (any process's), or None. A collective when
        there are several processes: every process must call it at the same point, and with
        the same RL ``step`` (None at stop points between RL steps)."""
        import jax

        flag = self.signum or 0
        if jax.process_count() > 1:
            import numpy as np
            from jax.experimental import multihost_utils

            flags = np.asarray(multihost_utils.process_allgather(np.int32(flag)))
            flag = int(flags.max())
            if not flag and step is not None and _reached_preemption_sync_point(step):
                flag = int(signal.SIGTERM)
        return flag or None


def _reached_preemption_sync_point(step: int) -> bool:
    from jax.experimental import multihost_utils

    try:
        return multihost_utils.reached_preemption_sync_point(step)
    except RuntimeError:  # the preemption service is off (jax_enable_preemption_service)
        return False


_active: GracefulStop | None = None


def stop_requested(out: str | os.PathLike | None = None, step: int | None = None) -> int | None:
    """At a stop point: the signal every process agrees stops the run, or None (always None
    outside `graceful_stop`). ``out`` is the run directory, for the messages; ``step`` the RL
    step just finished (None during the warm start)."""
    if _active is None:
        return None
    if out is not None:
        _active.out = Path(out)
    return _active.requested(step)


def stop_point(
    out: str | os.PathLike,
    step: int | None = None,
    *,
    save: Callable[[], None] | None = None,
    close: Callable[[], None] | None = None,
) -> None:
    """A stop point of the trainer, after RL step ``step`` (None: in the warm start, before
    the first checkpoint): if a signal asked the run to stop (`stop_requested`), call ``save``
    (which writes this step's checkpoint) and ``close``, then raise `Interrupted`."""
    signum = stop_requested(out, step)
    if signum is None:
        return
    if save is not None:
        save()
    if close is not None:
        close()
    raise Interrupted(signum, out, step)


@contextlib.contextmanager
def graceful_stop(out: str | os.PathLike | None = None) -> Iterator[GracefulStop | None]:
    """SIGINT and SIGTERM set a flag instead of stopping the process (main thread only);
    ``out``: the run directory, for the messages (the trainer sets it too)."""
    global _active
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    stop, outer = GracefulStop(out), _active
    previous = {s: signal.signal(s, stop.handler) for s in SIGNALS}
    _active = stop
    try:
        yield stop
    finally:
        _active = outer
        for s, h in previous.items():
            signal.signal(s, h)


def _say(line: str) -> None:
    """A line on stderr from a signal handler: a raw write (the handler may interrupt a print
    or a progress bar mid-write)."""
    with contextlib.suppress(OSError):
        os.write(2, ("\n" + line + "\n").encode())
