"""The ``allreduce`` pattern: payloads that add up, reduced by any all-reduce algorithm.

For compressors linear in a basis every rank shares (casts, shared-seed
random-k, PowerSGD, ``none``; int8 with shared scales by choice). The pattern
runs the compressor's declared rounds
(:meth:`~refcoll.compressors.base.Compressor.allreduce_rounds`): each round's
arrays go through the chosen all-reduce algorithm as they are, roles in sorted
order, and the results go back into the compressor, which computes the next
round or the result. By default that is one round, the payload's wire arrays
reduced with the call's op and decompressed once; PowerSGD declares two (``P``
summed and orthogonalised, then ``Q``), int8 a ``max`` of its block scales
before its codes.

With error feedback the compressor sees ``x + e_old``, and ``e_new`` is that
less the decompression of this rank's own contribution (the ``local`` payload
the rounds return: PowerSGD's ``P_shared Q_localᵀ``, int8's codes against the
shared scales).

Spec: spec/compressors.md
"""

from __future__ import annotations

from ...calls.collectives import allreduce
from ..base import Compressor, CompressorState, split_feedback

__all__ = ["allreduce_pattern"]


def allreduce_pattern(t, comp: Compressor, state: CompressorState, x, *, op: str,
                      algorithm: str, options: dict):
    """All-reduce ``x`` through ``comp``'s rounds; return the result and the payload bytes.

    The payload bytes are every array this rank put into a round.
    """
    inner, feedback = split_feedback(comp)
    if feedback is not None:
        x = feedback.corrected(x, state.residual)
    rounds = inner.allreduce_rounds(x, state, size=t.size, op=op)
    payload, reduced = 0, None
    while True:
        try:
            step = rounds.send(reduced)
        except StopIteration as done:
            local, result = done.value
            break
        payload += sum(arr.nbytes for arr in step.arrays.values())
        reduced = {role: allreduce(arr, t, op=step.op, algorithm=algorithm, validate=False,
                                   **options)
                   for role, arr in sorted(step.arrays.items())}
    if feedback is not None:
        state.residual = feedback.new_residual(x, inner.decompress(local))
    return result, payload
