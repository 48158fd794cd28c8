"""Soak test: thousands of mixed collectives back to back under MPI, every result checked.

Run: mpiexec -n N python benchmarks/soak.py [--calls 5000] [--seed S] [--json FILE]
     [--max-count 200003] [--max-growth-mib 8]

Call ``i`` is drawn from a generator seeded with ``(seed, i)``, the same on every
rank: a communicator, an algorithm, a collective it implements, an op and dtype
that go together, a count (edge sizes 0, 1, p-1, p, p+1, mid sizes, and now and
then a large odd one up to ``--max-count``), in place or not, the root, the
algorithm's options (``hierarchical``: ``ranks_per_node`` and ``inter``;
``tree``/``dbtree``: ``segment``) and whether arguments are validated. The
communicators are ``COMM_WORLD``, the world in reverse rank order, its two halves
and its even and odd ranks (``comm.Split``); on a split, each group runs the call
at the same time on its own ranks.

Inputs are :func:`refcoll.verify.inputs.make_inputs` ``exact`` inputs seeded per call, so
every rank regenerates its group's inputs and checks its own result against
:func:`refcoll.verify.oracle.fold` (the gathered rows, the root's data) bit for bit; it
also checks that an out-of-place call left its input alone and that all-reduce,
allgather and broadcast results are bitwise the same on every rank of the group
(a digest per rank, compared over the group).

Memory: a warm-up first runs every (communicator, algorithm, collective) at the
largest count, so workspaces and cached communicators reach their size; the
resident set (``VmRSS``) is sampled then, every tenth of the run, and at the end.
``growth`` is the end less the sample after warm-up. The allocator's arenas move
that by up to about 20 MiB either way (a 20000-call run at 4 ranks plateaus within its
first half), so the verdict looks at the second half: a leak of ``L`` bytes a
call raises the end above every sample of the first half by about ``L·calls/2``.
``memory_grew`` when that ``second_half_growth`` passes ``--max-growth-mib`` on
any rank, which counts as a failure.

The ``switch`` algorithm is skipped: its switches are extra processes that hold
no data (``refcoll.algorithms.switch``), so a communicator of N ranks has fewer
than N data ranks and the plan's sizes would not be every rank's.

Output: one line per tenth of the run, then a summary; ``--json FILE`` writes
``{"ranks", "seed", "calls", "warmup_calls", "rank_calls", "failures",
"failure_examples", "wall_s", "calls_per_s", "rss_kib": {"after_warmup", "end",
"growth", "second_half_growth", "peak", "samples"} (lists by world rank; samples:
after warm-up, every tenth, the end), "memory_grew", "skipped",
"by_algorithm", "by_collective", "by_comm"}``: ``calls`` is the planned calls,
``rank_calls`` the collective calls summed over ranks (warm-up included),
``wall_s`` the planned calls' time (warm-up excluded). Exit status 0 when every
call passed and memory did not grow, 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import sys
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np

os.environ.setdefault("REFCOLL_TIMEOUT", "120")  # a hang ends the soak instead of the job

from mpi4py import MPI  # noqa: E402

import refcoll  # noqa: E402
from refcoll import algorithms  # noqa: E402
from refcoll.core.chunking import chunk_slice  # noqa: E402
from refcoll.core.errors import CollectiveTimeout  # noqa: E402
from refcoll.core.ops import DTYPES, OPS, supports  # noqa: E402
from refcoll.verify.inputs import make_inputs  # noqa: E402
from refcoll.verify.oracle import fold  # noqa: E402

#: Algorithms the soak leaves out, and why (printed in the summary).
SKIPPED = {"switch": "needs switch processes beyond the data ranks"}
ALGORITHMS = [n for n in algorithms.names() if n not in SKIPPED]
REDUCING = ("allreduce", "reduce_scatter", "reduce")
ROOTED = ("broadcast", "reduce")
REPLICATED = ("allreduce", "allgather", "broadcast")
INTER = [n for n in algorithms.names("allreduce")
         if n != "hierarchical" and algorithms.get(n).extra_ranks is None]
#: Warm-up calls are numbered from here (their inputs' seeds differ from the plan's).
WARMUP_INDEX = 1 << 40
#: Failures kept in full for the report.
KEEP_FAILURES = 20


# ------------------------------------------------------------------ communicators

def communicators(world) -> dict:
    """Return ``{name: this rank's communicator}``: the world and four splits of it."""
    rank, size = world.rank, world.size
    return {
        "world": world,
        "reversed": world.Split(0, size - 1 - rank),
        "halves": world.Split(0 if rank < (size + 1) // 2 else 1, rank),
        "parity": world.Split(rank % 2, rank),
    }


# ---------------------------------------------------------------------- the plan

@dataclass(frozen=True)
class Call:
    """One planned call, drawn alike on every rank (sizes relative to the group's p)."""

    index: int
    comm: str
    algorithm: str
    collective: str
    op: str | None
    dtype: str
    size_kind: str
    size_draw: int
    inplace: bool
    root_draw: float
    options: tuple
    validate: bool

    def count(self, p: int) -> int:
        """Return the element count on a group of ``p`` ranks."""
        if self.size_kind == "edge":
            return max(0, (0, 1, p - 1, p, p + 1, 2 * p + 1)[self.size_draw % 6])
        return self.size_draw

    def root(self, p: int) -> int:
        return min(int(self.root_draw * p), p - 1)

    def kwargs(self, p: int) -> dict:
        """Return the algorithm options; ``ranks_per_node`` is at most the group's ``p``."""
        opts = dict(self.options)
        if "ranks_per_node" in opts:
            opts["ranks_per_node"] = min(opts["ranks_per_node"], p)
        return opts

    def describe(self, p: int) -> str:
        opts = "".join(f" {k}={v}" for k, v in self.kwargs(p).items())
        root = f" root={self.root(p)}" if self.collective in ROOTED else ""
        which = (f"warm-up call {self.index - WARMUP_INDEX}" if self.index >= WARMUP_INDEX
                 else f"call {self.index}")
        return (f"{which} on {self.comm} (p={p}): {self.algorithm} {self.collective} "
                f"{self.op or '-'} {self.dtype} n={self.count(p)} "
                f"{'in place' if self.inplace else 'out of place'}{root}{opts}"
                f"{'' if self.validate else ' validate=False'}")


def plan_call(index: int, seed: int, comm_names: list[str], max_count: int,
              world_size: int) -> Call:
    """Draw call ``index``; the same on every rank."""
    rng = np.random.default_rng([seed, index])
    comm = comm_names[rng.integers(len(comm_names))]
    name = ALGORITHMS[rng.integers(len(ALGORITHMS))]
    colls = algorithms.get(name).collectives
    collective = colls[rng.integers(len(colls))]
    op = list(OPS)[rng.integers(len(OPS))] if collective in REDUCING else None
    dtypes = [d for d in DTYPES if supports(op, d)]
    dtype = dtypes[rng.integers(len(dtypes))]
    roll = rng.random()
    if roll < 0.4:
        size_kind, size_draw = "edge", int(rng.integers(6))
    elif roll < 0.9:
        size_kind, size_draw = "mid", int(rng.integers(2, 5000))
    else:
        size_kind, size_draw = "large", int(rng.integers(max_count // 4, max_count + 1)) | 1
    options = {}
    if name == "hierarchical":
        if rng.random() < 0.75:
            options["ranks_per_node"] = int(rng.integers(1, world_size + 1))
        options["inter"] = INTER[rng.integers(len(INTER))]
    elif name in ("tree", "dbtree") and rng.random() < 0.75:
        options["segment"] = int(rng.integers(1, 4097))
    return Call(index, comm, name, collective, op, dtype, size_kind, size_draw,
                bool(rng.random() < 0.5), float(rng.random()), tuple(sorted(options.items())),
                bool(rng.random() < 0.8))


def warmup_calls(comm_names: list[str], max_count: int, world_size: int) -> list[Call]:
    """Every (communicator, algorithm, collective) once at the largest count, out of place.

    ``hierarchical`` runs once per node shape and ``inter`` the plan can draw: each
    shape caches its own communicators and workspaces, which would otherwise
    look like growth when the plan first meets it.
    """
    variants = {"hierarchical": [tuple(sorted({"inter": inter, **shape}.items()))
                                 for inter in INTER
                                 for shape in [{}] + [{"ranks_per_node": k}
                                                      for k in range(1, world_size + 1)]]}
    calls = []
    for comm in comm_names:
        for name in ALGORITHMS:
            for options in variants.get(name, [()]):
                for coll in algorithms.get(name).collectives:
                    calls.append(Call(WARMUP_INDEX + len(calls), comm, name, coll,
                                      "sum" if coll in REDUCING else None, "float64", "large",
                                      max_count, False, 0.0, options, True))
    return calls


# ---------------------------------------------------------------------- one call

def _digest(arr) -> bytes:
    if arr is None:
        return b""
    return hashlib.blake2b(np.ascontiguousarray(arr).tobytes(), digest_size=16).digest()


def _run(call: Call, comm, x: np.ndarray, p: int):
    """Run the call through the public API; return ``(result, out= buffer or None)``."""
    rank = comm.rank
    opts = {"algorithm": call.algorithm, "validate": call.validate, **call.kwargs(p)}
    if call.collective == "allreduce":
        target = x if call.inplace else None
        return refcoll.allreduce(x, comm, op=call.op, out=target, **opts), target
    if call.collective == "reduce_scatter":
        target = x[chunk_slice(x.size, p, rank)] if call.inplace else None
        return refcoll.reduce_scatter(x, comm, op=call.op, out=target, **opts), target
    if call.collective == "allgather":
        if not call.inplace:
            return refcoll.allgather(x, comm, **opts), None
        target = np.empty((p, x.size), dtype=x.dtype)
        target[rank] = x
        return refcoll.allgather(target[rank], comm, out=target, **opts), target
    if call.collective == "broadcast":
        target = x if call.inplace else None
        return refcoll.broadcast(x, call.root(p), comm, out=target, **opts), target
    target = x if (call.inplace and rank == call.root(p)) else None
    return refcoll.reduce(x, call.root(p), comm, op=call.op, out=target, **opts), target


def _expected(call: Call, inputs: list[np.ndarray], rank: int, p: int):
    if call.collective == "allgather":
        return np.stack(inputs)
    if call.collective == "broadcast":
        return inputs[call.root(p)]
    if call.collective == "reduce" and rank != call.root(p):
        return None
    full = fold(call.op, inputs)
    if call.collective == "reduce_scatter":
        return full[chunk_slice(full.size, p, rank)]
    return full


def run_call(call: Call, comm, seed: int) -> list[str]:
    """Run one call on this rank of ``comm``; return this rank's problems (empty: passed)."""
    p, rank = comm.size, comm.rank
    n = call.count(p)
    inputs = make_inputs("exact", DTYPES[call.dtype], n, p, op=call.op or "sum",
                         seed=seed * 1_000_003 + call.index)
    x = inputs[rank].copy()
    problems = []
    result = None
    try:
        result, target = _run(call, comm, x, p)
    except CollectiveTimeout:
        raise  # the job cannot go on
    except Exception as exc:  # noqa: BLE001 - a failing call is a finding, not a crash
        problems.append(f"raised {type(exc).__name__}: {exc}")
    else:
        want = _expected(call, inputs, rank, p)
        if want is None:
            if result is not None:
                problems.append("a non-root rank of reduce returned a result")
        elif result is None:
            problems.append("returned None")
        elif result.dtype != want.dtype or result.shape != want.shape:
            problems.append(f"returned {result.dtype}{result.shape}, expected "
                            f"{want.dtype}{want.shape}")
        else:
            if _digest(result) != _digest(want):
                got, ref = result.reshape(-1), want.reshape(-1)
                bad = np.flatnonzero(got.view(np.uint8).reshape(got.size, -1)
                                     != ref.view(np.uint8).reshape(ref.size, -1))
                i = int(bad[0]) // got.itemsize if len(bad) else 0
                problems.append(f"element {i} is {got[i]!r}, the fold gives {ref[i]!r}")
            if call.inplace and target is not None and result.size and \
                    not np.shares_memory(result, target):
                problems.append("an in-place call did not return its out= buffer")
        if not call.inplace and not np.array_equal(x.view(np.uint8), inputs[rank].view(np.uint8)):
            problems.append("an out-of-place call modified its input")
    if call.collective in REPLICATED:
        digests = comm.allgather(_digest(result))
        differing = [r for r, d in enumerate(digests) if d != digests[0]]
        if differing:
            problems.append(f"ranks {differing} of the group hold different bits from its rank 0")
    return problems


# ------------------------------------------------------------------------ memory

def rss_kib() -> int:
    """Return this process's resident set size now (``VmRSS``), in KiB."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return peak_rss_kib()  # no /proc (macOS): the peak is the best there is


def peak_rss_kib() -> int:
    """Return this process's peak resident set size, in KiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak // 1024 if sys.platform == "darwin" else peak


# --------------------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-count", type=int, default=200_003,
                    help="largest element count of a call (and of the warm-up)")
    ap.add_argument("--max-growth-mib", type=float, default=8.0,
                    help="resident-set growth over the second half of the run, per rank, that "
                         "counts as a leak (a failure)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    world = MPI.COMM_WORLD
    comms = communicators(world)
    names = list(comms)
    rank_calls = 0
    failures: list[dict] = []
    by_algorithm, by_collective, by_comm = Counter(), Counter(), Counter()

    def execute(call: Call) -> None:
        nonlocal rank_calls
        comm = comms[call.comm]
        try:
            problems = run_call(call, comm, args.seed)
        except CollectiveTimeout as exc:
            print(f"rank {world.rank}: {call.describe(comm.size)}: {exc}", file=sys.stderr,
                  flush=True)
            world.Abort(1)
        rank_calls += 1
        for msg in problems:
            failures.append({"rank": world.rank, "call": call.describe(comm.size), "problem": msg})

    start = time.perf_counter()
    warm = warmup_calls(names, args.max_count, world.size)
    for call in warm:
        execute(call)
    world.Barrier()
    after_warmup = rss_kib()
    samples = [after_warmup]  # after warm-up, every tenth of the run (the last is the end)
    if world.rank == 0:
        print(f"# soak: {world.size} ranks, {args.calls} calls, seed {args.seed}, "
              f"{len(warm)} warm-up calls in {time.perf_counter() - start:.1f} s; "
              f"skipped: {', '.join(f'{k} ({v})' for k, v in SKIPPED.items())}", flush=True)
    run_start = time.perf_counter()
    tenth = max(1, args.calls // 10)
    for i in range(args.calls):
        call = plan_call(i, args.seed, names, args.max_count, world.size)
        execute(call)
        by_algorithm[call.algorithm] += 1
        by_collective[call.collective] += 1
        by_comm[call.comm] += 1
        if (i + 1) % tenth == 0 or i + 1 == args.calls:
            samples.append(rss_kib())
            done = world.allreduce(len(failures))
            if world.rank == 0:
                print(f"{i + 1:>7} calls  {time.perf_counter() - run_start:8.1f} s  "
                      f"failures {done}  rank-0 RSS {samples[-1] / 1024:.1f} MiB", flush=True)
    world.Barrier()
    wall = time.perf_counter() - run_start
    end = rss_kib()

    all_failures = [f for part in world.gather(failures[:KEEP_FAILURES]) or [] for f in part]
    total_failures = world.allreduce(len(failures))
    total_rank_calls = world.allreduce(rank_calls)
    after = world.gather(after_warmup)
    ends = world.gather(end)
    peaks = world.gather(peak_rss_kib())
    all_samples = world.gather(samples)
    if world.rank != 0:
        return 0 if total_failures == 0 else 1
    growth = [e - a for a, e in zip(after, ends)]
    half = [e - max(s[: 1 + len(s) // 2]) for e, s in zip(ends, all_samples)]
    grew = max(half) > args.max_growth_mib * 1024
    report = {
        "ranks": world.size,
        "seed": args.seed,
        "calls": args.calls,
        "warmup_calls": len(warm),
        "rank_calls": total_rank_calls,
        "failures": total_failures,
        "failure_examples": all_failures[:KEEP_FAILURES],
        "wall_s": round(wall, 3),
        "calls_per_s": round(args.calls / wall, 1) if wall > 0 else None,
        "rss_kib": {"after_warmup": after, "end": ends, "growth": growth,
                    "second_half_growth": half, "peak": peaks, "samples": all_samples},
        "memory_grew": grew,
        "max_growth_mib": args.max_growth_mib,
        "skipped": SKIPPED,
        "by_algorithm": dict(sorted(by_algorithm.items())),
        "by_collective": dict(sorted(by_collective.items())),
        "by_comm": dict(sorted(by_comm.items())),
    }
    for f in all_failures[:5]:
        print(f"FAILED rank {f['rank']}: {f['call']}: {f['problem']}")
    print(f"calls {args.calls} (rank-calls {total_rank_calls}, warm-up {len(warm)}), "
          f"failures {total_failures}, wall {wall:.1f} s ({report['calls_per_s']} calls/s)")
    print("RSS after warm-up / end / growth / second-half growth (MiB, by rank): "
          + ", ".join(f"{a / 1024:.1f}/{e / 1024:.1f}/{g / 1024:+.1f}/{h / 1024:+.1f}"
                      for a, e, g, h in zip(after, ends, growth, half)))
    print(f"peak RSS (MiB, by rank): {', '.join(f'{k / 1024:.1f}' for k in peaks)}; memory grew: "
          f"{'yes' if grew else 'no'} (second-half limit {args.max_growth_mib:g} MiB)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
            fh.write("\n")
    return 0 if total_failures == 0 and not grew else 1


if __name__ == "__main__":
    code = main()
    # Rank 0 decided the memory verdict; share the exit status so mpiexec reports it.
    sys.exit(MPI.COMM_WORLD.bcast(code, root=0))
