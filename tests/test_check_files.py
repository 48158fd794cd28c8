"""refcoll check / oracle / gen-inputs on files they cannot judge: one line, exit 2.

Every case builds its directories with NumPy and json directly (not with refcoll's
writer), runs the command through click's runner and requires exit 2, nothing on
stdout, and one line on stderr that names the file and the reason. Good files next
to them must still be judged (exit 0), so a refusal cannot come from a reader that
refuses everything.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import refcoll
from refcoll import algorithms
from refcoll.cli import main
from refcoll.core.bits import same_bits
from refcoll.core.ops import DTYPES
from refcoll.verify.inputs import make_inputs

P, N = 4, 8


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def inputs(p=P, n=N, dtype="float32"):
    rng = np.random.default_rng([p, n])
    return [rng.standard_normal(n).astype(dtype) for _ in range(p)]


def write_world(folder: Path, arrays, meta: dict | None = None) -> Path:
    """Save ``rank<r>.npy`` (None: no file) and, if given, ``meta.json`` verbatim."""
    folder.mkdir(parents=True, exist_ok=True)
    for r, x in enumerate(arrays):
        if x is not None:
            np.save(folder / f"rank{r}.npy", x)
    if meta is not None:
        (folder / "meta.json").write_text(json.dumps(meta))
    return folder


def good_case(tmp: Path, *, meta_in=True, meta_out=True, collective="allreduce", root=0):
    """Inputs of P ranks and the ring's outputs for them, as gen-inputs and oracle write."""
    xs = inputs()
    write_world(tmp / "in", xs, {"dtype": "float32", "p": P, "count": N} if meta_in else None)
    options = {"root": root} if collective in ("reduce", "broadcast") else {}
    name = "ring" if "ring" in algorithms.names(collective) else "tree"
    outs = refcoll.simulate(collective, xs, algorithm=name, **options).outputs
    write_world(tmp / "out", outs, {"dtype": "float32", "p": P, "collective": collective,
                                    "op": "sum", "root": root} if meta_out else None)
    return tmp / "in", tmp / "out"


def assert_refused(res, *needles) -> str:
    """Exit 2, no traceback, and one line on stderr holding every needle; return the line."""
    assert res.exit_code == 2, (res.exit_code, res.output, repr(res.exception))
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert res.stdout == "", res.stdout
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("refcoll: error: "), res.stderr
    for needle in needles:
        assert str(needle) in lines[0], (needle, lines[0])
    return lines[0]


# ------------------------------------------------------------------- broken files

def _npz(path: Path) -> None:
    buf = io.BytesIO()
    np.savez(buf, x=inputs()[0])
    path.write_bytes(buf.getvalue())


def _truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-5])


def _pickled(path: Path) -> None:
    np.save(path, np.array([{"a": 1}, None, 3.0], dtype=object), allow_pickle=True)


def _text(path: Path) -> None:
    path.write_text("1.0 2.0 3.0\n")


BROKEN = {  # what is written over the file, and the reason the refusal must give
    "npz": (_npz, ".npz archive"),
    "empty": (lambda f: f.write_bytes(b""), "empty"),
    "truncated": (_truncated, "truncated"),
    "pickled-objects": (_pickled, "Python objects"),
    "not-npy": (_text, "not a .npy file"),
}

BAD_META = {
    "not-json": ('{"dtype": float32}', "not valid JSON"),
    "empty": ("", "empty"),
    "number": ("4", "not a JSON object"),
    "list": ('["float32", 4]', "not a JSON object"),
    "not-utf8": (b"\xff\xfe\x00{", "not valid JSON"),
    "unknown-dtype": ('{"dtype": "float33"}', "unknown dtype 'float33'"),
    "p-zero": ('{"p": 0}', "p must be"),
    "p-string": ('{"p": "4"}', "p must be"),
    "stored-as-wrong": ('{"dtype": "float32", "stored_as": "uint32"}', "stored_as"),
}

#: Where a broken file lies and the command that meets it: (folder, command).
PLACES = {
    "check-in": ("in", ["check"]),
    "check-out": ("out", ["check"]),
    "oracle-in": ("in", ["oracle", "--algorithm", "ring"]),
}


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("kind", BAD_META)
def test_a_bad_meta_json_is_refused(tmp_path, place, kind):
    folder, command = PLACES[place]
    in_dir, out_dir = good_case(tmp_path)
    text, reason = BAD_META[kind]
    meta = tmp_path / folder / "meta.json"
    (meta.write_bytes if isinstance(text, bytes) else meta.write_text)(text)
    if command[0] == "oracle":
        out_dir = tmp_path / "predicted"
    assert_refused(invoke(*command, in_dir, out_dir), meta, reason)


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("kind", BROKEN)
def test_a_broken_rank_file_is_refused(tmp_path, place, kind):
    folder, command = PLACES[place]
    in_dir, out_dir = good_case(tmp_path)
    spoil, reason = BROKEN[kind]
    spoil(tmp_path / folder / "rank1.npy")
    if command[0] == "oracle":
        out_dir = tmp_path / "predicted"
    assert_refused(invoke(*command, in_dir, out_dir), tmp_path / folder / "rank1.npy", reason)
    assert not out_dir.exists() or command[0] == "check", "oracle wrote outputs for bad inputs"


# ----------------------------------------------------------------- the inputs' world

def _drop(rank, folder="in"):
    return lambda tmp: (tmp / folder / f"rank{rank}.npy").unlink()


def _drop_meta(folder="in"):
    return lambda tmp: (tmp / folder / "meta.json").unlink()


def _then(*steps):
    def run(tmp):
        for step in steps:
            step(tmp)
    return run


def _replace(rank, array, folder="in"):
    return lambda tmp: np.save(tmp / folder / f"rank{rank}.npy", array)


def _meta(folder="in", **fields):
    def run(tmp):
        path = tmp / folder / "meta.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return run


INPUT_CASES = {  # spoil the good case's inputs; the file named and the reason
    "rank0-missing": (_drop(0), "rank0.npy", "missing"),
    "rank0-missing-no-meta": (_then(_drop_meta(), _drop(0)), "rank0.npy", "missing"),
    "gap-no-meta": (_then(_drop_meta(), _drop(1)), "rank1.npy", "missing"),
    "last-missing-meta-p4": (_drop(3), "rank3.npy", "p = 4"),
    "extra-beyond-meta-p4": (_replace(4, inputs()[0]), "rank4.npy", "p = 4"),
    "shorter-rank": (_replace(2, inputs(n=N - 1)[0]), "rank2.npy", f"{N - 1} elements"),
    "shorter-rank-no-meta": (_then(_drop_meta(), _replace(2, inputs(n=N - 1)[0])), "rank2.npy",
                             f"{N - 1} elements"),
    "other-shape": (_replace(1, inputs()[1].reshape(2, -1)), "rank1.npy", "(2, 4)"),
    "count-disagrees": (_meta(count=N + 1), "meta.json", f"count {N + 1}"),
    "mixed-dtypes-no-meta": (_then(_drop_meta(), _replace(2, inputs(dtype="float64")[2])),
                             "rank2.npy", "float64"),
    "mixed-dtypes-meta": (_replace(2, inputs(dtype="float64")[2]), "rank2.npy", "float64"),
    "int32-as-float32": (_replace(1, np.arange(N, dtype=np.int32)), "rank1.npy", "int32"),
    "uint32-as-float32": (_replace(1, np.arange(N, dtype=np.uint32)), "rank1.npy", "uint32"),
    "complex-no-meta": (_then(_drop_meta(), *[_replace(r, np.ones(N, np.complex64))
                                              for r in range(P)]), "rank0.npy", "complex64"),
    "no-rank-files": (_then(*[_drop(r) for r in range(P)], _drop_meta()), "in", "no rank"),
}


@pytest.mark.parametrize("command", ["check", "oracle"])
@pytest.mark.parametrize("case", INPUT_CASES)
def test_inputs_that_make_no_world_are_refused(tmp_path, case, command):
    spoil, name, reason = INPUT_CASES[case]
    in_dir, out_dir = good_case(tmp_path)
    spoil(tmp_path)
    if command == "oracle":
        res = invoke("oracle", "--algorithm", "ring", in_dir, tmp_path / "predicted")
        assert not (tmp_path / "predicted").exists(), "oracle wrote outputs for bad inputs"
    else:
        res = invoke("check", in_dir, out_dir)
    needles = [in_dir / name if name != "in" else in_dir, reason]
    if case.startswith(("mixed", "int32", "uint32")):
        needles.append("float32")  # both dtypes are named
    assert_refused(res, *needles)


def test_without_meta_json_the_files_define_the_world(tmp_path):
    in_dir, out_dir = good_case(tmp_path, meta_in=False, meta_out=False)
    res = invoke("check", "--algorithm", "ring", in_dir, out_dir)
    assert res.exit_code == 0 and f"{P} ranks, {N} x float32" in res.output, res.output
    res = invoke("oracle", "--algorithm", "ring", in_dir, tmp_path / "predicted")
    assert res.exit_code == 0, res.output
    written = sorted(f.name for f in (tmp_path / "predicted").glob("rank*.npy"))
    assert written == [f"rank{r}.npy" for r in range(P)]


# ------------------------------------------------------------------------ the outputs

OUTPUT_CASES = {
    "rank-missing": (_drop(2, "out"), "rank2.npy", "missing"),
    "rank-missing-no-meta": (_then(_drop_meta("out"), _drop(2, "out")), "rank2.npy", "missing"),
    "extra-rank": (_replace(P, inputs()[0], "out"), f"rank{P}.npy", f"{P} ranks"),
    "int32-as-float32": (_replace(1, np.arange(N, dtype=np.int32), "out"), "rank1.npy", "int32"),
    "uint32-as-float32": (_replace(1, np.arange(N, dtype=np.uint32), "out"), "rank1.npy",
                          "uint32"),
    "float64-as-float32": (_replace(1, inputs(dtype="float64")[1], "out"), "rank1.npy",
                           "float64"),
    "meta-p-differs": (_meta("out", p=P - 1), "meta.json", f"p = {P - 1}"),
    "meta-dtype-differs": (_meta("out", dtype="float64"), "meta.json", "float64"),
    "meta-collective-differs": (_meta("out", collective="reduce_scatter"), "meta.json",
                                "reduce_scatter"),
    "meta-op-differs": (_meta("out", op="max"), "meta.json", "--op max"),
    # a name no option takes: refused as such, never advised as --op sun or --collective
    "meta-op-unknown": (_meta("out", op="sun"), "meta.json", "unknown op 'sun'"),
    "meta-collective-unknown": (_meta("out", collective="AllReduce"), "meta.json",
                                "is not one of allreduce"),
}


@pytest.mark.parametrize("case", OUTPUT_CASES)
def test_outputs_that_do_not_fit_the_inputs_are_refused(tmp_path, case):
    spoil, name, reason = OUTPUT_CASES[case]
    in_dir, out_dir = good_case(tmp_path)
    spoil(tmp_path)
    needles = [out_dir / name, reason]
    if "as-float32" in case:
        needles.append("float32")
    assert_refused(invoke("check", in_dir, out_dir), *needles)


def test_a_meta_json_op_in_capitals_and_big_endian_outputs_are_judged(tmp_path):
    """The options read SUM as sum, and so does meta.json now (it was refused with advice to
    give --op SUM, refused the same way); --inputs read a big-endian file's dtype as its
    bytes' (>f4), not its values' (float32)."""
    in_dir, out_dir = good_case(tmp_path)
    meta = json.loads((out_dir / "meta.json").read_text())
    (out_dir / "meta.json").write_text(json.dumps({**meta, "op": "SUM"}))
    res = invoke("check", in_dir, out_dir)
    assert res.exit_code == 0 and "verdict: conforming" in res.stdout, res.output
    formula = tmp_path / "formula"
    assert invoke("gen-inputs", "-p", 3, "--count", 100, "--kind", "adversarial", "--seed", 4,
                  "--formula", formula / "in").exit_code == 0
    assert invoke("oracle", "--algorithm", "ring", formula / "in", formula / "out").exit_code == 0
    for r in range(3):
        f = formula / "out" / f"rank{r}.npy"
        np.save(f, np.load(f).astype(">f4"))
    (formula / "out" / "meta.json").unlink()
    res = invoke("check", "--inputs", "adversarial:seed=4,p=3,count=100", formula / "out")
    assert res.exit_code == 0 and "verdict: conforming" in res.stdout, res.output
    for r in range(3):  # a dtype refcoll does not judge: the file is named
        np.save(formula / "out" / f"rank{r}.npy", np.ones(100, bool))
    assert_refused(invoke("check", "--inputs", "adversarial:seed=4,p=3,count=100",
                          formula / "out"), formula / "out" / "rank0.npy", "dtype bool")


def test_an_op_the_dtype_has_not_is_refused_by_gen_inputs_oracle_and_check(tmp_path):
    """float8 has no prod or avg: simulate refused them, these three made and judged them."""
    assert invoke("gen-inputs", "-p", 3, "--count", 5, "--dtype", "float8_e5m2", "--kind",
                  "exact", tmp_path / "in").exit_code == 0
    assert_refused(invoke("gen-inputs", "-p", 3, "--count", 5, "--dtype", "float8_e5m2",
                          "--op", "prod", tmp_path / "prod"), "not supported on float8_e5m2")
    assert_refused(invoke("oracle", "--algorithm", "ring", "--op", "avg", tmp_path / "in",
                          tmp_path / "out"), "not supported on float8_e5m2")
    assert invoke("oracle", "--algorithm", "ring", tmp_path / "in", tmp_path / "out"
                  ).exit_code == 0
    (tmp_path / "out" / "meta.json").unlink()
    assert_refused(invoke("check", "--op", "prod", tmp_path / "in", tmp_path / "out"),
                   "not supported on float8_e5m2")
    (tmp_path / "out" / "meta.json").write_text('{"dtype": "float8_e5m2"}')  # and a sample
    assert_refused(invoke("check", "--op", "prod", "--inputs", "exact:seed=1,p=3,count=5",
                          "--sample", 2, tmp_path / "out"), "not supported on float8_e5m2")


@pytest.mark.parametrize("formula", [False, True])
def test_gen_inputs_asks_for_the_memory_its_draws_take(formula):
    """The formula's adversarial inputs took 82 B an element to draw, against the 64 asked."""
    import tracemalloc

    from refcoll.cli.check import DRAW_BYTES, FORMULA_DRAW_BYTES
    from refcoll.verify.formula import FormulaInput

    n = 1 << 16
    for kind in ("adversarial", "exact") + (() if formula else ("random",)):
        for dtype in ("float32", "float64", "int32"):
            if formula and kind == "adversarial" and dtype == "int32":
                continue  # (the formula's adversarial kind is for floats)
            tracemalloc.start()
            try:
                if formula:
                    FormulaInput(kind, np.dtype(dtype), 4, 1, n, seed=3).whole()
                else:
                    make_inputs(kind, dtype, n, 4)  # (all four ranks': at least one's)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            asked = (FORMULA_DRAW_BYTES if formula else 4 * DRAW_BYTES) * n
            assert peak <= asked, (kind, dtype, peak / n)


def test_reduce_needs_only_the_roots_output(tmp_path):
    in_dir, out_dir = good_case(tmp_path, collective="reduce", root=2)
    assert sorted(f.name for f in out_dir.glob("rank*.npy")) == ["rank2.npy"]
    res = invoke("check", "--collective", "reduce", "--root", 2, in_dir, out_dir)
    assert res.exit_code == 0, res.output
    for junk in (np.zeros(3), np.zeros(7, np.float32), np.zeros(3, np.uint16)):
        np.save(out_dir / "rank0.npy", junk)  # the others' outputs are undefined: unread
        res = invoke("check", "--collective", "reduce", "--root", 2, in_dir, out_dir)
        assert res.exit_code == 0, res.output
    (out_dir / "rank2.npy").unlink()
    assert_refused(invoke("check", "--collective", "reduce", "--root", 2, in_dir, out_dir),
                   out_dir / "rank2.npy", "root")


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_bit_stored_types_read_back_from_their_unsigned_bits_only(tmp_path, dtype):
    xs = make_inputs("exact", dtype, N, P)
    in_dir = write_world(tmp_path / "in", [x.view(f"u{x.itemsize}") for x in xs],
                         {"dtype": dtype, "stored_as": f"uint{8 * xs[0].itemsize}", "p": P})
    outs = refcoll.simulate("allreduce", xs, algorithm="ring").outputs
    out_dir = write_world(tmp_path / "out", [o.view(f"u{o.itemsize}") for o in outs])
    res = invoke("check", "--algorithm", "ring", in_dir, out_dir)
    assert res.exit_code == 0 and f"x {dtype}" in res.output, res.output
    np.save(out_dir / "rank3.npy", outs[3].view(f"i{outs[3].itemsize}"))  # signed: not the bits
    assert_refused(invoke("check", in_dir, out_dir), out_dir / "rank3.npy",
                   f"int{8 * outs[3].itemsize}", dtype)


# --------------------------------------------------------------- folders and options

FOLDER_CASES = {
    "in-missing": ("in", lambda p: None, "does not exist"),
    "in-is-a-file": ("in", lambda p: p.write_text("x"), "not a folder"),
    "out-missing": ("out", lambda p: None, "does not exist"),
    "out-is-a-file": ("out", lambda p: p.write_text("x"), "not a folder"),
}


@pytest.mark.parametrize("case", FOLDER_CASES)
def test_a_missing_folder_or_a_file_in_its_place_is_refused(tmp_path, case):
    which, make, reason = FOLDER_CASES[case]
    in_dir, out_dir = good_case(tmp_path)
    target = in_dir if which == "in" else out_dir
    for f in target.iterdir():
        f.unlink()
    target.rmdir()
    make(target)
    assert_refused(invoke("check", in_dir, out_dir), target, reason)
    if which == "in":
        assert_refused(invoke("oracle", "--algorithm", "ring", in_dir, tmp_path / "p"),
                       target, reason)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0,
                    reason="running as root, which reads a chmod 000 file anyway")
@pytest.mark.parametrize("name", ["rank1.npy", "meta.json"])
def test_an_unreadable_file_is_refused(tmp_path, name):
    in_dir, out_dir = good_case(tmp_path)
    (in_dir / name).chmod(0)
    try:
        assert_refused(invoke("check", in_dir, out_dir), in_dir / name, "cannot be read")
    finally:
        (in_dir / name).chmod(0o644)


@pytest.mark.parametrize("command", ["check", "oracle"])
def test_a_root_beyond_the_world_is_refused(tmp_path, command):
    in_dir, out_dir = good_case(tmp_path)
    if command == "oracle":
        out_dir = tmp_path / "predicted"
        res = invoke("oracle", "--algorithm", "tree", "--collective", "reduce", "--root", P,
                     in_dir, out_dir)
    else:
        res = invoke("check", "--collective", "reduce", "--root", P, in_dir, out_dir)
    assert_refused(res, f"--root {P}", f"{P} ranks")


# ---------------------------------------------------------- what the writers leave

def test_gen_inputs_over_a_larger_world_leaves_no_stale_ranks(tmp_path):
    assert invoke("gen-inputs", "-p", 6, "--count", 5, tmp_path / "in").exit_code == 0
    assert invoke("gen-inputs", "-p", 3, "--count", 5, tmp_path / "in").exit_code == 0
    assert sorted(f.name for f in (tmp_path / "in").glob("rank*.npy")) == [
        "rank0.npy", "rank1.npy", "rank2.npy"]
    assert invoke("oracle", "--algorithm", "ring", tmp_path / "in", tmp_path / "out").exit_code == 0
    # A reduce predicted over an all-reduce's folder keeps only the root's file.
    assert invoke("oracle", "--algorithm", "tree", "--collective", "reduce", "--root", 1,
                  tmp_path / "in", tmp_path / "out").exit_code == 0
    assert sorted(f.name for f in (tmp_path / "out").glob("rank*.npy")) == ["rank1.npy"]
    res = invoke("check", "--collective", "reduce", "--root", 1, "--algorithm", "tree",
                 tmp_path / "in", tmp_path / "out")
    assert res.exit_code == 0, res.output


@pytest.mark.parametrize("command", ["gen-inputs", "oracle"])
def test_a_folder_of_rank_files_refcoll_did_not_write_is_refused_not_overwritten(tmp_path,
                                                                                 command):
    # A library's outputs (rank files, no meta.json): neither overwritten nor, beyond the
    # new world's p, removed.
    assert invoke("gen-inputs", "-p", 3, "--count", 5, tmp_path / "in").exit_code == 0
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    for r in range(5):
        np.save(theirs / f"rank{r}.npy", np.full(5, r, np.float32))
    before = {f.name: f.read_bytes() for f in theirs.iterdir()}
    args = ["-p", 3, "--count", 5] if command == "gen-inputs" else [
        "--algorithm", "ring", tmp_path / "in"]
    res = invoke(command, *args, theirs)
    assert res.exit_code == 2, res.output
    assert "no meta.json" in res.output and "rank0.npy, rank1.npy, rank2.npy, ..." in res.output
    assert {f.name: f.read_bytes() for f in theirs.iterdir()} == before


def test_gen_inputs_makes_and_writes_one_rank_at_a_time(tmp_path, monkeypatch):
    # A world larger than memory is written rank by rank: each input is made when its
    # file is written and let go before the next is made; the files are make_inputs'.
    import weakref

    from refcoll.verify import inputs

    made, original = [], inputs.make_input

    def watched(*args, **kwargs):
        assert all(ref() is None for ref in made), "an earlier rank's input is still held"
        array = original(*args, **kwargs)
        made.append(weakref.ref(array))
        return array
    monkeypatch.setattr("refcoll.cli.check.make_input", watched)
    res = invoke("gen-inputs", "-p", 5, "--count", 1000, "--kind", "adversarial",
                 tmp_path / "in")
    assert res.exit_code == 0, res.output
    assert len(made) == 5
    for r, x in enumerate(make_inputs("adversarial", "float32", 1000, 5)):
        assert np.array_equal(np.load(tmp_path / "in" / f"rank{r}.npy"), x)


@pytest.mark.parametrize("dtype,op", [("float32", "sum"), ("bfloat16", "avg")])
def test_the_ring_oracle_and_check_run_block_by_block_as_the_simulator_does(tmp_path,
                                                                            monkeypatch, dtype,
                                                                            op):
    # refcoll oracle --algorithm ring writes its files block by block (rank 0's made, the
    # others copied) and check --algorithm ring judges them block by block: the files are
    # np.save's of the simulated outputs byte for byte, and the report the simulated one's.
    import io

    from refcoll.verify import oracle
    from refcoll.verify.oracle import check_outputs, expected_outputs

    monkeypatch.setattr("refcoll.cli.check.block_length", lambda p, itemsize: 7)
    assert invoke("gen-inputs", "-p", 5, "--count", 1003, "--dtype", dtype, "--kind",
                  "adversarial", "--op", op, tmp_path / "in").exit_code == 0
    assert invoke("gen-inputs", "-p", 7, "--count", 3, tmp_path / "out").exit_code == 0
    res = invoke("oracle", "--algorithm", "ring", "--op", op, tmp_path / "in", tmp_path / "out")
    assert res.exit_code == 0, res.output
    xs = [np.load(tmp_path / "in" / f"rank{r}.npy") for r in range(5)]
    xs = [x.view(DTYPES[dtype]) for x in xs]
    want = expected_outputs("allreduce", xs, algorithm="ring", op=op)
    for r in range(5):
        saved = io.BytesIO()
        np.save(saved, want[r].view(f"u{want[r].dtype.itemsize}") if dtype == "bfloat16"
                else want[r])
        assert (tmp_path / "out" / f"rank{r}.npy").read_bytes() == saved.getvalue(), r
    assert sorted(f.name for f in (tmp_path / "out").glob("rank*.npy")) == [
        f"rank{r}.npy" for r in range(5)]  # the larger world's stale files are gone
    res = invoke("oracle", "--algorithm", "tree", "--collective", "reduce", "--root", 3,
                 "--op", op, tmp_path / "in", tmp_path / "reduced")
    assert res.exit_code == 0 and "wrote 1 expected output of tree reduce" in res.output
    expected = expected_outputs("reduce", xs, algorithm="tree", op=op, root=3)[3]
    assert sorted(f.name for f in (tmp_path / "reduced").glob("rank*.npy")) == ["rank3.npy"]
    assert same_bits(np.load(tmp_path / "reduced" / "rank3.npy").view(expected.dtype), expected)
    for name in ("dbtree", "hierarchical"):  # any all-reduce is written block by block
        res = invoke("oracle", "--algorithm", name, "--op", op, tmp_path / "in",
                     tmp_path / name)
        assert res.exit_code == 0, res.output
        for r, expected in enumerate(expected_outputs("allreduce", xs, algorithm=name, op=op)):
            written = np.load(tmp_path / name / f"rank{r}.npy")
            assert same_bits(written.view(expected.dtype), expected), (name, r)
    streamed = {name: check_outputs(xs, want, op=op, algorithm=name, budget=2000)
                for name in ("ring", "dbtree", "hierarchical", "tree")}
    reduced = expected_outputs("reduce", xs, algorithm="tree", op=op, root=3)
    streamed["reduce"] = check_outputs(xs, reduced, collective="reduce", op=op, root=3,
                                       algorithm="tree", budget=2000)
    monkeypatch.setattr(oracle, "rank_blockwise", lambda *a, **k: None)  # the simulator's way
    for name, report in streamed.items():  # (every all-reduce is judged block by block)
        simulated = (check_outputs(xs, reduced, collective="reduce", op=op, root=3,
                                   algorithm="tree") if name == "reduce"
                     else check_outputs(xs, want, op=op, algorithm=name))
        assert json.dumps(report.to_json()) == json.dumps(simulated.to_json()), name
    assert streamed["reduce"].conforming
    assert "bit-exact against ring" in json.dumps(streamed["ring"].to_json())
    assert streamed["ring"].conforming and not streamed["dbtree"].conforming
    res = invoke("check", "--algorithm", "ring", "--op", op, tmp_path / "in", tmp_path / "out")
    assert res.exit_code == 0 and "conforming, bit-exact" in res.output, res.output


@pytest.mark.parametrize("collective", ["reduce_scatter", "allgather", "broadcast"])
def test_the_other_collectives_oracle_check_and_identify_never_read_a_whole_file(
        tmp_path, monkeypatch, collective):
    # oracle, check --algorithm and check --identify of a reduce-scatter, an all-gather or a
    # broadcast read their files a block at a time, as an all-reduce's do: no file is
    # ever read whole, the oracle's files are np.save's of the simulated outputs byte for
    # byte, and the reports are the simulator's.
    import io

    from refcoll.verify import oracle
    from refcoll.verify.npy import NpyFile
    from refcoll.verify.oracle import check_outputs, expected_outputs

    assert invoke("gen-inputs", "-p", 5, "--count", 1003, "--kind", "adversarial",
                  tmp_path / "in").exit_code == 0
    xs = [np.load(tmp_path / "in" / f"rank{r}.npy") for r in range(5)]
    monkeypatch.setattr("refcoll.cli.check.block_length", lambda p, itemsize: 7)

    def whole(self):
        raise AssertionError(f"{self.name} read whole")
    monkeypatch.setattr(NpyFile, "whole", whole)
    for name in algorithms.names(collective):
        if name == "auto":
            continue
        rooted = ("--root", 3) if collective in ("broadcast", "reduce") else ()
        res = invoke("oracle", "--algorithm", name, "--collective", collective, *rooted,
                     tmp_path / "in", tmp_path / name)
        assert res.exit_code == 0 and "wrote 5 expected outputs" in res.output, res.output
        want = expected_outputs(collective, xs, algorithm=name, root=3)
        for r in range(5):
            saved = io.BytesIO()
            np.save(saved, want[r])
            assert (tmp_path / name / f"rank{r}.npy").read_bytes() == saved.getvalue(), \
                (name, r)
        res = invoke("check", "--algorithm", name, "--identify", "--collective", collective,
                     *rooted, tmp_path / "in", tmp_path / name)
        assert res.exit_code == 0 and "conforming, bit-exact" in res.output, res.output
        assert f"matches {name}" in res.output or "moves the data unchanged" in res.output
        streamed = check_outputs(xs, want, collective=collective, algorithm=name, root=3,
                                 budget=2000)
        with monkeypatch.context() as m:
            m.setattr(oracle, "rank_blockwise", lambda *a, **k: None)  # the simulator's way
            simulated = check_outputs(xs, want, collective=collective, algorithm=name, root=3)
        assert json.dumps(streamed.to_json()) == json.dumps(simulated.to_json()), name


def test_a_root_or_an_op_the_collective_has_not_is_refused(tmp_path):
    # oracle wrote "root": 1 of an all-reduce and "op": "max" of an all-gather into its
    # meta.json; simulate refuses both, and so do oracle and check now.
    in_dir = tmp_path / "in"
    assert invoke("gen-inputs", "-p", 2, "--count", 4, in_dir).exit_code == 0
    for command in ("oracle", "check"):
        for args, said in ((("--root", 1), "--root 1: allreduce has no root"),
                           (("--collective", "allgather", "--op", "max"),
                            "--op max: allgather reduces nothing")):
            res = invoke(command, "--algorithm", "ring", *args, in_dir, tmp_path / "out")
            assert res.exit_code == 2 and said in res.output, (command, res.output)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("collective", algorithms.COLLECTIVES)
def test_zero_elements_run_end_to_end(tmp_path, collective):
    """gen-inputs --count 0, oracle, then check on the oracle's own output: exit 0."""
    in_dir = tmp_path / "in"
    res = invoke("gen-inputs", "-p", 3, "--count", 0, "--dtype", "bfloat16", in_dir)
    assert res.exit_code == 0, res.output
    rooted = ("--root", 2) if collective in ("broadcast", "reduce") else ()
    for name in algorithms.names(collective):
        out_dir = tmp_path / name
        res = invoke("oracle", "--algorithm", name, "--collective", collective, *rooted,
                     in_dir, out_dir)
        assert res.exit_code == 0, (name, res.output)
        res = invoke("check", "--algorithm", name, "--collective", collective, *rooted,
                     in_dir, out_dir)
        assert res.exit_code == 0, (name, res.output)
        assert "3 ranks, 0 x bfloat16" in res.output and "verdict: conforming" in res.output


def test_the_writers_refuse_a_file_in_the_folders_place(tmp_path):
    (tmp_path / "taken").write_text("x")
    assert_refused(invoke("gen-inputs", "-p", 2, "--count", 3, tmp_path / "taken"),
                   tmp_path / "taken", "is a file")
    in_dir, _ = good_case(tmp_path)
    assert_refused(invoke("oracle", "--algorithm", "ring", in_dir, tmp_path / "taken"),
                   tmp_path / "taken", "is a file")


def test_oracle_refuses_to_write_over_its_inputs(tmp_path):
    in_dir, _ = good_case(tmp_path)
    before = {f.name: f.read_bytes() for f in in_dir.iterdir()}
    assert_refused(invoke("oracle", "--algorithm", "ring", in_dir, in_dir), in_dir, "overwrite")
    assert {f.name: f.read_bytes() for f in in_dir.iterdir()} == before


def test_worlds_that_would_not_fit_on_the_disk_are_refused_before_a_file_is_written(
        tmp_path, monkeypatch):
    import collections

    usage = collections.namedtuple("usage", "total used free")
    assert invoke("gen-inputs", "-p", 3, "--count", 1000, tmp_path / "in").exit_code == 0
    monkeypatch.setattr("refcoll.cli.common.shutil.disk_usage",
                        lambda path: usage(1 << 30, 1 << 30, 11_999))  # 4 B short of 3 x 1000
    res = invoke("gen-inputs", "-p", 3, "--count", 1000, tmp_path / "more")
    assert res.exit_code == 2 and "needs about 11.7 KiB of disk" in res.output, res.output
    res = invoke("oracle", "--algorithm", "tree", tmp_path / "in", tmp_path / "out")
    assert res.exit_code == 2 and "writing 3 expected outputs needs about" in res.output
    assert not (tmp_path / "more").exists() and not (tmp_path / "out").exists()


def test_identify_of_a_reduce_takes_the_roots_file_when_every_rank_wrote_one(tmp_path):
    """Every MPI rank saves its receive buffer; a reduce's non-roots' hold nothing of it."""
    assert invoke("gen-inputs", "-p", 4, "--count", 101, "--kind", "adversarial",
                  tmp_path / "in").exit_code == 0
    assert invoke("oracle", "--algorithm", "tree", "--collective", "reduce", tmp_path / "in",
                  tmp_path / "out").exit_code == 0
    for r in (1, 2, 3):
        (tmp_path / "out" / f"rank{r}.npy").write_bytes(
            (tmp_path / "in" / f"rank{r}.npy").read_bytes())
    res = invoke("check", "--identify", "--collective", "reduce", tmp_path / "in",
                 tmp_path / "out")
    assert res.exit_code == 0, res.output
    assert "identify: matches tree" in res.output


def test_a_product_every_order_gives_exactly_is_judged_bit_for_bit(tmp_path):
    assert invoke("gen-inputs", "-p", 4, "--count", 1000, "--kind", "exact", "--op", "prod",
                  tmp_path / "in").exit_code == 0
    assert invoke("oracle", "--algorithm", "ring", "--op", "prod", tmp_path / "in",
                  tmp_path / "out").exit_code == 0
    right = invoke("check", "--op", "prod", tmp_path / "in", tmp_path / "out")
    assert right.exit_code == 0 and "exact (a product every order gives exactly)" in right.output
    for r in range(4):  # one ulp off, on every rank: within the bound, but no order gives it
        path = tmp_path / "out" / f"rank{r}.npy"
        a = np.load(path)
        a[0] = np.nextafter(a[0], np.float32(0))
        np.save(path, a)
    wrong = invoke("check", "--op", "prod", tmp_path / "in", tmp_path / "out")
    assert wrong.exit_code == 1, wrong.output
    assert "verdict: not conforming" in wrong.output and "0xc0000000" in wrong.output


def test_an_empty_folder_name_or_a_seed_past_64_bits_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("rank5.npy").write_text("precious")
    assert_refused(invoke("gen-inputs", "-p", 2, "--count", 3, ""), "give a folder name")
    assert Path("rank5.npy").read_text() == "precious"
    res = invoke("gen-inputs", "-p", 2, "--count", 1, "--seed", 2**64, "--formula", "--kind",
                 "exact", "g")
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
