"""The third transport: ``torch.distributed``'s tagged point-to-point calls.

Every refcoll algorithm runs unchanged over a ``torch.distributed`` process group:
Gloo moves CPU buffers, NCCL moves CUDA buffers. No MPI is needed, so refcoll's
collectives run under ``torchrun``; under ``mpiexec`` the same processes start a
group with :func:`refcoll.torch.init_process_group`.

How the MPI transport's guarantees carry over:

* **Bytes, zero-copy.** A NumPy buffer becomes a ``uint8`` tensor over the same
  memory (``torch.from_numpy``); a CuPy buffer, through DLPack
  (``torch.from_dlpack``). Every dtype moves unchanged, bfloat16 and float8
  included, because the wire sees bytes.
* **Isolation.** MPI isolates a library's messages with a duplicated communicator;
  creating a torch group is a blocking collective over the whole world, so this
  transport tags instead. Gloo keeps point-to-point tags apart from its
  collectives, and refcoll's tags start at :data:`TAG_ROOT` (2**30), above the
  small tags applications use; each split gets a context of its own
  (:data:`CONTEXT_SPAN` tags), and each call a slot of ``TAGS_PER_CALL`` tags in
  it, as on MPI. A split builds no torch group either: it is a view of the ranks
  of its parent's group, agreed with point-to-point messages under the deadline.
  NCCL ignores tags and matches a pair's messages in issue order, which refcoll's
  calls respect (every rank issues them in the same order).
* **Deadlines.** Each wait is ``Work.wait(timeout)`` with what is left of the
  deadline (``REFCOLL_TIMEOUT``, 300 s by default): a peer that never comes is a
  :class:`~refcoll.core.errors.CollectiveTimeout` naming the exchange. Gloo
  closes the connection to that peer when a wait times out, so the group is
  unusable afterwards, as an NCCL communicator is after its watchdog fires.
  Gloo's ``Work.is_completed()`` stays false for point-to-point work, so waits
  block in C++ (without the GIL) rather than poll.
* **Byte counts.** Gloo cannot report how many bytes a receive got, and a message
  longer than the posted buffer aborts the receiving process inside Gloo. The
  argument agreement (fixed-size records, exchanged before any data moves) is
  what keeps mismatched sizes off the wire, so ``validate=False`` is the caller's
  promise that every rank passes the same count and dtype.
"""

from __future__ import annotations

import atexit
import functools
import socket
import sys
import time
import warnings
import zlib
from datetime import timedelta

import numpy as np

from ..core.errors import PeerFailure, UsageError
from ..core.xp import is_device_array
from .base import TAGS_PER_CALL, TransportBase, as_bytes, default_timeout, tag_text
from .deadline import timed_out

__all__ = ["TorchTransport", "torch_transport_for", "is_process_group", "TAG_ROOT",
           "CONTEXT_SPAN", "CONTEXTS", "forget_groups"]

#: The first tag refcoll uses on a torch group: applications' own tags stay below.
TAG_ROOT = 1 << 30

#: Calls whose tag slots a transport cycles through (``TAGS_PER_CALL`` tags each).
CALL_SLOTS = 1024

#: Tags of one transport (a group, or a split of one): its calls' slots.
CONTEXT_SPAN = CALL_SLOTS * TAGS_PER_CALL

#: Contexts below 2**31, torch's largest tag. Splits reuse them in a cycle, as MPI
#: reuses context ids: two live transports of the same ranks collide only after
#: this many splits.
CONTEXTS = ((1 << 31) - TAG_ROOT) // CONTEXT_SPAN

#: A reserved tag of each call's slot: the ranks' records when a transport splits.
_SPLIT_TAG = TAGS_PER_CALL - 1


@functools.cache
def _dist():
    import torch.distributed as dist  # imported lazily: torch is an optional extra

    return dist


def _torch():
    import torch

    return torch


def is_process_group(obj) -> bool:
    """Return whether ``obj`` is a ``torch.distributed`` process group (torch loaded or not)."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and isinstance(obj, dist.ProcessGroup)


def _quietly_from_numpy(a: np.ndarray):
    """Return a tensor over ``a``'s memory; a read-only send buffer gives no warning.

    Torch warns that writing through a tensor of a read-only array is undefined;
    a send only reads it.
    """
    torch = _torch()
    if a.flags.writeable:
        return torch.from_numpy(a)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


class TorchTransport(TransportBase):
    """A :class:`~refcoll.transport.base.Transport` over a ``torch.distributed`` group.

    Args:
        group: a process group; ``None`` means the default (world) group, which
            ``torch.distributed.init_process_group`` (or
            :func:`refcoll.torch.init_process_group`) must have made.
        timeout: seconds any one wait may take before
            :class:`~refcoll.core.errors.CollectiveTimeout`; default
            ``REFCOLL_TIMEOUT`` or 300 (``REFCOLL_TIMEOUT=0``: wait forever).

    ``backend`` is the group's (``"gloo"`` or ``"nccl"``); ``device`` is ``"cpu"``
    for Gloo, the current CUDA device for NCCL.
    """

    def __init__(self, group=None, *, timeout: float | None = None):
        super().__init__()
        dist = _dist()
        if not dist.is_available() or not dist.is_initialized():
            raise UsageError("torch.distributed is not initialized: call "
                             "refcoll.torch.init_process_group() (under torchrun or mpiexec) "
                             "or torch.distributed.init_process_group first")
        self.group = dist.group.WORLD if group is None else group
        members = dist.get_process_group_ranks(self.group)
        me = dist.get_rank()
        if me not in members:
            raise UsageError(f"global rank {me} is not a member of the process group it "
                             f"was given (ranks {members})")
        self.backend = str(dist.get_backend(self.group)).lower()
        self.timeout = timeout if timeout is not None else default_timeout()
        self._peers = list(range(len(members)))  # my ranks -> ranks of self.group
        self.rank, self.size = members.index(me), len(members)
        self._context = 0
        self._family = {"next": 1}  # shared with every split: the next context to offer
        self.device = "cpu"
        self.nccl = self.backend == "nccl"
        if self.nccl:
            self.device = f"cuda:{_torch().cuda.current_device()}"
        self.moves_device_arrays = self.nccl  # no staging: NCCL moves device memory itself
        # Gloo and NCCL accept calls from several threads, as MPI_THREAD_MULTIPLE does.
        self.thread_multiple = True
        self._raw = None  # a library group torch did not register: see over_backend

    @classmethod
    def over_backend(cls, backend, rank: int, size: int, *, kind: str,
                     timeout: float | None = None) -> "TorchTransport":
        """Return a transport over a library group torch has not registered.

        ``backend`` is a ``ProcessGroupGloo`` (``kind="gloo"``) or
        ``ProcessGroupNCCL`` (``kind="nccl"``) made directly from a store, as the
        ``"refcoll"`` backend makes its own (:mod:`refcoll.torch.backend`): its
        ``send``/``recv`` name peers by the group's ranks, and no
        ``torch.distributed`` call needs to know the group.
        """
        t = cls.__new__(cls)
        TransportBase.__init__(t)
        t.group, t._raw, t.backend = None, backend, kind
        t.timeout = timeout if timeout is not None else default_timeout()
        t._peers = list(range(size))
        t.rank, t.size = rank, size
        t._context, t._family = 0, {"next": 1}
        t.nccl = kind == "nccl"
        t.device = f"cuda:{_torch().cuda.current_device()}" if t.nccl else "cpu"
        t.moves_device_arrays = t.nccl
        t.thread_multiple = True
        return t

    def __repr__(self) -> str:
        return f"TorchTransport(rank={self.rank}, size={self.size}, backend={self.backend!r})"

    # -------------------------------------------------------------- buffers

    def tensor(self, buf):
        """Return ``buf``'s bytes as a flat ``uint8`` tensor over the same memory."""
        if is_device_array(buf):
            if not self.nccl:
                raise UsageError(f"rank {self.rank}: a CUDA buffer on a {self.backend} group: "
                                 "Gloo moves CPU tensors only; move it to the CPU or use an "
                                 "NCCL group")
            import cupy

            return _torch().from_dlpack(buf.reshape(-1).view(cupy.uint8))
        if self.nccl:
            raise UsageError(f"rank {self.rank}: a CPU buffer on an NCCL group: NCCL moves "
                             "CUDA tensors only; use a Gloo group for CPU tensors")
        return _quietly_from_numpy(as_bytes(buf))

    def _wire(self, tag: int) -> int:
        return TAG_ROOT + self._context * CONTEXT_SPAN + self._wire_tag(tag)

    # ------------------------------------------------------- point to point

    def _isend(self, buf, dest: int, wire: int):
        if self._raw is not None:
            return self._raw.send([self.tensor(buf)], self._peers[dest], wire)
        return _dist().isend(self.tensor(buf), group=self.group, group_dst=self._peers[dest],
                             tag=wire)

    def _irecv(self, buf, source: int, wire: int):
        if self._raw is not None:
            return self._raw.recv([self.tensor(buf)], self._peers[source], wire)
        return _dist().irecv(self.tensor(buf), group=self.group, group_src=self._peers[source],
                             tag=wire)

    def send(self, buf, dest: int, tag: int = 0) -> None:
        what = lambda: f"to send {buf.nbytes} B to rank {dest} ({tag_text(tag)})"  # noqa: E731
        self._finish(self._posted(what, lambda: [self._isend(buf, dest, self._wire(tag))]), what)
        self.traffic.add(buf.nbytes, -1)

    def recv(self, buf, source: int, tag: int = 0) -> None:
        what = lambda: (f"to receive {buf.nbytes} B from rank {source} "  # noqa: E731
                        f"({tag_text(tag)})")
        self._finish(self._posted(what, lambda: [self._irecv(buf, source, self._wire(tag))]),
                     what)
        self.traffic.add(-1, buf.nbytes)

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0) -> None:
        wire = self._wire(tag)
        what = lambda: (f"to receive {recvbuf.nbytes} B from rank {source} and send "  # noqa: E731
                        f"{sendbuf.nbytes} B to rank {dest} ({tag_text(tag)})")
        self._finish(self._posted(what, lambda: self._pair(sendbuf, dest, recvbuf, source, wire)),
                     what)
        self.traffic.add(sendbuf.nbytes, recvbuf.nbytes)

    def _pair(self, sendbuf, dest: int, recvbuf, source: int, wire: int) -> list:
        """Post a receive and a send at once (in one group call for NCCL)."""
        if self.nccl and self._raw is not None:  # one NCCL group call, on the group itself
            self._raw._group_start()
            try:
                return [self._irecv(recvbuf, source, wire), self._isend(sendbuf, dest, wire)]
            finally:
                self._raw._group_end()
        if self.nccl:  # NCCL needs the pair in one group call, or the ranks deadlock
            dist = _dist()
            return dist.batch_isend_irecv([
                dist.P2POp(dist.irecv, self.tensor(recvbuf), group=self.group,
                           group_peer=self._peers[source], tag=wire),
                dist.P2POp(dist.isend, self.tensor(sendbuf), group=self.group,
                           group_peer=self._peers[dest], tag=wire)])
        return [self._irecv(recvbuf, source, wire), self._isend(sendbuf, dest, wire)]

    def _posted(self, waiting_for, post) -> list:
        """Return the works ``post()`` posts; a peer already gone (gloo raises as the work is
        posted, not only as it is waited for) is refcoll's error, as in :meth:`_finish`."""
        try:
            return post()
        except RuntimeError as exc:
            self._ops += 1
            self._failed(exc, waiting_for)

    def _finish(self, works: list, waiting_for) -> None:
        """Wait for ``works`` by the deadline; a timeout or a lost peer is refcoll's error."""
        self._ops += 1
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        for work in works:
            try:
                if deadline is None:
                    work.wait()
                else:
                    left = max(deadline - time.monotonic(), 1e-3)
                    work.wait(timedelta(seconds=left))
            except RuntimeError as exc:
                self._failed(exc, waiting_for)
        if self.nccl:  # the host may reuse the buffers only once the GPU is done with them
            _torch().cuda.current_stream().synchronize()

    def _failed(self, exc: RuntimeError, waiting_for):
        where = (f"rank {self.rank}: {self.current_call or 'point-to-point'} over torch "
                 f"({self.backend})")
        text = str(exc)
        if "timed out" in text.lower() or "timeout" in text.lower():
            timed_out(f"{where} timed out after {self.timeout:g} s at its exchange {self._ops} "
                      f"of this call, still waiting {waiting_for()}; that rank may be dead, "
                      "slow, or in a different call (set REFCOLL_TIMEOUT to wait longer; "
                      f"{self.backend} has closed the connection, so this group is done)")
        raise PeerFailure(f"{where} failed at its exchange {self._ops} of this call, waiting "
                          f"{waiting_for()}: {text.splitlines()[0] if text else exc!r} "
                          "(a peer process may have died)") from exc

    # ------------------------------------------------------------ splitting

    def split(self, color: int, key: int) -> "TorchTransport | None":
        """Return the transport of the ranks that passed ``color``, ordered by ``key``.

        No torch group is made: the ranks exchange ``(color, key, context)``
        with point-to-point messages under the deadline, and the result is a
        view of this group's ranks with a context (tag range) every member
        agrees on: the largest its members offer, so none of them uses it yet.
        """
        color = -1 if color is None or color < 0 else int(color)
        mine = np.array([color, int(key), self._family["next"]], np.int64)
        table = np.empty((self.size, 3), np.int64)
        table[self.rank] = mine
        with self.call("split"):
            for shift in range(1, self.size):
                source = (self.rank - shift) % self.size
                self.sendrecv(mine, (self.rank + shift) % self.size, table[source], source,
                              _SPLIT_TAG)
        if color < 0:
            return None
        members = sorted((int(k), r) for r, (c, k, _) in enumerate(table) if c == color)
        context = max(int(table[r, 2]) for _, r in members)
        self._family["next"] = context + 1
        child = TorchTransport.__new__(TorchTransport)
        TransportBase.__init__(child)
        child.group, child.backend, child.timeout = self.group, self.backend, self.timeout
        child._raw = self._raw
        child.nccl, child.device, child.thread_multiple = self.nccl, self.device, True
        child.moves_device_arrays = self.moves_device_arrays
        child._peers = [self._peers[r] for _, r in members]
        child.rank = [r for _, r in members].index(self.rank)
        child.size = len(members)
        child._context = context % CONTEXTS
        child._family = self._family
        child.traffic = self.traffic
        return child

    def split_node(self) -> "TorchTransport":
        """Return the transport of the ranks on this host (by host name)."""
        color = zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF
        return self.split(color, self.rank)

    def unreceived(self) -> list[str]:
        """Return nothing: torch has no probe, so a message left unreceived cannot be seen."""
        return []

    def free(self) -> None:
        """Nothing to free: the transport made no group of its own."""


#: Transports by process group, so repeated calls on one group share one.
_BY_GROUP: dict = {}


@atexit.register
def forget_groups() -> None:
    """Drop the cached transports while torch is whole: a group ``destroy_process_group``
    ended is then freed here, not in the interpreter's teardown after torch's own."""
    _BY_GROUP.clear()


def torch_transport_for(group=None) -> TorchTransport:
    """Return the cached :class:`TorchTransport` of ``group`` (``None``: the default group).

    A group of refcoll's own backend (``"refcoll"``) gives the transport its calls run on
    (``refcoll_transport()``): refcoll's functions and DDP hooks named by that group then
    queue in issue order with its collectives, on one engine and one set of tags, as
    the calls of one MPI communicator do.
    """
    dist = _dist()
    if not dist.is_available() or not dist.is_initialized():
        return TorchTransport(group)  # raises the usage error
    group = dist.group.WORLD if group is None else group
    own = getattr(group, "refcoll_transport", None)
    if callable(own):  # a "refcoll" group: the transport its own calls run on, not a
        return own()  # second one on the same library group and the same tags
    key = (id(group), dist.get_rank())
    found = _BY_GROUP.get(key)
    if found is None or found.group is not group:
        found = _BY_GROUP[key] = TorchTransport(group)
    return found
