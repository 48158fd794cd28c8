"""``refcoll bench``: nccl-tests' sweep for refcoll's algorithms, against MPI's, NCCL's or Gloo's.

Thin: the options become a :class:`~refcoll.bench.BenchConfig`, the ranks run
:func:`~refcoll.bench.run_report`, rank 0 prints its table and writes its files.
"""

from __future__ import annotations

import os
import re
import sys

import click

from .. import algorithms
from ..bench import (
    FORMATS,
    SIZE_RULE,
    BenchConfig,
    bar_target,
    check_config,
    extra_ranks,
    forced_mpi_env,
    parse_size,
    rank_writer,
    run_report,
    save_report,
    size_sweep,
)
from ..bench.options import parse_algorithms
from ..bench.terminal import PROGRESS_VARIABLE, progress_setting
from ..core.errors import UsageError
from ..core.plot import require_matplotlib
from ..core.units import parse_count
from . import launch
from .common import (
    check_output_paths,
    check_output_paths_on_lead,
    main,
    reports_errors,
    require_memory,
    require_processes,
    write_json,
)

__all__ = ["bench", "decimal_size_note", "BUFFERS_PER_RANK"]

#: Bytes a rank holds per byte of the largest message: its input, output, the check's
#: expected result, the baseline's buffers and the algorithm's scratch (about 7.5 measured
#: at 32 MiB on 2 ranks).
BUFFERS_PER_RANK = 8


@main.command("bench")
@click.option("-n", "--np", "nprocs", type=int, default=2, show_default=True,
              help="Processes to start with mpiexec (ignored inside an MPI job).")
@click.option("-b", "--minbytes", default="8", show_default=True,
              help=f"Smallest size in {SIZE_RULE}.")
@click.option("-e", "--maxbytes", default="64M", show_default=True,
              help="Largest size (read as -b is).")
@click.option("-f", "--stepfactor", default="2", metavar="INTEGER", show_default=True,
              help="Multiply the size by this from one row to the next.")
@click.option("--algorithm", default="auto", show_default=True,
              help="Algorithms, comma-separated, or all (those with the collective); the first "
                   "is the algorithm under test, whose average ends '# Avg bus bandwidth'. "
                   "Options in parentheses: 'hierarchical(inter=ring,pipeline=8)'.")
@click.option("--collective", default="allreduce", show_default=True,
              metavar="[" + "|".join(algorithms.COLLECTIVES) + "]")
@click.option("-o", "--op", default="sum", show_default=True,
              help="sum, prod, max, min or avg, a comma list, or all (nccl-tests' -o).")
@click.option("-d", "--datatype", "--dtype", "dtype", default="float32", show_default=True,
              help="nccl-tests' names (float, half, bfloat16, double, int8, uint8, int32, "
                   "uint32, int64, uint64, f8e4m3 or fp8_e4m3, f8e5m2) or refcoll's (float32, "
                   "float16, int16...), a comma list, or all (nccl-tests' -d).")
@click.option("-r", "--root", default="0", metavar="INTEGER", show_default=True,
              help="The root of broadcast and reduce; -1: every root in turn (nccl-tests' -r).")
@click.option("-a", "--average", default="3", metavar="INTEGER", show_default=True,
              help="Each rank's median time, then over ranks: 0 rank 0's, 1 the mean, 2 the "
                   "smallest, 3 the largest (nccl-tests' -a; its default is 1).")
@click.option("--against", default="mpi", show_default=True,
              help="The library collectives timed beside refcoll's, comma-separated: mpi (the "
                   "MPI library's; mpi:ALGO forces its own algorithm ALGO, e.g. mpi:ring), nccl "
                   "(NCCL's through CuPy, with --device gpu, one process per GPU), gloo "
                   "(torch.distributed's Gloo backend; needs PyTorch), or none. "
                   "mpi:ring,gloo times both in the same run.")
@click.option("--nccl-algo", default=None,
              help="NCCL_ALGO for --against nccl (Ring, Tree, ^NVLS...; default: the "
                   "environment's, else NCCL's choice).")
@click.option("--nccl-proto", default=None,
              help="NCCL_PROTO for --against nccl (LL, LL128, Simple...).")
@click.option("--device", default="cpu", show_default=True, metavar="[cpu|gpu]",
              help="Where the buffers live: host memory (NumPy) or each rank's GPU (CuPy).")
@click.option("-w", "--warmup", "--warmup_iters", "warmup", default="5", metavar="INTEGER",
              show_default=True, help="Untimed iterations per size.")
@click.option("-i", "--iters", default="20", metavar="INTEGER", show_default=True,
              help="Timed iterations per size (nccl-tests' -n; -n here is the processes).")
@click.option("-m", "--agg-iters", "--agg_iters", "agg", default="1", metavar="INTEGER",
              show_default=True,
              help="Calls of each algorithm back to back in a timed iteration, no barrier "
                   "between them (nccl-tests' -m): each call meets the link as the one "
                   "before it left it. Each is timed and checked on its own.")
@click.option("-c", "--check", default="1", show_default=True, metavar="INTEGER",
              help="1 (or any count, as nccl-tests' -c N takes one): compare every "
                   "iteration's result with the expected one, bit for bit; 0: #wrong shows N/A.")
@click.option("--format", "fmt", default="refcoll", show_default=True,
              metavar="[" + "|".join(FORMATS) + "]",
              help="nccl-tests: nccl-tests' layout exactly (refcoll's columns as # lines).")
@click.option("--bound", is_flag=True,
              help="Also time each algorithm's bare messages and reductions (its transport bound).")
@click.option("--compressor", default=None,
              help="Run a compressed all-reduce with this compressor spec (ef(topk:ratio=0.01)).")
@click.option("--json", "json_file", type=click.Path(dir_okay=False),
              help="Write the header, rows and summary as JSON.")
@click.option("--csv", "csv_file", type=click.Path(dir_okay=False), help="Write the rows as CSV.")
@click.option("--plot", "plot_file", type=click.Path(dir_okay=False),
              help="Draw busbw against size to this PNG (needs matplotlib).")
@reports_errors
def bench(nprocs, minbytes, maxbytes, stepfactor, algorithm, collective, op, dtype, root, average,
          against, nccl_algo, nccl_proto, device, warmup, iters, agg, check, fmt, bound, compressor,
          json_file, csv_file, plot_file):
    """Time collectives over a size sweep, as nccl-tests does, beside the MPI library's own.

    Each row is nccl-tests' row: size, count, type, redop, root, then time
    (each rank's median, then over ranks as -a says), algbw, busbw and #wrong
    out of place and again in place; then refcoll's columns: the algorithm
    (and what auto chose), each baseline's time, busbw (MPI's in place too)
    and time/base (below 1: refcoll is faster), the bound. The footer ends
    with nccl-tests' '# Out of bounds values' and '# Avg bus bandwidth' (the
    algorithm under test, both halves); each baseline's average has a line
    of its own. The header says when the ranks outnumber the cores.
    With --device gpu the header names the GPU and how device buffers travel
    (direct through a CUDA-aware MPI, or staged through host memory) and why.
    Exit 0 when every check passes, 1 on wrong results, 2 on bad usage.
    """
    # Every value is read here, so that a bad one is one line and exit 2 (click's own
    # refusals are three), on every rank of a job started by a user's mpiexec.
    collective = _one_of(collective, algorithms.COLLECTIVES, "--collective")
    device = _one_of(device, ("cpu", "gpu"), "--device")
    fmt = _one_of(fmt, FORMATS, "--format")
    stepfactor = _whole(stepfactor, "-f/--stepfactor", "2")
    root = _whole(root, "-r/--root", "0")
    average = _whole(average, "-a/--average", "1")  # its range: check_config's, in words
    warmup = _whole(warmup, "-w/--warmup", "5")
    iters = _whole(iters, "-i/--iters", "20")
    agg = _whole(agg, "-m/--agg-iters", "4")
    check = _whole(check, "-c/--check", "1", minimum=0)  # nccl-tests' -c N checks N calls
    if not launch.in_mpi_job():
        # Before anything runs. Inside an MPI job only rank 0 writes the files, so
        # only it checks (_bench_in_world): another node may lack the folder.
        check_output_paths(json=json_file, csv=csv_file, plot=plot_file)
    require_processes(nprocs)  # first: the other checks count ranks with it
    names = parse_algorithms(algorithm)
    low = parse_size(minbytes, name="-b/--minbytes")
    high = parse_size(maxbytes, name="-e/--maxbytes")
    config = BenchConfig(
        sizes=size_sweep(low, high, stepfactor), sweep=(low, high, stepfactor),
        algorithms=names if names is not None else algorithms.names(collective),
        collective=collective, op=op, dtype=dtype, against=against, device=device,
        warmup=warmup, iters=iters, agg=agg, check=check, bound=bound, compressor=compressor,
        root=root, average=average, nccl_algo=nccl_algo, nccl_proto=nccl_proto)
    check_config(config, None if launch.in_mpi_job() else nprocs)
    notes = [note for note in (decimal_size_note(option, text) for option, text in
                               (("-b", minbytes), ("-e", maxbytes))) if note]
    if not launch.in_mpi_job():  # the launcher speaks once, not every rank
        for note in notes:
            click.echo(f"refcoll: note: {note}", err=True)
    if plot_file:
        require_matplotlib()
    if not launch.in_mpi_job():
        ranks = nprocs + extra_ranks(config.algorithms, nprocs)  # all on this machine
        require_memory(BUFFERS_PER_RANK * max(config.sizes) * ranks,
                       f"-e {maxbytes} on {ranks} ranks of this machine", "lower -e")
        # The terminal is here: the ranks' streams are pipes. The MPI library reads a
        # forced algorithm at MPI_Init, so its variables go into the job's environment.
        env = {**launch.workers_env(nprocs), PROGRESS_VARIABLE: progress_setting(bar_target()),
               **forced_mpi_env(config)}
        launch.relaunch(nprocs + extra_ranks(config.algorithms, nprocs), env)
    # In a job the user's own mpiexec started (bench's relaunch sets its bar's variable),
    # rank 0 gives the notes; and every rank checks this host's memory, since no launcher did.
    ours = PROGRESS_VARIABLE in os.environ
    _bench_in_world(nprocs, config, json_file, csv_file, plot_file, fmt,
                    notes=[] if ours else notes, memory=not ours)


def _require_memory_of_host(MPI, world, config) -> None:
    """Refuse, on every rank, a sweep whose largest size the ranks of some host cannot hold
    (as the launcher refuses it before a job it starts; here the user's mpiexec did)."""
    local = world.Split_type(MPI.COMM_TYPE_SHARED)
    ranks = local.Get_size()
    local.Free()
    problem = ""
    try:
        require_memory(BUFFERS_PER_RANK * max(config.sizes) * ranks,
                       f"-e {max(config.sizes)} B on {ranks} ranks of a host", "lower -e")
    except UsageError as exc:
        problem = str(exc)
    problem = next((text for text in world.allgather(problem) if text), "")
    if problem:
        raise UsageError(problem)


def _bench_in_world(nprocs, config, json_file, csv_file, plot_file, fmt="refcoll", *,
                    notes=(), memory=False) -> None:
    MPI = launch.start_mpi("refcoll bench")

    world = MPI.COMM_WORLD
    lead = world.rank == 0
    check_output_paths_on_lead(world, "refcoll bench", json=json_file, csv=csv_file,
                               plot=plot_file)  # (a bounded barrier: every rank is here)
    if memory:
        _require_memory_of_host(MPI, world, config)
    for note in notes if lead else ():
        click.echo(f"refcoll: note: {note}", err=True)
    config.workers = launch.data_ranks(world, nprocs)
    writer = _writer() if lead else None  # rank 0 writes the table and the bar, nobody else
    try:
        report = run_report(world, config, line=writer.line if lead else None,
                            progress=writer, fmt=fmt)
    finally:
        if writer is not None:
            writer.clear()  # an error's message must not land on the bar's line
    if lead:
        write_json(json_file, report)
        save_report(report, csv_path=csv_file, plot_path=plot_file)
    sys.stdout.flush()
    sys.exit(0 if report["summary"]["passed"] else 1)


def decimal_size_note(option: str, text: str) -> str | None:
    """Return a note when a size uses a decimal unit, which nccl-tests reads as binary.

    nccl-tests' ``parsesize`` reads only the letter (``sscanf("%lf %1s")``), so its
    ``-e 1GB`` is 1 GiB; here ``GB`` is 10^9 bytes (:data:`SIZE_RULE`). Said, not
    refused: both readings are a size, and the user may mean either.
    """
    written = str(text).strip()
    if not re.fullmatch(r".*[0-9.]\s*[kKMGT]B", written):  # 64K, 1MiB, 4096: one reading
        return None
    decimal, binary = parse_size(written, name=option), parse_size(written[:-1], name=option)
    return (f"{option} {written} is {decimal:,} B (a power of 1000); nccl-tests reads "
            f"{written} as {binary:,} B: write {written[:-1]} for that")


def _one_of(value: str, choices, option: str) -> str:
    """Return ``value`` if it is one of ``choices``; else a one-line UsageError naming them."""
    if value not in choices:
        raise UsageError(f"{option} {value!r}: choose one of {', '.join(choices)}")
    return value


def _whole(text: str, option: str, example: str, *, minimum: int | None = None,
           maximum: int | None = None) -> int:
    """Return a whole number given to ``option`` (a UsageError in one line otherwise)."""
    return parse_count(text, name=option, minimum=minimum, maximum=maximum, example=example)


def _writer():
    """Return rank 0's :class:`~refcoll.bench.TableWriter` over this process's streams."""
    return rank_writer(sys.stdout, sys.stderr)
