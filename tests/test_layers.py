"""The package's layers point one way: the import graph of ais_jax, read from the source.

Every ``import`` and ``from ... import`` in every module (those inside functions too) is an
edge. The README's layout section names the layers; this test holds the code to them:
a package imports only itself and packages below it, ``config`` imports no engine, no module
imports another module's private name, and the module graph has no cycle. It also checks that
the names a YAML may use (spelled in config.py so that reading a config loads no engine) are the
engines' own.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import ais_jax

ROOT = pathlib.Path(ais_jax.__file__).parent

# lower rank = lower layer; a module may import its own package and packages of lower rank
RANK = {
    "checks": -1,
    "ais": 0,
    "grpo": 0,
    "tasks": 0,
    "analysis": 0,
    "parallel": 0,
    "nn": 1,
    "models": 2,
    "config": 3,
    "rollout": 4,
    "io": 5,
    "train": 6,
    "experiments": 7,
    "cli": 8,
    "integrations": 9,
    "tools": 9,
}
LEAVES = {"checks", "tasks", "analysis", "parallel"}  # import nothing of ais_jax but checks


def module_name(path: pathlib.Path) -> str:
    parts = ("ais_jax", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def edges(path: pathlib.Path) -> list[tuple[str, list[str]]]:
    """``(imported module, names)`` of every ais_jax import in ``path`` (relative ones too)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "ais_jax" or target.startswith("ais_jax."):
                found.append((target, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.startswith("ais_jax.")]
    return found


def resolve(target: str, names: list[str]) -> list[str]:
    """The modules an import loads: ``from ais_jax.x import y`` is module ``ais_jax.x.y`` when
    y is a submodule, else ``ais_jax.x``."""
    modules = []
    for n in names or [None]:
        sub = f"{target}.{n}" if n else None
        is_module = sub and (
            (ROOT / pathlib.Path(*sub.split(".")[1:])).with_suffix(".py").is_file()
            or (ROOT / pathlib.Path(*sub.split(".")[1:]) / "__init__.py").is_file()
        )
        modules.append(sub if is_module else target)
    return modules


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "ais_jax"


GRAPH = {
    module_name(p): sorted({m for t, ns in edges(p) for m in resolve(t, ns)} - {module_name(p)})
    for p in sorted(ROOT.rglob("*.py"))
}


def test_every_layer_is_ranked():
    assert {layer(m) for m in GRAPH} - {"ais_jax", "__main__"} <= set(RANK), sorted(
        {layer(m) for m in GRAPH} - set(RANK)
    )


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m != "ais_jax"))
def test_imports_point_down(module):
    here = layer(module)
    upward = [
        m
        for m in GRAPH[module]
        if m != "ais_jax" and layer(m) != here and RANK[layer(m)] >= RANK[here]
    ]
    assert not upward, f"{module} imports {upward}: a layer imports only layers below it"
    if here in LEAVES:
        others = [m for m in GRAPH[module] if layer(m) not in (here, "checks")]
        assert not others, f"{module} is in a leaf layer but imports {others}"


def test_config_imports_no_engine():
    assert set(GRAPH["ais_jax.config"]) <= {"ais_jax.ais", "ais_jax.grpo", "ais_jax.checks"}


def test_nn_never_imports_models_and_models_nothing_above():
    for module, targets in GRAPH.items():
        if layer(module) == "nn":
            assert all(layer(t) in ("nn", "checks") for t in targets), (module, targets)
        if layer(module) == "models":
            assert all(layer(t) in ("models", "nn", "checks") for t in targets), (module, targets)


def test_no_private_name_crosses_a_module_boundary():
    crossings = [
        (module_name(p), target, n)
        for p in ROOT.rglob("*.py")
        for target, names in edges(p)
        for n in names
        if n.startswith("_") and not n.startswith("__") and target != module_name(p)
    ]
    assert not crossings, crossings


def test_the_module_graph_has_no_cycle():
    state: dict[str, int] = {}  # 1: on the stack, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in GRAPH.get(m, []):
            if t == "ais_jax" or t not in GRAPH:
                continue
            if state.get(t) == 1:
                pytest.fail("import cycle: " + " -> ".join([*path, m, t]))
            if t not in state:
                visit(t, [*path, m])
        state[m] = 2

    for m in GRAPH:
        if m not in state:
            visit(m, [])


def test_a_wrong_edge_is_caught(tmp_path):
    """The checks read real source: an upward import written into a module is an edge."""
    fake = ROOT / "nn" / "quant.py"
    text = fake.read_text() + "\nfrom ais_jax.models import qwen3\n"
    probe = tmp_path / "quant.py"
    probe.write_text(text)
    found = [m for t, ns in ast_edges(probe) for m in resolve(t, ns)]
    assert "ais_jax.models.qwen3" in found


def ast_edges(path: pathlib.Path):
    """`edges` of a file outside the package, read as if it were ``ais_jax.nn.quant``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ais_jax"):
            found.append((node.module, [a.name for a in node.names]))
    return found


def test_config_names_are_the_engines():
    from ais_jax import config, models
    from ais_jax.nn import quant
    from ais_jax.parallel import sharding
    from ais_jax.rollout import diffusion, sampler

    assert config.ROLLOUT_FORMATS == ("bf16", *quant.FORMATS)
    assert config.DECODE_LAYOUTS == tuple(sampler.DECODE_LAYOUTS)
    assert config.REMASKING == diffusion.REMASKING
    assert config.AXES == sharding.AXES
    assert config.FAMILIES == {name: f.kind for name, f in models.FAMILIES.items()}


def test_families_implement_the_interface():
    from ais_jax import models

    for name, family in models.FAMILIES.items():
        assert family.name == name
        assert models.family_of(family.config_class.preset(family.presets[0])) is family
        if family.kind == "diffusion":
            assert family.init_cache is None and family.forward_cached is None
    with pytest.raises(TypeError, match="not a model config"):
        models.family_of(object())
