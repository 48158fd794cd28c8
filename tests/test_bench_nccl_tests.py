"""refcoll bench as nccl-tests users read it: its layout, its options, in-place halves,
NCCL's choice.

A parser written as scripts read nccl-tests' output (data lines are the lines not
starting with ``#``, whitespace-split, 13 fields; ``# Avg bus bandwidth : X`` and
``# Out of bounds values : N OK``) is checked on a hand-written table in nccl-tests'
layout, then on refcoll's output in both formats. The NCCL plumbing (``NCCL_ALGO``,
the TUNING log) is checked with recorded lines: there is no GPU here.
"""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner
from conftest import mpiexec_path

from refcoll.bench import (
    AVERAGE,
    BenchConfig,
    NcclLog,
    bench_header,
    forced_mpi_env,
    format_table,
    over_ranks,
    oversubscription,
    parse_dtypes,
    parse_ops,
    summarize,
    variants,
)
from refcoll.bench.config import baseline_name, check_forced_mpi
from refcoll.bench.nccl_tests import float_str
from refcoll.cli import main
from refcoll.core.errors import UsageError

needs_mpi = pytest.mark.skipif(mpiexec_path() is None,
                               reason="no mpiexec: install with pip install 'refcoll[mpi]'")

FIELDS = ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "wrong",
          "ip_time", "ip_algbw", "ip_busbw", "ip_wrong")


def parse_nccl_tests(text: str, *, strict: bool = True) -> dict:
    """Read nccl-tests' output the way its users' scripts do.

    ``strict``: every data line has exactly nccl-tests' 13 fields; else the first 13.
    """
    rows, avg, oob = [], None, None
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            m = re.match(r"#\s*Avg bus bandwidth\s*:\s*(\S+)", line)
            if m:
                assert avg is None, "a second '# Avg bus bandwidth :' line"
                avg = float(line.split()[-1])
            m = re.match(r"#\s*Out of bounds values\s*:\s*(\d+)\s+(OK|FAILED)", line)
            if m:
                oob = (int(m[1]), m[2])
            continue
        fields = line.split()
        assert len(fields) == 13 if strict else len(fields) >= 13, line
        rows.append(dict(zip(FIELDS, fields[:13])))
    return {"rows": rows, "avg": avg, "oob": oob}


#: A table written by hand in nccl-tests' layout (all_reduce_perf, two sizes, -c 0 on one).
NCCL_TESTS_SAMPLE = """\
# nThread 1 nGpus 1 minBytes 8 maxBytes 64 step: 8(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0
#
# Using devices
#  Rank  0 Group  0 Pid   4242 on      node1 device  0 [0000:01:00] Some GPU
#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
           8             2     float     sum      -1    20.51    0.00    0.00      0    19.99    0.00    0.00      0
          64            16     float     sum      -1    21.02    0.00    0.01    N/A    20.73    0.00    0.01    N/A
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 0.005
#
"""  # noqa: E501 - nccl-tests' own line widths, verbatim


def test_the_parser_reads_nccl_tests_own_layout():
    got = parse_nccl_tests(NCCL_TESTS_SAMPLE)
    assert [(r["size"], r["type"], r["root"], r["wrong"], r["ip_wrong"]) for r in got["rows"]] == [
        ("8", "float", "-1", "0", "0"), ("64", "float", "-1", "N/A", "N/A")]
    assert got["avg"] == 0.005 and got["oob"] == (0, "OK")


@pytest.mark.parametrize("value,width,text", [
    (146.0934, 7, " 146.09"), (1359.64, 7, "1359.64"), (12646.31, 7, "12646.3"),
    (1234567.0, 7, "1234567"), (12345678.0, 7, "1.2e+07"), (0.0012, 6, "  0.00"),
    (338.82, 6, "338.82"), (1520.4, 6, "1520.4"), (None, 6, "   N/A"),
    (1e100, 7, "1.0e+10"),  # snprintf(str, width+1, ...) cuts what does not fit
])
def test_numbers_are_squeezed_into_their_columns_as_nccl_tests_does(value, width, text):
    assert float_str(value, width) == text


def test_average_takes_nccl_tests_modes_over_the_ranks_that_ran():
    times = [3.0, 1.0, None, 2.0]  # rank 2 sat this one out
    assert [over_ranks(times, mode) for mode in AVERAGE] == [3.0, 2.0, 1.0, 3.0]
    assert over_ranks([None, 5.0], 0) == 5.0 and over_ranks([None], 3) == 0.0


def test_types_and_ops_take_nccl_tests_names_and_all():
    assert parse_dtypes("float") == ["float32"]
    assert parse_dtypes("half,bfloat16,double,fp8_e4m3,f8e5m2,int16") == [
        "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2", "int16"]
    assert parse_dtypes("all")[:3] == ["int8", "uint8", "int32"] and len(parse_dtypes("all")) == 12
    assert parse_ops("all") == ["sum", "prod", "max", "min", "avg"]
    with pytest.raises(UsageError, match="unknown dtype 'floats'.*half"):
        parse_dtypes("floats")
    with pytest.raises(UsageError, match="unknown op 'mulsum'"):
        parse_ops("mulsum")


def test_all_runs_every_type_with_every_op_it_has():
    runs = variants(BenchConfig(dtype="all", op="all"))
    pairs = {(v.dtype, v.op) for v in runs}
    assert ("float8_e4m3fn", "sum") in pairs and ("float8_e4m3fn", "prod") not in pairs
    assert len(runs) == 10 * 5 + 2 * 3  # float8 has sum, max and min
    assert [v.dtype for v in runs[:5]] == ["int8"] * 5  # nccl-tests' order: types, then ops
    moves = variants(BenchConfig(collective="allgather", dtype="float,half", op="all"))
    assert [(v.dtype, v.op) for v in moves] == [("float32", "sum"), ("float16", "sum")]
    with pytest.raises(UsageError, match="'prod' is not supported on float8_e4m3fn"):
        from refcoll.bench import check_config
        check_config(BenchConfig(dtype="fp8_e4m3", op="prod"))


def test_oversubscription_counts_ranks_against_the_cores_they_may_use():
    ranks = [{"host": "a", "cores": [0, 1]}, {"host": "a", "cores": [0, 1]},
             {"host": "a", "cores": [1]}, {"host": "b", "cores": [0]}]
    assert oversubscription(ranks) == [
        {"host": "a", "ranks": 3, "cores": 2, "oversubscribed": True},
        {"host": "b", "ranks": 1, "cores": 1, "oversubscribed": False}]


def test_the_count_column_is_one_ranks_chunk_for_reduce_scatter_and_allgather(header):
    from refcoll.bench.nccl_tests import preamble

    # nccl-tests' row: size = the larger buffer (the whole array), count = paramcount.
    for collective, count in (("reduce_scatter", 4), ("allgather", 4), ("allreduce", 12)):
        row = _row(48, 1.0, 1.0, 0, collective=collective, ranks=3, count=12)
        assert preamble(row).split()[:2] == ["48", str(count)], collective
        for fmt, strict in (("nccl-tests", True), ("refcoll", False)):
            (got,) = parse_nccl_tests(format_table(header, [row], fmt), strict=strict)["rows"]
            assert (got["size"], got["count"]) == ("48", str(count)), (collective, fmt)


# ---------------------------------------------------------------- both formats, offline

def _row(size, busbw, ip_busbw, wrong, **extra):
    row = {"collective": "allreduce", "algorithm": "ring", "resolved": None, "ranks": 2,
           "size": size, "count": size // 4, "dtype": "float32", "op": "sum", "root": None,
           "time_us": 10.0, "algbw": busbw, "busbw": busbw, "wrong": wrong,
           "checked": None if wrong is None else size // 4, "wrong_ranks": wrong and 1,
           "inplace_time_us": 11.0, "inplace_algbw": ip_busbw, "inplace_busbw": ip_busbw,
           "inplace_wrong": wrong, "inplace_checked": None if wrong is None else size // 4,
           "inplace_wrong_ranks": wrong and 1, "baseline": "MPI_Allreduce", "base_time_us": 5.0,
           "base_busbw": 9.0, "base_wrong": 0, "time_over_base": 2.0,
           "base_inplace_time_us": 6.0, "base_inplace_busbw": 7.0, "base_inplace_wrong": 0,
           "bound_us": None, "time_over_bound": None, "wire_sent": None, "nccl_algo": None,
           "baselines": {"mpi": {"baseline": "MPI_Allreduce", "time_us": 5.0, "busbw": 9.0,
                                 "wrong": 0, "checked": 1, "time_over": 2.0,
                                 "inplace_time_us": 6.0, "inplace_busbw": 7.0,
                                 "inplace_wrong": 0, "inplace_checked": 1}}}
    row.update(extra)
    return row


@pytest.fixture(scope="module")
def header():
    from mpi4py import MPI

    return bench_header(MPI.COMM_SELF, BenchConfig(sizes=[8, 64], algorithms=["ring"]))


@pytest.mark.parametrize("fmt,strict", [("nccl-tests", True), ("refcoll", False)])
def test_a_parser_of_nccl_tests_reads_both_formats(header, fmt, strict):
    rows = [_row(8, 1.0, 2.0, 0), _row(64, 3.0, 4.0, 5), _row(64, 100.0, 100.0, 0,
                                                            algorithm="tree")]
    text = format_table(header, rows, fmt)
    got = parse_nccl_tests(text, strict=strict)
    # nccl-tests prints one data line per size: tree's row (not under test) is a # line there.
    shown = 2 if fmt == "nccl-tests" else 3
    assert [(r["size"], r["count"], r["type"], r["redop"], r["root"]) for r in got["rows"]] == [
        ("8", "2", "float", "sum", "-1"), ("64", "16", "float", "sum", "-1"),
        ("64", "16", "float", "sum", "-1")][:shown]
    assert [(r["busbw"], r["wrong"], r["ip_busbw"], r["ip_wrong"]) for r in got["rows"][:2]] == [
        ("1.00", "0", "2.00", "0"), ("3.00", "5", "4.00", "5")]
    # The algorithm under test (ring, the first) over both halves; not tree's, not MPI's 8.
    assert got["avg"] == pytest.approx(2.5) == summarize(rows)["under_test_avg_busbw"]
    if fmt == "nccl-tests":  # what a script averaging the data lines gets is the footer's
        lines = got["rows"]
        mean = sum(float(r[k]) for r in lines for k in ("busbw", "ip_busbw")) / (2 * len(lines))
        assert mean == pytest.approx(got["avg"])
        (tree,) = [line for line in text.splitlines() if line.startswith("#") and "100.00" in line]
        data = [line for line in text.splitlines() if not line.startswith("#")]
        assert len(tree) == len(data[0]) and tree.split()[1:3] == ["64", "16"]  # columns kept
    assert got["oob"] == (2, "FAILED")  # the two halves of the 64 B row had a wrong element


def test_each_roots_baseline_counts_in_its_average():
    rows = [_row(8, 1.0, 1.0, 0, collective="reduce", root=root, base_busbw=busbw,
                 base_inplace_busbw=busbw, base_wrong=root,
                 baselines={"mpi": {"baseline": "MPI_Reduce", "time_us": 5.0, "busbw": busbw,
                                    "wrong": root, "checked": 2, "time_over": 2.0,
                                    "inplace_time_us": 6.0, "inplace_busbw": busbw,
                                    "inplace_wrong": 0, "inplace_checked": 2}})
            for root, busbw in ((0, 2.0), (1, 4.0))]
    summary = summarize(rows)
    assert summary["base_avg_busbw"] == summary["baselines"]["mpi"]["avg_busbw"] == 3.0
    assert summary["base_wrong"] == summary["baselines"]["mpi"]["wrong"] == 1


def test_rows_too_small_for_an_element_each_count_their_baseline():
    """Sizes too small for a chunk's element (8, 16, 32 B of a 3-rank reduce-scatter) all
    print as 0 B: their baseline rows were taken as one, and its average skipped two."""
    rows = [_row(0, 1.0, 1.0, 0, requested=requested, base_busbw=busbw,
                 base_inplace_busbw=busbw,
                 baselines={"mpi": {"baseline": "MPI_Allreduce", "time_us": 5.0, "busbw": busbw,
                                    "wrong": 0, "checked": 1, "time_over": 2.0,
                                    "inplace_time_us": 6.0, "inplace_busbw": busbw,
                                    "inplace_wrong": 0, "inplace_checked": 1}})
            for requested, busbw in ((8, 1.0), (16, 2.0), (32, 6.0))]
    rows.append(dict(rows[2], algorithm="tree"))  # another algorithm's row: the same baseline
    summary = summarize(rows)
    assert summary["base_avg_busbw"] == summary["baselines"]["mpi"]["avg_busbw"] == 3.0


def test_a_switch_runs_row_is_timed_and_bandwidthed_over_its_workers():
    """A switch process's serving time was reduced with the workers' (-a 1: 15 % low), and
    the row's busbw took (n-1)/(n+1) where nccl-tests takes 2(n-1)/n whatever the algorithm."""
    from refcoll.bench.rows import Reduced, make_row

    class Groups:
        layout, workers = {"switch": (2, 3)}, 3

    config = BenchConfig(sizes=[4096], algorithms=["switch"], average=1, against=["none"])
    by_key = {("ours", "switch"): Reduced(239.5e-6, 0, 2048, [402.5e-6, 158.9e-6, 157.1e-6])}
    row = make_row(config, Groups(), 4096, "switch", None, by_key, None)
    assert row["time_us"] == pytest.approx((402.5 + 158.9) / 2)
    assert row["rank_times_us"] == pytest.approx([402.5, 158.9])
    assert row["busbw"] == pytest.approx(row["algbw"] * 2 * (2 - 1) / 2)
    assert row["requested"] == 4096 and row["ranks"] == 2


def test_no_check_prints_n_a_under_wrong_in_both_formats(header):
    unchecked = dict(header, check=False)
    rows = [_row(8, 1.0, 2.0, None)]
    for fmt, strict in (("nccl-tests", True), ("refcoll", False)):
        (row,) = parse_nccl_tests(format_table(unchecked, rows, fmt), strict=strict)["rows"]
        assert row["wrong"] == row["ip_wrong"] == "N/A"


@pytest.mark.parametrize("count", [0, 1, 5])
def test_the_header_gives_the_check_count_as_nccl_tests_c_took_it(count):
    from mpi4py import MPI

    header = bench_header(MPI.COMM_SELF, BenchConfig(sizes=[8], algorithms=["ring"],
                                                     check=count))
    assert header["check"] is (count > 0) and header["validation"] == count
    line = format_table(header, [_row(8, 1.0, 2.0, 0 if count else None)],
                        "nccl-tests").splitlines()[1]
    assert f" validation: {count} graph: 0 " in line


def test_nccl_tests_format_moves_refcoll_columns_to_comments(header):
    text = format_table(header, [_row(8, 1.0, 2.0, 0, resolved=None)], "nccl-tests")
    lines = text.splitlines()
    assert lines[0] == "# Collective test starting: all_reduce_perf"
    assert lines[1].startswith("# nThread 1 nGpus 1 minBytes 8 maxBytes 64 step: 8(factor) "
                               "warmup iters: 5 iters: 20")
    assert re.fullmatch(r"#  Rank  0 Group  0 Pid +\d+ on +\S+ device -1 \[\d+ cores\] .*",
                        lines[4])
    data = [line for line in lines if not line.startswith("#")]
    comment = lines[lines.index(data[0]) + 1]
    assert comment.startswith("#  ^ refcoll: algorithm ring; MPI_Allreduce 5.00 us busbw 9.00, "
                              "in place 6.00 us busbw 7.00, time/base 2.00")
    assert [line for line in lines if "Avg bus bandwidth" in line] == [
        "# Avg bus bandwidth    : 1.5 "]
    assert lines[-3:] == ["#", "# Collective test concluded: all_reduce_perf", "#"]


def test_refcoll_format_gives_each_baseline_its_own_average_line(header):
    text = format_table(header, [_row(8, 1.0, 2.0, 0), _row(8, 6.0, 6.0, 0, algorithm="tree")])
    averages = [line for line in text.splitlines() if "Avg bus bandwidth" in line]
    assert averages == ["# Avg bus bandwidth    : 1.5", "# Avg bus bandwidth (ring) : 1.5",
                        "# Avg bus bandwidth (tree) : 6", "# Avg bus bandwidth (MPI_Allreduce) : 8"]


# --------------------------------------------------------------- forcing MPI's algorithm

def test_mpi_colon_algo_forces_the_library_algorithm_and_labels_the_baseline():
    config = BenchConfig(against="mpi:ring,gloo")
    assert forced_mpi_env(config, "mpich") == {"MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": "ring"}
    assert forced_mpi_env(BenchConfig(against="mpi"), "mpich") == {}
    assert baseline_name(config, "mpi") == "MPI_Allreduce[ring]"
    assert forced_mpi_env(BenchConfig(against="mpi:ring"), "openmpi")[
        "OMPI_MCA_coll_tuned_use_dynamic_rules"] == "1"
    with pytest.raises(UsageError, match="has no allreduce algorithm 'rung'; it has: .*ring"):
        forced_mpi_env(BenchConfig(against="mpi:rung"), "mpich")
    with pytest.raises(UsageError, match="only mpi takes an algorithm"):
        forced_mpi_env(BenchConfig(against="gloo:ring"), "mpich")


def test_inside_a_job_a_forced_algorithm_needs_its_variables(monkeypatch):
    monkeypatch.delenv("MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM", raising=False)
    monkeypatch.setattr("refcoll.baselines.mpi_algorithms.library_of", lambda text: "mpich")
    config = BenchConfig(against="mpi:ring")
    with pytest.raises(UsageError, match=r"rank 3: .*set MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=ring"):
        check_forced_mpi(config, 3)
    monkeypatch.setenv("MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM", "ring")
    assert check_forced_mpi(config, 3) == {"MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": "ring"}


def test_bench_starts_mpiexec_with_the_forced_algorithm(monkeypatch, launched):

    seen = launched
    monkeypatch.setattr("refcoll.baselines.mpi_algorithms.installed_library", lambda: "mpich")
    res = CliRunner().invoke(main, ["bench", "-n", "2",
                                    "--against", "mpi:reduce_scatter_allgather"])
    assert res.exit_code == 0, res.output
    assert seen["env"]["MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM"] == "reduce_scatter_allgather"
    # nccl-tests' -c takes a count of checked calls (-c 5): still a run, checked throughout.
    seen.clear()
    res = CliRunner().invoke(main, ["bench", "-n", "2", "-c", "5", "-a", "0", "-r", "1"])
    assert res.exit_code == 0 and seen["cmd"][:3] == ["mpiexec", "-n", "2"], res.output


# ------------------------------------------------------------------------ NCCL, offline

#: TUNING lines as NCCL 2.23 and 2.24 write them (rank 0's NCCL_DEBUG_FILE).
TUNING_LINES = [
    "node1:4242:4250 [0] NCCL INFO Channel 00/02 :    0   1\n",
    "node1:4242:4242 [0] NCCL INFO AllReduce: 8 Bytes -> Algo 1 proto 0 time 6.100000\n",
    "node1:4242:4242 [0] NCCL INFO AllReduce: 4194304 Bytes -> Algo RING proto SIMPLE "
    "channel{Lo..Hi}={0..3}\n",
]


def test_nccl_runs_with_its_tuning_log_and_the_choice_is_read_per_size(tmp_path):
    environ = {"NCCL_PROTO": "Simple"}
    log = NcclLog.start(BenchConfig(against="nccl", nccl_algo="Ring"), environ, str(tmp_path))
    assert environ["NCCL_DEBUG"] == "INFO" and "TUNING" in environ["NCCL_DEBUG_SUBSYS"]
    assert environ["NCCL_ALGO"] == "Ring" and environ["NCCL_PROTO"] == "Simple"
    assert environ["NCCL_DEBUG_FILE"].startswith(str(tmp_path / f"refcoll-nccl-{os.getpid()}."))
    path = environ["NCCL_DEBUG_FILE"].replace("%h", "node1").replace("%p", "4242")
    with open(path, "w") as fh:
        fh.writelines(TUNING_LINES[:2])
    small = log.choice("allreduce", 8)
    assert (small.algo, small.proto, small.channels) == ("Ring", "LL", None)
    with open(path, "a") as fh:
        fh.write(TUNING_LINES[2])
    big = log.choice("allreduce", 4 << 20)
    assert (big.algo, big.proto, big.channels) == ("Ring", "Simple", (0, 3))
    assert log.choice("allreduce", 8) is None  # nothing new since the last read
    log.close()
    assert not os.path.exists(path)
    assert environ == {"NCCL_PROTO": "Simple"}  # NCCL's variables as they were before


def test_nccl_choice_reaches_the_row_and_both_tables(header):
    from refcoll.baselines.nccl_log import parse_tuning

    (choice,) = parse_tuning(TUNING_LINES[2:])
    with_nccl = dict(header, nccl={"algo": None, "proto": None})
    row = _row(4 << 20, 1.0, 1.0, 0, nccl_algo=choice.algo, nccl_proto=choice.proto,
               nccl_channels=choice.channels[1] - choice.channels[0] + 1)
    (line,) = [x for x in format_table(with_nccl, [row]).splitlines() if not x.startswith("#")]
    assert line.split()[-1] == "Ring/Simple"
    assert "NCCL chose Ring/Simple on 4 channels" in format_table(with_nccl, [row], "nccl-tests")


# ------------------------------------------------------------------------- real runs

@needs_mpi
def test_a_real_run_in_nccl_tests_format_reads_as_its_json(tmp_path, monkeypatch):
    monkeypatch.setenv("REFCOLL_CACHE", str(tmp_path))
    monkeypatch.setenv("REFCOLL_CALIBRATION", "default")
    out = tmp_path / "bench.json"
    res = subprocess.run([sys.executable, "-m", "refcoll", "bench", "-n", "2", "-b", "8",
                          "-e", "1K", "-f", "8", "-w", "1", "-i", "2", "-a", "1", "-d", "float",
                          "--algorithm", "ring", "--format", "nccl-tests", "--json", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    got = parse_nccl_tests(res.stdout)
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [int(r["size"]) for r in got["rows"]] == [r["size"] for r in rows] == [8, 64, 512]
    for line, row in zip(got["rows"], rows):
        assert (line["type"], line["redop"], line["root"]) == ("float", "sum", "-1")
        assert line["time"] == float_str(row["time_us"], 7).strip()
        assert line["ip_time"] == float_str(row["inplace_time_us"], 7).strip()
        assert line["wrong"] == line["ip_wrong"] == "0"
        # -a 1: the mean of every rank's median, each rank's kept in the JSON.
        for prefix in ("", "inplace_"):
            ranks = row[prefix + "rank_times_us"]
            assert len(ranks) == 2 and all(t > 0 for t in ranks)
            assert row[prefix + "time_us"] == pytest.approx(sum(ranks) / 2)
        assert row["baselines"]["mpi"]["inplace_wrong"] == 0
    assert got["avg"] == float(f"{data['summary']['under_test_avg_busbw']:g}")
    assert got["oob"] == (0, "OK")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert data["header"]["hosts"][0]["cores"] == cores
    assert data["header"]["oversubscribed"] == (2 > cores)
    assert [r["rank"] for r in data["header"]["ranks"]] == [0, 1]


SCRIPT = textwrap.dedent("""
    import json, sys
    from mpi4py import MPI
    from refcoll.calls import collectives as api
    from refcoll.bench import BenchConfig, run_bench

    out = {}
    for coll, algo in [("allreduce", "ring"), ("reduce_scatter", "ring"), ("allgather", "ring"),
                       ("broadcast", "tree"), ("reduce", "tree")]:
        config = BenchConfig(sizes=[48], algorithms=[algo], collective=coll, warmup=0, iters=1,
                             root=1, dtype="int32")
        out[coll] = [(r["wrong"], r["inplace_wrong"], r["inplace_checked"],
                      r["baselines"]["mpi"]["inplace_wrong"], r["root"])
                     for r in run_bench(MPI.COMM_WORLD, config)]
    # -r -1: every root in turn, as nccl-tests' broadcast_perf and reduce_perf run them.
    for coll in ("broadcast", "reduce"):
        config = BenchConfig(sizes=[48], algorithms=["tree"], collective=coll, warmup=0, iters=1,
                             root=-1, dtype="int32")
        out["every_root_" + coll] = [(r["root"], r["wrong"], r["inplace_wrong"],
                                      r["baselines"]["mpi"]["wrong"])
                                     for r in run_bench(MPI.COMM_WORLD, config)]
    real = api.allreduce
    api.allreduce = lambda x, t, out=None, **kw: out if out is x else real(x, t, out=out, **kw)
    (row,) = run_bench(MPI.COMM_WORLD, BenchConfig(sizes=[48], algorithms=["ring"], warmup=0,
                                                   iters=1))
    out["lazy"] = (row["wrong"], row["inplace_wrong"], row["inplace_checked"])
    # In place, a reduce-scatter's result is a view of its input and an allgather's input a
    # view of its result: a call that does nothing when they share memory must be caught.
    import numpy as np
    for name in ("reduce_scatter", "allgather"):
        real = getattr(api, name)
        setattr(api, name, lambda x, t, out=None, real=real, **kw: out if out is not None
                and np.shares_memory(out, x) else real(x, t, out=out, **kw))
        (row,) = run_bench(MPI.COMM_WORLD, BenchConfig(sizes=[48], algorithms=["ring"],
                                                       collective=name, warmup=0, iters=1,
                                                       dtype="int32"))
        out["lazy_" + name] = (row["wrong"], row["inplace_wrong"], row["inplace_checked"],
                               row["inplace_wrong_ranks"])
    if MPI.COMM_WORLD.rank == 0:
        json.dump(out, open(sys.argv[1], "w"))
""")


@needs_mpi
def test_every_collective_is_checked_in_place_as_nccl_tests_lays_it_out(tmp_path):
    script, result = tmp_path / "inplace.py", tmp_path / "inplace.json"
    script.write_text(SCRIPT)
    env = {**os.environ, "REFCOLL_CACHE": str(tmp_path), "REFCOLL_CALIBRATION": "default"}
    res = subprocess.run([mpiexec_path(), "-n", "3", sys.executable, str(script), str(result)],
                         capture_output=True, text=True, timeout=150, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    got = json.loads(result.read_text())
    counted = {"allreduce": 12 * 3, "reduce_scatter": 4 * 3, "allgather": 12 * 3,
               "broadcast": 12 * 3, "reduce": 12}  # elements checked: one run, 3 ranks
    for coll in ("broadcast", "reduce"):
        assert got.pop("every_root_" + coll) == [[root, 0, 0, 0] for root in range(3)], coll
    for coll, rows in got.items():
        if coll.startswith("lazy"):
            continue
        (wrong, ip_wrong, ip_checked, mpi_ip_wrong, root) = rows[0]
        assert (wrong, ip_wrong, mpi_ip_wrong) == (0, 0, 0), coll
        assert ip_checked == counted[coll], coll
        assert root == (1 if coll in ("broadcast", "reduce") else None)
    # An in-place call that writes nothing leaves each rank its own input: wrong throughout.
    assert got["lazy"] == [0, 36, 36]
    # Reduce-scatter: each rank's chunk still holds its own input, not the sum (4 a rank).
    assert got["lazy_reduce_scatter"] == [0, 12, 12, 3]
    # Allgather: each rank's own row is its input, the two others still hold the poison.
    assert got["lazy_allgather"] == [0, 2 * 4 * 3, 36, 3]


@needs_mpi
@pytest.mark.parametrize("args,message", [
    (["--collective", "broadcast", "-r", "5"], "-r 5 is not one of the 2 data ranks (0..1)"),
], ids=["root"])
def test_inside_a_users_job_every_rank_refuses_before_any_table(tmp_path, args, message):
    env = {**os.environ, "REFCOLL_CACHE": str(tmp_path), "REFCOLL_CALIBRATION": "default"}
    res = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, "-m", "refcoll", "bench",
                          "-b", "8", "-e", "8", "-w", "0", "-i", "1", *args],
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 2 and res.stdout == "", res.stdout + res.stderr
    assert res.stderr.splitlines() == [f"refcoll: error: {message}"] * 2, res.stderr


def test_in_place_inputs_are_copied_back_outside_the_clock(monkeypatch):
    from mpi4py import MPI

    from refcoll.bench import _Item, run

    clock = [0.0]
    monkeypatch.setattr(run.time, "perf_counter", lambda: clock[0])

    def advance(seconds):
        return lambda: clock.__setitem__(0, clock[0] + seconds)

    item = _Item("ours_ip", "ring", MPI.COMM_SELF, advance(1.0), prepare=advance(100.0))
    item.run(timed=True, check=False)
    assert item.times == [1.0]  # the copy (100 s on this clock) came before the clock started


@needs_mpi
def test_a_forced_mpi_algorithm_is_set_for_the_job_and_refused_without_it(tmp_path, monkeypatch):
    from refcoll.baselines import mpi_algorithms

    if mpi_algorithms.installed_library() != "mpich":
        pytest.skip("the variable checked here is MPICH's")
    monkeypatch.setenv("REFCOLL_CACHE", str(tmp_path))
    monkeypatch.setenv("REFCOLL_CALIBRATION", "default")
    monkeypatch.delenv("MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM", raising=False)
    out = tmp_path / "bench.json"
    args = ["-m", "refcoll", "bench", "-b", "64", "-e", "64", "-w", "0", "-i", "1", "--algorithm",
            "ring", "--against", "mpi:ring"]
    res = subprocess.run([sys.executable, *args, "-n", "2", "--json", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    header = json.loads(out.read_text())["header"]
    assert header["mpi"]["algorithm"] == "ring" and header["baseline"] == "MPI_Allreduce[ring]"
    assert header["mpi"]["forced_env"] == {"MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": "ring"}
    assert "# MPI algorithm forced: ring (MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=ring)" in res.stdout
    # Started by a user's mpiexec without the variable: every rank refuses, nothing is timed.
    res = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, *args],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stdout == "", res.stdout + res.stderr
    refusals = [line for line in res.stderr.splitlines()
                if "set MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=ring" in line]
    assert sorted(line.split(":")[2].strip() for line in refusals) == ["rank 0", "rank 1"]
