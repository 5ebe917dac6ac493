"""The package's import surface: what `from ais_jax import ais, grpo` loads, and the lazy names.

The README promises that the correction and the loss import only JAX and chex, so another JAX
codebase can take them without the model, checkpoint and training stack. Each check runs in a
fresh interpreter, since this test session has long imported everything.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import ais_jax

# What `ais` and `grpo` must not pull in: the training, checkpoint and model stack.
# ml_dtypes is left out on purpose: jax itself imports it (`jax._src.dtypes` defines bfloat16
# and the float8 types with it), and the test below checks that in the same interpreter.
HEAVY = (
    "flax",
    "optax",
    "orbax",
    "safetensors",
    "yaml",
    "grain",
    "transformers",
    "torch",
    "tensorboardX",
    "tokenizers",
    "matplotlib",
    "scipy",
    "ais_jax.models",
    "ais_jax.nn",
    "ais_jax.config",
    "ais_jax.rollout",
    "ais_jax.train",
    "ais_jax.io",
)


def loaded_after(statement: str) -> set[str]:
    """The names in `sys.modules` after running `statement` in a fresh interpreter."""
    code = f"{statement}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    return set(json.loads(out.stdout.splitlines()[-1]))


def top_level_hits(modules: set[str], names: tuple[str, ...]) -> list[str]:
    """Entries of `modules` that are one of `names` or inside one of them (`flax.struct`)."""
    return sorted(m for m in modules if any(m == n or m.startswith(n + ".") for n in names))


@pytest.mark.slow
def test_ais_and_grpo_import_only_jax_and_chex():
    modules = loaded_after("from ais_jax import ais, grpo")
    assert {"ais_jax.ais", "ais_jax.grpo", "jax", "chex"} <= modules
    assert not top_level_hits(modules, HEAVY), top_level_hits(modules, HEAVY)
    ours = sorted(m for m in modules if m.startswith("ais_jax"))
    assert ours == ["ais_jax", "ais_jax.ais", "ais_jax.checks", "ais_jax.grpo"], ours
    # the exclusion of ml_dtypes above is jax's doing, not ours
    assert "ml_dtypes" in loaded_after("import jax")


def test_bare_package_import_loads_no_jax():
    modules = loaded_after("import ais_jax")
    assert not top_level_hits(modules, ("jax", "chex", "numpy") + HEAVY)


def test_validation_module_is_standard_library_only():
    modules = loaded_after("import ais_jax.checks")
    assert not top_level_hits(modules, ("jax", "chex", "numpy", "ml_dtypes") + HEAVY)


@pytest.mark.parametrize("name", ais_jax.__all__)
def test_every_public_name_resolves_to_its_definition(name):
    value = getattr(ais_jax, name)
    module = __import__(ais_jax._EXPORTS[name], fromlist=["_"])
    expected = module if module.__name__ == f"ais_jax.{name}" else getattr(module, name)
    assert value is expected
    assert name in dir(ais_jax)


def test_star_import_submodules_and_unknown_names():
    namespace: dict = {}
    exec("from ais_jax import *", namespace)
    assert set(ais_jax.__all__) <= set(namespace)
    assert namespace["forward"] is ais_jax.models.forward  # submodules also resolve on access
    assert ais_jax.nn.quant.linear is ais_jax.linear
    with pytest.raises(AttributeError, match="'ais_jax' has no attribute 'no_such_name'"):
        ais_jax.no_such_name  # noqa: B018
    with pytest.raises(ImportError):
        exec("from ais_jax import no_such_name", {})


@pytest.mark.slow
def test_event_writer_leaves_torch_unloaded_and_importable(tmp_path):
    # tensorboardX imports torch when it is installed (the test extra installs it), seconds of
    # every run's start; the run's writer hides it during that import, and only then
    write = (
        "from pathlib import Path\n"
        "from ais_jax.io.run_log import EventWriter\n"
        f"w = EventWriter(Path({str(tmp_path)!r}), None)\n"
        "w.add_scalar('loss', 0.25, 1)\n"
        "w.close()"
    )
    modules = loaded_after(write)
    assert "tensorboardX" in modules and "torch" not in modules
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1
    assert "torch" in loaded_after(f"{write}\nimport torch")
