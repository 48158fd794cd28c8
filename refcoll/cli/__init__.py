"""The ``refcoll`` command line: thin click commands over library calls.

Exit codes: 0 success, 1 a check failed, 2 bad usage or environment (with a
one-line reason), 3 a collective timed out.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import click

from ..errors import CollectiveTimeout, RefcollError, UsageError

__all__ = ["main"]


def _fail(message: str, code: int) -> None:
    click.echo(f"refcoll: error: {message}", err=True)
    sys.exit(code)


def _abort_job(code: int) -> None:
    """Exit with ``code``, ending every rank of the MPI job so none is left waiting."""
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized() \
            and mpi.COMM_WORLD.Get_size() > 1:
        mpi.COMM_WORLD.Abort(code)
    sys.exit(code)


def reports_errors(fn):
    """Turn refcoll's exceptions into one-line messages and the documented exit codes."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UsageError as exc:
            _fail(str(exc), 2)
        except CollectiveTimeout as exc:
            click.echo(f"refcoll: error: {exc}", err=True)
            _abort_job(3)
        except RefcollError as exc:
            _fail(str(exc), 1)
        except OSError as exc:  # a --json path that cannot be written, a missing file
            _fail(f"{exc.strerror or exc}: {exc.filename}" if exc.filename else str(exc), 2)
    return wrapper


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


def relaunch(nprocs: int, env: dict | None = None) -> None:
    """Re-run this very command under ``mpiexec -n nprocs`` and exit with its status."""
    import os

    from ..launch import mpiexec_command

    cmd = mpiexec_command(nprocs, _invoked_args)
    try:
        code = subprocess.run(cmd, env={**os.environ, **(env or {})}).returncode
    except OSError as exc:
        raise UsageError(f"could not start {cmd[0]}: {exc}") from None
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
from . import bench, model, train  # noqa: E402,F401
