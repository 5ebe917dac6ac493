"""Specification of `qwen35.py` (Qwen3.5: Gated DeltaNet + gated attention) and its checkpoints.

* Parity with `transformers`' `Qwen3_5ForCausalLM` (float32, CPU) on random-weight checkpoints,
  LEFT-PADDED batches with explicit ``position_ids = max(cumsum(mask) - 1, 0)``, valid positions
  compared at levanter's ``|ours - ref| <= 1e-4 * max(1, |ref|)``, for three configurations
  (layer patterns, head counts, conv taps, partial-rotary factors, tied and untied).
* The chunked delta rule equals the token-by-token recurrence in float32 to ``1e-5 * max(1,
  |ref|)``: both are the same sums in another order and the unit-triangular system's entries
  are bounded (|k_i.k_j| <= 1 for L2-normalised keys, beta < 1, decays <= 1), so the two differ
  by a few float32 roundings (measured <= 1.1e-6 on 200 correlated keys with beta ~ 1 and slow
  decay, the worst case for the solve); gradients are checked in float64 against finite
  differences and against the recurrence's.
* Decoding state: stepping a linear-attention layer token by token (`linear_attention_step`)
  from a chunked prefill's state equals the chunked layer over the whole sequence; masked rows
  leave both states bitwise untouched.
* Checkpoints: `load_hf` reads the text and the multimodal layouts; `save_hf` writes what
  transformers loads, and a save/load round trip is bitwise; `ais-jax sample` samples one.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

from ais_jax.io.hf import CheckpointError, load_hf, save_hf
from ais_jax.models import qwen35
from ais_jax.nn.layers import cast_params
from ais_jax.nn.quant import QArray

_forward = jax.jit(qwen35.forward, static_argnums=1, static_argnames="chunk_size")
LIN, FULL = "linear_attention", "full_attention"

# Each case: a Qwen3_5TextConfig's fields, and the chunk size our forward uses on it (small
# chunks so the 20-token batch spans several).
BASE = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
)
CASES = {
    "lin3-full1-untied-gva2-k4": (
        dict(num_hidden_layers=4, layer_types=[LIN, LIN, LIN, FULL], tie_word_embeddings=False),
        64,
    ),
    "full-lin-lin-tied-mqa-k3-rot0.5": (
        dict(
            num_hidden_layers=3,
            layer_types=[FULL, LIN, LIN],
            tie_word_embeddings=True,
            num_attention_heads=2,
            num_key_value_heads=1,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=3,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e6,
                "partial_rotary_factor": 0.5,
            },
        ),
        8,
    ),
    "lin-full-lin-untied-gva3-k2-rot1": (
        dict(
            num_hidden_layers=3,
            layer_types=[LIN, FULL, LIN],
            tie_word_embeddings=False,
            hidden_size=48,
            num_attention_heads=6,
            num_key_value_heads=3,
            head_dim=8,
            linear_num_key_heads=1,
            linear_num_value_heads=3,
            linear_key_head_dim=12,
            linear_value_head_dim=4,
            linear_conv_kernel_dim=2,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5e5,
                "partial_rotary_factor": 1.0,
            },
        ),
        4,
    ),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Random weights that give O(1) logits (as conftest.py's for Qwen3): matrices and the
    zero-centred norms 0.2 N(0, 1), the gated norm 1 + 0.2 N(0, 1), conv taps 0.5 N(0, 1),
    ``A = exp(a_log)`` in [0.05, 1] so decays span fast and slow."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("A_log"):
                p.copy_(torch.log(0.05 + 0.95 * torch.rand(p.shape, generator=gen)))
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("conv1d.weight"):
                p.copy_(0.5 * noise)
            else:
                p.copy_(0.2 * noise)


@functools.lru_cache(maxsize=4)
def _checkpoint(case: str, root: str) -> str:
    fields, _ = CASES[case]
    config = transformers.Qwen3_5TextConfig(**(BASE | fields))
    model = transformers.Qwen3_5ForCausalLM(config).to(torch.float32)
    _randomize(model, seed=len(case))
    folder = f"{root}/{case}"
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("qwen35"))
    return lambda case: _checkpoint(case, root)


@functools.lru_cache(maxsize=4)
def _hf_model(path: str):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def left_padded(vocab: int, seed: int = 0, pads=(0, 5, 11), seq: int = 20):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (len(pads), seq))
    return tokens, np.arange(seq)[None] >= np.asarray(pads)[:, None]


def hf_logits(path, tokens, mask) -> np.ndarray:
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        out = _hf_model(str(path))(
            input_ids=torch.as_tensor(tokens),
            attention_mask=torch.as_tensor(mask.astype(np.int64)),
            position_ids=torch.as_tensor(positions),
        )
    return out.logits.float().numpy()


def assert_close(ours, ref, where, rtol=1e-4) -> float:
    """|ours - ref| <= rtol * max(1, |ref|) on the positions ``where``; returns max |diff|."""
    ours, ref = np.asarray(ours)[np.asarray(where)], np.asarray(ref)[np.asarray(where)]
    assert np.isfinite(ours).all()
    diff = np.abs(ours - ref)
    worst = np.argmax(diff - rtol * np.maximum(1.0, np.abs(ref)))
    assert diff.flat[worst] <= rtol * max(1.0, abs(ref.flat[worst])), (
        f"max |diff| {diff.max():.3g} (ref {ref.flat[worst]:.3g}) exceeds {rtol} * max(1, |ref|)"
    )
    return float(diff.max())


# ---- parity with transformers -------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_float32_parity_on_left_padded_batch(checkpoint, case):
    path = checkpoint(case)
    config, params = load_hf(path, dtype=jnp.float32)
    assert isinstance(config, qwen35.Qwen35Config)
    assert config.layer_types == tuple(CASES[case][0]["layer_types"])
    tokens, mask = left_padded(config.vocab_size)
    ref = hf_logits(path, tokens, mask)
    assert 0.3 < np.abs(ref[mask]).mean() < 5, "random weights must give O(1) logits"
    ours = _forward(
        params, config, jnp.asarray(tokens), jnp.asarray(mask), chunk_size=CASES[case][1]
    )
    assert_close(ours, ref, mask)


@pytest.mark.slow
def test_save_hf_loads_in_transformers_and_round_trips_bitwise(checkpoint, tmp_path):
    case = "full-lin-lin-tied-mqa-k3-rot0.5"
    config, params = load_hf(checkpoint(case), dtype=jnp.float32)
    out = save_hf(tmp_path / "saved", config, params, max_shard_bytes=20_000)  # sharded
    assert (out / "model.safetensors.index.json").is_file()
    config2, params2 = load_hf(out, dtype=jnp.float32)
    assert config2 == config
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(params), jax.tree_util.tree_leaves(params2), strict=True
    ):
        np.testing.assert_array_equal(
            np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path)
        )
    tokens, mask = left_padded(config.vocab_size, seed=3)
    assert_close(hf_logits(out, tokens, mask), hf_logits(checkpoint(case), tokens, mask), mask)


@pytest.mark.slow
def test_multimodal_layout_loads_the_text_model(checkpoint, tmp_path, caplog):
    """A `qwen3_5` (image-text) checkpoint: text weights under ``model.language_model.``, a
    vision tower and an MTP head beside them, the text config nested in ``text_config``."""
    case = "lin3-full1-untied-gva2-k4"
    text_path = checkpoint(case)
    config, params = load_hf(text_path, dtype=jnp.float32)
    tensors = safetensors.numpy.load_file(f"{text_path}/model.safetensors")
    wrapped = {
        (n if n == "lm_head.weight" else "model.language_model." + n[len("model.") :]): t
        for n, t in tensors.items()
    }
    wrapped["model.visual.blocks.0.attn.qkv.weight"] = np.ones((6, 2), np.float32)
    wrapped["mtp.fc.weight"] = np.ones((2, 2), np.float32)
    folder = tmp_path / "multimodal"
    folder.mkdir()
    safetensors.numpy.save_file(wrapped, str(folder / "model.safetensors"))
    text_config = json.loads(Path(text_path, "config.json").read_text())
    (folder / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["Qwen3_5ForConditionalGeneration"],
                "model_type": "qwen3_5",
                "text_config": text_config,
                "vision_config": {"model_type": "qwen3_5_vision", "depth": 1},
                "tie_word_embeddings": False,
            }
        )
    )
    with caplog.at_level(logging.INFO, logger="ais_jax.models.qwen35"):
        config2, params2 = load_hf(folder, dtype=jnp.float32)
    assert config2 == config
    assert "model.visual" in caplog.text and "mtp.fc" in caplog.text
    for a, b in zip(
        jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(params2), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    del wrapped["model.language_model.layers.1.linear_attn.A_log"]
    safetensors.numpy.save_file(wrapped, str(folder / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"missing tensor\(s\) \['model.layers.1.linear_attn.A_log'"
    ):
        load_hf(folder)


# ---- our forward: properties --------------------------------------------------------------

TINY = qwen35.Qwen35Config.tiny(vocab_size=64)
# the property tests' model: small, so each distinct shape compiles in about a second
SMALL = qwen35.Qwen35Config(
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    intermediate_size=48,
    layer_types=(LIN, FULL),
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
)


def random_params(config, seed=0):
    """Every leaf of `qwen35.param_shapes` drawn O(1)-active as `_randomize` does (numpy draws:
    a jitted init compiled for longer than the tests it served)."""
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(qwen35.param_shapes(config))
    out = []
    for path, leaf in leaves:
        name = jax.tree_util.keystr(path)
        noise = rng.standard_normal(leaf.shape)
        if "a_log" in name:
            value = np.log(0.05 + 0.95 * rng.random(leaf.shape))
        elif "linear_norm" in name:
            value = 1.0 + 0.2 * noise
        elif "conv_weight" in name:
            value = 0.5 * noise
        else:
            value = 0.2 * noise
        out.append(jnp.asarray(value, jnp.float32))
    return jax.tree_util.tree_unflatten(treedef, out)


@pytest.mark.slow
def test_padding_is_invisible():
    """Pad tokens don't matter (bitwise), and a left-padded row equals the same tokens with
    nothing before them (placed first, padding after): no pad leaks into the conv or the
    recurrent state."""
    c = SMALL
    params = random_params(c)
    pads = (0, 7, 13)
    tokens, mask = left_padded(c.vocab_size, seed=4, pads=pads, seq=24)
    logits = np.asarray(_forward(params, c, jnp.asarray(tokens), jnp.asarray(mask), chunk_size=8))
    repadded = np.where(mask, tokens, (tokens + 5) % c.vocab_size)
    np.testing.assert_array_equal(
        np.asarray(_forward(params, c, repadded, jnp.asarray(mask), chunk_size=8))[mask],
        logits[mask],
    )
    unstacked = qwen35.unstack_layers(params, c)  # the per-layer form takes the same path
    unstacked_logits = _forward(unstacked, c, jnp.asarray(tokens), jnp.asarray(mask), chunk_size=8)
    assert_close(unstacked_logits, logits, mask, rtol=1e-6)
    first = np.stack([np.roll(tokens[b], -pad) for b, pad in enumerate(pads)])
    first_logits = _forward(params, c, first, jnp.asarray(mask[:, ::-1]), chunk_size=8)
    shifted = np.stack([np.roll(logits[b], -pad, axis=0) for b, pad in enumerate(pads)])
    assert_close(first_logits, shifted, mask[:, ::-1])


@pytest.mark.slow
def test_fp8_covers_every_projection_and_keeps_padding_out_of_scales():
    c = SMALL
    params = random_params(c)
    q = qwen35.quantize_params(params)
    projections = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    projections |= set(qwen35.LINEAR_ATTENTION_WEIGHTS)
    quantized = {n for n, w in q["layers"].items() if isinstance(w, QArray)}
    assert quantized == projections
    for name in ("conv_weight", "a_log", "dt_bias", "linear_norm", "input_norm"):
        assert q["layers"][name].dtype == jnp.bfloat16
    tokens, mask = left_padded(c.vocab_size, seed=5, pads=(0, 3, 9), seq=16)
    tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
    fp8 = np.asarray(_forward(q, c, tokens, mask, chunk_size=8))
    repadded = jnp.where(mask, tokens, (tokens + 3) % c.vocab_size)
    repadded = np.asarray(_forward(q, c, repadded, mask, chunk_size=8))
    valid = np.asarray(mask)
    np.testing.assert_array_equal(repadded[valid], fp8[valid])
    bf16 = cast_params(params, jnp.bfloat16)
    ref = np.asarray(_forward(bf16, c, tokens, mask, chunk_size=8))
    logp = lambda x: np.asarray(jax.nn.log_softmax(x, -1))  # noqa: E731
    fp8_error = np.abs(logp(fp8) - logp(ref))[valid].mean()
    # W8A8 rounds every projection's operands to 3 mantissa bits: on random weights (std 0.2,
    # chaotic) mean |dlogp| is ~0.3, not 0 (unquantized) and far from unrelated logits (~3).
    assert np.isfinite(fp8).all() and 0.01 < fp8_error < 1.0, fp8_error


# ---- the delta rule: chunked = recurrent, gradients ----------------------------------------


def delta_inputs(seed, B=2, S=37, U=3, I=8, O=5, dtype=jnp.float32, correlated=False):
    """Normalised q/k (correlated keys with strong writes and slow decay are the hard case for
    the triangular solve), values, log decays <= 0, write strengths in (0, 1), a state."""
    ks = jax.random.split(jax.random.key(seed), 7)
    l2 = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    k = jax.random.normal(ks[1], (B, S, U, I))
    if correlated:
        k = jnp.broadcast_to(jax.random.normal(ks[6], (1, 1, 1, I)), k.shape) + 0.3 * k
    g_scale, beta_lo = (0.02, 0.9) if correlated else (0.5, 0.0)
    args = (
        l2(jax.random.normal(ks[0], (B, S, U, I))) * I**-0.5,
        l2(k),
        jax.random.normal(ks[2], (B, S, U, O)),
        -g_scale * jax.random.uniform(ks[3], (B, S, U)),
        beta_lo + (1 - beta_lo) * jax.random.uniform(ks[4], (B, S, U)),
        jax.random.normal(ks[5], (B, U, I, O)),
    )
    return tuple(a.astype(dtype) for a in args)


@pytest.mark.slow
@pytest.mark.parametrize("chunk, correlated", [(5, False), (64, False), (16, True)])
def test_chunked_equals_recurrent(chunk, correlated):
    """Chunks that do not divide S (5 into 37), one chunk (64 > 37), and the hard case."""
    args = delta_inputs(0, S=37, correlated=correlated)
    o_ref, state_ref = jax.jit(qwen35.gated_delta_rule_recurrent)(*args)
    o, state = jax.jit(qwen35.gated_delta_rule_chunked, static_argnums=6)(*args, chunk)
    assert o.dtype == state.dtype == jnp.float32
    assert_close(o, o_ref, np.ones(o.shape, bool), rtol=1e-5)
    assert_close(state, state_ref, np.ones(state.shape, bool), rtol=1e-5)


@pytest.mark.parametrize("Z", [1, 2, 5, 16, 37, 64])
def test_unit_lower_inverse_equals_float64_inverse(Z):
    """Block inversion by matmuls (sizes that are and are not powers of two) against numpy's
    float64 inverse, relative to the inverse's largest entry (which grows with Z)."""
    a = np.tril(np.random.default_rng(Z).normal(size=(3, 2, Z, Z)) * 0.5, -1)
    inv = np.asarray(jax.jit(qwen35.unit_lower_inverse)(jnp.asarray(a, jnp.float32)))
    ref = np.linalg.inv(np.eye(Z) + a)
    assert inv.dtype == np.float32
    np.testing.assert_array_equal(np.triu(inv, 1), 0.0)
    assert np.abs(inv - ref).max() <= 1e-6 * np.abs(ref).max(), np.abs(inv - ref).max()


def test_chunked_rule_calls_no_lapack_solve():
    """The delta rule's chunks solve by matmuls: jaxlib 0.10.2's LAPACK `trsm` custom call
    deadlocks on XLA:CPU when two batched solves run at once (the Qwen3.5 training step hung
    at batch >= 64), so neither the rule nor its gradient may lower to a triangular solve."""
    args = delta_inputs(0, B=4, S=20)
    grad = jax.grad(lambda q: qwen35.gated_delta_rule_chunked(q, *args[1:])[0].sum())
    assert "triangular_solve" not in str(jax.make_jaxpr(grad)(args[0]))


@pytest.mark.slow
def test_chunked_gradients_float64():
    """Reverse-mode gradients of the chunked rule: finite differences (`check_grads`) and the
    recurrence's gradients, all in float64."""
    from jax.test_util import check_grads

    with jax.enable_x64(True):
        args = delta_inputs(1, B=1, S=11, U=2, I=4, O=3, dtype=jnp.float64)
        w_o = jax.random.normal(jax.random.key(9), (1, 11, 2, 3), jnp.float64)
        w_s = jax.random.normal(jax.random.key(10), (1, 2, 4, 3), jnp.float64)

        def loss(rule, *a):
            o, s = rule(*a)  # a: the six inputs (and the chunk size)
            return jnp.sum(o * w_o) + jnp.sum(s * w_s)

        chunked = jax.jit(lambda *a: loss(qwen35.gated_delta_rule_chunked, *a, 4))
        check_grads(chunked, args, order=1, modes=["rev"], atol=1e-6, rtol=1e-6)
        grads = jax.jit(jax.grad(chunked, argnums=range(6)))(*args)
        recurrent = lambda *a: loss(qwen35.gated_delta_rule_recurrent, *a)  # noqa: E731
        grads_ref = jax.jit(jax.grad(recurrent, argnums=range(6)))(*args)
        for g, r in zip(grads, grads_ref, strict=True):
            assert g.dtype == jnp.float64
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-10, atol=1e-10)


# ---- decoding state -----------------------------------------------------------------------


@pytest.mark.slow
def test_step_from_prefill_state_equals_chunked_layer():
    """A left-padded prefill of P tokens (chunked), then one `linear_attention_step` per token
    (row 1 finished after two steps): every step's output equals the chunked layer over the
    whole sequence, and a finished row's states stay bitwise what they were."""
    c = SMALL
    lp = qwen35._layer_params(random_params(c, seed=2), c, 0)
    assert c.layer_types[0] == LIN
    B, P, T = 3, 9, 6
    h = jax.random.normal(jax.random.key(3), (B, P + T, c.hidden_size))
    _, prompt_mask = left_padded(c.vocab_size, pads=(0, 2, 6), seq=P)
    alive = np.ones((B, T), bool)
    alive[1, 2:] = False
    mask = jnp.asarray(np.concatenate([prompt_mask, alive], 1))
    empty = qwen35.init_linear_state(c, B)
    layer = jax.jit(qwen35.linear_attention, static_argnums=1, static_argnames="chunk_size")
    full, _ = layer(lp, c, h, mask, empty, chunk_size=4)
    out, state = layer(lp, c, h[:, :P], mask[:, :P], empty, chunk_size=4)
    assert_close(out, full[:, :P], prompt_mask, rtol=1e-5)
    step = jax.jit(qwen35.linear_attention_step, static_argnums=1)
    for t in range(T):
        before = state
        out_t, state = step(lp, c, h[:, P + t], mask[:, P + t], state)
        assert_close(out_t, full[:, P + t], alive[:, t], rtol=1e-5)
        if not alive[1, t]:
            np.testing.assert_array_equal(np.asarray(state.conv[1]), np.asarray(before.conv[1]))
            np.testing.assert_array_equal(
                np.asarray(state.recurrent[1]), np.asarray(before.recurrent[1])
            )
    assert state.conv.shape == (B, c.linear_conv_kernel - 1, c.conv_channels)
    assert state.recurrent.dtype == jnp.float32


# ---- config -------------------------------------------------------------------------------


def test_config_round_trip_and_defaults():
    assert qwen35.Qwen35Config.from_hf_dict(TINY.to_hf_dict()) == TINY
    hf = TINY.to_hf_dict()
    del hf["layer_types"]
    hf |= {"num_hidden_layers": 8, "full_attention_interval": 4}
    config = qwen35.Qwen35Config.from_hf_dict(hf)
    assert config.attention_layers == (3, 7) and config.linear_layers == (0, 1, 2, 4, 5, 6)
    assert config.rotary_dim == 8 and config.kind_index == (0, 1, 2, 0, 3, 4, 5, 1)
    hf_config = transformers.Qwen3_5TextConfig(**(BASE | CASES["lin3-full1-untied-gva2-k4"][0]))
    assert qwen35.Qwen35Config.from_hf_dict(hf_config.to_dict()).num_params == sum(
        p.numel() for p in transformers.Qwen3_5ForCausalLM(hf_config).parameters()
    )


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(layer_types=(LIN, "sliding_attention", LIN, FULL)), "unknown type"),
        (dict(layer_types=(LIN, FULL)), "has 2 entries for num_layers=4"),
        (dict(linear_num_value_heads=3), "multiple of linear_num_key_heads"),
        (dict(partial_rotary_factor=0.01), "rotary_dim=0"),
        (dict(linear_conv_kernel=0), "linear_conv_kernel must be a positive integer"),
    ],
)
def test_config_errors_name_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(TINY, **change)


def test_unsupported_hf_configs_are_named():
    for extra, message in [
        (dict(num_experts=8), "MoE"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6}), "rope_type 'yarn'"),
    ]:
        with pytest.raises(ValueError, match=message):
            qwen35.Qwen35Config.from_hf_dict(TINY.to_hf_dict() | extra)


@pytest.mark.slow
def test_ais_jax_sample_runs_a_qwen35_checkpoint(checkpoint, tmp_path, capsys):
    """`ais-jax sample` on a Qwen3.5 checkpoint written by transformers (the sampler runs the
    family since #17 item 3): it prints the sampled responses with finite log-probs."""
    import shutil

    from conftest import write_tokenizer

    from ais_jax.cli import main as cli

    path = shutil.copytree(checkpoint("full-lin-lin-tied-mqa-k3-rot0.5"), tmp_path / "ckpt")
    config, _ = load_hf(path, dtype=jnp.float32)
    write_tokenizer(path, config.vocab_size - 1, eos_id=config.vocab_size - 1)
    args = ["sample", "--checkpoint", str(path), "--prompt", "1 2 3", "--max-new-tokens", "4"]
    assert cli.main(args) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert out.strip() and "nan" not in out.lower(), out
