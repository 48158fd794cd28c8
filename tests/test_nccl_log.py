"""NCCL_ALGO/NCCL_PROTO passthrough and NCCL's TUNING lines, on recorded lines (no GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from refcoll.baselines import nccl_log as nl
from refcoll.core.errors import UsageError

DATA = Path(__file__).parent / "data"


def lines(version: str) -> list[str]:
    return (DATA / f"nccl_tuning_{version}.log").read_text().splitlines()


@pytest.mark.parametrize("value", ["Ring", "ring", "TREE,ring", "^NVLS", "^nvls,collnetchain",
                                   "CollnetDirect", "NVLSTree", "PAT",
                                   "allreduce:tree",
                                   "ring;allreduce:tree,collnetdirect;broadcast:ring",
                                   "allreduce:^tree", "AllGather:PAT;ReduceScatter:ring"])
def test_nccl_algo_values_nccl_accepts_pass_through_as_written(value):
    assert nl.nccl_env(algo=value) == {"NCCL_ALGO": value}


@pytest.mark.parametrize("value", ["LL", "ll128", "Simple", "^LL128", "LL,Simple;allreduce:^LL",
                                   "^LL128;allreduce:LL128"])
def test_nccl_proto_values_nccl_accepts_pass_through(value):
    assert nl.nccl_env(proto=value) == {"NCCL_PROTO": value}


@pytest.mark.parametrize("algo, proto, says", [
    ("rnig", None, "NCCL has no algorithm 'rnig'; it has: Tree, Ring, CollNetDirect"),
    ("ring,bogus", None, "'bogus'"),
    ("allreduce:tree;ring", None, "only the first list may lack"),
    ("scan:ring", None, "NCCL has no collective 'scan'"),
    (None, "LL256", "NCCL has no protocol 'LL256'; it has: LL, LL128, Simple"),
    (None, "allreduce:^LL64", "'LL64'"),
])
def test_nccl_env_refuses_names_nccl_does_not_have(algo, proto, says):
    with pytest.raises(UsageError) as info:
        nl.nccl_env(algo, proto)
    assert says in str(info.value)


def test_nccl_env_refuses_what_an_older_nccl_would_skip_silently():
    assert nl.nccl_env("PAT", version="2.23.4") == {"NCCL_ALGO": "PAT"}
    with pytest.raises(UsageError, match="PAT needs NCCL 2.23; NCCL 2.21 would ignore it"):
        nl.nccl_env("ring,pat", version="2.21.5")
    with pytest.raises(UsageError, match="per-collective lists need NCCL 2.24"):
        nl.nccl_env("allreduce:tree", version="2.23.4")
    assert nl.nccl_env("allreduce:tree", version="2.24.3")
    assert nl.nccl_env(proto="LL128", version="2.18.3") == {"NCCL_PROTO": "LL128"}


def test_nccl_env_of_nothing_leaves_nccl_to_choose():
    assert nl.nccl_env() == {}
    assert nl.nccl_env("ring", "simple") == {"NCCL_ALGO": "ring", "NCCL_PROTO": "simple"}


def test_debug_env_asks_for_info_and_tuning_per_process():
    assert nl.debug_env("/tmp/nccl.%h.%p", environ={}) == {
        "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "TUNING", "NCCL_DEBUG_FILE": "/tmp/nccl.%h.%p"}
    # Every process opens the file: a pattern without %p would be overwritten.
    assert nl.debug_env("/tmp/nccl", environ={})["NCCL_DEBUG_FILE"] == "/tmp/nccl.%h.%p"


def test_debug_env_keeps_what_the_user_asked_for():
    env = nl.debug_env("/tmp/n.%p",
                       environ={"NCCL_DEBUG": "trace", "NCCL_DEBUG_SUBSYS": "INIT,NET"})
    assert env["NCCL_DEBUG"] == "TRACE"
    assert env["NCCL_DEBUG_SUBSYS"] == "INIT,NET,TUNING"
    assert nl.debug_env("/tmp/n.%p", environ={"NCCL_DEBUG": "WARN",
                                              "NCCL_DEBUG_SUBSYS": "^INIT,TUNING"}) == {
        "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "^INIT", "NCCL_DEBUG_FILE": "/tmp/n.%p"}
    everything = nl.debug_env("/tmp/n.%p", environ={"NCCL_DEBUG_SUBSYS": "ALL"})
    assert everything["NCCL_DEBUG_SUBSYS"] == "ALL"
    assert nl.debug_env("/tmp/n.%p", environ={"NCCL_DEBUG_SUBSYS": "tuning"},
                        calls=True)["NCCL_DEBUG_SUBSYS"] == "tuning,COLL"


def test_nccl_2_24_lines_give_names_channels_and_per_rank_bytes():
    got = nl.parse_tuning(lines("2.24"))
    assert [(t.collective, t.nbytes, t.algo, t.proto) for t in got] == [
        ("AllReduce", 8, "Tree", "LL"),
        ("AllReduce", 4194304, "Ring", "Simple"),
        ("AllReduce", 4194304, "Ring", "Simple"),
        ("AllGather", 524288, "NVLS", "Simple"),
        ("ReduceScatter", 524288, "PAT", "Simple"),
        ("Reduce", 65536, "Ring", "LL128"),
        ("Broadcast", 1048576, "Ring", "LL128"),
        ("AllReduce", 268435456, "NVLSTree", "Simple"),
        ("AllReduce", 33554432, "CollNetDirect", "Simple"),
    ]
    assert got[1].channels == (0, 31) and got[1].time_us is None
    assert [t.per_rank for t in got[3:6]] == [True, True, False]


def test_nccl_2_23_lines_map_enum_numbers_to_names():
    got = nl.parse_tuning(lines("2.23"))
    assert [(t.collective, t.nbytes, t.algo, t.proto, t.time_us) for t in got] == [
        ("AllReduce", 1024, "Tree", "LL", 11.2),
        ("AllReduce", 67108864, "Ring", "Simple", 452.75),
        ("AllGather", 4194304, "PAT", "Simple", 40.125),
        ("ReduceScatter", 4194304, "Ring", "LL128", 38.0),
        ("Broadcast", 1048576, "Ring", "LL128", 12.5),
    ]
    assert all(t.channels is None and not t.per_rank for t in got)


def test_nccl_2_20_lines_take_their_collective_from_the_call_lines():
    got = nl.parse_tuning(lines("2.20"))
    # The grouped AllGather and ReduceScatter are told apart by their bytes (bf16 is code 9).
    assert [(t.collective, t.nbytes, t.algo, t.proto, t.time_us) for t in got] == [
        ("AllReduce", 8, "Tree", "LL", 10.4),
        ("AllReduce", 4194304, "Ring", "Simple", 36.0),
        ("AllGather", 4194304, "Ring", "LL128", 31.5),
        ("ReduceScatter", 1048576, "Ring", "Simple", 14.25),
    ]
    bare = nl.parse_tuning(line for line in lines("2.20") if "opCount" not in line)
    assert [t.collective for t in bare] == [None] * 4


def test_the_brief_example_line_and_unknown_tokens():
    [t] = nl.parse_tuning(["host:1:2 [0] NCCL INFO AllReduce: 4194304 Bytes -> Algo RING proto "
                           "SIMPLE channel{Lo..Hi}={0..31}"])
    assert t == nl.Tuning("AllReduce", 4194304, "Ring", "Simple", (0, 31), None, False)
    [u] = nl.parse_tuning(["h:1:1 [0] NCCL INFO 64 Bytes -> Algo 9 proto 7 time 1.0"])
    assert (u.algo, u.proto) == ("9", "7")
    assert nl.parse_tuning(["h:1:1 [0] NCCL WARN nothing", "", "AllReduce | 1.0/2.0 |"]) == []


def test_choice_for_matches_collective_and_whole_buffer_bytes():
    new, old = nl.parse_tuning(lines("2.24")), nl.parse_tuning(lines("2.23"))
    assert nl.choice_for(new, "allreduce", 4194304).algo == "Ring"
    assert nl.choice_for(new, "AllReduce", 8).proto == "LL"
    # 2.24 prints one rank's part of an allgather: the whole 4 MiB over 8 ranks.
    assert nl.choice_for(new, "allgather", 4194304, nranks=8).algo == "NVLS"
    assert nl.choice_for(new, "allgather", 4194304) is None
    assert nl.choice_for(new, "reduce_scatter", 4194304, nranks=8).algo == "PAT"
    assert nl.choice_for(old, "allgather", 4194304, nranks=8).algo == "PAT"
    assert nl.choice_for(new, "broadcast", 1048576, nranks=8).proto == "LL128"
    assert nl.choice_for(new, "allreduce", 12345) is None
    assert nl.choice_for(new, "reduce", 4194304) is None


def test_read_tuning_finds_the_files_nccl_expanded(tmp_path):
    pattern = str(tmp_path / "nccl.%h.%p")
    (tmp_path / "nccl.gpu-node-1.61007").write_text("\n".join(lines("2.24")))
    (tmp_path / "nccl.gpu-node-1.61008").write_text("gpu-node-1:61008:61008 [1] NCCL INFO ok\n")
    (tmp_path / "other.log").write_text("\n".join(lines("2.23")))
    assert len(nl.tuning_files(pattern)) == 2
    assert len(nl.read_tuning(pattern)) == 9
