"""Bad arguments are refused with a UsageError that says what, where and what to do.

Compressor specs, error feedback without a state, MPI's op objects, and algorithm
options an algorithm does not take. Errors that concern a collective are raised on
every rank (the argument agreement shares them), before any algorithm data moves.
"""

import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import refcoll
import refcoll.compressors
from refcoll import algorithms
from refcoll.compressors import ErrorFeedback, parse
from refcoll.core.errors import UsageError
from refcoll.core.ops import OPS, get_op
from refcoll.transport import SimWorld

P = 4
TIMEOUT = 60.0  # a hang would be the bug; fail it instead of waiting forever


def every_rank(body, p=P):
    """Run ``body(t)`` on ``p`` simulated ranks; return each rank's UsageError (or None)."""

    def caught(t):
        try:
            body(t)
        except UsageError as exc:
            return exc
        return None

    return SimWorld(p, timeout=TIMEOUT).run(caught)


# ---- 1. compressor spec strings -----------------------------------------------------

@pytest.mark.parametrize("spec", ["ef(ef(topk))", "ef(ef(topk:ratio=0.1))", " ef( ef(sign) ) "])
def test_nested_error_feedback_is_refused_saying_why(spec):
    with pytest.raises(UsageError, match="one residual") as info:
        parse(spec)
    assert "ef of ef" in str(info.value) and "ef(ef(" not in str(info.value).split("write")[-1]


def test_nested_error_feedback_is_refused_when_built_directly():
    with pytest.raises(UsageError, match="one residual.*'ef\\(sign:block=0\\)'"):
        ErrorFeedback(ErrorFeedback(parse("sign")))
    with pytest.raises(UsageError, match="wraps a compressor, got NoneType"):
        ErrorFeedback()


def test_a_repeated_parameter_is_refused_naming_the_key():
    with pytest.raises(UsageError, match="parameter 'ratio' is given twice"):
        parse("topk:ratio=0.01,ratio=0.5")
    with pytest.raises(UsageError, match="parameter 'levels' is given twice"):
        parse("ef(qsgd:levels=4,bucket=64, levels=8)")
    assert parse("qsgd:levels=4,bucket=64") == parse("qsgd:bucket=64,levels=4")


@pytest.mark.parametrize("spec,message", [
    ("topk:=3", "parameter '=3' has no name"),
    ("topk:ratio", "parameter 'ratio' has no value.*key=value"),
    ("topk:ratio=0.1,", "empty parameter"),
    ("topk:ratio=0.1,,", "empty parameter"),
    ("topk:", "nothing follows ':'"),
    ("topk:k=3", "no parameter 'k'.*its parameters: ratio"),
    ("qsgd:level=3", "no parameter 'level'.*its parameters: levels, bucket"),
    ("none:x=1", "'none' has no parameter 'x'.*takes no parameters"),
])
def test_malformed_specs_say_what_is_wrong(spec, message):
    with pytest.raises(UsageError, match=message):
        parse(spec)


def test_a_spec_that_is_not_a_string_names_its_type():
    with pytest.raises(UsageError, match="got int"):
        parse(3)


# ---- 2. error feedback needs a state ------------------------------------------------

def test_the_state_class_the_message_names_exists():
    state = refcoll.compressors.CompressorState(seed=1, rank=2)
    assert state.residual is None and parse("ef(topk)").new_state(seed=1, rank=2).seed == 1


@pytest.mark.parametrize("spec", ["ef(topk:ratio=0.5)", "ef(sign)", "ef(powersgd:rank=1)"])
@pytest.mark.parametrize("validate", [True, False])
def test_error_feedback_without_state_is_refused_on_every_rank(spec, validate):
    x = np.linspace(-1, 1, 12, dtype=np.float32)
    errors = every_rank(
        lambda t: refcoll.compressed_allreduce(x, t, compressor=spec, validate=validate))
    for rank, exc in enumerate(errors):
        assert exc is not None, f"rank {rank} accepted {spec} without state="
        assert f"rank {rank}: " in str(exc)
        assert "state=refcoll.compressors.CompressorState(" in str(exc)
        assert "one per tensor" in str(exc)


def test_one_rank_without_state_makes_it_an_error_on_every_rank():
    x = np.ones(10, np.float32)
    spec = "ef(topk:ratio=0.5)"

    def body(t):
        state = None if t.rank == 2 else parse(spec).new_state(seed=0, rank=t.rank)
        refcoll.compressed_allreduce(x, t, compressor=spec, state=state)

    errors = every_rank(body)
    assert all(exc is not None for exc in errors), errors
    assert "rank 2: compressor 'ef(topk:ratio=0.5)'" in str(errors[2])
    for rank in (0, 1, 3):
        assert "rank 2 could not run compressed_allreduce" in str(errors[rank])


def test_error_feedback_with_a_state_keeps_its_residual_across_calls():
    x = np.linspace(-1, 1, 20, dtype=np.float64)
    spec = "ef(topk:ratio=0.1)"

    def body(t):
        state = parse(spec).new_state(seed=0, rank=t.rank)
        first, _ = refcoll.compressed_allreduce(x, t, compressor=spec, state=state)
        kept = state.residual.copy()
        refcoll.compressed_allreduce(x, t, compressor=spec, state=state)
        return first, kept

    for first, kept in SimWorld(2, timeout=TIMEOUT).run(body):
        assert np.count_nonzero(first) == 2 and np.count_nonzero(kept) == 18


def test_compression_without_error_feedback_still_needs_no_state():
    x = np.arange(8, dtype=np.float32)
    out = SimWorld(2, timeout=TIMEOUT).run(
        lambda t: refcoll.compressed_allreduce(x, t, compressor="fp16")[0])
    assert all(np.array_equal(o, 2 * x) for o in out)


@pytest.mark.parametrize("given", [{"compressor": "fp16"}, {"state": None}])
def test_allreduce_takes_no_compressor_and_names_the_call_that_does(given):
    x = np.arange(8, dtype=np.float32)
    errors = every_rank(lambda t: refcoll.allreduce(x, t, **given))
    for rank, exc in enumerate(errors):
        assert isinstance(exc, refcoll.UsageError), f"rank {rank}: {exc!r}"
        assert "call refcoll.compressed_allreduce(x, comm, compressor=" in str(exc)


# ---- 3. ops: MPI's op objects and other non-strings ---------------------------------

@pytest.mark.parametrize("op", [None, 3, np.add, object(), b"sum"])
def test_a_non_string_op_names_its_type_never_an_address(op, monkeypatch):
    monkeypatch.delitem(sys.modules, "mpi4py.MPI", raising=False)
    with pytest.raises(UsageError) as info:
        get_op(op)
    message = str(info.value)
    assert "object at 0x" not in message and "sum, prod, min, max, avg" in message
    assert type(op).__name__ in message
    assert "mpi4py.MPI" not in sys.modules  # get_op never imports mpi4py


def test_op_names_and_op_objects_still_work():
    assert get_op("SUM") is OPS["sum"] and get_op(OPS["max"]) is OPS["max"]
    with pytest.raises(UsageError, match="unknown op 'mean': choose one of sum, prod"):
        get_op("mean")


MPI_OPS_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import refcoll
    from refcoll.core.errors import UsageError
    from refcoll.core.ops import OPS, get_op
    from refcoll.transport import SimWorld
    assert "mpi4py.MPI" not in sys.modules, "importing refcoll imported mpi4py.MPI"
    from mpi4py import MPI

    for mpi_op, name in [(MPI.SUM, "sum"), (MPI.PROD, "prod"), (MPI.MIN, "min"),
                         (MPI.MAX, "max"), (MPI.Op(MPI.MAX), "max")]:
        assert get_op(mpi_op) is OPS[name], (mpi_op, name)
    for mpi_op, name in [(MPI.LAND, "MPI.LAND"), (MPI.BAND, "MPI.BAND"), (MPI.BXOR, "MPI.BXOR"),
                         (MPI.MAXLOC, "MPI.MAXLOC"), (MPI.REPLACE, "MPI.REPLACE"),
                         (MPI.Op.Create(lambda a, b, t: None), "a user-defined MPI.Op")]:
        try:
            get_op(mpi_op)
        except UsageError as exc:
            assert name in str(exc) and "sum, prod, min, max, avg" in str(exc), exc
            assert "object at 0x" not in str(exc), exc
        else:
            raise AssertionError(f"{name} was accepted")

    xs = [np.arange(5, dtype=np.int64) * (r + 1) for r in range(3)]
    res = refcoll.simulate("reduce_scatter", xs, algorithm="ring", op=MPI.SUM)
    assert np.concatenate(res.outputs).tolist() == (6 * xs[0]).tolist()
    res = refcoll.simulate("reduce", xs, algorithm="naive", op=MPI.PROD, root=1)
    assert res.outputs[1].tolist() == (6 * xs[0] * xs[0] * xs[0]).tolist()
    f = np.array([-1.0, -0.5, 0.0, 0.25, 1.5])  # exact in fp16
    out = SimWorld(2).run(
        lambda t: refcoll.compressed_allreduce(f, t, op=MPI.SUM, compressor="fp16")[0])
    assert out[0].tolist() == out[1].tolist() == (2 * f).tolist()
    print("ok")
""")


def test_mpi_predefined_ops_map_to_names_and_others_are_named():
    pytest.importorskip("mpi4py")
    res = subprocess.run([sys.executable, "-c", MPI_OPS_SCRIPT], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr


MPI_ALLREDUCE_SCRIPT = textwrap.dedent("""
    import numpy as np
    import refcoll
    from refcoll.transport import SimWorld
    from mpi4py import MPI

    xs = [np.arange(6, dtype=np.int32) * (r + 1) for r in range(3)]

    def body(t):
        # Twice: the second call runs from what the first one prepared.
        first = refcoll.allreduce(xs[t.rank], t, op=MPI.MAX)
        return first, refcoll.allreduce(xs[t.rank], t, op=MPI.MAX)

    for first, second in SimWorld(3).run(body):
        assert first.tolist() == second.tolist() == (3 * xs[0]).tolist()
    print("ok")
""")


def test_allreduce_takes_mpi_max():
    pytest.importorskip("mpi4py")
    res = subprocess.run([sys.executable, "-c", MPI_ALLREDUCE_SCRIPT], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stdout + res.stderr


# ---- 4. algorithm options an algorithm does not take --------------------------------

def test_the_options_of_each_algorithm_come_from_its_signature():
    assert algorithms.options("ring", "allreduce") == ("direction", "start", "split")
    assert algorithms.options("ring", "allgather") == ()
    assert algorithms.options("tree", "allreduce") == ("segment", "radix", "subtrees", "first",
                                                       "shape")
    assert algorithms.options("tree", "reduce") == ("segment", "radix", "subtrees", "first",
                                                    "shape")  # root is the call's own
    assert algorithms.options("hierarchical", "allreduce") == ("ranks_per_node", "inter",
                                                                   "pipeline", "level")
    assert algorithms.options("switch", "allreduce") == ("radix", "packet", "slots", "mode")
    assert algorithms.options("auto", "allreduce") == ()


def test_check_options_lists_what_the_algorithm_takes():
    algorithms.check_options("tree", "allreduce", {"segment": 4})
    algorithms.check_options("ring", "allreduce", {})
    with pytest.raises(UsageError) as info:
        algorithms.check_options("ring", "allreduce", {"segment": 4}, rank=2)
    assert str(info.value) == (
        "rank 2: algorithm 'ring' does not take the option segment for allreduce: its "
        "allreduce takes direction, start, split; drop it, or choose an algorithm that takes "
        "it: tree, dbtree")
    with pytest.raises(UsageError) as info:
        algorithms.check_options("bruck", "allgather", {"segment": 4}, rank=1)
    assert str(info.value) == (
        "rank 1: algorithm 'bruck' takes no algorithm options for allgather (got segment); "
        "drop it")
    with pytest.raises(UsageError) as info:
        algorithms.check_options("tree", "allreduce", {"segmnt": 4})
    assert str(info.value) == ("algorithm 'tree' does not take the option segmnt for "
                               "allreduce: its allreduce takes segment, radix, subtrees, first, "
                               "shape; drop it")
    with pytest.raises(UsageError, match="the options a, b for allreduce: its allreduce takes "
                                         "ranks_per_node, inter, pipeline, level; drop them$"):
        algorithms.check_options("hierarchical", "allreduce", {"b": 1, "a": 2, "inter": "ring"})
    with pytest.raises(UsageError, match="'auto' takes no algorithm options for broadcast "
                                         r"\(got segment\); name an algorithm that takes it "
                                         "instead: tree"):
        algorithms.check_options("auto", "broadcast", {"segment": 4})
    with pytest.raises(UsageError, match="unknown algorithm 'rung'"):
        algorithms.check_options("rung", "allreduce", {"segment": 4})


CALLS = {
    "allreduce": lambda x, t, **kw: refcoll.allreduce(x, t, algorithm="ring", **kw),
    "auto": lambda x, t, **kw: refcoll.allreduce(x, t, algorithm="auto", **kw),
    "reduce_scatter": lambda x, t, **kw: refcoll.reduce_scatter(x, t, algorithm="ring", **kw),
    "allgather": lambda x, t, **kw: refcoll.allgather(x, t, algorithm="naive", **kw),
    "broadcast": lambda x, t, **kw: refcoll.broadcast(x, 1, t, algorithm="naive", **kw),
    "reduce": lambda x, t, **kw: refcoll.reduce(x, 1, t, algorithm="tree", **kw),
    "compressed": lambda x, t, **kw: refcoll.compressed_allreduce(
        x, t, algorithm="ring", compressor="topk:ratio=0.5", **kw),
}


@pytest.mark.parametrize("call", list(CALLS))
def test_an_option_the_algorithm_does_not_take_is_a_usage_error_before_any_data_moves(call):
    x = np.arange(8, dtype=np.float32)
    world = SimWorld(P, timeout=TIMEOUT)

    def body(t):
        try:
            CALLS[call](x, t, validate=False, bogus=4)
        except UsageError as exc:
            return exc
        return None

    errors = world.run(body)
    for rank, exc in enumerate(errors):
        assert exc is not None, f"rank {rank} took bogus=4"
        assert f"rank {rank}: algorithm" in str(exc) and "bogus" in str(exc)
        assert ("takes no algorithm options" in str(exc)
                or "does not take the option bogus" in str(exc)), exc
    assert world.ledger.messages == []  # refused before the algorithm sent anything


def test_one_rank_with_a_bad_option_makes_it_an_error_on_every_rank():
    x = np.arange(8, dtype=np.float32)
    errors = every_rank(lambda t: refcoll.allreduce(x, t, algorithm="ring",
                                                    **({"segment": 4} if t.rank == 2 else {})))
    assert "rank 2: algorithm 'ring' does not take the option segment for allreduce" in \
        str(errors[2])
    assert "choose an algorithm that takes it: tree, dbtree" in str(errors[2])
    for rank in (0, 1, 3):
        assert "rank 2 could not run allreduce: UsageError: rank 2: algorithm 'ring'" in str(
            errors[rank])


def test_simulate_refuses_an_option_the_algorithm_does_not_take():
    xs = [np.arange(5, dtype=np.float64) for _ in range(3)]
    with pytest.raises(UsageError, match="'ring' does not take the option segment"):
        refcoll.simulate("allreduce", xs, algorithm="ring", segment=4)
    ok = refcoll.simulate("allreduce", xs, algorithm="tree", segment=2)
    assert np.array_equal(ok.outputs[0], 3 * xs[0])


@pytest.mark.parametrize("comm", ["world", 0, object()])
def test_a_comm_that_is_no_communicator_is_a_clear_type_error(comm):
    with pytest.raises(TypeError, match=r"comm= must be an mpi4py intracommunicator \(such as "
                                        r"MPI.COMM_WORLD\), a torch.distributed process group, a "
                                        r"refcoll Transport, or None"):
        refcoll.allreduce(np.ones(3), comm)


@pytest.mark.parametrize("collective, algorithm", [("allreduce", "ring"), ("allreduce", "auto"),
                                                   ("reduce_scatter", "ring"),
                                                   ("reduce", "tree")])
def test_op_none_on_a_reduction_is_a_usage_error_on_every_rank(collective, algorithm):
    """Once a TypeError from inside the algorithm (its op argument missing)."""
    with pytest.raises(UsageError, match=f"{collective} reduces: give op="):
        refcoll.simulate(collective, [np.ones(5, np.float32)] * 3, algorithm=algorithm,
                         op=None, **({"root": 0} if collective == "reduce" else {}))


def test_equal_options_of_other_types_are_another_call_in_the_simulator_too():
    """The simulated ranks share the signatures' cache: ``segment=2.0`` on one rank met the
    signature of ``segment=2``, and the ranks deadlocked rather than disagree."""
    from refcoll.core.errors import MismatchError

    for odd in (2.0, True):
        with pytest.raises(MismatchError, match=re.escape(f"('segment', {odd!r})")):
            SimWorld(3).run(lambda t, odd=odd: refcoll.allreduce(
                np.arange(8, dtype=np.float32), t, algorithm="tree",
                segment=odd if t.rank == 1 else 2))


@pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")  # (np.matrix's own)
def test_out_of_an_ndarray_subclass_is_written_as_its_memory():
    """np.matrix stays 2-D when flattened: the ring then met a message of the wrong size and
    blamed the ranks' counts; out= is now written through a plain view of its memory."""
    xs = [np.arange(6, dtype=np.float32) + r for r in range(3)]

    def run(t):
        out = np.asmatrix(np.zeros(6, np.float32))
        return refcoll.allreduce(xs[t.rank], t, algorithm="ring", out=out)

    for got in SimWorld(3).run(run):
        assert isinstance(got, np.matrix) and got.tolist() == [sum(xs).tolist()]


@pytest.mark.parametrize("call, needle", [
    (lambda t: refcoll.allgather(np.ones(4, np.float32), t, op="sum"), "allgather takes no op"),
    (lambda t: refcoll.allreduce(np.ones(4, np.float32), t, root=1), "allreduce takes no root"),
])
def test_a_collectives_argument_it_lacks_is_named_as_the_collectives(call, needle):
    """Not 'algorithm ring takes no algorithm options (got op)': op and root are not options."""
    with pytest.raises(UsageError, match=needle):
        SimWorld(2).run(call)
