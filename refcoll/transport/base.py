"""The Transport protocol every algorithm is written against, and the Ledger.

An algorithm sees only ``rank``, ``size``, blocking point-to-point calls on
contiguous array buffers, ``split`` and ``reduce_local``. Two transports
implement it: :class:`~refcoll.transport.mpi.MPITransport` (real processes) and
:class:`~refcoll.transport.sim.SimTransport` (threads in one process, with a
ledger of every message).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from ..core.errors import UsageError

__all__ = ["Transport", "TransportBase", "Traffic", "Ledger", "Message", "Reduction",
           "TAGS_PER_CALL", "DEFAULT_TIMEOUT", "default_timeout", "CACHE_OWNERS",
           "transport_cache", "as_bytes", "TAG_NAMES", "tag_text"]

#: Tags an algorithm may use inside one collective call: ``0 <= tag < TAGS_PER_CALL``.
TAGS_PER_CALL = 1024

#: What a tag a library layer reserves carries, for a timeout's message (by tag).
TAG_NAMES: dict[int, str] = {}


def tag_text(tag: int) -> str:
    """Return how a timeout names the exchange of ``tag``: its reserved name, or the tag."""
    return TAG_NAMES.get(tag) or f"tag {tag}"


#: Seconds a blocking wait may take when neither ``timeout=`` nor ``REFCOLL_TIMEOUT`` says.
DEFAULT_TIMEOUT = 300.0

#: Values of ``REFCOLL_TIMEOUT`` that mean "wait forever".
_FOREVER = ("0", "none", "inf", "infinity")


def default_timeout() -> float | None:
    """Return ``REFCOLL_TIMEOUT`` in seconds (``0``, ``none`` or ``inf``: wait forever), else 300.

    A number of seconds at or beyond ``threading.TIMEOUT_MAX`` (about 292 years on
    64-bit Linux; ``1e10``, ``1e400``) is more than any wait of the platform can
    hold (a lock's ``acquire`` raises ``OverflowError`` for it): it means what it
    says, wait forever, as ``0`` does.

    Raises:
        UsageError: the value is not a positive number of seconds, so that a
            typo neither crashes every rank with a traceback nor (``-1``)
            times every call out at once.
    """
    value = os.environ.get("REFCOLL_TIMEOUT")
    if value is None or not value.strip():
        return DEFAULT_TIMEOUT
    if value.strip().lower() in _FOREVER:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:  # NaN, 0 written otherwise (0.0, -0), a negative number
        raise UsageError(f"REFCOLL_TIMEOUT={value!r} is not a number of seconds: give a positive "
                         "number (for example 300), or 0 to wait forever")
    if seconds >= threading.TIMEOUT_MAX:  # beyond what a wait can hold: for ever
        return None
    return seconds


@runtime_checkable
class Transport(Protocol):
    """How bytes move between ranks: all an algorithm may use."""

    rank: int
    size: int

    def send(self, buf, dest: int, tag: int = 0) -> None:
        """Send the contiguous array ``buf`` to ``dest``; return when it may be reused."""

    def recv(self, buf, source: int, tag: int = 0) -> None:
        """Receive exactly ``buf.nbytes`` bytes from ``source`` into ``buf``."""

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0) -> None:
        """Send to ``dest`` and receive from ``source`` at once (no ordering deadlock)."""

    def split(self, color: int, key: int) -> "Transport":
        """Return the transport of the ranks that passed the same ``color``, ordered by ``key``."""

    def reduce_local(self, op, a, b, out) -> None:
        """Compute ``out = op(a, b)`` elementwise; ``out`` may be ``a`` or ``b``."""


class Traffic:
    """Bytes and messages one rank has sent and received, counted as they move.

    A transport and every transport split from it share one ``Traffic``, so a
    composite algorithm's sub-communicator messages count too. Take the
    difference of two :meth:`snapshot` values to measure one call. Two threads
    may count at once (a pipelined all-reduce's two levels), so counting holds a lock.

    A recorded program (a plan's replay) moves the same bytes at every run, so it
    takes a :class:`Meter` instead (:meth:`meter`): its runner counts a run by
    ``meter.runs += 1``, one integer and no lock, and the counts here add up the
    meters' runs when read. A plan's run is counted when it completes: one that fails
    partway (its plan abandoned) counts none of its exchanges.
    """

    __slots__ = ("_sent", "_received", "_messages_sent", "_messages_received", "_meters",
                 "_lock")

    def __init__(self) -> None:
        self._sent = self._received = self._messages_sent = self._messages_received = 0
        self._meters: list[Meter] = []
        self._lock = threading.Lock()

    def add(self, sent: int, received: int) -> None:
        """Count one exchange: ``sent`` bytes out (if any) and ``received`` bytes in (if any)."""
        with self._lock:
            if sent >= 0:
                self._sent += sent
                self._messages_sent += 1
            if received >= 0:
                self._received += received
                self._messages_received += 1

    def meter(self, exchanges) -> "Meter":
        """Return the meter of a program whose every run makes ``exchanges``, pairs of
        ``(sent, received)`` bytes each as :meth:`add` takes them; :meth:`release` it
        when the program is freed."""
        per_run = [0, 0, 0, 0]  # bytes sent, received; messages sent, received
        for sent, received in exchanges:
            for at, moved in ((0, sent), (1, received)):
                if moved >= 0:
                    per_run[at] += moved
                    per_run[at + 2] += 1
        meter = Meter(tuple(per_run))
        with self._lock:
            self._meters.append(meter)
        return meter

    def release(self, meter: "Meter") -> None:
        """Fold a freed program's runs into the counts (once; a meter not held: nothing)."""
        with self._lock:
            if meter not in self._meters:
                return
            self._meters.remove(meter)
            sent, received, messages_sent, messages_received = (
                meter.runs * moved for moved in meter.per_run)
            self._sent += sent
            self._received += received
            self._messages_sent += messages_sent
            self._messages_received += messages_received

    def _totals(self) -> tuple[int, int, int, int]:
        """Bytes sent, received; messages sent, received: the counts and every meter's runs."""
        with self._lock:
            counts = [self._sent, self._received, self._messages_sent, self._messages_received]
            for meter in self._meters:
                if meter.runs:
                    for at, moved in enumerate(meter.per_run):
                        counts[at] += meter.runs * moved
        return counts[0], counts[1], counts[2], counts[3]

    # (each a field of _totals(): bytes sent, received; messages sent, received, so far)
    sent = property(lambda self: self._totals()[0], doc="Bytes sent so far.")
    received = property(lambda self: self._totals()[1], doc="Bytes received so far.")
    messages_sent = property(lambda self: self._totals()[2], doc="Messages sent so far.")
    messages_received = property(lambda self: self._totals()[3],
                                 doc="Messages received so far.")

    def snapshot(self) -> tuple[int, int]:
        """Return ``(sent, received)`` bytes so far."""
        if not self._meters:  # (no plan: the counts alone, as they are)
            return self._sent, self._received
        sent, received, _, _ = self._totals()
        return sent, received

    def __repr__(self) -> str:
        sent, received, messages_sent, messages_received = self._totals()
        return (f"Traffic(sent={sent}, received={received}, messages_sent={messages_sent}, "
                f"messages_received={messages_received})")


class Meter:
    """One recorded program's traffic: its completed runs, and what each run moves
    (:meth:`Traffic.meter`)."""

    __slots__ = ("runs", "per_run")

    def __init__(self, per_run: tuple[int, int, int, int]):
        self.runs = 0  # counted by the program's runner: one run at a time
        self.per_run = per_run


#: Who keeps what in a transport's cache (:func:`transport_cache`), one dict each:
#: the algorithms' receive buffers by shape (``workspace``), hierarchical's node
#: split (``node_layouts``), persistent collectives and the blocking calls' kept
#: plans (``plans``, :mod:`refcoll.calls.plans`), ``auto``'s
#: agreed settings (``auto``), the device transport over a host one (``device``)
#: the cluster model's timing buffers (``model``), the engine that runs the
#: transport's non-blocking calls (``progress``) and the argument agreement's
#: signature exchange (``agreement``).
CACHE_OWNERS = ("workspace", "node_layouts", "plans", "auto", "device", "model",
                "progress", "agreement")

#: Caches of transports that are not :class:`TransportBase` (a user's own), kept
#: beside them and dropped with them.
_OTHER_CACHES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def as_bytes(buf) -> np.ndarray:
    """Return a contiguous array's memory as a flat ``uint8`` view (no copy)."""
    if not buf.flags.c_contiguous:
        raise ValueError("transport buffers must be C-contiguous (pass a contiguous view)")
    return (buf if buf.ndim == 1 else buf.reshape(-1)).view(np.uint8)


def transport_cache(t, owner: str) -> dict:
    """Return the dict ``owner`` keeps on transport ``t``: the one per-transport cache.

    What a transport keeps between calls (buffers, plans, agreed settings) lives
    here, declared in :data:`CACHE_OWNERS`, rather than in attributes each module
    invents. :class:`TransportBase` holds the caches in its ``cache`` attribute;
    any other transport gets them in a table that forgets them with it.
    """
    if owner not in CACHE_OWNERS:
        raise ValueError(f"unknown transport cache {owner!r}: declare it in CACHE_OWNERS")
    caches = getattr(t, "cache", None)
    if caches is None:
        caches = _OTHER_CACHES.setdefault(t, {})
    return caches.setdefault(owner, {})


class TransportBase:
    """Machinery both transports share: tag spaces per call and local reductions.

    Every public collective runs inside :meth:`call`, which gives it a fresh tag
    space: the tags an algorithm passes (``0 <= tag < TAGS_PER_CALL``) are offset by
    a per-call base, so messages of two consecutive calls can never match each other.
    """

    rank: int
    size: int
    _tag_slots: int = 1 << 16
    #: Whether the user's communicator was freed (``comm.Free()``): the calls outstanding
    #: then complete, and no new one may start (:meth:`MPITransport.release`).
    released: bool = False
    #: Whether two threads may communicate over this transport's library at once
    #: (MPI's ``MPI_THREAD_MULTIPLE``): a progress thread needs it.
    thread_multiple: bool = True
    #: Whether an algorithm may run phases on two of this transport's sub-transports
    #: from two threads at once (:mod:`refcoll.algorithms._pipeline`): a real library
    #: with ``MPI_THREAD_MULTIPLE``; not the simulator, whose rank threads take turns.
    concurrent_phases: bool = False
    #: Set while a progress thread runs a call over this transport: its waits may
    #: sleep between polls rather than spin (see :data:`refcoll.transport.mpi.PATIENT_POLLS`).
    patient: bool = False
    #: Whether the library moves device (CUDA) buffers itself, as NCCL does: device
    #: arrays then need neither CUDA-aware MPI nor host staging.
    moves_device_arrays: bool = False
    #: Where a call's arrays live and how its messages travel: None for host memory; a
    #: device transport's path (:mod:`refcoll.transport.device`), which ranks agree on.
    memory: str | None = None

    def __init__(self) -> None:
        self._calls = 0
        self._ops = 0  # blocking exchanges in the current call (named in timeouts)
        self._depth = 0
        self._tag_base = 0
        self.current_call: str | None = None
        self.traffic = Traffic()  # shared with every transport split from this one
        self.cache: dict[str, dict] = {}  # see transport_cache

    def call(self, name: str) -> "_CallScope":
        """Return the context of one collective call: its own tag space (nested calls share it)."""
        return _CallScope(self, name)

    def enter_call(self, name: str, tags: int | None = None) -> None:
        """Begin collective ``name`` (:meth:`call`'s scope): a new tag slot, unless nested.

        ``tags``: the first wire tag of the slot to use instead (a plan's own,
        ``plan_tags``); the call is counted all the same.
        """
        if self._depth == 0:
            self._tag_base = (self._calls % self._tag_slots) * TAGS_PER_CALL if tags is None \
                else tags
            self._calls += 1
            self._ops = 0
            self.current_call = name
        self._depth += 1

    def leave_call(self) -> None:
        """End the collective :meth:`enter_call` began."""
        self._depth -= 1
        if self._depth == 0:
            self.current_call = None

    def _wire_tag(self, tag: int) -> int:
        if not 0 <= tag < TAGS_PER_CALL:
            raise ValueError(f"tag {tag} out of range: algorithms use 0 <= tag < {TAGS_PER_CALL}")
        return self._tag_base + tag

    def reduce_local(self, op, a, b, out) -> None:
        """Compute ``out = op(a, b)`` elementwise through :meth:`refcoll.core.ops.Op.apply`."""
        op.apply(a, b, out)

    def idle(self) -> None:
        """Note that the calls outstanding on this transport are done (the progress engines
        and a plan's run started in place say so). Nothing here; an MPI transport whose
        communicator was freed meanwhile is freed now (:meth:`MPITransport.release`)."""

    def activity(self, delta: int) -> None:
        """Note a thread of this rank starting (+1) or stopping (-1) work besides waiting on it.

        Nothing for a real transport; the simulator counts it, so that its
        deadlock detector sees a rank whose main thread waits on a non-blocking
        call's handle while its progress thread runs the call.
        """


class _CallScope:
    """The context :meth:`TransportBase.call` returns.

    A plain class rather than a generator-based context manager: every call
    enters one, and for small messages the difference is measurable.
    """

    __slots__ = ("t", "name")

    def __init__(self, t: TransportBase, name: str):
        self.t, self.name = t, name

    def __enter__(self) -> None:
        self.t.enter_call(self.name)

    def __exit__(self, kind, exc, traceback) -> bool:
        self.t.leave_call()
        return False


@dataclass(frozen=True)
class Message:
    """One matched point-to-point message, in world ranks."""

    step: int
    source: int
    dest: int
    nbytes: int
    tag: int
    comm: int
    payload: bytes | None = None  # a copy of the bytes, when the world records payloads


@dataclass(frozen=True)
class Reduction:
    """One local reduction: ``elements`` combined on ``rank`` after its ``step``-th round."""

    rank: int
    elements: int
    step: int


@dataclass
class Ledger:
    """Everything that moved in a simulated world.

    ``step`` is a message's round on the critical path: one more than the later of
    the sender's and the receiver's round when each posted it (a Lamport clock
    over rendezvous). ``rounds`` is therefore the number of α terms an algorithm
    pays, and ``critical_bytes`` (the largest message of each round, summed) the
    bytes its β term pays.
    """

    messages: list[Message] = field(default_factory=list)
    reductions: list[Reduction] = field(default_factory=list)

    @property
    def total_messages(self) -> int:
        return len(self.messages)

    @property
    def total_bytes(self) -> int:
        return sum(m.nbytes for m in self.messages)

    @property
    def rounds(self) -> int:
        return max((m.step for m in self.messages), default=0)

    def bytes_sent(self) -> dict[int, int]:
        """Return bytes sent per world rank."""
        out: dict[int, int] = defaultdict(int)
        for m in self.messages:
            out[m.source] += m.nbytes
        return dict(out)

    def bytes_received(self) -> dict[int, int]:
        """Return bytes received per world rank."""
        out: dict[int, int] = defaultdict(int)
        for m in self.messages:
            out[m.dest] += m.nbytes
        return dict(out)

    def messages_sent(self) -> dict[int, int]:
        """Return messages sent per world rank."""
        return dict(Counter(m.source for m in self.messages))

    def reduced_elements(self) -> dict[int, int]:
        """Return elements combined by local reductions, per world rank."""
        out: dict[int, int] = defaultdict(int)
        for r in self.reductions:
            out[r.rank] += r.elements
        return dict(out)

    @property
    def max_rank_bytes(self) -> int:
        return max(self.bytes_sent().values(), default=0)

    @property
    def max_rank_messages(self) -> int:
        return max(self.messages_sent().values(), default=0)

    @property
    def max_rank_reduced(self) -> int:
        return max(self.reduced_elements().values(), default=0)

    @property
    def critical_bytes(self) -> int:
        """Sum over rounds of the largest message in that round."""
        largest: dict[int, int] = defaultdict(int)
        for m in self.messages:
            largest[m.step] = max(largest[m.step], m.nbytes)
        return sum(largest.values())

    def split_bytes(self, same_group) -> tuple[int, int]:
        """Return ``(inside, across)`` bytes, by ``same_group(source, dest)``."""
        inside = across = 0
        for m in self.messages:
            if same_group(m.source, m.dest):
                inside += m.nbytes
            else:
                across += m.nbytes
        return inside, across

    def counts(self) -> dict:
        """Return the counts a :class:`~refcoll.core.cost.Cost` predicts, under its field names."""
        return {
            "rounds": self.rounds,
            "messages": self.total_messages,
            "bytes": self.total_bytes,
            "max_rank_messages": self.max_rank_messages,
            "max_rank_bytes": self.max_rank_bytes,
            "critical_bytes": self.critical_bytes,
            "reduced": self.max_rank_reduced,
        }

    def summary(self) -> dict:
        """Return the ledger's totals as a JSON-ready dict."""
        return {
            "messages": self.total_messages,
            "bytes": self.total_bytes,
            "rounds": self.rounds,
            "critical_bytes": self.critical_bytes,
            "max_rank_bytes": self.max_rank_bytes,
            "max_rank_messages": self.max_rank_messages,
            "max_rank_reduced": self.max_rank_reduced,
            "bytes_sent": {str(k): v for k, v in sorted(self.bytes_sent().items())},
            "messages_sent": {str(k): v for k, v in sorted(self.messages_sent().items())},
        }
