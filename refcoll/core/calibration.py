"""The one calibration record: α, β and γ of a machine, with their units and what backs them.

``auto`` (:mod:`refcoll.calls.auto`) prices each candidate's exact counts with
α, β and γ; the cluster model's calibration (:mod:`refcoll.model`)
measures the same three and keeps, beside them, the tables its measured-step
prediction reads. One record serves both, so γ has one unit everywhere.

Units:

* ``alpha``: seconds per message (the latency of one point-to-point send).
* ``beta``: seconds per byte on the wire.
* ``gamma``: seconds per element combined, the element a float32 (one
  ``float32`` addition of two operands into a third); :attr:`Calibration.gamma_per_byte`
  is the same figure per byte of one operand (``gamma / 4``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["Calibration", "DEFAULT", "GAMMA_ITEMSIZE"]

#: Bytes of the element ``gamma`` is measured on (float32).
GAMMA_ITEMSIZE = 4


@dataclass(frozen=True)
class Calibration:
    """α, β, γ of a machine, where they came from, and the tables measured with them.

    Attributes:
        alpha: seconds per message.
        beta: seconds per byte.
        gamma: seconds per float32 element combined (see :attr:`gamma_per_byte`).
        source: where the figures came from (``default``, ``measured``, a cache file).
        key: the :class:`~refcoll.calls.calibration.CalibrationKey` text it was measured
            under; empty for :data:`DEFAULT`.
        measured_at: Unix time of the measurement; None for a fixed calibration.
        load: runnable tasks per core while it was measured (None: unknown).
        ranks: processes the measurements ran on (0: not recorded).
        call: seconds a repeated all-reduce call costs beyond its algorithm's
            rounds, on the ordinary path (its checks and scope), measured on
            every rank after a barrier.
        pingpong: ``(bytes, one-way seconds)`` between ranks 0 and 1, the others idle.
        reduction: ``(bytes of one operand, seconds)`` of one float32 reduction of
            operands in cache.
        steps: ``(buffer bytes, message bytes, first, later, reduction after
            first, reduction after later)``, seconds: a ring step (every rank
            sends right and receives from the left at once) right after a
            barrier (``first``) and back to back with the previous one
            (``later``), each followed by its reduction, moving through an input
            and an output buffer of the all-reduce's size as its rounds do: what
            a round and a reduction cost inside an all-reduce of that size, with
            its cache misses and the contention of every rank at once. On a
            machine with fewer cores than ranks a round after a barrier waits
            for peers to be scheduled again, and ``first`` is much larger than
            ``later``.
        waits: ``(buffer bytes, message bytes, q first, W first, q later, W
            later)``, beside each row of ``steps``: the share ``q`` of those
            steps that waited for a descheduled peer and their mean wait ``W``,
            seconds (the scheduling term,
            :mod:`refcoll.model.calibrate_sched`). Empty in a record
            measured before it, which then predicts without the term.
        stretch: ``(buffer bytes, message bytes, (s_1, s_2, ...))`` beside each
            row of ``steps``: ``s_R``, seconds, is the median time ``R``
            consecutive ``later`` steps took beyond ``R`` median ones
            (:func:`refcoll.model.calibrate_sched.stretch`): the
            scheduling term measured with the rounds' real correlation. Empty
            in an older record, which then uses ``waits``.

        planned_call: the same for a blocking call that replayed a plan
            the transport kept, in older records: 0 now (a blocking call
            keeps no plan between calls).
        planned_steps: rows like ``steps`` for small buffers, each step run
            as a plan runs it (a persistent exchange, the op's ufunc on bound
            buffers), in older records; empty now, and those sizes are
            priced with ``steps``.
        own: ``(algorithm, buffer bytes, seconds)``: the algorithm's own work
            in an ordinary all-reduce of that size, its exchanges and
            reductions left out (chunk arithmetic, views, its loop). Empty in
            an older record.

        inter_alpha: seconds per message between two nodes (0: one level, the
            ranks measured all on one node).
        inter_beta: seconds per byte between two nodes, one flow on the link
            (0: one level).
        nodes: nodes the measurement's ranks were on (0 or 1: one level).
        per_node: ranks per node then (the most on one node).
        rack_beta: seconds per byte through one rack's uplink, all of it (0: no
            racks); from the topology file, never measured.
        rack_nodes: nodes in each rack (0: no racks). The ranks' racks must be
            equal and consecutive in rank order for both to be set
            (:func:`refcoll.core.topology.rack_levels`).

    ``auto``'s calibrations leave the tables empty; the cluster model's
    (:func:`refcoll.model.calibrate`) fill them. A calibration measured
    across nodes is *two-level*: ``alpha`` and ``beta`` inside a node,
    ``inter_alpha`` and ``inter_beta`` across (:meth:`link`).
    """

    alpha: float
    beta: float
    gamma: float
    source: str = "default"
    key: str = ""
    measured_at: float | None = None
    load: float | None = None
    ranks: int = 0
    call: float = 0.0
    pingpong: tuple[tuple[int, float], ...] = ()
    reduction: tuple[tuple[int, float], ...] = ()
    steps: tuple[tuple[int, int, float, float, float, float], ...] = ()
    waits: tuple[tuple[int, int, float, float, float, float], ...] = ()
    stretch: tuple[tuple[int, int, tuple[float, ...]], ...] = ()
    planned_call: float = 0.0
    planned_steps: tuple[tuple[int, int, float, float, float, float], ...] = ()
    own: tuple[tuple[str, int, float], ...] = ()
    inter_alpha: float = 0.0
    inter_beta: float = 0.0
    nodes: int = 0
    per_node: int = 0
    rack_beta: float = 0.0
    rack_nodes: int = 0

    @property
    def two_level(self) -> bool:
        """Return whether α and β were measured across nodes as well as inside one."""
        return self.nodes > 1 and self.inter_beta > 0

    def link(self, kind: str, per_node: int) -> tuple[float, float]:
        """Return ``(α, β)`` of one phase's link, with ``per_node`` ranks on each node.

        ``intra``: inside a node. ``inter``: across nodes with every rank of a
        node crossing at once, so each flow has ``1/per_node`` of the node's link
        (one NIC a node, as measured). ``flat``: a flat ring's step, in which one
        rank of each node crosses. ``slowest``: a step that uses both kinds and
        waits for the slower, every rank crossing. ``local``: no message.
        One-level calibrations give ``(alpha, beta)`` for every kind but ``local``.
        """
        if kind == "local":
            return 0.0, 0.0
        if not self.two_level or kind == "intra":
            return self.alpha, self.beta
        flows = 1 if kind == "flat" else max(per_node, 1)
        inter = (self.inter_alpha, self.inter_beta * flows)
        if kind == "inter":
            return inter
        return max(self.alpha, inter[0]), max(self.beta, inter[1])

    def price(self, parts, per_node: int, itemsize: int) -> float:
        """Return the α-β-γ seconds of ``parts`` (:class:`~refcoll.algorithms.registry.LinkCost`).

        Each phase's counts at its link's α and β (:meth:`link`), and γ per
        element combined scaled to ``itemsize``. A phase whose flows cross the
        racks' uplinks (its ``uplink``) waits for the slower of its link and
        its share of the uplink, ``rack_beta × uplink`` a byte.

        Phases that are one segment's of a pipeline of ``S`` (their
        ``segments``) overlap: the first segment runs through every phase, the
        other ``S-1`` follow at the pace of the busiest resource. The phases of
        one ``stage`` run one after another (one thread runs them; a phase
        without a stage is one of its own), and every phase that crosses
        nodes shares the nodes' links, and the uplinks, with the others: a
        stage inside a rack and one across racks still take turns on the
        node links.
        """
        gamma = self.gamma_per_byte * itemsize
        seconds, stages, links, uplinks = [], {}, 0.0, 0.0
        for part in parts:
            alpha, beta = self.link(part.link, per_node)
            shared = self.rack_beta * part.uplink if part.uplink and self.rack_beta else 0.0
            if shared:
                alpha = max(alpha, self.inter_alpha)
            nbytes = part.cost.critical_bytes
            t = part.cost.rounds * alpha + nbytes * max(beta, shared) + part.cost.reduced * gamma
            seconds.append(t)
            stages[part.stage or part.name] = stages.get(part.stage or part.name, 0.0) + t
            if self.two_level and part.link not in ("intra", "local"):
                links += nbytes * beta
            uplinks += nbytes * shared
        segments = max((part.segments for part in parts), default=1)
        pace = max(max(stages.values(), default=0.0), links, uplinks)
        return sum(seconds) + (segments - 1) * pace

    @property
    def gamma_per_byte(self) -> float:
        """Return γ in seconds per byte of one operand combined."""
        return self.gamma / GAMMA_ITEMSIZE

    def age(self, now: float | None = None) -> float | None:
        """Return seconds since the measurement (None for a fixed calibration)."""
        if self.measured_at is None:
            return None
        return (time.time() if now is None else now) - self.measured_at

    def to_json(self) -> dict:
        """Return the calibration as a JSON-ready dict, γ both per element and per byte."""
        return {"ranks": self.ranks, "alpha": self.alpha, "beta": self.beta,
                "gamma": self.gamma, "gamma_per_byte": self.gamma_per_byte, "call": self.call,
                "source": self.source, "key": self.key, "measured_at": self.measured_at,
                "load": self.load,
                "pingpong": [{"bytes": b, "seconds": s} for b, s in self.pingpong],
                "reduction": [{"bytes": b, "seconds": s} for b, s in self.reduction],
                "steps": [{"buffer": n, "message": b, "first": f, "later": e,
                           "reduction_first": rf, "reduction_later": rl}
                          for n, b, f, e, rf, rl in self.steps],
                "waits": [{"buffer": n, "message": b, "q_first": qf, "wait_first": wf,
                           "q_later": ql, "wait_later": wl}
                          for n, b, qf, wf, ql, wl in self.waits],
                "stretch": [{"buffer": n, "message": b, "rounds": list(values)}
                            for n, b, values in self.stretch],
                "planned_call": self.planned_call,
                "planned_steps": [{"buffer": n, "message": b, "first": f, "later": e,
                                   "reduction_first": rf, "reduction_later": rl}
                                  for n, b, f, e, rf, rl in self.planned_steps],
                "own": [{"algorithm": a, "buffer": n, "seconds": s} for a, n, s in self.own],
                "inter_alpha": self.inter_alpha, "inter_beta": self.inter_beta,
                "nodes": self.nodes, "per_node": self.per_node,
                "rack_beta": self.rack_beta, "rack_nodes": self.rack_nodes}


#: Shared-memory MPI on a current CPU: ~3 µs latency, ~4 GB/s, ~1 G additions/s.
DEFAULT = Calibration(alpha=3e-6, beta=1 / 4e9, gamma=1e-9, source="default")
