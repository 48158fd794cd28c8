"""Tensors in, tensors out: torch tensors as NumPy or CuPy arrays over the same memory.

A CPU tensor becomes a NumPy array, a CUDA tensor a CuPy array, both with DLPack
(``Tensor.numpy()`` would mark the storage as never resizable, which FSDP's
freed-and-regrown parameters cannot have): no copy either way, and results come back the same way
(``torch.from_numpy``, ``torch.from_dlpack``). bfloat16 and float8 tensors, which
NumPy and DLPack have no type for, travel as their bits (an integer view of the
same width) and are read as ml_dtypes' types.

What cannot be carried is refused here, before any data moves, with a reason:
a tensor that is not a tensor, a non-contiguous one, one on a device the group's
library does not move, a dtype refcoll does not reduce.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

from ..core.errors import UsageError
from ..core.ops import DTYPES

__all__ = ["as_array", "as_tensor", "cpu_tensor", "check_same_device", "torch_dtype_name",
           "flat", "reduction", "premultipliable", "premultiplier"]

#: torch's reduction types, as refcoll's ops (PREMUL_SUM: ``sum`` after the factor).
_OPS = {"SUM": "sum", "PRODUCT": "prod", "MIN": "min", "MAX": "max", "AVG": "avg",
        "PREMUL_SUM": "sum"}


def _torch():
    import torch

    return torch


@functools.cache
def _bits_types():
    """Return ``{torch dtype: (integer view dtype, NumPy dtype)}`` for NumPy's missing types."""
    torch = _torch()
    return {torch.bfloat16: (torch.int16, np.dtype(ml_dtypes.bfloat16)),
            torch.float8_e4m3fn: (torch.int8, np.dtype(ml_dtypes.float8_e4m3fn)),
            torch.float8_e5m2: (torch.int8, np.dtype(ml_dtypes.float8_e5m2))}


def torch_dtype_name(dtype) -> str:
    """Return torch's dtype without the ``torch.`` prefix: ``float32``, ``bfloat16``..."""
    return str(dtype).removeprefix("torch.")


def as_array(tensor, t, what: str = "the input"):
    """Return ``tensor`` as an array over its memory, for a call over transport ``t``.

    Raises:
        TypeError: ``tensor`` is not a torch tensor.
        ValueError: it is not contiguous.
        UsageError: its device is one the group's library does not move (a CUDA
            tensor on Gloo, a CPU tensor on NCCL), or refcoll does not reduce its dtype.
    """
    torch = _torch()
    rank = t.rank
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"rank {rank}: {what} must be a torch.Tensor, got "
                        f"{type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(f"rank {rank}: {what} is not contiguous (strides {tensor.stride()} "
                         f"for shape {tuple(tensor.shape)}); pass tensor.contiguous()")
    backend = getattr(t, "backend", None)
    if tensor.is_cuda and backend == "gloo":
        raise UsageError(f"rank {rank}: {what} is a CUDA tensor ({tensor.device}) on a Gloo "
                         "group: Gloo moves CPU tensors; use an NCCL group, or .cpu()")
    if not tensor.is_cuda and backend == "nccl":
        raise UsageError(f"rank {rank}: {what} is a {tensor.device.type} tensor on an NCCL "
                         "group: NCCL moves CUDA tensors; use a Gloo group, or .cuda()")
    if tensor.device.type not in ("cpu", "cuda"):
        raise UsageError(f"rank {rank}: {what} is on {tensor.device}; refcoll moves CPU and "
                         "CUDA tensors")
    name = torch_dtype_name(tensor.dtype)
    if name not in DTYPES:
        raise UsageError(f"rank {rank}: {what} has dtype {name}, which refcoll does not "
                         f"reduce; supported: {', '.join(DTYPES)}")
    tensor = tensor.detach()
    bits = _bits_types().get(tensor.dtype)
    if tensor.is_cuda:
        import cupy

        if bits is not None:
            return cupy.from_dlpack(tensor.view(bits[0])).view(bits[1])
        return cupy.from_dlpack(tensor)
    # DLPack, not Tensor.numpy(): numpy() marks the storage as never resizable again, and
    # FSDP frees and regrows its parameters' storage (resize_) around every all-gather.
    if bits is not None:
        return np.from_dlpack(tensor.view(bits[0])).view(bits[1])
    return np.from_dlpack(tensor)


def as_tensor(array, like):
    """Return ``array`` as a tensor over its memory, of ``like``'s dtype and device kind."""
    torch = _torch()
    if array is None:
        return None
    bits = _bits_types().get(like.dtype)
    if like.is_cuda:
        if bits is not None:
            return torch.from_dlpack(array.view(np.dtype(f"int{bits[1].itemsize * 8}"))) \
                .view(like.dtype)
        return torch.from_dlpack(array)
    if bits is not None:
        return torch.from_numpy(array.view(f"int{bits[1].itemsize * 8}")).view(like.dtype)
    return torch.from_numpy(array)


def check_same_device(tensor, out, rank: int) -> None:
    """Refuse an ``out=`` tensor of another dtype or device than the input."""
    if out.dtype != tensor.dtype or out.device != tensor.device:
        raise TypeError(f"rank {rank}: out= is {torch_dtype_name(out.dtype)} on {out.device}, "
                        f"the input {torch_dtype_name(tensor.dtype)} on {tensor.device}; they "
                        "must match")


def cpu_tensor(array):
    """Return a CPU tensor over ``array``'s memory, of torch's dtype of the same name (no copy)."""
    torch = _torch()
    return as_tensor(array, torch.empty(0, dtype=getattr(torch, str(array.dtype))))



def reduction(op) -> tuple[str, object]:
    """Return refcoll's op and PREMUL_SUM's factor (``None`` for the others) for torch's op.

    Raises:
        ValueError: an op refcoll does not reduce (the bitwise ones).
    """
    kind = getattr(op, "op", op)
    known = _REDUCTIONS.get(kind)  # (a call's path: the op's kind looked up once)
    if known is not None:
        return known
    name = str(kind).rsplit(".", 1)[-1]
    if name not in _OPS:
        raise ValueError(f"reduce op {name} is not one refcoll reduces; refcoll reduces "
                         f"{', '.join(sorted(_OPS))}")
    if name != "PREMUL_SUM":
        _REDUCTIONS[kind] = (_OPS[name], None)
        return _OPS[name], None
    factor = op.factor
    if isinstance(factor, _torch().Tensor):
        factor = factor.item()
    return _OPS[name], factor


def premultipliable(factor, tensors) -> None:
    """Refuse PREMUL_SUM (``factor``; None: another op) on tensors that are not floating
    point or complex: a real factor rounded to an integer type (0.3 to 0) would be a
    silent wrong sum. Gloo refuses PREMUL_SUM, and torch's NCCL backend takes it on
    floating point only.

    Raises:
        ValueError: such a tensor.
    """
    if factor is None:
        return
    for x in tensors:
        if not (x.is_floating_point() or x.is_complex()):
            raise ValueError(f"PREMUL_SUM on a {x.dtype} tensor: its factor {factor!r} is a "
                             "real number, which an integer type would round away; use a "
                             "floating-point tensor (as NCCL requires)")


def premultiplier(factor: float, tensor):
    """Return PREMUL_SUM's ``factor`` as a 0-d tensor of ``tensor``'s dtype: ``x * f`` is then
    one rounding of ``x`` times the factor rounded to the dtype (a 16-bit float's through
    float32, as NCCL's scalar ``T(double)`` is too), as NCCL's premultiply is (torch's
    ``x * f`` of a Python float rounds ``x · f`` instead, another result in float16 and
    bfloat16)."""
    torch = _torch()
    dtype = tensor.dtype
    if dtype.is_complex:  # a complex tensor's parts are scaled by the real factor
        dtype = torch.float32 if dtype == torch.complex64 else torch.float64
    return torch.tensor(factor, dtype=dtype, device=tensor.device)


#: torch's reduction kinds met so far, but PREMUL_SUM (whose factor is the call's).
_REDUCTIONS: dict = {}


def flat(tensor):
    """Return a contiguous tensor's elements as one dimension (a complex tensor as its reals):
    a view of its memory, so what is written there lands in the tensor.

    Raises:
        ValueError: a sparse tensor (refcoll reduces dense ones), or one that is not
            contiguous (a flat view of it would be a copy, and the result would be lost).
    """
    if tensor.layout != _torch().strided:
        raise ValueError(f"a {str(tensor.layout).removeprefix('torch.')} tensor: refcoll "
                         "reduces dense tensors (tensor.to_dense(); Gloo's backend has a "
                         "sparse all-reduce)")
    if not tensor.is_contiguous():
        raise ValueError(f"a tensor that is not contiguous (strides {tensor.stride()} for "
                         f"shape {tuple(tensor.shape)}): refcoll works on its memory; pass "
                         "tensor.contiguous() and copy the result back")
    if tensor.is_complex():
        tensor = _torch().view_as_real(tensor)
    return tensor.reshape(-1)
