"""refcoll bench on a terminal, its refusals before any work, and the deadlines of its MPI calls.

The table and the progress bar are checked through :class:`refcoll.bench.TableWriter`
over recording streams (no real terminal): every write is logged, in order, and a
small terminal model replays the log to show what a user would see. Where the bar
goes is checked on pseudo-terminals (``os.openpty``). The deadlines are checked with
communicators that never complete, so a missing rank is a
:class:`~refcoll.core.errors.CollectiveTimeout` naming the point, not a hang.
"""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import mpiexec_path

from refcoll.bench import (
    BenchConfig,
    Replay,
    TableWriter,
    _Groups,
    _Item,
    _reduce_items,
    bar_target,
)
from refcoll.cli import main
from refcoll.core.errors import CollectiveTimeout

needs_mpi = pytest.mark.skipif(mpiexec_path() is None,
                               reason="no mpiexec: install with pip install 'refcoll[mpi]'")

FLUSH = object()  # marks a flush in the log

ROWS = [f"  {1024 << (2 * k):>10}  row {k}" for k in range(4)]


class _Stream:
    """A write-only stream that logs ``(name, text)`` (and ``(name, FLUSH)``) to a shared list."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def write(self, text: str) -> int:
        self.log.append((self.name, text))
        return len(text)

    def flush(self) -> None:
        self.log.append((self.name, FLUSH))


def _streams():
    log: list = []
    return _Stream("out", log), _Stream("err", log), log


def _sweep(writer: TableWriter, bars_per_row: int = 3) -> None:
    """Write what ``_bench_in_world`` writes: header, bars and rows in turn, the footer."""
    writer.line("# header")
    total = bars_per_row * len(ROWS)
    for k, row in enumerate(ROWS):
        for j in range(bars_per_row):
            writer.progress(k * bars_per_row + j + 1, total, 1024 << (2 * k))
        writer.line(row)
    writer.clear()
    writer.line("# footer")


def _render(texts) -> list[str]:
    """Return the lines a terminal shows for ``texts`` (``\\r`` returns, ``\\n`` ends a line)."""
    lines, line, col = [], [], 0
    for ch in "".join(texts):
        if ch == "\r":
            col = 0
        elif ch == "\n":
            lines.append("".join(line).rstrip())
            line, col = [], 0
        else:
            line[col:col + 1] = [ch]
            col += 1
    lines.append("".join(line).rstrip())
    return lines


def _texts(log, names=("out", "err")) -> list[str]:
    return [text for name, text in log if name in names and text is not FLUSH]


def test_every_bar_is_erased_and_flushed_before_each_row_is_written():
    out, err, log = _streams()
    _sweep(TableWriter(out, err, tty=True, min_interval=0))
    assert any(name == "err" and "[#" in str(text) for name, text in log), "no bar was drawn"
    bar_on_line = False
    for j, (name, text) in enumerate(log):
        if text is FLUSH:
            continue
        if name == "err":
            # A draw leaves a bar on the line; an erasure ends with a return to column 0.
            bar_on_line = not (text.strip() == "" and text.endswith("\r"))
            continue
        # A row: no bar stands, and the erasure was flushed before the row was written.
        assert not bar_on_line, (j, text)
        last_err = max((i for i in range(j) if log[i][0] == "err"), default=None)
        if last_err is not None:
            assert log[last_err][1] is FLUSH, (j, log[last_err])
        assert log[j + 1] == ("out", FLUSH), "every row is flushed at once"


def test_no_row_ever_shares_a_line_with_a_bar():
    out, err, log = _streams()
    _sweep(TableWriter(out, err, tty=True, min_interval=0))
    # The writes in the order made, as one terminal receives them when both streams go there.
    shown = _render(_texts(log))
    assert shown == ["# header", *ROWS, "# footer", ""]


def test_on_one_terminal_the_bar_travels_down_the_rows_stream():
    # mpiexec forwards a rank's stdout and stderr on separate pipes, which may reach the
    # terminal in either order: on a shared terminal nothing but the rows' stream is used,
    # so the order written is the order shown.
    out, err, log = _streams()
    _sweep(TableWriter(out, err, tty=True, shared=True, min_interval=0))
    assert [name for name, _ in log if name == "err"] == []
    assert any("[#" in text for text in _texts(log, ["out"]))
    assert _render(_texts(log, ["out"])) == ["# header", *ROWS, "# footer", ""]


def test_stdout_elsewhere_gets_the_rows_alone():
    out, err, log = _streams()
    _sweep(TableWriter(out, err, tty=True, shared=False, min_interval=0))
    assert "".join(_texts(log, ["out"])) == "\n".join(["# header", *ROWS, "# footer"]) + "\n"
    assert _render(_texts(log, ["err"])) == [""], "the bar erases itself on its own terminal"


def test_without_a_terminal_no_bar_is_drawn():
    out, err, log = _streams()
    _sweep(TableWriter(out, err, tty=False, min_interval=0))
    assert _texts(log, ["err"]) == []
    assert "".join(_texts(log)) == "\n".join(["# header", *ROWS, "# footer"]) + "\n"


def test_the_bar_fits_the_terminal_and_a_redraw_covers_a_longer_one():
    out, err, log = _streams()
    writer = TableWriter(out, err, tty=True, width=40, min_interval=0)
    writer.progress(1, 1000, 1 << 30)
    assert _render(_texts(log)) == ["[" + "." * 30 + "] 1/1000"]  # 39 columns: never wraps
    out, err, log = _streams()
    writer = TableWriter(out, err, tty=True, width=80, min_interval=0)
    writer.progress(999, 1000, 1 << 30)
    writer.progress(1000, 1000, 8)  # a shorter text than the bar before it
    assert _render(_texts(log)) == ["[" + "#" * 30 + "] 1000/1000 iterations, at 8 B"]
    writer.line("row")
    assert _render(_texts(log)) == ["row", ""]


def test_the_bar_is_redrawn_at_most_once_per_interval():
    now = [0.0]
    out, err, log = _streams()
    writer = TableWriter(out, err, tty=True, min_interval=0.1, clock=lambda: now[0])
    for k in range(50):
        now[0] = k * 0.01  # 100 calls a second
        writer.progress(k + 1, 50, 8)
    draws = [t for t in _texts(log, ["err"]) if "[" in t]
    assert len(draws) == 5


# ------------------------------------------------------------ where the bar goes

needs_pty = pytest.mark.skipif(not hasattr(os, "openpty"), reason="no pseudo-terminals here")


def _pty(columns: int = 0):
    import fcntl
    import struct
    import termios

    master, slave = os.openpty()
    if columns:
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    return master, slave


@needs_pty
def test_one_terminal_on_both_streams_puts_the_bar_on_stdout():
    master, slave = _pty(columns=123)
    other = os.dup(slave)  # as a shell gives a command: 1 and 2 the same terminal
    try:
        assert bar_target(slave, other) == ("stdout", 123)
    finally:
        for fd in (master, slave, other):
            os.close(fd)


@needs_pty
def test_the_bar_stays_on_stderr_unless_stdout_is_that_terminal():
    m1, tty1 = _pty(columns=90)
    m2, tty2 = _pty(columns=70)
    read, write = os.pipe()
    try:
        assert bar_target(tty1, tty2) == ("stderr", 70)  # two terminals
        assert bar_target(write, tty2) == ("stderr", 70)  # stdout to a pipe or file
        assert bar_target(tty1, write) is None  # stderr not a terminal: no bar
        assert bar_target(write, write) is None
        m3, tty3 = _pty()  # a terminal that reports no size
        assert bar_target(write, tty3) == ("stderr", 80)
        os.close(m3), os.close(tty3)
    finally:
        for fd in (m1, tty1, m2, tty2, read, write):
            os.close(fd)


@pytest.mark.parametrize("setting,where", [("stdout:100", "out"), ("stderr:100", "err"),
                                           ("", None)])
def test_rank_0_draws_where_the_launcher_saw_the_terminal(monkeypatch, capsys, setting, where):
    from refcoll.cli.bench import _writer

    monkeypatch.setenv("REFCOLL_BENCH_BAR", setting)
    writer = _writer()
    writer.progress(1, 2, 8)
    writer.line("row")
    got = capsys.readouterr()
    shown = {"out": got.out, "err": got.err}
    for name, text in shown.items():
        assert ("[#" in text) == (name == where), shown
    assert _render([got.out]) == ["row", ""]


# ----------------------------------------------------------- refused before any run

@pytest.mark.parametrize("option", ["--json", "--csv", "--plot"])
def test_an_output_in_a_missing_folder_is_refused_before_mpiexec(monkeypatch, tmp_path, option):
    import refcoll.cli as cli

    def never(*args, **kwargs):
        raise AssertionError("mpiexec was started")

    monkeypatch.setattr(cli.subprocess, "run", never)
    monkeypatch.setattr("refcoll.cli.launch.in_mpi_job", lambda: False)
    path = tmp_path / "missing" / "out.file"
    res = CliRunner().invoke(main, ["bench", "-n", "2", option, str(path)])
    assert res.exit_code == 2, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and option in lines[0] and "does not exist" in lines[0], res.output
    assert "Traceback" not in res.output and not isinstance(res.exception, AssertionError)


@needs_mpi
def test_inside_an_mpi_job_rank_0_refuses_a_missing_folder_for_every_rank(tmp_path):
    path = tmp_path / "missing" / "bench.json"
    res = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, "-m", "refcoll", "bench",
                          "-b", "8", "-e", "8", "-i", "1", "-w", "0", "--json", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--json" in lines[0], res.stderr
    assert res.stdout == ""


# ------------------------------------------------------------------ the deadlines

class _Never:
    """A request that never completes: a rank that never comes."""

    def Test(self):
        return False

    def Wait(self):
        raise AssertionError("an unbounded wait")


class _Stuck:
    """A communicator of two ranks whose nonblocking collectives never complete.

    Its blocking calls fail the test: bench must never reach one while a rank is missing.
    """

    rank, size = 0, 2

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 2

    def Ibarrier(self):
        return _Never()

    def Idup(self):
        return object(), _Never()

    def Iallreduce(self, *args, **kwargs):
        return _Never()

    def Iallgather(self, *args, **kwargs):
        return _Never()

    def __getattr__(self, name):  # Barrier, Split, Allreduce, Dup, bcast...
        raise AssertionError(f"blocking MPI call {name} reached with a rank missing")


def test_a_missing_participant_times_out_before_the_timed_call():
    called = []
    item = _Item("base", "MPI_Allreduce", _Stuck(), lambda: called.append(1),
                 what="refcoll bench (before MPI_Allreduce at 8 B)", timeout=0.05)
    with pytest.raises(CollectiveTimeout, match=r"rank 0: refcoll bench \(before MPI_Allreduce "
                                                r"at 8 B\) timed out after 0.05 s"):
        item.run(timed=True, check=False)
    assert called == []  # the library's collective, which has no deadline, never ran


def test_the_split_of_the_participants_waits_by_the_deadline():
    with pytest.raises(CollectiveTimeout, match="MPI_Comm_split"):
        _Groups(_Stuck(), BenchConfig(algorithms=("ring",)), timeout=0.05)


def test_the_results_are_reduced_by_the_deadline():
    item = _Item("ours", "ring", None, None)
    item.times = [1.0]
    with pytest.raises(CollectiveTimeout, match="gathering the timings.*MPI_Iallgather over 2"):
        _reduce_items(_Stuck(), [item], timeout=0.05)


def test_the_bounds_communicator_is_duplicated_by_the_deadline():
    pytest.importorskip("mpi4py")
    with pytest.raises(CollectiveTimeout, match="MPI_Comm_idup"):
        Replay(_Stuck(), [], np.float32, "sum", timeout=0.05)


@needs_mpi
def test_a_rank_that_never_comes_ends_the_run_with_a_message(tmp_path):
    script = tmp_path / "missing_rank.py"
    script.write_text(textwrap.dedent("""
        import time
        from mpi4py import MPI
        from refcoll.bench import BenchConfig, run_bench

        if MPI.COMM_WORLD.rank == 0:
            run_bench(MPI.COMM_WORLD, BenchConfig(sizes=[8], algorithms=["ring"], iters=1))
        else:
            time.sleep(30)  # never comes to the benchmark
    """))
    env = {**os.environ, "REFCOLL_TIMEOUT": "1", "REFCOLL_ABORT_ON_TIMEOUT": "1"}
    res = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, str(script)], env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
    assert "rank 0: refcoll bench (MPI_Comm_split of the first 2 ranks) timed out after 1 s" \
        in res.stderr, res.stderr
