"""Where and how a run writes: paths under the run directory, its lock, and strict JSON.

Every output path is built with `safe_path` under the run directory. The output directory
itself (``--out``) is the user's choice and may be anywhere; what the library derives from it
(``checkpoints/``, ``metrics.jsonl``, ``tb/``, ``plots/``, the arms of ``ais-jax compare``)
must stay inside it, so that a name taken from a config can never make a run write over files
elsewhere. The check is lexical (``..`` and absolute parts are resolved as text, symbolic links
are not followed): a user may still point ``out/checkpoints`` at another disk with a link.

`claim_run_dir` makes ``--out`` (or says in one line why it cannot: an existing file, a
read-only place) and holds an exclusive `fcntl.flock` on ``out/.lock`` for the life of the
run, with the holder's pid, host and start time written in it: a second writer is refused
with a message naming the holder. The kernel drops the lock when its process dies, however it
dies, so a SIGKILLed run never leaves a lock that blocks ``--resume``.

`dumps_strict` writes strict JSON: non-finite floats (NaN, +-inf, which `json.dumps` writes as
the non-JSON tokens ``NaN`` and ``Infinity``) become ``null``, and the caller learns which keys
held them, to warn; `write_atomic` replaces a file in one rename, so a crash leaves the old
content or the new, never half of it.
`write_json` writes a whole document (``summary.json``, ``results.json``) that way. The rows a
run appends as it goes are `run_log.py`'s.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import math
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "RunDirBusy",
    "claim_run_dir",
    "dumps_strict",
    "os_error_message",
    "safe_path",
    "strict_json",
    "write_atomic",
    "write_json",
]

log = logging.getLogger(__name__)
LOCK_NAME = ".lock"


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


# ---- the run directory and its lock -------------------------------------------------------------


class RunDirBusy(ValueError):
    """Another live process holds the run directory's lock."""


def os_error_message(e: OSError) -> str:
    """One line for an OSError: the reason, the file, and what to do for a full disk."""
    reason = e.strerror or str(e)
    where = f": {e.filename}" if e.filename else ""
    hint = ""
    if e.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        hint = " (the disk is full or a file-size limit was reached: free space or raise it)"
    return f"{reason}{where}{hint}"


def _make_dir(out: Path, what: str) -> list[Path]:
    """Create ``out`` and its missing parents; returns the directories created (deepest first)."""
    if out.exists() and not out.is_dir():
        raise ValueError(
            f"{what} {str(out)!r} is an existing file, not a directory: give a new or "
            "existing directory."
        )
    created = []
    p = out.absolute()
    while not p.exists():
        created.append(p)
        p = p.parent
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # a parent is a file
        raise ValueError(
            f"{what} {str(out)!r} cannot be created: a part of the path is an existing file."
        ) from None
    except OSError as e:
        raise ValueError(
            f"{what} {str(out)!r} cannot be created ({os_error_message(e)}): give a "
            "directory you can write to."
        ) from None
    return created


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"pid {info['pid']} on host {info['host']}, started {info['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not written its name yet"


@contextlib.contextmanager
def claim_run_dir(out: str | os.PathLike, process: int = 0, *, what: str = "--out") -> Iterator:
    """Create ``out`` if needed and hold its lock until the block ends.

    Process 0 of a run locks ``out/.lock``; process ``i > 0`` of a multi-host run locks
    ``out/.lock.<i>``, so every process of a second job is refused too. A ValueError naming
    ``out`` if it is a file or cannot be written, `RunDirBusy` (a ValueError) naming the holder
    if another live process holds the lock. If the block fails and ``out`` holds nothing but
    the lock, the directories this call created are removed again."""
    out = Path(out)
    created = _make_dir(out, what)
    lock = safe_path(out, LOCK_NAME if process == 0 else f"{LOCK_NAME}.{process}")
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ValueError(
            f"{what} {str(out)!r} is not writable ({os_error_message(e)}): give a directory "
            "you can write to."
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirBusy(
                f"{what} {str(out)!r} is in use by another ais-jax run ({_holder(fd)}; lock "
                f"file {lock}): wait for it to end, or give another {what}."
            ) from None
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        ok = False
        try:
            yield lock
            ok = True
        finally:
            os.ftruncate(fd, 0)  # an empty lock file: nobody holds it
            if not ok and created and _only(out, lock.name):
                lock.unlink(missing_ok=True)
                for d in created:  # deepest first; stops at the first one that is not empty
                    try:
                        d.rmdir()
                    except OSError:
                        break
    finally:
        os.close(fd)  # releases the flock


def _only(out: Path, name: str) -> bool:
    try:
        return [p.name for p in out.iterdir()] == [name]
    except OSError:
        return False


# ---- strict JSON --------------------------------------------------------------------------------


def strict_json(obj: Any, where: str = "") -> tuple[Any, list[str]]:
    """``obj`` with every non-finite float (and NumPy scalar) replaced by None, and the keys
    (``a/b/0``) where that happened."""
    found: list[str] = []

    def walk(x, path):
        if isinstance(x, dict):
            return {k: walk(v, f"{path}/{k}" if path else str(k)) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [walk(v, f"{path}/{i}" if path else str(i)) for i, v in enumerate(x)]
        if hasattr(x, "item") and getattr(x, "shape", None) == ():  # NumPy / JAX scalars
            x = x.item()
        if isinstance(x, float) and not math.isfinite(x):
            found.append(path or "(value)")
            return None
        return x

    return walk(obj, where), found


def dumps_strict(obj: Any, **kwargs) -> tuple[str, list[str]]:
    """``json.dumps`` of `strict_json(obj)` (never ``NaN``/``Infinity``), and the keys that
    held non-finite values."""
    clean, found = strict_json(obj)
    return json.dumps(clean, allow_nan=False, **kwargs), found


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory and one
    rename; an OSError names ``path``."""
    path = Path(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
        tmp = None
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """``obj`` as strict JSON, replacing ``path`` in one rename (never half-written); a
    non-finite value is written as null, with a warning naming the file and the keys."""
    text, bad = dumps_strict(obj, indent=2)
    if bad:
        log.warning("%s: non-finite %s written as null.", path, bad)
    write_atomic(path, text)
