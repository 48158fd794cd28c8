"""A collective agreed once, its algorithm chosen once, its schedule recorded once, run many times.

MPI-4's persistent collectives (``MPI_Allreduce_init``, ``MPI_Start``,
``MPI_Wait``) and NCCL's capture-then-replay under CUDA graphs, in Python::

    plan = refcoll.allreduce_init(grad, comm, algorithm="ring")   # every rank, together
    for step in range(steps):
        ...                                  # write this step's values into grad
        total = plan()                       # or: plan.start(); ...; total = plan.wait()
    plan.free()                              # or: with refcoll.allreduce_init(...) as plan:

Making a plan (collective) checks the arguments, agrees on them (unless
``validate=False``), chooses the algorithm (``auto`` resolves here, once) and,
where the transport has persistent exchanges (MPI) and the algorithm's record
says ``replayable``, records the all-reduce's schedule on the plan's buffers
(:mod:`refcoll.transport.recorder`): each exchange one set of persistent MPI
requests, each reduction a ufunc bound to its buffers. A run then starts those
requests and runs those reductions in order: the same bits as the algorithm,
and none of the call's Python layers. Elsewhere (the simulator,
``torch.distributed``, the other collectives, an algorithm that splits its
communicator) a run calls the algorithm again on the plan's buffers.

A run exchanges nothing but its data. What would break the plan's promise is
checked on each rank at every run, locally: a freed plan, a run already started,
a buffer whose shape or dtype changed in place, another buffer or communicator
passed in. A rank that finds
one refuses the run with a :class:`~refcoll.core.errors.UsageError` and, for a
validated plan, revokes the communicator's transport
(:meth:`~refcoll.transport.mpi.MPITransport.revoke`, the simulator's alike):
its peers, already in the run and waiting for its data, raise
:class:`~refcoll.core.errors.PeerFailure` naming it and the reason, in that
very run rather than at their deadline, and the transport refuses every later
exchange. With ``validate=False`` the rank at fault raises alone; its peers
wait for its next, corrected start, or until their deadline.

The blocking calls (:mod:`refcoll.calls.collectives`) go through
:func:`run`: agree, choose, run the algorithm. A small all-reduce whose
arguments came twice is kept as a plan on buffers of its own, so that the
third call of those arguments replays it (its input copied in, its result
copied out): the transport's kept plans (:func:`kept`, :func:`reusable`), at
most :data:`PLANS_KEPT`, looked up by the agreed fields, never by a buffer's
identity. A blocking call agrees at every call, so a kept plan's replay carries
the call's signature beside its first exchange (:meth:`Plan._signed`): no round
trip of its own, and no data reduced before every rank's signature matched.
"""

from __future__ import annotations

import collections
import functools

import numpy as np

from .. import algorithms
from ..core.errors import UsageError
from ..core.xp import array_namespace
from ..transport.base import TransportBase, transport_cache
from ..transport.recorder import compile_steps, record, run_steps
from . import debug
from .agree import agree, disagreement, record_of, signature_of, signatures
from .args import PLAN_BYTES, Call
from .auto import resolve_with_options
from .progress import Handle, Steps, any_busy, busy_engine, engine_for

__all__ = ["Plan", "run", "kept", "reusable", "live_plans", "PLAN_BYTES", "PLANS_KEPT"]

#: Kept plans per transport; past it the oldest is freed. Every rank makes the
#: same calls, so every rank keeps and drops the same plans.
PLANS_KEPT = 96


class Plan:
    """One collective call, agreed, chosen and (where it can be) recorded: run it many times.

    Made by :func:`refcoll.allreduce_init` and its kin. ``plan()`` runs it now
    and returns the result; ``plan.start()`` runs it as a non-blocking call
    (in issue order with the communicator's others) and ``wait()`` / ``test()``
    complete it; ``free()`` releases its persistent requests.

    Attributes:
        collective: the call's name (``allreduce``...).
        algorithm: the algorithm it runs (``auto`` resolved).
        x: the input it reads at every run (the caller's array).
        out: the result it writes at every run (``out=`` or its own array;
            ``None`` on a ``reduce``'s non-roots and a switch rank).
        recorded: whether a run replays a recorded schedule (else the
            algorithm runs again).
        runs: how many runs have completed; freed: whether :meth:`free` has run.
        handle: the :class:`~refcoll.calls.progress.Handle` of the run last
            started with :meth:`start` (``None`` before, and once waited for).
    """

    def __init__(self, call: Call, *, own_buffers: bool = False):
        t = self.t = call.t
        self.comm, self.collective, self.validate = call.comm, call.collective, call.validate
        self.reduction, self.root, self.options = call.reduction, call.root, call.options
        name, self.fn, options = chosen(call)
        self.algorithm = name
        self.fields = call.fields()
        if own_buffers:  # a kept plan: the caller's arrays are copied in and out
            result = None if call.result is None else array_namespace(call.flat).empty_like(
                call.result)
            call = call.on(array_namespace(call.flat).empty_like(call.flat), result)
        self.call = call
        self.x, self.out = call.x, call.output()
        self._shapes = self._layout_now()
        self.runs = 0
        self.handle = None
        self.freed = False
        self._broken = None  # why a run failed partway (abandon)
        self._schedule = self._program = None
        self._signature = None
        if t.size > 1 and own_buffers:  # a blocking call's: each call says if it agrees
            # A kept plan's signature says so: a rank that replays it meets only ranks that do.
            self._signature = signature_of(record_of(dict(self.fields, compressor="(kept plan)")))
        self.recorded = (call.collective == "allreduce" and t.size > 1 and call.result is not None
                         and hasattr(t, "persistent") and replayable(t, name, options))
        if self.recorded:
            self._record()
        live_plans(t)[id(self)] = self

    def __repr__(self) -> str:
        state = "freed" if self.freed else ("started" if self.handle else "ready")
        return (f"<refcoll.Plan {self.collective} {self.algorithm} "
                f"{'recorded' if self.recorded else 'run'} {state}>")

    # ----------------------------------------------------------- the public use

    def __call__(self, x=None, *, out=None, comm=None):
        """Run the plan now and return its result (``MPI_Start`` then ``MPI_Wait``).

        ``x``, ``out`` and ``comm`` may be passed to say which buffers and
        communicator the caller means; each must be the plan's own (the same
        memory, shape and dtype), or the run is refused.
        """
        error = self._misuse(x, out, comm)
        engine = busy_engine(self.t) if any_busy() else None
        if engine is not None:  # non-blocking calls are outstanding: run behind them
            return engine.submit(Handle(self.collective, lambda: self._run(error), engine)).wait()
        if debug.enabled():
            return debug.traced(self.t, self.collective, self._trace_fields(),
                                lambda: self._run(error))
        return self._run(error)

    def start(self, x=None, *, out=None, comm=None) -> "Plan":
        """Start a non-blocking run (``MPI_Start``); return the plan.

        :meth:`wait` or :meth:`test` completes it. The run's
        :class:`~refcoll.calls.progress.Handle` is :attr:`handle`, for
        :func:`refcoll.wait_all` and its time stamps; a run completed through it
        may be started again at once.
        """
        error = self._misuse(x, out, comm)
        engine = engine_for(self.t)
        job = (Steps(self) if engine.kind == "schedule" and self._program is not None
               and error is None else lambda: self._run(error))
        self.handle = engine.submit(Handle(self.collective, job, engine))
        return self

    def wait(self, timeout: float | None = None):
        """Complete the started run and return its result (``MPI_Wait``); raise its error."""
        handle = self.handle
        if handle is None:
            raise UsageError(f"rank {self.t.rank}: wait() on a {self.collective} plan that was "
                             "not started: call start() first")
        try:
            result = handle.wait(timeout)
        except BaseException:
            if handle._done.is_set():
                self.handle = None  # the run failed: the plan may be started again
            raise
        self.handle = None
        return result

    def test(self) -> bool:
        """Return whether the started run has completed (a plan not started: True)."""
        return self.handle is None or self.handle.test()

    def free(self) -> None:
        """Release the persistent requests and the buffers; a later run is refused.

        A started run is waited for first (MPI frees an active request once it
        completes); freeing twice is allowed.
        """
        if self.freed:
            return
        if self.handle is not None:
            try:
                self.wait()
            except Exception:  # noqa: BLE001 - freeing releases; the failure was the run's
                pass
        self.freed = True
        self._forget()
        live_plans(self.t).pop(id(self), None)
        self.x = self.out = self.call = None

    def rebind(self, x, out=None) -> None:
        """Point the plan at other buffers of the same shapes and dtypes (this rank alone).

        For a caller whose buffer moves while its call stays the same, as a DDP
        bucket's does when PyTorch reallocates it: the ranks agreed on the
        call, not on addresses, and a recording's exchanges are this rank's own
        persistent requests, so recording them again on the new buffers is
        local. ``out=None`` keeps the in-place layout when the plan had it.
        """
        if self.freed or (self.handle is not None and not self.handle._done.is_set()):
            raise UsageError(f"rank {self.t.rank}: rebind() on a {self.collective} plan that is "
                             "freed or running")
        in_place = self.out is self.x
        out = x if out is None and in_place else out
        shapes = (x.shape, x.dtype) if out is None else (x.shape, x.dtype, out.shape, out.dtype)
        if shapes != self._shapes or self.collective != "allreduce":
            raise UsageError(f"rank {self.t.rank}: rebind() takes buffers of the plan's shapes "
                             f"and dtypes ({self._shapes}), for an all-reduce")
        call = self.call
        self.call = call.on(x.reshape(-1), out.reshape(-1) if out is not None else call.result)
        self.call.x, self.call.out = x, out
        self.x, self.out = x, self.call.output()
        self.renew()

    def __enter__(self) -> "Plan":
        return self

    def __exit__(self, *exc) -> None:  # the with block frees the plan, however it ends
        self.free()

    # ------------------------------------------------------------- the running

    def _run(self, error: str | None = None):
        """Run once, in the call's own tag space; return the result."""
        t, call = self.t, self.call
        if error:
            _refuse(t, error, tell=self.validate)
        try:
            with t.call(self.collective):
                if self._program is None:
                    call.prologue()
                    self.fn(t, *call.arguments(), **call.keywords())
                else:
                    run_steps(t, self._program)
        except BaseException:
            self.abandon()
            raise
        call.finish()
        self.runs += 1
        return self.out

    def _signed(self) -> None:
        """Replay a kept plan with the call's signature exchange beside its first exchange.

        The first exchange starts, then every rank's signature is gathered; the
        data exchange completes and the reductions run only when every
        signature is the plan's. Otherwise every rank withdraws its data and
        raises (:func:`~refcoll.calls.agree.disagreement`, which also records
        the plans again in a fresh tag slot).
        """
        t, steps = self.t, self._schedule.steps
        first = steps[0] if steps and hasattr(steps[0], "start") else None  # n = 0: none
        exchange = signatures(t)
        if first is not None:
            first.start()
        try:
            agreed = exchange.agreed(self._signature)
        except BaseException:
            if first is not None:
                first.cancel()
            raise
        if not agreed:
            if first is not None:
                first.cancel()
            disagreement(t, self.fields)
        if first is not None:
            first.finish()
        run_steps(t, self._program, 0 if first is None else 1)

    def replay(self, flat, result, out, shape, validate: bool):
        """Run a kept plan on a blocking call's flat input into its flat ``result``; return output.

        ``out`` (the caller's ``out=``, or None) and ``shape`` say what the call
        returns: ``out`` itself, or ``result`` in ``shape``.
        """
        own = self.call
        own.flat[...] = flat
        try:
            with self.t.call(self.collective):
                if validate and self._signature is not None:
                    self._signed()
                else:
                    run_steps(self.t, self._program)
        except BaseException:
            self.abandon()
            raise
        result[...] = own.result
        if self.reduction.divides:
            self.reduction.finalize(result, self.t.size)
        self.runs += 1
        return out if out is not None else result.reshape(shape)

    def abandon(self) -> None:
        """After a run that failed partway: never start its requests again (they may be running).

        A kept plan is dropped (the next call of its arguments takes the
        ordinary path); a user's recorded plan refuses its later runs.
        """
        table = transport_cache(self.t, "plans").get("kept", {})
        if self.call is not None and table.get(self.call.key) is self:
            del table[self.call.key]
            self.free()
        elif self._program is not None:
            self._broken = (f"rank {self.t.rank}: run {self.runs + 1} of this {self.collective} "
                            "plan failed partway; its requests may still be running: make a "
                            "new plan")

    # ------------------------------------------------------- recording, checks

    def _record(self) -> None:
        """Record the all-reduce on the plan's buffers, in the transport's current tag slot."""
        self._schedule = record(self.t, self.fn, *self.call.arguments(), **self.call.keywords())
        self._program = compile_steps(self._schedule.steps)

    def renew(self) -> None:
        """Record again after every rank left the old persistent exchanges (a failed agreement)."""
        self._forget()
        if self.recorded:
            self._record()

    def _forget(self) -> None:
        if self._schedule is not None:
            self._schedule.free()
        self._schedule = self._program = None

    def _misuse(self, x, out, comm) -> str | None:
        """Return what breaks the plan's promise for this run, or None (refused at once if freed).
        """
        if self.handle is not None and self.handle._done.is_set():
            self.handle = None  # completed through its handle: nothing left to wait for
        if (x is None and out is None and comm is None and not self.freed
                and self.handle is None and self._broken is None
                and self._layout_now() == self._shapes):
            return None  # the common case, in a few attribute reads
        rank = self.t.rank
        if self._broken is not None:
            return self._broken
        if self.freed:  # its peers may be in the run already: tell them (_refuse)
            return (f"rank {rank}: this {self.collective} plan was freed; make a new one with "
                    f"refcoll.{self.collective}_init")
        if self.handle is not None:
            raise UsageError(f"rank {rank}: this {self.collective} plan is already started; "
                             "wait() for it before starting it again")
        if comm is not None and comm is not self.comm and comm is not self.t:
            return f"rank {rank}: this {self.collective} plan belongs to another communicator"
        for name, given, held in (("x", x, self.x), ("out", out, self.out)):
            if given is not None and not _same_buffer(given, held):
                return (f"rank {rank}: {name}= is not the buffer this {self.collective} plan "
                        "was made with; a plan runs on its own buffers: make a plan per buffer")
        now = self._layout_now()
        if now != self._shapes:
            name = "x" if now[:2] != self._shapes[:2] else "out"
            at = 0 if name == "x" else 2
            return (f"rank {rank}: {name} of this {self.collective} plan changed from shape "
                    f"{self._shapes[at]} {self._shapes[at + 1]} to shape {now[at]} {now[at + 1]} "
                    "since the plan was made; a plan runs on the buffers it was made with: make "
                    "a new plan")
        return None

    def _layout_now(self) -> tuple:
        """Return the shapes and dtypes of the plan's buffers as they are now."""
        x, out = self.x, self.out
        return (x.shape, x.dtype) if out is None else (x.shape, x.dtype, out.shape, out.dtype)

    def _trace_fields(self) -> dict:
        return debug.call_fields(self.x, op=self.reduction, algorithm=self.algorithm,
                                 root=self.root, options=self.options, validate=self.validate)


def _refuse(t, error: str, *, tell: bool) -> None:
    """Refuse a run on this rank alone; with ``tell``, revoke the transport so its peers know.

    A peer already in the run waits for this rank's data. Told (a validated
    plan, :meth:`~refcoll.transport.mpi.MPITransport.revoke`), it raises
    PeerFailure naming this rank and the reason in that very run, and the
    transport refuses every later exchange. Untold (``validate=False``), it
    waits: for this rank's next, corrected start, or until its deadline.
    """
    if tell and getattr(t, "revoke", None) is not None:
        t.revoke(error)
    raise UsageError(error)


def _same_buffer(a, b) -> bool:
    """Return whether ``a`` is ``b``'s very memory, shape and dtype."""
    return a is b or (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
                      and a.shape == b.shape and a.dtype == b.dtype
                      and a.__array_interface__["data"][0] == b.__array_interface__["data"][0])


# ------------------------------------------------------------ the blocking calls

def live_plans(t) -> dict:
    """Return ``t``'s plans not yet freed, in the order they were made (every rank's same order)."""
    return transport_cache(t, "plans").setdefault("live", {})


def kept(t, key) -> Plan | None:
    """Return the plan ``t`` keeps for a blocking call of these agreed fields, if any."""
    table = transport_cache(t, "plans").get("kept")
    return None if table is None else table.get(key)


def reusable(t, x, op, algorithm, out) -> Plan | None:
    """Return the kept plan a blocking all-reduce of these arguments may replay, if any.

    Its arguments were checked in full, on every rank, when the plan was kept:
    a later call with the same algorithm, op, dtype and count on a contiguous
    NumPy array passes the same checks, and ``out=`` (when given) is checked
    here as the full checks would (:func:`refcoll.calls.args.flat_out`). Any
    other call returns None and takes the ordinary path.
    """
    table = t.cache.get("plans", {}).get("kept") if isinstance(t, TransportBase) else None
    if (not table or x.__class__ is not np.ndarray or not x.flags.c_contiguous
            or op.__class__ is not str or not op.islower()):  # MPI.SUM, "SUM": checked in full
        return None
    plan = table.get((algorithm, op, x.dtype, x.size))
    if plan is None or out is None or out is x:
        return plan
    if (out.__class__ is not np.ndarray or out.dtype != x.dtype or out.size != x.size
            or not out.flags.c_contiguous or not out.flags.writeable or np.shares_memory(x, out)):
        return None  # the full checks say what is wrong, or take the in-place layout
    return plan


def chosen(call: Call) -> tuple:
    """Return the algorithm ``call`` runs, its implementation and its options, ``auto`` resolved.

    ``auto`` runs what it chose with the options it chose (across nodes,
    hierarchical's ``inter`` and ``pipeline``).
    """
    name, options = call.algorithm, dict(call.options or {})
    fn = algorithms.implementation(name, call.collective)
    if algorithms.get(name).chooses:
        name, options = resolve_with_options(call.t, call.collective, call.flat.size,
                                             call.flat.itemsize)
        fn = algorithms.implementation(name, call.collective)
        if options:
            fn = functools.partial(fn, **options)
    return name, fn, options


def replayable(t, name: str, options) -> bool:
    """Return whether ``name``'s all-reduce with ``options`` on ``t`` replays from a recording
    (its record's ``replayable``: a flag, or a function of the transport and options)."""
    flag = algorithms.get(name).replayable
    return flag(t, **(options or {})) if callable(flag) else bool(flag)


def _keep(t, key, call: Call) -> None:
    """Keep a plan of ``call`` on buffers of its own, for the next calls of the same fields."""
    cache = transport_cache(t, "plans")
    table = cache.setdefault("kept", collections.OrderedDict())
    while len(table) >= PLANS_KEPT:
        table.popitem(last=False)[1].free()
    table[key] = Plan(call, own_buffers=True)


def run(call: Call, implementation=None):
    """Run one blocking call: its kept plan if it has one, else agree, choose and run.

    ``implementation``: run it instead of the algorithm's (calibration times the
    call layer around an algorithm that does nothing); no plan is kept then.

    A small all-reduce on a transport with persistent exchanges is kept as a
    plan the second time its fields come (``seen``): a one-off call pays no
    recording. Every rank makes the same calls, so every rank keeps the same
    plans at the same call; a kept plan's signature says it is one, so ranks on
    different paths raise a MismatchError instead of waiting for each other.
    """
    t, key = call.t, call.key
    if key is not None:
        plan = kept(t, key)
        if plan is not None:
            return plan.replay(call.flat, call.result, call.out, call.x.shape, call.validate)
    with t.call(call.collective):
        if call.validate:
            agree(t, **call.fields())
        name, fn, options = chosen(call)
        call.prologue()
        (implementation or fn)(t, *call.arguments(), **call.keywords())
    call.finish()
    if key is not None and implementation is None and replayable(t, name, options):
        seen = transport_cache(t, "plans").setdefault("seen", set())
        if key in seen:
            seen.discard(key)
            _keep(t, key, call)
        else:
            if len(seen) >= 4 * PLANS_KEPT:
                seen.clear()
            seen.add(key)
    return call.output()
