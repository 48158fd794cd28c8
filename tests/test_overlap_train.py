"""Training with overlap: the layered model's gradients, the reducer's replicas, the command."""

import json
import os
import shlex
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import mpiexec_path, raised_on_each_rank

from refcoll import MismatchError, RefcollError, SimWorld, UsageError
from refcoll.cli import main
from refcoll.model import Cluster, ModelRequest, allreduce_estimate, overlap
from refcoll.model.overlap import fit_link, predict_step
from refcoll.training import overlap as training_overlap
from refcoll.training.mlp import backward, forward, init_layers, loss_and_grads, loss_gradient
from refcoll.training.overlap import OverlapConfig, parse_widths, run_overlap
from refcoll.training.reducer import Reducer
from refcoll.training.train import ReplicaDivergence, init_params
from refcoll.training.train import loss_and_grads as two_layer_grads

needs_mpi = pytest.mark.skipif(mpiexec_path() is None,
                               reason="no mpiexec: install with pip install 'refcoll[mpi]'")

#: The keys `refcoll train --layers --json` documents, at the top and per reducing variant.
TOP_KEYS = {"command", "mode", "world_size", "config", "parameters", "gradient_bytes",
            "variants", "blocking", "fit", "layer_seconds", "loss", "test_accuracy",
            "replicas_identical"}
VARIANT_KEYS = {"overlap", "bucket_mb", "step", "forward", "backward", "compute", "comm",
                "exposed", "hidden", "buckets", "predicted", "model_command", "model_exposed",
                "vs_compute", "speedup", "timeline"}


def small_run(p=2, **settings):
    config = OverlapConfig(**{"widths": (12, 48, 40, 5), "steps": 4, "batch": 8,
                              "synthetic": True, "warmup": 1, "bucket_mbs": (0.004,),
                              "first_bucket_mb": 0.002, **settings})
    return config, SimWorld(p).run(lambda t: run_overlap(t, config))


def outcomes(configs):
    """Run ``run_overlap`` with rank r's config ``configs[r]``; return what each rank raised."""
    # The timeout only bounds a failure: ranks that did not agree before the Reducer waited
    # for ranks that had raised already.
    return raised_on_each_rank(run_overlap, [(c,) for c in configs], timeout=30)


def test_the_gradient_is_the_derivative_of_the_loss():
    rng = np.random.default_rng(1)
    params = init_layers((5, 7, 6, 3), 2, dtype=np.float64)
    params = [w + 0.1 * rng.standard_normal(w.shape) for w in params]  # biases not zero
    x, y = rng.standard_normal((9, 5)), rng.integers(0, 3, 9)
    _, grads = loss_and_grads(params, x, y)
    for i, w in enumerate(params):
        direction = rng.standard_normal(w.shape)
        shifted = [[*params[:i], w + s * 1e-6 * direction, *params[i + 1:]] for s in (1, -1)]
        numeric = (loss_and_grads(shifted[0], x, y)[0]
                   - loss_and_grads(shifted[1], x, y)[0]) / 2e-6
        assert numeric == pytest.approx(float((grads[i] * direction).sum()), rel=1e-6), i


def test_two_layers_give_the_gradients_of_the_digits_mlp():
    """An independent computation: refcoll.training.train's two-layer MLP, the same weights."""
    named = init_params(64, 16, 3)
    x = np.random.default_rng(0).random((20, 64), dtype=np.float32)
    y = np.arange(20) % 10
    loss, grads = loss_and_grads([named[k] for k in ("W1", "b1", "W2", "b2")], x, y)
    want_loss, want = two_layer_grads(named, x, y)
    assert loss == pytest.approx(want_loss, rel=1e-6)
    for got, name in zip(grads, ("W1", "b1", "W2", "b2")):
        np.testing.assert_allclose(got, want[name], rtol=1e-5, atol=1e-7, err_msg=name)


def test_backward_hands_over_gradients_last_layer_first():
    params = init_layers((4, 6, 5, 3), 0)
    acts = forward(params, np.ones((2, 4), np.float32))
    order = []
    backward(params, acts, np.ones((2, 3), np.float32), lambda i, g: order.append(i))
    assert order == [5, 4, 3, 2, 1, 0]  # reverse parameter order: DDP's bucket order


def test_reducer_averages_the_layered_gradients_identically_on_every_rank():
    widths, p = (10, 300, 200, 4), 2

    def rank(t):
        params = init_layers(widths, 0)
        rng = np.random.default_rng([5, t.rank])
        x, y = rng.standard_normal((6, 10)).astype(np.float32), rng.integers(0, 4, 6)
        reducer = Reducer(params, t, bucket_cap_mb=0.05, first_bucket_mb=0.001, algorithm="ring")
        _, grads = loss_and_grads(params, x, y)
        acts = forward(params, x)
        backward(params, acts, loss_gradient(acts[-1], y)[1], reducer.ready)
        return grads, reducer.finalize(), len(reducer.buckets)

    results = SimWorld(p).run(rank)
    assert results[0][2] >= 3  # several buckets, so the launch order matters
    for i in range(len(results[0][0])):
        # p = 2: g·fl(1/2) is exact, so DDP's average is (g0 + g1)/2 to the bit
        want = (results[0][0][i] + results[1][0][i]) * np.float32(0.5)
        for r in range(p):
            assert results[r][1][i].tobytes() == want.tobytes(), (i, r)


def test_overlap_and_no_overlap_train_the_same_bits_on_every_rank():
    config, results = small_run()
    first, second = results
    init = init_layers(config.widths, config.seed)
    for name in ("overlap", "no_overlap"):
        for a, b in zip(first.params[name], second.params[name]):
            assert a.tobytes() == b.tobytes(), name  # every rank averaged the same gradients
        assert not np.array_equal(first.params[name][0], init[0])
    for a, b in zip(first.params["overlap"], first.params["no_overlap"]):
        assert a.tobytes() == b.tobytes()
    assert first.identical and second.identical
    data = first.to_json()
    assert TOP_KEYS <= set(data) and set(data["variants"]) == {"compute", "overlap", "no_overlap"}
    for name in ("overlap", "no_overlap"):
        row = data["variants"][name]
        assert VARIANT_KEYS <= set(row), name
        assert len(row["buckets"]) >= 2 and len(row["predicted"]["bucket_comm"]) == len(
            row["buckets"])
        assert sum(b["bytes"] for b in row["buckets"]) == data["gradient_bytes"]
    json.dumps(data)


def plan_of(command: str):
    """Return the plan ``refcoll model``'s library function gives for a printed command line."""
    args, kwargs = shlex.split(command)[2:], {}
    while args:
        option = args.pop(0)
        if option == "--unidirectional":
            kwargs["bidirectional"] = False
        else:
            kwargs[option[2:].replace("-", "_")] = args.pop(0)
    return ModelRequest(**kwargs).plan()


def test_the_printed_model_command_gives_the_reported_exposed_time(tmp_path):
    _, results = small_run()
    for name, row in results[0].variants.items():
        if row["overlap"] is None:
            continue
        assert plan_of(row["model_command"]).stack[-1].exposed == row["model_exposed"], name
        out = tmp_path / f"{name}.json"
        res = CliRunner().invoke(main, [*shlex.split(row["model_command"])[1:], "--json",
                                        str(out)])
        assert res.exit_code == 0, res.output
        assert json.loads(out.read_text())["stack"][-1]["exposed"] == pytest.approx(
            row["model_exposed"], rel=1e-12)
        buckets = len(row["buckets"]) if row["overlap"] else 1
        assert f"--buckets {buckets} " in row["model_command"]


def test_prediction_is_the_overlap_model_of_a_hand_built_timeline():
    # Buckets ready at 2, 5 and 10 s of a 10 s backward pass, applied to a 20 s one.
    exposed, hidden = predict_step([2.0, 5.0, 10.0], 10.0, 20.0, [3.0, 4.0, 6.0])
    assert (exposed, hidden) == overlap([4.0, 10.0, 20.0], [3.0, 4.0, 6.0], 20.0) == (6.0, 7.0)
    # Two measured steps: the median fraction of each bucket.
    two = predict_step([[2.0, 5.0, 10.0], [3.0, 9.0, 12.0]], [10.0, 12.0], 20.0, [3, 4, 6])
    fractions = [(0.2 + 0.25) / 2, (0.5 + 0.75) / 2, 1.0]
    assert two == pytest.approx(overlap([f * 20 for f in fractions], [3, 4, 6], 20.0))
    # Every bucket after the backward pass (no overlap): all of it exposed.
    assert predict_step([10.0, 10.0], 10.0, 20.0, [3.0, 4.0]) == (7.0, 0.0)


def test_fit_link_recovers_alpha_and_beta_from_the_ring_price():
    alpha, beta = 40e-6, 1 / 2e9
    cluster = Cluster(1, 2, 1 / beta, 1 / beta, intra_latency=alpha, reduce_bw=0)
    blocking = {n: allreduce_estimate(cluster, "ring", n // 4, 4).seconds
                for n in (4096, 1 << 20, 9 << 20)}
    assert fit_link(blocking, 2, "ring") == pytest.approx((alpha, beta), rel=1e-6)


def test_fit_link_of_noisy_times_stays_near_every_measurement():
    """A small message timed slower than a large one (noise) makes β negative; the median
    of seconds per byte then priced 340 kB at 81 ms where 1.1 ms was measured. The best
    one-term fit is within 2x of both."""
    measured = {4096: 1.95e-3, 340008: 1.12e-3}
    alpha, beta = fit_link(measured, 2, "ring")
    cluster = Cluster(1, 2, 1 / beta, 1 / beta, intra_latency=alpha, reduce_bw=0)
    for nbytes, seconds in measured.items():
        priced = allreduce_estimate(cluster, "ring", nbytes // 4, 4).seconds
        assert seconds / 2 <= priced <= seconds * 2, (nbytes, priced, seconds)


def test_bad_settings_are_usage_errors():
    with pytest.raises(UsageError, match="at least an input and an output width"):
        parse_widths("64")
    with pytest.raises(UsageError, match="at least an input and an output width"):
        parse_widths("64,x,10")
    for digits in ("²", "١٢"):  # digits to str.isdigit, but not to int() or not ASCII
        with pytest.raises(UsageError, match="at least an input and an output width"):
            parse_widths(f"64,{digits},10")
    with pytest.raises(UsageError, match="the digits need 64 inputs and 10 outputs"):
        OverlapConfig(widths=(32, 10))
    with pytest.raises(UsageError, match="--bucket-mb must be positive"):
        OverlapConfig(widths=(64, 10), bucket_mbs=(0,))
    with pytest.raises(UsageError, match="--steps must be at least 1"):
        OverlapConfig(widths=(64, 10), steps=0)
    res = CliRunner().invoke(main, ["train", "-n", "2", "--synthetic"])
    assert res.exit_code == 2 and "give --layers too" in res.output
    res = CliRunner().invoke(main, ["train", "-n", "2", "--layers", "8,4", "--synthetic",
                                    "--compressor", "topk:ratio=0.1"])
    assert res.exit_code == 2 and "leave out --compressor" in res.output


@needs_mpi
def test_train_with_layers_under_mpi_writes_the_json_and_the_timeline(tmp_path):
    out, png = tmp_path / "overlap.json", tmp_path / "timeline.png"
    res = subprocess.run(
        [sys.executable, "-m", "refcoll", "train", "-n", "2", "--layers", "16,96,96,10",
         "--synthetic", "--steps", "5", "--batch", "8", "--bucket-mb", "0.02", "--json",
         str(out), "--plot", str(png)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(out.read_text())
    assert TOP_KEYS <= set(data) and data["world_size"] == 2 and data["mode"] == "overlap"
    assert set(data["variants"]) == {"compute", "overlap", "no_overlap"}
    for name in ("overlap", "no_overlap"):
        row = data["variants"][name]
        assert VARIANT_KEYS <= set(row)
        assert row["model_command"] in res.stdout
        assert plan_of(row["model_command"]).stack[-1].exposed == pytest.approx(
            row["model_exposed"], rel=1e-12)
        assert {"index", "bytes", "ready", "launched", "started", "finished"} <= set(
            row["timeline"]["buckets"][0])
    assert data["replicas_identical"] is True and data["test_accuracy"] is None
    # --bucket-mb caps the first bucket too (torch 2.13's DDP): 47 KB of gradients in
    # 0.02 MiB buckets (each closed once it holds the cap) are two, where a first bucket
    # of 1 MiB held them all
    buckets = data["variants"]["overlap"]["buckets"]
    # (last layer first: b3, W3, b2 and W2 reach the cap together; b1 and W1 are left)
    assert [b["bytes"] for b in buckets] == [4 * (10 + 96 * 10 + 96 + 96 * 96),
                                             4 * (96 + 16 * 96)]
    assert "replicas bit-identical across variants: yes" in res.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ranks_given_different_settings_all_raise_at_once():
    """Ranks given different --steps ran different numbers of steps and waited for each other
    (a timeout under MPI): the settings are agreed first, and every rank names them."""
    base = {"widths": (12, 48, 5), "batch": 8, "synthetic": True, "warmup": 1}
    errors = outcomes([OverlapConfig(steps=4, **base), OverlapConfig(steps=5, **base)])
    for exc in errors:
        assert isinstance(exc, MismatchError), repr(exc)
        assert "ranks called train with different arguments" in str(exc)
        assert "steps=4" in str(exc) and "steps=5" in str(exc)


def test_a_batch_that_one_shard_fits_is_refused_on_every_rank():
    """3 ranks split 1438 rows into shards of 480, 479 and 479: a batch of 480 was accepted by
    rank 0 alone, which then waited for the others. Every rank now refuses it, as train does."""
    pytest.importorskip("sklearn", reason="needs scikit-learn: pip install 'refcoll[examples]'")
    config = OverlapConfig(widths=(64, 16, 10), steps=2, batch=480)
    for exc in outcomes([config] * 3):
        assert isinstance(exc, UsageError), repr(exc)
        assert "--batch 480 is larger than a rank's shard of 479 training rows on 3 ranks" in str(
            exc)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the overflow that makes the nan
def test_a_diverging_run_is_an_error_on_every_rank():
    config = OverlapConfig(widths=(12, 48, 40, 5), steps=4, batch=8, synthetic=True, warmup=1,
                           lr=1e30, momentum=0.5)
    for exc in outcomes([config] * 2):
        assert isinstance(exc, RefcollError) and not isinstance(exc, UsageError), repr(exc)
        assert "the training loss is nan at step 2: training diverged; lower --lr" in str(exc)


def test_replicas_that_differ_between_variants_are_an_error(monkeypatch):
    step = training_overlap._step

    def drifting(t, rep, *args):  # the no-overlap replica drifts alike on every rank
        record = step(t, rep, *args)
        if rep.variant.name == "no_overlap":
            rep.params[-1][0] += np.float32(1)
        return record

    monkeypatch.setattr(training_overlap, "_step", drifting)
    config = OverlapConfig(widths=(12, 48, 5), steps=3, batch=8, synthetic=True, warmup=1)
    for exc in outcomes([config] * 2):
        assert isinstance(exc, ReplicaDivergence), repr(exc)
        assert "the replicas of overlap, no_overlap differ after training" in str(exc)


@needs_mpi
def test_train_with_layers_refuses_a_batch_one_shard_fits_once_with_status_2():
    res = subprocess.run(
        [sys.executable, "-m", "refcoll", "train", "-n", "3", "--layers", "64,16,10",
         "--batch", "480", "--steps", "2"], capture_output=True, text=True, timeout=300,
        env={**os.environ, "REFCOLL_TIMEOUT": "10"})
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.count(
        "refcoll: error: --batch 480 is larger than a rank's shard of 479 training rows on 3 "
        "ranks") == 1, res.stderr
    assert "refcoll train --layers:" not in res.stdout


@needs_mpi
def test_train_with_layers_exits_1_when_training_diverges():
    res = subprocess.run(
        [sys.executable, "-W", "ignore::RuntimeWarning", "-m", "refcoll", "train", "-n", "2",
         "--layers", "12,48,5", "--synthetic", "--steps", "3", "--batch", "8", "--lr", "1e30",
         "--momentum", "0.5"], capture_output=True, text=True, timeout=300,
        env={**os.environ, "REFCOLL_TIMEOUT": "10"})
    assert res.returncode == 1, res.stdout + res.stderr
    assert "the training loss is nan at step 2: training diverged; lower --lr" in res.stderr
