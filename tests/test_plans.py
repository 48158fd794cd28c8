"""Persistent collectives (``allreduce_init`` and its kin): agreed once, started many times.

Every start gives, bit for bit, the blocking call's and the simulator's result for what ``x``
holds then. A plan that is no longer what the ranks agreed on (freed, started twice, a buffer
changed or swapped, another communicator) is refused: on every rank when it validates, on the
rank at fault alone when not. Under ``mpiexec``: the MPI half (tests/mpi/test_plans_mpi.py),
and 100,000 plans made and freed with flat memory and no persistent request left.
"""

import contextlib
import json
import re
import textwrap
import threading
import warnings

import ml_dtypes
import numpy as np
import pytest
from conftest import run_script

import refcoll
from refcoll import SimWorld
from refcoll.core.bits import same_bits
from refcoll.core.chunking import chunk_bounds
from refcoll.core.errors import CollectiveTimeout, MismatchError, PeerFailure, UsageError

TIMEOUT = 60.0  # a hang would be the bug: the simulator names it instead of waiting forever
ROOTED = ("broadcast", "reduce")
DTYPES = [np.float32, np.float64, np.int32, ml_dtypes.bfloat16]
OPS = ["sum", "prod", "min", "max", "avg"]

# (collective, algorithm, keywords); root -1 is the last rank.
CASES = [("allreduce", "ring", {"op": "sum"}), ("allreduce", "rabenseifner", {"op": "avg"}),
         ("allreduce", "recursive_doubling", {"op": "prod"}), ("allreduce", "tree", {"op": "max"}),
         ("allreduce", "dbtree", {"op": "sum"}), ("allreduce", "naive", {"op": "min"}),
         ("allreduce", "auto", {"op": "sum"}),
         ("reduce_scatter", "ring", {"op": "sum"}), ("reduce_scatter", "bruck", {"op": "prod"}),
         ("reduce_scatter", "rabenseifner", {"op": "avg"}),
         ("reduce_scatter", "naive", {"op": "max"}),
         ("allgather", "ring", {}), ("allgather", "bruck", {}), ("allgather", "rabenseifner", {}),
         ("broadcast", "naive", {"root": -1}), ("broadcast", "tree", {"root": 0}),
         ("reduce", "naive", {"op": "sum", "root": 0}),
         ("reduce", "tree", {"op": "min", "root": -1})]


def _id(case) -> str:
    collective, algorithm, kw = case
    words = [f"root {'last' if v < 0 else v}" if k == "root" else v for k, v in kw.items()]
    return " ".join([collective, algorithm, *words])


def _values(shape, dtype, rank: int, start: int) -> np.ndarray:
    """Return values that differ per element, rank and start (small integers for int32)."""
    rng = np.random.default_rng([rank, start, 11])
    if np.dtype(dtype).kind == "i":
        return rng.integers(-9, 10, size=shape).astype(dtype)
    return (rng.standard_normal(shape) * 4).astype(dtype)


def _call(name, collective, x, t, **kw):
    fn = getattr(refcoll, name)
    return fn(x, kw.pop("root", 0), t, **kw) if collective in ROOTED else fn(x, t, **kw)


def _make(collective, x, t, **kw):
    return _call(f"{collective}_init", collective, x, t, **kw)


def _blocking(collective, x, t, **kw):
    return _call(collective, collective, x, t, **kw)


def _same(a, b) -> bool:
    return a is None and b is None or (a is not None and b is not None and same_bits(a, b))


def _copy(a):
    return None if a is None else a.copy()


@contextlib.contextmanager
def _changed(arr, attr: str, value):
    """Change an array's shape or dtype in place (as a user's ``x.shape = ...``), then back."""
    old = getattr(arr, attr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        setattr(arr, attr, value)
        try:
            yield
        finally:
            setattr(arr, attr, old)


def _caught(body):
    """Return ``body``'s result and error (the simulator's run raises a rank's error)."""
    def rank(t):
        try:
            return body(t), None
        except (UsageError, MismatchError, PeerFailure, TypeError, ValueError) as exc:
            return None, exc
    return rank


# ---- 1. every start gives the blocking call's bits ------------------------------------

def _starts(p, collective, algorithm, configs, starts=3):
    """Start a plan per ``(shape, dtype, keywords)`` of ``configs`` ``starts`` times, new values in
    ``x`` each time, each result held to the blocking call's on them: start 0 a call, 1 a
    non-blocking start, 2 one passed the plan's own buffers and communicator (accepted).
    Returns, per rank, per start of each config in turn, (result, input)."""
    def rank(t):
        seen = []
        for shape, dtype, kw in configs:
            x = _values(shape, dtype, t.rank, 0)
            with _make(collective, x, t, algorithm=algorithm, **kw) as plan:
                assert algorithm == "auto" or plan.algorithm == algorithm
                for start in range(starts):
                    x[...] = _values(shape, dtype, t.rank, start)
                    before = x.copy()
                    result = _copy(plan() if start == 0 else plan.start().wait() if start == 1
                                   else plan.start(x=x, out=plan.out, comm=t).wait())
                    assert x.tobytes() == before.tobytes(), "a start changed its input"
                    want = _blocking(collective, before, t, algorithm=algorithm, **kw)
                    assert _same(result, want), f"{shape} {np.dtype(dtype)} {kw}, start {start}"
                    seen.append((result, before))
        return seen

    return SimWorld(p, timeout=TIMEOUT).run(rank)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_every_start_gives_the_blocking_calls_and_the_simulators_bits_for_what_x_holds(p, case):
    collective, algorithm, kw = case
    kw = {k: v % p if k == "root" else v for k, v in kw.items()}  # root -1: the last rank
    ranks = _starts(p, collective, algorithm, [((3, 7), np.float32, kw)])
    for start in range(3):
        inputs = [ranks[r][start][1] for r in range(p)]
        oracle = refcoll.simulate(collective, inputs, algorithm=algorithm, **kw).outputs
        for r in range(p):
            assert _same(ranks[r][start][0], oracle[r]), f"start {start}, rank {r}"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("collective,algorithm", [
    ("allreduce", "ring"), ("allreduce", "recursive_doubling"),
    ("reduce_scatter", "ring"), ("reduce", "tree")])
def test_every_op_and_dtype_gives_the_blocking_calls_bits(collective, algorithm, dtype):
    _starts(3, collective, algorithm, [(11, dtype, {"op": op}) for op in OPS], starts=2)


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("collective,algorithm", [
    ("allreduce", "ring"), ("allreduce", "rabenseifner"),
    ("reduce_scatter", "ring"), ("allgather", "bruck"),
    ("broadcast", "tree")])
def test_plans_of_every_size_give_the_blocking_calls_bits(p, collective, algorithm):
    sizes = (0, 1, p - 1, p, p + 1, 1001)
    _starts(p, collective, algorithm, [(n, np.float64, {}) for n in sizes], starts=2)


# ---- 2. what a plan holds ----------------------------------------------------------

@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_a_plan_holds_x_and_a_result_buffer_of_the_blocking_calls_shape(p):
    shape = (5, 3)  # 15 elements: uneven chunks for p = 2 and 4

    def rank(t):
        x = _values(shape, np.float64, t.rank, 0)
        lo, hi = chunk_bounds(15, p)[t.rank]
        expected = {"allreduce": shape, "reduce_scatter": (hi - lo,), "allgather": (p, *shape),
                    "broadcast": shape, "reduce": shape if t.rank == p - 1 else None}
        for collective, want in expected.items():
            kw = {"root": p - 1} if collective in ROOTED else {}
            with _make(collective, x, t, **kw) as plan:
                assert plan.x is x, collective
                if want is None:
                    assert plan.out is None and plan() is None, collective
                    continue
                assert plan.out.shape == want and plan.out.dtype == x.dtype, collective
                assert plan() is plan.out, collective

    SimWorld(p, timeout=TIMEOUT).run(rank)


def test_a_plan_given_out_writes_every_start_there_in_place_too():
    def rank(t):
        flat, rows = _values(10, np.float32, t.rank, 0), np.empty((3, 10), np.float32)
        lo, hi = chunk_bounds(10, 3)[t.rank]
        for collective, x, kw in [("allreduce", flat, {"out": flat}),
                                  ("reduce_scatter", flat, {"out": flat[lo:hi]}),
                                  ("allgather", rows[t.rank], {"out": rows}),
                                  ("broadcast", flat, {"out": flat, "root": 1}),
                                  ("allreduce", flat,
                                   {"out": np.empty(10, np.float32), "op": "max"})]:
            with _make(collective, x, t, **kw) as plan:
                assert plan.out is kw["out"] and plan.x is x, collective
                for start in range(3):
                    x[...] = _values(10, np.float32, t.rank, start)
                    before = x.copy()
                    result = plan.start().wait() if start == 1 else plan(x=x, out=kw["out"], comm=t)
                    assert result is kw["out"], collective
                    kept = {k: v for k, v in kw.items() if k != "out"}
                    assert _same(result, _blocking(collective, before, t, **kept)), (
                        collective, start)

    SimWorld(3, timeout=TIMEOUT).run(rank)


@pytest.mark.parametrize("collective",
                         ["allreduce", "reduce_scatter", "allgather", "broadcast", "reduce"])
def test_auto_resolves_once_at_init_to_one_algorithm_on_every_rank(collective):
    def rank(t):
        x = _values(64, np.float32, t.rank, 0)
        with _make(collective, x, t, algorithm="auto") as plan:
            name = plan.algorithm
            assert name in refcoll.REGISTRY and not refcoll.REGISTRY[name].chooses, name
            got = _copy(plan())
        assert _same(got, _blocking(collective, x, t, algorithm=name))
        assert _same(got, _blocking(collective, x, t, algorithm="auto"))
        return name

    assert len(set(SimWorld(3, timeout=TIMEOUT).run(rank))) == 1


def test_a_free_refused_inside_a_done_callback_leaves_the_running_plan_whole():
    # free() waits for a started run; from a done callback of the same engine that wait is
    # refused, and free() swallowed the refusal and freed the plan under its queued run:
    # the run then failed unseen on the progress thread, and the peer waited for ever.
    def rank(t):
        plan = refcoll.allreduce_init(np.full(4, t.rank + 1.0), t)
        first = refcoll.iallreduce(np.ones(2), t)
        plan.start()
        refused = []
        if t.rank == 0:
            def free(_):
                try:
                    plan.free()
                except UsageError as exc:
                    refused.append(str(exc))
            first.add_done_callback(free)
        first.wait()
        result = plan.wait().copy()
        plan.free()
        return refused, result.tolist(), plan.freed

    for refused, result, freed in SimWorld(2, timeout=TIMEOUT).run(rank):
        assert result == [3.0] * 4 and freed
        assert all("would wait for itself" in text for text in refused)


def test_a_plan_used_as_a_context_is_freed_on_exit_even_by_an_exception():
    def rank(t):
        x = np.arange(4.0)
        with refcoll.allreduce_init(x, t) as plan:
            assert not plan.freed
            np.testing.assert_array_equal(plan(), 2 * x)
        assert plan.freed
        with pytest.raises(KeyError):
            with refcoll.broadcast_init(x, 0, t) as failing:
                raise KeyError("the body failed")
        assert failing.freed
        explicit = refcoll.allgather_init(x, t)
        explicit.free()
        assert explicit.freed

    SimWorld(2, timeout=TIMEOUT).run(rank)


# ---- 3. non-blocking starts ---------------------------------------------------------

@pytest.mark.parametrize("p", [2, 3])
def test_a_start_runs_in_issue_order_among_nonblocking_and_blocking_calls(p):
    # Rank 0 issues everything at once; the others wait for each call before the next. A start
    # that jumped or lagged its place would pair calls of different counts or ops.
    def rank(t):
        x = np.arange(8, dtype=np.float64) * (t.rank + 1)
        y = np.arange(3, dtype=np.float64) + 10 * t.rank
        plan = refcoll.allreduce_init(x, t)
        if t.rank == 0:
            first = refcoll.iallreduce(y, t, op="max")
            plan.start()
            between = refcoll.allreduce(y, t, op="min")  # blocking: queued behind the start
            last = refcoll.iallgather(y, t)
            return first.wait(), plan.wait().copy(), between, last.wait()
        first = refcoll.iallreduce(y, t, op="max").wait()
        return (first, plan().copy(), refcoll.allreduce(y, t, op="min"),
                refcoll.iallgather(y, t).wait())

    ranks = SimWorld(p, timeout=TIMEOUT).run(rank)
    for results in ranks[1:]:
        assert all(same_bits(a, b) for a, b in zip(ranks[0], results))
    np.testing.assert_array_equal(ranks[0][1], np.arange(8) * sum(range(1, p + 1)))
    np.testing.assert_array_equal(ranks[0][2], np.arange(3.0))


def test_a_started_plan_is_incomplete_until_its_peers_start_it():
    release = threading.Event()

    def rank(t):
        x = np.full(5, t.rank + 1.0)
        plan = refcoll.allreduce_init(x, t)
        if t.rank == 1:
            assert release.wait(TIMEOUT)  # starts only after rank 0 has looked
            return plan().copy()
        try:
            started = plan.start()
            assert plan.test() is False  # rank 1 has not started: it waits for the event
            with pytest.raises(CollectiveTimeout):
                plan.wait(timeout=0.05)
        finally:
            release.set()  # whatever failed here, rank 1 must not wait for the event in vain
        out = plan.wait().copy()
        assert plan.test() is True and started is plan
        return out

    a, b = SimWorld(2, timeout=TIMEOUT).run(rank)
    assert same_bits(a, b) and a.tolist() == [3.0] * 5


# ---- 4. refusals --------------------------------------------------------------------

def _changed_run(which, attr, value):
    def fault(plan, x, other):
        with _changed(x if which == "x" else plan.out, attr, value):
            plan()
    return fault


# (name, the faulty run on the rank at fault, what its message names)
FAULTS = [("freed", lambda plan, x, other: (plan.free(), plan()), "freed"),
          ("x reshaped in place", _changed_run("x", "shape", (3, 4)), r"\bx\b.*\(3, 4\)"),
          ("x retyped in place", _changed_run("x", "dtype", np.int32), r"\bx\b.*int32"),
          ("out reshaped in place", _changed_run("out", "shape", (4, 3)), r"\bout\b.*\(4, 3\)"),
          ("out retyped in place", _changed_run("out", "dtype", np.int32), r"\bout\b.*int32"),
          ("another x", lambda plan, x, other: plan(x=x.copy()), r"\bx\b"),
          ("x in another shape", lambda plan, x, other: plan(x=x.reshape(3, 4)), r"\bx\b"),
          ("x as another dtype", lambda plan, x, other: plan(x=x.view(np.int32)), r"\bx\b"),
          ("another x to start", lambda plan, x, other: plan.start(x=x.copy()).wait(), r"\bx\b"),
          ("another out", lambda plan, x, other: plan(out=plan.out.copy()), r"\bout\b"),
          ("another communicator", lambda plan, x, other: plan(comm=other), "comm")]
BAD = 1  # the rank at fault, of 3


@pytest.mark.parametrize("fault", FAULTS, ids=[f[0] for f in FAULTS])
def test_a_refused_start_is_raised_on_every_rank_in_that_start(fault):
    name, run_fault, names = fault

    def rank(t):
        other = t.split(0, t.rank) if name == "another communicator" else None
        x = _values(12, np.float32, t.rank, 0)
        plan = refcoll.allreduce_init(x, t)
        plan()  # a good start first: the plan is refused when it is reused, not only new
        _, error = _caught(lambda t: run_fault(plan, x, other) if t.rank == BAD else plan())(t)
        return error, _caught(lambda t: refcoll.allreduce(np.ones(3), t))(t)

    ranks = SimWorld(3, timeout=TIMEOUT).run(rank)
    errors = [error for error, _ in ranks]
    # The rank at fault is refused; it revokes the communicator, so its peers, already in the
    # run, raise in that run, naming it and the reason (not at their deadline).
    assert isinstance(errors[BAD], UsageError) and re.search(names, str(errors[BAD])), errors
    for r, e in enumerate(errors):
        if r != BAD:
            assert isinstance(e, PeerFailure), errors
            assert f"rank {BAD} revoked the communicator" in str(e), e
            assert re.search(names, str(e)), e
    for r, (_, (after, error)) in enumerate(ranks):  # revoked: every later call is refused
        assert after is None and isinstance(error, PeerFailure), f"rank {r}: {error}"
        assert "revoked" in str(error), error


@pytest.mark.parametrize("fault", FAULTS, ids=[f[0] for f in FAULTS])
def test_without_validation_only_the_rank_at_fault_raises_at_once(fault):
    # Its peers make no call meanwhile: a refusal that waited on them would deadlock.
    name, run_fault, names = fault

    def rank(t):
        other = t.split(0, t.rank) if name == "another communicator" else None
        plan = refcoll.allreduce_init(_values(12, np.float32, t.rank, 0), t, validate=False)
        plan()
        if t.rank == BAD:
            with pytest.raises(UsageError, match=names):
                run_fault(plan, plan.x, other)
        return True

    assert SimWorld(3, timeout=TIMEOUT).run(rank) == [True] * 3


@pytest.mark.parametrize("fault",
                         [f for f in FAULTS if f[0] in ("another x", "x reshaped in place")],
                         ids=lambda f: f[0])
def test_without_validation_a_rank_that_retries_a_refused_start_meets_its_peers_start(fault):
    # The peers start once; the rank at fault is refused, then starts right: one start each.
    name, run_fault, names = fault

    def rank(t):
        x = _values(12, np.float32, t.rank, 0)
        plan = refcoll.allreduce_init(x, t, validate=False)
        if t.rank == BAD:
            with pytest.raises(UsageError, match=names):
                run_fault(plan, x, None)
        return plan().copy(), refcoll.allreduce(x, t, validate=False)

    for r, (got, want) in enumerate(SimWorld(3, timeout=TIMEOUT).run(rank)):
        assert _same(got, want), f"rank {r}"


@pytest.mark.parametrize("validate", [True, False])
def test_starting_a_started_plan_is_refused_and_the_first_start_still_completes(validate):
    # Validated, every rank starts twice; unvalidated, the rank at fault alone does.
    def rank(t):
        x = _values(12, np.float32, t.rank, 0)
        plan = refcoll.allreduce_init(x, t, validate=validate)
        plan.start()
        if validate or t.rank == BAD:
            with pytest.raises(UsageError, match="start"):
                plan.start()
        return plan.wait().copy(), refcoll.allreduce(x, t)

    for r, (got, want) in enumerate(SimWorld(3, timeout=TIMEOUT).run(rank)):
        assert _same(got, want), f"rank {r}"


# ---- 5. errors at init ---------------------------------------------------------------

# (collective, the field that differs, its value on ranks 0 and 1, on rank 2)
DISAGREEMENTS = [("allreduce", "count", 10, 11), ("reduce_scatter", "count", 10, 12),
                 ("allgather", "count", 10, 9), ("broadcast", "count", 10, 11),
                 ("reduce", "count", 10, 11), ("allreduce", "op", "sum", "max"),
                 ("reduce", "op", "min", "avg"), ("allreduce", "algorithm", "ring", "tree"),
                 ("broadcast", "root", 0, 1), ("allreduce", "dtype", "float32", "float64")]


@pytest.mark.parametrize("case", DISAGREEMENTS, ids=lambda c: f"{c[0]} {c[1]}")
def test_ranks_that_disagree_at_init_get_a_mismatch_on_every_rank(case):
    collective, field, common, last = case

    def rank(t):
        value = last if t.rank == 2 else common
        x = np.ones(value if field == "count" else 10, value if field == "dtype" else np.float32)
        _make(collective, x, t, **({} if field in ("count", "dtype") else {field: value}))

    errors = [e for _, e in SimWorld(3, timeout=TIMEOUT).run(_caught(rank))]
    assert all(isinstance(e, MismatchError) for e in errors), errors
    assert all(f"{field}: rank 0 has {common}, rank 2 has {last}" in str(e) for e in errors), errors


# The bad keywords of a collective that its blocking call refuses too, by name.
BAD_ARGUMENTS = {
    "unknown algorithm": ("allreduce", {"algorithm": "nope"}),
    "algorithm without the collective": ("allgather", {"algorithm": "tree"}),
    "unknown op": ("allreduce", {"op": "mean"}),
    "unknown op of reduce": ("reduce", {"op": "median"}),
    "out of another dtype": ("allreduce", {"out": np.empty(10, np.float64)}),
    "out of another size": ("allreduce", {"out": np.empty(11, np.float32)}),
    "out not an array": ("allreduce", {"out": [0.0] * 10}),
    "out not a chunk": ("reduce_scatter", {"out": np.empty(10, np.float32)}),
    "out not p rows": ("allgather", {"out": np.empty(10, np.float32)}),
    "unknown option": ("allreduce", {"nosuch": 1}),
    "root past the last rank": ("broadcast", {"root": 3}),
    "negative root": ("reduce", {"root": -1})}


@pytest.mark.parametrize("everywhere", [False, True], ids=["on one rank", "on every rank"])
@pytest.mark.parametrize("case", BAD_ARGUMENTS)
def test_bad_arguments_at_init_raise_the_blocking_calls_errors_on_every_rank(case, everywhere):
    collective, bad = BAD_ARGUMENTS[case]

    def rank(fn):
        def body(t):
            kw = dict(bad) if everywhere or t.rank == BAD else {}
            if isinstance(kw.get("out"), np.ndarray):
                kw["out"] = kw["out"].copy()
            fn(collective, np.ones(10, np.float32), t, **kw)
        return _caught(body)

    plan = [e for _, e in SimWorld(3, timeout=TIMEOUT).run(rank(_make))]
    blocking = [e for _, e in SimWorld(3, timeout=TIMEOUT).run(rank(_blocking))]
    assert all(e is not None for e in blocking)  # the case is a bad argument for the blocking call
    assert [type(e) for e in plan] == [type(e) for e in blocking], plan
    assert str(plan[BAD]) == str(blocking[BAD])


# ---- 6. under mpiexec -------------------------------------------------------------------

# The MPI half (tests/mpi/test_plans_mpi.py) as one job at 2 processes: test_mpi.py runs it,
# with the rest of tests/mpi, at 3 (and at 2 with -m slow).
SUITE = ("import sys, pytest\n"
         "sys.exit(pytest.main(['--with-mpi', '-q', '-p', 'no:cacheprovider', "
         "'tests/mpi/test_plans_mpi.py']))\n")


@pytest.mark.parametrize("p", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_the_mpi_half_passes_under_mpiexec(tmp_path, p):
    res = run_script(tmp_path, p, SUITE, env={"REFCOLL_TIMEOUT": "60"})
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    assert " passed" in res.stdout and " failed" not in res.stdout, res.stdout[-3000:]
    assert "persistent request" not in res.stderr  # every plan's requests were freed


MANY = textwrap.dedent("""
    import json, resource
    import numpy as np
    from mpi4py import MPI
    import refcoll

    comm = MPI.COMM_WORLD
    t = refcoll.as_transport(comm)
    x = np.arange(4, dtype=np.float32)
    makers = [lambda: refcoll.allreduce_init(x, comm), lambda: refcoll.reduce_scatter_init(x, comm),
              lambda: refcoll.allgather_init(x, comm), lambda: refcoll.broadcast_init(x, 0, comm),
              lambda: refcoll.reduce_init(x, 0, comm, op="max")]
    for make in makers:  # once each first: what the transport keeps for good is made here
        with make() as plan:
            plan()
    record = {"kept": len(t._persistent)}
    with makers[0]() as plan:
        plan()
        record["alive"] = len(t._persistent)  # a live plan's recorded exchanges
    for i in range(1, 100_001):
        plan = makers[i % 5]()
        if i % 50 < 5:  # one plan of each kind in fifty is run too
            plan()
        plan.free()
        if i in (10_000, 100_000):  # peak resident memory (KiB) and the requests left
            record[i] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, len(t._persistent))
    records = comm.gather(record)
    if comm.rank == 0:
        print(json.dumps(records), flush=True)
""")


def test_making_and_freeing_100_000_plans_keeps_memory_flat_and_leaves_no_persistent_request(
        tmp_path):
    # About 6 s on two cores: 100,000 plans of the five kinds, one in ten of them run.
    res = run_script(tmp_path, 2, MANY, env={"REFCOLL_TIMEOUT": "60"})
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    for rank, record in enumerate(json.loads(res.stdout.splitlines()[-1])):
        assert record["alive"] > record["kept"], record  # else no request was there to leak
        (start, at_start), (end, at_end) = record["10000"], record["100000"]
        assert end - start < 20 * 1024, f"rank {rank}: memory grew {(end - start) / 1024:.1f} MiB"
        assert at_start == at_end == record["kept"], f"rank {rank}: persistent requests {record}"
    assert "persistent request" not in res.stderr


def test_plans_keep_half_the_tag_space_up_to_16384_slots_and_the_rest_is_the_calls():
    """The tag slots that 16 epochs of 1,024 plan slots held are one pool now (an epoch
    moved only after a failed agreement of a kept plan, and no plan is kept): a plan's
    tags are its own until 16,384 plans, and MPI's minimum of 32 slots still runs."""
    from refcoll.transport.base import TAGS_PER_CALL
    from refcoll.transport.persistent import PLAN_SLOTS, plan_slots

    assert PLAN_SLOTS == 16384
    minimum = (32767 + 1) // TAGS_PER_CALL - 1  # MPI's least MPI_TAG_UB, less the notices'
    assert plan_slots(minimum) == 15 and minimum - plan_slots(minimum) == 16
    mpich = (536870911 + 1) // TAGS_PER_CALL - 1  # MPICH 5's MPI_TAG_UB
    assert plan_slots(mpich) == PLAN_SLOTS and mpich - PLAN_SLOTS > PLAN_SLOTS
