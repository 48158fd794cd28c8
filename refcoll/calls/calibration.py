"""The calibration ``auto`` prices with: measured once per machine shape, cached, agreed.

The numbers (α latency per message, β seconds per byte, γ seconds per element
combined: :class:`~refcoll.core.calibration.Calibration`) come from a small
measurement (:func:`measure`), kept in ``$REFCOLL_CACHE/calibration.json``
(default ``~/.cache/refcoll``) under a key of everything they depend on: the
host, the MPI library, the ranks per node and whether the ranks outnumber the
cores (:class:`CalibrationKey`). A measurement taken while oversubscribed, or
too noisy to trust, is used by the job that took it and never saved
(:data:`LOAD_LIMIT`). ``refcoll calibrate`` measures and saves on purpose.
``REFCOLL_CALIBRATION`` (:func:`calibration_mode`) says where the numbers come
from; :mod:`refcoll.calls.auto` describes the modes.

The cache is refcoll's own file, but anyone may have left anything there: it is
read through :mod:`refcoll.core.reading` (a regular file of bounded, finite JSON)
and each entry's numbers checked (:func:`_from_record`). A cache that cannot be
read, or an entry that is out of range, is said once on stderr and ignored: auto
then measures, or uses its defaults, as with no cache. Saving takes a lock beside
the file (:func:`refcoll.core.writing.locked`) around reading, adding the entry and
replacing the file (:func:`refcoll.core.writing.write_json`, a temporary renamed
over it), so two jobs saving at once keep both entries; a cache that cannot be read
is left as it is, not overwritten.
"""

from __future__ import annotations

import collections
import os
import platform
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..algorithms.naive import naive_broadcast
from ..core.calibration import DEFAULT, Calibration
from ..core.errors import UsageError
from ..core.reading import number, read_json
from ..core.topology import machine_of
from ..core.writing import locked, write_json
from ..transport.deadline import mpi_library_version
from .agree import allgather_records, pack, unpack

__all__ = ["Calibration", "CalibrationKey", "DEFAULT", "LOAD_LIMIT", "measure", "cache_path",
           "current_calibration", "cached_calibrations", "calibrate", "calibration_mode",
           "ping_pong", "runnable_tasks", "node_peers", "host_counts", "INTER_SIZES"]

#: A measurement taken while more tasks were runnable than there are cores
#: (runnable tasks per core above this) is too noisy to keep: another job was
#: taking the cores, and every round trip waited for the scheduler.
LOAD_LIMIT = 1.0


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
    nodes: int = 1

    def text(self) -> str:
        """Return the key as the cache file writes it (``|nodes=N`` across several nodes)."""
        return (f"{self.host}|{self.library}|ranks_per_node={self.ranks_per_node}|"
                f"oversubscribed={'yes' if self.oversubscribed else 'no'}"
                + (f"|nodes={self.nodes}" if self.nodes > 1 else ""))


def cache_path() -> Path:
    """Return where measured calibrations are cached."""
    base = os.environ.get("REFCOLL_CACHE") or os.path.join(Path.home(), ".cache", "refcoll")
    return Path(base) / "calibration.json"


#: What refcoll said about the cache already: each warning once in a process.
_WARNED: set[str] = set()


def _warn_once(text: str) -> None:
    if text not in _WARNED:
        _WARNED.add(text)
        print(f"refcoll: warning: {text}", file=sys.stderr, flush=True)


def _read_cache() -> dict | None:
    """Return the cache's entries by key: ``{}`` when there is no cache, None when it is corrupt.

    A cache that is not a regular file of bounded JSON holding an object (a FIFO, a
    folder, ``NaN``, truncated text) is said once on stderr and treated as absent by
    the readers; :func:`_save` leaves it as it is.
    """
    path = cache_path()
    if not os.path.lexists(path):
        return {}
    try:
        data = read_json(path, what="calibration cache")
    except UsageError as exc:
        _warn_once(f"{exc}; the cache is ignored (remove it to keep calibrations again)")
        return None
    if not isinstance(data, dict):
        _warn_once(f"{path}: the calibration cache must hold an object of calibrations by key, "
                   f"not a {type(data).__name__}; the cache is ignored (remove it to keep "
                   "calibrations again)")
        return None
    return data


#: The two-level fields a cache record may hold.
_LEVEL_FIELDS = ("inter_alpha", "inter_beta", "nodes", "per_node")

#: Each number of a cache record: ``(field, whole number, least, most)``. Seconds a message
#: at most an hour, a byte or an element at most a second; ranks and nodes whole numbers.
_RECORD_FIELDS = (("alpha", False, 0.0, 3600.0), ("beta", False, 0.0, 1.0),
                  ("gamma", False, 0.0, 1.0), ("inter_alpha", False, 0.0, 3600.0),
                  ("inter_beta", False, 0.0, 1.0), ("nodes", True, 0, 1 << 24),
                  ("per_node", True, 0, 1 << 24))


#: How far in the future a cached ``measured_at`` may lie (another host's clock), seconds.
_CLOCK_SLACK = 86400.0


def _from_record(key: str, record) -> Calibration | None:
    """Return the calibration of one cache entry, or None (said once) where it is not one.

    α, β and γ must be there; every number must be finite and in range
    (:data:`_RECORD_FIELDS`; ``measured_at`` and ``load`` not negative, or null).
    """
    where = f"{cache_path()}: the entry {key!r}"
    try:
        if not isinstance(record, dict):
            raise UsageError(f"{where}: must be an object, not a {type(record).__name__}")
        missing = [k for k in ("alpha", "beta", "gamma") if k not in record]
        if missing:
            raise UsageError(f"{where}: lacks {', '.join(missing)}")
        values = {name: number(record.get(name, 0), where=f"{where}: {name}", integer=whole,
                               least=least, most=most)
                  for name, whole, least, most in _RECORD_FIELDS}
        latest = {"measured_at": time.time() + _CLOCK_SLACK, "load": None}  # not in the future
        extra = {name: (None if record.get(name) is None else
                        float(number(record[name], where=f"{where}: {name}", least=0,
                                     most=latest[name])))
                 for name in ("measured_at", "load")}
    except UsageError as exc:
        _warn_once(f"{exc}; the entry is ignored")
        return None
    return Calibration(float(values["alpha"]), float(values["beta"]), float(values["gamma"]),
                       source=f"cached in {cache_path()}", key=key, **extra,
                       **_levels([values[k] for k in _LEVEL_FIELDS]))


def _load(key: str) -> Calibration | None:
    record = (_read_cache() or {}).get(key)
    return None if record is None else _from_record(key, record)


def _save(key: str, calibration: Calibration) -> str | None:
    """Add ``calibration`` to the cache under ``key``, keeping every other job's entries;
    return None, or why it was not saved.

    Under the cache's lock: read it, add the entry, replace the file (a temporary
    renamed over it). A cache that cannot be read is not overwritten; a cache that
    cannot be written only costs a measurement next time.
    """
    path = cache_path()
    entry = {"alpha": calibration.alpha, "beta": calibration.beta, "gamma": calibration.gamma,
             "measured_at": calibration.measured_at, "load": calibration.load,
             **{k: getattr(calibration, k) for k in _LEVEL_FIELDS}}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with locked(path):
            data = _read_cache()
            if data is None:
                return (f"the cache {path} cannot be read (said above) and is left as it is; "
                        "remove it to keep calibrations again")
            data[key] = entry
            write_json(path, data, allow_nan=False)
    except (OSError, UsageError, ValueError) as exc:  # a read-only home; a number not finite
        return f"the cache {path} could not be written: {exc}"
    return None


def cached_calibrations(host: str | None = None) -> list[Calibration]:
    """Return every cached calibration of ``host`` (default: this one), newest first."""
    host = platform.node() if host is None else host
    found = [_from_record(k, v) for k, v in (_read_cache() or {}).items()
             if k.startswith(host + "|")]
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


def host_counts(hosts) -> dict[str, int]:
    """Return how many ranks each host holds, hosts in the order their first rank comes."""
    return dict(collections.Counter(hosts))


def node_peers(hosts: list[str]) -> tuple[int | None, int | None, int, int]:
    """Return ``(intra peer, inter peer, nodes, ranks per node)`` of rank 0, from every rank's host.

    The intra peer is the first other rank on rank 0's host, the inter peer the
    first rank on another host (None where there is none); the ranks per node
    are the most on one host.
    """
    counts = host_counts(hosts)
    intra = next((r for r in range(1, len(hosts)) if hosts[r] == hosts[0]), None)
    inter = next((r for r in range(1, len(hosts)) if hosts[r] != hosts[0]), None)
    return intra, inter, len(counts), max(counts.values(), default=1)


def _round_trips(t, buf, peer: int, repeats: int, samples: list | None) -> float:
    """Return half the median round trip of ``buf`` between rank 0 and ``peer`` (those two call).

    A first exchange sets up the connection and is not timed. Rank 0 counts the
    runnable tasks a few times between round trips into ``samples`` (never timed).
    """
    ping_pong(t, buf, buf, peer)
    every = max(1, repeats // 3)
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        ping_pong(t, buf, buf, peer)
        times.append(time.perf_counter() - start)
        if samples is not None and t.rank == 0 and i % every == every - 1:
            count = runnable_tasks()
            if count is not None:
                samples.append(count)
    return float(np.median(times)) / 2


#: Messages of the ping-pongs across nodes: β is the slope between the two large ones,
#: so a shaped link's token bucket (a burst at the line rate) and α cancel out.
INTER_SIZES = (1 << 20, 1 << 22)

#: Round trips of each large message across nodes (a 100 Mbit/s link takes 0.3 s each way).
INTER_REPEATS = 5


def measure(t, *, repeats: int = 30) -> Calibration:
    """Measure α, β and γ, and across nodes α and β again (every rank must call; collective).

    α: half the round trip of an 8-byte ping-pong between rank 0 and a rank of
    its node; β: from a 4 MiB ping-pong, less α; γ: a NumPy float32 addition
    of 1 Mi elements with ``out=``. Medians of ``repeats``. When the ranks
    span nodes (their hosts, ``t.hosts``, differ), rank 0 measures the link to
    a rank of another node too: ``inter_alpha`` from 8 bytes, ``inter_beta``
    the slope between :data:`INTER_SIZES` (a two-level calibration,
    :meth:`~refcoll.core.calibration.Calibration.link`). ``load``: rank 0
    counts the runnable tasks of its machine (:func:`runnable_tasks`) three
    times in each ping-pong and keeps the fewest, per core: a task that runs
    for an instant (a kernel thread) is missed, a job that runs all along is
    in every count. The ranks of this job poll while they wait, so on a
    machine of its own a job that fills the cores reads 1.0; another job
    running makes it more. Rank 0's result is broadcast so every rank returns
    the same.
    """
    # α, β, γ, load (-1: unknown), when, inter α, inter β, nodes, ranks per node
    values = np.zeros(9, dtype=np.float64)
    values[3] = -1.0
    samples: list[int] = []
    hosts = list(getattr(t, "hosts", None) or [""] * t.size)
    intra, inter, nodes, per_node = node_peers(hosts)
    values[7:9] = nodes, per_node
    small, large = np.zeros(1, np.float64), np.zeros(1 << 20, np.float32)
    values[:2] = DEFAULT.alpha, DEFAULT.beta
    if intra is not None and t.rank in (0, intra):
        alpha = _round_trips(t, small, intra if t.rank == 0 else 0, repeats, samples)
        beta = max(_round_trips(t, large, intra if t.rank == 0 else 0, repeats, samples)
                   - alpha, 0.0) / large.nbytes
        values[:2] = alpha, beta
    if inter is not None and t.rank in (0, inter):
        peer = inter if t.rank == 0 else 0
        values[5] = _round_trips(t, small, peer, repeats, samples)
        times = [_round_trips(t, np.zeros(n, np.uint8), peer, INTER_REPEATS, None)
                 for n in INTER_SIZES]
        values[6] = max((times[1] - times[0]) / (INTER_SIZES[1] - INTER_SIZES[0]), 1e-15)
        if intra is None:  # one rank a node: the flat link is the only one
            values[:2] = values[5], values[6]
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
    naive_broadcast(t, values, root=0)
    return Calibration(*map(float, values[:3]), source="measured", measured_at=float(values[4]),
                       load=float(values[3]) if values[3] >= 0 else None,
                       **_levels(values[5:9]))


def _levels(values) -> dict:
    """Return the two-level fields of a calibration from ``(inter α, inter β, nodes, per node)``."""
    inter_alpha, inter_beta, nodes, per_node = map(float, values)
    if nodes <= 1:
        return {}
    return {"inter_alpha": inter_alpha, "inter_beta": inter_beta, "nodes": int(nodes),
            "per_node": int(per_node)}


#: Bytes of one rank's record in the exchange that finds the key: host name and cores.
_HOST_RECORD = 256

#: Bytes of rank 0's word on whether it saved the calibration (empty: it did).
_WHY_RECORD = 1024


def _key_of(t) -> CalibrationKey:
    """Return ``t``'s :class:`CalibrationKey`, the same on every rank (collective on ``t``).

    Every rank sends its host name and core count to every other (a
    fixed-size allgather over ``t``'s own point-to-point messages, so it has
    the transport's deadline): the ranks per node are the most ranks on one
    host, and the job is oversubscribed when some host has more ranks than
    cores.
    """
    from mpi4py import MPI

    mine = pack([[MPI.Get_processor_name(), os.cpu_count() or 1]], _HOST_RECORD)
    everyone = allgather_records(t, mine)
    hosts: dict[str, list[int]] = {}
    machines: dict[str, list[int]] = {}  # an emulated cluster's nodes share one machine's cores
    for row in everyone:
        name, cores = unpack(row)
        hosts.setdefault(name, []).append(int(cores))
        machines.setdefault(machine_of(name), []).append(int(cores))
    library = mpi_library_version()
    return CalibrationKey(
        host=unpack(everyone[0])[0] or platform.node(),
        library=library,
        ranks_per_node=max(len(v) for v in hosts.values()),
        oversubscribed=any(len(v) > min(v) for v in machines.values()),
        nodes=len(hosts),
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
    the result unless :func:`_why_not_saved` objects or the cache cannot be
    written (the reason comes back on every rank, and with ``announce`` goes to
    rank 0's stderr). ``save=False`` (with ``force``:
    ``REFCOLL_CALIBRATION=measure``) neither reads nor writes the cache. A
    one-rank ``t`` has no peer to measure: it gets :data:`DEFAULT`, saved nowhere.
    """
    key = _key_of(t)
    if t.size < 2:  # no peer: nothing to measure, and nothing worth keeping
        return replace(DEFAULT, key=key.text(),
                       source="the defaults (one rank: there is no peer to measure)"), None
    found, kind = None, 0.0
    if t.rank == 0 and not force:
        found, kind = _load(key.text()), 1.0
        if found is None:
            found, kind = _THIS_JOB.get(key.text()), 2.0
    record = np.zeros(10)  # kind (0: measure, 1: cached in the file, 2: this job's), α, β, γ...
    if found is not None:
        record[:] = (kind, found.alpha, found.beta, found.gamma, found.measured_at or 0,
                     -1.0 if found.load is None else found.load,
                     *(getattr(found, k) for k in _LEVEL_FIELDS))
    naive_broadcast(t, record, root=0)
    if record[0]:
        source = (f"cached in {cache_path()}" if record[0] == 1 else
                  "measured earlier in this job, not saved")
        return Calibration(*map(float, record[1:4]), source=source,
                           key=key.text(), measured_at=float(record[4]) or None,
                           load=float(record[5]) if record[5] >= 0 else None,
                           **_levels(record[6:10])), None
    calibration = replace(measure(t), key=key.text())
    if not save:
        return replace(calibration, source="measured for this job (the cache is neither read "
                                           "nor written)"), None
    # Rank 0 alone decides (its key: the ranks' own machine files may differ) and keeps the
    # cache; every rank learns what it said, in the one broadcast every rank makes.
    said = np.zeros(_WHY_RECORD, dtype=np.uint8)
    if t.rank == 0:
        text = _why_not_saved(key, calibration) or _save(key.text(), calibration) or ""
        said = pack([text, text[:_WHY_RECORD // 2] + "..."], _WHY_RECORD)
    naive_broadcast(t, said, root=0)
    why = unpack(said) or None
    if why is None:
        return replace(calibration, source=f"measured, saved in {cache_path()}"), None
    calibration = replace(calibration, source=f"measured for this job only ({why})")
    if t.rank != 0:
        return calibration, why
    if announce:
        print(f"refcoll: note: auto's calibration was measured for this job only and not "
              f"saved: {why}", file=sys.stderr, flush=True)
    _THIS_JOB[key.text()] = calibration  # other communicators of this job reuse it
    return calibration, why


#: Measurements this process took and could not save, by key: a second
#: communicator of the same shape in the same job uses them instead of measuring again.
_THIS_JOB: dict[str, Calibration] = {}


