"""NCCL's algorithm and protocol: forced by ``NCCL_ALGO``/``NCCL_PROTO``, read from its TUNING log.

``refcoll bench --against nccl`` passes ``NCCL_ALGO`` and ``NCCL_PROTO`` through
(:func:`nccl_env` checks the names first, since NCCL before 2.24 ignores a name
it does not know), and shows per row what NCCL chose, read back from the lines
NCCL writes with ``NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=TUNING`` (:func:`debug_env`,
:func:`parse_tuning`, :func:`choice_for`).

The names are NCCL's ``ncclAlgoStr``, ``ncclProtoStr`` and ``ncclFuncStr``
(``src/init.cc``), matched without case by ``parseList`` (``src/graph/tuning.cc``).
The value is a comma-separated list, or ``^`` and a list to exclude; since NCCL
2.24 lists can be given per collective, ``;``-separated, the first one
optionally without a prefix: ``NCCL_ALGO="ring;allreduce:tree,ring"``.

The TUNING line, one per collective call, printed by rank 0 only, has had
these forms (``src/enqueue.cc``; before 2.20 it was commented out, a TRACE):

* 2.20-2.22: ``4194304 Bytes -> Algo 1 proto 2 time 36.000000`` (no collective;
  numbers in NCCL's enum order, time in µs, the tuning model's prediction);
* 2.23: ``AllReduce: 4194304 Bytes -> Algo 1 proto 2 time 36.000000``;
* 2.24 on: ``AllReduce: 4194304 Bytes -> Algo RING proto SIMPLE channel{Lo..Hi}={0..31}``
  (``ncclAlgoToString``/``ncclProtoToString``: upper case, ``COLLNET_DIRECT``...).

Each follows NCCL's prefix ``host:pid:tid [cudaDev] NCCL INFO `` (``src/debug.cc``,
with an optional ``[date time]`` in front).

Bytes: for AllGather and ReduceScatter, 2.20-2.23 print the whole buffer
(``nRanks·count·size``, ``ncclFuncMaxSendRecvCount``), 2.24 on one rank's
part (``task->count·size``); the other collectives print ``count·size``.
:func:`choice_for` takes the whole buffer, nccl-tests' ``size``, and converts.
Lines without a collective take it from the call's ``NCCL_COLL`` line
(``AllReduce: opCount 0 sendbuff ... count N datatype D ... [nranks=P]``) when
the log has them (:func:`debug_env` with ``calls=True``).
"""

from __future__ import annotations

import glob
import os
import re
from typing import Iterable, NamedTuple

from ..core.errors import UsageError
from ..core.reading import MAX_TEXT_BYTES, read_bytes

__all__ = ["NCCL_ALGOS", "NCCL_PROTOS", "NCCL_FUNCS", "Tuning", "nccl_env", "debug_env",
           "parse_tuning", "read_tuning", "tuning_files", "choice_for", "COLLECTIVE_OF"]

#: ``ncclAlgoStr``, in NCCL's enum order (``NCCL_ALGO_TREE`` = 0, ... ``NCCL_ALGO_PAT`` = 6).
NCCL_ALGOS = ("Tree", "Ring", "CollNetDirect", "CollNetChain", "NVLS", "NVLSTree", "PAT")
#: ``ncclProtoStr``, in NCCL's enum order (``NCCL_PROTO_LL`` = 0, LL128 = 1, SIMPLE = 2).
NCCL_PROTOS = ("LL", "LL128", "Simple")
#: ``ncclFuncStr``: the prefixes of per-collective lists (NCCL 2.24 and later).
NCCL_FUNCS = ("Broadcast", "Reduce", "AllGather", "ReduceScatter", "AllReduce")

#: NCCL's name of each refcoll collective, as its log and its lists spell it.
COLLECTIVE_OF = {"allreduce": "AllReduce", "reduce_scatter": "ReduceScatter",
                 "allgather": "AllGather", "broadcast": "Broadcast", "reduce": "Reduce"}

#: The NCCL release that first has each name (``ncclAlgoStr`` by tag; 2.12-2.13 had
#: one "CollNet"), and per-collective lists (``parseList``, 2.24). Older releases
#: skip a token they do not know without a word.
_SINCE = {"CollNetDirect": (2, 14), "CollNetChain": (2, 14), "NVLS": (2, 17),
          "NVLSTree": (2, 18), "PAT": (2, 23)}
_PREFIXES_SINCE = (2, 24)

_KEY = str.maketrans("", "", "_- ")


def _key(name: str) -> str:
    return name.translate(_KEY).lower()


# ncclAlgoToString's spellings (COLLNET_DIRECT, NVLS_TREE) fold onto ncclAlgoStr's.
_ALGO_BY_KEY = {_key(a): a for a in NCCL_ALGOS}
_PROTO_BY_KEY = {_key(p): p for p in NCCL_PROTOS}
_FUNC_BY_KEY = {_key(f): f for f in NCCL_FUNCS}
_FUNC_BY_KEY.update({_key(c): f for c, f in COLLECTIVE_OF.items()})


class Tuning(NamedTuple):
    """One TUNING line: what NCCL chose for one call.

    ``collective`` is NCCL's name (``AllReduce``; None in 2.20-2.22, whose line
    omits it), ``algo`` and ``proto`` are ``ncclAlgoStr``/``ncclProtoStr`` names,
    ``channels`` is ``(lo, hi)`` (2.24 on; None before), ``time_us`` the tuning
    model's predicted time (2.20-2.23; None after), ``per_rank`` whether
    ``nbytes`` is one rank's part rather than the whole buffer.
    """

    collective: str | None
    nbytes: int
    algo: str
    proto: str
    channels: tuple[int, int] | None
    time_us: float | None
    per_rank: bool = False  # nbytes is one rank's part (AllGather/ReduceScatter, 2.24 on)


def _release(version: str | None) -> tuple[int, int] | None:
    if not version:
        return None
    major, minor = (int(x) for x in re.findall(r"\d+", version)[:2])
    return major, minor


def _check_list(value: str, known: dict, what: str, variable: str,
                release: tuple[int, int] | None) -> None:
    """Refuse a ``NCCL_ALGO``/``NCCL_PROTO`` value naming anything NCCL does not have."""
    valid = ", ".join(dict.fromkeys(known.values()))
    have = f"NCCL {release[0]}.{release[1]}" if release else "NCCL"
    for i, part in enumerate(value.split(";")):
        prefix, sep, elems = part.rpartition(":")
        if sep:
            if _key(prefix) not in _FUNC_BY_KEY:
                raise UsageError(f"{variable}={value!r}: NCCL has no collective {prefix!r}; its "
                                 f"lists are per {', '.join(NCCL_FUNCS)}")
            if release and release < _PREFIXES_SINCE:
                raise UsageError(f"{variable}={value!r}: per-collective lists need NCCL 2.24; "
                                 f"{have} would ignore them")
        elif i:
            raise UsageError(f"{variable}={value!r}: only the first list may lack a "
                             "'collective:' prefix")
        elems = elems.strip()
        elems = elems[1:] if elems.startswith("^") else elems
        for elem in elems.split(","):
            name = known.get(_key(elem))
            if name is None:
                raise UsageError(f"{variable}={value!r}: NCCL has no {what} {elem.strip()!r}; "
                                 f"it has: {valid} (any case, ^ to exclude)")
            if release and release < _SINCE.get(name, (0, 0)):
                since = _SINCE[name]
                raise UsageError(f"{variable}={value!r}: {name} needs NCCL "
                                 f"{since[0]}.{since[1]}; {have} would ignore it")


def nccl_env(algo: str | None = None, proto: str | None = None, *,
             version: str | None = None) -> dict[str, str]:
    """Return ``NCCL_ALGO``/``NCCL_PROTO`` for the given values, checked name by name.

    Each value is passed as written (NCCL parses it): ``Ring``, ``tree,ring``,
    ``^NVLS``, ``allreduce:tree;broadcast:ring``. None leaves NCCL to choose.
    ``version`` (``2.21.5``, :func:`refcoll.baselines.nccl.nccl_version`) also
    refuses what that release would skip silently: names it predates
    (NVLS 2.17, NVLSTree 2.18, PAT 2.23...) and per-collective lists (2.24).
    NCCL reads both variables when a communicator is created.

    Raises:
        UsageError: a name NCCL does not have, naming those it has.
    """
    release = _release(version)
    env = {}
    if algo is not None:
        _check_list(algo, _ALGO_BY_KEY, "algorithm", "NCCL_ALGO", release)
        env["NCCL_ALGO"] = algo
    if proto is not None:
        _check_list(proto, _PROTO_BY_KEY, "protocol", "NCCL_PROTO", release)
        env["NCCL_PROTO"] = proto
    return env


def debug_env(path_pattern: str, environ=None, *, calls: bool = False) -> dict[str, str]:
    """Return the environment that makes NCCL write its TUNING lines to ``path_pattern``.

    NCCL expands ``%h`` (host name) and ``%p`` (pid) in ``NCCL_DEBUG_FILE``; a
    pattern without ``%p`` gets ``.%h.%p`` appended, since every process opens
    the file for writing. A user's ``NCCL_DEBUG=TRACE`` is kept (it includes
    INFO), and so are the subsystems they asked for, with TUNING added (or
    taken out of a ``^`` exclusion list); ``calls`` adds COLL too, one line per
    call on every rank, which names the collective of NCCL 2.20-2.22's lines.
    """
    environ = os.environ if environ is None else environ
    if "%p" not in path_pattern:
        path_pattern += ".%h.%p"
    level = environ.get("NCCL_DEBUG", "").upper()
    subsys = environ.get("NCCL_DEBUG_SUBSYS", "").strip()
    names = [s for s in subsys.lstrip("^").split(",") if s.strip()]
    wanted = ("TUNING", "COLL") if calls else ("TUNING",)
    if subsys.startswith("^"):
        kept = [s for s in names if s.strip().upper() not in wanted]
        subsys = "^" + ",".join(kept) if kept else "ALL"
    elif not any(s.strip().upper() == "ALL" for s in names):
        have = {s.strip().upper() for s in names}
        subsys = ",".join(names + [w for w in wanted if w not in have])
    return {"NCCL_DEBUG": "TRACE" if level == "TRACE" else "INFO",
            "NCCL_DEBUG_SUBSYS": subsys, "NCCL_DEBUG_FILE": path_pattern}


_LINE = re.compile(
    r"NCCL INFO (?:(?P<coll>[A-Za-z]+): )?(?P<nbytes>\d+) Bytes -> "
    r"Algo (?P<algo>[A-Za-z_0-9]+) proto (?P<proto>[A-Za-z_0-9]+)"
    r"(?: time (?P<time>[-+0-9.eE]+))?"
    r"(?: channel\{Lo\.\.Hi\}=\{(?P<lo>\d+)\.\.(?P<hi>\d+)\})?")


_CALL = re.compile(
    r"NCCL INFO (?P<coll>[A-Za-z]+): opCount [0-9a-fx]+ .*?count (?P<count>\d+) "
    r"datatype (?P<dtype>\d+) .*?\[nranks=(?P<nranks>\d+)\]")

#: ncclDataType_t sizes, by code (nccl.h): int8 uint8 int32 uint32 int64 uint64
#: float16 float32 float64 bfloat16 float8e4m3 float8e5m2.
_TYPE_SIZES = (1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1)
_PER_RANK = ("AllGather", "ReduceScatter")


def _call_bytes(m) -> tuple[str, int]:
    """Return (collective, the bytes its TUNING line prints) for an NCCL_COLL line (2.20-2.23)."""
    coll = _FUNC_BY_KEY.get(_key(m["coll"]), m["coll"])
    code = int(m["dtype"])
    size = _TYPE_SIZES[code] if code < len(_TYPE_SIZES) else 0
    ranks = int(m["nranks"]) if coll in _PER_RANK else 1
    return coll, int(m["count"]) * size * ranks


def _name(token: str, names: tuple[str, ...], by_key: dict) -> str:
    if token.isascii() and token.isdigit():
        number = int(token)
        return names[number] if number < len(names) else token
    return by_key.get(_key(token), token)


def parse_tuning(lines: Iterable[str]) -> list[Tuning]:
    """Return the :class:`Tuning` of every TUNING line among ``lines``, in order.

    Other lines are skipped. Numbers (2.20-2.23) and NCCL's upper-case strings
    (2.24 on) both become ``ncclAlgoStr``/``ncclProtoStr`` names; a name or
    number this table does not know is kept as written.
    """
    found, pending = [], []
    for line in lines:
        call = _CALL.search(line)
        if call is not None:
            pending.append(_call_bytes(call))
            continue
        m = _LINE.search(line)
        if m is None:
            continue
        nbytes = int(m["nbytes"])
        coll = _FUNC_BY_KEY.get(_key(m["coll"]), m["coll"]) if m["coll"] else None
        if coll is None:  # 2.20-2.22: the first call still waiting with these bytes
            match = next((i for i, (_, b) in enumerate(pending) if b == nbytes), None)
            if match is not None:
                coll = pending.pop(match)[0]
        channels = (int(m["lo"]), int(m["hi"])) if m["lo"] is not None else None
        found.append(Tuning(
            collective=coll, nbytes=nbytes,
            algo=_name(m["algo"], NCCL_ALGOS, _ALGO_BY_KEY),
            proto=_name(m["proto"], NCCL_PROTOS, _PROTO_BY_KEY),
            channels=channels,
            time_us=float(m["time"]) if m["time"] is not None else None,
            per_rank=channels is not None and coll in _PER_RANK))
    return found


def tuning_files(path_pattern: str) -> list[str]:
    """Return the files NCCL wrote for ``path_pattern`` (``%h`` and ``%p`` expanded by NCCL)."""
    if "%p" not in path_pattern:
        path_pattern += ".%h.%p"
    return sorted(glob.glob(glob.escape(path_pattern).replace("%h", "*").replace("%p", "*")))


def read_tuning(path_pattern: str) -> list[Tuning]:
    """Return :func:`parse_tuning` of every file NCCL wrote for ``path_pattern``.

    Each file is read through :mod:`refcoll.core.reading`: a regular file (a FIFO
    or a device is refused, one line) of at most
    :data:`~refcoll.core.reading.MAX_TEXT_BYTES`; bytes that are not UTF-8 are
    replaced, as NCCL's log is text. ``path_pattern`` should name a folder of this
    user's own (:func:`refcoll.core.writing.private_folder`), where no one else can
    plant a file the pattern matches.
    """
    found = []
    for path in tuning_files(path_pattern):
        data = read_bytes(path, max_bytes=MAX_TEXT_BYTES, what="NCCL debug log")
        found.extend(parse_tuning(data.decode("utf-8", errors="replace").splitlines()))
    return found


def choice_for(tunings: Iterable[Tuning], collective: str, nbytes: int,
               nranks: int | None = None) -> Tuning | None:
    """Return the last TUNING record for ``collective`` (NCCL's or refcoll's name) of ``nbytes``.

    ``nbytes`` is the whole buffer, nccl-tests' ``size`` (an allgather's
    output, a reduce-scatter's input); records that give one rank's part
    (:attr:`Tuning.per_rank`) match ``nbytes / nranks``, so they need
    ``nranks``. Lines without a collective (NCCL 2.20-2.22 without COLL lines)
    match any collective. None: NCCL wrote no line for that call.
    """
    want = _FUNC_BY_KEY.get(_key(collective), collective)
    chosen = None
    for t in tunings:
        if t.collective is not None and t.collective != want:
            continue
        whole = t.nbytes * nranks if (t.per_rank and nranks) else t.nbytes
        if whole == nbytes and (nranks or not t.per_rank):
            chosen = t
    return chosen
