"""Training checkpoints with orbax: train state + a JSON record (data iterator, step, config).

Orbax writes each step into a temporary folder and renames it only when every file is on
disk, so a run killed in the middle of a save leaves a `*.orbax-checkpoint-tmp-*` folder that
is never listed as a step: a half-written checkpoint is never picked up. A checkpoint that is
listed but cannot be read (files deleted or truncated afterwards) raises `CheckpointError`
naming its path; ``fallback=True`` restores the newest readable one instead and says which
steps it passed over. A checkpoint whose arrays have other names or shapes than the state to
restore (a different model or training setup) is a `CheckpointError` listing the differences,
found from the checkpoint's metadata before any array is read.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy as preservation

from ais_jax.hf import CheckpointError

log = logging.getLogger(__name__)


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
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), record=ocp.args.JsonSave(record)
            ),
            force=True,
        )
        self._manager.wait_until_finished()

    def restore(
        self, template: Any, step: int | None = None, *, fallback: bool = False
    ) -> tuple[int, Any, dict[str, Any]]:
        """Restore ``step`` (default: the latest) onto ``template``'s structure and shardings.

        Returns ``(step, state, record)``.
        """
        steps = self.steps()
        if not steps:
            raise CheckpointError(f"No checkpoint to resume from in {self.directory}.")
        candidates = [step] if step is not None else steps[::-1]
        if step is not None and step not in steps:
            raise CheckpointError(
                f"No checkpoint for step {step} in {self.directory}; available steps: {steps}."
            )
        if fallback and step is None:
            candidates = steps[::-1]
        elif step is None:
            candidates = steps[-1:]
        failures = []
        for s in candidates:
            self._check_shapes(s, template)
            try:
                out = self._manager.restore(
                    s,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(template), record=ocp.args.JsonRestore()
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
            return s, out.state, dict(out.record)
        hint = "" if fallback else " Pass fallback=True (--resume-fallback) to use an older one."
        raise CheckpointError(
            "Checkpoint could not be read (corrupt or truncated): "
            + "; ".join(failures)
            + "."
            + hint
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


def _shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    """``{"train/params/embed": (V, D), ...}`` for a state pytree or orbax's metadata tree."""

    def name(k):
        return str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))

    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(name(k) for k in path): tuple(leaf.shape) for path, leaf in leaves}
