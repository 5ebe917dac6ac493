"""Multi-digit addition, subtraction and multiplication.

The smallest task with a verifiable answer: the prompt is the bare problem, ``"47+385="``,
and the reference response is the bare result, ``"432"``. Operand lengths are drawn uniformly
from ``[min_digits, max_digits]`` and the operand uniformly among the numbers with that many
digits (``0..9`` for one digit, so the task covers ``x+0``).

``show_work=True`` makes the demonstration a column-by-column derivation, one true equation per
line, ending in a ``"="``-prefixed result line::

    47+385=            (prompt)
    7+5=12 carry 1
    4+8+1=13 carry 1
    3+1=4
    =432

Subtraction borrows (``10+5-7=8 borrow 1``) and multiplication lists the partial products and
their sum (``385*7=2695``, ``385*40=15400``, ``2695+15400=18095``). Long responses are the
point: the rollout/trainer log-prob mismatch that AIS corrects grows with response length.

``slip`` makes the demonstrations those of a careless teacher: each carry (addition) or borrow
(subtraction) is dropped with probability ``slip``, in the bare and in the worked format
(the worked line still says ``carry 1``; the next column forgets to add it). The answer the
reward checks stays the true result, so a warm start on such demonstrations learns a
systematic error that only the reward can correct: with ``slip > 0.5`` its greedy answer to
every problem with a carry is wrong while the right one keeps probability ``1 - slip`` per
carry, which is the situation RL post-training is for. Multiplication demonstrations are
always exact. With ``slip=0`` (the default) no extra random numbers are drawn.

``filler`` prefixes each demonstration with that many lowercase letters and a space (``"abqd
432"``): free tokens that carry entropy but no reward, as the free phrasing of a real model's
response does. Letter ``i`` is the ``i``-th of the alphabet (cycling) with probability
``1 - filler_noise`` and otherwise uniform among all 26, so a warm start learns a likely letter
and a tail of unlikely ones at each position (``filler_noise=1``: all uniform). A rollout's
log-prob error grows with how far below the top a sampled token's logit lies, so sampling from
such tails is what makes a real model's FP8 mismatch (issue 47, docs/results.md). ``filler_zipf``
(an exponent ``a > 0``, in place of ``filler_noise``) grades the tail as a real vocabulary's is:
position i holds the letter ``r`` places after its own (cycling) with probability proportional
to ``(r + 1) ** -a``, so every letter has its own logit, ``log 26 * a`` nats below the top at the
bottom (``a = 1.5``: entropy 2.07 nats, 39% of the letters drawn with p < 0.1). On the toy
neither tail raises the FP8 mismatch much (measured: docs/results.md), because a tail that is
the same for every prompt is learned as fixed logits, which FP8 barely moves. ``filler_center=
"prompt"`` centres each position's letters on the prompt instead: position i's own letter is the
one that codes the prompt's i-th character (cycling; ``0``-``9`` are ``a``-``j``, then ``+ - *
=`` are ``k``-``n``), so the warm start must compute each letter's distribution from the input,
as a real model's contextual uncertainty is; that does not raise the mismatch either (measured:
docs/results.md). ``filler_place="after"`` writes the letters after the result instead
(``"432 abqd"``): a long response whose answer comes first (``configs/compare_narrow_long.yaml``;
the 16-wide toy's warm start learns the sums neither behind 62 uniform letters nor in front of
them, and in front of near-deterministic ones it does: docs/results.md). The letters never hold
a digit, so the reward reads the same answer.

``instruction`` gives each example chat ``messages`` too: one user message, ``"What is 47 +
385? "`` followed by the instruction, which a tokenizer with a chat template (an
instruction-tuned checkpoint such as SmolLM2-135M-Instruct) renders in place of the bare
prompt; other tokenizers keep reading ``prompt``.

Simplifications: subtraction orders its operands so the result is never negative, and there is
no division. The reward is 1.0 iff the *last integer* in the response equals the answer, else
0.0. "Last integer" is the last run of digits, with a leading ``-`` read as a sign only when it
does not follow a digit (so ``"5-3"`` ends in ``3``); this one rule reads both the bare and the
worked format, whose final line is ``=<result>``. Digits are compared as strings after dropping
leading zeros, so an absurdly long response cannot trip Python's int-parsing limit.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import re
import string
from typing import ClassVar

from ais_jax.tasks.base import Example

__all__ = ["FILLER_CENTERS", "FILLER_PLACES", "OPS", "Arithmetic"]

OPS = ("+", "-", "*")
FILLER_CENTERS = ("position", "prompt")
FILLER_PLACES = ("before", "after")
_PROMPT_LETTER = "0123456789+-*="
_INTEGER = re.compile(r"(?<!\d)-?\d+")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Arithmetic:
    """``a op b`` with ``op`` in ``ops`` and operands of ``min_digits..max_digits`` digits.

    Example:
      >>> task = Arithmetic(ops=("+",), min_digits=2, max_digits=3)
      >>> ex = task.sample(random.Random(0))
      >>> task.reward(ex, ex.demonstration)
      1.0
    """

    name: ClassVar[str] = "arithmetic"

    ops: tuple[str, ...] = OPS
    min_digits: int = 1
    max_digits: int = 3
    show_work: bool = False
    slip: float = 0.0
    instruction: str | None = None
    filler: int = 0
    filler_noise: float = 1.0
    filler_zipf: float = 0.0
    filler_center: str = "position"
    filler_place: str = "before"

    def __post_init__(self):
        object.__setattr__(self, "ops", tuple(self.ops))
        if not self.ops:
            raise ValueError(f"ops must be a non-empty subset of {OPS}, got ()")
        for op in self.ops:
            if op not in OPS:
                raise ValueError(f"unknown op {op!r}; allowed ops are {OPS}")
        if len(set(self.ops)) != len(self.ops):
            raise ValueError(f"ops has duplicates: {self.ops}")
        if self.min_digits < 1:
            raise ValueError(f"min_digits must be >= 1, got {self.min_digits}")
        if not (isinstance(self.slip, int | float) and 0.0 <= self.slip <= 1.0):
            raise ValueError(f"slip must be a probability in [0, 1], got {self.slip!r}")
        if isinstance(self.filler, bool) or not isinstance(self.filler, int) or self.filler < 0:
            raise ValueError(f"filler must be an integer >= 0, got {self.filler!r}")
        if not (isinstance(self.filler_noise, int | float) and 0.0 <= self.filler_noise <= 1.0):
            raise ValueError(
                f"filler_noise must be a probability in [0, 1], got {self.filler_noise!r}"
            )
        zipf = self.filler_zipf
        if isinstance(zipf, bool) or not isinstance(zipf, int | float) or not 0.0 <= zipf < 1e3:
            raise ValueError(f"filler_zipf must be an exponent in [0, 1000), got {zipf!r}")
        if zipf > 0 and self.filler_noise != 1.0:
            raise ValueError(
                f"filler_zipf={zipf!r} replaces filler_noise; leave filler_noise at 1.0, got "
                f"{self.filler_noise!r}"
            )
        if self.filler_center not in FILLER_CENTERS:
            raise ValueError(
                f"filler_center must be one of {FILLER_CENTERS}, got {self.filler_center!r}"
            )
        if self.filler_place not in FILLER_PLACES:
            raise ValueError(
                f"filler_place must be one of {FILLER_PLACES}, got {self.filler_place!r}"
            )
        if self.instruction is not None and not isinstance(self.instruction, str):
            raise ValueError(f"instruction must be a string or None, got {self.instruction!r}")
        if self.max_digits < self.min_digits:
            raise ValueError(
                f"max_digits must be >= min_digits={self.min_digits}, got {self.max_digits}"
            )

    def sample(self, rng: random.Random) -> Example:
        op = rng.choice(self.ops)
        a, b = self._operand(rng), self._operand(rng)
        if op == "-" and a < b:
            a, b = b, a
        result = {"+": a + b, "-": a - b, "*": a * b}[op]
        prompt = f"{a}{op}{b}="
        slips = (lambda: rng.random() < self.slip) if self.slip > 0 else (lambda: False)
        if op == "*":
            steps, shown = _mul_steps(a, b), result
        else:
            steps, shown = {"+": _add_steps, "-": _sub_steps}[op](a, b, slips)
        demonstration = "\n".join([*steps, f"={shown}"]) if self.show_work else str(shown)
        if self.filler:
            letter = (
                functools.partial(_zipf_letter, weights=_zipf_weights(self.filler_zipf))
                if self.filler_zipf > 0
                else functools.partial(_filler_letter, noise=self.filler_noise)
            )
            centers = (
                [_PROMPT_LETTER.index(prompt[i % len(prompt)]) for i in range(self.filler)]
                if self.filler_center == "prompt"
                else range(self.filler)
            )
            letters = "".join(letter(center, rng) for center in centers)
            demonstration = (
                f"{letters} {demonstration}"
                if self.filler_place == "before"
                else f"{demonstration} {letters}"
            )
        messages = None
        if self.instruction is not None:
            question = f"What is {a} {op} {b}? {self.instruction}".strip()
            messages = ({"role": "user", "content": question},)
        return Example(
            prompt=prompt,
            answer=str(result),
            demonstration=demonstration,
            messages=messages,
        )

    def reward(self, example: Example, response: str) -> float:
        found = final_integer(response)
        return float(found is not None and found == _normalize(example.answer))

    def final_answer(self, response: str) -> str | None:
        """The answer ``response`` states, as `reward` reads it (for maj@k votes)."""
        return final_integer(response)

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(self.min_digits, self.max_digits)
        low = 0 if digits == 1 else 10 ** (digits - 1)
        return rng.randint(low, 10**digits - 1)


def _filler_letter(i: int, rng: random.Random, noise: float) -> str:
    """The alphabet's ``i``-th letter (cycling), or w.p. ``noise`` any."""
    if rng.random() < noise:
        return rng.choice(string.ascii_lowercase)
    return string.ascii_lowercase[i % 26]


@functools.cache
def _zipf_weights(exponent: float) -> tuple[float, ...]:
    return tuple((rank + 1) ** -exponent for rank in range(26))


def _zipf_letter(i: int, rng: random.Random, weights: tuple[float, ...]) -> str:
    """The letter ``r`` places after the ``i``-th (cycling), ``r`` drawn with ``weights[r]``."""
    (rank,) = rng.choices(range(26), weights=weights)
    return string.ascii_lowercase[(i + rank) % 26]


def final_integer(response: str) -> str | None:
    """The last integer in ``response`` as a normalized digit string, or None if there is none.

    >>> final_integer("7+5=12 carry 1\\n=0432")
    '432'
    >>> final_integer("5-3"), final_integer("x=-3"), final_integer("none")
    ('3', '-3', None)
    """
    matches = _INTEGER.findall(response)
    return _normalize(matches[-1]) if matches else None


def _normalize(integer: str) -> str:
    sign, digits = ("-", integer[1:]) if integer.startswith("-") else ("", integer)
    digits = digits.lstrip("0") or "0"
    return "0" if digits == "0" else sign + digits


def _digits(n: int) -> list[int]:
    """Decimal digits of ``n``, least significant first."""
    return [int(c) for c in reversed(str(n))]


def _add_steps(a: int, b: int, slips) -> tuple[list[str], int]:
    """Column-by-column lines of ``a + b`` and the result they reach; a carry for which
    ``slips()`` is true is announced but not added to the next column."""
    da, db = _digits(a), _digits(b)
    steps, out, carry = [], [], 0
    for i in range(max(len(da), len(db))):
        terms = [d[i] for d in (da, db) if i < len(d)] + ([carry] if carry else [])
        total = sum(terms)
        steps.append("+".join(map(str, terms)) + f"={total}" + (" carry 1" if total >= 10 else ""))
        out.append(total % 10)
        carry = int(total >= 10 and not slips())
    out.append(carry)
    return steps, _number(out)


def _sub_steps(a: int, b: int, slips) -> tuple[list[str], int]:
    """Column-by-column lines of ``a - b`` (``a >= b``) and the result they reach; a borrow for
    which ``slips()`` is true is announced but not taken from the next column."""
    da, db = _digits(a), _digits(b)
    steps, out, borrow = [], [], 0
    for i, top in enumerate(da):
        bottom = db[i] if i < len(db) else 0
        borrow_out = int(top - borrow - bottom < 0)
        expr = (f"10+{top}" if borrow_out else f"{top}") + ("-1" if borrow else "")
        expr += f"-{db[i]}" if i < len(db) else ""
        result = 10 * borrow_out + top - borrow - bottom
        steps.append(f"{expr}={result}" + (" borrow 1" if borrow_out else ""))
        out.append(result)
        borrow = int(borrow_out and not slips())
    return steps, _number(out)


def _number(digits: list[int]) -> int:
    """The integer whose decimal digits, least significant first, are ``digits``."""
    return sum(d * 10**i for i, d in enumerate(digits))


def _mul_steps(a: int, b: int) -> list[str]:
    partials = [d * 10**i for i, d in enumerate(_digits(b)) if d] or [0]
    steps = [f"{a}*{p}={a * p}" for p in partials]
    if len(partials) > 1:
        steps.append("+".join(str(a * p) for p in partials) + f"={a * b}")
    return steps
