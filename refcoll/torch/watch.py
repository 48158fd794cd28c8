"""Watch mode: another backend does a program's collectives; refcoll judges every call.

::

    REFCOLL_WATCH=gloo REFCOLL_WATCH_SAMPLE=64 torchrun --nproc-per-node 2 \\
        -m refcoll.torch train.py --backend refcoll

The ``"refcoll"`` group (:mod:`refcoll.torch.backend`) then makes a group of the
watched backend (``gloo``, ``nccl`` or any backend registered with
``torch.distributed.Backend.register_backend``) from the same store and hands it
every collective, unchanged: the program's numbers are that library's. For
every all-reduce, reduce-scatter, allgather, broadcast and reduce it also picks
``k`` elements (``REFCOLL_WATCH_SAMPLE``, 64 by default; the same on every
rank, evenly spaced from an offset drawn afresh for each call), keeps their
inputs before the call and reads their outputs after it (a tensor that is not
contiguous in its logical order, through copies: Gloo sums memory, so a
transposed view on one rank against plain tensors on the others is a wrong
result, seen on every rank). The ranks then
allgather those few values over a library other than the watched one (MPI
under ``mpiexec``, on a communicator of the group's ranks; else refcoll's own
Gloo group), the calls' headers first where checksums are on (:func:`_exchange`),
and each judges them by the
oracle's rules (:func:`refcoll.verify.oracle.check_outputs`):

* **rank agreement**: all-reduce, allgather and broadcast outputs are the same
  bits on every rank;
* **bound**: a float sum, average or product lies within the rigorous error
  bound of some summation order (min and max: one of the inputs, by IEEE's rules);
* **bits where the inputs are exact**: integers, data movement, and float sums of
  integer-valued inputs, whose every order gives the same bits;
* **contribution**: for such exact inputs, which rank's value is missing or
  counted twice.

A sample of ``k`` elements sees one wrong element with probability ``k/n``, so float
sums and averages (all-reduce, reduce-scatter) are also checked on every element by
block checksums (:mod:`refcoll.verify.checksums`): each rank sums each block of its
input before the call, and of its output after it, with shared weights, and those
sums travel with the sample. A block outside the rigorous bound of every summation
order is wrong even where the sample saw nothing (``REFCOLL_WATCH_CHECKSUMS=off``:
the sample alone).

PREMUL_SUM's factor is each rank's own, as NCCL's pre-multiplier is (a weighted
average of uneven batches): the factors travel with the samples, and each rank's
inputs are judged times its factor (a plain SUM beside them: times 1); ranks whose
calls differ in op are told so, as for a count.

Every rank judges the same values, so a wrong result is a
:class:`~refcoll.core.errors.WrongResult` on every rank
(``REFCOLL_WATCH_ACTION=log``: one log line instead, and training goes on),
naming the collective, op, dtype, element, ranks and the range a conforming
library could have returned. The judging is a job on refcoll's progress
engine, queued in issue order behind the watched call, so ``async_op=True``
still overlaps; the Work the program waits on completes when the sample has
been judged, and a wrong result is raised from that call's ``wait()``.
``REFCOLL_WATCH_BATCH=n`` sends the samples of ``n`` calls in one exchange,
judged when the ``n``-th completes (the batch's all-reduce sums of one dtype
together, each call alone only where that fails): a wrong call is then named as
ever but raised from the wait of the call that closes its batch, for a fraction
of the cost (``benchmarks/watch_overhead.py``); the last batch, which no call
closes, is judged at ``destroy_process_group`` (:meth:`Watch.finish`), which
also logs a wrong call no ``wait()`` raised. The other calls of a batch
need no exchange and so no job: where the library's work has a future and
the tensors are on the CPU, their outputs are read by a callback on that
future, on the library's thread, the moment the call is done, and the Work
the program gets completes with it (:class:`~refcoll.torch.work.FutureWork`). Other
calls (gather, scatter, all-to-all, barrier, point to point) are handed over
unjudged.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading

import numpy as np
import torch
import torch.distributed as dist

from ..calls import collectives as calls
from ..core.errors import MismatchError, UsageError, WrongResult
from ..core.ops import DTYPES, dtype_name, is_float, unit_roundoff
from ..verify.checksums import block_elements, block_size, checksums, judge_sums
from ..verify.findings import renumbered
from ..verify.ieee import zero_signs_wrong
from ..verify.oracle import check_outputs
from .tensors import _bits_types, as_array, flat, premultipliable, premultiplier, reduction
from .work import FutureWork, JoinedWork, submit

__all__ = ["Watch", "watched_from_env", "watch_settings", "make_backend", "check_backend",
           "DEFAULT_SAMPLE"]

#: Elements judged per call unless ``REFCOLL_WATCH_SAMPLE`` says otherwise.
DEFAULT_SAMPLE = 64

_log = logging.getLogger("refcoll.watch")

#: torch 2.13's names of calls that a library's group (a C++ Backend) may know by older ones.
_OLDER = {"all_gather_single": ("_allgather_base",),
          "reduce_scatter_single": ("_reduce_scatter_base",),
          "all_to_all_single": ("alltoall_base",),
          "all_gather_single_coalesced": ("allgather_into_tensor_coalesced",),
          "reduce_scatter_single_coalesced": ("reduce_scatter_tensor_coalesced",)}


#: Coalesced calls a library may lack, and the single call each runs as then.
_SINGLES = {"all_gather_single_coalesced": "all_gather_single",
            "reduce_scatter_single_coalesced": "reduce_scatter_single"}


def check_backend(name: str) -> str:
    """Return the watched backend's name, lowercased, refusing one this rank cannot make."""
    low = name.strip().lower()
    if low == "refcoll":
        raise UsageError("REFCOLL_WATCH=refcoll: refcoll cannot watch itself; name the backend "
                         "whose results it should judge (gloo, nccl, or a registered one)")
    if low == "nccl" and not dist.is_nccl_available():
        raise UsageError("REFCOLL_WATCH=nccl: this torch has no NCCL (a CPU build?)")
    if low not in ("gloo", "nccl") and low.upper() not in dist.Backend._plugins:
        known = ["gloo", "nccl"] + sorted(k.lower() for k in dist.Backend._plugins
                                          if k.lower() != "refcoll")
        raise UsageError(f"REFCOLL_WATCH={name!r} is not a backend torch knows: use "
                         f"{', '.join(known)} (a third-party backend must be registered with "
                         "torch.distributed.Backend.register_backend before the group is made)")
    return low


def make_backend(name: str, store, rank: int, size: int, timeout):
    """Return a group of backend ``name`` made from ``store``, as torch would make it."""
    low = check_backend(name)
    prefix = dist.PrefixStore(f"refcoll/watched/{low}", store)
    if low == "gloo":
        return dist.ProcessGroupGloo(prefix, rank, size, timeout)
    if low == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefix, rank, size, options)
    plugin = dist.Backend._plugins[low.upper()]
    if plugin.extended_api:
        options = dist.distributed_c10d._DistributedBackendOptions()
        options.store, options.group_rank, options.group_size = prefix, rank, size
        options.timeout = timeout
        options.group_id, options.global_ranks_in_group = f"refcoll-watched-{low}", []
        return plugin.creator_fn(options, None)
    return plugin.creator_fn(prefix, rank, size, timeout)


#: The most elements a call's sample may hold, and calls a batch: a rank's record of a
#: call holds ``(p + 1)`` times the sample, and a batch's records travel as one message.
MAX_SAMPLE, MAX_BATCH = 1 << 16, 1 << 12


def _whole(text: str, most: int) -> bool:
    """Return whether ``text`` is a whole number from 1 to ``most`` (ASCII digits only)."""
    return text.isascii() and text.isdigit() and 1 <= int(text) <= most


def watched_from_env(store, rank: int, size: int, timeout, settings: dict | None = None):
    """Return the :class:`Watch` that ``REFCOLL_WATCH`` asks for, or ``None`` (``settings``:
    :func:`watch_settings`' already read)."""
    settings = watch_settings() if settings is None else settings
    if not settings:
        return None
    return Watch(settings["backend"], make_backend(settings["backend"], store, rank, size,
                                                   timeout),
                 settings["sample"], settings["action"], settings["batch"],
                 checksums=settings["checksums"], size=size, rank=rank)


def watch_settings() -> dict:
    """Return watch mode's settings from the environment (empty: no watch mode), checked,
    the watched backend's name too, before any group is made.

    Raises:
        UsageError: a value no watch could take.
    """
    name = os.environ.get("REFCOLL_WATCH", "").strip()
    if not name:
        return {}
    text = os.environ.get("REFCOLL_WATCH_SAMPLE", "").strip() or str(DEFAULT_SAMPLE)
    if not _whole(text, MAX_SAMPLE):
        raise UsageError(f"REFCOLL_WATCH_SAMPLE={text!r}: give the elements to judge per call, "
                         f"a whole number from 1 to {MAX_SAMPLE} (every element is judged by "
                         "the block checksums already)")
    action = os.environ.get("REFCOLL_WATCH_ACTION", "raise").strip().lower() or "raise"
    if action not in ("raise", "log"):
        raise UsageError(f"REFCOLL_WATCH_ACTION={action!r}: use raise (a WrongResult on every "
                         "rank) or log (a log line, and training goes on)")
    batch = os.environ.get("REFCOLL_WATCH_BATCH", "").strip() or "1"
    if not _whole(batch, MAX_BATCH):
        raise UsageError(f"REFCOLL_WATCH_BATCH={batch!r}: give the calls whose samples travel "
                         f"together, a whole number from 1 to {MAX_BATCH}")
    sums = os.environ.get("REFCOLL_WATCH_CHECKSUMS", "").strip().lower() or "on"
    if sums not in ("on", "off"):
        raise UsageError(f"REFCOLL_WATCH_CHECKSUMS={sums!r}: use on (every element, by block "
                         "checksums: the default) or off (the sample alone)")
    return {"backend": check_backend(name), "sample": int(text), "action": action,
            "batch": int(batch), "checksums": sums == "on"}


def _as_gloo_sums(method: str, args: tuple, rank: int, p: int):
    """Gloo has no AVG and no PREMUL_SUM: give it SUM, the factor applied before, ``/p`` after.

    As a program on Gloo does itself (FSDP2 divides before and after a SUM
    there); on the ``"refcoll"`` backend it asks for AVG. Returns the arguments
    to hand Gloo and what to run once its call is done (``None``: nothing changed).
    """
    opts = args[-1]
    op = getattr(opts, "reduceOp", None)
    kind = str(getattr(op, "op", op)).rsplit(".", 1)[-1]
    if kind not in ("AVG", "PREMUL_SUM") or method not in _GLOO_SUMS:
        return args, None
    factor = reduction(op)[1]
    if method in ("allreduce", "allreduce_coalesced", "reduce"):
        premultipliable(factor, args[0])
    else:
        premultipliable(factor, [args[1]] if method == "reduce_scatter_single"
                        else [piece for row in args[1] for piece in row])
    summed = type(opts)()
    for field in ("rootRank", "rootTensor", "timeout"):
        if hasattr(opts, field):
            setattr(summed, field, getattr(opts, field))
    summed.reduceOp = dist.ReduceOp.SUM
    args, outs, back = _premultiplied(method, args, factor, summed, rank == opts.rootRank
                                      if method == "reduce" else True)

    def finish() -> None:
        if kind == "AVG":
            for out in outs:
                if out.is_floating_point() or out.is_complex():
                    out.div_(p)
                else:  # an integer average truncates toward zero, as refcoll's and NCCL's
                    out.div_(p, rounding_mode="trunc")
        for tensor, copy in back:
            tensor.copy_(copy)
    return args, finish


def _premultiplied(method: str, args: tuple, factor, summed, root: bool):
    """Return the arguments that hand Gloo ``method`` as a SUM (``summed``, its options)
    of the inputs times ``factor`` (None: as they are), the tensors its result lands in,
    and the pairs ``(tensor, copy)`` whose copy must go back once it is done.

    An all-reduce's tensors are its outputs on every rank: multiplied in place. A
    reduce's are a non-root's input alone, as Gloo leaves it: a copy is premultiplied,
    and the root's result copied back. ``root``: this rank is the reduce's root.
    """
    back = []
    if method in ("allreduce", "allreduce_coalesced"):
        tensors = args[0]
        for tensor in tensors if factor is not None else ():
            tensor.mul_(premultiplier(factor, tensor))
        return (tensors, summed), tensors, back
    if method == "reduce":
        tensors = args[0]
        if factor is not None:
            copies = [tensor * premultiplier(factor, tensor) for tensor in tensors]
            if root:
                back = list(zip(tensors, copies))
            tensors = copies
        return (tensors, summed), tensors if root else [], back
    if method == "reduce_scatter_single":
        x = args[1]
        return (args[0], x if factor is None else x * premultiplier(factor, x), summed), \
            [args[0]], back
    pieces = args[1]  # reduce_scatter: lists
    if factor is not None:
        pieces = [[piece * premultiplier(factor, piece) for piece in row] for row in pieces]
    return (args[0], pieces, summed), args[0], back


#: The calls :func:`_as_gloo_sums` rewrites.
_GLOO_SUMS = ("allreduce", "allreduce_coalesced", "reduce", "reduce_scatter",
              "reduce_scatter_single")


#: The collectives judged, by the code their samples carry.
_JUDGED = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce")

#: Each dtype's code in a sample record's header.
_DTYPE_CODE = {name: code for code, name in enumerate(DTYPES)}

#: Each op's code in a sample record's header (``-``: data movement).
_OP_CODE = {name: code for code, name in enumerate(("-", "sum", "avg", "prod", "min", "max"))}

#: The header of a rank's sample record: what every rank must agree on, then the two fields
#: each rank has its own of: PREMUL_SUM's factor (its float64 bits; NaN: none), which
#: NCCL takes per rank ("pre-multiplies input values by a given scalar locally"), and
#: whether the call failed on that rank (its record then keeps its place and its size,
#: and the call is judged on no rank).
_HEADER = ("call", "collective", "op", "dtype", "elements", "inputs sampled", "outputs sampled",
           "root", "checksums")
_FIELDS = len(_HEADER) + 2


def _exchange(t, samples: list, k: int, checksums: bool) -> list:
    """Allgather every rank's sampled inputs and outputs of ``samples``, and their block
    checksums; return them per call.

    Per call a header, the values zero-padded to ``(p + 1)·k`` eight-byte elements, then
    the checksums, whose count the header carries. Without checksums (``checksums``:
    watch mode's setting, every rank's) a record has one size on every rank that agrees
    on the calls, so one exchange carries headers and values, and the headers are
    compared after it. With them a record's size depends on the call (its op, dtype and
    elements), so the headers travel first, alone, after refcoll's agreement (ranks
    holding other numbers of calls raise its MismatchError), and are compared before
    any record of another size could be exchanged: ranks that disagree on a call raise
    the same MismatchError, naming the field. Returns, per sample,
    ``(inputs, outputs, sums)``: one array per rank each (``sums``: ``(p, checksums)``
    float64); and sets each sample's ``factors``, every rank's PREMUL_SUM factor (None
    where no rank has one).
    """
    heads, values = 8 * _FIELDS, (t.size + 1) * k * 8
    rows_of_sums = [sample.sums() for sample in samples]
    header = np.array([[sample.number, _JUDGED.index(sample.collective), _OP_CODE[sample.op],
                        _DTYPE_CODE[dtype_name(sample.before.dtype)], sample.m,
                        sample.before.size, sample.after.size, sample.root, sums.size,
                        _bits(sample.factor), int(sample.failed)]
                       for sample, sums in zip(samples, rows_of_sums)], np.int64)
    bodies = []
    for sample, sums in zip(samples, rows_of_sums):
        data = np.concatenate([sample.before, sample.after]).view(np.uint8)
        bodies.append([data, np.zeros(values - data.size, np.uint8), sums.view(np.uint8)])

    def gathered(parts: list, validate: bool = False) -> np.ndarray:
        return calls.allgather(np.concatenate(parts), t, algorithm="rabenseifner",
                               validate=validate)

    if checksums:  # the headers first (agreed: ranks may hold other numbers of calls),
        heads_of = gathered([header.reshape(-1).view(np.uint8)], validate=True).reshape(
            t.size, len(samples), heads)  # then records whose sizes they agreed on
        _same_calls(heads_of)
        table, inline = gathered([part for body in bodies for part in body]), 0
    else:  # one exchange, each record its header and its body
        table = gathered([part for head, body in zip(header, bodies)
                          for part in (head.view(np.uint8), *body)])
        inline = heads
    starts = np.cumsum([0] + [inline + values + 8 * sums.size for sums in rows_of_sums])
    if not checksums:
        heads_of = np.stack([table[:, at:at + heads] for at in starts[:-1].tolist()], axis=1)
        _same_calls(heads_of)
    own = heads_of[:, :, 8 * len(_HEADER):].copy()
    factors = own.view(np.float64)[:, :, 0]  # (p, calls)
    failed = own.view(np.int64)[:, :, 1].any(axis=0)
    out = []
    for i, (sample, at, mine) in enumerate(zip(samples, starts[:-1].tolist(), rows_of_sums)):
        sample.failed = bool(failed[i])  # on some rank: judged on none
        column = factors[:, i]
        sample.factors = None if np.isnan(column).all() else \
            [1.0 if np.isnan(f) else f for f in column.tolist()]  # (no factor: a plain sum)
        n, dtype = sample.before.size, sample.before.dtype
        at += inline
        data = table[:, at:at + (n + sample.after.size) * dtype.itemsize]
        data = data.copy().view(dtype)
        at += values
        sums = table[:, at:at + 8 * mine.size].copy().view(np.float64)
        out.append(([row[:n] for row in data], [row[n:] for row in data], sums))
    return out


def _same_calls(heads_of: np.ndarray) -> None:
    """Raise the MismatchError of the first call whose header differs between ranks
    (``heads_of``: ``(p, calls, header bytes)``; not the factors: each rank's own)."""
    agreed = heads_of[:, :, :8 * len(_HEADER)]
    differ = np.flatnonzero((agreed != agreed[:1]).any(axis=(0, 2)))  # calls, by rank 0's
    if differ.size:
        columns = heads_of[:, differ[0]].copy().view(np.int64).T
        field, column = next((f, c) for f, c in zip(_HEADER, columns) if (c != c[0]).any())
        names = {"collective": _JUDGED, "op": tuple(_OP_CODE), "dtype": tuple(DTYPES)}.get(field)
        values = [names[v] if names else v for v in column.tolist()]
        raise MismatchError(f"watch: the ranks judged different calls: {field}: " +
                            ", ".join(f"rank {r} has {v}" for r, v in enumerate(values)))


def _rounded(factor, tensor) -> float | None:
    """PREMUL_SUM's ``factor`` as the library multiplies by it: rounded to ``tensor``'s
    dtype as torch rounds a Python float (through float32 for a 16-bit float, as NCCL's
    scalar is too), so the judge's ``x · f`` and checksums are the library's own."""
    return None if factor is None else premultiplier(factor, tensor).item()


def _bits(factor) -> int:
    """Return PREMUL_SUM's factor as the int64 of its float64 bits (none: NaN's)."""
    return int(np.float64(np.nan if factor is None else factor).view(np.int64))


def _factor_text(factors: list) -> str:
    """Name the ranks' PREMUL_SUM factors: one, or each rank's where they differ."""
    if all(f == factors[0] for f in factors):
        return f" premul_sum (factor {factors[0]!r})"
    return " premul_sum (factors " + ", ".join(f"rank {r} {f!r}" for r, f in enumerate(factors)) \
        + ")"


def _plainly_right(sample: "_Sample", inputs, outputs) -> bool:
    """Return whether the sample is right on its face (the oracle's full check then not needed).

    Data movement: the bits land where they belong. A float sum or average: every rank
    holds the same bits, each within the rigorous bound of the exact value, which a
    float64 sum of ``p`` narrower values gives to far below it. Anything else, or any
    doubt, goes to :func:`refcoll.verify.oracle.check_outputs`.
    """
    p, dtype = len(inputs), inputs[0].dtype
    words = lambda a: a.view(f"u{a.dtype.itemsize}")  # noqa: E731 - bits, for equality
    if sample.collective == "broadcast":
        return all(np.array_equal(words(o), words(inputs[sample.root])) for o in outputs)
    if sample.collective == "allgather":
        whole = words(np.concatenate(inputs))
        return all(np.array_equal(words(o), whole) for o in outputs)
    if sample.op not in ("sum", "avg") or dtype.itemsize > 4 or dtype.kind != "f" \
            or sample.collective == "reduce":
        return False
    if sample.collective == "allreduce":
        if any(not np.array_equal(words(o), words(outputs[0])) for o in outputs):
            return False
        got, xs = outputs[0].astype(np.float64), [x.astype(np.float64) for x in inputs]
    else:  # reduce_scatter: rank c holds chunk c of every rank's inputs
        k = outputs[0].size
        got = np.concatenate(outputs).astype(np.float64)
        xs = [x.astype(np.float64) for x in inputs]
        if any(x.size != p * k for x in xs):
            return False
    with np.errstate(invalid="ignore", over="ignore"):
        exact, scale = np.sum(xs, axis=0), np.sum(np.abs(xs), axis=0)
        u = unit_roundoff(dtype)
        if sample.op == "avg":
            exact, scale, steps = exact / p, scale / p, p
        else:
            steps = p - 1
        bound = steps * u / (1 - steps * u) * scale
        zeros = scale == 0  # zeros only: the bound sees no sign, the sign rule does
        return bool(np.all(np.isfinite(got)) and np.all(np.abs(got - exact) <= bound)
                    and not (zeros.any() and zero_signs_wrong(np.array(xs), got, zeros).any()))


def _right_together(samples: list, exchanged: list, p: int) -> set:
    """Return the ids of the samples that are right on their face, judged many at once.

    A batch's float sums and averages of all-reduces (no factor) of one dtype are
    one all-reduce as far as the judging goes: their samples, side by side, pass
    :func:`_plainly_right` together, and their checksums :func:`judge_sums`
    together, or each call is judged alone (which names what is wrong).
    """
    groups: dict = {}
    for sample, got in zip(samples, exchanged):
        dtype = sample.before.dtype
        if sample.collective == "allreduce" and sample.op in ("sum", "avg") \
                and sample.factors is None and dtype.kind == "f" and dtype.itemsize <= 4:
            groups.setdefault((sample.op, dtype, sample.b), []).append((sample, got))
    right = set()
    for (op, dtype, b), members in groups.items():
        inputs = [np.concatenate([got[0][r] for _, got in members]) for r in range(p)]
        outputs = [np.concatenate([got[1][r] for _, got in members]) for r in range(p)]
        if not _plainly_right(members[0][0], inputs, outputs):
            continue
        summed = [(sample, got[2]) for sample, got in members if got[2].size]
        if summed:
            ins = np.concatenate([sums[:, :sums.shape[1] // 2].reshape(p, 3, -1)
                                  for _, sums in summed], axis=2)
            outs = np.concatenate([sums[:, sums.shape[1] // 2:].reshape(p, 3, -1)
                                   for _, sums in summed], axis=2)
            full = np.concatenate([block_elements(s.n, b) for s, _ in summed])
            if judge_sums(ins, outs, p=p, dtype=dtype, op=op, b=b, n=None, full=full):
                continue
        right.update(id(sample) for sample, _ in members)
    return right


def _read(sample: "_Sample | None", finish, result: list, wait) -> list:
    """Once the library's call is done (``wait()`` raises its error, if it had one): run
    ``finish`` and read the outputs' sample and checksums; return the call's ``result``."""
    try:
        wait()  # the watched library's own error, if it has one, is the call's
        if finish is not None:
            finish()
        if sample is not None:
            sample.after = sample.read_after()
            if sample.read_sums is not None:
                sample.sums_out = sample.read_sums()
    except BaseException:
        if sample is not None:  # nothing of this call is judged; its record, read all the
            sample.failed = True  # same, keeps this rank in step with the others
            with contextlib.suppress(Exception):  # (the call's own error is the one raised)
                if sample.after is None:
                    sample.after = sample.read_after()
                if sample.read_sums is not None and sample.sums_out is None:
                    sample.sums_out = sample.read_sums()
        raise
    finally:
        if sample is not None:
            sample.read_after = sample.read_sums = None  # (they hold the call's tensors)
            sample.read.set()
    return result


def _on_cpu(result: list) -> bool:
    """Return whether every tensor of a call's ``result`` (lists of them) is on the CPU."""
    return all(_on_cpu(r) if isinstance(r, list) else r.device.type == "cpu" for r in result)


def _has_future(work) -> bool:
    """Return whether a library's ``work`` has a future (a third party's may not)."""
    try:
        work.get_future()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _host(x: torch.Tensor) -> np.ndarray:
    """Return a flat tensor's elements as a NumPy array of refcoll's dtype (CPU: no copy)."""
    x = x.detach()
    if x.dtype in _PLAIN and x.device.type == "cpu":
        # DLPack, not Tensor.numpy(), which would mark the program's storage as never
        # resizable again: FSDP frees a gathered parameter with storage().resize_(0)
        return np.from_dlpack(x)
    return as_array(x.cpu().contiguous(), _HOST)


def _values(tensor: torch.Tensor) -> np.ndarray:
    """Return a (small) tensor's values as a NumPy array of refcoll's dtype, a copy on the host."""
    return np.array(as_array(tensor.detach().cpu().contiguous(), _HOST), copy=True)


class _Host:
    """The transport stand-in :func:`as_array` needs for host copies: rank and backend only."""

    rank, backend = -1, "gloo"


_HOST = _Host()

#: The torch dtypes NumPy reads as they are (the others travel as their bits: as_array).
_PLAIN = frozenset(getattr(torch, name, None) for name in DTYPES) - set(_bits_types()) - {None}


class _Elements:
    """A tensor's sampled elements, read when asked: the same slice ``idx`` of each of
    ``rows`` equal parts of it (an all-gather's output: one part per rank).

    A CPU tensor is read through a NumPy view of its memory (made once: no copy
    but the elements read); another device's by indexing there and copying the
    few elements to the host.
    """

    __slots__ = ("tensor", "idx", "shape", "view")

    def __init__(self, tensor: torch.Tensor, idx: slice, rows: int = 1):
        rows = max(rows, 1)  # (an empty tensor: one empty part)
        self.tensor, self.idx, self.shape = tensor, idx, (rows, tensor.numel() // rows)
        mine = tensor.device.type == "cpu" and tensor.is_contiguous()
        self.view = _host(tensor).reshape(self.shape) if mine else None

    def read(self) -> np.ndarray:
        """The elements at ``idx`` of every part, part after part (a copy)."""
        if self.view is not None:
            return self.view[:, self.idx].copy().reshape(-1)
        return _values(self.tensor.reshape(self.shape)[:, self.idx]).reshape(-1)

    def rows(self) -> np.ndarray:
        """Every part, whole, on the host (``(rows, m)``; a contiguous CPU tensor: its own
        memory; any other: a copy of its elements as they are now, in their logical order)."""
        if self.view is not None:
            return self.view
        return _host(self.tensor.reshape(-1)).reshape(self.shape)


def _elements(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor whose elements, in their logical order, are the call's: :func:`flat`'s view
    of a contiguous tensor; a strided one as it is (read through copies: a library may
    take one rank's transposed view with the others' plain tensors, and Gloo then sums
    their memory, not their elements, which the judging must see, on every rank)."""
    if tensor.layout == torch.strided and not tensor.is_contiguous():
        return torch.view_as_real(tensor) if tensor.is_complex() else tensor
    return flat(tensor)


class _Sample:
    """One call's sampled elements: where they are, and their values before and after."""

    def __init__(self, collective: str, op: str, factor, root: int, where: slice, m: int):
        self.collective, self.op, self.factor, self.root = collective, op, factor, root
        self.factors = None  # every rank's factor, once exchanged (None: no rank has one)
        self.where, self.m = where, m  # the sampled elements of each part of ``m``
        self.number = 0  # the call's number among the judged ones
        self.before: np.ndarray | None = None
        self.after: np.ndarray | None = None
        self.read_after = None  # () -> the outputs' values at the sample
        # Block checksums (refcoll.verify.checksums): ``b`` elements a block, of ``n``;
        # ``sums_in`` (pieces, 3, blocks) of the input before the call, ``sums_out``
        # (3, blocks) of the output after it, read by ``read_sums``.
        self.b = self.n = 0
        self.sums_in: np.ndarray | None = None
        self.sums_out: np.ndarray | None = None
        self.read_sums = None
        self.failed = False  # the watched call raised: nothing of it is judged
        self.read = threading.Event()  # its outputs read (or its call failed): the tensors
        # are let go then, so a batch keeps only the values it judges

    def sums(self) -> np.ndarray:
        """This rank's checksums as one float64 row (empty without them)."""
        if self.sums_in is None:
            return np.zeros(0)
        out = self.sums_out if self.sums_out is not None else \
            np.zeros((3, self.sums_in.shape[2]))  # (a failed call's, unread: placeholders)
        return np.concatenate([self.sums_in.reshape(-1), out.reshape(-1)])

    def real_index(self, s: int, whole: bool) -> int:
        """The element of the real output that element ``s`` of the sampled one stands for."""
        start, _, stride = self.where.indices(self.m)
        k = self.k
        if self.collective == "allgather" or (whole and self.collective == "reduce_scatter"):
            return (s // k) * self.m + start + stride * (s % k)
        return start + stride * s

    @property
    def k(self) -> int:
        """The elements sampled of each part."""
        return len(range(*self.where.indices(self.m)))


def _told(handle) -> bool:
    """Return whether a judging job's outcome needs no telling: a wait saw it, or it is done
    and found nothing."""
    # (is_completed() would count as the program seeing it: MPI_Test's rule)
    return handle._done.is_set() and (handle.seen or handle.exception() is None)


def _nothing() -> None:
    """A wait with nothing to wait for."""


class Watch:
    """Watch mode of one ``"refcoll"`` group: the watched backend's group and the judging."""

    def __init__(self, backend: str, group, sample: int, action: str, batch: int = 1,
                 checksums: bool = True, size: int = 1, rank: int = 0):
        self.backend, self.group, self.sample, self.action = backend, group, sample, action
        self.batch = batch  # calls whose samples travel in one exchange (REFCOLL_WATCH_BATCH)
        self.pending: list[_Sample] = []  # sampled calls not yet judged, in issue order
        self.calls = 0  # calls sampled (judged in batches), the same count on every rank
        self.findings: list[str] = []  # what REFCOLL_WATCH_ACTION=log logged
        self.checksums = checksums  # every element, by block checksums (REFCOLL_WATCH_CHECKSUMS)
        self.size, self.rank = size, rank  # the group's ranks, and this one
        self._judging: list = []  # the Works that judge a batch (finish reports unwaited ones)
        self.over = None  # the transport the judging exchanges over (None: the group's Gloo)

    def call(self, refcoll_group, method: str, *args, **kwargs):
        """Hand ``method(*args)`` to the watched backend; return a Work completed once judged."""
        if method in _SINGLES and not self._has(method):
            return self._singly(refcoll_group, method, *args, **kwargs)
        try:
            sample = None if kwargs else self._sample(method, args)
        except (TypeError, ValueError):
            sample = None  # a dtype or op refcoll cannot judge: the call goes unjudged
        result = args[0] if args and isinstance(args[0], list) else list(args[:1])
        finish = None
        if self.backend == "gloo" and not kwargs:
            args, finish = _as_gloo_sums(method, args, self.rank, self.size)
        work = self._method(method)(*args, **kwargs)
        if sample is None and finish is None:
            return work
        batch = self._take(sample)
        value = result[0] if method == "allgather" and len(result) == 1 else result  # (Gloo's)
        read = functools.partial(_read, sample, finish, value)
        done = None
        if _on_cpu(result) and _has_future(work):
            # Read on the library's thread the moment it completes the call: a call that
            # closes no batch then costs no hand-off to refcoll's progress engine.
            done = FutureWork(work, lambda future: read(future.value))
            if not batch:
                return done
        wait = functools.partial(read, work.wait) if done is None else done.wait
        name = sample.collective if sample is not None else method
        judging = submit(f"watch {name}", refcoll_group._cpu,
                         functools.partial(self._close, wait, batch), value)
        if batch:
            self._keep(judging)
        return judging

    def _keep(self, work) -> None:
        """Keep a judging Work for :meth:`finish`, letting go of those a wait saw or that
        found nothing."""
        if len(self._judging) >= 32:
            self._judging = [h for h in self._judging if not _told(h)]
        self._judging.append(work._handle)  # (not the Work: it holds the call's tensors)

    def finish(self, refcoll_group) -> None:
        """At ``destroy_process_group``: judge the calls of the last batch, which no call
        closed, and log a wrong result that no ``wait()`` raised (its call never waited).

        Raises:
            WrongResult: in the last batch (``REFCOLL_WATCH_ACTION=raise``), on every rank.
        """
        batch, self.pending = self.pending, []
        try:  # in issue order, after every judging job before it
            submit("watch: the last batch", refcoll_group._cpu,
                   functools.partial(self._close, _nothing, batch), None).wait()
        finally:
            for handle in self._judging:
                error = None if _told(handle) else handle.exception()
                if isinstance(error, WrongResult):
                    _log.error("%s (no wait() raised it: its call was never waited for)", error)
            self._judging = []

    def _take(self, sample: "_Sample | None") -> list:
        """Queue ``sample`` for judging; return the batch it closes (empty: none)."""
        if sample is None:
            return []
        self.pending.append(sample)
        if len(self.pending) < self.batch:
            return []
        batch, self.pending = self.pending, []  # taken now: later calls' samples wait
        return batch

    def _close(self, wait, batch: list, t) -> None:
        """A call's job on the progress engine: wait for it, then judge the batch it closes."""
        try:
            wait()
        except Exception:  # the call's own failure: the batch is judged without it, in
            with contextlib.suppress(Exception):  # step with the ranks where it ran (the
                self._judge_batch(t, batch, quietly=True)  # call's error is the one raised)
            raise
        self._judge_batch(t, batch)

    def _judge_batch(self, t, batch: list, quietly: bool = False) -> None:
        """Judge ``batch`` once each of its calls is read (on the library's thread, or by its
        own job, ahead of this one); ``quietly``: log what is wrong rather than raise it
        (the caller raises its call's own failure)."""
        for sample in batch:
            sample.read.wait()
        if not batch:
            return
        try:
            self._judge(self.over or t, batch)
        except WrongResult as exc:
            if not quietly:
                raise
            self.findings.append(str(exc))
            _log.error("%s", exc)

    def _singly(self, refcoll_group, method: str, outputs, inputs, *rest, **kwargs):
        """A coalesced call the watched backend has not (Gloo's, which torch's own group
        runs call by call): each pair as its single call, each judged as one."""
        single = _SINGLES[method]
        return JoinedWork([self.call(refcoll_group, single, out, x, *rest, **kwargs)
                           for out, x in zip(outputs, inputs)], outputs)

    def _has(self, name: str) -> bool:
        """Whether the watched group has ``name`` (or its older name) of its own: not the
        one a Python library's group inherits from torch's ``ProcessGroup``, which hands
        the call to a backend such a group never registers."""
        inherited = dist.ProcessGroup if isinstance(self.group, dist.ProcessGroup) else None
        return any(getattr(self.group, candidate, None) is not None
                   and getattr(type(self.group), candidate, None)
                   is not getattr(inherited, candidate, object())
                   for candidate in (name, *_OLDER.get(name, ())))

    def _method(self, name: str):
        """The watched group's method for torch 2.13's ``name``, or its older name."""
        for candidate in (name, *_OLDER.get(name, ())):
            found = getattr(self.group, candidate, None)
            if found is not None:
                return found
        raise UsageError(f"the watched backend {self.backend} has no {name} (nor "
                         f"{', '.join(_OLDER.get(name, ())) or 'an older name'}) to hand it to")

    # ------------------------------------------------------------ sampling

    def _indices(self, m: int) -> slice:
        """The call's ``k`` elements of ``m``: every ``m//k``-th from a start of its own.

        The same on every rank (from the call's number alone), spread over the
        whole tensor, and a different set for each call. A slice, so reading it is
        a view of the tensor and one copy (this runs in the caller's path). Every
        element is within reach: the start ranges over ``[0, m - stride·(k-1))``.
        """
        self.calls += 1
        k = min(self.sample, m)
        if k == m:
            return slice(0, m, 1)
        stride = m // k
        start = (self.calls * 2654435761) % (m - stride * (k - 1))  # Knuth's hash of the call
        return slice(start, start + stride * (k - 1) + 1, stride)

    def _sample(self, method: str, args) -> _Sample | None:
        """Keep the sampled inputs of a judged call now, before the call may overwrite them."""
        if method in ("allreduce", "broadcast", "reduce"):
            tensors, opts = args
            if len(tensors) != 1:
                return None
            x = _elements(tensors[0])
            op, factor = reduction(opts.reduceOp) if method != "broadcast" else ("-", None)
            factor = _rounded(factor, tensors[0])
            root = getattr(opts, "rootRank", 0)
            sample = _Sample(method, op, factor, root, self._indices(x.numel()), x.numel())
            elements = _Elements(x, sample.where)
            sample.before, sample.read_after = elements.read(), elements.read
            if method == "allreduce" and op in ("sum", "avg"):
                self._checksum(sample, elements.rows(), elements)
        elif method in ("allgather", "all_gather_single"):
            out, x = args[0], args[1]
            if method == "allgather":
                if len(x) != 1 or len(out) != 1:
                    return None
                out, x = out[0], x[0]
            x = _elements(x)
            sample = _Sample("allgather", "-", None, 0, self._indices(x.numel()), x.numel())
            sample.before = _Elements(x, sample.where).read()
            rows = out.numel() // max(x.numel(), 1) if not isinstance(out, list) else 1
            outs = [_Elements(_elements(o), sample.where) for o in out] if isinstance(out, list) \
                else [_Elements(_elements(out), sample.where, rows=rows)]
            sample.read_after = lambda: np.concatenate([o.read() for o in outs])
        elif method in ("reduce_scatter", "reduce_scatter_single"):
            out, x, opts = args
            op, factor = reduction(opts.reduceOp)
            factor = _rounded(factor, out if method != "reduce_scatter" else out[0])
            if method == "reduce_scatter":
                if len(x) != 1 or len(out) != 1:
                    return None
                out, pieces = _elements(out[0]), [_elements(piece) for piece in x[0]]
            else:
                out, pieces = _elements(out), [_elements(x)]
            idx = self._indices(out.numel())
            ins = [_Elements(piece, idx, rows=piece.numel() // max(out.numel(), 1))
                   for piece in pieces]
            sample = _Sample("reduce_scatter", op, factor, 0, idx, out.numel())
            sample.before = np.concatenate([piece.read() for piece in ins])
            elements = _Elements(out, idx)
            sample.read_after = elements.read
            if op in ("sum", "avg"):
                self._checksum(sample, [row for piece in ins for row in piece.rows()], elements)
        else:
            return None
        sample.number = self.calls
        return sample

    def _checksum(self, sample: _Sample, pieces: list, out: "_Elements") -> None:
        """Keep the block checksums of ``pieces`` (the input, or each rank's part of it,
        as arrays) now, and how to take those of ``out`` once the call is done."""
        if not self.checksums or not is_float(pieces[0].dtype):
            return  # (integers are exact: the sampled check sees their bits)
        b = block_size(self.size, pieces[0].dtype)
        sample.b, sample.n = b, pieces[0].size
        sample.sums_in = checksums(pieces[0], b)[None] if len(pieces) == 1 else \
            np.stack([checksums(a, b) for a in pieces])
        sample.read_sums = lambda: checksums(out.rows()[0], b)

    # ------------------------------------------------------------- judging

    def _judge(self, t, samples: list) -> None:
        """Gather every rank's samples, judge them the same way on every rank, raise or log."""
        problems = []
        exchanged = _exchange(t, samples, self.sample, self.checksums)
        kept = [(s, got) for s, got in zip(samples, exchanged) if not s.failed]
        samples, exchanged = [s for s, _ in kept], [got for _, got in kept]
        right = _right_together(samples, exchanged, t.size)
        for sample, (inputs, outputs, sums) in zip(samples, exchanged):
            if id(sample) in right:
                continue
            found = self._judge_sample(sample, inputs, outputs, t.size)
            if found is None and sums.size:  # the sample saw nothing: every element's blocks
                found = self._judge_sums(sample, sums, t.size)
            if found is not None:
                problems.append(found)
        if problems and self.action == "log":
            self.findings += problems
            for message in problems:
                _log.error(message)
        elif problems:
            raise WrongResult(problems[0] + (f" (and {len(problems) - 1} more wrong calls in this "
                                             "batch)" if len(problems) > 1 else ""))

    def _judge_sample(self, sample: _Sample, inputs, outputs, p: int) -> str | None:
        """Judge one call's sampled elements by the oracle; return what is wrong, or None."""
        if sample.factors is not None:  # PREMUL_SUM: each input times its rank's factor, rounded
            inputs = [x * x.dtype.type(f) for x, f in zip(inputs, sample.factors)]
        if sample.collective == "reduce":
            outputs = [o if r == sample.root else None for r, o in enumerate(outputs)]
        if _plainly_right(sample, inputs, outputs):
            return None
        op = sample.op if sample.op != "-" else "sum"
        report = check_outputs(inputs, outputs, collective=sample.collective, op=op,
                               root=sample.root)
        return None if report.conforming else self._message(sample, report,
                                                            sample.before.dtype, p)

    def _judge_sums(self, sample: _Sample, sums: np.ndarray, p: int) -> str | None:
        """Judge every rank's block checksums of one call (``sums``: a row per rank)."""
        pieces = sample.sums_in.shape[0]
        blocks = sample.sums_in.shape[2]
        ins = sums[:, :pieces * 3 * blocks].reshape(p, pieces, 3, blocks)
        outs = sums[:, pieces * 3 * blocks:].reshape(p, 3, blocks)
        dtype = sample.before.dtype
        if sample.collective == "allreduce":
            bad = judge_sums(ins[:, 0], outs, p=p, dtype=dtype, op=sample.op, b=sample.b,
                             n=sample.n, factor=sample.factors)
        else:  # reduce_scatter: rank c's output is every rank's piece c, reduced
            bad = []
            for c in range(p):
                bad += judge_sums(ins[:, c], outs[c:c + 1], p=p, dtype=dtype, op=sample.op,
                                  b=sample.b, n=sample.n, factor=sample.factors, ranks=[c])
        if not bad:
            return None
        op = f" {sample.op}" if sample.factors is None else _factor_text(sample.factors)
        more = f" ({len(bad)} such blocks, and maybe more)" if len(bad) > 1 else ""
        return (f"watch: {self.backend}'s {sample.collective}{op} of {dtype_name(dtype)} over "
                f"{p} ranks (call {sample.number}, every element checked in blocks of "
                f"{sample.b}) returned a wrong result: {bad[0]}{more}")

    def _message(self, sample: _Sample, report, dtype, p: int) -> str:
        failed = [f for f in report.findings if not f.passed]
        texts = []
        for finding in failed:
            text = renumbered(finding.detail,
                              lambda _rank, whole, s: sample.real_index(s, whole))
            data = finding.data or {}
            if "exact" in data and "bound" in data:
                text += (f"; a conforming library returns a value in "
                         f"[{data['exact'] - data['bound']!r}, {data['exact'] + data['bound']!r}]")
            texts.append(f"{finding.check}: {text}")
        op = "" if sample.op == "-" else f" {sample.op}"
        if sample.factors is not None:
            op = _factor_text(sample.factors)
        return (f"watch: {self.backend}'s {sample.collective}{op} of {dtype_name(dtype)} over "
                f"{p} ranks (call {sample.number}, {sample.k} elements sampled of "
                f"{sample.m}) returned a wrong result: " + "; ".join(texts))
