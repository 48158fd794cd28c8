"""Bad usage the CLI must refuse up front: one line, exit 2, no traceback, no work done."""

import time

import pytest
from click.testing import CliRunner

from refcoll.cli import commands, common, main
from refcoll.compressors.conformance import build_compressor_cases
from refcoll.core.errors import UsageError
from refcoll.verify import simulation
from refcoll.verify.conformance import build_cases


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def one_line_error(res, *fragments):
    """Assert exit 2 with a single ``refcoll: error:`` line holding every fragment."""
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1, res.output
    assert lines[0].startswith("refcoll: error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def no_launch(monkeypatch):
    """Outside an MPI job, with relaunching under mpiexec (and so any run) forbidden."""
    def forbidden(*args, **kwargs):
        raise AssertionError("relaunched under mpiexec although the usage was bad")

    monkeypatch.setattr("refcoll.cli.launch.in_mpi_job", lambda: False)
    monkeypatch.setattr(commands, "relaunch", forbidden)
    monkeypatch.setattr("refcoll.cli.train.relaunch", forbidden)
    monkeypatch.setattr("refcoll.cli.calibrate.relaunch", forbidden)
    monkeypatch.setattr("refcoll.cli.launch.relaunch", forbidden)  # bench's


@pytest.fixture
def no_simulation(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("simulated although the usage was bad")

    monkeypatch.setattr("refcoll.calls.collectives.simulate", forbidden)


# ----------------------------------------------------------------- -n below 1

@pytest.mark.parametrize("command", [["verify"], ["verify", "--compressor", "none"], ["train"]],
                         ids=["verify", "verify-compressor", "train"])
@pytest.mark.parametrize("n", [0, -1])
def test_a_process_count_below_one_is_refused_plainly(no_launch, command, n):
    line = one_line_error(invoke(*command, "-n", n), f"-n {n}", "at least 1", "give -n 1 or more")
    assert "switch" not in line


@pytest.mark.parametrize("args", [["bench", "-n", "0"], ["model", "--calibrate", "-n", "0"],
                                  ["bench", "-n", "-1", "--collective", "broadcast"]],
                         ids=["bench", "model-calibrate", "bench-rooted"])
def test_the_other_commands_with_n_refuse_it_too(no_launch, args):
    # Their own checks (refcoll/cli/bench.py, model.py) word it their way; a rooted bench
    # named the root first ("-r 0 is not one of the -1 data ranks").
    line = one_line_error(invoke(*args), "-n", "at least", args[2])
    assert "-r 0" not in line


@pytest.mark.parametrize("command", ["bench", "verify", "train", "calibrate"])
def test_more_processes_than_refcoll_starts_is_refused_before_mpiexec(no_launch, command):
    # calibrate had no upper bound: -n 5000 started 5000 ranks on the machine.
    one_line_error(invoke(command, "-n", 5000), "-n 5000: refcoll starts at most 4096 processes")


def test_require_processes_is_shared():
    common.require_processes(1)
    with pytest.raises(UsageError, match="-n 1: .* at least 2"):
        common.require_processes(1, minimum=2)


# ------------------------------------------------------- selections of no case

@pytest.mark.parametrize("args,fragments", [
    (["--algorithm", "dbtree", "--collective", "broadcast"],
     ["dbtree implements allreduce, not broadcast", "naive, tree, auto"]),
    (["--algorithm", "dbtree,ring", "--collective", "broadcast,reduce"],
     ["ring implements allreduce, reduce_scatter, allgather",
      "none implements broadcast or reduce"]),
    (["--algorithm", "naive", "--op", "prod", "--dtype", "float8_e5m2", "--collective", "reduce"],
     ["no selected op (prod) is defined on a selected dtype (float8_e5m2)"]),
    (["--sizes", ","], ["no size is selected"]),
    (["--algorithm", ","], ["no algorithm is selected"]),
    (["--compressor", "none", "--op", ","], ["no compressed case", "no op is selected"]),
    (["--compressor", "none", "--dtype", ","], ["no compressed case", "no dtype is selected"]),
    (["--compressor", "none", "--algorithm", ","], ["no all-reduce algorithm is selected"]),
], ids=["collective", "collectives", "op-dtype", "sizes", "algorithms", "compressor-op",
        "compressor-dtype", "compressor-algorithm"])
def test_a_selection_of_no_case_is_an_error_before_mpiexec(no_launch, args, fragments):
    one_line_error(invoke("verify", "-n", 2, *args), *fragments)


@pytest.mark.parametrize("args", [["--collective", "reduce"], ["--sizes", "7"],
                                  ["--inplace", "no"]])
def test_what_the_compressed_battery_has_not_is_refused_not_ignored(no_launch, args):
    # It ran the compressed all-reduces, said "32 passed" and exited 0.
    one_line_error(invoke("verify", "-n", 2, "--compressor", "fp16", *args), args[0],
                   "the compressed battery is all-reduces of its own cases and sizes")


def test_a_compressor_given_twice_is_run_once(monkeypatch):
    seen = []
    monkeypatch.setattr("refcoll.cli.launch.in_mpi_job", lambda: False)
    monkeypatch.setattr(commands, "relaunch", lambda n, env=None: None)
    monkeypatch.setattr(commands, "_verify_in_world",
                        lambda n, selection, *args: seen.append(selection))
    res = invoke("verify", "-n", 2, "--compressor", "fp16", "--compressor", " fp16",
                 "--collective", "ALL")  # (all, however spelled, is what it runs)
    assert res.exit_code == 0, res.output
    assert seen[0].filters["compressors"] == ["fp16"]


def test_a_selection_with_cases_still_relaunches(monkeypatch):
    seen = []
    monkeypatch.setattr("refcoll.cli.launch.in_mpi_job", lambda: False)
    monkeypatch.setattr(commands, "relaunch", lambda n, env=None: seen.append(n))
    monkeypatch.setattr(commands, "_verify_in_world", lambda *args, **kwargs: None)
    res = invoke("verify", "-n", 3, "--algorithm", "dbtree", "--collective", "allreduce")
    assert res.exit_code == 0, res.output
    assert seen == [3]


def test_build_cases_says_why_it_is_empty_only_when_asked():
    assert build_cases(4, algorithms_=["dbtree"], collectives=["broadcast"]) == []
    with pytest.raises(UsageError, match="dbtree implements allreduce, not broadcast"):
        build_cases(4, algorithms_=["dbtree"], collectives=["broadcast"], allow_empty=False)
    assert build_cases(4, algorithms_=["dbtree"], collectives=["allreduce"], allow_empty=False)
    assert build_compressor_cases(2, compressors=["none"], ops=[]) == []
    with pytest.raises(UsageError, match="no op is selected"):
        build_compressor_cases(2, compressors=["none"], ops=[], allow_empty=False)


# ------------------------------------------------------------ simulate's bounds

@pytest.mark.parametrize("world", [[], ["--ledger-only"]])
def test_simulate_refuses_a_bad_setting_in_either_world(monkeypatch, world):
    """The ledger-only world never read REFCOLL_TIMEOUT, and ran on a value the threaded
    world refuses."""
    monkeypatch.setenv("REFCOLL_TIMEOUT", "bogus")
    one_line_error(invoke("simulate", "--algorithm", "ring", "-p", 4, "--count", 4, *world),
                   "REFCOLL_TIMEOUT='bogus'")


def test_simulate_refuses_a_count_that_cannot_fit_in_memory(no_simulation):
    line = one_line_error(invoke("simulate", "--algorithm", "ring", "-p", 4,
                                 "--count", 100_000_000_000),
                          "needs about", "TiB", "MemAvailable", "lower --count or -p")
    assert "100000000000 x float32" in line


def test_the_estimate_of_a_pipelined_tree_replays_no_segment(monkeypatch, no_simulation):
    # dbtree's ledger counted its messages by replaying every segment: at 2**60 elements
    # the estimate itself filled the memory (killed) before it could refuse.
    from refcoll.algorithms import dbtree

    bounds = dbtree.segment_bounds

    def replayed(n, segment=None):
        assert n < 1 << 30, "the estimate replayed the segments of the whole count"
        return bounds(n, segment)

    monkeypatch.setattr(dbtree, "segment_bounds", replayed)
    line = one_line_error(invoke("simulate", "--algorithm", "dbtree", "-p", 3, "--count",
                                 2 ** 60, "--dtype", "float64", "--ledger-only"),
                          "needs about", "lower --count or -p")
    assert f"{2 ** 60} x float64" in line


def test_allgathers_outputs_count_in_the_estimate():
    ring = simulation.simulation_bytes("allreduce", 8, 1000, 4)
    gather = simulation.simulation_bytes("allgather", 8, 1000, 4)
    assert ring == 8 * 1000 * (3 * 4 + 8)
    assert gather == 8 * 1000 * ((2 + 2 * 8) * 4 + 8)  # bruck's packing: an output again


def test_without_meminfo_the_fixed_cap_holds(monkeypatch, tmp_path, no_simulation):
    monkeypatch.setattr(common, "_MEMINFO", str(tmp_path / "no-meminfo"))
    assert common.available_memory()[0] == common.FALLBACK_MEMORY_CAP
    count = common.FALLBACK_MEMORY_CAP // (3 * 4 + 8) // 4 + 1
    one_line_error(invoke("simulate", "--algorithm", "ring", "-p", 4, "--count", count),
                   "4.0 GiB of the fixed cap")


def test_a_memory_error_is_a_clear_exit_2(monkeypatch):
    def exhausted(*args, **kwargs):
        raise MemoryError("Unable to allocate 12.0 GiB for an array")

    monkeypatch.setattr("refcoll.calls.collectives.simulate", exhausted)
    one_line_error(invoke("simulate", "--algorithm", "ring", "-p", 2, "--count", 8),
                   "ran out of memory", "Unable to allocate 12.0 GiB", "lower --count or -p")


def test_gen_inputs_refuses_a_count_that_cannot_fit(tmp_path):
    one_line_error(invoke("gen-inputs", "-p", 2, "--count", 100_000_000_000, tmp_path / "in"),
                   "needs about", "lower --count or -p")
    assert not (tmp_path / "in").exists()


@pytest.mark.parametrize("p", [simulation.MAX_SIMULATED_RANKS + 1, 8192])
def test_simulate_bounds_the_simulated_ranks(no_simulation, p):
    one_line_error(invoke("simulate", "--algorithm", "ring", "-p", p, "--count", 1),
                   f"-p {p}", "threads", f"-p {simulation.MAX_SIMULATED_RANKS} or fewer")


@pytest.mark.parametrize("args,fragment", [(["-p", 0, "--count", 1], "-p 0"),
                                           (["-p", 2, "--count", -1], "--count -1")])
def test_simulate_refuses_nonsense_sizes(no_simulation, args, fragment):
    one_line_error(invoke("simulate", "--algorithm", "ring", *args), fragment)


def test_simulate_documents_its_limits():
    res = invoke("simulate", "--help")
    text = " ".join(res.output.split())
    assert f"1 to {simulation.MAX_SIMULATED_RANKS}" in text and "threads" in text
    assert "available memory" in text


def test_a_long_simulation_says_it_is_still_running(monkeypatch):
    import refcoll.calls.collectives

    real = refcoll.calls.collectives.simulate

    def slow(*args, **kwargs):
        time.sleep(0.3)
        return real(*args, **kwargs)

    monkeypatch.setattr(common, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr("refcoll.calls.collectives.simulate", slow)
    res = invoke("simulate", "--algorithm", "ring", "-p", 3, "--count", 5)
    assert res.exit_code == 0, res.output
    assert "refcoll: simulate ring -p 3: still running after" in res.output  # on stderr


# --------------------------------------------------------------- output paths

@pytest.mark.parametrize("args", [
    ["verify", "-n", 2, "--json", "{missing}/v.json"],
    ["verify", "-n", 2, "--compressor", "none", "--json", "{missing}/v.json"],
    ["simulate", "--algorithm", "ring", "-p", 2, "--count", 4, "--json", "{missing}/s.json"],
    ["check", "--json", "{missing}/c.json", "{tmp}", "{tmp}"],
    ["train", "-n", 2, "--json", "{missing}/t.json"],
    ["train", "-n", 2, "--plot", "{missing}/t.png"],
], ids=["verify", "verify-compressor", "simulate", "check", "train-json", "train-plot"])
def test_an_output_file_in_a_missing_folder_fails_before_the_run(no_launch, no_simulation,
                                                                 tmp_path, args):
    missing = tmp_path / "missing"
    args = [str(a).format(missing=missing, tmp=tmp_path) for a in args]
    flag = next(a for a in args if a in ("--json", "--plot"))
    one_line_error(invoke(*args), flag, f"folder {missing} does not exist", "create it first")


@pytest.mark.parametrize("command", ["gen-inputs", "oracle"])
def test_an_output_folder_under_a_file_fails_before_the_run(no_simulation, tmp_path, command):
    (tmp_path / "afile").write_text("")
    target = tmp_path / "afile" / "out"
    if command == "gen-inputs":
        args = ["gen-inputs", "-p", 2, "--count", 4, target]
    else:
        args = ["oracle", "--algorithm", "ring", tmp_path / "in", target]
    one_line_error(invoke(*args), "is a file, so the folder cannot be created")


def test_gen_inputs_still_creates_a_missing_folder(tmp_path):
    res = invoke("gen-inputs", "-p", 2, "--count", 4, tmp_path / "a" / "b")
    assert res.exit_code == 0, res.output
    assert (tmp_path / "a" / "b" / "rank1.npy").exists()


def test_arguments_problem_names_the_option_whose_value_differs():
    from refcoll.cli.launch import arguments_problem

    same = ["bench", "-b", "64", "-d", "float"]
    assert arguments_problem([same, list(same), list(same)]) is None
    problem = arguments_problem([same, same, ["bench", "-b", "64", "-d", "double"]])
    assert "rank 2 has '-d double' where rank 0 has '-d float'" in problem, problem
    problem = arguments_problem([same, same + ["--json", "x.json"]])
    assert "rank 1 has '--json x.json' where rank 0 has 'nothing'" in problem, problem


def test_a_job_whose_ranks_were_given_other_arguments_stops_before_any_work():
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    env["REFCOLL_TIMEOUT"] = "60"
    bench = [sys.executable, "-m", "refcoll", "bench", "-b", "64", "-e", "64", "-w", "0",
             "-i", "1", "--against", "none"]
    res = subprocess.run([str(Path(sys.executable).parent / "mpiexec"), "-n", "1", *bench,
                          "-d", "float", ":", "-n", "1", *bench, "-d", "double"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert "rank 1 has '-d double' where rank 0 has '-d float'" in res.stderr, res.stderr
    assert "#wrong" not in res.stdout and "Traceback" not in res.stderr


@pytest.mark.parametrize("args, fragments", [
    (["bench", "-n", "2", "-b", "256M", "-e", "1T", "-f", "4"], ["needs about", "lower -e"]),
    (["bench", "-n", "2", "-e", "64", "--json", "same.out", "--plot", "same.out"],
     ["--plot same.out: is the file of --json"]),
    (["bench", "-n", "2", "-e", "64", "--json", ""], ["--json '': give a file name"]),
])
def test_bench_refuses_what_it_could_not_finish_before_mpiexec(no_launch, monkeypatch, args,
                                                                 fragments):
    monkeypatch.setattr("refcoll.cli.launch.relaunch",
                        lambda *a, **k: pytest.fail("relaunched although the usage was bad"))
    monkeypatch.setattr(common, "available_memory", lambda: (16 << 30, "available (test)"))
    one_line_error(invoke(*args), *fragments)


def test_a_ledger_only_simulation_counts_its_ledger_against_memory(monkeypatch):
    monkeypatch.setattr(common, "available_memory", lambda: (8 << 30, "available (test)"))
    # a ring of 4096 ranks sends 2p(p-1) = 33.5M messages: about 16 GiB of ledger
    one_line_error(invoke("simulate", "--algorithm", "ring", "-p", "4096", "--count", "1",
                          "--ledger-only"), "needs about 16.", "lower --count or -p")
    assert simulation.simulation_case("ring", 64, 1).memory_bytes() < 8 << 20


def test_a_switch_without_room_for_its_ranks_is_refused_not_run_on_fewer():
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    env["REFCOLL_TIMEOUT"] = "60"
    res = subprocess.run([str(Path(sys.executable).parent / "mpiexec"), "-n", "2",
                          sys.executable, "-m", "refcoll", "bench", "-b", "1K", "-e", "1K",
                          "-w", "0", "-i", "1", "--algorithm", "switch,ring"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert "--algorithm switch needs 1 more ranks" in res.stderr, res.stderr
    assert "Avg bus bandwidth" not in res.stdout  # no row ran on fewer data ranks
    assert "# refcoll bench" not in res.stdout  # refused before the header, as documented


def test_the_jobs_size_is_noted_only_against_an_n_that_was_given():
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    env["REFCOLL_TIMEOUT"] = "60"
    base = [str(Path(sys.executable).parent / "mpiexec"), "-n", "3", sys.executable, "-m",
            "refcoll", "verify", "--backend", "mpi", "--collective", "allgather", "--dtype",
            "int8", "--sizes", "3"]
    quiet = subprocess.run(base, capture_output=True, text=True, timeout=120, env=env)
    told = subprocess.run(base + ["-n", "2"], capture_output=True, text=True, timeout=120,
                          env=env)
    assert quiet.returncode == 0 and told.returncode == 0, quiet.stderr + told.stderr
    assert "ignored" not in quiet.stderr
    assert "using it (-n 2 ignored)" in told.stderr, told.stderr


def test_a_process_count_no_machine_could_start_is_refused(no_launch):
    one_line_error(invoke("verify", "-n", "1000000"), "-n 1000000", "at most 4096")


def test_verify_refuses_sizes_this_machine_cannot_hold_before_mpiexec(no_launch):
    """--sizes 10000000000 went to mpiexec, where a 74.5 GiB allocation failed (or a case
    ran out of memory and was reported as the algorithm's failure)."""
    one_line_error(invoke("verify", "-n", 2, "--algorithm", "ring", "--collective", "allreduce",
                          "--op", "sum", "--dtype", "float32", "--sizes", 10**10),
                   "the largest case on 2 ranks of this machine needs about",
                   "select smaller --sizes")


def test_a_case_that_runs_out_of_memory_ends_the_battery_not_as_the_algorithms_failure(
        monkeypatch):
    from refcoll import SimWorld
    from refcoll.verify.conformance import Case, run_case
    from refcoll.verify.conformance import run as conformance

    real = conformance.COLLECTIVE_FUNCTIONS["allreduce"]

    def short_of_memory(x, t, **kwargs):
        if t.rank == 1:
            raise MemoryError("Unable to allocate 244. MiB")
        return real(x, t, **kwargs)

    monkeypatch.setitem(conformance.COLLECTIVE_FUNCTIONS, "allreduce", short_of_memory)
    case = Case("ring", "allreduce", "sum", "float32", 7, False, "exact", ranks=2, total=2)
    with pytest.raises(MemoryError, match="244"):
        SimWorld(2).run(lambda t: run_case(t, t.split(0, t.rank), case))


def test_switch_processes_start_only_for_a_selection_with_switch_cases(monkeypatch):
    # --collective reduce started "2 ranks + 1 switch processes": switch implements only
    # all-reduce, so the extra process ran no case and took a core.
    seen = []
    monkeypatch.setattr("refcoll.cli.launch.in_mpi_job", lambda: False)
    monkeypatch.setattr(commands, "relaunch", lambda n, env=None: seen.append(n))
    monkeypatch.setattr(commands, "_verify_in_world", lambda *args, **kwargs: None)
    for collective, processes in (("reduce", 2), ("allreduce", 3)):
        res = invoke("verify", "-n", 2, "--collective", collective, "--dtype", "int8",
                     "--sizes", "1", "--op", "sum")
        assert res.exit_code == 0, res.output
        assert seen.pop() == processes, collective
