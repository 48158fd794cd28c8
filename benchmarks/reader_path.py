"""The reader's path: which of refcoll's files one blocking all-reduce runs, in order.

Run: mpiexec -n 2 python benchmarks/reader_path.py [--algorithm ring] [--count 1000]
     [--calls 50] [--validate/--no-validate]

A reader who follows ``refcoll.allreduce(x, comm, algorithm="ring")`` opens every file
whose functions the call runs. This traces calls 1, 2, 3 and the last of ``--calls``
(``sys.setprofile``, rank 0) on the same buffers, and prints for each: the refcoll files
it ran functions in, in the order first entered, how many come before the algorithm's
module, and whether its set of functions is the same as call 2's (a call that runs other
functions than the one before it keeps state behind the reader's back).

A wait that polls long enough also asks whether a peer revoked the communicator
(:data:`POLLING`): how long a wait polls depends on the peers' timing, not on what
the call kept, so those checks are left out of the files and the comparison.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

import refcoll

PACKAGE = str(Path(refcoll.__file__).resolve().parent)

#: What a transport's wait runs only when it polls long (every NOTICE_POLLS polls).
POLLING = {("transport/revocation.py", "_stopped"), ("transport/revocation.py", "_noticed")}


def traced(fn):
    """Return ``(files in first-entered order, set of (file, function))`` of one ``fn()``."""
    files, functions = [], set()

    def profile(frame, event, arg):
        if event == "call":
            path = frame.f_code.co_filename
            if path.startswith(PACKAGE):
                name = path[len(PACKAGE) + 1:]
                if (name, frame.f_code.co_name) in POLLING:
                    return
                if name not in files:
                    files.append(name)
                functions.add((name, frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return files, functions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", default="ring")
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--no-validate", dest="validate", action="store_false")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    x = np.arange(args.count, dtype=np.float32) + comm.rank
    out = np.empty_like(x)
    module = f"algorithms/{args.algorithm}.py"
    seen = {}
    for call in range(1, args.calls + 1):
        def one():
            refcoll.allreduce(x, comm, algorithm=args.algorithm, out=out,
                              validate=args.validate)
        if call in (1, 2, 3, args.calls):
            seen[call] = traced(one)
        else:
            one()
    if comm.rank:
        return
    print(f"# {comm.size} ranks, allreduce of float32[{args.count}], algorithm "
          f"{args.algorithm}, validate={args.validate}")
    for call, (files, functions) in seen.items():
        before = files.index(module) if module in files else None
        same = "" if call == 1 else (
            f"; {'the same' if functions == seen[2][1] else 'OTHER'} functions as call 2")
        print(f"call {call}: {len(files)} files, {before} before {module}{same}")
        print("  " + " -> ".join(files))


if __name__ == "__main__":
    main()
