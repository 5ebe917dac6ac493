"""The README against the code: its "use AIS in your own JAX code" snippet runs as written and
does what it says; its "## Command line" usage lines name only options the parser has, with the
parser's defaults and required options; its configuration table names every setting of
`ais_jax.config.TrainConfig` with its default."""

import argparse
import dataclasses
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _snippet() -> str:
    text = README.read_text()
    section = text[text.index("## Use AIS in your own JAX code") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_readme_ais_snippet_runs_and_both_forms_agree():
    namespace: dict = {}
    exec(compile(_snippet(), str(README), "exec"), namespace)  # noqa: S102 - our own README
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    B, T = 16, 12
    logp_old = -jnp.abs(jax.random.normal(k1, (B, T)))
    logp_new = logp_old + 0.05 * jax.random.normal(k2, (B, T))
    logp_rollout = logp_old + 0.1 * jax.random.normal(k3, (B, T))
    rewards = jax.random.bernoulli(k4, 0.5, (B,)).astype(jnp.float32)
    mask = jnp.asarray(np.arange(T)[None, :] < np.arange(4, 4 + B)[:, None] % T + 1)
    loss, metrics = namespace["loss_fn"](logp_new, logp_old, logp_rollout, rewards, mask)
    assert np.isfinite(float(loss)) and 0.0 < float(metrics["ais/alpha"]) <= 1.0
    grads = namespace["grads"](logp_new, logp_old, logp_rollout, rewards, mask)
    assert grads.shape == (B, T) and float(jnp.abs(grads).sum()) > 0
    assert float(jnp.abs(jnp.where(mask, 0.0, grads)).max()) == 0.0
    # the two ways of composing the correction give the same loss
    grpo, correction = namespace["grpo"], namespace["correction"]
    adv_B = grpo.group_advantages(rewards, group_size=8)
    adv_BT, _ = correction(adv_B, logp_old, logp_rollout, mask)
    a, _ = grpo.loss(logp_new, logp_old, adv_BT, mask)
    b, _ = grpo.loss(
        logp_new, logp_old, adv_B, mask, correction=correction, logp_rollout_BT=logp_rollout
    )
    assert float(a) == float(b)


# --- the "## Command line" block against `ais_jax.cli.build_parser` ---------------------------

# The usage lines this block once had that the parser contradicted: each must be reported.
OLD_USAGE_ERRORS = {
    "ais-jax sample    --prompt TEXT [--n 4] [--format float8_e4m3fn]": "--format",
    "ais-jax plan      --model qwen3-8b --mesh data=1,fsdp=8,tensor=1 [--batch 64]": "--mesh",
    "ais-jax plan      [--gen-length 512]": "--gen-length",
    "ais-jax eval      --run DIR [--no-such-flag]": "--no-such-flag",
    "ais-jax sample    --prompt TEXT [--n]": "--n",
}


def _command_block(text: str) -> str:
    section = text[text.index("## Command line\n") :]
    return re.search(r"```\n(.*?)```", section, re.S).group(1)


def _usages(block: str) -> list[tuple[str | None, str, str]]:
    """``(command, usage, comments)`` per ``ais-jax <command> ...`` line and its continuation
    lines; ``command`` is None for ``ais-jax --help | --version``. A comment is a parenthesised
    note that ends a line after three or more spaces."""
    usages: list[list] = []
    for line in block.splitlines():
        if not line.strip():
            continue
        m = re.match(r"ais-jax (\S+)\s*(.*)", line)
        if m:
            command, rest = m.groups()
            if command.startswith("-"):
                command, rest = None, line[len("ais-jax ") :]
            usages.append([command, "", ""])
        else:
            assert usages and line.startswith(" "), f"not a usage or continuation line: {line!r}"
            rest = line.strip()
        note = re.match(r"(.*?\S)\s{3,}(\(.*\))\s*$", rest)
        if note:
            rest, comment = note.groups()
            usages[-1][2] += " " + comment
        usages[-1][1] += " " + rest
    return [(c, u.strip(), n.strip()) for c, u, n in usages]


def _shown_value(after: str) -> str | None:
    """The value the usage shows after a flag (``after`` is the text that follows it), or None
    when the flag is shown bare (followed by another flag, a bracket, ``|`` or ``...``)."""
    m = re.match(r" (\S+)", after)
    if not m or m.group(1)[0] in "-[(|" or m.group(1) == "...":
        return None
    token = m.group(1)
    pairs = {"]": "[", ")": "("}
    while token and token[-1] in pairs and token.count(token[-1]) > token.count(pairs[token[-1]]):
        token = token[:-1]
    return token


def _usage_problems(block: str) -> list[str]:
    """Everything the block's usage lines say that the parser contradicts: an unknown command or
    flag, a command left out, a required option left out, a flag shown with a value that takes
    none (or without one that takes one), a required option in brackets or an optional one
    outside them, and a literal value in ``[--flag VALUE]``
    that is not the flag's default (a metavar such as N, FILE, KEY=VALUE is not checked;
    ``a|b`` must be choices of the flag and include its default). When the parser's default is
    None and the help text says ``(default: X)``, X is the default shown."""
    from ais_jax.cli.main import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    problems = []
    for command, usage, comments in _usages(block):
        where = f"ais-jax {command or ''}"
        if command is not None and command not in sub.choices:
            problems.append(f"{where}: no such command")
            continue
        p = parser if command is None else sub.choices[command]
        required_groups = [g for g in p._mutually_exclusive_groups if g.required]
        for m in re.finditer(r"--[a-z][a-z0-9-]*", comments):
            if m.group() not in p._option_string_actions:
                problems.append(f"{where}: {m.group()} (in a note) is not an option")
        for m in re.finditer(r"--[a-z][a-z0-9-]*", usage):
            flag = m.group()
            action = p._option_string_actions.get(flag)
            if action is None:
                problems.append(f"{where}: {flag} is not an option")
                continue
            value = _shown_value(usage[m.end() :])
            if (action.nargs == 0) != (value is None):
                problems.append(f"{where}: {flag} shown {'with' if value else 'without'} a value")
                continue
            before = usage[: m.start()]
            optional = before.count("[") > before.count("]")
            required = action.required or any(action in g._group_actions for g in required_groups)
            if command is not None and optional == required:
                problems.append(
                    f"{where}: {flag} is {'required' if required else 'optional'} but shown "
                    f"{'in' if optional else 'outside'} brackets"
                )
            if value is None or not optional or not re.search(r"[a-z0-9]", value):
                continue  # a bare flag, a required option's example, or a metavar
            default = action.default
            if default is None and action.help:
                said = re.search(r"\(default: ([^\s()]+)\)", action.help)
                default = said.group(1) if said else None
            if "|" in value:
                alternatives = value.split("|")
                if action.choices is not None and not set(alternatives) <= set(action.choices):
                    problems.append(f"{where}: {flag} {value}: choices are {action.choices}")
                if default is not None and str(default) not in alternatives:
                    problems.append(f"{where}: {flag} {value}: the default is {default!r}")
                continue
            try:
                shown = action.type(value) if callable(action.type) else value
            except ValueError:
                shown = value
            if shown != default:
                problems.append(f"{where}: [{flag} {value}] but the default is {default!r}")
    for command, usage, _ in _usages(block):
        if command not in sub.choices:
            continue
        p = sub.choices[command]
        shown = set(re.findall(r"--[a-z][a-z0-9-]*", usage))
        for action in p._actions:
            if action.required and not shown & set(action.option_strings):
                problems.append(f"ais-jax {command}: required {action.option_strings[0]} not shown")
        for group in p._mutually_exclusive_groups:
            flags = {s for a in group._group_actions for s in a.option_strings}
            if group.required and not shown & flags:
                problems.append(f"ais-jax {command}: one of {sorted(flags)} is required")
    shown_commands = {c for c, _, _ in _usages(block)}
    for command in sub.choices:
        if command not in shown_commands:
            problems.append(f"ais-jax {command} is missing from the block")
    return problems


def test_readme_command_line_matches_the_parser():
    assert _usage_problems(_command_block(README.read_text())) == []


def test_readme_command_line_check_reports_contradictions():
    """The check itself: each line the README once had wrong is reported, naming the flag."""
    for line, flag in OLD_USAGE_ERRORS.items():
        problems = _usage_problems(line)
        assert any(flag + " " in p or p.endswith(flag) for p in problems), (line, problems)


# --- the "## Configuration" table against `ais_jax.config.TrainConfig` -------------------------


def _config_rows(text: str) -> list[tuple[list[str], bool, str]]:
    """``(keys, has_ellipsis, defaults)`` per row of the Configuration table; keys are full
    dotted paths (a row's later keys share the first one's section unless they name theirs)."""
    section = text[text.index("## Configuration\n") : text.index("### GSM8K and MATH")]
    rows = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        keys_col, defaults = (c.strip() for c in line.strip("|").split("|")[:2])
        names = re.findall(r"`([^`]+)`", keys_col)
        prefix = names[0].rpartition(".")[0]
        keys = [names[0]] + [n if "." in n else f"{prefix}.{n}".lstrip(".") for n in names[1:]]
        rows.append((keys, "..." in keys_col, defaults))
    return rows


def _leaves(obj, prefix: str = "") -> dict:
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out.update(_leaves(value, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = value
    return out


def _table_value(text: str):
    text = text.strip().strip("`")
    named = {"null": None, "true": True, "false": False, "{}": {}}
    if text in named:
        return named[text]
    try:
        return float(text)
    except ValueError:
        return text


def test_readme_config_table_names_every_setting_with_its_default():
    from ais_jax.config import TrainConfig

    leaves = _leaves(TrainConfig())
    rows = _config_rows(README.read_text())
    listed = {k for keys, _, _ in rows for k in keys}
    sections_with_more = {keys[0].rpartition(".")[0] for keys, more, _ in rows if more}
    assert listed <= set(leaves), sorted(listed - set(leaves))
    missing = [
        k for k in leaves if k not in listed and k.rpartition(".")[0] not in sections_with_more
    ]
    assert missing == [], missing
    for keys, _, defaults in rows:
        if defaults.startswith("see "):
            continue
        values = defaults.split(", ")
        values = values * len(keys) if len(values) == 1 else values
        assert len(values) == len(keys), (keys, defaults)
        for key, value in zip(keys, values, strict=True):
            assert _table_value(value) == leaves[key], (key, value, leaves[key])


def test_cited_design_sections_exist_in_the_repository():
    """Every "design.md section N" cited in the code, the tests, the benchmarks and the notebooks
    is a heading of docs/design.md's specification, and nothing cites the design documents that
    live outside the repository (SPEC.md, ARCHITECTURE.md)."""
    root = README.parent
    design = (root / "docs" / "design.md").read_text()
    spec = design[design.index("# Part 1") : design.index("# Part 2")]
    headings = set(re.findall(r"^## (\d+)\. ", spec, re.M))
    assert headings == {str(n) for n in range(1, 8)}, headings
    sources = [*root.glob("ais_jax/**/*.py"), *root.glob("tests/*.py"), *root.glob("benchmarks/*")]
    sources += [root / "notebooks" / "build.py", README]
    cited, outside = set(), []
    for path in sources:
        if path.is_file() and path.name != Path(__file__).name:
            text = path.read_text()
            cited |= {(path.name, n) for n in re.findall(r"design\.md`? section (\d+)", text)}
            outside += [path.name for name in ("SPEC.md", "ARCHITECTURE.md") if name in text]
    assert cited and all(n in headings for _, n in cited), sorted(cited)
    assert not outside, outside
