"""Qwen3.5's text model (hybrid Gated DeltaNet + gated attention) as pure functions.

The decoder is Hugging Face's `Qwen3_5ForCausalLM`. Each of its L layers is a token mixer then
the SwiGLU MLP of Qwen3, both pre-normed; the mixer is given by ``config.layer_types``:

* ``"full_attention"``: grouped-query softmax attention with an **output gate**: ``q_proj``
  gives, per head, a query and a gate (``[H, 2E]``: query first), q/k RMSNorm, **partial**
  rotary embeddings (only the first ``rotary_dim = E * partial_rotary_factor`` dims of each
  head rotate) and ``o_proj(attn * sigmoid(gate))``.
* ``"linear_attention"``: Gated DeltaNet. With ``w = in_proj_qkv(x)`` (channels: q, k, v),
  a causal depthwise conv ``w'_t = silu(sum_x conv[:, x] * w_{t-X+1+x})`` over X taps,
  ``q, k`` L2-normalised (and ``q`` scaled by ``I**-0.5``), per value head u and token t::

      beta_t = sigmoid(in_proj_b(x_t))                          write strength in (0, 1)
      g_t    = -exp(a_log) * softplus(in_proj_a(x_t) + dt_bias)  log decay, <= 0
      S_t    = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T     [I, O]
      o_t    = S_t^T q_t

  then a gated RMSNorm ``rms(o_t) * linear_norm * silu(in_proj_z(x_t))`` per head and
  ``out_proj``. Each key head serves ``U // J`` consecutive value heads.

Every RMSNorm except the gated one is zero-centred, ``rms(x) * (1 + w)`` in float32, so its
weights are stored as checkpoints store them (zeros at initialisation).

The delta rule has two equal forms. `gated_delta_rule_recurrent` is the recurrence above, a
`lax.scan` over tokens (the reference, and one decode step). `gated_delta_rule_chunked` is the
training/prefill form (the "WY / UT transform" of the DeltaNet papers). Within a chunk of Z
tokens that starts from state S_0, with in-chunk cumulative log decays ``G_i = sum_{j<=i} g_j``,
the recurrence unrolls to ``S_i = exp(G_i) S_0 + sum_{j<=i} exp(G_i - G_j) k_j Delta_j^T``,
and its writes ``Delta_j = beta_j (v_j - exp(g_j) S_{j-1}^T k_j)`` solve one unit
lower-triangular system::

      (I + A) Delta = beta V - (beta exp(G) K) S_0,    A_ij = beta_i exp(G_i - G_j) k_i.k_j (j < i)
      o_i   = exp(G_i) S_0^T q_i + sum_{j<=i} exp(G_i - G_j) (q_i.k_j) Delta_j
      S_end = exp(G_Z) S_0 + sum_j exp(G_Z - G_j) k_j Delta_j^T

so the work is matmuls inside chunks and a `lax.scan` over the S / Z chunks carries S: linear
in the sequence length.

Precision: every projection (``q/k/v/o_proj``, ``in_proj_qkv/z/b/a``, ``out_proj``, the MLP,
the LM head) goes through `quant.linear`, so a `QArray` weight makes it W8A8 FP8 (see
`quantize_params`). The conv, decay, delta rule, its state, every norm and the rotary angles are
float32 whatever the parameter dtype (the rollout copy stores their weights in bfloat16, as the
trainer's): they are cheap, and the recurrent state accumulates over the whole sequence, so a
low-precision state would compound its rounding error token by token.

Padding: positions with ``mask == False`` (left padding; finished rows in a decode step) have
their conv input zeroed, and ``g = 0``, ``beta = 0``: the recurrent state passes through them
unchanged, so nothing of a pad leaks into later tokens. (transformers zeroes the hidden states
of pads, which leaves a zero state zero; on a left-padded batch from an empty state the two
agree.) `linear_attention_step` leaves a masked row's conv and recurrent states untouched.

Decoding (`init_cache` / `forward_cached`, which `ais_jax.models.init_cache` / `forward_cached`
and so the sampler reach for a `Qwen35Config`): a `HybridCache` holds the KV cache of the
full-attention layers and, per linear-attention layer, a `LinearState` (float32 conv and
recurrent state) instead of a KV cache: a prefill runs the chunked rule from it and keeps the
state after its last token; a decode step is `linear_attention_step`.

Parameters: a dict like `qwen3.py`'s, whose ``layers`` arrays are stacked per layer kind, in
the Hugging Face ``[out, in]`` layout (L layers, La = full-attention layers, Ll = linear ones):

    embed [V, D]   final_norm [D]   lm_head [V, D] (untied only)
    every layer:  input_norm/post_norm [L, D]  gate_proj/up_proj [L, F, D]  down_proj [L, D, F]
    attention:    q_proj [La, 2*H*E, D]  k_proj/v_proj [La, K*E, D]  o_proj [La, D, H*E]
                  q_norm/k_norm [La, E]
    linear attn:  in_proj_qkv [Ll, W, D]  in_proj_z [Ll, U*O, D]  in_proj_b/in_proj_a [Ll, U, D]
                  conv_weight [Ll, W, X]  a_log/dt_bias [Ll, U]  linear_norm [Ll, O]
                  out_proj [Ll, D, U*O]

Layer i of kind k is entry ``config.kind_index[i]`` of its kind's stacks.

Dimensions: docs/design.md's key (B, S, V, D, L, H, K, R, E, F) plus, for a linear-attention layer,
J key heads, U value heads, I key head dim, O value head dim, W = 2*J*I + U*O conv channels,
X conv taps, Y chunks and Z tokens per chunk.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from ais_jax import checks
from ais_jax.models.family import Family, hf_layer_names
from ais_jax.models.qwen3 import HF_LAYER_NAMES, HF_TOP_NAMES
from ais_jax.models.qwen3 import PROJECTIONS as QWEN3_PROJECTIONS
from ais_jax.nn import quant
from ais_jax.nn.cache import KVCache, cache_layout, write_kv
from ais_jax.nn.layers import (
    Params,
    attention,
    embed,
    head_logits,
    mlp,
    positions_from_mask,
    recompute_layer,
    rope,
)
from ais_jax.nn.quant import linear

F32 = jnp.float32
LAYER_TYPES = ("linear_attention", "full_attention")
ARCHITECTURE = "Qwen3_5ForCausalLM"
MODEL_TYPES = ("qwen3_5_text", "qwen3_5")
# Linear weights of the linear-attention layers (quant.LINEAR_WEIGHTS has the others).
LINEAR_ATTENTION_WEIGHTS = quant.LINEAR_ATTENTION_WEIGHTS
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
_LINEAR = LINEAR_ATTENTION_WEIGHTS + ("conv_weight", "a_log", "dt_bias", "linear_norm")
_POSITIVE_FIELDS = (
    "vocab_size hidden_size num_layers num_heads num_kv_heads head_dim intermediate_size "
    "linear_num_key_heads linear_num_value_heads linear_key_head_dim linear_value_head_dim "
    "linear_conv_kernel max_position_embeddings"
).split()
_REQUIRED_HF_FIELDS = (
    "vocab_size hidden_size num_hidden_layers num_attention_heads intermediate_size "
    "linear_num_key_heads linear_num_value_heads linear_key_head_dim linear_value_head_dim"
).split()
_L2_EPS = 1e-6  # inside the rsqrt of q/k's L2 norm, as transformers and the FLA kernels


# ---- config ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen35Config:
    """Qwen3.5 text-decoder hyper-parameters.

    A type of its own rather than more fields on `ModelConfig`: half of these fields mean
    nothing to Qwen3 and `ModelConfig`'s validation (qk-norm xor biases) means nothing here,
    and code that meets a config can tell the families apart by type. The fields Qwen3 shares
    (``vocab_size`` ... ``max_position_embeddings``) have `ModelConfig`'s names, so code that
    only reads those works with either.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel: int = 4
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10_000_000.0
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    max_position_embeddings: int = 262_144

    def __post_init__(self):
        for name in _POSITIVE_FIELDS:
            checks.positive_int(f"Qwen35Config.{name}", getattr(self, name))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"Qwen35Config.layer_types has {len(self.layer_types)} entries for "
                f"num_layers={self.num_layers}; give one per layer."
            )
        bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        if bad:
            raise ValueError(
                f"Qwen35Config.layer_types has unknown type(s) {bad}; valid: {list(LAYER_TYPES)}."
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"Qwen35Config.num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})."
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"Qwen35Config.linear_num_value_heads ({self.linear_num_value_heads}) must be a "
                f"multiple of linear_num_key_heads ({self.linear_num_key_heads})."
            )
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2 or not self.rotary_dim:
            raise ValueError(
                f"Qwen35Config.partial_rotary_factor={self.partial_rotary_factor!r} with "
                f"head_dim={self.head_dim} gives rotary_dim={self.rotary_dim}; it must be in "
                "(0, 1] and give an even, nonzero number of rotated dims."
            )
        for name in ("rope_theta", "rms_norm_eps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Qwen35Config.{name} must be > 0, got {getattr(self, name)!r}.")

    # ---- derived sizes ----
    @property
    def architecture(self) -> str:
        return ARCHITECTURE

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def conv_channels(self) -> int:
        """W: the conv runs over q, k and v of a linear-attention layer."""
        key_dim = self.linear_num_key_heads * self.linear_key_head_dim
        return 2 * key_dim + self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def kind_index(self) -> tuple[int, ...]:
        """Layer i's index within the stacks of its kind."""
        return tuple(self.layer_types[:i].count(t) for i, t in enumerate(self.layer_types))

    @property
    def num_params(self) -> int:
        return sum(math.prod(s.shape) for s in jax.tree_util.tree_leaves(param_shapes(self)))

    @classmethod
    def tiny(cls, vocab_size: int = 512) -> Qwen35Config:
        """A ~1M-parameter shape (4 layers: 3 Gated DeltaNet, then 1 attention) for tests."""
        return cls(
            vocab_size=vocab_size,
            hidden_size=128,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
            intermediate_size=384,
            layer_types=("linear_attention",) * 3 + ("full_attention",),
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            max_position_embeddings=4096,
        )

    @classmethod
    def qwen3p5_9b(cls) -> Qwen35Config:
        """Qwen3.5-9B's text model (about 8.95B parameters with its untied 248,320-id head).
        The numbers are transformers' `Qwen3_5TextConfig` defaults (configuration_qwen3_5.py,
        whose docstring names them "the Qwen3.5-9B style configuration"): 32 layers, every
        fourth full attention (``full_attention_interval`` 4), D 4096, F 12288, 16 query / 4 kv
        heads of 256, 16 key / 32 value linear heads of 128, conv kernel 4, partial rotary
        0.25; rope_theta 10,000 and 32,768 positions are that class's defaults too (neither
        changes a memory plan)."""
        return cls(
            vocab_size=248_320,
            hidden_size=4096,
            num_layers=32,
            num_heads=16,
            num_kv_heads=4,
            head_dim=256,
            intermediate_size=12_288,
            layer_types=interleaved_layer_types(32),
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel=4,
            partial_rotary_factor=0.25,
            rope_theta=10_000.0,
            tie_embeddings=False,
            max_position_embeddings=32_768,
        )

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> Qwen35Config:
        """A preset of `PRESETS` by name (``"qwen3.5-9b"``, ``"qwen3.5-tiny"``) with field
        overrides. Overriding ``num_layers`` without ``layer_types`` gives the family's
        pattern (`interleaved_layer_types`) for the new depth."""
        key = name.lower().replace("_", "-")
        if key not in PRESETS:
            raise ValueError(f"Unknown Qwen3.5 preset {name!r}; valid presets: {list(PRESETS)}.")
        base = getattr(cls, PRESETS[key])()
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(
                f"Qwen3.5 preset {name!r}: unknown field(s) {unknown} (Qwen3-only settings?)."
            )
        if "num_layers" in overrides and "layer_types" not in overrides:
            overrides["layer_types"] = interleaved_layer_types(overrides["num_layers"])
        return dataclasses.replace(base, **overrides)

    # ---- Hugging Face config.json ----
    @classmethod
    def from_hf_dict(cls, hf: Mapping[str, Any], *, source: str = "config.json") -> Qwen35Config:
        """A `Qwen3_5TextConfig` dict (``model_type`` ``qwen3_5_text``), or the multimodal
        ``qwen3_5`` one, whose ``text_config`` is read (its vision part is not a text model's)."""
        model_type = hf.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(
                f"{source}: model_type {model_type!r} is not Qwen3.5; expected {list(MODEL_TYPES)}."
            )
        text = dict(hf)
        if model_type == "qwen3_5":
            if not isinstance(hf.get("text_config"), Mapping):
                raise ValueError(f"{source}: a qwen3_5 config needs a 'text_config' object.")
            text = dict(hf["text_config"])
            if "tie_word_embeddings" in hf:  # the wrapper's flag decides the tie
                text["tie_word_embeddings"] = hf["tie_word_embeddings"]
        required = _REQUIRED_HF_FIELDS
        missing = [k for k in required if k not in text]
        if missing:
            raise ValueError(f"{source}: required Qwen3.5 field(s) {missing} missing.")
        if text.get("num_experts") or text.get("num_experts_per_tok"):
            raise ValueError(f"{source}: Qwen3.5 MoE (num_experts) is not supported.")
        if text.get("attention_bias"):
            raise ValueError(f"{source}: attention_bias=true is not supported for Qwen3.5.")
        if text.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act {text['hidden_act']!r}; only 'silu'.")
        if text.get("attn_output_gate") is False:
            raise ValueError(f"{source}: attn_output_gate=false is not supported.")
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"{source}: rope_type {rope_type!r} is not supported; only 'default'.")
        layers = text["num_hidden_layers"]
        layer_types = text.get("layer_types")
        if layer_types is None:
            layer_types = interleaved_layer_types(layers, text.get("full_attention_interval", 4))
        heads = text["num_attention_heads"]
        return cls(
            vocab_size=text["vocab_size"],
            hidden_size=text["hidden_size"],
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=text.get("num_key_value_heads") or heads,
            head_dim=text.get("head_dim") or text["hidden_size"] // heads,
            intermediate_size=text["intermediate_size"],
            layer_types=tuple(layer_types),
            linear_num_key_heads=text["linear_num_key_heads"],
            linear_num_value_heads=text["linear_num_value_heads"],
            linear_key_head_dim=text["linear_key_head_dim"],
            linear_value_head_dim=text["linear_value_head_dim"],
            linear_conv_kernel=text.get("linear_conv_kernel_dim", 4),
            partial_rotary_factor=float(
                rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
            ),
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10_000.0))),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(text.get("tie_word_embeddings", False)),
            max_position_embeddings=text.get("max_position_embeddings", 262_144),
        )

    def to_hf_dict(self, *, dtype: str = "bfloat16") -> dict[str, Any]:
        """The `Qwen3_5TextConfig` dict of a `Qwen3_5ForCausalLM` checkpoint."""
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3_5_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "layer_types": list(self.layer_types),
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
            },
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_embeddings,
            "attention_bias": False,
            "max_position_embeddings": self.max_position_embeddings,
            "torch_dtype": dtype,
            "dtype": dtype,
        }


# Presets by name (`Qwen35Config.preset`; `ais_jax.models.preset` resolves them too). Only sizes
# with a published config: see each constructor's docstring for where its numbers come from.
PRESETS = {"qwen3.5-9b": "qwen3p5_9b", "qwen3.5-tiny": "tiny"}


def interleaved_layer_types(num_layers: int, interval: int = 4) -> tuple[str, ...]:
    """Qwen3.5's layer pattern: every ``interval``-th layer full attention, the rest Gated
    DeltaNet (transformers' default for a config without ``layer_types``)."""
    return tuple(
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(num_layers)
    )


# ---- parameters -----------------------------------------------------------------------------


def _shapes(c: Qwen35Config) -> dict[str, tuple[int, ...]]:
    L, D, E, F = c.num_layers, c.hidden_size, c.head_dim, c.intermediate_size
    La, Ll = len(c.attention_layers), len(c.linear_layers)
    U, O = c.linear_num_value_heads, c.linear_value_head_dim
    shapes = {
        "input_norm": (L, D),
        "post_norm": (L, D),
        "gate_proj": (L, F, D),
        "up_proj": (L, F, D),
        "down_proj": (L, D, F),
    }
    if La:
        HE, KE = c.num_heads * E, c.num_kv_heads * E
        shapes |= {
            "q_proj": (La, 2 * HE, D),
            "k_proj": (La, KE, D),
            "v_proj": (La, KE, D),
            "o_proj": (La, D, HE),
            "q_norm": (La, E),
            "k_norm": (La, E),
        }
    if Ll:
        shapes |= {
            "in_proj_qkv": (Ll, c.conv_channels, D),
            "in_proj_z": (Ll, U * O, D),
            "in_proj_b": (Ll, U, D),
            "in_proj_a": (Ll, U, D),
            "conv_weight": (Ll, c.conv_channels, c.linear_conv_kernel),
            "a_log": (Ll, U),
            "dt_bias": (Ll, U),
            "linear_norm": (Ll, O),
            "out_proj": (Ll, D, U * O),
        }
    return shapes


def init_params(config: Qwen35Config, key: jax.Array, dtype=jnp.float32) -> Params:
    """Random parameters as Hugging Face initialises them: matrices N(0, 0.02^2), zero-centred
    norms 0, the gated norm 1, ``dt_bias`` 1, ``a_log = log(Uniform(0.01, 16))``."""
    shapes = _shapes(config)
    keys = iter(jax.random.split(key, len(shapes) + 2))
    layers = {}
    for name, shape in shapes.items():
        k = next(keys)
        if name.endswith("norm") and name != "linear_norm":
            layers[name] = jnp.zeros(shape, dtype)
        elif name in ("linear_norm", "dt_bias"):
            layers[name] = jnp.ones(shape, dtype)
        elif name == "a_log":
            layers[name] = jnp.log(jax.random.uniform(k, shape, F32, 0.01, 16.0)).astype(dtype)
        else:
            layers[name] = (0.02 * jax.random.normal(k, shape)).astype(dtype)
    params = {
        "embed": (
            0.02 * jax.random.normal(next(keys), (config.vocab_size, config.hidden_size))
        ).astype(dtype),
        "final_norm": jnp.zeros((config.hidden_size,), dtype),
        "layers": layers,
    }
    if not config.tie_embeddings:
        params["lm_head"] = (
            0.02 * jax.random.normal(next(keys), (config.vocab_size, config.hidden_size))
        ).astype(dtype)
    return params


def param_shapes(config: Qwen35Config, dtype=jnp.bfloat16) -> Params:
    """The parameter tree as `jax.ShapeDtypeStruct`s, built without allocating it."""
    return jax.eval_shape(lambda k: init_params(config, k, dtype), jax.random.key(0))


def quantize_params(
    params: Mapping[str, Any],
    fmt: str = "float8_e4m3fn",
    *,
    act_scaling: str = "tensor",
    lm_head: bool = False,
) -> dict[str, Any]:
    """The rollout copy: `quant.quantize_params`, which quantizes the linear-attention
    projections (``in_proj_qkv/z/b/a``, ``out_proj``, in `quant.PROJECTIONS`) with the others.
    Conv, decay parameters and norms stay bfloat16 (and compute in float32)."""
    return quant.quantize_params(params, fmt, act_scaling=act_scaling, lm_head=lm_head)


def layer_indices(config: Qwen35Config, name: str) -> tuple[int, ...]:
    """The layers whose stacked ``layers[name]`` arrays hold one entry each, in order."""
    if name in _ATTENTION:
        return config.attention_layers
    if name in _LINEAR:
        return config.linear_layers
    return tuple(range(config.num_layers))


def _layer_params(params: Params, c: Qwen35Config, i: int) -> Params:
    """Layer i's arrays (each stack indexed at the layer's position within its kind)."""
    layers = params["layers"]
    if isinstance(layers, list | tuple):  # unstacked (see `unstack_layers`)
        return layers[i]
    names = ("input_norm", "post_norm", "gate_proj", "up_proj", "down_proj")
    kind = _ATTENTION if c.layer_types[i] == "full_attention" else _LINEAR
    out = {n: _index(layers[n], i) for n in names}
    return out | {n: _index(layers[n], c.kind_index[i]) for n in kind}


def _index(a, i: int):
    return jax.tree_util.tree_map(lambda x: x[i], a)  # a QArray indexes its codes and scales


def unstack_layers(params: Params, config: Qwen35Config) -> Params:
    """``params`` with ``layers`` as a list of L per-layer dicts (each with its kind's arrays);
    the model takes either form (see `nn.layers.unstack_layers`)."""
    if isinstance(params["layers"], list | tuple):
        return params
    layers = [_layer_params(params, config, i) for i in range(config.num_layers)]
    return {**params, "layers": layers}


# ---- building blocks ------------------------------------------------------------------------


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Zero-centred RMSNorm ``x / rms(x) * (1 + w)``, all in float32, cast back to x's dtype."""
    x32 = x.astype(F32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * (1.0 + jnp.broadcast_to(weight.astype(F32), x.shape))).astype(x.dtype)


def gated_rms_norm(o: jax.Array, z: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """``o / rms(o) * w * silu(z)`` over the last axis, in float32 (w is NOT zero-centred)."""
    o32 = o.astype(F32)
    o32 = o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True) + eps)
    return o32 * jnp.broadcast_to(weight.astype(F32), o.shape) * jax.nn.silu(z.astype(F32))


def _partial_rope(x_BSHE: jax.Array, positions_BS: jax.Array, c: Qwen35Config) -> jax.Array:
    """Rotate-half RoPE on the first ``rotary_dim`` dims of each head; the rest pass."""
    r = c.rotary_dim
    rotated = rope(x_BSHE[..., :r], positions_BS, c.rope_theta)
    return jnp.concatenate([rotated, x_BSHE[..., r:]], axis=-1)


# ---- gated attention ------------------------------------------------------------------------


def _gated_attention(lp, c: Qwen35Config, h_BSD, positions_BS, mask_BS, allowed_BSS, kv=None):
    """Gated attention of S queries; ``kv(k_BSKE, v_BSKE) -> (k_BKXE, v_BKEX)`` gives the X
    keys/values attended over (default: these S in `layers.attention`'s layouts; a decode step
    writes them into its KV cache and returns the cache), ``allowed_BSS`` is then ``[B, S, X]``."""
    B, S, _ = h_BSD.shape
    H, K, E = c.num_heads, c.num_kv_heads, c.head_dim
    qg = linear(h_BSD, lp["q_proj"], row_mask=mask_BS).reshape(B, S, H, 2 * E)
    q_BSHE, gate_BSHE = qg[..., :E], qg[..., E:]
    k_BSKE = linear(h_BSD, lp["k_proj"], row_mask=mask_BS).reshape(B, S, K, E)
    v_BSKE = linear(h_BSD, lp["v_proj"], row_mask=mask_BS).reshape(B, S, K, E)
    q_BSHE = _partial_rope(rms_norm(q_BSHE, lp["q_norm"], c.rms_norm_eps), positions_BS, c)
    k_BSKE = _partial_rope(rms_norm(k_BSKE, lp["k_norm"], c.rms_norm_eps), positions_BS, c)
    k_BKXE, v_BKEX = (kv or cache_layout)(k_BSKE, v_BSKE)
    out_BSX = attention(q_BSHE, k_BKXE, v_BKEX, allowed_BSS)
    gated = out_BSX * jax.nn.sigmoid(gate_BSHE.reshape(B, S, H * E))
    return linear(gated, lp["o_proj"], row_mask=mask_BS)


# ---- the gated delta rule -------------------------------------------------------------------


def _wide(a: jax.Array) -> jax.Array:
    """``a`` in float32, or float64 if it is (the gradient checks run the rule in float64)."""
    return a.astype(jnp.promote_types(a.dtype, F32))


def gated_delta_rule_recurrent(q_BSUI, k_BSUI, v_BSUO, g_BSU, beta_BSU, state_BUIO):
    """The token-by-token recurrence (a `lax.scan` over S), float32; returns ``(o_BSUO,
    final state_BUIO)``. ``q`` and ``k`` come normalised (and ``q`` scaled); ``g`` is the log
    decay (<= 0), ``beta`` the write strength. Per token::

        S = exp(g) S;   S += k (beta (v - S^T k))^T;   o = S^T q
    """
    q, k, v, g, beta = map(_wide, (q_BSUI, k_BSUI, v_BSUO, g_BSU, beta_BSU))

    def step(state_BUIO, inputs):
        q_BUI, k_BUI, v_BUO, g_BU, beta_BU = inputs
        state_BUIO = state_BUIO * jnp.exp(g_BU)[..., None, None]
        read_BUO = jnp.einsum("buio,bui->buo", state_BUIO, k_BUI)
        delta_BUO = (v_BUO - read_BUO) * beta_BU[..., None]
        state_BUIO = state_BUIO + k_BUI[..., :, None] * delta_BUO[..., None, :]
        return state_BUIO, jnp.einsum("buio,bui->buo", state_BUIO, q_BUI)

    swap = lambda a: jnp.moveaxis(a, 1, 0)  # noqa: E731  [B, S, ...] <-> [S, B, ...]
    state, o_SBUO = jax.lax.scan(step, _wide(state_BUIO), tuple(map(swap, (q, k, v, g, beta))))
    return swap(o_SBUO), state


def unit_lower_inverse(a_NZZ: jax.Array) -> jax.Array:
    """``(I + a)^-1`` for strictly lower-triangular ``a`` (``[..., Z, Z]``), by matmuls only.

    Block inversion, doubling the block size from 1 to Z (padded to a power of two with
    zeros, i.e. identity rows): with the diagonal blocks' inverses ``P`` and ``Q`` known,
    ``[[L11, 0], [L21, L22]]^-1 = [[P, 0], [-Q L21 P, Q]]``. Work ``~Z^3 / 3`` like a
    substitution, in log2(Z) batched matmul rounds, so it is the GPU/TPU-friendly form too.
    It also replaces `jax.scipy.linalg.solve_triangular`, whose LAPACK custom call on
    XLA:CPU (jaxlib 0.10.2) deadlocks when two batched solves run at once on a 2-thread pool
    (seen as a hang of the training step at batch >= 64)."""
    Z = a_NZZ.shape[-1]
    P = 1 << max(Z - 1, 0).bit_length()  # next power of two >= Z
    lead = a_NZZ.shape[:-2]
    a = jnp.pad(a_NZZ, [(0, 0)] * len(lead) + [(0, P - Z), (0, P - Z)])
    inv = jnp.ones(lead + (P, 1, 1), a.dtype)  # the 1x1 diagonal blocks' inverses
    s = 1
    while s < P:
        n = P // (2 * s)
        blocks = a.reshape(lead + (n, 2 * s, n, 2 * s))
        blocks = jnp.moveaxis(jnp.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)  # [.., n, 2s, 2s]
        inv = inv.reshape(lead + (n, 2, s, s))
        p, q = inv[..., 0, :, :], inv[..., 1, :, :]
        lower = -q @ blocks[..., s:, :s] @ p
        zeros = jnp.zeros_like(p)
        inv = jnp.concatenate(
            [jnp.concatenate([p, zeros], -1), jnp.concatenate([lower, q], -1)], -2
        )
        s *= 2
    return inv.reshape(lead + (P, P))[..., :Z, :Z]


def gated_delta_rule_chunked(
    q_BSUI, k_BSUI, v_BSUO, g_BSU, beta_BSU, state_BUIO, chunk_size: int = 64
):
    """The same map as `gated_delta_rule_recurrent` in chunks of Z = ``chunk_size`` tokens
    (the module docstring has the equations): one unit-triangular inverse and a few matmuls per
    chunk, all chunks at once, then a `lax.scan` over the Y chunks that carries the state.
    S is padded up to a multiple of Z with ``g = beta = k = 0`` tokens, which pass the state
    through unchanged."""
    B, S, U, I = k_BSUI.shape
    O = v_BSUO.shape[-1]
    Z = min(chunk_size, S)
    pad = -S % Z
    Y = (S + pad) // Z

    def chunks(a):  # [B, S, U, ...] -> [B, Y, U, Z, ...] in float32
        a = jnp.pad(_wide(a), [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        return jnp.swapaxes(a.reshape(B, Y, Z, *a.shape[2:]), 2, 3)

    q, k, v = chunks(q_BSUI), chunks(k_BSUI), chunks(v_BSUO)  # [B, Y, U, Z, I|O]
    g_BYUZ, beta_BYUZ = chunks(g_BSU), chunks(beta_BSU)
    G_BYUZ = jnp.cumsum(g_BYUZ, axis=-1)  # in-chunk cumulative log decay
    i_Z, j_Z = jnp.arange(Z)[:, None], jnp.arange(Z)[None, :]
    causal_ZZ, strict_ZZ = (m[None, None, None] for m in (i_Z >= j_Z, i_Z > j_Z))  # [1, 1, 1, Z, Z]
    diff = G_BYUZ[..., :, None] - G_BYUZ[..., None, :]  # G_i - G_j, <= 0 where i >= j
    decay_BYUZZ = jnp.where(causal_ZZ, jnp.exp(jnp.where(causal_ZZ, diff, 0.0)), 0.0)

    beta_k = k * beta_BYUZ[..., None]
    A = jnp.einsum("byuzi,byuxi->byuzx", beta_k, k) * jnp.where(strict_ZZ, decay_BYUZZ, 0.0)
    rhs = jnp.concatenate([v * beta_BYUZ[..., None], beta_k * jnp.exp(G_BYUZ)[..., None]], -1)
    solved = jnp.einsum("byuzx,byuxc->byuzc", unit_lower_inverse(A), rhs)
    u_BYUZO, w_BYUZI = solved[..., :O], solved[..., O:]
    qk_BYUZZ = jnp.einsum("byuzi,byuxi->byuzx", q, k) * decay_BYUZZ
    q_decayed = q * jnp.exp(G_BYUZ)[..., None]
    k_decayed = k * jnp.exp(G_BYUZ[..., -1:] - G_BYUZ)[..., None]
    chunk_decay_BYU = jnp.exp(G_BYUZ[..., -1])

    def step(state_BUIO, xs):
        u, w, qk, qd, kd, decay_BU = xs
        delta_BUZO = u - jnp.einsum("buzi,buio->buzo", w, state_BUIO)
        o_BUZO = jnp.einsum("buzi,buio->buzo", qd, state_BUIO)
        o_BUZO = o_BUZO + jnp.einsum("buzx,buxo->buzo", qk, delta_BUZO)
        state_BUIO = state_BUIO * decay_BU[..., None, None] + jnp.einsum(
            "buzi,buzo->buio", kd, delta_BUZO
        )
        return state_BUIO, o_BUZO

    xs = (u_BYUZO, w_BYUZI, qk_BYUZZ, q_decayed, k_decayed, chunk_decay_BYU)
    state, o_YBUZO = jax.lax.scan(step, _wide(state_BUIO), [jnp.moveaxis(a, 1, 0) for a in xs])
    o_BSUO = o_YBUZO.transpose(1, 0, 3, 2, 4).reshape(B, Y * Z, U, O)[:, :S]
    return o_BSUO, state


# ---- Gated DeltaNet layer -------------------------------------------------------------------


@struct.dataclass
class LinearState:
    """One linear-attention layer's decoding state (float32).

    conv: ``[B, X-1, W]`` the conv inputs of the last X-1 tokens (zeros before the first);
    recurrent: ``[B, U, I, O]`` the delta-rule state S.
    """

    conv: jax.Array
    recurrent: jax.Array


def init_linear_state(config: Qwen35Config, batch: int) -> LinearState:
    c = config
    return LinearState(
        conv=jnp.zeros((batch, c.linear_conv_kernel - 1, c.conv_channels), F32),
        recurrent=jnp.zeros(
            (batch, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim),
            F32,
        ),
    )


def _linear_inputs(lp, c: Qwen35Config, h_BSD, mask_BS):
    """The projections of a linear-attention layer: conv input ``w_BSW`` (zero on masked
    tokens), ``z``, and float32 ``g_BSU`` / ``beta_BSU`` (zero on masked tokens)."""
    w_BSW = linear(h_BSD, lp["in_proj_qkv"], row_mask=mask_BS).astype(F32)
    w_BSW = jnp.where(mask_BS[..., None], w_BSW, 0.0)
    z = linear(h_BSD, lp["in_proj_z"], row_mask=mask_BS)
    b_BSU = linear(h_BSD, lp["in_proj_b"], row_mask=mask_BS).astype(F32)
    a_BSU = linear(h_BSD, lp["in_proj_a"], row_mask=mask_BS).astype(F32)
    a_log_BSU, dt_bias_BSU = (
        jnp.broadcast_to(lp[n].astype(F32), a_BSU.shape) for n in ("a_log", "dt_bias")
    )
    g_BSU = -jnp.exp(a_log_BSU) * jax.nn.softplus(a_BSU + dt_bias_BSU)
    g_BSU = jnp.where(mask_BS[..., None], g_BSU, 0.0)
    beta_BSU = jnp.where(mask_BS[..., None], jax.nn.sigmoid(b_BSU), 0.0)
    return w_BSW, z, g_BSU, beta_BSU


def _causal_conv(w_BSW, conv_BXW, weight_WX):
    """Depthwise causal conv + SiLU over ``[previous X-1 inputs; w]``, float32; returns the S
    outputs and the new conv state (the last X-1 inputs)."""
    X = weight_WX.shape[-1]
    S = w_BSW.shape[1]
    full = jnp.concatenate([conv_BXW, w_BSW], axis=1)  # [B, X-1+S, W]
    weight_11WX = weight_WX.astype(F32)[None, None]
    out = sum(full[:, x : x + S] * weight_11WX[..., x] for x in range(X))  # X taps, unrolled
    return jax.nn.silu(out), full[:, S:]


def _qkv_heads(c: Qwen35Config, w_BSW):
    """Split the conv output into q, k (L2-normalised, q scaled by I**-0.5, repeated from J key
    heads to U value heads) and v."""
    B, S, _ = w_BSW.shape
    J, U, I, O = (
        c.linear_num_key_heads,
        c.linear_num_value_heads,
        c.linear_key_head_dim,
        c.linear_value_head_dim,
    )
    q_BSJI = w_BSW[..., : J * I].reshape(B, S, J, I)
    k_BSJI = w_BSW[..., J * I : 2 * J * I].reshape(B, S, J, I)
    v_BSUO = w_BSW[..., 2 * J * I :].reshape(B, S, U, O)

    def l2(x):
        return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + _L2_EPS)

    q_BSUI = jnp.repeat(l2(q_BSJI) * I**-0.5, U // J, axis=2)
    k_BSUI = jnp.repeat(l2(k_BSJI), U // J, axis=2)
    return q_BSUI, k_BSUI, v_BSUO


def _linear_output(lp, c: Qwen35Config, o_BSUO, z, mask_BS, dtype):
    B, S = o_BSUO.shape[:2]
    U, O = c.linear_num_value_heads, c.linear_value_head_dim
    normed = gated_rms_norm(o_BSUO, z.reshape(B, S, U, O), lp["linear_norm"], c.rms_norm_eps)
    return linear(normed.reshape(B, S, U * O).astype(dtype), lp["out_proj"], row_mask=mask_BS)


def linear_attention(
    lp: Params,
    config: Qwen35Config,
    h_BSD: jax.Array,
    mask_BS: jax.Array,
    state: LinearState,
    *,
    chunk_size: int = 64,
) -> tuple[jax.Array, LinearState]:
    """A Gated DeltaNet mixer over S tokens (chunked delta rule) from ``state``; returns its
    output ``[B, S, D]`` (``h``'s dtype) and the state after the last token. Masked tokens
    must be left padding (or trailing finished tokens): they leave the recurrent state as it
    was; their conv input is zero."""
    w_BSW, z, g_BSU, beta_BSU = _linear_inputs(lp, config, h_BSD, mask_BS)
    w_BSW, conv = _causal_conv(w_BSW, state.conv, lp["conv_weight"])
    q_BSUI, k_BSUI, v_BSUO = _qkv_heads(config, w_BSW)
    o_BSUO, recurrent = gated_delta_rule_chunked(
        q_BSUI, k_BSUI, v_BSUO, g_BSU, beta_BSU, state.recurrent, chunk_size
    )
    out = _linear_output(lp, config, o_BSUO, z, mask_BS, h_BSD.dtype)
    return out, LinearState(conv=conv, recurrent=recurrent)


def linear_attention_step(
    lp: Params, config: Qwen35Config, h_BD: jax.Array, mask_B: jax.Array, state: LinearState
) -> tuple[jax.Array, LinearState]:
    """One token per row of a Gated DeltaNet mixer (the decode step): the recurrence's single
    update and a conv over the X-1 stored inputs. Rows with ``mask_B == False`` keep their
    conv and recurrent states bitwise; their output is finite and meaningless."""
    h_B1D, mask_B1 = h_BD[:, None], mask_B[:, None]
    w_B1W, z, g_B1U, beta_B1U = _linear_inputs(lp, config, h_B1D, mask_B1)
    w_B1W, conv = _causal_conv(w_B1W, state.conv, lp["conv_weight"])
    q_B1UI, k_B1UI, v_B1UO = _qkv_heads(config, w_B1W)
    o_B1UO, recurrent = gated_delta_rule_recurrent(
        q_B1UI, k_B1UI, v_B1UO, g_B1U, beta_B1U, state.recurrent
    )
    out = _linear_output(lp, config, o_B1UO, z, mask_B1, h_BD.dtype)[:, 0]
    keep = lambda new, old: jnp.where(  # noqa: E731
        mask_B.reshape((-1,) + (1,) * (old.ndim - 1)), new, old
    )
    return out, LinearState(conv=keep(conv, state.conv), recurrent=keep(recurrent, state.recurrent))


# ---- full sequence --------------------------------------------------------------------------


def forward(
    params: Params,
    config: Qwen35Config,
    tokens_BS: jax.Array,
    mask_BS: jax.Array | None = None,
    *,
    return_hidden: bool = False,
    chunk_size: int = 64,
    remat: bool = False,
) -> jax.Array:
    """Logits ``[B, S, V]`` (float32) of a left-padded batch; ``mask_BS`` marks valid tokens
    (positions are `layers.positions_from_mask`'s). Padded positions give finite values that
    no valid position depends on. ``chunk_size`` is the delta rule's Z (any value gives the
    same function). With ``remat`` the backward pass recomputes each layer
    (`layers.recompute_layer`)."""
    c = config
    B, S = tokens_BS.shape
    mask_BS = jnp.ones((B, S), bool) if mask_BS is None else mask_BS.astype(bool)
    positions_BS = positions_from_mask(mask_BS)
    allowed_BSS = jnp.tril(jnp.ones((S, S), bool))[None] & mask_BS[:, None, :]
    x_BSD = embed(params["embed"], tokens_BS)

    def layer(kind: str, lp, xs, consts):
        (x_BSD,), (positions_BS, mask_BS, allowed_BSS, empty) = xs, consts
        h_BSD = rms_norm(x_BSD, lp["input_norm"], c.rms_norm_eps)
        if kind == "full_attention":
            mixed = _gated_attention(lp, c, h_BSD, positions_BS, mask_BS, allowed_BSS)
        else:
            mixed, _ = linear_attention(lp, c, h_BSD, mask_BS, empty, chunk_size=chunk_size)
        x_BSD = x_BSD + mixed
        return (x_BSD + mlp(lp, rms_norm(x_BSD, lp["post_norm"], c.rms_norm_eps), mask_BS),)

    layers = {kind: functools.partial(layer, kind) for kind in LAYER_TYPES}
    if remat:
        layers = {kind: recompute_layer(fn) for kind, fn in layers.items()}
    consts = (positions_BS, mask_BS, allowed_BSS, init_linear_state(c, B))
    for i in range(c.num_layers):
        (x_BSD,) = layers[c.layer_types[i]](_layer_params(params, c, i), (x_BSD,), consts)
    if return_hidden:
        return x_BSD
    x_BSD = rms_norm(x_BSD, params["final_norm"], c.rms_norm_eps)
    return head_logits(params, x_BSD, mask_BS)


def final_hidden(
    params: Params,
    config: Qwen35Config,
    tokens_BS: jax.Array,
    mask_BS: jax.Array | None = None,
    *,
    chunk_size: int = 64,
    remat: bool = False,
) -> jax.Array:
    """The final-normed hidden states ``[B, S, D]``: ``forward(...) == layers.head_logits(params,
    final_hidden(...), mask_BS)`` (the split `qwen3.final_hidden` documents); ``remat`` as in
    `forward`."""
    x_BSD = forward(
        params, config, tokens_BS, mask_BS, return_hidden=True, chunk_size=chunk_size, remat=remat
    )
    return rms_norm(x_BSD, params["final_norm"], config.rms_norm_eps)


# ---- decoding: the KV cache of the attention layers and the state of the linear ones ---------


@struct.dataclass
class HybridCache:
    """What a Qwen3.5 decode step reads and writes: ``attention``, a `cache.KVCache` whose k/v
    tuples hold the La full-attention layers (in layer order; its ``valid``, ``next_pos`` and
    ``index`` serve every layer), and ``linear``, one `LinearState` per linear-attention layer
    (Ll of them, float32: the X-1 last conv inputs ``[B, X-1, W]`` and the delta-rule state
    ``[B, U, I, O]``). The recurrent state replaces the KV cache of a linear layer: its size
    does not grow with the sequence."""

    attention: KVCache
    linear: tuple[LinearState, ...]


def init_cache(config: Qwen35Config, batch: int, max_len: int, dtype=jnp.bfloat16) -> HybridCache:
    """An empty cache (`qwen3.init_cache`'s signature): S = ``max_len`` KV slots per row for
    each attention layer, keys and values in ``dtype``, and zero float32 states (the state
    before any token) for each linear-attention layer."""
    c = config
    K, E = c.num_kv_heads, c.head_dim
    attention_layers = range(len(c.attention_layers))
    kv = KVCache(
        k=tuple(jnp.zeros((batch, K, max_len, E), dtype) for _ in attention_layers),
        v=tuple(jnp.zeros((batch, K, E, max_len), dtype) for _ in attention_layers),
        valid=jnp.zeros((batch, max_len), bool),
        next_pos=jnp.zeros((batch,), jnp.int32),
        index=jnp.zeros((), jnp.int32),
    )
    return HybridCache(
        attention=kv, linear=tuple(init_linear_state(c, batch) for _ in c.linear_layers)
    )


def forward_cached(
    params: Params,
    config: Qwen35Config,
    tokens_BQ: jax.Array,
    cache: HybridCache,
    mask_BQ: jax.Array | None = None,
    *,
    last_only: bool = False,
    chunk_size: int = 64,
) -> tuple[jax.Array, HybridCache]:
    """`qwen3.forward_cached` for Qwen3.5: append the Q tokens ``tokens_BQ`` and return their
    float32 logits ``[B, Q, V]`` (``[B, 1, V]`` with ``last_only``) and the new cache.

    Attention layers write their keys/values into the cache's slots and attend over it, as
    Qwen3's. Linear-attention layers continue from their `LinearState`: a prefill (Q > 1, left
    padded) runs the chunked delta rule (`linear_attention`) from the stored state and keeps
    the state after its last token; a decode step (Q = 1) is `linear_attention_step`. Tokens
    with ``mask_BQ == False`` (left padding; finished rows in a decode step) leave every state
    as it was and are never attended to. Tokens after the first call must be Q = 1 steps or
    fully valid rows (a masked token inside a row after real ones would zero its conv input
    but still shift the conv window)."""
    c = config
    B, Q = tokens_BQ.shape
    mask_BQ = jnp.ones((B, Q), bool) if mask_BQ is None else mask_BQ.astype(bool)
    kv = cache.attention
    S = kv.valid.shape[1]
    start = kv.index
    positions_BQ = positions_from_mask(mask_BQ, kv.next_pos)
    valid_BS = jax.lax.dynamic_update_slice(kv.valid, mask_BQ, (0, start))
    slot_S = jnp.arange(S)
    allowed_BQS = valid_BS[:, None, :] & (slot_S[None, :] <= start + jnp.arange(Q)[:, None])[None]
    k_cache, v_cache, states = list(kv.k), list(kv.v), list(cache.linear)
    x_BQD = embed(params["embed"], tokens_BQ)
    for i in range(c.num_layers):
        lp, j = _layer_params(params, c, i), c.kind_index[i]
        h_BQD = rms_norm(x_BQD, lp["input_norm"], c.rms_norm_eps)
        if c.layer_types[i] == "full_attention":

            def write(k_BQKE, v_BQKE, j=j):
                k_cache[j], v_cache[j] = write_kv(k_cache[j], v_cache[j], k_BQKE, v_BQKE, start)
                return k_cache[j], v_cache[j]

            mixed = _gated_attention(lp, c, h_BQD, positions_BQ, mask_BQ, allowed_BQS, write)
        elif Q == 1:
            mixed_BD, states[j] = linear_attention_step(
                lp, c, h_BQD[:, 0], mask_BQ[:, 0], states[j]
            )
            mixed = mixed_BD[:, None]
        else:
            mixed, states[j] = linear_attention(
                lp, c, h_BQD, mask_BQ, states[j], chunk_size=chunk_size
            )
        x_BQD = x_BQD + mixed
        x_BQD = x_BQD + mlp(lp, rms_norm(x_BQD, lp["post_norm"], c.rms_norm_eps), mask_BQ)
    x_BQD = rms_norm(x_BQD, params["final_norm"], c.rms_norm_eps)
    row_mask_BQ = mask_BQ
    if last_only:
        x_BQD, row_mask_BQ = x_BQD[:, -1:], mask_BQ[:, -1:]
    new_kv = KVCache(
        k=tuple(k_cache),
        v=tuple(v_cache),
        valid=valid_BS,
        next_pos=kv.next_pos + mask_BQ.sum(-1, dtype=jnp.int32),
        index=start + Q,
    )
    return head_logits(params, x_BQD, row_mask_BQ), HybridCache(
        attention=new_kv, linear=tuple(states)
    )


# ---- the family ---------------------------------------------------------------------------------

# our per-layer name -> Hugging Face suffix: the MLP and norms as Qwen3, then each mixer's own
HF_LAYER_NAMES_35 = {
    **{k: v for k, v in HF_LAYER_NAMES.items() if "bias" not in k},
    "in_proj_qkv": "linear_attn.in_proj_qkv.weight",
    "in_proj_z": "linear_attn.in_proj_z.weight",
    "in_proj_b": "linear_attn.in_proj_b.weight",
    "in_proj_a": "linear_attn.in_proj_a.weight",
    "conv_weight": "linear_attn.conv1d.weight",  # [W, 1, X] there, [W, X] here
    "a_log": "linear_attn.A_log",
    "dt_bias": "linear_attn.dt_bias",
    "linear_norm": "linear_attn.norm.weight",
    "out_proj": "linear_attn.out_proj.weight",
}
TEXT_PREFIX = "model.language_model."  # the multimodal wrapper's text model
log = logging.getLogger(__name__)


def tensor_names(config: Qwen35Config) -> dict:
    """Every Hugging Face tensor name of a Qwen3.5 text model -> `family.TensorName`: each
    kind's tensors on the layers of that kind."""

    def file_shape(name, shape):
        return (shape[0], 1, shape[1]) if name == "conv_weight" else shape

    return hf_layer_names(
        HF_TOP_NAMES,
        HF_LAYER_NAMES_35,
        param_shapes(config),
        lambda name: layer_indices(config, name),
        file_shape=file_shape,
    )


def text_tensors(path, tensors: dict) -> dict:
    """The text model's tensors under `Qwen3_5ForCausalLM`'s names. A multimodal checkpoint
    (``model.language_model.*``) is renamed; its vision tower (``model.visual.*``) and the
    multi-token-prediction head (``mtp.*``) are not part of the text model and are dropped
    with a log note, as transformers does."""
    multimodal = any(name.startswith(TEXT_PREFIX) for name in tensors)
    text, ignored = {}, []
    for name, tensor in tensors.items():
        if multimodal and name.startswith(TEXT_PREFIX):
            text["model." + name[len(TEXT_PREFIX) :]] = tensor
        elif name.startswith(("model.visual.", "mtp.")):
            ignored.append(name)
        else:
            text[name] = tensor
    if ignored:
        groups = sorted({".".join(n.split(".")[:2]) for n in ignored})
        log.info(
            "%s: ignoring %d tensor(s) that are not the Qwen3.5 text model (%s).",
            path,
            len(ignored),
            ", ".join(groups),
        )
    return text


FAMILY = Family(
    name="qwen35",
    kind="autoregressive",
    config_class=Qwen35Config,
    presets=tuple(PRESETS),
    architectures=(ARCHITECTURE,),
    model_types=MODEL_TYPES,
    init_params=init_params,
    forward=forward,
    unstack_layers=unstack_layers,
    tensor_names=tensor_names,
    head_name=HF_TOP_NAMES["lm_head"],
    projections=QWEN3_PROJECTIONS + LINEAR_ATTENTION_WEIGHTS,
    final_hidden=final_hidden,
    init_cache=init_cache,
    forward_cached=forward_cached,
    file_tensors=text_tensors,
)
