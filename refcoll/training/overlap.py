"""Training with overlap: a layered MLP whose backward pass feeds a Reducer, timed and modelled.

The workload behind ``refcoll train --layers``: data-parallel SGD whose
gradients are averaged by :class:`refcoll.training.reducer.Reducer` (PyTorch DDP's
bucketing), timed with and without overlap in one interleaved run, beside the
overlap model's prediction (:func:`refcoll.model.overlap`).

* Model: an MLP of the given widths (``64,1024,1024,10``), ReLU between layers,
  softmax cross-entropy, float32, He-initialised from the seed alone.
  Parameters in forward order ``W1, b1, W2, b2, ...`` (layer ``l``: ``2l``, ``2l+1``).
* Backward: layer by layer, last first. A layer's bias and weight gradients go
  to ``reducer.ready(i, grad)`` as soon as they exist, before its input's
  gradient is computed: autograd's order, the reverse parameter order DDP fills
  buckets in (``torch/csrc/distributed/c10d/reducer.cpp``). Gradients are written
  straight into the Reducer's bucket views (DDP's ``gradient_as_bucket_view``), so
  nothing is copied in or out; the compute-only variant reuses arrays of its own.
* Variants, interleaved step by step (in a random order; a barrier starts each),
  each with its own replica, momentum and Reducer: ``compute`` (no reduction:
  its replica learns from this rank's gradient alone); ``overlap`` (buckets
  launched as their last gradient arrives; one per bucket cap); ``no_overlap``
  (every ``ready()`` after the whole backward pass, the last cap); and a
  blocking all-reduce of each bucket size, the prediction's communication cost.
  The reducing replicas stay bit-identical (:attr:`OverlapResult.identical`).
* Per step (rank 0's clock), medians after ``warmup``: ``step`` (barrier to the
  end of the update), ``forward``, ``backward`` (loss gradient included),
  ``compute`` (both), ``after_backward`` (the no-overlap ``ready()`` calls and
  ``finalize``), ``update``; ``comm``, the buckets' ``finished - started`` (the
  reducer's timeline) summed; ``tail``, the last bucket's end after the backward
  pass; ``exposed`` = step minus the compute-only step of the same index;
  ``hidden = comm - exposed``.
* Prediction (:func:`predict_step`): bucket ``i`` is ready at the fraction of
  the backward pass its last gradient took (the reducer's timeline), applied to
  the compute-only backward median, and costs the median blocking all-reduce of
  its size. :func:`model_command` prints the ``refcoll model`` line of the same
  step, under that command's assumptions (flat gradient, equal buckets, uniform
  rate) with α and β fitted to the blocking all-reduces (:func:`fit_link`).
* ``backward="sleep"``: each layer's backward is a ``time.sleep`` of its measured
  NumPy time (the ranks' mean), reducing the first batch's gradients every step:
  a backward pass that leaves the cores free, as a GPU's does.
"""

from __future__ import annotations

import math
import shlex
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import numpy as np

from .. import algorithms
from ..calls.agree import barrier
from ..calls.collectives import allreduce, as_transport
from ..calls.nonblocking import iallreduce
from ..core.errors import UsageError
from ..core.plot import figure, save
from ..model import ALGORITHMS, ModelRequest
from ..model.overlap import fit_link, predict_step
from .mlp import backward, forward, init_layers, loss_and_grads, loss_gradient
from .reducer import Reducer
from .train import (
    ReplicaDivergence,
    TrainConfig,
    agree_settings,
    batch_problem,
    check_loss,
    check_replicas,
    load_digits_split,
)

__all__ = ["parse_widths", "OverlapConfig", "Variant", "OverlapResult", "run_overlap",
           "model_command", "measure_layer_backward", "plot_timeline"]

_DIGITS = (64, 10)  # the digits' input width and classes
_POOL = 8  # synthetic data: batches of rows drawn once per rank, then cycled


def parse_widths(text: str) -> tuple[int, ...]:
    """Return layer widths from ``64,1024,1024,10``: at least two, each at least 1."""
    parts = str(text).split(",")
    if len(parts) < 2 or not all(p.strip().isascii() and p.strip().isdigit() and int(p) >= 1
                                  for p in parts):
        raise UsageError(f"--layers {text!r}: give at least an input and an output width, "
                         "each a whole number at least 1, separated by commas: 64,1024,10")
    return tuple(int(p) for p in parts)


def measure_layer_backward(params, x, y, *, repeats: int = 5) -> tuple[float, ...]:
    """Return each layer's median NumPy backward time on ``(x, y)``, first layer first."""
    acts = forward(params, x)
    _, d_out = loss_gradient(acts[-1], y)
    runs: list[list] = [[] for _ in range(repeats)]
    for spans in runs:  # each run's spans, last layer first
        backward(params, acts, d_out, lambda i, g: None, spans=spans)
    return tuple(float(statistics.median(r[-1 - layer][1] - r[-1 - layer][0] for r in runs))
                 for layer in range(len(params) // 2))


class Variant(NamedTuple):
    """One interleaved way of running the step: ``overlap`` None is compute-only."""

    name: str
    overlap: bool | None
    bucket_mb: float


@dataclass(frozen=True)
class OverlapConfig:
    """Settings of one overlap run; every rank must be given the same.

    Attributes:
        widths: layer widths, input first (digits: 64 in, 10 out).
        steps, lr, momentum, batch, seed, algorithm: as
            :class:`~refcoll.training.train.TrainConfig`.
        bucket_mbs: bucket caps (MiB) of the overlap variants; the no-overlap
            variant uses the last. The first bucket's cap is ``first_bucket_mb``.
        overlap: run the overlap variants (False: compute-only and no-overlap).
        synthetic: random inputs and labels from the seed instead of the digits.
        warmup: first steps left out of the medians (the reducer rebuilds after one).
        backward: ``numpy`` or ``sleep`` (the free-cores stand-in).
    """

    widths: tuple[int, ...]
    steps: int = 400
    lr: float = 0.05
    momentum: float = 0.9
    batch: int = 32
    seed: int = 0
    algorithm: str = "ring"
    bucket_mbs: tuple[float, ...] = (25.0,)
    first_bucket_mb: float = 1.0
    overlap: bool = True
    synthetic: bool = False
    warmup: int = 2
    backward: str = "numpy"

    def __post_init__(self):
        TrainConfig(steps=self.steps, lr=self.lr, momentum=self.momentum, batch=self.batch,
                    seed=self.seed, algorithm=self.algorithm)  # the same checks and messages
        parse_widths(",".join(map(str, self.widths)))
        if not self.synthetic and (self.widths[0], self.widths[-1]) != _DIGITS:
            raise UsageError(f"--layers {','.join(map(str, self.widths))}: the digits need "
                             f"{_DIGITS[0]} inputs and {_DIGITS[1]} outputs "
                             "(or give --synthetic)")
        if not self.bucket_mbs or not all(0 < b < math.inf for b in
                                          (*self.bucket_mbs, self.first_bucket_mb)):
            raise UsageError("--bucket-mb must be positive and finite, got "
                             + ", ".join(f"{b:g}" for b in self.bucket_mbs))
        if self.backward not in ("numpy", "sleep") or self.warmup < 0:
            raise UsageError(f"backward {self.backward!r}, warmup {self.warmup}: give numpy or "
                             "sleep, and a warmup of at least 0 steps")

    def variants(self) -> list[Variant]:
        """Return the interleaved variants, compute-only first."""
        out = [Variant("compute", None, 0.0)]
        if self.overlap:
            several = len(self.bucket_mbs) > 1
            out += [Variant(f"overlap {b:g}MB" if several else "overlap", True, b)
                    for b in self.bucket_mbs]
        return out + [Variant("no_overlap", False, self.bucket_mbs[-1])]


@dataclass
class _Replica:
    variant: Variant
    params: list
    velocity: list
    reducer: Reducer | None
    sleep: tuple | None  # the stand-in's seconds per layer and this replica's gradients
    records: list = field(default_factory=list)  # the measured steps' figures
    scratch: list = field(default_factory=list)  # compute-only: its gradients' arrays, reused

    def __post_init__(self):
        if self.reducer is None:
            self.scratch = [np.empty_like(w) for w in self.params]


def _data(t, config: OverlapConfig):
    """Return ``(x, y, x_test, y_test)``: this rank's rows, and the test set (None: synthetic)."""
    if config.synthetic:
        rng, rows = np.random.default_rng([config.seed, 2, t.rank]), config.batch * _POOL
        x = rng.standard_normal((rows, config.widths[0])).astype(np.float32)
        return x, rng.integers(0, config.widths[-1], rows), None, None
    x_train, y_train, x_test, y_test = load_digits_split()
    problem = batch_problem(config.batch, t.size, len(y_train))  # every rank alike
    if problem:
        raise UsageError(problem)
    return x_train[t.rank::t.size], y_train[t.rank::t.size], x_test, y_test


def _batches(n_rows: int, config: OverlapConfig, rank: int):
    """Yield each step's rows: a fresh permutation of the shard per epoch, as train does."""
    rng, per_epoch = np.random.default_rng([config.seed, 1, rank]), n_rows // config.batch
    order = None
    for step in range(config.steps):
        within = step % per_epoch
        if within == 0:
            order = rng.permutation(n_rows)
        yield order[within * config.batch:(within + 1) * config.batch]


def _step(t, rep: _Replica, x, y, lr, momentum) -> dict:
    """Run one step of ``rep``'s variant; return its figures (seconds, this rank's clock)."""
    barrier(t)
    v, n = rep.variant, len(rep.params)
    t0 = time.perf_counter()
    acts = forward(rep.params, x)
    t1 = time.perf_counter()
    loss, d_out = loss_gradient(acts[-1], y)
    grads, first, spans = [None] * n, [], []

    def hand(i, grad):
        if not first:  # the reducer's timeline counts from here
            first.append(time.perf_counter())
        rep.reducer.ready(i, grad)

    backward(rep.params, acts, d_out, hand if v.overlap else grads.__setitem__, spans=spans,
             sleep=rep.sleep and rep.sleep[0], grads=rep.sleep and rep.sleep[1],
             out=rep.reducer.gradient if rep.reducer is not None else rep.scratch.__getitem__)
    t2 = time.perf_counter()
    timeline = []
    if rep.reducer is not None:
        if not v.overlap:  # every gradient after the whole backward pass, last first
            first.append(time.perf_counter())
            for i in reversed(range(n)):
                rep.reducer.ready(i, grads[i])
        grads = rep.reducer.finalize(in_place=True)  # into the gradients, as DDP's .grad
        shift = first[0] - t0  # the timeline counts from the first ready()
        timeline = [{"index": b["index"], "bytes": b["bytes"],
                     **{k: b[k] + shift for k in ("ready", "launched", "started", "finished")}}
                    for b in rep.reducer.timeline()]
    t3 = time.perf_counter()
    for w, vel, g in zip(rep.params, rep.velocity, grads):  # momentum SGD, as train does
        vel *= momentum
        vel += g
        w -= lr * vel
    t4 = time.perf_counter()
    return {"step": t4 - t0, "forward": t1 - t0, "backward": t2 - t1, "compute": t2 - t0,
            "after_backward": t3 - t2, "update": t4 - t3,
            "comm": sum(b["finished"] - b["started"] for b in timeline),
            "tail": max([b["finished"] - t2 + t0 for b in timeline] + [0.0]),
            "loss": loss, "backward_start": t1 - t0, "timeline": timeline,
            "layers": [(s - t0, e - t0) for s, e in reversed(spans)], "update_at": t3 - t0}


def _blocking(t, sizes: dict, algorithm: str, buffers: dict) -> None:
    """Time each bucket size's all-reduce alone, the reducer's call waited at once."""
    for nbytes in sorted(sizes):
        buf, out = buffers.setdefault(nbytes, (np.ones(nbytes // 4, np.float32),
                                               np.empty(nbytes // 4, np.float32)))
        barrier(t)
        start = time.perf_counter()
        iallreduce(buf, t, op="sum", algorithm=algorithm, out=out, validate=False).wait()
        sizes[nbytes].append(time.perf_counter() - start)


def model_command(*, ranks: int, parameters: int, forward_s: float, backward_s: float,
                  buckets: int, alpha: float, beta: float, algorithm: str) -> tuple[str, float]:
    """Return the ``refcoll model`` command line of this step and the exposed time it prints.

    The exposed time is computed by :class:`~refcoll.model.ModelRequest`
    from the very strings of the line (its last stack row), so they agree.
    """
    text = {"nodes": "1", "gpus_per_node": str(ranks), "intra_bw": f"{1 / beta:.6g}B/s",
            "intra_latency": f"{alpha * 1e6:.6g}us", "reduce_bw": "0",
            "params": str(parameters), "forward": f"{forward_s:.6g}",
            "backward": f"{backward_s:.6g}", "buckets": str(buckets), "algorithm": algorithm}
    line = ["refcoll", "model", "--unidirectional",
            *(part for key, val in text.items() for part in ("--" + key.replace("_", "-"), val))]
    return shlex.join(line), ModelRequest(bidirectional=False, **text).plan().stack[-1].exposed


def _median(records, key) -> float:
    return float(statistics.median(r[key] for r in records)) if records else 0.0


@dataclass
class OverlapResult:
    """One run: per variant medians, predictions, a typical step; ``params``: final weights."""

    config: OverlapConfig
    world_size: int
    parameters: int
    variants: dict = field(default_factory=dict)
    blocking: dict = field(default_factory=dict)
    link: tuple = (0.0, 0.0, "ring")
    layer_seconds: tuple | None = None
    loss: float = math.nan
    test_accuracy: float | None = None
    identical: bool = True
    params: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        """Return the run as JSON-ready data (the schema ``refcoll train --layers`` documents)."""
        return {"command": "train", "mode": "overlap", "world_size": self.world_size,
                "config": asdict(self.config), "parameters": self.parameters,
                "gradient_bytes": 4 * self.parameters, "variants": self.variants,
                "blocking": [{"bytes": b, "seconds": s} for b, s in sorted(self.blocking.items())],
                "fit": {"alpha": self.link[0], "beta": self.link[1], "algorithm": self.link[2]},
                "layer_seconds": self.layer_seconds, "loss": self.loss,
                "test_accuracy": self.test_accuracy, "replicas_identical": self.identical}


def _summary(rep: _Replica, compute: list, blocking: dict, result: OverlapResult) -> dict:
    """Return a variant's medians, paired with the compute-only steps, and its predictions."""
    recs, v, backward = rep.records, rep.variant, _median(compute, "backward")
    out = {"overlap": v.overlap, "bucket_mb": v.bucket_mb, **{k: _median(recs, k) for k in (
        "step", "forward", "backward", "compute", "after_backward", "update", "comm", "tail")}}
    if v.overlap is None:
        return out
    paired = [(r["step"] - c["step"], r["comm"]) for r, c in zip(recs, compute)]
    out["exposed"] = statistics.median(e for e, _ in paired)
    out["hidden"] = statistics.median(c - e for e, c in paired)
    last = recs[-1]["timeline"]
    out["buckets"] = [{"index": b["index"], "bytes": b["bytes"]} for b in last]
    same = [r for r in recs if len(r["timeline"]) == len(last)]  # the layout of the last step
    ready = [[b["ready"] - r["backward_start"] for b in r["timeline"]] for r in same]
    comm = [blocking.get(b["bytes"], 0.0) for b in last]
    exposed, hidden = predict_step(ready, [r["backward"] for r in same], backward, comm)
    out["predicted"] = {"exposed": float(exposed), "hidden": float(hidden), "bucket_comm": comm,
                        "backward": backward}
    typical = min(same, key=lambda r: abs(r["step"] - out["step"]))  # the median-like step
    out["timeline"] = {"forward": [0.0, typical["forward"]], "layers": typical["layers"],
                       "buckets": typical["timeline"], "step": typical["step"],
                       "update": [typical["update_at"], typical["step"]]}
    alpha, beta, algorithm = result.link
    out["model_command"], out["model_exposed"] = model_command(
        ranks=result.world_size, parameters=result.parameters,
        forward_s=_median(compute, "forward"), backward_s=backward,
        buckets=len(last) if v.overlap else 1, alpha=alpha, beta=beta, algorithm=algorithm)
    return out


def run_overlap(comm, config: OverlapConfig) -> OverlapResult:
    """Train through the Reducer with each variant interleaved on ``comm``; return the figures.

    Every rank raises the same error, none is left waiting.

    Raises:
        UsageError: bad settings, or scikit-learn missing for the digits (on any rank).
        MismatchError: the ranks were given different configs.
        RefcollError: the training loss stopped being finite (lower ``lr``).
        ReplicaDivergence: a training replica differs across ranks at the end, or the
            reducing variants' replicas differ from each other.
    """
    t = as_transport(comm)
    error = ""
    try:
        x, y, x_test, y_test = _data(t, config)
    except UsageError as exc:
        error = str(exc)
    agree_settings(t, config, error)  # every rank raises, or none
    params = init_layers(config.widths, config.seed)
    sleep = layer_seconds = None
    if config.backward == "sleep":  # the ranks' mean NumPy time, so they sleep alike
        mine = np.array(measure_layer_backward(params, x[:config.batch], y[:config.batch]))
        layer_seconds = tuple(allreduce(mine, t, op="avg", validate=False).tolist())
        sleep = (layer_seconds, loss_and_grads(params, x[:config.batch], y[:config.batch])[1])
    reps = [_Replica(v, [w.copy() for w in params], [np.zeros_like(w) for w in params],
                     None if v.overlap is None else Reducer(
                         params, t, bucket_cap_mb=v.bucket_mb, gradient_as_bucket_view=True,
                         first_bucket_mb=config.first_bucket_mb, algorithm=config.algorithm),
                     sleep and (sleep[0], [g.copy() for g in sleep[1]]))
            for v in config.variants()]
    total, buffers, losses = 4 * sum(w.size for w in params), {}, []
    blocking: dict[int, list] = {4096: [], total: []}  # and the buckets' sizes: α and β's fit
    entries = reps + [None]  # None: the blocking all-reduces of the buckets' sizes so far
    for step, rows in enumerate(_batches(len(y), config, t.rank)):
        lr = np.float32(config.lr * (1 + math.cos(math.pi * step / config.steps)) / 2)
        measured = step >= min(config.warmup, config.steps - 1)
        # A fresh order each step, the same on every rank: no variant always follows another.
        for k in np.random.default_rng([config.seed, 3, step]).permutation(len(entries)):
            rep = entries[k]
            if rep is None:
                _blocking(t, blocking if measured else {}, config.algorithm, buffers)
                continue
            record = _step(t, rep, x[rows], y[rows], lr, config.momentum)
            if measured:
                rep.records.append(record)
            if rep is reps[1]:  # the first reducing replica's loss, every step
                losses.append(record["loss"])
            for b in record["timeline"]:
                blocking.setdefault(b["bytes"], [])
    losses = allreduce(np.array(losses), t, op="avg", validate=False)  # the ranks' mean
    for step, loss in enumerate(losses, 1):
        check_loss(float(loss), step)  # the first step it stopped being finite
    medians = {n: float(statistics.median(s)) for n, s in blocking.items() if s}
    trained = [r for r in reps if r.reducer is not None]
    for rep in trained:
        check_replicas(t, {str(i): w for i, w in enumerate(rep.params)},
                       when=f"after the {rep.variant.name} run")
    result = OverlapResult(config, t.size, total // 4, blocking=medians,
                           layer_seconds=layer_seconds)
    algorithm = config.algorithm if config.algorithm in ALGORITHMS and not algorithms.get(
        config.algorithm).needs_in_network else "ring"  # what the model prices in its stead
    result.link = (*fit_link(medians, t.size, algorithm), algorithm)
    rows = {rep.variant.name: _summary(rep, reps[0].records, medians, result) for rep in reps}
    for row in list(rows.values())[1:]:
        row["vs_compute"] = row["step"] / rows["compute"]["step"]
        row["speedup"] = rows["no_overlap"]["step"] / row["step"]
    result.variants, result.params = rows, {r.variant.name: r.params for r in reps}
    result.loss = float(np.mean(losses[-10:]))
    result.identical = all(a.tobytes() == b.tobytes() for rep in trained[1:]
                           for a, b in zip(trained[0].params, rep.params))
    if not result.identical:  # the same on every rank: check_replicas passed
        raise ReplicaDivergence(
            "the replicas of " + ", ".join(r.variant.name for r in trained) + " differ after "
            "training: the Reducer averaged different gradients with and without overlap")
    if x_test is not None:
        logits = forward(trained[0].params, x_test)[-1]
        result.test_accuracy = float((logits.argmax(axis=1) == y_test).mean())
    return result


def plot_timeline(result: OverlapResult, path: str) -> None:
    """Draw one step of each reducing variant: compute on one row, each bucket on the next.

    Raises:
        UsageError: matplotlib is not installed.
    """
    rows = [(n, r) for n, r in result.variants.items() if r["overlap"] is not None]
    fig = figure(figsize=(10, 1.6 + 1.3 * len(rows)))
    axes = fig.subplots(len(rows), 1, sharex=True, squeeze=False)
    blues, oranges = ("#4c78a8", "#9ecae9"), ("#f58518", "#ffbf79")
    for ax, (name, row) in zip(axes[:, 0], rows):
        tl, ms = row["timeline"], 1e3
        ax.broken_barh([(0, tl["forward"][1] * ms), (tl["update"][0] * ms, (
            tl["update"][1] - tl["update"][0]) * ms)], (1.1, 0.8), color="0.7")
        ax.broken_barh([(s * ms, (e - s) * ms) for s, e in tl["layers"]], (1.1, 0.8),
                       color=[blues[i % 2] for i in range(len(tl["layers"]))])
        ax.broken_barh([(b["started"] * ms, (b["finished"] - b["started"]) * ms)
                        for b in tl["buckets"]], (0.1, 0.8), edgecolor="black",
                       color=[oranges[b["index"] % 2] for b in tl["buckets"]])
        ax.set_yticks([0.5, 1.5], ["comm", "compute"])
        ax.set_title(f"{name}: this step {tl['step'] * ms:.1f} ms; medians (ms): exposed "
                     f"{row['exposed'] * ms:.1f}, communication after backward "
                     f"{row['tail'] * ms:.1f}, predicted {row['predicted']['exposed'] * ms:.1f}",
                     fontsize=9)
    axes[-1, 0].set_xlabel("ms into a typical step: forward, update (grey); backward per layer, "
                           "last first (blue); all-reduce per bucket (orange)")
    fig.suptitle(f"{result.world_size} ranks, layers {result.config.widths}", fontsize=10)
    fig.tight_layout()
    save(fig, path, dpi=120)
