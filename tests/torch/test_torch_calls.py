"""refcoll on torch tensors over Gloo: the tensor calls, bad input, splits, and DDP's comm hook.

Runs in every process of a torchrun or mpiexec job (tests/test_torch.py). Every
expected value is refcoll's simulator run on every rank's inputs, which each rank
builds from its rank number alone.
"""

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch_job import transport  # noqa: F401 - the fixture

import refcoll
import refcoll.torch as rt
from refcoll.core.bits import same_bits
from refcoll.verify.oracle import gamma


def _inputs(p: int, n: int, dtype=torch.float32, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, generator=g) * 10).to(dtype) for _ in range(p)]


def _bits(tensor) -> np.ndarray:
    return rt.tensors.as_array(tensor.contiguous(), rt.transport_for())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn,
                                   torch.int32])
def test_allreduce_of_a_tensor_is_the_simulators(transport, dtype):
    # float8 and bfloat16 travel as bytes: Gloo's own all_reduce has no float8.
    p, r = transport.size, transport.rank
    xs = [x if dtype.is_floating_point else x.to(torch.int32) for x in _inputs(p, 37)]
    xs = [x.to(dtype) for x in xs]
    got = rt.allreduce(xs[r], algorithm="ring")
    want = refcoll.simulate("allreduce", [_bits(x) for x in xs], algorithm="ring").outputs[r]
    assert got.dtype == dtype and got.shape == xs[r].shape
    assert same_bits(_bits(got), want)


def test_in_place_writes_the_callers_memory(transport):
    p, r = transport.size, transport.rank
    xs = _inputs(p, 50)
    x = xs[r].clone()
    address = x.data_ptr()
    out = rt.allreduce(x, out=x, algorithm="rabenseifner")
    want = refcoll.simulate("allreduce", [_bits(v) for v in xs], algorithm="rabenseifner")
    assert out is x and x.data_ptr() == address
    assert same_bits(_bits(x), want.outputs[r])


@pytest.mark.parametrize("name,root", [("reduce_scatter", None), ("allgather", None),
                                       ("broadcast", 0), ("reduce", 0)])
def test_the_other_collectives(transport, name, root):
    p, r = transport.size, transport.rank
    xs = _inputs(p, 3 * p + 1)
    kwargs = {} if root is None else {"root": root}
    got = getattr(rt, name)(xs[r], **kwargs)
    algorithm = "ring" if root is None else "naive"
    want = refcoll.simulate(name, [_bits(x) for x in xs], algorithm=algorithm, **kwargs)
    if want.outputs[r] is None:
        assert got is None
    else:
        assert same_bits(_bits(got), want.outputs[r])


def test_a_process_group_is_a_comm(transport):
    p, r = transport.size, transport.rank
    xs = [np.full(5, float(k + 1)) for k in range(p)]
    got = refcoll.allreduce(xs[r], dist.group.WORLD, algorithm="tree")
    assert same_bits(got, refcoll.simulate("allreduce", xs, algorithm="tree").outputs[r])


def test_nonblocking_calls_outstanding_together(transport):
    p, r = transport.size, transport.rank
    xs = [_inputs(p, 40, seed=s) for s in range(3)]
    handles = [rt.iallreduce(x[r], algorithm=a) for x, a in zip(xs, ["ring", "tree", "auto"])]
    blocking = rt.allreduce(xs[0][r], algorithm="recursive_doubling")  # queues behind them
    for x, a, h in zip(xs, ["ring", "tree", "auto"], handles):
        want = refcoll.simulate("allreduce", [_bits(v) for v in x],
                                algorithm="ring" if a == "auto" and p == 1 else a)
        if a != "auto":
            assert same_bits(_bits(h.wait()), want.outputs[r])
        else:
            assert h.wait().shape == x[r].shape
    want = refcoll.simulate("allreduce", [_bits(v) for v in xs[0]], algorithm="recursive_doubling")
    assert same_bits(_bits(blocking), want.outputs[r])


def test_split_halves_run_their_own_calls(transport):
    p, r = transport.size, transport.rank
    half = transport.split(r % 2, r)
    members = [k for k in range(p) if k % 2 == r % 2]
    xs = {k: np.full(7, float(k + 1), np.float32) for k in range(p)}
    got = refcoll.allreduce(xs[r], half, algorithm="ring")
    whole = refcoll.allreduce(xs[r], transport, algorithm="ring")
    assert half.size == len(members) and half.rank == members.index(r)
    assert half._context != transport._context
    assert same_bits(got, refcoll.simulate("allreduce", [xs[k] for k in members],
                                           algorithm="ring").outputs[half.rank])
    assert same_bits(whole, refcoll.simulate("allreduce", list(xs.values()),
                                             algorithm="ring").outputs[r])
    assert transport.split(-1, r) is None


class _FakeCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: the Gloo check, on a machine without a GPU."""

    @property
    def is_cuda(self):
        return True


def _bad(kind: str, r: int, bad_rank: int):
    if r != bad_rank:
        return torch.zeros(6)
    return {"non-contiguous": lambda: torch.zeros(6, 2)[:, 0],
            "complex dtype": lambda: torch.zeros(6, dtype=torch.complex64),
            "CUDA on Gloo": lambda: torch.zeros(6).as_subclass(_FakeCuda),
            "shape": lambda: torch.zeros(7),
            "not a tensor": lambda: [0.0] * 6}[kind]()


@pytest.mark.parametrize("kind,words", [("non-contiguous", "not contiguous"),
                                        ("complex dtype", "complex64"),
                                        ("CUDA on Gloo", "Gloo moves CPU tensors"),
                                        ("shape", "count"),
                                        ("not a tensor", "torch.Tensor")])
def test_bad_input_is_an_error_on_every_rank(transport, kind, words):
    p, r = transport.size, transport.rank
    bad_rank = p - 1
    if p == 1 and kind == "shape":  # one rank cannot disagree with itself
        assert rt.allreduce(_bad(kind, r, bad_rank)).shape == (7,)
        return
    with pytest.raises((TypeError, ValueError)) as caught:
        rt.allreduce(_bad(kind, r, bad_rank))
    assert words in str(caught.value)
    if r != bad_rank and kind != "shape":
        assert f"rank {bad_rank}" in str(caught.value)
    # the group is still usable, in step on every rank
    assert float(rt.allreduce(torch.ones(2))[0]) == p


def _model():
    """1.7 MB of parameters: DDP starts with one bucket and rebuilds two (its first is 1 MiB)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 1024), torch.nn.Tanh(),
                               torch.nn.Linear(1024, 384), torch.nn.Tanh(), torch.nn.Linear(384, 5))


def _batch(r: int, step: int):
    g = torch.Generator().manual_seed(1000 * r + step)
    return torch.randn(16, 20, generator=g), torch.randint(0, 5, (16,), generator=g)


def _backward(ddp, r: int, step: int) -> None:
    x, y = _batch(r, step)
    torch.nn.functional.cross_entropy(ddp(x), y).backward()


def test_ddp_ring_hook_is_the_simulators_and_within_the_bound_of_ddps(transport):
    p, r = transport.size, transport.rank
    ours = DDP(_model())
    state, hook = rt.comm_hook(algorithm="ring", record=True)
    ours.register_comm_hook(state, hook)
    theirs = DDP(_model())
    for step in range(2):  # the second iteration runs on DDP's rebuilt buckets
        for ddp in (ours, theirs):
            ddp.zero_grad()
            _backward(ddp, r, step)
    assert len(state.last) == 2 and state.calls == 3  # one bucket, then the two rebuilt
    # Each bucket's average: bit for bit refcoll.simulate of ring on every rank's bucket.
    for index, (bucket_in, bucket_out) in sorted(state.last.items()):
        every = refcoll.allgather(bucket_in, transport).reshape(p, -1)
        want = refcoll.simulate("allreduce", list(every), algorithm="ring", op="avg")
        assert same_bits(bucket_out, want.outputs[r]), f"bucket {index}"
    # Against DDP's default (Gloo's all-reduce of g * fl(1/p)): each within the summation
    # bound of the exact mean (one rounding more for DDP's, its multiplication by fl(1/p)).
    local = _model()  # no optimizer step ran: this rank's own gradients of the last step
    _backward(local, r, 1)
    u = 2.0 ** -24
    for a, b, c in zip(ours.parameters(), theirs.parameters(), local.parameters()):
        every = refcoll.allgather(_bits(c.grad).reshape(-1), transport).reshape(p, -1)
        mean_abs = np.abs(every.astype(np.float64)).sum(axis=0) / p
        bound = (gamma(p, u) + gamma(p + 1, u)) * mean_abs * (1 + 2.0 ** -40)
        diff = np.abs(_bits(a.grad).astype(np.float64) - _bits(b.grad).astype(np.float64))
        assert (diff.reshape(-1) <= bound).all()
        assert not same_bits(_bits(a.grad), _bits(c.grad)) or p == 1


@pytest.mark.parametrize("spec", ["ef(topk:ratio=0.01)", "powersgd:rank=2"])
def test_ddp_compressed_hooks_train_and_carry_state_across_the_rebuild(transport, spec):
    p, r = transport.size, transport.rank
    ddp = DDP(_model())
    state, hook = rt.comm_hook(compressor=spec)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    for step in range(3):
        opt.zero_grad()
        _backward(ddp, r, step)
        opt.step()
    # The parameters stay equal on every rank: each applied the same averaged gradient.
    flat = torch.cat([q.detach().reshape(-1) for q in ddp.parameters()])
    every = refcoll.allgather(_bits(flat), transport).reshape(p, -1)
    assert all(same_bits(every[k], every[0]) for k in range(p))
    # DDP's rebuild: one bucket, then two.
    assert state.calls == 1 + 2 * 2
    if spec.startswith("ef"):  # each parameter's residual moved to its new bucket
        assert state.layouts == 3 and state.carried == len(list(ddp.parameters()))
    else:  # PowerSGD: a state per parameter, whatever bucket it is in
        assert state.layouts == 0 and len(state._tensors) == len(list(ddp.parameters()))
    assert state.sent > 0 or p == 1


def test_a_hooks_error_reaches_ddp_named_on_every_rank(transport):
    """Ranks whose hooks name other algorithms: every rank's backward raises refcoll's
    MismatchError by its name and message (a future given an exception read as a result
    used to give "Unable to cast ... to Tensor")."""
    r = transport.rank
    ddp = DDP(_model())
    ddp.register_comm_hook(*rt.comm_hook(algorithm="ring" if r == 0 else "tree"))
    with pytest.raises(RuntimeError) as caught:
        _backward(ddp, r, 0)
    said = str(caught.value)
    assert "MismatchError: ranks called allreduce_init with different arguments" in said, said
    assert "Unable to cast" not in said


def test_a_sparse_gradient_is_refused_by_name_not_as_a_strided_buffer(transport):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    ddp = DDP(model)
    ddp.register_comm_hook(*rt.comm_hook(algorithm="ring"))
    with pytest.raises(RuntimeError) as caught:
        ddp(torch.tensor([1, 2, 3])).sum().backward()
    said = str(caught.value)
    assert "holds a torch.sparse_coo gradient" in said and "strides" not in said, said
