"""The steps and call overheads calibration measures, on the paths an all-reduce can take.

A blocking all-reduce keeps nothing between calls (:mod:`refcoll.calls.collectives`):
it runs the ordinary way, its checks, then the algorithm's ``sendrecv`` and
``reduce_local`` calls. :func:`step_samples` times ring steps that way (and, with
``planned``, as a plan the caller holds replays them: recorded persistent
exchanges and bound reductions), and :func:`call_overheads` times the public call
on every rank with an algorithm that moves nothing.
"""

from __future__ import annotations

import functools
from typing import Callable

import numpy as np

from .. import algorithms
from ..calls.agree import barrier
from ..calls.args import checked
from ..calls.collectives import allreduce, run
from ..core.ops import get_op
from ..transport.recorder import compile_steps, record, run_steps

__all__ = ["planned_path", "InCall", "step_samples", "call_overheads", "own_work"]


def planned_path(t, nbytes: int) -> bool:
    """Return whether a repeated blocking all-reduce of ``nbytes`` on ``t`` runs from a plan: never.

    A blocking call keeps no plan between calls; only a plan the caller holds
    replays (:func:`refcoll.allreduce_init`).
    """
    return False


class InCall:
    """Run code inside a repeated ordinary all-reduce call on ``t`` (collective).

    Calling the object with ``body`` runs the public path of ``refcoll.allreduce``
    (out of place, argument agreement off) with ``body`` where the algorithm
    would run (:func:`refcoll.calls.collectives.run` with it as the
    implementation). A round timed there waits, as a real call's first round
    does, for the peer that finished the call's own work later, and runs in the
    caches the call's own work left.
    """

    def __init__(self, t):
        count = (64 << 10) // 4 + 3  # a count no measured call uses
        self.t = t
        self.x, self.out = np.ones(count, np.float32), np.empty(count, np.float32)

    def __enter__(self) -> "InCall":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def __call__(self, body: Callable[[], None] | None = None) -> None:
        call = checked(self.t, self.t, "allreduce", self.x, op="sum", root=None,
                       algorithm="ring", out=self.out, validate=False, options={})
        run(call, implementation=lambda *args, **kwargs: body and body())


def call_overheads(t, timed: Callable, repeats: int, largest: Callable) -> tuple[float, float]:
    """Return ``(ordinary, planned)``: seconds of a repeated all-reduce call beyond its algorithm.

    Every rank calls ``refcoll.allreduce`` on ``t`` after a barrier, out of
    place into the same ``out=``, argument agreement off, as
    :func:`~refcoll.model.calibrate.measure_allreduce` does, with an
    algorithm that moves nothing (:class:`InCall`): the ordinary path's checks
    and scope. ``planned`` is 0: a blocking call replays no plan
    (:func:`planned_path`). ``timed`` and ``largest`` are calibration's timer
    and its largest-over-ranks median.
    """
    with InCall(t) as call:
        return largest(t, timed(t, lambda _: call(), repeats)), 0.0


def step_samples(t, buffers, nbytes: int, sizes, per_pass, clock,
                 collected: dict[int, list[list[float]]], *, planned: bool = False,
                 call: "InCall | None" = None) -> None:
    """Time one pass of ring steps and their reductions per message size, in buffers of ``nbytes``.

    The steps do to memory what the rounds of an out-of-place ring,
    recursive-doubling or Rabenseifner all-reduce do, slice by slice through
    an input and an output buffer of ``nbytes``: the peer's partial is received
    straight into the output slice and reduced there with the input slice.
    ``first``: right after a barrier, sending a slice of the input, as a call's
    first round does. ``later``: back to back, sending the slice the previous
    step has just reduced, as later rounds do; that data is still in the
    sender's cache, and a peer on a core of another cache domain pays for
    fetching it, as the sender then pays for writing lines the peer has read.
    With ``planned`` each step runs as a plan's does: a recorded persistent
    exchange and the op's ufunc bound to its buffers
    (:func:`~refcoll.transport.recorder.compile_steps`); otherwise through
    ``t.sendrecv`` and ``t.reduce_local``, as the algorithms call them. With
    ``call`` (an entered :class:`InCall`) each ``first`` step runs inside a
    call, where an all-reduce's first round runs.

    ``buffers(t, nbytes)`` gives the three buffers, ``sizes`` the message
    sizes, ``per_pass(b)`` a pass's ``(timed, untimed)`` steps at message ``b``.
    Appends this rank's times, seconds, to ``collected[message]`` = ``[first,
    later, reduction after first, reduction after later]``.
    """
    add = get_op("sum")
    left, right = (t.rank - 1) % t.size, (t.rank + 1) % t.size
    count = nbytes // 4
    x, out, spare = buffers(t, nbytes)
    schedules = []
    for b in sizes:
        elements = b // 4
        slots = max(count // elements, 1)
        repeats, warmups = per_pass(b)
        kept = collected.setdefault(b, [[], [], [], []])
        programs: dict[tuple[int, int], tuple] = {}

        # The closures below run within this iteration; the defaults bind its values.
        def piece(buf: np.ndarray, i: int, slots=slots, elements=elements) -> np.ndarray:
            return buf[(i % slots) * elements:(i % slots + 1) * elements]

        def step(kind: int, i: int, slots=slots, programs=programs,
                 piece=piece) -> tuple[Callable[[], None], Callable[[], None]]:
            if kind == 0:
                sending, landing = piece(x, i), piece(out, i)
            else:  # what the previous step reduced; never the slice it receives into
                sending = piece(out, i - 1)
                landing = piece(spare if slots == 1 else out, i)
            own, dst = piece(x, i), piece(out, i)
            if not planned:
                return (lambda: t.sendrecv(sending, right, landing, left),
                        lambda: t.reduce_local(add, landing, own, dst))
            if (kind, i % slots) not in programs:  # every rank records in the same order

                def one(rec) -> None:
                    rec.sendrecv(sending, right, landing, left)
                    rec.reduce_local(add, landing, own, dst)

                schedule = record(t, one)
                schedules.append(schedule)
                exchange, reduction = compile_steps(schedule.steps)
                programs[kind, i % slots] = (functools.partial(_exchange, t, exchange),
                                             reduction)
            return programs[kind, i % slots]

        for kind, (steps, reductions) in enumerate((kept[0::2], kept[1::2])):
            done = len(steps)  # each pass goes on through the buffers where the last stopped
            for i in range(done, done + warmups + repeats):
                exchange, reduce = step(kind, i)
                marks: list[float] = []

                def timed_step(marks=marks, exchange=exchange, reduce=reduce) -> None:
                    marks.append(clock())
                    exchange()
                    marks.append(clock())
                    reduce()
                    marks.append(clock())

                if kind == 0 or i == done + warmups:
                    barrier(t)
                if kind == 0 and call is not None:
                    call(timed_step)  # a first round, where a real call runs it
                else:
                    timed_step()
                if i >= done + warmups:
                    steps.append(marks[1] - marks[0])
                    reductions.append(marks[2] - marks[1])
    for schedule in schedules:
        schedule.free()


class _Dry:
    """``t`` with its exchanges and reductions doing nothing: an algorithm's own Python alone.

    Everything else (rank, size, the per-transport caches an algorithm keeps its
    workspaces in) is ``t``'s.
    """

    def __init__(self, t):
        self._t = t

    def __getattr__(self, name: str):
        return getattr(self._t, name)

    def send(self, buf, dest: int, tag: int = 0) -> None:
        """Send nothing."""

    def recv(self, buf, source: int, tag: int = 0) -> None:
        """Receive nothing."""

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0) -> None:
        """Exchange nothing."""

    def reduce_local(self, op, a, b, out) -> None:
        """Reduce nothing."""


def own_work(t, names, sizes, buffers, repeats, clock) -> list[tuple[str, int, float]]:
    """Return ``(algorithm, bytes, seconds)``: each algorithm's own work in an all-reduce.

    Collective.

    The median time of the algorithm's implementation run on ``t`` with its
    exchanges and reductions doing nothing (:class:`_Dry`): the chunk
    arithmetic, views, workspace lookups and loop of its rounds, which the step
    tables (bare exchanges and reductions) leave out. An algorithm that cannot
    run so (one that reads what it received, or needs more than point-to-point
    exchanges) gets no row on any rank, and is predicted without the term.
    """
    dry, add = _Dry(t), get_op("sum")
    rows, times = [], []
    for name in names:
        fn = algorithms.implementation(name, "allreduce")
        for nbytes in sizes:
            x, out, _ = buffers(t, nbytes)
            samples = []
            try:
                for i in range(repeats(nbytes) + 3):
                    start = clock()
                    fn(dry, x, out, op=add)
                    if i >= 3:
                        samples.append(clock() - start)
            except Exception:  # noqa: BLE001 - not an algorithm a dry run can time
                samples = []
            rows.append((name, nbytes))
            times.append(float(np.median(samples)) if samples else -1.0)
    mine = np.array(times or [0.0])
    worst = allreduce(mine, t, op="max", algorithm="recursive_doubling", validate=False)
    failed = allreduce(-np.minimum(mine, 0.0), t, op="max", algorithm="recursive_doubling",
                       validate=False)
    return [(name, nbytes, float(w)) for (name, nbytes), w, f in zip(rows, worst, failed)
            if f == 0]


def _exchange(t, exchange: tuple) -> None:
    """Run one compiled exchange and count its traffic (a recorded run's runner counts it)."""
    run_steps(t, [exchange])
    t.traffic.add(exchange[3], exchange[1])
