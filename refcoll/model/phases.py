"""A collective's phases, each on one kind of link, and their α-β-γ price.

:func:`price_phase` puts a link's α and β and the device's reduction rate on an
algorithm's exact counts: a phase whose counts are ``c`` costs
``c.rounds·α + c.critical_bytes·β + c.reduced·s/reduce_bw`` (``s`` bytes per
element). A cluster is any object with the
:class:`~refcoll.model.cluster.Cluster` methods ``link`` and
``seconds_per_byte_reduced``. :mod:`~refcoll.model.pricing`, :mod:`~refcoll.model.channels`
and :mod:`~refcoll.model.compression` build their estimates from these.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol

from ..core.cost import Cost

__all__ = ["Phase", "Estimate", "price_phase", "local_phase", "steps_phase"]


class _Rates(Protocol):
    """What pricing reads off a :class:`~.cluster.Cluster`: its links and its reduction speed.

    A protocol rather than the class, which this module cannot import: cluster
    imports channels, and channels imports this module.
    """

    def link(self, kind: str) -> tuple[float, float]: ...

    def seconds_per_byte_reduced(self) -> float: ...


@dataclass(frozen=True)
class Phase:
    """One phase of a collective on one kind of link.

    Attributes:
        name: what happens (``intra reduce-scatter``...).
        link: ``intra``, ``inter``, ``slowest`` (a step using both kinds), ``flat``
            (a flat ring's step: both kinds, one GPU of a node crossing) or
            ``local`` (computation only).
        rounds: α terms on the critical path.
        bytes: β bytes on the critical path: what the busiest GPU sends (and
            receives) one message after another.
        reduced: elements combined on the critical path (γ terms).
        seconds: the phase's modelled time.
        latency: the part of ``seconds`` that is α (rounds times the link's latency).
    """

    name: str
    link: str
    rounds: int
    bytes: int
    reduced: int
    seconds: float
    latency: float = 0.0


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
    def latency(self) -> float:
        """Return the α part of :attr:`seconds`."""
        return sum(ph.latency for ph in self.phases)

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


def price_phase(cluster: _Rates, name: str, link: str, cost: Cost, itemsize: int) -> Phase:
    """Price ``cost`` (elements of ``itemsize`` bytes) on ``link`` of ``cluster``."""
    alpha, beta = cluster.link(link) if link != "local" else (0.0, 0.0)
    seconds = (cost.rounds * alpha + cost.critical_bytes * beta
               + cost.reduced * itemsize * cluster.seconds_per_byte_reduced())
    return Phase(name, link, cost.rounds, cost.critical_bytes, cost.reduced, seconds,
                 cost.rounds * alpha)


def local_phase(cluster: _Rates, name: str, nbytes: int) -> Phase:
    """Price ``nbytes`` of local element-wise work (passes over dense data)."""
    return Phase(name, "local", 0, 0, 0, nbytes * cluster.seconds_per_byte_reduced())


def steps_phase(cluster: _Rates, name: str, link: str, rounds: int, nbytes: int) -> Phase:
    """Price ``rounds`` exchanges of ``nbytes`` each way, one after another, on ``link``."""
    c = Cost(rounds=rounds, messages=rounds, bytes=rounds * nbytes, max_rank_messages=rounds,
             max_rank_bytes=rounds * nbytes, critical_bytes=rounds * nbytes, reduced=0)
    return price_phase(cluster, name, link, c, 1)
