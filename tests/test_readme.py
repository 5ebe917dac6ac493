"""The README's "use AIS in your own JAX code" snippet runs as written and does what it says."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

README = Path(__file__).resolve().parents[1] / "README.md"


def _snippet() -> str:
    text = README.read_text()
    section = text[text.index("## Use AIS in your own JAX code") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_ais_snippet_runs_and_both_forms_agree():
    namespace: dict = {}
    exec(compile(_snippet(), str(README), "exec"), namespace)  # noqa: S102 - our own README
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    B, T = 16, 12
    logp_old = -jnp.abs(jax.random.normal(k1, (B, T)))
    logp_new = logp_old + 0.05 * jax.random.normal(k2, (B, T))
    logp_rollout = logp_old + 0.1 * jax.random.normal(k3, (B, T))
    rewards = jax.random.bernoulli(k4, 0.5, (B,)).astype(jnp.float32)
    mask = jnp.asarray(np.arange(T)[None, :] < np.arange(4, 4 + B)[:, None] % T + 1)
    loss, metrics = namespace["loss_fn"](logp_new, logp_old, logp_rollout, rewards, mask)
    assert np.isfinite(float(loss)) and 0.0 < float(metrics["ais/alpha"]) <= 1.0
    grads = namespace["grads"](logp_new, logp_old, logp_rollout, rewards, mask)
    assert grads.shape == (B, T) and float(jnp.abs(grads).sum()) > 0
    assert float(jnp.abs(jnp.where(mask, 0.0, grads)).max()) == 0.0
    # the two ways of composing the correction give the same loss
    grpo, correction = namespace["grpo"], namespace["correction"]
    adv_B = grpo.group_advantages(rewards, group_size=8)
    adv_BT, _ = correction(adv_B, logp_old, logp_rollout, mask)
    a, _ = grpo.loss(logp_new, logp_old, adv_BT, mask)
    b, _ = grpo.loss(
        logp_new, logp_old, adv_B, mask, correction=correction, logp_rollout_BT=logp_rollout
    )
    assert float(a) == float(b)
