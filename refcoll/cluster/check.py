"""Check the emulation before trusting it: each link's rate and round trip, measured.

A plain TCP socket between two nodes' namespaces: the round trip is the median of
200 one-byte ping-pongs, the rate a stream of 2 s of the path's rate (4 KiB to
16 MiB: :func:`stream_bytes`), timed to the receiver's acknowledgement. Node ``i``
is measured against the fastest other node of its rack, so the figure is its own
link's where it can be; what it is held to is the slowest link on the path
(:func:`path_rate`: the peer's, or the racks' uplink), which the line names. A
check that would take more than :data:`MOST_SECONDS` (a link of a few kbit/s) is
refused before it starts.

Then the two nodes stream as much to each other at once, :data:`BOTH_WAYS` times:
an all-reduce sends and receives at once, and then each direction's data shares
the link with the acknowledgements of the other's, which wait in the same queue.
That rate, not the one-way stream's, is the most an all-reduce across the link
can reach.
"""

from __future__ import annotations

import json
import statistics
import subprocess

from ..core.errors import RefcollError, UsageError
from ..core.processes import python
from .emulate import Cluster, parse_rate

__all__ = ["measure_link", "measure_links", "format_links", "path_rate", "stream_bytes",
           "BOTH_WAYS", "MOST_SECONDS"]

#: Streams both ways at once after the one-way stream; each is timed on its own.
BOTH_WAYS = 3

_COMMON = r"""
import socket, sys, threading
def drain(c, n):
    while n > 0:
        got = len(c.recv(min(n, 1 << 20)))
        if not got:
            sys.exit("the peer closed the connection")
        n -= got
def stream(c, n):
    block = b"x" * (1 << 20)
    while n > 0:
        c.sendall(block[:n]); n -= len(block)
def both_ways(c, n):
    sender = threading.Thread(target=stream, args=(c, n)); sender.start()
    drain(c, n); sender.join()
"""

_SERVER = _COMMON + r"""
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for _ in range(200):
    c.sendall(c.recv(1))
want, repeats = int(sys.argv[2]), int(sys.argv[3])
drain(c, want); c.sendall(b"k")
for _ in range(repeats):
    both_ways(c, want); c.sendall(b"k")  # after its own stream: the peer has both
"""

_CLIENT = _COMMON + r"""
import json, statistics, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(200):
    t = time.perf_counter(); c.sendall(b"x"); c.recv(1); rtts.append(time.perf_counter() - t)
want, repeats = int(sys.argv[3]), int(sys.argv[4])
t = time.perf_counter(); stream(c, want); c.recv(1)
one_way = want * 8 / (time.perf_counter() - t)
both = []
for _ in range(repeats):
    t = time.perf_counter(); both_ways(c, want); c.recv(1)
    both.append(want * 8 / (time.perf_counter() - t))
print(json.dumps({"rtt_s": statistics.median(rtts), "bits_per_s": one_way,
                  "both_ways_bits_per_s": both}))
"""


def path_rate(cluster: Cluster, i: int, peer: int) -> tuple[float, str]:
    """Return the rate of the slowest link between nodes ``i`` and ``peer`` (bits/s) and
    which it is: ``node i``'s, ``node peer``'s, or the racks' uplink (one stream takes a
    whole uplink; between racks it crosses two of the same rate)."""
    limits = [(parse_rate(cluster.rate(i)), f"node {i}'s link"),
              (parse_rate(cluster.rate(peer)), f"node {peer}'s link")]
    if cluster.rack_of(i) != cluster.rack_of(peer):
        uplinks = cluster.topology().uplinks
        limits.append((min(uplinks[cluster.rack_of(i)], uplinks[cluster.rack_of(peer)]),
                       "the racks' uplink"))
    return min(limits, key=lambda limit: limit[0])


#: The longest a check may take for one link (a few kbit/s would take hours): refused first.
MOST_SECONDS = 300.0

#: Seconds of the path's rate each stream carries (so a slow link is measured briefly), and
#: its bounds in bytes.
_STREAM_SECONDS, _LEAST_BYTES, _MOST_BYTES = 2.0, 4 << 10, 16 << 20

#: What the 200 one-byte ping-pongs put on the wire, about (headers included), bytes.
_PING_BYTES = 200 * 2 * 100


def stream_bytes(rate: float) -> int:
    """Return the bytes each timed stream carries on a path of ``rate`` bits/s."""
    return int(min(max(rate / 8 * _STREAM_SECONDS, _LEAST_BYTES), _MOST_BYTES))


def measure_link(cluster: Cluster, i: int, peer: int, nbytes: int | None = None,
                 port: int = 47123, both_ways: int = BOTH_WAYS) -> dict:
    """Return node ``i``'s round trip to ``peer``, the rate of a stream from ``i`` to it, and
    the rate each way of ``both_ways`` pairs of streams between them at once (a list).

    ``nbytes`` (default :func:`stream_bytes` of the path's rate) a stream. Raises
    :class:`~refcoll.core.errors.RefcollError` with the last words of the side that failed
    where the measurement fails or outlasts 4 times what the path's slowest link allows;
    :class:`~refcoll.core.errors.UsageError`, before anything runs, where that would be
    more than :data:`MOST_SECONDS`.
    """
    slower, _ = path_rate(cluster, i, peer)
    nbytes = stream_bytes(slower) if nbytes is None else nbytes
    allowed = 60 + 4 * _wire_bits(nbytes, both_ways) / slower
    what = f"cluster check: the streams between node {i} and node {peer}"
    if allowed > MOST_SECONDS:
        raise UsageError(f"{what} would take up to {allowed:.0f} s at {slower:.0f} bit/s "
                         f"(more than {MOST_SECONDS:.0f} s): check links of at least "
                         f"{_least_rate(both_ways) / 1e3:.0f} kbit/s")
    server = subprocess.Popen(["ip", "netns", "exec", cluster.node_ns(peer),
                               *python("-c", _SERVER, str(port), str(nbytes), str(both_ways))],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if server.stdout.readline().strip() != "ready":  # it could not listen: say why, now
            server.kill()
            said = (server.stderr.read().strip().splitlines() or ["no output"])[-1]
            raise RefcollError(f"{what}: the receiver on node {peer} did not start: {said}")
        try:
            res = subprocess.run(["ip", "netns", "exec", cluster.node_ns(i),
                                  *python("-c", _CLIENT, cluster.address(peer), str(port),
                                          str(nbytes), str(both_ways))],
                                 capture_output=True, text=True, timeout=allowed)
        except subprocess.TimeoutExpired:
            raise RefcollError(f"{what} took over {allowed:.0f} s") from None
        try:
            return json.loads(res.stdout)
        except ValueError:
            last = (res.stderr.strip().splitlines() or ["no output"])[-1]
            raise RefcollError(f"{what} failed (exit {res.returncode}): {last}") from None
    finally:
        server.kill()
        server.wait()


def _wire_bits(nbytes: int, both_ways: int) -> int:
    """Return the bits one check of a link puts on it: its streams and its ping-pongs."""
    return (nbytes * (1 + both_ways) + _PING_BYTES) * 8


def _least_rate(both_ways: int) -> float:
    """Return the slowest path (bits/s) a check finishes within :data:`MOST_SECONDS`."""
    return 4 * _wire_bits(_LEAST_BYTES, both_ways) / (MOST_SECONDS - 60)


def measure_links(cluster: Cluster, nbytes: int | None = None) -> list[dict]:
    """Return, per node, the rate and round trip measured beside what the path between it and
    its peer was asked to carry (its slowest link: :func:`path_rate`).

    Raises:
        UsageError: a cluster of one node, which has no link between nodes.
    """
    nodes = range(1, cluster.spec.nodes + 1)
    if len(nodes) < 2:
        raise UsageError(f"cluster {cluster.prefix} has one node: there is no link between "
                         "nodes to measure (refcoll cluster up --nodes 2 or more)")
    rows = []
    for i in nodes:
        others = [j for j in nodes if j != i]
        # the fastest peer in the same rack: the node's own link, not an uplink
        peer = max(others, key=lambda j: (cluster.rack_of(j) == cluster.rack_of(i),
                                          parse_rate(cluster.rate(j))))
        asked, limit = path_rate(cluster, i, peer)
        rows.append({"node": i, "peer": peer, "asked_bits_per_s": asked, "limit": limit,
                     "delay": cluster.spec.delay, **measure_link(cluster, i, peer, nbytes)})
    return rows


def format_links(rows: list[dict]) -> list[str]:
    """One line per link: what was asked, what a socket measured one way and both ways at once."""
    lines = []
    for row in rows:
        asked, got = row["asked_bits_per_s"], row["bits_per_s"]
        delay = f", delay {row['delay']} asked" if row["delay"] else ""
        own = row.get("limit", "").startswith(f"node {row['node']}'")
        limit = "" if own or "limit" not in row else f" ({row['limit']})"
        lines.append(f"node {row['node']} (to node {row['peer']}): asked {asked / 1e6:.0f} Mbit/s"
                     f"{limit}{delay}; measured {got / 1e6:.0f} Mbit/s ({got / asked:.0%})"
                     f"{_both_ways(row['both_ways_bits_per_s'], asked)}, round trip "
                     f"{row['rtt_s'] * 1e6:.0f} us")
    return lines


def _both_ways(rates: list[float], asked: float) -> str:
    """``", both ways at once 90 Mbit/s each (90%; 85-94 over 3)"``, or nothing without rates."""
    if not rates:
        return ""
    middle = statistics.median(rates)
    spread = (f"; {min(rates) / 1e6:.0f}-{max(rates) / 1e6:.0f} over {len(rates)}"
              if len(rates) > 1 else "")
    return (f", both ways at once {middle / 1e6:.0f} Mbit/s each ({middle / asked:.0%}"
            f"{spread})")
