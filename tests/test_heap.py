"""Specification of `heap.py`: glibc's free heap pages go back to the system, after long
compiles once installed."""

from __future__ import annotations

import ctypes
import platform

import jax
import pytest

from ais_jax import heap

pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's (CI runs on glibc)"
)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_release_free_heap_returns_freed_pages():
    """200 MB of small blocks, freed below a live one (so `free` cannot shrink the heap from
    its top): resident memory falls by most of them only after `release_free_heap`."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    size, count = 2048, 100_000
    blocks = [libc.malloc(size) for _ in range(count)]
    for b in blocks:
        ctypes.memset(b, 1, size)  # resident
    pin = libc.malloc(size)
    for b in blocks:
        libc.free(b)
    held = _resident_bytes()
    assert heap.release_free_heap()
    released = held - _resident_bytes()
    libc.free(pin)
    assert released > 0.5 * size * count, released


def test_release_after_compiles_trims_after_long_compiles_only(monkeypatch):
    calls = []
    monkeypatch.setattr(heap, "release_free_heap", lambda: calls.append(1))
    assert heap.release_after_compiles()
    assert heap.release_after_compiles()  # installed once: one trim per compile below
    record = jax.monitoring.record_event_duration_secs
    record(heap.COMPILE_EVENT, heap.MIN_COMPILE_S + 0.5)
    assert len(calls) == 1
    record(heap.COMPILE_EVENT, heap.MIN_COMPILE_S / 10)  # short: little to return
    record("/jax/core/compile/jaxpr_trace_duration", 5.0)  # not a compile
    assert len(calls) == 1
