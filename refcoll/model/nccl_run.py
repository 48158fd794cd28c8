"""What NCCL runs for an all-reduce on a real system, and how long it takes.

NCCL times each algorithm × protocol with ``latency + bytes / bandwidth`` and
runs the least (``ncclTopoGetAlgoTime``, ``src/graph/tuning.cc``). This module
keeps that form and NCCL's constants for what belongs to NCCL's kernels (its
per-hop latencies, protocol costs, per-channel limits and corrections: the
``ncclTunerConstantsDefaults`` of :mod:`refcoll.model.nccl`), but feeds it the
system's own links (:class:`~refcoll.model.systems.System`): the bytes each
algorithm puts on the NVLink, PCIe or network link it is limited by, at what
that link carries, and each transport's latency. So the pick and the price are
one model, and the algorithms NCCL's graph search decides among are all here:

* **Ring**: ``2(p-1)`` steps; every GPU sends ``2(p-1)/p`` of the buffer, and
  each node sends as much through its NICs (each ring leaves a node once).
* **Tree**: NCCL's chain inside a node and double binary tree across nodes. A
  node that is inner in one tree and a leaf in the other sends twice the
  buffer over its NICs; with two nodes, each is the root of one tree and a leaf
  of the other, so it sends the buffer once: the 2-node tree moves half the
  ring's network bytes.
* **NVLS** (one node, NVSwitch with NVLink SHARP, Hopper and later): the switch
  reduces and multicasts; every GPU sends and receives the buffer about once
  (``(p+1)/p`` of it), at NCCL's ``nvlsEfficiency`` of its NVLink rate.
* **NVLSTree** (more nodes): NVLS inside each node, NCCL's tree of nodes across.
  Both only where the switch reduces the type and op (:func:`nvls_reduces`: a
  sum of any 16-, 32- or 64-bit type, min and max of the 16-bit floats and the
  integers; never 8-bit types, products or averages).
* **CollNet** (``collnet``: the network switches reduce, SHARP): each node
  sends the buffer to the switch once and receives the result once.

Protocols: LL carries 8 bytes a line of which 4 are data (half the bandwidth,
least latency); LL128 120 bytes of every 128 (on NVLink only, as NCCL enables
it); Simple all of it, with the most latency. Times are nccl-tests' (one
all-reduce, out of place): ``algbw = bytes / time``, ``busbw = algbw · 2(p-1)/p``.
Spec: spec/model.md
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .nccl import (
    _BASE_LAT,
    _LL_MAX_BW_INTEL,
    _LL_MAX_BW_ONE_NODE,
    _NET_LAT,
    _NET_OVERHEAD,
    _NVLINK_LAT,
    _PER_CH_MAX_RING_LL128,
    _PER_CH_MAX_TREE,
    _PER_CH_MAX_TREE_LL128,
    _TREE_CORRECTION,
    NCCL_VERSION,
    PROTOCOLS,
)
from .systems import System

__all__ = ["NCCL_ALGORITHMS", "NCCL_VERSION", "Run", "runs", "nccl_pick", "predict",
           "busbw_factor", "used_channels", "nvls_reduces"]

#: What NVLink SHARP reduces: each nccl-tests type's ops (NCCL's ``ncclNvlsSupported``,
#: ``src/include/device.h``, NVIDIA/nccl v2.30.7): sums of the 16-bit floats, the 32- and
#: 64-bit integers and floats; min and max but of float and double; nothing of 8 bits.
#: (``avg`` is NCCL's PreMulSum or SumPostDiv and ``mulsum`` a PreMulSum: not a Sum.)
_NVLS_OPS = {**dict.fromkeys(("int32", "uint32", "int64", "uint64", "half", "bfloat16"),
                             ("sum", "min", "max")),
             "float": ("sum",), "double": ("sum",)}


def nvls_reduces(dtype: str, op: str) -> bool:
    """Return whether NVLS (and NVLSTree) can run an all-reduce of nccl-tests' ``dtype``
    and ``op``: NCCL falls back to its other algorithms for the rest."""
    return op in _NVLS_OPS.get(dtype, ())


#: The algorithms NCCL may run for an all-reduce, in its order.
NCCL_ALGORITHMS = ("Tree", "Ring", "CollNet", "NVLS", "NVLSTree")

#: hwLat[PCI] per protocol (NCCL's ncclTunerConstantsDefaults, the version above), µs.
_PCI_LAT = {"Tree": (1.0, 1.9, 4.0), "Ring": (1.0, 2.5, 5.7)}
#: NVLS and NVLSTree: hwLat[NVLINK] of Simple (µs); their base latency is 0.
_NVLS_NVLINK_LAT = 25.0
#: hwLat[NET] of Simple for NVLS (more than one node), NVLSTree and CollNetDirect, µs.
_NVLS_NET_LAT, _NVLSTREE_NET_LAT, _COLLNET_NET_LAT = 18.0, 20.9, 31.0
#: CollNetDirect's hwLat[NVLINK] of Simple and NCCL's per-local-rank term, µs.
_COLLNET_NVLINK_LAT, _COLLNET_PER_RANK = 3.7, 0.4
#: NCCL's bandwidth factors: Tree and CollNet busBw ×0.92 and ×0.9; LL128 ×0.92 on a ring.
_TREE_FACTOR, _COLLNET_FACTOR, _LL128_FACTOR = 0.92, 0.9, 0.92
#: NCCL's ring plateau (ncclTopoGetAlgoTime): Ring/Simple's latency ×1.4 on more than one
#: node once a channel's share per rank reaches 64 B (×1.9 before Ampere).
_PLATEAU = (1.9, 1.4)

_ARCHS = ("volta", "ampere", "hopper", "blackwell")


@dataclass(frozen=True)
class Run:
    """One way NCCL can run the all-reduce, priced.

    Attributes:
        algorithm, protocol: NCCL's names (``Ring``, ``LL128``...).
        channels: the channels it runs on.
        latency: seconds before the first byte's worth of bandwidth counts.
        algbw: bytes of the buffer per second once it streams.
        seconds: the time of one all-reduce of ``nbytes``.
        limit: the link that bounds the bandwidth (``nvlink``, ``pcie``,
            ``network``, ``protocol``).
        tuned: the time NCCL's tuning compares when it picks: the same run on every
            channel (it drops channels for a small buffer only once it has picked).
    """

    algorithm: str
    protocol: str
    channels: int
    latency: float
    algbw: float
    seconds: float
    limit: str
    tuned: float

    @property
    def name(self) -> str:
        return f"{self.algorithm}/{self.protocol}"


def busbw_factor(ranks: int) -> float:
    """Return nccl-tests' all-reduce bus bandwidth factor, ``2(p-1)/p``."""
    return 2.0 * (ranks - 1) / ranks if ranks > 1 else 1.0


def _log2i(x: int) -> int:
    return max(x, 1).bit_length() - 1


def _ll_max(system: System, arch: int) -> float:
    column = min(system.nodes - 1, 2)
    return 1e9 * (_LL_MAX_BW_ONE_NODE[arch] if system.nodes == 1 else _LL_MAX_BW_INTEL[column])


def _hop(system: System, algorithm: str, proto: int) -> tuple[float, float]:
    """Return an intra-node and an inter-node step's latency, seconds."""
    table = _NVLINK_LAT if system.nvlink else _PCI_LAT
    intra = table[algorithm][proto]
    if system.nodes > 1 and algorithm == "Ring":
        intra = max(intra, _NET_OVERHEAD * (3 if proto == 2 else 1))
    inter = _NET_LAT["Tree" if system.gpus_per_node == 1 else algorithm][proto]
    return (max(1e-6 * intra, system.intra_alpha) + system.intra_latency(),
            max(1e-6 * inter, system.inter_alpha) + system.net_latency())


#: The data in each byte a protocol puts on the wire: LL's 8-byte lines carry 4, LL128's
#: 128-byte lines 120 (NCCL's ``src/device/prims_ll*.h``), Simple all of it.
_WIRE = (0.5, 120.0 / 128.0, 1.0)


def _net_rate(system: System, channels: int) -> float:
    """Return what a node's NICs carry for a run on ``channels`` channels: each channel
    crosses on one NIC (NCCL gives each ring a NIC), so fewer channels leave NICs idle."""
    return system.nic_rate(used=channels)


def _intra(system: System) -> tuple[float, str]:
    """Return the intra-node links' rate and name: none with one GPU a node (no hop
    inside a node, so only the network bounds the run)."""
    if system.gpus_per_node == 1:
        return math.inf, "network"
    return system.intra_rate(), ("nvlink" if system.nvlink else "pcie")


def _tree_net_factor(nodes: int) -> float:
    """Return the buffers a node sends over its NICs in NCCL's double binary tree."""
    return 1.0 if nodes == 2 else 2.0


def _ring(system: System, proto: int, channels: int, arch: int, nbytes: int) -> Run | None:
    p, n = system.ranks, system.nodes
    bus, limit = _intra(system)
    if n > 1 and _net_rate(system, channels) < bus:
        bus, limit = _net_rate(system, channels), "network"
    if proto == 0:
        bus, limit = (bus * 0.5, limit) if bus * 0.5 < _ll_max(system, arch) else (
            _ll_max(system, arch), "protocol")
    elif proto == 1:
        cap = channels * 1e9 * _PER_CH_MAX_RING_LL128[arch][min(n - 1, 2)]
        bus, limit = (bus * _LL128_FACTOR, limit) if bus * _LL128_FACTOR < cap else (
            cap, "protocol")
    intra, inter = _hop(system, "Ring", proto)
    steps, inter_steps = 2 * (p - 1), 2 * (n - 1)
    lat = 1e-6 * _BASE_LAT["Ring"][proto] + (steps - inter_steps) * intra + inter_steps * inter
    if proto == 2 and n > 1 and nbytes // (channels * p) >= 64:
        lat *= _PLATEAU[0 if arch == 0 else 1]
    return _run("Ring", proto, channels, lat, bus / busbw_factor(p), nbytes, limit, p)


def _tree(system: System, proto: int, channels: int, arch: int, nbytes: int) -> Run | None:
    n, g = system.nodes, system.gpus_per_node
    column = min(n - 1, 2)
    rate, limit = _intra(system)
    bus = min(rate * _TREE_FACTOR, channels * 1e9 * _PER_CH_MAX_TREE[arch][column])
    if proto == 0:
        bus = min(bus / 3.8, _ll_max(system, arch))
        limit = "protocol"
    elif proto == 1:
        bus = min(bus * (7.0 / 9.0 if n == 1 else 120.0 / 128.0),
                  channels * 1e9 * _PER_CH_MAX_TREE_LL128[arch][column])
    algbw = bus * 0.5
    net = _net_rate(system, channels) * _WIRE[proto] / _tree_net_factor(n)
    if n > 1 and net < algbw:  # the protocol's lines cross the network too
        algbw, limit = net, "network"
    log_size = _log2i(nbytes >> 6) if nbytes >> 6 else -1
    if 0 <= log_size < len(_TREE_CORRECTION[proto]):
        algbw *= _TREE_CORRECTION[proto][log_size]
    intra, inter = _hop(system, "Tree", proto)
    lat = 1e-6 * _BASE_LAT["Tree"][proto] + 2 * ((g - 1) * intra + _log2i(n) * inter)
    return _run("Tree", proto, channels, lat, algbw, nbytes, limit, system.ranks)


def _nvls_rate(system: System, channels: int, per_node: int) -> float:
    """Return NVLS's algorithm bandwidth inside a node: each GPU sends and receives
    ``(g+1)/g`` of the buffer, at nvlsEfficiency of its NVLink rate on ``(C-1)/C`` of the
    channels (NCCL keeps one for the switch's multicast)."""
    share = (channels - 1) / channels  # one channel: none left for the data, no NVLS
    return system.intra_rate() * system.gen.nvls * share * per_node / (per_node + 1)


def _nvls(system: System, channels: int, nbytes: int) -> Run | None:
    if not system.has_nvls or system.nodes > 1:
        return None
    lat = max(1e-6 * _NVLS_NVLINK_LAT, 2 * system.intra_alpha) + system.intra_latency()
    return _run("NVLS", 2, channels, lat, _nvls_rate(system, channels, system.ranks), nbytes,
                "nvlink", system.ranks)


def _nvls_tree(system: System, channels: int, nbytes: int) -> Run | None:
    n = system.nodes
    if not system.has_nvls or n == 1:
        return None
    algbw, limit = _nvls_rate(system, channels, system.gpus_per_node), "nvlink"
    net = _net_rate(system, channels) / _tree_net_factor(n)
    if net < algbw:
        algbw, limit = net, "network"
    lat = (max(1e-6 * _NVLS_NVLINK_LAT, 2 * system.intra_alpha) + system.intra_latency()
           + 2 * _log2i(n) * (max(1e-6 * _NVLSTREE_NET_LAT, system.inter_alpha)
                              + system.net_latency()))
    return _run("NVLSTree", 2, channels, lat, algbw, nbytes, limit, system.ranks)


def _collnet(system: System, channels: int, nbytes: int) -> Run | None:
    if not system.collnet or system.nodes == 1:
        return None
    g = system.gpus_per_node
    rate, limit = _intra(system)
    algbw = rate * _COLLNET_FACTOR
    if _net_rate(system, channels) * _COLLNET_FACTOR < algbw:
        algbw, limit = _net_rate(system, channels) * _COLLNET_FACTOR, "network"
    lat = (2 * min(1, g - 1) * max(1e-6 * _COLLNET_NVLINK_LAT, system.intra_alpha)
           + 1e-6 * (2 * (g - 1) * _COLLNET_PER_RANK)
           + max(1e-6 * _COLLNET_NET_LAT, 2 * system.inter_alpha) + system.net_latency())
    return _run("CollNet", 2, channels, lat, algbw, nbytes, limit, system.ranks)


#: A channel's buffer per protocol, bytes of data (NCCL's defaults: ``NCCL_BUFFSIZE`` 4 MiB
#: for Simple; LL's 8 lines × 512 threads × 8 steps × 16 B, half of it flags; LL128's 120
#: elements × 640 threads × 8 steps × 8 B, 120 of each 128 bytes data).
_BUFFER = (8 * 512 * 8 * 16 // 2, 120 * 640 * 8 * 8 * 120 // 128, 4 << 20)


def _fill(proto: int, channels: int, algbw: float, nbytes: int) -> float:
    """Return the time NCCL's pipeline takes to fill: each channel streams through a buffer
    of ``_BUFFER`` bytes, ``NCCL_STEPS`` steps deep, sent on one side and drained on the
    other, so until the buffers are full a run pays half a buffer's worth of bandwidth per
    channel, on what the buffers hold."""
    return 0.5 * min(nbytes, channels * _BUFFER[proto]) / algbw


#: NCCL's threads per channel block by protocol (``NCCL_LL_MAX_NTHREADS``,
#: ``NCCL_LL128_MAX_NTHREADS``, ``NCCL_SIMPLE_MAX_NTHREADS``: src/include/device.h) and
#: the bytes each thread must have before another channel is used
#: (``NCCL_*_THREAD_THRESHOLD``, src/include/comm.h; a ring's LL threshold is times the
#: ranks, src/graph/tuning.cc).
_THREADS, _THREAD_THRESHOLD = (512, 640, 512), (8, 8, 64)


def used_channels(algorithm: str, proto: int, channels: int, ranks: int, nbytes: int) -> int:
    """Return the channels NCCL launches a Ring or Tree on for ``nbytes``: it drops one at a
    time while the buffer is less than ``channels × threads × threshold`` bytes
    (``topoGetAlgoInfo``, src/enqueue.cc), so a small buffer runs on fewer channels, each
    at its own share of the link."""
    if algorithm not in ("Ring", "Tree"):
        return channels
    threshold = _THREAD_THRESHOLD[proto] * (ranks if algorithm == "Ring" and proto == 0 else 1)
    per_channel = _THREADS[proto] * threshold
    return max(1, min(channels, nbytes // per_channel))


def _run(algorithm, proto, channels, latency, algbw, nbytes, limit, ranks: int) -> Run | None:
    if algbw <= 0:
        return None
    tuned = latency + nbytes / algbw + _fill(proto, channels, algbw, nbytes)
    used = used_channels(algorithm, proto, channels, ranks, nbytes)
    algbw = algbw * used / channels
    return Run(algorithm, PROTOCOLS[proto], used, latency, algbw,
               latency + nbytes / algbw + _fill(proto, used, algbw, nbytes), limit, tuned)


def runs(system: System, nbytes: int, dtype: str = "float", op: str = "sum") -> list[Run]:
    """Return every algorithm × protocol NCCL could run for ``nbytes`` of nccl-tests'
    ``dtype`` reduced by ``op``, priced."""
    if system.ranks < 2:
        return []
    arch = _ARCHS.index(system.generation)
    channels = system.channel_count()
    out = []
    for proto in range(3):
        if proto == 1 and not system.nvlink:
            continue  # NCCL enables LL128 only over NVLink
        out.append(_ring(system, proto, channels, arch, nbytes))
        out.append(_tree(system, proto, channels, arch, nbytes))
    out.append(_collnet(system, channels, nbytes))
    if nvls_reduces(dtype, op):
        out += [_nvls(system, channels, nbytes), _nvls_tree(system, channels, nbytes)]
    return [r for r in out if r is not None]


def nccl_pick(system: System, nbytes: int, algorithms=None, *, dtype: str = "float",
              op: str = "sum") -> Run | None:
    """Return what NCCL runs: the least time among ``algorithms`` (default: all NCCL has),
    as its tuning compares them (:attr:`Run.tuned`)."""
    choices = [r for r in runs(system, nbytes, dtype, op)
               if algorithms is None or r.algorithm.lower() in algorithms]
    return min(choices, key=lambda r: r.tuned) if choices else None


def predict(system: System, nbytes: int, algorithm: str | None = None, *,
            dtype: str = "float", op: str = "sum") -> Run | None:
    """Return the run priced for ``nbytes`` of ``dtype`` reduced by ``op`` (nccl-tests'
    names): NCCL's pick, or the fastest protocol of ``algorithm`` (an NCCL algorithm's
    name, any case; ``Ring/LL128`` fixes the protocol)."""
    if algorithm is None:
        return nccl_pick(system, nbytes, dtype=dtype, op=op)
    name, _, proto = algorithm.partition("/")
    choices = [r for r in runs(system, nbytes, dtype, op) if r.algorithm.lower() == name.lower()
               and (not proto or r.protocol.lower() == proto.lower())]
    return min(choices, key=lambda r: r.tuned) if choices else None
