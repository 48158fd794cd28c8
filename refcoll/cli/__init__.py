"""The ``refcoll`` command line: thin click commands over library calls.

Each command parses its options, calls one library function and prints what it
returns. The group and what the commands share are in :mod:`.common`; starting
MPI jobs is :mod:`.launch`'s; the commands register themselves on :data:`main`
when their modules are imported, which :data:`main` does for the command asked
for (:data:`~.common.COMMANDS`).

Exit codes: 0 success, 1 a check failed, 2 bad usage or environment (with a
one-line reason), 3 a collective timed out or a rank died (the launcher ended the
job: a killed rank is a fault, not a failed check); 141 when the reader of stdout
went away (``refcoll model ... | head``); 130 when Ctrl-C ended it.
"""

from __future__ import annotations

# Re-exported: tests patch ``refcoll.cli.subprocess.run`` to see what relaunch starts.
import subprocess  # noqa: F401

from .common import (
    BROKEN_PIPE,
    COMMANDS,
    check_output_paths,
    check_output_paths_on_lead,
    main,
    reports_errors,
    split_list,
    write_json,
)
from .launch import check_environment, relaunch

__all__ = ["main", "COMMANDS", "all_commands", "reports_errors", "check_output_paths",
           "check_output_paths_on_lead", "write_json", "split_list", "relaunch",
           "check_environment", "BROKEN_PIPE"]


def all_commands() -> dict:
    """Return every ``refcoll`` command, ``{name: click.Command}``, in the order ``--help``
    lists them (each command's module imported)."""
    return {name: main.get_command(None, name) for name in main.list_commands(None)}
