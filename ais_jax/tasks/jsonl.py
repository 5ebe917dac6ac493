"""Tasks read from local JSONL files: GSM8K and MATH, prompted the way RL recipes prompt them.

Each non-blank line is one JSON object:

* GSM8K: ``{"question": "...", "answer": "...reasoning... #### 42"}``. The answer is the
  first number after the last ``####`` (commas dropped; the whole stripped tail if it holds
  no number); the demonstration is the reasoning with the
  calculator annotations (``<<48/2=24>>``) removed, ending in ``#### 42``.
* MATH: ``{"problem": "...", "solution": "... \\boxed{\\frac{3}{4}} ..."}``. The answer is
  the content of the last ``\\boxed{}``; the demonstration is the solution as written.

Prompts follow a :class:`~ais_jax.tasks.chat.ChatFormat`: each example carries ``messages``
(an optional system message, then the user message ``question + " " + instruction``) for a
tokenizer with a chat template, and ``prompt``, the user message's text, for one without.
By default there is no system prompt and the instruction is verl's for the dataset
(:data:`GSM8K_INSTRUCTION`, :data:`MATH_INSTRUCTION`); ``enable_thinking`` is left to the
template. Rewards: :func:`~ais_jax.tasks.rewards.gsm8k_reward` (the number after the last
``####`` or in the last ``\\boxed{}``) and :func:`~ais_jax.tasks.rewards.math_reward` (the last
``\\boxed{}``, judged by math-verify); :mod:`ais_jax.tasks.rewards` says which published recipe
each matches. For maj@k votes a task's final answers are
:func:`~ais_jax.tasks.answers.gsm8k_final_answer` (equal numbers vote together) and
:func:`~ais_jax.tasks.answers.math_final_answer` (grouped by math-verify,
:func:`~ais_jax.tasks.rewards.latex_equivalent`).

Malformed lines (not UTF-8, invalid JSON, not an object, a missing or non-string key, a GSM8K
answer without ``####``, a MATH solution without ``\\boxed{}``) are errors that name the file, the
line number and what is wrong. By default loading stops at the first one: silently dropping
lines would change the data distribution -- and the evaluation denominator -- without anyone
noticing. ``on_error="skip"`` keeps the good lines and emits one warning listing every skipped
line. Blank lines are not data and are ignored. A file with no lines, or none left after
skipping, is an error naming the path. Nothing is ever downloaded: the paths are local files.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import operator
import pathlib
import random
import re
import warnings
from collections.abc import Callable

from ais_jax.tasks.answers import (
    answer_after_hashes,
    gsm8k_final_answer,
    last_boxed,
    math_final_answer,
)
from ais_jax.tasks.base import Example
from ais_jax.tasks.chat import ChatFormat
from ais_jax.tasks.rewards import gsm8k_reward, latex_equivalent, math_reward

__all__ = [
    "GSM8K_INSTRUCTION",
    "MATH_INSTRUCTION",
    "ON_ERROR",
    "JsonlTask",
    "load_gsm8k",
    "load_jsonl",
    "load_math",
]

ON_ERROR = ("raise", "skip")
# verl, examples/data_preprocess/gsm8k.py and math_dataset.py (`instruction_following`)
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
_CALCULATOR = re.compile(r"<<[^<>]*>>")
_MAX_LISTED = 20


class _BadLine(Exception):
    """What is wrong with one line; turned into a ValueError naming the file and line."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class JsonlTask:
    """A fixed list of examples, their chat format and a reward; ``sample`` picks one uniformly.

    Attributes:
      name: the task's name in logs.
      examples: the file's examples, in order.
      verifier: ``verifier(response, answer) -> float`` in ``[0, 1]``, e.g.
        :func:`~ais_jax.tasks.rewards.gsm8k_reward`.
      chat: how the examples' ``messages`` were built; ``chat.template_kwargs`` (e.g.
        ``{"enable_thinking": False}``) go to the tokenizer's chat template with them.
      extract: ``extract(response) -> str | None``, the final answer a response states (for
        maj@k votes, `ais_jax.analysis.evaluation`); None: the stripped response.
      equivalent: ``equivalent(a, b) -> bool`` on two extracted answers (default: ``==``).
    """

    name: str
    examples: tuple[Example, ...]
    verifier: Callable[[str, str], float]
    chat: ChatFormat = ChatFormat()
    extract: Callable[[str], str | None] | None = None
    equivalent: Callable[[str, str], bool] = operator.eq

    def __post_init__(self):
        object.__setattr__(self, "examples", tuple(self.examples))
        if not self.examples:
            raise ValueError(f"JsonlTask {self.name!r} needs at least one example, got none")

    def sample(self, rng: random.Random) -> Example:
        return rng.choice(self.examples)

    def reward(self, example: Example, response: str) -> float:
        return self.verifier(response, example.answer)

    def final_answer(self, response: str) -> str | None:
        return self.extract(response) if self.extract else response.strip() or None

    def same_answer(self, a: str, b: str) -> bool:
        return bool(self.equivalent(a, b))


def load_gsm8k(
    path: str | pathlib.Path,
    *,
    on_error: str = "raise",
    name: str = "gsm8k",
    system_prompt: str | None = None,
    instruction: str | None = GSM8K_INSTRUCTION,
    enable_thinking: bool | None = None,
) -> JsonlTask:
    """A :class:`JsonlTask` from a GSM8K-style file (keys ``question``, ``answer``), rewarded
    by :func:`~ais_jax.tasks.rewards.gsm8k_reward`; ``system_prompt``, ``instruction`` and
    ``enable_thinking`` make its :class:`~ais_jax.tasks.chat.ChatFormat`."""
    chat = ChatFormat(
        system_prompt=system_prompt, instruction=instruction, enable_thinking=enable_thinking
    )
    examples = load_jsonl(path, functools.partial(_gsm8k_example, chat=chat), on_error=on_error)
    return JsonlTask(
        name=name,
        examples=examples,
        verifier=gsm8k_reward,
        chat=chat,
        extract=gsm8k_final_answer,
    )


def load_math(
    path: str | pathlib.Path,
    *,
    on_error: str = "raise",
    name: str = "math",
    system_prompt: str | None = None,
    instruction: str | None = MATH_INSTRUCTION,
    enable_thinking: bool | None = None,
) -> JsonlTask:
    """A :class:`JsonlTask` from a MATH-style file (keys ``problem``, ``solution``), rewarded
    by :func:`~ais_jax.tasks.rewards.math_reward` (math-verify); ``system_prompt``,
    ``instruction`` and ``enable_thinking`` make its :class:`~ais_jax.tasks.chat.ChatFormat`."""
    chat = ChatFormat(
        system_prompt=system_prompt, instruction=instruction, enable_thinking=enable_thinking
    )
    examples = load_jsonl(path, functools.partial(_math_example, chat=chat), on_error=on_error)
    return JsonlTask(
        name=name,
        examples=examples,
        verifier=math_reward,
        chat=chat,
        extract=math_final_answer,
        equivalent=latex_equivalent,
    )


def load_jsonl(
    path: str | pathlib.Path,
    to_example: Callable[[dict], Example],
    *,
    on_error: str = "raise",
) -> tuple[Example, ...]:
    """Reads ``path`` line by line, turning each JSON object into an Example.

    ``to_example`` raises ``KeyError`` / ``TypeError`` / ``ValueError`` with a message for a
    record it cannot use; the message is reported with the file and line number.
    """
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(
            f"JSONL file {str(path)!r} " + ("is not a file" if path.exists() else "does not exist")
        )
    examples, skipped, lines = [], [], 0
    with path.open("rb") as f:  # bytes: a line that is not UTF-8 is a bad line like any other
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            lines += 1
            try:
                examples.append(_parse_line(line, to_example))
            except _BadLine as e:
                if on_error == "raise":
                    raise ValueError(
                        f"{path}:{line_no}: {e}; fix the line or pass on_error='skip'"
                    ) from None
                skipped.append(f"line {line_no} ({e})")
    if lines == 0:
        raise ValueError(f"{path} is empty: no JSON lines")
    if skipped:
        listed = ", ".join(skipped[:_MAX_LISTED])
        more = f" and {len(skipped) - _MAX_LISTED} more" if len(skipped) > _MAX_LISTED else ""
        message = f"{path}: skipped {len(skipped)} malformed line(s): {listed}{more}"
        warnings.warn(message, stacklevel=3)  # points at the caller of load_gsm8k / load_math
    if not examples:
        raise ValueError(f"{path}: no valid examples ({len(skipped)} malformed lines skipped)")
    return tuple(examples)


def _parse_line(raw: bytes, to_example: Callable[[dict], Example]) -> Example:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _BadLine(f"not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start})") from None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise _BadLine(f"invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise _BadLine(f"expected a JSON object, got {type(record).__name__}")
    try:
        return to_example(record)
    except (KeyError, TypeError, ValueError) as e:
        raise _BadLine(e.args[0] if e.args else repr(e)) from None


def _field(record: dict, key: str) -> str:
    if key not in record:
        raise KeyError(f"missing key {key!r} (keys present: {sorted(record)})")
    value = record[key]
    if not isinstance(value, str):
        raise TypeError(f"key {key!r} must be a string, got {type(value).__name__}")
    return value


def _gsm8k_example(record: dict, chat: ChatFormat) -> Example:
    question, answer = _field(record, "question"), _field(record, "answer")
    if "####" not in answer:
        raise ValueError("key 'answer' has no '#### <final answer>' marker")
    final = answer_after_hashes(answer)
    if final is None:
        raise ValueError("key 'answer' has nothing after '####'")
    return Example(
        prompt=chat.user_content(question),
        answer=final.replace(",", ""),
        demonstration=_CALCULATOR.sub("", answer),
        messages=chat.messages(question),
    )


def _math_example(record: dict, chat: ChatFormat) -> Example:
    problem, solution = _field(record, "problem"), _field(record, "solution")
    boxed = last_boxed(solution)
    if boxed is None:
        raise ValueError("key 'solution' has no balanced \\boxed{...} answer")
    return Example(
        prompt=chat.user_content(problem),
        answer=boxed,
        demonstration=solution,
        messages=chat.messages(problem),
    )
