"""Compressed all-reduce: how the payloads of every rank become one result.

A compressor never communicates; this module does, in one of three patterns,
chosen from what the compressor declares (:attr:`Compressor.patterns`, the
default first, or ``pattern=`` to pick another it allows):

``allreduce`` (casts, shared-seed random-k, PowerSGD, ``none``; int8 by choice)
    The payloads add up element for element in a basis every rank shares, so
    each wire array goes through the chosen all-reduce algorithm as it is and
    the sum is decompressed once. int8 first agrees on shared scales (an
    all-reduce of each block's ``max|x|``) and quantises to ``127 // p`` levels,
    so the int8 codes of ``p`` ranks sum without overflow. PowerSGD takes two all-reduces (Vogels et
    al. 2019, Algorithm 1): ``P = M Q`` summed, orthogonalised, then
    ``Q = M^T P`` summed; the summed ``Q`` is every rank's next warm start.
    With error feedback its residual is ``M - P Q_local^T`` (the shared ``P``,
    this rank's ``Q`` before the sum), as in the paper's reference code.

``gather`` (top-k, threshold, QSGD, TernGrad, int8, and sign/1-bit by choice)
    Payloads do not add up compressed, so every rank's payload goes round a
    ring allgather with variable sizes (the element counts of each wire array
    are exchanged first, ``8 · arrays`` bytes per rank), and every rank
    decompresses all ``p`` payloads and sums them in rank order. The bytes a
    rank sends grow with ``p``: ``(p - 1)`` payloads.

``twophase`` (sign and 1-bit by default: 1-bit Adam's compressed all-reduce, Tang et al. 2021)
    The tensor is cut into ``p`` chunks (:func:`refcoll.core.chunking.chunk_bounds`).
    Each rank compresses every chunk; an all-to-all sends chunk ``j`` to rank
    ``j``; rank ``j`` decompresses the ``p`` versions of its chunk, sums them in
    rank order (divides by ``p`` for ``avg``), compresses the sum again and the
    compressed chunks go round a ring allgather; every rank decompresses them
    all. With ``ef(...)`` both compressions keep a residual: the worker's for
    the whole tensor (``state.residual``) and the server's for its chunk
    (``state.memory``), so no error is lost at either stage.

Every rank ends with bitwise the same result (all decompress the same bytes
and sum in the same order), and :func:`simulate_compressed` runs this very code
on simulated ranks, so it predicts an MPI run bit for bit, fixed seeds given.

Ops are ``sum`` and ``avg`` (``avg`` divides the sum by ``p`` once, as
:mod:`refcoll.core.ops` defines it). Each call measures the bytes this rank really
sent and received (the transport's counters, sub-communicators included) and
returns them with the payload's ``nbytes`` and the dense equivalent: the bytes
the same all-reduce would send uncompressed.

Spec: spec/compressors.md
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .. import algorithms
from ..algorithms.ring import ring_allgather_steps
from ..core.chunking import chunk_bounds
from ..core.errors import UsageError
from ..core.ops import get_op
from ..calls.args import flat_input, flat_out, shared_errors
from ..calls.collectives import allreduce, as_transport, device_for
from ..core.xp import array_namespace
from ..transport.sim import SimWorld
from .base import (Compressor, CompressorState, ErrorFeedback, Payload, check_float,
                   compute_dtype, parse)
from ._blocks import block_max
from .int8 import Int8
from .powersgd import PowerSGD, orthogonalise

__all__ = [
    "CompressedTraffic",
    "compressed_allreduce",
    "simulate_compressed",
    "SimulatedSteps",
    "run_steps",
    "PATTERNS",
]

#: Every pattern, in the order the documentation gives them.
PATTERNS = ("allreduce", "gather", "twophase")

_TAG_COUNTS, _TAG_DATA, _TAG_ALLTOALL = 0, 1, 2


@dataclass(frozen=True)
class CompressedTraffic:
    """What one compressed all-reduce moved, for one rank.

    Attributes:
        pattern: the pattern that ran.
        sent, received: bytes this rank sent and received, measured on the wire
            (payloads, forwarded payloads, element counts, everything).
        payload: ``nbytes`` of the payloads this rank compressed in the call.
        tensor: bytes of the uncompressed tensor.
        dense: bytes this rank would send in the same all-reduce uncompressed
            (the algorithm's cost model: ``Cost.max_rank_bytes``).
    """

    pattern: str
    sent: int
    received: int
    payload: int
    tensor: int
    dense: int

    @property
    def ratio(self) -> float:
        """Return ``dense / sent``: the compression a user really gets (inf when nothing moved)."""
        return self.dense / self.sent if self.sent else math.inf


def _unwrap(comp: Compressor) -> tuple[Compressor, bool]:
    """Return the innermost compressor and whether error feedback wraps it."""
    if isinstance(comp, ErrorFeedback):
        inner, _ = _unwrap(comp.inner)
        return inner, True
    return comp, False


def _resolve(compressor) -> Compressor:
    if isinstance(compressor, str):
        return parse(compressor)
    if not isinstance(compressor, Compressor):
        raise TypeError(f"compressor= takes a Compressor or a spec string, got "
                        f"{type(compressor).__name__}")
    return compressor


def compressed_allreduce(x, comm=None, *, compressor, state: CompressorState | None = None,
                         op: str = "sum", algorithm: str = "ring", pattern: str | None = None,
                         out=None, validate: bool = True,
                         **options) -> tuple[np.ndarray, CompressedTraffic]:
    """All-reduce ``x`` through ``compressor``; return the result and this rank's traffic.

    Args:
        x: this rank's floating tensor (any shape; PowerSGD reads ``(m, ...)`` as
            an ``m × n`` matrix).
        comm: an mpi4py communicator or a Transport (``None``: ``MPI.COMM_WORLD``).
        compressor: a :class:`Compressor` or a spec string (``"ef(topk:ratio=0.01)"``).
        state: this tensor stream's state (residuals, warm starts, RNG); ``None``
            makes a fresh one for this call. Build it with
            ``compressor.new_state(seed=S, rank=r)`` (a
            :class:`~refcoll.compressors.base.CompressorState`), the same ``S`` on
            every rank, and keep it per tensor across calls. Error feedback
            (``ef(...)``) requires it: its residual lives in the state, so without
            one every call would throw the residual away. After the call
            ``state.traffic`` is the returned traffic.
        op: ``sum`` or ``avg`` (or ``MPI.SUM``).
        algorithm: the all-reduce algorithm of the ``allreduce`` pattern;
            ``auto`` chooses once per call, by the dense tensor's size.
        pattern: ``allreduce``, ``gather`` or ``twophase``; default: the
            compressor's first.
        out: result buffer (``out=x`` allowed); a new array otherwise.
        validate: agree on the arguments, compressor and pattern included, first.
        **options: the algorithm's options (those it does not take are refused).

    Raises:
        UsageError: an unknown compressor, op, pattern or algorithm, a pattern
            the compressor does not allow, an option the algorithm does not
            take, error feedback without ``state``, a non-floating tensor,
            ``switch``; raised on every rank when any rank's call has one.
        MismatchError: ranks passed different arguments (with ``validate``).
    """

    xp = array_namespace(x)
    t = device_for(as_transport(comm, "compressed allreduce"), x)
    with shared_errors(t, validate, "compressed_allreduce"):
        try:
            comp = _resolve(compressor)
        except UsageError as exc:
            raise UsageError(f"rank {t.rank}: {exc}") from None
        if isinstance(comp, ErrorFeedback) and state is None:
            raise UsageError(
                f"rank {t.rank}: compressor {comp.spec()!r} keeps an error-feedback residual "
                "in its state, and with state=None it would be thrown away after every call; "
                "pass state=refcoll.compressors.CompressorState(seed=S, rank=rank) (or "
                "compressor.new_state(seed=S, rank=rank)), one per tensor, the same seed on "
                "every rank, and the same object on every call for that tensor")
        if not isinstance(op, str):  # MPI.SUM and the like; anything else is refused here
            try:
                op = get_op(op).name
            except UsageError as exc:
                raise UsageError(f"rank {t.rank}: {exc}") from None
        if op not in ("sum", "avg"):
            raise UsageError(f"rank {t.rank}: a compressed all-reduce takes op sum or avg, "
                             f"not {op!r}")
        chosen = pattern or comp.patterns[0]
        if chosen not in comp.patterns:
            raise UsageError(f"rank {t.rank}: compressor {comp.spec()!r} allows the patterns "
                             f"{', '.join(comp.patterns)}, not {chosen!r}")
        if algorithms.get(algorithm).workers is not None:
            raise UsageError(f"rank {t.rank}: {algorithm} needs switch processes, which cannot "
                             "combine compressed payloads; choose another algorithm")
        algorithms.check_options(algorithm, "allreduce", options, rank=t.rank)
        arr = xp.asarray(x)
        flat = flat_input(arr, t)
        try:
            check_float(arr, comp.name)
        except UsageError as exc:
            raise UsageError(f"rank {t.rank}: {exc}") from None
        result = flat_out(out, arr.shape, arr.dtype, t, "compressed all-reduce", xp)
        if state is None:
            state = comp.new_state(rank=t.rank)
    if validate:
        from ..core.ops import dtype_name
        from ..calls.agree import agree

        with t.call("compressed_allreduce"):
            agree(t, collective="compressed_allreduce", algorithm=algorithm, op=op,
                  dtype=dtype_name(flat.dtype), count=flat.size,
                  compressor=comp.spec(),
                  options=sorted(options.items()) + [("pattern", chosen), ("seed", state.seed)])
    if algorithm == "auto":
        # One choice for every payload array of the call, by the dense tensor's size,
        # so that an oracle resolving the same way predicts the same schedule.
        from ..calls.auto import resolve

        algorithm = resolve(t, "allreduce", flat.size, flat.dtype.itemsize)
    before = t.traffic.snapshot()
    tensor = flat.reshape(arr.shape)
    if chosen == "allreduce":
        total, payload = _allreduce_pattern(t, comp, state, tensor, op, algorithm, options)
    elif chosen == "gather":
        total, payload = _gather_pattern(t, comp, state, tensor, op)
    else:
        total, payload = _twophase_pattern(t, comp, state, tensor, op)
    np.copyto(result, total.reshape(-1))
    sent, received = (now - then for now, then in zip(t.traffic.snapshot(), before))
    traffic = CompressedTraffic(chosen, sent, received, payload, flat.nbytes,
                                _dense_bytes(t, algorithm, flat.size, flat.dtype.itemsize))
    state.traffic = traffic
    return (out if out is not None else result.reshape(arr.shape)), traffic


def _dense_bytes(t, algorithm: str, count: int, itemsize: int) -> int:
    """Return the bytes a rank sends in the uncompressed all-reduce of the same tensor."""
    return algorithms.get(algorithm).costs["allreduce"](t.size, count, itemsize).max_rank_bytes


def _finish_sum(acc: np.ndarray, op: str, p: int) -> np.ndarray:
    if op == "avg":
        get_op("avg").finalize(acc.reshape(-1), p)
    return acc


def _sum_in_rank_order(parts: Sequence[np.ndarray], op: str) -> np.ndarray:
    """Return ``parts[0] + parts[1] + ...`` left to right in their dtype (``avg``: over len)."""
    add = get_op("sum")
    acc = parts[0].copy()
    for part in parts[1:]:
        add.apply(acc, part, acc)
    return _finish_sum(acc, op, len(parts))


# --- allreduce: payloads that add up -------------------------------------------------------

def _allreduce_pattern(t, comp, state, x, op, algorithm, options):
    inner, ef = _unwrap(comp)
    if isinstance(inner, PowerSGD) and inner.plan(x.shape) is not None:
        return _powersgd(t, inner, ef, state, x, op, algorithm, options)
    if isinstance(inner, Int8):
        return _int8_shared(t, inner, ef, state, x, op, algorithm, options)
    payload = comp.compress(x, state)
    summed = {role: allreduce(arr, t, op=op, algorithm=algorithm, validate=False, **options)
              for role, arr in sorted(payload.arrays.items())}
    return comp.decompress(dataclasses.replace(payload, arrays=summed)), payload.nbytes


def _powersgd(t, inner: PowerSGD, ef: bool, state, x, op, algorithm, options):
    """Distributed PowerSGD: all-reduce ``P``, orthogonalise, all-reduce ``Q``."""
    m, n, r = inner.plan(x.shape)
    corrected = x if not ef or state.residual is None else x + state.residual
    cd = compute_dtype(x.dtype)
    matrix = corrected.reshape(m, n).astype(cd)
    key = ("powersgd.q", m, n, r)
    q = state.memory.get(key)
    if q is None:
        q = array_namespace(x).asarray(state.shared_rng(m, n, r).standard_normal((n, r)).astype(cd))
    p_local = matrix @ q
    p = allreduce(p_local, t, op="sum", algorithm=algorithm, validate=False, **options)
    orthogonalise(p, inner.eps)
    q_local = matrix.T @ p
    if ef:
        state.residual = corrected - (p @ q_local.T).astype(x.dtype).reshape(x.shape)
    q = allreduce(q_local, t, op=op, algorithm=algorithm, validate=False, **options)
    state.memory[key] = q
    return (p @ q.T).astype(x.dtype).reshape(x.shape), p_local.nbytes + q_local.nbytes


def _int8_shared(t, inner: Int8, ef: bool, state, x, op, algorithm, options):
    """Shared-scale int8: all-reduce each block's ``max|x|``, then sum the codes as int8.

    With ``L = 127 // p`` levels per side the sum of ``p`` codes fits in int8, so
    the codes go through the all-reduce as they are; the sum decompresses with
    the shared scales.
    """
    levels = 127 // t.size
    if levels < 1:
        raise UsageError(f"shared-scale int8 sums at most 127 ranks' codes in int8; "
                         f"{t.size} ranks are too many: use the gather pattern")
    corrected = x if not ef or state.residual is None else x + state.residual
    xp = array_namespace(x)
    cd = compute_dtype(x.dtype)
    flat = corrected.reshape(-1).astype(cd)
    local = block_max(xp.abs(flat), inner.block)
    shared = allreduce(local, t, op="max", algorithm=algorithm, validate=False, **options)
    scales = shared / cd.type(levels)
    codes = inner.encode(flat, scales, levels)
    if ef:
        state.residual = corrected - inner.decode(codes, scales).astype(x.dtype).reshape(x.shape)
    total = allreduce(codes, t, op="sum", algorithm=algorithm, validate=False, **options)
    result = _finish_sum(inner.decode(total, scales), op, t.size)
    return result.astype(x.dtype).reshape(x.shape), codes.nbytes + local.nbytes


# --- gather: payloads summed after decompression -------------------------------------------

def _counts(payload: Payload) -> np.ndarray:
    """Return the element count of each wire array, roles in sorted order."""
    return np.array([payload.arrays[role].size for role in sorted(payload.arrays)], np.int64)


def _serialise(payload: Payload) -> np.ndarray:
    """Return the payload's wire arrays as one byte string, roles in sorted order."""
    xp = array_namespace(next(iter(payload.arrays.values()), np.empty(0)))
    parts = [xp.ascontiguousarray(payload.arrays[role]).reshape(-1).view(np.uint8)
             for role in sorted(payload.arrays)]
    return xp.concatenate(parts) if parts else xp.empty(0, np.uint8)


def _deserialise(record: np.ndarray, counts: np.ndarray, like: Payload) -> Payload:
    """Return the payload in ``record``, read with ``like``'s roles, dtypes and trailing shapes.

    Every rank's payload of the same tensor has the same roles and dtypes; only
    the element counts may differ (threshold), and they travel ahead of the data.
    """
    arrays, offset = {}, 0
    for role, count in zip(sorted(like.arrays), counts):
        ref = like.arrays[role]
        nbytes = int(count) * ref.dtype.itemsize
        data = record[offset:offset + nbytes].view(ref.dtype)
        offset += nbytes
        trailing = ref.shape[1:]
        arrays[role] = data.reshape((-1, *trailing) if trailing else (-1,))
    return dataclasses.replace(like, arrays=arrays)


def _allgather_counts(t, mine: np.ndarray) -> np.ndarray:
    """Return every rank's ``mine`` (same length everywhere) as a ``(p, len)`` table."""
    k = mine.size
    table = np.zeros(t.size * k, np.int64)
    table[t.rank * k:(t.rank + 1) * k] = mine
    ring_allgather_steps(_Tagged(t, _TAG_COUNTS), table, [(i * k, (i + 1) * k)
                                                           for i in range(t.size)])
    return table.reshape(t.size, k)


def _allgatherv(t, record: np.ndarray, lengths: Sequence[int]) -> list[np.ndarray]:
    """Ring allgather of byte strings of the given lengths; return them in rank order."""
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    buf = array_namespace(record).empty(int(offsets[-1]), np.uint8)
    bounds = [(int(offsets[i]), int(offsets[i + 1])) for i in range(t.size)]
    start, stop = bounds[t.rank]
    buf[start:stop] = record
    ring_allgather_steps(_Tagged(t, _TAG_DATA), buf, bounds)
    return [buf[a:b] for a, b in bounds]


def _gather_payloads(t, payloads: list[Payload], like: list[Payload]) -> list[list[Payload]]:
    """Allgather this rank's ``payloads``; return every rank's, read with ``like`` as templates.

    Each rank passes the same number of payloads; entry ``[rank][i]`` is rank
    ``rank``'s payload ``i``.
    """
    per_rank = [_counts(pl) for pl in payloads]
    widths = [c.size for c in per_rank]
    table = _allgather_counts(t, np.concatenate(per_rank) if per_rank else np.empty(0, np.int64))
    itemsizes = np.concatenate([[a.dtype.itemsize for _, a in sorted(pl.arrays.items())]
                                for pl in like]).astype(np.int64)
    lengths = [int((row * itemsizes).sum()) for row in table]
    records = [_serialise(pl) for pl in payloads]
    record = array_namespace(records[0]).concatenate(records)
    records = _allgatherv(t, record, lengths)
    result = []
    for rec, row in zip(records, table):
        mine, offset, at = [], 0, 0
        for template, width in zip(like, widths):
            counts = row[at:at + width]
            nbytes = int((counts * itemsizes[at:at + width]).sum())
            mine.append(_deserialise(rec[offset:offset + nbytes], counts, template))
            offset += nbytes
            at += width
        result.append(mine)
    return result


def _gather_pattern(t, comp, state, x, op):
    with t.call("compressed_allreduce"):
        payload = comp.compress(x, state)
        everyone = _gather_payloads(t, [payload], [payload])
    parts = [comp.decompress(pls[0]) for pls in everyone]
    return _sum_in_rank_order(parts, op), payload.nbytes


# --- twophase: compressed all-to-all, sum and recompress, compressed allgather -------------

def _twophase_pattern(t, comp, state, x, op):
    inner, ef = _unwrap(comp)
    p, r = t.size, t.rank
    flat = x.reshape(-1)
    corrected = flat if not ef or state.residual is None else flat + state.residual.reshape(-1)
    bounds = chunk_bounds(flat.size, p)
    with t.call("compressed_allreduce"):
        chunks = [inner.compress(corrected[a:b], state) for a, b in bounds]
        xp = array_namespace(x)
        if ef:
            approximation = xp.concatenate([inner.decompress(c) for c in chunks])
            state.residual = (corrected - approximation).reshape(x.shape)
        mine = _alltoall_payloads(t, chunks)
        total = _sum_in_rank_order([inner.decompress(c) for c in mine], op)
        server_key = ("twophase.server", flat.size, p)
        if ef and server_key in state.memory:
            total = total + state.memory[server_key]
        server = inner.compress(total, state)
        if ef:
            state.memory[server_key] = total - inner.decompress(server)
        everyone = _gather_payloads(t, [server], [chunks[r]])
        like = [chunks[j] for j in range(p)]
        merged = [inner.decompress(dataclasses.replace(pls[0], shape=like[j].shape))
                  for j, pls in enumerate(everyone)]
    payload = sum(c.nbytes for c in chunks) - chunks[r].nbytes + server.nbytes
    return xp.concatenate(merged).reshape(x.shape), payload


def _alltoall_payloads(t, chunks: list[Payload]) -> list[Payload]:
    """Send chunk ``j`` to rank ``j``; return every rank's chunk ``rank``, in rank order.

    Pairwise exchange: at step ``s = 1 .. p-1`` send to ``rank + s`` and receive
    from ``rank - s``, after an allgather of every chunk's element counts.
    """
    p, r = t.size, t.rank
    table = _allgather_counts(t, np.concatenate([_counts(c) for c in chunks]))
    width = _counts(chunks[r]).size
    itemsizes = np.array([a.dtype.itemsize for _, a in sorted(chunks[r].arrays.items())], np.int64)
    received: list[Payload] = [None] * p
    received[r] = chunks[r]
    tagged = _Tagged(t, _TAG_ALLTOALL)
    xp = array_namespace(next(iter(chunks[r].arrays.values())))
    for step in range(1, p):
        dst, src = (r + step) % p, (r - step) % p
        counts = table[src, r * width:(r + 1) * width]
        incoming = xp.empty(int((counts * itemsizes).sum()), np.uint8)
        tagged.sendrecv(_serialise(chunks[dst]), dst, incoming, src)
        received[src] = _deserialise(incoming, counts, chunks[r])
    return received


class _Tagged:
    """A transport view that sends every message of one phase under one tag."""

    def __init__(self, t, tag: int):
        self._t, self._tag = t, tag
        self.rank, self.size = t.rank, t.size

    def sendrecv(self, sendbuf, dest, recvbuf, source, tag: int = 0) -> None:
        self._t.sendrecv(sendbuf, dest, recvbuf, source, self._tag)


# --- the same code on simulated ranks: the oracle ------------------------------------------

def run_steps(t, compressor, inputs: Sequence[np.ndarray], *, seed: int = 0, op: str = "sum",
              algorithm: str = "ring", pattern: str | None = None, validate: bool = True,
              **options) -> tuple[list[np.ndarray], list[CompressedTraffic]]:
    """Run one compressed all-reduce per input on ``t``, one state carried through.

    This is what a training loop does for one tensor: the residual and warm
    start of each step feed the next. Returns each step's result and traffic.
    """
    comp = _resolve(compressor)
    state = comp.new_state(seed=seed, rank=t.rank)
    outputs, traffic = [], []
    for x in inputs:
        result, moved = compressed_allreduce(x, t, compressor=comp, state=state, op=op,
                                             algorithm=algorithm, pattern=pattern,
                                             validate=validate, **options)
        outputs.append(result)
        traffic.append(moved)
    return outputs, traffic


@dataclass
class SimulatedSteps:
    """What :func:`simulate_compressed` returns.

    Attributes:
        outputs: ``outputs[step][rank]``, the result every rank must return.
        traffic: ``traffic[step][rank]``.
        ledger: every message of the run.
    """

    outputs: list[list[np.ndarray]]
    traffic: list[list[CompressedTraffic]]
    ledger: object


def simulate_compressed(compressor, inputs: Sequence[Sequence[np.ndarray]], *, seed: int = 0,
                        op: str = "sum", algorithm: str = "ring", pattern: str | None = None,
                        validate: bool = False, timeout: float | None = None,
                        **options) -> SimulatedSteps:
    """Predict a compressed all-reduce run bit for bit: the same code on simulated ranks.

    ``inputs[step][rank]`` is rank ``rank``'s tensor at step ``step``; every rank's
    state starts from ``compressor.new_state(seed, rank)``, as :func:`run_steps` does.
    """
    steps = [list(step) for step in inputs]
    p = len(steps[0]) if steps else 0
    if p < 1 or any(len(step) != p for step in steps):
        raise UsageError("simulate_compressed needs one input per rank at every step")
    world = SimWorld(p, timeout=timeout)
    per_rank = world.run(
        lambda t: run_steps(t, compressor, [step[t.rank] for step in steps], seed=seed, op=op,
                            algorithm=algorithm, pattern=pattern, validate=validate, **options))
    outputs = [[per_rank[r][0][s] for r in range(p)] for s in range(len(steps))]
    traffic = [[per_rank[r][1][s] for r in range(p)] for s in range(len(steps))]
    return SimulatedSteps(outputs, traffic, world.ledger)
