"""Where a math response states its final answer, and GSM8K's numbers (no dependencies).

A response states its final answer in LaTeX ``\\boxed{...}`` (MATH's convention, and what
instruction-tuned models write when asked to) or after ``####`` (GSM8K's). When a response
holds several, the *last* one counts -- the rule of verl's reward functions
(``verl/utils/reward_score/gsm8k.py`` takes the last ``#### <number>`` match,
``math_reward.py`` the last ``\\boxed{}``):

* :func:`last_boxed`: the content of the last ``\\boxed{...}`` / ``\\fbox{...}``, braces
  balanced, or None if there is none or it is cut off (a truncated response);
* :func:`final_answer_text` (GSM8K): whichever of the last ``\\boxed{}`` and the last ``####``
  comes later; after ``####`` the answer is the rest of that line;
* :func:`final_number` (GSM8K): the first number in that text, after its last ``=`` if it has
  one (``\\boxed{3 \\times 6 = 18}`` states 18), with ``$``, ``\\$``, thousands separators
  (``1,234``, ``1{,}234``, ``1\\,234``), units and a trailing period ignored; ``\\frac{a}{b}``
  and ``a/b`` are read as fractions. A number that is a root, exponent or subscript argument,
  or is followed by an operator, is not a stated answer (``\\sqrt{2}``, ``2^{10}`` and
  ``48 + 24`` state none);
* :func:`gsm8k_final_answer` and :func:`math_final_answer`: a response's final answer as a
  string that equal answers share (for maj@k votes, `analysis.evaluation`): GSM8K's number in
  lowest terms (``18``, ``18.00`` and ``\\boxed{18 \\text{ apples}}`` are all ``"18"``), MATH's
  last ``\\boxed{}`` content (compared by math-verify, not as a string);
* :func:`parse_number`: a GSM8K ground truth (``"1,024"``, ``"-3"``, ``"0.5"``) as an exact
  :class:`fractions.Fraction`.

MATH answers (``\\frac{1}{2}`` vs ``0.5``, intervals, sets, matrices) are compared by
``math-verify`` in :mod:`ais_jax.tasks.rewards`, not here.
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = [
    "answer_after_hashes",
    "final_answer_text",
    "final_number",
    "gsm8k_final_answer",
    "last_boxed",
    "math_final_answer",
    "parse_number",
]

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_DIGITS = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
# first match wins: a fraction, a ratio, else a plain number (never a part of a longer one)
_NUMBER = re.compile(
    rf"(?P<frac>(?P<fsign>-?)\\[dt]?frac\{{(?P<fnum>-?{_DIGITS})\}}\{{(?P<fden>-?{_DIGITS})\}})"
    rf"|(?<![\d.,])(?P<ratio>(?P<rnum>-?{_DIGITS})\s*/\s*(?P<rden>{_DIGITS}))"
    rf"|(?<![\d.,])(?P<plain>-?{_DIGITS})"
)
_PLAIN = re.compile(rf"(?<![\d.,])-?{_DIGITS}")
# LaTeX, typographic and Markdown spellings: 1{,}000 and 1\,000 (thin space), U+2212 minus, **bold**
_SPELLINGS = (("{,}", ","), ("\\,", ""), ("\\!", ""), ("\u2212", "-"), ("\\$", "$"), ("**", ""))
# what makes a number an operand rather than a stated answer
_BEFORE_OPERAND = ("\\sqrt", "\\sqrt[", "^", "_")
_AFTER_OPERAND = ("+", "-", "*", "/", "^", "_", "\u00d7", "\u00f7", "\\times", "\\cdot", "\\div")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}``, stripped; None if there is none
    or its braces never close.

    >>> last_boxed(r"so \\boxed{1} then \\boxed{\\frac{3}{4}}.")
    '\\\\frac{3}{4}'
    >>> last_boxed(r"\\boxed{1} and then \\boxed{\\frac{3}{"), last_boxed("no box") is None
    (None, True)
    """
    opening = _last_box(text)
    return None if opening is None else _balanced(text, opening.end())


def answer_after_hashes(text: str) -> str | None:
    """The first number after the last ``####``, else the stripped rest (None if empty).

    >>> answer_after_hashes("4*6=24 #### 1,024 apples"), answer_after_hashes("#### yes")
    ('1,024', 'yes')
    """
    tail = text.rsplit("####", 1)[1] if "####" in text else ""
    match = _PLAIN.search(tail)
    return match.group() if match else tail.strip() or None


def final_answer_text(response: str) -> str | None:
    """The text of the final answer: the last ``\\boxed{}``'s content or the line after the
    last ``####``, whichever comes later in ``response``; None if neither is there (or the
    last box is cut off).

    >>> final_answer_text("#### 5 is wrong, so \\\\boxed{6}.")
    '6'
    >>> final_answer_text("\\\\boxed{5}\\nNo:\\n#### 6 apples\\nDone."), final_answer_text("6")
    ('6 apples', None)
    """
    hashes = response.rfind("####")
    opening = _last_box(response)
    if opening is not None and opening.start() > hashes:
        return _balanced(response, opening.end())
    if hashes < 0:
        return None
    lines = response[hashes + 4 :].strip().splitlines()
    return lines[0].strip() if lines else None


def final_number(text: str) -> Fraction | None:
    """The number ``text`` states (after its last ``=``), as an exact fraction, or None.

    >>> final_number(r"\\$1,234.50."), final_number(r"3 \\times 6 = 18 \\text{ apples}")
    (Fraction(2469, 2), Fraction(18, 1))
    >>> final_number(r"-\\frac{3}{4}"), final_number("7/2 hours"), final_number("none")
    (Fraction(-3, 4), Fraction(7, 2), None)
    >>> final_number(r"\\sqrt{2}"), final_number("2^{10}"), final_number("48 + 24")
    (None, None, None)
    """
    for spelling, plain in _SPELLINGS:
        text = text.replace(spelling, plain)
    text = text.rsplit("=", 1)[-1]
    match = _NUMBER.search(text)
    if match is None or _is_operand(text[: match.start()], text[match.end() :]):
        return None
    try:
        if match.group("frac"):
            value = parse_number(match.group("fnum")) / parse_number(match.group("fden"))
            return -value if match.group("fsign") else value
        if match.group("ratio"):
            return parse_number(match.group("rnum")) / parse_number(match.group("rden"))
    except ZeroDivisionError:  # \frac{1}{0}, 1/0: no number
        return None
    return parse_number(match.group("plain"))


def gsm8k_final_answer(response: str) -> str | None:
    """The final answer of ``response`` as `gsm8k_reward` reads it: the stated number in lowest
    terms (``str`` of a `fractions.Fraction`), else the stripped answer text without a trailing
    period; None if there is no final answer.

    >>> gsm8k_final_answer("#### 18.00 apples"), gsm8k_final_answer("\\\\boxed{\\\\frac{6}{4}}")
    ('18', '3/2')
    >>> gsm8k_final_answer("#### yes."), gsm8k_final_answer("18"), gsm8k_final_answer("#### ")
    ('yes', None, None)
    """
    text = final_answer_text(response)
    if text is None:
        return None
    number = final_number(text)
    if number is not None:
        return str(number)
    return text.strip().removesuffix(".").strip() or None


def math_final_answer(response: str) -> str | None:
    """The content of ``response``'s last ``\\boxed{}`` (what `math_reward` judges), without
    a trailing period; None if there is none or it is cut off.

    >>> math_final_answer("so $\\\\boxed{\\\\frac{1}{2}.}$"), math_final_answer("1/2")
    ('\\\\frac{1}{2}', None)
    """
    boxed = last_boxed(response)
    if boxed is None:
        return None
    if boxed.endswith(".") and not boxed.endswith(".."):
        boxed = boxed[:-1].rstrip()
    return boxed or None


def parse_number(text: str) -> Fraction | None:
    """``text`` as an exact number (thousands separators and surrounding spaces allowed), or
    None if it is not one.

    >>> parse_number("1,024"), parse_number(" -0.50 "), parse_number("1,0"), parse_number("x")
    (Fraction(1024, 1), Fraction(-1, 2), None, None)
    """
    text = text.strip()
    if not re.fullmatch(rf"-?{_DIGITS}", text):
        return None
    try:
        return Fraction(text.replace(",", ""))
    except ValueError:  # more digits than int() accepts
        return None


def _is_operand(before: str, after: str) -> bool:
    """Whether a number with ``before`` and ``after`` around it is part of an expression: the
    argument of a root, exponent or subscript, or followed by an operator."""
    before = before.rstrip().rstrip("{").rstrip()
    return before.endswith(_BEFORE_OPERAND) or after.lstrip().startswith(_AFTER_OPERAND)


def _last_box(text: str) -> re.Match | None:
    """The last ``\\boxed{`` / ``\\fbox{`` opening in ``text``."""
    return max(_BOX.finditer(text), key=lambda m: m.start(), default=None)


def _balanced(text: str, start: int) -> str | None:
    """``text[start:i]`` up to the brace that closes the one before ``start``, stripped."""
    depth = 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i].strip()
    return None
