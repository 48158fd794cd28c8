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
measured at the message sizes and buffer sizes the all-reduce uses, and adds
the time its rounds wait for descheduled peers, measured by the same steps
(:mod:`~refcoll.model.calibrate_sched`). Steps and all-reduces are
measured in :data:`PASSES` interleaved passes per size, so both see the same
load, and each figure is the median over every pass. A blocking call keeps
no plan between calls: its steps and call are measured as the ordinary path
runs them (:mod:`~refcoll.model.calibrate_steps`).
"""

from __future__ import annotations

import math
import os
import time
from typing import Callable, Sequence

import numpy as np

from .. import algorithms as registry
from ..calls.agree import barrier
from ..calls.auto import resolve_with_options
from ..calls.calibration import ping_pong, runnable_tasks
from ..calls.collectives import allreduce
from ..core.calibration import GAMMA_ITEMSIZE, Calibration
from ..core.errors import UsageError
from ..core.ops import get_op
from ..transport.base import transport_cache
from .calibrate_compare import Comparison, machine_busy
from .calibrate_nodes import across_nodes, inter_link
from .calibrate_sched import stretch, wait_median, wait_summary, waits_at
from .calibrate_steps import InCall, call_overheads, own_work, planned_path, step_samples

__all__ = ["CALIBRATE_LIMIT", "CALIBRATE_DEFAULT", "PASSES", "calibration_choices", "Comparison",
           "calibrate", "predict", "scheduling_wait", "measure_allreduce",
           "compare_with_measurement"]

#: The largest buffer ``refcoll model --calibrate`` measures (every rank holds a few).
CALIBRATE_LIMIT = 1 << 30

#: What ``refcoll model --calibrate`` measures unless told: the all-reduces whose
#: rounds the measured-step model prices best, and ``auto``'s choice among them.
CALIBRATE_DEFAULT = ("ring", "recursive_doubling", "rabenseifner", "auto")

#: Interleaved passes per size: step tables, then every all-reduce, and again.
#: Another job's burst then lands in a share of each measurement's samples, not
#: in all of one and none of another.
PASSES = 6


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


#: The clock every measurement reads (a test replaces it with a counter).
_clock = time.perf_counter


def _everyone(t, values: Sequence[float]) -> np.ndarray:
    """Return every rank's ``values`` as rows of a ``(ranks, len(values))`` array (collective).

    Every rank must pass as many values; an all-reduce of the rows, each rank's
    own in place and zeros elsewhere.
    """
    rows = np.zeros((t.size, len(values)))
    rows[t.rank] = values
    return allreduce(rows.ravel(), t, algorithm="recursive_doubling",
                     validate=False).reshape(rows.shape)


def _largest_median(t, times: list[float]) -> float:
    """Return the largest over ranks of each rank's median time (every rank calls)."""
    mine = np.array([float(np.median(times)) if times else 0.0])
    return float(allreduce(mine, t, op="max", algorithm="recursive_doubling", validate=False)[0])


def _warmups(repeats: int) -> int:
    """Return the untimed calls before ``repeats`` timed ones: fresh buffers and caches settle."""
    return max(3, repeats // 2)


def _per_pass(repeats: int) -> tuple[int, int]:
    """Return ``(timed, untimed)`` calls of one of :data:`PASSES` passes, for ``repeats`` in all."""
    timed = -(-repeats // PASSES)
    return timed, max(1, timed // 2)


def _timed(t, fn: Callable[[int], None], repeats: int, *, sync: bool = True,
           warmups: int | None = None) -> list[float]:
    """Return the times of ``repeats`` calls ``fn(i)``, after ``warmups`` untimed ones.

    ``warmups`` defaults to :func:`_warmups`.
    """
    warmups = _warmups(repeats) if warmups is None else warmups
    times = []
    for i in range(warmups + repeats):
        if sync:
            barrier(t)
        start = _clock()
        fn(i)
        if i >= warmups:
            times.append(_clock() - start)
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


def _pingpong(t, sizes: list[int], partner: int = 1) -> list[tuple[int, float]]:
    """Return ``(bytes, one-way seconds)`` of ping-pongs between rank 0 and ``partner``."""
    pool, back, _ = (buf.view(np.uint8) for buf in _buffers(t, sizes[-1]))
    points = []
    for b in sizes:
        send, recv = pool[:b], back[:b]
        times: list[float] = []
        if t.rank in (0, partner):
            peer = partner if t.rank == 0 else 0

            def round_trip(_: int, send=send, recv=recv, peer=peer) -> None:
                ping_pong(t, send, recv, peer)

            times = [s / 2 for s in _timed(t, round_trip, _repeats(b), sync=False)]
        points.append((b, _largest_median(t, times)))
    return points


def _step_samples(t, nbytes: int, collected: dict[int, list[list[float]]], *,
                  planned: bool = False) -> None:
    """Time one pass of steps in buffers of ``nbytes`` (:func:`~.calibrate_steps.step_samples`).

    The ordinary path's first steps run inside a call (:class:`~.calibrate_steps.InCall`).
    """
    sizes, per_pass = _message_sizes(nbytes, t.size), lambda b: _per_pass(_repeats(b))
    if planned:
        step_samples(t, _buffers, nbytes, sizes, per_pass, _clock, collected, planned=True)
        return
    with InCall(t) as call:
        step_samples(t, _buffers, nbytes, sizes, per_pass, _clock, collected, call=call)


def _most_rounds(p: int, nbytes: int) -> int:
    """Return the most rounds any all-reduce calibration can measure takes here."""
    return max([1] + [registry.get(name).costs["allreduce"](p, nbytes // 4, 4).rounds
                      for name in calibration_choices()])


def _step_rows(t, nbytes: int, collected: dict[int, list[list[float]]]
               ) -> tuple[list, list, list]:
    """Return the ``steps``, ``waits`` and ``stretch`` rows of :class:`Calibration` (collective).

    Steps: the largest over ranks of each rank's median, per column. Waits:
    :func:`~refcoll.model.calibrate_sched.wait_summary` of the
    ``first`` and the ``later`` steps of every rank. Stretch:
    :func:`~refcoll.model.calibrate_sched.stretch` of the ``later``
    steps for 1 up to :func:`_most_rounds` rounds.
    """
    rows, waits, stretches = [], [], []
    for b in sorted(collected):
        first, later, _, _ = collected[b]
        rows.append((nbytes, b, *(_largest_median(t, column) for column in collected[b])))
        everyone = _everyone(t, later)
        waits.append((nbytes, b, *wait_summary(_everyone(t, first)), *wait_summary(everyone)))
        stretches.append((nbytes, b, tuple(stretch(everyone, r) for r in
                                           range(1, _most_rounds(t.size, nbytes) + 1))))
    return rows, waits, stretches


def _runnable(t, counts: list[int]) -> float | None:
    """Return rank 0's median count of runnable tasks, on every rank (None: unknown)."""
    mine = np.array([float(np.median(counts)) if t.rank == 0 and counts else -1.0])
    value = float(allreduce(mine, t, op="max", algorithm="recursive_doubling", validate=False)[0])
    return value if value >= 0 else None


def calibrate(t, sizes: Sequence[int] = (1 << 16, 1 << 20, 1 << 24), *,
              after_size: Callable[[int], None] | None = None) -> Calibration:
    """Measure this machine's step tables for ``sizes``, then α, β and γ (collective).

    First a repeated all-reduce call's own work on either path
    (:func:`~refcoll.model.calibrate_steps.call_overheads`); then, for
    each all-reduce size in ``sizes`` from the smallest up, :data:`PASSES`
    passes of a ring step and a reduction at each message size
    :func:`_message_sizes` gives, inside buffers of that size (see
    :class:`~refcoll.core.calibration.Calibration`), the first steps inside
    a call (and again as a plan replays them where
    :func:`~refcoll.model.calibrate_steps.planned_path` says a blocking call
    runs from one: nowhere now), each followed by ``after_size(nbytes)``
    if given (what :func:`compare_with_measurement` measures there, interleaved
    with the steps); last the ping-pong between ranks 0 and 1 and local
    reductions at 8 B and every power of two from 1 KiB to ``max(sizes)``, for
    the α-β-γ fit, and each algorithm's own work at each size
    (:func:`~refcoll.model.calibrate_steps.own_work`). Small sizes come first
    because transfers of tens of MiB leave this kind of machine slower at small
    and medium sizes for a while. Everything
    goes through ``Transport`` calls, as the algorithms make them; every rank
    returns the same numbers. ``load``: rank 0's median count of runnable
    tasks (:func:`~refcoll.calls.calibration.runnable_tasks`) after each pass,
    per core.
    """
    if t.size < 2:
        raise UsageError("calibration needs at least 2 ranks to measure messages")
    if not sizes or min(sizes) < 4:
        raise UsageError("calibration sizes must be at least 4 bytes (one float32)")
    measured = _pingpong_sizes(max(sizes))
    _buffers(t, measured[-1])  # once, at the largest size
    call, planned_call = call_overheads(t, _timed, _repeats(0), _largest_median)
    steps, planned, waits, stretches, counts = [], [], [], [], []
    for nbytes in sorted(set(sizes)):
        collected: dict[int, list[list[float]]] = {}
        replayed: dict[int, list[list[float]]] = {}
        for _ in range(PASSES):
            _step_samples(t, nbytes, collected)
            if planned_path(t, nbytes):
                _step_samples(t, nbytes, replayed, planned=True)
            count = runnable_tasks() if t.rank == 0 else None  # between passes: never timed
            if count is not None:
                counts.append(count)
            if after_size is not None:
                after_size(nbytes)
        rows, row_waits, row_stretch = _step_rows(t, nbytes, collected)
        steps += rows
        planned += [(nbytes, b, *(_largest_median(t, column) for column in replayed[b]))
                    for b in sorted(replayed)]
        waits += row_waits
        stretches += row_stretch
    runnable = _runnable(t, counts)
    own = own_work(t, calibration_choices(), sorted(set(sizes)), _buffers, _repeats, _clock)
    pingpong = _pingpong(t, measured)
    add = get_op("sum")
    reduction = []
    for b in measured[1:]:
        a, c, out = _buffers(t, b)
        reduction.append((b, _largest_median(
            t, _timed(t, lambda _, a=a, c=c, out=out: t.reduce_local(add, a, c, out), _repeats(b),
                      sync=False))))
    alpha, beta = _fit_line(pingpong)
    _, gamma = _fit_line(reduction)
    levels = inter_link(t, pingpong, _pingpong)
    # The fit's γ is per byte of one float32 operand; the record's is per element.
    return Calibration(alpha=alpha, beta=beta, gamma=gamma * GAMMA_ITEMSIZE, source="measured",
                       ranks=t.size, call=call, planned_call=planned_call,
                       planned_steps=tuple(planned), own=tuple(own), pingpong=tuple(pingpong),
                       reduction=tuple(reduction), steps=tuple(steps), waits=tuple(waits),
                       stretch=tuple(stretches),
                       load=None if runnable is None else runnable / (os.cpu_count() or 1),
                       **levels)


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
            *, fit: bool = False, waits: bool = True, options: dict | None = None) -> float:
    """Return the predicted time of an all-reduce of ``nbytes``.

    Across nodes (a two-level calibration): the call, and the algorithm's
    phases (its record's ``price``, with ``options`` such as hierarchical's
    ``inter``) each at the α, β and γ of its link (:func:`~.calibrate_nodes.across_nodes`).
    On one machine, as follows.

    With ``fit`` (or for a size the calibration has no steps for): the textbook
    ``rounds·α + critical_bytes·β + reduced·s·γ`` of :mod:`refcoll.core.cost` at the
    fitted α, β, γ. Otherwise the measured-step model: ``call + F(b) +
    (rounds-1)·L(b) + RF(b) + (k-1)·RL(b) + wait``, ``b = critical_bytes/rounds`` the
    algorithm's mean message, ``k = reduced·s/b`` its reductions, ``F``, ``L``,
    ``RF`` and ``RL`` the calibration's first and later ring steps and the
    reductions after each, inside buffers of ``nbytes`` (log-log interpolated
    between its message sizes): a timed call starts from synchronised ranks
    and sends its input in its first round, later rounds send what the one
    before reduced. ``wait`` is :func:`scheduling_wait` (0 with ``waits=False``).
    Exact in form for ring and recursive doubling, whose messages are all
    alike; Rabenseifner's halve, and ``b`` is their mean. ``call`` and the
    step tables are those of the path the repeated call takes
    (:mod:`~refcoll.model.calibrate_steps`): where an older record has
    planned steps, for a ``replayable`` algorithm, the plan's replay
    (``planned_call``, ``planned_steps``); otherwise the ordinary call, whose
    ``call`` adds the algorithm's own work (``own``).
    """
    if calibration.two_level:
        return across_nodes(calibration, algorithm, nbytes, itemsize, options or {})
    c = registry.get(algorithm).costs["allreduce"](p, nbytes // itemsize, itemsize)
    steps = [row[1:] for row in calibration.steps if row[0] == nbytes]
    if fit or not steps:
        return c.time(calibration.alpha, calibration.beta, calibration.gamma_per_byte * itemsize)
    call = calibration.call
    replayed = [row[1:] for row in calibration.planned_steps if row[0] == nbytes]
    if replayed and registry.get(algorithm).replayable is True:  # it runs from its plan
        steps, call = replayed, calibration.planned_call
    else:  # the ordinary way: the algorithm's own Python runs too
        call += sum(s for name, n, s in calibration.own if name == algorithm and n == nbytes)
    if c.rounds == 0:
        return call
    message = c.critical_bytes / c.rounds
    reductions = c.reduced * itemsize / message if message else 0.0

    def at(column: int) -> float:
        return _interpolate([(row[0], row[column]) for row in steps], message)

    wait = scheduling_wait(calibration, algorithm, p, nbytes, itemsize) if waits else 0.0
    return (call + at(1) + (c.rounds - 1) * at(2) + min(reductions, 1.0) * at(3)
            + max(reductions - 1.0, 0.0) * at(4) + wait)


def scheduling_wait(calibration: Calibration, algorithm: str, p: int, nbytes: int,
                    itemsize: int = 4) -> float:
    """Return the median time an all-reduce's rounds wait for descheduled peers.

    The calibration's measured stretch of ``R`` consecutive rounds at its mean
    message inside buffers of ``nbytes`` (linear in ``log`` message between
    rows) where it has one for ``R``. Otherwise
    :func:`~refcoll.model.calibrate_sched.wait_median` of its ``R``
    rounds at the measured ``q`` and ``W``: the first round's, then ``R - 1``
    later ones', pooled (``q = (q_F + (R-1)·q_L)/R``, ``W`` the mean of the
    waits weighted by how often each kind waits). 0 for a calibration with
    neither.
    """
    c = registry.get(algorithm).costs["allreduce"](p, nbytes // itemsize, itemsize)
    if c.rounds == 0:
        return 0.0
    message = c.critical_bytes / c.rounds
    runs = [(b, values[c.rounds - 1], 0.0) for n, b, values in calibration.stretch
            if n == nbytes and len(values) >= c.rounds]
    if runs:
        return waits_at(sorted(runs), message)[0]
    rows = [row[1:] for row in calibration.waits if row[0] == nbytes]
    if not rows:
        return 0.0
    q_first, w_first = waits_at([(b, qf, wf) for b, qf, wf, _, _ in rows], message)
    q_later, w_later = waits_at([(b, ql, wl) for b, _, _, ql, wl in rows], message)
    later = c.rounds - 1
    waited = q_first + later * q_later  # expected rounds that wait, of R
    if waited <= 0:
        return 0.0
    mean_wait = (q_first * w_first + later * q_later * w_later) / waited
    return wait_median(c.rounds, waited / c.rounds, mean_wait)


def _allreduce_times(t, algorithm: str, nbytes: int, repeats: int,
                     warmups: int | None = None, sync: bool = True) -> list[float]:
    """Return this rank's times of ``repeats`` all-reduces of float32 ``nbytes``, seconds.

    ``sync``: a barrier before each call; without it, one before the first.
    """
    x, out, _ = _buffers(t, nbytes)
    if not sync:
        barrier(t)
    return _timed(t, lambda _: allreduce(x, t, algorithm=algorithm, validate=False, out=out),
                  repeats, warmups=warmups, sync=sync)


def measure_allreduce(t, algorithm: str, nbytes: int, *, repeats: int | None = None) -> float:
    """Return the median time (largest over ranks) of ``refcoll.allreduce`` of float32 ``nbytes``.

    Out of place into a preallocated ``out=``, argument agreement off: the
    algorithm alone, as ``refcoll bench`` times it.
    """
    return _largest_median(t, _allreduce_times(t, algorithm, nbytes, repeats or _repeats(nbytes)))


def compare_with_measurement(t, algorithms: Sequence[str], sizes: Sequence[int], *,
                             back_to_back: bool = False) -> Comparison:
    """Calibrate, measure each algorithm at each size on ``t``, and predict (collective).

    Each size's all-reduces are measured in :data:`PASSES` passes interleaved
    with its step tables (see :func:`calibrate`), the algorithms in a rotated
    order each pass, and reported by the largest over ranks of each rank's
    median over every pass; the predictions use the calibration alone. Each call
    is timed after a barrier, or with ``back_to_back`` after the one before it, as
    a training loop runs them (``refcoll bench -m``): across a shaped link, a call
    after a barrier finds the token bucket refilled and passes a burst at memory
    speed, which a cross-node β, taken from a slope, leaves out. The CPU
    time the machine spent beyond this job's own ranks is reported with them.
    """
    times: dict[tuple[str, int], list[float]] = {}
    ran: dict[tuple[str, int], str] = {}
    passes: dict[int, int] = {}

    def measure_pass(nbytes: int) -> None:
        start = passes[nbytes] = passes.get(nbytes, -1) + 1
        repeats, warmups = _per_pass(_repeats(nbytes))
        for i in range(len(algorithms)):
            algorithm = algorithms[(start + i) % len(algorithms)]
            chooses = registry.get(algorithm).chooses  # auto: what it resolves to here
            ran[algorithm, nbytes] = (resolve_with_options(t, "allreduce", nbytes // 4, 4)
                                      if chooses else (algorithm, {}))
            times.setdefault((algorithm, nbytes), []).extend(
                _allreduce_times(t, algorithm, nbytes, repeats, warmups, not back_to_back))

    busy, own, wall = machine_busy(), time.process_time(), time.perf_counter()
    calibration = calibrate(t, sizes, after_size=measure_pass)
    own = allreduce(np.array([time.process_time() - own]), t, algorithm="recursive_doubling",
                    validate=False)[0]
    others = None
    if busy is not None:
        wall = time.perf_counter() - wall
        others = max(machine_busy() - busy - own, 0.0) / (wall * (os.cpu_count() or 1))
    rows = []
    for algorithm in algorithms:
        for nbytes in sizes:
            (name, chosen), seconds = ran[algorithm, nbytes], _largest_median(
                t, times[algorithm, nbytes])
            predicted = predict(calibration, name, t.size, nbytes, options=chosen)
            shown = name + ("(" + ",".join(f"{k}={v}" for k, v in chosen.items()) + ")"
                            if chosen else "")
            rows.append({"algorithm": algorithm if shown == algorithm else f"{algorithm} ({shown})",
                         "bytes": nbytes, "predicted": predicted,
                         "wait": scheduling_wait(calibration, name, t.size, nbytes),
                         "predicted_without_wait": predict(calibration, name, t.size, nbytes,
                                                           waits=False, options=chosen),
                         "predicted_fit": predict(calibration, name, t.size, nbytes, fit=True,
                                                  options=chosen),
                         "measured": seconds,
                         "ratio": predicted / seconds if seconds else math.inf})
    return Comparison(calibration, rows, others, os.cpu_count() or 0, back_to_back)
