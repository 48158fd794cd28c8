"""refcoll bench --against gloo: torch's Gloo collectives timed beside refcoll's and MPI's.

The comma list of libraries, what Gloo lacks (checked against Gloo itself), the check of
Gloo's results (a wrong one is counted), and a real two-process run of
``--against mpi,gloo`` whose table and JSON carry Gloo's numbers.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import mpiexec_path

from refcoll.baselines import gloo
from refcoll.bench import BenchConfig, bench_header, format_header, libraries
from refcoll.cli import main
from refcoll.core.errors import UsageError
from refcoll.core.ops import DTYPES

needs_mpi = pytest.mark.skipif(mpiexec_path() is None,
                               reason="no mpiexec: install with pip install 'refcoll[mpi]'")


@pytest.mark.parametrize("against,chosen", [
    ("mpi", ("mpi",)), ("mpi,gloo", ("mpi", "gloo", "backend")),
    (" gloo , mpi ", ("gloo", "mpi", "backend")), ("none", ()),
    (["nccl", "gloo"], ("nccl", "gloo", "backend")), ("backend", ("backend",)),
    ("backend,gloo", ("backend", "gloo")),
])
def test_against_takes_one_library_or_a_comma_list(against, chosen):
    # gloo brings backend: torch's same calls on a backend="refcoll" group
    assert libraries(BenchConfig(against=against)) == chosen


@pytest.mark.parametrize("against,message", [
    ("gluu", "unknown baseline 'gluu': choose mpi, nccl, gloo, backend or none"),
    ("mpi,,gloo", "unknown baseline ''"),
    ("mpi,none", "--against mpi,none: none means no library"),
    ("gloo,mpi,gloo", "--against gloo,mpi,gloo names a library twice"),
])
def test_a_bad_library_list_is_a_usage_error(against, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        libraries(BenchConfig(against=against))


def test_against_gloo_without_torch_exits_2_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # importing torch now fails
    monkeypatch.setitem(sys.modules, "torch.distributed", None)
    res = CliRunner().invoke(main, ["bench", "-n", "2", "--against", "mpi,gloo"])
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 2 and len(lines) == 1, res.output
    assert "--against gloo needs PyTorch" in lines[0]
    assert "pip install 'refcoll[torch]'" in lines[0]


def test_what_gloo_lacks_is_a_note_and_no_column():
    from mpi4py import MPI

    assert gloo.gloo_unavailable("allreduce", "float32", "sum") is None
    assert gloo.gloo_unavailable("allreduce", "bfloat16", "avg") is None
    assert gloo.gloo_unavailable("allgather", "int32", "sum") is None
    assert "Gloo has no uint16 type" in gloo.gloo_unavailable("broadcast", "uint16")
    assert "Gloo has no average of integers (int64)" in gloo.gloo_unavailable("reduce", "int64",
                                                                             "avg")
    config = BenchConfig(sizes=[1024], algorithms=["ring"], against="mpi,gloo", dtype="uint32")
    header = bench_header(MPI.COMM_SELF, config)
    assert [(b["against"], b["available"]) for b in header["baselines"]] == [
        ("mpi", True), ("gloo", False), ("backend", True)]  # refcoll's backend carries uint32
    text = format_header(header)
    assert "# baseline: MPI_Allreduce on the same buffers, interleaved" in text
    assert "# baseline: none (Gloo has no uint32 type; torch's Gloo backend carries" in text
    titles = [line for line in text.splitlines() if "algorithm" in line][-1].split()
    assert "MPI" in titles and "backend" in titles and "Gloo" not in titles


@pytest.fixture
def torch_dist():
    pytest.importorskip("torch")
    import torch.distributed as dist

    return dist


def test_the_types_gloo_lacks_are_the_ones_gloo_refuses(torch_dist):
    """GLOO_DTYPES against Gloo itself: a one-process group, one all_reduce per type."""
    import torch

    import refcoll.torch

    dist = torch_dist
    created = not dist.is_initialized()
    refcoll.torch.init_process_group("gloo")
    try:
        runs = {}
        for name in DTYPES:
            tensor = torch.zeros(4, dtype=getattr(torch, name))
            try:
                dist.all_reduce(tensor)
                runs[name] = True
            except RuntimeError as exc:
                assert "Invalid scalar type" in str(exc)
                runs[name] = False
    finally:
        if created:
            dist.destroy_process_group()
    assert [name for name, ran in runs.items() if ran] == list(gloo.GLOO_DTYPES)


def test_gloo_results_are_checked_and_a_wrong_one_is_counted(torch_dist, monkeypatch):
    """One process, MPI_COMM_SELF: Gloo's result must be the expected one, bit for bit."""
    from mpi4py import MPI

    from refcoll.bench import run_bench

    dist = torch_dist
    monkeypatch.delenv("REFCOLL_WORKERS", raising=False)
    config = BenchConfig(sizes=[64, 4096], algorithms=["ring"], against="mpi,gloo", warmup=1,
                         iters=2, dtype="bfloat16", op="avg")
    rows = run_bench(MPI.COMM_SELF, config)
    for row in rows:  # MPI has no bfloat16: Gloo and the backend, avg checked (sums, divides)
        assert row["baseline"] is None and list(row["baselines"]) == ["gloo", "backend"]
        entry = row["baselines"]["gloo"]
        assert entry["baseline"] == "Gloo all_reduce" and entry["time_us"] > 0
        assert entry["wrong"] == 0 and entry["checked"] == 3 * row["count"]
        entry = row["baselines"]["backend"]
        assert entry["baseline"] == "all_reduce on backend=refcoll [ring]"
        assert entry["wrong"] == 0 and entry["checked"] == 3 * row["count"]
    real = dist.all_reduce

    def off_by_one(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        real(tensor, op=op, group=group)
        tensor.add_(1)  # every element wrong

    monkeypatch.setattr(dist, "all_reduce", off_by_one)
    (row,) = run_bench(MPI.COMM_SELF, BenchConfig(sizes=[64], algorithms=["ring"],
                                                  against="mpi,gloo", warmup=0, iters=2))
    assert row["wrong"] == 0 and row["baselines"]["mpi"]["wrong"] == 0
    assert row["baselines"]["gloo"]["wrong"] == row["baselines"]["gloo"]["checked"] == 2 * 16
    # the backend's calls are the same dist.all_reduce, on a "refcoll" group: counted too
    assert row["baselines"]["backend"]["wrong"] == row["baselines"]["backend"]["checked"] == 32
    assert not dist.is_initialized()  # the group the bench started is gone again


@needs_mpi
def test_a_real_run_shows_mpi_gloo_and_refcoll_side_by_side(torch_dist, tmp_path, monkeypatch):
    monkeypatch.setenv("REFCOLL_CACHE", str(tmp_path))
    monkeypatch.setenv("REFCOLL_CALIBRATION", "default")  # auto without measuring: a short run
    out, table = tmp_path / "bench.json", tmp_path / "bench.csv"
    res = subprocess.run([sys.executable, "-m", "refcoll", "bench", "-n", "2", "-b", "1K",
                          "-e", "8K", "-f", "8", "-w", "1", "-i", "2", "--against", "mpi,gloo",
                          "--json", str(out), "--csv", str(table)],
                         capture_output=True, text=True, timeout=150)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    titles = next(line for line in lines if line.startswith("#") and "algorithm" in line).split()
    # nccl-tests' thirteen, then the algorithm, MPI's two halves, Gloo's one, the backend's one.
    assert titles[-12:] == ["algorithm", "MPI", "busbw", "in-place", "busbw", "time/MPI", "Gloo",
                            "busbw", "time/Gloo", "backend", "busbw", "time/backend"]
    body = [line.split() for line in lines if line and not line.startswith("#")]
    assert [int(cells[0]) for cells in body] == [1024, 8192]
    for cells in body:
        assert cells[8] == cells[12] == "0"  # refcoll's #wrong, out of place and in place
        assert all(float(c) > 0 for c in (cells[14], cells[16], cells[19], cells[22]))
    assert "# Gloo all_reduce #wrong: 0" in lines and "# MPI_Allreduce #wrong: 0" in lines
    assert "# all_reduce on backend=refcoll [auto] #wrong: 0" in lines
    summary = json.loads(out.read_text())["summary"]["baselines"]
    assert [line for line in lines if line.startswith("# Avg bus bandwidth (")] == [
        f"# Avg bus bandwidth ({name}) : {summary[key]['avg_busbw']:g}" for name, key in (
            ("MPI_Allreduce", "mpi"), ("Gloo all_reduce", "gloo"),
            ("all_reduce on backend=refcoll [auto]", "backend"))]
    data = json.loads(out.read_text())
    assert data["header"]["against"] == "mpi,gloo" and data["header"]["versions"]["torch"]
    assert [b["name"] for b in data["header"]["baselines"]] == [
        "MPI_Allreduce", "Gloo all_reduce", "all_reduce on backend=refcoll [auto]"]
    for row in data["rows"]:
        assert row["algorithm"] == "auto" and row["wrong"] == 0
        assert row["baseline"] == "MPI_Allreduce" and row["base_wrong"] == 0
        entry = row["baselines"]["gloo"]
        assert entry["wrong"] == 0 and entry["checked"] == 3 * row["count"] * 2  # 3 runs, 2 ranks
        assert entry["inplace_time_us"] is None  # Gloo's halves: out of place only
        assert row["baselines"]["mpi"]["inplace_wrong"] == 0
        assert entry["time_over"] == pytest.approx(row["time_us"] / entry["time_us"])
        assert entry["busbw"] == pytest.approx(row["size"] / entry["time_us"] / 1e3)
    summary = data["summary"]["baselines"]
    assert summary["gloo"]["wrong"] == 0 and summary["gloo"]["avg_busbw"] > 0
    header_line = table.read_text().splitlines()[0].split(",")
    assert header_line[-10:] == ["gloo_baseline", "gloo_time_us", "gloo_busbw", "gloo_wrong",
                                 "time_over_gloo", "backend_baseline", "backend_time_us",
                                 "backend_busbw", "backend_wrong", "time_over_backend"]
    assert np.isfinite([float(v) for v in table.read_text().splitlines()[1].split(",")[-3:]]).all()


def test_the_backend_groups_environment_is_set_for_the_block_and_restored(monkeypatch):
    """The refcoll group is made with REFCOLL_ALGO set and REFCOLL_WATCH unset; after it,
    and after an error in it, both are as they were (set, or absent)."""
    monkeypatch.setenv("REFCOLL_WATCH", "gloo")
    monkeypatch.delenv("REFCOLL_ALGO", raising=False)
    with gloo._environment(REFCOLL_ALGO="allreduce=ring", REFCOLL_WATCH=None):
        assert os.environ["REFCOLL_ALGO"] == "allreduce=ring"
        assert "REFCOLL_WATCH" not in os.environ
    assert os.environ["REFCOLL_WATCH"] == "gloo" and "REFCOLL_ALGO" not in os.environ
    with pytest.raises(RuntimeError), gloo._environment(REFCOLL_WATCH="nccl"):
        raise RuntimeError("group creation failed")
    assert os.environ["REFCOLL_WATCH"] == "gloo"
