"""`refcoll train`: data-parallel SGD on the digits data, once per compressor."""

from __future__ import annotations

import importlib.util

import click

from ..calls.collectives import as_transport
from ..core.errors import UsageError
from ..train import EXAMPLES_HINT, TrainConfig, plot_histories
from ..train import train as train_model
from . import launch
from .common import (check_output_paths, check_output_paths_on_lead, main, reports_errors,
                     require_processes, write_json)
from .launch import relaunch

__all__ = ["train"]


@main.command("train")
@click.option("-n", "--np", "nprocs", type=int, default=4, show_default=True,
              help="Processes to start with mpiexec (ignored inside an MPI job).")
@click.option("--compressor", "compressors", multiple=True, default=("none",), show_default=True,
              help="Compressor spec (none, topk:ratio=0.01, ef(sign), qsgd, powersgd:rank=2...); "
                   "repeat it to train once per compressor.")
@click.option("--steps", type=int, default=400, show_default=True, help="Optimiser steps per run.")
@click.option("--lr", type=float, default=0.05, show_default=True,
              help="Peak learning rate (decayed along a half cosine).")
@click.option("--momentum", type=float, default=0.9, show_default=True,
              help="Momentum (0: plain SGD).")
@click.option("--batch", type=int, default=32, show_default=True, help="Rows per rank per step.")
@click.option("--hidden", type=int, default=64, show_default=True,
              help="Width of the hidden layer.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed of the weights, the batch order and the compressors.")
@click.option("--algorithm", default="ring", show_default=True, help="All-reduce algorithm.")
@click.option("--json", "json_file", type=click.Path(dir_okay=False),
              help="Write every run as JSON.")
@click.option("--plot", "plot_file", type=click.Path(dir_okay=False),
              help="Draw test accuracy against bytes sent, all runs in one figure (PNG).")
@reports_errors
def train(nprocs, compressors, steps, lr, momentum, batch, hidden, seed, algorithm, json_file,
          plot_file):
    """Train a small MLP on the digits data over N ranks; print accuracy and bytes per epoch.

    Each rank trains on its shard of the training rows and the gradients are
    averaged with refcoll's all-reduce, through each --compressor in turn (same
    seed, same steps). Rank 0 prints a row per epoch (loss, test accuracy,
    gradient bytes sent per rank so far, the uncompressed all-reduce's bytes,
    their ratio), then a summary. Needs scikit-learn: pip install 'refcoll[examples]'.

    JSON: {"command": "train", "world_size": p, "runs": [{"compressor", "config",
    "world_size", "steps_per_epoch", "train_rows", "test_rows", "epochs": [{"epoch",
    "step", "loss", "test_accuracy", "bytes_sent", "dense_bytes", "ratio"}], "final":
    {"test_accuracy", "loss", "bytes_sent", "dense_bytes", "ratio"}}]}.
    """
    if not launch.in_mpi_job():
        # Before anything runs. Inside an MPI job only rank 0 writes the files, so
        # only it checks (_train_in_world): another node may lack the folder.
        check_output_paths(json=json_file, plot=plot_file)
    require_processes(nprocs)
    configs = [TrainConfig(compressor=spec, steps=steps, lr=lr, momentum=momentum, batch=batch,
                           hidden=hidden, seed=seed, algorithm=algorithm) for spec in compressors]
    if importlib.util.find_spec("sklearn") is None:
        raise UsageError(f"refcoll train needs scikit-learn: {EXAMPLES_HINT}")
    if plot_file and importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib: pip install 'refcoll[plot]'")
    if not launch.in_mpi_job():
        relaunch(nprocs)
    _train_in_world(nprocs, configs, json_file, plot_file)


def _train_in_world(nprocs, configs, json_file, plot_file) -> None:
    from mpi4py import MPI

    check_output_paths_on_lead(MPI.COMM_WORLD, "refcoll train", json=json_file, plot=plot_file)
    t = as_transport(MPI.COMM_WORLD, "refcoll train")
    lead = t.rank == 0
    first = configs[0]
    launch.data_ranks(t, nprocs)  # notes, on rank 0, an -n the job's size overrules
    if lead:
        click.echo(f"refcoll train: {t.size} ranks, digits MLP 64-{first.hidden}-10, "
                   f"{first.steps} steps, batch {first.batch} per rank, lr {first.lr:g} "
                   f"(cosine), momentum {first.momentum:g}, seed {first.seed}, "
                   f"{first.algorithm} all-reduce")

    def show(record) -> None:
        if lead:
            click.echo(f"{record.epoch:>6} {record.step:>6} {record.loss:>8.4f} "
                       f"{100 * record.test_accuracy:>8.2f}% {record.bytes_sent:>14} "
                       f"{record.dense_bytes:>14} {record.ratio:>8.1f}")

    histories = []
    for config in configs:
        if lead:
            click.echo(f"\n== {config.compressor}")
            click.echo(f"{'epoch':>6} {'step':>6} {'loss':>8} {'test acc':>9} "
                       f"{'bytes sent':>14} {'dense bytes':>14} {'ratio':>8}")
        histories.append(train_model(t, config, on_epoch=show))
    if not lead:
        return
    width = max(len("compressor"), *(len(c.compressor) for c in configs))
    click.echo(f"\nsummary ({histories[0].test_rows} test rows; bytes are gradient bytes sent "
               "per rank, mean over ranks):")
    click.echo(f"{'compressor':<{width}} {'test acc':>9} {'loss':>8} {'bytes sent':>14} "
               f"{'dense bytes':>14} {'ratio':>8}")
    for h in histories:
        f = h.final
        click.echo(f"{h.config.compressor:<{width}} {100 * f.test_accuracy:>8.2f}% {f.loss:>8.4f} "
                   f"{f.bytes_sent:>14} {f.dense_bytes:>14} {f.ratio:>8.1f}")
    write_json(json_file, {"command": "train", "world_size": t.size,
                           "runs": [h.to_dict() for h in histories]})
    if plot_file:
        plot_histories(histories, plot_file)
        click.echo(f"plot: {plot_file}")
