"""The ``Work`` a ``"refcoll"`` group returns: a refcoll handle, as torch waits on one.

``torch.distributed`` waits on what a backend returns: ``wait()``,
``is_completed()``, ``get_future()``, ``exception()``. A Python subclass of
``dist.Work`` answers each from the call's handle on refcoll's progress
engine, so an error is raised from ``wait()`` as refcoll raised it (a
:class:`~refcoll.core.errors.CollectiveTimeout` naming the peer, a
:class:`~refcoll.core.errors.MismatchError`...), as Gloo's work raises its own.
(``_create_work_from_future``, the other way to make one, drops a failed
future's exception: its ``wait()`` returns ``True``.) Code that waits on the
future instead (DDP's reducer, a comm hook's ``then``) gets the same
exception from ``value()``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..calls.nonblocking import issue

__all__ = ["RefcollWork", "submit"]


class RefcollWork(dist.Work):
    """One call of a ``"refcoll"`` group, as a ``torch.distributed`` Work."""

    def __init__(self, handle, value):
        super().__init__()
        self._handle, self._value = handle, value
        self._future = torch.futures.Future()
        handle.add_done_callback(self._done)

    def _done(self, handle) -> None:
        error = handle.exception()
        if error is not None:
            self._future.set_exception(error)
        else:
            self._future.set_result(self._value)

    def wait(self, timeout=None) -> bool:
        """Wait for the call (``timeout``: a ``timedelta``); raise its error on this rank."""
        seconds = None if timeout is None else timeout.total_seconds()
        self._handle.wait(seconds if seconds else None)  # torch passes 0 for "no timeout"
        return True

    def is_completed(self) -> bool:
        return self._handle.is_completed()

    def is_success(self) -> bool:
        return self._handle.is_completed() and self._handle.exception() is None

    def exception(self):
        return self._handle.exception()

    def get_future(self):
        return self._future

    def result(self):
        self.wait()
        return self._value

    def __repr__(self) -> str:
        return f"<RefcollWork {self._handle!r}>"


def submit(name: str, t, job, value) -> RefcollWork:
    """Queue ``job(t)`` on ``t``'s progress engine, in issue order; its Work (result ``value``)."""
    return RefcollWork(issue(name, t, job), value)
