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
(error-feedback residual, PowerSGD's warm start) from one iteration to the next.
DDP rebuilds its buckets once, after the first iteration (in the order gradients
became ready), so a bucket index names other parameters before and after; the
state is therefore keyed by the bucket's parameters, not its index, and when a new
layout appears the residual of each parameter is carried into the new bucket at
that parameter's new offset (PyTorch's ``powerSGD_hook`` instead waits for
``start_powerSGD_iter >= 2`` before compressing, and keys by index).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..calls.collectives import allreduce
from ..calls.nonblocking import issue
from ..compressors import Compressor, parse
from ..core.errors import UsageError
from ..transport.torch import torch_transport_for
from .tensors import as_array

__all__ = ["comm_hook", "HookState", "refcoll_hook"]


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
        seed: bucket layouts' compressor states are seeded ``seed + index``, the
            index of the bucket where the layout first appeared (the same on every rank).
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
    last: dict = field(default_factory=dict)
    _slots: dict = field(default_factory=dict, repr=False)

    def slot(self, bucket, rank: int) -> _Slot:
        """Return the compressor state of ``bucket``'s layout, made (and carried) on first sight."""
        params = bucket.parameters()
        key = tuple(id(p) for p in params)
        found = self._slots.get(key)
        if found is not None:
            return found
        offsets, at = {}, 0
        for p in params:
            offsets[id(p)] = (at, p.numel())
            at += p.numel()
        state = self.compressor.new_state(seed=self.seed + bucket.index(), rank=rank)
        slot = _Slot(state, offsets)
        self._carry(slot, at)
        self._slots[key] = slot
        self.layouts += 1
        return slot

    def _carry(self, new: _Slot, length: int) -> None:
        """Move each parameter's residual from the layouts it was in before into ``new``."""
        residual = None
        for old_key, old in list(self._slots.items()):
            moved = [pid for pid in old.offsets if pid in new.offsets]
            if not moved:
                continue
            if old.state.residual is not None:
                if residual is None:
                    residual = np.zeros(length, old.state.residual.dtype)
                for pid in moved:
                    (src, n), (dst, _) = old.offsets[pid], new.offsets[pid]
                    residual[dst:dst + n] = old.state.residual[src:src + n]
                    self.carried += 1
            for pid in moved:
                del old.offsets[pid]
            if not old.offsets:
                del self._slots[old_key]  # every parameter of that layout has moved on
        new.state.residual = residual


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
    raises it) for DDP's ``wait()`` to raise.
    """
    import torch

    buffer = bucket.buffer()
    index = bucket.index()
    t = torch_transport_for(state.group)
    slot = state.slot(bucket, t.rank) if state.compressor is not None else None
    future = torch.futures.Future()

    def job(t):
        try:
            x = as_array(buffer, t, f"bucket {index}")
            before = x.copy() if state.record else None
            sent, received = t.traffic.snapshot()
            if slot is None:
                allreduce(x, t, op="avg", algorithm=state.algorithm, out=x)
            else:
                allreduce(x, t, op="avg", algorithm=state.algorithm, compressor=state.compressor,
                          state=slot.state, out=x)
            now_sent, now_received = t.traffic.snapshot()
            state.sent += now_sent - sent
            state.received += now_received - received
            state.calls += 1
            if state.record:
                if index == 0:  # DDP reduces buckets in index order: a new iteration
                    state.last.clear()
                state.last[index] = (before, x.copy())
        except BaseException as exc:  # noqa: BLE001 - DDP raises it from the future
            future.set_exception(exc)
            raise
        future.set_result(buffer)

    issue("allreduce", t, job)
    return future
