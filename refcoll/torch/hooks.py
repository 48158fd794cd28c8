"""DDP communication hooks that run refcoll's all-reduce on each gradient bucket.

::

    import refcoll.torch as rt
    state, hook = rt.comm_hook(algorithm="ring")               # or compressor="ef(topk:ratio=0.01)"
    ddp_model.register_comm_hook(state, hook)

The contract is DDP's (``torch/distributed/algorithms/ddp_comm_hooks``): the hook is
handed a ``GradBucket`` of *undivided* gradients, must return a
``torch.futures.Future`` of a tensor of the bucket's size, and that tensor must be
the average. refcoll's hook returns ``fl(Σ_r g_r) / p``: ``op="avg"``, the sum in
the algorithm's documented order and one division (the same bits as
``refcoll.simulate("allreduce", buckets, algorithm=..., op="avg")``). It runs as a
non-blocking call on the group's progress engine, in place in the bucket, so the
bucket's reduction overlaps the rest of the backward pass as DDP's does.

With a compressor each bucket keeps a :class:`~refcoll.compressors.base.CompressorState`
(an error-feedback residual) from one iteration to the next; a compressor of
matrices (PowerSGD) keeps one per parameter instead, each view of the bucket
compressed in its parameter's shape (:func:`average`).
DDP rebuilds its buckets once, after the first iteration (in the order gradients
became ready), so a bucket index names other parameters before and after; the
state is therefore keyed by the bucket's parameters, not its index, and when a new
layout appears the residual of each parameter is carried into the new bucket at
that parameter's new offset (PyTorch's ``powerSGD_hook`` instead waits for
``start_powerSGD_iter >= 2`` before compressing, and keys by index).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..calls.collectives import allreduce_init
from ..calls.nonblocking import issue
from ..compressors import Compressor, parse
from ..compressors.collective import compressed_allreduce
from ..compressors.patterns.twophase import carried
from ..compressors.patterns.twophase import owed as owes
from ..core.errors import UsageError
from ..core.xp import address
from ..training.buckets import compress_each
from ..transport.torch import torch_transport_for
from .tensors import as_array

__all__ = ["comm_hook", "HookState", "refcoll_hook", "average", "bucket_layout"]


#: A bucket's layout: ``(key, shape)`` of each parameter, in the bucket's order
#: (``key`` is the parameter's ``id``, stable for the life of the model).
Layout = tuple


def bucket_layout(bucket) -> Layout:
    """Return the layout of a DDP ``GradBucket``: each parameter's key and shape, in order."""
    return tuple((id(p), tuple(p.shape)) for p in bucket.parameters())


@dataclass
class _Slot:
    """One bucket layout's compressor state and where its parameters sit in the bucket."""

    state: object
    offsets: dict  # parameter key -> (offset, numel)


@dataclass
class HookState:
    """What :func:`refcoll_hook` keeps between calls; the first element of :func:`comm_hook`.

    Attributes:
        algorithm: the all-reduce algorithm (a name from ``refcoll list``).
        compressor: the :class:`~refcoll.compressors.base.Compressor`, or ``None``.
        group: the process group (``None``: the default group, as DDP's).
        seed: compressor states are seeded ``seed + index`` (a bucket layout's, by the
            index of the bucket where it first appeared) or ``seed + 65536·index + j``
            (parameter ``j`` of that bucket, for a compressor of matrices): the same
            on every rank.
        record: keep each bucket's last input and output (:attr:`last`), to check
            them against :func:`refcoll.simulate`.
        sent, received: bytes this rank has sent and received in the hook's calls.
        calls: bucket all-reduces run; layouts: bucket layouts seen (DDP's
            rebuild adds some after the first iteration); carried: parameters
            whose residual moved into a rebuilt bucket.
        last: with ``record``, ``{bucket index: (input, output)}`` of the last
            iteration, as NumPy arrays.
    """

    algorithm: str = "ring"
    compressor: Compressor | None = None
    group: object = None
    seed: int = 0
    record: bool = False
    sent: int = 0
    received: int = 0
    calls: int = 0
    layouts: int = 0
    carried: int = 0
    plans: dict = field(default_factory=dict, repr=False)  # bucket index -> (layout, plan)
    last: dict = field(default_factory=dict)
    _slots: dict = field(default_factory=dict, repr=False)
    _tensors: dict = field(default_factory=dict, repr=False)

    def slot(self, layout: Layout, index: int, rank: int) -> _Slot:
        """Return the compressor state of a bucket layout, made (and carried) on first sight."""
        key = tuple(k for k, _ in layout)
        found = self._slots.get(key)
        if found is not None:
            return found
        offsets, at = {}, 0
        for k, shape in layout:
            offsets[k] = (at, math.prod(shape))
            at += math.prod(shape)
        slot = _Slot(self.compressor.new_state(seed=self.seed + index, rank=rank), offsets)
        self._carry(slot, at, rank)
        self._slots[key] = slot
        self.layouts += 1
        return slot

    def tensor_state(self, key: int, index: int, j: int, rank: int):
        """Return parameter ``key``'s own compressor state (for a compressor of matrices)."""
        found = self._tensors.get(key)
        if found is None:
            found = self._tensors[key] = self.compressor.new_state(
                seed=self.seed + 65536 * index + j, rank=rank)
        return found

    def _carry(self, new: _Slot, length: int, rank: int) -> None:
        """Move each parameter's residual from the layouts it was in before into ``new``.

        What a layout still owes is its worker residual and, for a two-phase
        compressor (``ef(sign)``, ``ef(onebit)``), its server residual: this rank's
        chunk of the old bucket, which no chunk of the new one matches. That is
        folded into this rank's worker residual over the chunk, times ``p`` (the
        hook averages): the next average owes it as the server would have, and no
        error is lost at the rebuild.
        """
        pieces = []
        for old_key, old in list(self._slots.items()):
            moved = [pid for pid in old.offsets if pid in new.offsets]
            if not moved:
                continue
            debt = owes(old.state, rank)
            pieces += [(debt, *old.offsets[pid], new.offsets[pid][0]) for pid in moved]
            self.carried += len(moved) if debt is not None else 0
            for pid in moved:
                del old.offsets[pid]
            if not old.offsets:
                del self._slots[old_key]  # every parameter of that layout has moved on
        new.state.residual = carried(length, pieces)


def average(state: HookState, x: np.ndarray, layout: Layout, index: int, t) -> None:
    """All-reduce bucket ``index`` (flat ``x``, undivided) to its average in place, as hooks do.

    Uncompressed: one all-reduce of the bucket, ``op="avg"``. A compressor of
    vectors (top-k, quantizers...) compresses the bucket whole, with the state of
    its layout. A compressor of matrices (PowerSGD) needs the shapes: each
    parameter's view of the bucket is all-reduced in its own shape with its own
    state, as PyTorch's ``powerSGD_hook`` compresses each tensor of a bucket
    (vectors go uncompressed, which the compressor decides itself). Every rank
    makes the same calls in the same order.
    """
    if state.compressor is None:
        bucket_plan(state, x, layout, index, t)()
    elif state.compressor.matrices:
        views, states, at = [], [], 0
        for j, (key, shape) in enumerate(layout):
            n = math.prod(shape)
            views.append(x[at:at + n].reshape(shape))
            states.append(state.tensor_state(key, index, j, t.rank))
            at += n
        compress_each(views, states, state.compressor, state.algorithm, x, t, validate=True)
    else:
        compressed_allreduce(x, t, op="avg", algorithm=state.algorithm,
                             compressor=state.compressor,
                             state=state.slot(layout, index, t.rank).state, out=x)


def bucket_plan(state: HookState, x: np.ndarray, layout: Layout, index: int, t):
    """Return bucket ``index``'s all-reduce plan (``op="avg"``, in place on ``x``).

    A bucket's all-reduce repeats every iteration on the same parameters: one
    plan (:func:`refcoll.allreduce_init`), made when the bucket's layout is new,
    which every rank sees at the same iteration (DDP's buckets are the same on
    every rank), so the plan is made collectively. Where PyTorch moved the
    bucket's buffer, the plan follows it on this rank alone (:meth:`Plan.rebind`).
    """
    kept = state.plans.get(index)
    if kept is None or kept[0] != layout:
        if kept is not None:
            kept[1].free()
        kept = state.plans[index] = (layout, allreduce_init(x, t, op="avg",
                                                            algorithm=state.algorithm, out=x))
    plan = kept[1]
    if plan.x is not x and (plan.x.shape != x.shape or address(plan.x) != address(x)):
        plan.rebind(x)
    return plan


def comm_hook(algorithm: str = "ring", compressor=None, *, group=None, seed: int = 0,
              record: bool = False):
    """Return ``(state, hook)`` for ``DistributedDataParallel.register_comm_hook``.

    Args:
        algorithm: refcoll's all-reduce for each bucket (``ring``, ``rabenseifner``,
            ``auto``...); with ``compressor``, the algorithm of its pattern.
        compressor: a spec string (``"ef(topk:ratio=0.01)"``, ``"powersgd:rank=2"``)
            or a :class:`~refcoll.compressors.base.Compressor`: each bucket is
            all-reduced compressed, with state kept per bucket layout.
        group: the process group DDP reduces over (``None``: the default group).
        seed: the compressor states' seed (the same on every rank).
        record: keep each bucket's last input and output in ``state.last``.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise UsageError(f"seed= takes a whole number from 0 (its compressor states' seeds "
                         f"count up from it), got {seed!r}")
    if compressor is not None and not isinstance(compressor, Compressor):
        if not isinstance(compressor, str):
            raise UsageError(f"compressor= takes a spec string or a Compressor, got "
                             f"{type(compressor).__name__}")
        compressor = parse(compressor)
    return HookState(algorithm=algorithm, compressor=compressor, group=group, seed=seed,
                     record=record), refcoll_hook


def refcoll_hook(state: HookState, bucket):
    """DDP comm hook: refcoll's non-blocking all-reduce (``op="avg"``) of ``bucket``, in place.

    Returns a ``torch.futures.Future`` that completes with the bucket's buffer
    holding the average, or with the call's error (every rank's, as refcoll
    raises it) for DDP's ``wait()`` to raise: raised from a ``then`` callback, as
    torch's own hooks chain theirs, since DDP reads a future given an exception
    with ``set_exception`` as its result ("Unable to cast ... to Tensor").
    """
    import torch

    buffer = bucket.buffer()
    index = bucket.index()
    layout = bucket_layout(bucket)
    t = torch_transport_for(state.group)
    done = torch.futures.Future()
    failure: list[BaseException] = []

    def job(t):
        try:
            if buffer.layout != torch.strided:  # every rank's model alike: each raises it
                raise UsageError(f"rank {t.rank}: bucket {index} holds a {buffer.layout} "
                                 "gradient (Embedding(sparse=True)?): refcoll's hook reduces "
                                 "dense buckets; use sparse=False, or DDP's own all-reduce")
            x = as_array(buffer, t, f"bucket {index}")
            if x.size != sum(math.prod(shape) for _, shape in layout):
                raise UsageError(f"rank {t.rank}: bucket {index} holds {x.size} elements, its "
                                 "parameters more or fewer: not DDP's plain concatenation")
            before = x.copy() if state.record else None
            sent, received = t.traffic.snapshot()
            average(state, x, layout, index, t)
            now_sent, now_received = t.traffic.snapshot()
            state.sent += now_sent - sent
            state.received += now_received - received
            state.calls += 1
            if state.record:
                if index == 0:  # DDP reduces buckets in index order: a new iteration
                    state.last.clear()
                state.last[index] = (before, x.copy())
        except BaseException as exc:  # noqa: BLE001 - DDP raises it from the future
            failure.append(exc)
            done.set_result(None)
            raise
        done.set_result(None)

    def outcome(_):
        if failure:
            raise failure[0]
        return buffer

    issue("allreduce", t, job)
    return done.then(outcome)
