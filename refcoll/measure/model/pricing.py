"""Phase pricing: an algorithm's exact counts on a cluster's links, in seconds.

Each algorithm says, through its registry record's ``price``, which of its phases
run on which link (:class:`~refcoll.algorithms.registry.LinkCost`); this module
puts the link's α and β and the device's reduction rate on each. A phase whose
counts are ``c`` costs ``c.rounds·α + c.critical_bytes·β + c.reduced·s/reduce_bw``
(``s`` bytes per element). The compressed collectives
(:mod:`~refcoll.measure.model.compression`) are priced with the same
:func:`price_phase`, :func:`local_phase` and :func:`steps_phase`.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import asdict, dataclass

from ... import algorithms
from ...core.cost import Cost
from ...core.errors import UsageError
from .cluster import ALGORITHMS, Cluster

__all__ = ["Phase", "Estimate", "price_phase", "local_phase", "steps_phase",
           "allreduce_estimate", "estimate_name"]


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


def price_phase(cluster: Cluster, name: str, link: str, cost: Cost, itemsize: int) -> Phase:
    """Price ``cost`` (elements of ``itemsize`` bytes) on ``link`` of ``cluster``."""
    alpha, beta = cluster.link(link) if link != "local" else (0.0, 0.0)
    seconds = (cost.rounds * alpha + cost.critical_bytes * beta
               + cost.reduced * itemsize * cluster.seconds_per_byte_reduced())
    return Phase(name, link, cost.rounds, cost.critical_bytes, cost.reduced, seconds)


def local_phase(cluster: Cluster, name: str, nbytes: int) -> Phase:
    """Price ``nbytes`` of local element-wise work (passes over dense data)."""
    return Phase(name, "local", 0, 0, 0, nbytes * cluster.seconds_per_byte_reduced())


def steps_phase(cluster: Cluster, name: str, link: str, rounds: int, nbytes: int) -> Phase:
    """Price ``rounds`` exchanges of ``nbytes`` each way, one after another, on ``link``."""
    c = Cost(rounds, rounds, rounds * nbytes, rounds, rounds * nbytes, rounds * nbytes, 0)
    return price_phase(cluster, name, link, c, 1)


@functools.lru_cache(maxsize=None)
def _default_inter(name: str) -> str | None:
    """Return the default of the ``inter`` option ``name``'s all-reduce takes (None: none)."""
    parameter = inspect.signature(
        algorithms.implementation(name, "allreduce")).parameters.get("inter")
    return None if parameter is None else parameter.default


def estimate_name(algorithm: str, inter: str) -> str:
    """Return how an estimate names ``algorithm``: with its ``inter`` when not the default."""
    default = _default_inter(algorithm)
    return algorithm if default is None or inter == default else f"{algorithm}(inter={inter})"


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
    priced = algorithms.get(algorithm).price(cluster.shape, count, itemsize, inter=inter)
    phases = tuple(price_phase(cluster, part.name, part.link, part.cost, itemsize)
                   for part in priced)
    return Estimate(estimate_name(algorithm, inter), phases, dense=count * itemsize)
