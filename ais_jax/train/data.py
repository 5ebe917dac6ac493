"""Deterministic, resumable prompt pipelines over tasks, built on ``grain``.

A synthetic task generates examples from a ``random.Random``; here example ``i`` of a split is
``task.sample(random.Random(key))`` with ``key`` an injective integer function of
``(seed, split, i)`` (no ``hash()``, which is salted per process). That makes a split a
*deterministic map over indices* -- a ``grain.MapDataset`` -- so grain can shuffle it per epoch
and checkpoint an iterator as a single integer. A :class:`~ais_jax.tasks.FiniteTask` (a JSONL
file) is its list of examples instead.

Pipeline (all lazy; nothing is generated until read)::

    MapDataset.range(num_examples).map(example i)   # or MapDataset.source(task.examples)
        .shuffle(seed)        # a fresh permutation every epoch (grain reseeds per epoch)
        .repeat(num_epochs)   # None: forever
        .batch(batch_size, drop_remainder=True, batch_fn=tuple)

Batches are ``tuple[Example, ...]`` of length ``batch_size``: tokenization is the consumer's
job, and the reward needs the whole Example anyway. A tuple of frozen dataclasses passes
through grain untouched (grain's default batching would try to stack leaves as arrays).
Batches span epoch boundaries, so every example is seen once per epoch; only a finite
``num_epochs`` drops a final partial batch (fixed shapes for jit).

Splits, for synthetic tasks, are disjoint seed streams of the same generator: ``"train"`` (RL
prompts), ``"sft"`` (demonstrations for the warm start) and ``"eval"`` (held out). Held out
means held out by construction, not by luck: a prompt text belongs to the evaluation set iff
``crc32(prompt) % HELD_OUT_BUCKETS == 0`` (:func:`is_held_out`), and each split draws from the
task until it gets a prompt on its side of that line. So no training or SFT prompt is ever an
evaluation prompt, however few distinct instances a task has (2-digit arithmetic has about
20,000, which a run's SFT and RL streams cover many times over), and the evaluation set is the
same for every run seed (:func:`eval_examples` reads the eval stream of seed 0 by default).
For a finite task, held-out data is a separate file (as GSM8K and MATH ship train and test
files): the split only selects the shuffle stream, and :func:`eval_examples` returns the
file's examples in order.

Iterators come from ``MapDataset.to_iter_dataset(read_options)``; their ``get_state()`` /
``set_state()`` round-trip exactly. The default ``ReadOptions(num_threads=0)`` generates in
the consuming thread: generation is cheap pure Python, and threads would only contend for the
GIL with the training loop.

Between examples and arrays: `encode_prompts` (left-padded ``[B, P]`` ids and mask; an
example's ``messages`` go through the tokenizer's chat template when it has one,
`prompt_ids`),
`encode_responses` (right-padded ``[B, T]`` demonstrations ending in EOS, for SFT),
`decode_responses` and `score_responses` (rewards as float32, a failing reward function a
`RewardError` naming the task, prompt and response).
"""

from __future__ import annotations

import functools
import random
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np

from ais_jax.tasks.base import Example, FiniteTask, RewardError, Task

__all__ = [
    "HELD_OUT_BUCKETS",
    "SPLITS",
    "check_per_host",
    "decode_responses",
    "demonstration_batches",
    "encode_prompts",
    "prompt_ids",
    "encode_responses",
    "eval_examples",
    "example_dataset",
    "example_seed",
    "host_shard",
    "is_held_out",
    "prompt_batches",
    "prompt_dataset",
    "score_responses",
]

SPLITS = ("train", "eval", "sft")
_MAX_SEED = 2**32
_MAX_INDEX = 2**62  # grain's range() needs the length to fit in a C ssize_t
_NO_PREFETCH = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)
HELD_OUT_BUCKETS = 8  # 1 in 8 prompt texts of a synthetic task is reserved for evaluation
_MAX_DRAWS = 10_000


def is_held_out(example: Example) -> bool:
    """Whether ``example``'s prompt text belongs to the held-out evaluation set (a stable hash,
    the same in every process and run)."""
    return zlib.crc32(example.prompt.encode()) % HELD_OUT_BUCKETS == 0


def example_seed(seed: int, split: str, index: int) -> int:
    """The integer that seeds ``random.Random`` for example ``index`` of ``split``.

    Injective in ``(seed, split, index)``: the low 64 bits hold the index, the bits above a
    tag bit (0 here, 1 for the shuffle stream, so the two never alias), the split and the
    seed.
    """
    return _key(seed, split, tag=0) << 64 | index


def example_dataset(
    task: Task, *, seed: int, split: str = "train", num_examples: int | None = None
) -> grain.MapDataset:
    """The examples of ``split`` as a ``grain.MapDataset[Example]``, unshuffled.

    For a synthetic task ``num_examples`` (the size of the index pool) is required; for a
    finite task it defaults to all examples and otherwise takes the first ``num_examples``.
    """
    _check(seed=seed, split=split)
    if isinstance(task, FiniteTask):
        examples = tuple(task.examples)
        if num_examples is not None:
            _check_count(num_examples, maximum=len(examples))
            examples = examples[:num_examples]
        return grain.MapDataset.source(examples)
    if num_examples is None:
        raise ValueError(
            f"task {task.name!r} is generated, so num_examples (the index pool size) is required"
        )
    _check_count(num_examples, maximum=_MAX_INDEX)
    make = functools.partial(_generate, task, seed, split)
    return grain.MapDataset.range(num_examples).map(make)


def prompt_dataset(
    task: Task,
    *,
    seed: int,
    batch_size: int,
    num_examples: int | None = None,
    split: str = "train",
    num_epochs: int | None = None,
) -> grain.MapDataset:
    """Shuffled (per epoch), repeated batches: a ``grain.MapDataset[tuple[Example, ...]]``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if num_epochs is not None and num_epochs < 1:
        raise ValueError(f"num_epochs must be >= 1 or None (forever), got {num_epochs}")
    examples = example_dataset(task, seed=seed, split=split, num_examples=num_examples)
    if num_epochs is not None and len(examples) * num_epochs < batch_size:
        raise ValueError(
            f"{len(examples)} examples x {num_epochs} epochs cannot fill one batch of {batch_size}"
        )
    return (
        examples.shuffle(seed=random.Random(_key(seed, split, tag=1) << 64).getrandbits(32))
        .repeat(num_epochs)
        .batch(batch_size, drop_remainder=True, batch_fn=tuple)
    )


def prompt_batches(
    task: Task,
    *,
    seed: int,
    batch_size: int,
    num_examples: int | None = None,
    num_epochs: int | None = None,
    read_options: grain.ReadOptions = _NO_PREFETCH,
    shard_options: grain.sharding.ShardOptions | None = None,
) -> grain.DatasetIterator:
    """Iterator over batches of training prompts (split ``"train"``), resumable via state.

    With ``shard_options`` (multi-host: ``grain.sharding.ShardByJaxProcess()``) this host reads
    its share of the batches (`host_shard`); ``batch_size`` is then the per-host batch.

    >>> from ais_jax.tasks import Arithmetic
    >>> it = prompt_batches(Arithmetic(), seed=0, batch_size=2, num_examples=100)
    >>> [ex.prompt for ex in next(it)], it.get_state()
    (['149-6=', '15+700='], {'next_index': 1})
    """
    dataset = prompt_dataset(
        task,
        seed=seed,
        batch_size=batch_size,
        num_examples=num_examples,
        split="train",
        num_epochs=num_epochs,
    )
    if shard_options is not None:
        dataset = host_shard(dataset, shard_options)
    return iter(dataset.to_iter_dataset(read_options))


def demonstration_batches(
    task: Task,
    *,
    seed: int,
    batch_size: int,
    num_examples: int | None = None,
    num_epochs: int | None = None,
    read_options: grain.ReadOptions = _NO_PREFETCH,
    shard_options: grain.sharding.ShardOptions | None = None,
) -> grain.DatasetIterator:
    """Like :func:`prompt_batches` over split ``"sft"``: train on ``prompt + demonstration``.

    A separate stream keeps the warm start from memorizing the exact RL prompts.
    """
    dataset = prompt_dataset(
        task,
        seed=seed,
        batch_size=batch_size,
        num_examples=num_examples,
        split="sft",
        num_epochs=num_epochs,
    )
    if shard_options is not None:
        dataset = host_shard(dataset, shard_options)
    return iter(dataset.to_iter_dataset(read_options))


def check_per_host(batch_sizes: dict[str, int], hosts: int) -> None:
    """Every process takes an equal share of each global batch: a ValueError naming a batch
    size (``{"rollout.prompts_per_step": 16, ...}``) that ``hosts`` does not divide."""
    for name, size in batch_sizes.items():
        if size % hosts:
            raise ValueError(
                f"{name}={size} is not divisible by the number of processes ({hosts}): "
                "each process takes an equal share of every batch."
            )


def host_shard(
    dataset: grain.MapDataset, options: grain.sharding.ShardOptions | None = None
) -> grain.MapDataset:
    """Every ``shard_count``-th element of ``dataset``, from ``shard_index`` on.

    ``options`` defaults to ``grain.sharding.ShardByJaxProcess(drop_remainder=True)``. Applied
    to a dataset of per-host batches, process i reads global batches i, i + n, ...: the global
    batch of a step is the same as a one-process run with an n times larger batch.
    ``drop_remainder`` trims a finite dataset to a multiple of n first, so every host gets as
    many elements (no host waits for the others at the end).
    """
    if options is None:
        options = grain.sharding.ShardByJaxProcess(drop_remainder=True)
    if options.drop_remainder:
        dataset = dataset[: len(dataset) - len(dataset) % options.shard_count]
    return dataset[options.shard_index :: options.shard_count]


def eval_examples(
    task: Task, *, seed: int = 0, num_examples: int | None = None
) -> tuple[Example, ...]:
    """The held-out examples, in a fixed order: split ``"eval"`` (or a finite task's file).
    ``seed`` defaults to 0, so every run evaluates on the same prompts whatever its seed."""
    dataset = example_dataset(task, seed=seed, split="eval", num_examples=num_examples)
    return tuple(dataset[i] for i in range(len(dataset)))


# ---- tokens <-> text ----------------------------------------------------------------------------


def prompt_ids(
    tokenizer, prompt: str | Example, template_kwargs: Mapping[str, Any] | None = None
) -> list[int]:
    """The ids the policy is conditioned on. An `Example` with ``messages``, for a tokenizer
    with a chat template, is rendered through that template with the assistant's generation
    prompt (``template_kwargs``, e.g. ``{"enable_thinking": False}``, go to the template), as
    verl and TRL prompt Qwen3; anything else is BOS (where the tokenizer has one) followed by
    the encoded text (a string, or the example's ``prompt``)."""
    text, messages = (prompt, None) if isinstance(prompt, str) else (prompt.prompt, prompt.messages)
    if messages and getattr(tokenizer, "chat_template", None) is not None:
        return tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, **(template_kwargs or {})
        )
    bos = [tokenizer.bos_id] if getattr(tokenizer, "bos_id", None) is not None else []
    return bos + tokenizer.encode(text)


def encode_prompts(
    tokenizer,
    prompts: Sequence[str | Example],
    length: int,
    template_kwargs: Mapping[str, Any] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded ``[B, length]`` prompt ids (`prompt_ids` of each prompt) and mask."""
    ids = [prompt_ids(tokenizer, p, template_kwargs) for p in prompts]
    longest = max(len(i) for i in ids)
    if longest > length:
        raise ValueError(
            f"A prompt has {longest} tokens, more than rollout.max_prompt_len="
            f"{length}; raise max_prompt_len or shorten the task's prompts."
        )
    return _pad(ids, length, tokenizer.pad_id, left=True)


def encode_responses(tokenizer, texts: list[str], length: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded ``[B, length]`` response ids ending in EOS (for the SFT warm start)."""
    ids = [tokenizer.encode(t) + [tokenizer.eos_id] for t in texts]
    longest = max(len(i) for i in ids)
    if longest > length:
        raise ValueError(
            f"A demonstration has {longest} tokens (with EOS), more than "
            f"rollout.max_new_tokens={length}; raise max_new_tokens."
        )
    return _pad(ids, length, tokenizer.pad_id, left=False)


def _pad(ids: list[list[int]], length: int, pad_id: int, *, left: bool):
    """``[B, length]`` int32 tokens and bool mask, padded on the left or the right."""
    tokens = np.full((len(ids), length), pad_id, np.int32)
    mask = np.zeros((len(ids), length), bool)
    for row, seq in enumerate(ids):
        cols = slice(length - len(seq), length) if left else slice(0, len(seq))
        tokens[row, cols] = seq
        mask[row, cols] = True
    return tokens, mask


def trim_padding(tokens_BL: np.ndarray, mask_BL: np.ndarray, *, left: bool):
    """``tokens_BL`` and ``mask_BL`` without the columns that are padding in every row (on the
    left of left-padded rows, on the right of right-padded ones), as a pad-to-longest collator
    does. The kept width is the longest row rounded up to a power of two (at most L), so that
    batches fall on a few shapes: each new shape is a compile."""
    L = mask_BL.shape[1]
    longest = int(mask_BL.sum(axis=1).max(initial=1))
    width = min(L, 1 << max(longest - 1, 0).bit_length())
    cols = slice(L - width, L) if left else slice(0, width)
    return tokens_BL[:, cols], mask_BL[:, cols]


def decode_responses(tokenizer, tokens: np.ndarray, lengths: np.ndarray) -> list[str]:
    """The text of the first ``lengths[b]`` tokens of each row ``b`` of ``tokens [B, T]``."""
    return [tokenizer.decode(row[:n].tolist()) for row, n in zip(tokens, lengths, strict=True)]


def score_responses(task: Task, examples, responses: list[str]) -> np.ndarray:
    """Rewards as float32; a reward function that raises or returns a non-finite value is a
    `RewardError` naming the task, the prompt and the response."""
    rewards = np.empty(len(responses), np.float32)
    for i, (ex, text) in enumerate(zip(examples, responses, strict=True)):
        try:
            r = float(task.reward(ex, text))
        except Exception as e:
            raise RewardError(
                f"Reward function of task {task.name!r} raised {e!r} on prompt "
                f"{ex.prompt!r}, response {text!r}."
            ) from e
        if not np.isfinite(r):
            raise RewardError(
                f"Reward function of task {task.name!r} returned {r} on prompt "
                f"{ex.prompt!r}, response {text!r}; rewards must be finite."
            )
        rewards[i] = r
    return rewards


# ---- internals ----------------------------------------------------------------------------------


def _generate(task: Task, seed: int, split: str, index: int) -> Example:
    """Example ``index`` of ``split``: the first draw of its seeded generator whose prompt is on
    the split's side of the held-out line (`is_held_out`)."""
    rng = random.Random(example_seed(seed, split, index))
    for _ in range(_MAX_DRAWS):
        example = task.sample(rng)
        if is_held_out(example) == (split == "eval"):
            return example
    raise ValueError(
        f"task {task.name!r} gave no {split!r} prompt in {_MAX_DRAWS} draws: its prompts all "
        f"fall on one side of the held-out split (1 in {HELD_OUT_BUCKETS} prompt texts is "
        "held out), so it has too few distinct prompts to train and evaluate on."
    )


def _key(seed: int, split: str, *, tag: int) -> int:
    return (seed * len(SPLITS) + SPLITS.index(split)) * 2 + tag


def _check(*, seed: int, split: str) -> None:
    if not 0 <= seed < _MAX_SEED:
        raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits are {SPLITS}")


def _check_count(num_examples: int, *, maximum: int) -> None:
    if not 1 <= num_examples <= maximum:
        raise ValueError(f"num_examples must be in [1, {maximum}], got {num_examples}")
