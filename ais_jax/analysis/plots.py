"""PNG plots of a run's metrics.jsonl (reward, the AIS coefficients, ESS and mismatch), and of
a comparison's arms side by side (`plot_arm_curves`: one colour per arm, mean over seeds).

Figures are drawn on `matplotlib.figure.Figure` objects and saved directly, without pyplot,
so this works on a headless machine and never switches the backend of a notebook's kernel.
"""

from __future__ import annotations

import json
from pathlib import Path

PANELS = {
    "reward.png": ("Reward", ["reward/mean", "reward/accuracy"]),
    "ais.png": (
        "AIS coefficients",
        ["ais/alpha", "ais/alpha_ess", "ais/alpha_mis", "ais/alpha_var"],
    ),
    "ess.png": (
        "Effective sample size ratio",
        ["ais/ess_ratio_truncated", "mismatch/ess_ratio_raw", "mismatch/seq_ess_ratio_raw"],
    ),
    "mismatch.png": ("Rollout vs trainer mismatch", ["ais/mismatch", "mismatch/k3"]),
}


def trailing_mean(values, window: int) -> list[float]:
    """Mean of each value and the ``window - 1`` before it (fewer at the start).

    >>> trailing_mean([1, 2, 3, 4], 2)
    [1.0, 1.5, 2.5, 3.5]
    """
    import numpy as np

    cumsum = np.concatenate([[0.0], np.cumsum(np.asarray(values, float))])
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(ends - window, 0)
    return ((cumsum[ends] - cumsum[starts]) / (ends - starts)).tolist()


def read_metrics(path: str | Path) -> list[dict]:
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_run(metrics_file: str | Path, out_dir: str | Path) -> list[Path]:
    """Write one PNG per panel of `PANELS` (skipping metrics the run did not log)."""
    from matplotlib.figure import Figure

    rows = read_metrics(metrics_file)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for fname, (title, keys) in PANELS.items():
        keys = [k for k in keys if rows and k in rows[0]]
        if not keys:
            continue
        fig = Figure(figsize=(6, 3.5), dpi=110)
        ax = fig.subplots()
        steps = [r["step"] for r in rows]
        window = max(1, min(20, len(rows) // 10))
        for k in keys:
            values = [r[k] for r in rows]
            if window == 1:
                ax.plot(steps, values, label=k, lw=1.5)
                continue
            (raw,) = ax.plot(steps, values, lw=0.8, alpha=0.35)
            ax.plot(
                steps,
                trailing_mean(values, window),
                color=raw.get_color(),
                lw=1.8,
                label=f"{k} ({window}-step mean)",
            )
        ax.set_title(title)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / fname)
        written.append(out_dir / fname)
    return written


def plot_arms(runs: dict[str, list[list[dict]]], keys: list[str], out_file: str | Path) -> Path:
    """One panel per metric key, one line per arm (mean over seeds, band = min..max)."""
    return plot_arm_curves(runs, keys, out_file)


def plot_arm_curves(
    runs: dict[str, list[list[dict]]],
    keys: list[str],
    out_file: str | Path,
    *,
    window: int = 1,
    seed_lines: bool = False,
    ncols: int | None = None,
    titles: dict[str, str] | None = None,
    xlabel: str = "RL step",
    marker: str | None = None,
) -> Path:
    """One panel per metric key, one colour per arm (the same in every panel).

    ``runs[arm]`` holds one list of rows per seed (``metrics.jsonl`` or ``eval.jsonl`` rows, each
    with a ``step``). Each seed's curve is first smoothed with a ``window``-step `trailing_mean`
    (1 = raw); the thick line is the mean over seeds and the band spans min..max across seeds;
    ``seed_lines`` adds every seed's own curve as a thin line. Seeds are cut to the shortest
    one; an arm that did not log a key is left out of that panel. ``ncols`` panels per row
    (default: all in one row); ``titles`` maps a key to its panel title; ``marker`` marks the
    points of the mean line (for sparse curves such as held-out evaluations).
    """
    import numpy as np
    from matplotlib.figure import Figure

    ncols = min(ncols or len(keys), len(keys))
    nrows = -(-len(keys) // ncols)
    fig = Figure(figsize=(5 * ncols, 3.5 * nrows), dpi=110)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[len(keys) :]:
        ax.set_visible(False)
    for ax, key in zip(axes, keys, strict=False):
        for i, (arm, seeds) in enumerate(runs.items()):
            n = min((len(rows) for rows in seeds), default=0)
            if n == 0 or key not in seeds[0][0]:
                continue
            color = f"C{i % 10}"
            values_SN = np.array(
                [trailing_mean([r.get(key, np.nan) for r in rows[:n]], window) for rows in seeds]
            )
            steps = [r["step"] for r in seeds[0][:n]]
            if seed_lines:
                for values_N in values_SN:
                    ax.plot(steps, values_N, color=color, lw=0.6, alpha=0.45)
            ax.plot(steps, values_SN.mean(0), color=color, label=arm, lw=1.8, marker=marker, ms=4)
            if len(seeds) > 1:
                ax.fill_between(
                    steps, values_SN.min(0), values_SN.max(0), color=color, alpha=0.12, lw=0
                )
        title = (titles or {}).get(key, key)
        ax.set_title(title + (f" ({window}-step trailing mean)" if window > 1 else ""), fontsize=10)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_file)
    return Path(out_file)
