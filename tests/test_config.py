"""Specifications of the run configuration (config.py): YAML maps strictly onto frozen
dataclasses, and every bad key or value is an error that names it and says what is allowed."""

from __future__ import annotations

import dataclasses
import random
import re
from pathlib import Path

import pytest

from ais_jax.cli.main import default_config_path
from ais_jax.config import (
    CORRECTIONS,
    RESUMABLE,
    ROLLOUT_FORMATS,
    CorrectionConfig,
    LossConfig,
    RolloutConfig,
    TrainConfig,
    apply_overrides,
    changed_settings,
    check_resume,
    dump_config,
    from_dict,
    load_config,
)


def load_yaml(tmp_path, text: str, overrides=()) -> TrainConfig:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return load_config(path, list(overrides))


def check_error(data: dict, *fragments: str) -> str:
    """``from_dict(TrainConfig, data)`` raises a ValueError whose one-line message holds every
    fragment (compared literally)."""
    with pytest.raises(ValueError) as err:
        from_dict(TrainConfig, data)
    message = str(err.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


# ---- the shipped config and round trips ---------------------------------------------------------


def test_quickstart_yaml_loads():
    cfg = load_config(default_config_path())
    assert cfg.rollout.format == "float8_e4m3fn" and cfg.correction.method == "ais"
    assert cfg.model.preset == "tiny" and cfg.task.name == "arithmetic"
    assert isinstance(cfg.optim.learning_rate, float) and cfg.optim.learning_rate > 0
    batch = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    assert batch % cfg.optim.minibatches == 0


@pytest.mark.parametrize(
    "path", sorted((Path(__file__).parent.parent / "configs").glob("*.yaml")), ids=lambda p: p.stem
)
def test_every_shipped_config_loads_and_builds_its_task(path):
    """A typo in a shipped config's keys or task options fails here, not after its warm start."""
    from ais_jax.tasks.catalog import make_task

    cfg = load_config(path)
    if "/path/to/" in str(cfg.task.options):  # a dataset the user points it at: named if absent
        with pytest.raises(ValueError, match="'/path/to/.*' does not exist"):
            make_task(cfg.task.name, **cfg.task.options)
        return
    task = make_task(cfg.task.name, **cfg.task.options)
    example = task.sample(random.Random(0))
    assert example.prompt and task.reward(example, example.demonstration) in (0.0, 1.0)


def test_no_file_gives_the_defaults():
    assert load_config() == TrainConfig()


@pytest.mark.parametrize(
    "cfg",
    [
        TrainConfig(),
        load_config(default_config_path()),
        load_config(
            None,
            [
                "rollout.top_p=0.9",
                "rollout.top_k=5",
                "model.checkpoint=/some/dir",
                "model.num_layers=2",
                "correction.method=mis",
                "loss.kl_coef=0.01",
                "optim.schedule=cosine",
                "optim.learning_rate=3e-5",
                "task.options={ops: ['+', '*'], max_digits: 2}",
            ],
        ),
    ],
    ids=["defaults", "quickstart", "overridden"],
)
def test_dump_then_load_round_trips(tmp_path, cfg):
    text = dump_config(cfg)
    again = load_yaml(tmp_path, text)
    assert again == cfg
    assert dump_config(again) == text


def test_dumped_config_holds_every_field():
    data = TrainConfig().to_dict()
    for section in ("model", "task", "rollout", "correction", "loss", "optim", "sft"):
        assert set(data[section]) == {
            f.name for f in dataclasses.fields(type(getattr(TrainConfig(), section)))
        }


def test_configs_are_frozen_and_keyword_only():
    cfg = TrainConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.steps = 3
    with pytest.raises(TypeError):
        RolloutConfig("bf16")


# ---- unknown keys -------------------------------------------------------------------------------


def test_unknown_top_level_key_lists_the_valid_keys():
    message = check_error({"stepz": 3}, "'stepz'", "top level")
    for key in ("steps", "seed", "rollout", "correction", "optim"):
        assert repr(key) in message


def test_unknown_nested_key_names_its_path_and_the_valid_keys():
    message = check_error({"rollout": {"fromat": "bf16"}}, "'rollout.fromat'", "in rollout")
    for key in ("format", "group_size", "top_p", "temperature"):
        assert repr(key) in message


def test_section_that_is_not_a_mapping():
    check_error({"rollout": 8}, "rollout must be a mapping", "int")


def test_yaml_top_level_not_a_mapping(tmp_path):
    with pytest.raises(ValueError, match="config must be a mapping, got list"):
        load_yaml(tmp_path, "- steps\n- 3\n")


# ---- wrong types --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, fragments",
    [
        ({"rollout": {"group_size": "eight"}}, ["rollout.group_size='eight'", "expected int"]),
        ({"rollout": {"group_size": 4.0}}, ["rollout.group_size=4.0", "expected int"]),
        ({"steps": True}, ["steps=True", "expected int"]),
        ({"rollout": {"format": 8}}, ["rollout.format=8", "expected str"]),
        ({"rollout": {"fp8_lm_head": "no way"}}, ["rollout.fp8_lm_head='no way'", "expected bool"]),
        ({"rollout": {"temperature": "hot"}}, ["rollout.temperature='hot'", "expected a number"]),
        ({"optim": {"learning_rate": True}}, ["optim.learning_rate=True", "expected a number"]),
        ({"rollout": {"top_k": 2.5}}, ["rollout.top_k=2.5", "expected int"]),
        ({"task": {"options": [1, 2]}}, ["task.options", "mapping"]),
        (
            {"rollout": {"act_scaling": "channel"}},
            ["rollout.act_scaling='channel'", "['tensor', 'token']"],
        ),
        ({"optim": {"schedule": "linear"}}, ["optim.schedule='linear'", "['constant', 'cosine']"]),
        (
            {"rollout": {"decode_layout": "fast"}},
            [
                "rollout.decode_layout='fast'",
                "['auto', 'out_in_columns', 'out_in', 'out_in_columns_fused'",
            ],
        ),
    ],
)
def test_wrong_type_names_the_key_and_the_type(data, fragments):
    check_error(data, *fragments)


@pytest.mark.parametrize("raw", [".inf", "-.inf", ".nan", "inf", "nan"])
def test_non_finite_numbers_are_rejected(raw):
    with pytest.raises(ValueError, match=r"optim\.learning_rate=.*finite"):
        load_config(None, [f"optim.learning_rate={raw}"])


# ---- values out of range ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "section, key, value, allowed",
    [
        ("rollout", "group_size", -4, ">= 2"),
        ("rollout", "group_size", 1, ">= 2"),
        ("rollout", "group_size", 0, ">= 2"),
        ("rollout", "prompts_per_step", 0, ">= 1"),
        ("rollout", "max_new_tokens", 0, ">= 1"),
        ("rollout", "temperature", 0.0, "> 0"),
        ("rollout", "temperature", -1.0, "> 0"),
        ("rollout", "top_p", 0.0, "(0, 1]"),
        ("rollout", "top_p", 1.5, "(0, 1]"),
        ("rollout", "top_p", -0.1, "(0, 1]"),
        ("rollout", "top_k", 0, ">= 1"),
        ("correction", "clip", 0.0, ">= 1"),
        ("correction", "clip", -2.0, ">= 1"),
        ("correction", "clip", 0.5, ">= 1"),
        ("correction", "delta", 0.0, "> 0"),
        ("correction", "delta", -0.02, "> 0"),
        ("correction", "gamma", 0.0, "> 0"),
        ("correction", "gamma", -1.2, "> 0"),
        ("correction", "eps", 0.0, "> 0"),
        ("correction", "beta_var", -1.0, ">= 0"),
        ("loss", "kl_coef", -0.1, ">= 0"),
        ("optim", "learning_rate", 0.0, "> 0"),
        ("optim", "grad_clip", 0.0, "> 0"),
        ("optim", "ppo_epochs", 0, ">= 1"),
        ("optim", "minibatches", 0, ">= 1"),
        ("sft", "steps", -1, ">= 0"),
        ("task", "eval_examples", 0, ">= 1"),
    ],
)
def test_out_of_range_value_names_key_value_and_range(section, key, value, allowed):
    check_error({section: {key: value}}, f"{section}.{key}={value!r}", allowed)


@pytest.mark.parametrize(
    "data, fragments",
    [
        ({"steps": -1}, ["steps=-1", ">= 0"]),
        ({"checkpoint_every": 0}, ["checkpoint_every=0", ">= 1"]),
        ({"correction": {"low": 1.5}}, ["correction.low=1.5", "(0, 1]"]),
        ({"correction": {"low": 0.0}}, ["correction.low=0.0", "(0, 1]"]),
        ({"correction": {"high": 0.5}}, ["correction.high=0.5", ">= 1"]),
        ({"correction": {"level": "tokens"}}, ["correction.level='tokens'", "'sequence'"]),
        ({"loss": {"clip_low": -0.1}}, ["loss.clip_low=-0.1", "[0, 1)"]),
        ({"loss": {"clip_low": 1.0}}, ["loss.clip_low=1.0", "[0, 1)"]),
        ({"loss": {"clip_high": -0.2}}, ["loss.clip_high=-0.2", ">= 0"]),
        ({"loss": {"aggregation": "mean"}}, ["loss.aggregation='mean'", "'token_mean'"]),
        ({"optim": {"b1": 1.0}}, ["optim.b1/b2", "[0, 1)"]),
        ({"optim": {"eps": 0.0}}, ["optim.eps=0.0", "> 0"]),
    ],
)
def test_other_range_errors(data, fragments):
    check_error(data, *fragments)


def test_correction_and_loss_accept_exactly_what_their_factories_accept():
    """One rule per setting, in the module that uses it: a section is valid iff the factory it
    configures (`ais.adaptive`, `ais.masked`, `grpo.make_loss`) accepts it -- e.g. clip_low = 0
    (no lower clip), which grpo.make_loss allows."""
    from ais_jax import ais, grpo

    assert LossConfig(clip_low=0.0).clip_low == 0.0
    grpo.make_loss(clip_low=0.0)
    for key, value in [("clip", 0.99), ("delta", 0.0), ("gamma", -1.0), ("beta_var", -0.1)]:
        with pytest.raises(ValueError) as theirs:
            ais.adaptive(**{key: value})
        with pytest.raises(ValueError) as ours:
            CorrectionConfig(**{key: value})
        assert str(ours.value) == f"correction.{theirs.value}"
    with pytest.raises(ValueError) as theirs:
        grpo.make_loss(clip_high=-1.0)
    with pytest.raises(ValueError) as ours:
        LossConfig(clip_high=-1.0)
    assert str(ours.value) == f"loss.{theirs.value}"


def test_config_does_not_redefine_the_library_constants():
    """LEVELS and AGGREGATIONS live in ais.py and grpo.py only."""
    import ast
    import pathlib

    from ais_jax import config

    tree = ast.parse(pathlib.Path(config.__file__).read_text())
    assigned = {
        t.id
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    assert not assigned & {"LEVELS", "AGGREGATIONS"}, assigned


@pytest.mark.parametrize("method", ["none", "ais"])
@pytest.mark.parametrize("level", ["sequence", "geometric"])
def test_a_level_with_a_method_that_has_none_is_an_error(method, level):
    """Only tis and mis weight by a level; with none or ais it would be silently ignored."""
    message = check_error(
        {"correction": {"method": method, "level": level}},
        f"correction.level={level!r}",
        "['tis', 'mis']",
        repr(method),
    )
    assert "token" in message
    for weighted in ("tis", "mis"):
        assert CorrectionConfig(method=weighted, level=level).level == level


def test_unknown_rollout_format_lists_the_allowed_formats():
    message = check_error({"rollout": {"format": "fp8"}}, "rollout.format='fp8'")
    for name in ROLLOUT_FORMATS:
        assert repr(name) in message
    assert {"bf16", "float8_e4m3fn", "float4_e2m1fn"} <= set(ROLLOUT_FORMATS)


def test_unknown_correction_method_lists_the_allowed_methods():
    message = check_error({"correction": {"method": "is"}}, "correction.method='is'")
    assert CORRECTIONS == ("none", "tis", "ais", "mis")
    for name in CORRECTIONS:
        assert repr(name) in message


def test_minibatches_must_divide_the_rollout_batch():
    check_error(
        {"rollout": {"prompts_per_step": 4, "group_size": 4}, "optim": {"minibatches": 3}},
        "optim.minibatches=3",
        "= 16",
    )
    cfg = from_dict(
        TrainConfig,
        {"rollout": {"prompts_per_step": 4, "group_size": 4}, "optim": {"minibatches": 8}},
    )
    assert cfg.optim.minibatches == 8


def test_every_allowed_choice_is_accepted():
    for fmt in ROLLOUT_FORMATS:
        assert RolloutConfig(format=fmt).format == fmt
    for method in CORRECTIONS:
        assert CorrectionConfig(method=method).method == method
    for level in ("token", "sequence", "geometric"):
        assert CorrectionConfig(method="tis", level=level).level == level
    assert RolloutConfig(top_p=1.0, top_k=1).top_p == 1.0
    assert CorrectionConfig(clip=1.0).clip == 1.0


# ---- --set overrides ----------------------------------------------------------------------------


def test_set_values_are_parsed_as_yaml():
    cfg = load_config(
        None,
        [
            "rollout.top_p=0.9",
            "rollout.group_size=4",
            "rollout.top_k=null",
            "rollout.fp8_lm_head=true",
            "optim.learning_rate=1e-4",
            "loss.kl_coef=0",
            "seed=7",
            "rollout.format=float4_e2m1fn",
        ],
    )
    assert cfg.rollout.top_p == 0.9 and type(cfg.rollout.top_p) is float
    assert cfg.rollout.group_size == 4 and type(cfg.rollout.group_size) is int
    assert cfg.rollout.top_k is None and cfg.rollout.fp8_lm_head is True
    # YAML 1.1 reads "1e-4" as a string; a float field takes it as the number
    assert cfg.optim.learning_rate == 1e-4 and type(cfg.optim.learning_rate) is float
    assert cfg.loss.kl_coef == 0.0 and type(cfg.loss.kl_coef) is float
    assert cfg.seed == 7 and cfg.rollout.format == "float4_e2m1fn"


def test_set_overrides_a_yaml_file_and_keeps_its_other_keys(tmp_path):
    cfg = load_yaml(
        tmp_path,
        "steps: 5\nrollout:\n  group_size: 6\n  top_p: 0.5\n",
        ["rollout.top_p=1.0", "steps=9"],
    )
    assert (cfg.steps, cfg.rollout.group_size, cfg.rollout.top_p) == (9, 6, 1.0)


def test_set_deep_key_and_string_that_looks_like_a_number():
    cfg = load_config(None, ["task.options.max_digits=2", "model.checkpoint='123'"])
    assert cfg.task.options == {"max_digits": 2} and cfg.model.checkpoint == "123"


def test_set_does_not_mutate_its_input():
    data = {"rollout": {"group_size": 4}, "task": {"options": {"ops": ["+"]}}}
    apply_overrides(data, ["rollout.group_size=6", "task.options.max_digits=2"])
    assert data == {"rollout": {"group_size": 4}, "task": {"options": {"ops": ["+"]}}}


@pytest.mark.parametrize(
    "item, fragments",
    [
        ("rollout.top_p", ["--set 'rollout.top_p'", "section.key=value"]),
        ("steps.x=1", ["--set 'steps.x=1'", "'steps' is not a section"]),
        ("rollout.fromat=bf16", ["'rollout.fromat'", "valid keys in rollout"]),
        ("rollout.group_size=1", ["rollout.group_size=1", ">= 2"]),
        ("rollout.top_p=1.5", ["rollout.top_p=1.5", "(0, 1]"]),
        ("rollout.group_size=1e-4", ["rollout.group_size='1e-4'", "expected int"]),
    ],
)
def test_bad_set_is_an_error_naming_it(item, fragments):
    with pytest.raises(ValueError) as err:
        load_config(None, ["steps=3", item])
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)


# ---- files --------------------------------------------------------------------------------------


def test_missing_yaml_file_names_the_path(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*does not exist"):
        load_config(path)


def test_invalid_yaml_names_the_file(tmp_path):
    with pytest.raises(ValueError, match="is not valid YAML") as err:
        load_yaml(tmp_path, "rollout: {format: bf16\nsteps: [1, 2\n")
    assert str(tmp_path / "config.yaml") in str(err.value)


def test_empty_yaml_and_empty_sections_give_defaults(tmp_path):
    assert load_yaml(tmp_path, "") == TrainConfig()
    assert load_yaml(tmp_path, "rollout:\ncorrection: {}\n") == TrainConfig()


# ---- resuming under another configuration ------------------------------------------------------


def test_changed_settings_names_every_differing_leaf():
    old = TrainConfig()
    new = load_config(None, ["steps=80", "optim.learning_rate=3e-5", "task.options={ops: ['+']}"])
    assert changed_settings(old.to_dict(), new.to_dict()) == {
        "optim.learning_rate": (1e-4, 3e-5),
        "steps": (40, 80),
        "task.options": ({}, "(absent)"),
        "task.options.ops": ("(absent)", ["+"]),
    }
    assert changed_settings(old.to_dict(), old.to_dict()) == {}


def test_resume_may_change_only_when_to_stop_log_and_where_to_run():
    old = TrainConfig()
    allowed = load_config(
        None,
        ["steps=80", "checkpoint_every=5", "eval_every=10", "mesh.fsdp=2", "mesh.data=-1"]
        + ["distributed.enabled=true", "distributed.coordinator_address='h:1'"],
    )
    changes = check_resume(old, allowed, "run/config.yaml")
    assert set(changes) == {
        "steps",
        "checkpoint_every",
        "eval_every",
        "mesh.fsdp",
        "distributed.enabled",
        "distributed.coordinator_address",
    }
    assert RESUMABLE == ("steps", "checkpoint_every", "eval_every", "mesh.*", "distributed.*")
    assert check_resume(old, old, "x") == {}


@pytest.mark.parametrize(
    "sets, named",
    [
        (
            ["optim.learning_rate=3e-5"],
            ["optim.learning_rate: 0.0001 in run/config.yaml, 3e-05 given"],
        ),
        (["seed=1", "steps=80"], ["seed: 0 in run/config.yaml, 1 given"]),
        (["correction.method=tis", "rollout.format=bf16"], ["correction.method", "rollout.format"]),
        (["task.options={max_digits: 2}"], ["task.options"]),
    ],
)
def test_resume_under_another_experiment_is_an_error_naming_the_settings(sets, named):
    with pytest.raises(ValueError) as err:
        check_resume(TrainConfig(), load_config(None, sets), "run/config.yaml")
    message = str(err.value)
    assert "run/config.yaml" in message and "steps, checkpoint_every, eval_every" in message
    for fragment in named:
        assert fragment in message, message
    assert "steps:" not in message  # an allowed change is not an error


# ---- model.family: llada ------------------------------------------------------------------------

LLADA = {"model": {"family": "llada"}}


def test_llada_tiny_yaml_loads():
    path = Path(__file__).parent.parent / "configs" / "llada_tiny.yaml"
    cfg = load_config(path)
    assert cfg.model.family == "llada" and cfg.task.name == "countdown"
    assert cfg.rollout.diffusion.p_mask_prompt == 0.0 and cfg.optim.ppo_epochs == 2
    assert load_config(path, ["task.name=sudoku", "task.options={}"]).task.name == "sudoku"


@pytest.mark.parametrize(
    "data, fragments",
    [
        ({"model": {"family": "mamba"}}, ["model.family='mamba'", "['qwen3', 'qwen35', 'llada']"]),
        (
            {**LLADA, "rollout": {"diffusion": {"block_length": 5}}},
            ["rollout.diffusion.block_length=5", "must divide", "max_new_tokens = 16"],
        ),
        (
            {**LLADA, "rollout": {"diffusion": {"steps": 3}}},
            ["rollout.diffusion.steps=3", "multiple of the number of blocks (2"],
        ),
        (
            {**LLADA, "rollout": {"diffusion": {"steps": 18}}},
            ["rollout.diffusion.steps=18", "at most max_new_tokens (16)"],
        ),
        (
            {**LLADA, "rollout": {"diffusion": {"remasking": "greedy"}}},
            ["rollout.diffusion.remasking='greedy'", "['low_confidence', 'random']"],
        ),
        (
            {**LLADA, "rollout": {"diffusion": {"p_mask_prompt": 1.5}}},
            ["rollout.diffusion.p_mask_prompt=1.5", "[0, 1]"],
        ),
        ({**LLADA, "rollout": {"top_k": 5}}, ["rollout.top_k=5", "full softmax"]),
        ({**LLADA, "loss": {"kl_coef": 0.1}}, ["loss.kl_coef=0.1", "use 0"]),
        ({**LLADA, "optim": {"remat": True}}, ["optim.remat=True", "use false"]),
        ({"model": {"family": "llada", "head_dim": 16}}, ["model.head_dim=16", "hidden_size"]),
        (
            {"model": {"family": "llada", "checkpoint": "ckpt"}},
            ["model.checkpoint='ckpt'", "family llada"],
        ),
        (
            {"rollout": {"diffusion": {"steps": 4}}},
            ["rollout.diffusion=", "only with model.family=llada"],
        ),
    ],
)
def test_llada_settings_are_checked(data, fragments):
    check_error(data, *fragments)
