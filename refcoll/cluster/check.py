"""Check the emulation before trusting it: each link's rate and round trip, measured.

A plain TCP socket between two nodes' namespaces: the round trip is the median of
200 one-byte ping-pongs, the rate a 16 MiB stream (its time to the receiver's
acknowledgement). Node ``i`` is measured against the fastest other node, so the
figure is its own link's (a transfer is bounded by the slower of the two).
"""

from __future__ import annotations

import json
import subprocess
import sys

from .emulate import Cluster, parse_rate

__all__ = ["measure_link", "measure_links", "format_links"]

_SERVER = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1); print("ready", flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for _ in range(200):
    c.sendall(c.recv(1))
n, want = 0, int(sys.argv[2])
while n < want:
    n += len(c.recv(1 << 20))
c.sendall(b"k")
"""

_CLIENT = r"""
import json, socket, statistics, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(200):
    t = time.perf_counter(); c.sendall(b"x"); c.recv(1); rtts.append(time.perf_counter() - t)
block, want = b"x" * (1 << 20), int(sys.argv[3])
t = time.perf_counter()
for _ in range(want // len(block)):
    c.sendall(block)
c.recv(1)
seconds = time.perf_counter() - t
print(json.dumps({"rtt_s": statistics.median(rtts), "bits_per_s": want * 8 / seconds}))
"""


def measure_link(cluster: Cluster, i: int, peer: int, nbytes: int = 16 << 20,
                 port: int = 47123) -> dict:
    """Return node ``i``'s round trip to ``peer`` and the rate of a stream from ``i`` to it."""
    server = subprocess.Popen(["ip", "netns", "exec", cluster.node_ns(peer), sys.executable,
                               "-c", _SERVER, str(port), str(nbytes)],
                              stdout=subprocess.PIPE, text=True)
    try:
        server.stdout.readline()  # "ready"
        res = subprocess.run(["ip", "netns", "exec", cluster.node_ns(i), sys.executable, "-c",
                              _CLIENT, cluster.address(peer), str(port), str(nbytes)],
                             capture_output=True, text=True, timeout=300)
        return json.loads(res.stdout)
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
    """One line per link: what was asked, what a socket measured."""
    lines = []
    for row in rows:
        asked, got = row["asked_bits_per_s"], row["bits_per_s"]
        delay = f", delay {row['delay']} asked" if row["delay"] else ""
        lines.append(f"node {row['node']} (to node {row['peer']}): asked {asked / 1e6:.0f} Mbit/s"
                     f"{delay}; measured {got / 1e6:.0f} Mbit/s ({got / asked:.0%}), round trip "
                     f"{row['rtt_s'] * 1e6:.0f} us")
    return lines
