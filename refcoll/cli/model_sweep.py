"""`refcoll model --sweep / --compare / --fit`: all-reduce on a real system, in nccl-tests' terms.

The system comes from ``--preset`` (dgx-h100, p4d, a3-mega...) and the
options (``--nodes``, ``--gpus-per-node``, ``--gpu-arch``, ``--intra-transport``,
``--inter-transport``, ``--inter-bw``, ``--nics-per-node``, ``--nvls``,
``--p2p``, ``--in-network`` for CollNet), or from ``--from-fit FILE``. Then:

* ``--sweep -b 8 -e 8G -f 2``: nccl-tests' rows for what NCCL would run (its
  algorithm, protocol and channels in a column), and for each ``--algorithm``;
* ``--compare LOG``: a real ``all_reduce_perf`` output beside the prediction,
  size by size, with the error per size band;
* ``--fit LOG [--fit LOG...] --save-fit FILE``: the system's unknown constants
  learnt from its own measurements (:mod:`refcoll.model.nccl_fit`);
* ``--plot FILE``: the busbw curves; ``--json FILE``: every row.
"""

from __future__ import annotations

from dataclasses import replace

import click

from ..core.errors import UsageError
from ..core.plot import figure, require_matplotlib, save
from ..core.units import parse_bandwidth, parse_count, parse_duration, parse_size
from ..model.cluster import MODELLED
from ..model.nccl_fit import fit, fit_algorithm, fit_to_json, fit_unlearnt, read_fit
from ..model.nccl_run import NCCL_ALGORITHMS, NCCL_VERSION
from ..model.nccl_tests import (
    BANDS,
    DTYPE_BYTES,
    check_comparable,
    compare,
    predicted_rows,
    price,
    read_table,
    sweep_sizes,
    table_lines,
)
from ..model.request import IN_NETWORK_ON_ONE_NODE, quoted_links
from ..model.systems import SYSTEM_PRESETS, System, system_preset
from .bench import decimal_size_note
from .common import write_json
from .launch import given

__all__ = ["SWEEP_OPTIONS", "run_sweep", "wants_sweep"]

#: The options only the sweep reads (their names as click passes them).
SWEEP_OPTIONS = ("sweep", "minbytes", "maxbytes", "stepfactor", "stepbytes", "datatype",
                 "compare_log", "plot_file", "fit_logs", "save_fit", "fit_file",
                 "intra_transport", "inter_transport", "nvls", "p2p", "pcie_gen")


#: The options of the sweep's sizes (and the type that turns them into counts).
_SWEEP_SIZES = (("-b", "minbytes"), ("-e", "maxbytes"), ("-f", "stepfactor"),
                ("-i", "stepbytes"), ("-d", "datatype"))

#: The options only the step report reads: refused in nccl-tests' view, which has no use
#: for them (the latencies are both's: a step of the sweep takes at least that long).
STEP_OPTIONS = ("rail", "spine_bw", "reduce_bw", "params", "layers_file", "bytes_per_element",
                "forward", "backward", "inter", "compressor", "pattern", "buckets",
                "bucket_size", "search", "topology_file", "calibration_file", "calibrate",
                "nprocs", "sizes", "back_to_back")


def wants_sweep(opts: dict) -> bool:
    """Return whether the command asks for the nccl-tests view rather than the step report."""
    return bool(opts["sweep"] or opts["compare_log"] or opts["fit_logs"] or opts["fit_file"]
                or (opts["preset"] in SYSTEM_PRESETS and not opts["params"]
                    and not opts["layers_file"] and not opts["calibrate"]))


#: The options that describe the hardware a fit was made on: with ``--from-fit`` they
#: would change what its constants mean (``--nodes`` and the rest stay free).
_FITTED_HARDWARE = ("preset", "gpu_arch", "intra_transport", "inter_transport", "intra_bw",
                    "inter_bw", "nics_per_node", "pcie_gen", "p2p", "intra_quoted",
                    "inter_quoted", "bidirectional")


#: The options that describe a network: free with ``--from-fit`` of a fit that learnt
#: nothing of one (one node's tables), so its nodes can be priced joined by a network.
_NETWORK = ("inter_transport", "inter_bw", "nics_per_node", "inter_quoted")

#: The options that describe the network between nodes (refused on one node).
_NETWORK_OPTIONS = (*_NETWORK, "inter_latency")

#: The constants a fit learns of the network.
_NETWORK_CONSTANTS = frozenset({"nic_efficiency", "net_latency"})


def _base(opts: dict) -> System | None:
    """Return the system of ``--from-fit`` or a system ``--preset``, or None."""
    if opts["fit_file"]:
        base = read_fit(opts["fit_file"])
        # (what it learnt, not the network the fitted system described: a preset's NICs)
        networked = bool(_NETWORK_CONSTANTS & set(base.fitted) - fit_unlearnt(opts["fit_file"]))
        clash = [f"--{name.replace('_', '-')}" for name in _FITTED_HARDWARE
                 if given(name) and (networked or name not in _NETWORK)]
        if clash:
            raise UsageError(f"--from-fit {opts['fit_file']} prices the hardware it was "
                             f"fitted on; {', '.join(clash)} would change what its constants "
                             "mean: fit that hardware's own tables (--fit)")
        if not networked and any(given(name) for name in _NETWORK):  # a network of their own:
            base = replace(base, fitted={k: v for k, v in base.fitted.items()  # described
                                         if k not in _NETWORK_CONSTANTS})
        return base
    if opts["preset"] is None:
        return None
    if opts["preset"] not in SYSTEM_PRESETS:
        raise UsageError(f"--preset {opts['preset']} is not a system: with --sweep, "
                         f"--compare or --fit choose {', '.join(sorted(SYSTEM_PRESETS))}")
    return System(**system_preset(opts["preset"]))


def _counts(opts: dict) -> dict:
    """Return the whole-number fields the options give."""
    fields = {}
    for option, key in (("nodes", "nodes"), ("gpus_per_node", "gpus_per_node"),
                        ("pcie_gen", "pcie_gen"), ("channels", "channels"),
                        ("nics_per_node", "nics")):
        if opts[option] is not None:
            fields[key] = parse_count(opts[option], name=f"--{option.replace('_', '-')}")
    return fields


def _links(opts: dict) -> dict:
    """Return the line rates the options give, per direction (quoted as they say)."""
    if opts["intra_bw"] is None and opts["inter_bw"] is None:
        return {}
    if opts["fit_file"] and opts["inter_quoted"] is None and opts["bidirectional"] is None:
        raise UsageError("--inter-bw beside --from-fit: say how it is quoted with --inter-quoted "
                         "unidirectional (per direction) or --inter-quoted bidirectional (both "
                         "directions added); the fitted node's own links stay as fitted")
    intra_both, inter_both = quoted_links(
        opts["bidirectional"],
        opts["intra_quoted"] or ("unidirectional" if opts["intra_bw"] is None else None),
        opts["inter_quoted"] or ("unidirectional" if opts["inter_bw"] is None else None))
    fields = {}
    if opts["intra_bw"] is not None:
        bw = parse_bandwidth(opts["intra_bw"], name="--intra-bw")
        fields["intra_bw"] = bw / 2 if intra_both else bw
    if opts["inter_bw"] is not None:
        bw = parse_bandwidth(opts["inter_bw"], name="--inter-bw")
        fields["nic_bw"] = bw / 2 if inter_both else bw
    return fields


def _system(opts: dict) -> System:
    """Return the system the options (over the preset, over a fit file) describe."""
    base = _base(opts)
    fields = {**_counts(opts), **_links(opts)}
    if base is None or given("gpu_arch"):
        fields["generation"] = opts["gpu_arch"]
    for name, key in (("intra_transport", "intra"), ("inter_transport", "transport")):
        if opts[name] is not None:
            fields[key] = opts[name]
    for name in ("nvls", "p2p"):
        if base is None or given(name):
            fields[name] = opts[name]
    if opts["in_network"]:
        fields["collnet"] = True
    for name, key in (("intra_latency", "intra_alpha"), ("inter_latency", "inter_alpha")):
        if given(name):  # a step takes at least this long on that link
            fields[key] = parse_duration(opts[name], name=f"--{name.replace('_', '-')}",
                                         unit=True)
    if "nic_bw" in fields and "nics" not in fields and (base is None or not base.nics):
        fields["nics"] = fields.get("gpus_per_node", base.gpus_per_node if base else 8)
    system = System(**fields) if base is None else replace(base, **fields)
    _refuse_contradictions(opts, system)
    return system


def _refuse_contradictions(opts: dict, system: System) -> None:
    """Refuse an option the system described cannot have, rather than drop it unsaid."""
    if given("nvls") and opts["nvls"] and not system.has_nvls:
        raise UsageError(f"--nvls: NVLink SHARP needs NVSwitch nodes of Hopper or later; "
                         f"{system.describe()} has none")
    if given("p2p") and system.intra != "pcie":
        raise UsageError(f"--{'' if opts['p2p'] else 'no-'}p2p says how PCIe GPUs reach each "
                         f"other (--intra-transport pcie); these GPUs are joined by "
                         f"{system.intra}")
    if opts["in_network"] and system.nodes < 2:
        raise UsageError(IN_NETWORK_ON_ONE_NODE)
    if given("pcie_gen") and system.intra != "pcie":
        raise UsageError(f"--pcie-gen is the generation of the PCIe links between GPUs "
                         f"(--intra-transport pcie); these GPUs are joined by {system.intra}")
    network = [f"--{name.replace('_', '-')}" for name in _NETWORK_OPTIONS if given(name)]
    if network and system.nodes < 2:
        raise UsageError(f"{', '.join(network)} describe the network between nodes, and "
                         f"{system.describe()} is one node: give --nodes")


def _algorithms(text: str | None) -> list[str | None]:
    """Return what to price besides NCCL's pick: NCCL's algorithms or refcoll's schedules."""
    if text is None or text == "all":
        return [None]
    out: list[str | None] = [None]
    nccl = {a.lower(): a for a in NCCL_ALGORITHMS}
    for item in (v.strip() for v in text.split(",") if v.strip()):
        name, _, proto = item.partition("/")
        if item in MODELLED:  # refcoll's, in lower case: ring, dbtree/ch...
            out.append(item)
        elif name.lower() in nccl and proto.lower() in ("", "ll", "ll128", "simple"):
            out.append(item)
        else:
            raise UsageError(f"unknown --algorithm {item!r} for --sweep: NCCL's "
                             f"{', '.join(NCCL_ALGORITHMS)} (optionally /LL, /LL128, /Simple) "
                             f"or refcoll's {', '.join(MODELLED)}")
    return out


def _refuse_strays(opts: dict) -> None:
    """Refuse what the nccl-tests view cannot do, before anything is read."""
    if opts["fit_logs"] and not opts["save_fit"]:
        raise UsageError("--fit learns constants for a file: give --save-fit FILE (what "
                         "--from-fit reads)")
    if opts["save_fit"] and not opts["fit_logs"]:
        raise UsageError("--save-fit writes what --fit learns: give --fit LOG")
    stray = [f"--{name.replace('_', '-')}" for name in STEP_OPTIONS if given(name)]
    if stray:
        raise UsageError(f"{', '.join(stray)} belong to the step report (--params or "
                         "--layers, without --sweep, --compare or --fit), not to nccl-tests' "
                         "view")
    if not opts["sweep"]:
        sizes = [option for option, name in _SWEEP_SIZES if given(name)]
        if sizes:
            raise UsageError(f"{', '.join(sizes)} make the --sweep's sizes; --compare and "
                             "--fit take the logs' own (add --sweep for a sweep beside them)")
    if (opts["compare_log"] or opts["fit_logs"]) and not (
            opts["preset"] or opts["fit_file"] or given("gpu_arch")):
        raise UsageError("--compare and --fit price a log on the hardware it ran on: describe "
                         "it (--preset NAME, or --gpu-arch with its links and counts, or "
                         "--from-fit FILE); the defaults are no one's machine")
    if opts["datatype"] not in DTYPE_BYTES:
        raise UsageError(f"unknown --datatype {opts['datatype']!r}: choose "
                         f"{', '.join(DTYPE_BYTES)}")
    named = [a for a in _algorithms(opts["algorithm"]) if a is not None]
    if (opts["fit_logs"] or opts["compare_log"]) and len(named) > 1:
        raise UsageError(f"--algorithm {opts['algorithm']}: --fit and --compare take what the "
                         "logs ran, one algorithm (NCCL_ALGO); a --sweep alone prices several")
    if opts["fit_logs"] and named and named[0] in MODELLED:
        raise UsageError(f"--algorithm {named[0]} is refcoll's own schedule; --fit learns from "
                         "what NCCL ran: give NCCL's name ("
                         f"{', '.join(NCCL_ALGORITHMS)}, as NCCL_ALGO spells it)")
    if opts["plot_file"]:
        if not (opts["sweep"] or opts["compare_log"]):
            raise UsageError("--plot draws the --sweep and --compare curves: give one of them "
                             "(a --fit alone has none to draw)")
        require_matplotlib()


def _runnable(system: System, asked: list) -> None:
    """Refuse a system without an all-reduce, or an algorithm it cannot run."""
    if system.ranks < 2:
        raise UsageError(f"{system.describe()}: an all-reduce needs at least 2 GPUs (--nodes, "
                         "--gpus-per-node)")
    for algorithm in asked[1:]:
        if price(system, 1 << 20, algorithm) is None:
            raise UsageError(f"--algorithm {algorithm} cannot run on {system.describe()}"
                             + (" (CollNet needs --in-network and more than one node)"
                                if algorithm.lower().startswith("collnet") else ""))


def _sizes(opts: dict) -> list[int]:
    """Return the sweep's sizes (``-b -e -f -i -d``), as all_reduce_perf makes them."""
    factor = parse_count(opts["stepfactor"], name="-f/--stepfactor")
    step = parse_size(opts["stepbytes"], name="-i/--stepbytes", whole=True)
    if given("stepfactor") and factor > 1:
        step = 0  # as all_reduce_perf: a factor above 1 wins over -i
    for option, name in (("-b", "minbytes"), ("-e", "maxbytes"), ("-i", "stepbytes")):
        note = decimal_size_note(option, opts[name]) if given(name) else None
        if note:
            click.echo(f"refcoll: note: {note}", err=True)
    return sweep_sizes(parse_size(opts["minbytes"], name="-b/--minbytes", whole=True),
                       parse_size(opts["maxbytes"], name="-e/--maxbytes", whole=True),
                       factor, step, width=DTYPE_BYTES[opts["datatype"]])


def _measured(opts: dict, system: System):
    """Return the ``--compare`` log, refused if it ran on another rank count (a table
    without ``# Rank`` lines is taken as described), or None."""
    if not opts["compare_log"]:
        return None
    table = read_table(opts["compare_log"])
    if table.ranks is None:
        table = replace(table, notes=(*table.notes, (
            f"no '# Rank' lines say how many ranks ran: taken as the {system.ranks} "
            f"described ({system.nodes} nodes × {system.gpus_per_node}, --nodes, "
            "--gpus-per-node)")))
    if table.ranks not in (None, system.ranks):
        raise UsageError(f"{opts['compare_log']} ran on {table.ranks} ranks; the system "
                         f"described has {system.ranks} ({system.nodes} nodes × "
                         f"{system.gpus_per_node}): say --nodes and --gpus-per-node")
    check_comparable(table, system.ranks)
    return table


def run_sweep(opts: dict) -> None:
    """Carry out ``--sweep``, ``--compare`` and ``--fit`` (after the output paths were checked).

    Everything that can be refused is refused before the first line is printed.
    """
    if not (opts["sweep"] or opts["compare_log"] or opts["fit_logs"]):
        opts = {**opts, "sweep": True}  # a system alone: its sweep
    _refuse_strays(opts)
    system = _system(opts)
    asked = _algorithms(opts["algorithm"])
    _runnable(system, asked)
    told = asked[1] if len(asked) > 1 else None  # what the tables ran, when told
    sizes = _sizes(opts) if opts["sweep"] else []
    tables = [read_table(path) for path in opts["fit_logs"]]
    measured_table = _measured(opts, system)
    ran = fit_algorithm(opts["fit_file"]) if opts["fit_file"] else None  # (refused here)
    report: dict = {"system": system.describe(), "nccl_constants": NCCL_VERSION}
    if tables:
        fitted = fit(system, tables, told)  # (what it refuses, refused before a word)
        saved = fit_to_json(system, fitted, tables, told)
        for table in tables:
            _print_notes(table)
            if table.ranks is None:  # alone (several must each say theirs: nccl_fit refuses)
                click.echo(f"# {table.name}: no '# Rank' lines say how many ranks ran: taken "
                           f"as the {system.ranks} described (--nodes, --gpus-per-node)")
        write_json(opts["save_fit"], saved)
        system = replace(system, fitted=fitted)
        _print_fit(saved)
        report["fit"] = saved
    click.echo(f"system: {system.describe()}")
    report["not_expressed"] = system.unknowns()
    for note in report["not_expressed"]:
        click.echo(f"not expressed: {note}")
    curves = []
    if sizes:
        report["rows"] = []
        for algorithm in asked:
            rows = predicted_rows(system, sizes, algorithm, opts["datatype"])
            report["rows"] += rows
            curves.append((algorithm or "NCCL's pick", rows))
            click.echo("")
            click.echo(f"# {'what NCCL runs' if algorithm is None else algorithm} "
                       f"(constants of NCCL {NCCL_VERSION})")
            for line in table_lines(rows, system.ranks):
                click.echo(line)
    measured = None
    if measured_table is not None:
        if ran is not None and told is None:
            click.echo(f"note: {opts['fit_file']} was fitted on tables that ran {ran}; this "
                       f"log is priced as NCCL's own pick: say --algorithm {ran} if it ran "
                       f"{ran} too")
        measured = compare(measured_table, system, told)
        report["compare"] = measured.to_json()
        _print_compare(measured)
    if opts["plot_file"]:
        _plot(opts["plot_file"], system, curves, measured)
    write_json(opts["json_file"], report)


def _print_fit(saved: dict) -> None:
    fitted = saved["fitted"]
    parts = []
    if "intra_rate" in fitted:
        parts += [f"intra {fitted['intra_rate'] / 1e9:.1f} GB/s per GPU and direction",
                  f"+{fitted['intra_latency'] * 1e6:.2f} us per intra-node step"]
    if "nic_efficiency" in fitted:
        parts += [f"NICs at {100 * fitted['nic_efficiency']:.0f}% of line rate",
                  f"+{fitted['net_latency'] * 1e6:.2f} us per network step"]
    click.echo(f"fit on {len(saved['logs'])} table(s): " + ", ".join(parts))
    for name in saved["unlearnt"]:
        click.echo(f"not learnt: {name} (no size of the tables depends on it, or their one "
                   "size cannot tell it from its pair): as described")
    if saved.get("described"):
        click.echo("the search ended worse than the description: its constants stand "
                   "(the tables follow a form the model cannot give)")
    for name in saved.get("on_bounds", ()):
        click.echo(f"on its bound: {name} (the tables may want a value past it, which the "
                   "model cannot give: read its predictions with care)")
    errors = saved["errors"]
    click.echo("fit error per band: " + "; ".join(
        f"{name} {'-' if errors[name] is None else f'{100 * errors[name]:.0f}%'}"
        for name, _, _ in BANDS))


def _print_notes(table) -> None:
    for note in table.notes:
        click.echo(f"# {table.name}: {note}")


def _print_compare(result) -> None:
    click.echo("")
    click.echo(f"# {result.table.name}: measured (the faster of out of place and in place) "
               "beside predicted")
    _print_notes(result.table)
    click.echo(f"# {'size':>12} {'measured':>10} {'predicted':>10} {'ratio':>6} "
               f"{'busbw':>7} {'busbw':>7}  algorithm")
    click.echo(f"# {'(B)':>12} {'(us)':>10} {'(us)':>10} {'':>6} {'meas':>7} {'pred':>7}")
    for r in result.rows:
        click.echo(f"  {r['size']:>12} {r['measured_us']:>10.2f} {r['predicted_us']:>10.2f} "
                   f"{r['ratio']:>6.2f} {r['measured_busbw']:>7.2f} "
                   f"{r['predicted_busbw']:>7.2f}  {r['algorithm']}/{r['protocol']}")
    parts = []
    for name, _, _ in BANDS:
        error, n = result.errors[name]
        parts.append(f"{name}: {'-' if n == 0 else f'{100 * error:.0f}%'} ({n} sizes)")
    click.echo("error, exp(mean |ln(predicted/measured)|) - 1, per band: " + "; ".join(parts))
    click.echo(f"within 30%: {result.within} of {len(result.rows)} sizes")


def _plot(path: str, system: System, curves, measured) -> None:
    fig = figure(figsize=(7, 4))
    ax = fig.add_subplot()
    for label, rows in curves:
        ax.plot([r["size"] for r in rows], [r["busbw"] for r in rows], "--", label=label)
    if measured is not None:
        sizes = [r["size"] for r in measured.rows]
        ax.plot(sizes, [r["measured_busbw"] for r in measured.rows], "o-", ms=3,
                label="measured")
        if not curves:
            ax.plot(sizes, [r["predicted_busbw"] for r in measured.rows], "s--", ms=3,
                    label="predicted")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(system.describe(), fontsize=7)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save(fig, path, dpi=100)
