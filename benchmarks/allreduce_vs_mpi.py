"""refcoll's all-reduce algorithms against the MPI library's own MPI_Allreduce, interleaved.

Run: mpiexec -n 2 python benchmarks/allreduce_vs_mpi.py [--algorithms ring,auto]
     [--sizes 4K,64K,1M,16M] [--iters 30] [--json FILE]

Each iteration times every algorithm and MPI_Allreduce back to back on the same
buffers (after a barrier), so all see the same machine noise. Reported: the median
over iterations of the slowest rank's time, and MPI's median divided by ours
(above 1: refcoll is faster).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from mpi4py import MPI

import refcoll


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def timed(comm, fn) -> float:
    comm.Barrier()
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    return comm.allreduce(elapsed, op=MPI.MAX)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--sizes", default="4K,64K,1M,16M")
    ap.add_argument("--algorithms", default="ring")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    names = [a for a in args.algorithms.split(",") if a]
    rows = []
    if comm.rank == 0:
        print(f"# {comm.size} ranks, {MPI.Get_library_version().splitlines()[0].strip()}, "
              f"float32 sum, median of {args.iters} interleaved iterations, time in ms "
              f"(MPI/ours: above 1 is faster than MPI_Allreduce)")
        print(f"{'bytes':>10} {'MPI':>9} " + " ".join(f"{n:>18} {'MPI/ours':>8}" for n in names))
    for nbytes in (parse_size(s) for s in args.sizes.split(",")):
        x = np.random.default_rng(comm.rank).standard_normal(max(nbytes // 4, 1)).astype(np.float32)
        out = np.empty_like(x)
        theirs = np.empty_like(x)
        times = {n: [] for n in ["MPI", *names]}
        for i in range(args.warmup + args.iters):
            sample = {"MPI": timed(comm, lambda: comm.Allreduce(x, theirs))}
            for n in names:
                sample[n] = timed(comm, lambda: refcoll.allreduce(x, comm, algorithm=n, out=out))
            if i >= args.warmup:
                for k, v in sample.items():
                    times[k].append(v)
        med = {k: float(np.median(v)) for k, v in times.items()}
        rows.append({"bytes": nbytes, "ranks": comm.size, "median_s": med})
        if comm.rank == 0:
            print(f"{nbytes:>10} {med['MPI'] * 1e3:>9.3f} " + " ".join(
                f"{med[n] * 1e3:>18.3f} {med['MPI'] / med[n]:>8.2f}" for n in names))
    if comm.rank == 0 and args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
