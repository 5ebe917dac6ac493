"""The model families, listed once, and the entry points that reach any of them through its config.

    family   kind             configs                         checkpoints
    qwen3    autoregressive   `qwen3.ModelConfig`             Qwen3, Qwen2, Llama (and GGUF)
    qwen35   autoregressive   `qwen35.Qwen35Config`           Qwen3.5 text (and its VL wrapper)
    llada    diffusion        `llada.LLaDAConfig`             LLaDA

Each module defines its config, its pure functions and its `family.Family` record (``FAMILY``);
`FAMILIES` is the table. The functions below take any family's config and call its family's
function of the same name (`family_of`, one dictionary look-up on the config's type), so the
sampler, the trainer, the memory plan and the loaders see one interface:

    init_params(config, key, dtype)          param_shapes(config, dtype)
    forward(params, config, tokens_BS, mask_BS, **kw)
    final_hidden / response_hidden / init_cache / forward_cached  (autoregressive families)
    unstack_layers(params, config)           preset(name, family=None, **overrides)

A family's own module stays importable alone for its own names (``qwen3.fuse_projections``,
``qwen35.gated_delta_rule_chunked``); nothing outside the families branches on a config type.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import jax
import jax.numpy as jnp

from ais_jax.models import llada, qwen3, qwen35
from ais_jax.models.family import KINDS, Family, TensorName
from ais_jax.models.llada import LLaDAConfig
from ais_jax.models.qwen3 import ModelConfig
from ais_jax.models.qwen35 import Qwen35Config
from ais_jax.nn import layers
from ais_jax.nn.layers import Params

__all__ = [
    "FAMILIES",
    "KINDS",
    "Config",
    "Family",
    "LLaDAConfig",
    "ModelConfig",
    "Params",
    "Qwen35Config",
    "TensorName",
    "config_from_hf",
    "family_of",
    "final_hidden",
    "forward",
    "forward_cached",
    "init_cache",
    "init_params",
    "param_shapes",
    "preset",
    "preset_names",
    "response_hidden",
    "unstack_layers",
]

FAMILIES: dict[str, Family] = {f.name: f for f in (qwen3.FAMILY, qwen35.FAMILY, llada.FAMILY)}
Config: TypeAlias = ModelConfig | Qwen35Config | LLaDAConfig
_BY_CONFIG = {f.config_class: f for f in FAMILIES.values()}


def family_of(config: Any) -> Family:
    """The `Family` whose config class ``config`` is an instance of (a TypeError otherwise)."""
    family = _BY_CONFIG.get(type(config))
    if family is None:
        names = [c.__name__ for c in _BY_CONFIG]
        raise TypeError(
            f"{type(config).__name__} is not a model config of a known family; the families "
            f"take {names} (ais_jax.models.FAMILIES)."
        )
    return family


def _autoregressive(config: Any, what: str) -> Family:
    family = family_of(config)
    if family.kind != "autoregressive":
        raise ValueError(
            f"{what}: the {family.name!r} family is a {family.kind} model; it has no "
            f"{what} (ais_jax.rollout.diffusion samples it)."
        )
    return family


# ---- the entry points -----------------------------------------------------------------------


def init_params(config: Config, key: jax.Array, dtype=jnp.float32) -> Params:
    """Random parameters of ``config``'s family (each family initialises as Hugging Face)."""
    return family_of(config).init_params(config, key, dtype)


def param_shapes(config: Config, dtype=jnp.bfloat16) -> Params:
    """The parameter tree as `jax.ShapeDtypeStruct`s, built without allocating it."""
    return jax.eval_shape(lambda k: init_params(config, k, dtype), jax.random.key(0))


def forward(params: Params, config: Config, tokens_BS, mask_BS=None, **kwargs) -> jax.Array:
    """Logits ``[B, S, V]`` (float32) of a left-padded batch (the family's ``forward``; the
    autoregressive families also take ``return_hidden`` and ``remat``)."""
    return family_of(config).forward(params, config, tokens_BS, mask_BS, **kwargs)


def final_hidden(params: Params, config: Config, tokens_BS, mask_BS=None, **kwargs) -> jax.Array:
    """Final-normed hidden states ``[B, S, D]`` (`qwen3.final_hidden` documents the split)."""
    family = _autoregressive(config, "final_hidden")
    return family.final_hidden(params, config, tokens_BS, mask_BS, **kwargs)


def response_hidden(params: Params, config: Config, *args, **kwargs) -> jax.Array:
    """Hidden states that score B responses to N shared prompts, each prompt run once
    (`qwen3.response_hidden`); an error for a family without it (`Family.response_hidden`)."""
    family = _autoregressive(config, "response_hidden")
    if family.response_hidden is None:
        raise ValueError(f"the {family.name!r} family scores full rows: no response_hidden.")
    return family.response_hidden(params, config, *args, **kwargs)


def init_cache(config: Config, batch: int, max_len: int, dtype=jnp.bfloat16):
    """An empty decoding cache of S = ``max_len`` slots per row (a `nn.cache.KVCache`; for
    Qwen3.5 a `qwen35.HybridCache`)."""
    return _autoregressive(config, "init_cache").init_cache(config, batch, max_len, dtype)


def forward_cached(params: Params, config: Config, tokens_BQ, cache, mask_BQ=None, **kwargs):
    """Append the Q tokens ``tokens_BQ`` to ``cache``: ``(logits, cache)``
    (`qwen3.forward_cached`)."""
    family = _autoregressive(config, "forward_cached")
    return family.forward_cached(params, config, tokens_BQ, cache, mask_BQ, **kwargs)


def unstack_layers(params: Params, config: Config | None = None) -> Params:
    """``params`` with ``layers`` a per-layer list (`nn.layers.unstack_layers`); a family that
    stacks per layer kind (Qwen3.5) needs its ``config``."""
    own = None if config is None else family_of(config).unstack_layers
    return layers.unstack_layers(params) if own is None else own(params, config)


# ---- presets and checkpoints' configs -----------------------------------------------------------


def preset_names(family: str | None = None) -> list[str]:
    """Every preset name `preset` resolves (of one ``family``, or of all)."""
    return [n for f in _families(family) for n in f.presets]


def preset(name: str, family: str | None = None, **overrides: Any) -> Config:
    """The config of preset ``name`` with field overrides: of ``family`` when given, else of
    the first family in `FAMILIES` that has the name (``"tiny"`` is Qwen3's; LLaDA's tiny is
    ``preset("tiny", family="llada")``). Unknown names are a ValueError listing the valid."""
    for f in _families(family):
        if f.config_class is ModelConfig:
            key = name.lower().replace("-", "_").replace(".", "p")
            if key in qwen3.PRESETS:
                return ModelConfig.preset(name, **overrides)
        elif name.lower().replace("_", "-") in f.presets:
            return f.config_class.preset(name.lower().replace("_", "-"), **overrides)
    where = f" of family {family!r}" if family else ""
    raise ValueError(
        f"Unknown model preset {name!r}{where}; valid presets: {preset_names(family)}."
    )


def _families(name: str | None) -> list[Family]:
    if name is None:
        return list(FAMILIES.values())
    if name not in FAMILIES:
        raise ValueError(f"Unknown model family {name!r}; the families: {list(FAMILIES)}.")
    return [FAMILIES[name]]


def config_from_hf(hf: dict[str, Any], *, source: str = "config.json") -> Config:
    """The config of a Hugging Face ``config.json`` dict, by the family whose architectures
    or model types it names; a ValueError naming both and the families' otherwise."""
    archs = hf.get("architectures") or []
    for f in FAMILIES.values():
        if hf.get("model_type") in f.model_types or any(a in f.architectures for a in archs):
            return f.config_class.from_hf_dict(hf, source=source)
    known = [a for f in FAMILIES.values() for a in f.architectures]
    raise ValueError(
        f"{source}: unsupported architecture {archs[0] if archs else None!r} (model_type "
        f"{hf.get('model_type')!r}); ais_jax loads {known}."
    )
