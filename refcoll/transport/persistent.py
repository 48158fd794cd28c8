"""Persistent requests and their tag slots: exchanges built once and run many times.

A plan (:mod:`refcoll.calls.plans`, recorded by :mod:`refcoll.transport.recorder`)
runs each of its exchanges as MPI persistent requests (``MPI_Send_init``,
``MPI_Recv_init``): a :class:`PersistentExchange`, made by the transport's
:meth:`~PersistentSlots.persistent`. Their tags live in slots no ordinary call
uses: each plan has its own slot (:meth:`~PersistentSlots.next_plan_slot`, in the
order every rank makes its plans), so two plans started in different orders on
different ranks can never take each other's messages: their exchanges wait for
their own, up to the deadline, instead of swapping data.

Apart from the data path (:mod:`refcoll.transport.mpi`): an algorithm's send,
receive and sendrecv are posted and waited once each, and a reader of an
algorithm needs none of this; the recorder and the plans do.
"""

from __future__ import annotations

import atexit

from ..core.errors import RefcollError
from .base import TAGS_PER_CALL
from .deadline import mpi

__all__ = ["PersistentSlots", "PersistentExchange", "PLAN_SLOTS", "plan_slots"]


#: Tag slots kept for plans, one each: plan ``k`` of a transport uses slot ``k %
#: PLAN_SLOTS`` (fewer where the library's ``MPI_TAG_UB`` leaves less room: MPI
#: guarantees only 32 slots of all kinds, and then plans take turns in 15).
PLAN_SLOTS = 16384


def plan_slots(slots: int) -> int:
    """Return how many of a tag space's ``slots`` go to plans: at most half; ordinary calls
    cycle through the rest."""
    return max(1, min(PLAN_SLOTS, slots // 2))


class PersistentSlots:
    """:class:`~refcoll.transport.mpi.MPITransport`'s persistent exchanges and their tag slots.

    A mixin of the transport: it uses the transport's ``comm``, ``timeout``, tag
    slots and deadline wait; :meth:`_init_persistent` sets its state.
    """

    def _init_persistent(self, plan_slots: int) -> None:
        """Keep ``plan_slots`` tag slots, after the ordinary calls', for plans."""
        self._plan_slots = plan_slots
        self._plans_made = 0
        self._persistent_tags = self._tag_slots * TAGS_PER_CALL  # the first plan slot's
        self._persistent: list[PersistentExchange] = []

    def next_plan_slot(self) -> int:
        """Return the number of the plan made now on this transport (0, 1, ...).

        Every rank makes a communicator's plans in the same order (as MPI's
        ``MPI_Allreduce_init`` requires), so a plan has the same number on
        every rank, and its tags (:meth:`plan_tags`) are its own.
        """
        slot, self._plans_made = self._plans_made, self._plans_made + 1
        return slot

    def plan_tags(self, slot: int) -> int:
        """Return the first wire tag of plan ``slot``'s tag slot."""
        return self._persistent_tags + (slot % self._plan_slots) * TAGS_PER_CALL

    def persistent(self, sends, recvs, what: str = "persistent",
                   slot: int = 0) -> "PersistentExchange":
        """Return one exchange over fixed buffers, as MPI persistent requests.

        ``sends`` and ``recvs`` are lists of ``(buf, peer, tag)`` (at most one
        of each); calling the result runs the exchange, as :meth:`sendrecv`
        would, with the same deadline and byte-count check. The buffers must
        stay alive and in place while it exists. Its tags live in plan
        ``slot``'s tag slot (:meth:`plan_tags`), which no ordinary call uses; the
        ranks run a plan's exchanges in the same order. ``what`` names the
        exchange in a timeout's message.
        """
        exchange = PersistentExchange(self, sends, recvs, what, slot)
        self._persistent.append(exchange)
        return exchange


class PersistentExchange:
    """One send and/or receive over fixed buffers, built once, run many times.

    MPI's persistent requests (``MPI_Send_init``, ``MPI_Recv_init``): a run is
    ``MPI_Startall`` and the transport's deadline wait, nothing built per run.
    Made by :meth:`PersistentSlots.persistent`.
    """

    def __init__(self, t, sends, recvs, what: str = "persistent", slot: int = 0):
        if len(sends) > 1 or len(recvs) > 1:
            raise ValueError("a persistent exchange holds at most one send and one receive")
        base = t.plan_tags(slot)
        for _, _, tag in (*sends, *recvs):
            if not 0 <= tag < TAGS_PER_CALL:
                raise ValueError(f"tag {tag} out of range: algorithms use 0 <= tag < "
                                 f"{TAGS_PER_CALL}")
        self._t = t
        # The receive comes first: its status is the one the byte count is read from.
        comm, message = t.comm, t._message
        self._requests = ([comm.Recv_init(message(buf), peer, base + tag)
                           for buf, peer, tag in recvs]
                          + [comm.Send_init(message(buf), peer, base + tag)
                             for buf, peer, tag in sends])
        self._buffers = [buf for buf, _, _ in (*sends, *recvs)]  # MPI writes and reads them
        t._persistent_sends.update(id(req) for req in self._requests[len(recvs):])
        self._received = recvs[0][0].nbytes if recvs else -1
        self._source = recvs[0][1] if recvs else None
        self._sent = sends[0][0].nbytes if sends else -1
        waits = ([f"to receive {buf.nbytes} B from {t.peer(peer)}" for buf, peer, _ in recvs]
                 + [f"to send {buf.nbytes} B to {t.peer(peer)}" for buf, peer, _ in sends])
        self._waiting_for = " and ".join(waits) + f" ({what})"
        _UNFREED.add(self)

    def __call__(self) -> None:
        """Run the exchange once; return when its buffers may be read and reused."""
        if not self._requests:
            self._freed()
        mpi().Prequest.Startall(self._requests)
        self.finish()

    def _freed(self):
        """Refuse to run a freed exchange: with no requests it would "complete" moving nothing."""
        raise RefcollError(f"rank {self._t.rank}: a freed persistent exchange was run "
                           f"({self._waiting_for}); its plan was freed, or its communicator")

    def finish(self) -> None:
        """Complete an exchange begun with :meth:`start`, as :meth:`__call__` does after it."""
        t = self._t
        t._finish(self._requests, self._describe)
        if self._source is not None:
            t._check_count(self._received, self._source)
        t.traffic.add(self._sent, self._received)

    def cancel(self) -> None:
        """Withdraw an exchange begun with :meth:`start` and free it: its call is abandoned.

        A receive not yet matched is cancelled (``MPI_Cancel``) and completed; a
        send is freed and completes on its own (MPI's rule for active requests).
        """
        if self._source is not None:  # the receive is the first request
            receive = self._requests[0]
            try:
                if not receive.Test():
                    receive.Cancel()
                    receive.Wait()
            except mpi().Exception:
                pass  # it completed in error (a message too long): it is no longer active
        self.free()

    def start(self) -> None:
        """Start the exchange and return at once (:meth:`test` completes it): a schedule's step."""
        if not self._requests:
            self._freed()
        mpi().Prequest.Startall(self._requests)
        self._deadline = self._t.deadline()

    def test(self) -> bool:
        """Return whether the started exchange has completed, checking it as ``__call__`` does.

        Past the transport's deadline (counted from :meth:`start`) it times out
        as a blocking wait would, its receive withdrawn and the call revoked, so a
        late peer raises PeerFailure rather than completing with what this rank
        writes next (:meth:`~refcoll.transport.mpi.MPITransport._look`).
        """
        t = self._t
        if not mpi().Request.Testall(self._requests, t._statuses):
            t._look(self._requests, self._describe, self._deadline)
            return False
        if self._source is not None:
            t._check_count(self._received, self._source)
        t.traffic.add(self._sent, self._received)
        return True

    def _describe(self) -> str:
        return self._waiting_for

    def free(self) -> None:
        """Free the requests; a running one is freed once it completes (MPI's rule)."""
        for req in self._requests:
            self._t._persistent_sends.discard(id(req))
            req.Free()
        self._requests = []
        _UNFREED.discard(self)
        if self in self._t._persistent:
            self._t._persistent.remove(self)


#: Persistent exchanges not yet freed. MPICH warns about persistent requests left
#: at MPI_Finalize, which mpi4py runs after Python's exit handlers: free them there.
_UNFREED: set[PersistentExchange] = set()


@atexit.register
def _free_persistent() -> None:
    if _UNFREED and not mpi().Is_finalized():
        for exchange in list(_UNFREED):
            exchange.free()
