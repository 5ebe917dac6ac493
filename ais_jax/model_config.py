"""The Qwen3 / Qwen2 / Llama decoder as one frozen dataclass, with presets for the real sizes.

`ModelConfig` carries exactly the fields Hugging Face's `Qwen3Config` / `Qwen2Config` /
`LlamaConfig` need to describe the decoder: the three differ only by `qk_norm` (Qwen3: RMSNorm on
each query and key head before RoPE) and `attention_bias` (Qwen2: biases on the q/k/v
projections); Llama has neither. `head_dim` is decoupled from `hidden_size // num_heads`, as in
Qwen3.

Presets are constructors: `ModelConfig.qwen3_8b()`, `ModelConfig.tiny()`. Real sizes are checked
against the published `config.json` files of the Qwen3 release.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ais_jax import checks

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
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """Build a preset by name (``"qwen3-8b"``, ``"tiny"``, ...) with field overrides."""
        key = name.lower().replace("-", "_").replace(".", "p")
        if key not in PRESETS:
            valid = [
                k.replace("_", "-").replace("0p6", "0.6").replace("1p7", "1.7") for k in PRESETS
            ]
            raise ValueError(f"Unknown model preset {name!r}; valid presets: {valid}.")
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


def preset_names() -> list[str]:
    """Every model preset name `preset` resolves: Qwen3's and Qwen3.5's."""
    from ais_jax import qwen35  # here: qwen35.py imports model.py, which imports this module

    names = [k.replace("_", "-").replace("0p6", "0.6").replace("1p7", "1.7") for k in PRESETS]
    return names + list(qwen35.PRESETS)


def preset(name: str, **overrides: Any):
    """The model config of a preset name with field overrides: a `ModelConfig` for the Qwen3
    presets (`ModelConfig.preset`), a `qwen35.Qwen35Config` for a Qwen3.5 one
    (``"qwen3.5-9b"``, ``"qwen3.5-tiny"``; `qwen35.Qwen35Config.preset`). The one function a
    caller that builds a model from a name needs."""
    from ais_jax import qwen35

    if name.lower().replace("_", "-") in qwen35.PRESETS:
        return qwen35.Qwen35Config.preset(name, **overrides)
    if name.lower().replace("-", "_").replace(".", "p") not in PRESETS:
        raise ValueError(f"Unknown model preset {name!r}; valid presets: {preset_names()}.")
    return ModelConfig.preset(name, **overrides)  # its settings' errors pass through
