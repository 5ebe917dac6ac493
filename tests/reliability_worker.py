"""`ais-jax` as tests/test_reliability.py runs it: ``python reliability_worker.py train ...``.

The same entry point as the console script (`ais_jax.cli.main`), plus the crash points the
test asks for with ``AIS_JAX_TEST_KILL_AT=<phase>:<step>``: the process SIGKILLs itself, as a
crash or a preempted job would, on reaching that point of RL step ``step`` (1-based). The
points are hooked in here, from outside the library, by wrapping what the run calls:

    rollout      the start of `Run.collect` (weight sync, rollout, reward, score) of the step
    update       the start of `Run.learn` (the update phase) of the step
    checkpoint   inside orbax's save of step ``step``: after every file of the step's temporary
                 folder (``<step>.orbax-checkpoint-tmp``) is written and before orbax finalizes
                 it and renames it into place, the most complete a half-written checkpoint
                 can be
"""

from __future__ import annotations

import functools
import os
import re
import signal
import sys
from pathlib import Path

import orbax.checkpoint as ocp

from ais_jax.cli.main import main
from ais_jax.train.run import Run

KILL_AT = os.environ.get("AIS_JAX_TEST_KILL_AT")


def kill_point(phase: str, step: int) -> None:
    if KILL_AT == f"{phase}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def at_start_of_step(phase: str, method):
    """``method`` of `Run`, first passing the kill point ``phase`` of the step it serves."""

    @functools.wraps(method)
    def wrapped(run, *args, **kwargs):
        kill_point(phase, int(run.state.step) + 1)
        return method(run, *args, **kwargs)

    return wrapped


_finalize = ocp.CompositeCheckpointHandler.finalize


def _finalize_with_kill_point(self, directory):
    match = re.match(r"(\d+)\.orbax-checkpoint-tmp", Path(str(directory)).name)
    if match:
        kill_point("checkpoint", int(match.group(1)))
    return _finalize(self, directory)


if KILL_AT:
    Run.collect = at_start_of_step("rollout", Run.collect)
    Run.learn = at_start_of_step("update", Run.learn)
    ocp.CompositeCheckpointHandler.finalize = _finalize_with_kill_point

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
