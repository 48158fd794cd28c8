"""CUDA-aware MPI: does the MPI library read device memory, and why refcoll thinks so.

:func:`cuda_aware` answers from the ``REFCOLL_CUDA_AWARE`` override, the MPI
library's own ``MPIX_Query_cuda_support`` (Open MPI, MPICH), or a probe in a
child process; :func:`device_path` says which path device buffers take here.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import signal
import subprocess
from typing import Sequence

from ..core.errors import UsageError
from ..core.processes import python
from ..core.xp import cupy_or_none, gpu_unavailable_reason

__all__ = ["CUDA_AWARE_ENV", "cuda_aware", "mpi_library_paths", "query_cuda_support",
           "probe_cuda_aware", "device_path"]

#: The environment variable that overrides CUDA-aware detection: ``1`` direct, ``0`` staging.
CUDA_AWARE_ENV = "REFCOLL_CUDA_AWARE"


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
_PROBE_CODE = ("from refcoll.transport.cuda_aware import _probe_child; "
               "raise SystemExit(_probe_child())")


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
        command = python("-c", _PROBE_CODE)
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
