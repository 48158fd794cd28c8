"""The commands of ``refcoll``: each parses, calls the library, prints.

``verify`` and ``simulate``; ``gen-inputs``, ``oracle`` and ``check`` (:mod:`.check`), ``list``,
``bench``, ``calibrate``, ``model``, ``spec`` and ``train`` have modules of their own.
"""

from __future__ import annotations

import hashlib
import json
import sys

import click

from .. import algorithms
from ..bench.config import reduces
from ..compressors import conformance as compressed
from ..core.errors import UsageError
from ..core.ops import DTYPES, OPS
from ..transport.scheduler import progress_note
from ..verify import session as verify_session
from ..verify.conformance.library import build_library_cases
from ..verify.simulation import MAX_SIMULATED_RANKS, run_simulation, simulation_case
from . import launch
from .common import (
    check_output_paths,
    check_output_paths_on_lead,
    main,
    out_of_memory_is_usage,
    reports_errors,
    require_memory,
    require_processes,
    split_list,
    still_running,
    write_json,
)
from .launch import relaunch

__all__ = ["verify", "simulate"]


# ------------------------------------------------------------------------ verify

@main.command()
@click.option("-n", "--np", "nprocs", type=int, default=4, show_default=True,
              help="Processes to start with mpiexec (ignored inside an MPI job).")
@click.option("--algorithm", default="all", show_default=True,
              help="Algorithms, comma-separated, or all.")
@click.option("--collective", default="all", show_default=True,
              help="Collectives, comma-separated, or all.")
@click.option("--op", default="all", show_default=True, help="Ops, comma-separated, or all.")
@click.option("--dtype", default="all", show_default=True, help="Dtypes, comma-separated, or all.")
@click.option("--sizes", default=None,
              help="Element counts, comma-separated [default: 0,1,p-1,p,p+1,5003].")
@click.option("--inplace", type=click.Choice(["both", "yes", "no"]),
              default="both", show_default=True)
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed of the inputs.")
@click.option("--compressor", "compressors", multiple=True, metavar="SPEC",
              help="Verify compressed all-reduce instead: a compressor spec (repeatable), "
                   "or all.")
@click.option("--device", type=click.Choice(["cpu", "gpu"]), default="cpu", show_default=True,
              help="Where the inputs live: host memory (NumPy) or each rank's GPU (CuPy).")
@click.option("--backend", type=click.Choice(["refcoll", "torch", "mpi"]), default="refcoll",
              show_default=True,
              help="refcoll: refcoll's algorithms over MPI; torch: torch.distributed's own "
                   "collectives (Gloo on cpu, NCCL on gpu); mpi: the MPI library's own "
                   "(MPI_Allreduce...); the last two judged by the oracle.")
@click.option("--json", "json_file", type=click.Path(dir_okay=False),
              help="Write every case's verdict as JSON.")
@reports_errors
def verify(nprocs, algorithm, collective, op, dtype, sizes, inplace, seed, compressors, device,
           backend, json_file):
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

    With --backend torch, judge torch.distributed's own all_reduce,
    reduce_scatter_tensor, all_gather_into_tensor, broadcast and reduce (Gloo;
    NCCL with --device gpu) on the battery's inputs with the oracle; what the
    backend refuses is listed as not supported. Runs under mpiexec (started
    with -n) or torchrun. With --backend mpi, the same for the MPI library's
    own MPI_Allreduce, MPI_Reduce_scatter_block, MPI_Allgather, MPI_Bcast and
    MPI_Reduce, in place and out of place, under mpiexec.
    """
    inside = launch.in_mpi_job() or (backend == "torch" and launch.in_torchrun())
    if not inside:
        # Before anything runs. Inside a job only rank 0 writes the file, so
        # only it checks (_verify_in_world): another node may lack the folder.
        check_output_paths(json=json_file)
    require_processes(nprocs)
    if backend == "torch":
        torch_judge = _torch_judge()
        filters = _library_filters("torch", torch_judge.TORCH_CALLS, algorithm, collective, op,
                                   dtype, sizes, inplace, compressors)
        torch_judge.require_torch(device)
        if not inside:  # an empty selection fails here, before mpiexec
            torch_judge.build_cases(nprocs, torch_judge.backend_for(device), allow_empty=False,
                                    **filters)
            relaunch(nprocs)
        return _verify_library_in_world(lambda: torch_judge.TorchJudge(device), nprocs,
                                        filters, seed, json_file)  # exits
    if backend == "mpi":
        from ..baselines import mpi_judge

        if device != "cpu":
            raise UsageError("--backend mpi judges the MPI library on host buffers: drop "
                             "--device gpu")
        filters = _library_filters("mpi", mpi_judge.MPI_CALLS, algorithm, collective, op,
                                   dtype, sizes, inplace, compressors)
        if not launch.in_mpi_job():  # an empty selection fails here, before mpiexec
            cases = build_library_cases(nprocs, "mpi", mpi_judge.MPI_CALLS,
                                        mpi_judge.IN_PLACE_ONLY, allow_empty=False, **filters)
            reasons = {mpi_judge.known_refusal(c.op, c.dtype) for c in cases}
            if None not in reasons:
                raise UsageError("no MPI library runs any of the selected cases: "
                                 + "; ".join(sorted(reasons)))
            relaunch(nprocs)
        launch.start_mpi("refcoll verify --backend mpi")
        return _verify_library_in_world(mpi_judge.MPIJudge, nprocs, filters, seed,
                                        json_file)  # exits
    verify_session.device_namespace(device)
    if compressors:
        chosen = split_list(collective, algorithms.COLLECTIVES, "collective")
        ignored = [flag for flag, given in (("--collective", chosen not in (None, ["allreduce"])),
                                            ("--sizes", sizes is not None),
                                            ("--inplace", inplace != "both")) if given]
        if ignored:
            raise UsageError(f"{', '.join(ignored)}: the compressed battery is all-reduces "
                             "of its own cases and sizes; drop "
                             f"{'it' if len(ignored) == 1 else 'them'} with --compressor")
        specs = None if [c.strip().lower() for c in compressors] == ["all"] else \
            list(dict.fromkeys(c.strip() for c in compressors))  # each spec once
        selection = verify_session.Selection(dict(
            compressors=specs,
            algorithms_=split_list(algorithm, compressed.compressed_algorithms(),
                                   "algorithm for a compressed all-reduce (one without "
                                   "switch processes)"),
            ops=split_list(op, compressed.COMPRESSED_OPS, "op for a compressed all-reduce"),
            dtypes=split_list(dtype, compressed.COMPRESSED_DTYPES, "dtype for a compressor"),
        ), battery=compressed.COMPRESSED_ALLREDUCE)
    else:
        selection = verify_session.Selection(dict(
            algorithms_=split_list(algorithm, algorithms.names(), "algorithm"),
            collectives=split_list(collective, algorithms.COLLECTIVES, "collective"),
            ops=split_list(op, list(OPS), "op"),
            dtypes=split_list(dtype, list(DTYPES), "dtype"),
            sizes=_parse_sizes(sizes),
            inplace={"both": (False, True), "yes": (True,), "no": (False,)}[inplace],
        ))
    if not launch.in_mpi_job():  # an empty selection fails in launch_size, before mpiexec
        total = selection.launch_size(nprocs)
        if not compressors:  # (the compressed battery has sizes of its own, all small)
            require_memory(max((_battery_bytes(c, total) for c in selection.cases(nprocs, total)),
                               default=0), f"the largest case on {total} ranks of this machine",
                           "select smaller --sizes")
        relaunch(total, launch.workers_env(nprocs))
    elif compressors:
        selection.launch_size(nprocs)  # a bad spec fails here, before the battery starts
    _verify_in_world(nprocs, selection, seed, json_file, device)


def _library_filters(backend: str, calls: dict, algorithm, collective, op, dtype, sizes,
                     inplace, compressors) -> dict:
    """Return a library backend's selection, refusing what does not apply to its own calls."""
    if compressors:
        raise UsageError(f"--backend {backend} judges the library's own collectives, which "
                         f"compress nothing: drop --compressor (or --backend {backend})")
    if split_list(algorithm, algorithms.names(), "algorithm") is not None:
        raise UsageError(f"--backend {backend} judges the library's own collectives, which "
                         "have no algorithm to choose: drop --algorithm")
    return dict(collectives=split_list(collective, list(calls), "collective"),
                ops=split_list(op, list(OPS), "op"),
                dtypes=split_list(dtype, list(DTYPES), "dtype"), sizes=_parse_sizes(sizes),
                inplace={"both": (False, True), "yes": (True,), "no": (False,)}[inplace])


def _torch_judge():
    """Return :mod:`refcoll.torch.judge`, imported when asked: it imports torch (a second)."""
    from ..torch import judge

    return judge


#: What each library backend's run says of the library's forms, before its rows.
_FORMS = {
    "torch": "all_reduce, broadcast and reduce run in place (torch's only form); "
             "reduce_scatter_tensor zero-pads a count p does not divide to the next multiple, "
             "as FSDP does",
    "mpi": "in place is MPI_IN_PLACE (MPI_Bcast is in place by nature); a count p does not "
           "divide is reduce-scattered with MPI_Reduce_scatter and refcoll's chunks",
}


def _verify_library_in_world(make_judge, nprocs, filters, seed, json_file) -> None:
    """Run a library's own collectives on the battery (every rank), print on rank 0, exit.

    ``make_judge()`` returns the library's judge, made here, inside the job.
    """
    judge = make_judge()
    lead = judge.rank == 0
    problem = None
    cases = judge.cases(**filters)
    if lead:
        try:
            check_output_paths(json=json_file)
            require_memory(max((_judging_bytes(judge, c) for c in cases), default=0),
                           "judging the largest case on rank 0", "select smaller --sizes")
        except UsageError as exc:
            problem = str(exc)
    # Every rank's arguments beside rank 0's: a digest to compare, the words to say how.
    words = launch.invoked_arguments()
    digest = hashlib.sha256(json.dumps(words).encode()).hexdigest()
    given = judge.gather({"digest": digest, "words": "\x1f".join(words)})
    if lead and problem is None and any(g["digest"] != digest for g in given):
        problem = launch.arguments_problem([g["words"].split("\x1f") for g in given])
    problem = judge.share({"problem": problem})["problem"]
    if problem is not None:
        if lead:
            raise UsageError(problem)
        sys.exit(2)
    width = max(23, 1 + max(len(call) for call in judge.calls.values()))
    if lead:
        if nprocs != judge.size and launch.given("nprocs"):
            click.echo(f"refcoll: note: already inside a {judge.launcher} job of {judge.size} "
                       f"processes; using it (-n {nprocs} ignored)", err=True)
        where = f"torch {judge.version}, {judge.backend} on {judge.device}" \
            if judge.library == "torch" else judge.version
        click.echo(f"refcoll verify --backend {judge.library}: {judge.size} ranks "
                   f"({judge.launcher}), {where}, {len(cases)} cases")
        click.echo("judged by the oracle: integers, min/max, data movement and exact inputs bit "
                   "for bit; random float sum/avg/prod within the error bound; every rank the "
                   "same bits")
        click.echo(_FORMS[judge.library])
        click.echo(f"{'backend':<8} {'call':<{width}} {'op':<5} {'dtypes':>6} {'cases':>6} "
                   f"{'passed':>7} {'failed':>7}  same bits as (random floats)")

    def show(row: dict) -> None:
        same = "; ".join(f"{dt}: {', '.join(labels) or 'none'}"
                         for dt, labels in row["same_bits"].items())
        click.echo(f"{row['algorithm']:<8} {row['call']:<{width}} {row['op']:<5} "
                   f"{row['dtypes']:>6} "
                   f"{row['cases']:>6} {row['passed']:>7} {row['failed']:>7}  {same}")
        if row["failed"]:
            click.echo(f"    failed on {', '.join(row['failed_dtypes'])}; first failure: "
                       f"{row['first_failure']}")

    report = judge.run(cases, seed=seed, on_group=show if lead else None)
    if lead:
        if report.unsupported:
            click.echo(f"not supported by {report.backend} "
                       f"({sum(u['cases'] for u in report.unsupported)} cases not run):")
        for u in report.unsupported_summary():
            click.echo(f"  {u['call']} {','.join(u['ops'])} on {', '.join(u['dtypes'])}: "
                       f"{u['reason']}")
        write_json(json_file, report.to_json())
        click.echo(f"{report.passed} passed, {report.failed} failed")
    sys.stdout.flush()
    if not report.results:
        if lead:
            raise UsageError(f"nothing was checked: {report.backend} supports none of the "
                             "selected cases")
        sys.exit(2)
    sys.exit(0 if report.failed == 0 else 1)


def _battery_bytes(case, ranks: int) -> int:
    """Return about what one case of the battery holds on this machine's ``ranks``: each
    data rank makes every rank's input and keeps its own, its result and twin's; rank 0
    also runs the oracle's prediction (every rank's input and result, twice)."""
    itemsize = DTYPES[case.dtype].itemsize
    data = case.ranks * case.count * itemsize
    return ranks * (data + 4 * case.count * itemsize) + 4 * data


def _judging_bytes(judge, case) -> int:
    """Return about what rank 0 holds to judge ``case``: every rank's input and result
    (several copies: the records, the oracle's and an order's simulated run) and the
    float64 reference of the exact sums."""
    itemsize = DTYPES[case.dtype].itemsize
    results = sum(judge.output_count(case, r) for r in range(judge.size))
    return 4 * itemsize * (judge.size * case.count + results) + 32 * case.count


def _parse_sizes(sizes: str | None) -> list[int] | None:
    if sizes is None:
        return None
    try:
        values = [int(s) for s in sizes.split(",") if s.strip()]
    except ValueError:
        raise UsageError(f"--sizes takes comma-separated element counts, got {sizes!r}") from None
    if any(v < 0 for v in values):
        raise UsageError("--sizes must be non-negative")
    return list(dict.fromkeys(values))  # each size once, in the order given


def _verify_in_world(nprocs, selection, seed, json_file, device: str = "cpu") -> None:
    MPI = launch.start_mpi("refcoll verify")

    check_output_paths_on_lead(MPI.COMM_WORLD, "refcoll verify", json=json_file)
    session = verify_session.VerifySession(MPI.COMM_WORLD, selection, device=device)
    t = session.t
    lead = t.rank == 0
    workers = launch.data_ranks(t, nprocs)
    cases = session.cases(workers)
    if lead:
        helpers = f" + {t.size - workers} switch processes" if t.size > workers else ""
        click.echo(f"refcoll verify: {workers} ranks{helpers}, {verify_session.mpi_library()}, "
                   f"{len(cases)} cases")
        fewer = sorted({(c.algorithm, c.ranks, c.total - c.ranks) for c in cases
                        if getattr(c, "ranks", workers) < workers})  # (compressed: all of them)
        for name, data, switches in fewer:  # the job has no room for its switch processes
            served = f" and {switches} switch process{'es' * (switches != 1)}" if switches else ""
            click.echo(f"note: {name} runs on {data} data rank{'s' * (data != 1)}{served} of "
                       f"this {t.size}-process job, which has no room for its switch processes "
                       f"beside {workers} data ranks: start more processes")
        where = session.where
        if where is not None:
            click.echo(f"device: {where['gpu']}; transfers: {where['path']} ({where['why']})")
            if session.left_out:
                click.echo(f"left out on this device: {', '.join(session.left_out)}")
        if selection.battery.nonblocking:
            click.echo("non-blocking: each case also runs as i<collective> (iallreduce...), issued "
                       "before the blocking call and held to its bits; then calls outstanding "
                       "together" + (" (host arrays)" if device == "gpu" else ""))
        click.echo(f"{'algorithm':<19} {'collective':<15} {'op':<5} {'dtypes':>6} {'cases':>6} "
                   f"{'passed':>7} {'failed':>7}  options")

    def show(row: dict) -> None:
        click.echo(f"{row['algorithm']:<19} {row['collective']:<15} {row['op']:<5} "
                   f"{row['dtypes']:>6} {row['cases']:>6} {row['passed']:>7} {row['failed']:>7}"
                   f"  {row['options']}")
        if row["failed"]:
            click.echo(f"    first failure: {row['first_failure']}")

    results = session.run(cases, seed=seed, on_group=show if lead else None)
    scenarios = session.run_outstanding(workers, seed=seed)
    if lead:
        for sc in scenarios:
            click.echo(f"non-blocking, {sc.name}: {sc.calls} calls outstanding together, "
                       f"{'passed' if sc.passed else 'FAILED: ' + sc.reason}")
    everything = [*results, *scenarios]
    failed = sum(not r.passed for r in everything)
    if lead:
        write_json(json_file, session.report(results, seed=seed, scenarios=scenarios))
        click.echo(f"{len(everything) - failed} passed, {failed} failed")
    sys.stdout.flush()
    sys.exit(0 if failed == 0 else 1)


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
@click.option("--root", type=int, default=None,
              help="Root of broadcast and reduce (default 0).")
@click.option("--ranks-per-node", "ranks_per_node", type=int, default=None,
              help="Consecutive ranks per node: report intra- and inter-node bytes "
                   "(and give an algorithm that takes a node shape this one).")
@click.option("--ledger-only", "ledger_only", is_flag=True,
              help="Record each rank's messages and replay their rendezvous, moving no data "
                   "(the same ledger, no thread per rank; for thousands of ranks). Not for "
                   "algorithms that split their communicator.")
@click.option("--json", "json_file", type=click.Path(dir_okay=False),
              help="Write the ledger summary as JSON.")
@reports_errors
def simulate(algorithm, p, count, collective, dtype, op, root, ranks_per_node, ledger_only,
             json_file):
    """Run one collective in-process and print its ledger beside the cost formula.

    The simulated ranks are threads of this process that take turns: -p is at
    most 4096 (--ledger-only runs them one after another, without data), and a
    run whose inputs, outputs and per-rank buffers would not fit in available
    memory (MemAvailable of /proc/meminfo; 4 GiB where it cannot be read) is
    refused before it starts. A run longer than 10 s says so on stderr every
    10 s.
    """
    check_output_paths(json=json_file)
    launch.check_environment()  # REFCOLL_TIMEOUT and the rest: the ledger-only world too
    case = simulation_case(algorithm, p, count, collective=collective, dtype=dtype, op=op,
                           root=root, ranks_per_node=ranks_per_node)
    what, advice = case.describe(), "lower --count or -p"
    require_memory(case.memory_bytes(moves_data=not ledger_only), what, advice)
    with out_of_memory_is_usage(what, advice), still_running(f"simulate {algorithm} -p {p}",
                                                             progress_note):
        report = run_simulation(case, moves_data=not ledger_only)
    predicted = report.predicted
    click.echo(f"refcoll simulate: {algorithm} {collective}, p={p}, n={count} x {dtype} "
               f"({count * case.itemsize} B per rank), "
               f"op={case.op if reduces(collective) else 'none'}")
    if report.chosen is not None:
        click.echo(f"auto ran: {report.chosen}")
    if predicted is not None:
        click.echo(f"cost: {predicted.formula}")
    click.echo(f"{'quantity':<20} {'ledger':>14} {'cost formula':>14}")
    for label, value, want in report.comparison():
        click.echo(f"{label:<20} {value:>14} {'' if want is None else want:>14}")
    node = report.node
    if node is not None:
        want = node.predicted if node.predicted is not None else ("", "")
        click.echo(f"{'intra-node bytes':<20} {node.intra:>14} {want[0]:>14}")
        click.echo(f"{'inter-node bytes':<20} {node.inter:>14} {want[1]:>14}")
    click.echo(f"{'rank':>6} {'messages sent':>14} {'bytes sent':>14} {'bytes received':>15}")
    for r in report.ranks:
        role = "  (switch)" if r.switch else ""
        click.echo(f"{r.rank:>6} {r.messages:>14} {r.sent:>14} {r.received:>15}{role}")
    write_json(json_file, report.to_json())
