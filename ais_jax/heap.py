"""Giving the memory XLA's compiler frees back to the operating system.

XLA:CPU compiles each program with LLVM, whose allocations are freed when the compile ends,
but glibc keeps freed heap pages for reuse: they stay in the process's resident memory. On the
tiny benchmark model they were most of what a GRPO step held beyond its model and buffers:
resident memory rose 0.31 GiB over the rollout's first call and 0.46 GiB over the update's
compile, of which ``malloc_trim`` returned 0.22 and 0.38 GiB, and the peak over four steps
fell from 1.45 to 1.09 GiB (from 1.29 to 0.94 GiB once `model.recompute_in_backward` had cut
the update's temporaries; `benchmarks/README.md`).

`release_after_compiles` asks glibc to return its free pages after every compile of at least
`MIN_COMPILE_S`; `Run` installs it. Elsewhere (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import platform

import jax

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# Shorter compiles leave little to return, and each trim costs ~10 ms (it walks the heap).
MIN_COMPILE_S = 0.1


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None off glibc."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def release_free_heap() -> bool:
    """Returns the heap's free pages to the operating system now (``malloc_trim(0)``); whether
    this process's C library can (glibc)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
    return trim is not None


def _on_duration(event: str, duration_s: float, **_) -> None:
    if event == COMPILE_EVENT and duration_s >= MIN_COMPILE_S:
        release_free_heap()


@functools.cache
def release_after_compiles() -> bool:
    """Calls `release_free_heap` after each XLA compile of at least `MIN_COMPILE_S`, from now on
    in this process (installed once, however often called); whether it can (glibc). Pages a
    later computation needs are mapped again when it touches them; programs compile only on
    their first call, so a training loop's steady steps are unaffected."""
    if _malloc_trim() is None:
        return False
    jax.monitoring.register_event_duration_secs_listener(_on_duration)
    return True
