"""How long ``refcoll.simulate`` takes as the simulated world grows, per algorithm and count.

Run: python benchmarks/simulate_scaling.py [--algorithms ring,tree,rabenseifner]
     [--counts 1,1M] [--modes data,ledger] [--max-p 4096] [--cap 120] [--memory 4G]
     [--json FILE]

Each run is one all-reduce of float32 exact inputs (``refcoll simulate``'s) on a
world of the mode's kind: ``data``, :class:`refcoll.transport.SimWorld` (what
``refcoll.simulate`` runs: bytes move, outputs computed), or ``ledger``,
:class:`refcoll.transport.ledger_only.LedgerWorld` (the same ledger, no data). It
runs in a process of its own so that a run past ``--cap`` seconds can be stopped
and its memory returned; the time is the simulation alone (inputs are made before
the clock starts). Process counts go 1, 2, 4, ... up to ``--max-p``; once a run is
over the cap, the larger counts of that algorithm and size are not tried (each
takes longer) and read "> cap". A run whose buffers would need more than
``--memory`` (refcoll.verify.simulation.simulation_bytes) is skipped. Every run
also checks that the ledger equals the algorithm's cost formula.

Prints a markdown table (seconds, one column per algorithm and count) and, with
``--json``, every run's record.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from refcoll.core.units import parse_size
from refcoll.verify.simulation import simulation_bytes

#: What each child process runs: one simulation, timed, and its check against the cost.
CHILD = r"""
import json, sys, time
import refcoll
from refcoll import algorithms
from refcoll.core.ops import get_dtype
from refcoll.transport import SimWorld
from refcoll.transport.ledger_only import LedgerWorld
from refcoll.verify.inputs import make_inputs
mode, algorithm, p, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
dt = get_dtype("float32")
inputs = make_inputs("exact", dt, count, p, op="sum")
world = (SimWorld if mode == "data" else LedgerWorld)(p)
start = time.perf_counter()
world.run(lambda t, x: refcoll.allreduce(x, t, algorithm=algorithm, validate=False),
          [(x,) for x in inputs])
seconds = time.perf_counter() - start
cost = algorithms.get(algorithm).costs["allreduce"](p, count, dt.itemsize)
print(json.dumps({"seconds": seconds, "messages": world.ledger.total_messages,
                  "rounds": world.ledger.rounds,
                  "ledger_is_cost": world.ledger.counts() == cost.counts()}))
"""


def run_one(mode: str, algorithm: str, p: int, count: int, cap: float) -> dict:
    """Run one simulation in a child process; return its record (``status`` ok, over, failed)."""
    record = {"mode": mode, "algorithm": algorithm, "p": p, "count": count}
    try:
        done = subprocess.run([sys.executable, "-c", CHILD, mode, algorithm, str(p), str(count)],
                              capture_output=True, text=True, timeout=cap)
    except subprocess.TimeoutExpired:
        return {**record, "status": "over", "seconds": None}
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {**record, "status": "failed", "seconds": None, "error": tail}
    out = json.loads(done.stdout.strip().splitlines()[-1])
    status = "ok" if out["seconds"] <= cap else "over"
    return {**record, **out, "status": status}


def cell(record: dict | None, cap: float) -> str:
    """Return a table cell: seconds, ``> cap s``, ``skipped`` or ``failed``."""
    if record is None:
        return ""
    if record["status"] == "ok":
        flag = "" if record["ledger_is_cost"] else " (ledger != cost)"
        return f"{record['seconds']:.2f}{flag}"
    if record["status"] == "over":
        return f"> {cap:g} s"
    return record["status"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algorithms", default="ring,tree,rabenseifner")
    ap.add_argument("--counts", default="1,1M", help="elements per rank, e.g. 1,1M")
    ap.add_argument("--modes", default="data,ledger", help="data (SimWorld), ledger (LedgerWorld)")
    ap.add_argument("--max-p", type=int, default=4096)
    ap.add_argument("--cap", type=float, default=120.0, help="seconds; longer runs read '> cap'")
    ap.add_argument("--memory", default="4G", help="skip runs whose buffers need more")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    algos = [a for a in args.algorithms.split(",") if a]
    modes = [m for m in args.modes.split(",") if m]
    counts = [parse_size(c) for c in args.counts.split(",") if c]
    limit = parse_size(args.memory)
    ps = [1 << k for k in range(args.max_p.bit_length()) if 1 << k <= args.max_p]
    records: list[dict] = []
    columns = [(m, a, c) for c in counts for m in modes for a in algos]
    for mode, algorithm, count in columns:
        over = False
        for p in ps:
            record = {"mode": mode, "algorithm": algorithm, "p": p, "count": count}
            if over:
                record.update(status="over", seconds=None, note="not run: a smaller p was over")
            elif simulation_bytes("allreduce", p, count, 4) > limit:
                record.update(status="skipped", seconds=None, note="memory")
            else:
                record = run_one(mode, algorithm, p, count, args.cap)
                over = record["status"] == "over"
            records.append(record)
            print(f"# {mode} {algorithm} count={count} p={p}: {cell(record, args.cap)}",
                  file=sys.stderr, flush=True)
    by_key = {(r["mode"], r["algorithm"], r["count"], r["p"]): r for r in records}
    print("| p | " + " | ".join(f"{a} {c:,} ({m})" for m, a, c in columns) + " |")
    print("|---:|" + "---:|" * len(columns))
    for p in ps:
        print(f"| {p} | " + " | ".join(cell(by_key.get((m, a, c, p)), args.cap)
                                       for m, a, c in columns) + " |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"cap_s": args.cap, "runs": records}, fh, indent=2)


if __name__ == "__main__":
    main()
