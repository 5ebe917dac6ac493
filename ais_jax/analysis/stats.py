"""Statistics of a comparison across seeds: t-intervals, paired differences, area under a curve.

Pure NumPy/SciPy on host values (one number per seed), no JAX. With ``n`` seeds,
``x_1 .. x_n``, confidence ``c`` (0.95 by default):

    mean      m  = (1/n) sum_i x_i
    std       s  = sqrt( sum_i (x_i - m)^2 / (n - 1) )          (ddof = 1)
    std error se = s / sqrt(n)
    interval  m -+ t_{(1 + c)/2, n - 1} * se                     (Student t quantile)

A paired difference applies the same to ``d_i = a_i - b_i``, where ``a_i`` and ``b_i`` come
from the same seed (same start, same data order, same rollout keys), so the seed-to-seed
spread that both arms share cancels. With ``n = 1`` there is no spread to estimate: the
standard error and the interval are NaN (written as ``null`` in JSON).

The power of such a design: the smallest true mean difference ``delta`` that the two-sided
paired t-test at level ``1 - c`` detects with probability ``power`` (0.8), given the spread
``s`` of the differences, solves (``T'`` noncentral t, ``n - 1`` degrees of freedom, noncentrality
``delta sqrt(n) / s``)

    P(|T'| > t_{(1 + c)/2, n - 1}) = power.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import scipy.integrate
import scipy.optimize
import scipy.stats

__all__ = [
    "Estimate",
    "area_under_curve",
    "mean_ci",
    "minimum_detectable_difference",
    "paired_difference",
    "t_quantile",
]


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A mean over seeds with its standard error and ``confidence`` t-interval ``[low, high]``.

    ``values`` are the per-seed numbers the estimate is over (for a paired difference, the
    per-seed differences ``a_i - b_i``)."""

    mean: float
    std_error: float
    low: float
    high: float
    n: int
    confidence: float
    values: tuple[float, ...]

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "values": list(self.values)}


def t_quantile(confidence: float, dof: int) -> float:
    """``t_{(1 + confidence)/2, dof}``, the half-width of a two-sided interval in standard errors.

    >>> round(t_quantile(0.95, 4), 6)
    2.776445
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence!r} must be in (0, 1).")
    if dof < 1:
        raise ValueError(f"A t quantile needs dof >= 1, got {dof}.")
    return float(scipy.stats.t.ppf((1 + confidence) / 2, dof))


def mean_ci(values: Sequence[float], confidence: float = 0.95) -> Estimate:
    """Mean of ``values`` with ``se = std(ddof=1) / sqrt(n)`` and the interval
    ``mean -+ t_{(1 + c)/2, n - 1} * se``.

    >>> e = mean_ci([1.0, 2.0, 3.0, 4.0, 5.0])
    >>> round(e.mean, 6), round(e.std_error, 6), round(e.low, 4), round(e.high, 4)
    (3.0, 0.707107, 1.0368, 4.9632)
    """
    x_N = np.asarray(values, np.float64)
    if x_N.ndim != 1 or x_N.size == 0:
        raise ValueError(f"mean_ci needs a non-empty list of numbers, got shape {x_N.shape}.")
    n = int(x_N.size)
    mean = float(x_N.mean())
    if n < 2:
        se = low = high = math.nan
    else:
        se = float(scipy.stats.sem(x_N, ddof=1))
        half = t_quantile(confidence, n - 1) * se
        low, high = mean - half, mean + half
    return Estimate(mean, se, low, high, n, confidence, tuple(float(v) for v in x_N))


def paired_difference(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> Estimate:
    """Paired difference ``a - b`` over seeds: `mean_ci` of ``d_i = a_i - b_i``.

    ``a[i]`` and ``b[i]`` must come from the same seed. ``values`` of the result are the
    ``d_i``.

    >>> d = paired_difference([0.5, 0.6, 0.7], [0.4, 0.6, 0.5])
    >>> [round(v, 2) for v in d.values], round(d.mean, 4), d.n
    ([0.1, 0.0, 0.2], 0.1, 3)
    """
    a_N, b_N = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a_N.shape != b_N.shape:
        raise ValueError(
            f"A paired difference needs one value of each arm per seed; got {a_N.shape} and "
            f"{b_N.shape}."
        )
    return mean_ci(a_N - b_N, confidence)


def minimum_detectable_difference(
    std: float, n: int, power: float = 0.8, confidence: float = 0.95
) -> float:
    """The smallest mean difference a paired t-test over ``n`` seeds detects with ``power``.

    ``std`` is the standard deviation of the per-seed differences (ddof = 1), ``confidence``
    the test's ``1 - level``; the answer solves the noncentral-t power equation of the module
    docstring exactly (no normal approximation), and NaN where ``n < 2`` or ``std`` is not
    finite. Zero spread detects every difference: 0.

    >>> round(minimum_detectable_difference(1.0, 8), 4)  # 8 seeds: 1.16 standard deviations
    1.156
    >>> round(minimum_detectable_difference(0.02, 16, power=0.9), 5)
    0.01735
    """
    if not 0 < power < 1:
        raise ValueError(f"power={power!r} must be in (0, 1).")
    if n < 2 or not math.isfinite(std):
        return math.nan
    if std < 0:
        raise ValueError(f"std={std!r} must be >= 0.")
    if std == 0:
        return 0.0
    dof, t_crit = n - 1, t_quantile(confidence, n - 1)

    def shortfall(effect_in_stds: float) -> float:
        nc = effect_in_stds * math.sqrt(n)
        # P(T' < -t) = P(T'' > t) with T'' of noncentrality -nc (cdf(-t, nc) is NaN at large nc)
        rejects = scipy.stats.nct.sf(t_crit, dof, nc) + scipy.stats.nct.sf(t_crit, dof, -nc)
        return float(rejects) - power

    effect = scipy.optimize.brentq(shortfall, 0.0, 100.0, xtol=1e-12)
    return float(effect * std)


def area_under_curve(steps: Sequence[float], values: Sequence[float]) -> float:
    """Trapezoid integral of ``values`` over ``steps``, divided by the step span:

        AUC = (1 / (s_K - s_0)) sum_k (s_{k+1} - s_k) (v_k + v_{k+1}) / 2

    i.e. the time-average of the curve over training (an accuracy AUC is an accuracy). One
    point gives its value. Steps must be strictly increasing.

    >>> round(area_under_curve([0, 10, 30], [0.5, 0.7, 0.6]), 6)
    0.633333
    """
    s_K, v_K = np.asarray(steps, np.float64), np.asarray(values, np.float64)
    if s_K.ndim != 1 or s_K.shape != v_K.shape or s_K.size == 0:
        raise ValueError(
            f"area_under_curve needs equal-length, non-empty steps and values; got "
            f"{s_K.shape} and {v_K.shape}."
        )
    if s_K.size == 1:
        return float(v_K[0])
    if np.any(np.diff(s_K) <= 0):
        raise ValueError(f"steps must be strictly increasing, got {s_K.tolist()}.")
    return float(scipy.integrate.trapezoid(v_K, s_K) / (s_K[-1] - s_K[0]))
