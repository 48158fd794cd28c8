"""The report of ``refcoll bench``: its header, table, footer, CSV and plot.

:func:`bench_header` captures the run's environment (machine, MPI library,
versions, the device path on GPUs, auto's calibration); :func:`summarize` gives the
footer's numbers; :func:`format_table` (or :func:`format_header`,
:func:`format_row`, :func:`format_footer` line by line) prints nccl-tests' table;
:func:`write_csv` and :func:`plot` write the rows; :func:`run_report` runs a sweep
with its header and footer, :func:`save_report` writes its files. Where the table
is printed, with its progress bar, is :mod:`.terminal`'s.
"""

from __future__ import annotations

import csv
import os
import platform
import time
from collections import defaultdict
from importlib.metadata import PackageNotFoundError, version
from typing import Callable, Sequence

import numpy as np

from ... import algorithms
from ...baselines import gloo, nccl
from ...calls import as_transport, device_for
from ...calls.auto import calibration_for
from ...core.errors import UsageError
from ...core.plot import figure
from ...core.ops import dtype_name, get_dtype, get_op
from ...transport import cuda_aware
from ...transport.mpi import bounded_barrier, default_timeout
from .config import (LIBRARIES, ROW_FIELDS, BenchConfig, array_module, baseline_name,
                     baseline_unavailable, libraries, op_label, use_device)
from .run import run_bench

__all__ = [
    "bench_header",
    "summarize",
    "format_header",
    "format_row",
    "format_footer",
    "format_table",
    "write_csv",
    "plot",
    "run_report",
    "save_report",
    "SCHEMA",
]


def bench_header(comm, config: BenchConfig) -> dict:
    """Return the run's description: machine, MPI library, versions, ranks, settings, notes.

    Collective over ``comm`` when ``auto`` is selected (its calibration may be
    measured here, once) and on GPUs (each rank's GPU is chosen here, as
    :func:`run_bench` does). ``gpu`` describes the device path
    (:func:`refcoll.transport.cuda_aware.device_path`: the GPU, direct or staged transfers and
    why) on GPUs, and is None on CPUs.
    """
    from mpi4py import MPI

    def package(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    workers = config.workers or comm.size
    timeout = default_timeout()
    use_device(comm, config)
    unavailable = baseline_unavailable(config)
    notes = [
        "timed calls pass validate=False: the argument agreement round trip is not timed",
        "time: the largest over ranks of each rank's median over the timed iterations",
        f"busbw = algbw x nccl-tests' factor for {config.collective}",
    ]
    chosen = libraries(config)
    available = [lib for lib in chosen if baseline_unavailable(config, lib) is None]
    if get_op(config.op).name == "avg":
        if "nccl" in available:
            notes.append("avg: NCCL's ncclAvg may scale before summing; the baseline is not "
                         "checked")
        if "mpi" in available:
            notes.append("avg: MPI has no average; the baseline runs MPI_SUM and is not checked")
    if "gloo" in available:
        notes.append("Gloo: torch.distributed's Gloo group of the same processes, on the same "
                     "buffers (torch.from_numpy, no copy); all_reduce and reduce work in place, "
                     "so the input is copied into the result buffer before each call, untimed")
    if config.device == "gpu":
        notes.append("device time: every timed call ends when the current stream has drained")
    if any(algorithms.get(n).workers is not None for n in config.algorithms):
        notes.append("switch: busbw factor (n-1)/(n+1) of in-network reduction, n the workers")
    header = {
        "command": "refcoll bench",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"node": platform.node(), "arch": platform.machine(),
                    "system": platform.platform(), "cpus": os.cpu_count(),
                    "processor": MPI.Get_processor_name()},
        "mpi": {"library": " ".join(MPI.Get_library_version().splitlines()[0].split()),
                "standard": "%d.%d" % MPI.Get_version()},
        "versions": {"python": platform.python_version(), "numpy": np.__version__,
                     "mpi4py": package("mpi4py"), "refcoll": package("refcoll"),
                     "ml_dtypes": package("ml_dtypes")},
        "gpu": cuda_aware.device_path() if config.device == "gpu" else None,
        "world": comm.size,
        "workers": workers,
        "collective": config.collective,
        "op": op_label(config),
        "dtype": dtype_name(get_dtype(config.dtype)),
        "root": 0 if config.collective in ("broadcast", "reduce") else None,
        "algorithms": list(config.algorithms),
        "sizes": list(config.sizes),
        "baseline": baseline_name(config) if unavailable is None else None,
        "baseline_note": unavailable,
        "baselines": [{"against": lib, "name": baseline_name(config, lib),
                       "available": baseline_unavailable(config, lib) is None,
                       "note": baseline_unavailable(config, lib)} for lib in chosen],
        "device": config.device,
        "against": config.against,
        "warmup": config.warmup,
        "iters": config.iters,
        "check": config.check,
        "bound": config.bound and config.compressor is None,
        "compressor": config.compressor,
        "validate": False,
        "notes": notes,
        "calibration": None,
    }
    if "gloo" in chosen:
        header["versions"]["torch"] = gloo.torch_version()
    if config.device == "gpu":
        cupy = array_module("gpu")
        header["versions"]["cupy"] = getattr(cupy, "__version__", None)
        header["versions"]["nccl"] = nccl.nccl_version()
    if any(algorithms.get(n).chooses for n in config.algorithms):
        # MPI has no nonblocking split: a bounded MPI_Ibarrier first.
        bounded_barrier(comm, "refcoll bench (MPI_Comm_split for auto's calibration)", timeout)
        sub = comm.Split(0 if comm.rank < workers else MPI.UNDEFINED, comm.rank)
        if sub != MPI.COMM_NULL:
            # The calibration of the transport the calls run on (device buffers: its wrapper);
            # its messages wait by the transport's deadline.
            template = array_module(config.device).zeros(1, np.uint8)
            cal = calibration_for(device_for(as_transport(sub), template))
            header["calibration"] = {"alpha": cal.alpha, "beta": cal.beta, "gamma": cal.gamma,
                                     "source": cal.source}
            sub.Free()
        # A bounded MPI_Ibarrier (the spare ranks wait here through the calibration),
        # then the blocking (pickled) bcast.
        bounded_barrier(comm, "refcoll bench (sharing auto's calibration)", timeout)
        header["calibration"] = comm.bcast(header["calibration"], root=0)
    return header


def summarize(rows: Sequence[dict]) -> dict:
    """Return the footer's numbers: average busbw per algorithm and baseline, the check tally.

    ``baseline``, ``base_avg_busbw`` and ``base_wrong`` are the first library's
    (the one in each row's ``base_*`` fields); ``baselines`` has every library's
    ``name``, ``avg_busbw``, ``wrong`` and ``checked``, each baseline counted once
    per size. ``passed`` judges refcoll's results only.
    """
    per: dict[str, list[float]] = defaultdict(list)
    base: list[float] = []
    seen_base = set()
    for row in rows:
        per[row["algorithm"]].append(row["busbw"])
        if row["base_busbw"] is not None and row["size"] not in seen_base:
            seen_base.add(row["size"])
            base.append(row["base_busbw"])
    checked_rows = [r for r in rows if r["wrong"] is not None]
    wrong = sum(r["wrong"] for r in checked_rows) if checked_rows else None
    base_rows = {r["size"]: r["base_wrong"] for r in rows if r["base_wrong"] is not None}
    return {
        "avg_busbw": {name: sum(v) / len(v) for name, v in per.items()},
        "base_avg_busbw": sum(base) / len(base) if base else None,
        "baseline": next((r["baseline"] for r in rows if r["baseline"]), None),
        "wrong": wrong,
        "checked": sum(r["checked"] for r in checked_rows) if checked_rows else None,
        "base_wrong": sum(base_rows.values()) if base_rows else None,
        "baselines": _summarize_baselines(rows),
        "passed": not wrong,
    }


def _summarize_baselines(rows: Sequence[dict]) -> dict:
    """Return ``library -> {name, avg_busbw, wrong, checked}`` over one row per size."""
    per_size: dict[str, dict[int, dict]] = defaultdict(dict)
    for row in rows:
        for library, entry in (row.get("baselines") or {}).items():
            per_size[library].setdefault(row["size"], entry)
    out = {}
    for library, sizes in per_size.items():
        entries = list(sizes.values())
        checked = [e for e in entries if e["wrong"] is not None]
        out[library] = {
            "name": entries[0]["baseline"],
            "avg_busbw": sum(e["busbw"] for e in entries) / len(entries),
            "wrong": sum(e["wrong"] for e in checked) if checked else None,
            "checked": sum(e["checked"] for e in checked) if checked else None,
        }
    return out


def _columns(header: dict) -> list[tuple[str, str, int, Callable]]:
    """Return the table's columns: (title, unit, width, formatter of a row)."""
    cols = [("size", "(B)", 12, lambda r: f"{r['size']}"),
            ("count", "(elements)", 12, lambda r: f"{r['count']}"),
            ("type", "", 13, lambda r: r["dtype"]),
            ("redop", "", 5, lambda r: r["op"]),
            ("algorithm", "", 26, _algorithm_label),
            ("time", "(us)", 10, lambda r: _us(r["time_us"])),
            ("algbw", "(GB/s)", 7, lambda r: f"{r['algbw']:.2f}"),
            ("busbw", "(GB/s)", 7, lambda r: f"{r['busbw']:.2f}")]
    if header["check"] and not header["compressor"]:
        cols.append(("#wrong", "", 7, lambda r: _opt(r["wrong"], "{}")))
    shown = [b for b in header.get("baselines", ()) if b["available"]]
    for entry in shown:
        library, name = entry["against"], entry["name"]
        if len(shown) > 1:  # several libraries: each column named by its library
            short, ratio = LIBRARIES[library], f"time/{LIBRARIES[library]}"
        else:
            short = (name.replace("MPI_", "").replace("Reduce_scatter_block", "RSblock")
                     if library == "mpi" else LIBRARIES[library])
            ratio = "time/base"
        cols += [(short, "(us)", 10, lambda r, k=library: _us(_base(r, k, "time_us"))),
                 ("busbw", "(GB/s)", 7, lambda r, k=library: _opt(_base(r, k, "busbw"), "{:.2f}")),
                 (ratio, "", 9, lambda r, k=library: _opt(_base(r, k, "time_over"), "{:.2f}"))]
    if header["bound"]:
        cols += [("bound", "(us)", 10, lambda r: _us(r["bound_us"])),
                 ("time/bound", "", 10, lambda r: _opt(r["time_over_bound"], "{:.2f}"))]
    if header["compressor"]:
        cols += [("wire", "(B sent)", 12, lambda r: _opt(r["wire_sent"], "{}")),
                 ("dense", "(B sent)", 12, lambda r: _opt(r["dense_sent"], "{}"))]
    return cols


def _base(row: dict, library: str, key: str):
    """Return one number of a library's baseline in ``row`` (None: not run at that size)."""
    return ((row.get("baselines") or {}).get(library) or {}).get(key)


def _algorithm_label(row: dict) -> str:
    return f"{row['algorithm']}({row['resolved']})" if row["resolved"] else row["algorithm"]


def _us(value) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f}" if value < 1e5 else f"{value:.0f}"


def _opt(value, fmt: str) -> str:
    return "n/a" if value is None else fmt.format(value)


def format_header(header: dict) -> str:
    """Return the ``#`` lines that open the table, and the column titles."""
    lines = [
        f"# refcoll bench: {header['collective']}, {header['dtype']} {header['op']}, "
        f"{header['workers']} ranks" + (f" ({header['world']} with switch processes)"
                                       if header["world"] > header["workers"] else ""),
        f"# machine: {header['machine']['node']} ({header['machine']['arch']}, "
        f"{header['machine']['cpus']} CPUs), {header['machine']['system']}",
        f"# MPI: {header['mpi']['library']} (MPI {header['mpi']['standard']}); "
        + ", ".join(f"{k} {v}" for k, v in header["versions"].items() if v),
        f"# iterations: {header['warmup']} warm-up + {header['iters']} timed per size; check: "
        + _check_label(header),
    ]
    where = f"on the same {'device ' if header.get('gpu') else ''}buffers, interleaved"
    lines += [f"# baseline: {b['name']} {where}" if b["available"] else
              f"# baseline: none ({b['note']})"
              for b in header.get("baselines") or [{"available": False,
                                                    "note": header["baseline_note"]}]]
    if header.get("gpu"):
        g = header["gpu"]
        lines.insert(2, f"# device: {g['gpu'] or 'none (' + str(g['gpu_reason']) + ')'}; "
                        f"transfers: {g['path']} ({g['why']})")
    if header["compressor"]:
        lines.append(f"# compressor: {header['compressor']} (algbw and busbw of the dense size)")
    if header["calibration"]:
        c = header["calibration"]
        lines.append(f"# auto: alpha={c['alpha']:.3g} s, beta={c['beta']:.3g} s/B, "
                     f"gamma={c['gamma']:.3g} s/element ({c['source']})")
    lines += [f"# note: {note}" for note in header["notes"]]
    cols = _columns(header)
    lines.append("#" + " ".join(f"{title:>{w}}" for title, _, w, _ in cols))
    lines.append("#" + " ".join(f"{unit:>{w}}" for _, unit, w, _ in cols))
    return "\n".join(lines)


def _check_label(header: dict) -> str:
    if not header["check"]:
        return "off"
    if header["compressor"]:
        return "the baseline only (a compressed result is approximate)"
    return "every iteration, bit for bit"


def format_row(row: dict, header: dict) -> str:
    """Return one row of the table."""
    return " " + " ".join(f"{fmt(row):>{w}}" for _, _, w, fmt in _columns(header))


def format_footer(summary: dict) -> str:
    """Return the closing lines: average bus bandwidths and the correctness tally."""
    averages = [f"{name} {value:.3f}" for name, value in summary["avg_busbw"].items()]
    averages += [f"{b['name']} {b['avg_busbw']:.3f}" for b in summary["baselines"].values()]
    lines = ["# Avg bus bandwidth (GB/s): " + ", ".join(averages)]
    if summary["wrong"] is None:
        lines.append("# #wrong: not checked")
    else:
        verdict = "OK" if summary["passed"] else "FAILED"
        lines.append(f"# #wrong: {summary['wrong']} of {summary['checked']} elements checked: "
                     f"{verdict}")
    lines += [f"# {b['name']} #wrong: {b['wrong']}" for b in summary["baselines"].values()
              if b["wrong"] is not None]
    return "\n".join(lines)


def format_table(header: dict, rows: Sequence[dict]) -> str:
    """Return the whole report: header lines, one line per row, footer."""
    body = [format_row(row, header) for row in rows]
    return "\n".join([format_header(header), *body, format_footer(summarize(rows))])


#: A further library's columns in ``--csv``, after :data:`ROW_FIELDS`: ``gloo_time_us``...
_CSV_BASELINE = (("{}_baseline", "baseline"), ("{}_time_us", "time_us"), ("{}_busbw", "busbw"),
                 ("{}_wrong", "wrong"), ("time_over_{}", "time_over"))


def write_csv(rows: Sequence[dict], path: str) -> None:
    """Write the rows to ``path`` as CSV, one column per field of :data:`ROW_FIELDS`.

    The first library's baseline is in the ``base_*`` fields; each further one
    (``--against mpi,gloo``) adds ``gloo_baseline``, ``gloo_time_us``,
    ``gloo_busbw``, ``gloo_wrong`` and ``time_over_gloo``.
    """
    further = []
    for row in rows:
        for library, entry in (row.get("baselines") or {}).items():
            if entry["baseline"] != row["baseline"] and library not in further:
                further.append(library)
    extra = {column.format(library): (library, key) for library in further
             for column, key in _CSV_BASELINE}
    with open(path, "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=[*ROW_FIELDS, *extra])
        writer.writeheader()
        for row in rows:
            values = {k: row.get(k) for k in ROW_FIELDS}
            values.update({column: _base(row, library, key)
                           for column, (library, key) in extra.items()})
            writer.writerow({k: "" if v is None else v for k, v in values.items()})


def plot(rows: Sequence[dict], path: str, *, title: str = "") -> None:
    """Draw busbw against size, log-log, one line per algorithm and baseline, to ``path``.

    Raises:
        UsageError: matplotlib is not installed (it is in the ``plot`` extra).
    """
    lines: dict[str, list[tuple[int, float]]] = defaultdict(list)
    base_names = set()
    for row in rows:
        lines[row["algorithm"]].append((row["size"], row["busbw"]))
        for entry in (row.get("baselines") or {}).values():
            base_names.add(entry["baseline"])
            if all(size != row["size"] for size, _ in lines[entry["baseline"]]):
                lines[entry["baseline"]].append((row["size"], entry["busbw"]))
    fig = figure(figsize=(8, 5))  # no pyplot: no global state
    ax = fig.subplots()
    for name, points in lines.items():
        shown = sorted((s, b) for s, b in points if s > 0 and b > 0)  # a log axis has no zero
        if shown:
            ax.plot(*zip(*shown), marker="o", label=name,
                    linestyle="--" if name in base_names else "-")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title or "refcoll bench")
    ax.grid(True, which="both", alpha=0.3)
    if any(ax.get_lines()):
        ax.legend()
    fig.savefig(path, format="png", dpi=100)


# --------------------------------------------------------------- a whole report

#: The ``schema`` of ``--json``'s document.
SCHEMA = "refcoll-bench/1"


def run_report(comm, config: BenchConfig, *, line: Callable[[str], None] | None = None,
               progress: Callable[[int, int, int], None] | None = None) -> dict:
    """Run the benchmark with its header and summary, on every rank of ``comm``.

    Args:
        comm: an mpi4py communicator (as :func:`~.run.run_bench` takes it).
        config: what to run.
        line: called with each line of the table as soon as it is known: the
            header's, each row's, the footer's (rank 0 passes
            :meth:`TableWriter.line`; the others nothing).
        progress: :func:`~.run.run_bench`'s ``progress``.

    Returns:
        ``--json``'s document: ``{"schema": SCHEMA, "header", "rows", "summary"}``.
    """
    show = line if line is not None else (lambda text: None)
    header = bench_header(comm, config)
    show(format_header(header))
    rows = run_bench(comm, config, on_row=lambda row: show(format_row(row, header)),
                     progress=progress)
    summary = summarize(rows)
    show(format_footer(summary))
    return {"schema": SCHEMA, "header": header, "rows": rows, "summary": summary}


def save_report(report: dict, *, csv_path: str | None = None,
                plot_path: str | None = None) -> None:
    """Write a :func:`run_report`'s rows as CSV and as a plot, where paths are given."""
    header, rows = report["header"], report["rows"]
    if csv_path:
        write_csv(rows, csv_path)
    if plot_path:
        plot(rows, plot_path, title=f"{header['collective']} {header['dtype']} {header['op']}, "
                                    f"{header['workers']} ranks, {header['mpi']['library']}")
