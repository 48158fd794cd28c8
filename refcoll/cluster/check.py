"""Check the emulation before trusting it: each link's rate and round trip, measured.

A plain TCP socket between two nodes' namespaces: the round trip is the median of
200 one-byte ping-pongs, the rate a 16 MiB stream (its time to the receiver's
acknowledgement). Node ``i`` is measured against the fastest other node, so the
figure is its own link's (a transfer is bounded by the slower of the two).

Then the two nodes stream 16 MiB to each other at once, :data:`BOTH_WAYS` times:
an all-reduce sends and receives at once, and then each direction's data shares
the link with the acknowledgements of the other's, which wait in the same queue.
That rate, not the one-way stream's, is the most an all-reduce across the link
can reach.
"""

from __future__ import annotations

import json
import statistics
import subprocess

from ..core.errors import RefcollError
from ..core.processes import python
from .emulate import Cluster, parse_rate

__all__ = ["measure_link", "measure_links", "format_links", "BOTH_WAYS"]

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


def measure_link(cluster: Cluster, i: int, peer: int, nbytes: int = 16 << 20,
                 port: int = 47123, both_ways: int = BOTH_WAYS) -> dict:
    """Return node ``i``'s round trip to ``peer``, the rate of a stream from ``i`` to it, and
    the rate each way of ``both_ways`` pairs of streams between them at once (a list).

    Raises :class:`~refcoll.core.errors.RefcollError` with the client's last words where
    the measurement fails or outlasts 4 times what the slower link asked for allows.
    """
    slower = min(parse_rate(cluster.rate(i)), parse_rate(cluster.rate(peer)))
    allowed = 60 + 4 * nbytes * 8 * (1 + both_ways) / slower
    what = f"cluster check: the streams between node {i} and node {peer}"
    server = subprocess.Popen(["ip", "netns", "exec", cluster.node_ns(peer),
                               *python("-c", _SERVER, str(port), str(nbytes), str(both_ways))],
                              stdout=subprocess.PIPE, text=True)
    try:
        server.stdout.readline()  # "ready"
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


def measure_links(cluster: Cluster, nbytes: int = 16 << 20) -> list[dict]:
    """Return, per node, the rate and round trip measured beside what was asked for."""
    nodes = range(1, cluster.spec.nodes + 1)
    rows = []
    for i in nodes:
        others = [j for j in nodes if j != i]
        if not others:
            break
        # the fastest peer in the same rack: the node's own link, not an uplink
        peer = max(others, key=lambda j: (cluster.rack_of(j) == cluster.rack_of(i),
                                          parse_rate(cluster.rate(j))))
        rows.append({"node": i, "peer": peer, "asked_bits_per_s": parse_rate(cluster.rate(i)),
                     "delay": cluster.spec.delay, **measure_link(cluster, i, peer, nbytes)})
    return rows


def format_links(rows: list[dict]) -> list[str]:
    """One line per link: what was asked, what a socket measured one way and both ways at once."""
    lines = []
    for row in rows:
        asked, got = row["asked_bits_per_s"], row["bits_per_s"]
        delay = f", delay {row['delay']} asked" if row["delay"] else ""
        lines.append(f"node {row['node']} (to node {row['peer']}): asked {asked / 1e6:.0f} Mbit/s"
                     f"{delay}; measured {got / 1e6:.0f} Mbit/s ({got / asked:.0%})"
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
