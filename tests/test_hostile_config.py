"""Hostile configuration files and variables: each is refused in one line (exit 2), in bounded time.

The files a user points refcoll at (``REFCOLL_TUNING_FILE``, ``refcoll tune``'s bench
reports, ``model --layers`` and ``--from-calibration``) and the calibration cache are
read through :mod:`refcoll.core.reading`; a device, a FIFO, JSON that is not finite or
nests too deep, and a field that is not what the file's kind says are refused with one
line naming the file. A corrupt cache is refcoll's own file: it is said once and
ignored. ``REFCOLL_TIMEOUT`` beyond what a wait can hold means wait for ever. Every
test runs under an alarm, so a hang fails it instead of the suite.
"""

from __future__ import annotations

import json
import os
import platform
import re
import resource
import signal
import stat
import subprocess
import sys
import threading

import pytest
from click.testing import CliRunner
from conftest import mpiexec_path, run_script

from refcoll.calls import calibration, tuned
from refcoll.cli import main
from refcoll.core.calibration import Calibration
from refcoll.core.errors import UsageError
from refcoll.transport import SimWorld
from refcoll.transport.base import default_timeout

#: Seconds any one test may take before its alarm fails it (a FIFO read that blocks).
BOUND = 20

#: A character device that reads as endless bytes is tried in a process of its own, whose
#: memory this bounds (a reader that swallowed it would fail there, not take the machine);
#: in this process the device tried is ``/dev/null``, which no reader can be hurt by.
ENDLESS_LIMIT = 1536 << 20


class _Hung(Exception):
    pass


@pytest.fixture(autouse=True)
def bounded():
    """Fail a test that runs past :data:`BOUND` seconds (a read that hangs), not the suite."""
    def ring(signum, frame):
        raise _Hung(f"still running after {BOUND} s: a read that hangs")

    old = signal.signal(signal.SIGALRM, ring)
    signal.alarm(BOUND)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("REFCOLL_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(tuned.TUNING_ENV, raising=False)
    monkeypatch.delenv("REFCOLL_CALIBRATION", raising=False)
    calibration._WARNED.clear()


def invoke(*args, env=None):
    return CliRunner().invoke(main, [str(a) for a in args], env=env)


def refused(res, *said: str) -> str:
    """Assert exit 2 with one line ``refcoll: error: ...`` holding ``said``; return the line."""
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("refcoll: error: "), res.stderr
    assert "Traceback" not in res.output
    for text in said:
        assert text in lines[0], (text, lines[0])
    return lines[0]


def fifo(path):
    os.mkfifo(path)
    return path


# ------------------------------------------------------------------ the tuning file

#: Tuning files that are not what ``refcoll tune`` writes, and what the refusal says.
GOOD_RULE = {"bytes": 64, "algorithm": "ring", "time_us": 1.0}
TUNING = [
    ('{"tables": [{"collective": "allreduce", "ranks": 2, "rules": [{"bytes": 1e400, '
     '"algorithm": "ring"}]}]}', "beyond the range of a float"),
    ('{"tables": [{"collective": "allreduce", "ranks": 2, "rules": [{"bytes": 1' + "0" * 400
     + ', "algorithm": "ring"}]}]}', "an integer of 401 digits"),
    ('{"tables": [{"collective": "allreduce", "ranks": 2, "rules": [{"bytes": 64, '
     '"algorithm": "ring", "time_us": NaN}]}]}', "NaN is not a number"),
    (json.dumps({"tables": [{"collective": "allreduce", "ranks": 2, "rules": ["ring"]}]}),
     "rules[0]: a rule must be an object"),
    (json.dumps({"tables": [{"collective": "allreduce", "ranks": -2, "rules": [GOOD_RULE]}]}),
     "tables[0].ranks: must be at least 1"),
    (json.dumps({"tables": [{"collective": "allreduce", "ranks": 2, "rules": [
        {"bytes": 64.5, "algorithm": "ring"}]}]}), "bytes: must be a whole number"),
    (json.dumps({"tables": [{"collective": "allreduce", "ranks": 2, "rules": [
        {"bytes": 1 << 63, "algorithm": "ring"}]}]}), "bytes: must be at most"),
    (json.dumps({"tables": {"allreduce": 1}}), "tables: must be a list"),
    ("[" * 100 + "]" * 100, "nests deeper than the 64 levels"),
    ("", "not valid JSON"),
]


@pytest.mark.parametrize("text,said", TUNING)
def test_a_tuning_file_out_of_bounds_is_one_line(tmp_path, text, said):
    path = tmp_path / "t.json"
    path.write_text(text)
    res = invoke("simulate", "--algorithm", "auto", "-p", "2", "--count", "4",
                 env={tuned.TUNING_ENV: str(path)})
    refused(res, said, str(path), tuned.TUNING_ENV)


def test_a_tuning_file_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "t.json"
    path.write_bytes(b"\xff\xfe{}")
    res = invoke("simulate", "--algorithm", "auto", "-p", "2", "--count", "4",
                 env={tuned.TUNING_ENV: str(path)})
    refused(res, "is not UTF-8 text (byte 0 is 0xff)")


@pytest.mark.parametrize("kind", ["/dev/null", "fifo", "folder"])
def test_a_tuning_file_that_is_not_a_file_is_refused_at_once(tmp_path, kind):
    path = {"/dev/null": "/dev/null", "fifo": fifo(tmp_path / "pipe"),
            "folder": tmp_path}[kind]
    res = invoke("simulate", "--algorithm", "auto", "-p", "2", "--count", "4",
                 env={tuned.TUNING_ENV: str(path)})
    what = {"/dev/null": "is a character device", "fifo": "is a FIFO (named pipe)",
            "folder": "is a folder"}[kind]
    refused(res, f"{path}: {what}, not a regular file", tuned.TUNING_ENV)


def _bounded_memory():
    resource.setrlimit(resource.RLIMIT_AS, (ENDLESS_LIMIT, ENDLESS_LIMIT))


def test_dev_zero_as_the_tuning_file_is_refused_before_a_byte_is_read(tmp_path):
    env = {**os.environ, tuned.TUNING_ENV: "/dev/zero", "REFCOLL_CACHE": str(tmp_path)}
    res = subprocess.run([sys.executable, "-m", "refcoll", "simulate", "--algorithm", "auto",
                          "-p", "2", "--count", "4"], env=env, capture_output=True, text=True,
                         timeout=BOUND, preexec_fn=_bounded_memory)
    assert res.returncode == 2 and res.stderr.splitlines() == [
        "refcoll: error: /dev/zero: is a character device, not a regular file; give the "
        "tuning file (REFCOLL_TUNING_FILE) as a file"], res.stderr


@pytest.mark.parametrize("path,said", [("/dev/null", "is a character device"),
                                       ("missing", "does not exist")])
def test_every_rank_gets_rank_0s_refusal_of_the_tuning_file(tmp_path, path, said):
    """Rank 0 reads and broadcasts ``{"error": ...}``: each rank raises the same reason."""
    path = path if path.startswith("/") else str(tmp_path / path)

    def body(t):
        try:
            tuned.agreed_tuning(t, path)
        except UsageError as exc:
            return str(exc)
        return None

    said_by = SimWorld(3).run(body)
    assert [s.split(": ", 1)[0] for s in said_by] == ["rank 0", "rank 1", "rank 2"]
    assert len({s.split(": ", 1)[1] for s in said_by}) == 1 and said in said_by[0]


# --------------------------------------------------------------------- refcoll tune

HEADER = {"collective": "allreduce", "workers": 2, "dtype": "float32",
          "ranks": [{"host": "a"}, {"host": "a"}]}
ROWS = [{"algorithm": "ring", "size": 1024, "time_us": 5.0, "wrong": 0},
        {"algorithm": "naive", "size": 1024, "time_us": 7.0, "wrong": 0}]


def report(rows=ROWS, **header):
    return json.dumps({"header": {**HEADER, **header}, "rows": rows})


REPORTS = [
    (report([5, "x"]), "rows[0]: a row must be an object"),
    (report([{"size": 1024, "time_us": 5.0}]), "rows[0]: the row lacks algorithm"),
    (report([{"algorithm": "ring", "time_us": 5.0}]), "rows[0]: the row lacks size"),
    (report([{"algorithm": "ring", "size": 1, "time_us": 5.0}]).replace(
        '"size": 1,', '"size": 1' + "0" * 400 + ","), "an integer of 401 digits"),
    (report([{"algorithm": "ring", "size": 1e300, "time_us": 5.0}]),
     "rows[0].size: must be a whole number"),
    (report([{"algorithm": "ring", "size": True, "time_us": 5.0}]),
     "rows[0].size: must be a whole number, not True"),
    (report([{"algorithm": "ring", "size": 1024, "time_us": -5.0}]),
     "rows[0].time_us: must be at least 0"),
    (report([{"algorithm": ["ring"], "size": 1024, "time_us": 5.0}]),
     "rows[0].algorithm: must be a name"),
    (report([{"algorithm": "ring", "size": 1024, "time_us": float("inf")}]),
     "Infinity is not a number"),
    (report(workers=5), "header.workers: must be at most 2"),
    (report(ranks=[{"host": 3}, {}]), "header.ranks[0].host: must be a name"),
    (report(ranks=[]), "header.ranks is empty"),
    (json.dumps([1, 2]), "the report must be an object"),
    (json.dumps({"rows": []}), "it lacks header"),
]


@pytest.mark.parametrize("text,said", REPORTS)
def test_tune_refuses_a_report_bench_did_not_write_and_writes_nothing(tmp_path, text, said):
    (tmp_path / "b.json").write_text(text)
    res = invoke("tune", tmp_path / "b.json", "-o", tmp_path / "t.json")
    refused(res, said, "b.json")
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("kind", ["/dev/null", "fifo"])
def test_tune_refuses_a_report_that_is_not_a_file(tmp_path, kind):
    path = "/dev/null" if kind == "/dev/null" else fifo(tmp_path / "pipe")
    res = invoke("tune", path, "-o", tmp_path / "t.json")
    refused(res, "not a regular file; give the bench report as a file")
    assert not (tmp_path / "t.json").exists()


def test_tune_replaces_a_link_and_refuses_a_fifo_as_its_output(tmp_path):
    (tmp_path / "b.json").write_text(report())
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "link").symlink_to(victim)
    res = invoke("tune", tmp_path / "b.json", "-o", tmp_path / "link")
    assert res.exit_code == 0, res.output
    assert victim.read_text() == "keep" and not (tmp_path / "link").is_symlink()
    assert tuned.read(str(tmp_path / "link")).tables[0].rules[0].algorithm == "ring"
    out = fifo(tmp_path / "out")
    refused(invoke("tune", tmp_path / "b.json", "-o", out), "--output", "is not a regular file")
    assert stat.S_ISFIFO(os.lstat(out).st_mode)


# ------------------------------------------------------------------- refcoll model

MODEL = ("model", "--preset", "seed", "--no-search")


@pytest.mark.parametrize("data,said", [
    (b"[[2, 3], \xff]", "is not UTF-8 text (byte 9 is 0xff)"),
    (b"[[2, NaN]]", "NaN is not a number"),
    (b"[[2, 1e400]]", "beyond the range of a float"),
    (b'{"a": [2, -3]}', "bad shape [2, -3]"),
    (b"[[2, 3.5]]", "a shape is a list of non-negative integers"),
    (b"", "not valid JSON"),
])
def test_model_refuses_a_layers_file_in_one_line(tmp_path, data, said):
    (tmp_path / "l.json").write_bytes(data)
    refused(invoke(*MODEL, "--layers", tmp_path / "l.json"), said, "--layers")


@pytest.mark.parametrize("kind", ["/dev/null", "fifo", "missing"])
def test_model_refuses_a_layers_file_that_is_not_a_file(tmp_path, kind):
    path = {"/dev/null": "/dev/null", "fifo": fifo(tmp_path / "pipe"),
            "missing": tmp_path / "missing.json"}[kind]
    said = "does not exist" if kind == "missing" else "not a regular file"
    refused(invoke(*MODEL, "--layers", path), said, "layers file (--layers)")


CAL = {"alpha": 1e-6, "beta": 1e-9, "gamma_per_byte": 1e-10, "inter_alpha": 5e-6,
       "inter_beta": 1e-8, "nodes": 2, "per_node": 2}


@pytest.mark.parametrize("change,said", [
    ({"nodes": float("nan")}, "NaN is not a number"),
    ({"per_node": float("inf")}, "Infinity is not a number"),
    ({"beta": -1}, "beta: must be at least 0, not -1"),
    ({"beta": 1e-320}, "beta: must be 0 or at least 1e-18"),
    ({"nodes": "2"}, "nodes: must be a whole number, not '2'"),
    ({"nodes": 1e9}, "nodes: must be a whole number"),
    ({"nodes": 10 ** 9}, "nodes: must be at most"),
    ({"alpha": None}, "alpha: must be a finite number, not None"),
])
def test_model_refuses_a_calibration_out_of_range(tmp_path, change, said):
    (tmp_path / "c.json").write_text(json.dumps({"calibration": {**CAL, **change}}))
    refused(invoke("model", "--from-calibration", tmp_path / "c.json", "--params", "1e9",
                   "--no-search"), said, "c.json (--from-calibration)")


def test_model_takes_a_good_calibration_and_refuses_a_fifo(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps({"calibration": CAL}))
    res = invoke("model", "--from-calibration", tmp_path / "c.json", "--params", "1e9",
                 "--no-search")
    assert res.exit_code == 0 and res.output.startswith("cluster: 2 nodes × 2 GPUs"), res.output
    refused(invoke("model", "--from-calibration", fifo(tmp_path / "pipe"), "--params", "1e9"),
            "is a FIFO (named pipe), not a regular file")


# ----------------------------------------------------------- the calibration cache

def key(per_node=2):
    return f"{platform.node()}|lib|ranks_per_node={per_node}|oversubscribed=no"


def write_cache(tmp_path, text):
    (tmp_path / "cache").mkdir(exist_ok=True)
    (tmp_path / "cache" / "calibration.json").write_text(text)


@pytest.mark.parametrize("text,said", [
    ('{"%s": {"alpha": 1e-6, "beta": 1e-9, "gamma": 1e-9, "nodes": 2, "per_node": Infinity}}'
     % key(), "Infinity is not a number"),
    ('{"a', "not valid JSON"),
    ("[1, 2]", "must hold an object of calibrations by key"),
])
def test_list_says_a_corrupt_cache_once_and_runs_without_it(tmp_path, text, said):
    write_cache(tmp_path, text)
    res = invoke("list")
    assert res.exit_code == 0, res.output
    warnings = res.stderr.splitlines()
    assert len(warnings) == 1 and warnings[0].startswith("refcoll: warning: "), res.stderr
    assert said in warnings[0] and "the cache is ignored" in warnings[0]
    assert "key:    (fixed defaults: no measurement)" in res.stdout


def test_list_ignores_a_bad_entry_and_keeps_the_good_one(tmp_path):
    write_cache(tmp_path, json.dumps({
        key(2): {"alpha": -1, "beta": 1e-9, "gamma": 1e-9},
        key(3): {"alpha": 1e-6, "beta": 1e-9, "gamma": 1e-9, "per_node": 1e300, "nodes": 2},
        key(4): {"alpha": 2e-6, "beta": 1e-9, "gamma": 1e-9, "measured_at": 1.7e9}}))
    res = invoke("list")
    assert res.exit_code == 0, res.output
    warned = res.stderr.splitlines()
    assert len(warned) == 2 and all(w.endswith("the entry is ignored") for w in warned)
    assert "alpha: must be at least 0" in warned[0] and "per_node: must be a whole" in warned[1]
    assert f"key:    {key(4)}" in res.stdout


def test_a_fifo_as_the_cache_is_ignored_not_waited_on_and_not_replaced(tmp_path):
    (tmp_path / "cache").mkdir()
    pipe = fifo(tmp_path / "cache" / "calibration.json")
    res = invoke("list")
    assert res.exit_code == 0 and "is a FIFO" in res.stderr, res.output
    calibration._save(key(), Calibration(1e-6, 1e-9, 1e-9, measured_at=1.0))
    assert stat.S_ISFIFO(os.lstat(pipe).st_mode)  # left as it was


def test_two_jobs_saving_at_once_keep_both_entries(tmp_path):
    keys = [key(n) for n in range(2, 14)]
    start = threading.Barrier(len(keys))

    def save(k):
        start.wait()
        calibration._save(k, Calibration(1e-6, 1e-9, 1e-9, measured_at=1.0))

    threads = [threading.Thread(target=save, args=(k,)) for k in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    saved = json.loads(calibration.cache_path().read_text())
    assert sorted(saved) == sorted(keys)
    assert not [p for p in calibration.cache_path().parent.iterdir() if p.name.endswith(".tmp")]


def test_a_corrupt_cache_is_not_overwritten_by_a_save(tmp_path):
    write_cache(tmp_path, '{"half')
    why = calibration._save(key(), Calibration(1e-6, 1e-9, 1e-9, measured_at=1.0))
    assert calibration.cache_path().read_text() == '{"half'
    assert "cannot be read" in why and "left as it is" in why  # for calibrate to say


# ------------------------------------------------------------------- REFCOLL_TIMEOUT

@pytest.mark.parametrize("value", ["1e10", "1e400", "9223372037", "infinity"])
def test_a_timeout_beyond_what_a_wait_holds_is_for_ever(monkeypatch, value):
    monkeypatch.setenv("REFCOLL_TIMEOUT", value)
    assert default_timeout() is None
    assert SimWorld(2).timeout is None


def test_a_timeout_just_inside_the_platforms_is_kept(monkeypatch):
    monkeypatch.setenv("REFCOLL_TIMEOUT", str(threading.TIMEOUT_MAX / 2))
    assert default_timeout() == threading.TIMEOUT_MAX / 2


def test_the_simulator_runs_under_a_timeout_of_1e10():
    res = invoke("simulate", "--algorithm", "ring", "-p", "4", "--count", "16",
                 env={"REFCOLL_TIMEOUT": "1e10"})
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output


@pytest.mark.parametrize("value", ["nan", "-1", "1e-400", "ten"])
def test_a_timeout_that_is_no_number_of_seconds_is_still_refused(value):
    res = invoke("simulate", "--algorithm", "ring", "-p", "2", "--count", "4",
                 env={"REFCOLL_TIMEOUT": value})
    refused(res, f"REFCOLL_TIMEOUT={value!r} is not a number of seconds")


# -------------------------------------------------------- NCCL's log, read back

def test_the_nccl_log_lives_in_a_private_folder_and_is_removed(tmp_path):
    from refcoll.bench import BenchConfig, NcclLog

    environ: dict = {}
    log = NcclLog.start(BenchConfig(against="nccl"), environ)
    folder = os.path.dirname(environ["NCCL_DEBUG_FILE"])
    info = os.lstat(folder)
    assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700
    assert info.st_uid == os.getuid()
    assert os.path.basename(folder) != "tmp" and folder.startswith(os.path.join(
        os.path.dirname(folder), "refcoll-nccl-"))
    path = environ["NCCL_DEBUG_FILE"].replace("%h", "node1").replace("%p", "42")
    with open(path, "w") as fh:
        fh.write("node1:42:42 [0] NCCL INFO AllReduce: 8 Bytes -> Algo RING proto LL\n")
    assert log.choice("allreduce", 8).algo == "Ring"
    log.close()
    assert not os.path.exists(folder) and environ == {}


def test_a_fifo_where_the_log_should_be_is_refused_not_waited_on(tmp_path):
    from refcoll.baselines import nccl_log
    from refcoll.bench import BenchConfig, NcclLog

    log = NcclLog.start(BenchConfig(against="nccl"), {}, str(tmp_path))
    fifo(tmp_path / f"refcoll-nccl-{os.getpid()}.node1.42")
    with pytest.raises(UsageError, match="is a FIFO"):
        log.new_lines()
    with pytest.raises(UsageError, match="is a FIFO"):
        nccl_log.read_tuning(log.pattern)
    log.close()
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------- the torch store

@pytest.mark.parametrize("value,port", [("", 0), ("29500", 29500)])
def test_master_port_is_a_port_or_any(monkeypatch, value, port):
    from refcoll.torch.launch import _master_port

    monkeypatch.setenv("MASTER_PORT", value)
    assert _master_port() == port


@pytest.mark.parametrize("value", ["abc", "70000", "-1", "1e3"])
def test_a_master_port_that_is_no_port_is_refused(monkeypatch, value):
    from refcoll.torch.launch import _master_port

    monkeypatch.setenv("MASTER_PORT", value)
    with pytest.raises(UsageError, match="MASTER_PORT=.* is not a TCP port"):
        _master_port()


STORE_JOB = """
import torch, torch.distributed as dist
from refcoll.torch.launch import init_process_group
init_process_group("gloo", timeout=60)
t = torch.ones(2) * (dist.get_rank() + 1)
dist.all_reduce(t)
print(f"sum {dist.get_rank()} {t.tolist()}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.skipif(mpiexec_path() is None, reason="no mpiexec")
def test_under_mpiexec_the_store_takes_the_port_it_binds(tmp_path):
    pytest.importorskip("torch.distributed")
    res = run_script(tmp_path, 2, STORE_JOB, env={"MASTER_PORT": ""})
    assert res.returncode == 0, res.stdout + res.stderr
    # mpiexec forwards both ranks' output through one pipe: their lines may interleave
    assert sorted(re.findall(r"sum (\d) (\[[^]]*\])", res.stdout)) == \
        [("0", "[3.0, 3.0]"), ("1", "[3.0, 3.0]")]
    bad = run_script(tmp_path, 2, STORE_JOB, env={"MASTER_PORT": "abc"})
    assert bad.returncode != 0
    # Each rank raises the same error; once one exits, mpiexec may end the other before it
    # prints, so every line said must be that error, and at least one rank must say it. The
    # error's line may end without its newline when the other rank's traceback comes next
    # through the same pipe: what follows the message on its line is not the message's.
    said = re.findall(r"UsageError: rank (\d): (.*)", bad.stderr)
    assert said and {rank for rank, _ in said} <= {"0", "1"}
    error = ("MASTER_PORT='abc' is not a TCP port: give a number from 1 to 65535, or leave it "
             "unset for any free port")
    assert all(text.startswith(error) for _, text in said), said


def test_a_layers_file_of_more_tensors_than_a_model_has_is_refused():
    from refcoll.model.cluster import MAX_LAYERS, load_layers

    assert len(load_layers("[" + ",".join(["[2]"] * MAX_LAYERS) + "]")) == MAX_LAYERS
    with pytest.raises(UsageError, match=f"lists {MAX_LAYERS + 1} tensors, more than the"):
        load_layers("[" + ",".join(["[2]"] * (MAX_LAYERS + 1)) + "]", "l.json")
