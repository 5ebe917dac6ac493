"""LLaDA, a masked-diffusion language model, as pure functions over a parameter pytree.

LLaDA (Nie et al. 2025, GSAI-ML/LLaDA-8B-Instruct) is a LLaMA-shaped transformer trained as a
mask predictor: the input is a sequence in which some tokens are replaced by the mask token
(`LLaDAConfig.mask_token_id`, 126336 for LLaDA-8B) and the logits at every position predict the
clean token there. The only architectural difference from an autoregressive LLaMA is that the
attention is **bidirectional**: every position attends to every (non-padding) position.

Per layer (pre-norm, as LLaDA's ``LLaDALlamaBlock``)::

    h = RMSNorm(x) ;  q, k, v = h Wq^T, h Wk^T, h Wv^T ;  q, k = RoPE(q), RoPE(k)
    x = x + softmax(q k^T / sqrt(E) + pad_bias) v  Wo^T                (no causal mask)
    h = RMSNorm(x) ;  x = x + (silu(h Wg^T) * (h Wu^T)) Wd^T              (SwiGLU)

then ``logits = RMSNorm(x) W_head^T`` (``W_head`` = the embedding when `tie_embeddings`), times
``1/sqrt(D)`` with `scale_logits`; the embedding is scaled by ``sqrt(D)`` with `input_emb_norm`.
RoPE is rotate-half with `rope_theta`, applied in float32 when `rope_full_precision` (LLaDA's
default). RMSNorm keeps float32 statistics and multiplies its weight in the compute dtype.

Parameters use `qwen3.py`'s names and layout (``[L, ...]`` stacked, Hugging Face ``[out, in]``):

    embed [V, D]   final_norm [D]   lm_head [V, D] (untied only)
    layers: input_norm [L, D]  q_proj [L, H*E, D]  k_proj/v_proj [L, K*E, D]  o_proj [L, D, H*E]
            post_norm [L, D]  gate_proj/up_proj [L, F, D]  down_proj [L, D, F]

so `quant.quantize_fp8` makes the FP8 W8A8 rollout copy unchanged: every projection goes
through `quant.linear`. LLaDA's checkpoint names map onto these in `tensor_names` (read and
written by `io.hf`)
(``attn_norm`` -> input_norm, ``attn_out`` -> o_proj, ``ff_norm`` -> post_norm, ``ff_proj`` ->
gate_proj, ``up_proj``, ``ff_out`` -> down_proj; ``wte``, ``ln_f``, top-level ``ff_out`` ->
lm_head).

Padding: `forward` takes a left-padded batch and its mask; padding keys are never attended to and
positions count valid tokens only (`layers.positions_from_mask`), so a row's logits do not depend
on its padding. LLaDA's reference uses absolute positions 0..S-1 with padding: RoPE scores depend
on position differences only, so that is the same function (up to rounding) on every valid
position.

Dimensions (docs/design.md's key): B rows, S positions, V vocabulary (LLaDA's
``embedding_size``), D model, L layers, H query heads, K kv heads, E = D / H head dim, F MLP.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from ais_jax import checks
from ais_jax.models.family import Family, TensorName, hf_layer_names
from ais_jax.models.qwen3 import PROJECTIONS, dense_params
from ais_jax.nn.layers import (
    Params,
    attention,
    embed,
    layer_params,
    mlp,
    positions_from_mask,
    rms_norm,
    rope,
)
from ais_jax.nn.quant import linear

ARCHITECTURE = "LLaDAModelLM"
PRESETS = ("tiny", "llada-8b")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LLaDAConfig:
    """LLaDA hyper-parameters. ``vocab_size`` is the logits' width V (LLaDA's
    ``embedding_size``, which may exceed the tokenizer's ``text_vocab_size``); the head dim is
    ``hidden_size // num_heads``. `block_group_size` only changes checkpoint tensor names."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500_000.0
    rope_full_precision: bool = True
    tie_embeddings: bool = False
    scale_logits: bool = False
    input_emb_norm: bool = False
    mask_token_id: int = 126_336
    eos_token_id: int = 126_081
    pad_token_id: int = 126_081
    max_position_embeddings: int = 4096
    text_vocab_size: int | None = None
    block_group_size: int = 1

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
            "max_position_embeddings",
            "block_group_size",
        ):
            checks.positive_int(f"LLaDAConfig.{name}", getattr(self, name))
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            raise ValueError(
                f"LLaDAConfig.hidden_size ({self.hidden_size}) must be num_heads "
                f"({self.num_heads}) times an even head dim."
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"LLaDAConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})."
            )
        if self.num_layers % self.block_group_size:
            raise ValueError(
                f"LLaDAConfig.block_group_size ({self.block_group_size}) must divide num_layers "
                f"({self.num_layers})."
            )
        if self.text_vocab_size is not None and not 0 < self.text_vocab_size <= self.vocab_size:
            raise ValueError(
                f"LLaDAConfig.text_vocab_size ({self.text_vocab_size}) must be in "
                f"[1, vocab_size={self.vocab_size}] or None."
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"LLaDAConfig.mask_token_id ({self.mask_token_id}) must be an id below "
                f"vocab_size ({self.vocab_size})."
            )
        if not (self.rope_theta > 0 and self.rms_norm_eps > 0):
            raise ValueError(
                f"LLaDAConfig: rope_theta ({self.rope_theta!r}) and rms_norm_eps "
                f"({self.rms_norm_eps!r}) must be > 0."
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_params(self) -> int:
        """``L (D E (2H + 2K) + 3 D F + 2 D) + V D (1 + untied) + D``: projections, the two
        norms per layer, embedding (+ head), final norm. LLaDA-8B: 8.02e9."""
        d, e, f = self.hidden_size, self.head_dim, self.intermediate_size
        layer = d * e * 2 * (self.num_heads + self.num_kv_heads) + 3 * d * f + 2 * d
        embed = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.num_layers * layer + embed + d

    @classmethod
    def llada_8b(cls) -> LLaDAConfig:
        """GSAI-ML/LLaDA-8B-Instruct (its config.json)."""
        return cls(
            vocab_size=126_464,
            hidden_size=4096,
            num_layers=32,
            num_heads=32,
            num_kv_heads=32,
            intermediate_size=12_288,
        )

    @classmethod
    def tiny(cls) -> LLaDAConfig:
        """A LLaDA-shaped model for CPU runs on the synthetic tasks: the character vocabulary
        (`tasks.CharTokenizer`, 78 ids, <pad> 0, <eos> 2) plus the mask token (id 78)."""
        return cls(
            vocab_size=79,
            hidden_size=128,
            num_layers=4,
            num_heads=4,
            num_kv_heads=4,
            intermediate_size=384,
            rope_theta=10_000.0,
            mask_token_id=78,
            eos_token_id=2,
            pad_token_id=0,
            max_position_embeddings=512,
        )

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> LLaDAConfig:
        """``"tiny"`` or ``"llada-8b"`` with field overrides (a ValueError names the choices)."""
        presets = dict(zip(PRESETS, (cls.tiny, cls.llada_8b), strict=True))
        if name not in presets:
            raise ValueError(f"Unknown LLaDA preset {name!r}; valid presets: {list(presets)}.")
        return dataclasses.replace(presets[name](), **overrides)

    # ---- LLaDA's config.json --------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], *, source: str = "config.json") -> LLaDAConfig:
        """Map LLaDA's ``config.json`` keys onto a config; a flag this implementation does not
        compute raises a ValueError naming the flag, its value and what is supported."""
        archs = hf.get("architectures") or []
        if hf.get("model_type") != "llada" and "LLaDAModelLM" not in archs:
            raise ValueError(
                f"{source}: not a LLaDA config (model_type {hf.get('model_type')!r}, "
                f"architectures {archs}); expected model_type 'llada' / LLaDAModelLM."
            )
        missing = [k for k in ("d_model", "n_layers", "n_heads") if k not in hf]
        if missing:
            raise ValueError(f"{source}: required LLaDA field(s) {missing} missing.")
        supported = {  # flag: (default when absent, the values implemented)
            "block_type": ("llama", ("llama",)),
            "activation_type": ("silu", ("silu",)),
            "layer_norm_type": ("rms", ("rms",)),
            "layer_norm_with_affine": (True, (True,)),
            "alibi": (False, (False,)),
            "rope": (True, (True,)),
            "include_bias": (False, (False,)),
            "include_qkv_bias": (False, (False, None)),
            "bias_for_layer_norm": (None, (False, None)),
            "attention_layer_norm": (False, (False,)),
            "attention_dropout": (0.0, (0, 0.0)),
            "residual_dropout": (0.0, (0, 0.0)),
            "embedding_dropout": (0.0, (0, 0.0)),
        }
        for flag, (default, allowed) in supported.items():
            value = hf.get(flag, default)
            if value not in allowed:
                raise ValueError(
                    f"{source}: {flag}={value!r} is not implemented; ais_jax's LLaDA supports "
                    f"{flag} in {list(allowed)}."
                )
        heads = hf["n_heads"]
        kv_heads = hf.get("n_kv_heads") or heads
        mqa = hf.get("multi_query_attention")
        if mqa is not None and kv_heads != (1 if mqa else heads):
            if hf.get("n_kv_heads") is not None:
                raise ValueError(
                    f"{source}: multi_query_attention={mqa!r} contradicts n_kv_heads={kv_heads}."
                )
            kv_heads = 1 if mqa else heads
        text_vocab = hf.get("vocab_size")
        vocab = hf.get("embedding_size") or text_vocab
        if vocab is None:
            raise ValueError(f"{source}: needs embedding_size or vocab_size.")
        if text_vocab is not None and text_vocab > vocab:
            raise ValueError(
                f"{source}: embedding_size ({vocab}) is smaller than vocab_size ({text_vocab})."
            )
        mlp = hf.get("mlp_hidden_size") or hf.get("mlp_ratio", 4) * hf["d_model"]
        eos = hf.get("eos_token_id", 126_081)
        return cls(
            vocab_size=vocab,
            hidden_size=hf["d_model"],
            num_layers=hf["n_layers"],
            num_heads=heads,
            num_kv_heads=kv_heads,
            intermediate_size=mlp,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            rope_theta=float(hf.get("rope_theta", 10_000.0)),
            rope_full_precision=bool(hf.get("rope_full_precision", True)),
            tie_embeddings=bool(hf.get("weight_tying", True)),
            scale_logits=bool(hf.get("scale_logits", False)),
            input_emb_norm=bool(hf.get("input_emb_norm", False)),
            mask_token_id=hf.get("mask_token_id", 126_336),
            eos_token_id=eos,
            pad_token_id=hf.get("pad_token_id", eos),
            max_position_embeddings=hf.get("max_sequence_length", 4096),
            text_vocab_size=text_vocab if text_vocab != vocab else None,
            block_group_size=hf.get("block_group_size", 1),
        )

    def to_hf_dict(self, *, dtype: str = "bfloat16") -> dict[str, Any]:
        """LLaDA's config.json keys (those of LLaDA-8B-Instruct's file, without ``auto_map``:
        loading with `transformers` needs LLaDA's remote code files copied beside it)."""
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "llada",
            "block_type": "llama",
            "activation_type": "silu",
            "layer_norm_type": "rms",
            "layer_norm_with_affine": True,
            "bias_for_layer_norm": False,
            "include_bias": False,
            "include_qkv_bias": False,
            "attention_layer_norm": False,
            "alibi": False,
            "rope": True,
            "flash_attention": False,
            "attention_dropout": 0.0,
            "residual_dropout": 0.0,
            "embedding_dropout": 0.0,
            "d_model": self.hidden_size,
            "n_layers": self.num_layers,
            "n_heads": self.num_heads,
            "n_kv_heads": self.num_kv_heads,
            "multi_query_attention": None,
            "mlp_hidden_size": self.intermediate_size,
            "embedding_size": self.vocab_size,
            "vocab_size": self.text_vocab_size or self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_full_precision": self.rope_full_precision,
            "weight_tying": self.tie_embeddings,
            "scale_logits": self.scale_logits,
            "input_emb_norm": self.input_emb_norm,
            "block_group_size": self.block_group_size,
            "mask_token_id": self.mask_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "max_sequence_length": self.max_position_embeddings,
            "use_cache": False,
            "torch_dtype": dtype,
        }


# ---- parameters ---------------------------------------------------------------------------------


def init_params(config: LLaDAConfig, key: jax.Array, dtype=jnp.float32) -> Params:
    """Random parameters (normal, std 0.02; norms at one) in `qwen3.py`'s layout."""
    return dense_params(config, key, dtype)


# ---- forward ------------------------------------------------------------------------------------


def _rope(x_BSHE: jax.Array, positions_BS: jax.Array, c: LLaDAConfig) -> jax.Array:
    if not c.rope_full_precision:  # angles float32, rotation in x's dtype
        return rope(x_BSHE, positions_BS, c.rope_theta)
    return rope(x_BSHE.astype(jnp.float32), positions_BS, c.rope_theta).astype(x_BSHE.dtype)


def _layer(lp: Params, c: LLaDAConfig, x_BSD, positions_BS, mask_BS, allowed_BSS):
    B, S, _ = x_BSD.shape
    h_BSD = rms_norm(x_BSD, lp["input_norm"], c.rms_norm_eps)
    q_BSHE = linear(h_BSD, lp["q_proj"], row_mask=mask_BS).reshape(B, S, c.num_heads, -1)
    k_BSKE = linear(h_BSD, lp["k_proj"], row_mask=mask_BS).reshape(B, S, c.num_kv_heads, -1)
    v_BSKE = linear(h_BSD, lp["v_proj"], row_mask=mask_BS).reshape(B, S, c.num_kv_heads, -1)
    q_BSHE, k_BSKE = _rope(q_BSHE, positions_BS, c), _rope(k_BSKE, positions_BS, c)
    out_BSD = attention(
        q_BSHE, k_BSKE.transpose(0, 2, 1, 3), v_BSKE.transpose(0, 2, 3, 1), allowed_BSS
    )
    x_BSD = x_BSD + linear(out_BSD, lp["o_proj"], row_mask=mask_BS)
    h_BSD = rms_norm(x_BSD, lp["post_norm"], c.rms_norm_eps)
    return x_BSD + mlp(lp, h_BSD, mask_BS)


def forward(
    params: Params, config: LLaDAConfig, tokens_BS: jax.Array, mask_BS: jax.Array | None = None
) -> jax.Array:
    """Logits ``[B, S, V]`` (float32) of a left-padded batch (``mask_BS`` marks valid tokens)
    with bidirectional attention over the valid tokens. Mask tokens are ordinary inputs (ids
    ``config.mask_token_id``). Padded positions give finite values no valid position uses."""
    c = config
    B, S = tokens_BS.shape
    mask_BS = jnp.ones((B, S), bool) if mask_BS is None else mask_BS.astype(bool)
    positions_BS = positions_from_mask(mask_BS)
    allowed_BSS = jnp.broadcast_to(mask_BS[:, None, :], (B, S, S))
    x_BSD = embed(params["embed"], tokens_BS)
    if c.input_emb_norm:
        x_BSD = x_BSD * jnp.asarray(c.hidden_size**0.5, x_BSD.dtype)
    for i in range(c.num_layers):
        x_BSD = _layer(layer_params(params, i), c, x_BSD, positions_BS, mask_BS, allowed_BSS)
    x_BSD = rms_norm(x_BSD, params["final_norm"], c.rms_norm_eps)
    head = params.get("lm_head", params["embed"])
    logits_BSV = linear(x_BSD, head, row_mask=mask_BS, out_dtype=jnp.float32)
    if c.scale_logits:
        logits_BSV = logits_BSV * jnp.float32(1.0 / c.hidden_size**0.5)
    return logits_BSV


# ---- checkpoints --------------------------------------------------------------------------------

_BLOCK_NAMES = {  # ours -> LLaDA's name inside a block
    "input_norm": "attn_norm.weight",
    "q_proj": "q_proj.weight",
    "k_proj": "k_proj.weight",
    "v_proj": "v_proj.weight",
    "o_proj": "attn_out.weight",
    "post_norm": "ff_norm.weight",
    "gate_proj": "ff_proj.weight",
    "up_proj": "up_proj.weight",
    "down_proj": "ff_out.weight",
}
_TOP_NAMES = {
    "embed": "model.transformer.wte.weight",
    "final_norm": "model.transformer.ln_f.weight",
    "lm_head": "model.transformer.ff_out.weight",
}


def _block_prefix(config: LLaDAConfig, i: int) -> str:
    g = config.block_group_size
    if g == 1:
        return f"model.transformer.blocks.{i}."
    return f"model.transformer.block_groups.{i // g}.{i % g}."


def tensor_names(config: LLaDAConfig) -> dict[str, TensorName]:
    """Every tensor name of a LLaDA checkpoint (the hub's layout) -> `family.TensorName`."""
    shapes = jax.eval_shape(lambda k: init_params(config, k), jax.random.key(0))
    layers = range(config.num_layers)
    prefix = lambda i: _block_prefix(config, i)  # noqa: E731
    return hf_layer_names(_TOP_NAMES, _BLOCK_NAMES, shapes, lambda _: layers, prefix=prefix)


FAMILY = Family(
    name="llada",
    kind="diffusion",
    config_class=LLaDAConfig,
    presets=PRESETS,
    architectures=(ARCHITECTURE,),
    model_types=("llada",),
    init_params=init_params,
    forward=forward,
    tensor_names=tensor_names,
    head_name=_TOP_NAMES["lm_head"],
    projections=PROJECTIONS,
)
