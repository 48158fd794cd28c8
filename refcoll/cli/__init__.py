"""The ``refcoll`` command line: thin click commands over library calls.

Exit codes: 0 success, 1 a check failed, 2 bad usage or environment (with a
one-line reason), 3 a collective timed out. A reader that closes the pipe early
(``refcoll model ... | head``) ends the command quietly with 141, the status of
a Unix tool that SIGPIPE ended.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import click

from ..core.errors import CollectiveTimeout, RefcollError, UsageError
from ..transport.base import default_timeout
from ..transport.mpi import abort_job, bounded_barrier
from ..calls.auto import algo_filter, calibration_mode

__all__ = ["main"]


def _fail(message: str, code: int) -> None:
    click.echo(f"refcoll: error: {message}", err=True)
    sys.exit(code)


def _abort_job(code: int) -> None:
    """Exit with ``code``, ending every rank of the MPI job so none is left waiting."""
    abort_job(code)
    sys.exit(code)


#: The status of a process that SIGPIPE ended (128 + 13): what ``yes | head`` leaves.
BROKEN_PIPE = 141


def _quiet_broken_pipe() -> None:
    """Exit quietly after the reader of stdout went away, as Unix tools do."""
    try:  # later writes (and Python's own flush at exit) must not raise again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    os._exit(BROKEN_PIPE)


def reports_errors(fn):
    """Turn refcoll's exceptions into one-line messages and the documented exit codes."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except BrokenPipeError:
            _quiet_broken_pipe()
        except UsageError as exc:
            _fail(str(exc), 2)
        except CollectiveTimeout as exc:
            click.echo(f"refcoll: error: {exc}", err=True)
            _abort_job(3)
        except RefcollError as exc:
            _fail(str(exc), 1)
        except MemoryError as exc:
            _fail(f"out of memory ({str(exc).strip() or 'MemoryError'}); try a smaller size", 2)
        except OSError as exc:  # a --json path that cannot be written, a missing file
            _fail(f"{exc.strerror or exc}: {exc.filename}" if exc.filename else str(exc), 2)
    return wrapper


def check_output_paths(**paths: str | None) -> None:
    """Refuse, before any work, output files that could not be written afterwards.

    ``paths`` maps an option's name (``json``, ``csv``, ``plot``) to its path or
    None. A missing folder, a folder in the file's place or a folder without
    write permission is a :class:`~refcoll.core.errors.UsageError` naming the option,
    so a long run never ends in an error it could have given at the start.
    """
    for option, path in paths.items():
        if not path:
            continue
        flag = f"--{option.replace('_', '-')}"
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            raise UsageError(f"{flag} {path}: is a folder; give a file name")
        if not os.path.isdir(folder):
            raise UsageError(f"{flag} {path}: folder {folder} does not exist; create it first")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise UsageError(f"{flag} {path}: folder {folder} is not writable")
        if os.path.exists(path) and not os.access(path, os.W_OK):
            raise UsageError(f"{flag} {path}: file is not writable")


def check_output_paths_on_lead(world, what: str, **paths: str | None) -> None:
    """Check the output paths on rank 0 of an MPI job, the rank that writes them.

    Another node may lack the folder, so only rank 0 looks; a bounded
    ``MPI_Ibarrier`` and a broadcast of its verdict make a bad path exit 2 on
    every rank, with rank 0 saying why, once.
    """
    problem = None
    if world.Get_rank() == 0:
        try:
            check_output_paths(**paths)
        except UsageError as exc:
            problem = str(exc)
    bounded_barrier(world, f"{what} (checking the output paths)")
    problem = world.bcast(problem, root=0)
    if problem is not None:
        if world.Get_rank() == 0:
            raise UsageError(problem)
        sys.exit(2)


def write_json(path: str | None, payload: dict) -> None:
    """Write ``payload`` to ``path`` as indented JSON (nothing when path is None)."""
    if path:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(payload, fh, indent=2, default=str)
            fh.write("\n")


def split_list(value: str | None, choices, what: str) -> list[str] | None:
    """Parse ``a,b,c`` or ``all`` into a list checked against ``choices`` (None: all)."""
    if value is None or value.strip().lower() == "all":
        return None
    items = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in items if v not in choices]
    if unknown:
        raise UsageError(f"unknown {what} {', '.join(map(repr, unknown))}: choose from "
                         f"{', '.join(choices)} or all")
    return items


def check_environment() -> None:
    """Refuse, before starting any process, a ``REFCOLL_*`` setting every rank would refuse."""
    default_timeout()
    calibration_mode()
    algo_filter()


def relaunch(nprocs: int, env: dict | None = None) -> None:
    """Re-run this very command under ``mpiexec -n nprocs`` and exit with its status."""
    import os

    from .launch import mpiexec_command

    check_environment()
    cmd = mpiexec_command(nprocs, _invoked_args)
    try:
        code = subprocess.run(cmd, env={**os.environ, **(env or {})}).returncode
    except OSError as exc:
        raise UsageError(f"could not start {cmd[0]}: {exc}") from None
    if code == BROKEN_PIPE:
        sys.exit(code)  # the reader went away: nothing to say
    if code not in (0, 1, 2, 3):  # a rank killed, or the launcher failing
        click.echo(f"refcoll: error: {cmd[0]} exited with status {code}", err=True)
        code = 1
    sys.exit(code)


_invoked_args: list[str] = []


class _Main(click.Group):
    """The ``refcoll`` group; it keeps its arguments so a command can re-run itself."""

    def main(self, args=None, *rest, **kwargs):
        global _invoked_args
        _invoked_args = list(args) if args is not None else sys.argv[1:]
        return super().main(args, *rest, **kwargs)


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="refcoll")
def main() -> None:
    """refcoll: reference collectives, their conformance suite and their oracle."""


from . import commands  # noqa: E402,F401  (registers the commands on main)
from . import bench, calibrate, model, train  # noqa: E402,F401
