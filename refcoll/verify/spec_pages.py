"""The spec pages' generated blocks: step tables and reduction trees rendered as markdown.

A spec page (``spec/*.md``) holds blocks generated from a symbolic run of the
code (:mod:`refcoll.verify.trace`). Each is delimited by markers that carry its
arguments::

    <!-- generated: refcoll.trace step_table algorithm=ring p=4 n=4 -->
    ...
    <!-- end generated -->

Kinds: ``step_table`` (options ``layout=grid`` (a column per sender, as
baidu-allreduce's comment) or ``layout=list`` (one cell per step)), and
``reduction_tree``. Other ``key=value`` pairs are ``collective=``, ``p=``, ``n=``
and the algorithm's options (``ranks_per_node=4``, ``root=2``...). Regenerate
with ``refcoll spec --write spec/``; ``refcoll spec --check spec/`` exits 1 and
names the pages that differ; ``refcoll spec step_table algorithm=ring p=4 n=4``
prints one block.

In the tables, letters ``A, B, ...`` are elements ``0, 1, ...`` (when there are at
most 26; ranges ``[start:stop)`` otherwise), ``xr`` is rank ``r``'s input, ``+``
the op and ``result`` a finished reduction (every rank's input once). Ranks
beyond the ``p`` data ranks (the switches of an in-network reduction) are
written ``s<rank>``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

from ..core.errors import RefcollError, UsageError
from ..core.reading import MAX_JSON_BYTES, read_text
from ..core.writing import write_text
from .trace import REDUCING, Row, Trace, reduction_trees, trace

__all__ = ["KINDS", "OPEN", "CLOSE", "Block", "find_blocks", "render_markdown", "render_block",
           "block_arguments", "blocks", "regenerate", "pages", "stale_pages"]

#: The kinds of generated block.
KINDS = ("step_table", "reduction_tree")

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


#: The largest block drawn: a page's table is read by eye (the spec's reach p = 9, n = 9).
MAX_BLOCK_RANKS, MAX_BLOCK_COUNT = 64, 256

#: The most pipeline segments a block draws (hierarchical's ``pipeline``): the symbolic
#: run's work grows faster than the segments (p = 64, n = 256: 2.5 s at 4, 55 s at 32).
MAX_BLOCK_PIPELINE = 16

#: What the symbolic run sets itself, so no block may: :func:`refcoll.simulate`'s own keywords.
_RESERVED = ("op", "inputs", "timeout", "record_payloads", "moves_data", "calibration",
             "validate", "x", "comm", "out")


def _check_block(kind: str, algorithm, p, n, options: dict) -> None:
    """Refuse a block the pages could not hold: its kind, size or a keyword the run sets."""
    if kind not in KINDS:
        raise UsageError(f"unknown block kind {kind!r}: choose {' or '.join(KINDS)}")
    if not isinstance(algorithm, str):
        given = "no algorithm" if algorithm is None else f"algorithm={algorithm!r}"
        raise UsageError(f"{given}: give algorithm=NAME (refcoll list names them)")
    for name, value, top in (("p", p, MAX_BLOCK_RANKS), ("n", n, MAX_BLOCK_COUNT)):
        low = 1 if name == "p" else 0
        if type(value) is not int or not low <= value <= top:
            given = f"no {name}" if value is None else f"{name}={value!r}"
            raise UsageError(f"{given}: give {name}= a whole number from {low} to {top} "
                             "(a generated block is read by eye)")
    pipeline = options.get("pipeline")
    if type(pipeline) is int and pipeline > MAX_BLOCK_PIPELINE:
        raise UsageError(f"pipeline={pipeline}: a generated block draws at most "
                         f"{MAX_BLOCK_PIPELINE} segments (a block is read by eye)")
    reserved = sorted(set(options) & set(_RESERVED))
    if reserved:
        raise UsageError(f"{', '.join(reserved)}: the symbolic run sets "
                         f"{'this' if len(reserved) == 1 else 'these'} itself; drop "
                         f"{'it' if len(reserved) == 1 else 'them'}")


def render_markdown(kind: str, *, algorithm=None, p=None, n=None,
                    collective: str = "allreduce", layout: str | None = None, **options) -> str:
    """Return the markdown body of one generated block (without its markers).

    Raises:
        UsageError: an unknown kind, no algorithm, ``p`` or ``n`` missing or beyond
            :data:`MAX_BLOCK_RANKS` and :data:`MAX_BLOCK_COUNT`, or a keyword the run
            sets itself (``op=``...).
    """
    _check_block(kind, algorithm, p, n, options)
    if kind != "step_table" and layout is not None:
        raise UsageError(f"layout={layout}: only a step_table has a layout (grid or list)")
    run = trace(algorithm, p, n, collective=collective, **options)
    if kind == "step_table":
        return _step_table_markdown(run, layout or "grid")
    return _reduction_tree_markdown(run)


# ------------------------------------------------------------------------ pages

#: A generated block's opening marker, a line of its own (one space between words).
OPEN = re.compile(r"<!-- generated: refcoll\.trace (?P<kind>\w+)(?P<args>(?: [\w.]+=\S+)*) -->")

#: A generated block's closing marker, a line of its own.
CLOSE = "<!-- end generated -->"

#: How a block's markers are written, for the messages about one that cannot be read.
_MARKERS = ("a block opens with '<!-- generated: refcoll.trace KIND key=value ... -->' and "
            f"closes with '{CLOSE}', each on a line of its own, one space between words")


def _value(text: str):
    """Return a marker's value as Python reads it: an int, None, a bool, else the text."""
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    return {"None": None, "True": True, "False": False}.get(text, text)


def block_arguments(args: str) -> dict:
    """Return the ``key=value`` pairs of a block's opening marker as keyword arguments."""
    words = args.split()
    pairs = [word.partition("=") for word in words]
    bad = [word for word, (key, eq, _) in zip(words, pairs) if not (eq and key)]
    if bad:
        raise UsageError(f"{bad[0]!r}: a block's arguments are key=value pairs "
                         "(algorithm=ring p=4 n=4)")
    keys = [key for key, _, _ in pairs]
    twice = sorted({key for key in keys if keys.count(key) > 1})
    if twice:
        raise UsageError(f"{', '.join(twice)}: given twice in one block's arguments")
    return {key: _value(value) for key, _, value in pairs}


class Block:
    """One generated block of a page: its kind and arguments, and where it lies."""

    def __init__(self, line: int, start: int, body: int, close: int, end: int, kind: str,
                 args: str):
        self.line, self.kind, self.args = line, kind, args  # line: its opening marker's
        self.start, self.body, self.close, self.end = start, body, close, end  # offsets


def find_blocks(text: str, page: str = "the page") -> list[Block]:
    """Return the generated blocks of ``text`` (lines ending in ``\\n``), in order.

    A marker of another generator (``<!-- generated: NAME -->``, as the docs' own
    blocks) opens a block left alone up to its closing marker.

    Raises:
        UsageError: a marker it cannot read, a block opened inside another or never
            closed, a closing marker that closes nothing; each naming the page and line.
    """
    found, opened, at = [], None, 0
    for number, line in enumerate(text.splitlines(keepends=True), 1):
        bare = line.rstrip()  # (a line that does not open with the comment, indented
        # or not, is prose: a Markdown code block may show the markers)
        if bare.startswith("<!--") and ("generated:" in bare or "end generated" in bare):
            mine = OPEN.fullmatch(bare)
            foreign = not mine and bare.startswith("<!-- generated:") \
                and "refcoll.trace" not in bare
            if mine or foreign:
                if opened is not None:
                    raise UsageError(f"{page}: line {number}: a block opens inside the one "
                                     f"opened at line {opened[0]}, which is not closed: {_MARKERS}")
                opened = (number, at, at + len(line), mine)
            elif bare == CLOSE and opened is not None:
                number0, start, body, mine = opened
                if mine:
                    close = at + line.index(CLOSE)
                    found.append(Block(number0, start, body, close, close + len(CLOSE),
                                       mine["kind"], mine["args"]))
                opened = None
            elif bare == CLOSE:
                raise UsageError(f"{page}: line {number}: {CLOSE} closes no block")
            else:
                raise UsageError(f"{page}: line {number}: cannot read the marker "
                                 f"{bare.strip()!r}: {_MARKERS}")
        at += len(line)
    if opened is not None:
        raise UsageError(f"{page}: line {opened[0]}: the block opened there is never closed "
                         f"({CLOSE})")
    return found


def regenerate(text: str, page: str = "the page") -> str:
    """Return a page's text with every generated block rebuilt from the code, each in the
    line ends of its opening marker (a page with Windows line ends keeps them).

    Raises:
        UsageError: a block that cannot be read or rendered, naming the page and line.
    """
    out, done = [], 0
    for block in find_blocks(text, page):
        try:
            body = render_markdown(block.kind, **block_arguments(block.args))
        except (RefcollError, TypeError, ValueError) as exc:  # a bad block is bad usage
            raise UsageError(f"{page}: line {block.line}: {exc}") from None
        eol = "\r\n" if text[:block.body].endswith("\r\n") else "\n"  # its marker's
        out += [text[done:block.body], eol, body.replace("\n", eol), eol, eol, CLOSE]
        done = block.end
    return "".join(out) + text[done:]


def blocks(text: str) -> list[tuple[str, dict]]:
    """Return ``(kind, arguments)`` of every generated block in a page."""
    return [(b.kind, block_arguments(b.args)) for b in find_blocks(text)]


def pages(paths) -> list[Path]:
    """Return the pages named by ``paths``: files as given, folders' ``*.md`` in order.

    Raises:
        UsageError: a path that does not exist.
    """
    missing = [str(path) for path in paths if not Path(path).exists()]
    if missing:
        raise UsageError(f"no such page or folder: {', '.join(missing)}")
    found: list[Path] = []
    for path in map(Path, paths):
        found += sorted(path.glob("*.md")) if path.is_dir() else [path]
    return found


def stale_pages(paths, *, write: bool = False) -> list[Path]:
    """Return the pages whose generated blocks differ from the code; rewrite them if ``write``.

    Raises:
        UsageError: a path that does not exist (:func:`pages`).
    """
    stale, found, held = [], pages(paths), 0
    if not found:
        raise UsageError(f"no spec pages (*.md) in {', '.join(map(str, paths))}: nothing to "
                         "check")
    for page in found:
        text = read_text(page, max_bytes=MAX_JSON_BYTES, what="spec page")
        fresh = regenerate(text, str(page))
        held += bool(find_blocks(text, str(page)))
        if fresh != text:
            stale.append(page)
            if write:
                write_text(page, fresh)
    if not held:
        raise UsageError(f"no generated blocks in {', '.join(map(str, paths))}: nothing to "
                         "check (a block opens with '<!-- generated: refcoll.trace ...')")
    return stale


def render_block(words: Sequence[str]) -> str:
    """Return one block's markdown from its marker's words: ``step_table algorithm=ring p=4 n=4``.

    Raises:
        UsageError: the first word is no block kind.
    """
    if not words or words[0] not in KINDS:
        raise UsageError(f"give --write or --check, or a block: {'|'.join(KINDS)} "
                         "algorithm=NAME p=P n=N [key=value ...]")
    return render_markdown(words[0], **block_arguments(" ".join(words[1:])))
