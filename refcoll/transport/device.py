"""Device transports: device buffers over a host transport, CUDA-aware or staged.

A device transport wraps the host transport so that device buffers can cross it:

* :class:`DirectTransport`, when the MPI library reads device memory (CUDA-aware):
  device buffers go to mpi4py's upper-case calls as they are (mpi4py takes
  objects with ``__cuda_array_interface__`` or DLPack), after the current stream
  is synchronised, so no kernel still writes a buffer MPI reads or reads one MPI
  overwrites.
* :class:`StagingTransport`, when it does not: each message crosses a pinned host
  buffer, copied device-to-host before the send and host-to-device after the
  receive on a stream of its own, in chunks, so the copy of one chunk overlaps
  the transfer of its neighbour. Pinned buffers are allocated once per size class
  and reused.

Local reductions stay on the device (CuPy's ufuncs with ``out=``) on both.
Which of the two applies is :func:`~refcoll.transport.cuda_aware.cuda_aware`'s
answer, agreed by every rank (the caller passes the agreement in). GPU selection
(:func:`use_node_gpu`, :func:`check_one_gpu_per_rank`) is here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..core.errors import UsageError
from ..core.xp import (
    array_namespace,
    cupy_or_none,
    gpu_unavailable_reason,
    is_device_array,
    require_cupy,
)
from .base import as_bytes, transport_cache
from .cuda_aware import cuda_aware
from .deadline import bounded_barrier
from .sim import SimTransport

__all__ = ["STAGING_CHUNK_BYTES", "DeviceOp", "PinnedPool", "DirectTransport", "LibraryTransport",
           "StagingTransport", "device_transport", "check_one_gpu_per_rank", "use_node_gpu"]

#: Largest message the staging path sends whole; longer ones go in chunks of this size.
STAGING_CHUNK_BYTES = 4 << 20


@dataclass(frozen=True)
class DeviceOp:
    """A reduction op whose combine runs as the device array module's own ufunc.

    ``apply`` is what every transport's ``reduce_local`` calls: here it is
    ``xp.add(a, b, out=out)`` (or ``multiply``, ``minimum``, ``maximum``) of
    CuPy, one elementwise kernel, correctly rounded like NumPy's.
    """

    op: Any
    xp: Any

    @property
    def name(self) -> str:
        """Return the op's name (``sum``...)."""
        return self.op.name

    def apply(self, a, b, out) -> None:
        """Compute ``out = a (op) b`` on the device."""
        getattr(self.xp, self.op.ufunc.__name__)(a, b, out=out)


#: What the call layer reads off a transport that only some transports have, taken from
#: the wrapped one where it has them: MPI's tag slots of plans (``next_plan_slot``,
#: ``plan_tags``), revocation (``revoke``), the ranks' host names (``hosts``: a rack's
#: ranks) and the thread level (``thread_multiple``: which progress engine runs).
_FROM_INNER = frozenset({"next_plan_slot", "plan_tags", "revoke", "hosts", "thread_multiple",
                         "released"})


class _DeviceTransport:
    """What both device transports share: everything but point-to-point goes to ``inner``.

    ``array_module`` tells the algorithms' workspaces where to allocate. The
    call's state is the wrapped transport's: its tag space (:meth:`call`,
    :meth:`enter_call`, :meth:`leave_call`), counters, deadline names, and the
    attributes in :data:`_FROM_INNER`, so a plan or a non-blocking call on
    device arrays runs as it does on host arrays. Not forwarded, on purpose:
    ``persistent`` (a recording binds MPI requests to host memory: a plan on
    device arrays runs its algorithm again) and ``concurrent_phases`` (the
    staging path's pinned buffers are shared by a transport and its splits).
    """

    #: Phases of a pipelined algorithm run one after another (see the class's notes).
    concurrent_phases = False
    #: The path device arrays take: what the ranks' argument agreement compares.
    memory = "device"

    def __init__(self, inner, xp):
        self.inner = inner
        self.array_module = xp
        self.rank = inner.rank
        self.size = inner.size
        # Its own buffers (device arrays, not the host ones), but the wrapped transport's
        # progress engine: one communicator's calls, host and device, in one issue order.
        self.cache: dict[str, dict] = {"progress": transport_cache(inner, "progress")}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"

    def __getattr__(self, name: str):
        if name in _FROM_INNER:  # the wrapped transport's, or AttributeError as it has none
            return getattr(self.inner, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def traffic(self):
        """Return the wrapped transport's byte counters."""
        return self.inner.traffic

    @property
    def current_call(self) -> str | None:
        """Return the name of the collective call running, if any (what a timeout names)."""
        return self.inner.current_call

    @current_call.setter
    def current_call(self, name: str | None) -> None:
        self.inner.current_call = name

    @property
    def patient(self) -> bool:
        """Whether a progress thread runs the wrapped transport's calls (its waits may sleep)."""
        return getattr(self.inner, "patient", False)

    @patient.setter
    def patient(self, value: bool) -> None:
        self.inner.patient = value

    def call(self, name: str):
        """Run one collective call in the wrapped transport's tag space."""
        return self.inner.call(name)

    def enter_call(self, name: str, tags: int | None = None) -> None:
        """Begin collective ``name`` in the wrapped transport's tag space (a plan's, ``tags``)."""
        self.inner.enter_call(name, tags)

    def leave_call(self) -> None:
        """End the collective :meth:`enter_call` began."""
        self.inner.leave_call()

    def activity(self, delta: int) -> None:
        """Note a thread starting or stopping work, as the wrapped transport counts it."""
        activity = getattr(self.inner, "activity", None)
        if activity is not None:
            activity(delta)

    def idle(self) -> None:
        """Note that the calls outstanding are done, as the wrapped transport hears it."""
        idle = getattr(self.inner, "idle", None)
        if idle is not None:
            idle()

    def unreceived(self) -> list[str]:
        """Return the messages sent to this rank and not received."""
        return self.inner.unreceived()

    def split(self, color: int, key: int):
        """Return the device transport of ``inner.split(color, key)`` (None where it is)."""
        sub = self.inner.split(color, key)
        return None if sub is None else self._wrap(sub)

    def split_node(self):
        """Return the device transport of the ranks on this rank's node."""
        return self._wrap(self.inner.split_node())

    def reduce_local(self, op, a, b, out) -> None:
        """Compute ``out = op(a, b)``: on the device for device arrays, else as ``inner`` does."""
        if is_device_array(out):
            op = DeviceOp(getattr(op, "op", op), self.array_module)
        self.inner.reduce_local(op, a, b, out)

    def _wrap(self, sub):
        raise NotImplementedError


class DirectTransport(_DeviceTransport):
    """Device buffers straight to a transport whose MPI library reads device memory.

    Before each exchange that touches a device buffer the current stream is
    synchronised: kernels queued on it may still write a buffer about to be
    sent, or read one about to be overwritten, and MPI knows nothing of streams.
    """

    memory = "device, sent as it is (CUDA-aware MPI)"

    def send(self, buf, dest: int, tag: int = 0) -> None:
        """Send ``buf`` (host or device) to ``dest``."""
        self._settle(buf)
        self.inner.send(buf, dest, tag)

    def recv(self, buf, source: int, tag: int = 0) -> None:
        """Receive into ``buf`` (host or device) from ``source``."""
        self._settle(buf)
        self.inner.recv(buf, source, tag)

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0) -> None:
        """Send to ``dest`` and receive from ``source`` at once."""
        self._settle(sendbuf, recvbuf)
        self.inner.sendrecv(sendbuf, dest, recvbuf, source, tag)

    def _settle(self, *bufs) -> None:
        if any(is_device_array(b) for b in bufs):
            self.array_module.cuda.get_current_stream().synchronize()

    def _wrap(self, sub) -> "DirectTransport":
        return DirectTransport(sub, self.array_module)


class LibraryTransport(DirectTransport):
    """Device buffers straight to a library that moves device memory only: NCCL.

    :class:`DirectTransport`'s device path, and its stream synchronisation. The
    few host buffers the call layer sends (the argument agreement's signatures,
    counts) go through device copies, since NCCL refuses host memory. The
    algorithms' workspaces are device arrays (``array_module``).
    """

    memory = "device, through a library that moves device memory (NCCL)"

    def send(self, buf, dest: int, tag: int = 0) -> None:
        """Send ``buf`` (host or device) to ``dest``."""
        super().send(self._on_device(buf), dest, tag)

    def recv(self, buf, source: int, tag: int = 0) -> None:
        """Receive into ``buf`` (host or device) from ``source``."""
        landing = self._on_device(buf, copy=False)
        super().recv(landing, source, tag)
        self._back(landing, buf)

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0) -> None:
        """Send to ``dest`` and receive from ``source`` at once."""
        landing = self._on_device(recvbuf, copy=False)
        super().sendrecv(self._on_device(sendbuf), dest, landing, source, tag)
        self._back(landing, recvbuf)

    def _on_device(self, buf, copy: bool = True):
        """Return ``buf`` itself if on the device, else a device array of its bytes (or size)."""
        if is_device_array(buf):
            return buf
        xp = self.array_module
        return xp.asarray(buf) if copy else xp.empty(buf.shape, buf.dtype)

    def _back(self, landing, buf) -> None:
        if landing is not buf:  # a host buffer, received through the device
            buf[...] = self.array_module.asnumpy(landing)

    def _wrap(self, sub) -> "LibraryTransport":
        return LibraryTransport(sub, self.array_module)


class PinnedPool:
    """Page-locked host buffers, one per (role, slot), grown by size class and reused.

    A request of ``n`` bytes gets a view of a buffer of the next power of two
    (at least 4 KiB); a buffer is replaced only by a larger class, so once a
    collective has run, repeating it allocates nothing. ``allocations`` and
    ``allocated_bytes`` count what was allocated.
    """

    MIN_BYTES = 4096

    def __init__(self, xp):
        self.xp = xp
        self._buffers: dict[tuple, np.ndarray] = {}
        self.allocations = 0
        self.allocated_bytes = 0

    def get(self, role: str, slot: int, nbytes: int) -> np.ndarray:
        """Return ``nbytes`` of pinned host memory as a ``uint8`` array, for (role, slot)."""
        key = (role, slot)
        buf = self._buffers.get(key)
        if buf is None or buf.nbytes < nbytes:
            size = max(self.MIN_BYTES, 1 << max(0, nbytes - 1).bit_length())
            memory = self.xp.cuda.alloc_pinned_memory(size)
            buf = np.frombuffer(memory, np.uint8, size)  # the array keeps the memory alive
            self._buffers[key] = buf
            self.allocations += 1
            self.allocated_bytes += size
        return buf[:nbytes]


class _CopyEngine:
    """The staging path's stream, events and pinned pool, shared by a transport and its splits."""

    def __init__(self, xp):
        self.xp = xp
        self.pool = PinnedPool(xp)
        self._stream = None
        self._events: dict[tuple, Any] = {}

    @property
    def stream(self):
        if self._stream is None:
            self._stream = self.xp.cuda.Stream(non_blocking=True)
        return self._stream

    def event(self, role: str, slot: int):
        key = (role, slot)
        if key not in self._events:
            self._events[key] = self.xp.cuda.Event(disable_timing=True)
        return self._events[key]

    def follow_current_stream(self) -> None:
        """Make later copies wait for the kernels queued so far on the current stream."""
        ready = self.event("ready", 0)
        ready.record(self.xp.cuda.get_current_stream())
        self.stream.wait_event(ready)


def _pieces(nbytes: int, chunk: int) -> list[tuple[int, int]]:
    """Return the byte ranges a message of ``nbytes`` travels in (one, possibly empty, at least)."""
    count = max(1, -(-nbytes // chunk))
    return [(i * chunk, min((i + 1) * chunk, nbytes)) for i in range(count)]


class StagingTransport(_DeviceTransport):
    """Device buffers through pinned host memory, for an MPI library that reads host memory only.

    Every message longer than ``chunk_bytes`` travels as consecutive messages of
    ``chunk_bytes`` (host or device alike, so both ends cut it the same way: the
    cut depends on the byte count alone). The pieces of one message keep its tag
    and MPI delivers messages of one (source, tag) in order, so matching stays
    deterministic; step ``i`` exchanges piece ``i`` of the send and of the
    receive, so an exchange that completes whole also completes in pieces.

    Pipelining with blocking transport calls: two pinned slots per direction.
    While the host blocks in the transfer of piece ``i`` (slot ``i % 2``), the
    copy stream copies piece ``i + 1`` device-to-host into the other slot, and
    the host-to-device copy of received piece ``i`` runs while piece ``i + 1``
    is received. A slot is reused only after the event of its last copy. The
    copy stream first waits for the kernels already queued on the current
    stream; a call returns once its received bytes are on the device.

    Host buffers travel untouched (no copies), in the same pieces.
    """

    memory = "device, staged through host memory"

    def __init__(self, inner, xp=None, *, chunk_bytes: int = STAGING_CHUNK_BYTES,
                 engine: _CopyEngine | None = None):
        xp = xp if xp is not None else require_cupy("host staging")
        super().__init__(inner, xp)
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self._engine = engine if engine is not None else _CopyEngine(xp)

    @property
    def pool(self) -> PinnedPool:
        """Return the pinned buffers this transport (and its splits) reuse."""
        return self._engine.pool

    def send(self, buf, dest: int, tag: int = 0) -> None:
        """Send ``buf`` (host or device) to ``dest``."""
        self._exchange(buf, dest, None, None, tag)

    def recv(self, buf, source: int, tag: int = 0) -> None:
        """Receive into ``buf`` (host or device) from ``source``."""
        self._exchange(None, None, buf, source, tag)

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0) -> None:
        """Send to ``dest`` and receive from ``source`` at once, piece by piece."""
        self._exchange(sendbuf, dest, recvbuf, source, tag)

    def _wrap(self, sub) -> "StagingTransport":
        return StagingTransport(sub, self.array_module, chunk_bytes=self.chunk_bytes,
                                engine=self._engine)

    def _exchange(self, sendbuf, dest, recvbuf, source, tag: int) -> None:
        outgoing = None if sendbuf is None else as_bytes(sendbuf)
        incoming = None if recvbuf is None else as_bytes(recvbuf)
        out_device = outgoing is not None and is_device_array(outgoing)
        in_device = incoming is not None and is_device_array(incoming)
        sends = [] if outgoing is None else _pieces(outgoing.nbytes, self.chunk_bytes)
        recvs = [] if incoming is None else _pieces(incoming.nbytes, self.chunk_bytes)
        if not (out_device or in_device) and len(sends) <= 1 and len(recvs) <= 1:
            self._step(outgoing, dest, incoming, source, tag)
            return
        engine = self._engine
        if out_device or in_device:
            engine.follow_current_stream()
        staged = self._stage(outgoing, sends[0], 0) if sends else None
        for i in range(max(len(sends), len(recvs))):
            following = None
            if i + 1 < len(sends):  # its copy overlaps this piece's transfer
                following = self._stage(outgoing, sends[i + 1], (i + 1) % 2)
            if out_device and i < len(sends):
                engine.event("send", i % 2).synchronize()
            landing = None
            if i < len(recvs):
                start, stop = recvs[i]
                if in_device:
                    engine.event("recv", i % 2).synchronize()  # its last copy to the device is done
                    landing = engine.pool.get("recv", i % 2, stop - start)
                else:
                    landing = incoming[start:stop]
            self._step(staged if i < len(sends) else None, dest, landing, source, tag)
            if in_device and landing is not None and landing.nbytes:
                incoming[start:stop].set(landing, stream=engine.stream)
                engine.event("recv", i % 2).record(engine.stream)
            staged = following
        if in_device:
            engine.stream.synchronize()

    def _stage(self, outgoing, bounds: tuple[int, int], slot: int):
        """Return piece ``bounds`` of ``outgoing`` in host memory (its copy queued, if needed)."""
        start, stop = bounds
        if not is_device_array(outgoing):
            return outgoing[start:stop]
        engine = self._engine
        host = engine.pool.get("send", slot, stop - start)
        if stop > start:
            outgoing[start:stop].get(stream=engine.stream, out=host, blocking=False)
        engine.event("send", slot).record(engine.stream)
        return host

    def _step(self, outgoing, dest, incoming, source, tag: int) -> None:
        if outgoing is not None and incoming is not None:
            self.inner.sendrecv(outgoing, dest, incoming, source, tag)
        elif outgoing is not None:
            self.inner.send(outgoing, dest, tag)
        elif incoming is not None:
            self.inner.recv(incoming, source, tag)



def device_transport(t, x=None, *, agree: Callable[[Any, bool], bool] | None = None):
    """Return the transport that carries device arrays over ``t``: direct or staged.

    ``x`` a host array (or ``t`` a device transport already): ``t`` itself. A
    ``t`` whose library moves device memory itself, and only that (NCCL):
    :class:`LibraryTransport`. Otherwise :class:`DirectTransport` when
    :func:`cuda_aware` says so on every rank, else :class:`StagingTransport`.
    Ranks must agree, since the two cut long messages differently:
    ``agree(t, aware)`` returns whether every rank's answer is yes (a collective
    the caller supplies, as this layer has none);
    simulated ranks share a process and its answer. The result is kept in
    ``t``'s cache (:func:`~refcoll.transport.base.transport_cache`).
    """
    if isinstance(t, _DeviceTransport) or (x is not None and not is_device_array(x)):
        return t
    cache = transport_cache(t, "device")
    if "transport" in cache:
        return cache["transport"]
    xp = array_namespace(x) if x is not None else require_cupy("a device transport")
    if getattr(t, "moves_device_arrays", False):
        cache["transport"] = LibraryTransport(t, xp)
        return cache["transport"]
    aware, _ = cuda_aware()
    if t.size > 1 and not isinstance(t, SimTransport) and agree is not None:
        aware = agree(t, aware)
    wrapped = DirectTransport(t, xp) if aware else StagingTransport(t, xp)
    cache["transport"] = wrapped
    return wrapped


def _node_rank(mpi_comm) -> tuple[int, int]:
    """Return this rank's place among the ranks of ``mpi_comm`` on its node, and their count."""
    from mpi4py import MPI

    bounded_barrier(mpi_comm, "GPU selection (MPI_Comm_split_type)")
    node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, mpi_comm.Get_rank())
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def check_one_gpu_per_rank(mpi_comm) -> int:
    """Give each rank of ``mpi_comm`` its own GPU on its node; return the device number.

    NCCL needs one process per GPU. Ranks on one node (``MPI.COMM_TYPE_SHARED``)
    take devices 0, 1, ... in rank order; a node with more ranks than visible
    GPUs is an error on every rank.

    Raises:
        UsageError: some node has more ranks than GPUs (or there is no GPU).
    """
    from mpi4py import MPI

    rank = mpi_comm.Get_rank()
    local_rank, local_size = _node_rank(mpi_comm)
    cupy = cupy_or_none()
    gpus = cupy.cuda.runtime.getDeviceCount() if cupy is not None else 0
    bounded_barrier(mpi_comm, "GPU selection (MPI_Allreduce)")
    crowded = mpi_comm.allreduce(int(local_size > gpus), op=MPI.MAX)
    if crowded:
        if local_size > gpus:
            seen = (f"{gpus} GPU(s) visible" if cupy is not None
                    else f"no GPU ({gpu_unavailable_reason()})")
            raise UsageError(
                f"rank {rank}: {local_size} ranks share this node ({MPI.Get_processor_name()}) "
                f"with {seen}; NCCL needs one process per GPU: start at most {gpus} rank(s) per "
                "node, or make more GPUs visible (CUDA_VISIBLE_DEVICES)")
        raise UsageError(f"rank {rank}: another node has more ranks than GPUs; NCCL needs one "
                         "process per GPU")
    cupy.cuda.Device(local_rank).use()
    return local_rank


def use_node_gpu(mpi_comm) -> int:
    """Make GPU ``local rank mod GPUs`` current on each rank of ``mpi_comm``; return its number.

    For refcoll's own collectives, which run with several ranks on one GPU
    (slower, but correct); NCCL does not (:func:`check_one_gpu_per_rank`).

    Raises:
        UsageError: there is no usable GPU here.
    """
    cupy = require_cupy("a GPU run")
    local_rank, _ = _node_rank(mpi_comm)
    device = local_rank % cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(device).use()
    return device
