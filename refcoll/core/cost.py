"""The α-β-γ cost record every algorithm's cost function returns, and its clock replay.

Model (Hockney; Thakur, Rabenseifner and Gropp 2005): a message of ``b`` bytes
costs ``α + b·β``, combining ``e`` elements costs ``e·γ``. Each algorithm module
(:mod:`refcoll.algorithms`) has a pure cost function beside its run function,
registered in its record's ``costs``; each returns the exact counts the simulator's
:class:`~refcoll.transport.base.Ledger` must show for ``p`` ranks and ``n`` elements of
``itemsize`` bytes:

* ``rounds``: α terms on the critical path (the ledger's largest step);
* ``messages``, ``bytes``: totals over all ranks;
* ``max_rank_messages``, ``max_rank_bytes``: the busiest sender;
* ``critical_bytes``: β bytes on the critical path (largest message per round, summed);
* ``reduced``: elements combined by the busiest rank (γ terms).

Every field is keyword-only, so each construction names what each number is
(an example is in :class:`Cost`'s docstring).

``time(α, β, γ) = rounds·α + critical_bytes·β + reduced·γ`` is what
``algorithm="auto"`` and ``refcoll model`` compare. ``formula`` is the textbook
form for display, with ``n`` in bytes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["Cost", "ZERO", "lamport_replay"]


@dataclass(frozen=True, kw_only=True)
class Cost:
    """Exact message counts of one collective call, and its α-β-γ time.

    The fields are the counts the module docstring describes, then ``formula``;
    all are keyword-only. A broadcast of one 4-byte element from one rank to one other:

    ``Cost(rounds=1, messages=1, bytes=4, max_rank_messages=1, max_rank_bytes=4,
    critical_bytes=4, reduced=0)``
    """

    rounds: int
    messages: int
    bytes: int
    max_rank_messages: int
    max_rank_bytes: int
    critical_bytes: int
    reduced: int
    formula: str = ""

    def time(self, alpha: float, beta: float, gamma: float) -> float:
        """Return the modelled time: ``rounds·α + critical_bytes·β + reduced·γ``."""
        return self.rounds * alpha + self.critical_bytes * beta + self.reduced * gamma

    def counts(self) -> dict:
        """Return the counts (everything but the formula) as a dict."""
        d = asdict(self)
        d.pop("formula")
        return d


ZERO = Cost(rounds=0, messages=0, bytes=0, max_rank_messages=0, max_rank_bytes=0,
            critical_bytes=0, reduced=0, formula="0")


def lamport_replay(runs, itemsize: int) -> tuple[int, int]:
    """Return ``(rounds, critical_bytes)`` of messages matched one at a time in order.

    ``runs`` is ``[(transfers, repeat), ...]`` with ``transfers`` a tuple of
    ``(source, dest, elements)``. A message's step is one more than the later of
    its two ranks' clocks, the simulator's rule. Steps at or below every rank's
    clock can get no further message, so their largest message is final. Once a
    tick leaves the state (clocks and open steps, less the least clock) as it
    found it, each further tick of the run repeats it shifted by the same amount
    (max-plus homogeneity), and the rest of the run is added at once.
    """
    clock = {r: 0 for transfers, _ in runs for a, b, _ in transfers for r in (a, b)}
    open_steps: dict[int, int] = {}  # step -> largest message at it, not yet final
    critical = 0
    for transfers, repeat in runs:
        state = None
        for done in range(1, repeat + 1):
            floor_before = min(clock.values())
            for source, dest, elements in transfers:
                step = max(clock[source], clock[dest]) + 1
                clock[source] = clock[dest] = step
                open_steps[step] = max(open_steps.get(step, 0), elements * itemsize)
            floor = min(clock.values())
            final = sum(open_steps.pop(s) for s in [s for s in open_steps if s <= floor])
            critical += final
            previous, state = state, (tuple(c - floor for c in clock.values()),
                                      tuple(sorted((s - floor, b) for s, b in open_steps.items())))
            if state == previous:  # a fixed point: jump over the rest of the run
                shift = (repeat - done) * (floor - floor_before)
                critical += (repeat - done) * final
                clock = {r: c + shift for r, c in clock.items()}
                open_steps = {s + shift: b for s, b in open_steps.items()}
                break
    return max(clock.values(), default=0), critical + sum(open_steps.values())
