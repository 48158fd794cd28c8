"""Step tables and reduction trees, generated from the simulator: the spec pages' facts.

Every spec page (``spec/*.md``) shows, for a small ``p``, who sends which
elements to whom at each step, and the exact tree of operations that makes each
element of the result. Both are generated here from a run of the algorithm's own
code in the simulator, and ``tests/test_spec.py`` regenerates every page's
blocks, so a page cannot disagree with the code.

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

Generated blocks in a page are delimited by markers that carry the arguments::

    <!-- generated: refcoll.trace step_table algorithm=ring p=4 n=4 -->
    ...
    <!-- end generated -->

Kinds: ``step_table`` (options ``layout=grid`` (a column per sender, as
baidu-allreduce's comment) or ``layout=list`` (one cell per step)), and
``reduction_tree``. Other ``key=value`` pairs are ``collective=``, ``p=``, ``n=``
and the algorithm's options (``ranks_per_node=4``, ``root=2``...). Regenerate
with ``python -m refcoll.trace --write spec/``; ``--check spec/`` exits 1 and
names the pages that differ.

In the tables, letters ``A, B, ...`` are elements ``0, 1, ...`` (when there are at
most 26; ranges ``[start:stop)`` otherwise), ``xr`` is rank ``r``'s input, ``+``
the op and ``result`` a finished reduction (every rank's input once). Ranks
beyond the ``p`` data ranks (the switches of ``algorithm="switch"``) are written
``s<rank>``.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..calls.collectives import simulate
from ..core.errors import RefcollError
from ..core.ops import Op

__all__ = [
    "TraceError",
    "SymbolicOp",
    "Expressions",
    "Piece",
    "Row",
    "Trace",
    "trace",
    "step_table",
    "reduction_trees",
    "reduction_tree",
    "render_markdown",
    "blocks",
    "block_arguments",
    "regenerate",
    "stale_pages",
    "main",
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


# -------------------------------------------------------------------- rendering

def _letters(width: int) -> bool:
    return width <= 26


def _span(start: int, stop: int, width: int) -> str:
    if _letters(width):
        return "".join(chr(ord("A") + i) for i in range(start, stop))
    return f"[{start}:{stop})"


def _element_set(elements: list[int], width: int) -> str:
    """Return elements as letters (``A C D``) or ranges (``[0:3) [5:6)``)."""
    runs: list[list[int]] = []
    for element in elements:
        if runs and runs[-1][1] == element:
            runs[-1][1] = element + 1
        else:
            runs.append([element, element + 1])
    if _letters(width):
        return " ".join(_span(e, e + 1, width) for e in elements)
    return " ".join(_span(start, stop, width) for start, stop in runs)


def _rank(rank: int, p: int) -> str:
    return str(rank) if rank < p else f"s{rank}"


def _carries(row: Row, width: int, reducing: bool) -> str:
    """Return what a message carries: ``C: x3+x0``, ``AB: result``, or (moving inputs) ``AB``.

    Adjacent pieces that read the same (two finished elements) are written as one.
    """
    if not row.pieces:
        return "(empty)"
    runs: list[list] = []
    for piece in row.pieces:
        what = ("result" if piece.complete else piece.tree) if reducing else ""
        if runs and runs[-1][1] == piece.start and runs[-1][2] == what:
            runs[-1][1] = piece.stop
        else:
            runs.append([piece.start, piece.stop, what])
    return ", ".join(_span(start, stop, width) + (f": {what}" if what else "")
                     for start, stop, what in runs)


def _describe(run: Trace) -> str:
    extra = "".join(f", {key}={value}" for key, value in sorted(run.options.items()))
    return f"`{run.algorithm}` {run.collective}, p = {run.p}, n = {run.n}{extra}"


def _legend(run: Trace) -> str:
    words = ["step = the ledger's round",
             "letters `A`, `B`, ... are elements 0, 1, ..." if _letters(run.width)
             else "`[a:b)` are elements a to b-1"]
    if run.collective in REDUCING:
        words.append("`xr` is rank r's input, `+` the op, `result` the finished reduction")
    elif run.collective == "allgather":
        words.append("element e is rank e's input" if run.n == 1
                     else f"element e is rank ⌊e/{run.n}⌋'s input")
    else:
        words.append("every message carries the root's input")
    if any(max(row.source, row.dest) >= run.p for row in run.rows):
        words.append("`sR` is world rank R, which holds no data")
    return f"Generated from a simulator run ({_describe(run)}): {'; '.join(words)}."


def _step_table_markdown(run: Trace, layout: str) -> str:
    lines = [_legend(run), ""]
    if not run.rows:
        return "\n".join(lines + ["No message is sent."])
    reducing = run.collective in REDUCING
    steps = sorted({row.step for row in run.rows})
    if layout == "grid":
        senders = sorted({row.source for row in run.rows})
        lines.append("| step | " + " | ".join(f"rank {_rank(s, run.p)} sends" for s in senders)
                     + " |")
        lines.append("| --- |" + " --- |" * len(senders))
        for step in steps:
            cells: dict[int, list[str]] = {}
            for row in run.rows:
                if row.step == step:
                    cells.setdefault(row.source, []).append(
                        f"{_carries(row, run.width, reducing)} → {_rank(row.dest, run.p)}")
            lines.append(f"| {step} | " + " | ".join("; ".join(cells.get(s, []))
                                                     for s in senders) + " |")
    elif layout == "list":
        lines.append("| step | messages |")
        lines.append("| --- | --- |")
        for step in steps:
            cell = "; ".join(f"{_rank(row.source, run.p)}→{_rank(row.dest, run.p)} "
                             f"{_carries(row, run.width, reducing)}"
                             for row in run.rows if row.step == step)
            lines.append(f"| {step} | {cell} |")
    else:
        raise ValueError(f"unknown layout {layout!r}: choose grid or list")
    return "\n".join(lines)


def _reduction_tree_markdown(run: Trace) -> str:
    trees = reduction_trees(run.algorithm, run.p, run.n, collective=run.collective,
                            **run.options)
    lines = [f"Every element of the result, as the code computes it ({_describe(run)}; "
             "`+` is the op, operands in the order the code passes them):", ""]
    lines += [f"    {_element_set(elements, run.width)}: {tree}" for elements, tree in trees]
    return "\n".join(lines)


def render_markdown(kind: str, *, algorithm: str, p: int, n: int,
                    collective: str = "allreduce", layout: str = "grid", **options) -> str:
    """Return the markdown body of one generated block (without its markers)."""
    run = trace(algorithm, p, n, collective=collective, **options)
    if kind == "step_table":
        return _step_table_markdown(run, layout)
    if kind == "reduction_tree":
        return _reduction_tree_markdown(run)
    raise ValueError(f"unknown block kind {kind!r}: choose step_table or reduction_tree")


# ------------------------------------------------------------------------ pages

BLOCK = re.compile(
    r"(?P<open><!-- generated: refcoll\.trace (?P<kind>\w+)(?P<args>(?: [\w.]+=[^\s]+)*) -->\n)"
    r"(?P<body>.*?)"
    r"(?P<close><!-- end generated -->)",
    re.DOTALL,
)


def _value(text: str):
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    return {"None": None, "True": True, "False": False}.get(text, text)


def block_arguments(args: str) -> dict:
    """Return the ``key=value`` pairs of a block's opening marker as keyword arguments."""
    return {key: _value(value) for key, value in (pair.split("=", 1) for pair in args.split())}


def regenerate(text: str) -> str:
    """Return a page's text with every generated block rebuilt from the code."""
    def rebuild(match: re.Match) -> str:
        body = render_markdown(match["kind"], **block_arguments(match["args"]))
        return match["open"] + "\n" + body + "\n\n" + match["close"]

    return BLOCK.sub(rebuild, text)


def blocks(text: str) -> list[tuple[str, dict]]:
    """Return ``(kind, arguments)`` of every generated block in a page."""
    return [(m["kind"], block_arguments(m["args"])) for m in BLOCK.finditer(text)]


def _pages(paths) -> list[Path]:
    pages: list[Path] = []
    for path in map(Path, paths):
        pages += sorted(path.glob("*.md")) if path.is_dir() else [path]
    return pages


def stale_pages(paths, *, write: bool = False) -> list[Path]:
    """Return the pages whose generated blocks differ from the code; rewrite them if ``write``."""
    stale = []
    for page in _pages(paths):
        text = page.read_text(encoding="utf-8")
        fresh = regenerate(text)
        if fresh != text:
            stale.append(page)
            if write:
                page.write_text(fresh, encoding="utf-8")
    return stale


def main(argv=None) -> int:
    """``python -m refcoll.trace (--write | --check) [PATH ...]``; or print one block."""
    parser = argparse.ArgumentParser(
        prog="python -m refcoll.trace",
        description="Regenerate or check the generated blocks of spec pages, or print one "
                    "block: python -m refcoll.trace step_table algorithm=ring p=4 n=4")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite stale blocks in place")
    mode.add_argument("--check", action="store_true", help="exit 1 if any page is stale")
    parser.add_argument("paths", nargs="*", help="spec pages or folders (default spec/)")
    args = parser.parse_args(argv)
    try:
        if not (args.write or args.check):
            if not args.paths or args.paths[0] not in ("step_table", "reduction_tree"):
                parser.error("give --write or --check, or a block: step_table|reduction_tree "
                             "algorithm=NAME p=P n=N [key=value ...]")
            print(render_markdown(args.paths[0], **block_arguments(" ".join(args.paths[1:]))))
            return 0
        paths = args.paths or ["spec"]
        missing = [p for p in paths if not Path(p).exists()]
        if missing:
            print(f"error: no such page or folder: {', '.join(missing)}", file=sys.stderr)
            return 2
        stale = stale_pages(paths, write=args.write)
    except (RefcollError, TypeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for page in stale:
        print(f"{page}: {'rewritten' if args.write else 'differs from the code'}")
    if args.check and stale:
        print("run: python -m refcoll.trace --write " + " ".join(args.paths or ["spec"]),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
