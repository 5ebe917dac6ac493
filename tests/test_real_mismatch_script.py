"""benchmarks/real_mismatch.py's core functions on a tiny random Llama: its metrics against a
float64 numpy recomputation from the same log-probs (and those log-probs against the model's
own forward), its layer loop against `model.forward`, one small ablation, and the toy alone
(``--formats ''``) measured end to end on a one-step tiny run."""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from training_run import TINY_RUN

from ais_jax import models
from ais_jax.config import TrainConfig, from_dict
from ais_jax.models.qwen3 import ModelConfig
from ais_jax.nn import layers as M
from ais_jax.nn.quant import quantize_params
from ais_jax.train.job import run_training

pytestmark = pytest.mark.slow  # ~30 s: the script's generation, scoring and layer loop compile

FORWARD = jax.jit(models.forward, static_argnums=1, static_argnames="return_hidden")
SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "real_mismatch.py"


@pytest.fixture(scope="module")
def rm():
    spec = importlib.util.spec_from_file_location("real_mismatch", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny():
    config = ModelConfig(
        vocab_size=96,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=64,
        qk_norm=False,
        attention_bias=False,
        max_position_embeddings=128,
    )
    params = models.init_params(config, jax.random.key(1), jnp.float32)
    # twice the 0.02 init (more peaked distributions), every value a bfloat16 one: the FP8
    # rollout copy's embedding and norms (bfloat16) are then the float32 model's own
    params = jax.tree.map(
        lambda a: (a * 2.0 if a.ndim >= 2 else a).astype(jnp.bfloat16).astype(jnp.float32), params
    )
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, 96, (4, 6)).astype(np.int32)
    pmask = np.ones((4, 6), bool)
    pmask[1, :2] = False  # one left-padded prompt
    prompts[1, :2] = 0
    return config, params, prompts, pmask


def _measure(rm, tiny, fmt: str, new_tokens: int, *, score_chunk: int, bin_width: int):
    """The script's `measure_format` of the tiny model's 4 prompts: per-tensor scales, key 0,
    token 5 as the stop id, the bf16 trainer."""
    config, params, prompts, pmask = tiny
    return rm.measure_format(
        params,
        config,
        prompts,
        pmask,
        jax.random.key(0),
        fmt=fmt,
        act_scaling="tensor",
        new_tokens=new_tokens,
        stop_ids=(5,),
        trainer_dtypes=("bf16",),
        gen_chunk=4,
        score_chunk=score_chunk,
        bin_width=bin_width,
    )


def _ref_metrics(lt, lr, mask):
    """The metrics written out directly, float64, no shared helper."""
    lt, lr = lt.astype(np.float64), lr.astype(np.float64)
    d = (lt - lr)[mask]
    r = np.exp(d)
    n = d.size
    seq = np.array([(lt[b] - lr[b])[mask[b]].sum() for b in range(lt.shape[0])])
    R = np.exp(seq)
    return {
        "n": n,
        "mean_abs": np.abs(d).mean(),
        "k1": (lr - lt)[mask].mean(),
        "k3": (r - 1 - np.log(r)).mean(),
        "chi2": (r**2).sum() / n - 1,
        "ess": r.sum() ** 2 / (n * (r**2).sum()),
        "ratio_max": r.max(),
        "seq_logratio_std": np.sqrt(((seq - seq.mean()) ** 2).sum() / (len(seq) - 1)),
        "seq_ess": R.sum() ** 2 / (len(R) * (R**2).sum()),
    }


def test_measure_format_metrics_match_numpy(rm, tiny):
    config, params, prompts, pmask = tiny
    T = 12
    out, raw = _measure(rm, tiny, "float4_e2m1fn", T, score_chunk=2, bin_width=4)
    tokens, mask, lr, lt = raw["tokens"], raw["mask"], raw["logp_rollout"], raw["logp_train_bf16"]
    assert tokens.shape == (4, T) and mask.all()  # no EOS stop: every row has T tokens
    # the trainer's log-probs are the bf16 model's full-sequence log-softmax of the tokens
    bf = M.cast_params(params, jnp.bfloat16)
    seq = np.concatenate([prompts, tokens], 1)
    smask = np.concatenate([pmask, mask], 1)
    logits = np.asarray(FORWARD(bf, config, jnp.asarray(seq), jnp.asarray(smask)), np.float64)
    logits = logits[:, prompts.shape[1] - 1 : -1]
    top = logits.max(-1, keepdims=True)
    lsm = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    own = np.take_along_axis(lsm, tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(lt, own, atol=2e-4)
    all_ = out["vs"]["bf16"]["all"]
    ref = _ref_metrics(lt, lr, mask)
    assert ref["mean_abs"] > 1e-3  # FP4 moves the log-probs: the comparison is not of zeros
    for k, v in ref.items():
        np.testing.assert_allclose(all_[k], v, rtol=1e-9, atol=1e-12, err_msg=k)
    lib = all_["library"]  # ais.mismatch_metrics, float32
    for ours, theirs in (("mean_abs", "mean_abs"), ("k3", "k3"), ("ess", "ess_ratio_raw")):
        np.testing.assert_allclose(all_[ours], lib[theirs], rtol=1e-4, atol=1e-6)
    # bins partition the tokens and each bin is the metric of its own tokens
    pos = out["vs"]["bf16"]["by_position"]
    assert [b["start"] for b in pos] == [0, 4, 8] and sum(b["n"] for b in pos) == mask.sum()
    sub = np.zeros_like(mask)
    sub[:, 4:8] = True
    np.testing.assert_allclose(pos[1]["ess"], _ref_metrics(lt, lr, mask & sub)["ess"], rtol=1e-9)
    prob = out["vs"]["bf16"]["by_probability"]
    assert sum(b["n"] for b in prob) == mask.sum()
    np.testing.assert_allclose(sum(b["share"] for b in prob), 1.0)
    p = np.exp(lr.astype(np.float64))
    for b in prob:
        sel = mask & (p >= b["lo"]) & ((p <= 1.0) if b["hi"] == 1.0 else (p < b["hi"]))
        assert b["n"] == sel.sum()
        if sel.any():
            np.testing.assert_allclose(b["chi2"], _ref_metrics(lt, lr, sel)["chi2"], rtol=1e-9)
    # the before/after split at the first stop id
    stop = raw["first_eos"]
    for b in range(4):
        hits = np.flatnonzero(tokens[b] == 5)
        assert stop[b] == (hits[0] if hits.size else T)
    split = out["vs"]["bf16"]
    assert split["before_first_eos"]["n"] + split["after_first_eos"].get("n", 0) == mask.sum()


def test_layer_loop_is_the_models_forward(rm, tiny):
    config, params, prompts, pmask = tiny
    L = config.num_layers
    tokens, mask = jnp.asarray(prompts), jnp.asarray(pmask)
    none = np.zeros((L, 7), bool)
    kw = dict(mask_BS=mask, config=config, with_stats=False, keep_residual=False)
    loop = functools.partial(rm.layer_loop, **kw)
    f32 = lambda a: np.asarray(a, np.float32)[pmask]  # noqa: E731
    # float32: the same numbers as model.forward, plain and with every projection quantized
    q = M.cast_params(quantize_params(params, "float8_e4m3fn"), jnp.float32)
    x0 = M.embed(params["embed"], tokens)
    x, stats, resid = loop(params["layers"], None, none, x0, 0, with_stats=True, keep_residual=True)
    np.testing.assert_allclose(
        f32(x), f32(FORWARD(params, config, tokens, mask, return_hidden=True))
    )
    xq, _, _ = loop(params["layers"], q["layers"], ~none, x0, 0)
    want_q = f32(FORWARD(q, config, tokens, mask, return_hidden=True))
    np.testing.assert_allclose(f32(xq), want_q, rtol=1e-5, atol=1e-5)
    assert np.abs(want_q - f32(x)).max() > 100 * np.abs(f32(xq) - want_q).max()
    # the statistics: the residual stream entering layer 1 and the final output
    h1 = np.abs(f32(resid[1]))
    np.testing.assert_allclose(stats[1, 0, 0], h1.max())
    np.testing.assert_allclose(stats[1, 0, 1], np.median(h1), rtol=1e-6)
    np.testing.assert_allclose(stats[1, 0, 2], np.median(h1.max(-1)), rtol=1e-6)
    np.testing.assert_allclose(stats[L, 0, 0], np.abs(f32(x)).max())
    # one layer quantized: starting at its saved input is the full pass
    only_last = rm._flags(L, [L - 1])
    x_tail, _, _ = loop(params["layers"], q["layers"], only_last, resid[L - 1], L - 1)
    x_full, _, _ = loop(params["layers"], q["layers"], only_last, x0, 0)
    np.testing.assert_array_equal(f32(x_tail), f32(x_full))
    # bfloat16: within the bf16-vs-float32 difference of model.forward (fusions round apart)
    bf = M.cast_params(params, jnp.bfloat16)
    xb, _, _ = loop(bf["layers"], None, none, M.embed(bf["embed"], tokens), 0)
    want_b = f32(FORWARD(bf, config, tokens, mask, return_hidden=True))
    assert np.abs(f32(xb) - want_b).max() <= np.abs(want_b - f32(x)).max()


def test_ablation_rows(rm, tiny):
    config, params, prompts, pmask = tiny
    rng = np.random.default_rng(1)
    response = rng.integers(3, 96, (4, 8)).astype(np.int32)
    seq = np.concatenate([prompts, response], 1)
    smask = np.concatenate([pmask, np.ones((4, 8), bool)], 1)
    P = prompts.shape[1]
    a = rm.ablation(params, config, seq, smask, P, extra_formats=(), dtype=jnp.float32)
    rows = {r["variant"]: r for r in a["variants"]}
    assert len(a["per_layer"]) == config.num_layers and len(a["activations"]) == 3
    for r in a["variants"] + a["per_layer"]:
        assert np.isfinite(r["mean_abs"]) and r["kl"] >= -1e-6, r
    # the teacher-forced log-probs: float32 forwards of the trainer and the FP8 rollout copy
    q = M.cast_params(quantize_params(params, "float8_e4m3fn"), jnp.float32)
    for p, got in ((params, a["logp_loop_trainer"]), (q, a["logp_teacher_forced"])):
        logits = FORWARD(p, config, jnp.asarray(seq), jnp.asarray(smask))[:, P - 1 : -1]
        lp = np.asarray(jax.nn.log_softmax(logits, -1), np.float64)
        own = np.take_along_axis(lp, response[..., None], -1)[..., 0]
        np.testing.assert_allclose(got, own, atol=1e-5)
    d = a["logp_loop_trainer"] - a["logp_teacher_forced"]
    every = rows["float8_e4m3fn W8A8, every projection"]
    np.testing.assert_allclose(every["mean_abs"], np.abs(d).mean(), rtol=1e-9)
    np.testing.assert_allclose(every["k3"], (np.exp(d) - 1 - d).mean(), rtol=1e-9)
    assert every["kl"] > 0
    assert rows["float8_e4m3fn weights only (bf16 activations)"]["kl"] > 0
    assert rows["float8_e4m3fn activations only (bf16 weights)"]["kl"] > 0


def test_tables_and_plots_of_the_toy_alone(rm, tiny, tmp_path):
    """``--formats ''`` measures only the toy: the tables list its position bins (section 3, with
    each bin's own numbers) and its probability bins, and the plot is drawn (both used to raise
    before the toy had position bins)."""
    out, _ = _measure(rm, tiny, "float8_e4m3fn", 6, score_chunk=4, bin_width=2)
    meta = {"title": "t", "date": "d", "commit": "c", "jax": "j", "jaxlib": "l", "cpu": "cpu"}
    meta.update(cores=2, model="m", task="a", prompts=4, prompt_len=6, new_tokens=6)
    toy = {"run": "runs/x", "step": 40, "task": "Arithmetic(...)", "max_new_tokens": 6}
    toy["formats"] = {"fp8": out}
    res = {"meta": meta, "formats": {}, "toy": toy}
    text = rm.tables(res)
    # the header names the toy that was measured, not SmolLM2's model and task (not measured)
    header = text.split("## 1.")[0]
    assert "model m" not in header and "task a" not in header
    assert "toy runs/x (parameters: 40), Arithmetic(...)" in header
    assert "chat template" not in header and "at most 6 new tokens" in header
    section3 = text.split("## 3.")[1].split("## 4.")[0].strip().splitlines()[1:]
    positions = out["vs"]["bf16"]["by_position"]
    assert section3[0].split() == ["positions", "toy", "fp8"] and len(positions) == 3
    for line, b in zip(section3[1:], positions, strict=True):
        cells = f"{b['mean_abs']:8.4f} {b['ess']:7.4f} {b['chi2']:8.4f}".split()
        assert line.split() == [f"{b['start']}-{b['stop'] - 1}", *cells]
    bins = [line for line in text.splitlines() if line.startswith("toy fp8 ")]
    assert len(bins) == 1 + len(out["vs"]["bf16"]["by_probability"])  # section 1's row + bins
    assert (
        rm.plots(res, tmp_path) == ["mismatch.png"] and (tmp_path / "mismatch.png").stat().st_size
    )


def test_toy_params_are_the_files_bits_or_a_clear_error(rm, tiny, tmp_path):
    """``--toy-params``: a comparison's saved start replaces the run's parameters bit for bit;
    a file of another model (a leaf missing, or of another shape) is refused by name."""
    from ais_jax.experiments.compare import save_params

    _, params, _, _ = tiny
    host = jax.device_get(params)
    start = jax.tree.map(lambda a: a + np.float32(0.25), host)  # not the run's own values
    got = rm.toy_params(host, save_params(tmp_path / "params.npz", start))
    assert jax.tree.structure(got) == jax.tree.structure(start)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(start), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    fewer = dict(start)
    fewer.pop(next(iter(fewer)))
    wider = jax.tree.map(lambda a: np.concatenate([a, a], -1) if a.ndim == 2 else a, start)
    for name, bad in (("fewer", fewer), ("wider", wider)):
        with pytest.raises(ValueError, match="--toy-params .*not parameters of the --toy-run"):
            rm.toy_params(host, save_params(tmp_path / f"{name}.npz", bad))


def test_toy_alone_neither_loads_nor_names_smollm2(rm, tmp_path, capsys):
    """``--formats ''`` with ``--toy-run``: SmolLM2 is not loaded (a missing ``--checkpoint`` is
    no error) and the title does not name it; with no toy either, a clear error."""
    run = tmp_path / "run"
    cfg = {**TINY_RUN, "steps": 1, "checkpoint_every": 1, "eval_every": 0}
    run_training(from_dict(TrainConfig, cfg), run, show_progress=False)
    absent = tmp_path / "absent.gguf"
    common = ["--formats", "", "--f32-formats", "", "--ablate-rows", "0", "--checkpoint", absent]
    out = tmp_path / "out"
    argv = [*map(str, common), "--toy-run", str(run), "--toy-formats", "fp8", "--prompts", "4"]
    assert rm.main([*argv, "--out", str(out)]) == 0
    title = (out / "table.txt").read_text().splitlines()[0]
    assert "toy alone" in title and "SmolLM2-135M" not in title
    assert json.loads((out / "results.json").read_text())["toy"]["formats"]["fp8"]["vs"]["bf16"]
    with pytest.raises(SystemExit):
        rm.main([*map(str, common), "--out", str(tmp_path / "none")])
    assert "nothing to measure: --formats '' and no --toy-run" in capsys.readouterr().err
