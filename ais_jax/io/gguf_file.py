"""GGUF checkpoints (llama.cpp's format) read as Hugging Face tensors, config and tokenizer.

`read_checkpoint(path)` gives ``(config, tensors)`` with the tensors under the names of a
Hugging Face ``*ForCausalLM`` checkpoint and dequantized to float32 by the `gguf` package
(llama.cpp's own reader: F32, F16, BF16, Q8_0, Q4_0, Q4_1 and every other type its
``gguf.quants.dequantize`` implements; any other type is a `CheckpointError` naming the tensor
and the type). `hf.load_hf` checks and stacks them as it does a safetensors directory, so a GGUF
file and the directory it was converted from load to the same tree.

llama.cpp's converter (``convert_hf_to_gguf.py``, ``LlamaModel.permute``) reorders the rows of
a Llama model's q and k projections so that each head's rotary pairs are adjacent (GPT-J
style); `unpermute_rows` puts them back in Hugging Face's half-split order, which `model.rope`
uses. Only ``llama`` files are read for now.

`read_tokenizer(path)` builds the ``tokenizers`` BPE tokenizer the file describes (its
``tokenizer.ggml.*`` vocabulary, merges, token types and special ids; pre-tokenizer by
``tokenizer.ggml.pre``) and returns its chat template (``tokenizer.chat_template``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from ais_jax.io.errors import CheckpointError
from ais_jax.models.qwen3 import ModelConfig

# general.architecture -> what it loads as (Qwen2/Qwen3 files: not read yet, untested)
ARCHITECTURES = {"llama": "LlamaForCausalLM"}
_PERMUTED = ("llama",)  # the converter permutes these architectures' q/k rows

_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
_CONTROL, _USER_DEFINED = 3, 4


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether ``path`` names a GGUF file (by its suffix; the magic is checked on reading)."""
    return Path(path).suffix.lower() == ".gguf"


def _reader(path: Path):
    import gguf

    if not path.is_file():
        raise CheckpointError(f"GGUF file {str(path)!r} does not exist.")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError, struct.error, ... on a bad file
        raise CheckpointError(
            f"{path} is not a readable GGUF file (corrupt or truncated?): {e}."
        ) from None


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    if isinstance(value, float):  # a float32 field: its shortest repr (1e-05, not 9.99e-06)
        value = float(np.format_float_positional(np.float32(value), unique=True, trim="-"))
    return value


def read_config(path: str | os.PathLike, reader=None) -> ModelConfig:
    """The `ModelConfig` of a GGUF file's ``{arch}.*`` metadata."""

    path = Path(path)
    reader = reader or _reader(path)
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{path}: GGUF architecture {arch!r} is not supported; ais_jax reads "
            f"{sorted(ARCHITECTURES)}."
        )

    def need(key: str):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise CheckpointError(f"{path}: metadata {arch}.{key} is missing.")
        return value

    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in _tensor_names(reader):
        raise CheckpointError(
            f"{path}: rope scaling {scaling!r} is not supported; only plain RoPE."
        )
    heads, hidden = int(need("attention.head_count")), int(need("embedding_length"))
    kv_heads = _field(reader, f"{arch}.attention.head_count_kv", heads)
    head_dim = _field(reader, f"{arch}.attention.key_length") or hidden // heads
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, f"{arch}.vocab_size") or (len(tokens.data) if tokens else None)
    if vocab is None:
        raise CheckpointError(f"{path}: neither {arch}.vocab_size nor a vocabulary is given.")
    try:
        return ModelConfig(
            vocab_size=int(vocab),
            hidden_size=hidden,
            num_layers=int(need("block_count")),
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=int(head_dim),
            intermediate_size=int(need("feed_forward_length")),
            rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10_000.0)),
            rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            tie_embeddings="output.weight" not in _tensor_names(reader),
            qk_norm=arch == "qwen3",
            attention_bias=arch == "qwen2",
            max_position_embeddings=int(_field(reader, f"{arch}.context_length", 40_960)),
        )
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None


def _tensor_names(reader) -> set[str]:
    return {t.name for t in reader.tensors}


def hf_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor name, or None for one ais_jax does not know."""
    if name in _TOP:
        return _TOP[name]
    m = _BLOCK.match(name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"
    return None


def unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (``convert_hf_to_gguf.LlamaModel.permute``): within
    each head, rows ``(E/2, 2)`` interleaved back to ``(2, E/2)`` halves."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_checkpoint(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """``(config, tensors)``: a GGUF file's model, its tensors dequantized to float32 under
    Hugging Face names (`hf_name`), Llama's q/k rows unpermuted. Unknown tensor names are kept
    under their GGUF names, so `hf.load_hf` reports them as unexpected."""
    from gguf import GGMLQuantizationType, quants

    path = Path(path)
    reader = _reader(path)
    config = read_config(path, reader)
    arch = _field(reader, "general.architecture")
    tensors = {}
    for t in reader.tensors:
        qtype = GGMLQuantizationType(t.tensor_type)
        try:
            if qtype == GGMLQuantizationType.BF16:
                import ml_dtypes

                value = np.asarray(t.data).view(ml_dtypes.bfloat16).astype(np.float32)
            else:
                value = np.asarray(quants.dequantize(t.data, qtype), dtype=np.float32)
        except NotImplementedError:
            raise CheckpointError(
                f"{path}: tensor {t.name!r} has GGUF type {qtype.name}, which ais_jax cannot "
                "dequantize (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants can)."
            ) from None
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims fastest first
        value = value.reshape(shape)
        name = hf_name(t.name) or t.name
        if arch in _PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_heads if "q_proj" in name else config.num_kv_heads
            value = unpermute_rows(value, heads)
        tensors[name] = value
    return config, tensors


def read_tokenizer(path: str | os.PathLike):
    """``(tokenizer, special_tokens, chat_template, eos_ids, pad_id)`` of a GGUF file: a
    ``tokenizers.Tokenizer`` for its ``gpt2`` (byte-level BPE) vocabulary, the named special
    tokens (``{"eos_token": "<|im_end|>", ...}``), the chat template text (or None), the
    end-of-sequence ids and the padding id (the eos id when the file names none)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    path = Path(path)
    reader = _reader(path)
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(
            f"{path}: tokenizer.ggml.model {kind!r} is not supported; ais_jax builds 'gpt2' "
            "(byte-level BPE) tokenizers from GGUF files."
        )
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    tok = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre == "smollm":  # llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM: every digit on its own
        digits = pre_tokenizers.Digits(individual_digits=True)
        tok.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, types, strict=True)
            if kind == _CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, types, strict=True)
            if kind == _USER_DEFINED
        ]
    )
    special = {}
    for key in ("bos", "eos", "unknown", "padding"):
        i = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if i is not None and 0 <= int(i) < len(tokens):
            name = {"unknown": "unk", "padding": "pad"}.get(key, key)
            special[f"{name}_token"] = tokens[int(i)]
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = tuple(dict.fromkeys(int(i) for i in (eos, eot) if i is not None))
    pad = _field(reader, "tokenizer.ggml.padding_token_id")
    pad_id = int(pad) if pad is not None else (eos_ids[0] if eos_ids else None)
    return tok, special, _field(reader, "tokenizer.chat_template"), eos_ids, pad_id
