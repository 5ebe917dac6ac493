"""Qwen3 (and Qwen2) as pure functions over a parameter pytree.

The decoder is exactly Hugging Face's `Qwen3ForCausalLM`: RMSNorm (float32 statistics), per-head
q/k RMSNorm before RoPE (Qwen3; off for Qwen2, which has q/k/v biases instead), rotate-half RoPE
with the config's `rope_theta`, grouped-query attention, SwiGLU MLP, tied or untied embeddings.

Parameters are a plain dict whose per-layer arrays are stacked along a leading L axis, in the
Hugging Face `[out, in]` layout:

    embed [V, D]   final_norm [D]   lm_head [V, D] (untied only)
    layers: input_norm [L, D]  q_proj [L, H*E, D]  k_proj/v_proj [L, K*E, D]  o_proj [L, D, H*E]
            q_norm/k_norm [L, E] (Qwen3)  q_bias [L, H*E]  k_bias/v_bias [L, K*E] (Qwen2)
            post_norm [L, D]  gate_proj/up_proj [L, F, D]  down_proj [L, D, F]

``layers`` may also be a list of L per-layer dicts (`unstack_layers`), which the sampler uses
inside its decode loop, and a layer's q/k/v and gate/up weights may be held as one
``qkv_proj [K*(R+2)*E, D]`` and one ``gate_up_proj [2*F, D]`` (`fuse_projections`: two
matmuls where there were five).

Every matmul goes through `quant.linear`, so the same code is the BF16 trainer (plain arrays)
and the FP8 rollout engine (`QArray` weights). The compute dtype is the embedding's dtype;
logits are always float32.

Three entry points share one layer function:
- `forward(params, config, tokens_BS, mask_BS)`: full sequence, for training and scoring; it is
  `head_logits(params, final_hidden(...))`, and the two halves serve callers that apply the
  LM head to a few positions at a time (the trainer's chunked log-softmax, `sampler.py`).
- `response_hidden(params, config, prompt_tokens_NP, prompt_mask_NP, tokens_BT, mask_BT)`: the
  hidden states that score B responses to N prompts (G = B / N consecutive rows per prompt,
  GRPO's groups), each prompt run once: what the trainer's log-probs run on.
- `forward_cached(params, config, tokens_BQ, cache, mask_BQ)`: writes the new keys/values into a
  `KVCache` and attends over it; a batched prefill and one-token decode steps are both this call.
Positions come from the padding mask (left padding: position = number of earlier valid tokens).

The same entry points take a Qwen3.5 config (`qwen35.Qwen35Config`): `init_params`,
`param_shapes`, `forward`, `final_hidden`, `init_cache`, `forward_cached` and `unstack_layers`
then run `qwen35.py`'s functions of the same name (`_family`), so the sampler, the trainer and
the memory plan see one interface for both families. `head_logits` and `cast_params` are the
same for both.

Dimensions (docs/design.md's key): B rows, S sequence positions (a `forward`'s tokens; a KV cache's
slots), V vocabulary, D model, L layers, H query heads, K kv heads, R = H // K, E head dim, F MLP;
and Q: the query positions of one attention call (Q = S in `forward`; in `forward_cached` the Q new
tokens it appends to the cache's S slots: the prompt in a prefill, one in a decode step). The layer
functions shared by both call their positions S.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from ais_jax.model_config import ModelConfig
from ais_jax.quant import QArray, concat_rows, linear, split_rows

Params = dict[str, Any]
F32 = jnp.float32
_MASKED = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: a fully masked row stays finite


# ---- the model family -----------------------------------------------------------------------


def _family(config):
    """`qwen35` (the module) for a `qwen35.Qwen35Config`; None for a `ModelConfig` (or any
    other config object, read as before by this module's own code). Imported here, not at the
    top: qwen35.py builds on this module's functions."""
    if isinstance(config, ModelConfig):
        return None
    from ais_jax import qwen35

    return qwen35 if isinstance(config, qwen35.Qwen35Config) else None


# ---- parameters ---------------------------------------------------------------------------------


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.float32) -> Params:
    """Random parameters (normal, std 0.02, as Hugging Face's initializer; norms at one);
    `qwen35.init_params` for a Qwen3.5 config."""
    if (family := _family(config)) is not None:
        return family.init_params(config, key, dtype)
    return dense_params(config, key, dtype)


def dense_params(config, key: jax.Array, dtype=jnp.float32) -> Params:
    """`init_params` of a LLaMA-style stack of dense layers: `ModelConfig`, and any config with
    its dimension fields (`llada.LLaDAConfig`; no ``qk_norm`` or ``attention_bias`` there)."""
    c = config
    L, D, E, F = c.num_layers, c.hidden_size, c.head_dim, c.intermediate_size
    HE, KE = c.num_heads * E, c.num_kv_heads * E
    shapes = {
        "q_proj": (L, HE, D),
        "k_proj": (L, KE, D),
        "v_proj": (L, KE, D),
        "o_proj": (L, D, HE),
        "gate_proj": (L, F, D),
        "up_proj": (L, F, D),
        "down_proj": (L, D, F),
    }
    keys = iter(jax.random.split(key, len(shapes) + 2))
    normal = lambda shape: (0.02 * jax.random.normal(next(keys), shape)).astype(dtype)  # noqa: E731
    layers = {name: normal(shape) for name, shape in shapes.items()}
    layers["input_norm"] = jnp.ones((L, D), dtype)
    layers["post_norm"] = jnp.ones((L, D), dtype)
    if getattr(c, "qk_norm", False):
        layers["q_norm"] = jnp.ones((L, E), dtype)
        layers["k_norm"] = jnp.ones((L, E), dtype)
    if getattr(c, "attention_bias", False):
        layers["q_bias"] = jnp.zeros((L, HE), dtype)
        layers["k_bias"] = jnp.zeros((L, KE), dtype)
        layers["v_bias"] = jnp.zeros((L, KE), dtype)
    params = {
        "embed": normal((c.vocab_size, D)),
        "final_norm": jnp.ones((D,), dtype),
        "layers": layers,
    }
    if not c.tie_embeddings:
        params["lm_head"] = normal((c.vocab_size, D))
    return params


def param_shapes(config: ModelConfig, dtype=jnp.bfloat16) -> Params:
    """The parameter tree as `jax.ShapeDtypeStruct`s, built without allocating it."""
    return jax.eval_shape(lambda k: init_params(config, k, dtype), jax.random.key(0))


def cast_params(params: Params, dtype) -> Params:
    """Cast floating-point arrays to ``dtype``; quantized weights (`QArray`) are left alone."""

    def cast(x):
        return x if isinstance(x, QArray) else x.astype(dtype)

    return jax.tree_util.tree_map(cast, params, is_leaf=lambda x: isinstance(x, QArray))


# ---- building blocks ----------------------------------------------------------------------------


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
    grad_D = jnp.sum(_f32(g) * _f32(x), axis=rows).astype(weight_D.dtype)
    return grad_D, jnp.broadcast_to(weight_D, g.shape) * g


_scale.defvjp(_scale_forward, _scale_backward)


def _f32(a: jax.Array) -> jax.Array:
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
    keys and values (`_f32`) sum their gradients in float32 too.
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


def _cache_layout(k_BSKE: jax.Array, v_BSKE: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Projected keys/values ``[B, S, K, E]`` in `attention`'s layouts: ``[B, K, S, E]`` and
    ``[B, K, E, S]``."""
    return k_BSKE.transpose(0, 2, 1, 3), v_BSKE.transpose(0, 2, 3, 1)


QKV_PROJ, GATE_UP_PROJ = "qkv_proj", "gate_up_proj"  # `fuse_projections`' names


def fuse_projections(lp: Params, c: ModelConfig) -> Params:
    """A Qwen3/Qwen2 layer's params with its q/k/v weights held as one ``qkv_proj`` and its
    gate/up weights as one ``gate_up_proj`` (`quant.concat_rows`; plain arrays, `Columns` and
    `QArray` s alike): the layer then runs two matmuls where it ran five, with the same
    products (a quantized layer's activation scales too: the five share two inputs, whose
    quantization XLA already computed once each). The rows come in per-KV-head blocks (a head's R
    query heads, its key, its value) and per-channel pairs (gate, up), so that tensor-parallel
    shards of the fused weights hold whole heads and matching channels. A layer without these
    weights (already fused) is returned as it is. Stacked ``[L, O, I]`` or per-layer."""
    fused = dict(lp)
    if all(n in lp for n in ("q_proj", "k_proj", "v_proj")):
        parts = [fused.pop(n) for n in ("q_proj", "k_proj", "v_proj")]
        fused[QKV_PROJ] = concat_rows(parts, groups=c.num_kv_heads)
    if "gate_proj" in lp and "up_proj" in lp:
        parts = [fused.pop(n) for n in ("gate_proj", "up_proj")]
        fused[GATE_UP_PROJ] = concat_rows(parts, groups=c.intermediate_size)
    return fused


def _qkv(lp: Params, c: ModelConfig, x_BSD, positions_BS, row_mask_BS):
    B, S, _ = x_BSD.shape
    if QKV_PROJ in lp:
        HE, KE = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        qkv = linear(x_BSD, lp[QKV_PROJ], row_mask=row_mask_BS)
        q, k, v = split_rows(qkv, (HE, KE, KE), groups=c.num_kv_heads)
    else:
        q = linear(x_BSD, lp["q_proj"], row_mask=row_mask_BS)
        k = linear(x_BSD, lp["k_proj"], row_mask=row_mask_BS)
        v = linear(x_BSD, lp["v_proj"], row_mask=row_mask_BS)
    if c.attention_bias:
        q, k, v = (
            (_f32(a) + jnp.broadcast_to(_f32(lp[f"{n}_bias"].astype(a.dtype)), a.shape)).astype(
                a.dtype
            )
            for a, n in ((q, "q"), (k, "k"), (v, "v"))
        )
    q_BSHE = q.reshape(B, S, c.num_heads, c.head_dim)
    k_BSKE = k.reshape(B, S, c.num_kv_heads, c.head_dim)
    v_BSKE = v.reshape(B, S, c.num_kv_heads, c.head_dim)
    if c.qk_norm:
        q_BSHE = rms_norm(q_BSHE, lp["q_norm"], c.rms_norm_eps)
        k_BSKE = rms_norm(k_BSKE, lp["k_norm"], c.rms_norm_eps)
    return (
        rope(q_BSHE, positions_BS, c.rope_theta),
        rope(k_BSKE, positions_BS, c.rope_theta),
        v_BSKE,
    )


def _mlp(lp: Params, x_BSD, row_mask_BS):
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


def _layer(lp: Params, c: ModelConfig, x_BSD, positions_BS, row_mask_BS, attend):
    """One decoder layer; ``attend(q, k, v) -> out`` decides where keys/values come from."""
    h = rms_norm(x_BSD, lp["input_norm"], c.rms_norm_eps)
    q_BSHE, k_BSKE, v_BSKE = _qkv(lp, c, h, positions_BS, row_mask_BS)
    x_BSD = x_BSD + linear(attend(q_BSHE, k_BSKE, v_BSKE), lp["o_proj"], row_mask=row_mask_BS)
    h = rms_norm(x_BSD, lp["post_norm"], c.rms_norm_eps)
    return x_BSD + _mlp(lp, h, row_mask_BS)


def _layer_params(params: Params, i: int) -> Params:
    layers = params["layers"]
    if isinstance(layers, list | tuple):  # unstacked (see `unstack_layers`)
        return layers[i]
    return jax.tree_util.tree_map(lambda a: a[i], layers)


def unstack_layers(params: Params, config: ModelConfig | None = None) -> Params:
    """``params`` with ``layers`` as a list of per-layer trees instead of stacked arrays.

    The model accepts either form. Inside a loop (the sampler's decode loop) unstacking once,
    before the loop, saves XLA from slicing every stacked weight again at every step; it costs
    one copy of the layer weights for as long as the unstacked tree lives. A Qwen3.5 tree
    (stacked per layer kind) needs its ``config`` (`qwen35.unstack_layers`).
    """
    if config is not None and (family := _family(config)) is not None:
        return family.unstack_layers(params, config)
    layers = params["layers"]
    if isinstance(layers, list | tuple):
        return params
    lengths = {x.shape[0] for x in jax.tree_util.tree_leaves(layers)}
    if len(lengths) > 1:
        raise ValueError(
            f"unstack_layers: stacked layer arrays of different lengths {sorted(lengths)} (a "
            "Qwen3.5 tree, stacked per layer kind?); pass its config."
        )
    num_layers = lengths.pop()
    return {**params, "layers": [_layer_params(params, i) for i in range(num_layers)]}


def head_logits(params: Params, hidden_BSD: jax.Array, row_mask_BS=None) -> jax.Array:
    """The LM head: float32 logits ``[B, S, V]`` of final-normed hidden states ``[B, S, D]``
    (`final_hidden`), with the untied ``lm_head`` or the tied embedding. ``row_mask_BS``
    marks the rows a quantized head's dynamic activation scale is taken over."""
    head = params.get("lm_head", params["embed"])
    return linear(hidden_BSD, head, row_mask=row_mask_BS, out_dtype=jnp.float32)


def _logits(params: Params, c: ModelConfig, x_BSD, row_mask_BS, last_only=False) -> jax.Array:
    x_BSD = rms_norm(x_BSD, params["final_norm"], c.rms_norm_eps)
    if last_only:  # sliced after the norm: before it, XLA:CPU fused the norm's sum differently
        x_BSD, row_mask_BS = x_BSD[:, -1:], row_mask_BS[:, -1:]
    return head_logits(params, x_BSD, row_mask_BS)


def positions_from_mask(mask_BS: jax.Array, offset_B: jax.Array | int = 0) -> jax.Array:
    """Left-padding positions: the number of earlier valid tokens (0 on padding)."""
    offset_B = jnp.broadcast_to(jnp.asarray(offset_B, jnp.int32), mask_BS.shape[:-1])
    pos = jnp.cumsum(mask_BS.astype(jnp.int32), axis=-1) - 1 + offset_B[..., None]
    return jnp.maximum(pos, 0)


# ---- full sequence ------------------------------------------------------------------------------


def forward(
    params: Params,
    config: ModelConfig,
    tokens_BS: jax.Array,
    mask_BS: jax.Array | None = None,
    *,
    return_hidden: bool = False,
    remat: bool = False,
) -> jax.Array:
    """Logits ``[B, S, V]`` (float32) of a left-padded batch; ``mask_BS`` marks valid tokens.

    Padded positions give finite values that no valid position depends on. With
    ``return_hidden`` the last layer's output ``[B, S, D]`` instead (before the final norm).
    With ``remat`` the backward pass recomputes each layer (`recompute_layer`).
    """
    if (family := _family(config)) is not None:
        return family.forward(
            params, config, tokens_BS, mask_BS, return_hidden=return_hidden, remat=remat
        )
    mask_BS = _valid(tokens_BS, mask_BS)
    x_BSD = _decoder(params, config, tokens_BS, mask_BS, remat)
    if return_hidden:
        return x_BSD
    return _logits(params, config, x_BSD, mask_BS)


def final_hidden(
    params: Params,
    config: ModelConfig,
    tokens_BS: jax.Array,
    mask_BS: jax.Array | None = None,
    *,
    remat: bool = False,
) -> jax.Array:
    """The final-normed hidden states ``[B, S, D]`` (compute dtype) of a left-padded batch:
    ``forward(...) == head_logits(params, final_hidden(...), mask_BS)``, so a caller can apply
    the LM head to a few positions at a time instead of holding all ``[B, S, V]`` logits.
    ``remat`` as in `forward`."""
    if (family := _family(config)) is not None:
        return family.final_hidden(params, config, tokens_BS, mask_BS, remat=remat)
    mask_BS = _valid(tokens_BS, mask_BS)
    x_BSD = _decoder(params, config, tokens_BS, mask_BS, remat)
    return rms_norm(x_BSD, params["final_norm"], config.rms_norm_eps)


def response_hidden(
    params: Params,
    config: ModelConfig,
    prompt_tokens_NP: jax.Array,
    prompt_mask_NP: jax.Array,
    tokens_BT: jax.Array,
    mask_BT: jax.Array,
    *,
    remat: bool = False,
) -> jax.Array:
    """The final-normed hidden states ``[B, T, D]`` whose logits score ``tokens_BT``: positions
    P - 1 ... P + T - 2 of the rows ``[prompt, tokens]``, where the B rows come in N groups of
    G = B / N consecutive rows that share one of the N left-padded prompts (GRPO's groups).

    Each prompt runs through the decoder once instead of G times, its keys/values broadcast to
    its group's rows; the last response token, whose hidden state scores nothing, is no input.
    The values are those of `final_hidden` of the concatenated rows, sliced, and a shared
    prompt's gradient is the sum of its rows' (float32: to rounding, tested). In bfloat16 they
    round differently: bitwise equal on the test model, up to 6e-3 apart in a log-prob on the
    default job's, with gradients as far from float32's as the full rows' (tested). The final
    norm runs on each part before they are joined: normed after the join, it was fused
    otherwise, and XLA skips roundings to bfloat16 inside a fusion (a BF16 rollout's
    log-probs then moved off the trainer's by 3.6e-3 on average). With prompts of P and
    responses of T tokens the decoder runs on P / G + T - 1 positions per row instead of
    P + T.

    ``remat``: each layer (its prompt and response parts together) under `recompute_layer`.

    Not used for one prompt per row (G = 1): with it, the default job's 1,500-step SFT warm
    start ended at a loss of 0.34 instead of 0.20 and its 30 GRPO steps gained 2 points of
    held-out accuracy instead of 25, although values and gradients matched the full rows'
    at its start and end; why is not known.
    """
    N, P = prompt_tokens_NP.shape
    B, T = tokens_BT.shape
    G, S = rows_per_prompt(N, B), T - 1  # S response inputs: all but the last token
    share = lambda a_N: jnp.repeat(a_N, G, axis=0)  # noqa: E731  (a prompt's value, per row)
    # a prompt's float values, per row; their gradient (the sum over the group) in float32
    fan_out = lambda a_N: share(_f32(a_N)).astype(a_N.dtype)  # noqa: E731
    prompt_mask_NP, mask_BT = prompt_mask_NP.astype(bool), mask_BT.astype(bool)
    tokens_BS, mask_BS = tokens_BT[:, :S], mask_BT[:, :S]
    positions_NP = positions_from_mask(prompt_mask_NP)
    positions_BS = positions_from_mask(mask_BS, share(prompt_mask_NP.sum(-1, dtype=jnp.int32)))
    # the prompt attends causally within itself; a response to its prompt, then causally
    allowed_NPP = jnp.tril(jnp.ones((P, P), bool))[None] & prompt_mask_NP[:, None, :]
    valid_BX = jnp.concatenate([share(prompt_mask_NP), mask_BS], axis=1)  # X = P + S keys
    allowed_BSX = jnp.tril(jnp.ones((S, P + S), bool), k=P)[None] & valid_BX[:, None, :]
    x_NPD = embed(params["embed"], prompt_tokens_NP)
    x_BSD = embed(params["embed"], tokens_BS)

    def layer(lp, xs, consts):
        """One layer over the prompts, then over the responses, which attend to its keys and
        values of their prompt (``xs`` = (x_NPD, x_BSD))."""
        (x_NPD, x_BSD), prompt_kv = xs, []
        positions_NP, prompt_mask_NP, positions_BS, mask_BS, allowed_NPP, allowed_BSX = consts

        def attend_prompt(q_NPHE, k_NPKE, v_NPKE):
            prompt_kv[:] = k_NPKE, v_NPKE  # this layer's, for the responses' attention below
            return attention(q_NPHE, *_cache_layout(k_NPKE, v_NPKE), allowed_NPP)

        def attend_response(q_BSHE, k_BSKE, v_BSKE):
            k_BXKE, v_BXKE = (
                jnp.concatenate([fan_out(a_NPKE), a_BSKE], axis=1)
                for a_NPKE, a_BSKE in zip(prompt_kv, (k_BSKE, v_BSKE), strict=True)
            )
            return attention(q_BSHE, *_cache_layout(k_BXKE, v_BXKE), allowed_BSX)

        x_NPD = _layer(lp, config, x_NPD, positions_NP, prompt_mask_NP, attend_prompt)
        if S:
            x_BSD = _layer(lp, config, x_BSD, positions_BS, mask_BS, attend_response)
        return x_NPD, x_BSD

    layer = recompute_layer(layer) if remat else layer
    consts = (positions_NP, prompt_mask_NP, positions_BS, mask_BS, allowed_NPP, allowed_BSX)
    for i in range(config.num_layers):
        x_NPD, x_BSD = layer(_layer_params(params, i), (x_NPD, x_BSD), consts)
    norm = lambda x: rms_norm(x, params["final_norm"], config.rms_norm_eps)  # noqa: E731
    return jnp.concatenate([fan_out(norm(x_NPD)[:, -1:]), norm(x_BSD)], axis=1)


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


def _valid(tokens_BS: jax.Array, mask_BS: jax.Array | None) -> jax.Array:
    if mask_BS is None:
        return jnp.ones(tokens_BS.shape, bool)
    return mask_BS.astype(bool)


def _decoder(
    params: Params, config: ModelConfig, tokens_BS, mask_BS, remat: bool = False
) -> jax.Array:
    """Embedding and every decoder layer of a full sequence: ``[B, S, D]`` before the norm;
    with ``remat`` each layer under `recompute_layer`."""
    S = tokens_BS.shape[1]
    positions_BS = positions_from_mask(mask_BS)
    causal_SS = jnp.tril(jnp.ones((S, S), bool))
    allowed_BSS = causal_SS[None] & mask_BS[:, None, :]
    x_BSD = embed(params["embed"], tokens_BS)

    def layer(lp, xs, consts):
        positions_BS, mask_BS, allowed_BSS = consts
        attend = lambda q, k, v: attention(q, *_cache_layout(k, v), allowed_BSS)  # noqa: E731
        return (_layer(lp, config, xs[0], positions_BS, mask_BS, attend),)

    layer = recompute_layer(layer) if remat else layer
    for i in range(config.num_layers):
        (x_BSD,) = layer(_layer_params(params, i), (x_BSD,), (positions_BS, mask_BS, allowed_BSS))
    return x_BSD


# ---- KV cache ---------------------------------------------------------------------------------


@struct.dataclass
class KVCache:
    """Keys/values of every layer for a batch of rows; its S slots are filled left to right.

    k: one ``[B, K, S, E]`` array per layer; v: one ``[B, K, E, S]`` array per layer (the
    layouts of `attention`; per-layer arrays so a decode step updates and reads each layer's
    cache in place); valid: ``[B, S]`` slots holding a real token; next_pos: ``[B]`` position of
    each row's next token; index: the next free slot (same for every row).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    valid: jax.Array
    next_pos: jax.Array
    index: jax.Array


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> KVCache:
    """An empty cache of S = ``max_len`` slots per row, keys and values in ``dtype`` (the
    model's compute dtype). For a Qwen3.5 config `qwen35.init_cache` (a `qwen35.HybridCache`:
    this cache for its attention layers, a recurrent state for each linear-attention layer)."""
    if (family := _family(config)) is not None:
        return family.init_cache(config, batch, max_len, dtype)
    L, K, E = config.num_layers, config.num_kv_heads, config.head_dim
    return KVCache(
        k=tuple(jnp.zeros((batch, K, max_len, E), dtype) for _ in range(L)),
        v=tuple(jnp.zeros((batch, K, E, max_len), dtype) for _ in range(L)),
        valid=jnp.zeros((batch, max_len), bool),
        next_pos=jnp.zeros((batch,), jnp.int32),
        index=jnp.zeros((), jnp.int32),
    )


def _write_slots(cache: jax.Array, update: jax.Array, index: tuple) -> jax.Array:
    """``dynamic_update_slice`` of ``update`` (cast to the cache's dtype) into ``cache``. A
    16-bit float cache is updated through its bits: XLA:CPU runs a bfloat16
    dynamic-update-slice in float32, over a converted copy of the whole cache, at every step."""
    update = update.astype(cache.dtype)
    if cache.dtype.itemsize != 2 or not jnp.issubdtype(cache.dtype, jnp.floating):
        return jax.lax.dynamic_update_slice(cache, update, index)
    bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.uint16)  # noqa: E731
    written = jax.lax.dynamic_update_slice(bits(cache), bits(update), index)
    return jax.lax.bitcast_convert_type(written, cache.dtype)


def _write_kv(k_BKSE, v_BKES, k_BQKE, v_BQKE, start) -> tuple[jax.Array, jax.Array]:
    """The caches of one layer with the Q projected keys/values ``[B, Q, K, E]`` written to
    slots ``start`` .. ``start + Q - 1`` (keys ``[B, K, S, E]``, values ``[B, K, E, S]``).

    One 16-bit value slot on CPU (a decode step) is written with a select over the whole cache
    rather than a dynamic-update-slice: XLA:CPU's 16-bit update is not in place either way
    (`_write_slots`), and along the values' minor slot axis its element-by-element copy is
    several times slower than the vectorised select (docs/benchmarks.md). The stored
    values are the same.
    """
    k_BKQE, v_BKEQ = _cache_layout(k_BQKE, v_BQKE)
    k_BKSE = _write_slots(k_BKSE, k_BKQE, (0, 0, start, 0))
    v_BKEQ = v_BKEQ.astype(v_BKES.dtype)
    if v_BKEQ.shape[-1] == 1 and v_BKES.dtype.itemsize == 2 and jax.default_backend() == "cpu":
        hit_S = jnp.arange(v_BKES.shape[-1]) == start
        return k_BKSE, jnp.where(hit_S, v_BKEQ, v_BKES)
    return k_BKSE, _write_slots(v_BKES, v_BKEQ, (0, 0, 0, start))


def forward_cached(
    params: Params,
    config: ModelConfig,
    tokens_BQ: jax.Array,
    cache: KVCache,
    mask_BQ: jax.Array | None = None,
    *,
    last_only: bool = False,
) -> tuple[jax.Array, KVCache]:
    """Append the Q tokens ``tokens_BQ`` to the cache and return their logits ``[B, Q, V]``
    (float32), or with ``last_only`` those of the last position, ``[B, 1, V]`` (all a
    left-padded prefill needs: the LM head over every prompt position was 2.5% of a small-model
    `generate`).

    ``mask_BQ`` marks real tokens (left padding in a prefill; finished rows in a decode step):
    unmasked tokens are neither attended to later nor counted in activation scales.
    For a Qwen3.5 config it is `qwen35.forward_cached` (its cache a `qwen35.HybridCache`).
    """
    if (family := _family(config)) is not None:
        return family.forward_cached(params, config, tokens_BQ, cache, mask_BQ, last_only=last_only)
    B, Q = tokens_BQ.shape
    if mask_BQ is None:
        mask_BQ = jnp.ones((B, Q), bool)
    mask_BQ = mask_BQ.astype(bool)
    S = cache.valid.shape[1]
    start = cache.index
    positions_BQ = positions_from_mask(mask_BQ, cache.next_pos)
    valid_BS = jax.lax.dynamic_update_slice(cache.valid, mask_BQ, (0, start))
    slot_S = jnp.arange(S)
    allowed_BQS = valid_BS[:, None, :] & (slot_S[None, :] <= start + jnp.arange(Q)[:, None])[None]

    k_cache, v_cache = list(cache.k), list(cache.v)
    x_BQD = embed(params["embed"], tokens_BQ)
    for i in range(config.num_layers):

        def attend(q_BQHE, k_BQKE, v_BQKE, i=i):
            k_cache[i], v_cache[i] = _write_kv(k_cache[i], v_cache[i], k_BQKE, v_BQKE, start)
            return attention(q_BQHE, k_cache[i], v_cache[i], allowed_BQS)

        x_BQD = _layer(_layer_params(params, i), config, x_BQD, positions_BQ, mask_BQ, attend)
    logits_BQV = _logits(params, config, x_BQD, mask_BQ, last_only)
    new_cache = KVCache(
        k=tuple(k_cache),
        v=tuple(v_cache),
        valid=valid_BS,
        next_pos=cache.next_pos + mask_BQ.sum(-1, dtype=jnp.int32),
        index=start + Q,
    )
    return logits_BQV, new_cache
