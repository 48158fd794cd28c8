"""refcoll's collectives on torch tensors, over a ``torch.distributed`` group.

The five collectives and their non-blocking forms, with refcoll's arguments, taking
a tensor and a process group where :mod:`refcoll.calls` takes an array and a
communicator::

    import refcoll.torch as rt
    rt.init_process_group()                       # torchrun or mpiexec
    y = rt.allreduce(grad, algorithm="ring")      # a new tensor; out=grad: in place
    h = rt.iallreduce(grad, algorithm="rabenseifner"); ...; y = h.wait()

The tensor is read (and ``out=`` written) in place, zero-copy
(:mod:`refcoll.torch.tensors`). A tensor that cannot be carried (not contiguous,
on a device the group's library does not move, a dtype refcoll does not reduce)
is an error on every rank, shared through the argument agreement before any data
moves, as every argument error is.
"""

from __future__ import annotations

from ..calls import collectives as calls
from ..calls.args import shared_errors
from ..calls.nonblocking import issue
from ..calls.progress import busy_engine
from ..transport.torch import torch_transport_for
from .tensors import as_array, as_tensor, check_same_device

__all__ = ["allreduce", "reduce_scatter", "allgather", "broadcast", "reduce", "iallreduce",
           "ireduce_scatter", "iallgather", "ibroadcast", "ireduce", "transport_for"]


def transport_for(group=None):
    """Return refcoll's transport over ``group`` (``None``: the default group), cached."""
    return torch_transport_for(group)


def _job(name: str, fn, tensor, root, kwargs: dict):
    """Return the call as a job on a transport: convert, run refcoll's call, convert back."""
    out = kwargs.pop("out", None)
    validate = kwargs.get("validate", True)

    def job(t):
        with shared_errors(t, validate, name):
            x = as_array(tensor, t)
            if out is not None:
                check_same_device(tensor, out, t.rank)
            o = None if out is None else as_array(out, t, "out=")
        args = (x,) if root is None else (x, root)
        result = fn(*args, t, out=o, **kwargs)
        return out if out is not None else as_tensor(result, tensor)
    return job


def _blocking(name: str, fn, tensor, group, root, kwargs: dict):
    t = torch_transport_for(group)
    job = _job(name, fn, tensor, root, kwargs)
    if busy_engine(t) is not None:  # queue behind the calls outstanding on the group
        return issue(name, t, job).wait()
    return job(t)


def _nonblocking(name: str, fn, tensor, group, root, kwargs: dict):
    return issue(name, torch_transport_for(group), _job(name, fn, tensor, root, kwargs))


def allreduce(tensor, group=None, **kwargs):
    """:func:`refcoll.allreduce` of a tensor over ``group``; returns a tensor (``out`` if given)."""
    return _blocking("allreduce", calls.allreduce, tensor, group, None, kwargs)


def reduce_scatter(tensor, group=None, **kwargs):
    """:func:`refcoll.reduce_scatter` of a tensor: rank r gets chunk r of the reduction."""
    return _blocking("reduce_scatter", calls.reduce_scatter, tensor, group, None, kwargs)


def allgather(tensor, group=None, **kwargs):
    """:func:`refcoll.allgather` of a tensor: every rank's tensor, concatenated in rank order."""
    return _blocking("allgather", calls.allgather, tensor, group, None, kwargs)


def broadcast(tensor, root: int = 0, group=None, **kwargs):
    """:func:`refcoll.broadcast` of a tensor from ``root`` (a rank of ``group``)."""
    return _blocking("broadcast", calls.broadcast, tensor, group, root, kwargs)


def reduce(tensor, root: int = 0, group=None, **kwargs):
    """:func:`refcoll.reduce` of a tensor to ``root``; other ranks get ``None``."""
    return _blocking("reduce", calls.reduce, tensor, group, root, kwargs)


def iallreduce(tensor, group=None, **kwargs):
    """Non-blocking :func:`allreduce`: a :class:`refcoll.Handle` whose ``wait()`` gives the tensor.
    """
    return _nonblocking("allreduce", calls.allreduce, tensor, group, None, kwargs)


def ireduce_scatter(tensor, group=None, **kwargs):
    """Non-blocking :func:`reduce_scatter`."""
    return _nonblocking("reduce_scatter", calls.reduce_scatter, tensor, group, None, kwargs)


def iallgather(tensor, group=None, **kwargs):
    """Non-blocking :func:`allgather`."""
    return _nonblocking("allgather", calls.allgather, tensor, group, None, kwargs)


def ibroadcast(tensor, root: int = 0, group=None, **kwargs):
    """Non-blocking :func:`broadcast`."""
    return _nonblocking("broadcast", calls.broadcast, tensor, group, root, kwargs)


def ireduce(tensor, root: int = 0, group=None, **kwargs):
    """Non-blocking :func:`reduce`."""
    return _nonblocking("reduce", calls.reduce, tensor, group, root, kwargs)
