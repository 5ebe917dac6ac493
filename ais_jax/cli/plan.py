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
    linear state  Qwen3.5 only: per Gated DeltaNet layer the   ROLLOUT
                  float32 conv state [batch, X-1, W] and
                  recurrent state [batch, U, I, O] (no seq)

A Qwen3.5 model (``--model qwen3.5-9b``) has a KV cache for its
full-attention layers only; its linear-attention layers carry the fixed-size state instead
(`qwen35.HybridCache`), whatever the sequence length.

Params and optimizer state stay resident through the whole step; the training phase adds
gradients and the bf16 copy, the rollout phase adds the FP8 copy and the KV cache. Activations
(which depend on rematerialisation and minibatch size) and XLA's temporaries are not counted:
leave headroom. Nor is, on CPU, the rollout's bfloat16 copy of the FP8 codes (2 bytes per
weight, `quant.widen_codes`); on GPU and TPU the loop reads the FP8 copy itself. Nor is a
fused decode layout's copy of each layer's q/k/v and gate/up weights (`model.fuse_projections`).
``optim.remat=true`` keeps the update's activations to the residual stream (one ``[b, S, D]``
per layer) and one layer's own.

Diffusion models (``--model llada-8b``) have the same parameter layout
(`llada.py` uses `qwen3.py`'s names), so the first five rows are computed the same way. Their
rollout (`diffusion_sampler.generate`) has **no KV cache**: each of the ``steps`` denoising
steps is one full bidirectional forward over all S = prompt + gen_length positions (``--seq``),
the steps one after another in a loop, so memory is ONE forward's activations (time is ``steps``
forwards) and the KV row is replaced by ``activations``: the larger of (bf16 unless noted, b =
batch rows per device; heads, MLP and vocab split over ``tensor`` where they divide)

    a layer's attention   x [b,S,D] + q, k, v [b,S,H*E] + scores [b,H,S,S] float32 + probs
                          [b,H,S,S]                  (`model.attention` materialises both)
    a layer's MLP         x, h [b,S,D] + gate, up, silu(gate)*up [b,S,F]
    the head              h [b,S,D] + logits [b,S,V] float32 (all S positions) + three
                          float32 [b,T,V] temporaries over the T = gen_length response positions
                          (the sliced logits, the Gumbel-noised scores, the log-softmax)

the layers run one at a time, so only one layer's temporaries are live at once. T defaults to
S (an upper bound). Measured with XLA's `compile().memory_analysis()` on CPU (a 2-layer model,
D = 256, V = 8192, 4 x 512 tokens, T = 384): a bare forward + Gumbel argmax + log-softmax
needs 218.1 MB of temporaries against 219.2 MB here, but the whole jitted
`diffusion_sampler._generate` needs 346.8 MB (XLA on CPU keeps more float32 [B, T, V] copies
alive in the loop): the head's count is a floor, not a bound; leave headroom (GPU XLA fuses
more of the elementwise work).

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

from ais_jax import models
from ais_jax.config import MeshConfig, OptimConfig
from ais_jax.models import Config, init_cache, init_params
from ais_jax.nn.layers import cast_params
from ais_jax.nn.quant import quantize_fp8
from ais_jax.parallel import sharding as shd
from ais_jax.train.step import make_optimizer

GIB = 1024**3
DIFFUSION_PRESETS = ("llada-8b",)
DIFFUSION_NOTE = (
    "Diffusion rollout: no KV cache; each of the `steps` denoising steps is one full forward "
    "over\nprompt + gen_length = --seq tokens, run one after another: memory counts ONE "
    "forward's peak\n(one layer's attention scores or MLP, or the head's float32 logits + three "
    "float32\n[B, gen_length, V] temporaries, gen_length = --seq unless given); time is steps x "
    "that forward."
)


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


def resolve_model(name: str) -> Config:
    """A Qwen3 or Qwen3.5 preset or a diffusion preset (`DIFFUSION_PRESETS`), by
    `models.preset`."""
    key = name.lower().replace("_", "-")
    if key in DIFFUSION_PRESETS:
        return models.preset(key, "llada")
    try:
        return models.preset(name)
    except ValueError as e:
        raise ValueError(
            f"{str(e).rstrip('.')}; diffusion presets: {list(DIFFUSION_PRESETS)}."
        ) from None


def _split(n: int, ways: int) -> int:
    """One device's share of a dimension of size ``n`` over ``ways`` shards (replicated when
    ``ways`` does not divide it, as `sharding.partition_spec` does)."""
    return n // ways if n % ways == 0 else n


def diffusion_activation_bytes(
    config: Config, batch: int, seq: int, tensor: int = 1, gen_length: int | None = None
):
    """Peak activation bytes of one denoising step: a bidirectional forward of ``batch`` rows
    (already one device's share) over ``seq`` positions, ``gen_length`` of them the response
    (default all), heads/MLP/vocab split over ``tensor``: the largest of a layer's attention, a
    layer's MLP and the head (module docstring). Returns ``{"attention": ..., "mlp": ...,
    "head": ..., "peak": ...}``."""
    c, b, S = config, batch, seq
    T = seq if gen_length is None else gen_length
    if not 1 <= T <= S:
        raise ValueError(f"gen_length={gen_length} must be in [1, seq={seq}].")
    H, K = _split(c.num_heads, tensor), _split(c.num_kv_heads, tensor)
    F, V = _split(c.intermediate_size, tensor), _split(c.vocab_size, tensor)
    E, D = c.head_dim, c.hidden_size
    bf16, f32 = 2, 4
    x = b * S * D * bf16
    attention = x + b * S * (H + 2 * K) * E * bf16 + b * H * S * S * (f32 + bf16)
    mlp = 2 * x + 3 * b * S * F * bf16
    head = x + b * S * V * f32 + 3 * b * T * V * f32
    return {"attention": attention, "mlp": mlp, "head": head, "peak": max(attention, mlp, head)}


def plan_memory(
    config: Config,
    sizes: Mapping[str, int],
    *,
    batch: int,
    seq: int,
    optim: OptimConfig | None = None,
    gen_length: int | None = None,
) -> dict[str, Row]:
    """Memory of one RL step of ``config`` on a mesh with axis ``sizes``, by item: ``params``,
    ``gradients``, ``optimizer``, ``bf16``, ``fp8``, then ``kv_cache`` (autoregressive) or
    ``activations`` (a diffusion `LLaDAConfig`: one denoising step, ``batch`` x ``seq`` tokens
    of which ``gen_length`` (default ``seq``) are the response)."""
    ways = sizes["data"] * sizes["fsdp"]
    if batch % ways:
        raise ValueError(f"batch={batch} is not divisible by mesh data x fsdp = {ways}.")
    diffusion = models.family_of(config).kind == "diffusion"
    params = jax.eval_shape(lambda k: init_params(config, k, jnp.float32), jax.random.key(0))
    bf16 = jax.eval_shape(lambda p: cast_params(p, jnp.bfloat16), params)
    opt_state = jax.eval_shape(make_optimizer(optim or OptimConfig(), 1).init, params)
    fp8 = jax.eval_shape(quantize_fp8, params)
    trees = {
        "params": ("params (float32 master)", "train", params),
        "gradients": ("gradients (float32)", "train", params),
        "optimizer": ("optimizer (AdamW moments)", "train", opt_state),
        "bf16": ("bf16 compute copy", "train", bf16),
        "fp8": ("FP8 rollout copy", "rollout", fp8),
    }
    if not diffusion:
        cache = jax.eval_shape(lambda: init_cache(config, batch, seq, jnp.bfloat16))
        kv = getattr(cache, "attention", cache)  # a hybrid cache's KV part (Qwen3.5)
        trees["kv_cache"] = (f"KV cache (bf16, {batch} x {seq})", "rollout", kv)
        if hasattr(cache, "linear"):  # and its recurrent states
            label = f"linear-attn state (f32, {batch} rows)"
            trees["linear_state"] = (label, "rollout", cache.linear)
    rules = {"train": shd.TRAIN, "rollout": shd.ROLLOUT}
    rows = {
        key: Row(label, layout, _total_bytes(tree), device_bytes(tree, rules[layout], sizes))
        for key, (label, layout, tree) in trees.items()
    }
    if diffusion:
        rows["activations"] = Row(
            f"activations (1 forward, {batch} x {seq})",
            "rollout",
            diffusion_activation_bytes(config, batch, seq, 1, gen_length)["peak"],
            diffusion_activation_bytes(config, batch // ways, seq, sizes["tensor"], gen_length)[
                "peak"
            ],
        )
    return rows


def format_table(rows: dict[str, Row], title: str) -> str:
    b = {key: row.device_bytes for key, row in rows.items()}
    resident = b["params"] + b["optimizer"]
    diffusion = "activations" in rows
    rollout = b["activations"] if diffusion else b["kv_cache"] + b.get("linear_state", 0)
    rollout_name = "activations" if diffusion else "KV cache"
    rollout_name += " + linear state" if "linear_state" in b else ""
    peaks = [
        ("resident: params + optimizer", resident),
        ("train peak: + gradients + bf16 copy", resident + b["gradients"] + b["bf16"]),
        (f"rollout peak: + FP8 copy + {rollout_name}", resident + b["fp8"] + rollout),
    ]
    lines = [title, f"{'':38}{'layout':>8}{'total GiB':>12}{'per device GiB':>17}"]
    lines += [
        f"{r.label:38}{r.layout:>8}{r.total_bytes / GIB:12.2f}{r.device_bytes / GIB:17.2f}"
        for r in rows.values()
    ]
    lines += [f"{name:58}{n / GIB:17.2f}" for name, n in peaks]
    if diffusion:
        lines.append(DIFFUSION_NOTE)
        lines.append("Training activations and XLA temporaries are not included; leave headroom.")
    else:
        lines.append("Activations and XLA temporaries are not included; leave headroom.")
    return "\n".join(lines)


def main(args) -> int:
    """``ais-jax plan [--model NAME] [--mesh data=D,fsdp=F,tensor=T] [--batch B] [--seq S]
    [--gen-length T]`` (defaults: qwen3-8b, data=1,fsdp=1,tensor=1, 64, 2048, T = S)."""
    for option, value in (("--batch", args.batch), ("--seq", args.seq)):
        if not 1 <= value < 2**31:
            raise ValueError(f"{option} {value} is invalid: must be an integer in [1, 2**31).")
    config = resolve_model(args.model)
    mesh = MeshConfig.parse(args.mesh)
    fill = [n for n in shd.AXES if getattr(mesh, n) == -1]
    if fill:
        raise ValueError(
            f"--mesh {args.mesh!r}: give every axis a size for plan ({fill[0]}=-1 "
            "needs a device count)."
        )
    sizes = {n: getattr(mesh, n) for n in shd.AXES}
    gen_length = getattr(args, "gen_length", None)  # --gen-length; None (or absent): T = S
    rows = plan_memory(config, sizes, batch=args.batch, seq=args.seq, gen_length=gen_length)
    title = (
        f"ais-jax plan: {args.model} ({config.num_params / 1e9:.2f}B parameters) on "
        f"{mesh.describe()} ({math.prod(sizes.values())} devices); rollout batch "
        f"{args.batch} x {args.seq} tokens"
        + (" (prompt + gen_length)" if models.family_of(config).kind == "diffusion" else "")
    )
    print(format_table(rows, title))
    return 0
