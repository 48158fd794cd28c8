"""Starting a job across an emulated cluster's nodes: MPICH's ``mpiexec``, or ``torchrun`` per node.

* ``mpich``: ``mpiexec`` runs inside node 1 (the namespaces cannot reach the
  host's), with a hostfile of the nodes and :mod:`refcoll.cluster.standin` as
  its ``ssh``; the environment forces the bytes between nodes onto the links
  (``UCX_TLS=tcp,self`` on ``eth0``).
* ``torchrun``: one agent per node, each inside its node's namespaces, with
  ``--nnodes``, ``--node-rank`` and the c10d rendezvous on node 1, as on a real
  cluster; Gloo on ``eth0`` (``GLOO_SOCKET_IFNAME``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..core.errors import UsageError

__all__ = ["LAUNCHERS", "environment", "mpiexec_argv", "torchrun_argvs", "run",
           "RENDEZVOUS_PORT"]

#: The launchers ``run`` knows.
LAUNCHERS = ("mpich", "torchrun")

#: The port of torchrun's rendezvous on node 1.
RENDEZVOUS_PORT = 29400


def environment(cluster) -> dict:
    """What every process of a run gets: the network forced onto the links, the cluster named.

    MPICH's UCX would otherwise carry bytes between "nodes" of one machine
    through shared memory; ``UCX_TLS=tcp,self`` on ``eth0`` makes every byte
    between nodes cross its emulated link (MPICH's own shared memory still
    serves the ranks of one node). ``REFCOLL_CLUSTER`` is the state file:
    refcoll reads the machine's true core count from it.
    """
    return {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0", "FI_PROVIDER": "tcp",
            "GLOO_SOCKET_IFNAME": "eth0", "REFCOLL_CLUSTER": str(cluster.state_file)}


def _on_node(cluster, i: int) -> list[str]:
    """The prefix that runs a command inside node ``i``'s network and UTS namespaces."""
    return ["ip", "netns", "exec", cluster.node_ns(i), "unshare", "--uts", "sh", "-c",
            'hostname "$0" && shift && exec "$@"', cluster.host(i), "_"]


def mpiexec_argv(cluster, command: list[str], folder: Path, nprocs: int | None = None) -> list:
    """MPICH's ``mpiexec`` across the nodes; ``folder`` gets the hostfile and the stand-in
    (``-launcher-exec`` takes one path)."""
    hostfile = cluster.hostfile(folder / "hosts")
    standin = folder / "ssh"
    standin.write_text(f"#!/bin/sh\nexec {sys.executable} -m refcoll.cluster.standin \"$@\"\n")
    standin.chmod(0o755)
    mpiexec = Path(sys.executable).parent / "mpiexec"
    mpiexec = str(mpiexec) if mpiexec.exists() else (shutil.which("mpiexec") or "mpiexec")
    env = [a for k, v in environment(cluster).items() for a in ("-genv", k, v)]
    n = nprocs or cluster.spec.total_ranks
    return [*_on_node(cluster, 1), mpiexec, "-f", str(hostfile), "-launcher", "ssh",
            "-launcher-exec", str(standin), *env, "-n", str(n), *command]


def torchrun_argvs(cluster, command: list[str]) -> list[list[str]]:
    """One ``torchrun`` agent per node, rendezvous on node 1; ``command`` is run as it is
    (``--no-python``: ``python train.py ...``, ``refcoll bench ...``)."""
    nodes = cluster.spec.nodes
    out = []
    for i in range(1, nodes + 1):
        out.append([*_on_node(cluster, i), sys.executable, "-m", "torch.distributed.run",
                    f"--nnodes={nodes}", f"--node-rank={i - 1}",
                    f"--nproc-per-node={cluster.spec.ranks(i)}", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint={cluster.address(1)}:{RENDEZVOUS_PORT}",
                    f"--local-addr={cluster.address(i)}", "--no-python", *command])
    return out


def run(cluster, command: list[str], nprocs: int | None, launcher: str,
        **popen) -> subprocess.CompletedProcess:
    """Start ``command`` across the nodes with ``launcher`` and wait (see :meth:`Cluster.run`)."""
    if launcher not in LAUNCHERS:
        raise UsageError(f"unknown launcher {launcher!r}: use {' or '.join(LAUNCHERS)}")
    env = {**os.environ, **environment(cluster), **popen.pop("env", {})}
    if launcher == "mpich":
        with tempfile.TemporaryDirectory(prefix="refcoll-cluster-") as tmp:
            return subprocess.run(mpiexec_argv(cluster, command, Path(tmp), nprocs), env=env,
                                  **popen)
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
