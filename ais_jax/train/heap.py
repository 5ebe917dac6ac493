"""Keeping the memory a training step frees for the next one, and giving the memory XLA's
compiler frees back to the operating system.

XLA:CPU allocates each call's temporaries as one buffer (35 MB for the default job's SFT step)
and frees it when the call ends. glibc maps blocks above 32 MB anew and unmaps them on ``free``,
returns the top of a heap once 128 KB of it is free, and unmaps a thread arena's emptied heap:
every call faulted its temporaries' pages in again, a large share of a small step's time spent
in the kernel. `reuse_freed_memory` tells glibc to keep freed memory instead (``mallopt``);
`Run` sets it: the default job runs faster with far fewer page faults and a few percent more
peak resident memory, the results bit for bit the same (measured: docs/benchmarks.md).
Blocks larger than a thread arena's 64 MB heap are still mapped anew.

XLA:CPU compiles each program with LLVM, whose allocations are freed when the compile ends,
but glibc keeps freed heap pages for reuse: they stay in the process's resident memory. On the
tiny benchmark model they were most of what a GRPO step held beyond its model and buffers, and
``malloc_trim`` returned most of them (measured: docs/benchmarks.md).

`release_after_compiles` asks glibc to return its free pages after every compile of at least
`MIN_COMPILE_S`; `Run` installs it. Elsewhere (macOS, musl) both do nothing.
"""

from __future__ import annotations

import ctypes
import functools
import platform

import jax

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# glibc's <malloc.h>
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4
# Free memory at the top of the heap beyond this goes back to the system (glibc: 128 KB).
KEEP_FREE_BYTES = 1 << 30
# Each heap keeps this much free room at its top (glibc: 128 KB); it also stops glibc unmapping
# a thread arena's emptied 64 MB heap, which the trim threshold does not govern.
TOP_PAD_BYTES = 64 << 20
# Shorter compiles leave little to return, and each trim walks the whole heap.
MIN_COMPILE_S = 0.1


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """This process's C library when it is glibc, else None."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def _malloc_trim():
    """glibc's ``malloc_trim``, or None off glibc."""
    libc = _glibc()
    return None if libc is None else libc.malloc_trim


@functools.cache
def reuse_freed_memory() -> bool:
    """From now on in this process, glibc serves blocks from its heaps rather than mapping
    each anew, keeps up to `KEEP_FREE_BYTES` free at a heap's top and `TOP_PAD_BYTES` in a
    thread's heap, so that a step's freed temporaries are the next step's, without new pages
    to fault in; whether it can (glibc). Memory freed stays with the process until
    `release_free_heap` (after every long compile once `release_after_compiles` is
    installed)."""
    libc = _glibc()
    if libc is None:
        return False
    settings = {M_MMAP_MAX: 0, M_TRIM_THRESHOLD: KEEP_FREE_BYTES, M_TOP_PAD: TOP_PAD_BYTES}
    return all([libc.mallopt(param, value) == 1 for param, value in settings.items()])


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
