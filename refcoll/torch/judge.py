"""torch.distributed's own collectives judged by the oracle: ``refcoll verify --backend torch``.

The battery's cases on ``all_reduce``, ``reduce_scatter_tensor``,
``all_gather_into_tensor``, ``broadcast`` and ``reduce`` of a Gloo group (CPU
tensors) or an NCCL group (CUDA tensors). A torch collective has no algorithm to
name: a case is (collective, op, dtype, count, in place or not, input kind), with
the battery's inputs (:func:`refcoll.verify.inputs.make_input`). Rank 0 gathers
every rank's output over a Gloo group of its own (the group under test carries
only the calls under test) and judges them as ``refcoll check`` judges another
library (:func:`refcoll.verify.oracle.check_outputs`): every rank the same bits
where all get the same result; integers, ``min``/``max`` and data movement bit for
bit; float ``sum``/``avg``/``prod`` within the error bound and, on ``exact``
inputs, the naive fold's bits, as the battery holds refcoll's own; an out-of-place
input unchanged.

torch's forms, as its users call them: ``all_reduce``, ``broadcast`` and
``reduce`` work in place only; ``reduce_scatter_tensor`` in place writes rank r's
chunk over its own part of the input, ``all_gather_into_tensor`` in place reads
each rank's input from its block of the output (as FSDP calls them).
``reduce_scatter_tensor`` needs equal chunks: a count ``p`` does not divide is
padded with zeros to the next multiple, as FSDP pads its flat parameter, and the
padding is judged with the rest. Each (collective, op, dtype) is first tried on a
small input; what the backend refuses there (torch 2.13's Gloo: int16, unsigned
types beyond uint8, float8, and AVG of integers, which it divides in float) is listed
as not supported, never as failed; a case that raises after its probe passed fails.
Gloo's order is its own, so floats are held to no refcoll order, but each
order-dependent case records which refcoll orders give its bits
(:func:`refcoll.verify.identify.identify`: for Gloo's all-reduce,
``ring(direction=reverse, split=gloo)``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ..calls.agree import gather_records
from ..core.bits import first_difference, same_bits
from ..core.chunking import chunk_slice
from ..core.errors import UsageError
from ..core.ops import DTYPES, OPS, get_dtype, get_op, is_float
from ..transport.torch import TorchTransport
from ..verify.conformance.cases import Case, CaseResult, call_cases, default_sizes, ordered
from ..verify.conformance.control import bcast_report, gather_reports
from ..verify.conformance.judge import group_rows
from ..verify.identify import identify
from ..verify.inputs import make_input
from ..verify.oracle import check_outputs, fold
from .launch import INSTALL_HINT, init_process_group, launcher, reduce_op, torch_installed
from .tensors import as_array, cpu_tensor

__all__ = ["TORCH_CALLS", "IN_PLACE_ONLY", "INSTALL_HINT", "backend_for", "require_torch",
           "build_cases", "verdict", "TorchJudge", "TorchReport", "judge_collectives"]

#: refcoll's name of each collective -> the ``torch.distributed`` call judged.
TORCH_CALLS = {"allreduce": "all_reduce", "reduce_scatter": "reduce_scatter_tensor",
               "allgather": "all_gather_into_tensor", "broadcast": "broadcast",
               "reduce": "reduce"}

#: Collectives torch offers in place only: the tensor is the input and the result.
IN_PLACE_ONLY = ("allreduce", "broadcast", "reduce")

_EXCHANGE = "refcoll verify --backend torch"  # what a timeout of the verdicts' exchange names


def _dist():
    import torch
    import torch.distributed as dist  # imported lazily: torch is an optional extra

    return torch, dist


_torch_installed = torch_installed  # looked up when called: a test can stand in for torch


def backend_for(device: str) -> str:
    """Return the torch backend whose collectives are judged on ``device``: gloo or nccl."""
    return "nccl" if device == "gpu" else "gloo"


def require_torch(device: str = "cpu") -> None:
    """Refuse, before any process starts, a run without torch (or, for NCCL, without CUDA)."""
    if not _torch_installed():
        raise UsageError(f"--backend torch needs PyTorch, which is not installed: {INSTALL_HINT}")
    if device == "gpu" and not _dist()[0].cuda.is_available():
        raise UsageError("--backend torch --device gpu judges NCCL, which needs a CUDA device; "
                         "torch sees none (use --device cpu for Gloo)")


# ------------------------------------------------------------------------- cases

def build_cases(p: int, backend: str, *, collectives: Sequence[str] | None = None,
                ops: Sequence[str] | None = None, dtypes: Sequence[str] | None = None,
                sizes: Sequence[int] | None = None, inplace: Sequence[bool] = (False, True),
                allow_empty: bool = True) -> list[Case]:
    """Return the cases for torch's collectives on ``p`` ranks, grouped by (collective, op).

    ``None`` means every collective, op and dtype, and the battery's sizes. A
    case's ``algorithm`` is the backend (``gloo``); its root the battery's,
    ``(count + 1) % p``. Raises :class:`UsageError` for an unknown name, and with
    ``allow_empty=False`` for a selection that leaves no case, saying why.
    """
    colls = list(collectives) if collectives is not None else list(TORCH_CALLS)
    if set(colls) - set(TORCH_CALLS):
        raise UsageError(f"unknown collective {sorted(set(colls) - set(TORCH_CALLS))[0]!r}: "
                         f"choose one of {', '.join(TORCH_CALLS)}")
    op_names = [get_op(o).name for o in (ops if ops is not None else OPS)]
    dtype_names = list(dtypes) if dtypes is not None else list(DTYPES)
    for d in dtype_names:
        get_dtype(d)
    size_list = list(sizes) if sizes is not None else default_sizes(p)
    cases = []
    for coll in colls:
        modes = [m for m in inplace if m or coll not in IN_PLACE_ONLY]
        cases += call_cases(backend, coll, (), p, p, op_names, dtype_names, size_list, modes)
    if not cases and not allow_empty:
        raise UsageError("no case matches the selection: " + _why_no_case(
            p, colls, op_names, dtype_names, size_list, list(inplace)))
    return cases


def _why_no_case(p, colls, op_names, dtype_names, size_list, modes) -> str:
    empty = [what for what, chosen in (("collective", colls), ("dtype", dtype_names),
                                       ("size", size_list), ("mode", modes)) if not chosen]
    if p < 1 or empty:
        return f"at least 1 rank and one {empty[0] if empty else 'rank'} are needed"
    if True not in modes and all(c in IN_PLACE_ONLY for c in colls):
        return (f"torch's {', '.join(TORCH_CALLS[c] for c in IN_PLACE_ONLY)} work in place "
                "only, so --inplace no leaves nothing of them: use --inplace both")
    return (f"no selected op ({', '.join(op_names) or 'none'}) is defined on a selected dtype "
            f"({', '.join(dtype_names)}): `refcoll list` shows the ops each dtype takes")


def _padded_count(case: Case) -> int:
    """Return the count each rank passes: reduce_scatter's padded to a multiple of ``p``."""
    p = case.ranks
    return -(-case.count // p) * p if case.collective == "reduce_scatter" else case.count


def _input(case: Case, rank: int, seed: int) -> np.ndarray:
    """Return rank ``rank``'s input as the battery makes it, zero-padded where torch needs it."""
    x = make_input(case.kind, DTYPES[case.dtype], case.count, rank, case.ranks,
                   op=case.op or "sum", seed=seed)
    pad = _padded_count(case) - case.count
    return np.concatenate([x, np.zeros(pad, x.dtype)]) if pad else x


def _output_count(case: Case) -> int:
    n, p = _padded_count(case), case.ranks
    return {"reduce_scatter": n // p, "allgather": n * p}.get(case.collective, n)


# ---------------------------------------------------------------------- verdicts

def _inexact(case: Case, inputs, outputs) -> list[str]:
    """Return where an ``exact`` case's float sum, avg or prod is not the fold's bits.

    The oracle bounds float sums, averages and products; exact inputs give every
    order the same bits, so they must be the fold's.
    """
    if case.kind != "exact" or case.op not in ("sum", "avg", "prod") or \
            not is_float(DTYPES[case.dtype]):
        return []
    full = fold(case.op, inputs)
    for r, out in enumerate(outputs):
        if out is None:
            continue
        want = full[chunk_slice(full.size, case.ranks, r)] if \
            case.collective == "reduce_scatter" else full
        if not same_bits(out, want):
            return [f"rank {r}: exact inputs, yet not the exact result: "
                    f"{first_difference(out, want)}"]
    return []


def verdict(case: Case, inputs, outputs, problems: Sequence[str] = ()) -> dict:
    """Return the verdict on one case's per-rank ``outputs`` (``None`` where a rank has none).

    ``inputs``: every rank's input as passed (padded); ``problems``: what the ranks
    found themselves. Returns ``{"problems": [...], "same_bits": orders or None}``
    (passed when ``problems`` is empty; orders for order-dependent cases only).
    """
    problems = list(problems)
    if problems:
        return {"problems": problems, "same_bits": None}
    report = check_outputs(inputs, outputs, collective=case.collective, op=case.op or "sum",
                           root=case.root)
    problems = [f"{f.check}: {f.detail}" for f in report.findings if not f.passed]
    problems += _inexact(case, inputs, outputs)
    same = identify(inputs, outputs, collective=case.collective, op=case.op or "sum",
                    root=case.root, known=[]).matches if ordered(case) and not problems else None
    return {"problems": problems, "same_bits": same}


@dataclass
class TorchReport:
    """What a run found: ``results`` (a ``CaseResult`` per case run), ``unsupported``
    (per (collective, op, dtype) the backend refused: torch's ``call``, its ``reason``
    and the ``cases`` not run) and ``same_bits`` (``"collective op dtype"`` -> the
    refcoll orders whose simulated results equal the backend's on every
    order-dependent case of that class).
    """

    backend: str
    torch_version: str
    world_size: int
    seed: int
    launcher: str
    results: list = field(default_factory=list)
    unsupported: list = field(default_factory=list)
    same_bits: dict = field(default_factory=dict)

    @property
    def passed(self) -> int:
        return sum(r.passed for r in self.results)

    @property
    def failed(self) -> int:
        return len(self.results) - self.passed

    def unsupported_summary(self) -> list[dict]:
        """Return the refused classes merged: per call and reason, dtypes refused the same ops."""
        ops: dict[tuple, list] = {}
        for u in self.unsupported:
            ops.setdefault((u["call"], u["reason"], u["dtype"]), []).append(u["op"])
        merged: dict[tuple, dict] = {}
        for (call, reason, dtype), refused in ops.items():
            merged.setdefault((call, reason, tuple(refused)), {"call": call, "ops": refused,
                               "dtypes": [], "reason": reason})["dtypes"].append(dtype)
        return list(merged.values())

    def to_json(self) -> dict:
        """Return the report as ``refcoll verify --backend torch --json`` writes it."""
        return {"backend": "torch", "torch": self.torch_version, "torch_backend": self.backend,
                "launcher": self.launcher, "world_size": self.world_size, "seed": self.seed,
                "passed": self.passed, "failed": self.failed,
                "not_supported": sum(u["cases"] for u in self.unsupported),
                "groups": group_rows(self.results), "unsupported": self.unsupported,
                "same_bits": self.same_bits, "cases": [r.to_json() for r in self.results]}


# -------------------------------------------------------------------------- runs

class TorchJudge:
    """torch's collectives on a process group, judged on rank 0.

    ``device``: ``cpu`` (Gloo) or ``gpu`` (NCCL, a CUDA device per rank); ``group``:
    the group judged, ``None`` to start the default one as the launcher asks
    (:func:`refcoll.torch.init_process_group`). Collective over the default group:
    every process makes the Gloo group the verdicts travel over.
    """

    def __init__(self, device: str = "cpu", *, group=None):
        torch, dist = _dist()
        if group is None:
            group = init_process_group(backend_for(device))
        self.group = group
        self.backend = str(dist.get_backend(group)).lower()
        members = dist.get_process_group_ranks(group)
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.ctl = TorchTransport(dist.new_group(ranks=members, backend="gloo"))
        self.device = f"cuda:{torch.cuda.current_device()}" if self.backend == "nccl" else "cpu"
        self.torch_version = torch.__version__
        self.launcher = launcher()
        self._refused: dict[tuple, str | None] = {}

    def cases(self, **filters) -> list[Case]:
        """Return :func:`build_cases`'s cases for this group; an empty selection is an error."""
        return build_cases(self.size, self.backend, allow_empty=False, **filters)

    def share(self, obj):
        """Return rank 0's small JSON object on every rank (a verdict, an error)."""
        with self.ctl.call(_EXCHANGE):
            return bcast_report(self.ctl, obj)

    # ------------------------------------------------------------ torch's calls

    def _tensor(self, array: np.ndarray, dtype: str):
        """Return a writeable tensor holding ``array`` (of ``dtype``), on the group's device."""
        x = cpu_tensor(np.array(array, dtype=DTYPES[dtype], copy=True))
        return x if self.device == "cpu" else x.to(self.device)

    def _empty(self, count: int, like):
        """Return an output tensor filled with a pattern no result has (0xa5 bytes)."""
        torch, _ = _dist()
        out = torch.empty(count, dtype=like.dtype, device=like.device)
        out.view(torch.uint8).fill_(0xA5)
        return out

    def _host(self, tensor) -> np.ndarray:
        """Return a host copy of ``tensor`` as a NumPy array of refcoll's dtype."""
        return np.array(as_array(tensor.detach().cpu().contiguous(), self.ctl), copy=True)

    def _call(self, case: Case, mine: np.ndarray):
        """Run torch's collective of ``case`` on this rank's input; return (result, input)."""
        torch, dist = _dist()
        x = self._tensor(mine, case.dtype)
        op = reduce_op(case.op) if case.op else None
        rank, p, g = self.rank, self.size, self.group
        with warnings.catch_warnings():  # torch 2.13 renames the *_tensor calls
            warnings.simplefilter("ignore", FutureWarning)
            if case.collective == "allreduce":
                dist.all_reduce(x, op=op, group=g)
                out = x
            elif case.collective == "reduce_scatter":
                chunk = x.numel() // p
                out = x[rank * chunk:(rank + 1) * chunk] if case.inplace else self._empty(chunk, x)
                dist.reduce_scatter_tensor(out, x, op=op, group=g)
            elif case.collective == "allgather":
                n = x.numel()
                out = self._empty(n * p, x)
                if case.inplace:
                    out[rank * n:(rank + 1) * n] = x
                    x = out[rank * n:(rank + 1) * n]
                dist.all_gather_into_tensor(out, x, group=g)
            elif case.collective == "broadcast":
                dist.broadcast(x, src=dist.get_global_rank(g, case.root), group=g)
                out = x
            else:
                dist.reduce(x, dst=dist.get_global_rank(g, case.root), op=op, group=g)
                out = x if rank == case.root else None
        if self.device != "cpu":
            torch.cuda.synchronize()
        return out, x

    def refused(self, collective: str, op: str | None, dtype: str) -> str | None:
        """Return why the backend refuses ``collective``, ``op`` on ``dtype`` (None: it takes it).

        Tried once per run on a small exact input on every rank; any rank's
        exception (torch's message, first line) is the answer on every rank.
        """
        key = (collective, op, dtype)
        if key not in self._refused:
            probe = Case(self.backend, collective, op, dtype, self.size, False, "exact", 0, (),
                         self.size, self.size)
            error = None
            try:
                self._call(probe, _input(probe, self.rank, 0))
            except Exception as exc:  # noqa: BLE001 - a refusal is an answer, not a crash
                error = f"{type(exc).__name__}: {_first_line(exc)}"
            with self.ctl.call(_EXCHANGE):
                reports = gather_reports(self.ctl, {"error": error})
                answer = None
                if self.rank == 0:
                    answer = next((rep["error"] for rep in reports if rep["error"]), None)
                self._refused[key] = bcast_report(self.ctl, {"error": answer})["error"]
        return self._refused[key]

    def run_case(self, case: Case, *, seed: int = 0) -> tuple[CaseResult, list | None]:
        """Run one case on every rank; return its verdict and the orders it matches (every rank)."""
        mine = _input(case, self.rank, seed)
        problems: list[str] = []
        result = None
        try:
            out, x = self._call(case, mine)
            result = None if out is None else self._host(out)
            if not case.inplace and case.collective not in IN_PLACE_ONLY and \
                    not same_bits(self._host(x), mine):
                problems.append("input was modified by an out-of-place call")
        except Exception as exc:  # noqa: BLE001 - a failing call is a verdict, not a crash
            problems.append(f"raised {type(exc).__name__}: {_first_line(exc)}")
        nbytes = _output_count(case) * DTYPES[case.dtype].itemsize
        record = np.zeros(nbytes, np.uint8)
        if result is not None:  # the output tensor was made here: its size is right
            record[:] = result.reshape(-1).view(np.uint8)
        with self.ctl.call(_EXCHANGE):
            reports = gather_reports(self.ctl, {"problems": problems,
                                                "output": result is not None})
            records = gather_records(self.ctl, record) if nbytes else [record] * self.size
            found = self._judge(case, seed, reports, records) if self.rank == 0 else None
            found = bcast_report(self.ctl, found)
        return (CaseResult(case, not found["problems"], "; ".join(found["problems"])),
                found["same_bits"])

    def _judge(self, case: Case, seed: int, reports, records) -> dict:
        inputs = [_input(case, r, seed) for r in range(self.size)]
        dtype = DTYPES[case.dtype]
        outputs = [rec.view(dtype) if rep["output"] and not (
            case.collective == "reduce" and r != case.root) else None
            for r, (rep, rec) in enumerate(zip(reports, records))]
        return verdict(case, inputs, outputs, [f"rank {r}: {msg}" for r, rep in
                                               enumerate(reports) for msg in rep["problems"]])

    def run(self, cases: Sequence[Case], *, seed: int = 0,
            on_group: Callable[[dict], None] | None = None) -> TorchReport:
        """Run ``cases`` (every rank the same list); return the report on every rank.

        ``on_group`` is given each group's :func:`group_rows` row (collective
        and op), with ``call`` (torch's name) and ``same_bits`` (dtype -> the
        orders matched) added, once its last case is judged; a group whose
        every case the backend refused has no row.
        """
        report = TorchReport(self.backend, self.torch_version, self.size, seed, self.launcher)
        refused: dict[tuple, dict] = {}
        group: list = []
        for i, case in enumerate(cases):
            key = (case.collective, case.op, case.dtype)
            reason = self.refused(*key)
            if reason is not None:
                refused.setdefault(key, {
                    "collective": case.collective, "call": TORCH_CALLS[case.collective],
                    "op": case.op or "-", "dtype": case.dtype, "reason": reason, "cases": 0}
                )["cases"] += 1
            else:
                result, same = self.run_case(case, seed=seed)
                report.results.append(result)
                group.append(result)
                name = f"{case.collective} {case.op} {case.dtype}"
                if same is not None:  # the orders that match every case of the class so far
                    report.same_bits[name] = [o for o in report.same_bits.get(name, same)
                                              if o in same]
            following = cases[i + 1] if i + 1 < len(cases) else None
            if group and (following is None or (following.collective, following.op) != (
                    case.collective, case.op)):
                if on_group is not None:
                    on_group(self._row(group, report))
                group = []
        report.unsupported = list(refused.values())
        return report

    @staticmethod
    def _row(group: list, report: TorchReport) -> dict:
        row = group_rows(group)[0]
        case = group[0].case
        row["call"] = TORCH_CALLS[case.collective]
        row["same_bits"] = {name.split()[-1]: labels for name, labels in report.same_bits.items()
                            if name.startswith(f"{case.collective} {case.op} ")}
        return row


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)


def judge_collectives(group=None, *, device: str = "cpu", seed: int = 0,
                      **filters) -> TorchReport:
    """Run the battery on torch's own collectives of ``group``; return what it found.

    On every rank (under ``torchrun`` or ``mpiexec``); ``filters`` are
    :func:`build_cases`'s: ``judge_collectives(dtypes=["float32"]).failed == 0``.
    """
    judge = TorchJudge(device, group=group)
    return judge.run(judge.cases(**filters), seed=seed)
