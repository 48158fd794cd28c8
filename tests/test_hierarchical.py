"""The hierarchical all-reduce: battery, exact cost, node traffic, the documented order.

Nodes are simulated two ways: the ``ranks_per_node=k`` option (consecutive ranks
``r // k`` form a node; what the battery's option sets run) and
``SimWorld(p, ranks_per_node=k)``, whose ``split_node`` the default path asks.
"""

import numpy as np
import pytest
from conftest import failure_text, sim_battery

import refcoll
from refcoll import algorithms
from refcoll.algorithms.hierarchical import hierarchical_allreduce_cost as hierarchical_cost
from refcoll.algorithms.hierarchical import (
    hierarchical_traffic,
    node_layout,
    node_sizes,
    node_traffic,
)
from refcoll.core.chunking import chunk_bounds
from refcoll.core.errors import UsageError
from refcoll.core.ops import get_op
from refcoll.transport import Ledger, SimWorld
from refcoll.verify.inputs import make_inputs
from refcoll.verify.oracle import fold

#: (p, ranks_per_node): equal nodes, a smaller last node, one node, one rank a node.
SHAPES = [(8, 4), (7, 3), (16, 4), (17, 4), (6, 6), (5, 1), (5, 2), (4, 3), (9, 3), (3, 5)]


def shape_id(shape):
    p, k = shape
    return f"p{p}-k{k}"




def random_inputs(p, n, dtype=np.float32, seed=0):
    return make_inputs("random", np.dtype(dtype), n, p, seed=seed)


# ----------------------------------------------------------------- (a) the battery

def test_battery_runs_several_node_shapes():
    shapes = algorithms.get("hierarchical").battery_options
    assert {"ranks_per_node": 2} in shapes and {"ranks_per_node": 3} in shapes and {} in shapes


#: Dtypes of every width and kind; the algorithm only moves bytes and reduces through
#: Op.apply, whose dtypes the ring's full battery covers.
SMALL_WORLD_DTYPES = {1: ["int8", "uint64", "float16", "bfloat16", "float32", "float8_e5m2"],
                      2: ["int8", "uint64", "float16", "bfloat16", "float32", "float8_e5m2"],
                      3: ["uint8", "int64", "bfloat16", "float64"],
                      4: ["int16", "float16", "float32"],
                      5: ["uint32", "bfloat16", "float64"]}


@pytest.mark.parametrize("p", [1,
                               pytest.param(2, marks=pytest.mark.slow),  # one node or two of one
                               3, 4, pytest.param(5, marks=pytest.mark.slow)])
def test_battery_small_worlds(p):
    # Every op, size and mode, on each of the node shapes of battery_options.
    failures = sim_battery(p, algorithms_=["hierarchical"], dtypes=SMALL_WORLD_DTYPES[p])
    assert not failures, failure_text(failures)


@pytest.mark.parametrize("p", [p if p in (6, 7, 8, 9, 12, 17)
                               else pytest.param(p, marks=pytest.mark.slow)
                               for p in range(6, 18)])  # the others (16: 8's) repeat these shapes
def test_battery_covering_subset(p):
    failures = sim_battery(p, algorithms_=["hierarchical"], ops=["sum" if p % 3 else "max"],
                           dtypes=["int32", "float32"], sizes=[0, 1, p - 1, p + 1, 1001],
                           inplace=[p % 2 == 0])
    assert not failures, failure_text(failures)


# ------------------------------------------------------------ the reduction order

def fold_in_order(op, parts, order):
    """Return ``((parts[order[0]] op parts[order[1]]) ...) op parts[order[-1]]``."""
    acc = parts[order[0]].copy()
    for r in order[1:]:
        op.apply(acc, parts[r], acc)
    return acc


def ring_order(op, parts):
    """Chunk c of chunk_bounds(len, q) is ((parts[c+1] op parts[c+2]) ...) op parts[c]."""
    q = len(parts)
    out = np.empty_like(parts[0])
    for c, (start, stop) in enumerate(chunk_bounds(parts[0].size, q)):
        out[start:stop] = fold_in_order(op, [x[start:stop] for x in parts],
                                        [(c + 1 + i) % q for i in range(q)])
    return out


def documented_order(op, xs, k):
    """The spec's reduction order for inter='ring', computed without any transport."""
    sizes = node_sizes(len(xs), k)
    nodes = [xs[start:start + m] for start, m in zip(range(0, len(xs), k), sizes)]
    if len(set(sizes)) > 1:  # leader-based: fold in local-rank order, ring over the leaders
        return ring_order(op, [fold_in_order(op, node, range(len(node))) for node in nodes])
    k = sizes[0]  # ranks_per_node >= p: one node of p
    out = np.empty_like(xs[0])
    for j, (start, stop) in enumerate(chunk_bounds(xs[0].size, k)):
        # shard j: the node ring's order j+1, ..., j inside each node, then a ring over nodes
        partials = [fold_in_order(op, [x[start:stop] for x in node],
                                  [(j + 1 + i) % k for i in range(k)]) for node in nodes]
        out[start:stop] = ring_order(op, partials)
    return out


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("opname,dtype", [("sum", np.float32), ("prod", np.float16),
                                          ("sum", np.float64)])
def test_result_is_the_documented_reduction_order(shape, opname, dtype):
    p, k = shape
    op = get_op(opname)
    for n in (0, 1, p + 1, 257):
        xs = make_inputs("random", np.dtype(dtype), n, p, op=opname, seed=n)
        result = refcoll.simulate("allreduce", xs, algorithm="hierarchical", op=opname,
                                  ranks_per_node=k)
        want = documented_order(op, xs, k)
        for r, got in enumerate(result.outputs):
            assert got.tobytes() == want.tobytes(), f"rank {r}, n={n}"


def test_random_floats_depend_on_the_node_shape():
    """The order is the shape's: the check above would catch a shape-blind order."""
    xs = random_inputs(8, 64)
    two = refcoll.simulate("allreduce", xs, algorithm="hierarchical", ranks_per_node=2).outputs[0]
    four = refcoll.simulate("allreduce", xs, algorithm="hierarchical", ranks_per_node=4).outputs[0]
    assert two.tobytes() != four.tobytes()


def test_one_node_is_the_ring_and_one_rank_a_node_is_the_inter_algorithm():
    xs = random_inputs(6, 101)
    ring = refcoll.simulate("allreduce", xs, algorithm="ring")
    for k in (1, 6, 9):
        hier = refcoll.simulate("allreduce", xs, algorithm="hierarchical", ranks_per_node=k)
        assert [o.tobytes() for o in hier.outputs] == [o.tobytes() for o in ring.outputs]
        assert hier.ledger.counts() == ring.ledger.counts()
    naive = refcoll.simulate("allreduce", xs, algorithm="naive")
    hier = refcoll.simulate("allreduce", xs, algorithm="hierarchical", ranks_per_node=1,
                            inter="naive")
    assert [o.tobytes() for o in hier.outputs] == [o.tobytes() for o in naive.outputs]


# ------------------------------------------------------------ (b) ledger == cost

@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_ledger_equals_cost(shape):
    p, k = shape
    for n in (0, 1, k - 1, p + 1, 1003):
        xs = make_inputs("exact", np.dtype(np.float32), n, p)
        result = refcoll.simulate("allreduce", xs, algorithm="hierarchical", ranks_per_node=k)
        predicted = hierarchical_cost(p, n, 4, ranks_per_node=k)
        assert result.ledger.counts() == predicted.counts(), f"n={n}"


@pytest.mark.parametrize("shape", [(8, 4), (7, 3), (12, 3), (9, 2)], ids=shape_id)
def test_cost_with_a_naive_inter_phase(shape):
    """With an inter algorithm whose ranks finish at different rounds, rounds and
    critical_bytes may only be over-estimated; every other count is exact."""
    p, k = shape
    equal = p % k == 0
    for n in (0, 5, 1003):
        xs = make_inputs("exact", np.dtype(np.int64), n, p)
        result = refcoll.simulate("allreduce", xs, algorithm="hierarchical", ranks_per_node=k,
                                  inter="naive")
        assert all(np.array_equal(o, fold("sum", xs)) for o in result.outputs)
        got = result.ledger.counts()
        want = hierarchical_cost(p, n, 8, ranks_per_node=k, inter="naive").counts()
        for field in ("messages", "bytes", "max_rank_messages", "max_rank_bytes", "reduced"):
            assert got[field] == want[field], field
        assert got["critical_bytes"] <= want["critical_bytes"]
        if equal:  # every node starts its allgather after its own last inter round
            assert got["rounds"] == want["rounds"]
        else:
            assert got["rounds"] <= want["rounds"]


FLAT_ALLREDUCES = [a.name for a in algorithms.REGISTRY.values()
                   if "allreduce" in a.implementations and a.name != "hierarchical"
                   and a.extra_ranks is None]


@pytest.mark.parametrize("inter", FLAT_ALLREDUCES)
def test_every_flat_allreduce_serves_as_the_inter_phase(inter):
    for p, k in [(8, 4), (7, 3), (6, 1)]:
        for n in (0, 1, p + 1, 300):
            xs = make_inputs("exact", np.dtype(np.float32), n, p)
            result = refcoll.simulate("allreduce", xs, algorithm="hierarchical",
                                      ranks_per_node=k, inter=inter)
            want = fold("sum", xs).tobytes()
            assert all(o.tobytes() == want for o in result.outputs), (p, k, n)


@pytest.mark.parametrize("inter", ["recursive_doubling", "rabenseifner", "tree"])
@pytest.mark.parametrize("shape", [(8, 4), (7, 3), (16, 4), (17, 4), (12, 3)], ids=shape_id)
def test_cost_is_exact_with_other_inter_algorithms(inter, shape):
    if inter not in algorithms.REGISTRY:
        pytest.skip(f"{inter} is not registered")
    p, k = shape
    for n in (0, 5, 1003):
        xs = make_inputs("exact", np.dtype(np.float32), n, p)
        result = refcoll.simulate("allreduce", xs, algorithm="hierarchical", ranks_per_node=k,
                                  inter=inter)
        predicted = hierarchical_cost(p, n, 4, ranks_per_node=k, inter=inter)
        assert result.ledger.counts() == predicted.counts(), f"n={n}"


def test_cost_formula_names_the_shape():
    assert "k=4 ranks per node, g=4 nodes" in hierarchical_cost(16, 10, 4, ranks_per_node=4).formula
    assert "4+4+4+4+1" in hierarchical_cost(17, 10, 4, ranks_per_node=4).formula
    assert hierarchical_cost(1, 10, 4, ranks_per_node=4).counts() == {
        key: 0 for key in Ledger().counts()}


def test_cost_matches_the_textbook_terms_when_p_divides_n():
    p, k, n, s = 16, 4, 16 * 60, 4
    g = p // k
    cost = hierarchical_cost(p, n, s, ranks_per_node=k)
    assert cost.rounds == 2 * (k - 1) + 2 * (g - 1)
    assert cost.critical_bytes == (2 * (k - 1) * n // k + 2 * (g - 1) * n // p) * s
    assert cost.reduced == (k - 1) * n // k + (g - 1) * n // p


# --------------------------------------------------- (c) intra- and inter-node bytes

@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
def test_node_traffic_equals_the_prediction(shape):
    p, k = shape
    for n in (0, 7, 1003):
        result = refcoll.simulate("allreduce", random_inputs(p, n), algorithm="hierarchical",
                                  ranks_per_node=k)
        intra, inter = node_traffic(result.ledger, k)
        assert (intra, inter) == result.ledger.split_bytes(lambda a, b: a // k == b // k)
        assert (intra, inter) == hierarchical_traffic(p, n, 4, ranks_per_node=k)
        if p % k == 0:  # equal nodes, ring inter: 2(g-1)·n bytes cross nodes, for any n
            assert inter == 2 * (p // k - 1) * n * 4


def inter_node_bytes_per_rank(ledger, k) -> dict:
    sent = {}
    for m in ledger.messages:
        if m.source // k != m.dest // k:
            sent[m.source] = sent.get(m.source, 0) + m.nbytes
    return sent


@pytest.mark.parametrize("shape", [(8, 4), (16, 4), (12, 3), (6, 2)], ids=shape_id)
def test_inter_node_bytes_shrink_by_the_claimed_factor(shape):
    """Spec claim: with p | n, every rank sends 2((g-1)/g)·(n/k) across nodes, where
    the flat ring's boundary ranks send 2((p-1)/p)·n: (p-1)/(g-1) times less."""
    p, k = shape
    g = p // k
    n, s = 12 * p, 4
    xs = random_inputs(p, n)
    hier = inter_node_bytes_per_rank(
        refcoll.simulate("allreduce", xs, algorithm="hierarchical", ranks_per_node=k).ledger, k)
    flat = inter_node_bytes_per_rank(refcoll.simulate("allreduce", xs, algorithm="ring").ledger, k)
    assert sorted(hier) == list(range(p))  # every rank shares the inter-node load
    assert set(hier.values()) == {2 * (g - 1) * n * s // p}
    assert sorted(flat) == [i * k + k - 1 for i in range(g)]  # the flat ring: boundary ranks
    assert set(flat.values()) == {2 * (p - 1) * n * s // p}
    assert max(flat.values()) * (g - 1) == max(hier.values()) * (p - 1)


# ------------------------------------------------- (d) nodes from split_node

def run_split_node(p, k, xs, *, calls=1):
    """All-reduce ``xs`` in SimWorld(p, ranks_per_node=k) with no option; return
    (outputs of the last call, the world, ledger index where the last call starts)."""
    world = SimWorld(p, ranks_per_node=k)
    marks = []

    def body(t, x):
        for call in range(calls):
            if call == calls - 1:
                node_layout(t)  # the node discovery (first call only) before the mark
                t.split(0, t.rank)  # every rank is here: all earlier messages are matched
                if t.rank == 0:
                    marks.append(len(world.ledger.messages))
                t.split(0, t.rank)  # no rank goes on before rank 0 took the mark
            out = refcoll.allreduce(x, t, algorithm="hierarchical", validate=False)
        return out

    outputs = world.run(body, [(x,) for x in xs])
    return outputs, world, marks[0]


@pytest.mark.parametrize("shape", [(8, 4), (7, 3), (17, 4), (6, 6), (5, 1), (6, 2)],
                         ids=shape_id)
def test_split_node_path_matches_the_option(shape):
    p, k = shape
    n = 2 * p + 3
    xs = random_inputs(p, n, seed=p)
    option = refcoll.simulate("allreduce", xs, algorithm="hierarchical", ranks_per_node=k)
    outputs, world, mark = run_split_node(p, k, xs, calls=2)
    assert [o.tobytes() for o in outputs] == [o.tobytes() for o in option.outputs]
    # The second call sends exactly the option path's messages (the layout is cached).
    data = Ledger(world.ledger.messages[mark:])
    assert sorted((m.source, m.dest, m.nbytes) for m in data.messages) == sorted(
        (m.source, m.dest, m.nbytes) for m in option.ledger.messages)
    predicted = hierarchical_cost(p, n, 4, ranks_per_node=k)
    assert data.total_bytes == predicted.bytes
    assert data.max_rank_bytes == predicted.max_rank_bytes
    # The first call's discovery: a broadcast of 8 B inside each node, a ring allgather
    # of p 8-byte blocks over all ranks; none when the node is the whole world.
    g = len(node_sizes(p, k))
    discovery = world.ledger.messages[:mark]
    first_call = len(discovery) - option.ledger.total_messages
    assert first_call == (0 if g == 1 else (p - g) + p * (p - 1))


def test_split_node_layouts_agree_on_every_rank():
    world = SimWorld(10, ranks_per_node=4)
    layouts = world.run(lambda t: node_layout(t))
    assert {lay.sizes for lay in layouts} == {(4, 4, 2)}
    assert [lay.node for lay in layouts] == [r // 4 for r in range(10)]
    assert [lay.intra.rank for lay in layouts] == [r % 4 for r in range(10)]
    leaders = [r for r, lay in enumerate(layouts) if lay.cross is not None]
    assert leaders == [0, 4, 8]
    assert [layouts[r].cross.rank for r in leaders] == [0, 1, 2]


def test_splits_happen_once_per_transport_and_shape():
    world = SimWorld(6)
    splits = []

    def body(t, x):
        real = t.split

        def counting(color, key):
            splits.append(t.rank)
            return real(color, key)

        t.split = counting
        for _ in range(3):
            refcoll.allreduce(x, t, algorithm="hierarchical", ranks_per_node=3)
        refcoll.allreduce(x, t, algorithm="hierarchical", ranks_per_node=2)
        return refcoll.allreduce(x, t, algorithm="hierarchical", ranks_per_node=3)

    xs = make_inputs("exact", np.dtype(np.int32), 9, 6)
    outputs = world.run(body, [(x,) for x in xs])
    assert all(np.array_equal(o, fold("sum", xs)) for o in outputs)
    assert sorted(splits) == sorted(list(range(6)) * 4)  # intra + cross, for k=3 and k=2


# --------------------------------------------------------------------- errors

def test_bad_options_are_usage_errors():
    xs = make_inputs("exact", np.dtype(np.int32), 4, 2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(UsageError, match="ranks_per_node"):
            refcoll.simulate("allreduce", xs, algorithm="hierarchical", ranks_per_node=bad)
    with pytest.raises(UsageError, match="inter"):
        refcoll.simulate("allreduce", xs, algorithm="hierarchical", inter="hierarchical")
    switches = [a.name for a in algorithms.REGISTRY.values() if a.extra_ranks is not None]
    for name in switches:
        with pytest.raises(UsageError, match="beyond the data ranks"):
            refcoll.simulate("allreduce", xs, algorithm="hierarchical", inter=name)
    with pytest.raises(UsageError, match="unknown algorithm"):
        refcoll.simulate("allreduce", xs, algorithm="hierarchical", inter="nope")


def test_node_sizes():
    assert node_sizes(7, 3) == (3, 3, 1)
    assert node_sizes(16, 4) == (4, 4, 4, 4)
    assert node_sizes(4, 6) == (4,)
    assert node_sizes(5, 1) == (1,) * 5
