"""What a real GPU cluster is made of, as NCCL meets it: GPU generations, links, transports.

A :class:`System` is what ``refcoll model --sweep`` prices: ``nodes`` nodes of
``gpus_per_node`` GPUs, the link inside a node (NVLink through NVSwitch, NVLink
without a switch, or PCIe with or without peer-to-peer) and, across nodes,
``nics`` NICs per node of a line rate each, on one of the network
:data:`TRANSPORTS`. Every constant below is a documented property, with its
source beside it: NCCL's own (its topology and tuning code, version named), a
standard's (PCIe, InfiniBand), or a vendor's line rate. Where nothing public
gives a transport's property (a cloud network's per-message latency, its
achievable fraction of line rate), the constant is left at the ideal and the
transport says so (``unknown``): the report prints it, and ``--fit`` learns it
from the user's own measurements (:mod:`refcoll.model.nccl_fit`).

Bandwidths here are per direction, bytes per second; latencies seconds.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace

from ..core.errors import UsageError

__all__ = ["Generation", "GENERATIONS", "Transport", "TRANSPORTS", "INTRA_KINDS", "System",
           "SYSTEM_PRESETS", "system_preset", "PCIE_GBPS", "as_system",
           "GPU_ARCHS", "MAX_GPUS", "MAX_CHANNELS", "MAX_NICS"]

#: The most GPUs (nodes × GPUs per node) the model prices: Rabenseifner's exact
#: counts on a number of ranks that is not a power of two take time quadratic in it.
MAX_GPUS = 16384

#: The most channels: NCCL's ``MAXCHANNELS`` (src/include/device.h, NCCL 2.30).
MAX_CHANNELS = 64

#: The most NICs per node the model takes.
MAX_NICS = 64


@dataclass(frozen=True)
class Generation:
    """A GPU generation's NVLink and what NCCL assumes of it.

    Attributes:
        name: NCCL's name of the compute capability class (volta... blackwell).
        nvlink_links: NVLink links per GPU on the SXM board of that generation.
        nvlink_line: one link's line rate per direction, bytes/s.
        nvlink_achieved: what NCCL's topology takes one link to carry per direction
            (``SM70_NVLINK_BW`` ... ``SM100_NVLINK_BW`` in ``src/graph/topo.h``), bytes/s.
        nvls: NVLink SHARP (multicast and reduction in the NVSwitch) exists, and
            NCCL's ``nvlsEfficiency`` for it (``src/graph/tuning.cc``); 0: none.
        source: where the figures are published.
    """

    name: str
    nvlink_links: int
    nvlink_line: float
    nvlink_achieved: float
    nvls: float
    source: str


#: GPU generations, NCCL 2.2x's constants. Line rates: NVIDIA's datasheets (V100: 6 links
#: of 25 GB/s each way, 300 GB/s both ways in all; A100: 12 links, 600 GB/s; H100 SXM: 18
#: links, 900 GB/s; B200: 18 links of NVLink 5 at 50 GB/s each way, 1.8 TB/s).
GENERATIONS = {
    "volta": Generation("volta", 6, 25e9, 20.0e9, 0.0,
                        "NVIDIA V100 datasheet; NCCL src/graph/topo.h SM70_NVLINK_BW 20.0"),
    "ampere": Generation("ampere", 12, 25e9, 20.0e9, 0.0,
                         "NVIDIA A100 datasheet; NCCL src/graph/topo.h SM80_NVLINK_BW 20.0"),
    "hopper": Generation("hopper", 18, 25e9, 20.6e9, 0.85,
                         "NVIDIA H100 datasheet; NCCL src/graph/topo.h SM90_NVLINK_BW 20.6; "
                         "NCCL src/graph/tuning.cc nvlsEfficiency 0.85 (Hopper)"),
    "blackwell": Generation("blackwell", 18, 50e9, 40.1e9, 0.74,
                            "NVIDIA B200 datasheet; NCCL src/graph/topo.h SM100_NVLINK_BW "
                            "40.1; NCCL src/graph/tuning.cc nvlsEfficiency 0.74 (Blackwell)"),
}

#: The GPU generations by name, oldest first: the columns of NCCL's tuning tables.
GPU_ARCHS = tuple(GENERATIONS)

#: PCIe x16 line rate per direction by generation, after 128b/130b encoding (PCI-SIG:
#: 8, 16, 32 GT/s a lane for Gen3, 4, 5), bytes/s.
PCIE_GBPS = {3: 15.75e9, 4: 31.5e9, 5: 63.0e9}

#: What NCCL takes a PCIe Gen3 x16 link to carry (``PCI_BW 12.0`` in ``src/graph/topo.h``):
#: the fraction of line rate it stands for, applied to every generation.
PCIE_ACHIEVED = 12.0e9 / PCIE_GBPS[3]


@dataclass(frozen=True)
class Transport:
    """A network transport NCCL runs over, and what is public about it.

    Attributes:
        name: the option's word (``--inter-transport``).
        title: what it is.
        efficiency: the fraction of the NICs' line rate a bulk transfer achieves
            (1.0 where NCCL itself takes the port speed as the bandwidth).
        latency: a message's latency beyond NCCL's own network hop latency
            (``hwLat[NET]``, which stands for InfiniBand), seconds.
        gdr: data moves between GPU memory and the NIC directly (GPUDirect RDMA,
            or TCPX/TCPXO's device-memory TCP); without it, through host memory.
        source: where the figures come from.
        unknown: what no public source gives, printed with every prediction.
    """

    name: str
    title: str
    efficiency: float = 1.0
    latency: float = 0.0
    gdr: bool = True
    source: str = ""
    unknown: str = ""


TRANSPORTS = {
    "ib": Transport(
        "ib", "InfiniBand with GPUDirect RDMA",
        source="NCCL src/transport/net_ib.cc takes the port's speed (ibv_query_port) as the "
               "NIC's bandwidth and reports no latency of its own; NCCL's hwLat[NET] is "
               "measured on it"),
    "roce": Transport(
        "roce", "RoCE v2 with GPUDirect RDMA",
        source="the same NCCL IB-verbs transport as InfiniBand (src/transport/net_ib.cc)"),
    "efa": Transport(
        "efa", "AWS Elastic Fabric Adapter (SRD) through the aws-ofi-nccl plugin",
        source="AWS EC2 instance types: p4d 4×100 Gb/s, p5 32×100 Gb/s EFA",
        unknown="EFA's achieved fraction of line rate and its per-message latency through "
                "aws-ofi-nccl are not published; the ideal is priced (fit them: --fit)"),
    "tcp": Transport(
        "tcp", "TCP sockets (NCCL's socket transport), through host memory",
        gdr=False,
        source="NCCL src/transport/net_socket.cc: data is staged in host memory",
        unknown="a socket's achieved bandwidth (threads and sockets per connection) and the "
                "kernel's per-message latency are not published; the ideal is priced "
                "(fit them: --fit)"),
    "tcpx": Transport(
        "tcpx", "Google GPUDirect-TCPX (a3-highgpu: 4×200 Gb/s)",
        source="Google Cloud: A3 High, GPUDirect-TCPX, 4 NICs of 200 Gb/s per VM",
        unknown="TCPX's achieved fraction and per-message latency are not published; the "
                "ideal is priced (fit them: --fit)"),
    "tcpxo": Transport(
        "tcpxo", "Google GPUDirect-TCPXO (a3-megagpu: 8×200 Gb/s)",
        source="Google Cloud: A3 Mega, GPUDirect-TCPXO, 8 NICs of 200 Gb/s per VM",
        unknown="TCPXO's achieved fraction and per-message latency are not published; the "
                "ideal is priced (fit them: --fit)"),
}

#: What joins the GPUs of a node (``--intra-transport``).
INTRA_KINDS = {
    "nvswitch": "NVLink through NVSwitch: every GPU reaches every other at its full NVLink rate",
    "nvlink": "NVLink without a switch (DGX-1's hybrid cube mesh, bridges): a ring's links",
    "pcie": "PCIe: peer-to-peer through the switch (--p2p) or through host memory (--no-p2p)",
}


@dataclass(frozen=True)
class System:
    """A cluster as ``refcoll model --sweep`` prices it.

    Attributes:
        nodes, gpus_per_node: the shape; ranks are ``nodes · gpus_per_node``.
        generation: a key of :data:`GENERATIONS`.
        intra: a key of :data:`INTRA_KINDS`.
        intra_bw: the intra-node link's line rate per GPU and direction (bytes/s);
            ``None``: the generation's NVLink, or the PCIe generation's x16.
        pcie_gen: PCIe generation (3, 4, 5) for ``intra="pcie"`` and the host path.
        p2p: with PCIe, whether GPUs reach each other peer-to-peer (else through
            host memory, NCCL's SHM transport).
        nvls: use NVLink SHARP where the generation and NVSwitch have it.
        nics: NICs per node; nic_bw: each one's line rate per direction (bytes/s).
        transport: a key of :data:`TRANSPORTS`.
        collnet: the network switches reduce (SHARP): NCCL's CollNet.
        channels: NCCL's channels (``None``: as NCCL's topology search finds them).
        intra_alpha, inter_alpha: a message's latency on the intra-node link and on
            the network, as the user describes them (``--intra-latency``,
            ``--inter-latency`` of the step report): a step takes at least that
            long (0: NCCL's own hop latencies alone).
        spine_bw: a node's share of a spine that binds, without rails (bytes/s per
            direction; 0: none binds): the NICs a run uses carry at most that together
            (the step report's ``--no-rail --spine-bw``).
        fitted: constants learnt from measurements (:mod:`refcoll.model.nccl_fit`),
            by name; they replace the described ones.
    """

    nodes: int = 1
    gpus_per_node: int = 8
    generation: str = "hopper"
    intra: str = "nvswitch"
    intra_bw: float | None = None
    pcie_gen: int = 4
    p2p: bool = True
    nvls: bool = True
    nics: int = 0
    nic_bw: float = 0.0
    transport: str = "ib"
    collnet: bool = False
    channels: int | None = None
    intra_alpha: float = 0.0
    inter_alpha: float = 0.0
    spine_bw: float = 0.0
    fitted: dict = field(default_factory=dict)

    def __post_init__(self):
        self._check_types()
        if self.generation not in GENERATIONS:
            raise UsageError(f"unknown GPU generation {self.generation!r}: choose "
                             f"{', '.join(GENERATIONS)}")
        if self.intra not in INTRA_KINDS:
            raise UsageError(f"unknown intra-node link {self.intra!r} (--intra-transport): "
                             f"choose {', '.join(INTRA_KINDS)}")
        if self.transport not in TRANSPORTS:
            raise UsageError(f"unknown network transport {self.transport!r} "
                             f"(--inter-transport): choose {', '.join(TRANSPORTS)}")
        if self.pcie_gen not in PCIE_GBPS:
            raise UsageError(f"PCIe generation {self.pcie_gen}: choose 3, 4 or 5")
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise UsageError("a system has at least one node of at least one GPU")
        if self.nodes > 1 and (self.nics < 1 or self.nic_bw <= 0):
            raise UsageError(f"{self.nodes} nodes need their NICs: give --inter-bw (each NIC's "
                             "line rate) and --nics-per-node")
        if self.ranks > MAX_GPUS:
            raise UsageError(f"{self.nodes} nodes × {self.gpus_per_node} GPUs: give at most "
                             f"{MAX_GPUS:,} GPUs in all (--nodes × --gpus-per-node)")

    def _check_types(self) -> None:
        """Refuse a field of the wrong kind or out of range, naming it (a fit file's
        system, or options, say any of them)."""
        def whole(name, low, high, optional=False):
            value = getattr(self, name)
            if optional and value is None:
                return
            if (isinstance(value, bool) or not isinstance(value, numbers.Integral)
                    or not low <= value <= high):
                raise UsageError(f"{_field(name)} = {value!r}: give a whole number from "
                                 f"{low} to {high}")

        def rate(name, optional=False, zero=False):
            value = getattr(self, name)
            if optional and value is None:
                return
            if (isinstance(value, bool) or not isinstance(value, numbers.Real)
                    or not math.isfinite(value) or value < 0 or (value == 0 and not zero)):
                raise UsageError(f"{_field(name)} = {value!r}: give a finite number "
                                 f"{'>= 0' if zero else '> 0'}")

        whole("nodes", 1, MAX_GPUS)
        whole("gpus_per_node", 1, MAX_GPUS)
        whole("nics", 0, MAX_NICS)
        whole("channels", 1, MAX_CHANNELS, optional=True)
        rate("intra_bw", optional=True)
        rate("nic_bw", zero=True)
        rate("intra_alpha", zero=True)
        rate("inter_alpha", zero=True)
        rate("spine_bw", zero=True)
        for name in ("p2p", "nvls", "collnet"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError(f"{_field(name)} = {getattr(self, name)!r}: give true or "
                                 "false")
        for name in ("generation", "intra", "transport"):
            if not isinstance(getattr(self, name), str):
                raise UsageError(f"{_field(name)} = {getattr(self, name)!r}: give a name")
        if isinstance(self.pcie_gen, bool) or not isinstance(self.pcie_gen, numbers.Integral):
            raise UsageError(f"{_field('pcie_gen')} = {self.pcie_gen!r}: choose 3, 4 or 5")

    @property
    def ranks(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def gen(self) -> Generation:
        return GENERATIONS[self.generation]

    @property
    def net(self) -> Transport:
        return TRANSPORTS[self.transport]

    def with_shape(self, nodes: int, gpus_per_node: int | None = None) -> "System":
        """Return the same system with another node count (and GPUs per node)."""
        return replace(self, nodes=nodes, gpus_per_node=gpus_per_node or self.gpus_per_node)

    # ---------------------------------------------------------------- what it carries

    def intra_line(self) -> float:
        """Return the intra-node link's line rate per GPU and direction, bytes/s: what no
        measurement of it can exceed (:mod:`refcoll.model.nccl_fit` bounds its fit by it)."""
        if self.intra in ("nvswitch", "nvlink"):
            return self.intra_bw or self.gen.nvlink_links * self.gen.nvlink_line
        return self.intra_bw or PCIE_GBPS[self.pcie_gen]

    def intra_rate(self) -> float:
        """Return what one GPU's intra-node link carries per direction in bulk, bytes/s.

        NVLink: the generation's links at NCCL's achieved rate per link (scaled
        from ``intra_bw`` when given). PCIe: the x16 rate at NCCL's achieved
        fraction; through host memory, half of it: each byte crosses the host's
        PCIe root twice, out of one GPU and into the next.
        """
        if "intra_rate" in self.fitted:
            return self.fitted["intra_rate"]
        if self.intra in ("nvswitch", "nvlink"):
            return self.intra_line() * self.gen.nvlink_achieved / self.gen.nvlink_line
        return self.intra_line() * PCIE_ACHIEVED * (1.0 if self.p2p else 0.5)

    def nic_rate(self, used: int | None = None) -> float:
        """Return a node's NICs' bulk rate per direction, all together, bytes/s (``used``:
        of that many of them), at most the node's share of the spine."""
        efficiency = self.fitted.get("nic_efficiency", self.net.efficiency)
        nics = self.nics if used is None else min(used, self.nics)
        rate = nics * self.nic_bw * efficiency
        return min(rate, self.spine_bw * efficiency) if self.spine_bw else rate

    def net_latency(self) -> float:
        """Return a network message's latency beyond NCCL's hop latency, seconds."""
        return self.fitted.get("net_latency", self.net.latency)

    def intra_latency(self) -> float:
        """Return an intra-node step's latency beyond NCCL's hop latency, seconds."""
        return self.fitted.get("intra_latency", 0.0)

    @property
    def has_nvls(self) -> bool:
        """NVLink SHARP: an NVSwitch node of a generation that has it, and asked for."""
        return self.nvls and self.intra == "nvswitch" and self.gen.nvls > 0

    @property
    def nvlink(self) -> bool:
        return self.intra in ("nvswitch", "nvlink")

    def channel_count(self) -> int:
        """Return NCCL's channels: as given, else as its topology search finds them.

        One ring per NIC doubled across nodes (NCCL's search gives a channel per
        NIC and duplicates the rings); inside an NVLink node, one per NVLink link
        (12 on Ampere, 18 on Hopper), at most :data:`MAX_CHANNELS` (NCCL's ``MAXCHANNELS``);
        PCIe, 2.
        """
        if self.channels is not None:
            return self.channels
        if self.nodes > 1:
            return max(2, min(MAX_CHANNELS, 2 * self.nics))
        if self.nvlink:
            return max(2, min(MAX_CHANNELS,
                              self.gen.nvlink_links - self.gen.nvlink_links % 2))
        return 2

    def describe(self) -> str:
        """Return one line: the system as priced."""
        gen = self.gen
        intra = {"nvswitch": f"NVSwitch, NVLink {gen.name}", "nvlink": f"NVLink {gen.name}",
                 "pcie": f"PCIe Gen{self.pcie_gen} " + ("peer-to-peer" if self.p2p
                                                        else "through host memory")}[self.intra]
        text = (f"{self.nodes} node{'s' if self.nodes > 1 else ''} × {self.gpus_per_node} GPUs "
                f"({gen.name}), {intra} at {self.intra_rate() / 1e9:.0f} GB/s per GPU and "
                f"direction")
        if self.has_nvls:
            text += ", NVLS"
        if self.nodes > 1:
            text += (f"; {self.nics} × {self.nic_bw * 8 / 1e9:.0f} Gb/s {self.transport} per "
                     f"node ({self.nic_rate() / 1e9:.0f} GB/s per direction)")
            if self.collnet:
                text += ", CollNet (switches reduce)"
        return text

    def unknowns(self) -> list[str]:
        """Return what the prediction could not express about this system."""
        notes = []
        if self.nodes > 1 and self.net.unknown and not self.fitted:
            notes.append(f"{self.transport}: {self.net.unknown}")
        if self.intra == "pcie" and not self.p2p and not self.fitted:
            notes.append("PCIe through host memory: the host's memory and root-port bandwidth "
                         "is not described; half the PCIe rate is priced (fit it: --fit)")
        return notes


#: The options that set a :class:`System`'s fields, named in its refusals.
_OPTIONS = {"nodes": "--nodes", "gpus_per_node": "--gpus-per-node", "nics": "--nics-per-node",
            "channels": "--channels", "intra_bw": "--intra-bw", "nic_bw": "--inter-bw",
            "intra_alpha": "--intra-latency", "inter_alpha": "--inter-latency", "p2p": "--p2p",
            "nvls": "--nvls", "collnet": "--in-network", "generation": "--gpu-arch",
            "intra": "--intra-transport", "transport": "--inter-transport",
            "pcie_gen": "--pcie-gen", "spine_bw": "--spine-bw"}


def _field(name: str) -> str:
    return f"system field {name} ({_OPTIONS[name]})"


def as_system(cluster) -> System:
    """Return the :class:`System` of a step report's :class:`~refcoll.model.cluster.Cluster`:
    NVSwitch nodes of its GPU generation, its NICs on InfiniBand (together at most the
    node's share of the spine without rails), its links' line rates and latencies, and its channels
    (one per NIC unless given, as the step report's own schedules take them)."""
    nodes = cluster.nodes
    nic_bw = 1.0 / cluster.nic_beta() if nodes > 1 else 0.0
    spine_bw = 1.0 / cluster.spine_beta() if nodes > 1 and cluster.spine_beta() else 0.0
    return System(nodes=nodes, gpus_per_node=cluster.gpus_per_node,
                  generation=cluster.gpu_arch, intra="nvswitch",
                  intra_bw=1.0 / cluster.link("intra")[1],
                  nics=cluster.nic_count if nodes > 1 else 0, nic_bw=nic_bw,
                  collnet=cluster.in_network, channels=cluster.channel_count,
                  intra_alpha=cluster.intra_latency, inter_alpha=cluster.inter_latency,
                  spine_bw=spine_bw)


def _gbit(n: float) -> float:
    return n * 1e9 / 8


#: Common systems (``--preset``), as their makers describe them.
SYSTEM_PRESETS = {
    "dgx-a100": dict(gpus_per_node=8, generation="ampere", intra="nvswitch", nics=8,
                     nic_bw=_gbit(200), transport="ib"),
    "dgx-h100": dict(gpus_per_node=8, generation="hopper", intra="nvswitch", nics=8,
                     nic_bw=_gbit(400), transport="ib"),
    "dgx-b200": dict(gpus_per_node=8, generation="blackwell", intra="nvswitch", nics=8,
                     nic_bw=_gbit(400), transport="ib"),
    "p4d": dict(gpus_per_node=8, generation="ampere", intra="nvswitch", nics=4,
                nic_bw=_gbit(100), transport="efa"),
    "p5": dict(gpus_per_node=8, generation="hopper", intra="nvswitch", nics=32,
               nic_bw=_gbit(100), transport="efa"),
    "a3-high": dict(gpus_per_node=8, generation="hopper", intra="nvswitch", nics=4,
                    nic_bw=_gbit(200), transport="tcpx"),
    "a3-mega": dict(gpus_per_node=8, generation="hopper", intra="nvswitch", nics=8,
                    nic_bw=_gbit(200), transport="tcpxo"),
    "nd-a100-v4": dict(gpus_per_node=8, generation="ampere", intra="nvswitch", nics=8,
                       nic_bw=_gbit(200), transport="ib"),
    "nd-h100-v5": dict(gpus_per_node=8, generation="hopper", intra="nvswitch", nics=8,
                       nic_bw=_gbit(400), transport="ib"),
    "pcie-no-p2p": dict(gpus_per_node=2, generation="ampere", intra="pcie", p2p=False,
                        pcie_gen=4),
}


def system_preset(name: str) -> dict:
    """Return the preset ``name``'s fields; an unknown one is a UsageError."""
    if name not in SYSTEM_PRESETS:
        raise UsageError(f"unknown system preset {name!r}: choose "
                         f"{', '.join(sorted(SYSTEM_PRESETS))}")
    return dict(SYSTEM_PRESETS[name])
