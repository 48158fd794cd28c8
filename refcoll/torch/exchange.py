"""Gather, scatter and all-to-all over a Transport: the collectives torch has and refcoll's do not.

``torch.distributed`` asks a backend for three data movements that no reduction
algorithm covers: ``gather`` (every rank's tensor to one root), ``scatter`` (the
root's i-th tensor to rank i) and ``all_to_all`` (rank i's j-th piece to rank j,
pieces of any size). They are written here as the MPI libraries' linear
algorithms are (MPICH's ``MPIR_Gather_intra_linear``... and the pairwise
exchange of ``MPIR_Alltoallv_intra_pairwise_sendrecv_replace``): ``p - 1``
point-to-point messages at the root, or ``p - 1`` rounds of one ``sendrecv``
each, round ``s`` sending to ``rank + s`` and receiving from ``rank - s``.

The arguments are agreed first, as every refcoll call's are: a root that differs
across ranks, tensors of different sizes or dtypes, or an all-to-all whose split
sizes do not pair up (rank i sends j fewer elements than j expects from i) are a
:class:`~refcoll.core.errors.MismatchError` on every rank before any data moves.
Over Gloo that matters: a message longer than the buffer posted for it aborts
the receiving process inside Gloo.
"""

from __future__ import annotations

import json

import numpy as np

from ..algorithms._util import overlaps
from ..calls.agree import agree, allgather_records, pack, unpack
from ..calls.agree import barrier as dissemination
from ..calls.args import check_root
from ..core.errors import MismatchError, UsageError

__all__ = ["gather", "scatter", "alltoall", "barrier"]


def _agree_movement(t, name: str, x, root: int, error: str) -> None:
    """Agree on the collective, the dtype, the element count and the root.

    ``error``: this rank's own objection (its arguments could not be read), which
    every rank raises: the others a UsageError naming this rank, this one its own.
    """
    if not error:
        try:
            check_root(root, t)
        except UsageError as exc:
            error = str(exc)
    agree(t, collective=name, dtype="" if x is None else str(x.dtype),
          count=0 if x is None else x.size, root=root, error=error)
    if error:
        raise ValueError(error)


def gather(t, x: np.ndarray | None, root: int, outs: list | None, error: str = "") -> None:
    """Copy every rank's ``x`` into ``outs[rank]`` on ``root`` (``outs`` read there only).

    ``error`` (and ``x`` or ``outs`` ``None``): this rank's arguments could not be
    read; every rank raises, none waits.
    """
    with t.call("gather"):
        if not error and t.rank == root and len(outs) != t.size:
            error = f"rank {root}: gather needs one output per rank ({t.size}), got {len(outs)}"
        if not error and t.rank == root:
            error = _unlike("gather", "output", outs, x)
        _agree_movement(t, "gather", x, root, error)
        if t.rank != root:
            t.send(x, root)
            return
        for src in range(t.size):
            if src == root:
                outs[src][...] = x
            else:
                t.recv(outs[src], src)


def scatter(t, ins: list | None, root: int, out: np.ndarray | None, error: str = "") -> None:
    """Copy ``ins[rank]`` of ``root`` into every rank's ``out`` (``ins`` read on the root only)."""
    with t.call("scatter"):
        if not error and t.rank == root and len(ins) != t.size:
            error = f"rank {root}: scatter needs one input per rank ({t.size}), got {len(ins)}"
        if not error and t.rank == root:
            error = _unlike("scatter", "input", ins, out)
        _agree_movement(t, "scatter", out, root, error)
        if t.rank != root:
            t.recv(out, root)
            return
        for dest in range(t.size):
            if dest == root:
                out[...] = ins[dest]
            else:
                t.send(ins[dest], dest)


def _unlike(name: str, what: str, pieces: list, mine) -> str:
    """Return the root's objection to a piece of ``pieces`` that is not ``mine``'s size and
    dtype (every rank's own tensor is agreed on: the root's pieces must be like them)."""
    for r, piece in enumerate(pieces):
        if piece.size != mine.size or piece.dtype != mine.dtype:
            return (f"{name}: the root's {what} for rank {r} holds {piece.size} x {piece.dtype}, "
                    f"every rank's own tensor {mine.size} x {mine.dtype}")
    return ""


def _pieces_record(t, ins: list, outs: list, error: str) -> np.ndarray:
    """This rank's record: its objection (or ``""``), its dtypes, its send and receive sizes."""
    if not error and (len(ins) != t.size or len(outs) != t.size):
        error = (f"rank {t.rank}: all_to_all needs one input and one output per rank "
                 f"({t.size}), got {len(ins)} and {len(outs)}")
    if error:
        return pack([[error, [], [[], []]], [error[:200], [], [[], []]]], 256 + 48 * t.size)
    sizes = [[int(a.size) for a in ins], [int(a.size) for a in outs]]
    dtypes = sorted({str(a.dtype) for a in list(ins) + list(outs)})
    return pack([["", dtypes, sizes]], 256 + 48 * t.size)


def _check_pieces(t, table: np.ndarray) -> None:
    """Raise the same MismatchError on every rank unless every pair's sizes and dtypes match."""
    records = [unpack(table[r]) for r in range(t.size)]
    for r, (error, _, _) in enumerate(records):
        if error:
            if r == t.rank:
                raise ValueError(error)
            raise UsageError(f"rank {r} could not run all_to_all: {error}")
    if len({json.dumps(rec[1]) for rec in records}) > 1:
        raise MismatchError("ranks called all_to_all with different dtypes: " + ", ".join(
            f"rank {r} has {'/'.join(rec[1])}" for r, rec in enumerate(records)))
    for i, rec in enumerate(records):
        for j, other in enumerate(records):
            sends, expects = rec[2][0][j], other[2][1][i]
            if sends != expects:
                raise MismatchError(f"ranks called all_to_all with split sizes that do not pair "
                                    f"up: rank {i} sends {sends} elements to rank {j}, which "
                                    f"expects {expects} from rank {i}")


def alltoall(t, ins: list, outs: list, error: str = "") -> None:
    """Send ``ins[j]`` to rank ``j`` and receive rank ``j``'s piece for this rank into ``outs[j]``.

    Pairwise exchange: round ``s`` (``1 <= s < p``) sends to ``rank + s`` and
    receives from ``rank - s``, so every rank has one message out and one in.
    ``error``: this rank's arguments could not be read (every rank raises).
    """
    with t.call("alltoall"):
        _check_pieces(t, allgather_records(t, _pieces_record(t, ins, outs, error)))
        if any(overlaps(i, o) for i in ins for o in outs):  # in place, as Gloo takes it: a
            ins = [piece.copy() for piece in ins]  # round would receive over what a later sends
        outs[t.rank][...] = ins[t.rank]
        for shift in range(1, t.size):
            dest, src = (t.rank + shift) % t.size, (t.rank - shift) % t.size
            t.sendrecv(ins[dest], dest, outs[src], src)


def barrier(t) -> None:
    """Return once every rank of ``t`` has called (the dissemination barrier, agreed first)."""
    with t.call("barrier"):
        agree(t, collective="barrier")
        dissemination(t)
