"""AIS inside tunix: its GRPO learner corrected by `ais_jax.ais`, ais_jax's FP8 rollout its sampler.

tunix's GRPO (``google-tunix`` 0.1.7) trains on the rollout engine's samples as if the trainer
had drawn them: it has no rollout-vs-trainer correction. This module adds one, in three parts a
tunix user composes (each usable alone):

- **The loss.** Importing the module registers the policy loss ``"grpo_ais"`` in tunix's
  function registry: the chosen `ais_jax.ais` correction (AIS by default, or TIS, MIS, none)
  turns tunix's GRPO advantages ``[B]`` into corrected per-token advantages ``[B, T]`` from the
  sampler's log-probs and the trainer's, then tunix's own ``"grpo"`` loss runs on them
  unchanged. The trainer's log-probs are tunix's ``old_per_token_logps`` where it computes
  them (``num_iterations > 1``), else the stop-gradient log-probs of the model being trained,
  as tunix's GRPO takes its old policy. Its metrics (``ais/alpha`` and its parts, both ESS
  ratios, ``mismatch/*``, ``is/*``: `ais_jax.ais`'s table) join the loss's aux.
- **The learner.** `GRPOLearner` is tunix's, carrying the sampler's per-token log-probs
  (`RolloutOutput.logprobs`; tunix's ``RolloutConfig(return_logprobs=True)``) into the training
  example (`TrainExample.rollout_per_token_logps`) and sending the correction's metrics to
  tunix's metric logging. Its config, `GRPOConfig`, is tunix's with ``policy_loss_fn`` set to
  ``"grpo_ais"`` and the correction named (``correction``, ``correction_kwargs``).
- **The rollout.** `Rollout` is a tunix rollout engine (``ClusterConfig(rollout_engine=...)``)
  that samples with ais_jax's jitted sampler from an FP8 (or BF16, FP4) copy of a
  ``tunix.models.qwen3`` model's weights, made again at every weight sync from the trainer's
  (`params_from_tunix`: the name map, `params_to_tunix` its inverse), so a tunix GRPO run gets
  FP8 rollouts plus AIS.

Usage (a tunix ``model``, ``mesh``, optimizer and dataset as in tunix's own GRPO example)::

    import functools
    from tunix.rl import rl_cluster
    from ais_jax.integrations import tunix as ais_tunix

    cluster = rl_cluster.RLCluster(
        actor=model,
        tokenizer=tokenizer,
        cluster_config=rl_cluster.ClusterConfig(
            role_to_mesh={role: mesh for role in rl_cluster.Role},
            rollout_engine=functools.partial(ais_tunix.Rollout, format="float8_e4m3fn"),
            rollout_config=rollout_config,  # tunix's RolloutConfig
            training_config=training_config,
        ),
    )
    learner = ais_tunix.GRPOLearner(
        rl_cluster=cluster,
        algo_config=ais_tunix.GRPOConfig(num_generations=8, beta=0.0, correction="adaptive"),
        reward_fns=reward_fn,
    )
    learner.train(dataset)

Nothing in tunix is patched. The one gap the learner bridges: tunix 0.1.7's
`GRPOLearner._generate_and_compute_advantage` receives the rollout's `RolloutOutput.logprobs`
from `RLCluster.generate` and drops them (its `TrainExample` has no field for them), so
`GRPOLearner` wraps that one `generate` call, on the cluster instance and for the length of the
method, to keep its output.

Where this differs from tunix's own pieces:
- `Rollout.get_per_token_logps` (tunix's "old" log-probs when ``num_iterations > 1``) scores with
  the trainer's weights and precision, not the FP8 copy, at the rollout temperature (tunix's
  `VanillaRollout` scores at temperature 1 whatever the sampling temperature, while its loss
  divides the logits by it).
- `Rollout.model()` is None: the rollout holds its own copy, so tunix syncs the weights after
  every global step (`RLCluster.sync_weights` -> `Rollout.update_params`).
- Sequence packing (``segment_ids``) and LoRA weights are not supported: clear errors.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Mapping
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tunix.models.qwen3 import model as tunix_qwen3
from tunix.rl import common, function_registry
from tunix.rl import rl_cluster as rl_cluster_lib
from tunix.rl.grpo import grpo_learner
from tunix.rl.rollout import base_rollout

from ais_jax import ais
from ais_jax.config import RolloutConfig
from ais_jax.models.qwen3 import ModelConfig
from ais_jax.rollout.sampler import generate
from ais_jax.train.step import sync_rollout_params

__all__ = [
    "CORRECTIONS",
    "POLICY_LOSS",
    "GRPOConfig",
    "GRPOLearner",
    "Rollout",
    "Tokenizer",
    "TrainExample",
    "grpo_ais_loss",
    "make_correction",
    "metric_reductions",
    "model_config",
    "params_from_tunix",
    "params_to_tunix",
]

POLICY_LOSS = "grpo_ais"
CORRECTIONS = {
    "adaptive": ais.adaptive,
    "truncated": ais.truncated,
    "masked": ais.masked,
    "uncorrected": ais.uncorrected,
}


# ----------------------------------------------------------------------------- config, example


@dataclasses.dataclass(kw_only=True)
class GRPOConfig(grpo_learner.GRPOConfig):
    """tunix's `GRPOConfig` with the ``"grpo_ais"`` loss and its correction.

    ``correction`` names an `ais_jax.ais` factory (`CORRECTIONS`: ``"adaptive"`` = AIS,
    ``"truncated"`` = TIS, ``"masked"`` = MIS, ``"uncorrected"``: tunix's GRPO with the
    mismatch metrics logged) and ``correction_kwargs`` its keyword arguments (e.g.
    ``{"clip": 5.0, "delta": 0.02}``), checked here as the factory checks them.
    """

    policy_loss_fn: str = POLICY_LOSS
    correction: str = "adaptive"
    correction_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        super().__post_init__()
        if self.policy_loss_fn != POLICY_LOSS:
            raise ValueError(
                f"GRPOConfig.policy_loss_fn={self.policy_loss_fn!r}: the AIS learner trains with "
                f"{POLICY_LOSS!r} (correction='uncorrected' gives tunix's GRPO loss)."
            )
        if self.loss_algo != "grpo":
            raise ValueError(
                f"GRPOConfig.loss_algo={self.loss_algo!r}: {POLICY_LOSS!r} corrects the "
                "token-level GRPO loss only; allowed: 'grpo'."
            )
        make_correction(self)  # a bad name or value fails here, not inside the jitted step


def make_correction(algo_config) -> ais.Correction:
    """The `ais_jax.ais` correction ``algo_config.correction`` names, built with its kwargs."""
    name = getattr(algo_config, "correction", None)
    if name not in CORRECTIONS:
        raise ValueError(f"correction={name!r}; allowed: {sorted(CORRECTIONS)}.")
    return CORRECTIONS[name](**dict(getattr(algo_config, "correction_kwargs", {})))


@flax.struct.dataclass(frozen=True)
class TrainExample(grpo_learner.TrainExample):
    """tunix's GRPO example plus the sampler's log-probs of the completion tokens ``[B, T]``
    (float32, 0 where ``completion_mask`` is 0)."""

    rollout_per_token_logps: jax.Array | None = None


def metric_reductions() -> dict[str, Any]:
    """Each metric of the correction and how tunix combines its values over micro-batches:
    maxima (keys ending in ``_max``) by `np.max`, the rest by `np.mean` (as
    `ais_jax.ais.reduce_minibatch_metrics`)."""
    one = jnp.ones((1, 2), jnp.float32)
    _, metrics = ais.uncorrected()(jnp.ones((1,)), one, one, one)
    return {k: np.max if k.endswith("_max") else np.mean for k in sorted(metrics)}


# ----------------------------------------------------------------------------- the loss

_GRPO_LOSS = function_registry.get_policy_loss_fn("grpo")


@function_registry.register_policy_loss_fn(POLICY_LOSS)
def grpo_ais_loss(model, train_example, algo_config, pad_id, eos_id, **kwargs):
    """tunix's ``"grpo"`` loss on the advantages ``algo_config``'s correction makes of
    ``train_example.advantages``, from ``rollout_per_token_logps`` (the sampler) and the
    trainer's log-probs; returns ``(loss, aux)`` with the correction's metrics in ``aux``."""
    logp_rollout_BT = getattr(train_example, "rollout_per_token_logps", None)
    if logp_rollout_BT is None:
        raise ValueError(
            f"{POLICY_LOSS!r} needs the sampler's log-probs: a TrainExample with "
            "rollout_per_token_logps, as ais_jax.integrations.tunix.GRPOLearner builds it."
        )
    if getattr(train_example, "segment_ids", None) is not None:
        raise NotImplementedError(f"{POLICY_LOSS!r} does not support packed sequences.")
    logp_train_BT = train_example.old_per_token_logps
    if logp_train_BT is None:  # one iteration: the old policy is the model being trained
        graphdef, state = nnx.split(model)
        logp_train_BT = common.compute_per_token_logps(
            graphdef,
            state,
            prompt_tokens=train_example.prompt_ids,
            completion_tokens=train_example.completion_ids,
            pad_id=pad_id,
            eos_id=eos_id,
            stop_gradient=True,
            temperature=algo_config.temperature,
        )
    advantages_BT, metrics = make_correction(algo_config)(
        train_example.advantages, logp_train_BT, logp_rollout_BT, train_example.completion_mask
    )
    example = train_example.replace(advantages=advantages_BT)
    loss, aux = _GRPO_LOSS(model, example, algo_config, pad_id, eos_id, **kwargs)
    return loss, {**aux, **metrics}


# ----------------------------------------------------------------------------- the learner


class GRPOLearner(grpo_learner.GRPOLearner):
    """tunix's GRPO learner whose training examples carry the sampler's log-probs, trained with
    the ``"grpo_ais"`` loss of a `GRPOConfig`; the correction's metrics go to tunix's metric
    logging (``ais/alpha``, ``mismatch/k3``, ... beside ``kl`` and ``pg_clipfrac``)."""

    def __init__(self, rl_cluster, algo_config: GRPOConfig, reward_fns, **kwargs):
        if not isinstance(algo_config, GRPOConfig):
            raise TypeError(
                f"algo_config is a {type(algo_config).__name__}; the AIS learner takes "
                "ais_jax.integrations.tunix.GRPOConfig (tunix's, with the correction)."
            )
        super().__init__(
            rl_cluster=rl_cluster, algo_config=algo_config, reward_fns=reward_fns, **kwargs
        )
        trainer = self.rl_cluster.actor_trainer
        trainer.with_rl_metrics_to_log({**trainer.rl_metrics_to_log, **metric_reductions()})
        self._generate_lock = threading.Lock()

    def _generate_and_compute_advantage(self, training_input, mode=rl_cluster_lib.Mode.TRAIN):
        cluster, outputs = self.rl_cluster, []
        generate = cluster.generate  # its method, or a wrapper someone put on the instance
        wrapped = "generate" in vars(cluster)

        def generate_and_keep(*args, **kwargs):
            outputs.append(generate(*args, **kwargs))
            return outputs[-1]

        with self._generate_lock:  # the one `generate` of tunix's method, its output kept
            cluster.generate = generate_and_keep
            try:
                example = super()._generate_and_compute_advantage(training_input, mode)
            finally:
                if wrapped:
                    cluster.generate = generate
                else:
                    del cluster.generate
        (rollout,) = outputs
        logp_BT = _rollout_logps(rollout, example.completion_ids.shape[1])
        fields = {f.name: getattr(example, f.name) for f in dataclasses.fields(example)}
        return TrainExample(**fields, rollout_per_token_logps=jnp.asarray(logp_BT))


def _rollout_logps(rollout: base_rollout.RolloutOutput, T: int) -> np.ndarray:
    """The rollout's per-token log-probs as ``[B, T]`` float32, right-padded with 0."""
    if rollout.logprobs is None:
        raise ValueError(
            "The rollout returned no log-probs: AIS needs the sampler's per-token log-probs; set "
            "tunix's RolloutConfig(return_logprobs=True) (ais_jax's Rollout always returns them)."
        )
    logp_BT = np.zeros((len(rollout.tokens), T), np.float32)
    for i, (tokens, logps) in enumerate(zip(rollout.tokens, rollout.logprobs, strict=True)):
        if len(logps) != len(tokens):
            raise ValueError(
                f"rollout row {i}: {len(logps)} log-probs for {len(tokens)} completion tokens."
            )
        logp_BT[i, : len(logps)] = logps
    return logp_BT


# ----------------------------------------------------------------------------- the name map


# tunix 0.1.7's Qwen3 attention calls `apply_rope` without the config's rope_theta: it rotates
# with the default 1e6 (Qwen3's own value) whatever `ModelConfig.rope_theta` says.
TUNIX_QWEN3_ROPE_THETA = 1_000_000.0


def model_config(config: tunix_qwen3.ModelConfig) -> ModelConfig:
    """ais_jax's `ModelConfig` of a dense ``tunix.models.qwen3`` model: the model tunix computes,
    so rope theta `TUNIX_QWEN3_ROPE_THETA` (tunix's Qwen3 ignores its config's)."""
    if not isinstance(config, tunix_qwen3.ModelConfig):
        raise TypeError(
            f"ais_jax's tunix rollout runs tunix.models.qwen3 models; got a "
            f"{type(config).__module__}.{type(config).__name__}."
        )
    if config.num_experts:
        raise NotImplementedError(
            f"tunix Qwen3 with num_experts={config.num_experts} (MoE): ais_jax runs dense Qwen3."
        )
    return ModelConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.embed_dim,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        intermediate_size=config.hidden_dim,
        rope_theta=TUNIX_QWEN3_ROPE_THETA,
        rms_norm_eps=float(config.norm_eps),
        tie_embeddings=bool(config.use_tied_embedding),
        qk_norm=True,
    )


# ais_jax layer weight -> (tunix's path inside a layer, how to read it as ais_jax's [out, in])
_PROJECTIONS = {
    "q_proj": ("attn", "q_proj", "w"),  # [D, H, E]
    "k_proj": ("attn", "k_proj", "w"),  # [D, K, E]
    "v_proj": ("attn", "v_proj", "w"),  # [D, K, E]
    "o_proj": ("attn", "o_proj", "w"),  # [H, E, D]
    "gate_proj": ("mlp", "gate_proj", "kernel"),  # [D, F]
    "up_proj": ("mlp", "up_proj", "kernel"),  # [D, F]
    "down_proj": ("mlp", "down_proj", "kernel"),  # [F, D]
}
_NORMS = {
    "input_norm": ("input_layernorm", "w"),
    "post_norm": ("post_attention_layernorm", "w"),
    "q_norm": ("attn", "q_norm", "w"),
    "k_norm": ("attn", "k_norm", "w"),
}


def _flat(params) -> dict[tuple, jax.Array]:
    """``{path: array}`` of an `nnx.State` (or of such a dict already)."""
    if isinstance(params, Mapping) and all(isinstance(k, tuple) for k in params):
        return dict(params)
    return {path: v.get_value() for path, v in nnx.to_flat_state(params)}


def params_from_tunix(params, config: ModelConfig) -> dict[str, Any]:
    """ais_jax's Qwen3 parameter tree (layers stacked, matmul weights ``[out, in]``) of a tunix
    Qwen3's ``nnx.state(model, nnx.Param)`` (or its ``{path: array}``), in the same dtypes;
    jittable (reshapes and transposes only)."""
    flat = _flat(params)
    D = config.hidden_size
    layers: dict[str, list] = {name: [] for name in (*_PROJECTIONS, *_NORMS)}
    for i in range(config.num_layers):
        for name, path in _PROJECTIONS.items():
            w = flat[("layers", i, *path)]
            if name == "o_proj":
                w = w.reshape(-1, D)  # [H E, D]
            elif w.ndim == 3:
                w = w.reshape(D, -1)  # [D, H E]
            layers[name].append(w.T)
        for name, path in _NORMS.items():
            layers[name].append(flat[("layers", i, *path)])
    out = {
        "embed": flat[("embedder", "input_embedding")],
        "final_norm": flat[("final_norm", "w")],
        "layers": {name: jnp.stack(ws) for name, ws in layers.items()},
    }
    if not config.tie_embeddings:
        out["lm_head"] = flat[("lm_head", "w")].T
    return out


def params_to_tunix(params: Mapping[str, Any], config: ModelConfig) -> dict[tuple, jax.Array]:
    """The inverse of `params_from_tunix`: ``{path: array}`` for ``nnx.update(model, ...)``
    (`nnx.from_flat_state`)."""
    D, E = config.hidden_size, config.head_dim
    H, K = config.num_heads, config.num_kv_heads
    shapes = {"q_proj": (D, H, E), "k_proj": (D, K, E), "v_proj": (D, K, E), "o_proj": (H, E, D)}
    flat = {
        ("embedder", "input_embedding"): params["embed"],
        ("final_norm", "w"): params["final_norm"],
    }
    for i in range(config.num_layers):
        for name, path in _PROJECTIONS.items():
            w = params["layers"][name][i].T
            flat[("layers", i, *path)] = w.reshape(shapes[name]) if name in shapes else w
        for name, path in _NORMS.items():
            flat[("layers", i, *path)] = params["layers"][name][i]
    if not config.tie_embeddings:
        flat[("lm_head", "w")] = params["lm_head"].T
    return flat


# ----------------------------------------------------------------------------- the rollout


class Tokenizer:
    """An ais_jax tokenizer (`ais_jax.tasks.tokenizer.CharTokenizer`, `ais_jax.HFTokenizer`)
    with the methods tunix's `TokenizerAdapter` calls (``bos_id()`` etc. are attributes in
    ais_jax)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, text: str, **_) -> list[int]:
        return list(self.tokenizer.encode(text))

    def decode(self, ids, **_) -> str:
        return self.tokenizer.decode([int(i) for i in ids])

    def bos_id(self) -> int | None:
        return getattr(self.tokenizer, "bos_id", None)

    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    def pad_id(self) -> int:
        return self.tokenizer.pad_id


@functools.lru_cache(maxsize=8)
def _sync_fn(config: ModelConfig, rollout: RolloutConfig):
    """trainer weights ``{path: array}`` -> ais_jax's rollout copy, one jitted program."""
    return jax.jit(lambda flat: sync_rollout_params(params_from_tunix(flat, config), rollout))


class Rollout(base_rollout.BaseRollout):
    """A tunix rollout engine that samples with `ais_jax.generate` from a low-precision copy of
    a tunix Qwen3's weights.

    tunix builds it from ``ClusterConfig(rollout_engine=functools.partial(Rollout, format=...))``
    with the actor model, the tokenizer, the rollout mesh and its `RolloutConfig`. ``format``:
    ``"float8_e4m3fn"`` (default; ais_jax's W8A8 with per-tensor weight scales),
    ``"bf16"``, or any of `ais_jax.nn.quant.FORMATS`; ``act_scaling`` ``"tensor"`` (per-tensor
    dynamic activation scales) or ``"token"``; ``fp8_lm_head`` also quantizes the LM head.
    ``seed`` seeds the draws when the RolloutConfig has none: call n of `generate` uses
    ``fold_in(key, n)``.

    As tunix's own sampler: prompts are encoded with a BOS id where the tokenizer has one and
    left-padded to ``max_prompt_length`` (the next power of two above the longest prompt when
    longer), completions stop at the first ``eos_tokens`` id (else the tokenizer's eos id),
    which they exclude, and ``logprobs`` are ``log_softmax(logits / temperature)`` of each
    sampled token under the copy that sampled it (`ais_jax.Rollout.logp_plain`).

    The copy is made where the trainer's weights are, and sampling runs there: tunix's rollout
    ``mesh`` is kept but not used to re-shard (tested on one device; a sharded rollout mesh is
    ais_jax's `train.make_phases`' job, not yet this adapter's).
    """

    def __init__(
        self,
        rollout_actor,
        tokenizer,
        mesh=None,
        rollout_config: base_rollout.RolloutConfig | None = None,
        *,
        format: str = "float8_e4m3fn",
        act_scaling: str = "tensor",
        fp8_lm_head: bool = False,
        seed: int = 0,
    ):
        self.config = model_config(rollout_actor.config)
        self.rollout = RolloutConfig(
            format=format, act_scaling=act_scaling, fp8_lm_head=fp8_lm_head
        )
        self._tokenizer = tokenizer
        self._mesh = mesh
        self._temperature = 1.0 if rollout_config is None else float(rollout_config.temperature)
        # the trainer's weights, by reference (no copy): for `get_per_token_logps`
        self._trainer = nnx.merge(*nnx.split(rollout_actor))
        self._key = jax.random.key(seed)
        self._calls = 0
        self.params = None  # the rollout copy (ais_jax's tree)
        self.update_params(nnx.state(rollout_actor, nnx.Param))

    def update_params(self, params, filter_types=None) -> None:
        """Takes the trainer's new weights (tunix's weight sync) and makes the rollout copy."""
        if filter_types is not None and any(t is nnx.LoRAParam for t in filter_types):
            raise NotImplementedError("ais_jax's tunix Rollout does not sync LoRA weights.")
        nnx.update(self._trainer, params)
        flat = _flat(nnx.state(self._trainer, nnx.Param))
        self.params = _sync_fn(self.config, self.rollout)(flat)

    def generate(self, prompts, rollout_config, **kwargs) -> base_rollout.RolloutOutput:
        tok = self._tokenizer
        pad, bos = tok.pad_id(), tok.bos_id()
        # as tunix's `Sampler.tokenize`: a BOS id in front where the tokenizer has one, once
        rows = [tok.dedup_bos_ids(([bos] if bos else []) + list(tok.encode(p))) for p in prompts]
        P = rollout_config.max_prompt_length
        if max(map(len, rows)) > P:  # as tunix's sampler: the next power of two
            P = 1 << (max(map(len, rows)) - 1).bit_length()
        prompts_BP = np.full((len(rows), P), pad, np.int32)
        mask_BP = np.zeros((len(rows), P), bool)
        for i, ids in enumerate(rows):
            prompts_BP[i, P - len(ids) :] = ids
            mask_BP[i, P - len(ids) :] = True
        key = self._key if rollout_config.seed is None else jax.random.key(rollout_config.seed)
        key = jax.random.fold_in(key, self._calls)
        self._calls += 1
        top_k = rollout_config.top_k or None  # tunix: 0 or None is the whole vocabulary
        top_p = rollout_config.top_p if rollout_config.top_p not in (None, 1.0) else None
        out = generate(
            self.params,
            self.config,
            prompts_BP,
            key,
            prompt_mask=mask_BP,
            max_new_tokens=rollout_config.max_tokens_to_generate,
            temperature=rollout_config.temperature,
            top_k=top_k,
            top_p=top_p,
            eos_ids=tuple(rollout_config.eos_tokens or [tok.eos_id()]),
            pad_id=pad,
            prompt_group=_prompt_group(prompts),
        )
        tokens_BT, lengths_B, finished_B, logp_BT = jax.device_get(
            (out.tokens, out.lengths, out.finished, out.logp_plain)
        )
        n_B = lengths_B - finished_B  # the end-of-sequence token is not part of a completion
        tokens = [tokens_BT[i, :n] for i, n in enumerate(n_B)]
        return base_rollout.RolloutOutput(
            text=[tok.decode(t.tolist()) for t in tokens],
            logits=[],
            tokens=tokens,
            left_padded_prompt_tokens=prompts_BP,
            logprobs=[logp_BT[i, :n] for i, n in enumerate(n_B)],
        )

    def get_per_token_logps(self, prompt_tokens, completion_tokens) -> jax.Array:
        """The trainer's log-probs (its weights and precision, at the rollout temperature):
        tunix's "old" policy for ``num_iterations > 1``."""
        graphdef, state = nnx.split(self._trainer)
        return common.compute_per_token_logps(
            graphdef,
            state,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            pad_id=self.pad_id(),
            eos_id=self.eos_id(),
            stop_gradient=True,
            temperature=self._temperature,
        )

    def pad_id(self) -> int:
        return self._tokenizer.pad_id()

    def eos_id(self) -> int:
        return self._tokenizer.eos_id()

    def model(self):
        """None: the rollout holds its own copy, so tunix syncs the weights every step."""
        return None


def _prompt_group(prompts) -> int:
    """G when the prompts come as runs of G equal ones (tunix repeats each prompt G times), else
    1: ais_jax's sampler then runs each prompt's prefill once (`ais_jax.generate`)."""
    B = len(prompts)
    G = next((i for i in range(1, B) if prompts[i] != prompts[0]), B)
    if B % G or any(prompts[i] != prompts[i - i % G] for i in range(B)):
        return 1
    return G
