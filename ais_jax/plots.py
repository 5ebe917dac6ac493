"""PNG plots of a run's metrics.jsonl: reward, the AIS coefficients, ESS and mismatch.

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
    "ess.png": ("Effective sample size ratio", ["ais/ess_ratio", "mismatch/ess_ratio"]),
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
    import numpy as np
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5 * len(keys), 3.5), dpi=110)
    axes = fig.subplots(1, len(keys), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        for arm, seeds in runs.items():
            n = min(len(rows) for rows in seeds)
            if n == 0 or key not in seeds[0][0]:
                continue
            values = np.array([[r[key] for r in rows[:n]] for rows in seeds])
            steps = [r["step"] for r in seeds[0][:n]]
            ax.plot(steps, values.mean(0), label=arm, lw=1.5)
            ax.fill_between(steps, values.min(0), values.max(0), alpha=0.15)
        ax.set_title(key)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_file)
    return Path(out_file)
