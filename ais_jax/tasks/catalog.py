"""Building a task from its name, e.g. from a YAML config: ``make_task("countdown", ...)``.

:data:`TASKS` is a plain dict from name to constructor, written out once here -- no
registration decorators, no import side effects. :func:`make_task` checks the name and the
keyword arguments against the constructor's signature before calling it, so a typo in a
config fails with a message that lists what is allowed instead of a bare ``TypeError``.

The file tasks' prompt options come from the config the same way, e.g.
``task.options: {path: train.jsonl, instruction: null, enable_thinking: false}`` (see
:class:`~ais_jax.tasks.chat.ChatFormat`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from ais_jax.tasks.arithmetic import Arithmetic
from ais_jax.tasks.base import Task
from ais_jax.tasks.countdown import Countdown
from ais_jax.tasks.jsonl import load_gsm8k, load_math
from ais_jax.tasks.sudoku import Sudoku

__all__ = ["TASKS", "make_task"]

TASKS: dict[str, Callable[..., Task]] = {
    "arithmetic": Arithmetic,
    "countdown": Countdown,
    "sudoku": Sudoku,
    # need path=; take on_error, name, system_prompt, instruction, enable_thinking
    "gsm8k": load_gsm8k,
    "math": load_math,
}


def make_task(name: str, **kwargs) -> Task:
    """``TASKS[name](**kwargs)``, with ValueErrors naming an unknown task or argument.

    >>> make_task("arithmetic", max_digits=5).max_digits
    5
    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid names are {sorted(TASKS)}")
    parameters = inspect.signature(TASKS[name]).parameters
    unknown = sorted(set(kwargs) - set(parameters))
    if unknown:
        raise ValueError(
            f"unknown argument(s) {unknown} for task {name!r}; valid arguments are "
            f"{sorted(parameters)}"
        )
    missing = [
        p for p, param in parameters.items() if param.default is param.empty and p not in kwargs
    ]
    if missing:
        raise ValueError(f"task {name!r} needs argument(s) {missing}")
    return TASKS[name](**kwargs)
