"""The conformance battery under real MPI (run by test_mpi.py under mpiexec -n P).

Every rank runs the same cases; verdicts are identical on every rank. One and two
processes run every case of the selection; from three processes on, where the
processes share 2 cores, a covering subset (:func:`covering`): the simulator's
batteries hold the rest of the product to the same code.
"""

import numpy as np
import pytest
from conftest import classes, covering

import refcoll
from refcoll.verify.conformance import build_cases, run_battery

pytestmark = pytest.mark.mpi

ALL_DTYPES = ["int8", "uint64", "float16", "bfloat16", "float32", "float64", "float8_e4m3fn"]


@pytest.fixture(scope="module")
def transport():
    from mpi4py import MPI

    from refcoll.transport.mpi import MPITransport

    return MPITransport(MPI.COMM_WORLD)


def group_key(p: int):
    """The case fields a covering subset keeps every combination of, at ``p`` processes.

    1-2 processes: every field (the whole selection). 3-4: every (algorithm,
    collective, options, op) at every size in both modes. 5 and more: every
    (algorithm, collective, options, op) at every size, the modes cycled through
    with the dtypes.
    """
    if p <= 2:
        return lambda c: c
    if p <= 4:
        return lambda c: (c.algorithm, c.collective, c.options, c.op, c.count, c.inplace)
    return lambda c: (c.algorithm, c.collective, c.options, c.op, c.count)


def run_covering(transport, cases):
    chosen = covering(cases, group_key(transport.size))
    assert classes(chosen) == classes(cases), "the covering subset lost a case class"
    results = run_battery(transport, chosen)
    failures = [f"{r.case.id}: {r.reason}" for r in results if not r.passed]
    assert not failures, "\n".join(failures[:10])


def test_battery_naive_and_ring(transport):
    # Every op and dtype; the simulator's battery holds every dtype at every size.
    run_covering(transport, build_cases(transport.size, algorithms_=["naive", "ring"],
                                        dtypes=ALL_DTYPES))


def test_other_algorithms(transport):
    others = [name for name in refcoll.REGISTRY if name not in ("naive", "ring")]
    if not others:
        pytest.skip("only naive and ring are registered")
    ops = ["sum", "max", "avg"] if transport.size <= 4 else ["sum", "avg"]
    dtypes = ["int32", "bfloat16", "float32"] if transport.size <= 4 else ["int32", "float32"]
    run_covering(transport, build_cases(transport.size, algorithms_=others, ops=ops,
                                        dtypes=dtypes))


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
