"""The compressed battery: every compressor, through every pattern it allows, judged exactly.

Each case runs a few steps of one compressor state (so residuals and warm
starts are exercised) and is held, rank by rank and step by step, to the
simulator running the same code: the same bits and the same bytes sent and
received. The uncompressed ``none`` (a compressor whose payload is the tensor
itself) on exact inputs must also equal the naive reduction.

A tool beside the reference's conformance battery (:mod:`refcoll.verify.conformance`),
using its judges: ``refcoll verify --compressor`` hands :data:`COMPRESSED_ALLREDUCE`
to :class:`refcoll.verify.session.Selection`.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from .. import algorithms
from ..calls.agree import barrier
from ..calls.collectives import allreduce, device_for
from ..core import xp as xp_module
from ..core.errors import CollectiveTimeout, UsageError
from ..core.ops import DTYPES, get_dtype, is_float
from ..verify.conformance.cases import CaseResult
from ..verify.conformance.control import bcast_report, gather_reports
from ..verify.conformance.judge import digest, misplaced, oracle_algorithm
from ..verify.conformance.run import inputs_lock
from ..verify.inputs import make_inputs
from ..verify.oracle import fold
from ..verify.session import Battery
from .base import parse
from .collective import run_steps, simulate_compressed

__all__ = ["COMPRESSOR_BATTERY", "COMPRESSOR_STEPS", "COMPRESSED_OPS", "COMPRESSED_DTYPES",
           "COMPRESSED_ALLREDUCE", "CompressorCase", "compressed_algorithms",
           "compressor_shapes", "build_compressor_cases", "run_compressor_case",
           "run_compressor_battery"]

#: The ops a compressed all-reduce is verified with.
COMPRESSED_OPS = ("sum", "avg")

#: The dtypes a compressor may be verified on.
COMPRESSED_DTYPES = ("float16", "bfloat16", "float32", "float64")


def compressed_algorithms() -> list[str]:
    """Return the all-reduce algorithms a compressed all-reduce may run over.

    Those without switch processes: a compressor's payloads are not summed by
    switches.
    """
    return [a for a in algorithms.names("allreduce") if algorithms.get(a).workers is None]


#: The compressors ``refcoll verify --compressor all`` runs: every method, with
#: settings that keep something to compress at the battery's small sizes, and
#: error feedback where it changes the collective (a residual, a server stage).
COMPRESSOR_BATTERY = (
    "none", "fp16", "bf16", "randomk:ratio=0.25", "powersgd:rank=2", "ef(powersgd:rank=2)",
    "topk:ratio=0.1", "ef(topk:ratio=0.1)", "threshold:threshold=0.5", "qsgd:levels=4,bucket=64",
    "terngrad", "sign", "ef(sign)", "onebit", "ef(onebit)", "int8:block=64",
)
#: Steps each compressed case runs with one state, so residuals and warm starts are exercised.
COMPRESSOR_STEPS = 3
#: The dense all-reduce the patterns that run none are compared with: ``allreduce``'s default.
DENSE = inspect.signature(allreduce).parameters["algorithm"].default


@dataclass(frozen=True)
class CompressorCase:
    """One compressed all-reduce check: compressor, pattern, algorithm, op, dtype, shape."""

    compressor: str
    pattern: str
    algorithm: str
    op: str
    dtype: str
    shape: tuple
    kind: str = "random"
    steps: int = COMPRESSOR_STEPS
    collective: str = "compressed_allreduce"

    @property
    def count(self) -> int:
        """Return the elements of the tensor."""
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def options(self) -> tuple:
        """Return the compressor and pattern as the case's options (a row of the summary)."""
        return (("compressor", self.compressor), ("pattern", self.pattern))

    @property
    def id(self) -> str:
        """Return the case's readable name."""
        shape = "x".join(map(str, self.shape))
        return "-".join([self.compressor, self.pattern, self.algorithm, self.op, self.dtype,
                         f"shape{shape}", self.kind])


def compressor_shapes(p: int) -> list[tuple]:
    """Return the shapes of the compressed battery: empty, one element, ``p+1``, a matrix."""
    return [(0,), (1,), (p + 1,), (40, 25)]


def _check_algorithms(algos: list[str]) -> None:
    """Raise UsageError unless ``algos`` names all-reduce algorithms a compressed run can use."""
    if not algos:  # every pattern names an algorithm, if only for its dense bytes
        raise UsageError("no all-reduce algorithm is selected for the compressed battery; "
                         "name at least one, or all")
    for name in algos:
        algorithms.implementation(name, "allreduce")  # every pattern reduces through one
        if algorithms.get(name).workers is not None:
            raise UsageError(f"{name} needs switch processes and cannot run compressed payloads")


def _cases_of(comp, p: int, algos: list[str], op_names: list[str],
              dtype_names: list[str]) -> list[CompressorCase]:
    """Return the cases of one parsed compressor ``comp``: every pattern it allows."""
    cases = []
    for pattern in comp.patterns:
        # Only the allreduce pattern runs an algorithm; the others name one for
        # the dense bytes they are compared with: DENSE, unless it is not selected.
        dense = [DENSE if DENSE in algos else algos[0]]
        for algo in (algos if pattern == "allreduce" else dense):
            for op in op_names:
                for dt in dtype_names:
                    for shape in compressor_shapes(p):
                        kinds = ["exact", "random"] if comp.identity else ["random"]
                        for kind in kinds:
                            cases.append(CompressorCase(comp.spec(), pattern, algo, op, dt,
                                                        shape, kind))
    return cases


def build_compressor_cases(p: int, *, compressors: Iterable[str] | None = None,
                           algorithms_: Iterable[str] | None = None,
                           ops: Iterable[str] | None = None,
                           dtypes: Iterable[str] | None = None,
                           allow_empty: bool = True) -> list[CompressorCase]:
    """Return the compressed battery for ``p`` ranks.

    Every compressor runs every pattern it allows; the ``allreduce`` pattern
    once per algorithm (``None``: every algorithm without switch processes),
    the others (which use no all-reduce algorithm) once. Ops: ``sum`` and
    ``avg``; dtypes: float32 and float64 unless given. A compressor whose
    payload is the tensor itself (``identity``: ``none``) runs on exact inputs
    as well, where it must equal the naive reduction bit for bit.

    Raises:
        UsageError: an unknown or unusable name, no algorithm selected; or, with
            ``allow_empty=False``, a selection that leaves no case, saying why.
    """
    specs = list(compressors) if compressors is not None else list(COMPRESSOR_BATTERY)
    comps = [parse(s) for s in specs]
    algos = list(algorithms_) if algorithms_ is not None else compressed_algorithms()
    _check_algorithms(algos)
    op_names = list(ops) if ops is not None else list(COMPRESSED_OPS)
    for op in op_names:
        if op not in COMPRESSED_OPS:
            raise UsageError(f"a compressed all-reduce takes op sum or avg, not {op!r}")
    dtype_names = list(dtypes) if dtypes is not None else ["float32", "float64"]
    for d in dtype_names:
        if not is_float(get_dtype(d)) or d.startswith("float8"):
            raise UsageError(f"compressors take float16, bfloat16, float32 or float64, not {d}")
    cases = []
    for comp in comps:
        cases += _cases_of(comp, p, algos, op_names, dtype_names)
    if not cases and not allow_empty:
        for what, chosen in (("compressor", specs), ("op", op_names), ("dtype", dtype_names)):
            if not chosen:
                raise UsageError(f"no compressed case matches the selection: no {what} is "
                                 "selected; name at least one, or all")
        raise UsageError("no compressed case matches the selection: the selected compressors "
                         f"({', '.join(specs)}) allow no pattern")
    return cases


@functools.lru_cache(maxsize=4)
def _compressor_inputs(case: CompressorCase, p: int, seed: int):
    """Every step's inputs for every rank, read-only: ``inputs[step][rank]``."""
    steps = []
    for step in range(case.steps):
        xs = make_inputs(case.kind, DTYPES[case.dtype], case.count, p, op=case.op,
                         seed=seed + step)
        for x in xs:
            x.flags.writeable = False
        steps.append(tuple(x.reshape(case.shape) for x in xs))
    return tuple(steps)


def run_compressor_case(t, ctl, case: CompressorCase, *, seed: int = 0, xp=np) -> CaseResult:
    """Run one compressed case on every rank of ``t`` and judge it against the simulator.

    Checked: each step's result has the tensor's shape and dtype, lives where
    the input does and leaves the input unchanged; every rank holds the same
    bits; each rank's result and the bytes it sent and received equal the
    simulator's run of the same code
    (:func:`refcoll.compressors.collective.simulate_compressed`); with an
    identity compressor (``none``) on exact inputs, the naive reduction.

    With ``xp`` CuPy the tensors are on the GPU and the simulator runs on the
    GPU too: stochastic compressors draw their rounding from the device's
    generator and summed scales come out of the device's reduction order, so
    the same code on the same device is the prediction that holds bit for bit.
    """
    with inputs_lock:
        inputs = _compressor_inputs(case, t.size, seed)
    mine = [xp.array(step[t.rank]) for step in inputs]
    # The transport the calls run on, agreed on by every rank before any call can fail.
    carrier = device_for(t, xp.zeros(0, np.uint8))
    problems: list[str] = []
    outputs, traffic = [], []
    try:
        outputs, traffic = run_steps(t, case.compressor, mine, seed=seed, op=case.op,
                                     algorithm=case.algorithm, pattern=case.pattern)
    except CollectiveTimeout:
        raise
    except Exception as exc:  # noqa: BLE001 - a failing case is a verdict, not a crash
        problems.append(f"raised {type(exc).__name__}: {exc}")
    for step, (x, out) in enumerate(zip(mine, outputs)):
        if not np.array_equal(xp_module.to_host(x).view(np.uint8),
                              inputs[step][t.rank].view(np.uint8)):
            problems.append(f"step {step}: the input was modified")
        if misplaced(out, xp):
            problems.append(f"step {step}: {misplaced(out, xp)}")
        elif out.shape != x.shape or out.dtype != x.dtype:
            problems.append(f"step {step}: result has shape {out.shape} and dtype {out.dtype}, "
                            f"not {x.shape} and {x.dtype}")
    barrier(ctl)
    problems += [f"{m} left unreceived" for m in t.unreceived()]
    reports = gather_reports(ctl, {
        "problems": problems,
        "digests": [digest(o).hex() for o in outputs],
        "traffic": [[m.sent, m.received] for m in traffic],
    })
    verdict = None
    if ctl.rank == 0:
        verdict = [f"rank {r}: {msg}" for r, rep in enumerate(reports) for msg in rep["problems"]]
        if not verdict:
            on_device = [[xp.asarray(x) for x in step] for step in inputs]
            algorithm = oracle_algorithm(carrier, case.algorithm, "allreduce", case.count,
                                         case.dtype)
            predicted = simulate_compressed(case.compressor, on_device, seed=seed, op=case.op,
                                            algorithm=algorithm, pattern=case.pattern)
            verdict += _judge_compressed(case, inputs, reports, predicted)
    verdict = bcast_report(ctl, verdict)
    return CaseResult(case, not verdict, "; ".join(verdict))


def _judge_compressed(case: CompressorCase, inputs, reports: list[dict], predicted) -> list[str]:
    """Return rank 0's verdict on a compressed case: agreement, prediction, bytes (three)."""
    problems = []
    for step in range(case.steps):
        digests = [rep["digests"][step] for rep in reports]
        if len(set(digests)) > 1:
            differing = [r for r, d in enumerate(digests) if d != digests[0]]
            problems.append(f"step {step}: ranks {differing} hold different bits from rank 0")
        for r, want in enumerate(predicted.outputs[step]):
            if digest(want).hex() != digests[r]:
                problems.append(f"step {step}: rank {r} differs from the simulator's prediction")
            moved = predicted.traffic[step][r]
            if reports[r]["traffic"][step] != [moved.sent, moved.received]:
                problems.append(f"step {step}: rank {r} sent/received "
                                f"{reports[r]['traffic'][step]} B, the simulator "
                                f"{[moved.sent, moved.received]} B")
        if case.kind == "exact" and parse(case.compressor).identity:
            want = fold(case.op, [x.reshape(-1) for x in inputs[step]])
            if digest(want).hex() != digests[0]:
                problems.append(f"step {step}: {case.compressor} differs from the naive "
                                "reduction")
    return problems[:3]


def run_compressor_battery(t, cases: Sequence[CompressorCase], *, seed: int = 0,
                           progress: Callable[[int, int, CaseResult], None] | None = None,
                           xp=np) -> list[CaseResult]:
    """Run compressed ``cases`` on every rank of ``t`` (all ranks pass the same list), on ``xp``."""
    ctl = t.split(0, t.rank)
    results = []
    for i, case in enumerate(cases):
        result = run_compressor_case(t, ctl, case, seed=seed, xp=xp)
        results.append(result)
        if progress is not None:
            progress(i, len(cases), result)
    return results


def _cases(workers: int, world_size: int, **filters) -> list[CompressorCase]:
    """The compressed battery's cases: no switch processes, so every rank holds data."""
    return build_compressor_cases(world_size, **filters)


def _on_device(xp, filters: dict) -> tuple[dict, list[str]]:
    """Return the filters less the compressors that cannot run on ``xp``'s device (bf16 on
    a GPU without it), and the specs ``all`` lost; a compressor named explicitly that
    cannot run there is an error (:class:`UsageError`)."""
    specs = filters["compressors"]
    runnable, left_out = [], []
    for spec in specs if specs is not None else COMPRESSOR_BATTERY:
        comp = parse(spec)
        try:
            comp.compress(xp.zeros(8, np.float32), comp.new_state())
        except UsageError as exc:
            if specs is not None:
                raise UsageError(f"--compressor {spec} on the device: {exc}") from None
            left_out.append(spec)
            continue
        runnable.append(spec)
    return dict(filters, compressors=runnable), left_out


#: The compressed all-reduce battery, as ``refcoll verify --compressor`` runs it: filters
#: ``compressors``, ``algorithms_``, ``ops`` and ``dtypes``; no switch processes, no
#: non-blocking runs or outstanding-call scenarios.
COMPRESSED_ALLREDUCE = Battery(build_cases=_cases, run=run_compressor_battery,
                               on_device=_on_device, nonblocking=False)
