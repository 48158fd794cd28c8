"""refcoll's all-reduce algorithms against the MPI library's own MPI_Allreduce, interleaved.

Run: mpiexec -n 2 python benchmarks/allreduce_vs_mpi.py [--algorithms ring,auto]
     [--sizes 4K,64K,1M,16M] [--iters 30] [--warmup 3] [--bound] [--json FILE]

A fixed list of sizes through the harness of ``refcoll bench`` (refcoll.bench):
every iteration times each algorithm and MPI_Allreduce on the same buffers, each
after a barrier, in a rotating order, so all see the same machine noise. The time
is the slowest rank's median; ``time/base`` below 1 means refcoll is faster.
"""

from __future__ import annotations

import argparse
import json

from mpi4py import MPI

from refcoll.bench import BenchConfig, bench_header, format_table, parse_size, run_bench, summarize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--sizes", default="4K,64K,1M,16M")
    ap.add_argument("--algorithms", default="ring")
    ap.add_argument("--bound", action="store_true", help="also time each algorithm's bare messages")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    config = BenchConfig(sizes=[parse_size(s) for s in args.sizes.split(",") if s.strip()],
                         algorithms=[a for a in args.algorithms.split(",") if a],
                         warmup=args.warmup, iters=args.iters, bound=args.bound)
    header = bench_header(comm, config)
    rows = run_bench(comm, config)
    if comm.rank == 0:
        print(format_table(header, rows))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"header": header, "rows": rows, "summary": summarize(rows)}, fh,
                          indent=2, default=str)


if __name__ == "__main__":
    main()
