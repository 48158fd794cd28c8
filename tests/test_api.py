import ml_dtypes
import numpy as np
import pytest

import refcoll
from refcoll.core.errors import UsageError
from refcoll.transport import SimWorld
from refcoll.verify.oracle import fold


def run(p, fn):
    return SimWorld(p).run(fn)


@pytest.mark.parametrize("algorithm", ["naive", "ring"])
def test_multidimensional_input_is_reduced_elementwise_and_keeps_its_shape(algorithm):
    xs = [np.arange(12, dtype=np.int32).reshape(3, 4) * (r + 1) for r in range(3)]
    out = run(3, lambda t: refcoll.allreduce(xs[t.rank], t, algorithm=algorithm))
    for o in out:
        assert o.shape == (3, 4)
        assert np.array_equal(o, xs[0] * 6)


def test_non_contiguous_and_read_only_inputs_work_and_are_not_modified():
    base = [np.arange(20, dtype=np.float64).reshape(4, 5) + r for r in range(2)]
    views = [b.T for b in base]  # Fortran-ordered views
    for v in views:
        v.flags.writeable = False
    out = run(2, lambda t: refcoll.allreduce(views[t.rank], t))
    assert np.array_equal(out[0], views[0] + views[1])
    assert np.array_equal(base[0], np.arange(20.0).reshape(4, 5))


def test_out_and_in_place():
    xs = [np.arange(6, dtype=np.int64) + r for r in range(3)]
    bufs = [x.copy() for x in xs]

    def body(t):
        res = refcoll.allreduce(bufs[t.rank], t, out=bufs[t.rank])
        return res is bufs[t.rank]

    assert all(run(3, body))
    for b in bufs:
        assert np.array_equal(b, fold("sum", xs))


def test_bad_out_buffer_is_rejected_with_the_rank():
    def body(t):
        refcoll.allreduce(np.zeros(4), t, out=np.zeros(3))

    with pytest.raises(ValueError, match="rank 0: out= has 3 elements"):
        run(1, body)


@pytest.mark.parametrize("kwargs,match", [
    ({"algorithm": "rung"}, "unknown algorithm 'rung'"),
    ({"op": "mean"}, "unknown op 'mean'"),
])
def test_unknown_names_raise_usage_errors(kwargs, match):
    with pytest.raises(UsageError, match=match):
        run(1, lambda t: refcoll.allreduce(np.zeros(2), t, **kwargs))


def test_unsupported_dtype_and_missing_collective():
    with pytest.raises(UsageError, match="unsupported dtype"):
        run(1, lambda t: refcoll.allreduce(np.zeros(2, dtype=np.complex128), t))
    with pytest.raises(UsageError, match="does not implement broadcast"):
        run(1, lambda t: refcoll.broadcast(np.zeros(2), 0, t, algorithm="ring"))
    with pytest.raises(UsageError, match="float8"):
        run(1, lambda t: refcoll.allreduce(np.zeros(2, dtype=ml_dtypes.float8_e5m2), t, op="prod"))


def test_non_native_byte_order_is_a_clear_type_error():
    x = np.zeros(3, dtype=np.dtype(np.float32).newbyteorder())
    with pytest.raises(TypeError, match="non-native byte order"):
        run(1, lambda t: refcoll.allreduce(x, t))


def test_reduce_scatter_allgather_broadcast_reduce_shapes():
    xs = [np.arange(7, dtype=np.int16) * (r + 1) for r in range(3)]
    total = fold("sum", xs)
    rs = run(3, lambda t: refcoll.reduce_scatter(xs[t.rank], t))
    assert [o.tolist() for o in rs] == [total[:3].tolist(), total[3:5].tolist(), total[5:].tolist()]
    ag = run(3, lambda t: refcoll.allgather(xs[t.rank], t))
    assert ag[1].shape == (3, 7) and np.array_equal(ag[2], np.stack(xs))
    bc = run(3, lambda t: refcoll.broadcast(xs[t.rank], 2, t))
    assert all(np.array_equal(o, xs[2]) for o in bc)
    rd = run(3, lambda t: refcoll.reduce(xs[t.rank], 1, t, op="max"))
    assert rd[0] is None and rd[2] is None and np.array_equal(rd[1], fold("max", xs))


def test_bad_root():
    with pytest.raises(UsageError, match="root 3 is not a rank"):
        run(2, lambda t: refcoll.broadcast(np.zeros(1), 3, t))


def test_simulate_returns_outputs_and_ledger():
    xs = [np.full(5, r, dtype=np.float32) for r in range(4)]
    res = refcoll.simulate("allreduce", xs, algorithm="ring", op="avg")
    assert len(res.outputs) == 4
    assert np.array_equal(res.outputs[3], np.full(5, 1.5, dtype=np.float32))
    assert res.ledger.total_messages == 2 * 4 * 3
    with pytest.raises(UsageError, match="unknown collective"):
        refcoll.simulate("alltoall", xs, algorithm="ring")


def test_partially_overlapping_buffers_are_refused():
    buf = np.arange(20, dtype=np.float64)
    with pytest.raises(ValueError, match="overlap"):
        run(1, lambda t: refcoll.allreduce(buf[2:12], t, out=buf[5:15]))
    row = np.zeros((2, 4))
    with pytest.raises(ValueError, match="overlap"):
        run(2, lambda t: refcoll.allgather(
            row[t.rank][:4].copy() if t.rank else row.reshape(-1)[1:5], t, out=row))


def test_avg_at_large_p_divides_once_and_never_overflows():
    from refcoll.core.ops import OPS

    ints = np.array([100, -100, 5], dtype=np.int8)
    OPS["avg"].finalize(ints, 200)
    assert ints.tolist() == [0, 0, 0]
    bf = np.array([772.0], dtype=ml_dtypes.bfloat16)
    OPS["avg"].finalize(bf, 257)
    assert float(bf[0]) == float(ml_dtypes.bfloat16(772.0 / 257))


def test_a_world_runs_once():
    world = SimWorld(2)
    world.run(lambda t: None)
    with pytest.raises(RuntimeError, match="runs once"):
        world.run(lambda t: None)


def test_auto_refuses_algorithm_options():
    with pytest.raises(UsageError, match="auto' takes no algorithm options"):
        run(2, lambda t: refcoll.allreduce(np.zeros(4), t, algorithm="auto", segment=3))


def test_simulate_takes_no_out_since_every_rank_would_share_it():
    with pytest.raises(UsageError, match="takes no out="):
        refcoll.simulate("allreduce", [np.ones(4)] * 3, algorithm="tree", out=np.empty(4))


@pytest.mark.parametrize("collective", ["broadcast", "reduce"])
def test_a_rooted_call_given_no_root_is_refused_not_rooted_at_zero(collective):
    with pytest.raises(UsageError, match="root None is not a rank"):
        refcoll.simulate(collective, [np.ones(3)] * 2, algorithm="naive", root=None)


def test_simulate_refuses_what_no_run_could_do_and_agrees_on_dtypes():
    from refcoll.core.errors import MismatchError

    x = [np.ones(4, np.float32)] * 3
    with pytest.raises(UsageError, match="ledger-only world sends no data"):
        refcoll.simulate("allreduce", x, algorithm="ring", validate=True, moves_data=False)
    for bad in (-2, 0, 2.5):
        with pytest.raises(UsageError, match="node_size must be a whole number"):
            refcoll.simulate("allreduce", x, algorithm="hierarchical", node_size=bad)
    for bad in (0, -1, True, float("nan"), "60"):
        with pytest.raises(UsageError, match="timeout must be seconds > 0"):
            refcoll.simulate("allreduce", x, algorithm="ring", timeout=bad)
    for forever in (float("inf"), 1e10):  # more than a wait holds: for ever, not a crash
        assert refcoll.simulate("allreduce", x, algorithm="ring",
                                timeout=forever).outputs[0].tolist() == [3.0] * 4
    # A validated real call refuses ranks of different dtypes; so does the simulator,
    # which holds every input (it read an int32 rank's bytes as float32 before), lists
    # included (each rank's array of its list: int64 here, float64 there).
    with pytest.raises(MismatchError, match="rank 0 has float32, rank 1 has int32"):
        refcoll.simulate("allreduce", [np.ones(4, np.float32), np.ones(4, np.int32)],
                         algorithm="ring")
    for collective in ("allreduce", "allgather", "broadcast"):
        with pytest.raises(MismatchError, match="rank 0 has int64, rank 1 has float64"):
            refcoll.simulate(collective, [[1, 2], [3.0, 4.0]], algorithm="ring"
                             if collective != "broadcast" else "naive")
    # The switch's extra ranks are counted from its own options, not from validate=.
    assert refcoll.simulate("allreduce", x, algorithm="switch",
                            validate=True).outputs[0].tolist() == [3.0] * 4


def test_switch_workers_inverts_switch_count_at_any_size():
    from refcoll.algorithms.switch_tree import switch_count, switch_workers

    for total in [*range(1, 600), 4095, 4096, 10**6 + 7]:
        for radix in (2, 3, 16):
            w = switch_workers(total, radix=radix)
            assert w == 1 or w + switch_count(w, radix=radix) <= total
            assert w + 1 + switch_count(w + 1, radix=radix) > total


def test_simulate_cli_gives_auto_the_node_shape_and_ledger_only_no_inputs(tmp_path,
                                                                          monkeypatch):
    import json

    from click.testing import CliRunner

    from refcoll.cli import main
    from refcoll.verify.simulation import simulation_case

    monkeypatch.setenv("REFCOLL_ALGO", "hierarchical")
    out = tmp_path / "s.json"
    res = CliRunner().invoke(main, ["simulate", "--algorithm", "auto", "-p", "8", "--count",
                                    "1000", "--ranks-per-node", "4", "--json", str(out)])
    assert res.exit_code == 0, res.output
    node = json.loads(out.read_text())["node_traffic"]
    assert node["inter"] > 0 and node["predicted"] == [48000, 8000], node  # two nodes of 4
    # Ledger-only runs need no inputs' memory: the ranks run one after another on zeros.
    case = simulation_case("tree", 512, 1_000_000)
    assert case.memory_bytes(moves_data=False) * 100 < case.memory_bytes()


def test_auto_prices_each_schedule_once_per_process_not_once_per_rank(monkeypatch):
    """A simulated world's ranks each choose; the counts they price are kept."""
    from refcoll.calls import auto

    auto._cost_counts.cache_clear()
    refcoll.simulate("allreduce", [np.ones(3, np.float32)] * 16, algorithm="auto",
                     moves_data=False)
    info = auto._cost_counts.cache_info()
    assert info.misses <= len(auto.candidates("allreduce")) and info.hits >= info.misses, info
