"""Countdown: combine the given numbers with + - * / to hit the target (TinyZero's task).

Prompt and reference response::

    25 5 4 to 80=        (prompt: the numbers, then the target)
    (25-5)*4             (demonstration)

With ``show_work=True`` the demonstration first lists one line per operation, then the
expression on its own last line (``25-5=20\\n20*4=80\\n(25-5)*4``).

``slip`` makes the demonstrations those of a careless teacher (arithmetic's ``slip``): each
subtraction or division is written with its operands swapped with probability ``slip``
(``5-25`` for ``25-5``, in the expression and in its worked line, ``5-25=20``), so the
demonstrated expression misses the target. A warm start on them learns a systematic error that
only the reward can correct: with ``slip > 0.5`` its greedy answer puts the smaller operand
first while the right order keeps probability ``1 - slip``. The slips are drawn after the
prompt (the instance is replayed from the generator's saved state with the swaps applied), so
the prompts and answers of a stream do not depend on ``slip``; with ``slip=0`` (the default)
no extra random numbers are drawn.

Instances are solvable by construction: draw ``min_numbers..max_numbers`` numbers in
``[min_number, max_number]``, merge two random nodes with a random operation until one node
is left, and call its value the target. Merges keep every intermediate value a positive integer
(exact division, positive difference), as in the TV game, and instances whose target falls
outside ``[1, max_target]`` are redrawn. The prompt lists the numbers in shuffled order.

Reward, TinyZero's ``countdown.compute_score`` levels (``score=1.0``, ``format_score=0.1``):

* the expression is the *last non-empty line* of the response, taken whole (so
  ``(25-5)*4=80`` does not parse: the line must be the expression alone);
* 0.0 if it does not parse;
* 0.1 if it parses but does not use each given number exactly once, or does not evaluate to
  the target, or divides by zero (TinyZero's ``eval`` raises there and scores 0.1);
* 1.0 if it uses each number exactly once and evaluates to the target.

The one departure: TinyZero finds the expression between ``<answer>`` tags and scores 0.0
only when the tags are missing, giving 0.1 to a tagged string that ``eval`` rejects. Our
prompts are tag-free (the character vocabulary has no ``<``), so "well-formed" means
"parses" and an unparsable last line scores 0.0.

d1 (diffu-GRPO's ``countdown_reward_func``) scores Countdown with the same ``compute_score``
(format score 0.1, score 1.0), so these are d1's levels too, with these departures, each because
our prompts are tag-free character strings: (1) the answer is the last non-empty line, not the
last ``<answer>...</answer>`` span (no tags: 0.0 in both); (2) d1 gives 0.1 to a tagged answer
that uses the right numbers but does not evaluate and 0.1 to any other tagged text that fails its
number check, while we give 0.0 to a line that does not parse (and 0.1 to one that parses but is
wrong); (3) d1 evaluates with Python ``eval`` (unary minus and decimals allowed, a float
compared to the target within 1e-5), we parse exactly as below (no unary minus or decimals,
exact Fraction equality).

The expression is parsed by a small recursive-descent parser, never ``eval``: non-negative
integer literals, binary ``+ - * /``, parentheses and spaces. Arithmetic is exact
(:class:`fractions.Fraction`), so ``4/3*3`` is 4 and non-integer intermediate values are
allowed in a response even though generated instances never need them. There is no unary
minus (nor plus): ``-5+10`` does not parse (0.0), since a unary minus would let a response
negate a given number, which the game does not allow. Parentheses nest at most 64
deep and literals have at most 100 digits (beyond either the text counts as unparsable).
"""

from __future__ import annotations

import dataclasses
import random
import re
from fractions import Fraction
from typing import ClassVar

from ais_jax.tasks.base import Example

__all__ = ["Countdown", "ParseError", "parse_expression"]

_MAX_DEPTH = 64
_MAX_DIGITS = 100
_MAX_TRIES = 10_000
_TOKEN = re.compile(r"\s*(?:([0-9]+)|(.))")
_PROMPT = re.compile(r"((?:\d+ )+)to (\d+)=")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Countdown:
    """Countdown instances with ``min_numbers..max_numbers`` numbers (TinyZero: 3 to 4)."""

    name: ClassVar[str] = "countdown"

    min_numbers: int = 3
    max_numbers: int = 4
    min_number: int = 1
    max_number: int = 100
    max_target: int = 1000
    show_work: bool = False
    slip: float = 0.0

    def __post_init__(self):
        if self.min_numbers < 2:
            raise ValueError(f"min_numbers must be >= 2, got {self.min_numbers}")
        if self.max_numbers < self.min_numbers:
            raise ValueError(
                f"max_numbers must be >= min_numbers={self.min_numbers}, got {self.max_numbers}"
            )
        if self.min_number < 1:
            raise ValueError(f"min_number must be >= 1, got {self.min_number}")
        if self.max_number < self.min_number:
            raise ValueError(
                f"max_number must be >= min_number={self.min_number}, got {self.max_number}"
            )
        if self.max_target < 1:
            raise ValueError(f"max_target must be >= 1, got {self.max_target}")
        if not (isinstance(self.slip, int | float) and 0.0 <= self.slip <= 1.0):
            raise ValueError(f"slip must be a probability in [0, 1], got {self.slip!r}")

    def sample(self, rng: random.Random) -> Example:
        count = rng.randint(self.min_numbers, self.max_numbers)
        for _ in range(_MAX_TRIES):
            numbers = [rng.randint(self.min_number, self.max_number) for _ in range(count)]
            state = rng.getstate()
            root, steps = _random_expression(numbers, rng)
            if 1 <= root.value <= self.max_target:
                break
        else:
            raise RuntimeError(f"no target in [1, {self.max_target}] after {_MAX_TRIES} draws")
        drawn = list(numbers)
        rng.shuffle(numbers)
        prompt = " ".join(map(str, numbers)) + f" to {root.value}="
        if self.slip > 0:  # the same instance again, with the teacher's swaps
            swaps = iter([rng.random() < self.slip for _ in range(count - 1)])
            replay = random.Random()
            replay.setstate(state)
            root, steps = _random_expression(drawn, replay, lambda: next(swaps))
        lines = [*steps, root.text] if self.show_work else [root.text]
        return Example(prompt=prompt, answer=str(root.value), demonstration="\n".join(lines))

    def reward(self, example: Example, response: str) -> float:
        numbers, target = _parse_prompt(example.prompt)
        lines = [line for line in response.splitlines() if line.strip()]
        try:
            value, used = parse_expression(lines[-1] if lines else "")
        except ParseError:
            return 0.0
        if sorted(used) != sorted(numbers) or value is None or value != target:
            return 0.1
        return 1.0


class ParseError(ValueError):
    """The text is not an expression over integers, + - * / and parentheses."""


def parse_expression(text: str) -> tuple[Fraction | None, list[int]]:
    """Parses and evaluates ``text`` exactly.

    Returns ``(value, numbers)``: the value as a Fraction (None if the expression divides by
    zero) and the integer literals in order of appearance. Raises :class:`ParseError` if
    ``text`` is not a complete expression.

    >>> parse_expression("(25-5)*4")
    (Fraction(80, 1), [25, 5, 4])
    >>> parse_expression("1/(2-2)")
    (None, [1, 2, 2])
    """
    tokens = [m.group(1) or m.group(2) for m in _TOKEN.finditer(text.strip())]
    parser = _Parser(tokens)
    value = parser.expr(depth=0)
    if parser.pos != len(tokens):
        raise ParseError(f"unexpected {tokens[parser.pos]!r} at token {parser.pos} in {text!r}")
    return value, parser.numbers


class _Parser:
    """expr := term (('+'|'-') term)* ; term := factor (('*'|'/') factor)* ;
    factor := INT | '(' expr ')'. Values are Fractions, None once a division by zero occurs."""

    def __init__(self, tokens: list[str]):
        self.tokens, self.pos, self.numbers = tokens, 0, []

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def expr(self, depth: int) -> Fraction | None:
        value = self.term(depth)
        while self.peek() in ("+", "-"):
            op = self.tokens[self.pos]
            self.pos += 1
            right = self.term(depth)
            if value is not None and right is not None:
                value = value + right if op == "+" else value - right
            else:
                value = None
        return value

    def term(self, depth: int) -> Fraction | None:
        value = self.factor(depth)
        while self.peek() in ("*", "/"):
            op = self.tokens[self.pos]
            self.pos += 1
            right = self.factor(depth)
            if value is None or right is None or (op == "/" and right == 0):
                value = None
            else:
                value = value * right if op == "*" else value / right
        return value

    def factor(self, depth: int) -> Fraction | None:
        token = self.peek()
        if token is None:
            raise ParseError("expression ends early")
        self.pos += 1
        if token.isascii() and token.isdigit():
            if len(token) > _MAX_DIGITS:  # int() refuses > 4300 digits; no game needs > 100
                raise ParseError(f"number literal longer than {_MAX_DIGITS} digits")
            self.numbers.append(int(token))
            return Fraction(int(token))
        if token != "(":
            raise ParseError(f"expected a number or '(', got {token!r} at token {self.pos - 1}")
        if depth >= _MAX_DEPTH:
            raise ParseError(f"parentheses nest deeper than {_MAX_DEPTH}")
        value = self.expr(depth + 1)
        if self.peek() != ")":
            raise ParseError(f"expected ')' at token {self.pos}, got {self.peek()!r}")
        self.pos += 1
        return value


@dataclasses.dataclass(frozen=True)
class _Node:
    value: int
    text: str
    precedence: int  # 0: + or -, 1: * or /, 2: a literal


def _wrap(node: _Node, below: int) -> str:
    return f"({node.text})" if node.precedence < below else node.text


def _combine(left: _Node, op: str, right: _Node, swap: bool = False) -> _Node:
    """The node ``left op right``, parenthesized minimally (exact arithmetic is associative).
    ``swap``: a - or / written ``right op left`` (a careless teacher); the value stays true."""
    if op == "+":
        return _Node(left.value + right.value, f"{left.text}+{right.text}", 0)
    a, b = (right, left) if swap and op in "-/" else (left, right)
    if op == "-":
        return _Node(left.value - right.value, f"{a.text}-{_wrap(b, 1)}", 0)
    if op == "*":
        return _Node(left.value * right.value, f"{_wrap(left, 1)}*{_wrap(right, 1)}", 1)
    return _Node(left.value // right.value, f"{_wrap(a, 1)}/{_wrap(b, 2)}", 1)


def _valid(left: _Node, op: str, right: _Node) -> bool:
    if op == "-":
        return left.value > right.value
    if op == "/":
        return left.value % right.value == 0
    return True


def _random_expression(
    numbers: list[int], rng: random.Random, swaps=lambda: False
) -> tuple[_Node, list[str]]:
    """Merges random pairs until one node is left; returns it and one ``a op b=c`` per merge.
    ``swaps()``, called once per merge, says whether a - or / is written swapped (`_combine`)."""
    nodes = [_Node(n, str(n), 2) for n in numbers]
    steps = []
    while len(nodes) > 1:
        pairs = [(i, j) for i in range(len(nodes)) for j in range(len(nodes)) if i != j]
        options = {
            op: [(i, j) for i, j in pairs if _valid(nodes[i], op, nodes[j])] for op in "+-*/"
        }
        op = rng.choice([op for op, valid in options.items() if valid])
        i, j = rng.choice(options[op])
        swap = swaps() and op in "-/"
        merged = _combine(nodes[i], op, nodes[j], swap)
        a, b = (nodes[j], nodes[i]) if swap else (nodes[i], nodes[j])
        steps.append(f"{a.value}{op}{b.value}={merged.value}")
        nodes = [node for k, node in enumerate(nodes) if k not in (i, j)] + [merged]
    return nodes[0], steps


def _parse_prompt(prompt: str) -> tuple[list[int], int]:
    match = _PROMPT.fullmatch(prompt)
    if match is None:
        raise ValueError(f"not a countdown prompt (expected 'a b c to t='): {prompt!r}")
    return [int(n) for n in match.group(1).split()], int(match.group(2))
