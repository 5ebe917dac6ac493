"""Tasks for RL post-training: prompts, reward functions and demonstrations (pure Python).

Synthetic, generated locally and deterministically from a ``random.Random``:
:class:`Arithmetic`, :class:`Countdown`, :class:`Sudoku`. From local JSONL files:
:func:`load_gsm8k`, :func:`load_math` (both give a :class:`JsonlTask` whose examples also carry
chat ``messages``, built by a :class:`ChatFormat`; rewards :func:`gsm8k_reward` and
:func:`math_reward`, the latter by math-verify). Build any of them by name with
:func:`make_task`. :class:`CharTokenizer` tokenizes the synthetic tasks' text;
:func:`render_chat_template` renders a checkpoint's Jinja chat template as `transformers` does.
"""

from ais_jax.tasks.answers import (
    answer_after_hashes,
    final_answer_text,
    final_number,
    gsm8k_final_answer,
    last_boxed,
    math_final_answer,
    parse_number,
)
from ais_jax.tasks.arithmetic import Arithmetic
from ais_jax.tasks.base import Example, FiniteTask, RewardError, Task
from ais_jax.tasks.catalog import TASKS, make_task
from ais_jax.tasks.chat import ChatFormat, render_chat_template
from ais_jax.tasks.countdown import Countdown, ParseError, parse_expression
from ais_jax.tasks.jsonl import (
    GSM8K_INSTRUCTION,
    MATH_INSTRUCTION,
    JsonlTask,
    load_gsm8k,
    load_jsonl,
    load_math,
)
from ais_jax.tasks.rewards import gsm8k_reward, latex_equivalent, math_reward
from ais_jax.tasks.sudoku import Sudoku
from ais_jax.tasks.tokenizer import CharTokenizer

__all__ = [
    "GSM8K_INSTRUCTION",
    "MATH_INSTRUCTION",
    "TASKS",
    "Arithmetic",
    "CharTokenizer",
    "ChatFormat",
    "Countdown",
    "Example",
    "FiniteTask",
    "JsonlTask",
    "ParseError",
    "RewardError",
    "Sudoku",
    "Task",
    "answer_after_hashes",
    "final_answer_text",
    "final_number",
    "gsm8k_final_answer",
    "gsm8k_reward",
    "last_boxed",
    "latex_equivalent",
    "load_gsm8k",
    "load_jsonl",
    "load_math",
    "make_task",
    "math_final_answer",
    "math_reward",
    "parse_expression",
    "parse_number",
    "render_chat_template",
]
