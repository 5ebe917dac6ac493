"""Specification of GGUF loading (`gguf_file.py` through `hf.load_hf` / `hf.HFTokenizer`).

Each GGUF here is written by the test with `gguf.GGUFWriter` from a random Hugging Face Llama
checkpoint (conftest.py), the way llama.cpp's converter writes one: llama.cpp's tensor names,
q/k rows permuted (`llama_cpp_permute`, written out here from ``convert_hf_to_gguf.py``), the
weights quantized by `gguf.quants.quantize`. The references are independent of ais_jax:
`transformers` reads the same file (its own dequantization, un-permutation, config and tokenizer
conversion), and a float32 GGUF must load to exactly the tensors of the directory it came from.
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from gguf import GGMLQuantizationType as Q

from ais_jax.io.hf import CheckpointError, HFTokenizer, load_hf, save_hf
from ais_jax.models import forward

_forward = jax.jit(forward, static_argnums=1)

# HF suffix -> llama.cpp name, written from llama.cpp's tensor table (gguf-py constants.py)
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
TOP_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# a different GGUF type for each kind of tensor, so every required type is read
MIXED = {
    "token_embd": Q.Q8_0,
    "attn_q": Q.Q4_1,
    "attn_k": Q.Q4_0,
    "attn_v": Q.Q8_0,
    "attn_output": Q.F16,
    "ffn_gate": Q.BF16,
    "ffn_up": Q.Q4_1,
    "ffn_down": Q.Q4_0,
    "output": Q.F16,
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
VOCAB = 320  # 256 byte tokens, 3 specials, 61 merges


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """``convert_hf_to_gguf.LlamaModel.permute``: each head's rows from HF's two halves to
    interleaved rotary pairs."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def byte_bpe(corpus: list[str]):
    """A byte-level BPE tokenizer trained on ``corpus`` to VOCAB ids: ``(tokens, merges)``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = model["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    assert len(tokens) == VOCAB, len(tokens)
    return tokens, merges


CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "What is 12 + 345? The answer is 357.",
    "def f(x):\n    return x * 2\n",
    "Hello, world! Hello again; hello there.",
] * 20


def write_gguf(
    hf_dir: Path,
    path: Path,
    *,
    types: dict[str, Q] | None = None,
    edit=None,
    arch: str = "llama",
) -> Path:
    """``hf_dir`` (a Llama directory) as a GGUF file at ``path``, tensors of ``types`` (by
    llama.cpp base name; F32 otherwise), with a byte-level BPE tokenizer and a chat template.
    ``edit(name, array) -> (array, type)`` may change a tensor before it is written."""
    config = json.loads((hf_dir / "config.json").read_text())
    tensors = safetensors.numpy.load_file(str(hf_dir / "model.safetensors"))
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_dimension_count(config["head_dim"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_vocab_size(config["vocab_size"])
    tokens, merges = byte_bpe(CORPUS)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, array in tensors.items():
        if name in TOP_NAMES:
            ours = TOP_NAMES[name]
        else:
            _, _, i, rest = name.split(".", 3)
            ours = f"blk.{i}.{LAYER_NAMES[rest]}"
            if rest == "self_attn.q_proj.weight":
                array = llama_cpp_permute(array, heads)
            elif rest == "self_attn.k_proj.weight":
                array = llama_cpp_permute(array, kv_heads)
        base = ours.removesuffix(".weight").split(".")[-1]
        qtype = (types or {}).get(base, Q.F32) if array.ndim == 2 else Q.F32
        if edit is not None:
            array, qtype = edit(ours, array, qtype)
        if qtype in (Q.F32, Q.I32):
            w.add_tensor(ours, array)
        else:
            w.add_tensor(
                ours, gguf.quants.quantize(array.astype(np.float32), qtype), raw_dtype=qtype
            )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


LLAMA = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, max_position_embeddings=256)
CASES = {
    "untied-gqa2": dict(LLAMA),
    "tied-gqa4-hd8": dict(
        LLAMA, num_attention_heads=8, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True
    ),
}


@pytest.fixture(scope="module", params=list(CASES))
def llama_dir(request, hf_checkpoint):
    return hf_checkpoint("llama", **CASES[request.param])


def _reference_logits(gguf_path: Path, tokens: np.ndarray) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.numpy()


@pytest.mark.slow
def test_float32_gguf_loads_to_the_tensors_it_was_written_from(llama_dir, tmp_path):
    """The un-permutation and the name table, against the directory itself: bit for bit."""
    path = write_gguf(llama_dir, tmp_path / "model.gguf")
    config, params = load_hf(path, dtype=jnp.float32)
    want_config, want = load_hf(llama_dir, dtype=jnp.float32)
    assert config.architecture == "LlamaForCausalLM"
    assert config == want_config
    jax.tree.map(np.testing.assert_array_equal, params, want)


@pytest.mark.slow
def test_quantized_gguf_logits_match_transformers(llama_dir, tmp_path):
    path = write_gguf(llama_dir, tmp_path / "model.gguf", types=MIXED)
    config, params = load_hf(path, dtype=jnp.float32)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 11))
    ours = np.asarray(_forward(params, config, jnp.asarray(tokens)))
    ref = _reference_logits(path, tokens)
    assert np.abs(ref).max() > 0.5  # random weights, not a degenerate model
    np.testing.assert_array_less(np.abs(ours - ref), 1e-4 * np.maximum(1.0, np.abs(ref)))
    # quantized, so not the float32 directory's logits (the file's own weights were read)
    _, exact = load_hf(llama_dir, dtype=jnp.float32)
    assert np.abs(np.asarray(_forward(exact, config, jnp.asarray(tokens))) - ours).max() > 1e-3


def test_gguf_tokenizer_matches_transformers(hf_checkpoint, tmp_path):
    path = write_gguf(hf_checkpoint("llama", **LLAMA), tmp_path / "model.gguf")
    ours = HFTokenizer(path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    rng = random.Random(0)
    alphabet = (
        string.ascii_letters + string.digits + " \n\t.,;:!?'\"()[]{}+-*/=<>_#@%&" + "éüßñ日本語"
    )
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))) for _ in range(200)]
    texts += CORPUS[:4] + ["  leading spaces", "trailing  ", "<|im_start|>user\nhi<|im_end|>\n"]
    for text in texts:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, skip_special=False) == ref.decode(ids), text
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == (
        ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    )
    assert ours.eos_ids == (2,) and ours.pad_id == 0 and ours.vocab_size == VOCAB


def test_gguf_tokenizer_saves_as_a_directory_transformers_reads(hf_checkpoint, tmp_path):
    path = write_gguf(hf_checkpoint("llama", **LLAMA), tmp_path / "model.gguf")
    saved = HFTokenizer(path).save(tmp_path / "hf")
    again, ref = HFTokenizer(saved), transformers.AutoTokenizer.from_pretrained(str(saved))
    messages = [{"role": "user", "content": "the fox 12"}]
    text = again.apply_chat_template(messages, add_generation_prompt=True)
    assert text == ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert again.encode(text) == ref.encode(text, add_special_tokens=False)
    assert again.eos_ids == (2,) and again.pad_id == 0


def test_a_tensor_type_that_cannot_be_dequantized_is_named(hf_checkpoint, tmp_path):
    def as_int(name, array, qtype):
        if name == "blk.1.ffn_up.weight":
            return (array * 100).astype(np.int32), Q.I32
        return array, qtype

    path = write_gguf(hf_checkpoint("llama", **LLAMA), tmp_path / "m.gguf", edit=as_int)
    with pytest.raises(CheckpointError, match=r"tensor 'blk\.1\.ffn_up\.weight' has GGUF type I32"):
        load_hf(path)


def test_unsupported_architecture_and_damaged_file(hf_checkpoint, tmp_path):
    folder = hf_checkpoint("llama", **LLAMA)
    with pytest.raises(CheckpointError, match=r"GGUF architecture 'gemma' is not supported"):
        load_hf(write_gguf(folder, tmp_path / "g.gguf", arch="gemma"))
    path = write_gguf(folder, tmp_path / "t.gguf")
    path.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(CheckpointError, match=r"is not a readable GGUF file"):
        load_hf(path)
    with pytest.raises(CheckpointError, match=r"does not exist"):
        load_hf(tmp_path / "missing.gguf")


def poisoned_copy(folder: Path, dest: Path, name: str, index: tuple[int, int]) -> Path:
    """A copy of the checkpoint directory ``folder`` at ``dest`` with NaN at ``index`` of tensor
    ``name``."""
    dest.mkdir()
    for f in folder.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    tensors = safetensors.numpy.load_file(str(dest / "model.safetensors"))
    tensors[name][index] = np.nan
    safetensors.numpy.save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def test_non_finite_weights_are_refused_naming_the_tensor(hf_checkpoint, tmp_path):
    folder = hf_checkpoint("llama", **LLAMA)

    def poison(name, array, qtype):
        if name == "blk.0.attn_v.weight":
            array = array.copy()
            array[3, 5], array[0, 0] = np.inf, np.nan
        return array, qtype

    with pytest.raises(CheckpointError) as e:
        load_hf(write_gguf(folder, tmp_path / "p.gguf", edit=poison))
    assert (
        "tensor 'model.layers.0.self_attn.v_proj.weight' holds non-finite values (1 NaN, 1 inf"
        in (str(e.value))
    )
    assert "\n" not in str(e.value)
    copy = poisoned_copy(folder, tmp_path / "dir", "model.layers.1.mlp.down_proj.weight", (2, 2))
    with pytest.raises(
        CheckpointError,
        match=r"tensor 'model\.layers\.1\.mlp\.down_proj\.weight' "
        r"holds non-finite values \(1 NaN, 0 inf of 6144\)",
    ):
        load_hf(copy)


def test_sample_refuses_a_checkpoint_with_a_nan_in_one_line(hf_checkpoint, tmp_path, capsys):
    from ais_jax.cli.main import main

    folder = hf_checkpoint("llama", **LLAMA)
    copy = poisoned_copy(folder, tmp_path / "dir", "model.embed_tokens.weight", (7, 1))
    capsys.readouterr()
    assert main(["sample", "--checkpoint", str(copy), "--prompt", "1 2", "--n", "1"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    (line,) = err.strip().splitlines()
    assert line.startswith("ais-jax sample: error: ") and "'model.embed_tokens.weight'" in line


def test_package_paths_name_a_file_inside_an_installed_package(tmp_path):
    from ais_jax.io.hf import resolve_checkpoint

    assert resolve_checkpoint("package:gguf/constants.py") == Path(gguf.__file__).parent / (
        "constants.py"
    )
    with pytest.raises(CheckpointError, match=r"no installed Python package 'no_such_pkg'"):
        resolve_checkpoint("package:no_such_pkg/model.gguf")


def test_llada_loader_refuses_non_finite_weights_too(tmp_path):
    from ais_jax.models import llada

    config = llada.LLaDAConfig.tiny()
    params = jax.device_get(llada.init_params(config, jax.random.key(0)))
    params["final_norm"] = np.asarray(params["final_norm"]).copy()
    params["final_norm"][1] = np.inf
    path = save_hf(tmp_path / "llada", config, params)
    with pytest.raises(CheckpointError, match=r"holds non-finite values \(0 NaN, 1 inf of "):
        load_hf(path)
