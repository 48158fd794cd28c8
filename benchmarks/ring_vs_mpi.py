"""Ring all-reduce against the MPI library's own MPI_Allreduce, interleaved.

Run: mpiexec -n 2 python benchmarks/ring_vs_mpi.py [--iters 30] [--sizes 1M,16M]

Each iteration times refcoll's ring and MPI_Allreduce back to back on the same
buffers (after a barrier), so both see the same machine noise; the table gives the
median over iterations of the slowest rank's time, and the ratio of medians.
"""

from __future__ import annotations

import argparse
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
    ap.add_argument("--sizes", default="1M,16M")
    ap.add_argument("--algorithm", default="ring")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    if comm.rank == 0:
        print(f"# {comm.size} ranks, {MPI.Get_library_version().splitlines()[0].strip()}, "
              f"float32 sum, median of {args.iters} interleaved iterations")
        print(f"{'bytes':>10} {args.algorithm + ' (ms)':>12} {'MPI (ms)':>10} {'MPI/ours':>9}")
    for nbytes in (parse_size(s) for s in args.sizes.split(",")):
        x = np.random.default_rng(comm.rank).standard_normal(nbytes // 4).astype(np.float32)
        out = np.empty_like(x)
        theirs = np.empty_like(x)
        ours_t, mpi_t = [], []
        for i in range(args.warmup + args.iters):
            a = timed(comm, lambda: refcoll.allreduce(x, comm, algorithm=args.algorithm, out=out))
            b = timed(comm, lambda: comm.Allreduce(x, theirs))
            if i >= args.warmup:
                ours_t.append(a)
                mpi_t.append(b)
        ours, mpi = float(np.median(ours_t)), float(np.median(mpi_t))
        if comm.rank == 0:
            print(f"{nbytes:>10} {ours * 1e3:>12.3f} {mpi * 1e3:>10.3f} {mpi / ours:>9.2f}")


if __name__ == "__main__":
    main()
