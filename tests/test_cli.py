import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import mpiexec_path

import refcoll.cli as cli
from refcoll import algorithms
from refcoll.cli import main
from refcoll.core.errors import CollectiveTimeout


def invoke(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_list_shows_every_algorithm_and_writes_json(tmp_path):
    out = tmp_path / "list.json"
    res = invoke("list", "--json", str(out))
    assert res.exit_code == 0
    data = json.loads(out.read_text())
    assert [a["name"] for a in data["algorithms"]] == list(algorithms.REGISTRY)
    ring = next(a for a in data["algorithms"] if a["name"] == "ring")
    assert ring["cost"]["allreduce"] == "2(p-1)·α + 2((p-1)/p)·n·β + ((p-1)/p)·n·γ"
    assert data["dtypes"]["float8_e5m2"] == ["sum", "min", "max"]
    assert "ring" in res.output and "bfloat16" in res.output


@pytest.mark.parametrize("variable", ["REFCOLL_CALIBRATION", "REFCOLL_ALGO"])
def test_list_refuses_a_bad_setting_before_printing_a_line(monkeypatch, variable):
    monkeypatch.setenv(variable, "bogus")
    res = CliRunner().invoke(main, ["list"])
    assert res.exit_code == 2 and f"{variable}='bogus'" in res.stderr, res.stderr
    assert res.stdout == ""


def test_simulate_prints_the_ledger_beside_the_cost(tmp_path):
    out = tmp_path / "sim.json"
    res = invoke("simulate", "--algorithm", "ring", "-p", "5", "--count", "1003",
                 "--json", str(out))
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["ledger"]["messages"] == data["cost"]["messages"] == 40
    assert data["ledger"]["bytes"] == data["cost"]["bytes"] == 2 * 4 * 1003 * 4
    assert data["ledger"]["rounds"] == 8
    assert "max rank bytes" in res.output
    res = invoke("simulate", "--algorithm", "ring", "-p", "3", "--count", "4", "--dtype",
                 "Float32", "--op", "SUM", "--json", str(out))
    data = json.loads(out.read_text())  # names as refcoll spells them, however given
    assert res.exit_code == 0 and (data["dtype"], data["op"]) == ("float32", "sum"), res.output


@pytest.mark.parametrize("args,message", [
    (["simulate", "--algorithm", "rung", "-p", "2", "--count", "4"], "unknown algorithm 'rung'"),
    (["simulate", "--algorithm", "ring", "-p", "2", "--count", "4", "--op", "mean"], "unknown op"),
    (["simulate", "--algorithm", "ring", "-p", "2", "--count", "4", "--dtype", "f3"],
     "unknown dtype"),
    (["verify", "-n", "2", "--algorithm", "rung"], "unknown algorithm 'rung'"),
    (["verify", "-n", "2", "--dtype", "float128"], "unknown dtype 'float128'"),
    (["verify", "-n", "2", "--sizes", "a,b"], "--sizes takes"),
])
def test_bad_usage_is_one_line_and_exit_2(args, message):
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0]


def test_verify_without_mpi_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("REFCOLL_MPIEXEC", raising=False)
    for var in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK"):
        monkeypatch.delenv(var, raising=False)
    res = CliRunner().invoke(main, ["verify", "-n", "2"])
    assert res.exit_code == 2
    assert "pip install 'refcoll[mpi]'" in res.output


@pytest.mark.skipif(mpiexec_path() is None,
                    reason="no mpiexec: install with pip install 'refcoll[mpi]'")
def test_verify_under_mpi_ends_with_the_tally(tmp_path):
    out = tmp_path / "verify.json"
    res = subprocess.run(
        [sys.executable, "-m", "refcoll", "verify", "-n", "2", "--algorithm", "naive,ring",
         "--dtype", "int32,bfloat16", "--op", "sum,avg", "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    last = res.stdout.strip().splitlines()[-1]
    data = json.loads(out.read_text())
    assert last == f"{data['passed']} passed, 0 failed"
    assert data["passed"] == len(data["cases"]) + len(data["nonblocking"])
    assert len(data["cases"]) > 100 and all(c["passed"] for c in data["cases"])
    assert [s["scenario"] for s in data["nonblocking"]] == [
        "one communicator", "split communicators", "an error among them"]
    assert all(s["passed"] and s["calls"] > 1 for s in data["nonblocking"])
    assert "non-blocking: each case also runs as i<collective>" in res.stdout
    assert data["world_size"] == 2


@pytest.mark.skipif(mpiexec_path() is None,
                    reason="no mpiexec: install with pip install 'refcoll[mpi]'")
def test_verify_in_a_job_without_room_for_switches_says_what_the_switch_cases_ran_on():
    """Inside a 2-process job with -n 2, switch's cases ran on 1 data rank, and nothing
    said so: its rows read as if at 2 ranks."""
    res = subprocess.run(
        [mpiexec_path(), "-n", "2", sys.executable, "-m", "refcoll", "verify", "-n", "2",
         "--algorithm", "switch,ring", "--collective", "allreduce", "--op", "sum",
         "--dtype", "int32", "--sizes", "3"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    notes = [line for line in res.stdout.splitlines() if line.startswith("note:")]
    assert notes == ["note: switch runs on 1 data rank of this 2-process job, which has no room "
                     "for its switch processes beside 2 data ranks: start more processes"]


def test_the_oracle_bound_holds_for_float64_edge_sums():
    import numpy as np

    from refcoll.verify.oracle import bound_violations, fold

    xs = [np.array([1.0]), np.array([2.0 ** -53]), np.array([2.0 ** -53]), np.array([2.0 ** -53])]
    idx, _, _ = bound_violations("sum", xs, fold("sum", xs))
    assert len(idx) == 0


def test_a_long_report_keeps_its_shape():
    from refcoll.verify.conformance import _pack, _unpack

    rep = {"problems": ["raised PeerFailure: " + "x" * 5000] * 7, "digest": "ab" * 16}
    back = _unpack(_pack(rep))
    assert back["digest"] == rep["digest"] and len(back["problems"]) == 3


def test_relaunch_runs_the_command_it_was_given(monkeypatch):
    import refcoll.cli as cli

    seen = {}

    def fake_run(cmd, env):
        seen["cmd"] = cmd

        class Done:
            returncode = 0

        return Done()

    monkeypatch.setattr(sys, "argv", ["host-program.py", "list"])
    monkeypatch.setattr(cli.subprocess, "run", fake_run)
    monkeypatch.setattr("refcoll.cli.launch.in_mpi_job", lambda: False)
    monkeypatch.setattr("refcoll.cli.launch._is_open_mpi", lambda launcher: False)
    monkeypatch.setenv("REFCOLL_MPIEXEC", "mpiexec")
    res = CliRunner().invoke(main, ["verify", "-n", "3", "--algorithm", "ring"])
    assert res.exit_code == 0
    assert seen["cmd"][-7:] == ["-m", "refcoll", "verify", "-n", "3", "--algorithm", "ring"]
    assert seen["cmd"][:3] == ["mpiexec", "-n", "3"]


@pytest.mark.parametrize("status,noted,exit_code", [
    (0, "", 0), (1, "1", 1), (2, "2", 2), (3, "", 3), (9, "", 3), (-9, "", 3), (137, "", 3),
    # MPICH's mpiexec passes on SIGHUP's and SIGINT's numbers: no rank said 1 or 2 itself
    (1, "running", 3), (2, "0", 3),
    # no rank could reach the folder (ranks on other nodes only): their status stands
    (1, None, 1)])
def test_a_rank_that_died_is_a_fault_not_a_failed_check(monkeypatch, status, noted, exit_code):
    """mpiexec ending with a killed rank's status exited 1, the status of a check that failed:
    nothing was judged, so it is 3, as a timeout is."""
    def run(cmd, env=None):
        if noted is not None:  # a rank reached the folder, and noted this (note_exit)
            (Path(env["REFCOLL_EXIT_NOTES"]) / "4242").write_text(noted)
        return type("Done", (), {"returncode": status})()

    monkeypatch.setattr(cli.subprocess, "run", run)
    monkeypatch.setattr("refcoll.cli.launch.in_mpi_job", lambda: False)
    monkeypatch.setattr("refcoll.cli.launch._is_open_mpi", lambda launcher: False)
    monkeypatch.setenv("REFCOLL_MPIEXEC", "mpiexec")
    res = CliRunner().invoke(main, ["verify", "-n", "2", "--algorithm", "ring"])
    assert res.exit_code == exit_code, res.output
    if exit_code == 3 and status != 3:
        assert f"exited with status {status}: a rank died" in res.stderr


@pytest.mark.parametrize("error,code", [(MemoryError("Unable to allocate 47.7 GiB"), 2),
                                        (CollectiveTimeout("allreduce timed out"), 3)])
def test_a_rank_that_ends_its_job_notes_its_status_before_mpi_abort(monkeypatch, error, code):
    # MPI_Abort ends the rank before Python's exit notes it: the -n launcher then read the
    # usage status 2 of a rank out of memory as a rank that died (3).
    from refcoll.cli import common

    events = []
    monkeypatch.setattr(common.launch, "note_exit", lambda status: events.append(("note", status)))
    monkeypatch.setattr(common, "abort_job", lambda status: events.append(("abort", status)))

    @common.reports_errors
    def command():
        raise error

    with pytest.raises(SystemExit) as ended:
        command()
    assert ended.value.code == code
    assert events == [("note", code), ("abort", code)]


@pytest.mark.parametrize("status,allocation,exit_code,open_mpi", [
    (0, None, 3, False), (1, None, 3, False), (1, "SLURM_JOB_ID", 1, False),
    (0, "PE_HOSTFILE", 0, False),
    (0, None, 0, True)])  # Open MPI also reads install-wide host files: never sure
def test_a_launcher_that_started_no_rank_here_judged_nothing(monkeypatch, status, allocation,
                                                             exit_code, open_mpi):
    # The launcher refcoll finds, given no hosts, runs every rank here, and each notes that
    # it started: a job none of whose ranks did (Open MPI refusing root, a launcher that
    # does nothing) exited 1, a failed check, or 0. Within an allocation ranks may be on
    # other nodes, which note nothing here: their status stands.
    from refcoll.cli import launch

    def run(cmd, env=None):
        return type("Done", (), {"returncode": status})()

    monkeypatch.setattr(cli.subprocess, "run", run)
    monkeypatch.setattr(launch, "in_mpi_job", lambda: False)
    monkeypatch.setattr(launch, "_is_open_mpi", lambda launcher: open_mpi)
    monkeypatch.setattr(launch, "find_mpiexec", lambda: "mpiexec")
    monkeypatch.delenv("REFCOLL_MPIEXEC", raising=False)
    for name in launch._HOSTS_FROM:
        monkeypatch.delenv(name, raising=False)
    if allocation:
        monkeypatch.setenv(allocation, "1")
    res = CliRunner().invoke(main, ["verify", "-n", "2", "--algorithm", "ring"])
    assert res.exit_code == exit_code, res.output
    if exit_code == 3:
        assert "no rank of the job started; nothing was judged" in res.stderr


@pytest.mark.parametrize("args,status", [(["check", "absent-in", "absent-out"], 2),
                                         (["list"], 0)])
def test_a_rank_notes_the_status_it_exits_with(monkeypatch, tmp_path, args, status):
    """What relaunch reads to tell a rank's own status from a signal's number."""
    monkeypatch.setenv("REFCOLL_EXIT_NOTES", str(tmp_path))
    res = CliRunner().invoke(main, args)
    assert res.exit_code == status, res.output
    assert [f.read_text() for f in tmp_path.iterdir()] == [str(status)]  # "running", then it
    assert "REFCOLL_EXIT_NOTES" not in os.environ  # not passed on to what the rank starts


def test_ctrl_c_ends_a_command_with_status_130(monkeypatch):
    def interrupted(**paths):
        raise KeyboardInterrupt  # as Ctrl-C arrives in the middle of the command's work

    monkeypatch.setattr("refcoll.cli.listing.check_output_paths", interrupted)
    res = CliRunner().invoke(main, ["list"])
    assert res.exit_code == 130, res.output
    assert "refcoll: interrupted" in res.output and "Aborted" not in res.output


def test_simulate_refuses_a_root_for_a_collective_without_one():
    res = CliRunner().invoke(main, ["simulate", "--algorithm", "ring", "-p", "4", "--count", "8",
                                    "--root", "2"])
    assert res.exit_code == 2 and "allreduce has no root" in res.output, res.output
    res = invoke("simulate", "--algorithm", "tree", "--collective", "broadcast", "-p", "4",
                 "--count", "8", "--root", "3")
    assert res.exit_code == 0 and "op=none" in res.output


def test_each_command_is_found_in_the_module_the_table_names_and_no_other():
    """``refcoll check`` loads only its own module: the table of commands and their modules
    must name every command each module registers, and nothing more."""
    import importlib

    for module in set(cli.COMMANDS.values()):
        importlib.import_module(f"refcoll.cli.{module}")
    assert sorted(main.commands) == sorted(cli.COMMANDS)
    for name, command in cli.all_commands().items():
        assert command.callback.__module__ == f"refcoll.cli.{cli.COMMANDS[name]}", name


def test_a_command_loads_its_own_module_not_the_other_commands():
    code = ("import sys; from refcoll.cli import main\n"
            "try:\n    main(['check', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.startswith(('refcoll.cli.', 'refcoll.bench',"
            " 'refcoll.model', 'torch'))))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    loaded = res.stdout.strip().splitlines()[-1]
    assert "refcoll.cli.check" in loaded and "Usage: " in res.stdout, res.stdout + res.stderr
    for other in ("refcoll.cli.bench", "refcoll.cli.model", "refcoll.bench", "refcoll.model",
                  "'torch"):
        assert other not in loaded, loaded
