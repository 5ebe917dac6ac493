"""`ais-jax plan`: per-device memory of a model on a mesh, from shapes alone.

Every tree is built with `jax.eval_shape` (nothing is allocated, no device is needed) and
every leaf is divided by the number of shards its PartitionSpec gives on the mesh, with the
same table and presets as the real run (`sharding.partition_spec`):

    params        float32 master weights                       TRAIN layout (fsdp x tensor)
    gradients     float32, live during the update              TRAIN
    optimizer     AdamW first and second moments (float32)     TRAIN
    bf16 copy     the trainer's compute copy (`cast_params`)   TRAIN
    FP8 copy      the rollout weights (`quantize_fp8`)         ROLLOUT (tensor only)
    KV cache      bfloat16, batch x seq, rows over data x fsdp ROLLOUT

Params and optimizer state stay resident through the whole step; the training phase adds
gradients and the bf16 copy, the rollout phase adds the FP8 copy and the KV cache. Activations
(which depend on rematerialisation and minibatch size) and XLA's temporaries are not counted:
leave headroom.

>>> rows = plan_memory(ModelConfig.qwen3_8b(), {"data": 1, "fsdp": 8, "tensor": 1},
...                    batch=64, seq=2048)
>>> round(rows["params"].device_bytes / GIB, 2)  # 8.19e9 parameters x 4 bytes / 8
3.82
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ais_jax import sharding as shd
from ais_jax.config import MeshConfig, OptimConfig
from ais_jax.model import cast_params, init_cache, init_params
from ais_jax.model_config import ModelConfig
from ais_jax.quant import quantize_fp8
from ais_jax.train import make_optimizer

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Row:
    label: str
    layout: str  # "train" or "rollout"
    total_bytes: int  # the whole tree
    device_bytes: int  # what one device holds


def device_bytes(tree, rules: shd.Rules, sizes: Mapping[str, int]) -> int:
    """Bytes one device holds of ``tree`` (arrays or ShapeDtypeStructs) in the ``rules``
    layout on a mesh of axis ``sizes``."""
    total = 0
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        spec = shd.partition_spec(path, x.shape, rules, sizes)
        axes = [
            a
            for entry in spec
            if entry is not None
            for a in ((entry,) if isinstance(entry, str) else entry)
        ]
        total += (
            np.dtype(x.dtype).itemsize * math.prod(x.shape) // math.prod(sizes[a] for a in axes)
        )
    return total


def _total_bytes(tree) -> int:
    return sum(np.dtype(x.dtype).itemsize * math.prod(x.shape) for x in jax.tree.leaves(tree))


def plan_memory(
    config: ModelConfig,
    sizes: Mapping[str, int],
    *,
    batch: int,
    seq: int,
    optim: OptimConfig | None = None,
) -> dict[str, Row]:
    """Memory of one RL step of ``config`` on a mesh with axis ``sizes``, by item: ``params``,
    ``gradients``, ``optimizer``, ``bf16``, ``fp8``, ``kv_cache``."""
    ways = sizes["data"] * sizes["fsdp"]
    if batch % ways:
        raise ValueError(f"batch={batch} is not divisible by mesh data x fsdp = {ways}.")
    params = jax.eval_shape(lambda k: init_params(config, k, jnp.float32), jax.random.key(0))
    bf16 = jax.eval_shape(lambda p: cast_params(p, jnp.bfloat16), params)
    opt_state = jax.eval_shape(make_optimizer(optim or OptimConfig(), 1).init, params)
    fp8 = jax.eval_shape(quantize_fp8, params)
    cache = jax.eval_shape(lambda: init_cache(config, batch, seq, jnp.bfloat16))
    trees = {
        "params": ("params (float32 master)", "train", params),
        "gradients": ("gradients (float32)", "train", params),
        "optimizer": ("optimizer (AdamW moments)", "train", opt_state),
        "bf16": ("bf16 compute copy", "train", bf16),
        "fp8": ("FP8 rollout copy", "rollout", fp8),
        "kv_cache": (f"KV cache (bf16, {batch} x {seq})", "rollout", cache),
    }
    rules = {"train": shd.TRAIN, "rollout": shd.ROLLOUT}
    return {
        key: Row(label, layout, _total_bytes(tree), device_bytes(tree, rules[layout], sizes))
        for key, (label, layout, tree) in trees.items()
    }


def format_table(rows: dict[str, Row], title: str) -> str:
    b = {key: row.device_bytes for key, row in rows.items()}
    resident = b["params"] + b["optimizer"]
    peaks = [
        ("resident: params + optimizer", resident),
        ("train peak: + gradients + bf16 copy", resident + b["gradients"] + b["bf16"]),
        ("rollout peak: + FP8 copy + KV cache", resident + b["fp8"] + b["kv_cache"]),
    ]
    lines = [title, f"{'':38}{'layout':>8}{'total GiB':>12}{'per device GiB':>17}"]
    lines += [
        f"{r.label:38}{r.layout:>8}{r.total_bytes / GIB:12.2f}{r.device_bytes / GIB:17.2f}"
        for r in rows.values()
    ]
    lines += [f"{name:58}{n / GIB:17.2f}" for name, n in peaks]
    lines.append("Activations and XLA temporaries are not included; leave headroom.")
    return "\n".join(lines)


def main(args) -> int:
    """``ais-jax plan --model NAME --mesh data=D,fsdp=F,tensor=T --batch B --seq S``."""
    for option, value in (("--batch", args.batch), ("--seq", args.seq)):
        if not 1 <= value < 2**31:
            raise ValueError(f"{option} {value} is invalid: must be an integer in [1, 2**31).")
    config = ModelConfig.preset(args.model)
    mesh = MeshConfig.parse(args.mesh)
    fill = [n for n in shd.AXES if getattr(mesh, n) == -1]
    if fill:
        raise ValueError(
            f"--mesh {args.mesh!r}: give every axis a size for plan ({fill[0]}=-1 "
            "needs a device count)."
        )
    sizes = {n: getattr(mesh, n) for n in shd.AXES}
    rows = plan_memory(config, sizes, batch=args.batch, seq=args.seq)
    title = (
        f"ais-jax plan: {args.model} ({config.num_params / 1e9:.2f}B parameters) on "
        f"{mesh.describe()} ({math.prod(sizes.values())} devices); rollout batch "
        f"{args.batch} x {args.seq} tokens"
    )
    print(format_table(rows, title))
    return 0
