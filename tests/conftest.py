"""Shared fixtures: tiny random Hugging Face Qwen3/Qwen2/Llama checkpoints made by `transformers`.

`make_hf_checkpoint(tmp_path_factory, arch, **shape)` writes a float32 `save_pretrained`
directory whose every weight is random (matrices std 0.2, norms 1 + 0.2 N(0, 1), Qwen2 q/k/v
biases 0.2 N(0, 1)) so logits are O(1), never near zero, plus a `tokenizer.json` (WordLevel over
the whitespace-separated words "0" .. "V-2", and "<eos>" = V-1) and a `generation_config.json`
naming that eos id. The `hf_checkpoint` fixture is the same factory, cached per session: treat
the directories it returns as read-only (copy one before breaking it).

Every test runs with ``jax_numpy_rank_promotion="raise"`` (`_strict_rank_promotion`): an
implicit broadcast between arrays of different rank is an error, not a silent outer product.

XLA:CPU compiles the suite's programs fast (`FAST_COMPILE`, added to ``XLA_FLAGS`` here, before
JAX starts its backend, each flag unless ``XLA_FLAGS`` already sets it; subprocesses inherit
them): LLVM at ``-O0``, and loop and reduction fusions by XLA's older elemental emitter instead
of its MLIR fusion emitters. The suite's models are tiny, so most of its time was XLA compiling,
which these flags make 4-5x faster (a whole run here: 1,926 worker-s of backend compile with
XLA's defaults, 1,021 at -O0 alone, 419 with both). The programs are the same HLO; only the
machine code differs (no vectorization or instruction scheduling, other math-function
expansions), so float32 results may differ in their last bits, as they do between CPUs, and no
test compares numbers computed under both settings. A test that runs long enough for the
compiled code's speed to matter runs its job in a subprocess with `default_compile_env()`, XLA's
defaults, as a user's run compiles; a test's own jitted function that runs long compiles with
them by ``jax.jit(f, **XLA_DEFAULTS)``.

The suite's processes share one persistent compilation cache (`pytest_configure`): a temporary
directory the controlling process creates, names in ``AIS_JAX_TEST_COMPILE_CACHE`` for its
pytest-xdist workers, and removes at the end. Each pytest process compiles into it (every
program, however quick), so a program that both workers build (the same model and shapes in
several modules) compiles once. The directory is set through `jax.config`, not JAX's
environment variable, so subprocesses (the learning job, the notebooks' kernels, the 8-device
workers) compile as a user's run does. No size limit: with one, JAX's cache rescans every
entry on each write under a file lock, and a whole run with a limit was slower than a run
without the cache (it had not finished after 28 minutes, against ~23 without). A hit still
counts as a compile for `count_compiles` (JAX times the cache lookup as the backend compile).
"""

from __future__ import annotations

import os

FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}
XLA_DEFAULTS = {  # XLA's defaults for the same options, per `jax.jit`
    "compiler_options": {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}
}
_FAST_FLAGS = {name: f"--{name}={str(value).lower()}" for name, value in FAST_COMPILE.items()}
_flags = os.environ.get("XLA_FLAGS", "")
_added = [flag for name, flag in _FAST_FLAGS.items() if name not in _flags]
os.environ["XLA_FLAGS"] = " ".join([_flags, *_added]).strip()

import contextlib  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

COMPILE_CACHE_ENV = "AIS_JAX_TEST_COMPILE_CACHE"


def pytest_configure(config):
    """The session's shared compilation cache (see the module docstring)."""
    if COMPILE_CACHE_ENV not in os.environ:  # the controlling process: workers inherit it
        os.environ[COMPILE_CACHE_ENV] = tempfile.mkdtemp(prefix="ais-jax-test-jit-")
        config._ais_jax_compile_cache = os.environ[COMPILE_CACHE_ENV]
    jax.config.update("jax_compilation_cache_dir", os.environ[COMPILE_CACHE_ENV])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    cache = getattr(config, "_ais_jax_compile_cache", None)
    if cache is not None:
        shutil.rmtree(cache, ignore_errors=True)
        del os.environ[COMPILE_CACHE_ENV]


@contextlib.contextmanager
def count_compiles(name: str):
    """The XLA compiles of a jitted function named ``name`` inside the block, as a list that
    grows by one per compile (JAX's backend-compile events, whose ``fun_name`` is ``jit(name)``).

    Tests of "this does not recompile" count compiles, not ``jitted._cache_size()``: every jit
    with options (static arguments, compiler options) shares one least-recently-used table of
    compiled programs (8,192 entries), which a whole suite fills, and then each new entry evicts
    an old one, sometimes of the same function, so the size stops growing with compiles."""
    names = {name, f"jit({name})"}
    compiles: list[str] = []

    def listener(event: str, duration_secs: float, **kwargs) -> None:
        if (
            event == "/jax/core/compile/backend_compile_duration"
            and kwargs.get("fun_name") in names
        ):
            compiles.append(kwargs["fun_name"])

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def default_compile_env() -> dict[str, str]:
    """This process's environment without `FAST_COMPILE`'s flags: XLA's defaults."""
    fast = set(_FAST_FLAGS.values())
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if f not in fast)
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | (
        {"XLA_FLAGS": flags} if flags else {}
    )


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program (``jax.clear_caches()``) after each test module.

    XLA:CPU maps each compiled program's code into memory (three anonymous mappings an object)
    and unmaps it only when the program is freed; jit caches keep every program alive, so one
    pytest-xdist worker went past Linux's 65,530 mappings a process (``vm.max_map_count``) near
    the end of a full run, and the next compile aborted the worker ("Fatal Python error:
    Aborted" inside ``backend_compile_and_load``; three full runs, each in ``test_train.py``,
    2026-12-05). Measured here: four modules left 1,861-2,683 mappings each, and 1,140 after
    clearing. A module's own programs stay cached while it runs; programs the next module
    compiles again come from the persistent compilation cache."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True)
def _strict_rank_promotion():
    """`jax_numpy_rank_promotion="raise"` for every test (the one place it is set)."""
    with jax.numpy_rank_promotion("raise"):
        yield


TINY = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=64,
    rope_theta=10_000.0,
    tie_word_embeddings=False,
)


def write_tokenizer(folder: Path, num_words: int, eos_id: int | None = None) -> None:
    """A WordLevel `tokenizer.json`: word ``str(i)`` is id ``i`` for ``i < num_words``, then
    ``<eos>`` (a special token) is id ``num_words``; ``eos_id`` goes to generation_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {str(i): i for i in range(num_words)} | {"<eos>": num_words}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<eos>"])
    tok.save(str(folder / "tokenizer.json"))
    if eos_id is not None:
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_id}))


def make_hf_checkpoint(tmp_path_factory, arch: str = "qwen3", *, seed: int = 0, **shape) -> Path:
    """Build and save a random-weight ``Qwen3ForCausalLM`` / ``Qwen2ForCausalLM`` /
    ``LlamaForCausalLM`` (float32)."""
    import torch
    import transformers

    kw = TINY | shape
    rope_theta = kw.pop("rope_theta")
    config_cls, model_cls = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }[arch]
    config = config_cls(
        **kw,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        eos_token_id=kw["vocab_size"] - 1,
    )
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = 0.2 * torch.randn(p.shape, dtype=torch.float32)
            p.copy_(1.0 + noise if name.endswith("norm.weight") else noise)
    folder = tmp_path_factory.mktemp(f"hf_{arch}")
    model.save_pretrained(folder)
    write_tokenizer(folder, kw["vocab_size"] - 1, eos_id=kw["vocab_size"] - 1)
    return folder


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """``hf_checkpoint(arch="qwen3", **shape) -> Path``, one directory per distinct argument set."""
    cache: dict[tuple, Path] = {}

    def build(arch: str = "qwen3", **shape) -> Path:
        key = (arch, tuple(sorted(shape.items())))
        if key not in cache:
            cache[key] = make_hf_checkpoint(tmp_path_factory, arch, **shape)
        return cache[key]

    return build


@pytest.fixture
def checkpoint_copy(hf_checkpoint, tmp_path):
    """A private, writable copy of the default tiny Qwen3 checkpoint (for breaking it)."""
    return Path(shutil.copytree(hf_checkpoint(), tmp_path / "ckpt"))
