"""torch.distributed's own calls on the "refcoll" backend: results, Work, errors, subgroups, DDP.

Runs in every process of a torchrun or mpiexec job (tests/test_torch_backend.py).
Every expected value is refcoll's simulator run on every rank's inputs, which
each rank builds from its rank number alone; the algorithm is fixed per group
with ``REFCOLL_ALGO`` so that the simulator's prediction is one order.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from backend_job import environment, group_with, world  # noqa: F401 - the fixture

import refcoll
from refcoll.core.bits import same_bits
from refcoll.core.errors import CollectiveTimeout, MismatchError, UsageError
from refcoll.torch.backend import RefcollGroup
from refcoll.torch.tensors import as_array

HOST = SimpleNamespace(rank=0, backend="gloo")


def bits(tensor) -> np.ndarray:
    return as_array(tensor.detach().contiguous(), HOST)


def inputs(p: int, n: int, dtype=torch.float32, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, generator=g) * 10 for _ in range(p)]
    if not dtype.is_floating_point:
        xs = [x.round() for x in xs]
    return [x.to(dtype) for x in xs]


@pytest.fixture(scope="module")
def ring(world):
    """A "refcoll" group of every rank that runs the ring wherever a collective has one."""
    return group_with(REFCOLL_ALGO="ring")


def test_the_default_group_is_refcolls(world):
    assert isinstance(world, RefcollGroup)
    assert dist.get_backend(world) == "refcoll" and world.algorithms["allreduce"] == "auto"
    assert world.group_name  # functional collectives need the name torch gave it


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int32])
@pytest.mark.parametrize("op", ["sum", "avg", "max", "prod"])
def test_all_reduce_is_the_simulators_ring(ring, dtype, op):
    if op == "avg" and not dtype.is_floating_point:
        pytest.skip("AVG of integers: torch refuses it before any backend is asked")
    p, r = ring.size(), ring.rank()
    xs = inputs(p, 3 * p + 2, dtype)
    torch_op = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
                "prod": dist.ReduceOp.PRODUCT}[op]
    t = xs[r].clone()
    dist.all_reduce(t, op=torch_op, group=ring)
    want = refcoll.simulate("allreduce", [bits(x) for x in xs], algorithm="ring", op=op)
    assert same_bits(bits(t), want.outputs[r])


def test_premul_sum_multiplies_each_input_then_sums(ring):
    p, r = ring.size(), ring.rank()
    xs = inputs(p, 11)
    factor = 1 / 3
    t = xs[r].clone()
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(factor), group=ring)
    scaled = [bits(x) * np.float32(factor) for x in xs]
    want = refcoll.simulate("allreduce", scaled, algorithm="ring").outputs[r]
    assert same_bits(bits(t), want)


def test_premul_sum_rounds_the_factor_to_a_16_bit_float_as_torch_and_nccl_do(ring):
    # Through float32 (NCCL's T(double), torch.tensor(f, dtype)): 1 + 2**-8 + 2**-30 is
    # 1.0 in bfloat16 so, and 1 + 2**-7 rounded once; reduce-scatter rounded it so already.
    p = ring.size()
    factor = 1 + 2**-8 + 2**-30
    t = torch.full((8,), 3.0, dtype=torch.bfloat16)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(factor), group=ring)
    out = torch.empty(8, dtype=torch.bfloat16)
    dist.reduce_scatter_single(out, torch.full((8 * p,), 3.0, dtype=torch.bfloat16),
                               op=dist._make_nccl_premul_sum(factor), group=ring)
    assert t.tolist() == out.tolist() == [3.0 * p] * 8


def test_reduce_scatter_and_all_gather_tensors_are_the_simulators(ring):
    p, r = ring.size(), ring.rank()
    xs = inputs(p, 4 * p)
    out = torch.empty(4)
    dist.reduce_scatter_single(out, xs[r], group=ring)
    want = refcoll.simulate("reduce_scatter", [bits(x) for x in xs], algorithm="ring")
    assert same_bits(bits(out), want.outputs[r])
    whole = torch.empty(p * 5)
    dist.all_gather_single(whole, xs[r][:5], group=ring)
    assert torch.equal(whole.view(p, 5), torch.stack([x[:5] for x in xs]))


def test_the_list_forms(ring):
    p, r = ring.size(), ring.rank()
    xs = inputs(p, 3 * p)
    outs = [torch.empty(3) for _ in range(p)]
    dist.all_gather(outs, xs[r][:3], group=ring)
    assert all(torch.equal(outs[q], xs[q][:3]) for q in range(p))
    mine = torch.empty(3)
    dist.reduce_scatter(mine, list(xs[r].view(p, 3)), group=ring)
    want = refcoll.simulate("reduce_scatter", [bits(x) for x in xs], algorithm="ring")
    assert same_bits(bits(mine), want.outputs[r])


@pytest.mark.parametrize("root", [0, -1])
def test_broadcast_and_reduce(ring, root):
    p, r = ring.size(), ring.rank()
    root = root % p
    xs = inputs(p, 9)
    t = xs[r].clone()
    dist.broadcast(t, src=root, group=ring)
    assert torch.equal(t, xs[root])
    t = xs[r].clone()
    dist.reduce(t, dst=root, group=ring)
    if r == root:  # broadcast and reduce have no ring: auto runs the tree
        want = refcoll.simulate("reduce", [bits(x) for x in xs], algorithm="tree", root=root)
        assert same_bits(bits(t), want.outputs[r])
    else:
        assert torch.equal(t, xs[r])  # a non-root's tensor is left as it was


def test_gather_scatter_and_all_to_all(world):
    p, r = world.size(), world.rank()
    mine = torch.full((2,), float(r))
    got = [torch.empty(2) for _ in range(p)] if r == 0 else None
    dist.gather(mine, got, dst=0)
    if r == 0:
        assert [g.tolist() for g in got] == [[float(q)] * 2 for q in range(p)]
    out = torch.empty(3)
    dist.scatter(out, [torch.full((3,), 10.0 + q) for q in range(p)] if r == 0 else None, src=0)
    assert out.tolist() == [10.0 + r] * 3
    # uneven pieces: rank r sends q + 1 rows to rank q, each row holding 100·r + q
    send = torch.cat([torch.full((q + 1,), 100.0 * r + q) for q in range(p)])
    recv = torch.empty(p * (r + 1))
    dist.all_to_all_single(recv, send, [r + 1] * p, [q + 1 for q in range(p)])
    assert recv.tolist() == [100.0 * q + r for q in range(p) for _ in range(r + 1)]
    outs = [torch.empty(1) for _ in range(p)]
    dist.all_to_all(outs, [torch.tensor([10.0 * r + q]) for q in range(p)])
    assert [o.item() for o in outs] == [10.0 * q + r for q in range(p)]
    dist.barrier()


def test_send_and_recv_are_the_users_own_messages(world):
    p, r = world.size(), world.rank()
    t = torch.full((4,), float(r))
    if r == 0:
        for q in range(1, p):
            dist.send(t, q, tag=7)
    else:
        dist.recv(t, 0, tag=7)
    assert t.tolist() == [0.0] * 4


def test_async_op_returns_a_work_that_completes_on_the_engine(ring):
    p, r = ring.size(), ring.rank()
    xs = inputs(p, 1000)
    t = xs[r].clone()
    work = dist.all_reduce(t, group=ring, async_op=True)
    assert isinstance(work.is_completed(), bool)
    assert work.wait() is True and work.is_completed() and work.exception() is None
    assert work.get_future().value()[0] is t
    want = refcoll.simulate("allreduce", [bits(x) for x in xs], algorithm="ring")
    assert same_bits(bits(t), want.outputs[r])
    futures = [dist.all_reduce(torch.ones(3) * k, group=ring, async_op=True).get_future()
               for k in range(4)]
    torch.futures.wait_all(futures)
    assert [f.value()[0].tolist() for f in futures] == [[float(k * p)] * 3 for k in range(4)]


def test_refcolls_own_calls_on_the_group_queue_behind_its_calls_in_flight(ring):
    # refcoll.torch's functions and DDP hooks given a "refcoll" group once made a second
    # transport over its Gloo group, on the same tags: beside an all-reduce in flight
    # the two took each other's messages (wrong sums, or Gloo aborting the process).
    import refcoll.torch as rt
    from refcoll.transport.torch import torch_transport_for

    assert torch_transport_for(ring) is ring.refcoll_transport()
    p, r = ring.size(), ring.rank()
    for _ in range(3):
        a, b = torch.full((100_000,), 1.0 + r), torch.full((100_000,), 100.0 * (r + 1))
        work = dist.all_reduce(a, group=ring, async_op=True)
        direct = rt.allreduce(b, group=ring)
        assert work.wait() is True
        assert torch.equal(a, torch.full_like(a, p * (p + 1) / 2))
        assert torch.equal(direct, torch.full_like(b, 100.0 * p * (p + 1) / 2))


def test_a_waited_works_future_holds_its_value_however_late_its_callback(ring, monkeypatch):
    # The future completes from the handle's done callback on the engine's thread; a
    # wait() that returned before it did left get_future().value() failing torch's
    # "completed()" assertion (seen at load 3). A late callback, forced here, is waited for.
    import time

    from refcoll.torch.work import RefcollWork

    prompt = RefcollWork._done

    def late(self, handle):
        time.sleep(0.05)
        prompt(self, handle)
    monkeypatch.setattr(RefcollWork, "_done", late)
    t = torch.ones(5)
    work = dist.all_reduce(t, group=ring, async_op=True)
    assert work.wait() is True
    assert work.get_future().value()[0] is t and t[0].item() == ring.size()


def test_mismatched_counts_are_a_mismatch_error_on_every_rank(world):
    r = world.rank()
    with pytest.raises(MismatchError, match="count: rank 0 has 4"):
        dist.all_reduce(torch.ones(4 + (r == 1)))
    with pytest.raises(MismatchError, match="dtype"):
        dist.all_reduce(torch.ones(4, dtype=torch.float64 if r == 1 else torch.float32))
    ok = torch.ones(4)
    dist.all_reduce(ok)  # the group goes on
    assert ok.tolist() == [float(world.size())] * 4


def test_mismatched_all_to_all_splits_are_refused_on_every_rank(world):
    p, r = world.size(), world.rank()
    splits = [1] * p
    if r == 1:
        splits = [2] + [1] * (p - 2) + [0] if p > 1 else splits
    with pytest.raises(MismatchError, match="do not pair up"):
        dist.all_to_all_single(torch.empty(p), torch.zeros(p), None, splits)


def test_pieces_and_outputs_of_the_wrong_count_or_size_are_refused_on_every_rank(world):
    """reduce_scatter split any length by its own chunks, and all_gather zipped its outputs:
    pieces of 3 and 1 for an output of 2, 2p pieces, an input of 2p + 1, p - 1 or p + 1
    outputs all returned a result (a piece's element on another rank, a rank's data
    dropped), where Gloo refuses each."""
    p, r = world.size(), world.rank()
    wrong = [
        lambda: dist.reduce_scatter(torch.zeros(2), [torch.zeros(3)] + [torch.zeros(1)] * (p - 1)),
        lambda: dist.reduce_scatter(torch.zeros(1), [torch.zeros(1)] * (2 * p)),
        lambda: dist.reduce_scatter_tensor(torch.zeros(2), torch.zeros(2 * p + 1)),
        lambda: dist.all_gather([torch.zeros(3)] * (p - 1), torch.zeros(3)),
        lambda: dist.all_gather([torch.zeros(3) for _ in range(p + 1)], torch.zeros(3)),
    ]
    for call in wrong:
        with pytest.raises((ValueError, UsageError), match="reduce-scatter|allgather"):
            call()
    x = torch.ones(3) * (r + 1)
    dist.all_reduce(x)
    assert x.tolist() == [p * (p + 1) / 2] * 3  # the group goes on


def test_a_bad_split_on_one_rank_is_every_ranks_error_and_the_group_goes_on(world):
    """A negative or fractional split size, or a scalar, raised in torch on its rank alone;
    the others waited out the deadline in the all-to-all, and Gloo closed the group."""
    p, r = world.size(), world.rank()
    for bad in ([p + 1] + [-1] + [1] * (p - 2), [1.0] * p):
        splits = bad if r == p - 1 else [1] * p
        with pytest.raises((ValueError, UsageError), match="whole numbers from 0"):
            dist.all_to_all_single(torch.empty(p), torch.zeros(p), None, splits)
    x = torch.ones(2)
    dist.all_reduce(x)
    assert x.tolist() == [float(p)] * 2


def test_all_to_all_in_place_is_gloos_answer(world):
    """In place, a round received over a piece a later round sent: wrong at 3 ranks."""
    p, r = world.size(), world.rank()
    x = torch.arange(float(p)) + 10 * r  # element j goes to rank j
    dist.all_to_all_single(x, x)
    assert x.tolist() == [10.0 * q + r for q in range(p)]
    pieces = [torch.full((2,), 10.0 * r + q) for q in range(p)]
    dist.all_to_all(pieces, pieces)
    assert [t.tolist() for t in pieces] == [[10.0 * q + r] * 2 for q in range(p)]


def test_what_refcoll_cannot_reduce_is_an_error_on_every_rank(world):
    with pytest.raises(ValueError, match="BAND is not one refcoll reduces"):
        dist.all_reduce(torch.ones(3, dtype=torch.int32), op=dist.ReduceOp.BAND)
    with pytest.raises(UsageError, match="dtype bool"):
        dist.all_reduce(torch.ones(3, dtype=torch.bool))


def test_a_sparse_tensor_is_refused_on_every_rank(world):
    sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (4,))
    with pytest.raises(ValueError, match="sparse_coo tensor: refcoll reduces dense tensors"):
        dist.all_reduce(sparse)


@pytest.mark.parametrize("call", ["all_gather_single", "reduce_scatter_single",
                                  "reduce_scatter", "all_gather"])
def test_a_tensor_not_contiguous_on_one_rank_is_refused_on_every_rank(world, call):
    """Each rank's tensors are judged inside the shared check: rank 1's alone raised, and
    rank 0 waited in the agreement for a call that never came."""
    p, r = world.size(), world.rank()

    def odd(n):  # rank 1's tensor: every other element of a larger one
        return torch.zeros(2 * n)[::2] if r == 1 else torch.zeros(n)
    with pytest.raises(ValueError, match="not contiguous"):
        if call == "all_gather_single":
            dist.all_gather_single(odd(4 * p), torch.ones(4))
        elif call == "reduce_scatter_single":
            dist.reduce_scatter_single(odd(4), torch.ones(4 * p))
        elif call == "reduce_scatter":
            dist.reduce_scatter(torch.zeros(4), [odd(4) for _ in range(p)])
        else:
            dist.all_gather([odd(4) for _ in range(p)], torch.ones(4))
    ok = torch.ones(4)
    dist.all_reduce(ok)  # the group goes on, in step
    assert ok.tolist() == [float(p)] * 4


def test_a_premultiplied_call_refused_leaves_the_tensor_and_a_reduce_its_non_roots(world):
    p, r = world.size(), world.rank()
    premul = dist._make_nccl_premul_sum(0.5)
    t = torch.full((4 + (r == 1),), 8.0)
    with pytest.raises(MismatchError, match="count"):
        dist.all_reduce(t, op=premul)
    assert t.tolist() == [8.0] * t.numel()  # not halved: a retry must not scale it twice
    t = torch.full((4,), 3.0)
    dist.reduce(t, 0, op=premul)
    assert t.tolist() == ([1.5 * p] if r == 0 else [3.0]) * 4  # as SUM leaves non-roots


def test_a_tensor_it_carried_can_still_be_freed_and_regrown(world):
    # as FSDP does with its parameters' storage: Tensor.numpy() would forbid it
    t = torch.ones(64)
    dist.all_reduce(t)
    t.untyped_storage().resize_(0)
    t.untyped_storage().resize_(64 * 4)


def test_an_unknown_algorithm_is_refused_when_the_group_is_made(world):
    with pytest.raises(UsageError, match="REFCOLL_ALGO='nosuch'"):
        group_with(REFCOLL_ALGO="nosuch")
    chosen = group_with(REFCOLL_ALGO="allreduce=tree,allgather=bruck")
    assert chosen.algorithms["allreduce"] == "tree" and chosen.algorithms["allgather"] == "bruck"


def test_one_ranks_bad_setting_is_every_ranks_error_when_the_group_is_made(world):
    """The rank with the bad value raised at once; the others waited in the making of the
    group's Gloo until the group's timeout (30 minutes by torch's default)."""
    last = world.size() - 1
    for bad in ({"REFCOLL_ALGO": "Bogus"}, {"REFCOLL_WATCH": "gloo", "REFCOLL_WATCH_SAMPLE": 0},
                {"REFCOLL_TIMEOUT": "5s"}):
        mine = bad if world.rank() == last else {}
        with pytest.raises(UsageError, match=f"settings: rank {last}: REFCOLL_"):
            group_with(**mine)
    assert group_with(REFCOLL_ALGO="ring").algorithms["allreduce"] == "ring"  # goes on
    assert group_with(REFCOLL_ALGO="auto").algorithms["allreduce"] == "auto"  # as unset


def test_a_rank_missing_from_a_collective_is_a_timeout_not_a_hang(world):
    short = group_with(REFCOLL_TIMEOUT=2)
    if world.rank() == 0:
        with pytest.raises(CollectiveTimeout, match="timed out after 2 s"):
            dist.all_reduce(torch.ones(3), group=short)
    dist.barrier()  # the others were never in it; the world group goes on


def test_subgroups(world):
    p, r = world.size(), world.rank()
    pair = group_with([0, 1] if p > 1 else [0])
    if r < 2:
        t = torch.full((3,), float(r + 1))
        dist.all_reduce(t, group=pair)
        assert t.tolist() == [3.0 if p > 1 else 1.0] * 3
    else:
        assert pair == dist.GroupMember.NON_GROUP_MEMBER


def test_debug_traces_every_call(world, tmp_path_factory):
    from refcoll.calls import debug

    path = tmp_path_factory.mktemp("trace") / f"trace.{world.rank()}"
    with environment(REFCOLL_DEBUG="INFO", REFCOLL_DEBUG_FILE=path):
        debug.reset()
        dist.all_reduce(torch.ones(5))
        dist.broadcast(torch.ones(5), src=0)
    debug.reset()
    text = path.read_text()
    assert "REFCOLL INFO AllReduce" in text and "count 5" in text and "Broadcast" in text


def test_ddp_trains_on_the_refcoll_group(world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    p, r = world.size(), world.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    local = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    local.load_state_dict(model.state_dict())
    ddp = DDP(model)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(r))
    ddp(x).square().sum().backward()
    local(x).square().sum().backward()
    grads = [q.grad.detach().clone() for q in local.parameters()]
    everyone = [[torch.empty_like(g) for _ in range(p)] for g in grads]
    for g, gathered in zip(grads, everyone):
        dist.all_gather(gathered, g)
    for q, gathered in zip(model.parameters(), everyone):
        stack = torch.stack(gathered).double()
        exact, scale = stack.mean(0), stack.abs().sum(0) / p
        u = 2.0 ** -24
        bound = 2 * (p + 1) * u / (1 - (p + 1) * u) * scale  # the summation, DDP's 1/p
        assert bool(((q.grad.double() - exact).abs() <= bound).all())


def test_a_tensor_that_is_not_contiguous_is_refused_not_left_unchanged(world):
    # a flat view of it would be a copy: the result would land there and be lost
    x = (torch.arange(8, dtype=torch.float32).reshape(2, 4) + 1).t()
    with pytest.raises(ValueError, match="not contiguous"):
        dist.all_reduce(x)
    with pytest.raises(ValueError, match="not contiguous"):
        dist.broadcast(x, src=0)
    y = x.contiguous()
    dist.all_reduce(y)
    assert y.tolist() == (x * world.size()).tolist()


def test_complex_ops_other_than_sums_are_refused_on_every_rank(world):
    x = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    for op in (dist.ReduceOp.PRODUCT, dist.ReduceOp.MAX):
        with pytest.raises(ValueError, match="on a complex tensor"):
            dist.reduce(x.clone(), dst=0, op=op)
    with pytest.raises(ValueError, match="on a complex tensor"):
        dist.reduce_scatter_tensor(torch.zeros(1, dtype=torch.complex64),
                                   torch.ones(world.size(), dtype=torch.complex64),
                                   op=dist.ReduceOp.PRODUCT)
    y = x.clone()
    dist.all_reduce(y)  # a sum is the complex sum
    assert y.tolist() == (x * world.size()).tolist()


def test_premul_sum_rounds_the_factor_to_the_dtype_in_every_call(ring):
    p, r = dist.get_world_size(), dist.get_rank()
    x = torch.linspace(-3, 7, 10 * p, dtype=torch.float16) + r
    factor = dist._make_nccl_premul_sum(0.1)
    whole = x.clone()
    dist.all_reduce(whole, op=factor)
    part = torch.empty(10, dtype=torch.float16)
    dist.reduce_scatter_tensor(part, x.clone(), op=factor)
    # each input times fl16(0.1), one rounding: the same products in both calls (at 2 ranks,
    # one order of the sum, so the same bits; more ranks may sum in other orders)
    if p == 2:
        assert part.tolist() == whole[10 * r:10 * (r + 1)].tolist()


def test_gather_and_scatter_pieces_unlike_the_ranks_tensors_are_refused(world):
    p, r = world.size(), world.rank()
    root = p - 1
    pieces = [torch.empty(2) for _ in range(p)] if r == root else None
    with pytest.raises(ValueError, match="the root's output for rank 0 holds 2"):
        dist.gather(torch.ones(4), pieces, dst=root)
    ins = [torch.ones(4) for _ in range(p)] if r == root else None
    with pytest.raises(ValueError, match="the root's input for rank 0 holds 4"):
        dist.scatter(torch.empty(2), ins, src=root)


def test_premul_sum_of_integers_is_refused_on_every_rank(world):
    # The factor was rounded to the integer type: 0.3 summed zeros, 2.5 scaled by 2.
    p, r = world.size(), world.rank()
    premul = dist._make_nccl_premul_sum(0.3)
    x = torch.tensor([10, 20, 30]) * (r + 1)
    with pytest.raises(ValueError, match="PREMUL_SUM on a torch.int64 tensor"):
        dist.all_reduce(x, op=premul)
    assert x.tolist() == [10 * (r + 1), 20 * (r + 1), 30 * (r + 1)]  # left as it was
    with pytest.raises(ValueError, match="PREMUL_SUM on a torch.int32 tensor"):
        dist.reduce_scatter_tensor(torch.zeros(2, dtype=torch.int32),
                                   torch.ones(2 * p, dtype=torch.int32), op=premul)
    dist.barrier()  # the group goes on


def test_bool_tensors_are_moved_as_gloo_moves_them(world):
    # Refused as a dtype refcoll does not reduce: DDP of a model with a bool buffer (a
    # causal mask) failed when it was made, at its broadcast of the buffers.
    p, r = world.size(), world.rank()
    mask = torch.tensor([True, False, r == 0])
    dist.broadcast(mask, src=0)
    assert mask.tolist() == [True, False, True]
    gathered = torch.empty(3 * p, dtype=torch.bool)
    dist.all_gather_into_tensor(gathered, torch.tensor([r % 2 == 0, True, False]))
    assert gathered.tolist() == [v for q in range(p) for v in (q % 2 == 0, True, False)]
    model = torch.nn.Linear(3, 2)
    model.register_buffer("mask", torch.tensor([r == 0, True]))
    torch.nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's buffers
    assert model.mask.tolist() == [True, True]
    with pytest.raises(UsageError, match="dtype bool, which refcoll does not reduce"):
        dist.all_reduce(torch.tensor([True]))


def test_a_complex_reduce_scatter_is_the_complex_sum(world):
    # Its reals were counted against the complex output: every call was refused.
    p, r = world.size(), world.rank()
    x = torch.arange(2 * p, dtype=torch.float32).to(torch.complex64) * (1 + 1j) + r
    out = torch.empty(2, dtype=torch.complex64)
    dist.reduce_scatter_tensor(out, x)
    whole = sum(torch.arange(2 * p, dtype=torch.float32).to(torch.complex64) * (1 + 1j) + q
                for q in range(p))
    assert out.tolist() == whole[2 * r:2 * r + 2].tolist()


def test_a_list_all_gathers_future_holds_its_outputs_as_gloos_does(world):
    p, r = world.size(), world.rank()
    outs = [torch.zeros(2) for _ in range(p)]
    value = dist.all_gather(outs, torch.ones(2) * r, async_op=True).get_future().wait()
    assert [v.tolist() for v in value] == [[q, q] for q in range(p)]  # not [[t0, t1]]
