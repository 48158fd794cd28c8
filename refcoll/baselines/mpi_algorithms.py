"""Forcing the MPI library's own algorithm: ``refcoll bench --against mpi:ALGO``.

refcoll's ring is fairly timed against the MPI library's ring only when the
library is made to run its ring. Both libraries refcoll knows take the choice
from the environment, read once at ``MPI_Init``:

* **MPICH** (3.3 and later): one string-valued control variable per collective,
  ``MPIR_CVAR_<COLL>_INTRA_ALGORITHM=<name>``. The names are MPICH 5.0's, as
  its ``mpivars`` tool prints them (MPICH's ``src/mpi/coll/cvars.txt``). MPICH
  checks each forced algorithm's restrictions per call (``reduce_scatter_allgather``
  needs ``count >= 2^⌊lg p⌋``...) and, by default
  (``MPIR_CVAR_COLLECTIVE_FALLBACK=silent``), silently runs its own choice
  where the forced one cannot apply; ``fallback="print"`` makes it say so.
* **Open MPI**: the ``coll/tuned`` component's forced-algorithm parameters,
  ``OMPI_MCA_coll_tuned_use_dynamic_rules=1`` and
  ``OMPI_MCA_coll_tuned_<coll>_algorithm=<number>``, numbered as the enums of
  ``ompi/mca/coll/tuned/coll_tuned_<coll>_decision.c`` (Open MPI main; older
  releases stop earlier in each list and refuse the later numbers). Names and
  numbers are both accepted here; the number is what is set. ``coll/tuned`` must
  be the component that runs the collective (``coll/han`` or ``coll/hcoll``,
  where enabled, run before it).

refcoll's ``reduce_scatter`` is timed against ``MPI_Reduce_scatter_block``
(:data:`refcoll.baselines.mpi.BASELINES`), so its variable is the one for
``reduce_scatter_block`` in both libraries, not the one for ``MPI_Reduce_scatter``.

Derivatives of MPICH (Intel MPI, MVAPICH, Cray MPICH) keep their own selection
(``I_MPI_ADJUST_<COLL>``, ``MVP_``/``MV2_`` tuning, ``MPICH_<COLL>_...``) and
are not treated as MPICH: :func:`library_of` calls them ``unknown`` and
:func:`forced_env` refuses them rather than set variables they ignore.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys

from ..core.errors import UsageError
from ..core.processes import python

__all__ = ["LIBRARIES", "library_of", "installed_version", "installed_library", "algorithm_names",
           "forced_env", "missing_env", "COUNTERPARTS", "counterpart", "counterparts_of",
           "variable_of"]

#: The libraries whose algorithm refcoll can force, by :func:`library_of`'s names.
LIBRARIES = ("mpich", "openmpi")

_TITLES = {"mpich": "MPICH 5.0", "openmpi": "Open MPI"}

#: MPICH's control variable for each refcoll collective (MPICH 5.0 ``mpivars``).
_MPICH_VARIABLES = {
    "allreduce": "MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM",
    "reduce_scatter": "MPIR_CVAR_REDUCE_SCATTER_BLOCK_INTRA_ALGORITHM",
    "allgather": "MPIR_CVAR_ALLGATHER_INTRA_ALGORITHM",
    "broadcast": "MPIR_CVAR_BCAST_INTRA_ALGORITHM",
    "reduce": "MPIR_CVAR_REDUCE_INTRA_ALGORITHM",
}

#: The values each MPICH 5.0 variable takes, in ``mpivars``' order ("auto": MPICH's choice).
_MPICH_NAMES = {
    "allreduce": ("auto", "nb", "smp", "recursive_doubling", "recursive_multiplying",
                  "reduce_scatter_allgather", "tree", "recexch", "ring",
                  "k_reduce_scatter_allgather", "ccl"),
    "reduce_scatter": ("auto", "noncommutative", "recursive_doubling", "pairwise",
                       "recursive_halving", "nb"),
    "allgather": ("auto", "brucks", "k_brucks", "nb", "recursive_doubling", "ring",
                  "recexch_doubling", "recexch_halving"),
    "broadcast": ("auto", "binomial", "nb", "smp", "scatter_recursive_doubling_allgather",
                  "scatter_ring_allgather", "pipelined_tree", "tree"),
    "reduce": ("auto", "binomial", "nb", "smp", "reduce_scatter_gather"),
}

#: Open MPI coll/tuned's parameter stem for each refcoll collective.
_OMPI_STEMS = {
    "allreduce": "allreduce",
    "reduce_scatter": "reduce_scatter_block",
    "allgather": "allgather",
    "broadcast": "bcast",
    "reduce": "reduce",
}

#: coll/tuned's algorithm enums: position = the number Open MPI takes ("ignore": its choice).
_OMPI_NAMES = {
    "allreduce": ("ignore", "basic_linear", "nonoverlapping", "recursive_doubling", "ring",
                  "segmented_ring", "rabenseifner", "allgather_reduce"),
    "reduce_scatter": ("ignore", "basic_linear", "recursive_doubling", "recursive_halving",
                       "butterfly"),
    "allgather": ("ignore", "linear", "bruck", "recursive_doubling", "ring", "neighbor",
                  "two_proc", "sparbit", "direct-messaging"),
    "broadcast": ("ignore", "basic_linear", "chain", "pipeline", "split_binary_tree",
                  "binary_tree", "binomial", "knomial", "scatter_allgather",
                  "scatter_allgather_ring"),
    "reduce": ("ignore", "linear", "chain", "pipeline", "binary", "binomial",
               "in-order_binary", "rabenseifner"),
}

_NAMES = {"mpich": _MPICH_NAMES, "openmpi": _OMPI_NAMES}

#: The refcoll algorithm each library algorithm is the counterpart of: the same
#: schedule, message for message (the recursive ones at powers of two; their
#: fix-ups for other p differ in detail). Keyed by (library, refcoll collective,
#: library algorithm).
COUNTERPARTS = {
    ("mpich", "allreduce", "ring"): "ring",
    ("mpich", "allreduce", "recursive_doubling"): "recursive_doubling",
    ("mpich", "allreduce", "reduce_scatter_allgather"): "rabenseifner",
    # MPICH's default tree (knomial_1, k = 2, unpipelined) is a binomial tree hung the
    # other way round (at p = 4: 0-1-3, 0-2): the same cost, mirrored ranks.
    ("mpich", "allreduce", "tree"): "tree",
    ("mpich", "reduce_scatter", "recursive_halving"): "rabenseifner",
    ("mpich", "allgather", "ring"): "ring",
    ("mpich", "allgather", "brucks"): "bruck",
    ("mpich", "allgather", "recursive_doubling"): "rabenseifner",
    ("mpich", "broadcast", "binomial"): "tree",
    ("mpich", "reduce", "binomial"): "tree",
    ("openmpi", "allreduce", "basic_linear"): "naive",
    ("openmpi", "allreduce", "recursive_doubling"): "recursive_doubling",
    ("openmpi", "allreduce", "ring"): "ring",
    ("openmpi", "allreduce", "rabenseifner"): "rabenseifner",
    ("openmpi", "reduce_scatter", "recursive_halving"): "rabenseifner",
    ("openmpi", "allgather", "linear"): "naive",
    ("openmpi", "allgather", "bruck"): "bruck",
    ("openmpi", "allgather", "recursive_doubling"): "rabenseifner",
    ("openmpi", "allgather", "ring"): "ring",
    ("openmpi", "broadcast", "basic_linear"): "naive",
    ("openmpi", "broadcast", "binomial"): "tree",
    ("openmpi", "reduce", "linear"): "naive",
    ("openmpi", "reduce", "binomial"): "tree",
}

_FALLBACKS = ("error", "print", "silent")

#: What the libraries that are not forced here use instead, for the refusal.
_OTHER_KNOBS = {
    "intel": "Intel MPI selects with I_MPI_ADJUST_<COLLECTIVE>=<number>",
    "mvapich": "MVAPICH selects with its own MVP_/MV2_ tuning variables",
    "cray": "Cray MPICH selects with its own MPICH_<COLLECTIVE>_... variables",
}


def library_of(version: str) -> str:
    """Return ``"mpich"``, ``"openmpi"`` or ``"unknown"`` for ``MPI_Get_library_version``'s text.

    The first line names the library: only upstream MPICH counts as ``mpich``
    (``MPICH Version: 5.0.2``); Intel MPI, MVAPICH and Cray MPICH, built from
    MPICH, choose their algorithms with their own variables. Open MPI says
    ``Open MPI v5.0.3, package: ...``. The later lines (configure flags,
    compilers) are not read: an MPICH built with Intel's compilers is MPICH.
    """
    first = _first_line(version)
    if first.startswith("open mpi"):
        return "openmpi"
    if re.match(r"mpich version:", first):
        return "mpich"
    return "unknown"


def _first_line(version: str) -> str:
    return next((line.strip().lower() for line in version.splitlines() if line.strip()), "")


def _other(version: str) -> str:
    first = _first_line(version)
    return next((hint for word, hint in _OTHER_KNOBS.items() if word in first), "")


_PROBE = ("import mpi4py; mpi4py.rc.initialize = False; mpi4py.rc.finalize = False\n"
          "from mpi4py import MPI; print(MPI.Get_library_version())")


@functools.lru_cache(maxsize=1)
def installed_version() -> str:
    """Return ``MPI_Get_library_version``'s text for the library mpi4py loads ("" if none).

    MPI allows the call before ``MPI_Init``, but mpi4py initialises MPI when
    ``mpi4py.MPI`` is first imported, unless told not to, and only once per
    process. So when this process has not imported it yet, a child interpreter
    imports it without initialising and prints the text (0.2 s), and this
    process stays free to initialise MPI normally later. Already imported, it is
    asked directly.
    """
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:
        return mpi.Get_library_version()
    try:
        done = subprocess.run(python("-c", _PROBE), capture_output=True, text=True,
                              timeout=60, env=os.environ.copy(), check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout if done.returncode == 0 else ""


def installed_library() -> str:
    """Return :func:`library_of` the library mpi4py loads, without initialising MPI here."""
    return library_of(installed_version())


def _check_library(library: str) -> None:
    if library not in _NAMES:
        what, hint = repr(library), ""
        if library == "unknown":  # say which library this is, and its own knob if known
            version = installed_version()
            first = next((line.strip() for line in version.splitlines() if line.strip()), "")
            what, hint = (first[:60] or "an unknown MPI library"), _other(version)
        raise UsageError(f"refcoll can force the algorithms of {' and '.join(_TITLES.values())} "
                         f"only, not of {what}" + (f"; {hint}" if hint else ""))


def _check_collective(collective: str) -> None:
    if collective not in _MPICH_VARIABLES:
        raise UsageError(f"no MPI algorithm can be forced for {collective!r}: the collectives "
                         f"are {', '.join(_MPICH_VARIABLES)}")


def algorithm_names(library: str, collective: str) -> tuple[str, ...]:
    """Return the names ``library`` accepts for ``collective`` (refcoll's name of it).

    MPICH's list starts with ``auto`` (its own choice), Open MPI's with
    ``ignore`` (number 0, its own choice); Open MPI's are in enum order, so a
    name's position is its number.
    """
    _check_library(library)
    _check_collective(collective)
    return _NAMES[library][collective]


def variable_of(library: str, collective: str) -> str:
    """Return the environment variable that carries ``collective``'s algorithm in ``library``."""
    _check_library(library)
    _check_collective(collective)
    if library == "mpich":
        return _MPICH_VARIABLES[collective]
    return f"OMPI_MCA_coll_tuned_{_OMPI_STEMS[collective]}_algorithm"


def _canonical(name) -> str:
    return str(name).strip().lower().replace("-", "_")


def _resolve(library: str, collective: str, name) -> str:
    """Return the value to set for ``name``: MPICH's name, or Open MPI's number as text."""
    names = algorithm_names(library, collective)
    wanted = _canonical(name)
    if library == "openmpi" and wanted.isascii() and wanted.isdigit() and int(wanted) < len(names):
        return str(int(wanted))
    for number, known in enumerate(names):
        if _canonical(known) == wanted:
            return known if library == "mpich" else str(number)
    listed = ", ".join(names) if library == "mpich" else \
        ", ".join(f"{n} ({i})" for i, n in enumerate(names))
    raise UsageError(f"{_TITLES[library]} has no {collective} algorithm {str(name)!r}; "
                     f"it has: {listed}")


def forced_env(library: str, collective: str, name, *, fallback: str | None = None
               ) -> dict[str, str]:
    """Return the environment that makes ``library`` run its algorithm ``name`` for ``collective``.

    ``name`` is the library's own name (case and ``-``/``_`` do not matter) or,
    for Open MPI, its number. ``fallback`` (MPICH only: ``error``, ``print`` or
    ``silent``) sets ``MPIR_CVAR_COLLECTIVE_FALLBACK``, what MPICH does when the
    forced algorithm cannot apply to a call; note that MPICH's own
    ``MPI_Init`` runs collectives too, so ``error`` can abort at start-up.

    Raises:
        UsageError: a library refcoll cannot force, a collective it does not
            have, or a name that library does not have (naming those it has).
    """
    value = _resolve(library, collective, name)
    env = {variable_of(library, collective): value}
    if library == "openmpi":
        env = {"OMPI_MCA_coll_tuned_use_dynamic_rules": "1", **env}
    if fallback is not None:
        if library != "mpich" or fallback not in _FALLBACKS:
            raise UsageError(f"fallback= is MPICH's MPIR_CVAR_COLLECTIVE_FALLBACK, one of "
                             f"{', '.join(_FALLBACKS)}; got {fallback!r} for {library}")
        env["MPIR_CVAR_COLLECTIVE_FALLBACK"] = fallback
    return env


def missing_env(env: dict) -> list[str]:
    """Return the variables of ``env`` that this process's environment does not set to that value.

    An MPI library reads them at ``MPI_Init``: a bench already running inside
    an MPI job cannot set them any more, only check that its launcher did.
    """
    return [key for key, value in env.items() if os.environ.get(key) != str(value)]


#: Library algorithms that run on one count of ranks only: (library, collective, name) -> p.
_EXACT_RANKS = {("openmpi", "allgather", "two_proc"): 2}


def ranks_needed(library: str, collective: str, name) -> int | None:
    """Return the one count of ranks the library's algorithm ``name`` runs on (None: any)."""
    try:
        value = _resolve(library, collective, name)
    except UsageError:
        return None
    if library == "openmpi":
        value = _NAMES[library][collective][int(value)]
    return _EXACT_RANKS.get((library, collective, value))


def counterpart(library: str, collective: str, name) -> str | None:
    """Return the refcoll algorithm whose counterpart library algorithm ``name`` is (or None)."""
    value = _resolve(library, collective, name)
    if library == "openmpi":
        value = _NAMES[library][collective][int(value)]
    return COUNTERPARTS.get((library, collective, value))


def counterparts_of(library: str, collective: str, algorithm: str) -> tuple[str, ...]:
    """Return the ``library`` algorithms that refcoll's ``algorithm`` is timed against fairly."""
    names = algorithm_names(library, collective)
    return tuple(n for n in names if COUNTERPARTS.get((library, collective, n)) == algorithm)
