"""`ais-jax` with the toy's random init scaled: std 0.02 x FACTOR on every matrix, norms at one.

A probe of issue 47 (docs/results.md, "Toward the paper's regime"), not a library option:

    python docs/results/toy_levers/init_scale.py 5 train --config configs/compare_filler.yaml \
        --set steps=3 --set eval_every=0 --set correction.method=none --no-progress --out DIR
"""

import sys

import jax

import ais_jax.models.qwen3 as qwen3
from ais_jax.cli.main import main

_dense_params = qwen3.dense_params


def _scaled(factor: float):
    def dense_params(config, key, dtype=jax.numpy.float32):
        params = _dense_params(config, key, dtype)
        keep = lambda path: "norm" in jax.tree_util.keystr(path)  # noqa: E731
        return jax.tree_util.tree_map_with_path(
            lambda path, x: x if keep(path) else x * factor, params
        )

    return dense_params


if __name__ == "__main__":
    qwen3.dense_params = _scaled(float(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
