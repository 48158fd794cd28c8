"""What the cluster model prices: the machine, the workload, the options, and the buckets.

**The cluster** (:class:`Cluster`): ``nodes`` nodes of ``g = gpus_per_node``
GPUs, ``p = nodes·g`` ranks, node-major (GPU ``j`` of node ``i`` is rank
``i·g + j``). Every GPU has an intra-node link (NVLink, PCIe); each node has
``nics`` NICs (one per GPU unless said), each with a bandwidth, a latency, and a flag
saying how the bandwidth was quoted: a *unidirectional* figure ``B`` is what
one direction carries; a *bidirectional* figure ``B`` (how NVLink is usually
quoted) is ``B/2`` each way. Every algorithm sends and receives at once on a
link (a ring step, a halving or doubling exchange, a switch's reduce and
multicast), so the per-direction figure is the one that counts:
``β = 1 / B_per_direction``.

**NICs, channels and rails.** NCCL runs a collective as ``channels`` copies
at once, each on ``1/channels`` of the data, each crossing a node boundary
on its own NIC (NCCL's topology search gives one channel per NIC, the default
here). With *rail-optimised placement* (``rail``, the default; DGX SuperPOD's
layout) NIC ``j`` of every node sits on rail ``j``, so the channels' and the
GPUs' cross-node traffic never leaves its rail; without it, cross-node
traffic goes through the spine, which gives each node ``spine_bw`` (default:
its NICs' total, a non-blocking fabric). The :meth:`Cluster.link` ``inter``
figure is one GPU's share when every GPU of a node crosses at once (``nics``
NICs for ``g`` GPUs); :meth:`Cluster.channel_link` is one channel's.

:class:`Workload` is the gradient and the compute around it, :class:`Options`
what to try. The algorithms the model prices are the registry's, each through
its own record (``price``, ``across_nodes``, ``needs_in_network``):
:data:`ALGORITHMS` and :data:`INTER_ALGORITHMS` are read from it, in registry
order.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .. import algorithms
from ..algorithms.registry import NodeShape
from ..compressors.patterns import PATTERNS as _PATTERN_FUNCTIONS
from ..core.errors import UsageError
from ..core.reading import loads_json
from .buckets import MAX_BUCKETS, bucket_limit, buckets_for_size, buckets_of, check_buckets
from .channels import CHANNELLED
from .systems import GPU_ARCHS, MAX_CHANNELS, MAX_GPUS, MAX_NICS

__all__ = [
    "ALGORITHMS",
    "MODELLED",
    "INTER_ALGORITHMS",
    "MAX_GPUS",
    "MAX_BUCKETS",
    "MAX_CHANNELS",
    "MAX_NICS",
    "GPU_ARCHS",
    "PATTERNS",
    "Cluster",
    "Workload",
    "Options",
    "select_algorithms",
    "choices_text",
    "load_layers",
    "bucket_limit",
    "check_buckets",
    "buckets_for_size",
    "buckets_of",
]

#: The all-reduce algorithms the cluster model prices (those whose record has ``price``).
ALGORITHMS = tuple(a.name for a in algorithms.REGISTRY.values() if a.price is not None)

#: Everything ``--algorithm`` takes: the registry's schedules as refcoll runs them, then the
#: channelled collectives of :mod:`~refcoll.model.channels` (NCCL's ring and tree).
MODELLED = ALGORITHMS + tuple(CHANNELLED)

#: What the hierarchical all-reduce may run across nodes (records with ``across_nodes``).
INTER_ALGORITHMS = tuple(a.name for a in algorithms.REGISTRY.values()
                         if a.price is not None and a.across_nodes)


#: The compressed collective patterns (``--pattern``), those of ``refcoll.compressors.patterns``.
PATTERNS = tuple(_PATTERN_FUNCTIONS)

#: GPU generations whose constants NCCL's tuning model has (:mod:`.nccl`).

_FLOAT_DTYPES = {2: np.float16, 4: np.float32, 8: np.float64}


def _in_network_only(name: str) -> bool:
    return name not in CHANNELLED and algorithms.get(name).needs_in_network


# ------------------------------------------------------------------------------ cluster

@dataclass(frozen=True)
class Cluster:
    """The machine: nodes of GPUs, their two kinds of link, and in-network reduction.

    Attributes:
        nodes: number of nodes.
        gpus_per_node: GPUs (ranks) per node, ``g``.
        intra_bw: intra-node bandwidth per GPU, bytes/s, as quoted.
        inter_bw: inter-node bandwidth per GPU (its NIC), bytes/s, as quoted.
        intra_latency: seconds per intra-node message (α).
        inter_latency: seconds per inter-node message (α).
        intra_bidirectional: whether ``intra_bw`` counts both directions together
            (then each direction carries half of it).
        inter_bidirectional: the same for ``inter_bw``.
        in_network: whether the switches can reduce (SHARP): enables the
            algorithms whose record ``needs_in_network``.
        reduce_bw: bytes of one operand an element-wise reduction consumes per
            second on the device; ``0`` makes local work free.
        nics: NICs per node, each of ``inter_bw`` (None: one per GPU).
        channels: NCCL-style channels, rings or trees run at once on a part of the
            data each (None: one per NIC).
        rail: rail-optimised placement (NIC ``j`` of every node on rail ``j``).
        spine_bw: without ``rail``, the bandwidth per node and direction the spine
            gives cross-node traffic, bytes/s (None: the node's NICs in all).
        gpu_arch: the GPU generation whose constants NCCL's tuning model takes
            (:data:`GPU_ARCHS`).
    """

    nodes: int
    gpus_per_node: int
    intra_bw: float
    inter_bw: float
    intra_latency: float = 2e-6
    inter_latency: float = 5e-6
    intra_bidirectional: bool = False
    inter_bidirectional: bool = False
    in_network: bool = False
    reduce_bw: float = 1e12
    nics: int | None = None
    channels: int | None = None
    rail: bool = True
    spine_bw: float | None = None
    gpu_arch: str = "hopper"

    def __post_init__(self):
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise UsageError(f"a cluster needs at least one node of one GPU, got {self.nodes} "
                             f"nodes of {self.gpus_per_node}")
        if self.gpus > MAX_GPUS:
            raise UsageError(f"{self.nodes} nodes × {self.gpus_per_node} GPUs = {self.gpus:,} "
                             f"GPUs: give at most {MAX_GPUS:,} GPUs in all (--nodes × "
                             f"--gpus-per-node), the most the model prices")
        if not all(math.isfinite(v) and v > 0 for v in (self.intra_bw, self.inter_bw)):
            raise UsageError(f"bandwidths must be positive and finite, got intra "
                             f"{self.intra_bw:g} and inter {self.inter_bw:g} bytes/s")
        if not all(math.isfinite(v) and v >= 0
                   for v in (self.intra_latency, self.inter_latency, self.reduce_bw)):
            raise UsageError("latencies and the reduction bandwidth must be finite and not "
                             "negative")
        if self.nics is not None and not 1 <= self.nics <= MAX_NICS:
            raise UsageError(f"NICs per node (--nics-per-node) {self.nics}: give 1 to "
                             f"{MAX_NICS}")
        if self.channels is not None and not 1 <= self.channels <= MAX_CHANNELS:
            raise UsageError(f"channels (--channels) {self.channels}: give 1 to {MAX_CHANNELS} "
                             f"(NCCL's MAXCHANNELS)")
        if self.spine_bw is not None:
            if self.rail:
                raise UsageError("a spine bandwidth (--spine-bw) applies without rail-optimised "
                                 "placement only: add --no-rail, or drop --spine-bw")
            if not (math.isfinite(self.spine_bw) and self.spine_bw > 0):
                raise UsageError(f"the spine bandwidth (--spine-bw) must be positive and finite, "
                                 f"got {self.spine_bw:g} bytes/s")
        if self.gpu_arch not in GPU_ARCHS:
            raise UsageError(f"unknown GPU generation {self.gpu_arch!r} (--gpu-arch): choose "
                             f"one of {', '.join(GPU_ARCHS)}")

    @property
    def gpus(self) -> int:
        """Return ``p``, the number of ranks."""
        return self.nodes * self.gpus_per_node

    @property
    def shape(self) -> NodeShape:
        """Return the node shape the algorithms' ``price`` reads."""
        return NodeShape(self.nodes, self.gpus_per_node, self.in_network)

    @property
    def nic_count(self) -> int:
        """Return the NICs per node (one per GPU unless given)."""
        return self.nics or self.gpus_per_node

    @property
    def channel_count(self) -> int:
        """Return the channels (one per NIC unless given)."""
        return self.channels or self.nic_count

    def nic_beta(self) -> float:
        """Return β of one NIC, seconds per byte and direction."""
        return (2.0 if self.inter_bidirectional else 1.0) / self.inter_bw

    def spine_beta(self) -> float:
        """Return β of a node's way through the spine (0 with rails: no spine is crossed)."""
        if self.rail:
            return 0.0
        if self.spine_bw is None:
            return self.nic_beta() / self.nic_count  # non-blocking: the NICs' total
        return (2.0 if self.inter_bidirectional else 1.0) / self.spine_bw

    def crossing_beta(self, flows: int) -> float:
        """Return β of one of ``flows`` flows leaving a node at once, spread over its NICs.

        ``⌈flows / nics⌉`` flows share a NIC; without rails the ``flows`` also
        share the node's way through the spine.
        """
        return max(-(-flows // self.nic_count) * self.nic_beta(), flows * self.spine_beta())

    def link(self, kind: str) -> tuple[float, float]:
        """Return ``(α, β)`` of ``intra``, ``inter``, ``slowest`` or ``flat``, β per byte and
        direction.

        ``inter`` is one GPU's share when all ``g`` GPUs of a node cross at once
        (the NIC's own β with a NIC per GPU). ``slowest`` is the link a step that
        uses both kinds waits for: the larger α and the larger β (on one node it
        is the intra-node link). ``flat`` is ``slowest`` for a flat ring over
        all ranks, node-major: one GPU of each node sends across the boundary at
        each step, on one NIC of its own (``⌈1/nics⌉ = 1``), so fewer NICs than
        GPUs do not slow it.
        """
        intra = (self.intra_latency, (2.0 if self.intra_bidirectional else 1.0) / self.intra_bw)
        flows = 1 if kind == "flat" else self.gpus_per_node
        inter = (self.inter_latency, self.crossing_beta(flows))
        if kind == "intra":
            return intra
        if kind == "inter":
            return inter
        if self.nodes == 1:
            return intra
        if self.gpus_per_node == 1:
            return inter
        return max(intra[0], inter[0]), max(intra[1], inter[1])

    def channel_link(self, kind: str) -> tuple[float, float]:
        """Return one channel's ``(α, β)`` on ``intra``, ``inter`` or ``slowest``.

        Every channel passes through every GPU, so a GPU's intra-node link
        carries all of them (β times ``channels``); each channel crosses a node
        boundary on its own NIC where there are enough (:meth:`crossing_beta` of
        ``channels`` flows).
        """
        c = self.channel_count
        intra = (self.intra_latency, self.link("intra")[1] * c)
        inter = (self.inter_latency, self.crossing_beta(c))
        if kind == "intra" or (kind == "slowest" and self.nodes == 1):
            return intra
        if kind == "inter" or self.gpus_per_node == 1:
            return inter
        return max(intra[0], inter[0]), max(intra[1], inter[1])

    def seconds_per_byte_reduced(self) -> float:
        """Return the time to combine one byte of one operand (0: free)."""
        return 1.0 / self.reduce_bw if self.reduce_bw else 0.0


# ----------------------------------------------------------------------------- workload

#: The most parameters a modelled gradient may have: the times of more overflow a float.
MAX_PARAMS = 10 ** 15


@dataclass(frozen=True)
class Workload:
    """The model's gradient and the compute around it.

    Attributes:
        shapes: parameter shapes in forward order (the backward pass produces
            their gradients last first). A bare parameter count is one flat tensor.
        bytes_per_element: gradient element size: 2 (float16), 4 or 8.
        forward: seconds of one forward pass.
        backward: seconds of one backward pass.
        layered: whether ``shapes`` are real layers (PowerSGD needs them) rather
            than one flat parameter count.
    """

    shapes: tuple[tuple[int, ...], ...]
    bytes_per_element: int = 4
    forward: float = 0.0
    backward: float = 0.0
    layered: bool = True

    def __post_init__(self):
        if self.bytes_per_element not in _FLOAT_DTYPES:
            raise UsageError(f"bytes per element (--bytes-per-element) must be 2, 4 or 8 "
                             f"(float16, float32, float64), got {self.bytes_per_element}")
        if any(any(d < 0 for d in s) for s in self.shapes) or self.elements < 1:
            raise UsageError("the model needs at least one parameter, and no negative dimension")
        if self.elements > MAX_PARAMS:
            raise UsageError(f"the model has {self.elements:.3g} parameters; give at most "
                             f"{MAX_PARAMS:.0e} (a thousand times the largest trained)")
        if not all(math.isfinite(v) and v >= 0 for v in (self.forward, self.backward)):
            raise UsageError(f"forward and backward times must be finite and not negative, "
                             f"got {self.forward:g} and {self.backward:g} s")

    @classmethod
    def from_params(cls, params: float, **kwargs) -> "Workload":
        """Return a workload of ``params`` parameters in one flat tensor."""
        if not math.isfinite(params):
            raise UsageError(f"a model needs a finite parameter count, got {params:g}")
        count = int(round(params))
        if not 1 <= count <= MAX_PARAMS:
            raise UsageError(f"a model needs 1 to {MAX_PARAMS:.0e} parameters, got {params:g}")
        return cls(shapes=((count,),), layered=False, **kwargs)

    @property
    def dtype(self) -> np.dtype:
        """Return the gradient dtype (float16, float32 or float64 by element size)."""
        return np.dtype(_FLOAT_DTYPES[self.bytes_per_element])

    @property
    def elements(self) -> int:
        """Return the number of parameters."""
        return sum(math.prod(s) for s in self.shapes)

    @property
    def nbytes(self) -> int:
        """Return the gradient's size in bytes."""
        return self.elements * self.bytes_per_element


#: The most tensors a layers file may list: a 70B-parameter transformer has about 700,
#: the largest mixtures of experts tens of thousands; pricing each costs a few µs.
MAX_LAYERS = 100_000


def load_layers(text: str, source: str = "the layers file") -> tuple[tuple[int, ...], ...]:
    """Return parameter shapes from JSON: a list of shapes, or an object name -> shape.

    ``[[1024, 4096], [4096], ...]`` or ``{"fc1.weight": [1024, 4096], ...}`` (what
    ``{n: list(p.shape) for n, p in model.named_parameters()}`` gives), in
    forward order. The JSON is read within :func:`refcoll.core.reading.loads_json`'s
    bounds (finite numbers, integers of fewer than 20 digits, shallow nesting) and
    at most :data:`MAX_LAYERS` tensors; ``source`` names the file in each refusal.
    """
    data = loads_json(text, source=source)
    shapes = list(data.values()) if isinstance(data, dict) else data
    if not isinstance(shapes, list) or not shapes:
        raise UsageError(f"{source}: must hold a non-empty list of shapes or an object "
                         "of name: shape")
    if len(shapes) > MAX_LAYERS:
        raise UsageError(f"{source}: lists {len(shapes)} tensors, more than the {MAX_LAYERS} "
                         "refcoll prices (a model's parameters, not its activations)")
    out = []
    for shape in shapes:
        shape = [shape] if isinstance(shape, int) and not isinstance(shape, bool) else shape
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool)
                                                  and d >= 0 for d in shape):
            raise UsageError(f"bad shape {json.dumps(shape)[:60]} in {source}: a shape is a "
                             "list of non-negative integers")
        out.append(tuple(shape))
    return tuple(out)


# ------------------------------------------------------------------------------ options

def _default_algorithms() -> tuple[str, ...]:
    return tuple(a for a in MODELLED if not _in_network_only(a))


@dataclass(frozen=True)
class Options:
    """What to try: algorithms, a compressor and its pattern, buckets for overlap.

    Attributes:
        algorithms: the all-reduce algorithms to price (default: every one of
            :data:`MODELLED` that needs no in-network reduction).
        compressor: a compressor spec (``"topk:ratio=0.01"``), or None.
        extra_compressors: more compressor specs: ``+compression`` and the search
            take the best of all those given.
        pattern: the compressed collective pattern; None: the compressor's default.
        buckets: gradient buckets for overlap (1: no overlap).
        inter: the hierarchical all-reduce's algorithm across nodes.
    """

    algorithms: tuple[str, ...] = field(default_factory=_default_algorithms)
    compressor: str | None = None
    pattern: str | None = None
    buckets: int = 1
    inter: str = "ring"
    extra_compressors: tuple[str, ...] = ()

    def __post_init__(self):
        unknown = [a for a in self.algorithms if a not in MODELLED]
        if unknown or not self.algorithms:
            raise UsageError(f"unknown algorithm {', '.join(map(repr, unknown)) or '(none)'}: the "
                             f"model prices {', '.join(MODELLED)}")
        if self.inter not in INTER_ALGORITHMS:
            raise UsageError(f"unknown inter-node algorithm {self.inter!r} (--inter): choose "
                             f"one of {', '.join(INTER_ALGORITHMS)}")
        if self.buckets < 1:
            raise UsageError(f"buckets must be at least 1, got {self.buckets}")
        if self.pattern is not None and self.pattern not in PATTERNS:
            raise UsageError(f"unknown pattern {self.pattern!r} (--pattern): choose one of "
                             f"{', '.join(PATTERNS)}")
        if self.extra_compressors and self.compressor is None:
            raise UsageError("extra compressors need a first one (compressor)")

    @property
    def compressors(self) -> tuple[str, ...]:
        """Return every compressor given, the first one first."""
        return (self.compressor, *self.extra_compressors) if self.compressor else ()


def select_algorithms(text: str | None, *, in_network: bool) -> tuple[str, ...]:
    """Return the algorithms named in ``ring,dbtree`` or ``all`` (None: all) for a cluster.

    ``all`` is every algorithm of :data:`ALGORITHMS` the cluster can run: those
    that need in-network reduction only with it. Naming one of those without
    it, or an unknown name, is a :class:`UsageError` that says what is supported.
    """
    usable = tuple(a for a in MODELLED if in_network or not _in_network_only(a))
    if text is None or text.strip().lower() == "all":
        return usable
    names = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in names if a not in MODELLED]
    if unknown or not names:
        raise UsageError(f"unknown algorithm {', '.join(map(repr, unknown)) or '(none)'} "
                         f"(--algorithm): choose from {', '.join(usable)}"
                         f"{'' if in_network else _needing_in_network()}, or all")
    needing = [a for a in names if not in_network and _in_network_only(a)]
    if needing:
        raise UsageError(f"algorithm {needing[0]!r} (--algorithm) is an in-network all-reduce: "
                         f"add --in-network if the switches can reduce (SHARP; it is priced on "
                         f"each GPU's inter-node link, --inter-bw and --inter-latency), or "
                         f"choose from {', '.join(usable)}")
    return tuple(dict.fromkeys(names))


def _needing_in_network() -> str:
    return "".join(f", {a} with --in-network" for a in ALGORITHMS if _in_network_only(a))


def choices_text(names: Sequence[str], *, joiner: str = "and") -> str:
    """Return ``names`` for a help text: ``ring, tree, and switch with --in-network``."""
    anywhere = [a for a in names if not _in_network_only(a)]
    special = [a for a in names if _in_network_only(a)]
    text = ", ".join(anywhere)
    return f"{text}, {joiner} {', '.join(special)} with --in-network" if special else text
