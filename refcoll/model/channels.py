"""NCCL-style collectives: several rings or trees at once, each crossing on its own NIC.

NCCL splits a collective's buffer over ``C`` *channels* and runs one ring (or
tree) per channel at the same time; its topology search gives each channel
its own NIC, so the ``C`` rings cross every node boundary side by side
(NCCL's ``src/graph/search.cc``, ``connect.cc``). refcoll's own schedules run
one ring; these are the same schedules run ``C`` times on ``1/C`` of the
buffer each, priced by :meth:`~refcoll.model.cluster.Cluster.channel_link`:
a GPU's intra-node link carries all ``C`` channels, a channel's crossing gets
its NIC (``⌈C/nics⌉`` channels share one; without rails they share the spine
too). Counts come from the algorithms' own cost functions, for the largest
channel (``⌈n/C⌉`` elements); a phase's ``bytes`` and ``reduced`` are one
GPU's over every channel, its ``rounds`` one channel's (they run at once).

* ``ring/ch``: NCCL's Ring. On 8 nodes × 8 GPUs with a 25 GB/s NIC each, 28 GB
  take ``2·(63/64)·28 GB / (8 × 25 GB/s) ≈ 0.28 s``.
* ``tree/ch``: refcoll's binomial tree per channel (each channel's tree across
  nodes on its own NIC).
* ``dbtree/ch``: NCCL's Tree: in each channel a chain through the node's GPUs
  and a double binary tree across nodes (Sanders, Speck and Träff 2009; NCCL
  2.4), the two trees on the same NIC (NCCL's channel ``c`` and ``c + C``),
  reduce and broadcast pipelined at once. A GPU sends each element twice (up
  and down the chain); a node's NIC carries ``3/2`` of its part as an interior
  node of one tree and ``1/2`` as a leaf of the other: ``2·n/C`` each way per
  channel, on ``2(g-1)`` intra-node and ``2⌊lg m⌋`` inter-node hops.
* ``pat``: PAT-style (NCCL 2.23's Parallel Aggregated Trees, for allgather and
  reduce-scatter at one GPU per node): a ring reduce-scatter in each node, a
  Bruck reduce-scatter and allgather of each GPU's shard across nodes on its
  rail (``⌈lg m⌉`` rounds each, PAT's schedule when its buffers hold what it
  aggregates; :mod:`refcoll.algorithms.bruck`, counted by :func:`pat_cost`
  with every block the largest), a ring allgather in each node.
  NCCL runs no PAT all-reduce; this is the composition it allows.

* ``nccl``: what NCCL runs, as :mod:`refcoll.model.nccl_run` picks and prices it
  (the step report's baseline).

Spec: spec/model.md
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from ..algorithms.bruck import bruck_steps, moving_offsets
from ..algorithms.ring import ring_allgather_cost, ring_price, ring_reduce_scatter_cost
from ..algorithms.tree import tree_price
from ..core.chunking import max_chunk
from ..core.cost import Cost
from ..core.units import counted
from .nccl_run import busbw_factor, predict
from .phases import Phase, price_phase
from .systems import as_system

__all__ = ["Channelled", "CHANNELLED", "channelled_phases", "pat_cost"]


class Channelled(NamedTuple):
    """A collective the model prices with channels: a line for the help, its pricer."""

    summary: str
    phases: Callable


def _channel_phase(cluster, name: str, link: str, cost: Cost, itemsize: int) -> Phase:
    """Price one channel's ``cost`` on ``link``: the channels run at once, on shared links."""
    c = cluster.channel_count
    alpha, beta = cluster.channel_link(link)
    reduced = cost.reduced * c  # a GPU reduces every channel's part, at its one rate
    seconds = (cost.rounds * alpha + cost.critical_bytes * beta
               + reduced * itemsize * cluster.seconds_per_byte_reduced())
    return Phase(f"{name} ×{c}", link, cost.rounds, cost.critical_bytes * c, reduced, seconds,
                 cost.rounds * alpha)


def _ring(cluster, count: int, itemsize: int) -> list[Phase]:
    per = max_chunk(count, cluster.channel_count)
    return [_channel_phase(cluster, part.name, part.link, part.cost, itemsize)
            for part in ring_price(cluster.shape, per, itemsize)]


def _tree(cluster, count: int, itemsize: int) -> list[Phase]:
    per = max_chunk(count, cluster.channel_count)
    return [_channel_phase(cluster, part.name, part.link, part.cost, itemsize)
            for part in tree_price(cluster.shape, per, itemsize)]


def _depth(nodes: int) -> int:
    """Return the double binary tree's depth over ``nodes`` nodes: ``⌊lg m⌋`` (NCCL's log2i)."""
    return nodes.bit_length() - 1


def _dbtree(cluster, count: int, itemsize: int) -> list[Phase]:
    """NCCL's Tree: a chain in each node, a double binary tree across nodes, per channel."""
    g, m, c = cluster.gpus_per_node, cluster.nodes, cluster.channel_count
    if g * m == 1 or count == 0:
        return []
    per = max_chunk(count, c)
    intra_rounds, inter_rounds = 2 * (g - 1), 2 * _depth(m)
    alpha_intra, beta_intra = cluster.channel_link("intra")
    alpha_inter, beta_inter = cluster.channel_link("inter")
    beta = max(beta_intra if g > 1 else 0.0, beta_inter if m > 1 else 0.0)
    # Each GPU folds one partial of every element; a channel's head GPU folds the network
    # children's too (2 of its half as an interior node, none as a leaf).
    reduced = per * c + (per * -(-c // g) if m > 1 else 0)
    latency = intra_rounds * alpha_intra + inter_rounds * alpha_inter
    seconds = (latency + 2 * per * itemsize * beta
               + reduced * itemsize * cluster.seconds_per_byte_reduced())
    link = "slowest" if g > 1 and m > 1 else ("intra" if m == 1 else "inter")
    return [Phase(f"chain + double binary tree, reduce ∥ broadcast ×{c}", link,
                  intra_rounds + inter_rounds, 2 * per * itemsize * c, reduced, seconds,
                  latency)]


def pat_cost(m: int, block: int, itemsize: int, *, reduce: bool) -> Cost:
    """Return one rank's counts of a Bruck (PAT) allgather, or reduce-scatter, of blocks of
    ``block`` elements on ``m`` ranks: ``⌈lg m⌉`` rounds; at the step of distance ``2^k``
    every rank moves the :func:`~refcoll.algorithms.bruck.moving_offsets` blocks.

    The counts of :func:`~refcoll.algorithms.bruck.bruck_allgather_cost` when every
    block has ``block`` elements, in ``O(lg m)`` rather than ``O(m²)`` steps, so a
    cluster of thousands of nodes prices at once.
    """
    if m == 1:
        return Cost(rounds=0, messages=0, bytes=0, max_rank_messages=0, max_rank_bytes=0,
                    critical_bytes=0, reduced=0)
    steps = bruck_steps(m)
    moved = sum(len(moving_offsets(m, k)) for k in range(steps)) * block
    return Cost(rounds=steps, messages=m * steps, bytes=m * moved * itemsize,
                max_rank_messages=steps, max_rank_bytes=moved * itemsize,
                critical_bytes=moved * itemsize, reduced=moved if reduce else 0)


def _pat(cluster, count: int, itemsize: int) -> list[Phase]:
    """PAT-style: ring halves in the nodes, Bruck reduce-scatter and allgather on each rail."""
    g, m = cluster.gpus_per_node, cluster.nodes
    shard = max_chunk(count, g)
    phases = []
    if g > 1:
        phases.append(price_phase(cluster, "intra reduce-scatter", "intra",
                                  ring_reduce_scatter_cost(g, count, itemsize), itemsize))
    if m > 1:
        block = max_chunk(shard, m)  # the largest block: exact when m divides the shard
        phases.append(price_phase(cluster, "inter PAT reduce-scatter", "inter",
                                  pat_cost(m, block, itemsize, reduce=True), itemsize))
        phases.append(price_phase(cluster, "inter PAT allgather", "inter",
                                  pat_cost(m, block, itemsize, reduce=False), itemsize))
    if g > 1:
        phases.append(price_phase(cluster, "intra allgather", "intra",
                                  ring_allgather_cost(g, shard, itemsize), itemsize))
    return phases


def _nccl(cluster, count: int, itemsize: int) -> list[Phase]:
    """What NCCL runs (:mod:`refcoll.model.nccl_run`): its pick among its algorithms and
    protocols on the cluster's links, priced as one phase."""
    nbytes = count * itemsize
    run = predict(as_system(cluster), nbytes) if cluster.gpus > 1 else None
    if run is None:
        return [Phase("one GPU: nothing to send", "local", 0, 0, 0, 0.0)]
    return [Phase(f"NCCL {run.name} on {counted(run.channels, 'channel')}, {run.limit}-bound",
                  "slowest", 1, int(nbytes * busbw_factor(cluster.gpus)), 0, run.seconds,
                  run.latency)]


#: The channelled collectives, by the name ``--algorithm`` takes.
CHANNELLED = {
    "nccl": Channelled("what NCCL runs: its algorithm and protocol, picked and priced on the "
                       "cluster's links (Ring, Tree, NVLS, NVLSTree, CollNet)", _nccl),
    "ring/ch": Channelled("NCCL's ring: a ring per channel, each crossing on its own NIC", _ring),
    "tree/ch": Channelled("binomial tree per channel, each across nodes on its own NIC", _tree),
    "dbtree/ch": Channelled("NCCL's tree: a chain in each node, a double binary tree across "
                            "nodes, per channel, pipelined", _dbtree),
    "pat": Channelled("PAT-style: ring reduce-scatter in the node, PAT (Bruck) reduce-scatter "
                      "and allgather across nodes on each rail, ring allgather", _pat),
}


def channelled_phases(cluster, name: str, count: int, itemsize: int) -> tuple[Phase, ...]:
    """Return the phases of the channelled all-reduce ``name`` of ``count`` elements."""
    return tuple(CHANNELLED[name].phases(cluster, count, itemsize))


