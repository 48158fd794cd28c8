"""Data-parallel SGD over refcoll's all-reduce: a small NumPy MLP on handwritten digits.

The workload behind ``refcoll train``, small enough to run on a laptop and real
enough to show what gradient compression costs in accuracy and saves in bytes.

* Data: scikit-learn's bundled digits (1797 images of 8×8 pixels, 10 classes),
  pixels scaled to [0, 1], split once by a fixed permutation into 80% training
  and 20% test rows. Rank ``r`` of ``p`` trains on the training rows ``r::p``.
* Model: ``64 → hidden (ReLU) → 10`` with softmax cross-entropy, float32,
  initialised from the seed alone so every rank starts from the same weights.
* Step: each rank takes the next ``batch`` rows of its shard, computes the
  gradient of each parameter tensor, and averages it over the ranks with
  :func:`refcoll.allreduce` (``op="avg"``), through a compressor when one is
  given (one :class:`~refcoll.compressors.base.CompressorState` per tensor, so
  error-feedback residuals and PowerSGD's warm start follow each tensor). Then
  momentum SGD, ``v = μ·v + g``, ``w -= lr_s·v``, with the learning rate
  decayed along a half cosine, ``lr_s = lr·(1 + cos(π·s/steps))/2``, so the
  last steps settle the weights and the final accuracy does not hinge on
  where the last step happened to land.

Every rank ends each step holding the same averaged gradient, bit for bit, so
the replicas never drift apart; :func:`check_replicas` proves it at the start
and after every epoch by comparing a digest of the configuration and weights
across ranks, and raises :class:`ReplicaDivergence` otherwise.

Bytes are counted by the transport (``Traffic``) around the gradient all-reduces
alone, so they are exactly what the gradients put on the wire, compressed
payloads, indices, scales and element counts included. The dense equivalent is
what the same all-reduce algorithm sends uncompressed, from its cost formula in
:mod:`refcoll.core.cost` (the uncompressed run's measured bytes equal it exactly).
Both are reported per rank, averaged over the ranks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .. import algorithms
from ..calls.agree import agree
from ..calls.auto import resolve
from ..calls.collectives import allreduce, as_transport
from ..compressors import parse
from ..compressors.collective import compressed_allreduce
from ..core.errors import RefcollError, UsageError
from ..core.plot import figure, save
from . import mlp

__all__ = [
    "TrainConfig",
    "EpochRecord",
    "History",
    "ReplicaDivergence",
    "load_digits_split",
    "batch_problem",
    "agree_settings",
    "check_loss",
    "init_params",
    "loss_and_grads",
    "accuracy",
    "check_replicas",
    "train",
    "plot_histories",
    "EXAMPLES_HINT",
]

EXAMPLES_HINT = "pip install 'refcoll[examples]'"

_SPLIT_SEED = 20240605  # the test set is the same whatever the training seed
_TEST_FRACTION = 0.2
_CLASSES = 10


class ReplicaDivergence(RefcollError):
    """The ranks' model replicas (or their configurations) are not bitwise identical."""


#: The largest learning rate: the steps scale float32 gradients by it (np.float32(lr)).
_LARGEST_LR = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one training run; every rank must be given the same.

    Attributes:
        compressor: a compressor spec (``"ef(topk:ratio=0.01)"``), or ``"none"``
            for the plain all-reduce.
        steps: optimiser steps (each one all-reduce per parameter tensor).
        lr: peak learning rate (decayed along a half cosine to 0 at ``steps``).
        momentum: heavy-ball momentum ``μ`` (0: plain SGD).
        batch: rows per rank per step (the global batch is ``batch · p``).
        hidden: width of the hidden layer.
        seed: seeds the initial weights, the batch order and the compressors.
        algorithm: the all-reduce algorithm (a name from ``refcoll list``).
    """

    compressor: str = "none"
    steps: int = 400
    lr: float = 0.05
    momentum: float = 0.9
    batch: int = 32
    hidden: int = 64
    seed: int = 0
    algorithm: str = "ring"

    def __post_init__(self):
        for name in ("steps", "batch", "hidden"):
            if getattr(self, name) < 1:
                raise UsageError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if not (self.lr > 0 and self.lr <= _LARGEST_LR):  # (NaN and inf fail too)
            raise UsageError(f"--lr must be a positive number a float32 holds (at most "
                             f"{_LARGEST_LR:.4g}), got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise UsageError(f"--momentum must be in [0, 1), got {self.momentum}")
        if self.seed < 0:
            raise UsageError(f"--seed must be non-negative, got {self.seed}")
        algo = algorithms.get(self.algorithm)
        if "allreduce" not in algo.collectives:
            raise UsageError(f"algorithm {self.algorithm!r} has no all-reduce")
        if algo.workers is not None:
            raise UsageError(f"algorithm {self.algorithm!r} needs switch processes besides the "
                             "data ranks; train with an all-reduce every rank holds data for")
        self.make_compressor()

    def make_compressor(self):
        """Return the parsed compressor, or None for ``"none"`` (the plain all-reduce)."""
        compressor = parse(self.compressor)
        return None if compressor.identity else compressor


@dataclass
class EpochRecord:
    """Where training stood at the end of one epoch (or of the last, partial one).

    Attributes:
        epoch: 1-based epoch number.
        step: optimiser steps taken so far.
        loss: mean training loss over this epoch's steps, averaged over the ranks.
        test_accuracy: accuracy of the (shared) model on the test set.
        bytes_sent: gradient bytes sent per rank so far (mean over the ranks).
        dense_bytes: what the uncompressed all-reduce would have sent per rank so far.
    """

    epoch: int
    step: int
    loss: float
    test_accuracy: float
    bytes_sent: int
    dense_bytes: int

    @property
    def ratio(self) -> float:
        """Return dense bytes over bytes sent: how many times fewer bytes went on the wire.

        1 when neither sent anything (a single rank), inf when only the dense would have.
        """
        if not self.bytes_sent:
            return 1.0 if not self.dense_bytes else math.inf
        return self.dense_bytes / self.bytes_sent


@dataclass
class History:
    """The record of one run, the same on every rank.

    Attributes:
        config: the run's settings.
        world_size: ranks that trained.
        epochs: one record per epoch.
        params: the final weights by name (``W1``, ``b1``, ``W2``, ``b2``).
        steps_per_epoch: steps in a full epoch.
        train_rows: training rows over all ranks.
        test_rows: rows of the test set.
    """

    config: TrainConfig
    world_size: int
    epochs: list[EpochRecord] = field(default_factory=list)
    params: dict[str, np.ndarray] = field(default_factory=dict)
    steps_per_epoch: int = 0
    train_rows: int = 0
    test_rows: int = 0

    @property
    def final(self) -> EpochRecord:
        """Return the last epoch's record."""
        return self.epochs[-1]

    def to_dict(self) -> dict:
        """Return the run as JSON-ready data (without the weights)."""
        return {
            "compressor": self.config.compressor,
            "config": dataclasses.asdict(self.config),
            "world_size": self.world_size,
            "steps_per_epoch": self.steps_per_epoch,
            "train_rows": self.train_rows,
            "test_rows": self.test_rows,
            "epochs": [_record_dict(e) for e in self.epochs],
            "final": _record_dict(self.final),
        }


def _record_dict(record: EpochRecord) -> dict:
    """Return the record as JSON-ready data; an infinite ratio becomes null (JSON has no inf)."""
    return {**dataclasses.asdict(record),
            "ratio": record.ratio if math.isfinite(record.ratio) else None}


def batch_problem(batch: int, ranks: int, train_rows: int | None = None) -> str | None:
    """Return why ``batch`` rows per rank cannot make one step on ``ranks`` ranks (None: they
    can); ``train_rows``: the training split's rows (default: read the data)."""
    rows = len(load_digits_split()[1]) if train_rows is None else train_rows
    if rows // ranks // batch == 0:
        return (f"--batch {batch} is larger than a rank's shard of {rows // ranks} training "
                f"rows on {ranks} ranks")
    return None


def agree_settings(t, config, error: str = "") -> None:
    """Return once every rank of ``t`` holds the same ``config`` and none an ``error``.

    One argument agreement (:func:`refcoll.calls.agree.agree`) before any step, so
    ranks given different settings raise the same
    :class:`~refcoll.core.errors.MismatchError` naming them, and a rank's own
    objection (``error``: a batch its shard cannot fill, scikit-learn missing) is
    every rank's: the others raise a :class:`~refcoll.core.errors.UsageError` naming
    that rank, that rank its own. None is left waiting for the others.
    """
    with t.call("train"):
        agree(t, collective="train", options=repr(config), error=error)
    if error:
        raise UsageError(error)


def check_loss(loss: float, step: int) -> None:
    """Raise :class:`~refcoll.core.errors.RefcollError` unless ``loss`` is finite.

    ``loss``: the ranks' mean training loss at ``step``; the same on every rank, so
    every rank raises or none.
    """
    if not math.isfinite(loss):
        raise RefcollError(f"the training loss is {loss} at step {step}: training diverged; "
                           "lower --lr")


def load_digits_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Return ``(X_train, y_train, X_test, y_test)``: digits scaled to [0, 1], float32.

    Raises:
        UsageError: scikit-learn is not installed.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise UsageError(f"refcoll train needs scikit-learn: {EXAMPLES_HINT}") from None
    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    order = np.random.default_rng(_SPLIT_SEED).permutation(len(y))
    n_test = round(_TEST_FRACTION * len(y))
    train_rows, test_rows = order[:-n_test], order[-n_test:]
    return x[train_rows], y[train_rows], x[test_rows], y[test_rows]


#: The two-layer MLP's parameters by name, in the layered model's order.
NAMES = ("W1", "b1", "W2", "b2")


def init_params(n_in: int, hidden: int, seed: int) -> dict[str, np.ndarray]:
    """Return the :mod:`~refcoll.training.mlp` ``n_in``-``hidden``-10 model's tensors by name."""
    return dict(zip(NAMES, mlp.init_layers((n_in, hidden, _CLASSES), seed)))


def loss_and_grads(params: dict[str, np.ndarray], x: np.ndarray,
                   y: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
    """Return the mean softmax cross-entropy on ``(x, y)`` and its gradient per tensor."""
    loss, grads = mlp.loss_and_grads([params[name] for name in NAMES], x, y)
    return loss, dict(zip(NAMES, grads))


def accuracy(params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    """Return the fraction of rows of ``x`` whose predicted class is ``y``."""
    return mlp.accuracy([params[name] for name in NAMES], x, y)


def check_replicas(t, params: dict[str, np.ndarray], config: TrainConfig | None = None,
                   *, when: str = "") -> None:
    """Raise :class:`ReplicaDivergence` unless every rank holds the same weights and config.

    Compares a SHA-256 digest of the configuration and of every tensor's bytes:
    its elementwise max and min over the ranks agree with it on every rank exactly
    when all digests are equal. Every rank raises, so none is left waiting.
    """
    digest = hashlib.sha256(repr(config).encode())
    for name in sorted(params):
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(params[name]).tobytes())
    mine = np.frombuffer(digest.digest(), dtype=np.int32)
    high = allreduce(mine, t, op="max", validate=False)
    low = allreduce(mine, t, op="min", validate=False)
    if not (np.array_equal(high, mine) and np.array_equal(low, mine)):
        raise ReplicaDivergence(
            f"rank {t.rank}: the model replicas differ across ranks{' ' + when if when else ''}; "
            "every rank must run the same configuration and receive the same averaged gradient")


def _shard(x: np.ndarray, y: np.ndarray, rank: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    return x[rank::size], y[rank::size]


def train(comm, config: TrainConfig,
          on_epoch: Callable[[EpochRecord], None] | None = None) -> History:
    """Train the MLP data-parallel over the ranks of ``comm``; return the run's :class:`History`.

    Args:
        comm: an mpi4py communicator or a Transport (a ``SimWorld`` rank runs it
            in one process); every rank calls ``train`` with the same ``config``.
        config: the run's settings.
        on_epoch: called on every rank with each epoch's record as it ends.

    Raises:
        UsageError: bad settings, or scikit-learn missing (on any rank).
        MismatchError: the ranks were given different configs.
        ReplicaDivergence: the ranks' weights differ (checked every epoch).
        RefcollError: the loss stopped being finite (lower ``lr``).
    """
    t = as_transport(comm)
    compressor = config.make_compressor()
    try:
        x_train, y_train, x_test, y_test = load_digits_split()
        problem = batch_problem(config.batch, t.size, len(y_train)) or ""
    except UsageError as exc:
        problem = str(exc)
    agree_settings(t, config, problem)  # every rank raises, or none
    steps_per_epoch = len(y_train) // t.size // config.batch
    x_shard, y_shard = _shard(x_train, y_train, t.rank, t.size)
    params = init_params(x_train.shape[1], config.hidden, config.seed)
    velocity = {name: np.zeros_like(w) for name, w in params.items()}
    # One stream per tensor, seeded alike on every rank (random-k and PowerSGD draw from it).
    states = {name: compressor.new_state(seed=config.seed * len(params) + i, rank=t.rank)
              for i, name in enumerate(params)} if compressor is not None else {}
    history = History(config, t.size, steps_per_epoch=steps_per_epoch,
                      train_rows=len(y_train), test_rows=len(y_test))
    order_rng = np.random.default_rng([config.seed, 1, t.rank])
    check_replicas(t, params, config, when="before training")
    dense_per_step = sum(_dense_bytes(t, config.algorithm, w) for w in params.values())

    sent = dense = 0  # this rank's gradient bytes; every rank's dense bytes together
    losses: list[float] = []
    order = order_rng.permutation(len(y_shard))
    for step in range(config.steps):
        within = step % steps_per_epoch
        if within == 0 and step:
            order = order_rng.permutation(len(y_shard))
        rows = order[within * config.batch:(within + 1) * config.batch]
        loss, grads = loss_and_grads(params, x_shard[rows], y_shard[rows])
        losses.append(loss)
        lr = np.float32(config.lr * (1 + math.cos(math.pi * step / config.steps)) / 2)
        before = t.traffic.sent
        for name, grad in grads.items():
            if compressor is None:
                avg = allreduce(grad, t, op="avg", algorithm=config.algorithm, validate=False)
            else:
                avg, _ = compressed_allreduce(grad, t, op="avg", algorithm=config.algorithm,
                                              compressor=compressor, state=states.get(name),
                                              validate=False)
            velocity[name] *= config.momentum
            velocity[name] += avg
            params[name] -= lr * velocity[name]
        sent += t.traffic.sent - before
        dense += dense_per_step
        if within == steps_per_epoch - 1 or step == config.steps - 1:
            record = _end_epoch(t, params, losses, sent, dense, step + 1,
                                len(history.epochs) + 1, x_test, y_test)
            history.epochs.append(record)
            losses = []
            if on_epoch is not None:
                on_epoch(record)
    history.params = params
    return history


def _dense_bytes(t, algorithm: str, tensor: np.ndarray) -> int:
    """Return the bytes all ranks together send in the uncompressed all-reduce of ``tensor``."""
    if algorithms.get(algorithm).chooses:  # auto: price the algorithm it runs for this size
        algorithm = resolve(t, "allreduce", tensor.size, tensor.itemsize)
    return algorithms.get(algorithm).costs["allreduce"](t.size, tensor.size, tensor.itemsize).bytes


def _end_epoch(t, params, losses, sent, dense, step, epoch, x_test, y_test) -> EpochRecord:
    """Average the epoch's loss and byte counts over the ranks, check the replicas, test."""
    totals = allreduce(np.array([sum(losses), len(losses)], np.float64), t, op="sum",
                       validate=False)
    loss = float(totals[0] / totals[1])
    check_loss(loss, step)
    sent_by_all = allreduce(np.array([sent], np.int64), t, op="sum", validate=False)
    check_replicas(t, params, when=f"after step {step}")
    return EpochRecord(epoch=epoch, step=step, loss=loss,
                       test_accuracy=accuracy(params, x_test, y_test),
                       bytes_sent=int(sent_by_all[0]) // t.size, dense_bytes=dense // t.size)


def plot_histories(histories: list[History], path: str) -> None:
    """Draw test accuracy against cumulative bytes sent per rank, one line per run.

    Raises:
        UsageError: matplotlib is not installed.
    """
    fig = figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for h in histories:
        xs = [e.bytes_sent for e in h.epochs]
        ys = [100 * e.test_accuracy for e in h.epochs]
        ax.plot(xs, ys, marker="o", markersize=3,
                label=f"{h.config.compressor} ({100 * h.final.test_accuracy:.1f}%)")
    first = histories[0]
    if any(e.bytes_sent > 0 for h in histories for e in h.epochs):
        ax.set_xscale("log")  # (one rank sends nothing: its points stay at 0, on a line)
    ax.set_xlabel("gradient bytes sent per rank (cumulative)")
    ax.set_ylabel("test accuracy (%)")
    ranks = f"{first.world_size} rank{'' if first.world_size == 1 else 's'}"
    ax.set_title(f"digits MLP, {ranks}, {first.config.steps} steps, "
                 f"{first.config.algorithm} all-reduce")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save(fig, path, dpi=120)
