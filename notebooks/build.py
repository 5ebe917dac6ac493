"""Generates the tutorial notebooks from the cell sources in this file.

    python notebooks/build.py           # (re)write notebooks/*.ipynb
    python notebooks/build.py --check   # exit 1 if a committed notebook differs from its source

Edit the cells here, not the .ipynb files: the notebooks are committed without outputs and
with fixed cell ids, so a rebuild is byte-for-byte reproducible and a review reads this file.
`tests/test_notebooks.py` runs the check and executes every notebook.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent


def md(source: str) -> tuple[str, str]:
    return "markdown", source


def code(source: str) -> tuple[str, str]:
    return "code", source


# ------------------------------------------------------------------------------------------------
FP8_MISMATCH = [
    md(r"""
    # 01 · Why FP8 and BF16 give different token probabilities

    Quantized RL post-training samples answers with an **FP8** copy of the policy (faster, half
    the memory) and computes log-probs and gradients with the **BF16** trainer. Same checkpoint,
    yet the two give the same token different probabilities, so the samples do not come from
    the policy being trained: $\pi_\text{rollout} \neq \pi_\text{train}$, and the gradient is
    biased unless corrected (notebook 02). This notebook measures the gap from the bits up: the
    two number formats, the source's 3-token softmax example, how per-token gaps compound over
    a long response, and the measured gap of a real (random-weight) Qwen3 checkpoint between
    this library's FP8, FP6, FP4 and BF16 forward passes. All numerics come from `ais_jax`; the
    notebook only arranges and plots.
    """),
    code(r"""
    import tempfile

    import jax
    import jax.numpy as jnp
    import matplotlib.pyplot as plt
    import ml_dtypes
    import numpy as np

    import ais_jax
    from ais_jax.nn.quant import FORMATS, round_to_format

    E4M3 = FORMATS["float8_e4m3fn"]
    """),
    md(r"""
    ## 1. Two formats, bit by bit

    A normal float is $(-1)^s \cdot 2^{e - \text{bias}} \cdot 1.m$. **FP8 E4M3**
    (`float8_e4m3fn`) has 1 sign, 4 exponent and 3 mantissa bits, largest finite value 448 and
    no infinity. **BF16** has 1 sign, 8 exponent and 7 mantissa bits: float32's range with far
    fewer digits. Below, a few values rounded to each format (round to nearest, ties to even)
    and the bits that store them. `round_to_format` clips before casting: a plain cast of a
    value above 464 to `float8_e4m3fn` gives NaN.
    """),
    code(r"""
    def bits(value, dtype, exponent_bits):
        # "s eeee mmm": the sign, exponent and mantissa bits that store `value` in `dtype`
        width = 8 * np.dtype(dtype).itemsize
        word = format(int(np.asarray(value, dtype).view(f"uint{width}")), f"0{width}b")
        return f"{word[0]} {word[1:1 + exponent_bits]} {word[1 + exponent_bits:]}"


    print(f"{'x':>7} | {'E4M3 s eeee mmm':>15} {'value':>7} | "
          f"{'BF16 s eeeeeeee mmmmmmm':>23} {'value':>10}")
    for x in [0.1, 0.94, 1.0, 1.06, 300.0, 1000.0]:
        q8 = np.asarray(round_to_format(jnp.float32(x), E4M3))  # saturates at 448
        q16 = np.asarray(x, ml_dtypes.bfloat16)
        print(f"{x:7g} | {bits(q8, ml_dtypes.float8_e4m3fn, 4):>15} {float(q8):7g} | "
              f"{bits(q16, ml_dtypes.bfloat16, 8):>23} {float(q16):10g}")
    print("plain cast of 1000.0 to E4M3, no clipping:", np.asarray(1000.0, ml_dtypes.float8_e4m3fn))
    """),
    code(r"""
    print(f"{'format':>14} {'bits':>4} {'exp':>3} {'mant':>4} {'max':>9} {'min normal':>10} "
          f"{'step at 1':>9}")
    for name in ["bfloat16", *FORMATS]:
        f = ml_dtypes.finfo(getattr(ml_dtypes, name))
        print(f"{name:>14} {f.bits:>4} {f.nexp:>3} {f.nmant:>4} {float(f.max):>9.4g} "
              f"{float(f.smallest_normal):>10.4g} {float(f.eps):>9.4g}")
    """),
    md(r"""
    Between two neighbouring representable values there is a gap, and a value inside it is
    rounded to one end. The gap doubles at every power of two, so the *relative* step is
    constant over the normal range: $2^{-3} = 12.5\%$ for E4M3, $2^{-7} \approx 0.8\%$ for BF16
    (worst-case rounding error half of that). Per-tensor scaling, $s = \max|X| / 448$, moves a
    tensor into E4M3's range; it cannot buy mantissa bits. Below the smallest normal value
    (E4M3: $2^{-6}$) the gap stops shrinking and the relative error grows: small values in a
    tensor with a large outlier lose most of their digits.
    """),
    code(r"""
    def positive_grid(dtype, lo=2.0**-9, hi=448.0):
        # the representable values of `dtype` in [lo, hi]: round a dense grid, keep the distinct
        dense = np.geomspace(lo, hi, 400_000).astype(np.float32)
        values = np.unique(dense.astype(dtype).astype(np.float32))
        return values[values > 0]


    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for name, style in [("bfloat16", "-"), ("float8_e4m3fn", "-"), ("float8_e5m2", "--")]:
        grid = positive_grid(getattr(ml_dtypes, name))
        gap = np.diff(grid)
        axes[0].step(grid[:-1], gap, where="post", ls=style, label=name)
        axes[1].step(grid[:-1], gap / grid[:-1], where="post", ls=style, label=name)
    axes[0].set(xscale="log", yscale="log", xlabel="magnitude |x|",
                ylabel="gap to the next value", title="grid spacing")
    axes[1].set(xscale="log", yscale="log", xlabel="magnitude |x|", ylabel="gap / |x|",
                title="relative spacing")
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    fig.tight_layout()
    """),
    md(r"""
    ## 2. One softmax, three tokens

    The source's illustration: the BF16 trainer's logits for tokens A, B, C are
    $[1.06, 1.00, 0.94]$, and it *assumes* FP8 rounds them to $[1.00, 1.00, 0.9375]$. That is
    exactly what E4M3 does: near 1 its step is 0.125 above 1 and 0.0625 below. (Real BF16
    rounding moves the logits too, to $[1.0625, 1, 0.9414]$, by much less.) Below: the
    probabilities for the exact logits, BF16, every rollout format of the library cast
    directly as in the source, and E4M3 with per-tensor scaling, which is what the library does
    to activations.
    """),
    code(r"""
    logits = np.array([1.06, 1.00, 0.94], np.float32)
    scale = np.abs(logits).max() / E4M3.max  # per-tensor dynamic scale
    variants = {
        "exact": logits,
        "bfloat16": logits.astype(ml_dtypes.bfloat16),
        **{name: round_to_format(logits, fmt) for name, fmt in FORMATS.items()},
        "e4m3 scaled": round_to_format(logits / scale, E4M3).astype(jnp.float32) * scale,
    }
    variants = {k: np.asarray(v, np.float32) for k, v in variants.items()}
    probs = {k: 100 * np.asarray(jax.nn.softmax(v)) for k, v in variants.items()}

    print(f"{'variant':>14} | {'logits A, B, C':>22} | {'p(A) %':>6} {'p(B) %':>6} {'p(C) %':>6} "
          f"| vs exact (pt)")
    for k, z in variants.items():
        p, shift = probs[k], probs[k] - probs["exact"]
        print(f"{k:>14} | {' '.join(f'{v:6.4f}' for v in z):>22} | "
              f"{' '.join(f'{v:6.2f}' for v in p)} | {' '.join(f'{v:+.2f}' for v in shift)}")

    # the source's table: exact 35.35 / 33.29 / 31.35 %, FP8 34.02 / 34.02 / 31.96 %
    np.testing.assert_array_equal(variants["float8_e4m3fn"], [1.0, 1.0, 0.9375])
    np.testing.assert_allclose(probs["exact"], [35.35, 33.29, 31.35], atol=0.01)
    np.testing.assert_allclose(probs["float8_e4m3fn"], [34.02, 34.02, 31.96], atol=0.01)
    """),
    code(r"""
    shown = ["exact", "bfloat16", "float8_e4m3fn", "e4m3 scaled", "float8_e5m2", "float4_e2m1fn"]
    fig, ax = plt.subplots(figsize=(9, 3.5))
    width = 0.8 / len(shown)
    for i, k in enumerate(shown):
        ax.bar(np.arange(3) + (i - len(shown) / 2 + 0.5) * width, probs[k], width, label=k)
    ax.set(xticks=range(3), xticklabels=["token A", "token B", "token C"], ylim=(30, 36),
           ylabel="probability (%)", title="softmax of [1.06, 1.00, 0.94] after rounding")
    ax.legend(fontsize=8, ncol=3)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    """),
    md(r"""
    E4M3 turns BF16's favourite, A, into a tie with B (a -1.33 pt shift): one draw from these
    distributions already picks a different token now and then, and the rest of the response
    follows a different context. E5M2 and the FP6/FP4 formats flatten all three logits to 1.0
    (uniform). Scaling is no cure: it moves the logits into E4M3's top binade, where the step is
    $32/448 \cdot 1.06 \approx 0.076$ in logit units, and the gaps become 0.076 instead of 0.06.
    In a model, every matmul adds such errors to its outputs and the layers after it pass them
    on.

    ## 3. Small gaps compound over long responses

    A response's probability is the product of its token probabilities, so the sequence-level
    importance ratio is a product and its log a sum:

    $$\log w(x) = \sum_{t=1}^{T} \log \rho_t, \qquad
      \rho_t = \frac{\pi_\text{train}(x_t \mid x_{<t})}{\pi_\text{rollout}(x_t \mid x_{<t})}.$$

    A constant per-token factor compounds geometrically (the source: $0.99^{1000} \approx
    4.3\times 10^{-5}$). Random per-token gaps add up like a random walk: the spread of
    $\log w$ grows like $\sqrt{T}$, and the ESS ratio $(\sum w)^2 / (n \sum w^2)$ of the
    sequence weights collapses, while every single token's ratio stays tame. That is why TIS
    and AIS weight tokens, not sequences, and why long responses make the mismatch matter.

    Simulation: per-token $\log \rho \sim \mathcal{N}(-\sigma^2/2, \sigma^2)$ with
    $\sigma = 0.05$ (the $-\sigma^2/2$ makes $\mathbb{E}_\text{rollout}[\rho] = 1$, as for a
    true importance weight), 4096 sequences. The ESS ratios come from
    `ais_jax.mismatch_metrics`, given the log-ratios as `logp_train` and zeros as `logp_rollout`.
    """),
    code(r"""
    print(f"0.99 ** 1000 = {0.99 ** 1000:.1e}")

    sigma, n_seq, lengths = 0.05, 4096, [1, 4, 16, 64, 256, 1024]
    rng = np.random.default_rng(0)
    token_log_ratio = rng.normal(-sigma**2 / 2, sigma, size=(n_seq, max(lengths)))


    def ess_ratio(log_ratio_BT):
        zeros = np.zeros_like(log_ratio_BT)
        metrics = ais_jax.mismatch_metrics(log_ratio_BT, zeros, np.ones_like(zeros))
        return float(metrics["mismatch/ess_ratio_raw"])


    seq_log_ratio = {T: token_log_ratio[:, :T].sum(axis=1) for T in lengths}
    seq_std = [seq_log_ratio[T].std() for T in lengths]
    seq_ess = [ess_ratio(seq_log_ratio[T][:, None]) for T in lengths]  # one weight per sequence
    token_ess = [ess_ratio(token_log_ratio[:, :T]) for T in lengths]  # one weight per token
    print(f"{'T':>5} {'std log w':>9} {'ESS seq':>8} {'ESS token':>9}")
    for row in zip(lengths, seq_std, seq_ess, token_ess, strict=True):
        print("{:5d} {:9.3f} {:8.3f} {:9.4f}".format(*row))
    """),
    code(r"""
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for T in [16, 256, 1024]:
        axes[0].hist(seq_log_ratio[T], bins=80, histtype="step", density=True, label=f"T = {T}")
    axes[0].set(xlabel="sequence log-ratio  log w", ylabel="density",
                title="log w = sum of T token log-ratios")
    axes[1].loglog(lengths, seq_std, "o-", label="measured")
    axes[1].loglog(lengths, sigma * np.sqrt(lengths), "k--", label=r"$\sigma\sqrt{T}$")
    axes[1].set(xlabel="response length T", ylabel="std of log w", title="spread grows as sqrt(T)")
    axes[2].semilogx(lengths, seq_ess, "o-", label="sequence weights")
    axes[2].semilogx(lengths, token_ess, "s-", label="token weights")
    axes[2].semilogx(lengths, np.exp(-sigma**2 * np.array(lengths)), "k--",
                     label=r"$e^{-\sigma^2 T}$")
    axes[2].set(xlabel="response length T", ylabel="ESS ratio", ylim=(0, 1.05),
                title="sequence-level ESS collapses")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    """),
    md(r"""
    ## 4. A real checkpoint: this library's FP8 and BF16 forward passes

    A small Qwen3 built with `transformers` and saved with `save_pretrained`, exactly as a
    downloaded checkpoint would be. Its weights are random with std 0.2: Hugging Face's
    initialisation (std 0.02) gives nearly uniform next-token distributions whose log-probs
    barely move under quantization, while 0.2 gives logits of order one, as a trained model has
    (and a mismatch large enough to see at this size). `ais_jax.load_hf` reads it as the BF16
    trainer; `ais_jax.quantize_fp8` makes the rollout copy: every q/k/v/o/gate/up/down
    projection becomes an E4M3 `QArray` with a per-tensor scale, activations are quantized per
    matmul, and embeddings, norms and the LM head stay BF16. Both copies run the same model
    code; only the matmul wrapper `ais_jax.linear` differs.
    """),
    code(r"""
    import torch
    import transformers

    hf_config = transformers.Qwen3Config(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=192, max_position_embeddings=512,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    hf_model = transformers.Qwen3ForCausalLM(hf_config)
    with torch.no_grad():
        for name, weight in hf_model.named_parameters():
            if not name.endswith("norm.weight"):  # RMSNorm weights stay at 1
                weight.normal_(0.0, 0.2)
    checkpoint = tempfile.TemporaryDirectory(prefix="qwen3-random-")
    hf_model.save_pretrained(checkpoint.name)

    config, params = ais_jax.load_hf(checkpoint.name)  # BF16 trainer weights
    rollout_params = ais_jax.quantize_fp8(params)  # FP8 E4M3 W8A8 rollout copy
    print(config)
    print(f"{ais_jax.tree_bytes(params) / 1e3:.0f} kB of BF16 params -> "
          f"{ais_jax.tree_bytes(rollout_params) / 1e3:.0f} kB in the rollout copy "
          "(the embedding and LM head stay BF16)")
    """),
    md(r"""
    The rollout: 64 random 8-token prompts, 64 new tokens each, sampled from the FP8 copy
    (`Rollout.logp_plain` holds each sampled token's log-prob at sampling time). The trainer
    then re-scores the same tokens in BF16 with one full-sequence forward (`token_logprobs`),
    and `mismatch_metrics` summarises $d_t = \log\pi_\text{train} - \log\pi_\text{rollout}$.
    """),
    code(r"""
    prompts = np.random.default_rng(0).integers(0, config.vocab_size, size=(64, 8))
    rollout = ais_jax.generate(rollout_params, config, prompts, jax.random.key(0),
                               max_new_tokens=64)
    score = jax.jit(ais_jax.token_logprobs, static_argnums=1)  # the trainer's re-scoring
    sampled = (rollout.prompt_tokens, rollout.prompt_mask, rollout.tokens, rollout.mask)
    logp_train = score(params, config, *sampled)

    for k, v in ais_jax.mismatch_metrics(logp_train, rollout.logp_plain, rollout.mask).items():
        print(f"{k:>22}  {float(v):.4f}")
    """),
    code(r"""
    mask = np.asarray(rollout.mask)
    d_BT = np.where(mask, np.asarray(logp_train - rollout.logp_plain), 0.0)
    cumulative_BT = np.cumsum(d_BT, axis=1)  # log w of each prefix of each response
    positions = np.arange(1, d_BT.shape[1] + 1)

    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    axes[0].hist(d_BT[mask], bins=100, log=True)
    axes[0].set(xlabel=r"$d_t = \log\pi_{train} - \log\pi_{rollout}$ (nats)", ylabel="tokens",
                title=f"FP8 E4M3 vs BF16: mean |d| = {np.abs(d_BT[mask]).mean():.3f}")
    axes[1].plot(positions, cumulative_BT[:16].T, lw=0.8, alpha=0.6)
    axes[1].plot(positions, cumulative_BT.std(axis=0), "k", lw=2.5, label="std over 64 responses")
    axes[1].plot(positions, d_BT[mask].std() * np.sqrt(positions), "k--",
                 label=r"std$(d_t)\,\sqrt{t}$")
    axes[1].set(xlabel="response position t", ylabel=r"$\sum_{s \leq t} d_s$",
                title="sequence log-ratio of 16 responses")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    """),
    md(r"""
    ### Other rollout formats

    The same sampled tokens, re-scored teacher-forced by the rollout copy of every format the
    library offers (`quantize_params(params, fmt)`; the FP6 and FP4 formats are emulated on an
    FP8 container with their exact rounding), each compared with the BF16 trainer. Two
    reference bars: **bf16 vs fp32**, the trainer loaded in float32 against BF16 (the floor any
    two implementations show), and **e4m3 sampled**, the log-probs recorded while sampling.
    Those differ slightly from the teacher-forced E4M3 re-score because per-tensor activation
    scales depend on the batch-mates and on prefill vs one-token decode steps.
    """),
    code(r"""
    _, params_fp32 = ais_jax.load_hf(checkpoint.name, dtype=jnp.float32)


    def gap(logp_BT):
        m = ais_jax.mismatch_metrics(logp_train, logp_BT, rollout.mask)
        return float(m["mismatch/mean_abs"]), float(m["mismatch/ess_ratio_raw"])


    gaps = {"bf16 vs fp32": gap(score(params_fp32, config, *sampled)),
            "e4m3 sampled": gap(rollout.logp_plain)}
    for fmt in FORMATS:
        gaps[fmt] = gap(score(ais_jax.quantize_params(params, fmt), config, *sampled))

    print(f"{'rollout':>14} {'mean |d|':>9} {'token ESS':>9}")
    for k, (mean_abs, ess) in gaps.items():
        print(f"{k:>14} {mean_abs:9.4f} {ess:9.4f}")
    """),
    code(r"""
    names = list(gaps)
    colors = ["gray", "tab:blue"] + ["tab:orange"] * len(FORMATS)
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    axes[0].bar(names, [gaps[k][0] for k in names], color=colors)
    axes[0].set(yscale="log", ylabel="mean |logp_train - logp_rollout|",
                title="per-token log-prob gap vs the BF16 trainer")
    axes[1].bar(names, [gaps[k][1] for k in names], color=colors)
    axes[1].set(ylim=(0, 1.05), ylabel="ESS ratio of token weights", title="token-level ESS")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    """),
    md(r"""
    What to take away:

    - The gap follows the **mantissa bits**. The 3-bit formats (E4M3, FP6 E2M3) are the
      closest to BF16, the 2-bit ones (E5M2, FP6 E3M2) about twice as far, and FP4 (1 bit)
      is far beyond, with a token ESS near zero. At equal mantissa width, fewer exponent bits
      cost extra: FP6 E2M3 spans only four binades (normals from 1 to 7.5), so after
      per-tensor scaling the small entries of a tensor land in its coarse subnormals. A
      harsher format is the knob that makes the mismatch, and AIS, visible at toy scale.
    - The walks of the cumulative log-ratio drift downward: the rollout samples the tokens
      *it* likes, so on average $\log\pi_\text{train} < \log\pi_\text{rollout}$ on them
      (`mismatch/k1` > 0). That systematic part is the bias of uncorrected training; the
      spread around it is the variance a sequence-level weight would have to absorb.
    - Random weights of std 0.2 are harsher than a trained model: on a small trained model the
      project measured an E4M3 gap of 0.001 to 0.019 nats per token (`docs/design.md` section 7),
      growing with training as activation outliers grow. Always report the measured mismatch
      next to a result.

    Next: notebook 02 turns these per-token gaps into the AIS coefficient.
    """),
]

# ------------------------------------------------------------------------------------------------
AIS_WALKTHROUGH = [
    md(r"""
    # 02 · The AIS coefficient, step by step

    Importance sampling corrects the FP8-vs-BF16 gap of notebook 01 by re-weighting each token's
    advantage with $\rho = \pi_\text{train} / \pi_\text{rollout}$, truncated at $C$ (TIS). Full
    correction is not always best: when the mismatch is negligible it only adds noise (and
    removes the exploration the FP8 noise brings), and when a few weights dominate it inflates
    the gradient variance. **AIS** (Zhou et al., 2026) mixes the two with one coefficient
    $\alpha$ per mini-batch, $\tilde A = (1 + \alpha(\bar w - 1))\,A$, set by three diagnostics:
    can the weights be trusted, is a correction needed, does it amplify the variance. We
    recompute the source's 4-token example by hand, check `ais_jax.ais.adaptive()` against it,
    then sweep synthetic batches to see what moves $\alpha$.
    """),
    md(r"""
    The recipe, over the valid response tokens of one mini-batch:
    ```
    w_bar     = min(rho, C)                                   truncated weights
    alpha_ess = (1 + CV(w_bar)^2)^(-1/2)                      = sqrt(ESS ratio)
    alpha_mis = min(1, mean|logp_train - logp_rollout| / delta)
    Delta_sig = std(A * w_bar) / (std(A) + eps)
    alpha_var = max(0, (Delta_sig - gamma) / gamma)
    alpha     = clip(alpha_ess - beta_var * alpha_var, 0, 1) * alpha_mis
    ```
    Defaults: $C = 5$, $\delta = 0.02$, $\gamma = 1.2$, $\beta_\text{var} = 1$,
    $\epsilon = 10^{-6}$; standard deviations with ddof = 1, over the valid tokens of the
    mini-batch.
    """),
    code(r"""
    import jax
    import matplotlib.pyplot as plt
    import numpy as np

    from ais_jax import ais, grpo
    """),
    md(r"""
    ## 1. The source's example, by hand

    Four tokens with truncated weights $\bar w = [0.8, 1.0, 1.2, 2.0]$ and advantages
    $A = [1.2, 0.4, -0.2, -0.8]$. The weights are the ratios themselves (all below $C = 5$), so
    their log is the per-token log-prob gap and $\bar d = \text{mean}|\log \bar w| \approx 0.27$,
    far above $\delta = 0.02$: the necessity gate is fully open, $\alpha_\text{mis} = 1$, as the
    source assumes.
    """),
    code(r"""
    w_bar = np.array([0.8, 1.0, 1.2, 2.0])
    A = np.array([1.2, 0.4, -0.2, -0.8])
    C, delta, gamma, beta_var, eps = 5.0, 0.02, 1.2, 1.0, 1e-6

    cv = w_bar.std(ddof=1) / w_bar.mean()
    alpha_ess = (1 + cv**2) ** -0.5
    d_bar = np.abs(np.log(w_bar)).mean()
    alpha_mis = min(1.0, d_bar / delta)
    delta_sig = (A * w_bar).std(ddof=1) / (A.std(ddof=1) + eps)
    alpha_var = max(0.0, (delta_sig - gamma) / gamma)
    alpha = np.clip(alpha_ess - beta_var * alpha_var, 0, 1) * alpha_mis
    w_tilde = 1 + alpha * (w_bar - 1)
    A_tilde = w_tilde * A

    by_hand = dict(cv=cv, alpha_ess=alpha_ess, d_bar=d_bar, alpha_mis=alpha_mis,
                   delta_sig=delta_sig, alpha_var=alpha_var, alpha=alpha)
    for k, v in by_hand.items():
        print(f"{k:>10} = {v:.3f}")
    print(f"{'w_tilde':>10} = {np.round(w_tilde, 3)}")
    print(f"{'A_tilde':>10} = {np.round(A_tilde, 3)}")

    # the source's numbers (3 decimals)
    np.testing.assert_allclose([cv, alpha_ess, delta_sig, alpha_var, alpha],
                               [0.421, 0.922, 1.290, 0.075, 0.847], atol=5e-4)
    np.testing.assert_allclose(w_tilde, [0.831, 1.000, 1.169, 1.847], atol=5e-4)
    np.testing.assert_allclose(A_tilde, [0.997, 0.400, -0.234, -1.478], atol=5e-4)
    """),
    md(r"""
    Token 4 has the largest weight and the largest |A|: $\bar w A$ spreads wider than $A$
    ($\Delta_\sigma = 1.29 > \gamma$), so $\alpha_\text{var}$ takes 0.075 off the reliability
    0.922. The corrected advantage keeps its sign everywhere; AIS changes how strongly each
    token pushes, never the direction.

    ### The library does the same

    A correction takes log-probs, not weights: `correction(advantages, logp_train, logp_rollout,
    mask)` with `rho = exp(logp_train - logp_rollout)`. So we pass
    `logp_rollout = 0` and `logp_train = log(w_bar)`. The advantages here differ per token, so
    they are given as `[B, T] = [1, 4]`; in GRPO they are per sequence (`[B]`) and broadcast to
    its tokens.
    """),
    code(r"""
    correction = ais.adaptive(clip=C, delta=delta, gamma=gamma, beta_var=beta_var, eps=eps)
    logp_train, logp_rollout = np.log(w_bar)[None], np.zeros((1, 4))
    A_tilde_lib, metrics = correction(A[None], logp_train, logp_rollout, np.ones((1, 4)))

    from_library = dict(cv=metrics["ais/cv"], alpha_ess=metrics["ais/alpha_ess"],
                        d_bar=metrics["ais/mismatch"], alpha_mis=metrics["ais/alpha_mis"],
                        delta_sig=metrics["ais/var_ratio"], alpha_var=metrics["ais/alpha_var"],
                        alpha=metrics["ais/alpha"])
    print(f"{'':>10} {'by hand':>8} {'ais.adaptive':>12}")
    for k in by_hand:
        print(f"{k:>10} {by_hand[k]:8.4f} {float(from_library[k]):12.4f}")
    print(f"{'A_tilde':>10} {np.round(np.asarray(A_tilde_lib[0]), 4)}")

    np.testing.assert_allclose([float(from_library[k]) for k in by_hand], list(by_hand.values()),
                               rtol=1e-5)
    np.testing.assert_allclose(np.asarray(A_tilde_lib[0]), A_tilde, rtol=1e-5)
    """),
    md(r"""
    ## 2. $\alpha$ slides between no correction and TIS

    $\tilde w = 1 + \alpha(\bar w - 1)$ is a straight line through $(1, 1)$: $\alpha = 0$ is the
    uncorrected FP8 baseline (`ais.uncorrected()`), $\alpha = 1$ is truncated IS
    (`ais.truncated(C)`). `alpha_override` pins $\alpha$ (for ablations); the diagnostics are
    still computed and logged. Below, the weight applied to a unit advantage for a range of
    ratios, straight from the library.
    """),
    code(r"""
    rho = np.linspace(0.05, 7.0, 200)[None]  # one row of ratios, up to past C = 5
    log_rho, zeros, ones = np.log(rho), np.zeros_like(rho), np.ones_like(rho)


    def weights(corr):
        return np.asarray(corr(np.ones(1), log_rho, zeros, ones)[0][0])


    np.testing.assert_array_equal(weights(ais.adaptive(alpha_override=0.0)),
                                  weights(ais.uncorrected()))
    np.testing.assert_allclose(weights(ais.adaptive(alpha_override=1.0)),
                               weights(ais.truncated(5.0)), rtol=1e-6)

    fig, ax = plt.subplots(figsize=(6, 4))
    for a in [0.0, 0.25, 0.5, float(alpha), 1.0]:
        label = rf"$\alpha$ = {a:.3g}" + {0.0: " (uncorrected)", 1.0: " (TIS)"}.get(a, "")
        ax.plot(rho[0], weights(ais.adaptive(alpha_override=a)), label=label)
    ax.axvline(5.0, color="k", ls=":", lw=1)
    ax.set(xlabel=r"$\rho = \pi_{train} / \pi_{rollout}$", ylabel=r"$\tilde w$ (weight on A)",
           title=r"$\tilde w = 1 + \alpha(\min(\rho, C) - 1)$, C = 5")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    """),
    md(r"""
    ## 3. What moves $\alpha$: sweeps on synthetic batches

    A mini-batch shaped like the training job's: 8 prompts x G = 8 responses of 32 tokens,
    random rewards turned into group-relative advantages by `grpo.group_advantages`. We choose
    the token log-ratios $\log\rho$ ourselves and pass them as `logp_train` with
    `logp_rollout = 0`. Each sweep turns one knob; the correction is jitted once (the shapes
    never change).
    """),
    code(r"""
    B, G, T = 64, 8, 32
    rng = np.random.default_rng(0)
    advantages = np.asarray(grpo.group_advantages(rng.random(B), group_size=G))  # [B]
    mask = np.ones((B, T))
    adaptive = jax.jit(ais.adaptive())  # paper defaults
    KEYS = ["ais/alpha", "ais/alpha_ess", "ais/alpha_mis", "ais/alpha_var"]
    STYLE = {"ais/alpha": dict(color="k", lw=2.5), "ais/alpha_ess": dict(color="tab:blue"),
             "ais/alpha_mis": dict(color="tab:green"), "ais/alpha_var": dict(color="tab:red")}


    def diagnose(log_ratio_BT, adv=advantages):
        _, m = adaptive(adv, log_ratio_BT, np.zeros_like(log_ratio_BT), mask)
        return {k: float(v) for k, v in m.items()}


    def plot_sweep(ax, x, rows, xlabel, extra=()):
        for k in [*KEYS, *extra]:
            ax.plot(x, [r[k] for r in rows], label=k, **STYLE.get(k, dict(ls="--")))
        ax.set(xlabel=xlabel, ylim=(-0.05, 1.05))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    """),
    md(r"""
    ### 3a. Mismatch size: the necessity gate

    $\log\rho \sim \mathcal{N}(-\sigma^2/2, \sigma^2)$ for $\sigma$ from 0.001 to 1.5; the
    x-axis is the measured mismatch $\bar d$ = mean $|\log\rho|$. Below $\delta = 0.02$ the gate
    $\alpha_\text{mis} = \bar d/\delta$ scales the correction down: the two policies agree, and
    the FP8 noise is left to act as exploration. Above it, $\alpha$ follows the reliability
    $\alpha_\text{ess}$, which falls as the weights spread, and for large mismatch the variance
    penalty $\alpha_\text{var}$ cuts it further.
    """),
    code(r"""
    z = rng.standard_normal((B, T))  # the same draw for every sigma: smooth curves
    sigmas = np.geomspace(1e-3, 1.5, 40)
    rows = [diagnose(s * z - s**2 / 2) for s in sigmas]
    d_bar = [r["ais/mismatch"] for r in rows]

    fig, ax = plt.subplots(figsize=(7, 4))
    plot_sweep(ax, d_bar, rows, r"mismatch $\bar d$ = mean $|\log\rho|$ (log scale)",
               extra=["ais/ess_ratio_truncated"])
    ax.set_xscale("log")
    ax.axvline(0.02, color="tab:green", ls=":", lw=1)
    ax.text(0.021, 0.03, r"$\delta$ = 0.02", color="tab:green")
    ax.set_title("sweep 1: how far apart the two policies are")
    fig.tight_layout()
    """),
    md(r"""
    ### 3b. Weight concentration: heavy tails

    The same typical size, heavier tails: $\log\rho = s \cdot t_\nu$ (Student's t with $\nu$
    degrees of freedom, $s = 0.2$, so the gate stays open), from nearly Gaussian ($\nu = 100$)
    to beyond Cauchy ($\nu = 0.5$). A few tokens get large ratios and carry more and more of
    the total weight. Truncation at $C = 5$ caps each one (`is/clip_frac` is the fraction
    capped), but the CV still grows and $\alpha_\text{ess}$ falls; once those few large weights
    also stretch $\bar w A$, the variance penalty joins in, and for the heaviest tails AIS
    all but switches the correction off: it cannot be trusted.
    """),
    code(r"""
    dofs = np.geomspace(100, 0.5, 30)
    rows = [diagnose(0.2 * np.random.default_rng(1).standard_t(df, size=(B, T))) for df in dofs]

    fig, ax = plt.subplots(figsize=(7, 4))
    plot_sweep(ax, dofs, rows, r"degrees of freedom $\nu$ (log scale; heavier tails to the right)",
               extra=["ais/ess_ratio_truncated", "is/clip_frac"])
    ax.set_xscale("log")
    ax.invert_xaxis()
    ax.set_title("sweep 2: heavy-tailed weights")
    fig.tight_layout()
    """),
    md(r"""
    ### 3c. Advantage-weight correlation: the variance penalty

    Now the distribution of the weights stays (nearly) fixed, $\sigma = 0.4$, and only *where*
    the large weights land changes: each token's log-ratio is correlated, with coefficient $c$,
    with the standardized $|A|$ of its sequence. For $c > 0$ the large weights sit on the
    responses with the largest |advantage|, $\bar w A$ spreads wider than $A$,
    $\Delta_\sigma$ passes $\gamma = 1.2$ and $\alpha_\text{var}$ pulls $\alpha$ down, even
    though $\alpha_\text{ess}$ hardly moves. For $c < 0$ the large weights sit on
    near-zero advantages and do little harm.
    """),
    code(r"""
    abs_a = np.abs(advantages)
    z_abs_a = ((abs_a - abs_a.mean()) / abs_a.std())[:, None]  # [B, 1], broadcast over tokens
    noise = rng.standard_normal((B, T))
    sigma = 0.4
    corrs = np.linspace(-1, 1, 41)
    rows = [diagnose(sigma * (c * z_abs_a + np.sqrt(1 - c**2) * noise) - sigma**2 / 2)
            for c in corrs]

    fig, ax = plt.subplots(figsize=(7, 4))
    plot_sweep(ax, corrs, rows, r"correlation of $\log\rho$ with $|A|$")
    ax2 = ax.twinx()
    ax2.plot(corrs, [r["ais/var_ratio"] for r in rows], color="tab:red", ls=":",
             label=r"$\Delta_\sigma$ (right axis)")
    ax2.axhline(1.2, color="tab:red", lw=0.8, alpha=0.5)
    ax2.set_ylabel(r"$\Delta_\sigma$ = std(A w) / std(A)")
    ax2.legend(fontsize=8, loc="lower left")
    ax.set_title("sweep 3: large weights on large advantages")
    fig.tight_layout()
    """),
    md(r"""
    ## Summary

    | term | asks | moves when | effect on $\alpha$ |
    |---|---|---|---|
    | $\alpha_\text{mis}$ | is a correction needed? | policies agree, $\bar d < \delta$ | scales |
    | $\alpha_\text{ess}$ | can the weights be trusted? | a few weights dominate | lowers it |
    | $\alpha_\text{var}$ | does it add variance? | large weights on large \|A\| | subtracts |

    Every quantity is a scalar reduction of values the GRPO step already has, computed under
    `stop_gradient`. In training, `ais_jax.grpo.loss(..., correction=ais.adaptive())` applies it
    per mini-batch and logs the same `ais/*` metrics; notebook 03 plots them over a run.
    """),
]

# ------------------------------------------------------------------------------------------------
TRAIN_TINY = [
    md(r"""
    # 03 · Train a tiny model with FP8 rollouts and AIS

    The whole loop on a CPU in a minute or two: a tiny Qwen3-style model (character vocabulary)
    learns single-digit addition and subtraction by a supervised warm start, then GRPO. Every
    GRPO step quantizes the BF16 trainer weights to an FP8 E4M3 rollout copy, samples G = 8
    answers per prompt with it, rewards them (1 if the last integer is right), re-scores the
    sampled tokens with the BF16 trainer, computes $\alpha$ and the corrected advantages (AIS)
    and takes a PPO-clipped step in BF16. Only the public API is used: `ais_jax.load_config`
    shrinks the shipped `quickstart.yaml` with `key=value` overrides, `ais_jax.run_training`
    runs it. At this scale the curves are noisy and the answers short, so the mismatch stays
    small: the point is the plumbing, and how $\alpha$ follows the measured mismatch.
    """),
    md(r"""
    The full default is **`ais-jax train`** (this same `quickstart.yaml`, unshrunk: a 4-layer
    model, 2,000 SFT steps on a careless teacher's 1- and 2-digit additions, then 300 GRPO
    steps that fix its dropped carries; about five minutes on a 2-core CPU).
    Any override below works on the command line too, e.g.
    `ais-jax train --set steps=60 --set rollout.format=float4_e2m1fn`.
    """),
    code(r"""
    import json
    import shutil
    from pathlib import Path

    import matplotlib.pyplot as plt

    import ais_jax
    from ais_jax.analysis.plots import read_metrics

    config_path = Path(ais_jax.__file__).parent / "configs" / "quickstart.yaml"
    print(config_path.read_text())
    """),
    code(r"""
    overrides = [
        "steps=60",  # GRPO steps
        "checkpoint_every=60",
        "sft.steps=300",
        "sft.batch_size=32",
        "model.num_layers=2",
        "model.hidden_size=64",
        "model.intermediate_size=192",
        'task.options={ops: ["+", "-"], min_digits: 1, max_digits: 1}',
        "task.eval_examples=64",
        "rollout.prompts_per_step=8",  # x group_size 8 = 64 responses per step
    ]
    cfg = ais_jax.load_config(config_path, overrides)
    print(cfg.rollout)
    print(cfg.correction)
    """),
    code(r"""
    out_dir = Path("runs/notebook-03")
    shutil.rmtree(out_dir, ignore_errors=True)  # run_training refuses a directory with checkpoints
    summary = ais_jax.run_training(cfg, out_dir, show_progress=False)
    print(sorted(p.name for p in out_dir.iterdir()))
    """),
    md(r"""
    `metrics.jsonl` holds one JSON object per GRPO step (the same keys go to TensorBoard in
    `tb/`; `plots/` has PNGs of the main panels). Reward, $\alpha$ with its three components,
    the ESS ratio, and the mismatch $\bar d$ that drives the gate $\alpha_\text{mis}$:
    """),
    code(r"""
    # run_training's PNG writer switches matplotlib to the Agg backend; switch back to inline
    %matplotlib inline
    rows = read_metrics(out_dir / "metrics.jsonl")
    steps = [r["step"] for r in rows]


    def plot(ax, keys, title):
        for k in keys:
            style = dict(color="k", lw=2.5) if k == "ais/alpha" else {}
            ax.plot(steps, [r[k] for r in rows], label=k, **style)
        ax.set(title=title, xlabel="GRPO step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


    fig, axes = plt.subplots(2, 2, figsize=(12, 7))
    plot(axes[0, 0], ["reward/mean"], "mean reward of the FP8 samples (1 = correct)")
    plot(axes[0, 1], ["ais/alpha", "ais/alpha_ess", "ais/alpha_mis", "ais/alpha_var"],
         "AIS coefficient and its components")
    plot(axes[1, 0], ["ais/ess_ratio_truncated", "mismatch/ess_ratio_raw"], "ESS ratio of the token weights")
    plot(axes[1, 1], ["ais/mismatch"], r"mismatch $\bar d$ = mean |logp_train - logp_rollout|")
    axes[1, 1].axhline(cfg.correction.delta, color="k", ls=":", label=r"$\delta$")
    axes[1, 1].legend(fontsize=8)
    fig.tight_layout()
    """),
    code(r"""
    print(json.dumps(summary, indent=1))
    """),
    md(r"""
    Reading the plots: whenever the mismatch is below $\delta = 0.02$ the gate
    $\alpha_\text{mis} = \bar d/\delta$ sets $\alpha$, so $\alpha$ rises and falls with the
    measured mismatch; with 64 responses of a few tokens the weights are close to 1, the ESS
    ratio stays near 1 and $\alpha_\text{var}$ near 0. This is what the project measured at toy
    scale before writing any code (`docs/design.md` section 7): to see the reliability and variance
    terms act, use longer responses (`task.options={..., show_work: true}` writes out the
    column-by-column derivation) or a harsher rollout format (`rollout.format=float4_e2m1fn`).
    To compare corrections side by side, `ais-jax compare` runs the BF16, FP8, FP8+TIS and
    FP8+AIS arms over several seeds.
    """),
]

NOTEBOOKS = {
    "01_fp8_mismatch.ipynb": FP8_MISMATCH,
    "02_ais_walkthrough.ipynb": AIS_WALKTHROUGH,
    "03_train_tiny.ipynb": TRAIN_TINY,
}

METADATA = {
    "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
    "language_info": {"name": "python"},
}


def notebook(cells: list[tuple[str, str]]) -> nbformat.NotebookNode:
    """A notebook with no outputs, no execution counts and fixed cell ids."""
    nb = nbformat.v4.new_notebook(metadata=METADATA)
    for i, (kind, source) in enumerate(cells):
        new = nbformat.v4.new_markdown_cell if kind == "markdown" else nbformat.v4.new_code_cell
        cell = new(textwrap.dedent(source).strip("\n"))
        cell.id = f"cell-{i:02d}"
        nb.cells.append(cell)
    nbformat.validate(nb)
    return nb


def render(name: str) -> str:
    """The exact text of ``notebooks/<name>``."""
    return nbformat.writes(notebook(NOTEBOOKS[name])) + "\n"


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for name in NOTEBOOKS:
        path, text = HERE / name, render(name)
        if check:
            if not path.is_file() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"stale: {', '.join(stale)}; run `python notebooks/build.py`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
