"""An algorithm's result in a few whole-array passes, where simulating it is slow: for identify.

The oracle is the algorithm itself: :func:`refcoll.simulate` runs the algorithm's
code on threads, message by message. ``refcoll check --identify`` tries tens of
orders; at 8 ranks most simulate in milliseconds, but the switch all-reduce
streams every packet through its switch processes (seconds at 256K elements), and
at 256 ranks a ring's ``2(p-1)`` steps of ``p`` messages take seconds too. Their
orders are simple folds: a switch tree folds each level's children left to right,
the same for every packet; a ring folds chunk ``c`` over the ranks in ring order.
An evaluator computes that fold on whole arrays with the same op and the same
operands in the same places, so the same bits.

Each evaluator is held bit for bit to the simulated run of its algorithm over the
battery's inputs and the golden vectors' variants (``tests/test_evaluators.py``).
:func:`evaluate` returns ``None`` where no evaluator applies (then simulate).

Buffers larger than memory are judged a block of elements at a time, so an
all-reduce's result is also given block by block: :func:`rank_blockwise` returns,
for each algorithm, ``fold(cols, first)``, every rank's result for the elements
``first ..`` of a block (``cols``: every rank's elements there). Most algorithms
combine an element's operands in the same order wherever it lies
(:data:`ELEMENTWISE`): the block is run alone. The ring folds each chunk where the
block cuts it; the double binary tree's halves and the two-level all-reduce's
shards are laid out or folded as the whole buffer's are. The same tests hold each
to the algorithm run on the whole buffer, cut anywhere. A reduce-scatter's rank
holds its chunk of the reduced vector: the ring's is its all-reduce's, naive and
recursive-halving folds run a block alone, and Bruck's, which combines chunk ``c``
over the ranks turned by ``c``, runs each chunk's part with its ranks turned. An
all-gather or a broadcast moves the data, which every algorithm leaves as it is.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from .. import algorithms
from ..algorithms.ring import ring_order, ring_walk
from ..algorithms.switch_tree import PACKET, RADIX, SLOTS, switch_levels
from ..calls.auto import algo_filter, choose
from ..calls.collectives import simulate
from ..calls.tuned import tuning_path
from ..core.calibration import DEFAULT
from ..core.chunking import check_split, chunk_bounds
from ..core.ops import get_op

__all__ = ["EVALUATORS", "evaluate", "switch_evaluator", "ring_evaluator",
           "hierarchical_evaluator", "ring_blocks", "ELEMENTWISE",
           "ELEMENTWISE_COLLECTIVES", "RANK_BLOCKS", "rank_blockwise", "dbtree_blocks",
           "hierarchical_blocks", "scatter_blocks", "SCATTER_ALONE", "SCATTER_TURNED",
           "SCATTER_BLOCKS", "DATA_MOVEMENT"]


def switch_evaluator(collective: str, inputs, *, op="sum", radix: int = RADIX,
                     packet: int = PACKET, slots: int = SLOTS, mode: str = "float"):
    """Return every worker's output of the float-mode switch all-reduce (None otherwise).

    Level by level (:func:`~refcoll.algorithms.switch_tree.switch_levels`), switch
    ``j`` of a level folds chunk ``j`` of the level below left to right (a lone
    child is forwarded); ``packet`` and ``slots`` change when, not what. ``avg``
    divides the root's sum by the workers, as the call does after the algorithm.
    """
    if collective != "allreduce" or mode != "float":
        return None
    reduction = get_op(op)
    shape = np.asarray(inputs[0]).shape
    level = [np.asarray(x).reshape(-1) for x in inputs]
    levels = switch_levels(len(level), radix=radix)
    for above in levels[1:]:
        folded = []
        for lo, hi in chunk_bounds(len(level), above):
            acc = level[lo].copy()
            for child in level[lo + 1:hi]:
                reduction.apply(acc, child, acc)
            folded.append(acc)
        level = folded
    result = level[0].copy()
    reduction.finalize(result, len(inputs))
    return [result.reshape(shape).copy() for _ in inputs]


def _ring_fold(arrays, bounds, reduction, direction: str = "forward",
               start: str = "next", first: int = 0) -> np.ndarray:
    """Return the ring reduce-scatter's partials: chunk ``c`` folded in ``ring_order(c)``,
    each step's partial on the left of the next rank's own chunk.

    ``arrays`` may be a block of the buffers starting at element ``first``: each chunk
    of ``bounds`` (the whole buffer's) is folded where it overlaps the block."""
    p = len(arrays)
    size = arrays[0].size
    result = np.empty(size, arrays[0].dtype)
    for c, (lo, hi) in enumerate(bounds):
        lo, hi = max(lo - first, 0), min(hi - first, size)
        if lo >= hi:
            continue
        order = ring_order(c, p, direction, start)
        acc = result[lo:hi]
        acc[...] = arrays[order[0]][lo:hi]
        for r in order[1:]:
            reduction.apply(acc, arrays[r][lo:hi], acc)
    return result


def ring_evaluator(collective: str, inputs, *, op="sum", direction: str = "forward",
                   start: str = "next", split: str = "front"):
    """Return every rank's output of the ring all-reduce (None for another collective).

    Chunk ``c`` (``chunk_bounds`` under ``split``) is folded over the ranks of
    :func:`~refcoll.algorithms.ring.ring_order`, left to right, each step's
    partial on the left of the next rank's own chunk, as the reduce-scatter steps
    combine them; the allgather hands every rank the same result. ``p``
    chunks of ``p - 1`` reductions each: ``p²`` NumPy calls, not ``2(p-1)·p``
    simulated messages.
    """
    if collective != "allreduce":
        return None
    reduction = get_op(op)
    arrays = [np.asarray(x).reshape(-1) for x in inputs]
    p, n = len(arrays), arrays[0].size
    shape = np.asarray(inputs[0]).shape
    ring_walk(direction, start)  # an option the ring does not know is its UsageError
    if split != "front":
        check_split(split)
    result = _ring_fold(arrays, chunk_bounds(n, p, split, itemsize=arrays[0].dtype.itemsize),
                        reduction, direction, start)
    reduction.finalize(result, p)
    return [result.reshape(shape).copy() for _ in inputs]


def hierarchical_evaluator(collective: str, inputs, *, op="sum", ranks_per_node=None,
                           inter: str = "ring", pipeline: int = 1, level: str = "node"):
    """Return every rank's output of the two-level all-reduce on equal nodes (None otherwise).

    Node ``i`` (ranks ``i·k .. i·k+k-1``; one node of every rank when
    ``ranks_per_node`` is None, as the simulator's default node) folds shard ``j``
    of ``chunk_bounds(n, k)`` over its ranks in ring order; shard ``j`` of the
    node partials is then all-reduced across the nodes by ``inter`` (its own
    evaluator, or the simulator on the ``g`` partials: node ``i`` as rank ``i``),
    and each node's ranks get its results. Unequal nodes (the leader fallback),
    ``pipeline`` and racks: None, simulate.
    """
    p = len(inputs)
    k = p if ranks_per_node is None else ranks_per_node
    if collective != "allreduce" or pipeline != 1 or level != "node" or not (
            isinstance(k, int) and 0 < k and p % k == 0):
        return None
    reduction = get_op(op)
    shape = np.asarray(inputs[0]).shape
    arrays = [np.asarray(x).reshape(-1) for x in inputs]
    n, g = arrays[0].size, p // k
    shards = chunk_bounds(n, k)
    partials = [_ring_fold(arrays[i * k:(i + 1) * k], shards, reduction) if k > 1
                else arrays[i] for i in range(g)]
    raw = "sum" if op == "avg" else op  # the inter phase sums; the call divides once at the end
    results = [np.empty(n, arrays[0].dtype) for _ in range(g)]
    for lo, hi in shards:
        parts = [part[lo:hi] for part in partials]
        across = (evaluate("allreduce", parts, algorithm=inter, op=raw) if g > 1 else parts)
        if across is None:  # an inter with no evaluator: the simulator, as the oracle runs it
            across = simulate("allreduce", parts, algorithm=inter, op=raw).outputs
        for i in range(g):
            results[i][lo:hi] = np.asarray(across[i]).reshape(-1)
    for res in results:
        reduction.finalize(res, p)
    return [results[r // k].reshape(shape).copy() for r in range(p)]


def ring_blocks(collective: str, p: int, n: int, itemsize: int, *, op="sum",
                direction: str = "forward", start: str = "next", split: str = "front"):
    """Return ``fold(cols, first)``: the ring all-reduce's result for a block of the buffer,
    or None for another collective.

    ``cols`` is every rank's elements ``first .. first + k - 1`` (a ``(p, k)`` array);
    the result is those elements of every rank's output (they are the same on every
    rank). The same folds as :func:`ring_evaluator`'s, element for element, so a
    buffer larger than memory is judged or predicted block by block.
    """
    if collective != "allreduce":
        return None
    reduction = get_op(op)
    ring_walk(direction, start)  # an option the ring does not know is its UsageError
    if split != "front":
        check_split(split)
    bounds = chunk_bounds(n, p, split, itemsize=itemsize)

    def fold(cols: np.ndarray, first: int) -> np.ndarray:
        result = _ring_fold(list(cols), bounds, reduction, direction, start, first)
        reduction.finalize(result, p)
        return result
    return fold


#: Algorithms whose reduction order is the same for every element: their chunks and
#: segments change which rank reduces an element, and when, never the order its operands
#: are combined in (recursive halving puts the lower rank's partial first; a tree combines
#: every segment's children alike; the switch folds every packet alike in its float mode,
#: while its int mode scales each block of packets by an exponent the workers agree on).
#: A block of columns run alone gives those columns' results; ``tests/test_evaluators.py``
#: holds each to the algorithm run on the whole buffer.
ELEMENTWISE = ("naive", "recursive_doubling", "rabenseifner", "tree", "switch")


#: The collectives :data:`ELEMENTWISE` algorithms are run on block by block: a reduce's
#: element, like an all-reduce's, depends on that element of every rank alone.
ELEMENTWISE_COLLECTIVES = ("allreduce", "reduce")


def _elementwise_blocks(name: str) -> Callable:
    def blocks(collective: str, p: int, n: int, itemsize: int, *, op="sum", root: int = 0,
               **options):
        if collective not in ELEMENTWISE_COLLECTIVES or name not in algorithms.names(
                collective) or options.get("mode", "float") != "float":
            return None
        options["op"] = op
        if collective == "reduce":
            options["root"] = root

        def fold(cols: np.ndarray, first: int) -> list:
            rows = list(cols)
            outputs = (collective == "allreduce" and evaluate(collective, rows, algorithm=name,
                                                               **options)
                       or simulate(collective, rows, algorithm=name, **options).outputs)
            return [None if out is None else np.asarray(out).reshape(-1) for out in outputs]
        return fold
    return blocks


def _ring_rank_blocks(collective: str, p: int, n: int, itemsize: int, *, op="sum", root: int = 0,
                      **options):
    fold = ring_blocks(collective, p, n, itemsize, op=op, **options)
    return None if fold is None else (lambda cols, first: [fold(cols, first)] * p)


def dbtree_blocks(collective: str, p: int, n: int, itemsize: int, *, op="sum", root: int = 0,
                  **options):
    """Return ``fold(cols, first)``: every rank's double-binary-tree all-reduce of a block.

    Tree ``h`` reduces half ``h`` of the buffer (``chunk_bounds(n, 2)``), every
    segment alike: the block's part in each half is laid in that half of a buffer of
    two equal halves (zeros after it), which the algorithm runs on.
    """
    if collective != "allreduce":
        return None
    middle = chunk_bounds(n, 2)[0][1]

    def fold(cols: np.ndarray, first: int) -> list:
        p_, k = cols.shape
        cut = min(max(middle - first, 0), k)
        m = max(cut, k - cut)
        window = np.zeros((p_, 2 * m), cols.dtype)
        window[:, :cut], window[:, m:m + k - cut] = cols[:, :cut], cols[:, cut:]
        outputs = simulate(collective, list(window), algorithm="dbtree", op=op,
                           **options).outputs
        return [np.concatenate([out[:cut], out[m:m + k - cut]]) for out in
                (np.asarray(o).reshape(-1) for o in outputs)]
    return fold


def hierarchical_blocks(collective: str, p: int, n: int, itemsize: int, *, op="sum",
                        root: int = 0, ranks_per_node=None, inter: str = "ring",
                        pipeline: int = 1, level: str = "node"):
    """Return ``fold(cols, first)``: :func:`hierarchical_evaluator`'s folds for a block.

    Each node's ranks fold their shards (``chunk_bounds(n, k)``) in ring order; the
    shards' node partials are then all-reduced by ``inter``'s own block evaluator over
    the shard (None where ``inter`` has none, or where the whole evaluator declines).
    """
    k = p if ranks_per_node is None else ranks_per_node
    if collective != "allreduce" or pipeline != 1 or level != "node" or not (
            isinstance(k, int) and 0 < k and p % k == 0):
        return None
    g, reduction = p // k, get_op(op)
    raw = "sum" if op == "avg" else op  # the inter phase sums; the call divides once at the end
    shards = chunk_bounds(n, k)
    across = [rank_blockwise(collective, g, hi - lo, itemsize, algorithm=inter, op=raw)
              if g > 1 else None for lo, hi in shards]
    if g > 1 and any(fold is None for fold in across):
        return None

    def fold(cols: np.ndarray, first: int) -> list:
        size = cols.shape[1]
        partials = [_ring_fold(list(cols[i * k:(i + 1) * k]), shards, reduction, first=first)
                    if k > 1 else cols[i] for i in range(g)]
        results = [np.empty(size, cols.dtype) for _ in range(g)]
        for (lo, hi), inner in zip(shards, across):
            a, b = max(lo, first) - first, min(hi, first + size) - first
            if a >= b:
                continue
            parts = np.stack([part[a:b] for part in partials])
            reduced = inner(parts, a + first - lo) if g > 1 else parts
            for i in range(g):
                results[i][a:b] = reduced[i]
        for res in results:
            reduction.finalize(res, p)
        return [results[r // k] for r in range(p)]
    return fold


#: Every rank's result of a block, by algorithm name: ``fn(collective, p, n, itemsize, *, op,
#: root, **options)`` returns ``fold(cols, first)``, a list of ``p`` arrays, or None.
RANK_BLOCKS: dict[str, Callable] = {
    **{name: _elementwise_blocks(name) for name in ELEMENTWISE},
    "ring": _ring_rank_blocks, "dbtree": dbtree_blocks, "hierarchical": hierarchical_blocks}


#: Reduce-scatter algorithms that combine every element in one order, wherever it lies
#: (a naive fold; recursive halving): a block of columns run alone, its ranks' outputs
#: side by side, gives those columns' results.
SCATTER_ALONE = ("naive", "rabenseifner")

#: Reduce-scatter algorithms that combine chunk ``c`` as they combine chunk 0, over the
#: ranks turned by ``c`` (Bruck's doubling halves, in the cyclic order ``c+1, ..., c``).
SCATTER_TURNED = ("bruck",)

#: The collectives that move data: every algorithm's output is the inputs' bits.
DATA_MOVEMENT = ("allgather", "broadcast")


def _scatter_alone(name: str, p: int, n: int, itemsize: int, op: str, options: dict):
    def fold(cols: np.ndarray, first: int) -> list:
        outputs = simulate("reduce_scatter", list(cols), algorithm=name, op=op,
                           **options).outputs
        values = np.concatenate([np.asarray(out).reshape(-1) for out in outputs])
        return [values] * p
    return fold


def _scatter_turned(name: str, p: int, n: int, itemsize: int, op: str, options: dict):
    """A block is cut into pieces of at most ``m`` elements, each within one chunk; a
    window of ``p`` equal chunks of ``m`` takes ``p`` pieces, piece ``j`` (of chunk ``c``)
    in its chunk ``j`` with window rank ``r`` holding rank ``r + c - j``'s elements, so
    that chunk ``j`` is combined as chunk ``c`` is: window rank ``j``'s output is then
    piece ``j``'s result. ``m`` is chosen so that a block usually fills one window (one
    run of about twice the block's size, whatever the chunks it meets)."""
    bounds = chunk_bounds(n, p)

    def fold(cols: np.ndarray, first: int) -> list:
        k = cols.shape[1]
        values = np.empty(k, cols.dtype)
        m = max(1, -(-k // max(1, p // 2)))
        pieces = [(c, a, min(a + m, b))
                  for c, (lo, hi) in enumerate(bounds)
                  for b in (min(hi - first, k),)
                  for a in range(max(lo - first, 0), b, m)]
        for w in range(0, len(pieces), p):
            window = np.zeros((p, p * m), cols.dtype)
            for j, (c, a, b) in enumerate(pieces[w:w + p]):
                window[:, j * m:j * m + b - a] = cols[(np.arange(p) + c - j) % p, a:b]
            outputs = simulate("reduce_scatter", list(window), algorithm=name, op=op,
                               **options).outputs
            for (_, a, b), out in zip(pieces[w:w + p], outputs):
                values[a:b] = np.asarray(out).reshape(-1)[:b - a]
        return [values] * p
    return fold


def _scatter_ring(name: str, p: int, n: int, itemsize: int, op: str, options: dict):
    ring = ring_blocks("allreduce", p, n, itemsize, op=op, **options)
    return lambda cols, first: [ring(cols, first)] * p


#: Every reduce-scatter's block evaluator, by algorithm name: ``fn(name, p, n, itemsize,
#: op, options)`` returns ``fold(cols, first)``.
SCATTER_BLOCKS: dict[str, Callable] = {"ring": _scatter_ring,
                                        **dict.fromkeys(SCATTER_ALONE, _scatter_alone),
                                        **dict.fromkeys(SCATTER_TURNED, _scatter_turned)}


def scatter_blocks(p: int, n: int, itemsize: int, *, algorithm: str, op="sum", **options):
    """Return ``fold(cols, first)``: a reduce-scatter's reduced vector for a block, or None.

    ``cols`` is every rank's input elements ``first ..`` (the reduced vector's, ``n``
    long); each rank's output is its chunk of that vector, so the fold gives the
    block's values, for every rank alike. The ring's reduce-scatter keeps its chunk
    of the ring all-reduce (:func:`ring_blocks`); :data:`SCATTER_ALONE` and
    :data:`SCATTER_TURNED` run the algorithm itself on a block's worth of elements.
    """
    fn = SCATTER_BLOCKS.get(algorithm)
    return None if fn is None else fn(algorithm, p, n, itemsize, op, options)


def _chosen_blocks(collective: str, p: int, n: int, itemsize: int, *, op="sum", root: int = 0,
                   **options):
    """``auto``'s block evaluator: that of the algorithm it runs for this call.

    The oracle's simulator resolves ``auto`` at the deterministic calibration, on one
    node, over the candidates ``REFCOLL_ALGO`` leaves (:func:`refcoll.calls.auto.choose`),
    so the pick depends on the collective, ``p``, the count and the width alone; a
    tuning file's rules (``REFCOLL_TUNING_FILE``) are left to the simulator.
    """
    if options or tuning_path():
        return None
    name = choose(collective, p, n, itemsize, DEFAULT, algo_filter().allowed(collective))
    return rank_blockwise(collective, p, n, itemsize, algorithm=name, op=op, root=root)


def rank_blockwise(collective: str, p: int, n: int, itemsize: int, *, algorithm: str, op="sum",
                   root: int = 0, **options):
    """Return ``algorithm``'s every-rank block evaluator for this buffer, or None.

    ``fold(cols, first)`` gives, for a block of the reference vector from element
    ``first`` (the reduced vector; an all-gather's is every input in rank order),
    every rank's elements there: a list of ``p`` arrays, None for a rank without an
    output (a reduce's non-roots). A reduction's ``cols`` are every rank's operands
    (``(p, k)``); a data movement's (:data:`DATA_MOVEMENT`) the block of the data
    itself, which every algorithm hands every rank unchanged. A reduce-scatter's rank
    holds its chunk of the vector (:func:`scatter_blocks`). Every all-reduce, the
    reduces of :data:`ELEMENTWISE` algorithms, every reduce-scatter, all-gather and
    broadcast algorithm, and ``auto`` where what it picks has one
    (:func:`_chosen_blocks`) have one.
    """
    if collective in DATA_MOVEMENT:
        if algorithm not in algorithms.names(collective):
            return None
        return lambda cols, first: [cols] * p
    if algorithm in algorithms.names(collective) and algorithms.get(algorithm).chooses:
        return _chosen_blocks(collective, p, n, itemsize, op=op, root=root, **options)
    if collective == "reduce_scatter":
        return scatter_blocks(p, n, itemsize, algorithm=algorithm, op=op, **options)
    fn = RANK_BLOCKS.get(algorithm)
    return None if fn is None else fn(collective, p, n, itemsize, op=op, root=root, **options)


#: The evaluators by algorithm name: ``fn(collective, inputs, *, op, **options)``.
EVALUATORS: dict[str, Callable] = {"switch": switch_evaluator, "ring": ring_evaluator,
                                   "hierarchical": hierarchical_evaluator}


def evaluate(collective: str, inputs, *, algorithm: str, op="sum", **options):
    """Return every rank's output of ``algorithm`` from its evaluator, or None: simulate it."""
    fn = EVALUATORS.get(algorithm)
    if fn is None or options.get("root"):
        return None
    return fn(collective, inputs, op=op, **options)
