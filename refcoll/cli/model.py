"""`refcoll model`: the cluster cost model, and its calibration against this machine."""

from __future__ import annotations

import math
import os
import sys

import click

from ..core.errors import UsageError
from ..core.units import human_bytes as _bytes
from ..core.units import human_time as _time
from ..measure import model as m
from ..measure.model import BANDWIDTH_UNITS, CALIBRATE_LIMIT, MAX_BUCKETS, MAX_GPUS
from ..transport.mpi import MPITransport
from . import launch
from .common import check_output_paths, main, reports_errors, split_list, write_json

__all__ = ["model"]


@main.command("model")
@click.option("--nodes", metavar="N",
              help=f"Nodes in the cluster, a whole number >= 1 (nodes × GPUs per node: at most "
                   f"{MAX_GPUS}).")
@click.option("--gpus-per-node", metavar="G", help="GPUs (ranks) per node, a whole number >= 1.")
@click.option("--intra-bw", help=f"Intra-node bandwidth per GPU with its unit, e.g. 900GB/s "
                                 f"(NVLink). Units: {BANDWIDTH_UNITS}; a number without a unit "
                                 f"is refused.")
@click.option("--inter-bw", help="Inter-node bandwidth per GPU with its unit, e.g. 400Gb/s or "
                                 "50GB/s (its NIC).")
@click.option("--bidirectional/--unidirectional", default=None,
              help="Whether both bandwidths count both directions added (then each direction "
                   "carries half) or one direction. Required unless each link says.")
@click.option("--intra-quoted", type=click.Choice(["unidirectional", "bidirectional"]),
              default=None, help="How --intra-bw is quoted, overriding the flag above.")
@click.option("--inter-quoted", type=click.Choice(["unidirectional", "bidirectional"]),
              default=None, help="How --inter-bw is quoted, overriding the flag above.")
@click.option("--intra-latency", default="2us", show_default=True,
              help="Intra-node latency per message with its unit (ns, us, ms, s), or 0.")
@click.option("--inter-latency", default="5us", show_default=True,
              help="Inter-node latency per message with its unit, or 0.")
@click.option("--in-network", is_flag=True,
              help="The switches can reduce (SHARP): price the in-network all-reduces too, on "
                   "each GPU's inter-node link (--inter-bw, --inter-latency).")
@click.option("--reduce-bw", default="1TB/s", show_default=True,
              help="Element-wise reduction rate on a GPU, bytes of one operand per second, with "
                   "its unit (0: free).")
@click.option("--params", metavar="N",
              help="Parameter count, a whole number >= 1, e.g. 1.3e9 (one flat gradient).")
@click.option("--layers", "layers_file", type=click.Path(exists=True, dir_okay=False),
              help="JSON list of parameter shapes, or object name -> shape, in forward order.")
@click.option("--bytes-per-element", default="4", show_default=True, metavar="2|4|8",
              help="Gradient element size: 2 (float16), 4 (float32) or 8 (float64).")
@click.option("--forward", default="0", show_default=True,
              help="Forward time per step, e.g. 50ms (a number without a unit is seconds; "
                   ">= 0).")
@click.option("--backward", default="0", show_default=True,
              help="Backward time per step, e.g. 0.1s (>= 0).")
@click.option("--algorithm", default="all", show_default=True,
              help=f"All-reduce algorithms, comma-separated, or all: "
                   f"{m.choices_text(m.ALGORITHMS)}. With --calibrate: default "
                   f"{','.join(m.CALIBRATE_DEFAULT)}.")
@click.option("--inter", default="ring", show_default=True,
              help=f"The hierarchical all-reduce's algorithm across nodes: "
                   f"{m.choices_text(m.INTER_ALGORITHMS, joiner='or')}.")
@click.option("--compressor", default=None, help="Compressor spec, e.g. topk:ratio=0.01 or "
                                                 "ef(powersgd:rank=4).")
@click.option("--pattern", type=click.Choice(["allreduce", "gather", "twophase"]), default=None,
              help="Compressed collective pattern [default: the compressor's own].")
@click.option("--buckets", default=None, metavar="B",
              help=f"Gradient buckets all-reduced during the backward pass: 1 (one bucket, no "
                   f"overlap) up to the number of parameters and at most {MAX_BUCKETS} "
                   f"[default: 1].")
@click.option("--bucket-size", default=None,
              help="Bucket size instead of a count, e.g. 25MB (PyTorch DDP's bucket_cap_mb); "
                   "it must make at most as many buckets as --buckets allows.")
@click.option("--calibrate", is_flag=True,
              help="Measure α, β, γ on this machine under mpiexec and compare predicted "
                   "all-reduce times with measured ones.")
@click.option("-n", "--np", "nprocs", default="2", show_default=True, metavar="N",
              help="With --calibrate: processes to start with mpiexec (>= 2).")
@click.option("--sizes", default="64K..64M", show_default=True,
              help=f"With --calibrate: buffer sizes, a doubling range A..B or a list, each at "
                   f"most {CALIBRATE_LIMIT >> 30}G.")
@click.option("--json", "json_file", type=click.Path(),
              help="Write the report as JSON (its folder must exist).")
@reports_errors
def model(nodes, gpus_per_node, intra_bw, inter_bw, bidirectional, intra_quoted, inter_quoted,
          intra_latency, inter_latency,
          in_network, reduce_bw, params, layers_file, bytes_per_element, forward, backward,
          algorithm, inter, compressor, pattern, buckets, bucket_size, calibrate, nprocs, sizes,
          json_file):
    """Model all-reduce and step time on a described cluster, or calibrate against this one.

    Prints each algorithm's all-reduce time with its phases, the compressed
    collective, and the step time with the speed-up of each technique stacked
    (topology, compression, overlap). Units: bandwidths 300GB/s, 200Gb/s,
    100Gbps (a unit is required); latencies 2us, 500ns (a unit is required,
    but for 0); forward and backward 50ms or 0.05 (seconds); sizes 64K (KiB),
    25MB. Every number must be finite and not negative; counts and bandwidths
    positive. The GPUs in all and the buckets are bounded: see --nodes and --buckets.
    """
    check_output_paths(json=json_file)
    if calibrate:
        _calibrate(nprocs, algorithm, sizes, json_file)
        return
    layers_text = None
    if layers_file is not None:
        with open(layers_file, encoding="utf-8") as fh:
            layers_text = fh.read()
    result = m.plan_from_text(
        nodes=nodes, gpus_per_node=gpus_per_node, intra_bw=intra_bw, inter_bw=inter_bw,
        bidirectional=bidirectional, intra_quoted=intra_quoted, inter_quoted=inter_quoted,
        intra_latency=intra_latency, inter_latency=inter_latency, in_network=in_network,
        reduce_bw=reduce_bw, params=params, layers_text=layers_text,
        bytes_per_element=bytes_per_element, forward=forward, backward=backward,
        algorithm=algorithm, inter=inter, compressor=compressor, pattern=pattern,
        buckets=buckets, bucket_size=bucket_size)
    write_json(json_file, result.to_json())  # first: a reader that leaves early loses no file
    _print_plan(result)  # click.echo flushes each line, so a closed pipe is met in here


def _calibrate(nprocs, algorithm, sizes, json_file) -> None:
    nprocs, byte_sizes = m.calibration_request(nprocs, sizes)
    names = (split_list(algorithm, m.calibration_choices(), "algorithm")
             or list(m.CALIBRATE_DEFAULT))
    if not launch.in_mpi_job():
        launch.relaunch(nprocs)
    from mpi4py import MPI

    t = MPITransport(MPI.COMM_WORLD, collective="refcoll model --calibrate")
    launch.data_ranks(t, nprocs)  # says so when the job's size overrules -n
    if t.size < 2:
        raise UsageError("--calibrate needs at least 2 processes to measure messages")
    result = m.compare_with_measurement(t, names, byte_sizes)
    if t.rank == 0:
        library = MPI.Get_library_version().splitlines()[0].strip()
        write_json(json_file, {"ranks": t.size, "cores": os.cpu_count(), "library": library,
                               **result.to_json()})
        _print_calibration(result, library)
    sys.stdout.flush()


# ------------------------------------------------------------------------------ printing

def _phases(estimate) -> str:
    parts = []
    for ph in estimate.phases:
        if ph.seconds or ph.rounds:
            link = f" [{ph.link}]" if ph.link != "local" else ""
            parts.append(f"{ph.name} {_time(ph.seconds)}{link}")
    return ", ".join(parts)


def _print_plan(result) -> None:
    c, w = result.cluster, result.workload
    intra_a, intra_b = c.link("intra")
    inter_a, inter_b = c.link("inter")
    reduction = f"{_bytes(c.reduce_bw)}/s" if c.reduce_bw else "free"
    click.echo(f"cluster: {c.nodes} nodes × {c.gpus_per_node} GPUs = {c.gpus} GPUs; per GPU and "
               f"direction: intra {_bytes(1 / intra_b)}/s, {_time(intra_a)}; inter "
               f"{_bytes(1 / inter_b)}/s, {_time(inter_a)}; in-network reduction: "
               f"{'yes' if c.in_network else 'no'}; reduction {reduction}")
    tensors = f"{len(w.shapes)} tensor{'s' if len(w.shapes) > 1 else ''}"
    click.echo(f"model: {w.elements:,} parameters ({tensors}) × "
               f"{w.bytes_per_element} B = {_bytes(w.nbytes)}; forward {_time(w.forward)}, "
               f"backward {_time(w.backward)}")
    click.echo("")
    click.echo(f"all-reduce of the gradient ({_bytes(w.nbytes)}), dense:")
    click.echo(f"  {'algorithm':<26} {'time':>9} {'bytes/GPU':>10}  phases [link]")
    for est in sorted(result.dense, key=lambda e: e.seconds):
        click.echo(f"  {est.algorithm:<26} {_time(est.seconds):>9} {_bytes(est.bytes):>10}  "
                   f"{_phases(est)}")
    if result.compressed is not None:
        e = result.compressed
        click.echo("")
        click.echo(f"compressed: {e.compressor}, pattern {e.pattern}, {e.algorithm}: payload "
                   f"{_bytes(e.payload)} per GPU for {_bytes(e.dense)} dense "
                   f"({e.dense / e.payload if e.payload else math.inf:.3g}×), "
                   f"{_time(e.seconds)} with {_bytes(e.bytes)} on the wire per GPU")
        click.echo(f"  {_phases(e)}")
    click.echo("")
    click.echo("step time, techniques stacked:")
    click.echo(f"  {'step':<24} {'collective':<26} {'buckets':>7} {'comm':>9} {'exposed':>9} "
               f"{'step':>9} {'comm %':>7} {'speed-up':>9} {'vs prev':>8}")
    for row in result.stack:
        click.echo(f"  {row.label:<24} {row.algorithm:<26} {row.buckets:>7} {_time(row.comm):>9} "
                   f"{_time(row.exposed):>9} {_time(row.step):>9} {100 * row.fraction:>6.1f}% "
                   f"{row.speedup:>8.2f}× {row.gain:>7.2f}×")
    for note in result.notes:
        click.echo(f"note: {note}")


def _print_calibration(result, library: str) -> None:
    cal, rows = result.calibration, result.rows
    click.echo(f"refcoll model --calibrate: {cal.ranks} ranks on {os.cpu_count()} cores, "
               f"{library}")
    click.echo(f"ping-pong fit: α = {_time(cal.alpha)}, β = {cal.beta * 1e9:.4g} ns/B "
               f"({_bytes(1 / cal.beta) if cal.beta > 0 else 'inf'}/s); γ = "
               f"{cal.gamma_per_byte * 1e9:.4g} ns/B; call {_time(cal.call)}")
    click.echo(f"  {'algorithm':<26} {'size':>8} {'predicted':>10} {'α-β-γ fit':>10} "
               f"{'measured':>10} {'pred/meas':>9}")
    for r in rows:
        size = _bytes(r["bytes"], "g", binary=True)
        click.echo(f"  {r['algorithm']:<26} {size:>8} {_time(r['predicted']):>10} "
                   f"{_time(r['predicted_fit']):>10} {_time(r['measured']):>10} "
                   f"{r['ratio']:>9.2f}")
    click.echo(f"{result.within()} of {len(rows)} predictions within 30% of the measured time "
               f"(α-β-γ fit: {result.within(fit=True)})")
    if result.others is not None:
        click.echo(f"other processes used {100 * result.others:.0f}% of the machine's CPU "
                   f"meanwhile" + ("; the timings shared the cores, rerun on an idle machine"
                                   if result.others > 0.05 else ""))
