"""nccl-tests' option values, read as nccl-tests reads them: types, ops, ``-a``, ``--against``.

nccl-tests (``src/common.cu``) names its types ``int8 uint8 int32 uint32 int64
uint64 half float double bfloat16 f8e4m3 f8e5m2`` and its ops ``sum prod max min
avg``, and takes ``all`` for every one of them; :func:`parse_dtypes` and
:func:`parse_ops` read those names beside refcoll's own (``float32``,
``float8_e4m3fn``...), and :func:`table_type` prints a type as nccl-tests does.
``-a`` (:data:`AVERAGE`, :func:`over_ranks`) says how each rank's time becomes the
row's, and :func:`parse_against` reads ``--against`` lists such as ``mpi:ring,gloo``.
"""

from __future__ import annotations

import math
from typing import Sequence

from .. import algorithms
from ..algorithms.spelling import check_spelled, split_spelled, unspell
from ..core.errors import UsageError
from ..core.ops import DTYPES, OPS, dtype_name, get_dtype, get_op, supports

__all__ = [
    "NCCL_TESTS_TYPES",
    "NCCL_TESTS_OPS",
    "AVERAGE",
    "parse_dtypes",
    "parse_ops",
    "table_type",
    "over_ranks",
    "parse_against",
    "program_name",
    "parse_algorithms",
    "registry_name",
    "algorithm_options",
    "check_algorithm",
    "extra_ranks",
]

#: nccl-tests' type names (and the spellings ``fp8_e4m3``, ``fp8_e5m2``), by refcoll's dtype.
NCCL_TESTS_TYPES = {
    "int8": "int8", "uint8": "uint8", "int32": "int32", "uint32": "uint32", "int64": "int64",
    "uint64": "uint64", "half": "float16", "float": "float32", "double": "float64",
    "bfloat16": "bfloat16", "f8e4m3": "float8_e4m3fn", "f8e5m2": "float8_e5m2",
    "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
}

#: The ops nccl-tests' ``-o all`` runs, in its order (its ``mulsum`` has no refcoll op).
NCCL_TESTS_OPS = ("sum", "prod", "max", "min", "avg")

#: nccl-tests' ``-a``: how the ranks' times make the reported one (its default is 1;
#: refcoll's, 3, keeps the slowest rank, which is what a synchronous step waits for).
AVERAGE = {0: "rank 0's", 1: "the mean over ranks", 2: "the smallest over ranks",
           3: "the largest over ranks"}

#: nccl-tests' program for each collective, named in its ``--format nccl-tests`` header.
_PROGRAMS = {"allreduce": "all_reduce_perf", "reduce_scatter": "reduce_scatter_perf",
             "allgather": "all_gather_perf", "broadcast": "broadcast_perf",
             "reduce": "reduce_perf"}


def _items(text) -> list[str]:
    values = text.split(",") if isinstance(text, str) else list(text)
    return [str(v).strip() for v in values]


def parse_dtypes(text) -> list[str]:
    """Return refcoll's dtype names for ``-d``: one name, a comma list, or ``all``.

    A name is refcoll's (``float32``) or nccl-tests' (``float``, ``half``,
    ``double``, ``f8e4m3`` or ``fp8_e4m3``...); ``all`` is nccl-tests' types in its
    order.

    Raises:
        UsageError: an unknown name, naming both sets of names.
    """
    names = _items(text)
    if names == ["all"]:
        return list(dict.fromkeys(NCCL_TESTS_TYPES.values()))
    out = []
    for name in names:
        refcoll_name = NCCL_TESTS_TYPES.get(name, name)
        if refcoll_name not in DTYPES:
            raise UsageError(f"unknown dtype {name!r}: choose one of nccl-tests' "
                             f"{', '.join(list(NCCL_TESTS_TYPES)[:12])}, refcoll's "
                             f"{', '.join(DTYPES)}, or all")
        out.append(refcoll_name)
    return list(dict.fromkeys(out))


def parse_ops(text) -> list[str]:
    """Return the ops of ``-o``: one name, a comma list, or ``all`` (nccl-tests' five).

    Raises:
        UsageError: an unknown op.
    """
    names = _items(text)
    if names == ["all"]:
        return list(NCCL_TESTS_OPS)
    for name in names:
        if name not in OPS:
            raise UsageError(f"unknown op {name!r}: choose one of {', '.join(NCCL_TESTS_OPS)} "
                             "or all")
    return list(dict.fromkeys(names))


def variant_pairs(dtypes: Sequence[str], ops: Sequence[str], *, reduces: bool,
                  every_op: bool) -> list[tuple[str, str]]:
    """Return the ``(dtype, op)`` pairs to run, nccl-tests' loop order: types, then ops.

    A collective that only moves data runs one op per type. With ``every_op``
    (``-o all``) an op the type lacks (``prod`` on float8) is left out, as
    nccl-tests leaves out what NCCL lacks; an op named explicitly is kept, for
    the configuration check to refuse.
    """
    pairs = []
    for dtype in dtypes:
        for op in (ops if reduces else ops[:1]):
            if reduces and every_op and not supports(get_op(op), get_dtype(dtype)):
                continue
            pairs.append((dtype, op))
    return pairs


def table_type(dtype) -> str:
    """Return a dtype as nccl-tests prints it (``float``, ``half``...); refcoll's name otherwise."""
    name = dtype_name(get_dtype(dtype))
    for theirs, ours in NCCL_TESTS_TYPES.items():
        if ours == name:
            return theirs
    return name


def over_ranks(times: Sequence[float | None], mode: int) -> float:
    """Return the reported time from each rank's (None or NaN: a rank that sat it out).

    ``mode`` is nccl-tests' ``-a``: 0 rank 0's (the first rank that ran it, where
    rank 0 sat out), 1 the mean, 2 the smallest, 3 the largest. No time at all: 0.
    """
    ran = [t for t in times if t is not None and not math.isnan(t)]
    if not ran:
        return 0.0
    if mode == 0:
        return ran[0]
    if mode == 1:
        return sum(ran) / len(ran)
    return min(ran) if mode == 2 else max(ran)


def parse_against(text) -> list[tuple[str, str | None]]:
    """Return ``--against`` as ``(library, algorithm)`` pairs: ``mpi:ring,gloo``.

    Only ``mpi`` takes an algorithm (the MPI library's own, forced through its
    environment: :mod:`refcoll.baselines.mpi_algorithms`); ``none`` stays as it is.

    Raises:
        UsageError: an algorithm after another library, or an empty algorithm.
    """
    pairs = []
    for item in _items(text):
        library, sep, algorithm = item.partition(":")
        library, algorithm = library.strip(), algorithm.strip()
        if sep and library != "mpi":
            raise UsageError(f"--against {item}: only mpi takes an algorithm (mpi:ring); "
                             "NCCL's is chosen with --nccl-algo")
        if sep and not algorithm:
            raise UsageError(f"--against {item}: name the MPI library's algorithm after the "
                             "colon, e.g. mpi:ring")
        pairs.append((library, algorithm or None))
    return pairs


def program_name(collective: str) -> str:
    """Return nccl-tests' program for ``collective`` (``all_reduce_perf``...)."""
    return _PROGRAMS.get(collective, f"{collective}_perf")


def parse_algorithms(text) -> list[str] | None:
    """Return the algorithms of ``--algorithm``: a comma list, each perhaps with its options
    (``hierarchical(inter=ring,pipeline=8)``), or None for ``all``.

    Raises:
        UsageError: a word that does not read, or an unknown algorithm name.
    """
    if text is None or text.strip().lower() == "all":
        return None
    words = split_spelled(text)
    unknown = [word for word in words if unspell(word)[0] not in algorithms.REGISTRY]
    if unknown:
        raise UsageError(f"unknown algorithm {', '.join(map(repr, unknown))}: choose from "
                         f"{', '.join(algorithms.names())} or all")
    return list(dict.fromkeys(words))


def registry_name(spelled: str) -> str:
    """Return an ``--algorithm`` word's registry name: ``hierarchical`` of ``hierarchical(...)``."""
    return unspell(spelled)[0]


def algorithm_options(spelled: str) -> dict:
    """Return the options of a ``--algorithm`` word (``{}`` for a bare name)."""
    return unspell(spelled)[1]


def check_algorithm(spelled: str, collective: str) -> None:
    """Refuse a ``--algorithm`` word whose algorithm lacks ``collective`` or its options.

    Raises:
        UsageError: naming what the algorithm takes.
    """
    check_spelled(spelled, collective)


def extra_ranks(names: Sequence[str], workers: int) -> int:
    """Return the ranks beyond ``workers`` the algorithms ``names`` need (switch processes)."""
    records = [algorithms.get(registry_name(n)) for n in names]
    return max((a.extra_ranks(workers) for a in records if a.extra_ranks is not None), default=0)
