"""The registry: one record per algorithm, holding every fact other code needs about it.

An implementation has one of these signatures, by collective:

* ``allreduce(t, x, out, *, op, **options)``: ``out`` may be ``x`` (in place);
* ``reduce_scatter(t, x, out, *, op, **options)``: ``out`` is chunk ``t.rank``;
* ``allgather(t, out, **options)``: in place, block ``t.rank`` filled on entry;
* ``broadcast(t, buf, *, root, **options)``: in place;
* ``reduce(t, x, out, *, op, root, **options)``: ``out`` written on the root only.

``x`` and ``out`` are flat, C-contiguous arrays; ``op`` is the base combine of
:mod:`refcoll.core.ops` (``avg`` is finished by the caller). The options an
implementation takes are its keyword-only parameters other than ``op``, ``root``
and ``out`` (:func:`options`), and :func:`check_options` refuses any other before
a collective moves data.

Each algorithm module ends with ``register(Algorithm(...))``; the package imports
every module it holds, so adding an algorithm is adding its module. Code outside
an algorithm's module never names it: it reads the record (``replayable``,
``auto``, ``node_option``, ``price``...) instead.

The cluster model (:mod:`refcoll.model`) prices an algorithm on a
cluster of ``nodes`` nodes of ``per_node`` GPUs through the record's ``price``:
the algorithm says which of its phases run on which link (:class:`LinkCost`),
with exact counts, and the model puts α, β and γ on them.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Callable, Mapping, NamedTuple

from ..core.cost import Cost
from ..core.errors import UsageError

__all__ = ["Algorithm", "REGISTRY", "COLLECTIVES", "register", "get", "implementation", "names",
           "options", "check_options", "NodeShape", "LinkCost", "over_racks"]

#: The collectives, in the order the CLI lists them.
COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce")


@dataclass(frozen=True)
class NodeShape:
    """The shape the cluster model prices on: ``nodes`` nodes of ``per_node`` ranks each.

    ``equal=False`` marks nodes of different sizes, ``per_node`` their largest
    (``auto``'s shape of a real job); ``ranks`` then counts every node as full.
    ``racks > 1``: the nodes sit in that many racks of :attr:`per_rack`
    consecutive nodes each, joined by uplinks (a fat tree's aggregation layer);
    a phase that crosses them says how many flows share each uplink
    (:attr:`LinkCost.uplink`).
    """

    nodes: int
    per_node: int
    in_network: bool = False
    equal: bool = True  # every node holds per_node ranks (False: per_node is the most on one)
    racks: int = 1

    @property
    def ranks(self) -> int:
        """Return every rank of the cluster."""
        return self.nodes * self.per_node

    @property
    def per_rack(self) -> int:
        """Return the nodes of one rack (all of them on one rack)."""
        return self.nodes // max(self.racks, 1)

    @property
    def rack_ranks(self) -> int:
        """Return the ranks of one rack."""
        return self.per_node * self.per_rack

    @property
    def all_cross(self) -> int:
        """Return the flows on each uplink when every rank of a rack crosses at once (0
        without racks): the ``uplink`` of an exchange whose partners are in other racks."""
        return self.rack_ranks if self.racks > 1 else 0

    def among_nodes(self) -> "NodeShape":
        """Return the shape of an algorithm run among the nodes, one member a node:
        one rank a node, or, with racks, the racks as its nodes (:func:`over_racks`)."""
        if self.racks > 1:
            return NodeShape(self.racks, self.per_rack)
        return NodeShape(self.nodes, 1)

    def levels(self) -> str:
        """Return how an algorithm over all ranks meets the links.

        ``intra`` or ``inter`` when only one kind is used, ``split`` when nodes and
        ranks per node are powers of two (exchanges at distance ``< per_node``
        stay in the node), else ``slowest``.
        """
        if self.nodes == 1:
            return "intra"
        if self.per_node == 1:
            return "inter"
        if _pow2(self.nodes) and _pow2(self.per_node):
            return "split"
        return "slowest"

    def ring_link(self) -> str:
        """Return the link a flat ring's steps wait for: every step uses every link at once."""
        levels = self.levels()
        return "slowest" if levels == "split" else levels

    def flat_ring_link(self) -> str:
        """Return the link of one flat ring over all ranks, node-major: ``flat`` across nodes.

        Each step crosses every node boundary once, on one GPU's NIC, so the
        cluster prices the crossing as one flow (``flat``), not as every GPU of
        the node sharing the node's NICs.
        """
        link = self.ring_link()
        return "flat" if link == "slowest" else link


def _pow2(x: int) -> bool:
    return x & (x - 1) == 0


class LinkCost(NamedTuple):
    """One phase of an algorithm on a cluster: its name, the link it waits for, its counts.

    ``link`` is ``intra``, ``inter`` or ``slowest`` (the slower of the two: a
    round that uses both waits for it), or ``local`` for work without messages.
    ``segments``: the phase is one segment's of a pipeline of that many, whose
    phases overlap (:meth:`~refcoll.core.calibration.Calibration.price`).
    ``uplink``: the flows that share each rack's uplink at once during the
    phase, on a shape with racks (0: the phase stays inside the racks).
    ``stage``: in a pipeline, the phases of one stage run one after another
    (one thread runs them) while different stages overlap; empty: a stage of
    its own.
    """

    name: str
    link: str
    cost: Cost
    segments: int = 1
    uplink: int = 0
    stage: str = ""


def over_racks(parts, shape: NodeShape, *, parallel: int = 1, segments: int = 1
               ) -> list[LinkCost]:
    """Return the phases of an algorithm run among ``shape``'s nodes, crossing its racks.

    ``parts`` is the algorithm's price on :meth:`NodeShape.among_nodes`, whose
    nodes are the racks: its ``intra`` phases stay inside a rack (on the
    nodes' links), its ``flat`` ones send one flow across each rack's uplink,
    and its ``inter`` and ``slowest`` ones send every node of the rack across.
    ``parallel`` instances run at once (one per rank of a node, each among the
    nodes), so every crossing is that many flows, on the node links
    (``inter``) and on the uplinks. Without racks every part is ``inter`` with
    no uplink. ``segments``: the pipeline the phases are one segment's of, in
    one stage (``across``).
    """
    out = []
    for part in parts:
        if part.link == "local":
            out.append(part._replace(segments=segments, stage="across"))
            continue
        crossing = 0 if shape.racks < 2 else {"intra": 0, "flat": 1}.get(part.link, shape.per_rack)
        out.append(part._replace(link="inter", segments=segments, uplink=crossing * parallel,
                                 stage="across"))
    return out


@dataclass(frozen=True)
class Algorithm:
    """One algorithm: its implementations, its costs, and every fact other code needs.

    Attributes:
        name: the name users pass (``algorithm="ring"``).
        summary: one line for ``refcoll list``.
        implementations: collective name -> function (signatures above).
        costs: collective name -> ``cost(p, n, itemsize, **options) -> Cost``.
        spec: the page in ``spec/`` that specifies it.
        order: its place in every list (``refcoll list``, the battery, the vectors).
        battery_options: option sets the conformance battery runs every case
            with (small segments, odd node shapes), so edge paths run.
        vector_variants: option sets of its golden vectors: the first on the
            whole grid, the others on a few cases (:mod:`refcoll.verify.vectors`).
        extra_ranks: for algorithms that need processes holding no input (the
            switches of in-network reduction): ``extra_ranks(workers, **options)``
            is how many to add after the ``workers`` data ranks. ``None``: none.
        workers: the inverse, ``workers(total_ranks, **options)``; required with
            ``extra_ranks``.
        replayable: its all-reduce, on two or more ranks, touches data only
            through the transport (no local copies), so a recorded schedule
            replays it exactly (:mod:`refcoll.transport.recorder`). A function
            ``replayable(t, **options) -> bool`` where that depends on the
            transport or the options (the hierarchical all-reduce's node shape).
        auto: ``algorithm="auto"`` considers it (it needs ``costs``).
        pinnable: ``REFCOLL_ALGO`` may name it.
        node_option: the option through which it takes the node shape
            (``ranks_per_node``); code that knows the real nodes passes their
            size under this name. ``None``: the node shape does not matter.
        node_traffic: ``(p, n, itemsize, **options) -> (intra_bytes, inter_bytes)``
            predicted for a node size, or ``None``.
        price: ``price(shape, count, itemsize, *, inter) -> list[LinkCost]``, its
            all-reduce phase by phase on a cluster of :class:`NodeShape`; ``inter``
            is the algorithm across nodes where it has one. ``None``: the cluster
            model does not price it.
        model_cost: ``(p, count, itemsize) -> Cost`` of its all-reduce as the
            cluster model counts it flat (default: ``costs["allreduce"]``).
        model_cost_exact: ``model_cost`` equals ``costs["allreduce"]`` at its default
            options (a closed form of the same counts, not an ideal), so an estimate
            may take it instead of a cost that replays the schedule.
        across_nodes: it may be a hierarchical all-reduce's algorithm across nodes.
        needs_in_network: it runs only where the network reduces (switches).
        chooses: it runs another algorithm it picks per call (``auto``), so an
            option belongs to a named algorithm instead.
        orders: ``orders(collective, p) -> [options, ...]``: the option sets under
            which its ``collective`` on ``p`` ranks reduces in a distinct order (ring
            direction, a tree's radix...), the first its default ``{}``. ``refcoll
            check --identify`` runs every one; ``None``: its default order only.
    """

    name: str
    summary: str
    implementations: Mapping[str, Callable]
    costs: Mapping[str, Callable] = field(default_factory=dict)
    spec: str = ""
    order: int = 100
    battery_options: tuple = ({},)
    vector_variants: tuple = ({},)
    extra_ranks: Callable | None = None
    workers: Callable | None = None
    replayable: bool | Callable = False
    auto: bool = False
    pinnable: bool = True
    node_option: str | None = None
    node_traffic: Callable | None = None
    price: Callable | None = None
    model_cost: Callable | None = None
    model_cost_exact: bool = False
    across_nodes: bool = False
    needs_in_network: bool = False
    chooses: bool = False
    orders: Callable | None = None

    def reduction_orders(self, collective: str, p: int) -> list[dict]:
        """Return the option sets of its distinct reduction orders (:attr:`orders`)."""
        return list(self.orders(collective, p)) if self.orders else [{}]

    @property
    def collectives(self) -> tuple[str, ...]:
        """Return the collectives it implements, in :data:`COLLECTIVES` order."""
        return tuple(c for c in COLLECTIVES if c in self.implementations)

    def flat_cost(self, p: int, count: int, itemsize: int) -> Cost:
        """Return its all-reduce's counts as the cluster model takes them (:attr:`model_cost`)."""
        fn = self.model_cost or self.costs["allreduce"]
        return fn(p, count, itemsize)


REGISTRY: dict[str, Algorithm] = {}


def register(algo: Algorithm) -> Algorithm:
    """Add an algorithm to the registry (names are unique), keeping :attr:`Algorithm.order`."""
    if algo.name in REGISTRY:
        raise ValueError(f"algorithm {algo.name!r} is registered twice")
    entries = sorted([*REGISTRY.values(), algo], key=lambda a: a.order)
    REGISTRY.clear()  # the same dict object: every importer sees the new entry in its place
    REGISTRY.update((a.name, a) for a in entries)
    return algo


def names(collective: str | None = None) -> list[str]:
    """Return the registered algorithm names, those implementing ``collective`` if given."""
    return [a.name for a in REGISTRY.values()
            if collective is None or collective in a.implementations]


def get(name: str) -> Algorithm:
    """Return the algorithm called ``name``; raise :class:`UsageError` for unknown names."""
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise UsageError(
            f"unknown algorithm {name!r}: choose one of {', '.join(REGISTRY)}"
        ) from None


def implementation(name: str, collective: str) -> Callable:
    """Return ``name``'s implementation of ``collective``; :class:`UsageError` if it has none."""
    if collective not in COLLECTIVES:
        raise UsageError(f"unknown collective {collective!r}: choose one of "
                         f"{', '.join(COLLECTIVES)}")
    algo = get(name)
    try:
        return algo.implementations[collective]
    except KeyError:
        raise UsageError(
            f"algorithm {name!r} does not implement {collective}: it implements "
            f"{', '.join(algo.collectives)}; algorithms with {collective}: "
            f"{', '.join(names(collective))}"
        ) from None


#: Keyword-only parameters the collective fills in itself: never user options.
_CALL_PARAMETERS = frozenset({"op", "root", "out"})


@functools.lru_cache(maxsize=None)
def _keyword_options(fn: Callable) -> tuple[str, ...]:
    return tuple(param.name for param in inspect.signature(fn).parameters.values()
                 if param.kind is param.KEYWORD_ONLY and param.name not in _CALL_PARAMETERS)


def options(name: str, collective: str) -> tuple[str, ...]:
    """Return the options ``name``'s ``collective`` takes (``segment``, ``ranks_per_node``...).

    They are the implementation's keyword-only parameters other than ``op``,
    ``root`` and ``out``, in signature order.
    """
    return _keyword_options(implementation(name, collective))


def check_options(name: str, collective: str, given: Mapping, *, rank: int | None = None) -> None:
    """Refuse options ``name``'s ``collective`` does not take, before any data moves.

    Args:
        name: the algorithm.
        collective: the collective it runs.
        given: the options the caller passed (``{"segment": 4}``).
        rank: the calling rank, named in the message.

    Raises:
        UsageError: an unknown algorithm or collective, or an option it does not
            take; the message lists the options it does take and the algorithms
            that take the refused ones.
    """
    taken = options(name, collective)
    unknown = sorted(set(given) - set(taken))
    if not unknown:
        return
    where = f"rank {rank}: " if rank is not None else ""
    for argument, takers in (("op", "allreduce, reduce_scatter and reduce"),
                             ("root", "broadcast and reduce")):
        if argument in unknown:  # a collective's argument, not an algorithm's option
            raise UsageError(f"{where}{collective} takes no {argument} (only {takers} do); "
                             f"drop {argument}=")
    them = "it" if len(unknown) == 1 else "them"
    others = [other for other in names(collective)
              if other != name and set(unknown) <= set(options(other, collective))]
    if get(name).chooses and others:
        fix = f"name an algorithm that takes {them} instead: {', '.join(others)}"
    elif others:
        fix = f"drop {them}, or choose an algorithm that takes {them}: {', '.join(others)}"
    else:
        fix = f"drop {them}"
    if not taken:
        raise UsageError(f"{where}algorithm {name!r} takes no algorithm options for "
                         f"{collective} (got {', '.join(unknown)}); {fix}")
    noun = "option" if len(unknown) == 1 else "options"
    raise UsageError(f"{where}algorithm {name!r} does not take the {noun} {', '.join(unknown)} "
                     f"for {collective}: its {collective} takes {', '.join(taken)}; {fix}")
