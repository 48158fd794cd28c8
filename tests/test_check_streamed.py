"""``refcoll check`` block by block: the same findings for any block, in bounded memory.

The whole-array judgement is the one-block case of the streamed one, so these tests
hold the many-block cases to it: every collective, dtype and op, right and wrong
outputs, the report compared whole (every message, index and figure). The files are
read through :class:`refcoll.verify.npy.NpyFile`; a large world is judged in a child
process whose peak memory is read from Linux's ``VmHWM``.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from refcoll.core.errors import UsageError
from refcoll.core.ops import get_dtype
from refcoll.verify.checksums import block_size, checksums, judge_sums, smallest_caught
from refcoll.verify.formula import FormulaInput
from refcoll.verify.ieee import judge_float, reference
from refcoll.verify.inputs import make_inputs
from refcoll.verify.npy import NpyFile
from refcoll.verify.oracle import check_outputs, expected_outputs, fold
from refcoll.verify.rankfiles import load_case, write_world
from refcoll.verify.screen import Estimate, _exact_sums, estimate, screened

CASES = [("allreduce", "float32", "sum", "adversarial"), ("allreduce", "bfloat16", "avg", "random"),
         ("allreduce", "float16", "prod", "random"), ("allreduce", "float32", "max", "random"),
         ("allreduce", "int8", "sum", "random"), ("allreduce", "float64", "sum", "exact"),
         ("reduce_scatter", "float32", "sum", "adversarial"),
         ("reduce_scatter", "int32", "min", "random"), ("reduce", "float32", "avg", "exact"),
         ("allgather", "float16", "sum", "random"), ("broadcast", "int32", "sum", "random")]


def _spoil(outs, how: int, xs):
    outs = [None if o is None else np.array(o, copy=True) for o in outs]
    ranks = [r for r, o in enumerate(outs) if o is not None]
    if how == 1:  # one element of the last rank
        flat = outs[ranks[-1]].reshape(-1)
        mid = flat.size // 2
        far = np.array(30000.0 if flat[mid] < 1000 else -30000.0)
        flat[mid] = flat[mid] + 1 if flat.dtype.kind in "iu" else far.astype(flat.dtype)
    elif how == 2:  # a NaN in every rank's first element, a changed last one on the first
        for r in ranks:
            flat = outs[r].reshape(-1)
            if flat.dtype.kind == "f" or "float" in str(flat.dtype):
                flat[0] = np.array(np.nan).astype(flat.dtype)
        outs[ranks[0]].reshape(-1)[-1] += 1
    elif how == 3 and outs[ranks[0]].shape == xs[1].shape:  # rank 1's contribution missing
        outs = [None if o is None else (o - xs[1]).astype(o.dtype) for o in outs]
    return outs


def _case(collective, dtype, op, kind) -> tuple:
    """Return a case's inputs on 3 ranks of 301 elements, its root keyword and its outputs."""
    xs = make_inputs(kind, dtype, 301, 3, op=op, seed=5)
    kw = {"root": 1} if collective in ("reduce", "broadcast") else {}
    options = {} if collective in ("allgather", "broadcast") else {"op": op}
    outs = expected_outputs(collective, xs, algorithm="ring" if collective == "reduce_scatter"
                            else "naive", **options, **kw)
    return xs, kw, outs


def _text(report) -> str:
    """The whole report as text (NaN figures compare equal there)."""
    return json.dumps(report.to_json(), sort_keys=True)


@pytest.mark.parametrize("collective,dtype,op,kind", CASES)
def test_any_block_length_gives_the_whole_arrays_report(collective, dtype, op, kind):
    xs, kw, outs = _case(collective, dtype, op, kind)
    for how in range(4):
        spoiled = _spoil(outs, how, xs)
        whole = _text(check_outputs(xs, spoiled, collective=collective, op=op, **kw))
        for budget in (1, 500, 4000):  # blocks of 1, a few and tens of elements
            streamed = check_outputs(xs, spoiled, collective=collective, op=op, budget=budget,
                                     **kw)
            assert _text(streamed) == whole, (how, budget)
        if how in (1, 2) or (how == 3 and collective in ("allreduce", "reduce")):
            assert '"conforming": false' in whole, how


@pytest.mark.parametrize("p,dtype,op,kind", [(2, "float32", "sum", "adversarial"),
                                          (3, "bfloat16", "avg", "random"),
                                          (8, "float16", "sum", "adversarial"),
                                          (64, "float32", "avg", "adversarial"),
                                          (5, "float32", "sum", "exact")])
def test_the_screen_judges_every_element_as_the_exact_reference_does(p, dtype, op, kind):
    # The screen (refcoll/verify/screen.py) decides most elements from plain float64 sums
    # and sends the rest to the exact reference. Results placed at fractions of the bound
    # just inside and outside 1, exactly at it, tied, exact, far out, NaN and infinite
    # must get the exact path's counts, worst element and figures.
    k = 3000
    cols = np.stack(make_inputs(kind, dtype, k, p, op=op, seed=p))
    with np.errstate(invalid="ignore", over="ignore"):
        ref = reference(op, cols, dtype)
        est = estimate(op, cols, dtype)
        rng = np.random.default_rng(p)
        cases = {"fold": fold(op, list(cols)).astype(np.float64), "exact": ref.exact.copy()}
        for name, at in (("inside", 1 - 1e-14), ("outside", 1 + 1e-14), ("at", 1.0),
                         ("spread", rng.uniform(-1.5, 1.5, k))):
            cases[name] = ref.exact + ref.bound * at * rng.choice([-1.0, 1.0], k)
        odd = cases["fold"].copy()
        odd[rng.choice(k, 40, replace=False)] = [np.nan, np.inf, -np.inf, 0.0] * 10
        cases["odd"] = odd
    assert isinstance(est, Estimate)
    if kind == "exact":  # the plain sums are the exact ones: the reference is built from them
        built = _exact_sums(est)
        assert built is not None and all(
            np.array_equal(getattr(built, f), getattr(ref, f)) and
            getattr(built, f).dtype == getattr(ref, f).dtype
            for f in ("exact", "bound", "scale", "e", "finite"))
    for name, got in cases.items():
        whole = judge_float(op, cols, got, dtype, ref)
        failed, special, i, judged, j = screened(est, got)
        assert failed == int((~whole.ok).sum()) and special == int(whole.special.sum()), name
        assert i == int(np.argmax(whole.fraction)), name
        assert judged.fraction[j] == whole.fraction[i] and judged.ok[j] == whole.ok[i], name
        assert json.dumps(judged.numbers(j)) == json.dumps(whole.numbers(i)), name
        if kind != "exact" and name in ("fold", "spread"):  # few needed the exact sums
            assert judged.ok.size < k // 10, (name, judged.ok.size)


def test_files_and_formulas_read_block_by_block_give_the_arrays_report(tmp_path):
    p, n = 4, 5000
    xs = [FormulaInput("adversarial", "float32", p, r, n, seed=3) for r in range(p)]
    arrays = [x.whole() for x in xs]
    outs = [o.copy() for o in expected_outputs("allreduce", arrays, algorithm="ring")]
    outs[2][4321] = np.float32(7.0)
    write_world(tmp_path / "in", arrays)
    write_world(tmp_path / "out", outs)
    inputs, outputs, _ = load_case(tmp_path / "in", tmp_path / "out", lazy=True)
    assert all(isinstance(x, NpyFile) for x in inputs + outputs)
    whole = _text(check_outputs(arrays, outs))
    assert _text(check_outputs(inputs, outputs, budget=3000)) == whole
    assert _text(check_outputs(xs, outputs, budget=3000)) == whole
    assert "rank 2 element 4321" in whole


@pytest.mark.parametrize("collective,dtype,op,kind", [c for c in CASES if c[1] != "bfloat16"])
def test_rank_files_read_block_by_block_give_the_arrays_report(tmp_path, collective, dtype, op,
                                                              kind):
    # Outputs every rank holds whole (all-reduce, all-gather, broadcast) are read from
    # files into one buffer's rows and compared in one pass: the report is the arrays'.
    xs, kw, outs = _case(collective, dtype, op, kind)
    write_world(tmp_path / "in", xs)
    for how in (1, 2):
        spoiled = _spoil(outs, how, xs)
        folder = tmp_path / f"out{how}"
        write_world(folder, [np.zeros(0, xs[0].dtype) if o is None else o for o in spoiled])
        _, files, _ = load_case(tmp_path / "in", folder, lazy=True)
        files = [None if o is None else f for o, f in zip(spoiled, files)]
        whole = _text(check_outputs(xs, spoiled, collective=collective, op=op, **kw))
        for budget in (1, 500):
            assert _text(check_outputs(xs, files, collective=collective, op=op, budget=budget,
                                       **kw)) == whole, (how, budget)


def test_a_failure_while_judging_ends_the_reads_ahead_before_the_files_close(tmp_path,
                                                                              monkeypatch):
    # The next block is read on a thread while this one is judged: a judge that fails
    # leaves no read running, no thread behind and every file closed.
    import threading

    from refcoll.verify import oracle

    p, n = 3, 4000
    arrays = [x.whole() for x in (FormulaInput("adversarial", "float32", p, r, n, seed=1)
                                  for r in range(p))]
    write_world(tmp_path / "in", arrays)
    write_world(tmp_path / "out", expected_outputs("allreduce", arrays, algorithm="ring"))
    inputs, outputs, _ = load_case(tmp_path / "in", tmp_path / "out", lazy=True)
    judged, real_block = [], oracle._Judge.block

    def failing(self, lo, hi, q, data, held):
        judged.append(lo)
        if len(judged) == 3:
            raise RuntimeError("the judge failed")
        real_block(self, lo, hi, q, data, held)
    monkeypatch.setattr(oracle._Judge, "block", failing)
    with pytest.raises(RuntimeError, match="the judge failed"):
        check_outputs(inputs, outputs, budget=2000)
    assert len(judged) == 3
    assert not [t for t in threading.enumerate() if t.name.startswith("refcoll-read")]
    assert all(x._fh is None for x in inputs + outputs)


def test_more_rank_files_than_may_be_open_are_judged_from_two_threads(tmp_path, monkeypatch):
    # The inputs are read on one thread and the outputs on another, while at most
    # OPEN_FILES files are open: one thread closed a file the other was reading
    # ("I/O operation on closed file", exit 1) past 128 ranks. A file being read is
    # never closed now.
    p, n = 3, 30_000
    arrays = make_inputs("random", "float32", n, p, seed=5)
    write_world(tmp_path / "in", arrays)
    write_world(tmp_path / "out", expected_outputs("allreduce", arrays, algorithm="naive"))
    monkeypatch.setattr(NpyFile, "OPEN_FILES", 4)  # 6 files: as 129 ranks are with 256
    for _ in range(12):  # (a third of the checks failed before)
        inputs, outputs, _ = load_case(tmp_path / "in", tmp_path / "out", lazy=True)
        assert check_outputs(inputs, outputs, budget=20000).conforming
        assert len(NpyFile._open) == 0  # every file closed at the end


def test_a_big_endian_or_fortran_file_is_read_in_blocks_as_numpy_reads_it(tmp_path):
    x = np.arange(60, dtype=np.float32).reshape(6, 10)
    np.save(tmp_path / "be.npy", x.astype(">f4"))
    np.save(tmp_path / "f.npy", np.asfortranarray(x))
    for name in ("be.npy", "f.npy"):
        f = NpyFile(tmp_path / name, lambda path: open(path, "rb"))
        assert f.shape == (6, 10) and f.dtype == np.float32
        assert np.array_equal(f.read(7, 23), x.reshape(-1)[7:23])
        into = np.empty(5, np.float32)
        f.read(50, 55, out=into)
        assert np.array_equal(into, x.reshape(-1)[50:55])
        f.close()
        assert np.array_equal(f.whole(), x)


def test_a_fortran_file_is_judged_block_by_block_never_whole(tmp_path, monkeypatch):
    """A Fortran file's blocks were read from the whole array, held until the process ended:
    memory grew with the files' total size."""
    import refcoll.verify.npy as npy

    rng = np.random.default_rng(4)
    xs = [rng.integers(-100, 100, (40, 70)).astype(np.float32) for _ in range(3)]
    total = (xs[0] + xs[1]) + xs[2]
    for sub, arrays in (("in", xs), ("out", [total] * 3)):
        (tmp_path / sub).mkdir()
        for r, a in enumerate(arrays):
            np.save(tmp_path / sub / f"rank{r}.npy", np.asfortranarray(a))
    monkeypatch.setattr(npy, "read_npy", lambda *a, **k: pytest.fail("read whole"))
    def judged():
        ins, outs, _ = load_case(tmp_path / "in", tmp_path / "out", lazy=True)
        return check_outputs(ins, outs, budget=3000)  # blocks of a few rows
    assert judged().conforming
    spoiled = total.copy()
    spoiled[33, 9] += 1
    np.save(tmp_path / "out" / "rank2.npy", np.asfortranarray(spoiled))
    report = judged()
    assert not report.conforming
    assert "rank 2's output element 2319" in " ".join(f.detail for f in report.findings)


@pytest.mark.parametrize("layout", ["c", "big-endian", "fortran"])
def test_a_sample_of_a_file_is_its_elements_at_those_places(tmp_path, layout):
    # far apart (a read each), close together (one span), and spans cut at their limit
    x = np.arange(3 * 300_000, dtype=np.float64).reshape(3, 300_000)
    stored = {"c": x, "big-endian": x.astype(">f8"), "fortran": np.asfortranarray(x)}[layout]
    np.save(tmp_path / "a.npy", stored)
    f = NpyFile(tmp_path / "a.npy", lambda path: open(path, "rb"))
    flat = x.reshape(-1)
    for where in ([0], [3, 4, 9, 700, 100_000, flat.size - 1], range(0, flat.size, 3), []):
        where = np.asarray(list(where), dtype=np.int64)
        assert np.array_equal(f.take(where), flat[where])
    with pytest.raises(UsageError, match=f"holds {flat.size} elements; element {flat.size} "):
        f.take(np.array([5, flat.size]))
    f.close()


def _at_scale(tmp_path, *args) -> tuple[str, int]:
    """Run ``benchmarks/check_at_scale.py`` (one sample); return its output and the check's
    peak resident bytes (the child's own VmHWM)."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "check_at_scale.py"
    res = subprocess.run([sys.executable, str(script), "--samples", "1", "--dir",
                          str(tmp_path / "world"), *args], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    peak = re.search(r"peak (\d+) MiB resident", res.stdout)
    return res.stdout, int(peak[1]) << 20


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's VmHWM")
def test_check_holds_blocks_not_arrays(tmp_path):
    """2 ranks x 8M float32: 128 MiB of files, which whole arrays would need 600 MiB to
    judge (the float64 operands and the bound's arrays); blocks need a few dozen."""
    n = 1 << 23
    out, peak = _at_scale(tmp_path, "-p", "2", "--count", str(n), "--kind", "exact",
                          "--wrong", str(n - 3))
    assert f"rank 1 element {n - 3} is" in out, out  # differs from rank 0's
    assert f"first at rank 1's output element {n - 3}" in out, out  # a contribution too many
    assert peak < 256 << 20, peak


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's VmHWM")
def test_an_int8_all_reduce_past_2_to_the_31_elements_is_judged_from_disk(tmp_path):
    """2**31 + 3 elements on 2 ranks (8 GiB of files): indices past int32 in the findings."""
    n, wrong = 2**31 + 3, 2**31 + 1
    out, peak = _at_scale(tmp_path, "-p", "2", "--count", str(n), "--kind", "exact",
                          "--dtype", "int8", "--wrong", str(wrong))
    assert f"rank 1's output element {wrong} is" in out, out
    assert f"1 of {n} differ" in out
    assert f"rank 1 element {wrong}" in out  # and it differs from rank 0 there
    assert peak < 512 << 20, peak


# ------------------------------------------------------------ block checksums

@pytest.mark.parametrize("dtype,p", [("float32", 2), ("float32", 3), ("bfloat16", 2),
                                     ("float16", 8), ("float64", 2)])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_checksums_pass_every_conforming_order_and_catch_what_they_promise(dtype, p, op):
    n = 50_000
    xs = make_inputs("adversarial", dtype, n, p, seed=2)
    b = block_size(p, np.dtype(xs[0].dtype))
    ins = np.stack([checksums(x, b)[None] for x in xs])[:, 0]
    for algorithm in ("ring", "naive", "recursive_doubling"):
        out = expected_outputs("allreduce", xs, algorithm=algorithm, op=op)[0]
        outs = np.stack([checksums(out, b)] * p)
        assert judge_sums(ins, outs, p=p, dtype=xs[0].dtype, op=op, b=b, n=n) == []
    # One element moved by what smallest_caught promises, at the block's mean scale
    scale = np.abs(np.stack([x.astype(np.float64) for x in xs])).sum(axis=0)
    i = 3 * b + 5 if n > 3 * b + 5 else n // 2
    lo = (i // b) * b
    mean = scale[lo:lo + b].mean() / (p if op == "avg" else 1)
    spoiled = out.astype(np.float64)
    spoiled[i] += 1.01 * smallest_caught(p, xs[0].dtype, mean)
    bad = judge_sums(ins, np.stack([checksums(spoiled, b)] * p), p=p, dtype=xs[0].dtype, op=op,
                     b=b, n=n)
    assert bad and bad[0].lo <= i < bad[0].hi
    nan = out.copy()
    nan[i] = np.array(np.nan).astype(out.dtype)
    assert judge_sums(ins, np.stack([checksums(nan, b)] * p), p=p, dtype=xs[0].dtype, op=op,
                      b=b, n=n)


@pytest.mark.parametrize("dtype,magnitude,factor", [
    ("bfloat16", 1.0, 0.3),  # the factor rounded to the dtype is 2**-9 off: near the bound
    ("float16", 6e-5, 0.1),  # products among the subnormals: off by half their spacing
    ("float32", 1.0, 0.1)])
def test_a_premultiplied_sum_as_libraries_compute_it_passes_and_one_percent_is_caught(
        dtype, magnitude, factor):
    """NCCL's PREMUL_SUM, Gloo's under watch mode and refcoll's multiply each input by the
    factor rounded to the dtype, round the product, then sum: 2u of each input, and an
    absolute half-spacing where a product is subnormal."""
    p, n = 2, 8192
    dt = get_dtype(dtype)
    rng = np.random.default_rng(3)
    xs = [((rng.random(n) + 1.0) * magnitude).astype(dt) for _ in range(p)]
    if dtype == "bfloat16":  # the pair of [1, 2) whose premultiplied sum is furthest off
        xs = [np.full(n, 1.6953125, dt), np.full(n, 1.8125, dt)]
    f = dt.type(factor)
    got = (xs[0] * f + xs[1] * f).astype(dt)  # each product and the sum rounded once
    b = block_size(p, dt)
    ins = np.stack([checksums(x, b) for x in xs])
    assert judge_sums(ins, np.stack([checksums(got, b)] * p), p=p, dtype=dt, op="sum", b=b,
                      n=n, factor=factor) == []
    if dtype == "float32":  # a silent corruption of one element: caught in its block
        spoiled = got.copy()
        spoiled[4321] *= 1.01
        bad = judge_sums(ins, np.stack([checksums(spoiled, b)] * p), p=p, dtype=dt, op="sum",
                         b=b, n=n, factor=factor)
        assert bad and bad[0].lo <= 4321 < bad[0].hi


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_premultiplied_sum_with_each_ranks_own_factor_passes_and_one_percent_is_caught(dtype):
    """NCCL's pre-multiplier is each rank's own (a weighted average of uneven batches):
    the checksums hold each rank's inputs times its factor, not one factor for all."""
    p, n = 3, 8192
    dt = get_dtype(dtype)
    rng = np.random.default_rng(4)
    xs = [(rng.random(n) + 1.0).astype(dt) for _ in range(p)]
    factors = [0.5, 0.25, 0.125 * 3]
    got = xs[0] * dt.type(factors[0])
    for x, f in zip(xs[1:], factors[1:]):
        got = (got + x * dt.type(f)).astype(dt)
    b = block_size(p, dt)
    ins = np.stack([checksums(x, b) for x in xs])
    outs = np.stack([checksums(got, b)] * p)
    assert judge_sums(ins, outs, p=p, dtype=dt, op="sum", b=b, n=n, factor=factors) == []
    assert judge_sums(ins, outs, p=p, dtype=dt, op="sum", b=b, n=n, factor=0.5)  # one for all
    if dtype == "float32":
        spoiled = got.copy()
        spoiled[4321] *= 1.01
        bad = judge_sums(ins, np.stack([checksums(spoiled, b)] * p), p=p, dtype=dt, op="sum",
                         b=b, n=n, factor=factors)
        assert bad and bad[0].lo <= 4321 < bad[0].hi


def test_a_float32_block_catches_one_percent_of_a_typical_element():
    assert smallest_caught(2, np.float32) * 8 <= 0.0101
    assert smallest_caught(3, np.float32) * 8 <= 0.0101
    assert block_size(2, np.float32) == 4096
