"""Persistent requests and their tag epochs: exchanges built once and run many times.

A plan (:mod:`refcoll.calls.plans`, recorded by :mod:`refcoll.transport.recorder`)
runs each of its exchanges as MPI persistent requests (``MPI_Send_init``,
``MPI_Recv_init``): a :class:`PersistentExchange`, made by the transport's
:meth:`~PersistentEpochs.persistent`. Their tags live in slots no ordinary call
uses: each plan has its own slot (:meth:`~PersistentEpochs.next_plan_slot`, in the
order every rank makes its plans), so two plans started in different orders on
different ranks can never take each other's messages: their exchanges wait for
their own, up to the deadline, instead of swapping data. The slots come one epoch
at a time: when an argument agreement fails, every rank moves the exchanges made
from then on to a fresh epoch (:meth:`~PersistentEpochs.new_persistent_epoch`), so
that a message the failed call left unmatched can never be taken by a later exchange.

Apart from the data path (:mod:`refcoll.transport.mpi`): an algorithm's send,
receive and sendrecv are posted and waited once each, and a reader of an
algorithm needs none of this; the recorder and the plans do.
"""

from __future__ import annotations

import atexit

from ..core.errors import RefcollError
from .base import TAGS_PER_CALL
from .deadline import duplicate, mpi

__all__ = ["PersistentEpochs", "PersistentExchange", "PERSISTENT_EPOCHS", "PLAN_SLOTS",
           "persistent_layout"]


#: Epochs of tag slots kept for persistent exchanges, used one at a time
#: (:meth:`PersistentEpochs.new_persistent_epoch`).
PERSISTENT_EPOCHS = 16
#: Tag slots per epoch, one per plan: plan ``k`` of a transport uses slot ``k %
#: PLAN_SLOTS`` (fewer where the library's ``MPI_TAG_UB`` leaves less room: MPI
#: guarantees only 32 slots, and then every plan shares one).
PLAN_SLOTS = 1024


def persistent_layout(slots: int) -> tuple[int, int]:
    """Return ``(epochs, plan slots per epoch)`` for a tag space of ``slots`` slots.

    At most half the slots go to persistent exchanges; ordinary calls cycle
    through the rest.
    """
    kept = slots // 2
    epochs = max(1, min(PERSISTENT_EPOCHS, kept))
    return epochs, max(1, min(PLAN_SLOTS, kept // epochs))


class PersistentEpochs:
    """:class:`~refcoll.transport.mpi.MPITransport`'s persistent exchanges and their tag epochs.

    A mixin of the transport: it uses the transport's ``comm``, ``timeout``, tag
    slots and deadline wait; :meth:`_init_persistent` sets its state.
    """

    def _init_persistent(self, epochs: int, plan_slots: int = 1) -> None:
        """Keep ``epochs`` of ``plan_slots`` tag slots each, after the ordinary calls', for
        persistent exchanges."""
        self._epochs, self._plan_slots = epochs, plan_slots
        self._epoch = 0
        self._plans_made = 0
        self._persistent_tags = self._tag_slots * TAGS_PER_CALL  # the current epoch's first
        # The communicator persistent exchanges are made on: this one, until every
        # reserved slot has had its epoch (then a duplicate, new_persistent_epoch).
        self._persistent_comm = self.comm
        self._persistent: list[PersistentExchange] = []
        self._abandoned, self._kept_comms = False, []  # see new_persistent_epoch

    def next_plan_slot(self) -> int:
        """Return the number of the plan made now on this transport (0, 1, ...).

        Every rank makes a communicator's plans in the same order (as MPI's
        ``MPI_Allreduce_init`` requires), so a plan has the same number on
        every rank, and its tags (:meth:`plan_tags`) are its own.
        """
        slot, self._plans_made = self._plans_made, self._plans_made + 1
        return slot

    def plan_tags(self, slot: int) -> int:
        """Return the first wire tag of plan ``slot``'s tag slot in the current epoch."""
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

    def new_persistent_epoch(self) -> None:
        """Move the persistent exchanges made from now on to the next reserved tag slot.

        Every rank calls it at the same point (after an argument agreement that
        every rank saw fail), so the messages a failed call left unmatched in
        the old slot can never be taken by a later exchange. Once every reserved
        slot has had its epoch, the slots would come round again to messages still
        unreceived there: instead the persistent exchanges move to a duplicate of
        the communicator (``MPI_Comm_idup``, by the deadline; every rank is here),
        where no old message can match at all. The previous duplicate is kept, not
        freed, and so is every communicator of a transport that has been here
        (:meth:`free`): MPI gives a freed communicator's context to the next one
        made, where a message a failed call left would match a receive not its own.
        """
        self._abandoned = True
        self._epoch = (self._epoch + 1) % self._epochs
        self._persistent_tags = (self._tag_slots + self._epoch * self._plan_slots) * TAGS_PER_CALL
        if self._epoch == 0:
            old, self._persistent_comm = self._persistent_comm, duplicate(
                self.comm, self.timeout, self.current_call)
            if old is not self.comm:
                self._kept_comms.append(old)  # never freed: see above


class PersistentExchange:
    """One send and/or receive over fixed buffers, built once, run many times.

    MPI's persistent requests (``MPI_Send_init``, ``MPI_Recv_init``): a run is
    ``MPI_Startall`` and the transport's deadline wait, nothing built per run.
    Made by :meth:`PersistentEpochs.persistent`.
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
        comm, message = t._persistent_comm, t._message
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
                           f"({self._waiting_for}); its plan was dropped (its communicator freed, "
                           "or a failed agreement moved the exchanges to a new tag slot)")

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
