"""A cluster's topology written down, as NCCL reads ``NCCL_TOPO_FILE``: nodes, links, racks.

``refcoll cluster up`` writes one for the cluster it builds and names it to
every process it runs (``REFCOLL_TOPO_FILE``); for a real cluster a user
writes the same JSON by hand::

    {"version": 1, "source": "refcoll cluster rc1a2b3c",
     "nodes": [{"host": "node1", "rack": 1, "ranks": 8, "link_bits_per_s": 1e9}, ...],
     "racks": [{"rack": 1, "uplink_bits_per_s": 5e8}, ...],
     "link_latency_s": 2.5e-05}

``link_bits_per_s`` is each node's own link, one direction; ``uplink_bits_per_s``
a rack's link to the others (absent: one switch joins every node); ``link_latency_s``
one message's latency across nodes (``refcoll cluster check`` writes what it
measured; absent: unknown).

Who reads it: ``auto`` prices its choice across nodes with the links it gives
when its calibration measured one level only (:func:`inter_levels`), and
with the racks' uplinks always (:func:`rack_levels`); and
``refcoll model --topology FILE`` builds its cluster from it
(:func:`model_options`).
"""

from __future__ import annotations

import json
from collections import Counter
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..core.errors import UsageError

__all__ = ["Topology", "NodeLink", "TOPO_ENV", "read", "from_env", "inter_levels", "rack_levels",
           "model_options", "DEFAULT_LATENCY"]

#: The environment variable that names the topology file, as ``NCCL_TOPO_FILE`` does.
TOPO_ENV = "REFCOLL_TOPO_FILE"

#: Latency across nodes assumed when the file gives none: a TCP message between two hosts.
DEFAULT_LATENCY = 50e-6


@dataclass(frozen=True)
class NodeLink:
    """One node: its host name, rack, ranks and own link rate (bits per second, one way)."""

    host: str
    rack: int = 1
    ranks: int = 1
    link_bits_per_s: float = 0.0


@dataclass(frozen=True)
class Topology:
    """The nodes, their racks and links; :func:`read` and :meth:`write` keep it as JSON."""

    nodes: tuple[NodeLink, ...]
    uplinks: dict = field(default_factory=dict)  # rack -> uplink bits per second
    link_latency_s: float | None = None
    source: str = ""

    def write(self, path) -> Path:
        """Write the topology to ``path`` as JSON; return the path."""
        path = Path(path)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path

    def to_json(self) -> dict:
        """Return the file's contents."""
        return {"version": 1, "source": self.source,
                "nodes": [asdict(node) for node in self.nodes],
                "racks": [{"rack": r, "uplink_bits_per_s": rate}
                          for r, rate in sorted(self.uplinks.items())],
                "link_latency_s": self.link_latency_s}

    def of_hosts(self, hosts) -> list[NodeLink]:
        """Return the nodes of ``hosts`` (each once), in the topology's order."""
        wanted = set(hosts)
        return [node for node in self.nodes if node.host in wanted]

    def slowest_link(self, hosts) -> float:
        """Return the slowest link rate (bits per second) among ``hosts``' nodes and uplinks.

        An uplink counts per node of its rack: ``uplink / nodes of the rack``
        is what each node gets when all of them cross at once.
        """
        nodes = self.of_hosts(hosts)
        rates = [n.link_bits_per_s for n in nodes if n.link_bits_per_s > 0]
        racks = {n.rack for n in nodes}
        if len(racks) > 1:
            for rack in racks:
                members = sum(1 for n in self.nodes if n.rack == rack)
                if self.uplinks.get(rack):
                    rates.append(self.uplinks[rack] / members)
        return min(rates) if rates else 0.0


def read(path) -> Topology:
    """Read a topology file; a missing, unreadable or malformed one is a :class:`UsageError`."""
    try:
        data = json.loads(Path(path).read_text())
        nodes = tuple(NodeLink(str(n["host"]), int(n.get("rack", 1)), int(n.get("ranks", 1)),
                               float(n.get("link_bits_per_s", 0))) for n in data["nodes"])
        uplinks = {int(r["rack"]): float(r["uplink_bits_per_s"])
                   for r in data.get("racks", []) if r.get("uplink_bits_per_s")}
        latency = data.get("link_latency_s")
        topology = Topology(nodes, uplinks, None if latency is None else float(latency),
                            str(data.get("source", "")))
    except OSError as exc:
        raise UsageError(f"cannot read the topology file {path} ({TOPO_ENV}): "
                         f"{exc.strerror or exc}") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"the topology file {path} ({TOPO_ENV}) is not a refcoll topology: "
                         f"{type(exc).__name__}: {exc}; see refcoll/cluster/topology.py for "
                         "its form") from None
    if not nodes or any(n.ranks < 1 or n.link_bits_per_s < 0 for n in nodes):
        raise UsageError(f"the topology file {path} ({TOPO_ENV}) lists no node, or a node "
                         "with no rank or a negative link rate")
    return topology


def from_env() -> Topology | None:
    """Return the topology ``REFCOLL_TOPO_FILE`` names, or None when it is unset."""
    path = os.environ.get(TOPO_ENV, "").strip()
    return read(path) if path else None


def inter_levels(topology: Topology | None, hosts) -> dict:
    """Return the two-level calibration fields the topology gives for ranks on ``hosts``.

    ``{}`` when there is no topology, the ranks are on one node, or the file
    knows none of their hosts' links. Otherwise β across nodes is one byte at
    the slowest link rate among them and α the file's latency (else
    :data:`DEFAULT_LATENCY`). The slowest link counts the racks' uplinks
    (:meth:`Topology.slowest_link`) unless :func:`rack_levels` prices them
    apart; then it is the nodes' own.
    """
    hosts = list(hosts)
    if topology is None or len(set(hosts)) < 2:
        return {}
    if rack_levels(topology, hosts):
        rates = [n.link_bits_per_s for n in topology.of_hosts(hosts) if n.link_bits_per_s > 0]
        rate = min(rates, default=0.0)
    else:
        rate = topology.slowest_link(hosts)
    if rate <= 0 or len(topology.of_hosts(hosts)) < len(set(hosts)):
        return {}
    counts = Counter(hosts)
    return {"inter_alpha": topology.link_latency_s or DEFAULT_LATENCY,
            "inter_beta": 8.0 / rate, "nodes": len(counts), "per_node": max(counts.values())}


def rack_levels(topology: Topology | None, hosts) -> dict:
    """Return the rack fields of a calibration (``rack_beta``, ``rack_nodes``) for ``hosts``.

    ``{}`` unless the ranks' hosts (one a rank, in rank order) lie in two or
    more racks of the file, every rack holding the same number of the nodes,
    each rack's ranks consecutive, and every rack with an uplink rate: the
    layout ``auto`` prices a rack level on (a rank's rack given by its host).
    ``rack_beta`` is one byte through the slowest uplink among them.
    """
    hosts = list(hosts)
    if topology is None or len(set(hosts)) < 2:
        return {}
    rack_of = {node.host: node.rack for node in topology.nodes}
    if any(h not in rack_of for h in hosts):
        return {}
    order = [rack_of[h] for h in hosts]
    runs = [r for i, r in enumerate(order) if i == 0 or order[i - 1] != r]
    if len(runs) < 2 or len(runs) != len(set(runs)):
        return {}  # one rack, or a rack whose ranks are not consecutive
    nodes = {r: len({h for h in hosts if rack_of[h] == r}) for r in runs}
    uplinks = [topology.uplinks.get(r, 0.0) for r in runs]
    if len(set(nodes.values())) != 1 or min(uplinks) <= 0:
        return {}
    return {"rack_beta": 8.0 / min(uplinks), "rack_nodes": nodes[runs[0]]}


def model_options(topology: Topology) -> dict:
    """Return ``refcoll model``'s option values for the cluster the topology describes.

    Nodes and ranks per node (the most on one), one NIC a node at the slowest
    node link, quoted one way; racks with uplinks become a spine shared by each
    rack's nodes (``--no-rail --spine-bw``: the uplink over its nodes).
    """
    rates = [n.link_bits_per_s for n in topology.nodes if n.link_bits_per_s > 0]
    if not rates:
        raise UsageError("the topology gives no link rate: add link_bits_per_s to its nodes")
    options = {"nodes": str(len(topology.nodes)),
               "gpus_per_node": str(max(n.ranks for n in topology.nodes)),
               "inter_bw": f"{min(rates) / 8!r}B/s", "nics_per_node": "1",
               "inter_quoted": "unidirectional"}
    if topology.link_latency_s:
        options["inter_latency"] = f"{topology.link_latency_s!r}s"
    racks = {n.rack for n in topology.nodes}
    if len(racks) > 1 and topology.uplinks:
        share = min(rate / sum(1 for n in topology.nodes if n.rack == rack)
                    for rack, rate in topology.uplinks.items())
        options.update(rail=False, spine_bw=f"{share / 8!r}B/s")
    return options
