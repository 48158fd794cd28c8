"""``refcoll verify --backend torch``: torch's own collectives judged by the oracle.

The verdicts are held to wrong results they must catch (a rank's contribution
dropped or counted twice, a rank that disagrees, an exact input answered
inexactly); one real run under ``mpiexec -n 2`` must check cases and pass them;
what does not apply to torch's collectives is bad usage.
"""

import json
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import mpiexec_path

import refcoll
from refcoll.cli import launch, main
from refcoll.core.errors import UsageError
from refcoll.torch import judge
from refcoll.verify.conformance import Case
from refcoll.verify.inputs import make_inputs
from refcoll.verify.oracle import fold


def _case(collective="allreduce", op="sum", dtype="float32", count=11, kind="exact", p=3):
    return Case("gloo", collective, op, dtype, count, True, kind, 0, (), p, p)


@pytest.mark.parametrize("kind", ["exact", "random"])
def test_a_dropped_contribution_fails(kind):
    inputs = make_inputs(kind, np.float32, 11, 3, op="sum")
    without_rank_1 = fold("sum", [inputs[0], inputs[2]])
    found = judge.verdict(_case(kind=kind), inputs, [without_rank_1] * 3)
    assert found["problems"] and found["same_bits"] is None
    if kind == "exact":  # exact inputs name the culprit
        assert any("rank 1's contribution is missing" in p for p in found["problems"])
    else:
        assert any(p.startswith("within the error bound") for p in found["problems"])


def test_ranks_that_disagree_fail_even_within_the_bound():
    inputs = make_inputs("random", np.float32, 11, 3, op="sum")
    outputs = [o.copy() for o in refcoll.simulate("allreduce", inputs, algorithm="ring").outputs]
    outputs[2][4] = np.nextafter(outputs[2][4], np.float32(np.inf))  # one ulp, inside the bound
    found = judge.verdict(_case(kind="random"), inputs, outputs)
    assert any(p.startswith("identical on every rank: ranks [2] differ") for p in found["problems"])


def test_exact_inputs_must_give_the_exact_bits():
    inputs = make_inputs("exact", np.float32, 12, 3, op="prod")
    chunks = [fold("prod", inputs)[r * 4:(r + 1) * 4].copy() for r in range(3)]
    chunks[1][2] = np.nextafter(chunks[1][2], np.float32(np.inf))  # within the bound, not exact
    found = judge.verdict(_case(collective="reduce_scatter", op="prod", count=12), inputs, chunks)
    # A product every order gives exactly: the oracle judges it bit for bit, once.
    assert len(found["problems"]) == 1, found["problems"]
    assert found["problems"][0].startswith("exact (a product every order gives exactly): rank 1's "
                                           "output element 2 (global element 6) is ")


def test_a_right_result_passes_and_names_the_order_it_matches():
    inputs = make_inputs("random", np.float32, 11, 3, op="sum")
    outputs = refcoll.simulate("allreduce", inputs, algorithm="ring").outputs
    found = judge.verdict(_case(kind="random"), inputs, outputs)
    assert found["problems"] == [] and "ring" in found["same_bits"]
    assert "naive" not in found["same_bits"]  # 3 random floats: the orders differ


def test_reduce_scatter_pads_a_count_p_does_not_divide_and_in_place_only_calls_say_so():
    cases = judge.build_cases(4, "gloo", collectives=["reduce_scatter", "allreduce"],
                              ops=["sum"], dtypes=["int32"], sizes=[5])
    assert {(c.collective, c.inplace) for c in cases} == {
        ("reduce_scatter", False), ("reduce_scatter", True), ("allreduce", True)}
    assert judge._output_count(cases[0]) == 2
    assert judge._input(cases[0], 1, 0)[5:].tolist() == [0] * 3
    with pytest.raises(UsageError, match="work in place only"):
        judge.build_cases(2, "gloo", collectives=["allreduce", "broadcast"], inplace=(False,),
                          allow_empty=False)


@pytest.fixture
def one_rank_group():
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    created = not dist.is_initialized()
    refcoll.torch.init_process_group("gloo")
    yield torch, dist
    if created:
        dist.destroy_process_group()


def test_a_collective_that_counts_a_contribution_twice_fails_in_a_real_run(one_rank_group,
                                                                             monkeypatch):
    torch, dist = one_rank_group
    real = dist.all_reduce

    def twice(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        real(tensor, op=op, group=group)
        tensor.mul_(2)  # every element: this rank's input counted twice

    monkeypatch.setattr(dist, "all_reduce", twice)
    report = judge.judge_collectives(collectives=["allreduce"], ops=["sum"],
                                     dtypes=["float32", "int16"], sizes=[6])
    assert report.failed == len(report.results) == 2 and report.passed == 0
    exact = next(r for r in report.results if r.case.kind == "exact")
    assert "rank 0's contribution is counted twice" in exact.reason
    assert [(u["dtype"], u["reason"]) for u in report.unsupported] == [
        ("int16", "RuntimeError: Invalid scalar type")]


def _clean_env(monkeypatch):
    for var in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS",
                "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("args,message", [
    (["--compressor", "topk:ratio=0.1"], "drop --compressor"),
    (["--algorithm", "ring"], "drop --algorithm"),
    (["--collective", "allreduce,reduce", "--inplace", "no"], "work in place only"),
    (["--collective", "alltoall"], "unknown collective 'alltoall'"),
])
def test_what_does_not_apply_to_torch_is_bad_usage(monkeypatch, args, message):
    _clean_env(monkeypatch)
    monkeypatch.setattr(judge, "_torch_installed", lambda: True)  # these hold without torch too
    res = CliRunner().invoke(main, ["verify", "--backend", "torch", "-n", "2", *args])
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and message in lines[0], res.output


def test_without_torch_the_backend_says_how_to_install_it(monkeypatch):
    _clean_env(monkeypatch)
    monkeypatch.setattr(judge, "_torch_installed", lambda: False)
    res = CliRunner().invoke(main, ["verify", "--backend", "torch", "-n", "2"])
    assert res.exit_code == 2 and "pip install 'refcoll[torch]'" in res.output


def test_torchrun_is_a_job_for_the_torch_backend(monkeypatch):
    _clean_env(monkeypatch)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(judge, "_torch_installed", lambda: True)
    ran = []
    monkeypatch.setattr("refcoll.cli.commands.relaunch", lambda *a, **k: pytest.fail("relaunched"))
    monkeypatch.setattr("refcoll.cli.commands._verify_library_in_world",
                        lambda make, nprocs, filters, *rest: ran.append(filters["dtypes"]))
    res = CliRunner().invoke(main, ["verify", "--backend", "torch", "--dtype", "int8"])
    assert res.exit_code == 0 and ran == [["int8"]], res.output
    assert launch.in_torchrun() and not launch.in_mpi_job()


@pytest.mark.skipif(mpiexec_path() is None, reason="no mpiexec: pip install 'refcoll[mpi]'")
def test_gloo_passes_a_small_battery_under_mpiexec(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "torch.json"
    res = subprocess.run(
        [sys.executable, "-m", "refcoll", "verify", "--backend", "torch", "-n", "2",
         "--sizes", "5", "--dtype", "float32,int32", "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(out.read_text())
    assert res.stdout.strip().splitlines()[-1] == f"{data['passed']} passed, 0 failed"
    assert data["torch_backend"] == "gloo" and data["world_size"] == 2
    assert data["torch"] in res.stdout.splitlines()[0]
    assert data["passed"] == len(data["cases"]) > 40
    assert {c["collective"] for c in data["cases"]} == set(judge.TORCH_CALLS)
    # Gloo's AVG divides in float: refused on int32, listed, not failed.
    assert {(u["call"], u["op"], u["dtype"]) for u in data["unsupported"]} == {
        ("all_reduce", "avg", "int32"), ("reduce_scatter_tensor", "avg", "int32"),
        ("reduce", "avg", "int32")}
