"""Specifications of the GSM8K and MATH rewards on responses shaped like real model outputs.

Each case is (response, ground truth, the grade a careful human gives it). The responses
imitate what Qwen-style models write: worked solutions ending in ``#### n`` (verl's GSM8K
instruction) or ``\\boxed{}`` (MATH's), Qwen3 thinking blocks, LaTeX variants of one answer,
wrong answers, responses cut off by the token limit (no final answer, or a box that never
closes) and responses that state several answers, where the LAST one counts (verl's rule).
"""

from __future__ import annotations

import random
import threading
import time

import math_verify
import pytest
from math_verify.errors import TimeoutException

from ais_jax.tasks import gsm8k_reward, latex_equivalent, math_reward
from ais_jax.tasks.rewards import MAX_ANSWER_CHARS

NATALIA = (
    "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether in April "
    "and May."
)

GSM8K_CASES = [
    # verl's format: reasoning, then "#### n"
    (f"{NATALIA}\n#### 72", "72", 1.0),
    (f"{NATALIA}\n#### 72.", "72", 1.0),
    (f"{NATALIA}\n#### 72 clips", "72", 1.0),
    (f"{NATALIA}\n####72", "72", 1.0),
    (f"{NATALIA}\n####\n72", "72", 1.0),
    (f"{NATALIA}\n#### **72**", "72", 1.0),
    (f"{NATALIA}\n#### 72\n\nI hope this helps!", "72", 1.0),
    (f"{NATALIA}\n#### 71", "72", 0.0),
    (f"{NATALIA}\n#### 24", "72", 0.0),
    # boxed, as instruction-tuned models write it
    (f"{NATALIA}\nTherefore, the answer is $\\boxed{{72}}$.", "72", 1.0),
    (f"{NATALIA}\n\n**Final Answer**\n\\[\n\\boxed{{72}}\n\\]", "72", 1.0),
    ("She sold \\boxed{72 \\text{ clips}} in total.", "72", 1.0),
    ("The answer is \\fbox{72}.", "72", 1.0),
    ("So $48 + 24 = \\boxed{72}$", "72", 1.0),
    ("\\boxed{48 + 24 = 72}", "72", 1.0),
    ("\\boxed{x = 72}", "72", 1.0),
    ("\\boxed{70}", "72", 0.0),
    ("\\boxed{48 + 24}", "72", 0.0),  # an expression, not a stated number
    ("\\boxed{\\sqrt{2}}", "2", 0.0),
    (f"{NATALIA}\n#### The answer is 72.", "72", 1.0),
    ("\\boxed{}", "72", 0.0),
    ("\\boxed{\\text{seventy-two}}", "72", 0.0),
    # money, thousands separators, percentages, units, signs
    ("He earns 2 * 9 = $18 per day.\n#### $18", "18", 1.0),
    ("The total cost is $\\boxed{\\$18.00}$.", "18", 1.0),
    ("#### 18 dollars", "18", 1.0),
    ("The farm has 1,234 animals.\n#### 1,234", "1234", 1.0),
    ("#### 1234", "1234", 1.0),
    ("\\boxed{1{,}234}", "1234", 1.0),
    ("\\boxed{1\\,234}", "1234", 1.0),
    ("#### 1,243", "1234", 0.0),
    ("#### 1,000,000", "1000000", 1.0),
    ("The discount is 25%.\n#### 25%", "25", 1.0),
    ("The temperature fell to -5 degrees.\n#### -5", "-5", 1.0),
    ("#### \u22125", "-5", 1.0),
    ("#### 5", "-5", 0.0),
    ("Each share is 5/2 = 2.5 pounds.\n#### 2.50", "2.5", 1.0),
    ("\\boxed{\\frac{5}{2}}", "2.5", 1.0),
    ("#### 123456789012345678901234567890", "123456789012345678901234567890", 1.0),
    # no final answer: wrong format, or cut off by the token limit
    (f"{NATALIA} So the answer is 72.", "72", 0.0),
    ("Natalia sold 48/2 = 24 clips in May.\nThen she sold 48+24 =", "72", 0.0),
    (f"{NATALIA}\nSo the answer is $\\boxed{{7", "72", 0.0),
    (f"{NATALIA}\n####", "72", 0.0),
    ("", "72", 0.0),
    # several answers: the last one counts
    (f"{NATALIA}\n#### 70\nWait, 48 + 24 = 72, not 70.\n#### 72", "72", 1.0),
    (f"{NATALIA}\n#### 72\nHmm, let me redo it.\n#### 70", "72", 0.0),
    ("\\boxed{70} ... no: \\boxed{72}", "72", 1.0),
    ("\\boxed{72} ... no: \\boxed{70}", "72", 0.0),
    ("#### 70\nActually the answer is \\boxed{72}.", "72", 1.0),
    ("\\boxed{72}\nDouble-checking the units...\n#### 70", "72", 0.0),
    (f"{NATALIA}\n#### 72\nAnd then \\boxed{{7", "72", 0.0),  # the last answer is cut off
    # Qwen3 thinking blocks
    (f"<think>\n48/2 = 24, 48 + 24 = 72.\n</think>\n\n{NATALIA}\n\\boxed{{72}}", "72", 1.0),
    ("<think>\nMaybe \\boxed{70}? No, 72.\n</think>\n\nThe answer is \\boxed{72}.", "72", 1.0),
    ("<think>\nOkay, so Natalia sold 48 clips in April and half as many in May, 24", "72", 0.0),
]

MATH_CASES = [
    # one value, many spellings
    ("Dividing gives $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}", 1.0),
    ("The probability is $\\boxed{0.5}$.", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac12}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\tfrac{1}{2}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{1/2}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0),
    ("\\boxed{-0.75}", "-\\frac{3}{4}", 1.0),
    ("\\boxed{\\frac{-3}{4}}", "-\\frac34", 1.0),
    ("\\boxed{\\frac{3}{4}}", "-\\frac{3}{4}", 0.0),
    ("So the area is $\\boxed{6\\sqrt{3}}$.", "6\\sqrt{3}", 1.0),
    ("\\boxed{\\sqrt{108}}", "6\\sqrt{3}", 1.0),
    ("\\boxed{2\\sqrt{3}}", "6\\sqrt{3}", 0.0),
    ("\\boxed{\\dfrac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0),
    ("\\boxed{2\\pi}", "2\\pi", 1.0),
    ("\\boxed{2^{10}}", "1024", 1.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{3.0}", "3", 1.0),
    ("\\boxed{5.}", "5", 1.0),
    ("\\boxed{5}.", "5", 1.0),
    # units, degrees, percent, money
    ("\\boxed{5\\text{ cm}}", "5", 1.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{10\\%}", "10\\%", 1.0),
    ("\\boxed{\\$5.00}", "5", 1.0),
    # expressions, equations, intervals, sets, tuples, matrices
    ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    ("\\boxed{x^2+2x}", "x^2+2x+1", 0.0),
    ("\\boxed{x = 3}", "3", 1.0),
    ("\\boxed{y = 2x + 3}", "y=2x+3", 1.0),
    ("\\boxed{[1, 3)}", "[1,3)", 1.0),
    ("\\boxed{[1,3]}", "[1,3)", 0.0),
    ("\\boxed{(-\\infty, 2]}", "(-\\infty,2]", 1.0),
    ("\\boxed{2, 1}", "1, 2", 1.0),
    ("\\boxed{\\{1,2\\}}", "1,2", 1.0),
    ("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
    ("\\boxed{(\\frac{\\pi}{2}, 3)}", "\\left( 3, \\frac{\\pi}{2} \\right)", 0.0),
    (
        "\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}",
        "\\begin{pmatrix}1\\\\2\\end{pmatrix}",
        1.0,
    ),
    (
        "\\boxed{\\begin{pmatrix} 2 \\\\ 1 \\end{pmatrix}}",
        "\\begin{pmatrix}1\\\\2\\end{pmatrix}",
        0.0,
    ),
    # words and multiple-choice letters
    ("\\boxed{\\text{Monday}}", "\\text{Monday}", 1.0),
    ("\\boxed{\\text{(C)}}", "\\text{(C)}", 1.0),
    ("\\boxed{(B)}", "\\text{(C)}", 0.0),
    ("\\boxed{\\text{odd}}", "\\text{even}", 0.0),
    # no final answer: no box, or cut off by the token limit
    ("We have $x = 3$, so the answer is $3$.", "3", 0.0),
    ("Let's compute the sum: $1 + 2 = 3$, so", "3", 0.0),
    ("Simplifying, we get $\\boxed{\\frac{3}{", "\\frac{3}{4}", 0.0),
    ("\\boxed{}", "3", 0.0),
    # several answers: the last box counts
    ("First guess $\\boxed{2}$; checking, it fails. Corrected: $\\boxed{3}$.", "3", 1.0),
    ("First guess $\\boxed{2}$; checking, it fails. Corrected: $\\boxed{3}$.", "2", 0.0),
    ("<think>\nIs it \\boxed{5}? No.\n</think>\n\nThe answer is $\\boxed{7}$.", "7", 1.0),
    ("<think>\nIs it \\boxed{5}? No.\n</think>\n\nThe answer is $\\boxed{7}$.", "5", 0.0),
    ("<think>\nWe need the roots of $x^2 - 5x + 6 = 0$, which are 2 and 3", "2, 3", 0.0),
    # malformed or pathological boxes score 0 and return
    ("\\boxed{\\frac{}{}}", "1", 0.0),
    ("\\boxed{)(}", "1", 0.0),
]


def test_there_are_enough_real_looking_cases():
    assert len(GSM8K_CASES) >= 40 and len(MATH_CASES) >= 40
    for cases in (GSM8K_CASES, MATH_CASES):
        assert {g for _, _, g in cases} == {0.0, 1.0}
        assert len({r for r, _, _ in cases}) >= 40


@pytest.mark.parametrize("response, truth, grade", GSM8K_CASES)
def test_gsm8k_reward(response, truth, grade):
    assert gsm8k_reward(response, truth) == grade


@pytest.mark.parametrize("response, truth, grade", MATH_CASES)
def test_math_reward(response, truth, grade):
    assert math_reward(response, truth) == grade


# Ground truths as they appear in MATH's solutions (the last \boxed{} of each).
MATH_TRUTHS = [
    "\\frac{63}{400}",
    "6\\sqrt{3}",
    "[1,3)",
    "(-\\infty, 2] \\cup [5, \\infty)",
    "\\left( 3, \\frac{\\pi}{2} \\right)",
    "\\begin{pmatrix} -1 \\\\ 4 \\end{pmatrix}",
    "\\text{(C)}",
    "\\text{Monday}",
    "x^2+7x+10",
    "y = -\\frac{1}{2}x + 3",
    "1, 2, 3",
    "\\$32,\\!348",
    "10\\%",
    "45^\\circ",
    "\\infty",
    "0.5",
    "-\\frac{\\sqrt{2}}{2}",
    "2\\pi - 4",
    "\\dfrac{9}{7}",
    "8\\text{ cm}^2",
]


@pytest.mark.parametrize("truth", MATH_TRUTHS)
def test_math_truth_scores_itself(truth):
    """The SFT demonstration's reward is 1.0: a MATH ground truth judged against itself."""
    assert math_reward(f"Working... so the answer is $\\boxed{{{truth}}}$.", truth) == 1.0


def test_spellings_of_one_half_agree_with_each_other():
    forms = ["\\frac{1}{2}", "0.5", "\\dfrac12", "\\tfrac{1}{2}", "1/2", "\\frac{2}{4}", ".5"]
    for gold in forms:
        for predicted in forms:
            assert latex_equivalent(gold, predicted), (gold, predicted)
        assert not latex_equivalent(gold, "\\frac{1}{3}")


def test_rewards_are_deterministic_and_in_unit_interval():
    rng = random.Random(0)
    alphabet = "0123456789+-*/=#{}\\$., boxedfrac^_()[]x\n"
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        for reward, truth in ((gsm8k_reward, "42"), (math_reward, "\\frac{1}{2}")):
            value = reward(text, truth)
            assert value in (0.0, 1.0) and value == reward(text, truth), text


@pytest.mark.slow
def test_pathological_answer_times_out_and_scores_zero():
    """``10^{10^{10}}`` would take sympy forever; math-verify's alarm stops it (main thread)."""
    assert threading.current_thread() is threading.main_thread()
    start = time.perf_counter()
    assert math_reward("\\boxed{10^{10^{10}}}", "2") == 0.0
    assert time.perf_counter() - start < 60


def test_overlong_answer_is_not_parsed():
    assert latex_equivalent("1", "1" + " " * (MAX_ANSWER_CHARS - 1))
    assert not latex_equivalent("1", "1" + " " * MAX_ANSWER_CHARS)
    assert math_reward("\\boxed{" + "(" * 2000 + ")" * 2000 + "}", "1") == 0.0


def test_math_reward_outside_the_main_thread():
    """math-verify's signal-based timeouts fail outside the main thread; there the reward runs
    without them and still grades correctly instead of raising."""
    results = {}

    def grade():
        results["right"] = math_reward("\\boxed{\\dfrac12}", "\\frac{1}{2}")
        results["wrong"] = math_reward("\\boxed{\\frac13}", "\\frac{1}{2}")
        results["long"] = math_reward("\\boxed{" + "1" * (MAX_ANSWER_CHARS + 1) + "}", "1")

    worker = threading.Thread(target=grade)
    worker.start()
    worker.join(timeout=120)
    assert results == {"right": 1.0, "wrong": 0.0, "long": 0.0}


@pytest.mark.parametrize("error", [RuntimeError("sympy bug"), TimeoutException("slow")])
def test_verifier_errors_score_zero(monkeypatch, error):
    def broken(*args, **kwargs):
        raise error

    monkeypatch.setattr(math_verify, "verify", broken)
    assert math_reward("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}") == 0.0
    monkeypatch.setattr(math_verify, "parse", broken)
    assert math_reward("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}") == 0.0
