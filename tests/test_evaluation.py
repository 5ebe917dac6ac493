"""Specification of `ais_jax.analysis.evaluation`: the statistics against NumPy references, maj@k on
hand-made answers (ties, missing answers, equivalent spellings), and the per-example rows."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats

from ais_jax.analysis.evaluation import (
    Draws,
    answer_rule,
    example_rows,
    majority_vote,
    metrics_at_k,
    score_draws,
    wilson_interval,
)
from ais_jax.tasks import Arithmetic, Example, JsonlTask, gsm8k_reward, latex_equivalent, load_gsm8k
from ais_jax.tasks.answers import gsm8k_final_answer, math_final_answer


def wilson_reference(x: int, n: int, confidence: float) -> tuple[float, float]:
    """Wilson's score interval written out in NumPy (float64)."""
    z = scipy.stats.norm.ppf((1 + confidence) / 2)
    p = np.float64(x) / n
    center = (p + z**2 / (2 * n)) / (1 + z**2 / n)
    half = z / (1 + z**2 / n) * np.sqrt(p * (1 - p) / n + z**2 / (4 * n**2))
    return float(center - half), float(center + half)


@pytest.mark.parametrize(
    "x, n, confidence",
    [(7, 10, 0.95), (0, 12, 0.95), (12, 12, 0.95), (1, 1, 0.9), (431, 1319, 0.95)],
)
def test_wilson_interval_matches_the_formula(x, n, confidence):
    low, high = wilson_interval(x, n, confidence)
    ref_low, ref_high = wilson_reference(x, n, confidence)
    assert low == pytest.approx(ref_low, abs=1e-12) and high == pytest.approx(ref_high, abs=1e-12)
    assert 0.0 <= low <= x / n <= high <= 1.0
    if 0 < x < n:
        assert low > 0.0 and high < 1.0


@pytest.mark.parametrize("x, n", [(-1, 10), (11, 10), (0, 0)])
def test_wilson_interval_rejects_impossible_counts(x, n):
    with pytest.raises(ValueError, match=rf"{x}/{n}"):
        wilson_interval(x, n)


def test_metrics_at_k_match_numpy_references():
    rng = np.random.default_rng(0)
    N, K = 37, 5
    p_N = rng.uniform(0.1, 0.9, N)  # each prompt its own difficulty
    sampled_NK = rng.uniform(size=(N, K)) < p_N[:, None]
    greedy_N = rng.uniform(size=N) < p_N
    majority_N = rng.uniform(size=N) < p_N
    got = metrics_at_k(greedy_N, sampled_NK, majority_N)
    assert list(got) == ["pass@1", "mean@5", "maj@5", "pass@5"]

    for name, outcome_N in (
        ("pass@1", greedy_N),
        ("maj@5", majority_N),
        ("pass@5", sampled_NK.any(axis=1)),
    ):
        m = got[name]
        x = int(outcome_N.sum())
        assert m.value == x / N and m.n == N and m.interval == "wilson"
        assert (m.low, m.high) == pytest.approx(wilson_reference(x, N, 0.95), abs=1e-12)

    per_prompt_N = sampled_NK.astype(np.float64).mean(axis=1)
    mean = per_prompt_N.mean()
    se = per_prompt_N.std(ddof=1) / np.sqrt(N)
    half = scipy.stats.t.ppf(0.975, N - 1) * se
    m = got["mean@5"]
    assert m.interval == "t" and m.n == N and 0 < m.low < m.value < m.high < 1
    assert m.value == pytest.approx(mean, abs=1e-12)
    assert (m.low, m.high) == pytest.approx((mean - half, mean + half), abs=1e-12)


def test_mean_at_k_of_one_prompt_has_no_interval():
    got = metrics_at_k(np.array([True]), np.array([[True, False, True, True]]), np.array([True]))
    assert got["mean@4"].value == 0.75
    assert math.isnan(got["mean@4"].low) and math.isnan(got["mean@4"].high)
    assert got["pass@1"].low > 0.0 and got["pass@1"].high == 1.0  # Wilson is defined at n = 1


def test_metrics_at_k_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"\(3,\), \(2, 4\) and \(3,\)"):
        metrics_at_k(np.ones(3, bool), np.ones((2, 4), bool), np.ones(3, bool))


# ---- maj@k ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "answers, expected",
    [
        (["5", "6", "6", "5", "6"], (1, 3)),  # plain majority
        (["5", None, "6", "6", "5"], (0, 2)),  # 2-2 tie: the answer sampled first wins
        (["6", "5", "5", "6"], (0, 2)),  # the same tie, the other order
        ([None, "7", "6", "6"], (2, 2)),  # no answer does not vote
        ([None, "7", None, None], (1, 1)),  # one vote is a majority
        ([None, None, None], (None, 0)),  # no votes at all
        (["1", "2", "3", "4"], (0, 1)),  # all different: the first
    ],
)
def test_majority_vote_on_hand_made_answers(answers, expected):
    assert majority_vote(answers) == expected


def test_majority_vote_groups_equivalent_answers():
    task = load_math_like()
    extract, same = answer_rule(task)
    responses = [
        r"so \boxed{0.5}",
        r"\boxed{\frac{1}{3}}",
        r"\boxed{\dfrac12}",
        r"\boxed{\frac{2}{6}}",
        r"it is \boxed{\frac{1}{2}.}",
    ]
    answers = [extract(r) for r in responses]
    assert answers == ["0.5", r"\frac{1}{3}", r"\dfrac12", r"\frac{2}{6}", r"\frac{1}{2}"]
    assert majority_vote(answers, same) == (0, 3)  # 0.5 = 1/2 = \dfrac12 beat 1/3 = 2/6
    assert majority_vote(answers) == (0, 1)  # as strings, every answer differs


def load_math_like() -> JsonlTask:
    return JsonlTask(
        name="math",
        examples=[Example(prompt="p", answer=r"\frac{1}{2}", demonstration="")],
        verifier=lambda r, a: 0.0,
        extract=math_final_answer,
        equivalent=latex_equivalent,
    )


@pytest.mark.parametrize(
    "response, answer",
    [
        ("3 + 15 = 18\n#### 18", "18"),
        ("#### 18.00 apples", "18"),
        (r"The answer is $\boxed{18 \text{ apples}}$.", "18"),
        (r"\boxed{1,234}", "1234"),
        (r"#### \$1,234.50.", "2469/2"),
        ("#### 7/2 hours", "7/2"),
        ("#### -3", "-3"),
        ("18", None),  # no marker: no final answer, as the reward reads it
        (r"\boxed{18", None),  # cut off
        ("#### yes.", "yes"),
    ],
)
def test_gsm8k_final_answer(response, answer):
    assert gsm8k_final_answer(response) == answer


def test_gsm8k_votes_follow_the_reward():
    """Responses with one extracted answer get one reward: the vote groups what the reward
    judges alike."""
    responses = ["#### 18", "#### 18.0", r"\boxed{18}", "#### 17", r"\boxed{3 \times 6 = 18}"]
    answers = [gsm8k_final_answer(r) for r in responses]
    assert answers == ["18", "18", "18", "17", "18"]
    for r, a in zip(responses, answers, strict=True):
        assert gsm8k_reward(r, "18") == float(a == "18")


def test_tasks_expose_their_answer_rule(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text('{"question": "2+2?", "answer": "2+2=4\\n#### 4"}\n')
    extract, same = answer_rule(load_gsm8k(path))
    assert extract(r"#### 4.0") == "4" and same("4", "4") and not same("4", "5")
    extract, _ = answer_rule(Arithmetic())
    assert extract("7+5=12\n=012") == "12"
    extract, _ = answer_rule(object())  # a task without the methods: the stripped response
    assert extract("  42 \n") == "42" and extract("   ") is None


# ---- rows --------------------------------------------------------------------------------------


def test_example_rows_and_scores_of_hand_made_draws(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text(
        '{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+3?", "answer": "#### 5"}\n'
        '{"question": "3*3?", "answer": "#### 9"}\n'
    )
    task = load_gsm8k(path)
    samples = [
        ["#### 2", "#### 3", "#### 3", "#### 2.0"],  # 2-2 tie: "2" came first, right
        ["#### 4", r"\boxed{5}", "no idea", "#### 4"],  # "4" wins 2-1, wrong; pass@4 yes
        ["no", "nothing", "cut \\boxed{9", "#### 8"],  # one vote, wrong; nothing right
    ]
    greedy = ["#### 2", "#### 6", r"\boxed{9}"]
    pairs = list(zip(task.examples, samples, greedy, strict=True))
    rewards_NK = np.array([[task.reward(e, t) for t in s] for e, s, _ in pairs])
    greedy_N = np.array([task.reward(e, g) for e, _, g in pairs])
    draws = Draws(task, task.examples, greedy, greedy_N, samples, rewards_NK)
    rows, majority_N = example_rows(draws)
    assert majority_N.tolist() == [True, False, False]
    assert [r["majority"]["answer"] for r in rows] == ["2", "4", "8"]
    assert [r["majority"]["votes"] for r in rows] == [2, 2, 1]
    assert rows[1]["samples"][1] == {
        "response": r"\boxed{5}",
        "answer": "5",
        "reward": 1.0,
        "correct": True,
    }
    assert rows[1]["samples"][2]["answer"] is None
    assert rows[2]["greedy"] == {
        "response": r"\boxed{9}",
        "answer": "9",
        "reward": 1.0,
        "correct": True,
    }
    assert rows[0]["prompt"] == task.examples[0].prompt and rows[0]["ground_truth"] == "2"
    assert rows[0]["messages"] == [{"role": "user", "content": task.examples[0].prompt}]
    assert [r["mean_correct"] for r in rows] == [0.5, 0.25, 0.0]

    metrics, again = score_draws(draws)
    assert again == rows
    assert metrics["pass@1"].value == pytest.approx(2 / 3)
    assert metrics["mean@4"].value == pytest.approx(0.25)
    assert metrics["maj@4"].value == pytest.approx(1 / 3)
    assert metrics["pass@4"].value == pytest.approx(2 / 3)
