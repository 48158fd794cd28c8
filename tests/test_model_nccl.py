"""The cluster model's NCCL: channels on NICs and rails, NCCL's tree and PAT, NCCL's own tuning
model, the baseline NCCL runs by default, and the search for the best stack. Every expected
number is worked out here by hand from the formulas, not read from the code."""

import json
import math

import pytest
from click.testing import CliRunner

from refcoll.algorithms.bruck import bruck_allgather_cost, bruck_reduce_scatter_cost
from refcoll.cli import main
from refcoll.core.errors import UsageError
from refcoll.model import (
    Cluster,
    ModelRequest,
    Options,
    Workload,
    allreduce_estimate,
    baseline_algorithm,
    nccl_times,
    pat_cost,
    plan,
    plan_and_search,
)

GB = 1e9
N_SEED = 7_000_000_000  # fp32 parameters: 28 GB of gradient


def seed(**kw):
    """8 nodes × 8 GPUs, NVLink 300 GB/s and a 25 GB/s NIC per GPU, both per direction."""
    kw = {"intra_latency": 0.0, "inter_latency": 0.0, "reduce_bw": 0.0, **kw}
    return Cluster(kw.pop("nodes", 8), kw.pop("g", 8), kw.pop("intra_bw", 300 * GB),
                   kw.pop("inter_bw", 25 * GB), **kw)


def seconds(cluster, algorithm, count=N_SEED, itemsize=4):
    return allreduce_estimate(cluster, algorithm, count, itemsize).seconds


# ------------------------------------------------------------------------ channels and NICs

def test_the_issues_figure_eight_channels_on_eight_nics():
    n = 4 * N_SEED
    # One ring a channel, 8 at once, each crossing on its own 25 GB/s NIC.
    assert seconds(seed(), "ring/ch") == pytest.approx(2 * (63 / 64) * n / (8 * 25 * GB),
                                                       rel=1e-12)
    # refcoll's single ring crosses every node boundary on one NIC: 2.2 s.
    assert seconds(seed(), "ring") == pytest.approx(2 * (63 / 64) * n / (25 * GB), rel=1e-12)
    # The hierarchical all-reduce of the issue (NVLink 900 GB/s both ways): 354 ms.
    c = seed(intra_bw=900 * GB, intra_bidirectional=True)
    hier = 2 * (7 / 8) * n / (450 * GB) + 2 * (7 / 8) * (n / 8) / (25 * GB)
    assert seconds(c, "hierarchical") == pytest.approx(hier, rel=1e-12)
    assert seconds(c, "ring/ch") < seconds(c, "hierarchical")


def test_refcolls_single_ring_crosses_on_one_nic_however_few_the_node_has():
    n = 4 * N_SEED
    # Each step of one node-major ring crosses each boundary once, on one GPU's NIC: with 2
    # or 4 NICs for 8 GPUs it is as fast as with a NIC per GPU, one 25 GB/s NIC's worth.
    for nics in (2, 4, 8):
        assert seconds(seed(nics=nics), "ring") == pytest.approx(
            2 * (63 / 64) * n / (25 * GB), rel=1e-12)


def test_one_channel_is_refcolls_ring():
    for c in (seed(channels=1), seed(nodes=3, g=5, channels=1), seed(nodes=1, channels=1)):
        assert seconds(c, "ring/ch", 1 << 20) == seconds(c, "ring", 1 << 20)


def test_channels_beyond_the_nics_share_them_and_nvlink_can_bind():
    n = 4 * N_SEED
    # 4 NICs, 8 channels: two channels a NIC, so the node crosses at 4 × 25 GB/s; the
    # default, one channel a NIC, is as fast.
    for c in (seed(nics=4, channels=8), seed(nics=4)):
        assert seconds(c, "ring/ch") == pytest.approx(2 * (63 / 64) * n / (4 * 25 * GB),
                                                      rel=1e-12)
    # 16 channels on 8 NICs are no faster than 8 (but for the chunks' rounding).
    assert seconds(seed(channels=16), "ring/ch") == pytest.approx(seconds(seed(), "ring/ch"),
                                                                  rel=1e-6)
    # NVLink of 100 GB/s carries all 8 channels: 12.5 GB/s each, below the NIC's 25.
    assert seconds(seed(intra_bw=100 * GB), "ring/ch") == pytest.approx(
        2 * (63 / 64) * n / (100 * GB), rel=1e-12)
    # Four NICs for eight GPUs halve what each GPU gets when all of them cross at once.
    assert seed(nics=4).link("inter")[1] == pytest.approx(2 / (25 * GB))


def test_without_rails_the_spine_is_shared():
    n = 4 * N_SEED
    c = seed(rail=False, spine_bw=50 * GB)
    # 8 channels leave each node through a 50 GB/s spine: 6.25 GB/s each.
    assert seconds(c, "ring/ch") == pytest.approx(2 * (63 / 64) * n / (50 * GB), rel=1e-12)
    # The hierarchical all-reduce's 8 shards cross at once through the same spine.
    hier = 2 * (7 / 8) * n / (300 * GB) + 2 * (7 / 8) * (n / 8) / (50 * GB / 8)
    assert seconds(c, "hierarchical") == pytest.approx(hier, rel=1e-12)
    # A non-blocking spine (the default) changes nothing.
    assert seconds(seed(rail=False), "ring/ch") == pytest.approx(seconds(seed(), "ring/ch"))
    with pytest.raises(UsageError, match="--no-rail"):
        seed(spine_bw=50 * GB)
    for bad in (dict(channels=0), dict(channels=65), dict(nics=0), dict(gpu_arch="kepler")):
        with pytest.raises(UsageError):
            seed(**bad)


def test_more_nics_behind_a_spine_never_slow_nccl_down():
    """4 channels on 4 or 8 NICs of 50 GB/s behind a 100 GB/s spine share: the spine binds
    both, once (it was counted again per channel, so 8 NICs took twice as long)."""
    times = [seconds(seed(nodes=2, g=4, inter_bw=50 * GB, rail=False, spine_bw=100 * GB,
                          channels=4, nics=nics), "nccl") for nics in (4, 8)]
    assert times[1] <= times[0] * (1 + 1e-12), times


def test_one_gpu_a_node_is_not_bound_by_an_intra_node_link_it_never_uses():
    """With one GPU a node every hop crosses the network: NVLink's rate changes nothing."""
    times = {bw: seconds(seed(nodes=4, g=1, intra_bw=bw * GB, inter_bw=50 * GB), "nccl")
             for bw in (1, 300, 5000)}
    assert len(set(times.values())) == 1, times


# ------------------------------------------------------------------------- NCCL tree, PAT

def test_nccls_tree_sends_twice_a_channels_part_over_its_hops():
    n = 4 * N_SEED
    # Bandwidth: each channel's NIC carries 2·n/C each way (interior in one tree, leaf in
    # the other); NVLink's share (300/8) is not the bottleneck.
    assert seconds(seed(), "dbtree/ch") == pytest.approx(2 * (n / 8) / (25 * GB), rel=1e-12)
    # Latency: up and down a chain of 8 GPUs (7 hops) and a tree of 8 nodes (depth 3).
    fast = seed(intra_bw=1e30, inter_bw=1e30, intra_latency=2e-6, inter_latency=5e-6)
    assert seconds(fast, "dbtree/ch", 1 << 20) == pytest.approx(2 * 7 * 2e-6 + 2 * 3 * 5e-6)
    assert seconds(fast, "ring/ch", 1 << 20) == pytest.approx(2 * 63 * 5e-6)


def test_pat_takes_log_rounds_across_nodes():
    m, count = 16, 16 * 1000
    c = Cluster(m, 1, 1e11, 25 * GB, inter_latency=5e-6, reduce_bw=0)
    est = allreduce_estimate(c, "pat", count, 4)
    assert sum(ph.rounds for ph in est.phases) == 2 * 4  # lg 16 each way
    assert est.bytes == 2 * (m - 1) * (count // m) * 4
    assert est.seconds == pytest.approx(8 * 5e-6 + 2 * (15 / 16) * count * 4 / (25 * GB))
    for nodes in (2, 3, 5, 8, 13):
        for block in (1, 7, 100):
            assert pat_cost(nodes, block, 4, reduce=False).counts() == \
                bruck_allgather_cost(nodes, block, 4).counts()
            assert pat_cost(nodes, block, 4, reduce=True).counts() == \
                bruck_reduce_scatter_cost(nodes, nodes * block, 4).counts()


# -------------------------------------------------------------------- NCCL's tuning model

def by_name(times):
    return {t.name: t for t in times}


def test_nccls_model_for_the_seed_gradient():
    times = by_name(nccl_times(seed(), 4 * N_SEED))
    ring = times["Ring/Simple"]
    # baseLat 8.4 + 112 NVLink steps at max(3.4, 3 × 1 µs overhead) + 14 network steps at 14,
    # then 1.4× (the ring's plateau, Ampere and later).
    assert ring.latency == pytest.approx((8.4 + 112 * 3.4 + 14 * 14.0) * 1.4e-6)
    assert ring.bandwidth == pytest.approx(8 * 25 * GB * 64 / 126)
    assert ring.seconds == pytest.approx(ring.latency + 4 * N_SEED / ring.bandwidth)
    tree = times["Tree/Simple"]
    assert tree.latency == pytest.approx((8.4 + 2 * (7 * 4.0 + 3 * 14.0)) * 1e-6)
    assert tree.bandwidth == pytest.approx(min(0.92 * 200, 8 * 36.0) * 0.5 * GB)
    assert set(times) == {f"{a}/{p}" for a in ("Ring", "Tree") for p in ("LL", "LL128", "Simple")}
    # The baseline is what NCCL runs, picked and priced on the cluster's own links: the
    # ring of 8 channels, bound by the node's 8 NICs of 25 GB/s, with NCCL's hop latencies
    # (NVLink 3.4 µs, network 14 µs a step) and the plateau.
    # Until its 8 channels' 4 MiB buffers are full, the pipeline pays half of them at the
    # algorithm bandwidth (200 GB/s · 64/126).
    name, run = baseline_algorithm(seed(), 4 * N_SEED)
    assert name == "nccl" and run.name == "Ring/Simple" and run.limit == "network"
    latency = (8.4 + 112 * 3.4 + 14 * 14.0) * 1.4e-6
    fill = 0.5 * 8 * (4 << 20) / (200 * GB * 64 / 126)
    assert run.seconds == pytest.approx(latency + 2 * (63 / 64) * 4 * N_SEED / (200 * GB) + fill)


def test_nccls_model_picks_the_tree_for_small_messages():
    times = by_name(nccl_times(seed(), 4096))
    ll = times["Tree/LL"]
    assert ll.latency == pytest.approx((6.8 + 2 * (7 * 0.6 + 3 * 5.0)) * 1e-6)
    # busBw min(0.92·200, 8·36) = 184, LL: min(184/3.8, llMaxBw 20.4) = 20.4, halved, then
    # the tree correction of 4 KiB (64 B · 2^6) for LL: 0.7.
    assert ll.bandwidth == pytest.approx(20.4 * 0.5 * 0.7 * GB)
    assert times["Ring/LL"].latency == pytest.approx((6.6 + 112 * 1.0 + 14 * 2.7) * 1e-6)
    name, choice = baseline_algorithm(seed(), 4096)
    assert choice.name == "Tree/LL" and name == "nccl"
    # One node: NVLink latencies only, no plateau, no post overhead.
    one = by_name(nccl_times(seed(nodes=1), 1 << 30))
    assert one["Ring/Simple"].latency == pytest.approx((8.4 + 14 * 3.4) * 1e-6)
    assert nccl_times(seed(nodes=1, g=1), 1 << 20) == ()


# ------------------------------------------------------------ baseline, search and verdict

def test_the_baseline_is_nccls_default_not_a_flat_ring():
    w = Workload.from_params(N_SEED, forward=2.0, backward=4.0)
    result = plan(seed(), w, Options())
    base = result.stack[0]
    assert base.label == "baseline (NCCL Ring/Simple)" and base.algorithm == "nccl"
    latency = (8.4 + 112 * 3.4 + 14 * 14.0) * 1.4e-6  # NCCL's hops: the seed's latencies are 0
    fill = 0.5 * 8 * (4 << 20) / (200 * GB * 64 / 126)  # 8 channels' buffers, filling
    assert base.comm == pytest.approx(
        latency + 2 * (63 / 64) * 4 * N_SEED / (200 * GB) + fill, rel=1e-12)
    assert result.baseline["nccl_pick"] == "Ring/Simple"


def test_the_search_never_keeps_compression_that_slows_the_step():
    # 1% top-k is gathered: at 64 GPUs each receives 63 payloads of 2% of the gradient,
    # more than a ring all-reduce moves, at every bucket count.
    w = Workload.from_params(1 << 24, forward=0.01, backward=0.02)
    options = Options(compressor="topk:ratio=0.01", extra_compressors=("fp16",))
    result = plan_and_search(seed(intra_latency=2e-6, inter_latency=5e-6), w, options)
    tried = {(row.label, row.buckets) for row in result.search}
    assert {"dense", "topk:ratio=0.01", "fp16"} == {label for label, _ in tried}
    assert {b for _, b in tried} == {1, 4, 16, 64, 256, 3}  # 64 MiB in DDP's 25 MiB buckets
    assert all(result.best.step <= row.step for row in result.search)
    assert result.best.compressor != "topk:ratio=0.01"
    assert any("topk:ratio=0.01 is not kept" in line for line in result.verdict)
    # With nothing to hide under, buckets only add latency and fp16 halves the bytes.
    bare = Workload.from_params(1 << 24)
    best = plan_and_search(seed(intra_latency=2e-6, inter_latency=5e-6), bare,
                           Options(compressor="fp16")).best
    assert best.compressor == "fp16" and best.buckets == 1
    # Dense when compression gains nothing: fp16 on a free network.
    free = seed(intra_bw=1e30, inter_bw=1e30, reduce_bw=1e12)
    assert plan_and_search(free, bare, Options(compressor="fp16")).best.compressor is None


def test_the_seed_preset_gives_a_row_per_algorithm_and_says_who_wins(tmp_path):
    out = tmp_path / "seed.json"
    res = CliRunner().invoke(main, ["model", "--preset", "seed", "--json", str(out)],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["cluster"]["nodes"] == 8 and data["cluster"]["gpus_per_node"] == 8
    assert data["workload"]["bytes"] == 4 * N_SEED
    assert data["workload"]["forward"] == 2.0 and data["workload"]["backward"] == 4.0
    names = {a["algorithm"] for a in data["allreduce"]}
    assert {"ring", "hierarchical", "ring/ch", "dbtree/ch", "tree/ch", "pat", "nccl"} <= names
    assert data["nccl_model"]["version"] and len(data["nccl_model"]["times"]) == 6
    # What NCCL runs (its ring on 8 NICs) beats refcoll's own schedules of one ring each.
    assert "nccl wins the all-reduce" in res.output and "the gap is" in res.output
    assert "what NCCL does by default" in res.output and "best stack found" in res.output
    assert data["best"]["step"] <= min(row["step"] for row in data["search"])
    # An option given on the command line beats the preset's.
    res = CliRunner().invoke(main, ["model", "--preset", "seed", "--nodes", "2", "--no-search",
                                    "--json", str(out)], catch_exceptions=False)
    assert res.exit_code == 0 and json.loads(out.read_text())["cluster"]["nodes"] == 2
    assert json.loads(out.read_text())["search"] == []


@pytest.mark.parametrize("args, needle", [
    (["--channels", "0"], "--channels"), (["--channels", "65"], "--channels"),
    (["--nics-per-node", "nan"], "--nics-per-node"), (["--spine-bw", "10GB/s"], "--no-rail"),
    (["--no-rail", "--spine-bw", "10"], "--spine-bw"),
    (["--nodes", "1", "--in-network"], "one node has no network to cross"),  # as the sweep
])
def test_bad_network_options_are_one_line_and_exit_2(args, needle):
    res = CliRunner().invoke(main, ["model", "--preset", "seed", *args], catch_exceptions=False)
    assert res.exit_code == 2, res.output
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in res.output


def test_the_library_takes_several_compressors_as_text():
    result = ModelRequest(nodes="2", gpus_per_node="2", intra_bw="100GB/s", inter_bw="10GB/s",
                          bidirectional=False, params="1e6",
                          compressor=["fp16", "bf16", "fp16"]).plan()
    assert result.options.compressors == ("fp16", "bf16")
    assert result.stack[2].compressor in ("fp16", "bf16")
    assert math.isfinite(result.stack[2].step)


# ------------------------------------------------------------------- review: fixed defects

def test_a_tie_is_named_and_the_next_best_is_the_first_slower_one():
    from refcoll.model import allreduce_verdict
    # One GPU a node: Rabenseifner and PAT both take 2·lg 8 = 6 rounds and move 2·(7/8)·n;
    # the ring takes 14 rounds. Before, a tie at the top gave no sentence at all.
    c = Cluster(8, 1, 300 * GB, 25 * GB, inter_latency=5e-6, reduce_bw=0)
    n = 8 * 1000
    dense = [allreduce_estimate(c, a, n, 4) for a in ("ring", "rabenseifner", "pat")]
    tie = 6 * 5e-6 + 2 * (7 / 8) * n * 4 / (25 * GB)
    assert dense[1].seconds == pytest.approx(tie) and dense[2].seconds == pytest.approx(tie)
    (line,) = allreduce_verdict(c, dense)
    assert line.startswith("rabenseifner (tied with pat) wins")
    assert "for ring, the next best" in line
    assert "6 rounds" in line and "against 14" in line
    # Every algorithm tied: one GPU, nothing moves.
    one = Cluster(1, 1, GB, GB)
    assert allreduce_verdict(one, [allreduce_estimate(one, a, n, 4) for a in ("ring", "tree")]) \
        == ("On one GPU an all-reduce moves nothing: every algorithm takes 0.",)


def test_times_that_three_digits_show_equal_get_more_digits():
    from refcoll.model.verdict import distinct_times
    assert distinct_times(0.18784533, 0.18786133) == ("187.8 ms", "187.9 ms")
    assert distinct_times(0.304, 0.312) == ("304 ms", "312 ms")


def test_the_search_names_a_hierarchical_all_reduce_with_its_inter_algorithm():
    # Before, the bucket sentence looked the row's name 'hierarchical(inter=rabenseifner)' up
    # as an algorithm and a valid command ended with 'unknown algorithm'.
    w = Workload.from_params(N_SEED, forward=2.0, backward=4.0)
    options = Options(algorithms=("hierarchical", "ring/ch"), inter="rabenseifner")
    result = plan_and_search(seed(intra_latency=2e-6, inter_latency=5e-6), w, options)
    assert result.best.algorithm == "hierarchical(inter=rabenseifner)"
    # 26 MB buckets: 7 + 3 + 3 + 7 rounds against the ring's 2·63.
    line = [v for v in result.verdict if v.startswith("In buckets of")][0]
    assert "hierarchical(inter=rabenseifner) beats ring/ch" in line
    assert "20 rounds" in line and "against 126" in line


def test_the_bucket_sentence_prices_the_bucket_as_the_best_stack_sends_it():
    from refcoll.model import human_bytes
    from refcoll.model.verdict import distinct_times
    w = Workload.from_params(N_SEED, forward=2.0, backward=4.0)
    c = seed(intra_latency=2e-6, inter_latency=5e-6)
    result = plan_and_search(c, w, Options(compressor="fp16"))
    best = result.best
    assert (best.compressor, best.algorithm, best.buckets) == ("fp16", "dbtree/ch", 1069)
    e = N_SEED // 1069  # the last of 1069 buckets (the first N_SEED % 1069 hold one more)
    per = -(-e // 8)  # a channel's elements, fp16 (2 B) on the wire
    tree = 2 * 7 * 2e-6 + 2 * 3 * 5e-6 + 2 * per * 2 / (25 * GB)
    ring = 2 * 63 * 5e-6 + 2 * 63 * -(-per // 64) * 2 / (25 * GB)
    t_tree, t_ring = distinct_times(tree, ring)
    line = [v for v in result.verdict if v.startswith("In buckets of")][0]
    assert f"compressed with fp16 to {human_bytes(2 * e)}" in line
    assert f"({t_tree} against {t_ring} a bucket)" in line


def test_a_topology_row_slower_than_ncclss_default_is_noted():
    w = Workload.from_params(N_SEED, forward=2.0, backward=4.0)
    result = plan(seed(), w, Options(algorithms=("ring",)))
    base, topo = result.stack[:2]
    n = 4 * N_SEED
    latency = (8.4 + 112 * 3.4 + 14 * 14.0) * 1.4e-6  # NCCL's ring: its hops and plateau
    fill = 0.5 * 8 * (4 << 20) / (200 * GB * 64 / 126)  # 8 channels' buffers, filling
    assert base.comm == pytest.approx(latency + 2 * (63 / 64) * n / (8 * 25 * GB) + fill,
                                      rel=1e-12)
    assert topo.comm == pytest.approx(2 * (63 / 64) * n / (25 * GB), rel=1e-12)
    assert topo.speedup == pytest.approx(base.step / topo.step)
    assert any(note.startswith("+topology makes the step slower") and "nccl" in note
               for note in result.notes)


def test_a_flat_ring_allgather_crosses_each_boundary_on_one_nic():
    from refcoll.model import compressed_estimate
    # 2 NICs for 8 GPUs: a GPU gets a quarter NIC when all cross at once (the hierarchical
    # all-reduce's shards), but a flat ring has one GPU a node crossing, on a whole NIC.
    c = seed(nics=2, intra_latency=2e-6, inter_latency=5e-6)
    assert c.link("inter") == (5e-6, 4 / (25 * GB))
    assert c.link("flat") == (5e-6, 1 / (25 * GB))
    est = compressed_estimate(c, "topk:ratio=0.01", ((1 << 20,),), "float32")
    payload = est.payload
    gather = [ph for ph in est.phases if ph.name == "payload allgather"][0]
    assert gather.link == "flat"
    assert gather.seconds == pytest.approx(63 * (5e-6 + payload / (25 * GB)))


def test_a_single_layer_compressed_by_powersgd_is_priced_as_layers():
    # One 1-D layer from --layers: PowerSGD sends it whole. Before, the +compression
    # estimate forgot that the shapes were layers and refused them as a flat count.
    w = Workload(((4096,),), forward=0.01, backward=0.02)
    result = plan(seed(), w, Options(compressor="powersgd:rank=4"))
    assert result.compressed.payload == 4096 * 4


@pytest.mark.parametrize("args, needle", [
    (["--gpu-arch", "pascal"], "--gpu-arch"), (["--preset", "nope"], "--preset"),
    (["--pattern", "scatter"], "--pattern"), (["--intra-quoted", "both"], "--intra-quoted"),
])
def test_unknown_choices_are_one_line_and_exit_2(args, needle):
    base = [] if "--preset" in args else ["--preset", "seed"]
    res = CliRunner().invoke(main, ["model", *base, *args], catch_exceptions=False)
    assert res.exit_code == 2, res.output
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Usage" not in res.output


def test_one_node_of_one_gpu_reads_in_the_singular(tmp_path):
    out = tmp_path / "one.json"
    res = CliRunner().invoke(main, ["model", "--nodes", "1", "--gpus-per-node", "1",
                                    "--intra-bw", "1GB/s", "--unidirectional", "--params", "1e6",
                                    "--no-search", "--json", str(out)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "cluster: 1 node × 1 GPU = 1 GPU;" in res.output
    assert "network: one node, no NIC crossed; 1 channel\n" in res.output
    assert "1 nodes" not in res.output and "1 channels" not in res.output
    assert "On one GPU an all-reduce moves nothing" in res.output
    data = json.loads(out.read_text())["cluster"]
    assert data["nics"] == data["nics_per_node"] == 1 and data["channels"] == 1


def test_columns_line_up_with_long_algorithm_names():
    res = CliRunner().invoke(main, ["model", "--preset", "seed", "--inter", "recursive_doubling",
                                    "--algorithm", "hierarchical,ring/ch,ring"],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    # The dense table: each time ends under the header's "time".
    at = lines.index(next(x for x in lines if x.startswith("  algorithm ")))
    end = lines[at].index(" time") + len(" time")
    rows = lines[at + 1:at + 6]
    assert any(x.startswith("  hierarchical(inter=recursive_doubling) ") for x in rows)
    assert all(x[end - 1] == "s" and x[end] == " " for x in rows)
    # The search table: each bucket count ends under the header's "buckets".
    at = lines.index(next(x for x in lines if x.startswith("  compression ")))
    end = lines[at].index("buckets") + len("buckets")
    rows = [x for x in lines[at + 1:] if x.startswith("  dense ")]
    assert rows and all(x[end - 1].isdigit() and x[end] == " " for x in rows)


def test_nccl_launches_a_small_buffer_on_fewer_channels_after_it_has_picked():
    # src/enqueue.cc drops a channel while n < channels × threads × threshold: Simple's
    # 512 threads × 64 B make 32 KiB a channel, LL128's 640 × 8 B 5 KiB, a ring's LL
    # 512 × 8 B × 16 ranks 64 KiB; NVLS keeps its channels.
    from refcoll.model.nccl_run import nccl_pick, runs, used_channels
    from refcoll.model.systems import System, system_preset

    assert used_channels("Ring", 2, 24, 16, 256 << 10) == 8
    assert used_channels("Ring", 2, 24, 16, 1 << 30) == 24
    assert used_channels("Tree", 1, 24, 16, 20 << 10) == 4
    assert used_channels("Ring", 0, 24, 16, 1 << 20) == 16
    assert used_channels("Ring", 0, 24, 16, 8) == 1
    assert used_channels("NVLS", 2, 16, 8, 8) == 16
    system = System(nodes=2, **system_preset("dgx-h100"))
    for nbytes in (8, 32 << 10, 1 << 20, 64 << 20):
        every = runs(system, nbytes)
        picked = nccl_pick(system, nbytes)
        assert picked.tuned == min(r.tuned for r in every)  # chosen on every channel
        assert all(r.seconds >= r.tuned - 1e-15 for r in every)  # fewer cannot be faster
        if picked.channels < system.channel_count():  # then it streams at its share
            assert picked.seconds > picked.tuned



# ------------------------------------------------------------ review: NCCL's baseline, bounded

def _nccl(cluster, count=1_000_000_000):
    return seconds(cluster, "nccl", count)


def test_nccls_baseline_is_held_to_the_spine_without_rails():
    """--no-rail --spine-bw 10GB/s: each node sends 2·7/8 of 4 GB through 10 GB/s, at least
    700 ms; NCCL's baseline priced 40 ms, as if every NIC had its own rail."""
    spine = seed(rail=False, spine_bw=10 * GB)
    assert _nccl(spine) >= 2 * 7 / 8 * 4e9 / (10 * GB)
    assert _nccl(seed()) < _nccl(spine)


def test_nccl_on_fewer_channels_than_nics_is_never_faster():
    """Each channel crosses on one NIC: 1 channel of 8 NICs uses one. The baseline got
    faster from 2 channels to 1 (NVLS kept its whole rate on its one channel)."""
    times = [_nccl(seed(nodes=2, nics=8, channels=c)) for c in (1, 2, 8, 16)]
    assert times == sorted(times, reverse=True), times
    one_nic = 4e9 / (25 * GB)  # the 2-node tree sends the buffer once, on one NIC
    assert times[0] >= one_nic


def test_nccls_tree_pays_its_protocols_lines_on_the_network():
    """LL carries 4 bytes of data in each 8-byte line, on the network too: a network-bound
    Tree/LL cannot beat twice the buffer over the NIC (it used to price Simple's rate)."""
    from refcoll.model.nccl_run import runs
    from refcoll.model.systems import as_system

    slow = seed(nodes=2, inter_bw=1.25 * GB, nics=1)
    ll = [r for r in runs(as_system(slow), 1 << 30) if r.name == "Tree/LL"]
    assert ll and ll[0].algbw <= 0.5 * 1.25 * GB  # the wire's half of the NIC's rate


def test_the_json_search_rows_carry_their_speed_up(tmp_path):
    out = tmp_path / "m.json"
    res = CliRunner().invoke(main, ["model", "--preset", "seed", "--compressor", "fp16",
                                    "--json", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    base = data["stack"][0]["step"]
    for row in data["search"]:
        assert row["speedup"] == pytest.approx(base / row["step"])
    assert data["best"]["speedup"] == pytest.approx(base / data["best"]["step"])
    assert any(row["speedup"] != 1.0 for row in data["search"])


@pytest.mark.parametrize("args,said", [
    (["--params", "1e308"], "a model needs 1 to 1e+15 parameters"),
    (["--intra-bw", "1e-300B/s"], "--intra-bw '1e-300B/s': give 1 B/s to 1 EB/s"),
    (["--reduce-bw", "1e-300B/s"], "--reduce-bw '1e-300B/s': give 1 B/s to 1 EB/s"),
    (["--forward", "1e308"], "--forward '1e308': at most 1e+07 s"),
    (["--calibrate", "-n", "100000"], "-n 100000: refcoll starts at most 4096 processes"),
])
def test_numbers_no_float_can_price_are_refused(args, said):
    res = CliRunner().invoke(main, ["model", "--preset", "seed", *args])
    assert res.exit_code == 2 and said in res.stderr and "Traceback" not in res.output, \
        res.output


def test_a_preset_the_step_report_cannot_express_says_so():
    for preset, nodes, said in (("p4d", "2", "not expressed: p4d's NICs are efa"),
                                ("pcie-no-p2p", "1", "not expressed: pcie-no-p2p's GPUs talk "
                                                     "through host memory")):
        res = CliRunner().invoke(main, ["model", "--preset", preset, "--nodes", nodes,
                                        "--params", "1e8", "--no-search"])
        assert res.exit_code == 0 and said in res.output, res.output
