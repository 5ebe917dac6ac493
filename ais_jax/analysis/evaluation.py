"""Evaluation a researcher can quote: pass@1, mean@k, maj@k and pass@k with 95% intervals.

For ``n`` prompts ``i``, a greedy response that is right (``g_i = 1``) or not, and ``k``
responses sampled at a stated temperature with correctness ``c_ij`` and final answers
``a_ij`` (None where a response states none):

    pass@1  = (1/n) sum_i g_i                        greedy                  Wilson interval
    mean@k  = (1/n) sum_i m_i,  m_i = (1/k) sum_j c_ij   mean sampled accuracy   t over prompts
    maj@k   = (1/n) sum_i c_{i, w_i}                 the majority answer     Wilson interval
    pass@k  = (1/n) sum_i max_j c_ij                 any of the k is right   Wilson interval

A response is right when its reward is >= 1 (the tasks' rewards are 1 or 0). The intervals
(``confidence`` 0.95 by default) are over prompts, the unit that was sampled from the test set:

* Wilson score interval, for the 0/1 per-prompt outcomes (pass@1, maj@k, pass@k), with
  ``p = x / n`` and ``z = Phi^-1((1 + confidence) / 2)``:

      center = (p + z^2 / (2n)) / (1 + z^2 / n)
      half   = z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / (4 n^2))

  (``scipy.stats.binomtest(x, n).proportion_ci(method="wilson")``). Unlike the normal
  approximation it stays inside [0, 1] and is not degenerate at 0% or 100%.
* Student t over prompts, for mean@k, whose per-prompt values ``m_i`` are fractions:
  ``mean -+ t_{(1 + c)/2, n - 1} * std(m, ddof=1) / sqrt(n)`` (`analysis.stats.mean_ci`; NaN,
  printed as null, for ``n = 1``). It counts the spread between prompts, not the k samples as
  independent trials.

maj@k (`majority_vote`): the k final answers are grouped by the task's answer equivalence
(`answer_rule`: GSM8K numbers by value, so ``18``, ``18.00`` and ``\\boxed{18}`` vote
together; MATH boxed answers by math-verify, so ``\\frac{1}{2}`` and ``0.5`` do; other tasks by
their stated number or the stripped response). A response without a final answer does not
vote. The answer with the most votes wins; a tie goes to the tied answer that was sampled
first (the rule of ``collections.Counter.most_common``, as in lm-evaluation-harness' maj@k), so
the vote never peeks at correctness. The majority is right iff the first sample that voted for
it is right; no votes at all is wrong.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import scipy.stats

from ais_jax.analysis.stats import mean_ci

__all__ = [
    "INTERVALS",
    "Draws",
    "Metric",
    "answer_rule",
    "example_rows",
    "majority_vote",
    "metrics_at_k",
    "score_draws",
    "wilson_interval",
]

INTERVALS = {
    "wilson": "Wilson score interval over prompts (0/1 outcomes)",
    "t": "Student t interval over prompts (per-prompt mean accuracy)",
}


@dataclasses.dataclass(frozen=True)
class Draws:
    """What a policy answered (`ais_jax.train.run.Run.evaluate_at_k`): for each of ``N``
    examples of ``task``, the greedy response and ``K`` sampled ones, with their rewards."""

    task: Any
    examples: Sequence[Any]
    greedy_texts: Sequence[str]
    greedy_rewards_N: np.ndarray
    sample_texts: Sequence[Sequence[str]]  # [N][K]
    sample_rewards_NK: np.ndarray


@dataclasses.dataclass(frozen=True)
class Metric:
    """An accuracy over ``n`` prompts with its ``confidence`` interval ``[low, high]``."""

    value: float
    low: float
    high: float
    n: int
    confidence: float
    interval: str  # a key of INTERVALS

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of ``successes`` out of ``n`` (module docstring).

    >>> [round(x, 4) for x in wilson_interval(7, 10)]
    [0.3968, 0.8922]
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence!r} must be in (0, 1).")
    if not (n >= 1 and 0 <= successes <= n):
        raise ValueError(
            f"wilson_interval needs 0 <= successes <= n and n >= 1, got {successes}/{n}."
        )
    ci = scipy.stats.binomtest(int(successes), int(n)).proportion_ci(confidence, method="wilson")
    return float(ci.low), float(ci.high)


def _proportion(correct_N: np.ndarray, confidence: float) -> Metric:
    n, x = int(correct_N.size), int(correct_N.sum())
    low, high = wilson_interval(x, n, confidence)
    return Metric(x / n, low, high, n, confidence, "wilson")


def majority_vote(
    answers: Sequence[str | None], same: Callable[[str, str], bool] = operator.eq
) -> tuple[int | None, int]:
    """``(j, votes)``: the index of the first sample whose answer won the vote, and its vote
    count; ``(None, 0)`` when no sample states an answer. ``same(a, b)`` says whether two
    answers are equal (each answer is compared with the first answer of every group so far).

    >>> majority_vote(["5", None, "6", "6", "5"])  # a 2-2 tie: "5" came first
    (0, 2)
    >>> majority_vote([None, "7", "6", "6"]), majority_vote([None, None])
    ((2, 2), (None, 0))
    """
    firsts: list[int] = []  # the first sample of each group, in order of appearance
    votes: list[int] = []
    for j, answer in enumerate(answers):
        if answer is None:
            continue
        for g, first in enumerate(firsts):
            if same(answers[first], answer):
                votes[g] += 1
                break
        else:
            firsts.append(j)
            votes.append(1)
    if not firsts:
        return None, 0
    best = max(range(len(votes)), key=lambda g: (votes[g], -g))  # ties: the earliest group
    return firsts[best], votes[best]


def metrics_at_k(
    greedy_correct_N: np.ndarray,
    sampled_correct_NK: np.ndarray,
    majority_correct_N: np.ndarray,
    confidence: float = 0.95,
) -> dict[str, Metric]:
    """``{"pass@1", "mean@k", "maj@k", "pass@k"}`` (with k the number of columns of
    ``sampled_correct_NK``) from per-prompt 0/1 outcomes (module docstring)."""
    g_N = np.asarray(greedy_correct_N, bool)
    c_NK = np.asarray(sampled_correct_NK, bool)
    maj_N = np.asarray(majority_correct_N, bool)
    if c_NK.ndim != 2 or c_NK.shape[1] < 1 or not g_N.shape == maj_N.shape == c_NK.shape[:1]:
        raise ValueError(
            "metrics_at_k needs greedy [N], sampled [N, K>=1] and majority [N] outcomes, got "
            f"{g_N.shape}, {c_NK.shape} and {maj_N.shape}."
        )
    if g_N.size == 0:
        raise ValueError("metrics_at_k needs at least one prompt, got none.")
    k = c_NK.shape[1]
    mean = mean_ci(c_NK.mean(axis=1, dtype=np.float64), confidence)
    return {
        "pass@1": _proportion(g_N, confidence),
        f"mean@{k}": Metric(mean.mean, mean.low, mean.high, mean.n, confidence, "t"),
        f"maj@{k}": _proportion(maj_N, confidence),
        f"pass@{k}": _proportion(c_NK.any(axis=1), confidence),
    }


def answer_rule(task) -> tuple[Callable[[str], str | None], Callable[[str, str], bool]]:
    """``(final_answer, same_answer)`` of ``task`` for maj@k: its own methods where it has them
    (GSM8K, MATH, arithmetic), else the stripped response (None if empty) and string equality."""
    extract = getattr(task, "final_answer", None)
    if extract is None:
        return (lambda response: response.strip() or None), operator.eq
    return extract, getattr(task, "same_answer", operator.eq)


def score_draws(draws: Draws, confidence: float = 0.95) -> tuple[dict[str, Metric], list[dict]]:
    """`metrics_at_k` of ``draws`` and their `example_rows`."""
    rows, majority_N = example_rows(draws)
    metrics = metrics_at_k(
        draws.greedy_rewards_N >= 1.0, draws.sample_rewards_NK >= 1.0, majority_N, confidence
    )
    return metrics, rows


def example_rows(draws: Draws) -> tuple[list[dict[str, Any]], np.ndarray]:
    """One inspectable row per example (prompt, ground truth, the greedy response and the k
    samples with their extracted answers and correctness, the majority vote), and the
    per-example correctness of the majority answer ``[N]``."""
    extract, same = answer_rule(draws.task)
    greedy_rewards_N, sample_rewards_NK = draws.greedy_rewards_N, draws.sample_rewards_NK
    if sample_rewards_NK.shape != (len(draws.examples), len(draws.sample_texts[0])):
        raise ValueError(
            f"Draws of {len(draws.examples)} examples need [N, K] sample rewards, got "
            f"{sample_rewards_NK.shape}."
        )
    rows, majority = [], []
    for i, ex in enumerate(draws.examples):
        texts = draws.sample_texts[i]
        answers = [extract(t) for t in texts]
        correct = [bool(r >= 1.0) for r in sample_rewards_NK[i]]
        winner, votes = majority_vote(answers, same)
        majority.append(winner is not None and correct[winner])
        greedy = draws.greedy_texts[i]
        rows.append(
            {
                "index": i,
                "prompt": ex.prompt,
                "messages": list(ex.messages) if ex.messages else None,
                "ground_truth": ex.answer,
                "greedy": {
                    "response": greedy,
                    "answer": extract(greedy),
                    "reward": float(greedy_rewards_N[i]),
                    "correct": bool(greedy_rewards_N[i] >= 1.0),
                },
                "samples": [
                    {"response": t, "answer": a, "reward": float(r), "correct": c}
                    for t, a, r, c in zip(
                        texts, answers, sample_rewards_NK[i], correct, strict=True
                    )
                ],
                "majority": {
                    "answer": None if winner is None else answers[winner],
                    "votes": votes,
                    "correct": majority[-1],
                },
                "mean_correct": float(np.mean(correct)),
            }
        )
    return rows, np.asarray(majority, bool)
