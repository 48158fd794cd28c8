"""The ``"refcoll"`` backend of ``torch.distributed``: a program's collectives on refcoll's.

::

    import refcoll.torch                          # registers the backend "refcoll"
    dist.init_process_group("refcoll")            # under torchrun (or mpiexec: see below)
    model = DDP(model)                            # unchanged: every collective is refcoll's

A program that cannot be edited runs the same way through ``-m refcoll.torch``,
which registers the backend and then runs the script: ``torchrun
--nproc-per-node 2 -m refcoll.torch train.py --backend refcoll``. Under
``mpiexec``, :func:`refcoll.torch.init_process_group` starts the group
(``init_process_group("refcoll")``) from MPI's ranks, over a ``TCPStore`` that rank
0 starts on a port the kernel gives it and MPI broadcasts; like ``torchrun``'s, that
store listens unauthenticated on every interface, so a job belongs on a trusted
network (:mod:`refcoll.torch.launch`). ``dist.new_group(ranks,
backend="refcoll")`` makes subgroups.

**What a group is.** ``torch.distributed`` calls the backend's creator with a
store, the rank and the size; the creator returns a :class:`RefcollGroup`, a
``dist.ProcessGroup`` subclass written in Python. It makes a ``ProcessGroupGloo``
of its own from the same store (and a ``ProcessGroupNCCL`` at the first CUDA
tensor) and runs refcoll's algorithms over that library's point-to-point
``send``/``recv`` (:class:`~refcoll.transport.torch.TorchTransport`): the
library moves bytes, refcoll decides what moves where and reduces. Every call is
a job on refcoll's progress engine, in issue order; the ``Work`` torch gets back
(:class:`~refcoll.torch.work.RefcollWork`) completes with it, so
``async_op=True`` returns at once, and ``wait()``, ``is_completed()``,
``get_future()`` and the exceptions behave as Gloo's do.

**Environment**, read by each rank when a group is made:

* ``REFCOLL_ALGO``: the algorithm, ``auto`` by default, in ``auto``'s grammar
  (:class:`~refcoll.calls.auto.AlgoFilter`). One name (``ring``) applies to every
  collective that has it, the others stay ``auto``; ``allreduce=ring,allgather=bruck``
  (or ``allreduce:ring;allgather:bruck``) chooses per collective; a list or an
  exclusion leaves ``auto`` to choose within it.
* ``REFCOLL_WATCH=gloo|nccl|<a registered backend>``: watch mode
  (:mod:`refcoll.torch.watch`): that backend does the collectives and refcoll
  judges a sample of every result. ``REFCOLL_WATCH_SAMPLE`` (64) elements per
  call; ``REFCOLL_WATCH_ACTION=raise|log``.
* ``REFCOLL_TIMEOUT`` bounds every wait (else the group's own timeout, at most
  refcoll's 300 s); ``REFCOLL_DEBUG=INFO`` writes a line per call.

**What torch 2.13 forwards to Python.** A Python call (``dist.all_reduce``...)
finds every method of the class. Calls made from C++ reach a Python group only
through the methods its binding declares overridable: ``allreduce``,
``allgather``, ``broadcast``, ``barrier``, ``send``, ``recv`` and the
group-name methods among the ones used here. Where C++ code (the functional
collectives of DTensor, a compiled graph) calls ``reduce``,
``all_gather_single``, ``reduce_scatter_single``, ``gather``, ``scatter``,
``alltoall`` or a coalesced call, torch 2.13 raises "No backend type associated
with device type cpu" itself, before refcoll is asked: a clear error, never a
wrong answer. ``dist.monitored_barrier`` refuses every backend but Gloo, and
``dist._coalescing_manager(device=...)`` needs ``_start_coalescing``, which a Python
group cannot give; both fail in torch with their own message. Without ``device``,
torch hands the block's calls to the coalesced methods below.
"""

from __future__ import annotations

import datetime
import functools
import json
import os

import torch
import torch.distributed as dist

from ..calls import collectives as calls
from ..calls.args import shared_errors
from ..calls.auto import AlgoFilter
from ..core.errors import UsageError
from ..transport.base import default_timeout
from ..transport.mpi import MPITransport
from ..transport.torch import TorchTransport
from . import exchange
from .launch import mpi_communicator
from .tensors import as_array, flat, premultipliable, premultiplier, reduction
from .watch import watch_settings, watched_from_env
from .work import submit

__all__ = ["NAME", "register", "RefcollGroup", "algorithms_from_env", "COLLECTIVES"]

#: The backend's name: ``dist.init_process_group("refcoll")``.
NAME = "refcoll"

#: The collectives whose algorithm ``REFCOLL_ALGO`` chooses.
COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce")

def register() -> None:
    """Register ``"refcoll"`` with ``torch.distributed`` (once; ``import refcoll.torch`` does)."""
    if NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(NAME, _create, devices=["cpu", "cuda"])


def algorithms_from_env(value: str | None = None) -> dict:
    """Return ``{collective: algorithm}`` from ``REFCOLL_ALGO`` (``value``); UsageError if bad.

    The variable is ``auto``'s (:class:`~refcoll.calls.auto.AlgoFilter`): where it leaves a
    collective one algorithm, the group runs that one; elsewhere ``auto``, which the
    same value then steers. ``ring``: ring wherever a collective has it;
    ``allreduce=ring,broadcast=tree`` (or ``allreduce:ring;broadcast:tree``): per
    collective; ``^recursive_doubling`` or ``allreduce:ring,tree``: ``auto``, choosing
    among those left; ``auto`` (or unset): ``auto`` everywhere.
    """
    text = os.environ.get("REFCOLL_ALGO", "") if value is None else value
    chosen = AlgoFilter.parse(text)
    return {collective: chosen.pinned(collective) or "auto" for collective in COLLECTIVES}


def _timeout(group_timeout: datetime.timedelta) -> float | None:
    """refcoll's deadline for one wait: ``REFCOLL_TIMEOUT``, else the group's, at most 300 s."""
    if "REFCOLL_TIMEOUT" in os.environ:
        return default_timeout()
    return min(group_timeout.total_seconds(), default_timeout() or float("inf"))


def _judges_mpi(store, rank: int, size: int, deadline: float | None) -> MPITransport | None:
    """Watch mode's own exchanges under ``mpiexec``: MPI among the group's processes.

    The samples and checksums of every watched call travel once more, among the
    group's ranks, over a library other than the watched one. Under ``mpiexec``
    that is MPI (a few microseconds on one host against Gloo's hundreds), on a
    communicator of the group's ranks (:func:`~refcoll.torch.launch.mpi_communicator`);
    elsewhere, ``None``: refcoll's own Gloo group.
    """
    comm = mpi_communicator(store, rank, size)
    if comm is None:
        return None
    try:
        t = MPITransport(comm, timeout=deadline, collective="watch mode's exchanges")
        # Only judging jobs, on the progress thread, use it, and a peer is often still at
        # its training: a wait sleeps between polls at once rather than spin on a core
        # that peer, or this rank's own training, needs (the judging is off their path).
        t.patient, t.patience = True, 1
        return t
    finally:
        comm.Free()  # the transport works on its own duplicate


def _create(store, rank: int, size: int, timeout: datetime.timedelta):
    """The creator torch calls on every rank of a new group: a RefcollGroup.

    Every rank reads its settings (``REFCOLL_ALGO``, ``REFCOLL_WATCH*``,
    ``REFCOLL_TIMEOUT``) and tells the others through the group's store whether they
    read, before any group is made: one rank's bad value is every rank's
    :class:`UsageError`, where the others would wait in the making of the groups until
    the group's timeout.
    """
    problem, algorithms, settings = "", {}, {}
    try:
        algorithms, settings = algorithms_from_env(), watch_settings()
        _timeout(timeout)
    except UsageError as exc:
        problem = str(exc) or "a setting it could not read"
    # What each rank read, or why it could not: ranks that read other values (a watch on
    # one rank alone, other samples or batches) would run other exchanges, and wait
    # for each other until the group's timeout.
    store.set(f"refcoll/settings/{rank}", json.dumps(
        {"problem": problem, "algorithms": algorithms, "watch": settings}, sort_keys=True))
    told = [_told(store.get(f"refcoll/settings/{r}")) for r in range(size)]
    bad = [f"rank {r}: {said['problem']}" for r, said in enumerate(told) if said["problem"]]
    if bad:
        raise UsageError("the refcoll group's settings: " + "; ".join(bad))
    for key, name in (("algorithms", "REFCOLL_ALGO"), ("watch", "REFCOLL_WATCH*")):
        if any(said[key] != told[0][key] for said in told):
            raise UsageError(f"the refcoll group's settings differ between ranks: {name} "
                             "reads " + "; ".join(f"rank {r}: {said[key] or 'unset'}"
                                                  for r, said in enumerate(told))
                             + ": give every rank the same environment")
    watched = watched_from_env(store, rank, size, timeout, settings)
    return RefcollGroup(store, rank, size, timeout, algorithms=algorithms, watched=watched)


def _told(raw: bytes) -> dict:
    """One rank's settings record from the store (a record it cannot read: its problem)."""
    try:
        said = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError):
        said = None
    if not isinstance(said, dict) or not {"problem", "algorithms", "watch"} <= set(said):
        return {"problem": "settings this version of refcoll cannot read", "algorithms": {},
                "watch": {}}
    return said


def _watchable(name: str):
    """Hand the call to the watched backend in watch mode (:mod:`refcoll.torch.watch`)."""
    def wrap(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            if self.watched is not None:
                return self.watched.call(self, name, *args, **kwargs)
            return method(self, *args, **kwargs)
        return call
    return wrap


class RefcollGroup(dist.ProcessGroup):
    """A ``torch.distributed`` process group whose collectives are refcoll's.

    Made by torch through the registered creator, on every rank of a group;
    each method takes torch's arguments (tensor lists and an ``*Options``
    object) and returns a ``Work``. ``algorithms`` maps each collective to the
    algorithm it runs; ``watched`` is watch mode's :class:`~refcoll.torch.watch.Watch`.
    """

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta, *,
                 algorithms: dict | None = None, watched=None):
        super().__init__(rank, size)
        self._store, self._group_timeout = store, timeout
        self.algorithms = dict(algorithms or algorithms_from_env())
        self.watched = watched
        self.deadline = _timeout(timeout)
        gloo = dist.ProcessGroupGloo(dist.PrefixStore("refcoll/gloo", store), rank, size, timeout)
        self._gloo = gloo
        self._cpu = TorchTransport.over_backend(gloo, rank, size, kind="gloo",
                                                timeout=self.deadline)
        self._cuda = None  # made at the first CUDA tensor
        self._name = self._desc = ""
        if watched is not None:
            watched.over = _judges_mpi(store, rank, size, self.deadline)

    def shutdown(self) -> None:
        """``destroy_process_group``'s call: watch mode judges its last, unclosed batch."""
        if self.watched is not None:
            try:
                self.watched.finish(self)
            finally:
                if self.watched.over is not None:
                    self.watched.over.free()
                    self.watched.over = None

    # ----------------------------------------------------------- identity

    def getBackendName(self) -> str:  # noqa: N802 - torch's names
        return NAME

    def name(self) -> str:
        return NAME

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._desc

    _set_group_name, _set_group_desc = setGroupName, setGroupDesc

    @property
    def group_name(self) -> str:
        return self._name

    @property
    def group_desc(self) -> str:
        return self._desc

    def __repr__(self) -> str:
        watch = f", watching {self.watched.backend}" if self.watched else ""
        return f"RefcollGroup(rank={self.rank()}, size={self.size()}{watch})"

    # -------------------------------------------------------------- running

    def transport(self, tensors) -> TorchTransport:
        """Return the transport that moves ``tensors``: Gloo's for CPU, NCCL's for CUDA."""
        first = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
        if first is None or not first.is_cuda:
            return self._cpu
        if self._cuda is None:
            nccl = dist.ProcessGroupNCCL(dist.PrefixStore("refcoll/nccl", self._store),
                                         self.rank(), self.size(),
                                         dist.ProcessGroupNCCL.Options())
            self._cuda = TorchTransport.over_backend(nccl, self.rank(), self.size(),
                                                     kind="nccl", timeout=self.deadline)
        return self._cuda

    def _submit(self, name: str, tensors: list, job, result=None):
        """Run ``job(t)`` on the progress engine; return the Work whose result is ``result``."""
        return submit(name, self.transport(tensors), job, tensors if result is None else result)

    def _arrays(self, t, name: str, tensors, what: str = "the input") -> list:
        """Return each tensor as an array over its memory; a bad one is every rank's error."""
        with shared_errors(t, True, name):
            return [as_array(flat(x), t, what) for x in tensors]

    # --------------------------------------------------------- reductions

    @_watchable("allreduce")
    def allreduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.AllreduceOptions()
        return self._reducing("allreduce", tensors, opts, lambda x, out, t, **kw: calls.allreduce(
            x, t, out=out, **kw))

    @_watchable("allreduce_coalesced")
    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts if opts is not None else dist.AllreduceOptions())

    @_watchable("reduce")
    def reduce(self, tensors, opts=None):
        opts = opts if opts is not None else dist.ReduceOptions()
        root = opts.rootRank
        return self._reducing("reduce", tensors, opts, lambda x, out, t, **kw: calls.reduce(
            x, root, t, out=out if t.rank == root else None, **kw))

    def _reducing(self, name: str, tensors, opts, call):
        """Each tensor reduced in place by ``call(x, out, t, op=, algorithm=)``: the Work of the
        all-reduce or the reduce. PREMUL_SUM's factor scales a copy of the input, so a call
        refused by the agreement, or a reduce's non-root, leaves the tensor as it was."""
        def job(t):
            with shared_errors(t, True, name):
                op, factor = reduction(opts.reduceOp)
                _linear_on_complex(op, any(x.is_complex() for x in tensors))
                premultipliable(factor, tensors)
            for tensor, x in zip(tensors, self._arrays(t, name, tensors)):
                source = x if factor is None else \
                    x * x.dtype.type(premultiplier(factor, tensor).item())  # torch's rounding
                call(source, x, t, op=op, algorithm=self.algorithms[name])
        return self._submit(name, tensors, job)

    @_watchable("reduce_scatter")
    def reduce_scatter(self, outputs, input_lists, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()

        def job(t):
            for out, pieces in zip(outputs, input_lists):
                self._reduce_scatter(t, out, pieces, opts,
                                     complex_=any(piece.is_complex() for piece in pieces))
        return self._submit("reduce_scatter", outputs, job)

    @_watchable("reduce_scatter_single")
    def reduce_scatter_single(self, output, input, opts=None):  # noqa: A002 - torch's names
        opts = opts if opts is not None else dist.ReduceScatterOptions()

        def job(t):
            self._reduce_scatter(t, output, input, opts, complex_=input.is_complex())
        return self._submit("reduce_scatter", [output], job, [output])

    _reduce_scatter_base = reduce_scatter_single

    @_watchable("reduce_scatter_single_coalesced")
    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else dist.ReduceScatterOptions()

        def job(t):
            for out, x in zip(outputs, inputs):
                self._reduce_scatter(t, out, x, opts, complex_=x.is_complex())
        return self._submit("reduce_scatter", outputs, job, outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _reduce_scatter(self, t, out: torch.Tensor, x, opts, *, complex_: bool = False):
        """Reduce-scatter ``x`` (a tensor, or a list of the pieces, one a rank) into ``out``;
        a tensor refused on one rank (not contiguous, sparse) is every rank's error."""
        with shared_errors(t, True, "reduce_scatter"):
            op, factor = reduction(opts.reduceOp)
            _linear_on_complex(op, complex_)
            copied = isinstance(x, list)
            premultipliable(factor, x if copied else [x])
            if copied:
                _one_a_rank(t, x, out.numel(), "reduce-scatter", "piece", "its output")
            whole = torch.cat([flat(piece) for piece in x]) if copied else flat(x)
            count = sum(piece.numel() for piece in x) if copied else x.numel()
            if count != out.numel() * t.size:  # torch's rule (refcoll's takes any n)
                raise ValueError(f"rank {t.rank}: the reduce-scatter's input has {count} "
                                 f"elements; {t.size} ranks of an output of {out.numel()} "
                                 f"need {out.numel() * t.size}")
            if factor is not None:
                scale = premultiplier(factor, whole)
                whole = whole * scale if not copied else whole.mul_(scale)
            x, o = as_array(whole, t, "the input"), as_array(flat(out), t, "out=")
        calls.reduce_scatter(x, t, op=op, algorithm=self.algorithms["reduce_scatter"], out=o)

    # ------------------------------------------------------ data movement

    @_watchable("broadcast")
    def broadcast(self, tensors, opts=None):
        opts = opts if opts is not None else dist.BroadcastOptions()

        def job(t):
            for x in self._arrays(t, "broadcast", [_moved(x) for x in tensors]):
                calls.broadcast(x, opts.rootRank, t, algorithm=self.algorithms["broadcast"],
                                out=x)
        return self._submit("broadcast", tensors, job)

    @_watchable("allgather")
    def allgather(self, output_lists, inputs, opts=None):
        opts = opts if opts is not None else dist.AllgatherOptions()

        def job(t):
            self._allgather_lists(t, output_lists, inputs)
        # the future's value is the one input's outputs, as Gloo's is
        return self._submit("allgather", inputs, job, output_lists[0] if len(output_lists) == 1
                            else output_lists)

    @_watchable("allgather_coalesced")
    def allgather_coalesced(self, output_lists, inputs, opts=None):
        """``output_lists[r][j]``: rank ``r``'s ``inputs[j]`` (by rank first, as Gloo's is)."""
        by_input = [[outs[j] for outs in output_lists] for j in range(len(inputs))]

        def job(t):
            self._allgather_lists(t, by_input, inputs)
        return self._submit("allgather", inputs, job, output_lists)

    def _allgather_lists(self, t, output_lists, inputs) -> None:
        """``output_lists[j][r]``: rank ``r``'s ``inputs[j]``; a tensor refused on one rank is
        every rank's error, before the call."""
        for outs, x in zip(output_lists, inputs):
            with shared_errors(t, True, "allgather"):
                mine = flat(x)
                targets = [flat(out) for out in outs]
                _one_a_rank(t, targets, mine.numel(), "allgather", "output", "the input")
            whole = torch.empty((self.size(), mine.numel()), dtype=mine.dtype, device=x.device)
            self._allgather(t, whole, x)
            for target, row in zip(targets, whole):
                target.copy_(row)

    @_watchable("all_gather_single")
    def all_gather_single(self, output, input, opts=None):  # noqa: A002
        opts = opts if opts is not None else dist.AllgatherOptions()

        def job(t):
            self._allgather(t, output, input)
        return self._submit("allgather", [output], job, [output])

    _allgather_base = all_gather_single

    @_watchable("all_gather_single_coalesced")
    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        def job(t):
            for out, x in zip(outputs, inputs):
                self._allgather(t, out, x)
        return self._submit("allgather", outputs, job, outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def _allgather(self, t, whole: torch.Tensor, x: torch.Tensor) -> None:
        with shared_errors(t, True, "allgather"):
            a, o = as_array(flat(_moved(x)), t), as_array(flat(_moved(whole)), t, "the output")
            if o.size != a.size * t.size:
                raise ValueError(f"rank {t.rank}: the allgather output has {o.size} elements; "
                                 f"{t.size} ranks of {a.size} need {a.size * t.size}")
        calls.allgather(a, t, algorithm=self.algorithms["allgather"],
                        out=o.reshape(t.size, a.size))

    @_watchable("gather")
    def gather(self, output_lists, inputs, opts=None):
        opts = opts if opts is not None else dist.GatherOptions()

        def job(t):
            root = opts.rootRank
            (x,), error = _readable(t, inputs[:1])
            outs = None
            if t.rank == root and not error:
                outs, error = _readable(t, output_lists[0] if output_lists else [], "an output")
            exchange.gather(t, x, root, outs, error)
        return self._submit("gather", inputs, job, output_lists)

    @_watchable("scatter")
    def scatter(self, outputs, input_lists, opts=None):
        opts = opts if opts is not None else dist.ScatterOptions()

        def job(t):
            root = opts.rootRank
            (out,), error = _readable(t, outputs[:1], "the output")
            ins = None
            if t.rank == root and not error:
                ins, error = _readable(t, input_lists[0] if input_lists else [])
            exchange.scatter(t, ins, root, out, error)
        return self._submit("scatter", outputs, job, outputs)

    @_watchable("alltoall")
    def alltoall(self, outputs, inputs, opts=None):
        def job(t):
            ins, error = _readable(t, inputs)
            outs, error = _readable(t, outputs, "an output", error)
            exchange.alltoall(t, ins, outs, error)
        return self._submit("alltoall", outputs, job, outputs)

    @_watchable("all_to_all_single")
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes,  # noqa: A002
                          opts=None):
        def job(t):
            try:
                ins = _split(input, input_split_sizes, self.size())
                outs, error = _split(output, output_split_sizes, self.size()), ""
            except ValueError as exc:
                ins, outs, error = [], [], f"rank {t.rank}: {exc}"
            ins, error = _readable(t, ins, error=error)
            outs, error = _readable(t, outs, "an output", error)
            exchange.alltoall(t, ins, outs, error)
        return self._submit("alltoall", [output], job, [output])

    alltoall_base = all_to_all_single

    @_watchable("barrier")
    def barrier(self, opts=None):
        return self._submit("barrier", [], exchange.barrier, [])

    # --------------------------------------------------- point to point

    @_watchable("send")
    def send(self, tensors, dst: int, tag: int = 0):
        """The user's own message: Gloo's (or NCCL's) send, beside refcoll's tags."""
        return self._library(tensors).send(tensors, dst, tag)

    @_watchable("recv")
    def recv(self, tensors, src: int, tag: int = 0):
        return self._library(tensors).recv(tensors, src, tag)

    @_watchable("recv_anysource")
    def recv_anysource(self, tensors, tag: int = 0):
        return self._library(tensors).recv_anysource(tensors, tag)

    def _library(self, tensors):
        return self.transport(tensors)._raw

    def refcoll_transport(self) -> TorchTransport:
        """The transport of this group's calls on CPU tensors, for refcoll's own functions
        and hooks given this group (:func:`~refcoll.transport.torch.torch_transport_for`):
        a second transport over the same Gloo group would use the same tags, and its
        calls in flight beside this group's would take each other's messages."""
        return self._cpu


def _moved(tensor):
    """Return what data movement carries of ``tensor``: a bool tensor as its bytes (a uint8
    view), which refcoll moves as Gloo does though it reduces no bool; any other, itself."""
    if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.bool:
        return tensor.view(torch.uint8)
    return tensor


def _linear_on_complex(op: str, complex_: bool) -> None:
    """Refuse an op other than a sum or average on complex tensors: refcoll reduces their
    real and imaginary parts as floats, elementwise, which is the complex result only for
    the ops that are linear (SUM, AVG, PREMUL_SUM). Gloo refuses complex reductions."""
    if complex_ and op not in ("sum", "avg"):
        raise ValueError(f"reduce op {op} on a complex tensor: refcoll reduces the real and "
                         "imaginary parts apart, which is the complex result of SUM, AVG and "
                         "PREMUL_SUM only")


def _readable(t, tensors, what: str = "the input", error: str = "") -> tuple[list, str]:
    """Return the tensors as arrays and ``""``, or ``[None]``s and why they cannot be read.

    For the calls whose agreement carries a rank's objection to every rank
    (:mod:`refcoll.torch.exchange`) instead of raising it here alone.
    """
    if error:
        return [None] * max(len(tensors), 1), error
    try:
        return [as_array(flat(_moved(x)), t, what) for x in tensors] or [None], ""
    except (TypeError, ValueError) as exc:
        return [None] * max(len(tensors), 1), str(exc)


def _one_a_rank(t, tensors: list, count: int, collective: str, kind: str, other: str) -> None:
    """Refuse a list form's tensors (an allgather's outputs, a reduce-scatter's pieces) unless
    there is one a rank, each of ``count`` elements, as ``other`` has (ValueError: the
    shared check makes it every rank's)."""
    if len(tensors) != t.size:
        raise ValueError(f"rank {t.rank}: the {collective} has {len(tensors)} {kind}s for "
                         f"{t.size} ranks")
    for r, tensor in enumerate(tensors):
        if tensor.numel() != count:
            raise ValueError(f"rank {t.rank}: {kind} {r} of the {collective} has "
                             f"{tensor.numel()} elements, {other} {count}")


def _split(tensor: torch.Tensor, sizes, p: int) -> list:
    """Cut ``tensor`` along dim 0 into ``sizes`` rows (``[]``: ``p`` equal parts)."""
    if tensor.dim() == 0:
        raise ValueError("all_to_all_single needs a tensor with a dim 0 to cut, got a scalar")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in sizes or ()):
        raise ValueError(f"all_to_all_single split sizes {list(sizes)} must be whole numbers "
                         "from 0")
    if not sizes:
        if tensor.shape[0] % p if tensor.dim() else True:
            raise ValueError(f"all_to_all_single without split sizes needs dim 0 "
                             f"({tuple(tensor.shape)}) divisible by {p} ranks")
        sizes = [tensor.shape[0] // p] * p
    if len(sizes) != p or sum(sizes) != tensor.shape[0]:
        raise ValueError(f"all_to_all_single split sizes {list(sizes)} must be {p} sizes "
                         f"summing to dim 0 ({tensor.shape[0]})")
    return list(torch.split(tensor, list(sizes)))
