"""Phase pricing: an algorithm's exact counts on a cluster's links, in seconds.

Each algorithm says, through its registry record's ``price``, which of its phases
run on which link (:class:`~refcoll.algorithms.registry.LinkCost`); this module
puts the link's α and β and the device's reduction rate on each. A phase whose
counts are ``c`` costs ``c.rounds·α + c.critical_bytes·β + c.reduced·s/reduce_bw``
(``s`` bytes per element). The compressed collectives
(:mod:`~refcoll.model.compression`) are priced with the same
:func:`price_phase`, :func:`local_phase` and :func:`steps_phase`.
"""

from __future__ import annotations

import functools
import inspect

from .. import algorithms
from ..algorithms.spelling import spell
from ..core.errors import UsageError
from .channels import CHANNELLED, channelled_phases
from .cluster import MODELLED, Cluster
from .phases import Estimate, Phase, local_phase, price_phase, steps_phase

__all__ = ["Phase", "Estimate", "price_phase", "local_phase", "steps_phase",
           "allreduce_estimate", "estimate_name"]


@functools.lru_cache(maxsize=None)
def _default_inter(name: str) -> str | None:
    """Return the default of the ``inter`` option ``name``'s all-reduce takes (None: none)."""
    parameter = inspect.signature(
        algorithms.implementation(name, "allreduce")).parameters.get("inter")
    return None if parameter is None else parameter.default


def estimate_name(algorithm: str, inter: str) -> str:
    """Return how an estimate names ``algorithm``: with its ``inter`` when not the default."""
    if algorithm in CHANNELLED:
        return algorithm
    default = _default_inter(algorithm)
    return algorithm if default is None or inter == default else spell(algorithm, {"inter": inter})


@functools.lru_cache(maxsize=4096)
def allreduce_estimate(cluster: Cluster, algorithm: str, count: int, itemsize: int, *,
                       inter: str = "ring") -> Estimate:
    """Return the phases of a dense all-reduce of ``count`` elements on ``cluster``.

    ``algorithm`` is a registry name (its schedule, priced by its record's
    ``price``) or a channelled collective of :data:`~.channels.CHANNELLED`.
    ``inter`` is the hierarchical all-reduce's algorithm across nodes. The
    phases' ``bytes`` are what one GPU sends (and receives) in each; with
    ``g = gpus_per_node``, ``m = nodes`` and ``n = count·itemsize`` divisible
    by ``g·m``, hierarchical's are ``(g-1)/g·n``, ``2(m-1)/m·n/g`` and ``(g-1)/g·n``.
    """
    if algorithm not in MODELLED:
        raise UsageError(f"unknown algorithm {algorithm!r}: the model prices "
                         f"{', '.join(MODELLED)}")
    if count < 0:
        raise UsageError(f"element count must not be negative, got {count}")
    if algorithm in CHANNELLED:
        return Estimate(algorithm, channelled_phases(cluster, algorithm, count, itemsize),
                        dense=count * itemsize)
    priced = algorithms.get(algorithm).price(cluster.shape, count, itemsize, inter=inter)
    phases = tuple(price_phase(cluster, part.name, part.link, part.cost, itemsize)
                   for part in priced)
    return Estimate(estimate_name(algorithm, inter), phases, dense=count * itemsize)
