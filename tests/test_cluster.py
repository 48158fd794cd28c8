"""The emulated cluster: namespaces as nodes, shaped links, MPICH across them, and nothing left.

These need CAP_NET_ADMIN (CI runs as root); elsewhere they skip, saying why.
Every test ends with the cluster removed, and checks that the host's own
namespace (its links, addresses, routes) is as it was.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, mpiexec_path

import refcoll
from refcoll.calls.auto import DEFAULT
from refcoll.cluster import Cluster, ClusterError, emulate, missing_capability
from refcoll.cluster.check import BOTH_WAYS, format_links, measure_link, measure_links
from refcoll.core.calibration import Calibration
from refcoll.core.errors import UsageError

WHY = missing_capability()
needs_root = pytest.mark.skipif(WHY is not None, reason=f"no namespaces here: {WHY}")


def host_view() -> tuple:
    """The host namespace as ip shows it: links, addresses, routes, and its namespaces."""
    return tuple(subprocess.run(argv, capture_output=True, text=True).stdout for argv in (
        ["ip", "-br", "link"], ["ip", "-br", "addr"], ["ip", "route"], ["ip", "-6", "route"]))


def leftovers(prefix: str) -> list[str]:
    """Whatever of cluster ``prefix`` still exists: namespaces, /etc/netns files, its state."""
    out = [ns for ns in emulate._namespaces() if ns.startswith(prefix)]
    out += [str(p) for p in emulate.NETNS_ETC.glob(f"{prefix}*")]
    out += [str(p) for p in emulate.STATE_DIR.glob(f"{prefix}*")]
    return out


@pytest.fixture
def untouched_host():
    before = host_view()
    yield
    assert host_view() == before, "the host's own namespace changed"


@needs_root
def test_up_and_down_leave_nothing_and_touch_nothing_of_the_host(untouched_host):
    with Cluster(nodes=3, ranks_per_node=1, link="100mbit", racks=1) as cluster:
        prefix = cluster.prefix
        assert set(cluster.made) == {f"{prefix}-hub", f"{prefix}-n1", f"{prefix}-n2",
                                     f"{prefix}-n3"}
        addr = subprocess.run(["ip", "-n", cluster.node_ns(2), "-br", "addr", "show", "eth0"],
                              capture_output=True, text=True).stdout
        assert f"{emulate.SUBNET}.0.2/16" in addr
        state = json.loads(cluster.state_file.read_text())
        assert [n["host"] for n in state["nodes"]] == [cluster.host(i) for i in (1, 2, 3)]
        assert emulate.SUBNET not in "".join(host_view())  # its addresses: inside only
    assert leftovers(prefix) == []


@needs_root
def test_an_error_while_building_leaves_nothing(untouched_host, monkeypatch):
    built = []
    real = Cluster._shape

    def fail_on_the_second_node(self, ns, dev, rate):
        built.append(self.prefix)
        if ns.endswith("-n2"):
            raise ClusterError("stand-in for a qdisc the kernel lacks")
        return real(self, ns, dev, rate)

    monkeypatch.setattr(Cluster, "_shape", fail_on_the_second_node)
    with pytest.raises(ClusterError, match="stand-in"):
        Cluster(nodes=2, ranks_per_node=1).up()
    assert built and leftovers(built[0]) == []


@needs_root
def test_a_shaped_link_carries_no_more_than_its_rate(untouched_host):
    with Cluster(nodes=2, ranks_per_node=1, link="1gbit", node_links={2: "100mbit"}) as cluster:
        rows = {row["node"]: row for row in measure_links(cluster, nbytes=4 << 20)}
    # a token bucket is an upper bound whatever the load; how close it comes is the machine's
    assert rows[2]["bits_per_s"] <= 1.15 * 100e6
    # node 1's only peer is the slow node: what its path was asked to carry is that link's
    assert rows[2]["asked_bits_per_s"] == rows[1]["asked_bits_per_s"] == 100e6
    assert (rows[2]["limit"], rows[1]["limit"]) == ("node 2's link", "node 2's link")
    assert rows[1]["bits_per_s"] <= 1.15 * 100e6
    assert "asked 100 Mbit/s (node 2's link)" in format_links([rows[1]])[0]
    assert "asked 100 Mbit/s;" in format_links([rows[2]])[0]  # its own: not named
    # both ways at once, each way is held to the rate as well: node 2's link shapes both
    assert len(rows[2]["both_ways_bits_per_s"]) == BOTH_WAYS
    assert all(0 < rate <= 1.15 * 100e6 for rate in rows[2]["both_ways_bits_per_s"])


def test_a_link_is_held_to_the_slowest_link_on_its_path():
    """Across racks a stream takes the uplink: 2 nodes, 100 Mbit/s each, a rack each,
    oversubscribed 4: the uplinks run at 25 Mbit/s, and that is what the check holds it to.
    Each stream carries 2 s of it; a link too slow to check in MOST_SECONDS is refused."""
    from refcoll.cluster.check import MOST_SECONDS, path_rate, stream_bytes
    from refcoll.core.errors import UsageError

    racks = Cluster(nodes=2, ranks_per_node=1, link="100mbit", racks=2, oversubscription=4)
    assert path_rate(racks, 1, 2) == (25e6, "the racks' uplink")
    assert stream_bytes(25e6) == 25e6 / 8 * 2 and stream_bytes(1e12) == 16 << 20
    assert stream_bytes(1e3) == 4 << 10
    slow = Cluster(nodes=2, ranks_per_node=1, link="5kbit")
    with pytest.raises(UsageError, match=rf"would take up to \d+ s at 5000 bit/s \(more than "
                                         rf"{MOST_SECONDS:.0f} s\)"):
        measure_links(slow)
    with pytest.raises(UsageError, match="has one node: there is no link between nodes"):
        measure_links(Cluster(nodes=1, ranks_per_node=1))


def test_a_link_line_shows_both_ways_as_median_and_range():
    row = {"node": 2, "peer": 1, "asked_bits_per_s": 100e6, "delay": None, "rtt_s": 50e-6,
           "bits_per_s": 96e6, "both_ways_bits_per_s": [94e6, 85e6, 90e6]}
    (line,) = format_links([row])
    assert line == ("node 2 (to node 1): asked 100 Mbit/s; measured 96 Mbit/s (96%), both ways "
                    "at once 90 Mbit/s each (90%; 85-94 over 3), round trip 50 us")
    (line,) = format_links([{**row, "both_ways_bits_per_s": []}])
    assert "both ways" not in line and line.endswith("(96%), round trip 50 us")


class _Links:
    """The parts of a cluster that measure_link reads: 1 Mbit/s and 100 Mbit/s links."""

    def node_ns(self, i):
        return f"ns{i}"

    def address(self, i):
        return f"10.0.0.{i}"

    def rate(self, i):
        return "1mbit" if i == 2 else "100mbit"

    def rack_of(self, i):
        return 1


class _Server:
    """A stand-in for the server's process: ready at once; every one started is kept."""

    started: list[_Server] = []

    said = "ready\n"

    def __init__(self, *args, **kwargs):
        self.stdout, self.killed = io.StringIO(self.said), False
        self.stderr = io.StringIO("Traceback ...\nOSError: [Errno 98] Address already in use\n")
        _Server.started.append(self)

    def kill(self):
        self.killed = True

    def wait(self):
        return 0


@pytest.mark.parametrize("outcome", ["timeout", "no output"])
def test_a_link_measurement_that_fails_is_one_error_not_a_traceback(monkeypatch, outcome):
    from refcoll.cluster import check
    allowed = []

    def client(argv, **kwargs):
        allowed.append(kwargs["timeout"])
        if outcome == "timeout":
            raise subprocess.TimeoutExpired(argv, kwargs["timeout"])
        return subprocess.CompletedProcess(argv, 1, "", "Traceback ...\nConnectionRefusedError\n")

    monkeypatch.setattr(_Server, "started", [])
    monkeypatch.setattr(check.subprocess, "Popen", _Server)
    monkeypatch.setattr(check.subprocess, "run", client)
    with pytest.raises(refcoll.RefcollError) as err:
        measure_link(_Links(), 1, 2, nbytes=1 << 20, both_ways=3)
    # the slower link (1 Mbit/s) sets the time allowed: 4 x the 4 streams' and the 200
    # ping-pongs' bits at its rate
    assert allowed == [pytest.approx(60 + 4 * ((1 << 20) * 4 + 200 * 2 * 100) * 8 / 1e6)]
    message = str(err.value)
    assert message.startswith("cluster check: the streams between node 1 and node 2")
    assert (f"took over {allowed[0]:.0f} s" in message if outcome == "timeout"
            else message.endswith("failed (exit 1): ConnectionRefusedError"))
    assert [server.killed for server in _Server.started] == [True]  # none left behind


def test_a_receiver_that_cannot_listen_is_said_at_once(monkeypatch):
    """A receiver that never says "ready" (its port taken) is one error naming why, at once,
    not a client that waits and then fails with a reset connection."""
    from refcoll.cluster import check

    monkeypatch.setattr(_Server, "started", [])
    monkeypatch.setattr(_Server, "said", "")
    monkeypatch.setattr(check.subprocess, "Popen", _Server)
    monkeypatch.setattr(check.subprocess, "run", lambda *a, **k: pytest.fail("client started"))
    with pytest.raises(refcoll.RefcollError, match="the receiver on node 2 did not start: "
                                                   r"OSError: \[Errno 98\] Address already"):
        measure_link(_Links(), 1, 2, nbytes=1 << 20)
    assert [server.killed for server in _Server.started] == [True]


@needs_root
def test_racks_are_joined_by_an_oversubscribed_uplink(untouched_host):
    # 2 racks of 2 nodes at 100 Mbit/s, uplinks 4x oversubscribed: 2 x 100 / 4 = 50 Mbit/s
    with Cluster(nodes=4, ranks_per_node=1, link="100mbit", racks=2,
                 oversubscription=4) as cluster:
        assert [cluster.rack_of(i) for i in (1, 2, 3, 4)] == [1, 1, 2, 2]
        across = measure_link(cluster, 1, 3, nbytes=2 << 20)
        state = json.loads(cluster.state_file.read_text())
    assert across["bits_per_s"] <= 1.15 * 50e6
    assert state["racks"] == 2 and state["oversubscription"] == 4


@needs_root
@pytest.mark.skipif(mpiexec_path() is None, reason="no mpiexec: pip install 'refcoll[mpi]'")
def test_mpich_runs_across_the_nodes_and_the_bytes_cross_the_links(untouched_host, tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "from mpi4py import MPI\nimport socket\nimport numpy as np\n"
        "w = MPI.COMM_WORLD\nnode = w.Split_type(MPI.COMM_TYPE_SHARED)\n"
        "x = np.ones(1 << 20, np.float32)\nw.Allreduce(MPI.IN_PLACE, x)\n"
        f"open(r'{tmp_path}/rank%d' % w.Get_rank(), 'w').write("
        "f'{w.Get_rank()} {socket.gethostname()} {node.Get_size()} {x[0]}')\n")
    with Cluster(nodes=2, ranks_per_node=2, link="1gbit") as cluster:
        res = cluster.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=240)
        traffic = cluster.last_traffic
        hosts = [cluster.host(1)] * 2 + [cluster.host(2)] * 2
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [(tmp_path / f"rank{r}").read_text().split() for r in range(4)]
    # MPICH's node split is the emulated one: two ranks on each host, by block
    assert rows == [[str(r), hosts[r], "2", "4.0"] for r in range(4)]
    # 4 MiB all-reduced across the two nodes: each node's link carries at least the half
    # its peers need (a ring of two nodes sends n/2 each way at least)
    assert all(tx >= 2 << 20 for tx, _ in traffic.values()), traffic


@needs_root
def test_a_killed_command_leaves_no_process_on_any_node(untouched_host):
    with Cluster(nodes=2, ranks_per_node=1) as cluster:
        if mpiexec_path() is None:
            pytest.skip("no mpiexec: pip install 'refcoll[mpi]'")
        with pytest.raises(subprocess.TimeoutExpired):  # run kills mpiexec at its timeout
            cluster.run(["sleep", "1000"], timeout=10)
        left = [subprocess.run(["ip", "netns", "pids", ns], capture_output=True,
                               text=True).stdout.split() for ns in cluster.made]
    assert left == [[], [], []]  # the ranks and proxies on both nodes are gone too


@needs_root
def test_a_cluster_whose_owner_was_killed_is_removed_by_the_next(untouched_host):
    owner = subprocess.run([sys.executable, "-c",
                            "import os, signal\nfrom refcoll.cluster import Cluster\n"
                            "c = Cluster(nodes=2, ranks_per_node=1).up()\n"
                            "print(c.prefix, flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\n"],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert owner.returncode == -signal.SIGKILL
    stale = owner.stdout.split()[0]
    assert leftovers(stale)  # kill -9: nothing could clean up
    with Cluster(nodes=1, ranks_per_node=1):
        assert leftovers(stale) == []


@needs_root
def test_a_program_killed_while_it_holds_a_cluster_leaves_nothing(untouched_host):
    # SIGTERM (kill, a batch system's timeout) unwinds the with-block, as Ctrl-C does.
    owner = subprocess.Popen([sys.executable, "-c",
                              "import time\nfrom refcoll.cluster import Cluster\n"
                              "with Cluster(nodes=2, ranks_per_node=1) as c:\n"
                              "    print(c.prefix, flush=True)\n    time.sleep(600)\n"],
                             stdout=subprocess.PIPE, text=True, cwd=ROOT)
    prefix = owner.stdout.readline().split()[0]
    assert leftovers(prefix)
    owner.terminate()
    assert owner.wait(timeout=120) == 143
    assert leftovers(prefix) == []


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "refcoll", "cluster", *args],
                          capture_output=True, text=True, timeout=240, cwd=ROOT,
                          env={**os.environ, **(env or {})})


@needs_root
def test_the_command_line(untouched_host, tmp_path):
    env = {"REFCOLL_CLUSTER_DIR": str(tmp_path / "state")}  # not the user's own clusters
    assert _cli("run", "--", "true", env=env).returncode == 2
    first = _cli("up", "--nodes", "2", "--ranks-per-node", "1", env=env)
    assert first.returncode == 0, first.stderr
    prefix = first.stdout.split()[1].rstrip(":")
    second = _cli("up", "--nodes", "2", "--ranks-per-node", "1", "--link", "100mbit", env=env)
    assert second.returncode == 0 and leftovers(prefix) == []  # replaced
    prefix = second.stdout.split()[1].rstrip(":")
    status = _cli("status", env=env)
    assert f"cluster {prefix}: 2 nodes x 1 ranks, link 100mbit, complete" in status.stdout
    # options after COMMAND are its own, as mpiexec's are
    echo = _cli("run", sys.executable, "-c", "import sys; print(sys.argv[1:])", "-n", "1",
                env=env)
    assert echo.returncode == 0 and echo.stdout.count("['-n', '1']") == 2, echo.stderr
    delayed = _cli("up", "--nodes", "2", "--ranks-per-node", "1", "--delay", "50us", env=env)
    if delayed.returncode == 0:  # this kernel has netem: it replaced the cluster
        prefix = delayed.stdout.split()[1].rstrip(":")
    else:  # the cluster that was up is left as it was: the new one is built first
        assert delayed.returncode == 2 and "netem" in delayed.stderr
        status = _cli("status", env=env)
        assert f"cluster {prefix}: 2 nodes x 1 ranks, link 100mbit, complete" in status.stdout
    # a killed check takes its measuring processes with it
    check = subprocess.Popen([sys.executable, "-m", "refcoll", "cluster", "check"], cwd=ROOT,
                             env={**os.environ, **env}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    while not any(emulate._run("ip", "netns", "pids", f"{prefix}-n{i}", check=False).stdout
                  for i in (1, 2)) and check.poll() is None:
        pass  # until a measuring process runs in a node (or the check is over)
    check.terminate()
    check.wait(timeout=120)
    assert not any(emulate._run("ip", "netns", "pids", f"{prefix}-n{i}", check=False).stdout
                   for i in (1, 2))
    assert _cli("down", env=env).returncode == 0
    assert not [ns for ns in emulate._namespaces() if ns.startswith(prefix)]
    assert not list((tmp_path / "state").glob("*.json"))


@needs_root
@pytest.mark.skipif(mpiexec_path() is None, reason="no mpiexec: pip install 'refcoll[mpi]'")
def test_a_running_job_keeps_its_cluster_and_its_processes(untouched_host, tmp_path):
    # A plain down (or up) removed the cluster from under a running `cluster run`, and a
    # second run, ending, killed every process in the namespaces: the first job's too.
    env = {"REFCOLL_CLUSTER_DIR": str(tmp_path / "state")}
    made = _cli("up", "--nodes", "2", "--ranks-per-node", "1", env=env)
    assert made.returncode == 0, made.stderr
    prefix = made.stdout.split()[1].rstrip(":")
    mark, done, go = tmp_path / "started", tmp_path / "done", tmp_path / "go"
    job = subprocess.Popen([sys.executable, "-m", "refcoll", "cluster", "run", "--", "sh", "-c",
                            f"touch {mark}.$$; while [ ! -e {go} ]; do sleep 0.1; done; "
                            f"touch {done}.$$"], cwd=ROOT, env={**os.environ, **env},
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while len(list(tmp_path.glob("started.*"))) < 2 and job.poll() is None:
            threading_wait(0.1)
        assert job.poll() is None, job.communicate()
        down = _cli("down", env=env)
        assert down.returncode == 0 and "no cluster removed" in down.stdout, down.stdout
        assert f"left cluster {prefix}: a refcoll cluster run or check job uses it" in \
            down.stderr
        other = _cli("run", "--", "true", env=env)
        assert other.returncode == 0, other.stderr
        assert _cli("run", "--bogus", "--", "true", env=env).returncode == 2
        go.touch()  # the first run's ranks go on, and end by themselves
        out, err = job.communicate(timeout=120)
        assert job.returncode == 0, err
        assert len(list(tmp_path.glob("done.*"))) == 2, "its ranks were killed"
    finally:
        go.touch()
        if job.poll() is None:
            job.terminate()
            job.communicate(timeout=120)
        gone = _cli("down", "--force", env=env)  # whatever failed above: nothing left
    assert gone.returncode == 0 and f"removed {prefix}" in gone.stdout and leftovers(prefix) == []


def test_a_launcher_killed_by_a_signal_is_said_and_exits_as_a_shell_would(monkeypatch):
    # mpiexec killed by SIGKILL made run exit 247 (sys.exit(-9)) and say nothing.
    import contextlib

    from click.testing import CliRunner

    import refcoll.cli.cluster as command

    class Killed:
        prefix, last_traffic = "rc000000", {}

        class spec:  # noqa: N801 - the attribute run reads
            total_ranks = 2

        def run(self, *args, **kwargs):
            return subprocess.CompletedProcess(args, -9)
    monkeypatch.setattr(command, "_the_cluster", Killed)
    monkeypatch.setattr(emulate, "using", lambda made: contextlib.nullcontext(made))
    monkeypatch.setattr(command, "_cleanup_on_signals", lambda: None)  # (pytest's handlers)
    result = CliRunner().invoke(command.cluster, ["run", "--", "true"])
    assert result.exit_code == 137
    assert "the mpich launcher was killed by SIGKILL" in result.output


def threading_wait(seconds: float) -> None:
    import threading

    threading.Event().wait(seconds)


@needs_root
def test_what_is_missing_is_one_line_and_exit_2(untouched_host, tmp_path):
    env = {"REFCOLL_CLUSTER_DIR": str(tmp_path / "state")}
    before = emulate._namespaces()
    delayed = _cli("up", "--nodes", "2", "--ranks-per-node", "1", "--delay", "50us", env=env)
    if delayed.returncode == 0:  # this kernel has netem
        assert _cli("down", env=env).returncode == 0
    else:
        assert delayed.returncode == 2
        assert delayed.stderr.strip().count("\n") == 0 and "netem" in delayed.stderr
    assert emulate._namespaces() == before  # nothing half-built is left
    assert not list((tmp_path / "state").glob("*.json"))
    plain = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                            "--inh-caps=-all", sys.executable, "-m", "refcoll", "cluster", "up"],
                           capture_output=True, text=True, timeout=120, cwd=ROOT,
                           env={**os.environ, **env, "HOME": str(tmp_path)})
    assert plain.returncode == 2, plain.stderr
    assert plain.stderr.strip().count("\n") == 0 and "CAP_NET_ADMIN" in plain.stderr


def test_the_nodes_of_an_emulated_cluster_are_one_machine(tmp_path, monkeypatch):
    # four ranks on two "nodes" of a two-core machine: each node alone looks fine
    from refcoll.bench.header import oversubscription

    state = tmp_path / "rcx.json"
    state.write_text(json.dumps({"machine": "box", "nodes": [{"host": "rcx-n1"},
                                                            {"host": "rcx-n2"}]}))
    ranks = [{"host": f"rcx-n{1 + r // 2}", "cores": [0, 1]} for r in range(4)]
    assert not any(h["oversubscribed"] for h in oversubscription(ranks))
    monkeypatch.setenv("REFCOLL_CLUSTER", str(state))
    assert emulate.machine_of("rcx-n2") == "box (emulating rcx-n1, rcx-n2)"
    assert emulate.machine_of("elsewhere") == "elsewhere"
    ranks = [dict(r, machine=emulate.machine_of(r["host"])) for r in ranks]
    assert oversubscription(ranks) == [{"host": "box (emulating rcx-n1, rcx-n2)", "ranks": 4,
                                        "cores": 2, "oversubscribed": True}]


@needs_root
@pytest.mark.skipif(mpiexec_path() is None, reason="no mpiexec: pip install 'refcoll[mpi]'")
def test_bench_on_the_cluster_knows_the_cores_are_shared(untouched_host):
    with Cluster(nodes=2, ranks_per_node=2, link="1gbit") as cluster:
        res = cluster.run([sys.executable, "-m", "refcoll", "bench", "-b", "64K", "-e", "64K",
                           "--algorithm", "ring", "-w", "1", "-i", "2"],
                          capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert (f"OVERSUBSCRIBED: 4 ranks on {os.cpu_count()} cores of" in res.stdout) == (
        os.cpu_count() < 4)
    assert f"(emulating {cluster.host(1)}, {cluster.host(2)})" in res.stdout


def test_uneven_nodes_have_a_hostfile_of_their_counts(tmp_path):
    cluster = Cluster(nodes=2, ranks_per_node=2, node_ranks={1: 3})
    cluster.prefix = "rcx"
    assert cluster.hostfile(tmp_path / "hosts").read_text() == "rcx-n1:3\nrcx-n2:2\n"
    assert cluster.spec.total_ranks == 5
    with pytest.raises(UsageError, match="--node-ranks names node 3"):
        Cluster(nodes=2, node_ranks={3: 1})


@needs_root
def test_torchrun_with_an_agent_per_node_and_the_refcoll_backend(untouched_host, tmp_path):
    pytest.importorskip("torch")
    script = tmp_path / "job.py"
    script.write_text(
        "import socket, torch, torch.distributed as dist\nimport refcoll.torch\n"
        "dist.init_process_group('refcoll')\nr = dist.get_rank()\n"
        "t = torch.ones(1 << 18) * (r + 1)\ndist.all_reduce(t)\n"
        f"open(r'{tmp_path}/rank%d' % r, 'w').write(f'{{socket.gethostname()}} {{t[0].item()}}')\n"
        "dist.destroy_process_group()\n")
    with Cluster(nodes=2, ranks_per_node=2) as cluster:
        res = cluster.run([sys.executable, str(script)], launcher="torchrun",
                          capture_output=True, text=True, timeout=300)
        traffic = cluster.last_traffic
        hosts = [cluster.host(1)] * 2 + [cluster.host(2)] * 2
    assert res.returncode == 0, res.stderr[-3000:]
    assert [(tmp_path / f"rank{r}").read_text().split() for r in range(4)] == [
        [hosts[r], "10.0"] for r in range(4)]
    assert all(tx >= 1 << 20 for tx, _ in traffic.values()), traffic  # 1 MiB across the link


@needs_root
@pytest.mark.skipif(mpiexec_path() is None, reason="no mpiexec: pip install 'refcoll[mpi]'")
def test_a_cut_link_is_an_error_on_every_rank_and_the_job_ends_on_both_sides(untouched_host,
                                                                           tmp_path):
    import threading

    from refcoll.cluster import launch
    from refcoll.transport.deadline import ABORT_WAIT

    started = tmp_path / "started"
    script = tmp_path / "job.py"
    script.write_text(
        "import socket, sys\nimport numpy as np\nfrom mpi4py import MPI\nimport refcoll\n"
        "w = MPI.COMM_WORLD\nx = np.ones(1 << 16, np.float32)\n"
        "try:\n    for k in range(10 ** 9):\n        refcoll.allreduce(x, w)\n"
        f"        if k == 20 and w.Get_rank() == 0:\n            open(r'{started}', 'w').close()\n"
        "except Exception as e:\n"
        f"    open(r'{tmp_path}/rank%d' % w.Get_rank(), 'w').write(type(e).__name__)\n"
        "    raise\n")
    with Cluster(nodes=2, ranks_per_node=2) as cluster:
        def cut():
            while not started.exists():
                threading.Event().wait(0.1)
            subprocess.run(["ip", "-n", cluster.hub, "link", "set", "v2", "down"], check=True)
        threading.Thread(target=cut, daemon=True).start()
        res = launch.run(cluster, [sys.executable, str(script)], None, "mpich",
                         env={"REFCOLL_TIMEOUT": "5", "REFCOLL_ABORT_ON_TIMEOUT": "1"},
                         capture_output=True, text=True, timeout=240)  # a guard against a hang
        left = []
        # what mpiexec left on the far side: its ranks end when their MPI_Abort, which cannot
        # reach the launcher, has waited ABORT_WAIT; their proxy then. (A bound against a hang.)
        for _ in range(10 * (ABORT_WAIT + 30)):
            left = [pid for ns in cluster.made for pid in subprocess.run(
                ["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()]
            if not left:
                break
            threading.Event().wait(0.1)
    assert started.exists() and res.returncode != 0
    assert left == [], "ranks or proxies outlived the job"
    # REFCOLL_ABORT_ON_TIMEOUT=1: a rank that times out aborts the job and raises nothing
    assert not list(tmp_path.glob("rank*")), "a rank raised after its MPI_Abort"
    assert "timed out after 5 s" in res.stderr and "aborting the MPI job" in res.stderr


@needs_root
@pytest.mark.skipif(mpiexec_path() is None, reason="no mpiexec: pip install 'refcoll[mpi]'")
def test_auto_and_hierarchical_read_the_nodes_and_the_topology_across_them(untouched_host,
                                                                           tmp_path):
    """On 2 x 2 nodes at 1 Gbit/s, with the deterministic calibration (no timing), auto prices
    the second level from the topology file the cluster wrote and runs hierarchical, whose
    node split is MPI's (the emulated hosts); its bits are the simulator's for that choice."""
    script = tmp_path / "job.py"
    script.write_text(
        "import json, os\nimport numpy as np\nfrom mpi4py import MPI\nimport refcoll\n"
        "from refcoll.calls.auto import calibration_for, resolve_with_options\n"
        "from refcoll.algorithms._nodes import node_layout\n"
        "from refcoll.transport.mpi import transport_for\n"
        "w = MPI.COMM_WORLD\nr = w.Get_rank()\nt = transport_for(w)\n"
        "x = (np.arange(1 << 18, dtype=np.float32) * 0.37 + r).astype(np.float32)\n"
        "y = refcoll.allreduce(x, w, algorithm='auto')\n"
        "small = [refcoll.allreduce((np.arange(1 << 10, dtype=np.float32) * 0.11 + r + i)\n"
        "                           .astype(np.float32), w, algorithm='auto') for i in range(4)]\n"
        "cal = calibration_for(t)\n"
        "with refcoll.allreduce_init((np.arange(1 << 10, dtype=np.float32) * 0.11 + r + 3)\n"
        "                            .astype(np.float32), w, algorithm='auto') as plan:\n"
        "    planned = plan().copy()\n"
        "out = {'hosts': t.hosts, 'sizes': node_layout(t).sizes,\n"
        "       'two_level': cal.two_level, 'inter_beta': cal.inter_beta,\n"
        "       'choices': {n: resolve_with_options(t, 'allreduce', n, 4)\n"
        "                   for n in (1 << 10, 1 << 18, 1 << 24)},\n"
        "       'topo': os.environ.get('REFCOLL_TOPO_FILE'),\n"
        "       'recorded': plan.recorded}\n"
        f"np.save(r'{tmp_path}/y%d.npy' % r, y)\n"
        f"np.save(r'{tmp_path}/p%d.npy' % r, planned)\n"
        f"np.save(r'{tmp_path}/s%d.npy' % r, np.stack(small))\n"
        f"open(r'{tmp_path}/rank%d.json' % r, 'w').write(json.dumps(out))\n")
    with Cluster(nodes=2, ranks_per_node=2, link="1gbit") as cluster:
        res = cluster.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=240, env={"REFCOLL_CALIBRATION": "default"})
        hosts = [cluster.host(1)] * 2 + [cluster.host(2)] * 2
        topo = str(cluster.topology_file)
    assert res.returncode == 0, res.stdout + res.stderr
    outs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for out in outs:
        assert out["hosts"] == hosts and out["sizes"] == [2, 2] and out["topo"] == topo
        assert out["two_level"] and out["inter_beta"] == pytest.approx(8 / 1e9)
        assert {n: c[0] for n, c in out["choices"].items()} == {
            str(1 << 10): "hierarchical", str(1 << 18): "hierarchical",
            str(1 << 24): "hierarchical"}
    # 64 MiB: the ring between the nodes, in segments whose network phase overlaps the node's
    assert outs[0]["choices"][str(1 << 24)][1]["inter"] == "ring"
    assert outs[0]["choices"][str(1 << 24)][1].get("pipeline", 1) > 1
    inputs = [(np.arange(1 << 18, dtype=np.float32) * 0.37 + r).astype(np.float32)
              for r in range(4)]
    cal = Calibration(DEFAULT.alpha, DEFAULT.beta, DEFAULT.gamma, inter_alpha=50e-6,
                      inter_beta=8 / 1e9, nodes=2, per_node=2)
    want = refcoll.simulate("allreduce", inputs, algorithm="auto", node_size=2,
                            calibration=cal).outputs
    for r in range(4):
        assert np.load(tmp_path / f"y{r}.npy").tobytes() == want[r].tobytes()
    # 4 KiB as a plan: auto's hierarchical, its phases on the node's and the cross-node
    # communicators recorded as one schedule, gives the blocking call's bits
    assert all(out["recorded"] for out in outs), outs
    for i in range(4):
        small = [(np.arange(1 << 10, dtype=np.float32) * 0.11 + r + i).astype(np.float32)
                 for r in range(4)]
        want = refcoll.simulate("allreduce", small, algorithm="auto", node_size=2,
                                calibration=cal).outputs
        for r in range(4):
            assert np.load(tmp_path / f"s{r}.npy")[i].tobytes() == want[r].tobytes(), (i, r)
            if i == 3:
                assert np.load(tmp_path / f"p{r}.npy").tobytes() == want[r].tobytes(), r
