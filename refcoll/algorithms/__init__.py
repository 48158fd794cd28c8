"""The registry: every algorithm, the collectives it implements, and their costs.

An implementation has one of these signatures, by collective:

* ``allreduce(t, x, out, *, op, **options)``: ``out`` may be ``x`` (in place);
* ``reduce_scatter(t, x, out, *, op, **options)``: ``out`` is chunk ``t.rank``;
* ``allgather(t, out, **options)``: in place, block ``t.rank`` filled on entry;
* ``broadcast(t, buf, *, root, **options)``: in place;
* ``reduce(t, x, out, *, op, root, **options)``: ``out`` written on the root only.

``x`` and ``out`` are flat, C-contiguous arrays; ``op`` is the base combine of
:mod:`refcoll.core.ops` (``avg`` is finished by the caller). The options an
implementation takes are its keyword-only parameters other than ``op``, ``root``
and ``out`` (:func:`options`); a catch-all ``**kwargs`` adds none, and
:func:`check_options` refuses any other before a collective moves data.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Callable, Mapping

from ..core import cost as _cost
from ..core.errors import UsageError
from . import hierarchical, naive, recursive, ring, switch, tree

__all__ = ["Algorithm", "REGISTRY", "COLLECTIVES", "get", "implementation", "names", "options",
           "check_options"]

#: The collectives, in the order the CLI lists them.
COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce")


@dataclass(frozen=True)
class Algorithm:
    """One algorithm family member: its implementations and cost functions.

    Attributes:
        name: the name users pass (``algorithm="ring"``).
        summary: one line for ``refcoll list``.
        implementations: collective name -> function (signatures above).
        costs: collective name -> ``cost(p, n, itemsize) -> Cost``.
        spec: the page in ``spec/`` that specifies it.
        battery_options: option sets the conformance battery runs every case
            with (small segments, odd node shapes), so edge paths run.
        extra_ranks: for algorithms that need processes holding no input (the
            switches of in-network reduction): ``extra_ranks(workers, **options)``
            is how many to add after the ``workers`` data ranks. ``None``: none.
        workers: the inverse, ``workers(total_ranks, **options)``; required with
            ``extra_ranks``.
    """

    name: str
    summary: str
    implementations: Mapping[str, Callable]
    costs: Mapping[str, Callable] = field(default_factory=dict)
    spec: str = ""
    battery_options: tuple = ({},)
    extra_ranks: Callable | None = None
    workers: Callable | None = None

    @property
    def collectives(self) -> tuple[str, ...]:
        return tuple(c for c in COLLECTIVES if c in self.implementations)


REGISTRY: dict[str, Algorithm] = {}


def register(algo: Algorithm) -> Algorithm:
    """Add an algorithm to the registry (names are unique)."""
    if algo.name in REGISTRY:
        raise ValueError(f"algorithm {algo.name!r} is registered twice")
    REGISTRY[algo.name] = algo
    return algo


register(Algorithm(
    "naive",
    "everything through rank 0 in rank order: the reference every variant is checked against",
    {
        "allreduce": naive.naive_allreduce,
        "reduce_scatter": naive.naive_reduce_scatter,
        "allgather": naive.naive_allgather,
        "broadcast": naive.naive_broadcast,
        "reduce": naive.naive_reduce,
    },
    {
        "allreduce": _cost.naive_allreduce,
        "reduce_scatter": _cost.naive_reduce_scatter,
        "allgather": _cost.naive_allgather,
        "broadcast": _cost.naive_broadcast,
        "reduce": _cost.naive_reduce,
    },
    "spec/naive.md",
))

register(Algorithm(
    "ring",
    "ring reduce-scatter + ring allgather: bandwidth-optimal, 2(p-1) rounds",
    {
        "allreduce": ring.ring_allreduce,
        "reduce_scatter": ring.ring_reduce_scatter,
        "allgather": ring.ring_allgather,
    },
    {
        "allreduce": _cost.ring_allreduce,
        "reduce_scatter": _cost.ring_reduce_scatter,
        "allgather": _cost.ring_allgather,
    },
    "spec/ring.md",
))

register(Algorithm(
    "hierarchical",
    "ring reduce-scatter in each node, all-reduce across nodes, ring allgather in each node",
    {"allreduce": hierarchical.hierarchical_allreduce},
    {"allreduce": _cost.hierarchical_allreduce},
    "spec/hierarchical.md",
    battery_options=({"ranks_per_node": 2}, {"ranks_per_node": 3}, {}),
))

register(Algorithm(
    "recursive_doubling",
    "lg p exchanges of the whole buffer with rank ^ mask (MPICH fold for other p): short messages",
    {"allreduce": recursive.recursive_doubling_allreduce},
    {"allreduce": _cost.recursive_doubling_allreduce},
    "spec/recursive_doubling.md",
))

register(Algorithm(
    "rabenseifner",
    "recursive-halving reduce-scatter + recursive-doubling allgather: 2 lg p rounds, ring's bytes",
    {
        "allreduce": recursive.rabenseifner_allreduce,
        "reduce_scatter": recursive.rabenseifner_reduce_scatter,
        "allgather": recursive.rabenseifner_allgather,
    },
    {
        "allreduce": _cost.rabenseifner_allreduce,
        "reduce_scatter": _cost.rabenseifner_reduce_scatter,
        "allgather": _cost.rabenseifner_allgather,
    },
    "spec/rabenseifner.md",
))

register(Algorithm(
    "tree",
    "binomial reduce to rank 0 + binomial broadcast (MPICH): 2⌈lg p⌉ rounds of the whole buffer",
    {
        "allreduce": tree.tree_allreduce,
        "reduce": tree.tree_reduce,
        "broadcast": tree.tree_broadcast,
    },
    {
        "allreduce": _cost.tree_allreduce,
        "reduce": _cost.tree_reduce,
        "broadcast": _cost.tree_broadcast,
    },
    "spec/tree.md",
    battery_options=({}, {"segment": 1024}),
))

register(Algorithm(
    "dbtree",
    "NCCL's double binary tree: two complementary in-order trees, a half each, pipelined",
    {"allreduce": tree.dbtree_allreduce},
    {"allreduce": _cost.dbtree_allreduce},
    "spec/double_binary_tree.md",
    battery_options=({}, {"segment": 1024}),
))

register(Algorithm(
    "switch",
    "in-network reduction (SHARP, SwitchML): packets summed up a tree of switch processes",
    {"allreduce": switch.switch_allreduce},
    {"allreduce": _cost.switch_allreduce},
    "spec/switch.md",
    # Few slots so the pool wraps; radix 3 leaves one-child switches at some W.
    battery_options=({}, {"radix": 2, "packet": 1001, "slots": 2},
                     {"radix": 3, "packet": 401, "slots": 3}),
    extra_ranks=switch.switch_count,
    workers=switch.switch_workers,
))


def names(collective: str | None = None) -> list[str]:
    """Return the registered algorithm names, those implementing ``collective`` if given."""
    return [a.name for a in REGISTRY.values()
            if collective is None or collective in a.implementations]


def get(name: str) -> Algorithm:
    """Return the algorithm called ``name``; raise :class:`UsageError` for unknown names."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise UsageError(
            f"unknown algorithm {name!r}: choose one of {', '.join(REGISTRY)}"
        ) from None


def implementation(name: str, collective: str) -> Callable:
    """Return ``name``'s implementation of ``collective``; :class:`UsageError` if it has none."""
    if collective not in COLLECTIVES:
        raise UsageError(f"unknown collective {collective!r}: choose one of {', '.join(COLLECTIVES)}")
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
    them = "it" if len(unknown) == 1 else "them"
    others = [other for other in names(collective)
              if other != name and set(unknown) <= set(options(other, collective))]
    if name == "auto" and others:  # auto chooses per call: options belong to a named one
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


from ..calls.auto import auto_algorithm  # noqa: E402  (auto is built from every entry above)

register(auto_algorithm())
