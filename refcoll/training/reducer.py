"""The bucketed gradient reducer: PyTorch DDP's ``Reducer``, point by point, over refcoll's calls.

    reducer = Reducer(params, comm, bucket_cap_mb=25, first_bucket_mb=1, algorithm="ring")
    for grad_index, grad in backward():          # last layer first
        reducer.ready(grad_index, grad)          # a full bucket starts its all-reduce now
    grads = reducer.finalize()                   # the averaged gradients, by parameter

What follows PyTorch (``torch/csrc/distributed/c10d/reducer.cpp``,
``torch/nn/parallel/distributed.py``); spec/reducer.md cites each point:

1. Buckets: parameters in reverse index order, one open bucket per dtype, closed
   once it holds ``>=`` its cap; a dtype's first bucket has the cap
   ``first_bucket_mb``, later ones ``bucket_cap_mb`` (``compute_bucket_assignment_by_size``,
   :func:`~refcoll.training.buckets.assign_buckets`).
2. :meth:`Reducer.ready` copies the gradient into its bucket, multiplying by
   ``fl(1/p)`` on the way (``copy_grad_to_bucket``; undivided for a hook or a
   compressor). A bucket whose last gradient arrived is ready; buckets launch in
   index order, every consecutive ready one from ``next_bucket`` on
   (``mark_bucket_ready``), each its plan started (``allreduce_init``, ``sum``).
3. :meth:`Reducer.finalize` first agrees, over a control communicator of its own,
   on what went wrong anywhere (a parameter never ready, ready twice, a bad
   argument), raising the same UsageError on every rank, then waits for every
   bucket and returns the gradients (``finalize_backward``).
4. After the first iteration the buckets are rebuilt once, in the order rank 0's
   gradients became ready (``rebuild_buckets``, ``sync_bucket_indices``).
5. ``find_unused=True``: parameters never ready are reduced as zeros and a used map
   is summed; parameters no rank used are left alone. ``no_sync()`` accumulates locally.

Averaging, to the bit: DDP multiplies each gradient by ``fl(1/p)`` and sums, so
the result is ``Σ_r fl(g_r · fl(1/p))`` in the algorithm's order, not refcoll's
``op="avg"``, ``fl(Σ_r g_r) / p``. For ``p`` a power of two the two are the same
bits (scaling by ``2^-k`` is exact, barring subnormals); for ``p = 3`` they differ
in general, by a few units in the last place.

Spec: spec/reducer.md
"""

from __future__ import annotations

import contextlib
import functools
import numbers
import time

import numpy as np

from .. import algorithms
from ..calls.collectives import as_transport, broadcast
from ..calls.nonblocking import issue, wait_all
from ..compressors import Compressor, parse
from ..compressors.patterns.twophase import carried
from ..compressors.patterns.twophase import owed as owes
from ..core.errors import MismatchError, RefcollError, UsageError
from ..core.ops import by_ieee_rules, is_float
from ..core.xp import address
from .buckets import (
    NAMED,
    BucketLayout,
    GradBucket,
    Parameter,
    assign_buckets,
    bucket_plans,
    cap_bytes,
    compressor_states,
    divide_then_sum,
    first_difference,
    gather_json,
    layouts,
    parameters_of,
    reduce_compressed,
    same_dtype,
    used_map,
)

__all__ = ["Reducer", "GradBucket", "BucketLayout", "Parameter", "assign_buckets"]

#: The rule of DDP that each problem breaks, quoted in its message.
_NEVER_READY = (
    "every parameter must get its gradient through ready(i, grad) before finalize(), in every "
    "iteration (DDP: \"Expected to have finished reduction in the prior iteration before "
    "starting a new one\"); for parameters a step does not use, build the Reducer with "
    "find_unused=True")
_TWICE = (
    "call ready(i, grad) once per parameter and iteration (DDP: \"Expected to mark a variable "
    "ready only once\"); to add up several backward passes, call ready() inside no_sync()")


#: The problem of a finalize() inside no_sync(), as the ranks agree on it.
_IN_NO_SYNC = {"kind": "argument", "text": "finalize() inside no_sync(): nothing is reduced "
               "inside no_sync(); leave the block, call ready(i, grad) for the step that "
               "synchronises, then finalize()"}


class Reducer:
    """DDP's gradient reducer: bucketed, overlapped all-reduces of gradients as they are ready.

    Args:
        shapes_or_params: the parameters, in forward (definition) order: arrays, shapes
            (float32), ``(shape, dtype)`` pairs, ``(name, array)`` pairs, or a dict
            ``name -> array``. Names appear in messages.
        comm: an mpi4py communicator or a refcoll Transport (``None``: ``MPI.COMM_WORLD``).
            The reducer splits two of its own off it: one for the buckets' data, one for
            its agreements, so the user's communicator is never left with a call pending.
        bucket_cap_mb, first_bucket_mb: the bucket caps in MiB (DDP's defaults).
        algorithm: the all-reduce algorithm of every bucket (``auto`` chooses by size).
        compressor: a spec string or Compressor: each bucket is all-reduced with it
            (``op="avg"``), one state per bucket index, kept across iterations; a
            compressor of matrices (PowerSGD) all-reduces each parameter's view in
            its shape, with a state per parameter (a list per bucket index).
        find_unused: reduce parameters a step never marks ready as zeros, and leave
            those no rank used untouched (DDP's ``find_unused_parameters``).
        hook: ``hook(bucket) -> handle or array``, replacing the all-reduce of a
            :class:`GradBucket` (DDP's comm hook): it gets undivided gradients and its
            result is the reduced bucket.
        seed: the seed of bucket ``b``'s compressor state is ``seed + b`` (of its
            parameter ``j``'s, for a compressor of matrices, ``seed + 65536·b + j``).
        gradient_as_bucket_view: DDP's option: gradients written into
            :meth:`gradient`'s views are divided in place, and :meth:`finalize`
            returns the views (no copy in or out).

    Raises:
        UsageError: on every rank, when any rank's arguments are unusable.
        MismatchError: on every rank, when ranks' parameters or settings differ
            (their buckets would not match).
    """

    def __init__(self, shapes_or_params, comm=None, *, bucket_cap_mb=25, first_bucket_mb=1,
                 algorithm="auto", compressor=None, find_unused: bool = False, hook=None,
                 seed: int = 0, gradient_as_bucket_view: bool = False):
        t = as_transport(comm, "Reducer")
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.data_transport = t.split(0, t.rank)
        self.control_transport = t.split(0, t.rank)
        self.rank, self.size = t.rank, t.size
        self.algorithm, self.find_unused, self.hook, self.seed = algorithm, find_unused, hook, seed
        self.params: list[Parameter] = []
        self.compressor: Compressor | None = None
        error = None
        try:
            self._check_arguments(shapes_or_params, bucket_cap_mb, first_bucket_mb, compressor)
        except (UsageError, TypeError, ValueError) as exc:
            error = str(exc)
        first_cap, cap = getattr(self, "_caps", (None, None))  # (bytes: what the buckets use)
        settings = {key: str(value) for key, value in [
            ("bucket_cap_mb in bytes", cap), ("first_bucket_mb in bytes", first_cap),
            ("algorithm", algorithm), ("find_unused", bool(find_unused)), ("seed", seed),
            ("compressor", self.compressor.spec() if self.compressor else "none"),
            ("hook", "none" if hook is None else "a hook")]}
        rows = gather_json(self.control_transport, {
            "error": error, "params": [p.key() for p in self.params],
            "names": [p.name for p in self.params], "settings": settings})
        failed = [f"rank {r}: {row['error']}" for r, row in enumerate(rows) if row["error"]]
        if failed:
            raise UsageError("Reducer: " + "; ".join(failed))
        problem = first_difference(rows)
        if problem is not None:
            raise MismatchError(
                f"ranks built their Reducers differently, so their buckets would not match: "
                f"{problem}. Every rank must pass the same parameters (shapes and dtypes, in "
                "the same order) and the same settings")
        self.rebuilt = False
        self.states: dict = {}  # compressor state by bucket index
        self._no_sync = 0
        self._broken: str | None = None
        self._accumulated: list = [None] * len(self.params)
        self._timeline: list[dict] = []
        self._set_layout(assign_buckets([p.nbytes for p in self.params],
                                        [p.dtype for p in self.params],
                                        list(reversed(range(len(self.params)))), *self._caps))
        self._used, self._used_plan = used_map(len(self.params), self.data_transport, find_unused)
        self._start_iteration()

    def _check_arguments(self, spec, bucket_cap_mb, first_bucket_mb, compressor) -> None:
        self.params = parameters_of(spec)
        self._caps = (cap_bytes(first_bucket_mb, "first_bucket_mb"),
                      cap_bytes(bucket_cap_mb, "bucket_cap_mb"))
        if algorithms.get(self.algorithm).workers is not None:
            raise UsageError(f"algorithm {self.algorithm!r} needs switch processes, which hold "
                             "no gradients; choose another")
        algorithms.implementation(self.algorithm, "allreduce")
        if compressor is not None and self.hook is not None:
            raise UsageError("give compressor= or hook=, not both: the compressor is a hook")
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral) \
                or self.seed < 0:
            raise UsageError(f"seed= takes a whole number from 0 (its compressor states' "
                             f"seeds count up from it), got {self.seed!r}")
        if compressor is not None:
            chosen = parse(compressor) if isinstance(compressor, str) else compressor
            if not isinstance(chosen, Compressor):  # (kept only once it is one: its spec is
                raise UsageError(f"compressor= takes a spec string or a Compressor, got "
                                 f"{type(compressor).__name__}")  # every rank's to agree on)
            self.compressor = chosen
        for p in self.params:
            if not is_float(p.dtype):
                raise UsageError(f"{p.describe()}: gradients are floating (float16, bfloat16, "
                                 "float32, float64)")

    # ------------------------------------------------------------------ layout

    @property
    def buckets(self) -> list[BucketLayout]:
        """Return the buckets, in launch order."""
        return list(self._buckets)

    def _set_layout(self, groups) -> None:
        self._buckets = layouts(self.params, groups)
        self._buffers = [np.zeros(b.numel, b.dtype) for b in self._buckets]
        self._plans = bucket_plans(self._buffers, self.data_transport, self.algorithm,
                                   self.hook is None and self.compressor is None,
                                   getattr(self, "_plans", []))
        self._bucket_of = [0] * len(self.params)
        self._views: list = [None] * len(self.params)
        for b, buf in zip(self._buckets, self._buffers):
            for i, off in zip(b.params, b.offsets):
                p = self.params[i]
                self._bucket_of[i] = b.index
                self._views[i] = buf[off:off + p.numel].reshape(p.shape)

    def _rebuild(self) -> None:
        """Rebuild the buckets once, in rank 0's ready order of this iteration (DDP's rebuild)."""
        order = broadcast(np.array(self._order, np.int64), 0, self.control_transport)
        groups = assign_buckets([p.nbytes for p in self.params], [p.dtype for p in self.params],
                                [int(i) for i in order], *self._caps)
        self.rebuilt = True
        if [list(b.params) for b in self._buckets] != groups:
            old = self._buckets
            self._set_layout(groups)
            self.states = self._carried(old, self.states)  # bucket indices name others now

    def _carried(self, old: list, states: dict) -> dict:
        """Return the compressor states of the new buckets, each gradient's carried from its
        old bucket (as the DDP hook carries them, :mod:`refcoll.torch.hooks`): a compressor
        of vectors, what its old bucket owed over that gradient's elements; of matrices,
        the gradient's own state (PowerSGD's warm start and residual)."""
        if self.compressor is None or not states:
            return {}
        was = {i: (b.index, j, off) for b in old for j, (i, off) in
               enumerate(zip(b.params, b.offsets))}
        debts = {} if self.compressor.matrices else \
            {b: owes(state, self.rank) for b, state in states.items()}
        new_states = {}
        for b in self._buckets:
            moved = [(i, off, was[i]) for i, off in zip(b.params, b.offsets)
                     if was[i][0] in states]
            if not moved:
                continue
            fresh = compressor_states(self.compressor, self.seed, b.index, len(b.params),
                                      self.rank)
            if self.compressor.matrices:
                place = {i: j for j, i in enumerate(b.params)}
                for i, _, (ob, oj, _) in moved:
                    fresh[place[i]] = states[ob][oj]
            else:
                fresh.residual = carried(b.numel, [(debts[ob], old_off, self.params[i].numel, off)
                                                   for i, off, (ob, _, old_off) in moved])
            new_states[b.index] = fresh
        return new_states

    # -------------------------------------------------------------- iteration

    def _start_iteration(self) -> None:
        n = len(self.params)
        self._ready = [False] * n
        self._divide = [False] * n  # slots written in place, divided when their bucket launches
        self._ready_at: list = [None] * n
        self._grads: list = [None] * n
        self._used[...] = 0
        self._order: list[int] = []
        self._problems: list[dict] = []
        self._pending = [len(b.params) for b in self._buckets]
        self._next_bucket = 0
        self._work: list = [None] * len(self._buckets)
        self._bucket_ready_at: list = [None] * len(self._buckets)
        self._launched_at: list = [None] * len(self._buckets)
        self._returned_at: list = [None] * len(self._buckets)
        self._first_ready = None

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally inside the block, with no communication (DDP's ``no_sync``).

        Inside, ``ready(i, grad)`` keeps a copy of the first gradient and adds the
        later ones to it (``acc += grad``). The first ``ready(i, grad)`` after the
        block reduces ``acc + grad``.
        """
        self._no_sync += 1
        try:
            yield self
        finally:
            self._no_sync -= 1

    def _argument_problem(self, i, grad) -> str | None:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or \
                not 0 <= i < len(self.params):
            return f"ready({i!r}, grad): no such parameter; indices run 0..{len(self.params) - 1}"
        p = self.params[i]
        if type(grad).__module__.partition(".")[0] == "torch":
            return (f"ready({i}, grad): the gradient is a {type(grad).__name__} of torch; the "
                    "Reducer takes NumPy arrays (grad.numpy()); for torch models use DDP with "
                    "refcoll.torch.comm_hook")
        shape, dtype = tuple(np.shape(grad)), getattr(grad, "dtype", None)
        if shape != p.shape:
            return f"ready({i}, grad): the gradient has shape {shape}, {p.describe()} has {p.shape}"
        if not same_dtype(dtype, p.dtype):
            return (f"ready({i}, grad): the gradient has dtype {dtype}, {p.describe()} needs "
                    f"{p.dtype}; cast it (grad.astype(...)) or declare the parameter so")
        return None

    @by_ieee_rules  # (accumulating and scaling: IEEE's results, never a one-rank raise)
    def ready(self, i: int, grad) -> None:
        """Mark parameter ``i``'s gradient ready: copy it into its bucket, launch what is ready.

        Never raises for a usage error (an index out of range, a wrong shape or
        dtype, a second call for the same parameter): it records the problem, and
        :meth:`finalize` raises it on every rank, so no rank leaves the others waiting.
        """
        now = time.perf_counter()
        if self._broken:
            raise UsageError(self._broken)
        problem = self._argument_problem(i, grad)
        if problem is not None:
            self._problems.append({"kind": "argument", "text": problem})
            return
        if self._no_sync:
            if self._accumulated[i] is None:
                self._accumulated[i] = np.array(grad, copy=True)
            else:
                np.add(self._accumulated[i], grad, out=self._accumulated[i])
            return
        if self._ready[i]:
            self._problems.append({"kind": "twice", "param": i})
            return
        if self._first_ready is None:
            self._first_ready = now
        source = grad
        if self._accumulated[i] is not None:
            accumulated, self._accumulated[i] = self._accumulated[i], None
            if self._is_slot(i, grad):  # DDP's .grad is the bucket view: it accumulated there
                np.add(accumulated, grad, out=grad)
            else:
                source = np.add(accumulated, grad)
        self._fill(i, source)
        self._grads[i] = grad
        self._used[i] = 1
        self._order.append(i)
        self._mark_ready(i, now)

    def gradient(self, i: int) -> np.ndarray:
        """Return parameter ``i``'s slot in its bucket, shaped as the parameter.

        With ``gradient_as_bucket_view=True`` (DDP's option) the backward pass writes
        the gradient here and passes this array to :meth:`ready`: nothing is copied,
        the slot is divided by ``p`` in place (DDP's ``bucket_view.div_``), and
        :meth:`finalize` returns the views. A rebuild moves them: ask each iteration."""
        return self._views[i]

    def _is_slot(self, i: int, grad) -> bool:
        """Whether ``grad`` is parameter ``i``'s slot itself (not a view of it in another
        shape or order): written in place, as ``gradient_as_bucket_view`` writes it."""
        view = self._views[i]
        return grad is view or (isinstance(grad, np.ndarray) and grad.size > 0
                                and address(grad) == address(view) and grad.shape == view.shape
                                and grad.strides == view.strides)

    def _fill(self, i: int, grad) -> None:
        """Put a gradient in its slot: copied times ``1/p`` (DDP's ``copy_grad_to_bucket``: the
        factor rounded to the dtype, float32 for 16-bit floats, as torch's opmath computes),
        or, written in the slot itself, divided by ``p`` there (DDP's ``div_``: other bits
        for ``p`` not a power of two); undivided for a hook or a compressor."""
        view = self._views[i]
        scaled = self.hook is None and self.compressor is None
        if self._is_slot(i, grad):
            self._divide[i] = scaled  # on the progress thread, just before the bucket's sum
        elif scaled:
            if view.dtype.itemsize == 2 and is_float(view.dtype):
                # torch computes a 16-bit float times a scalar in float32 (its opmath type):
                # the factor is float32's 1/p, the product rounded once, to the bucket's dtype
                np.multiply(grad, np.float32(1.0 / self.size), out=view, dtype=np.float32,
                            casting="unsafe")  # (dtype: NumPy 1's promotion would take fp16)
            else:
                np.multiply(grad, view.dtype.type(1.0 / self.size), out=view)
        else:  # a hook gets undivided gradients, as in DDP
            np.copyto(view, grad)

    def _mark_ready(self, i: int, now: float) -> None:
        """Count ``i`` in its bucket; launch the ready buckets in order (``mark_bucket_ready``)."""
        self._ready[i], self._ready_at[i] = True, now
        b = self._bucket_of[i]
        self._pending[b] -= 1
        if self._pending[b] == 0:
            self._bucket_ready_at[b] = now
        while self._next_bucket < len(self._buckets) and self._pending[self._next_bucket] == 0:
            self._launch(self._next_bucket)
            self._next_bucket += 1

    def _launch(self, b: int) -> None:
        """Start bucket ``b``'s reduction: the all-reduce, the compressed one, or the hook."""
        buf, layout = self._buffers[b], self._buckets[b]
        self._launched_at[b] = time.perf_counter()
        t = self.data_transport
        if self.hook is not None:
            bucket = GradBucket(layout, buf, [self.params[i].shape for i in layout.params],
                                b == len(self._buckets) - 1)
            try:
                self._work[b] = self.hook(bucket)
            except Exception as exc:  # noqa: BLE001 - reported at finalize, on every rank
                self._problems.append({"kind": "hook", "text": f"the hook raised on bucket {b}: "
                                       f"{type(exc).__name__}: {exc}"})
        elif self.compressor is not None:
            if b not in self.states:
                self.states[b] = compressor_states(self.compressor, self.seed, b,
                                                   len(layout.params), self.rank)
            self._work[b] = issue("allreduce", t, functools.partial(
                reduce_compressed, self.compressor, self.states[b],
                [self._views[i] for i in layout.params], buf, self.algorithm))
        elif any(self._divide[i] for i in layout.params):
            views = [self._views[i] for i in layout.params if self._divide[i]]
            self._work[b] = issue("allreduce", t, functools.partial(
                divide_then_sum, views, self.size, self._plans[b]))
        else:
            self._work[b] = self._plans[b].start().handle
        self._returned_at[b] = time.perf_counter()

    # --------------------------------------------------------------- finalize

    @by_ieee_rules  # (an unused parameter's accumulated gradient is scaled here too)
    def finalize(self, *, in_place: bool = False) -> list:
        """End the iteration: agree on problems, wait for every bucket, return the gradients.

        Returns:
            The averaged gradient of every parameter, in index order, each a new
            array shaped as the parameter; ``None`` for a parameter no rank used
            (``find_unused``). With ``in_place=True`` each is also written into the
            array passed to ``ready(i, grad)``, and that array is returned (a
            parameter this rank did not use gets a new one). With
            ``gradient_as_bucket_view``, the bucket views of :meth:`gradient`.

        Raises:
            UsageError: on every rank, when any rank has a parameter never ready,
                one ready twice, or a bad argument to ``ready``; inside ``no_sync()``.
        """
        if self._broken:
            raise UsageError(self._broken)
        if self._no_sync:  # agreed, so that the ranks outside no_sync() do not wait
            table = gather_json(self.control_transport, [_IN_NO_SYNC], size=256)
            if all(problems == [_IN_NO_SYNC] for problems in table):
                raise UsageError(self._describe(table))  # none reduced: the sums are kept
            try:
                self._fail(table)  # complete the others' calls, then raise
            finally:
                self._start_iteration()
        try:
            if self.find_unused:
                self._mark_unused()
            problems = self._problems + [{"kind": "never", "param": i}
                                         for i, done in enumerate(self._ready) if not done]
            if in_place:
                problems += [{"kind": "argument", "text": f"finalize(in_place=True): the gradient "
                              f"given for {self.params[i].describe()} is not a writeable NumPy "
                              "array"} for i, g in enumerate(self._grads) if g is not None
                             and not (isinstance(g, np.ndarray) and g.flags.writeable)]
            table = gather_json(self.control_transport, problems, size=256)
            if any(table):
                self._fail(table)
            return self._collect(in_place)
        finally:
            self._start_iteration()

    def _mark_unused(self) -> None:
        """Mark every parameter not ready as ready, with zeros (or its no_sync sum)."""
        now = time.perf_counter()
        for i, done in enumerate(self._ready):
            if done:
                continue
            if self._accumulated[i] is not None:  # used inside no_sync: DDP reduces its .grad
                self._fill(i, self._accumulated[i])
                self._accumulated[i], self._used[i] = None, 1
            else:
                self._views[i][...] = 0
            self._mark_ready(i, now)

    def _fail(self, table: list[list[dict]]) -> None:
        """Complete the iteration's calls on every rank, then raise the agreed problems."""
        message = self._describe(table)
        if any(p["kind"] == "hook" for problems in table for p in problems):
            # A rank's hook issued nothing for a bucket: its peers' calls cannot complete.
            self._broken = (f"this Reducer failed and cannot be used again (a hook raised); "
                            f"build a new one. The failure: {message}")
            raise UsageError(message)
        # Every rank launched a prefix of the buckets: launching the rest on every rank
        # matches every call, so the data communicator is left clean for the next iteration.
        while self._next_bucket < len(self._buckets):
            self._launch(self._next_bucket)
            self._next_bucket += 1
        with contextlib.suppress(RefcollError):
            wait_all([w for w in self._work if hasattr(w, "wait")])
        self.states = {}  # their residuals took in buffers that were never whole
        self._accumulated = [None] * len(self.params)
        raise UsageError(message)

    def _describe(self, table: list[list[dict]]) -> str:
        """Return the one message every rank raises for the problems in ``table`` (by rank)."""
        lines = []
        never = [(r, [p["param"] for p in problems if p["kind"] == "never"])
                 for r, problems in enumerate(table)]
        if any(idx for _, idx in never):
            named = "; ".join(
                f"on rank {r}: " + ", ".join(self.params[i].describe() for i in idx[:NAMED])
                + (f" and {len(idx) - NAMED} more" if len(idx) > NAMED else "")
                for r, idx in never if idx)
            lines.append(f"parameters never became ready in this iteration ({named}); "
                         f"{_NEVER_READY}")
        twice = [f"{self.params[p['param']].describe()} was marked ready twice on rank {r}"
                 for r, problems in enumerate(table) for p in problems if p["kind"] == "twice"]
        if twice:
            lines.append(f"{'; '.join(twice)} in this iteration; {_TWICE}")
        lines += [f"rank {r}: {p['text']}" for r, problems in enumerate(table) for p in problems
                  if "text" in p]
        return "Reducer.finalize(): " + "\n".join(lines)

    def _collect(self, in_place: bool) -> list:
        """Wait for every bucket in order (and the used map); return the gradients."""
        waiting = [b for b, w in enumerate(self._work) if hasattr(w, "wait")]
        handles = [self._work[b] for b in waiting]
        if self.find_unused:  # DDP's all_reduce_local_used_map, after the last bucket
            handles.append(self._used_plan.start().handle)
        first = not self.rebuilt and not self.find_unused  # ends in a collective: agree first
        results, wrong = _waited(handles, first and self.hook is not None)
        reduced = list(self._work)
        for b, result in zip(waiting, results or ()):
            reduced[b] = result
        if results is not None:
            wrong = [{"kind": "argument", "text": f"the hook returned {np.size(result)} "
                      f"elements for bucket {b}, which holds {self._buckets[b].numel}"}
                     for b, result in enumerate(reduced)
                     if np.size(result) != self._buckets[b].numel]
        if first:
            # the first iteration ends in a collective (the rebuild): agree on the results
            # first, so that one rank's wrong hook is every rank's error, not a peer's wait
            table = gather_json(self.control_transport, wrong, size=256)
            if any(table):
                raise UsageError(self._describe(table))
        elif wrong:  # later: this rank's error, as DDP's check of a hook's result is
            raise UsageError(f"Reducer.finalize(): {wrong[0]['text']}")
        for b, result in enumerate(reduced):
            flat = np.asarray(result).reshape(-1)
            if address(flat) != address(self._buffers[b]):  # a hook's own result array
                np.copyto(self._buffers[b], flat)
        used = results[-1] if self.find_unused else None
        self._timeline = self._record_timeline()
        out: list = []
        for i in range(len(self.params)):
            if used is not None and used[i] == 0:
                out.append(None)  # no rank used it: its gradient is left alone, as DDP does
                continue
            grad = self._grads[i]
            if self.gradient_as_bucket_view:  # the bucket's own view: nothing to copy out
                if in_place and grad is not None and grad is not self._views[i]:
                    np.copyto(grad, self._views[i])
                out.append(self._views[i])
            elif in_place and grad is not None:  # one copy, straight from the bucket
                np.copyto(grad, self._views[i])
                out.append(grad)
            else:
                out.append(self._views[i].copy())
        if not self.rebuilt and not self.find_unused:
            self._rebuild()
        return out

    # --------------------------------------------------------------- timeline

    def _record_timeline(self) -> list[dict]:
        t0 = self._first_ready if self._first_ready is not None else 0.0

        def rel(stamp):
            return None if stamp is None else stamp - t0

        rows = []
        for b, layout in enumerate(self._buckets):
            work = self._work[b]
            started = getattr(work, "started", self._launched_at[b])
            finished = getattr(work, "finished", self._returned_at[b])
            rows.append({"index": b, "bytes": layout.nbytes, "parameters": list(layout.params),
                         "gradients": [rel(self._ready_at[i]) for i in layout.params],
                         "ready": rel(self._bucket_ready_at[b]),
                         "launched": rel(self._launched_at[b]),
                         "started": rel(started), "finished": rel(finished)})
        return rows

    def timeline(self) -> list[dict]:
        """Return the last finished iteration, per bucket, in seconds from its first ``ready()``.

        Each row: ``index``, ``bytes``, ``parameters``, ``gradients`` (each one's
        ready time), ``ready`` (the bucket's last gradient), ``launched``, and the
        all-reduce's ``started`` and ``finished`` (its handle's stamps).
        """
        return [dict(row) for row in self._timeline]


def _waited(handles: list, agreed: bool) -> tuple[list | None, list]:
    """Wait for ``handles``; return their results (None: one raised) and this rank's
    problems. ``agreed``: a hook's handles in the first iteration, which ends in a
    collective: one that raised something other than refcoll's own errors is a problem
    the ranks then agree on (every rank's error, not a peer's wait); otherwise it is
    raised here, as DDP raises it."""
    try:
        return wait_all(handles), []
    except Exception as exc:  # noqa: BLE001 - a hook's own handle failed on this rank
        if not agreed or isinstance(exc, RefcollError):
            raise
        return None, [{"kind": "argument",
                       "text": f"a hook's handle raised {type(exc).__name__}: {exc}"}]
