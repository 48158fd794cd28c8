"""The conformance battery over the torch transport (Gloo), in every process of the job.

The default run takes the fewest cases that keep every class of the battery (each
call's ops, sizes and modes, each algorithm's dtypes and input kinds), each with
its non-blocking twin; ``-m slow`` runs every case. The verdicts are the MPI
battery's: bits equal to the simulator's, on every rank.
"""

import pytest
from conftest import classes, fewest_covering
from torch_job import transport  # noqa: F401 - the fixture

from refcoll.verify.conformance import build_cases, run_battery


def _failures(transport, cases) -> list[str]:
    return [f"{r.case.id}: {r.reason}" for r in run_battery(transport, cases) if not r.passed]


def test_battery_covering_every_class(transport):
    cases = build_cases(transport.size)
    chosen = fewest_covering(cases)
    assert classes(chosen) == classes(cases)
    failures = _failures(transport, chosen)
    assert not failures, "\n".join(failures[:10])


@pytest.mark.slow
def test_battery_every_case(transport):
    failures = _failures(transport, build_cases(transport.size))
    assert not failures, "\n".join(failures[:10])
