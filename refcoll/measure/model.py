"""The cluster cost model: all-reduce phases, compression and overlap, for runs no one can try.

Everything here is arithmetic on the exact counts of :mod:`refcoll.core.cost` (α
terms, β bytes, γ elements) and on the compressors' real ``Payload.nbytes``,
priced with the links of a described cluster. ``refcoll model`` prints it; the
formulas are in ``spec/model.md``.

**The cluster.** ``nodes`` nodes of ``g = gpus_per_node`` GPUs, ``p = nodes·g``
ranks, node-major (GPU ``j`` of node ``i`` is rank ``i·g + j``). Every GPU has an
intra-node link (NVLink, PCIe) and its own inter-node link (a NIC per GPU), each
with a bandwidth, a latency, and a flag saying how the bandwidth was quoted: a
*unidirectional* figure ``B`` is what one direction carries; a *bidirectional*
figure ``B`` (how NVLink is usually quoted) is ``B/2`` each way. Every algorithm
here sends and receives at once on a link (a ring step, a halving or doubling
exchange, a switch's reduce and multicast), so the per-direction figure is the
one that counts: ``β = 1 / B_per_direction``. A phase whose counts are ``c`` on a
link costs ``c.rounds·α + c.critical_bytes·β + c.reduced·s/reduce_bw`` (``s``
bytes per element; ``reduce_bw`` the device's element-wise reduction rate).

**The algorithms** (:func:`allreduce_estimate`), with ``n`` the buffer:

* ``ring``: flat over all ``p`` GPUs. Every step moves one chunk on every link
  at once, so the step takes as long as the slowest link: with several nodes,
  the inter-node one, and the ring pays ``2(p-1)`` inter-node latencies.
* ``recursive_doubling``, ``rabenseifner``, ``tree``: their exchanges at
  distance ``< g`` stay inside a node, the others cross nodes. When ``g`` and
  ``nodes`` are powers of two the algorithm splits exactly into an intra-node
  part and an inter-node part (recursive doubling: ``lg g`` then ``lg nodes``
  whole-buffer exchanges; Rabenseifner halves across nodes first, so its
  inter-node halving moves ``(nodes-1)/nodes·n``, far more than the
  hierarchical all-reduce; tree: the binomial levels). Otherwise every round is
  priced on the slower link (an upper bound).
* ``hierarchical``: intra-node ring reduce-scatter, moving ``(g-1)/g·n`` per GPU
  over the intra-node link; an all-reduce (``inter``, ring by default) of the
  GPU's shard ``n/g`` among the ``nodes`` GPUs of the same local index, moving
  ``2(nodes-1)/nodes·n/g`` per GPU over its own inter-node link, the ``g`` shards
  in parallel on ``g`` links; intra-node ring allgather.
* ``switch`` (only with in-network reduction, SHARP): every GPU sends ``n`` up
  and receives ``n`` down once over its inter-node link, both directions at once:
  ``2α + n·β``, half a ring's bytes. ``inter="switch"`` puts the switch inside
  the hierarchical all-reduce instead: each GPU sends its shard ``n/g``.

* ``dbtree`` (NCCL's double binary tree, :func:`refcoll.core.cost.dbtree_allreduce`'s
  counts, segments of :data:`refcoll.algorithms.tree.DBTREE_SEGMENT`): its tree
  edges join ranks at every distance, so every round is priced on the slowest
  link (an upper bound) unless the cluster has one kind of link. The counts
  replay the schedule's messages with the simulator's clock rule, each run of
  equal segments jumped over once it repeats (:func:`dbtree_cost`), so a
  model-sized buffer costs a fraction of a second, not a replay per segment.

**Limits** (so that no input makes the model run for ever or exhaust memory):
at most :data:`MAX_GPUS` GPUs (``nodes·g``; some exact counts take time
quadratic in ``p``) and from 1 to ``min(parameters, MAX_BUCKETS)`` buckets (each
bucket is priced on its own). Every number must be finite; counts, bandwidths
and sizes positive; times and latencies may be 0.

**Compression** (:func:`compressed_estimate`) runs the pattern of
``refcoll/compressors/collective.py`` (the compressor's default, or one it allows):

* ``allreduce`` (none, casts, random-k, PowerSGD): the payload's wire arrays go
  through the all-reduce algorithm as they are; PowerSGD sums ``P`` (``Σ m·r``
  elements) then ``Q`` (``Σ n·r``), plus the tensors it leaves uncompressed.
* ``gather``: a ring allgather of every rank's element counts (``8`` bytes per
  wire array), then a ring allgather of the payloads, ``p-1`` steps of a payload
  each: the bytes grow with ``p``, then every rank decompresses ``p`` payloads
  and sums them. Compressing makes the step slower when ``(p-1)·payload`` exceeds
  the all-reduce's ``2(p-1)/p·n``, which the model says.
* ``twophase`` (sign, 1-bit): an all-to-all of compressed chunks of ``n/p``
  (pairwise, ``g-1`` steps inside the node and ``p-g`` across), each rank sums
  and recompresses its chunk, a ring allgather of the compressed chunks.

Local work (compress, decompress and sum) is priced as passes over the dense
bytes at ``reduce_bw``: one pass to compress (two for PowerSGD, ``M·Q`` and
``Mᵀ·P``), one per payload decompressed and added. It is a floor; selection
(top-k) and orthogonalisation cost more on real devices.

**Payload bytes** (:func:`payload_arrays`) come from compressing a
representative tensor (standard normal, fixed seed) with the real compressor
and summing its wire arrays, ``Payload.nbytes``. Tensors of more than
``EXACT_LIMIT`` elements are not compressed whole. Top-k and random-k then
keep ``k = min(n, max(1, round(ratio·n)))`` elements, their own rule, so their
bytes stay exact. Every other array's element count is extrapolated affinely
in ``n`` from tensors of ``SAMPLE`` and ``2·SAMPLE`` elements, with indices
widened to int64 past ``2**31 - 1`` elements as the compressors do: exact for
none, fp16 and bf16 at any ``n``, and for sign, 1-bit, TernGrad, int8 and QSGD
when ``n`` and ``SAMPLE`` are multiples of their block or bucket (otherwise
within one partial block). Threshold's payload depends on the data: the model
keeps the fraction of the standard normal sample at or above the threshold, an
assumption to replace with a real gradient's. PowerSGD's factors come from
``PowerSGD.plan(shape)``: ``(m+n)·r`` elements in the compute dtype for each
matrix it compresses, the tensor itself for vectors and matrices it leaves whole.

**Overlap** (:func:`overlap`): the backward pass produces gradients at a uniform
rate per parameter, last layers first; gradients are grouped into buckets in
that order, and bucket ``i``'s all-reduce starts when its last gradient is ready
and the previous bucket's all-reduce has finished (one communication stream).
The communication after the backward pass ends is exposed; what runs before it
is hidden. So one bucket hides nothing, and no number of buckets hides more
than the backward pass, less the last bucket's share of it. Computation and
communication are assumed not to slow each other down.

**The stack** (:func:`plan`): baseline (flat ring, dense, one bucket), then
``+topology`` (the fastest of the chosen algorithms), ``+compression``,
``+overlap``, each with its step time (``forward + backward + exposed
communication``), communication fraction and speed-up.

**Calibration** (:func:`calibrate`, :func:`predict`,
:func:`compare_with_measurement`; ``refcoll model --calibrate``) holds the same
counts to measured all-reduces on this machine. The textbook fit (α and β by
least squares over ping-pong times, γ over NumPy reductions) misses them by two
to five times: β depends on the message size and on whether the buffers are in
cache, and with more ranks than cores a round waits for its peers to be
scheduled. So the prediction keeps each algorithm's :class:`~refcoll.core.cost.Cost`
and prices its rounds and reductions with steps measured at the message sizes
and buffer sizes the all-reduce uses (see :class:`Calibration`).
"""

from __future__ import annotations

import functools
import json
import math
import re
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Callable, Sequence

import numpy as np

from ..core import cost as _cost
from ..core.chunking import max_chunk
from ..core.errors import UsageError
from ..calls.auto import ping_pong

__all__ = [
    "ALGORITHMS",
    "INTER_ALGORITHMS",
    "EXACT_LIMIT",
    "SAMPLE",
    "MAX_GPUS",
    "MAX_BUCKETS",
    "CALIBRATE_LIMIT",
    "BANDWIDTH_UNITS",
    "Cluster",
    "Workload",
    "Options",
    "Phase",
    "Estimate",
    "StepTime",
    "Plan",
    "allreduce_estimate",
    "dbtree_cost",
    "select_algorithms",
    "compressed_estimate",
    "payload_arrays",
    "powersgd_elements",
    "buckets_of",
    "bucket_limit",
    "check_buckets",
    "buckets_for_size",
    "overlap",
    "step_time",
    "plan",
    "human_time",
    "human_bytes",
    "parse_count",
    "parse_bandwidth",
    "parse_duration",
    "parse_size",
    "parse_sizes",
    "load_layers",
    "Calibration",
    "Comparison",
    "calibrate",
    "predict",
    "measure_allreduce",
    "compare_with_measurement",
]

#: The all-reduce algorithms the cluster model prices, in table order.
ALGORITHMS = ("ring", "tree", "dbtree", "recursive_doubling", "rabenseifner", "hierarchical",
              "switch")

#: What the hierarchical all-reduce may run across nodes.
INTER_ALGORITHMS = ("ring", "tree", "dbtree", "recursive_doubling", "rabenseifner", "switch")

#: The most GPUs (nodes × GPUs per node) the model prices: Rabenseifner's exact
#: counts on a number of ranks that is not a power of two take time quadratic in it.
MAX_GPUS = 16384

#: The largest buffer ``refcoll model --calibrate`` measures (every rank holds a few).
CALIBRATE_LIMIT = 1 << 30

#: The most gradient buckets the overlap model cuts a gradient into: each is priced
#: on its own, so the work grows with their number.
MAX_BUCKETS = 100_000

#: Tensors up to this many elements are compressed whole to find their payload.
EXACT_LIMIT = 1 << 18

#: Larger tensors' payloads are extrapolated from tensors of SAMPLE and 2·SAMPLE elements.
SAMPLE = 1 << 17

_FLOAT_DTYPES = {2: np.float16, 4: np.float32, 8: np.float64}


# ------------------------------------------------------------------------------- inputs

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
        in_network: whether the switches can reduce (SHARP): enables ``switch``.
        reduce_bw: bytes of one operand an element-wise reduction consumes per
            second on the device; ``0`` makes local work free.
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

    @property
    def gpus(self) -> int:
        """Return ``p``, the number of ranks."""
        return self.nodes * self.gpus_per_node

    def link(self, kind: str) -> tuple[float, float]:
        """Return ``(α, β)`` of ``intra``, ``inter`` or ``slowest``, β per byte and direction.

        ``slowest`` is the link a step that uses both kinds waits for: the larger
        α and the larger β (on one node it is the intra-node link).
        """
        intra = (self.intra_latency, (2.0 if self.intra_bidirectional else 1.0) / self.intra_bw)
        inter = (self.inter_latency, (2.0 if self.inter_bidirectional else 1.0) / self.inter_bw)
        if kind == "intra":
            return intra
        if kind == "inter":
            return inter
        if self.nodes == 1:
            return intra
        if self.gpus_per_node == 1:
            return inter
        return max(intra[0], inter[0]), max(intra[1], inter[1])

    def seconds_per_byte_reduced(self) -> float:
        """Return the time to combine one byte of one operand (0: free)."""
        return 1.0 / self.reduce_bw if self.reduce_bw else 0.0


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
        if not all(math.isfinite(v) and v >= 0 for v in (self.forward, self.backward)):
            raise UsageError(f"forward and backward times must be finite and not negative, "
                             f"got {self.forward:g} and {self.backward:g} s")

    @classmethod
    def from_params(cls, params: float, **kwargs) -> "Workload":
        """Return a workload of ``params`` parameters in one flat tensor."""
        if not math.isfinite(params):
            raise UsageError(f"a model needs a finite parameter count, got {params:g}")
        count = int(round(params))
        if count < 1:
            raise UsageError(f"a model needs at least one parameter, got {params:g}")
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


@dataclass(frozen=True)
class Options:
    """What to try: algorithms, a compressor and its pattern, buckets for overlap.

    Attributes:
        algorithms: the all-reduce algorithms to price (``switch`` needs
            in-network reduction).
        compressor: a compressor spec (``"topk:ratio=0.01"``), or None.
        pattern: the compressed collective pattern; None: the compressor's default.
        buckets: gradient buckets for overlap (1: no overlap).
        inter: the hierarchical all-reduce's algorithm across nodes.
    """

    algorithms: tuple[str, ...] = ("ring", "tree", "recursive_doubling", "rabenseifner",
                                   "hierarchical")
    compressor: str | None = None
    pattern: str | None = None
    buckets: int = 1
    inter: str = "ring"

    def __post_init__(self):
        unknown = [a for a in self.algorithms if a not in ALGORITHMS]
        if unknown or not self.algorithms:
            raise UsageError(f"unknown algorithm {', '.join(map(repr, unknown)) or '(none)'}: the "
                             f"model prices {', '.join(ALGORITHMS)}")
        if self.inter not in INTER_ALGORITHMS:
            raise UsageError(f"unknown inter-node algorithm {self.inter!r} (--inter): choose "
                             f"one of {', '.join(INTER_ALGORITHMS)}")
        if self.buckets < 1:
            raise UsageError(f"buckets must be at least 1, got {self.buckets}")


# ----------------------------------------------------------------------------- results

@dataclass(frozen=True)
class Phase:
    """One phase of a collective on one kind of link.

    Attributes:
        name: what happens (``intra reduce-scatter``...).
        link: ``intra``, ``inter``, ``slowest`` (a step using both kinds) or
            ``local`` (computation only).
        rounds: α terms on the critical path.
        bytes: β bytes on the critical path: what the busiest GPU sends (and
            receives) one message after another.
        reduced: elements combined on the critical path (γ terms).
        seconds: the phase's modelled time.
    """

    name: str
    link: str
    rounds: int
    bytes: int
    reduced: int
    seconds: float


@dataclass(frozen=True)
class Estimate:
    """A collective's modelled phases.

    Attributes:
        algorithm: the all-reduce algorithm, or the collective of a compressed
            pattern that needs none (``ring allgather``, ``all-to-all + allgather``).
        phases: in order.
        pattern: the compressed pattern, or None for a dense all-reduce.
        compressor: the compressor's spec, or None.
        payload: bytes one rank's compressed payloads put on the wire (0: dense).
        dense: bytes of the uncompressed buffer.
    """

    algorithm: str
    phases: tuple[Phase, ...]
    pattern: str | None = None
    compressor: str | None = None
    payload: int = 0
    dense: int = 0

    @property
    def seconds(self) -> float:
        """Return the total modelled time, phase after phase."""
        return sum(ph.seconds for ph in self.phases)

    @property
    def bytes(self) -> int:
        """Return the β bytes each GPU sends on the critical path, over all phases."""
        return sum(ph.bytes for ph in self.phases)

    def to_json(self) -> dict:
        """Return the estimate as a JSON-ready dict."""
        return {"algorithm": self.algorithm, "pattern": self.pattern,
                "compressor": self.compressor, "payload_bytes": self.payload,
                "dense_bytes": self.dense, "seconds": self.seconds, "bytes": self.bytes,
                "phases": [asdict(ph) for ph in self.phases]}


def _phase(cluster: Cluster, name: str, link: str, c: _cost.Cost, itemsize: int) -> Phase:
    """Price cost ``c`` (elements of ``itemsize`` bytes) on ``link``."""
    alpha, beta = cluster.link(link) if link != "local" else (0.0, 0.0)
    seconds = (c.rounds * alpha + c.critical_bytes * beta
               + c.reduced * itemsize * cluster.seconds_per_byte_reduced())
    return Phase(name, link, c.rounds, c.critical_bytes, c.reduced, seconds)


def _local(cluster: Cluster, name: str, nbytes: int) -> Phase:
    """Price ``nbytes`` of local element-wise work (passes over dense data)."""
    return Phase(name, "local", 0, 0, 0, nbytes * cluster.seconds_per_byte_reduced())


def _pow2(x: int) -> bool:
    return x & (x - 1) == 0


# ------------------------------------------------------------------ dense all-reduces

def _flat(name: str) -> Callable[[int, int, int], _cost.Cost]:
    from .. import algorithms

    return algorithms.get(name).costs["allreduce"]


def _levels(cluster: Cluster) -> str:
    """Return how an algorithm over all ranks meets the links.

    ``intra`` or ``inter`` when only one kind is used, ``split`` when nodes and
    GPUs per node are powers of two (exchanges at distance ``< g`` stay in the
    node), else ``slowest``.
    """
    if cluster.nodes == 1:
        return "intra"
    if cluster.gpus_per_node == 1:
        return "inter"
    if _pow2(cluster.nodes) and _pow2(cluster.gpus_per_node):
        return "split"
    return "slowest"


def _ring_link(cluster: Cluster) -> str:
    """Return the link a flat ring's steps wait for: every step uses every link at once."""
    levels = _levels(cluster)
    return "slowest" if levels == "split" else levels


def _ring(cluster: Cluster, count: int, itemsize: int) -> list[Phase]:
    p, link = cluster.gpus, _ring_link(cluster)
    return [_phase(cluster, "reduce-scatter", link, _cost.ring_reduce_scatter(p, count, itemsize),
                   itemsize),
            _phase(cluster, "allgather", link, _cost.ring_allgather(p, max_chunk(count, p),
                                                                    itemsize), itemsize)]


def _recursive_doubling(cluster: Cluster, count: int, itemsize: int) -> list[Phase]:
    g, m, levels = cluster.gpus_per_node, cluster.nodes, _levels(cluster)
    if levels != "split":
        return [_phase(cluster, "exchanges", levels,
                       _cost.recursive_doubling_allreduce(cluster.gpus, count, itemsize), itemsize)]
    return [_phase(cluster, "intra exchanges", "intra",
                   _cost.recursive_doubling_allreduce(g, count, itemsize), itemsize),
            _phase(cluster, "inter exchanges", "inter",
                   _cost.recursive_doubling_allreduce(m, count, itemsize), itemsize)]


def _rabenseifner(cluster: Cluster, count: int, itemsize: int) -> list[Phase]:
    g, m, levels = cluster.gpus_per_node, cluster.nodes, _levels(cluster)
    if levels != "split":
        p = cluster.gpus
        return [_phase(cluster, "halving reduce-scatter", levels,
                       _cost.rabenseifner_reduce_scatter(p, count, itemsize), itemsize),
                _phase(cluster, "doubling allgather", levels,
                       _cost.rabenseifner_allgather(p, max_chunk(count, p), itemsize), itemsize)]
    # The largest distance goes first: the inter-node halving moves (m-1)/m of the buffer.
    node_part = max_chunk(count, m)
    return [_phase(cluster, "inter halving", "inter",
                   _cost.rabenseifner_reduce_scatter(m, count, itemsize), itemsize),
            _phase(cluster, "intra halving", "intra",
                   _cost.rabenseifner_reduce_scatter(g, node_part, itemsize), itemsize),
            _phase(cluster, "intra doubling", "intra",
                   _cost.rabenseifner_allgather(g, max_chunk(node_part, g), itemsize), itemsize),
            _phase(cluster, "inter doubling", "inter",
                   _cost.rabenseifner_allgather(m, node_part, itemsize), itemsize)]


def _tree(cluster: Cluster, count: int, itemsize: int) -> list[Phase]:
    g, m, levels = cluster.gpus_per_node, cluster.nodes, _levels(cluster)
    p = cluster.gpus
    if levels != "split":
        return [_phase(cluster, "binomial reduce", levels, _cost.tree_reduce(p, count, itemsize),
                       itemsize),
                _phase(cluster, "binomial broadcast", levels,
                       _cost.tree_broadcast(p, count, itemsize), itemsize)]
    return [_phase(cluster, "intra reduce", "intra", _cost.tree_reduce(g, count, itemsize),
                   itemsize),
            _phase(cluster, "inter reduce", "inter", _cost.tree_reduce(m, count, itemsize),
                   itemsize),
            _phase(cluster, "inter broadcast", "inter", _cost.tree_broadcast(m, count, itemsize),
                   itemsize),
            _phase(cluster, "intra broadcast", "intra", _cost.tree_broadcast(g, count, itemsize),
                   itemsize)]


@functools.lru_cache(maxsize=64)
def _dbtree_pairs(p: int) -> dict[tuple[int, str], tuple[tuple[int, int], ...]]:
    """Return the ``(source, dest)`` of every message of one segment, by tree and phase."""
    from ..algorithms.tree import dbtree_messages

    pairs: dict[tuple[int, str], list[tuple[int, int]]] = {}
    for tree, phase, source, dest, _ in dbtree_messages(p, 2, None):  # one segment a half
        pairs.setdefault((tree, phase), []).append((source, dest))
    return {key: tuple(v) for key, v in pairs.items()}


def dbtree_cost(p: int, count: int, itemsize: int) -> _cost.Cost:
    """Return :func:`refcoll.core.cost.dbtree_allreduce`'s counts, without a replay per segment.

    The schedule (:func:`refcoll.algorithms.tree.dbtree_messages`) is, for each
    tree, the reduce of every segment then the broadcast of every segment, each
    segment the same messages; segments of a half differ by at most one element
    (the longer first). So it is at most eight runs of one repeated group of
    messages, which :func:`refcoll.core.cost._lamport_replay` replays with the
    simulator's clock rule, jumping over a run's remaining repeats once a repeat
    leaves the clocks as it found them (shifted). The other counts are sums.
    Equal to ``dbtree_allreduce(p, count, itemsize)`` (held by the tests), at the
    default segment :data:`refcoll.algorithms.tree.DBTREE_SEGMENT`.
    """
    from ..algorithms.tree import DBTREE_SEGMENT

    if p == 1 or count == 0:
        return _cost.ZERO
    pairs = _dbtree_pairs(p)
    runs = []
    sent, sends, reduced = [0] * p, [0] * p, [0] * p
    messages = elements = 0
    for tree, (start, stop) in enumerate(((0, (count + 1) // 2), ((count + 1) // 2, count))):
        half = stop - start
        if half == 0:
            continue
        pieces = -(-half // DBTREE_SEGMENT)
        size, longer = divmod(half, pieces)  # ``longer`` pieces of size + 1, then the rest
        for phase in ("reduce", "broadcast"):
            group = pairs[tree, phase]
            for elems, repeat in ((size + 1, longer), (size, pieces - longer)):
                if repeat:
                    runs.append((tuple((a, b, elems) for a, b in group), repeat))
            for source, dest in group:
                sent[source] += half
                sends[source] += pieces
                if phase == "reduce":
                    reduced[dest] += half  # every partial received is folded once
            messages += len(group) * pieces
            elements += len(group) * half
    rounds, critical = _cost._lamport_replay(runs, itemsize)
    return _cost.Cost(rounds, messages, elements * itemsize, max(sends), max(sent) * itemsize,
                      critical, max(reduced), _dbtree_formula())


@functools.lru_cache(maxsize=1)
def _dbtree_formula() -> str:
    return _cost.dbtree_allreduce(2, 2, 1).formula  # the registry's own text, for display


def _allreduce_cost(name: str) -> Callable[[int, int, int], _cost.Cost]:
    """Return the all-reduce counts of registry algorithm ``name`` (dbtree's fast replay)."""
    return dbtree_cost if name == "dbtree" else _flat(name)


def _dbtree(cluster: Cluster, count: int, itemsize: int) -> list[Phase]:
    # Tree edges join ranks at every distance: like a ring step, a round waits for the
    # slowest link unless the cluster has only one kind.
    return [_phase(cluster, "two pipelined trees (reduce + broadcast)", _ring_link(cluster),
                   dbtree_cost(cluster.gpus, count, itemsize), itemsize)]


def _switch_cost(p: int, count: int, itemsize: int) -> _cost.Cost:
    """Counts of an in-network all-reduce: ``n`` up and ``n`` down at once, two latencies."""
    if p == 1 or count == 0:
        return _cost.ZERO
    b = count * itemsize
    return _cost.Cost(2, 2 * p, 2 * p * b, 1, b, b, 0, "2α + n·β")


def _switch(cluster: Cluster, count: int, itemsize: int) -> list[Phase]:
    if not cluster.in_network:
        raise UsageError("algorithm 'switch' needs in-network reduction (--in-network)")
    return [_phase(cluster, "in-network reduce + multicast", "inter",
                   _switch_cost(cluster.gpus, count, itemsize), itemsize)]


def _hierarchical(cluster: Cluster, count: int, itemsize: int, inter: str) -> list[Phase]:
    g, m = cluster.gpus_per_node, cluster.nodes
    shard = max_chunk(count, g)
    if inter == "switch":
        if not cluster.in_network:
            raise UsageError("inter-node algorithm 'switch' (--inter) needs in-network "
                             "reduction: add --in-network, or choose one of "
                             f"{', '.join(a for a in INTER_ALGORITHMS if a != 'switch')}")
        across = _switch_cost(m, shard, itemsize)
    else:
        across = _allreduce_cost(inter)(m, shard, itemsize)
    return [_phase(cluster, "intra reduce-scatter", "intra",
                   _cost.ring_reduce_scatter(g, count, itemsize), itemsize),
            _phase(cluster, f"inter {inter} all-reduce", "inter", across, itemsize),
            _phase(cluster, "intra allgather", "intra", _cost.ring_allgather(g, shard, itemsize),
                   itemsize)]


@functools.lru_cache(maxsize=4096)
def allreduce_estimate(cluster: Cluster, algorithm: str, count: int, itemsize: int, *,
                       inter: str = "ring") -> Estimate:
    """Return the phases of a dense all-reduce of ``count`` elements on ``cluster``.

    ``inter`` is the hierarchical all-reduce's algorithm across nodes. The
    phases' ``bytes`` are what one GPU sends (and receives) in each; with
    ``g = gpus_per_node``, ``m = nodes`` and ``n = count·itemsize`` divisible
    by ``g·m``, hierarchical's are ``(g-1)/g·n``, ``2(m-1)/m·n/g`` and ``(g-1)/g·n``.
    """
    if algorithm not in ALGORITHMS:
        raise UsageError(f"unknown algorithm {algorithm!r}: the model prices "
                         f"{', '.join(ALGORITHMS)}")
    if count < 0:
        raise UsageError(f"element count must not be negative, got {count}")
    if algorithm == "hierarchical":
        phases = _hierarchical(cluster, count, itemsize, inter)
    else:
        phases = {"ring": _ring, "recursive_doubling": _recursive_doubling, "tree": _tree,
                  "dbtree": _dbtree, "rabenseifner": _rabenseifner,
                  "switch": _switch}[algorithm](cluster, count, itemsize)
    name = f"hierarchical(inter={inter})" if algorithm == "hierarchical" and inter != "ring" \
        else algorithm
    return Estimate(name, tuple(phases), dense=count * itemsize)


# -------------------------------------------------------------------------- compression

@functools.lru_cache(maxsize=256)
def _compressor(spec: str):
    from ..compressors import parse

    return parse(spec)


def _innermost(comp):
    from ..compressors import ErrorFeedback

    while isinstance(comp, ErrorFeedback):
        comp = comp.inner
    return comp


def _real_arrays(spec: str, count: int, dtype: np.dtype) -> tuple[tuple[str, int, int], ...]:
    """Compress a standard normal tensor of ``count`` elements; return its wire arrays."""
    comp = _compressor(spec)
    x = np.random.default_rng(0).standard_normal(count).astype(dtype)
    payload = comp.compress(x, comp.new_state())
    return tuple((role, int(a.size), int(a.dtype.itemsize))
                 for role, a in sorted(payload.arrays.items()))


@functools.lru_cache(maxsize=4096)
def payload_arrays(spec: str, count: int, dtype: str) -> tuple[tuple[str, int, int], ...]:
    """Return ``(role, elements, itemsize)`` of each wire array of a flat tensor's payload.

    Up to :data:`EXACT_LIMIT` elements the real compressor compresses a standard
    normal tensor of ``count`` elements. Past it: top-k and random-k keep
    ``k = min(n, max(1, round(ratio·n)))`` elements (their documented rule);
    every other array's count is extrapolated affinely from tensors of
    :data:`SAMPLE` and ``2·SAMPLE`` elements; indices take the width the
    compressors give them at ``count`` elements. ``Σ elements·itemsize`` is
    ``Payload.nbytes``.
    """
    from ..compressors.base import index_dtype

    dt = np.dtype(dtype)
    if count <= EXACT_LIMIT:
        return _real_arrays(spec, count, dt)
    small, large = _real_arrays(spec, SAMPLE, dt), _real_arrays(spec, 2 * SAMPLE, dt)
    inner = _innermost(_compressor(spec))
    ratio = getattr(inner, "ratio", None) if inner.name in ("topk", "randomk") else None
    arrays = []
    for (role, a, itemsize), (_, b, _) in zip(small, large):
        if ratio is not None:
            elements = min(count, max(1, round(ratio * count)))
        else:
            elements = a + ((b - a) * (count - SAMPLE) + SAMPLE // 2) // SAMPLE
        if role == "indices":
            itemsize = index_dtype(count).itemsize
        arrays.append((role, elements, itemsize))
    return tuple(arrays)


def powersgd_elements(spec: str, shapes: Sequence[tuple[int, ...]]) -> tuple[int, int, int]:
    """Return PowerSGD's ``(Σ m·r, Σ n·r, elements sent whole)`` over ``shapes``.

    Each shape goes through ``PowerSGD.plan``: a matrix it compresses sends
    ``P`` (``m·r``) and ``Q`` (``n·r``) in the compute dtype; vectors, and
    matrices where compression does not pay, go whole in the gradient's dtype.
    """
    inner = _innermost(_compressor(spec))
    p_elements = q_elements = whole = 0
    for shape in shapes:
        planned = inner.plan(tuple(shape))
        if planned is None:
            whole += math.prod(shape)
        else:
            m, n, r = planned
            p_elements += m * r
            q_elements += n * r
    return p_elements, q_elements, whole


def _is_powersgd(spec: str) -> bool:
    return _innermost(_compressor(spec)).name == "powersgd"


def _pattern(spec: str, pattern: str | None) -> str:
    comp = _compressor(spec)
    chosen = pattern or comp.patterns[0]
    if chosen not in comp.patterns:
        raise UsageError(f"compressor {spec!r} allows the patterns {', '.join(comp.patterns)}, "
                         f"not {chosen!r}")
    return chosen


def _steps(cluster: Cluster, name: str, link: str, rounds: int, nbytes: int) -> Phase:
    """Price ``rounds`` exchanges of ``nbytes`` each way, one after another, on ``link``."""
    c = _cost.Cost(rounds, rounds, rounds * nbytes, rounds, rounds * nbytes, rounds * nbytes, 0)
    return _phase(cluster, name, link, c, 1)


def compressed_estimate(cluster: Cluster, spec: str, shapes: Sequence[tuple[int, ...]],
                        dtype, algorithm: str = "ring", *, pattern: str | None = None,
                        inter: str = "ring") -> Estimate:
    """Return the phases of a compressed all-reduce of the tensors ``shapes`` on ``cluster``.

    PowerSGD compresses each tensor (it needs the shapes) and sums all ``P``
    factors in one all-reduce, then all ``Q`` factors, as PyTorch's PowerSGD
    hook does per bucket; every other compressor compresses the tensors as one
    flat buffer, as a communication hook does with a bucket. ``algorithm`` and
    ``inter`` serve the ``allreduce`` pattern only.
    """
    dt = np.dtype(dtype)
    itemsize = dt.itemsize
    chosen = _pattern(spec, pattern)
    n = sum(math.prod(s) for s in shapes)
    dense = n * itemsize
    p, g = cluster.gpus, cluster.gpus_per_node
    inner = _innermost(_compressor(spec))
    phases: list[Phase] = []

    def all_reduced(role: str, count: int, size: int) -> None:
        if count:
            for ph in allreduce_estimate(cluster, algorithm, count, size, inter=inter).phases:
                phases.append(replace(ph, name=f"{role}: {ph.name}"))

    if chosen == "allreduce":
        if _is_powersgd(spec):
            from ..compressors.base import compute_dtype

            if len(shapes) == 1 and len(shapes[0]) < 2 and n > 1:
                raise UsageError("PowerSGD compresses matrices: give the layer shapes "
                                 "(--layers), not a flat parameter count")
            factor = compute_dtype(dt).itemsize
            p_el, q_el, whole = powersgd_elements(spec, shapes)
            payload = (p_el + q_el) * factor + whole * itemsize
            matrices = dense - whole * itemsize
            phases.append(_local(cluster, "compress (M·Q, Mᵀ·P)", 2 * matrices))
            all_reduced("P", p_el, factor)
            all_reduced("Q", q_el, factor)
            all_reduced("uncompressed", whole, itemsize)
            phases.append(_local(cluster, "decompress (P·Qᵀ)", matrices))
        else:
            arrays = payload_arrays(spec, n, dt.name)
            payload = sum(c * s for _, c, s in arrays)
            busy = inner.name != "none"
            if busy:
                phases.append(_local(cluster, "compress", dense))
            for role, count, size in arrays:
                all_reduced(role, count, size)
            if busy:
                phases.append(_local(cluster, "decompress", dense))
        return Estimate(algorithm, tuple(phases), chosen, spec, payload, dense)

    link = _ring_link(cluster)
    if chosen == "gather":
        arrays = payload_arrays(spec, n, dt.name)
        payload = sum(c * s for _, c, s in arrays)
        phases.append(_local(cluster, "compress", dense))
        if p > 1:
            phases.append(_steps(cluster, "counts allgather", link, p - 1, 8 * len(arrays)))
            phases.append(_steps(cluster, "payload allgather", link, p - 1, payload))
        phases.append(_local(cluster, f"decompress and sum {p} payloads", p * dense))
        return Estimate("ring allgather", tuple(phases), chosen, spec, payload, dense)

    chunk = max_chunk(n, p)
    arrays = payload_arrays(spec, chunk, dt.name)
    part = sum(c * s for _, c, s in arrays)
    phases.append(_local(cluster, "compress chunks", dense))
    if p > 1:
        phases.append(_steps(cluster, "counts allgather", link, p - 1, 8 * len(arrays) * p))
        phases.append(_steps(cluster, "all-to-all (intra)", "intra", g - 1, part))
        phases.append(_steps(cluster, "all-to-all (inter)", "inter", p - g, part))
    phases.append(_local(cluster, f"sum {p} chunks and recompress", (p + 1) * chunk * itemsize))
    if p > 1:
        phases.append(_steps(cluster, "counts allgather", link, p - 1, 8 * len(arrays)))
        phases.append(_steps(cluster, "chunk allgather", link, p - 1, part))
    phases.append(_local(cluster, "decompress", dense))
    return Estimate("all-to-all + allgather", tuple(phases), chosen, spec, p * part, dense)


# ------------------------------------------------------------------- buckets and overlap

def bucket_limit(workload: Workload) -> int:
    """Return the most buckets ``workload`` may be cut into: one a parameter, MAX_BUCKETS."""
    return min(workload.elements, MAX_BUCKETS)


def check_buckets(count: int, workload: Workload, *, name: str = "buckets") -> int:
    """Return ``count`` if it is from 1 to :func:`bucket_limit`; else raise UsageError.

    ``name`` is what the message calls the number (an option, ``--buckets``).
    """
    limit = bucket_limit(workload)
    if count < 1:
        raise UsageError(f"{name} {count}: give at least 1 (1 means one bucket: no overlap)")
    if count > limit:
        raise UsageError(f"{name} {count:,}: give at most {limit:,} (at most one bucket per "
                         f"parameter and at most {MAX_BUCKETS:,})")
    return count


def buckets_for_size(workload: Workload, nbytes: int, *, name: str = "bucket size") -> int:
    """Return how many buckets of at most ``nbytes`` the gradient fills (checked as above)."""
    if nbytes < 1:
        raise UsageError(f"{name} {nbytes}: give a positive size, e.g. 25MB")
    count = -(-workload.nbytes // nbytes)
    limit = bucket_limit(workload)
    if count > limit:
        smallest = -(-workload.nbytes // limit)
        raise UsageError(f"{name} {nbytes:,} B cuts the {human_bytes(workload.nbytes)} gradient "
                         f"into {count:,} buckets, more than the {limit:,} the model takes: "
                         f"give at least {smallest:,} B")
    return count


def buckets_of(workload: Workload, count: int) -> list[tuple[tuple[tuple[int, ...], ...], float]]:
    """Cut the gradient into at most ``count`` buckets, last layers first.

    Returns ``[(shapes, ready), ...]`` in the order the backward pass fills them:
    ``ready`` is the fraction of the backward pass after which the bucket's
    last gradient exists (gradients appear at a uniform rate per parameter). A
    flat parameter count is cut into ``count`` equal pieces; layers are never
    split (as in PyTorch DDP), so big layers can leave fewer buckets than asked.
    ``count`` runs from 1 to :func:`bucket_limit` (:func:`check_buckets`).
    """
    check_buckets(count, workload)
    total = workload.elements
    if not workload.layered:
        sizes = [total // count + (1 if i < total % count else 0) for i in range(count)]
        out, done = [], 0
        for size in sizes:
            done += size
            out.append((((size,),), done / total))
        return out
    out, current, done = [], [], 0
    boundary = 1
    for shape in reversed(workload.shapes):
        current.append(shape)
        done += math.prod(shape)
        if done * count >= boundary * total:
            out.append((tuple(current), done / total if total else 1.0))
            current = []
            while boundary * total <= done * count and boundary < count:
                boundary += 1
    if current:
        out.append((tuple(current), 1.0))
    return out


def overlap(ready: Sequence[float], comm: Sequence[float], backward: float) -> tuple[float, float]:
    """Return ``(exposed, hidden)`` communication of buckets all-reduced during the backward pass.

    Bucket ``i`` is ready at ``ready[i]`` seconds into the backward pass and
    takes ``comm[i]``; one communication stream runs them in order, each
    starting when it is ready and the previous one is done. What runs after
    ``backward`` is exposed, the rest hidden.
    """
    end = -backward  # clocks run from the end of the backward pass, so exposed time is exact
    for at, seconds in zip(ready, comm):
        end = max(at - backward, end) + seconds
    exposed = max(end, 0.0)
    return exposed, max(sum(comm) - exposed, 0.0)


@dataclass(frozen=True)
class StepTime:
    """One training step's modelled time with one set of techniques.

    Attributes:
        label: which techniques (``baseline``, ``+topology``...).
        algorithm: the all-reduce (or the compressed pattern's collective).
        compressor: spec, or None.
        pattern: compressed pattern, or None.
        buckets: buckets actually made.
        comm: total communication time (every bucket's collective, local work included).
        exposed: communication not hidden under the backward pass.
        step: ``forward + backward + exposed``.
        speedup: baseline step / this step.
        gain: previous row's step / this step.
    """

    label: str
    algorithm: str
    compressor: str | None
    pattern: str | None
    buckets: int
    comm: float
    exposed: float
    step: float
    speedup: float = 1.0
    gain: float = 1.0

    @property
    def fraction(self) -> float:
        """Return the share of the step spent in exposed communication."""
        return self.exposed / self.step if self.step else 0.0

    def to_json(self) -> dict:
        """Return the row as a JSON-ready dict."""
        return {**asdict(self), "hidden": self.comm - self.exposed,
                "comm_fraction": self.fraction}


def step_time(cluster: Cluster, workload: Workload, algorithm: str, *,
              compressor: str | None = None, pattern: str | None = None, buckets: int = 1,
              inter: str = "ring", label: str = "") -> StepTime:
    """Return the modelled step with ``algorithm``, an optional compressor and ``buckets``."""
    cut = buckets_of(workload, buckets)
    comm, seen = [], {}  # buckets of the same shapes (all of a flat count's) cost the same
    for shapes, _ in cut:
        if shapes not in seen:
            if compressor is None:
                count = sum(math.prod(s) for s in shapes)
                seen[shapes] = allreduce_estimate(cluster, algorithm, count,
                                                  workload.bytes_per_element, inter=inter).seconds
            else:
                seen[shapes] = compressed_estimate(cluster, compressor, shapes, workload.dtype,
                                                   algorithm, pattern=pattern,
                                                   inter=inter).seconds
        comm.append(seen[shapes])
    exposed, _ = overlap([ready * workload.backward for _, ready in cut], comm, workload.backward)
    chosen = _pattern(compressor, pattern) if compressor else None
    name = algorithm if chosen in (None, "allreduce") else \
        {"gather": "ring allgather", "twophase": "all-to-all + allgather"}[chosen]
    if algorithm == "hierarchical" and inter != "ring" and chosen in (None, "allreduce"):
        name = f"hierarchical(inter={inter})"
    return StepTime(label, name, compressor, chosen, len(cut), sum(comm), exposed,
                    workload.forward + workload.backward + exposed)


# ------------------------------------------------------------------------------ the plan

@dataclass(frozen=True)
class Plan:
    """Everything ``refcoll model`` reports for one cluster, workload and options."""

    cluster: Cluster
    workload: Workload
    options: Options
    dense: tuple[Estimate, ...]
    compressed: Estimate | None
    stack: tuple[StepTime, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_json(self) -> dict:
        """Return the plan as a JSON-ready dict (the ``--json`` schema)."""
        w = self.workload
        return {
            "cluster": {**asdict(self.cluster), "gpus": self.cluster.gpus},
            "workload": {"parameters": w.elements, "tensors": len(w.shapes),
                         "bytes_per_element": w.bytes_per_element, "bytes": w.nbytes,
                         "forward": w.forward, "backward": w.backward},
            "options": {**asdict(self.options), "algorithms": list(self.options.algorithms)},
            "allreduce": [e.to_json() for e in self.dense],
            "compressed": self.compressed.to_json() if self.compressed else None,
            "stack": [row.to_json() for row in self.stack],
            "notes": list(self.notes),
        }


def _fastest(rows: list[StepTime]) -> StepTime:
    return min(rows, key=lambda r: (r.step, r.comm))


def _stacked(row: StepTime, label: str, baseline: StepTime, previous: StepTime) -> StepTime:
    return replace(row, label=label, speedup=baseline.step / row.step if row.step else 1.0,
                   gain=previous.step / row.step if row.step else 1.0)


def select_algorithms(text: str | None, *, in_network: bool) -> tuple[str, ...]:
    """Return the algorithms named in ``ring,dbtree`` or ``all`` (None: all) for a cluster.

    ``all`` is every algorithm of :data:`ALGORITHMS` the cluster can run:
    ``switch`` only with in-network reduction. Naming ``switch`` without it, or
    an unknown name, is a :class:`UsageError` that says what is supported.
    """
    usable = tuple(a for a in ALGORITHMS if a != "switch" or in_network)
    if text is None or text.strip().lower() == "all":
        return usable
    names = [a.strip() for a in text.split(",") if a.strip()]
    unknown = [a for a in names if a not in ALGORITHMS]
    if unknown or not names:
        raise UsageError(f"unknown algorithm {', '.join(map(repr, unknown)) or '(none)'} "
                         f"(--algorithm): choose from {', '.join(usable)}"
                         f"{'' if in_network else ', switch with --in-network'}, or all")
    if "switch" in names and not in_network:
        raise UsageError("algorithm 'switch' (--algorithm) is an in-network all-reduce: add "
                         "--in-network if the switches can reduce (SHARP; it is priced on each "
                         "GPU's inter-node link, --inter-bw and --inter-latency), or choose from "
                         f"{', '.join(usable)}")
    return tuple(dict.fromkeys(names))


def plan(cluster: Cluster, workload: Workload, options: Options) -> Plan:
    """Price every chosen algorithm, the compressor and overlap, and stack their speed-ups.

    Rows: ``baseline`` (flat ring, dense, one bucket); ``+topology`` (the
    fastest chosen algorithm); ``+compression`` (the compressor's pattern, with
    the fastest algorithm for its payload when the pattern is an all-reduce);
    ``+overlap`` (that, in ``options.buckets`` buckets). A technique that makes
    the step slower is kept in the stack and said so in ``notes``.
    """
    if "switch" in options.algorithms and not cluster.in_network:
        raise UsageError("algorithm 'switch' needs in-network reduction (--in-network)")
    check_buckets(options.buckets, workload)
    if options.compressor is not None:
        _pattern(options.compressor, options.pattern)
        if _is_powersgd(options.compressor) and not workload.layered:
            raise UsageError("PowerSGD's ratio comes from the layer shapes: give --layers, "
                             "not --params")
    elements, itemsize = workload.elements, workload.bytes_per_element
    dense = tuple(allreduce_estimate(cluster, a, elements, itemsize, inter=options.inter)
                  for a in options.algorithms)
    kw = dict(inter=options.inter)
    baseline = step_time(cluster, workload, "ring", label="baseline (flat ring)", **kw)
    rows, notes = [baseline], []
    topology = _fastest([step_time(cluster, workload, a, **kw) for a in options.algorithms])
    rows.append(_stacked(topology, "+topology", baseline, rows[-1]))
    compressed = None
    candidates = options.algorithms
    comp_kw = {}
    if options.compressor is not None:
        chosen = _pattern(options.compressor, options.pattern)
        if chosen != "allreduce":
            candidates = ("ring",)  # the pattern's own collective; the algorithm plays no part
        comp_kw = dict(compressor=options.compressor, pattern=options.pattern)
        with_comp = _fastest([step_time(cluster, workload, a, **comp_kw, **kw)
                              for a in candidates])
        algorithm = with_comp.algorithm.split("(")[0] if chosen == "allreduce" else "ring"
        compressed = compressed_estimate(cluster, options.compressor, workload.shapes,
                                         workload.dtype, algorithm, pattern=options.pattern,
                                         **kw)
        rows.append(_stacked(with_comp, "+compression", baseline, rows[-1]))
        if with_comp.comm > topology.comm:
            notes.append(_slower_note(cluster, compressed, topology, with_comp))
    if options.buckets > 1:
        overlapped = _fastest([step_time(cluster, workload, a, buckets=options.buckets,
                                         **comp_kw, **kw) for a in candidates])
        rows.append(_stacked(overlapped, "+overlap", baseline, rows[-1]))
        if overlapped.step > rows[-2].step:
            notes.append(f"{overlapped.buckets} buckets make the step slower: each bucket's "
                         f"collective pays all its rounds' latency again "
                         f"({human_time(overlapped.comm)} of communication against "
                         f"{human_time(rows[-2].comm)} in one bucket)")
        if overlapped.buckets < options.buckets:
            notes.append(f"layers are not split across buckets: {overlapped.buckets} buckets "
                         f"made of the {options.buckets} asked")
    return Plan(cluster, workload, options, dense, compressed, tuple(rows), tuple(notes))


def _slower_note(cluster: Cluster, compressed: Estimate, dense: StepTime,
                 with_comp: StepTime) -> str:
    p = cluster.gpus
    why = ""
    if compressed.pattern == "gather":
        why = (f": a gathered payload is not reduced on the way, so each GPU receives "
               f"p-1 = {p - 1} payloads of {human_bytes(compressed.payload)} "
               f"({human_bytes((p - 1) * compressed.payload)}) where a ring all-reduce moves "
               f"{human_bytes(2 * (p - 1) * compressed.dense // p)}, and decompresses {p}")
    return (f"compression makes communication slower ({human_time(with_comp.comm)} against "
            f"{human_time(dense.comm)} dense){why}")


def human_time(seconds: float) -> str:
    """Return ``seconds`` with three significant digits in s, ms, µs or ns."""
    if seconds >= 1000:
        return f"{seconds:,.0f} s"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns" if seconds else "0"


def human_bytes(nbytes: float) -> str:
    """Return ``nbytes`` with three significant digits in decimal units (TB, GB, MB, kB)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


# ------------------------------------------------------------------------------- units

# A number, or the words float() reads as non-finite, so they are refused by name.
_NUMBER = (r"\s*([-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?"
           r"|[-+]?(?i:nan|inf(?:inity)?))\s*")
_SCALE = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
          "Ki": 2.0 ** 10, "Mi": 2.0 ** 20, "Gi": 2.0 ** 30, "Ti": 2.0 ** 40}

#: The bandwidth units :func:`parse_bandwidth` reads, for messages and help.
BANDWIDTH_UNITS = "B/s, kB/s, MB/s, GB/s, TB/s, KiB/s, MiB/s, GiB/s, Gb/s (= Gbit/s = Gbps), Mb/s"


def _finite(text: str, value: float, name: str, example: str) -> float:
    """Return ``value`` if finite and not negative; else a UsageError naming ``name``."""
    if not math.isfinite(value):
        raise UsageError(f"{name} {text!r}: not a finite number; give e.g. {example}")
    if value < 0:
        raise UsageError(f"{name} {text!r}: must not be negative; give e.g. {example}")
    return value


def parse_count(text, *, name: str = "count", minimum: int | None = 1,
                maximum: int | None = None, example: str = "4") -> int:
    """Return a whole number from ``4``, ``1300000000`` or ``1.3e9``.

    Refused with a :class:`UsageError` that names ``name`` (an option, ``--nodes``):
    what is not a number, not finite, not whole, below ``minimum`` (None: no
    bound) or above ``maximum``.
    """
    raw = str(text).strip()
    try:
        value = int(raw)  # exact for long integers
    except ValueError:
        m = re.fullmatch(_NUMBER, raw)
        if not m:
            raise UsageError(f"{name} {text!r}: not a number; give a whole number, e.g. "
                             f"{example}") from None
        number = float(m.group(1))
        if not math.isfinite(number):
            raise UsageError(f"{name} {text!r}: not a finite number; give a whole number, e.g. "
                             f"{example}") from None
        if not number.is_integer():
            raise UsageError(f"{name} {text!r}: not a whole number; give e.g. {example}") \
                from None
        value = int(number)
    if minimum is not None and value < minimum:
        raise UsageError(f"{name} {text}: must be at least {minimum}; give e.g. {example}")
    if maximum is not None and value > maximum:
        raise UsageError(f"{name} {text}: must be at most {maximum:,}; give e.g. {example}")
    return value


def parse_bandwidth(text: str, *, name: str = "bandwidth", zero: bool = False) -> float:
    """Return bytes per second from ``300GB/s``, ``200Gb/s``, ``200Gbit/s``, ``1e9B/s``.

    ``B`` is bytes and ``b`` or ``bit`` bits; ``k M G T`` are powers of 1000 and
    ``Ki Mi Gi Ti`` of 1024. A number without a unit is refused (``600`` is
    more likely 600 GB/s than 600 B/s), but ``0`` where ``zero`` allows it (a
    free reduction). Otherwise the bandwidth must be positive and finite.
    ``name`` (an option, ``--intra-bw``) is what messages call it.
    """
    example = "300GB/s or 200Gb/s"
    m = re.fullmatch(_NUMBER + r"(?:([kKMGT]i?)?(B|bit|b)(?:/s|ps))?\s*", str(text))
    if not m:
        raise UsageError(f"{name} {text!r}: cannot read a bandwidth; write a number and a unit, "
                         f"e.g. {example} (units: {BANDWIDTH_UNITS})")
    value = _finite(text, float(m.group(1)), name, example)
    if value == 0 and not zero:
        raise UsageError(f"{name} {text!r}: a bandwidth must be positive; give e.g. {example}")
    if not m.group(3):
        if value == 0:
            return 0.0
        raise UsageError(f"{name} {text!r}: a bandwidth needs a unit: add one, e.g. "
                         f"{text.strip()}GB/s (units: {BANDWIDTH_UNITS})")
    value *= _SCALE[m.group(2) or ""]
    return value / 8 if m.group(3) != "B" else value


def parse_duration(text: str, *, name: str = "duration", unit: bool = False) -> float:
    """Return seconds from ``2us``, ``2µs``, ``500ns``, ``50ms``, ``1s`` or ``0.05`` (seconds).

    With ``unit`` a number needs its unit (a latency of ``5`` is more likely
    5 µs than 5 s), but for ``0``. The time must be finite and not negative.
    ``name`` (an option, ``--inter-latency``) is what messages call it.
    """
    example = "5us, 500ns or 0" if unit else "50ms, 0.1s or 0.05 (seconds)"
    m = re.fullmatch(_NUMBER + r"(ns|us|µs|ms|s)?\s*", str(text))
    if not m:
        raise UsageError(f"{name} {text!r}: cannot read a time; write e.g. {example} "
                         f"(units: ns, us, µs, ms, s)")
    value = _finite(text, float(m.group(1)), name, example)
    if unit and m.group(2) is None and value != 0:
        raise UsageError(f"{name} {text!r}: a time needs a unit: add one, e.g. "
                         f"{text.strip()}us (units: ns, us, µs, ms, s)")
    return value * {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0,
                    None: 1.0}[m.group(2)]


def parse_size(text: str, *, name: str = "size") -> int:
    """Return bytes from ``64K``, ``64KiB``, ``25MB``, ``1G``, ``4096``.

    ``K M G`` alone and ``KiB MiB GiB`` are powers of 1024 (message sizes, as
    nccl-tests reads them); ``kB MB GB`` are powers of 1000. The size must be
    finite and not negative.
    """
    example = "64K, 64KiB, 25MB or 4096"
    m = re.fullmatch(_NUMBER + r"(?:([kKMGT])(i?B|B)?)?\s*", str(text))
    if not m:
        raise UsageError(f"{name} {text!r}: cannot read a size; write e.g. {example}")
    value = _finite(text, float(m.group(1)), name, example)
    if m.group(2):
        unit = m.group(2).upper()
        decimal = m.group(3) == "B"
        value *= (1000 if decimal else 1024) ** ("KMGT".index(unit) + 1)
    return int(round(value))


def parse_sizes(text: str, *, name: str = "sizes", largest: int | None = None) -> list[int]:
    """Return byte sizes from ``64K,1M,16M`` or a doubling range ``64K..64M``.

    Every size must be positive, and at most ``largest`` bytes if given;
    ``name`` (an option, ``--sizes``) is what messages call them.
    """
    sizes: list[int] = []
    for item in str(text).split(","):
        if not item.strip():
            continue
        if ".." in item:
            low, high = (parse_size(v, name=name) for v in item.split("..", 1))
            if low < 1 or high < low:
                raise UsageError(f"{name} {item!r}: a range must run from a positive size "
                                 f"upwards, e.g. 64K..64M")
            if largest is not None and high > largest:
                raise UsageError(f"{name} {item!r}: give sizes up to {_binary_size(largest)} "
                                 f"(the largest buffer it measures)")
            while low <= high:
                sizes.append(low)
                low *= 2
        else:
            sizes.append(parse_size(item, name=name))
    if not sizes or any(s < 1 for s in sizes):
        raise UsageError(f"{name} {text!r}: give positive sizes, e.g. 64K..64M or 64K,1M,16M")
    if largest is not None and max(sizes) > largest:
        raise UsageError(f"{name} {text!r}: give sizes up to {_binary_size(largest)} (the "
                         f"largest buffer it measures)")
    return sizes


def _binary_size(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes} B"


def load_layers(text: str) -> tuple[tuple[int, ...], ...]:
    """Return parameter shapes from JSON: a list of shapes, or an object name -> shape.

    ``[[1024, 4096], [4096], ...]`` or ``{"fc1.weight": [1024, 4096], ...}`` (what
    ``{n: list(p.shape) for n, p in model.named_parameters()}`` gives), in
    forward order.
    """
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"the layers file is not JSON: {exc}") from None
    shapes = list(data.values()) if isinstance(data, dict) else data
    if not isinstance(shapes, list) or not shapes:
        raise UsageError("the layers file must hold a non-empty list of shapes or an object "
                         "of name: shape")
    out = []
    for shape in shapes:
        shape = [shape] if isinstance(shape, int) else shape
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool)
                                                  and d >= 0 for d in shape):
            raise UsageError(f"bad shape {shape!r} in the layers file: a shape is a list of "
                             "non-negative integers")
        out.append(tuple(shape))
    return tuple(out)


# -------------------------------------------------------------------- calibration

def _pingpong_sizes(largest: int) -> list[int]:
    """Return 8 B and every power of two from 1 KiB to the first at or past ``largest``."""
    sizes, b = [8], 1 << 10
    while b < 2 * largest:
        sizes.append(b)
        b *= 2
    return sizes


def _message_sizes(nbytes: int, p: int) -> list[int]:
    """Return the message sizes an all-reduce of ``nbytes`` on ``p`` ranks sends, bracketed.

    ``nbytes / 2^k`` for ``k = 0 .. ⌈lg p⌉`` (whole buffers for recursive doubling,
    halves and quarters for Rabenseifner, ``nbytes/p`` for the ring), rounded
    down to whole float32 elements.
    """
    return sorted({max(4, (nbytes >> k) // 4 * 4) for k in range((p - 1).bit_length() + 1)})


def _repeats(nbytes: int) -> int:
    """Return how often to time an operation on ``nbytes``: the same on every rank."""
    return 100 if nbytes <= 1 << 16 else 40 if nbytes <= 1 << 20 else 20 if nbytes <= 1 << 24 else 8


@dataclass(frozen=True)
class Calibration:
    """α, β and γ of this machine, and the tables the measured-size model reads.

    Attributes:
        ranks: processes the measurements ran on.
        alpha, beta: least-squares fit of the ping-pong's one-way times,
            ``t(b) = α + β·b``, each point weighted by ``1/t(b)`` so that small
            and large messages count alike (a relative-error fit).
        gamma: least-squares slope of one local reduction's time, seconds per
            byte of one operand (float32 ``sum`` through ``Transport.reduce_local``).
        call: seconds of an all-reduce call's own work, measured on one rank.
        pingpong: ``(bytes, one-way seconds)`` between ranks 0 and 1, the others idle.
        reduction: ``(bytes, seconds)`` of one reduction of operands in cache.
        steps: ``(buffer bytes, message bytes, first, later, reduction after
            first, reduction after later)``, seconds: a ring step (every rank
            sends right and receives from the left at once) right after a
            barrier (``first``) and back to back with the previous one
            (``later``), each followed by its reduction, moving through an input
            and an output buffer of the all-reduce's size as its rounds do (see
            :func:`_step_table`): what a round and a reduction cost inside an
            all-reduce of that size, with its cache misses and the contention
            of every rank at once. On a machine with fewer cores than ranks a
            round after a barrier waits for peers to be scheduled again, and
            ``first`` is much larger than ``later``.
    """

    ranks: int
    alpha: float
    beta: float
    gamma: float
    call: float
    pingpong: tuple[tuple[int, float], ...]
    reduction: tuple[tuple[int, float], ...]
    steps: tuple[tuple[int, int, float, float, float, float], ...]

    def to_json(self) -> dict:
        """Return the calibration as a JSON-ready dict."""
        return {"ranks": self.ranks, "alpha": self.alpha, "beta": self.beta,
                "gamma": self.gamma, "call": self.call,
                "pingpong": [{"bytes": b, "seconds": s} for b, s in self.pingpong],
                "reduction": [{"bytes": b, "seconds": s} for b, s in self.reduction],
                "steps": [{"buffer": n, "message": b, "first": f, "later": e,
                           "reduction_first": rf, "reduction_later": rl}
                          for n, b, f, e, rf, rl in self.steps]}


def _barrier(t) -> None:
    """Dissemination barrier from point-to-point exchanges: ``⌈lg p⌉`` rounds of one byte."""
    token, back = np.zeros(1, np.uint8), np.zeros(1, np.uint8)
    distance = 1
    while distance < t.size:
        t.sendrecv(token, (t.rank + distance) % t.size, back, (t.rank - distance) % t.size)
        distance *= 2


def _largest_median(t, times: list[float]) -> float:
    """Return the largest over ranks of each rank's median time (every rank calls)."""
    from ..calls.collectives import allreduce

    mine = np.array([float(np.median(times)) if times else 0.0])
    return float(allreduce(mine, t, op="max", algorithm="recursive_doubling", validate=False)[0])


def _warmups(repeats: int) -> int:
    """Return the untimed calls before ``repeats`` timed ones: fresh buffers and caches settle."""
    return max(3, repeats // 2)


def _timed(t, fn: Callable[[int], None], repeats: int, *, sync: bool = True) -> list[float]:
    """Return the times of ``repeats`` calls ``fn(i)``, after :func:`_warmups` untimed ones."""
    times = []
    for i in range(_warmups(repeats) + repeats):
        if sync:
            _barrier(t)
        start = time.perf_counter()
        fn(i)
        if i >= _warmups(repeats):
            times.append(time.perf_counter() - start)
    return times


def _fit_line(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Return ``(a, b)``, both >= 0, minimising ``Σ ((a + b·x - y)/y)²`` (relative error).

    A negative intercept or slope means nothing here (a latency, a time per
    byte), so when the free fit gives one, it is fixed at 0 and the other refitted.
    """
    xs = np.array([x for x, _ in points], dtype=np.float64)
    ys = np.array([y for _, y in points], dtype=np.float64)
    design = np.stack([1 / ys, xs / ys], axis=1)
    target = np.ones_like(ys)
    (a, b), *_ = np.linalg.lstsq(design, target, rcond=None)
    if a < 0:
        a, b = 0.0, float(max(design[:, 1] @ target / (design[:, 1] @ design[:, 1]), 0.0))
    elif b < 0:
        a, b = float(max(design[:, 0] @ target / (design[:, 0] @ design[:, 0]), 0.0)), 0.0
    return float(a), float(b)


def _buffers(t, nbytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return three float32 buffers of ``nbytes // 4`` elements, views of buffers kept on ``t``.

    Calibration and measurement reuse one set of pages: allocating and freeing
    buffers of tens of MiB between measurements leaves the kernel reclaiming
    memory for a second or two, on a core the ranks need, and the next
    measurements come out several times too slow.
    """
    kept = transport_cache(t, "model").setdefault("buffers", [])
    count = max(nbytes // 4, 1)
    if not kept or kept[0].size < count:
        kept[:] = [np.ones(count, np.float32) for _ in range(3)]
    return kept[0][:count], kept[1][:count], kept[2][:count]


def _pingpong(t, sizes: list[int]) -> list[tuple[int, float]]:
    pool, back, _ = (buf.view(np.uint8) for buf in _buffers(t, sizes[-1]))
    points = []
    for b in sizes:
        send, recv = pool[:b], back[:b]
        times: list[float] = []
        if t.rank in (0, 1):
            peer = 1 - t.rank

            def round_trip(_: int) -> None:
                ping_pong(t, send, recv, peer)

            times = [s / 2 for s in _timed(t, round_trip, _repeats(b), sync=False)]
        points.append((b, _largest_median(t, times)))
    return points


def _step_table(t, nbytes: int) -> list[tuple[int, int, float, float, float, float]]:
    """Time ring steps and their reductions per message size, inside buffers of ``nbytes``.

    The steps do to memory what the rounds of an out-of-place ring,
    recursive-doubling or Rabenseifner all-reduce do, slice by slice through
    an input and an output buffer of ``nbytes``: the peer's partial is received
    straight into the output slice and reduced there with the input slice.
    ``first``: right after a barrier, sending a slice of the input, as a call's
    first round does. ``later``: back to back, sending the slice the previous
    step has just reduced, as later rounds do; that data is still in the
    sender's cache, and a peer on a core of another cache domain pays for
    fetching it, as the sender then pays for writing lines the peer has read.

    Returns ``(nbytes, message, first, later, reduction after first, reduction
    after later)`` rows, seconds.
    """
    from ..core.ops import get_op

    add = get_op("sum")
    left, right = (t.rank - 1) % t.size, (t.rank + 1) % t.size
    count = nbytes // 4
    x, out, spare = _buffers(t, nbytes)
    rows = []
    for b in _message_sizes(nbytes, t.size):
        elements = b // 4
        slots = max(count // elements, 1)
        repeats, warmups = _repeats(b), _warmups(_repeats(b))
        medians = []

        def piece(buf: np.ndarray, i: int) -> np.ndarray:
            return buf[(i % slots) * elements:(i % slots + 1) * elements]

        for kind in ("first", "later"):
            steps, reductions = [], []
            for i in range(warmups + repeats):
                if kind == "first" or i == warmups:
                    _barrier(t)
                start = time.perf_counter()
                if kind == "first":
                    sending, landing = piece(x, i), piece(out, i)
                else:  # what the previous step reduced; never the slice it receives into
                    sending = piece(out, i - 1)
                    landing = piece(spare if slots == 1 else out, i)
                t.sendrecv(sending, right, landing, left)
                middle = time.perf_counter()
                t.reduce_local(add, landing, piece(x, i), piece(out, i))
                if i >= warmups:
                    steps.append(middle - start)
                    reductions.append(time.perf_counter() - middle)
            medians.append((_largest_median(t, steps), _largest_median(t, reductions)))
        (first, reduce_first), (later, reduce_later) = medians
        rows.append((nbytes, b, first, later, reduce_first, reduce_later))
    return rows


def calibrate(t, sizes: Sequence[int] = (1 << 16, 1 << 20, 1 << 24), *,
              after_size: Callable[[int], None] | None = None) -> Calibration:
    """Measure this machine's step tables for ``sizes``, then α, β and γ (collective).

    First an all-reduce call's own work; then, for each all-reduce size in
    ``sizes`` from the smallest up, a ring step and a reduction at each message
    size :func:`_message_sizes` gives, inside buffers of that size (see
    :class:`Calibration`), and ``after_size(nbytes)`` if given (what
    :func:`compare_with_measurement` measures there); last the ping-pong
    between ranks 0 and 1 and local reductions at 8 B and every power of two
    from 1 KiB to ``max(sizes)``, for the α-β-γ fit. Small sizes come first
    because transfers of tens of MiB leave this kind of machine slower at
    small and medium sizes for a while. Everything goes through ``Transport``
    calls, as the algorithms make them; every rank returns the same numbers.
    """
    from ..core.ops import get_op

    if t.size < 2:
        raise UsageError("calibration needs at least 2 ranks to measure messages")
    if not sizes or min(sizes) < 4:
        raise UsageError("calibration sizes must be at least 4 bytes (one float32)")
    measured = _pingpong_sizes(max(sizes))
    _buffers(t, measured[-1])  # once, at the largest size
    call = _call_overhead(t)
    steps = []
    for nbytes in sorted(set(sizes)):
        steps += _step_table(t, nbytes)
        if after_size is not None:
            after_size(nbytes)
    pingpong = _pingpong(t, measured)
    add = get_op("sum")
    reduction = []
    for b in measured[1:]:
        a, c, out = _buffers(t, b)
        reduction.append((b, _largest_median(
            t, _timed(t, lambda _: t.reduce_local(add, a, c, out), _repeats(b), sync=False))))
    alpha, beta = _fit_line(pingpong)
    _, gamma = _fit_line(reduction)
    return Calibration(t.size, alpha, beta, gamma, call, tuple(pingpong), tuple(reduction),
                       tuple(steps))


def _call_overhead(t) -> float:
    """Return the median time of a one-element all-reduce on a one-rank split of ``t``."""
    from ..calls.collectives import allreduce

    solo = t.split(t.rank, 0)
    x, out = np.ones(1, np.float32), np.empty(1, np.float32)
    times = _timed(solo, lambda _: allreduce(x, solo, algorithm="ring", validate=False, out=out),
                   _repeats(0), sync=False)
    return _largest_median(t, times)


def _interpolate(table: Sequence[tuple[float, float]], x: float) -> float:
    """Return ``y`` at ``x``, log-log linear between the table's points (sorted by ``x``).

    Outside the table, the nearest segment extended (the nearest point if only one).
    """
    if len(table) == 1:
        return table[0][1]
    xs = np.log([max(a, 1e-300) for a, _ in table])
    ys = np.log([max(b, 1e-300) for _, b in table])
    at = math.log(max(x, 1e-300))
    i = int(np.clip(np.searchsorted(xs, at) - 1, 0, len(xs) - 2))
    slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
    return float(math.exp(ys[i] + slope * (at - xs[i])))


def predict(calibration: Calibration, algorithm: str, p: int, nbytes: int, itemsize: int = 4,
            *, fit: bool = False) -> float:
    """Return the predicted time of a single-machine all-reduce of ``nbytes``.

    With ``fit`` (or for a size the calibration has no steps for): the textbook
    ``rounds·α + critical_bytes·β + reduced·s·γ`` of :mod:`refcoll.core.cost` at the
    fitted α, β, γ. Otherwise the measured-step model: ``call + F(b) +
    (rounds-1)·L(b) + RF(b) + (k-1)·RL(b)``, ``b = critical_bytes/rounds`` the
    algorithm's mean message, ``k = reduced·s/b`` its reductions, ``F``, ``L``,
    ``RF`` and ``RL`` the calibration's first and later ring steps and the
    reductions after each, inside buffers of ``nbytes`` (log-log interpolated
    between its message sizes): a timed call starts from synchronised ranks
    and sends its input in its first round, later rounds send what the one
    before reduced.
    Exact in form for ring and recursive doubling, whose messages are all
    alike; Rabenseifner's halve, and ``b`` is their mean.
    """
    c = _flat(algorithm)(p, nbytes // itemsize, itemsize)
    steps = [row[1:] for row in calibration.steps if row[0] == nbytes]
    if fit or not steps:
        return c.time(calibration.alpha, calibration.beta, calibration.gamma * itemsize)
    if c.rounds == 0:
        return calibration.call
    message = c.critical_bytes / c.rounds
    reductions = c.reduced * itemsize / message if message else 0.0

    def at(column: int) -> float:
        return _interpolate([(row[0], row[column]) for row in steps], message)

    return (calibration.call + at(1) + (c.rounds - 1) * at(2) + min(reductions, 1.0) * at(3)
            + max(reductions - 1.0, 0.0) * at(4))


def measure_allreduce(t, algorithm: str, nbytes: int, *, repeats: int | None = None) -> float:
    """Return the median time (largest over ranks) of ``refcoll.allreduce`` of float32 ``nbytes``.

    Out of place into a preallocated ``out=``, argument agreement off: the
    algorithm alone, as ``refcoll bench`` times it.
    """
    from ..calls.collectives import allreduce

    x, out, _ = _buffers(t, nbytes)
    times = _timed(t, lambda _: allreduce(x, t, algorithm=algorithm, validate=False, out=out),
                   repeats or _repeats(nbytes))
    return _largest_median(t, times)


def _machine_busy() -> float | None:
    """Return the CPU seconds every process on this machine has used so far (None: unknown).

    From ``/proc/stat`` (Linux): user, nice, system, irq, softirq and steal time,
    in clock ticks.
    """
    import os

    try:
        with open("/proc/stat", encoding="ascii") as fh:
            fields = fh.readline().split()
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[1:9])
    return (user + nice + system + irq + softirq + steal) / ticks


@dataclass(frozen=True)
class Comparison:
    """Predicted against measured all-reduce times on this machine.

    Attributes:
        calibration: what the predictions were made from.
        rows: by algorithm then size: ``algorithm`` (``auto`` names what it
            resolved to), ``bytes``, ``predicted`` (measured-step model),
            ``predicted_fit`` (α-β-γ fit), ``measured``, ``ratio`` =
            predicted / measured.
        others: the share of the machine's CPU time that other processes used
            while this ran (None where unknown): above a few percent, the
            measurements shared the cores with someone else's work.
    """

    calibration: Calibration
    rows: list[dict]
    others: float | None

    def within(self, tolerance: float = 0.3, *, fit: bool = False) -> int:
        """Return how many predictions are within ``tolerance`` of the measured time."""
        key = "predicted_fit" if fit else "predicted"
        return sum(abs(r[key] / r["measured"] - 1) <= tolerance for r in self.rows
                   if r["measured"])

    def to_json(self) -> dict:
        """Return the comparison as a JSON-ready dict."""
        return {"calibration": self.calibration.to_json(), "rows": self.rows,
                "others_cpu_share": self.others, "within_30_percent": self.within(),
                "fit_within_30_percent": self.within(fit=True)}


def compare_with_measurement(t, algorithms: Sequence[str], sizes: Sequence[int]) -> Comparison:
    """Calibrate, measure each algorithm at each size on ``t``, and predict (collective).

    Each size's all-reduces are measured right after its step tables (see
    :func:`calibrate`); the predictions use the calibration alone. The CPU
    time the machine spent beyond this job's own ranks is reported with them.
    """
    from ..calls.collectives import allreduce
    from ..calls.auto import resolve

    measured: dict[tuple[str, int], tuple[str, float]] = {}

    def measure_all(nbytes: int) -> None:
        for algorithm in algorithms:
            ran = resolve(t, "allreduce", nbytes // 4, 4) if algorithm == "auto" else algorithm
            measured[algorithm, nbytes] = ran, measure_allreduce(t, algorithm, nbytes)

    busy, own, wall = _machine_busy(), time.process_time(), time.perf_counter()
    calibration = calibrate(t, sizes, after_size=measure_all)
    own = allreduce(np.array([time.process_time() - own]), t, algorithm="recursive_doubling",
                    validate=False)[0]
    others = None
    if busy is not None:
        import os

        wall = time.perf_counter() - wall
        others = max(_machine_busy() - busy - own, 0.0) / (wall * (os.cpu_count() or 1))
    rows = []
    for algorithm in algorithms:
        for nbytes in sizes:
            ran, seconds = measured[algorithm, nbytes]
            predicted = predict(calibration, ran, t.size, nbytes)
            rows.append({"algorithm": algorithm if ran == algorithm else f"auto ({ran})",
                         "bytes": nbytes, "predicted": predicted,
                         "predicted_fit": predict(calibration, ran, t.size, nbytes, fit=True),
                         "measured": seconds,
                         "ratio": predicted / seconds if seconds else math.inf})
    return Comparison(calibration, rows, others)
