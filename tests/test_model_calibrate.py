"""The calibration's scheduling term: its arithmetic, its measurement, and its report.

The term (refcoll.model.calibrate_sched) prices the rounds that wait for
a descheduled peer: a share q of rounds waits an exponential time of mean W, and
a call of R rounds pays the median of the sum. Its arithmetic is checked
against closed forms; its measurement against a counter standing in for the
clock on simulated ranks, so nothing here depends on how loaded the machine
is; one short mpiexec run checks what compare_with_measurement returns, never
how accurate it was.
"""

import importlib
import json
import math
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from conftest import mpiexec_path

from refcoll import algorithms as registry
from refcoll.core.calibration import Calibration
from refcoll.model import Comparison, predict
from refcoll.model.calibrate_sched import (
    WAIT_THRESHOLD,
    expected_share,
    stretch,
    wait_cdf,
    wait_median,
    wait_summary,
    waits_at,
)
from refcoll.transport import SimWorld

calibrate_module = importlib.import_module("refcoll.model.calibrate")

MPIEXEC = mpiexec_path()
needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec: pip install 'refcoll[mpi]'")


# ------------------------------------------------------------------- the term's arithmetic

def test_one_round_that_always_waits_has_the_exponential_median():
    assert wait_median(1, 1.0, 2e-3) == pytest.approx(2e-3 * math.log(2), rel=1e-9)


def test_rounds_that_all_wait_add_up_to_a_gamma_median():
    # The median of Γ(2, 1) solves 1 - e^(-x)(1 + x) = 1/2: x = 1.678346990...
    assert wait_median(2, 1.0, 1.0) == pytest.approx(1.678346990, rel=1e-7)
    assert wait_cdf(wait_median(5, 1.0, 3e-4), 5, 1.0, 3e-4) == pytest.approx(0.5, abs=1e-9)


def test_no_wait_when_most_calls_wait_in_no_round():
    # (1 - q)^R >= 1/2: more than half the calls never wait, so the median pays nothing.
    assert wait_median(2, 0.29, 1e-3) == 0.0  # 0.71² = 0.504
    assert wait_median(2, 0.30, 1e-3) > 0.0  # 0.70² = 0.49
    assert wait_median(6, 0.0, 1e-3) == 0.0 and wait_median(6, 0.5, 0.0) == 0.0
    assert wait_median(0, 1.0, 1e-3) == 0.0


def test_the_cdf_is_a_distribution():
    for rounds, q in ((1, 0.3), (4, 0.6), (12, 0.9)):
        assert wait_cdf(-1e-9, rounds, q, 1e-3) == 0.0
        assert wait_cdf(0.0, rounds, q, 1e-3) == pytest.approx((1 - q) ** rounds)
        assert wait_cdf(1.0, rounds, q, 1e-3) == pytest.approx(1.0)
        values = [wait_cdf(x, rounds, q, 1e-3) for x in np.linspace(0, 0.02, 50)]
        assert values == sorted(values)


def test_the_median_grows_with_rounds_and_share_and_nears_the_mean_wait_of_many_rounds():
    medians = [wait_median(r, 0.5, 1e-3) for r in (2, 4, 8, 16)]
    assert medians == sorted(medians) and medians[0] > 0
    assert wait_median(6, 0.4, 1e-3) < wait_median(6, 0.8, 1e-3)
    # Many rounds: the sum concentrates near its mean R·q·W.
    assert wait_median(200, 0.5, 1e-3) == pytest.approx(200 * 0.5 * 1e-3, rel=0.05)
    # Thousands of rounds overflow nothing: the sums are taken in logarithms.
    assert wait_median(1500, 0.5, 1e-3) == pytest.approx(1500 * 0.5 * 1e-3, rel=0.02)


def test_the_expected_share_is_one_minus_cores_over_runnable_tasks():
    assert expected_share(4, 2) == 0.5
    assert expected_share(2, 2) == 0.0 and expected_share(1, 2) == 0.0
    assert expected_share(None, 2) is None


def test_waits_interpolate_linearly_in_log_message_and_clamp_outside():
    table = [(1024, 0.0, 1e-3), (4096, 0.4, 3e-3)]
    assert waits_at(table, 2048) == pytest.approx((0.2, 2e-3))
    assert waits_at(table, 10) == (0.0, 1e-3) and waits_at(table, 1 << 20) == (0.4, 3e-3)
    assert waits_at([], 2048) == (0.0, 0.0)


# ---------------------------------------------------------------- the term from samples

def test_the_summary_counts_steps_well_past_their_rank_median():
    base = np.full(40, 1e-4)
    slow = base.copy()
    slow[::4] += 2e-3  # every fourth step waited 2 ms
    slow[1] += 0.1  # and one a tenth of a second, which leaves the median wait at 2 ms
    q, wait = wait_summary(np.stack([base, slow]))
    assert q == pytest.approx(11 / 80) and wait == pytest.approx(2e-3 / math.log(2))
    # Jitter under the threshold is no wait; a rank that timed nothing is left out.
    jitter = base * (1 + WAIT_THRESHOLD * 0.9)
    assert wait_summary(np.stack([base, jitter[:40]])) == (0.0, 0.0)
    assert wait_summary(np.stack([slow, np.zeros(40)])) == pytest.approx(
        (11 / 40, 2e-3 / math.log(2)))
    assert wait_summary(np.zeros((2, 5))) == (0.0, 0.0)


def test_the_stretch_is_the_median_excess_of_runs_of_consecutive_steps():
    # Every other step waits a slice and the next is short (its peer ran meanwhile):
    # a run of two is never longer than two median steps, though half the steps are long.
    alternating = np.tile([1e-3, 3e-3], 20)
    assert stretch(alternating[None, :], 1) == 0.0
    assert stretch(alternating[None, :], 2) == pytest.approx(0.0, abs=1e-15)
    # Waits in bursts: 6 slow steps in a row out of 20; runs of 4 that hold any pay.
    bursty = np.full(20, 1e-4)
    bursty[5:11] += 2e-3
    runs = np.convolve(bursty - np.median(bursty), np.ones(4), mode="valid")
    assert stretch(bursty[None, :], 4) == pytest.approx(max(float(np.median(runs)), 0.0))
    # Rows pool; a rank that timed nothing and runs longer than a row are left out.
    two = np.stack([bursty, np.zeros(20)])
    assert stretch(two, 4) == stretch(bursty[None, :], 4)
    assert stretch(two, 21) == 0.0


def _calibration(q_later: float, *, waits: bool = True) -> Calibration:
    """A hand-made measured calibration: one buffer size, steps at two message sizes."""
    n = 1 << 20
    steps = ((n, 1 << 18, 4e-4, 3e-4, 5e-5, 4e-5), (n, 1 << 20, 9e-4, 8e-4, 2e-4, 1.5e-4))
    rows = ((n, 1 << 18, 0.5, 2e-3, q_later, 1e-3), (n, 1 << 20, 0.5, 2e-3, q_later, 1e-3))
    return Calibration(3e-6, 1e-10, 1e-9, source="measured", ranks=4, call=2e-5, steps=steps,
                       waits=rows if waits else ())


def test_predict_adds_the_median_wait_of_the_rounds_to_the_step_model():
    cal = _calibration(0.25)
    n, p = 1 << 20, 4
    c = registry.get("ring").costs["allreduce"](p, n // 4, 4)
    assert c.critical_bytes / c.rounds == 1 << 18  # the ring's message: one table row
    reductions = c.reduced * 4 / (1 << 18)
    steps_only = (2e-5 + 4e-4 + (c.rounds - 1) * 3e-4 + 5e-5 + (reductions - 1) * 4e-5)
    assert predict(cal, "ring", p, n, waits=False) == pytest.approx(steps_only)
    # Pooled over the first round (q 0.5, W 2 ms) and R - 1 later ones (q 0.25, W 1 ms).
    waited = 0.5 + (c.rounds - 1) * 0.25
    mean_wait = (0.5 * 2e-3 + (c.rounds - 1) * 0.25 * 1e-3) / waited
    term = wait_median(c.rounds, waited / c.rounds, mean_wait)
    assert term > 0
    assert calibrate_module.scheduling_wait(cal, "ring", p, n) == pytest.approx(term)
    assert predict(cal, "ring", p, n) == pytest.approx(steps_only + term)


def test_a_measured_stretch_is_the_term_where_the_record_has_one():
    base = _calibration(0.25)
    rounds = registry.get("ring").costs["allreduce"](4, (1 << 20) // 4, 4).rounds
    values = tuple(1e-4 * r for r in range(1, rounds + 1))
    cal = Calibration(**{**base.__dict__, "stretch": (
        (1 << 20, 1 << 18, values), (1 << 20, 1 << 20, tuple(2 * v for v in values)))})
    assert calibrate_module.scheduling_wait(cal, "ring", 4, 1 << 20) == pytest.approx(
        values[rounds - 1])  # the ring's message is the first row's
    assert predict(cal, "ring", 4, 1 << 20) == pytest.approx(
        predict(cal, "ring", 4, 1 << 20, waits=False) + values[rounds - 1])
    # Too few rounds recorded for this call: the formula of q and W again.
    short = Calibration(**{**base.__dict__, "stretch": ((1 << 20, 1 << 18, values[:1]),)})
    assert calibrate_module.scheduling_wait(short, "ring", 4, 1 << 20) == pytest.approx(
        calibrate_module.scheduling_wait(base, "ring", 4, 1 << 20))
    assert cal.to_json()["stretch"][0] == {"buffer": 1 << 20, "message": 1 << 18,
                                           "rounds": list(values)}


def test_a_record_without_waits_predicts_as_before():
    # A record measured before the term (or read from auto's cache) has no waits.
    old = _calibration(0.25, waits=False)
    assert calibrate_module.scheduling_wait(old, "ring", 4, 1 << 20) == 0.0
    assert predict(old, "ring", 4, 1 << 20) == predict(old, "ring", 4, 1 << 20, waits=False)
    assert old.to_json()["waits"] == [] and old.to_json()["stretch"] == []
    assert _calibration(0.25).to_json()["waits"][0] == {
        "buffer": 1 << 20, "message": 1 << 18, "q_first": 0.5, "wait_first": 2e-3,
        "q_later": 0.25, "wait_later": 1e-3}


def _two_paths() -> Calibration:
    """A record with ordinary and planned steps at 64 KiB, 2 ranks, and own work per algorithm."""
    n = 1 << 16
    steps = ((n, 1 << 15, 4e-5, 3e-5, 5e-6, 4e-6), (n, 1 << 16, 6e-5, 5e-5, 8e-6, 7e-6))
    planned = ((n, 1 << 15, 2e-5, 1e-5, 3e-6, 2e-6), (n, 1 << 16, 3e-5, 2e-5, 6e-6, 5e-6))
    return Calibration(3e-6, 1e-10, 1e-9, source="measured", ranks=2, call=3e-5, steps=steps,
                       planned_call=5e-6, planned_steps=planned,
                       own=(("ring", n, 2e-5), ("naive", n, 1e-5)))


def test_a_call_that_runs_from_its_plan_is_priced_with_the_planned_steps_and_call():
    cal, n = _two_paths(), 1 << 16
    assert registry.get("ring").replayable and not registry.get("naive").replayable
    planned = Calibration(**{**cal.__dict__, "steps": cal.planned_steps,
                             "call": cal.planned_call, "planned_steps": (), "own": ()})
    # Up to PLAN_BYTES a replayable algorithm replays its plan: no own work is added.
    assert predict(cal, "ring", 2, n, waits=False) == pytest.approx(
        predict(planned, "ring", 2, n, waits=False))
    # One that is not replayable runs the ordinary way, its own work added to the call.
    ordinary = Calibration(**{**cal.__dict__, "planned_steps": (), "own": (),
                              "call": cal.call + 1e-5})
    assert predict(cal, "naive", 2, n, waits=False) == pytest.approx(
        predict(ordinary, "naive", 2, n, waits=False))
    # A record without planned steps (older, or no persistent exchanges) prices as before.
    old = Calibration(**{**cal.__dict__, "planned_steps": (), "own": ()})
    assert predict(old, "ring", 2, n, waits=False) > predict(cal, "ring", 2, n, waits=False)
    assert old.to_json()["planned_steps"] == [] and old.to_json()["own"] == []
    assert cal.to_json()["own"][0] == {"algorithm": "ring", "buffer": n, "seconds": 2e-5}
    assert cal.to_json()["planned_call"] == 5e-6


def test_own_work_is_the_same_on_every_rank_and_skips_what_cannot_run_dry(monkeypatch):
    steps_module = importlib.import_module("refcoll.model.calibrate_steps")

    def broken(t, x, out, *, op):
        raise RuntimeError("reads what it received")

    def rank(t):
        return steps_module.own_work(t, ["ring", "recursive_doubling"], [1024, 4096],
                                     calibrate_module._buffers, lambda _: 5,
                                     calibrate_module._clock)

    first, second = SimWorld(2).run(rank)
    assert first == second
    assert [(name, n) for name, n, _ in first] == [
        ("ring", 1024), ("ring", 4096), ("recursive_doubling", 1024),
        ("recursive_doubling", 4096)]
    assert all(seconds > 0 for _, _, seconds in first)
    real = registry.implementation

    def implementation(name, collective):
        return broken if name == "ring" else real(name, collective)

    monkeypatch.setattr(steps_module.algorithms, "implementation", implementation)
    first, _ = SimWorld(2).run(rank)
    assert [name for name, _, _ in first] == ["recursive_doubling"] * 2


class _Counter:
    """A clock per thread: every read advances 1 µs; a rank's messages advance it more."""

    def __init__(self):
        self.local = threading.local()

    def now(self) -> float:
        value = getattr(self.local, "now", 0.0)
        self.local.now = value + 1e-6
        return value

    def advance(self, seconds: float) -> None:
        self.local.now = getattr(self.local, "now", 0.0) + seconds


def _measure_steps(monkeypatch, slow_rank: int | None):
    """Return rank 0's ``_step_rows`` on 2 simulated ranks timed by a :class:`_Counter`.

    Each message of at least 64 B costs 10 µs on the counter; on ``slow_rank``
    every fourth costs 1 ms more, as if its peer had been descheduled.
    """
    clock = _Counter()
    monkeypatch.setattr(calibrate_module, "_clock", clock.now)
    nbytes = 1024

    def rank(t):
        exchange, sent = t.sendrecv, [0]

        def sendrecv(sendbuf, dest, recvbuf, source, tag=0):
            exchange(sendbuf, dest, recvbuf, source, tag)
            if sendbuf.nbytes >= 64:
                sent[0] += 1
                clock.advance(1e-5 + (1e-3 if t.rank == slow_rank and sent[0] % 4 == 0 else 0))

        t.sendrecv = sendrecv
        collected = {}
        for _ in range(calibrate_module.PASSES):
            calibrate_module._step_samples(t, nbytes, collected)
        return collected, calibrate_module._step_rows(t, nbytes, collected)[:2]

    return SimWorld(2).run(rank)


def test_the_step_probe_measures_the_waits_and_keeps_them_out_of_the_medians(monkeypatch):
    (collected, (rows, waits)), (_, (rows1, waits1)) = _measure_steps(monkeypatch, slow_rank=1)
    assert rows == rows1 and waits == waits1  # every rank returns the same
    sizes = calibrate_module._message_sizes(1024, 2)
    assert [r[:2] for r in rows] == [(1024, b) for b in sizes] == [w[:2] for w in waits]
    repeats, _ = calibrate_module._per_pass(calibrate_module._repeats(sizes[0]))
    assert [len(column) for column in collected[sizes[0]]] == [
        repeats * calibrate_module.PASSES] * 4
    for row, wait in zip(rows, waits):
        first, later = row[2], row[3]
        # A step reads the clock, exchanges (10 µs), reads it again: 11 µs, waits aside.
        assert first == pytest.approx(1.1e-5) and later == pytest.approx(1.1e-5)
        q_first, w_first, q_later, w_later = wait[2:]
        # About one step in four on one rank of two waited 1 ms.
        assert 0.05 < q_first < 0.25 and 0.05 < q_later < 0.25
        assert w_first == pytest.approx(1e-3 / math.log(2))
        assert w_later == pytest.approx(1e-3 / math.log(2))


def test_without_descheduled_peers_the_probe_measures_no_wait(monkeypatch):
    (_, (rows, waits)), _ = _measure_steps(monkeypatch, slow_rank=None)
    assert all(w[2:] == (0.0, 0.0, 0.0, 0.0) for w in waits)
    assert all(r[2] == pytest.approx(1.1e-5) for r in rows)


@pytest.mark.parametrize("sync", [True, False])
def test_back_to_back_all_reduces_wait_for_one_barrier_not_one_each(monkeypatch, sync):
    barriers = []
    real = calibrate_module.barrier

    def counted(t):
        barriers.append(t.rank)
        real(t)

    monkeypatch.setattr(calibrate_module, "barrier", counted)
    times = SimWorld(2).run(lambda t: calibrate_module._allreduce_times(
        t, "ring", 1024, 5, warmups=2, sync=sync))
    assert [len(each) for each in times] == [5, 5]
    calls = 2 + 5  # warm-ups and timed calls
    assert barriers.count(0) == barriers.count(1) == (calls if sync else 1)
    assert len(barriers) == 2 * (calls if sync else 1)


@pytest.mark.parametrize("back_to_back", [True, False])
def test_compare_with_measurement_times_calls_as_asked(monkeypatch, back_to_back):
    asked = []

    def times(t, algorithm, nbytes, repeats, warmups=None, sync=True):
        asked.append(sync)
        return [1e-3] * repeats

    monkeypatch.setattr(calibrate_module, "_allreduce_times", times)
    monkeypatch.setattr(calibrate_module, "calibrate",
                        lambda t, sizes, after_size: [after_size(n) for n in sizes] and
                        _calibration(0.25))
    first, _ = SimWorld(2).run(lambda t: calibrate_module.compare_with_measurement(
        t, ["ring"], [4096], back_to_back=back_to_back))
    assert asked and set(asked) == {not back_to_back}
    assert first.to_json()["back_to_back"] is back_to_back


# ------------------------------------------------------------------------- the report

def _row(algorithm, predicted, measured, wait=0.0):
    return {"algorithm": algorithm, "bytes": 1024, "predicted": predicted, "wait": wait,
            "predicted_without_wait": predicted - wait, "predicted_fit": predicted / 10,
            "measured": measured, "ratio": predicted / measured}


def test_the_geometric_mean_error_counts_twice_and_half_alike():
    rows = [_row("ring", 2.0, 1.0), _row("ring", 0.5, 1.0), _row("tree", 1.1, 1.0, wait=0.1)]
    comparison = Comparison(_calibration(0.25), rows, None, 2)
    expected = math.exp((2 * math.log(2) + math.log(1.1)) / 3) - 1
    assert comparison.geomean_error() == pytest.approx(expected)
    assert comparison.within() == 1 and comparison.worst()["predicted"] == 2.0
    assert comparison.geomean_error("predicted_without_wait") == pytest.approx(
        math.exp(2 * math.log(2) / 3) - 1)
    lines = comparison.summary_lines()
    assert lines[0].startswith("measured steps + scheduling wait: geometric-mean error")
    assert "1 of 3 predictions within 30%" in lines[0]
    assert lines[-1].startswith("scheduling: 4 ranks")
    data = comparison.to_json()
    assert data["geomean_error"] == pytest.approx(expected)
    assert data["scheduling"]["q_max"] == 0.5 and data["scheduling"]["wait_max"] == 2e-3
    json.dumps(data)


SMOKE = textwrap.dedent("""
    import json, sys
    from mpi4py import MPI
    from refcoll.model import compare_with_measurement
    from refcoll.transport.mpi import MPITransport

    t = MPITransport(MPI.COMM_WORLD)
    result = compare_with_measurement(t, ["ring", "auto"], [4096])
    data = result.to_json()
    if t.rank == 0:
        data["lines"] = result.summary_lines()
        with open(sys.argv[1], "w") as fh:
            json.dump(data, fh)
""")


@needs_mpi
def test_compare_with_measurement_on_two_ranks_reports_every_row(tmp_path):
    script, out = tmp_path / "smoke.py", tmp_path / "out.json"
    script.write_text(SMOKE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "REFCOLL_ALGO"))}
    env.update(REFCOLL_CACHE=str(tmp_path / "cache"), REFCOLL_TIMEOUT="60",
               REFCOLL_CALIBRATION="default")
    res = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(script), str(out)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [(r["algorithm"].split(" ")[0], r["bytes"]) for r in rows] == [
        ("ring", 4096), ("auto", 4096)]
    for r in rows:
        assert r["measured"] > 0 and r["wait"] >= 0
        assert r["predicted"] == pytest.approx(r["predicted_without_wait"] + r["wait"])
        assert r["ratio"] == pytest.approx(r["predicted"] / r["measured"])
    cal = data["calibration"]
    assert cal["ranks"] == 2
    assert [(w["buffer"], w["message"]) for w in cal["waits"]] == [
        (s["buffer"], s["message"]) for s in cal["steps"]] == [
        (s["buffer"], s["message"]) for s in cal["stretch"]]
    assert all(len(s["rounds"]) >= 2 and min(s["rounds"]) >= 0 for s in cal["stretch"])
    assert all(0 <= w["q_first"] <= 1 and 0 <= w["q_later"] <= 1 for w in cal["waits"])
    assert data["geomean_error"] >= 0 and data["scheduling"]["ranks"] == 2
    assert data["lines"][0].startswith("measured steps + scheduling wait")
    # A blocking call keeps no plan, so 4 KiB runs the ordinary way: no planned path.
    assert cal["planned_steps"] == [] and cal["planned_call"] == 0 and cal["call"] > 0
    assert {(o["algorithm"], o["buffer"]) for o in cal["own"]} >= {("ring", 4096)}
