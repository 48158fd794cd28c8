"""Small all-reduce latency: refcoll's plain call and its plan against MPI's, interleaved.

Run: mpiexec -n 2 python benchmarks/small_messages.py [--sizes 8,64,512,4K]
     [--samples 30] [--calls 200] [--algorithm auto] [--json FILE]

A sample times ``--calls`` back-to-back calls of one variant (after a barrier)
and takes the slowest rank's time per call. Samples of the variants take turns,
so all of them see the same machine noise:

* ``MPI_Allreduce``: ``comm.Allreduce(x, y)``;
* ``MPI_Allreduce_init``: MPI-4's persistent all-reduce, ``Start`` then ``Wait``
  (where the library has it: MPICH 4 and later, Open MPI 5);
* refcoll's plan: ``plan = refcoll.allreduce_init(x, comm, out=y)``, then ``plan()``;
* the same plan driven as MPI drives one: ``plan.start()`` then ``plan.wait()``;
* the plain call, as people write it: ``refcoll.allreduce(x, comm, algorithm=A)``
  (a new result each call, arguments agreed each call);
* the same with ``validate=False``.

Reported: the median per-call latency in µs and each over ``MPI_Allreduce``, with
the load average before and after the run (a figure measured beside other work,
or with more ranks than cores, is suspect). float32 sum.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
from mpi4py import MPI

import refcoll
from refcoll.core.units import SIZE_RULE, parse_size


def sample(comm, fn, calls: int) -> float:
    """Return the slowest rank's seconds per call over ``calls`` calls of ``fn``."""
    comm.Barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = (time.perf_counter() - start) / calls
    return comm.allreduce(elapsed, op=MPI.MAX)


def variants(comm, x: np.ndarray, algorithm: str) -> tuple[dict, list]:
    """Return the variants to time, by name, and the plans to free afterwards."""
    theirs, ours, persistent_out = np.empty_like(x), np.empty_like(x), np.empty_like(x)
    found = {"MPI_Allreduce": lambda: comm.Allreduce(x, theirs)}
    persistent = getattr(comm, "Allreduce_init", None)
    if persistent is not None:
        try:
            request = persistent(x, persistent_out)  # MPI holds both buffers: keep them alive
        except NotImplementedError:  # the library lacks MPI-4's persistent collectives
            request = None
        if request is not None:
            def start_wait(buffers=(x, persistent_out)):
                request.Start()
                request.Wait()
            found["MPI_Allreduce_init"] = start_wait
    plan = refcoll.allreduce_init(x, comm, algorithm=algorithm, out=ours)
    found["refcoll plan"] = plan

    def start_wait_plan():
        plan.start()
        plan.wait()
    found["plan start/wait"] = start_wait_plan
    found["allreduce"] = lambda: refcoll.allreduce(x, comm, algorithm=algorithm)
    found["validate=False"] = lambda: refcoll.allreduce(x, comm, algorithm=algorithm,
                                                        validate=False)
    return found, [plan] + ([request] if persistent is not None and request is not None else [])


def main() -> None:
    """Time every size and print one row per size (rank 0)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="8,64,512,4K",
                    help=f"message sizes, comma-separated, in {SIZE_RULE}")
    ap.add_argument("--samples", type=int, default=30, help="samples per variant")
    ap.add_argument("--calls", type=int, default=200, help="calls timed together in a sample")
    ap.add_argument("--algorithm", default="auto", help="refcoll algorithm")
    ap.add_argument("--json", default=None, help="write the medians here")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    load_before = os.getloadavg()
    rows = []
    for nbytes in (parse_size(s, name="--sizes") for s in args.sizes.split(",")):
        x = np.random.default_rng(comm.rank).standard_normal(max(nbytes // 4, 1)).astype(np.float32)
        timed, plans = variants(comm, x, args.algorithm)
        for fn in timed.values():  # warm up: connections, plans, the auto calibration
            sample(comm, fn, args.calls)
        times: dict[str, list[float]] = {name: [] for name in timed}
        for _ in range(args.samples):
            for name, fn in timed.items():
                times[name].append(sample(comm, fn, args.calls))
        for plan in plans:
            plan.Free() if hasattr(plan, "Free") else plan.free()
        med = {name: float(np.median(v)) * 1e6 for name, v in times.items()}
        rows.append({"bytes": nbytes, "ranks": comm.size, "median_us": med,
                     "algorithm": plans[0].algorithm})
    load_after = os.getloadavg()
    if comm.rank != 0:
        return
    names = list(rows[0]["median_us"])
    print(f"# {comm.size} ranks on {os.cpu_count()} cores, "
          f"{MPI.Get_library_version().splitlines()[0].strip()}, float32 sum, algorithm "
          f"{args.algorithm}, median of {args.samples} interleaved samples of {args.calls} calls")
    print(f"# load average {load_before[0]:.2f} before, {load_after[0]:.2f} after; "
          "µs per call (× MPI_Allreduce)")
    print(f"{'bytes':>6} {'auto ran':>18} " + " ".join(f"{n:>22}" for n in names))
    for row in rows:
        med = row["median_us"]
        cells = " ".join(f"{med[n]:>13.2f} ({med[n] / med['MPI_Allreduce']:>4.2f}×)" for n in names)
        print(f"{row['bytes']:>6} {row['algorithm']:>18} {cells}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": rows, "load": [load_before[0], load_after[0]]}, fh, indent=2)


if __name__ == "__main__":
    main()
