"""The reducer's layout: its parameters, DDP's bucket assignment, and the bucket a hook sees.

:func:`assign_buckets` is PyTorch's ``compute_bucket_assignment_by_size``
(``torch/csrc/distributed/c10d/reducer.cpp``) as refcoll's
:class:`~refcoll.training.reducer.Reducer` applies it, :class:`BucketLayout` the record of
one bucket (DDP's ``Bucket``: its variables, offsets and lengths), and
:class:`GradBucket` what a communication hook is handed (DDP's ``GradBucket``,
``torch/csrc/distributed/c10d/comm.hpp``). All of that is pure. Last, what the
ranks exchange to agree on a layout or on an iteration's problems:
:func:`gather_json` moves a record from every rank to every rank, and
:func:`first_difference` names the first field of a layout that differs.

Spec: spec/reducer.md
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..calls.agree import allgather_records, pack, unpack
from ..calls.collectives import allreduce_init
from ..compressors.collective import compressed_allreduce
from ..core.errors import UsageError
from ..core.ops import dtype_name, get_dtype

__all__ = ["Parameter", "parameters_of", "MIB", "cap_bytes", "assign_buckets", "BucketLayout",
           "layouts", "GradBucket", "gather_json", "first_difference", "NAMED"]

#: Bytes in the reducer's megabyte: DDP's ``_MB_TO_BYTES`` (a MiB).
MIB = 1 << 20

#: How many ranks or parameters a message names before it says "and N more".
NAMED = 8


@dataclass(frozen=True)
class Parameter:
    """One parameter as the reducer knows it: its position, name, shape and dtype."""

    index: int
    name: str | None
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def numel(self) -> int:
        """Return the number of elements of its gradient."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Return the bytes of its gradient (DDP's ``numel() * element_size()``)."""
        return self.numel * self.dtype.itemsize

    def key(self) -> str:
        """Return ``float32[4, 5]``: what every rank must agree on about this parameter."""
        return f"{dtype_name(self.dtype)}[{', '.join(map(str, self.shape))}]"

    def describe(self) -> str:
        """Return ``parameter 3 'fc.weight' float32[4, 5]`` for messages."""
        name = f" {self.name!r}" if self.name is not None else ""
        return f"parameter {self.index}{name} {self.key()}"


def _dtype(dtype) -> np.dtype:
    """Return the NumPy dtype of ``dtype``, a torch dtype (``torch.float32``) included."""
    try:
        return get_dtype(dtype)
    except UsageError:
        return get_dtype(str(dtype).removeprefix("torch."))


def _is_shape(item) -> bool:
    return isinstance(item, (int, np.integer)) or (
        isinstance(item, (tuple, list)) and all(isinstance(s, (int, np.integer)) for s in item))


def _shape_and_dtype(item) -> tuple[tuple[int, ...], np.dtype]:
    """Return the shape and dtype an array, a shape or a ``(shape, dtype)`` pair gives."""
    if hasattr(item, "shape") and hasattr(item, "dtype"):
        return tuple(int(s) for s in item.shape), _dtype(item.dtype)
    if _is_shape(item):
        shape = (int(item),) if np.ndim(item) == 0 else tuple(int(s) for s in item)
        return shape, np.dtype(np.float32)
    if isinstance(item, (tuple, list)) and len(item) == 2 and _is_shape(item[0]):
        return _shape_and_dtype(item[0])[0], _dtype(item[1])
    raise UsageError(f"cannot read a parameter from {item!r}: give an array, a shape "
                     "(float32) or a (shape, dtype) pair")


def parameters_of(spec) -> list[Parameter]:
    """Return the parameters ``spec`` describes, in its order (forward/definition order).

    ``spec`` is a list of arrays, of shapes (float32), of ``(shape, dtype)`` pairs
    or of ``(name, array)`` pairs, or a dict ``name -> array``.
    """
    items = list(spec.items()) if isinstance(spec, Mapping) else list(spec)
    if not items:
        raise UsageError("a Reducer needs at least one parameter (DDP: 'Expected at least one "
                         "parameter')")
    params = []
    for index, item in enumerate(items):
        name = None
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            name, item = item
        shape, dtype = _shape_and_dtype(item)
        if any(s < 0 for s in shape):
            raise UsageError(f"parameter {index}{f' ({name})' if name else ''} has the shape "
                             f"{shape}: a dimension cannot be negative")
        params.append(Parameter(index, name, shape, dtype))
    return params


def cap_bytes(mb: float, what: str) -> int:
    """Return a cap given in MiB as bytes, as DDP does (``int(mb * _MB_TO_BYTES)``)."""
    if isinstance(mb, bool) or not isinstance(mb, numbers.Real) or not 0 < mb < math.inf:
        raise UsageError(f"{what} must be a positive, finite number of MiB, got {mb!r}")
    return int(mb * MIB)


def assign_buckets(nbytes: Sequence[int], dtypes: Sequence, order: Sequence[int],
                   first_cap: int, cap: int) -> list[list[int]]:
    """Group parameters into buckets: DDP's ``compute_bucket_assignment_by_size``.

    Walk the parameters in ``order``. Each dtype has one open bucket: add the
    parameter to its dtype's; once that bucket holds ``>=`` its limit in bytes,
    close it. A dtype's first bucket has the limit ``first_cap``, its later ones
    ``cap``. At the end the open buckets close. Buckets are ordered by the
    position, in ``order``, of their first parameter, and list their parameters
    in the order they were added.

    Args:
        nbytes, dtypes: each parameter's gradient bytes and dtype, by index.
        order: the parameter indices in the order gradients are expected.
        first_cap, cap: the limits in bytes.
    """
    open_buckets: dict = {}  # dtype -> (position of its first parameter, indices, bytes)
    closed: dict = {}  # dtype -> how many of its buckets have closed
    done: list[tuple[int, list[int]]] = []
    for position, index in enumerate(order):
        key = np.dtype(dtypes[index])
        start, members, size = open_buckets.get(key, (position, [], 0))
        members.append(index)
        size += nbytes[index]
        limit = first_cap if closed.get(key, 0) == 0 else cap
        if size >= limit:
            done.append((start, members))
            closed[key] = closed.get(key, 0) + 1
            open_buckets.pop(key, None)
        else:
            open_buckets[key] = (start, members, size)
    done.extend((start, members) for start, members, _ in open_buckets.values())
    return [members for _, members in sorted(done, key=lambda pair: pair[0])]


@dataclass(frozen=True)
class BucketLayout:
    """One bucket: which parameters it holds and where (DDP's ``Bucket``).

    Attributes:
        index: its position; buckets launch in index order.
        params: its parameter indices, in bucket order (the order of its flat buffer).
        dtype: the dtype of every parameter in it.
        numel, nbytes: the size of its flat buffer.
        offsets: where each parameter's gradient starts in the buffer, in elements.
    """

    index: int
    params: tuple[int, ...]
    dtype: np.dtype
    numel: int
    nbytes: int
    offsets: tuple[int, ...]


def layouts(params: Sequence[Parameter], groups: Sequence[Sequence[int]]) -> list[BucketLayout]:
    """Return the bucket records of ``groups`` (lists of parameter indices), in order."""
    out = []
    for index, group in enumerate(groups):
        offsets, numel = [], 0
        for i in group:
            offsets.append(numel)
            numel += params[i].numel
        dtype = params[group[0]].dtype
        out.append(BucketLayout(index, tuple(group), dtype, numel, numel * dtype.itemsize,
                                tuple(offsets)))
    return out


class GradBucket:
    """What a communication hook is handed: one bucket, as DDP's ``GradBucket``.

    The method names are torch's (``torch.distributed.GradBucket``);
    :meth:`parameters` gives parameter indices rather than tensors.
    """

    def __init__(self, layout: BucketLayout, buffer: np.ndarray, shapes: Sequence[tuple],
                 last: bool):
        self._layout, self._buffer, self._shapes, self._last = layout, buffer, shapes, last

    def index(self) -> int:
        """Return the bucket's index (its launch position)."""
        return self._layout.index

    def buffer(self) -> np.ndarray:
        """Return the bucket's flat buffer: every gradient of it, undivided, in bucket order."""
        return self._buffer

    def parameters(self) -> list[int]:
        """Return the indices of the bucket's parameters, in bucket order."""
        return list(self._layout.params)

    def gradients(self) -> list[np.ndarray]:
        """Return views of the buffer, one per parameter, shaped as the parameter."""
        return [self._buffer[off:off + math.prod(shape)].reshape(shape)
                for off, shape in zip(self._layout.offsets, self._shapes)]

    def is_last(self) -> bool:
        """Return whether this is the iteration's last bucket to be reduced."""
        return self._last


# ------------------------------------------- what every rank must agree on

def gather_json(t, obj, size: int = 512) -> list:
    """Return every rank's ``obj`` (JSON), in rank order: one fixed-size round, two when large.

    The first round's records are ``size`` bytes and carry ``obj`` if it fits, its
    length always; if any did not fit, a second round of records as long as the
    longest carries them all. Every rank sees the same first round, so every rank
    takes the same number of rounds.
    """
    length = len(json.dumps(obj).encode())
    first = [unpack(r) for r in allgather_records(
        t, pack(({"v": obj, "n": length}, {"n": length}), size))]
    if all("v" in row for row in first):
        return [row["v"] for row in first]
    longest = max(row["n"] for row in first)
    return [unpack(r) for r in allgather_records(t, pack((obj,), longest))]


def _who_has(values: list) -> str:
    """Return ``rank 0 has A, rank 3 has B``: the majority once, then every rank that differs."""
    texts = [str(v) for v in values]
    majority = max(texts, key=texts.count)  # ties: the lowest rank's, the same on every rank
    odd = [r for r, v in enumerate(texts) if v != majority]
    parts = [f"rank {texts.index(majority)} has {majority}"]
    parts += [f"rank {r} has {texts[r]}" for r in odd[:NAMED]]
    return ", ".join(parts) + (f" (and {len(odd) - NAMED} more ranks)" if len(odd) > NAMED
                               else "")


def first_difference(rows: list[dict]) -> str | None:
    """Return the first field of the ranks' layout records that differs, with who has what."""
    counts = [len(row["params"]) for row in rows]
    checks = [("the number of parameters", counts)]
    names = rows[0]["names"]
    for i in range(min(counts)):
        label = f"parameter {i}" + (f" {names[i]!r}" if names[i] is not None else "")
        checks.append((label, [row["params"][i] for row in rows]))
    checks += [(key, [row["settings"].get(key) for row in rows]) for key in rows[0]["settings"]]
    for what, values in checks:
        if len({str(v) for v in values}) > 1:
            return f"{what}: {_who_has(values)}"
    return None


def same_dtype(dtype, wanted: np.dtype) -> bool:
    """Return whether ``dtype`` is the NumPy dtype ``wanted``."""
    try:
        return dtype is not None and np.dtype(dtype) == wanted
    except TypeError:  # not a NumPy dtype (a torch tensor's): not the parameter's
        return False


def bucket_plans(buffers, t, algorithm: str, wanted: bool = True, old=()) -> list:
    """Return each bucket's all-reduce, summed in place, as a plan.

    Collective: every rank, in order.

    A bucket's all-reduce repeats on the same buffer every iteration: agreed
    and recorded once (:func:`refcoll.allreduce_init`), started every time.
    ``wanted=False``: none (a hook or a compressor reduces its own way). The
    ``old`` plans (of the layout before a rebuild) are freed first.
    """
    for plan in old:
        plan.free()
    return [allreduce_init(buf, t, op="sum", algorithm=algorithm, out=buf, validate=False)
            for buf in buffers] if wanted else []


def used_map(n: int, t, find_unused: bool):
    """Return DDP's local used map of ``n`` parameters and its summing plan.

    The plan is None without ``find_unused``.
    """
    used = np.zeros(n, np.int32)
    plan = allreduce_init(used, t, op="sum", algorithm="ring", validate=False) if find_unused \
        else None
    return used, plan


def divide_then_sum(views, p: int, plan, t):
    """A bucket of slots written in place: each divided by ``p`` (DDP's ``div_``), then summed.

    ``plan``: the bucket's all-reduce plan (:func:`refcoll.allreduce_init`, in place).
    """
    for view in views:  # p exact, as torch's div_ by an int computes (a 16-bit float's in
        wide = np.float64 if view.dtype == np.float64 else np.float32  # float32, its opmath)
        np.divide(view, wide(p), out=view, dtype=wide, casting="unsafe")
    return plan()


def compress_each(views, states, compressor, algorithm: str, buf, t, validate: bool = False):
    """All-reduce each view of ``buf`` compressed, in its shape with its own state; return ``buf``.

    ``op="avg"``, in place.

    For a compressor of matrices (``Compressor.matrices``: PowerSGD), which
    compresses a tensor as a matrix and sends a flat bucket uncompressed: each
    parameter's view of the bucket goes through it alone, as PyTorch's
    ``powerSGD_hook`` compresses each tensor of a bucket. Every rank makes the
    same calls in the same order.
    """
    for view, state in zip(views, states):
        compressed_allreduce(view, t, op="avg", algorithm=algorithm, compressor=compressor,
                             state=state, out=view, validate=validate)
    return buf


def compressor_states(compressor, seed: int, b: int, n: int, rank: int):
    """Return bucket ``b``'s compressor state: seed ``seed + b``; for a compressor of
    matrices, a list of one per parameter ``j`` of its ``n``, seed ``seed + 65536·b + j``."""
    if compressor.matrices:
        return [compressor.new_state(seed=seed + 65536 * b + j, rank=rank) for j in range(n)]
    return compressor.new_state(seed=seed + b, rank=rank)


def reduce_compressed(compressor, states, views, buf, algorithm: str, t):
    """A bucket's compressed all-reduce, ``op="avg"``, in place: whole, or view by view."""
    if compressor.matrices:
        return compress_each(views, states, compressor, algorithm, buf, t)
    return compressed_allreduce(buf, t, op="avg", compressor=compressor, state=states,
                                algorithm=algorithm, out=buf, validate=False)[0]

