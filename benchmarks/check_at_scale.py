"""``refcoll check`` on files larger than its memory: peak memory and time against a read.

    python benchmarks/check_at_scale.py -p 64 --count 16777216 --dir /var/tmp/at_scale

writes a world of ``p`` float32 inputs of ``count`` elements (refcoll's formula
inputs, ``adversarial`` by default) and their all-reduce (the naive fold: a
conforming result), block by block, so the benchmark itself never holds a rank's
array. Then, interleaved ``--samples`` times:

* ``read``: every input and output file read once into one reused NumPy buffer
  (``readinto``): the floor of any judge that reads the files;
* ``np.load``: every file read once by NumPy's own reader, a new array each (its
  pages faulted in as it is filled), as a script that loads the ranks' files would;
* ``check``: ``refcoll check IN OUT`` in a child process, its peak resident
  memory (Linux's ``VmHWM`` of the process), its exit status (0: conforming).

It prints the medians and the ratios of the check to both reads (with ``--wrong I``, the last rank's
output element ``I`` is made wrong, and the check's report is printed once: it must
exit 1). Both read from the page cache
when the files fit in memory (they are read once before timing); say so when
quoting. The files stay in ``--dir`` (``--keep``) or are removed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from refcoll.verify.formula import FormulaInput
from refcoll.verify.oracle import fold

BLOCK = 1 << 20


def write_world(folder: Path, p: int, count: int, kind: str, dtype: str,
                wrong: int | None = None) -> None:
    """Write inputs and their fold as rank files, ``BLOCK`` elements at a time; with
    ``wrong``, the last rank's output element ``wrong`` is one more."""
    ins, outs = folder / "in", folder / "out"
    ins.mkdir(parents=True, exist_ok=True)
    outs.mkdir(parents=True, exist_ok=True)
    sources = [FormulaInput(kind, dtype, p, r, count, seed=1) for r in range(p)]
    shape = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
             "shape": (count,)}
    files = []
    for sub in (ins, outs):
        for r in range(p):
            fh = open(sub / f"rank{r}.npy", "wb")
            np.lib.format.write_array_header_2_0(fh, shape)
            files.append(fh)
    for lo in range(0, count, BLOCK):
        hi = min(count, lo + BLOCK)
        blocks = [s.read(lo, hi) for s in sources]
        total = fold("sum", blocks)
        for r in range(p):
            blocks[r].tofile(files[r])
            out = total
            if r == p - 1 and wrong is not None and lo <= wrong < hi:
                out = total.copy()
                out[wrong - lo] += 1
            out.tofile(files[p + r])
    for fh in files:
        fh.close()


def load_once(folder: Path) -> float:
    """Return the seconds to ``np.load`` every rank file of ``folder/in`` and ``folder/out``."""
    start = time.perf_counter()
    for sub in ("in", "out"):
        for f in sorted((folder / sub).iterdir()):
            np.load(f)
    return time.perf_counter() - start


def read_once(folder: Path, buffer: np.ndarray) -> float:
    """Return the seconds to read every rank file of ``folder/in`` and ``folder/out``."""
    start = time.perf_counter()
    for sub in ("in", "out"):
        for f in sorted((folder / sub).iterdir()):
            with open(f, "rb") as fh:
                np.lib.format.read_magic(fh)
                np.lib.format.read_array_header_2_0(fh)
                while fh.readinto(buffer):
                    pass
    return time.perf_counter() - start


#: Runs ``refcoll check`` and writes the process's own peak resident memory (VmHWM, which
#: a new program starts afresh, unlike ``ru_maxrss``, which keeps the forking parent's).
_CHILD = """
import atexit, runpy, sys
def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            sys.stderr.write(f"peak-kib {line.split()[1]}\\n")
atexit.register(peak)
sys.argv = ["refcoll", "check"] + sys.argv[1:]
runpy.run_module("refcoll", run_name="__main__")
"""


def check_once(folder: Path) -> tuple[float, int, int, str]:
    """Return ``(seconds, peak resident bytes, exit status, report)`` of ``refcoll check``."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(folder / "in"),
                           str(folder / "out")], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    peak = [int(line.split()[1]) * 1024 for line in proc.stderr.splitlines()
            if line.startswith("peak-kib ")]
    return seconds, peak[-1] if peak else 0, proc.returncode, proc.stdout + proc.stderr


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-p", type=int, default=64)
    parser.add_argument("--count", type=int, default=1 << 24)
    parser.add_argument("--kind", default="adversarial", choices=["exact", "adversarial"])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--keep", action="store_true", help="keep the files")
    parser.add_argument("--wrong", type=int, default=None, metavar="I",
                        help="make the last rank's output element I wrong: check must then "
                             "exit 1 (its report is printed)")
    args = parser.parse_args()
    made = not (args.dir / "in" / "rank0.npy").exists()
    if made:
        start = time.perf_counter()
        write_world(args.dir, args.p, args.count, args.kind, args.dtype, args.wrong)
        print(f"wrote {args.p} inputs and outputs of {args.count} x {args.dtype} in "
              f"{time.perf_counter() - start:.1f} s")
    data = 2 * args.p * args.count * np.dtype(args.dtype).itemsize
    buffer = np.empty(1 << 24, dtype=np.uint8)
    read_once(args.dir, buffer)  # the page cache, as both runs then see it
    reads, loads, checks, peaks = [], [], [], []
    expected = 0 if args.wrong is None else 1
    for sample in range(args.samples):
        reads.append(read_once(args.dir, buffer))
        loads.append(load_once(args.dir))
        seconds, peak, status, report = check_once(args.dir)
        if status != expected or (sample == 0 and expected):
            print(report)
        if status != expected:
            print(f"refcoll check exited {status}, not {expected}")
            return 1
        checks.append(seconds)
        peaks.append(peak)
    read, load = statistics.median(reads), statistics.median(loads)
    check = statistics.median(checks)
    print(f"p = {args.p}, {args.count} x {args.dtype} a rank: {data / 2**30:.2f} GiB of inputs "
          f"and outputs; load average {os.getloadavg()[0]:.1f}")
    print(f"read once into a buffer: {read:.2f} s ({data / read / 2**30:.2f} GiB/s)")
    print(f"np.load of every file:   {load:.2f} s ({data / load / 2**30:.2f} GiB/s)")
    print(f"refcoll check:           {check:.2f} s ({check / read:.2f}x the read into a buffer, "
          f"{check / load:.2f}x np.load), peak {max(peaks) / 2**20:.0f} MiB resident")
    if not args.keep and made:
        shutil.rmtree(args.dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
