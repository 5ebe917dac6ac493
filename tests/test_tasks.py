"""Specifications of the tasks: generators, rewards, parsers, JSONL loading and the tokenizer."""

import collections
import dataclasses
import doctest
import importlib
import json
import random
import re
import string
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ais_jax.tasks import (
    GSM8K_INSTRUCTION,
    MATH_INSTRUCTION,
    TASKS,
    Arithmetic,
    CharTokenizer,
    ChatFormat,
    Countdown,
    Example,
    FiniteTask,
    JsonlTask,
    ParseError,
    Sudoku,
    Task,
    final_answer_text,
    final_number,
    gsm8k_reward,
    last_boxed,
    load_gsm8k,
    load_math,
    make_task,
    math_reward,
    parse_expression,
    parse_number,
)
from ais_jax.tasks.arithmetic import _add_steps, _mul_steps, _sub_steps, final_integer
from ais_jax.tasks.sudoku import count_solutions

SYNTHETIC = {
    "arithmetic": Arithmetic(),
    "arithmetic_long": Arithmetic(min_digits=3, max_digits=6, show_work=True),
    "arithmetic_work": Arithmetic(show_work=True),
    "countdown": Countdown(),
    "countdown_work": Countdown(show_work=True, min_numbers=2, max_numbers=5),
    "sudoku": Sudoku(),
    "sudoku_1": Sudoku(n_blank=1),
    "sudoku_12": Sudoku(n_blank=12),
}


def _samples(task, n=200, seed=0):
    return [task.sample(random.Random(seed * 1_000_003 + i)) for i in range(n)]


# ---------------------------------------------------------------- shared properties


@pytest.mark.parametrize("key", sorted(SYNTHETIC))
def test_demonstration_earns_full_reward(key):
    task = SYNTHETIC[key]
    for ex in _samples(task):
        assert task.reward(ex, ex.demonstration) == 1.0, ex


@pytest.mark.parametrize("key", sorted(SYNTHETIC))
def test_sample_is_deterministic_given_rng(key):
    task = SYNTHETIC[key]
    assert _samples(task, 20, seed=1) == _samples(task, 20, seed=1)
    assert _samples(task, 20, seed=1) != _samples(task, 20, seed=2)


@pytest.mark.parametrize("key", sorted(SYNTHETIC))
def test_synthetic_text_is_in_char_vocabulary(key):
    tok = CharTokenizer()
    for ex in _samples(SYNTHETIC[key], 50):
        assert tok.decode(tok.encode(ex.prompt + ex.demonstration)) == ex.prompt + ex.demonstration


@pytest.mark.parametrize("key", sorted(SYNTHETIC))
def test_reward_is_in_unit_interval_on_garbage(key):
    task, rng = SYNTHETIC[key], random.Random(0)
    alphabet = "0123456789+-*/=() |\n."
    for ex in _samples(task, 20):
        for _ in range(20):
            response = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 25)))
            assert 0.0 <= task.reward(ex, response) <= 1.0


def test_tasks_satisfy_the_protocols(tmp_path):
    for task in SYNTHETIC.values():
        assert isinstance(task, Task) and not isinstance(task, FiniteTask)
    path = tmp_path / "g.jsonl"
    path.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    assert isinstance(load_gsm8k(path), FiniteTask)


def test_example_is_frozen():
    ex = Example(prompt="1+1=", answer="2", demonstration="2")
    with pytest.raises(dataclasses.FrozenInstanceError):
        ex.answer = "3"
    assert ex.messages is None  # plain-text prompt
    chat = Example(prompt="q", answer="2", demonstration="2", messages=({"role": "user"},))
    assert hash(chat) == hash(Example(prompt="q", answer="2", demonstration="2"))  # dicts inside


@pytest.mark.parametrize(
    "module",
    ["answers", "arithmetic", "catalog", "chat", "countdown", "rewards", "sudoku", "tokenizer"],
)
def test_docstring_examples(module):
    results = doctest.testmod(importlib.import_module(f"ais_jax.tasks.{module}"))
    assert results.failed == 0 and results.attempted > 0


# ---------------------------------------------------------------- arithmetic


def _arith(prompt="47+385=", answer="432"):
    return Example(prompt=prompt, answer=answer, demonstration=answer)


@pytest.mark.parametrize(
    "response, reward",
    [
        ("432", 1.0),
        ("0432", 1.0),
        ("the answer is 432", 1.0),
        ("7+5=12 carry 1\n4+8+1=13 carry 1\n3+1=4\n=432", 1.0),
        ("431", 0.0),
        ("432 no wait 433", 0.0),
        ("-432", 0.0),
        ("", 0.0),
        ("four hundred", 0.0),
        ("4 3 2", 0.0),
    ],
)
def test_arithmetic_reward(response, reward):
    assert Arithmetic().reward(_arith(), response) == reward


def test_arithmetic_reward_reads_signs_and_huge_numbers():
    task = Arithmetic()
    assert task.reward(_arith("3-5=", "-2"), "=-2") == 1.0
    assert task.reward(_arith("3-5=", "-2"), "5-2") == 0.0  # '-' after a digit is an operator
    assert task.reward(_arith(), "9" * 10_000) == 0.0  # beyond int()'s digit limit: no crash
    assert final_integer("x=-0") == "0"


def test_arithmetic_operands_respect_config():
    task = Arithmetic(ops=("-", "*"), min_digits=2, max_digits=4)
    for ex in _samples(task):
        a, op, b = _split_arith(ex.prompt)
        assert op in "-*" and all(2 <= len(str(x)) <= 4 for x in (a, b))
        assert int(ex.answer) == (a - b if op == "-" else a * b) >= 0


def _split_arith(prompt):
    body = prompt.removesuffix("=")
    i = next(i for i, c in enumerate(body) if c in "+-*" and i > 0)
    return int(body[:i]), body[i], int(body[i + 1 :])


def test_arithmetic_instruction_adds_chat_messages_and_keeps_the_draws():
    plain, chat = Arithmetic(ops=("+", "*")), Arithmetic(ops=("+", "*"), instruction="Be brief.")
    for seed in range(20):
        a, b = plain.sample(random.Random(seed)), chat.sample(random.Random(seed))
        assert (a.prompt, a.answer, a.demonstration) == (b.prompt, b.answer, b.demonstration)
        x, op, y = re.fullmatch(r"(\d+)([+*])(\d+)=", a.prompt).groups()
        assert a.messages is None
        assert b.messages == ({"role": "user", "content": f"What is {x} {op} {y}? Be brief."},)
    with pytest.raises(ValueError, match="instruction must be a string or None, got 3"):
        Arithmetic(instruction=3)


def test_arithmetic_filler_prefixes_uniform_letters_and_keeps_the_reward():
    """The filler is ``filler`` lowercase letters and a space before the unchanged demonstration;
    its letters are near-uniform over the 26 (the entropy it exists to add), the reward of a
    demonstration stays 1 (no digit leaks in), and ``filler=0`` draws nothing extra."""
    plain, padded = Arithmetic(ops=("+",), slip=0.5), Arithmetic(ops=("+",), slip=0.5, filler=5)
    counts = collections.Counter()
    for seed in range(400):
        ex = padded.sample(random.Random(seed))
        letters, sep, rest = ex.demonstration.partition(" ")
        assert sep == " " and len(letters) == 5 and letters.isalpha() and letters.islower()
        assert padded.reward(ex, ex.demonstration) == plain.reward(ex, rest)
        counts.update(letters)
    assert padded.reward(ex, "qwert " + ex.answer) == 1.0
    assert len(counts) == 26 and max(counts.values()) < 2 * min(counts.values())
    assert Arithmetic(filler=0).sample(random.Random(3)) == Arithmetic().sample(random.Random(3))
    for bad in (-1, 2.0, True, "3"):
        with pytest.raises(ValueError, match=f"filler must be an integer >= 0, got {bad!r}"):
            Arithmetic(filler=bad)
    for bad in (-0.1, 1.5, "0.5"):
        with pytest.raises(
            ValueError, match=f"filler_noise must be a probability in .0, 1., got {bad!r}"
        ):
            Arithmetic(filler_noise=bad)


def test_arithmetic_filler_noise_mixes_the_positions_letter_with_a_uniform_tail():
    """``filler_noise=0`` writes the alphabet's first letters; at 0.4 position i holds its letter
    with probability 0.6 + 0.4/26 and each other letter with 0.4/26 (the likely token and the
    tail that an FP8 rollout gets wrong)."""
    exact = Arithmetic(filler=30, filler_noise=0.0).sample(random.Random(0)).demonstration
    assert exact.split(" ")[0] == "abcdefghijklmnopqrstuvwxyzabcd"
    task, n = Arithmetic(filler=3, filler_noise=0.4), 3000
    firsts = collections.Counter(task.sample(random.Random(s)).demonstration[2] for s in range(n))
    own = 0.6 + 0.4 / 26
    assert abs(firsts["c"] / n - own) < 4 * (own * (1 - own) / n) ** 0.5
    assert abs((n - firsts["c"]) / n / 25 - 0.4 / 26) < 0.01 and len(firsts) == 26


def test_arithmetic_filler_zipf_grades_each_positions_letters_by_rank():
    """``filler_zipf=a``: position i holds the letter r places after its own with probability
    (r + 1) ** -a / sum; checked against those frequencies at two positions (a uniform tail
    or a rank ignoring the position would fail), with bad exponents and a clash refused."""
    a, n = 1.5, 6000
    task = Arithmetic(ops=("+",), slip=0.5, filler=3, filler_zipf=a)
    weights = [(r + 1) ** -a for r in range(26)]
    expected = [w / sum(weights) for w in weights]
    samples = [task.sample(random.Random(s)) for s in range(n)]
    for position in (0, 2):
        counts = collections.Counter(ex.demonstration[position] for ex in samples)
        for rank in (0, 1, 5, 25):
            letter = string.ascii_lowercase[(position + rank) % 26]
            p = expected[rank]
            assert abs(counts[letter] / n - p) < 4.5 * (p * (1 - p) / n) ** 0.5, (position, rank)
    assert all(ex.demonstration[:3].isalpha() and ex.demonstration[3] == " " for ex in samples)
    ex = samples[0]
    assert task.reward(ex, ex.demonstration[:4] + ex.answer) == 1.0
    assert Arithmetic(filler=0, filler_zipf=a).sample(random.Random(3)) == Arithmetic(
        filler_zipf=a
    ).sample(random.Random(3))
    for bad in (-1.0, True, "1", float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"filler_zipf must be an exponent in \[0, 1000\)"):
            Arithmetic(filler=3, filler_zipf=bad)
    with pytest.raises(ValueError, match="filler_zipf=1.5 replaces filler_noise; .* got 0.5"):
        Arithmetic(filler=3, filler_zipf=1.5, filler_noise=0.5)


def test_arithmetic_filler_center_prompt_codes_the_prompts_characters():
    """``filler_center="prompt"``: position i's own letter codes the prompt's i-th character
    (digits a-j, then + - * = as k-n, cycling past the prompt's end), exactly at noise 0 and as
    the rank-0 letter of a Zipf tail; the default keeps the alphabet's letters (a tail centred
    on the position, or a code off by one, would fail)."""
    exact = Arithmetic(ops=("+", "-", "*"), filler=9, filler_noise=0.0, filler_center="prompt")
    code = dict(zip("0123456789+-*=", "abcdefghijklmn", strict=True))
    for seed in range(50):
        ex = exact.sample(random.Random(seed))
        cycled = (ex.prompt * 9)[:9]
        assert ex.demonstration == "".join(code[c] for c in cycled) + " " + ex.answer
    a, n = 1.5, 4000
    task = Arithmetic(
        ops=("+",), min_digits=2, max_digits=2, filler=6, filler_zipf=a, filler_center="prompt"
    )
    weights = [(r + 1) ** -a for r in range(26)]
    top = weights[0] / sum(weights)
    hits = collections.Counter()
    for seed in range(n):
        ex = task.sample(random.Random(seed))
        for i in (0, 2, 5):
            hits[i] += ex.demonstration[i] == code[ex.prompt[i]]
    for i in (0, 2, 5):
        assert abs(hits[i] / n - top) < 4.5 * (top * (1 - top) / n) ** 0.5, i
    default = Arithmetic(filler=4, filler_noise=0.0).sample(random.Random(1)).demonstration
    assert default.startswith("abcd ")
    for bad in ("answer", "", None):
        with pytest.raises(
            ValueError, match=rf"filler_center must be one of \('position', 'prompt'\), got {bad!r}"
        ):
            Arithmetic(filler=3, filler_center=bad)


def test_arithmetic_filler_place_after_writes_the_letters_behind_the_answer():
    """``filler_place="after"``: the same letters as before the answer, but after it and a space,
    so the response starts with the answer, and the reward still reads it (letters placed before,
    or the answer read from the letters, would fail); a bad place is refused by name."""
    before = Arithmetic(ops=("+",), max_digits=2, slip=0.6, filler=9, filler_noise=0.3)
    after = dataclasses.replace(before, filler_place="after")
    for seed in range(40):
        ex_before = before.sample(random.Random(seed))
        ex = after.sample(random.Random(seed))
        letters, shown = ex_before.demonstration.split(" ")
        assert ex.prompt == ex_before.prompt and ex.answer == ex_before.answer
        assert ex.demonstration == f"{shown} {letters}" and letters.isalpha()
        assert after.reward(ex, ex.demonstration) == float(shown == ex.answer)
        assert after.reward(ex, f"{ex.answer} {letters}") == 1.0
    assert before.filler_place == "before"
    for bad in ("end", "", None):
        with pytest.raises(
            ValueError, match=rf"filler_place must be one of \('before', 'after'\), got {bad!r}"
        ):
            Arithmetic(filler=3, filler_place=bad)


def test_arithmetic_one_digit_covers_zero():
    prompts = {ex.prompt for ex in _samples(Arithmetic(ops=("+",), max_digits=1), 400)}
    assert any("0" in p for p in prompts)


@pytest.mark.parametrize("ops", [("+",), ("-",), ("*",)])
def test_arithmetic_worked_steps_are_true_equations(ops):
    """Every line but the last reads 'expr=value[ carry 1| borrow 1]' and is arithmetically true."""
    task = Arithmetic(ops=ops, min_digits=1, max_digits=5, show_work=True)
    for ex in _samples(task, 100):
        *steps, last = ex.demonstration.split("\n")
        assert last == "=" + ex.answer and steps
        for step in steps:
            equation = step.removesuffix(" carry 1").removesuffix(" borrow 1")
            left, right = equation.split("=")
            assert parse_expression(left)[0] == int(right), step


def _never():
    return False


def test_arithmetic_worked_examples():
    assert _add_steps(47, 385, _never) == (["7+5=12 carry 1", "4+8+1=13 carry 1", "3+1=4"], 432)
    assert _add_steps(95, 5, _never) == (["5+5=10 carry 1", "9+1=10 carry 1"], 100)
    assert _sub_steps(385, 47, _never) == (["10+5-7=8 borrow 1", "8-1-4=3", "3=3"], 338)
    assert _sub_steps(100, 99, _never) == (
        ["10+0-9=1 borrow 1", "10+0-1-9=0 borrow 1", "1-1=0"],
        1,
    )
    assert _mul_steps(385, 47) == ["385*7=2695", "385*40=15400", "2695+15400=18095"]
    assert _mul_steps(12, 101) == ["12*1=12", "12*100=1200", "12+1200=1212"]
    assert _mul_steps(12, 0) == ["12*0=0"]


def test_arithmetic_slips_drop_carries_and_borrows():
    """A slipped carry is announced but not added; a slipped borrow is not taken."""
    slips = iter([True, False]).__next__  # drop the first carry, keep the second
    assert _add_steps(47, 385, slips) == (["7+5=12 carry 1", "4+8=12 carry 1", "3+1=4"], 422)
    assert _add_steps(95, 5, lambda: True) == (["5+5=10 carry 1", "9=9"], 90)
    assert _sub_steps(385, 47, lambda: True) == (["10+5-7=8 borrow 1", "8-4=4", "3=3"], 348)


def test_arithmetic_slip_rate_and_true_answers():
    """With slip p, a demonstration of a problem with exactly one carry or borrow is wrong with
    probability p (binomial check, 3.5 sigma), the answer is always the true result, and
    problems without a carry or borrow are always demonstrated correctly."""
    p, n = 0.7, 4000
    task = Arithmetic(ops=("+", "-"), min_digits=1, max_digits=2, slip=p)
    wrong = one_carry = 0
    for ex in _samples(task, n):
        a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)=", ex.prompt).groups()
        a, b = int(a), int(b)
        assert ex.answer == str(a + b if op == "+" else a - b)
        (a0, a1), (b0, b1) = divmod(a, 10)[::-1], divmod(b, 10)[::-1]
        if op == "+":
            if a0 + b0 >= 10 and a1 + b1 == 9:
                continue  # a chained carry: whether the second exists depends on the first slip
            carries = (a0 + b0 >= 10) + (a1 + b1 >= 10)
        else:
            carries = int(a0 < b0)  # two digits at most: only the units can borrow
        if carries == 0:
            assert ex.demonstration == ex.answer, ex
        elif carries == 1:
            one_carry += 1
            wrong += ex.demonstration != ex.answer
    assert one_carry > 1000
    assert abs(wrong / one_carry - p) < 3.5 * (p * (1 - p) / one_carry) ** 0.5


def test_arithmetic_slip_changes_demonstrations_only():
    """Slips are drawn after the operands: the prompts and answers of a stream do not depend on
    ``slip``, only the demonstrations do."""
    exact = _samples(Arithmetic(ops=("+", "-")), 200)
    careless = _samples(Arithmetic(ops=("+", "-"), slip=0.9), 200)
    assert [(e.prompt, e.answer) for e in exact] == [(e.prompt, e.answer) for e in careless]
    assert all(e.demonstration == e.answer for e in exact)
    assert sum(e.demonstration != e.answer for e in careless) > 40


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"slip": 1.5}, "slip"),
        ({"slip": -0.1}, "slip"),
        ({"ops": ("/",)}, "unknown op '/'"),
        ({"ops": ()}, "non-empty"),
        ({"ops": ("+", "+")}, "duplicates"),
        ({"min_digits": 0}, "min_digits"),
        ({"min_digits": 3, "max_digits": 2}, "max_digits"),
    ],
)
def test_arithmetic_rejects_bad_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Arithmetic(**kwargs)


# ---------------------------------------------------------------- countdown

_CD = Example(prompt="25 5 4 to 80=", answer="80", demonstration="(25-5)*4")


@pytest.mark.parametrize(
    "response, reward",
    [
        ("(25-5)*4", 1.0),
        ("4*(25-5)", 1.0),
        (" ( 25 - 5 ) * 4 ", 1.0),
        ("(25-5)*4\n", 1.0),
        ("25-5=20\n20*4=80\n(25-5)*4", 1.0),  # worked steps, expression on the last line
        ("(25+5)*4", 0.1),  # well-formed, wrong value
        ("25*4-5*4", 0.1),  # reuses 4
        ("25*4-20", 0.1),  # 20 is not a given number; 5 and 4 missing
        ("(25-5)*4*1", 0.1),  # extra number
        ("25*4", 0.1),  # misses 5
        ("(25-5)*4/(5-5)", 0.1),  # division by zero is well-formed but wrong (as TinyZero)
        ("(25-5*4", 0.0),  # unbalanced
        ("25-5)*4", 0.0),
        ("(25-5)*4)", 0.0),
        ("()", 0.0),
        ("-5+25*4", 0.0),  # no unary minus
        ("+(25-5)*4", 0.0),  # no unary plus
        ("(25-5)*4=80", 0.0),  # the last line must be the expression alone
        ("(25-5)**4", 0.0),
        ("(25-5)x4", 0.0),
        ("2.5*32", 0.0),  # no decimals
        ("(25-5)*4\nnot sure", 0.0),  # last line is prose
        ("", 0.0),
        ("\n\n", 0.0),
    ],
)
def test_countdown_reward(response, reward):
    assert Countdown().reward(_CD, response) == reward


def test_countdown_division_by_zero_with_exact_numbers_is_wrong():
    ex = Example(prompt="6 3 3 to 2=", answer="2", demonstration="6/(3)")
    assert Countdown().reward(ex, "6/(3-3)") == 0.1
    assert Countdown().reward(ex, "6/3*3/3") == 0.1  # 6, 3, 3, 3 reuses 3


def test_countdown_allows_fractional_intermediates():
    ex = Example(prompt="4 3 3 to 4=", answer="4", demonstration="4/3*3")
    assert Countdown().reward(ex, "4/3*3") == 1.0
    assert Countdown().reward(ex, "4/(3*3)") == 0.1


def test_countdown_parser_is_bounded():
    assert Countdown().reward(_CD, "(" * 1000 + "80" + ")" * 1000) == 0.0
    with pytest.raises(ParseError):
        parse_expression("1" * 101)
    assert parse_expression("(" * 64 + "7" + ")" * 64) == (Fraction(7), [7])


@pytest.mark.parametrize(
    "text, value",
    [("2+3*4", 14), ("(2+3)*4", 20), ("8-3-2", 3), ("8-(3-2)", 7), ("8/4/2", 1), ("8/(4/2)", 4)],
)
def test_parse_expression_precedence_and_associativity(text, value):
    assert parse_expression(text)[0] == value


def test_parse_expression_reports_numbers_and_division_by_zero():
    assert parse_expression("1/(2-2)+7") == (None, [1, 2, 2, 7])
    assert parse_expression("007+1") == (Fraction(8), [7, 1])
    with pytest.raises(ParseError, match="unexpected"):
        parse_expression("1 2")


_leaf = st.integers(0, 50).map(lambda n: (str(n), Fraction(n)))


def _node(children):
    def combine(args):
        (lt, lv), op, (rt, rv) = args
        if op == "/" and rv == 0:
            return (f"({lt})-({lt})", Fraction(0))
        value = {"+": lv + rv, "-": lv - rv, "*": lv * rv, "/": lv / rv if rv else 0}[op]
        return (f"({lt}){op}({rt})", value)

    return st.tuples(children, st.sampled_from("+-*/"), children).map(combine)


@settings(max_examples=200, deadline=None)
@given(st.recursive(_leaf, _node, max_leaves=8))
def test_parse_expression_matches_exact_arithmetic(tree):
    text, value = tree
    assert parse_expression(text)[0] == value


def test_countdown_instances_are_valid():
    task = Countdown(min_numbers=3, max_numbers=4, max_number=50, max_target=500)
    for ex in _samples(task):
        numbers = [int(n) for n in ex.prompt.split(" to ")[0].split()]
        assert 3 <= len(numbers) <= 4 and all(1 <= n <= 50 for n in numbers)
        assert 1 <= int(ex.answer) <= 500 and ex.prompt.endswith(f" to {ex.answer}=")
        value, used = parse_expression(ex.demonstration)
        assert value == int(ex.answer) and sorted(used) == sorted(numbers)


def test_countdown_worked_steps_use_positive_integers():
    for ex in _samples(Countdown(show_work=True), 100):
        *steps, expression = ex.demonstration.split("\n")
        assert parse_expression(expression)[0] == int(ex.answer)
        for step in steps:
            left, right = step.split("=")
            assert int(right) >= 1 and parse_expression(left)[0] == int(right)
        assert steps[-1].endswith("=" + ex.answer)


def test_countdown_slip_swaps_subtractions_and_divisions_only():
    """With slip p the prompts and answers of a stream are those of slip 0; a two-number
    demonstration ``a-b`` or ``a/b`` (a != b) is written ``b-a`` / ``b/a`` (missing the target:
    0.1) with probability p (binomial check, 3.5 sigma), one with + or * never; slip 1 swaps
    every - and / of a worked three-number demonstration, in its lines too."""
    p, n = 0.7, 3000
    exact = _samples(Countdown(min_numbers=2, max_numbers=2, max_number=9), n)
    careless = _samples(Countdown(min_numbers=2, max_numbers=2, max_number=9, slip=p), n)
    assert [(e.prompt, e.answer) for e in exact] == [(e.prompt, e.answer) for e in careless]
    task = Countdown(min_numbers=2, max_numbers=2, max_number=9)
    swapped = with_op = 0
    for e, c in zip(exact, careless, strict=True):
        assert task.reward(e, e.demonstration) == 1.0
        a, op, b = re.fullmatch(r"(\d+)([-+*/])(\d+)", e.demonstration).groups()
        if op in "+*" or a == b:  # a swapped a/a reads the same
            assert c.demonstration == e.demonstration
            continue
        with_op += 1
        if c.demonstration != e.demonstration:
            assert c.demonstration == f"{b}{op}{a}" and task.reward(c, c.demonstration) == 0.1
            swapped += 1
    assert with_op > 800
    assert abs(swapped / with_op - p) < 3.5 * (p * (1 - p) / with_op) ** 0.5
    worked = Countdown(min_numbers=3, max_numbers=3, max_number=9, show_work=True)
    for e, c in zip(_samples(worked), _samples(dataclasses.replace(worked, slip=1.0)), strict=True):
        *steps, expression = e.demonstration.split("\n")
        *c_steps, c_expression = c.demonstration.split("\n")
        for step, c_step in zip(steps, c_steps, strict=True):
            a, op, b, v = re.fullmatch(r"(\d+)([-+*/])(\d+)=(\d+)", step).groups()
            assert c_step == (f"{b}{op}{a}={v}" if op in "-/" else step)
        if not any(op in expression for op in "-/"):
            assert c_expression == expression


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"slip": 1.5}, "slip"),
        ({"slip": -0.1}, "slip"),
        ({"min_numbers": 1}, "min_numbers"),
        ({"min_numbers": 4, "max_numbers": 3}, "max_numbers"),
        ({"min_number": 0}, "min_number"),
        ({"min_number": 9, "max_number": 3}, "max_number"),
        ({"max_target": 0}, "max_target"),
    ],
)
def test_countdown_rejects_bad_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Countdown(**kwargs)


# ---------------------------------------------------------------- sudoku

_SOLUTION = "1234341221434321"
_SD = Example(prompt="1.34|34.2|2.43|.3.1=", answer=_SOLUTION, demonstration="1234|3412|2143|4321")


@pytest.mark.parametrize(
    "response, reward",
    [
        ("1234|3412|2143|4321", 1.0),
        ("1234341221434321", 1.0),
        ("1234 3412 2143 4321", 1.0),
        ("thinking\n1234|3412|2143|4321", 1.0),
        ("1234|3412|2143|4321\n", 1.0),
        ("1134|3412|2143|4321", 0.8),  # one of five blanks wrong
        ("4234|3412|2143|4321", 1.0),  # a changed given is not scored
        ("1334|3422|2243|1311", 0.0),  # every blank wrong
        ("1234|3412|2143|432", 0.0),  # 15 digits
        ("1234|3412|2143|43215", 0.0),  # 17 digits
        ("1234|3412|2143|4325", 0.0),  # 5 is not a Sudoku digit
        ("1234|3412|2143|4321\nok", 0.0),  # last line is not the grid
        ("", 0.0),
    ],
)
def test_sudoku_reward(response, reward):
    assert Sudoku().reward(_SD, response) == reward


@pytest.mark.parametrize("n_blank", [1, 6, 12])
def test_sudoku_puzzles_are_unique_and_consistent(n_blank):
    for ex in _samples(Sudoku(n_blank=n_blank), 50):
        cells = ex.prompt.removesuffix("=").replace("|", "")
        assert cells.count(".") == n_blank
        assert all(c == "." or c == s for c, s in zip(cells, ex.answer, strict=True))
        puzzle = [0 if c == "." else int(c) for c in cells]
        assert count_solutions(puzzle, limit=3) == 1
        assert _is_valid_grid(ex.answer)


def _is_valid_grid(grid):
    rows = [grid[4 * r : 4 * r + 4] for r in range(4)]
    cols = ["".join(row[c] for row in rows) for c in range(4)]
    boxes = [
        "".join(rows[r + i][c + j] for i in (0, 1) for j in (0, 1)) for r in (0, 2) for c in (0, 2)
    ]
    return all(sorted(group) == list("1234") for group in rows + cols + boxes)


def test_count_solutions():
    assert count_solutions([0] * 16, limit=1000) == 288  # all 4x4 Sudoku grids
    assert count_solutions([int(c) for c in _SOLUTION]) == 1
    assert count_solutions([1, 1] + [0] * 14) == 0


@pytest.mark.parametrize("n_blank", [0, 13])
def test_sudoku_rejects_bad_n_blank(n_blank):
    with pytest.raises(ValueError, match=r"n_blank must be in \[1, 12\]"):
        Sudoku(n_blank=n_blank)


# ---------------------------------------------------------------- answers (GSM8K / MATH)


@pytest.mark.parametrize(
    "text, value",
    [
        ("42", 42),
        ("-7", -7),
        ("1,234", 1234),
        (" 1,234.50 ", Fraction(2469, 2)),
        ("0.5", Fraction(1, 2)),
        ("1,23", None),  # not a thousands separator
        ("3/4", None),  # ground truths are plain numbers; fractions are read by final_number
        ("x", None),
        ("", None),
    ],
)
def test_parse_number(text, value):
    assert parse_number(text) == value


@pytest.mark.parametrize(
    "text, value",
    [
        ("42", 42),
        ("$1,234.50.", Fraction(2469, 2)),
        ("\\$1{,}234", 1234),
        ("1\\,234\\,567", 1234567),
        ("\u22125 degrees", -5),
        ("3/4 of a cup", Fraction(3, 4)),
        ("\\frac{3}{4}", Fraction(3, 4)),
        ("-\\dfrac{1}{2}", Fraction(-1, 2)),
        ("\\tfrac{6}{4}", Fraction(3, 2)),
        ("3 \\times 6 = 18 \\text{ apples}", 18),
        ("x = -3", -3),
        ("25\\%", 25),
        ("1/0", None),
        ("\\frac{1}{0}", None),
        ("**72**", 72),
        ("The answer is 72.", 72),
        ("\\sqrt{2}", None),  # operands are not stated answers
        ("\\sqrt[3]{8}", None),
        ("2^{10}", None),
        ("48 + 24", None),
        ("3 \\times 6", None),
        ("\\text{forty-two}", None),
        ("", None),
    ],
)
def test_final_number(text, value):
    assert final_number(text) == value


@settings(max_examples=100, deadline=None)
@given(st.integers(-10_000, 10_000), st.integers(1, 10_000))
def test_fraction_spellings_agree(p, q):
    value = Fraction(p, q)
    spellings = [f"{p}/{q}", f"\\frac{{{p}}}{{{q}}}", f"x = {p}/{q}"]
    if value.denominator in (1, 2, 4, 5, 8, 10):
        spellings.append(f"{float(value):.4f}")
    if value.denominator == 1:
        spellings.append(f"${value.numerator:,}.00 in total")
    for spelling in spellings:
        assert final_number(spelling) == value, spelling


def test_final_answer_is_the_last_box_or_hashes():
    assert final_answer_text("so 5 and \\boxed{\\frac{3}{4}} then 9") == "\\frac{3}{4}"
    assert final_answer_text("3*8=24 #### 1,024 apples. 7\nbye") == "1,024 apples. 7"
    assert final_answer_text("#### 5 then \\boxed{6}") == "6"
    assert final_answer_text("\\boxed{6} then #### 5") == "5"
    assert final_answer_text("####\n\n  42\n") == "42"
    assert final_answer_text("it is 12, not 13.") is None  # no marker: no answer
    assert final_answer_text("#### 5 then \\boxed{6") is None  # the last box is cut off
    assert final_answer_text("ends in ####") is None
    assert last_boxed("\\boxed{\\frac{1}{2}") is None  # unbalanced
    assert last_boxed("\\fbox{7}") == "7"
    assert last_boxed("\\boxed {  x^{2}  }") == "x^{2}"


def _write(tmp_path, lines, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return path


_GSM = [
    json.dumps(
        {"question": "Ann has 3 apples and buys 4. How many?", "answer": "3+4=<<3+4=7>>7\n#### 7"}
    ),
    json.dumps({"question": "How many cents in $10.24?", "answer": "10.24*100=1024\n#### 1,024"}),
]
_MATH = [
    json.dumps({"problem": "Simplify 6/8.", "solution": "Divide: $\\boxed{\\frac{3}{4}}$."}),
    json.dumps({"problem": "2+2?", "solution": "It is \\boxed{4}."}),
]


def test_gsm8k_loading_and_reward(tmp_path):
    task = load_gsm8k(_write(tmp_path, _GSM))
    assert task.name == "gsm8k" and len(task.examples) == 2 and task.verifier is gsm8k_reward
    first, second = task.examples
    question = "Ann has 3 apples and buys 4. How many?"
    assert first.prompt == f"{question} {GSM8K_INSTRUCTION}"  # verl's user message
    assert first.messages == ({"role": "user", "content": first.prompt},)
    assert first.answer == "7" and second.answer == "1024"
    assert "<<" not in first.demonstration and first.demonstration.endswith("#### 7")
    for response, reward in [
        ("#### 7", 1.0),
        ("3 + 4 = 7\n#### 7 apples.", 1.0),
        ("So she has $\\boxed{7}$ apples.", 1.0),
        ("#### 7.0", 1.0),
        ("#### 7\nmaybe #### 8", 0.0),  # the last #### counts
        ("3 plus 4 is 7.", 0.0),  # no final-answer marker
        ("#### 8", 0.0),
        ("", 0.0),
    ]:
        assert task.reward(first, response) == reward, response
    assert task.reward(second, "#### 1,024") == task.reward(second, "\\boxed{1024}") == 1.0
    for ex in task.examples:
        assert task.reward(ex, ex.demonstration) == 1.0


def test_math_loading_and_reward(tmp_path):
    task = load_math(_write(tmp_path, _MATH))
    first = task.examples[0]
    assert task.name == "math" and first.answer == "\\frac{3}{4}" and task.verifier is math_reward
    assert first.prompt == f"Simplify 6/8. {MATH_INSTRUCTION}"
    assert first.messages == ({"role": "user", "content": first.prompt},)
    for response, reward in [
        ("\\boxed{\\frac{3}{4}}", 1.0),
        ("\\boxed{\\dfrac{3}{4}}", 1.0),
        ("\\boxed{0.75}", 1.0),
        ("\\boxed{3/4}", 1.0),
        ("the answer is 3/4", 0.0),  # no box: no answer
        ("\\boxed{3/5}", 0.0),
        ("\\boxed{\\frac{3}{4}", 0.0),  # cut off
    ]:
        assert task.reward(first, response) == reward, response
    for ex in task.examples:
        assert task.reward(ex, ex.demonstration) == 1.0


def test_chat_format_options(tmp_path):
    """System prompt, instruction and thinking switch reach the messages; the defaults and the
    plain-text prompt are verl's; an empty or null instruction leaves the bare question."""
    path = _write(tmp_path, _GSM)
    task = load_gsm8k(path, system_prompt="You are a careful solver.", enable_thinking=False)
    ex = task.examples[0]
    assert ex.messages == (
        {"role": "system", "content": "You are a careful solver."},
        {"role": "user", "content": f"{ex.prompt}"},
    )
    assert task.chat.template_kwargs == {"enable_thinking": False}
    assert load_gsm8k(path).chat == ChatFormat(instruction=GSM8K_INSTRUCTION)
    assert load_gsm8k(path).chat.template_kwargs == {}
    for bare in (None, ""):
        ex = load_gsm8k(path, instruction=bare).examples[1]
        assert ex.prompt == "How many cents in $10.24?"
        assert ex.messages == ({"role": "user", "content": ex.prompt},)
    task = make_task("math", path=_write(tmp_path, _MATH, "m.jsonl"), instruction="Box it.")
    assert task.examples[1].prompt == "2+2? Box it."
    with pytest.raises(TypeError, match="enable_thinking must be true, false or null"):
        load_gsm8k(path, enable_thinking="no")
    with pytest.raises(TypeError, match="instruction must be a string or None, got 3"):
        load_math(_write(tmp_path, _MATH, "m.jsonl"), instruction=3)


def test_jsonl_task_sample_is_deterministic(tmp_path):
    task = load_gsm8k(_write(tmp_path, _GSM))
    picks = [task.sample(random.Random(s)).answer for s in range(20)]
    assert picks == [task.sample(random.Random(s)).answer for s in range(20)]
    assert set(picks) == {"7", "1024"}


@pytest.mark.parametrize(
    "bad, message",
    [
        ('{"question": "q", "answer": "#### 1"', "invalid JSON"),
        ('["q", "#### 1"]', "expected a JSON object, got list"),
        ('{"question": "q"}', "missing key 'answer'"),
        ('{"question": "q", "answer": 1}', "key 'answer' must be a string, got int"),
        ('{"question": "q", "answer": "1"}', "no '#### <final answer>' marker"),
        ('{"question": "q", "answer": "so ####  "}', "nothing after '####'"),
    ],
)
def test_gsm8k_malformed_line_names_file_and_line(tmp_path, bad, message):
    path = _write(tmp_path, [_GSM[0], "", bad, _GSM[1]])  # line 2 blank, line 3 bad
    with pytest.raises(ValueError, match=f"data.jsonl:3: .*{message}"):
        load_gsm8k(path)


def test_math_without_boxed_is_an_error(tmp_path):
    path = _write(tmp_path, [_MATH[0], json.dumps({"problem": "p", "solution": "no box"})])
    with pytest.raises(ValueError, match=r"data.jsonl:2: .*no balanced \\boxed"):
        load_math(path)


def test_skip_policy_warns_with_line_numbers_and_keeps_the_rest(tmp_path):
    path = _write(tmp_path, [_GSM[0], "{oops", _GSM[1], '{"question": "q"}'])
    with pytest.warns(UserWarning, match=r"skipped 2 malformed line\(s\): line 2 .*line 4 "):
        task = load_gsm8k(path, on_error="skip")
    assert [ex.answer for ex in task.examples] == ["7", "1024"]


def test_empty_and_all_bad_files_are_errors(tmp_path):
    for lines in ([], ["", "  "]):
        path = _write(tmp_path, lines, name="empty.jsonl")
        with pytest.raises(ValueError, match=r"empty.jsonl is empty"):
            load_gsm8k(path)
    path = _write(tmp_path, ["{", "}"], name="bad.jsonl")
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="bad.jsonl: no valid"):
        load_gsm8k(path, on_error="skip")
    with pytest.raises(ValueError, match=r"on_error must be one of \('raise', 'skip'\)"):
        load_gsm8k(path, on_error="drop")
    with pytest.raises(ValueError, match="at least one example"):
        JsonlTask(name="x", examples=(), verifier=gsm8k_reward)


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_ids_are_fixed():
    tok = CharTokenizer()
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 78)
    assert tok.chat_template is None and tok.eos_ids == (tok.eos_id,)  # plain-text prompts
    assert tok.encode("\n 09=|Aa") == [3, 4, 14, 23, 24, 25, 26, 52]
    assert tok.vocab_size <= 128


@given(st.text(alphabet="\n #()*+,-./0123456789=|abcXYZ", max_size=50))
def test_tokenizer_round_trip(text):
    tok = CharTokenizer()
    ids = tok.encode(text)
    assert len(ids) == len(text) and all(3 <= i < tok.vocab_size for i in ids)
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == text


def test_tokenizer_errors_and_specials():
    tok = CharTokenizer()
    with pytest.raises(ValueError, match=r"character '\?' at position 3 of '12\+\?'"):
        tok.encode("12+?")
    with pytest.raises(ValueError, match=r"token id 78 at position 1"):
        tok.decode([5, 78])
    assert tok.decode([1, 14, 2, 0], skip_special=False) == "<bos>0<eos><pad>"


# ---------------------------------------------------------------- make_task


def test_make_task_builds_every_synthetic_task():
    assert make_task("arithmetic", max_digits=5) == Arithmetic(max_digits=5)
    assert make_task("arithmetic", ops=["+", "*"]).ops == ("+", "*")  # YAML lists become tuples
    assert make_task("countdown") == Countdown()
    assert make_task("sudoku", n_blank=4) == Sudoku(n_blank=4)
    assert {"arithmetic", "countdown", "sudoku"} <= set(TASKS)


def test_make_task_loads_jsonl(tmp_path):
    task = make_task("gsm8k", path=_write(tmp_path, _GSM))
    assert isinstance(task, JsonlTask) and len(task.examples) == 2
    task = make_task("gsm8k", path=_write(tmp_path, _GSM), instruction=None, enable_thinking=False)
    assert task.examples[0].prompt == "Ann has 3 apples and buys 4. How many?"
    assert task.chat.template_kwargs == {"enable_thinking": False}
    with pytest.raises(ValueError, match=r"unknown argument\(s\) \['system'\] .*'system_prompt'"):
        make_task("gsm8k", path=_write(tmp_path, _GSM), system="x")


def test_make_task_errors_list_valid_choices():
    with pytest.raises(ValueError, match=r"unknown task 'sodoku'; valid names are \['arithmetic'"):
        make_task("sodoku")
    with pytest.raises(ValueError, match=r"unknown argument\(s\) \['digits'\] .*'max_digits'"):
        make_task("arithmetic", digits=3)
    with pytest.raises(ValueError, match=r"needs argument\(s\) \['path'\]"):
        make_task("math")
