"""Compression in the cluster model: the patterns of a compressed all-reduce, priced.

:func:`compressed_estimate` prices the pattern that ``refcoll/compressors/patterns/``
runs (the compressor's default, or one it allows), by what the compressor
declares, never by its name:

* ``allreduce``: the payload's wire arrays go through the all-reduce algorithm
  as they are. A compressor that compresses matrices (it declares
  ``matrices``: PowerSGD) is priced tensor by tensor, one all-reduce per round
  of its :meth:`~refcoll.compressors.base.Compressor.shared_factors` over all
  the tensors (PowerSGD: ``P``, ``Σ m·r`` elements, then ``Q``, ``Σ n·r``),
  plus the tensors it leaves whole.
* ``gather``: a ring allgather of every rank's element counts (``8`` bytes per
  wire array), then a ring allgather of the payloads, ``p-1`` steps of a payload
  each: the bytes grow with ``p``, then every rank decompresses ``p`` payloads
  and sums them. Compressing makes the step slower when ``(p-1)·payload`` exceeds
  the all-reduce's ``2(p-1)/p·n``.
* ``twophase`` (sign, 1-bit): an all-to-all of compressed chunks of ``n/p``
  (pairwise, ``g-1`` steps inside the node and ``p-g`` across), each rank sums
  and recompresses its chunk, a ring allgather of the compressed chunks.

Local work (compress, decompress and sum) is priced as passes over the dense
bytes at ``reduce_bw``: one pass to compress (one per round for a matrix
compressor: ``M·Q`` and ``Mᵀ·P``), one per payload decompressed and added,
none for a compressor whose payload is the tensor itself (it declares
``identity``) in the ``allreduce`` pattern. It is a floor; selection (top-k)
and orthogonalisation cost more on real devices.

**Payload bytes** (:func:`payload_arrays`) come from compressing a
representative tensor (standard normal, fixed seed) with the real compressor
and summing its wire arrays, ``Payload.nbytes``. Tensors of more than
:data:`EXACT_LIMIT` elements are not compressed whole. A compressor that keeps
a fixed number of elements (it declares :meth:`~refcoll.compressors.base.Compressor.keeps`:
top-k and random-k's ``k = min(n, max(1, round(ratio·n)))``) keeps its own
rule, so its bytes stay exact. Every other array's element count is
extrapolated affinely in ``n`` from tensors of :data:`SAMPLE` and ``2·SAMPLE``
elements, with indices widened to int64 past ``2**31 - 1`` elements as the
compressors do: exact for none, fp16 and bf16 at any ``n``, and for sign,
1-bit, TernGrad, int8 and QSGD when ``n`` and ``SAMPLE`` are multiples of their
block or bucket (otherwise within one partial block). Threshold's payload
depends on the data: the model keeps the fraction of the standard normal sample
at or above the threshold, an assumption to replace with a real gradient's.

Spec: spec/model.md
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import Sequence

import numpy as np

from ..compressors import parse
from ..compressors.base import (
    Compressor,
    compute_dtype,
    index_dtype,
    split_feedback,
    too_many_ranks,
)
from ..core.chunking import max_chunk
from ..core.errors import UsageError
from .cluster import Cluster
from .pricing import Estimate, Phase, allreduce_estimate, local_phase, steps_phase

__all__ = [
    "EXACT_LIMIT",
    "SAMPLE",
    "compressed_estimate",
    "payload_arrays",
    "factor_elements",
    "powersgd_elements",
    "chosen_pattern",
    "needs_shapes",
]

#: Tensors up to this many elements are compressed whole to find their payload.
EXACT_LIMIT = 1 << 18

#: Larger tensors' payloads are extrapolated from tensors of SAMPLE and 2·SAMPLE elements.
SAMPLE = 1 << 17

#: The collective an estimate names for the patterns that run their own, not an all-reduce.
_COLLECTIVE = {"gather": "ring allgather", "twophase": "all-to-all + allgather"}


@functools.lru_cache(maxsize=256)
def _compressor(spec: str) -> Compressor:
    return parse(spec)


def _innermost(spec: str) -> Compressor:
    """Return the compressor of ``spec`` inside any error feedback."""
    return split_feedback(_compressor(spec))[0]


def needs_shapes(spec: str) -> bool:
    """Return whether ``spec`` compresses each tensor as a matrix, so it needs the layer shapes."""
    return _compressor(spec).matrices


def chosen_pattern(spec: str, pattern: str | None) -> str:
    """Return ``pattern``, or the compressor's default; refuse one it does not allow."""
    comp = _compressor(spec)
    chosen = pattern or comp.patterns[0]
    if chosen not in comp.patterns:
        raise UsageError(f"compressor {spec!r} allows the patterns {', '.join(comp.patterns)}, "
                         f"not {chosen!r}")
    return chosen


def _real_arrays(spec: str, count: int, dtype: np.dtype) -> tuple[tuple[str, int, int], ...]:
    """Compress a standard normal tensor of ``count`` elements; return its wire arrays."""
    comp = _compressor(spec)
    x = np.random.default_rng(0).standard_normal(count).astype(dtype)
    payload = comp.compress(x, comp.new_state())
    return tuple((role, int(a.size), int(a.dtype.itemsize))
                 for role, a in sorted(payload.arrays.items()))


@functools.lru_cache(maxsize=4096)
def payload_arrays(spec: str, count: int, dtype: str) -> tuple[tuple[str, int, int], ...]:
    """Return ``(role, elements, itemsize)`` of each wire array of a flat tensor's payload.

    Up to :data:`EXACT_LIMIT` elements the real compressor compresses a standard
    normal tensor of ``count`` elements. Past it: a compressor that declares how
    many elements it keeps (:meth:`~refcoll.compressors.base.Compressor.keeps`)
    keeps that many in every array; every other array's count is extrapolated
    affinely from tensors of :data:`SAMPLE` and ``2·SAMPLE`` elements; indices
    take the width the compressors give them at ``count`` elements.
    ``Σ elements·itemsize`` is ``Payload.nbytes``.
    """
    dt = np.dtype(dtype)
    if count <= EXACT_LIMIT:
        return _real_arrays(spec, count, dt)
    small, large = _real_arrays(spec, SAMPLE, dt), _real_arrays(spec, 2 * SAMPLE, dt)
    kept = _innermost(spec).keeps(count)
    arrays = []
    for (role, a, itemsize), (_, b, _) in zip(small, large):
        if kept is not None:
            elements = kept
        else:
            elements = a + ((b - a) * (count - SAMPLE) + SAMPLE // 2) // SAMPLE
        if role == "indices":
            itemsize = index_dtype(count).itemsize
        arrays.append((role, elements, itemsize))
    return tuple(arrays)


def factor_elements(spec: str, shapes: Sequence[tuple[int, ...]]) -> tuple[int, int, int]:
    """Return a matrix compressor's ``(Σ first factor, Σ second factor, elements sent whole)``.

    Each shape goes through the compressor's
    :meth:`~refcoll.compressors.base.Compressor.shared_factors`: PowerSGD's
    ``P`` (``m·r``) and ``Q`` (``n·r``) in the compute dtype for a matrix it
    compresses; vectors, and matrices where compression does not pay, go whole
    in the gradient's dtype.
    """
    inner = _innermost(spec)
    p_elements = q_elements = whole = 0
    for shape in shapes:
        factors = inner.shared_factors(tuple(shape))
        if factors is None:
            whole += math.prod(shape)
        else:
            p_part, q_part = factors
            p_elements += p_part
            q_elements += q_part
    return p_elements, q_elements, whole


#: The name ``refcoll.model`` has always given :func:`factor_elements`.
powersgd_elements = factor_elements


def compressed_estimate(cluster: Cluster, spec: str, shapes: Sequence[tuple[int, ...]],
                        dtype, algorithm: str = "ring", *, pattern: str | None = None,
                        inter: str = "ring", layered: bool = False) -> Estimate:
    """Return the phases of a compressed all-reduce of the tensors ``shapes`` on ``cluster``.

    A matrix compressor (PowerSGD) compresses each tensor (it needs the shapes)
    and sums all first factors in one all-reduce, then all second ones, as
    PyTorch's PowerSGD hook does per bucket; every other compressor compresses
    the tensors as one flat buffer, as a communication hook does with a bucket.
    ``algorithm`` and ``inter`` serve the ``allreduce`` pattern only. ``layered``
    says the shapes are real layers (a bucket of one bias vector is sent whole),
    not one flat parameter count.

    Raises:
        UsageError: a pattern the compressor does not allow; a flat parameter
            count for a compressor that needs the layer shapes.
    """
    dt = np.dtype(dtype)
    chosen = chosen_pattern(spec, pattern)
    n = sum(math.prod(s) for s in shapes)
    if chosen == "allreduce":
        return _allreduce(cluster, spec, shapes, dt, n, algorithm, inter, layered)
    if chosen == "gather":
        return _gather(cluster, spec, dt, n)
    return _twophase(cluster, spec, dt, n)


def _allreduce(cluster: Cluster, spec: str, shapes, dt: np.dtype, n: int, algorithm: str,
               inter: str, layered: bool = False) -> Estimate:
    """Price the ``allreduce`` pattern: the payload's arrays through ``algorithm``."""
    itemsize, dense = dt.itemsize, n * dt.itemsize
    inner = _innermost(spec)
    if inner.most_ranks is not None and cluster.gpus > inner.most_ranks:
        raise UsageError(too_many_ranks(inner, cluster.gpus))
    phases: list[Phase] = []

    def all_reduced(role: str, count: int, size: int) -> None:
        if count:
            for ph in allreduce_estimate(cluster, algorithm, count, size, inter=inter).phases:
                phases.append(replace(ph, name=f"{role}: {ph.name}"))

    if inner.matrices:
        if not layered and len(shapes) == 1 and len(shapes[0]) < 2 and n > 1:
            raise UsageError(f"compressor {spec!r} compresses each layer as a matrix, so its "
                             "ratio comes from the layer shapes: give --layers, not --params "
                             "(a flat parameter count)")
        factor = compute_dtype(dt).itemsize
        p_el, q_el, whole = factor_elements(spec, shapes)
        payload = (p_el + q_el) * factor + whole * itemsize
        matrices = dense - whole * itemsize
        phases.append(local_phase(cluster, "compress (M·Q, Mᵀ·P)", 2 * matrices))
        all_reduced("P", p_el, factor)
        all_reduced("Q", q_el, factor)
        all_reduced("uncompressed", whole, itemsize)
        phases.append(local_phase(cluster, "decompress (P·Qᵀ)", matrices))
    else:
        arrays = payload_arrays(spec, n, dt.name)
        payload = sum(c * s for _, c, s in arrays)
        if not inner.identity:
            phases.append(local_phase(cluster, "compress", dense))
        for role, count, size in arrays:
            all_reduced(role, count, size)
        if not inner.identity:
            phases.append(local_phase(cluster, "decompress", dense))
    return Estimate(algorithm, tuple(phases), "allreduce", spec, payload, dense)


def _ring_link(cluster: Cluster) -> str:
    """Return the link a flat ring allgather's steps wait for (one flow a node boundary)."""
    return cluster.shape.flat_ring_link()


def _gather(cluster: Cluster, spec: str, dt: np.dtype, n: int) -> Estimate:
    """Price the ``gather`` pattern: counts and payloads round a ring allgather."""
    p, dense, link = cluster.gpus, n * dt.itemsize, _ring_link(cluster)
    arrays = payload_arrays(spec, n, dt.name)
    payload = sum(c * s for _, c, s in arrays)
    phases = [local_phase(cluster, "compress", dense)]
    if p > 1:
        phases.append(steps_phase(cluster, "counts allgather", link, p - 1, 8 * len(arrays)))
        phases.append(steps_phase(cluster, "payload allgather", link, p - 1, payload))
    phases.append(local_phase(cluster, f"decompress and sum {p} payloads", p * dense))
    return Estimate(_COLLECTIVE["gather"], tuple(phases), "gather", spec, payload, dense)


def _twophase(cluster: Cluster, spec: str, dt: np.dtype, n: int) -> Estimate:
    """Price the ``twophase`` pattern: all-to-all of chunks, recompress, chunk allgather."""
    p, g = cluster.gpus, cluster.gpus_per_node
    dense, link = n * dt.itemsize, _ring_link(cluster)
    chunk = max_chunk(n, p)
    arrays = payload_arrays(spec, chunk, dt.name)
    part = sum(c * s for _, c, s in arrays)
    phases = [local_phase(cluster, "compress chunks", dense)]
    if p > 1:
        phases.append(steps_phase(cluster, "counts allgather", link, p - 1,
                                  8 * len(arrays) * p))
        phases.append(steps_phase(cluster, "all-to-all (intra)", "intra", g - 1, part))
        phases.append(steps_phase(cluster, "all-to-all (inter)", "inter", p - g, part))
    phases.append(local_phase(cluster, f"sum {p} chunks and recompress",
                              (p + 1) * chunk * dt.itemsize))
    if p > 1:
        phases.append(steps_phase(cluster, "counts allgather", link, p - 1, 8 * len(arrays)))
        phases.append(steps_phase(cluster, "chunk allgather", link, p - 1, part))
    phases.append(local_phase(cluster, "decompress", dense))
    return Estimate(_COLLECTIVE["twophase"], tuple(phases), "twophase", spec, p * part, dense)
