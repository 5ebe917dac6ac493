"""Specification of `qwen3.py` and `model_config.py` without a reference implementation.

What must hold for any weights: causality and padding invariance of `forward`; the KV cache
(a left-padded prefill, then one-token decode steps, some rows finished) reproduces the
full-sequence logits; the real Qwen3 sizes are built by `jax.eval_shape` alone and have the
published parameter counts; configs validate eagerly with messages that name the field.
Parity with `transformers` itself is in test_hf.py.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import count_compiles
from hypothesis import given, settings
from hypothesis import strategies as st
from training_run import MODEL

from ais_jax import models as model
from ais_jax.models import forward, forward_cached, init_cache, param_shapes, qwen3
from ais_jax.models.qwen3 import PRESETS, ModelConfig
from ais_jax.nn import cache as kv_cache
from ais_jax.nn import layers, quant

QWEN3 = dataclasses.replace(MODEL, vocab_size=96, tie_embeddings=False)  # = conftest.TINY
QWEN2 = dataclasses.replace(
    QWEN3, qk_norm=False, attention_bias=True, tie_embeddings=True, num_kv_heads=1
)
CONFIGS = pytest.mark.parametrize("config", [QWEN3, QWEN2], ids=["qwen3", "qwen2"])

_forward = jax.jit(forward, static_argnums=1)


@functools.partial(jax.jit, static_argnums=(0, 2))
def random_params(config: ModelConfig, seed: int = 0, std: float = 0.2):
    """Every leaf random (norm weights around one, biases nonzero) so logits are O(1)."""
    shapes = param_shapes(config, jnp.float32)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = []
    for (path, leaf), key in zip(leaves, keys, strict=True):
        noise = std * jax.random.normal(key, leaf.shape, jnp.float32)
        out.append(1.0 + noise if "norm" in jax.tree_util.keystr(path) else noise)
    return jax.tree_util.tree_unflatten(treedef, out)


def left_padded(seed: int, batch: int, seq: int, vocab: int, pads=(0, 3, 6)):
    """Random tokens (padding tokens random too) and a left-padding mask."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (batch, seq))
    mask = np.arange(seq)[None] >= np.asarray(pads[:batch])[:, None]
    return jnp.asarray(tokens, jnp.int32), jnp.asarray(mask)


def assert_close(ours, ref, where):
    """|ours - ref| <= 1e-4 * max(1, |ref|) elementwise over the positions ``where[B, S]``."""
    ours, ref = np.asarray(ours)[np.asarray(where)], np.asarray(ref)[np.asarray(where)]
    assert np.isfinite(ours).all()
    bound = 1e-4 * np.maximum(1.0, np.abs(ref))
    excess = np.abs(ours - ref) - bound
    assert excess.max() <= 0, f"max |diff| {np.abs(ours - ref).max():.3g} exceeds 1e-4 tolerance"
    return float(np.abs(ours - ref).max())


# ---- forward: properties ------------------------------------------------------------------------


@pytest.mark.slow
@CONFIGS
@pytest.mark.parametrize("t", [0, 4, 9])
def test_causality(config, t):
    """Changing token t changes no logit before t (bitwise) and does change the logits at t."""
    params = random_params(config)
    tokens, mask = left_padded(1, 3, 10, config.vocab_size, pads=(0, 0, 0))
    changed = tokens.at[:, t].set((tokens[:, t] + 1 + jnp.arange(3)) % config.vocab_size)
    before, after = (
        np.asarray(_forward(params, config, tokens, mask)),
        np.asarray(_forward(params, config, changed, mask)),
    )
    np.testing.assert_array_equal(after[:, :t], before[:, :t])
    assert np.abs(after[:, t] - before[:, t]).max(axis=-1).min() > 1e-3


@pytest.mark.slow
@CONFIGS
def test_padding_is_invisible(config):
    """Pad tokens don't matter, and a row's logits don't depend on how much padding precedes it:
    left-padded rows equal the same tokens placed first (right-padded, so nothing precedes them)."""
    params = random_params(config)
    tokens, mask = left_padded(2, 3, 10, config.vocab_size)
    logits = np.asarray(_forward(params, config, tokens, mask))
    other_pads = jnp.where(mask, tokens, (tokens + 7) % config.vocab_size)
    valid = np.asarray(mask)
    np.testing.assert_array_equal(
        np.asarray(_forward(params, config, other_pads, mask))[valid], logits[valid]
    )
    pads = (~valid).sum(1)
    first = jnp.stack([jnp.roll(tokens[b], -int(pads[b])) for b in range(3)])
    first_logits = _forward(params, config, first, mask[:, ::-1])
    shifted = np.stack([np.roll(logits[b], -int(pads[b]), axis=0) for b in range(3)])
    assert_close(shifted, first_logits, valid[:, ::-1])


def test_logits_are_float32_and_finite_for_bf16_params():
    params = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), random_params(QWEN3))
    tokens, mask = left_padded(3, 3, 10, QWEN3.vocab_size)
    logits = _forward(params, QWEN3, tokens, mask)
    assert logits.dtype == jnp.float32 and logits.shape == (3, 10, QWEN3.vocab_size)
    assert np.isfinite(np.asarray(logits)).all()


# ---- KV cache -----------------------------------------------------------------------------------


@pytest.mark.slow
@CONFIGS
def test_kv_cache_decode_matches_full_forward(config):
    """Prefill a left-padded prompt batch, then decode one token per step (row 1 finishes after
    two steps): every step's logits equal the full-sequence forward at that position."""
    P, T, B = 7, 5, 3
    params = random_params(config, seed=4)
    prompt, prompt_mask = left_padded(5, B, P, config.vocab_size)
    new = jnp.asarray(np.random.default_rng(6).integers(0, config.vocab_size, (B, T)), jnp.int32)
    new_mask = jnp.ones((B, T), bool).at[1, 2:].set(False)
    full = _forward(
        params,
        config,
        jnp.concatenate([prompt, new], 1),
        jnp.concatenate([prompt_mask, new_mask], 1),
    )

    step = jax.jit(forward_cached, static_argnums=1)
    cache = init_cache(config, B, P + T, dtype=jnp.float32)
    last, _ = jax.jit(forward_cached, static_argnums=1, static_argnames="last_only")(
        params, config, prompt, cache, prompt_mask, last_only=True
    )
    logits, cache = step(params, config, prompt, cache, prompt_mask)
    assert_close(logits, full[:, :P], prompt_mask)
    assert last.shape == (B, 1, config.vocab_size)
    np.testing.assert_allclose(last, logits[:, -1:], rtol=1e-6, atol=1e-6)  # the prefill's
    compiles_by_step = []
    for j in range(T):
        with count_compiles("forward_cached") as compiles:
            logits, cache = step(params, config, new[:, j : j + 1], cache, new_mask[:, j : j + 1])
        assert_close(logits, full[:, P + j : P + j + 1], new_mask[:, j : j + 1])
        compiles_by_step.append(len(compiles))
    assert int(cache.index) == P + T
    np.testing.assert_array_equal(cache.next_pos, prompt_mask.sum(1) + new_mask.sum(1))
    assert compiles_by_step[1:] == [0] * (T - 1)  # decode steps after the first never recompile


@pytest.mark.slow
@CONFIGS
@pytest.mark.parametrize("kind", ["float32", "fp8"])
def test_fused_projections_are_the_same_layers(config, kind):
    """`fuse_projections`: q/k/v and gate/up as one matmul each give the same logits (to
    float32 summation order, `assert_close`) in the full forward (stacked layers) and in a
    prefill and a decode step (per-layer), for Qwen3, Qwen2 (biases) and FP8 rollout params;
    the fused rows are each KV head's query heads, its key and value, and each channel's gate
    and up, in that order."""

    params = random_params(config, seed=8)
    if kind == "fp8":
        params = quant.quantize_fp8(layers.cast_params(params, jnp.bfloat16))
    fused = {**params, "layers": qwen3.fuse_projections(params["layers"], config)}
    assert {"qkv_proj", "gate_up_proj"} <= set(fused["layers"])
    assert not {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"} & set(fused["layers"])
    assert qwen3.fuse_projections(fused["layers"], config) == fused["layers"]  # idempotent
    if kind == "float32":
        L, K, R, E = (
            config.num_layers,
            config.num_kv_heads,
            config.num_heads // config.num_kv_heads,
            config.head_dim,
        )
        lp = params["layers"]
        qkv = np.asarray(fused["layers"]["qkv_proj"]).reshape(L, K, R + 2, E, -1)
        np.testing.assert_array_equal(
            qkv[:, :, :R], np.asarray(lp["q_proj"]).reshape(L, K, R, E, -1)
        )
        np.testing.assert_array_equal(qkv[:, :, R], np.asarray(lp["k_proj"]).reshape(L, K, E, -1))
        np.testing.assert_array_equal(
            qkv[:, :, R + 1], np.asarray(lp["v_proj"]).reshape(L, K, E, -1)
        )
        gate_up = np.asarray(fused["layers"]["gate_up_proj"]).reshape(L, -1, 2, config.hidden_size)
        np.testing.assert_array_equal(gate_up[:, :, 0], lp["gate_proj"])
        np.testing.assert_array_equal(gate_up[:, :, 1], lp["up_proj"])
    B, P = 3, 7
    tokens, mask = left_padded(9, B, P, config.vocab_size)
    assert_close(
        _forward(fused, config, tokens, mask), _forward(params, config, tokens, mask), mask
    )
    step = jax.jit(forward_cached, static_argnums=1)
    per_layer = [model.unstack_layers(p) for p in (params, fused)]
    logits = []
    for p in per_layer:  # a prefill, then one decode step
        out, cache = step(p, config, tokens, init_cache(config, B, P + 1, p["embed"].dtype), mask)
        logits.append((out, step(p, config, tokens[:, :1], cache)[0]))
    assert_close(logits[1][0], logits[0][0], mask)
    assert_close(logits[1][1], logits[0][1], np.ones((B, 1), bool))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("Q", [1, 3])
def test_write_kv_puts_each_token_in_its_slot_and_nothing_else(dtype, Q):
    """`kv_cache.write_kv` (a decode step's 16-bit values go through a select on CPU, everything
    else through a dynamic-update-slice): slots start .. start + Q - 1 hold the new keys and
    values, bit for bit (float32 updates rounded once to the cache dtype), and every other slot
    is unchanged."""
    B, K, E, S, start = 3, 2, 4, 9, 5
    rng = np.random.default_rng(Q)
    k_cache = jnp.asarray(rng.normal(size=(B, K, S, E)), dtype)
    v_cache = jnp.asarray(rng.normal(size=(B, K, E, S)), dtype)
    k_new = jnp.asarray(rng.normal(size=(B, Q, K, E)), jnp.float32)
    v_new = jnp.asarray(rng.normal(size=(B, Q, K, E)), jnp.float32)
    write = jax.jit(kv_cache.write_kv)
    k_out, v_out = write(k_cache, v_cache, k_new, v_new, jnp.int32(start))
    assert k_out.dtype == v_out.dtype == jnp.dtype(dtype)
    k_want, v_want = np.asarray(k_cache).copy(), np.asarray(v_cache).copy()
    k_want[:, :, start : start + Q] = np.asarray(k_new.astype(dtype)).transpose(0, 2, 1, 3)
    v_want[..., start : start + Q] = np.asarray(v_new.astype(dtype)).transpose(0, 2, 3, 1)
    bits = lambda x: np.asarray(x).view(f"u{np.dtype(x.dtype).itemsize}")  # noqa: E731
    np.testing.assert_array_equal(bits(k_out), bits(k_want))
    np.testing.assert_array_equal(bits(v_out), bits(v_want))


@pytest.mark.parametrize("Q", [1, 4])
@pytest.mark.parametrize("B, K, R, E, S", [(5, 2, 2, 8, 11), (3, 1, 4, 16, 9), (4, 3, 1, 8, 6)])
def test_attention_is_float64_softmax_attention(B, K, R, E, S, Q):
    """`attention` (queries laid out as ``[B, K, R * Q, E]``) against float64 softmax attention,
    for a decode step (Q = 1) and several query positions: float32 to rounding. With bfloat16
    queries, keys and values (the bf16 trainer's and sampler's) the probabilities and the
    output are rounded to bfloat16 (unit roundoff u = 2^-8),
    so each output is within u * (sum_s p_s |v_s| + |out|) <= u * (max |v| + |out|) of the
    float64 attention of the same bfloat16 inputs, plus float32 rounding."""
    rng = np.random.default_rng(B * 100 + S + Q)
    q = rng.normal(size=(B, Q, K * R, E)).astype(np.float32)
    k = rng.normal(size=(B, K, S, E)).astype(np.float32)
    v = rng.normal(size=(B, K, E, S)).astype(np.float32)
    allowed = rng.random((B, Q, S)) < 0.7
    allowed[:, :, 0] = True  # every query attends somewhere

    def reference(q, k, v):
        q_BKRQE = np.asarray(q, np.float64).reshape(B, Q, K, R, E).transpose(0, 2, 3, 1, 4)
        scores = np.einsum("bkrqe,bkse->bkrqs", q_BKRQE, np.asarray(k, np.float64)) / E**0.5
        scores = np.where(allowed[:, None, None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = np.einsum("bkrqs,bkes->bqkre", probs, np.asarray(v, np.float64))
        return out.reshape(B, Q, K * R * E)

    got = jax.jit(layers.attention)(q, k, v, allowed)
    assert got.dtype == jnp.float32 and got.shape == (B, Q, K * R * E)
    np.testing.assert_allclose(got, reference(q, k, v), rtol=1e-5, atol=1e-6)

    bf16 = jnp.bfloat16
    q16, k16, v16 = (jnp.asarray(a, bf16) for a in (q, k, v))
    got16 = jax.jit(layers.attention)(q16, k16, v16, allowed)
    assert got16.dtype == bf16
    want = reference(*(np.asarray(a, np.float32) for a in (q16, k16, v16)))
    u = 2.0**-8
    bound = u * (np.abs(np.asarray(v16, np.float32)).max() + np.abs(want)) + 1e-6
    assert (np.abs(np.asarray(got16, np.float64) - want) <= bound).all()
    # ... and the bound is not vacuous: the bfloat16 result is not the float32 one
    assert not np.array_equal(np.asarray(got16, np.float32), np.asarray(got))


def _dyadic_cotangents(rng, shape) -> jax.Array:
    """bfloat16 multiples of 1/8 in [-3.5, 4.5]: sums of 8,192 of them are exact in float32."""
    return jnp.asarray(rng.integers(-28, 37, shape) / 8, jnp.bfloat16)


def _assert_rounded_once(got: jax.Array, exact: np.ndarray) -> None:
    """``got`` (bfloat16) is ``exact`` rounded once to bfloat16: within half a unit in its last
    place (ties may go either way: XLA:CPU's conversions need not round them to even)."""
    got = np.asarray(got, np.float64)
    half_ulp = np.ldexp(1.0, np.frexp(got)[1] - 9)  # bfloat16 keeps 8 significant bits
    assert (np.abs(got - exact) <= half_ulp).all(), np.abs(got - exact).max()


def test_bf16_norm_weight_gradient_sums_rows_in_float32():
    """The gradient of a bfloat16 RMSNorm weight, a sum over 8,192 rows, is the exact sum
    rounded once to bfloat16 (inputs of +-1, which normalise to +-1, and cotangents whose sums
    are exact in float32). A weight multiplied in bfloat16 had XLA sum the rows in bfloat16,
    rounding after every addition: up to 4.4 off (measured), where half a unit in the last
    place is at most 1. The values stay a bfloat16 product's."""
    rng = np.random.default_rng(0)
    N, D = 8192, 64
    w = jnp.asarray(1 + 0.1 * rng.normal(size=D), jnp.bfloat16)
    x = jnp.asarray(rng.normal(size=(N, D)), jnp.bfloat16)
    signs = jnp.asarray(rng.choice([-1.0, 1.0], (N, D)), jnp.bfloat16)
    g = _dyadic_cotangents(rng, (N, D))

    @jax.jit
    def norm_and_grads(x, signs, w, g):
        out = layers.rms_norm(x, w, 1e-6)
        x_normed = layers.rms_norm(x, jnp.ones_like(w), 1e-6)
        _, vjp = jax.vjp(lambda w: layers.rms_norm(signs, w, 1e-6), w)
        return out, x_normed, vjp(g)[0]

    out, x_normed, dw = norm_and_grads(x, signs, w, g)
    np.testing.assert_array_equal(out, jnp.broadcast_to(w, x.shape) * x_normed)
    assert dw.dtype == jnp.bfloat16
    exact = (np.asarray(g, np.float64) * np.asarray(signs, np.float64)).sum(0)
    _assert_rounded_once(dw, exact)


def test_bf16_embedding_gradient_sums_a_tokens_rows_in_float32():
    """`layers.embed`'s gradient: each table row gets the exact sum of its token's cotangents
    rounded once to bfloat16, with one token at half of 8,192 positions. `jnp.take`'s
    transpose scatter-adds in bfloat16, rounding after every addition: the busy token's row
    (sums near 2,000) came out up to 415.5 off (measured)."""
    rng = np.random.default_rng(1)
    N, V, D = 8192, 50, 64
    tokens = np.where(rng.random(N) < 0.5, 7, rng.integers(0, V, N)).astype(np.int32)
    table = jnp.asarray(rng.normal(size=(V, D)), jnp.bfloat16)
    g = _dyadic_cotangents(rng, (N, D))

    @jax.jit
    def lookup_and_grad(table, tokens, g):
        rows, vjp = jax.vjp(lambda t: layers.embed(t, tokens), table)
        return rows, vjp(g)[0]

    rows, grad = lookup_and_grad(table, tokens, g)
    np.testing.assert_array_equal(rows, np.asarray(table)[tokens])
    assert grad.dtype == jnp.bfloat16
    exact = np.zeros((V, D))
    np.add.at(exact, tokens, np.asarray(g, np.float64))
    _assert_rounded_once(grad, exact)
    f32_grad = jax.grad(lambda t: layers.embed(t, tokens).sum())(table.astype(jnp.float32))
    assert f32_grad.dtype == jnp.float32


def _plain_autodiff(monkeypatch):
    """The model with attention and the MLP activation under plain autodiff (no
    `layers.recompute_in_backward`)."""
    monkeypatch.setattr(layers, "recompute_in_backward", lambda fn: fn)
    monkeypatch.setattr(layers, "swiglu", lambda gate, up: jax.nn.silu(gate) * up)


def _scored_groups(vocab: int, N: int, G: int, P: int = 9, T: int = 24):
    """N left-padded prompts (the first padded by 3) of G responses each (row 1 ending at 15
    tokens) and a random weight per response token: what a GRPO-style log-prob loss scores."""
    rng = np.random.default_rng(0)
    prompt_mask = np.ones((N, P), bool)
    prompt_mask[0, :3] = False
    mask = np.ones((N * G, T), bool)
    mask[1, 15:] = False
    prompt = rng.integers(1, vocab, (N, P))
    tokens = rng.integers(1, vocab, (N * G, T))
    weights = jnp.asarray(rng.normal(size=(N * G, T)), jnp.float32)
    return prompt, prompt_mask, tokens, mask, weights


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_recomputing_backward_keeps_gradients_and_frees_memory(dtype, monkeypatch):
    """Attention and SwiGLU recompute their forward in the backward pass: the gradients of a
    GRPO-style log-prob loss are autodiff's, and XLA keeps less alive across the step: the
    recomputation is not merged back into the forward pass, as `jax.checkpoint`'s was.

    The recomputed softmax sums in other fusions, so a float32 gradient may differ in its last
    bits: measured up to 1.8 ulps of each leaf's largest element (float32; bfloat16: bitwise
    equal), allowed 8."""
    from ais_jax.train.logprobs import token_logprobs

    config = dataclasses.replace(QWEN3, num_layers=3)
    params = random_params(config)
    prompt, prompt_mask, tokens, mask, weights = _scored_groups(config.vocab_size, 3, 4)

    def loss(p):
        logp = token_logprobs(
            layers.cast_params(p, dtype), config, prompt, prompt_mask, tokens, mask
        )
        return (logp * weights).sum()

    def compiled():
        return jax.jit(jax.grad(loss)).lower(params).compile()

    recomputing = compiled()
    with monkeypatch.context() as m:
        _plain_autodiff(m)
        plain = compiled()
    temp = lambda c: c.memory_analysis().temp_size_in_bytes  # noqa: E731
    assert temp(recomputing) < 0.8 * temp(plain), (temp(recomputing), temp(plain))
    for got, want in zip(
        jax.tree_util.tree_leaves(recomputing(params)),
        jax.tree_util.tree_leaves(plain(params)),
        strict=True,
    ):
        ulp = 2.0**-23 * np.abs(want).max()  # float32's, at the leaf's largest element
        np.testing.assert_allclose(got, want, rtol=0, atol=8 * ulp)


def test_recompute_in_backward_is_the_function_and_its_vjp():
    """Values, and the vector-Jacobian products of every float input: equal to plain
    autodiff's and to their float64 formulas, for a function with an integer argument and a
    bfloat16 cotangent; integer and bool arguments get float0 cotangents."""

    def fn(x, y, n):
        return (jnp.sin(x) * y + n).astype(jnp.bfloat16)

    wrapped = layers.recompute_in_backward(fn)
    rng = np.random.default_rng(1)
    x, y = (jnp.asarray(rng.normal(size=(4, 5)), jnp.float32) for _ in range(2))
    n = jnp.arange(20, dtype=jnp.int32).reshape(4, 5)
    np.testing.assert_array_equal(wrapped(x, y, n), fn(x, y, n))
    g = jnp.asarray(rng.normal(size=(4, 5)), jnp.bfloat16)
    want = jax.vjp(fn, x, y, n)[1](g)
    got = jax.vjp(wrapped, x, y, n)[1](g)
    for a, b in zip(got[:2], want[:2], strict=True):
        np.testing.assert_array_equal(a, b)
    assert got[2].dtype == jax.dtypes.float0
    g64 = np.asarray(g, np.float64)
    np.testing.assert_allclose(got[0], g64 * np.cos(np.asarray(x, np.float64)) * y, rtol=1e-6)
    np.testing.assert_allclose(got[1], g64 * np.sin(np.asarray(x, np.float64)), rtol=1e-6)

    masked = layers.recompute_in_backward(lambda x, keep: jnp.where(keep, x * x, 0.0))
    keep = np.array([True, False, True])
    dx, dkeep = jax.vjp(masked, jnp.arange(3.0), keep)[1](jnp.ones(3))
    np.testing.assert_array_equal(dx, [0.0, 0.0, 4.0])
    assert dkeep.dtype == jax.dtypes.float0


@pytest.mark.slow
@pytest.mark.parametrize("group", [4, 1], ids=["shared-prompts", "own-prompts"])
def test_remat_recomputes_each_layer_with_the_same_gradients(group):
    """``remat=True`` (optim.remat): every decoder layer recomputes its activations in the
    backward pass, for rows that share their prompts (`qwen3.response_hidden`, one layer's
    prompt and response parts together) and for full rows (`qwen3._decoder`). The log-probs
    are the same; float32 gradients within 8 ulps of each leaf's largest element (measured
    up to 3.9: the recomputation sits in other fusions); bfloat16 gradients as close to the
    float32 ones as without remat (XLA may skip a bfloat16 rounding inside a fusion, so the
    recomputed activations can differ from the stored ones by a rounding: measured relative
    errors 0.89-1.02x those without); and less than 60% of the temporaries."""
    from ais_jax.train.logprobs import token_logprobs

    config = dataclasses.replace(QWEN3, num_layers=3)
    params = random_params(config)
    N = 12 // group
    prompt, prompt_mask, tokens, mask, weights = _scored_groups(config.vocab_size, N, group)

    def compiled(dtype, remat):
        def loss(p):
            logp = token_logprobs(
                layers.cast_params(p, dtype), config, prompt, prompt_mask, tokens, mask, remat=remat
            )
            return (logp * weights).sum()

        return jax.jit(jax.value_and_grad(loss)).lower(params).compile()

    runs = {(d, r): compiled(d, r) for d in (jnp.float32, jnp.bfloat16) for r in (False, True)}
    temp = lambda c: c.memory_analysis().temp_size_in_bytes  # noqa: E731
    for dtype in (jnp.float32, jnp.bfloat16):
        plain, remat = runs[dtype, False], runs[dtype, True]
        assert temp(remat) < 0.6 * temp(plain), (temp(remat), temp(plain))
    out = {k: (v, jax.tree_util.tree_leaves(g)) for k, c in runs.items() for v, g in [c(params)]}
    for dtype in (jnp.float32, jnp.bfloat16):
        assert out[dtype, True][0] == out[dtype, False][0]
    for got, want in zip(out[jnp.float32, True][1], out[jnp.float32, False][1], strict=True):
        ulp = 2.0**-23 * np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=0, atol=8 * ulp)

    def errors(remat):  # each leaf's bfloat16 gradient against the float32 one
        pairs = zip(out[jnp.bfloat16, remat][1], out[jnp.float32, False][1], strict=True)
        return np.array([np.linalg.norm(g - w) / np.linalg.norm(w) for g, w in pairs])

    assert errors(True).mean() <= 1.05 * errors(False).mean()
    assert errors(True).max() <= 1.1 * errors(False).max()


@pytest.mark.slow
def test_remat_of_qwen35_layers_moves_gradients_less_than_the_chunk_size_does():
    """Qwen3.5's hybrid layers under ``remat`` (`qwen35.forward`): the float32 gradients of
    its final hidden states move by less than another chunk size of its delta rule moves them
    (the same function, summed in another order: up to 109 ulps of a leaf's largest element
    at chunk 8 against 64; remat: 0 measured), and the temporaries fall below 60%."""
    from ais_jax.models import qwen35

    config = qwen35.Qwen35Config.tiny(vocab_size=96)
    params = qwen35.init_params(config, jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens, mask = left_padded(0, 12, 33, config.vocab_size, pads=(3,) + (0,) * 11)
    weights = jnp.asarray(rng.normal(size=(12, 33, config.hidden_size)), jnp.float32)

    def compiled(chunk_size, remat):
        def loss(p):
            hidden = qwen35.final_hidden(
                p, config, tokens, mask, chunk_size=chunk_size, remat=remat
            )
            return jnp.sum(hidden * weights)

        return jax.jit(jax.grad(loss)).lower(params).compile()

    runs = {k: compiled(*k) for k in ((64, False), (64, True), (8, False))}
    temp = lambda c: c.memory_analysis().temp_size_in_bytes  # noqa: E731
    assert temp(runs[64, True]) < 0.6 * temp(runs[64, False])
    grads = {k: jax.tree_util.tree_leaves(c(params)) for k, c in runs.items()}

    def moved(k):  # ulps of each leaf's largest element, the largest over the leaves
        pairs = zip(grads[k], grads[64, False], strict=True)
        return max(np.abs(g - w).max() / (2.0**-23 * max(np.abs(w).max(), 1e-30)) for g, w in pairs)

    assert moved((8, False)) > 8  # the yardstick is a rounding-level one, not zero
    assert moved((64, True)) <= moved((8, False))


# ---- real sizes without allocating --------------------------------------------------------------


def _leaf_count(tree) -> int:
    leaves = jax.tree_util.tree_leaves(tree)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves), "param_shapes allocated"
    return sum(int(np.prod(x.shape)) for x in leaves)


@pytest.mark.parametrize("name, published", [("qwen3-8b", 8.19e9), ("qwen3-0.6b", 0.596e9)])
def test_real_size_parameter_count(name, published):
    config = ModelConfig.preset(name)
    shapes = param_shapes(config)
    assert ("lm_head" in shapes) == (not config.tie_embeddings)
    L, HE, D = config.num_layers, config.num_heads * config.head_dim, config.hidden_size
    assert shapes["layers"]["q_proj"].shape == (L, HE, D)
    assert _leaf_count(shapes) == config.num_params
    assert abs(config.num_params - published) <= 0.01 * published
    print(f"{name}: {config.num_params / 1e9:.4f}B parameters")


@settings(max_examples=25, deadline=None)
@given(
    kv=st.integers(1, 4),
    group=st.integers(1, 3),
    half_e=st.integers(1, 8),
    d=st.integers(1, 64),
    f=st.integers(1, 64),
    layers=st.integers(1, 3),
    v=st.integers(1, 300),
    family=st.sampled_from(["qwen3", "qwen2"]),
    tied=st.booleans(),
)
def test_num_params_and_hf_dict_roundtrip(kv, group, half_e, d, f, layers, v, family, tied):
    """For any valid config: `num_params` is the size of the tree, and config.json round-trips."""
    config = ModelConfig(
        vocab_size=v,
        hidden_size=d,
        num_layers=layers,
        num_heads=kv * group,
        num_kv_heads=kv,
        head_dim=2 * half_e,
        intermediate_size=f,
        tie_embeddings=tied,
        qk_norm=family == "qwen3",
        attention_bias=family == "qwen2",
        rope_theta=12_345.0,
    )
    assert _leaf_count(param_shapes(config)) == config.num_params
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config


@pytest.mark.parametrize("key", sorted(PRESETS))
def test_presets_are_consistent(key):
    config = ModelConfig.preset(key)
    assert _leaf_count(param_shapes(config)) == config.num_params
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config


# ---- config validation --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            dict(num_heads=6, num_kv_heads=4),
            r"num_heads \(6\) must be a multiple of num_kv_heads \(4",
        ),
        (dict(head_dim=15), r"head_dim must be even.*15"),
        (dict(hidden_size=0), r"hidden_size must be a positive integer, got 0"),
        (dict(vocab_size=-3), r"vocab_size must be a positive integer, got -3"),
        (dict(num_layers=0), r"num_layers must be a positive integer"),
        (dict(num_kv_heads=0), r"num_kv_heads must be a positive integer"),
        (dict(intermediate_size=2.5), r"intermediate_size must be a positive integer, got 2.5"),
        (dict(head_dim=True), r"head_dim must be a positive integer, got True"),
        (dict(rope_theta=0.0), r"rope_theta must be > 0"),
        (dict(rms_norm_eps=-1e-6), r"rms_norm_eps must be > 0"),
    ],
)
def test_config_validation_names_the_field(overrides, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.preset("tiny", **overrides)


def test_presets_by_name():
    assert ModelConfig.preset("qwen3-8b") == ModelConfig.qwen3_8b()
    assert ModelConfig.preset("Qwen3-0.6B") == ModelConfig.qwen3_0p6b()
    assert ModelConfig.preset("tiny", vocab_size=77).vocab_size == 77
    with pytest.raises(ValueError, match=r"Unknown model preset .qwen9-1t.*qwen3-8b.*tiny"):
        ModelConfig.preset("qwen9-1t")
