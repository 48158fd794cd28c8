"""Prepared all-reduces: a repeated call skips its checks, and a small one replays a recording.

The first all-reduce of an (algorithm, op, dtype, count) on a transport runs the
ordinary way and keeps what it checked and resolved (``auto``'s choice
included); later calls skip those steps. Small ones on MPI go further, as MPI-4's
persistent collectives (``MPI_Allreduce_init``) do: the algorithm's schedule is
recorded once on buffers of the plan's own (:mod:`refcoll.transport.recorder`),
and a call copies the input in, replays the schedule over persistent requests
and copies the result out. Below :data:`PLAN_BYTES` a call costs its messages
and Python steps, not its bytes, and the replay drops most of the steps. The
results are the same bits: the same exchanges and reductions, in the same order,
on the same values. Only algorithms whose record says ``replayable`` are replayed.
"""

from __future__ import annotations

import numpy as np

from .. import algorithms
from ..transport.base import transport_cache
from ..transport.recorder import record
from .auto import resolve

__all__ = ["PLAN_BYTES", "PREPARED_KEPT", "Prepared", "Plan", "prepared_call", "prepare"]


#: Largest all-reduce, in bytes, that runs from a recorded plan. Up to here the
#: two copies a plan adds (input in, result out) cost less than the Python steps
#: it saves; above it an out-of-place call should not copy its input at all.
PLAN_BYTES = 64 << 10

#: Prepared all-reduces kept per transport; past this the oldest is dropped (on
#: every rank alike, as every rank makes the same calls).
PREPARED_KEPT = 128

class Prepared:
    """An all-reduce already run once on a transport with this (algorithm, op, dtype, count).

    It keeps what the first call checked and resolved (the op, the
    implementation, ``auto``'s choice), so later calls skip those steps; below
    :data:`PLAN_BYTES`, on a transport with persistent exchanges, it also holds
    the recorded :class:`Plan`. Every rank makes the same calls, so every rank
    prepares the same calls and switches to a plan at the same call (a plan's
    messages use tags ordinary calls do not).
    """

    def __init__(self, t, key: tuple, reduction):
        algorithm, _, dtype, count = key
        chooses = algorithms.get(algorithm).chooses  # auto: run the algorithm it picks for this size
        name = resolve(t, "allreduce", count, dtype.itemsize) if chooses else algorithm
        self.fn = algorithms.implementation(name, "allreduce")
        self.reduction = reduction
        self.plan = None
        if (count * dtype.itemsize <= PLAN_BYTES and algorithms.get(name).replayable
                and hasattr(t, "persistent")):
            self.plan = Plan(t, self.fn, reduction, dtype, count)

    def run(self, t, x: np.ndarray, out: np.ndarray) -> None:
        """Reduce the flat ``x`` into the flat ``out``, inside the caller's ``t.call``."""
        if self.plan is None:
            self.fn(t, x, out, op=self.reduction)
            return
        try:
            self.plan.run(x, out)
        except BaseException:
            self.plan = None  # its requests may still be running: never restart them
            raise

    def free(self) -> None:
        """Free the plan's persistent requests, if any."""
        if self.plan is not None:
            self.plan.free()


def prepared_call(t, key: tuple) -> Prepared | None:
    """Return the all-reduce prepared on ``t`` for ``key``; None the first time."""
    try:
        return transport_cache(t, "prepared").get(key)
    except TypeError:  # an unhashable op or algorithm: the ordinary checks name it
        return None


def prepare(t, key: tuple, reduction) -> None:
    """Keep ``key``'s all-reduce prepared on ``t`` after a call that ran the ordinary way."""
    try:
        hash(key)
    except TypeError:  # an op object that cannot key a cache (mpi4py's MPI.SUM): never prepared
        return
    prepared = transport_cache(t, "prepared")
    if len(prepared) >= PREPARED_KEPT:
        prepared.pop(next(iter(prepared))).free()
    prepared[key] = Prepared(t, key, reduction)


class Plan:
    """A small all-reduce recorded once: its own buffers and the schedule that runs on them.

    A run copies the input in, replays the recorded exchanges (persistent
    requests) and reductions in their order (:mod:`refcoll.transport.recorder`),
    and copies the result out.
    """

    def __init__(self, t, fn, reduction, dtype, count: int):
        self.x = np.empty(count, dtype)
        self.out = np.empty(count, dtype)
        self.schedule = record(t, fn, self.x, self.out, op=reduction)

    def run(self, x: np.ndarray, out: np.ndarray) -> None:
        """Reduce the flat ``x`` into the flat ``out`` (which may be ``x``)."""
        np.copyto(self.x, x)
        self.schedule()
        np.copyto(out, self.out)

    def free(self) -> None:
        """Free the persistent requests."""
        self.schedule.free()
