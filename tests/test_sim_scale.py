"""The simulator at a thousand ranks: same ledger as the cost formulas, same bits as a fold.

The ranks of a SimWorld take turns (refcoll.transport.scheduler). These tests hold
the big worlds to what the small ones promise: every count of the ledger equal to
the algorithm's closed-form cost, every rank's output equal, bit for bit, to a
reference computed here with NumPy, and a schedule that cannot complete still
reported as a named wait-for cycle. They also show that the order in which threads
run changes nothing (one at a time against all at once), that a thread that waits
where the world cannot see does not stall the others, and that the ledger-only
world (refcoll.transport.ledger_only) keeps the simulator's ledger, message for
message, for every registered algorithm that does not split its communicator.
"""

import threading
import time

import numpy as np
import pytest

import refcoll
from refcoll import algorithms
from refcoll.core.errors import DeadlockError, RefcollError, UsageError
from refcoll.core.ops import get_dtype
from refcoll.transport import SimWorld
from refcoll.transport.ledger_only import LedgerWorld
from refcoll.transport.scheduler import progress_note
from refcoll.transport.sim import SimProgress
from refcoll.verify.inputs import make_inputs

FLOAT32 = get_dtype("float32")


def exact_sum(inputs) -> np.ndarray:
    """Return the sum of exact (integer-valued) float32 inputs: every order gives it."""
    total = np.sum(np.stack(inputs).astype(np.float64), axis=0)
    assert np.array_equal(total.astype(np.float32).astype(np.float64), total), "sum not exact"
    return total.astype(np.float32)


def ring_fold(inputs) -> np.float32:
    """Return the ring's one-element all-reduce in its documented order.

    With one element only chunk 0 is non-empty, and chunk c is combined
    ``c+1, c+2, ..., p-1, 0, ..., c``, each rank's value appended on the right.
    """
    p = len(inputs)
    partial = np.float32(inputs[1 % p][0])
    for r in list(range(2, p)) + [0]:
        partial = np.float32(partial + inputs[r][0])
    return partial


def assert_ledger_is_the_cost(result, algorithm: str, p: int, count: int) -> None:
    """Hold a run's ledger (a SimResult's or a world's) to the algorithm's cost formula."""
    cost = algorithms.get(algorithm).costs["allreduce"](p, count, FLOAT32.itemsize)
    assert result.ledger.counts() == cost.counts()


def assert_bits(outputs, want) -> None:
    want = np.asarray(want, dtype=np.float32).reshape(-1)
    for rank, out in enumerate(outputs):
        assert np.array_equal(out.view(np.uint32), want.view(np.uint32)), f"rank {rank}"


@pytest.mark.parametrize("algorithm", ["tree", "rabenseifner"])
def test_a_thousand_ranks_move_the_ledger_the_cost_predicts(algorithm):
    p = 1024
    inputs = make_inputs("exact", FLOAT32, 1, p)
    result = refcoll.simulate("allreduce", inputs, algorithm=algorithm)
    assert_ledger_is_the_cost(result, algorithm, p, 1)
    assert_bits(result.outputs, exact_sum(inputs))


def test_ring_at_128_ranks_keeps_its_reduction_order():
    p = 128
    inputs = [np.random.default_rng(r).standard_normal(1).astype(np.float32) for r in range(p)]
    result = refcoll.simulate("allreduce", inputs, algorithm="ring")
    assert_ledger_is_the_cost(result, "ring", p, 1)
    assert_bits(result.outputs, ring_fold(inputs))
    backwards = np.float32(0)
    for x in reversed(inputs):
        backwards = np.float32(backwards + x[0])
    assert backwards != ring_fold(inputs), "these inputs must make the order visible"


@pytest.mark.slow
def test_ring_at_a_thousand_ranks():
    p = 1024
    inputs = [np.random.default_rng(r).standard_normal(1).astype(np.float32) for r in range(p)]
    result = refcoll.simulate("allreduce", inputs, algorithm="ring")
    assert_ledger_is_the_cost(result, "ring", p, 1)
    assert_bits(result.outputs, ring_fold(inputs))


def ledger_of(world) -> list:
    return sorted((m.step, m.source, m.dest, m.nbytes, m.tag, m.comm)
                  for m in world.ledger.messages)


@pytest.mark.parametrize("algorithm", ["ring", "tree", "rabenseifner", "hierarchical"])
def test_taking_turns_changes_neither_the_ledger_nor_the_bits(algorithm):
    p, count = 12, 37
    inputs = [np.random.default_rng(r).standard_normal(count).astype(np.float32)
              for r in range(p)]
    runs = []
    for slots in (1, p):  # one thread at a time; every thread as soon as it can go on
        world = SimWorld(p, slots=slots, ranks_per_node=4)
        outputs = world.run(lambda t: refcoll.allreduce(inputs[t.rank], t, algorithm=algorithm,
                                                        validate=False))
        runs.append((ledger_of(world), sorted((r.rank, r.elements, r.step)
                                              for r in world.ledger.reductions),
                     [o.tobytes() for o in outputs]))
    assert runs[0] == runs[1]


def test_a_deadlock_of_a_thousand_ranks_is_named_as_one_cycle():
    def all_send_first(t):
        t.send(np.zeros(1), (t.rank + 1) % t.size)  # rendezvous: no send can complete
        t.recv(np.zeros(1), (t.rank - 1) % t.size)

    p = 1024
    with pytest.raises(DeadlockError) as caught:
        SimWorld(p).run(all_send_first)
    head, *lines = str(caught.value).splitlines()
    cycle = [int(r) for r in head.split("wait-for cycle ")[1].split(" -> ")]
    assert len(cycle) == p + 1 and cycle[0] == cycle[-1]
    assert all((b - a) % p == 1 for a, b in zip(cycle, cycle[1:]))
    assert len(lines) == p and "rank 1023 waits on a send of 8 B to rank 0" in lines[-1]


def test_a_thread_waiting_outside_the_world_does_not_stall_the_others():
    # Rank 0 keeps its turn while it waits on an event the world knows nothing of;
    # only ranks 1 and 2, after an exchange of their own, can set it.
    told = threading.Event()

    def body(t):
        if t.rank == 0:
            return told.wait(60)
        peer = 3 - t.rank
        got = np.zeros(1)
        t.sendrecv(np.full(1, t.rank, dtype=np.float64), peer, got, peer)
        if t.rank == 1:
            told.set()
        return float(got[0])

    assert SimWorld(3).run(body) == [True, 2.0, 1.0]


def test_a_long_run_reports_its_progress():
    seen, notes = [], []

    def body(t):
        if t.rank > 0:
            t.recv(np.zeros(1), 0)
            return
        notes.append(progress_note())
        time.sleep(0.3)
        for r in (1, 2, 3):
            t.send(np.zeros(1), r)

    world = SimWorld(4, progress=seen.append, progress_every=0.05)
    world.run(body)
    assert seen and all(isinstance(s, SimProgress) and s.size == 4 for s in seen)
    assert all(0 <= s.finished <= 4 and 0 <= s.messages <= 3 for s in seen)
    assert notes[0].startswith("0 of 4 ranks finished, 0 messages")
    assert progress_note() is None


def test_a_ledger_only_run_reports_its_progress_while_recording_then_matching():
    """The heartbeat of a ledger-only run names the ranks recorded, then (read once the
    replay is done) the ranks finished and the messages matched."""
    notes = []

    def ring(t):
        notes.append(progress_note())
        t.sendrecv(np.zeros(4), (t.rank + 1) % t.size, np.zeros(4), (t.rank - 1) % t.size)

    world = LedgerWorld(5)
    world.run(ring)
    assert notes == [f"{r} of 5 ranks' messages recorded, none matched yet" for r in range(5)]
    assert world.ledger.counts()["messages"] == 5  # one a rank
    assert world.snapshot().describe() == "5 of 5 ranks finished, 5 messages matched"
    assert progress_note() is None


def run_in(world_class, p, algorithm, collective, inputs):
    world = world_class(p)
    fn = getattr(refcoll, collective)
    kwargs = {"root": 0} if collective in ("broadcast", "reduce") else {}
    world.run(lambda t, x: fn(x, comm=t, algorithm=algorithm, validate=False, **kwargs),
              [(x,) for x in inputs])
    return world


CASES = [(a.name, c) for a in algorithms.REGISTRY.values() for c in a.collectives]


@pytest.mark.parametrize("algorithm,collective", CASES, ids=[f"{a}-{c}" for a, c in CASES])
def test_the_ledger_only_world_keeps_the_simulators_ledger(algorithm, collective):
    p = 5
    inputs = [np.random.default_rng(r).standard_normal(13).astype(np.float32) for r in range(p)]
    full = run_in(SimWorld, p, algorithm, collective, inputs)
    if any(m.comm != 0 for m in full.ledger.messages):  # it split its communicator
        with pytest.raises(UsageError, match="ledger-only simulation cannot split"):
            run_in(LedgerWorld, p, algorithm, collective, inputs)
        return
    bare = run_in(LedgerWorld, p, algorithm, collective, inputs)
    assert ledger_of(bare) == ledger_of(full)
    assert (sorted((r.rank, r.elements, r.step) for r in bare.ledger.reductions)
            == sorted((r.rank, r.elements, r.step) for r in full.ledger.reductions))


@pytest.mark.parametrize("algorithm,p", [("tree", 4096), ("rabenseifner", 1024)])
def test_the_ledger_only_world_reaches_thousands_of_ranks(algorithm, p):
    world = run_in(LedgerWorld, p, algorithm, "allreduce", [np.zeros(1, np.float32)] * p)
    assert_ledger_is_the_cost(world, algorithm, p, 1)


@pytest.mark.slow
def test_the_ledger_only_ring_at_a_thousand_ranks():
    p = 1024
    world = run_in(LedgerWorld, p, "ring", "allreduce", [np.zeros(1, np.float32)] * p)
    assert_ledger_is_the_cost(world, "ring", p, 1)


def test_the_ledger_only_world_holds_one_ranks_transport_at_a_time():
    """Each rank's transport kept its workspaces until the replay: bruck's allgather at
    p = 512 held a gigabyte that the memory refusal never counted."""
    import weakref

    earlier = []

    def ring(t):
        assert all(ref() is None for ref in earlier)  # the ranks before have let go
        earlier.append(weakref.ref(t))
        t.sendrecv(np.zeros(4), (t.rank + 1) % t.size, np.zeros(4), (t.rank - 1) % t.size)

    world = LedgerWorld(5)
    world.run(ring)
    assert world.ledger.counts()["messages"] == 5


def failure(world_class, p, body):
    with pytest.raises(RefcollError) as caught:
        world_class(p).run(body)
    return type(caught.value), str(caught.value)


def test_the_ledger_only_world_reports_the_same_deadlocks_and_mismatches():
    def head_on(t):
        t.send(np.zeros(4), (t.rank + 1) % t.size)
        t.recv(np.zeros(4), (t.rank - 1) % t.size)

    def lonely(t):
        if t.rank == 0:
            t.recv(np.zeros(1), 1)

    def mismatch(t):
        if t.rank == 0:
            t.send(np.zeros(5), 1)
        else:
            t.recv(np.zeros(4), 0)

    for p, body in [(6, head_on), (2, lonely), (2, mismatch)]:
        assert failure(LedgerWorld, p, body) == failure(SimWorld, p, body)


# ---------------------------------------------------- refcoll simulate --ledger-only


def _simulate_json(tmp_path, *args):
    import json

    from click.testing import CliRunner

    from refcoll.cli import main

    out = tmp_path / f"ledger{len(list(tmp_path.iterdir()))}.json"
    res = CliRunner().invoke(main, ["simulate", *map(str, args), "--json", str(out)])
    return res, (json.loads(out.read_text()) if out.exists() else None)


@pytest.mark.parametrize("algorithm", ["ring", "tree", "rabenseifner", "dbtree"])
def test_the_ledger_only_command_prints_the_ledger_the_data_run_prints(tmp_path, algorithm):
    base = ["--algorithm", algorithm, "-p", 12, "--count", 37]
    plain, with_data = _simulate_json(tmp_path, *base)
    quick, without = _simulate_json(tmp_path, *base, "--ledger-only")
    assert plain.exit_code == 0 and quick.exit_code == 0, (plain.output, quick.output)
    assert with_data == without  # the ledger, the cost formula and their agreement


def test_the_ledger_only_command_refuses_an_algorithm_that_splits_in_one_line(tmp_path):
    res, _ = _simulate_json(tmp_path, "--algorithm", "hierarchical", "-p", 8, "--count", 4,
                            "--ranks-per-node", 4, "--ledger-only")
    assert res.exit_code == 2
    assert "cannot split a communicator" in res.output and "Traceback" not in res.output
