"""auto's calibration depends on what it should depend on, and nothing else.

The key holds the host, the MPI library, the ranks per node and whether the
ranks outnumber the cores; measurements taken oversubscribed or noisy are never
saved; ``REFCOLL_CALIBRATION=default`` is deterministic; ``REFCOLL_ALGO`` pins
auto's choice, and a bad value is an error on every rank. No test here depends
on what a measurement measured: only on what was done with it.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import mpiexec_path

import refcoll
from refcoll.calls import auto as tuning
from refcoll.calls import calibration as calibration_module
from refcoll.core.errors import UsageError
from refcoll.transport import SimWorld

MPIEXEC = mpiexec_path()
needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec: pip install 'refcoll[mpi]'")
CORES = os.cpu_count() or 1

REPORT = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    from mpi4py import MPI
    import refcoll
    from refcoll.calls import auto as tuning
    from refcoll.calls.collectives import as_transport

    comm = MPI.COMM_WORLD

    def report(**fields):  # one file a rank: lines printed by several ranks may interleave
        with open(os.path.join(os.environ["REPORTS"], f"{comm.rank}.json"), "w") as fh:
            json.dump(dict(fields, rank=comm.rank), fh)

    if len(sys.argv) > 1 and comm.rank == 1:
        os.environ["REFCOLL_ALGO"] = sys.argv[1]  # this rank alone
    t = as_transport(comm)
    try:
        refcoll.allreduce(np.ones(1000, np.float32), comm, algorithm="auto")
    except refcoll.RefcollError as exc:
        report(error=f"{type(exc).__name__}: {exc}")
        sys.exit(0)
    cal = tuning.calibration_for(t)
    picks = {n: tuning.resolve(t, "allreduce", n, 4) for n in (1, 1 << 12, 1 << 22)}
    report(alpha=cal.alpha, beta=cal.beta, gamma=cal.gamma, key=cal.key, source=cal.source,
           picks=picks)
""")


def run_report(tmp_path, n, *args, **env_extra):
    path = tmp_path / "report.py"
    path.write_text(REPORT)
    reports_dir = tmp_path / "reports"
    reports_dir.mkdir(exist_ok=True)
    for old in reports_dir.iterdir():
        old.unlink()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "PMIX_", "REFCOLL_ALGO", "REFCOLL_CALIBRATION"))}
    env.update(REFCOLL_CACHE=str(tmp_path / "cache"), REFCOLL_TIMEOUT="60",
               REPORTS=str(reports_dir), **env_extra)
    res = subprocess.run([MPIEXEC, "-n", str(n), sys.executable, str(path), *args],
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    reports = [json.loads((reports_dir / f"{r}.json").read_text()) for r in range(n)]
    return reports, res.stderr


def cache_file(tmp_path):
    return tmp_path / "cache" / "calibration.json"


@needs_mpi
def test_the_key_names_ranks_per_node_and_oversubscription(tmp_path):
    n = 2
    reports, stderr = run_report(tmp_path, n)
    key = reports[0]["key"]
    over = "yes" if n > CORES else "no"
    assert key.endswith(f"|ranks_per_node={n}|oversubscribed={over}"), key
    assert len({json.dumps(dict(r, rank=0), sort_keys=True) for r in reports}) == 1, \
        "every rank must resolve with the same calibration"
    saved = json.loads(cache_file(tmp_path).read_text()) if cache_file(tmp_path).exists() else {}
    # Saved, or not saved with the reason on stderr: never saved silently under another key.
    assert list(saved) == [key] or "not saved" in stderr, (saved, stderr)


@needs_mpi
def test_whether_to_save_is_rank_zeros_to_decide_and_every_rank_hears_it(tmp_path):
    """Each rank decided from its own key (its machine file) whether to save, and the
    ranks that would save met rank 0's broadcast alone: a hang, or another message's bytes.
    Here rank 1 alone would refuse; rank 0 decides, and every rank says what it said."""
    script = tmp_path / "one_rank_objects.py"
    patched = REPORT.replace(
        "t = as_transport(comm)\n",
        "from refcoll.calls import calibration\n"  # rank 0 would save (however busy), 1 not
        "calibration._why_not_saved = lambda key, measured: (\n"
        "    'rank 1 alone objects' if comm.rank == 1 else None)\n"
        "t = as_transport(comm)\n")
    assert patched != REPORT
    script.write_text(patched)
    reports_dir = tmp_path / "reports"
    reports_dir.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "PMIX_", "REFCOLL_ALGO", "REFCOLL_CALIBRATION"))}
    env.update(REFCOLL_CACHE=str(tmp_path / "cache"), REFCOLL_TIMEOUT="20",
               REPORTS=str(reports_dir))
    res = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(script)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    reports = [json.loads((reports_dir / f"{r}.json").read_text()) for r in range(2)]
    assert all("error" not in r for r in reports), reports
    assert reports[0]["source"] == reports[1]["source"], reports
    assert reports[1]["source"].startswith("measured, saved in"), reports


@needs_mpi
def test_an_oversubscribed_measurement_is_used_but_never_saved(tmp_path):
    n = CORES + 1
    reports, stderr = run_report(tmp_path, n)
    assert reports[0]["key"].endswith(f"ranks_per_node={n}|oversubscribed=yes")
    assert "measured for this job only" in reports[0]["source"]
    assert "not saved: the ranks outnumber the cores" in stderr
    assert not cache_file(tmp_path).exists()


@needs_mpi
def test_refcoll_calibrate_not_saving_exits_1_on_every_rank(tmp_path):
    # Rank 0 said "not saved" and exited 1; the others exited 0.
    script = tmp_path / "exit_codes.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        from mpi4py import MPI
        from refcoll.cli import main
        rank = MPI.COMM_WORLD.rank
        try:
            main(["calibrate"])
        except SystemExit as exc:
            code = exc.code
        with open(os.path.join(os.environ["REPORTS"], str(rank)), "w") as fh:
            fh.write(str(code))
        """))
    reports = tmp_path / "reports"
    reports.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "PMIX_", "REFCOLL_ALGO", "REFCOLL_CALIBRATION"))}
    env.update(REFCOLL_CACHE=str(tmp_path / "cache"), REFCOLL_TIMEOUT="60", REPORTS=str(reports))
    n = CORES + 1  # oversubscribed: measured, never saved
    res = subprocess.run([MPIEXEC, "-n", str(n), sys.executable, str(script)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert "not saved: the ranks outnumber the cores" in res.stderr, res.stderr[-3000:]
    assert [(reports / str(r)).read_text() for r in range(n)] == ["1"] * n


@needs_mpi
def test_a_cached_calibration_is_used_only_under_its_own_key(tmp_path):
    reports, _ = run_report(tmp_path, 2, REFCOLL_CALIBRATION="measure")
    key = reports[0]["key"]
    # A calibration so slow per message that auto must pick recursive doubling everywhere,
    # cached under this key and under another shape.
    planted = {"alpha": 1.0, "beta": 1e-12, "gamma": 1e-12, "measured_at": 0, "load": 0.5}
    other = key.replace("ranks_per_node=2", "ranks_per_node=7")
    cache_file(tmp_path).parent.mkdir(exist_ok=True)
    cache_file(tmp_path).write_text(json.dumps({key: planted, other: dict(planted, alpha=2.0)}))
    reports, _ = run_report(tmp_path, 2)
    assert reports[0]["alpha"] == 1.0 and "cached in" in reports[0]["source"]
    expected = {str(n): tuning.choose("allreduce", 2, n, 4, tuning.Calibration(1.0, 1e-12, 1e-12))
                for n in (1, 1 << 12, 1 << 22)}
    assert reports[0]["picks"] == expected


@needs_mpi
def test_the_deterministic_mode_never_measures(tmp_path):
    reports, _ = run_report(tmp_path, 2, REFCOLL_CALIBRATION="default")
    assert (reports[0]["alpha"], reports[0]["beta"], reports[0]["gamma"]) == (
        tuning.DEFAULT.alpha, tuning.DEFAULT.beta, tuning.DEFAULT.gamma)
    assert reports[0]["picks"] == {str(n): tuning.choose("allreduce", 2, n, 4)
                                   for n in (1, 1 << 12, 1 << 22)}
    assert not cache_file(tmp_path).exists()


@needs_mpi
def test_refcoll_algo_pins_auto_under_mpi(tmp_path):
    reports, _ = run_report(tmp_path, 2, REFCOLL_ALGO="allreduce:tree",
                            REFCOLL_CALIBRATION="default")
    assert set(reports[0]["picks"].values()) == {"tree"}


@needs_mpi
@pytest.mark.parametrize("value,message", [
    ("rign", "unknown algorithm 'rign'"),
    ("^ring,recursive_doubling,rabenseifner,tree,dbtree", "leaves auto no algorithm"),
])
def test_a_bad_refcoll_algo_is_an_error_on_every_rank(tmp_path, value, message):
    reports, _ = run_report(tmp_path, 2, REFCOLL_ALGO=value, REFCOLL_CALIBRATION="default")
    assert all(message in r.get("error", "") for r in reports), reports


@needs_mpi
def test_ranks_whose_refcoll_algo_differs_fail_together(tmp_path):
    reports, _ = run_report(tmp_path, 2, "ring", REFCOLL_CALIBRATION="default")
    assert all("MismatchError" in r.get("error", "") and "REFCOLL_ALGO" in r["error"]
               for r in reports), reports


def test_a_noisy_measurement_is_not_saved():
    key = tuning.CalibrationKey("host", "lib", 2, False)
    busy = tuning.Calibration(1e-5, 1e-9, 1e-9, load=tuning.LOAD_LIMIT * 1.5)
    quiet = tuning.Calibration(1e-5, 1e-9, 1e-9, load=tuning.LOAD_LIMIT)
    unknown = tuning.Calibration(1e-5, 1e-9, 1e-9, load=None)
    assert "too noisy: 1.5 runnable tasks per core" in calibration_module._why_not_saved(key, busy)
    assert calibration_module._why_not_saved(key, quiet) is None
    assert calibration_module._why_not_saved(key, unknown) is None  # no /proc/loadavg: cannot tell
    over = tuning.CalibrationKey("host", "lib", 3, True)
    assert "outnumber the cores" in calibration_module._why_not_saved(over, quiet)


def test_runnable_tasks_reads_the_instantaneous_count(tmp_path, monkeypatch):
    import builtins

    fake = tmp_path / "loadavg"
    fake.write_text("0.52 0.58 0.59 3/467 12345\n")
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: real_open(
        fake if path == "/proc/loadavg" else path, *a, **k))
    assert tuning.runnable_tasks() == 3
    fake.write_text("garbage")
    assert tuning.runnable_tasks() is None


@needs_mpi
@pytest.mark.skipif(tuning.runnable_tasks() is None,
                    reason="no /proc/loadavg here: only oversubscription can be seen")
def test_a_measurement_beside_another_job_is_not_saved(tmp_path):
    # A busy loop on every core but the ones the job's ranks poll on: more runnable tasks
    # than cores whatever the machine, so the measurement must not be kept.
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(CORES)]
    try:
        reports, stderr = run_report(tmp_path, 2)  # nothing cached: it measures, to save
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert "too noisy" in reports[0]["source"] or "outnumber the cores" in reports[0]["source"]
    assert not cache_file(tmp_path).exists()


@pytest.mark.parametrize("value,collective,expected", [
    ("ring", "allreduce", ["ring"]),
    ("ring,tree", "allreduce", ["ring", "tree"]),
    ("^recursive_doubling", "allreduce", ["ring", "rabenseifner", "tree", "dbtree"]),
    ("allreduce:ring;reduce_scatter:rabenseifner", "reduce_scatter", ["rabenseifner"]),
    ("allreduce:ring", "reduce_scatter", tuning.candidates("reduce_scatter")),
    ("rabenseifner", "broadcast", tuning.candidates("broadcast")),  # it has no broadcast
    ("allreduce:hierarchical", "allreduce", ["hierarchical"]),  # pinned, not auto's own pick
])
def test_refcoll_algo_grammar(value, collective, expected):
    assert tuning.AlgoFilter.parse(value).allowed(collective) == expected


@pytest.mark.parametrize("value,message", [
    ("rign", "unknown algorithm 'rign'; choose from"),
    ("bcast:ring", "unknown collective 'bcast'"),
    ("allgather:tree", "tree does not implement allgather"),
    ("allreduce:", "names no algorithm"),
    ("switch", "unknown algorithm 'switch'"),
    # which part would win was the parser's accident (the first here, the last there)
    ("allreduce:ring;allreduce:tree", "allreduce is given twice"),
    ("ring;tree", "every collective is given twice"),
    ("=ring", "names no collective before its ':'"),
    (":ring", "names no collective before its ':'"),
])
def test_refcoll_algo_errors(value, message):
    with pytest.raises(UsageError, match=message):
        tuning.AlgoFilter.parse(value)


def test_refcoll_algo_steers_the_simulator_too(monkeypatch):
    xs = [np.arange(1 << 12, dtype=np.float32) + r for r in range(4)]
    monkeypatch.setenv("REFCOLL_ALGO", "allreduce:tree")
    auto = refcoll.simulate("allreduce", xs, algorithm="auto")
    tree = refcoll.simulate("allreduce", xs, algorithm="tree")
    assert auto.outputs[0].tobytes() == tree.outputs[0].tobytes()
    assert auto.ledger.counts() == tree.ledger.counts()
    monkeypatch.setenv("REFCOLL_ALGO", "nope")
    with pytest.raises(UsageError, match="unknown algorithm 'nope'"):
        refcoll.simulate("allreduce", xs, algorithm="auto")


def test_simulate_resolves_auto_with_the_calibration_given():
    slow_messages = tuning.Calibration(1.0, 1e-12, 1e-12)
    count = 1 << 20
    pick = tuning.choose("allreduce", 4, count, 4, slow_messages)
    assert pick != tuning.choose("allreduce", 4, count, 4)  # the two calibrations disagree
    xs = [np.ones(count, np.float32)] * 4
    got = SimWorld(4, calibration=slow_messages).run(
        lambda t: (tuning.resolve(t, "allreduce", count, 4), tuning.calibration_for(t)))
    assert got[0] == (pick, slow_messages)
    result = refcoll.simulate("allreduce", xs, algorithm="auto", calibration=slow_messages)
    assert result.ledger.counts() == refcoll.simulate("allreduce", xs,
                                                      algorithm=pick).ledger.counts()


def test_a_bad_calibration_mode_is_a_usage_error(monkeypatch):
    monkeypatch.setenv("REFCOLL_CALIBRATION", "sometimes")
    with pytest.raises(UsageError, match="REFCOLL_CALIBRATION='sometimes'"):
        tuning.calibration_mode()


@needs_mpi
def test_calibrate_command_saves_or_says_why_not(tmp_path):
    env = dict(os.environ, REFCOLL_CACHE=str(tmp_path / "cache"))
    out = tmp_path / "cal.json"
    res = subprocess.run([sys.executable, "-m", "refcoll", "calibrate", "-n", "2", "--force",
                          "--json", str(out)], capture_output=True, text=True, timeout=120,
                         env=env)
    report = json.loads(out.read_text())
    assert report["calibration"]["key"].endswith("ranks_per_node=2|oversubscribed="
                                                 + ("yes" if CORES < 2 else "no"))
    assert report["cached"] is False
    if report["saved"]:
        assert res.returncode == 0, res.stderr
        assert report["calibration"]["key"] in json.loads(cache_file(tmp_path).read_text())
        # Again, without --force: the entry is shown, neither measured nor saved again.
        res = subprocess.run([sys.executable, "-m", "refcoll", "calibrate", "-n", "2", "--json",
                              str(out)], capture_output=True, text=True, timeout=120, env=env)
        again = json.loads(out.read_text())
        assert res.returncode == 0 and again["cached"] is True and again["saved"] is False
        assert again["calibration"]["alpha"] == report["calibration"]["alpha"]
    else:
        assert res.returncode == 1 and "not saved" in res.stderr
        assert not cache_file(tmp_path).exists()


def test_list_shows_the_calibration_in_force_with_its_age_and_key(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from refcoll.cli import main

    monkeypatch.setenv("REFCOLL_CACHE", str(tmp_path))
    monkeypatch.delenv("REFCOLL_CALIBRATION", raising=False)
    host = __import__("platform").node()
    quiet = f"{host}|lib|ranks_per_node=2|oversubscribed=no"
    other = f"{host}|lib|ranks_per_node=8|oversubscribed=no"
    now = __import__("time").time()
    (tmp_path / "calibration.json").write_text(json.dumps({
        quiet: {"alpha": 7e-6, "beta": 1e-10, "gamma": 2e-10, "measured_at": now - 7200,
                "load": 0.5},
        other: {"alpha": 9e-6, "beta": 1e-10, "gamma": 2e-10, "measured_at": now - 3 * 86400,
                "load": 0.5}}))
    out = tmp_path / "list.json"
    res = CliRunner().invoke(main, ["list", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert f"key:    {quiet}" in res.output and "measured 2.0 h ago" in res.output
    assert f"{other}: α=9e-06 s" in res.output and "measured 3.0 days ago" in res.output
    auto = json.loads(out.read_text())["auto"]
    assert auto["calibration"]["key"] == quiet and auto["calibration"]["alpha"] == 7e-6
    assert sorted(c["key"] for c in auto["cached"]) == sorted([quiet, other])
    monkeypatch.setenv("REFCOLL_CALIBRATION", "default")
    res = CliRunner().invoke(main, ["list"])
    assert "REFCOLL_CALIBRATION=default" in res.output and "(fixed defaults" in res.output


QUIET_CALIBRATE = textwrap.dedent("""
    import sys
    import refcoll.calls.calibration as calibration
    calibration.runnable_tasks = lambda: 1  # a quiet machine: the save is what is judged
    from refcoll.cli import main
    sys.argv = ["refcoll", "calibrate", *sys.argv[1:]]
    main()
""")


@needs_mpi
def test_calibrate_says_not_saved_when_the_cache_could_not_be_kept(tmp_path):
    """An unreadable cache is left as it is: the command says the calibration was not
    saved and exits 1, its JSON says so, rather than claiming it saved (the load probe is
    faked quiet, so the machine's load decides nothing here)."""
    script = tmp_path / "calibrate.py"
    script.write_text(QUIET_CALIBRATE)
    cache = tmp_path / "cache" / "calibration.json"
    cache.parent.mkdir()
    cache.write_text('{"x": ')
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    env.update(REFCOLL_CACHE=str(cache.parent), REFCOLL_TIMEOUT="60")
    res = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(script), "--force", "--json",
                          str(tmp_path / "cal.json")], capture_output=True, text=True,
                         timeout=120, env=env)
    assert res.returncode == 1, res.stdout + res.stderr
    assert "not saved: the cache" in res.stderr and "cannot be read" in res.stderr
    assert "saved in" not in res.stdout and "measured for this job only" in res.stdout
    report = json.loads((tmp_path / "cal.json").read_text())
    assert report["saved"] is False and "cannot be read" in report["why_not_saved"]
    assert cache.read_text() == '{"x": '  # left as it was


def test_calibrate_refuses_to_write_its_json_over_the_cache(tmp_path):
    cache = tmp_path / "calibration.json"
    cache.write_text("{}")
    env = dict(os.environ, REFCOLL_CACHE=str(tmp_path))
    res = subprocess.run([sys.executable, "-m", "refcoll", "calibrate", "--json", str(cache)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "is the file of the calibration cache" in res.stderr
    assert cache.read_text() == "{}"


ONE_RANK = textwrap.dedent("""
    import json, sys
    import numpy as np
    from mpi4py import MPI
    import refcoll
    from refcoll.calls import auto
    from refcoll.calls.collectives import as_transport

    alone = MPI.COMM_WORLD.Split(MPI.COMM_WORLD.rank)  # a communicator of one rank
    refcoll.allreduce(np.ones(4, np.float32), alone, algorithm="auto")
    cal = auto.calibration_for(as_transport(alone))
    assert "no peer to measure" in cal.source, cal.source  # every rank, as rank 0 shows
    if MPI.COMM_WORLD.rank == 0:
        print(json.dumps({"alpha": cal.alpha, "beta": cal.beta, "source": cal.source}))
""")


@needs_mpi
def test_a_one_rank_communicator_measures_and_saves_nothing(tmp_path):
    """A rank alone has no peer to ping: it takes the defaults and caches no fake
    measurement that later jobs would take as this machine's."""
    script = tmp_path / "one.py"
    script.write_text(ONE_RANK)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "PMIX_", "REFCOLL_CALIBRATION"))}
    env.update(REFCOLL_CACHE=str(tmp_path / "cache"), REFCOLL_TIMEOUT="60")
    res = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(script)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    for line in res.stdout.splitlines():
        got = json.loads(line)
        assert (got["alpha"], got["beta"]) == (tuning.DEFAULT.alpha, tuning.DEFAULT.beta)
        assert "no peer to measure" in got["source"]
    assert not cache_file(tmp_path).exists()


@needs_mpi
def test_the_measure_mode_neither_reads_nor_writes_the_cache(tmp_path):
    """REFCOLL_CALIBRATION=measure measures for this job, ignoring the cache, as documented:
    an entry planted under the job's key is neither used nor replaced."""
    reports, _ = run_report(tmp_path, 2, REFCOLL_CALIBRATION="measure")
    key = reports[0]["key"]
    planted = json.dumps({key: {"alpha": 1.0, "beta": 1e-12, "gamma": 1e-12, "measured_at": 0,
                                "load": 0.5}})
    cache_file(tmp_path).parent.mkdir(exist_ok=True)
    cache_file(tmp_path).write_text(planted)
    reports, _ = run_report(tmp_path, 2, REFCOLL_CALIBRATION="measure")
    assert reports[0]["alpha"] != 1.0 and "neither read nor written" in reports[0]["source"]
    assert cache_file(tmp_path).read_text() == planted


def test_a_cached_date_in_the_future_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("REFCOLL_CACHE", str(tmp_path))
    host = __import__("platform").node()
    key = f"{host}|lib|ranks_per_node=2|oversubscribed=no"
    (tmp_path / "calibration.json").write_text(json.dumps({
        key: {"alpha": 7e-6, "beta": 1e-10, "gamma": 2e-10, "measured_at": 1e300}}))
    assert calibration_module.cached_calibrations() == []


@needs_mpi
@pytest.mark.parametrize("json_file", ["/nonexistent/x.json", "r1.json"])
def test_calibrate_ranks_given_different_arguments_exit_2_on_every_rank(tmp_path, json_file):
    # Rank 1 alone was given --json: a path only it checked (before MPI started) left
    # rank 0 waiting in MPI's start-up until REFCOLL_TIMEOUT; a path it could write was
    # silently never written. Both are refused on every rank, once, before measuring.
    base = [sys.executable, "-m", "refcoll", "calibrate"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    env.update(REFCOLL_CACHE=str(tmp_path), REFCOLL_TIMEOUT="60")
    res = subprocess.run([MPIEXEC, "-n", "1", *base, ":", "-n", "1", *base, "--json", json_file],
                         capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert res.stderr.count("refcoll: error:") == 1, res.stderr
    assert f"rank 1 has '--json {json_file}' where rank 0 has 'nothing'" in res.stderr
    assert not (tmp_path / "r1.json").exists() and "calibration:" not in res.stdout


@needs_mpi
def test_ranks_that_read_different_topologies_under_one_path_are_told_on_every_rank(tmp_path):
    """Only REFCOLL_TOPO_FILE's value was agreed: a relative path read from two working
    folders (or one path on two hosts) gave each rank its own links, and auto chose ring
    on one rank and recursive_doubling on the other for the same call."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import os
        import numpy as np
        from mpi4py import MPI
        import refcoll
        try:
            refcoll.allreduce(np.ones(100_000, np.float32), MPI.COMM_WORLD, algorithm="auto")
            said = "no error"
        except refcoll.RefcollError as exc:
            said = f"{type(exc).__name__} {exc}"
        with open(os.path.join(os.environ["REPORTS"], str(MPI.COMM_WORLD.rank)), "w") as fh:
            fh.write(said)  # a file a rank: lines two ranks print at once may interleave
    """))
    (tmp_path / "reports").mkdir()
    for folder, rate, latency in (("a", 1e9, 5e-5), ("b", 1e6, 5.0)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "topo.json").write_text(json.dumps(
            {"version": 1, "link_latency_s": latency,
             "nodes": [{"host": h, "ranks": 1, "link_bits_per_s": rate} for h in ("n1", "n2")]}))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "PMIX_", "REFCOLL_ALGO", "REFCOLL_CALIBRATION"))}
    env.update(REFCOLL_CALIBRATION="default", REFCOLL_TIMEOUT="20", REFCOLL_TOPO_FILE="topo.json",
               REPORTS=str(tmp_path / "reports"))
    res = subprocess.run([MPIEXEC, "-n", "1", "-wdir", str(tmp_path / "a"), sys.executable,
                          str(script), ":", "-n", "1", "-wdir", str(tmp_path / "b"),
                          sys.executable, str(script)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    said = [(tmp_path / "reports" / str(r)).read_text() for r in range(2)]
    assert all(s.startswith("MismatchError") and "topology read" in s for s in said), said
