"""Scale-out with `jax.jit` and named shardings: one mesh, one logical-axis table, two presets.

The device mesh has three named axes, ``("data", "fsdp", "tensor")``, sized by
`config.MeshConfig` (``-1`` fills with the remaining devices). Every array of the library names
its dimensions with *logical* axes (`LOGICAL_AXES`: ``q_proj [L, H*E, D]`` is
``("layer", "heads", "embed")``) and a preset maps logical axes onto mesh axes:

    logical axis     TRAIN (FSDP + tensor parallel)   ROLLOUT (tensor parallel)
    batch            ("data", "fsdp")                 ("data", "fsdp")
    vocab, heads,    "tensor"                         "tensor"
    kv_heads, mlp,
    linear_heads
    embed (D)        "fsdp"                           replicated
    layer, norms     replicated                       replicated

So ``embed [V, D]`` is ``P("tensor", "fsdp")`` for training; ``q/k/v/gate/up [L, O, I]`` are
``P(None, "tensor", "fsdp")``; ``o/down [L, D, X]`` are ``P(None, "fsdp", "tensor")``; a
`QArray`'s codes shard like its weight and its per-layer scale is replicated. The optimizer
moments shard like the params they mirror (the table is keyed by the last name on a leaf's
path, so it covers params, Adam's ``mu``/``nu``, quantized copies and the KV cache alike). A
dimension the mesh axes do not divide is left unsharded on that axis instead of failing.

The jitted phases (`train.make_phases`) take their ``in_shardings``/``out_shardings`` from this
table; XLA inserts the collectives. In particular a per-tensor FP8 scale ``max|W|`` of a sharded
weight (and ``max|X|`` of a batch-sharded activation) is the *global* amax, because `jnp.max`
under `jit` has global semantics: the FP8 copy on 8 devices is bit-identical to the 1-device
copy. `jax.pmap` is not used anywhere (it is in maintenance mode and itself implemented on
`jit` + `shard_map`).

Multi-host: `initialize_distributed` wraps `jax.distributed.initialize`; `data.host_shard` gives
each process every ``process_count``-th batch of a grain `MapDataset`; `shard_batch` assembles
per-host arrays into one global `jax.Array`, `host_rows` takes this host's rows back and
`all_rows` gathers every host's (for global metrics). `runner.Run` uses all of them, so
`ais-jax train` runs unchanged on every host. Checkpoints restore onto any mesh through
`abstract_state` templates (orbax reshards on read).

This module imports nothing of the package (the configurations it reads are duck-typed), so
every other module may use it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

AXES = ("data", "fsdp", "tensor")
Rules = Mapping[str, str | tuple[str, ...] | None]

# Logical axes of every named array, by the last name on its pytree path (model.py's naming).
# None: replicated whatever its rank (a QArray's per-layer scale).
LOGICAL_AXES: dict[str, tuple[str, ...] | None] = {
    "embed": ("vocab", "embed"),
    "lm_head": ("vocab", "embed"),
    "final_norm": ("norm",),
    "q_proj": ("layer", "heads", "embed"),
    "k_proj": ("layer", "kv_heads", "embed"),
    "v_proj": ("layer", "kv_heads", "embed"),
    "o_proj": ("layer", "embed", "heads"),
    "gate_proj": ("layer", "mlp", "embed"),
    "up_proj": ("layer", "mlp", "embed"),
    "down_proj": ("layer", "embed", "mlp"),
    # `model.fuse_projections`: rows in per-KV-head blocks, per-channel (gate, up) pairs
    "qkv_proj": ("layer", "kv_heads", "embed"),
    "gate_up_proj": ("layer", "mlp", "embed"),
    "q_bias": ("layer", "heads"),
    "k_bias": ("layer", "kv_heads"),
    "v_bias": ("layer", "kv_heads"),
    "scale": None,
    # Qwen3.5's Gated DeltaNet (`qwen35.py`): value heads U split like attention heads. The conv
    # channels W of in_proj_qkv / conv_weight (q, k, v concatenated) split in channel order;
    # where a shard boundary falls inside q, k or v, XLA gathers what the heads need.
    "in_proj_qkv": ("layer", "linear_heads", "embed"),
    "in_proj_z": ("layer", "linear_heads", "embed"),
    "in_proj_b": ("layer", "linear_heads", "embed"),
    "in_proj_a": ("layer", "linear_heads", "embed"),
    "out_proj": ("layer", "embed", "linear_heads"),
    "conv_weight": ("layer", "linear_heads", "taps"),
    "a_log": ("layer", "linear_heads"),
    "dt_bias": ("layer", "linear_heads"),
    # KVCache fields: per layer k [B, K, S, E] and v [B, K, E, S], valid [B, S], next_pos [B]
    "k": ("batch", "kv_heads", "cache", "head_dim"),
    "v": ("batch", "kv_heads", "head_dim", "cache"),
    "valid": ("batch", "cache"),
    "next_pos": ("batch",),
    # qwen35.LinearState fields: conv [B, X-1, W], recurrent [B, U, I, O]
    "conv": ("batch", "taps", "linear_heads"),
    "recurrent": ("batch", "linear_heads", "key_dim", "value_dim"),
}
BATCH = ("data", "fsdp")
TRAIN: Rules = {
    "batch": BATCH,
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "linear_heads": "tensor",
    "embed": "fsdp",
}
ROLLOUT: Rules = {**TRAIN, "embed": None}  # tensor-parallel, replicated over data and fsdp


# ---- the mesh ----------------------------------------------------------------------------------


def initialize_distributed(cfg) -> None:
    """Join the multi-host job before any other JAX call: `jax.distributed.initialize` with the
    fields of ``cfg`` (a `config.DistributedConfig`); a no-op unless ``cfg.enabled``."""
    if cfg.enabled:
        jax.distributed.initialize(
            coordinator_address=cfg.coordinator_address,
            num_processes=cfg.num_processes,
            process_id=cfg.process_id,
        )


def make_mesh(cfg, devices=None) -> jax.sharding.Mesh:
    """The ``("data", "fsdp", "tensor")`` mesh over ``devices`` (default: all, every host), sized
    by ``cfg.sizes(device_count)`` (a `config.MeshConfig`).

    Axes are `AxisType.Auto` (GSPMD/Shardy propagation), the same on every JAX version."""
    devices = jax.devices() if devices is None else list(devices)
    sizes = cfg.sizes(len(devices))
    auto = (jax.sharding.AxisType.Auto,) * len(AXES)
    return jax.make_mesh(tuple(sizes[n] for n in AXES), AXES, axis_types=auto, devices=devices)


# ---- the table ----------------------------------------------------------------------------------


def _key_name(entry) -> str | None:
    return getattr(entry, "key", getattr(entry, "name", None))


def partition_spec(path, shape, rules: Rules, sizes: Mapping[str, int]) -> PartitionSpec:
    """The PartitionSpec of one leaf: the last name on ``path`` found in `LOGICAL_AXES`, its
    logical axes mapped by ``rules``, keeping for each dimension the longest prefix of mesh axes
    whose product divides it (each mesh axis used once)."""
    axes = None
    for entry in reversed(path):
        if _key_name(entry) in LOGICAL_AXES:
            axes = LOGICAL_AXES[_key_name(entry)]
            break
    if axes is None or len(axes) != len(shape):
        return PartitionSpec()
    used, spec = set(), []
    for logical, dim in zip(axes, shape, strict=True):
        mesh_axes = rules.get(logical)
        mesh_axes = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes or ())
        kept = []
        for a in mesh_axes:
            if a in used or dim % (math.prod(sizes[k] for k in kept) * sizes[a]):
                break
            kept.append(a)
        used.update(kept)
        spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return PartitionSpec(*spec)


def param_specs(tree: Any, rules: Rules, sizes: Mapping[str, int]) -> Any:
    """`partition_spec` of every leaf (arrays or `jax.ShapeDtypeStruct`s); needs no devices."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: partition_spec(path, x.shape, rules, sizes), tree
    )


def param_shardings(tree: Any, mesh: jax.sharding.Mesh, rules: Rules = TRAIN) -> Any:
    """`NamedSharding` of every leaf of a params / train-state / rollout-params pytree."""
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec),
        param_specs(tree, rules, dict(mesh.shape)),
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
    """Leading (batch) axis over ``data`` x ``fsdp``; a prefix for any tree of [B, ...] arrays."""
    return NamedSharding(mesh, PartitionSpec(BATCH))


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def shard_state(tree: Any, mesh: jax.sharding.Mesh, rules: Rules = TRAIN) -> Any:
    """Place an existing (host or single-device) pytree in the ``rules`` layout."""
    return jax.device_put(tree, param_shardings(tree, mesh, rules))


def abstract_state(tree: Any, mesh: jax.sharding.Mesh, rules: Rules = TRAIN) -> Any:
    """``jax.ShapeDtypeStruct`` s carrying the ``rules`` shardings on ``mesh``: a restore
    template for `Checkpointer.restore`, to load a checkpoint onto a different mesh."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        tree,
        param_shardings(tree, mesh, rules),
    )


def shard_batch(tree: Any, mesh: jax.sharding.Mesh) -> Any:
    """This process's rows of a batch (host arrays) -> global arrays sharded over data x fsdp.

    With one process that is a `device_put`; with several, each passes its own rows (from
    `host_shard`) and the global batch is their concatenation in process order."""
    ways = mesh.shape["data"] * mesh.shape["fsdp"]

    def put(x):
        rows = np.shape(x)[0] * jax.process_count()
        if rows % ways:
            raise ValueError(f"batch size {rows} is not divisible by mesh data x fsdp = {ways}.")
        return jax.make_array_from_process_local_data(batch_sharding(mesh), np.asarray(x))

    return jax.tree.map(put, tree)


def host_rows(tree: Any) -> Any:
    """The inverse of `shard_batch`: this process's rows of batch-sharded ``[B, ...]`` global
    arrays, as numpy (all rows with one process), e.g. to decode and reward a rollout."""

    def rows(x):
        shards = {s.index[0].start or 0: s.data for s in x.addressable_shards}
        return np.concatenate([np.asarray(shards[k]) for k in sorted(shards)])

    return jax.tree.map(rows, tree)


def all_rows(tree: Any) -> Any:
    """Every process's rows, in process order, as numpy: for global batch-sharded arrays (their
    full value) and for this process's host rows (e.g. rewards) alike. With one process it is
    `np.asarray`. Every process must call it (it is a collective)."""
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, tree)

    def gather(x):  # a global array: its value; host rows: concatenated in process order
        x = x if isinstance(x, jax.Array) and not x.is_fully_addressable else np.asarray(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(gather, tree)
