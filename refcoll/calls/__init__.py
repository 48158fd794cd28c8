"""The public collectives: argument handling, agreement, prepared calls, ``auto``, simulation.

:mod:`~refcoll.calls.collectives` holds the five collectives,
:mod:`~refcoll.calls.args` what they share about arguments,
:mod:`~refcoll.calls.agree` the check that every rank passed the same ones,
:mod:`~refcoll.calls.prepared` the fast path of repeated all-reduces,
:mod:`~refcoll.calls.nonblocking` the non-blocking collectives and
:mod:`~refcoll.calls.progress` the engines that run them,
:mod:`~refcoll.calls.auto` the ``auto`` algorithm and :mod:`~refcoll.calls.calibration`
the machine figures it prices with.
"""

from .collectives import (SimResult, allgather, allreduce, as_transport, broadcast, device_for,
                          reduce, reduce_scatter, simulate)
from .nonblocking import (Handle, iallgather, iallreduce, ibroadcast, ireduce, ireduce_scatter,
                          wait_all)


__all__ = ["allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "simulate",
           "SimResult", "as_transport", "device_for", "iallreduce", "ireduce_scatter", "iallgather",
           "ibroadcast", "ireduce", "wait_all", "Handle"]
