"""Overlapped training steps, measured two ways, beside the overlap model's prediction.

    python benchmarks/overlap_step.py [--json FILE] [--steps 30] [--batch auto]
    (starts ``mpiexec -n 2`` itself, one BLAS thread per rank; or run it under mpiexec)

The step is ``refcoll.training.overlap``'s (what ``refcoll train --layers`` runs): an MLP
of 8 hidden layers of 512 (each weight 1 MiB of float32, so 1, 4 and 25 MiB
buckets cut it differently), its gradients averaged by ``refcoll.Reducer``
(ring all-reduce). ``--batch auto`` picks the batch whose NumPy backward pass
takes about 1.2 times the blocking all-reduce of the whole gradient (the issue's
"a backward pass at least as long as the all-reduce of its gradients").

Two interleaved runs, each of the variants compute-only, overlap at 1, 4 and
25 MiB and no overlap (25 MiB), step by step in a fresh random order, medians of the
steps after the first two (rank 0's clock, each step after a barrier):

(a) ``sleep``: each layer's backward is a ``time.sleep`` of that layer's
    measured NumPy backward time (the total is the measured backward): the
    cores stay free, as under a GPU's backward pass. Also, interleaved: one
    all-reduce of the whole gradient overlapped with a sleep of its own length
    (``iallreduce; sleep(T); wait``) against ``allreduce; sleep(T)``: 0.5 is
    perfect overlap, 1.0 none.
(b) ``numpy``: the real backward, competing with the other rank and the
    progress thread for the cores.

Columns (ms unless a ratio): ``step``; ``exposed``, the step minus the
compute-only step of the same index; ``tail``, how long after the backward pass
the last bucket's all-reduce ended (the exposed communication proper); ``pred``,
the model's prediction (``refcoll.model.overlap.predict_step``: the
buckets' measured ready times, each bucket's all-reduce alone in the same run),
and ``p/exp``, ``p/tail``; ``ovl/cmp``, this step over the compute-only step;
``no/ovl``, the no-overlap step over this one. What explains the rest: ``bwd+``,
how much longer the backward pass took than without communication; ``after``,
the time from the backward pass's end to ``finalize()``'s return (waiting for
the tail, the reducer's agreement and copy-out; for no overlap also its
``ready()`` calls); ``comm`` the buckets' all-reduces during the step, ``alone``
the same sizes alone, and their ratio; ``model``, what the printed ``refcoll
model`` command line gives (flat gradient, equal buckets, uniform rate).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

WIDTHS = (256, *([512] * 8), 10)
CAPS = (1.0, 4.0, 25.0)
BLAS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def relaunch() -> None:
    """Run this script under ``mpiexec -n 2`` with one BLAS thread per rank; exit with it."""
    from refcoll.cli.launch import find_mpiexec

    env = {**os.environ, **{name: "1" for name in BLAS if name not in os.environ}}
    cmd = [find_mpiexec(), "-n", "2", sys.executable, os.path.abspath(__file__), *sys.argv[1:]]
    sys.exit(subprocess.run(cmd, env=env).returncode)


def slowest(comm, fn) -> float:
    """Run ``fn`` after a barrier; return the slowest rank's seconds (on every rank)."""
    from mpi4py import MPI

    comm.Barrier()
    start = time.perf_counter()
    fn()
    return comm.allreduce(time.perf_counter() - start, op=MPI.MAX)


def choose_batch(comm, requested: str) -> tuple[int, float, float]:
    """Return the batch, and the blocking all-reduce and backward times that chose it."""
    import refcoll
    from refcoll.training.overlap import init_layers, measure_layer_backward

    params = init_layers(WIDTHS, 0)
    grad = np.ones(sum(w.size for w in params), np.float32)
    for _ in range(3):
        refcoll.allreduce(grad, comm, algorithm="ring", validate=False)
    allreduce_s = statistics.median(slowest(comm, lambda: refcoll.allreduce(
        grad, comm, algorithm="ring", validate=False)) for _ in range(7))
    batch = 64 if requested == "auto" else int(requested)
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal((batch, WIDTHS[0])).astype(np.float32)
    y = rng.integers(0, WIDTHS[-1], batch)
    backward_s = comm.allreduce(sum(measure_layer_backward(params, x, y))) / comm.size
    if requested == "auto":  # backward time grows about linearly with the batch
        batch = int(np.clip(round(batch * 1.2 * allreduce_s / backward_s), 8, 1024))
        backward_s *= batch / 64
    return comm.bcast(batch, root=0), allreduce_s, backward_s


def sleep_overlap(comm, nbytes: int, reps: int) -> dict:
    """Return the medians of ``iallreduce; sleep(T); wait`` and ``allreduce; sleep(T)``."""
    import refcoll

    x = np.ones(nbytes // 4, np.float32)
    out = np.empty_like(x)

    def blocking():
        refcoll.allreduce(x, comm, algorithm="ring", out=out, validate=False)

    for _ in range(3):
        blocking()
    length = statistics.median(slowest(comm, blocking) for _ in range(7))
    length = comm.bcast(length, root=0)

    def sequential():
        blocking()
        time.sleep(length)

    def overlapped():
        h = refcoll.iallreduce(x, comm, algorithm="ring", out=out, validate=False)
        time.sleep(length)
        h.wait()

    times = {"sequential": [], "overlapped": []}
    for _ in range(reps):
        times["sequential"].append(slowest(comm, sequential))
        times["overlapped"].append(slowest(comm, overlapped))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"bytes": nbytes, "allreduce": length, **med,
            "ratio": med["overlapped"] / med["sequential"]}


def rows_of(result) -> list[dict]:
    """Return one row per reducing variant, with the figures that explain it."""
    compute = result.variants["compute"]
    out = []
    for name, row in result.variants.items():
        if row["overlap"] is None:
            continue
        alone, predicted = sum(row["predicted"]["bucket_comm"]), row["predicted"]["exposed"]
        out.append({
            "variant": name, "buckets": len(row["buckets"]), "step": row["step"],
            "compute_step": compute["step"], "exposed": row["exposed"], "tail": row["tail"],
            "predicted": predicted,
            "pred_over_exposed": predicted / row["exposed"] if row["exposed"] > 0 else None,
            "pred_over_tail": predicted / row["tail"] if row["tail"] > 0 else None,
            "vs_compute": row["vs_compute"], "no_overlap_vs_this": row["speedup"],
            "backward_extra": row["backward"] - compute["backward"],
            "after_backward": row["after_backward"],
            "comm": row["comm"], "comm_alone": alone,
            "comm_inflation": row["comm"] / alone if alone else None,
            "model_command": row["model_command"], "model_exposed": row["model_exposed"]})
    return out


def _ratio(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_table(mode: str, result, rows: list[dict]) -> None:
    """Print one run's rows (ms unless a ratio)."""
    compute = result.variants["compute"]
    print(f"\n({'a' if mode == 'sleep' else 'b'}) backward = {mode}: compute-only step "
          f"{1e3 * compute['step']:.1f} ms (forward {1e3 * compute['forward']:.1f}, backward "
          f"{1e3 * compute['backward']:.1f}, update {1e3 * compute['update']:.1f}); medians")
    print(f"{'variant':<13} {'bkts':>4} {'step':>6} {'exposed':>7} {'tail':>6} {'pred':>6} "
          f"{'p/exp':>5} {'p/tail':>6} {'ovl/cmp':>7} {'no/ovl':>6} {'bwd+':>6} {'after':>6} "
          f"{'comm':>6} {'alone':>6} {'comm×':>5} {'model':>6}")
    for r in rows:
        ms = {k: f"{1e3 * r[k]:.2f}" for k in ("step", "exposed", "tail", "predicted",
                                                "backward_extra", "after_backward", "comm",
                                                "comm_alone", "model_exposed")}
        print(f"{r['variant']:<13} {r['buckets']:>4} {ms['step']:>6} {ms['exposed']:>7} "
              f"{ms['tail']:>6} {ms['predicted']:>6} {_ratio(r['pred_over_exposed']):>5} "
              f"{_ratio(r['pred_over_tail']):>6} {r['vs_compute']:>7.2f} "
              f"{r['no_overlap_vs_this']:>6.2f} {ms['backward_extra']:>6} "
              f"{ms['after_backward']:>6} {ms['comm']:>6} {ms['comm_alone']:>6} "
              f"{_ratio(r['comm_inflation']):>5} {ms['model_exposed']:>6}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="steps per run (2 of warm-up)")
    ap.add_argument("--batch", default="auto", help="rows per rank, or auto")
    ap.add_argument("--reps", type=int, default=15, help="repetitions of the sleep overlap")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval in seconds (CPython's default is 0.005)")
    ap.add_argument("--json", default=None, help="write every figure here")
    args = ap.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    from refcoll.cli.launch import in_mpi_job

    if not in_mpi_job():
        relaunch()
    from mpi4py import MPI

    from refcoll.training.overlap import OverlapConfig, run_overlap
    from refcoll.transport.mpi import MPITransport

    comm = MPI.COMM_WORLD
    lead = comm.rank == 0
    t = MPITransport(comm, collective="benchmarks/overlap_step.py")
    started = time.perf_counter()
    batch, allreduce_s, backward_s = choose_batch(comm, args.batch)
    load = os.getloadavg()[0]
    if lead:
        library = MPI.Get_library_version().splitlines()[0].strip()
        print(f"# {comm.size} ranks on {os.cpu_count()} cores (load {load:.1f}), {library}; "
              f"MLP {','.join(map(str, WIDTHS))}, batch {batch}; blocking all-reduce of the "
              f"gradient {1e3 * allreduce_s:.1f} ms, NumPy backward about "
              f"{1e3 * backward_s:.1f} ms")
    report = {"ranks": comm.size, "cores": os.cpu_count(), "load_before": load,
              "switch_interval": sys.getswitchinterval(),
              "widths": WIDTHS, "batch": batch, "allreduce_gradient": allreduce_s,
              "backward_estimate": backward_s, "runs": {}}
    gradient_bytes = 0
    for mode in ("sleep", "numpy"):
        config = OverlapConfig(WIDTHS, steps=args.steps, batch=batch, synthetic=True,
                               bucket_mbs=CAPS, backward=mode, lr=0.01)
        result = run_overlap(t, config)
        gradient_bytes = 4 * result.parameters
        rows = rows_of(result)
        data = result.to_json()
        report["runs"][mode] = {"rows": rows, "result": data}
        if lead:
            print_table(mode, result, rows)
        if mode == "sleep":
            report["sleep_overlap"] = sleep_overlap(comm, gradient_bytes, args.reps)
            if lead:
                s = report["sleep_overlap"]
                print(f"one all-reduce of {gradient_bytes / 2**20:.1f} MiB "
                      f"({1e3 * s['allreduce']:.1f} ms) with a sleep of its length: overlapped "
                      f"{1e3 * s['overlapped']:.1f} ms / sequential {1e3 * s['sequential']:.1f} "
                      f"ms = {s['ratio']:.2f} (0.5: perfect, 1.0: none)")
    report["load_after"] = os.getloadavg()[0]
    report["seconds"] = time.perf_counter() - started
    if lead:
        print(f"\nload average {report['load_before']:.1f} before, {report['load_after']:.1f} "
              f"after; {report['seconds']:.0f} s")
        if args.json:
            with open(args.json, "w", encoding="utf-8") as fh:
                json.dump(report, fh, indent=2, default=str)
                fh.write("\n")


if __name__ == "__main__":
    main()
