"""Forcing the MPI library's algorithm: names, refusals, environments, and MPICH honouring them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT, mpiexec_path

from refcoll.algorithms.registry import COLLECTIVES, REGISTRY
from refcoll.baselines import mpi_algorithms as ma
from refcoll.core.errors import UsageError

# MPI_Get_library_version's first line in each library (as they print it).
VERSIONS = {
    "MPICH Version:      5.0.2\nMPICH Release date: Fri Sep 25 2026\nMPICH Device: ch4": "mpich",
    "MPICH Version:\t3.3.2\nMPICH Release date:\tTue Nov 12 21:23:16 CST 2019": "mpich",
    "Open MPI v5.0.3, package: Open MPI Distribution, ident: 5.0.3, repo rev: v5.0.3": "openmpi",
    "Open MPI v4.1.2, package: Debian OpenMPI, ident: 4.1.2, repo rev: v4.1.2": "openmpi",
    "Intel(R) MPI Library 2021.10 for Linux* OS": "unknown",
    "MVAPICH Version:      3.0\nMVAPICH Release date: 2024": "unknown",
    "MVAPICH2 Version:     2.3.7\nMVAPICH2 Release date: Wed March 02 2022": "unknown",
    "MPI VERSION    : CRAY MPICH version 8.1.28.29 (ANL base 3.4a2)\nMPI BUILD INFO": "unknown",
    "Microsoft MPI 10.1.12498.18": "unknown",
    "MPICH Version:      4.2.0\nMPICH CC:  icx -O2\nMPICH configure: --prefix=/opt/intel": "mpich",
    "": "unknown",
}


@pytest.mark.parametrize("text", list(VERSIONS))
def test_library_of_names_only_the_libraries_whose_variables_it_sets(text):
    assert ma.library_of(text) == VERSIONS[text]


def test_every_collective_has_names_in_both_libraries():
    for library in ma.LIBRARIES:
        for collective in COLLECTIVES:
            names = ma.algorithm_names(library, collective)
            assert len(names) == len(set(names)) >= 5
            assert names[0] == ("auto" if library == "mpich" else "ignore")


def test_mpich_environment_is_its_intra_cvar_with_the_name():
    assert ma.forced_env("mpich", "allreduce", "ring") == {
        "MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": "ring"}
    # refcoll's reduce_scatter is timed against MPI_Reduce_scatter_block: its own variable.
    assert ma.forced_env("mpich", "reduce_scatter", "Recursive-Halving") == {
        "MPIR_CVAR_REDUCE_SCATTER_BLOCK_INTRA_ALGORITHM": "recursive_halving"}
    assert ma.forced_env("mpich", "broadcast", "binomial") == {
        "MPIR_CVAR_BCAST_INTRA_ALGORITHM": "binomial"}
    assert ma.forced_env("mpich", "allgather", "brucks", fallback="print") == {
        "MPIR_CVAR_ALLGATHER_INTRA_ALGORITHM": "brucks", "MPIR_CVAR_COLLECTIVE_FALLBACK": "print"}


def test_open_mpi_environment_is_coll_tuned_dynamic_rules_and_the_number():
    assert ma.forced_env("openmpi", "allreduce", "ring") == {
        "OMPI_MCA_coll_tuned_use_dynamic_rules": "1",
        "OMPI_MCA_coll_tuned_allreduce_algorithm": "4"}
    assert ma.forced_env("openmpi", "allreduce", "RABENSEIFNER")[
        "OMPI_MCA_coll_tuned_allreduce_algorithm"] == "6"
    assert ma.forced_env("openmpi", "allreduce", "segmented_ring")[
        "OMPI_MCA_coll_tuned_allreduce_algorithm"] == "5"
    assert ma.forced_env("openmpi", "allreduce", "nonoverlapping")[
        "OMPI_MCA_coll_tuned_allreduce_algorithm"] == "2"
    assert ma.forced_env("openmpi", "allreduce", 3)[
        "OMPI_MCA_coll_tuned_allreduce_algorithm"] == "3"
    assert ma.forced_env("openmpi", "reduce_scatter", "recursive_halving") == {
        "OMPI_MCA_coll_tuned_use_dynamic_rules": "1",
        "OMPI_MCA_coll_tuned_reduce_scatter_block_algorithm": "3"}
    assert ma.forced_env("openmpi", "broadcast", "binomial")[
        "OMPI_MCA_coll_tuned_bcast_algorithm"] == "6"
    assert ma.forced_env("openmpi", "reduce", "in_order_binary")[
        "OMPI_MCA_coll_tuned_reduce_algorithm"] == "6"
    assert ma.forced_env("openmpi", "allgather", "bruck")[
        "OMPI_MCA_coll_tuned_allgather_algorithm"] == "2"


def test_open_mpi_numbers_are_positions_in_its_enum():
    for collective in COLLECTIVES:
        names = ma.algorithm_names("openmpi", collective)
        variable = ma.variable_of("openmpi", collective)
        for number, name in enumerate(names):
            assert ma.forced_env("openmpi", collective, name)[variable] == str(number)
            assert ma.forced_env("openmpi", collective, str(number))[variable] == str(number)


@pytest.mark.parametrize("library, collective, name, says", [
    ("mpich", "allreduce", "foo",
     "MPICH 5.0 has no allreduce algorithm 'foo'; it has: auto, nb, smp"),
    ("mpich", "allreduce", "rabenseifner", "reduce_scatter_allgather"),
    ("mpich", "broadcast", "ring", "scatter_ring_allgather"),
    ("openmpi", "allreduce", "8", "Open MPI has no allreduce algorithm '8'; it has: ignore (0)"),
    ("openmpi", "allgather", "brucks", "bruck (2)"),
    ("unknown", "allreduce", "ring", "MPICH 5.0 and Open MPI only"),
    ("mpich", "scan", "ring", "the collectives are allreduce, reduce_scatter"),
])
def test_refusals_name_what_the_library_has(library, collective, name, says):
    with pytest.raises(UsageError) as info:
        ma.forced_env(library, collective, name)
    assert says in str(info.value)
    assert "\n" not in str(info.value)


def test_an_unknown_library_is_named_with_its_own_knob(monkeypatch):
    monkeypatch.setattr(ma, "installed_version",
                        lambda: "Intel(R) MPI Library 2021.10 for Linux* OS\n")
    with pytest.raises(UsageError, match=r"not of Intel\(R\) MPI Library 2021.10 .*I_MPI_ADJUST"):
        ma.forced_env(ma.installed_library(), "allreduce", "ring")


def test_fallback_is_mpich_only_and_one_of_its_values():
    with pytest.raises(UsageError, match="error, print, silent"):
        ma.forced_env("mpich", "allreduce", "ring", fallback="loud")
    with pytest.raises(UsageError, match="MPIR_CVAR_COLLECTIVE_FALLBACK"):
        ma.forced_env("openmpi", "allreduce", "ring", fallback="print")


def test_missing_env_lists_what_the_launcher_did_not_set(monkeypatch):
    env = ma.forced_env("openmpi", "allreduce", "ring")
    monkeypatch.delenv("OMPI_MCA_coll_tuned_use_dynamic_rules", raising=False)
    monkeypatch.setenv("OMPI_MCA_coll_tuned_allreduce_algorithm", "6")
    assert ma.missing_env(env) == ["OMPI_MCA_coll_tuned_use_dynamic_rules",
                                   "OMPI_MCA_coll_tuned_allreduce_algorithm"]
    monkeypatch.setenv("OMPI_MCA_coll_tuned_use_dynamic_rules", "1")
    monkeypatch.setenv("OMPI_MCA_coll_tuned_allreduce_algorithm", "4")
    assert ma.missing_env(env) == []


def test_counterparts_are_real_names_on_both_sides():
    for (library, collective, name), algorithm in ma.COUNTERPARTS.items():
        assert name in ma.algorithm_names(library, collective)
        assert collective in REGISTRY[algorithm].implementations, (algorithm, collective)
        assert name in ma.counterparts_of(library, collective, algorithm)
        assert ma.counterpart(library, collective, name) == algorithm


def test_counterparts_pair_the_issues_examples():
    assert ma.counterparts_of("mpich", "allreduce", "rabenseifner") == ("reduce_scatter_allgather",)
    assert ma.counterparts_of("mpich", "allreduce", "ring") == ("ring",)
    assert ma.counterpart("mpich", "allreduce", "recursive_doubling") == "recursive_doubling"
    assert ma.counterpart("openmpi", "allreduce", "4") == "ring"
    assert ma.counterpart("mpich", "allreduce", "nb") is None


def test_installed_library_leaves_mpi_uninitialised_in_this_process():
    pytest.importorskip("mpi4py")
    code = ("import sys; from refcoll.baselines import mpi_algorithms as m; "
            "print(m.installed_library(), 'mpi4py.MPI' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, check=True)
    library, imported = done.stdout.split()
    assert library in ma.LIBRARIES + ("unknown",)
    assert imported == "False"


# One MPI job per position i: every collective's variable set to its i-th name
# (cycling), so the 11 jobs cover all of MPICH's names for the five collectives.
_JOB = textwrap.dedent("""
    import sys
    from array import array  # not NumPy: each of the 22 ranks starts faster
    from mpi4py import MPI
    c = MPI.COMM_WORLD
    p, r, n = c.size, c.rank, 12
    x = array("d", [i + r for i in range(n)])
    want = [p * i + p * (p - 1) / 2 for i in range(n)]
    y = array("d", [0.0] * n); c.Allreduce(x, y)
    assert list(y) == want, ("allreduce", y)
    z = array("d", [0.0] * (n // p)); c.Reduce_scatter_block(x, z)
    assert list(z) == want[r * n // p:(r + 1) * n // p], ("reduce_scatter", z)
    g = array("d", [0.0] * (n * p)); c.Allgather(x, g)
    assert list(g) == [i + q for q in range(p) for i in range(n)], ("allgather", g)
    b = array("d", x); c.Bcast(b, root=1)
    assert list(b) == [i + 1.0 for i in range(n)], ("broadcast", b)
    s = array("d", [0.0] * n); c.Reduce(x, s, root=0)
    assert r != 0 or list(s) == want, ("reduce", s)
    sys.stdout.write(f"ok{r}" + chr(10)); sys.stdout.flush()
""")

_MPICH_JOBS = max(len(ma.algorithm_names("mpich", c)) for c in COLLECTIVES)


def _mpich_job(env: dict, tmp_path):
    mpiexec = mpiexec_path()
    if mpiexec is None or ma.installed_library() != "mpich":
        pytest.skip("needs MPICH's mpiexec and mpi4py on MPICH")
    script = tmp_path / "job.py"
    script.write_text(_JOB)
    full = {k: v for k, v in os.environ.items() if not k.startswith("MPIR_CVAR_")}
    return subprocess.run([mpiexec, "-n", "2", sys.executable, str(script)], env={**full, **env},
                          capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize("i", range(_MPICH_JOBS))
def test_mpich_accepts_each_name_and_sums_right(i, tmp_path):
    env = {}
    for collective in COLLECTIVES:
        names = ma.algorithm_names("mpich", collective)
        env.update(ma.forced_env("mpich", collective, names[i % len(names)]))
    done = _mpich_job(env, tmp_path)
    assert done.returncode == 0, (env, done.stderr[-2000:])
    assert sorted(re.findall(r"ok(\d)", done.stdout)) == ["0", "1"], (env, done.stdout)


def test_mpich_refuses_a_name_it_does_not_have(tmp_path):
    # The check above could not fail if MPICH ignored the variable: a bad value aborts MPI_Init.
    done = _mpich_job({"MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": "Ring"}, tmp_path)
    assert done.returncode != 0 and "ok" not in done.stdout
    assert "Init" in done.stderr


def test_an_algorithm_of_one_rank_count_is_known_by_name_and_number():
    from refcoll.baselines.mpi_algorithms import ranks_needed

    assert ranks_needed("openmpi", "allgather", "two_proc") == 2
    assert ranks_needed("openmpi", "allgather", 6) == 2  # coll/tuned's number for it
    assert ranks_needed("openmpi", "allgather", "ring") is None
    assert ranks_needed("mpich", "allgather", "ring") is None
