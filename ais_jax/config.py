"""Run configuration: frozen, keyword-only dataclasses, read strictly from YAML.

A YAML file maps onto `TrainConfig` section by section; `--set a.b=value` overrides a leaf (the
value is parsed as YAML, so `--set rollout.top_p=0.9` gives a float). An unknown key is an error
that names it and lists the valid keys; a value of the wrong type or out of range is an error
that names the key, the value and what is allowed. Each section validates itself in
`__post_init__`, so a bad config fails before any array is allocated. The correction and loss
sections are checked by the factories they configure (`ais.adaptive`, `ais.masked`,
`grpo.make_loss`): one rule per setting, in the module that uses it.

YAML is read with `StrictSafeLoader`: a `yaml.SafeLoader` (plain data, no code) that also
refuses a key given twice in one mapping (naming the key and both lines), a document whose
aliases expand to more than `MAX_EXPANDED_NODES` values (a "billion laughs" bomb is refused in
time linear in its text, never expanded) or refer to themselves, and integers too long to read.
Error messages quote at most ~200 characters of any value (`show`).

    model       which network: a built-in preset trained from scratch, or a local HF checkpoint;
                family: qwen3, qwen35 or llada (masked diffusion); null: the preset's or
                checkpoint's
    task        the verifiable task (tasks/) and its options
    rollout     the rollout engine: number format, sampling, group size, response length;
                ``rollout.diffusion``: LLaDA's sampler and diffu-GRPO's estimator (llada only)
    correction  the rollout-vs-trainer correction: none | tis | ais | mis (ais.py)
    loss        the GRPO objective (grpo.py)
    optim       AdamW, schedule, PPO epochs and minibatches
    sft         the supervised warm start on task demonstrations
    mesh        device mesh axis sizes (sharding.py); distributed: jax.distributed settings

`check_resume` says which settings a resumed run may change (`RESUMABLE`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import reprlib
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import yaml

from ais_jax import ais, grpo

# The names a YAML may use for what the engines implement. They are spelled here, not imported,
# so that reading a config loads no model, sampler or quantizer (tests/test_layers.py checks
# that each list is the engine's own: `nn.quant.FORMATS`, `rollout.sampler.DECODE_LAYOUTS`,
# `rollout.diffusion.REMASKING`, `parallel.sharding.AXES`, `models.FAMILIES`' names and kinds).
ROLLOUT_FORMATS = (
    "bf16",
    "float8_e4m3fn",
    "float8_e5m2",
    "float6_e3m2fn",
    "float6_e2m3fn",
    "float4_e2m1fn",
)
DECODE_LAYOUTS = ("out_in_columns", "out_in", "out_in_columns_fused", "out_in_fused")
REMASKING = ("low_confidence", "random")
AXES = ("data", "fsdp", "tensor")
FAMILIES = {"qwen3": "autoregressive", "qwen35": "autoregressive", "llada": "diffusion"}
CORRECTIONS = ("none", "tis", "ais", "mis")
LEVEL_METHODS = ("tis", "mis")  # the corrections that weight by token, sequence or geometric mean
# the settings a resumed run may change (`check_resume`): when to stop, checkpoint and evaluate,
# and where it runs (orbax reshards a checkpoint onto any mesh; a job restarted by a scheduler
# may get another coordinator)
RESUMABLE = ("steps", "checkpoint_every", "eval_every", "mesh.*", "distributed.*")


MAX_SHOWN = 200  # characters of a value an error message quotes
MAX_EXPANDED_NODES = 100_000  # values a YAML document may hold once its aliases are expanded
SEED_RANGE = 2**32  # the data pipeline and `jax.random.key` take seeds in [0, 2**32)
MAX_TASK_DIGITS = 100  # numbers in generated tasks: far beyond any rollout length already

_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxdict, _repr.maxlist, _repr.maxtuple = 3, 8, 8, 8
_repr.maxstring, _repr.maxother, _repr.maxlong = MAX_SHOWN, MAX_SHOWN, MAX_SHOWN


def show(value: Any) -> str:
    """``repr(value)`` for an error message: at most ~200 characters, quick for any value
    (nested containers are abbreviated before they are printed, huge integers summarised)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 640:
        return f"<an integer of about {int(value.bit_length() * 0.30103)} digits>"
    text = _repr.repr(value)
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 3] + "..."


def _check(cond: bool, section: str, key: str, value: Any, allowed: str) -> None:
    if not cond:
        name = f"{section}.{key}" if section else key
        raise ValueError(f"{name}={show(value)} is invalid: {allowed}.")


def _rules_of(section: str, factory: Callable[..., Any], **settings: Any) -> None:
    """Validate ``settings`` with the library factory that owns their rules (`ais.adaptive`,
    `grpo.make_loss`, ...), so a config accepts exactly what the code it configures accepts;
    the factory's ValueError is re-raised with the section in front of the key."""
    try:
        factory(**settings)
    except ValueError as e:
        raise ValueError(f"{section}.{e}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A preset (random init) or a local Hugging Face directory (`checkpoint`).

    ``family``: the model family (`ais_jax.models.FAMILIES`): ``qwen3`` (Qwen3, Qwen2, Llama),
    ``qwen35`` (Qwen3.5) or ``llada`` (the masked-diffusion LLaDA, trained with
    ``rollout.diffusion``); null (the default) takes the preset's family (the first that has
    the name: ``tiny`` is Qwen3's, so LLaDA's tiny needs ``family: llada``) or the
    checkpoint's. LLaDA's head dim is hidden_size / num_heads, so it takes no ``head_dim``; a
    LLaDA checkpoint is not trainable from a config yet."""

    family: str | None = None
    preset: str = "tiny"
    checkpoint: str | None = None
    hidden_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None

    def __post_init__(self):
        _check(
            self.family is None or self.family in FAMILIES,
            "model",
            "family",
            self.family,
            f"allowed: {list(FAMILIES)} or null (the preset's or checkpoint's family)",
        )
        for key, value in self.overrides().items():
            _check(1 <= value < 2**31, "model", key, value, "must be an integer in [1, 2**31)")
        if self.family == "llada":
            _check(
                self.head_dim is None,
                "model",
                "head_dim",
                self.head_dim,
                "family llada has no head_dim setting (it is hidden_size / num_heads); use null",
            )
            _check(
                self.checkpoint is None,
                "model",
                "checkpoint",
                self.checkpoint,
                "family llada trains from a preset only for now (ais_jax.load_hf reads "
                "checkpoints for evaluation); use null",
            )

    @property
    def kind(self) -> str:
        """ "diffusion" for a diffusion family, else "autoregressive" (also when ``family`` is
        null: a preset or checkpoint of a diffusion family must name it)."""
        return FAMILIES.get(self.family, "autoregressive")

    def overrides(self) -> dict[str, int]:
        names = (
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
        )
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaskConfig:
    name: str = "arithmetic"
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    eval_examples: int = 200
    # file tasks (gsm8k, math): the held-out file; generated tasks use a disjoint seed stream
    eval_path: str | None = None

    def __post_init__(self):
        _check(self.eval_examples >= 1, "task", "eval_examples", self.eval_examples, "must be >= 1")
        for key, value in self.options.items():
            if not isinstance(value, int) or isinstance(value, bool):
                continue
            if key.endswith("digits"):  # arithmetic's min_digits/max_digits
                _check(
                    1 <= value <= MAX_TASK_DIGITS,
                    "task",
                    f"options.{key}",
                    value,
                    f"must be in [1, {MAX_TASK_DIGITS}] (longer numbers fit no prompt or response)",
                )
            _check(abs(value) < 2**63, "task", f"options.{key}", value, "must fit in 64 bits")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiffusionConfig:
    """LLaDA's sampler and diffu-GRPO's log-prob estimator (``model.family: llada`` only).

    The response length T (LLaDA's ``gen_length``) is ``rollout.max_new_tokens``; it is filled
    in blocks of ``block_length`` positions with ``steps`` denoising steps in all (a multiple of
    the number of blocks, at most one step per token), choosing what to keep by ``remasking``.
    d1's mu inner updates per rollout batch are ``optim.ppo_epochs``: each draws a new random
    prompt mask (each valid prompt token masked with probability ``p_mask_prompt``)."""

    block_length: int = 8
    steps: int = 8
    remasking: str = "low_confidence"
    p_mask_prompt: float = 0.15

    def __post_init__(self):
        s = "rollout.diffusion"
        _check(self.block_length >= 1, s, "block_length", self.block_length, "must be >= 1")
        _check(self.steps >= 1, s, "steps", self.steps, "must be >= 1")
        _check(
            self.remasking in REMASKING,
            s,
            "remasking",
            self.remasking,
            f"allowed: {list(REMASKING)}",
        )
        _check(
            0 <= self.p_mask_prompt <= 1,
            s,
            "p_mask_prompt",
            self.p_mask_prompt,
            "must be in [0, 1] (d1: 0.15)",
        )

    def check_length(self, gen_length: int) -> None:
        """ValueErrors unless blocks tile ``gen_length`` and ``steps`` fits them."""
        s = "rollout.diffusion"
        _check(
            gen_length % self.block_length == 0,
            s,
            "block_length",
            self.block_length,
            f"must divide the response length rollout.max_new_tokens = {gen_length}",
        )
        blocks = gen_length // self.block_length
        _check(
            self.steps % blocks == 0 and self.steps <= gen_length,
            s,
            "steps",
            self.steps,
            f"must be a multiple of the number of blocks ({blocks} = max_new_tokens / "
            f"block_length) and at most max_new_tokens ({gen_length})",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    format: str = "float8_e4m3fn"
    act_scaling: Literal["tensor", "token"] = "tensor"
    fp8_lm_head: bool = False
    prompts_per_step: int = 16
    group_size: int = 8
    max_new_tokens: int = 16
    max_prompt_len: int = 32
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    # How decode holds the weights (`sampler.DECODE_LAYOUTS`); "auto" picks
    # `sampler.default_layout`: "out_in_columns" for float32 models on CPU, else "out_in"; the
    # "*_fused" layouts hold each layer's q/k/v and gate/up as one weight each.
    decode_layout: str = "auto"
    diffusion: DiffusionConfig = dataclasses.field(default_factory=DiffusionConfig)

    def __post_init__(self):
        s = "rollout"
        _check(
            self.decode_layout in ("auto", *DECODE_LAYOUTS),
            s,
            "decode_layout",
            self.decode_layout,
            f"allowed: {['auto', *DECODE_LAYOUTS]}",
        )
        _check(
            self.format in ROLLOUT_FORMATS,
            s,
            "format",
            self.format,
            f"allowed: {list(ROLLOUT_FORMATS)}",
        )
        _check(
            self.act_scaling in ("tensor", "token"),
            s,
            "act_scaling",
            self.act_scaling,
            "allowed: ['tensor', 'token']",
        )
        _check(
            self.prompts_per_step >= 1, s, "prompts_per_step", self.prompts_per_step, "must be >= 1"
        )
        _check(
            self.group_size >= 2,
            s,
            "group_size",
            self.group_size,
            "must be >= 2 (group-relative advantages need at least two answers)",
        )
        _check(self.max_new_tokens >= 1, s, "max_new_tokens", self.max_new_tokens, "must be >= 1")
        _check(self.max_prompt_len >= 1, s, "max_prompt_len", self.max_prompt_len, "must be >= 1")
        _check(self.temperature > 0, s, "temperature", self.temperature, "must be > 0")
        _check(
            self.top_k is None or self.top_k >= 1, s, "top_k", self.top_k, "must be >= 1 or null"
        )
        _check(
            self.top_p is None or 0 < self.top_p <= 1,
            s,
            "top_p",
            self.top_p,
            "must be in (0, 1] or null",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CorrectionConfig:
    method: str = "ais"
    clip: float = 5.0
    delta: float = 0.02
    gamma: float = 1.2
    beta_var: float = 1.0
    eps: float = 1e-6
    low: float = 0.5
    high: float = 2.0
    level: str = "token"

    def __post_init__(self):
        s = "correction"
        _check(
            self.method in CORRECTIONS, s, "method", self.method, f"allowed: {list(CORRECTIONS)}"
        )
        # every setting is checked whatever the method, so switching methods never meets a
        # value that was silently invalid
        diagnostics = dict(
            clip=self.clip, delta=self.delta, gamma=self.gamma, beta_var=self.beta_var, eps=self.eps
        )
        _rules_of(s, ais.adaptive, **diagnostics)
        _rules_of(s, ais.masked, low=self.low, high=self.high, level=self.level)
        _check(
            self.level == "token" or self.method in LEVEL_METHODS,
            s,
            "level",
            self.level,
            f"only methods {list(LEVEL_METHODS)} use a level; method {self.method!r} would "
            "ignore it, so leave level at 'token'",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossConfig:
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    aggregation: str = "seq_mean_token_mean"

    def __post_init__(self):
        _rules_of("loss", grpo.make_loss, **dataclasses.asdict(self))


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
    learning_rate: float = 1e-4
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.99
    eps: float = 1e-8  # Adam's epsilon (optax's default)
    grad_clip: float = 1.0
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine"] = "constant"
    ppo_epochs: int = 1
    minibatches: int = 1
    # Recompute each decoder layer in the update's backward pass instead of keeping its
    # activations (`model.recompute_layer`): a forward pass more compute for an update whose
    # temporaries hold one layer's activations and the residual stream.
    remat: bool = False

    def __post_init__(self):
        s = "optim"
        _check(self.learning_rate > 0, s, "learning_rate", self.learning_rate, "must be > 0")
        _check(self.weight_decay >= 0, s, "weight_decay", self.weight_decay, "must be >= 0")
        _check(
            0 <= self.b1 < 1 and 0 <= self.b2 < 1,
            s,
            "b1/b2",
            (self.b1, self.b2),
            "must be in [0, 1)",
        )
        _check(self.eps > 0, s, "eps", self.eps, "must be > 0")
        _check(self.grad_clip > 0, s, "grad_clip", self.grad_clip, "must be > 0")
        _check(self.warmup_steps >= 0, s, "warmup_steps", self.warmup_steps, "must be >= 0")
        _check(
            self.schedule in ("constant", "cosine"),
            s,
            "schedule",
            self.schedule,
            "allowed: ['constant', 'cosine']",
        )
        _check(self.ppo_epochs >= 1, s, "ppo_epochs", self.ppo_epochs, "must be >= 1")
        _check(self.minibatches >= 1, s, "minibatches", self.minibatches, "must be >= 1")
        _check(isinstance(self.remat, bool), s, "remat", self.remat, "must be true or false")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTConfig:
    steps: int = 300
    batch_size: int = 64
    learning_rate: float = 3e-3

    def __post_init__(self):
        _check(self.steps >= 0, "sft", "steps", self.steps, "must be >= 0")
        _check(self.batch_size >= 1, "sft", "batch_size", self.batch_size, "must be >= 1")
        _check(self.learning_rate > 0, "sft", "learning_rate", self.learning_rate, "must be > 0")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Mesh axis sizes (`sharding.AXES`); at most one may be -1 (all remaining devices)."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        for name in AXES:
            value = getattr(self, name)
            integer = isinstance(value, int) and not isinstance(value, bool)
            _check(
                integer and (value == -1 or value >= 1),
                "mesh",
                name,
                value,
                "must be >= 1 or -1 (fill)",
            )
        if [getattr(self, n) for n in AXES].count(-1) > 1:
            raise ValueError(f"mesh: at most one axis may be -1 (fill), got {self}.")

    @classmethod
    def parse(cls, text: str) -> MeshConfig:
        """``"data=1,fsdp=8,tensor=1"`` (missing axes keep their defaults)."""
        sizes = {}
        for item in filter(None, (s.strip() for s in text.split(","))):
            name, _, value = item.partition("=")
            if name.strip() not in AXES or not value.strip().lstrip("-").isdigit():
                raise ValueError(f"mesh item {item!r} must look like AXIS=INT with AXIS in {AXES}.")
            sizes[name.strip()] = int(value)
        return cls(**sizes)

    def sizes(self, num_devices: int) -> dict[str, int]:
        """Axis sizes with -1 resolved; their product must equal ``num_devices``."""
        sizes = {n: getattr(self, n) for n in AXES}
        fixed = math.prod(v for v in sizes.values() if v != -1)
        fill = [n for n, v in sizes.items() if v == -1]
        if fill and num_devices % fixed:
            raise ValueError(
                f"mesh {self.describe()}: the product of the fixed axis sizes "
                f"({fixed}) does not divide the device count {num_devices}."
            )
        if not fill and fixed != num_devices:
            raise ValueError(
                f"mesh {self.describe()}: the product of the axis sizes ({fixed}) "
                f"is not the device count {num_devices}; use -1 to fill an axis."
            )
        return {n: (num_devices // fixed if v == -1 else v) for n, v in sizes.items()}

    def describe(self) -> str:
        return ",".join(f"{n}={getattr(self, n)}" for n in AXES)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """`jax.distributed.initialize` arguments (`sharding.initialize_distributed`); all None =
    auto-detect (TPU pods, SLURM)."""

    enabled: bool = False
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    seed: int = 0
    steps: int = 40
    checkpoint_every: int = 10
    eval_every: int = 0
    model: ModelSpec = dataclasses.field(default_factory=ModelSpec)
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    correction: CorrectionConfig = dataclasses.field(default_factory=CorrectionConfig)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)

    def __post_init__(self):
        _check(
            0 <= self.seed < SEED_RANGE,
            "",
            "seed",
            self.seed,
            "must be an integer in [0, 2**32) (the data pipeline's seed range)",
        )
        _check(self.steps >= 0, "", "steps", self.steps, "must be >= 0")
        _check(
            self.checkpoint_every >= 1,
            "",
            "checkpoint_every",
            self.checkpoint_every,
            "must be >= 1",
        )
        _check(self.eval_every >= 0, "", "eval_every", self.eval_every, "must be >= 0")
        batch = self.rollout.prompts_per_step * self.rollout.group_size
        _check(
            batch % self.optim.minibatches == 0,
            "optim",
            "minibatches",
            self.optim.minibatches,
            f"must divide the rollout batch prompts_per_step*group_size = {batch}",
        )
        if self.model.kind == "diffusion":
            self._check_diffusion()
        else:
            _check(
                self.rollout.diffusion == DiffusionConfig(),
                "rollout",
                "diffusion",
                dataclasses.asdict(self.rollout.diffusion),
                "is read only with model.family=llada; leave it out for an autoregressive model",
            )

    def _check_diffusion(self) -> None:
        """What LLaDA's trainer (`train.diffusion.ESTIMATOR`) does not do: top-k/top-p sampling (its
        sampler draws from the full softmax) and a KL term."""
        r = self.rollout
        r.diffusion.check_length(r.max_new_tokens)
        for key in ("top_k", "top_p"):
            _check(
                getattr(r, key) is None,
                "rollout",
                key,
                getattr(r, key),
                "LLaDA's sampler draws from the full softmax (Gumbel noise); use null",
            )
        _check(
            self.loss.kl_coef == 0,
            "loss",
            "kl_coef",
            self.loss.kl_coef,
            "model.family=llada trains without a reference policy for now; use 0",
        )
        _check(
            not self.optim.remat,
            "optim",
            "remat",
            self.optim.remat,
            "model.family=llada's trainer does not recompute layers; use false",
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---- YAML <-> dataclasses -------------------------------------------------------------------


def from_dict(cls: type, data: dict[str, Any], *, where: str = "") -> Any:
    """Build dataclass ``cls`` from a nested dict; unknown keys and wrong types are errors."""
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'config'} must be a mapping, got {type(data).__name__}.")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        prefix = f"{where}." if where else ""
        raise ValueError(
            f"Unknown config key(s) {show([prefix + str(k) for k in unknown])}; valid keys "
            f"{('in ' + where) if where else 'at the top level'}: {sorted(fields)}."
        )
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        kwargs[key] = _coerce(hints[key], value, path)
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, path: str) -> Any:
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value or {}, where=path)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, path)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ValueError(
                f"{path}={show(value)} is invalid: allowed {list(typing.get_args(tp))}."
            )
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{path} must be a mapping, got {show(value)}.")
        return dict(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if tp is float and isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ValueError(f"{path}={show(value)} is invalid: must be a finite number.")
        return float(value)
    if tp in (int, str, bool) and not (
        isinstance(value, tp) and (tp is bool or not isinstance(value, bool))
    ):
        raise ValueError(f"{path}={show(value)} has the wrong type: expected {tp.__name__}.")
    if tp is float and not isinstance(value, float):
        raise ValueError(f"{path}={show(value)} has the wrong type: expected a number.")
    return value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b=value`` strings (values parsed as YAML) to a nested dict."""
    data = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"--set {show(item)} must look like section.key=value.")
        dotted, raw = item.split("=", 1)
        keys = dotted.strip().split(".")
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {show(item)}: {show(k)} is not a section.")
        try:
            node[keys[-1]] = yaml.load(raw, Loader=StrictSafeLoader)
        except yaml.YAMLError as e:
            raise ValueError(
                f"--set {show(item)}: the value is not valid YAML: {_yaml_error(e)}."
            ) from None
    return data


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> TrainConfig:
    """Read a YAML file (or the defaults when ``path`` is None) and apply ``--set`` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ValueError(f"Config file {str(p)!r} does not exist.")
        if not p.is_file():
            raise ValueError(f"Config file {str(p)!r} is not a file.")
        try:
            text = p.read_text()
        except UnicodeDecodeError as e:
            raise ValueError(
                f"Config file {p} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                f"{e.start})."
            ) from None
        except OSError as e:
            raise ValueError(f"Config file {p} cannot be read: {e.strerror}.") from None
        try:
            data = yaml.load(text, Loader=StrictSafeLoader)
        except yaml.YAMLError as e:
            raise ValueError(f"Config file {p} is not valid YAML: {_yaml_error(e)}.") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ValueError(
                f"Config file {p}: the config must be a mapping, got {type(data).__name__} "
                f"{show(data)} (sections like seed: ..., rollout: {{...}})."
            )
    return from_dict(TrainConfig, apply_overrides(data, list(overrides)))


def _yaml_error(e: yaml.YAMLError) -> str:
    """One line: what the parser expected, and where (its own message spans several lines)."""
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(e, "problem", None) or " ".join(str(e).split())
    return problem[:MAX_SHOWN] + where


class StrictSafeLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` (plain data only) that also refuses duplicate keys, alias bombs,
    self-referring aliases and integers too long to read."""

    def get_single_node(self):
        node = super().get_single_node()
        if node is not None:
            _check_expansion(node)
        return node

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, int] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                    continue
                key = self.construct_object(key_node)
                if key in first:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"duplicate key {show(key)} (first given at line {first[key] + 1})",
                        key_node.start_mark,
                    )
                first[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):
        try:
            return super().construct_yaml_int(node)
        except ValueError:  # Python's int-string limit (4300 digits)
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"an integer of {len(node.value)} characters is too long to read",
                node.start_mark,
            ) from None


StrictSafeLoader.add_constructor("tag:yaml.org,2002:int", StrictSafeLoader.construct_yaml_int)


def _check_expansion(root: yaml.Node) -> None:
    """A `ConstructorError` if ``root`` refers to itself through an alias or holds more than
    `MAX_EXPANDED_NODES` values once every alias is expanded. Each distinct node is visited
    once (aliases are shared node objects), so a bomb is measured without being expanded."""
    size: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        children = _children(node)
        if done:
            on_path.discard(key)
            size[key] = 1 + sum(size[id(c)] for c in children)
            if size[key] > MAX_EXPANDED_NODES:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"its aliases expand to more than {MAX_EXPANDED_NODES} values (an alias "
                    "bomb?); write the values out instead",
                    node.start_mark,
                )
            continue
        if key in size:
            continue
        if key in on_path:
            raise yaml.constructor.ConstructorError(
                None, None, "an alias refers to the node that contains it", node.start_mark
            )
        on_path.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in size)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def dump_config(config: TrainConfig) -> str:
    return yaml.safe_dump(config.to_dict(), sort_keys=False)


# ---- comparing configurations ---------------------------------------------------------------


def changed_settings(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{"optim.learning_rate": (old, new), ...}``: the dotted keys whose values differ between
    two nested config mappings (`TrainConfig.to_dict` or YAML); a key one side lacks is
    ``"(absent)"`` there."""
    a, b = _leaves(old), _leaves(new)
    absent = "(absent)"
    return {
        k: (a.get(k, absent), b.get(k, absent))
        for k in sorted(set(a) | set(b))
        if a.get(k, absent) != b.get(k, absent)
    }


def describe_changes(
    changes: dict[str, tuple[Any, Any]], old: str = "there", new: str = "here", limit: int = 4
) -> str:
    """``"optim.learning_rate: 0.001 there, 0.002 here; ..."`` (at most ``limit`` keys)."""
    items = [f"{k}: {show(a)} {old}, {show(b)} {new}" for k, (a, b) in changes.items()]
    more = f" ... ({len(items)} differences)" if len(items) > limit else ""
    return "; ".join(items[:limit]) + more


def check_resume(old: TrainConfig, new: TrainConfig, where: str | Path) -> dict[str, tuple]:
    """The settings ``new`` changes in the configuration ``old`` of a run being resumed (from
    ``where``, its config.yaml). Only `RESUMABLE` settings may change: when to stop, checkpoint
    and evaluate, and the mesh and distributed setup (a checkpoint restores onto any mesh).
    Anything else -- the model, task, rollout, correction, loss, optimizer, SFT or seed --
    would continue the run as another experiment than the one its checkpoints, metrics and
    config.yaml record: a ValueError naming every such key with both values. (A longer
    ``steps`` also lengthens a cosine learning-rate schedule from the resumed step on.)"""
    changes = changed_settings(old.to_dict(), new.to_dict())
    fixed = {k: v for k, v in changes.items() if not _resumable(k)}
    if fixed:
        raise ValueError(
            f"--resume: the run was trained with another configuration "
            f"({describe_changes(fixed, f'in {where}', 'given')}); resume it under its own "
            "(ais-jax train --out DIR --resume, without --config), or start a new run in "
            f"another --out. A resumed run may change only {', '.join(RESUMABLE)}."
        )
    return changes


def _resumable(key: str) -> bool:
    return any(key == r or (r.endswith(".*") and key.startswith(r[:-1])) for r in RESUMABLE)


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict) and tree:
        return {
            k: v for key, sub in tree.items() for k, v in _leaves(sub, f"{prefix}{key}.").items()
        }
    return {prefix.rstrip("."): tree}
