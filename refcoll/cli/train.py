"""`refcoll train`: data-parallel SGD on the digits data, once per compressor, or with overlap."""

from __future__ import annotations

import importlib.util
import os
import sys

import click

from ..calls.collectives import as_transport
from ..core.errors import UsageError
from ..core.plot import require_matplotlib
from ..core.units import human_bytes
from ..training.overlap import OverlapConfig, parse_widths, plot_timeline, run_overlap
from ..training.train import EXAMPLES_HINT, TrainConfig, batch_problem, plot_histories
from ..training.train import train as train_model
from . import launch
from .common import (
    check_output_paths,
    check_output_paths_on_lead,
    main,
    reports_errors,
    require_processes,
    write_json,
)
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
              help="Draw test accuracy against bytes sent, all runs in one figure (PNG); with "
                   "--layers, one step's timeline of compute and each bucket's all-reduce.")
@click.option("--layers", "layers", metavar="W0,W1,...",
              help="Train an MLP of these widths through the bucketed Reducer, timed with and "
                   "without overlap (replaces --hidden; digits: 64,...,10).")
@click.option("--synthetic", is_flag=True, default=None,
              help="With --layers: random inputs and labels from the seed (any input width).")
@click.option("--overlap/--no-overlap", "overlap", default=None,
              help="With --layers: run the overlapped variant besides compute-only and no "
                   "overlap [default: overlap].")
@click.option("--bucket-mb", type=float, default=None,
              help="With --layers: bucket cap in MiB, the first bucket's too, as DDP's "
                   "bucket_cap_mb is in torch 2.13 [default: 25, the first bucket 1 MiB].")
@reports_errors
def train(nprocs, compressors, steps, lr, momentum, batch, hidden, seed, algorithm, json_file,
          plot_file, layers, synthetic, overlap, bucket_mb):
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

    With --layers, the gradients go through refcoll.Reducer and three variants
    run interleaved step by step: compute-only (no reduction: its replica
    learns from its own rank's gradient), overlap (buckets launched during
    backward) and no overlap (every bucket after backward), each with its own
    replica; the two reducing replicas stay bit-identical (checked: status 1
    otherwise, as for a training loss that stops being finite). Rank 0 prints their
    medians (ms): step, compute (forward + backward), comm (the buckets'
    all-reduces), exposed (step minus the compute-only step), hidden (comm -
    exposed), the overlap model's predicted exposed time, and the `refcoll
    model` line that prices the same step. Started here, each rank gets one BLAS
    thread (OMP_NUM_THREADS etc. unless set), so the ranks and the progress
    thread share the cores without oversubscribing them. JSON with --layers: {"command",
    "mode": "overlap", "world_size", "config", "parameters", "gradient_bytes",
    "variants": {name: {"overlap", "bucket_mb", "step", "forward", "backward",
    "compute", "after_backward", "update", "comm", "tail" (the last bucket's end
    after the backward pass), and but for compute: "exposed", "hidden", "buckets":
    [{"index", "bytes"}], "predicted": {"exposed", "hidden", "bucket_comm",
    "backward"}, "model_command", "model_exposed", "vs_compute" (step over the
    compute-only step), "speedup" (the no-overlap step over this one),
    "timeline": {"forward", "layers", "buckets": [{"index", "bytes", "ready",
    "launched", "started", "finished"}], "step", "update"}}}, "blocking": [{"bytes",
    "seconds"}], "fit": {"alpha", "beta", "algorithm"}, "layer_seconds",
    "loss", "test_accuracy", "replicas_identical"}; seconds, rank 0's clock.
    """
    if layers is None and (synthetic, overlap, bucket_mb) != (None, None, None):
        raise UsageError("--synthetic, --overlap/--no-overlap and --bucket-mb train the layered "
                         "model: give --layers too, e.g. --layers 64,1024,1024,10")
    if layers is not None:
        _overlap(nprocs, compressors, json_file, plot_file, OverlapConfig(
            parse_widths(layers), steps=steps, lr=lr, momentum=momentum, batch=batch, seed=seed,
            algorithm=algorithm, bucket_mbs=(25.0 if bucket_mb is None else bucket_mb,),
            first_bucket_mb=1.0 if bucket_mb is None else bucket_mb,
            overlap=overlap is not False, synthetic=bool(synthetic)))
        return
    if not launch.in_mpi_job():
        # Before anything runs. Inside an MPI job only rank 0 writes the files, so
        # only it checks (_train_in_world): another node may lack the folder.
        check_output_paths(json=json_file, plot=plot_file)
    require_processes(nprocs)
    configs = [TrainConfig(compressor=spec, steps=steps, lr=lr, momentum=momentum, batch=batch,
                           hidden=hidden, seed=seed, algorithm=algorithm) for spec in compressors]
    if importlib.util.find_spec("sklearn") is None:
        raise UsageError(f"refcoll train needs scikit-learn: {EXAMPLES_HINT}")
    if plot_file:
        require_matplotlib()
    if not launch.in_mpi_job():
        relaunch(nprocs)
    _train_in_world(nprocs, configs, json_file, plot_file)


def _train_in_world(nprocs, configs, json_file, plot_file) -> None:
    MPI = launch.start_mpi("refcoll train")

    check_output_paths_on_lead(MPI.COMM_WORLD, "refcoll train", json=json_file, plot=plot_file)
    t = as_transport(MPI.COMM_WORLD, "refcoll train")
    lead = t.rank == 0
    first = configs[0]
    launch.data_ranks(t, nprocs)  # notes, on rank 0, an -n the job's size overrules
    _refuse_batch(t, first.batch)
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


def _refuse_batch(t, batch: int) -> None:
    """End every rank with status 2 if ``batch`` rows per rank cannot make one step.

    :func:`~refcoll.training.train.batch_problem` gives every rank the same answer, so
    every rank stops; rank 0 alone says why, once, before any output.
    """
    problem = batch_problem(batch, t.size)
    if problem:
        if t.rank == 0:
            raise UsageError(problem)
        sys.exit(2)


#: One BLAS thread per rank unless the user says otherwise: ranks that each start a
#: thread per core oversubscribe the cores, and the progress thread needs one too.
_BLAS_THREADS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def _overlap(nprocs, compressors, json_file, plot_file, config: OverlapConfig) -> None:
    if tuple(compressors) != ("none",):
        raise UsageError("--layers reduces dense gradients: leave out --compressor")
    if not launch.in_mpi_job():
        check_output_paths(json=json_file, plot=plot_file)
    require_processes(nprocs)
    if not config.synthetic and importlib.util.find_spec("sklearn") is None:
        raise UsageError(f"refcoll train needs scikit-learn for the digits: {EXAMPLES_HINT} "
                         "(or give --synthetic)")
    if plot_file:
        require_matplotlib()
    if not launch.in_mpi_job():
        relaunch(nprocs, env={name: "1" for name in _BLAS_THREADS if name not in os.environ})
    MPI = launch.start_mpi("refcoll train")

    check_output_paths_on_lead(MPI.COMM_WORLD, "refcoll train", json=json_file, plot=plot_file)
    t = as_transport(MPI.COMM_WORLD, "refcoll train")
    launch.data_ranks(t, nprocs)
    if not config.synthetic:  # synthetic data: batch · 8 rows per rank, whatever the batch
        _refuse_batch(t, config.batch)
    c = config
    if t.rank == 0:
        click.echo(f"refcoll train --layers: {t.size} ranks, MLP {'-'.join(map(str, c.widths))}, "
                   f"{'synthetic data' if c.synthetic else 'digits'}, {c.steps} steps, batch "
                   f"{c.batch} per rank, {c.algorithm} all-reduce, buckets of "
                   f"{c.bucket_mbs[-1]:g} MiB (first {c.first_bucket_mb:g} MiB); variants "
                   f"interleaved step by step, medians of the steps after the first {c.warmup}")
    result = run_overlap(t, config)
    if t.rank != 0:
        return
    click.echo(f"{result.parameters:,} parameters, {human_bytes(4 * result.parameters)} of "
               "float32 gradients; times in ms, rank 0")
    click.echo(f"{'variant':<12} {'buckets':>7} {'step':>8} {'compute':>8} {'comm':>8} "
               f"{'exposed':>8} {'hidden':>8} {'tail':>8} {'predicted':>9} {'model':>8} "
               f"{'vs compute':>10} {'speed-up':>8}")
    for name, row in result.variants.items():
        ms = [f"{1e3 * row[k]:>8.2f}" for k in ("step", "compute", "comm")]
        if row["overlap"] is None:
            click.echo(f"{name:<12} {'-':>7} {' '.join(ms)}")
            continue
        click.echo(f"{name:<12} {len(row['buckets']):>7} {' '.join(ms)} "
                   f"{1e3 * row['exposed']:>8.2f} {1e3 * row['hidden']:>8.2f} "
                   f"{1e3 * row['tail']:>8.2f} "
                   f"{1e3 * row['predicted']['exposed']:>9.2f} {1e3 * row['model_exposed']:>8.2f} "
                   f"{row['vs_compute']:>9.2f}× {row['speedup']:>7.2f}×")
    alpha, beta, _ = result.link
    click.echo(f"tail: the last bucket's end after the backward pass; predicted: the overlap "
               f"model on the buckets' measured ready times and lone all-reduces; model: "
               f"refcoll model with α {1e6 * alpha:.3g} µs, {human_bytes(1 / beta)}/s fitted to "
               f"them:")
    for name, row in result.variants.items():
        if row["overlap"] is not None:
            click.echo(f"  {name}: {row['model_command']}")
    click.echo(f"replicas bit-identical across variants: {'yes' if result.identical else 'NO'}; "
               f"training loss (last steps) {result.loss:.4f}"
               + ("" if result.test_accuracy is None
                  else f"; test accuracy {100 * result.test_accuracy:.2f}%"))
    write_json(json_file, result.to_json())
    if plot_file:
        plot_timeline(result, plot_file)
        click.echo(f"plot: {plot_file}")
