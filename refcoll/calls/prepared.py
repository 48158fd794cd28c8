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

A validated call carries its argument agreement beside its first exchange
(:func:`signed_replay`, :class:`refcoll.calls.agree.Signatures`): no round trip
of its own. A loop that passes the very same ``x`` and ``out=`` again reaches a
:class:`Bound` plan, recorded on those buffers, with one dictionary lookup: no
argument handling and no copies.
"""

from __future__ import annotations

import numpy as np

from .. import algorithms
from ..core.ops import get_op
from ..transport.base import TAGS_PER_CALL, transport_cache
from ..transport.recorder import compile_steps, record, run_steps
from .agree import disagreement, record_of, signature_of, signatures
from .auto import resolve

__all__ = ["PLAN_BYTES", "PREPARED_KEPT", "Prepared", "Plan", "Bound", "prepared_call",
           "prepare", "bound_call", "bind", "op_key"]


#: Largest all-reduce, in bytes, that runs from a recorded plan. Up to here the
#: two copies a plan adds (input in, result out) cost less than the Python steps
#: it saves; above it an out-of-place call should not copy its input at all.
PLAN_BYTES = 64 << 10

#: Prepared and bound all-reduces kept per transport. A quarter of the room is
#: for :class:`Bound` calls, the rest for :class:`Prepared` ones; past its share
#: the oldest of a kind is dropped. The shares are apart because ranks need not
#: bind alike (one passes the same ``out=`` again, another a new one) but must
#: prepare alike: a rank that dropped a prepared call its peers still replay
#: would run it the ordinary way while they wait for its replay.
PREPARED_KEPT = 128


def _kept(bound: bool) -> int:
    """Return how many entries of a kind a transport keeps (read late: a test may lower it)."""
    share = max(1, PREPARED_KEPT // 4)
    return share if bound else max(1, PREPARED_KEPT - share)


def _make_room(cache: dict, bound: bool) -> None:
    """Drop the oldest entries of a kind until there is room for one more of it."""
    keys = [k for k in cache if (k[0] == "bound") == bound]
    for k in keys[:max(0, len(keys) - _kept(bound) + 1)]:
        cache.pop(k).free()


def op_key(op):
    """Return the op as a prepared call is keyed: its name for every spelling of it.

    ``"sum"``, ``"SUM"``, refcoll's op object and mpi4py's ``MPI.SUM`` are one op, and
    the argument agreement sees them as one, so they must key one prepared call: a
    rank that spells it differently from its peers still replays when they do. An
    op that is not one refcoll reduces with is returned as is (the checks name it).
    """
    if op.__class__ is str:
        return op if op.islower() else op.lower()
    try:
        return get_op(op).name
    except Exception:  # noqa: BLE001 - the ordinary checks raise the right error for it
        return op

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
        self.signature = None  # the validated call's, made by its first signed run
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

    def signed(self) -> bool:
        """Return whether a validated call can carry its agreement beside its data (:meth:`run_signed`)."""
        return self.plan is not None and self.plan.signatures is not None

    def run_signed(self, t, x: np.ndarray, out: np.ndarray, fields: dict) -> bool:
        """Run a validated call from the plan, its signature beside its first exchange.

        The plan's first exchange starts, then the signature exchange runs
        (:class:`~refcoll.calls.agree.Signatures`); only when every rank's
        signature equals this one does the data exchange complete and the
        reductions run. Returns False, having withdrawn the data exchange,
        when the signatures differ: the caller names the difference
        (:func:`~refcoll.calls.agree.disagreement`).
        """
        plan = self.plan
        if self.signature is None:
            self.signature = signature_of(record_of(fields))
        np.copyto(plan.x, x)
        try:
            if not signed_replay(plan.schedule.steps, plan.signatures, self.signature):
                self.plan = None
                plan.free()  # its first exchange was withdrawn, the others never started
                return False
        except BaseException:
            self.plan = None  # never restart requests a failed call may have left running
            raise
        np.copyto(out, plan.out)
        return True

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
    if len(prepared) >= _kept(False):
        _make_room(prepared, False)
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
        self.fn, self.reduction = fn, reduction
        self.renew(t)

    def renew(self, t) -> None:
        """Record the schedule (again) on the plan's buffers, in ``t``'s current tag slot.

        After a failed agreement every rank moves its persistent exchanges to a
        new slot (:func:`~refcoll.calls.agree.disagreed`); a plan that calls
        already queued hold is recorded again there instead of being dropped.
        """
        self.schedule = record(t, self.fn, self.x, self.out, op=self.reduction)
        self.signatures = signatures(t)  # the argument agreement that runs beside it

    def run(self, x: np.ndarray, out: np.ndarray) -> None:
        """Reduce the flat ``x`` into the flat ``out`` (which may be ``x``)."""
        np.copyto(self.x, x)
        self.schedule()
        np.copyto(out, self.out)

    def free(self) -> None:
        """Free the persistent requests."""
        self.schedule.free()


def signed_replay(steps, exchange, signature: bytes, rest=None) -> bool:
    """Replay ``steps`` with the signature exchange run beside the first of them.

    The first exchange starts, then every rank's signature is gathered; the
    data exchange completes and the reductions run only when every signature
    equals ``signature``. Otherwise the data exchange is withdrawn and False
    returned (the caller names the difference). On an error the started
    exchange is withdrawn too. ``rest(start)``, if given, runs the steps from
    ``start`` on instead (a :class:`Bound` plan's flat program).
    """
    first = steps[0] if steps and hasattr(steps[0], "start") else None
    if first is not None:
        first.start()
    try:
        agreed = exchange.agreed(signature)
    except BaseException:
        if first is not None:
            first.cancel()
        raise
    if not agreed:
        if first is not None:
            first.cancel()
        return False
    if first is not None:
        first.finish()
    start = 1 if first is not None else 0
    if rest is None:
        for step in steps[start:]:
            step()
    else:
        rest(start)
    return True


class Bound:
    """A prepared all-reduce recorded on the caller's own ``x`` and ``out``: no copies at all.

    A loop that all-reduces the same small arrays into the same ``out`` (a
    benchmark, a training step's fixed buckets) reaches it with one dictionary
    lookup (:func:`bound_call`) and replays the schedule on its buffers, which
    the persistent requests were bound to. It holds the arrays (and the
    communicator), so their identities, which key it, cannot be reused while it
    lives. A call advances the transport's call count as an ordinary call does,
    so ranks on different paths stay in step.
    """

    def __init__(self, t, comm, x, out, prepared: Prepared, key: tuple, fields: dict | None):
        self.t, self.comm, self.x, self.out, self.key = t, comm, x, out, key
        self.dtype = x.dtype
        self.reduction = prepared.reduction
        self.schedule = record(t, prepared.fn, x.reshape(-1), out.reshape(-1),
                               op=prepared.reduction)
        self.steps = self.schedule.steps
        self.program = compile_steps(self.steps)
        self.fields = fields
        self.exchange = signatures(t) if fields is not None else None
        self.signature = None if fields is None else signature_of(record_of(fields))
        self.divides = prepared.reduction.divides

    def __call__(self) -> np.ndarray:
        """Run the all-reduce in a call of its own; return ``out``."""
        t = self.t
        if t._depth:  # inside another call's scope (not from the public calls)
            with t.call("allreduce"):
                return self._run(t)
        # The call's own tag slot and count, as TransportBase.call's scope sets them: the
        # ranks' call counts stay in step whichever path each takes.
        t._tag_base = (t._calls % t._tag_slots) * TAGS_PER_CALL
        t._calls += 1
        t._ops = 0
        t._depth = 1
        t.current_call = "allreduce"
        try:
            return self._run(t)
        finally:
            t._depth = 0
            t.current_call = None

    def _run(self, t) -> np.ndarray:
        try:
            if self.exchange is None:
                run_steps(t, self.program)
            elif not signed_replay(self.steps, self.exchange, self.signature,
                                   lambda start: run_steps(t, self.program, start)):
                self.free()
                disagreement(t, self.fields)
        except BaseException:
            self.free()  # never restart requests a failed call may have left running
            raise
        if self.divides:
            self.reduction.finalize(self.out, t.size)
        return self.out

    def free(self) -> None:
        """Free the persistent requests and forget the buffers."""
        if _BOUND.get(self.key) is self:
            del _BOUND[self.key]
        if self.schedule is not None:
            self.schedule.free()
            self.schedule = None
            self.steps = []
            self.program = []


#: Bound all-reduces by (id(comm), id(x), id(out), algorithm, op, validate).
_BOUND: dict = {}


def bound_call(comm, x, out, algorithm, op, validate) -> Bound | None:
    """Return the all-reduce bound to exactly these arguments, if one is (a dictionary lookup)."""
    try:
        bound = _BOUND.get((id(comm), id(x), id(out), algorithm, op, validate))
    except TypeError:  # an unhashable op
        return None
    if bound is None or x.dtype is not bound.dtype or out.dtype is not bound.dtype:
        return None  # a dtype set since (x.dtype = ...): the ordinary way checks it again
    if not out.flags.writeable:
        return None
    return bound


def bind(t, comm, x, out, algorithm, op, validate: bool, fields: dict | None) -> None:
    """Bind the all-reduce just run with these arguments to its buffers, if it qualifies.

    It qualifies when it ran from a plan (small, replayable, on MPI) with a
    given ``out=`` that is ``x`` (or its very memory) or shares no memory with
    it, both plain C-contiguous NumPy arrays (the call's checks ran before). Kept
    among the transport's prepared calls, in a share of their room of its own
    (:data:`PREPARED_KEPT`), so it is dropped and freed with them but never
    pushes a prepared call out.
    """
    key = (id(comm), id(x), id(out), algorithm, op, validate)
    try:
        hash(key)
    except TypeError:  # an op that cannot key a dictionary (mpi4py's MPI.SUM): never bound
        return
    prepared = prepared_call(t, (algorithm, op_key(op), x.dtype, x.size))
    if (prepared is None or prepared.plan is None or key in _BOUND or type(x) is not np.ndarray
            or type(out) is not np.ndarray or not x.flags.c_contiguous
            or not out.flags.c_contiguous or not out.flags.writeable):
        return
    cache = transport_cache(t, "prepared")
    if len(cache) >= _kept(True):
        _make_room(cache, True)
    bound = Bound(t, comm, x, out, prepared, key, fields if validate and t.size > 1 else None)
    cache[("bound", *key)] = _BOUND[key] = bound

