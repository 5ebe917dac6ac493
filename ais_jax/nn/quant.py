"""Low-precision rollout weights: one pytree type and ONE matmul wrapper.

The rollout engine of docs/design.md section 1 runs every linear layer as W8A8 FP8 with per-tensor
dynamic scaling:

    s_w = max|W| / fmax          once per weight sync     (fmax = 448 for float8_e4m3fn)
    s_x = max|X| / fmax          per call, over the valid rows of the activation
    Q(X) = cast(clip(X / s_x, -fmax, fmax))
    Y = (Q(X) @ Q(W)^T) * (s_x * s_w)      dot on the FP8 operands, float32 accumulation

`QArray(quant, scale)` holds a quantized weight in the Hugging Face `[out, in]` layout, so the
contraction is row-major x column-major, the form XLA's GPU GEMM rewriter lowers to a cuBLASLt
FP8 GEMM on Hopper (scalar scales, `preferred_element_type=float32`). On CPU and TPU the same
code runs (XLA converts the FP8 operands where the hardware has no FP8 units). The sampler's
few-row decode steps on a GPU multiply the same codes as bfloat16 instead (`step_operands`,
`QArray.operand_dtype`): at few rows cuBLASLt's FP8 GEMM was slower than the BF16 one.

`linear(x, w)` is the only matmul of the model: a plain array `w` gives the BF16/FP32 trainer
path, a `QArray` gives the quantized rollout path, so both policies are literally the same
model code and FP8 is the only difference between them.

Formats: float8_e4m3fn (default) and float8_e5m2 are native JAX dtypes. float6_e3m2fn,
float6_e2m3fn and float4_e2m1fn (FP4, left as future work by the paper) are *emulated*: values
are rounded to the format's grid (round-to-nearest-even, saturating) in float32 and stored in a
float8_e4m3fn container, which holds every one of their values exactly. Their numerics are the
real format's; their memory is one byte per value, not 6 or 4 bits.

Activation scaling: ``act_scaling="tensor"`` (the paper's choice) shares one scale across the
whole activation tensor, so a sequence's FP8 log-probs depend on its batch-mates and differ
between a batched prefill and one-token decode steps. ``act_scaling="token"`` gives every row
(token) its own scale, which removes that coupling at the cost of a row-wise rescale.
Rows marked invalid by ``row_mask`` (padding, finished sequences) never enter an amax.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import struct

ACT_SCALINGS = ("tensor", "token")
F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Format:
    """A low-precision number format: its grid and how it is stored."""

    name: str
    max: float  # largest finite value
    nmant: int  # explicit mantissa bits
    minexp: int  # exponent of the smallest normal number
    storage: Any  # JAX dtype the codes are stored in
    native: bool  # True if `storage` *is* the format (no emulation)


def _format(name: str, native: bool) -> Format:
    info = ml_dtypes.finfo(getattr(ml_dtypes, name))
    storage = jnp.dtype(getattr(jnp, name)) if native else jnp.dtype(jnp.float8_e4m3fn)
    return Format(name, float(info.max), int(info.nmant), int(info.minexp), storage, native)


FORMATS: dict[str, Format] = {
    "float8_e4m3fn": _format("float8_e4m3fn", True),
    "float8_e5m2": _format("float8_e5m2", True),
    "float6_e3m2fn": _format("float6_e3m2fn", False),
    "float6_e2m3fn": _format("float6_e2m3fn", False),
    "float4_e2m1fn": _format("float4_e2m1fn", False),
}

# Parameter names of the linear weights the rollout copy quantizes (model.py's naming).
LINEAR_WEIGHTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Qwen3.5's Gated DeltaNet projections (`qwen35.py`); names no Qwen3 layer has.
LINEAR_ATTENTION_WEIGHTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
# Every per-layer matmul weight of either family: what the rollout copy quantizes.
PROJECTIONS = LINEAR_WEIGHTS + LINEAR_ATTENTION_WEIGHTS


def get_format(name: str) -> Format:
    if name not in FORMATS:
        raise ValueError(f"Unknown quantization format {name!r}; valid formats: {list(FORMATS)}.")
    return FORMATS[name]


@struct.dataclass
class QArray:
    """A quantized weight: ``value ~= quant.astype(float32) * scale``.

    quant: codes, ``[..., O, I]`` in the format's storage dtype (or held as bfloat16, the same
        numbers, where `widen_codes` says so).
    scale: float32 per-tensor scale, shape ``[...]`` (one per stacked layer); or, for several
        weights held as one (`concat_rows`), ``[..., O]``: each row its own weight's scale.
    operand_dtype: the dtype both operands' codes enter `linear`'s dot as (`OPERAND_DTYPES`):
        ``"storage"``, the codes' storage dtype (FP8 operands: an FP8 GEMM where the backend
        has one, cuBLASLt's on Hopper); ``"bfloat16"``, the same numbers converted, for a
        16-bit GEMM that converts the weight's 1-byte codes as it loads them; ``None``
        (default), the storage dtype, except in the sampler's decode steps, which
        `step_operands` may give bfloat16 operands. `set_operand_dtype` sets it.
    """

    quant: jax.Array
    scale: jax.Array
    fmt: str = struct.field(pytree_node=False, default="float8_e4m3fn")
    act_scaling: str = struct.field(pytree_node=False, default="tensor")
    operand_dtype: str | None = struct.field(pytree_node=False, default=None)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.quant.shape

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        per_row = self.scale.ndim == self.quant.ndim - 1
        scale = self.scale[..., None] if per_row else self.scale[..., None, None]
        return (self.quant.astype(jnp.float32) * scale).astype(dtype)


# `Columns` weights multiply at most this many rows as ``(w @ x^T)^T``; more rows take the plain
# ``x @ w^T`` (at more rows XLA:CPU's plain form is the faster one; docs/benchmarks.md).
COLUMNS_MAX_ROWS = 128


@struct.dataclass
class Columns:
    """A plain ``[O, I]`` weight in the model's layout, marked for the sampler's CPU decode
    path: a float32 product over at most `COLUMNS_MAX_ROWS` rows runs as ``(w @ x^T)^T``, the
    weight on the left and the activations as ``[I, rows]`` columns. XLA:CPU's float32 GEMM
    runs that form faster than ``x @ w^T`` (or than ``x`` times a transposed ``[I, O]`` copy)
    at few rows (docs/benchmarks.md), and it needs no copy of the weight. Optimization barriers
    keep XLA from folding the two small transposes back into the dot. Other products (more rows,
    16-bit operands) are the plain ones."""

    w_OI: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.w_OI.shape


# ---- the quantizer ----------------------------------------------------------------------------


def round_to_format(x: jax.Array, fmt: Format, dtype=None) -> jax.Array:
    """Round float32 ``x`` (already scaled) to the nearest value of ``fmt``, saturating at its
    max, and return it in the storage dtype; with ``dtype`` (bfloat16, say), the same values
    computed in float32 arithmetic and returned in ``dtype``, with no FP8 value on the way.
    Never produces NaN for finite input."""
    x = jnp.clip(x.astype(jnp.float32), -fmt.max, fmt.max)
    if fmt.native and dtype is None:
        return x.astype(fmt.storage)
    # Emulation: the grid step in the binade of |x| is 2^(e - nmant), with e >= minexp
    # (subnormals share the smallest binade's step). jnp.round is round-half-to-even.
    _, exp = jnp.frexp(x)  # |x| = m * 2^exp with m in [0.5, 1)
    e = jnp.maximum(exp - 1, fmt.minexp)
    step = jnp.ldexp(jnp.ones_like(x), e - fmt.nmant)
    q = jnp.clip(jnp.round(x / step) * step, -fmt.max, fmt.max)
    return q.astype(fmt.storage if dtype is None else dtype)


def _safe_scale(amax: jax.Array, fmt: Format) -> jax.Array:
    """amax / fmax, with 1.0 for an all-zero (or all-masked) tensor so 0/0 never happens.

    The scale is floored at the smallest normal float32: for a tiny amax (below fmax times
    that), amax / fmax is subnormal, which flush-to-zero hardware (XLA CPU, GPU) makes 0, and
    x / 0 would give inf and NaN codes."""
    amax = amax.astype(jnp.float32)
    scale = jnp.maximum(amax / fmt.max, jnp.finfo(jnp.float32).tiny)
    return jnp.where(amax > 0, scale, 1.0)


def quantize_weight(
    w_OI: jax.Array, fmt: str = "float8_e4m3fn", *, act_scaling: str = "tensor"
) -> QArray:
    """Per-tensor quantization of a ``[..., O, I]`` weight (one scale per leading index).

    The weight is first rounded to bfloat16, the trainer's compute dtype, so the rollout copy
    quantizes exactly the values the trainer's forward uses.
    """
    f = get_format(fmt)
    if act_scaling not in ACT_SCALINGS:
        raise ValueError(f"act_scaling={act_scaling!r}; valid values: {list(ACT_SCALINGS)}.")
    w = jnp.asarray(w_OI).astype(jnp.bfloat16).astype(jnp.float32)
    scale = _safe_scale(jnp.max(jnp.abs(w), axis=(-2, -1)), f)
    quant = round_to_format(w / scale[..., None, None], f)
    return QArray(quant=quant, scale=scale, fmt=fmt, act_scaling=act_scaling)


def widen_codes(w: QArray, backend: str | None = None) -> QArray:
    """``w`` with its codes held as bfloat16 on CPU (``backend``, default
    `jax.default_backend()`), as it is elsewhere. Every value of every format here is a bfloat16
    value (at most 3 mantissa bits, exponents within bfloat16's range), so the codes are the same
    numbers, and `linear` multiplies the activation codes as bfloat16 too: the products are exact
    and the dot sums them in float32 either way (only the summation order can change). XLA:CPU
    has no FP8 dot: it widened the codes to float32 at every call, which in the decode loop
    (compiled without invariant code motion, `sampler.compiler_options`) is every weight at every
    step. Done once before the loop (`sampler.decode_params`; LLaDA's loop in
    `diffusion_sampler.generate_arrays`), CPU FP8 rollouts run markedly faster
    (docs/benchmarks.md). Off CPU the FP8 codes stay: they are the FP8 GEMM's operands."""
    backend = jax.default_backend() if backend is None else backend
    if backend != "cpu" or w.quant.dtype == jnp.bfloat16:
        return w
    return w.replace(quant=w.quant.astype(jnp.bfloat16))


def map_qarrays(f, params: Any) -> Any:
    """``f`` applied to every `QArray` of a pytree; other leaves as they are."""
    is_q = lambda x: isinstance(x, QArray)  # noqa: E731
    return jax.tree.map(lambda x: f(x) if is_q(x) else x, params, is_leaf=is_q)


def widen_tree_codes(params: Any, backend: str | None = None) -> Any:
    """`widen_codes` applied to every `QArray` of a pytree; other leaves as they are."""
    return map_qarrays(lambda w: widen_codes(w, backend), params)


OPERAND_DTYPES = (None, "storage", "bfloat16")  # `QArray.operand_dtype`

# Below this many rows, a matmul off CPU multiplies the FP8 codes as bfloat16 (`step_operands`).
# On one H200 (docs/benchmarks.md, "The second H200 lease"), cuBLASLt's FP8 GEMM read a
# Qwen3-8B layer's weights at 64 rows well below the BF16 GEMM's bytes per second, and bfloat16
# operands (a Triton GEMM widening the 1-byte codes as it loads them) were the faster decode; from
# 256 rows the FP8 GEMM was level with BF16 and the prefill faster with FP8 operands.
FP8_GEMM_MIN_ROWS = 256


def set_operand_dtype(params: Any, operand_dtype: str | None) -> Any:
    """Every `QArray` of a pytree with ``operand_dtype`` (`OPERAND_DTYPES`), the codes as
    they are; other leaves as they are."""
    if operand_dtype not in OPERAND_DTYPES:
        raise ValueError(f"operand_dtype={operand_dtype!r}; valid values: {list(OPERAND_DTYPES)}.")
    return map_qarrays(lambda w: w.replace(operand_dtype=operand_dtype), params)


def step_operands(params: Any, rows: int, backend: str | None = None) -> Any:
    """The params a matmul over ``rows`` rows (a decode step's batch) multiplies by: off CPU
    (``backend``, default `jax.default_backend()`), below `FP8_GEMM_MIN_ROWS` rows, every
    `QArray` whose ``operand_dtype`` is not set with bfloat16 operands (the same numbers);
    else ``params``. On CPU the codes are already bfloat16 (`widen_codes`)."""
    backend = jax.default_backend() if backend is None else backend
    if backend == "cpu" or rows >= FP8_GEMM_MIN_ROWS:
        return params
    return map_qarrays(
        lambda w: w.replace(operand_dtype="bfloat16") if w.operand_dtype is None else w, params
    )


def quantize_activation(
    x: jax.Array,
    fmt: Format,
    *,
    act_scaling: str = "tensor",
    row_mask: jax.Array | None = None,
    dtype=None,
) -> tuple[jax.Array, jax.Array]:
    """Dynamic scaling of an activation ``x[..., I]``; returns (codes, scale).

    ``scale`` is a scalar (per tensor) or ``[..., 1]`` (per row). ``row_mask[...]`` (bool)
    excludes rows from the per-tensor amax. ``dtype``: the codes in that dtype, rounded in
    float32 arithmetic (`round_to_format`).
    """
    x32 = x.astype(jnp.float32)
    if act_scaling == "token":
        scale = _safe_scale(jnp.max(jnp.abs(x32), axis=-1, keepdims=True), fmt)
    else:
        absx = jnp.abs(x32)
        if row_mask is not None:
            absx = jnp.where(row_mask[..., None], absx, 0.0)
        scale = _safe_scale(jnp.max(absx), fmt)
    return round_to_format(x32 / scale, fmt, dtype), scale


# From this many rows (tokens) on, XLA:CPU multiplies bfloat16 operands as float32 (`dot_dtype`):
# training-sized products upcast; decode steps and the tiny experiments' updates do not.
CPU_FLOAT32_DOT_MIN_ROWS = 4096


def dot_dtype(dtype, rows: int, backend: str | None = None) -> jnp.dtype:
    """The operand dtype of a matmul over ``rows`` rows of ``dtype`` operands on ``backend``
    (default: `jax.default_backend()`): ``dtype``, except float32 for bfloat16 on CPU from
    `CPU_FLOAT32_DOT_MIN_ROWS` rows on. The values are the same: a product of two bfloat16
    numbers is exact in float32, and the dots accumulate in float32 either way, so only the
    summation order can differ. The backward pass is unchanged too (JAX's transpose of a
    bfloat16 dot already multiplies float32 cotangents by the operands upcast, and rounds the
    gradients to bfloat16, as the casts' transposes do here). XLA:CPU's float32 GEMMs are
    faster than its bfloat16 ones from some tens of rows on. Yet the threshold stays at 4096
    rows, above a GRPO batch's decode
    step: another summation order is another bf16 rounding now and then, and a BF16 rollout
    is the trainer's policy bitwise only while its decode steps and the trainer's re-score
    run the same kind of kernel. A threshold of 128 rows made bf16 rollouts faster, but the BF16
    arm's rollout-vs-trainer mismatch on `configs/compare.yaml` rose from 0-4e-8 to 1.2e-4
    nats per token (docs/benchmarks.md): the experiments' control arm has to stay on-policy
    (`test_bf16_rollout_of_a_grpo_batch_is_the_trainers_policy`). Runs whose re-score or
    update reaches 4096 rows (128 responses of 32 tokens or more) still mix the two kernels,
    so their BF16 rollouts are on-policy to float32 summation order only."""
    dtype = jnp.dtype(dtype)
    backend = jax.default_backend() if backend is None else backend
    if dtype == jnp.bfloat16 and backend == "cpu" and rows >= CPU_FLOAT32_DOT_MIN_ROWS:
        return jnp.dtype(jnp.float32)
    return dtype


def linear(
    x: jax.Array, w: jax.Array | QArray, *, row_mask: jax.Array | None = None, out_dtype=None
) -> jax.Array:
    """``y[..., O] = x[..., I] @ w[O, I]^T``; the one matmul of the model.

    A plain array ``w`` (or `Columns`) runs on ``x.dtype`` operands (bf16 or f32 trainer path;
    held as float32 where `dot_dtype` says so) with float32 accumulation, rounded once to
    ``out_dtype``. (Asking XLA:CPU for a bf16 result directly is slower for the same
    numbers.) A `QArray` runs the W8A8 path: ``x`` is quantized with a dynamic scale (masked
    rows excluded) and the dot takes the low-precision operands (or the same codes as
    bfloat16, `QArray.operand_dtype`) with float32 accumulation, rescaled by both scales.
    """
    out_dtype = out_dtype or x.dtype
    if not isinstance(w, QArray):
        rows = x.size // x.shape[-1]
        dot = dot_dtype(x.dtype, rows)
        if isinstance(w, Columns):
            if dot == F32 and rows <= COLUMNS_MAX_ROWS:
                return columns_dot(x, w.w_OI.astype(x.dtype)).astype(out_dtype)
            w = w.w_OI
        w = w.astype(x.dtype).astype(dot)
        y = jnp.einsum("...i,oi->...o", x.astype(dot), w, preferred_element_type=F32)
        return y.astype(out_dtype)
    fmt = get_format(w.fmt)
    # With bfloat16 operands the activation codes never pass through an FP8 value, so XLA:GPU
    # does not take the product for an FP8 GEMM, and the weight codes widen inside the GEMM.
    operands = None if w.operand_dtype in (None, "storage") else w.operand_dtype
    xq, x_scale = quantize_activation(
        x, fmt, act_scaling=w.act_scaling, row_mask=row_mask, dtype=operands
    )
    wq = w.quant if operands is None else w.quant.astype(operands)
    xq = xq.astype(wq.dtype)
    y = jnp.einsum("...i,oi->...o", xq, wq, preferred_element_type=jnp.float32)
    w_scale = w.scale.reshape((1,) * (y.ndim - w.scale.ndim) + w.scale.shape)  # [] or [O]
    return (y * (x_scale * w_scale)).astype(out_dtype)


def columns_dot(x: jax.Array, w_OI: jax.Array) -> jax.Array:
    """``x[..., I] @ w_OI^T`` as ``(w_OI @ x_IR)^T`` over the R rows of ``x``: the operands in
    their dtypes, accumulated and returned in float32 (`Columns`)."""
    x_IR = jax.lax.optimization_barrier(x.reshape(-1, x.shape[-1]).T)
    y_OR = jnp.matmul(w_OI, x_IR, preferred_element_type=F32)
    return jax.lax.optimization_barrier(y_OR).T.reshape(*x.shape[:-1], w_OI.shape[0])


def concat_rows(ws: Sequence[Any], groups: int = 1) -> Any:
    """Weights ``[..., O_i, I]`` that multiply one input, held as one ``[..., sum O_i, I]``
    weight of their kind (plain arrays, `Columns` or `QArray` s), so that `linear` runs one
    matmul where there were ``len(ws)``; `split_rows` takes its product apart again.

    The rows come in ``groups`` blocks, block g holding the g-th ``1/groups`` of every weight's
    rows in the order of ``ws``. With ``groups`` = the number of KV heads, a layer's q/k/v rows
    are each KV head's query heads, then its key and its value head, so a contiguous split of
    the rows over tensor-parallel devices leaves every device whole heads of all three.
    `QArray` s keep their own scales as a per-row scale: every product is the one it was."""
    kinds = {type(w) for w in ws}
    if len(kinds) != 1 or not ws:
        raise ValueError(
            f"concat_rows: weights of one kind needed, got {sorted(k.__name__ for k in kinds)}."
        )
    first = ws[0]
    arrays = [
        w.w_OI if isinstance(w, Columns) else w.quant if isinstance(w, QArray) else w for w in ws
    ]
    rows = [a.shape[-2] for a in arrays]
    if groups < 1 or any(r % groups for r in rows):
        raise ValueError(f"concat_rows: groups={groups!r} must divide every weight's rows {rows}.")

    def join(parts):  # [..., O_i, X] -> [..., sum O_i, X], in blocks
        lead = parts[0].shape[:-2]
        blocks = [a.reshape(*lead, groups, a.shape[-2] // groups, a.shape[-1]) for a in parts]
        joined = jnp.concatenate(blocks, axis=-2)
        return joined.reshape(*lead, -1, joined.shape[-1])

    if isinstance(first, Columns):
        return Columns(join(arrays))
    if not isinstance(first, QArray):
        return join(arrays)
    static = {(w.fmt, w.act_scaling, w.operand_dtype, jnp.dtype(w.quant.dtype)) for w in ws}
    if len(static) != 1:
        raise ValueError(
            f"concat_rows: QArrays of one format, scaling and dtype needed, got {static}."
        )

    def row_scales(w):  # [..., O, 1]
        per_row = w.scale.ndim == w.quant.ndim - 1
        return (
            w.scale[..., None]
            if per_row
            else jnp.broadcast_to(w.scale[..., None, None], (*w.scale.shape, w.shape[-2], 1))
        )

    return first.replace(quant=join(arrays), scale=join([row_scales(w) for w in ws])[..., 0])


def split_rows(y: jax.Array, sizes: Sequence[int], groups: int = 1) -> tuple[jax.Array, ...]:
    """The products ``y[..., sum O_i]`` of a `concat_rows` weight (of ``groups`` blocks) as
    the products ``[..., O_i]`` of its weights, ``sizes`` = their rows ``O_i``."""
    lead = y.shape[:-1]
    y_GO = y.reshape(*lead, groups, y.shape[-1] // groups)
    cuts = np.cumsum([s // groups for s in sizes])[:-1]
    return tuple(
        part.reshape(*lead, size)
        for part, size in zip(jnp.split(y_GO, cuts, axis=-1), sizes, strict=True)
    )


# ---- whole-tree helpers --------------------------------------------------------------------


def quantize_params(
    params: Mapping[str, Any],
    fmt: str = "float8_e4m3fn",
    *,
    act_scaling: str = "tensor",
    lm_head: bool = False,
) -> dict[str, Any]:
    """The rollout copy of trainer params: every linear weight of every layer (`PROJECTIONS`:
    Qwen3's, and Qwen3.5's Gated DeltaNet ``in_proj_qkv/z/b/a``, ``out_proj``) becomes a
    `QArray`; embeddings, norms, biases, and Qwen3.5's conv and decay parameters stay
    bfloat16. ``lm_head=True`` also quantizes the output projection (a separate quantized copy
    when embeddings are tied)."""
    get_format(fmt)
    if act_scaling not in ACT_SCALINGS:
        raise ValueError(f"act_scaling={act_scaling!r}; valid values: {list(ACT_SCALINGS)}.")
    bf16 = lambda a: jnp.asarray(a).astype(jnp.bfloat16)  # noqa: E731
    out = {k: bf16(v) for k, v in params.items() if k != "layers"}
    out["layers"] = {
        name: (quantize_weight(w, fmt, act_scaling=act_scaling) if name in PROJECTIONS else bf16(w))
        for name, w in params["layers"].items()
    }
    if lm_head:
        head = params.get("lm_head", params["embed"])
        out["lm_head"] = quantize_weight(head, fmt, act_scaling=act_scaling)
    return out


def quantize_fp8(
    params: Mapping[str, Any], *, act_scaling: str = "tensor", lm_head: bool = False
) -> dict[str, Any]:
    """FP8 E4M3 W8A8 rollout copy (per-tensor weight scales); see `quantize_params`."""
    return quantize_params(params, "float8_e4m3fn", act_scaling=act_scaling, lm_head=lm_head)


def tree_bytes(tree: Any) -> int:
    """Bytes held by the arrays of a pytree (QArray codes count at their storage size)."""
    return int(
        sum(
            np.dtype(x.dtype).itemsize * int(np.prod(x.shape))
            for x in jax.tree_util.tree_leaves(tree)
        )
    )
