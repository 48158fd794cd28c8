"""The ``ssh`` of an emulated cluster: start a command on a node, inside that node's namespaces.

MPICH's ``mpiexec -launcher ssh -launcher-exec "python -m refcoll.cluster.standin"``
calls it as it would call ssh: ``standin [ssh options] HOST COMMAND``; so does Open
MPI's ``mpirun --mca plm_rsh_agent`` (``standin -x HOST PRTE_PREFIX=...;prted ...``,
the daemon's command in several words, joined here as ssh joins them). It finds
HOST among the clusters' state files, then runs COMMAND (one string, for a
shell, as ssh gives it to the remote shell) inside HOST's network namespace and
in a UTS namespace of its own whose host name is HOST, so that MPI's node
detection (host names, ``MPI_Comm_split_type``) sees the emulated nodes.
"""

from __future__ import annotations

import os
import sys

from ..core.errors import UsageError
from .emulate import clusters

__all__ = ["main", "namespace_of"]

#: ssh options that take a value (skipped with it).
_WITH_VALUE = set("bcDEeFIiJLlmOoPpQRSWw")


def namespace_of(host: str) -> str | None:
    """Return the namespace of the emulated node named ``host`` (None: no cluster has it)."""
    for state in clusters():
        for node in state.get("nodes", []):
            if host in (node["host"], node["address"]):
                return node["namespace"]
    return None


def main(argv: list[str]) -> int:
    args = list(argv)
    while args and args[0].startswith("-"):
        option = args.pop(0)
        if len(option) == 2 and option[1] in _WITH_VALUE and args:
            args.pop(0)
    if len(args) < 2:
        print("refcoll.cluster.standin: usage: standin [ssh options] HOST COMMAND",
              file=sys.stderr)
        return 2
    host, command = args[0], " ".join(args[1:])
    try:
        ns = namespace_of(host)
    except UsageError as exc:  # the cluster folder is not one refcoll trusts
        print(f"refcoll.cluster.standin: {exc}", file=sys.stderr)
        return 255
    if ns is None:
        print(f"refcoll.cluster.standin: {host!r} is no node of an emulated cluster "
              "(refcoll cluster status lists them)", file=sys.stderr)
        return 255  # what ssh returns when it cannot reach the host
    os.execvp("ip", ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c",
                     'hostname "$0" && exec sh -c "$1"', host, command])
    return 255


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
