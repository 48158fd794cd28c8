"""`refcoll model --sweep/--compare/--fit`: nccl-tests' terms, real systems, published tables.

The reader of ``all_reduce_perf`` outputs on every format the stored tables use; what
NCCL runs on a system, held to the physics the model claims (the 2-node tree's network
bytes, NVLS where the hardware has it, LL128 on NVLink only, the host path); a fit that
recovers constants it did not see; the CLI's rows and refusals; every stored table with
its source; the benchmark over them.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from refcoll.cli import main
from refcoll.core.errors import UsageError
from refcoll.model.nccl_fit import fit, fit_algorithm, fit_to_json, read_fit
from refcoll.model.nccl_run import busbw_factor, nccl_pick, predict, runs
from refcoll.model.nccl_tests import (
    band_errors,
    compare,
    parse_table,
    predicted_rows,
    read_table,
    sweep_sizes,
)
from refcoll.model.systems import SYSTEM_PRESETS, System, system_preset

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "data" / "nccl_tests"
GB = 1e9

H100_TWO = System(nodes=2, nics=8, nic_bw=50 * GB)


def perf_text(system: System, sizes, *, root: bool = True, ranks: bool = True) -> str:
    """Return an all_reduce_perf output of what ``system`` predicts (out and in place)."""
    lines = ["# nThread 1 nGpus 1 minBytes 8 maxBytes 1 step: 2(factor)", "#"]
    if ranks:
        lines += [f"#  Rank {r:2d} Group  0 Pid {100 + r} on host device  {r} [0x00] GPU"
                  for r in range(system.ranks)]
    lines.append("#       size         count      type   redop    root     time   algbw   busbw")
    for row in predicted_rows(system, sizes):
        t = row["time_us"]
        time_text = f"{t:.0f}" if t >= 10000 else f"{t:.2f}"
        cols = f"{time_text} {row['algbw']:.2f} {row['busbw']:.2f} 0"
        lines.append(f"{row['size']:>12} {row['count']:>12} float sum "
                     + ("-1 " if root else "") + f"{cols} {cols}")
    lines.append("# Avg bus bandwidth    : 1.0")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ reading all_reduce_perf

def test_a_table_with_the_root_column_and_rank_lines_is_read_whole():
    text = perf_text(H100_TWO, sweep_sizes(8, 1 << 30, 4))
    table = parse_table(text)
    assert table.ranks == 16
    assert [r.size for r in table.rows] == sweep_sizes(8, 1 << 30, 4)
    big = table.rows[-1]
    assert big.time == pytest.approx(big.size / big.algbw, rel=1e-2)
    assert big.busbw == pytest.approx(big.algbw * 30 / 16, rel=1e-2)
    assert big.in_place_time == big.time


@pytest.mark.parametrize("prefix", ["", "[1,0]<stdout>:", "0: ", "[0] "])  # MPICH's -l too
def test_old_formats_and_launcher_prefixes_are_read(prefix):
    rows = ["       8             2   float     sum    35.84    0.00    0.00  0e+00    35.26"
            "    0.00    0.00  0e+00",
            "1048576        262144   float     sum    112.5    9.32   17.48  N/A    110.9"
            "    9.46   17.73  N/A",
            "4294967296 1073741824 float sum 28815 149.05 279.47 0 28790 149.18 279.71 0"]
    table = parse_table("\n".join(prefix + r for r in rows))
    assert table.ranks is None
    assert [r.size for r in table.rows] == [8, 1048576, 4294967296]
    assert table.rows[1].in_place_time == pytest.approx(110.9e-6)
    assert table.rows[2].time == pytest.approx(28815e-6)  # nccl-tests prints no decimals


def test_the_measured_time_is_the_faster_of_the_two_columns():
    # nccl-tests times the same all-reduce out of place, then in place; a stall only adds
    # time, so the model is held to the faster (a published row: 68.52 us against 24.70)
    table = parse_table("8 2 float sum -1 68.52 0.00 0.00 0 24.70 0.00 0.00 0\n"
                        "16 4 float sum -1 24.96 0.00 0.00 0 24.99 0.00 0.00 0")
    assert [r.measured for r in table.rows] == pytest.approx([24.70e-6, 24.96e-6])
    row = compare(table, System(**system_preset("dgx-h100"))).rows[0]
    assert row["measured_us"] == pytest.approx(24.70) and row["out_of_place_us"] == \
        pytest.approx(68.52) and row["ratio"] == pytest.approx(row["predicted_us"] / 24.70)
    assert parse_table("8 2 float sum 35.84 0.00 0.00 0").rows[0].measured == \
        pytest.approx(35.84e-6)  # one column: that one


@pytest.mark.parametrize("text", ["", "no table here\n", "# size count\n", "8 2 float sum x y z"])
def test_a_log_without_rows_is_a_usage_error(text):
    with pytest.raises(UsageError, match="no all_reduce_perf row"):
        parse_table(text, "log.txt")


def test_every_stored_table_has_its_source_beside_it_and_reads():
    tables = sorted(DATA.glob("*.txt"))
    assert len(tables) >= 8
    for txt in tables:
        meta = json.loads(txt.with_suffix(".json").read_text())
        assert meta["source"].startswith("https://"), txt.name
        assert meta["commit_or_date"], txt.name
        system = meta["system"]
        assert system["gpus_per_node"] >= 1 and system["nodes"] >= 1, txt.name
        table = read_table(str(txt))
        sizes = [r.size for r in table.rows]
        assert sizes == sorted(sizes) and len(sizes) >= 5, txt.name
        for r in table.rows:  # what was copied agrees with itself: algbw is size / time
            if r.algbw >= 1 * GB:
                assert r.algbw == pytest.approx(r.size / r.time, rel=0.02), (txt.name, r.size)


def test_a_long_line_is_never_matched_and_older_formats_count_their_ranks(monkeypatch):
    """A blank line of 80 KB took the row pattern 52 s (quadratic): no line past 1 KiB, far
    more than a row's 150 characters, is handed to it."""
    import refcoll.model.nccl_tests as nccl_tests

    pattern = nccl_tests._ROW

    class Watched:
        def match(self, line):
            assert len(line) <= 1024, "a long line reached the row pattern"
            return pattern.match(line)
    monkeypatch.setattr(nccl_tests, "_ROW", Watched())
    row = "1048576 262144 float sum -1 30.00 34.95 34.95 0 30.00 34.95 34.95 0"
    table = parse_table(" " * 80_000 + "x\n" + "\t" * 80_000 + "\n" + row, "blank.txt")
    assert [r.size for r in table.rows] == [1048576]
    old = ("#   Rank  0 Pid  26 on worker-0 device  0 [0x10] NVIDIA A100-SXM4-40GB\n"
           "#   Rank  1 Pid  27 on worker-0 device  1 [0x10] NVIDIA A100-SXM4-40GB\n"
           "# Collective test starting: all_reduce_perf_mpi\n"
           "1048576 262144 float sum -1 30.00 34.95 34.95 0 30.00 34.95 34.95 0\n")
    table = parse_table(old, "old.txt")  # nccl-tests before 2.13, its MPI build's name
    assert table.ranks == 2 and [r.size for r in table.rows] == [1048576]


def test_a_log_whose_rows_say_another_rank_count_is_refused():
    sixteen = perf_text(H100_TWO, sweep_sizes(1 << 20, 1 << 30, 4), ranks=False)
    eight = perf_text(H100_TWO.with_shape(1), sweep_sizes(1 << 20, 1 << 30, 4), ranks=False)
    assert compare(parse_table(sixteen), H100_TWO).rows  # its rows' busbw/algbw: 16 ranks
    for text, said in ((eight, "8 ranks"), (sixteen + eight, "8 ranks")):
        with pytest.raises(UsageError, match=f"busbw/algbw 1.750, which is {said}"):
            compare(parse_table(text, "log"), H100_TWO)
        with pytest.raises(UsageError, match="1.750"):
            fit(H100_TWO, [parse_table(text, "log")])
    # sendrecv_perf before it printed its name: busbw is algbw, no all-reduce of 16 ranks
    sendrecv = "1048576 262144 float sum -1 30.00 34.95 34.95 0 30.00 34.95 34.95 0\n"
    with pytest.raises(UsageError, match="1.000, which is 2 ranks"):
        compare(parse_table(sendrecv, "sendrecv"), H100_TWO)


def test_a_size_of_0_bytes_is_neither_compared_nor_fitted():
    zero = "0 0 float sum -1 24.00 0.00 0.00 0 24.00 0.00 0.00 0\n"
    text = perf_text(H100_TWO, sweep_sizes(8, 1 << 28, 4))
    assert 0 not in [r["size"] for r in compare(parse_table(zero + text), H100_TWO).rows]
    assert fit(H100_TWO, [parse_table(zero + text)]) == fit(H100_TWO, [parse_table(text)])


# ------------------------------------------------------------------------- sweep sizes

def test_sweep_sizes_are_all_reduce_perfs():
    assert sweep_sizes(8, 8 << 30, 2) == [8 << k for k in range(31)]
    assert sweep_sizes(1024, 4096, 2, step=1024) == [1024, 2048, 3072, 4096]
    # whole elements, as all_reduce_perf rounds each size down (count = size / width)
    assert sweep_sizes(6, 48, 2, width=4) == [4, 12, 24, 48]
    assert sweep_sizes(3, 5, 2, step=1, width=2) == [2, 4]
    for bad in ((0, 8, 2), (16, 8, 2), (8, 64, 1), (8, 1 << 63, 2)):
        with pytest.raises(UsageError):
            sweep_sizes(*bad)
    with pytest.raises(UsageError, match="less than one element"):
        sweep_sizes(1, 8, 2, width=4)


def test_rows_that_cannot_be_used_are_left_out_and_said():
    good = "1024 256 float sum -1 20.00 0.05 0.09 0 19.00 0.05 0.09 0"
    table = parse_table("\n".join([
        good,
        "2048 512 float sum -1 nan 0.05 0.09 0 19.00 0.05 0.09 0",  # not a number
        "4096 1024 float sum -1 0.00 0.05 0.09 0 19.00 0.05 0.09 0",  # no time
        "8192 2000 float sum -1 20.00 0.05 0.09 0 19.00 0.05 0.09 0",  # count is not size
        "16384 4096 float sum -1 30.00 0.5 0.9 0 0.00 0.5 0.9 0",  # in-place time of 0
        "32768 8192 float sum -1 40.00 0.8 1.6 3 40.00 0.8 1.6 0",  # #wrong
        "65536 16384 float sum -1 50.0",  # a cut line
    ]), "log")
    assert [r.size for r in table.rows] == [1024, 16384, 32768]
    assert table.rows[1].in_place_time is None
    assert table.rows[1].measured == pytest.approx(30e-6)
    notes = "\n".join(table.notes)
    for line in (2, 3, 4, 7):
        assert f"line {line} left out" in notes, notes
    assert "line 5 (size 16384): its in-place" in notes and "#wrong 3" in notes
    with pytest.raises(UsageError, match="time 1e-310 us"):
        parse_table("1024 256 float sum -1 1e-310 0 0 0 1e-310 0 0 0", "sub")


def test_a_wrong_count_of_a_million_printed_as_g_is_said():
    table = parse_table("1048576 262144 float sum -1 30.00 34.95 34.95 1.23457e+06 30.00 34.95 "
                        "34.95 0e+00", "log")
    assert "#wrong 1.23457e+06" in " ".join(table.notes)
    assert not parse_table("1048576 262144 float sum -1 30.00 34.95 34.95 0e+00 30.00 34.95 "
                           "34.95 N/A", "log").notes


def test_the_time_column_is_held_to_size_over_algbw():
    # nccl-tests of 2017-2019 printed milliseconds (read as microseconds: 1000x too fast);
    # -C 1 prints the host's CPU time there; -I 1 adds four columns to each half; the
    # column #wrong once held the largest deviation (5e-07), not a count.
    row = "1048576 262144 float sum -1 {} 34.95 65.53 {} {} 34.95 65.53 0"
    ms = parse_table(row.format("0.030", 0, "0.029"), "old")
    assert ms.rows[0].time == pytest.approx(30e-6) and ms.rows[0].in_place_time == \
        pytest.approx(29e-6)
    assert any("milliseconds" in note for note in ms.notes)
    with pytest.raises(UsageError, match="not the time of the all-reduce"):
        parse_table(row.format("5.05", 0, "5.00"), "cputime")
    deviation = parse_table(row.format("30.00", "5e-07", "30.00"), "error column")
    assert not deviation.notes
    per_iteration = parse_table("1048576 262144 float sum -1 30.00 34.95 65.53 0 28.1 31.9 "
                                "31.5 2.10 25.90 40.49 75.91 0 25.1 26.5 26.4 1.20", "-I 1")
    assert per_iteration.rows[0].in_place_time == pytest.approx(25.9e-6)
    assert not per_iteration.notes  # (i_cv% 2.10 is no #wrong)
    # refcoll bench's rows carry their algorithm and MPI's times after the two halves
    bench = parse_table("1048576 262144 float sum -1 390.30 2.69 2.69 0 275.86 3.80 3.80 3 "
                        "auto(ring) 303.78 3.45 247.40 4.24 1.28 295.16 1.32", "bench --bound")
    assert bench.rows[0].in_place_time == pytest.approx(275.86e-6)
    assert [note for note in bench.notes if "#wrong 3" in note] and len(bench.notes) == 1
    huge = parse_table("4" + "0" * 400 + " 1" + "0" * 400 + " float sum -1 30.0 0 0 0\n"
                       + row.format("30.00", 0, "30.00"), "huge")
    assert [r.size for r in huge.rows] == [1048576] and "more bytes" in huge.notes[0]


@pytest.mark.parametrize("text, needle", [
    ("# Collective test starting: all_gather_perf\n1048576 32768 float none -1 30.10 34.84 "
     "30.48 0 29.50 35.54 31.10 0", "all_gather_perf"),
    ("1048576 32768 float none -1 30.10 34.84 30.48 0 29.50 35.54 31.10 0", "redop none"),
    ("1048576 262144 float sum 0 30.10 34.84 30.48 0 29.50 35.54 31.10 0", "root 0"),
])
def test_another_collectives_log_is_refused(text, needle):
    with pytest.raises(UsageError, match=needle):
        parse_table(text, "log")


# -------------------------------------------------------------------- what NCCL runs

def test_the_two_node_tree_sends_half_the_network_bytes_of_a_larger_trees():
    # 4 NICs of 25 GB/s a node: the tree is bound by the NICs. On 2 nodes each node sends
    # the buffer once; inner nodes of larger trees send it twice.
    fast = replace(H100_TWO, nics=4, nic_bw=25 * GB, nvls=False)
    two = predict(fast, 1 << 30, "Tree/Simple")
    four = predict(fast.with_shape(4), 1 << 30, "Tree/Simple")
    assert two.limit == four.limit == "network"
    assert two.algbw == pytest.approx(fast.nic_rate())
    assert four.algbw == pytest.approx(fast.nic_rate() / 2)
    ring = predict(fast, 1 << 30, "Ring/Simple")
    assert ring.algbw == pytest.approx(fast.nic_rate() / busbw_factor(16))


def test_nvls_runs_where_the_hardware_has_it_and_nowhere_else():
    names = lambda s: {r.algorithm for r in runs(s, 1 << 28)}  # noqa: E731
    one = System()  # one 8 × H100 NVSwitch node
    assert "NVLS" in names(one) and "NVLSTree" not in names(one)
    assert "NVLSTree" in names(H100_TWO) and "NVLS" not in names(H100_TWO)
    assert not {"NVLS", "NVLSTree"} & names(replace(one, generation="ampere"))
    assert not {"NVLS", "NVLSTree"} & names(replace(one, nvls=False))
    assert "CollNet" in names(replace(H100_TWO, collnet=True))
    assert "CollNet" not in names(H100_TWO)
    # NVLS: each GPU sends and receives (p+1)/p of the buffer at nvlsEfficiency.
    nvls = predict(one, 1 << 30, "NVLS")
    c = one.channel_count()
    assert nvls.algbw == pytest.approx(one.intra_rate() * 0.85 * (c - 1) / c * 8 / 9)


def test_ll128_only_over_nvlink_and_the_host_path_at_half_the_pcie_rate():
    pcie = System(gpus_per_node=4, generation="ampere", intra="pcie", pcie_gen=4)
    assert all(r.protocol != "LL128" for r in runs(pcie, 1 << 20))
    assert any(r.protocol == "LL128" for r in runs(System(), 1 << 20))
    host = replace(pcie, p2p=False)
    assert host.intra_rate() == pytest.approx(pcie.intra_rate() / 2)
    assert pcie.intra_rate() == pytest.approx(31.5e9 * 12 / 15.75)
    assert host.unknowns() and not pcie.unknowns()


def test_nccls_pick_is_the_least_time_and_protocols_trade_latency_for_bandwidth():
    for size in (8, 1 << 16, 1 << 24, 1 << 32):
        choices = runs(H100_TWO, size)
        assert nccl_pick(H100_TWO, size).seconds == min(r.seconds for r in choices)
    ll, simple = (predict(System(), 1 << 30, f"Ring/{p}") for p in ("LL", "Simple"))
    assert ll.latency < simple.latency and ll.algbw < simple.algbw
    assert predict(System(), 8).protocol == "LL"  # latency wins at 8 B
    assert predict(System(), 1 << 32).protocol == "Simple"  # bandwidth at 4 GiB


def test_predicted_rows_are_nccl_tests_arithmetic():
    rows = predicted_rows(H100_TWO, sweep_sizes(8, 1 << 30, 8))
    for r in rows:
        assert r["algbw"] == pytest.approx(r["size"] / (r["time_us"] * 1e-6) / GB)
        assert r["busbw"] == pytest.approx(r["algbw"] * 30 / 16)
        assert {"size", "count", "time_us", "algbw", "busbw", "algorithm", "protocol"} <= set(r)
    refcoll_rows = predicted_rows(H100_TWO, [1 << 20], "hierarchical")
    assert refcoll_rows[0]["algorithm"] == "hierarchical" and refcoll_rows[0]["protocol"] == "-"


def test_band_errors_are_geometric_mean_misses():
    errors = band_errors([(8, 2.0, 1.0), (16, 0.5, 1.0), (1 << 20, 1.1, 1.0),
                          (1 << 30, 1.0, 1.0)])
    assert errors["<= 64 KiB"] == (pytest.approx(1.0), 2)  # ×2 and ÷2 both miss by 2
    assert errors["64 KiB - 64 MiB"][0] == pytest.approx(0.1)
    assert errors[">= 64 MiB"] == (0.0, 1)
    assert errors["all"][1] == 4


def test_every_preset_is_a_system():
    for name in SYSTEM_PRESETS:
        system = System(**system_preset(name), nodes=2) if system_preset(name).get("nics") \
            else System(**system_preset(name))
        assert nccl_pick(system, 1 << 20) is not None, name
    with pytest.raises(UsageError):
        system_preset("nope")


# ------------------------------------------------------------------------------- fitting

def test_a_fit_recovers_network_constants_it_never_saw():
    truth = replace(H100_TWO, transport="efa", fitted={"nic_efficiency": 0.6,
                                                      "net_latency": 30e-6})
    table = parse_table(perf_text(truth, sweep_sizes(8, 8 << 30, 2)))
    learnt = fit(replace(truth, fitted={}), [table])
    assert learnt["nic_efficiency"] == pytest.approx(0.6, rel=0.05)
    assert learnt["net_latency"] == pytest.approx(30e-6, rel=0.05)
    assert "intra_rate" not in learnt  # a multi-node table says nothing of NVLink alone


def test_a_fit_on_one_node_count_predicts_another():
    truth = replace(H100_TWO, transport="tcpxo", nic_bw=25 * GB,
                    fitted={"nic_efficiency": 0.8, "net_latency": 40e-6})
    two = parse_table(perf_text(truth, sweep_sizes(8, 8 << 30, 2)))
    four = parse_table(perf_text(truth.with_shape(4), sweep_sizes(8, 8 << 30, 2)))
    described = replace(truth, fitted={})
    learnt = replace(described.with_shape(4), fitted=fit(described, [two]))
    result = compare(four, learnt)
    assert all(e < 0.05 for name, (e, n) in result.errors.items() if n)
    assert compare(four, described.with_shape(4)).errors["<= 64 KiB"][0] > 0.5


def test_a_fit_file_round_trips_and_hostile_ones_are_refused(tmp_path):
    system = System(gpus_per_node=4, generation="ampere", intra="pcie", p2p=False)
    table = parse_table(perf_text(replace(system, fitted={"intra_rate": 5e9,
                                                          "intra_latency": 4e-6}),
                                  sweep_sizes(8, 1 << 28, 2)))
    learnt = fit(system, [table])
    assert learnt["intra_rate"] == pytest.approx(5e9, rel=0.05)
    path = tmp_path / "fit.json"
    path.write_text(json.dumps(fit_to_json(system, learnt, [table])))
    again = read_fit(str(path))
    assert again.fitted == learnt and again.intra == "pcie" and not again.p2p
    bad = [{"refcoll_fit": 2}, {"refcoll_fit": 1, "system": {}, "fitted": {"speed": 1.0}},
           {"refcoll_fit": 1, "system": {}, "fitted": {"intra_rate": -1.0}},
           {"refcoll_fit": 1, "system": {"warp": 9}, "fitted": {}},
           {"refcoll_fit": 1, "system": {"generation": "kepler"}, "fitted": {}}]
    for data in bad:
        path.write_text(json.dumps(data))
        with pytest.raises(UsageError):
            read_fit(str(path))
    path.write_text("{not json")
    with pytest.raises(UsageError):
        read_fit(str(path))
    saved = fit_to_json(system, learnt, [table])
    for spine in (-1, "x", True, 1e-300, 1e30):  # (once a KeyError in the message, or inf)
        path.write_text(json.dumps({**saved, "system": {**saved["system"], "spine_bw": spine}}))
        with pytest.raises(UsageError, match="spine_bw"):
            read_fit(str(path))
    for algorithm in ("Bogus", "Ring/LL64", 7, "x" * 100_000):  # (once echoed as an option)
        path.write_text(json.dumps({**saved, "algorithm": algorithm}))
        with pytest.raises(UsageError, match="not one of NCCL's") as raised:
            fit_algorithm(str(path))
        assert len(str(raised.value)) < 300
    path.write_text(json.dumps({**saved, "algorithm": "Ring/Simple"}))
    assert fit_algorithm(str(path)) == "Ring/Simple"


def test_a_fit_learns_no_constant_its_tables_cannot_show_and_no_rate_above_the_line():
    system = System()  # one H100 node
    small = parse_table(perf_text(replace(system, fitted={"intra_latency": 3e-6}),
                                  sweep_sizes(8, 4096, 2)))
    learnt = fit(system, [small])
    assert learnt["intra_rate"] == system.intra_rate()  # bandwidth never counts at 4 KiB
    assert learnt["intra_latency"] == pytest.approx(3e-6, rel=0.05)
    assert fit_to_json(system, learnt, [small])["unlearnt"] == ["intra_rate"]
    fast = parse_table(perf_text(replace(system, fitted={"intra_rate": 2e12}),
                                 sweep_sizes(1 << 20, 1 << 30, 2)))
    assert fit(system, [fast])["intra_rate"] <= system.intra_line()


def test_one_size_learns_neither_of_a_pair_and_every_fit_file_is_one_from_fit_reads(
        tmp_path):
    truth = replace(H100_TWO, fitted={"nic_efficiency": 0.6, "net_latency": 30e-6})
    one = parse_table(perf_text(truth, [1 << 20]))  # one time: any split of rate and latency
    learnt = fit(replace(truth, fitted={}), [one])
    assert learnt["nic_efficiency"] == H100_TWO.net.efficiency
    assert learnt["net_latency"] == H100_TWO.net.latency
    assert set(fit_to_json(H100_TWO, learnt, [one])["unlearnt"]) == {"nic_efficiency",
                                                                      "net_latency"}
    # A description outside what a fit file holds is refused, not fitted into a file that
    # --from-fit then refuses (a rate searched past its bounds, or kept as described).
    table = parse_table(perf_text(System(), sweep_sizes(8, 1 << 28, 2)))
    for intra_bw in (10e6, 10e12):
        with pytest.raises(UsageError, match="intra rate .* outside what a fit learns"):
            fit(System(intra_bw=intra_bw), [table])
    path = tmp_path / "fit.json"
    for system in (System(intra_bw=1.5e8), System()):
        learnt = fit(system, [table])
        path.write_text(json.dumps(fit_to_json(system, learnt, [table])))
        assert read_fit(str(path)).fitted == learnt


def test_a_fit_never_ends_worse_than_the_description_it_starts_from():
    """A table the model's form cannot follow (15 us plus a line rate): the loss jumps as
    NCCL's pick moves from Ring/LL to NVLS, where a golden-section search alone lands
    on a worse point than the description's own."""
    from refcoll.model import nccl_fit

    rows = [f"{s} {s // 4} float sum -1 {15 + s * 1.75 / 200e3:.2f} 0 0 0"
            for s in sweep_sizes(8, 1 << 27, 2)]
    table = parse_table("\n".join(rows))
    system = System()  # one H100 node
    shaped = nccl_fit._shaped(system, [table])
    learnt = fit(system, [table])
    described = {"intra_rate": system.intra_rate(), "intra_latency": 0.0}
    assert nccl_fit._loss(shaped, learnt, None) <= nccl_fit._loss(shaped, described, None)
    assert learnt.described and learnt == described  # (the search alone ended worse)
    saved = fit_to_json(system, learnt, [table])
    assert saved["described"] and saved["on_bounds"] == []  # (0 latency: described, not hit)


def test_a_constant_that_ends_on_its_bound_is_named():
    from refcoll.model.nccl_fit import on_bounds

    node = System()
    line = node.intra_line()
    assert on_bounds(node, {"intra_rate": line, "intra_latency": 2e-6}) == ["intra_rate"]
    assert on_bounds(node, {"intra_rate": line / 2, "intra_latency": 0.0}) == ["intra_latency"]
    assert on_bounds(node, {"intra_rate": line / 2, "intra_latency": 2e-12}) == \
        ["intra_latency"]  # (golden section's end: within 1e-8 of its range of 0)
    assert on_bounds(node, {"intra_rate": line, "intra_latency": 0.0}, ["intra_rate"]) == \
        ["intra_latency"]  # (not learnt: its described value, no bound reached)
    assert on_bounds(H100_TWO, {"nic_efficiency": 0.7, "net_latency": 5e-6}) == []


def test_a_fit_that_prices_no_row_and_a_log_too_long_to_fit_are_refused():
    table = parse_table(perf_text(H100_TWO, sweep_sizes(8, 1 << 20, 2)))
    with pytest.raises(UsageError, match="no size can be priced as NVLS"):
        fit(H100_TWO, [table], "NVLS")
    rows = "\n".join(f"{4 * k} {k} float sum -1 {20 + k * 1e-3:.3f} 0 0 0"
                     for k in range(1, 600))
    with pytest.raises(UsageError, match="599 sizes to fit"):
        fit(H100_TWO, [parse_table(rows)])


def test_a_fit_file_holds_the_latencies_and_keeps_an_earlier_fits_constants(tmp_path):
    node = System()
    one = parse_table(perf_text(replace(node, fitted={"intra_rate": 3e11}),
                                sweep_sizes(8, 1 << 30, 4)))
    path = tmp_path / "node.json"
    path.write_text(json.dumps(fit_to_json(node, fit(node, [one]), [one])))
    base = replace(read_fit(str(path)), nodes=2, nics=4, nic_bw=12.5 * GB, transport="efa",
                   inter_alpha=2e-6)
    two = parse_table(perf_text(replace(base, fitted={**base.fitted, "nic_efficiency": 0.6}),
                                sweep_sizes(8, 8 << 30, 2)))
    both = fit(base, [two])  # the network learnt on top of the node's own
    assert both["intra_rate"] == base.fitted["intra_rate"]
    assert both["nic_efficiency"] == pytest.approx(0.6, rel=0.05)
    path.write_text(json.dumps(fit_to_json(base, both, [two])))
    assert read_fit(str(path)).inter_alpha == 2e-6  # priced as it was fitted


@pytest.mark.parametrize("field, value", [
    ("intra_bw", 1e-300), ("nic_bw", 1e300), ("inter_alpha", 1e308), ("generation", None)])
def test_a_fit_file_outside_the_options_bounds_or_lacking_a_field_is_refused(tmp_path, field,
                                                                              value):
    table = parse_table(perf_text(H100_TWO, sweep_sizes(8, 1 << 30, 4)))
    saved = fit_to_json(H100_TWO, fit(H100_TWO, [table]), [table])
    if value is None:
        del saved["system"][field]
    else:
        saved["system"][field] = value
    path = tmp_path / "fit.json"
    path.write_text(json.dumps(saved))
    with pytest.raises(UsageError, match="lacks generation" if value is None else
                       f"system field {field} = .* is outside"):
        read_fit(str(path))


@pytest.mark.parametrize("field, value", [
    ("channels", 0), ("channels", -4), ("channels", 10 ** 9), ("nodes", 1.5),
    ("nodes", True), ("intra_bw", -1e9), ("p2p", "no"), ("nvls", "false"),
    ("gpus_per_node", 10 ** 18), ("nics", 10 ** 6), ("nic_bw", -5.0), ("generation", [1]),
])
def test_a_crafted_fit_files_system_is_refused_naming_the_field(tmp_path, field, value):
    table = parse_table(perf_text(H100_TWO, sweep_sizes(8, 1 << 30, 4)))
    saved = fit_to_json(H100_TWO, fit(H100_TWO, [table]), [table])
    saved["system"][field] = value
    path = tmp_path / "fit.json"
    path.write_text(json.dumps(saved))
    with pytest.raises(UsageError, match=f"system field {field} "):
        read_fit(str(path))


# ------------------------------------------------------------------------------- the CLI

def run(args, **kw):
    return CliRunner().invoke(main, ["model", *args], catch_exceptions=False, **kw)


def test_the_sweep_prints_nccl_tests_rows_and_writes_them(tmp_path):
    out = tmp_path / "rows.json"
    res = run(["--preset", "dgx-h100", "--nodes", "2", "--sweep", "-b", "8", "-e", "1G",
               "-f", "32", "--algorithm", "Ring,hierarchical", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "# what NCCL runs" in res.output and "# Ring " in res.output
    assert "refcoll hierarchical" in res.output
    first = res.output.split("# Ring ")[0]  # what NCCL runs: nccl-tests' lines, read back
    table = parse_table(first)
    assert [r.size for r in table.rows] == sweep_sizes(8, 1 << 30, 32)
    rows = json.loads(out.read_text())["rows"]
    assert {r["asked"] for r in rows} == {"pick", "Ring", "hierarchical"}
    assert len(rows) == 3 * len(sweep_sizes(8, 1 << 30, 32))
    assert all(math.isfinite(r["busbw"]) and r["time_us"] > 0 for r in rows)


def test_the_json_says_what_the_text_says_is_not_expressed(tmp_path):
    out = tmp_path / "p4d.json"
    res = run(["--preset", "p4d", "--nodes", "2", "-b", "1G", "-e", "1G", "--json", str(out)])
    notes = [line.removeprefix("not expressed: ") for line in res.output.splitlines()
             if line.startswith("not expressed: ")]
    assert res.exit_code == 0 and any(n.startswith("efa:") for n in notes), res.output
    assert json.loads(out.read_text())["not_expressed"] == notes


def test_compare_and_fit_on_a_stored_table(tmp_path):
    log = DATA / "ib-ndr-2x8-h100-dell-xe9680-qoofyk.txt"
    plot, saved = tmp_path / "c.png", tmp_path / "fit.json"
    res = run(["--preset", "dgx-h100", "--nodes", "2", "--compare", str(log), "--plot",
               str(plot)])
    assert res.exit_code == 0, res.output
    assert "per band" in res.output and "within 30%" in res.output
    assert plot.read_bytes()[:4] == b"\x89PNG"
    res = run(["--preset", "dgx-h100", "--nodes", "2", "--fit", str(log), "--save-fit",
               str(saved)])
    assert res.exit_code == 0, res.output
    res = run(["--from-fit", str(saved), "--nodes", "4", "--sweep", "-e", "1M"])
    assert res.exit_code == 0 and "4 nodes × 8 GPUs" in res.output


def test_a_system_preset_alone_sweeps_and_with_a_model_gives_the_step_report():
    res = run(["--preset", "p4d", "--nodes", "2", "-e", "1K"])
    assert res.exit_code == 0 and "# what NCCL runs" in res.output, res.output
    assert "not expressed: efa" in res.output  # what no public source gives is said
    res = run(["--preset", "dgx-h100", "--nodes", "4", "--params", "1e9", "--no-search"])
    assert res.exit_code == 0, res.output
    assert "4 nodes × 8 GPUs" in res.output and "intra 450 GB/s" in res.output
    assert "inter 50 GB/s" in res.output and "8 NICs per node" in res.output
    res = run(["--preset", "dgx-h100", "--params", "1e9", "--no-search"])  # one node, as swept
    assert res.exit_code == 0 and "1 node × 8 GPUs" in res.output, res.output


@pytest.mark.parametrize("args, needle", [
    (["--fit", str(DATA / "ib-ndr-2x8-h100-dell-xe9680-qoofyk.txt")], "--save-fit"),
    (["--sweep", "--algorithm", "Warp"], "unknown --algorithm"),
    (["--sweep", "--inter-transport", "carrier-pigeon", "--nodes", "2", "--inter-bw",
      "100Gb/s", "--unidirectional"], "transport"),
    (["--sweep", "--nodes", "2"], "NICs"),
    (["--preset", "dgx-h100", "--compare", str(DATA / "ib-ndr-2x8-h100-dell-xe9680-qoofyk.txt")],
     "16"),
    (["--compare", str(DATA / "ib-ndr-2x8-h100-dell-xe9680-qoofyk.txt")], "describe it"),
    (["--preset", "dgx-h100", "--nodes", "2", "--compare", str(DATA / "ib-ndr-2x8-h100-"
      "gjaion-default.txt"), "-b", "1M"], "-b make the --sweep's sizes"),
    (["--preset", "dgx-h100", "-b", "1G", "-e", "1G", "--pcie-gen", "3"], "--pcie-gen"),
    (["--preset", "dgx-h100", "-b", "1G", "-e", "1G", "--inter-transport", "tcp"],
     "is one node: give --nodes"),
    (["--preset", "seed", "--sweep"], "not a system"),
    (["--params", "1e9", "--inter-transport", "efa"], "--inter-transport"),
    (["--sweep", "-b", "1.5K"], "-b"),
    (["--preset", "dgx-h100", "--nodes", "2", "--sweep", "--algorithm", "NVLS"], "cannot run"),
    (["--preset", "dgx-h100", "--nodes", "2", "--algorithm", "CollNet"], "--in-network"),
    (["--preset", "dgx-h100", "--gpus-per-node", "1"], "at least 2 GPUs"),
    (["--preset", "dgx-h100", "--channels", "100000"], "--channels"),
    (["--preset", "dgx-h100", "--nodes", "1e9"], "--nodes"),
    (["--preset", "dgx-h100", "--spine-bw", "1GB/s", "--no-rail"], "--rail, --spine-bw"),
    (["--preset", "dgx-h100", "--sweep", "--params", "1e9"], "step report"),
    (["--preset", "dgx-h100", "-e", "99999999999999999999999T"], "2**63"),
    # --fit learns what NCCL ran, by NCCL's name; a log ran one algorithm
    (["--preset", "dgx-h100", "--nodes", "2", "--fit", str(DATA / "ib-ndr-2x8-h100-gjaion-"
      "default.txt"), "--save-fit", "x.json", "--algorithm", "ring"], "refcoll's own schedule"),
    (["--preset", "dgx-h100", "--nodes", "2", "--compare", str(DATA / "ib-ndr-2x8-h100-"
      "gjaion-default.txt"), "--algorithm", "Ring,Tree"], "one algorithm"),
])
def test_bad_sweep_arguments_are_one_line_and_exit_2(args, needle):
    res = run(args)
    assert res.exit_code == 2, res.output
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and needle in lines[0], res.stderr


def test_a_fit_of_one_node_prices_nodes_joined_by_a_network_given_then(tmp_path):
    saved = tmp_path / "node.json"
    assert run(["--preset", "pcie-no-p2p", "--gpus-per-node", "8", "--fit",
                str(DATA / "rtx4090-8gpu-pcie-nop2p-blog-chlc.txt"), "--save-fit",
                str(saved)]).exit_code == 0
    res = run(["--from-fit", str(saved), "--nodes", "2", "--inter-bw", "100Gb/s",
               "--nics-per-node", "1", "--inter-quoted", "unidirectional", "--sweep",
               "-b", "1MB", "-e", "4M"])
    assert res.exit_code == 0, res.output
    assert "2 nodes × 8" in res.output and "     4000000 " in res.output
    # -b 1MB is 10^6 B here, 2^20 to nccl-tests: said, once
    assert res.stderr.count("nccl-tests reads 1MB as 1,048,576 B") == 1
    # A preset with NICs fitted on one node's table learnt nothing of them either.
    saved = tmp_path / "h100.json"
    assert run(["--preset", "dgx-h100", "--fit", str(DATA / "h100-sxm-8gpu-nccl-tests-issue-"
                "290.txt"), "--save-fit", str(saved)]).exit_code == 0
    joined = ["--from-fit", str(saved), "--nodes", "2", "--inter-bw", "400Gb/s", "--sweep",
              "-b", "1G", "-e", "1G"]
    res = run([*joined, "--inter-quoted", "unidirectional"])
    assert res.exit_code == 0 and "2 nodes × 8" in res.output, res.output
    res = run(joined)
    assert res.exit_code == 2 and "--inter-quoted unidirectional" in res.stderr, res.stderr


def test_a_refusal_comes_before_any_line_printed_or_file_written(tmp_path):
    # A log of another rank count without '# Rank' lines, and a fit file naming no
    # algorithm of NCCL's, were refused only after the fit was saved and printed (and the
    # whole sweep): a usage error then left a file and half a report behind.
    other = tmp_path / "four.txt"
    other.write_text(perf_text(H100_TWO.with_shape(4), sweep_sizes(1 << 20, 1 << 30, 4),
                               ranks=False))
    fit_log = tmp_path / "two.txt"
    fit_log.write_text(perf_text(H100_TWO, sweep_sizes(8, 1 << 30, 4)))
    saved, report = tmp_path / "fit.json", tmp_path / "out.json"
    for args in (["--fit", str(fit_log), "--save-fit", str(saved), "--compare", str(other),
                  "--json", str(report)],
                 ["--sweep", "--compare", str(other)]):
        res = run(["--preset", "dgx-h100", "--nodes", "2", *args])
        assert res.exit_code == 2 and "32 ranks" in res.stderr, res.stderr
        assert res.stdout == "" and not saved.exists() and not report.exists(), res.stdout
    assert run(["--preset", "dgx-h100", "--nodes", "2", "--fit", str(fit_log), "--save-fit",
                str(saved)]).exit_code == 0
    saved.write_text(json.dumps({**json.loads(saved.read_text()), "algorithm": 5}))
    res = run(["--from-fit", str(saved), "--sweep", "-e", "1K"])
    assert res.exit_code == 2 and "not one of NCCL's" in res.stderr and res.stdout == ""


def test_no_output_overwrites_an_input_and_from_fit_keeps_its_hardware(tmp_path):
    log = tmp_path / "log.txt"
    log.write_text((DATA / "ib-ndr-2x8-h100-gjaion-default.txt").read_text())
    (tmp_path / "link.txt").symlink_to(log)
    for args in (["--fit", str(log), "--save-fit", str(log)],
                 ["--compare", str(log), "--json", str(tmp_path / "link.txt")],
                 ["--fit", str(log), "--save-fit", "x.json", "--json", "x.json"]):
        res = run(["--preset", "dgx-h100", "--nodes", "2", *args])
        assert res.exit_code == 2 and "is the file of" in res.stderr, res.output
    assert log.read_text().startswith("# nThread")  # untouched
    saved = tmp_path / "fit.json"
    assert run(["--preset", "dgx-h100", "--nodes", "2", "--fit", str(log), "--save-fit",
                str(saved)]).exit_code == 0
    for other in (["--preset", "p4d"], ["--inter-transport", "efa"], ["--gpu-arch", "ampere"]):
        res = run(["--from-fit", str(saved), "-e", "1K", *other])
        assert res.exit_code == 2 and "fitted on" in res.stderr, res.output


def test_the_latencies_given_bound_every_step_of_the_sweep():
    quick = run(["--preset", "dgx-h100", "-b", "1M", "-e", "1M"])
    slow = run(["--preset", "dgx-h100", "-b", "1M", "-e", "1M", "--intra-latency", "1ms"])
    assert quick.exit_code == 0 and slow.exit_code == 0, slow.output
    time = [float(r.output.strip().splitlines()[-1].split()[5]) for r in (quick, slow)]
    assert time[0] < 100 and time[1] >= 2000  # NVLS: two steps through the switch


def test_the_json_has_no_number_json_cannot_hold(tmp_path):
    out = tmp_path / "c.json"
    log = tmp_path / "log.txt"
    log.write_text("1024 256 float sum -1 20.0 0.05 0.09 0 19.0 0.05 0.09 0\n")
    res = run(["--preset", "dgx-h100", "--compare", str(log), "--json", str(out)])
    assert res.exit_code == 0, res.output
    text = out.read_text()
    assert "NaN" not in text and "Infinity" not in text  # empty bands are null
    assert json.loads(text)["compare"]["errors"]["64 KiB - 64 MiB"]["error"] is None


# --------------------------------------------------------------------------- the benchmark

@pytest.mark.slow  # the measurements page runs the benchmark in the default run already
def test_the_benchmark_judges_every_stored_table():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "model_vs_nccl_tests.py")],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    pooled = [line for line in res.stdout.splitlines() if line.startswith("pooled")]
    assert [line.split()[3] for line in pooled] == ["described", "fitted", "other"]
    judged = {line.split()[0] for line in res.stdout.splitlines()
              if " described " in line and not line.startswith("pooled")}
    assert judged == {p.stem for p in DATA.glob("*.txt")}


def test_one_node_needs_no_network_and_lists_no_nic():
    res = run(["--nodes", "1", "--gpus-per-node", "8", "--intra-bw", "900GB/s",
               "--intra-quoted", "bidirectional", "--params", "1e9", "--no-search"])
    assert res.exit_code == 0, res.output
    assert "intra 450 GB/s" in res.output and "no inter-node link (one node)" in res.output
    assert "network: one node, no NIC crossed" in res.output
    assert "NICs per node" not in res.output


# ------------------------------------------------------------ what --compare and --fit say

def test_compare_gives_the_measured_busbw_of_the_measured_time_and_each_size_once(tmp_path):
    # The faster column is the in-place one at some sizes: its busbw was the out-of-place
    # column's scaled by the time ratio (0.04 beside 0.02 predicted, at 256 B). A log
    # holding a run twice counted each size twice.
    log = DATA / "ib-ndr-2x8-h100-dell-xe9680-qoofyk.txt"
    system = System(**system_preset("dgx-h100"), nodes=2)
    once = compare(read_table(log), system)
    faster_in_place = [r for r in once.rows if r["in_place_us"] is not None
                       and r["in_place_us"] < r["out_of_place_us"]]
    assert faster_in_place  # the case the old formula got wrong
    for r in once.rows:
        assert r["measured_busbw"] == pytest.approx(
            r["size"] / (r["measured_us"] * 1e-6) * busbw_factor(16) / 1e9)
    twice = tmp_path / "twice.txt"
    twice.write_text(log.read_text() + log.read_text())
    again = compare(read_table(twice), system)
    assert again.rows == once.rows and again.within == once.within
    assert again.errors == once.errors


def test_a_log_that_does_not_say_its_ranks_is_noted_alone_and_refused_among_several(tmp_path):
    four = DATA / "ib-ndr-4x8-h100-gjaion-default.txt"
    res = CliRunner().invoke(main, ["model", "--preset", "dgx-h100", "--nodes", "4",
                                    "--compare", str(four)])
    assert res.exit_code == 0, res.output
    assert "no '# Rank' lines say how many ranks ran: taken as the 32 described" in res.output
    two = DATA / "ib-ndr-2x8-h100-gjaion-default.txt"
    res = CliRunner().invoke(main, ["model", "--preset", "dgx-h100", "--fit", str(two),
                                    "--fit", str(four), "--save-fit", str(tmp_path / "f.json")])
    assert res.exit_code == 2 and "each table must say its own" in res.output, res.output
    assert not (tmp_path / "f.json").exists()


def test_from_fit_says_which_algorithm_its_tables_ran(tmp_path):
    log = DATA / "ib-ndr-2x8-h100-gjaion-ring-minctas24-qps2.txt"
    fitted = tmp_path / "f.json"
    res = run(["--preset", "dgx-h100", "--nodes", "2", "--algorithm", "Ring", "--fit", str(log),
               "--save-fit", str(fitted)])
    assert res.exit_code == 0, res.output
    res = run(["--from-fit", str(fitted), "--compare", str(log)])
    assert res.exit_code == 0 and "was fitted on tables that ran Ring" in res.output
    res = run(["--from-fit", str(fitted), "--algorithm", "Ring", "--compare", str(log)])
    assert res.exit_code == 0 and "fitted on tables" not in res.output


@pytest.mark.parametrize("args, needle", [
    (["--fit", "LOG", "--save-fit", "f.json", "--plot", "p.png"], "--plot draws the --sweep"),
    (["--sweep", "--json", "-"], "not to standard output"),
])
def test_outputs_that_cannot_be_what_was_asked_are_refused(tmp_path, args, needle):
    log = str(DATA / "ib-ndr-2x8-h100-gjaion-default.txt")
    args = [log if a == "LOG" else str(tmp_path / a) if a.endswith((".json", ".png")) else a
            for a in args]
    res = CliRunner().invoke(main, ["model", "--preset", "dgx-h100", "--nodes", "2", *args])
    assert res.exit_code == 2 and needle in res.output, res.output
    assert list(tmp_path.iterdir()) == [] and not os.path.exists("-")


@pytest.mark.parametrize("args, needle", [
    (["--intra-transport", "pcie", "--nvls"], "NVLink SHARP needs NVSwitch nodes"),
    (["--gpu-arch", "ampere", "--nvls"], "NVLink SHARP needs NVSwitch nodes"),
    (["--no-p2p"], "--no-p2p says how PCIe GPUs reach each other"),
    (["--nodes", "1", "--in-network"], "one node has no network to cross"),
])
def test_an_option_the_system_cannot_have_is_refused_not_dropped(args, needle):
    res = CliRunner().invoke(main, ["model", "--preset", "dgx-h100", *args, "--sweep", "-b",
                                    "8", "-e", "8"])
    assert res.exit_code == 2 and needle in res.output, res.output


def test_the_options_a_system_can_have_still_run():
    for args in (["--intra-transport", "pcie", "--no-p2p", "--no-nvls"],
                 ["--nodes", "2", "--in-network"], ["--nvls"]):
        res = run(["--preset", "dgx-h100", *args, "--sweep", "-b", "8", "-e", "8"])
        assert res.exit_code == 0, (args, res.output)


def test_refcolls_own_schedules_in_the_sweep_take_the_latencies_given():
    """--intra-latency and --inter-latency floor every step of NCCL's runs and of refcoll's
    own schedules alike (refcoll's ring kept NCCL's hop latencies whatever was given)."""
    from refcoll.model.nccl_tests import price

    def seconds(algorithm, latency):
        system = System(**{**system_preset("dgx-h100"), "nodes": 2, "intra_alpha": latency,
                           "inter_alpha": latency})
        return price(system, 1 << 20, algorithm)[0]

    for algorithm in ("ring", "hierarchical", "Ring"):
        # (a ring of 16 ranks: 30 steps, each at least the millisecond given)
        assert seconds(algorithm, 1e-3) > seconds(algorithm, 0.0) + 10e-3, algorithm
    assert seconds("ring", 1e-3) >= 30 * 1e-3


@pytest.mark.parametrize("dtype, op, nvls", [
    ("float", "sum", True), ("half", "max", True), ("bfloat16", "min", True),
    ("int32", "sum", True), ("uint64", "max", True),
    ("float", "max", False), ("double", "min", False), ("int8", "sum", False),
    ("uint8", "sum", False), ("f8e4m3", "sum", False), ("float", "prod", False),
    ("half", "avg", False), ("float", "mulsum", False)])
def test_nvls_runs_only_where_the_switch_reduces_the_type_and_op(dtype, op, nvls):
    """NCCL's ncclNvlsSupported: NVLS is no choice for 8-bit types, products, averages, or
    float and double min/max; NCCL then runs its ring or tree, and so does the model."""
    node = System()  # one H100 node: NVLS where it may
    big = 256 << 20
    ran = {r.algorithm for r in runs(node, big, dtype, op)}
    assert ("NVLS" in ran) == nvls
    assert (nccl_pick(node, big, dtype=dtype, op=op).algorithm == "NVLS") == nvls
    assert (predict(node, big, "NVLS", dtype=dtype, op=op) is None) != nvls
    two = System(nodes=2, nics=8, nic_bw=50 * GB)
    assert ("NVLSTree" in {r.algorithm for r in runs(two, big, dtype, op)}) == nvls


def test_compare_prices_each_row_as_its_type_and_op(tmp_path):
    log = tmp_path / "int8.log"
    log.write_text("\n".join(f"{s} {s} int8 sum -1 {20 + s / 2e5:.2f} 0 0 0"
                             for s in sweep_sizes(1 << 20, 1 << 28, 4)) + "\n")
    res = run(["--preset", "dgx-h100", "--compare", str(log)])
    assert res.exit_code == 0, res.output
    picked = [line.split()[-1] for line in res.output.splitlines()
              if line.strip() and line.split()[0].isdigit()]
    assert len(picked) == 5 and not any(p.startswith("NVLS") for p in picked), picked
