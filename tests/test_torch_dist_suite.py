"""PyTorch's own backend conformance suite against the "refcoll" backend.

The suite is ``torch.testing._internal.distributed.distributed_test`` (the tests
upstream runs for Gloo and NCCL); ``benchmarks/torch_backend_suite.py`` runs it
for a backend and writes each test's outcome. The default run takes a covering
selection, one or two tests per collective family, and asserts refcoll passes
each. The slow runs take the whole suite at 2 and 3 processes, for Gloo and for
refcoll, and assert that refcoll passes every test Gloo passes but the known
exceptions below, each with its reason.

The suite decides its skips from backend names: on CPU it runs ``all_to_all``
for MPI only, a few tests (``get_future``, the coalesced all-reduce...) for
Gloo only and its subgroup tests at 8 processes or more but for MPI.
``--gates-as`` runs those on refcoll as if it were that backend.
It has no CPU test of ``reduce_scatter`` or ``all_gather_into_tensor`` (only
CUDA ones), so those two are checked here directly on two processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the torch suite needs torch: pip install "
                                            "'refcoll[torch]'")
pytest.importorskip("expecttest", reason="torch's distributed test suite needs expecttest: "
                                         "pip install expecttest")

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "benchmarks" / "torch_backend_suite.py"

#: A bound on a whole run, against a hang only (the runner bounds each test as well).
HANG_S = 3600

#: The covering selection: (world size, --gates-as, {family: tests}).
COVERING = [
    (2, None, {
        "all_reduce": ["test_all_reduce_sum", "test_all_reduce_sum_async"],
        "reduce": ["test_reduce_sum", "test_reduce_max"],
        "broadcast": ["test_broadcast"],
        "all_gather": ["test_all_gather", "test_all_gather_coalesced_with_empty"],
        "gather": ["test_gather", "test_gather_checks"],
        "scatter": ["test_scatter", "test_scatter_checks"],
        "barrier": ["test_barrier"],
        "send/recv": ["test_send_recv", "test_send_recv_any_source"],
        "new_group": ["test_all_reduce_full_group_sum", "test_broadcast_full_group"],
        "DDP": ["test_DistributedDataParallelCPU", "test_ddp_create_graph"],
    }),
    (2, "gloo", {  # the suite runs these on Gloo only
        "all_reduce_coalesced": ["test_all_reduce_coalesced_sum"],
        "get_future": ["test_get_future", "test_accumulate_gradients_no_sync_allreduce_hook"],
    }),
    (2, "mpi", {  # ... and these on MPI only
        "all_to_all": ["test_all_to_all", "test_all_to_all_single_unequal_split"],
    }),
    # A group of ranks 1 and 2: the suite runs these at 8 processes or more but
    # for MPI, which runs them at 3.
    (3, "mpi", {
        "subgroups": ["test_all_reduce_group_sum", "test_barrier_group"],
    }),
]

#: Tests Gloo passes and refcoll does not, whole-suite runs, by world size: why.
KNOWN = {
    "test_all_reduce_coalesced_sum": "the suite runs it on Gloo only "
                                     "(require_backend_is_available({'gloo'}))",
    "test_all_reduce_coalesced_product": "the suite runs it on Gloo only",
    "test_all_reduce_coalesced_min": "the suite runs it on Gloo only",
    "test_all_reduce_coalesced_max": "the suite runs it on Gloo only",
    "test_all_reduce_coalesced_full_group_sum": "the suite runs it on Gloo only",
    "test_all_reduce_coalesced_full_group_product": "the suite runs it on Gloo only",
    "test_all_reduce_coalesced_full_group_min": "the suite runs it on Gloo only",
    "test_all_reduce_coalesced_full_group_max": "the suite runs it on Gloo only",
    "test_all_reduce_coalesced_group_sum": "the suite runs it on Gloo only",
    "test_all_reduce_coalesced_group_product": "the suite runs it on Gloo only",
    "test_all_reduce_coalesced_group_min": "the suite runs it on Gloo only",
    "test_all_reduce_coalesced_group_max": "the suite runs it on Gloo only",
    "test_grads_same_across_ranks_with_no_sync": "the suite runs it on Gloo only",
    "test_scatter_object_list": "the suite runs it on Gloo only",
    "test_all_gather_object_default_pg": "the suite runs it on Gloo, NCCL and UCC only",
    "test_all_gather_object_subgroup": "the suite runs it on Gloo, NCCL and UCC only",
    "test_get_future": "the suite runs it on MPI, NCCL and Gloo only",
    "test_accumulate_gradients_no_sync": "the suite runs it on MPI, NCCL and Gloo only "
                                         "(get_future)",
    "test_accumulate_gradients_no_sync_allreduce_hook": "get_future: MPI, NCCL, Gloo only",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook": "get_future: MPI, NCCL, "
                                                                  "Gloo only",
    "test_accumulate_gradients_no_sync_grad_is_view": "get_future: MPI, NCCL, Gloo only",
    "test_barrier_timeout_full_group": "the suite runs it on Gloo only ('Only gloo backend "
                                       "supports timeouts')",
    "test_barrier_timeout_group": "the suite runs it on Gloo only",
    "test_barrier_timeout_global": "the suite runs it on Gloo only",
    "test_batch_isend_irecv_gloo": "the suite runs it on Gloo only",
    "test_batch_isend_irecv_gloo_tags": "the suite runs it on Gloo only",
    "test_monitored_barrier_gloo": "dist.monitored_barrier is Gloo-only in torch's Python "
                                   "code (and the suite runs it on Gloo only)",
    "test_monitored_barrier_gloo_rank_0_timeout": "monitored_barrier: Gloo only in torch",
    "test_monitored_barrier_gloo_subgroup": "monitored_barrier: Gloo only in torch",
    "test_monitored_barrier_wait_all_ranks": "monitored_barrier: Gloo only in torch",
    "test_monitored_barrier_failure_order": "monitored_barrier: Gloo only in torch",
    "test_monitored_barrier_allreduce_hang": "monitored_barrier: Gloo only in torch",
    "test_monitored_barrier_allreduce_hang_wait_all_ranks": "monitored_barrier: Gloo only",
    "test_sparse_all_reduce_sum": "sparse tensors: refcoll's all-reduce takes dense tensors "
                                  "(and the suite runs it on Gloo only)",
}


#: The same, with the suite's backend-name skips decided as for Gloo (``--gates-as gloo``).
KNOWN_AS_GLOO = {
    "test_get_backend": "the suite expects dist.get_backend() to be the name it was told, gloo",
    **{name: why for name, why in KNOWN.items() if "monitored_barrier" in why},
    "test_sparse_all_reduce_sum": "sparse tensors: refcoll's all-reduce takes dense tensors",
}


def suite(tmp_path, backend: str, world_size: int, names=(), gates_as=None) -> dict:
    """Run the suite (``names``: these tests only) and return the runner's record."""
    out = tmp_path / f"{backend}-{world_size}-{gates_as or 'own'}.json"
    cmd = [sys.executable, str(RUNNER), "run", "--backend", backend,
           "--world-size", str(world_size), "--json", str(out)]
    cmd += [arg for name in names for arg in ("--test", name)]
    if gates_as:
        cmd += ["--gates-as", gates_as]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=HANG_S)
    assert out.exists(), (f"the runner wrote no record:\n{done.stdout[-4000:]}\n"
                          f"{done.stderr[-4000:]}")
    record = json.loads(out.read_text())
    assert not record["errors"], record["errors"]
    return record


def failures(record: dict, names) -> list:
    """The named tests that did not pass, each with its outcome and reason."""
    tests = record["tests"]
    return [f"{name}: {tests.get(name, {}).get('outcome', 'not run')}: "
            f"{tests.get(name, {}).get('reason', '')}"
            for name in names if tests.get(name, {}).get("outcome") != "passed"]


@pytest.mark.parametrize("world_size,gates_as,families", COVERING,
                         ids=[f"{p}-{g or 'own'}" for p, g, _ in COVERING])
def test_refcoll_passes_a_covering_selection(tmp_path, world_size, gates_as, families):
    names = [name for tests in families.values() for name in tests]
    record = suite(tmp_path, "refcoll", world_size, names, gates_as)
    assert not failures(record, names), "\n".join(failures(record, names))


CHECK = textwrap.dedent("""
    import sys
    import torch
    import torch.distributed as dist
    import refcoll.torch  # noqa: F401 - registers "refcoll"

    rank, p, init = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("refcoll", init_method=init, rank=rank, world_size=p)
    x = torch.arange(4 * p, dtype=torch.float32) + 100 * rank
    total = sum(torch.arange(4 * p, dtype=torch.float32) + 100 * r for r in range(p))
    mine = total[4 * rank:4 * rank + 4]

    out = torch.empty(4)
    dist.reduce_scatter_tensor(out, x)
    assert torch.equal(out, mine), ("reduce_scatter_tensor", out, mine)
    out = torch.empty(4)
    dist.reduce_scatter(out, list(x.chunk(p)))
    assert torch.equal(out, mine), ("reduce_scatter", out, mine)
    work = dist.reduce_scatter_tensor(out, x * 2, async_op=True)
    work.wait()
    assert torch.equal(out, 2 * mine), ("reduce_scatter_tensor async", out)

    y = torch.full((3,), float(rank))
    whole = torch.empty(3 * p)
    dist.all_gather_into_tensor(whole, y)
    want = torch.arange(p, dtype=torch.float32).repeat_interleave(3)
    assert torch.equal(whole, want), ("all_gather_into_tensor", whole)
    rows = torch.empty(p, 3)
    dist.all_gather_into_tensor(rows, y)
    assert torch.equal(rows.flatten(), want), ("all_gather_into_tensor 2-D", rows)
    dist.destroy_process_group()
""")


@pytest.mark.parametrize("world_size", [2])
def test_reduce_scatter_and_all_gather_into_tensor(tmp_path, world_size):
    """The two collectives the suite tests on CUDA only, on CPU processes of refcoll."""
    init = f"file://{tmp_path / 'init'}"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    ranks = [subprocess.Popen([sys.executable, "-c", CHECK, str(r), str(world_size), init],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for r in range(world_size)]
    outputs = [rank.communicate(timeout=HANG_S)[0] for rank in ranks]
    for r, (rank, output) in enumerate(zip(ranks, outputs)):
        assert rank.returncode == 0, f"rank {r}:\n{output[-4000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("world_size,gates_as", [(2, None), (3, None), (2, "gloo"), (3, "gloo")])
def test_refcoll_passes_what_gloo_passes(tmp_path, world_size, gates_as):
    """The whole suite: every test Gloo passes, refcoll passes, but the known exceptions.

    ``gates_as="gloo"``: the suite's Gloo-only tests too, on refcoll.
    """
    gloo = suite(tmp_path, "gloo", world_size)
    ours = suite(tmp_path, "refcoll", world_size, gates_as=gates_as)
    known = KNOWN_AS_GLOO if gates_as else KNOWN
    missing = failures(ours, sorted(n for n, e in gloo["tests"].items()
                                    if e["outcome"] == "passed"))
    unexplained = [line for line in missing if line.split(":", 1)[0] not in known]
    assert not unexplained, "\n".join(unexplained)
