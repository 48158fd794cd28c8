"""`refcoll model`: the cluster cost model, and its calibration against this machine."""

from __future__ import annotations

import dataclasses
import math
import os
import sys

import click
from click.core import ParameterSource

from .. import model as m
from ..core.errors import UsageError
from ..core.reading import MAX_JSON_BYTES, read_text
from ..core.topology import model_notes, model_options
from ..core.topology import read as read_topology
from ..core.units import human_bytes as _bytes
from ..core.units import human_time as _time
from ..model import BANDWIDTH_UNITS, CALIBRATE_LIMIT, MAX_BUCKETS, MAX_CHANNELS, MAX_GPUS
from ..model.systems import SYSTEM_PRESETS
from ..transport.deadline import mpi_library_version
from ..transport.mpi import MPITransport
from . import launch
from .common import (
    check_not_inputs,
    check_output_paths,
    main,
    reports_errors,
    require_processes,
    split_list,
    write_json,
)
from .model_sweep import SWEEP_OPTIONS, run_sweep, wants_sweep

__all__ = ["model"]


@main.command("model")
@click.option("--nodes", metavar="N",
              help=f"Nodes in the cluster, a whole number >= 1 (nodes × GPUs per node: at most "
                   f"{MAX_GPUS}).")
@click.option("--gpus-per-node", metavar="G", help="GPUs (ranks) per node, a whole number >= 1.")
@click.option("--intra-bw", help=f"Intra-node bandwidth per GPU with its unit, e.g. 900GB/s "
                                 f"(NVLink). Units: {BANDWIDTH_UNITS}; a number without a unit "
                                 f"is refused.")
@click.option("--inter-bw", help="Inter-node bandwidth per NIC with its unit, e.g. 400Gb/s or "
                                 "50GB/s (a NIC per GPU unless --nics-per-node says).")
@click.option("--nics-per-node", metavar="N", default=None,
              help="NICs per node, each of --inter-bw [default: one per GPU].")
@click.option("--channels", metavar="C", default=None,
              help=f"NCCL-style channels: rings or trees run at once on 1/C of the data each, "
                   f"each crossing node boundaries on its own NIC (ring/ch, tree/ch, dbtree/ch), "
                   f"1 to {MAX_CHANNELS} [default: one per NIC].")
@click.option("--rail/--no-rail", default=True, show_default=True,
              help="Rail-optimised placement: NIC j of every node on rail j, so cross-node "
                   "traffic never leaves its rail; without it, it shares the spine.")
@click.option("--spine-bw", default=None,
              help="With --no-rail: the spine's bandwidth per node, with its unit [default: "
                   "the node's NICs in all, non-blocking].")
@click.option("--gpu-arch", default="hopper", show_default=True,
              metavar="|".join(m.GPU_ARCHS),
              help="GPU generation for NCCL's tuning model's constants.")
@click.option("--bidirectional/--unidirectional", default=None,
              help="Whether both bandwidths count both directions added (then each direction "
                   "carries half) or one direction. Required unless each link says.")
@click.option("--intra-quoted", metavar="|".join(m.QUOTED), default=None,
              help="How --intra-bw is quoted, overriding the flag above.")
@click.option("--inter-quoted", metavar="|".join(m.QUOTED), default=None,
              help="How --inter-bw is quoted, overriding the flag above.")
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
@click.option("--layers", "layers_file", type=click.Path(dir_okay=False),
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
                   f"{m.choices_text(m.MODELLED)}. With --calibrate: default "
                   f"{','.join(m.CALIBRATE_DEFAULT)}.")
@click.option("--inter", default="ring", show_default=True,
              help=f"The hierarchical all-reduce's algorithm across nodes: "
                   f"{m.choices_text(m.INTER_ALGORITHMS, joiner='or')}.")
@click.option("--compressor", multiple=True,
              help="Compressor spec, e.g. topk:ratio=0.01 or ef(powersgd:rank=4); repeat it to "
                   "try several (+compression and the search take the best).")
@click.option("--pattern", metavar="|".join(m.PATTERNS), default=None,
              help="Compressed collective pattern [default: the compressor's own].")
@click.option("--buckets", default=None, metavar="B",
              help=f"Gradient buckets all-reduced during the backward pass: 1 (one bucket, no "
                   f"overlap) up to the number of parameters and at most {MAX_BUCKETS} "
                   f"[default: 1].")
@click.option("--bucket-size", default=None,
              help="Bucket size instead of a count, e.g. 25MB (PyTorch DDP's bucket_cap_mb); "
                   "it must make at most as many buckets as --buckets allows.")
@click.option("--search/--no-search", default=True, show_default=True,
              help="Search for the best stack: every algorithm, dense and with each compressor, "
                   "in 1, 4, 16, 64, 256 buckets, DDP's 25 MiB buckets and --buckets.")
@click.option("--preset", metavar="|".join(sorted(m.PRESETS) + sorted(SYSTEM_PRESETS)),
              default=None,
              help="Option values to start from; options given win. seed: 8 nodes × 8 GPUs, "
                   "NVLink 300GB/s and a 25GB/s NIC per GPU (per direction), 7e9 fp32 "
                   "parameters, forward 2s, backward 4s. The others are systems as their "
                   "makers describe them (dgx-h100: 8 H100 on NVSwitch, 8 × 400 Gb/s "
                   "InfiniBand; p4d: 8 A100, 4 × 100 Gb/s EFA...): without --params they "
                   "print the nccl-tests sweep.")
@click.option("--topology", "topology_file", type=click.Path(dir_okay=False), default=None,
              help="Take the nodes, ranks per node and links from a topology file (what "
                   "refcoll cluster writes, REFCOLL_TOPO_FILE); options given win.")
@click.option("--from-calibration", "calibration_file", type=click.Path(dir_okay=False),
              default=None,
              help="Take the cluster from a two-level calibration: the JSON of refcoll model "
                   "--calibrate --json run across nodes (α and β inside and across nodes, γ); "
                   "options given win.")
@click.option("--calibrate", is_flag=True,
              help="Measure α, β, γ on this machine under mpiexec and compare predicted "
                   "all-reduce times with measured ones.")
@click.option("-n", "--np", "nprocs", default="2", show_default=True, metavar="N",
              help="With --calibrate: processes to start with mpiexec (>= 2).")
@click.option("--sizes", default="64K..64M", show_default=True,
              help=f"With --calibrate: buffer sizes, a doubling range A..B or a list, each at "
                   f"most {CALIBRATE_LIMIT >> 30}G.")
@click.option("--back-to-back", is_flag=True,
              help="With --calibrate: time each all-reduce right after the one before it, as a "
                   "training loop runs them (bench -m), not after a barrier of its own: across "
                   "a shaped link, a call after a barrier finds the token bucket refilled.")
@click.option("--sweep", is_flag=True,
              help="Print all-reduce in nccl-tests' terms over -b..-e: size, count, type, "
                   "redop, time, algbw, busbw, and what NCCL runs (algorithm/protocol, "
                   "channels), then each --algorithm asked: NCCL's as NCCL spells them (Ring, "
                   "Tree, NVLS, NVLSTree, CollNet, optionally /LL, /LL128, /Simple), "
                   "refcoll's in lower case (ring, hierarchical, dbtree/ch...).")
@click.option("-b", "--minbytes", default="8", show_default=True,
              help="With --sweep: the first size, as all_reduce_perf -b (8, 1K, 1M).")
@click.option("-e", "--maxbytes", default="8G", show_default=True,
              help="With --sweep: the last size, as all_reduce_perf -e.")
@click.option("-f", "--stepfactor", default="2", show_default=True,
              help="With --sweep: multiply the size by this, as all_reduce_perf -f.")
@click.option("-i", "--stepbytes", default="0", show_default=True,
              help="With --sweep: add this to the size instead (as all_reduce_perf -i).")
@click.option("-d", "--datatype", default="float", show_default=True,
              help="nccl-tests' data type: float, half, bfloat16, double, int8...")
@click.option("--compare", "compare_log", type=click.Path(dir_okay=False),
              help="A real all_reduce_perf output: print it beside the prediction, size by "
                   "size, with the error per size band.")
@click.option("--fit", "fit_logs", type=click.Path(dir_okay=False), multiple=True,
              help="all_reduce_perf outputs of this system (repeat it, one node count each): "
                   "learn its unknown constants (each level's latency, the links' achieved "
                   "rates) and write them to --save-fit.")
@click.option("--save-fit", type=click.Path(), default=None,
              help="With --fit: the file the fitted system is written to.")
@click.option("--from-fit", "fit_file", type=click.Path(dir_okay=False), default=None,
              help="Price the system a --fit wrote (options given win: another --nodes...).")
@click.option("--intra-transport", default=None, metavar="nvswitch|nvlink|pcie",
              help="What joins a node's GPUs [default: nvswitch].")
@click.option("--inter-transport", default=None, metavar="ib|roce|efa|tcp|tcpx|tcpxo",
              help="The network transport across nodes [default: ib].")
@click.option("--nvls/--no-nvls", default=True, show_default=True,
              help="NVLink SHARP on NVSwitch nodes of Hopper and later (NCCL's NVLS, NVLSTree).")
@click.option("--p2p/--no-p2p", default=True, show_default=True,
              help="With --intra-transport pcie: peer-to-peer, or through host memory.")
@click.option("--pcie-gen", default=None, metavar="3|4|5",
              help="PCIe generation of the GPUs' links [default: 4].")
@click.option("--plot", "plot_file", type=click.Path(),
              help="With --sweep or --compare: draw the busbw curves (PNG, SVG, PDF).")
@click.option("--json", "json_file", type=click.Path(),
              help="Write the report as JSON (its folder must exist).")
@reports_errors
def model(nodes, gpus_per_node, intra_bw, inter_bw, nics_per_node, channels, rail, spine_bw,
          gpu_arch, bidirectional, intra_quoted, inter_quoted, intra_latency, inter_latency,
          in_network, reduce_bw, params, layers_file, bytes_per_element, forward, backward,
          algorithm, inter, compressor, pattern, buckets, bucket_size, search, preset,
          topology_file, calibration_file, calibrate, nprocs, sizes, back_to_back, sweep,
          minbytes, maxbytes, stepfactor, stepbytes, datatype, compare_log, fit_logs, save_fit,
          fit_file, intra_transport, inter_transport, nvls, p2p, pcie_gen, plot_file,
          json_file):
    """Model all-reduce and step time on a described cluster, or calibrate against this one.

    Prints each algorithm's all-reduce time with its phases (refcoll's own
    schedules, and NCCL's ring and tree run on --channels channels, ring/ch and
    dbtree/ch), NCCL's own tuning model's times, the compressed collective, the
    step time with the speed-up of each technique stacked (topology,
    compression, overlap) over the baseline NCCL runs by default, the search
    for the best stack, and which all-reduce wins and why. Units: bandwidths 300GB/s, 200Gb/s,
    100Gbps (a unit is required); latencies 2us, 500ns (a unit is required,
    but for 0); forward and backward 50ms or 0.05 (seconds); sizes 64K (KiB),
    25MB. Every number must be finite and not negative; counts and bandwidths
    positive. The GPUs in all and the buckets are bounded: see --nodes and --buckets.
    """
    if back_to_back and not calibrate:
        raise UsageError("--back-to-back times the all-reduces of --calibrate: give both")
    opts = dict(locals())
    check_not_inputs({"--json": json_file, "--plot": plot_file, "--save-fit": save_fit},
                     {"--compare": compare_log, "--fit": fit_logs, "--from-fit": fit_file,
                      "--layers": layers_file, "--topology": topology_file,
                      "--from-calibration": calibration_file})
    if wants_sweep(opts):
        check_output_paths(json=json_file, plot=plot_file, save_fit=save_fit)
        run_sweep(opts)
        return
    used = [f"--{name.replace('_', '-')}" for name in SWEEP_OPTIONS
            if click.get_current_context().get_parameter_source(name)
            not in (None, ParameterSource.DEFAULT)]
    if used or plot_file:
        raise UsageError(f"{', '.join(used) or '--plot'} belong to --sweep, --compare and "
                         "--fit (nccl-tests' view): give one of those")
    check_output_paths(json=json_file)
    if calibrate:
        _calibrate(nprocs, algorithm, sizes, back_to_back, json_file)
        return
    layers_text = None
    if layers_file is not None:  # a regular file of UTF-8 JSON, bounded: else exit 2, one line
        layers_text = read_text(layers_file, max_bytes=MAX_JSON_BYTES,
                                what="layers file (--layers)")
    given = dict(
        nodes=nodes, gpus_per_node=gpus_per_node, intra_bw=intra_bw, inter_bw=inter_bw,
        nics_per_node=nics_per_node, channels=channels, rail=rail, spine_bw=spine_bw,
        gpu_arch=gpu_arch, bidirectional=bidirectional, intra_quoted=intra_quoted,
        inter_quoted=inter_quoted, intra_latency=intra_latency, inter_latency=inter_latency,
        in_network=in_network, reduce_bw=reduce_bw, params=params,
        bytes_per_element=bytes_per_element, forward=forward, backward=backward,
        algorithm=algorithm, inter=inter, compressor=compressor, pattern=pattern,
        buckets=buckets, bucket_size=bucket_size)
    described = {}  # what the files describe; the preset's below, options given above both
    if calibration_file is not None:
        described.update(m.calibration_options(calibration_file))
    notes = []  # what of the system the step report could not express
    if topology_file is not None:
        topology = read_topology(topology_file)
        described.update(model_options(topology))
        notes += model_notes(topology)
    if preset is not None:
        described = {**m.preset_values(preset), **described}
    ctx = click.get_current_context()
    for name, value in described.items():
        if ctx.get_parameter_source(name) in (None, ParameterSource.DEFAULT) and not (
                name == "params" and layers_text is not None):
            given[name] = value
    result = m.ModelRequest(layers_text=layers_text, search=search, **given,
                            layers_name=f"{layers_file} (--layers)").plan()
    notes += m.preset_notes(preset) if preset is not None else []
    result = dataclasses.replace(result, notes=result.notes + tuple(notes))
    write_json(json_file, result.to_json())  # first: a reader that leaves early loses no file
    _print_plan(result)  # click.echo flushes each line, so a closed pipe is met in here


def _calibrate(nprocs, algorithm, sizes, back_to_back, json_file) -> None:
    nprocs, byte_sizes = m.calibration_request(nprocs, sizes)
    require_processes(nprocs, minimum=2)  # at most MAX_PROCESSES, as every -n
    names = (split_list(algorithm, m.calibration_choices(), "algorithm")
             or list(m.CALIBRATE_DEFAULT))
    if not launch.in_mpi_job():
        launch.relaunch(nprocs)
    MPI = launch.start_mpi("refcoll model --calibrate")

    t = MPITransport(MPI.COMM_WORLD, collective="refcoll model --calibrate")
    launch.data_ranks(t, nprocs)  # says so when the job's size overrules -n
    if t.size < 2:
        raise UsageError("--calibrate needs at least 2 processes to measure messages")
    result = m.compare_with_measurement(t, names, byte_sizes, back_to_back=back_to_back)
    if t.rank == 0:
        library = mpi_library_version()
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


def _count(number: int, noun: str) -> str:
    """Return ``1 node``, ``8 nodes``: a count with its noun, plural when it is not 1."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _step(seconds: float) -> str:
    return m.step_text(seconds)


def _nccl_rows(result, width: int = 26) -> None:
    """Print NCCL's tuning model's best protocol per algorithm, its pick marked."""
    times = result.nccl
    if not times:
        return
    pick = min(times, key=lambda t: t.seconds)
    for algo in dict.fromkeys(t.algorithm for t in times):
        t = min((t for t in times if t.algorithm == algo), key=lambda t: t.seconds)
        mark = "  <- NCCL's pick" if t is pick else ""
        click.echo(f"  {'NCCL model ' + t.name:<{width}} {_time(t.seconds):>9} {'':>10}  latency "
                   f"{_time(t.latency)} + bytes at {_bytes(t.bandwidth)}/s (tuning.cc, NCCL "
                   f"{m.NCCL_VERSION}){mark}")


def _widths(rows) -> tuple[int, int]:
    """Return the label and collective columns' widths: wide enough for every row."""
    return (max([27, *(len(r.label) for r in rows)]),
            max([26, *(len(r.algorithm) for r in rows)]))


def _stack_header(label: int = 27, collective: int = 26) -> None:
    click.echo(f"  {'step':<{label}} {'collective':<{collective}} {'buckets':>7} {'comm':>9} "
               f"{'exposed':>9} "
               f"{'step':>9} {'comm %':>7} {'speed-up':>9} {'vs prev':>8}")


def _stack_row(row, label: int = 27, collective: int = 26) -> None:
    click.echo(f"  {row.label:<{label}} {row.algorithm:<{collective}} {row.buckets:>7} "
               f"{_time(row.comm):>9} {_time(row.exposed):>9} {_step(row.step):>9} "
               f"{100 * row.fraction:>6.1f}% {row.speedup:>8.2f}× {row.gain:>7.2f}×")


def _print_plan(result) -> None:
    c, w = result.cluster, result.workload
    intra_a, intra_b = c.link("intra")
    inter_a, inter_b = c.link("inter")
    reduction = f"{_bytes(c.reduce_bw)}/s" if c.reduce_bw else "free"
    inter = (f"inter {_bytes(1 / inter_b)}/s, {_time(inter_a)}" if c.nodes > 1
             else "no inter-node link (one node)")
    click.echo(f"cluster: {_count(c.nodes, 'node')} × {_count(c.gpus_per_node, 'GPU')} = "
               f"{_count(c.gpus, 'GPU')}; per GPU and "
               f"direction: intra {_bytes(1 / intra_b)}/s, {_time(intra_a)}; {inter}; "
               f"in-network reduction: {'yes' if c.in_network else 'no'}; reduction "
               f"{reduction}")
    spine = ("rail-optimised (no spine crossed)" if c.rail else
             f"no rails: cross-node traffic shares a spine of {_bytes(1 / c.spine_beta())}/s "
             f"per node")
    if c.nodes == 1:
        click.echo(f"network: one node, no NIC crossed; {_count(c.channel_count, 'channel')}")
    else:
        click.echo(f"network: {_count(c.nic_count, 'NIC')} per node of "
                   f"{_bytes(1 / c.nic_beta())}/s each way; "
                   f"{_count(c.channel_count, 'channel')}"
                   f"{' (one per NIC)' if c.channels is None else ''}; {spine}")
    tensors = f"{len(w.shapes)} tensor{'s' if len(w.shapes) > 1 else ''}"
    click.echo(f"model: {w.elements:,} parameters ({tensors}) × "
               f"{w.bytes_per_element} B = {_bytes(w.nbytes)}; forward {_time(w.forward)}, "
               f"backward {_time(w.backward)}")
    click.echo("")
    click.echo(f"all-reduce of the gradient ({_bytes(w.nbytes)}), dense (…/ch: "
               f"{c.channel_count} channel{'s' if c.channel_count > 1 else ''} as NCCL runs them; "
               f"the others one schedule, as refcoll runs it):")
    width = max([26, *(len(e.algorithm) for e in result.dense)])
    click.echo(f"  {'algorithm':<{width}} {'time':>9} {'bytes/GPU':>10}  phases [link]")
    for est in sorted(result.dense, key=lambda e: e.seconds):
        click.echo(f"  {est.algorithm:<{width}} {_time(est.seconds):>9} "
                   f"{_bytes(est.bytes):>10}  {_phases(est)}".rstrip())
    _nccl_rows(result, width)
    for line in m.allreduce_verdict(c, result.dense):
        click.echo(line)
    base = result.baseline
    if base.get("nccl_pick"):
        click.echo("")
        click.echo(f"baseline: what NCCL does by default: it runs {base['nccl_pick']} for "
                   f"{_bytes(w.nbytes)} on {c.gpus} ranks ({base['algorithm']}: its pick among "
                   f"its algorithms and protocols, priced on these links, {c.channel_count} "
                   f"channel{'s' if c.channel_count > 1 else ''}"
                   f"{', rail-optimised' if c.rail else ', no rails'}), dense, one bucket")
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
    widths = _widths(result.stack)
    _stack_header(*widths)
    for row in result.stack:
        _stack_row(row, *widths)
    for note in result.notes:
        click.echo(f"note: {note}")
    if result.search:
        _print_search(result)


def _print_search(result) -> None:
    base = result.stack[0]
    click.echo("")
    click.echo("best stack, searched: each row the fastest of the "
               f"{len(result.options.algorithms)} "
               f"algorithms (one for a pattern with its own collective); speed-up against the "
               f"baseline:")
    label, collective = _widths(result.search)
    click.echo(f"  {'compression':<{label}} {'collective':<{collective}} {'buckets':>7} "
               f"{'comm':>9} {'exposed':>9} {'step':>9} {'comm %':>7} {'speed-up':>9}")
    for row in result.search:
        mark = "  <- best" if row is result.best else ""
        click.echo(f"  {row.label:<{label}} {row.algorithm:<{collective}} {row.buckets:>7} "
                   f"{_time(row.comm):>9} {_time(row.exposed):>9} {_step(row.step):>9} "
                   f"{100 * row.fraction:>6.1f}% {base.step / row.step:>8.3f}×{mark}")
    for line in m.stack_verdict(result, result.best):
        click.echo(line)


def _print_calibration(result, library: str) -> None:
    cal, rows = result.calibration, result.rows
    click.echo(f"refcoll model --calibrate: {cal.ranks} ranks on {os.cpu_count()} cores, "
               f"{library}")
    where = " (between ranks 0 and 1)" if cal.two_level else ""
    click.echo(f"ping-pong fit{where}: α = {_time(cal.alpha)}, β = {cal.beta * 1e9:.4g} ns/B "
               f"({_bytes(1 / cal.beta) if cal.beta > 0 else 'inf'}/s); γ = "
               f"{cal.gamma_per_byte * 1e9:.4g} ns/B; call {_time(cal.call)}")
    if cal.two_level:
        click.echo(f"across {cal.nodes} nodes of {cal.per_node} ranks: α = "
                   f"{_time(cal.inter_alpha)}, β = {cal.inter_beta * 1e9:.4g} ns/B "
                   f"({8 / cal.inter_beta / 1e6:.0f} Mbit/s); the predictions price each "
                   f"phase at its level's α and β")
    click.echo("measured: each all-reduce " + ("right after the one before it (--back-to-back)"
                                               if result.back_to_back else "after a barrier"))
    click.echo(f"  {'algorithm':<26} {'size':>8} {'predicted':>10} {'of it wait':>10} "
               f"{'α-β-γ fit':>10} {'measured':>10} {'pred/meas':>9}")
    for r in rows:
        size = _bytes(r["bytes"], "g", binary=True)
        click.echo(f"  {r['algorithm']:<26} {size:>8} {_time(r['predicted']):>10} "
                   f"{_time(r['wait']):>10} {_time(r['predicted_fit']):>10} "
                   f"{_time(r['measured']):>10} "
                   f"{r['ratio']:>9.2f}")
    for line in result.summary_lines():  # geometric-mean error, within 30%, worst; the term
        click.echo(line)
    if result.others is not None:
        click.echo(f"other processes used {100 * result.others:.0f}% of the machine's CPU "
                   f"meanwhile" + ("; the timings shared the cores, rerun on an idle machine"
                                   if result.others > 0.05 else ""))
