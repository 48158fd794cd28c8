"""The public collectives: argument handling, agreement, prepared calls, ``auto``, simulation.

:mod:`~refcoll.calls.collectives` holds the five collectives,
:mod:`~refcoll.calls.args` what they share about arguments,
:mod:`~refcoll.calls.agree` the check that every rank passed the same ones,
:mod:`~refcoll.calls.prepared` the fast path of repeated all-reduces,
:mod:`~refcoll.calls.auto` the ``auto`` algorithm and :mod:`~refcoll.calls.calibration`
the machine figures it prices with.
"""

from .collectives import (SimResult, allgather, allreduce, as_transport, broadcast, device_for,
                          reduce, reduce_scatter, simulate)


__all__ = ["allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "simulate",
           "SimResult", "as_transport", "device_for"]
