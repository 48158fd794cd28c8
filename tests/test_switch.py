"""In-network all-reduce: the tree, conformance, exact cost, traffic, the slot pool, int mode.

Switches are ranks ``W..W+S-1`` of the world; the tests run the implementation
directly on ``SimWorld(W + S)`` (switch ranks get a template buffer and ``out=None``)
and through ``refcoll.simulate``, which adds the switch ranks itself.
"""

import numpy as np
import pytest
from conftest import ALGORITHM_TWINS, failure_text

import refcoll
from refcoll import algorithms
from refcoll.algorithms.switch import (
    PACKET,
    RADIX,
    SLOTS,
    int_error_bound,
    packet_bounds,
    switch_allreduce,
    switch_count,
    switch_levels,
    switch_links,
    switch_schedule,
    switch_workers,
)
from refcoll.algorithms.switch import switch_allreduce_cost as switch_cost
from refcoll.core.chunking import chunk_bounds
from refcoll.core.errors import UsageError
from refcoll.core.ops import get_dtype, get_op
from refcoll.transport import SimWorld
from refcoll.verify.conformance import build_cases, run_battery
from refcoll.verify.inputs import make_inputs
from refcoll.verify.oracle import exact_reduce, fold


def run_switch(inputs, *, op="sum", inplace=False, spare=0, **options):
    """Run ``switch_allreduce`` on the workers and their switches; return (outputs, world)."""
    workers = len(inputs)
    total = workers + refcoll.algorithms.get("switch").extra_ranks(workers, **options) + spare
    template = np.zeros_like(inputs[0])
    xs = [x.copy() for x in inputs]
    outs = [x if inplace else np.empty_like(x) for x in xs]
    args = [(x, out) for x, out in zip(xs, outs)] + [(template, None)] * (total - workers)
    world = SimWorld(total)
    world.run(lambda t, x, out: switch_allreduce(t, x, out, op=get_op(op), **options), args)
    return outs, world




def tree_fold(op, arrays, radix):
    """The documented order, by hand: level by level, each chunk of nodes folded left to right."""
    reduction = get_op(op)
    level = [np.array(x, copy=True) for x in arrays]
    while len(level) > 1:
        above = []
        for lo, hi in chunk_bounds(len(level), -(-len(level) // radix)):
            acc = level[lo].copy()
            for part in level[lo + 1:hi]:
                reduction.apply(acc, part, acc)
            above.append(acc)
        level = above
    out = level[0]
    reduction.finalize(out, len(arrays))
    return out


# ------------------------------------------------------------------------ the tree

@pytest.mark.parametrize("radix", range(2, 9))
def test_switch_count_and_workers_are_inverse(radix):
    totals = [w + switch_count(w, radix=radix) for w in range(1, 66)]
    assert totals == sorted(set(totals)), "W + S(W) must grow strictly"
    assert switch_count(1, radix=radix) == 0
    for workers in range(1, 65):
        total = workers + switch_count(workers, radix=radix)
        assert switch_workers(total, radix=radix) == workers
        # Every total between two trees gives the smaller one (the rest are spares).
        for spare in range(totals[workers] - total):
            assert switch_workers(total + spare, radix=radix) == workers
        if 2 <= workers <= radix:
            assert switch_count(workers, radix=radix) == 1
    # The record's functions take every switch option; only radix shapes the tree.
    record = refcoll.algorithms.get("switch")
    assert record.extra_ranks(64, radix=radix, packet=5, mode="int") \
        == switch_count(64, radix=radix)
    assert record.workers(2, radix=radix, slots=3) == 1
    with pytest.raises(TypeError):  # an option no switch takes is not swallowed
        record.extra_ranks(64, radix=radix, unknown=1)


@pytest.mark.parametrize("radix", [2, 3, 4, 7])
@pytest.mark.parametrize("workers", [1, 2, 3, 5, 8, 9, 17, 40])
def test_tree_links_are_consistent(workers, radix):
    levels = switch_levels(workers, radix=radix)
    total = sum(levels)
    assert total == workers + switch_count(workers, radix=radix)
    links = [switch_links(r, workers, radix=radix) for r in range(total)]
    assert links[-1][0] is None, "the root is the last rank"
    assert all(parent is not None for parent, _ in links[:-1])
    for rank, (_parent, children) in enumerate(links):
        assert (children == []) == (rank < workers), "workers are exactly the leaves"
        assert len(children) <= radix
        assert children == sorted(children)
        for child in children:
            assert links[child][0] == rank
    depth = []
    for rank in range(workers):
        hops, node = 0, rank
        while links[node][0] is not None:
            node, hops = links[node][0], hops + 1
        depth.append(hops)
    assert set(depth) == {len(levels) - 1}, "every worker is at the same depth"


def test_tree_of_the_module_diagram():
    # W = 5, radix 2: s5(w0 w1) s6(w2 w3) s7(w4); s8(s5 s6) s9(s7); s10(s8 s9).
    assert switch_levels(5, radix=2) == [5, 3, 2, 1]
    got = {r: switch_links(r, 5, radix=2) for r in range(5, 11)}
    assert got == {5: (8, [0, 1]), 6: (8, [2, 3]), 7: (9, [4]), 8: (10, [5, 6]),
                   9: (10, [7]), 10: (None, [8, 9])}


def test_packets_follow_the_chunking_rule():
    assert packet_bounds(10, 4) == [(0, 4), (4, 7), (7, 10)]
    assert packet_bounds(0, 4) == []
    assert packet_bounds(3, 8) == [(0, 3)]
    assert all(hi - lo <= 7 for lo, hi in packet_bounds(1003, 7))


# ---------------------------------------------------------------------- conformance

EXACT_CASES = [(w, ("sum", "prod", "min", "max", "avg")[w % 5],
                ("float32", "int32", "bfloat16", "float64", "int8", "float16")[w % 6])
               for w in range(1, 18)]


@pytest.mark.parametrize("workers,op,dtype", EXACT_CASES,
                         ids=[f"W{w}-{op}-{dt}" for w, op, dt in EXACT_CASES])
def test_exact_inputs_match_the_fold(workers, op, dtype):
    radix = 2 + workers % 3
    for count in (0, 1, workers + 1, 29):
        for inplace in (False, True):
            inputs = make_inputs("exact", get_dtype(dtype), count, workers, op=op, seed=count)
            outs, world = run_switch(inputs, op=op, inplace=inplace, radix=radix, packet=4,
                                     slots=2 + count % 2)
            want = fold("sum" if op == "avg" else op, inputs)  # the API divides, not the switch
            for rank, out in enumerate(outs):
                assert out.tobytes() == want.tobytes(), (rank, count, inplace, out, want)
            if workers == 1 or count == 0:
                assert world.ledger.total_messages == 0


@pytest.mark.parametrize("workers", [2, 3, 5, 8, 13, 17])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_random_floats_follow_the_documented_order(workers, dtype):
    radix = 2 + workers % 4
    inputs = make_inputs("random", get_dtype(dtype), 37, workers, seed=workers)
    outs, _ = run_switch(inputs, radix=radix, packet=5, slots=3)
    want = tree_fold("sum", inputs, radix)
    for out in outs:
        assert out.tobytes() == want.tobytes()


def test_the_tree_order_is_not_the_rank_order():
    # What the test above pins down is a different order from naive's (so it can fail).
    inputs = make_inputs("random", np.dtype("float32"), 37, 9, seed=9)
    outs, _ = run_switch(inputs, radix=3, packet=5, slots=3)
    assert outs[0].tobytes() == tree_fold("sum", inputs, 3).tobytes()
    assert outs[0].tobytes() != fold("sum", inputs).tobytes()


def test_simulate_adds_the_switches_and_finishes_avg():
    inputs = make_inputs("random", np.dtype("float64"), 50, 6, seed=3)
    result = refcoll.simulate("allreduce", inputs, algorithm="switch", op="avg", radix=3, packet=8)
    assert len(result.outputs) == 6
    senders = set(result.ledger.bytes_sent())
    assert senders == set(range(6 + switch_count(6, radix=3)))
    want = tree_fold("avg", inputs, 3)
    for out in result.outputs:
        assert out.tobytes() == want.tobytes()


def test_spare_ranks_take_no_part():
    # Radix 2: 4 workers need 7 ranks, 5 workers 11; 10 ranks are 4 workers and 3 spares.
    assert switch_workers(10, radix=2) == 4
    inputs = make_inputs("exact", np.dtype("float32"), 20, 4, seed=1)
    outs, world = run_switch(inputs, spare=3, radix=2, packet=3)
    assert all(o.tobytes() == fold("sum", inputs).tobytes() for o in outs)
    involved = {m.source for m in world.ledger.messages} | {m.dest for m in world.ledger.messages}
    assert involved == set(range(4 + switch_count(4, radix=2)))


@pytest.mark.parametrize("workers", [2, 4, 9])
def test_battery_with_the_switch_option_sets(workers):
    world = workers + max(algorithms.get("switch").extra_ranks(workers, **o)
                          for o in algorithms.get("switch").battery_options)
    cases = build_cases(workers, algorithms_=["switch"], world_size=world,
                        ops=["sum", "max"] if workers < 9 else ["avg"],
                        dtypes=["int16", "float32", "bfloat16"], sizes=[0, 1, workers + 1, 1003])
    assert {c.ranks for c in cases} == {workers}
    results = SimWorld(world).run(
        lambda t: run_battery(t, cases, nonblocking=ALGORITHM_TWINS))[0]
    failures = [r for r in results if not r.passed]
    assert not failures, failure_text(failures)


# ------------------------------------------------------------------- cost, traffic

COST_CASES = [(w, radix, slots, count, mode)
              for w, radix in [(1, 2), (2, 2), (3, 2), (4, 2), (5, 3), (7, 2), (9, 3), (16, 4),
                               (17, 2)]
              for slots, count in [(1, 5), (2, 0), (3, 23), (5, 301)]
              for mode in ("float", "int")]


@pytest.mark.parametrize("workers,radix,slots,count,mode", COST_CASES,
                         ids=[f"W{w}-R{r}-s{s}-n{n}-{m}" for w, r, s, n, m in COST_CASES])
def test_ledger_equals_cost(workers, radix, slots, count, mode):
    inputs = make_inputs("random", np.dtype("float32"), count, workers, seed=count)
    options = dict(radix=radix, packet=3, slots=slots, mode=mode)
    _, world = run_switch(inputs, **options)
    assert world.ledger.counts() == switch_cost(workers, count, 4, **options).counts()


def test_default_options_agree_with_the_cost():
    inputs = make_inputs("random", np.dtype("float64"), 1003, 6, seed=4)
    _, world = run_switch(inputs)
    assert world.ledger.counts() == switch_cost(6, 1003, 8).counts()
    assert switch_cost(6, 1003, 8) == switch_cost(6, 1003, 8, radix=RADIX, packet=PACKET,
                                                  slots=SLOTS, mode="float")


def test_cost_is_fast_for_large_buffers():
    # The replay jumps over the steady state: a billion elements cost no more than a few.
    big = switch_cost(64, 10**9, 4, radix=4, packet=256, slots=8)
    assert big.messages == 2 * (64 + switch_count(64, radix=4) - 1) * -(-10**9 // 256)
    assert big.rounds > 10**9 // 256


@pytest.mark.parametrize("workers", [2, 5, 16])
@pytest.mark.parametrize("mode", ["float", "int"])
def test_each_worker_sends_n_and_receives_n(workers, mode):
    count, packet, slots = 103, 10, 4
    inputs = make_inputs("random", np.dtype("float64"), count, workers, seed=workers)
    _, world = run_switch(inputs, radix=3, packet=packet, slots=slots, mode=mode)
    sent, received = world.ledger.bytes_sent(), world.ledger.bytes_received()
    packets = -(-count // packet)
    # int mode: int32 on the wire, one exponent per packet, and the first `slots` exponents.
    expected = count * 8 if mode == "float" else 4 * (count + packets + min(slots, packets))
    for rank in range(workers):
        assert sent[rank] == expected and received[rank] == expected


@pytest.mark.parametrize("workers,radix,slots", [(4, 2, 1), (5, 2, 3), (9, 3, 2), (6, 4, 8)])
def test_a_switch_holds_at_most_slots_packets(workers, radix, slots):
    # Derived from the ledger: a packet takes its slot (its tag) when the first child's
    # partial arrives and frees it when the result reaches the last child.
    count, packet = 60, 4
    inputs = make_inputs("random", np.dtype("float32"), count, workers, seed=0)
    _, world = run_switch(inputs, radix=radix, packet=packet, slots=slots)
    packets = -(-count // packet)
    for switch in range(workers, workers + switch_count(workers, radix=radix)):
        _, children = switch_links(switch, workers, radix=radix)
        taken, freed, held, most = 0, 0, set(), 0
        for m in world.ledger.messages:
            if m.source == children[0] and m.dest == switch:
                assert m.tag == taken % slots and m.tag not in held, "a slot reused while held"
                held.add(m.tag)
                taken += 1
            elif m.source == switch and m.dest == children[-1]:
                assert m.tag == freed % slots
                held.remove(m.tag)
                freed += 1
            most = max(most, len(held))
        assert taken == freed == packets and not held
        assert most == min(slots, packets)


@pytest.mark.parametrize("workers,radix,mode", [(4, 2, "float"), (5, 2, "int"), (7, 3, "float"),
                                                (10, 4, "int")])
def test_schedule_is_every_ranks_program_order(workers, radix, mode):
    # The deadlock-freedom witness: the global order, seen from any one rank, is the
    # order in which that rank's messages matched in a real run.
    count, packet, slots = 31, 4, 3
    inputs = make_inputs("random", np.dtype("float32"), count, workers, seed=2)
    _, world = run_switch(inputs, radix=radix, packet=packet, slots=slots, mode=mode)
    plan = [(src, dst, elements * 4)
            for transfers, repeat in switch_schedule(workers, count, radix=radix, packet=packet,
                                                     slots=slots, mode=mode)
            for _ in range(repeat) for src, dst, elements in transfers]
    ran = [(m.source, m.dest, m.nbytes) for m in world.ledger.messages]
    assert sorted(plan) == sorted(ran)
    for rank in range(workers + switch_count(workers, radix=radix)):
        assert [e for e in plan if rank in e[:2]] == [e for e in ran if rank in e[:2]]


# ------------------------------------------------------------------------ int mode

@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("workers", [2, 3, 8, 17])
def test_int_mode_is_exact_on_exact_inputs(workers, dtype):
    inputs = make_inputs("exact", get_dtype(dtype), 41, workers, seed=workers)
    outs, _ = run_switch(inputs, radix=3, packet=6, slots=2, mode="int")
    want = fold("sum", inputs)
    for out in outs:
        assert out.tobytes() == want.tobytes()


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize("workers", [2, 5, 16])
def test_int_mode_error_bound(workers, dtype):
    # Values spread over many binades in a block, so the shared exponent bites.
    rng = np.random.default_rng(workers)
    inputs = [(rng.standard_normal(200) * 2.0 ** rng.integers(-12, 3, 200)).astype(dtype)
              for _ in range(workers)]
    options = dict(packet=16, slots=3)
    outs, _ = run_switch(inputs, radix=4, mode="int", **options)
    exact = exact_reduce("sum", inputs)
    bound = int_error_bound(inputs, **options)
    for out in outs:
        assert out.tobytes() == outs[0].tobytes()
    error = np.abs(outs[0].astype(np.float64) - exact)
    assert np.all(error <= bound), float(np.max(error / bound))
    assert np.max(error / bound) > 0.1, "the bound should not be loose by orders of magnitude"


def test_int_mode_scales_each_block_by_its_own_exponent():
    # Blocks of wildly different magnitude: a worker quantizing a block with another
    # block's exponent would overflow int32 or lose the small block entirely.
    rng = np.random.default_rng(1)
    scale = np.repeat(2.0 ** np.array([-20, 12, -3, 30, -40, 0, 7, -25, 18, -9]), 4)
    inputs = [(rng.standard_normal(40) * scale).astype(np.float32) for _ in range(5)]
    options = dict(packet=4, slots=3)
    outs, _ = run_switch(inputs, radix=2, mode="int", **options)
    error = np.abs(outs[0].astype(np.float64) - exact_reduce("sum", inputs))
    assert np.all(error <= int_error_bound(inputs, **options))
    relative = error / np.abs(exact_reduce("sum", inputs))
    assert np.median(relative) < 1e-6


def test_int_mode_is_not_exact_beyond_30_bits():
    # float64 "exact" inputs may need 53 bits; int32 keeps 30 - ceil(log2 W).
    inputs = [np.array([2.0 ** 40 + 1, 3.0]), np.array([1.0, 2.0 ** 35 + 1])]
    outs, _ = run_switch(inputs, radix=2, mode="int")
    assert outs[0].tobytes() != fold("sum", inputs).tobytes()
    assert np.all(np.abs(outs[0] - fold("sum", inputs)) <= int_error_bound(inputs))


def test_int_mode_avg_through_simulate():
    inputs = make_inputs("exact", np.dtype("float32"), 30, 4, op="avg", seed=5)
    result = refcoll.simulate("allreduce", inputs, algorithm="switch", op="avg", mode="int",
                              packet=7, slots=2)
    for out in result.outputs:
        assert out.tobytes() == fold("avg", inputs).tobytes()


def test_int_mode_nonfinite_block_comes_back_nan():
    inputs = make_inputs("random", np.dtype("float32"), 12, 3, seed=0)
    inputs[1][5] = np.inf
    outs, _ = run_switch(inputs, radix=2, packet=4, slots=2, mode="int")
    for out in outs:
        assert np.isnan(out[4:8]).all()
        assert np.isfinite(out[:4]).all() and np.isfinite(out[8:]).all()


@pytest.mark.parametrize("dtype,op", [("int32", "sum"), ("float32", "max"), ("float32", "prod")])
def test_int_mode_refuses_what_it_cannot_compute(dtype, op):
    inputs = [np.ones(4, dtype=dtype)] * 3
    with pytest.raises(UsageError, match="mode 'int'"):
        run_switch(inputs, op=op, mode="int", radix=2)


@pytest.mark.parametrize("options", [{"radix": 1}, {"packet": 0}, {"slots": 0}, {"slots": 1025},
                                     {"mode": "fixed"}])
def test_bad_options_are_usage_errors(options):
    with pytest.raises(UsageError):
        run_switch([np.ones(4)] * 2, **{"radix": 2, **options})


@pytest.mark.parametrize("strict", ["seterr", "warnings"])
def test_int_mode_past_the_dtypes_range_is_inf_on_every_worker_under_strict_numpy(strict):
    """float16 sums past 65504 turn into inf when the int32 sum is cast back: under
    np.seterr(all="raise") or warnings as errors that cast raised on the workers, and the
    switch waited for them to its deadline."""
    import warnings

    x = np.full(8, 60000, dtype=np.float16)
    total = 2 + refcoll.algorithms.get("switch").extra_ranks(2, packet=2, slots=2)
    outs = [np.empty_like(x), np.empty_like(x)] + [None] * (total - 2)

    def rank(t, y, out):  # (NumPy's error state is each thread's own)
        before = np.seterr(all="raise" if strict == "seterr" else "warn")
        try:
            switch_allreduce(t, y, out, op=get_op("sum"), packet=2, slots=2, mode="int")
        finally:
            np.seterr(**before)

    with warnings.catch_warnings():  # (the filters are the process's: set once, here)
        if strict == "warnings":
            warnings.simplefilter("error")
        SimWorld(total).run(rank, [(x.copy(), out) for out in outs[:2]]
                            + [(np.zeros_like(x), None)] * (total - 2))
    assert all(np.isinf(out).all() for out in outs[:2])
