"""``refcoll calibrate``: measure auto's α, β and γ on N processes and save them on purpose."""

from __future__ import annotations

import sys

import click

from ..calls.auto import Calibration, cache_path
from ..calls.auto import calibrate as measure_and_save
from ..core.errors import UsageError
from ..transport.mpi import MPITransport
from . import launch
from .common import (
    check_not_inputs,
    check_output_paths,
    check_output_paths_on_lead,
    main,
    reports_errors,
    require_processes,
    write_json,
)
from .launch import relaunch

__all__ = ["calibrate", "describe", "as_json"]


def describe(calibration: Calibration) -> str:
    """Return one line of a calibration: its numbers, its age and where it came from."""
    age = calibration.age()
    when = "" if age is None else f", measured {_age(age)} ago"
    load = "" if calibration.load is None else f", {calibration.load:.2g} runnable tasks per core"
    return (f"α={calibration.alpha:.3g} s, β={calibration.beta:.3g} s/B "
            f"({1 / calibration.beta / 1e9 if calibration.beta else float('inf'):.3g} GB/s), "
            f"γ={calibration.gamma:.3g} s/element{load}{when}")


def _age(seconds: float) -> str:
    for unit, scale in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= scale:
            return f"{seconds / scale:.1f} {unit}"
    return f"{max(seconds, 0):.0f} s"


def as_json(calibration: Calibration) -> dict:
    """Return a calibration as the ``--json`` outputs of ``calibrate`` and ``list`` write it."""
    return {"alpha": calibration.alpha, "beta": calibration.beta, "gamma": calibration.gamma,
            "source": calibration.source, "key": calibration.key or None,
            "measured_at": calibration.measured_at, "age_s": calibration.age(),
            "load": calibration.load}


@main.command()
@click.option("-n", "--np", "nprocs", type=click.IntRange(min=2), default=2, show_default=True,
              help="Processes to start with mpiexec (ignored inside an MPI job); the ranks "
                   "per node of the jobs the calibration is for.")
@click.option("--force", is_flag=True,
              help="Measure even when a calibration of this key is cached, and replace it.")
@click.option("--json", "json_file", type=click.Path(dir_okay=False),
              help="Write the calibration and its key as JSON.")
@reports_errors
def calibrate(nprocs, force, json_file):
    """Measure the α, β and γ that algorithm auto chooses by, and save them.

    The calibration is kept under a key of what it depends on: the host, the
    MPI library, the ranks per node and whether the ranks outnumber the cores.
    A job of another shape measures its own. A measurement taken while the
    ranks outnumber the cores, or too noisy (another job on the cores), is
    not saved: the command then exits 1 and says why. Without --force, a
    calibration already cached under this key is shown, not measured again.
    """
    require_processes(nprocs, minimum=2)
    check_not_inputs({"--json": json_file}, {"the calibration cache": str(cache_path())})
    if not launch.in_mpi_job():
        check_output_paths(json=json_file)
        relaunch(nprocs)
    _calibrate_in_world(nprocs, force, json_file)


def _calibrate_in_world(nprocs: int, force: bool, json_file) -> None:
    MPI = launch.start_mpi("refcoll calibrate")
    # Only rank 0 writes --json, and every rank must have been given its arguments.
    check_output_paths_on_lead(MPI.COMM_WORLD, "refcoll calibrate", json=json_file)

    t = MPITransport(MPI.COMM_WORLD, collective="refcoll calibrate")
    if t.size < 2:
        raise UsageError("calibrate needs at least 2 processes: α and β come from a ping-pong")
    launch.data_ranks(t, nprocs)  # notes, on rank 0, an -n the job's size overrules
    with t.call("calibrate"):
        calibration, why = measure_and_save(t, force=force, announce=False)
    if t.rank != 0:
        if why is not None:
            sys.exit(1)  # every rank's status: what rank 0 says below
        return
    click.echo(f"key:         {calibration.key}")
    click.echo(f"calibration: {describe(calibration)}")
    click.echo(f"source:      {calibration.source}")
    cached = calibration.source.startswith("cached in")  # shown, not measured: not saved now
    write_json(json_file, {"schema": "refcoll-calibration/1", "cache": str(cache_path()),
                           "cached": cached, "saved": why is None and not cached,
                           "why_not_saved": why,
                           "calibration": as_json(calibration)})
    if why is not None:
        click.echo(f"refcoll: error: not saved: {why}", err=True)
        sys.exit(1)
