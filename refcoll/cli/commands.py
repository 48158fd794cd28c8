"""The commands of ``refcoll``: each parses, calls the library, prints."""

from __future__ import annotations

import contextlib
import os
import sys
import threading

import click

from . import (check_output_paths, check_output_paths_on_lead, main, relaunch, reports_errors,
               split_list, write_json)
from .. import algorithms
from ..core.errors import UsageError
from ..core.ops import DTYPES, OPS, check_supported, get_dtype, get_op, supports


# -------------------------------------------------------------------------- list

@main.command("list")
@click.option("--json", "json_file", type=click.Path(dir_okay=False), help="Write the listing as JSON.")
@reports_errors
def list_(json_file):
    """List algorithms, collectives, ops and dtypes, with each algorithm's cost.

    Ends with the GPU, if any, and how device buffers would travel (directly
    through a CUDA-aware MPI, or staged through host memory) and why.
    """
    from ..calls.auto import candidates

    payload = {"algorithms": [], "ops": list(OPS), "dtypes": {}}
    click.echo("algorithms:")
    for algo in algorithms.REGISTRY.values():
        costs = {c: (algo.costs[c](8, 1 << 18, 4).formula if algo.name != "auto" else
                 "the least modelled time among " + ", ".join(candidates(c)))
                 if c in algo.costs else "" for c in algo.collectives}
        payload["algorithms"].append({"name": algo.name, "summary": algo.summary,
                                      "collectives": list(algo.collectives), "cost": costs,
                                      "spec": algo.spec})
        click.echo(f"  {algo.name:<19} {algo.summary}")
        for coll in algo.collectives:
            click.echo(f"      {coll:<16} {costs[coll]}")
    from ..calls.auto import (algo_filter, cache_path, cached_calibrations, calibration_mode,
                              choice_table, current_calibration)
    from .calibrate import as_json, describe

    calibration = current_calibration()
    mode, allowed = calibration_mode(), algo_filter()
    cached = cached_calibrations()
    table = choice_table(calibration)
    payload["auto"] = {"calibration": as_json(calibration), "mode": mode,
                       "refcoll_algo": allowed.text or None, "cache": str(cache_path()),
                       "cached": [as_json(c) for c in cached],
                       "allreduce_float32": table}
    steering = [f"REFCOLL_CALIBRATION={mode}" if mode != "cache" else "from the cache",
                f"REFCOLL_ALGO={allowed.text}" if allowed.text else ""]
    click.echo(f"auto's calibration in force ({'; '.join(filter(None, steering))}):")
    click.echo(f"  {describe(calibration)}")
    click.echo(f"  key:    {calibration.key or '(fixed defaults: no measurement)'}")
    click.echo(f"  source: {calibration.source}")
    if len(cached) > (1 if calibration.key else 0):
        click.echo(f"  also cached in {cache_path()} (a job uses the entry of its own key):")
        for other in cached:
            if other.key != calibration.key:
                click.echo(f"    {other.key}: {describe(other)}")
    sizes = sorted({row["bytes"] for row in table})
    click.echo("auto picks for all-reduce of float32 with it:")
    click.echo("  " + f"{'p':>4} " + " ".join(f"{_human(b):>18}" for b in sizes))
    for p in sorted({row["p"] for row in table}):
        picks = {row["bytes"]: row["algorithm"] for row in table if row["p"] == p}
        click.echo("  " + f"{p:>4} " + " ".join(f"{picks[b]:>18}" for b in sizes))
    click.echo("ops:    " + ", ".join(OPS))
    click.echo("dtypes:")
    for name, dt in DTYPES.items():
        ok = [op for op in OPS if supports(op, dt)]
        payload["dtypes"][name] = ok
        click.echo(f"  {name:<14} {', '.join(ok)}")
    payload["gpu"] = _device_lines()
    write_json(json_file, payload)


def _device_lines() -> dict:
    """Print the GPU and the device-buffer path; return :func:`refcoll.transport.cuda_aware.device_path`'s answer.

    Without mpi4py (or an MPI library under it) the path is staging, said so:
    ``refcoll list`` runs without MPI.
    """
    from ..transport import cuda_aware as cuda
    from ..transport import device as devices
    from ..core import xp as xp_module

    info = cuda.device_path()
    click.echo(f"gpu: {info['gpu'] or 'none (' + str(info['gpu_reason']) + ')'}")
    click.echo(f"device buffers: {info['path']} ({info['why']})")
    return info


def _human(nbytes: int, digits: str = "g") -> str:
    """Return ``nbytes`` in the largest binary unit it reaches, formatted with ``digits``."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:{digits}} {unit}"
    return f"{nbytes} B"


# ------------------------------------------------------------- shared checks

def require_processes(nprocs: int, *, minimum: int = 1, flag: str = "-n") -> None:
    """Refuse a process count below ``minimum`` (``-n 0``, ``-n -1``) with a plain reason.

    Every command with ``-n`` calls it first, inside an MPI job too (where ``-n``
    is otherwise ignored): a count that no launch could use is bad usage, not
    something a collective should discover.

    Raises:
        UsageError: ``nprocs < minimum``.
    """
    if nprocs < minimum:
        raise UsageError(f"{flag} {nprocs}: the number of MPI processes to start must be at "
                         f"least {minimum}; give {flag} {minimum} or more")


#: The most ranks ``refcoll simulate`` runs. Simulated ranks are threads of one
#: process: a ring all-reduce of one element takes about 1 s at 64 ranks, 5 s at
#: 128 and 25 s at 256 on two cores (its p² messages each switch threads), and
#: grows as p² beyond.
MAX_SIMULATED_RANKS = 256

#: The memory ``simulate`` and ``gen-inputs`` may plan for where /proc/meminfo
#: (MemAvailable) cannot be read.
FALLBACK_MEMORY_CAP = 4 << 30

#: Seconds between "still running" notes of a long simulation on stderr.
_HEARTBEAT_S = 10.0

_MEMINFO = "/proc/meminfo"


def available_memory() -> tuple[int, str]:
    """Return the bytes a run may allocate and where that number comes from.

    MemAvailable of /proc/meminfo (Linux); elsewhere :data:`FALLBACK_MEMORY_CAP`.
    """
    try:
        with open(_MEMINFO, encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "available (MemAvailable, /proc/meminfo)"
    except (OSError, ValueError, IndexError):
        pass
    return FALLBACK_MEMORY_CAP, "of the fixed cap (no MemAvailable in /proc/meminfo)"


def simulation_bytes(collective: str, p: int, count: int, itemsize: int) -> int:
    """Return an upper estimate of the bytes :func:`refcoll.simulate` allocates.

    Per rank and element: the input, the output (allgather's is ``p`` inputs
    long), one receive or accumulation buffer in the dtype, and 8 bytes for the
    wider temporaries (the float64 or int64 draws of the inputs, the switch
    processes' accumulators). Measured peaks stay under it for every algorithm.
    """
    outputs = p if collective == "allgather" else 1
    return p * count * (itemsize * (2 + outputs) + 8)


def require_memory(needed: int, what: str, advice: str) -> None:
    """Refuse a run whose estimated ``needed`` bytes exceed the memory it may use.

    Raises:
        UsageError: naming the estimate, the limit and where the limit comes from.
    """
    limit, source = available_memory()
    if needed > limit:
        raise UsageError(f"{what} needs about {_human(needed, '.1f')}, more than the "
                         f"{_human(limit, '.1f')} {source}; {advice}")


@contextlib.contextmanager
def out_of_memory_is_usage(what: str, advice: str):
    """Turn a MemoryError (the estimate was too low, or memory went) into a one-line exit 2."""
    try:
        yield
    except MemoryError as exc:
        detail = str(exc).strip() or "MemoryError"
        raise UsageError(f"{what} ran out of memory ({detail}); {advice}") from None


@contextlib.contextmanager
def _still_running(label: str):
    """Note on stderr every :data:`_HEARTBEAT_S` seconds that a long run is still going."""
    done = threading.Event()

    def beat() -> None:
        waited = 0.0
        while not done.wait(_HEARTBEAT_S):
            waited += _HEARTBEAT_S
            click.echo(f"refcoll: {label}: still running after {waited:g} s", err=True)

    beater = threading.Thread(target=beat, name="refcoll-heartbeat", daemon=True)
    beater.start()
    try:
        yield
    finally:
        done.set()
        beater.join()


def check_output_directory(flag: str, path: str) -> None:
    """Refuse, before any work, a folder that files could not be written into.

    The folder may be missing (it is created, with its parents), but then the
    nearest folder above it that exists must be writable.

    Raises:
        UsageError: ``path`` is a file, or it or the folder above is not writable.
    """
    target = os.path.abspath(path)
    if os.path.exists(target) and not os.path.isdir(target):
        raise UsageError(f"{flag} {path}: is a file, not a folder; give a folder name")
    existing = target
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UsageError(f"{flag} {path}: {existing} is a file, so the folder cannot be created")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: folder {existing} is not writable")


# ------------------------------------------------------------------------ verify

@main.command()
@click.option("-n", "--np", "nprocs", type=int, default=4, show_default=True,
              help="Processes to start with mpiexec (ignored inside an MPI job).")
@click.option("--algorithm", default="all", show_default=True, help="Algorithms, comma-separated, or all.")
@click.option("--collective", default="all", show_default=True, help="Collectives, comma-separated, or all.")
@click.option("--op", default="all", show_default=True, help="Ops, comma-separated, or all.")
@click.option("--dtype", default="all", show_default=True, help="Dtypes, comma-separated, or all.")
@click.option("--sizes", default=None, help="Element counts, comma-separated [default: 0,1,p-1,p,p+1,5003].")
@click.option("--inplace", type=click.Choice(["both", "yes", "no"]), default="both", show_default=True)
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed of the inputs.")
@click.option("--compressor", "compressors", multiple=True, metavar="SPEC",
              help="Verify compressed all-reduce instead: a compressor spec (repeatable), "
                   "or all.")
@click.option("--device", type=click.Choice(["cpu", "gpu"]), default="cpu", show_default=True,
              help="Where the inputs live: host memory (NumPy) or each rank's GPU (CuPy).")
@click.option("--json", "json_file", type=click.Path(dir_okay=False), help="Write every case's verdict as JSON.")
@reports_errors
def verify(nprocs, algorithm, collective, op, dtype, sizes, inplace, seed, compressors, device,
           json_file):
    """Run the conformance battery on N MPI processes; end with 'N passed, N failed'.

    With --compressor, run the compressed all-reduce battery: every pattern the
    compressor allows, ops sum and avg, float32 and float64 unless --op and
    --dtype say otherwise, three steps of one state each, judged bit for bit
    against the simulator running the same code.

    With --device gpu, the inputs are CuPy arrays on each rank's GPU (ranks of a
    node share its GPUs in turn) and results must come back there, with the
    same bits as on the CPU; the compressed battery is judged against the
    simulator running on the GPU. Dtypes the GPU cannot compute in are left out
    of --dtype all.
    """
    from ..verify.conformance import build_cases, build_compressor_cases
    from .launch import in_mpi_job

    if not in_mpi_job():
        # Before anything runs. Inside an MPI job only rank 0 writes the file, so
        # only it checks (_verify_in_world): another node may lack the folder.
        check_output_paths(json=json_file)
    require_processes(nprocs)
    if device == "gpu":
        from ..transport import cuda_aware as cuda
        from ..transport import device as devices
        from ..core import xp as xp_module

        xp_module.require_cupy("--device gpu")

    if compressors:
        names = [a for a in algorithms.names() if algorithms.get(a).workers is None]
        specs = None if [c.strip().lower() for c in compressors] == ["all"] else list(compressors)
        selection = dict(
            compressors=specs,
            algorithms_=split_list(algorithm, names, "algorithm (switch takes no compressor)"),
            ops=split_list(op, ["sum", "avg"], "op for a compressed all-reduce"),
            dtypes=split_list(dtype, ["float16", "bfloat16", "float32", "float64"],
                              "dtype for a compressor"),
        )
        # Bad specs and empty selections fail here, before mpiexec.
        build_compressor_cases(nprocs, allow_empty=False, **selection)
        if not in_mpi_job():
            relaunch(nprocs)
        _verify_in_world(nprocs, selection, seed, json_file, device, compressed=True)
        return
    selection = dict(
        algorithms_=split_list(algorithm, algorithms.names(), "algorithm"),
        collectives=split_list(collective, algorithms.COLLECTIVES, "collective"),
        ops=split_list(op, list(OPS), "op"),
        dtypes=split_list(dtype, list(DTYPES), "dtype"),
        sizes=_parse_sizes(sizes),
        inplace={"both": (False, True), "yes": (True,), "no": (False,)}[inplace],
    )
    if not in_mpi_job():
        # Algorithms with switch processes need ranks beyond the N data ranks.
        extra = max([algorithms.get(name).extra_ranks(nprocs, **opts)
                     for name in (selection["algorithms_"] or algorithms.names())
                     if algorithms.get(name).extra_ranks is not None
                     for opts in algorithms.get(name).battery_options], default=0)
        build_cases(nprocs, world_size=nprocs + extra, allow_empty=False, **selection)
        relaunch(nprocs + extra, {"REFCOLL_WORKERS": str(nprocs)})
    _verify_in_world(nprocs, selection, seed, json_file, device)


def _parse_sizes(sizes: str | None) -> list[int] | None:
    if sizes is None:
        return None
    try:
        values = [int(s) for s in sizes.split(",") if s.strip()]
    except ValueError:
        raise UsageError(f"--sizes takes comma-separated element counts, got {sizes!r}") from None
    if any(v < 0 for v in values):
        raise UsageError("--sizes must be non-negative")
    return values


def _verify_in_world(nprocs, selection, seed, json_file, device: str = "cpu",
                     compressed: bool = False) -> None:
    import numpy as np
    from mpi4py import MPI

    from ..transport import cuda_aware as cuda
    from ..transport import device as devices
    from ..core import xp as xp_module
    from ..verify.conformance import (build_cases, build_compressor_cases, group_rows,
                                      run_battery, run_compressor_battery)
    from ..transport.mpi import MPITransport

    check_output_paths_on_lead(MPI.COMM_WORLD, "refcoll verify", json=json_file)
    t = MPITransport(MPI.COMM_WORLD, collective="refcoll verify")
    lead = t.rank == 0
    xp, where, left_out = np, None, []
    if device == "gpu":
        devices.use_node_gpu(MPI.COMM_WORLD)
        xp = xp_module.require_cupy("--device gpu")
        selection, left_out = _on_device(selection, xp, compressed)
        where = cuda.device_path()
    workers = int(os.environ.get("REFCOLL_WORKERS", t.size))
    if not 1 <= workers <= t.size:
        raise UsageError(f"REFCOLL_WORKERS={workers} does not fit a world of {t.size} ranks")
    if lead and "REFCOLL_WORKERS" not in os.environ and nprocs != t.size:
        click.echo(f"refcoll: note: already inside an MPI job of {t.size} processes; "
                   f"using it (-n {nprocs} ignored)", err=True)
    if compressed:
        cases = build_compressor_cases(t.size, allow_empty=False, **selection)
        run = run_compressor_battery
    else:
        cases = build_cases(workers, world_size=t.size, allow_empty=False, **selection)
        run = run_battery
    if lead:
        library = MPI.Get_library_version().splitlines()[0].strip()
        helpers = f" + {t.size - workers} switch processes" if t.size > workers else ""
        click.echo(f"refcoll verify: {workers} ranks{helpers}, {library}, {len(cases)} cases")
        if where is not None:
            click.echo(f"device: {where['gpu']}; transfers: {where['path']} ({where['why']})")
            if left_out:
                click.echo(f"left out on this device: {', '.join(left_out)}")
        click.echo(f"{'algorithm':<19} {'collective':<15} {'op':<5} {'dtypes':>6} {'cases':>6} "
                   f"{'passed':>7} {'failed':>7}  options")
    state = {"group": None, "rows": []}

    def progress(i, total, result):
        key = _group_of(result.case)
        state["rows"].append(result)
        done = i + 1 == total or _group_of(cases[i + 1]) != key
        if lead and done:
            row = group_rows([r for r in state["rows"] if _group_of(r.case) == key])[0]
            click.echo(f"{row['algorithm']:<19} {row['collective']:<15} {row['op']:<5} "
                       f"{row['dtypes']:>6} {row['cases']:>6} {row['passed']:>7} {row['failed']:>7}"
                       f"  {row['options']}")
            if row["failed"]:
                click.echo(f"    first failure: {row['first_failure']}")

    results = run(t, cases, seed=seed, progress=progress, xp=xp)
    passed = sum(r.passed for r in results)
    failed = len(results) - passed
    if lead:
        write_json(json_file, {"world_size": t.size, "seed": seed, "device": device,
                               "gpu": where, "passed": passed, "failed": failed,
                               "groups": group_rows(results),
                               "cases": [r.to_json() for r in results]})
        click.echo(f"{passed} passed, {failed} failed")
    sys.stdout.flush()
    sys.exit(0 if failed == 0 else 1)


def _on_device(selection: dict, xp, compressed: bool) -> tuple[dict, list[str]]:
    """Return the selection the device can run, and what ``all`` lost on the way.

    Dtypes the device cannot compute in (float8; bfloat16 before CuPy 14) and
    compressors that need one (bf16) leave ``all``; named explicitly, they are
    an error.

    Raises:
        UsageError: a dtype or compressor named explicitly that the device cannot run.
    """
    import numpy as np

    from ..transport import cuda_aware as cuda
    from ..transport import device as devices
    from ..core import xp as xp_module

    chosen = selection["dtypes"]
    if chosen is not None:
        for name in chosen:
            xp_module.check_device_dtype(get_dtype(name), xp)
    left_out: list[str] = []
    if not compressed:
        if chosen is None:
            chosen = [name for name in DTYPES if xp_module.device_supports(DTYPES[name], xp)]
            left_out = [name for name in DTYPES if name not in chosen]
        return dict(selection, dtypes=chosen), left_out
    from ..compressors import parse
    from ..verify.conformance import COMPRESSOR_BATTERY

    specs = selection["compressors"]
    runnable = []
    for spec in specs if specs is not None else COMPRESSOR_BATTERY:
        comp = parse(spec)
        try:
            comp.compress(xp.zeros(8, np.float32), comp.new_state())
        except UsageError as exc:
            if specs is not None:
                raise UsageError(f"--compressor {spec} on the device: {exc}") from None
            left_out.append(spec)
            continue
        runnable.append(spec)
    return dict(selection, compressors=runnable), left_out


def _group_of(case):
    return (case.algorithm, case.collective, case.op, case.options)


# ---------------------------------------------------------------------- simulate

@main.command()
@click.option("--algorithm", required=True, help="Algorithm to simulate.")
@click.option("-p", "--procs", "p", type=int, required=True,
              help=f"Number of simulated ranks, 1 to {MAX_SIMULATED_RANKS} (they are threads of "
                   "this one process).")
@click.option("--count", type=int, required=True,
              help="Elements per rank; inputs, outputs and buffers must fit in available memory.")
@click.option("--collective", default="allreduce", show_default=True)
@click.option("--dtype", default="float32", show_default=True)
@click.option("--op", default="sum", show_default=True)
@click.option("--root", type=int, default=0, show_default=True, help="Root of broadcast and reduce.")
@click.option("--ranks-per-node", "ranks_per_node", type=int, default=None,
              help="Consecutive ranks per node: report intra- and inter-node bytes "
                   "(and give hierarchical its node shape).")
@click.option("--json", "json_file", type=click.Path(dir_okay=False), help="Write the ledger summary as JSON.")
@reports_errors
def simulate(algorithm, p, count, collective, dtype, op, root, ranks_per_node, json_file):
    """Run one collective in-process and print its ledger beside the cost formula.

    The simulated ranks are threads of this process: -p is at most 256, and a
    run whose inputs, outputs and per-rank buffers would not fit in available
    memory (MemAvailable of /proc/meminfo; 4 GiB where it cannot be read) is
    refused before it starts. A run longer than 10 s says so on stderr every
    10 s.
    """
    from ..calls.collectives import simulate as run_simulation
    from ..verify.inputs import make_inputs

    check_output_paths(json=json_file)
    if p < 1:
        raise UsageError(f"-p {p}: a simulation needs at least 1 rank; give -p 1 or more")
    if p > MAX_SIMULATED_RANKS:
        raise UsageError(f"-p {p}: simulated ranks are threads of this one process, so at "
                         f"most {MAX_SIMULATED_RANKS} (a ring over 256 already takes tens of "
                         f"seconds); give -p {MAX_SIMULATED_RANKS} or fewer (the cost formulas "
                         "of `refcoll list` hold for any p)")
    if count < 0:
        raise UsageError(f"--count {count}: the element count per rank must be 0 or more")
    algo = algorithms.get(algorithm)
    algorithms.implementation(algorithm, collective)
    dt = get_dtype(dtype)
    reduction = get_op(op)
    check_supported(reduction, dt)
    if ranks_per_node is not None and ranks_per_node < 1:
        raise UsageError(f"--ranks-per-node must be at least 1, got {ranks_per_node}")
    what = f"simulating {collective} on {p} ranks of {count} x {dtype}"
    advice = "lower --count or -p"
    require_memory(simulation_bytes(collective, p, count, dt.itemsize), what, advice)
    options = {"root": root} if collective in ("broadcast", "reduce") else {}
    if algorithm == "hierarchical" and ranks_per_node is not None:
        options["ranks_per_node"] = ranks_per_node
    with out_of_memory_is_usage(what, advice), _still_running(f"simulate {algorithm} -p {p}"):
        inputs = make_inputs("exact", dt, count, p, op=reduction.name)
        result = run_simulation(collective, inputs, algorithm=algorithm, op=reduction.name,
                                **options)
    ledger = result.ledger
    cost_options = {k: v for k, v in options.items() if k != "root"}
    predicted = (algo.costs[collective](p, count, dt.itemsize, **cost_options)
                 if collective in algo.costs else None)
    click.echo(f"refcoll simulate: {algorithm} {collective}, p={p}, n={count} x {dtype} "
               f"({count * dt.itemsize} B per rank), op={reduction.name}")
    if predicted is not None:
        click.echo(f"cost: {predicted.formula}")
    click.echo(f"{'quantity':<20} {'ledger':>14} {'cost formula':>14}")
    rows = [("rounds", "rounds", ledger.rounds), ("messages", "messages", ledger.total_messages),
            ("bytes", "bytes", ledger.total_bytes),
            ("max rank messages", "max_rank_messages", ledger.max_rank_messages),
            ("max rank bytes", "max_rank_bytes", ledger.max_rank_bytes),
            ("critical-path bytes", "critical_bytes", ledger.critical_bytes),
            ("max rank reduced", "reduced", ledger.max_rank_reduced)]
    for label, field, value in rows:
        want = getattr(predicted, field) if predicted is not None else ""
        click.echo(f"{label:<20} {value:>14} {want:>14}")
    node_traffic = None
    if ranks_per_node is not None:
        from ..algorithms.hierarchical import node_traffic as split_traffic
        from ..core.cost import hierarchical_traffic

        intra, inter = split_traffic(ledger, ranks_per_node)
        want = (hierarchical_traffic(p, count, dt.itemsize, ranks_per_node=ranks_per_node)
                if algorithm == "hierarchical" else ("", ""))
        click.echo(f"{'intra-node bytes':<20} {intra:>14} {want[0]:>14}")
        click.echo(f"{'inter-node bytes':<20} {inter:>14} {want[1]:>14}")
        node_traffic = {"ranks_per_node": ranks_per_node, "intra": intra, "inter": inter,
                        "predicted": list(want) if algorithm == "hierarchical" else None}
    sent, received, msgs = ledger.bytes_sent(), ledger.bytes_received(), ledger.messages_sent()
    click.echo(f"{'rank':>6} {'messages sent':>14} {'bytes sent':>14} {'bytes received':>15}")
    for r in range(result.world.size):
        role = "" if r < p else "  (switch)"
        click.echo(f"{r:>6} {msgs.get(r, 0):>14} {sent.get(r, 0):>14} {received.get(r, 0):>15}{role}")
    write_json(json_file, {"algorithm": algorithm, "collective": collective, "p": p, "count": count,
                           "dtype": dtype, "op": reduction.name, "ledger": ledger.summary(),
                           "cost": predicted.counts() if predicted is not None else None,
                           "formula": predicted.formula if predicted is not None else None,
                           "node_traffic": node_traffic})


# -------------------------------------------------------------------- the oracle

_KINDS = ["exact", "random", "adversarial"]


@main.command("gen-inputs")
@click.option("-p", "--procs", "p", type=click.IntRange(min=1), required=True, help="Number of ranks.")
@click.option("--count", type=click.IntRange(min=0), required=True, help="Elements per rank.")
@click.option("--dtype", default="float32", show_default=True)
@click.option("--kind", type=click.Choice(_KINDS), default="random", show_default=True)
@click.option("--op", default="sum", show_default=True, help="The op the inputs are made exact for.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.argument("directory", type=click.Path(file_okay=False))
@reports_errors
def gen_inputs(p, count, dtype, kind, op, seed, directory):
    """Write rank<r>.npy inputs for P ranks (and meta.json) into DIRECTORY.

    exact: float results exact in any order (nccl-tests' verifiable inputs);
    random: normal values; adversarial: cancelling large values that expose the
    reduction order. bfloat16 and float8 are stored as their integer bits.
    """
    from ..verify.inputs import make_inputs, write_rank_files

    check_output_directory("DIRECTORY", directory)
    dt = get_dtype(dtype)
    reduction = get_op(op)
    what = f"generating {p} inputs of {count} x {dtype}"
    advice = "lower --count or -p"
    # Every rank's input is held at once, beside one float64/int64 draw.
    require_memory(p * count * dt.itemsize + 8 * count, what, advice)
    with out_of_memory_is_usage(what, advice):
        arrays = make_inputs(kind, dt, count, p, op=reduction.name, seed=seed)
    write_rank_files(directory, arrays, meta={"p": p, "count": count, "kind": kind,
                                              "op": reduction.name, "seed": seed})
    click.echo(f"wrote {p} inputs of {count} x {dtype} ({kind}) to {directory}")


def _collective_options(f):
    f = click.option("--root", type=click.IntRange(min=0), default=0, show_default=True,
                     help="Root of broadcast and reduce.")(f)
    f = click.option("--collective", type=click.Choice(list(algorithms.COLLECTIVES)),
                     default="allreduce", show_default=True)(f)
    f = click.option("--op", default="sum", show_default=True)(f)
    return f


@main.command()
@click.option("--algorithm", required=True, help="The algorithm whose results to predict.")
@_collective_options
@click.argument("in_dir", type=click.Path(file_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@reports_errors
def oracle(algorithm, op, collective, root, in_dir, out_dir):
    """Write the expected per-rank outputs of ALGORITHM for IN_DIR's inputs, bit for bit."""
    from ..verify.inputs import read_rank_files, write_rank_files
    from ..verify.oracle import expected_outputs

    check_output_directory("OUT_DIR", out_dir)
    algorithms.implementation(algorithm, collective)
    inputs = read_rank_files(in_dir)
    if any(x is None for x in inputs):
        raise UsageError(f"{in_dir}: rank files are missing (need rank0.npy .. rank{len(inputs) - 1}.npy)")
    if root >= len(inputs):
        raise UsageError(f"--root {root} is not one of the {len(inputs)} ranks")
    what = f"predicting {algorithm} {collective} for {len(inputs)} ranks"
    advice = "predict fewer or smaller inputs"
    require_memory(simulation_bytes(collective, len(inputs), inputs[0].size,
                                    inputs[0].dtype.itemsize), what, advice)
    with out_of_memory_is_usage(what, advice):
        outputs = expected_outputs(collective, inputs, algorithm=algorithm, op=get_op(op).name,
                                   root=root)
    write_rank_files(out_dir, outputs, meta={"algorithm": algorithm, "collective": collective,
                                             "op": get_op(op).name, "root": root})
    click.echo(f"wrote {sum(o is not None for o in outputs)} expected outputs of {algorithm} "
               f"{collective} to {out_dir}")


@main.command()
@click.option("--algorithm", default=None, help="Also require bit-exactness against this algorithm.")
@click.option("--any", "any_order", is_flag=True, help="Judge without a declared algorithm (the default).")
@_collective_options
@click.option("--json", "json_file", type=click.Path(dir_okay=False), help="Write the whole report as JSON.")
@click.argument("in_dir", type=click.Path(file_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@reports_errors
def check(algorithm, any_order, op, collective, root, json_file, in_dir, out_dir):
    """Judge another implementation's outputs (OUT_DIR/rank<r>.npy) for IN_DIR's inputs.

    Exit 0 conforming, 1 not conforming, 2 the files cannot be judged.
    """
    from ..verify.inputs import read_rank_files
    from ..verify.oracle import check_outputs

    check_output_paths(json=json_file)
    if algorithm and any_order:
        raise UsageError("give --algorithm A or --any, not both")
    if algorithm:
        algorithms.implementation(algorithm, collective)
    inputs = read_rank_files(in_dir)
    if root >= len(inputs):
        raise UsageError(f"--root {root} is not one of the {len(inputs)} ranks")
    outputs = read_rank_files(out_dir, dtype=inputs[0].dtype, size=len(inputs))
    with out_of_memory_is_usage(f"judging {len(inputs)} ranks' outputs",
                                "judge fewer or smaller outputs"):
        report = check_outputs(inputs, outputs, collective=collective, op=get_op(op).name,
                               algorithm=algorithm, root=root)
    against = f", against {algorithm}" if algorithm else ""
    click.echo(f"refcoll check: {collective} {report.op}, {report.ranks} ranks, {report.count} x "
               f"{report.dtype}{against}")
    click.echo(f"{'check':<42} {'result':<7} detail")
    for f in report.findings:
        click.echo(f"{f.check:<42} {'ok' if f.passed else 'FAIL':<7} {f.detail}")
    click.echo("verdict: " + ("conforming" if report.conforming else "not conforming"))
    write_json(json_file, report.to_json())
    sys.exit(0 if report.conforming else 1)
