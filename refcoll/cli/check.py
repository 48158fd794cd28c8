"""The oracle's commands: ``gen-inputs``, ``oracle`` and ``check``.

``gen-inputs`` writes deterministic inputs, ``oracle`` writes what an algorithm
returns for them bit for bit, and ``check`` judges another implementation's
outputs (:mod:`refcoll.verify.oracle`).
"""

from __future__ import annotations

import sys

import click

from .. import algorithms
from ..core.errors import UsageError
from ..core.ops import get_dtype, get_op
from ..verify.inputs import make_inputs, read_rank_files, write_rank_files
from ..verify.oracle import check_outputs, expected_outputs
from ..verify.simulation import simulation_bytes
from .common import (check_output_directory, check_output_paths, main, out_of_memory_is_usage,
                     reports_errors, require_memory, write_json)

__all__ = ["gen_inputs", "oracle", "check"]


# -------------------------------------------------------------------- the oracle

_KINDS = ["exact", "random", "adversarial"]


@main.command("gen-inputs")
@click.option("-p", "--procs", "p", type=click.IntRange(min=1), required=True,
              help="Number of ranks.")
@click.option("--count", type=click.IntRange(min=0), required=True, help="Elements per rank.")
@click.option("--dtype", default="float32", show_default=True)
@click.option("--kind", type=click.Choice(_KINDS), default="random", show_default=True)
@click.option("--op", default="sum", show_default=True,
              help="The op the inputs are made exact for.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.argument("directory", type=click.Path(file_okay=False))
@reports_errors
def gen_inputs(p, count, dtype, kind, op, seed, directory):
    """Write rank<r>.npy inputs for P ranks (and meta.json) into DIRECTORY.

    exact: float results exact in any order (nccl-tests' verifiable inputs);
    random: normal values; adversarial: cancelling large values that expose the
    reduction order. bfloat16 and float8 are stored as their integer bits.
    """
    check_output_directory("DIRECTORY", directory)
    dt = get_dtype(dtype)
    reduction = get_op(op)
    what = f"generating {p} inputs of {count} x {dtype}"
    advice = "lower --count or -p"
    # Every rank's input is held at once, beside one float64/int64 draw.
    require_memory(p * count * dt.itemsize + 8 * count, what, advice)
    with out_of_memory_is_usage(what, advice):
        arrays = make_inputs(kind, dt, count, p, op=reduction.name, seed=seed)
    write_rank_files(directory, arrays, meta={"p": p, "count": count, "kind": kind,
                                              "op": reduction.name, "seed": seed})
    click.echo(f"wrote {p} inputs of {count} x {dtype} ({kind}) to {directory}")


def _collective_options(f):
    f = click.option("--root", type=click.IntRange(min=0), default=0, show_default=True,
                     help="Root of broadcast and reduce.")(f)
    f = click.option("--collective", type=click.Choice(list(algorithms.COLLECTIVES)),
                     default="allreduce", show_default=True)(f)
    f = click.option("--op", default="sum", show_default=True)(f)
    return f


@main.command()
@click.option("--algorithm", required=True, help="The algorithm whose results to predict.")
@_collective_options
@click.argument("in_dir", type=click.Path(file_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@reports_errors
def oracle(algorithm, op, collective, root, in_dir, out_dir):
    """Write the expected per-rank outputs of ALGORITHM for IN_DIR's inputs, bit for bit."""
    check_output_directory("OUT_DIR", out_dir)
    algorithms.implementation(algorithm, collective)
    inputs = read_rank_files(in_dir)
    if any(x is None for x in inputs):
        raise UsageError(f"{in_dir}: rank files are missing (need rank0.npy .. "
                         f"rank{len(inputs) - 1}.npy)")
    if root >= len(inputs):
        raise UsageError(f"--root {root} is not one of the {len(inputs)} ranks")
    what = f"predicting {algorithm} {collective} for {len(inputs)} ranks"
    advice = "predict fewer or smaller inputs"
    require_memory(simulation_bytes(collective, len(inputs), inputs[0].size,
                                    inputs[0].dtype.itemsize), what, advice)
    with out_of_memory_is_usage(what, advice):
        outputs = expected_outputs(collective, inputs, algorithm=algorithm, op=get_op(op).name,
                                   root=root)
    write_rank_files(out_dir, outputs, meta={"algorithm": algorithm, "collective": collective,
                                             "op": get_op(op).name, "root": root})
    click.echo(f"wrote {sum(o is not None for o in outputs)} expected outputs of {algorithm} "
               f"{collective} to {out_dir}")


@main.command()
@click.option("--algorithm", default=None,
              help="Also require bit-exactness against this algorithm.")
@click.option("--any", "any_order", is_flag=True,
              help="Judge without a declared algorithm (the default).")
@_collective_options
@click.option("--json", "json_file", type=click.Path(dir_okay=False),
              help="Write the whole report as JSON.")
@click.argument("in_dir", type=click.Path(file_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@reports_errors
def check(algorithm, any_order, op, collective, root, json_file, in_dir, out_dir):
    """Judge another implementation's outputs (OUT_DIR/rank<r>.npy) for IN_DIR's inputs.

    Exit 0 conforming, 1 not conforming, 2 the files cannot be judged.
    """
    check_output_paths(json=json_file)
    if algorithm and any_order:
        raise UsageError("give --algorithm A or --any, not both")
    if algorithm:
        algorithms.implementation(algorithm, collective)
    inputs = read_rank_files(in_dir)
    if root >= len(inputs):
        raise UsageError(f"--root {root} is not one of the {len(inputs)} ranks")
    outputs = read_rank_files(out_dir, dtype=inputs[0].dtype, size=len(inputs))
    with out_of_memory_is_usage(f"judging {len(inputs)} ranks' outputs",
                                "judge fewer or smaller outputs"):
        report = check_outputs(inputs, outputs, collective=collective, op=get_op(op).name,
                               algorithm=algorithm, root=root)
    against = f", against {algorithm}" if algorithm else ""
    click.echo(f"refcoll check: {collective} {report.op}, {report.ranks} ranks, {report.count} x "
               f"{report.dtype}{against}")
    click.echo(f"{'check':<42} {'result':<7} detail")
    for f in report.findings:
        click.echo(f"{f.check:<42} {'ok' if f.passed else 'FAIL':<7} {f.detail}")
    click.echo("verdict: " + ("conforming" if report.conforming else "not conforming"))
    write_json(json_file, report.to_json())
    sys.exit(0 if report.conforming else 1)
