"""Inputs by formula (spec/inputs.md): the C in the spec and refcoll's NumPy agree bit for bit,
the kinds do what they say, and `refcoll check --inputs` (with `--sample`) judges by them."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from click.testing import CliRunner

from refcoll.cli import main
from refcoll.core.errors import UsageError
from refcoll.core.ops import exact_integer_limit
from refcoll.verify.formula import inputs, parse_spec, sample_indices, values
from refcoll.verify.identify import identify
from refcoll.verify.oracle import expected_outputs
from refcoll.verify.rankfiles import write_world

ROOT = Path(__file__).resolve().parent.parent
CC = shutil.which("cc") or shutil.which("gcc")

MAIN = r"""
#include <stdio.h>
#include <string.h>
int main(void) {
    unsigned long long seed, p, rank, index, M; int kind;
    while (scanf("%d %llu %llu %llu %llu %llu", &kind, &seed, &p, &rank, &index, &M) == 6) {
        double v = kind ? refcoll_adversarial(seed, p, rank, index, M)
                        : refcoll_exact(seed, p, rank, index, M);
        float f = (float)v;
        unsigned long long d; unsigned int b;
        memcpy(&d, &v, 8); memcpy(&b, &f, 4);
        printf("%016llx %08x\n", d, b);
    }
    return 0;
}
"""


def _spec_c() -> str:
    text = (ROOT / "spec" / "inputs.md").read_text()
    blocks = re.findall(r"```c\n(.*?)```", text, re.S)
    assert len(blocks) == 1, "spec/inputs.md holds one C block"
    return blocks[0]


@pytest.mark.skipif(CC is None, reason="no C compiler (cc or gcc) on this machine")
def test_the_c_in_the_spec_makes_refcolls_bits(tmp_path):
    source = tmp_path / "inputs.c"
    source.write_text(_spec_c() + MAIN)
    program = tmp_path / "inputs"
    subprocess.run([CC, "-O2", "-std=c99", "-o", str(program), str(source)], check=True,
                   capture_output=True, timeout=60)
    cases = []
    for kind in (0, 1):
        for seed in (0, 7, (1 << 64) - 1):
            for p in (1, 2, 5, 3000):
                for rank in sorted({0, 1 % p, p - 1}):
                    for index in (0, 1, 2, 12345, (1 << 40) + 3):
                        cases.append((kind, seed, p, rank, index))
    limits = {np.float32: exact_integer_limit(np.float32), np.float64: exact_integer_limit(
        np.float64)}
    lines = "".join(f"{k} {s} {p} {r} {i} {limits[np.float64]}\n" for k, s, p, r, i in cases)
    lines += "".join(f"{k} {s} {p} {r} {i} {limits[np.float32]}\n" for k, s, p, r, i in cases)
    out = subprocess.run([str(program)], input=lines, capture_output=True, text=True,
                         check=True, timeout=60).stdout.split("\n")
    for n, (kind, seed, p, rank, index) in enumerate(cases):
        name = ("exact", "adversarial")[kind]
        wide = values(name, np.float64, p, rank, np.array([index]), seed=seed)[0]
        narrow = values(name, np.float32, p, rank, np.array([index]), seed=seed)[0]
        c_wide = out[n].split()[0]
        c_narrow = out[len(cases) + n].split()[1]
        assert f"{np.float64(wide).view(np.uint64):016x}" == c_wide, (name, seed, p, rank, index)
        assert f"{np.float32(narrow).view(np.uint32):08x}" == c_narrow, (name, seed, p, rank)


def test_any_block_of_elements_is_the_whole_arrays_block():
    whole = inputs("adversarial", np.float32, 6, 1001, seed=5)
    for start, stop in ((0, 1), (10, 517), (1000, 1001)):
        part = inputs("adversarial", np.float32, 6, 1001, seed=5, start=start, stop=stop)
        assert all(np.array_equal(w[start:stop], b) for w, b in zip(whole, part))
    where = np.array([3, 999, 4])
    assert np.array_equal(values("exact", np.int8, 6, 2, where, seed=5),
                          inputs("exact", np.int8, 6, 1001, seed=5)[2][where])


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
def test_exact_inputs_give_every_order_the_same_bits(dtype):
    ins = inputs("exact", dtype, 7, 513, seed=2)
    outputs = expected_outputs("allreduce", ins, algorithm="ring")
    assert identify(ins, outputs, known=[]).indistinct
    assert np.array_equal(outputs[0], np.sum(np.stack(ins).astype(np.float64), axis=0))


def test_adversarial_inputs_tell_orders_apart():
    ins = inputs("adversarial", np.float32, 8, 4099, seed=11)
    found = identify(ins, expected_outputs("allreduce", ins, algorithm="tree"), known=[])
    assert "tree" in found.matches and "ring" not in found.matches and not found.indistinct
    big = np.abs(np.stack(ins)) == exact_integer_limit(np.float32)
    assert (big.sum(axis=0) >= 1).all()  # every element has its large value somewhere


def test_samples_are_distinct_sorted_and_hold_the_ends():
    where = sample_indices(10**9, 64, seed=1)
    assert where.size == 64 and where[0] == 0 and where[-1] == 10**9 - 1
    assert np.all(np.diff(where) > 0)
    assert sample_indices(5, 64).tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("count, k", [(3, 2), (4, 3), (1003, 1002), (100003, 100000),
                                      (100003, 1000), (201, 199), (2**62, 50)])
def test_a_sample_is_k_elements_spread_over_the_whole_array(count, k):
    where = sample_indices(count, k, seed=7)
    assert where.size == k and np.all(np.diff(where) > 0)  # k of them, however close to count
    assert where[0] == 0 and where[-1] == count - 1
    if k >= 50 and 2 * k < count:  # drawn, not every element: as many above the middle
        above = np.count_nonzero(where > count // 2) / k
        assert 0.35 < above < 0.65, above


@pytest.mark.parametrize("text", ["exact", "exact:seed=1,p=0,count=3", "gauss:seed=1,p=2,count=3",
                                  "exact:p=2,seed=1,count=3", f"exact:seed=0,p=3,count={2**63}",
                                  f"exact:seed=0,p={2**31},count=1",
                                  f"exact:seed=0,p=4,count={2**51 + 1}",
                                  # past int()'s 4300 digits (a ValueError's traceback, exit
                                  # 1), and digits int() takes that are not ASCII
                                  "exact:seed=" + "9" * 5000 + ",p=4,count=37",
                                  "exact:seed=1,p=\u0663,count=37",
                                  "exact:seed=1,p=2,count=3,dtype=float33",
                                  "exact:seed=1,p=2,count=3,dtype=",
                                  "exact:seed=1,p=2,count=3,dtype=float32,dtype=int8"])
def test_a_bad_spec_is_a_usage_error(text):
    with pytest.raises(UsageError) as raised:
        parse_spec(text)
    assert len(str(raised.value)) < 300  # a long one is quoted cut short


def test_a_spec_past_2_to_the_32_elements_is_taken():
    assert parse_spec(f"exact:seed=0,p=4,count={2**51}") == ("exact", 0, 4, 2**51, None)
    assert parse_spec(f"adversarial:seed=1,p=2,count={2**33 + 3}")[3] == 2**33 + 3


def test_a_spec_names_its_dtype_and_writes_itself_back():
    spec = parse_spec("exact:seed=2,p=3,count=10,dtype=bfloat16")
    assert spec.dtype == ml_dtypes.bfloat16 and spec.count == 10
    assert parse_spec(str(spec)) == spec
    assert str(parse_spec("exact:seed=2,p=3,count=10")) == "exact:seed=2,p=3,count=10"


def _bits_world(tmp_path, wrong: int | None) -> Path:
    """bfloat16 all-reduce outputs stored as their bits, with no meta.json to name them."""
    ins = inputs("adversarial", ml_dtypes.bfloat16, 2, 1000, seed=3)
    outs = expected_outputs("allreduce", ins, algorithm="ring")
    if wrong is not None:
        outs[1][wrong] *= 2
    folder = tmp_path / f"bits{wrong}"
    folder.mkdir()
    for r, y in enumerate(outs):
        np.save(folder / f"rank{r}.npy", y.view(np.uint16))
    return folder


def test_check_inputs_judges_bits_files_as_the_dtype_the_spec_names(tmp_path):
    spec = "adversarial:seed=3,p=2,count=1000"
    good, bad = _bits_world(tmp_path, None), _bits_world(tmp_path, 4)
    run = CliRunner().invoke
    for kind in ("adversarial", "exact"):  # uint16 alone: exact's bits judged as integers
        res = run(main, ["check", "--inputs", spec.replace("adversarial", kind), str(good)])
        assert res.exit_code == 2 and "dtype=" in res.output and "bfloat16" in res.output, \
            res.output
    for more in ([], ["--sample", "20"]):
        res = run(main, ["check", "--inputs", spec + ",dtype=bfloat16", *more, str(good)])
        assert res.exit_code == 0 and "x bfloat16" in res.output, res.output
    res = run(main, ["check", "--inputs", spec + ",dtype=bfloat16", str(bad)])
    assert res.exit_code == 1 and "rank 1 element 4" in res.output, res.output
    res = run(main, ["check", "--inputs", spec + ",dtype=float16", str(good)])
    assert res.exit_code == 2 and "holds uint16, expected float16" in res.output, res.output


def test_a_spec_dtype_against_meta_json_is_a_usage_error(tmp_path):
    folder = _bits_world(tmp_path, None)
    (folder / "meta.json").write_text(json.dumps({"dtype": "float8_e5m2"}))
    res = CliRunner().invoke(main, ["check", "--inputs",
                                    "adversarial:seed=3,p=2,count=1000,dtype=bfloat16",
                                    str(folder)])
    assert res.exit_code == 2 and "float8_e5m2" in res.output, res.output


def _world(tmp_path, corrupt: bool = False) -> Path:
    ins = inputs("adversarial", np.float32, 4, 3001, seed=3)
    outs = expected_outputs("allreduce", ins, algorithm="ring")
    if corrupt:  # one nonzero sampled element of rank 2, off by 1 %
        k = next(i for i in sample_indices(3001, 40, seed=3) if outs[2][i] != 0)
        outs[2][k] *= np.float32(1.01)
    out = tmp_path / ("bad" if corrupt else "out")
    write_world(out, outs)
    return out


def test_check_judges_against_the_formula_whole_and_sampled(tmp_path):
    spec = "adversarial:seed=3,p=4,count=3001"
    out, bad = _world(tmp_path), _world(tmp_path, corrupt=True)
    run = CliRunner().invoke
    res = run(main, ["check", "--inputs", spec, str(out), "--identify"])
    assert res.exit_code == 0 and "matches ring" in res.output, res.output
    res = run(main, ["check", "--inputs", spec, str(out), "--sample", "40"])
    assert res.exit_code == 0 and "sampled 40 of 3001" in res.output, res.output
    for args in ([str(bad)], [str(bad), "--sample", "40"]):
        res = run(main, ["check", "--inputs", spec, *args])
        assert res.exit_code == 1 and "verdict: not conforming" in res.output, res.output


@pytest.mark.parametrize("collective", ["reduce_scatter", "allgather", "broadcast", "reduce"])
def test_every_collective_is_judged_sampled_against_the_formula(tmp_path, collective):
    # --sample reads K elements of each output: a reduce-scatter's K of each rank's chunk,
    # an all-gather's every copy of the K sampled input elements, a reduce's root's alone;
    # element 0 of every output is always among them.
    from refcoll.verify.oracle import expected_outputs

    spec, p, root = "adversarial:seed=3,p=5,count=3001", 5, 2
    outs = expected_outputs(collective, inputs("adversarial", np.float32, p, 3001, seed=3),
                            algorithm="naive", root=root)
    write_world(tmp_path / "out", outs)
    outs[root].reshape(-1)[0] += np.float32(1e9)  # far outside any bound, on one rank
    write_world(tmp_path / "bad", outs)
    run = CliRunner().invoke
    for folder, code in (("out", 0), ("bad", 1)):
        rooted = ["--root", str(root)] if collective in ("broadcast", "reduce") else []
        res = run(main, ["check", "--inputs", spec, "--collective", collective, *rooted,
                         "--sample", "40", str(tmp_path / folder),
                         "--json", str(tmp_path / f"{folder}.json")])
        assert res.exit_code == code, (folder, res.output)
    sampled = json.loads((tmp_path / "out.json").read_text())["sampled"]
    if collective == "reduce_scatter":  # 40 of each rank's chunk of 600 or 601
        assert sorted(sampled) == [str(r) for r in range(p)] and \
            all(len(v) == 40 and v[0] == 0 for v in sampled.values())
    else:
        assert len(sampled) == 40 and sampled[0] == 0 and sampled[-1] == 3000


@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather"])
def test_a_sampled_report_names_the_element_of_the_outputs_file(tmp_path, collective):
    # It named the element's place among the sampled ones (element 5 of a 4 TiB output).
    from refcoll.verify.oracle import expected_outputs

    spec, p, count = "adversarial:seed=3,p=3,count=3001", 3, 3001
    outs = expected_outputs(collective, inputs("adversarial", np.float32, p, count, seed=3),
                            algorithm="naive")
    chunk = 1000 if collective == "reduce_scatter" else count  # rank 1's: 1000 of 3001
    picked = [int(i) for i in sample_indices(chunk, 40, seed=3)]
    k = next(i for i in picked[1:] if outs[1].reshape(-1)[i] != 0)  # not the 0th: a place
    outs[1].reshape(-1)[k] += np.float32(1e9)
    write_world(tmp_path / "bad", outs)
    res = CliRunner().invoke(main, ["check", "--inputs", spec, "--collective", collective,
                                    "--sample", "40", str(tmp_path / "bad"),
                                    "--json", str(tmp_path / "bad.json")])
    assert res.exit_code == 1 and f"rank 1's output element {k}" in res.output, res.output
    indices = [f["data"]["index"] for f in json.loads((tmp_path / "bad.json").read_text())
               ["findings"] if not f["passed"] and "index" in (f.get("data") or {})]
    assert indices and set(indices) == {k}, indices


@pytest.mark.parametrize("args, needle", [
    (["--sample", "5", "x", "y"], "--inputs"),
    (["--inputs", "exact:seed=1,p=2,count=3"], "OUT_DIR alone"),
    (["--inputs", "exact:seed=1,p=2,count=3", "a", "b"], "OUT_DIR alone"),
    (["onlyone"], "IN_DIR and OUT_DIR"),
    (["--inputs", "exact:seed=1,p=4,count=3001", "--sample", "5", "--identify", "OUT"],
     "--identify"),
    (["--inputs", "exact:seed=1,p=4,count=3", "--sample", "5", "--collective",
      "reduce_scatter", "OUT"], "count >= p=4"),
    (["--inputs", "exact:seed=1,p=4,count=30", "--sample", "5", "--collective", "broadcast",
      "--root", "4", "OUT"], "--root 4 is not one of the 4 ranks"),
])
def test_check_refuses_what_the_formula_cannot_judge(tmp_path, args, needle):
    res = CliRunner().invoke(main, ["check", *[str(tmp_path / a) if a in ("OUT",) else a
                                               for a in args]])
    assert res.exit_code == 2 and needle in res.output, res.output


def _sampled_check(folder, spec: str, k: int, *more) -> tuple[int, str]:
    res = CliRunner().invoke(main, ["check", "--inputs", spec, "--sample", str(k), *more,
                                    str(folder)])
    return res.exit_code, res.output


def test_a_reduce_scatter_of_uneven_chunks_is_sampled_alike_near_their_size(tmp_path):
    # chunks of 201 and 200 elements: 199 of each, the same number on every rank
    ins = inputs("exact", np.float32, 5, 1003, seed=11)
    write_world(tmp_path / "out", expected_outputs("reduce_scatter", ins, algorithm="ring"))
    for k in (199, 1000):
        code, out = _sampled_check(tmp_path / "out", "exact:seed=11,p=5,count=1003", k,
                                   "--collective", "reduce_scatter")
        assert code == 0, out
        assert f"sampled {min(k, 200)} elements of each of 5 ranks' chunks" in out, out


def test_a_sample_judges_the_outputs_shapes_and_folder_as_the_full_check(tmp_path):
    spec = "exact:seed=7,p=4,count=1003"
    outs = expected_outputs("allreduce", inputs("exact", np.float32, 4, 1003, seed=7),
                            algorithm="ring")
    longer = [np.concatenate([o, o[:5]]) if r == 1 else o for r, o in enumerate(outs)]
    write_world(tmp_path / "longer", longer)
    write_world(tmp_path / "more", outs + [outs[0]])
    write_world(tmp_path / "out", outs)
    cases = [("longer", spec, 1, "rank 1: float32 shaped (1008,), expected float32 shaped"),
             ("out", "exact:seed=7,p=4,count=1000", 1, "shaped (1003,), expected"),
             ("out", "exact:seed=7,p=4,count=0", 1, "shapes and dtypes"),
             ("more", spec, 2, "says p = 5, but the inputs have 4 ranks"),
             ("out", "exact:seed=7,p=99999999999999999999,count=10", 2,
              "at most 2147483647 ranks")]
    for folder, text, want, needle in cases:
        for k in ([] if want == 2 and "99999" in text else [None]) + [50]:
            args = ["check", "--inputs", text, str(tmp_path / folder)]
            res = CliRunner().invoke(main, args + (["--sample", str(k)] if k else []))
            assert res.exit_code == want and needle in res.output, (folder, text, k, res.output)


def test_a_sample_reaches_the_end_of_the_outputs(tmp_path):
    # every rank's last quarter off by one: the sample must see it, as the full check does
    outs = expected_outputs("allreduce", inputs("exact", np.float32, 4, 100003, seed=7),
                            algorithm="ring")
    for o in outs:
        o[75000:100002] += 1
    write_world(tmp_path / "bad", outs)
    code, out = _sampled_check(tmp_path / "bad", "exact:seed=7,p=4,count=100003", 400)
    assert code == 1 and "verdict: not conforming" in out, out


def test_a_reduce_sample_says_it_read_the_root_alone(tmp_path):
    outs = expected_outputs("reduce", inputs("exact", np.float32, 4, 1003, seed=7),
                            algorithm="naive", root=2)
    write_world(tmp_path / "out", outs)
    code, out = _sampled_check(tmp_path / "out", "exact:seed=7,p=4,count=1003", 50,
                               "--collective", "reduce", "--root", "2")
    assert code == 0 and "50 of 1003 elements of the root's output (rank 2, of 4)" in out, out
    bare = tmp_path / "bare"  # no meta.json: the type is the root file's header's
    bare.mkdir()
    np.save(bare / "rank2.npy", outs[2])
    np.save(bare / "rank0.npy", np.zeros(3))  # undefined, and float64: never read
    for more in ([], ["--sample", "50"]):
        res = CliRunner().invoke(main, ["check", "--inputs", "exact:seed=7,p=4,count=1003",
                                        *more, "--collective", "reduce", "--root", "2",
                                        str(bare)])
        assert res.exit_code == 0, res.output


@pytest.mark.parametrize("kind, dtype", [("adversarial", "float32"), ("exact", "bfloat16"),
                                         ("exact", "int32")])
def test_gen_inputs_formula_writes_what_check_inputs_makes_again(tmp_path, kind, dtype):
    from refcoll.verify.rankfiles import load_case

    res = CliRunner().invoke(main, ["gen-inputs", "-p", "3", "--count", "1001", "--kind", kind,
                                    "--dtype", dtype, "--seed", "5", "--formula",
                                    str(tmp_path / "in")])
    spec = f"{kind}:seed=5,p=3,count=1001,dtype={dtype}"
    assert res.exit_code == 0 and f"--inputs {spec}" in res.output, res.output
    written, _, meta = load_case(tmp_path / "in")
    made = inputs(kind, dtype, 3, 1001, seed=5)
    assert all(w.tobytes() == m.tobytes() for w, m in zip(written, made))
    assert meta["inputs"] == spec


def test_gen_inputs_formula_refuses_what_the_formula_does_not_make(tmp_path):
    for more, needle in ((["--kind", "random"], "--formula makes the kinds"),
                         (["--kind", "exact", "--op", "max"], "--formula makes the kinds"),
                         (["--kind", "adversarial", "--dtype", "int32"], "use exact")):
        res = CliRunner().invoke(main, ["gen-inputs", "-p", "2", "--count", "4", *more,
                                        "--formula", str(tmp_path / "x")])
        assert res.exit_code == 2 and needle in res.output, res.output
        assert not (tmp_path / "x").exists()
