"""Compressed all-reduce: the public call, its traffic, and its oracle on simulated ranks.

:func:`compressed_allreduce` checks and agrees on the arguments, then runs one
of the three patterns of :mod:`refcoll.compressors.patterns`, chosen from what
the compressor declares (:attr:`Compressor.patterns`, the default first, or
``pattern=`` to pick another it allows):

``allreduce`` (casts, shared-seed random-k, PowerSGD, ``none``; int8 by choice)
    the compressor's declared rounds go through the chosen all-reduce algorithm;
``gather`` (top-k, threshold, QSGD, TernGrad, int8, and sign/1-bit by choice)
    every payload goes round a ring allgather and is summed after decompression;
``twophase`` (sign and 1-bit by default: 1-bit Adam's compressed all-reduce)
    compressed all-to-all, sum and recompress per chunk, compressed allgather.

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

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .. import algorithms
from ..calls.agree import agree
from ..calls.args import flat_input, flat_out, shared_errors
from ..calls.auto import resolve
from ..calls.collectives import as_transport, device_for, in_issue_order
from ..core.errors import UsageError
from ..core.ops import by_ieee_rules, dtype_name, get_op
from ..core.xp import array_namespace, is_device_array
from ..transport.sim import SimWorld
from .base import Compressor, CompressorState, ErrorFeedback, check_float, parse
from .patterns import PATTERNS

__all__ = [
    "CompressedTraffic",
    "compressed_allreduce",
    "simulate_compressed",
    "SimulatedSteps",
    "run_steps",
    "PATTERNS",
]


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


def _resolve(compressor) -> Compressor:
    if isinstance(compressor, str):
        return parse(compressor)
    if not isinstance(compressor, Compressor):
        raise TypeError(f"compressor= takes a Compressor or a spec string, got "
                        f"{type(compressor).__name__}")
    return compressor


@in_issue_order(1)
@by_ieee_rules  # (a compressor's casts and sums: IEEE's results, never a one-rank raise)
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
    t = as_transport(comm, "compressed allreduce")
    if is_device_array(x):  # (anything else, None too, is judged below, on every rank)
        t = device_for(t, x)
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
        elif isinstance(comp, ErrorFeedback):  # another tensor's residual: every rank's error
            try:
                comp.check_residual(state.residual, arr)
            except UsageError as exc:
                raise UsageError(f"rank {t.rank}: {exc}") from None
    if validate:
        with t.call("compressed_allreduce"):
            agree(t, collective="compressed_allreduce", algorithm=algorithm, op=op,
                  dtype=dtype_name(flat.dtype), count=flat.size,
                  compressor=comp.spec(),
                  options=sorted(options.items()) + [("pattern", chosen), ("seed", state.seed),
                                                     ("shape", list(arr.shape)),
                                                     ("step", state.step)])
    if algorithms.get(algorithm).chooses:
        # auto: one choice for every payload array of the call, by the dense tensor's size,
        # so that an oracle resolving the same way predicts the same schedule.
        algorithm = resolve(t, "allreduce", flat.size, flat.dtype.itemsize)
    before = t.traffic.snapshot()
    tensor = flat.reshape(arr.shape)
    total, payload = PATTERNS[chosen](t, comp, state, tensor, op=op, algorithm=algorithm,
                                      options=options)
    np.copyto(result, total.reshape(-1))
    sent, received = (now - then for now, then in zip(t.traffic.snapshot(), before))
    traffic = CompressedTraffic(chosen, sent, received, payload, flat.nbytes,
                                _dense_bytes(t, algorithm, flat.size, flat.dtype.itemsize))
    state.traffic = traffic
    return (out if out is not None else result.reshape(arr.shape)), traffic


def _dense_bytes(t, algorithm: str, count: int, itemsize: int) -> int:
    """Return the bytes a rank sends in the uncompressed all-reduce of the same tensor."""
    return algorithms.get(algorithm).costs["allreduce"](t.size, count, itemsize).max_rank_bytes


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
