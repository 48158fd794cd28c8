"""NCCL's own tuning model: ``time = latency + bytes / bandwidth`` per algorithm and protocol.

NCCL picks an all-reduce's algorithm and protocol by predicting each one's
time and taking the least (``ncclTopoTuneModel`` and ``ncclTopoGetAlgoTime``
in ``src/graph/tuning.cc``; the constants below are NCCL 2.30.7's
``ncclTunerConstantsDefaults``, unchanged in substance since 2.23, which added
PAT). This module follows that model with its constants, in its units
(latencies in µs, bandwidths in GB/s), for the algorithms an all-reduce can
use without NVLink SHARP or CollNet: Ring and Tree, each with the LL, LL128
and Simple protocols.

* Bandwidth: ``busBw = channels · bw``, ``bw`` a channel's speed. NCCL's graph
  search finds it (``bwIntra = bwInter``, limited by the channel's slowest
  link); here it is the channel's bandwidth in this model
  (:meth:`~refcoll.model.cluster.Cluster.channel_link`). Then NCCL's
  refinements: Ring/LL ``min(llMaxBw, busBw/2)``; Ring/LL128
  ``min(0.92·busBw, channels·perChMaxRingLL128Bw)``; Tree
  ``min(0.92·busBw, channels·perChMaxTreeBw)``, then Tree/LL ``min(busBw/3.8,
  llMaxBw)`` and Tree/LL128 ``min(busBw·(7/9 on one node, else 120/128),
  channels·perChMaxTreeLL128Bw)``. The algorithm bandwidth is
  ``busBw·p/(2(p-1))`` for Ring, ``busBw/2`` for Tree, and Tree's is scaled by
  NCCL's ``treeCorrectionFactor`` for sizes of 64 B to 256 MB.
* Latency: ``baseLat[algorithm][protocol]`` plus, for Ring,
  ``(2(p-1) - 2(m-1))·intraLat + 2(m-1)·interLat`` with ``intraLat`` at least
  the network's post overhead (1 µs, 3 µs for Simple, on more than one node),
  and for Tree ``2·((g-1)·intraLat + ⌊lg m⌋·interLat)``; ``intraLat`` and
  ``interLat`` are ``hwLat`` of NVLink and of the network. Ring/Simple on more
  than one node pays its latency 1.4× (1.9× before Ampere) once a channel's
  share per rank reaches 64 B.

Assumptions where NCCL asks the machine: intra-node links are NVLink; the
CPUs are Intel x86 (``llMaxBw``'s column and a 1 µs post overhead); the
network reports no latency of its own (``latencyInter = 0``, as NCCL's IB
transport does); LL128 is enabled (Hopper over NVLink and PXN); the tree
pattern is balanced. Spec: spec/model.md
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .systems import GPU_ARCHS

__all__ = ["PROTOCOLS", "NCCL_VERSION", "PRICED_AS", "NcclTime", "nccl_times", "nccl_choice"]

#: The release whose src/graph/tuning.cc the constants are read from.
NCCL_VERSION = "2.30.7"

#: NCCL's protocols, in its order (NCCL_PROTO_LL, NCCL_PROTO_LL128, NCCL_PROTO_SIMPLE).
PROTOCOLS = ("LL", "LL128", "Simple")

#: baseLatencies, µs, per protocol.
_BASE_LAT = {"Tree": (6.8, 14.0, 8.4), "Ring": (6.6, 14.0, 8.4)}

#: hwLatencies, µs, per protocol: NVLink (NCCL_HW_NVLINK) and network (NCCL_HW_NET).
_NVLINK_LAT = {"Tree": (0.6, 1.25, 4.0), "Ring": (0.6, 1.9, 3.4)}
_NET_LAT = {"Tree": (5.0, 8.5, 14.0), "Ring": (2.7, 4.0, 14.0)}

#: Per GPU generation (Volta, Ampere, Hopper, Blackwell), columns 1 node, 2 nodes, more.
_LL_MAX_BW_ONE_NODE = (39.0, 87.7, 141.0, 282.0)  # llMaxBws[compCap][0]
_LL_MAX_BW_INTEL = (39.0, 39.0, 20.4)  # llMaxBws[0]: more than one node, Intel CPUs
_PER_CH_MAX_RING_LL128 = ((20.0,) * 3, (20.0,) * 3, (36.7,) * 3, (40.0,) * 3)
_PER_CH_MAX_TREE_LL128 = ((20.0, 20.0, 20.0), (20.0, 20.0, 20.0), (36.7, 36.7, 29.0),
                          (55.6, 31.67, 20.0))
_PER_CH_MAX_TREE = ((26.5, 18.5, 10.0), (24.0, 23.6, 17.8), (38.7, 41.4, 36.0),
                    (70.0, 42.8, 24.0))

#: treeCorrectionFactor per protocol, for sizes 64 B · 2^i, i = 0..23.
_TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0,
     1.0, 1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9,
     1.0, 1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9,
     .9),
)

#: Network post overhead, µs (getNetOverhead: Intel x86), tripled for Simple.
_NET_OVERHEAD = 1.0

#: How this model prices what NCCL picks: its algorithm -> the channelled collective.
PRICED_AS = {"Ring": "ring/ch", "Tree": "dbtree/ch"}


@dataclass(frozen=True)
class NcclTime:
    """NCCL's predicted time of one all-reduce with one algorithm and protocol."""

    algorithm: str
    protocol: str
    latency: float  # seconds
    bandwidth: float  # algorithm bandwidth, bytes/s
    seconds: float

    @property
    def name(self) -> str:
        """Return ``Ring/Simple``, as NCCL's TUNING lines name it."""
        return f"{self.algorithm}/{self.protocol}"


def _log2i(x: int) -> int:
    return x.bit_length() - 1


def _bus_bandwidth(algorithm: str, proto: int, channels: int, bw: float, nodes: int,
                   arch: int) -> float:
    column = min(nodes - 1, 2)
    ll_max = _LL_MAX_BW_ONE_NODE[arch] if nodes == 1 else _LL_MAX_BW_INTEL[column]
    bus = channels * bw
    if algorithm == "Ring":
        if proto == 0:
            bus = min(ll_max, bus * 0.5)
        elif proto == 1:
            bus = min(bus * 0.92, channels * _PER_CH_MAX_RING_LL128[arch][column])
        return bus
    bus = min(bus * 0.92, channels * _PER_CH_MAX_TREE[arch][column])
    if proto == 0:
        bus = min(bus / 3.8, ll_max)
    elif proto == 1:
        bus = min(bus * (7.0 / 9.0 if nodes == 1 else 120.0 / 128.0),
                  channels * _PER_CH_MAX_TREE_LL128[arch][column])
    return bus


def _latency(algorithm: str, proto: int, ranks: int, nodes: int) -> float:
    per_node = ranks // nodes
    intra = _NVLINK_LAT[algorithm][proto]
    inter = _NET_LAT["Tree" if per_node == 1 else algorithm][proto]  # one GPU a node: Tree's
    lat = _BASE_LAT[algorithm][proto]
    if algorithm == "Ring":
        if nodes > 1:
            intra = max(intra, _NET_OVERHEAD * (3 if proto == 2 else 1))
        steps, inter_steps = 2 * (ranks - 1), (2 * (nodes - 1) if nodes > 1 else 0)
        return lat + (steps - inter_steps) * intra + inter_steps * inter
    return lat + 2 * ((per_node - 1) * intra + _log2i(nodes) * inter)


def nccl_times(cluster, nbytes: int) -> tuple[NcclTime, ...]:
    """Return NCCL's predicted all-reduce times of ``nbytes`` on ``cluster``, each algorithm
    and protocol (nothing on one GPU: NCCL does not tune a single rank)."""
    ranks, nodes, channels = cluster.gpus, cluster.nodes, cluster.channel_count
    if ranks < 2:
        return ()
    arch = GPU_ARCHS.index(cluster.gpu_arch)
    bw = 1.0 / cluster.channel_link("slowest")[1] / 1e9  # a channel's speed, GB/s
    log_size = _log2i(nbytes >> 6) if nbytes >> 6 else -1
    out = []
    for algorithm in ("Tree", "Ring"):
        for proto, protocol in enumerate(PROTOCOLS):
            bus = _bus_bandwidth(algorithm, proto, channels, bw, nodes, arch)
            algbw = bus * ranks / (2 * (ranks - 1)) if algorithm == "Ring" else bus * 0.5
            if algorithm == "Tree" and 0 <= log_size < 23:
                algbw *= _TREE_CORRECTION[proto][log_size]
            lat = _latency(algorithm, proto, ranks, nodes)
            if (algorithm == "Ring" and proto == 2 and nodes > 1
                    and nbytes // (channels * ranks) >= 64):
                lat *= 1.9 if arch == 0 else 1.4  # the ring's plateau
            seconds = lat * 1e-6 + (nbytes / (algbw * 1e9) if algbw > 0 else math.inf)
            out.append(NcclTime(algorithm, protocol, lat * 1e-6, algbw * 1e9, seconds))
    return tuple(out)


def nccl_choice(cluster, nbytes: int) -> NcclTime | None:
    """Return what NCCL's tuning picks for an all-reduce of ``nbytes``: the least time."""
    times = nccl_times(cluster, nbytes)
    return min(times, key=lambda t: t.seconds) if times else None
