"""``algorithm="auto"``: pick the algorithm the cost model says is fastest, like NCCL's tuner.

The model is each algorithm's :class:`~refcoll.core.cost.Cost` evaluated at this
machine's α (latency per message), β (seconds per byte) and γ (seconds per element
combined), among the algorithms whose registry record says ``auto``. Those three
numbers come from a small calibration (:mod:`refcoll.calls.calibration`), cached
under a key of everything they depend on.

Every rank must pick the same algorithm, so rank 0 decides the calibration and
broadcasts it once per communicator; the environment that steers auto
(``REFCOLL_CALIBRATION``, ``REFCOLL_ALGO``) is agreed on by every rank first, so
one rank's typo is an error on all of them.

``REFCOLL_CALIBRATION`` says where the numbers come from:

* unset or ``cache``: the cached calibration of this key, else a measurement;
* ``default`` (or ``fixed``): the deterministic mode. auto uses :data:`DEFAULT`
  on every transport, never a timing, so its choice (and so the bits of every
  float result) depends only on the collective, p, count and dtype. The
  simulator always works so.
* ``measure``: measure now, for this job: the cache is neither read nor written.

Across nodes (the ranks' hosts differ) the calibration is two-level: α and β
inside a node and across nodes, measured by :func:`~refcoll.calls.calibration.measure`,
or, for a calibration of one level (``default`` included), across nodes from
the links of the topology file ``REFCOLL_TOPO_FILE`` names
(:mod:`refcoll.core.topology`, as ``NCCL_TOPO_FILE``). Each all-reduce is
then priced phase by phase on the level each phase uses (its record's
``price``), and the node-aware algorithms join the candidates:
``hierarchical``, with the algorithm between the nodes chosen per shape
(:func:`two_level_choice`). Where the topology file puts the nodes in equal
racks of consecutive ranks with uplink rates, a third level prices the
uplinks (:func:`~refcoll.core.topology.rack_levels`, :func:`priced_shape`)
and ``hierarchical`` is tried with groups of a rack as well.

``REFCOLL_ALGO`` restricts the algorithms auto may pick, as ``NCCL_ALGO`` does
(see :class:`AlgoFilter`): ``ring``, ``ring,tree``, ``^recursive_doubling``,
``allreduce:ring;reduce_scatter:rabenseifner``. It applies to ``auto`` calls
only: a call that names its algorithm runs that algorithm.
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass, field, replace

from .. import algorithms
from ..algorithms.registry import NodeShape
from ..algorithms.spelling import spell
from ..core.cost import Cost
from ..core.errors import UsageError
from ..core.topology import TOPO_ENV, inter_levels, rack_levels
from ..core.topology import from_env as topology_from_env
from ..transport.base import transport_cache
from ..transport.mpi import MPITransport
from .agree import agree
from .auto_nodes import (
    PIPELINE_SEGMENT,
    PIPELINES,
    _two_level,
    across_options,
    candidates,
    node_aware,
    node_shape,
    priced_shape,
    shape_of,
    two_level_choice,
)
from .calibration import (
    DEFAULT,
    LOAD_LIMIT,
    Calibration,
    CalibrationKey,
    cache_path,
    cached_calibrations,
    calibrate,
    calibration_mode,
    current_calibration,
    measure,
    ping_pong,
    runnable_tasks,
)
from .tuned import TUNING_ENV, Tuning, agreed_tuning, tuning_path
from .tuned import read as read_tuning

__all__ = ["AlgoFilter", "calibration_for", "choose", "candidates", "resolve", "auto_algorithm",
           "resolve_with_options", "two_level_choice", "node_aware", "across_options",
           "node_shape", "priced_shape", "PIPELINES", "PIPELINE_SEGMENT",
           "choice_table", "algo_filter", "modelled_time", "prediction", "choice_changes",
           "auto_table", "TABLE_PS", "TABLE_LARGEST",
           # the calibration it prices with (refcoll.calls.calibration), for one import:
           "Calibration", "CalibrationKey", "DEFAULT", "LOAD_LIMIT", "measure", "cache_path",
           "current_calibration", "cached_calibrations", "calibrate", "calibration_mode",
           "ping_pong", "runnable_tasks"]



# -------------------------------------------------------------- REFCOLL_ALGO


@dataclass(frozen=True)
class AlgoFilter:
    """What ``REFCOLL_ALGO`` lets auto pick, per collective (as ``NCCL_ALGO``).

    Grammar: ``[collective:]list[;[collective:]list...]``, where ``list`` is
    ``a,b,...`` (pick only among these) or ``^a,b,...`` (never these); one algorithm
    per collective may also be written ``allreduce=ring,allgather=bruck``. A part
    without a collective applies to every collective that one of its algorithms
    implements; a part naming a collective overrides it there. A listed
    algorithm may be one auto never picks by itself (``naive``,
    ``hierarchical``): pinned, it runs.
    """

    text: str = ""
    rules: tuple = ()  # ((collective or None, frozenset of names, exclude?), ...)

    def allowed(self, collective: str) -> list[str]:
        """Return the algorithms auto may pick for ``collective``, in registry order."""
        pool = candidates(collective)
        rule = self._rule(collective)
        if rule is None:
            return pool
        names, exclude = rule
        if exclude:
            return [n for n in pool if n not in names]
        return [n for n in algorithms.names(collective) if n in names]

    def pinned(self, collective: str) -> str | None:
        """Return the one algorithm named for ``collective`` (``allreduce:ring``,
        ``ring``), or None where the value names several, excludes, or says nothing."""
        rule = self._rule(collective)
        if rule is None or rule[1]:
            return None
        left = self.allowed(collective)
        return left[0] if len(left) == 1 else None

    def permits(self, collective: str, name: str) -> bool:
        """Return whether ``REFCOLL_ALGO`` leaves ``name`` to ``collective`` (a tuning file's
        rule may name one auto never picks by itself, as a listed algorithm may)."""
        rule = self._rule(collective)
        return rule is None or (name in rule[0]) != rule[1]

    def _rule(self, collective: str):
        chosen = None
        for coll, names, exclude in self.rules:
            if coll == collective:
                return names, exclude
            if coll is None and (exclude or any(collective in algorithms.get(n).collectives
                                                for n in names)):
                chosen = names, exclude
        return chosen

    @classmethod
    def parse(cls, text: str | None) -> "AlgoFilter":
        """Parse a ``REFCOLL_ALGO`` value; :class:`UsageError` names what is wrong.
        ``auto`` is what unset is: auto picks among all its candidates."""
        if not text or not text.strip() or text.strip() == "auto":
            return cls()
        known = [n for n, algo in algorithms.REGISTRY.items() if algo.pinnable]
        rules, seen = [], set()
        for part in filter(None, (p.strip() for p in _colon_form(text).split(";"))):
            coll, colon, spec = part.rpartition(":")
            coll = coll.strip() or None
            if colon and coll is None:
                raise UsageError(f"REFCOLL_ALGO={text!r}: {part!r} names no collective before "
                                 "its ':' (or '='); drop it to apply to every collective")
            if coll in seen:  # which would win is no one's guess: say it once
                raise UsageError(f"REFCOLL_ALGO={text!r}: "
                                 f"{coll or 'every collective'} is given twice; give it once")
            seen.add(coll)
            if coll is not None and coll not in algorithms.COLLECTIVES:
                raise UsageError(f"REFCOLL_ALGO={text!r}: unknown collective {coll!r}; choose "
                                 f"from {', '.join(algorithms.COLLECTIVES)}")
            spec = spec.strip()
            exclude = spec.startswith("^")
            names = [n.strip() for n in spec.lstrip("^").split(",") if n.strip()]
            if not names:
                raise UsageError(f"REFCOLL_ALGO={text!r}: {part!r} names no algorithm")
            unknown = [n for n in names if n not in known]
            if unknown:
                raise UsageError(f"REFCOLL_ALGO={text!r}: unknown algorithm "
                                 f"{', '.join(map(repr, unknown))}; choose from {', '.join(known)}")
            if coll is not None and not exclude:
                wrong = [n for n in names if coll not in algorithms.get(n).collectives]
                if wrong:
                    raise UsageError(f"REFCOLL_ALGO={text!r}: {', '.join(wrong)} does not "
                                     f"implement {coll}; algorithms with {coll}: "
                                     + ", ".join(n for n in algorithms.names(coll) if n in known))
            rules.append((coll, frozenset(names), exclude))
        parsed = cls(text.strip(), tuple(rules))
        for coll in algorithms.COLLECTIVES:
            if parsed._rule(coll) is not None and not parsed.allowed(coll):
                raise UsageError(f"REFCOLL_ALGO={text!r} leaves auto no algorithm for {coll} "
                                 f"(its candidates: {', '.join(candidates(coll))})")
        return parsed


def _colon_form(text: str) -> str:
    """Return ``REFCOLL_ALGO``'s one-per-collective form, ``allreduce=ring,allgather=bruck``
    (the torch backend's, documented there), as ``allreduce:ring;allgather:bruck``."""
    if "=" not in text:
        return text
    pairs = [part.partition("=") for part in text.split(",")]
    if ":" in text or ";" in text or any(not eq for _, eq, _ in pairs):
        raise UsageError(f"REFCOLL_ALGO={text!r}: write one algorithm per collective as "
                         "allreduce=ring,allgather=bruck, or lists as allreduce:ring,tree;"
                         "allgather:bruck; not both")
    return ";".join(f"{coll.strip()}:{name.strip()}" for coll, _, name in pairs)


def algo_filter() -> AlgoFilter:
    """Return this process's ``REFCOLL_ALGO``, parsed."""
    return AlgoFilter.parse(os.environ.get("REFCOLL_ALGO"))


# ----------------------------------------------------------------- choosing


def choose(collective: str, p: int, count: int, itemsize: int,
           calibration: Calibration = DEFAULT, allowed: list[str] | None = None,
           shape: NodeShape | None = None) -> str:
    """Return the algorithm with the least modelled time (ties: registry order).

    ``allowed`` (default: :func:`candidates`) limits the choice, as
    ``REFCOLL_ALGO`` does; one allowed algorithm without a cost model is
    returned as it is. With a two-level ``calibration`` and the ranks' node
    ``shape`` an all-reduce is priced level by level (:func:`two_level_choice`),
    the node-aware algorithms among the candidates.
    """
    if _two_level(collective, calibration, shape):
        return two_level_choice(count, itemsize, calibration, shape, allowed)[0]
    pool = candidates(collective) if allowed is None else allowed
    if len(pool) == 1:
        return pool[0]
    best, best_time = None, float("inf")
    for name in pool:
        modelled = modelled_time(name, collective, p, count, itemsize, calibration)
        if modelled is None:
            continue
        if modelled < best_time:
            best, best_time = name, modelled
    return best if best is not None else pool[0]


@dataclass
class _AutoSettings:
    """What auto resolves with on one transport: the calibration, ``REFCOLL_ALGO``, the nodes."""

    calibration: Calibration
    allowed: AlgoFilter = field(default_factory=AlgoFilter)
    shape: NodeShape | None = None  # the ranks' nodes, where they span more than one
    tuning: Tuning | None = None  # REFCOLL_TUNING_FILE's measured choices
    tuned: set = field(default_factory=set)  # the keys whose choice the tuning made
    choices: dict = field(default_factory=dict)  # (name, options) by key
    predictions: dict = field(default_factory=dict)  # (name, modelled s) by key, for tracing


def _settings(t) -> _AutoSettings:
    """Return the auto settings of ``t``, agreeing on them the first time (collective)."""
    cache = transport_cache(t, "auto")
    settings = cache.get("settings")
    if settings is not None:
        return settings
    inner = getattr(t, "inner", None)
    if inner is not None:  # a device transport: the MPI transport under it was measured
        settings = _settings(inner)
    else:
        settings = _agreed_settings(t)
    cache["settings"] = settings
    return settings


def _agreed_settings(t) -> _AutoSettings:
    world = getattr(t, "world", None)
    if world is not None:  # the simulator: one process, one environment
        return _AutoSettings(getattr(world, "calibration", None) or DEFAULT, algo_filter(),
                             shape_of(t), read_tuning(tuning_path()) if tuning_path() else None)
    if not isinstance(t, MPITransport):
        return _library_settings(t)
    error, mode, allowed, topology = None, "cache", AlgoFilter(), None
    try:
        mode, allowed, topology = calibration_mode(), algo_filter(), topology_from_env()
    except UsageError as exc:
        error = str(exc)
    with t.call("auto"):
        # Every rank's environment must say the same: one rank's typo is everyone's error;
        # and so must the topology each rank read (one path, files of their own per host).
        agree(t, collective="auto", error=error or "",
              options=[(name, os.environ.get(name, "")) for name in
                       ("REFCOLL_CALIBRATION", "REFCOLL_ALGO", TOPO_ENV, TUNING_ENV)]
              + [("topology read", hashlib.sha256(repr(topology).encode()).hexdigest()[:16]
                  if topology is not None else "")])
        if error:
            raise UsageError(f"rank {t.rank}: {error}")
        tuning = agreed_tuning(t, tuning_path())
        calibration = (DEFAULT if mode == "default"
                       else calibrate(t, force=mode == "measure", save=mode != "measure")[0])
    if not calibration.two_level:  # one level measured: the topology's links price the other
        calibration = replace(calibration, **inter_levels(topology, t.hosts))
    calibration = replace(calibration, **rack_levels(topology, t.hosts))  # the racks' uplinks
    return _AutoSettings(calibration, allowed, shape_of(t), tuning)


def _library_settings(t) -> _AutoSettings:
    """Another library's ranks (a torch process group): processes of their own, so the same
    agreement as MPI's on ``REFCOLL_ALGO`` and the tuning file's path, and rank 0's tuning
    file, sent to the others; the default calibration (measuring it needs MPI)."""
    error, allowed = None, AlgoFilter()
    try:
        allowed = algo_filter()
    except UsageError as exc:
        error = str(exc)
    with t.call("auto"):
        agree(t, collective="auto", error=error or "",
              options=[(name, os.environ.get(name, "")) for name in ("REFCOLL_ALGO", TUNING_ENV)])
        if error:
            raise UsageError(f"rank {t.rank}: {error}")
        tuning = agreed_tuning(t, tuning_path())
    return _AutoSettings(DEFAULT, allowed, shape_of(t), tuning)


def calibration_for(t) -> Calibration:
    """Return the calibration auto uses on ``t``: the same on every rank, kept per transport.

    The simulator (and any transport but MPI's) uses :data:`DEFAULT`, or the
    ``calibration=`` given to :func:`refcoll.simulate`, as does
    ``REFCOLL_CALIBRATION=default``. On MPI, rank 0 reads the cache under the
    job's key (or the ranks measure) and broadcasts the numbers. A device
    transport uses the calibration of the transport it wraps.
    """
    return _settings(t).calibration


#: Choices kept per transport; a training loop all-reduces a few dozen sizes.
_CHOICES_KEPT = 4096


def resolve(t, collective: str, count: int, itemsize: int) -> str:
    """Return the algorithm auto runs for this call on ``t``.

    Evaluating every candidate's cost takes tens of microseconds, as long as a
    small all-reduce itself, so each choice is kept on the transport.
    """
    return resolve_with_options(t, collective, count, itemsize)[0]


def resolve_with_options(t, collective: str, count: int, itemsize: int) -> tuple[str, dict]:
    """Return the algorithm auto runs for this call on ``t`` and the options it runs it with:
    the tuning file's rule where one applies (:mod:`refcoll.calls.tuned`), else the cost
    model's choice (across nodes with hierarchical's options; else none)."""
    settings = _settings(t)
    choices = settings.choices
    key = (collective, count, itemsize)
    found = choices.get(key)
    if found is None:
        if len(choices) >= _CHOICES_KEPT:
            choices.clear()
            settings.tuned.clear()
        pool = settings.allowed.allowed(collective)
        explicit = settings.allowed._rule(collective) is not None
        whole = count * itemsize * (t.size if collective == "allgather" else 1)  # bench's size
        left = [n for n in algorithms.names(collective) if settings.allowed.permits(collective, n)]
        found = settings.tuning and settings.tuning.choice(collective, t.size, settings.shape,
                                                           whole, left if explicit else None)
        if found:
            settings.tuned.add(key)
        elif _two_level(collective, settings.calibration, settings.shape):
            name, options, _ = two_level_choice(count, itemsize, settings.calibration,
                                                settings.shape, pool if explicit else None)
            found = (name, options)
        else:
            found = (choose(collective, t.size, count, itemsize, settings.calibration, pool), {})
        choices[key] = found
    return found


def modelled_time(name: str, collective: str, p: int, count: int, itemsize: int,
                  calibration: Calibration) -> float | None:
    """Return the α-β-γ seconds auto's model gives ``name``'s ``collective`` (None: no cost model).

    An all-reduce is priced by the algorithm's
    :meth:`~refcoll.algorithms.registry.Algorithm.flat_cost`: the same counts, without
    replaying a segmented schedule (dbtree) message by message.
    """
    cost = _cost_counts(name, collective, p, count, itemsize)
    if cost is None:
        return None
    return cost.time(calibration.alpha, calibration.beta, calibration.gamma)


@functools.lru_cache(maxsize=1 << 12)
def _cost_counts(name: str, collective: str, p: int, count: int, itemsize: int) -> Cost | None:
    """The counts :func:`modelled_time` prices (a pure function of its arguments, kept: a
    simulated world's thousand ranks each choose, and a schedule's counts at p = 1024 take
    tens of milliseconds)."""
    algo = algorithms.get(name)
    if collective not in algo.costs:
        return None
    return (algo.flat_cost(p, count, itemsize) if collective == "allreduce"
            else algo.costs[collective](p, count, itemsize))


def _agreed_already(t) -> _AutoSettings | None:
    """Return ``t``'s auto settings if they were agreed already, else None (never communicates)."""
    while t is not None:
        settings = transport_cache(t, "auto").get("settings")
        if settings is not None:
            return settings
        t = getattr(t, "inner", None)
    return None


def prediction(t, collective: str, count: int, itemsize: int) -> tuple[str, float | None] | None:
    """Return what auto runs for this call on ``t`` and its modelled seconds, as tracing shows.

    ``None`` before ``t``'s first ``auto`` call has agreed on the settings:
    this never communicates, so it may be asked after any call, on any rank.
    The choice is :func:`resolve`'s own (kept on the transport); the time is
    kept beside it, since a cost replay (dbtree's) can take longer than the call.
    """
    settings = _agreed_already(t)
    if settings is None:
        return None
    key = (collective, count, itemsize)
    found = settings.predictions.get(key)
    if found is None:
        name, options = resolve_with_options(t, collective, count, itemsize)
        if len(settings.predictions) >= _CHOICES_KEPT:
            settings.predictions.clear()
        if key in settings.tuned:
            seconds = None  # measured, not modelled
        elif _two_level(collective, settings.calibration, settings.shape):
            shape = priced_shape(settings.calibration, settings.shape)
            seconds = settings.calibration.price(
                algorithms.get(name).price(shape, count, itemsize, **options),
                shape.per_node, itemsize)
        else:
            seconds = modelled_time(name, collective, t.size, count, itemsize,
                                    settings.calibration)
        name = spell(name, options)  # one word, as the model names it
        found = settings.predictions[key] = (name, seconds)
    return found


def _dispatch(collective: str):
    def run(t, *args, **options):
        extra = set(options) - {"op", "root"}
        if extra:
            raise UsageError(f"rank {t.rank}: algorithm 'auto' takes no algorithm options "
                             f"(got {', '.join(sorted(extra))}); name the algorithm instead")
        buf = args[0]
        count = buf.size // t.size if collective == "allgather" else buf.size
        name, chosen = resolve_with_options(t, collective, count, buf.itemsize)
        return algorithms.implementation(name, collective)(t, *args, **options, **chosen)

    run.__name__ = f"auto_{collective}"
    run.__doc__ = f"Run the {collective} algorithm the cost model picks for this size and p."
    return run


def _modelled_cost(collective: str):
    def cost(p: int, n: int, itemsize: int):
        return algorithms.get(choose(collective, p, n, itemsize)).costs[collective](p, n, itemsize)

    return cost


def auto_algorithm():
    """Return the registry entry of ``auto`` (built once the other algorithms exist)."""
    collectives = [c for c in algorithms.COLLECTIVES
                   if any(c in algorithms.get(n).costs for n in candidates(c))]
    return algorithms.Algorithm(
        "auto",
        "the algorithm with the least modelled α-β-γ time for this p and size (calibrated)",
        {c: _dispatch(c) for c in collectives},
        {c: _modelled_cost(c) for c in collectives},
        "spec/README.md",
        order=1000,
        pinnable=False,
        chooses=True,
    )


def choice_table(calibration: Calibration, ps=(2, 4, 8, 16, 64),
                 sizes=(8, 1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 24, 1 << 28),
                 collective: str = "allreduce", itemsize: int = 4) -> list[dict]:
    """Return what auto picks for each (p, bytes), as rows for ``refcoll list``."""
    return [{"p": p, "bytes": b, "algorithm": choose(collective, p, b // itemsize, itemsize,
                                                     calibration)}
            for p in ps for b in sizes]


#: The process counts ``refcoll list`` tabulates: every p to 8, then the powers of two and
#: the midpoints between them. Auto's choice depends on where p sits between powers of
#: two (the non-power-of-two folds of recursive doubling and Rabenseifner) and on lg p;
#: between two listed counts the choices are the same and the change points move
#: monotonically, so the rows between add length, not information.
TABLE_PS = (2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64)

#: The largest message (bytes of each rank's input) the table scans.
TABLE_LARGEST = 1 << 26

#: Sizes probed per octave before each change is narrowed to its exact count.
_PROBES_PER_OCTAVE = 2


def choice_changes(collective: str, p: int, itemsize: int = 4,
                   calibration: Calibration = DEFAULT, allowed: list[str] | None = None,
                   largest: int = TABLE_LARGEST) -> list[dict]:
    """Return where auto's choice for ``collective`` on ``p`` ranks changes, from 1 element up.

    Each entry is ``{"count", "bytes", "algorithm", "predicted_s"}``: from
    ``count`` elements on (``bytes`` of each rank's input) auto picks
    ``algorithm`` (:func:`choose`, with ``allowed`` as ``REFCOLL_ALGO`` gives
    it), until the next entry's count; ``predicted_s`` is its modelled time at
    ``count``. Sizes are probed :data:`_PROBES_PER_OCTAVE` times per octave up
    to ``largest`` bytes and every change between two probes is narrowed by
    bisection to the first count at which the choice differs, so each entry is
    exact: auto picks the previous entry's algorithm at ``count - 1`` and this
    one at ``count``. (A choice that changed and changed back between two
    probes, less than an octave apart, would not be seen.) Results are kept per
    process: a cost replay (dbtree's, O(p·segments)) makes a table take seconds.
    """
    pool = None if allowed is None else tuple(allowed)
    return [{"count": count, "bytes": count * itemsize, "algorithm": name, "predicted_s": time}
            for count, name, time in _changes(collective, p, itemsize, calibration, pool,
                                              largest)]


@functools.lru_cache(maxsize=1024)
def _changes(collective: str, p: int, itemsize: int, calibration: Calibration,
             allowed: tuple | None, largest: int) -> tuple:
    pool = None if allowed is None else list(allowed)
    picks: dict[int, str] = {}

    def pick(count: int) -> str:
        if count not in picks:
            picks[count] = choose(collective, p, count, itemsize, calibration, pool)
        return picks[count]

    def entry(count: int) -> tuple:
        name = pick(count)
        return count, name, modelled_time(name, collective, p, count, itemsize, calibration)

    top = max(1, largest // itemsize)
    probes, count = [], 1
    while count < top:
        probes.append(count)
        count = max(count + 1, int(count * 2 ** (1 / _PROBES_PER_OCTAVE)))
    probes.append(top)
    changes = [entry(1)]
    below = 1  # the largest count known to pick the last entry's algorithm
    for probe in probes[1:]:
        # narrow (below, probe] to the first count that differs
        while pick(probe) != changes[-1][1]:
            lo, hi = below, probe
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if pick(mid) != changes[-1][1]:
                    hi = mid
                else:
                    lo = mid
            changes.append(entry(hi))
            below = hi
        below = probe
    return tuple(changes)


def auto_table(calibration: Calibration, ps=TABLE_PS, itemsize: int = 4,
               allowed: AlgoFilter | None = None, largest: int = TABLE_LARGEST) -> dict:
    """Return auto's choices per collective and p, as ``refcoll list`` prints them.

    ``{collective: [{"p": p, "changes": choice_changes(...)}, ...]}`` for every
    collective auto chooses among more than one algorithm for;
    ``allowed`` is ``REFCOLL_ALGO`` (default: none).
    """
    allowed = allowed or AlgoFilter()
    table = {}
    for collective in algorithms.COLLECTIVES:
        pool = allowed.allowed(collective)
        if len([n for n in pool if collective in algorithms.get(n).costs]) < 2:
            continue
        table[collective] = [{"p": p, "changes": choice_changes(collective, p, itemsize,
                                                                calibration, pool, largest)}
                             for p in ps]
    return table


algorithms.register(auto_algorithm())  # chooses among every algorithm registered above
