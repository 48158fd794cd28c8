"""The symbolic tracer: who sends which elements at each step, and every result's tree.

Every spec page (``spec/*.md``) shows, for a small ``p``, who sends which
elements to whom at each step, and the exact tree of operations that makes each
element of the result. Both come from here, from a run of the algorithm's own
code in the simulator; :mod:`refcoll.verify.spec_pages` renders them into the
pages' generated blocks (``refcoll spec --write spec/``), and
``tests/test_spec.py`` regenerates every page's blocks, so a page cannot
disagree with the code.

**How the trace is exact: a symbolic run.** Messages carry bytes, so the
algorithm cannot be handed Python objects; it can be handed *handles*. Rank
``r``'s input element ``i`` is a ``uint64`` handle naming the leaf ``x_r``
(element ``i``) in a shared table, and the op is :class:`SymbolicOp`, a
:class:`~refcoll.core.ops.Op` whose ``apply(a, b, out)`` writes, for each element, the
handle of the node ``(a op b)``, interned in the table (the same operands in the
same order give the same handle, whichever rank computes them). Every algorithm
combines only through ``t.reduce_local(op, a, b, out)``, which computes
``a op b``, so the left operand is the one the code puts on the left. Copies and
messages move handles untouched. After the run:

* each message's payload (``record_payloads=True``) is a list of handles: each
  names an element (its leaves' element index), the ranks already combined into
  it, and its whole tree so far: that is the step table;
* each rank's output is a list of handles: the reduction tree of every element,
  parenthesised exactly as the code computed it. Equal trees on every rank have
  equal handles, so "every rank holds the same bits" is checked too.

A value that is not a handle (an uninitialised buffer sent, an element combined
with another element's partial) stops the trace with :class:`TraceError`.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field

import numpy as np

from ..calls.collectives import simulate
from ..core.errors import RefcollError
from ..core.ops import Op

__all__ = [
    "REDUCING",
    "TraceError",
    "SymbolicOp",
    "Expressions",
    "Node",
    "Piece",
    "Row",
    "Trace",
    "trace",
    "step_table",
    "reduction_trees",
    "reduction_tree",
]

#: Collectives whose result is a reduction (the others only move inputs).
REDUCING = ("allreduce", "reduce_scatter", "reduce")

HANDLE = np.uint64


class TraceError(RefcollError):
    """The symbolic run saw a value that is not a well-formed partial reduction."""


# ----------------------------------------------------------------- expressions

@dataclass(frozen=True)
class Node:
    """One handle's meaning: a leaf ``x_rank`` of ``element``, or ``left op right``."""

    element: int
    ranks: frozenset
    leaves: int
    rank: int | None = None
    left: int | None = None
    right: int | None = None


class Expressions:
    """A hash-consed table of reduction trees; array elements hold handles into it.

    Handle 0 is never a value, so zeroed or stale memory that reaches a message
    or a result is reported instead of being read as a leaf.
    """

    def __init__(self) -> None:
        self.nodes: list[Node | None] = [None]
        self._interned: dict[tuple, int] = {}
        self._lock = threading.Lock()
        self._text: dict[int, str] = {}

    def _add(self, key: tuple, node: Node) -> int:
        handle = len(self.nodes)
        self.nodes.append(node)
        self._interned[key] = handle
        return handle

    def leaf(self, rank: int, element: int) -> int:
        """Return the handle of ``x_rank`` at ``element``."""
        key = ("x", rank, element)
        with self._lock:
            handle = self._interned.get(key)
            if handle is None:
                handle = self._add(key, Node(element, frozenset((rank,)), 1, rank=rank))
            return handle

    def node(self, handle: int) -> Node:
        """Return the node of ``handle``; :class:`TraceError` if it names none."""
        if not 0 < handle < len(self.nodes):
            raise TraceError(f"value {handle} is not a partial reduction of any input: "
                             "uninitialised or foreign memory reached a message or a result")
        return self.nodes[handle]

    def combine(self, a, b) -> list[int]:
        """Return the handles of ``a[k] op b[k]`` for every ``k``."""
        out = []
        with self._lock:
            for left, right in zip(np.asarray(a).tolist(), np.asarray(b).tolist()):
                lnode, rnode = self.node(left), self.node(right)
                if lnode.element != rnode.element:
                    raise TraceError(f"element {lnode.element}'s partial is combined with "
                                     f"element {rnode.element}'s")
                key = ("op", left, right)
                handle = self._interned.get(key)
                if handle is None:
                    handle = self._add(key, Node(lnode.element, lnode.ranks | rnode.ranks,
                                                 lnode.leaves + rnode.leaves,
                                                 left=left, right=right))
                out.append(handle)
        return out

    def text(self, handle: int, *, top: bool = True) -> str:
        """Return the tree of ``handle`` as ``(x1+x2)+x0`` (outer parentheses dropped)."""
        body = self._text.get(handle)
        if body is None:
            node = self.node(handle)
            if node.rank is not None:
                body = f"x{node.rank}"
            else:
                body = f"{self.text(node.left, top=False)}+{self.text(node.right, top=False)}"
            self._text[handle] = body
        node = self.nodes[handle]
        return body if top or node.rank is not None else f"({body})"


@dataclass(frozen=True, eq=False)
class SymbolicOp(Op):
    """An op that records ``a op b`` as a tree node; see the module docstring.

    It keeps the name ``sum`` so algorithms that ask the op's name treat it as a sum.
    """

    expressions: Expressions = field(default_factory=Expressions, repr=False)

    def apply(self, a, b, out) -> None:
        """Write the handle of ``a[k] op b[k]`` into ``out[k]``; ``out`` may be ``a`` or ``b``."""
        out[...] = np.asarray(self.expressions.combine(a, b), dtype=HANDLE)

    def finalize(self, buf, p: int) -> None:
        """Do nothing: a trace shows the combinations, not ``avg``'s division."""


# ------------------------------------------------------------------------ trace

@dataclass(frozen=True)
class Piece:
    """Consecutive elements ``[start, stop)`` of a message with the same partial tree."""

    start: int
    stop: int
    ranks: frozenset
    tree: str
    complete: bool


@dataclass(frozen=True)
class Row:
    """One message: its ledger step, world ranks, tag, bytes and what it carries."""

    step: int
    source: int
    dest: int
    tag: int
    nbytes: int
    pieces: tuple

    @property
    def elements(self) -> list[tuple[int, int]]:
        """Return the element ranges ``[(start, stop), ...]`` this message carries."""
        return [(piece.start, piece.stop) for piece in self.pieces]

    @property
    def ranks(self) -> frozenset:
        """Return the ranks whose inputs are in any element of this message."""
        return frozenset().union(*(piece.ranks for piece in self.pieces))


@dataclass
class Trace:
    """A symbolic run: its messages in step order and every element's result tree.

    Attributes:
        results: element index -> handle of its result (reducing collectives).
        width: elements of the result (``p·n`` for allgather, else ``n``).
    """

    algorithm: str
    collective: str
    p: int
    n: int
    options: dict
    rows: list
    results: dict
    expressions: Expressions
    width: int


def _options_key(options: dict) -> tuple:
    return tuple(sorted(options.items()))


def trace(algorithm: str, p: int, n: int, *, collective: str = "allreduce", **options) -> Trace:
    """Run ``collective`` symbolically on ``p`` ranks of ``n`` elements; return its trace.

    ``n`` is each rank's input count (for ``allgather`` the result has ``p·n``).
    Options go to :func:`refcoll.simulate` (``root=``, ``ranks_per_node=``...).
    Runs are cached: the same arguments return the same :class:`Trace`.
    """
    return _trace(algorithm, int(p), int(n), collective, _options_key(options))


@functools.lru_cache(maxsize=None)
def _trace(algorithm: str, p: int, n: int, collective: str, options_key: tuple) -> Trace:
    options = dict(options_key)
    op = SymbolicOp("sum", np.add)
    table = op.expressions
    gathers = collective == "allgather"
    inputs = [np.array([table.leaf(r, r * n + i if gathers else i) for i in range(n)],
                       dtype=HANDLE) for r in range(p)]
    if collective in REDUCING:
        options["op"] = op
    result = simulate(collective, inputs, algorithm=algorithm, record_payloads=True, **options)
    messages = sorted(result.ledger.messages, key=lambda m: (m.step, m.source, m.dest, m.tag))
    rows = [Row(m.step, m.source, m.dest, m.tag, m.nbytes,
                _pieces(table, np.frombuffer(m.payload, dtype=HANDLE), p,
                        collective in REDUCING))
            for m in messages]
    results = _results(table, result.outputs, p) if collective in REDUCING else {}
    options.pop("op", None)
    return Trace(algorithm, collective, p, n, options, rows, results, table,
                 p * n if gathers else n)


def _pieces(table: Expressions, handles: np.ndarray, p: int, reducing: bool) -> tuple:
    """Cut a payload into runs of consecutive elements with the same tree."""
    pieces: list[Piece] = []
    for handle in handles.tolist():
        node = table.node(handle)
        tree = table.text(handle)
        last = pieces[-1] if pieces else None
        if last is not None and last.stop == node.element and last.tree == tree:
            pieces[-1] = Piece(last.start, node.element + 1, last.ranks, tree, last.complete)
        else:
            complete = reducing and node.leaves == p and len(node.ranks) == p
            pieces.append(Piece(node.element, node.element + 1, node.ranks, tree, complete))
    return tuple(pieces)


def _results(table: Expressions, outputs, p: int) -> dict:
    """Return element -> result handle, checking every rank that holds it agrees."""
    results: dict[int, int] = {}
    for rank, out in enumerate(outputs):
        if out is None:
            continue
        for handle in np.asarray(out).reshape(-1).tolist():
            node = table.node(handle)
            if node.leaves != p or len(node.ranks) != p:
                raise TraceError(f"rank {rank}'s element {node.element} is "
                                 f"{table.text(handle)}: not every rank's input exactly once")
            seen = results.setdefault(node.element, handle)
            if seen != handle:
                raise TraceError(f"ranks disagree on element {node.element}: "
                                 f"{table.text(seen)} against rank {rank}'s "
                                 f"{table.text(handle)}")
    return results


def step_table(algorithm: str, p: int, n: int, *, collective: str = "allreduce",
               **options) -> list[Row]:
    """Return every message of the run in step order (see :class:`Row`)."""
    return trace(algorithm, p, n, collective=collective, **options).rows


def reduction_trees(algorithm: str, p: int, n: int, *, collective: str = "allreduce",
                    **options) -> list[tuple[list[int], str]]:
    """Return ``[(elements, tree), ...]``: each distinct result tree and its elements."""
    if collective not in REDUCING:
        raise ValueError(f"{collective} reduces nothing: reduction trees exist for "
                         f"{', '.join(REDUCING)}")
    run = trace(algorithm, p, n, collective=collective, **options)
    groups: dict[str, list[int]] = {}
    for element in sorted(run.results):
        groups.setdefault(run.expressions.text(run.results[element]), []).append(element)
    return [(elements, tree) for tree, elements in groups.items()]


def reduction_tree(algorithm: str, p: int, n: int, element: int, *,
                   collective: str = "allreduce", **options) -> str:
    """Return the tree that computes ``element`` of the result, e.g. ``((x1+x2)+x3)+x0``."""
    if collective not in REDUCING:
        raise ValueError(f"{collective} reduces nothing")
    run = trace(algorithm, p, n, collective=collective, **options)
    if element not in run.results:
        raise ValueError(f"element {element} is not in the result of {n} elements")
    return run.expressions.text(run.results[element])
