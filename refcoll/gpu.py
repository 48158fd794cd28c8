"""GPU support: CuPy arrays through the same algorithms, CUDA-aware MPI or host staging, NCCL.

The algorithms never ask where their buffers live: the array namespace follows
the input (NumPy in, NumPy out; CuPy in, CuPy out), and a device transport
wraps the host transport so that device buffers can cross it:

* :class:`DirectTransport`, when the MPI library reads device memory (CUDA-aware):
  device buffers go to mpi4py's upper-case calls as they are (mpi4py takes
  objects with ``__cuda_array_interface__`` or DLPack), after the current stream
  is synchronised, so no kernel still writes a buffer MPI reads or reads one MPI
  overwrites.
* :class:`StagingTransport`, when it does not: each message crosses a pinned host
  buffer, copied device-to-host before the send and host-to-device after the
  receive on a stream of its own, in chunks, so the copy of one chunk overlaps
  the transfer of its neighbour. Pinned buffers are allocated once per size class
  and reused.

Local reductions stay on the device (CuPy's ufuncs with ``out=``) on both.
Which of the two applies is :func:`cuda_aware`'s answer, explained: the
``REFCOLL_CUDA_AWARE`` override, the MPI library's own ``MPIX_Query_cuda_support``
(Open MPI, MPICH), or a probe in a child process.

NCCL is the baseline ``refcoll bench --against nccl`` times beside refcoll:
:func:`nccl_comm`, :func:`nccl_call` (every collective NCCL has),
:func:`nccl_allreduce` and :func:`check_one_gpu_per_rank`; :func:`use_node_gpu`
picks a rank's GPU when ranks may share one.
:func:`copy_bandwidth` and :func:`compressor_throughput` measure what the GPU
benchmarks compare compressors with.

CuPy is imported lazily: nothing here imports it for a NumPy array, and a machine
without it runs everything else.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import signal
import statistics
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .errors import UsageError
from .transport.mpi import bounded_barrier

__all__ = [
    "CUDA_AWARE_ENV",
    "STAGING_CHUNK_BYTES",
    "cupy_or_none",
    "gpu_unavailable_reason",
    "require_cupy",
    "array_namespace",
    "is_device_array",
    "check_device_dtype",
    "device_supports",
    "synchronize",
    "to_host",
    "cuda_aware",
    "mpi_library_paths",
    "query_cuda_support",
    "probe_cuda_aware",
    "device_path",
    "DeviceOp",
    "PinnedPool",
    "DirectTransport",
    "StagingTransport",
    "device_transport",
    "device_generator",
    "NCCL_CALLS",
    "require_nccl",
    "nccl_version",
    "nccl_comm",
    "nccl_call",
    "nccl_allreduce",
    "nccl_types",
    "check_one_gpu_per_rank",
    "use_node_gpu",
    "copy_bandwidth",
    "compressor_throughput",
]

#: The environment variable that overrides CUDA-aware detection: ``1`` direct, ``0`` staging.
CUDA_AWARE_ENV = "REFCOLL_CUDA_AWARE"

#: Largest message the staging path sends whole; longer ones go in chunks of this size.
STAGING_CHUNK_BYTES = 4 << 20


# ------------------------------------------------------------------------------ CuPy

@functools.cache
def _cupy_state() -> tuple[Any, str | None]:
    try:
        import cupy
    except ImportError as exc:
        return None, f"CuPy is not installed ({exc}); pip install 'refcoll[gpu]'"
    except Exception as exc:  # noqa: BLE001 - a broken CUDA install fails in many ways
        return None, f"CuPy does not import ({type(exc).__name__}: {exc})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - no driver, no device: CUDA raises its own types
        return None, f"CuPy finds no CUDA device ({type(exc).__name__}: {exc})"
    if count < 1:
        return None, "CuPy finds no CUDA device"
    return cupy, None


def cupy_or_none():
    """Return the ``cupy`` module when it imports and sees a CUDA device, else None.

    :func:`gpu_unavailable_reason` says why not. The answer is cached.
    """
    return _cupy_state()[0]


def gpu_unavailable_reason() -> str | None:
    """Return why there is no usable GPU here, in one line (None: there is one)."""
    return _cupy_state()[1]


def require_cupy(what: str):
    """Return ``cupy``, or raise :class:`UsageError` saying why ``what`` cannot run here."""
    cupy = cupy_or_none()
    if cupy is None:
        raise UsageError(f"{what} needs a CUDA GPU and CuPy: {gpu_unavailable_reason()}")
    return cupy


def array_namespace(x):
    """Return the array module of ``x``: ``cupy`` for a CuPy array, NumPy for anything else.

    Decided by type alone, and without importing CuPy: an array can only be a
    CuPy array if CuPy is imported already.
    """
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        return cupy
    return np


def is_device_array(x) -> bool:
    """Return whether ``x`` lives in device memory (a CuPy array)."""
    return array_namespace(x) is not np


def check_device_dtype(dtype, xp) -> None:
    """Raise :class:`UsageError` when the device cannot compute in ``dtype``.

    CuPy 14 computes in bfloat16 when ml_dtypes is installed; earlier versions,
    and float8 everywhere, cannot. NumPy (``xp is np``) takes every dtype.
    """
    if xp is np:
        return
    problem = _device_dtype_problem(xp, np.dtype(dtype))
    if problem is not None:
        from .ops import dtype_name

        raise UsageError(
            f"CuPy {getattr(xp, '__version__', '?')} cannot compute in {dtype_name(dtype)} on "
            f"the device ({problem}); bfloat16 needs CuPy >= 14 with ml_dtypes, float8 has "
            "no CuPy support: cast to float16 or float32, or run on the CPU"
        )


def device_supports(dtype, xp) -> bool:
    """Return whether arrays of ``xp`` compute in ``dtype`` (NumPy: every refcoll dtype)."""
    return xp is np or _device_dtype_problem(xp, np.dtype(dtype)) is None


def synchronize(xp) -> None:
    """Wait for the work queued on the current stream of ``xp`` (nothing for NumPy).

    Timings of device work end here: a call returns once its kernels are queued,
    not when they have run.
    """
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


def to_host(a):
    """Return ``a`` as a NumPy array: a device array copied to the host, others as they are."""
    if a is None or not is_device_array(a):
        return a
    return array_namespace(a).asnumpy(a)


@functools.lru_cache(maxsize=64)
def _device_dtype_problem(xp, dtype: np.dtype) -> str | None:
    try:
        a = xp.zeros(2, dtype)
        xp.add(a, a, out=a)
    except Exception as exc:  # noqa: BLE001 - CuPy reports an unknown dtype as several types
        return f"{type(exc).__name__}: {exc}"
    return None


# ----------------------------------------------------------------- CUDA-aware MPI

def cuda_aware() -> tuple[bool, str]:
    """Return whether the MPI library reads device memory, and why refcoll thinks so.

    In order:

    1. ``REFCOLL_CUDA_AWARE=1`` or ``0`` decides (read on every call).
    2. The library's own ``MPIX_Query_cuda_support()``, looked up with ctypes in
       the MPI library mpi4py loaded (Open MPI; MPICH since 4.0, which answers
       at run time, so a CUDA build on a machine without a GPU says 0).
    3. Otherwise a probe: a one-element device buffer sent to self through MPI,
       in a child process (:func:`probe_cuda_aware`), because a library that
       cannot read device memory crashes on it rather than failing.

    The detected answer (2, 3) is cached for the process.

    Raises:
        UsageError: ``REFCOLL_CUDA_AWARE`` set to something other than 0 or 1.
    """
    value = os.environ.get(CUDA_AWARE_ENV)
    if value is not None:
        word = value.strip().lower()
        if word in ("1", "yes", "true", "on"):
            return True, f"{CUDA_AWARE_ENV}={value}"
        if word in ("0", "no", "false", "off"):
            return False, f"{CUDA_AWARE_ENV}={value}"
        raise UsageError(f"{CUDA_AWARE_ENV}={value!r}: set it to 1 (MPI reads device memory) "
                         "or 0 (stage through host memory), or unset it to detect")
    return _detected()


@functools.cache
def _detected() -> tuple[bool, str]:
    try:
        paths = mpi_library_paths()
    except (ImportError, RuntimeError) as exc:  # no mpi4py, or no MPI library under it
        return False, f"no MPI library to ask ({type(exc).__name__}: {exc})"
    library, answer = query_cuda_support(paths)
    if answer is not None:
        return bool(answer), (f"MPIX_Query_cuda_support() returned {answer} "
                              f"({_vendor()}, {os.path.basename(library)})")
    where = ", ".join(os.path.basename(p) for p in paths) or "the MPI library (not found)"
    aware, why = probe_cuda_aware()
    return aware, f"no MPIX_Query_cuda_support in {where}; {why}"


def _vendor() -> str:
    from mpi4py import MPI

    name, version = MPI.get_vendor()
    return f"{name} {'.'.join(map(str, version))}"


def mpi_library_paths() -> list[str]:
    """Return the paths of the MPI libraries mpi4py has loaded into this process.

    Read from the process's memory map (Linux), where the library mpi4py opened
    is listed whatever way it was found; elsewhere, the system's ``libmpi``.
    """
    from mpi4py import MPI  # noqa: F401 - loads the library whose symbols are looked up

    paths: list[str] = []
    with contextlib.suppress(OSError):
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip()
                name = os.path.basename(path)
                if name.startswith("libmpi") and ".so" in name and path not in paths:
                    paths.append(path)
    if not paths:
        found = ctypes.util.find_library("mpi")
        if found:
            paths.append(found)
    return paths


def query_cuda_support(paths: Sequence[str]) -> tuple[str | None, int | None]:
    """Call ``MPIX_Query_cuda_support()`` in the first of ``paths`` that exports it.

    Only libraries already loaded are opened (``RTLD_NOLOAD``): a second MPI
    library in the process would be worse than no answer. Returns the library's
    path and the answer, or ``(None, None)`` when none exports the function.
    """
    mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 1)
    for path in paths:
        try:
            library = ctypes.CDLL(path, mode=mode)
        except OSError:
            continue
        query = getattr(library, "MPIX_Query_cuda_support", None)
        if query is not None:
            query.restype = ctypes.c_int
            query.argtypes = []
            return path, int(query())
    return None, None


#: Environment variables a launcher sets for its processes. The probe's child
#: must not see them, or it would try to join the parent's job instead of
#: starting MPI on its own (a singleton).
_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "PRTE_", "HYDRA_", "MPI_LOCAL", "PALS_",
                      "SLURM_", "I_MPI_HYDRA")

_PROBE_VALUE = 1234.5
_PROBE_CODE = "from refcoll.gpu import _probe_child; raise SystemExit(_probe_child())"


def probe_cuda_aware(command: Sequence[str] | None = None, *,
                     timeout: float = 60.0) -> tuple[bool, str]:
    """Send a one-element device buffer to self through MPI in a child process.

    A library that cannot read device memory dereferences the device pointer as
    host memory: it crashes, hangs or moves garbage, so the probe never runs in
    this process. The child starts MPI on its own (launcher variables removed)
    and prints ``ok`` when the value arrived intact. Without a usable GPU the
    probe is skipped: the answer is staging, which works everywhere.

    Args:
        command: the child's command line; default: this Python running the probe.
        timeout: seconds before the child is killed and the answer is staging.
    """
    if command is None:
        reason = gpu_unavailable_reason()
        if reason is not None:
            return False, f"probe skipped: {reason}"
        command = [sys.executable, "-c", _PROBE_CODE]
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
    try:
        child = subprocess.run(list(command), env=env, capture_output=True, text=True,
                               timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"probe: no answer in {timeout:g} s, so staging"
    if child.returncode < 0:
        try:
            name = signal.Signals(-child.returncode).name
        except ValueError:
            name = f"signal {-child.returncode}"
        return False, f"probe: sending a device buffer through MPI killed the child ({name})"
    if child.returncode == 0 and child.stdout.strip() == "ok":
        return True, "probe: a device buffer sent to self through MPI arrived intact"
    last = (child.stderr.strip().splitlines() or child.stdout.strip().splitlines() or ["-"])[-1]
    return False, f"probe: failed (exit code {child.returncode}: {last})"


def _probe_child() -> int:
    """The probe itself: run in a child process by :func:`probe_cuda_aware`."""
    import cupy
    from mpi4py import MPI

    sent = cupy.full(1, _PROBE_VALUE, dtype=cupy.float64)
    got = cupy.zeros(1, dtype=cupy.float64)
    cupy.cuda.get_current_stream().synchronize()
    MPI.COMM_SELF.Sendrecv([sent, MPI.DOUBLE], 0, 0, [got, MPI.DOUBLE], 0, 0)
    print("ok" if float(got.get()[0]) == _PROBE_VALUE else "wrong value")
    return 0


def device_path() -> dict:
    """Return how device buffers would move here: the GPU, the path and the reason.

    ``{"gpu": name or None, "gpu_reason": why none or None, "cuda_aware": bool,
    "path": "direct" | "staging", "why": reason}``; for ``refcoll list`` and the
    headers of GPU benchmarks.
    """
    cupy = cupy_or_none()
    name = None
    if cupy is not None:
        device = cupy.cuda.runtime.getDevice()
        raw = cupy.cuda.runtime.getDeviceProperties(device)["name"]
        name = raw.decode() if isinstance(raw, bytes) else str(raw)
    aware, why = cuda_aware()
    return {"gpu": name, "gpu_reason": gpu_unavailable_reason(), "cuda_aware": aware,
            "path": "direct" if aware else "staging", "why": why}


# ---------------------------------------------------------------- device transports

@dataclass(frozen=True)
class DeviceOp:
    """A reduction op whose combine runs as the device array module's own ufunc.

    ``apply`` is what every transport's ``reduce_local`` calls: here it is
    ``xp.add(a, b, out=out)`` (or ``multiply``, ``minimum``, ``maximum``) of
    CuPy, one elementwise kernel, correctly rounded like NumPy's.
    """

    op: Any
    xp: Any

    @property
    def name(self) -> str:
        """Return the op's name (``sum``...)."""
        return self.op.name

    def apply(self, a, b, out) -> None:
        """Compute ``out = a (op) b`` on the device."""
        getattr(self.xp, self.op.ufunc.__name__)(a, b, out=out)


class _DeviceTransport:
    """What both device transports share: everything but point-to-point goes to ``inner``.

    ``array_module`` tells the algorithms' workspaces where to allocate.
    """

    def __init__(self, inner, xp):
        self.inner = inner
        self.array_module = xp
        self.rank = inner.rank
        self.size = inner.size

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"

    @property
    def traffic(self):
        """Return the wrapped transport's byte counters."""
        return self.inner.traffic

    @property
    def current_call(self) -> str | None:
        """Return the name of the collective call running, if any."""
        return self.inner.current_call

    def call(self, name: str):
        """Run one collective call in the wrapped transport's tag space."""
        return self.inner.call(name)

    def unreceived(self) -> list[str]:
        """Return the messages sent to this rank and not received."""
        return self.inner.unreceived()

    def split(self, color: int, key: int):
        """Return the device transport of ``inner.split(color, key)`` (None where it is)."""
        sub = self.inner.split(color, key)
        return None if sub is None else self._wrap(sub)

    def split_node(self):
        """Return the device transport of the ranks on this rank's node."""
        return self._wrap(self.inner.split_node())

    def reduce_local(self, op, a, b, out) -> None:
        """Compute ``out = op(a, b)``: on the device for device arrays, else as ``inner`` does."""
        if is_device_array(out):
            op = DeviceOp(getattr(op, "op", op), self.array_module)
        self.inner.reduce_local(op, a, b, out)

    def _wrap(self, sub):
        raise NotImplementedError


class DirectTransport(_DeviceTransport):
    """Device buffers straight to a transport whose MPI library reads device memory.

    Before each exchange that touches a device buffer the current stream is
    synchronised: kernels queued on it may still write a buffer about to be
    sent, or read one about to be overwritten, and MPI knows nothing of streams.
    """

    def send(self, buf, dest: int, tag: int = 0) -> None:
        """Send ``buf`` (host or device) to ``dest``."""
        self._settle(buf)
        self.inner.send(buf, dest, tag)

    def recv(self, buf, source: int, tag: int = 0) -> None:
        """Receive into ``buf`` (host or device) from ``source``."""
        self._settle(buf)
        self.inner.recv(buf, source, tag)

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0) -> None:
        """Send to ``dest`` and receive from ``source`` at once."""
        self._settle(sendbuf, recvbuf)
        self.inner.sendrecv(sendbuf, dest, recvbuf, source, tag)

    def _settle(self, *bufs) -> None:
        if any(is_device_array(b) for b in bufs):
            self.array_module.cuda.get_current_stream().synchronize()

    def _wrap(self, sub) -> "DirectTransport":
        return DirectTransport(sub, self.array_module)


class PinnedPool:
    """Page-locked host buffers, one per (role, slot), grown by size class and reused.

    A request of ``n`` bytes gets a view of a buffer of the next power of two
    (at least 4 KiB); a buffer is replaced only by a larger class, so once a
    collective has run, repeating it allocates nothing. ``allocations`` and
    ``allocated_bytes`` count what was allocated.
    """

    MIN_BYTES = 4096

    def __init__(self, xp):
        self.xp = xp
        self._buffers: dict[tuple, np.ndarray] = {}
        self.allocations = 0
        self.allocated_bytes = 0

    def get(self, role: str, slot: int, nbytes: int) -> np.ndarray:
        """Return ``nbytes`` of pinned host memory as a ``uint8`` array, for (role, slot)."""
        key = (role, slot)
        buf = self._buffers.get(key)
        if buf is None or buf.nbytes < nbytes:
            size = max(self.MIN_BYTES, 1 << max(0, nbytes - 1).bit_length())
            memory = self.xp.cuda.alloc_pinned_memory(size)
            buf = np.frombuffer(memory, np.uint8, size)  # the array keeps the memory alive
            self._buffers[key] = buf
            self.allocations += 1
            self.allocated_bytes += size
        return buf[:nbytes]


class _CopyEngine:
    """The staging path's stream, events and pinned pool, shared by a transport and its splits."""

    def __init__(self, xp):
        self.xp = xp
        self.pool = PinnedPool(xp)
        self._stream = None
        self._events: dict[tuple, Any] = {}

    @property
    def stream(self):
        if self._stream is None:
            self._stream = self.xp.cuda.Stream(non_blocking=True)
        return self._stream

    def event(self, role: str, slot: int):
        key = (role, slot)
        if key not in self._events:
            self._events[key] = self.xp.cuda.Event(disable_timing=True)
        return self._events[key]

    def follow_current_stream(self) -> None:
        """Make later copies wait for the kernels queued so far on the current stream."""
        ready = self.event("ready", 0)
        ready.record(self.xp.cuda.get_current_stream())
        self.stream.wait_event(ready)


def _pieces(nbytes: int, chunk: int) -> list[tuple[int, int]]:
    """Return the byte ranges a message of ``nbytes`` travels in (one, possibly empty, at least)."""
    count = max(1, -(-nbytes // chunk))
    return [(i * chunk, min((i + 1) * chunk, nbytes)) for i in range(count)]


class StagingTransport(_DeviceTransport):
    """Device buffers through pinned host memory, for an MPI library that reads host memory only.

    Every message longer than ``chunk_bytes`` travels as consecutive messages of
    ``chunk_bytes`` (host or device alike, so both ends cut it the same way: the
    cut depends on the byte count alone). The pieces of one message keep its tag
    and MPI delivers messages of one (source, tag) in order, so matching stays
    deterministic; step ``i`` exchanges piece ``i`` of the send and of the
    receive, so an exchange that completes whole also completes in pieces.

    Pipelining with blocking transport calls: two pinned slots per direction.
    While the host blocks in the transfer of piece ``i`` (slot ``i % 2``), the
    copy stream copies piece ``i + 1`` device-to-host into the other slot, and
    the host-to-device copy of received piece ``i`` runs while piece ``i + 1``
    is received. A slot is reused only after the event of its last copy. The
    copy stream first waits for the kernels already queued on the current
    stream; a call returns once its received bytes are on the device.

    Host buffers travel untouched (no copies), in the same pieces.
    """

    def __init__(self, inner, xp=None, *, chunk_bytes: int = STAGING_CHUNK_BYTES,
                 engine: _CopyEngine | None = None):
        xp = xp if xp is not None else require_cupy("host staging")
        super().__init__(inner, xp)
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self._engine = engine if engine is not None else _CopyEngine(xp)

    @property
    def pool(self) -> PinnedPool:
        """Return the pinned buffers this transport (and its splits) reuse."""
        return self._engine.pool

    def send(self, buf, dest: int, tag: int = 0) -> None:
        """Send ``buf`` (host or device) to ``dest``."""
        self._exchange(buf, dest, None, None, tag)

    def recv(self, buf, source: int, tag: int = 0) -> None:
        """Receive into ``buf`` (host or device) from ``source``."""
        self._exchange(None, None, buf, source, tag)

    def sendrecv(self, sendbuf, dest: int, recvbuf, source: int, tag: int = 0) -> None:
        """Send to ``dest`` and receive from ``source`` at once, piece by piece."""
        self._exchange(sendbuf, dest, recvbuf, source, tag)

    def _wrap(self, sub) -> "StagingTransport":
        return StagingTransport(sub, self.array_module, chunk_bytes=self.chunk_bytes,
                                engine=self._engine)

    def _exchange(self, sendbuf, dest, recvbuf, source, tag: int) -> None:
        from .transport.sim import as_bytes

        outgoing = None if sendbuf is None else as_bytes(sendbuf)
        incoming = None if recvbuf is None else as_bytes(recvbuf)
        out_device = outgoing is not None and is_device_array(outgoing)
        in_device = incoming is not None and is_device_array(incoming)
        sends = [] if outgoing is None else _pieces(outgoing.nbytes, self.chunk_bytes)
        recvs = [] if incoming is None else _pieces(incoming.nbytes, self.chunk_bytes)
        if not (out_device or in_device) and len(sends) <= 1 and len(recvs) <= 1:
            self._step(outgoing, dest, incoming, source, tag)
            return
        engine = self._engine
        if out_device or in_device:
            engine.follow_current_stream()
        staged = self._stage(outgoing, sends[0], 0) if sends else None
        for i in range(max(len(sends), len(recvs))):
            following = None
            if i + 1 < len(sends):  # its copy overlaps this piece's transfer
                following = self._stage(outgoing, sends[i + 1], (i + 1) % 2)
            if out_device and i < len(sends):
                engine.event("send", i % 2).synchronize()
            landing = None
            if i < len(recvs):
                start, stop = recvs[i]
                if in_device:
                    engine.event("recv", i % 2).synchronize()  # its last copy to the device is done
                    landing = engine.pool.get("recv", i % 2, stop - start)
                else:
                    landing = incoming[start:stop]
            self._step(staged if i < len(sends) else None, dest, landing, source, tag)
            if in_device and landing is not None and landing.nbytes:
                incoming[start:stop].set(landing, stream=engine.stream)
                engine.event("recv", i % 2).record(engine.stream)
            staged = following
        if in_device:
            engine.stream.synchronize()

    def _stage(self, outgoing, bounds: tuple[int, int], slot: int):
        """Return piece ``bounds`` of ``outgoing`` in host memory (its copy queued, if needed)."""
        start, stop = bounds
        if not is_device_array(outgoing):
            return outgoing[start:stop]
        engine = self._engine
        host = engine.pool.get("send", slot, stop - start)
        if stop > start:
            outgoing[start:stop].get(stream=engine.stream, out=host, blocking=False)
        engine.event("send", slot).record(engine.stream)
        return host

    def _step(self, outgoing, dest, incoming, source, tag: int) -> None:
        if outgoing is not None and incoming is not None:
            self.inner.sendrecv(outgoing, dest, incoming, source, tag)
        elif outgoing is not None:
            self.inner.send(outgoing, dest, tag)
        elif incoming is not None:
            self.inner.recv(incoming, source, tag)


def device_transport(t, x=None):
    """Return the transport that carries device arrays over ``t``: direct or staged.

    ``x`` a host array (or ``t`` a device transport already): ``t`` itself.
    Otherwise :class:`DirectTransport` when :func:`cuda_aware` says so on every
    rank, else :class:`StagingTransport` (ranks agree once per transport, since
    the two cut long messages differently; simulated ranks share a process and
    its answer). The result is cached on ``t``.
    """
    if isinstance(t, _DeviceTransport) or (x is not None and not is_device_array(x)):
        return t
    cached = t.__dict__.get("_device_transport")
    if cached is not None:
        return cached
    xp = array_namespace(x) if x is not None else require_cupy("a device transport")
    aware, _ = cuda_aware()
    from .transport.sim import SimTransport

    if t.size > 1 and not isinstance(t, SimTransport):
        from .api import allreduce

        aware = bool(allreduce(np.array([int(aware)], np.int8), t, op="min",
                               algorithm="ring", validate=False)[0])
    wrapped = DirectTransport(t, xp) if aware else StagingTransport(t, xp)
    t.__dict__["_device_transport"] = wrapped
    return wrapped


def device_generator(state, xp):
    """Return the state's random generator for arrays of ``xp``.

    NumPy: ``state.rng``. CuPy: a device generator seeded from ``(seed, rank)``,
    kept in ``state.memory``; stochastic compressors (QSGD, TernGrad) draw their
    rounding there, so a device run is reproducible but draws other numbers
    than the CPU.
    """
    if xp is np:
        return state.rng
    key = ("device.rng", xp.__name__)
    generator = state.memory.get(key)
    if generator is None:
        seed = np.random.SeedSequence([state.seed, state.rank]).generate_state(1, np.uint64)[0]
        generator = xp.random.default_rng(int(seed >> np.uint64(1)))
        state.memory[key] = generator
    return generator


# -------------------------------------------------------------------------------- NCCL

#: ncclDataType_t and ncclRedOp_t from nccl.h, by refcoll's names. bfloat16 and avg
#: need NCCL 2.10; NCCL has no 16-bit integers.
_NCCL_DTYPES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
                "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9}
_NCCL_OPS = {"sum": 0, "prod": 1, "max": 2, "min": 3, "avg": 4}
_NCCL_2_10 = 21000


#: The NCCL function that does each refcoll collective; ``cupy.cuda.nccl``'s
#: ``NcclCommunicator`` calls them allReduce, reduceScatter, allGather, broadcast, reduce.
NCCL_CALLS = {
    "allreduce": "ncclAllReduce",
    "reduce_scatter": "ncclReduceScatter",
    "allgather": "ncclAllGather",
    "broadcast": "ncclBroadcast",
    "reduce": "ncclReduce",
}


def require_nccl(what: str | None = None):
    """Return ``cupy.cuda.nccl``, or raise :class:`UsageError` saying why ``what`` cannot run."""
    require_cupy(what or "NCCL")
    import importlib

    prefix = f"{what}: " if what else ""
    try:
        nccl = importlib.import_module("cupy.cuda.nccl")
    except ImportError as exc:
        raise UsageError(f"{prefix}NCCL is not available to CuPy ({exc})") from None
    if not getattr(nccl, "available", True):
        raise UsageError(f"{prefix}NCCL is not available to CuPy: install the NCCL library "
                         "(pip install nvidia-nccl-cu12, or the one matching CuPy's CUDA)")
    return nccl


def nccl_version() -> str | None:
    """Return the NCCL library's version as ``2.23.4`` (None: no NCCL here).

    NCCL encodes it as ``major·10000 + minor·100 + patch`` since 2.9, as
    ``major·1000 + minor·100 + patch`` before.
    """
    try:
        code = int(require_nccl().get_version())
    except UsageError:
        return None
    if code >= 10000:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


def nccl_types(dtype, op) -> tuple[int, int]:
    """Return NCCL's ``(datatype, redop)`` codes for a dtype and an op name.

    Raises:
        UsageError: a dtype or op NCCL does not have (16-bit integers, float8;
            bfloat16 and avg before NCCL 2.10).
    """
    from .ops import dtype_name, get_op

    name, op_name = dtype_name(dtype), get_op(op).name
    if name not in _NCCL_DTYPES:
        raise UsageError(f"NCCL has no {name} type; NCCL reduces "
                         f"{', '.join(_NCCL_DTYPES)}")
    if name == "bfloat16" or op_name == "avg":
        version = require_nccl().get_version()
        if version < _NCCL_2_10:
            raise UsageError(f"NCCL {version} has no {'bfloat16' if name == 'bfloat16' else 'avg'}"
                             "; it needs NCCL >= 2.10")
    return _NCCL_DTYPES[name], _NCCL_OPS[op_name]


def nccl_comm(mpi_comm):
    """Return an NCCL communicator over the ranks of the mpi4py communicator ``mpi_comm``.

    Rank 0 makes the unique id and MPI broadcasts it; every rank must have
    chosen its GPU first (:func:`check_one_gpu_per_rank`).
    """
    nccl = require_nccl()
    uid = nccl.get_unique_id() if mpi_comm.Get_rank() == 0 else None
    bounded_barrier(mpi_comm, "NCCL communicator setup (MPI_Bcast of the unique id)")
    uid = mpi_comm.bcast(uid, root=0)
    # ncclCommInitRank blocks until every rank joins; all of them passed the barrier.
    return nccl.NcclCommunicator(mpi_comm.Get_size(), uid, mpi_comm.Get_rank())


def nccl_call(comm, collective: str, sendbuf, recvbuf, *, op="sum", root: int = 0):
    """Return a zero-argument call of NCCL's ``collective`` on these device buffers.

    The buffers follow refcoll's layout of the collective: ``sendbuf`` this
    rank's input (what the root sends, in a broadcast), ``recvbuf`` its result
    (``count / n`` elements of a reduce-scatter, ``n`` inputs of an allgather;
    ``None`` on the non-roots of a reduce). Types, counts and the stream are
    resolved here, once, so the call is NCCL's own and nothing else; it is
    queued on the current stream and returns without waiting
    (:func:`synchronize` waits).

    Raises:
        UsageError: host arrays, mismatched dtypes, a dtype or op NCCL lacks, an
            unknown collective.
    """
    xp = array_namespace(sendbuf)
    if xp is np or (recvbuf is not None and array_namespace(recvbuf) is np):
        raise UsageError("NCCL reduces device arrays: pass CuPy arrays")
    if recvbuf is not None and sendbuf.dtype != recvbuf.dtype:
        raise UsageError(f"NCCL needs buffers of one dtype, got {sendbuf.dtype} and "
                         f"{recvbuf.dtype}")
    if collective not in NCCL_CALLS:
        raise UsageError(f"NCCL has no {collective!r}: it runs {', '.join(NCCL_CALLS)}")
    if recvbuf is None and collective != "reduce":
        raise UsageError(f"NCCL {collective} needs a receive buffer on every rank")
    datatype, redop = nccl_types(sendbuf.dtype, op)
    send = sendbuf.data.ptr
    recv = send if recvbuf is None else recvbuf.data.ptr
    stream = xp.cuda.get_current_stream().ptr
    if collective == "allreduce":
        _check_count(sendbuf.size, recvbuf.size, collective)
        count = sendbuf.size
        return lambda: comm.allReduce(send, recv, count, datatype, redop, stream)
    if collective == "reduce_scatter":
        count = recvbuf.size
        _check_count(sendbuf.size, count * comm.size(), collective)
        return lambda: comm.reduceScatter(send, recv, count, datatype, redop, stream)
    if collective == "allgather":
        count = sendbuf.size
        _check_count(count * comm.size(), recvbuf.size, collective)
        return lambda: comm.allGather(send, recv, count, datatype, stream)
    if collective == "broadcast":
        count = recvbuf.size
        _check_count(sendbuf.size, count, collective)
        return lambda: comm.broadcast(send, recv, count, datatype, root, stream)
    count = sendbuf.size
    if recvbuf is not None:
        _check_count(count, recvbuf.size, collective)
    return lambda: comm.reduce(send, recv, count, datatype, redop, root, stream)


def _check_count(have: int, want: int, collective: str) -> None:
    if have != want:
        raise UsageError(f"NCCL {collective}: the buffers hold {have} and {want} elements, "
                         "which its layout does not allow")


def nccl_allreduce(comm, sendbuf, recvbuf, op="sum", *, synchronize: bool = True) -> None:
    """All-reduce the device array ``sendbuf`` into ``recvbuf`` with NCCL (``recvbuf`` may be it).

    Runs on the current stream; with ``synchronize`` (the default) it returns
    once the result is there, as refcoll's calls do, so the two time alike.
    """
    nccl_call(comm, "allreduce", sendbuf, recvbuf, op=op)()
    if synchronize:
        array_namespace(sendbuf).cuda.get_current_stream().synchronize()


def _node_rank(mpi_comm) -> tuple[int, int]:
    """Return this rank's place among the ranks of ``mpi_comm`` on its node, and their count."""
    from mpi4py import MPI

    bounded_barrier(mpi_comm, "GPU selection (MPI_Comm_split_type)")
    node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, mpi_comm.Get_rank())
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()


def check_one_gpu_per_rank(mpi_comm) -> int:
    """Give each rank of ``mpi_comm`` its own GPU on its node; return the device number.

    NCCL needs one process per GPU. Ranks on one node (``MPI.COMM_TYPE_SHARED``)
    take devices 0, 1, ... in rank order; a node with more ranks than visible
    GPUs is an error on every rank.

    Raises:
        UsageError: some node has more ranks than GPUs (or there is no GPU).
    """
    from mpi4py import MPI

    rank = mpi_comm.Get_rank()
    local_rank, local_size = _node_rank(mpi_comm)
    cupy = cupy_or_none()
    gpus = cupy.cuda.runtime.getDeviceCount() if cupy is not None else 0
    bounded_barrier(mpi_comm, "GPU selection (MPI_Allreduce)")
    crowded = mpi_comm.allreduce(int(local_size > gpus), op=MPI.MAX)
    if crowded:
        if local_size > gpus:
            seen = (f"{gpus} GPU(s) visible" if cupy is not None
                    else f"no GPU ({gpu_unavailable_reason()})")
            raise UsageError(
                f"rank {rank}: {local_size} ranks share this node ({MPI.Get_processor_name()}) "
                f"with {seen}; NCCL needs one process per GPU: start at most {gpus} rank(s) per "
                "node, or make more GPUs visible (CUDA_VISIBLE_DEVICES)")
        raise UsageError(f"rank {rank}: another node has more ranks than GPUs; NCCL needs one "
                         "process per GPU")
    cupy.cuda.Device(local_rank).use()
    return local_rank


def use_node_gpu(mpi_comm) -> int:
    """Make GPU ``local rank mod GPUs`` current on each rank of ``mpi_comm``; return its number.

    For refcoll's own collectives, which run with several ranks on one GPU
    (slower, but correct); NCCL does not (:func:`check_one_gpu_per_rank`).

    Raises:
        UsageError: there is no usable GPU here.
    """
    cupy = require_cupy("a GPU run")
    local_rank, _ = _node_rank(mpi_comm)
    device = local_rank % cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(device).use()
    return device


# --------------------------------------------------------------------- measurements

def _median_seconds(xp, fn, repeats: int) -> float:
    """Return the median device time of ``fn()`` over ``repeats`` runs after one warm-up.

    Timed with CUDA events on the current stream: host work between them (a
    Python loop, a synchronising read) counts, as the device idles through it.
    """
    fn()
    times = []
    for _ in range(repeats):
        start, stop = xp.cuda.Event(), xp.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(xp.cuda.get_elapsed_time(start, stop) / 1e3)
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 256 << 20, *, repeats: int = 5) -> dict:
    """Measure the copies the GPU path is made of, in bytes copied per second.

    Device to device (a byte read and a byte written: memory traffic is twice
    the figure), and device to pinned host and back (what staging pays).
    """
    xp = require_cupy("copy_bandwidth")
    src = xp.ones(nbytes, dtype=xp.uint8)
    dst = xp.empty_like(src)
    host = np.frombuffer(xp.cuda.alloc_pinned_memory(max(nbytes, 1)), np.uint8, nbytes)
    result = {"bytes": nbytes, "repeats": repeats}
    for name, fn in [("device_to_device", lambda: xp.copyto(dst, src)),
                     ("device_to_host", lambda: src.get(out=host)),
                     ("host_to_device", lambda: dst.set(host))]:
        seconds = _median_seconds(xp, fn, repeats)
        result[f"{name}_s"] = seconds
        result[f"{name}_GBps"] = nbytes / seconds / 1e9 if seconds > 0 else float("inf")
    return result


def compressor_throughput(specs: Sequence[str], n: int, *, repeats: int = 3,
                          seed: int = 0) -> list[dict]:
    """Time compress and decompress of ``n`` float32 on the device, per compressor spec.

    PowerSGD gets the tensor as a square-ish matrix (it compresses matrices).
    Each row: the spec, the median seconds of each half, the tensor's bytes per
    second through both (dense GB/s), the payload's bytes and the ratio.
    """
    from .compressors import parse

    xp = require_cupy("compressor_throughput")
    x = xp.random.default_rng(seed).standard_normal(n, dtype=xp.float32)
    rows = 1 << (max(n, 1).bit_length() - 1) // 2
    matrix = x[: rows * (n // rows)].reshape(rows, n // rows)
    out = []
    for spec in specs:
        comp = parse(spec)
        tensor = matrix if "powersgd" in spec else x
        state = comp.new_state(seed, 0)
        payload = comp.compress(tensor, state)
        compress_s = _median_seconds(xp, lambda: comp.compress(tensor, state), repeats)
        decompress_s = _median_seconds(xp, lambda: comp.decompress(payload), repeats)
        total = compress_s + decompress_s
        out.append({"spec": spec, "elements": int(tensor.size), "compress_s": compress_s,
                    "decompress_s": decompress_s,
                    "GBps": tensor.nbytes / total / 1e9 if total > 0 else float("inf"),
                    "payload_bytes": payload.nbytes,
                    "ratio": tensor.nbytes / payload.nbytes if payload.nbytes else float("inf")})
    return out
