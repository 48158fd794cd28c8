"""How the payloads of every rank become one result: the three combination patterns.

A compressor never communicates: it declares the patterns its payloads allow
(:attr:`~refcoll.compressors.base.Compressor.patterns`) and, for the
``allreduce`` pattern, the rounds it needs
(:meth:`~refcoll.compressors.base.Compressor.allreduce_rounds`). The modules
here do the communicating, each over any Transport:

``allreduce`` (:mod:`.allreduce`)
    Payloads add up in a basis every rank shares: the compressor's rounds go
    through the chosen all-reduce algorithm as they are.
``gather`` (:mod:`.gather`)
    Every payload goes round a ring allgather and every rank sums the ``p``
    decompressed payloads in rank order.
``twophase`` (:mod:`.twophase`)
    Compressed all-to-all of ``p`` chunks, sum and recompress per chunk,
    compressed allgather (1-bit Adam's compressed all-reduce).

Each pattern is a function ``(t, comp, state, x, *, op, algorithm, options) ->
(result, payload_bytes)`` and calls :class:`~refcoll.compressors.base.ErrorFeedback`'s
methods where ``comp`` wraps one. Error feedback is written there only.

Spec: spec/compressors.md
"""

from __future__ import annotations

from .allreduce import allreduce_pattern
from .gather import gather_pattern
from .twophase import twophase_pattern

__all__ = ["PATTERNS", "allreduce_pattern", "gather_pattern", "twophase_pattern"]

#: Every pattern by name, in the order the documentation gives them.
PATTERNS = {"allreduce": allreduce_pattern, "gather": gather_pattern,
            "twophase": twophase_pattern}
