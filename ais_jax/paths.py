"""Where a run may write: every output path is built with `safe_path` under the run directory.

The output directory itself (``--out``) is the user's choice and may be anywhere; what the
library derives from it (``checkpoints/``, ``metrics.jsonl``, ``tb/``, ``plots/``, the arms of
``ais-jax compare``) must stay inside it, so that a name taken from a config can never make a
run write over files elsewhere. The check is lexical (``..`` and absolute parts are resolved
as text, symbolic links are not followed): a user may still point ``out/checkpoints`` at
another disk with a link.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["safe_path"]


def safe_path(out: str | os.PathLike, *parts: str | os.PathLike) -> Path:
    """``Path(out, *parts)``; a ValueError if it leaves ``out`` (``..``, an absolute part).

    >>> safe_path("runs/a", "checkpoints", "3").as_posix()
    'runs/a/checkpoints/3'
    >>> safe_path("runs/a", "../b")
    Traceback (most recent call last):
    ...
    ValueError: Output path '../b' leaves the run directory 'runs/a'.
    """
    base = os.path.abspath(out)
    target = os.path.abspath(os.path.join(base, *parts))
    if os.path.commonpath([base, target]) != base:
        shown = os.path.join(*parts) if parts else ""
        raise ValueError(f"Output path {str(shown)!r} leaves the run directory {str(out)!r}.")
    return Path(out, *parts)
