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

:func:`machine_of` says which machine runs a host: itself, or on an emulated cluster
(``REFCOLL_CLUSTER``) the one machine whose namespaces are its nodes, so that ranks
are counted against the cores they really share.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .errors import UsageError
from .reading import number, read_json
from .writing import write_json

__all__ = ["Topology", "NodeLink", "TOPO_ENV", "read", "from_env", "inter_levels", "rack_levels",
           "model_options", "model_notes", "DEFAULT_LATENCY", "MIN_BITS_PER_S",
           "MAX_BITS_PER_S", "MAX_LATENCY_S", "MAX_NODES", "MAX_RANKS", "machine_of"]

#: The environment variable that names the topology file, as ``NCCL_TOPO_FILE`` does.
TOPO_ENV = "REFCOLL_TOPO_FILE"

#: Latency across nodes assumed when the file gives none: a TCP message between two hosts.
DEFAULT_LATENCY = 50e-6

#: The slowest link rate a file may give, bits per second: 1 kbit/s (slower, one 64 KiB
#: message takes ten minutes; what is below is a typo or a unit mistaken, such as 1e-300).
MIN_BITS_PER_S = 1e3

#: The fastest: 1 Pbit/s, beyond any rack's uplink built (a node's NIC is at most 800 Gbit/s).
MAX_BITS_PER_S = 1e15

#: The longest latency across nodes a file may give: 10 s (a message that slow is no link).
MAX_LATENCY_S = 10.0

#: The most nodes (and rack numbers) a file may list, and ranks one node may run.
MAX_NODES = 1 << 16
MAX_RANKS = 1 << 16


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
        write_json(path, self.to_json(), indent=1, mode=0o644)
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
    """Read a topology file; a missing, unreadable or malformed one is a :class:`UsageError`.

    The file is read by :mod:`refcoll.core.reading` (a regular file, bounded, finite
    numbers), then every field is checked before anything is built from it: each node
    a host (named once), a rack, ranks and a link rate; each uplink a rack that holds
    a node; every rate 0 (unknown) or between :data:`MIN_BITS_PER_S` and
    :data:`MAX_BITS_PER_S`; the latency between 0 and :data:`MAX_LATENCY_S`; no field
    but those the module's docstring shows. Each refusal is one line naming the field.
    """
    data = read_json(path, what=f"topology file ({TOPO_ENV})")
    where = str(path)
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list):
        raise UsageError(f"{where}: is not a refcoll topology (no \"nodes\" list); see "
                         "refcoll/core/topology.py for its form")
    _known(data, _FIELDS, where)
    if not data["nodes"]:
        raise UsageError(f"{where}: lists no node; a topology lists at least one")
    if len(data["nodes"]) > MAX_NODES:
        raise UsageError(f"{where}: lists {len(data['nodes'])} nodes, more than the {MAX_NODES} "
                         "refcoll reads")
    nodes = tuple(_node(n, f"{where}: nodes[{k}]") for k, n in enumerate(data["nodes"]))
    hosts = Counter(n.host for n in nodes)
    twice = [h for h, count in hosts.items() if count > 1]
    if twice:
        raise UsageError(f"{where}: host {twice[0]!r} is listed {hosts[twice[0]]} times; "
                         "list each node once")
    racks = data.get("racks", [])
    if not isinstance(racks, list):
        raise UsageError(f"{where}: racks: must be a list of {{\"rack\", \"uplink_bits_per_s\"}}")
    uplinks, seen = {}, set()
    for k, entry in enumerate(racks):
        here = f"{where}: racks[{k}]"
        if not isinstance(entry, dict):
            raise UsageError(f"{here}: must be an object {{\"rack\", \"uplink_bits_per_s\"}}")
        _known(entry, _RACK_FIELDS, here)
        rack = number(entry.get("rack"), where=f"{here}.rack", integer=True, least=1,
                      most=MAX_NODES)
        if rack in seen:
            raise UsageError(f"{here}: rack {rack} is listed twice")
        seen.add(rack)
        if not any(n.rack == rack for n in nodes):
            raise UsageError(f"{here}: rack {rack} holds no node of the file; an uplink joins "
                             "a rack of the nodes listed")
        rate = entry.get("uplink_bits_per_s")
        if rate is not None:  # absent or 0: the rack has no uplink of its own
            rate = _rate(rate, f"{here}.uplink_bits_per_s", unknown=True)
        if rate:
            uplinks[rack] = float(rate)
    latency = data.get("link_latency_s")
    if latency is not None:
        latency = float(number(latency, where=f"{where}: link_latency_s", least=0,
                               most=MAX_LATENCY_S))
    source = data.get("source", "")
    if not isinstance(source, str):
        raise UsageError(f"{where}: source: must be a string, not {type(source).__name__}")
    return Topology(nodes, uplinks, latency, source)


#: The fields of the file, of a node and of a rack: any other is refused, so that a
#: misspelt one (``"link"`` for ``"link_bits_per_s"``) is not read as absent.
_FIELDS = ("version", "source", "nodes", "racks", "link_latency_s")
_NODE_FIELDS = ("host", "rack", "ranks", "link_bits_per_s")
_RACK_FIELDS = ("rack", "uplink_bits_per_s")


def _known(entry: dict, names: tuple, where: str) -> None:
    """Refuse a field refcoll does not read, naming it and the fields there are."""
    unknown = [key for key in entry if key not in names]
    if unknown:
        raise UsageError(f"{where}: has a field refcoll does not read, {unknown[0][:40]!r} "
                         f"(the fields: {', '.join(names)})")


def _rate(value, where: str, *, unknown: bool) -> float:
    """Return a link rate in bits per second, bounded (0, ``unknown``, where it may be)."""
    if unknown and value == 0 and not isinstance(value, bool):
        return 0.0
    return number(value, where=where, least=MIN_BITS_PER_S, most=MAX_BITS_PER_S)


def _node(entry, where: str) -> NodeLink:
    """Return one node of a topology file, each field checked."""
    if not isinstance(entry, dict):
        raise UsageError(f"{where}: must be an object {{\"host\", \"rack\", \"ranks\", "
                         "\"link_bits_per_s\"}")
    _known(entry, _NODE_FIELDS, where)
    host = entry.get("host")
    if not isinstance(host, str) or not host.strip() or len(host) > 255:
        raise UsageError(f"{where}.host: must be a host name (a string of 1 to 255 "
                         f"characters), not {host!r:.60}")
    rack = number(entry.get("rack", 1), where=f"{where}.rack", integer=True, least=1,
                  most=MAX_NODES)
    ranks = number(entry.get("ranks", 1), where=f"{where}.ranks", integer=True, least=1,
                   most=MAX_RANKS)
    rate = _rate(entry.get("link_bits_per_s", 0), f"{where}.link_bits_per_s", unknown=True)
    return NodeLink(host, rack, ranks, float(rate))


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


def model_notes(topology: Topology) -> list[str]:
    """Return what :func:`model_options` flattens of an uneven topology: the step report
    prices every node alike, as the one with the most ranks on the slowest link."""
    ranks = sorted({n.ranks for n in topology.nodes})
    rates = sorted({n.link_bits_per_s for n in topology.nodes if n.link_bits_per_s > 0})
    notes = []
    if len(ranks) > 1:
        notes.append(f"not expressed: the topology's nodes hold {ranks[0]} to {ranks[-1]} "
                     f"ranks; every node is priced with {ranks[-1]}")
    if len(rates) > 1:
        notes.append(f"not expressed: the topology's node links run at {rates[0] / 1e9:g} to "
                     f"{rates[-1] / 1e9:g} Gbit/s; every node is priced on the slowest")
    return notes


def machine_of(host: str) -> str:
    """Return the machine that runs ``host``: itself, or the one emulating it.

    Inside a run on an emulated cluster (``REFCOLL_CLUSTER`` names its state),
    every node is a namespace of one machine and their ranks share its cores:
    ``"vm (emulating rc…-n1, rc…-n2)"`` for each of them, so that a check of
    ranks against cores counts the machine's, not one node's. A state file that
    cannot be read, or holds no such node, leaves ``host`` as it is.
    """
    path = os.environ.get("REFCOLL_CLUSTER")
    if not path:
        return host
    try:
        state = read_json(path, what="cluster state file (REFCOLL_CLUSTER)",
                          max_bytes=1 << 20)
    except UsageError:
        return host
    nodes = state.get("nodes") if isinstance(state, dict) else None
    names = [node["host"] for node in nodes if isinstance(node, dict)
             and isinstance(node.get("host"), str)] if isinstance(nodes, list) else []
    if host not in names:
        return host
    machine = state.get("machine")
    machine = machine[:255] if isinstance(machine, str) and machine else "this machine"
    return f"{machine} (emulating {', '.join(names)})"
