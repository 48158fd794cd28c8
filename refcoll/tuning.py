"""``algorithm="auto"``: pick the algorithm the cost model says is fastest, like NCCL's tuner.

The model is each algorithm's :class:`~refcoll.cost.Cost` evaluated at this
machine's α (latency per message), β (seconds per byte) and γ (seconds per element
combined). Those three numbers come from a small calibration, measured once and
cached in ``$REFCOLL_CACHE/calibration.json`` (default ``~/.cache/refcoll``), keyed
by the MPI library and host; the simulator uses :data:`DEFAULT` so its choices are
reproducible. Every rank must pick the same algorithm, so rank 0 decides the
calibration and broadcasts it once per communicator.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from . import algorithms
from .errors import UsageError

__all__ = ["Calibration", "DEFAULT", "calibration_for", "measure", "choose", "candidates",
           "cache_path", "resolve", "auto_algorithm", "choice_table", "current_calibration"]


@dataclass(frozen=True)
class Calibration:
    """α (s per message), β (s per byte), γ (s per element combined), and where they came from."""

    alpha: float
    beta: float
    gamma: float
    source: str = "default"


#: Shared-memory MPI on a current CPU: ~3 µs latency, ~4 GB/s, ~1 G additions/s.
DEFAULT = Calibration(alpha=3e-6, beta=1 / 4e9, gamma=1e-9, source="default")

#: Algorithms auto never picks: the reference, and those needing a node shape or switches.
_EXCLUDED = {"naive", "auto", "hierarchical", "switch"}


def candidates(collective: str) -> list[str]:
    """Return the algorithms auto chooses among for ``collective``."""
    names = [n for n in algorithms.names(collective) if n not in _EXCLUDED
             and collective in algorithms.get(n).costs]
    return names or ["naive"]


def choose(collective: str, p: int, count: int, itemsize: int,
           calibration: Calibration = DEFAULT) -> str:
    """Return the candidate with the least modelled time (ties: registry order)."""
    best, best_time = None, float("inf")
    for name in candidates(collective):
        cost = algorithms.get(name).costs[collective](p, count, itemsize)
        modelled = cost.time(calibration.alpha, calibration.beta, calibration.gamma)
        if modelled < best_time:
            best, best_time = name, modelled
    return best


def cache_path() -> Path:
    """Return where measured calibrations are cached."""
    base = os.environ.get("REFCOLL_CACHE") or os.path.join(Path.home(), ".cache", "refcoll")
    return Path(base) / "calibration.json"


def _cache_key(t) -> str:
    from mpi4py import MPI

    return f"{platform.node()}|{MPI.Get_library_version().splitlines()[0].strip()}"


def _load(key: str) -> Calibration | None:
    try:
        data = json.loads(cache_path().read_text())
        return Calibration(**data[key])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _save(key: str, calibration: Calibration) -> None:
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = json.loads(path.read_text()) if path.exists() else {}
        data[key] = asdict(calibration)
        path.write_text(json.dumps(data, indent=2))
    except (OSError, ValueError):
        pass  # a read-only home only costs a re-measurement next time


def ping_pong(t, send, recv, peer: int) -> None:
    """One round trip between ranks 0 and 1: rank 0 sends ``send`` first, the other answers."""
    if t.rank == 0:
        t.send(send, peer)
        t.recv(recv, peer)
    else:
        t.recv(recv, peer)
        t.send(send, peer)


def measure(t, *, repeats: int = 20) -> Calibration:
    """Measure α, β and γ on ranks 0 and 1 of ``t`` (every rank must call; collective).

    α: half the round trip of an 8-byte ping-pong; β: from a 4 MiB ping-pong, less
    α; γ: a NumPy float32 addition of 1 Mi elements with ``out=``. Medians of
    ``repeats``; rank 0's result is broadcast so every rank returns the same.
    """
    from .algorithms.naive import naive_broadcast

    values = np.zeros(3, dtype=np.float64)
    if t.rank in (0, 1) and t.size > 1:
        peer = 1 - t.rank
        small, large = np.zeros(1, np.float64), np.zeros(1 << 20, np.float32)

        def round_trip(buf) -> float:
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                ping_pong(t, buf, buf, peer)
                times.append(time.perf_counter() - start)
            return float(np.median(times)) / 2

        alpha = round_trip(small)
        beta = max(round_trip(large) - alpha, 0.0) / large.nbytes
        values[:] = alpha, beta, 0.0
    if t.rank == 0:
        a, b = np.ones(1 << 20, np.float32), np.ones(1 << 20, np.float32)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            np.add(a, b, out=a)
            times.append(time.perf_counter() - start)
        values[2] = float(np.median(times)) / a.size
        if t.size == 1:
            values[0], values[1] = DEFAULT.alpha, DEFAULT.beta
    naive_broadcast(t, values, root=0)
    return Calibration(*map(float, values), source="measured")


def calibration_for(t) -> Calibration:
    """Return the calibration auto uses on ``t``: cached per transport, same on every rank.

    The simulator (and any transport but MPI's) uses :data:`DEFAULT`, as does
    ``REFCOLL_CALIBRATION=default``. On MPI, rank 0 reads the cache file (or, the
    first time on this host and library, measures and writes it) and broadcasts
    the numbers. A device transport uses the calibration of the transport it wraps.
    """
    cached = t.__dict__.get("_calibration")
    if cached is not None:
        return cached
    inner = getattr(t, "inner", None)
    if inner is not None:  # a device transport: the MPI transport under it was measured
        t.__dict__["_calibration"] = calibration_for(inner)
        return t.__dict__["_calibration"]
    from .transport.mpi import MPITransport

    if not isinstance(t, MPITransport) or os.environ.get("REFCOLL_CALIBRATION") == "default":
        calibration = DEFAULT
    else:
        from .algorithms.naive import naive_broadcast

        key = _cache_key(t)
        found = _load(key) if t.rank == 0 else None
        flag = np.array([1.0 if found is not None else 0.0])
        naive_broadcast(t, flag, root=0)
        if flag[0]:
            values = np.array([found.alpha, found.beta, found.gamma]) if t.rank == 0 else np.zeros(3)
            naive_broadcast(t, values, root=0)
            calibration = Calibration(*map(float, values), source=f"cached in {cache_path()}")
        else:
            calibration = measure(t)
            if t.rank == 0:
                _save(key, calibration)
    t.__dict__["_calibration"] = calibration
    return calibration


#: Choices kept per transport; a training loop all-reduces a few dozen sizes.
_CHOICES_KEPT = 4096


def resolve(t, collective: str, count: int, itemsize: int) -> str:
    """Return the algorithm auto runs for this call on ``t``.

    Evaluating every candidate's cost takes tens of microseconds, as long as a
    small all-reduce itself, so each choice is kept on the transport.
    """
    choices = t.__dict__.setdefault("_auto_choices", {})
    key = (collective, count, itemsize)
    name = choices.get(key)
    if name is None:
        if len(choices) >= _CHOICES_KEPT:
            choices.clear()
        name = choices[key] = choose(collective, t.size, count, itemsize, calibration_for(t))
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


def current_calibration() -> Calibration:
    """Return the cached calibration of this host if any (no communication), else DEFAULT."""
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return DEFAULT
    mine = [v for k, v in data.items() if k.startswith(platform.node() + "|")]
    return Calibration(**{**mine[0], "source": f"cached in {cache_path()}"}) if mine else DEFAULT
