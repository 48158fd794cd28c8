"""Non-blocking collectives measured: how much of an all-reduce hides behind computation.

    mpiexec -n 2 python benchmarks/nonblocking.py [--json FILE] [--reps 15]

Everything is interleaved: each repetition runs every variant once, in turn, on
the same buffers, and the tables give medians over the repetitions (rank 0's
clock, after a barrier). Per size, ``T`` is the blocking all-reduce's median,
and ``C`` the computation put beside it:

* overlap with a sleep of length ``T`` (the cores stay free, as a GPU's backward
  pass leaves them): sequential ``allreduce; sleep(T)`` against ``iallreduce;
  sleep(T); wait`` on the progress thread, on the schedule engine (with and
  without a ``test()`` every millisecond of the sleep) and with the MPI library's
  own ``MPI_Iallreduce``. Perfect overlap is 0.5 of sequential, none 1.0;
* the same with NumPy computation of the same length (a matrix product, which
  releases the GIL), which competes with the ranks and the progress for the cores;
* the non-blocking call's overhead: ``iallreduce(x).wait()`` against
  ``allreduce(x)`` at 8 B to 64 KiB, where the message costs little, and the
  handle's own cost: issuing plus waiting for a call that has already completed.

Figures from a machine with fewer cores than ranks plus progress threads are
suspect, and the header says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

# One BLAS thread per rank: two ranks each starting a pool of threads on two cores
# make every matrix product a scheduling lottery.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402  (after the thread settings)
from mpi4py import MPI  # noqa: E402

import refcoll  # noqa: E402
from refcoll.calls.progress import engine_for  # noqa: E402
from refcoll.transport import mpi as mpi_transport  # noqa: E402
from refcoll.transport.mpi import MPITransport  # noqa: E402

OVERLAP_SIZES = [64 << 10, 1 << 20, 4 << 20, 16 << 20]
OVERHEAD_SIZES = [8, 64, 512, 4 << 10, 64 << 10]


def timed(comm, fn) -> float:
    """Run ``fn`` after a barrier; return rank 0's view of the slowest rank's time."""
    comm.Barrier()
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    return comm.allreduce(elapsed, op=MPI.MAX)


def matmul_work(seconds: float):
    """Return a NumPy computation taking about ``seconds`` (square matrix products)."""
    a = np.random.default_rng(0).standard_normal((128, 128)).astype(np.float32)
    start, k = time.perf_counter(), 0
    while time.perf_counter() - start < 0.05:
        a @ a
        k += 1
    per = 0.05 / k
    reps = max(1, round(seconds / per))

    def work():
        for _ in range(reps):
            a @ a
    return work


def _computation(compute: str, seconds: float):
    """The computation of ``seconds`` put beside the all-reduce, and the same calling
    ``h.test()`` on a handle (every millisecond of a sleep, or once after the NumPy)."""
    if compute == "sleep":
        def work():
            time.sleep(seconds)

        def work_testing(h):
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                time.sleep(min(1e-3, max(end - time.perf_counter(), 0)))
                h.test()
    else:
        work = matmul_work(seconds)

        def work_testing(h):
            work()
            h.test()
    return work, work_testing


def overlap_table(comm, reps: int, compute: str) -> list[dict]:
    """Sequential against overlapped all-reduces, with a sleep or NumPy beside them."""
    threaded = MPITransport(comm)
    engine_for(threaded, "thread")
    scheduled = MPITransport(comm)
    engine_for(scheduled, "schedule")
    plain = MPITransport(comm)
    return [_overlap_row(comm, reps, compute, nbytes, threaded, scheduled, plain)
            for nbytes in OVERLAP_SIZES]


def _overlap_row(comm, reps: int, compute: str, nbytes: int, threaded, scheduled, plain) -> dict:
    """One size of ``overlap_table``: its closures are timed here, on this size's buffers."""
    x = np.ones(nbytes // 4, np.float32)
    out = np.empty_like(x)
    for t in (threaded, scheduled, plain):  # warm: transports, prepared calls, schedules
        for _ in range(2):
            refcoll.allreduce(x, t, out=out)
    for t in (threaded, scheduled):
        for _ in range(2):
            refcoll.iallreduce(x, t, out=out).wait()
    blocking = statistics.median(timed(comm, lambda: refcoll.allreduce(x, plain, out=out))
                                 for _ in range(5))
    work, work_testing = _computation(compute, blocking)
    mpi_out = np.empty_like(x)

    def sequential():
        refcoll.allreduce(x, plain, out=out)
        work()

    beside: dict[str, list] = {"compute": [], "comm_wall": [], "comm_cpu": []}

    def overlapped(t):
        def run():
            h = refcoll.iallreduce(x, t, out=out)
            start = time.perf_counter()
            work()
            computed = time.perf_counter() - start
            h.wait()
            if t is threaded:  # what the computation and the progress thread each got
                beside["compute"].append(computed)
                beside["comm_wall"].append(h.finished - h.started)
                beside["comm_cpu"].append(h.cpu)
        return run

    def schedule_testing():
        h = refcoll.iallreduce(x, scheduled, out=out)
        work_testing(h)
        h.wait()

    def mpi_iallreduce():
        req = comm.Iallreduce(x, mpi_out, op=MPI.SUM)
        work()
        req.Wait()

    variants = {"sequential": sequential, "compute only": work,
                "thread": overlapped(threaded), "schedule": overlapped(scheduled),
                "schedule+test": schedule_testing, "MPI_Iallreduce": mpi_iallreduce}
    times = {name: [] for name in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            times[name].append(timed(comm, fn))
    med = {name: statistics.median(v) for name, v in times.items()}
    alone = statistics.median(timed(comm, work) for _ in range(5))
    return {"bytes": nbytes, "allreduce_s": blocking, "compute": compute,
            "compute_alone_s": alone,
            "compute_beside_s": statistics.median(beside["compute"]),
            "thread_comm_wall_s": statistics.median(beside["comm_wall"]),
            "thread_comm_cpu_s": statistics.median(beside["comm_cpu"]),
            **{f"{k}_s": v for k, v in med.items()},
            **{f"{k}_ratio": med[k] / med["sequential"] for k in
               ("thread", "schedule", "schedule+test", "MPI_Iallreduce")}}


def overhead_table(comm, reps: int) -> list[dict]:
    """``iallreduce(x).wait()`` against ``allreduce(x)`` for small messages (per call)."""
    t = MPITransport(comm)
    engine_for(t, "thread")
    s = MPITransport(comm)
    engine_for(s, "schedule")
    return [_overhead_row(comm, reps, nbytes, t, s) for nbytes in OVERHEAD_SIZES]


def _overhead_row(comm, reps: int, nbytes: int, t, s) -> dict:
    """One size of ``overhead_table``: its closures are timed here, on this size's buffers."""
    x = np.ones(max(nbytes // 4, 1), np.float32)
    out = np.empty_like(x)
    calls = 200

    def blocking():
        for _ in range(calls):
            refcoll.allreduce(x, t, out=out)

    def nonblocking(tr):
        def run():
            for _ in range(calls):
                refcoll.iallreduce(x, tr, out=out).wait()
        return run

    def mpi_blocking():
        for _ in range(calls):
            comm.Allreduce(x, out)

    def issue_and_wait_when_done():
        """Issue, let the call finish (not timed), wait: the handle's own cost."""
        own = 0.0
        for _ in range(calls // 10):
            start = time.perf_counter()
            h = refcoll.iallreduce(x, t, out=out)
            own += time.perf_counter() - start
            while h.finished is None:
                time.sleep(20e-6)
            start = time.perf_counter()
            h.wait()
            own += time.perf_counter() - start
        handle_cost.append(own / (calls // 10))

    handle_cost: list[float] = []
    variants = {"allreduce": blocking, "iallreduce+wait (thread)": nonblocking(t),
                "iallreduce+wait (schedule)": nonblocking(s), "MPI_Allreduce": mpi_blocking}
    for fn in variants.values():
        fn()
    times = {name: [] for name in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            times[name].append(timed(comm, fn) / calls)
    for _ in range(reps):
        comm.Barrier()
        issue_and_wait_when_done()
    med = {name: statistics.median(v) for name, v in times.items()}
    return {"bytes": x.nbytes, **{f"{k}_s": v for k, v in med.items()},
            "issue+wait, call already done_s": statistics.median(handle_cost)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--json", default=None)
    parser.add_argument("--spin", action="store_true",
                        help="the progress thread spins in its waits instead of sleeping "
                             "between polls (PATIENT_POLLS = 0)")
    args = parser.parse_args()
    if args.spin:
        mpi_transport.PATIENT_POLLS = 0
    comm = MPI.COMM_WORLD
    cores = os.cpu_count() or 1
    head = (f"# {comm.size} ranks on {cores} cores, MPI thread level "
            f"{MPI.Query_thread()} (MULTIPLE={MPI.THREAD_MULTIPLE}); "
            f"{MPI.Get_library_version().splitlines()[0].strip()}")
    if comm.size * 2 > cores:
        head += ("\n# ranks and their progress threads outnumber the cores: "
                 "every figure is suspect")
    result = {"ranks": comm.size, "cores": cores, "thread_level": MPI.Query_thread(),
              "patient_polls": mpi_transport.PATIENT_POLLS,
              "sleep": overlap_table(comm, args.reps, "sleep"),
              "numpy": overlap_table(comm, args.reps, "numpy"),
              "overhead": overhead_table(comm, args.reps)}
    if comm.rank:
        return
    print(head + f"\n# progress thread: {'spins' if args.spin else 'sleeps between polls'} "
          f"(PATIENT_POLLS = {mpi_transport.PATIENT_POLLS})")
    for compute in ("sleep", "numpy"):
        print(f"\n## all-reduce beside {compute} of its own length T: time / sequential "
              "(0.5 = all hidden)")
        print(f"{'bytes':>9} {'T ms':>8} {'seq ms':>8} {'thread':>7} {'sched':>7} "
              f"{'sch+test':>8} {'MPI_I':>7} | {'C alone':>8} {'C beside':>8} "
              f"{'comm wall':>9} {'comm cpu':>8}")
        for row in result[compute]:
            print(f"{row['bytes']:>9} {row['allreduce_s'] * 1e3:>8.2f} "
                  f"{row['sequential_s'] * 1e3:>8.2f} {row['thread_ratio']:>7.2f} "
                  f"{row['schedule_ratio']:>7.2f} {row['schedule+test_ratio']:>8.2f} "
                  f"{row['MPI_Iallreduce_ratio']:>7.2f} | {row['compute_alone_s'] * 1e3:>8.2f} "
                  f"{row['compute_beside_s'] * 1e3:>8.2f} {row['thread_comm_wall_s'] * 1e3:>9.2f} "
                  f"{row['thread_comm_cpu_s'] * 1e3:>8.2f}")
    print("\nC alone / C beside: the computation alone and beside the all-reduce (thread "
          "engine); comm wall / cpu: the all-reduce's time on the progress thread and the "
          "CPU time that thread used in it (ms).")
    print("\n## per call, µs: blocking against non-blocking + wait; issue + wait of a call "
          "already done (the handle's own cost, thread engine)")
    print(f"{'bytes':>7} {'allreduce':>10} {'i+wait thr':>11} {'i+wait sch':>11} {'MPI':>8} "
          f"{'handle':>8}")
    for row in result["overhead"]:
        print(f"{row['bytes']:>7} {row['allreduce_s'] * 1e6:>10.1f} "
              f"{row['iallreduce+wait (thread)_s'] * 1e6:>11.1f} "
              f"{row['iallreduce+wait (schedule)_s'] * 1e6:>11.1f} "
              f"{row['MPI_Allreduce_s'] * 1e6:>8.1f} "
              f"{row['issue+wait, call already done_s'] * 1e6:>8.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
