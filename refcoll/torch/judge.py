"""torch.distributed's own collectives judged by the oracle: ``refcoll verify --backend torch``.

The battery's cases on ``all_reduce``, ``reduce_scatter_tensor``,
``all_gather_into_tensor``, ``broadcast`` and ``reduce`` of a Gloo group (CPU
tensors) or an NCCL group (CUDA tensors), run and judged as every library's own
collectives are (:mod:`refcoll.verify.conformance.library`: rank 0 gathers the
outputs over a Gloo group of its own and judges them with the oracle).

torch's forms, as its users call them: ``all_reduce``, ``broadcast`` and
``reduce`` work in place only; ``reduce_scatter_tensor`` in place writes rank r's
chunk over its own part of the input, ``all_gather_into_tensor`` in place reads
each rank's input from its block of the output (as FSDP calls them).
``reduce_scatter_tensor`` needs equal chunks: a count ``p`` does not divide is
padded with zeros to the next multiple, as FSDP pads its flat parameter, and the
padding is judged with the rest. What the backend refuses (torch 2.13's Gloo:
int16, unsigned types beyond uint8, float8, and AVG of integers, which it divides
in float) is listed as not supported, never as failed. Gloo's order is its own,
so floats are held to no refcoll order, but each order-dependent case records
which refcoll orders give its bits (for Gloo's all-reduce,
``ring(direction=reverse, split=gloo)``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from ..core.errors import UsageError
from ..core.ops import DTYPES
from ..transport.torch import TorchTransport
from ..verify.conformance.cases import Case
from ..verify.conformance.library import (
    LibraryJudge,
    LibraryReport,
    build_library_cases,
    verdict,
)
from ..verify.inputs import make_input
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

def build_cases(p: int, backend: str, **filters) -> list[Case]:
    """Return the cases for torch's collectives on ``p`` ranks, grouped by (collective, op).

    :func:`~refcoll.verify.conformance.library.build_library_cases` with torch's
    calls; a case's ``algorithm`` is the backend (``gloo``).
    """
    return build_library_cases(p, backend, TORCH_CALLS, IN_PLACE_ONLY, **filters)


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


# -------------------------------------------------------------------------- runs

@dataclass
class TorchReport(LibraryReport):
    """What a run of torch's collectives found (:class:`LibraryReport`), written as before."""

    @property
    def torch_version(self) -> str:
        return self.version

    def to_json(self) -> dict:
        """Return the report as ``refcoll verify --backend torch --json`` writes it."""
        data = super().to_json()
        data.update(backend="torch", torch=self.version, torch_backend=self.backend)
        data.pop("version")
        data.pop("library")
        return data


class TorchJudge(LibraryJudge):
    """torch's collectives on a process group, judged on rank 0.

    ``device``: ``cpu`` (Gloo) or ``gpu`` (NCCL, a CUDA device per rank); ``group``:
    the group judged, ``None`` to start the default one as the launcher asks
    (:func:`refcoll.torch.init_process_group`). Collective over the default group:
    every process makes the Gloo group the verdicts travel over.
    """

    calls = TORCH_CALLS
    in_place_only = IN_PLACE_ONLY
    exchange = _EXCHANGE
    report_class = TorchReport

    def __init__(self, device: str = "cpu", *, group=None):
        torch, dist = _dist()
        if group is None:
            group = init_process_group(backend_for(device))
        self.group = group
        members = dist.get_process_group_ranks(group)
        backend = str(dist.get_backend(group)).lower()
        super().__init__(rank=dist.get_rank(group), size=dist.get_world_size(group),
                         ctl=TorchTransport(dist.new_group(ranks=members, backend="gloo")),
                         library="torch", version=torch.__version__, backend=backend,
                         launcher=launcher())
        self.device = f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu"
        self.torch_version = torch.__version__

    def input(self, case: Case, rank: int, seed: int) -> np.ndarray:
        return _input(case, rank, seed)

    def output_count(self, case: Case, rank: int) -> int:
        return _output_count(case)

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


def judge_collectives(group=None, *, device: str = "cpu", seed: int = 0,
                      **filters) -> TorchReport:
    """Run the battery on torch's own collectives of ``group``; return what it found.

    On every rank (under ``torchrun`` or ``mpiexec``); ``filters`` are
    :func:`build_cases`'s: ``judge_collectives(dtypes=["float32"]).failed == 0``.
    """
    judge = TorchJudge(device, group=group)
    return judge.run(judge.cases(**filters), seed=seed)
