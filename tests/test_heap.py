"""Specification of `heap.py`: a program's freed temporaries are reused by its next call once
`reuse_freed_memory` is set, and glibc's free heap pages go back to the system after long
compiles once installed."""

from __future__ import annotations

import ctypes
import json
import platform
import subprocess
import sys

import jax
import pytest
from training_run import TINY_RUN

from ais_jax.config import TrainConfig, from_dict
from ais_jax.train import heap
from ais_jax.train.run import Run

pytestmark = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc",
    reason="mallopt and malloc_trim are glibc's (CI runs on glibc)",
)


# Run in a fresh interpreter: glibc's malloc settings are the whole process's.
FAULTS_PER_CALL = """
import json, resource, statistics, sys
import jax, jax.numpy as jnp
from ais_jax.train import heap

if sys.argv[1] == "reuse":
    assert heap.reuse_freed_memory()


@jax.jit
def step(x_N):  # 40 MiB of temporaries, above the 32 MiB from which glibc maps blocks anew
    a_N = jax.lax.optimization_barrier(jnp.sin(x_N))
    b_N = jax.lax.optimization_barrier(jnp.cos(a_N))
    c_N = jax.lax.optimization_barrier(a_N * b_N)
    return jnp.sum(a_N + b_N + c_N)


x_N = jax.random.normal(jax.random.key(0), (5 << 20,))
temp_bytes = step.lower(x_N).compile().memory_analysis().temp_size_in_bytes
step(x_N).block_until_ready()
faults = []
for _ in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step(x_N).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
# the median call: one on a thread (a malloc arena) the program has not run on yet faults its
# temporaries in once more
pages = temp_bytes / resource.getpagesize()
print(json.dumps({"temp_pages": pages, "faults": statistics.median(faults)}))
"""


def _faults_per_call(mode: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", FAULTS_PER_CALL, mode], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_reuse_freed_memory_keeps_a_calls_temporaries_for_the_next():
    """Under glibc's defaults every call of a program with 40 MiB of temporaries faults all of
    their pages in anew (XLA:CPU frees them at the end of each call, glibc unmaps them); once
    `reuse_freed_memory` is set, the next calls find them in the heap: the median call of 12
    (a call on a thread whose malloc arena has not held them yet faults them in once; in one
    CI run under load, the mean over 10 calls was 30% of the pages)."""
    default, reused = _faults_per_call("default"), _faults_per_call("reuse")
    assert default["temp_pages"] == reused["temp_pages"] >= 40 * 2**20 / 4096
    assert default["faults"] >= 0.9 * default["temp_pages"], default
    assert reused["faults"] <= 0.2 * default["faults"], (default, reused)


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


def test_a_run_sets_both(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(heap, "reuse_freed_memory", lambda: calls.append("reuse"))
    monkeypatch.setattr(heap, "release_after_compiles", lambda: calls.append("release"))
    Run(from_dict(TrainConfig, TINY_RUN), tmp_path / "run")
    assert sorted(calls) == ["release", "reuse"]
