"""What a benchmark runs: its configuration, the size sweep, nccl-tests' bus factors.

:class:`BenchConfig` and :func:`check_config` (everything no rank could run is refused
here, before any MPI), the sizes (:func:`parse_size`, :func:`size_sweep`,
:func:`element_count`), :func:`bus_factor`, the device's array module and GPU
(:func:`array_module`, :func:`use_device`), the baseline's name and availability,
the MPI library's forced algorithm (:func:`mpi_algorithm`, :func:`forced_mpi_env`,
:func:`check_forced_mpi`), the runs of ``-d all -o all`` (:func:`variants`) and the
fields of a row (:data:`ROW_FIELDS`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from .. import algorithms
from ..algorithms.spelling import check_spelled
from ..baselines import gloo, mpi_algorithms, nccl, nccl_log
from ..baselines.mpi import BASELINES, mpi_unavailable
from ..calls import simulate
from ..compressors import parse as parse_compressor
from ..core import units
from ..core import xp as xp_module
from ..core.errors import UsageError
from ..core.ops import check_supported, get_dtype, get_op, is_float
from ..transport import device as devices
from ..transport.deadline import bounded_barrier
from .options import (
    check_algorithm,
    parse_against,
    parse_dtypes,
    parse_ops,
    registry_name,
    variant_pairs,
)

__all__ = [
    "BenchConfig",
    "dry_run",
    "ROW_FIELDS",
    "BASELINES",
    "NCCL_BASELINES",
    "GLOO_BASELINES",
    "LIBRARIES",
    "libraries",
    "parse_size",
    "size_sweep",
    "bus_factor",
    "element_count",
    "table_count",
    "array_module",
    "use_device",
    "check_config",
    "baseline_name",
    "baseline_unavailable",
    "baseline_checked",
    "op_label",
    "baseline_op",
    "reduces",
    "variants",
    "rooted",
    "root_runs",
    "mpi_algorithm",
    "forced_mpi_env",
    "check_forced_mpi",
    "SIZE_RULE",
]

#: NCCL's collective that each refcoll collective is timed against with ``--against nccl``.
NCCL_BASELINES = nccl.NCCL_CALLS

#: torch.distributed's collective on a Gloo group, timed with ``--against gloo``.
GLOO_BASELINES = gloo.GLOO_CALLS

#: The libraries ``--against`` names, and each one's column. ``backend`` (which ``gloo`` adds):
#: Gloo's torch.distributed calls on a ``backend="refcoll"`` group of the first algorithm.
LIBRARIES = {"mpi": "MPI", "nccl": "NCCL", "gloo": "Gloo", "backend": "backend"}

#: The fields of every row, in the order ``--csv`` writes them: the out-of-place half
#: (``time_us``... ``wrong``), then the in-place half (``inplace_*``), as nccl-tests' row.
ROW_FIELDS = (
    "collective", "algorithm", "resolved", "ranks", "size", "count", "dtype", "op", "root",
    "time_us", "algbw", "busbw", "wrong", "checked",
    "inplace_time_us", "inplace_algbw", "inplace_busbw", "inplace_wrong", "inplace_checked",
    "baseline", "base_time_us", "base_busbw", "base_wrong", "time_over_base",
    "base_inplace_time_us", "base_inplace_busbw", "base_inplace_wrong",
    "bound_us", "time_over_bound",
    "compressor", "pattern", "wire_sent", "wire_received", "dense_sent",
    "nccl_algo", "nccl_proto", "nccl_channels", "requested",
)

#: How every size option reads its value (:func:`refcoll.core.units.parse_size`), for --help.
SIZE_RULE = units.SIZE_RULE

#: The size of a sweep (``-b``, ``-e``) as :func:`refcoll.core.units.parse_size` reads it.
parse_size = units.parse_size


def size_sweep(minbytes: int, maxbytes: int, factor: int) -> list[int]:
    """Return ``minbytes, minbytes·factor, ...`` up to ``maxbytes`` (nccl-tests' ``-b -e -f``)."""
    if minbytes < 1:
        raise UsageError(f"the smallest size must be at least 1 byte, got {minbytes}")
    if maxbytes < minbytes:
        raise UsageError(f"the largest size ({maxbytes} B) is below the smallest ({minbytes} B)")
    if factor < 2:
        raise UsageError(f"the step factor must be at least 2, got {factor}")
    sizes = [minbytes]
    while sizes[-1] * factor <= maxbytes:
        sizes.append(sizes[-1] * factor)
    return sizes


def bus_factor(collective: str, n: int) -> float:
    """Return nccl-tests' ``busbw / algbw`` for ``collective`` on ``n`` ranks.

    All-reduce ``2(n-1)/n``; reduce-scatter and allgather ``(n-1)/n``; broadcast and
    reduce 1. The collective's, whatever the algorithm, as nccl-tests gives NVLS and
    CollNet rows the ring's: ``n`` are the ranks that hold data (a ``switch`` run's
    workers), and a row compares with the links' peak as every other row does.
    """
    if n < 1:
        raise ValueError(f"a collective needs at least one rank, got {n}")
    if collective == "allreduce":
        return 2 * (n - 1) / n
    if collective in ("reduce_scatter", "allgather"):
        return (n - 1) / n
    if collective in ("broadcast", "reduce"):
        return 1.0
    raise UsageError(f"unknown collective {collective!r}: choose one of "
                     f"{', '.join(algorithms.COLLECTIVES)}")


def element_count(collective: str, nbytes: int, itemsize: int, n: int) -> int:
    """Return the elements of the whole array for a size of ``nbytes``.

    Reduce-scatter and allgather give every rank a chunk of the same size (the MPI
    baseline, ``MPI_Reduce_scatter_block``, needs it), trimmed as nccl-tests trims
    it (``ReduceScatterGetCollByteCount``, ``AllGatherGetCollByteCount``: ``base =
    (count/nranks) & ~(16/eltSize - 1)``) to a whole number of 16-byte words, so
    that a row of refcoll's and a row of nccl-tests' for the same ``-b`` and ranks
    have the same size.
    """
    count = nbytes // itemsize
    if collective in ("reduce_scatter", "allgather"):
        base = count // n
        base -= base % max(1, 16 // itemsize)
        count = base * n
    return count


def table_count(collective: str, count: int, n: int) -> int:
    """Return the ``count`` column of nccl-tests' row: the elements each rank's call names.

    nccl-tests prints ``paramcount``: the whole buffer for all-reduce, broadcast and
    reduce, but one rank's chunk (``count/nranks``) for reduce-scatter and allgather,
    while its ``size`` column is the bytes of the larger buffer, the whole array.
    """
    return count // n if collective in ("reduce_scatter", "allgather") and n else count


def reduces(collective: str) -> bool:
    """Return whether ``collective`` combines values (allgather and broadcast only move them)."""
    return collective not in ("allgather", "broadcast")


# ------------------------------------------------------------------- the device

def array_module(device: str):
    """Return the array module buffers of ``device`` are allocated with: NumPy or CuPy.

    Raises:
        UsageError: an unknown device, or ``gpu`` where CuPy or a GPU is missing
            (the reason in one line).
    """
    if device == "cpu":
        return np
    if device == "gpu":
        return xp_module.require_cupy("--device gpu")
    raise UsageError(f"unknown device {device!r}: choose cpu or gpu")


def use_device(comm, config: "BenchConfig") -> int | None:
    """Make this rank's GPU current, collectively over ``comm``; return its number (None: CPU).

    With NCCL each rank needs a GPU of its own (an error says so when ranks
    would share one); refcoll alone shares GPUs round robin among a node's
    ranks. The dtype is checked on the device here, in the ranks, rather than
    in :func:`check_config`: a check there would open a CUDA context in the
    launching process, which a GPU in exclusive-process mode refuses to its ranks.

    Raises:
        UsageError: ranks that would share a GPU under NCCL; a dtype the device
            cannot compute in.
    """
    if config.device != "gpu":
        return None
    # The GPU choice starts with MPI_Comm_split_type, which has no nonblocking form:
    # a bounded MPI_Ibarrier first, so a rank that never comes times out here.
    bounded_barrier(comm, "refcoll bench (choosing GPUs: MPI_Comm_split_type)")
    device = (devices.check_one_gpu_per_rank(comm) if "nccl" in libraries(config)
              else devices.use_node_gpu(comm))
    xp_module.check_device_dtype(get_dtype(config.dtype), array_module("gpu"))
    return device


# ------------------------------------------------------------------- the config

@dataclass
class BenchConfig:
    """What to benchmark.

    Attributes:
        sizes: message sizes in bytes (:func:`size_sweep`).
        algorithms: algorithm names (``auto`` included).
        collective, op, dtype: what each call computes (``op`` ignored by
            allgather and broadcast).
        against: the library collectives timed beside ours: ``mpi`` (the MPI
            library's), ``nccl``, ``gloo`` (torch.distributed's on a Gloo group), a
            comma list of them (``mpi,gloo``: each one, interleaved) or ``none``.
        device: ``cpu`` or ``gpu``.
        warmup, iters: untimed and timed iterations per size.
        agg: calls of each item back to back in a timed iteration, no barrier between
            them (nccl-tests' ``-m``); each is timed and checked on its own.
        check: compare every iteration's result with the expected one (0: not); the
            count nccl-tests' ``-c N`` took, printed in its header as given.
        bound: also time each algorithm's transport bound.
        compressor: a compressor spec (all-reduce only), or None.
        workers: ranks that hold data (``None``: the whole communicator); the
            ranks after them serve as switch processes.
        root: the root of broadcast and reduce (nccl-tests' ``-r``; -1: every
            root in turn, :func:`root_runs`).
        average: how the ranks' times make a row's (nccl-tests' ``-a``): 0 rank 0's,
            1 the mean, 2 the smallest, 3 the largest (the default).
        in_place: also time the in-place half of each row (nccl-tests always does).
        nccl_algo, nccl_proto: ``NCCL_ALGO`` and ``NCCL_PROTO`` for ``--against
            nccl`` (None: what the environment says, if anything).
        sweep: the ``(-b, -e, -f)`` the sizes came from, as the header reports them
            (None: read off ``sizes``).

    ``dtype`` and ``op`` may name several (a comma list, or ``all``, as nccl-tests'
    ``-d all -o all``): :func:`variants` gives one configuration per pair, and
    ``against`` may force the MPI library's algorithm (``mpi:ring``).
    """

    sizes: Sequence[int] = (8,)
    algorithms: Sequence[str] = ("auto",)
    collective: str = "allreduce"
    op: str = "sum"
    dtype: str = "float32"
    against: str = "mpi"
    device: str = "cpu"
    warmup: int = 5
    iters: int = 20
    agg: int = 1
    check: int = 1
    bound: bool = False
    compressor: str | None = None
    workers: int | None = None
    root: int = 0
    average: int = 3
    in_place: bool = True
    nccl_algo: str | None = None
    nccl_proto: str | None = None
    sweep: tuple[int, int, int] | None = None


def rooted(collective: str) -> bool:
    """Return whether ``collective`` has a root (broadcast and reduce), as nccl-tests' column."""
    return collective in ("broadcast", "reduce")


def root_runs(config: BenchConfig, workers: int) -> list[BenchConfig]:
    """Return one configuration per root: ``-r -1`` runs every root in turn, as nccl-tests does.

    nccl-tests' broadcast and reduce (``BroadcastRunTest``, ``ReduceRunTest``) loop
    over the roots ``0 .. nranks-1`` when the root is ``-1``, inside the loop over
    types and ops; a collective without a root, or a root given, runs once.
    """
    if rooted(config.collective) and config.root == -1:
        return [replace(config, root=root) for root in range(workers)]
    return [config]


def variants(config: BenchConfig) -> list[BenchConfig]:
    """Return one configuration per ``(dtype, op)`` of ``config``, in nccl-tests' order.

    ``-d all -o all`` runs every type with every op it has; a collective that only
    moves data runs each type once.
    """
    ops = parse_ops(config.op)
    pairs = variant_pairs(parse_dtypes(config.dtype), ops, reduces=reduces(config.collective),
                          every_op=str(config.op).strip() == "all")
    if not pairs:
        raise UsageError(f"no op of -o {config.op} runs on -d {config.dtype}")
    return [replace(config, dtype=dtype, op=op) for dtype, op in pairs]


def check_config(config: BenchConfig, workers: int | None = None) -> None:
    """Raise :class:`UsageError` for a configuration no rank could run (before any MPI).

    Unknown or unsupported names, an algorithm without the collective, an op the
    dtype lacks, a compressor outside a floating sum/avg all-reduce, a GPU or NCCL
    where there is none, NCCL without ``--device gpu`` or with a dtype or op it
    lacks, ``--bound`` on a GPU, iteration counts below their minimum. Nothing
    here opens a CUDA context (:func:`use_device` checks the dtype on the device).
    Several dtypes or ops: each pair is checked (:func:`variants`). ``workers``
    (default ``config.workers``), where known, bounds the root of broadcast and
    reduce (the others have none: nccl-tests prints -1).
    """
    workers = workers or config.workers
    if workers is not None and rooted(config.collective) and config.root >= workers:
        raise UsageError(f"-r {config.root} is not one of the {workers} data ranks "
                         f"(0..{workers - 1})")
    runs = variants(config)
    if len(runs) > 1 or runs[0].dtype != config.dtype or runs[0].op != config.op:
        for run in runs:
            check_config(run, workers)
        return
    if not config.sizes:
        raise UsageError("no message sizes to run")
    if config.collective not in algorithms.COLLECTIVES:
        raise UsageError(f"unknown collective {config.collective!r}: choose one of "
                         f"{', '.join(algorithms.COLLECTIVES)}")
    if not config.algorithms:
        raise UsageError(f"no algorithm selected; algorithms with {config.collective}: "
                         f"{', '.join(algorithms.names(config.collective))}")
    for name in config.algorithms:
        check_algorithm(name, config.collective)
    dt = get_dtype(config.dtype)
    check_supported(get_op(config.op), dt)
    if workers is not None and not any(element_count(config.collective, size, dt.itemsize,
                                                     workers) for size in config.sizes):
        words = (" (each rank's chunk is whole 16-byte words, as nccl-tests cuts it)"
                 if config.collective in ("reduce_scatter", "allgather") else "")
        raise UsageError(f"no size from {config.sizes[0]} to {config.sizes[-1]} B holds an "
                         f"element of {config.dtype} for {config.collective} on {workers} "
                         f"ranks{words}: nothing would be measured; raise -b")
    if workers is not None:
        dry_run(config, workers)
    if config.warmup < 0 or config.iters < 1 or config.agg < 1:
        raise UsageError(f"need warm-up >= 0, iterations >= 1 and aggregated calls >= 1, "
                         f"got -w {config.warmup} -i {config.iters} -m {config.agg}")
    if config.root < -1:
        raise UsageError(f"the root must be a rank (>= 0), or -1 for every root in turn as "
                         f"nccl-tests takes it; got -r {config.root}")
    if config.average not in (0, 1, 2, 3):
        raise UsageError(f"-a takes 0 (rank 0), 1 (mean), 2 (min) or 3 (max) over ranks, as "
                         f"nccl-tests does; got {config.average}")
    _check_libraries(config, libraries(config), dt, workers)
    if config.compressor is not None:
        _check_compressor(config, dt)
        if config.bound:
            raise UsageError("--bound replays an algorithm's schedule on its full-width "
                             "messages: it does not run with --compressor")


def dry_run(config: BenchConfig, workers: int) -> None:
    """Run each algorithm once in the simulator, on ``workers`` ranks of a few elements:
    an option's value it refuses (``pipeline=0``, ``radix=1``, ``start=99``) is refused
    here, by the algorithm's own check, before any table line, not by every rank at its
    first row. The algorithms' options (not the sizes) decide it."""
    for run in variants(config):  # (each dtype and op of a list)
        dt = get_dtype(run.dtype)
        count = max(workers, 2) * (16 // dt.itemsize or 1)  # whole 16-byte words a rank
        xs = [np.zeros(count, dt) for _ in range(workers)]
        kwargs = {"op": run.op} if run.collective not in ("allgather", "broadcast") else {}
        if rooted(run.collective):
            kwargs["root"] = max(run.root, 0)
        for spelled in run.algorithms:
            name, options = check_spelled(spelled, run.collective)
            if options.get("level") == "rack":  # racks come from the topology file's hosts,
                continue  # which the simulator's ranks lack: the real run checks them
            simulate(run.collective, xs, algorithm=name, **kwargs, **options)


def _check_libraries(config: BenchConfig, chosen: tuple[str, ...], dt,
                     workers: int | None = None) -> None:
    """Raise :class:`UsageError` for baseline libraries ``chosen`` that cannot run ``config``."""
    if config.nccl_algo or config.nccl_proto:
        nccl_log.nccl_env(config.nccl_algo, config.nccl_proto)  # names NCCL lacks: refused
        if "nccl" not in chosen:
            raise UsageError("--nccl-algo and --nccl-proto choose NCCL's algorithm: they go "
                             "with --against nccl")
    if mpi_algorithm(config) is not None:
        forced_mpi_env(config)  # a name the MPI library lacks: refused, naming its own
        if workers is not None:
            needs = mpi_algorithms.ranks_needed(mpi_algorithms.installed_library(),
                                                config.collective, mpi_algorithm(config))
            if needs is not None and needs != workers:
                raise UsageError(f"--against mpi:{mpi_algorithm(config)} runs on exactly "
                                 f"{needs} ranks, not {workers} (the MPI library "
                                 "refuses it on any other count, refcoll's own calls too)")
    if "nccl" in chosen and config.device != "gpu":
        raise UsageError("--against nccl needs --device gpu (NCCL runs on GPUs)")
    if array_module(config.device) is not np and config.bound:
        raise UsageError("--bound replays schedules on host buffers: it runs with "
                         "--device cpu only")
    if "nccl" in chosen:
        nccl.require_nccl("--against nccl")
        nccl.nccl_types(dt, baseline_op(config))
    if "gloo" in chosen or "backend" in chosen:
        gloo.require_torch("--against gloo", load=False)  # the ranks import it
        if config.device != "cpu":
            raise UsageError("--against gloo times torch's Gloo backend on host buffers: it "
                             "runs with --device cpu only")


def _check_compressor(config: BenchConfig, dt) -> None:
    """Raise :class:`UsageError` for a ``--compressor`` that cannot run ``config``."""
    parse_compressor(config.compressor)
    if config.collective != "allreduce" or config.op not in ("sum", "avg") or not is_float(dt):
        raise UsageError("--compressor runs a compressed all-reduce: it needs --collective "
                         "allreduce, --op sum or avg and a floating dtype")
    switches = [n for n in config.algorithms if algorithms.get(registry_name(n)).workers]
    if switches:
        raise UsageError(f"--compressor cannot run with {', '.join(switches)}: switch "
                         "processes cannot combine compressed payloads")


def op_label(config: BenchConfig) -> str:
    """Return the op a report shows: ``none`` for the collectives that only move data."""
    return get_op(config.op).name if reduces(config.collective) else "none"


def baseline_op(config: BenchConfig) -> str:
    """Return the op the library's collective is given (``sum`` where nothing is reduced)."""
    return config.op if reduces(config.collective) else "sum"


# ----------------------------------------------------------------- the baseline

def libraries(config: BenchConfig) -> tuple[str, ...]:
    """Return the libraries ``config.against`` names, in its order (``none``: no library).

    One name of :data:`LIBRARIES`, a comma list or sequence of them, or ``none``;
    ``gloo`` brings ``backend`` with it.

    Raises:
        UsageError: an unknown name, a name twice, or ``none`` in a list.
    """
    names = [library for library, _ in parse_against(config.against)]
    choices = (f"choose {', '.join(LIBRARIES)} or none, or a comma list (mpi,gloo; "
               "mpi:ALGO forces the MPI library's algorithm)")
    if names == ["none"]:
        return ()
    text = ",".join(names)
    for name in names:
        if name == "none":
            raise UsageError(f"--against {text}: none means no library; it cannot be listed "
                             "with one")
        if name not in LIBRARIES:
            raise UsageError(f"unknown baseline {name!r}: {choices}")
    if len(set(names)) != len(names):
        raise UsageError(f"--against {config.against} names a library twice")
    names += ["backend"] if "gloo" in names and "backend" not in names else []
    return tuple(names)


def baseline_name(config: BenchConfig, library: str | None = None) -> str | None:
    """Return a library collective timed beside ours: ``MPI_Allreduce``, ``Gloo all_reduce``...

    ``library``: one of :func:`libraries`; None: the first (None when there is none).
    """
    chosen = libraries(config)
    library = library or (chosen[0] if chosen else None)
    if library == "nccl":
        return NCCL_BASELINES[config.collective]
    if library == "gloo":
        return GLOO_BASELINES[config.collective]
    if library == "backend":
        call = GLOO_BASELINES[config.collective].removeprefix("Gloo ")
        return f"{call} on backend=refcoll [{config.algorithms[0]}]"
    if library == "mpi":
        forced = mpi_algorithm(config)
        return BASELINES[config.collective] + (f"[{forced}]" if forced else "")
    return None


def mpi_algorithm(config: BenchConfig) -> str | None:
    """Return the MPI library's algorithm ``--against mpi:ALGO`` forces (None: its own choice)."""
    return next((algo for library, algo in parse_against(config.against) if library == "mpi"),
                None)


def forced_mpi_env(config: BenchConfig, library: str | None = None) -> dict[str, str]:
    """Return the environment that forces ``mpi:ALGO`` on ``library`` (None: mpi4py's, unread).

    MPICH reads ``MPIR_CVAR_<COLL>_INTRA_ALGORITHM``, Open MPI its ``coll_tuned``
    parameters (:func:`refcoll.baselines.mpi_algorithms.forced_env`); both at
    ``MPI_Init``, so the variables must be in the environment the ranks start
    with. Empty when nothing is forced.

    Raises:
        UsageError: an algorithm that library does not have, naming those it has.
    """
    forced = mpi_algorithm(config)
    if forced is None:
        return {}
    library = library or mpi_algorithms.installed_library()
    return dict(mpi_algorithms.forced_env(library, config.collective, forced))


def check_forced_mpi(config: BenchConfig, rank: int) -> dict[str, str]:
    """Refuse, in a rank, a forced MPI algorithm whose variables this job was not started with.

    Returns the variables in force (empty when nothing is forced).

    Raises:
        UsageError: on every rank alike, naming each variable to set and its value.
    """
    if mpi_algorithm(config) is None:
        return {}
    from mpi4py import MPI

    env = forced_mpi_env(config, mpi_algorithms.library_of(MPI.Get_library_version()))
    missing = mpi_algorithms.missing_env(env)
    if missing:
        settings = " ".join(f"{name}={env[name]}" for name in missing)
        raise UsageError(f"rank {rank}: --against {config.against} needs the MPI library's "
                         f"algorithm forced before MPI starts: set {settings} in the job's "
                         "environment (refcoll bench -n N sets it itself)")
    return env


def baseline_checked(config: BenchConfig, library: str) -> bool:
    """Return whether a library's results are checked against the expected ones.

    Not with checking off, and not for ``avg`` on MPI (it has no average: the
    baseline sums) or NCCL (``ncclAvg`` may scale before summing, so its result
    need not be the oracle's); Gloo's average sums, then divides, as refcoll's does.
    """
    return bool(config.check) and (get_op(config.op).name != "avg"
                                   or library in ("gloo", "backend"))


def baseline_unavailable(config: BenchConfig, library: str | None = None) -> str | None:
    """Return why a library's collective cannot run for ``config`` (None: it can).

    ``library``: one of :func:`libraries`; None: the first. NCCL's availability is
    :func:`check_config`'s to refuse; the others' their module's to judge
    (:func:`refcoll.baselines.mpi.mpi_unavailable`, :mod:`refcoll.baselines.gloo`).
    """
    chosen = libraries(config)
    library = library or (chosen[0] if chosen else None)
    if library is None:
        return "no baseline requested"
    if library == "nccl":
        return None
    if library == "gloo":
        return gloo.gloo_unavailable(config.collective, config.dtype, baseline_op(config),
                                     config.device)
    if library == "backend":
        return gloo.backend_unavailable(config.algorithms[0], config.collective, config.device)
    return mpi_unavailable(config.collective, config.dtype, config.device)
