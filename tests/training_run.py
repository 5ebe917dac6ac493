"""The tiny models and training runs the tests share, in a module with no heavy imports (the
subprocess workers import it too, before JAX).

``MODEL``: the tiny random decoder of the unit tests (two layers, grouped-query attention,
rope_theta 1e4); test modules derive what they need from it with ``dataclasses.replace``,
naming what differs. ``SHARDED_MODEL``: the same with every dimension divisible by a 2x2x2
mesh and an untied LM head, for the 8-device tests.

``TINY_RUN``: the one-layer run of test_train.py and test_cli.py (one compile per process):
16 rollouts of at most 6 tokens per step, and 40 SFT steps so rewards differ within groups.

``RUN``: the same model and task, which multihost_worker.py runs across two processes and
sharding_worker.py runs in one, both on 8 CPU devices (a mesh of data=8); test_sharding.py
compares the two. Both workers train in float32 (``train.COMPUTE_DTYPE``) so the comparison is
not bf16 rounding.
"""

import dataclasses

from ais_jax.models.qwen3 import ModelConfig

MODEL = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=64,
    rope_theta=10_000.0,
)
SHARDED_MODEL = dataclasses.replace(
    MODEL, hidden_size=64, intermediate_size=128, tie_embeddings=False
)

TINY_MODEL = {
    "num_layers": 1,
    "hidden_size": 64,
    "num_heads": 2,
    "num_kv_heads": 1,
    "head_dim": 32,
    "intermediate_size": 128,
}

TINY_RUN = {
    "steps": 4,
    "model": TINY_MODEL,
    "task": {"options": {"ops": ["+", "-"], "min_digits": 1, "max_digits": 1}, "eval_examples": 8},
    "rollout": {"prompts_per_step": 4, "group_size": 4, "max_new_tokens": 6, "max_prompt_len": 8},
    "optim": {"learning_rate": 1e-3},
    "sft": {"steps": 40, "batch_size": 16, "learning_rate": 1e-2},
}

RUN = {
    **TINY_RUN,
    "steps": 3,
    "checkpoint_every": 2,
    "mesh": {"data": -1},
    "sft": {**TINY_RUN["sft"], "steps": 4},
}
