"""ais_jax: FP8 rollouts, BF16 training and Adaptive Importance Sampling for GRPO in JAX.

Dimension key used in every name and einsum string:
B batch, G group size, T response length, P prompt length, S full sequence, V vocab,
D model dim, L layers, H query heads, K kv heads, R query heads per kv head, E head dim,
F MLP dim.

Modules a user meets:
- `ais_jax.ais`, `ais_jax.grpo`: the correction and the loss (arrays in, arrays out; they
  import only JAX and chex, so other JAX codebases can take them alone).
- `forward`, `generate`, `token_logprobs`, `quantize_fp8`: the model, the rollout engine and
  trainer-side scoring.
- `load_hf`, `save_hf`, `HFTokenizer`: Hugging Face checkpoints in and out.
- `TrainConfig`, `load_config`, `run_training`: the training job (`ais-jax train`).

Every public name is imported on first use (PEP 562), so `from ais_jax import ais, grpo` loads
those two modules and nothing of the model, checkpoint or training code (flax, optax, orbax,
safetensors, yaml, grain); `import ais_jax` alone loads nothing but this file.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

__version__ = "0.1.0"

# public name -> the module that defines it (a name equal to its module's last part is the module)
_EXPORTS: dict[str, str] = {
    "ais": "ais_jax.ais",
    "grpo": "ais_jax.grpo",
    "mismatch_metrics": "ais_jax.ais",
    "TrainConfig": "ais_jax.config",
    "load_config": "ais_jax.config",
    "CheckpointError": "ais_jax.io.hf",
    "HFTokenizer": "ais_jax.io.hf",
    "load_hf": "ais_jax.io.hf",
    "save_hf": "ais_jax.io.hf",
    "KVCache": "ais_jax.nn.cache",
    "FAMILIES": "ais_jax.models",
    "family_of": "ais_jax.models",
    "forward": "ais_jax.models",
    "forward_cached": "ais_jax.models",
    "init_cache": "ais_jax.models",
    "init_params": "ais_jax.models",
    "ModelConfig": "ais_jax.models",
    "QArray": "ais_jax.nn.quant",
    "linear": "ais_jax.nn.quant",
    "quantize_fp8": "ais_jax.nn.quant",
    "quantize_params": "ais_jax.nn.quant",
    "tree_bytes": "ais_jax.nn.quant",
    "Rollout": "ais_jax.rollout.sampler",
    "generate": "ais_jax.rollout.sampler",
    "token_logprobs": "ais_jax.train.logprobs",
    "run_training": "ais_jax.train.job",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Imports a public name's module on first access (and any `ais_jax.<submodule>`)."""
    if name in _EXPORTS:
        module = importlib.import_module(_EXPORTS[name])
        value = module if _EXPORTS[name] == f"{__name__}.{name}" else getattr(module, name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        # any submodule, e.g. `ais_jax.quant` after a bare `import ais_jax`
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
