"""ais_jax: FP8 rollouts, BF16 training and Adaptive Importance Sampling for GRPO in JAX.

Dimension key used in every name and einsum string:
B batch, G group size, T response length, P prompt length, S full sequence, V vocab,
D model dim, L layers, H query heads, K kv heads, R query heads per kv head, E head dim,
F MLP dim.

Modules a user meets:
- `ais_jax.ais`, `ais_jax.grpo`: the correction and the loss (arrays in, arrays out; they
  import no model code, so other JAX codebases can take them alone).
- `forward`, `generate`, `token_logprobs`, `quantize_fp8`: the model, the rollout engine and
  trainer-side scoring.
- `load_hf`, `save_hf`, `HFTokenizer`: Hugging Face checkpoints in and out.
- `TrainConfig`, `load_config`, `run_training`: the training job (`ais-jax train`).
"""

from ais_jax import ais, grpo
from ais_jax.ais import mismatch_metrics
from ais_jax.config import TrainConfig, load_config
from ais_jax.hf import CheckpointError, HFTokenizer, load_hf, save_hf
from ais_jax.model import KVCache, forward, forward_cached, init_cache, init_params
from ais_jax.model_config import ModelConfig
from ais_jax.quant import QArray, linear, quantize_fp8, quantize_params, tree_bytes
from ais_jax.sampler import Rollout, generate, token_logprobs

__version__ = "0.1.0"


def __getattr__(name: str):
    # The training loop pulls in grain, orbax and tensorboardX; import it only when asked, so
    # `import ais_jax` (model, sampler, AIS) works where those are not installed.
    if name == "run_training":
        from ais_jax.runner import run_training

        return run_training
    raise AttributeError(f"module 'ais_jax' has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "HFTokenizer",
    "KVCache",
    "ModelConfig",
    "QArray",
    "Rollout",
    "TrainConfig",
    "ais",
    "forward",
    "forward_cached",
    "generate",
    "grpo",
    "init_cache",
    "init_params",
    "linear",
    "load_config",
    "load_hf",
    "mismatch_metrics",
    "quantize_fp8",
    "quantize_params",
    "run_training",
    "save_hf",
    "token_logprobs",
    "tree_bytes",
]
