"""Specifications of the grain prompt pipelines: determinism, resumption, splits."""

import ast
import collections
import json
import pathlib
import random

import grain
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ais_jax.tasks import Arithmetic, Countdown, Example, Sudoku, load_gsm8k
from ais_jax.train import data
from ais_jax.train.data import (
    SPLITS,
    demonstration_batches,
    eval_examples,
    example_dataset,
    example_seed,
    prompt_batches,
    prompt_dataset,
)


def _take(iterator, n):
    return [next(iterator) for _ in range(n)]


def _gsm8k(tmp_path, n=10):
    path = tmp_path / "gsm8k.jsonl"
    lines = [
        json.dumps({"question": f"What is {i}+1?", "answer": f"#### {i + 1}"}) for i in range(n)
    ]
    path.write_text("\n".join(lines) + "\n")
    return load_gsm8k(path)


@pytest.mark.parametrize("task", [Arithmetic(), Countdown(), Sudoku()], ids=lambda t: t.name)
def test_state_round_trip(task):
    kwargs = dict(seed=7, batch_size=4, num_examples=1000)
    it = prompt_batches(task, **kwargs)
    _take(it, 3)
    state = it.get_state()
    expected = _take(it, 2)
    fresh = prompt_batches(task, **kwargs)
    fresh.set_state(state)
    assert _take(fresh, 2) == expected


def test_batches_are_tuples_of_examples():
    batch = next(prompt_batches(Arithmetic(), seed=0, batch_size=5, num_examples=100))
    assert isinstance(batch, tuple) and len(batch) == 5
    assert all(isinstance(ex, Example) for ex in batch)


def test_deterministic_given_seed_and_sensitive_to_it():
    def first(seed):
        return _take(prompt_batches(Arithmetic(), seed=seed, batch_size=8, num_examples=10**6), 3)

    assert first(0) == first(0)
    assert first(0) != first(1)


def test_prefetching_threads_do_not_change_the_stream():
    kwargs = dict(seed=3, batch_size=4, num_examples=500)
    threaded = prompt_batches(
        Countdown(), read_options=grain.ReadOptions(num_threads=4, prefetch_buffer_size=8), **kwargs
    )
    assert _take(threaded, 10) == _take(prompt_batches(Countdown(), **kwargs), 10)


def test_each_epoch_is_a_fresh_permutation_of_the_pool():
    pool = 12
    it = prompt_batches(
        Arithmetic(min_digits=4, max_digits=6), seed=0, batch_size=4, num_examples=pool
    )
    first = [ex for batch in _take(it, 3) for ex in batch]
    second = [ex for batch in _take(it, 3) for ex in batch]
    expected = list(
        example_dataset(Arithmetic(min_digits=4, max_digits=6), seed=0, num_examples=pool)
    )
    assert (
        collections.Counter(first) == collections.Counter(second) == collections.Counter(expected)
    )
    assert first != second


def test_batches_span_epochs_and_finite_epochs_drop_the_remainder():
    task = Arithmetic(min_digits=5, max_digits=5)
    batches = list(prompt_batches(task, seed=0, batch_size=4, num_examples=10, num_epochs=2))
    assert len(batches) == 5  # 20 examples -> 5 full batches, batch 3 spans the epoch boundary
    assert collections.Counter(ex for b in batches for ex in b) == collections.Counter(
        ex for ex in example_dataset(task, seed=0, num_examples=10) for _ in range(2)
    )
    batches = list(prompt_batches(task, seed=0, batch_size=4, num_examples=10, num_epochs=1))
    assert len(batches) == 2  # the last 2 examples would make a partial batch


def test_example_i_is_a_pure_function_of_seed_split_and_index():
    task = Countdown()
    ds = example_dataset(task, seed=5, split="sft", num_examples=100)
    assert ds[42] == example_dataset(task, seed=5, split="sft", num_examples=43)[42]  # any pool
    assert ds[42] == task.sample(random.Random(example_seed(5, "sft", 42)))
    assert ds[42] != example_dataset(task, seed=5, split="train", num_examples=100)[42]


@given(
    st.tuples(st.integers(0, 2**32 - 1), st.sampled_from(SPLITS), st.integers(0, 2**64 - 1)),
    st.tuples(st.integers(0, 2**32 - 1), st.sampled_from(SPLITS), st.integers(0, 2**64 - 1)),
)
def test_example_seed_is_injective(a, b):
    assert (example_seed(*a) == example_seed(*b)) == (a == b)


def test_eval_split_is_held_out_from_train_and_sft():
    task = Arithmetic(min_digits=6, max_digits=8)
    held_out = {ex.prompt for ex in eval_examples(task, seed=0, num_examples=200)}
    train = {
        ex.prompt
        for b in _take(prompt_batches(task, seed=0, batch_size=50, num_examples=10**9), 40)
        for ex in b
    }
    sft = {
        ex.prompt
        for b in _take(demonstration_batches(task, seed=0, batch_size=50, num_examples=10**9), 40)
        for ex in b
    }
    assert len(held_out) == 200 and len(train) == len(sft) == 2000
    assert not held_out & train and not held_out & sft and not train & sft


def test_eval_examples_are_fixed_and_ordered():
    task = Sudoku()
    examples = eval_examples(task, seed=1, num_examples=30)
    assert examples == eval_examples(task, seed=1, num_examples=30)
    assert examples[:10] == eval_examples(task, seed=1, num_examples=10)


def test_demonstration_batches_are_correct_responses():
    for task in (Arithmetic(show_work=True), Countdown(show_work=True), Sudoku()):
        for batch in _take(
            demonstration_batches(task, seed=0, batch_size=8, num_examples=10**6), 5
        ):
            assert all(task.reward(ex, ex.demonstration) == 1.0 for ex in batch)


def test_finite_task_batches_cover_the_file(tmp_path):
    task = _gsm8k(tmp_path, n=10)
    batches = list(prompt_batches(task, seed=0, batch_size=5, num_epochs=3))
    seen = collections.Counter(ex.answer for b in batches for ex in b)
    assert len(batches) == 6 and seen == collections.Counter({str(i + 1): 3 for i in range(10)})
    assert eval_examples(task, seed=0) == task.examples
    assert eval_examples(task, seed=0, num_examples=4) == task.examples[:4]
    it = prompt_batches(task, seed=0, batch_size=3)  # forever
    assert len(_take(it, 20)) == 20


def test_prompt_dataset_is_lazy_and_indexable():
    ds = prompt_dataset(Arithmetic(), seed=0, batch_size=3, num_examples=10**12)
    assert len(ds[10**9]) == 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_examples": None}, "num_examples .* is required"),
        ({"num_examples": 0}, r"num_examples must be in \[1, "),
        ({"seed": -1}, r"seed must be in \[0, 2\*\*32\)"),
        ({"split": "test"}, r"unknown split 'test'; valid splits are \('train', 'eval', 'sft'\)"),
        ({"batch_size": 0}, "batch_size must be >= 1"),
        ({"num_epochs": 0}, "num_epochs must be >= 1"),
        ({"num_examples": 3, "num_epochs": 1}, "cannot fill one batch of 4"),
    ],
)
def test_prompt_dataset_rejects_bad_arguments(kwargs, message):
    args = dict(seed=0, batch_size=4, num_examples=100, split="train") | kwargs
    with pytest.raises(ValueError, match=message):
        prompt_dataset(Arithmetic(), **args)


def test_finite_task_rejects_more_examples_than_it_has(tmp_path):
    with pytest.raises(ValueError, match=r"num_examples must be in \[1, 10\], got 11"):
        example_dataset(_gsm8k(tmp_path), seed=0, num_examples=11)


def test_data_module_does_not_import_jax():
    tree = ast.parse(pathlib.Path(data.__file__).read_text())
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    }
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any(name == "jax" or name.startswith("jax.") for name in imported)


@pytest.mark.slow
@pytest.mark.parametrize(
    "task",
    [Arithmetic(ops=("+", "-"), min_digits=1, max_digits=1), Arithmetic(ops=("+",), max_digits=2)],
    ids=["1-digit", "2-digit"],
)
def test_held_out_prompts_never_appear_in_training_streams(task):
    """Held out by construction: on a task small enough that every stream covers most of its
    155 or ~10,000 prompts, no train or SFT prompt is an eval prompt, and the eval set does not
    depend on the run seed."""
    held_out = {ex.prompt for ex in data.eval_examples(task, num_examples=400)}
    assert all(data.is_held_out(Example(prompt=p, answer="", demonstration="")) for p in held_out)
    for seed in (0, 1):
        for split in ("train", "sft"):
            stream = data.example_dataset(task, seed=seed, split=split, num_examples=3000)
            assert not held_out & {stream[i].prompt for i in range(len(stream))}
    assert data.eval_examples(task, num_examples=50) == data.eval_examples(
        task, seed=0, num_examples=50
    )
    assert len(held_out) >= 15  # the check above is not vacuous


def test_a_task_with_too_few_prompts_for_a_held_out_split_is_an_error():
    one_prompt = Arithmetic(ops=("+",), min_digits=1, max_digits=1)
    one_prompt_sampler = type(
        "OnePrompt",
        (),
        {
            "name": "one",
            "sample": lambda self, rng: Example(prompt="1+1=", answer="2", demonstration="2"),
            "reward": one_prompt.reward,
        },
    )()
    side = (
        "eval"
        if not data.is_held_out(Example(prompt="1+1=", answer="", demonstration=""))
        else "train"
    )
    with pytest.raises(ValueError, match="too few distinct prompts"):
        data.example_dataset(one_prompt_sampler, seed=0, split=side, num_examples=1)[0]


# ---- between examples and arrays ----------------------------------------------------------------


def test_prompts_are_left_padded_and_responses_right_padded_with_eos():
    from ais_jax.tasks import CharTokenizer

    tok = CharTokenizer()
    prompts, prompt_mask = data.encode_prompts(tok, ["1+2=", "10+20="], 8)
    bos = [tok.bos_id] if getattr(tok, "bos_id", None) is not None else []
    for row, text in enumerate(["1+2=", "10+20="]):
        ids = bos + tok.encode(text)
        assert prompts[row, 8 - len(ids) :].tolist() == ids
        assert prompt_mask[row].tolist() == [False] * (8 - len(ids)) + [True] * len(ids)
        assert (prompts[row, : 8 - len(ids)] == tok.pad_id).all()
    tokens, mask = data.encode_responses(tok, ["3", "30"], 4)
    assert tokens[1, :3].tolist() == tok.encode("30") + [tok.eos_id]
    assert mask.sum(axis=1).tolist() == [2, 3] and (tokens[0, 2:] == tok.pad_id).all()
    # decoding the first `length` tokens of each row gives the text back (EOS excluded)
    assert data.decode_responses(tok, tokens, mask.sum(axis=1) - 1) == ["3", "30"]
    # a tokenizer without a chat template prompts an example with its plain text
    chat = Example(
        prompt="1+2=",
        answer="3",
        demonstration="3",
        messages=({"role": "user", "content": "1+2="},),
    )
    np.testing.assert_array_equal(data.encode_prompts(tok, [chat, "10+20="], 8)[0], prompts)


@pytest.mark.slow
def test_trimming_drops_only_padding_and_keeps_the_log_probs():
    """The SFT batch without the columns no row uses: a power-of-two width, every valid token
    kept, and the same response log-probs as the padded batch (positions come from the mask)."""
    import jax
    from training_run import MODEL

    from ais_jax import models as model
    from ais_jax.tasks import CharTokenizer
    from ais_jax.train import logprobs

    tok = CharTokenizer()
    prompts, prompt_mask = data.encode_prompts(tok, ["1+2=", "10+20=", "7-3="], 12)
    tokens, mask = data.encode_responses(tok, ["3", "30", "4"], 8)
    short_prompts, short_prompt_mask = data.trim_padding(prompts, prompt_mask, left=True)
    short_tokens, short_mask = data.trim_padding(tokens, mask, left=False)
    assert short_prompts.shape == (3, 8) and prompt_mask.sum(axis=1).max() == 7  # BOS + 6
    assert short_tokens.shape == (3, 4) and mask.sum(axis=1).max() == 3
    pairs = [(prompts, prompt_mask, short_prompts, short_prompt_mask)]
    pairs += [(tokens, mask, short_tokens, short_mask)]
    for full, full_mask, short, short_mask_ in pairs:  # each row keeps its tokens, in order
        for row in range(3):
            assert full[row][full_mask[row]].tolist() == short[row][short_mask_[row]].tolist()
    # a row as long as L keeps L; all padding keeps one column
    assert data.trim_padding(tokens[:, :3], mask[:, :3], left=False)[0].shape == (3, 3)
    assert data.trim_padding(tokens, np.zeros_like(mask), left=False)[0].shape == (3, 1)

    params = model.init_params(MODEL, jax.random.key(0))
    full_logp = logprobs.token_logprobs(params, MODEL, prompts, prompt_mask, tokens, mask)
    short_logp = logprobs.token_logprobs(
        params, MODEL, short_prompts, short_prompt_mask, short_tokens, short_mask
    )
    assert np.abs(np.asarray(full_logp)).min(where=mask, initial=np.inf) > 0.1
    np.testing.assert_allclose(short_logp, np.asarray(full_logp)[:, :4], rtol=1e-6, atol=1e-6)
    assert not np.asarray(full_logp)[:, 4:].any()


def test_texts_that_do_not_fit_name_the_setting_to_raise():
    from ais_jax.tasks import CharTokenizer

    tok = CharTokenizer()
    with pytest.raises(ValueError, match="more than rollout.max_prompt_len=3"):
        data.encode_prompts(tok, ["1+2="], 3)
    with pytest.raises(ValueError, match=r"\(with EOS\), more than rollout.max_new_tokens=2"):
        data.encode_responses(tok, ["30"], 2)


def test_every_process_needs_an_equal_share_of_each_batch():
    data.check_per_host({"rollout.prompts_per_step": 16, "sft.batch_size": 64}, 4)
    with pytest.raises(ValueError, match=r"sft.batch_size=6 is not divisible by .* \(4\)"):
        data.check_per_host({"rollout.prompts_per_step": 16, "sft.batch_size": 6}, 4)
