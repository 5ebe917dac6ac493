"""`ais-jax` as tests/test_reliability.py runs it: ``python reliability_worker.py train ...``.

The same entry point as the console script (`ais_jax.cli.main`), plus the one kill point the
library cannot place itself: ``AIS_JAX_TEST_KILL_AT=checkpoint:<step>`` SIGKILLs the process
inside orbax's save of that step, after every file of the step's temporary folder
(``<step>.orbax-checkpoint-tmp``) is written and before orbax finalizes it and renames it into
place: the most complete a half-written checkpoint can be. The ``rollout`` and ``update`` kill
points are `ais_jax.runner.kill_point` calls inside the training step.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import orbax.checkpoint as ocp

from ais_jax import runner
from ais_jax.cli import main

_finalize = ocp.CompositeCheckpointHandler.finalize


def _finalize_with_kill_point(self, directory):
    match = re.match(r"(\d+)\.orbax-checkpoint-tmp", Path(str(directory)).name)
    if match:
        runner.kill_point("checkpoint", int(match.group(1)))
    return _finalize(self, directory)


ocp.CompositeCheckpointHandler.finalize = _finalize_with_kill_point

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
