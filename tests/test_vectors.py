"""The golden vectors in spec/vectors: regenerated identically, complete, reproduced bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import refcoll
from refcoll import algorithms
from refcoll.core.ops import get_dtype
from refcoll.verify.inputs import make_inputs
from refcoll.verify.vectors import PROCESS_COUNTS, generate, load, plan, read_manifest, verify

VECTORS = Path(__file__).resolve().parent.parent / "spec" / "vectors"


def _bits(a) -> bytes:
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}").tobytes() if a.size else b""


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and _bits(a) == _bits(b)


@pytest.fixture(scope="module")
def committed() -> dict:
    return read_manifest(VECTORS)


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("vectors")
    generate(directory)
    return directory


def _by_file(manifest: dict) -> dict:
    return {e["file"]: e for e in manifest["vectors"]}


def test_regenerated_manifest_is_the_committed_one(regenerated, committed):
    fresh = _by_file(read_manifest(regenerated))
    old = _by_file(committed)
    assert sorted(set(fresh) - set(old)) == [], "vectors the committed set lacks: regenerate"
    assert sorted(set(old) - set(fresh)) == [], "committed vectors the plan no longer makes"
    differing = [name for name in old if old[name] != fresh[name]]
    assert differing == [], (f"{len(differing)} manifest entries differ, first {differing[0]}: "
                             f"committed {old[differing[0]]}, regenerated {fresh[differing[0]]}")
    assert read_manifest(regenerated) == committed


def test_regenerated_arrays_are_the_committed_ones(regenerated, committed):
    differing = []
    for entry in committed["vectors"]:
        old_in, old_out = load(VECTORS, entry)
        new_in, new_out = load(regenerated, entry)
        for label, old, new in (("input", old_in, new_in), ("output", old_out, new_out)):
            differing += [f"{entry['file']} {label}_{r}" for r, (a, b) in enumerate(zip(old, new))
                          if not _same(a, b)]
    assert differing == [], f"{len(differing)} arrays differ, first: {differing[:5]}"


def test_regenerated_files_are_byte_identical(regenerated, committed):
    """The writer pins its bytes (no zip dates, no compression): same arrays, same file."""
    differing = [e["file"] for e in committed["vectors"]
                 if (regenerated / e["file"]).read_bytes() != (VECTORS / e["file"]).read_bytes()]
    assert differing == [], (f"{len(differing)} files differ in bytes, first {differing[:3]}; if "
                             "the arrays test passes, only the writer's bytes changed")
    assert (regenerated / "manifest.json").read_bytes() == (VECTORS / "manifest.json").read_bytes()


def test_folder_holds_exactly_the_manifest(committed):
    on_disk = {f.name for f in VECTORS.glob("*.npz")}
    assert on_disk == set(_by_file(committed))
    assert committed["count"] == len(committed["vectors"]) == len(plan())


@pytest.mark.parametrize("name", [n for n in algorithms.names() if n != "auto"])
def test_every_algorithm_and_collective_is_covered(committed, name):
    entries = [e for e in committed["vectors"] if e["algorithm"] == name]
    for collective in algorithms.get(name).collectives:
        mine = [e for e in entries if e["collective"] == collective]
        assert {e["p"] for e in mine} >= set(PROCESS_COUNTS), collective
        assert {e["dtype"] for e in mine} >= {"float32", "bfloat16", "int32"}, collective
        assert {0, 1} <= {e["n"] for e in mine}, collective
        if collective in ("allreduce", "reduce_scatter", "reduce"):
            assert {e["op"] for e in mine} == {"sum", "avg", "max", "prod"}, collective
            assert {e["dtype"] for e in mine} >= {"float16", "float64"}, collective
            assert any(e["kind"] == "adversarial" for e in mine), collective


def test_committed_vectors_reproduce_bit_for_bit():
    assert verify(VECTORS) == []


def _first_per_pair(manifest: dict) -> list[dict]:
    """One vector per (algorithm, collective, options): p = 5, float32, n = 37 where there
    is one."""
    chosen = {}
    for e in manifest["vectors"]:
        key = (e["algorithm"], e["collective"], json.dumps(e["options"], sort_keys=True))
        if key not in chosen or (e["p"], e["n"], e["dtype"]) == (5, 37, "float32"):
            chosen[key] = e
    return list(chosen.values())


@pytest.mark.parametrize("entry", _first_per_pair(read_manifest(VECTORS)),
                         ids=lambda e: e["file"][:-4])
def test_simulate_reproduces_a_loaded_vector(entry):
    """Read the file as an implementer would and run refcoll.simulate directly."""
    inputs, outputs = load(VECTORS, entry)
    assert len(inputs) == entry["p"]
    assert all(x.dtype == get_dtype(entry["dtype"]) and list(x.shape) == entry["input_shape"]
               for x in inputs)
    # The inputs are make_inputs' (data movement uses the sum inputs).
    made = make_inputs(entry["kind"], entry["dtype"], entry["n"], entry["p"],
                       op=entry["op"] or "sum", seed=entry["seed"])
    assert all(_same(a, b) for a, b in zip(inputs, made))
    kwargs = dict(entry["options"])
    if entry["op"] is not None:
        kwargs["op"] = entry["op"]
    result = refcoll.simulate(entry["collective"], inputs, algorithm=entry["algorithm"], **kwargs)
    assert [r for r, y in enumerate(result.outputs) if y is not None] == entry["output_ranks"]
    assert [list(outputs[r].shape) for r in entry["output_ranks"]] == entry["output_shapes"]
    for r in range(entry["p"]):
        assert _same(outputs[r], result.outputs[r]), f"rank {r}"
    if entry["extra_ranks"]:  # switches: in the world, not in the file
        assert result.world.size == entry["p"] + entry["extra_ranks"]


def test_bfloat16_is_stored_as_bits(committed):
    entry = next(e for e in committed["vectors"] if e["dtype"] == "bfloat16")
    assert entry["stored_as"] == "uint16"
    with np.load(VECTORS / entry["file"], allow_pickle=False) as data:
        stored = data["input_0"]
    assert stored.dtype == np.dtype("<u2")
    inputs, _ = load(VECTORS, entry)
    widened = (stored.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(widened, inputs[0].astype(np.float32))


def test_reduce_vectors_hold_the_root_output_only(committed):
    entries = [e for e in committed["vectors"] if e["collective"] == "reduce"]
    assert {e["root"] for e in entries if e["p"] == 8} == {0, 7}
    for e in entries:
        assert e["output_ranks"] == [e["root"]] == [e["options"]["root"]]


def _copy_entry(tmp_path: Path, entry: dict, arrays: dict | None = None) -> Path:
    """Put one vector (its arrays replaced by ``arrays`` if given) in a folder of its own."""
    directory = tmp_path / "one"
    directory.mkdir()
    if arrays is None:
        (directory / entry["file"]).write_bytes((VECTORS / entry["file"]).read_bytes())
    else:
        np.savez(directory / entry["file"], **arrays)
    (directory / "manifest.json").write_text(json.dumps({"format": 1, "vectors": [entry]}))
    return directory


def _arrays(entry: dict) -> dict:
    with np.load(VECTORS / entry["file"], allow_pickle=False) as data:
        return {k: data[k].copy() for k in data.files}


def test_verify_names_a_flipped_bit(tmp_path, committed):
    entry = _by_file(committed)["ring-allreduce-sum-float32-p5-n37-random.npz"]
    arrays = _arrays(entry)
    arrays["output_3"].view(np.uint32)[7] ^= 1
    directory = _copy_entry(tmp_path, entry, arrays)
    problems = verify(directory)
    assert problems[0] == f"{entry['file']}: sha256 differs from the manifest's"
    assert len(problems) == 2
    assert "rank 3 element 7" in problems[1] and "1 element differs" in problems[1]


def test_verify_names_a_missing_output_and_file(tmp_path, committed):
    entry = _by_file(committed)["tree-reduce-sum-float32-p5-n37-random-root4.npz"]
    arrays = _arrays(entry)
    del arrays["output_4"]
    arrays["output_0"] = arrays["input_0"]
    problems = verify(_copy_entry(tmp_path, entry, arrays))
    assert any("rank 0 has an output, the simulator gives none" in p for p in problems)
    assert any("rank 4 has no output, the simulator gives one" in p for p in problems)
    (tmp_path / "one" / entry["file"]).unlink()
    assert verify(tmp_path / "one") == [f"{entry['file']}: missing"]


@pytest.mark.parametrize("option", ["algorithm", "inputs", "moves_data", "timeout", "warp"])
def test_a_manifest_option_the_algorithm_does_not_take_is_refused(tmp_path, committed, option):
    """simulate's own keywords reached it twice: a traceback, or another run in silence."""
    from refcoll.core.errors import UsageError

    entry = _by_file(committed)["ring-allreduce-sum-float32-p5-n37-random.npz"]
    directory = _copy_entry(tmp_path, {**entry, "options": {option: 0}})
    with pytest.raises(UsageError, match=f"does not take the option {option}"):
        verify(directory)


def test_verify_passes_an_untouched_copy(tmp_path, committed):
    entry = _by_file(committed)["switch-allreduce-sum-bfloat16-p5-n37-random.npz"]
    assert verify(_copy_entry(tmp_path, entry)) == []


def test_verify_reports_a_truncated_vector_and_goes_on_to_the_next(tmp_path, committed):
    # A truncated file stopped the whole check at it (exit 2); it is one more mismatch.
    entries = _by_file(committed)
    cut = entries["ring-allreduce-sum-float32-p5-n37-random.npz"]
    flipped = entries["switch-allreduce-sum-bfloat16-p5-n37-random.npz"]
    directory = tmp_path / "two"
    directory.mkdir()
    data = (VECTORS / cut["file"]).read_bytes()
    (directory / cut["file"]).write_bytes(data[:len(data) // 2])
    arrays = _arrays(flipped)
    arrays["output_1"].view(np.uint16)[3] ^= 1
    np.savez(directory / flipped["file"], **arrays)
    (directory / "manifest.json").write_text(json.dumps({"format": 1,
                                                          "vectors": [cut, flipped]}))
    problems = verify(directory)
    assert problems[:2] == [f"{cut['file']}: sha256 differs from the manifest's",
                            f"{cut['file']}: cannot be read: {directory / cut['file']}: not a "
                            "readable .npz archive " + problems[1].split("archive ", 1)[1]]
    assert problems[2] == f"{flipped['file']}: sha256 differs from the manifest's"
    assert "rank 1 element 3" in problems[3] and len(problems) == 4


@pytest.mark.parametrize("field,value", [("n", 999), ("input_shape", [999]),
                                         ("output_ranks", [0]), ("output_shapes", [[1]]),
                                         ("extra_ranks", 7), ("stored_as", "float64")])
def test_verify_holds_the_manifests_description_to_the_vector(tmp_path, committed, field, value):
    # An implementation reads n, root, output_ranks and output_shapes from the manifest:
    # a manifest that misdescribes its vectors passed as "0 mismatches".
    entry = _by_file(committed)["ring-allreduce-sum-float32-p5-n37-random.npz"]
    problems = verify(_copy_entry(tmp_path, {**entry, field: value}))
    assert any(f"the manifest says {field}" in p and repr(value) in p for p in problems), \
        problems


def test_verify_refuses_a_manifest_of_no_or_repeated_vectors_and_stray_members(tmp_path,
                                                                             committed):
    from refcoll.core.errors import UsageError

    entry = _by_file(committed)["ring-allreduce-sum-float32-p3-n37-random.npz"]
    directory = _copy_entry(tmp_path, entry)
    for vectors, said in (([], "names no vectors"), ([entry, entry], "more than once")):
        (directory / "manifest.json").write_text(json.dumps({"format": 1, "vectors": vectors}))
        with pytest.raises(UsageError, match=said):
            verify(directory)
    arrays = {**_arrays(entry), "output_7": np.zeros(3, np.float32)}
    np.savez(directory / entry["file"], **arrays)
    import hashlib
    digest = hashlib.sha256((directory / entry["file"]).read_bytes()).hexdigest()
    (directory / "manifest.json").write_text(json.dumps({"format": 1,
                                                         "vectors": [{**entry, "sha256": digest}]}))
    with pytest.raises(UsageError, match="holds output_7.npy, which no rank of a vector of 3"):
        verify(directory)


def test_verify_names_unequal_inputs_and_goes_on(tmp_path, committed):
    entry = _by_file(committed)["ring-allreduce-sum-float32-p3-n37-random.npz"]
    arrays = _arrays(entry)
    arrays["input_1"] = arrays["input_1"][:12]
    problems = verify(_copy_entry(tmp_path, entry, arrays))
    assert problems[-1] == (f"{entry['file']}: rank 1's input holds 12 elements, the manifest "
                            "says n = 37")


def test_vectors_write_over_no_file_their_manifest_does_not_name(tmp_path):
    from click.testing import CliRunner

    from refcoll.cli import main

    own = tmp_path / "own"
    own.mkdir()
    (own / "manifest.json").write_text('{"format": 1, "count": 0, "vectors": []}')
    mine = own / "ring-allreduce-sum-float32-p3-n37-random.npz"
    mine.write_text("MY DATA")
    result = CliRunner().invoke(main, ["vectors", str(own)])
    assert result.exit_code == 2 and "does not name it" in result.output, result.output
    assert mine.read_text() == "MY DATA"
    result = CliRunner().invoke(main, ["vectors", ""])
    assert result.exit_code == 2 and "give a folder name" in result.output, result.output
