"""Device throughput: the copies the GPU path is made of, and compressors on the device.

:func:`copy_bandwidth` and :func:`compressor_throughput` measure what the GPU
benchmarks compare compressors with.
"""

from __future__ import annotations

import functools
import statistics
from typing import Sequence

import numpy as np

from ..compressors import parse
from ..core.xp import require_cupy

__all__ = ["copy_bandwidth", "compressor_throughput"]


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

    A compressor that compresses matrices (it declares ``matrices``: PowerSGD)
    gets the tensor as a square-ish matrix, every other one the flat tensor.
    Each row: the spec, the median seconds of each half, the tensor's bytes per
    second through both (dense GB/s), the payload's bytes and the ratio.
    """
    xp = require_cupy("compressor_throughput")
    x = xp.random.default_rng(seed).standard_normal(n, dtype=xp.float32)
    rows = 1 << (max(n, 1).bit_length() - 1) // 2
    matrix = x[: rows * (n // rows)].reshape(rows, n // rows)
    out = []
    for spec in specs:
        comp = parse(spec)
        tensor = matrix if comp.matrices else x
        state = comp.new_state(seed, 0)
        payload = comp.compress(tensor, state)
        compress_s = _median_seconds(xp, functools.partial(comp.compress, tensor, state), repeats)
        decompress_s = _median_seconds(xp, functools.partial(comp.decompress, payload), repeats)
        total = compress_s + decompress_s
        out.append({"spec": spec, "elements": int(tensor.size), "compress_s": compress_s,
                    "decompress_s": decompress_s,
                    "GBps": tensor.nbytes / total / 1e9 if total > 0 else float("inf"),
                    "payload_bytes": payload.nbytes,
                    "ratio": tensor.nbytes / payload.nbytes if payload.nbytes else float("inf")})
    return out
