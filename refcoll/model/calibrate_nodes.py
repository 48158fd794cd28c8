"""Calibration across nodes: α and β between two nodes, and a prediction with both levels."""

from __future__ import annotations

from .. import algorithms as registry
from ..algorithms.registry import NodeShape
from ..calls.calibration import INTER_SIZES, node_peers
from ..core.calibration import Calibration

__all__ = ["inter_link", "across_nodes"]



def inter_link(t, pingpong, measure) -> dict:
    """Return the two-level fields: α and β between rank 0 and a rank of another node.

    Nothing when every rank is on one node. α is half the round trip of 8 B, β
    the slope between :data:`~refcoll.calls.calibration.INTER_SIZES` (a shaped
    link's token bucket lets a burst through at the line rate, and the slope
    cancels it with α). ``pingpong`` is the ping-pong already measured between
    ranks 0 and 1, ``measure(t, sizes, partner)`` measures another: when rank 1
    is on another node the first was already across.
    """
    _, inter, nodes, per_node = node_peers(list(getattr(t, "hosts", None) or [""] * t.size))
    if inter is None:
        return {}
    points = dict(pingpong if inter == 1 else measure(t, [8, *INTER_SIZES], inter))
    small, large = INTER_SIZES
    beta = max((points[large] - points[small]) / (large - small), 1e-15)
    return {"inter_alpha": points[8], "inter_beta": beta, "nodes": nodes, "per_node": per_node}



def across_nodes(calibration: Calibration, algorithm: str, nbytes: int, itemsize: int,
                  options: dict) -> float:
    """Return a two-level calibration's prediction: the call, and each phase of the algorithm's
    ``price`` on the measured nodes at its link's α and β (inside a node or across).

    The algorithm's own work (``own``) is left out: measured across nodes it
    holds the waits for the links, which the phases price already.
    """
    shape = NodeShape(calibration.nodes, calibration.per_node)
    parts = registry.get(algorithm).price(shape, nbytes // itemsize, itemsize, **options)
    return calibration.call + calibration.price(parts, shape.per_node, itemsize)
