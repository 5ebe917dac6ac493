"""Tasks read from local JSONL files: GSM8K and MATH conventions.

Each non-blank line is one JSON object:

* GSM8K: ``{"question": "...", "answer": "...reasoning... #### 42"}``. The answer is the
  first number after the last ``####`` (commas dropped; the whole stripped tail if it holds
  no number); the demonstration is the reasoning with the
  calculator annotations (``<<48/2=24>>``) removed, ending in ``#### 42``.
* MATH: ``{"problem": "...", "solution": "... \\boxed{\\frac{3}{4}} ..."}``. The answer is
  the content of the last ``\\boxed{}``; the demonstration is the solution as written.

The reward is 1.0 iff the final answer stated in the response (see
:mod:`ais_jax.tasks.answers`: last ``\\boxed{}``, else after ``####``, else the last number)
matches the example's answer numerically (``0.5 == 1/2 == \\frac{1}{2}``) or, failing that,
as a normalized string.

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
import json
import pathlib
import random
import re
import warnings
from collections.abc import Callable

from ais_jax.tasks.answers import answer_after_hashes, answers_match, extract_answer, last_boxed
from ais_jax.tasks.base import Example

__all__ = ["ON_ERROR", "JsonlTask", "load_gsm8k", "load_jsonl", "load_math"]

ON_ERROR = ("raise", "skip")
_CALCULATOR = re.compile(r"<<[^<>]*>>")
_MAX_LISTED = 20


class _BadLine(Exception):
    """What is wrong with one line; turned into a ValueError naming the file and line."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class JsonlTask:
    """A fixed list of examples with the math-answer reward; ``sample`` picks one uniformly."""

    name: str
    examples: tuple[Example, ...]

    def __post_init__(self):
        object.__setattr__(self, "examples", tuple(self.examples))
        if not self.examples:
            raise ValueError(f"JsonlTask {self.name!r} needs at least one example, got none")

    def sample(self, rng: random.Random) -> Example:
        return rng.choice(self.examples)

    def reward(self, example: Example, response: str) -> float:
        predicted = extract_answer(response)
        return float(predicted is not None and answers_match(predicted, example.answer))


def load_gsm8k(
    path: str | pathlib.Path, *, on_error: str = "raise", name: str = "gsm8k"
) -> JsonlTask:
    """A :class:`JsonlTask` from a GSM8K-style file (keys ``question``, ``answer``)."""
    return JsonlTask(name=name, examples=load_jsonl(path, _gsm8k_example, on_error=on_error))


def load_math(
    path: str | pathlib.Path, *, on_error: str = "raise", name: str = "math"
) -> JsonlTask:
    """A :class:`JsonlTask` from a MATH-style file (keys ``problem``, ``solution``)."""
    return JsonlTask(name=name, examples=load_jsonl(path, _math_example, on_error=on_error))


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


def _gsm8k_example(record: dict) -> Example:
    question, answer = _field(record, "question"), _field(record, "answer")
    if "####" not in answer:
        raise ValueError("key 'answer' has no '#### <final answer>' marker")
    final = answer_after_hashes(answer)
    if final is None:
        raise ValueError("key 'answer' has nothing after '####'")
    demonstration = _CALCULATOR.sub("", answer)
    return Example(prompt=question, answer=final.replace(",", ""), demonstration=demonstration)


def _math_example(record: dict) -> Example:
    problem, solution = _field(record, "problem"), _field(record, "solution")
    boxed = last_boxed(solution)
    if boxed is None:
        raise ValueError("key 'solution' has no balanced \\boxed{...} answer")
    return Example(prompt=problem, answer=boxed, demonstration=solution)
