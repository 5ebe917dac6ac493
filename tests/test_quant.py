"""Specification of `quant.py`: the low-precision grids, per-tensor scaling, the one matmul.

What must hold: every format's rounding is exactly ml_dtypes' (round-half-to-even, saturating
at +-max, never NaN); quantize/dequantize error is within half an ulp of the scaled grid;
extreme and degenerate tensors stay finite; weights are quantized from their bfloat16
rounding; `linear` is the float64 reference of "dequantize both operands, matmul" with the
activation scale taken over the valid rows only; the rollout tree has the expected layout and
byte count. The last test prints how far each format moves a tiny Qwen3's log-probs.
"""

from __future__ import annotations

import dataclasses
import re
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from training_run import MODEL

from ais_jax.models import forward, init_params
from ais_jax.models.qwen3 import ModelConfig
from ais_jax.nn import quant
from ais_jax.nn.layers import cast_params
from ais_jax.nn.quant import FORMATS, LINEAR_WEIGHTS, QArray

ALL_FORMATS = pytest.mark.parametrize("name", list(FORMATS))
_round = jax.jit(quant.round_to_format, static_argnums=(1, 2))
# One compilation each instead of dozens of op-by-op ones (slow on a small CPU).
_init_params = jax.jit(init_params, static_argnums=(0, 2))
_quantize_fp8 = jax.jit(quant.quantize_fp8, static_argnames=("act_scaling", "lm_head"))
_quantize_params = jax.jit(
    quant.quantize_params, static_argnums=1, static_argnames=("act_scaling", "lm_head")
)


def ml_round(x, name: str) -> np.ndarray:
    """The reference: clip to the format's range, cast with ml_dtypes, back to float32."""
    fmax = float(ml_dtypes.finfo(getattr(ml_dtypes, name)).max)
    x = np.clip(np.asarray(x, np.float32), -fmax, fmax)
    return np.asarray(x, dtype=getattr(ml_dtypes, name)).astype(np.float32)


def ours_round(x, name: str, dtype=None) -> np.ndarray:
    return np.asarray(_round(jnp.asarray(x, jnp.float32), FORMATS[name], dtype).astype(jnp.float32))


def assert_scale(scale, amax, fmax) -> None:
    """scale == amax / fmax up to two float32 ulp: XLA's float32 division is not correctly
    rounded, unlike NumPy's (1 ulp off for ~half of the values on CPU; GPU: div.full.f32)."""
    expected = np.asarray(amax, np.float32) / np.float32(fmax)
    diff = np.abs(np.asarray(scale, np.float32) - expected)
    assert (diff <= 2 * np.spacing(expected)).all(), f"scale {scale} != amax/fmax {expected}"


def assert_codes(codes, x, scale, name: str) -> None:
    """``codes`` are ml_dtypes' rounding of the scaled value x / scale, computed exactly, up to
    a 4e-7 relative error in that value (~3 float32 ulp: XLA's division). The slack only
    matters at exact ties, which bf16-rounded weights hit often."""
    codes = np.asarray(jnp.asarray(codes).astype(jnp.float32))
    scaled = np.asarray(x, np.float64) / np.asarray(scale, np.float64)
    ok = (codes == ml_round(scaled * (1 - 4e-7), name)) | (
        codes == ml_round(scaled * (1 + 4e-7), name)
    )
    assert ok.all(), f"{(~ok).sum()} codes differ from the rounding of x / scale"


def grid(name: str) -> np.ndarray:
    """Every non-negative finite value of the format, built from its bit layout."""
    f = FORMATS[name]
    step = 2.0 ** (f.minexp - f.nmant)
    values = {m * step for m in range(2**f.nmant)}  # zero and the subnormals
    for e in range(f.minexp, int(np.floor(np.log2(f.max))) + 1):
        values |= {(1 + m / 2**f.nmant) * 2.0**e for m in range(2**f.nmant)}
    return np.array(sorted(v for v in values if v <= f.max), np.float32)


def randn(shape, seed: int, std: float = 1.0) -> jax.Array:
    """Gaussian test data from NumPy (jax.random compiles per shape: slow op by op)."""
    return jnp.asarray(std * np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def heavy_tailed(kind: str, shape, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = {
        "normal": lambda: rng.standard_normal(shape),
        "student_t2": lambda: rng.standard_t(2, shape),
        "cauchy": lambda: rng.standard_cauchy(shape),
    }[kind]()
    # A log-uniform spread of magnitudes guarantees elements in both the normal and the
    # subnormal range of the scaled grid, whatever the distribution's amax.
    spread = np.exp(rng.uniform(np.log(1e-12), 0.0, shape[-1])) * rng.choice([-1, 1], shape[-1])
    x[0] = spread * np.abs(x).max()
    return x.astype(np.float32)


# ---- the grids: exact agreement with ml_dtypes ---------------------------------------------------


@ALL_FORMATS
def test_grid_matches_ml_dtypes(name):
    """The format table (max, mantissa bits, min exponent) describes ml_dtypes' format."""
    g = grid(name)
    np.testing.assert_array_equal(ml_round(g, name), g)
    assert g[-1] == FORMATS[name].max
    np.testing.assert_array_equal(ours_round(g, name), g)
    np.testing.assert_array_equal(ours_round(-g, name), -g)
    expected_dtype = jnp.dtype(getattr(jnp, name) if FORMATS[name].native else jnp.float8_e4m3fn)
    assert _round(jnp.asarray(g), FORMATS[name]).dtype == expected_dtype


@pytest.mark.slow
@ALL_FORMATS
@pytest.mark.parametrize("dtype", [None, jnp.bfloat16])
def test_round_to_format_equals_ml_dtypes(name, dtype):
    """Grid points, exact midpoints (ties: half to even), one float32 ulp either side of them,
    random magnitudes over the whole range and values beyond max (saturate, never NaN). With
    ``dtype`` (the codes as bfloat16, rounded in float32 arithmetic: the bfloat16 operands of
    `QArray.operand_dtype`), the same values."""
    f = FORMATS[name]
    g = grid(name)
    mid = (g[:-1] + g[1:]) / 2  # exact in float32: one more bit than the grid
    rng = np.random.default_rng(0)
    magnitudes = 2.0 ** rng.uniform(f.minexp - f.nmant - 4, np.log2(f.max) + 3, 20_000)
    half_top_ulp = 2.0 ** (np.floor(np.log2(f.max)) - f.nmant - 1)  # e4m3fn: 448 + 16 = 464
    beyond = np.array(
        [
            f.max * 1.01,
            f.max + half_top_ulp,
            f.max * 1.5,
            f.max * 4,
            1e30,
            np.finfo(np.float32).max,
        ],
        np.float32,
    )
    pos = np.concatenate(
        [
            g,
            mid,
            np.nextafter(mid, np.float32(0)),
            np.nextafter(mid, np.inf),
            magnitudes.astype(np.float32),
            beyond,
        ]
    )
    x = np.concatenate([pos, -pos]).astype(np.float32)
    if dtype is not None:
        assert _round(jnp.asarray(x), f, dtype).dtype == dtype
    ours = ours_round(x, name, dtype)
    assert np.isfinite(ours).all()
    np.testing.assert_array_equal(ours, ml_round(x, name))
    np.testing.assert_array_equal(ours_round(beyond, name, dtype), np.float32(f.max))
    np.testing.assert_array_equal(ours_round(-beyond, name, dtype), np.float32(-f.max))
    # ties really are exercised: some midpoints round down (to the even neighbour)
    mid_ours = ours_round(mid, name, dtype)
    assert (mid_ours == g[:-1]).any() and (mid_ours == g[1:]).any()


@ALL_FORMATS
@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.floats(-1e4, 1e4, width=32), min_size=1, max_size=32))
def test_round_to_format_property(name, values):
    x = np.resize(np.asarray(values, np.float32), 32)  # a fixed shape: one compilation
    ours = ours_round(x, name)
    assert np.isfinite(ours).all()
    np.testing.assert_array_equal(ours, ml_round(x, name))


# ---- quantize / dequantize error -----------------------------------------------------------------


@ALL_FORMATS
@pytest.mark.parametrize("dist", ["normal", "student_t2", "cauchy"])
def test_quantize_error_within_half_ulp(name, dist):
    """Per-tensor scale s = amax / fmax; |deq - x| <= 2^-(nmant+1) |x| where |x/s| is in the
    normal range, <= half the subnormal step 2^(minexp-nmant-1) * s below it."""
    f = FORMATS[name]
    x = heavy_tailed(dist, (48, 256), seed=zlib.crc32(f"{name}/{dist}".encode()))
    codes, scale = quant.quantize_activation(jnp.asarray(x), f)
    assert_scale(scale, np.abs(x).max(), f.max)
    assert_codes(codes, x, scale, name)
    deq = np.asarray(codes.astype(jnp.float32), np.float64) * float(scale)
    err = np.abs(deq - x)
    normal = np.abs(x) / float(scale) >= 2.0**f.minexp
    assert normal.any() and (~normal).any()
    rel_bound = 2.0 ** -(f.nmant + 1)
    abs_bound = 2.0 ** (f.minexp - f.nmant - 1) * float(scale)
    rel = err[normal] / np.abs(x[normal])
    assert rel.max() <= rel_bound * (1 + 1e-6), f"{name}/{dist}: max rel err {rel.max():.4g}"
    assert err[~normal].max() <= abs_bound * (1 + 1e-6)
    assert rel.max() > 0.5 * rel_bound  # the bound is tight, not vacuous


@pytest.mark.slow
@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2", "float4_e2m1fn"])
def test_weight_scales_per_layer(name):
    """A stacked [L, O, I] weight gets one scale per layer, amax / fmax of its bf16 rounding,
    and dequantizes within the same half-ulp bound."""
    f = FORMATS[name]
    w = heavy_tailed("student_t2", (3, 40, 64), seed=3) * np.array([1e-3, 1.0, 50.0])[:, None, None]
    w = w.astype(np.float32)
    q = quant.quantize_weight(jnp.asarray(w), name)
    w16 = w.astype(ml_dtypes.bfloat16).astype(np.float32)
    assert q.scale.shape == (3,) and q.scale.dtype == jnp.float32 and q.quant.shape == w.shape
    assert_scale(q.scale, np.abs(w16).max((1, 2)), f.max)
    assert_codes(q.quant, w16, np.asarray(q.scale)[:, None, None], name)
    deq = np.asarray(q.dequantize(), np.float64)
    s = np.asarray(q.scale, np.float64)[:, None, None]
    normal = np.abs(w16) / s >= 2.0**f.minexp
    err = np.abs(deq - w16)
    assert (
        err
        <= np.where(
            normal, 2.0 ** -(f.nmant + 1) * np.abs(w16), 2.0 ** (f.minexp - f.nmant - 1) * s
        )
        * (1 + 1e-6)
    ).all()


def test_weights_are_quantized_from_their_bf16_rounding():
    w = np.random.default_rng(1).standard_normal((2, 96, 80)).astype(np.float32) * 0.05
    w16 = w.astype(ml_dtypes.bfloat16).astype(np.float32)
    assert (w16 != w).mean() > 0.9
    for name in FORMATS:
        a, b = quant.quantize_weight(w, name), quant.quantize_weight(w16, name)
        c = quant.quantize_weight(jnp.asarray(w, jnp.bfloat16), name)
        for other in (b, c):
            np.testing.assert_array_equal(
                np.asarray(a.quant).view(np.uint8), np.asarray(other.quant).view(np.uint8)
            )
            np.testing.assert_array_equal(
                np.asarray(a.scale).view(np.uint32), np.asarray(other.scale).view(np.uint32)
            )
    # and that differs from quantizing the raw float32 weight (the test is not vacuous)
    f = FORMATS["float8_e4m3fn"]
    raw = _round(jnp.asarray(w / (np.abs(w).max((1, 2), keepdims=True) / f.max)), f)
    assert (np.asarray(raw).view(np.uint8) != np.asarray(a.quant).view(np.uint8)).any()


# ---- saturation and degenerate tensors -----------------------------------------------------------


def _set(x, index, value):
    x = x.copy()
    x[index] = value
    return x


# Built in NumPy: XLA on CPU flushes subnormal results of its own arithmetic to zero.
EXTREMES = {
    "outliers_1e4": lambda x: _set(_set(x, (3, 5), 1e4), (7, 1), -1e4),
    "huge_1e30": lambda x: _set(_set(x, (0, 0), 1e30), (1, 1), -1e30),
    "subnormal_f32": lambda x: x * np.float32(1e-40),  # every element a float32 subnormal
    "tiny_normal_f32": lambda x: x * np.float32(1e-37 / np.abs(x).max()),  # amax/448 subnormal
    "all_zero": lambda x: x * np.float32(0.0),
}


def extreme(case: str, shape, seed: int) -> jax.Array:
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return jnp.asarray(EXTREMES[case](x).astype(np.float32))


@pytest.mark.parametrize("case", list(EXTREMES))
@pytest.mark.parametrize("act_scaling", quant.ACT_SCALINGS)
def test_extreme_activations_stay_finite(case, act_scaling):
    x = extreme(case, (8, 64), seed=0)
    fmt = FORMATS["float8_e4m3fn"]
    codes, scale = quant.quantize_activation(x, fmt, act_scaling=act_scaling)
    assert np.isfinite(np.asarray(codes.astype(jnp.float32))).all()
    assert np.isfinite(np.asarray(scale)).all() and (np.asarray(scale) > 0).all()
    amax = np.abs(np.asarray(x)).max()
    if act_scaling == "tensor" and amax > 448 * np.finfo(np.float32).tiny:
        assert_scale(scale, amax, 448)
    if case in ("outliers_1e4", "huge_1e30"):  # the outliers themselves survive
        deq = np.asarray(codes.astype(jnp.float32)) * np.asarray(scale)
        big = np.abs(np.asarray(x)) >= 1e4
        np.testing.assert_allclose(deq[big], np.asarray(x)[big], rtol=2**-4)
    w = quant.quantize_weight(randn((16, 64), seed=1, std=0.1), act_scaling=act_scaling)
    for dtype in (jnp.float32, jnp.bfloat16):
        y = np.asarray(quant.linear(x.astype(dtype), w).astype(jnp.float32))
        assert np.isfinite(y).all()
        if case == "all_zero":
            np.testing.assert_array_equal(y, 0.0)


@pytest.mark.parametrize("case", ["huge_1e30", "tiny_normal_f32", "all_zero"])
def test_extreme_weights_stay_finite(case):
    w = extreme(case, (16, 64), seed=2)
    q = quant.quantize_weight(w)
    assert np.isfinite(np.asarray(q.dequantize())).all()
    assert np.isfinite(np.asarray(q.scale)).all() and float(q.scale) > 0


# ---- the matmul ------------------------------------------------------------------------------


def reference_linear(x, q: QArray, row_mask=None) -> tuple[np.ndarray, np.ndarray]:
    """float64 NumPy "dequantize both operands, matmul", on the codes `quant` produced after
    checking them: the weight's against ml_dtypes (test_weight_scales_per_layer), the
    activation's scale against amax / fmax over the valid rows and its codes against
    ml_dtypes. Also returns sum_i |x_i w_i|, the scale of float32 accumulation error."""
    f = FORMATS[q.fmt]
    x32 = np.asarray(x, np.float32)
    if q.act_scaling == "token":
        amax = np.abs(x32).max(-1, keepdims=True)
    else:
        valid = np.ones(x32.shape[:-1], bool) if row_mask is None else np.asarray(row_mask)
        amax = np.abs(np.where(valid[..., None], x32, 0)).max()
    codes, scale = quant.quantize_activation(
        jnp.asarray(x32), f, act_scaling=q.act_scaling, row_mask=row_mask
    )
    assert_scale(scale, amax, f.max)
    assert_codes(codes, x32, scale, q.fmt)
    xq = np.asarray(codes.astype(jnp.float32), np.float64) * np.asarray(scale, np.float64)
    wq = np.asarray(q.dequantize(), np.float64)
    return np.einsum("...i,oi->...o", xq, wq), np.einsum("...i,oi->...o", np.abs(xq), np.abs(wq))


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2", "float6_e2m3fn", "float4_e2m1fn"])
@pytest.mark.parametrize("act_scaling", quant.ACT_SCALINGS)
@pytest.mark.parametrize("codes", ["stored", "widened", "storage operands", "bf16 operands"])
def test_linear_matches_float64_reference(name, act_scaling, codes):
    """The W8A8 matmul is the float64 reference to 1e-5 relative to sum |x_i w_i|; the
    per-tensor activation amax excludes the masked-out rows (one holds the largest values).
    The same with the weight codes held as bfloat16 (`widen_codes`, the CPU decode loop's),
    and with each `QArray.operand_dtype`."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 5, 128)) * np.exp(rng.standard_normal((3, 5, 1)))
    x[1, 0] = 300.0
    x = jnp.asarray(x, jnp.float32)
    row_mask = jnp.ones((3, 5), bool).at[1, :2].set(False).at[2, 4].set(False)
    q = quant.quantize_weight(randn((48, 128), seed=4, std=0.05), name, act_scaling=act_scaling)
    if codes == "widened":
        q = quant.widen_codes(q, backend="cpu")
        assert q.quant.dtype == jnp.bfloat16
    elif codes.endswith("operands"):
        q = quant.set_operand_dtype(q, "storage" if codes.startswith("storage") else "bfloat16")
    y = np.asarray(quant.linear(x, q, row_mask=row_mask))
    ref, mag = reference_linear(x, q, row_mask)
    assert y.dtype == np.float32 and np.isfinite(y).all()
    valid = np.asarray(row_mask) if act_scaling == "tensor" else np.ones((3, 5), bool)
    err, mag = np.abs(y - ref)[valid], mag[valid]
    assert (err <= 1e-5 * mag).all(), f"max |y - ref| / sum|x w| = {(err / mag).max():.3g}"
    # bf16 activations (the model's compute dtype) take the same path
    y16 = quant.linear(x.astype(jnp.bfloat16), q, row_mask=row_mask)
    assert y16.dtype == jnp.bfloat16 and np.isfinite(np.asarray(y16, np.float32)).all()


@pytest.mark.slow
@ALL_FORMATS
def test_widened_codes_are_the_same_numbers(name):
    """`widen_codes` holds the codes as bfloat16 on CPU, value for value (every code of every
    format, the grid's extremes included); off CPU and when already widened it returns the
    weight itself."""
    f = FORMATS[name]
    every = np.arange(256, dtype=np.uint8).view(getattr(ml_dtypes, name)).astype(np.float32)
    every = np.resize(every[np.isfinite(every)], 16 * 64).reshape(16, 64)  # each value, tiled
    w = randn((3, 16, 64), seed=11) * jnp.logspace(-3, 3, 64, dtype=jnp.float32)[None, None]
    q = quant.quantize_weight(w, name)
    q = q.replace(quant=q.quant.at[0].set(_round(jnp.asarray(every), f)))
    np.testing.assert_array_equal(np.asarray(q.quant[0].astype(jnp.float32)), every)
    wide = quant.widen_codes(q, backend="cpu")
    assert wide.quant.dtype == jnp.bfloat16 and wide.fmt == q.fmt
    np.testing.assert_array_equal(
        np.asarray(wide.quant, np.float32), np.asarray(q.quant.astype(jnp.float32))
    )
    np.testing.assert_array_equal(wide.scale, q.scale)
    assert quant.widen_codes(wide, backend="cpu") is wide
    for backend in ("gpu", "tpu"):
        assert quant.widen_codes(q, backend=backend) is q


@pytest.mark.slow
@pytest.mark.parametrize("act_scaling", quant.ACT_SCALINGS)
def test_bf16_operands_are_the_fp8_products_without_an_fp8_activation(act_scaling):
    """``operand_dtype="bfloat16"``: the same products as the FP8 operands (exact in float32:
    the codes have at most 4 significant bits), so the same result up to float32 summation
    order, and the program XLA receives converts no value to FP8 (the activation codes are
    rounded in float32 arithmetic), so XLA:GPU cannot take it for an FP8 GEMM: one widening
    convert, of the weight's codes, feeds the dot."""
    x = randn((6, 256), seed=21) * 3.0
    q = quant.quantize_weight(randn((96, 256), seed=22, std=0.05), act_scaling=act_scaling)
    fp8 = np.asarray(quant.linear(x, q))
    bf16_ops = quant.set_operand_dtype(q, "bfloat16")
    y = np.asarray(quant.linear(x, bf16_ops))
    mag = np.abs(np.asarray(x)) @ np.abs(np.asarray(q.dequantize())).T
    np.testing.assert_array_less(np.abs(y - fp8), 1e-6 * mag + 1e-30)
    lowered = jax.jit(quant.linear).lower(x, bf16_ops).as_text()
    converts = [line for line in lowered.splitlines() if "stablehlo.convert" in line]
    assert not any(re.search(r"-> tensor<[\dx]*f8", line) for line in converts), converts
    assert sum("f8E4M3FN" in line for line in converts) == 1, converts
    stored = jax.jit(quant.linear).lower(x, q).as_text()
    assert any(re.search(r"-> tensor<[\dx]*f8", line) for line in stored.splitlines())


@pytest.mark.slow
def test_step_operands_give_few_row_gpu_matmuls_bf16_operands():
    """`step_operands`: off CPU, below `FP8_GEMM_MIN_ROWS` rows, every QArray whose operand
    dtype is not set multiplies bfloat16 operands; one set explicitly keeps its choice; plain
    leaves are untouched; on CPU and from the threshold on, the tree itself comes back."""
    params = quant.quantize_params(_init_params(TREE_CONFIG, jax.random.key(0)))
    params["layers"]["o_proj"] = quant.set_operand_dtype(params["layers"]["o_proj"], "storage")
    is_q = lambda x: isinstance(x, quant.QArray)  # noqa: E731
    few = quant.step_operands(params, 64, backend="gpu")
    for name, w in few["layers"].items():
        if name == "o_proj":
            assert w.operand_dtype == "storage"
        elif is_q(w):
            assert w.operand_dtype == "bfloat16" and w.quant is params["layers"][name].quant
        else:
            assert w is params["layers"][name]
    assert few["embed"] is params["embed"]
    for rows, backend in ((64, "cpu"), (quant.FP8_GEMM_MIN_ROWS, "gpu"), (4096, "tpu")):
        assert quant.step_operands(params, rows, backend=backend) is params
    with pytest.raises(ValueError) as info:
        quant.set_operand_dtype(params, "float16")
    assert "'float16'" in str(info.value) and "'bfloat16'" in str(info.value)


def test_linear_plain_weight_is_the_plain_matmul():
    x, w = randn((2, 3, 32), seed=5), randn((16, 32), seed=6)
    np.testing.assert_allclose(
        quant.linear(x, w), np.einsum("bsi,oi->bso", x, w), rtol=1e-5, atol=1e-5
    )
    assert quant.linear(x.astype(jnp.bfloat16), w).dtype == jnp.bfloat16


def test_dot_dtype_upcasts_only_many_bf16_rows_on_cpu():
    rows = quant.CPU_FLOAT32_DOT_MIN_ROWS
    assert quant.dot_dtype(jnp.bfloat16, rows, "cpu") == jnp.float32
    assert quant.dot_dtype(jnp.bfloat16, rows - 1, "cpu") == jnp.bfloat16
    for backend in ("gpu", "tpu"):
        assert quant.dot_dtype(jnp.bfloat16, rows, backend) == jnp.bfloat16
    for dtype in (jnp.float32, jnp.float16, jnp.float8_e4m3fn):
        assert quant.dot_dtype(dtype, rows, "cpu") == dtype


@pytest.mark.parametrize("columns", [False, True])
def test_linear_bf16_rows_as_float32_same_products_and_same_backward(columns):
    """Many bf16 rows on CPU: float32 operands holding the bf16 values. The forward equals a
    float64 reference of the bf16 values to float32 summation error (the products are exact);
    the gradients, through the same backward dots, equal bitwise those of the bf16 dot. A
    `Columns` weight (more than `COLUMNS_MAX_ROWS` rows here) takes the same plain path."""
    rows = quant.CPU_FLOAT32_DOT_MIN_ROWS
    x = randn((rows // 64, 64, 96), seed=11).astype(jnp.bfloat16)
    w = randn((48, 96), seed=12)  # float32 master weights, cast to bf16 inside
    weight = quant.Columns(w) if columns else w

    def bf16_dot(x, w):  # the bf16 x bf16 -> float32 dot `linear` ran before
        w = w.w_OI if columns else w
        return jnp.einsum("bsi,oi->bso", x, w.astype(x.dtype), preferred_element_type=jnp.float32)

    hlo = jax.jit(lambda x, w: quant.linear(x, w, out_dtype=jnp.float32)).lower(x, weight)
    hlo = hlo.as_text()
    assert "xf32>) -> tensor" in hlo.split("dot_general")[1].split("\n")[0]
    y = np.asarray(quant.linear(x, weight, out_dtype=jnp.float32), np.float64)
    xs, ws = np.asarray(x, np.float64), np.asarray(w.astype(jnp.bfloat16), np.float64)
    ref = np.einsum("bsi,oi->bso", xs, ws)
    bound = 96 * np.finfo(np.float32).eps * np.einsum("bsi,oi->bso", np.abs(xs), np.abs(ws))
    assert np.all(np.abs(y - ref) <= bound)
    c = randn((rows // 64, 64, 48), seed=13)  # a linear loss: the cotangent is c itself

    def loss(f):
        return lambda x, w: jnp.sum(f(x, w).astype(jnp.bfloat16).astype(jnp.float32) * c)

    linear = lambda x, w: quant.linear(x, w, out_dtype=jnp.float32)  # noqa: E731
    got = jax.grad(loss(linear), argnums=(0, 1))(x, weight)
    want = jax.grad(loss(bf16_dot), argnums=(0, 1))(x, weight)
    for g, h in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.dtype == h.dtype
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(h, np.float32))


@pytest.mark.parametrize("columns", [False, True])
def test_linear_few_bf16_rows_keep_bf16_operands(columns):
    x = randn((8, 96), seed=14).astype(jnp.bfloat16)
    w = randn((48, 96), seed=15)
    hlo = jax.jit(quant.linear).lower(x, quant.Columns(w) if columns else w).as_text()
    assert "xbf16>) -> tensor" in hlo.split("dot_general")[1].split("\n")[0]
    assert "optimization_barrier" not in hlo


def _dot_shapes(f, *args) -> list[tuple[int, ...]]:
    """The result shapes of the dots in ``f``'s optimized HLO on ``args``."""
    hlo = jax.jit(f).lower(*args).compile().as_text()
    return [
        tuple(int(d) for d in m.split(",") if d)
        for m in re.findall(r"= f32\[([\d,]*)\]\S* dot\(", hlo)
    ]


@pytest.mark.parametrize("lead", [(3, 5), (1, 128), (129,)])
def test_columns_float32_few_rows_multiply_weight_by_activation_columns(lead):
    """A `Columns` weight times float32 activations of R <= `COLUMNS_MAX_ROWS` rows: the
    compiled dot is ``w [O, I] @ x^T [I, R]`` (result ``[O, R]``; XLA would fold the transposes
    back into ``x @ w^T`` without the barriers), with ``linear``'s float32 values to summation
    order, checked against float64 within float32 summation error. From R > `COLUMNS_MAX_ROWS`
    on, the plain ``x @ w^T`` (result ``[R, O]``)."""
    R, O, I = int(np.prod(lead)), 48, 96
    x = randn((*lead, I), seed=16)
    w = randn((O, I), seed=17)
    y = quant.linear(x, quant.Columns(w))
    assert y.shape == (*lead, O) and y.dtype == jnp.float32
    xs, ws = np.asarray(x, np.float64), np.asarray(w, np.float64)
    ref = np.einsum("...i,oi->...o", xs, ws)
    bound = I * np.finfo(np.float32).eps * np.einsum("...i,oi->...o", np.abs(xs), np.abs(ws))
    assert np.all(np.abs(np.asarray(y, np.float64) - ref) <= bound)
    np.testing.assert_allclose(y, quant.linear(x, w), rtol=1e-5, atol=1e-5)
    shapes = _dot_shapes(quant.linear, x, quant.Columns(w))
    want = (O, R) if R <= quant.COLUMNS_MAX_ROWS else (R, O)
    assert shapes == [want], (lead, shapes)
    assert _dot_shapes(quant.linear, x, w) == [(R, O)]


@pytest.mark.slow
def test_masked_rows_never_change_valid_rows():
    """Per-tensor scaling: rows with row_mask False do not enter the amax, so huge values
    there leave every valid row bitwise unchanged."""
    x = randn((4, 6, 64), seed=7)
    w = quant.quantize_weight(randn((32, 64), seed=8, std=0.1))
    row_mask = jnp.ones((4, 6), bool).at[0, :3].set(False).at[3, 5].set(False)
    valid = np.asarray(row_mask)
    base = np.asarray(quant.linear(x, w, row_mask=row_mask))
    for fill in (1e4, 1e30, -3e6):
        y = np.asarray(quant.linear(jnp.where(row_mask[..., None], x, fill), w, row_mask=row_mask))
        assert np.isfinite(y).all()
        np.testing.assert_array_equal(y[valid], base[valid])
    # without the mask the huge rows would have changed the valid rows (not vacuous)
    unmasked = np.asarray(quant.linear(jnp.where(row_mask[..., None], x, 1e4), w))
    assert (unmasked[valid] != base[valid]).any()


def test_token_scaling_rows_are_independent():
    x = randn((3, 64), seed=9)
    w = quant.quantize_weight(randn((32, 64), seed=10, std=0.1), act_scaling="token")
    base = np.asarray(quant.linear(x, w))
    for row1 in (x[1] * 1e3, x[1] * 1e-3, jnp.full((64,), 7.0), x[1] * 0.0):
        y = np.asarray(quant.linear(x.at[1].set(row1), w))
        np.testing.assert_array_equal(y[0], base[0])
        np.testing.assert_array_equal(y[2], base[2])
    # per-tensor scaling does couple the rows (what "token" removes)
    wt = dataclasses.replace(w, act_scaling="tensor")
    assert (
        np.asarray(quant.linear(x.at[1].mul(1e3), wt))[0] != np.asarray(quant.linear(x, wt))[0]
    ).any()


# ---- several weights of one input held as one -----------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "columns", "fp8-tensor", "fp8-token"])
@pytest.mark.parametrize("groups", [1, 4])
def test_concat_rows_gives_each_weights_own_products(kind, groups):
    """`concat_rows` of three weights of one input (rows 64, 16, 16: q/k/v-like) in ``groups``
    blocks, and `split_rows` of its product: every part is its weight's product, the float64
    reference's to float32 summation (1e-6 of sum |x w|; 1e-5 for FP8, as
    `test_linear_matches_float64_reference`). The fused rows are, block by block, the matching
    rows of each weight; a fused `QArray` keeps every weight's own scale (its dequantized rows
    are the weights' own, bit for bit) and quantizes the activation over the valid rows once."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((3, 5, 128)) * np.exp(rng.standard_normal((3, 5, 1))))
    x = x.astype(jnp.float32)
    row_mask = jnp.ones((3, 5), bool).at[1, :2].set(False)
    sizes = (64, 16, 16)
    dense = [randn((o, 128), seed=10 + i, std=0.05 * (i + 1)) for i, o in enumerate(sizes)]
    if kind.startswith("fp8"):
        ws = [quant.quantize_weight(w, act_scaling=kind.split("-")[1]) for w in dense]
    elif kind == "columns":
        ws = [quant.Columns(w) for w in dense]
    else:
        ws = [w.astype(kind) for w in dense]
        x = x.astype(kind)
    fused = quant.concat_rows(ws, groups=groups)
    assert type(fused) is type(ws[0]) and fused.shape == (sum(sizes), 128)
    rows_of = lambda w: np.asarray(  # noqa: E731
        w.dequantize() if isinstance(w, QArray) else getattr(w, "w_OI", w), np.float32
    )
    blocks = [rows_of(w).reshape(groups, -1, 128) for w in ws]
    np.testing.assert_array_equal(rows_of(fused), np.concatenate(blocks, 1).reshape(-1, 128))
    y = quant.linear(x, fused, row_mask=row_mask, out_dtype=jnp.float32)
    parts = quant.split_rows(y, sizes, groups=groups)
    valid = np.asarray(row_mask)[..., None]
    for w, part in zip(ws, parts, strict=True):
        assert part.shape == (3, 5, w.shape[0])
        if isinstance(w, QArray):
            ref, mag = reference_linear(x, w, row_mask)
            err = np.where(valid, np.abs(np.asarray(part) - ref), 0)
            assert (err <= 1e-5 * mag).all(), (err / mag).max()
            continue
        x64, w64 = np.asarray(x, np.float64), rows_of(w).astype(np.float64)
        ref, mag = x64 @ w64.T, np.abs(x64) @ np.abs(w64.T)
        err = np.abs(np.asarray(part) - ref)
        assert (err <= 1e-6 * mag).all(), (err / mag).max()


def test_concat_rows_bad_weights_name_what_is_wrong():
    w = randn((8, 16), seed=1)
    q = quant.quantize_weight(w)
    with pytest.raises(ValueError, match=r"one kind.*QArray"):
        quant.concat_rows([q, w])
    with pytest.raises(
        ValueError, match=re.escape("groups=3 must divide every weight's rows [8, 8]")
    ):
        quant.concat_rows([w, w], groups=3)
    with pytest.raises(ValueError, match="float8_e5m2"):
        quant.concat_rows([q, quant.quantize_weight(w, "float8_e5m2")])
    with pytest.raises(ValueError, match="one kind"):
        quant.concat_rows([])


# ---- the rollout parameter tree ------------------------------------------------------------------

TREE_CONFIG = dataclasses.replace(MODEL, vocab_size=96, num_layers=3, intermediate_size=80)


@pytest.mark.slow
@pytest.mark.parametrize("tied", [True, False])
def test_quantize_fp8_tree_layout_and_bytes(tied):
    config = dataclasses.replace(TREE_CONFIG, tie_embeddings=tied)
    L, V, D = config.num_layers, config.vocab_size, config.hidden_size
    params = _init_params(config, jax.random.key(0))
    bf16 = cast_params(params, jnp.bfloat16)
    bf16_bytes = quant.tree_bytes(bf16)
    assert bf16_bytes == 2 * config.num_params
    linear_elems = sum(params["layers"][n].size for n in LINEAR_WEIGHTS)
    scales = 4 * L * len(LINEAR_WEIGHTS)

    if tied:  # the default rollout copy; the untied case only adds a head
        q = _quantize_fp8(params)
        assert set(q) == set(params) and set(q["layers"]) == set(params["layers"])
        for name, leaf in q["layers"].items():
            if name in LINEAR_WEIGHTS:
                assert isinstance(leaf, QArray) and leaf.fmt == "float8_e4m3fn"
                assert leaf.act_scaling == "tensor"
                assert leaf.quant.dtype == jnp.float8_e4m3fn
                assert leaf.quant.shape == params["layers"][name].shape
                assert leaf.scale.shape == (L,) and leaf.scale.dtype == jnp.float32
            else:
                assert leaf.dtype == jnp.bfloat16
                np.testing.assert_array_equal(leaf, bf16["layers"][name])
        for name in set(q) - {"layers"}:
            assert q[name].dtype == jnp.bfloat16
            np.testing.assert_array_equal(q[name], bf16[name])
        codes = {n: q["layers"][n].quant for n in LINEAR_WEIGHTS}
        linear16 = {n: bf16["layers"][n] for n in LINEAR_WEIGHTS}
        assert 2 * quant.tree_bytes(codes) == quant.tree_bytes(linear16)  # exactly half
        assert quant.tree_bytes(q) == bf16_bytes - linear_elems + scales

    qh = _quantize_fp8(params, act_scaling="token", lm_head=True)
    head = qh["lm_head"]
    assert isinstance(head, QArray) and head.quant.shape == (V, D) and head.scale.shape == ()
    assert head.act_scaling == "token" and qh["layers"]["q_proj"].act_scaling == "token"
    assert qh["embed"].dtype == jnp.bfloat16  # the input embedding stays
    source = params["embed"] if tied else params["lm_head"]
    np.testing.assert_allclose(
        head.dequantize(), source, rtol=2**-4 + 2**-8, atol=2**-10 * float(head.scale)
    )
    expected = bf16_bytes - linear_elems + scales + V * D + 4
    assert quant.tree_bytes(qh) == expected - (0 if tied else 2 * V * D)
    print(f"tied={tied}: bf16 {bf16_bytes} B, fp8 rollout copy with head {quant.tree_bytes(qh)} B")


def test_invalid_format_and_act_scaling_name_the_value():
    w = jnp.full((4, 4), 0.5)
    params = _init_params(TREE_CONFIG, jax.random.key(0))
    bad_format = [
        lambda: quant.get_format("float8_e4m3"),
        lambda: quant.quantize_weight(w, "float8_e4m3"),
        lambda: quant.quantize_params(params, "float8_e4m3"),
    ]
    for call in bad_format:
        with pytest.raises(ValueError) as info:
            call()
        assert "'float8_e4m3'" in str(info.value)
        assert all(name in str(info.value) for name in FORMATS)
    bad_scaling = [
        lambda: quant.quantize_weight(w, act_scaling="channel"),
        lambda: quant.quantize_params(params, act_scaling="channel"),
        lambda: quant.quantize_fp8(params, act_scaling="channel"),
    ]
    for call in bad_scaling:
        with pytest.raises(ValueError) as info:
            call()
        assert "'channel'" in str(info.value)
        assert all(s in str(info.value) for s in quant.ACT_SCALINGS)


# ---- what each format does to a model's log-probs -----------------------------------------------


@pytest.mark.slow
def test_low_precision_logprob_gap_on_tiny_qwen3():
    """A random `ModelConfig.tiny()` Qwen3 (layer weights std 0.1, embeddings std 0.2: logits
    std ~2, max ~10): mean |dlogp| versus the BF16 model on tokens sampled from the BF16
    model, per format. The forward runs op by op: seven compilations of it cost more here."""
    config = ModelConfig.tiny()
    params = _init_params(config, jax.random.key(0))
    params = dict(
        params,
        embed=params["embed"] * 10,
        layers={k: v * 5 if k in LINEAR_WEIGHTS else v for k, v in params["layers"].items()},
    )
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (4, 32)), jnp.int32)

    def logp_at(p, sampled):
        logp = jax.nn.log_softmax(forward(p, config, tokens), axis=-1)
        return np.take_along_axis(np.asarray(logp), sampled[..., None], axis=-1)[..., 0]

    bf16 = cast_params(params, jnp.bfloat16)
    logits = np.asarray(forward(bf16, config, tokens), np.float64)
    assert 1.0 < logits.std() and np.abs(logits).max() < 30.0
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    sampled = (probs.cumsum(-1) < rng.uniform(size=probs.shape[:-1] + (1,))).sum(-1)
    sampled = np.minimum(sampled, config.vocab_size - 1)
    ref = logp_at(bf16, sampled)
    variants = {
        "f32 (baseline)": lambda: params,
        "e4m3 per-tensor": lambda: _quantize_fp8(params),
        "e4m3 per-token": lambda: _quantize_fp8(params, act_scaling="token"),
        "e5m2": lambda: _quantize_params(params, "float8_e5m2"),
        "fp6 e3m2": lambda: _quantize_params(params, "float6_e3m2fn"),
        "fp6 e2m3": lambda: _quantize_params(params, "float6_e2m3fn"),
        "fp4 e2m1": lambda: _quantize_params(params, "float4_e2m1fn"),
    }
    gap = {}
    for label, make in variants.items():
        d = np.abs(logp_at(make(), sampled) - ref)
        assert np.isfinite(d).all()
        gap[label] = d.mean()
        print(f"{label:>16}: mean |dlogp| {d.mean():.4f}  max {d.max():.3f}")
    assert gap["f32 (baseline)"] < 0.1 * gap["e4m3 per-tensor"]
    assert gap["e4m3 per-tensor"] < gap["e5m2"] and gap["e4m3 per-token"] < gap["e5m2"]
    assert gap["fp4 e2m1"] > 2 * max(v for k, v in gap.items() if k != "fp4 e2m1")
