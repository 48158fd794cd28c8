"""What an emulated cluster is built from, each number bounded: nodes, ranks, links, racks.

:class:`ClusterSpec` is checked before anything is built (:meth:`ClusterSpec.check`), so
that a number out of bounds (``--nodes 300``, ``--oversubscription nan``, a link rate
of ``1e-300kbit``, ``--delay 1e300s``) is one line, exit 2, and no namespace is made.

Example:
    >>> ClusterSpec(nodes=2, link="100mbit").check()
    >>> parse_rate("100mbit")
    100000000.0
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..core.errors import UsageError
from ..core.reading import number
from ..core.topology import MIN_BITS_PER_S
from ..core.units import parse_bandwidth, parse_duration

__all__ = ["ClusterSpec", "parse_rate", "MAX_NODES", "MAX_RANKS_PER_NODE", "MIN_RATE",
           "MAX_RATE", "MAX_OVERSUBSCRIPTION", "MAX_DELAY_S"]

#: The most nodes a cluster has. The addressing (``10.203.0.N``) would allow 254, but
#: every node is a namespace, a veth pair, four qdiscs and its ranks' processes on this
#: one machine, whose cores they all share: past 64 a build takes minutes and a run
#: measures the machine's scheduler, not the links.
MAX_NODES = 64

#: The most ranks a node runs (they share this machine's cores with every other node's).
MAX_RANKS_PER_NODE = 256

#: The slowest link, bits per second: 1 kbit/s (the least a topology file may give).
MIN_RATE = MIN_BITS_PER_S

#: The fastest link, bits per second: 1 Tbit/s. tbf's bucket (1/250 s of the rate) must
#: fit its 32 bits; at 10 Tbit/s it is 5 GB, which tc refuses (and a veth carries far less).
MAX_RATE = 1e12

#: The most a rack's uplink is oversubscribed (its nodes' links over the uplink's rate).
MAX_OVERSUBSCRIPTION = 1000

#: The longest added delay per link: 1 s (netem's; longer, a TCP handshake times out).
MAX_DELAY_S = 1.0


def _within(value, option: str, *, least, most, integer: bool = False, why: str = ""):
    """Return ``value`` if it is a finite number in [least, most]; else one line saying why."""
    try:
        return number(value, where=option, least=least, most=most, integer=integer)
    except UsageError as exc:
        raise UsageError(f"{exc}{why}") from None


def _node_number(key, option: str, nodes: int) -> int:
    """Return a node number given as a key (an int, or a string of digits from JSON)."""
    if isinstance(key, str) and re.fullmatch(r"[0-9]{1,3}", key.strip()):
        key = int(key)
    if isinstance(key, bool) or not isinstance(key, int) or not 1 <= key <= nodes:
        raise UsageError(f"{option} names node {key!r:.40}; nodes are 1..{nodes}")
    return key


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
        """Refuse, in one line, any number out of bounds: before anything is built."""
        _within(self.nodes, "--nodes", least=1, most=MAX_NODES, integer=True,
                why=f" (1 to {MAX_NODES}: every node is a namespace of this machine, sharing "
                    "its cores)")
        _within(self.ranks_per_node, "--ranks-per-node", least=1, most=MAX_RANKS_PER_NODE,
                integer=True, why=f" (1 to {MAX_RANKS_PER_NODE}: the ranks of every node share "
                                  "this machine's cores)")
        _within(self.racks, "--racks", least=1, most=self.nodes, integer=True,
                why=" (a rack holds at least one node)")
        if self.nodes % self.racks:
            raise UsageError(f"{self.nodes} nodes do not divide into {self.racks} racks")
        _within(self.oversubscription, "--oversubscription", least=1,
                most=MAX_OVERSUBSCRIPTION,
                why=f" (1 to {MAX_OVERSUBSCRIPTION}: a rack's uplink runs at its nodes' links "
                    "over it)")
        for option, given in (("--node-link", self.node_links), ("--node-ranks", self.node_ranks)):
            if not isinstance(given, dict):
                raise UsageError(f"{option}: give NODE=VALUE pairs")
            for node in given:
                _node_number(node, option, self.nodes)
        for rate in [self.link, *self.node_links.values()]:
            if not isinstance(rate, str):
                raise UsageError(f"link rate {rate!r:.40}: give a rate such as 1gbit")
            parse_rate(rate)
        for node, count in self.node_ranks.items():
            _within(count, f"--node-ranks {node}", least=1, most=MAX_RANKS_PER_NODE,
                    integer=True, why=f" (a node runs 1 to {MAX_RANKS_PER_NODE} ranks)")
        if self.delay is not None:
            self.delay_s()
        if self.racks > 1:
            uplink = parse_rate(self.link) * (self.nodes // self.racks) / self.oversubscription
            if not MIN_RATE <= uplink <= MAX_RATE:
                raise UsageError(f"--link {self.link} x {self.nodes // self.racks} nodes a rack / "
                                 f"--oversubscription {self.oversubscription:g}: a rack's uplink "
                                 f"would run at {uplink:.6g} bit/s, outside {MIN_RATE:g} to "
                                 f"{MAX_RATE:g}")

    def delay_s(self) -> float:
        """The added one-way delay in seconds (``delay`` read; 0 when none)."""
        if self.delay is None:
            return 0.0
        if not isinstance(self.delay, str):
            raise UsageError(f"--delay {self.delay!r:.40}: give a time such as 50us")
        seconds = parse_duration(self.delay, name="--delay", unit=True)
        if seconds > MAX_DELAY_S:
            raise UsageError(f"--delay {self.delay!r}: at most {MAX_DELAY_S:g} s a link")
        return seconds

    def ranks(self, i: int) -> int:
        """The ranks node ``i`` runs."""
        return int(self.node_ranks.get(i, self.node_ranks.get(str(i), self.ranks_per_node)))

    @property
    def total_ranks(self) -> int:
        return sum(self.ranks(i) for i in range(1, self.nodes + 1))


def parse_rate(text) -> float:
    """Return bits per second from ``tc``'s ``1gbit``, ``100mbit``, ``500kbit``, or ``1Gbit/s``.

    A rate outside :data:`MIN_RATE` to :data:`MAX_RATE` (1 kbit/s to 1 Tbit/s) is refused.
    """
    given = text
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([kmgt]?)(?:bit|bps)\s*", str(text).lower())
    if m:
        text = f"{m.group(1)}{m.group(2).upper().replace('K', 'k')}bit/s"
    try:
        bits = 8 * parse_bandwidth(text, name="link rate")
    except UsageError as exc:  # named as it was given, with a link's units and range
        if "cannot read" in str(exc):
            raise UsageError(f"link rate {given!r:.40}: write it as tc does (1gbit, 100mbit, "
                             "500kbit), or as 1Gbit/s or 1Gbps") from None
        if "1 EB/s" not in str(exc):  # beyond any rate: beyond a link's too, said below
            raise UsageError(str(exc).replace(repr(text), repr(given), 1)) from None
        bits = 0.0
    if not MIN_RATE <= bits <= MAX_RATE:
        raise UsageError(f"link rate {given!r:.40}: an emulated link runs at 1kbit (1 kbit/s) "
                         f"to 1tbit (1 Tbit/s)")
    return bits
