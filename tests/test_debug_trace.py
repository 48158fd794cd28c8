"""REFCOLL_DEBUG=INFO: a line per call per rank, as NCCL_DEBUG=INFO writes (refcoll.calls.debug)."""

import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import mpiexec_path

import refcoll
from refcoll import algorithms
from refcoll.calls import auto, debug
from refcoll.calls.collectives import as_transport
from refcoll.core.errors import UsageError
from refcoll.transport.sim import SimWorld

MPIEXEC = mpiexec_path()

#: A line, read the way a script reads NCCL's (``host:pid:tid [rank] NCCL INFO Name: ...``).
LINE = re.compile(r"^(?P<host>[^:\s]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<rank>\d+)\] REFCOLL INFO "
                  r"(?P<name>\w+): (?P<rest>.*)$")


def parse(text: str) -> dict:
    """Return a line's fields: the prefix's, then every ``name value`` pair."""
    match = LINE.match(text)
    assert match, text
    fields = {k: match[k] for k in ("host", "pid", "tid", "rank", "name")}
    rest = re.sub(r"\[nranks=(\d+)\]", r"nranks \1", match["rest"]).split()
    assert len(rest) % 2 == 0, text
    fields.update(zip(rest[::2], rest[1::2]))
    return fields


@pytest.fixture
def tracing(monkeypatch):
    """Turn REFCOLL_DEBUG=INFO on for one test (and off again after it)."""
    monkeypatch.setenv("REFCOLL_DEBUG", "INFO")
    monkeypatch.delenv("REFCOLL_DEBUG_FILE", raising=False)
    debug.reset()
    yield
    monkeypatch.delenv("REFCOLL_DEBUG")
    debug.reset()


def run_sim(p, body, inputs):
    return SimWorld(p).run(body, [(x,) for x in inputs])


def inputs_for(p, n, dtype=np.float32):
    return [np.arange(n, dtype=dtype) + 10 * r for r in range(p)]


# ------------------------------------------------------------- the level


@pytest.mark.parametrize("value,on", [(None, False), ("", False), ("WARN", False),
                                      ("version", False), ("ABORT", False), ("INFO", True),
                                      ("info", True), ("TRACE", True)])
def test_only_info_and_trace_write_a_line_per_call(monkeypatch, capsys, value, on):
    if value is None:
        monkeypatch.delenv("REFCOLL_DEBUG", raising=False)
    else:
        monkeypatch.setenv("REFCOLL_DEBUG", value)
    debug.reset()
    try:
        assert debug.enabled() is on
        out = run_sim(1, lambda t, x: debug.traced(t, "allreduce", debug.call_fields(x),
                                                  lambda: x * 2), inputs_for(1, 3))
        assert np.array_equal(out[0], inputs_for(1, 3)[0] * 2)
        err = capsys.readouterr().err
        assert ("REFCOLL INFO AllReduce" in err) is on
    finally:
        debug.reset()


def test_an_unknown_level_is_an_error_at_every_call_until_fixed(monkeypatch):
    monkeypatch.setenv("REFCOLL_DEBUG", "LOUD")
    debug.reset()
    try:
        for _ in range(2):
            assert not debug.enabled()  # traces nothing; the call's argument check refuses it
            with pytest.raises(UsageError, match=r"REFCOLL_DEBUG='LOUD' is not a debug level: "
                                                 r"use INFO"):
                debug.check_level()
            with pytest.raises(UsageError, match=r"REFCOLL_DEBUG='LOUD'"):
                refcoll.simulate("allreduce", [np.ones(4, np.float32)] * 2, algorithm="ring",
                                 validate=True)
        monkeypatch.setenv("REFCOLL_DEBUG", "INFO")  # read again while it was wrong
        assert debug.enabled() and debug.level() == "INFO"
        debug.check_level()
    finally:
        monkeypatch.delenv("REFCOLL_DEBUG")
        debug.reset()


# ------------------------------------------------------------- the line


def test_the_line_reads_as_nccls_with_refcolls_fields():
    fields = debug.call_fields(np.zeros(1024, np.float32), op="max", algorithm="tree", root=3,
                               options={"segment": 256}, compressor=None, validate=False)
    text = debug.line(host="node7", pid=41, tid=42, rank=5, collective="reduce", op_count=26,
                      comm_rank=1, nranks=4, fields=fields, sent=2048, received=4096,
                      elapsed=12.5e-6)
    assert text == ("node7:41:42 [5] REFCOLL INFO Reduce: opCount 1a count 1024 datatype float32 "
                    "op max root 3 rank 1 [nranks=4] algorithm tree options {\"segment\":256} "
                    "compressor - validate 0 sent 2048 received 4096 time_us 12.5")
    got = parse(text)
    assert got["opCount"] == "1a" and got["nranks"] == "4" and got["options"] == '{"segment":256}'


def test_auto_adds_its_choice_and_prediction_and_a_failure_its_error_type():
    fields = debug.call_fields(np.zeros(8, np.float16), op="sum",
                               algorithm="auto", compressor="topk:ratio=0.01")
    text = debug.line(host="h", pid=1, tid=2, rank=0, collective="allreduce", op_count=0,
                      comm_rank=0, nranks=2, fields=fields, choice="ring", predicted=3.25e-5,
                      elapsed=None, error=ValueError("x"))
    got = parse(text)
    assert got["choice"] == "ring" and got["predicted_us"] == "32.5"
    assert got["compressor"] == "topk:ratio=0.01" and got["datatype"] == "float16"
    assert got["time_us"] == "-" and got["failed"] == "ValueError"


@pytest.mark.parametrize("template,want", [
    ("trace.%r", "trace.3"), ("%h/%p.%r.log", "node7/41.3.log"), ("a%%r", "a%r"),
    ("keep%x%", "keep%x%"), ("plain", "plain")])
def test_the_file_name_is_expanded_as_nccl_debug_file_is(template, want):
    assert debug.expand_path(template, host="node7", pid=41, rank=3) == want


# ------------------------------------------------- traced calls, simulated


def test_each_rank_writes_its_line_with_the_bytes_it_moved(tracing, monkeypatch, tmp_path):
    monkeypatch.setenv("REFCOLL_DEBUG_FILE", str(tmp_path / "trace.%r"))
    debug.reset()
    p, n = 3, 1000
    world = SimWorld(p)

    def body(t, x):
        first = debug.traced(t, "allreduce", debug.call_fields(x, op="sum", algorithm="ring",
                                                               validate=False),
                             lambda: refcoll.allreduce(x, t, algorithm="ring", validate=False))
        debug.traced(t, "allreduce", debug.call_fields(x, op="max", algorithm="ring",
                                                       validate=False),
                     lambda: refcoll.allreduce(x, t, op="max", algorithm="ring", validate=False))
        return first

    out = world.run(body, [(x,) for x in inputs_for(p, n)])
    assert all(np.array_equal(o, sum(inputs_for(p, n))) for o in out)
    debug.reset()  # closes the files
    sent, received = world.ledger.bytes_sent(), world.ledger.bytes_received()
    for r in range(p):
        lines = (tmp_path / f"trace.{r}").read_text().splitlines()
        assert len(lines) == 2
        calls = [parse(text) for text in lines]
        assert [c["opCount"] for c in calls] == ["0", "1"]
        assert [c["op"] for c in calls] == ["sum", "max"]
        assert {c["rank"] for c in calls} == {str(r)}
        assert calls[0]["count"] == str(n) and calls[0]["nranks"] == str(p)
        # two identical ring all-reduces: each moved half of what the ledger holds
        assert 2 * int(calls[0]["sent"]) == sent[r] and 2 * int(calls[1]["received"]) == received[r]
        assert float(calls[0]["time_us"]) > 0 and "choice" not in calls[0]


@pytest.mark.parametrize("p,n", [(2, 10), (4, 100_000), (5, 3)])
def test_auto_names_resolves_choice_and_the_models_time(tracing, capfd, p, n):
    run_sim(p, lambda t, x: debug.traced(
        t, "allreduce", debug.call_fields(x, op="sum", algorithm="auto"),
        lambda: refcoll.allreduce(x, t, algorithm="auto")), inputs_for(p, n))
    lines = [parse(text) for text in capfd.readouterr().err.splitlines() if "REFCOLL" in text]
    assert sorted(int(c["rank"]) for c in lines) == list(range(p))
    want = auto.choose("allreduce", p, n, 4, auto.DEFAULT)
    seconds = auto.modelled_time(want, "allreduce", p, n, 4, auto.DEFAULT)
    for c in lines:
        assert c["algorithm"] == "auto" and c["choice"] == want
        assert c["predicted_us"] == f"{seconds * 1e6:.1f}"


def test_a_call_inside_a_traced_call_is_part_of_its_line(tracing, capfd):
    def body(t, x):
        def twice():
            refcoll.allreduce(x, t, validate=False)
            return debug.traced(t, "allreduce", debug.call_fields(x),
                                lambda: refcoll.allreduce(x, t, validate=False))
        return debug.traced(t, "allreduce", debug.call_fields(x), twice)

    world = SimWorld(2)
    world.run(body, [(x,) for x in inputs_for(2, 64)])
    lines = [parse(text) for text in capfd.readouterr().err.splitlines() if "REFCOLL" in text]
    assert len(lines) == 2  # one per rank
    assert sum(int(c["sent"]) for c in lines) == world.ledger.total_bytes


def test_a_failed_call_writes_its_line_and_raises(tracing, capfd):
    def body(t, x):
        return debug.traced(t, "broadcast", debug.call_fields(x, root=7),
                            lambda: refcoll.broadcast(x, 7, t))

    with pytest.raises(Exception, match="root"):
        run_sim(2, body, inputs_for(2, 4))
    lines = [parse(text) for text in capfd.readouterr().err.splitlines() if "REFCOLL" in text]
    assert lines and all(c["name"] == "Broadcast" and c["root"] == "7" and "failed" in c
                         for c in lines)


def test_a_span_begun_and_ended_apart_counts_what_moved_between(tracing, capfd):
    def body(t, x):
        span = debug.begin(t, "allreduce", debug.call_fields(x, algorithm="ring", validate=False))
        result = refcoll.allreduce(x, t, validate=False)
        return span.end(), result

    world = SimWorld(2)
    out = world.run(body, [(x,) for x in inputs_for(2, 50)])
    assert [parse(text)["sent"] for text, _ in out] == \
        [str(world.ledger.bytes_sent()[r]) for r in range(2)]
    # Each rank's span and the public call inside it (which traces itself) write a line.
    assert capfd.readouterr().err.count("REFCOLL INFO AllReduce") == 4


# ---------------------------------------- the wrapper the public calls take


@pytest.mark.parametrize("name,comm_at,args,kwargs,want", [
    ("allreduce", 1, (), {"op": "min"}, {"op": "min", "algorithm": "ring", "root": "0"}),
    ("broadcast", 2, (1,), {}, {"op": "-", "algorithm": "naive", "root": "1"}),
    ("allgather", 1, (), {"algorithm": "auto"}, {"op": "-", "algorithm": "auto"}),
])
def test_the_wrapper_reads_the_fields_from_the_calls_signature(tracing, capfd, name, comm_at,
                                                               args, kwargs, want):
    fn = refcoll.calls.collectives.COLLECTIVE_FUNCTIONS[name]
    wrapped = debug.tracing(fn, comm_at, as_transport)
    xs = inputs_for(3, 7)
    got = run_sim(3, lambda t, x: wrapped(x, *args, comm=t, **kwargs), xs)
    lines = [parse(text) for text in capfd.readouterr().err.splitlines() if "REFCOLL" in text]
    plain = run_sim(3, lambda t, x: fn(x, *args, comm=t, **kwargs), xs)
    assert all(np.array_equal(a, b) for a, b in zip(got, plain))
    # One line per rank through the wrapper alone, and so through the public call, wired.
    assert len(lines) == 3
    assert len([t for t in capfd.readouterr().err.splitlines() if "REFCOLL" in t]) == 3
    for c in lines:
        assert c["name"] == debug.NAMES[name] and c["count"] == "7"
        assert all(c[k] == v for k, v in want.items()), c
        if algorithms.get(c["algorithm"]).chooses:
            assert c["choice"] == auto.choose(name, 3, 7, 4, auto.DEFAULT)


def test_the_wrapper_off_is_the_call_and_writes_nothing(monkeypatch, capfd):
    monkeypatch.delenv("REFCOLL_DEBUG", raising=False)
    debug.reset()
    wrapped = debug.tracing(refcoll.allreduce, 1, as_transport)
    out = run_sim(2, lambda t, x: wrapped(x, t), inputs_for(2, 5))
    assert np.array_equal(out[0], sum(inputs_for(2, 5)))
    assert "REFCOLL" not in capfd.readouterr().err


# ------------------------------------------------------------ under MPI

SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    from mpi4py import MPI
    import refcoll
    from refcoll.calls import debug
    from refcoll.calls.collectives import as_transport
    from refcoll.core.errors import UsageError

    t = as_transport(MPI.COMM_WORLD)
    x = np.arange(int(sys.argv[1]), dtype=np.float32) + t.rank
    try:  # the public calls, which trace themselves; a non-blocking one from its engine
        for algorithm in ("auto", "ring"):
            refcoll.allreduce(x, t, algorithm=algorithm)
        refcoll.iallreduce(x, t).wait()
        refcoll.broadcast(x, 1, t)
    except UsageError as exc:
        print(exc, file=sys.stderr, flush=True)
        sys.exit(2)
""")


def run_mpi(tmp_path, level, count=4096):
    script = tmp_path / "trace.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "PMIX_", "REFCOLL_ALGO"))}
    env.update(REFCOLL_DEBUG=level, REFCOLL_DEBUG_FILE=str(tmp_path / "trace.%h.%r"),
               REFCOLL_CALIBRATION="default", REFCOLL_TIMEOUT="60")
    return subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(script), str(count)],
                          capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec: pip install 'refcoll[mpi]'")
def test_under_mpiexec_each_rank_writes_its_own_file(tmp_path):
    res = run_mpi(tmp_path, "INFO")
    assert res.returncode == 0, res.stderr[-3000:]
    files = sorted(tmp_path.glob("trace.*.*"))
    assert [f.name.rsplit(".", 1)[1] for f in files] == ["0", "1"]
    want = auto.choose("allreduce", 2, 4096, 4, auto.DEFAULT)
    for rank, path in enumerate(files):
        calls = [parse(text) for text in path.read_text().splitlines()]
        assert [(c["name"], c["algorithm"]) for c in calls] == [
            ("AllReduce", "auto"), ("AllReduce", "ring"), ("AllReduce", "ring"),
            ("Broadcast", "naive")]
        assert {c["rank"] for c in calls} == {str(rank)} and calls[0]["choice"] == want
        assert len({c["pid"] for c in calls}) == 1 and calls[0]["host"] in path.name
        # agreement and data: the ring's 2·(p-1)/p·n·4 bytes each way, at least
        assert all(int(c["sent"]) >= 4096 * 4 and int(c["received"]) >= 4096 * 4
                   for c in calls[:3])
        assert calls[3]["root"] == "1"
        assert int(calls[3]["sent" if rank == 1 else "received"]) >= 4096 * 4


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec: pip install 'refcoll[mpi]'")
def test_under_mpiexec_one_ranks_unknown_level_is_every_ranks_error(tmp_path):
    """Only rank 0 is given a bad level: rank 1 raises it too, from the call's argument
    check, rather than waiting for rank 0 until the deadline."""
    script = tmp_path / "trace.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "OMPI_", "PMIX_", "REFCOLL_"))}
    env.update(REFCOLL_CALIBRATION="default", REFCOLL_TIMEOUT="120")
    res = subprocess.run([MPIEXEC, "-n", "1", "env", "REFCOLL_DEBUG=VERBOSE", sys.executable,
                          str(script), "8", ":", "-n", "1", sys.executable, str(script), "8"],
                         capture_output=True, text=True, timeout=240, env=env)
    assert res.returncode != 0
    assert "rank 0 could not run allreduce: UsageError: rank 0: REFCOLL_DEBUG='VERBOSE'" in \
        res.stderr, res.stderr[-3000:]
    assert "CollectiveTimeout" not in res.stderr


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec: pip install 'refcoll[mpi]'")
def test_under_mpiexec_an_unknown_level_is_every_ranks_error(tmp_path):
    res = run_mpi(tmp_path, "VERBOSE", count=8)
    assert res.returncode != 0
    for rank in (0, 1):
        assert f"rank {rank}: REFCOLL_DEBUG='VERBOSE' is not a debug level" in res.stderr
    assert not list(tmp_path.glob("trace.*.*"))
