"""The cluster cost model: phase bytes against the formulas and the simulator's ledger,
compressed patterns against the compressors' real payloads, overlap's bounds, the CLI."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import mpiexec_path

import refcoll
from refcoll.cli import main
from refcoll.compressors import parse
from refcoll.core.errors import UsageError
from refcoll.model import (
    CHANNELLED,
    EXACT_LIMIT,
    Cluster,
    Options,
    Workload,
    allreduce_estimate,
    buckets_of,
    compressed_estimate,
    load_layers,
    overlap,
    parse_bandwidth,
    parse_duration,
    parse_size,
    parse_sizes,
    payload_arrays,
    plan,
    step_time,
)
from refcoll.verify.inputs import make_inputs

GB = 1e9


def cluster(nodes, g, **kw):
    return Cluster(nodes, g, intra_bw=kw.pop("intra_bw", 100 * GB),
                   inter_bw=kw.pop("inter_bw", 10 * GB), intra_latency=1e-6,
                   inter_latency=5e-6, **kw)


def phase_bytes(estimate):
    return {ph.name: ph.bytes for ph in estimate.phases}


# ------------------------------------------------------------------- dense all-reduces

@pytest.mark.parametrize("g, m", [(8, 4), (4, 16), (2, 3), (6, 5)])
def test_hierarchical_phases_move_the_stated_fractions_of_the_buffer(g, m):
    itemsize = 4
    n = g * m * 1000 * 7  # divisible by g·m, so the formulas hold exactly
    total = n * itemsize
    c = cluster(m, g)
    est = allreduce_estimate(c, "hierarchical", n, itemsize)
    got = phase_bytes(est)
    # Intra-node reduce-scatter: (g-1)/g of the full buffer per GPU over the intra link.
    assert got["intra reduce-scatter"] == (g - 1) * total // g
    # Inter-node ring all-reduce of 1/g of it among m nodes: 2(m-1)/m of the shard per GPU.
    assert got["inter ring all-reduce"] == 2 * (m - 1) * (total // g) // m
    assert got["intra allgather"] == (g - 1) * total // g
    # The g shards go over g inter-node links at once: the phase's time is one shard's.
    alpha, beta = c.link("inter")
    inter = [ph for ph in est.phases if ph.link == "inter"][0]
    assert inter.seconds == pytest.approx(2 * (m - 1) * alpha + 2 * (m - 1) * (total // g) // m
                                          * beta + (m - 1) * (n // g) // m * itemsize / 1e12)


def test_a_bidirectional_figure_is_half_each_way():
    one_way = cluster(4, 8, inter_bw=50 * GB, intra_bw=450 * GB)
    both = cluster(4, 8, inter_bw=100 * GB, intra_bw=900 * GB, inter_bidirectional=True,
                   intra_bidirectional=True)
    assert one_way.link("inter") == both.link("inter")
    assert one_way.link("intra") == both.link("intra")
    n = 1 << 24
    assert allreduce_estimate(one_way, "ring", n, 4).seconds == \
        allreduce_estimate(both, "ring", n, 4).seconds


def test_a_flat_ring_waits_for_the_inter_node_link():
    c = cluster(4, 8)
    n = 32 * 1024
    est = allreduce_estimate(c, "ring", n, 4)
    alpha, beta = c.link("flat")
    assert (alpha, beta) == c.link("inter")  # a NIC per GPU: one crossing is one GPU's share
    p = 32
    assert {ph.link for ph in est.phases} == {"flat"}
    assert est.bytes == 2 * (p - 1) * (n // p) * 4
    comm = 2 * (p - 1) * alpha + est.bytes * beta
    assert est.seconds == pytest.approx(comm + (p - 1) * (n // p) * 4 / 1e12)
    assert allreduce_estimate(c, "hierarchical", n, 4).seconds < est.seconds


def test_rabenseifner_halves_across_nodes_first():
    g, m, n = 4, 4, 16 * 4096
    got = phase_bytes(allreduce_estimate(cluster(m, g), "rabenseifner", n, 4))
    assert got["inter halving"] == (m - 1) * n * 4 // m
    assert got["intra halving"] == (g - 1) * (n // m) * 4 // g


def node_split(ledger, g):
    return ledger.split_bytes(lambda a, b: a // g == b // g)


@pytest.mark.parametrize("algorithm", ["hierarchical", "ring", "recursive_doubling",
                                       "rabenseifner"])
@pytest.mark.parametrize("g, m", [(2, 2), (4, 2), (2, 4)])
def test_phase_bytes_agree_with_the_simulators_ledger(algorithm, g, m):
    p, n = g * m, g * m * 24
    inputs = make_inputs("exact", np.float32, n, p)
    options = {"ranks_per_node": g, "node_size": g} if algorithm == "hierarchical" else {}
    ledger = refcoll.simulate("allreduce", inputs, algorithm=algorithm, **options).ledger
    est = allreduce_estimate(cluster(m, g), algorithm, n, 4)
    # Every GPU sends the same bytes in these algorithms, so the ledger's totals are p times
    # the model's per-GPU bytes, split by the link the model puts each phase on.
    inside, across = node_split(ledger, g)
    assert inside + across == p * est.bytes
    if algorithm != "ring":  # the flat ring puts everything on the slowest link
        assert inside == p * sum(ph.bytes for ph in est.phases if ph.link == "intra")
        assert across == p * sum(ph.bytes for ph in est.phases if ph.link == "inter")


def test_switch_needs_in_network_reduction_and_halves_the_ring():
    with pytest.raises(UsageError, match="in-network"):
        allreduce_estimate(cluster(4, 1), "switch", 1000, 4)
    c = cluster(8, 1, in_network=True)
    n = 1 << 20
    assert allreduce_estimate(c, "switch", n, 4).bytes == n * 4
    assert allreduce_estimate(c, "ring", n, 4).bytes == 2 * 7 * (n // 8) * 4


# -------------------------------------------------------------------------- compression

@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "qsgd:levels=16", "sign:block=256",
                                  "int8", "onebit", "terngrad:block=512", "randomk:ratio=0.003",
                                  "ef(topk:ratio=0.001)", "fp16"])
def test_payload_bytes_are_the_compressors_own_past_the_exact_limit(spec):
    comp = parse(spec)
    n = EXACT_LIMIT + 4096  # extrapolated; a multiple of every block and bucket used here
    x = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    real = comp.compress(x, comp.new_state()).nbytes
    assert sum(c * s for _, c, s in payload_arrays(spec, n, "float32")) == real


def test_gathered_topk_traffic_grows_with_p_and_the_ring_does_not():
    n, spec = 1 << 20, "topk:ratio=0.01"
    comp = parse(spec)
    payload = comp.compress(np.random.default_rng(0).standard_normal(n).astype(np.float32),
                            comp.new_state()).nbytes
    gathered, ring = {}, {}
    for p in (2, 4, 8, 16, 32):
        c = cluster(p, 1)
        est = compressed_estimate(c, spec, [(n,)], np.float32)
        assert est.pattern == "gather" and est.payload == payload
        gathered[p] = phase_bytes(est)["payload allgather"]
        ring[p] = allreduce_estimate(c, "ring", n, 4).bytes
    assert all(gathered[p] == (p - 1) * payload for p in gathered)  # linear in p
    assert all(ring[p] < 2 * n * 4 for p in ring)  # bounded by twice the buffer
    # So 1% top-k (8 bytes per kept element: 2% of the dense bytes) wins on few ranks and
    # loses past p ≈ 100, and the plan says so.
    small = plan(cluster(2, 1), Workload.from_params(n), Options(compressor=spec))
    large = plan(cluster(128, 1), Workload.from_params(n), Options(compressor=spec))
    assert small.stack[2].comm < small.stack[1].comm and not small.notes
    assert large.stack[2].comm > large.stack[1].comm
    assert any("slower" in note for note in large.notes)


def test_int8_summed_in_int8_is_refused_where_the_call_refuses_it():
    # Shared-scale int8 codes summed in int8 fit at most 127 ranks: the real call refuses
    # 128, and the model priced 256 ranks as if it ran.
    with pytest.raises(UsageError, match="at most 127 ranks' codes in their own type; 256 ranks"):
        compressed_estimate(cluster(32, 8), "int8", [(1 << 20,)], np.float32, pattern="allreduce")
    assert compressed_estimate(cluster(8, 8), "int8", [(1 << 20,)], np.float32,
                               pattern="allreduce").pattern == "allreduce"
    with pytest.raises(UsageError, match="at most 127 ranks' codes in their own type; 128 ranks"):
        refcoll.SimWorld(128).run(lambda t: refcoll.compressed_allreduce(
            np.ones(8, np.float32), t, compressor="int8", pattern="allreduce"))


def test_twophase_sends_compressed_chunks_of_n_over_p():
    n, p, spec = 1 << 16, 8, "sign"
    est = compressed_estimate(cluster(2, 4), spec, [(n,)], np.float32)
    assert est.pattern == "twophase"
    comp = parse(spec)
    chunk = comp.compress(np.ones(n // p, np.float32), comp.new_state()).nbytes
    got = phase_bytes(est)
    assert got["all-to-all (intra)"] == 3 * chunk and got["all-to-all (inter)"] == 4 * chunk
    assert got["chunk allgather"] == (p - 1) * chunk


SHAPES = [(256, 512), (512,), (64, 32, 3, 3), (4, 4), (1000, 10)]


def test_powersgd_ratio_comes_from_the_layer_shapes():
    r = 4
    spec = f"powersgd:rank={r}"
    factors = whole = dense = 0
    for shape in SHAPES:
        rows, cols = shape[0], math.prod(shape[1:]) if len(shape) > 1 else 1
        dense += rows * cols
        if len(shape) >= 2 and 2 * (rows + cols) * r < rows * cols:
            factors += (rows + cols) * r  # (m+n)·r against m·n
        else:
            whole += rows * cols  # vectors, and matrices where compressing does not pay
    est = compressed_estimate(cluster(2, 2), spec, SHAPES, np.float32)
    assert est.payload == (factors + whole) * 4
    assert est.dense == dense * 4
    # The same bytes the compressor itself puts on the wire, layer by layer.
    comp = parse(spec)
    real = sum(comp.compress(np.random.default_rng(0).standard_normal(s).astype(np.float32),
                             comp.new_state()).nbytes for s in SHAPES)
    assert est.payload == real
    with pytest.raises(UsageError, match="layers"):
        plan(cluster(2, 2), Workload.from_params(1e6), Options(compressor=spec))


# ------------------------------------------------------------------------------ overlap

def test_one_bucket_hides_nothing():
    assert overlap([1.0], [0.3], 1.0) == pytest.approx((0.3, 0.0))
    w = Workload.from_params(1 << 22, forward=0.05, backward=0.1)
    row = step_time(cluster(4, 2), w, "ring")
    assert row.exposed == row.comm and row.step == pytest.approx(0.15 + row.comm)


@pytest.mark.parametrize("comm_per_bucket", [1e-4, 0.01, 0.05])
@pytest.mark.parametrize("buckets", [2, 5, 25])
def test_overlap_hides_at_most_the_backward_pass_before_the_last_bucket(buckets,
                                                                        comm_per_bucket):
    backward = 0.1
    ready = [backward * (i + 1) / buckets for i in range(buckets)]
    comm = [comm_per_bucket] * buckets
    exposed, hidden = overlap(ready, comm, backward)
    assert exposed + hidden == pytest.approx(sum(comm))
    assert hidden <= backward - ready[0] + 1e-12  # nothing runs before the first bucket
    assert exposed >= comm[-1] - 1e-12  # the last bucket is ready only when backward ends
    if comm_per_bucket * buckets <= backward - ready[0]:
        assert exposed == pytest.approx(comm[-1])  # all but the last fits under backward


def test_buckets_fill_last_layers_first_and_never_split_a_layer():
    w = Workload(((100,), (10, 10), (100,), (300,)), backward=1.0)
    cut = buckets_of(w, 3)
    # 600 parameters: a bucket closes once it reaches the next third, the last layer first.
    assert [shapes for shapes, _ in cut] == [((300,),), ((100,),), ((10, 10), (100,))]
    assert [ready for _, ready in cut] == pytest.approx([0.5, 2 / 3, 1.0])
    flat = buckets_of(Workload.from_params(10), 3)
    assert [s for s, _ in flat] == [((4,),), ((3,),), ((3,),)]
    # An empty tensor is never a bucket of its own (one more all-reduce's latency): it joins
    # the bucket before it, or, first of all, the next.
    w = Workload(((0,), (1000,), (0, 3)), backward=1.0)
    assert [shapes for shapes, _ in buckets_of(w, 1)] == [((0, 3), (1000,), (0,))]
    assert len(buckets_of(Workload(((1000,), (0,)), backward=1.0), 1)) == 1


def test_the_stack_reports_each_technique():
    w = Workload(tuple([(1024, 1024), (1024,)] * 8), bytes_per_element=2, forward=0.02,
                 backward=0.04)
    result = plan(cluster(8, 4), w, Options(compressor="powersgd:rank=4", buckets=4))
    labels = [row.label for row in result.stack]
    # The baseline is what NCCL would run: its pick, priced with its channels (one bucket).
    assert labels[0].startswith("baseline (NCCL ")
    assert labels[1:] == ["+topology", "+compression", "+overlap"]
    base = result.stack[0]
    assert base.algorithm in CHANNELLED and base.buckets == 1
    for previous, row in zip(result.stack, result.stack[1:]):
        assert row.speedup == pytest.approx(base.step / row.step)
        assert row.gain == pytest.approx(previous.step / row.step)
    assert result.stack[1].step <= base.step
    assert result.stack[3].buckets == 4 and result.stack[3].exposed < result.stack[2].exposed


# --------------------------------------------------------------------------------- units

def test_the_fit_of_a_line_never_goes_negative():
    from refcoll.model.calibrate import _fit_line

    a, b = _fit_line([(8, 4e-6), (1 << 20, 4e-6 + (1 << 20) * 1e-10), (1 << 24, 2e-3)])
    assert a == pytest.approx(4e-6, rel=0.5) and b > 0
    # On the line t = -1 µs + 2 ns/B · b, so the free fit's intercept is negative.
    a, b = _fit_line([(1000, 1e-6), (2000, 3e-6), (4000, 7e-6)])
    assert a == 0 and b > 0


def test_units():
    assert parse_bandwidth("200Gb/s") == 25e9
    assert parse_bandwidth("300 GB/s") == 300e9
    assert parse_bandwidth("100Gbps") == 12.5e9
    assert parse_bandwidth("1GiB/s") == 2 ** 30
    assert parse_duration("2us") == pytest.approx(2e-6) and parse_duration("50ms") == 0.05
    assert parse_duration("0.1") == 0.1
    assert parse_size("64K") == 65536 and parse_size("25MB") == 25_000_000
    assert parse_sizes("64K..256K") == [65536, 131072, 262144]
    assert load_layers('{"a": [2, 3], "b": [3]}') == ((2, 3), (3,))
    for bad in (lambda: parse_bandwidth("fast"), lambda: parse_duration("2 parsecs"),
                lambda: parse_sizes("1M..64K"), lambda: load_layers("[[2, -1]]")):
        with pytest.raises(UsageError):
            bad()


# ----------------------------------------------------------------------------------- CLI

CLUSTER_ARGS = ["model", "--nodes", "4", "--gpus-per-node", "8", "--intra-bw", "900GB/s",
                "--inter-bw", "400Gb/s", "--intra-quoted", "bidirectional",
                "--inter-quoted", "unidirectional", "--forward", "50ms", "--backward", "0.1"]


def test_cli_writes_the_plan_as_json(tmp_path):
    layers = tmp_path / "layers.json"
    layers.write_text(json.dumps([[4096, 1024], [4096], [1024, 4096], [1024]] * 6))
    out = tmp_path / "plan.json"
    res = CliRunner().invoke(main, CLUSTER_ARGS + ["--layers", str(layers), "--bytes-per-element",
                                                   "2", "--compressor", "ef(powersgd:rank=8)",
                                                   "--buckets", "6", "--json", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["cluster"]["gpus"] == 32
    labels = [row["label"] for row in data["stack"]]
    assert labels[0].startswith("baseline (NCCL ")  # NCCL's default, not a single flat ring
    assert labels[1:] == ["+topology", "+compression", "+overlap"]
    hier = [a for a in data["allreduce"] if a["algorithm"] == "hierarchical"][0]
    n = data["workload"]["bytes"]
    assert [ph["bytes"] for ph in hier["phases"]] == [7 * n // 8, 2 * 3 * (n // 8) // 4,
                                                       7 * n // 8]
    assert data["compressed"]["pattern"] == "allreduce"
    assert "hierarchical" in res.output and "+overlap" in res.output


@pytest.mark.parametrize("args, message", [
    (["--params", "1e9"], "quoted"),
    (["--params", "1e9", "--bidirectional", "--inter-bw", "fast"], "bandwidth"),
    (["--bidirectional"], "--params"),
    (["--params", "1e9", "--bidirectional", "--compressor", "nope"], "unknown compressor"),
    (["--params", "1e9", "--bidirectional", "--compressor", " "], "names no compressor"),
    (["--params", "1e9", "--bidirectional", "--algorithm", "switch"], "algorithm"),
])
def test_cli_bad_input_is_one_line_and_exit_2(args, message):
    base = [a for a in CLUSTER_ARGS if a not in ("--intra-quoted", "--inter-quoted",
                                                 "bidirectional", "unidirectional")]
    if "--inter-bw" in args:
        i = base.index("--inter-bw")
        base = base[:i] + base[i + 2:]
    res = CliRunner().invoke(main, base + args)
    assert res.exit_code == 2, res.output
    assert message in res.output and "Traceback" not in res.output


@pytest.mark.skipif(mpiexec_path() is None,
                    reason="no mpiexec: install with pip install 'refcoll[mpi]'")
def test_calibrate_predicts_and_measures(tmp_path):
    out = tmp_path / "calibrate.json"
    env = {**os.environ, "REFCOLL_CACHE": str(tmp_path)}
    res = subprocess.run([sys.executable, "-m", "refcoll", "model", "--calibrate", "-n", "2",
                          "--sizes", "64K,128K", "--algorithm", "ring,recursive_doubling",
                          "--json", str(out)], capture_output=True, text=True, timeout=120,
                         env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(out.read_text())
    assert data["ranks"] == 2
    assert [(r["algorithm"], r["bytes"]) for r in data["rows"]] == [
        ("ring", 65536), ("ring", 131072), ("recursive_doubling", 65536),
        ("recursive_doubling", 131072)]
    assert all(r["measured"] > 0 and r["predicted"] > 0 for r in data["rows"])
    cal = data["calibration"]
    # The fit is of timings: on a shared machine 128K may take no longer than 64K, and the
    # least-squares β is then clamped at 0. What holds whatever the load: none is negative.
    assert cal["alpha"] >= 0 and cal["beta"] >= 0 and cal["gamma"] > 0
    assert "predictions within 30%" in res.stdout


@pytest.mark.parametrize("nodes", [0, 2])
def test_a_two_level_calibration_prints_the_level_across_nodes(nodes, capsys):
    from refcoll.cli.model import _print_calibration
    from refcoll.core.calibration import Calibration
    from refcoll.model import Comparison
    inter_beta = 8.369e-9
    cal = Calibration(alpha=4.2e-5, beta=1e-10, gamma=1.8e-10, ranks=4, inter_alpha=1.3e-5,
                      inter_beta=inter_beta if nodes else 0.0, nodes=nodes, per_node=2)
    row = {"algorithm": "ring", "bytes": 1 << 16, "predicted": 1.1e-3, "wait": 0.0,
           "predicted_without_wait": 1.1e-3, "predicted_fit": 1.1e-3, "measured": 8.3e-4,
           "ratio": 1.1e-3 / 8.3e-4}
    _print_calibration(Comparison(cal, [row], None, 2, back_to_back=bool(nodes)), "MPICH")
    out = capsys.readouterr().out
    across = [line for line in out.splitlines() if line.startswith("across ")]
    if nodes:
        assert across == [f"across 2 nodes of 2 ranks: α = 13 µs, β = 8.369 ns/B "
                          f"({8 / inter_beta / 1e6:.0f} Mbit/s); the predictions price each "
                          f"phase at its level's α and β"]
        assert "ping-pong fit (between ranks 0 and 1): α = 42 µs" in out
        assert ("measured: each all-reduce right after the one before it (--back-to-back)"
                in out.splitlines())
    else:
        assert across == [] and "between ranks" not in out
        assert "measured: each all-reduce after a barrier" in out.splitlines()
