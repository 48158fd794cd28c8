"""Faults: a rank revokes a communicator's transport, and its peers read the notice.

A rank that cannot go on with a communicator's calls (a plan misused on it
alone) revokes the transport (:meth:`Revocable.revoke`, as ULFM's
``MPI_Comm_revoke``): a notice goes to every other rank, whose next wait that
cannot complete reads it and raises :class:`~refcoll.core.errors.PeerFailure`
naming the rank and the reason, instead of waiting for its deadline.

Apart from the data path (:mod:`refcoll.transport.mpi`), whose waits only ask
whether the current call is revoked, and apart from the deadline
(:mod:`refcoll.transport.deadline`): a deadline bounds a wait for a rank that
never answers; a revocation is a rank that answers, to say it will not come.
"""

from __future__ import annotations

import numpy as np

from ..core.errors import PeerFailure
from .deadline import mpi

__all__ = ["Revocable", "NOTICE_BYTES", "NOTICE_POLLS"]


#: Bytes of a revocation notice (:meth:`Revocable.revoke`): UTF-8 text, zero-padded.
NOTICE_BYTES = 512

#: Tests of a cancelled request before it is taken as one MPI cannot cancel (matched).
CANCEL_POLLS = 1000

#: Polls of a wait between two looks for a revocation notice (an MPI_Iprobe: made at
#: every poll, it slowed the battery by a third with more ranks than cores).
NOTICE_POLLS = 64


class Revocable:
    """Revocation of :class:`~refcoll.transport.mpi.MPITransport`: its notices, sent and read.

    A mixin of the transport: it uses the transport's ``comm``, ``rank``, ``size``,
    ``current_call`` and count of calls; :meth:`_init_revocation` sets its state.
    """

    def _init_revocation(self, notice_tag: int) -> None:
        """Begin unrevoked, with notices sent and read on ``notice_tag`` (a tag no call uses)."""
        self._notice_tag = notice_tag
        self.revoked: str | None = None  # why, once this rank or a peer revoked the transport
        self._revoked_at = 0  # the call revoked: calls before it still complete
        self._notice, self._notice_status = np.zeros(NOTICE_BYTES, np.uint8), mpi().Status()
        self._notices_sent: list = []
        self._stranded: list = []  # requests of timed-out calls MPI could not cancel
        self._persistent_sends: set[int] = set()  # ids of live MPI_Send_init requests

    def _give_up(self, reqs: list, reason: str) -> None:
        """Leave nothing of a call that timed out to complete behind this rank's back.

        Its requests still waiting are withdrawn (:meth:`_withdraw`: cancelled, or kept
        with their buffers), so no late message lands in, and no late send reads from,
        memory the program has freed and reused. The transport is revoked from this
        very call on (:meth:`revoke`): a late peer's wait in it raises
        :class:`~refcoll.core.errors.PeerFailure` instead of completing with what this
        rank writes next, and no later call takes the call's late messages.
        """
        self._withdraw(reqs)
        self.revoke(reason, this_call=True)

    def revoke(self, reason: str, *, this_call: bool = False) -> None:
        """Tell every other rank that this rank cannot go on with this transport's calls.

        ULFM's ``MPI_Comm_revoke``: a notice of ``reason`` goes to every other
        rank; a peer waiting in this rank's next call (the one it refuses; with
        ``this_call``, the call this rank is in, which timed out) or a later one,
        for a message this rank will never send, reads it and raises
        :class:`~refcoll.core.errors.PeerFailure` at once. From that call on
        every exchange on the transport, here and there, raises: what was in
        flight cannot be told apart from what is new. A peer still finishing an
        earlier call (this rank finished it) is left to finish it.
        """
        if self.revoked is not None:
            return
        self.revoked, self._revoked_at = reason, self._calls - (1 if this_call else 0)
        if self.size == 1 or self.comm is None:  # alone, or its communicator freed: no one to tell
            return
        MPI = mpi()
        text = np.zeros(NOTICE_BYTES, np.uint8)
        data = f"{self._revoked_at} {reason}".encode()[:NOTICE_BYTES]
        text[:len(data)] = np.frombuffer(data, np.uint8)
        self._notices_sent.extend(self.comm.Isend([text, MPI.BYTE], peer, self._notice_tag)
                                  for peer in range(self.size) if peer != self.rank)
        self._notices_sent.append(text)  # MPI reads it until the sends complete

    def _noticed(self) -> bool:
        """Return whether a peer's revocation notice has come (its reason now in ``revoked``).

        Probed for, not received into a standing request: only a wait that is
        not complete at once looks, and a transport dropped without
        ``free`` leaves nothing posted behind.
        """
        if self.size == 1 or self.revoked is not None:
            return False
        MPI, status = mpi(), self._notice_status
        if not self.comm.Iprobe(MPI.ANY_SOURCE, self._notice_tag, status):
            return False
        self.comm.Recv([self._notice, MPI.BYTE], status.Get_source(), self._notice_tag, status)
        notice = self._notice.tobytes().rstrip(bytes(1)).decode(errors="replace")
        at, _, text = notice.partition(" ")
        self.revoked = f"rank {self._notice_status.Get_source()} revoked the communicator: {text}"
        self._revoked_at = int(at)
        return True

    def _stopped(self) -> bool:
        """Return whether the current call is revoked (a peer's notice read, if one came)."""
        if self.revoked is None:
            self._noticed()
        return self.revoked is not None and self._calls > self._revoked_at

    def _check_revoked(self) -> None:
        """Raise if this transport is revoked for the current call (a notice read first)."""
        if self._stopped():
            raise PeerFailure(f"rank {self.rank}: {self.current_call or 'a call'} cannot "
                              f"complete: {self.revoked}")

    def _release_notices(self) -> None:
        """Release the revocation notices sent (an active send completes on its own)."""
        for sent in self._notices_sent:
            if hasattr(sent, "Free"):
                sent.Free()
        self._notices_sent = []

    def _withdraw(self, reqs: list) -> None:
        """Cancel the requests among ``reqs`` still waiting (``MPI_Cancel``, sends too): their
        call is abandoned. One MPI cannot cancel at once (a send already matched, whose
        peer does not take it) is not waited for, which could be for ever: it is kept, and
        its buffer with it, as long as the transport lives (:attr:`_stranded`), so MPI
        never writes into or reads from memory the program has freed and reused. A
        persistent send (a plan's) is kept without being cancelled: MPICH 5 ends the
        process (SIGSEGV) cancelling one that is past its eager size, and a send only
        reads its buffer, which its plan holds."""
        MPI = mpi()
        for req in reqs:
            try:
                if req.Test():
                    continue
                if id(req) in self._persistent_sends:
                    self._stranded.append(req)
                    continue
                req.Cancel()
                if not any(req.Test() for _ in range(CANCEL_POLLS)):
                    self._stranded.append(req)  # the request keeps its buffer alive
            except MPI.Exception:
                self._stranded.append(req)  # completed in error, or unknown: kept
