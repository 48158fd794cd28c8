"""refcoll gen-inputs / oracle / check: judging other implementations' outputs."""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import mpiexec_path

import refcoll
import refcoll.cli.check as check_command
from refcoll.cli import main
from refcoll.verify.inputs import make_inputs, read_rank_files, write_rank_files
from refcoll.verify.oracle import check_outputs


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def flip_bit(arr, index, bit=0):
    out = arr.copy()
    view = out.reshape(-1).view(f"uint{8 * out.dtype.itemsize}")
    view[index] ^= np.array(1 << bit, dtype=view.dtype)
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int16", "float8_e5m2"])
def test_rank_files_round_trip_every_dtype(tmp_path, dtype):
    xs = make_inputs("random", dtype, 9, 3, op="sum")
    write_rank_files(tmp_path, xs)
    back = read_rank_files(tmp_path)
    assert [b.dtype for b in back] == [x.dtype for x in xs]
    assert all(b.tobytes() == x.tobytes() for b, x in zip(back, xs))


def test_gen_inputs_oracle_check_round_trip(tmp_path):
    assert invoke("gen-inputs", "-p", 5, "--count", 257, "--dtype", "float32",
                  "--kind", "random", tmp_path / "in").exit_code == 0
    assert invoke("oracle", "--algorithm", "rabenseifner",
                  tmp_path / "in", tmp_path / "out").exit_code == 0
    res = invoke("check", "--algorithm", "rabenseifner", "--json", tmp_path / "r.json",
                 tmp_path / "in", tmp_path / "out")
    assert res.exit_code == 0, res.output
    assert res.output.strip().endswith("verdict: conforming")
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["conforming"] and report["ranks"] == 5
    # Random floats expose the order: another algorithm's bits differ.
    res = invoke("check", "--algorithm", "ring", tmp_path / "in", tmp_path / "out")
    assert res.exit_code == 1 and "bit-exact against ring" in res.output


def test_a_flipped_bit_names_the_rank_and_element():
    xs = make_inputs("random", "float32", 1000, 4)
    outs = list(refcoll.simulate("allreduce", xs, algorithm="ring").outputs)
    outs[2] = flip_bit(outs[2], 17, bit=30)  # an exponent bit: far outside the bound too
    report = check_outputs(xs, outs, algorithm="ring")
    assert not report.conforming
    by_name = {f.check: f for f in report.findings}
    assert by_name["identical on every rank"].data["differing_ranks"] == [2]
    assert by_name["bit-exact against ring"].data["rank"] == 2
    assert by_name["bit-exact against ring"].data["index"] == 17
    assert by_name["within the error bound"].data["rank"] == 2
    assert by_name["within the error bound"].data["index"] == 17


@pytest.mark.parametrize("p, bad, named", [(5, [0], [0]), (5, [0, 3], [1, 2, 3, 4]),
                                            (2, [0], [1]), (3, [1], [1])])
def test_the_rank_that_differs_from_all_the_others_is_the_one_named(p, bad, named):
    xs = make_inputs("random", "float32", 1000, p)
    outs = list(refcoll.simulate("allreduce", xs, algorithm="ring").outputs)
    for r in bad:
        outs[r] = flip_bit(outs[r], 100 + r, bit=0)
    found = {f.check: f for f in check_outputs(xs, outs).findings}["identical on every rank"]
    assert found.data["differing_ranks"] == named and not found.passed
    if named == [0]:  # the others agree: rank 0 is the odd one, not ranks 1..4
        assert found.detail.startswith("rank 0 differs from every other rank, which agree")
        assert "rank 0 element 100" in found.detail and "(1 of 1000 elements" in found.detail


@pytest.mark.parametrize("budget", [None, 384])  # (384 B: blocks of a few elements)
def test_ranks_that_agree_only_in_part_never_make_rank_0_the_odd_one(budget):
    """Rank 2 differs from rank 0 only where rank 1 does (and as rank 1 does): in the
    blocks where rank 2 holds rank 0's bits it differs from rank 1, so they do not agree."""
    kwargs = {} if budget is None else {"budget": budget}
    xs = [np.arange(4, dtype=np.int32) + 10 * r for r in range(3)]
    outs = [np.concatenate(xs) for _ in range(3)]
    outs[1][:8] = -1
    outs[2][4:8] = -1
    found = {f.check: f for f in check_outputs(xs, outs, collective="allgather",
                                                 **kwargs).findings}
    assert found["identical on every rank"].data["differing_ranks"] == [1, 2]
    xs = [np.arange(4096, dtype=np.int64) + r for r in range(3)]
    outs = [sum(xs) for _ in range(3)]
    outs[1][:] = -1
    outs[2][2048:] = -1
    found = {f.check: f for f in check_outputs(xs, outs, **kwargs).findings}
    assert found["identical on every rank"].data["differing_ranks"] == [1, 2]


@pytest.mark.parametrize("count", [1, 3, 1001])
def test_a_last_bit_flipped_past_the_whole_words_is_seen(count):
    # Blocks are compared 8 bytes at a time: the odd float32 at the end is compared too.
    xs = make_inputs("random", "float32", count, 3)
    outs = list(refcoll.simulate("allreduce", xs, algorithm="ring").outputs)
    outs[1] = flip_bit(outs[1], count - 1, bit=0)  # within the bound: only the bits tell
    report = check_outputs(xs, outs, algorithm="ring")
    by_name = {f.check: f for f in report.findings}
    assert by_name["identical on every rank"].data["differing_ranks"] == [1]
    assert by_name["bit-exact against ring"].data["index"] == count - 1


def test_a_missing_and_a_doubled_contribution_are_named():
    xs = make_inputs("exact", "float32", 64, 5)
    total = refcoll.verify.oracle.fold("sum", xs)
    missing = check_outputs(xs, [total - xs[3]] * 5)
    finding = next(f for f in missing.findings if f.check.startswith("every rank"))
    assert not finding.passed and finding.data["missing"] == [3]
    twice = check_outputs(xs, [total + xs[1]] * 5)
    finding = next(f for f in twice.findings if f.check.startswith("every rank"))
    assert not finding.passed and finding.data["twice"] == [1]


@pytest.mark.parametrize("p", [3, 5, 6])
def test_nccls_premultiplied_average_of_exact_inputs_conforms_and_a_missing_rank_is_named(p):
    """NCCL averages floats as a sum of each input times fl(1/p), each product rounded:
    other bits than fl(S/p) where 1/p is inexact, all within the bound of every average."""
    xs = make_inputs("exact", "float32", 500, p)
    f = np.float32(1) / np.float32(p)

    def premultiplied(ranks):
        acc = np.zeros_like(xs[0])
        for q in ranks:
            acc = acc + xs[q] * f
        return acc

    right = premultiplied(range(p))
    post = (refcoll.verify.oracle.fold("sum", xs).astype(np.float64) / p).astype(np.float32)
    assert not np.array_equal(right, post)  # the bits a sum-then-divide check would refuse
    assert check_outputs(xs, [right] * p, op="avg").conforming
    for out in (premultiplied(q for q in range(p) if q != 1), post - xs[1] / p):
        report = check_outputs(xs, [out] * p, op="avg")
        finding = next(f for f in report.findings if f.check.startswith("every rank"))
        assert not finding.passed and finding.data["missing"] == [1], finding.detail


def test_reduce_scatter_and_reduce_outputs_are_judged_per_rank():
    xs = make_inputs("random", "float64", 11, 3)
    rs = refcoll.simulate("reduce_scatter", xs, algorithm="ring").outputs
    assert check_outputs(xs, rs, collective="reduce_scatter", algorithm="ring").conforming
    red = refcoll.simulate("reduce", xs, algorithm="tree", root=2).outputs
    assert red[0] is None
    assert check_outputs(xs, red, collective="reduce", algorithm="tree", root=2).conforming


def test_unusable_input_exits_2(tmp_path):
    xs = make_inputs("random", "float32", 8, 2)
    write_rank_files(tmp_path / "in", xs)
    write_rank_files(tmp_path / "out", [xs[0].astype(np.float64)] * 2)
    assert invoke("check", tmp_path / "in", tmp_path / "missing").exit_code == 2
    res = invoke("check", tmp_path / "in", tmp_path / "out")
    assert res.exit_code == 2 and "expected float32" in res.output
    assert invoke("check", "--algorithm", "ring", "--any",
                  tmp_path / "in", tmp_path / "in").exit_code == 2


MPI_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    from mpi4py import MPI
    from refcoll.verify.inputs import read_rank_files
    comm = MPI.COMM_WORLD
    x = read_rank_files(sys.argv[1])[comm.rank]
    y = np.empty_like(x)
    comm.Allreduce(x, y, op=MPI.SUM)
    np.save(f"{sys.argv[2]}/rank{comm.rank}.npy", y)
""")


@pytest.mark.skipif(mpiexec_path() is None,
                    reason="no mpiexec: install with pip install 'refcoll[mpi]'")
def test_the_mpi_librarys_own_allreduce_is_judged_conforming(tmp_path):
    script = tmp_path / "mpi_allreduce.py"
    script.write_text(MPI_SCRIPT)
    (tmp_path / "out").mkdir()
    assert invoke("gen-inputs", "-p", 4, "--count", 4099, "--kind", "random",
                  tmp_path / "in").exit_code == 0
    subprocess.run([mpiexec_path(), "-n", "4", sys.executable, str(script), str(tmp_path / "in"),
                    str(tmp_path / "out")], check=True, timeout=120)
    res = invoke("check", "--any", tmp_path / "in", tmp_path / "out")
    assert res.exit_code == 0, res.output
    # One flipped bit in one rank's output is caught, and named.
    bad = flip_bit(np.load(tmp_path / "out" / "rank3.npy"), 1234, bit=29)
    np.save(tmp_path / "out" / "rank3.npy", bad)
    res = invoke("check", "--any", "--json", tmp_path / "r.json", tmp_path / "in", tmp_path / "out")
    assert res.exit_code == 1
    report = json.loads((tmp_path / "r.json").read_text())
    identical = next(f for f in report["findings"] if f["check"] == "identical on every rank")
    assert identical["data"]["differing_ranks"] == [3]
    assert "rank 3 element 1234" in identical["detail"]


def test_the_reports_notes_are_printed_before_the_verdict(tmp_path, monkeypatch):
    def with_a_note(*args, **kwargs):
        report = check_outputs(*args, **kwargs)
        report.notes = ["passed on the error bound alone"]
        return report

    monkeypatch.setattr(check_command, "check_outputs", with_a_note)
    assert invoke("gen-inputs", "-p", 3, "--count", 5, tmp_path / "in").exit_code == 0
    assert invoke("oracle", "--algorithm", "ring", tmp_path / "in", tmp_path / "out").exit_code == 0
    res = invoke("check", tmp_path / "in", tmp_path / "out")
    assert res.exit_code == 0, res.output
    lines = res.output.strip().splitlines()
    assert lines[-2:] == ["note: passed on the error bound alone", "verdict: conforming"]


def test_infinities_and_overflow_give_no_numpy_warnings(tmp_path):
    """inf + -inf and sums past the largest float are the oracle's to judge, not NumPy's to
    warn of, on the main thread or the simulated ranks' own."""
    import warnings

    write_rank_files(tmp_path / "in", [np.array([v, 3e38], np.float32)
                                       for v in (np.inf, -np.inf, 1.0)])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert invoke("oracle", "--algorithm", "naive", tmp_path / "in",
                      tmp_path / "out").exit_code == 0
        res = invoke("check", "--identify", tmp_path / "in", tmp_path / "out")
    assert res.exit_code == 0, res.output
    assert not [w for w in seen if issubclass(w.category, RuntimeWarning)], \
        [str(w.message) for w in seen]
