"""Segments through three phases, the middle one on a second thread: a two-level pipeline.

A two-level all-reduce moves every byte through the node (phase 1), across the
network (phase 2) and through the node again (phase 3). Run one after another,
the network idles while the node works, and the node while the network does.
Cut into ``S`` segments, segment ``s+1``'s first phase and segment ``s-1``'s last
run while segment ``s`` crosses the network, as NCCL's chunks move through its
steps: the time tends to the slowest phase's, not the sum of the three.

:func:`run_pipelined` gives the middle phases to a thread of their own when the
transport can run two phases at once (:attr:`concurrent_phases`, a real library
with ``MPI_THREAD_MULTIPLE``); the phases use different transports (the node's,
the cross-node one), so the two threads never share a communicator. Elsewhere
(the simulator, whose rank threads take turns) the segments run one after
another. Each segment's arithmetic is the same either way, so are the bits.
"""

from __future__ import annotations

import threading

__all__ = ["run_pipelined", "concurrent_phases"]


def concurrent_phases(t) -> bool:
    """Return whether two of ``t``'s sub-transports may run phases on two threads at once."""
    return bool(getattr(t, "concurrent_phases", False))


def run_pipelined(t, segments: int, first, middle, last) -> None:
    """Run ``first(s)``, ``middle(s)``, ``last(s)`` for each segment ``s`` in ``range(segments)``.

    Segment ``s``'s phases run in that order. With :func:`concurrent_phases`, the
    ``middle`` phases run on a second thread, in segment order, while this thread
    runs the ``first`` phases and then each ``last`` as soon as its segment's
    ``middle`` is done. An error in either thread is raised here; a failing
    ``first`` or ``last`` leaves the other thread to its transport's deadline.
    """
    if segments == 1 or not concurrent_phases(t):
        for s in range(segments):
            first(s)
            middle(s)
            last(s)
        return
    ready = [threading.Event() for _ in range(segments)]
    done = [threading.Event() for _ in range(segments)]
    prepared = [False] * segments  # segment s's first phase completed
    failed: list = []  # (segment, error) of a middle phase that raised

    def across() -> None:
        for s in range(segments):
            ready[s].wait()
            if not prepared[s]:
                return  # released by the caller's error: no later segment comes
            try:
                middle(s)
            except BaseException as exc:  # raised on the caller's thread below
                failed.append((s, exc))
                for event in done[s:]:
                    event.set()
                return
            done[s].set()

    worker = threading.Thread(target=across, name="refcoll-pipeline", daemon=True)
    worker.start()
    try:
        for s in range(segments):
            first(s)
            prepared[s] = True
            ready[s].set()
        for s in range(segments):
            done[s].wait()
            if failed and s >= failed[0][0]:
                raise failed[0][1]
            last(s)
    except BaseException:
        for event in ready:
            event.set()
        raise
    worker.join()
