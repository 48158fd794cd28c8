"""Emulated nodes on one machine: namespaces, links, racks, the launcher stand-in.

:class:`~refcoll.cluster.emulate.Cluster` builds a cluster of network
namespaces joined by shaped veth links (``refcoll cluster up``);
:mod:`refcoll.cluster.standin` is the ``ssh`` that MPICH's ``mpiexec`` uses
to start a node's processes inside its namespace. Nothing above the transport
layer needs this package; the topology it writes is read by :mod:`refcoll.core.topology`.
"""

from .emulate import (
    Cluster,
    ClusterError,
    ClusterSpec,
    attach,
    bucket_bytes,
    clusters,
    down,
    missing_capability,
    parse_rate,
    status,
    up,
)

__all__ = ["Cluster", "ClusterError", "ClusterSpec", "attach", "bucket_bytes", "clusters", "down",
           "missing_capability", "parse_rate", "status", "up"]
