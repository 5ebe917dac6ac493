"""Specification of `hf.py`: parity with `transformers`, checkpoint round trips, clear errors.

The reference is `transformers`' own `Qwen3ForCausalLM` / `Qwen2ForCausalLM` / `LlamaForCausalLM`
(eager attention, CPU) on random-weight checkpoints built by conftest.py, run on LEFT-PADDED
batches with explicit ``position_ids = max(cumsum(mask) - 1, 0)``; only valid positions are
compared. The float32 tolerance is levanter's: ``|ours - ref| <= 1e-4 * max(1, |ref|)``
elementwise, never relaxed.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers

from ais_jax.io.hf import CheckpointError, HFTokenizer, check_vocab, load_hf, save_hf
from ais_jax.models import forward

# Each case differs from TINY (conftest.py: vocab 96, hidden 32, 2 layers, 4 heads, 2 kv heads,
# head_dim 16 != 32 / 4, rope_theta 1e4, untied embeddings) in what its id says.
CASES = {
    "qwen3-untied-gqa2-hd16": ("qwen3", {}),
    "qwen3-tied-mha-theta1e6": (
        "qwen3",
        dict(
            hidden_size=64,
            num_key_value_heads=4,
            tie_word_embeddings=True,
            rope_theta=1e6,
            vocab_size=128,
        ),
    ),
    "qwen2-untied-gqa4-theta5e5": (
        "qwen2",
        dict(
            hidden_size=64,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size=96,
            rope_theta=5e5,
            vocab_size=128,
        ),
    ),
    "qwen2-tied-gqa4-hd16": (
        "qwen2",
        dict(tie_word_embeddings=True, num_key_value_heads=1, rope_theta=2e4),
    ),
    "llama-untied-gqa2-hd16": ("llama", dict(rope_theta=1e5)),
    "llama-tied-gqa3-hd8": (
        "llama",
        dict(
            hidden_size=48,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=8,
            tie_word_embeddings=True,
            rms_norm_eps=1e-5,
        ),
    ),
}
ALL_CASES = pytest.mark.parametrize("case", list(CASES))
TWO_CASES = pytest.mark.parametrize(
    "case", ["qwen3-untied-gqa2-hd16", "qwen2-tied-gqa4-hd16", "llama-tied-gqa3-hd8"]
)

_forward = jax.jit(forward, static_argnums=1)


@pytest.fixture
def ckpt(hf_checkpoint, case):
    arch, shape = CASES[case]
    return hf_checkpoint(arch, **shape)


def left_padded(vocab: int, seed: int = 0, pads=(0, 4, 9), seq: int = 12):
    """Random tokens (on the padding too) and a left-padding mask, as numpy arrays."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (len(pads), seq))
    return tokens, np.arange(seq)[None] >= np.asarray(pads)[:, None]


@functools.lru_cache(maxsize=8)
def _hf_model(path: str, dtype: torch.dtype):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    return model.to(dtype).eval()


def hf_logits(path, tokens, mask, dtype=torch.float32) -> np.ndarray:
    """transformers' logits (float32) with explicit left-padding positions."""
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        out = _hf_model(str(path), dtype)(
            input_ids=torch.as_tensor(tokens),
            attention_mask=torch.as_tensor(mask.astype(np.int64)),
            position_ids=torch.as_tensor(positions),
        )
    return out.logits.float().numpy()


def our_logits(params, config, tokens, mask) -> np.ndarray:
    return np.asarray(_forward(params, config, jnp.asarray(tokens), jnp.asarray(mask)))


def assert_parity(ours, ref, mask) -> float:
    """|ours - ref| <= 1e-4 * max(1, |ref|) on every valid position; returns max |diff|."""
    ours, ref = ours[mask], ref[mask]
    assert np.isfinite(ours).all()
    diff = np.abs(ours - ref)
    worst = np.argmax(diff - 1e-4 * np.maximum(1.0, np.abs(ref)))
    assert diff.flat[worst] <= 1e-4 * max(1.0, abs(ref.flat[worst])), (
        f"max |diff| {diff.max():.3g} (ref {ref.flat[worst]:.3g}) exceeds 1e-4 * max(1, |ref|)"
    )
    return float(diff.max())


def assert_trees_bitwise_equal(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for (path, x), y in zip(
        jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b), strict=True
    ):
        x, y = np.asarray(x), np.asarray(y)
        where = jax.tree_util.keystr(path)
        assert x.dtype == y.dtype and x.shape == y.shape, where
        bits = np.dtype(f"u{x.dtype.itemsize}")
        np.testing.assert_array_equal(x.view(bits), y.view(bits), err_msg=where)


# ---- parity with transformers -------------------------------------------------------------------


@pytest.mark.slow
@ALL_CASES
def test_float32_parity_on_left_padded_batch(ckpt, case):
    config, params = load_hf(ckpt, dtype=jnp.float32)
    assert jax.tree_util.tree_leaves(params)[0].dtype == jnp.float32
    tokens, mask = left_padded(config.vocab_size)
    ref = hf_logits(ckpt, tokens, mask)
    assert np.abs(ref[mask]).max() > 1.0  # random weights give O(1) logits, not near-zero ones
    worst = assert_parity(our_logits(params, config, tokens, mask), ref, mask)
    print(f"\n[parity f32] {case}: max |diff| {worst:.3g}, max |ref| {np.abs(ref[mask]).max():.3g}")


@pytest.mark.slow
@TWO_CASES
def test_bfloat16_parity(ckpt, case):
    """bfloat16 params against transformers in bfloat16, and both against the float32 truth.

    bf16 keeps 8 significant bits (unit roundoff 2^-9 ~ 0.2%), and two bf16 implementations
    round at different points (fused vs separate ops, accumulation order), so logits differ by
    a few bf16 ulps of the logit scale after 2 layers; all figures are relative to
    ``scale = max |f32 reference|``. Bounds: (1) our bf16 error against float32 is no worse than
    transformers' own bf16 error (mean within 1.5x, max within 3x: the max of a few hundred
    samples is noisy); (2) ours vs transformers-bf16 within max 5% / mean 1% of scale (measured
    ~1.2-1.7% / ~0.25%: a couple of bf16 ulps; a real bug such as a wrong rope or norm gives
    differences of order 100% of scale).
    """
    config, params = load_hf(ckpt, dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(params))
    tokens, mask = left_padded(config.vocab_size)
    ours = our_logits(params, config, tokens, mask)[mask]
    f32 = hf_logits(ckpt, tokens, mask)[mask]
    hf_bf16 = hf_logits(ckpt, tokens, mask, torch.bfloat16)[mask]
    scale = np.abs(f32).max()
    figures = {}
    for name, a, b in [
        ("ours-bf16 vs hf-bf16", ours, hf_bf16),
        ("ours-bf16 vs f32", ours, f32),
        ("hf-bf16 vs f32", hf_bf16, f32),
    ]:
        diff = np.abs(a - b)
        figures[name] = diff.max(), diff.mean()
        print(
            f"\n[parity bf16] {case} {name}: max |diff| {diff.max():.3g} "
            f"({diff.max() / scale:.2%} of scale {scale:.3g}), mean |diff| {diff.mean():.3g} "
            f"({diff.mean() / scale:.2%})"
        )
    (ours_max, ours_mean), (hf_max, hf_mean) = (
        figures["ours-bf16 vs f32"],
        figures["hf-bf16 vs f32"],
    )
    assert ours_mean <= 1.5 * hf_mean and ours_max <= 3 * hf_max
    direct_max, direct_mean = figures["ours-bf16 vs hf-bf16"]
    assert direct_max <= 0.05 * scale and direct_mean <= 0.01 * scale


# ---- save_hf ------------------------------------------------------------------------------------


@pytest.mark.slow
@TWO_CASES
@pytest.mark.parametrize("max_shard_bytes", [4 << 30, 20_000], ids=["single", "sharded"])
def test_save_hf_loads_in_transformers(ckpt, case, max_shard_bytes, tmp_path):
    """transformers loads what save_hf writes (one file or shards + index): same logits."""
    config, params = load_hf(ckpt, dtype=jnp.float32)
    out = save_hf(tmp_path / "saved", config, params, max_shard_bytes=max_shard_bytes)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    index = out / "model.safetensors.index.json"
    if max_shard_bytes == 20_000:
        assert len(shards) > 1 and index.is_file() and "model.safetensors" not in shards
        weight_map = json.loads(index.read_text())["weight_map"]
        assert sorted(set(weight_map.values())) == shards
    else:
        assert shards == ["model.safetensors"] and not index.exists()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, attn_implementation="eager"
    )
    assert type(model).__name__ == config.architecture
    tokens, mask = left_padded(config.vocab_size, seed=1)
    positions = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        ref = model(
            input_ids=torch.as_tensor(tokens),
            position_ids=torch.as_tensor(positions),
            attention_mask=torch.as_tensor(mask.astype(np.int64)),
        ).logits.numpy()
    assert_parity(our_logits(params, config, tokens, mask), ref, mask)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("max_shard_bytes", [4 << 30, 20_000], ids=["single", "sharded"])
@pytest.mark.parametrize("case", ["qwen3-tied-mha-theta1e6", "qwen2-untied-gqa4-theta5e5"])
def test_save_load_roundtrip_is_bitwise(ckpt, dtype, max_shard_bytes, tmp_path):
    config, params = load_hf(ckpt, dtype=dtype)
    again_config, again = load_hf(
        save_hf(tmp_path, config, params, max_shard_bytes=max_shard_bytes), dtype=dtype
    )
    assert again_config == config
    assert_trees_bitwise_equal(again, params)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["torch_dtype"] == jnp.dtype(dtype).name


def test_save_hf_replaces_a_previous_layout(hf_checkpoint, tmp_path):
    """Saving unsharded over a sharded save leaves no stale index or shard behind (and back)."""
    config, params = load_hf(hf_checkpoint(), dtype=jnp.float32)
    save_hf(tmp_path, config, params, max_shard_bytes=20_000)
    save_hf(tmp_path, config, params)
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]
    save_hf(tmp_path, config, params, max_shard_bytes=20_000)
    assert not (tmp_path / "model.safetensors").exists()
    assert_trees_bitwise_equal(load_hf(tmp_path, dtype=jnp.float32)[1], params)


# ---- bad checkpoints ----------------------------------------------------------------------------


def _edit_tensors(folder: Path, edit) -> Path:
    file = folder / "model.safetensors"
    tensors = safetensors.numpy.load_file(str(file))
    edit(tensors)
    safetensors.numpy.save_file(tensors, str(file), metadata={"format": "pt"})
    return folder


def _edit_config(folder: Path, edit) -> Path:
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _noise(*shape):
    return np.random.default_rng(0).normal(0, 0.2, shape).astype(np.float32)


def _truncate(folder: Path) -> Path:
    file = folder / "model.safetensors"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    return folder


def _garble_header(folder: Path) -> Path:
    file = folder / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:24] = b"not a json head!"
    file.write_bytes(bytes(data))
    return folder


def _only_pytorch_bin(folder: Path) -> Path:
    (folder / "model.safetensors").unlink()
    torch.save({"model.norm.weight": torch.randn(32)}, folder / "pytorch_model.bin")
    return folder


def _shard_then_lose_one(folder: Path) -> Path:
    save_hf(folder, *load_hf(folder, dtype=jnp.float32), max_shard_bytes=20_000)
    sorted(folder.glob("model-*.safetensors"))[-1].unlink()
    return folder


def _empty(folder: Path) -> Path:
    shutil.rmtree(folder)
    folder.mkdir()
    return folder


BAD_CHECKPOINTS = {
    "directory-missing": (lambda f: f / "no-such-dir", r"'.*no-such-dir' does not exist"),
    "empty-directory": (_empty, r"config\.json is missing"),
    "config-not-json": (
        lambda f: (f / "config.json").write_text("{ nope") and f,
        r"config\.json is not valid JSON",
    ),
    "unsupported-architecture": (
        lambda f: _edit_config(
            f, lambda c: c.update(architectures=["MistralForCausalLM"], model_type="mistral")
        ),
        r"unsupported architecture 'MistralForCausalLM'.*"
        r"\['Qwen3ForCausalLM', 'Qwen2ForCausalLM', 'LlamaForCausalLM', 'Qwen3_5ForCausalLM', "
        r"'LLaDAModelLM'\]",
    ),
    "config-field-missing": (
        lambda f: _edit_config(f, lambda c: c.pop("hidden_size")),
        r"required field\(s\) \['hidden_size'\] missing",
    ),
    "rope-scaling": (
        lambda f: _edit_config(
            f,
            lambda c: c.update(
                rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
            ),
        ),
        r"rope_type 'yarn' is not supported",
    ),
    "missing-tensor": (
        lambda f: _edit_tensors(f, lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
        r"missing tensor\(s\) \['model\.layers\.1\.mlp\.up_proj\.weight'\]",
    ),
    "unexpected-tensor": (
        lambda f: _edit_tensors(
            f, lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": _noise(32)})
        ),
        r"unexpected tensor\(s\) \['model\.layers\.0\.self_attn\.o_proj\.bias'\]",
    ),
    "shape-mismatch": (
        lambda f: _edit_tensors(
            f, lambda t: t.update({"model.layers.1.self_attn.k_proj.weight": _noise(32, 24)})
        ),
        r"tensor 'model\.layers\.1\.self_attn\.k_proj\.weight' has shape \(32, 24\), "
        r"expected \(32, 32\)",
    ),
    "truncated-safetensors": (_truncate, r"model\.safetensors is not a readable safetensors file"),
    "garbled-safetensors-header": (
        _garble_header,
        r"model\.safetensors is not a readable safetensors file",
    ),
    "only-pytorch-bin": (
        _only_pytorch_bin,
        r"No \*\.safetensors file.*no pickle.*pytorch_model\.bin",
    ),
    "index-names-missing-shard": (
        _shard_then_lose_one,
        r"index\.json lists shard\(s\) that do not exist: \[.*model-0000(\d)-of-0000\1"
        r"\.safetensors'\]",
    ),
}


@pytest.mark.parametrize("name", list(BAD_CHECKPOINTS))
def test_bad_checkpoint_error_names_the_problem(name, checkpoint_copy):
    breaker, match = BAD_CHECKPOINTS[name]
    path = breaker(checkpoint_copy)
    with pytest.raises(CheckpointError, match=match):
        load_hf(path, dtype=jnp.float32)


# ---- tokenizer ----------------------------------------------------------------------------------


def test_tokenizer_round_trip(hf_checkpoint):
    tok = HFTokenizer(hf_checkpoint())
    V = tok.vocab_size
    assert V == 96  # words "0".."94" and "<eos>" = 95, exactly the model's vocabulary
    ids = np.random.default_rng(0).integers(0, V - 1, 20).tolist()
    text = tok.decode(ids)
    assert text == " ".join(map(str, ids))
    assert tok.encode(text) == ids
    assert tok.encode(text + " <eos>") == ids + [V - 1]
    assert tok.decode(ids + [V - 1]) == text
    assert tok.decode(ids + [V - 1], skip_special=False) == text + " <eos>"


def test_tokenizer_special_ids_come_from_generation_config(hf_checkpoint, tmp_path):
    tok = HFTokenizer(hf_checkpoint())
    assert (tok.eos_id, tok.eos_ids, tok.pad_id) == (95, (95,), 95)
    folder = Path(shutil.copytree(hf_checkpoint(), tmp_path / "ckpt"))
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [7, 95], "pad_token_id": 3})
    )
    tok = HFTokenizer(folder / "tokenizer.json")
    assert (tok.eos_id, tok.eos_ids, tok.pad_id) == (7, (7, 95), 3)


def test_tokenizer_config_adds_its_eos_and_pad(hf_checkpoint, tmp_path):
    """The tokenizer config's eos_token joins the generation config's ids (after them);
    its pad_token is used when no config names a pad_token_id; {"content": ...} objects work."""
    folder = Path(shutil.copytree(hf_checkpoint(), tmp_path / "ckpt"))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7]}))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<eos>", "pad_token": {"content": "3", "special": False}})
    )
    tok = HFTokenizer(folder)
    assert (tok.eos_id, tok.eos_ids, tok.pad_id) == (7, (7, 95), 3)
    (folder / "generation_config.json").unlink()
    (folder / "config.json").write_text(
        json.dumps({**json.loads((folder / "config.json").read_text()), "eos_token_id": 95})
    )
    tok = HFTokenizer(folder)
    assert (tok.eos_id, tok.eos_ids, tok.pad_id) == (95, (95,), 3)  # no duplicate
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(CheckpointError, match=r"eos_token '</s>' is not in the tokenizer's vocab"):
        HFTokenizer(folder)


def test_tokenizer_chat_template_from_tokenizer_config(hf_checkpoint, tmp_path):
    folder = Path(shutil.copytree(hf_checkpoint(), tmp_path / "ckpt"))
    tok = HFTokenizer(folder)
    assert tok.chat_template is None
    with pytest.raises(CheckpointError, match=r"has no chat template: put one in tokenizer_config"):
        tok.apply_chat_template([{"role": "user", "content": "1 2"}])
    template = (
        "{% for m in messages %}{{ m.content }} {% endfor %}"
        "{% if add_generation_prompt %}{{ 9 if enable_thinking is defined else 8 }} {% endif %}"
        "{{ eos_token }}"
    )
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": template, "eos_token": "<eos>"})
    )
    tok = HFTokenizer(folder)
    messages = [{"role": "user", "content": "1 2"}, {"role": "assistant", "content": "3"}]
    assert tok.apply_chat_template(messages) == "1 2 3 <eos>"
    assert tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True) == [
        1,
        2,
        3,
        8,
        95,
    ]
    assert (
        tok.apply_chat_template(
            messages, add_generation_prompt=True, enable_thinking=False, eos_token="4"
        )
        == "1 2 3 9 4"
    )


def test_tokenizer_errors(hf_checkpoint, tmp_path):
    config, _ = load_hf(hf_checkpoint(), dtype=jnp.float32)
    tok = HFTokenizer(hf_checkpoint())
    check_vocab(tok, config)  # equal sizes fit
    small = dataclasses.replace(config, vocab_size=64)
    with pytest.raises(
        CheckpointError,
        match=r"Tokenizer vocabulary \(96 ids\) is larger than "
        r"the model's vocab_size \(64\)",
    ):
        check_vocab(tok, small)
    tok.eos_ids = (95, 96)  # a second stop id outside the embedding
    with pytest.raises(
        CheckpointError, match=r"special id\(s\) \{'eos_ids\[1\]': 96\} are outside"
    ):
        check_vocab(tok, config)
    with pytest.raises(CheckpointError, match=r"tokenizer\.json is missing"):
        HFTokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{ nope")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json is not a valid tokenizers file"):
        HFTokenizer(tmp_path)
