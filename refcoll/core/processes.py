"""How refcoll starts Python processes: never with the working directory on the import path.

``python -m refcoll`` and ``python -c CODE`` put the current folder first on ``sys.path``,
so a folder ``./refcoll/`` (or ``./mpi4py/``) planted where a user runs a command would be
imported in place of the installed package, as root too. Every process refcoll starts
(a relaunch under ``mpiexec``, the cluster's launcher stand-in, a probe) is started with
:func:`python`, which asks Python not to add it: ``-P`` on Python 3.11 and later, and on
3.10 a ``-c`` that drops it before running the module.

Example:
    >>> python("-m", "refcoll", "list")[1:3]  # doctest: +SKIP
    ['-P', '-m']
"""

from __future__ import annotations

import sys

__all__ = ["python"]

#: What ``python3.10 -c`` runs in place of ``-m MODULE``: drop the working folder, then
#: run the module as ``-m`` would.
_RUN_MODULE = ("import runpy, sys; sys.path.pop(0); module = sys.argv.pop(1); "
               "runpy.run_module(module, run_name='__main__', alter_sys=True)")


def python(*args: str, executable: str | None = None) -> list[str]:
    """Return the command line that runs this Python with ``args``, without the working folder.

    Args:
        args: Python's arguments, ``"-m", "refcoll", ...`` or ``"-c", CODE, ...``.
        executable: the interpreter (default: this one, ``sys.executable``).
    """
    exe = executable or sys.executable
    if sys.version_info >= (3, 11):
        return [exe, "-P", *args]
    if args[:1] == ("-m",):
        return [exe, "-c", _RUN_MODULE, *args[1:]]
    if args[:1] == ("-c",):
        return [exe, "-c", "import sys; sys.path.pop(0)\n" + args[1], *args[2:]]
    return [exe, *args]
