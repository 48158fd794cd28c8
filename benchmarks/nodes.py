"""Every topology claim across a real (emulated) network: refcoll's all-reduces and MPI's.

For each cluster shape it builds an emulated cluster (``refcoll.cluster.Cluster``:
a network namespace per node, ``tc``-shaped links; needs root), runs ``refcoll
bench`` across the nodes with ring, hierarchical (plain and pipelined in 8
segments), Rabenseifner, auto and MPI_Allreduce timed side by side (bench interleaves
them per size; each timed iteration runs an algorithm's calls back to back, ``-m``, so
that a call meets the link as the calls before it left it, not a token bucket that
filled while the link idled), and prints,
per size, each one's bus bandwidth (out of place), what auto chose, auto over
the best refcoll algorithm and over MPI, the best over the link bound, and
the bytes each node's link carried in the run. Before the benches it measures
each link as ``refcoll cluster check`` does, and prints how much of the link a
TCP socket reached both ways at once: an all-reduce sends and receives at once,
so that, not the line rate, is the most it can reach. With ``--calibrate`` it also
runs ``refcoll model --calibrate --back-to-back`` across the 2 x 2 cluster and
prints the two-level model's predictions beside the measured times (calls back
to back, as the benches time them).

The link bound: an all-reduce of n bytes over g nodes must move at least
2(g-1)/g·n through each node's link each way, so with p ranks
busbw <= link · 2(p-1)/p · g / (2(g-1)): 1.5 x link at 2 x 2.

    python benchmarks/nodes.py                      # the shapes and rates of the README
    python benchmarks/nodes.py --shape 2x2 --link 1gbit --calibrate --json nodes.json
    python benchmarks/nodes.py --shape 4x1 --racks 2 --oversubscription 2   # 2 racks
    python benchmarks/nodes.py --shape 2x2 --tuned   # then auto tuned from it (refcoll tune)

Every shape runs more ranks than this machine's cores when it has 2: the
figures share the cores (bench's header says so) and are suspect as such.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from refcoll.cluster import Cluster, bucket_bytes, missing_capability, parse_rate
from refcoll.cluster.check import measure_links
from refcoll.core.units import parse_size

ALGORITHMS = ("ring", "hierarchical", "hierarchical(pipeline=8)", "rabenseifner", "auto")

#: Across racks: the two levels as nodes, or as racks (``level=rack``, the topology's).
RACK_ALGORITHMS = ("ring", "hierarchical", "hierarchical(level=rack)",
                   "hierarchical(level=rack,pipeline=8)", "auto")

#: Each algorithm's column heading.
HEADINGS = {"hierarchical(pipeline=8)": "hier. 8 segments",
            "hierarchical(level=rack)": "hier. racks",
            "hierarchical(level=rack,pipeline=8)": "hier. racks 8 segments"}

#: The sizes, each run by a bench of its own up to the run's largest.
SIZES = ("64K", "256K", "1M", "4M", "16M", "64M")

#: A timed iteration runs each algorithm's call back to back (bench's -m) until the calls
#: have carried this many of the link's token buckets: a call then meets the link as the
#: call before it left it, and few of the calls ride a bucket that filled while it idled.
BUCKETS = 8

#: (shape, link, largest size): the README's table. 100 Mbit/s stops at 16 MiB, whose calls
#: take seconds each already.
DEFAULT_RUNS = (("2x2", "1gbit", "64M"), ("2x2", "100mbit", "16M"), ("2x3", "1gbit", "64M"),
                ("3x2", "1gbit", "64M"))


def link_bound(nodes: int, per_node: int, link_bits: float) -> float:
    """Return the busbw bound, GB/s, of an all-reduce whose node links carry ``link_bits``/s."""
    p = nodes * per_node
    if nodes < 2:
        return math.inf
    return link_bits / 8 / 1e9 * 2 * (p - 1) / p * nodes / (2 * (nodes - 1))


def run_bench(nodes: int, per_node: int, link: str, largest: str, warmup: int, iters: int,
              folder: Path, small_iters: int = 8, racks: int = 1,
              oversubscription: float = 1.0, tuned: bool = False) -> dict:
    """Run refcoll bench across an emulated cluster; return its JSON and the bytes per link.

    One bench per size on the same cluster (:func:`_sweeps`), each algorithm's calls
    back to back in each timed iteration: ``small_iters`` iterations up to 1 MiB,
    ``iters`` from 4 MiB up.
    ``tuned``: then ``refcoll tune`` makes a tuning file of those benches, and they
    run again with ``REFCOLL_TUNING_FILE`` set (``run["tuned"]``), auto beside
    the algorithms it was tuned from.
    """
    names = ALGORITHMS if racks == 1 else RACK_ALGORITHMS
    with Cluster(nodes=nodes, ranks_per_node=per_node, link=link, racks=racks,
                 oversubscription=oversubscription) as cluster:
        links = measure_links(cluster)  # what TCP reaches on each link, both ways at once
        run = _sweeps(cluster, names, largest, warmup, iters, small_iters, folder, "")
        if tuned:
            tuning = folder / f"tuning-{nodes}x{per_node}-{link}.json"
            made = subprocess.run(["refcoll", "tune", *run.pop("files"), "-o", str(tuning)],
                                  capture_output=True, text=True)
            if made.returncode != 0:
                sys.exit(f"refcoll tune failed:\n{made.stdout}{made.stderr}")
            os.environ["REFCOLL_TUNING_FILE"] = str(tuning)
            try:
                run["tuned"] = _sweeps(cluster, names, largest, warmup, iters, small_iters,
                                       folder, "tuned-")
            finally:
                del os.environ["REFCOLL_TUNING_FILE"]
            run["tuning"] = json.loads(tuning.read_text())
    return {"nodes": nodes, "per_node": per_node, "link": link, "racks": racks,
            "oversubscription": oversubscription, "algorithms": names, "links": links, **run}


def calls_back_to_back(nbytes: int, link_bits: float) -> int:
    """Return bench's ``-m`` at ``nbytes``: calls enough to carry ``BUCKETS`` buckets, and 3."""
    return max(3, math.ceil(BUCKETS * bucket_bytes(link_bits) / nbytes))


def _sweeps(cluster, names, largest: str, warmup: int, iters: int, small_iters: int,
            folder: Path, tag: str) -> dict:
    """Run bench on ``cluster`` size by size; return the merged report, traffic and files.

    Each size is one ``refcoll bench`` with its own ``-m`` (:func:`calls_back_to_back`):
    ``small_iters`` timed iterations up to 1 MiB, ``iters`` from 4 MiB up.
    """
    data, traffic, files = None, {}, []
    nodes, per_node, link = cluster.spec.nodes, cluster.spec.ranks_per_node, cluster.spec.link
    start = time.perf_counter()
    sizes = [s for s in SIZES if parse_size(s) <= parse_size(largest)]
    for size in sizes:
        small = parse_size(size) <= parse_size("1M")
        agg = calls_back_to_back(parse_size(size), parse_rate(link))
        out = folder / f"{tag}bench-{nodes}x{per_node}-{link}-{size}.json"
        files.append(str(out))
        res = cluster.run(["refcoll", "bench", "-b", size, "-e", size,
                           "--algorithm", ",".join(names), "--against", "mpi",
                           "-w", str(5 if small else warmup),
                           "-i", str(small_iters if small else iters), "-m", str(agg),
                           "--json", str(out)],
                          capture_output=True, text=True, timeout=3600)
        if res.returncode != 0:
            sys.exit(f"bench failed on {nodes}x{per_node} {link}:\n{res.stdout[-3000:]}"
                     f"\n{res.stderr[-3000:]}")
        for node, (tx, rx) in cluster.last_traffic.items():
            sent, got = traffic.get(str(node), (0, 0))
            traffic[str(node)] = (sent + tx, got + rx)
        swept = json.loads(out.read_text())  # its header says the -m it ran with
        if data is None:
            data, header = swept, [line for line in res.stdout.splitlines()
                                   if line.startswith("# ")][:12]
        else:
            data["rows"] += swept["rows"]
    return {"wall_s": time.perf_counter() - start, "traffic": traffic, "bench": data,
            "header": header, "files": files}


def table(run: dict) -> list[str]:
    """Return the run's table as Markdown rows."""
    nodes, per_node = run["nodes"], run["per_node"]
    bound = link_bound(nodes, per_node, parse_rate(run["link"]))
    rows: dict[int, dict] = {}
    for row in run["bench"]["rows"]:
        entry = rows.setdefault(row["size"], {})
        entry[row["algorithm"]] = row["busbw"]
        if row["algorithm"] == "auto":
            entry["chose"] = row.get("resolved") or "?"
        entry["mpi"] = max(entry.get("mpi", 0.0), row.get("base_busbw") or 0.0)
    columns = [a for a in run.get("algorithms", ALGORITHMS) if a != "auto"]
    racks = (f", {run['racks']} racks, uplinks oversubscribed {run['oversubscription']:g}x "
             "(bound: the node links')" if run.get("racks", 1) > 1 else "")
    both = both_ways(run.get("links", []))
    lines = [f"{nodes} nodes x {per_node} ranks, {run['link']} links{racks}: link bound busbw "
             f"{bound:.4f} GB/s; bytes sent per node link: " + ", ".join(
                 f"node {k} {tx / 1e9:.2f} GB" for k, (tx, _) in run["traffic"].items())
             + (f"; a TCP socket both ways at once: {both:.0%} of the link (the slowest "
                "node's median)" if both else ""),
             "", "| size | " + " | ".join(HEADINGS.get(a, a) for a in columns)
             + " | auto (chose) | MPI_Allreduce | auto/best | auto/MPI | best/bound |",
             "|---" * (len(columns) + 6) + "|"]
    for size in sorted(rows):
        e = rows[size]
        best = max(e.get(a, 0.0) for a in columns)
        auto = e.get("auto", 0.0)
        lines.append(
            f"| {size >> 10} KiB | " + " | ".join(f"{e.get(a, 0):.4f}" for a in columns)
            + f" | {auto:.4f} ({e.get('chose')}) | {e['mpi']:.4f} | {auto / best:.2f} | "
            f"{auto / e['mpi']:.2f} | {best / bound:.2f} |")
    return lines


def both_ways(links: list[dict]) -> float | None:
    """Return the fraction of its asked rate that the slowest link reached both ways at once
    (``refcoll cluster check``'s streams, the median of each link's), or None unmeasured."""
    fractions = [statistics.median(row["both_ways_bits_per_s"]) / row["asked_bits_per_s"]
                 for row in links if row.get("both_ways_bits_per_s")]
    return min(fractions, default=None)


def calibrate(folder: Path, largest: str) -> dict:
    """Run refcoll model --calibrate across 2 x 2 nodes at 1 Gbit/s; return its JSON."""
    out = folder / "calibrate.json"
    with Cluster(nodes=2, ranks_per_node=2, link="1gbit") as cluster:
        res = cluster.run(["refcoll", "model", "--calibrate", "--sizes", f"64K..{largest}",
                           "--algorithm", "ring,hierarchical,rabenseifner", "--back-to-back",
                           "--json", str(out)],
                          capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        sys.exit(f"model --calibrate failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    print(res.stdout)
    data = json.loads(out.read_text())
    speedups = {}
    rows = {(r["algorithm"], r["bytes"]): r for r in data["rows"]}
    for (name, nbytes), r in rows.items():
        if name == "hierarchical" and ("ring", nbytes) in rows:
            ring = rows["ring", nbytes]
            measured = ring["measured"] / r["measured"]
            predicted = ring["predicted"] / r["predicted"]
            speedups[nbytes] = (measured, predicted, predicted / measured)
    print("hierarchical over ring, measured vs predicted speed-up:")
    for nbytes, (meas, pred, ratio) in sorted(speedups.items()):
        print(f"  {nbytes >> 10:>7} KiB  measured {meas:.2f}x  predicted {pred:.2f}x  "
              f"(pred/meas {ratio:.2f})")
    data["speedups"] = speedups
    return data


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", help="NODESxRANKS (default: the README's runs)")
    ap.add_argument("--racks", type=int, default=1, help="racks of --shape's nodes")
    ap.add_argument("--oversubscription", type=float, default=2.0,
                    help="of each rack's uplink, with --racks")
    ap.add_argument("--link", default="1gbit")
    ap.add_argument("--largest", default="64M")
    ap.add_argument("-w", "--warmup", type=int, default=1)
    ap.add_argument("-i", "--iters", type=int, default=5,
                    help="timed iterations from 4 MiB up (each of -m calls)")
    ap.add_argument("--small-iters", type=int, default=8,
                    help="timed iterations up to 1 MiB (each of -m calls)")
    ap.add_argument("--calibrate", action="store_true", help="also model --calibrate on 2 x 2")
    ap.add_argument("--no-bench", action="store_true", help="only the calibration")
    ap.add_argument("--tuned", action="store_true",
                    help="then tune auto from the run (refcoll tune) and run again with it")
    ap.add_argument("--json", help="write every run's figures here")
    args = ap.parse_args()
    why = missing_capability()
    if why:
        print(f"benchmarks/nodes.py: {why}", file=sys.stderr)
        return 2
    runs = DEFAULT_RUNS if args.shape is None else ((args.shape, args.link, args.largest),)
    results = []
    print(f"# {os.cpu_count()} cores on this machine; every shape below runs more ranks "
          "than that when it has 2: the figures share the cores")
    with tempfile.TemporaryDirectory(prefix="refcoll-nodes-") as tmp:
        folder = Path(tmp)
        for shape, link, largest in ([] if args.no_bench else runs):
            nodes, per_node = map(int, shape.split("x"))
            run = run_bench(nodes, per_node, link, largest, args.warmup, args.iters, folder,
                            args.small_iters, args.racks,
                            args.oversubscription if args.racks > 1 else 1.0, args.tuned)
            results.append(run)
            print("\n".join(run["header"]))
            print("\n".join(table(run)), f"\n(wall {run['wall_s']:.0f} s)\n", flush=True)
            if "tuned" in run:
                print("With REFCOLL_TUNING_FILE (refcoll tune of the run above):\n")
                print("\n".join(table({**run, **run["tuned"]})),
                      f"\n(wall {run['tuned']['wall_s']:.0f} s)\n", flush=True)
        cal = calibrate(folder, args.largest) if args.calibrate else None
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "calibrate": cal}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
