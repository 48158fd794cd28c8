"""``algorithm="auto"``: pick the algorithm the cost model says is fastest, like NCCL's tuner.

The model is each algorithm's :class:`~refcoll.core.cost.Cost` evaluated at this
machine's α (latency per message), β (seconds per byte) and γ (seconds per element
combined). Those three numbers come from a small calibration (:func:`measure`),
kept in ``$REFCOLL_CACHE/calibration.json`` (default ``~/.cache/refcoll``) under a
key of everything they depend on: the host, the MPI library, the ranks per node
and whether the ranks outnumber the cores (:class:`CalibrationKey`). A
measurement taken while oversubscribed, or too noisy to trust, is used by the job
that took it and never saved. ``refcoll calibrate`` measures and saves on purpose.

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
* ``measure``: measure now, ignoring the cache (and save, as ``cache`` does).

``REFCOLL_ALGO`` restricts the algorithms auto may pick, as ``NCCL_ALGO`` does
(see :class:`AlgoFilter`): ``ring``, ``ring,tree``, ``^recursive_doubling``,
``allreduce:ring;reduce_scatter:rabenseifner``. It applies to ``auto`` calls
only: a call that names its algorithm runs that algorithm.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from .. import algorithms
from ..core.calibration import DEFAULT, Calibration
from ..core.errors import UsageError
from ..transport.base import transport_cache
from ..transport.mpi import MPITransport

__all__ = ["Calibration", "CalibrationKey", "AlgoFilter", "DEFAULT", "calibration_for",
           "measure", "choose", "candidates", "cache_path", "resolve", "auto_algorithm",
           "choice_table", "current_calibration", "cached_calibrations", "calibrate",
           "algo_filter", "calibration_mode", "LOAD_LIMIT"]



#: Algorithms auto never picks: the reference, and those needing a node shape or switches.
_EXCLUDED = {"naive", "auto", "hierarchical", "switch"}

#: Algorithms ``REFCOLL_ALGO`` may not name: auto itself, and switch, whose extra
#: (switch) ranks the caller must provide.
_NEVER_PINNED = {"auto", "switch"}

#: A measurement taken while more tasks were runnable than there are cores
#: (runnable tasks per core above this) is too noisy to keep: another job was
#: taking the cores, and every round trip waited for the scheduler.
LOAD_LIMIT = 1.0


def candidates(collective: str) -> list[str]:
    """Return the algorithms auto chooses among for ``collective``."""
    names = [n for n in algorithms.names(collective) if n not in _EXCLUDED
             and collective in algorithms.get(n).costs]
    return names or ["naive"]


# -------------------------------------------------------------- REFCOLL_ALGO


@dataclass(frozen=True)
class AlgoFilter:
    """What ``REFCOLL_ALGO`` lets auto pick, per collective (as ``NCCL_ALGO``).

    Grammar: ``[collective:]list[;[collective:]list...]``, where ``list`` is
    ``a,b,...`` (pick only among these) or ``^a,b,...`` (never these). A part
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
        """Parse a ``REFCOLL_ALGO`` value; :class:`UsageError` names what is wrong."""
        if not text or not text.strip():
            return cls()
        known = [n for n in algorithms.REGISTRY if n not in _NEVER_PINNED]
        rules = []
        for part in filter(None, (p.strip() for p in text.split(";"))):
            coll, _, spec = part.rpartition(":")
            coll = coll.strip() or None
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
                                     f"{', '.join(n for n in algorithms.names(coll) if n in known)}")
            rules.append((coll, frozenset(names), exclude))
        parsed = cls(text.strip(), tuple(rules))
        for coll in algorithms.COLLECTIVES:
            if parsed._rule(coll) is not None and not parsed.allowed(coll):
                raise UsageError(f"REFCOLL_ALGO={text!r} leaves auto no algorithm for {coll} "
                                 f"(its candidates: {', '.join(candidates(coll))})")
        return parsed


def algo_filter() -> AlgoFilter:
    """Return this process's ``REFCOLL_ALGO``, parsed."""
    return AlgoFilter.parse(os.environ.get("REFCOLL_ALGO"))


_MODES = {"": "cache", "cache": "cache", "default": "default", "fixed": "default",
          "measure": "measure"}


def calibration_mode() -> str:
    """Return ``REFCOLL_CALIBRATION`` as ``cache``, ``default`` or ``measure``."""
    value = os.environ.get("REFCOLL_CALIBRATION", "")
    try:
        return _MODES[value.strip().lower()]
    except KeyError:
        raise UsageError(f"REFCOLL_CALIBRATION={value!r}: choose cache (the default: the cached "
                         "calibration, else a measurement), default or fixed (no timing: "
                         "deterministic), or measure") from None


# ----------------------------------------------------------------- choosing


def choose(collective: str, p: int, count: int, itemsize: int,
           calibration: Calibration = DEFAULT, allowed: list[str] | None = None) -> str:
    """Return the algorithm with the least modelled time (ties: registry order).

    ``allowed`` (default: :func:`candidates`) limits the choice, as
    ``REFCOLL_ALGO`` does; one allowed algorithm without a cost model is
    returned as it is.
    """
    pool = candidates(collective) if allowed is None else allowed
    if len(pool) == 1:
        return pool[0]
    best, best_time = None, float("inf")
    for name in pool:
        costs = algorithms.get(name).costs
        if collective not in costs:
            continue
        modelled = costs[collective](p, count, itemsize).time(
            calibration.alpha, calibration.beta, calibration.gamma)
        if modelled < best_time:
            best, best_time = name, modelled
    return best if best is not None else pool[0]


# ----------------------------------------------------------- the cache file


@dataclass(frozen=True)
class CalibrationKey:
    """What a calibration depends on, so a cached one is used only where it holds.

    α and β measured with 7 processes on 2 cores say nothing about 2 ranks on
    the same cores, and the ranks per node decide how often a node's ranks
    share its memory bandwidth.
    """

    host: str
    library: str
    ranks_per_node: int
    oversubscribed: bool

    def text(self) -> str:
        """Return the key as the cache file writes it."""
        return (f"{self.host}|{self.library}|ranks_per_node={self.ranks_per_node}|"
                f"oversubscribed={'yes' if self.oversubscribed else 'no'}")


def cache_path() -> Path:
    """Return where measured calibrations are cached."""
    base = os.environ.get("REFCOLL_CACHE") or os.path.join(Path.home(), ".cache", "refcoll")
    return Path(base) / "calibration.json"


def _read_cache() -> dict:
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _from_record(key: str, record: dict) -> Calibration | None:
    try:
        fields = {k: record[k] for k in ("alpha", "beta", "gamma")}
        cal = Calibration(**{k: float(v) for k, v in fields.items()},
                          measured_at=record.get("measured_at"), load=record.get("load"),
                          source=f"cached in {cache_path()}", key=key)
    except (KeyError, TypeError, ValueError):
        return None
    finite = all(np.isfinite(v) and v >= 0 for v in (cal.alpha, cal.beta, cal.gamma))
    return cal if finite else None


def _load(key: str) -> Calibration | None:
    record = _read_cache().get(key)
    return _from_record(key, record) if isinstance(record, dict) else None


def _save(key: str, calibration: Calibration) -> None:
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_cache()
        data[key] = {"alpha": calibration.alpha, "beta": calibration.beta,
                     "gamma": calibration.gamma, "measured_at": calibration.measured_at,
                     "load": calibration.load}
        path.write_text(json.dumps(data, indent=2))
    except OSError as exc:  # a read-only home only costs a re-measurement next time
        print(f"refcoll: note: could not save the calibration in {path}: {exc}",
              file=sys.stderr)


def cached_calibrations(host: str | None = None) -> list[Calibration]:
    """Return every cached calibration of ``host`` (default: this one), newest first."""
    host = platform.node() if host is None else host
    found = [_from_record(k, v) for k, v in _read_cache().items()
             if k.startswith(host + "|") and isinstance(v, dict)]
    return sorted((c for c in found if c is not None),
                  key=lambda c: -(c.measured_at or 0.0))


def current_calibration() -> Calibration:
    """Return the calibration a quiet job on this host would use (no communication).

    That is :data:`DEFAULT` in the deterministic mode or when nothing is
    cached; else the newest cached calibration measured without
    oversubscription (any, if all were).
    """
    if os.environ.get("REFCOLL_CALIBRATION", "").strip().lower() in ("default", "fixed"):
        return DEFAULT
    cached = cached_calibrations()
    quiet = [c for c in cached if c.key.endswith("oversubscribed=no")]
    return (quiet or cached or [DEFAULT])[0]


# --------------------------------------------------------------- measuring


def ping_pong(t, send, recv, peer: int) -> None:
    """One round trip between ranks 0 and 1: rank 0 sends ``send`` first, the other answers."""
    if t.rank == 0:
        t.send(send, peer)
        t.recv(recv, peer)
    else:
        t.recv(recv, peer)
        t.send(send, peer)


def runnable_tasks() -> int | None:
    """Return how many tasks are runnable on this machine now, or None where it cannot be read.

    The fourth field of Linux's ``/proc/loadavg``: the instantaneous count,
    not the load average, so it sees another job the moment it runs.
    """
    try:
        with open("/proc/loadavg", encoding="ascii") as fh:
            return int(fh.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None


def measure(t, *, repeats: int = 30) -> Calibration:
    """Measure α, β and γ on ranks 0 and 1 of ``t`` (every rank must call; collective).

    α: half the round trip of an 8-byte ping-pong; β: from a 4 MiB ping-pong, less
    α; γ: a NumPy float32 addition of 1 Mi elements with ``out=``. Medians of
    ``repeats``. ``load``: rank 0 counts the runnable tasks of its machine
    (:func:`runnable_tasks`) three times in each ping-pong and keeps the fewest,
    per core: a task that runs for an instant (a kernel thread) is missed, a job
    that runs all along is in every count. The ranks of this job poll while they
    wait, so on a machine of its own a job that fills the cores reads 1.0;
    another job running makes it more. Rank 0's result is broadcast so every
    rank returns the same.
    """
    from ..algorithms.naive import naive_broadcast

    values = np.zeros(6, dtype=np.float64)  # α, β, γ, load (-1: unknown), when, unused
    values[3] = -1.0
    samples: list[int] = []
    if t.rank in (0, 1) and t.size > 1:
        peer = 1 - t.rank
        small, large = np.zeros(1, np.float64), np.zeros(1 << 20, np.float32)
        every = max(1, repeats // 3)

        def round_trip(buf) -> float:
            ping_pong(t, buf, buf, peer)  # a first exchange sets up the connection: not timed
            times = []
            for i in range(repeats):
                start = time.perf_counter()
                ping_pong(t, buf, buf, peer)
                times.append(time.perf_counter() - start)
                if t.rank == 0 and i % every == every - 1:
                    count = runnable_tasks()  # between round trips: never timed
                    if count is not None:
                        samples.append(count)
            return float(np.median(times)) / 2

        alpha = round_trip(small)
        beta = max(round_trip(large) - alpha, 0.0) / large.nbytes
        values[:2] = alpha, beta
    if t.rank == 0:
        a, b = np.ones(1 << 20, np.float32), np.ones(1 << 20, np.float32)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            np.add(a, b, out=a)
            times.append(time.perf_counter() - start)
        values[2] = float(np.median(times)) / a.size
        if samples:
            values[3] = min(samples) / (os.cpu_count() or 1)
        values[4] = time.time()
        if t.size == 1:
            values[0], values[1] = DEFAULT.alpha, DEFAULT.beta
    naive_broadcast(t, values, root=0)
    return Calibration(*map(float, values[:3]), source="measured", measured_at=float(values[4]),
                       load=float(values[3]) if values[3] >= 0 else None)


#: Bytes of one rank's record in the exchange that finds the key: host name and cores.
_HOST_RECORD = 256


def _key_of(t) -> CalibrationKey:
    """Return ``t``'s :class:`CalibrationKey`, the same on every rank (collective on ``t``).

    Every rank sends its host name and core count to every other (a
    fixed-size allgather over ``t``'s own point-to-point messages, so it has
    the transport's deadline): the ranks per node are the most ranks on one
    host, and the job is oversubscribed when some host has more ranks than
    cores.
    """
    from mpi4py import MPI

    from ..algorithms.recursive import rabenseifner_allgather

    mine = json.dumps([MPI.Get_processor_name(), os.cpu_count() or 1]).encode()[:_HOST_RECORD]
    everyone = np.zeros(t.size * _HOST_RECORD, dtype=np.uint8)
    everyone[t.rank * _HOST_RECORD:t.rank * _HOST_RECORD + len(mine)] = np.frombuffer(mine,
                                                                                      np.uint8)
    if t.size > 1:
        rabenseifner_allgather(t, everyone)
    hosts: dict[str, list[int]] = {}
    for row in everyone.reshape(t.size, _HOST_RECORD):
        name, cores = json.loads(row.tobytes().rstrip(b"\0"))
        hosts.setdefault(name, []).append(int(cores))
    library = " ".join(MPI.Get_library_version().split("\n")[0].split())
    return CalibrationKey(
        host=json.loads(everyone[:_HOST_RECORD].tobytes().rstrip(b"\0"))[0] or platform.node(),
        library=library,
        ranks_per_node=max(len(v) for v in hosts.values()),
        oversubscribed=any(len(v) > min(v) for v in hosts.values()),
    )


def _why_not_saved(key: CalibrationKey, calibration: Calibration) -> str | None:
    """Return why a measurement must not be cached, or None when it may be."""
    if key.oversubscribed:
        return ("the ranks outnumber the cores, so every rank waits for a core and the "
                "latency measured is the scheduler's")
    if calibration.load is not None and calibration.load > LOAD_LIMIT:
        return (f"it was too noisy: {calibration.load:.2g} runnable tasks per core while it ran "
                "(more than the cores, so another job was taking them and the round trips "
                "waited for the scheduler); measure again on a quiet machine with "
                "refcoll calibrate")
    return None


def calibrate(t, *, force: bool = False, save: bool = True,
              announce: bool = True) -> tuple[Calibration, str | None]:
    """Return ``t``'s calibration and, if it was measured and not saved, why not.

    Collective on an MPI transport. Rank 0 reads the cache under ``t``'s key;
    without an entry (or with ``force``) the ranks measure, and rank 0 saves
    the result unless :func:`_why_not_saved` objects (the reason comes back
    on rank 0, None elsewhere, and with ``announce`` goes to stderr).
    """
    from ..algorithms.naive import naive_broadcast

    key = _key_of(t)
    found, kind = None, 0.0
    if t.rank == 0 and not force:
        found, kind = _load(key.text()), 1.0
        if found is None:
            found, kind = _THIS_JOB.get(key.text()), 2.0
    record = np.zeros(6)  # kind (0: measure, 1: cached in the file, 2: this job's), α, β, γ...
    if found is not None:
        record[:] = kind, found.alpha, found.beta, found.gamma, found.measured_at or 0, \
            -1.0 if found.load is None else found.load
    naive_broadcast(t, record, root=0)
    if record[0]:
        source = (f"cached in {cache_path()}" if record[0] == 1 else
                  "measured earlier in this job, not saved")
        return Calibration(*map(float, record[1:4]), source=source,
                           key=key.text(), measured_at=float(record[4]) or None,
                           load=float(record[5]) if record[5] >= 0 else None), None
    calibration = replace(measure(t), key=key.text())
    why = _why_not_saved(key, calibration)
    if why is None and save:
        if t.rank == 0:
            _save(key.text(), calibration)
        calibration = replace(calibration, source=f"measured, saved in {cache_path()}")
    if t.rank == 0:
        if why is not None and announce:
            print(f"refcoll: note: auto's calibration was measured for this job only and not "
                  f"saved: {why}", file=sys.stderr, flush=True)
    if why is not None:
        calibration = replace(calibration, source=f"measured for this job only ({why})")
        if t.rank == 0:
            _THIS_JOB[key.text()] = calibration  # other communicators of this job reuse it
    return calibration, why if t.rank == 0 else None


#: Measurements this process took and could not save, by key: a second
#: communicator of the same shape in the same job uses them instead of measuring again.
_THIS_JOB: dict[str, Calibration] = {}


@dataclass
class _AutoSettings:
    """What auto resolves with on one transport: the calibration and ``REFCOLL_ALGO``."""

    calibration: Calibration
    allowed: AlgoFilter = field(default_factory=AlgoFilter)
    choices: dict = field(default_factory=dict)


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
    if not isinstance(t, MPITransport):  # the simulator: one process, one environment
        preset = getattr(getattr(t, "world", None), "calibration", None)
        return _AutoSettings(preset or DEFAULT, algo_filter())
    from .agree import agree

    error, mode, allowed = None, "cache", AlgoFilter()
    try:
        mode, allowed = calibration_mode(), algo_filter()
    except UsageError as exc:
        error = str(exc)
    with t.call("auto"):
        # Every rank's environment must say the same: one rank's typo is everyone's error.
        agree(t, collective="auto", error=error or "",
              options=[("REFCOLL_CALIBRATION", os.environ.get("REFCOLL_CALIBRATION", "")),
                       ("REFCOLL_ALGO", os.environ.get("REFCOLL_ALGO", ""))])
        if error:
            raise UsageError(f"rank {t.rank}: {error}")
        if mode == "default":
            return _AutoSettings(DEFAULT, allowed)
        calibration, _ = calibrate(t, force=mode == "measure")
    return _AutoSettings(calibration, allowed)


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
    settings = _settings(t)
    choices = settings.choices
    key = (collective, count, itemsize)
    name = choices.get(key)
    if name is None:
        if len(choices) >= _CHOICES_KEPT:
            choices.clear()
        name = choices[key] = choose(collective, t.size, count, itemsize, settings.calibration,
                                     settings.allowed.allowed(collective))
    return name


def _dispatch(collective: str):
    def run(t, *args, **options):
        extra = set(options) - {"op", "root"}
        if extra:
            raise UsageError(f"rank {t.rank}: algorithm 'auto' takes no algorithm options "
                             f"(got {', '.join(sorted(extra))}); name the algorithm instead")
        buf = args[0]
        count = buf.size // t.size if collective == "allgather" else buf.size
        name = resolve(t, collective, count, buf.itemsize)
        return algorithms.implementation(name, collective)(t, *args, **options)

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
    )


def choice_table(calibration: Calibration, ps=(2, 4, 8, 16, 64),
                 sizes=(8, 1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 24, 1 << 28),
                 collective: str = "allreduce", itemsize: int = 4) -> list[dict]:
    """Return what auto picks for each (p, bytes), as rows for ``refcoll list``."""
    return [{"p": p, "bytes": b, "algorithm": choose(collective, p, b // itemsize, itemsize,
                                                     calibration)}
            for p in ps for b in sizes]



