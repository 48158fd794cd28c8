"""refcoll.verify.identify: naming the reduction order an output was computed in."""

from __future__ import annotations

import numpy as np
import pytest

from refcoll import algorithms
from refcoll.core.errors import UsageError
from refcoll.verify.evaluators import RANK_BLOCKS
from refcoll.verify.identify import (
    candidate_orders,
    identify,
    identify_blocks,
    known_orders,
    order_label,
    ulp_distance,
)
from refcoll.verify.inputs import make_inputs
from refcoll.verify.oracle import check_outputs, expected_outputs

COUNT = 203  # not a multiple of 3, 4 or 5: uneven chunks


def _predict(collective, inputs, name, options, root=0):
    return expected_outputs(collective, inputs, algorithm=name, op="sum", root=root, **options)


def test_order_labels():
    assert order_label("ring", {}) == "ring"
    assert order_label("ring", {"direction": "reverse", "start": "own"}) == \
        "ring(direction=reverse, start=own)"


def _bits(outputs):
    return b"".join(np.ascontiguousarray(o).tobytes() for o in outputs if o is not None)


@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "reduce"])
@pytest.mark.parametrize("p", [3, 4, pytest.param(5, marks=pytest.mark.slow)])
def test_every_order_identifies_itself(collective, p):
    """An order's own output matches exactly the orders that predict the same bits.

    Each algorithm's first and last order are judged (every order is simulated
    inside each identification).
    """
    inputs = make_inputs("adversarial", "float32", COUNT, p)
    orders = candidate_orders(collective, p)
    assert orders and all(not algorithms.get(name).chooses for name, _ in orders)
    predicted = {order_label(n, o): _bits(_predict(collective, inputs, n, o, root=p - 1))
                 for n, o in orders}
    judged = {}
    for name, options in orders:
        judged.setdefault(name, []).append(options)
    for name, sets in judged.items():
        for options in {0: sets[0], 1: sets[-1]}.values():
            outputs = _predict(collective, inputs, name, options, root=p - 1)
            result = identify(inputs, outputs, collective=collective, root=p - 1, known=[])
            mine = predicted[order_label(name, options)]
            assert sorted(result.matches) == sorted(
                label for label, bits in predicted.items() if bits == mine)


def test_distinct_orders_are_told_apart():
    """On adversarial inputs the naive fold and the ring are different orders at p = 4."""
    inputs = make_inputs("adversarial", "float32", COUNT, 4)
    ring = identify(inputs, _predict("allreduce", inputs, "ring", {}), known=[])
    assert "ring" in ring.matches and "naive" not in ring.matches
    assert not ring.indistinct
    groups = ring.groups(ring.matches)
    assert sum(len(g) for g in groups) == len(ring.matches)


def test_a_changed_element_matches_nothing_and_names_the_nearest():
    inputs = make_inputs("adversarial", "float32", COUNT, 4)
    outputs = [o.copy() for o in _predict("allreduce", inputs, "naive", {})]
    for o in outputs:  # every rank agrees on the wrong bits
        o[7] = np.nextafter(o[7], np.float32(np.inf))
    result = identify(inputs, outputs, known=[])
    assert result.matches == []
    label, differ, total = result.nearest
    assert (label, differ, total) == ("naive", 4, 4 * COUNT)
    naive = next(c for c in result.candidates if c.label == "naive")
    assert naive.ulps == 1
    group = result.nearest_group()  # every order that gives naive's bits here, named
    assert group[0] == "naive" and len(group) > 1
    assert all(c.digest == naive.digest for c in result.candidates if c.label in group)
    assert (f"nearest naive (the same order here: {', '.join(group[1:])}): 4 of 812 elements "
            "differ, at most 1 ulp apart") in "\n".join(result.summary())


def test_outputs_no_order_gives_on_inputs_that_cannot_tell_name_no_nearest():
    inputs = make_inputs("exact", "float32", COUNT, 4)
    outputs = [o.copy() for o in _predict("allreduce", inputs, "ring", {})]
    for o in outputs:
        o[7] = np.nextafter(o[7], np.float32(np.inf))
    result = identify(inputs, outputs, known=[])
    text = "\n".join(result.summary())
    assert result.alike and not result.indistinct and "nearest" not in text, text
    assert "every order gives the same bits here, and 4 of 812 elements differ" in text
    assert "cannot tell orders apart" in text


def test_two_ranks_say_no_inputs_can_tell_their_orders_apart():
    inputs = make_inputs("adversarial", "float32", COUNT, 2)
    result = identify(inputs, _predict("allreduce", inputs, "ring", {}), known=[])
    text = "\n".join(result.summary())
    assert result.indistinct and "at p = 2" in text and "adversarial" not in text, text


def test_order_free_inputs_say_they_cannot_tell():
    inputs = make_inputs("exact", "float32", COUNT, 4)
    result = identify(inputs, _predict("allreduce", inputs, "ring", {}), known=[])
    assert result.indistinct
    assert "cannot tell orders apart" in "\n".join(result.summary())


def test_a_data_movement_says_no_inputs_can_tell_its_orders_apart():
    inputs = make_inputs("adversarial", "float32", COUNT, 4)
    result = identify(inputs, _predict("allgather", inputs, "bruck", {}),
                      collective="allgather", known=[])
    text = "\n".join(result.summary())
    assert result.indistinct and "moves the data unchanged" in text and "adversarial" not in text


def test_library_facts_name_the_library():
    inputs = make_inputs("adversarial", "float32", COUNT, 4)
    outputs = _predict("allreduce", inputs, "ring", {})
    known = [{"library": "Lib 1.0", "description": "Lib's ring", "collective": "allreduce",
              "p": 4, "op": "sum", "matches": ["ring"]},
             {"library": "Lib 1.0", "description": "Lib's ring at 3", "collective": "allreduce",
              "p": 3, "op": "sum", "matches": ["ring"]}]
    result = identify(inputs, outputs, known=known)
    assert result.libraries["ring"] == ["Lib's ring (Lib 1.0)"]
    assert any(line.startswith("matches ring") and line.endswith(": Lib's ring (Lib 1.0)")
               for line in result.summary())


def test_library_facts_hold_at_their_root_and_say_the_count_they_were_recorded_at():
    """MPICH's reduce at root 1 is not its reduce at root 0 (recorded): it was named all the
    same, and a fact recorded at one count named at another as though a library chose the
    same algorithm at every size."""
    inputs = make_inputs("adversarial", "float32", COUNT, 3)
    fact = {"library": "Lib 1.0", "description": "Lib's reduce", "collective": "reduce",
            "p": 3, "op": "sum", "dtype": "float32", "matches": ["tree"]}
    at_0 = _predict("reduce", inputs, "tree", {}, root=0)
    assert identify(inputs, at_0, collective="reduce", known=[fact]).libraries == {
        "tree": ["Lib's reduce (Lib 1.0)"]}  # no root recorded: root 0
    at_1 = _predict("reduce", inputs, "tree", {}, root=1)
    for known in ([fact], [{**fact, "root": 0}]):
        assert identify(inputs, at_1, collective="reduce", root=1, known=known).libraries == {}
    elsewhere = {**fact, "collective": "allreduce", "count": 10007}
    ring = identify(inputs, _predict("allreduce", inputs, "tree", {}), known=[elsewhere])
    assert ring.libraries["tree"] == ["Lib's reduce (Lib 1.0), as recorded at 10007 elements"]
    blocks = identify_blocks(inputs, _predict("allreduce", inputs, "tree", {}),
                             known=[elsewhere])
    assert blocks.libraries == ring.libraries


def test_only_ranks_with_an_output_are_compared():
    inputs = make_inputs("adversarial", "float32", COUNT, 3)
    outputs = _predict("reduce", inputs, "tree", {}, root=2)
    assert outputs[0] is None and outputs[2] is not None
    assert "tree" in identify(inputs, outputs, collective="reduce", root=2, known=[]).matches
    with pytest.raises(UsageError, match="no rank's output"):
        identify(inputs, [None, None, None], collective="reduce", root=2, known=[])


def test_ulp_distance_counts_representable_values():
    one = np.float32(1.0)
    steps = [one]
    for _ in range(5):
        steps.append(np.nextafter(steps[-1], np.float32(2.0)))
    assert ulp_distance(np.array(steps[:1] * 6), np.array(steps)) == 5
    tiny = np.float32(np.finfo(np.float32).smallest_subnormal)
    assert ulp_distance(np.array([tiny]), np.array([-tiny])) == 2
    assert ulp_distance(np.array([0.0]), np.array([-0.0])) == 0
    assert ulp_distance(np.array([1.0]), np.array([np.nan])) > 2 ** 60
    assert ulp_distance(np.array([3], np.int32), np.array([-4], np.int32)) == 7
    # 64-bit: exactly (an int64 difference overflowed, and float64's rounded 63 bits)
    big = np.array([2 ** 63 - 1, 2 ** 62], np.int64)
    assert ulp_distance(big, np.array([-2 ** 63, -2 ** 62], np.int64)) == 2 ** 64 - 1
    assert ulp_distance(np.array([2 ** 64 - 1], np.uint64), np.array([0], np.uint64)) == \
        2 ** 64 - 1
    assert ulp_distance(np.array([1.0]), np.array([np.nextafter(1.0, 2.0)])) == 1
    largest = np.finfo(np.float64).max
    assert ulp_distance(np.array([largest]), np.array([-largest])) == 2 * (0x7FEF_FFFF_FFFF_FFFF)


def test_known_orders_file_is_a_list_or_refused(tmp_path):
    assert known_orders(tmp_path / "absent.json") == []
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UsageError, match="bad.json"):
        known_orders(bad)
    assert isinstance(known_orders(), list)


def test_check_identify_on_the_command_line(tmp_path):
    """``refcoll check --identify`` prints the orders found and writes them to the JSON."""
    import json

    from click.testing import CliRunner

    from refcoll.cli import main
    from refcoll.verify.inputs import write_rank_files

    inputs = make_inputs("adversarial", "float32", COUNT, 4)
    write_rank_files(tmp_path / "in", inputs, meta={"p": 4})
    ring = _predict("allreduce", inputs, "ring", {})
    write_rank_files(tmp_path / "out", ring)
    runner = CliRunner()
    args = ["check", "--identify", str(tmp_path / "in"), str(tmp_path / "out")]
    done = runner.invoke(main, [*args, "--json", str(tmp_path / "r.json")])
    assert done.exit_code == 0, done.output
    lines = [line for line in done.output.splitlines() if line.startswith("identify: ")]
    assert lines[0].startswith("identify: orders tried: ")
    assert any(line.startswith("identify: matches ring") for line in lines)
    assert done.output.rstrip().endswith("verdict: conforming")
    found = json.loads((tmp_path / "r.json").read_text())["identify"]
    assert "ring" in found["matches"] and "naive" not in found["matches"]
    # One element off on every rank: no order, the ring nearest, and still conforming.
    wrong = [o.copy() for o in ring]
    for o in wrong:
        o[11] = np.nextafter(o[11], np.float32(-np.inf))
    write_rank_files(tmp_path / "out", wrong)
    done = runner.invoke(main, args)
    assert done.exit_code == 0, done.output
    assert "identify: matches no order refcoll knows; nearest ring" in done.output
    # The ring's right values in the wrong shape: a failed check, and no order named.
    write_rank_files(tmp_path / "out", [o.reshape(1, -1) for o in ring])
    done = runner.invoke(main, args)
    assert done.exit_code == 1 and "shapes and dtypes" in done.output, done.output
    assert "identify:" not in done.output
    assert "note: --identify names no order: the outputs are not the shape" in done.output


def test_check_identify_of_an_all_reduce_goes_block_by_block(tmp_path, monkeypatch):
    """The files are read a block at a time: every order with a block evaluator is tried
    on each block, with the figures whole arrays give, and the rest named."""
    import json

    from click.testing import CliRunner

    from refcoll.cli import main
    from refcoll.verify.inputs import write_rank_files

    inputs = make_inputs("adversarial", "float32", COUNT, 4)
    outputs = _predict("allreduce", inputs, "ring", {})
    write_rank_files(tmp_path / "in", inputs, meta={"p": 4})
    write_rank_files(tmp_path / "out", outputs)
    monkeypatch.setattr("refcoll.cli.check.IDENTIFY_BYTES", 8 * 4 * 4 * 50)  # 50 a block
    monkeypatch.setattr("refcoll.verify.evaluators.RANK_BLOCKS",
                        {k: v for k, v in RANK_BLOCKS.items() if k != "dbtree"})
    args = ["check", "--identify", str(tmp_path / "in"), str(tmp_path / "out")]
    done = CliRunner().invoke(main, [*args, "--json", str(tmp_path / "blocks.json")])
    assert done.exit_code == 0, done.output
    assert "identify: matches ring" in done.output
    untried = ["hierarchical(ranks_per_node=2, inter=dbtree)", "dbtree"]  # (its inter phase)
    assert "identify: not tried, as they run only on whole arrays: " \
        + ", ".join(untried) in done.output
    blocks = json.loads((tmp_path / "blocks.json").read_text())["identify"]
    whole = identify(inputs, outputs, known=[])
    assert blocks["untried"] == untried and blocks["matches"] == whole.matches
    assert {c["label"]: (c["differing"], c["ulps"]) for c in blocks["candidates"]} == \
        {c.label: (c.differing, c.ulps) for c in whole.candidates if c.label not in untried}


def test_the_library_facts_ship_with_the_package():
    """known_orders.json is package data: an installed refcoll names libraries too."""
    facts = known_orders()
    assert facts, "refcoll/verify/known_orders.json is missing or empty"
    assert all({"library", "collective", "p", "matches"} <= set(f) for f in facts)


def test_a_nan_of_either_payload_is_the_order_s_nan():
    # Which of two NaNs an addition returns is the machine's choice, not the order's:
    # NumPy's vector loop and its scalar tail pick differently, so the last element of
    # a 17-element run and the same element judged alone get different NaN bits.
    nans = np.array([0x7FC00001, 0xFFC00002], dtype=np.uint32).view(np.float32)
    xs = [np.ones(17, np.float32), np.ones(17, np.float32)]
    xs[0][-1], xs[1][-1] = nans
    outs = expected_outputs("allreduce", xs, algorithm="naive")
    alone = expected_outputs("allreduce", [x[-1:] for x in xs], algorithm="naive")
    assert np.isnan(outs[0][-1]) and np.isnan(alone[0][0])
    found = identify_blocks(xs, outs, budget=40)  # blocks of a few elements
    assert "naive" in found.matches, found.summary()
    report = check_outputs(xs, outs, algorithm="naive", budget=40)
    assert report.conforming, report.findings
    moved = [o.copy() for o in outs]
    moved[1][3] = nans[0]  # a NaN where the order gives a number is still wrong
    assert not check_outputs(xs, moved, algorithm="naive", budget=40).conforming
