"""PyTorch's own backend conformance suite, run against Gloo or refcoll's ``"refcoll"`` backend.

Run: python benchmarks/torch_backend_suite.py run --backend refcoll [--world-size 2]
         [-k EXPR] [--test NAME]... [--timeout 120] [--start fork|spawn]
         [--gates-as gloo|mpi] [--json FILE]
     python benchmarks/torch_backend_suite.py compare GLOO.json REFCOLL.json [--list]

``run`` runs ``torch.testing._internal.distributed.distributed_test`` (the
``DistributedTest._DistTestBase`` tests behind upstream's
``test/distributed/test_distributed_spawn.py``) under pytest, one test at a
time, each on ``--world-size`` fresh processes that start the backend with
``dist.init_process_group(BACKEND)``. ``-k`` is pytest's selection,
``--test`` a test by its exact name. Each process is forked from the runner
(``--start fork``, the default: a few seconds a test cheaper than ``spawn`` on
a small machine), after this module has imported :mod:`refcoll.torch`, so the
backend is registered in every child.

The suite reads ``BACKEND`` and ``WORLD_SIZE`` when it is imported and decides
its skips then, from sets of backend names (``DistTestCases.backend_feature``);
``"refcoll"`` is added to ``plugin`` (a registered third-party backend),
``ddp`` and ``subgroup`` (both of which refcoll serves on CPU) before the
import. The tests the suite marks ``require_backend_is_available({"gloo"})``
or gates on ``BACKEND == "gloo"`` are skipped for refcoll by the suite itself;
``--gates-as gloo`` runs them: the suite decides its skips and its branches as
for Gloo, and every rank's ``init_process_group("gloo")`` starts ``--backend``
instead (torch's own Gloo-only code, ``monitored_barrier``, still sees the
backend's real name). ``--gates-as mpi`` does the same for the tests the suite
runs on CPU for MPI only (``all_to_all``, ``all_to_all_single``).

``--timeout`` bounds each test (the suite's own bound, which kills the test's
processes and fails it; 300 s upstream); a hang costs one test, not the run.

Output: one line per test as pytest prints it, then a summary; ``--json FILE``
writes ``{"backend", "world_size", "start", "selection", "torch", "wall_s",
"summary": {"passed", "failed", "skipped", "total"}, "tests": {name: {"outcome",
"reason", "duration_s", "detail"}}}``: ``reason`` is a skip's reason or the
first line of a failure (the exception a rank raised, where one did),
``detail`` the end of the failure's report.

``compare`` prints the tests each run passed and the tests the first passes and
the second does not, each with the second's outcome and reason (``--list``:
the passing tests by name as well).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time

#: Set by ``run`` for the pytest session it starts: the module then defines the test class.
SUITE_ENV = "REFCOLL_TORCH_SUITE"

#: The backends ``run`` accepts.
BACKENDS = ("gloo", "refcoll")

# --------------------------------------------------------------- the suite (under pytest)

if os.environ.get(SUITE_ENV):
    import multiprocessing

    import torch
    import torch.distributed as dist
    from torch.testing._internal import common_distributed

    import refcoll.torch  # noqa: F401 - registers "refcoll" here, so in every forked rank

    _backend = os.environ["BACKEND"]
    # --gates-as NAME: the suite decides its skips (and its branches) as for NAME,
    # while every rank starts the named backend in NAME's place.
    _as = os.environ.get("REFCOLL_TORCH_SUITE_GATES", "")
    _as = _as if _as != _backend else ""
    if _as:
        os.environ["BACKEND"] = _as
    if _backend not in ("gloo", "nccl", "ucc", "mpi"):
        for _feature in ("plugin", "ddp", "subgroup"):
            common_distributed.DistTestCases.backend_feature[_feature].add(_backend)
    _limit = int(os.environ["DISTRIBUTED_TESTS_DEFAULT_TIMEOUT"])
    for _name in list(common_distributed.TIMEOUT_OVERRIDE):
        common_distributed.TIMEOUT_OVERRIDE[_name] = _limit

    from torch.testing._internal.distributed.distributed_test import (
        DistributedTest,
        TestDistBackend,
    )

    torch.backends.cuda.matmul.allow_tf32 = False

    class TestBackendSuite(TestDistBackend, DistributedTest._DistTestBase):
        """Every test of the base, each on ``WORLD_SIZE`` processes of ``BACKEND``."""

        def setUp(self):
            super().setUp()
            start = os.environ.get("REFCOLL_TORCH_SUITE_START", "fork")
            self._start_processes(multiprocessing.get_context(start).Process)

        @classmethod
        def _run(cls, rank, test_name, file_name, pipe, **kwargs):
            if _as:  # in this rank only: a group asked of NAME is the backend's
                start_group = dist.init_process_group

                def init_process_group(*args, backend=None, **kw):
                    backend = _backend if backend in (_as, None) else backend
                    return start_group(*args, backend=backend, **kw)
                dist.init_process_group = init_process_group
            super()._run(rank, test_name, file_name, pipe, **kwargs)



def _first_line(text: str) -> str:
    """Return the line that says why a test failed: the exception a rank raised, if reported.

    A rank's traceback comes back inside the test's own RuntimeError; its
    exception is the first unindented line after its last ``Traceback`` line.
    """
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent")]
    if starts:
        for line in lines[starts[-1] + 1:]:
            if line.strip() and not line.startswith((" ", "\t")) and line.strip("^~ "):
                return line.strip()[:400]
    for line in lines:
        if re.match(r"^E\s+\S", line):
            return line[1:].strip()[:400]
    lines = [line for line in lines if line.strip()]
    return (lines[0].strip() if lines else "")[:400]


class Recorder:
    """A pytest plugin that keeps each test's outcome, reason and duration."""

    def __init__(self):
        self.tests: dict = {}
        self.errors: list = []  # the suite could not be collected: why

    def pytest_collectreport(self, report):
        if report.failed:
            self.errors.append(_first_line(str(report.longrepr)))

    def pytest_runtest_logreport(self, report):
        name = report.nodeid.rsplit("::", 1)[-1]
        entry = self.tests.setdefault(name, {"outcome": "passed", "reason": "",
                                             "duration_s": 0.0, "detail": ""})
        entry["duration_s"] = round(entry["duration_s"] + report.duration, 3)
        if report.skipped:
            entry["outcome"] = "skipped"
            longrepr = report.longrepr
            reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
            entry["reason"] = reason.removeprefix("Skipped: ")[:400]
        elif report.failed and entry["outcome"] != "failed":
            text = str(report.longrepr)
            crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", None)
            entry["outcome"] = "failed"
            entry["reason"] = (_first_line(crash or text) if report.when == "call"
                               else f"{report.when}: {_first_line(crash or text)}")
            entry["detail"] = text[-3000:]


def summarize(tests: dict) -> dict:
    """Count the outcomes."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for entry in tests.values():
        counts[entry["outcome"]] += 1
    counts["total"] = len(tests)
    return counts


def run(backend: str, world_size: int, selection: str | None, timeout: int, start: str,
        gates_as: str | None = None, names=(), pytest_args=()) -> dict:
    """Run the suite under pytest in this process; return the record ``--json`` writes."""
    import pytest
    import torch

    os.environ.update({SUITE_ENV: "1", "BACKEND": backend, "WORLD_SIZE": str(world_size),
                       "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": str(timeout),
                       "REFCOLL_TORCH_SUITE_START": start,
                       "REFCOLL_TORCH_SUITE_GATES": gates_as or ""})
    os.environ.setdefault("TEMP_DIR", tempfile.mkdtemp(prefix="torch-backend-suite-"))
    recorder = Recorder()
    suite = f"{os.path.abspath(__file__)}::TestBackendSuite"
    args = [f"{suite}::{name}" for name in names] or [suite]
    args += ["-p", "no:cacheprovider",
            "-o", "addopts=", "-p", "no:warnings", "-q", "-rN", "--tb=long"]
    if selection:
        args += ["-k", selection]
    started = time.perf_counter()
    pytest.main(args + list(pytest_args), plugins=[recorder])
    return {"backend": backend, "world_size": world_size, "start": start,
            "selection": selection, "gates_as": gates_as, "timeout_s": timeout,
            "torch": torch.__version__,
            "wall_s": round(time.perf_counter() - started, 1),
            "summary": summarize(recorder.tests), "tests": recorder.tests,
            "errors": recorder.errors}


def passing(record: dict) -> set:
    """The names of the tests a run passed."""
    return {name for name, entry in record["tests"].items() if entry["outcome"] == "passed"}


def compare(first: dict, second: dict, listing: bool = False) -> list:
    """Print what each run passed and what ``first`` passes and ``second`` does not; return it."""
    a, b = passing(first), passing(second)
    fa, fb = first["backend"], second["backend"]
    print(f"{fa} at {first['world_size']}: {len(a)} passed of {first['summary']['total']}"
          f" ({first['wall_s']} s)")
    print(f"{fb} at {second['world_size']}: {len(b)} passed of {second['summary']['total']}"
          f" ({second['wall_s']} s)")
    if listing:
        for backend, names in ((fa, a), (fb, b)):
            print(f"\ntests {backend} passes ({len(names)}):")
            for name in sorted(names):
                print(f"  {name}")
    differences = sorted(a - b)
    print(f"\n{fa} passes, {fb} does not ({len(differences)}):")
    for name in differences:
        entry = second["tests"].get(name, {"outcome": "not run", "reason": ""})
        print(f"  {name}: {entry['outcome']}: {entry['reason']}")
    extra = sorted(b - a)
    print(f"\n{fb} passes, {fa} does not ({len(extra)}):")
    for name in extra:
        entry = first["tests"].get(name, {"outcome": "not run", "reason": ""})
        print(f"  {name}: {entry['outcome']}: {entry['reason']}")
    return differences


def main(argv=None) -> int:
    """The command line: ``run`` or ``compare``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run the suite for one backend")
    r.add_argument("--backend", choices=BACKENDS, required=True)
    r.add_argument("--world-size", type=int, default=2, choices=range(2, 9))
    r.add_argument("-k", dest="selection", default=None, help="pytest's -k expression")
    r.add_argument("--test", dest="names", action="append", default=[],
                   help="run this test (its exact name; repeatable)")
    r.add_argument("--timeout", type=int, default=120, help="seconds a test may take")
    r.add_argument("--start", choices=("fork", "spawn"), default="fork",
                   help="how each test's processes start")
    r.add_argument("--gates-as", choices=("gloo", "mpi"), default=None,
                   help="decide the suite's backend-name skips as for this backend")
    r.add_argument("--gates-as-gloo", dest="gates_as", action="store_const", const="gloo",
                   help=argparse.SUPPRESS)
    r.add_argument("--json", default=None, help="write the per-test record here")
    c = sub.add_parser("compare", help="compare two runs' records")
    c.add_argument("first", help="the reference run's JSON (Gloo's)")
    c.add_argument("second", help="the run judged against it (refcoll's)")
    c.add_argument("--list", action="store_true", help="list the passing tests too")
    args = ap.parse_args(argv)
    if args.command == "compare":
        with open(args.first) as f, open(args.second) as g:
            compare(json.load(f), json.load(g), args.list)
        return 0
    record = run(args.backend, args.world_size, args.selection, args.timeout, args.start,
                 args.gates_as, args.names)
    s = record["summary"]
    print(f"\n{args.backend} at {args.world_size}: {s['passed']} passed, {s['failed']} failed, "
          f"{s['skipped']} skipped of {s['total']} in {record['wall_s']} s")
    for name, entry in sorted(record["tests"].items()):
        if entry["outcome"] == "failed":
            print(f"  FAILED {name}: {entry['reason']}")
    for error in record["errors"]:
        print(f"  the suite could not be collected: {error}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1, sort_keys=True)
    return 1 if record["errors"] or not record["tests"] else 0


if __name__ == "__main__":
    sys.exit(main())
