"""One diffu-GRPO step of LLaDA on 8 fake CPU devices vs one device (test_llada_sharding.py).

``python tests/diffusion_sharding_worker.py OUT.json`` sets
``--xla_force_host_platform_device_count=8`` before JAX starts, builds `diffusion_train`'s
phases on a 2 x 2 x 2 mesh (data, fsdp, tensor) and on one device, and runs on both: init,
the rollout sync, the score phase (J = 2 prompt masks: corrupted prompts, logp_rollout,
logp_old) and the update (2 inner updates x 2 minibatches of the GRPO loss with AIS). The
trainer runs in float32 (``compute_dtype``) so sharding may change only the order of float32
reductions, as in sharding_worker.py. Writes ``{"ok": bool, "error": str, ...}`` to OUT.json.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from ais_jax.config import MeshConfig, TrainConfig, from_dict
from ais_jax.models.llada import LLaDAConfig, init_params
from ais_jax.parallel import sharding as shd
from ais_jax.train import diffusion as dt
from ais_jax.train import step as train

CONFIG = LLaDAConfig(  # every dimension divisible by the 2 x 2 x 2 mesh; untied head
    vocab_size=80,
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
    rope_theta=10_000.0,
    mask_token_id=79,
    eos_token_id=2,
    pad_token_id=0,
    max_position_embeddings=64,
)
CFG = from_dict(
    TrainConfig,
    {
        "model": {"family": "llada"},
        "rollout": {"format": "bf16", "prompts_per_step": 4, "group_size": 4, "max_new_tokens": 8},
        # Adam's eps = 1: its step lr * m / (sqrt(v) + eps) is then a smooth function of the
        # gradient. With the default 1e-8 it is ~ lr * sign(g), so an element whose gradient is
        # a near-cancelling sum jumps by ~lr when the float32 reduction order (which sharding
        # changes) flips it (measured: 34% of a tensor's largest step after one update).
        "optim": {"ppo_epochs": 2, "minibatches": 2, "learning_rate": 1e-2, "eps": 1.0},
    },
)
N, P, T = 16, 6, 8
RTOL = 1e-5  # log-probs, entropies
# weights after the 4 updates, relative to the largest step of their tensor: float32 gradients
# summed in another order (measured on this setup: 5e-4 after one update, 1.6e-4 after four)
STEP_TOL = 2e-3


def host_inputs():
    """Random float32 params (matrices std 0.1, logits O(1)) and a rollout batch."""
    params = init_params(CONFIG, jax.random.key(0))
    params = jax.device_get(jax.tree.map(lambda x: 5 * x if x.ndim >= 2 else x, params))
    r = np.random.default_rng(0)
    prompt_mask = np.ones((N, P), bool)
    prompt_mask[::3, :2] = False  # left padding
    mask = np.ones((N, T), bool)
    mask[::2, 5:] = False  # an early EOS
    prompts = r.integers(3, 79, (N, P)).astype(np.int32)
    tokens = r.integers(3, 79, (N, T)).astype(np.int32)
    advantages = r.normal(size=N).astype(np.float32)
    return params, (prompts, prompt_mask, tokens, mask), advantages


def step(mesh, params, rows, advantages):
    """init, sync, score (2 masks) and one update on ``mesh``: (Scored, state, metrics)."""
    phases = train.make_phases(
        mesh, CFG, CONFIG, eos_ids=(2,), compute_dtype=jnp.float32, estimator=dt.ESTIMATOR
    )
    state = phases.init(params)
    rollout = phases.sync(state.params)
    rows = shd.shard_batch(rows, mesh)
    keys = jax.random.split(jax.random.key(5), CFG.optim.ppo_epochs)
    scored = phases.score(rollout, state.params, *rows, keys, jnp.float32(0.3))
    batch = train.Batch(
        prompt_tokens=scored.prompt_tokens,
        prompt_mask=rows[1],
        tokens=rows[2],
        mask=rows[3],
        logp_rollout=scored.logp_rollout + 0.05 * rows[3][:, None].astype(jnp.float32),
        logp_old=scored.logp_old,
        advantages=shd.shard_batch(advantages, mesh),
    )
    before = jax.device_get(state.params)
    state, metrics = phases.update(state, batch, jax.random.key(9))
    return jax.device_get((scored, before, state, metrics)), state


def main(out: str) -> None:
    result = {"ok": False, "devices": len(jax.devices())}
    try:
        assert len(jax.devices()) == 8, jax.devices()
        params, rows, advantages = host_inputs()
        one = shd.make_mesh(MeshConfig(data=1), jax.devices()[:1])
        eight = shd.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
        (s1, before, st1, m1), _ = step(one, params, rows, advantages)
        (s8, _, st8, m8), state8 = step(eight, params, rows, advantages)
        np.testing.assert_array_equal(s8.prompt_tokens, s1.prompt_tokens)  # the same masks
        for name in ("logp_rollout", "logp_old", "entropy"):
            np.testing.assert_allclose(
                getattr(s8, name), getattr(s1, name), rtol=RTOL, atol=RTOL, err_msg=name
            )
        assert np.abs(s1.logp_old).max() > 0.5  # real log-probs
        for (path, e), a, old in zip(
            jax.tree_util.tree_leaves_with_path(st1.params),
            jax.tree.leaves(st8.params),
            jax.tree.leaves(before),
            strict=True,
        ):
            step_size = float(np.abs(np.asarray(e) - old).max())
            assert step_size > 1e-4 or "norm" in jax.tree_util.keystr(path), (path, step_size)
            np.testing.assert_allclose(
                a, e, rtol=0, atol=STEP_TOL * step_size, err_msg=jax.tree_util.keystr(path)
            )
        for k in m1:
            np.testing.assert_allclose(m8[k], m1[k], rtol=1e-4, atol=1e-6, err_msg=k)
        spec = state8.params["layers"]["up_proj"].sharding.spec
        assert spec == jax.P(None, "tensor", "fsdp"), spec
        result.update(ok=True, up_proj_spec=str(spec), loss=float(m1["loss/total"]))
    except Exception:  # noqa: BLE001  (reported to the test)
        result["error"] = traceback.format_exc()
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
