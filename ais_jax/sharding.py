"""Scale-out with `jax.jit` and named shardings: one mesh, one logical-axis table, two presets.

The device mesh has three named axes, ``("data", "fsdp", "tensor")``, sized by `MeshConfig`
(``-1`` fills with the remaining devices). Every array of the library names its dimensions
with *logical* axes (`LOGICAL_AXES`: ``q_proj [L, H*E, D]`` is ``("layer", "heads", "embed")``)
and a preset maps logical axes onto mesh axes:

    logical axis     TRAIN (FSDP + tensor parallel)   ROLLOUT (tensor parallel)
    batch            ("data", "fsdp")                 ("data", "fsdp")
    vocab, heads,    "tensor"                         "tensor"
    kv_heads, mlp
    embed (D)        "fsdp"                           replicated
    layer, norms     replicated                       replicated

So ``embed [V, D]`` is ``P("tensor", "fsdp")`` for training; ``q/k/v/gate/up [L, O, I]`` are
``P(None, "tensor", "fsdp")``; ``o/down [L, D, X]`` are ``P(None, "fsdp", "tensor")``; a
`QArray`'s codes shard like its weight and its per-layer scale is replicated. The optimizer
moments shard like the params they mirror (the table is keyed by the last name on a leaf's
path, so it covers params, Adam's ``mu``/``nu``, quantized copies and the KV cache alike). A
dimension the mesh axes do not divide is left unsharded on that axis instead of failing.

The jitted phases (`sharded_update`, `sharded_score`, `sharded_generate`, `sharded_sync`) call
the library's own pure functions inside `jax.jit(in_shardings=..., out_shardings=...)`; XLA
inserts the collectives. In particular a per-tensor FP8 scale ``max|W|`` of a sharded weight
(and ``max|X|`` of a batch-sharded activation) is the *global* amax, because `jnp.max` under
`jit` has global semantics: the FP8 copy on 8 devices is bit-identical to the 1-device copy.
The weight sync quantizes in the training layout, then all-gathers the 1-byte codes into the
rollout layout, on device. `jax.pmap` is not used anywhere (it is in maintenance mode and
itself implemented on `jit` + `shard_map`).

Multi-host: `initialize_distributed` wraps `jax.distributed.initialize`; `host_shard` gives
each process every ``process_count``-th batch of a grain `MapDataset`; `shard_batch` assembles
per-host arrays into one global `jax.Array`, `host_rows` takes this host's rows back and
`all_rows` gathers every host's (for global metrics). `runner.Run` uses all of them, so
`ais-jax train` runs unchanged on every host. Checkpoints restore onto any mesh through
`abstract_state` templates (orbax reshards on read).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
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
    "q_bias": ("layer", "heads"),
    "k_bias": ("layer", "kv_heads"),
    "v_bias": ("layer", "kv_heads"),
    "scale": None,
    # KVCache fields: per layer k [B, K, T, E] and v [B, K, E, T], valid [B, T], next_pos [B]
    "k": ("batch", "kv_heads", "cache", "head_dim"),
    "v": ("batch", "kv_heads", "head_dim", "cache"),
    "valid": ("batch", "cache"),
    "next_pos": ("batch",),
}
BATCH = ("data", "fsdp")
TRAIN: Rules = {
    "batch": BATCH,
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "embed": "fsdp",
}
ROLLOUT: Rules = {**TRAIN, "embed": None}  # tensor-parallel, replicated over data and fsdp


# ---- configuration and the mesh -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Mesh axis sizes; at most one may be -1 (all remaining devices)."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        for name in AXES:
            value = getattr(self, name)
            if (
                not isinstance(value, int)
                or isinstance(value, bool)
                or not (value == -1 or value >= 1)
            ):
                raise ValueError(f"mesh.{name}={value!r} is invalid: must be >= 1 or -1 (fill).")
        if [getattr(self, n) for n in AXES].count(-1) > 1:
            raise ValueError(f"mesh: at most one axis may be -1 (fill), got {self}.")

    @classmethod
    def parse(cls, text: str) -> MeshConfig:
        """``"data=1,fsdp=8,tensor=1"`` (missing axes keep their defaults)."""
        sizes = {}
        for item in filter(None, (s.strip() for s in text.split(","))):
            name, _, value = item.partition("=")
            if name.strip() not in AXES or not value.strip().lstrip("-").isdigit():
                raise ValueError(f"mesh item {item!r} must look like AXIS=INT with AXIS in {AXES}.")
            sizes[name.strip()] = int(value)
        return cls(**sizes)

    def sizes(self, num_devices: int) -> dict[str, int]:
        """Axis sizes with -1 resolved; their product must equal ``num_devices``."""
        sizes = {n: getattr(self, n) for n in AXES}
        fixed = math.prod(v for v in sizes.values() if v != -1)
        fill = [n for n, v in sizes.items() if v == -1]
        if fill and num_devices % fixed:
            raise ValueError(
                f"mesh {self.describe()}: the product of the fixed axis sizes "
                f"({fixed}) does not divide the device count {num_devices}."
            )
        if not fill and fixed != num_devices:
            raise ValueError(
                f"mesh {self.describe()}: the product of the axis sizes ({fixed}) "
                f"is not the device count {num_devices}; use -1 to fill an axis."
            )
        return {n: (num_devices // fixed if v == -1 else v) for n, v in sizes.items()}

    def describe(self) -> str:
        return ",".join(f"{n}={getattr(self, n)}" for n in AXES)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """`jax.distributed.initialize` arguments; all None = auto-detect (TPU pods, SLURM)."""

    enabled: bool = False
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None


def initialize_distributed(cfg: DistributedConfig) -> None:
    """Join the multi-host job before any other JAX call (a no-op unless ``cfg.enabled``)."""
    if cfg.enabled:
        jax.distributed.initialize(
            coordinator_address=cfg.coordinator_address,
            num_processes=cfg.num_processes,
            process_id=cfg.process_id,
        )


def make_mesh(cfg: MeshConfig, devices=None) -> jax.sharding.Mesh:
    """The ``("data", "fsdp", "tensor")`` mesh over ``devices`` (default: all, every host).

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


def host_shard(dataset, options=None):
    """`data.host_shard`: this process's share of a grain ``MapDataset`` of per-host batches."""
    from ais_jax.data import host_shard

    return host_shard(dataset, options)


def all_rows(tree: Any) -> Any:
    """Every process's rows, in process order, as numpy: for global batch-sharded arrays (their
    full value) and for this process's host rows (e.g. rewards) alike. With one process it is
    `np.asarray`. Every process must call it (it is a collective)."""
    if jax.process_count() == 1:
        return jax.tree.map(np.asarray, tree)
    from jax.experimental import multihost_utils

    def gather(x):  # a global array: its value; host rows: concatenated in process order
        x = x if isinstance(x, jax.Array) and not x.is_fully_addressable else np.asarray(x)
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(gather, tree)


# ---- the jitted phases --------------------------------------------------------------------------
# train/sampler are imported inside: config.py may import this module for MeshConfig.


def sharded_init(mesh, params, optimizer, rules: Rules = TRAIN):
    """`train.init_state` born in the ``rules`` layout: ``params`` (host or device arrays) are
    placed shard by shard and the optimizer moments are created sharded, so no device ever
    holds the whole state."""
    from ais_jax import train

    init = functools.partial(train.init_state, optimizer=optimizer)
    shardings = param_shardings(jax.eval_shape(init, params), mesh, rules)
    return jax.jit(init, out_shardings=shardings)(jax.device_put(params, shardings.params))


def sharded_update(mesh, state, rules: Rules = TRAIN, **static) -> Callable:
    """``(state, batch, key) -> (state, metrics)``: `train.update` with the state in the
    ``rules`` layout (donated), the batch over data x fsdp and replicated metrics. ``static``
    are `train.update`'s keyword arguments (config, optimizer, optim, loss_cfg, correction,
    temperature)."""
    from ais_jax import train

    state_sh = param_shardings(state, mesh, rules)
    return jax.jit(
        functools.partial(train.update, **static),
        in_shardings=(state_sh, batch_sharding(mesh), replicated(mesh)),
        out_shardings=(state_sh, replicated(mesh)),
        donate_argnums=0,
    )


def sharded_score(mesh, params, config, rules: Rules = TRAIN) -> Callable:
    """``(params, prompt_tokens, prompt_mask, tokens, mask, temperature) -> (logp, entropy)``."""
    from ais_jax import train

    def score(params, prompt_tokens, prompt_mask, tokens, mask, temperature):
        return train.score(params, config, prompt_tokens, prompt_mask, tokens, mask, temperature)

    bs = batch_sharding(mesh)
    return jax.jit(
        score,
        in_shardings=(param_shardings(params, mesh, rules), bs, bs, bs, bs, replicated(mesh)),
        out_shardings=bs,
    )


def sharded_generate(mesh, params, config, rules: Rules = ROLLOUT, **static) -> Callable:
    """``(params, prompts, prompt_mask, key, temperature, top_k, top_p) -> Rollout``.

    `sampler.generate` with the rollout params in the ``rules`` layout and the rows over data x
    fsdp; ``static`` are its ``max_new_tokens``, ``eos_ids`` and ``pad_id``. Sampling options
    are runtime values (``top_k=vocab_size``, ``top_p=1.0``: no filtering). The random draws do
    not depend on the mesh (threefry is partitionable), so a key gives the same tokens on any
    mesh. The KV cache, created inside, is sharded like its inputs by propagation (rows over
    data x fsdp, kv heads over tensor)."""
    from ais_jax import sampler

    def rollout(params, prompts, prompt_mask, key, temperature, top_k, top_p):
        kw = dict(prompt_mask=prompt_mask, temperature=temperature, top_k=top_k, top_p=top_p)
        return sampler.generate(params, config, prompts, key, **kw, **static)

    bs, rep = batch_sharding(mesh), replicated(mesh)
    return jax.jit(
        rollout,
        in_shardings=(param_shardings(params, mesh, rules), bs, bs, rep, rep, rep, rep),
        out_shardings=bs,
    )


def sharded_sync(
    mesh, params, rollout_cfg, *, train_rules: Rules = TRAIN, rollout_rules: Rules = ROLLOUT
) -> Callable:
    """``params -> rollout params``: `train.sync_rollout_params` (bf16 cast or FP8 quantize)
    computed in the training layout, then resharded to the rollout layout, all on device."""
    from ais_jax import train

    sync = functools.partial(train.sync_rollout_params, cfg=rollout_cfg)
    shapes = jax.eval_shape(sync, params)
    train_shardings = param_shardings(shapes, mesh, train_rules)

    def synced(params):  # quantize in the training layout; out_shardings then gathers codes
        return jax.lax.with_sharding_constraint(sync(params), train_shardings)

    return jax.jit(
        synced,
        in_shardings=(param_shardings(params, mesh, train_rules),),
        out_shardings=param_shardings(shapes, mesh, rollout_rules),
    )
