"""Recorded schedules, replayed: the steps of one collective call, run again without the algorithm.

A schedule is a list of steps, each an exchange (its receives and sends) or a
local reduction, run in order. Two kinds of caller build one:

* a plan (:mod:`refcoll.calls.plans`) records an algorithm once on
  its buffers (:func:`record`): a :class:`Recorder` stands in for the
  transport, and each send, receive or sendrecv the algorithm makes becomes one
  persistent exchange of the real transport (MPI's ``MPI_Send_init`` /
  ``MPI_Recv_init``, with the transport's deadline), each local reduction the
  real transport's call, bound to its buffers. MPI-4's persistent collectives
  (``MPI_Allreduce_init``) in Python;
* the benchmark's transport bound (:meth:`Schedule.from_plan`) rebuilds every
  step of a simulated run from the ledger, on byte buffers: the messages and
  reductions of the algorithm and nothing else.

The schedules are data-oblivious (which message goes where never depends on
the values), so one recording serves every call. Replaying the same exchanges
and reductions, in the same order, on the same values, gives the same bits as
the algorithm itself.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Sequence

import numpy as np

from ..core.errors import RefcollError
from ..core.ops import Op, combine, get_dtype, get_op
from .base import TransportBase, default_timeout
from .deadline import POLLS_BEFORE_YIELD, duplicate

__all__ = ["Recorder", "Schedule", "Stepper", "record", "compile_steps", "exchanges",
           "run_steps", "start", "done", "landed"]


class Recorder:
    """A stand-in transport that records an algorithm's steps instead of running them.

    Each send, receive or sendrecv becomes one persistent exchange of ``t``
    (``t.persistent``); each local reduction, ``t``'s own ``reduce_local``, bound.
    """

    def __init__(self, t, steps: list | None = None, slot: int = 0):
        self.rank, self.size = t.rank, t.size
        self.slot = slot  # the plan's tag slot (its exchanges' tags: t.plan_tags)
        self.what = f"plan #{slot + 1} of this communicator"  # named in a timeout
        self.steps: list[Callable[[], None]] = [] if steps is None else steps
        #: The transport this one records for: an algorithm that splits it (the
        #: hierarchical all-reduce, :func:`refcoll.algorithms.node_layout`) takes the
        #: real transport's parts, each recorded by :meth:`sub` into the same steps.
        self.records = t

    def sub(self, t) -> "Recorder":
        """Return a recorder of ``t`` (a transport split from this one's) into these steps."""
        return Recorder(t, self.steps, self.slot)

    def call(self, name: str):
        """A collective's scope: nothing to record (the plan's run has its own)."""
        return contextlib.nullcontext()

    def send(self, buf, dest: int, tag: int = 0) -> None:
        self.steps.append(self.records.persistent([(buf, dest, tag)], [], self.what, self.slot))

    def recv(self, buf, source: int, tag: int = 0) -> None:
        self.steps.append(self.records.persistent([], [(buf, source, tag)], self.what, self.slot))

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0) -> None:
        self.steps.append(self.records.persistent([(sendbuf, dest, tag)],
                                                  [(recvbuf, source, tag)], self.what, self.slot))

    def reduce_local(self, op, a, b, out) -> None:
        self.steps.append(functools.partial(self.records.reduce_local, op, a, b, out))


class Schedule:
    """Steps run in order: exchanges and local reductions on buffers bound once.

    Call the object to run it once; :meth:`free` releases what its steps hold
    (persistent requests, a duplicated communicator).
    """

    def __init__(self, steps: Sequence[Callable[[], None]], *, on_free: Callable | None = None):
        self.steps = list(steps)
        self._on_free = on_free

    def __call__(self) -> None:
        for step in self.steps:
            step()

    def free(self) -> None:
        """Free the steps' persistent requests, and anything the builder kept."""
        for step in self.steps:
            if hasattr(step, "free"):
                step.free()
        if self._on_free is not None:
            self._on_free()

    @classmethod
    def from_plan(cls, comm, plan: list[tuple], dtype, op, *,
                  timeout: float | None = None) -> "Schedule":
        """Return one rank's simulated schedule on bare MPI: the transport bound of an algorithm.

        ``plan`` is ``[(step, sends, receives, reductions), ...]`` in step order:
        ``sends`` as ``(dest, nbytes)``, ``receives`` as ``(source, nbytes)``,
        ``reductions`` as element counts combined after the step's messages (the
        ledger's rounds, so within a step no message waits for another). Every
        step posts its receives and sends at once (``Irecv``/``Isend`` on
        preallocated byte buffers), waits for them all with a bare ``Waitall``
        (timed, so no deadline polling: the caller bounds the run by a barrier
        before it, after which every peer is in this very replay), then runs its
        reductions (the op's ufunc, ``out=`` the first operand). Nothing else runs:
        no argument handling, no views, no tag spaces, no Python step loop of the
        algorithm.

        Args:
            comm: an mpi4py communicator of the schedule's ranks (duplicated here,
                with ``MPI_Comm_idup`` waited for by the deadline).
            plan: this rank's plan.
            dtype: the elements' dtype; op: the reduction op.
            timeout: seconds the duplication may wait for the other ranks (None:
                ``REFCOLL_TIMEOUT``'s, see :func:`refcoll.transport.base.default_timeout`).
        """
        from mpi4py import MPI

        dup = duplicate(comm, default_timeout() if timeout is None else timeout,
                        "refcoll bench (the transport bound's communicator)")
        ufunc = get_op(op).ufunc
        dt = get_dtype(dtype)
        largest_send = max((n for _, sends, _, _ in plan for _, n in sends), default=0)
        largest_step = max((sum(n for _, n in recvs) for _, _, recvs, _ in plan), default=0)
        largest_reduction = max((e for *_, reds in plan for e in reds), default=0)
        # Written once, so every page is real: reading never-written (zero-page)
        # memory costs almost nothing and would make the bound too optimistic.
        send = np.ones(largest_send, np.uint8)  # concurrent sends may share a buffer
        recv = np.ones(largest_step, np.uint8)  # concurrent receives may not
        acc = np.ones(largest_reduction, dt)
        other = np.ones(largest_reduction, dt)
        steps: list[Callable[[], None]] = []
        for _, sends, recvs, reds in plan:
            receives, offset = [], 0
            for source, n in recvs:
                receives.append(([recv[offset:offset + n], MPI.BYTE], source))
                offset += n
            outgoing = [([send[:n], MPI.BYTE], dest) for dest, n in sends]
            if receives or outgoing:
                steps.append(functools.partial(_exchange, dup, receives, outgoing,
                                               MPI.Request.Waitall))
            for e in reds:
                steps.append(functools.partial(ufunc, acc[:e], other[:e], out=acc[:e]))
        return cls(steps, on_free=dup.Free)


def _exchange(comm, receives, sends, waitall) -> None:
    """Post every receive and send of one step at once and wait for them all."""
    waitall([comm.Irecv(buf, source) for buf, source in receives]
                         + [comm.Isend(buf, dest) for buf, dest in sends])


def record(t, fn: Callable, *args, slot: int = 0, **kwargs) -> Schedule:
    """Run ``fn(recorder, *args, **kwargs)`` over a :class:`Recorder` of ``t``; return its schedule.

    ``t`` must offer persistent exchanges (``t.persistent``, as
    :class:`~refcoll.transport.mpi.MPITransport` does), made in the tag slot of
    plan ``slot``. The buffers ``fn`` is given must stay alive and in place while
    the schedule exists.
    """
    recorder = Recorder(t, slot=slot)
    fn(recorder, *args, **kwargs)
    return Schedule(recorder.steps)


def compile_steps(steps: Sequence[Callable[[], None]]) -> list:
    """Return recorded steps as a flat program :func:`run_steps` runs without a call per layer.

    For the smallest calls, where the Python layers between a step and MPI cost
    as much as the message. An exchange becomes ``(requests, bytes received,
    source, bytes sent, what it waits for)``, run as
    :meth:`~refcoll.transport.persistent.PersistentExchange.__call__` runs it (start,
    the transport's deadline wait, the byte count); its runner counts a whole run's
    traffic at once (:func:`exchanges`, :meth:`~refcoll.transport.base.Traffic.meter`).
    A reduction
    ``transport.reduce_local(op, a, b, out)`` on a transport that keeps the base
    one becomes :func:`~refcoll.core.ops.combine` of the op's ufunc, bound to its
    buffers (what ``op.apply`` calls); any other step stays as it is.
    """
    program = []
    for step in steps:
        if hasattr(step, "_requests"):
            program.append((step._requests, step._received, step._source, step._sent,
                            step._describe))
            continue
        owner = getattr(getattr(step, "func", None), "__self__", None)
        if (owner is not None and type(owner).reduce_local is TransportBase.reduce_local
                and len(step.args) == 4 and type(step.args[0]).apply is Op.apply):
            op, a, b, out = step.args
            step = functools.partial(combine, op.ufunc, a, b, out)
        program.append(step)
    return program


def exchanges(program: list) -> list[tuple[int, int]]:
    """Return the ``(bytes sent, bytes received)`` of each exchange of a :func:`compile_steps`
    program (-1: no send, or no receive): what one run moves."""
    return [(step[3], step[1]) for step in program if step.__class__ is tuple]


class Stepper:
    """Recorded steps run one at a time: an exchange started, then tested across calls.

    What a schedule-driven non-blocking call advances (:mod:`refcoll.calls.plans`).
    """

    def __init__(self, steps):
        self.steps, self.index, self.started = steps, 0, False

    def advance(self) -> bool:
        """Run as far as possible without waiting; return whether every step is done."""
        steps = self.steps
        while self.index < len(steps):
            step = steps[self.index]
            if hasattr(step, "test"):  # an exchange: start it, then look again later
                if not self.started:
                    step.start()
                    self.started = True
                if not step.test():
                    return False
                self.started = False
            else:
                step()
            self.index += 1
        return True


def run_steps(t, program: list, start: int = 0, posted: bool = False) -> None:
    """Run a :func:`compile_steps` program on MPI transport ``t``, from step ``start``.

    The loop every recorded run spends its time in, so written out in full:
    each exchange is started (``MPI_Startall``; not if ``posted``: the exchange
    at ``start`` was started already, by :class:`~refcoll.calls.plans.InFlight`),
    polled up to :data:`~refcoll.transport.deadline.POLLS_BEFORE_YIELD` times
    on a transport nobody revoked (a small message's reply comes within them
    when each rank has its core), then waited for by the transport's deadline,
    watching for revocation, its polls counting towards the yield
    (:meth:`~refcoll.transport.mpi.MPITransport._finish`); then :func:`landed`.
    Each other step is called. The traffic is the caller's to count, once the run
    completes (a :class:`~refcoll.transport.base.Meter`'s ``runs``).
    """
    MPI = _MPI[0] or _load_mpi()
    startall, testall, statuses = MPI.Prequest.Startall, MPI.Request.Testall, t._statuses
    for i in range(start, len(program)):
        step = program[i]
        if step.__class__ is not tuple:
            step()
            continue
        requests, received, source, sent, what = step
        if posted:
            posted = False
        elif requests:
            startall(requests)
        else:
            raise RefcollError(f"rank {t.rank}: a freed persistent exchange was run ({what()})")
        if t.revoked is None:
            try:
                for _ in _SPIN:
                    if testall(requests, statuses):
                        t._ops += 1
                        break
                else:
                    t._finish(requests, what, polls=POLLS_BEFORE_YIELD)
            except MPI.Exception as exc:  # (_finish's own are translated already)
                t._mpi_error(exc, what)
        else:
            t._finish(requests, what)
        if source is not None and statuses[0].Get_count(MPI.BYTE) != received:
            t._check_count(received, source)  # raises, naming both sizes


def start(exchange: tuple) -> None:
    """Start an exchange of a :func:`compile_steps` program (``MPI_Startall``); return at once."""
    (_MPI[0] or _load_mpi()).Prequest.Startall(exchange[0])


def done(t, exchange: tuple) -> bool:
    """Return whether a started exchange has completed (``MPI_Testall``); never wait."""
    MPI = _MPI[0] or _load_mpi()
    try:
        return MPI.Request.Testall(exchange[0], t._statuses)
    except MPI.Exception as exc:  # a message longer than its buffer: the ranks disagree
        t._mpi_error(exc, exchange[4])


def landed(t, exchange: tuple) -> None:
    """Account for an exchange :func:`done` found complete: check what came (the run's
    runner counts its traffic, as :func:`run_steps`'s does)."""
    requests, received, source, sent, what = exchange
    t._ops += 1
    if source is not None and t._statuses[0].Get_count(_MPI[0].BYTE) != received:
        t._check_count(received, source)  # raises, naming both sizes


#: The polls :func:`run_steps` makes of an exchange before it waits by the deadline.
_SPIN = range(POLLS_BEFORE_YIELD)


#: mpi4py's MPI module, once :func:`run_steps` has loaded it (an import per call costs as
#: much as a small message's Python layers).
_MPI = [None]


def _load_mpi():
    from mpi4py import MPI

    _MPI[0] = MPI
    return MPI
