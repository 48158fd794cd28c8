"""The ``Work`` a ``"refcoll"`` group returns: a refcoll handle, as torch waits on one.

``torch.distributed`` waits on what a backend returns: ``wait()``,
``is_completed()``, ``get_future()``, ``exception()``. A Python subclass of
``dist.Work`` answers each from the call's handle on refcoll's progress
engine, so an error is raised from ``wait()`` as refcoll raised it (a
:class:`~refcoll.core.errors.CollectiveTimeout` naming the peer, a
:class:`~refcoll.core.errors.MismatchError`...), as Gloo's work raises its own.
(``_create_work_from_future``, the other way to make one, drops a failed
future's exception: its ``wait()`` returns ``True``.) Code that waits on the
future instead (DDP's reducer, a comm hook's ``then``) gets the error from
``wait()`` and ``value()``: raised from a ``then`` callback, as torch's own
hooks chain theirs (a future given it with ``set_exception`` crashes DDP's
reducer, which reads it as a list of tensors).

:class:`FutureWork` is the other kind: another library's call with a step of
refcoll's chained on its future (watch mode reads a result the moment the
library completes it, on the library's own thread), for calls that need no
collective of refcoll's and so no place on the progress engine. :class:`JoinedWork`
is one call made of several: a coalesced call the watched library lacks, run as
its single calls.
"""

from __future__ import annotations

import datetime
import functools
import time

import torch
import torch.distributed as dist

from ..calls.nonblocking import issue

__all__ = ["RefcollWork", "FutureWork", "JoinedWork", "submit"]


class RefcollWork(dist.Work):
    """One call of a ``"refcoll"`` group, as a ``torch.distributed`` Work."""

    def __init__(self, handle, value):
        super().__init__()
        self._handle, self._value = handle, value
        # The error reaches the future as a then callback's raise, never through
        # set_exception: DDP's reducer reads a future given one as its value, a list of
        # tensors, and ends the process with SIGSEGV (refcoll.torch.hooks does the same).
        done = self._done_future = torch.futures.Future()
        self._future = done.then(self._outcome)
        handle.add_done_callback(self._done)

    def _done(self, handle) -> None:
        self._done_future.set_result(None)

    def _outcome(self, _):
        error = self._handle.exception()
        if error is not None:
            raise error
        return self._value

    def wait(self, timeout=None) -> bool:
        """Wait for the call (``timeout``: a ``timedelta``); raise its error on this rank."""
        seconds = None if timeout is None else timeout.total_seconds()
        self._handle.wait(seconds if seconds else None)  # torch passes 0 for "no timeout"
        # The future completes from the handle's done callback, on the engine's thread,
        # a moment after the handle: a caller reading get_future().value() next needs it.
        self._future.wait()
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


class FutureWork(dist.Work):
    """Another library's call ``work``, completed once ``then(future)`` has run on its future.

    ``then`` runs when the library completes the call, on the library's thread
    (its future's callback), and what it returns is the future's value. Its error,
    or the library's, is raised from :meth:`wait` as it was raised (a torch future
    would wrap it in a ``RuntimeError``).
    """

    def __init__(self, work, then):
        super().__init__()
        self._work, self._error = work, None

        def run(future):
            try:
                return then(future)
            except BaseException as error:
                self._error = error
                raise
        self._future = work.get_future().then(run)

    def wait(self, timeout=None) -> bool:
        """Wait for the call and its step (``timeout``: the library's); raise their error."""
        self._work.wait(timeout) if timeout else self._work.wait()  # torch's 0: no timeout
        try:
            self._future.wait()
        except BaseException:
            if self._error is not None:
                raise self._error from None
            raise
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self._future.done() and self.exception() is None

    def exception(self):
        if not self._future.done():
            return None
        try:
            self._future.value()
        except BaseException as error:
            return self._error if self._error is not None else error
        return None

    def get_future(self):
        return self._future

    def result(self):
        self.wait()
        return self._future.value()

    def __repr__(self) -> str:
        return f"<FutureWork of {self._work!r}>"


class JoinedWork(dist.Work):
    """One call made of several ``works`` (a coalesced call run as its single calls):
    complete when every one is; its result ``value``; the first error of theirs raised."""

    def __init__(self, works: list, value):
        super().__init__()
        self._works, self._value, self._error = works, value, None
        try:
            futures = [work.get_future() for work in works]
        except (RuntimeError, NotImplementedError):  # a library's work without one
            self._future = None
        else:
            self._future = torch.futures.collect_all(futures).then(self._outcome)

    def _outcome(self, joined):
        for future in joined.value():
            future.value()  # (raises its call's error, as a then callback does)
        return self._value

    def wait(self, timeout=None) -> bool:
        """Wait for every call (each, even past one that failed) within ``timeout`` in all
        (a ``timedelta``; torch's 0: none); raise the first error."""
        seconds = timeout.total_seconds() if timeout else None
        deadline = None if seconds is None else time.monotonic() + seconds
        for work in self._works:
            if deadline is None:
                waited = work.wait
            else:  # what is left of the one deadline (a little, once it has passed)
                left = datetime.timedelta(seconds=max(deadline - time.monotonic(), 1e-3))
                waited = functools.partial(work.wait, left)
            try:
                waited()
            except Exception as error:  # (an interrupt is raised at once, never kept)
                self._error = self._error or error
                if deadline is not None and time.monotonic() >= deadline:
                    break  # the join's time is up: the first error stands
        if self._error is not None:
            raise self._error
        if self._future is not None:
            self._future.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def exception(self):
        if self._error is not None:  # (a work without a future tells its error by wait())
            return self._error
        return next((e for e in (work.exception() for work in self._works) if e is not None),
                    None)

    def get_future(self):
        if self._future is None:
            raise RuntimeError("the watched library's works of this call have no future")
        return self._future

    def result(self):
        self.wait()
        return self._value

    def __repr__(self) -> str:
        return f"<JoinedWork of {len(self._works)} calls>"


def submit(name: str, t, job, value) -> RefcollWork:
    """Queue ``job(t)`` on ``t``'s progress engine, in issue order; its Work (result ``value``)."""
    return RefcollWork(issue(name, t, job), value)
