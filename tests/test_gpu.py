"""GPU support: device arrays through the transports, compressors and NCCL helpers.

Two kinds of test. Those marked by the ``device`` fixture run twice: on a fake
CuPy (tests/fake_cupy.py, NumPy underneath, refusing any unrequested host copy
and counting every copy) everywhere, and on the real CuPy where there is a GPU.
The rest (``cuda``) need a GPU and skip, with the reason, where there is none:
the collectives on CuPy arrays against the simulator, the MPI runs on the
staging and direct paths, the compressors against their CPU results, NCCL.

The commands (``refcoll bench --device gpu --against nccl``, ``verify --device
gpu``, ``list``) run in this process on an MPI world of one rank; the fake
cannot cross processes, and its NCCL communicator, given every collective here,
copies and records on one rank.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import fake_cupy
import numpy as np
import pytest
from conftest import ROOT, mpiexec_path

import refcoll
from refcoll import algorithms
from refcoll.baselines import nccl
from refcoll.bench import throughput
from refcoll.calls.collectives import simulate
from refcoll.calls.progress import engine_for
from refcoll.compressors import ErrorFeedback, parse
from refcoll.compressors.topk import select_by_bits, topk_indices
from refcoll.core import xp as xp_module
from refcoll.core.chunking import chunk_slice
from refcoll.core.errors import UsageError
from refcoll.core.ops import get_op
from refcoll.transport import SimWorld, cuda_aware
from refcoll.transport import device as devices

TESTS = Path(__file__).resolve().parent


def _clear_caches() -> None:
    xp_module._cupy_state.cache_clear()
    cuda_aware._detected.cache_clear()
    xp_module._device_dtype_problem.cache_clear()


@pytest.fixture
def fake(monkeypatch):
    """The fake CuPy as ``cupy``, counters at zero, one device."""
    _clear_caches()
    fake_cupy.reset()
    yield fake_cupy.install(monkeypatch)
    fake_cupy.reset()
    _clear_caches()


@pytest.fixture
def no_cupy(monkeypatch):
    """A Python where ``import cupy`` fails."""
    _clear_caches()
    monkeypatch.setitem(sys.modules, "cupy", None)
    yield
    _clear_caches()


def _real_cupy():
    _clear_caches()
    cupy = xp_module.cupy_or_none()
    if cupy is None:
        pytest.skip(f"needs a CUDA GPU: {xp_module.gpu_unavailable_reason()}")
    return cupy


@pytest.fixture
def cuda():
    """The real CuPy on a GPU; skips with the reason where there is none."""
    return _real_cupy()


@pytest.fixture(params=["fake", "cuda"])
def device(request, monkeypatch):
    """The array module of device arrays: the fake everywhere, CuPy where there is a GPU."""
    if request.param == "cuda":
        yield _real_cupy()
        return
    _clear_caches()
    fake_cupy.reset()
    yield fake_cupy.install(monkeypatch)
    fake_cupy.reset()
    _clear_caches()


def _is_fake(xp) -> bool:
    return xp is fake_cupy


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# ----------------------------------------------------------------- namespaces, CuPy

def test_a_numpy_array_never_imports_cupy(monkeypatch):
    monkeypatch.delitem(sys.modules, "cupy", raising=False)
    x = np.zeros(3)
    assert xp_module.array_namespace(x) is np and not xp_module.is_device_array(x)
    assert xp_module.array_namespace([1, 2]) is np
    assert "cupy" not in sys.modules


def test_a_device_array_has_the_device_namespace(fake):
    x = fake.zeros(3, dtype=np.float32)
    assert xp_module.array_namespace(x) is fake and xp_module.is_device_array(x)
    assert xp_module.array_namespace(np.zeros(3)) is np
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(x)  # the fake refuses a silent host copy, as CuPy does


def test_without_cupy_the_reason_is_given(no_cupy):
    assert xp_module.cupy_or_none() is None
    assert "CuPy is not installed" in xp_module.gpu_unavailable_reason()
    with pytest.raises(UsageError, match="needs a CUDA GPU and CuPy: CuPy is not installed"):
        xp_module.require_cupy("this benchmark")


def test_without_a_device_the_reason_is_given(fake):
    fake.reset(device_count=0)
    assert xp_module.cupy_or_none() is None
    assert "no CUDA device" in xp_module.gpu_unavailable_reason()
    assert "cudaErrorNoDevice" in xp_module.gpu_unavailable_reason()


def test_with_a_device_cupy_is_returned(fake):
    assert xp_module.cupy_or_none() is fake and xp_module.gpu_unavailable_reason() is None


def test_device_dtypes_are_checked_with_the_reason(fake):
    xp_module.check_device_dtype(np.float16, fake)
    xp_module.check_device_dtype("bfloat16", np)
    with pytest.raises(UsageError, match="cannot compute in bfloat16.*CuPy >= 14"):
        xp_module.check_device_dtype("bfloat16", fake)
    with pytest.raises(UsageError, match="float8_e4m3fn"):
        xp_module.check_device_dtype("float8_e4m3fn", fake)
    fake.reset(bfloat16=True)
    xp_module._device_dtype_problem.cache_clear()
    xp_module.check_device_dtype("bfloat16", fake)


# ------------------------------------------------------------------- CUDA-aware MPI

@pytest.mark.parametrize("value, expected", [("1", True), ("0", False), (" yes ", True)])
def test_the_environment_decides(monkeypatch, value, expected):
    monkeypatch.setenv(cuda_aware.CUDA_AWARE_ENV, value)
    assert cuda_aware.cuda_aware() == (expected, f"{cuda_aware.CUDA_AWARE_ENV}={value}")


def test_a_bad_environment_value_is_a_usage_error(monkeypatch):
    monkeypatch.setenv(cuda_aware.CUDA_AWARE_ENV, "maybe")
    with pytest.raises(UsageError, match="set it to 1 .* or 0"):
        cuda_aware.cuda_aware()


def test_the_mpi_librarys_own_query_answers(monkeypatch, no_cupy):
    """The MPICH wheel exports MPIX_Query_cuda_support; without a GPU it answers 0."""
    monkeypatch.delenv(cuda_aware.CUDA_AWARE_ENV, raising=False)
    paths = cuda_aware.mpi_library_paths()
    assert paths, "mpi4py's MPI library is not in this process's memory map"
    library, answer = cuda_aware.query_cuda_support(paths)
    if answer is None:
        pytest.skip(f"{', '.join(paths)} has no MPIX_Query_cuda_support")
    aware, why = cuda_aware.cuda_aware()
    assert aware == bool(answer)
    assert why.startswith(f"MPIX_Query_cuda_support() returned {answer} (")
    assert Path(library).name in why


def test_without_the_query_symbol_the_probe_decides(monkeypatch, no_cupy):
    libc = ctypes.util.find_library("c")
    monkeypatch.delenv(cuda_aware.CUDA_AWARE_ENV, raising=False)
    monkeypatch.setattr(cuda_aware, "mpi_library_paths", lambda: [libc])
    assert cuda_aware.query_cuda_support([libc]) == (None, None)
    aware, why = cuda_aware.cuda_aware()
    assert not aware
    assert why.startswith(f"no MPIX_Query_cuda_support in {libc}; probe skipped: CuPy is not "
                          "installed")


@pytest.mark.parametrize("code, aware, said", [
    ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", False,
     "killed the child (SIGSEGV)"),
    ("print('ok')", True, "arrived intact"),
    ("import sys; sys.exit('MPI_ERR_BUFFER: invalid buffer pointer')", False,
     "exit code 1: MPI_ERR_BUFFER: invalid buffer pointer"),
])
def test_the_probe_reads_its_childs_fate(code, aware, said):
    got, why = cuda_aware.probe_cuda_aware([sys.executable, "-c", code])
    assert got is aware and said in why


def test_the_probe_gives_up_on_a_hung_child():
    aware, why = cuda_aware.probe_cuda_aware([sys.executable, "-c", "import time; time.sleep(30)"],
                                      timeout=0.5)
    assert not aware and "no answer in 0.5 s" in why


def test_the_probe_sends_a_device_buffer_through_mpi(fake, tmp_path, monkeypatch):
    """The real probe, in a child process whose ``cupy`` is the fake (memory the host can read)."""
    (tmp_path / "cupy.py").write_text("import sys\nimport fake_cupy\n"
                                      "sys.modules['cupy'] = fake_cupy\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{TESTS}:{ROOT}")
    # A launcher's variable: a child that saw it would try to join a job through it, and fail.
    monkeypatch.setenv("PMI_FD", "999")
    assert cuda_aware.probe_cuda_aware() == (
        True, "probe: a device buffer sent to self through MPI arrived intact")


def test_device_path_names_the_gpu_the_path_and_why(fake, monkeypatch):
    monkeypatch.setenv(cuda_aware.CUDA_AWARE_ENV, "0")
    assert cuda_aware.device_path() == {"gpu": "Fake GPU (NumPy)", "gpu_reason": None,
                                 "cuda_aware": False, "path": "staging",
                                 "why": f"{cuda_aware.CUDA_AWARE_ENV}=0"}


# ------------------------------------------------------------------ device transports

def _world_run(p: int, body):
    world = SimWorld(p)
    return world.run(body), world.ledger


def test_staging_cuts_messages_into_pieces_through_reused_pinned_buffers(fake):
    sizes = [0, 1, 63, 64, 65, 1000, 16]  # bytes; pieces of 64
    rng = np.random.default_rng(1)
    data = [[rng.integers(0, 256, n, dtype=np.uint8) for n in sizes] for _ in range(2)]

    def body(t):
        st = devices.StagingTransport(t, fake, chunk_bytes=64)
        rounds = []
        for _ in range(2):
            got = []
            for i, n in enumerate(sizes):
                incoming = fake.empty(n, dtype=np.uint8)
                st.sendrecv(fake.asarray(data[t.rank][i]), 1 - t.rank, incoming, 1 - t.rank, tag=i)
                got.append(incoming)
            rounds.append((st.pool.allocations, got))
        return rounds

    fake.reset()
    results, ledger = _world_run(2, body)
    stats = fake.stats
    moved = 2 * 2 * sum(sizes)  # two ranks, two rounds
    assert stats.d2h_bytes == stats.d2h_pinned_bytes == moved
    assert stats.h2d_pinned_bytes == moved, "each received byte crossed pinned memory once"
    pieces = sum(max(1, -(-n // 64)) for n in sizes)
    assert ledger.total_messages == 2 * 2 * pieces
    assert max(m.nbytes for m in ledger.messages) == 64
    for rank, rounds in enumerate(results):
        assert rounds[0][0] == rounds[1][0] == 4, "two pinned slots each way, then reused"
        for _, got in rounds:
            assert all(_same_bits(g.get(), want) for g, want in zip(got, data[1 - rank]))


@pytest.mark.parametrize("path", ["staging", "direct"])
@pytest.mark.parametrize("name", ["ring", "recursive_doubling", "rabenseifner", "tree", "dbtree",
                                  "naive", "hierarchical"])
def test_algorithms_on_device_arrays_are_the_numpy_bits(device, name, path):
    """Bit for bit the simulator's NumPy result; every staged byte crosses pinned memory once."""
    p, n = 4, 1001
    rng = np.random.default_rng(7)
    inputs = [rng.standard_normal(n).astype(np.float32) for _ in range(p)]
    want = simulate("allreduce", inputs, algorithm=name).outputs
    on_device = [device.asarray(x) for x in inputs]
    fn = algorithms.implementation(name, "allreduce")
    wrap = ((lambda t: devices.StagingTransport(t, device, chunk_bytes=512)) if path == "staging"
            else (lambda t: devices.DirectTransport(t, device)))

    def body(t):
        dt = wrap(t)
        out = device.empty(n, dtype=np.float32)
        with dt.call("allreduce"):
            fn(dt, on_device[t.rank], out, op=get_op("sum"))
        return out

    if _is_fake(device):
        device.reset()
    outputs, ledger = _world_run(p, body)
    if _is_fake(device):
        stats = device.stats
        if path == "staging":
            assert stats.d2h_bytes == stats.d2h_pinned_bytes == ledger.total_bytes
            assert stats.h2d_bytes == stats.h2d_pinned_bytes == ledger.total_bytes
        else:
            assert stats.d2h_bytes == stats.h2d_bytes == 0, "the direct path copies nothing to host"
            assert stats.stream_syncs >= ledger.total_messages
    assert all(xp_module.array_namespace(out) is device for out in outputs)
    host = [device.asnumpy(out) for out in outputs]
    assert all(_same_bits(got, exp) for got, exp in zip(host, want))
    assert all(_same_bits(device.asnumpy(d), x) for d, x in zip(on_device, inputs))


@pytest.mark.parametrize("op", ["prod", "min", "max", "avg"])
def test_ops_reduce_on_the_device(device, op):
    p, n = 3, 37
    inputs = [np.arange(1, n + 1, dtype=np.int32) * (r + 1) - 20 for r in range(p)]
    want = simulate("allreduce", inputs, algorithm="ring", op=op).outputs

    def body(t):
        dt = devices.StagingTransport(t, device)
        out = device.empty(n, dtype=np.int32)
        with dt.call("allreduce"):
            algorithms.ring.ring_allreduce(dt, device.asarray(inputs[t.rank]), out, op=get_op(op))
        get_op(op).finalize(out, p)
        return out

    outputs, ledger = _world_run(p, body)
    assert all(_same_bits(device.asnumpy(got), exp) for got, exp in zip(outputs, want))
    assert ledger.reductions, "reductions on the device are charged in the simulator's ledger"


def test_host_buffers_pass_through_staging_untouched(fake):
    def body(t):
        st = devices.StagingTransport(t, fake, chunk_bytes=8)
        incoming = np.empty(20, np.uint8)
        st.sendrecv(np.full(20, t.rank, np.uint8), 1 - t.rank, incoming, 1 - t.rank)
        total = np.empty(20, np.uint8)
        st.reduce_local(get_op("sum"), incoming, incoming, total)
        return incoming, total

    fake.reset()
    results, ledger = _world_run(2, body)
    assert all(np.all(got == 1 - rank) and np.all(total == 2 * (1 - rank))
               for rank, (got, total) in enumerate(results))
    assert ledger.total_messages == 2 * 3, "host messages are cut into the same pieces"
    assert fake.stats.d2h_copies == fake.stats.h2d_copies == fake.stats.pinned_allocations == 0


def test_device_transport_chooses_by_cuda_aware_and_is_cached(fake, monkeypatch):
    x = fake.zeros(4, dtype=np.float32)
    for value, kind in [("1", devices.DirectTransport), ("0", devices.StagingTransport)]:
        monkeypatch.setenv(cuda_aware.CUDA_AWARE_ENV, value)

        def body(t):
            chosen = devices.device_transport(t, x)
            assert devices.device_transport(t, np.zeros(4)) is t
            assert devices.device_transport(t, x) is chosen
            assert devices.device_transport(chosen, x) is chosen
            sub = chosen.split(t.rank % 2, t.rank)
            return chosen, sub

        results, ledger = _world_run(3, body)
        assert all(type(c) is kind and type(s) is kind for c, s in results)
        assert ledger.total_messages == 0, "simulated ranks share one process: no agreement"
        if kind is devices.StagingTransport:
            assert all(s.pool is c.pool for c, s in results), "a split reuses its parent's pool"


# ------------------------------------------- the call layer on device arrays: plans, racks

def _inputs(p: int, n: int, runs: int = 1) -> list[list[np.ndarray]]:
    """Return ``runs`` rounds of one float32 input per rank."""
    rng = np.random.default_rng([p, n, runs])
    return [[rng.standard_normal(n).astype(np.float32) for _ in range(p)] for _ in range(runs)]


@pytest.mark.parametrize("progress", ["thread", "schedule"])
@pytest.mark.parametrize("name", ["ring", "rabenseifner"])
def test_plans_and_nonblocking_calls_on_device_arrays_are_the_numpy_bits(device, monkeypatch,
                                                                         name, progress):
    """A plan on device arrays runs (``plan()``, ``start()``/``wait()``) in the wrapped
    transport's calls, on its progress engine; so does a non-blocking call on the device
    transport. Each run: the simulator's NumPy bits for what ``x`` holds then."""
    monkeypatch.setenv("REFCOLL_PROGRESS", progress)
    p, n, runs = 3, 1001, 4
    rounds = _inputs(p, n, runs + 1)
    want = [simulate("allreduce", xs, algorithm=name).outputs for xs in rounds]

    def body(t):
        x = device.asarray(rounds[0][t.rank])
        plan = refcoll.allreduce_init(x, t, algorithm=name)
        got = []
        for k in range(runs):
            x[...] = device.asarray(rounds[k][t.rank])
            if k % 2:
                plan.start()
                got.append(device.asnumpy(plan.wait()))
            else:
                got.append(device.asnumpy(plan()))
        assert engine_for(plan.t) is engine_for(t), "one engine: the communicator's issue order"
        plan.free()
        dt = devices.device_transport(t, x)
        handle = refcoll.iallreduce(device.asarray(rounds[runs][t.rank]), dt, algorithm=name)
        got.append(device.asnumpy(handle.wait()))
        return type(plan.t), got

    for rank, (kind, got) in enumerate(SimWorld(p, timeout=60).run(body)):
        assert issubclass(kind, devices._DeviceTransport)
        assert all(_same_bits(g, w[rank]) for g, w in zip(got, want))


class _NcclLike:
    """A simulated rank's transport as the torch backend's NCCL group is: it moves device
    memory itself (``moves_device_arrays``), and refuses host buffers, as
    ``TorchTransport.tensor`` does on an NCCL group."""

    def __init__(self, t):
        self.t, self.moves_device_arrays = t, True

    def __getattr__(self, name):
        return getattr(self.t, name)

    def _device(self, *bufs):
        for buf in bufs:
            if not xp_module.is_device_array(buf):
                raise UsageError(f"rank {self.t.rank}: a CPU buffer on an NCCL group")

    def send(self, buf, dest, tag=0):
        self._device(buf)
        self.t.send(buf, dest, tag)

    def recv(self, buf, source, tag=0):
        self._device(buf)
        self.t.recv(buf, source, tag)

    def sendrecv(self, sendbuf, dest, recvbuf, source, tag=0):
        self._device(sendbuf, recvbuf)
        self.t.sendrecv(sendbuf, dest, recvbuf, source, tag)


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("name", ["ring", "recursive_doubling", "rabenseifner", "tree", "auto"])
def test_device_arrays_over_a_library_that_moves_device_memory_only(device, name, validate):
    """The torch backend's NCCL group takes device buffers only: the argument agreement's
    host signatures go through device copies, and the algorithms' workspaces are device
    arrays. In place (``out=x``, as the backend calls it): the simulator's NumPy bits."""
    p, n = 3, 1001
    (xs,) = _inputs(p, n)
    want = simulate("allreduce", xs, algorithm=name).outputs

    def body(t):
        x = device.asarray(xs[t.rank])
        refcoll.allreduce(x, _NcclLike(t), out=x, algorithm=name, validate=validate)
        return device.asnumpy(x)

    for rank, got in enumerate(SimWorld(p, timeout=60).run(body)):
        assert _same_bits(got, want[rank])


@pytest.mark.parametrize("progress", ["thread", "schedule"])
def test_a_non_blocking_device_call_runs_on_the_callers_device_and_stream(fake, monkeypatch,
                                                                         progress):
    """CUDA's current device and stream belong to a host thread: a call the progress thread
    runs must run on the caller's, or it allocates on device 0 and races the caller's
    stream. Each rank here uses its own device and a stream of its own."""
    monkeypatch.setenv("REFCOLL_PROGRESS", progress)
    fake.reset(device_count=2)
    seen = {}
    real = refcoll.calls.nonblocking.allreduce

    def spying(x, *args, comm, **kwargs):
        seen[comm.rank] = (fake.cuda.Device().id, fake.cuda.get_current_stream())
        return real(x, *args, comm=comm, **kwargs)

    monkeypatch.setattr(refcoll.calls.nonblocking, "allreduce", spying)
    (xs,) = _inputs(2, 64)
    want = simulate("allreduce", xs, algorithm="ring").outputs

    def body(t):
        stream = fake.cuda.Stream(non_blocking=True)
        with fake.cuda.Device(1 - t.rank), stream:
            dt = devices.device_transport(t, fake.asarray(xs[t.rank]))
            got = refcoll.iallreduce(fake.asarray(xs[t.rank]), dt, algorithm="ring").wait()
            return fake.asnumpy(got), (1 - t.rank, stream)

    for rank, (got, callers) in enumerate(SimWorld(2, timeout=60).run(body)):
        assert _same_bits(got, want[rank])
        assert seen[rank] == callers


def test_the_ddp_hooks_bucket_plan_follows_a_device_bucket_wrapped_anew(fake):
    """The hook wraps DDP's bucket tensor anew each call: the plan's buffer is compared by
    address, which a CuPy array gives through its memory pointer (it has no
    ``__array_interface__``), so the second call keeps the plan and it runs."""
    torch_hooks = pytest.importorskip("refcoll.torch.hooks")
    (xs,) = _inputs(2, 6)
    want = simulate("allreduce", xs, algorithm="ring", op="avg").outputs

    def body(t):
        t = _NcclLike(t)
        state = torch_hooks.HookState(algorithm="ring")
        layout = ((1, (6,)),)
        x = fake.asarray(xs[t.rank])
        first = torch_hooks.bucket_plan(state, x, layout, 0, t)
        again = torch_hooks.bucket_plan(state, x.view(), layout, 0, t)
        return again is first, fake.asnumpy(again())

    for rank, (kept, got) in enumerate(SimWorld(2, timeout=60).run(body)):
        assert kept and _same_bits(got, want[rank])


def test_a_plan_takes_a_view_of_its_own_device_buffer(device):
    """``plan(x=...)`` accepts the plan's own device memory (a view of it), and refuses
    another buffer on every rank, as on the host."""
    p, n = 2, 64
    (xs,) = _inputs(p, n)
    want = simulate("allreduce", xs, algorithm="ring").outputs

    def body(t):
        x = device.asarray(xs[t.rank])
        plan = refcoll.allreduce_init(x, t, algorithm="ring")
        same = [device.asnumpy(plan(x=x[:])), device.asnumpy(plan(x=x.reshape(n)))]
        with pytest.raises(UsageError, match="is not the buffer"):
            plan(x=x.copy())
        return same

    for rank, same in enumerate(SimWorld(p, timeout=60).run(body)):
        assert all(_same_bits(got, want[rank]) for got in same)


def test_hierarchical_by_racks_on_device_arrays_is_the_numpy_bits(device, tmp_path,
                                                                  monkeypatch):
    """level="rack" reads the ranks' hosts through the device transport: the racks of the
    topology file group the ranks as ``ranks_per_node`` does in the simulator."""
    hosts = ["node0", "node1", "node2", "node3"]
    topology = {"version": 1,
                "nodes": [{"host": h, "rack": 1 + i // 2, "ranks": 1, "link_bits_per_s": 1e9}
                          for i, h in enumerate(hosts)],
                "racks": [{"rack": 1, "uplink_bits_per_s": 5e8},
                          {"rack": 2, "uplink_bits_per_s": 5e8}]}
    path = tmp_path / "topo.json"
    path.write_text(json.dumps(topology))
    monkeypatch.setenv("REFCOLL_TOPO_FILE", str(path))
    (xs,) = _inputs(len(hosts), 1001)
    want = simulate("allreduce", xs, algorithm="hierarchical", ranks_per_node=2).outputs

    def body(t):
        t.hosts = hosts  # what MPI's host exchange gives its transport
        x = device.asarray(xs[t.rank])
        return device.asnumpy(refcoll.allreduce(x, t, algorithm="hierarchical", level="rack"))

    outputs = SimWorld(len(hosts), timeout=60).run(body)
    assert all(_same_bits(got, exp) for got, exp in zip(outputs, want))


def test_overlap_checks_on_device_arrays_compare_bounds_only(fake):
    """In-place layouts are recognised, a partial overlap refused on every rank, and the
    checks never run CuPy's exact ``shares_memory`` (device memory per element, a sort)."""
    p, k = 3, 40
    n = p * k
    (xs,) = _inputs(p, n)
    scattered = simulate("reduce_scatter", xs, algorithm="ring").outputs
    gathered = simulate("allgather", xs, algorithm="ring").outputs
    summed = simulate("allreduce", xs, algorithm="ring").outputs

    def body(t):
        r = t.rank
        x = fake.asarray(xs[r])
        part = refcoll.reduce_scatter(x, t, out=x[chunk_slice(n, p, r)])  # NCCL's in place
        rows = fake.empty((p, n), dtype=np.float32)
        rows[r] = fake.asarray(xs[r])
        everyone = refcoll.allgather(rows[r], t, out=rows)  # x as row r of out=
        apart = refcoll.allgather(fake.asarray(xs[r]), t, out=fake.empty((p, n), np.float32))
        y = fake.asarray(xs[r])
        total = refcoll.allreduce(y, t, out=y)
        both = fake.empty(n + 1, dtype=np.float32)
        both[:n] = fake.asarray(xs[r])
        with pytest.raises(ValueError, match="overlap"):
            refcoll.allreduce(both[:n], t, out=both[1:])
        return [fake.asnumpy(a) for a in (part, everyone, apart, total)]

    fake.reset()
    for rank, (part, everyone, apart, total) in enumerate(SimWorld(p, timeout=60).run(body)):
        assert _same_bits(part, scattered[rank]) and _same_bits(total, summed[rank])
        assert _same_bits(everyone, gathered[rank]) and _same_bits(apart, gathered[rank])
    assert fake.stats.exact_overlap_checks == 0


PLAN_SCRIPT = textwrap.dedent("""
    import os
    import sys
    import numpy as np
    import fake_cupy
    sys.modules["cupy"] = fake_cupy
    from mpi4py import MPI
    import refcoll
    comm = MPI.COMM_WORLD
    rank = comm.rank

    def values(k):
        return (np.arange(1001, dtype=np.float32) * 0.37 + rank * 1.3 + k).astype(np.float32)

    x = fake_cupy.asarray(values(0))
    plan = refcoll.allreduce_init(x, comm, algorithm="ring")
    for k in range(4):
        x[...] = fake_cupy.asarray(values(k))
        if k % 2:
            plan.start()
            got = plan.wait()
        else:
            got = plan(x=x[:]) if k else plan()
        want = refcoll.allreduce(values(k), comm, algorithm="ring")
        assert fake_cupy.asnumpy(got).tobytes() == want.tobytes(), k
    kind = type(plan.t).__name__
    plan.free()
    # level="rack": this host's rack, from a topology file naming it
    topology = sys.argv[1] % rank
    with open(topology, "w") as f:
        f.write('{"version": 1, "nodes": [{"host": "%s", "rack": 1, "ranks": %d, '
                '"link_bits_per_s": 1e9}]}' % (MPI.Get_processor_name(), comm.size))
    os.environ["REFCOLL_TOPO_FILE"] = topology
    host = values(9)
    racks = refcoll.allreduce(fake_cupy.asarray(host), comm, algorithm="hierarchical",
                              level="rack")
    want = refcoll.allreduce(host, comm, algorithm="hierarchical", level="rack")
    assert fake_cupy.asnumpy(racks).tobytes() == want.tobytes()
    # host memory on rank 0, device memory on rank 1: a MismatchError on both, at a device
    # transport's first call (a fresh communicator) and at a later one
    for c in (comm.Dup(), comm):
        try:
            refcoll.allreduce(values(5) if rank == 0 else fake_cupy.asarray(values(5)), c)
            raise AssertionError("no error")
        except refcoll.MismatchError as exc:
            assert "device" in str(exc), str(exc)
    lines = comm.gather(f"{kind} ok", root=0)
    if rank == 0:
        print("\\n".join(lines))
""")


@pytest.mark.skipif(mpiexec_path() is None, reason="no mpiexec: pip install 'refcoll[mpi]'")
def test_plans_and_racks_on_device_arrays_through_mpi(tmp_path):
    """Under mpiexec: a plan on device arrays in its own tag slot, started, waited and
    given a view of its buffer, and hierarchical by racks: the NumPy calls' bits. A call on
    host memory on one rank and device memory on another: a MismatchError on both (it
    waited for the deadline)."""
    script = tmp_path / "plans.py"
    script.write_text(PLAN_SCRIPT)
    res = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, str(script),
                          str(tmp_path / "topo%d.json")],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": f"{TESTS}:{ROOT}",
                              cuda_aware.CUDA_AWARE_ENV: "0", "REFCOLL_TIMEOUT": "30"})
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.split("\n")[:2] == ["StagingTransport ok"] * 2


# ------------------------------------------------------------------------ compressors

DETERMINISTIC = ["none", "fp16", "topk:ratio=0.1", "randomk:ratio=0.1",
                 "threshold:threshold=0.8", "int8:block=64", "sign", "sign:block=16", "onebit",
                 "onebit:block=30", "powersgd:rank=2", "ef(topk:ratio=0.05)", "ef(sign:block=16)"]
STOCHASTIC = ["qsgd:levels=16,bucket=64", "terngrad", "terngrad:block=100"]


def _tensor(shape, seed=0, dtype=np.float32):
    x = np.random.default_rng(seed).standard_normal(shape).astype(dtype)
    x.reshape(-1)[::5] = 0.25  # ties for top-k's rule
    return x


def _run_steps(comp, x, xp, steps=2):
    state = comp.new_state(3, 1)
    results = []
    for step in range(steps):
        payload = comp.compress(xp.asarray(x) * x.dtype.type(step + 1), state)
        results.append((payload, comp.decompress(payload), state.residual))
    return results


@pytest.mark.parametrize("spec", DETERMINISTIC)
@pytest.mark.parametrize("shape", [(0,), (7,), (37, 53)], ids=str)
def test_deterministic_compressors_give_the_cpu_bits_on_device_arrays(device, spec, shape):
    """Same payload and result bits as NumPy; nothing copied to the host on the way."""
    comp, x = parse(spec), _tensor(shape)
    cpu = _run_steps(comp, x, np)
    if _is_fake(device):
        device.reset()
    gpu_steps = _run_steps(comp, x, device)
    if _is_fake(device):
        assert device.stats.d2h_bytes == 0, "a compressor read the tensor back to the host"
    # Scales that are sums come out of the device's reduction order, products out of
    # its BLAS: the last bits may differ there, and nowhere else.
    summed = "sign" in spec or "onebit" in spec
    blas = "powersgd" in spec and not _is_fake(device)
    tolerance = {"rtol": 1e-5} if summed else {"rtol": 1e-3, "atol": 1e-5}
    for (p_cpu, d_cpu, e_cpu), (p_dev, d_dev, e_dev) in zip(cpu, gpu_steps):
        assert sorted(p_dev.arrays) == sorted(p_cpu.arrays) and p_dev.nbytes == p_cpu.nbytes
        assert xp_module.is_device_array(d_dev)
        assert d_dev.shape == x.shape and d_dev.dtype == x.dtype
        for role, array in p_dev.arrays.items():
            assert xp_module.is_device_array(array), f"{role} left the device"
            host, want = device.asnumpy(array), p_cpu.arrays[role]
            if role == "signs" and not spec.startswith("ef("):
                assert _same_bits(host, want), "the sign bits are exact"
            elif summed or blas:
                np.testing.assert_allclose(host.astype(np.float64), want, **tolerance)
            else:
                assert _same_bits(host, want), role
        if summed or blas:
            np.testing.assert_allclose(device.asnumpy(d_dev), d_cpu, **tolerance)
        else:
            assert _same_bits(device.asnumpy(d_dev), d_cpu)
        if e_cpu is not None:
            assert xp_module.is_device_array(e_dev)


@pytest.mark.parametrize("spec", STOCHASTIC)
def test_stochastic_compressors_draw_on_the_device_reproducibly(device, spec):
    comp, x = parse(spec), _tensor((37, 53))
    first = _run_steps(comp, x, device)
    again = _run_steps(comp, x, device)
    for (p1, d1, _), (_p2, d2, _) in zip(first, again):
        assert all(xp_module.is_device_array(a) for a in p1.arrays.values())
        assert _same_bits(device.asnumpy(d1), device.asnumpy(d2))
    payload, decoded, _ = first[0]
    values = device.asnumpy(decoded).reshape(-1)
    if spec.startswith("terngrad"):  # every element is -s, 0 or +s of its block
        scales = device.asnumpy(payload.arrays["scales"])
        assert np.all(np.isin(np.abs(values), np.concatenate([[0], scales])))
    else:
        levels = device.asnumpy(payload.arrays["levels"])
        assert np.abs(levels).max() <= 16 and levels.size == x.size


def test_bf16_casts_on_the_device_where_cupy_has_bfloat16(fake):
    comp, x = parse("bf16"), _tensor((9, 4))
    with pytest.raises(UsageError, match="bfloat16 needs CuPy >= 14"):
        comp.compress(fake.asarray(x), comp.new_state())
    fake.reset(bfloat16=True)
    xp_module._device_dtype_problem.cache_clear()
    cpu = comp.decompress(comp.compress(x, comp.new_state()))
    assert _same_bits(fake.asnumpy(comp.decompress(comp.compress(fake.asarray(x),
                                                                 comp.new_state()))), cpu)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_selection_by_bits_is_topk_with_its_tie_rule(dtype):
    rng = np.random.default_rng(5)
    for n, distinct in [(1000, 1000), (1000, 7), (33, 1)]:
        magnitude = np.abs(rng.choice(rng.standard_normal(distinct), n)).astype(dtype)
        for k in (1, 2, n // 3, n - 1):
            assert np.array_equal(select_by_bits(magnitude, k), topk_indices(magnitude, k)), (n, k)
    # NaN above infinity on both paths (the host's took NaN for inf, and inf's lower index)
    magnitude = np.array([np.inf, np.nan, 1, 2, np.nan], dtype)
    for k in (1, 2, 3):
        assert np.array_equal(topk_indices(magnitude, k), select_by_bits(magnitude, k)), k
    assert topk_indices(magnitude, 1).tolist() == [1]


def test_error_feedback_keeps_its_residual_on_the_device(fake):
    ef = ErrorFeedback(parse("topk:ratio=0.1"))
    state = ef.new_state()
    x = fake.asarray(_tensor((50,)))
    for _ in range(3):
        before = state.residual
        payload = ef.compress(x, state)
        e_old = fake.zeros(50, np.float32) if before is None else before
        assert fake.asnumpy(ef.decompress(payload) + state.residual).tobytes() == \
            fake.asnumpy(x + e_old).tobytes()


AGREE_SCRIPT = textwrap.dedent("""
    import os
    import sys
    import numpy as np
    import fake_cupy
    sys.modules["cupy"] = fake_cupy
    from mpi4py import MPI
    from refcoll.transport import cuda_aware
    from refcoll.transport import device as devices
    from refcoll.baselines import nccl
    from refcoll.bench import throughput
    from refcoll.core import xp as xp_module
    from refcoll.calls.collectives import as_transport, device_for
    comm = MPI.COMM_WORLD
    # Rank 0 alone says its MPI reads device memory: every rank must stage.
    os.environ[cuda_aware.CUDA_AWARE_ENV] = "1" if comm.rank == 0 else "0"
    t = device_for(as_transport(comm), fake_cupy.zeros(1))
    peer = 1 - comm.rank
    n = (8 << 20) + 3  # two pieces of the default 4 MiB and a short third
    mine = fake_cupy.asarray(np.full(n, comm.rank + 1, np.uint8))
    got = fake_cupy.empty(n, dtype=np.uint8)
    fake_cupy.reset()
    before = t.traffic.messages_sent
    t.sendrecv(mine, peer, got, peer)
    s = fake_cupy.stats
    assert np.all(got.get() == peer + 1)
    line = f"{type(t).__name__} {t.traffic.messages_sent - before} {s.d2h_pinned_bytes} "
    lines = comm.gather(line + str(s.h2d_pinned_bytes), root=0)
    if comm.rank == 0:
        print("\\n".join(lines))
""")


@pytest.mark.skipif(mpiexec_path() is None, reason="no mpiexec: pip install 'refcoll[mpi]'")
def test_ranks_agree_on_the_path_and_stage_through_mpi(tmp_path):
    script = tmp_path / "agree.py"
    script.write_text(AGREE_SCRIPT)
    res = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, str(script)],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": f"{TESTS}:{ROOT}"})
    assert res.returncode == 0, res.stdout + res.stderr
    n = (8 << 20) + 3
    assert sorted(res.stdout.split("\n")[:2]) == [f"StagingTransport 3 {n} {n}"] * 2


# ------------------------------------------------------------------------------- NCCL

class _StubComm:
    """What the NCCL helpers ask of an mpi4py communicator, for ``size`` ranks on one node."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size, self.freed = rank, size, False

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py's names
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.size

    def Split_type(self, kind, key):  # noqa: N802
        return self

    def Free(self) -> None:  # noqa: N802
        self.freed = True

    def bcast(self, value, root=0):
        return value

    def allreduce(self, value, op=None):
        return value

    def Ibarrier(self):  # noqa: N802 - the stub's ranks are all here: the barrier is complete
        return _DoneRequest()


class _DoneRequest:
    """A request that has completed, as ``MPI_Ibarrier``'s does once every rank arrived."""

    def Test(self) -> bool:  # noqa: N802
        return True

    def Wait(self) -> None:  # noqa: N802
        return None


COLLECTIVES = ["allreduce", "reduce_scatter", "allgather", "broadcast", "reduce"]


class _RecordingNccl(fake_cupy.NcclCommunicator):
    """The fake's NCCL communicator with NCCL's other collectives, one rank: recorded copies."""

    def size(self) -> int:
        return self.ndev

    def _copy(self, name: str, send: int, recv: int, count: int, datatype: int, *rest) -> None:
        assert self.ndev == 1, "a stand-in for one rank"
        fake_cupy.stats.nccl_calls.append((name, count, datatype, *rest))
        if send != recv:
            ctypes.memmove(recv, send, count * fake_cupy._NCCL_ITEMSIZE[datatype])

    def reduceScatter(self, send, recv, count, datatype, op, stream):  # noqa: N802 - CuPy's
        self._copy("reduceScatter", send, recv, count, datatype, op, stream)

    def allGather(self, send, recv, count, datatype, stream):  # noqa: N802
        self._copy("allGather", send, recv, count, datatype, stream)

    def broadcast(self, send, recv, count, datatype, root, stream):
        self._copy("broadcast", send, recv, count, datatype, root, stream)

    def reduce(self, send, recv, count, datatype, op, root, stream):
        self._copy("reduce", send, recv, count, datatype, op, root, stream)


NCCL_METHODS = {"allreduce": "allReduce", "reduce_scatter": "reduceScatter",
                "allgather": "allGather", "broadcast": "broadcast", "reduce": "reduce"}


def test_nccl_types_map_refcolls_names():
    assert nccl.nccl_types("float32", "sum") == (7, 0)
    assert nccl.nccl_types(np.int64, "max") == (4, 2)
    with pytest.raises(UsageError, match="NCCL has no int16 type"):
        nccl.nccl_types("int16", "sum")
    with pytest.raises(UsageError, match="NCCL has no float8_e5m2"):
        nccl.nccl_types("float8_e5m2", "max")


def test_nccl_types_for_bfloat16_and_avg_ask_the_version(fake, monkeypatch):
    assert nccl.nccl_types("bfloat16", "avg") == (9, 4)
    monkeypatch.setattr(fake.nccl, "get_version", lambda: 2804)
    with pytest.raises(UsageError, match="needs NCCL >= 2.10"):
        nccl.nccl_types("float32", "avg")


def test_nccl_comm_and_allreduce_on_one_rank(fake):
    comm = nccl.nccl_comm(_StubComm(0, 1))
    assert (comm.ndev, comm.rank, len(comm.comm_id)) == (1, 0, 128)
    x = fake.asarray(np.arange(10, dtype=np.float32))
    out = fake.zeros(10, dtype=np.float32)
    syncs = fake.stats.stream_syncs
    nccl.nccl_allreduce(comm, x, out, "sum")
    assert fake.asnumpy(out).tolist() == list(range(10))
    assert fake.stats.nccl_calls == [("allReduce", 10, 7, 0, 0)]
    assert fake.stats.stream_syncs == syncs + 1
    with pytest.raises(UsageError, match="pass CuPy arrays"):
        nccl.nccl_allreduce(comm, np.zeros(3), out)


def test_nccl_calls_follow_refcolls_layouts(fake, monkeypatch):
    monkeypatch.setattr(fake.nccl, "NcclCommunicator", _RecordingNccl)
    comm = nccl.nccl_comm(_StubComm(0, 1))
    x = fake.asarray(np.arange(6, dtype=np.float64))
    for collective in COLLECTIVES:
        out = fake.zeros(6, dtype=np.float64)
        nccl.nccl_call(comm, collective, x, out, op="max", root=0)()
        assert fake.asnumpy(out).tolist() == list(range(6)), collective
    assert [c[:3] for c in fake.stats.nccl_calls] == [(m, 6, 8) for m in NCCL_METHODS.values()]
    nccl.nccl_call(comm, "reduce", x, None)()  # a non-root's reduce has no result buffer
    with pytest.raises(UsageError, match="NCCL allgather: the buffers hold 6 and 5 elements"):
        nccl.nccl_call(comm, "allgather", x, fake.zeros(5, dtype=np.float64))
    with pytest.raises(UsageError, match="NCCL needs buffers of one dtype"):
        nccl.nccl_call(comm, "allreduce", x, fake.zeros(6, dtype=np.float32))
    with pytest.raises(UsageError, match="NCCL has no 'alltoall'"):
        nccl.nccl_call(comm, "alltoall", x, x)


def test_nccl_version_reads_both_encodings(fake, monkeypatch):
    assert nccl.nccl_version() == "2.23.4"
    monkeypatch.setattr(fake.nccl, "get_version", lambda: 2804)
    assert nccl.nccl_version() == "2.8.4"
    monkeypatch.setattr(fake.nccl, "available", False)
    assert nccl.nccl_version() is None
    with pytest.raises(UsageError, match="--against nccl: NCCL is not available to CuPy"):
        nccl.require_nccl("--against nccl")


def test_one_gpu_per_rank_or_a_clear_error(fake):
    fake.reset(device_count=2)
    assert devices.check_one_gpu_per_rank(_StubComm(1, 2)) == 1 and fake.stats.device_in_use == 1
    with pytest.raises(UsageError, match="3 ranks share this node .* with 2 GPU.s. visible; NCCL "
                                         "needs one process per GPU: start at most 2 rank"):
        devices.check_one_gpu_per_rank(_StubComm(2, 3))


# ----------------------------------------------------------------------- measurements

def test_copy_bandwidth_and_compressor_throughput_report_their_figures(fake):
    copies = throughput.copy_bandwidth(1 << 16, repeats=2)
    assert copies["bytes"] == 1 << 16
    assert all(copies[f"{kind}_GBps"] > 0 for kind in
               ("device_to_device", "device_to_host", "host_to_device"))
    rows = throughput.compressor_throughput(["topk:ratio=0.01", "powersgd:rank=2"], 4096, repeats=2)
    assert [r["spec"] for r in rows] == ["topk:ratio=0.01", "powersgd:rank=2"]
    assert rows[0]["payload_bytes"] == 41 * 8 and rows[1]["elements"] == 4096
    assert all(r["GBps"] > 0 and r["ratio"] > 1 for r in rows)


# ------------------------------------------------------------ the commands on a device

@pytest.fixture
def mpi_self(monkeypatch):
    """``MPI.COMM_SELF``, and ``refcoll`` commands that take this process for an MPI job."""
    mpi = pytest.importorskip("mpi4py.MPI")
    monkeypatch.setattr("refcoll.cli.launch.in_mpi_job", lambda: True)
    monkeypatch.delenv("REFCOLL_WORKERS", raising=False)
    return mpi.COMM_SELF


def _on_fake(xp, monkeypatch, aware: str = "0") -> None:
    """Give the fake NCCL's every collective and a fixed transfer path (the real CuPy: as is)."""
    if _is_fake(xp):
        monkeypatch.setattr(xp.nccl, "NcclCommunicator", _RecordingNccl)
        monkeypatch.setenv(cuda_aware.CUDA_AWARE_ENV, aware)


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_bench_times_device_buffers_against_nccl(device, mpi_self, monkeypatch, collective):
    from refcoll.bench import BenchConfig, run_bench

    _on_fake(device, monkeypatch)
    algorithm = "tree" if collective in ("broadcast", "reduce") else "ring"
    config = BenchConfig(sizes=[16, 4096], algorithms=[algorithm], collective=collective,
                         against="nccl", device="gpu", warmup=1, iters=2, workers=1)
    if _is_fake(device):
        device.reset()
    rows = run_bench(mpi_self, config)
    name = nccl.NCCL_CALLS[collective]
    assert [(r["size"], r["baseline"]) for r in rows] == [(16, name), (4096, name)]
    for row in rows:
        assert row["wrong"] == 0 and row["checked"] == 3 * row["count"]  # 1 + 2 runs, 1 rank
        assert row["base_time_us"] > 0 and row["time_over_base"] > 0 and row["base_wrong"] == 0
    if _is_fake(device):
        stats = device.stats
        assert [c[:2] for c in stats.nccl_calls] == [(NCCL_METHODS[collective], 4)] * 3 + [
            (NCCL_METHODS[collective], 1024)] * 3
        assert stats.device_in_use == 0, "NCCL's rank took its own GPU"
        assert stats.stream_syncs >= 4 * 6, "each timed call ends with a synchronisation"
        checked = 3 * 4 * (4 + 1024) * (1 if collective == "broadcast" else 2)
        assert stats.d2h_bytes >= checked, "results are checked on host copies"


def test_bench_counts_an_unwritten_device_result_as_wrong(fake, mpi_self, monkeypatch):
    from refcoll.bench import BenchConfig, run_bench
    from refcoll.calls import collectives as api

    _on_fake(fake, monkeypatch)
    monkeypatch.setattr(api, "allreduce", lambda x, t, out=None, **kwargs: out)
    config = BenchConfig(sizes=[64], algorithms=["ring"], against="nccl", device="gpu",
                         warmup=0, iters=2, workers=1)
    (row,) = run_bench(mpi_self, config)
    assert row["wrong"] == row["checked"] == 2 * 16, "the device buffer was poisoned first"
    assert row["base_wrong"] == 0


@pytest.mark.parametrize("aware", ["0", "1"])
def test_bench_times_mpi_on_device_buffers_only_where_mpi_reads_them(fake, mpi_self,
                                                                     monkeypatch, aware):
    """The fake's device memory is host memory: MPI reads it as a CUDA-aware MPI would."""
    from refcoll.bench import BenchConfig, bench_header, format_header, run_bench

    _on_fake(fake, monkeypatch, aware)
    config = BenchConfig(sizes=[4096], algorithms=["ring"], device="gpu", warmup=1, iters=2,
                         workers=1)
    header = bench_header(mpi_self, config)
    (row,) = run_bench(mpi_self, config)
    text = format_header(header)
    assert header["gpu"]["gpu"] == "Fake GPU (NumPy)"
    assert header["versions"]["cupy"] == fake.__version__ and header["versions"]["nccl"] == "2.23.4"
    path = "direct" if aware == "1" else "staging"
    assert (f"# device: Fake GPU (NumPy); transfers: {path} "
            f"({cuda_aware.CUDA_AWARE_ENV}={aware})") in text
    assert row["wrong"] == 0
    if aware == "1":
        assert header["baseline"] == row["baseline"] == "MPI_Allreduce" and row["base_wrong"] == 0
        assert "# baseline: MPI_Allreduce on the same device buffers, interleaved" in text
    else:
        assert header["baseline"] is None and row["baseline"] is None
        assert "# baseline: none (MPI_Allreduce on device buffers needs a CUDA-aware MPI (" in text


def test_ranks_share_gpus_unless_nccl_runs(fake):
    from refcoll.bench import BenchConfig, use_device

    fake.reset(device_count=2)
    assert use_device(_StubComm(2, 3), BenchConfig(device="gpu")) == 0
    assert use_device(_StubComm(1, 3), BenchConfig(device="gpu")) == 1
    assert use_device(_StubComm(0, 1), BenchConfig(device="cpu")) is None
    with pytest.raises(UsageError, match="3 ranks share this node .*NCCL needs one process per"):
        use_device(_StubComm(2, 3), BenchConfig(device="gpu", against="nccl"))
    with pytest.raises(UsageError, match="cannot compute in float8_e5m2"):
        use_device(_StubComm(0, 1), BenchConfig(device="gpu", dtype="float8_e5m2"))


@pytest.mark.parametrize("args, message", [
    (["--against", "nccl", "--dtype", "int16"], "NCCL has no int16 type"),
    (["--against", "nccl", "--device", "cpu"], "--against nccl needs --device gpu (NCCL runs on"),
    (["--bound"], "--bound replays schedules on host buffers: it runs with --device cpu only"),
])
def test_bench_on_a_device_refuses_what_cannot_run_in_one_line(fake, args, message):
    from click.testing import CliRunner

    from refcoll.cli import main

    res = CliRunner().invoke(main, ["bench", "-n", "1", "--device", "gpu", *args])
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and message in lines[0], res.output


def test_bench_command_against_nccl_writes_the_device_path(fake, mpi_self, monkeypatch,
                                                           tmp_path):
    from click.testing import CliRunner

    from refcoll.cli import main

    _on_fake(fake, monkeypatch)
    out = tmp_path / "bench.json"
    res = CliRunner().invoke(main, ["bench", "-n", "1", "--device", "gpu", "--against", "nccl",
                                    "-b", "8", "-e", "512", "-f", "8", "--algorithm", "ring,auto",
                                    "-w", "1", "-i", "2", "--json", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["header"]["gpu"] == cuda_aware.device_path()
    assert data["header"]["baseline"] == "ncclAllReduce" and data["summary"]["passed"]
    assert [(r["size"], r["algorithm"], r["baseline"]) for r in data["rows"]] == [
        (s, a, "ncclAllReduce") for s in (8, 64, 512) for a in ("ring", "auto")]
    assert "# device: Fake GPU (NumPy); transfers: staging" in res.output
    assert "# ncclAllReduce #wrong: 0" in res.output


def test_list_names_the_gpu_and_the_device_path(fake, monkeypatch, tmp_path):
    from click.testing import CliRunner

    from refcoll.cli import main

    monkeypatch.setenv(cuda_aware.CUDA_AWARE_ENV, "1")
    out = tmp_path / "list.json"
    res = CliRunner().invoke(main, ["list", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["gpu"] == cuda_aware.device_path()
    assert res.output.splitlines()[-2:] == [
        "gpu: Fake GPU (NumPy)", f"device buffers: direct ({cuda_aware.CUDA_AWARE_ENV}=1)"]


def test_list_without_mpi_or_cupy_says_why(no_cupy, monkeypatch):
    from click.testing import CliRunner

    from refcoll.cli import main

    monkeypatch.delenv(cuda_aware.CUDA_AWARE_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # importing it now fails
    res = CliRunner().invoke(main, ["list"])
    assert res.exit_code == 0, res.output
    gpu_line, path_line = res.output.splitlines()[-2:]
    assert gpu_line.startswith("gpu: none (CuPy is not installed")
    assert path_line.startswith("device buffers: staging (no MPI library to ask")


def test_verify_runs_the_battery_on_device_arrays(fake, mpi_self, monkeypatch, tmp_path):
    from click.testing import CliRunner

    from refcoll.cli import main

    _on_fake(fake, monkeypatch)
    out = tmp_path / "verify.json"
    res = CliRunner().invoke(main, ["verify", "-n", "1", "--device", "gpu", "--algorithm",
                                    "ring,auto", "--collective", "allreduce,reduce",
                                    "--op", "sum,max", "--sizes", "0,3", "--json", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["device"] == "gpu" and data["gpu"]["path"] == "staging"
    assert data["passed"] == len(data["cases"]) + len(data["nonblocking"]) and data["failed"] == 0
    assert len(data["cases"]) > 100 and all(s["passed"] for s in data["nonblocking"])
    assert {c["dtype"] for c in data["cases"]} == {
        "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16",
        "float32", "float64"}
    lines = res.output.splitlines()
    assert lines[1] == ("device: Fake GPU (NumPy); transfers: staging "
                        f"({cuda_aware.CUDA_AWARE_ENV}=0)")
    assert lines[2] == "left out on this device: bfloat16, float8_e4m3fn, float8_e5m2"
    assert lines[-1] == f"{data['passed']} passed, 0 failed"


def test_verify_runs_the_compressed_battery_on_device_arrays(fake, mpi_self, monkeypatch):
    from click.testing import CliRunner

    from refcoll.cli import main

    _on_fake(fake, monkeypatch)
    res = CliRunner().invoke(main, ["verify", "-n", "1", "--device", "gpu", "--compressor", "all",
                                    "--algorithm", "ring", "--dtype", "float32"])
    assert res.exit_code == 0, res.output
    assert "left out on this device: bf16" in res.output
    assert res.output.splitlines()[-1].endswith(" passed, 0 failed")
    named = CliRunner().invoke(main, ["verify", "-n", "1", "--device", "gpu", "--compressor",
                                      "bf16"])
    assert named.exit_code == 2 and "--compressor bf16 on the device: " in named.output


def test_verify_on_a_gpu_without_one_exits_2_with_the_reason(no_cupy):
    from click.testing import CliRunner

    from refcoll.cli import main

    res = CliRunner().invoke(main, ["verify", "-n", "1", "--device", "gpu"])
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 2 and len(lines) == 1
    assert "--device gpu needs a CUDA GPU and CuPy: CuPy is not installed" in lines[0]


def test_the_battery_runs_on_device_arrays(device):
    from refcoll.verify.conformance import build_cases, run_battery

    cases = build_cases(3, algorithms_=["ring", "auto", "rabenseifner"], ops=["sum", "max"],
                        dtypes=["float32", "int32"], sizes=[0, 4, 11], inplace=(False, True))
    results = SimWorld(3).run(lambda t: run_battery(t, cases, xp=device))[0]
    failed = [f"{r.case.id}: {r.reason}" for r in results if not r.passed]
    assert not failed, failed[:3]
    assert {r.case.collective for r in results} == set(COLLECTIVES)


def test_the_battery_catches_a_wrong_or_misplaced_device_result(fake, monkeypatch):
    from refcoll.verify.conformance import Case, run_case
    from refcoll.verify.conformance import run as conformance

    real = conformance.COLLECTIVE_FUNCTIONS["allreduce"]

    def corrupt(x, t, **kwargs):
        result = real(x, t, **kwargs)
        if t.rank == 1:
            result[2] += 1  # on the device
        return result

    case = Case("ring", "allreduce", "sum", "float32", 7, False, "exact", ranks=3, total=3)

    def run(t):
        ctl = t.split(0, t.rank)
        return run_case(t, ctl, case, xp=fake)

    monkeypatch.setitem(conformance.COLLECTIVE_FUNCTIONS, "allreduce", corrupt)
    verdict = SimWorld(3).run(run)[0]
    assert not verdict.passed and "rank 1: element 2 is" in verdict.reason
    assert "ranks [1] hold different bits from rank 0" in verdict.reason
    monkeypatch.setitem(conformance.COLLECTIVE_FUNCTIONS, "allreduce",
                        lambda x, t, **kwargs: fake.asnumpy(real(x, t, **kwargs)))
    verdict = SimWorld(3).run(run)[0]
    assert not verdict.passed and "the result must live where the input does" in verdict.reason


def test_the_compressed_battery_on_device_arrays_is_judged_on_the_device(device):
    """QSGD draws on the device's generator: only the device's simulator predicts its bits."""
    from refcoll.compressors.conformance import build_compressor_cases, run_compressor_battery

    cases = build_compressor_cases(2, compressors=["none", "qsgd:levels=4,bucket=64",
                                                   "ef(topk:ratio=0.1)"],
                                   algorithms_=["ring"], ops=["sum"], dtypes=["float32"])
    results = SimWorld(2).run(lambda t: run_compressor_battery(t, cases, xp=device))[0]
    failed = [f"{r.case.id}: {r.reason}" for r in results if not r.passed]
    assert not failed, failed[:3]
    assert {r.case.pattern for r in results} >= {"allreduce", "gather"}


# ------------------------------------------------------------------ on a GPU only

def _device_run(cupy, collective, inputs, algorithm, op):
    """Run ``collective`` through refcoll's API on CuPy arrays over simulated ranks."""
    from refcoll.calls import collectives as api

    fn = getattr(api, collective)

    def body(t):
        x = cupy.asarray(inputs[t.rank])
        dt = devices.device_transport(t, x)
        kwargs = {"algorithm": algorithm, "validate": False}
        if collective not in ("allgather", "broadcast"):
            kwargs["op"] = op
        if collective in ("broadcast", "reduce"):
            return fn(x, 0, dt, **kwargs)
        return fn(x, dt, **kwargs)

    return SimWorld(len(inputs)).run(body)


@pytest.mark.parametrize("path", ["0", "1"], ids=["staging", "direct"])
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_gpu_conformance_battery(cuda, monkeypatch, collective, path):
    """Every algorithm, several rank counts and sizes: CuPy in, CuPy out, the simulator's bits."""
    monkeypatch.setenv(cuda_aware.CUDA_AWARE_ENV, path)
    dtypes = (np.float32, np.int32) if collective == "allreduce" else (np.float32,)
    for p in (1, 3, 5):
        for n in (0, p + 1, 1001):
            for dtype in dtypes:
                inputs = [(np.random.default_rng(r).standard_normal(n) * 100).astype(dtype)
                          for r in range(p)]
                for name in algorithms.names(collective):
                    if name == "switch":
                        continue
                    want = simulate(collective, inputs, algorithm=name,
                                    **({"root": 0} if collective == "reduce" else {})).outputs
                    got = _device_run(cuda, collective, inputs, name, "sum")
                    for rank, (g, w) in enumerate(zip(got, want)):
                        if w is None:
                            assert g is None
                            continue
                        assert xp_module.array_namespace(g) is cuda, (name, p, n, rank)
                        assert _same_bits(cuda.asnumpy(g), w), (name, p, n, dtype, rank)


@pytest.mark.parametrize("spec", ["none", "ef(topk:ratio=0.1)", "randomk:ratio=0.1", "int8",
                                  "qsgd", "ef(sign)", "onebit", "powersgd:rank=2"])
def test_gpu_compressed_allreduce(cuda, monkeypatch, spec):
    """Every pattern on CuPy arrays: the simulator's NumPy result, exactly where deterministic."""
    from refcoll.compressors.collective import run_steps, simulate_compressed

    monkeypatch.setenv(cuda_aware.CUDA_AWARE_ENV, "0")
    p = 3
    steps = [[_tensor((24, 40), seed=10 * s + r) for r in range(p)] for s in range(2)]
    want = simulate_compressed(spec, steps, seed=4).outputs

    def body(t):
        mine = [cuda.asarray(step[t.rank]) for step in steps]
        return run_steps(devices.device_transport(t, mine[0]), spec, mine,
                         seed=4, validate=False)[0]

    got = SimWorld(p).run(body)
    for s in range(len(steps)):
        for r in range(p):
            assert xp_module.array_namespace(got[r][s]) is cuda
            host = cuda.asnumpy(got[r][s])
            if spec == "qsgd":  # the device draws its own rounding: same scale, other bits
                assert np.abs(host - want[s][r]).max() < 2 * np.abs(want[s][r]).max()
            elif any(m in spec for m in ("sign", "onebit", "powersgd")):
                np.testing.assert_allclose(host, want[s][r], rtol=1e-3, atol=1e-4)
            else:
                assert _same_bits(host, want[s][r]), (spec, s, r)


MPI_SCRIPT = textwrap.dedent("""
    import sys
    import cupy
    import numpy as np
    from mpi4py import MPI
    import refcoll
    from refcoll.transport import cuda_aware
    from refcoll.transport import device as devices
    from refcoll.baselines import nccl
    from refcoll.bench import throughput
    from refcoll.core import xp as xp_module
    from refcoll.calls.collectives import as_transport
    comm = MPI.COMM_WORLD
    cupy.cuda.Device(comm.rank % cupy.cuda.runtime.getDeviceCount()).use()
    t = devices.device_transport(as_transport(comm), cupy.zeros(1))
    for n in (1, 1001, 3 << 20):
        x = cupy.arange(n, dtype=cupy.float32) * (comm.rank + 1)
        for algorithm in ("ring", "recursive_doubling", "rabenseifner", "tree"):
            got = refcoll.allreduce(x, t, algorithm=algorithm)
            assert isinstance(got, cupy.ndarray), type(got)
            want = np.arange(n, dtype=np.float32) * (comm.size * (comm.size + 1) // 2)
            assert np.array_equal(cupy.asnumpy(got), want), (algorithm, n)
    if comm.rank == 0:
        print(type(t).__name__, cuda_aware.cuda_aware()[1])
""")


@pytest.mark.parametrize("path", ["0", "1"], ids=["staging", "direct"])
def test_gpu_allreduce_under_mpi(cuda, tmp_path, monkeypatch, path):
    if mpiexec_path() is None:
        pytest.skip("no mpiexec: pip install 'refcoll[mpi]'")
    if path == "1":
        monkeypatch.delenv(cuda_aware.CUDA_AWARE_ENV, raising=False)
        aware, why = cuda_aware.cuda_aware()
        if not aware:
            pytest.skip(f"the MPI library does not read device memory: {why}")
    script = tmp_path / "gpu_allreduce.py"
    script.write_text(MPI_SCRIPT)
    res = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, str(script)],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, cuda_aware.CUDA_AWARE_ENV: path})
    assert res.returncode == 0, res.stdout + res.stderr
    expected = "StagingTransport" if path == "0" else "DirectTransport"
    assert res.stdout.splitlines()[0].startswith(expected)


@pytest.mark.parametrize("spec", DETERMINISTIC + STOCHASTIC + ["bf16"])
def test_gpu_compressors_at_scale(cuda, spec):
    """One large tensor: results on the device, equal to the CPU's where deterministic."""
    comp = parse(spec)
    x = _tensor((1 << 10, 1 << 10))
    if spec == "bf16":
        try:
            xp_module.check_device_dtype("bfloat16", cuda)
        except UsageError as exc:
            pytest.skip(str(exc))
    state_cpu, state_gpu = comp.new_state(1, 0), comp.new_state(1, 0)
    d_cpu = comp.decompress(comp.compress(x, state_cpu))
    d_gpu = comp.decompress(comp.compress(cuda.asarray(x), state_gpu))
    assert xp_module.array_namespace(d_gpu) is cuda
    host = cuda.asnumpy(d_gpu)
    if spec in STOCHASTIC:
        assert np.abs(host.mean() - x.mean()) < 0.01  # unbiased on a million elements
    elif "sign" in spec or "onebit" in spec or "powersgd" in spec:
        np.testing.assert_allclose(host, d_cpu, rtol=1e-3, atol=1e-4)
    else:
        assert _same_bits(host, d_cpu)


NCCL_SCRIPT = textwrap.dedent("""
    import cupy
    import numpy as np
    from mpi4py import MPI
    from refcoll.transport import cuda_aware
    from refcoll.transport import device as devices
    from refcoll.baselines import nccl
    from refcoll.bench import throughput
    from refcoll.core import xp as xp_module
    from refcoll.core.errors import UsageError
    comm = MPI.COMM_WORLD
    try:
        devices.check_one_gpu_per_rank(comm)
    except UsageError as exc:
        if comm.rank == 0:
            print("usage:", exc)
        raise SystemExit(2)
    nc = nccl.nccl_comm(comm)
    x = cupy.arange(1 << 20, dtype=cupy.float32)
    out = cupy.empty_like(x)
    nccl.nccl_allreduce(nc, x, out, "sum")
    assert np.array_equal(cupy.asnumpy(out), cupy.asnumpy(x) * comm.size)
    if comm.rank == 0:
        print("nccl ok")
""")


def test_gpu_nccl_one_process_per_gpu(cuda, tmp_path):
    if mpiexec_path() is None:
        pytest.skip("no mpiexec: pip install 'refcoll[mpi]'")
    script = tmp_path / "nccl.py"
    script.write_text(NCCL_SCRIPT)
    gpus = cuda.cuda.runtime.getDeviceCount()
    ok = subprocess.run([mpiexec_path(), "-n", str(gpus), sys.executable, str(script)],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and "nccl ok" in ok.stdout, ok.stdout + ok.stderr
    crowded = subprocess.run([mpiexec_path(), "-n", str(gpus + 1), sys.executable, str(script)],
                             capture_output=True, text=True, timeout=300)
    assert crowded.returncode != 0
    assert f"{gpus + 1} ranks share this node" in crowded.stdout
