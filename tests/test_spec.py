"""The spec pages agree with the code: their step tables and reduction trees are generated.

Every generated block in ``spec/*.md`` must be exactly what
``refcoll.verify.spec_pages`` renders from the code now (``refcoll spec --write
spec/``). The trace itself is checked against plain numeric runs that do not use
its symbolic op: which elements each message carries (``x_r[i] = i`` under
``max``), which ranks each partial contains (``x_r[i] = 2**r`` under ``sum``),
and the bits of random float32 results, recomputed by evaluating each printed
tree in its printed order.
"""

from __future__ import annotations

import difflib
import re

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import ROOT

from refcoll import REGISTRY, simulate
from refcoll.cli.spec import spec as spec_command
from refcoll.core.chunking import chunk_bounds
from refcoll.verify import spec_pages, trace
from refcoll.verify.oracle import fold
from refcoll.verify.trace import Expressions, SymbolicOp, TraceError, reduction_tree, step_table

SPEC = ROOT / "spec"
PAGES = sorted(SPEC.glob("*.md"))
GENERATED = [page for page in PAGES if spec_pages.blocks(page.read_text(encoding="utf-8"))]


def _configs():
    """Return every distinct (algorithm, p, n, collective, options) the pages generate."""
    seen = {}
    for page in GENERATED:
        for _, args in spec_pages.blocks(page.read_text(encoding="utf-8")):
            args = dict(args)
            args.pop("layout", None)
            key = tuple(sorted(args.items()))
            seen.setdefault(key, args)
    return list(seen.values())


CONFIGS = _configs()
DRAWS = 12  # random float32 draws per configuration in the bit-for-bit check


def _config_id(args: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in sorted(args.items()))


def _split(args: dict):
    args = dict(args)
    return (args.pop("algorithm"), args.pop("p"), args.pop("n"),
            args.pop("collective", "allreduce"), args)


# ---------------------------------------------------------------- the pages

def test_there_are_generated_pages():
    assert len(GENERATED) >= 8, [page.name for page in GENERATED]


@pytest.mark.parametrize("page", GENERATED, ids=lambda page: page.name)
def test_page_matches_the_code(page):
    text = page.read_text(encoding="utf-8")
    fresh = spec_pages.regenerate(text)
    diff = "\n".join(difflib.unified_diff(text.splitlines(), fresh.splitlines(),
                                          "page", "code", lineterm="", n=1))
    assert fresh == text, (f"{page.name} disagrees with the code; run "
                           f"`refcoll spec --write spec/` and reread the prose:\n"
                           f"{diff}")


@pytest.mark.parametrize("name", [n for n in REGISTRY if n != "auto"])
def test_every_algorithm_has_a_generated_page(name):
    page = ROOT / REGISTRY[name].spec
    assert page.exists(), f"{name}: no spec page {REGISTRY[name].spec}"
    kinds = {kind for kind, args in spec_pages.blocks(page.read_text(encoding="utf-8"))
             if args.get("algorithm") == name}
    assert kinds == {"step_table", "reduction_tree"}, (
        f"{page.name} needs a generated step table and reduction tree of {name}, has {kinds}")


def test_check_finds_a_page_that_disagrees(tmp_path):
    text = (SPEC / "ring.md").read_text(encoding="utf-8")
    assert "| 1 | D: x0 → 1 |" in text
    page = tmp_path / "ring.md"
    page.write_text(text.replace("| 1 | D: x0 → 1 |", "| 1 | D: x1 → 1 |"), encoding="utf-8")
    assert spec_pages.stale_pages([tmp_path]) == [page]
    checked = CliRunner().invoke(spec_command, ["--check", str(tmp_path)])
    assert checked.exit_code == 1
    assert "ring.md: differs from the code" in checked.stdout
    assert CliRunner().invoke(spec_command, ["--write", str(tmp_path)]).exit_code == 0
    assert page.read_text(encoding="utf-8") == text
    assert CliRunner().invoke(spec_command, ["--check", str(page)]).exit_code == 0


@pytest.mark.parametrize(("spoil", "says"), [
    (lambda t: t.replace("<!-- end generated -->\n", "", 1), "opens inside the one opened"),
    (lambda t: "".join(t.rsplit("<!-- end generated -->", 1)), "is never closed"),
    (lambda t: t.replace("<!-- end generated -->", "<!-- end generated -->\n"
                         "<!-- end generated -->", 1), "closes no block"),
    (lambda t: t.replace(" p=4 ", "  p=4 ", 1), "cannot read the marker"),
    (lambda t: t.replace("algorithm=ring", "algorithm=tre", 1), "line "),
    (lambda t: t.replace(" p=4 ", " p=4 p=5 ", 1), "given twice"),
])
def test_a_block_that_cannot_be_read_is_refused_and_the_page_left_alone(tmp_path, spoil, says):
    # A missing end marker once let --write replace everything up to the next block's
    # end: text between them was lost, and the command said it rewrote the page.
    text = (SPEC / "ring.md").read_text(encoding="utf-8")
    page = tmp_path / "ring.md"
    page.write_text(spoil(text), encoding="utf-8")
    before = page.read_text(encoding="utf-8")
    for flag in ("--write", "--check"):
        result = CliRunner().invoke(spec_command, [flag, str(tmp_path)])
        assert result.exit_code == 2 and says in result.output, result.output
        assert str(page) in result.output
    assert page.read_text(encoding="utf-8") == before


def test_a_windows_page_is_checked_and_keeps_its_line_ends(tmp_path):
    text = (SPEC / "ring.md").read_text(encoding="utf-8")
    page = tmp_path / "ring.md"
    page.write_bytes(text.replace("| 1 | D: x0 → 1 |", "| 1 | D: x1 → 1 |")
                     .replace("\n", "\r\n").encode())
    assert CliRunner().invoke(spec_command, ["--check", str(page)]).exit_code == 1
    assert CliRunner().invoke(spec_command, ["--write", str(page)]).exit_code == 0
    assert page.read_bytes() == text.replace("\n", "\r\n").encode()


def test_prose_about_markers_and_one_windows_line_leave_a_page_current(tmp_path):
    text = (SPEC / "ring.md").read_text(encoding="utf-8")
    first, rest = text.split("\n", 1)
    page = tmp_path / "ring.md"
    prose = ("A block opens with `<!-- generated: refcoll.trace KIND key=value -->` and "
             "closes with `<!-- end generated -->`.\n")
    shown = ("Written out:\n\n    <!-- generated: refcoll.trace step_table algorithm=ring p=2 "
             "n=2 -->\n    <!-- end generated -->\n\n")  # an indented code block: prose
    for text_ in (first + "\r\n" + prose + shown + rest,  # one Windows line end
                  first + "\n" + (prose + rest).replace("\n", "\r\n")):  # one Unix one
        page.write_bytes(text_.encode())
        before = page.read_bytes()
        assert CliRunner().invoke(spec_command, ["--check", str(page)]).exit_code == 0
        assert CliRunner().invoke(spec_command, ["--write", str(page)]).exit_code == 0
        assert page.read_bytes() == before


def test_pages_without_blocks_are_not_a_pass(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "plain.md").write_text("# no blocks\n", encoding="utf-8")
    for where in (tmp_path / "empty", tmp_path / "plain.md"):
        result = CliRunner().invoke(spec_command, ["--check", str(where)])
        assert result.exit_code == 2 and "nothing to check" in result.output, result.output


def test_block_arguments_round_trip():
    blocks = spec_pages.blocks("<!-- generated: refcoll.trace step_table algorithm=hierarchical "
                          "p=8 n=8 ranks_per_node=4 layout=list -->\nold\n<!-- end generated -->")
    assert blocks == [("step_table", {"algorithm": "hierarchical", "p": 8, "n": 8,
                                      "ranks_per_node": 4, "layout": "list"})]


@pytest.mark.parametrize(("words", "says"), [
    ([], "give --write or --check"),
    (["step_table"], "no algorithm: give algorithm=NAME"),
    (["step_table", "algorithm=ring", "n=4"], "no p: give p="),
    (["step_table", "algorithm=ring", "p=100000", "n=4"], "p=100000: give p= a whole number"),
    (["step_table", "algorithm=ring", "p=4", "n=99999999999"], "n=99999999999: give n="),
    (["step_table", "algorithm=ring", "p=4", "n=-1"], "n=-1: give n="),
    (["step_table", "algorithm=ring", "p=x", "n=4"], "p='x': give p="),
    (["step_table", "ring"], "'ring': a block's arguments are key=value pairs"),
    (["reduction_tree", "algorithm=ring", "p=4", "n=4", "op=max"], "op: the symbolic run sets"),
    (["step_table", "algorithm=ring", "p=4", "n=4", "x=1"], "x: the symbolic run sets"),
    (["step_table", "algorithm=hierarchical", "p=64", "n=256", "pipeline=256"],
     "pipeline=256: a generated block draws at most 16"),
    (["reduction_tree", "algorithm=ring", "p=4", "n=4", "layout=foo"],
     "only a step_table has a layout"),
    (["step_table", "algorithm=ring", "p=4", "n=4", "algorithm=tree"], "given twice"),
])
def test_a_block_it_cannot_draw_is_refused_at_once(words, says):
    """A block too large to read, without its arguments, or setting what the symbolic run
    sets (``op=``: it would be ignored) is bad usage, refused before any run."""
    result = CliRunner().invoke(spec_command, words)
    assert result.exit_code == 2, result.output
    assert says in result.output, result.output
    assert "Traceback" not in result.output


# ------------------------------------------------- the documented orders

@pytest.mark.parametrize("p", range(1, 7))
def test_naive_trees_are_the_oracle_fold(p):
    op = SymbolicOp("sum", np.add)
    leaves = [np.array([op.expressions.leaf(r, 0)], dtype=np.uint64) for r in range(p)]
    expected = op.expressions.text(int(fold(op, leaves)[0]))
    assert reduction_tree("naive", p, 1, 0) == expected
    assert reduction_tree("naive", p, 1, 0, collective="reduce", root=p - 1) == expected
    if p == 4:
        assert expected == "((x0+x1)+x2)+x3"


def _left_fold(ranks) -> str:
    text = f"x{ranks[0]}"
    for rank in ranks[1:]:
        text = (f"({text})" if "+" in text else text) + f"+x{rank}"
    return text


@pytest.mark.parametrize("p", range(2, 7))
def test_ring_trees_are_the_documented_order(p):
    """Chunk c is combined c+1, c+2, ..., c (spec/ring.md), every element of it."""
    n = 2 * p + 1  # uneven chunks
    for c, (start, stop) in enumerate(chunk_bounds(n, p)):
        expected = _left_fold([(c + k) % p for k in range(1, p + 1)])
        for element in range(start, stop):
            assert reduction_tree("ring", p, n, element) == expected


# ------------------------------------- the trace against plain numeric runs

def _numeric(collective, inputs, algorithm, op, options):
    if collective in trace.REDUCING:
        options = dict(options, op=op)
    return simulate(collective, inputs, algorithm=algorithm, record_payloads=True, **options)


def _messages(result, dtype):
    return [np.frombuffer(m.payload, dtype=dtype)
            for m in sorted(result.ledger.messages,
                            key=lambda m: (m.step, m.source, m.dest, m.tag))]


@pytest.mark.parametrize("args", CONFIGS, ids=_config_id)
def test_trace_matches_numeric_probes(args):
    algorithm, p, n, collective, options = _split(args)
    rows = step_table(algorithm, p, n, collective=collective, **options)

    # Which elements move: x_r[i] = i (allgather: its place in the result), under max.
    inputs = [np.arange(r * n if collective == "allgather" else 0, n * (r + 1)
                        if collective == "allgather" else n, dtype=np.uint32) for r in range(p)]
    payloads = _messages(_numeric(collective, inputs, algorithm, "max", options), np.uint32)
    assert len(payloads) == len(rows)
    for row, payload in zip(rows, payloads):
        carried = np.concatenate([np.arange(a, b) for a, b in row.elements] or [[]])
        assert payload.tolist() == carried.astype(int).tolist(), row

    # Which ranks a partial holds: x_r[i] = 2**r, under sum.
    if collective in trace.REDUCING:
        inputs = [np.full(n, 1 << r, dtype=np.uint64) for r in range(p)]
        payloads = _messages(_numeric(collective, inputs, algorithm, "sum", options), np.uint64)
        for row, payload in zip(rows, payloads):
            masks = [sum(1 << r for r in piece.ranks)
                     for piece in row.pieces for _ in range(piece.start, piece.stop)]
            assert payload.tolist() == masks, row


def _evaluate(tree: str, inputs, element: int) -> np.float32:
    """Evaluate ``((x1+x2)+x3)+x0`` in float32, in exactly the printed order."""
    tokens = re.findall(r"x\d+|[()+]", tree)
    position = 0

    def operand():
        nonlocal position
        token = tokens[position]
        position += 1
        if token == "(":
            value = expression()
            assert tokens[position] == ")"
            position += 1
            return value
        return inputs[int(token[1:])][element]

    def expression():
        nonlocal position
        value = operand()
        while position < len(tokens) and tokens[position] == "+":
            position += 1
            value = np.float32(value + operand())
        return value

    value = expression()
    assert position == len(tokens), tree
    return value


@pytest.mark.parametrize("args", [a for a in CONFIGS
                                  if a.get("collective", "allreduce") in trace.REDUCING],
                         ids=_config_id)
def test_printed_trees_give_the_simulated_bits(args):
    """Each printed tree, evaluated in float32 in its printed order, gives the simulated bits.

    Float addition is commutative, so this checks the bracketing (operand order
    is what the symbolic op records). One random draw tells two bracketings apart
    about a quarter of the time, so several draws are run.
    """
    algorithm, p, n, collective, options = _split(args)
    trees = dict((e, tree) for elements, tree in
                 trace.reduction_trees(algorithm, p, n, collective=collective, **options)
                 for e in elements)
    rng = np.random.default_rng(p * 1000 + n)
    for _ in range(DRAWS):
        inputs = [(rng.standard_normal(n) * 2.0 ** rng.integers(-12, 12, n)).astype(np.float32)
                  for _ in range(p)]
        result = simulate(collective, inputs, algorithm=algorithm, op="sum", **options)
        if collective == "reduce":
            got = dict(enumerate(result.outputs[options.get("root", 0)]))
        elif collective == "reduce_scatter":
            got = {start + i: v for r, (start, _) in enumerate(chunk_bounds(n, p))
                   for i, v in enumerate(result.outputs[r])}
        else:
            got = dict(enumerate(result.outputs[0]))
        assert sorted(got) == sorted(trees)
        for element, value in got.items():
            expected = _evaluate(trees[element], inputs, element)
            assert value.dtype == np.float32
            assert value.tobytes() == expected.tobytes(), (element, trees[element])


def test_tree_evaluation_tells_bracketings_apart():
    """The draws above would catch a wrong bracketing of the ring's p = 4 trees."""
    rng = np.random.default_rng(4004)
    caught = 0
    for _ in range(DRAWS):
        inputs = [(rng.standard_normal(4) * 2.0 ** rng.integers(-12, 12, 4)).astype(np.float32)
                  for _ in range(4)]
        out = simulate("allreduce", inputs, algorithm="ring").outputs[0]
        caught += _evaluate("((x0+x1)+x2)+x3", inputs, 0).tobytes() != out[0].tobytes()
    assert caught > 0


# ------------------------------------------------------------ the tracer

def test_values_that_are_no_partial_are_refused():
    table = Expressions()
    a = table.leaf(0, 0)
    b = table.leaf(1, 1)
    with pytest.raises(TraceError, match="not a partial reduction"):
        table.node(0)
    with pytest.raises(TraceError, match="element 0's partial is combined with element 1's"):
        table.combine([a], [b])


def test_equal_trees_share_a_handle_and_keep_operand_order():
    table = Expressions()
    a, b = table.leaf(0, 0), table.leaf(1, 0)
    assert table.combine([a], [b]) == table.combine([a], [b])
    assert table.combine([a], [b]) != table.combine([b], [a])
    assert table.text(table.combine([b], [a])[0]) == "x1+x0"


def test_allgather_rows_name_the_blocks():
    rows = step_table("ring", 3, 2, collective="allgather")
    assert [(r.step, r.source, r.dest, r.elements) for r in rows[:3]] == [
        (1, 0, 1, [(0, 2)]), (1, 1, 2, [(2, 4)]), (1, 2, 0, [(4, 6)])]
