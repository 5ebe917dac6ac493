"""Specifications of `ais-jax compare` (compare.py) and its statistics (stats.py).

- Arm names: ``<fmt>`` or ``<fmt>+<method>``; a bad one is an error naming it and the grammar.
- Statistics equal a NumPy reference (t-interval, paired difference, trapezoid AUC) and the
  worked examples in the docstrings.
- One tiny comparison (2 arms x 2 RL seeds x 3 RL steps, in one test): every run starts
  from bit-identical parameters (each run's step-0 checkpoint is the saved start), the outputs
  exist and results.json is strict JSON whose paired statistics match NumPy, and a re-run skips
  the finished runs, resumes an unfinished one and refuses another configuration.
"""

from __future__ import annotations

import dataclasses
import doctest
import json
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import scipy.stats
from training_run import TINY_RUN

from ais_jax.analysis import stats
from ais_jax.cli.main import build_parser, main
from ais_jax.config import CorrectionConfig, TrainConfig, dump_config, from_dict
from ais_jax.experiments import compare

T_975_4 = 2.7764451051977987  # Student t, 97.5% quantile, 4 degrees of freedom (tables)


# ---- arms ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, fmt, method",
    [
        ("bf16", "bf16", "none"),
        ("fp8", "float8_e4m3fn", "none"),
        ("fp8e5+tis", "float8_e5m2", "tis"),
        ("fp6+mis", "float6_e3m2fn", "mis"),
        ("fp6e2", "float6_e2m3fn", "none"),
        ("fp4+ais", "float4_e2m1fn", "ais"),
        (" FP4+AIS ", "float4_e2m1fn", "ais"),
        ("bf16+tis", "bf16", "tis"),
    ],
)
def test_parse_arm(name, fmt, method):
    arm = compare.parse_arm(name)
    assert (arm.format, arm.method) == (fmt, method)
    cfg = arm.config(TrainConfig(), seed=7)
    assert (cfg.rollout.format, cfg.correction.method, cfg.seed) == (fmt, method, 7)
    assert "+" not in arm.dirname and "/" not in arm.dirname
    assert cfg.rollout.act_scaling == "tensor"  # the base config's


def test_fp8tok_arms_scale_activations_per_token():
    base = TrainConfig()
    for name in ("fp8tok", "fp8tok+ais"):
        cfg = compare.parse_arm(name).config(base, seed=1)
        assert (cfg.rollout.format, cfg.rollout.act_scaling) == ("float8_e4m3fn", "token")
    assert compare.parse_arm("fp8+ais").config(base, 1).rollout.act_scaling == "tensor"


def test_the_base_level_goes_to_the_arms_that_weight_by_one():
    """A base config with ``correction.level: sequence`` (method tis) gives the tis and mis arms
    that level; the arms without one (none, ais) keep the default, which their config requires."""
    base = TrainConfig(correction=CorrectionConfig(method="tis", level="sequence"))
    levels = {a.name: a.config(base, 0).correction.level for a in compare.parse_arms(None)}
    assert levels == {
        "bf16": "token",
        "fp8": "token",
        "fp4": "token",
        "fp4+tis": "sequence",
        "fp4+ais": "token",
        "fp4+mis": "sequence",
    }


def test_default_arms():
    arms = compare.parse_arms(None)
    assert [a.name for a in arms] == ["bf16", "fp8", "fp4", "fp4+tis", "fp4+ais", "fp4+mis"]
    assert [a.method for a in arms] == ["none", "none", "none", "tis", "ais", "mis"]


@pytest.mark.parametrize(
    "spec, fragments",
    [
        ("bf16,fp9,fp4+xis", ["Unknown arm(s) ['fp9', 'fp4+xis']", "'fp8e5'", "'mis'"]),
        ("fp4+", ["Unknown arm(s) ['fp4+']"]),
        ("bf16,../../escape", ["Unknown arm(s) ['../../escape']"]),
        ("fp8+ais+tis", ["Unknown arm(s) ['fp8+ais+tis']"]),
        (" , ", ["No arms given"]),
        ("fp4,bf16,fp4", ["Arm(s) ['fp4'] listed more than once"]),
    ],
)
def test_bad_arms(spec, fragments):
    with pytest.raises(ValueError) as e:
        compare.parse_arms(spec)
    for fragment in fragments:
        assert fragment in str(e.value), str(e.value)


def test_bad_arm_on_the_command_line(tmp_path, capsys):
    code = main(["compare", "--arms", "bf16,fp3", "--out", str(tmp_path / "c"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "ais-jax compare: error: Unknown arm(s) ['fp3']" in err, err
    assert not (tmp_path / "c" / "config.yaml").exists()


def test_start_options_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["compare", "--vary-sft", "--start", "runs/a@3"])
    args = build_parser().parse_args(["compare", "--start", "runs/a@3"])
    assert (args.start, args.vary_sft, args.seeds) == ("runs/a@3", False, 5)
    assert compare.parse_start("runs/x@y@12") == (Path("runs/x@y"), 12)
    assert compare.parse_start("runs/x@y") == (Path("runs/x@y"), None)


# ---- statistics ---------------------------------------------------------------------------------


def test_t_quantile_matches_the_table():
    assert math.isclose(stats.t_quantile(0.95, 4), T_975_4, rel_tol=1e-12)
    assert math.isclose(stats.t_quantile(0.90, 1), 6.313751514675043, rel_tol=1e-12)


def test_paired_difference_matches_numpy():
    rng = np.random.default_rng(0)
    a_N, b_N = rng.uniform(0.3, 0.7, 5), rng.uniform(0.3, 0.7, 5)
    d_N = a_N - b_N
    mean = d_N.sum() / 5
    se = np.sqrt(((d_N - mean) ** 2).sum() / 4) / np.sqrt(5)
    got = stats.paired_difference(a_N, b_N)
    assert got.n == 5 and got.confidence == 0.95
    np.testing.assert_allclose(got.values, d_N, rtol=0, atol=1e-15)
    np.testing.assert_allclose(
        [got.mean, got.std_error, got.low, got.high],
        [mean, se, mean - T_975_4 * se, mean + T_975_4 * se],
        rtol=1e-12,
    )
    # the pairing matters: the unpaired interval of the same numbers is another one
    assert got.std_error != pytest.approx(
        np.sqrt(a_N.var(ddof=1) / 5 + b_N.var(ddof=1) / 5), rel=1e-3
    )


def test_worked_example():
    """Differences 1..5: mean 3, s = sqrt(10/4), se = s/sqrt(5) = 0.7071, half-width
    2.7764 * 0.7071 = 1.9632."""
    got = stats.paired_difference([2.0, 4.0, 6.0, 8.0, 10.0], [1.0, 2.0, 3.0, 4.0, 5.0])
    assert got.mean == 3.0
    assert got.std_error == pytest.approx(math.sqrt(0.5), rel=1e-12)
    assert (got.low, got.high) == pytest.approx((3 - 1.9632432, 3 + 1.9632432), abs=1e-7)
    single = stats.mean_ci([0.25])
    assert single.mean == 0.25 and math.isnan(single.std_error) and math.isnan(single.low)
    same = stats.paired_difference([0.5, 0.6], [0.4, 0.5])
    assert same.std_error == pytest.approx(0.0, abs=1e-15)
    assert same.low == pytest.approx(0.1) and same.high == pytest.approx(0.1)
    with pytest.raises(ValueError, match="one value of each arm per seed"):
        stats.paired_difference([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="non-empty"):
        stats.mean_ci([])


def test_stats_docstring_examples():
    results = doctest.testmod(stats)
    assert results.attempted >= 8 and results.failed == 0


def test_minimum_detectable_difference_has_the_power_it_claims():
    """At the returned difference, simulated paired t-tests over n seeds reject at the stated
    power (a normal approximation, z instead of t, would claim 8 seeds detect 0.99 s, where the
    power is 0.68); zero spread detects anything, one seed nothing."""
    rng = np.random.default_rng(0)
    for n, power in ((8, 0.8), (4, 0.5)):
        mde = stats.minimum_detectable_difference(2.0, n, power=power)
        d_RN = rng.normal(mde, 2.0, size=(20000, n))
        rejected = scipy.stats.ttest_1samp(d_RN, 0.0, axis=1).pvalue < 0.05
        assert abs(rejected.mean() - power) < 0.012, (n, power, rejected.mean())
    assert stats.minimum_detectable_difference(0.0, 8) == 0.0
    assert math.isnan(stats.minimum_detectable_difference(1.0, 1))
    assert math.isnan(stats.minimum_detectable_difference(math.nan, 8))
    with pytest.raises(ValueError, match="power=1.0 must be in"):
        stats.minimum_detectable_difference(1.0, 8, power=1.0)


def test_area_under_curve():
    steps, values = [0, 10, 30], [0.5, 0.7, 0.6]
    # (10 * (0.5 + 0.7) / 2 + 20 * (0.7 + 0.6) / 2) / 30
    assert stats.area_under_curve(steps, values) == pytest.approx(19 / 30, rel=1e-12)
    rng = np.random.default_rng(1)
    s_K = np.cumsum(rng.integers(1, 5, 12))
    v_K = rng.uniform(size=12)
    ref = sum((s_K[k + 1] - s_K[k]) * (v_K[k] + v_K[k + 1]) / 2 for k in range(11))
    assert stats.area_under_curve(s_K, v_K) == pytest.approx(ref / (s_K[-1] - s_K[0]), 1e-12)
    assert stats.area_under_curve([0, 5], [0.2, 0.2]) == pytest.approx(0.2)
    assert stats.area_under_curve([3], [0.4]) == 0.4
    with pytest.raises(ValueError, match="strictly increasing"):
        stats.area_under_curve([0, 0], [1.0, 1.0])


def _fake_records(arms, seeds: int, rng) -> dict[str, list[dict]]:
    """Per-seed records as `_run_record` writes them, with a seed effect shared by every arm."""
    seed_effect = rng.normal(0.6, 0.1, seeds)
    runs = {}
    for k, arm in enumerate(arms):
        runs[arm.name] = [
            {
                "seed": s,
                "final/accuracy": float(seed_effect[s] + 0.01 * k + rng.normal(0, 0.02)),
                "final/sampled_accuracy": float(seed_effect[s] + rng.normal(0, 0.02)),
                "auc/accuracy": float(seed_effect[s] - 0.1 + rng.normal(0, 0.02)),
                "start/accuracy": 0.5,
                "start/sampled_accuracy": 0.4,
                "ess/mean": 0.9,
                "ess/min": 0.8,
                "ess/first": float(0.95 - 0.01 * k + rng.normal(0, 0.003)),
                "ess/last": float(0.9 - 0.01 * k + rng.normal(0, 0.003)),
                "alpha/mean": 0.5,
                "mismatch/mean": 0.1,
                "entropy/mean": 0.3,
                "reward/mean": 0.5,
                "eval_steps": [0, 10],
            }
            for s in range(seeds)
        ]
    return runs


def test_contrasts_within_a_format_with_their_detectable_difference():
    """Every later arm of a format minus each earlier one is paired seed by seed (fp8+ais minus
    fp8+tis among them, never across formats or against the reference); each difference
    carries the smallest one its design detects, from the spread of its own per-seed
    differences; results.md shows them and the ESS of the first and last tenth of training."""
    arms = compare.parse_arms("bf16,fp8,fp8+tis,fp8+ais,fp4")
    runs = _fake_records(arms, 8, np.random.default_rng(0))
    got = compare.summarize(runs, arms)
    assert list(got["contrasts"]) == ["fp8+tis - fp8", "fp8+ais - fp8", "fp8+ais - fp8+tis"]
    assert list(got["paired"]) == ["fp8", "fp8+tis", "fp8+ais", "fp4"]
    key = "final/accuracy"
    d_N = np.array([a[key] - b[key] for a, b in zip(runs["fp8+ais"], runs["fp8+tis"], strict=True)])
    c = got["contrasts"]["fp8+ais - fp8+tis"][key]
    np.testing.assert_allclose(c["values"], d_N, atol=1e-15)
    assert c["mean"] == pytest.approx(d_N.mean(), abs=1e-15)
    assert c["detectable"] == pytest.approx(
        stats.minimum_detectable_difference(d_N.std(ddof=1), 8, power=0.8), rel=1e-12
    )
    other = got["paired"]["fp4"][key]["detectable"]
    assert other != pytest.approx(c["detectable"], rel=1e-3)  # each pair its own spread
    results = {
        "config": CFG.to_dict(),
        "arms": [dataclasses.asdict(a) for a in arms],
        "reference": "bf16",
        "seeds": list(range(8)),
        "confidence": 0.95,
        "start": {"all": {"source": "sft", "sft_seed": 0}},
        "runs": runs,
        **got,
        "provenance": {
            "versions": {"jax": "x", "jaxlib": "x"},
            "commit": "c",
            "device_count": 1,
            "device_kind": "cpu",
            "platform": "cpu",
            "cpu": "cpu",
        },
    }
    table = compare.format_results(results)
    row = next(line for line in table.splitlines() if line.startswith("| fp8+ais - fp8+tis |"))
    assert f"{100 * d_N.mean():+.1f} [" in row and f"| {100 * c['detectable']:.1f} |" in row
    assert "power 0.8" in table
    ess = next(line for line in table.splitlines() if line.startswith("| fp8+tis | 0.9"))
    first = np.mean([r["ess/first"] for r in runs["fp8+tis"]])
    last = np.mean([r["ess/last"] for r in runs["fp8+tis"]])
    assert f"| {first:.4f} [" in ess and f"| {last - first:+.4f} [" in ess


# ---- a tiny comparison --------------------------------------------------------------------------

SEEDS, ARMS = 2, "bf16,fp4+ais"
CFG = from_dict(
    TrainConfig,
    {
        **TINY_RUN,
        "seed": 3,
        "steps": 3,
        "task": {**TINY_RUN["task"], "eval_examples": 8},
        "sft": {**TINY_RUN["sft"], "steps": 5},
    },
)


def _strict_json(text: str):
    def refuse(name):
        raise ValueError(f"non-strict JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def _run_dirs(out: Path) -> list[Path]:
    return [out / arm / f"seed{s}" for arm in ("bf16", "fp4_ais") for s in (3, 4)]


def _check_same_start(out: Path) -> None:
    """Every (arm, seed) run started from bit-identical parameters: the saved start."""
    start = compare.load_params(out / "start" / "params.npz")
    digest = compare.params_digest(start)
    assert json.loads((out / "start" / "params.json").read_text())["sha256"] == digest
    assert not list(out.glob("start/seed*.npz"))  # one SFT, not one per seed
    results = _strict_json((out / "results.json").read_text())
    assert {r["start_sha256"] for rs in results["runs"].values() for r in rs} == {digest}
    leaves = sorted(compare._flat(start).items())
    for run_dir in _run_dirs(out):
        # what the run itself saved at step 0, through Run's own restore machinery
        params, info = compare.start_from_checkpoint(CFG, f"{run_dir}@0")
        assert info["step"] == 0
        assert compare.params_digest(params) == digest, run_dir
        for (name, a), (name_b, b) in zip(
            leaves, sorted(compare._flat(params).items()), strict=True
        ):
            assert name == name_b and a.dtype == b.dtype and np.array_equal(a, b), name
    # the held-out set is the same for every run: equal start params give equal step-0 accuracy
    start_acc = {r["start/accuracy"] for rs in results["runs"].values() for r in rs}
    assert len(start_acc) == 1


def _check_outputs(out: Path, table: str) -> None:
    """The outputs exist; results.json is strict JSON whose paired statistics match NumPy."""
    for name in ("results.md", "accuracy.png", "diagnostics.png", "config.yaml"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "results.md").read_text() == table + "\n"
    results = _strict_json((out / "results.json").read_text())
    assert [a["name"] for a in results["arms"]] == ["bf16", "fp4+ais"]
    assert results["reference"] == "bf16" and results["seeds"] == [3, 4]
    assert results["config"] == CFG.to_dict()
    assert results["provenance"]["versions"]["jax"]
    ref, arm = results["runs"]["bf16"], results["runs"]["fp4+ais"]
    for key in ("final/accuracy", "final/sampled_accuracy", "auc/accuracy"):
        d_N = np.array([a[key] - b[key] for a, b in zip(arm, ref, strict=True)])
        got = results["paired"]["fp4+ais"][key]
        se = d_N.std(ddof=1) / np.sqrt(2)
        half = 12.706204736174707 * se  # t 97.5%, 1 dof
        np.testing.assert_allclose(got["values"], d_N, atol=1e-12)
        np.testing.assert_allclose(
            [got["mean"], got["low"], got["high"]],
            [d_N.mean(), d_N.mean() - half, d_N.mean() + half],
            atol=1e-12,
        )
    for r in arm:  # every run's AUC is the trapezoid mean of its eval.jsonl curve
        rows = [json.loads(x) for x in (out / "fp4_ais" / f"seed{r['seed']}" / "eval.jsonl").open()]
        assert [row["step"] for row in rows] == r["eval_steps"] == [0, 3]
        assert r["auc/accuracy"] == pytest.approx(np.mean([x["eval/accuracy"] for x in rows]))
        assert 0 < r["ess/min"] <= r["ess/mean"] <= 1 and r["mismatch/mean"] > 0
        steps = [
            json.loads(x) for x in (out / "fp4_ais" / f"seed{r['seed']}" / "metrics.jsonl").open()
        ]
        ess = [x["ais/ess_ratio_truncated"] for x in steps if "ais/ess_ratio_truncated" in x]
        assert len(ess) == 3 and (r["ess/first"], r["ess/last"]) == (ess[0], ess[-1])
    assert "reference arm **bf16**" in table and "| fp4+ais | float4_e2m1fn | ais |" in table
    assert "seed 3" in table and "seed 4" in table and "jax " in table.splitlines()[-1]


def _check_rerun(out: Path, caplog, capsys) -> None:
    """A re-run skips finished runs, resumes an unfinished one and refuses another setup."""
    runs = _run_dirs(out)
    before = {p: (p / "summary.json").stat().st_mtime_ns for p in runs}
    start_mtime = (out / "start" / "params.npz").stat().st_mtime_ns
    (runs[-1] / "summary.json").unlink()  # as if killed after its last checkpoint
    with caplog.at_level(logging.INFO, logger="ais_jax"):
        compare.run_comparison(CFG, out, seeds=SEEDS, arms=ARMS, show_progress=False)
    skipped = [r.getMessage() for r in caplog.records if "finished earlier, skipped" in r.message]
    assert len(skipped) == 3, skipped
    assert {p: (p / "summary.json").stat().st_mtime_ns for p in runs[:-1]} == {
        p: before[p] for p in runs[:-1]
    }
    assert (runs[-1] / "summary.json").is_file()  # resumed from its step-3 checkpoint
    assert (out / "start" / "params.npz").stat().st_mtime_ns == start_mtime
    _strict_json((out / "results.json").read_text())

    # the command line on the finished comparison: nothing to run, the table printed
    config_file = out.parent / "cmp.yaml"
    config_file.write_text(dump_config(CFG))
    argv = ["compare", "--config", str(config_file), "--out", str(out), "--no-progress"]
    assert main([*argv, "--seeds", "2", "--arms", ARMS]) == 0
    assert "reference arm **bf16**" in capsys.readouterr().out

    with pytest.raises(ValueError, match=r"another configuration \(steps: 3 there, 4 here\)"):
        compare.run_comparison(dataclasses.replace(CFG, steps=4), out, seeds=SEEDS, arms=ARMS)
    with pytest.raises(ValueError, match="one shared SFT start, not one SFT per seed"):
        compare.run_comparison(CFG, out, seeds=SEEDS, arms=ARMS, vary_sft=True)


def _check_other_starts(out: Path, tmp_path: Path) -> None:
    """``start=RUN_DIR@STEP`` branches every run from that checkpoint; ``vary_sft`` gives each
    seed its own SFT (seed 3's is the shared start above: SFT is deterministic)."""
    branch = tmp_path / "branch"
    source = f"{out / 'bf16' / 'seed3'}@3"
    table = compare.run_comparison(CFG, branch, seeds=1, arms="fp4", start=source)
    info = json.loads((branch / "start" / "params.json").read_text())
    assert (info["source"], info["step"]) == ("checkpoint", 3)
    assert info["sha256"] == compare.params_digest(compare.start_from_checkpoint(CFG, source)[0])
    assert info["sha256"] != compare.params_digest(compare.load_params(out / "start/params.npz"))
    assert "starts from checkpoint step 3" in table and "Paired" not in table  # one arm
    other_model = dataclasses.replace(CFG, model=dataclasses.replace(CFG.model, hidden_size=32))
    with pytest.raises(ValueError, match="that run's model"):
        compare.start_from_checkpoint(other_model, source)

    varied = tmp_path / "varied"
    compare.run_comparison(CFG, varied, seeds=2, arms="bf16", vary_sft=True, show_progress=False)
    digests = [json.loads((varied / f"start/seed{s}.json").read_text())["sha256"] for s in (3, 4)]
    assert digests[0] != digests[1] and not (varied / "start" / "params.npz").exists()
    assert digests[0] == json.loads((out / "start" / "params.json").read_text())["sha256"]
    results = _strict_json((varied / "results.json").read_text())
    assert [r["start_sha256"] for r in results["runs"]["bf16"]] == digests


@pytest.mark.slow
def test_comparison(tmp_path, caplog, capsys):
    """One test, so that pytest-xdist runs the comparison once, on one worker."""
    out = tmp_path / "cmp"
    table = compare.run_comparison(CFG, out, seeds=SEEDS, arms=ARMS, show_progress=False)
    _check_same_start(out)
    _check_outputs(out, table)
    _check_rerun(out, caplog, capsys)
    _check_other_starts(out, tmp_path)
