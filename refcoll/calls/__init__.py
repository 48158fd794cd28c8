"""The public collectives: argument checks, agreement, plans, ``auto``, non-blocking calls.

:mod:`~refcoll.calls.collectives` holds the five collectives and their persistent
twins (``allreduce_init``...), :mod:`~refcoll.calls.args` the checks of their
arguments, :mod:`~refcoll.calls.agree` the check that every rank passed the same
ones, :mod:`~refcoll.calls.plans` the plans every call runs through,
:mod:`~refcoll.calls.nonblocking` the non-blocking collectives and
:mod:`~refcoll.calls.progress` the engines that run them,
:mod:`~refcoll.calls.auto` the ``auto`` algorithm and :mod:`~refcoll.calls.calibration`
the machine figures it prices with.
"""

from .collectives import (
    SimResult,
    allgather,
    allgather_init,
    allreduce,
    allreduce_init,
    as_transport,
    broadcast,
    broadcast_init,
    device_for,
    reduce,
    reduce_init,
    reduce_scatter,
    reduce_scatter_init,
    simulate,
)
from .nonblocking import (
    Handle,
    iallgather,
    iallreduce,
    ibroadcast,
    ireduce,
    ireduce_scatter,
    wait_all,
)
from .plans import Plan

__all__ = ["allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "simulate",
           "SimResult", "as_transport", "device_for", "iallreduce", "ireduce_scatter", "iallgather",
           "ibroadcast", "ireduce", "wait_all", "Handle", "allreduce_init", "reduce_scatter_init",
           "allgather_init", "broadcast_init", "reduce_init", "Plan"]
