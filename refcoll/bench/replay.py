"""The transport bound of an algorithm: its schedule, from the simulator, replayed on bare MPI.

:func:`schedule` reads every rank's messages and reductions off the simulator's
ledger, round by round; :data:`Replay` (refcoll's one schedule replay,
:meth:`refcoll.transport.recorder.Schedule.from_plan`) runs one rank's schedule with
nothing but nonblocking MPI calls on preallocated buffers and the op's ufunc. What
the implementation costs beyond that replay (``time/bound``) is argument handling,
views, tag spaces and Python's step loop: everything but its messages and arithmetic.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from .. import algorithms
from ..calls import simulate
from ..core.ops import get_dtype
from ..transport.recorder import Schedule

__all__ = ["schedule", "node_options", "Replay"]


def schedule(collective: str, algorithm: str, p: int, count: int, dtype, *, op: str = "sum",
             root: int = 0, **options) -> list[list[tuple]]:
    """Return every rank's replay plan of one call of ``algorithm``, from the simulator.

    The plan of a rank is a list of ``(step, sends, receives, reductions)`` in
    step order: ``sends`` as ``(dest, nbytes)``, ``receives`` as ``(source,
    nbytes)``, ``reductions`` as element counts combined after the step's
    messages. Steps are the ledger's rounds, so within a step no message waits
    for another. Ranks are those of the simulated world: the ``p`` data ranks,
    then any switch processes. ``count`` is the elements of the whole array
    (:func:`~refcoll.bench.config.element_count`); the schedule depends on
    sizes only, so the simulated inputs are zeros. ``options`` are the
    algorithm's (the real node shape among them: :func:`node_options`).
    """
    in_count = count // p if collective == "allgather" else count
    x = np.zeros(in_count, dtype=get_dtype(dtype))
    x.flags.writeable = False
    kwargs = dict(options)
    if collective in ("broadcast", "reduce"):
        kwargs["root"] = root
    result = simulate(collective, [x] * p, algorithm=algorithm, op=op, **kwargs)
    plans: list[dict] = [defaultdict(lambda: ([], [], [])) for _ in range(result.world.size)]
    for m in result.ledger.messages:
        plans[m.source][m.step][0].append((m.dest, m.nbytes))
        plans[m.dest][m.step][1].append((m.source, m.nbytes))
    for red in result.ledger.reductions:
        plans[red.rank][red.step][2].append(red.elements)
    return [[(step, *plan[step]) for step in sorted(plan)] for plan in plans]


def node_options(t, algorithm: str, options: dict | None = None) -> dict:
    """Return ``options`` with the node shape of ``t`` that ``algorithm``'s prediction needs.

    An algorithm whose record names a ``node_option`` is predicted with the size
    of ``t``'s first group under that option (collective over ``t``: the first
    call splits it). The groups are the nodes, or those its ``level`` option
    names (the racks): the simulator has no hosts, so the prediction takes the
    group size in their place, as consecutive ranks. The others keep ``options``.
    """
    options = dict(options or {})
    option = algorithms.get(algorithm).node_option
    if option is None or option in options:
        return options
    level = options.pop("level", "node")
    return {**options, option: algorithms.node_layout(t, None, level).sizes[0]}


#: One rank's schedule replayed on bare MPI, the transport bound of an algorithm:
#: ``Replay(comm, plan, dtype, op, *, timeout=None)`` with ``plan`` from :func:`schedule`,
#: a :class:`~refcoll.transport.recorder.Schedule` (call it to run once, then ``free()``).
Replay = Schedule.from_plan
