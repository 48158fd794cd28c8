"""Data-parallel training over refcoll's all-reduce: replicas, learning, bytes, the command."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import ROOT, mpiexec_path, raised_on_each_rank

from refcoll import MismatchError, SimWorld, UsageError
from refcoll.cli import main
from refcoll.training.train import (
    ReplicaDivergence,
    TrainConfig,
    check_replicas,
    init_params,
    load_digits_split,
    loss_and_grads,
    train,
)

pytest.importorskip("sklearn", reason="needs scikit-learn: pip install 'refcoll[examples]'")


def run(p, **settings):
    config = TrainConfig(**settings)
    return SimWorld(p).run(lambda t: train(t, config))


def test_replicas_stay_bitwise_identical_through_a_compressed_run():
    histories = run(2, compressor="ef(topk:ratio=0.01)", steps=30)
    first, second = (h.params for h in histories)
    assert set(first) == {"W1", "b1", "W2", "b2"}
    for name in first:
        assert first[name].tobytes() == second[name].tobytes(), name
    assert histories[0].epochs == histories[1].epochs
    assert not np.array_equal(first["W1"], init_params(64, 64, 0)["W1"])


def test_uncompressed_training_learns_the_digits():
    history = run(2, steps=88)[0]
    assert [e.step for e in history.epochs] == [22, 44, 66, 88]
    losses = [e.loss for e in history.epochs]
    assert losses == sorted(losses, reverse=True) and losses[-1] < 0.5 * losses[0]
    assert history.final.test_accuracy > 0.88  # 0.939 measured with seed 0


def test_uncompressed_bytes_are_the_ring_cost_and_topk_sends_far_fewer():
    from refcoll.algorithms.ring import ring_allreduce_cost as ring_allreduce

    plain = run(2, steps=3)[0].final
    sparse = run(2, steps=3, compressor="topk:ratio=0.01")[0].final
    sizes = [64 * 64, 64, 64 * 10, 10]
    assert plain.bytes_sent == plain.dense_bytes == 3 * sum(
        ring_allreduce(2, n, 4).bytes for n in sizes) // 2
    assert sparse.dense_bytes == plain.dense_bytes
    assert sparse.ratio > 20  # 42 measured: 1% of the values, with their indices and counts


def test_the_gradient_is_the_derivative_of_the_loss():
    x_train, y_train, _, _ = load_digits_split()
    params = {k: v.astype(np.float64) for k, v in init_params(64, 8, 3).items()}
    x, y = x_train[:16].astype(np.float64), y_train[:16]
    _, grads = loss_and_grads(params, x, y)
    rng = np.random.default_rng(0)
    for name in params:
        direction = rng.standard_normal(params[name].shape)
        shifted = [{**params, name: params[name] + s * 1e-6 * direction} for s in (1, -1)]
        numeric = (loss_and_grads(shifted[0], x, y)[0] - loss_and_grads(shifted[1], x, y)[0]) / 2e-6
        assert numeric == pytest.approx(float((grads[name] * direction).sum()), rel=1e-5), name


def test_diverged_replicas_are_reported_on_every_rank():
    def check(t):
        params = init_params(64, 4, 0)
        params["b2"][3] += t.rank  # rank 1's copy has drifted
        try:
            check_replicas(t, params, when="in the test")
        except ReplicaDivergence as exc:
            return str(exc)

    messages = SimWorld(2).run(check)
    assert all(m and "replicas differ across ranks in the test" in m for m in messages)


@pytest.mark.parametrize("second,error,said", [
    ({"batch": 5000}, UsageError, "larger than a rank's shard of 719 training rows on 2 ranks"),
    ({"steps": 4}, MismatchError, "ranks called train with different arguments"),
])
def test_ranks_given_different_settings_all_raise_at_once(second, error, said):
    """The batch was checked before the ranks agreed on the config: rank 1 refused 5000 rows
    while rank 0 went on and waited for it (a timeout under MPI). Now every rank raises."""
    configs = [TrainConfig(steps=3), TrainConfig(**{"steps": 3, **second})]
    for exc in raised_on_each_rank(train, [(c,) for c in configs]):
        assert isinstance(exc, error) and said in str(exc), repr(exc)


def test_bad_settings_are_usage_errors():
    for lr in (0.0, -1.0, math.nan, math.inf, 1e300):  # 1e300: float32's inf at the step
        with pytest.raises(UsageError, match="--lr must be a positive number a float32 holds"):
            TrainConfig(lr=lr)
    assert TrainConfig(lr=1e30).lr == 1e30  # (diverges: the run says so, exit 1)
    with pytest.raises(UsageError, match="--steps must be at least 1"):
        TrainConfig(steps=0)
    with pytest.raises(UsageError, match="unknown compressor 'topq'"):
        TrainConfig(compressor="topq")
    with pytest.raises(UsageError, match="switch processes"):
        TrainConfig(algorithm="switch")
    with pytest.raises(UsageError, match="larger than a rank's shard"):
        run(1, batch=5000)


def test_train_without_scikit_learn_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    res = CliRunner().invoke(main, ["train", "-n", "2", "--steps", "1"])
    assert res.exit_code == 2
    assert "pip install 'refcoll[examples]'" in res.output
    with pytest.raises(UsageError, match="refcoll\\[examples\\]"):
        load_digits_split()


@pytest.mark.skipif(mpiexec_path() is None,
                    reason="no mpiexec: install with pip install 'refcoll[mpi]'")
def test_train_under_mpi_reports_every_compressor(tmp_path):
    out, png = tmp_path / "train.json", tmp_path / "train.png"
    res = subprocess.run(
        [sys.executable, "-m", "refcoll", "train", "-n", "2", "--steps", "4",
         "--compressor", "none", "--compressor", "ef(topk:ratio=0.01)",
         "--json", str(out), "--plot", str(png)],
        capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(out.read_text())
    assert data["world_size"] == 2
    assert [r["compressor"] for r in data["runs"]] == ["none", "ef(topk:ratio=0.01)"]
    plain, sparse = (r["final"] for r in data["runs"])
    assert plain["step"] == sparse["step"] == 4
    assert (plain["bytes_sent"] == plain["dense_bytes"] == sparse["dense_bytes"]
            > 20 * sparse["bytes_sent"])
    assert f"{100 * sparse['test_accuracy']:.2f}%" in res.stdout.splitlines()[-2]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(mpiexec_path() is None,
                    reason="no mpiexec: install with pip install 'refcoll[mpi]'")
def test_a_batch_larger_than_a_shard_is_said_once_before_any_table():
    res = subprocess.run([sys.executable, "-m", "refcoll", "train", "-n", "2", "--steps", "2",
                          "--batch", "720"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.count("larger than a rank's shard of 719 training rows on 2 ranks") == 1
    assert "refcoll train:" not in res.stdout and "epoch" not in res.stdout


@pytest.mark.slow
def test_topk_one_percent_with_error_feedback_stays_within_a_point_of_uncompressed():
    plain = run(4, steps=400)[0].final
    sparse = run(4, steps=400, compressor="ef(topk:ratio=0.01)")[0].final
    assert plain.test_accuracy - sparse.test_accuracy <= 0.01  # 98.33% and 97.77% measured
    assert sparse.ratio > 20


@pytest.mark.parametrize("args,said", [(["--simulate", "0"], "give 1 to 64 simulated ranks"),
                                       (["--steps", "0"], "--steps 0: give at least 1")])
def test_the_example_refuses_what_it_cannot_run(args, said):
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "train_digits.py"), *args],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and said in res.stderr and "Traceback" not in res.stderr
