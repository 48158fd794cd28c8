"""The one reader of users' files and the one writer: what each refuses, and what it never does.

core.reading opens only regular files of a bounded size and parses JSON within bounds;
core.writing replaces a file whole and never writes through a link; core.processes starts
Python without the working folder on its import path. Each hostile input is built here; a
possible hang is bounded by an alarm, never by a timed assert.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest

import refcoll
from refcoll.calls import debug
from refcoll.cli.common import write_json as report_json
from refcoll.cli.launch import mpiexec_command
from refcoll.core import reading, writing
from refcoll.core.errors import UsageError
from refcoll.core.processes import python
from refcoll.transport.sim import SimWorld


@pytest.fixture
def deadline():
    """Fail the test, instead of hanging the suite, if it blocks for 10 s (a FIFO's open)."""
    def expire(*_):
        raise TimeoutError("blocked for 10 s")

    before = signal.signal(signal.SIGALRM, expire)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, before)


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "victim"
    path.write_text("root:x:0:0:root:/root:/bin/bash\n")
    return path


def one_line(exc) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


# --------------------------------------------------------------------------- reading

@pytest.mark.parametrize("make,said", [
    (lambda p: os.mkfifo(p), "is a FIFO (named pipe), not a regular file"),
    (lambda p: os.symlink("/dev/zero", p), "is a character device, not a regular file"),
    (lambda p: os.mkdir(p), "is a folder, not a regular file"),
    (lambda p: None, "the JSON file does not exist"),
])
def test_only_a_regular_file_is_read(tmp_path, deadline, make, said):
    path = tmp_path / "f.json"
    make(path)
    with pytest.raises(UsageError) as exc:
        reading.read_json(path)
    assert one_line(exc) == f"{path}: {said}" + ("" if "exist" in said
                                                  else "; give the JSON file as a file")


def test_a_file_over_the_bound_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "big.json"
    with open(path, "wb") as fh:
        fh.truncate(1 << 40)  # sparse: 1 TiB of nothing, no disk used
    with pytest.raises(UsageError) as exc:
        reading.read_json(path)
    assert one_line(exc) == (f"{path}: the JSON file holds {1 << 40} bytes, more than the "
                             f"{reading.MAX_JSON_BYTES} refcoll reads from one")


@pytest.mark.parametrize("text,said", [
    ("[" * 100_000 + "]" * 100_000, "nests deeper than the 64 levels"),
    ("[" * 65 + "]" * 65, "nests deeper than the 64 levels"),
    ('{"p": ' + "9" * 5000 + "}", "an integer of 5000 digits"),
    ('{"p": 12345678901234567890}', "an integer of 20 digits"),
    ('{"p": NaN}', "NaN is not a number refcoll accepts"),
    ('{"p": -Infinity}', "-Infinity is not a number refcoll accepts"),
    ('{"p": 1e400}', "1e400 is beyond the range of a float"),
    ('{"p": ', "not valid JSON (Expecting value"),
    ("", "is empty"),
])
def test_json_outside_the_bounds_is_one_line(tmp_path, text, said):
    path = tmp_path / "f.json"
    path.write_text(text)
    with pytest.raises(UsageError) as exc:
        reading.read_json(path)
    assert said in one_line(exc) and one_line(exc).startswith(f"{path}: ")


def test_json_within_the_bounds_is_read_as_is(tmp_path):
    value = {"p": 4, "rate": 1.5e9, "deep": [[[[1]]]] * 2, "big": 2**62, "name": "ring"}
    path = tmp_path / "f.json"
    path.write_text("\ufeff" + json.dumps(value))  # a byte-order mark is dropped
    assert reading.read_json(path) == value
    assert reading.loads_json("[" * 64 + "]" * 64, source="x") is not None


def test_the_depth_check_holds_one_iterator_a_level_not_one_entry_an_element():
    # A 16 MiB file of empty arrays ([[],[],...]: five million) once cost twice its
    # parse in the depth check's stack of every element; what it holds is allocations.
    import tracemalloc

    flat = [[] for _ in range(200_000)]
    tracemalloc.start()
    try:
        assert reading._depth(flat) == 2
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 10, peak  # the old stack: 200,000 tuples, about 15 MB
    assert reading._depth({"a": [1, {"b": [[]]}], "c": []}) == 5  # {[{[[
    assert reading._depth(7) == 0 and reading._depth({}) == 1


def test_text_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "f.txt"
    path.write_bytes(b"ok \xff\xfe")
    with pytest.raises(UsageError) as exc:
        reading.read_text(path)
    assert one_line(exc) == f"{path}: the file is not UTF-8 text (byte 3 is 0xff)"


@pytest.mark.parametrize("value,kw,said", [
    (float("nan"), {}, "must be a finite number, not nan"),
    (True, {}, "must be a finite number, not True"),
    ("5", {}, "must be a finite number, not '5'"),
    (4.0, {"integer": True}, "must be a whole number, not 4.0"),
    (0, {"above": 0}, "must be above 0, not 0"),
    (-1, {"least": 0}, "must be at least 0, not -1"),
    (10**30, {"most": 1e18}, "must be at most 1e+18"),
])
def test_a_number_out_of_range_names_where(value, kw, said):
    with pytest.raises(UsageError) as exc:
        reading.number(value, where="t.json: rate", **kw)
    assert one_line(exc).startswith("t.json: rate: " + said)


def test_a_number_in_range_is_returned():
    assert reading.number(3, where="x", integer=True, least=1, most=4) == 3
    assert reading.number(2.5, where="x", above=0) == 2.5


# --------------------------------------------------------------------------- writing

def test_a_link_at_the_target_is_replaced_never_written_through(tmp_path, victim):
    before = victim.read_bytes()
    link = tmp_path / "out.json"
    link.symlink_to(victim)
    writing.write_json(link, {"rows": []})
    assert victim.read_bytes() == before
    assert not link.is_symlink() and json.loads(link.read_text()) == {"rows": []}


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "f.npy"
    path.write_bytes(b"old")
    with pytest.raises(ValueError):
        writing.save_npy(path, np.array([object()]))  # allow_pickle=False refuses it
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["f.npy"]


def test_a_written_file_has_the_umasks_mode_or_the_one_asked(tmp_path):
    old = os.umask(0o022)
    try:
        writing.write_text(tmp_path / "a", "x")
        writing.write_text(tmp_path / "b", "x", mode=0o600)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "a").st_mode) == 0o644
    assert stat.S_IMODE(os.stat(tmp_path / "b").st_mode) == 0o600


def test_a_folder_or_a_missing_folder_is_one_line(tmp_path):
    with pytest.raises(UsageError, match="is a folder; give a file name"):
        writing.write_text(tmp_path, "x")
    with pytest.raises(UsageError, match="does not exist; create it first"):
        writing.write_text(tmp_path / "no" / "f", "x")


def test_remove_file_removes_the_link_not_its_target(tmp_path, victim):
    link = tmp_path / "rank3.npy"
    link.symlink_to(victim)
    writing.remove_file(link)
    assert not os.path.lexists(link) and victim.exists()
    with pytest.raises(UsageError, match="is a folder"):
        writing.remove_file(tmp_path)


def test_same_place_follows_links_and_dots(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "out").symlink_to(tmp_path / "in")
    assert writing.same_place(tmp_path / "out", f"{tmp_path}/in/./")
    assert not writing.same_place(tmp_path / "in", tmp_path)


def test_two_writers_under_the_lock_keep_both_entries(tmp_path):
    path = tmp_path / "cache.json"
    writing.write_json(path, {})

    def add(key):
        for i in range(20):
            with writing.locked(path):
                data = reading.read_json(path)
                data[f"{key}{i}"] = i
                writing.write_json(path, data)

    threads = [threading.Thread(target=add, args=(k,)) for k in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(reading.read_json(path)) == 40


def test_a_lock_held_elsewhere_is_not_waited_for_and_the_cache_goes_unsaved(tmp_path,
                                                                             monkeypatch):
    """A process that held the calibration cache's lock (a stopped job, a hostile one) kept
    every later job's rank 0 waiting in flock, and its peers timed out in its first call."""
    import fcntl

    from refcoll.calls import calibration

    monkeypatch.setenv("REFCOLL_CACHE", str(tmp_path))
    monkeypatch.setattr(writing, "LOCK_WAIT", 0.2)
    path = calibration.cache_path()
    holder = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        with pytest.raises(UsageError, match="locked by another process"):
            with writing.locked(path):
                pass
        why = calibration._save("host|lib|ranks_per_node=2|oversubscribed=no",
                                calibration.DEFAULT)
        assert why is not None and "could not be written" in why and "locked" in why
    finally:
        os.close(holder)
    assert calibration._save("host|lib|ranks_per_node=2|oversubscribed=no",
                             calibration.DEFAULT) is None  # released: saved


def test_the_json_report_replaces_a_planted_link(tmp_path, victim):
    before = victim.read_bytes()
    (tmp_path / "report.json").symlink_to(victim)
    report_json(str(tmp_path / "report.json"), {"ok": 1})
    assert victim.read_bytes() == before
    assert json.loads((tmp_path / "report.json").read_text()) == {"ok": 1}


def test_the_trace_file_is_never_opened_through_a_link(tmp_path, victim, monkeypatch, capfd):
    before = victim.read_bytes()
    (tmp_path / "trace.0").symlink_to(victim)
    monkeypatch.setenv("REFCOLL_DEBUG", "INFO")
    monkeypatch.setenv("REFCOLL_DEBUG_FILE", str(tmp_path / "trace.%r"))
    debug.reset()
    try:
        SimWorld(1).run(lambda t, x: debug.traced(
            t, "allreduce", debug.call_fields(x, op="sum", algorithm="ring", validate=False),
            lambda: refcoll.allreduce(x, t, algorithm="ring", validate=False)),
            [(np.ones(4, np.float32),)])
    finally:
        monkeypatch.delenv("REFCOLL_DEBUG")
        debug.reset()
    err = capfd.readouterr().err
    assert victim.read_bytes() == before
    assert "cannot open" in err and "algorithm ring" in err  # the line went to stderr instead


# ------------------------------------------------------------------ starting Python

def test_python_never_imports_a_package_planted_in_the_working_folder(tmp_path):
    planted = tmp_path / "refcoll"
    planted.mkdir()
    marker = tmp_path / "planted-ran"
    for name in ("__init__.py", "__main__.py"):
        (planted / name).write_text(f"open({str(marker)!r}, 'w').close()\n")
    done = subprocess.run(python("-m", "refcoll", "--version"), cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "version" in done.stdout, done.stderr
    assert not marker.exists()
    probe = subprocess.run(python("-c", "import refcoll; print(refcoll.__file__)"),
                           cwd=tmp_path, capture_output=True, text=True, timeout=120)
    # the installed package (or, in a checkout, the source tree), never the planted one
    assert probe.returncode == 0 and not marker.exists()
    assert Path(probe.stdout.strip()).name == "__init__.py"
    assert not Path(probe.stdout.strip()).is_relative_to(tmp_path)


def test_mpiexec_runs_refcoll_through_that_python():
    argv = mpiexec_command(2, ["verify"], mpiexec="mpiexec")
    assert argv[-4:] == python("-m", "refcoll", "verify")[-4:]
    assert argv[argv.index("2") + 1:] == python("-m", "refcoll", "verify")


# ------------------------------------------------------------------ the one way in and out

#: Calls that open, read or write a file by name; only core.reading and core.writing make them.
_FILE_CALLS = re.compile(r"json\.load\(|np\.load\(|(?<!reading)\.read_text\("
                         r"|(?<!reading)\.read_bytes\(|(?<![\w.])open\(|(?<!writing)\.write_text\("
                         r"|(?<!writing)\.write_bytes\(|np\.save\(|savefig\(|os\.open\(")

#: Where else a file is opened: the kernel's own (/proc), the null device, the trace file that
#: grows as the job runs (opened without following a link), an archive's member.
_ALLOWED = ("/proc", "_MEMINFO", "os.devnull", "_open_trace", "archive.open", "flags, 0o666")


def test_no_module_opens_a_file_but_the_reader_and_the_writer():
    package = Path(refcoll.__file__).parent
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.parent.name == "core" and path.name in ("reading.py", "writing.py", "plot.py"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if _FILE_CALLS.search(code) and not any(word in line for word in _ALLOWED):
                found.append(f"{path.relative_to(package.parent)}:{number}: {line.strip()}")
    assert not found, "files opened outside core.reading and core.writing:\n" + "\n".join(found)
