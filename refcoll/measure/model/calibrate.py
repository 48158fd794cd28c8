"""Calibration: measure this machine, and hold the model's counts to measured all-reduces.

:func:`calibrate` measures α, β and γ and the step tables of
:class:`~refcoll.core.calibration.Calibration`; :func:`predict` prices an
all-reduce with them; :func:`compare_with_measurement` (``refcoll model
--calibrate``) measures real all-reduces beside the predictions. The textbook
fit (α and β by least squares over ping-pong times, γ over NumPy reductions)
misses them by two to five times: β depends on the message size and on whether
the buffers are in cache, and with more ranks than cores a round waits for its
peers to be scheduled. So the prediction keeps each algorithm's
:class:`~refcoll.core.cost.Cost` and prices its rounds and reductions with steps
measured at the message sizes and buffer sizes the all-reduce uses.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ... import algorithms as registry
from ...calls.agree import barrier
from ...calls.auto import resolve
from ...calls.calibration import ping_pong
from ...calls.collectives import allreduce
from ...core.calibration import GAMMA_ITEMSIZE, Calibration
from ...core.errors import UsageError
from ...core.ops import get_op
from ...transport.base import transport_cache

__all__ = ["CALIBRATE_LIMIT", "CALIBRATE_DEFAULT", "calibration_choices", "Comparison",
           "calibrate", "predict", "measure_allreduce", "compare_with_measurement"]

#: The largest buffer ``refcoll model --calibrate`` measures (every rank holds a few).
CALIBRATE_LIMIT = 1 << 30

#: What ``refcoll model --calibrate`` measures unless told: the all-reduces whose
#: rounds the measured-step model prices best, and ``auto``'s choice among them.
CALIBRATE_DEFAULT = ("ring", "recursive_doubling", "rabenseifner", "auto")


def calibration_choices() -> list[str]:
    """Return the all-reduces calibration can measure: a cost, and no helper processes."""
    return [name for name in registry.names("allreduce")
            if "allreduce" in registry.get(name).costs and registry.get(name).workers is None]


def _pingpong_sizes(largest: int) -> list[int]:
    """Return 8 B and every power of two from 1 KiB to the first at or past ``largest``."""
    sizes, b = [8], 1 << 10
    while b < 2 * largest:
        sizes.append(b)
        b *= 2
    return sizes


def _message_sizes(nbytes: int, p: int) -> list[int]:
    """Return the message sizes an all-reduce of ``nbytes`` on ``p`` ranks sends, bracketed.

    ``nbytes / 2^k`` for ``k = 0 .. ⌈lg p⌉`` (whole buffers for recursive doubling,
    halves and quarters for Rabenseifner, ``nbytes/p`` for the ring), rounded
    down to whole float32 elements.
    """
    return sorted({max(4, (nbytes >> k) // 4 * 4) for k in range((p - 1).bit_length() + 1)})


def _repeats(nbytes: int) -> int:
    """Return how often to time an operation on ``nbytes``: the same on every rank."""
    return 100 if nbytes <= 1 << 16 else 40 if nbytes <= 1 << 20 else 20 if nbytes <= 1 << 24 else 8


def _largest_median(t, times: list[float]) -> float:
    """Return the largest over ranks of each rank's median time (every rank calls)."""
    mine = np.array([float(np.median(times)) if times else 0.0])
    return float(allreduce(mine, t, op="max", algorithm="recursive_doubling", validate=False)[0])


def _warmups(repeats: int) -> int:
    """Return the untimed calls before ``repeats`` timed ones: fresh buffers and caches settle."""
    return max(3, repeats // 2)


def _timed(t, fn: Callable[[int], None], repeats: int, *, sync: bool = True) -> list[float]:
    """Return the times of ``repeats`` calls ``fn(i)``, after :func:`_warmups` untimed ones."""
    times = []
    for i in range(_warmups(repeats) + repeats):
        if sync:
            barrier(t)
        start = time.perf_counter()
        fn(i)
        if i >= _warmups(repeats):
            times.append(time.perf_counter() - start)
    return times


def _fit_line(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """Return ``(a, b)``, both >= 0, minimising ``Σ ((a + b·x - y)/y)²`` (relative error).

    A negative intercept or slope means nothing here (a latency, a time per
    byte), so when the free fit gives one, it is fixed at 0 and the other refitted.
    """
    xs = np.array([x for x, _ in points], dtype=np.float64)
    ys = np.array([y for _, y in points], dtype=np.float64)
    design = np.stack([1 / ys, xs / ys], axis=1)
    target = np.ones_like(ys)
    (a, b), *_ = np.linalg.lstsq(design, target, rcond=None)
    if a < 0:
        a, b = 0.0, float(max(design[:, 1] @ target / (design[:, 1] @ design[:, 1]), 0.0))
    elif b < 0:
        a, b = float(max(design[:, 0] @ target / (design[:, 0] @ design[:, 0]), 0.0)), 0.0
    return float(a), float(b)


def _buffers(t, nbytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return three float32 buffers of ``nbytes // 4`` elements, views of buffers kept on ``t``.

    Calibration and measurement reuse one set of pages: allocating and freeing
    buffers of tens of MiB between measurements leaves the kernel reclaiming
    memory for a second or two, on a core the ranks need, and the next
    measurements come out several times too slow.
    """
    kept = transport_cache(t, "model").setdefault("buffers", [])
    count = max(nbytes // 4, 1)
    if not kept or kept[0].size < count:
        kept[:] = [np.ones(count, np.float32) for _ in range(3)]
    return kept[0][:count], kept[1][:count], kept[2][:count]


def _pingpong(t, sizes: list[int]) -> list[tuple[int, float]]:
    pool, back, _ = (buf.view(np.uint8) for buf in _buffers(t, sizes[-1]))
    points = []
    for b in sizes:
        send, recv = pool[:b], back[:b]
        times: list[float] = []
        if t.rank in (0, 1):
            peer = 1 - t.rank

            def round_trip(_: int) -> None:
                ping_pong(t, send, recv, peer)

            times = [s / 2 for s in _timed(t, round_trip, _repeats(b), sync=False)]
        points.append((b, _largest_median(t, times)))
    return points


def _step_table(t, nbytes: int) -> list[tuple[int, int, float, float, float, float]]:
    """Time ring steps and their reductions per message size, inside buffers of ``nbytes``.

    The steps do to memory what the rounds of an out-of-place ring,
    recursive-doubling or Rabenseifner all-reduce do, slice by slice through
    an input and an output buffer of ``nbytes``: the peer's partial is received
    straight into the output slice and reduced there with the input slice.
    ``first``: right after a barrier, sending a slice of the input, as a call's
    first round does. ``later``: back to back, sending the slice the previous
    step has just reduced, as later rounds do; that data is still in the
    sender's cache, and a peer on a core of another cache domain pays for
    fetching it, as the sender then pays for writing lines the peer has read.

    Returns ``(nbytes, message, first, later, reduction after first, reduction
    after later)`` rows, seconds.
    """
    add = get_op("sum")
    left, right = (t.rank - 1) % t.size, (t.rank + 1) % t.size
    count = nbytes // 4
    x, out, spare = _buffers(t, nbytes)
    rows = []
    for b in _message_sizes(nbytes, t.size):
        elements = b // 4
        slots = max(count // elements, 1)
        repeats, warmups = _repeats(b), _warmups(_repeats(b))
        medians = []

        def piece(buf: np.ndarray, i: int) -> np.ndarray:
            return buf[(i % slots) * elements:(i % slots + 1) * elements]

        for kind in ("first", "later"):
            steps, reductions = [], []
            for i in range(warmups + repeats):
                if kind == "first" or i == warmups:
                    barrier(t)
                start = time.perf_counter()
                if kind == "first":
                    sending, landing = piece(x, i), piece(out, i)
                else:  # what the previous step reduced; never the slice it receives into
                    sending = piece(out, i - 1)
                    landing = piece(spare if slots == 1 else out, i)
                t.sendrecv(sending, right, landing, left)
                middle = time.perf_counter()
                t.reduce_local(add, landing, piece(x, i), piece(out, i))
                if i >= warmups:
                    steps.append(middle - start)
                    reductions.append(time.perf_counter() - middle)
            medians.append((_largest_median(t, steps), _largest_median(t, reductions)))
        (first, reduce_first), (later, reduce_later) = medians
        rows.append((nbytes, b, first, later, reduce_first, reduce_later))
    return rows


def calibrate(t, sizes: Sequence[int] = (1 << 16, 1 << 20, 1 << 24), *,
              after_size: Callable[[int], None] | None = None) -> Calibration:
    """Measure this machine's step tables for ``sizes``, then α, β and γ (collective).

    First an all-reduce call's own work; then, for each all-reduce size in
    ``sizes`` from the smallest up, a ring step and a reduction at each message
    size :func:`_message_sizes` gives, inside buffers of that size (see
    :class:`~refcoll.core.calibration.Calibration`), and ``after_size(nbytes)`` if given (what
    :func:`compare_with_measurement` measures there); last the ping-pong
    between ranks 0 and 1 and local reductions at 8 B and every power of two
    from 1 KiB to ``max(sizes)``, for the α-β-γ fit. Small sizes come first
    because transfers of tens of MiB leave this kind of machine slower at
    small and medium sizes for a while. Everything goes through ``Transport``
    calls, as the algorithms make them; every rank returns the same numbers.
    """
    if t.size < 2:
        raise UsageError("calibration needs at least 2 ranks to measure messages")
    if not sizes or min(sizes) < 4:
        raise UsageError("calibration sizes must be at least 4 bytes (one float32)")
    measured = _pingpong_sizes(max(sizes))
    _buffers(t, measured[-1])  # once, at the largest size
    call = _call_overhead(t)
    steps = []
    for nbytes in sorted(set(sizes)):
        steps += _step_table(t, nbytes)
        if after_size is not None:
            after_size(nbytes)
    pingpong = _pingpong(t, measured)
    add = get_op("sum")
    reduction = []
    for b in measured[1:]:
        a, c, out = _buffers(t, b)
        reduction.append((b, _largest_median(
            t, _timed(t, lambda _: t.reduce_local(add, a, c, out), _repeats(b), sync=False))))
    alpha, beta = _fit_line(pingpong)
    _, gamma = _fit_line(reduction)
    # The fit's γ is per byte of one float32 operand; the record's is per element.
    return Calibration(alpha=alpha, beta=beta, gamma=gamma * GAMMA_ITEMSIZE, source="measured",
                       ranks=t.size, call=call, pingpong=tuple(pingpong),
                       reduction=tuple(reduction), steps=tuple(steps))


def _call_overhead(t) -> float:
    """Return the median time of a one-element all-reduce on a one-rank split of ``t``."""
    solo = t.split(t.rank, 0)
    x, out = np.ones(1, np.float32), np.empty(1, np.float32)
    times = _timed(solo, lambda _: allreduce(x, solo, algorithm="ring", validate=False, out=out),
                   _repeats(0), sync=False)
    return _largest_median(t, times)


def _interpolate(table: Sequence[tuple[float, float]], x: float) -> float:
    """Return ``y`` at ``x``, log-log linear between the table's points (sorted by ``x``).

    Outside the table, the nearest segment extended (the nearest point if only one).
    """
    if len(table) == 1:
        return table[0][1]
    xs = np.log([max(a, 1e-300) for a, _ in table])
    ys = np.log([max(b, 1e-300) for _, b in table])
    at = math.log(max(x, 1e-300))
    i = int(np.clip(np.searchsorted(xs, at) - 1, 0, len(xs) - 2))
    slope = (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])
    return float(math.exp(ys[i] + slope * (at - xs[i])))


def predict(calibration: Calibration, algorithm: str, p: int, nbytes: int, itemsize: int = 4,
            *, fit: bool = False) -> float:
    """Return the predicted time of a single-machine all-reduce of ``nbytes``.

    With ``fit`` (or for a size the calibration has no steps for): the textbook
    ``rounds·α + critical_bytes·β + reduced·s·γ`` of :mod:`refcoll.core.cost` at the
    fitted α, β, γ. Otherwise the measured-step model: ``call + F(b) +
    (rounds-1)·L(b) + RF(b) + (k-1)·RL(b)``, ``b = critical_bytes/rounds`` the
    algorithm's mean message, ``k = reduced·s/b`` its reductions, ``F``, ``L``,
    ``RF`` and ``RL`` the calibration's first and later ring steps and the
    reductions after each, inside buffers of ``nbytes`` (log-log interpolated
    between its message sizes): a timed call starts from synchronised ranks
    and sends its input in its first round, later rounds send what the one
    before reduced.
    Exact in form for ring and recursive doubling, whose messages are all
    alike; Rabenseifner's halve, and ``b`` is their mean.
    """
    c = registry.get(algorithm).costs["allreduce"](p, nbytes // itemsize, itemsize)
    steps = [row[1:] for row in calibration.steps if row[0] == nbytes]
    if fit or not steps:
        return c.time(calibration.alpha, calibration.beta, calibration.gamma_per_byte * itemsize)
    if c.rounds == 0:
        return calibration.call
    message = c.critical_bytes / c.rounds
    reductions = c.reduced * itemsize / message if message else 0.0

    def at(column: int) -> float:
        return _interpolate([(row[0], row[column]) for row in steps], message)

    return (calibration.call + at(1) + (c.rounds - 1) * at(2) + min(reductions, 1.0) * at(3)
            + max(reductions - 1.0, 0.0) * at(4))


def measure_allreduce(t, algorithm: str, nbytes: int, *, repeats: int | None = None) -> float:
    """Return the median time (largest over ranks) of ``refcoll.allreduce`` of float32 ``nbytes``.

    Out of place into a preallocated ``out=``, argument agreement off: the
    algorithm alone, as ``refcoll bench`` times it.
    """
    x, out, _ = _buffers(t, nbytes)
    times = _timed(t, lambda _: allreduce(x, t, algorithm=algorithm, validate=False, out=out),
                   repeats or _repeats(nbytes))
    return _largest_median(t, times)


def _machine_busy() -> float | None:
    """Return the CPU seconds every process on this machine has used so far (None: unknown).

    From ``/proc/stat`` (Linux): user, nice, system, irq, softirq and steal time,
    in clock ticks.
    """
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            fields = fh.readline().split()
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[1:9])
    return (user + nice + system + irq + softirq + steal) / ticks


@dataclass(frozen=True)
class Comparison:
    """Predicted against measured all-reduce times on this machine.

    Attributes:
        calibration: what the predictions were made from.
        rows: by algorithm then size: ``algorithm`` (``auto`` names what it
            resolved to), ``bytes``, ``predicted`` (measured-step model),
            ``predicted_fit`` (α-β-γ fit), ``measured``, ``ratio`` =
            predicted / measured.
        others: the share of the machine's CPU time that other processes used
            while this ran (None where unknown): above a few percent, the
            measurements shared the cores with someone else's work.
    """

    calibration: Calibration
    rows: list[dict]
    others: float | None

    def within(self, tolerance: float = 0.3, *, fit: bool = False) -> int:
        """Return how many predictions are within ``tolerance`` of the measured time."""
        key = "predicted_fit" if fit else "predicted"
        return sum(abs(r[key] / r["measured"] - 1) <= tolerance for r in self.rows
                   if r["measured"])

    def to_json(self) -> dict:
        """Return the comparison as a JSON-ready dict."""
        return {"calibration": self.calibration.to_json(), "rows": self.rows,
                "others_cpu_share": self.others, "within_30_percent": self.within(),
                "fit_within_30_percent": self.within(fit=True)}


def compare_with_measurement(t, algorithms: Sequence[str], sizes: Sequence[int]) -> Comparison:
    """Calibrate, measure each algorithm at each size on ``t``, and predict (collective).

    Each size's all-reduces are measured right after its step tables (see
    :func:`calibrate`); the predictions use the calibration alone. The CPU
    time the machine spent beyond this job's own ranks is reported with them.
    """
    measured: dict[tuple[str, int], tuple[str, float]] = {}

    def measure_all(nbytes: int) -> None:
        for algorithm in algorithms:
            chooses = registry.get(algorithm).chooses  # auto: what it resolves to here
            ran = resolve(t, "allreduce", nbytes // 4, 4) if chooses else algorithm
            measured[algorithm, nbytes] = ran, measure_allreduce(t, algorithm, nbytes)

    busy, own, wall = _machine_busy(), time.process_time(), time.perf_counter()
    calibration = calibrate(t, sizes, after_size=measure_all)
    own = allreduce(np.array([time.process_time() - own]), t, algorithm="recursive_doubling",
                    validate=False)[0]
    others = None
    if busy is not None:
        wall = time.perf_counter() - wall
        others = max(_machine_busy() - busy - own, 0.0) / (wall * (os.cpu_count() or 1))
    rows = []
    for algorithm in algorithms:
        for nbytes in sizes:
            ran, seconds = measured[algorithm, nbytes]
            predicted = predict(calibration, ran, t.size, nbytes)
            rows.append({"algorithm": algorithm if ran == algorithm else f"{algorithm} ({ran})",
                         "bytes": nbytes, "predicted": predicted,
                         "predicted_fit": predict(calibration, ran, t.size, nbytes, fit=True),
                         "measured": seconds,
                         "ratio": predicted / seconds if seconds else math.inf})
    return Comparison(calibration, rows, others)
