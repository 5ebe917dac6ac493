"""What a task is: a source of prompts and a reward for responses.

GRPO needs two things from a task: prompts to roll out on, and a scalar reward for each
sampled response. The SFT warm start needs a third: one correct response per prompt. An
:class:`Example` carries all three as plain strings, so a task never sees tokens; tokenization
happens later, in the data pipeline's consumer. A task meant for instruction-tuned checkpoints
(GSM8K, MATH) also gives each example its prompt as chat ``messages``, which the consumer
renders with the tokenizer's chat template; the synthetic tasks leave ``messages`` None.

A task is anything with

* ``name`` -- a short identifier used in logs and metric names;
* ``sample(rng)`` -- one :class:`Example`, a pure function of the ``random.Random`` it is given
  (no global randomness), so the data pipeline can make example ``i`` of a seeded stream by
  handing the task a ``random.Random`` seeded from ``(seed, i)``;
* ``reward(example, response)`` -- a float in ``[0, 1]``; it must be 1.0 for
  ``example.demonstration`` (the tests check this on hundreds of samples per task), except
  where a task is asked for a careless teacher on purpose (arithmetic's ``slip``).

A :class:`FiniteTask` (e.g. a JSONL file) also exposes its ``examples`` so an evaluation can walk
them in order. ``Task`` and ``FiniteTask`` are :class:`typing.Protocol` s: tasks are frozen
dataclasses that satisfy them structurally, with no base class to inherit.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

__all__ = ["Example", "FiniteTask", "RewardError", "Task"]


class RewardError(RuntimeError):
    """A reward function raised or returned a non-finite value; the message names the task,
    the prompt and the response (raised by the training loop, reported by the CLI)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Example:
    """One prompt, the ground truth its reward checks against, and a correct response.

    Attributes:
      prompt: the text the policy is conditioned on, e.g. ``"47+385="``.
      answer: the ground truth the reward compares against, e.g. ``"432"``. Its format is the
        task's business (Sudoku stores the 16-digit solution, GSM8K the final number).
      demonstration: a full response that earns reward 1.0, e.g. ``"432"`` (or a worked
        solution); used as the target of the SFT warm start.
      messages: the prompt as a conversation, ``({"role": "user", "content": ...},)`` with
        an optional leading system message, for a tokenizer with a chat template (rendered
        with ``add_generation_prompt=True``); None for plain-text prompts. ``prompt`` is then
        the user message's text, for tokenizers without a template. Not part of the hash.
    """

    prompt: str
    answer: str
    demonstration: str
    messages: tuple[dict[str, str], ...] | None = dataclasses.field(default=None, hash=False)


@runtime_checkable
class Task(Protocol):
    """A generator of :class:`Example` s together with their reward function."""

    @property
    def name(self) -> str:
        """Short identifier, e.g. ``"arithmetic"``."""
        ...

    def sample(self, rng: random.Random) -> Example:
        """Returns one example; deterministic given the state of ``rng``."""
        ...

    def reward(self, example: Example, response: str) -> float:
        """Scores ``response`` to ``example.prompt``; in ``[0, 1]``, 1.0 for the demonstration."""
        ...


@runtime_checkable
class FiniteTask(Task, Protocol):
    """A task backed by a fixed list of examples (a dataset file) rather than a generator."""

    @property
    def examples(self) -> Sequence[Example]:
        """All examples, in file order."""
        ...
