"""A random-weight Qwen3-shaped Hugging Face checkpoint around a real tokenizer.

Weights cannot be downloaded everywhere, but a tokenizer can; this writes a checkpoint directory
that every part of the real-model path reads as it would read Qwen3-0.6B (``ais-jax train
--set model.checkpoint=DIR``, ``eval``, ``sample --checkpoint``, ``export-hf``,
``transformers.AutoModelForCausalLM.from_pretrained``), at any size::

    python -m ais_jax.tools.random_qwen3 --tokenizer tests/data/qwen3-tokenizer \\
        --out /tmp/qwen3-random --layers 2 --hidden 64          # 10M parameters, 39 MB
    python -m ais_jax.tools.random_qwen3 --tokenizer DIR --out DIR --preset qwen3-0.6b

The directory holds:

* ``config.json`` + ``model.safetensors`` (`ais_jax.io.hf.save_hf`): a ``Qwen3ForCausalLM`` with
  vocabulary ``--vocab-size`` (151,936, Qwen3's padded vocabulary, by default) and the shape of
  ``--preset`` (``qwen3-0.6b`` by default) with ``--layers``, ``--hidden``, ... overriding it.
  Weights are drawn with NumPy from ``--seed``: matrices ``0.02 N(0, 1)`` (as
  `ais_jax.models.init_params` and Hugging Face's initializer), every RMSNorm scale
  ``1 + 0.1 N(0, 1)`` (not all ones, so a test of logits compares non-trivial numbers);
* the tokenizer files copied from ``--tokenizer``: ``tokenizer.json`` (or ``tokenizer.json.gz``,
  decompressed, as the test fixture ships it), ``tokenizer_config.json`` (with the chat
  template), ``chat_template.jinja`` if there is one;
* ``generation_config.json``: copied if ``--tokenizer`` has one, else Qwen3's published
  end-of-sequence ids -- the ids of ``<|im_end|>`` and ``<|endoftext|>`` in this tokenizer
  (151645 and 151643 for Qwen3) -- with ``pad_token_id`` and ``bos_token_id`` ``<|endoftext|>``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ais_jax.io.hf import CheckpointError, HFTokenizer, check_vocab, save_hf
from ais_jax.models import param_shapes
from ais_jax.models.qwen3 import ModelConfig

__all__ = ["QWEN3_VOCAB", "write_random_qwen3"]

QWEN3_VOCAB = 151_936  # Qwen3's embedding rows (151,669 tokenizer ids, padded)
_EOS_TOKENS = ("<|im_end|>", "<|endoftext|>")  # Qwen3's generation_config.json order
_COPIED = ("tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def write_random_qwen3(
    tokenizer_dir: str | Path,
    out: str | Path,
    *,
    preset: str = "qwen3-0.6b",
    vocab_size: int = QWEN3_VOCAB,
    seed: int = 0,
    norm_std: float = 0.1,
    dtype: str = "float32",
    **shape: int,
) -> Path:
    """Write a random ``Qwen3ForCausalLM`` of ``preset``'s shape (with ``shape`` overrides:
    ``num_layers``, ``hidden_size``, ``num_heads``, ``num_kv_heads``, ``head_dim``,
    ``intermediate_size``) and ``vocab_size`` rows, plus ``tokenizer_dir``'s tokenizer files,
    into ``out``. Returns ``out``."""
    tokenizer_dir, out = Path(tokenizer_dir), Path(out)
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype {dtype!r} is invalid: use 'float32' or 'bfloat16'.")
    config = ModelConfig.preset(preset, vocab_size=vocab_size, **shape)
    if not config.qk_norm:
        raise ValueError(f"preset {preset!r} is not a Qwen3 shape (no q/k norm).")
    out.mkdir(parents=True, exist_ok=True)
    _copy_tokenizer(tokenizer_dir, out)
    tokenizer = HFTokenizer(out)
    check_vocab(tokenizer, config)

    rng = np.random.default_rng(seed)

    def draw(path, leaf) -> np.ndarray:  # NumPy, not jax.random: no compile per shape
        name = str(path[-1].key)
        noise = rng.standard_normal(leaf.shape, dtype=np.float32)
        if name.endswith("norm"):
            return 1.0 + norm_std * noise
        return np.zeros(leaf.shape, np.float32) if name.endswith("bias") else 0.02 * noise

    shapes = param_shapes(config, jnp.float32)
    params = jax.tree_util.tree_map_with_path(draw, shapes)
    params = jax.tree_util.tree_map(lambda x: x.astype(jnp.dtype(dtype)), params)
    save_hf(out, config, params)
    return out


def _copy_tokenizer(src: Path, out: Path) -> None:
    """tokenizer.json (or .json.gz, decompressed) and the optional files of ``_COPIED``; a
    generation_config.json with Qwen3's EOS ids when ``src`` has none."""
    if not src.is_dir():
        raise CheckpointError(f"--tokenizer {str(src)!r} is not a directory.")
    if (src / "tokenizer.json").is_file():
        shutil.copyfile(src / "tokenizer.json", out / "tokenizer.json")
    elif (src / "tokenizer.json.gz").is_file():
        with (
            gzip.open(src / "tokenizer.json.gz", "rb") as f,
            open(out / "tokenizer.json", "wb") as g,
        ):
            shutil.copyfileobj(f, g)
    else:
        raise CheckpointError(
            f"{src} holds neither tokenizer.json nor tokenizer.json.gz: give the directory of "
            "a Qwen3 tokenizer (e.g. a downloaded Qwen3 checkpoint, or the test fixture)."
        )
    for name in _COPIED:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    if not (src / "generation_config.json").is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(out / "tokenizer.json"))
        ids = [i for t in _EOS_TOKENS if (i := tok.token_to_id(t)) is not None]
        generation = {"eos_token_id": ids}
        if tok.token_to_id("<|endoftext|>") is not None:
            pad = tok.token_to_id("<|endoftext|>")
            generation |= {"bos_token_id": pad, "pad_token_id": pad}
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ais_jax.tools.random_qwen3", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--tokenizer", required=True, help="directory with tokenizer.json[.gz]")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--preset", default="qwen3-0.6b", help="shape to start from (qwen3-*)")
    p.add_argument("--layers", type=int, help="num_hidden_layers")
    p.add_argument("--hidden", type=int, help="hidden_size")
    p.add_argument("--heads", type=int, help="num_attention_heads")
    p.add_argument("--kv-heads", type=int, help="num_key_value_heads")
    p.add_argument("--head-dim", type=int)
    p.add_argument("--intermediate", type=int, help="MLP width")
    p.add_argument("--vocab-size", type=int, default=QWEN3_VOCAB)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args(argv)
    names = {
        "layers": "num_layers",
        "hidden": "hidden_size",
        "heads": "num_heads",
        "kv_heads": "num_kv_heads",
        "head_dim": "head_dim",
        "intermediate": "intermediate_size",
    }
    shape = {ours: getattr(args, a) for a, ours in names.items() if getattr(args, a) is not None}
    try:
        out = write_random_qwen3(
            args.tokenizer,
            args.out,
            preset=args.preset,
            vocab_size=args.vocab_size,
            seed=args.seed,
            dtype=args.dtype,
            **shape,
        )
    except (ValueError, OSError) as e:
        print(f"random_qwen3: error: {e}", file=sys.stderr)
        return 2
    config = ModelConfig.from_hf_dict(json.loads((out / "config.json").read_text()))
    print(f"wrote {out} ({config.num_params / 1e6:.1f}M parameters, {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
