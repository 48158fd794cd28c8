"""Faults over a real network: a cut link, a slow node, a killed node, a delayed link.

On the emulated cluster (tests/test_cluster.py builds and checks it), MPICH's
``mpiexec`` runs on node 1. Each rank's stderr goes to a file of its own: a cut
link keeps node 2's messages from ever reaching ``mpiexec``. The fault comes once
the job has provably started (rank 0 has written a file after k calls, or its
``REFCOLL_DEBUG_FILE`` holds k lines), and the job is then watched from outside:
when ``mpiexec`` returns, and when each node's namespace holds no process.

The bounds asserted are guards against a hang (:data:`GUARD`), far above what
was measured, so that a loaded machine cannot fail them; the measured figures
are printed (``pytest -s``). They were, with ``REFCOLL_TIMEOUT=5`` on a 2-core
machine: every rank's error 5.0 to 6.5 s after the cut (the deadline, then
``ABORT_GRACE`` or the watchdog's period; once 11 s, in ``refcoll verify``, whose
node-local cases went on before a wait crossed the cut), the job ended on both
sides 6.0 to 6.6 s after it; a killed node ended the job in 0.1 s.

These need CAP_NET_ADMIN (CI runs as root); elsewhere they skip, saying why.
Every test ends with no process in the cluster's namespaces and no namespace.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import ROOT, mpiexec_path
from test_cluster import host_view, leftovers, needs_root

from refcoll.cluster import Cluster, ClusterError, launch
from refcoll.transport.deadline import TIMEOUT_STATUS

needs_mpiexec = pytest.mark.skipif(mpiexec_path() is None,
                                   reason="no mpiexec: pip install 'refcoll[mpi]'")

#: REFCOLL_TIMEOUT of every faulted job, in seconds.
TIMEOUT = 5

#: Seconds after the fault by which everything must have happened: a guard against a hang,
#: not a figure (the job ended 6.6 s after a cut at most, measured).
GUARD = 120

#: Seconds a job may take to start and reach its first calls (a guard as well).
START_GUARD = 300


# --------------------------------------------------------------------------- helpers

@pytest.fixture
def untouched_host():
    before = host_view()
    yield
    assert host_view() == before, "the host's own namespace changed"


def _pids(ns: str) -> list[str]:
    return subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                          text=True).stdout.split()


@dataclass(repr=False)
class Faulted:
    """What a job did after its fault; every time in seconds after the fault."""

    returncode: int | None
    stdout: str
    stderr: str  # mpiexec's own (the ranks' stderr went to their files)
    ended: dict  # "mpiexec" and each node number -> when it ended (its namespace emptied)
    errors: dict = field(default_factory=dict)  # rank -> (its stderr, when last written)
    at: float = 0.0  # the fault's wall-clock time (time.time())

    def __str__(self) -> str:
        errors = "".join(f"--- rank {r} ({t:.2f} s):\n{text[-1500:]}\n"
                         for r, (text, t) in sorted(self.errors.items()))
        return (f"exit {self.returncode}, ended {self.figures()}\n{errors}"
                f"--- mpiexec's stderr:\n{self.stderr[-3000:]}\n--- stdout:\n{self.stdout[-3000:]}")

    __repr__ = __str__

    def figures(self) -> dict:
        return {k: round(v, 2) for k, v in self.ended.items()}


def faulted_run(cluster: Cluster, command: list[str], *, env: dict, started, fault,
                folder: Path) -> Faulted:
    """Run ``command`` across the nodes; once ``started(stdout so far)``, call ``fault()``.

    Then wait, up to :data:`GUARD` seconds, until ``mpiexec`` has returned and
    every node's namespace is empty, noting when each happened. ``mpiexec`` is
    started as :func:`refcoll.cluster.launch.run` starts it, not through
    :meth:`Cluster.run`, which would kill what is left (the test looks for it).
    """
    wrapped = ["sh", "-c", 'exec "$@" 2>"$0/err.$PMI_RANK"', str(folder), *command]
    out: list[str] = []
    with tempfile.TemporaryDirectory(prefix="refcoll-faults-") as tmp:
        proc = subprocess.Popen(launch.mpiexec_argv(cluster, wrapped, Path(tmp)),
                                env={**os.environ, **launch.environment(cluster), **env},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        err: list[str] = []
        readers = [threading.Thread(target=lambda s=s, into=into: into.extend(s), daemon=True)
                   for s, into in ((proc.stdout, out), (proc.stderr, err))]
        for reader in readers:
            reader.start()
        try:
            begun = time.monotonic()
            while not started("".join(out)):
                if proc.poll() is not None or time.monotonic() - begun > START_GUARD:
                    for reader in readers:
                        reader.join(5)
                    pytest.fail(f"the job ended or hung before the fault: exit "
                                f"{proc.poll()}\n{''.join(out)[-3000:]}{''.join(err)[-3000:]}")
                time.sleep(0.05)
            fault_at, wall = time.monotonic(), time.time()
            fault()
            ended: dict = {}
            nodes = {i: cluster.node_ns(i) for i in range(1, cluster.spec.nodes + 1)}
            while len(ended) < len(nodes) + 1 and time.monotonic() - fault_at < GUARD:
                now = time.monotonic() - fault_at
                if "mpiexec" not in ended and proc.poll() is not None:
                    ended["mpiexec"] = now
                for i, ns in nodes.items():
                    if i not in ended and not _pids(ns):
                        ended[i] = now
                time.sleep(0.1)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for reader in readers:
                reader.join(5)
    errors = {int(p.name.split(".")[1]): (p.read_text(errors="replace"),
                                          p.stat().st_mtime - wall)
              for p in folder.glob("err.*")}
    return Faulted(proc.returncode, "".join(out), "".join(err), ended, errors, wall)


def cut_link(cluster: Cluster, node: int = 2):
    """The fault: node ``node``'s link down, at the hub's end (its cable pulled)."""
    return lambda: subprocess.run(["ip", "-n", cluster.hub, "link", "set", f"v{node}", "down"],
                                  check=True)


def kill_node(cluster: Cluster, node: int):
    """The fault: SIGKILL to every process of node ``node`` (its ranks, its MPI proxy)."""
    def kill():
        for pid in _pids(cluster.node_ns(node)):
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    return kill


def rank_hosts(cluster: Cluster) -> dict[int, str]:
    """Each rank's host: MPICH places ranks on the nodes by block, as the hostfile lists them."""
    out, rank = {}, 0
    for i in range(1, cluster.spec.nodes + 1):
        for _ in range(cluster.spec.ranks(i)):
            out[rank] = cluster.host(i)
            rank += 1
    return out


#: A timeout's message: a wait's (the transport's, which names the peer it waited for with
#: its host, or a nonblocking collective's, which MPI cannot say who is missing from), or the
#: watchdog's, for a blocking call of the MPI library.
TIMEOUT_MESSAGE = re.compile(rf"rank (\d+): .*(timed out after|has not returned after) {TIMEOUT} s")
PEER = re.compile(r"rank (\d+) \(host ([^)\s]+)\)")


def check_message(text: str, hosts: dict[int, str], rank: int | None = None) -> None:
    """Check one rank's timeout message: it names each peer it waited for with that peer's host.

    ``rank``: the rank's in the world, when the wait was on the world's communicator (the
    ranks a message names are those of the communicator waited on: in a command, a split
    one's, such as the node leaders' of a hierarchical all-reduce); then the message names
    the rank and each peer's host is that of the peer's world rank.
    """
    found = TIMEOUT_MESSAGE.search(text)
    assert found, text[-2000:]
    line = text[found.start():].splitlines()[0]
    peers = PEER.findall(line)
    # A point-to-point wait names its peer and the peer's host; a nonblocking collective
    # (MPI_Comm_idup, MPI_Ibarrier) completes on all ranks or none, and says so instead; the
    # watchdog names the call.
    assert peers or "MPI cannot tell which" in line or "has not returned" in line, line
    for peer, host in peers:
        assert host in hosts.values(), line
        if rank is not None:
            assert int(found.group(1)) == rank and host == hosts[int(peer)], line


def check_ended(run: Faulted, cluster: Cluster) -> None:
    """The job ended on both sides of the fault, by itself, leaving no process behind."""
    nodes = range(1, cluster.spec.nodes + 1)
    assert "mpiexec" in run.ended, f"mpiexec did not return within {GUARD} s: {run}"
    assert all(i in run.ended for i in nodes), f"processes outlived the job: {run}"
    assert run.returncode != 0, run


def loop_script(folder: Path, handling: str) -> Path:
    """A user's program: all-reduces in a loop until one fails; each rank notes what it raised.

    ``handling``: ``raise`` lets the exception go uncaught, ``abort_job`` catches it and
    ends the job with refcoll's :func:`~refcoll.transport.deadline.abort_job`.
    """
    script = folder / "job.py"
    script.write_text(
        "import time\nimport numpy as np\nfrom mpi4py import MPI\nimport refcoll\n"
        "from refcoll.transport.deadline import abort_job\n"
        "w = MPI.COMM_WORLD\nx = np.ones(1 << 16, np.float32)\n"
        "try:\n    for k in range(10 ** 9):\n        refcoll.allreduce(x, w)\n"
        f"        if k == 20 and w.Get_rank() == 0:\n"
        f"            open(r'{folder}/started', 'w').close()\n"
        "except Exception as e:\n"
        f"    with open(r'{folder}/rank%d' % w.Get_rank(), 'w') as f:\n"
        "        f.write(f'{time.time()}\\n{type(e).__name__}\\n{e}')\n"
        f"    if {handling == 'abort_job'!r}:\n        abort_job(4)\n"
        "    raise\n")
    return script


def raised(folder: Path, run: Faulted) -> dict[int, tuple]:
    """Return rank -> (seconds from the fault to its exception, the exception's type, its
    message), from the files the ranks wrote."""
    out = {}
    for p in folder.glob("rank*"):
        when, kind, message = p.read_text().split("\n", 2)
        out[int(p.name[4:])] = (float(when) - run.at, kind, message)
    return out


def started_file(folder: Path):
    return lambda _stdout: (folder / "started").exists()


# ------------------------------------------------------------------- a cut link: programs

@needs_root
@needs_mpiexec
# The default run keeps one cut-link case of these (a timeout left uncaught); the case with
# REFCOLL_ABORT_ON_TIMEOUT=1 runs by default in tests/test_cluster.py, the rest with -m slow.
@pytest.mark.parametrize("handling", [
    pytest.param("abort_on_timeout", id="REFCOLL_ABORT_ON_TIMEOUT=1", marks=pytest.mark.slow),
    pytest.param("raise", id="uncaught"),
    pytest.param("abort_job", id="caught-abort_job", marks=pytest.mark.slow),
])
def test_a_cut_link_ends_a_users_program_on_both_sides(untouched_host, tmp_path, handling):
    # REFCOLL_ABORT_ON_TIMEOUT=1: each rank aborts the job at its deadline. Without it, the
    # program gets CollectiveTimeout: left uncaught, refcoll ends the job after its traceback;
    # caught, the program ends the job itself with abort_job (MPI_Finalize, which a plain
    # exit runs, would wait for the lost node for ever).
    script = loop_script(tmp_path, handling)
    env = {"REFCOLL_TIMEOUT": str(TIMEOUT)}
    if handling == "abort_on_timeout":
        env["REFCOLL_ABORT_ON_TIMEOUT"] = "1"
    with Cluster(nodes=2, ranks_per_node=2) as cluster:
        prefix, hosts = cluster.prefix, rank_hosts(cluster)
        run = faulted_run(cluster, [sys.executable, str(script)], env=env,
                          started=started_file(tmp_path), fault=cut_link(cluster),
                          folder=tmp_path)
    assert leftovers(prefix) == []
    check_ended(run, cluster)
    if handling == "abort_on_timeout":  # each rank wrote its timeout and aborted, raising none
        got = {r: (t, "CollectiveTimeout", text) for r, (text, t) in run.errors.items()
               if "aborting the MPI job (REFCOLL_ABORT_ON_TIMEOUT=1)" in text}
    else:
        got = raised(tmp_path, run)
    print(f"\n{handling}: cut -> raised " + str({r: round(g[0], 2) for r, g in sorted(got.items())})
          + f", ended {run.figures()}")
    # every rank raised, on both sides of the cut, naming the peer it waited for and its host
    assert sorted(got) == [0, 1, 2, 3], run
    for rank, (when, kind, message) in sorted(got.items()):
        assert kind in ("CollectiveTimeout", "PeerFailure"), (kind, message)
        assert when > 0  # after the cut, by the deadline
        if kind == "CollectiveTimeout":
            check_message(message, hosts, rank)
    if handling == "raise":
        # the ranks that ended on their own say why they ended the job
        assert any("the program did not catch it" in text for text, _ in run.errors.values()), run


# ------------------------------------------------------------------- a cut link: commands

#: refcoll's commands, each long enough to be cut in the middle, and the lines rank 0 has
#: traced (REFCOLL_DEBUG=INFO, a line per collective call) once it is provably under way.
COMMANDS = {
    "train": (["train", "--steps", "1000000"], 20),
    "verify": (["verify"], 50),
    "bench": (["bench", "-b", "64K", "-e", "64K", "-w", "1", "-i", "1000000"], 4),
    "model --calibrate": (["model", "--calibrate", "--sizes", "64K..64M"], 50),
}


@needs_root
@needs_mpiexec
@pytest.mark.parametrize("name", [
    pytest.param("train", marks=pytest.mark.slow),
    pytest.param("verify", marks=pytest.mark.slow),
    pytest.param("bench", marks=pytest.mark.slow),
    pytest.param("model --calibrate", marks=pytest.mark.slow),
])
def test_a_cut_link_ends_a_refcoll_command_on_both_sides(untouched_host, tmp_path, name):
    # Under mpiexec a command uses the job's world (-n is ignored). Whatever it was doing when
    # the link went down (one of refcoll's calls, a barrier, the MPI library's own blocking
    # collective in bench, which runs under the watchdog: a quarter of the cuts land there),
    # it exits 3 and ends the job on both sides.
    args, lines = COMMANDS[name]
    trace = tmp_path / "trace.0"
    env = {"REFCOLL_TIMEOUT": str(TIMEOUT), "REFCOLL_DEBUG": "INFO",
           "REFCOLL_DEBUG_FILE": str(tmp_path / "trace.%r")}

    def under_way(_stdout):
        return trace.exists() and trace.read_text().count("\n") >= lines

    with Cluster(nodes=2, ranks_per_node=2) as cluster:
        prefix, hosts = cluster.prefix, rank_hosts(cluster)
        run = faulted_run(cluster, [sys.executable, "-m", "refcoll", *args], env=env,
                          started=under_way, fault=cut_link(cluster), folder=tmp_path)
    assert leftovers(prefix) == []
    check_ended(run, cluster)
    print(f"\n{name}: cut -> errors " + str({r: round(t, 2) for r, (_, t) in
                                           sorted(run.errors.items())})
          + f", ended {run.figures()}")
    # mpiexec's status is that of the rank whose abort reached it: the CLI's for a timeout
    assert run.returncode == TIMEOUT_STATUS, run
    reported = {r for r, (text, _) in run.errors.items() if TIMEOUT_MESSAGE.search(text)}
    for rank in reported:
        check_message(run.errors[rank][0], hosts)
    # Each side of the cut found it by its own deadline. (A rank whose deadline comes more
    # than ABORT_GRACE after its node's first is ended by that rank's abort before its own.)
    assert reported & {0, 1} and reported & {2, 3}, run


# ---------------------------------------------------------------------- a killed node

@needs_root
@needs_mpiexec
@pytest.mark.parametrize("node", [2, pytest.param(1, marks=pytest.mark.slow)])
def test_a_killed_node_ends_the_job_with_a_message(untouched_host, tmp_path, node):
    # Every process of one node (its ranks and MPICH's proxy) killed: the kernel closes their
    # sockets, so the launcher (node 1's mpiexec, or node 2's proxy when node 1 is the one
    # killed, mpiexec with it) sees it at once and ends the rest. No deadline is involved.
    script = loop_script(tmp_path, "raise")
    with Cluster(nodes=2, ranks_per_node=2) as cluster:
        prefix = cluster.prefix
        run = faulted_run(cluster, [sys.executable, str(script)],
                          env={"REFCOLL_TIMEOUT": "600"}, started=started_file(tmp_path),
                          fault=kill_node(cluster, node), folder=tmp_path)
    assert leftovers(prefix) == []
    check_ended(run, cluster)
    print(f"\nkill node {node}: ended {run.figures()}")
    # Measured: 0.1 s. With REFCOLL_TIMEOUT at 600, no deadline ended it: the launcher did
    # (the bound is a guard, far above the 10 s asked for, against a loaded machine).
    assert max(run.ended.values()) < 60, run
    if node == 2:  # mpiexec survives to say so (on node 1 it was killed itself: -9)
        # Which it sees first is a race: the lost proxy (its error, on stderr), or a rank of
        # node 1 that died of the lost peer (Hydra's BAD TERMINATION banner, on stdout).
        assert run.stderr.strip() or "BAD TERMINATION" in run.stdout, run
        assert run.returncode != 0


# --------------------------------------------------------------------------- a straggler

@needs_root
@needs_mpiexec
def test_a_slow_node_shows_in_the_per_rank_times(untouched_host, tmp_path):
    # Node 2's link at a tenth of node 1's. tbf caps a link's rate whatever the load, so the
    # time of every call has a floor: a ring all-reduce of 1 MiB on 4 ranks (0 1 | 2 3) sends
    # 6 chunks of 256 KiB over each edge, and the edges 1->2 and 3->0 cross between the nodes,
    # through node 2's 100 Mbit/s link. A rank's last receive waits for its left neighbour's
    # fifth, which waited for five chunks to cross: 105 ms at least on every rank, 126 ms on
    # the two that receive across (about 10 and 13 ms at 1 Gbit/s).
    nbytes, slow = 1 << 20, 100e6
    floor = 0.8 * 5 * (nbytes / 4) * 8 / slow  # the bucket's burst passes a little unshaped
    result = tmp_path / "bench.json"
    with Cluster(nodes=2, ranks_per_node=2, link="1gbit", node_links={2: "100mbit"}) as cluster:
        prefix, hosts = cluster.prefix, rank_hosts(cluster)
        res = cluster.run([sys.executable, "-m", "refcoll", "bench", "-b", "1M", "-e", "1M",
                           "-w", "1", "-i", "3", "--algorithm", "ring", "--against", "none",
                           "--json", str(result)],
                          env={"REFCOLL_DEBUG": "INFO",
                               "REFCOLL_DEBUG_FILE": str(tmp_path / "trace.%h.%r")},
                          capture_output=True, text=True, timeout=600)
    assert leftovers(prefix) == []
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    # bench's header names every node with its link, the slow one among them
    assert re.search(rf"{hosts[2]} \(rack 1, 2 ranks, link 100 Mbit/s\)", res.stdout), res.stdout
    # bench's per-rank times (the JSON's rank_times_us, each rank's median): every rank's is
    # above the floor that only the slow link explains
    row = json.loads(result.read_text())["rows"][0]
    times = row["rank_times_us"]
    print(f"\nstraggler: bench rank_times_us {[round(t) for t in times]}, floor {floor * 1e6:.0f}")
    assert len(times) == 4 and min(times) > floor * 1e6, times
    # REFCOLL_DEBUG=INFO: a line per call, with the rank's host first and time_us last
    for rank, host in hosts.items():
        lines = (tmp_path / f"trace.{host}.{rank}").read_text().splitlines()
        assert lines and all(line.startswith(f"{host}:") and f"[{rank}]" in line
                             for line in lines), lines
        timed = [float(line.rsplit("time_us ", 1)[1].split()[0]) for line in lines
                 if "count 262144" in line]
        assert timed and min(timed) > floor * 1e6, (rank, timed)


# ------------------------------------------------------------------ a delayed, lossy link

@needs_root
@needs_mpiexec
def test_a_delayed_link_still_carries_the_job_and_a_cut_still_ends_it(untouched_host, tmp_path):
    try:
        cluster = Cluster(nodes=2, ranks_per_node=2, delay="1ms").up()
    except ClusterError as exc:
        pytest.skip(f"no netem here: {exc}")
    script = loop_script(tmp_path, "raise")
    try:
        prefix, hosts = cluster.prefix, rank_hosts(cluster)
        run = faulted_run(cluster, [sys.executable, str(script)],
                          env={"REFCOLL_TIMEOUT": str(TIMEOUT)},
                          started=started_file(tmp_path), fault=cut_link(cluster),
                          folder=tmp_path)
    finally:
        cluster.down()
    assert leftovers(prefix) == []
    check_ended(run, cluster)
    got = raised(tmp_path, run)
    assert sorted(got) == [0, 1, 2, 3], run  # 20 calls went through the delay first
    for rank, (_, kind, message) in got.items():
        if kind == "CollectiveTimeout":
            check_message(message, hosts, rank)


# ---------------------------------------------------------------------------- the watchdog

def test_the_watchdog_ends_a_blocking_call_past_its_deadline(tmp_path):
    # No MPI job: the watchdog says which call it was and ends the process with status 3.
    res = subprocess.run(
        [sys.executable, "-c",
         "import time\nfrom refcoll.transport.deadline import watchdog\n"
         "with watchdog('a blocking stand-in', 0.5):\n    time.sleep(0.1)\n"
         "print('returned in time', flush=True)\n"
         "with watchdog('a blocking stand-in', 0.5):\n    time.sleep(60)\n"],
        capture_output=True, text=True, timeout=GUARD, cwd=ROOT)
    assert res.returncode == TIMEOUT_STATUS, res.stderr
    assert res.stdout == "returned in time\n"
    assert "a blocking stand-in has not returned after 0.5 s" in res.stderr


@needs_root
@needs_mpiexec
@pytest.mark.slow
def test_the_watchdog_ends_a_blocking_mpi_call_across_a_cut_link(untouched_host, tmp_path):
    # MPI_Allreduce has no deadline and nothing interrupts it: cut during one, every rank
    # would wait for ever. Under the watchdog every rank ends, and the job with them.
    script = tmp_path / "job.py"
    script.write_text(
        "import numpy as np\nfrom mpi4py import MPI\n"
        "from refcoll.transport.deadline import watchdog\n"
        "w = MPI.COMM_WORLD\nx = np.ones(1 << 16, np.float32)\n"
        "for k in range(10 ** 9):\n    with watchdog('MPI_Allreduce'):\n"
        "        w.Allreduce(MPI.IN_PLACE, x)\n"
        "    if k == 20 and w.Get_rank() == 0:\n"
        f"        open(r'{tmp_path}/started', 'w').close()\n")
    with Cluster(nodes=2, ranks_per_node=2) as cluster:
        prefix = cluster.prefix
        run = faulted_run(cluster, [sys.executable, str(script)],
                          env={"REFCOLL_TIMEOUT": str(TIMEOUT)},
                          started=started_file(tmp_path), fault=cut_link(cluster),
                          folder=tmp_path)
    assert leftovers(prefix) == []
    check_ended(run, cluster)
    print(f"\nwatchdog: cut -> ended {run.figures()}")
    assert run.returncode == TIMEOUT_STATUS, run
    said = [r for r, (text, _) in run.errors.items()
            if f"MPI_Allreduce has not returned after {TIMEOUT} s" in text]
    assert {0, 1} & set(said) and {2, 3} & set(said), run
