"""Launch the torch half of the suite: tests/torch/ under torchrun and under mpiexec.

Both launchers start the same processes; :func:`refcoll.torch.init_process_group`
starts the Gloo group from either. The serial tests below need no job: the tensor
conversions and the hook's state across DDP's bucket rebuild.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, mpiexec_path

torch = pytest.importorskip("torch", reason="the torch tests need torch: pip install "
                                           "torch==2.13.0 (README's test command does)")

MPIEXEC = mpiexec_path()


def _job(launcher: str, p: int, *args: str) -> list[str]:
    """Return the command that starts ``python ARGS`` in ``p`` processes with ``launcher``."""
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={p}", *args]
    return [MPIEXEC, "-n", str(p), sys.executable, *args]


def _run(launcher: str, p: int, *args: str, **env_vars):
    if launcher == "mpiexec" and MPIEXEC is None:
        pytest.skip("no mpiexec: install with pip install 'refcoll[mpi]'")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "PMIX_", "MASTER_", "RANK", "WORLD_SIZE",
                                "LOCAL_RANK"))}
    env.update(REFCOLL_TORCH_JOB="1", OMP_NUM_THREADS="1", **env_vars)
    return subprocess.run(_job(launcher, p, *args), capture_output=True, text=True, timeout=900,
                          env=env, cwd=ROOT)


# Three processes under mpiexec run by default (one process: in this process, below), every
# size from 1 to 4 under both launchers with -m slow: they start the same processes, which
# init_process_group reads either way, and the backend's suite (test_torch_backend.py) runs
# two under torchrun by default.
SLOW = pytest.mark.slow


@pytest.mark.parametrize("launcher,p", [("mpiexec", 3),
                                        *[pytest.param(launcher, p, marks=SLOW)
                                          for launcher in ("torchrun", "mpiexec")
                                          for p in range(1, 5)
                                          if (launcher, p) != ("mpiexec", 3)]])
def test_torch_suite(launcher, p):
    res = _run(launcher, p, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
               str(ROOT / "tests" / "torch"))
    assert res.returncode == 0, (f"{launcher} with {p} processes failed:\n{res.stdout[-6000:]}\n"
                                 f"{res.stderr[-3000:]}")
    assert " passed" in res.stdout and " failed" not in res.stdout


@SLOW
@pytest.mark.parametrize("launcher,p", [("torchrun", 1), ("torchrun", 2), ("mpiexec", 3),
                                        ("torchrun", 4)])
def test_every_case_of_the_battery_over_the_torch_transport(launcher, p):
    res = _run(launcher, p, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "slow",
               str(ROOT / "tests" / "torch" / "test_torch_battery.py"))
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    assert "1 passed" in res.stdout


@pytest.mark.parametrize("launcher,mode,error", [
    ("mpiexec", "absent", "CollectiveTimeout: rank 0: allreduce over torch (gloo) timed out "
                          "after 2 s at its exchange 1"),
    ("mpiexec", "dead", "PeerFailure: rank 0: allreduce over torch (gloo) failed"),
    pytest.param("torchrun", "absent", "CollectiveTimeout: rank 0: allreduce over torch (gloo) "
                 "timed out", marks=SLOW)])  # what mpiexec's shows, by the same code
def test_a_peer_absent_from_its_first_call_or_dead_is_an_error_not_a_hang(launcher, mode, error,
                                                                         tmp_path):
    # A dead peer is seen at once (its connection closes): a long deadline shows it is not a
    # timeout. An absent one stays until rank 0 has timed out, however loaded the machine.
    res = _run(launcher, 2, str(ROOT / "tests" / "torch" / "peer_gone.py"), mode,
               str(tmp_path / "done"), REFCOLL_TIMEOUT="2" if mode == "absent" else "60")
    said = (tmp_path / "done").read_text() if (tmp_path / "done").exists() else ""
    assert said.startswith(f"OK {error}"), said + res.stdout[-3000:] + res.stderr[-3000:]
    assert "waiting to receive" in said


# ------------------------------------------------------------- serial tests

from types import SimpleNamespace  # noqa: E402

import refcoll.torch as rt  # noqa: E402
from refcoll.core.errors import UsageError  # noqa: E402
from refcoll.torch.hooks import HookState  # noqa: E402
from refcoll.torch.tensors import as_array, as_tensor  # noqa: E402

GLOO = SimpleNamespace(rank=0, backend="gloo")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                   torch.float8_e4m3fn, torch.float8_e5m2, torch.int8,
                                   torch.uint8, torch.int64])
def test_tensors_become_arrays_over_the_same_memory_and_back(dtype):
    tensor = (torch.arange(12, dtype=torch.float32) - 3).to(dtype).reshape(3, 4)
    array = as_array(tensor, GLOO)
    assert array.__array_interface__["data"][0] == tensor.data_ptr()
    assert array.shape == (3, 4) and array.dtype.itemsize == tensor.element_size()
    assert str(array.dtype) == str(dtype).removeprefix("torch.")
    back = as_tensor(array, tensor)
    assert back.dtype == dtype and back.data_ptr() == tensor.data_ptr()
    assert torch.equal(back.view(torch.uint8), tensor.view(torch.uint8))


def test_a_tensor_that_needs_grad_is_read_without_its_graph():
    w = torch.ones(3, requires_grad=True)
    assert as_array(w, GLOO).tolist() == [1.0, 1.0, 1.0]


def test_refcoll_torch_refuses_before_a_group_exists():
    with pytest.raises(UsageError, match="not initialized"):
        rt.transport_for()


def test_init_process_group_names_the_backends_it_runs_on():
    with pytest.raises(UsageError, match="gloo"):
        rt.init_process_group("mpi")


def _layout(*params):
    return tuple((id(q), tuple(q.shape)) for q in params)


def test_a_rebuilt_bucket_takes_each_parameters_residual_at_its_new_offset():
    a, b, c = torch.zeros(2), torch.zeros(3), torch.zeros(4)
    state, _ = rt.comm_hook(compressor="ef(topk:ratio=0.5)")
    first = state.slot(_layout(a, b, c), 0, rank=0)
    first.state.residual = np.arange(9, dtype=np.float32)  # a: 0 1, b: 2 3 4, c: 5 6 7 8
    assert state.slot(_layout(a, b, c), 0, rank=0) is first  # the same layout: kept
    # DDP's rebuild: [c, a] and [b], in ready order.
    second = state.slot(_layout(c, a), 0, rank=0)
    third = state.slot(_layout(b), 1, rank=0)
    assert second.state.residual.tolist() == [5, 6, 7, 8, 0, 1]
    assert third.state.residual.tolist() == [2, 3, 4]
    assert state.carried == 3 and state.layouts == 3
    assert len(state._slots) == 2  # the old layout is gone: every parameter moved on
    assert third.state.seed == state.seed + 1  # seeded by the index it first appeared at


def test_a_rebuilt_bucket_takes_the_two_phase_servers_residual_into_the_workers():
    """ef(sign)'s server residual (this rank's chunk of the old bucket) was dropped at the
    rebuild: it is owed p times over in this rank's worker residual instead."""
    a, b = torch.zeros(3), torch.zeros(5)
    state, _ = rt.comm_hook(compressor="ef(sign)")
    first = state.slot(_layout(a, b), 0, rank=1)
    first.state.residual = np.full(8, 0.5, np.float32)
    first.state.memory[("twophase.server", 8, 2)] = np.array([1, 2, 3, 4], np.float32)
    second = state.slot(_layout(b), 0, rank=1)  # rank 1's old chunk, 4..7, lay in b at 1..4
    third = state.slot(_layout(a), 1, rank=1)
    assert second.state.residual.tolist() == [0.5, 2.5, 4.5, 6.5, 8.5]
    assert third.state.residual.tolist() == [0.5, 0.5, 0.5]
    assert first.state.residual.tolist() == [0.5] * 8  # (read, not changed)


def test_error_feedback_loses_nothing_at_the_rebuild_in_either_phase():
    """Every rank's gradients, summed over the steps, are p times the averages returned plus
    what the states still owe (the workers' residuals, p times the servers')."""
    import refcoll
    from refcoll.core.chunking import chunk_bounds

    sizes, keys = {1: 40, 2: 24}, (1, 2)

    def train(t):
        state, _ = rt.comm_hook(compressor="ef(sign)")
        given = {k: np.zeros(n) for k, n in sizes.items()}
        got = {k: np.zeros(n) for k, n in sizes.items()}
        for step in range(4):  # one bucket [2, 1], then DDP's rebuild: [2] and [1]
            layouts = [((2, (24,)), (1, (40,)))] if step == 0 else [((2, (24,)),), ((1, (40,)),)]
            for index, layout in enumerate(layouts):
                grads = {k: np.random.default_rng([step, t.rank, k]).standard_normal(
                    sizes[k]).astype(np.float32) for k, _ in layout}
                x = np.concatenate([grads[k] for k, _ in layout])
                rt.hooks.average(state, x, layout, index, t)
                at = 0
                for k, (n,) in layout:
                    given[k] += grads[k]
                    got[k] += x[at:at + n]
                    at += n
        owed = {k: np.zeros(n) for k, n in sizes.items()}
        for slot in state._slots.values():
            full = slot.state.residual.astype(np.float64)
            for key, server in slot.state.memory.items():
                lo, hi = chunk_bounds(key[1], t.size)[t.rank]
                full[lo:hi] += t.size * server
            for k, (at, n) in slot.offsets.items():
                owed[k] += full[at:at + n]
        return given, got, owed

    ranks = refcoll.SimWorld(2).run(train)
    for k in keys:
        books = sum(r[0][k] - r[2][k] for r in ranks) - 2 * ranks[0][1][k]
        assert np.abs(books).max() < 1e-5, np.abs(books).max()


def test_a_bucket_of_new_parameters_starts_without_a_residual():
    state, _ = rt.comm_hook(compressor="ef(topk:ratio=0.5)")
    assert state.slot(_layout(torch.zeros(2)), 0, rank=0).state.residual is None


def test_powersgd_in_a_hook_compresses_each_parameter_in_its_shape():
    # A flat bucket would go uncompressed (PowerSGD compresses matrices): the hook cuts it
    # into its parameters' views, each with a state of its own.
    import refcoll

    w, bias = torch.zeros(64, 32), torch.zeros(32)
    layout = _layout(w, bias)
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(64 * 32 + 32).astype(np.float32) for _ in range(2)]
    hooks = [rt.comm_hook(compressor="powersgd:rank=2")[0] for _ in range(2)]

    def run(t, x, state):
        before = t.traffic.snapshot()[0]
        rt.hooks.average(state, x, layout, 0, t)
        return t.traffic.snapshot()[0] - before

    sent = refcoll.SimWorld(2).run(run, list(zip([x.copy() for x in xs], hooks)))
    dense = refcoll.SimWorld(2).run(
        lambda t, x: (refcoll.allreduce(x, t, op="avg"), t.traffic.sent)[1],
        [(x.copy(),) for x in xs])
    assert sorted(hooks[0]._tensors) == sorted([id(w), id(bias)])
    assert max(sent) < max(dense) / 4  # rank 2 of a 64 x 32 matrix, and the bias whole


def test_comm_hook_refuses_what_is_not_a_compressor():
    with pytest.raises(UsageError, match="spec string"):
        rt.comm_hook(compressor=3)
    assert isinstance(rt.comm_hook(algorithm="ring")[0], HookState)


def test_one_process_alone_runs_the_battery_over_the_torch_transport():
    # A plain python process: init_process_group makes a Gloo group of one.
    import torch.distributed as dist
    from conftest import classes, fewest_covering

    from refcoll.verify.conformance import build_cases, run_battery

    assert rt.launcher() == "none"
    rt.init_process_group("gloo")
    try:
        t = rt.transport_for()
        assert (t.size, t.rank, t.backend) == (1, 0, "gloo")
        cases = build_cases(1)
        chosen = fewest_covering(cases)
        assert classes(chosen) == classes(cases)
        failures = [f"{r.case.id}: {r.reason}" for r in run_battery(t, chosen) if not r.passed]
        assert not failures, "\n".join(failures[:10])
        x = torch.arange(6, dtype=torch.bfloat16)
        assert torch.equal(rt.allreduce(x), x) and torch.equal(rt.iallreduce(x).wait(), x)
    finally:
        dist.destroy_process_group()
    with pytest.raises(UsageError, match="not initialized"):
        rt.transport_for()


_ENDS_CLEAN = """
import atexit, os, sys

def gloo_threads():
    tasks = os.listdir("/proc/self/task")
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in tasks]
    return sorted(n for n in names if "gloo" in n)

atexit.register(lambda: print("left at exit:", gloo_threads()))  # registered first: runs last

import torch
import torch.distributed as dist
import refcoll.torch as rt

def main():  # what the job holds goes with main, as a script's main() holds it
    rt.init_process_group("gloo")
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    state, hook = rt.comm_hook(algorithm="ring")
    ddp.register_comm_hook(state, hook)
    ddp(torch.ones(3, 4)).sum().backward()
    print("running:", gloo_threads())
    out = [None]
    dist.all_gather_object(out, 1)
    dist.destroy_process_group()

main()
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc to see "
                    "a process's threads")
def test_a_ddp_job_ends_its_gloo_threads_before_the_interpreters_teardown():
    # torch.distributed.nn.functional, which DDP imports, keeps the group it finds at import
    # (default arguments), and a comm hook's progress thread and state hold it too: Gloo's
    # worker threads then outlived destroy_process_group, and one that dropped the last
    # collective's tensors during the teardown aborted the process.
    res = subprocess.run([sys.executable, "-c", _ENDS_CLEAN], capture_output=True, text=True,
                         timeout=300, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "running: ['gloo_tcp_loop', 'pt_gloo_runloop', 'pt_gloo_runloop']" in res.stdout, \
        res.stdout
    assert "left at exit: []" in res.stdout, res.stdout


def _told(error=None, clock=None):
    """A library's Work, its outcome told by ``wait()`` alone (no future): ``error`` raised;
    with a ``clock``, a call to a dead peer that gives up after the timeout it is given."""
    import torch.distributed as dist

    class Told(dist.Work):
        def __init__(self):
            super().__init__()
            self.waited, self.given = False, None

        def wait(self, timeout=None):
            self.waited, self.given = True, timeout
            if error is not None:
                raise error
            if clock is not None:
                clock[0] += timeout.total_seconds()  # (moved as a real wait moves it)
                raise RuntimeError("timed out")
            return True

        def is_completed(self):
            return True

        def exception(self):
            return None

    return Told()


def test_a_joined_work_waits_for_every_call_and_keeps_the_first_error():
    """A coalesced call run as its single calls (watch mode): each is waited for, even past
    one that failed, and a failure told only by wait() (a Work with no future) is its
    exception() too."""
    from refcoll.torch.work import JoinedWork

    works = [_told(RuntimeError("first")), _told(), _told(ValueError("second"))]
    joined = JoinedWork(works, [])
    with pytest.raises(RuntimeError, match="first"):
        joined.wait()
    assert all(w.waited for w in works)
    assert str(joined.exception()) == "first" and not joined.is_success()
    empty = JoinedWork([], [])  # a coalesced call of no pairs: done at once
    assert empty.wait() and empty.is_success() and empty.get_future().wait() == []


def test_a_joined_work_has_one_deadline_and_lets_an_interrupt_through(monkeypatch):
    """wait(timeout) bounds the whole join (once each call had the full timeout); an
    interrupt in one call's wait is raised at once, never kept as the join's error."""
    import datetime

    import refcoll.torch.work as work_module
    from refcoll.torch.work import JoinedWork

    now = [0.0]
    monkeypatch.setattr(work_module.time, "monotonic", lambda: now[0])
    works = [_told(clock=now) for _ in range(4)]
    with pytest.raises(RuntimeError, match="timed out"):
        JoinedWork(works, []).wait(datetime.timedelta(seconds=1))
    assert works[0].given == datetime.timedelta(seconds=1)
    assert [w.given for w in works[1:]] == [None] * 3  # the join's second was spent
    works = [_told(KeyboardInterrupt()), _told(clock=now)]
    joined = JoinedWork(works, [])
    with pytest.raises(KeyboardInterrupt):
        joined.wait(datetime.timedelta(seconds=2))
    assert works[1].given is None and joined.exception() is None
