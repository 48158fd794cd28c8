"""Watch mode: another backend does the collectives, refcoll judges a sample of every result.

The corrupting backend below is a third-party backend as torch sees one:
registered by name with ``Backend.register_backend``, a Python ProcessGroup over
Gloo that spoils one call's result as ``CORRUPT=collective:call:how`` says.
"""

import os
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
from backend_job import group_with, world  # noqa: F401 - the fixture

from refcoll.core.errors import MismatchError, UsageError, WrongResult


class Corrupting(dist.ProcessGroup):
    """Gloo's results, except call ``n`` of ``collective``, spoiled ``how`` (several such
    ``collective:n:how``, comma-separated, spoil several calls):

    * ``element``: rank 0's element 5 is one more;
    * ``percent``: rank 0's element ``n // 3 + 1`` is 1 % larger (a silent corruption);
    * ``drop``: every rank gets the sum without rank 1's input;
    * ``saturate``: an int32 sum clamped at int32's largest value instead of wrapping;
    * ``abs``: every rank's result made non-negative (a sum of -0s comes back +0);
    * ``fail``: the call fails on every rank (its Work raises);
    * ``failone``: the call fails on the last rank only.
    """

    def __init__(self, store, rank, size, timeout):
        super().__init__(rank, size)
        self.gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self.spoils = {(collective, int(n)): how for collective, n, how in
                       (spec.split(":") for spec in os.environ["CORRUPT"].split(","))}
        self.calls = {}

    def _due(self, collective: str) -> str | None:
        """Count a call of ``collective``; return how to spoil it (None: not at all)."""
        self.calls[collective] = self.calls.get(collective, 0) + 1
        return self.spoils.get((collective, self.calls[collective]))

    def allreduce(self, tensors, opts):
        t = tensors[0]
        original = t.clone()
        self.gloo.allreduce(tensors, opts).wait()
        how = self._due("allreduce")
        if how is not None:
            if how == "fail" or how == "failone" and self.rank() == self.size() - 1:
                return _Failed(RuntimeError("the library failed this call"))
            if how == "element" and self.rank() == 0:
                t.view(-1)[5] += 1
            elif how == "percent" and self.rank() == 0:
                t.view(-1)[t.numel() // 3 + 1] *= 1.01
            elif how == "abs":
                t.abs_()
            elif how == "drop":
                mine = torch.zeros_like(original) if self.rank() == 1 else original
                everyone = [torch.empty_like(original) for _ in range(self.size())]
                self.gloo.allgather([everyone], [mine]).wait()
                t.copy_(sum(everyone))
            elif how == "saturate":
                total = torch.zeros_like(original, dtype=torch.int64)
                everyone = [torch.empty_like(original) for _ in range(self.size())]
                self.gloo.allgather([everyone], [original]).wait()
                for x in everyone:
                    total += x.to(torch.int64)
                t.copy_(total.clamp(max=2**31 - 1).to(t.dtype))
        return _done(tensors)

    def reduce_scatter_single(self, output, input, opts):  # noqa: A002
        self.gloo._reduce_scatter_base(output, input, opts).wait()
        if self._due("reduce_scatter") and self.rank() == self.size() - 1:
            output.view(-1)[2] *= 2
        return _done([output])

    def all_gather_single(self, output, input, opts):  # noqa: A002
        self.gloo._allgather_base(output, input, opts).wait()
        if self._due("allgather") and self.rank() == 0:
            output.view(-1)[-1] = -1
        return _done([output])

    def allgather(self, outputs, inputs, opts):  # DDP's check of the parameters' shapes
        return self.gloo.allgather(outputs, inputs, opts)

    def broadcast(self, tensors, opts):
        return self.gloo.broadcast(tensors, opts)

    def barrier(self, opts=None):
        return self.gloo.barrier(opts) if opts is not None else self.gloo.barrier()


class _Failed(dist.Work):
    """A call the library failed: its ``wait()`` raises (a Work made from a failed future
    does not)."""

    def __init__(self, error):
        super().__init__()
        self.error = error

    def wait(self, timeout=None):
        raise self.error


def _done(value):
    future = torch.futures.Future()
    future.set_result(value)
    return torch._C._distributed_c10d._create_work_from_future(future)


class Futureless(dist.ProcessGroup):
    """Gloo's all-reduce behind a Work with no future, as some third-party backends' are;
    rank 0's element 5 is one more in the second call."""

    def __init__(self, store, rank, size, timeout):
        super().__init__(rank, size)
        self.gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        self.calls = 0

    def allreduce(self, tensors, opts):
        self.calls += 1
        spoil = tensors[0] if self.calls == 2 and self.rank() == 0 else None
        return _NoFuture(self.gloo.allreduce(tensors, opts), spoil)


class _NoFuture(dist.Work):
    """A call that completes in ``wait()`` and has no ``get_future``."""

    def __init__(self, work, spoil):
        super().__init__()
        self.work, self.spoil = work, spoil

    def wait(self, timeout=None):
        self.work.wait()
        if self.spoil is not None:
            self.spoil.view(-1)[5] += 1
            self.spoil = None
        return True


class Lenient(dist.ProcessGroup):
    """A library that moves nothing and so never notices ranks that disagree: its all-reduce
    returns at once, each rank's input unchanged."""

    def allreduce(self, tensors, opts):
        return _done(tensors)


if "CORRUPTING" not in dist.Backend._plugins:
    dist.Backend.register_backend("corrupting", Corrupting, devices=["cpu"])
    dist.Backend.register_backend("futureless", Futureless, devices=["cpu"])
    dist.Backend.register_backend("lenient", lambda store, rank, size, timeout:
                                  Lenient(rank, size), devices=["cpu"])


def watching(backend, corrupt="none:0:none", **env):
    os.environ["CORRUPT"] = corrupt
    return group_with(REFCOLL_WATCH=backend, **env)


def test_a_corrupted_element_is_caught_at_the_first_wrong_call_on_every_rank(world):
    group = watching("corrupting", "allreduce:3:element")
    p = world.size()
    for _call in (1, 2):
        t = torch.arange(40, dtype=torch.float32) * (world.rank() + 1)
        dist.all_reduce(t, group=group)
        assert t[5].item() == 5 * p * (p + 1) / 2
    t = torch.arange(40, dtype=torch.float32) * (world.rank() + 1)
    with pytest.raises(WrongResult) as caught:
        dist.all_reduce(t, group=group)
    text = str(caught.value)
    assert "watch: corrupting's allreduce sum of float32" in text and "call 3" in text
    assert "element 5" in text and "identical on every rank" in text
    assert "a conforming library returns a value in [" in text


def test_the_judging_travels_over_mpi_among_the_groups_own_ranks_under_mpiexec(world):
    """Under mpiexec the samples go over MPI (microseconds where Gloo takes hundreds), on a
    communicator of the group's ranks in the group's order; under torchrun over Gloo."""
    from refcoll.torch.launch import launcher
    from refcoll.transport.mpi import MPITransport

    p, r = world.size(), world.rank()
    members = list(range(1, p)) if p > 2 else [0, 1]  # at 3 ranks, a group without rank 0
    group = watching("corrupting", "allreduce:2:element", ranks=members)
    if r not in members:
        return
    over = group.watched.over
    mpi = sys.modules.get("mpi4py.MPI")
    threads = mpi is not None and mpi.Query_thread() == mpi.THREAD_MULTIPLE
    assert isinstance(over, MPITransport) == (launcher() == "mpiexec" and threads)
    if over is not None:
        assert over.size == len(members) and over.rank == members.index(r)
        assert over.patient and over.patience == 1  # its waits sleep: a peer comes late
        assert over.comm.allgather(mpi.COMM_WORLD.Get_rank()) == members
    x = torch.arange(40, dtype=torch.float32) * (r + 1)
    dist.all_reduce(x, group=group)
    assert x[5].item() == 5 * sum(m + 1 for m in members)
    with pytest.raises(WrongResult, match="allreduce sum of float32 over 2 ranks.*call 2"):
        dist.all_reduce(torch.arange(40, dtype=torch.float32), group=group)


def test_ranks_that_disagree_on_a_call_are_told_on_every_rank(world):
    """A library that lets the ranks pass different counts: the judging meets it (not a hang)."""
    group = watching("lenient")
    x = torch.ones(40 + world.rank())
    with pytest.raises(MismatchError, match="judged different calls: elements: rank 0 has 40"):
        dist.all_reduce(x, group=group)
    op = dist.ReduceOp.AVG if world.rank() == 0 else dist.ReduceOp.SUM  # each judged its own
    with pytest.raises(MismatchError, match="judged different calls: op: rank 0 has avg, rank 1 "
                                            "has sum"):
        dist.all_reduce(torch.ones(8), op=op, group=group)
    # A sum has checksums and a max none: records of other sizes (once a hang to the
    # deadline, only the rank with checksums agreeing first); codes named (once KeyError).
    op = dist.ReduceOp.SUM if world.rank() == 0 else dist.ReduceOp.MAX
    with pytest.raises(MismatchError, match="judged different calls: op: rank 0 has sum, rank 1 "
                                            "has max"):
        dist.all_reduce(torch.ones(8), op=op, group=group)
    dtype = torch.float16 if world.rank() == 0 else torch.bfloat16
    with pytest.raises(MismatchError, match="judged different calls: dtype: rank 0 has float16, "
                                            "rank 1 has bfloat16"):
        dist.all_reduce(torch.ones(8, dtype=dtype), group=group)


def test_watch_settings_that_differ_between_ranks_are_refused_on_every_rank(world):
    with pytest.raises(UsageError, match="settings differ between ranks: REFCOLL_WATCH"):
        watching("gloo", REFCOLL_WATCH_SAMPLE=64 if world.rank() == 0 else 32)
    with pytest.raises(UsageError, match="settings differ between ranks: REFCOLL_WATCH.*unset"):
        group_with(REFCOLL_WATCH="gloo" if world.rank() == 0 else "")


def test_a_wrong_gradient_under_ddp_is_raised_from_backward_not_a_crash(world):
    # The Work's future was failed with set_exception, which DDP's reducer reads as a
    # list of tensors: the process ended with SIGSEGV and said nothing.
    from torch.nn.parallel import DistributedDataParallel as DDP

    group = watching("corrupting", "allreduce:1:element")
    torch.manual_seed(0)
    ddp = DDP(torch.nn.Linear(40, 3), process_group=group)
    torch.manual_seed(1 + world.rank())
    loss = ddp(torch.randn(8, 40)).square().sum()
    with pytest.raises(RuntimeError) as caught:
        loss.backward()
    text = str(caught.value)
    assert "WrongResult: watch: corrupting's allreduce sum of float32" in text, text


def test_the_last_unclosed_batch_is_judged_when_its_group_is_destroyed(world):
    # Calls 5 and 6 of batches of 4 closed no batch: call 5's wrong result went unseen.
    group = watching("corrupting", "allreduce:5:element", REFCOLL_WATCH_BATCH=4)
    works = [dist.all_reduce(torch.arange(40, dtype=torch.float32) * (world.rank() + 1),
                             group=group, async_op=True) for _ in range(6)]
    for work in works:
        work.wait()  # batch 1-4 right; 5 and 6 wait for a batch that never closes
    with pytest.raises(WrongResult, match="allreduce sum of float32 .*call 5"):
        dist.destroy_process_group(group)


def test_a_wrong_call_never_waited_for_is_logged_when_its_group_is_destroyed(world, caplog):
    import logging

    group = watching("corrupting", "allreduce:2:element")
    works = [dist.all_reduce(torch.arange(40, dtype=torch.float32), group=group, async_op=True)
             for _ in range(3)]
    works[0].wait()  # the wrong call 2 is never waited for: no wait() raises it
    with caplog.at_level(logging.ERROR, logger="refcoll.watch"):
        dist.destroy_process_group(group)
    logged = [r.getMessage() for r in caplog.records if r.name == "refcoll.watch"]
    assert len(logged) == 1 and "call 2" in logged[0] and "never waited for" in logged[0]


@pytest.mark.parametrize("collective", ["allgather", "reduce_scatter"])
def test_coalesced_calls_the_library_lacks_run_as_its_single_calls_each_judged(world, collective):
    """The corrupting library (as Gloo) has no coalesced all-gather or reduce-scatter into
    tensors (DTensor's and FSDP's): each pair runs as its single call and is judged as one,
    so the coalesced call's second piece, spoiled, is caught."""
    p, r = world.size(), world.rank()
    group = watching("corrupting", f"{collective}:4:element")
    gathering = collective == "allgather"
    inputs = [torch.arange(4.0) + r, torch.arange(3.0 * p) * (r + 1)]
    if gathering:
        want = [torch.cat([torch.arange(4.0) + q for q in range(p)]),
                torch.cat([torch.arange(3.0 * p) * (q + 1) for q in range(p)])]
    else:
        total = sum(range(1, p + 1))
        want = [None, (torch.arange(3.0 * p) * total)[3 * r:3 * r + 3]]  # (4 is not p·k)
        inputs[0] = torch.arange(2.0 * p) + r
        want[0] = (torch.arange(2.0 * p) * p + sum(range(p)))[2 * r:2 * r + 2]

    def coalesced():
        outs = [torch.empty_like(w) for w in want]
        with dist._coalescing_manager(group=group, async_ops=True) as manager:
            for out, x in zip(outs, inputs):
                if gathering:
                    dist.all_gather_into_tensor(out, x, group=group)
                else:
                    dist.reduce_scatter_tensor(out, x, group=group)
        manager.wait()
        return outs

    got = coalesced()  # calls 1 and 2: right
    assert [g.tolist() for g in got] == [w.tolist() for w in want]
    with pytest.raises(WrongResult, match=f"{collective} .*call 4"):
        coalesced()  # calls 3 and 4: the fourth spoiled


def test_a_missing_contribution_is_caught_in_a_large_call_by_its_sample(world):
    group = watching("corrupting", "allreduce:1:drop", REFCOLL_WATCH_SAMPLE=16)
    t = torch.ones(100_000) * (world.rank() + 1)
    with pytest.raises(WrongResult, match="16 elements sampled of 100000") as caught:
        work = dist.all_reduce(t, group=group, async_op=True)
        work.wait()
    assert "within the error bound" in str(caught.value)


@pytest.mark.parametrize("n", [4096, 1 << 20, pytest.param(1 << 26, marks=pytest.mark.slow)])
def test_one_element_off_by_one_percent_is_caught_by_the_block_checksums(world, n):
    """The 16 sampled elements miss it; the checksums see every element, in every call."""
    group = watching("corrupting", "allreduce:2:percent", REFCOLL_WATCH_SAMPLE=16)
    rng = torch.Generator().manual_seed(world.rank())
    t = 1 + torch.rand(n, generator=rng)
    dist.all_reduce(t, group=group)  # call 1: right, and judged so
    t = 1 + torch.rand(n, generator=rng)
    with pytest.raises(WrongResult, match="every element checked in blocks of") as caught:
        dist.all_reduce(t, group=group)
    text, wrong = str(caught.value), n // 3 + 1
    assert "call 2" in text and "rank 0's elements" in text
    lo, hi = (int(v) for v in text.split("rank 0's elements ")[1].split(" ")[0].split(".."))
    assert lo <= wrong <= hi


def test_a_batch_judged_together_still_names_the_wrong_call_and_its_block(world):
    """Three calls of different sizes, judged as one; the second is 1 % off unsampled."""
    group = watching("corrupting", "allreduce:2:percent", REFCOLL_WATCH_SAMPLE=16,
                     REFCOLL_WATCH_BATCH=3)
    rng = torch.Generator().manual_seed(world.rank())
    for n in (5000, 9000):  # judged only when the third call completes
        dist.all_reduce(1 + torch.rand(n, generator=rng), group=group)
    with pytest.raises(WrongResult, match="every element checked in blocks of") as caught:
        dist.all_reduce(1 + torch.rand(300, generator=rng), group=group)
    text, wrong = str(caught.value), 9000 // 3 + 1
    assert "call 2" in text and "call 1" not in text and "call 3" not in text
    lo, hi = (int(v) for v in text.split("rank 0's elements ")[1].split(" ")[0].split(".."))
    assert lo <= wrong <= hi < 9000


def test_checksums_can_be_turned_off_and_then_the_sample_alone_judges(world):
    group = watching("corrupting", "allreduce:1:percent", REFCOLL_WATCH_SAMPLE=16,
                     REFCOLL_WATCH_CHECKSUMS="off")
    t = 1 + torch.rand(4096, generator=torch.Generator().manual_seed(world.rank()))
    dist.all_reduce(t, group=group)  # element 1366 is not among the 16 sampled


def test_a_sum_of_negative_zeros_that_comes_back_positive_is_caught(world):
    """-0 + -0 is -0 in every order: +0 is within every bound of 0, but not a sum of -0s."""
    group = watching("corrupting", "allreduce:2:abs")
    t = torch.full((8,), -0.0)
    dist.all_reduce(t, group=group)
    assert torch.signbit(t).all()
    with pytest.raises(WrongResult, match="every operand is -0, so every order gives -0.0"):
        dist.all_reduce(torch.full((8,), -0.0), group=group)


def test_a_saturating_integer_sum_is_caught(world):
    group = watching("corrupting", "allreduce:1:saturate")
    t = torch.full((8,), 2**30 + 7, dtype=torch.int32)
    with pytest.raises(WrongResult, match="allreduce sum of int32"):
        dist.all_reduce(t, group=group)


def test_reduce_scatter_and_allgather_name_the_real_element(world):
    p, r = world.size(), world.rank()
    group = watching("corrupting", "reduce_scatter:1:x")
    out = torch.empty(10)
    with pytest.raises(WrongResult, match=rf"rank {p - 1}'s output element 2 \(global element "
                                          rf"{10 * (p - 1) + 2}\)"):
        dist.reduce_scatter_single(out, torch.arange(10.0 * p) + r, group=group)
    group = watching("corrupting", "allgather:1:x")
    whole = torch.empty(6 * p)
    with pytest.raises(WrongResult, match=rf"element {6 * p - 1}\b"):
        dist.all_gather_single(whole, torch.arange(6.0) + 10 * r, group=group)


def test_log_instead_of_raise(world):
    group = watching("corrupting", "allreduce:1:element", REFCOLL_WATCH_ACTION="log")
    t = torch.arange(10, dtype=torch.float32)
    dist.all_reduce(t, group=group)  # no exception: training goes on
    assert len(group.watched.findings) == 1 and "element 5" in group.watched.findings[0]


def test_no_false_alarm_over_many_calls_on_gloo(world):
    p, r = world.size(), world.rank()
    group = watching("gloo")
    rng = np.random.default_rng([7, r])
    for step in range(150):
        kind = step % 5
        dtype = [torch.float32, torch.bfloat16, torch.int32][step % 3]
        n = int(np.random.default_rng(step).integers(1, 3000))
        x = torch.from_numpy(rng.standard_normal(n * p).astype(np.float32) * 100).to(dtype)
        if kind == 0:
            op = [dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN][step % 3]
            dist.all_reduce(x, op=op, group=group)
        elif kind == 1:
            dist.reduce_scatter_single(torch.empty(n, dtype=dtype), x, group=group)
        elif kind == 2:
            dist.all_gather_single(torch.empty(n * p * p, dtype=dtype), x, group=group)
        elif kind == 3:
            dist.broadcast(x, src=step % p, group=group)
        else:
            dist.reduce(x, dst=step % p, group=group)
    assert group.watched.calls == 150 and not group.watched.findings


def test_watch_settings_are_checked_when_the_group_is_made(world):
    with pytest.raises(UsageError, match="not a backend torch knows"):
        watching("nosuch")
    for bad in (0, 1 << 17, "²"):  # "²" is a digit to str.isdigit, not to int()
        with pytest.raises(UsageError, match="REFCOLL_WATCH_SAMPLE"):
            watching("gloo", REFCOLL_WATCH_SAMPLE=bad)
    with pytest.raises(UsageError, match="cannot watch itself"):
        watching("refcoll")


def test_an_integer_average_on_gloo_truncates_as_refcolls_on_every_rank(world):
    """Gloo's SUM then out.div_(p) cannot write a float quotient into an int tensor: a
    reduce's root raised alone and the others waited out the deadline in the judging."""
    group = watching("gloo")
    p, r, last = world.size(), world.rank(), world.size() - 1
    x = torch.tensor([-7, -1, 0, 5, 9], dtype=torch.int32) * (r + 1)
    total = torch.tensor([-7, -1, 0, 5, 9], dtype=torch.int64) * (p * (p + 1) // 2)
    want = torch.div(total, p, rounding_mode="trunc").to(torch.int32)
    y = x.clone()
    dist.all_reduce(y, op=dist.ReduceOp.AVG, group=group)
    assert y.tolist() == want.tolist()
    y = x.clone()
    dist.reduce(y, dst=last, op=dist.ReduceOp.AVG, group=group)
    if r == last:
        assert y.tolist() == want.tolist()
    z = torch.ones(2)
    dist.all_reduce(z, group=group)  # the group goes on
    assert z.tolist() == [float(p)] * 2


def test_avg_and_premul_sum_on_gloo_are_sums_with_the_factor_and_the_division(world):
    # Gloo has neither; FSDP2 asks a "refcoll" group for AVG, so watch mode gives Gloo a SUM
    p, r = world.size(), world.rank()
    group = watching("gloo")
    t = torch.arange(12, dtype=torch.float32) + r
    dist.all_reduce(t, op=dist.ReduceOp.AVG, group=group)
    assert t.tolist() == [k + (p - 1) / 2 for k in range(12)]
    out = torch.empty(4)
    x = torch.ones(4 * p) * (r + 1)
    dist.reduce_scatter_single(out, x, op=dist._make_nccl_premul_sum(0.5), group=group)
    assert out.tolist() == [0.5 * p * (p + 1) / 2] * 4 and x.tolist() == [r + 1.0] * (4 * p)
    assert not group.watched.findings


def test_samples_batched_are_judged_together_naming_the_wrong_call(world):
    group = watching("corrupting", "allreduce:2:element", REFCOLL_WATCH_BATCH=3)
    results = []
    for _ in range(2):  # calls 1 and 2 complete: their samples wait for the third
        t = torch.arange(10, dtype=torch.float32)
        dist.all_reduce(t, group=group)
        results.append(t)
    with pytest.raises(WrongResult, match=r"call 2, 10 elements sampled .* element 5"):
        dist.all_reduce(torch.arange(10, dtype=torch.float32), group=group)
    assert group.watched.calls == 3 and not group.watched.pending


def test_no_false_alarm_on_premul_sum_in_half_precision_nor_on_strided_tensors(world):
    group = watching("gloo")
    for dtype in (torch.float16, torch.bfloat16):  # FSDP2's reduce_dtype with a divide factor
        t = torch.linspace(-3, 7, 100, dtype=dtype) + world.rank()
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.1), group=group)
    strided = (torch.arange(8, dtype=torch.float32).reshape(2, 4) + 1).t()
    dist.all_reduce(strided, group=group)  # judged through copies of its elements
    assert strided.tolist() == ((torch.arange(8.0).reshape(2, 4) + 1).t()
                                * world.size()).tolist()
    assert not group.watched.findings


def test_premul_sum_with_each_ranks_own_factor_is_judged_with_each_ranks_factor(world):
    """NCCL's pre-multiplier is each rank's (a weighted average of uneven batches), and so
    is Gloo's under watch mode: judged with every rank's own factor, the sample and the
    checksums raise no false alarm, a plain SUM beside them counting as a factor of 1."""
    group = watching("gloo", REFCOLL_WATCH_SAMPLE="4096")
    r, p = world.rank(), world.size()
    factor = 1.0 / (r + 2)
    for plain_on_0 in (False, True):
        op = dist.ReduceOp.SUM if plain_on_0 and r == 0 else dist._make_nccl_premul_sum(factor)
        t = torch.linspace(1, 2, 4096)
        dist.all_reduce(t, op=op, group=group)
        every = [1.0 if plain_on_0 and q == 0 else 1.0 / (q + 2) for q in range(p)]
        assert torch.allclose(t, torch.linspace(1, 2, 4096) * sum(every), rtol=1e-5)
    assert not group.watched.findings


def test_a_watched_call_that_fails_leaves_its_batch_judged_without_it(world):
    group = watching("corrupting", "allreduce:1:fail", REFCOLL_WATCH_BATCH=3)
    with pytest.raises(RuntimeError, match="the library failed this call"):
        dist.all_reduce(torch.ones(4), group=group)
    for _ in range(3):
        t = torch.ones(4)
        dist.all_reduce(t, group=group)
        assert t.tolist() == [float(world.size())] * 4
    assert not group.watched.findings


def test_a_buffer_reused_once_its_call_is_done_is_no_false_alarm(world):
    """A batch's calls are read when each completes, before the program may reuse them."""
    group = watching("gloo", REFCOLL_WATCH_BATCH=3)
    for n in (100, 5000, 300):
        t = torch.arange(n, dtype=torch.float32)
        work = dist.all_reduce(t, group=group, async_op=True)
        work.wait()
        assert t[7].item() == 7 * world.size()
        t.fill_(-7.0)  # reused at once: the sample and the checksums were taken already
    assert group.watched.calls == 3 and not group.watched.pending
    assert not group.watched.findings


def test_a_tensor_watched_can_still_be_freed_and_regrown(world):
    """FSDP frees a gathered parameter with storage().resize_(0); reading a sample through
    Tensor.numpy() made every such storage never resizable again."""
    group = watching("gloo")
    p, r = world.size(), world.rank()
    summed, gathered = torch.ones(64), torch.ones(32 * p)
    dist.all_reduce(summed, group=group)
    dist.all_gather_single(gathered, gathered[r * 32:(r + 1) * 32], group=group)
    for t in (summed, gathered):
        size = t.untyped_storage().nbytes()
        t.untyped_storage().resize_(0)
        t.untyped_storage().resize_(size)
    assert not group.watched.findings


def test_a_library_work_without_a_future_is_judged_all_the_same(world):
    """Without a future to read it from, each call is read by a job on the progress engine."""
    group = watching("futureless", REFCOLL_WATCH_BATCH=2)
    p = world.size()
    t = torch.arange(40, dtype=torch.float32)
    dist.all_reduce(t, group=group)  # call 1: right; its sample waits for call 2
    assert t[5].item() == 5 * p
    t = torch.arange(40, dtype=torch.float32)
    with pytest.raises(WrongResult, match=r"call 2, 40 elements sampled .* element 5"):
        dist.all_reduce(t, group=group)


def test_a_tensor_strided_on_one_rank_only_is_judged_on_every_rank(world):
    """Gloo reduces a tensor's memory, not its elements: a transposed view on one rank
    against plain tensors on the others sums unrelated elements. Every rank samples the
    call (a strided tensor through a copy), so every rank judges it and raises, and the
    ranks judge the same calls after it."""
    group = watching("gloo")
    r, p = world.rank(), world.size()
    x = torch.arange(40, dtype=torch.float32).reshape(8, 5) * (r + 1)
    if r == 1:
        x = x.t().contiguous().t()  # the same values, column-major
    with pytest.raises(WrongResult, match="gloo's allreduce sum of float32 over"):
        dist.all_reduce(x, group=group)
    y = torch.arange(12, dtype=torch.float32).reshape(3, 4).t() * (r + 1)  # strided everywhere
    dist.all_reduce(y, group=group)
    assert y.tolist() == (torch.arange(12.0).reshape(3, 4).t() * (p * (p + 1) // 2)).tolist()
    assert not group.watched.findings


def test_premul_sum_is_judged_with_the_factor_as_torch_rounds_it(world):
    # torch (and NCCL's scalar) round a Python float to a 16-bit float through float32;
    # the judge rounded it once, to another factor (bfloat16: 1 against 1 + 2**-7), and
    # checksums took it unrounded, wrong by far more than a float16 subnormal's rounding.
    group = watching("gloo", REFCOLL_WATCH_SAMPLE="4096")
    cases = [(torch.bfloat16, 1 + 2**-8 + 2**-30, 3.0), (torch.float16, 1 + 2**-11 + 2**-40, 3.0),
             (torch.float16, 167.5 * 2**-24, 1000.0), (torch.float16, 3e-7, 1000.0)]
    for dtype, factor, value in cases:
        t = torch.full((4096,), value, dtype=dtype)
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(factor), group=group)
        rounded = torch.tensor(factor, dtype=dtype)
        assert t[0].item() == (torch.tensor(value, dtype=dtype) * rounded).item() * world.size()
    assert not group.watched.findings


def test_a_premul_sum_reduce_leaves_a_non_roots_tensor_as_it_was(world):
    # Only the root's tensor is the reduce's output: the factor went into every rank's.
    group = watching("gloo")
    r, p = world.rank(), world.size()
    t = torch.ones(10) * (r + 1)
    dist.reduce(t, dst=0, op=dist._make_nccl_premul_sum(0.5), group=group)
    expected = 0.5 * p * (p + 1) / 2 if r == 0 else r + 1.0
    assert t.tolist() == [expected] * 10
    assert not group.watched.findings


def test_a_watched_calls_tensors_are_let_go_once_they_are_read(world):
    # The judging Works kept every call's output (up to 32 of them) and the pending
    # samples theirs until their batch closed: freed tensors stayed alive.
    import gc
    import weakref

    for batch in ("1", "8"):
        group = watching("gloo", REFCOLL_WATCH_BATCH=batch)
        refs = []
        for _ in range(10):
            x, out = torch.randn(100 * world.size()), torch.empty(100)
            dist.reduce_scatter_single(out, x, group=group)
            refs += [weakref.ref(x), weakref.ref(out)]
            del x, out
        gc.collect()
        assert [ref() for ref in refs] == [None] * len(refs), f"batch {batch}"
        assert not group.watched.findings


@pytest.mark.parametrize("batch", ["1", "3"])
def test_a_call_that_fails_on_one_rank_keeps_the_ranks_judging_in_step(world, batch):
    # The rank where it failed left its sample out of the exchange (or skipped it): the
    # others then exchanged records of another size (a crash in Gloo) or waited for ever.
    group = watching("corrupting", "allreduce:2:failone", REFCOLL_WATCH_BATCH=batch,
                     REFCOLL_TIMEOUT="60")
    last = world.rank() == world.size() - 1
    for call in range(1, 7):
        t = torch.arange(8, dtype=torch.int32)
        if call == 2 and last:
            with pytest.raises(RuntimeError, match="the library failed this call"):
                dist.all_reduce(t, group=group)
            continue
        dist.all_reduce(t, group=group)
        assert t.tolist() == [k * world.size() for k in range(8)]
    dist.destroy_process_group(group)
    assert not group.watched.findings


def test_a_failed_call_closing_a_batch_leaves_the_wrong_calls_before_it_told(world, caplog):
    # Its failure was raised and the batch's earlier calls went unjudged: a wrong result lost.
    import logging

    group = watching("corrupting", "allreduce:1:element,allreduce:2:fail",
                     REFCOLL_WATCH_BATCH=2)
    dist.all_reduce(torch.arange(10, dtype=torch.float32), group=group)
    with caplog.at_level(logging.ERROR, logger="refcoll.watch"):
        with pytest.raises(RuntimeError, match="the library failed this call"):
            dist.all_reduce(torch.arange(10, dtype=torch.float32), group=group)
    assert len(group.watched.findings) == 1 and "call 1" in group.watched.findings[0]
    assert any("call 1" in r.getMessage() for r in caplog.records if r.name == "refcoll.watch")
