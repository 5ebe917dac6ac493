"""`diffusion_sampler.py`: LLaDA's generation against a plain re-implementation, and diffu-GRPO's
one-step log-prob estimator.

`reference_generate` is LLaDA's ``generate`` written out in NumPy and Python loops (per-row
``get_num_transfer_tokens``, per-row top-k of the confidences, the whole sequence re-predicted
at every step), calling the jitted `llada.forward` for the logits and drawing its noise with the
sampler's documented keys (`step_keys`), so that sampled runs are compared token for token too.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import count_compiles

from ais_jax.models import llada
from ais_jax.models.llada import LLaDAConfig
from ais_jax.nn.quant import quantize_fp8
from ais_jax.rollout import diffusion as ds
from ais_jax.rollout.sampler import pad_prompts

CONFIG = LLaDAConfig(
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=64,
    rope_theta=10_000.0,
    mask_token_id=63,
    eos_token_id=62,
    pad_token_id=61,
    max_position_embeddings=128,
)
PROMPTS = [[5, 9, 13, 2, 7, 30, 4], [11, 3, 40], [20, 21, 22, 23, 24]]
KEY = jax.random.key(7)
_forward = jax.jit(llada.forward, static_argnums=1)
_logp = jax.jit(ds.one_step_logp, static_argnums=1)


@pytest.fixture(scope="module")
def params():
    """Matrices N(0, 1/fan_in), the embedding N(0, 1), norms 1 + N(0, 0.2^2) (float32)."""
    rng = np.random.default_rng(0)
    shapes = jax.eval_shape(lambda k: llada.init_params(CONFIG, k), KEY)

    def draw(path, leaf):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            return jnp.asarray(1.0 + 0.2 * rng.standard_normal(leaf.shape), jnp.float32)
        std = 1.0 if "embed" in name else leaf.shape[-1] ** -0.5
        return jnp.asarray(std * rng.standard_normal(leaf.shape), jnp.float32)

    return jax.tree_util.tree_map_with_path(draw, shapes)


def get_num_transfer_tokens(block_masked_BT: np.ndarray, steps: int) -> np.ndarray:
    """LLaDA's: per row, ``masked // steps`` per step, the first ``masked % steps`` steps +1."""
    masked_B = block_masked_BT.sum(-1)
    counts = np.zeros((len(masked_B), steps), np.int64) + (masked_B // steps)[:, None]
    for b, extra in enumerate(masked_B % steps):
        counts[b, :extra] += 1
    return counts


def reference_generate(params, prompts, key, gen_length, block_length, steps, temperature, remask):
    """LLaDA's ``generate`` (low_confidence / random remasking), step by step in NumPy."""
    mask_id, V = CONFIG.mask_token_id, CONFIG.vocab_size
    prompt_BP, prompt_mask_BP = pad_prompts(prompts, CONFIG.pad_token_id)
    B, P = prompt_BP.shape
    T = gen_length
    x = np.concatenate([prompt_BP, np.full((B, T), mask_id, np.int32)], axis=1)
    valid = np.concatenate([prompt_mask_BP, np.ones((B, T), bool)], axis=1)
    in_response = np.arange(P + T) >= P
    num_blocks = gen_length // block_length
    steps_per_block = steps // num_blocks
    for block in range(num_blocks):
        end = P + (block + 1) * block_length
        counts = get_num_transfer_tokens(x[:, end - block_length : end] == mask_id, steps_per_block)
        for i in range(steps_per_block):
            masked = (x == mask_id) & in_response
            logits = np.asarray(_forward(params, CONFIG, jnp.asarray(x), jnp.asarray(valid)))
            gumbel_key, remask_key = ds.step_keys(key, block * steps_per_block + i)
            noise = np.zeros(logits.shape, np.float32)
            noise[:, P:] = np.asarray(jax.random.gumbel(gumbel_key, (B, T, V), jnp.float32))
            noisy = logits + np.float32(temperature) * noise
            noisy[..., mask_id] = -np.inf  # the one deviation from LLaDA (sampler docstring)
            x0 = np.argmax(noisy, axis=-1)
            if remask == "low_confidence":
                z = logits.astype(np.float64)
                p = np.exp(z - z.max(-1, keepdims=True))
                p /= p.sum(-1, keepdims=True)
                x0_p = np.take_along_axis(p, x0[..., None], axis=-1)[..., 0]
            else:
                x0_p = np.zeros((B, P + T))
                x0_p[:, P:] = np.asarray(jax.random.uniform(remask_key, (B, T), jnp.float32))
            x0_p[:, end:] = -np.inf
            x0 = np.where(masked, x0, x)
            confidence = np.where(masked, x0_p, -np.inf)
            for b in range(B):
                chosen = np.argsort(-confidence[b], kind="stable")[: counts[b, i]]
                x[b, chosen] = x0[b, chosen]
    assert not (x[:, P:] == mask_id).any()
    return x[:, P:]


def cut(raw_BT: np.ndarray, eos: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
    tokens, mask = raw_BT.copy(), np.ones(raw_BT.shape, bool)
    for b, row in enumerate(raw_BT):
        hits = np.flatnonzero(row == eos)
        if hits.size:
            mask[b, hits[0] + 1 :] = False
            tokens[b, hits[0] + 1 :] = pad
    return tokens, mask


LOGP_KEY = jax.random.key(8)
SHAPE = (16, 8, 6)  # gen_length, block_length, steps: 2 blocks, 3 steps per block


def run(params, shape, temperature=0.0, remasking="low_confidence", prompts=PROMPTS, **kw):
    """`generate` sampling with KEY (its estimator on LOGP_KEY); no EOS cut unless asked."""
    gen_length, block_length, steps = shape
    kw.setdefault("eos_ids", ())
    return ds.generate(
        params,
        CONFIG,
        prompts,
        KEY,
        gen_length=gen_length,
        block_length=block_length,
        steps=steps,
        temperature=temperature,
        remasking=remasking,
        logp_key=LOGP_KEY,
        **kw,
    )


# ---- generation -------------------------------------------------------------------------------


@pytest.mark.slow
def test_greedy_is_llada_generate(params):
    """Temperature 0, low-confidence remasking: token for token LLaDA's algorithm (two blocks
    of 8 tokens, 3 steps each transferring 3, 3, 2: `get_num_transfer_tokens`'s remainder)."""
    shape = SHAPE
    for block, steps in ((8, 3), (12, 5), (4, 4), (7, 1)):
        np.testing.assert_array_equal(
            ds.transfer_schedule(block, steps),
            get_num_transfer_tokens(np.ones((1, block), bool), steps)[0],
        )
    r = run(params, shape)
    ref = reference_generate(params, PROMPTS, KEY, *shape, 0.0, "low_confidence")
    np.testing.assert_array_equal(np.asarray(r.tokens), ref)
    assert bool(r.mask.all()) and not bool(r.finished.any())
    np.testing.assert_array_equal(r.lengths, shape[0])
    # a different sampling key changes nothing at temperature 0
    other = ds.generate(
        params,
        CONFIG,
        PROMPTS,
        jax.random.key(99),
        gen_length=shape[0],
        block_length=shape[1],
        steps=shape[2],
        eos_ids=(),
    )
    np.testing.assert_array_equal(other.tokens, r.tokens)


@pytest.mark.slow
def test_sampling_options_do_not_recompile(params):
    """temperature and the remasking choice are runtime values: one compiled program for all
    four combinations, each token for token the reference with the same noise."""
    shape = SHAPE
    run(params, shape)
    seen = []
    with count_compiles("generate_arrays") as compiles:
        for temperature, remasking in [(0.8, "low_confidence"), (0.0, "random"), (1.5, "random")]:
            r = run(params, shape, temperature, remasking, p_mask_prompt=0.3)
            ref = reference_generate(params, PROMPTS, KEY, *shape, temperature, remasking)
            np.testing.assert_array_equal(
                np.asarray(r.tokens), ref, err_msg=f"{temperature, remasking}"
            )
            seen.append(ref)
    assert compiles == []
    greedy = reference_generate(params, PROMPTS, KEY, *shape, 0.0, "low_confidence")
    assert all((s != greedy).any() for s in seen)  # each option changed the result


@pytest.mark.slow
def test_rows_do_not_depend_on_padding_or_batch_mates(params):
    """Greedy: permuting the rows permutes the rollouts. Greedy and sampled: more left padding
    (same batch, so the same noise) changes no token."""
    shape = SHAPE
    batch = run(params, shape)
    order = [2, 0, 1]
    permuted = run(params, shape, prompts=[PROMPTS[b] for b in order])
    np.testing.assert_array_equal(permuted.tokens, np.asarray(batch.tokens)[order])
    tokens, mask = pad_prompts(PROMPTS, CONFIG.pad_token_id, length=10)
    for temperature, remasking in [(0.0, "low_confidence"), (0.9, "random")]:
        short = run(params, shape, temperature, remasking)
        long = run(params, shape, temperature, remasking, prompts=tokens, prompt_mask=mask)
        np.testing.assert_array_equal(long.tokens, short.tokens)


@pytest.mark.slow
def test_text_is_cut_at_the_first_eos(params):
    """LLaDA fills all T positions; the rollout keeps each row up to its first EOS id."""
    shape = SHAPE
    raw = np.asarray(run(params, shape).tokens)
    # an id that first appears mid-row in row 0 and never in row 1: a row that ends, one that
    # does not
    eos = next(int(v) for v in raw[0, 3:12] if v not in raw[1] and v not in raw[0, :3])
    r = run(params, shape, eos_ids=(eos, 60), pad_id=CONFIG.pad_token_id)
    tokens, mask = cut(np.where(raw == 60, eos, raw), eos, CONFIG.pad_token_id)
    np.testing.assert_array_equal(r.mask, mask)
    np.testing.assert_array_equal(np.where(mask, r.tokens, -1), np.where(mask, raw, -1))
    np.testing.assert_array_equal(np.asarray(r.tokens)[~mask], CONFIG.pad_token_id)
    np.testing.assert_array_equal(r.lengths, mask.sum(-1))
    np.testing.assert_array_equal(r.finished, (raw == eos).any(-1) | (raw == 60).any(-1))
    assert bool(r.finished[0]) and not bool(r.mask[0].all())
    assert np.all(np.asarray(r.logp)[~mask] == 0.0)


@pytest.mark.slow
def test_fp8_rollout_runs_through_the_same_linear(params):
    """FP8 W8A8 params (`quantize_fp8`) generate with the same code; the rollout's logp is
    `one_step_logp` of those params on its ``logp_key``."""
    fp8 = quantize_fp8(params)
    r = run(fp8, SHAPE, 0.7)
    tokens = np.asarray(r.tokens)
    assert tokens.min() >= 0 and tokens.max() < CONFIG.vocab_size
    assert not (tokens == CONFIG.mask_token_id).any()
    direct = _logp(fp8, CONFIG, r.prompt_tokens, r.prompt_mask, r.tokens, r.mask, r.logp_key, 0.15)
    np.testing.assert_array_equal(r.logp, direct)  # bitwise, on CPU
    np.testing.assert_array_equal(r.logp_plain, r.logp)


@pytest.mark.slow
def test_fp8_codes_are_widened_once_before_the_loop(params, monkeypatch):
    """On CPU the denoising loop reads the FP8 codes as bfloat16 (`quant.widen_codes`, once
    before the loop): its program holds fewer one-layer FP8 weights (``[1, O, I]`` slices)
    than with the codes as stored (only `one_step_logp` after the loop still reads them), and
    the rollout is the stored codes' one: the same tokens, the same log-probs bit for bit
    (computed from the params as given)."""
    fp8 = quantize_fp8(params)
    prompts, prompt_mask = map(jnp.asarray, pad_prompts(PROMPTS, CONFIG.pad_token_id))
    gen_length, block_length, steps = SHAPE
    static = dict(gen_length=gen_length, block_length=block_length, steps=steps, eos_ids=())
    args = (prompts, prompt_mask, KEY, LOGP_KEY, jnp.float32(0.7), jnp.int32(0), jnp.float32(0.15))
    O, I = fp8["layers"]["gate_proj"].shape[1:]

    def run():  # a function of its own each time: traced with the widening as it is now
        fn = jax.jit(
            lambda p, *a: ds.generate_arrays.__wrapped__(p, CONFIG, *a, **static, pad_id=0)
        )
        hlo = fn.lower(fp8, *args).compile().as_text()
        return fn(fp8, *args), len(re.findall(rf"f8e4m3fn\[(?:1,)?{O},{I}\]", hlo))

    wide, wide_f8 = run()
    monkeypatch.setattr(ds, "widen_tree_codes", lambda tree: tree)
    stored, stored_f8 = run()
    assert wide_f8 < stored_f8, (wide_f8, stored_f8)
    for name in ("tokens", "mask", "logp", "finished"):
        np.testing.assert_array_equal(getattr(wide, name), getattr(stored, name))


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(gen_length=16, block_length=5, steps=8), "block_length"),
        (dict(gen_length=16, block_length=8, steps=3), "steps"),
        (dict(gen_length=16, block_length=8, steps=32), "steps"),
        (dict(gen_length=16, block_length=8, steps=8, remasking="top_p"), "remasking"),
        (dict(gen_length=16, block_length=8, steps=8, temperature=-1.0), "temperature"),
        (dict(gen_length=128, block_length=8, steps=16), "max_position_embeddings"),
    ],
)
def test_bad_arguments_raise_naming_the_value(params, kwargs, named):
    with pytest.raises(ValueError, match=named):
        ds.generate(params, CONFIG, PROMPTS, KEY, **kwargs)


# ---- the one-step estimator --------------------------------------------------------------------


def response(params):
    """A sampled rollout, its rows cut at lengths 16, 11 and 5 (padding after)."""
    r = run(params, SHAPE, 0.9)
    mask = np.arange(16)[None] < np.array([[16], [11], [5]])
    tokens = np.where(mask, r.tokens, CONFIG.pad_token_id)
    return r.prompt_tokens, r.prompt_mask, jnp.asarray(tokens), jnp.asarray(mask)


def test_estimator_is_one_forward_on_the_masked_input(params):
    """The mask: valid prompt tokens at rate p, never padding, a function of the key alone;
    the log-probs: log_softmax of one forward on (masked prompt, T x [MASK]) at the tokens."""
    prompt, prompt_mask, tokens, mask = response(params)
    key = jax.random.key(3)
    hidden = np.asarray(ds.masked_prompt(key, prompt_mask, 0.5))
    assert hidden.any() and not hidden[~np.asarray(prompt_mask)].any()
    B, P = prompt.shape
    T = tokens.shape[1]
    z = np.concatenate([np.where(hidden, CONFIG.mask_token_id, prompt), np.full((B, T), 63)], 1)
    valid = np.concatenate([prompt_mask, np.ones((B, T), bool)], 1)
    logits = np.asarray(_forward(params, CONFIG, jnp.asarray(z), jnp.asarray(valid)))[:, P:]
    logits = logits.astype(np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    want = np.take_along_axis(logits, np.asarray(tokens)[..., None], -1)[..., 0] - logz
    got = _logp(params, CONFIG, prompt, prompt_mask, tokens, mask, key, 0.5)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, np.where(mask, want, 0.0), rtol=0, atol=2e-5)
    # the rate, over many rows; p = 0 masks nothing
    many = jnp.ones((4000, 8), bool)
    rate = float(ds.masked_prompt(jax.random.key(4), many, 0.15).mean())
    assert abs(rate - 0.15) < 0.01, rate
    assert not bool(ds.masked_prompt(key, many, 0.0).any())


@pytest.mark.slow
def test_same_weights_and_key_give_a_ratio_of_exactly_one(params):
    """logp_rollout and logp_train on the same key with identical weights and precision:
    exp(logp_train - logp_rollout) == 1 bitwise, BF16 and FP8 alike; a new key is a new mask
    (and new log-probs)."""
    prompt, prompt_mask, tokens, mask = response(params)
    key = jax.random.key(5)
    for p in (jax.tree.map(lambda a: a.astype(jnp.bfloat16), params), quantize_fp8(params)):
        copy = jax.tree.map(jnp.copy, p)
        rollout = _logp(p, CONFIG, prompt, prompt_mask, tokens, mask, key, 0.15)
        train = _logp(copy, CONFIG, prompt, prompt_mask, tokens, mask, key, 0.15)
        np.testing.assert_array_equal(np.exp(np.asarray(train) - np.asarray(rollout)), 1.0)
        again = _logp(copy, CONFIG, prompt, prompt_mask, tokens, mask, jax.random.key(6), 0.15)
        assert (np.asarray(again) != np.asarray(rollout))[np.asarray(mask)].any()
    masks = [ds.masked_prompt(jax.random.key(k), prompt_mask, 0.15) for k in (5, 6)]
    assert (np.asarray(masks[0]) != np.asarray(masks[1])).any()
    np.testing.assert_array_equal(masks[0], ds.masked_prompt(key, prompt_mask, 0.15))


@pytest.mark.slow
def test_fp8_versus_bf16_on_the_same_mask_is_a_small_mismatch(params):
    """FP8 rollout params vs the BF16 trainer's on one key: the log-ratio is the precision
    mismatch alone: nonzero, small (mean |dlogp| is printed)."""
    prompt, prompt_mask, tokens, mask = response(params)
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    key = jax.random.key(9)
    train = np.asarray(_logp(bf16, CONFIG, prompt, prompt_mask, tokens, mask, key, 0.15))
    rollout = np.asarray(
        _logp(quantize_fp8(bf16), CONFIG, prompt, prompt_mask, tokens, mask, key, 0.15)
    )
    valid = np.asarray(mask)
    dlogp = np.abs(train - rollout)[valid]
    print(f"FP8 vs BF16 one-step logp: mean |dlogp| {dlogp.mean():.4f}, max {dlogp.max():.4f}")
    assert 1e-4 < dlogp.mean() < 0.2
    assert np.all(train[~valid] == 0) and np.all(rollout[~valid] == 0)
