"""`diffusion_train.py`: LLaDA's masked-diffusion SFT loss against a NumPy float64 reference,
its special cases (t = 1, padding), and a jitted AdamW step that learns a fixed batch.

`reference_loss` rebuilds the corrupted input from the module's documented draws (``t_key,
mask_key = split(key)``), calls the jitted `llada.forward` for float32 logits and does every
later step (log-softmax, 1/p weights, per-row answer lengths, mean over rows) in float64 NumPy,
written the way LLaDA's GUIDELINES.md writes its SFT loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ais_jax.models import llada
from ais_jax.models.llada import LLaDAConfig
from ais_jax.train import diffusion as dt

CONFIG = LLaDAConfig(
    vocab_size=48,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=64,
    rope_theta=10_000.0,
    mask_token_id=47,
    eos_token_id=46,
    pad_token_id=45,
    max_position_embeddings=64,
)
MASK, PAD = CONFIG.mask_token_id, CONFIG.pad_token_id
KEY = jax.random.key(3)
_forward = jax.jit(llada.forward, static_argnums=1)
_loss = jax.jit(dt.sft_loss, static_argnums=1)
_loss_and_grad = jax.jit(jax.value_and_grad(lambda p, b, k: dt.sft_loss(p, CONFIG, b, k)[0]))


@pytest.fixture(scope="module")
def params():
    """Matrices N(0, 1/fan_in), the embedding N(0, 1), norms 1 (float32): logits far from
    uniform, so the cross-entropies differ by token."""
    rng = np.random.default_rng(0)
    shapes = jax.eval_shape(lambda k: llada.init_params(CONFIG, k), KEY)

    def draw(path, leaf):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            return jnp.ones(leaf.shape, jnp.float32)
        std = 1.0 if "embed" in name else leaf.shape[-1] ** -0.5
        return jnp.asarray(std * rng.standard_normal(leaf.shape), jnp.float32)

    return jax.tree_util.tree_map_with_path(draw, shapes)


def make_batch(prompts, responses, P=None, T=None, junk=None):
    """Left-padded prompts, right-padded responses; padding ids are ``junk`` (default PAD)."""
    B = len(prompts)
    P = P or max(map(len, prompts))
    T = T or max(map(len, responses))
    fill = PAD if junk is None else junk
    batch = {
        "prompt_tokens": np.full((B, P), fill, np.int32),
        "prompt_mask": np.zeros((B, P), bool),
        "tokens": np.full((B, T), fill, np.int32),
        "mask": np.zeros((B, T), bool),
    }
    for b, (x, y) in enumerate(zip(prompts, responses, strict=True)):
        batch["prompt_tokens"][b, P - len(x) :] = x
        batch["prompt_mask"][b, P - len(x) :] = True
        batch["tokens"][b, : len(y)] = y
        batch["mask"][b, : len(y)] = True
    return batch


PROMPTS = [[5, 9, 13, 2, 7], [11, 3], [20, 21, 22]]
RESPONSES = [[30, 31, 4, 8, 46, 46], [12, 40, 41], [1, 2, 3, 17, 46]]
BATCH = make_batch(PROMPTS, RESPONSES)


def reference_loss(params, batch, key, eps=1e-3, t_B=None):
    """LLaDA's SFT loss in float64: ``sum(ce / p / answer_length) / rows``; also the mask."""
    prompt, prompt_mask = batch["prompt_tokens"], batch["prompt_mask"]
    tokens, valid = batch["tokens"], batch["mask"]
    B, P = prompt.shape
    T = tokens.shape[1]
    t_key, mask_key = jax.random.split(key)
    t = np.asarray(jax.random.uniform(t_key, (B,)), np.float64) if t_B is None else t_B
    p_mask = (1 - eps) * np.asarray(t, np.float64)
    p_mask = p_mask + eps
    u = np.asarray(jax.random.uniform(mask_key, (B, T)))
    masked = valid & (u < p_mask.astype(np.float32)[:, None])
    noisy = np.where(masked, MASK, np.where(valid, tokens, PAD))
    inputs = np.concatenate([np.where(prompt_mask, prompt, PAD), noisy], axis=1)
    logits = np.asarray(_forward(params, CONFIG, inputs, np.concatenate([prompt_mask, valid], 1)))
    logits = logits[:, P:].astype(np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    answer_lengths = valid.sum(-1)
    total, rows = 0.0, 0
    for b in range(B):
        if answer_lengths[b] == 0:
            continue
        rows += 1
        for i in np.flatnonzero(masked[b]):
            total += -logp[b, i, tokens[b, i]] / p_mask[b] / answer_lengths[b]
    return total / max(rows, 1), masked, logp


@pytest.mark.slow
def test_loss_equals_the_float64_reference(params):
    loss, metrics = _loss(params, CONFIG, BATCH, KEY)
    ref, masked, logp = reference_loss(params, BATCH, KEY)
    assert 0 < masked.sum() < BATCH["mask"].sum()  # some response tokens masked, not all
    assert loss.dtype == jnp.float32 and all(v.dtype == jnp.float32 for v in metrics.values())
    np.testing.assert_allclose(float(loss), ref, rtol=2e-6)
    assert float(metrics["loss"]) == float(loss)
    np.testing.assert_allclose(float(metrics["masked_fraction"]), masked.sum() / 14, rtol=1e-6)
    ce = -np.take_along_axis(logp, BATCH["tokens"][..., None], -1)[..., 0][masked]
    np.testing.assert_allclose(float(metrics["masked_ce"]), ce.mean(), rtol=2e-6)
    assert float(metrics["response_tokens"]) == 14
    # another key: other masks, other loss, still the reference
    other = jax.random.key(11)
    np.testing.assert_allclose(
        float(_loss(params, CONFIG, BATCH, other)[0]),
        reference_loss(params, BATCH, other)[0],
        rtol=2e-6,
    )
    assert float(_loss(params, CONFIG, BATCH, other)[0]) != float(loss)


@pytest.mark.slow
def test_gradient_is_finite_and_nonzero(params):
    loss, grads = _loss_and_grad(params, BATCH, KEY)
    assert float(loss) == float(_loss(params, CONFIG, BATCH, KEY)[0])
    leaves = jax.tree.leaves(grads)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
    assert all(g.dtype == jnp.float32 for g in leaves)
    assert float(optax.tree_utils.tree_norm(grads)) > 1e-3


def test_t_one_masks_every_response_token_and_gives_the_mean_ce(params):
    ones = jnp.ones(3, jnp.float32)
    loss, metrics = _loss(params, CONFIG, BATCH, KEY, t_B=ones)
    assert float(metrics["masked_fraction"]) == 1.0 and float(metrics["p_mask"]) == 1.0
    # the plain mean CE of a fully masked response, per row, averaged over rows (float64)
    P = BATCH["prompt_tokens"].shape[1]
    inputs = np.concatenate(
        [np.where(BATCH["prompt_mask"], BATCH["prompt_tokens"], PAD), np.full((3, 6), MASK)], 1
    )
    valid_BS = np.concatenate([BATCH["prompt_mask"], BATCH["mask"]], 1)
    logits = np.asarray(_forward(params, CONFIG, inputs, valid_BS))[:, P:].astype(np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    row_means = [-np.mean([logp[b, i, y] for i, y in enumerate(RESPONSES[b])]) for b in range(3)]
    np.testing.assert_allclose(float(loss), np.mean(row_means), rtol=2e-6)
    np.testing.assert_allclose(
        float(metrics["masked_ce"]),
        np.mean(
            np.concatenate([[-logp[b, i, y] for i, y in enumerate(RESPONSES[b])] for b in range(3)])
        ),
        rtol=2e-6,
    )


@pytest.mark.slow
def test_padding_contributes_nothing(params):
    # same shapes, other ids under the padding: identical loss and gradient for any key
    junk = make_batch(PROMPTS, RESPONSES, junk=44)
    loss, grads = _loss_and_grad(params, BATCH, KEY)
    junk_loss, junk_grads = _loss_and_grad(params, junk, KEY)
    assert float(junk_loss) == float(loss)
    jax.tree.map(np.testing.assert_array_equal, grads, junk_grads)
    # with t = 1 (no randomness): more left padding, more right padding and an empty row
    wider = make_batch([*PROMPTS, [7]], [*RESPONSES, []], P=8, T=9, junk=44)
    t1 = jnp.ones(3, jnp.float32)
    base = float(_loss(params, CONFIG, BATCH, KEY, t_B=t1)[0])
    loss, metrics = _loss(params, CONFIG, wider, KEY, t_B=jnp.ones(4, jnp.float32))
    np.testing.assert_allclose(float(loss), base, rtol=1e-6)
    assert float(metrics["response_tokens"]) == 14


def test_errors_name_the_value(params):
    with pytest.raises(ValueError, match=r"missing \['mask'\]"):
        dt.sft_loss(params, CONFIG, {k: v for k, v in BATCH.items() if k != "mask"}, KEY)
    with pytest.raises(ValueError, match=r"eps must be in \(0, 1\).*got 0"):
        dt.sft_loss(params, CONFIG, BATCH, KEY, eps=0)


@pytest.mark.slow
def test_thirty_adamw_steps_learn_a_fixed_batch(params):
    """A learning check: the fully masked (t = 1) loss on the batch, a deterministic measure,
    falls by more than half after 30 steps with new masks each step."""
    step = dt.make_sft_step(CONFIG, dt.sft_optimizer(1e-2, weight_decay=0.0))
    opt_state = dt.sft_optimizer(1e-2, weight_decay=0.0).init(params)
    t1 = jnp.ones(3, jnp.float32)
    before = float(_loss(params, CONFIG, BATCH, KEY, t_B=t1)[0])
    p, losses = params, []
    for i in range(30):
        p, opt_state, metrics = step(p, opt_state, BATCH, jax.random.fold_in(KEY, i))
        assert np.isfinite(float(metrics["grad_norm"]))
        losses.append(float(metrics["loss"]))
    after = float(_loss(p, CONFIG, BATCH, KEY, t_B=t1)[0])
    assert after < 0.5 * before, (before, after, losses)
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses
    assert params["embed"].dtype == p["embed"].dtype == jnp.float32
