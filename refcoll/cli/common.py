"""What every ``refcoll`` command shares: the group, error handling, output paths, guards.

The commands themselves live in :mod:`~refcoll.cli.commands`, ``bench``,
``calibrate``, ``check``, ``cluster``, ``listing``, ``model``, ``spec``, ``train``
and ``tune``; each registers on :data:`main` with ``@main.command()`` when its
module is imported, which :data:`main` does when the command is asked for
(:data:`COMMANDS`, click's lazy subcommands): ``refcoll check`` never loads what
``bench`` or ``model`` need. Starting MPI jobs is :mod:`~refcoll.cli.launch`'s.

Exit codes: 0 success, 1 a check failed, 2 bad usage or environment (with a
one-line reason), 3 a collective timed out. A reader that closes the pipe early
(``refcoll model ... | head``) ends the command quietly with 141, the status of
a Unix tool that SIGPIPE ended.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math
import os
import shutil
import sys
import threading

import click

from ..core import writing
from ..core.errors import CollectiveTimeout, RefcollError, UsageError
from ..core.units import human_bytes
from ..transport.deadline import abort_job, bounded_barrier
from . import launch

__all__ = ["main", "COMMANDS", "reports_errors", "check_output_paths",
           "check_output_paths_on_lead", "check_output_directory", "write_json", "split_list",
           "require_processes", "available_memory", "require_memory", "out_of_memory_is_usage",
           "still_running", "BROKEN_PIPE", "FALLBACK_MEMORY_CAP"]

#: The status of a process that SIGPIPE ended (128 + 13): what ``yes | head`` leaves.
BROKEN_PIPE = launch.BROKEN_PIPE

#: The status of a command that Ctrl-C (SIGINT) ended: 128 + 2, as a shell reports it.
INTERRUPTED = 130


#: Each command and the module of :mod:`refcoll.cli` that defines it, imported when the
#: command is first asked for (``tests/test_cli.py`` holds this table to the modules).
COMMANDS = {"bench": "bench", "calibrate": "calibrate", "check": "check", "cluster": "cluster",
            "gen-inputs": "check", "list": "listing", "model": "model", "oracle": "check",
            "simulate": "commands", "spec": "spec", "train": "train", "tune": "tune",
            "vectors": "spec", "verify": "commands"}


class _Main(click.Group):
    """The ``refcoll`` group; it keeps its arguments so a command can re-run itself, and
    loads each command's module when the command is asked for."""

    def list_commands(self, ctx) -> list[str]:
        return sorted(set(COMMANDS) | set(self.commands))

    def get_command(self, ctx, name: str):
        if name not in self.commands and name in COMMANDS:
            importlib.import_module(f"{__package__}.{COMMANDS[name]}")  # registers on main
        return super().get_command(ctx, name)

    def main(self, args=None, *rest, **kwargs):
        launch.remember_arguments(list(args) if args is not None else sys.argv[1:])
        try:
            return super().main(args, *rest, **kwargs)
        except SystemExit as exc:
            launch.note_exit(exc.code)
            raise
        except BaseException:  # Python ends the process with status 1
            launch.note_exit(1)
            raise

    def invoke(self, ctx):
        """Run the command; Ctrl-C ends it with 130 (128 + SIGINT), as a shell reports it."""
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("refcoll: interrupted", err=True)
            sys.exit(INTERRUPTED)


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="refcoll")
def main() -> None:
    """refcoll: reference collectives, their conformance suite and their oracle."""


# ------------------------------------------------------------------------------ errors

def _fail(message: str, code: int) -> None:
    click.echo(f"refcoll: error: {message}", err=True)
    sys.exit(code)


def _abort_job(code: int) -> None:
    """Exit with ``code``, ending every rank of the MPI job so none is left waiting (noted
    first: ``MPI_Abort`` ends this rank before its exit is, and the ``-n`` launcher takes a
    status no rank noted for a rank that died)."""
    launch.note_exit(code)
    abort_job(code)
    sys.exit(code)


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
        except MemoryError as exc:  # in an MPI job every rank ends: the others would wait
            click.echo(f"refcoll: error: out of memory ({str(exc).strip() or 'MemoryError'}); "
                       "try a smaller size", err=True)
            _abort_job(2)
        except OSError as exc:  # a --json path that cannot be written, a missing file
            _fail(f"{exc.strerror or exc}: {exc.filename}" if exc.filename else str(exc), 2)
    return wrapper


# ------------------------------------------------------------------------ output paths

def check_output_paths(**paths: str | None) -> None:
    """Refuse, before any work, output files that could not be written afterwards.

    ``paths`` maps an option's name (``json``, ``csv``, ``plot``) to its path or
    None. A missing folder, a folder in the file's place or a folder without
    write permission is a :class:`~refcoll.core.errors.UsageError` naming the option,
    so a long run never ends in an error it could have given at the start, and so
    is one path given to two options (the second file would replace the first).
    """
    check_not_inputs({f"--{option.replace('_', '-')}": path for option, path in paths.items()},
                     {})
    for option, path in paths.items():
        if path is None:
            continue
        flag = f"--{option.replace('_', '-')}"
        if not str(path).strip():
            raise UsageError(f"{flag} {path!r}: give a file name")
        if str(path) == "-":  # not standard output: that carries the report
            raise UsageError(f"{flag} -: refcoll writes {flag} to a file, not to standard "
                             "output (the report goes there); give a file name")
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            raise UsageError(f"{flag} {path}: is a folder; give a file name")
        if not os.path.isdir(folder):
            raise UsageError(f"{flag} {path}: folder {folder} does not exist; create it first")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise UsageError(f"{flag} {path}: folder {folder} is not writable")
        if os.path.exists(path) and not os.access(path, os.W_OK):
            raise UsageError(f"{flag} {path}: file is not writable")
        try:
            writing.check_target(path)
        except UsageError as exc:
            raise UsageError(f"{flag} {exc}") from None


def check_not_inputs(outputs: dict, inputs: dict) -> None:
    """Refuse an output file that is one of the command's input files, or another output.

    ``outputs`` and ``inputs`` map an option (``--json``, ``--compare``) to a path, a
    list of paths, or None. Writing the report over the log it was computed from
    would lose the log.
    """
    def pairs(named):
        for option, value in named.items():
            for path in ([value] if isinstance(value, str) else list(value or ())):
                if path:
                    yield option, path

    seen = list(pairs(inputs))
    for option, path in pairs(outputs):
        for other, taken in seen:
            if writing.same_place(path, taken):
                raise UsageError(f"{option} {path}: is the file of {other}; write it elsewhere")
        seen.append((option, path))


def check_output_paths_on_lead(world, what: str, **paths: str | None) -> None:
    """Check the output paths on rank 0 of an MPI job, the rank that writes them, and that
    every rank was given rank 0's arguments.

    Another node may lack the folder, so only rank 0 looks; a bounded
    ``MPI_Ibarrier`` and a broadcast of its verdict make a bad path exit 2 on
    every rank, with rank 0 saying why, once. Arguments that differ between the
    ranks (:func:`~refcoll.cli.launch.arguments_problem`) are refused the same way.
    """
    problem = None
    if world.Get_rank() == 0:
        try:
            check_output_paths(**paths)
        except UsageError as exc:
            problem = str(exc)
    bounded_barrier(world, f"{what} (checking the output paths and arguments)")
    problem = world.bcast(problem, root=0)
    if problem is None:
        problem = launch.arguments_problem(world.allgather(launch.invoked_arguments()))
    if problem is not None:
        if world.Get_rank() == 0:
            raise UsageError(problem)
        sys.exit(2)


def check_output_directory(flag: str, path: str) -> None:
    """Refuse, before any work, a folder that files could not be written into.

    The folder may be missing (it is created, with its parents), but then the
    nearest folder above it that exists must be writable.

    Raises:
        UsageError: ``path`` is a file, or it or the folder above is not writable.
    """
    if not str(path).strip():  # an unset $DIR in a script: never the current folder
        raise UsageError(f"{flag} {path!r}: give a folder name (as mkdir '' refuses it)")
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


def write_json(path: str | None, payload: dict) -> None:
    """Write ``payload`` to ``path`` as indented JSON (nothing when path is None).

    The file is replaced whole (:func:`refcoll.core.writing.write_json`): a link at
    ``path`` is replaced, never written through.
    """
    if path:
        writing.write_json(path, _finite(payload), default=str, allow_nan=False)


def _finite(value):
    """Return ``value`` with every float that is not finite as None (JSON's null): NaN and
    Infinity are not JSON, and other readers (jq, browsers) refuse them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


# ----------------------------------------------------------------------------- parsing

def split_list(value: str | None, choices, what: str) -> list[str] | None:
    """Parse ``a,b,c`` or ``all`` into a list checked against ``choices`` (None: all)."""
    if value is None or value.strip().lower() == "all":
        return None
    items = list(dict.fromkeys(v.strip() for v in value.split(",") if v.strip()))  # once each
    unknown = [v for v in items if v not in choices]
    if unknown:
        raise UsageError(f"unknown {what} {', '.join(map(repr, unknown))}: choose from "
                         f"{', '.join(choices)} or all")
    return items


#: The most processes ``-n`` starts on this machine; a larger job is started with the
#: user's own ``mpiexec`` (and a hostfile), where ``-n`` is not read.
MAX_PROCESSES = 4096


def require_processes(nprocs: int, *, minimum: int = 1, flag: str = "-n") -> None:
    """Refuse a process count below ``minimum`` (``-n 0``, ``-n -1``) or above
    :data:`MAX_PROCESSES` with a plain reason.

    Every command with ``-n`` calls it first, inside an MPI job too (where ``-n``
    is otherwise ignored): a count that no launch could use is bad usage, not
    something a collective should discover.

    Raises:
        UsageError: ``nprocs < minimum`` or ``nprocs > MAX_PROCESSES``.
    """
    if nprocs < minimum:
        raise UsageError(f"{flag} {nprocs}: the number of MPI processes to start must be at "
                         f"least {minimum}; give {flag} {minimum} or more")
    if nprocs > MAX_PROCESSES:
        raise UsageError(f"{flag} {nprocs}: refcoll starts at most {MAX_PROCESSES} processes "
                         "on this machine; start a larger job with your own mpiexec (and a "
                         "hostfile)")


# ------------------------------------------------------------------------------ memory

#: The memory ``simulate`` and ``gen-inputs`` may plan for where /proc/meminfo
#: (MemAvailable) cannot be read.
FALLBACK_MEMORY_CAP = 4 << 30

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


def require_memory(needed: int, what: str, advice: str) -> None:
    """Refuse a run whose estimated ``needed`` bytes exceed the memory it may use.

    Raises:
        UsageError: naming the estimate, the limit and where the limit comes from.
    """
    limit, source = available_memory()
    if needed > limit:
        raise UsageError(f"{what} needs about {human_bytes(needed, '.1f', binary=True)}, more "
                         f"than the {human_bytes(limit, '.1f', binary=True)} {source}; {advice}")


def require_disk(folder, needed: int, what: str, advice: str) -> None:
    """Refuse to write ``needed`` bytes into ``folder`` when its file system has less free.

    ``folder`` need not exist yet: its nearest existing parent's file system is asked.

    Raises:
        UsageError: naming the estimate, the free space and the folder.
    """
    place = os.path.abspath(folder)
    while not os.path.isdir(place) and os.path.dirname(place) != place:
        place = os.path.dirname(place)
    try:
        free = shutil.disk_usage(place).free
    except OSError:
        return  # a file system that cannot say: the writes themselves report a full disk
    if needed > free:
        raise UsageError(f"{what} needs about {human_bytes(needed, '.1f', binary=True)} of "
                         f"disk, more than the {human_bytes(free, '.1f', binary=True)} free "
                         f"where {folder} is; {advice}")


@contextlib.contextmanager
def out_of_memory_is_usage(what: str, advice: str):
    """Turn a MemoryError (the estimate was too low, or memory went) into a one-line exit 2."""
    try:
        yield
    except MemoryError as exc:
        detail = str(exc).strip() or "MemoryError"
        raise UsageError(f"{what} ran out of memory ({detail}); {advice}") from None


# ---------------------------------------------------------------------------- heartbeat

#: Seconds between "still running" notes of a long run on stderr.
HEARTBEAT_S = 10.0


@contextlib.contextmanager
def still_running(label: str, detail=None):
    """Note on stderr every :data:`HEARTBEAT_S` seconds that a long run is still going.

    Not :func:`click.progressbar`: the run is one library call whose progress
    cannot be counted from outside, so there is no fraction to draw, only the
    time gone, and what ``detail()`` says, if given (a simulation's ranks finished
    and messages matched: :func:`refcoll.transport.scheduler.progress_note`).
    """
    done = threading.Event()
    every = HEARTBEAT_S

    def beat() -> None:
        waited = 0.0
        while not done.wait(every):
            waited += every
            note = detail() if detail is not None else None
            click.echo(f"refcoll: {label}: still running after {waited:g} s"
                       + (f" ({note})" if note else ""), err=True)

    beater = threading.Thread(target=beat, name="refcoll-heartbeat", daemon=True)
    beater.start()
    try:
        yield
    finally:
        done.set()
        beater.join()
