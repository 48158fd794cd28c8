"""refcoll bench: sizes, bus factors, the expected results it checks against, schedules, the CLI."""

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import mpiexec_path

from refcoll import algorithms, simulate
from refcoll.algorithms.ring import ring_allreduce_cost as ring_allreduce
from refcoll.bench import (
    BenchConfig,
    _Item,
    _make_data,
    bus_factor,
    count_wrong,
    parse_size,
    schedule,
    size_sweep,
)
from refcoll.cli import main
from refcoll.core.errors import UsageError

needs_mpi = pytest.mark.skipif(mpiexec_path() is None,
                               reason="no mpiexec: install with pip install 'refcoll[mpi]'")


@pytest.mark.parametrize("text,nbytes", [
    ("8", 8), ("64K", 64 * 1024), ("64k", 65536), ("16M", 16 << 20), (" 1G ", 1 << 30), ("0", 0),
    ("8T", 8 << 40), ("1.5K", 1536), ("64KiB", 65536), ("1MiB", 1 << 20), ("1MB", 10 ** 6),
    ("8KB", 8000), ("8kB", 8000), ("2GB", 2 * 10 ** 9),
])
def test_sizes_follow_the_one_rule_of_core_units(text, nbytes):
    # A letter alone and KiB... are powers of 1024, as nccl-tests reads -e 128M; kB... of 1000.
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["-8", "", "K", "eight", "8X", "8KiBB", "inf"])
def test_a_bad_size_is_a_usage_error(text):
    with pytest.raises(UsageError, match="bad size"):
        parse_size(text)


def test_the_benchmark_scripts_read_sizes_by_the_same_rule():
    import importlib.util as util
    from pathlib import Path

    from refcoll.core import units

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "small_messages.py"
    spec = util.spec_from_file_location("small_messages", script)
    module = util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.parse_size is units.parse_size
    assert [module.parse_size(s) for s in ("4K", "1MB", "1MiB")] == [4096, 10 ** 6, 1 << 20]


def test_the_sweep_multiplies_up_to_the_largest_size():
    assert size_sweep(8, 64 * 1024, 8) == [8, 64, 512, 4096, 32768]
    assert size_sweep(1024, 1024, 2) == [1024]
    for args in [(0, 8, 2), (16, 8, 2), (8, 64, 1)]:
        with pytest.raises(UsageError):
            size_sweep(*args)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 17])
def test_bus_factors_are_nccl_tests_definitions(n):
    # doc/PERFORMANCE.md of nccl-tests: the bytes each rank's link must carry, per byte of S.
    assert bus_factor("allreduce", n) == pytest.approx(2 * (n - 1) / n)
    assert bus_factor("reduce_scatter", n) == pytest.approx((n - 1) / n)
    assert bus_factor("allgather", n) == pytest.approx((n - 1) / n)
    assert bus_factor("broadcast", n) == 1.0
    assert bus_factor("reduce", n) == 1.0


def test_count_wrong_counts_every_differing_element_bit_for_bit():
    want = np.arange(1000, dtype=np.float32)
    got = want.copy()
    assert count_wrong(got, want) == 0
    got[[3, 500, 999]] += 1
    got[0] = -0.0  # equal as a number, not as bits: a reduction order showing through
    assert count_wrong(got, want) == 4
    assert count_wrong(got[:10], want) == 1000  # a result of the wrong size is wrong throughout
    nan = np.full(4, np.nan, dtype=np.float64)
    assert count_wrong(nan, nan.copy()) == 0


class _NoComm:
    """Stands in for the participants' communicator in a one-rank check."""

    def Get_size(self):
        return 1  # the bounded barrier before each call has nothing to wait for


def test_the_check_catches_a_wrong_result_and_an_unwritten_one():
    config = BenchConfig(collective="allreduce", op="sum", dtype="float32")
    data = _make_data(config, 4096, 3, 1)
    right = data.expected.copy()
    wrong = right.copy()
    wrong[::100] += 1
    writes = {"right": lambda: np.copyto(data.out, right),
              "wrong": lambda: np.copyto(data.out, wrong),
              "nothing": lambda: None}
    counted = {}
    for name, call in writes.items():
        np.copyto(data.out, right)  # what the previous iteration left behind
        item = _Item("ours", name, _NoComm(), call, data.out, data)
        item.run(timed=True, check=True)
        counted[name] = (item.wrong, item.checked)
    assert counted["right"] == (0, 1024)
    assert counted["wrong"] == (len(range(0, 1024, 100)), 1024)
    assert counted["nothing"] == (1024, 1024)  # the buffer was poisoned before the call


class _FirstRankHas(_NoComm):
    """A communicator whose broadcast from the first rank brings what it sends of ``first``,
    its result: the result itself, or (after several calls) each call's digest of it."""

    def __init__(self, first: np.ndarray):
        self.first = first

    def Ibcast(self, message, root):
        from refcoll.bench.run import _digest

        assert root == 0
        buf = message[0]
        whole = self.first.view(np.uint8)
        buf[:] = whole if buf.size == whole.size else \
            np.frombuffer(_digest(self.first) * (buf.size // 16), np.uint8)
        return type("Done", (), {"Test": lambda self: True, "Wait": lambda self: None})()


def test_a_compressed_result_is_checked_against_the_first_ranks_bits():
    """Lossy by design, so no expected bits: but every rank must hold the same (a rank
    whose result differs from the first rank's is wrong in each element that differs)."""
    config = BenchConfig(collective="allreduce", op="sum", dtype="float32")
    data = _make_data(config, 4096, 2, 1)
    mine = np.arange(1024, dtype=np.float32)
    theirs = mine.copy()
    theirs[[5, 700]] += 1
    for first, wrong in ((mine, 0), (theirs, 2)):
        item = _Item("ours", "ring", _FirstRankHas(first), lambda: mine.copy(), None, data,
                     agree=True)
        item.run(timed=True, check=True)
        assert (item.wrong, item.checked) == (wrong, 1024)  # element by element
        item = _Item("ours", "ring", _FirstRankHas(first), lambda: mine.copy(), None, data,
                     agree=True)
        item.run(timed=True, check=True, calls=2)  # -m 2: by digests, every element if not
        assert (item.wrong, item.checked) == (2 * 1024 if wrong else 0, 2 * 1024)
    item = _Item("ours", "ring", _FirstRankHas(theirs), lambda: mine.copy(), None, data,
                 agree=True)
    item.run(timed=True, check=False)  # -c 0: nothing compared
    assert (item.wrong, item.checked) == (0, 0)
    seen = []  # -m 3: the calls back to back, the broadcasts after them (no pacing between)
    comm = _FirstRankHas(mine)
    ibcast = comm.Ibcast
    comm.Ibcast = lambda message, root: (seen.append("broadcast"), ibcast(message, root))[1]
    item = _Item("ours", "ring", comm, lambda: (seen.append("call"), mine.copy())[1], None,
                 data, agree=True)
    item.run(timed=True, check=True, calls=3)
    assert seen == ["call"] * 3 + ["broadcast"] and item.wrong == 0  # (one, of 3 digests)


@pytest.mark.parametrize("collective,op,dtype", [
    ("allreduce", "sum", "float32"), ("allreduce", "avg", "bfloat16"),
    ("allreduce", "prod", "int8"),
    ("reduce_scatter", "max", "float64"), ("allgather", "sum", "uint16"),
    ("broadcast", "sum", "float16"), ("reduce", "min", "float32"),
])
def test_the_expected_result_is_what_every_algorithm_returns(collective, op, dtype):
    p = 3
    config = BenchConfig(collective=collective, op=op, dtype=dtype)
    datas = [_make_data(config, 1000, p, r) for r in range(p)]
    for name in algorithms.names(collective):
        if algorithms.get(name).workers is not None:
            continue
        result = simulate(collective, [d.x for d in datas], algorithm=name, op=op)
        for r, (d, got) in enumerate(zip(datas, result.outputs)):
            if d.expected is None:
                assert got is None and collective == "reduce" and r != 0
                continue
            assert count_wrong(got, d.expected) == 0, (name, r)
            assert count_wrong(d.poison, d.expected) == d.expected.size


def test_the_schedule_is_the_ledger_and_matches_the_cost_formula():
    p, n = 4, 1001
    plans = schedule("allreduce", "ring", p, n, "float32")
    sends = [(r, step, dest, nbytes) for r, plan in enumerate(plans)
             for step, out, _, _ in plan for dest, nbytes in out]
    recvs = sorted((source, step, r, nbytes) for r, plan in enumerate(plans)
                   for step, _, inbox, _ in plan for source, nbytes in inbox)
    assert sorted(sends) == recvs  # every send has its receive, in the same step
    cost = ring_allreduce(p, n, 4)
    assert len(sends) == cost.messages
    assert sum(nbytes for *_, nbytes in sends) == cost.bytes
    assert max(sum(e for *_, reds in plan for e in reds) for plan in plans) == cost.reduced
    assert all([s for s, *_ in plan] == sorted({s for s, *_ in plan}) for plan in plans)


def test_a_switch_run_starts_the_switch_processes_too(monkeypatch, launched):
    from refcoll.algorithms.switch import switch_count

    seen = launched
    res = CliRunner().invoke(main, ["bench", "-n", "5", "--algorithm", "switch,ring"])
    assert res.exit_code == 0, res.output
    assert seen["cmd"][:3] == ["mpiexec", "-n", str(5 + switch_count(5))]
    assert seen["env"]["REFCOLL_WORKERS"] == "5"


@pytest.fixture
def no_gpu(monkeypatch):
    """A Python where ``import cupy`` fails, as on a machine without a GPU."""
    from refcoll.core import xp as xp_module

    monkeypatch.setitem(sys.modules, "cupy", None)
    xp_module._cupy_state.cache_clear()
    yield
    xp_module._cupy_state.cache_clear()


@pytest.mark.parametrize("args,message", [
    (["--against", "nccl"], "--against nccl needs --device gpu (NCCL runs on GPUs)"),
    (["--device", "gpu"], "--device gpu needs a CUDA GPU and CuPy: CuPy is not installed"),
    (["--device", "gpu", "--against", "nccl"], "--device gpu needs a CUDA GPU and CuPy"),
    (["-b", "1.5X"], "bad -b/--minbytes '1.5X'"),
    (["-e", "64Q"], "bad -e/--maxbytes '64Q'"),
    (["-f", "1"], "step factor"),
    (["--algorithm", "rung"], "unknown algorithm 'rung'"),
    (["--algorithm", "tree", "--collective", "allgather"], "does not implement allgather"),
    (["--compressor", "topk", "--algorithm", "switch"], "switch"),
    (["--against", "mpi,gluu"], "unknown baseline 'gluu': choose mpi, nccl, gloo, backend or none"),
    (["--against", "mpi,none"], "--against mpi,none: none means no library"),
    (["--against", "mpi,nccl"], "--against nccl needs --device gpu (NCCL runs on GPUs)"),
])
def test_what_cannot_run_here_exits_2_with_one_line(no_gpu, args, message):
    res = CliRunner().invoke(main, ["bench", "-n", "2", *args])
    assert res.exit_code == 2
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], res.output


def test_plot_without_matplotlib_exits_2(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # importing it now fails
    res = CliRunner().invoke(main, ["bench", "-n", "2", "--plot", "out.png"])
    assert res.exit_code == 2
    assert "pip install 'refcoll[plot]'" in res.output


def test_the_plot_draws_each_dtype_and_op_as_the_table_prints_it(monkeypatch):
    pytest.importorskip("matplotlib", reason="matplotlib draws the plot (the plot extra)")
    from refcoll.bench import report

    drawn = []
    monkeypatch.setattr(report, "save", lambda fig, path, **kw: drawn.append(fig))
    rows = [{"algorithm": "ring", "size": size, "busbw": busbw, "dtype": dtype, "op": "sum",
             "root": -1, "baselines": {"mpi": {"baseline": "MPI_Allreduce", "busbw": 1.0}}}
            for dtype, busbw in (("float32", 2.0), ("int8", 3.0)) for size in (1024, 4096)]
    report.plot(rows, "unused.png")
    lines = {line.get_label(): list(line.get_ydata()) for line in drawn[0].axes[0].get_lines()}
    assert lines == {"ring (float32 sum)": [2.0, 2.0], "ring (int8 sum)": [3.0, 3.0],
                     "MPI_Allreduce (float32 sum)": [1.0, 1.0],
                     "MPI_Allreduce (int8 sum)": [1.0, 1.0]}
    report.plot(rows[:2], "unused.png")  # one dtype and op: the names alone
    assert {line.get_label() for line in drawn[1].axes[0].get_lines()} == {"ring",
                                                                           "MPI_Allreduce"}


@needs_mpi
def test_a_real_sweep_reports_every_size_and_algorithm(tmp_path, monkeypatch):
    monkeypatch.setenv("REFCOLL_CACHE", str(tmp_path))  # auto's calibration, kept out of $HOME
    out, table = tmp_path / "bench.json", tmp_path / "bench.csv"
    args = [sys.executable, "-m", "refcoll", "bench", "-n", "2", "-b", "8", "-e", "64K", "-f", "8",
            "--algorithm", "ring,auto", "-i", "3", "-w", "1", "--bound", "--json", str(out),
            "--csv", str(table)]
    png = tmp_path / "bench.png" if importlib.util.find_spec("matplotlib") else None
    if png is not None:
        args += ["--plot", str(png)]
    res = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(out.read_text())
    header, rows = data["header"], data["rows"]
    assert header["workers"] == 2 and header["validate"] is False
    assert header["mpi"]["library"] and header["machine"]["cpus"]
    sizes = [8, 64, 512, 4096, 32768]
    assert [(r["size"], r["algorithm"]) for r in rows] == [(s, a) for s in sizes
                                                          for a in ("ring", "auto")]
    for row in rows:
        assert row["count"] == row["size"] // 4
        assert row["wrong"] == 0 and row["checked"] == 4 * row["count"] * 2  # 4 runs, 2 ranks
        assert row["algbw"] == pytest.approx(row["size"] / (row["time_us"] * 1e-6) / 1e9)
        assert row["busbw"] == pytest.approx(row["algbw"] * 2 * (2 - 1) / 2)
        assert row["baseline"] == "MPI_Allreduce" and row["base_wrong"] == 0
        assert row["time_over_base"] == pytest.approx(row["time_us"] / row["base_time_us"])
        assert row["bound_us"] > 0
        assert row["time_over_bound"] == pytest.approx(row["time_us"] / row["bound_us"])
    assert all(r["resolved"] in algorithms.names("allreduce") for r in rows
               if r["algorithm"] == "auto")
    assert data["summary"]["passed"] and data["summary"]["wrong"] == 0
    assert len(table.read_text().splitlines()) == 1 + len(rows)
    assert "#wrong: 0 of" in res.stdout and "validate=False" in res.stdout
    for row in rows:  # the in-place half, refcoll's and MPI's (MPI_IN_PLACE)
        assert row["inplace_wrong"] == 0 and row["inplace_checked"] == row["checked"]
        assert row["base_inplace_wrong"] == 0 and row["base_inplace_time_us"] > 0
    # nccl-tests' closing lines: the plain average is the algorithm under test's (ring, the
    # first), both halves, and a script that takes the line's last field reads it.
    (plain,) = [line for line in res.stdout.splitlines()
                if line.startswith("# Avg bus bandwidth ") and "(" not in line]
    ring = [v for r in rows if r["algorithm"] == "ring" for v in (r["busbw"], r["inplace_busbw"])]
    assert float(plain.split()[-1]) == float(f"{sum(ring) / len(ring):g}")
    assert "# Out of bounds values : 0 OK" in res.stdout
    if png is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_mpi
def test_aggregated_iterations_run_and_check_each_call_back_to_back(tmp_path, monkeypatch):
    """-m 3: every timed iteration makes each call 3 times, each one checked on its own."""
    monkeypatch.setenv("REFCOLL_CACHE", str(tmp_path))
    out = tmp_path / "bench.json"
    base = [sys.executable, "-m", "refcoll", "bench", "-n", "2", "-b", "1K", "-e", "1K",
            "--algorithm", "ring", "-w", "1", "-i", "2"]
    res = subprocess.run(base + ["-m", "3", "--json", str(out)], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(out.read_text())
    assert data["header"]["agg"] == 3
    (row,) = data["rows"]
    runs = 1 + 2 * 3  # one warm-up call, then 2 timed iterations of 3 calls
    assert row["wrong"] == 0 and row["checked"] == runs * row["count"] * 2  # 2 ranks
    assert row["inplace_checked"] == row["checked"] and row["base_wrong"] == 0
    assert "2 timed per size, 3 calls back to back in each" in res.stdout
    assert "median over the timed calls (3 in each iteration)" in res.stdout
    nccl = subprocess.run(base + ["-m", "3", "--format", "nccl-tests"], capture_output=True,
                          text=True, timeout=120)
    assert nccl.returncode == 0 and " agg iters: 3 " in nccl.stdout, nccl.stdout + nccl.stderr


# ----------------------------------------------- nccl-tests' sizes, roots and refusals

@pytest.mark.parametrize("collective,nbytes,itemsize,n,count", [
    ("reduce_scatter", 64, 4, 3, 12),         # 16 floats, 5 a rank, trimmed to 4 (16 B)
    ("allgather", 1 << 20, 4, 3, 87380 * 3),  # not 87381 a rank: not a multiple of 4
    ("reduce_scatter", 8, 4, 2, 0),           # nccl-tests prints a 0-byte row here
    ("allgather", 24, 8, 2, 0),               # one double a rank: less than 16 bytes
    ("allgather", 64, 1, 3, 48),              # int8: 21 a rank, trimmed to 16
    ("allreduce", 60, 4, 3, 15), ("broadcast", 10, 4, 3, 2), ("reduce", 8, 8, 5, 1),
])
def test_sizes_are_trimmed_as_nccl_tests_get_coll_byte_count_trims_them(
        collective, nbytes, itemsize, n, count):
    from refcoll.bench import element_count

    assert element_count(collective, nbytes, itemsize, n) == count


def test_root_minus_one_runs_every_root_and_below_it_is_refused():
    from refcoll.bench.config import check_config, root_runs

    every = BenchConfig(collective="reduce", root=-1, algorithms=["tree"])
    assert [run.root for run in root_runs(every, 3)] == [0, 1, 2]
    assert root_runs(BenchConfig(root=-1), 3) == [BenchConfig(root=-1)]  # allreduce: no root
    check_config(every, 3)
    with pytest.raises(UsageError, match="or -1 for every root in turn as nccl-tests takes it"):
        check_config(BenchConfig(collective="reduce", root=-2, algorithms=["tree"]), 3)


@pytest.mark.parametrize("args,message", [
    (["--against", "nccl", "--nccl-algo", "Rung"], "NCCL has no algorithm 'Rung'"),
    (["--nccl-proto", "LL"], "--nccl-algo and --nccl-proto choose NCCL's algorithm: they go "
                             "with --against nccl"),
    (["--against", "mpi:rung"], "has no allreduce algorithm 'rung'"),
    (["--collective", "broadcast", "--algorithm", "tree", "-r", "2"],
     "-r 2 is not one of the 2 data ranks"),
    (["-d", "floaty"], "unknown dtype 'floaty'"),
    (["-d", "float,all"], "unknown dtype 'all'"),
    (["-o", "sum,mulsum"], "unknown op 'mulsum'"),
    (["-a", "7"], "-a takes 0 (rank 0), 1 (mean), 2 (min) or 3 (max)"),
    (["-m", "0"], "aggregated calls >= 1, got -w 5 -i 20 -m 0"),
    (["--agg-iters", "two"], "-m/--agg-iters 'two': not a number"),
    (["-a", "mean"], "-a/--average 'mean': not a number"),
    (["-c", "-1"], "-c/--check -1: must be at least 0"),
    (["-r", "one"], "-r/--root 'one': not a number"),
    (["-b", "1X"], "bad -b/--minbytes '1X': cannot read a size"),
    (["-e", "64Q"], "bad -e/--maxbytes '64Q': cannot read a size"),
    (["-f", "x"], "-f/--stepfactor 'x': not a number"),
    (["--collective", "alltoall"], "--collective 'alltoall': choose one of allreduce"),
    (["--format", "nccl"], "--format 'nccl': choose one of refcoll, nccl-tests"),
    (["--device", "tpu"], "--device 'tpu': choose one of cpu, gpu"),
    (["--collective", "reduce_scatter", "--against", "mpi:ring"],
     "MPICH 5.0 has no reduce_scatter algorithm 'ring'; it has: "),
    (["--collective", "allgather", "--against", "mpi:reduce_scatter_allgather"],
     "has no allgather algorithm 'reduce_scatter_allgather'"),
    # an option's value the algorithm refuses: by its own check, before the launch
    (["--algorithm", "tree(radix=1)"], "radix must be an integer >= 2"),
    (["--algorithm", "hierarchical(pipeline=0)"], "pipeline must be a whole number of segments"),
    (["--algorithm", "ring(start=99)", "-d", "float32,int8"], "ring start must be one of"),
])
def test_nccl_tests_options_refuse_what_cannot_run_in_one_line(monkeypatch, args, message):
    monkeypatch.setattr("refcoll.cli.launch.in_mpi_job", lambda: False)
    monkeypatch.setattr("refcoll.baselines.mpi_algorithms.installed_library", lambda: "mpich")
    res = CliRunner().invoke(main, ["bench", "-n", "2", *args])
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and message in lines[0], res.output


def test_a_decimal_size_is_run_as_written_and_said_to_differ_from_nccl_tests(monkeypatch, launched):
    from refcoll.cli.bench import decimal_size_note

    assert decimal_size_note("-e", "1M") is None and decimal_size_note("-e", "1MiB") is None
    assert decimal_size_note("-b", "4096") is None
    seen = launched
    res = CliRunner().invoke(main, ["bench", "-n", "2", "-b", "1K", "-e", "1GB"])
    assert res.exit_code == 0 and seen["cmd"][:3] == ["mpiexec", "-n", "2"], res.output
    assert res.output.splitlines() == [
        "refcoll: note: -e 1GB is 1,000,000,000 B (a power of 1000); nccl-tests reads 1GB as "
        "1,073,741,824 B: write 1G for that"]


def test_bench_refuses_a_sweep_without_elements_and_bound_with_a_compressor():
    from refcoll.bench.config import BenchConfig, check_config
    from refcoll.core.errors import UsageError

    with pytest.raises(UsageError, match="holds an element of float32"):
        check_config(BenchConfig(sizes=[3], algorithms=["ring"]), 2)
    with pytest.raises(UsageError, match="16-byte words"):  # 8 B a rank of 3: no whole word
        check_config(BenchConfig(sizes=[8, 32], algorithms=["ring"], collective="allgather"), 3)
    check_config(BenchConfig(sizes=[3, 4], algorithms=["ring"]), 2)  # one size holds some
    with pytest.raises(UsageError, match="does not run with --compressor"):
        check_config(BenchConfig(sizes=[4096], algorithms=["ring"], compressor="fp16",
                                 bound=True), 2)


def test_the_backend_baseline_says_why_it_cannot_take_an_algorithms_options():
    from refcoll.baselines.gloo import backend_unavailable

    assert backend_unavailable("tree", "allreduce", "cpu") is None
    assert "without the options of tree(segment=64)" in backend_unavailable(
        "tree(segment=64)", "allreduce", "cpu")
    assert "switch processes" in backend_unavailable("switch", "allreduce", "cpu")
    assert "switch processes" not in backend_unavailable("bruck", "allreduce", "cpu")


@needs_mpi
def test_under_a_users_own_mpiexec_notes_and_memory_are_as_under_benchs(tmp_path, monkeypatch):
    # Only the launch bench makes checked the memory and gave the decimal note: under a
    # user's mpiexec a size past any host's memory was a ValueError's traceback, exit 1.
    monkeypatch.setenv("REFCOLL_CACHE", str(tmp_path))
    env = {k: v for k, v in __import__("os").environ.items() if k != "REFCOLL_BENCH_BAR"}
    base = [mpiexec_path(), "-n", "2", sys.executable, "-m", "refcoll", "bench", "-i", "1",
            "-w", "0", "--algorithm", "ring"]
    huge = subprocess.run(base + ["-b", "1e30", "-e", "1e30"], capture_output=True, text=True,
                          timeout=120, env=env)
    errors = [line for line in huge.stderr.splitlines() if line.startswith("refcoll: error:")]
    assert huge.returncode == 2 and len(errors) == 2, huge.stdout + huge.stderr
    assert "Traceback" not in huge.stderr and "needs about" in errors[0]
    assert not huge.stdout.strip(), huge.stdout  # refused before any table line
    small = subprocess.run(base + ["-b", "1kB", "-e", "1kB"], capture_output=True, text=True,
                           timeout=120, env=env)
    assert small.returncode == 0, small.stdout + small.stderr
    notes = [line for line in small.stderr.splitlines() if line.startswith("refcoll: note:")]
    from refcoll.cli.bench import decimal_size_note

    assert notes == [f"refcoll: note: {decimal_size_note(option, '1kB')}"
                     for option in ("-b", "-e")]  # once, from rank 0
    refused = subprocess.run(base[:-1] + ["tree(radix=1)", "-b", "64", "-e", "64"],
                             capture_output=True, text=True, timeout=120, env=env)
    errors = [line for line in refused.stderr.splitlines() if "radix must be" in line]
    assert refused.returncode == 2 and len(errors) == 2 and not refused.stdout.strip(), \
        refused.stdout + refused.stderr
