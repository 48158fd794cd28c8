"""The DDP and FSDP2 digits examples on the "refcoll" backend: every loss replayed bit for bit.

Both examples run briefly (one epoch) with ``--backend refcoll`` on three
processes under mpiexec, where orders matter (at two ranks a sum of two is one
addition), and against a Gloo group of the same processes; the figures they
print are read back here. Two and four processes, and torchrun, run with ``-m slow``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT, mpiexec_path

pytest.importorskip("torch", reason="the examples need torch: pip install 'refcoll[torch]'")
pytest.importorskip("sklearn", reason="the examples need scikit-learn: pip install "
                                      "'refcoll[examples]'")

DDP = str(ROOT / "examples" / "ddp_digits.py")
FSDP = str(ROOT / "examples" / "fsdp_digits.py")
SLOW = pytest.mark.slow
#: The step-1 comparison's line: max |difference|, within or OUTSIDE, the worst element's ratio.
BOUND = re.compile(r"step-1 averaged gradients.*: max \|difference\| (\S+), (within|OUTSIDE) "
                   r"the bound .* \(worst element at (\S+) of its bound\)")


def run(launcher: str, p: int, *args: str) -> str:
    """Run ``python ARGS`` in ``p`` processes; return its stdout (it must exit 0)."""
    if launcher == "mpiexec":
        if mpiexec_path() is None:
            pytest.skip("no mpiexec: pip install 'refcoll[mpi]'")
        pytest.importorskip("mpi4py")
        cmd = [mpiexec_path(), "-n", str(p), sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={p}", *args]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "PMIX_", "MASTER_", "RANK", "WORLD_SIZE",
                                "LOCAL_RANK", "REFCOLL_"))}
    env.update(OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert res.returncode == 0, f"{cmd} failed:\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    assert "all checks passed" in res.stdout, res.stdout
    return res.stdout


def epoch_steps(p: int) -> int:
    """Return the steps of one epoch at ``p`` ranks and the examples' 32 rows a step."""
    from refcoll.training.train import load_digits_split

    return (len(load_digits_split()[0]) // p) // 32


def bound_holds(out: str, count: int = 1) -> list[float]:
    """Return the step-1 comparisons' differences; each must be within its bound."""
    found = BOUND.findall(out)
    assert len(found) >= count, out
    for diff, where, ratio in found:
        assert where == "within" and 0 <= float(ratio) <= 1, (diff, where, ratio)
    return [float(diff) for diff, _, _ in found]


def fsdp(launcher: str, p: int) -> None:
    out = run(launcher, p, FSDP, "--epochs", "1", "--against", "gloo")
    assert f"FSDP2 on digits: {p} processes ({launcher}), backend refcoll (reduce_scatter: " \
           "ring)" in out
    steps = epoch_steps(p)
    m = re.search(r"bit check \(replay on (\d+) simulated ranks\): pass \((\d+) steps x (\d+) "
                  r"ranks, bit for bit\); step-1 sharded gradients pass; final parameters pass; "
                  r"replay digest (\w+)", out)
    assert m and int(m[1]) == int(m[3]) == p and int(m[2]) == steps, out
    assert re.search(r"^losses: digest (\w+),", out, re.M)[1] == m[4]  # the run's, the replay's
    accuracy = float(re.search(r"^test accuracy (\d+\.\d+)%", out, re.M)[1])
    assert 10 < accuracy <= 100  # better than guessing one of 10
    bound_holds(out)


def ddp(launcher: str, p: int, *hooks: str) -> None:
    out = run(launcher, p, DDP, "--epochs", "1", "--backend", "refcoll", *hooks)
    assert f"DDP on digits: {p} processes ({launcher}), refcoll (REFCOLL_ALGO ring)" in out
    rows = {line.split()[0]: line for line in out.splitlines()
            if re.match(r"^\S+\s+\d+\.\d+%", line)}
    assert "default" in rows and "default@gloo" in rows, out
    steps = epoch_steps(p)
    assert re.search(rf"losses pass \({steps} steps x {p} ranks, bit for bit\); final "
                     r"parameters pass \(buckets first/last step: \d+/\d+", rows["default"])
    assert "n/a (Gloo's code)" in rows["default@gloo"]
    for name, line in rows.items():
        assert 10 < float(re.search(r"(\d+\.\d+)%", line)[1]) <= 100, line
        if name not in ("default", "default@gloo"):
            assert re.search(r"pass \(\d+ buckets\)$", line), line
    # default (refcoll) vs default@gloo, and (with every hook) ring vs default
    bound_holds(out, 2 if len(rows) > 2 else 1)


def test_fsdp_example_replayed_bit_for_bit_at_three_ranks():
    fsdp("mpiexec", 3)


def test_ddp_example_every_hook_on_the_refcoll_backend_at_three_ranks():
    ddp("mpiexec", 3)


@SLOW
@pytest.mark.parametrize("launcher,p", [("mpiexec", 2), ("mpiexec", 4), ("torchrun", 2),
                                        ("torchrun", 3)])
def test_fsdp_example_at_other_sizes(launcher, p):
    fsdp(launcher, p)


@SLOW
@pytest.mark.parametrize("launcher,p", [("mpiexec", 2), ("mpiexec", 4), ("torchrun", 3)])
def test_ddp_example_default_hook_at_other_sizes(launcher, p):
    ddp(launcher, p, "--hook", "default")
