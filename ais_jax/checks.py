"""Eager checks of hyper-parameters, shared by every factory of the package.

A factory (`ais.adaptive`, `grpo.make_loss`, ...) validates its Python-valued hyper-parameters
before it returns a jittable function, and a bad value raises `ValueError` naming the argument,
the value and what is allowed:

    >>> number("clip", 0.5, lambda c: c >= 1.0, "a finite float C >= 1")
    Traceback (most recent call last):
    ...
    ValueError: clip=0.5 is invalid; allowed: a finite float C >= 1
    >>> choice("level", "tok", ("token", "sequence"))
    Traceback (most recent call last):
    ...
    ValueError: level='tok' is not one of the allowed values ('token', 'sequence')

This module imports only the standard library, so the array modules (`ais`, `grpo`) and the
configuration (`config`) can all share it without pulling anything else in.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

__all__ = ["choice", "number", "positive_int"]


def number(name: str, value: object, ok: Callable[[float], bool], allowed: str) -> float:
    """`value` as a float if it is a finite real number (not a bool) with `ok(value)` true.

    Raises ValueError("{name}={value!r} ...; allowed: {allowed}") otherwise.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}={value!r} is not a number; allowed: {allowed}")
    if not (math.isfinite(value) and ok(float(value))):
        raise ValueError(f"{name}={value!r} is invalid; allowed: {allowed}")
    return float(value)


def choice(name: str, value: object, allowed: tuple[str, ...]) -> str:
    """`value` if it is one of the strings `allowed`, else ValueError listing them."""
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name}={value!r} is not one of the allowed values {allowed}")
    return value


def positive_int(name: str, value: object) -> int:
    """`value` if it is an int (not a bool) > 0, else ValueError("{name} must be a positive
    integer, got {value!r}.")."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
    return value
