import json

import numpy as np
import pytest

import refcoll
from refcoll import algorithms
from refcoll.calls import auto as tuning
from refcoll.calls import calibration as calibration_module
from refcoll.transport import SimWorld


def test_auto_picks_the_least_modelled_time():
    cal = tuning.Calibration(alpha=1e-5, beta=1e-9, gamma=1e-10)
    for p in (2, 3, 4, 8, 16):
        for n in (1, 100, 10_000, 1_000_000):
            pick = tuning.choose("allreduce", p, n, 4, cal)
            times = {name: algorithms.get(name).costs["allreduce"](p, n, 4).time(
                cal.alpha, cal.beta, cal.gamma) for name in tuning.candidates("allreduce")}
            assert times[pick] == min(times.values())


def test_latency_bound_small_and_bandwidth_bound_large_messages():
    cal = tuning.Calibration(alpha=1e-5, beta=1e-9, gamma=1e-10)
    small = tuning.choose("allreduce", 16, 2, 4, cal)
    large = tuning.choose("allreduce", 16, 1 << 24, 4, cal)
    cost = lambda name, n: algorithms.get(name).costs["allreduce"](16, n, 4)  # noqa: E731
    assert cost(small, 2).rounds < cost("ring", 2).rounds, "few rounds win for tiny messages"
    assert cost(large, 1 << 24).critical_bytes <= cost("recursive_doubling", 1 << 24).critical_bytes


def test_auto_never_picks_the_reference_or_algorithms_needing_a_topology():
    for coll in ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce"):
        assert not {"naive", "auto", "hierarchical", "switch"} & set(tuning.candidates(coll)) \
            or tuning.candidates(coll) == ["naive"]


def test_auto_runs_the_chosen_algorithm_bit_for_bit():
    xs = [np.random.default_rng(r).standard_normal(10_001).astype(np.float32) for r in range(4)]
    pick = tuning.choose("allreduce", 4, xs[0].size, 4)
    auto = refcoll.simulate("allreduce", xs, algorithm="auto")
    chosen = refcoll.simulate("allreduce", xs, algorithm=pick)
    assert auto.outputs[0].tobytes() == chosen.outputs[0].tobytes()
    assert auto.ledger.total_messages == chosen.ledger.total_messages


def test_the_simulator_uses_the_default_calibration():
    out = SimWorld(2).run(lambda t: tuning.calibration_for(t))
    assert out == [tuning.DEFAULT, tuning.DEFAULT]


def test_measured_calibration_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("REFCOLL_CACHE", str(tmp_path))
    cal = SimWorld(2).run(lambda t: tuning.measure(t, repeats=3))
    assert cal[0] == cal[1], "every rank must get rank 0's numbers"
    assert cal[0].alpha > 0 and cal[0].beta > 0 and cal[0].gamma > 0
    calibration_module._save("host|lib", cal[0])
    data = json.loads((tmp_path / "calibration.json").read_text())
    assert data["host|lib"]["alpha"] == cal[0].alpha
    loaded = calibration_module._load("host|lib")
    assert (loaded.alpha, loaded.beta, loaded.gamma, loaded.measured_at, loaded.load) == \
        (cal[0].alpha, cal[0].beta, cal[0].gamma, cal[0].measured_at, cal[0].load)


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8])
def test_auto_battery(p):
    from conftest import failure_text, sim_battery

    failures = sim_battery(p, algorithms_=["auto"], ops=["sum", "avg"],
                           dtypes=["int32", "float32"], sizes=[0, 1, p + 1, 40_000])
    assert not failures, failure_text(failures)
