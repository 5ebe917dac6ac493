"""What a result ran on: library versions, the CPU, the devices and the code's commit, and
the peak memory it took.

Training results move with the build: the same seed and data give another SFT loss under
jaxlib 0.10.0 than under 0.10.2, because XLA fuses and sums in another order. Every
`summary.json` and comparison `results.json` therefore carries `provenance()`, so a figure can
be traced to the exact stack that produced it (`constraints.txt` pins that stack for installs).
"""

from __future__ import annotations

import functools
import importlib.metadata
import platform
import subprocess
from pathlib import Path
from typing import Any

__all__ = ["PACKAGES", "cpu_model", "device_peak_gib", "git_commit", "host_peak_gib", "provenance"]

PACKAGES = (
    "jax",
    "jaxlib",
    "flax",
    "optax",
    "orbax-checkpoint",
    "grain",
    "chex",
    "ml-dtypes",
    "numpy",
    "ais_jax",
)


@functools.cache
def cpu_model() -> str:
    """The CPU's model name and the vector extensions its matmuls can use, e.g. ``AMD EPYC 7B13
    (avx2, fma)`` (``/proc/cpuinfo`` on Linux, else `platform.processor()`): hosts of one model
    name differ in them, and XLA:CPU's and PyTorch's kernels with them."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine() or "unknown"
    return _cpu_model_from(info)


def _cpu_model_from(cpuinfo: str) -> str:
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    flags = fields.get("flags", "").split()
    simd = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    name = fields.get("model name") or platform.processor() or platform.machine() or "unknown"
    return f"{name} ({', '.join(simd) or 'no AVX2'})"


def git_commit() -> str | None:
    """The commit of the ais_jax source tree (with ``+dirty`` for local changes), or None
    when the package is not run from a git checkout."""
    root = Path(__file__).resolve().parents[2]  # ais_jax/io/provenance.py -> the checkout
    if not (root / ".git").exists():
        return None
    try:
        run = functools.partial(
            subprocess.run, cwd=root, capture_output=True, text=True, timeout=10, check=True
        )
        commit = run(["git", "rev-parse", "HEAD"]).stdout.strip()
        dirty = run(["git", "status", "--porcelain", "--untracked-files=no"]).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")


def host_peak_gib() -> float:
    """This process's peak resident memory in GiB: weights, compiles and every call's buffers.
    Linux's ``VmHWM`` (the high-water mark since this program's exec); not ``ru_maxrss``, which
    keeps the peak of the memory a child shared with its parent before its exec; elsewhere
    ``ru_maxrss``."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20  # kB
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def device_peak_gib() -> float | None:
    """The first accelerator's peak bytes in use (JAX's allocator) in GiB; None on CPU, whose
    arrays are in `host_peak_gib`, or where the backend keeps no statistics."""
    import jax

    if jax.default_backend() == "cpu":
        return None
    peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    return None if peak is None else peak / 2**30


def provenance() -> dict[str, Any]:
    """Versions, machine and commit as a JSON-ready dict.

    >>> sorted(provenance())  # doctest: +NORMALIZE_WHITESPACE
    ['commit', 'cpu', 'device_count', 'device_kind', 'platform', 'python', 'versions']
    """
    import jax

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    devices = jax.devices()
    return {
        "versions": versions,
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "device_count": jax.device_count(),
        "commit": git_commit(),
    }
