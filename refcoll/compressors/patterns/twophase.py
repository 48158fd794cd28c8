"""The ``twophase`` pattern: 1-bit Adam's compressed all-reduce (Tang et al. 2021).

The default of sign and 1-bit. With ``p`` ranks and the tensor cut into ``p``
chunks (:func:`refcoll.core.chunking.chunk_bounds`):

1. each rank compresses every chunk;
2. an all-to-all sends chunk ``j`` to rank ``j`` (pairwise: at step
   ``s = 1 .. p-1`` send to ``rank + s``, receive from ``rank - s``, after an
   allgather of every chunk's element counts);
3. rank ``j`` decompresses the ``p`` versions of its chunk, sums them in rank
   order (divides by ``p`` for ``avg``) and compresses the sum again;
4. the compressed chunks go round a ring allgather; every rank decompresses
   them all.

With ``ef(...)`` both compressions keep a residual, through
:class:`~refcoll.compressors.base.ErrorFeedback`'s methods: the worker's for the
whole tensor (``state.residual``) and the server's for its chunk
(``state.memory``), so no error is lost at either stage.

Spec: spec/compressors.md
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ...core.chunking import chunk_bounds
from ...core.xp import array_namespace
from ..base import Compressor, CompressorState, Payload, split_feedback
from .gather import (
    TAG_ALLTOALL,
    Tagged,
    allgather_counts,
    deserialise,
    gather_payloads,
    serialise,
    sum_in_rank_order,
    wire_counts,
)

__all__ = ["twophase_pattern", "owed", "carried"]


def twophase_pattern(t, comp: Compressor, state: CompressorState, x, *, op: str,
                     algorithm: str, options: dict):
    """Run steps 1-4 above; return the result and the payload bytes this rank sent.

    ``algorithm`` and ``options`` play no part: the pattern has its own exchanges.
    """
    inner, feedback = split_feedback(comp)
    p, r = t.size, t.rank
    flat = x.reshape(-1)
    xp = array_namespace(x)
    if feedback is not None:
        residual = None if state.residual is None else state.residual.reshape(-1)
        flat = feedback.corrected(flat, residual)
    bounds = chunk_bounds(flat.size, p)
    with t.call("compressed_allreduce"):
        chunks = [inner.compress(flat[a:b], state) for a, b in bounds]
        if feedback is not None:
            approximation = xp.concatenate([inner.decompress(c) for c in chunks])
            state.residual = feedback.new_residual(flat, approximation).reshape(x.shape)
        mine = _alltoall_payloads(t, chunks)
        total = sum_in_rank_order([inner.decompress(c) for c in mine], op)
        server_key = ("twophase.server", flat.size, p)
        if feedback is not None:
            total = feedback.corrected(total, state.memory.get(server_key))
        server = inner.compress(total, state)
        if feedback is not None:
            state.memory[server_key] = feedback.new_residual(total, inner.decompress(server))
        everyone = gather_payloads(t, [server], [chunks[r]])
        merged = [inner.decompress(dataclasses.replace(pls[0], shape=chunks[j].shape))
                  for j, pls in enumerate(everyone)]
    payload = sum(c.nbytes for c in chunks) - chunks[r].nbytes + server.nbytes
    return xp.concatenate(merged).reshape(x.shape), payload


def _alltoall_payloads(t, chunks: list[Payload]) -> list[Payload]:
    """Send chunk ``j`` to rank ``j``; return every rank's chunk ``rank``, in rank order.

    Pairwise exchange: at step ``s = 1 .. p-1`` send to ``rank + s`` and receive
    from ``rank - s``, after an allgather of every chunk's element counts.
    """
    p, r = t.size, t.rank
    table = allgather_counts(t, np.concatenate([wire_counts(c) for c in chunks]))
    width = wire_counts(chunks[r]).size
    itemsizes = np.array([a.dtype.itemsize for _, a in sorted(chunks[r].arrays.items())], np.int64)
    received: list[Payload] = [None] * p
    received[r] = chunks[r]
    tagged = Tagged(t, TAG_ALLTOALL)
    xp = array_namespace(next(iter(chunks[r].arrays.values())))
    for step in range(1, p):
        dst, src = (r + step) % p, (r - step) % p
        sizes = table[src, r * width:(r + 1) * width]
        incoming = xp.empty(int((sizes * itemsizes).sum()), np.uint8)
        tagged.sendrecv(serialise(chunks[dst]), dst, incoming, src)  # chunk dst to its owner
        received[src] = deserialise(incoming, sizes, chunks[r])
    return received


def owed(state: CompressorState, rank: int) -> np.ndarray | None:
    """Return what a bucket's compressor state owes, element by element of the bucket (a
    copy), or None: its worker residual, plus ``p`` times its two-phase server residual
    over this rank's chunk (the average owes it as the server would have). What a
    bucket owes moves with its gradients when the buckets are laid out anew."""
    owes = None if state.residual is None else state.residual.reshape(-1)
    for key, server in state.memory.items():
        if isinstance(key, tuple) and key[:1] == ("twophase.server",):
            n, p = key[1], key[2]
            a, b = chunk_bounds(n, p)[rank]
            kind = server.dtype if owes is None else np.result_type(owes, server)
            owes = np.zeros(n, kind) if owes is None else owes.astype(kind, copy=True)
            owes[a:b] += p * server
    return owes


def carried(length: int, pieces) -> np.ndarray | None:
    """Return a new bucket's residual of ``length`` elements from what old buckets owe:
    ``pieces`` are ``(debt, src, n, dst)``, a gradient's ``n`` elements at ``src`` of its
    old bucket's :func:`owed` (None: it owes nothing), placed at ``dst``. None where no
    piece owes anything."""
    residual = None
    for debt, src, n, dst in pieces:
        if debt is None:
            continue
        if residual is None:
            residual = np.zeros(length, debt.dtype)
        residual[dst:dst + n] = debt[src:src + n]
    return residual
