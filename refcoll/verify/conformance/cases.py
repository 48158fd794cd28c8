"""The battery's cases: what one check runs, which sizes, and every case a selection gives.

The selection needs no MPI: ``refcoll verify`` builds it before it starts
``mpiexec``, so an empty or impossible selection fails at once, saying which
choice left nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

from ... import algorithms
from ...core.errors import UsageError
from ...core.ops import DTYPES, OPS, get_dtype, get_op, is_float, supports

__all__ = ["Case", "CaseResult", "LARGE_SIZE", "REDUCING", "ROOTED", "default_sizes",
           "case_ranks", "build_cases", "call_cases", "ordered"]

#: The "large odd" size of the default battery: odd, and prime, so it divides by no p.
LARGE_SIZE = 5003
#: Collectives that take an op.
REDUCING = ("allreduce", "reduce_scatter", "reduce")
#: Collectives that take a root.
ROOTED = ("broadcast", "reduce")


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
        """Return the case's readable name: every parameter, options and switches last."""
        parts = [self.algorithm, self.collective, self.op or "-", self.dtype, f"n{self.count}",
                 "inplace" if self.inplace else "outplace", self.kind]
        if self.collective in ROOTED:
            parts.append(f"root{self.root}")
        parts += [f"{k}={v}" for k, v in self.options]
        if self.total != self.ranks:
            parts.append(f"p{self.ranks}+{self.total - self.ranks}")
        return "-".join(parts)

    @property
    def group(self) -> tuple:
        """Return the case's group: ``(algorithm, collective, op, options)``, one summary row."""
        return (self.algorithm, self.collective, self.op, self.options)

    @property
    def kwargs(self) -> dict:
        """Return the case's algorithm options as keyword arguments."""
        return dict(self.options)


@dataclass
class CaseResult:
    """A case and its verdict (the same on every rank)."""

    case: Case
    passed: bool
    reason: str = ""

    def to_json(self) -> dict:
        """Return the case's fields, its id and its verdict, for ``--json``."""
        return {**asdict(self.case), "id": self.case.id, "passed": self.passed,
                "reason": self.reason}


def ordered(case: Case) -> bool:
    """Return whether the case's result depends on the reduction order (needs the oracle)."""
    return (case.kind == "random" and case.op in ("sum", "avg", "prod")
            and is_float(DTYPES[case.dtype]))


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
    ``p``) is how many ranks the battery runs on, switches included.

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
            cases += call_cases(name, coll, options, ranks, total, op_names, dtype_names,
                                size_list, inplace)
    if not cases and not allow_empty:
        raise UsageError("no conformance case matches the selection: " + _why_no_case(
            p, algos, colls, op_names, dtype_names, size_list, list(inplace), world_size))
    return cases


def call_cases(name: str, coll: str, options, ranks: int, total: int, op_names, dtype_names,
               size_list, modes) -> list[Case]:
    """Return one call's cases: each op (of a reducing collective) × dtype × size × mode × kind.

    Ops a dtype does not support are left out; floats get exact and random
    inputs, integers exact ones; a rooted collective's root is ``(count + 1) % ranks``.
    """
    cases = []
    for op in (op_names if coll in REDUCING else [None]):
        for dt in dtype_names:
            if not supports(op, dt):
                continue
            kinds = ["exact", "random"] if is_float(DTYPES[dt]) else ["exact"]
            for count in size_list:
                for mode in modes:
                    for kind in kinds:
                        root = (count + 1) % ranks if coll in ROOTED else 0
                        cases.append(Case(name, coll, op, dt, count, mode, kind, root,
                                          options, ranks, total))
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
    """Yield ``(collective, sorted options)`` of every case group of one algorithm."""
    algo = algorithms.get(name)
    for coll in colls:
        if coll in algo.implementations:
            for options in algo.battery_options:
                yield coll, tuple(sorted(options.items()))
