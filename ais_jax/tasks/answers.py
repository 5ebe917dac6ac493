"""Final-answer extraction and comparison for math word problems (GSM8K, MATH).

A response to a math problem states its answer in one of three ways, tried in this order:

1. LaTeX ``\\boxed{...}`` (MATH convention): the content of the *last* ``\\boxed{}`` (or
   ``\\fbox{}``), braces balanced, so ``\\boxed{\\frac{3}{4}}`` gives ``\\frac{3}{4}``;
2. ``#### 42`` (GSM8K convention): the first number after the last ``####``;
3. otherwise the last number in the text.

Two answers match if both parse as numbers and are equal as exact fractions, else if their
normalized strings are equal. Numbers: integers and decimals with optional sign,
thousands separators (``1,234``), ``a/b``, ``\\frac{a}{b}`` (also ``\\dfrac``, ``\\tfrac``);
surrounding ``$``, ``\\$``, spaces, LaTeX spacing (``\\!``, ``\\,``) and a trailing ``.`` are
ignored. So ``0.5 == 1/2 == \\frac{1}{2} == $0.50``. Normalized strings drop whitespace,
``$``, ``\\left``/``\\right``, LaTeX spacing, ``^\\circ``, ``\\text{...}`` wrappers and a
trailing ``.``, and read ``\\dfrac``/``\\tfrac`` as ``\\frac`` -- a deliberately small subset
of the MATH benchmark's normalizer; it does not decide algebraic equivalence.
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["answer_after_hashes", "answers_match", "extract_answer", "last_boxed", "parse_number"]

_BOX_OPENERS = ("\\boxed{", "\\fbox{")
_NUMBER = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")
_DECIMAL = r"-?(?:\d+(?:\.\d*)?|\.\d+)"
_FRAC = re.compile(rf"(-?)\\[dt]?frac\{{({_DECIMAL})\}}\{{({_DECIMAL})\}}")
_RATIO = re.compile(rf"({_DECIMAL})/({_DECIMAL})")
_NOISE = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\$", "$", "^\\circ", "^{\\circ}")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}``, or None if absent or unbalanced.

    >>> last_boxed(r"so \\boxed{1} then \\boxed{\\frac{3}{4}}.")
    '\\\\frac{3}{4}'
    """
    start = max(
        text.rfind(opener) + len(opener) if opener in text else -1 for opener in _BOX_OPENERS
    )
    if start < 0:
        return None
    depth = 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None


def extract_answer(response: str) -> str | None:
    """The final answer stated in ``response`` (boxed, then ``####``, then last number)."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed
    if "####" in response:
        return answer_after_hashes(response)
    matches = _NUMBER.findall(response)
    return matches[-1] if matches else None


def answer_after_hashes(text: str) -> str | None:
    """The first number after the last ``####``, else the stripped rest (None if empty).

    >>> answer_after_hashes("4*6=24 #### 1,024 apples"), answer_after_hashes("#### yes")
    ('1,024', 'yes')
    """
    tail = text.rsplit("####", 1)[1] if "####" in text else ""
    match = _NUMBER.search(tail)
    return match.group() if match else tail.strip() or None


def parse_number(text: str) -> Fraction | None:
    """``text`` as an exact number, or None if it is not one.

    >>> parse_number("$1,234.50."), parse_number(r"\\frac{3}{4}"), parse_number("x")
    (Fraction(2469, 2), Fraction(3, 4), None)
    """
    text = _strip_noise(text).replace(",", "")
    try:
        if match := _FRAC.fullmatch(text):
            sign = -1 if match.group(1) else 1
            return sign * Fraction(match.group(2)) / Fraction(match.group(3))
        if match := _RATIO.fullmatch(text):
            return Fraction(match.group(1)) / Fraction(match.group(2))
        if re.fullmatch(_DECIMAL, text):
            return Fraction(text)
    except (ZeroDivisionError, ValueError):  # x/0, or more digits than int() accepts
        return None
    return None


def answers_match(predicted: str, truth: str) -> bool:
    """Whether ``predicted`` states the same answer as ``truth`` (numerically, else textually).

    >>> answers_match("0.5", "1/2"), answers_match(r"\\dfrac{1}{2}", "0.50")
    (True, True)
    >>> answers_match("2", "3"), answers_match(r"\\sqrt{2}", r"\\sqrt{2}.")
    (False, True)
    """
    a, b = parse_number(predicted), parse_number(truth)
    if a is not None and b is not None:
        return a == b
    return _normalize(predicted) == _normalize(truth)


def _strip_noise(text: str) -> str:
    text = _TEXT.sub(r"\1", text)
    for noise in _NOISE:
        text = text.replace(noise, "")
    return "".join(text.split()).rstrip(".")


def _normalize(text: str) -> str:
    return _strip_noise(text).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
