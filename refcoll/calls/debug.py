"""``REFCOLL_DEBUG=INFO``: one line per collective call per rank, as ``NCCL_DEBUG=INFO`` writes.

NCCL's per-collective line (``src/enqueue.cc``, subsystem ``COLL``) reads::

    host:pid:tid [dev] NCCL INFO AllReduce: opCount 0 sendbuff ... count 1024 datatype 7 op 0 root 0 comm ... [nranks=2] stream ...

refcoll writes the same prefix and the same leading fields, then what a reader
of a reference implementation needs besides: the algorithm (for ``auto`` the
one it chose and the α-β-γ time its cost model predicted), the algorithm's
options, the compressor, whether the arguments were agreed, the bytes this rank
sent and received in the call (its transport's
:class:`~refcoll.transport.base.Traffic`, agreement included) and the call's
elapsed time. Every field is ``name value``, so ``awk`` and a regular expression
written for NCCL's lines read these too::

    vm:28039:28039 [0] REFCOLL INFO AllReduce: opCount 0 count 1048576 datatype float32 op sum root 0 rank 0 [nranks=2] algorithm auto choice ring predicted_us 557.3 options - compressor - validate 1 sent 4194672 received 4194624 time_us 58003.4

The line is written when the call completes (a non-blocking call's when its
handle does), so ``time_us`` is known; a call that fails writes its line with
``failed`` and the error's type, then raises. A call made inside another
(the device-path agreement, a compressed all-reduce's own collectives) is
part of the outer call's line, not a line of its own.

Environment, read once per process (:func:`reset` reads it again):

* ``REFCOLL_DEBUG``: NCCL's levels, in any case. ``INFO`` and ``TRACE``: a line
  per call; ``VERSION``, ``WARN`` and ``ABORT``: nothing per call; unset or empty:
  nothing. Any other value is a :class:`~refcoll.core.errors.UsageError` at the
  first collective call (and every later one), raised where the call checks its
  arguments (:func:`check_level`): like a bad argument, one rank's bad value is
  every rank's error, before any data moves (a call with ``validate=False`` raises
  it on that rank alone). Tracing itself needs no agreement: one rank may trace alone.
* ``REFCOLL_DEBUG_FILE``: write the lines to this file instead of stderr, as
  ``NCCL_DEBUG_FILE`` does: ``%h`` is the host name, ``%p`` the process id and
  (refcoll's addition) ``%r`` the rank, ``%%`` a percent sign. ``trace.%h.%r``
  gives a file per rank. A file that cannot be opened is noted once on stderr
  and the lines go to stderr.

When tracing is off a call pays one cached check (:func:`enabled`).
"""  # noqa: E501 - NCCL's and refcoll's log lines are quoted whole, as they are written

from __future__ import annotations

import functools
import inspect
import json
import os
import platform
import stat
import sys
import threading
import time
import weakref
from typing import Callable, TypeVar

import numpy as np

from .. import algorithms
from ..core.errors import UsageError
from ..core.ops import dtype_name, get_op
from .auto import prediction

__all__ = ["ON", "LEVELS", "TRACING_LEVELS", "enabled", "check_level", "reset", "level",
           "traced", "tracing", "begin", "Span", "call_fields", "line", "expand_path", "NAMES"]

R = TypeVar("R")

#: ``NCCL_DEBUG``'s levels (``src/debug.cc``), which ``REFCOLL_DEBUG`` takes.
LEVELS = ("VERSION", "WARN", "INFO", "ABORT", "TRACE")

#: The levels that write a line per call.
TRACING_LEVELS = ("INFO", "TRACE")

#: NCCL's names of the collectives (``ncclFuncToString``), as the lines give them.
NAMES = {"allreduce": "AllReduce", "reduce_scatter": "ReduceScatter", "allgather": "AllGather",
         "broadcast": "Broadcast", "reduce": "Reduce"}

_LEVEL_ENV, _FILE_ENV = "REFCOLL_DEBUG", "REFCOLL_DEBUG_FILE"

#: ``[on]``: None until the environment is read, then whether lines are written.
_on: list = [None]
#: The same, public: a call reads ``ON[0]`` in place, calling nothing, once it is read.
ON = _on
#: ``[message]``: why the last value read is no level (None: it is one, or none was read).
_problem: list = [None]
_settings: dict = {"level": None, "file": None}
_lock = threading.Lock()
_files: dict = {}  # expanded path -> open file (or sys.stderr where it could not be opened)
_op_counts: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_depth = threading.local()  # calls being traced on this thread (inner calls write no line)


# ------------------------------------------------------------ the environment


def enabled() -> bool:
    """Return whether ``REFCOLL_DEBUG`` asks for a line per call (read once, then cached).

    A value that is not one of :data:`LEVELS` traces nothing here: the call's own argument
    check refuses it (:func:`check_level`), on every rank, and the environment is read
    again at every call until it names a level.
    """
    on = _on[0]
    return _read() if on is None else on


def check_level() -> None:
    """Refuse a ``REFCOLL_DEBUG`` that names no level (nothing, once it is read and good).

    Called where a collective checks its arguments, so that one rank's bad value is
    every rank's error (:func:`refcoll.calls.args.shared_errors`), as a bad argument is.

    Raises:
        UsageError: ``REFCOLL_DEBUG`` is not one of :data:`LEVELS`.
    """
    if _on[0] is None and _problem[0] is None:
        _read()
    if _problem[0] is not None:
        raise UsageError(_problem[0])


def level() -> str | None:
    """Return the ``REFCOLL_DEBUG`` level in force (upper case), or None when unset."""
    enabled()
    return _settings["level"]


def reset() -> None:
    """Forget what was read from the environment and close the files written so far."""
    with _lock:
        for fh in _files.values():
            if fh is not sys.stderr:
                fh.close()
        _files.clear()
        _settings.update(level=None, file=None)
        _on[0] = _problem[0] = None


def _read() -> bool:
    value = os.environ.get(_LEVEL_ENV, "")
    name = value.strip().upper()
    if name and name not in LEVELS:
        where = _process_rank()
        prefix = "" if where is None else f"rank {where}: "
        _problem[0] = (f"{prefix}{_LEVEL_ENV}={value!r} is not a debug level: use INFO (a line "
                       f"per collective call, as NCCL_DEBUG=INFO), TRACE (the same), WARN, "
                       f"VERSION or ABORT (nothing per call), or leave it unset")
        return False  # _on stays None: read again at the next call
    _problem[0] = None
    _settings.update(level=name or None, file=os.environ.get(_FILE_ENV) or None)
    _on[0] = on = name in TRACING_LEVELS
    return on


# --------------------------------------------------------------- tracing


class Span:
    """One traced call from its start to its end: the counters it started from.

    :func:`traced` makes one around a blocking call; a call that runs in
    steps (the schedule engine's all-reduce) makes one with :func:`begin`
    when its first step runs and calls :meth:`end` when its handle completes.
    """

    __slots__ = ("t", "collective", "fields", "op_count", "start", "traffic")

    def __init__(self, t, collective: str, fields: dict):
        self.t, self.collective, self.fields = t, collective, fields
        self.op_count = _next_op_count(t)
        counters = getattr(t, "traffic", None)
        self.traffic = counters.snapshot() if counters is not None else None
        self.start = time.perf_counter()

    def end(self, error: BaseException | None = None) -> str:
        """Write the call's line (``error``: the call failed with it) and return it."""
        elapsed = time.perf_counter() - self.start
        t, fields = self.t, self.fields
        sent = received = None
        counters = getattr(t, "traffic", None)
        if self.traffic is not None and counters is not None:
            now = counters.snapshot()
            sent, received = now[0] - self.traffic[0], now[1] - self.traffic[1]
        choice = predicted = None
        if error is None:
            choice, predicted = _auto_choice(t, self.collective, fields)
        rank = _world_rank(t)
        text = line(host=_host(), pid=os.getpid(), tid=threading.get_native_id(),
                    rank=rank, collective=self.collective, op_count=self.op_count,
                    comm_rank=t.rank, nranks=t.size, fields=fields, choice=choice,
                    predicted=predicted, sent=sent, received=received, elapsed=elapsed,
                    error=error)
        _write(text, rank)
        return text


def begin(t, collective: str, fields: dict) -> Span:
    """Start tracing one call on ``t`` (call :meth:`Span.end` when it completes)."""
    return Span(t, collective, fields)


def traced(t, collective: str, fields: dict, run: Callable[[], R]) -> R:
    """Run ``run()`` as the collective ``collective`` on ``t``; write its line; return its result.

    ``fields``: :func:`call_fields`'s keys (count, dtype, op, algorithm, root,
    options, compressor, validate). Off (:func:`enabled` false), or inside a
    call already traced on this thread, this is ``run()`` and nothing more.
    """
    if not enabled() or getattr(_depth, "n", 0):
        return run()
    span = Span(t, collective, fields)
    _depth.n = 1
    try:
        result = run()
    except BaseException as exc:
        _depth.n = 0
        span.end(error=exc)
        raise
    _depth.n = 0
    span.end()
    return result


def tracing(fn: Callable, comm_at: int, find_transport: Callable) -> Callable:
    """Wrap a public collective so that, when tracing is on, each call writes its line.

    ``fn``'s name is the collective's; its signature gives the fields
    (:func:`call_fields`) and ``comm_at`` the position of its ``comm``
    argument, which ``find_transport(comm, name)`` turns into the transport
    whose traffic is counted. Arguments the call itself would refuse go
    straight to ``fn``, untraced, to fail there as they always do.
    """
    signature = inspect.signature(fn)
    collective = fn.__name__
    var_kw = next((p.name for p in signature.parameters.values()
                   if p.kind is inspect.Parameter.VAR_KEYWORD), None)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not enabled() or getattr(_depth, "n", 0):
            return fn(*args, **kwargs)
        try:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            given = bound.arguments
            t = find_transport(given.get("comm"), collective)
        except Exception:  # noqa: BLE001 - the call raises its own error
            return fn(*args, **kwargs)
        fields = call_fields(next(iter(given.values())), op=given.get("op"),
                             algorithm=given.get("algorithm"), root=given.get("root"),
                             options=given.get(var_kw) if var_kw else None,
                             compressor=given.get("compressor"), validate=given.get("validate"))
        return traced(t, collective, fields, lambda: fn(*args, **kwargs))

    return call


def call_fields(x, *, op=None, algorithm=None, root=None, options=None, compressor=None,
                validate=True) -> dict:
    """Return the fields of a call's line from its arguments (``x``: this rank's input)."""
    count, dtype = getattr(x, "size", None), getattr(x, "dtype", None)
    if not isinstance(count, (int, np.integer)) or dtype is None:
        try:
            arr = np.asarray(x)
            count, dtype = arr.size, arr.dtype
        except Exception:  # noqa: BLE001 - shown as unknown; the call says what is wrong
            count, dtype = None, None
    return {"count": count, "dtype": dtype, "op": op, "algorithm": algorithm, "root": root,
            "options": dict(options or {}), "compressor": compressor, "validate": validate}


def line(*, host: str, pid: int, tid: int, rank, collective: str, op_count: int,
         comm_rank: int, nranks: int, fields: dict, choice: str | None = None,
         predicted: float | None = None, sent: int | None = None, received: int | None = None,
         elapsed: float | None = None, error: BaseException | None = None) -> str:
    """Return one call's line (pure: every figure is given)."""
    parts = [f"{host}:{pid}:{tid} [{rank}] REFCOLL INFO {NAMES.get(collective, collective)}:",
             f"opCount {op_count:x}",
             f"count {_text(fields.get('count'))}",
             f"datatype {_dtype_text(fields.get('dtype'))}",
             f"op {_op_text(fields.get('op'))}",
             f"root {_text(fields.get('root'), '0')}",
             f"rank {comm_rank} [nranks={nranks}]",
             f"algorithm {_text(fields.get('algorithm'))}"]
    if choice is not None:
        parts.append(f"choice {choice}")
        parts.append(f"predicted_us {_micro(predicted)}")
    parts += [f"options {_options_text(fields.get('options'))}",
              f"compressor {_compressor_text(fields.get('compressor'))}",
              f"validate {int(bool(fields.get('validate', True)))}",
              f"sent {_text(sent)}", f"received {_text(received)}",
              f"time_us {_micro(elapsed)}"]
    if error is not None:
        parts.append(f"failed {type(error).__name__}")
    return " ".join(parts)


def expand_path(template: str, *, host: str, pid: int, rank) -> str:
    """Return ``REFCOLL_DEBUG_FILE`` with ``%h``, ``%p``, ``%r`` and ``%%`` replaced."""
    out, i = [], 0
    while i < len(template):
        ch = template[i]
        if ch == "%" and i + 1 < len(template):
            code = template[i + 1]
            value = {"h": host, "p": str(pid), "r": str(rank), "%": "%"}.get(code)
            if value is not None:
                out.append(value)
                i += 2
                continue
        out.append(ch)
        i += 1
    return "".join(out)


# ------------------------------------------------------------------ helpers


def _auto_choice(t, collective: str, fields: dict) -> tuple[str | None, float | None]:
    """Return what a choosing algorithm (``auto``) picked for this call and its predicted time."""
    algo = algorithms.REGISTRY.get(fields.get("algorithm")) \
        if isinstance(fields.get("algorithm"), str) else None
    count, dtype = fields.get("count"), fields.get("dtype")
    if algo is None or not algo.chooses or fields.get("compressor") is not None \
            or count is None or dtype is None:
        return None, None
    found = prediction(t, collective, int(count), np.dtype(dtype).itemsize)
    return found if found is not None else (None, None)


def _next_op_count(t) -> int:
    with _lock:
        try:
            count = _op_counts.get(t, 0)
            _op_counts[t] = count + 1
        except TypeError:  # a transport that takes no weak reference: no count
            return 0
    return count


def _write(text: str, rank) -> None:
    template = _settings["file"]
    if template is None:  # one write of the whole line: ranks sharing a pipe do not interleave
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
        return
    path = expand_path(template, host=_host(), pid=os.getpid(), rank=rank)
    with _lock:
        fh = _files.get(path)
        if fh is None:
            try:
                fh = _open_trace(path)
            except OSError as exc:
                print(f"refcoll: note: {_FILE_ENV}={template!r}: cannot open {path} ({exc}); "
                      "writing the debug lines to stderr", file=sys.stderr, flush=True)
                fh = sys.stderr
            _files[path] = fh
        fh.write(text + "\n")
        fh.flush()


def _open_trace(path: str):
    """Open a trace file for writing, never through a link and never a FIFO or device.

    The file is written line by line as the job runs, so it cannot be renamed into
    place; instead the last component may not be a link (``O_NOFOLLOW``) and what was
    opened must be a regular file, so a planted ``trace.log -> /etc/shadow`` fails to
    open (and the lines go to stderr) rather than overwriting its target.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, 0o666)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file")
    os.set_blocking(fd, True)
    os.ftruncate(fd, 0)
    return os.fdopen(fd, "w", encoding="utf-8")


@functools.lru_cache(maxsize=1)
def _host() -> str:
    return platform.node().split(".")[0] or "localhost"


def _world_rank(t):
    """Return the rank of this process (of this simulated rank) in the whole job."""
    inner = t
    while inner is not None:
        rank = getattr(inner, "world_rank", None)
        if rank is not None:
            return rank
        inner = getattr(inner, "inner", None)
    rank = _process_rank()
    return t.rank if rank is None else rank


def _process_rank() -> int | None:
    """Return this process's rank in its MPI (or torchrun) job, None where none is known."""
    mpi = sys.modules.get("mpi4py.MPI")
    try:
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            return mpi.COMM_WORLD.Get_rank()
    except Exception:  # noqa: BLE001 - a broken MPI: try the launcher's variables
        pass
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "RANK"):
        value = os.environ.get(name, "")
        if value.isascii() and value.isdigit():
            return int(value)
    return None


def _text(value, default: str = "-") -> str:
    return default if value is None else str(value)


def _micro(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.1f}"


def _dtype_text(dtype) -> str:
    if dtype is None:
        return "-"
    try:
        return dtype_name(dtype)
    except (TypeError, ValueError):
        return str(dtype).replace(" ", "")


def _op_text(op) -> str:
    if op is None:
        return "-"
    try:
        return get_op(op).name
    except Exception:  # noqa: BLE001 - an op the call refuses: shown as given
        return (op if isinstance(op, str) else repr(op)).replace(" ", "")


def _options_text(options) -> str:
    if not options:
        return "-"
    return json.dumps(options, separators=(",", ":"), sort_keys=True, default=str)


def _compressor_text(compressor) -> str:
    if compressor is None:
        return "-"
    if isinstance(compressor, str):
        return compressor.replace(" ", "")
    spec = getattr(compressor, "spec", None)
    try:
        text = spec() if callable(spec) else type(compressor).__name__
    except Exception:  # noqa: BLE001 - a compressor that cannot name itself
        text = type(compressor).__name__
    return str(text).replace(" ", "")
