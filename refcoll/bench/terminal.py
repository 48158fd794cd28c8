"""Where rank 0 prints ``refcoll bench``'s table, and the progress bar drawn between its lines.

:func:`bar_target` says where a bar may go, in the process that sees the terminal
(the one that starts ``mpiexec``); :func:`progress_setting` passes that to the ranks
through :data:`PROGRESS_VARIABLE`, and :func:`rank_writer` gives rank 0 its
:class:`TableWriter` from it.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Mapping

__all__ = ["PROGRESS_VARIABLE", "bar_target", "progress_setting", "rank_writer", "TableWriter"]

#: Set by the launching process when its stderr is a terminal (mpiexec's ranks see pipes):
#: ``stdout:COLUMNS`` (stdout is that terminal too: draw the bar there) or ``stderr:COLUMNS``.
PROGRESS_VARIABLE = "REFCOLL_BENCH_BAR"


def bar_target(out_fd: int = 1, err_fd: int = 2) -> tuple[str, int] | None:
    """Return where a progress bar may be drawn, ``("stdout" | "stderr", columns)``, or None.

    A bar is drawn only when stderr is a terminal. When stdout is that same
    terminal (``os.path.samestat`` of the two descriptors) the bar goes to
    ``"stdout"``, the stream that carries the table: see :class:`TableWriter`
    for why. ``columns`` is that terminal's width (80 when it reports none).
    Call it where the terminal is, in the process that starts ``mpiexec``:
    the ranks' streams are pipes to the launcher.
    """
    if not os.isatty(err_fd):
        return None
    shared = os.isatty(out_fd) and os.path.samestat(os.fstat(out_fd), os.fstat(err_fd))
    fd = out_fd if shared else err_fd
    try:
        columns = os.get_terminal_size(fd).columns
    except OSError:
        columns = 0
    return ("stdout" if shared else "stderr"), columns or 80


class TableWriter:
    """Rank 0's report: the table's lines on ``out``, and a progress bar between them.

    One process writes both, in one thread, and erases the bar before every
    line of the table, so no row is written while a bar stands on the line.
    That is not enough by itself: under ``mpiexec`` a rank's stdout and stderr
    are two pipes, which the launcher reads as data comes and copies to its own
    stdout and stderr, so bytes flushed to stderr before a row was flushed to
    stdout can still reach the terminal after it (a row glued to a bar, then
    erased). Order holds only within one stream. So when stdout and stderr are
    the same terminal (``shared``, from :func:`bar_target`) the bar is drawn on
    ``out`` itself: bar, erasure and row travel down one pipe and arrive in the
    order written. Otherwise the bar is on stderr and the rows go to a file, a
    pipe or another terminal: they never share a line with it. Either way the
    bar's stream is flushed after each erasure, before the row is written, and
    ``out`` after each row. The bar is erased by overwriting it with spaces
    (it never wraps: it is cut to the terminal's width), which every terminal
    understands.

    Args:
        out: the table's stream (stdout).
        err: the bar's stream when it is not ``out`` (stderr).
        tty: whether the bar's stream is a terminal; without one no bar is drawn.
        shared: ``out`` and ``err`` are the same terminal: draw the bar on ``out``.
        width: the terminal's columns.
        min_interval: seconds between two redraws of the bar (a sweep of small
            sizes would otherwise redraw it thousands of times a second).
        clock: the time source of ``min_interval`` (seconds).
    """

    BAR = 30

    def __init__(self, out, err, *, tty: bool, shared: bool = False, width: int = 80,
                 min_interval: float = 0.1, clock: Callable[[], float] = time.monotonic) -> None:
        self._out = out
        self._bar = (out if shared else err) if tty else None
        self._width = max(width - 1, 1)  # the last column would wrap on some terminals
        self._min_interval = min_interval
        self._clock = clock
        self._drawn = 0  # characters of the bar now on the line (0: none)
        self._last = None

    def line(self, text: str) -> None:
        """Erase the bar, then write ``text`` and a newline to ``out``; flush both."""
        self.clear()
        self._out.write(text + "\n")
        self._out.flush()

    def progress(self, done: int, total: int, nbytes: int) -> None:
        """Redraw the bar (at most once per ``min_interval``): ``run_bench``'s ``progress``."""
        if self._bar is None:
            return
        now = self._clock()
        if self._last is not None and now - self._last < self._min_interval:
            return
        self._last = now
        filled = self.BAR * done // max(total, 1)
        text = (f"[{'#' * filled}{'.' * (self.BAR - filled)}] {done}/{total} iterations, "
                f"at {nbytes} B")[:self._width]
        self._bar.write("\r" + text.ljust(self._drawn))  # covers a longer bar before it
        self._bar.flush()
        self._drawn = max(self._drawn, len(text))

    __call__ = progress

    def clear(self) -> None:
        """Erase the bar, if one is drawn, and flush its stream."""
        if self._drawn:
            self._bar.write("\r" + " " * self._drawn + "\r")
            self._bar.flush()
            self._drawn = 0


def progress_setting(target: tuple[str, int] | None) -> str:
    """Return :func:`bar_target`'s answer as :data:`PROGRESS_VARIABLE` carries it to the ranks."""
    return "%s:%d" % target if target is not None else ""


def rank_writer(out, err, environ: Mapping[str, str] = os.environ) -> "TableWriter":
    """Return rank 0's :class:`TableWriter` over the streams ``out`` and ``err``.

    Where the bar goes was decided by the launching process, which sees the
    terminal (:data:`PROGRESS_VARIABLE` in ``environ``; empty: no bar); started by
    a user's ``mpiexec``, this process looks at its own streams (terminals under
    ``srun --pty``, else pipes: no bar).
    """
    setting = environ.get(PROGRESS_VARIABLE)
    target = None
    if setting:
        where, _, columns = setting.partition(":")
        if where in ("stdout", "stderr"):
            target = where, int(columns) if columns.isascii() and columns.isdigit() else 80
    elif PROGRESS_VARIABLE not in environ:
        try:
            target = bar_target(out.fileno(), err.fileno())
        except (OSError, ValueError):  # streams without a descriptor
            target = None
    if target is None:
        return TableWriter(out, err, tty=False)
    return TableWriter(out, err, tty=True, shared=target[0] == "stdout", width=target[1])
