"""One simulated collective held against its algorithm's cost formula: ``refcoll simulate``.

:func:`simulation_case` checks what to simulate (before any memory is spent),
:func:`run_simulation` runs it on :func:`refcoll.simulate`'s threads and returns
a :class:`SimulationReport`: the ledger's counts beside the cost formula's, the
bytes inside and between nodes when a node size is given (beside the
algorithm's own prediction of them where it has one), and each rank's traffic.

The node size reaches the algorithm only through its record's ``node_option``
(hierarchical's ``ranks_per_node``); the predicted split is its
``node_traffic``. Nothing here names an algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import algorithms
from ..algorithms._nodes import node_traffic as measured_node_traffic
from ..algorithms.spelling import spell
from ..calls import collectives
from ..calls.auto import resolve_with_options
from ..core.cost import Cost
from ..core.errors import UsageError
from ..core.ops import check_supported, dtype_name, get_dtype, get_op
from ..transport.base import Ledger
from ..transport.ledger_only import LedgerTransport, LedgerWorld
from ..transport.sim import MAX_SIMULATED_RANKS
from .conformance.cases import ROOTED
from .inputs import make_inputs

__all__ = ["MAX_SIMULATED_RANKS", "COMPARED", "SimulationCase", "NodeTraffic",
           "RankTraffic", "SimulationReport", "simulation_bytes", "simulation_case",
           "run_simulation"]


#: The counts compared, as :meth:`Cost.counts` and :meth:`Ledger.counts` name
#: them, with the label ``refcoll simulate`` prints for each.
COMPARED = (("rounds", "rounds"), ("messages", "messages"), ("bytes", "bytes"),
            ("max_rank_messages", "max rank messages"), ("max_rank_bytes", "max rank bytes"),
            ("critical_bytes", "critical-path bytes"), ("reduced", "max rank reduced"))

#: The bytes the ledger keeps per message (measured: about 480 for a ring of 1024 and of
#: 2048 ranks, one element each, ``--ledger-only``).
LEDGER_BYTES = 512


def simulation_bytes(collective: str, p: int, count: int, itemsize: int) -> int:
    """Return an upper estimate of the bytes :func:`refcoll.simulate` allocates.

    Per rank and element: the input, the output (allgather's is ``p`` inputs
    long, and bruck packs what it sends and receives in as much again), one
    receive or accumulation buffer in the dtype, and 8 bytes for the wider
    temporaries (the float64 or int64 draws of the inputs, the switch processes'
    accumulators). Measured peaks stay under it for every algorithm.
    """
    outputs = 2 * p if collective == "allgather" else 1
    return p * count * (itemsize * (2 + outputs) + 8)


@dataclass(frozen=True)
class SimulationCase:
    """One checked simulation: what runs, on how many ranks, with which options.

    Attributes:
        algorithm: the algorithm's name; collective: the collective it runs.
        p: the simulated data ranks; count: elements per rank.
        dtype: the dtype's name; op: the op's canonical name.
        options: what :func:`refcoll.simulate` is given beside them (``root``
            for rooted collectives, the node size under the algorithm's
            ``node_option``).
        ranks_per_node: the node size the traffic is split by, or None.
        chosen: for ``auto``, the algorithm it runs and its options (resolved under
            the same settings as the run: ``REFCOLL_ALGO``, the tuning file, the
            world's nodes); what runs, is priced and is estimated. None otherwise.
    """

    algorithm: str
    collective: str
    p: int
    count: int
    dtype: str
    op: str
    options: dict
    ranks_per_node: int | None = None
    chosen: tuple | None = None

    @property
    def itemsize(self) -> int:
        """Return the bytes of one element."""
        return get_dtype(self.dtype).itemsize

    @property
    def cost_options(self) -> dict:
        """Return the options the cost formula and the node prediction take: those of the
        algorithm that runs (:meth:`runs`), without the root."""
        return {k: v for k, v in self.runs()[1].items() if k != "root"}

    def runs(self) -> tuple[str, dict]:
        """Return the algorithm that runs and its options, root and node size included
        (``auto``'s choice, spelled out: :attr:`chosen`)."""
        if self.chosen is None:
            return self.algorithm, dict(self.options)
        name, options = self.chosen
        options = dict(options, **{k: v for k, v in self.options.items() if k == "root"})
        node_option = algorithms.get(name).node_option
        if node_option is not None and self.ranks_per_node is not None:
            options.setdefault(node_option, self.ranks_per_node)  # the world's nodes
        return name, options

    def memory_bytes(self, moves_data: bool = True) -> int:
        """Return the upper estimate of the memory the run allocates: the data
        (:func:`simulation_bytes`; ledger-only, one rank's share: the ranks run one after
        another on inputs never written) and the ledger, :data:`LEDGER_BYTES` for each
        message the cost formula counts (a ring's ``2p(p-1)``: 16 GiB at 4096 ranks)."""
        algo = algorithms.get(self.runs()[0])
        messages = 0
        if self.collective in algo.costs:
            shape = (self.p, self.count, self.itemsize)
            cost = algo.costs[self.collective]
            if self.collective == "allreduce" and algo.model_cost_exact \
                    and not self.cost_options:  # the same counts, without a replay
                cost = algo.model_cost
            messages = cost(*shape, **self.cost_options).counts().get("messages", 0)
        data = simulation_bytes(self.collective, self.p, self.count, self.itemsize)
        return (data if moves_data else -(-data // self.p)) + LEDGER_BYTES * messages

    def describe(self) -> str:
        """Return what the run does, for messages: ``simulating allreduce on 4 ranks of ...``."""
        return (f"simulating {self.collective} on {self.p} ranks of {self.count} x "
                f"{self.dtype}")


def simulation_case(algorithm: str, p: int, count: int, *, collective: str = "allreduce",
                    dtype: str = "float32", op: str = "sum", root: int | None = None,
                    ranks_per_node: int | None = None) -> SimulationCase:
    """Check a simulation's arguments and return its :class:`SimulationCase`.

    ``ranks_per_node=k`` puts consecutive ranks ``r // k`` on one node: the
    report splits the bytes by it, and an algorithm with a ``node_option``
    takes it as its node shape.

    Raises:
        UsageError: ``p`` outside 1..:data:`MAX_SIMULATED_RANKS`, a negative
            count, an unknown algorithm, collective, dtype or op, an op the
            dtype does not support, or ``ranks_per_node`` below 1.
    """
    if p < 1:
        raise UsageError(f"-p {p}: a simulation needs at least 1 rank; give -p 1 or more")
    if p > MAX_SIMULATED_RANKS:
        raise UsageError(f"-p {p}: simulated ranks are threads of this one process, so at "
                         f"most {MAX_SIMULATED_RANKS}; give -p {MAX_SIMULATED_RANKS} or fewer "
                         "(the cost formulas of `refcoll list` hold for any p)")
    if count < 0:
        raise UsageError(f"--count {count}: the element count per rank must be 0 or more")
    algo = algorithms.get(algorithm)
    algorithms.implementation(algorithm, collective)
    dt = get_dtype(dtype)
    reduction = get_op(op)
    check_supported(reduction, dt)
    if ranks_per_node is not None and ranks_per_node < 1:
        raise UsageError(f"--ranks-per-node must be at least 1, got {ranks_per_node}")
    if root is None:
        root = 0
    elif collective not in ROOTED:
        raise UsageError(f"--root {root}: {collective} has no root (broadcast and reduce do)")
    options = {"root": root} if collective in ROOTED else {}
    if algo.node_option is not None and ranks_per_node is not None:
        options[algo.node_option] = ranks_per_node
    chosen = None
    if algo.chooses:  # what auto runs here: the run, its price and its memory are that
        t = LedgerTransport(LedgerWorld(p, ranks_per_node=ranks_per_node), 0)
        name, chosen_options = resolve_with_options(t, collective, count, dt.itemsize)
        chosen = (name, chosen_options)
    return SimulationCase(algorithm, collective, p, count, dtype_name(dt), reduction.name, options,
                          ranks_per_node, chosen)


@dataclass(frozen=True)
class NodeTraffic:
    """The bytes of a run inside nodes and between them, for one node size.

    ``predicted`` is the algorithm's ``node_traffic`` for the same shape, or
    None where the algorithm predicts no split.
    """

    ranks_per_node: int
    intra: int
    inter: int
    predicted: tuple[int, int] | None

    def to_json(self) -> dict:
        """Return it as ``simulate --json`` writes it."""
        return {"ranks_per_node": self.ranks_per_node, "intra": self.intra, "inter": self.inter,
                "predicted": list(self.predicted) if self.predicted is not None else None}


@dataclass(frozen=True)
class RankTraffic:
    """One simulated rank's messages and bytes; ``switch`` for ranks that hold no data."""

    rank: int
    messages: int
    sent: int
    received: int
    switch: bool


@dataclass(frozen=True)
class SimulationReport:
    """What :func:`run_simulation` found.

    Attributes:
        case: the simulation.
        ledger: every message and reduction of the run.
        predicted: the cost formula's counts, or None for a collective without one.
        node: the split by node, when the case has a node size.
        ranks: every rank of the simulated world, switches after the data ranks.
        chosen: what ``auto`` ran (spelled with its options, ``tree(segment=8)``), whose
            cost ``predicted`` is; None for a named algorithm.
    """

    case: SimulationCase
    ledger: Ledger
    predicted: Cost | None
    node: NodeTraffic | None
    ranks: tuple[RankTraffic, ...]
    chosen: str | None = None

    def comparison(self) -> list[tuple[str, int, int | None]]:
        """Return ``(label, ledger count, formula count or None)`` for each of :data:`COMPARED`."""
        counts = self.ledger.counts()
        want = self.predicted.counts() if self.predicted is not None else {}
        return [(label, counts[field], want.get(field)) for field, label in COMPARED]

    def to_json(self) -> dict:
        """Return the report as ``refcoll simulate --json`` writes it."""
        c = self.case
        return {"algorithm": c.algorithm, "chosen": self.chosen, "collective": c.collective,
                "p": c.p, "count": c.count,
                "dtype": c.dtype, "op": c.op, "ledger": self.ledger.summary(),
                "cost": self.predicted.counts() if self.predicted is not None else None,
                "formula": self.predicted.formula if self.predicted is not None else None,
                "node_traffic": self.node.to_json() if self.node is not None else None}


def run_simulation(case: SimulationCase, *, moves_data: bool = True) -> SimulationReport:
    """Run ``case`` on simulated ranks (exact inputs) and hold its ledger against its costs.

    ``moves_data=False``: the ledger-only world (the same ledger, no data, no threads).
    """
    dtype = get_dtype(case.dtype)
    if moves_data:
        inputs = make_inputs("exact", dtype, case.count, case.p, op=case.op)
    else:  # the schedule depends on sizes alone: zeros, whose pages are never touched
        inputs = [np.zeros(case.count, dtype) for _ in range(case.p)]
    name, run_options = case.runs()  # auto: its choice, on the world's nodes as named ones
    result = collectives.simulate(case.collective, inputs, algorithm=name, op=case.op,
                                  moves_data=moves_data, node_size=case.ranks_per_node,
                                  **run_options)
    ledger = result.ledger
    shape = (case.p, case.count, case.itemsize)
    algo, options = algorithms.get(name), case.cost_options  # auto: what it ran, priced
    chosen = spell(*case.chosen) if case.chosen is not None else None
    predicted = (algo.costs[case.collective](*shape, **options)
                 if case.collective in algo.costs else None)
    node = None
    if case.ranks_per_node is not None:
        intra, inter = measured_node_traffic(ledger, case.ranks_per_node)
        want = (tuple(algo.node_traffic(*shape, **options))
                if algo.node_traffic is not None else None)
        node = NodeTraffic(case.ranks_per_node, intra, inter, want)
    sent, received, msgs = ledger.bytes_sent(), ledger.bytes_received(), ledger.messages_sent()
    ranks = tuple(RankTraffic(r, msgs.get(r, 0), sent.get(r, 0), received.get(r, 0), r >= case.p)
                  for r in range(result.world.size))
    return SimulationReport(case, ledger, predicted, node, ranks, chosen)
