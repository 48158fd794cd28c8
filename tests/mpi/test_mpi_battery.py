"""The conformance battery under real MPI (run by test_mpi.py under mpiexec -n P).

Every rank runs the same cases; verdicts are identical on every rank.
"""

import numpy as np
import pytest

import refcoll
from refcoll.verify.conformance import build_cases, run_battery

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def transport():
    from mpi4py import MPI

    from refcoll.transport.mpi import MPITransport

    return MPITransport(MPI.COMM_WORLD)


def test_battery_naive_and_ring(transport):
    # Every dtype on small worlds; a covering set where 4 or more processes share 2 cores
    # (the simulator's battery holds every dtype at every size to the same code).
    dtypes = (["int8", "uint64", "float16", "bfloat16", "float32", "float64", "float8_e4m3fn"]
              if transport.size <= 3 else ["int8", "bfloat16", "float32", "float8_e4m3fn"])
    cases = build_cases(transport.size, algorithms_=["naive", "ring"], dtypes=dtypes)
    results = run_battery(transport, cases)
    failures = [f"{r.case.id}: {r.reason}" for r in results if not r.passed]
    assert not failures, "\n".join(failures[:10])


def test_other_algorithms(transport):
    others = [name for name in refcoll.REGISTRY if name not in ("naive", "ring")]
    if not others:
        pytest.skip("only naive and ring are registered")
    ops = ["sum", "max", "avg"] if transport.size <= 4 else ["sum", "avg"]
    dtypes = ["int32", "bfloat16", "float32"] if transport.size <= 4 else ["int32", "float32"]
    cases = build_cases(transport.size, algorithms_=others, ops=ops, dtypes=dtypes)
    results = run_battery(transport, cases)
    failures = [f"{r.case.id}: {r.reason}" for r in results if not r.passed]
    assert not failures, "\n".join(failures[:10])


def test_public_api_on_comm_world_is_identical_everywhere():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal(1001).astype(np.float32)
    y = refcoll.allreduce(x, algorithm="ring")
    gathered = comm.allgather(y.tobytes())
    assert all(g == gathered[0] for g in gathered)
    predicted = refcoll.simulate("allreduce", comm.allgather(x), algorithm="ring")
    assert predicted.outputs[comm.rank].tobytes() == y.tobytes()
