"""The reader's path of a blocking all-reduce: few files, and the same functions every call.

``benchmarks/reader_path.py`` traces calls 1, 2, 3 and 50 of
``refcoll.allreduce(x, comm, algorithm="ring", out=out)`` on the same buffers
(validated, float32[1000], 2 ranks under ``mpiexec``). After the first call, a
reader who follows the call opens at most 10 of refcoll's files, at most 5
before the algorithm's own, and calls 3 and 50 run the very functions call 2
runs: a blocking call keeps nothing behind the reader's back. Structure only,
never timing.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import mpiexec_path

MPIEXEC = mpiexec_path()
ROOT = Path(__file__).resolve().parent.parent

#: The most refcoll files a warm blocking call may run functions in, and before ring.py.
MOST_FILES, MOST_BEFORE = 10, 5


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec: pip install 'refcoll[mpi]'")
@pytest.mark.parametrize("validate", [True, False], ids=["validated", "validate=False"])
def test_a_warm_blocking_call_reads_short_and_keeps_nothing(validate):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("REFCOLL_DEBUG", None)
    args = [] if validate else ["--no-validate"]
    res = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(ROOT / "benchmarks" /
                                                                 "reader_path.py"), *args],
                         capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    calls = {int(m[1]): (int(m[2]), m[3], m[4]) for m in re.finditer(
        r"^call (\d+): (\d+) files, (\w+) before algorithms/ring\.py(?:; (.*))?$", res.stdout,
        re.MULTILINE)}
    assert sorted(calls) == [1, 2, 3, 50], res.stdout
    for call in (2, 3, 50):
        files, before, same = calls[call]
        assert files <= MOST_FILES, res.stdout
        assert before != "None" and int(before) <= MOST_BEFORE, res.stdout
        assert same == "the same functions as call 2", res.stdout
