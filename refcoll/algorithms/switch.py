"""In-network all-reduce: switches aggregate packets on their way up a tree.

NVIDIA SHARP (Graham et al., "Scalable Hierarchical Aggregation Protocol",
COMHPC 2016) and SwitchML (Sapio et al., "Scaling Distributed Machine Learning
with In-Network Aggregation", NSDI 2021) move the reduction into the network:
every worker streams its buffer up in small packets, each switch combines the
packets of its children and passes the partial up, and the root's result is
multicast back down. A worker sends ``n`` bytes and receives ``n`` bytes,
whatever the number of workers: half of what the ring moves.

Here the switches are processes that hold no input. A transport of ``W + S``
ranks has the ``W`` workers first and the ``S = switch_count(W)`` switches after
them, level by level. With ``W = 5`` and ``radix = 2``::

    level 3                 s10                  the root
                          /     \\
    level 2           s8           s9
                     /  \\          |
    level 1        s5    s6        s7           leaf switches
                  / \\   / \\        |
    level 0      w0 w1  w2 w3      w4           workers

Every level has ``ceil(m / radix)`` nodes over the ``m`` of the level below,
which are shared out by the chunking rule (the first ones get one more child),
so every worker is at the same depth and a switch may have a single child,
which it forwards.

Packets carry a pool index (their tag): a switch aggregates packet ``b`` in slot
``b % slots`` and never holds more than ``slots`` packets, and a worker never has
more than ``slots`` packets outstanding, as in SwitchML's pool.

Spec: spec/switch.md
"""

from __future__ import annotations

import math

import numpy as np

from ..core.chunking import max_chunk
from ..core.cost import ZERO, Cost, lamport_replay
from ..core.errors import UsageError
from ..core.ops import OPS, by_ieee_rules, dtype_name, finfo, is_float, unit_roundoff
from ..transport.base import TAGS_PER_CALL
from ._util import copy_into, view, workspace
from .registry import Algorithm, LinkCost, register
from .switch_tree import (
    MODES,
    PACKET,
    RADIX,
    SLOTS,
    check_radix,
    is_count,
    packet_bounds,
    packet_count,
    switch_count,
    switch_levels,
    switch_links,
    switch_schedule,
    switch_workers,
)

__all__ = [
    "RADIX",
    "PACKET",
    "SLOTS",
    "MODES",
    "switch_count",
    "switch_workers",
    "switch_levels",
    "switch_links",
    "packet_bounds",
    "switch_schedule",
    "int_headroom",
    "int_error_bound",
    "switch_allreduce",
    "switch_allreduce_cost",
    "switch_ideal_cost",
    "switch_price",
]

#: Bits of an int32 a quantized value may fill before the headroom for W summands.
_FIXED_BITS = 30
#: Block exponent of an all-zero block: below every finite float's (float64's least is -1073).
_ZERO_EXPONENT = -1100
#: Block exponent of a block holding NaN or Inf: above every finite float's (float64's is 1024).
_NONFINITE_EXPONENT = 1 << 16


# ------------------------------------------------------------- int mode numbers

def int_headroom(workers: int) -> int:
    """Return ``h = ceil(log2 W)``: the bits kept free so ``W`` int32 summands cannot overflow."""
    return (int(workers) - 1).bit_length()


def _shift(exponent: int, workers: int) -> int:
    """Return ``s``: a block with every ``|x| < 2**exponent`` is sent as ``rint(x * 2**s)``."""
    return _FIXED_BITS - int_headroom(workers) - exponent


def _block_exponent(block: np.ndarray) -> int:
    """Return the least ``e`` with all ``|x| < 2**e`` in ``block``: frexp's exponent of its peak."""
    if block.size == 0:
        return _ZERO_EXPONENT
    peak = float(np.max(np.abs(block)))
    if not math.isfinite(peak):
        return _NONFINITE_EXPONENT
    return math.frexp(peak)[1] if peak else _ZERO_EXPONENT


def int_error_bound(inputs, *, packet: int = PACKET, slots: int = SLOTS) -> np.ndarray:
    """Return the per-element bound on ``|int-mode sum - exact sum|``, one input per worker.

    Block ``b``'s shared exponent ``e`` is the largest over the workers (every
    ``|x| < 2**e``); each worker's value is rounded to a multiple of ``2**-s``,
    ``s = 30 - h - e``, ``h = ceil(log2 W)``, so off by at most ``2**(e + h - 31)``;
    the switch sums exactly; the worker converts the exact sum ``S`` to the dtype
    with one rounding. Hence, with ``u`` the dtype's unit roundoff and ``Σx`` exact::

        |result - Σx| <= W·2**(e+h-31) + u·(|Σx| + W·2**(e+h-31)) + tiny

    where ``tiny`` is half the dtype's least subnormal (an underflowing result).
    ``slots`` does not change the bound; it is accepted so option dicts pass through.
    """
    arrays = [np.asarray(x).reshape(-1) for x in inputs]
    workers = len(arrays)
    dtype = arrays[0].dtype
    exact = np.zeros(arrays[0].size, dtype=np.float64)
    for x in arrays:
        exact += x.astype(np.float64)
    quantum = np.zeros_like(exact)
    for lo, hi in packet_bounds(arrays[0].size, packet):
        e = max(_block_exponent(x[lo:hi]) for x in arrays)
        quantum[lo:hi] = workers * 2.0 ** (e + int_headroom(workers) - 31)
    u = unit_roundoff(dtype)
    tiny = float(finfo(dtype).smallest_subnormal) / 2
    # float64 accumulation of ``exact`` above is itself rounded: widen by W·2**-53·Σ|x|.
    slack = workers * 2.0 ** -53 * sum(np.abs(x.astype(np.float64)) for x in arrays)
    return quantum + u * (np.abs(exact) + quantum) + tiny + slack


def _quantize(block: np.ndarray, exponent: int, workers: int, wire: np.ndarray,
              scratch: np.ndarray) -> None:
    """Write ``rint(block * 2**s)`` into the int32 ``wire`` (zeros for a non-finite block)."""
    if exponent >= _NONFINITE_EXPONENT:
        wire[...] = 0
        return
    np.copyto(scratch, block, casting="unsafe")  # exact: every float type widens to float64
    np.ldexp(scratch, _shift(exponent, workers), out=scratch)  # a power of two: exact
    np.rint(scratch, out=scratch)
    np.copyto(wire, scratch, casting="unsafe")  # |value| <= 2**(30-h): fits, exactly


def _dequantize(wire: np.ndarray, exponent: int, workers: int, block: np.ndarray,
                scratch: np.ndarray) -> None:
    """Write the int32 sum ``wire`` scaled back by ``2**-s`` into ``block`` (NaN if non-finite)."""
    if exponent >= _NONFINITE_EXPONENT:
        block[...] = np.nan
        return
    np.copyto(scratch, wire, casting="unsafe")  # exact: int32 fits float64
    np.ldexp(scratch, -_shift(exponent, workers), out=scratch)  # exact barring underflow
    np.copyto(block, scratch, casting="unsafe")  # the one rounding, to the dtype


# ------------------------------------------------------------------ the streams

def _check_options(x: np.ndarray, op, radix, packet, slots, mode) -> None:
    """Raise :class:`UsageError` on every rank alike for options no rank can run with."""
    check_radix(radix)
    if not is_count(packet) or packet < 1:
        raise UsageError(f"switch packet must be an integer >= 1 (elements), got {packet!r}")
    if not is_count(slots) or not 1 <= slots <= TAGS_PER_CALL:
        raise UsageError(f"switch slots must be an integer in 1..{TAGS_PER_CALL} "
                         f"(packets a switch aggregates at once), got {slots!r}")
    if mode not in MODES:
        raise UsageError(f"switch mode must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "int":
        if not is_float(x.dtype):
            raise UsageError(f"switch mode 'int' quantizes floats to int32; {dtype_name(x.dtype)} "
                             "is not a float type: use mode='float'")
        if op.ufunc is not np.add:
            raise UsageError(f"switch mode 'int' sums int32 in the switch; it cannot compute "
                             f"{op.name!r}: use op sum or avg, or mode='float'")


def _stream(t, parent: int, packets: int, *, lag: int, slots: int, outgoing, landing,
            arrived=None) -> None:
    """Run a worker's side: packet ``b`` up at tick ``b``, the result of ``b - lag`` down.

    ``outgoing(b)`` returns the wire buffer of packet ``b``, ``landing(b)`` where
    its result is received, ``arrived(b)`` finishes it. At most ``lag + 1 =
    slots`` packets are ever outstanding.
    """
    for tick in range(packets + lag):
        if tick < packets:
            t.send(outgoing(tick), parent, tag=tick % slots)  # packet tick -> switch
        done = tick - lag
        if done >= 0:
            t.recv(landing(done), parent, tag=done % slots)  # result of packet done <- switch
            if arrived is not None:
                arrived(done)


def _aggregate(t, parent: int | None, children: list[int], lengths: list[int], *, lag: int,
               slots: int, pool: np.ndarray, incoming: np.ndarray, combine) -> None:
    """Run a switch's side over the pool ``pool[slots, width]``: at most ``slots`` packets held.

    Tick ``b``: gather packet ``b`` from the children in order into slot ``b % slots``
    (``combine(acc, incoming)`` folds each after the first) and send it up; then
    receive the result of packet ``b - lag`` from the parent (the root has it) and
    multicast it to the children in order, which frees its slot.
    """
    for tick in range(len(lengths) + lag):
        if tick < len(lengths):
            acc = pool[tick % slots, : lengths[tick]]
            t.recv(acc, children[0], tag=tick % slots)  # packet tick <- first child
            for child in children[1:]:
                part = incoming[: lengths[tick]]
                t.recv(part, child, tag=tick % slots)  # packet tick <- next child
                combine(acc, part)
            if parent is not None:
                t.send(acc, parent, tag=tick % slots)  # partial of packet tick -> parent
        done = tick - lag
        if done >= 0:
            result = pool[done % slots, : lengths[done]]
            if parent is not None:
                t.recv(result, parent, tag=done % slots)  # result of packet done <- parent
            for child in children:
                t.send(result, child, tag=done % slots)  # result of packet done -> child


def _switch_side(t, x: np.ndarray, op, parent, children, bounds, *, slots, mode) -> None:
    """Aggregate as a switch: float mode in ``x.dtype``, int mode in int32 with an exponent."""
    lag = slots - 1
    width = max_chunk(x.size, len(bounds))
    if mode == "float":
        pool = workspace(t, slots * width, x.dtype, slot=0).reshape(slots, width)
        incoming = workspace(t, width, x.dtype, slot=1)
        _aggregate(t, parent, children, [hi - lo for lo, hi in bounds], lag=lag,
                   slots=slots, pool=pool, incoming=incoming,
                   combine=lambda acc, part: t.reduce_local(op, acc, part, acc))
        return
    add, larger = OPS["sum"], OPS["max"]
    ahead = min(slots, len(bounds))
    pool = workspace(t, ahead, np.int32, slot=2).reshape(1, ahead)
    incoming = workspace(t, ahead, np.int32, slot=3)
    _aggregate(t, parent, children, [ahead], lag=0, slots=1, pool=pool, incoming=incoming,
               combine=lambda acc, part: t.reduce_local(larger, acc, part, acc))  # exponents
    pool = workspace(t, slots * (width + 1), np.int32, slot=0).reshape(slots, width + 1)
    incoming = workspace(t, width + 1, np.int32, slot=1)

    def combine(acc, part):
        t.reduce_local(add, acc[:-1], part[:-1], acc[:-1])  # exact int32 sums
        t.reduce_local(larger, acc[-1:], part[-1:], acc[-1:])  # exponent of a later block

    _aggregate(t, parent, children, [hi - lo + 1 for lo, hi in bounds], lag=lag,
               slots=slots, pool=pool, incoming=incoming, combine=combine)


@by_ieee_rules  # (a float16 sum past its range is IEEE's inf there: never a one-rank raise)
def _worker_int(t, x: np.ndarray, out: np.ndarray, parent: int, bounds, *, workers: int,
                slots: int) -> None:
    """Stream as an int-mode worker: agree on block exponents ``slots`` blocks ahead."""
    packets = len(bounds)
    lag = slots - 1
    width = max_chunk(x.size, packets)
    ahead = min(slots, packets)
    exponents = np.empty(packets, dtype=np.int32)  # agreed exponent of each block
    for b in range(ahead):
        exponents[b] = _block_exponent(view(x, bounds, b))
    _stream(t, parent, 1, lag=0, slots=1, outgoing=lambda _: exponents[:ahead],
            landing=lambda _: exponents[:ahead])  # blocks 0..ahead-1: max over workers
    wire_up = workspace(t, width + 1, np.int32, slot=0)
    wire_down = workspace(t, width + 1, np.int32, slot=1)
    scratch = workspace(t, width, np.float64, slot=2)

    def outgoing(b: int) -> np.ndarray:
        lo, hi = bounds[b]
        size = hi - lo
        _quantize(x[lo:hi], int(exponents[b]), workers, wire_up[:size], scratch[:size])
        later = b + slots
        wire_up[size] = (_block_exponent(view(x, bounds, later)) if later < packets
                         else _ZERO_EXPONENT)  # rides along: the exponent of block b+slots
        return wire_up[: size + 1]

    def landing(b: int) -> np.ndarray:
        lo, hi = bounds[b]
        return wire_down[: hi - lo + 1]

    def arrived(b: int) -> None:
        lo, hi = bounds[b]
        size = hi - lo
        if b + slots < packets:
            exponents[b + slots] = wire_down[size]
        _dequantize(wire_down[:size], int(exponents[b]), workers, out[lo:hi], scratch[:size])

    _stream(t, parent, packets, lag=lag, slots=slots, outgoing=outgoing, landing=landing,
            arrived=arrived)


def switch_allreduce(t, x: np.ndarray, out: np.ndarray | None, *, op, radix: int = RADIX,
                     packet: int = PACKET, slots: int = SLOTS, mode: str = "float") -> None:
    """In-network all-reduce over a tree of switch processes (SHARP, SwitchML).

    Runs on every rank of ``t``: ranks ``0..W-1`` are workers (``W =
    switch_workers(t.size)``), ranks ``W..W+S-1`` switches, any further ranks
    spares that return at once. On a switch ``x`` is a template (same count and
    dtype as the workers' buffers; contents unused) and ``out`` is None.

    Schedule (P = ceil(n/packet) packets by the chunking rule, lag = slots-1),
      tick b = 0 .. P-1+lag:
      1. up: a worker sends packet b to its switch; a switch receives packet b
         from its children in order into pool slot b % slots, combining as it
         goes, and sends the partial to its parent;
      2. down: the root multicasts the result of packet b-lag to its children; a
         switch receives it from its parent and sends it to its children in
         order; a worker receives it into ``out``, freeing the slot.
      Int mode first agrees on the exponents of blocks 0..min(slots,P)-1 the same
      way (max), and every packet carries the exponent of block b+slots.
    Deadlock freedom: :func:`switch_schedule` lists every message in one global
      order that respects every rank's program order (up bottom-up, then down
      top-down, tick after tick), so the rendezvous sends cannot cycle.
    Reduction order: float mode, each switch folds its children left to right,
      ``((c0 op c1) op c2) ...``, the children being switches' partials above
      level 1: a fixed tree, the same for every packet and every rank. Int mode
      sums exactly in int32: the order does not matter.
    Cost: per packet of m bytes, every tree link carries it once up and once
      down: 2(W+S-1)·P messages; a worker sends n bytes and receives n bytes
      whatever W is. The ledger serializes a switch's ports, so a round per port:
      about (2·R+2)·P rounds (see :func:`switch_allreduce_cost`).
    Restrictions: radix >= 2; 1 <= slots <= 1024 (the slot is the tag); int
      mode: float dtypes, op sum or avg, and a block holding NaN or Inf on any
      worker comes back all NaN. W == 1: no switch, the result is a copy.
      n == 0: no message. n < packet: one packet. Any W (the tree need not be
      full).
    Spec: spec/switch.md
    """
    _check_options(x, op, radix, packet, slots, mode)
    workers = switch_workers(t.size, radix=radix)
    rank = t.rank
    if rank >= workers + switch_count(workers, radix=radix):
        return  # a spare rank: the tree is complete without it
    if workers == 1:
        copy_into(out, x)
        return
    parent, children = switch_links(rank, workers, radix=radix)
    bounds = packet_bounds(x.size, int(packet))
    if not bounds:
        return  # n == 0: nothing to send
    if rank >= workers:
        _switch_side(t, x, op, parent, children, bounds, slots=int(slots), mode=mode)
    elif mode == "int":
        _worker_int(t, x, out, parent, bounds, workers=workers, slots=int(slots))
    else:
        _stream(t, parent, len(bounds), lag=int(slots) - 1, slots=int(slots),
                outgoing=lambda b: view(x, bounds, b),  # packet b of the input
                landing=lambda b: view(out, bounds, b))  # its result, in place


# ------------------------------------------------------------------ cost

def switch_allreduce_cost(p: int, n: int, itemsize: int, *, radix: int = RADIX,
                          packet: int = PACKET, slots: int = SLOTS, mode: str = "float") -> Cost:
    """In-network all-reduce over ``p`` workers and ``switch_count(p)`` switches.

    ``P = ceil(n/packet)`` packets; each of the ``W+S-1`` tree links carries every
    packet once up and once down, so a worker sends ``n`` and receives ``n``
    bytes whatever ``p`` is (int mode: int32 on the wire, ``4·(n + P)`` bytes
    each way, the exponents included, plus ``4·min(slots, P)`` for the first
    exponents). Rounds and critical bytes replay the schedule's Lamport clock
    (:func:`switch_schedule`): the ledger serves a
    switch's ports one at a time, where SHARP's latency is ``2·D`` hops.
    """
    levels = switch_levels(p, radix=radix)
    packets = packet_count(n, packet)
    if p == 1 or packets == 0:
        return ZERO
    links = sum(levels) - 1
    ticks, carried = packets, n  # messages per link each way; elements per link each way
    if mode == "int":
        itemsize = 4
        ticks, carried = packets + 1, n + packets + min(slots, packets)
    fan = [max_chunk(below, here) for below, here in zip(levels, levels[1:])]
    sends = max([f + 1 for f in fan[:-1]] + [fan[-1]])  # a switch: its children and its parent
    rounds, critical = lamport_replay(
        switch_schedule(p, n, radix=radix, packet=packet, slots=slots, mode=mode), itemsize)
    return Cost(rounds=rounds, messages=2 * links * ticks,
                bytes=2 * links * carried * itemsize, max_rank_messages=sends * ticks,
                max_rank_bytes=sends * carried * itemsize, critical_bytes=critical,
                reduced=(max(fan) - 1) * carried,
                formula="2·⌈log_R p⌉·α + 2·n·β + (R-1)·n·γ, in ⌈n/packet⌉ pipelined packets "
                "(the ledger serves a switch's R ports one after another)")


def switch_ideal_cost(p: int, count: int, itemsize: int) -> Cost:
    """Counts of an ideal in-network all-reduce: ``n`` up and ``n`` down at once, two latencies.

    What the cluster model takes for SHARP-class hardware, which serves a
    switch's ports at once (the ledger serves them one after another).
    """
    if p == 1 or count == 0:
        return ZERO
    b = count * itemsize
    return Cost(rounds=2, messages=2 * p, bytes=2 * p * b, max_rank_messages=1,
                max_rank_bytes=b, critical_bytes=b, reduced=0, formula="2α + n·β")


def switch_price(shape, count: int, itemsize: int, *, inter: str = "ring") -> list[LinkCost]:
    """Price it on a cluster: reduce and multicast in the network, across the nodes."""
    if not shape.in_network:
        raise UsageError("algorithm 'switch' needs in-network reduction (--in-network)")
    return [LinkCost("in-network reduce + multicast", "inter",
                     switch_ideal_cost(shape.ranks, count, itemsize))]


def switch_extra_ranks(workers: int, *, radix: int = RADIX, packet: int = PACKET,
                       slots: int = SLOTS, mode: str = "float") -> int:
    """Return the switch processes the options need beside ``workers`` (only radix counts)."""
    return switch_count(workers, radix=radix)


def switch_worker_ranks(total: int, *, radix: int = RADIX, packet: int = PACKET,
                        slots: int = SLOTS, mode: str = "float") -> int:
    """Return the workers among ``total`` ranks for the options (only radix counts)."""
    return switch_workers(total, radix=radix)


def switch_orders(collective: str, p: int) -> list[dict]:
    """Return the radixes whose switch trees reduce ``p`` workers in distinct orders.

    A radix of ``p`` or more is one switch folding every worker left to right.
    """
    return [{}] + [{"radix": k} for k in range(2, min(p, 8) + 1) if k != RADIX]


register(Algorithm(
    "switch",
    "in-network reduction (SHARP, SwitchML): packets summed up a tree of switch processes",
    {"allreduce": switch_allreduce},
    {"allreduce": switch_allreduce_cost},
    "spec/switch.md",
    order=70,
    # Few slots so the pool wraps; radix 3 leaves one-child switches at some W.
    battery_options=({}, {"radix": 2, "packet": 1001, "slots": 2},
                     {"radix": 3, "packet": 401, "slots": 3}),
    vector_variants=({}, {"radix": 2, "packet": 8, "slots": 2}, {"mode": "int", "packet": 8}),
    extra_ranks=switch_extra_ranks,
    workers=switch_worker_ranks,
    pinnable=False,
    price=switch_price,
    model_cost=switch_ideal_cost,
    across_nodes=True,
    needs_in_network=True,
    orders=switch_orders,
))
