"""The building blocks every model family shares, as pure functions (a leaf: no model here).

RMSNorm with float32 statistics, the embedding lookup, rotate-half RoPE, grouped-query softmax
attention over the KV cache's layouts, the SwiGLU MLP, the LM head and the two rematerialisation
wrappers; plus the parameter-tree conventions of the families (`Params`, `layer_params`,
`cast_params`) and the prompt-group arithmetic of GRPO's batches. Every matmul goes through
`quant.linear`, so one function serves the BF16 trainer and the FP8 rollout engine. The
16-bit fan-outs (an embedding row, a norm weight, a shared prompt's keys) sum their gradients in
float32 and round once (`embed`, `f32`).

Dimensions: docs/design.md's key (B rows, S positions, Q query positions, V vocabulary, D model,
H query heads, K kv heads, R = H // K, E head dim, F MLP).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from ais_jax.nn.quant import QArray, linear, split_rows

Params = dict[str, Any]
GATE_UP_PROJ = (
    "gate_up_proj"  # a layer's gate and up weights held as one (`qwen3.fuse_projections`)
)

F32 = jnp.float32


_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: a fully masked row stays finite


def cast_params(params: Params, dtype) -> Params:
    """Cast floating-point arrays to ``dtype``; quantized weights (`QArray`) are left alone."""

    def cast(x):
        return x if isinstance(x, QArray) else x.astype(dtype)

    return jax.tree_util.tree_map(cast, params, is_leaf=lambda x: isinstance(x, QArray))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm with float32 statistics, cast back before the weight (as Hugging Face does)."""
    x32 = x.astype(F32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return _scale(weight.astype(x.dtype), x32.astype(x.dtype))


@jax.custom_vjp
def _scale(weight_D: jax.Array, x: jax.Array) -> jax.Array:
    """``weight_D * x`` over ``x``'s last axis, in their dtype. The weight's gradient, a sum over
    every row, accumulates in float32 and is rounded once (see `embed`); the values and ``x``'s
    gradient are autodiff's."""
    return jnp.broadcast_to(weight_D, x.shape) * x


def _scale_forward(weight_D, x):
    return _scale(weight_D, x), (weight_D, x)


def _scale_backward(residuals, g):
    weight_D, x = residuals
    rows = tuple(range(x.ndim - 1))
    grad_D = jnp.sum(f32(g) * f32(x), axis=rows).astype(weight_D.dtype)
    return grad_D, jnp.broadcast_to(weight_D, g.shape) * g


_scale.defvjp(_scale_forward, _scale_backward)


def f32(a: jax.Array) -> jax.Array:
    """``a`` in float32: exact for 16-bit ``a``. Fanned out from there (broadcast, repeated), a
    16-bit value's gradient sums in float32 and is rounded once, where XLA would otherwise
    sum the copies' cotangents in 16 bits and round after every addition."""
    return a.astype(F32)


@jax.custom_vjp
def embed(table_VD: jax.Array, tokens: jax.Array) -> jax.Array:
    """The rows ``table_VD[tokens]`` (the embedding lookup).

    Its gradient adds the cotangents of a token's occurrences in float32 and rounds the
    table's gradient to its dtype once. A plain `jnp.take` of a bfloat16 table scatter-adds
    them in bfloat16, rounding after every addition: the gradient of a token seen a thousand
    times in a batch then keeps few of its bits (tests/test_model.py). The same holds for
    every fan-out of a 16-bit value: a norm's weight (`_scale`), a bias and a shared prompt's
    keys and values (`f32`) sum their gradients in float32 too.
    """
    return jnp.take(table_VD, tokens, axis=0)


def _embed_forward(table_VD, tokens):
    return embed(table_VD, tokens), (table_VD, tokens)


def _embed_backward(residuals, g):
    table_VD, tokens = residuals
    grad_VD = jnp.zeros(table_VD.shape, F32).at[tokens].add(g.astype(F32))
    return grad_VD.astype(table_VD.dtype), None


embed.defvjp(_embed_forward, _embed_backward)


def rope(x_BSHE: jax.Array, positions_BS: jax.Array, theta: float) -> jax.Array:
    """Rotate-half rotary embedding; angles in float32, applied in ``x``'s dtype. ``H`` is any
    number of heads (the H query heads, or the K key heads)."""
    E = x_BSHE.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, E, 2, dtype=jnp.float32) / E))
    angles_BSe = positions_BS.astype(jnp.float32)[..., None] * inv_freq[None, None]
    angles_BSE = jnp.concatenate([angles_BSe, angles_BSe], axis=-1)[:, :, None, :]
    cos, sin = jnp.cos(angles_BSE).astype(x_BSHE.dtype), jnp.sin(angles_BSE).astype(x_BSHE.dtype)
    x1, x2 = jnp.split(x_BSHE, 2, axis=-1)
    return x_BSHE * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def attention(
    q_BQHE: jax.Array, k_BKSE: jax.Array, v_BKES: jax.Array, allowed_BQS: jax.Array
) -> jax.Array:
    """Grouped-query softmax attention (R = H // K query heads per kv head), float32 softmax:
    Q query positions over S key positions, ``allowed_BQS`` the pairs that may attend.

    Keys come as ``[B, K, S, E]`` and values as ``[B, K, E, S]``, the KV cache's layouts, and
    the queries are laid out as ``[B, K, R * Q, E]``: each dot is then a plain batched matmul
    over ``[B, K]`` that contracts its operands' minor dimensions, which is what XLA's batched
    dots want (no per-step transpose of the cache; with Q = 1, a decode step, the query
    transpose only moves unit axes). q, k and v share one dtype (the compute dtype); the dots
    accumulate in float32, and the result and the probabilities are rounded to that dtype.
    Under autodiff the backward pass recomputes the scores and probabilities from q, k and v
    (`recompute_in_backward`) instead of keeping them: ``[B, K, R * Q, S]`` float32 arrays, the
    largest of a training step's activations after the logits.
    """
    return recompute_in_backward(_attention)(q_BQHE, k_BKSE, v_BKES, allowed_BQS)


def _attention(q_BQHE, k_BKSE, v_BKES, allowed_BQS):
    """`attention`'s forward. (The earlier layout, queries as ``[B, Q, K, R, E]`` inside the
    einsums, was slower on XLA:CPU and needed einsums of its own for a decode step's Q = 1;
    docs/benchmarks.md.)"""
    B, Q, H, E = q_BQHE.shape
    K = k_BKSE.shape[1]
    R = H // K
    dtype = q_BQHE.dtype
    q_BKME = q_BQHE.reshape(B, Q, K, R, E).transpose(0, 2, 3, 1, 4).reshape(B, K, R * Q, E)
    scores_BKMS = jnp.einsum("bkme,bkse->bkms", q_BKME, k_BKSE, preferred_element_type=F32)
    scores_BKMS = scores_BKMS * (E**-0.5)
    scores_BKRQS = scores_BKMS.reshape(B, K, R, Q, -1)
    scores_BKRQS = jnp.where(allowed_BQS[:, None, None], scores_BKRQS, _MASKED)
    probs_BKRQS = jax.nn.softmax(scores_BKRQS, axis=-1).astype(dtype)
    out_BKME = jnp.einsum(
        "bkms,bkes->bkme", probs_BKRQS.reshape(B, K, R * Q, -1), v_BKES, preferred_element_type=F32
    )
    out_BQKRE = out_BKME.astype(dtype).reshape(B, K, R, Q, E).transpose(0, 3, 1, 2, 4)
    return out_BQKRE.reshape(B, Q, H * E)


def recompute_in_backward(fn: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """``fn(x, *rest)`` (array arguments, one array out) whose backward pass recomputes
    ``fn``'s intermediates from its inputs instead of keeping them alive from the forward pass:
    memory for a second run of ``fn``'s forward, which is cheap where ``fn`` is elementwise
    work or a small share of the step (attention's softmax, the MLP's activation). ``x`` holds
    as many elements as the output, and every intermediate depends on it (attention's queries,
    SwiGLU's gate).

    This is what `jax.checkpoint` asks for, but XLA:CPU undid it: its recomputation matched
    the forward pass's ops exactly and was merged with them (CSE), so the values stayed alive
    (the tiny benchmark's update temporaries: 584 MB, 578 with the attention under
    `jax.checkpoint`, 379 with the attention and SwiGLU under this). Here the recomputation
    runs on ``x + 0 * g``, ``g`` the cotangent laid out as ``x``: XLA may not fold it
    (``0 * inf`` is NaN), so the recomputation matches nothing of the forward pass and cannot
    run before the cotangent exists; elementwise, it is sharded as ``x`` and ``g`` are and
    needs no communication. The values are ``fn``'s own (x + 0 is x) wherever ``g`` is
    finite.
    """

    def backward(args, g):
        x, *rest = args
        tied = x + (g.reshape(x.shape) * 0).astype(x.dtype)  # a zero XLA cannot fold
        return jax.vjp(fn, tied, *rest)[1](g)

    wrapped = jax.custom_vjp(fn)
    wrapped.defvjp(lambda *args: (fn(*args), args), backward)
    return wrapped


def recompute_layer(layer: Callable) -> Callable:
    """``layer(lp, xs, consts) -> ys`` (a decoder layer, or a group of them: ``lp`` its params,
    ``xs`` a tuple of activations, ``ys`` a tuple of the same shapes, ``consts`` arrays with no
    gradient such as positions and masks) whose backward pass recomputes everything the layer
    computed from ``lp`` and ``xs`` (rematerialisation, as `jax.checkpoint` would, which XLA:CPU
    undoes; see `recompute_in_backward` for the trick used instead). Between the forward and
    the backward pass only the layer's inputs stay alive, the residual stream, instead of its
    every intermediate; the price is a second run of its forward, in the backward pass.
    """

    def backward(residuals, g_ys):
        lp, xs, consts = residuals
        tied = tuple(x + (g * 0).astype(x.dtype) for x, g in zip(xs, g_ys, strict=True))
        grads = jax.vjp(lambda lp, xs: layer(lp, xs, consts), lp, tied)[1](g_ys)
        return (*grads, None)  # no gradient for the constants

    wrapped = jax.custom_vjp(layer)
    wrapped.defvjp(lambda lp, xs, consts: (layer(lp, xs, consts), (lp, xs, consts)), backward)
    return wrapped


def mlp(lp: Params, x_BSD, row_mask_BS):
    if GATE_UP_PROJ in lp:
        gate_up = linear(x_BSD, lp[GATE_UP_PROJ], row_mask=row_mask_BS)
        F = gate_up.shape[-1] // 2
        gate, up = split_rows(gate_up, (F, F), groups=F)
    else:
        gate = linear(x_BSD, lp["gate_proj"], row_mask=row_mask_BS)
        up = linear(x_BSD, lp["up_proj"], row_mask=row_mask_BS)
    return linear(swiglu(gate, up), lp["down_proj"], row_mask=row_mask_BS)


@recompute_in_backward
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """``silu(gate) * up``, the MLP's activation. Its backward pass recomputes it from ``gate``
    and ``up`` (`recompute_in_backward`): autodiff kept ``silu(gate)``, the sigmoid and a
    float32 product alive besides them."""
    return jax.nn.silu(gate) * up


def layer_params(params: Params, i: int) -> Params:
    layers = params["layers"]
    if isinstance(layers, list | tuple):  # unstacked (see `unstack_layers`)
        return layers[i]
    return jax.tree_util.tree_map(lambda a: a[i], layers)


def unstack_layers(params: Params) -> Params:
    """``params`` with ``layers`` as a list of per-layer trees instead of stacked arrays.

    The model accepts either form. Inside a loop (the sampler's decode loop) unstacking once,
    before the loop, saves XLA from slicing every stacked weight again at every step; it costs
    one copy of the layer weights for as long as the unstacked tree lives. A tree stacked per
    layer kind (Qwen3.5's) needs its family's own (`ais_jax.models.unstack_layers` with the
    config).
    """
    layers = params["layers"]
    if isinstance(layers, list | tuple):
        return params
    lengths = {x.shape[0] for x in jax.tree_util.tree_leaves(layers)}
    if len(lengths) > 1:
        raise ValueError(
            f"unstack_layers: stacked layer arrays of different lengths {sorted(lengths)} (a "
            "tree stacked per layer kind?); use ais_jax.models.unstack_layers with its config."
        )
    num_layers = lengths.pop()
    return {**params, "layers": [layer_params(params, i) for i in range(num_layers)]}


def head_logits(params: Params, hidden_BSD: jax.Array, row_mask_BS=None) -> jax.Array:
    """The LM head: float32 logits ``[B, S, V]`` of final-normed hidden states ``[B, S, D]``
    (`final_hidden`), with the untied ``lm_head`` or the tied embedding. ``row_mask_BS``
    marks the rows a quantized head's dynamic activation scale is taken over."""
    head = params.get("lm_head", params["embed"])
    return linear(hidden_BSD, head, row_mask=row_mask_BS, out_dtype=jnp.float32)


def positions_from_mask(mask_BS: jax.Array, offset_B: jax.Array | int = 0) -> jax.Array:
    """Left-padding positions: the number of earlier valid tokens (0 on padding)."""
    offset_B = jnp.broadcast_to(jnp.asarray(offset_B, jnp.int32), mask_BS.shape[:-1])
    pos = jnp.cumsum(mask_BS.astype(jnp.int32), axis=-1) - 1 + offset_B[..., None]
    return jnp.maximum(pos, 0)


def check_prompt_group(group, rows: int) -> int:
    """``group`` (G, the consecutive rows that share one prompt: `train.Batch.prompt_group`,
    `sampler.generate`'s ``prompt_group``) as an int; an error unless it is a positive integer
    that divides ``rows``."""
    if (
        isinstance(group, bool)
        or not isinstance(group, numbers.Integral)
        or group < 1
        or rows % group
    ):
        raise ValueError(
            f"prompt_group={group!r} must be a positive integer dividing the {rows} rows"
        )
    return int(group)


def rows_per_prompt(prompts: int, rows: int) -> int:
    """G: how many consecutive rows share each of ``prompts`` prompts among ``rows`` rows (one
    prompt per row: 1); an error unless the prompts divide the rows."""
    if prompts < 1 or rows % prompts:
        raise ValueError(
            f"{prompts} prompts for {rows} response rows: pass one prompt per row or one per "
            "group of consecutive rows (a number of prompts that divides the rows)"
        )
    return rows // prompts
