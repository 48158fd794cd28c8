"""A run of the conformance battery in an MPI world: what ``refcoll verify`` does.

Two steps, as the command takes them:

1. Before any process starts, a :class:`Selection` (the battery's filters)
   says how many ranks to start for ``N`` data ranks (:meth:`Selection.launch_size`:
   algorithms with switch processes need ranks beyond them) and refuses, with
   a reason, a selection that leaves no case.
2. In the world, a :class:`VerifySession` places each rank on its GPU where
   asked, drops from ``all`` what that device cannot run, builds the cases
   for the data ranks, runs them (reporting each finished group of cases) and
   returns the verdicts as the JSON ``refcoll verify --json`` writes.

The cases, their runs and their judges are :mod:`refcoll.verify.conformance`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from .. import algorithms
from ..compressors import parse
from ..core import xp as xp_module
from ..core.errors import UsageError
from ..core.ops import DTYPES, get_dtype
from ..transport import cuda_aware
from ..transport import device as devices
from ..transport.mpi import MPITransport
from .conformance import (COMPRESSOR_BATTERY, build_cases, build_compressor_cases, group_rows,
                          run_battery, run_compressor_battery)
from .conformance.outstanding import run_outstanding

__all__ = ["Selection", "VerifySession", "COMPRESSED_OPS", "COMPRESSED_DTYPES",
           "compressed_algorithms", "device_namespace", "mpi_library"]

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


def device_namespace(device: str):
    """Return the array namespace of ``device`` (``cpu``: NumPy, ``gpu``: CuPy).

    Raises:
        UsageError: ``gpu`` where CuPy or a GPU is missing, saying why.
    """
    return xp_module.require_cupy("--device gpu") if device == "gpu" else np


def mpi_library() -> str:
    """Return the first line of the MPI library's version string."""
    from mpi4py import MPI

    return MPI.Get_library_version().splitlines()[0].strip()


@dataclass(frozen=True)
class Selection:
    """What to verify: the filters of the battery, ``None`` meaning all.

    Attributes:
        compressed: run the compressed all-reduce battery
            (:func:`~refcoll.verify.conformance.build_compressor_cases`) instead
            of the collectives' (:func:`~refcoll.verify.conformance.build_cases`).
        filters: the keywords of that builder (``algorithms_``, ``ops``,
            ``dtypes``, and ``collectives``, ``sizes``, ``inplace`` or ``compressors``).
    """

    compressed: bool
    filters: dict

    def extra_ranks(self, nprocs: int) -> int:
        """Return the switch processes the selected algorithms need beside ``nprocs`` data ranks."""
        if self.compressed:
            return 0
        chosen = self.filters.get("algorithms_") or algorithms.names()
        return max([algorithms.get(name).extra_ranks(nprocs, **opts) for name in chosen
                    if algorithms.get(name).extra_ranks is not None
                    for opts in algorithms.get(name).battery_options], default=0)

    def launch_size(self, nprocs: int) -> int:
        """Return how many ranks to start for ``nprocs`` data ranks.

        Raises:
            UsageError: a selection that leaves no case for them, saying which
                choice left nothing, or a compressor spec that cannot be read.
        """
        total = nprocs + self.extra_ranks(nprocs)
        self.cases(nprocs, total)
        return total

    def cases(self, workers: int, world_size: int) -> list:
        """Return the cases for ``workers`` data ranks in a world of ``world_size``.

        Raises:
            UsageError: as :meth:`launch_size`.
        """
        if self.compressed:
            return build_compressor_cases(world_size, allow_empty=False, **self.filters)
        return build_cases(workers, world_size=world_size, allow_empty=False, **self.filters)

    def on_device(self, xp) -> tuple["Selection", list[str]]:
        """Return the selection the device of ``xp`` can run, and what ``all`` lost on the way.

        Dtypes the device cannot compute in (float8; bfloat16 before CuPy 14)
        and compressors that need one (bf16) leave ``all``; named explicitly,
        they are an error.

        Raises:
            UsageError: a dtype or compressor named explicitly that the device cannot run.
        """
        chosen = self.filters["dtypes"]
        if chosen is not None:
            for name in chosen:
                xp_module.check_device_dtype(get_dtype(name), xp)
        left_out: list[str] = []
        if not self.compressed:
            if chosen is None:
                chosen = [name for name in DTYPES if xp_module.device_supports(DTYPES[name], xp)]
                left_out = [name for name in DTYPES if name not in chosen]
            return replace(self, filters=dict(self.filters, dtypes=chosen)), left_out
        specs = self.filters["compressors"]
        runnable = []
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
        return replace(self, filters=dict(self.filters, compressors=runnable)), left_out


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

        run = run_compressor_battery if self.selection.compressed else run_battery
        return run(self.t, cases, seed=seed, progress=progress, xp=self.xp)

    def run_outstanding(self, workers: int, *, seed: int = 0) -> list:
        """Run the outstanding-call scenarios on the first ``workers`` ranks; verdicts on every rank.

        :mod:`refcoll.verify.conformance.outstanding`: many non-blocking calls
        in flight at once, on one communicator and on split ones. Host arrays
        only (the battery's twins cover device arrays); nothing for the
        compressed battery.
        """
        if self.selection.compressed:
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
