"""The reducer under real MPI: bits, rebuild and the never-ready error, at 2 and 3 ranks.

One ``mpiexec`` job per process count runs every check (each start costs about a
second); every rank prints one line per check, and the test reads them all.
A short ``REFCOLL_TIMEOUT`` ends a job that would hang; a rank that fails aborts it.
"""

import os
import re
import subprocess
import sys
import textwrap

import pytest
from conftest import mpiexec_path

MPIEXEC = mpiexec_path()

CHECKS = ["bits-ring", "across-ranks-ring", "rebuild-ring", "rebuilt-bits-ring",
          "bits-rabenseifner", "across-ranks-rabenseifner", "rebuild-rabenseifner",
          "rebuilt-bits-rabenseifner", "never-ready", "usable-after-error"]

SCRIPT = textwrap.dedent("""
    import traceback
    import numpy as np
    from mpi4py import MPI
    import refcoll
    from refcoll.core.errors import UsageError
    from refcoll.training.reducer import Reducer
    from refcoll.training.buckets import assign_buckets

    comm = MPI.COMM_WORLD
    rank = comm.rank
    SHAPES = [(37,), (5, 11), (129,), (3, 3, 3), (64,)]
    CAPS = {"first_bucket_mb": 300 / 2 ** 20, "bucket_cap_mb": 600 / 2 ** 20}

    def gradients(step):
        rng = np.random.default_rng([rank, step])
        return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]

    def reference(buckets, grads, algorithm):
        # each bucket's gradients times fl(1/p), concatenated, all-reduced blocking
        out = [None] * len(grads)
        for b in buckets:
            scaled = [(grads[i] * np.float32(1.0 / comm.size)).reshape(-1) for i in b.params]
            summed = refcoll.allreduce(np.concatenate(scaled), comm, algorithm=algorithm)
            for i, off in zip(b.params, b.offsets):
                out[i] = summed[off:off + grads[i].size].reshape(grads[i].shape)
        return out

    def same(a, b):
        return all(x.tobytes() == y.tobytes() for x, y in zip(a, b))

    def report(name, ok, detail=""):
        print(f"CHECK {name} rank {rank} " + ("ok" if ok else "FAILED " + detail), flush=True)

    def iteration(red, order, step, skip=()):
        grads = gradients(step)
        layout = red.buckets
        for i in order:
            if i not in skip:
                red.ready(i, grads[i])
        return red.finalize(), layout, grads

    def main():
        for algorithm in ("ring", "rabenseifner"):
            red = Reducer(SHAPES, comm, algorithm=algorithm, **CAPS)
            order = [int(i) for i in np.random.default_rng(100 + rank).permutation(len(SHAPES))]
            got, layout, grads = iteration(red, order, 0)
            report(f"bits-{algorithm}", same(got, reference(layout, grads, algorithm)))
            everyone = comm.allgather(b"".join(g.tobytes() for g in got))
            report(f"across-ranks-{algorithm}", len(set(everyone)) == 1)
            want = assign_buckets([4 * int(np.prod(s)) for s in SHAPES], [np.float32] * 5,
                                  comm.bcast(order), 300, 600)
            report(f"rebuild-{algorithm}", red.rebuilt and
                   [list(b.params) for b in red.buckets] == want, str(red.buckets))
            got, layout, grads = iteration(red, list(reversed(range(len(SHAPES)))), 1)
            everyone = comm.allgather(b"".join(g.tobytes() for g in got))
            report(f"rebuilt-bits-{algorithm}",
                   same(got, reference(layout, grads, algorithm)) and len(set(everyone)) == 1)
        red = Reducer(dict(zip(["a", "b", "c", "d", "e"], [np.zeros(s, np.float32)
                                                          for s in SHAPES])), comm,
                      algorithm="ring", **CAPS)
        try:
            iteration(red, [4, 3, 2, 1, 0], 2, skip={0} if rank == 1 else ())
        except UsageError as exc:
            text = str(exc)
            report("never-ready", "parameter 0 'a' float32[37]" in text and "on rank 1" in text
                   and "find_unused=True" in text, text)
        else:
            report("never-ready", False, "no error")
        got, layout, grads = iteration(red, [4, 3, 2, 1, 0], 3)
        report("usable-after-error", same(got, reference(layout, grads, "ring")))

    try:
        main()
    except BaseException:
        traceback.print_exc()
        comm.Abort(1)
""")


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec: install with pip install 'refcoll[mpi]'")
@pytest.mark.parametrize("p", [2, 3], ids=lambda p: f"{p}-ranks")
def test_the_reducer_under_mpiexec(p, tmp_path):
    script = tmp_path / "reducer_job.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    env.update(REFCOLL_TIMEOUT="20", REFCOLL_CALIBRATION="default")
    res = subprocess.run([MPIEXEC, "-n", str(p), sys.executable, str(script)],
                         capture_output=True, text=True, timeout=180, env=env)
    assert res.returncode == 0, \
        f"mpiexec -n {p} failed:\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    # Ranks print concurrently, so lines may interleave: find the reports, not lines.
    passed = set(re.findall(r"CHECK (\S+) rank (\d+) ok", res.stdout))
    missing = [f"{name} on rank {r}" for name in CHECKS for r in range(p)
               if (name, str(r)) not in passed]
    assert not missing, "\n".join(missing) + "\n" + res.stdout[-4000:]
