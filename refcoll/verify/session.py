"""A run of a conformance battery in an MPI world: what ``refcoll verify`` does.

Two steps, as the command takes them:

1. Before any process starts, a :class:`Selection` (a battery and its filters)
   says how many ranks to start for ``N`` data ranks (:meth:`Selection.launch_size`:
   algorithms with switch processes need ranks beyond them) and refuses, with
   a reason, a selection that leaves no case.
2. In the world, a :class:`VerifySession` places each rank on its GPU where
   asked, drops from ``all`` what that device cannot run, builds the cases
   for the data ranks, runs them (reporting each finished group of cases) and
   returns the verdicts as the JSON ``refcoll verify --json`` writes.

A battery is a :class:`Battery`: the collectives' (:data:`COLLECTIVES`, the cases,
runs and judges of :mod:`refcoll.verify.conformance`) unless the caller gives
another, as ``refcoll verify --compressor`` gives the compressed all-reduce's
(:data:`refcoll.compressors.conformance.COMPRESSED_ALLREDUCE`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import numpy as np

from .. import algorithms
from ..core import xp as xp_module
from ..core.ops import DTYPES, get_dtype
from ..transport import cuda_aware
from ..transport import device as devices
from ..transport.deadline import mpi_library_version
from ..transport.mpi import MPITransport
from .conformance import build_cases, group_rows, run_battery
from .conformance.outstanding import run_outstanding

__all__ = ["Battery", "COLLECTIVES", "Selection", "VerifySession", "device_namespace",
           "mpi_library"]


def device_namespace(device: str):
    """Return the array namespace of ``device`` (``cpu``: NumPy, ``gpu``: CuPy).

    Raises:
        UsageError: ``gpu`` where CuPy or a GPU is missing, saying why.
    """
    return xp_module.require_cupy("--device gpu") if device == "gpu" else np


def mpi_library() -> str:
    """Return the first line of the MPI library's version string."""
    return mpi_library_version()


def _no_extra_ranks(nprocs: int, filters: dict) -> int:
    return 0


@dataclass(frozen=True)
class Battery:
    """A conformance battery, as a :class:`Selection` and a :class:`VerifySession` run it.

    Attributes:
        build_cases: ``(workers, world_size, *, allow_empty, **filters)``: the cases
            for ``workers`` data ranks in a world of ``world_size``; raises
            :class:`~refcoll.core.errors.UsageError` for a selection that cannot run
            or, with ``allow_empty=False``, leaves no case, saying why.
        run: ``(t, cases, *, seed, progress, xp)``: run the cases on every rank of
            ``t``, calling ``progress(i, total, result)`` after each; each case's
            verdict (a :class:`~refcoll.verify.conformance.CaseResult`).
        on_device: ``(xp, filters)``: the filters less what ``all`` chose that the
            device of ``xp`` cannot run, and the names it lost (the dtypes named
            explicitly are checked before); a name given explicitly that the device
            cannot run is an error.
        extra_ranks: ``(nprocs, filters)``: the switch processes the selection needs
            beside ``nprocs`` data ranks.
        nonblocking: whether each case also runs non-blocking and the outstanding-call
            scenarios (:mod:`refcoll.verify.conformance.outstanding`) follow the battery.
    """

    build_cases: Callable[..., list]
    run: Callable[..., list]
    on_device: Callable[[Any, dict], tuple[dict, list[str]]]
    extra_ranks: Callable[[int, dict], int] = _no_extra_ranks
    nonblocking: bool = False


def _collective_cases(workers: int, world_size: int, **filters) -> list:
    return build_cases(workers, world_size=world_size, **filters)


def _collective_extra_ranks(nprocs: int, filters: dict) -> int:
    chosen = filters.get("algorithms_") or algorithms.names()
    wanted = filters.get("collectives")
    if wanted:  # (an algorithm of none of them runs no case: no processes for it)
        chosen = [name for name in chosen if set(algorithms.get(name).collectives) & set(wanted)]
    return max([algorithms.get(name).extra_ranks(nprocs, **opts) for name in chosen
                if algorithms.get(name).extra_ranks is not None
                for opts in algorithms.get(name).battery_options], default=0)


def _collective_on_device(xp, filters: dict) -> tuple[dict, list[str]]:
    """Leave out of ``all`` the dtypes the device cannot compute in (float8; bfloat16
    before CuPy 14)."""
    if filters["dtypes"] is not None:
        return filters, []
    chosen = [name for name in DTYPES if xp_module.device_supports(DTYPES[name], xp)]
    return dict(filters, dtypes=chosen), [name for name in DTYPES if name not in chosen]


#: The collectives' battery (:func:`~refcoll.verify.conformance.build_cases`,
#: :func:`~refcoll.verify.conformance.run_battery`): filters ``algorithms_``,
#: ``collectives``, ``ops``, ``dtypes``, ``sizes`` and ``inplace``.
COLLECTIVES = Battery(build_cases=_collective_cases, run=run_battery,
                      on_device=_collective_on_device, extra_ranks=_collective_extra_ranks,
                      nonblocking=True)


@dataclass(frozen=True)
class Selection:
    """What to verify: a battery and its filters, ``None`` meaning all.

    Attributes:
        filters: the keywords of the battery's ``build_cases`` (for
            :data:`COLLECTIVES`: ``algorithms_``, ``collectives``, ``ops``,
            ``dtypes``, ``sizes``, ``inplace``).
        battery: the battery (:data:`COLLECTIVES` unless given).
    """

    filters: dict
    battery: Battery = COLLECTIVES

    def extra_ranks(self, nprocs: int) -> int:
        """Return the switch processes the selected algorithms need beside ``nprocs`` data ranks."""
        return self.battery.extra_ranks(nprocs, self.filters)

    def launch_size(self, nprocs: int) -> int:
        """Return how many ranks to start for ``nprocs`` data ranks.

        Raises:
            UsageError: a selection that leaves no case for them, saying which
                choice left nothing, or a name the battery cannot read.
        """
        total = nprocs + self.extra_ranks(nprocs)
        self.cases(nprocs, total)
        return total

    def cases(self, workers: int, world_size: int) -> list:
        """Return the cases for ``workers`` data ranks in a world of ``world_size``.

        Raises:
            UsageError: as :meth:`launch_size`.
        """
        return self.battery.build_cases(workers, world_size, allow_empty=False, **self.filters)

    def on_device(self, xp) -> tuple["Selection", list[str]]:
        """Return the selection the device of ``xp`` can run, and what ``all`` lost on the way.

        Dtypes named explicitly that the device cannot compute in are an error;
        the battery's ``on_device`` takes out of ``all`` what the device cannot
        run (:data:`COLLECTIVES`: float8, and bfloat16 before CuPy 14).

        Raises:
            UsageError: a dtype (or a name of the battery's) given explicitly that
                the device cannot run.
        """
        chosen = self.filters["dtypes"]
        if chosen is not None:
            for name in chosen:
                xp_module.check_device_dtype(get_dtype(name), xp)
        filters, left_out = self.battery.on_device(xp, self.filters)
        return replace(self, filters=filters), left_out


def _group_of(case) -> tuple:
    return (case.algorithm, case.collective, case.op, case.options)


class VerifySession:
    """The battery on the ranks of an MPI world.

    Attributes:
        t: the transport over (a duplicate of) the world.
        selection: the selection, less what the device cannot run.
        device: ``cpu`` or ``gpu``; xp: the array namespace of the inputs.
        where: on a GPU, :func:`refcoll.transport.cuda_aware.device_path`'s
            answer (the GPU and how device buffers travel); None on the CPU.
        left_out: what ``all`` lost on this device.
    """

    def __init__(self, world, selection: Selection, *, device: str = "cpu",
                 name: str = "refcoll verify"):
        """Open the session on ``world`` (an mpi4py communicator); collective over it."""
        self.t = MPITransport(world, collective=name)
        self.selection, self.device = selection, device
        self.xp, self.where, self.left_out = np, None, []
        if device == "gpu":
            devices.use_node_gpu(world)
            self.xp = device_namespace(device)
            self.selection, self.left_out = selection.on_device(self.xp)
            self.where = cuda_aware.device_path()

    def cases(self, workers: int) -> list:
        """Return the cases of this world for its first ``workers`` ranks holding data."""
        return self.selection.cases(workers, self.t.size)

    def run(self, cases: Sequence, *, seed: int = 0,
            on_group: Callable[[dict], None] | None = None) -> list:
        """Run ``cases`` on every rank; return each case's verdict (on every rank).

        ``on_group`` is given the :func:`~refcoll.verify.conformance.group_rows`
        row of each group of cases (algorithm, collective, op, options) once its
        last case is judged.
        """
        done: list = []

        def progress(i: int, total: int, result) -> None:
            key = _group_of(result.case)
            done.append(result)
            if on_group is not None and (i + 1 == total or _group_of(cases[i + 1]) != key):
                on_group(group_rows([r for r in done if _group_of(r.case) == key])[0])

        return self.selection.battery.run(self.t, cases, seed=seed, progress=progress,
                                          xp=self.xp)

    def run_outstanding(self, workers: int, *, seed: int = 0) -> list:
        """Run the outstanding-call scenarios on the first ``workers`` ranks; verdicts on all ranks.

        :mod:`refcoll.verify.conformance.outstanding`: many non-blocking calls
        in flight at once, on one communicator and on split ones. Host arrays
        only (the battery's twins cover device arrays); nothing for a battery
        without non-blocking runs (:attr:`Battery.nonblocking`).
        """
        if not self.selection.battery.nonblocking:
            return []
        ctl = self.t.split(0, self.t.rank)
        data = self.t.split(0 if self.t.rank < workers else -1, self.t.rank)
        return run_outstanding(data, ctl, seed=seed)

    def report(self, results: Sequence, *, seed: int, scenarios: Sequence = ()) -> dict:
        """Return the verdicts as ``refcoll verify --json`` writes them.

        ``scenarios``: the outstanding-call scenarios' verdicts, counted in
        ``passed`` and ``failed`` too and listed under ``nonblocking``.
        """
        everything = [*results, *scenarios]
        passed = sum(r.passed for r in everything)
        return {"world_size": self.t.size, "seed": seed, "device": self.device,
                "gpu": self.where, "passed": passed, "failed": len(everything) - passed,
                "groups": group_rows(results), "cases": [r.to_json() for r in results],
                "nonblocking": [r.to_json() for r in scenarios]}
