"""Qwen3 (and Qwen2, and Llama) as pure functions over a parameter pytree.

The decoder is exactly Hugging Face's `Qwen3ForCausalLM`: RMSNorm (float32 statistics), per-head
q/k RMSNorm before RoPE (Qwen3; off for Qwen2, which has q/k/v biases instead), rotate-half RoPE
with the config's `rope_theta`, grouped-query attention, SwiGLU MLP, tied or untied embeddings.

Parameters are a plain dict whose per-layer arrays are stacked along a leading L axis, in the
Hugging Face `[out, in]` layout:

    embed [V, D]   final_norm [D]   lm_head [V, D] (untied only)
    layers: input_norm [L, D]  q_proj [L, H*E, D]  k_proj/v_proj [L, K*E, D]  o_proj [L, D, H*E]
            q_norm/k_norm [L, E] (Qwen3)  q_bias [L, H*E]  k_bias/v_bias [L, K*E] (Qwen2)
            post_norm [L, D]  gate_proj/up_proj [L, F, D]  down_proj [L, D, F]

``layers`` may also be a list of L per-layer dicts (`unstack_layers`), which the sampler uses
inside its decode loop, and a layer's q/k/v and gate/up weights may be held as one
``qkv_proj [K*(R+2)*E, D]`` and one ``gate_up_proj [2*F, D]`` (`fuse_projections`: two
matmuls where there were five).

Every matmul goes through `quant.linear`, so the same code is the BF16 trainer (plain arrays)
and the FP8 rollout engine (`QArray` weights). The compute dtype is the embedding's dtype;
logits are always float32.

Three entry points share one layer function:
- `forward(params, config, tokens_BS, mask_BS)`: full sequence, for training and scoring; it is
  `head_logits(params, final_hidden(...))`, and the two halves serve callers that apply the
  LM head to a few positions at a time (the trainer's chunked log-softmax, `train.logprobs`).
- `response_hidden(params, config, prompt_tokens_NP, prompt_mask_NP, tokens_BT, mask_BT)`: the
  hidden states that score B responses to N prompts (G = B / N consecutive rows per prompt,
  GRPO's groups), each prompt run once: what the trainer's log-probs run on.
- `forward_cached(params, config, tokens_BQ, cache, mask_BQ)`: writes the new keys/values into a
  `KVCache` and attends over it; a batched prefill and one-token decode steps are both this call.
Positions come from the padding mask (left padding: position = number of earlier valid tokens).

`ModelConfig` carries exactly the fields Hugging Face's `Qwen3Config` / `Qwen2Config` /
`LlamaConfig` need: the three differ only by `qk_norm` (Qwen3: RMSNorm on each query and key head
before RoPE) and `attention_bias` (Qwen2: biases on the q/k/v projections); Llama has neither, so
one family serves all three (`FAMILY`, listed in `ais_jax.models`). `head_dim` is decoupled from
`hidden_size // num_heads`, as in Qwen3. Presets are constructors: `ModelConfig.qwen3_8b()`,
`ModelConfig.tiny()`; real sizes are checked against the published `config.json` files.

Dimensions (docs/design.md's key): B rows, S sequence positions (a `forward`'s tokens; a KV cache's
slots), V vocabulary, D model, L layers, H query heads, K kv heads, R = H // K, E head dim, F MLP;
and Q: the query positions of one attention call (Q = S in `forward`; in `forward_cached` the Q new
tokens it appends to the cache's S slots: the prompt in a prefill, one in a decode step). The layer
functions shared by both call their positions S.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from ais_jax import checks
from ais_jax.models.family import Family, hf_layer_names
from ais_jax.nn import cache as kv
from ais_jax.nn.cache import KVCache, cache_layout, write_kv
from ais_jax.nn.layers import (
    GATE_UP_PROJ,
    Params,
    attention,
    embed,
    f32,
    head_logits,
    layer_params,
    mlp,
    positions_from_mask,
    recompute_layer,
    rms_norm,
    rope,
    rows_per_prompt,
)
from ais_jax.nn.quant import concat_rows, linear, split_rows

QKV_PROJ = "qkv_proj"  # a layer's q/k/v weights held as one (`fuse_projections`)

# ---- config -------------------------------------------------------------------------------------

ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM")
_MODEL_TYPES = {"qwen3": ARCHITECTURES[0], "qwen2": ARCHITECTURES[1], "llama": ARCHITECTURES[2]}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Decoder hyper-parameters. Dimension letters: V vocab, D hidden, L layers, H query heads,
    K kv heads, E head dim, F MLP dim."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = True
    qk_norm: bool = True
    attention_bias: bool = False
    max_position_embeddings: int = 40_960

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "max_position_embeddings",
        ):
            checks.positive_int(f"ModelConfig.{name}", getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention."
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}.")
        if not self.rope_theta > 0:
            raise ValueError(f"ModelConfig.rope_theta must be > 0, got {self.rope_theta!r}.")
        if self.qk_norm and self.attention_bias:
            raise ValueError(
                "ModelConfig: attention_bias=True with qk_norm=True (Qwen3) is not "
                "supported; Qwen3 checkpoints have no attention biases."
            )
        if not self.rms_norm_eps > 0:
            raise ValueError(f"ModelConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}.")

    @property
    def architecture(self) -> str:
        """Qwen3 (qk_norm), Qwen2 (attention_bias) or Llama (neither)."""
        if self.qk_norm:
            return ARCHITECTURES[0]
        return ARCHITECTURES[1] if self.attention_bias else ARCHITECTURES[2]

    @property
    def model_type(self) -> str:
        return {a: t for t, a in _MODEL_TYPES.items()}[self.architecture]

    @property
    def num_params(self) -> int:
        d, e, f = self.hidden_size, self.head_dim, self.intermediate_size
        h, k = self.num_heads, self.num_kv_heads
        attn = d * e * (2 * h + 2 * k) + (2 * e if self.qk_norm else 0)
        attn += (h + 2 * k) * e if self.attention_bias else 0
        layer = attn + 3 * d * f + 2 * d
        embed = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.num_layers * layer + embed + d

    # ---- presets -------------------------------------------------------------------------
    @classmethod
    def qwen3_0p6b(cls) -> ModelConfig:
        return cls(
            vocab_size=151_936,
            hidden_size=1024,
            num_layers=28,
            num_heads=16,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=3072,
        )

    @classmethod
    def qwen3_1p7b(cls) -> ModelConfig:
        return cls(
            vocab_size=151_936,
            hidden_size=2048,
            num_layers=28,
            num_heads=16,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=6144,
        )

    @classmethod
    def qwen3_4b(cls) -> ModelConfig:
        return cls(
            vocab_size=151_936,
            hidden_size=2560,
            num_layers=36,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=9728,
        )

    @classmethod
    def qwen3_8b(cls) -> ModelConfig:
        return cls(
            vocab_size=151_936,
            hidden_size=4096,
            num_layers=36,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            intermediate_size=12288,
            tie_embeddings=False,
        )

    @classmethod
    def smollm2_135m(cls) -> ModelConfig:
        """SmolLM2-135M(-Instruct), a Llama: no qk_norm, no attention biases."""
        return cls(
            vocab_size=49_152,
            hidden_size=576,
            num_layers=30,
            num_heads=9,
            num_kv_heads=3,
            head_dim=64,
            intermediate_size=1536,
            rope_theta=100_000.0,
            rms_norm_eps=1e-5,
            qk_norm=False,
            max_position_embeddings=8192,
        )

    @classmethod
    def tiny(cls, vocab_size: int = 512) -> ModelConfig:
        """The benchmark's "tiny" shape (about 1M parameters with a 512 vocabulary)."""
        return cls(
            vocab_size=vocab_size,
            hidden_size=128,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
            intermediate_size=384,
            max_position_embeddings=4096,
        )

    @classmethod
    def small(cls, vocab_size: int = 32_000) -> ModelConfig:
        """The benchmark's "small" shape (about 40M parameters with a 32k vocabulary)."""
        return cls(
            vocab_size=vocab_size,
            hidden_size=512,
            num_layers=8,
            num_heads=8,
            num_kv_heads=4,
            head_dim=64,
            intermediate_size=1536,
            max_position_embeddings=4096,
        )

    @classmethod
    def preset_names(cls) -> list[str]:
        """The names `preset` resolves (``"qwen3-0.6b"`` ... ``"tiny"``, ``"small"``)."""
        return [k.replace("_", "-").replace("0p6", "0.6").replace("1p7", "1.7") for k in PRESETS]

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """Build a preset by name (``"qwen3-8b"``, ``"tiny"``, ...) with field overrides."""
        key = name.lower().replace("-", "_").replace(".", "p")
        if key not in PRESETS:
            raise ValueError(f"Unknown model preset {name!r}; valid presets: {cls.preset_names()}.")
        return dataclasses.replace(getattr(cls, PRESETS[key])(), **overrides)

    # ---- Hugging Face config.json ---------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], *, source: str = "config.json") -> ModelConfig:
        """Map a Hugging Face `config.json` dict onto a ModelConfig (clear error on mismatch)."""
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else _MODEL_TYPES.get(hf.get("model_type", ""), None)
        if arch not in ARCHITECTURES:
            raise ValueError(
                f"{source}: unsupported architecture {arch!r} (model_type "
                f"{hf.get('model_type')!r}); ais_jax loads {list(ARCHITECTURES)}."
            )
        missing = [
            k
            for k in (
                "vocab_size",
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "intermediate_size",
            )
            if k not in hf
        ]
        if missing:
            raise ValueError(f"{source}: required field(s) {missing} missing for {arch}.")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"{source}: rope_type {rope_type!r} is not supported; only 'default'.")
        if hf.get("use_sliding_window"):
            raise ValueError(
                f"{source}: use_sliding_window=true is not supported; ais_jax "
                "implements full attention only."
            )
        for key in ("mlp_bias", "attention_bias"):  # Llama's biases (o_proj's too): not built
            if arch == ARCHITECTURES[2] and hf.get(key):
                raise ValueError(f"{source}: {key}=true is not supported for {arch}.")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(
                f"{source}: hidden_act {hf['hidden_act']!r} is not supported; only 'silu'."
            )
        rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10_000.0))
        heads = hf["num_attention_heads"]
        qwen3 = arch == ARCHITECTURES[0]
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            intermediate_size=hf["intermediate_size"],
            rope_theta=float(rope_theta),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qk_norm=qwen3,
            attention_bias=bool(hf.get("attention_bias", arch == ARCHITECTURES[1])),
            max_position_embeddings=hf.get("max_position_embeddings", 40_960),
        )

    def to_hf_dict(self, *, dtype: str = "bfloat16") -> dict[str, Any]:
        llama = {"mlp_bias": False} if self.architecture == ARCHITECTURES[2] else {}
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            **llama,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_embeddings,
            "attention_bias": self.attention_bias,
            "max_position_embeddings": self.max_position_embeddings,
            "use_sliding_window": False,
            "torch_dtype": dtype,
            "dtype": dtype,
        }


PRESETS = {
    "qwen3_0p6b": "qwen3_0p6b",
    "qwen3_1p7b": "qwen3_1p7b",
    "qwen3_4b": "qwen3_4b",
    "qwen3_8b": "qwen3_8b",
    "smollm2_135m": "smollm2_135m",
    "tiny": "tiny",
    "small": "small",
}


# ---- parameters ---------------------------------------------------------------------------------


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.float32) -> Params:
    """Random parameters (normal, std 0.02, as Hugging Face's initializer; norms at one)."""
    return dense_params(config, key, dtype)


def dense_params(config, key: jax.Array, dtype=jnp.float32) -> Params:
    """`init_params` of a LLaMA-style stack of dense layers: `ModelConfig`, and any config with
    its dimension fields (`llada.LLaDAConfig`; no ``qk_norm`` or ``attention_bias`` there)."""
    c = config
    L, D, E, F = c.num_layers, c.hidden_size, c.head_dim, c.intermediate_size
    HE, KE = c.num_heads * E, c.num_kv_heads * E
    shapes = {
        "q_proj": (L, HE, D),
        "k_proj": (L, KE, D),
        "v_proj": (L, KE, D),
        "o_proj": (L, D, HE),
        "gate_proj": (L, F, D),
        "up_proj": (L, F, D),
        "down_proj": (L, D, F),
    }
    keys = iter(jax.random.split(key, len(shapes) + 2))
    normal = lambda shape: (0.02 * jax.random.normal(next(keys), shape)).astype(dtype)  # noqa: E731
    layers = {name: normal(shape) for name, shape in shapes.items()}
    layers["input_norm"] = jnp.ones((L, D), dtype)
    layers["post_norm"] = jnp.ones((L, D), dtype)
    if getattr(c, "qk_norm", False):
        layers["q_norm"] = jnp.ones((L, E), dtype)
        layers["k_norm"] = jnp.ones((L, E), dtype)
    if getattr(c, "attention_bias", False):
        layers["q_bias"] = jnp.zeros((L, HE), dtype)
        layers["k_bias"] = jnp.zeros((L, KE), dtype)
        layers["v_bias"] = jnp.zeros((L, KE), dtype)
    params = {
        "embed": normal((c.vocab_size, D)),
        "final_norm": jnp.ones((D,), dtype),
        "layers": layers,
    }
    if not c.tie_embeddings:
        params["lm_head"] = normal((c.vocab_size, D))
    return params


def param_shapes(config: ModelConfig, dtype=jnp.bfloat16) -> Params:
    """The parameter tree as `jax.ShapeDtypeStruct`s, built without allocating it."""
    return jax.eval_shape(lambda k: init_params(config, k, dtype), jax.random.key(0))


def fuse_projections(lp: Params, c: ModelConfig) -> Params:
    """A Qwen3/Qwen2 layer's params with its q/k/v weights held as one ``qkv_proj`` and its
    gate/up weights as one ``gate_up_proj`` (`quant.concat_rows`; plain arrays, `Columns` and
    `QArray` s alike): the layer then runs two matmuls where it ran five, with the same
    products (a quantized layer's activation scales too: the five share two inputs, whose
    quantization XLA already computed once each). The rows come in per-KV-head blocks (a head's R
    query heads, its key, its value) and per-channel pairs (gate, up), so that tensor-parallel
    shards of the fused weights hold whole heads and matching channels. A layer without these
    weights (already fused) is returned as it is. Stacked ``[L, O, I]`` or per-layer."""
    fused = dict(lp)
    if all(n in lp for n in ("q_proj", "k_proj", "v_proj")):
        parts = [fused.pop(n) for n in ("q_proj", "k_proj", "v_proj")]
        fused[QKV_PROJ] = concat_rows(parts, groups=c.num_kv_heads)
    if "gate_proj" in lp and "up_proj" in lp:
        parts = [fused.pop(n) for n in ("gate_proj", "up_proj")]
        fused[GATE_UP_PROJ] = concat_rows(parts, groups=c.intermediate_size)
    return fused


def _qkv(lp: Params, c: ModelConfig, x_BSD, positions_BS, row_mask_BS):
    B, S, _ = x_BSD.shape
    if QKV_PROJ in lp:
        HE, KE = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        qkv = linear(x_BSD, lp[QKV_PROJ], row_mask=row_mask_BS)
        q, k, v = split_rows(qkv, (HE, KE, KE), groups=c.num_kv_heads)
    else:
        q = linear(x_BSD, lp["q_proj"], row_mask=row_mask_BS)
        k = linear(x_BSD, lp["k_proj"], row_mask=row_mask_BS)
        v = linear(x_BSD, lp["v_proj"], row_mask=row_mask_BS)
    if c.attention_bias:
        q, k, v = (
            (f32(a) + jnp.broadcast_to(f32(lp[f"{n}_bias"].astype(a.dtype)), a.shape)).astype(
                a.dtype
            )
            for a, n in ((q, "q"), (k, "k"), (v, "v"))
        )
    q_BSHE = q.reshape(B, S, c.num_heads, c.head_dim)
    k_BSKE = k.reshape(B, S, c.num_kv_heads, c.head_dim)
    v_BSKE = v.reshape(B, S, c.num_kv_heads, c.head_dim)
    if c.qk_norm:
        q_BSHE = rms_norm(q_BSHE, lp["q_norm"], c.rms_norm_eps)
        k_BSKE = rms_norm(k_BSKE, lp["k_norm"], c.rms_norm_eps)
    return (
        rope(q_BSHE, positions_BS, c.rope_theta),
        rope(k_BSKE, positions_BS, c.rope_theta),
        v_BSKE,
    )


def _layer(lp: Params, c: ModelConfig, x_BSD, positions_BS, row_mask_BS, attend):
    """One decoder layer; ``attend(q, k, v) -> out`` decides where keys/values come from."""
    h = rms_norm(x_BSD, lp["input_norm"], c.rms_norm_eps)
    q_BSHE, k_BSKE, v_BSKE = _qkv(lp, c, h, positions_BS, row_mask_BS)
    x_BSD = x_BSD + linear(attend(q_BSHE, k_BSKE, v_BSKE), lp["o_proj"], row_mask=row_mask_BS)
    h = rms_norm(x_BSD, lp["post_norm"], c.rms_norm_eps)
    return x_BSD + mlp(lp, h, row_mask_BS)


def _logits(params: Params, c: ModelConfig, x_BSD, row_mask_BS, last_only=False) -> jax.Array:
    x_BSD = rms_norm(x_BSD, params["final_norm"], c.rms_norm_eps)
    if last_only:  # sliced after the norm: before it, XLA:CPU fused the norm's sum differently
        x_BSD, row_mask_BS = x_BSD[:, -1:], row_mask_BS[:, -1:]
    return head_logits(params, x_BSD, row_mask_BS)


# ---- full sequence ------------------------------------------------------------------------------


def forward(
    params: Params,
    config: ModelConfig,
    tokens_BS: jax.Array,
    mask_BS: jax.Array | None = None,
    *,
    return_hidden: bool = False,
    remat: bool = False,
) -> jax.Array:
    """Logits ``[B, S, V]`` (float32) of a left-padded batch; ``mask_BS`` marks valid tokens.

    Padded positions give finite values that no valid position depends on. With
    ``return_hidden`` the last layer's output ``[B, S, D]`` instead (before the final norm).
    With ``remat`` the backward pass recomputes each layer (`recompute_layer`).
    """
    mask_BS = _valid(tokens_BS, mask_BS)
    x_BSD = _decoder(params, config, tokens_BS, mask_BS, remat)
    if return_hidden:
        return x_BSD
    return _logits(params, config, x_BSD, mask_BS)


def final_hidden(
    params: Params,
    config: ModelConfig,
    tokens_BS: jax.Array,
    mask_BS: jax.Array | None = None,
    *,
    remat: bool = False,
) -> jax.Array:
    """The final-normed hidden states ``[B, S, D]`` (compute dtype) of a left-padded batch:
    ``forward(...) == head_logits(params, final_hidden(...), mask_BS)``, so a caller can apply
    the LM head to a few positions at a time instead of holding all ``[B, S, V]`` logits.
    ``remat`` as in `forward`."""
    mask_BS = _valid(tokens_BS, mask_BS)
    x_BSD = _decoder(params, config, tokens_BS, mask_BS, remat)
    return rms_norm(x_BSD, params["final_norm"], config.rms_norm_eps)


def response_hidden(
    params: Params,
    config: ModelConfig,
    prompt_tokens_NP: jax.Array,
    prompt_mask_NP: jax.Array,
    tokens_BT: jax.Array,
    mask_BT: jax.Array,
    *,
    remat: bool = False,
) -> jax.Array:
    """The final-normed hidden states ``[B, T, D]`` whose logits score ``tokens_BT``: positions
    P - 1 ... P + T - 2 of the rows ``[prompt, tokens]``, where the B rows come in N groups of
    G = B / N consecutive rows that share one of the N left-padded prompts (GRPO's groups).

    Each prompt runs through the decoder once instead of G times, its keys/values broadcast to
    its group's rows; the last response token, whose hidden state scores nothing, is no input.
    The values are those of `final_hidden` of the concatenated rows, sliced, and a shared
    prompt's gradient is the sum of its rows' (float32: to rounding, tested). In bfloat16 they
    round differently: bitwise equal on the test model, up to 6e-3 apart in a log-prob on the
    default job's, with gradients as far from float32's as the full rows' (tested). The final
    norm runs on each part before they are joined: normed after the join, it was fused
    otherwise, and XLA skips roundings to bfloat16 inside a fusion (a BF16 rollout's
    log-probs then moved off the trainer's by 3.6e-3 on average). With prompts of P and
    responses of T tokens the decoder runs on P / G + T - 1 positions per row instead of
    P + T.

    ``remat``: each layer (its prompt and response parts together) under `recompute_layer`.

    Not used for one prompt per row (G = 1): with it, the default job's 1,500-step SFT warm
    start ended at a loss of 0.34 instead of 0.20 and its 30 GRPO steps gained 2 points of
    held-out accuracy instead of 25, although values and gradients matched the full rows'
    at its start and end; why is not known.
    """
    N, P = prompt_tokens_NP.shape
    B, T = tokens_BT.shape
    G, S = rows_per_prompt(N, B), T - 1  # S response inputs: all but the last token
    share = lambda a_N: jnp.repeat(a_N, G, axis=0)  # noqa: E731  (a prompt's value, per row)
    # a prompt's float values, per row; their gradient (the sum over the group) in float32
    fan_out = lambda a_N: share(f32(a_N)).astype(a_N.dtype)  # noqa: E731
    prompt_mask_NP, mask_BT = prompt_mask_NP.astype(bool), mask_BT.astype(bool)
    tokens_BS, mask_BS = tokens_BT[:, :S], mask_BT[:, :S]
    positions_NP = positions_from_mask(prompt_mask_NP)
    positions_BS = positions_from_mask(mask_BS, share(prompt_mask_NP.sum(-1, dtype=jnp.int32)))
    # the prompt attends causally within itself; a response to its prompt, then causally
    allowed_NPP = jnp.tril(jnp.ones((P, P), bool))[None] & prompt_mask_NP[:, None, :]
    valid_BX = jnp.concatenate([share(prompt_mask_NP), mask_BS], axis=1)  # X = P + S keys
    allowed_BSX = jnp.tril(jnp.ones((S, P + S), bool), k=P)[None] & valid_BX[:, None, :]
    x_NPD = embed(params["embed"], prompt_tokens_NP)
    x_BSD = embed(params["embed"], tokens_BS)

    def layer(lp, xs, consts):
        """One layer over the prompts, then over the responses, which attend to its keys and
        values of their prompt (``xs`` = (x_NPD, x_BSD))."""
        (x_NPD, x_BSD), prompt_kv = xs, []
        positions_NP, prompt_mask_NP, positions_BS, mask_BS, allowed_NPP, allowed_BSX = consts

        def attend_prompt(q_NPHE, k_NPKE, v_NPKE):
            prompt_kv[:] = k_NPKE, v_NPKE  # this layer's, for the responses' attention below
            return attention(q_NPHE, *cache_layout(k_NPKE, v_NPKE), allowed_NPP)

        def attend_response(q_BSHE, k_BSKE, v_BSKE):
            k_BXKE, v_BXKE = (
                jnp.concatenate([fan_out(a_NPKE), a_BSKE], axis=1)
                for a_NPKE, a_BSKE in zip(prompt_kv, (k_BSKE, v_BSKE), strict=True)
            )
            return attention(q_BSHE, *cache_layout(k_BXKE, v_BXKE), allowed_BSX)

        x_NPD = _layer(lp, config, x_NPD, positions_NP, prompt_mask_NP, attend_prompt)
        if S:
            x_BSD = _layer(lp, config, x_BSD, positions_BS, mask_BS, attend_response)
        return x_NPD, x_BSD

    layer = recompute_layer(layer) if remat else layer
    consts = (positions_NP, prompt_mask_NP, positions_BS, mask_BS, allowed_NPP, allowed_BSX)
    for i in range(config.num_layers):
        x_NPD, x_BSD = layer(layer_params(params, i), (x_NPD, x_BSD), consts)
    norm = lambda x: rms_norm(x, params["final_norm"], config.rms_norm_eps)  # noqa: E731
    return jnp.concatenate([fan_out(norm(x_NPD)[:, -1:]), norm(x_BSD)], axis=1)


def _valid(tokens_BS: jax.Array, mask_BS: jax.Array | None) -> jax.Array:
    if mask_BS is None:
        return jnp.ones(tokens_BS.shape, bool)
    return mask_BS.astype(bool)


def _decoder(
    params: Params, config: ModelConfig, tokens_BS, mask_BS, remat: bool = False
) -> jax.Array:
    """Embedding and every decoder layer of a full sequence: ``[B, S, D]`` before the norm;
    with ``remat`` each layer under `recompute_layer`."""
    S = tokens_BS.shape[1]
    positions_BS = positions_from_mask(mask_BS)
    causal_SS = jnp.tril(jnp.ones((S, S), bool))
    allowed_BSS = causal_SS[None] & mask_BS[:, None, :]
    x_BSD = embed(params["embed"], tokens_BS)

    def layer(lp, xs, consts):
        positions_BS, mask_BS, allowed_BSS = consts
        attend = lambda q, k, v: attention(q, *cache_layout(k, v), allowed_BSS)  # noqa: E731
        return (_layer(lp, config, xs[0], positions_BS, mask_BS, attend),)

    layer = recompute_layer(layer) if remat else layer
    for i in range(config.num_layers):
        (x_BSD,) = layer(layer_params(params, i), (x_BSD,), (positions_BS, mask_BS, allowed_BSS))
    return x_BSD


# ---- KV cache ---------------------------------------------------------------------------------


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> KVCache:
    """An empty cache of S = ``max_len`` slots per row, keys and values in ``dtype`` (the
    model's compute dtype)."""
    c = config
    return kv.empty(batch, c.num_layers, c.num_kv_heads, c.head_dim, max_len, dtype)


def forward_cached(
    params: Params,
    config: ModelConfig,
    tokens_BQ: jax.Array,
    cache: KVCache,
    mask_BQ: jax.Array | None = None,
    *,
    last_only: bool = False,
) -> tuple[jax.Array, KVCache]:
    """Append the Q tokens ``tokens_BQ`` to the cache and return their logits ``[B, Q, V]``
    (float32), or with ``last_only`` those of the last position, ``[B, 1, V]`` (all a
    left-padded prefill needs: the LM head over every prompt position was 2.5% of a small-model
    `generate`).

    ``mask_BQ`` marks real tokens (left padding in a prefill; finished rows in a decode step):
    unmasked tokens are neither attended to later nor counted in activation scales.
    """
    B, Q = tokens_BQ.shape
    if mask_BQ is None:
        mask_BQ = jnp.ones((B, Q), bool)
    mask_BQ = mask_BQ.astype(bool)
    S = cache.valid.shape[1]
    start = cache.index
    positions_BQ = positions_from_mask(mask_BQ, cache.next_pos)
    valid_BS = jax.lax.dynamic_update_slice(cache.valid, mask_BQ, (0, start))
    slot_S = jnp.arange(S)
    allowed_BQS = valid_BS[:, None, :] & (slot_S[None, :] <= start + jnp.arange(Q)[:, None])[None]

    k_cache, v_cache = list(cache.k), list(cache.v)
    x_BQD = embed(params["embed"], tokens_BQ)
    for i in range(config.num_layers):

        def attend(q_BQHE, k_BQKE, v_BQKE, i=i):
            k_cache[i], v_cache[i] = write_kv(k_cache[i], v_cache[i], k_BQKE, v_BQKE, start)
            return attention(q_BQHE, k_cache[i], v_cache[i], allowed_BQS)

        x_BQD = _layer(layer_params(params, i), config, x_BQD, positions_BQ, mask_BQ, attend)
    logits_BQV = _logits(params, config, x_BQD, mask_BQ, last_only)
    new_cache = KVCache(
        k=tuple(k_cache),
        v=tuple(v_cache),
        valid=valid_BS,
        next_pos=cache.next_pos + mask_BQ.sum(-1, dtype=jnp.int32),
        index=start + Q,
    )
    return logits_BQV, new_cache


# ---- the family ---------------------------------------------------------------------------------

# our name -> Hugging Face name: top-level tensors, and a layer's after "model.layers.{i}."
HF_TOP_NAMES = {
    "embed": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
}
HF_LAYER_NAMES = {
    "input_norm": "input_layernorm.weight",
    "post_norm": "post_attention_layernorm.weight",
    "q_proj": "self_attn.q_proj.weight",
    "k_proj": "self_attn.k_proj.weight",
    "v_proj": "self_attn.v_proj.weight",
    "o_proj": "self_attn.o_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "gate_proj": "mlp.gate_proj.weight",
    "up_proj": "mlp.up_proj.weight",
    "down_proj": "mlp.down_proj.weight",
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tensor_names(config: ModelConfig) -> dict:
    """Every Hugging Face tensor name of a ``config`` checkpoint -> `family.TensorName`."""
    layers = range(config.num_layers)
    return hf_layer_names(HF_TOP_NAMES, HF_LAYER_NAMES, param_shapes(config), lambda _: layers)


FAMILY = Family(
    name="qwen3",
    kind="autoregressive",
    config_class=ModelConfig,
    presets=tuple(ModelConfig.preset_names()),
    architectures=ARCHITECTURES,
    model_types=tuple(_MODEL_TYPES),
    init_params=init_params,
    forward=forward,
    tensor_names=tensor_names,
    head_name=HF_TOP_NAMES["lm_head"],
    projections=PROJECTIONS,
    final_hidden=final_hidden,
    response_hidden=response_hidden,
    init_cache=init_cache,
    forward_cached=forward_cached,
    fuse_projections=fuse_projections,
)
