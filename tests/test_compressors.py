"""The compressor contract (spec/compressors.md), held for every method."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from refcoll.compressors import COMPRESSORS, ErrorFeedback, parse
from refcoll.compressors.base import index_dtype
from refcoll.compressors.collective import simulate_compressed
from refcoll.compressors.powersgd import PowerSGD
from refcoll.compressors.randomk import RandomK
from refcoll.compressors.topk import topk_indices
from refcoll.core.errors import UsageError

SPECS = [
    "none",
    "fp16",
    "bf16",
    "topk:ratio=0.1",
    "randomk:ratio=0.1",
    "threshold:threshold=0.8",
    "qsgd:levels=16,bucket=64",
    "terngrad",
    "terngrad:block=100",
    "sign",
    "sign:block=16",
    "onebit",
    "onebit:block=30",
    "powersgd:rank=2",
    "int8:block=64",
]

# Compressors whose output d satisfies d == 0, d == c, or c within [d/2, 2d]
# (Sterbenz), so c - d is exact and the error-feedback identity holds bit for bit.
EXACT_EF = {"none", "fp16", "bf16", "topk", "threshold", "int8"}

SHAPES = [(0,), (1,), (7,), (37, 53), (4, 3, 5)]


def _data(shape, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_roundtrip_shape_dtype_and_purity(spec, shape):
    c = parse(spec)
    x = _data(shape)
    before = x.copy()
    payload = c.compress(x, c.new_state(3, 1))
    out = c.decompress(payload)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert np.array_equal(x, before), "compress must not modify its input"
    assert payload.nbytes == sum(a.nbytes for a in payload.arrays.values())


@pytest.mark.parametrize("spec", SPECS)
def test_same_seed_same_bits(spec):
    c = parse(spec)
    x = _data((37, 53))
    a = c.decompress(c.compress(x, c.new_state(5, 2)))
    b = c.decompress(c.compress(x, c.new_state(5, 2)))
    assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("spec", SPECS)
def test_error_feedback_conservation(spec, dtype):
    """e_new is bitwise (x + e_old) - d in x's dtype; d + e_new == x + e_old exactly
    where the subtraction is exact, else to within half an ulp of e_new."""
    ef = ErrorFeedback(parse(spec))
    state = ef.new_state(7, 0)
    base = _data((37, 53), dtype)
    for step in range(4):
        x = (base * dtype(step + 1)).astype(dtype)
        e_old = np.zeros_like(x) if state.residual is None else state.residual.copy()
        payload = ef.compress(x, state)
        d = ef.decompress(payload)
        e_new = state.residual
        assert e_new.dtype == x.dtype and e_new.shape == x.shape
        corrected = x + e_old
        assert (corrected - d).tobytes() == e_new.tobytes()
        if ef.inner.name in EXACT_EF:
            assert np.array_equal(d + e_new, corrected)
        else:
            wide = np.float64
            gap = np.abs(d.astype(wide) + e_new.astype(wide) - corrected.astype(wide))
            half_ulp = np.spacing(np.abs(e_new)).astype(np.float64) / 2
            assert np.all(gap <= half_ulp + np.abs(corrected.astype(wide)) * 2.0**-52)


def test_error_feedback_carries_what_topk_drops():
    ef = parse("ef(topk:ratio=0.25)")
    state = ef.new_state()
    x = np.array([4.0, 3.0, 2.0, 1.0], dtype=np.float32)
    assert np.array_equal(ef.decompress(ef.compress(x, state)), [4, 0, 0, 0])
    assert np.array_equal(state.residual, [0, 3, 2, 1])
    # step 2: corrected = [4, 6, 4, 2]; the 6 goes out.
    assert np.array_equal(ef.decompress(ef.compress(x, state)), [0, 6, 0, 0])
    assert np.array_equal(state.residual, [4, 0, 4, 2])


# ---- nbytes: the sum of the wire arrays, and a hand count ----------------------

N = 37 * 53  # 1961 elements

HAND_COUNT = {
    "none": 4 * N,
    "fp16": 2 * N,
    "bf16": 2 * N,
    "topk:ratio=0.1": 196 * 4 + 196 * 4,  # k = round(196.1): values + int32 indices
    "randomk:ratio=0.1": 196 * 4,  # values only: indices come from the shared seed
    "qsgd:levels=16,bucket=64": N * 1 + math.ceil(N / 64) * 4,  # int8 levels + norms
    "qsgd:levels=200,bucket=512": N * 2 + 4 * 4,  # int16 levels past 127
    "terngrad": math.ceil(N / 4) + 4,  # 2 bits each + one scale
    "sign": math.ceil(N / 8) + 4,
    "sign:block=16": math.ceil(N / 8) + math.ceil(N / 16) * 4,
    "onebit": math.ceil(N / 8) + 8,
    "powersgd:rank=2": (37 + 53) * 2 * 4,
    "int8:block=64": N + math.ceil(N / 64) * 4,
}


@pytest.mark.parametrize("spec", list(HAND_COUNT))
def test_nbytes_hand_count(spec):
    c = parse(spec)
    payload = c.compress(_data((37, 53)), c.new_state())
    assert payload.nbytes == HAND_COUNT[spec]
    assert payload.nbytes == sum(a.nbytes for a in payload.arrays.values())


def test_nbytes_small_shapes():
    sign = parse("sign")
    assert sign.compress(_data((9,)), sign.new_state()).nbytes == 2 + 4
    topk = parse("topk:ratio=0.5")
    assert topk.compress(_data((3, 3)), topk.new_state()).nbytes == 4 * (4 + 4)  # k=round(4.5)=4
    assert topk.compress(_data((0,)), topk.new_state()).nbytes == 0


def test_index_dtype_widens_past_int32():
    assert index_dtype(2**31 - 1) == np.int32
    assert index_dtype(2**31) == np.int64


# ---- top-k ------------------------------------------------------------------------


def _reference_topk(x, k):
    """Full stable sort: magnitude descending, then index ascending."""
    order = np.lexsort((np.arange(x.size), -np.abs(x)))
    return np.sort(order[:k])


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [1, 2, 7, 50, 99, 100])
def test_topk_exact_with_ties_to_lower_index(seed, k):
    rng = np.random.default_rng(seed)
    x = rng.integers(-5, 6, size=100).astype(np.float32)  # many ties, ±v tie too
    idx = topk_indices(np.abs(x), k)
    assert np.array_equal(idx, _reference_topk(x, k))


@pytest.mark.parametrize("spec", ["powersgd:min_rate=nan", "powersgd:min_rate=inf",
                                  "powersgd:eps=inf", "powersgd:eps=nan"])
def test_powersgd_refuses_a_rate_or_eps_that_is_not_finite(spec):
    """min_rate=nan or inf switched compression off without a word; eps=inf zeroed every
    gradient."""
    with pytest.raises(UsageError, match="must be a finite number >= 0"):
        parse(spec)


def test_error_feedback_around_random_k_keeps_its_residual_bounded():
    # Scaled by n/k, random-k inside error feedback is no contraction: the residual grew
    # by about (n/k - 1) a step and training diverged (loss 1e21). Unscaled (Stich et al.
    # 2018), it settles where the kept share of it balances the gradient.
    x = _data((1000,), seed=3)
    fed, alone = parse("ef(randomk:ratio=0.1)"), parse("randomk:ratio=0.1")
    assert fed.spec() == "ef(randomk:ratio=0.1)" and fed == parse(fed.spec())
    state = fed.new_state(seed=0)
    norms = []
    for _ in range(300):
        sent = fed.decompress(fed.compress(x, state))
        norms.append(float(np.linalg.norm(state.residual)))
    # (each element waits a geometric number of steps, mean n/k, to be sent: the
    # residual's norm settles near sqrt((2 - k/n)) n/k = 14 times the gradient's)
    assert max(norms[150:]) < 1.5 * max(norms[:150]) and max(norms) < 30 * np.linalg.norm(x)
    step = alone.new_state(seed=0)
    kept = alone.decompress(alone.compress(x, step))
    assert np.count_nonzero(sent) == np.count_nonzero(kept) == 100
    nonzero = kept != 0
    assert np.allclose(kept[nonzero], x[nonzero] * 10)  # alone: scaled by n/k, unbiased


@pytest.mark.parametrize("spec", ["randomk:ratio=0.1", "ef(randomk:ratio=0.1)"])
def test_randomk_keeps_an_overflow_where_no_index_fell(spec):
    """Random-k sent only the values at its drawn indices: an infinity or a NaN elsewhere
    left the average finite, and AMP's GradScaler took the step."""
    c = parse(spec)
    drawn = set(RandomK.indices(1000, 100, 0, 0).tolist())
    outside = [i for i in range(1000) if i not in drawn][:2]
    for bad in (np.nan, np.inf, -np.inf):
        x = _data((1000,), seed=5)
        x[outside] = bad
        state = c.new_state(seed=0)
        out = c.decompress(c.compress(x, state))
        assert not np.isfinite(out).all(), (spec, bad)
        assert np.isnan(out).any() == np.isnan(bad), (spec, bad)  # an infinity stays one
    x = _data((1000,), seed=5)  # a finite tensor: the values at the indices, as before
    kept = c.decompress(c.compress(x, c.new_state(seed=0)))
    assert np.isfinite(kept).all() and np.count_nonzero(kept) == 100


@pytest.mark.parametrize("spec", ["topk:ratio=0.1", "threshold:threshold=0.8"])
def test_a_non_finite_gradient_stays_non_finite(spec):
    """A sparsifier that dropped NaN (comparisons with NaN are false) hid an overflow from
    AMP's GradScaler: NaN now counts as the largest magnitude, infinity as large."""
    c = parse(spec)
    for bad in (np.nan, np.inf, -np.inf):
        x = _data((1000,), seed=5)
        x[[17, 500]] = bad
        out = c.decompress(c.compress(x, c.new_state()))
        kept = out[[17, 500]]
        assert np.array_equal(kept, x[[17, 500]], equal_nan=True), (spec, bad, kept)
    assert np.array_equal(topk_indices(np.abs(np.array([1.0, np.nan, 3.0, np.inf, 2.0])), 2),
                          [1, 3])  # NaN and infinity above every number


def test_topk_compressor_matches_full_sort():
    x = _data((37, 53), seed=4)
    x.reshape(-1)[::3] = 0.5  # a large tie class across the boundary
    c = parse("topk:ratio=0.4")
    p = c.compress(x, c.new_state())
    k = c.k(x.size)
    expected = _reference_topk(x.reshape(-1), k)
    assert np.array_equal(p.arrays["indices"], expected)
    assert np.array_equal(p.arrays["values"], x.reshape(-1)[expected])
    assert p.arrays["indices"].dtype == np.int32


# ---- unbiasedness ------------------------------------------------------------------

DRAWS = 2000


def _draws(spec, x):
    c = parse(spec)
    state = c.new_state(11, 0)  # stochastic rounding: state.rng; random-k: state.step
    return np.stack([c.decompress(c.compress(x, state)) for _ in range(DRAWS)]).astype(np.float64)


def _mean_within_bound(samples, x):
    """Each element's mean is within 5 standard errors of x (and the max over 64 elements
    of |z| exceeds 5 with probability ~1e-5 for an unbiased estimator)."""
    mean = samples.mean(axis=0)
    stderr = samples.std(axis=0, ddof=1) / math.sqrt(len(samples))
    return np.all(np.abs(mean - x) <= 5 * stderr + 1e-12)


UNBIASED = [
    "randomk:ratio=0.25",
    "qsgd:levels=4,bucket=16",
    "qsgd:levels=1,bucket=64",
    "terngrad",
    "terngrad:block=8",
]


@pytest.mark.parametrize("spec", UNBIASED)
def test_unbiased(spec):
    x = _data((64,), np.float64, seed=9)
    assert _mean_within_bound(_draws(spec, x), x)


def test_unbiased_check_can_fail():
    """The bound above rejects a biased estimator: a scaled random-k, and sign (deterministic)."""
    x = _data((64,), np.float64, seed=9)
    assert not _mean_within_bound(_draws("randomk:ratio=0.25", x) * 1.5, x)
    assert not _mean_within_bound(_draws("sign", x)[:50], x)


@pytest.mark.parametrize("d,s", [(16, 1), (16, 4), (64, 2), (64, 16), (256, 1), (100, 3)])
def test_qsgd_variance_lemma_3_1(d, s):
    """E||Q(v) - v||^2 <= min(d/s^2, sqrt(d)/s) ||v||^2 (Alistarh et al. 2017, Lemma 3.1)."""
    v = _data((d,), np.float64, seed=d + s)
    samples = _draws(f"qsgd:levels={s},bucket={d}", v)
    err = ((samples - v) ** 2).sum(axis=1)
    bound = min(d / s**2, math.sqrt(d) / s) * float(v @ v)
    # the mean of 2000 draws: allow 3 standard errors of sampling noise
    assert err.mean() <= bound + 3 * err.std() / math.sqrt(DRAWS)


# ---- PowerSGD ------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(8, 5), (5, 8), (6, 6), (6, 2, 3), (1, 9)], ids=str)
@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-10), (np.float32, 1e-4)])
def test_powersgd_full_rank_reconstructs(shape, dtype, tol):
    m, n = shape[0], math.prod(shape[1:])
    r = min(m, n)
    c = PowerSGD(rank=r, min_rate=0)
    x = _data(shape, dtype, seed=1)
    payload = c.compress(x, c.new_state(0, 0))
    assert payload.arrays["p"].shape == (m, r) and payload.arrays["q"].shape == (n, r)
    assert sum(a.size for a in payload.arrays.values()) == (m + n) * r
    out = c.decompress(payload)
    assert np.allclose(out, x, rtol=0, atol=tol * np.abs(x).max())


def test_powersgd_vectors_and_unprofitable_matrices_go_whole():
    c = PowerSGD(rank=4)  # min_rate 2: compress only when (m+n)*4*2 < m*n
    v = _data((50,))
    assert c.compress(v, c.new_state()).nbytes == v.nbytes
    assert c.plan((16, 16)) is None  # 256 == 256: not strictly less
    assert c.plan((17, 17)) == (17, 17, 4)  # 272 < 289
    small = _data((16, 16))
    payload = c.compress(small, c.new_state())
    assert payload.nbytes == small.nbytes
    assert np.array_equal(c.decompress(payload), small)


def test_powersgd_warm_start_and_shared_initial_q():
    c = PowerSGD(rank=1, min_rate=0)
    rng = np.random.default_rng(2)
    u, w = rng.standard_normal((30, 1)), rng.standard_normal((1, 20))
    x = (u @ w * 10 + rng.standard_normal((30, 20)) * 0.01)
    # ranks share the initial Q: identical inputs give identical payloads
    p0 = c.compress(x, c.new_state(4, 0))
    p1 = c.compress(x, c.new_state(4, 1))
    assert p0.arrays["p"].tobytes() == p1.arrays["p"].tobytes()
    state = c.new_state(4, 0)
    errors = []
    for _ in range(3):
        errors.append(np.linalg.norm(c.decompress(c.compress(x, state)) - x))
        assert ("powersgd.q", 30, 20, 1) in state.memory
    assert errors[-1] <= errors[0] + 1e-12


def _powersgd_steps(steps, spec="powersgd:rank=2"):
    """Each step's result on rank 0 of a simulated 2-rank compressed average."""
    res = simulate_compressed(spec, steps, op="avg", seed=1)
    return [res.outputs[s][0] for s in range(len(steps))]


@pytest.mark.parametrize("spec", ["powersgd:rank=2", "ef(powersgd:rank=2)"])
def test_powersgd_after_an_all_zero_gradient_starts_again_from_the_shared_seed(spec):
    # An unused parameter's gradient is all zeros for a step: its Q = M^T P is then zero,
    # and a zero warm start would make every later P = M Q zero, the tensor silenced.
    rng = np.random.default_rng(0)
    shape = (32, 16)
    later = [[rng.standard_normal(shape).astype(np.float32) for _ in range(2)]
             for _ in range(3)]
    zero = [[np.zeros(shape, np.float32)] * 2]
    after_zero = _powersgd_steps(zero + later, spec)
    assert not after_zero[0].any()
    # the zero step's Q is drawn again from the seed: what follows is a fresh start's, bits
    fresh = _powersgd_steps(later, spec)
    for got, want in zip(after_zero[1:], fresh):
        assert np.abs(got).max() > 0.1
        assert got.tobytes() == want.tobytes()


def test_powersgd_does_not_depend_on_the_gradients_scale():
    # The warm start is orthonormalised each step (step 0, as PyTorch's hook does), so a
    # gradient scaled by a power of two gives the scaled result, bit for bit, step after
    # step; before, a small gradient's P fell below eps and the result shrank each step.
    rng = np.random.default_rng(3)
    steps = [[rng.standard_normal((32, 16)).astype(np.float32) for _ in range(2)]
             for _ in range(5)]
    scale = np.float32(2.0 ** -40)
    small = _powersgd_steps([[x * scale for x in step] for step in steps])
    for got, want in zip(small, _powersgd_steps(steps)):
        assert got.tobytes() == (want * scale).tobytes()


def test_powersgd_refuses_a_negative_eps():
    with pytest.raises(ValueError, match="eps"):
        PowerSGD(eps=-1.0)


# ---- sign, 1-bit, int8, casts ---------------------------------------------------------


@pytest.mark.parametrize("n", [1, 7, 8, 9, 1000])
def test_sign_packs_eight_per_byte(n):
    x = _data((n,), seed=n)
    c = parse("sign:block=4")
    p = c.compress(x, c.new_state())
    assert p.arrays["signs"].dtype == np.uint8 and p.arrays["signs"].size == math.ceil(n / 8)
    assert np.array_equal(np.unpackbits(p.arrays["signs"], count=n).astype(bool), x >= 0)
    out = c.decompress(p)
    for b in range(0, n, 4):
        scale = np.float32(np.abs(x[b : b + 4]).mean())
        assert np.allclose(np.abs(out[b : b + 4]), scale, rtol=1e-6)
    assert np.array_equal(out >= 0, x >= 0)


def test_onebit_two_means():
    x = np.array([1.0, 3.0, -2.0, -4.0, 0.0, 5.0], dtype=np.float32)
    c = parse("onebit")
    out = c.decompress(c.compress(x, c.new_state()))
    assert np.array_equal(out, [2.25, 2.25, -3, -3, 2.25, 2.25])  # zero counts as +


@pytest.mark.parametrize("block", [1, 7, 64, 256])
def test_int8_error_within_half_scale(block):
    x = _data((1000,), seed=block) * 3
    c = parse(f"int8:block={block}")
    p = c.compress(x, c.new_state())
    codes = p.arrays["codes"]
    assert codes.dtype == np.int8 and codes.min() >= -127 and codes.max() <= 127
    scale = np.repeat(p.arrays["scales"], block)[: x.size]
    err = np.abs(c.decompress(p).astype(np.float64) - x)
    assert np.all(err <= scale / 2 * (1 + 1e-6))
    zero = np.zeros(10, np.float32)
    assert np.array_equal(c.decompress(c.compress(zero, c.new_state())), zero)


@pytest.mark.parametrize("spec,wire", [("fp16", np.float16), ("bf16", ml_dtypes.bfloat16)])
def test_casts_exact_for_representable_values(spec, wire):
    x = _data((500,), seed=3).astype(wire).astype(np.float32)  # representable by construction
    c = parse(spec)
    p = c.compress(x, c.new_state())
    assert p.arrays["values"].dtype == np.dtype(wire)
    assert np.array_equal(c.decompress(p), x)
    assert c.linear


def test_linear_flags():
    linear = {name for name, cls in COMPRESSORS.items() if cls.linear}
    assert linear == {"none", "fp16", "bf16", "randomk", "powersgd"}
    assert parse("ef(randomk)").linear and not parse("ef(topk)").linear


def test_randomk_ranks_share_indices():
    c = parse("randomk:ratio=0.1")
    a = c.decompress(c.compress(np.ones(100, np.float32), c.new_state(8, 0)))
    b = c.decompress(c.compress(np.ones(100, np.float32), c.new_state(8, 3)))
    assert np.array_equal(a != 0, b != 0) and np.count_nonzero(a) == 10
    assert np.all(a[a != 0] == 10)  # scaled by n/k


@pytest.mark.parametrize("ratio,n", [(1e-3, 10_000), (1e-5, 200_000)])
def test_randomk_in_float16_scales_after_the_sum(ratio, n):
    # n/k = 1000 takes a value of 100 past float16's 65504, and n/k = 100000 is itself past
    # it: scaled before the sum, opposite ranks' values made inf - inf = NaN (and 0 * inf
    # NaN) where the average is 0. Scaled after it, in float32, the result is 0, and a
    # small value's average is the float32 path's, rounded once.
    x = (np.random.default_rng(5).standard_normal(n) * 100).astype(np.float16)
    opposite = simulate_compressed(f"randomk:ratio={ratio}", [[x, -x]], op="avg", seed=1)
    assert not opposite.outputs[0][0].any()
    small = (x / np.float16(1e4)).astype(np.float16)
    half = simulate_compressed(f"randomk:ratio={ratio}", [[small, small]], op="avg", seed=1)
    single = simulate_compressed(f"randomk:ratio={ratio}", [[small.astype(np.float32)] * 2],
                                 op="avg", seed=1)
    got = half.outputs[0][0]
    assert np.isfinite(got).all() and np.count_nonzero(got) == round(ratio * n)
    assert got.tobytes() == single.outputs[0][0].astype(np.float16).tobytes()


@pytest.mark.parametrize("spec,wire", [("fp16", np.float16), ("bf16", ml_dtypes.bfloat16)])
def test_a_cast_averages_as_pytorchs_compress_hooks_do(spec, wire):
    # PyTorch's fp16_compress_hook and bf16_compress_hook divide each cast by p, then sum:
    # the average of 40000 and 50000 is 45000, where a float16 sum (90000) would overflow.
    # (Two ranks: one addition, in any order.)
    rng = np.random.default_rng(9)
    xs = [rng.uniform(3.5e4, 6e4, 64).astype(np.float32) for _ in range(2)]
    got = simulate_compressed(spec, [xs], op="avg", seed=1).outputs[0][0]
    want = xs[0].astype(wire) / wire(2) + xs[1].astype(wire) / wire(2)
    assert np.isfinite(got).all()
    assert got.tobytes() == want.astype(np.float32).tobytes()
    # error feedback keeps what this rank's undivided cast lost
    res = simulate_compressed(f"ef({spec})", [xs, xs], op="avg", seed=1)
    assert np.isfinite(res.outputs[1][0]).all()
    assert res.outputs[0][0].tobytes() == got.tobytes()


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_threshold_compares_with_the_threshold_itself_not_its_rounding(dtype):
    # 0.1 rounds down to 0.0999756 in float16: compared in float16, that value was kept.
    c = parse("threshold:threshold=0.1")
    below = np.array(0.1, dtype)  # the dtype's nearest value: below 0.1 in float16
    x = np.array([below, np.nextafter(below, np.array(np.inf, dtype))], dtype)
    kept = c.compress(x, c.new_state()).arrays["indices"].tolist()
    assert kept == ([0, 1] if float(below) >= 0.1 else [1])
    if dtype is np.float16:  # past float16's largest, 65504: only inf reaches it
        huge = parse("threshold:threshold=65510")
        y = np.array([65504, np.inf, 1], dtype)
        assert huge.compress(y, huge.new_state()).arrays["indices"].tolist() == [1]


def test_integer_tensor_refused():
    c = parse("topk")
    with pytest.raises(UsageError, match="floating"):
        c.compress(np.arange(10), c.new_state())


# ---- parse -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    SPECS + ["topk:ratio=0.001", "qsgd:levels=16", "powersgd:rank=4", "ef(topk:ratio=0.01)",
             " powersgd:rank=4 ", "randomk", "threshold"],
)
def test_parse_round_trips(spec):
    c = parse(spec)
    assert parse(c.spec()) == c


def test_parse_values():
    assert parse("topk:ratio=0.001").ratio == 0.001
    assert parse("qsgd:levels=16").levels == 16
    assert parse("powersgd:rank=4,min_rate=1.5") == PowerSGD(rank=4, min_rate=1.5)
    ef = parse("ef(topk:ratio=0.01)")
    assert isinstance(ef, ErrorFeedback) and ef.inner == parse("topk:ratio=0.01")


@pytest.mark.parametrize(
    "spec,message",
    [
        ("nope", "unknown compressor"),
        ("ef(nope)", "unknown compressor"),
        ("ef", "unknown compressor"),
        ("topk:k=3", "no parameter 'k'"),
        ("topk:ratio", "key=value"),
        ("topk:ratio=abc", "not a valid float"),
        ("qsgd:levels=1.5", "not a valid int"),
        ("topk:ratio=0", "ratio must be"),
        ("qsgd:levels=0", "levels must be"),
        ("int8:block=0", "block must be"),
        ("none:x=1", "no parameter"),
    ],
)
def test_parse_errors(spec, message):
    with pytest.raises(UsageError, match=message):
        parse(spec)


def test_an_error_feedback_state_serves_one_tensor():
    c = parse("ef(topk:ratio=0.5)")
    state = c.new_state()
    c.compress(_data((40,)), state)
    with pytest.raises(UsageError, match=r"holds the residual of a float32 tensor of shape "
                                         r"\(40,\), not of this float32 \(7,\) one"):
        c.compress(_data((7,)), state)


def test_qsgd_draws_for_a_tensor_smaller_than_its_bucket_only_its_elements():
    # A 10-element tensor with bucket=2**25 was padded to a whole bucket: 1.8 s and half a
    # gigabyte for a 14-byte payload. The bucket is the tensor there; values are the same.
    big, small = parse("qsgd:bucket=33554432"), parse("qsgd:bucket=10")
    x = _data((10,), seed=4)
    one, two = big.compress(x, big.new_state(seed=1)), small.compress(x, small.new_state(seed=1))
    assert one.nbytes == two.nbytes and big._buckets(x.reshape(-1)).size == 10
    assert np.array_equal(big.decompress(one), small.decompress(two))
