"""Launch tests/backend/: torch.distributed's own calls on the "refcoll" backend, in a job.

Two processes under torchrun and three under mpiexec by default (three: the
orders of a sum of three differ, so the simulator's prediction is a real
check); four under either with -m slow. The serial tests below need no job.
"""

import subprocess
import sys

import pytest
from conftest import ROOT

torch = pytest.importorskip("torch", reason="the backend's tests need torch: pip install "
                                           "torch==2.13.0 (README's test command does)")

from test_torch import _run  # noqa: E402 - after the skip

SLOW = pytest.mark.slow


@pytest.mark.parametrize("launcher,p", [("torchrun", 2), ("mpiexec", 3),
                                        pytest.param("torchrun", 4, marks=SLOW),
                                        pytest.param("mpiexec", 4, marks=SLOW)])
def test_backend_suite(launcher, p):
    res = _run(launcher, p, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
               str(ROOT / "tests" / "backend"), REFCOLL_BACKEND_JOB="1")
    failures = [line for line in res.stdout.splitlines() if line.startswith(("FAILED", "E   "))]
    assert res.returncode == 0, (f"{launcher} with {p} processes failed; every rank's failure "
                                 "lines first (the first rank to fail is what the others "
                                 "met):\n" + "\n".join(failures[:60])
                                 + f"\n...\n{res.stdout[-6000:]}\n{res.stderr[-3000:]}")
    assert " passed" in res.stdout and " failed" not in res.stdout


# ------------------------------------------------------------- serial tests

from refcoll.calls.auto import AlgoFilter  # noqa: E402
from refcoll.core.errors import UsageError  # noqa: E402
from refcoll.torch.backend import COLLECTIVES, algorithms_from_env  # noqa: E402


def test_import_refcoll_torch_registers_the_backend():
    import torch.distributed as dist

    import refcoll.torch  # noqa: F401

    assert dist.Backend.REFCOLL == "refcoll" and "REFCOLL" in dist.Backend._plugins
    assert dist.Backend._plugins["REFCOLL"].creator_fn is not None


def test_refcoll_algo_one_name_or_one_per_collective():
    assert algorithms_from_env("") == dict.fromkeys(COLLECTIVES, "auto")
    ring = algorithms_from_env("ring")
    assert ring["allreduce"] == ring["allgather"] == ring["reduce_scatter"] == "ring"
    assert ring["broadcast"] == ring["reduce"] == "auto"  # no ring broadcast: auto
    assert algorithms_from_env("allreduce=tree, broadcast=tree")["broadcast"] == "tree"
    # one grammar with auto's: the colon form pins alike, and a list leaves auto to choose
    # (auto then reads the same value without refusing it)
    both = [algorithms_from_env(v) for v in ("allreduce=ring,allgather=bruck",
                                              "allreduce:ring;allgather:bruck")]
    assert both[0] == both[1] == dict(dict.fromkeys(COLLECTIVES, "auto"), allreduce="ring",
                                      allgather="bruck")
    assert AlgoFilter.parse("allreduce=ring,allgather=bruck").allowed("allgather") == ["bruck"]
    assert algorithms_from_env("allreduce:ring,tree")["allreduce"] == "auto"
    for bad, words in [("nosuch", "unknown algorithm 'nosuch'"),
                       ("gather=ring", "unknown collective 'gather'"),
                       ("broadcast=ring", "ring does not implement broadcast"),
                       ("allreduce=ring;allgather:bruck", "not both")]:
        with pytest.raises(UsageError, match=words):
            algorithms_from_env(bad)


def test_watch_modes_mpi_communicator_is_only_for_one_mpi_jobs_processes(monkeypatch):
    """Each group rank notes its MPI rank and world size; processes of other jobs (the same
    rank twice, another world size) or another launcher get no communicator, never a hang."""
    import torch.distributed as dist
    from mpi4py import MPI

    from refcoll.torch.launch import mpi_communicator

    for name in ("RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PMI_RANK", "0")
    me = f"{MPI.COMM_WORLD.Get_rank()} {MPI.COMM_WORLD.Get_size()}"
    for other in (me, f"1 {MPI.COMM_WORLD.Get_size() + 3}"):
        store = dist.HashStore()
        store.set("refcoll/mpi-rank/1", other)
        assert mpi_communicator(store, 0, 2) is None
        assert store.get("refcoll/mpi-rank/0").decode() == me
    monkeypatch.delenv("PMI_RANK")
    monkeypatch.setenv("RANK", "0")  # torchrun's processes: no MPI asked at all
    assert mpi_communicator(dist.HashStore(), 0, 2) is None


def test_python_m_refcoll_torch_runs_a_script_with_the_backend_registered(tmp_path):
    script = tmp_path / "s.py"
    (tmp_path / "beside.py").write_text("WORD = 'refcoll'\n")  # the script's own module
    script.write_text("import sys, torch.distributed as dist\n"
                      "from beside import WORD\n"
                      "assert dist.Backend.REFCOLL == WORD\n"
                      "print(dist.Backend.REFCOLL, sys.argv[1:])\n")
    res = subprocess.run([sys.executable, "-m", "refcoll.torch", str(script), "--backend",
                          "refcoll"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "refcoll ['--backend', 'refcoll']"
    res = subprocess.run([sys.executable, "-m", "refcoll.torch", str(tmp_path / "absent.py")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 2 and "no such script" in res.stderr


def test_a_peer_gone_when_a_message_is_posted_is_a_peer_failure():
    """gloo raises as a send or receive is posted to a peer that closed the connection, not
    only as it is waited for: that was a raw RuntimeError out of refcoll's call."""
    from refcoll.core.errors import PeerFailure
    from refcoll.transport.torch import TorchTransport

    t = TorchTransport.__new__(TorchTransport)  # no group: only the posting is judged
    t.rank, t.backend, t._ops, t.timeout, t.current_call = 1, "gloo", 0, 5.0, "allreduce"

    def post():
        raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:45678")

    with pytest.raises(PeerFailure, match=r"rank 1: allreduce over torch \(gloo\) failed at "
                                          r"its exchange 1 of this call, waiting to send 8 B "
                                          r"to rank 0: '\[pair.cc:553\] Connection closed"):
        t._posted(lambda: "to send 8 B to rank 0", post)
