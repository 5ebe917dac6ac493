"""GSM8K and MATH rewards, and which published recipe each one follows.

Both rewards are 1.0 for a response whose final answer is right and 0.0 otherwise (wrong, no
final answer, a cut-off answer, a verifier error or timeout); there is no partial credit for the
format. When a response states several answers the LAST one counts, as in verl.

:func:`gsm8k_reward` reads the final answer as :mod:`ais_jax.tasks.answers` does -- the last
``\\boxed{}`` or the line after the last ``####``, whichever comes later -- takes the number it
states and compares it exactly with the ground truth. A response with neither marker scores 0
even if its last number is right (verl's default ``method="strict"``).

:func:`math_reward` takes the content of the last ``\\boxed{}`` and asks ``math-verify``
(Hugging Face's maintained verifier, `math_verify.parse` + `math_verify.verify`) whether it
equals the ground truth, both wrapped as ``\\boxed{...}`` and parsed with
``LatexExtractionConfig(boxed_match_priority=0)``. So ``\\frac{1}{2}``, ``0.5``, ``\\dfrac12``,
``\\tfrac{1}{2}`` and ``1/2`` agree, as do ``[1,3)`` and ``[1, 3)``, ``x=3`` and ``3``,
``\\{1,2\\}`` and ``2,1``, ``10\\%`` and ``0.1``, ``6\\sqrt{3}`` and ``\\sqrt{108}``; forms
math-verify cannot parse are compared as strings. A trailing period in the box is dropped.

Guards, so that a pathological response scores 0 and never stops a training step: a boxed
answer longer than :data:`MAX_ANSWER_CHARS` is not parsed; every exception and math-verify's
``TimeoutException`` (a ``BaseException``) is caught. math-verify times out with
``signal.alarm``, which works only in the main thread: there :func:`math_reward` allows
:data:`PARSE_TIMEOUT_S` per parse and :data:`VERIFY_TIMEOUT_S` per comparison
(``10^{10^{10}}`` scores 0 after 5 s); in any other thread it runs without timeouts, as TRL's
``accuracy_reward`` does, so a runner that scores in threads relies on the length cap alone.

Recipes (what their files say; the prompt side is :class:`ais_jax.tasks.ChatFormat`):

* verl, GSM8K (``examples/data_preprocess/gsm8k.py``, ``verl/utils/reward_score/gsm8k.py``):
  one user message ``question + ' Let\\'s think step by step and output the final answer after
  "####".'``; reward: the last ``#### <number>`` within the response's last 300 characters
  (``_SOLUTION_CLIP_CHARS = 300``), commas and ``$`` removed, compared as a string with the
  ground truth; ``score=1.0``, ``format_score=0.0``. Our ``gsm8k`` task uses the same prompt by
  default; its reward also accepts ``\\boxed{}``, units and ``1,234.00``-style spellings and
  reads the whole response (no 300-character window).
* verl, MATH (``examples/data_preprocess/math_dataset.py``; ``verl/utils/reward_score/
  math_reward.py``, or ``math_verify.py`` which its ``__init__`` names as the optional more
  accurate scorer): ``question + " Let's think step by step and output the final answer within
  \\boxed{}."``; reward: the last ``\\boxed{}`` under lm-eval-harness string normalization, or
  math-verify with the ground truth wrapped in ``\\boxed{}``. Our ``math`` task uses the same
  prompt by default and the last ``\\boxed{}`` judged by math-verify.
* TRL (``examples/scripts/async_grpo.py``: Qwen3-0.6B on GSM8K, ``max_completion_length=1024``,
  ``learning_rate=1e-5``, ``max_steps=200``): one user message holding the bare question,
  ``chat_template_kwargs={"enable_thinking": False}``; reward ``trl.rewards.accuracy_reward``:
  math-verify on the whole completion (boxed answers tried first, ``parsing_timeout=10``,
  ``verify_timeout=5`` s in the main thread, none elsewhere). Set ``instruction: null`` and
  ``enable_thinking: false`` for this prompt; our rewards then read only ``\\boxed{}`` /
  ``####`` answers, where TRL's also reads e.g. "the final answer is $18$".
* The AIS paper's GSM8K setup: the source at hand (an article on arXiv v1) reports Qwen3-8B
  GSM8K accuracies (BF16 89.84, FP8 rollout 87.65, TIS 88.63, AIS 89.99) and that AIS's
  hyperparameters were tuned on GSM8K validation, but names neither the prompt nor the verifier.
"""

from __future__ import annotations

import threading

from ais_jax.tasks.answers import final_answer_text, final_number, last_boxed, parse_number

__all__ = [
    "MAX_ANSWER_CHARS",
    "PARSE_TIMEOUT_S",
    "VERIFY_TIMEOUT_S",
    "gsm8k_reward",
    "latex_equivalent",
    "math_reward",
]

MAX_ANSWER_CHARS = 1_000
PARSE_TIMEOUT_S = 5  # math-verify's defaults for parse() and verify()
VERIFY_TIMEOUT_S = 5


def gsm8k_reward(response: str, answer: str) -> float:
    """1.0 iff the number stated as ``response``'s final answer equals ``answer``.

    ``answer`` is the GSM8K ground truth, a number (``"1024"``, ``"-3"``, ``"0.5"``); a
    ground truth that is not a number must be stated verbatim (trailing period aside).

    >>> gsm8k_reward("3 * 6 = 18 apples, so 18.", "18")  # no #### and no box: no answer
    0.0
    >>> gsm8k_reward("#### 17\\nWait, I forgot one: \\\\boxed{18 \\\\text{ apples}}.", "18")
    1.0
    """
    text = final_answer_text(response)
    if text is None:
        return 0.0
    truth = parse_number(answer)
    if truth is None:
        return float(text.strip().removesuffix(".") == answer.strip())
    return float(final_number(text) == truth)


def math_reward(response: str, answer: str) -> float:
    """1.0 iff the last ``\\boxed{}`` of ``response`` is equivalent to ``answer`` (a LaTeX
    ground truth such as ``\\frac{3}{4}``) by math-verify.

    >>> math_reward(r"... so the answer is $\\boxed{\\dfrac12}$.", r"\\frac{1}{2}")
    1.0
    """
    predicted = last_boxed(response)
    return 0.0 if predicted is None else float(latex_equivalent(answer, predicted))


def latex_equivalent(gold: str, predicted: str) -> bool:
    """Whether math-verify judges the LaTeX answer ``predicted`` equal to ``gold``; False on a
    parse failure of either side, an error, a timeout, or an answer over the length cap.

    >>> latex_equivalent(r"\\frac{1}{2}", "0.5"), latex_equivalent("[1,3)", "(1,3]")
    (True, False)
    """
    from math_verify import LatexExtractionConfig, parse, verify
    from math_verify.errors import TimeoutException

    if len(predicted) > MAX_ANSWER_CHARS:
        return False
    main = threading.current_thread() is threading.main_thread()
    parse_s, verify_s = (PARSE_TIMEOUT_S, VERIFY_TIMEOUT_S) if main else (None, None)
    config = [LatexExtractionConfig(boxed_match_priority=0)]
    try:
        gold_parsed = parse(_boxed(gold), config, parsing_timeout=parse_s)
        predicted_parsed = parse(_boxed(predicted), config, parsing_timeout=parse_s)
        return bool(
            gold_parsed
            and predicted_parsed
            and verify(gold_parsed, predicted_parsed, timeout_seconds=verify_s)
        )
    except (Exception, TimeoutException):
        return False


def _boxed(answer: str) -> str:
    """``\\boxed{answer}``, without one trailing period (``5.`` -> ``5``; ``\\ldots`` and
    ``...`` are kept)."""
    answer = answer.strip()
    if answer.endswith(".") and not answer.endswith(".."):
        answer = answer[:-1]
    return f"\\boxed{{{answer}}}"
