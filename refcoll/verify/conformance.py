"""The conformance battery that ``refcoll verify`` and the tests both run.

Every case runs one collective on every rank of a transport (MPI or simulated)
and checks, on every rank:

* the output has the right shape and dtype, and the input is unchanged (out of
  place) or the result landed in the input (in place);
* integers, ``exact`` float inputs, ``min``/``max``, allgather and broadcast:
  equal to the naive reference (:func:`refcoll.verify.oracle.fold`) bit for bit;
* ``random`` float inputs of ``sum``/``avg``/``prod``: within the summation error
  bound of the exactly computed result, and bit-exact against the simulator's
  prediction for the same algorithm (rank 0 runs the oracle);
* every rank holds bitwise the same all-reduce result;
* no message is left unreceived once every rank has finished.

Inputs are deterministic per (case, rank), so each rank regenerates every rank's
input and computes the expected result locally; only verdicts travel, over a
separate control communicator.

On GPUs (``xp=cupy``) the same cases run on device arrays: each rank's input is
copied to its GPU, the collective must return a device array, and the checks
run on host copies of the results. The expected results are the same host
references, so a GPU run is held to the CPU's bits.
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from .. import algorithms
from ..core import xp as xp_module
from ..calls.collectives import (allgather, allreduce, broadcast, device_for, reduce, reduce_scatter,
                                 simulate)
from ..core.chunking import chunk_slice
from .inputs import make_inputs
from ..core.ops import DTYPES, OPS, get_dtype, get_op, is_float, supports
from .oracle import error_bound, exact_reduce, fold, violations
from ..core.errors import CollectiveTimeout, UsageError
from ..calls.auto import resolve
from ..algorithms.naive import naive_broadcast

__all__ = ["Case", "CaseResult", "build_cases", "default_sizes", "run_battery", "run_case",
           "group_rows", "LARGE_SIZE", "REDUCING", "COMPRESSOR_BATTERY", "CompressorCase",
           "build_compressor_cases", "run_compressor_battery", "run_compressor_case"]

#: The "large odd" size of the default battery: odd, and prime, so it divides by no p.
LARGE_SIZE = 5003
#: Collectives that take an op.
REDUCING = ("allreduce", "reduce_scatter", "reduce")


@dataclass(frozen=True)
class Case:
    """One check: an algorithm's collective on one op, dtype, size, mode and input kind."""

    algorithm: str
    collective: str
    op: str | None
    dtype: str
    count: int
    inplace: bool
    kind: str
    root: int = 0
    options: tuple = ()
    ranks: int = 0
    total: int = 0

    @property
    def id(self) -> str:
        parts = [self.algorithm, self.collective, self.op or "-", self.dtype, f"n{self.count}",
                 "inplace" if self.inplace else "outplace", self.kind]
        if self.collective in ("broadcast", "reduce"):
            parts.append(f"root{self.root}")
        parts += [f"{k}={v}" for k, v in self.options]
        if self.total != self.ranks:
            parts.append(f"p{self.ranks}+{self.total - self.ranks}")
        return "-".join(parts)

    @property
    def kwargs(self) -> dict:
        return dict(self.options)


@dataclass
class CaseResult:
    """A case and its verdict (the same on every rank)."""

    case: Case
    passed: bool
    reason: str = ""

    def to_json(self) -> dict:
        return {**asdict(self.case), "id": self.case.id, "passed": self.passed,
                "reason": self.reason}


def default_sizes(p: int) -> list[int]:
    """Return the battery's sizes: 0, 1, p-1, p, p+1 and a large odd one."""
    return sorted({0, 1, max(p - 1, 0), p, p + 1, LARGE_SIZE})


def case_ranks(name: str, p: int, world_size: int, options: dict) -> tuple[int, int]:
    """Return ``(data ranks, total ranks)`` for one algorithm's cases.

    Most algorithms use ``p`` ranks. One with ranks that hold no data (switches)
    uses ``p`` workers plus its extra ranks when the world has room for them,
    and otherwise as many workers as the world allows.
    """
    algo = algorithms.get(name)
    if algo.extra_ranks is None:
        return p, p
    if p + algo.extra_ranks(p, **options) <= world_size:
        return p, p + algo.extra_ranks(p, **options)
    workers = algo.workers(world_size, **options)
    return workers, workers + algo.extra_ranks(workers, **options)


def build_cases(p: int, *, algorithms_: Iterable[str] | None = None,
                collectives: Iterable[str] | None = None, ops: Iterable[str] | None = None,
                dtypes: Iterable[str] | None = None, sizes: Iterable[int] | None = None,
                inplace: Iterable[bool] = (False, True),
                world_size: int | None = None, allow_empty: bool = True) -> list[Case]:
    """Return every applicable case for ``p`` data ranks, in a deterministic order.

    ``None`` means all registered algorithms, collectives, ops and dtypes and
    :func:`default_sizes`. Combinations that do not exist (an algorithm without
    that collective, float8 with ``prod``) are left out. Each case runs once per
    option set of the algorithm's ``battery_options``. ``world_size`` (default
    ``p``) is how many ranks the battery runs on, switches included. The
    selection needs no MPI: ``refcoll verify`` builds it before it starts
    ``mpiexec``.

    Raises:
        UsageError: an unknown name; or, with ``allow_empty=False``, a selection
            that leaves no case, saying which choice left nothing (a battery that
            checks nothing must not pass).
    """
    world_size = p if world_size is None else world_size
    algos = list(algorithms_) if algorithms_ is not None else algorithms.names()
    for name in algos:
        algorithms.get(name)
    colls = list(collectives) if collectives is not None else list(algorithms.COLLECTIVES)
    for c in colls:
        if c not in algorithms.COLLECTIVES:
            raise UsageError(f"unknown collective {c!r}: choose one of "
                             f"{', '.join(algorithms.COLLECTIVES)}")
    op_names = [get_op(o).name for o in (ops if ops is not None else OPS)]
    dtype_names = [d for d in (dtypes if dtypes is not None else DTYPES)]
    for d in dtype_names:
        get_dtype(d)
    size_list = list(sizes) if sizes is not None else default_sizes(p)
    cases = []
    for name in algos:
        for coll, options in _collectives_and_options(name, colls):
            ranks, total = case_ranks(name, p, world_size, dict(options))
            if ranks < 1:
                continue
            for op in (op_names if coll in REDUCING else [None]):
                for dt in dtype_names:
                    if not supports(op, dt):
                        continue
                    kinds = ["exact", "random"] if is_float(DTYPES[dt]) else ["exact"]
                    for count in size_list:
                        for mode in inplace:
                            for kind in kinds:
                                root = (count + 1) % ranks if coll in ("broadcast", "reduce") else 0
                                cases.append(Case(name, coll, op, dt, count, mode, kind, root,
                                                  options, ranks, total))
    if not cases and not allow_empty:
        raise UsageError("no conformance case matches the selection: " + _why_no_case(
            p, algos, colls, op_names, dtype_names, size_list, list(inplace), world_size))
    return cases


def _why_no_case(p: int, algos: list[str], colls: list[str], op_names: list[str],
                 dtype_names: list[str], size_list: list[int], modes: list[bool],
                 world_size: int) -> str:
    """Say which choice of an empty selection left nothing, and what to choose instead.

    The filters are tried in the order :func:`build_cases` applies them, so the
    reason is the first one that emptied the selection.
    """
    if p < 1:
        return f"the battery needs at least 1 rank, got {p}"
    for what, chosen in (("algorithm", algos), ("collective", colls), ("dtype", dtype_names),
                         ("size", size_list), ("mode (in place or out of place)", modes)):
        if not chosen:
            return f"no {what} is selected; name at least one, or all"
    pairs = [(name, coll) for name in algos for coll in colls
             if coll in algorithms.get(name).implementations]
    if not pairs:
        wanted = " or ".join(colls)
        implemented = "; ".join(f"{name} implements {', '.join(algorithms.get(name).collectives)}"
                                for name in algos)
        having = [a for a in algorithms.names()
                  if any(c in algorithms.get(a).implementations for c in colls)]
        if len(algos) == 1:
            return (f"{implemented}, not {wanted}: choose a collective it implements, or an "
                    f"algorithm with {wanted} ({', '.join(having)})")
        return (f"{implemented}; none implements {wanted}: choose a collective one of them "
                f"implements, or an algorithm with {wanted} ({', '.join(having)})")
    fitting = [(name, coll) for name, coll in pairs
               if any(case_ranks(name, p, world_size, options)[0] >= 1
                      for options in algorithms.get(name).battery_options)]
    if not fitting:
        crowded = sorted({name for name, _ in pairs})
        need = "needs" if len(crowded) == 1 else "need"
        return (f"{', '.join(crowded)} {need} switch processes beside the data ranks, and a "
                f"world of {world_size} ranks leaves room for no data rank: start more processes")
    if not op_names and all(coll in REDUCING for _, coll in fitting):
        return "no op is selected; name at least one, or all"
    return (f"no selected op ({', '.join(op_names)}) is defined on a selected dtype "
            f"({', '.join(dtype_names)}): `refcoll list` shows the ops each dtype takes")


def _collectives_and_options(name: str, colls: Sequence[str]):
    algo = algorithms.get(name)
    for coll in colls:
        if coll in algo.implementations:
            for options in algo.battery_options:
                yield coll, tuple(sorted(options.items()))


# ----------------------------------------------------------------- running a case

def _run_collective(t, case: Case, x, xp=np):
    """Run the case's collective on this rank's ``x``; return (output, in-place target)."""
    size, rank = case.ranks, t.rank
    opts = {"algorithm": case.algorithm, **case.kwargs}
    if case.collective == "allreduce":
        return allreduce(x, t, op=case.op, out=x if case.inplace else None, **opts), x
    if case.collective == "reduce_scatter":
        target = x[chunk_slice(x.size, size, rank)] if case.inplace else None
        return reduce_scatter(x, t, op=case.op, out=target, **opts), target
    if case.collective == "allgather":
        if case.inplace:
            buf = xp.empty((size, x.size), dtype=x.dtype)
            buf[rank] = x
            return allgather(buf[rank], t, out=buf, **opts), buf
        return allgather(x, t, **opts), None
    if case.collective == "broadcast":
        return broadcast(x, case.root, t, out=x if case.inplace else None, **opts), x
    target = x if (case.inplace and rank == case.root) else None
    return reduce(x, case.root, t, op=case.op, out=target, **opts), target


@functools.lru_cache(maxsize=4)
def _reference(case: Case, seed: int) -> dict:
    """The case's expected results over all ranks, computed once per process.

    ``full``: the naive fold (or the gathered / broadcast data); for cases whose
    result depends on the order, ``exact`` and ``bound`` too.
    """
    inputs = _case_inputs(case.kind, case.dtype, case.count, case.ranks, case.op or "sum", seed)
    if case.collective == "allgather":
        return {"full": np.stack(inputs)}
    if case.collective == "broadcast":
        return {"full": inputs[case.root]}
    ref = {"full": fold(case.op, inputs)}
    if _ordered(case):
        ref["exact"] = exact_reduce(case.op, inputs)
        ref["bound"] = error_bound(case.op, inputs, DTYPES[case.dtype])
    return ref


def _expected(case: Case, ref: dict, rank: int, key: str = "full"):
    """This rank's part of a reference array (``None`` on non-roots of reduce)."""
    if case.collective == "reduce" and rank != case.root:
        return None
    full = ref[key]
    if case.collective == "reduce_scatter":
        return full[chunk_slice(full.size, case.ranks, rank)]
    return full


def _ordered(case: Case) -> bool:
    """Whether the case's result depends on the reduction order (needs the oracle)."""
    return (case.kind == "random" and case.op in ("sum", "avg", "prod")
            and is_float(DTYPES[case.dtype]))


def _misplaced(output, xp) -> str:
    """Return why ``output`` is not an array of ``xp`` like the input, or ``""``."""
    if xp_module.array_namespace(output) is xp:
        return ""
    return (f"returned a {type(output).__module__}.{type(output).__name__} for {xp.__name__} "
            "input: the result must live where the input does")


def _digest(arr) -> bytes:
    if arr is None:
        return b"none"
    return hashlib.blake2b(np.ascontiguousarray(xp_module.to_host(arr)).tobytes(),
                           digest_size=16).digest()


def _first_difference(got: np.ndarray, want: np.ndarray) -> str:
    g = got.reshape(-1).view(np.uint8).reshape(got.size, -1) if got.size else got
    w = want.reshape(-1).view(np.uint8).reshape(want.size, -1) if want.size else want
    differs = np.flatnonzero((g != w).any(axis=1)) if got.size else []
    i = int(differs[0])
    return (f"element {i} is {got.reshape(-1)[i]!r}, expected {want.reshape(-1)[i]!r} "
            f"({len(differs)} of {got.size} differ)")


def _local_checks(t, case: Case, seed: int, x, before, output, target, error,
                  xp=np) -> list[str]:
    """Return this rank's problems with its own output (empty: all good).

    ``x`` and ``output`` are arrays of ``xp``; ``before`` is the input as it was,
    on the host. Values are compared on host copies.
    """
    rank = t.rank
    if error is not None:
        return [f"raised {type(error).__name__}: {error}"]
    problems = []
    with _inputs_lock:
        ref = _reference(case, seed)
    expected = _expected(case, ref, rank)
    if expected is None:
        if output is not None:
            problems.append("non-root rank of reduce returned a result")
        return problems
    if output is None:
        return ["returned None"]
    misplaced = _misplaced(output, xp)
    if misplaced:
        return [misplaced]
    if output.dtype != expected.dtype or output.size != expected.size:
        return [f"output is {output.dtype}[{output.size}], expected {expected.dtype}[{expected.size}]"]
    if case.inplace and target is not None and output.size and not xp.shares_memory(output, target):
        problems.append("in-place call did not return its out= buffer")
    if not case.inplace and not np.array_equal(xp_module.to_host(x).view(np.uint8),
                                               before.view(np.uint8)):
        problems.append("input was modified by an out-of-place call")
    got = xp_module.to_host(output).reshape(-1)
    want = expected.reshape(-1)
    if _ordered(case):
        idx, err, bound = violations(got, _expected(case, ref, rank, "exact"),
                                     _expected(case, ref, rank, "bound"))
        if len(idx):
            problems.append(f"element {int(idx[0])} off by {err[0]:.3g}, over the error bound "
                            f"{bound[0]:.3g} ({len(idx)} elements outside the bound)")
    elif case.op in ("min", "max") and case.kind == "random":
        if not np.array_equal(got, want, equal_nan=True):
            problems.append(_first_difference(got, want))
    elif not np.array_equal(got.view(np.uint8), want.view(np.uint8)):
        problems.append(_first_difference(got, want))
    return problems


#: Size of one control message: a verdict or report, JSON, zero-padded.
_REPORT_BYTES = 1024


def _pack(obj) -> np.ndarray:
    """Encode a report or verdict as one fixed-size message, shortening long prose."""
    def shorten(value, limit):
        if isinstance(value, str):
            return value if len(value) <= limit else value[: limit - 3] + "..."
        if isinstance(value, list):
            return [shorten(v, limit) for v in value[:3]]
        if isinstance(value, dict):
            return {k: shorten(v, limit) for k, v in value.items()}
        return value

    data = json.dumps(obj).encode()
    limit = _REPORT_BYTES // 2
    while len(data) > _REPORT_BYTES:  # keep the message fixed-size and the shape intact
        data = json.dumps(shorten(obj, limit)).encode()
        limit //= 2
    buf = np.zeros(_REPORT_BYTES, dtype=np.uint8)
    buf[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    return buf


def _unpack(buf: np.ndarray):
    return json.loads(buf.tobytes().rstrip(b"\0"))


def _gather_reports(ctl, report) -> list | None:
    """Gather one small JSON object per rank on rank 0, in rank order."""
    mine = _pack(report)
    if ctl.rank != 0:
        ctl.send(mine, 0)
        return None
    out = [report]
    incoming = np.empty(_REPORT_BYTES, dtype=np.uint8)
    for src in range(1, ctl.size):
        ctl.recv(incoming, src)
        out.append(_unpack(incoming))
    return out


def _bcast_report(ctl, report):
    """Broadcast rank 0's small JSON object to every rank."""
    buf = _pack(report) if ctl.rank == 0 else np.empty(_REPORT_BYTES, dtype=np.uint8)
    naive_broadcast(ctl, buf, root=0)
    return _unpack(buf)


def _barrier(ctl) -> None:
    token = np.zeros(1, dtype=np.uint8)
    if ctl.rank == 0:
        for src in range(1, ctl.size):
            ctl.recv(token, src)
    else:
        ctl.send(token, 0)
    naive_broadcast(ctl, token, root=0)


@functools.lru_cache(maxsize=4)
def _case_inputs(kind: str, dtype: str, count: int, size: int, op: str, seed: int):
    """Every rank's input, read-only, shared by the simulated ranks of one process."""
    inputs = make_inputs(kind, DTYPES[dtype], count, size, op=op, seed=seed)
    for x in inputs:
        x.flags.writeable = False
    return tuple(inputs)


_inputs_lock = threading.Lock()


def run_case(t, ctl, case: Case, *, seed: int = 0, xp=np) -> CaseResult:
    """Run one case on the case's ranks of ``t`` (``t`` is None on idle ranks).

    ``ctl`` spans every rank of the battery and carries the verdicts. Ranks
    ``case.ranks .. case.total-1`` hold no data (switches): they serve the call
    with a template buffer and must get ``None`` back. ``xp`` is the array
    module the inputs are made in (CuPy: on this rank's GPU).
    """
    with _inputs_lock:  # simulated ranks are threads: generate each case's inputs once
        inputs = _case_inputs(case.kind, case.dtype, case.count, case.ranks, case.op or "sum",
                              seed)
    rank = ctl.rank
    problems: list[str] = []
    output = None
    # The transport the calls run on (device arrays: its wrapper, agreed on by every rank of
    # ``t`` here rather than inside a call that might fail first); auto resolves on it.
    carrier = None if t is None else device_for(t, xp.zeros(0, np.uint8))
    if rank < case.ranks:
        x = xp.array(inputs[rank])  # a writeable copy, on the device for a GPU run
        target = error = None
        try:
            output, target = _run_collective(t, case, x, xp)
        except CollectiveTimeout:
            raise  # the job cannot go on: the caller aborts it
        except Exception as exc:  # noqa: BLE001 - a failing case is a verdict, not a crash
            error = exc
        _barrier(ctl)  # every rank has finished the case: nothing may still be in flight
        problems += [f"{m} left unreceived" for m in t.unreceived()]
        problems += _local_checks(t, case, seed, x, inputs[rank], output, target, error, xp)
    elif rank < case.total:
        try:
            served, _ = _run_collective(t, case, xp.zeros(inputs[0].shape, inputs[0].dtype), xp)
            if served is not None:
                problems.append("a rank without data (switch) returned a result")
        except Exception as exc:  # noqa: BLE001
            problems.append(f"raised {type(exc).__name__}: {exc}")
        _barrier(ctl)
        problems += [f"{m} left unreceived" for m in t.unreceived()]
    else:
        _barrier(ctl)
    reports = _gather_reports(ctl, {"problems": problems, "digest": _digest(output).hex()})
    verdict = None
    if ctl.rank == 0:
        algorithm, options = case.algorithm, case.kwargs
        if algorithm == "auto":
            algorithm = resolve(carrier, case.collective, case.count, DTYPES[case.dtype].itemsize)
        if algorithm == "hierarchical" and "ranks_per_node" not in options:
            # The real nodes (MPI_COMM_TYPE_SHARED) shape the order: predict with them,
            # assuming the launcher placed consecutive ranks on a node, as MPICH's does.
            from ..algorithms.hierarchical import node_layout

            sizes = node_layout(t).sizes
            if len(sizes) > 1:
                options = dict(options, ranks_per_node=sizes[0])
        verdict = _judge(case, inputs, reports, algorithm, options)
    verdict = _bcast_report(ctl, verdict)
    return CaseResult(case, not verdict, "; ".join(verdict))


def _judge(case: Case, inputs, reports: list[dict], algorithm: str, options: dict) -> list[str]:
    """Rank 0's verdict: every rank's problems, rank agreement, and the ordered oracle.

    ``algorithm`` is the one that ran: ``auto`` resolved on the real transport, so
    the oracle predicts the algorithm its calibration picked.
    """
    problems = [f"rank {r}: {msg}" for r, rep in enumerate(reports) for msg in rep["problems"]]
    digests = [rep["digest"] for rep in reports[: case.ranks]]
    if case.collective in ("allreduce", "allgather", "broadcast") and len(set(digests)) > 1:
        differing = [r for r, d in enumerate(digests) if d != digests[0]]
        problems.append(f"ranks {differing} hold different bits from rank 0")
    if _ordered(case) and not problems:
        predicted = simulate(case.collective, inputs, algorithm=algorithm, op=case.op,
                             **({"root": case.root} if case.collective == "reduce" else {}),
                             **options)
        for r, (want, got) in enumerate(zip(predicted.outputs, digests)):
            if _digest(want).hex() != got:
                problems.append(f"rank {r}: differs from the simulator's bit-exact prediction "
                                f"for {algorithm}")
    return problems


def run_battery(t, cases: Sequence[Case], *, seed: int = 0,
                progress: Callable[[int, int, CaseResult], None] | None = None,
                xp=np) -> list[CaseResult]:
    """Run ``cases`` on every rank of ``t`` (all ranks pass the same list), on arrays of ``xp``."""
    ctl = t.split(0, t.rank)
    by_size = {t.size: t}  # one communicator per rank count the cases need, split once
    results = []
    for i, case in enumerate(cases):
        if case.total not in by_size:
            by_size[case.total] = t.split(0 if t.rank < case.total else -1, t.rank)
        result = run_case(by_size[case.total], ctl, case, seed=seed, xp=xp)
        results.append(result)
        if progress is not None:
            progress(i, len(cases), result)
    return results


def group_rows(results: Sequence[CaseResult]) -> list[dict]:
    """Summarize results by (algorithm, collective, op, options): one row per group."""
    groups: dict[tuple, dict] = {}
    for res in results:
        c = res.case
        key = (c.algorithm, c.collective, c.op or "-", c.options)
        options = " ".join(f"{k}={v}" for k, v in c.options)
        row = groups.setdefault(key, {"algorithm": c.algorithm, "collective": c.collective,
                                      "op": c.op or "-", "options": options, "dtypes": set(),
                                      "cases": 0,
                                      "passed": 0, "failed": 0, "first_failure": ""})
        row["dtypes"].add(c.dtype)
        row["cases"] += 1
        if res.passed:
            row["passed"] += 1
        else:
            row["failed"] += 1
            if not row["first_failure"]:
                row["first_failure"] = f"{c.id}: {res.reason}"
    rows = []
    for row in groups.values():
        row["dtypes"] = len(row["dtypes"])
        rows.append(row)
    return rows


# ------------------------------------------------------------- compressed all-reduce

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
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def options(self) -> tuple:
        return (("compressor", self.compressor), ("pattern", self.pattern))

    @property
    def id(self) -> str:
        shape = "x".join(map(str, self.shape))
        return "-".join([self.compressor, self.pattern, self.algorithm, self.op, self.dtype,
                         f"shape{shape}", self.kind])


def compressor_shapes(p: int) -> list[tuple]:
    """Return the shapes of the compressed battery: empty, one element, ``p+1``, a matrix."""
    return [(0,), (1,), (p + 1,), (40, 25)]


def build_compressor_cases(p: int, *, compressors: Iterable[str] | None = None,
                           algorithms_: Iterable[str] | None = None,
                           ops: Iterable[str] | None = None,
                           dtypes: Iterable[str] | None = None,
                           allow_empty: bool = True) -> list[CompressorCase]:
    """Return the compressed battery for ``p`` ranks.

    Every compressor runs every pattern it allows; the ``allreduce`` pattern
    once per algorithm (``None``: every algorithm without switch processes),
    the others (which use no all-reduce algorithm) once. Ops: ``sum`` and
    ``avg``; dtypes: float32 and float64 unless given. ``none`` runs on exact
    inputs as well, where it must equal the naive reduction bit for bit.

    Raises:
        UsageError: an unknown or unusable name, no algorithm selected; or, with
            ``allow_empty=False``, a selection that leaves no case, saying why.
    """
    from ..compressors import parse

    specs = list(compressors) if compressors is not None else list(COMPRESSOR_BATTERY)
    comps = [parse(s) for s in specs]
    algos = (list(algorithms_) if algorithms_ is not None else
             [a for a in algorithms.names() if algorithms.get(a).workers is None])
    if not algos:  # every pattern names an algorithm, if only for its dense bytes
        raise UsageError("no all-reduce algorithm is selected for the compressed battery; "
                         "name at least one, or all")
    for name in algos:
        if algorithms.get(name).workers is not None:
            raise UsageError(f"{name} needs switch processes and cannot run compressed payloads")
    op_names = list(ops) if ops is not None else ["sum", "avg"]
    for op in op_names:
        if op not in ("sum", "avg"):
            raise UsageError(f"a compressed all-reduce takes op sum or avg, not {op!r}")
    dtype_names = list(dtypes) if dtypes is not None else ["float32", "float64"]
    for d in dtype_names:
        if not is_float(get_dtype(d)) or d.startswith("float8"):
            raise UsageError(f"compressors take float16, bfloat16, float32 or float64, not {d}")
    cases = []
    for spec, comp in zip(specs, comps):
        for pattern in comp.patterns:
            # Only the allreduce pattern runs an algorithm; the others name one for
            # the dense bytes they are compared with: ring, unless it is not selected.
            dense = ["ring" if "ring" in algos else algos[0]]
            for algo in (algos if pattern == "allreduce" else dense):
                for op in op_names:
                    for dt in dtype_names:
                        for shape in compressor_shapes(p):
                            kinds = ["exact", "random"] if comp.spec() == "none" else ["random"]
                            for kind in kinds:
                                cases.append(CompressorCase(comp.spec(), pattern, algo, op, dt,
                                                            shape, kind))
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
    (:func:`refcoll.compressors.collective.simulate_compressed`); with ``none``
    on exact inputs, the naive reduction.

    With ``xp`` CuPy the tensors are on the GPU and the simulator runs on the
    GPU too: stochastic compressors draw their rounding from the device's
    generator and summed scales come out of the device's reduction order, so
    the same code on the same device is the prediction that holds bit for bit.
    """
    from ..compressors.collective import run_steps, simulate_compressed

    with _inputs_lock:
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
        if _misplaced(out, xp):
            problems.append(f"step {step}: {_misplaced(out, xp)}")
        elif out.shape != x.shape or out.dtype != x.dtype:
            problems.append(f"step {step}: result has shape {out.shape} and dtype {out.dtype}, "
                            f"not {x.shape} and {x.dtype}")
    _barrier(ctl)
    problems += [f"{m} left unreceived" for m in t.unreceived()]
    reports = _gather_reports(ctl, {
        "problems": problems,
        "digests": [_digest(o).hex() for o in outputs],
        "traffic": [[m.sent, m.received] for m in traffic],
    })
    verdict = None
    if ctl.rank == 0:
        verdict = [f"rank {r}: {msg}" for r, rep in enumerate(reports) for msg in rep["problems"]]
        if not verdict:
            on_device = [[xp.asarray(x) for x in step] for step in inputs]
            predicted = simulate_compressed(case.compressor, on_device, seed=seed, op=case.op,
                                            algorithm=_oracle_algorithm(carrier, case),
                                            pattern=case.pattern)
            verdict += _judge_compressed(case, inputs, reports, predicted)
    verdict = _bcast_report(ctl, verdict)
    return CaseResult(case, not verdict, "; ".join(verdict))


def _oracle_algorithm(t, case: CompressorCase) -> str:
    """Return the algorithm the simulator must run to predict ``t``'s (``auto`` resolved).

    ``t`` is the transport the calls ran on (for device arrays, its wrapper).
    """
    if case.algorithm == "auto":
        return resolve(t, "allreduce", case.count, DTYPES[case.dtype].itemsize)
    return case.algorithm


def _judge_compressed(case: CompressorCase, inputs, reports: list[dict], predicted) -> list[str]:
    problems = []
    for step in range(case.steps):
        digests = [rep["digests"][step] for rep in reports]
        if len(set(digests)) > 1:
            differing = [r for r, d in enumerate(digests) if d != digests[0]]
            problems.append(f"step {step}: ranks {differing} hold different bits from rank 0")
        for r, want in enumerate(predicted.outputs[step]):
            if _digest(want).hex() != digests[r]:
                problems.append(f"step {step}: rank {r} differs from the simulator's prediction")
            moved = predicted.traffic[step][r]
            if reports[r]["traffic"][step] != [moved.sent, moved.received]:
                problems.append(f"step {step}: rank {r} sent/received "
                                f"{reports[r]['traffic'][step]} B, the simulator "
                                f"{[moved.sent, moved.received]} B")
        if case.kind == "exact" and case.compressor == "none":
            want = fold(case.op, [x.reshape(-1) for x in inputs[step]])
            if _digest(want).hex() != digests[0]:
                problems.append(f"step {step}: none differs from the naive reduction")
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
