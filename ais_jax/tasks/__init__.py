"""Tasks for RL post-training: prompts, reward functions and demonstrations (pure Python).

Synthetic, generated locally and deterministically from a ``random.Random``:
:class:`Arithmetic`, :class:`Countdown`, :class:`Sudoku`. From local JSONL files:
:func:`load_gsm8k`, :func:`load_math` (both give a :class:`JsonlTask`). Build any of them by
name with :func:`make_task`. :class:`CharTokenizer` tokenizes the synthetic tasks' text.
"""

from ais_jax.tasks.answers import answers_match, extract_answer, last_boxed, parse_number
from ais_jax.tasks.arithmetic import Arithmetic
from ais_jax.tasks.base import Example, FiniteTask, RewardError, Task
from ais_jax.tasks.catalog import TASKS, make_task
from ais_jax.tasks.countdown import Countdown, ParseError, parse_expression
from ais_jax.tasks.jsonl import JsonlTask, load_gsm8k, load_jsonl, load_math
from ais_jax.tasks.sudoku import Sudoku
from ais_jax.tasks.tokenizer import CharTokenizer

__all__ = [
    "TASKS",
    "Arithmetic",
    "CharTokenizer",
    "Countdown",
    "Example",
    "FiniteTask",
    "JsonlTask",
    "ParseError",
    "RewardError",
    "Sudoku",
    "Task",
    "answers_match",
    "extract_answer",
    "last_boxed",
    "load_gsm8k",
    "load_jsonl",
    "load_math",
    "make_task",
    "parse_expression",
    "parse_number",
]
