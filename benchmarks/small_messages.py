"""Small all-reduce latency: refcoll's ``auto`` against MPI_Allreduce, interleaved.

Run: mpiexec -n 2 python benchmarks/small_messages.py [--sizes 8,64,512,4K]
     [--samples 30] [--calls 200] [--json FILE]

A sample times ``--calls`` back-to-back calls of one variant (after a barrier)
and takes the slowest rank's time per call. Samples of the three variants take
turns: MPI_Allreduce, refcoll ``auto`` with ``validate=False``, refcoll ``auto``
with argument validation (the default), so all three see the same machine noise.
Reported: the median per-call latency in µs, refcoll's latency over MPI's, and
what argument validation adds to a call. float32 sum into a preallocated ``out=``.
"""

from __future__ import annotations

import argparse
import json
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
    rows = []
    if comm.rank == 0:
        print(f"# {comm.size} ranks, {MPI.Get_library_version().splitlines()[0].strip()}, "
              f"float32 sum, algorithm {args.algorithm}, median of {args.samples} interleaved "
              f"samples of {args.calls} calls, µs per call")
        print(f"{'bytes':>6} {'MPI':>8} {'validate=False':>15} {'ratio':>6} "
              f"{'validate=True':>14} {'ratio':>6} {'validation':>11}")
    for nbytes in (parse_size(s, name="--sizes") for s in args.sizes.split(",")):
        x = np.random.default_rng(comm.rank).standard_normal(max(nbytes // 4, 1)).astype(np.float32)
        out, theirs = np.empty_like(x), np.empty_like(x)
        variants = {
            "mpi": lambda: comm.Allreduce(x, theirs),
            "unchecked": lambda: refcoll.allreduce(x, comm, algorithm=args.algorithm, out=out,
                                                   validate=False),
            "validated": lambda: refcoll.allreduce(x, comm, algorithm=args.algorithm, out=out),
        }
        for fn in variants.values():  # warm up: connections, plans, the auto calibration
            sample(comm, fn, args.calls)
        times = {name: [] for name in variants}
        for _ in range(args.samples):
            for name, fn in variants.items():
                times[name].append(sample(comm, fn, args.calls))
        med = {name: float(np.median(v)) * 1e6 for name, v in times.items()}
        rows.append({"bytes": nbytes, "ranks": comm.size, "median_us": med})
        if comm.rank == 0:
            print(f"{nbytes:>6} {med['mpi']:>8.2f} {med['unchecked']:>15.2f} "
                  f"{med['unchecked'] / med['mpi']:>6.2f} {med['validated']:>14.2f} "
                  f"{med['validated'] / med['mpi']:>6.2f} "
                  f"{med['validated'] - med['unchecked']:>+9.2f}µs")
    if comm.rank == 0 and args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
