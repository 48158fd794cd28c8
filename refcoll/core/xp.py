"""The array namespace: NumPy for host arrays, CuPy for device arrays, decided by type.

The algorithms never ask where their buffers live: the namespace follows the
input (NumPy in, NumPy out; CuPy in, CuPy out). CuPy is imported lazily: nothing
here imports it for a NumPy array, and a machine without it runs everything else.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import numpy as np

from .errors import UsageError
from .ops import dtype_name

__all__ = ["cupy_or_none", "gpu_unavailable_reason", "require_cupy", "array_namespace",
           "is_device_array", "address", "check_device_dtype", "device_supports", "synchronize",
           "to_host", "device_generator", "on_callers_device"]


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


def address(a) -> int:
    """Return the address of ``a``'s first element, in host or device memory.

    (CuPy arrays have no ``__array_interface__``: their memory pointer says it.)
    """
    if a.__class__ is np.ndarray or not is_device_array(a):
        return a.__array_interface__["data"][0]
    return a.data.ptr


def on_callers_device(job, x):
    """Return ``job`` to run on another thread, on the caller's current device and stream.

    CUDA's current device and CuPy's current stream belong to a host thread: a
    progress thread would otherwise allocate on device 0 and queue kernels on its
    own stream, racing the caller's. A host ``x``: ``job`` itself.
    """
    if not is_device_array(x):
        return job
    cuda = array_namespace(x).cuda
    device, stream = cuda.Device(), cuda.get_current_stream()

    def on_device():
        with device, stream:
            return job()
    return on_device


def check_device_dtype(dtype, xp) -> None:
    """Raise :class:`UsageError` when the device cannot compute in ``dtype``.

    CuPy 14 computes in bfloat16 when ml_dtypes is installed; earlier versions,
    and float8 everywhere, cannot. NumPy (``xp is np``) takes every dtype.
    """
    if xp is np:
        return
    problem = _device_dtype_problem(xp, np.dtype(dtype))
    if problem is not None:
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
