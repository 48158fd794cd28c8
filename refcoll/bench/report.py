"""The report of ``refcoll bench``: its table, footer, CSV and plot.

:func:`~.header.bench_header` captures the run's environment; :func:`summarize` gives
the footer's numbers; :func:`format_table` (or :func:`format_header`,
:func:`format_row`, :func:`format_footer` line by line) prints the table in one of
two formats: ``refcoll`` (nccl-tests' thirteen columns, out of place and in place,
then refcoll's: the algorithm, each baseline, the bound) or ``nccl-tests``
(nccl-tests' layout exactly, :mod:`.nccl_tests`, refcoll's columns on ``#`` lines);
:func:`write_csv` and :func:`plot` write the rows; :func:`run_report` runs a sweep
with its header and footer, :func:`save_report` writes its files. Where the table
is printed, with its progress bar, is :mod:`.terminal`'s.
"""

from __future__ import annotations

import csv
import io
from collections import defaultdict
from typing import Callable, Sequence

from ..core import writing
from ..core.errors import UsageError
from ..core.plot import figure, save
from . import nccl_tests
from .config import LIBRARIES, ROW_FIELDS, BenchConfig, check_config
from .header import bench_header
from .run import check_room, run_bench

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
    "FORMATS",
]


def _run_key(row: dict) -> tuple:
    """Return what one baseline row stands for: its type, op, root and the sweep's size (not its
    algorithm; the size asked for, since sizes too small for an element all print as 0)."""
    return row["dtype"], row["op"], row.get("root"), row.get("requested", row["size"])


def summarize(rows: Sequence[dict]) -> dict:
    """Return the footer's numbers: average busbw per algorithm and baseline, the check tally.

    Every average is over every row and both halves, as nccl-tests' ``Avg bus
    bandwidth``; ``algorithm`` is the algorithm under test (the first one run)
    and ``under_test_avg_busbw`` its average. ``baseline``, ``base_avg_busbw`` and
    ``base_wrong`` are the first library's (the one in each row's ``base_*``
    fields); ``baselines`` has every library's ``name``, ``avg_busbw``, ``wrong``
    and ``checked``, each baseline counted once per size, type, op and root.
    ``wrong`` and ``checked`` count refcoll's results, both halves;
    ``out_of_bounds`` is nccl-tests' ``Out of bounds values``: the results (one
    per row, half and rank) that had a wrong element. ``passed`` judges
    refcoll's results only.
    """
    per: dict[str, list[float]] = defaultdict(list)
    base: list[float] = []
    seen_base = set()
    wrong = checked = bad = 0
    judged = False
    for row in rows:
        per[row["algorithm"]] += [v for v in (row["busbw"], row.get("inplace_busbw"))
                                  if v is not None]
        key = _run_key(row)
        if row["base_busbw"] is not None and key not in seen_base:
            seen_base.add(key)
            base += [v for v in (row["base_busbw"], row.get("base_inplace_busbw")) if v is not None]
        for prefix in ("", "inplace_"):
            if row.get(prefix + "wrong") is not None:
                judged = True
                wrong += row[prefix + "wrong"]
                checked += row[prefix + "checked"]
                bad += row.get(prefix + "wrong_ranks") or 0
    base_rows = {_run_key(r): (r["base_wrong"] or 0)
                 + (r.get("base_inplace_wrong") or 0) for r in rows if r["base_wrong"] is not None}
    averages = {name: sum(v) / len(v) if v else 0.0 for name, v in per.items()}
    under_test = rows[0]["algorithm"] if rows else None
    return {
        "avg_busbw": averages,
        "algorithm": under_test,
        "under_test_avg_busbw": averages.get(under_test),
        "base_avg_busbw": sum(base) / len(base) if base else None,
        "baseline": next((r["baseline"] for r in rows if r["baseline"]), None),
        "wrong": wrong if judged else None,
        "checked": checked if judged else None,
        "out_of_bounds": bad,
        "base_wrong": sum(base_rows.values()) if base_rows else None,
        "baselines": _summarize_baselines(rows),
        "passed": not wrong,
    }


def _summarize_baselines(rows: Sequence[dict]) -> dict:
    """Return ``library -> {name, avg_busbw, wrong, checked}``, one row per size, both halves."""
    per_size: dict[str, dict[tuple, dict]] = defaultdict(dict)
    for row in rows:
        for library, entry in (row.get("baselines") or {}).items():
            per_size[library].setdefault(_run_key(row), entry)
    out = {}
    for library, sizes in per_size.items():
        entries = list(sizes.values())
        busbw = [v for e in entries for v in (e["busbw"], e.get("inplace_busbw")) if v is not None]
        counts = [(e[f"{p}wrong"], e[f"{p}checked"]) for e in entries for p in ("", "inplace_")
                  if e.get(f"{p}wrong") is not None]
        out[library] = {
            "name": entries[0]["baseline"],
            "avg_busbw": sum(busbw) / len(busbw),
            "wrong": sum(w for w, _ in counts) if counts else None,
            "checked": sum(c for _, c in counts) if counts else None,
        }
    return out


# ------------------------------------------------------------------- refcoll's table

def _checked(header: dict) -> bool:
    return bool(header["check"])


def _columns(header: dict) -> list[tuple[str, str, int, Callable]]:
    """Return the columns after nccl-tests' thirteen: (title, unit, width, formatter of a row)."""
    cols = [("algorithm", "", 24, _algorithm_label)]
    shown = [b for b in header.get("baselines", ()) if b["available"]]
    for entry in shown:
        library, name = entry["against"], entry["name"]
        if len(shown) > 1:  # several libraries: each column named by its library
            short, ratio = LIBRARIES[library], f"time/{LIBRARIES[library]}"
        else:
            short = (name.replace("MPI_", "").replace("Reduce_scatter_block", "RSblock")
                     if library == "mpi" else LIBRARIES[library])
            ratio = "time/base"
        cols += [(short, "(us)", max(9, len(short)),
                  lambda r, k=library: _us(_base(r, k, "time_us"))),
                 ("busbw", "(GB/s)", 6, lambda r, k=library: _opt(_base(r, k, "busbw"), "{:.2f}"))]
        if header.get("in_place") and library == "mpi":
            cols += [("in-place", "(us)", 9,
                      lambda r, k=library: _us(_base(r, k, "inplace_time_us"))),
                     ("busbw", "(GB/s)", 6,
                      lambda r, k=library: _opt(_base(r, k, "inplace_busbw"), "{:.2f}"))]
        cols.append((ratio, "", 9, lambda r, k=library: _opt(_base(r, k, "time_over"), "{:.2f}")))
    if header["bound"]:
        cols += [("bound", "(us)", 9, lambda r: _us(r["bound_us"])),
                 ("time/bound", "", 10, lambda r: _opt(r["time_over_bound"], "{:.2f}"))]
    if header["compressor"]:
        cols += [("wire", "(B sent)", 12, lambda r: _opt(r["wire_sent"], "{}")),
                 ("dense", "(B sent)", 12, lambda r: _opt(r["dense_sent"], "{}"))]
    if header.get("nccl") is not None:
        cols.append(("NCCL chose", "algo/proto", 14, _nccl_label))
    return cols


def _base(row: dict, library: str, key: str):
    """Return one number of a library's baseline in ``row`` (None: not run at that size)."""
    return ((row.get("baselines") or {}).get(library) or {}).get(key)


def _algorithm_label(row: dict) -> str:
    return f"{row['algorithm']}({row['resolved']})" if row["resolved"] else row["algorithm"]


def _nccl_label(row: dict) -> str:
    return f"{row['nccl_algo']}/{row['nccl_proto']}" if row.get("nccl_algo") else "n/a"


def _us(value) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f}" if value < 1e5 else f"{value:.0f}"


def _opt(value, fmt: str) -> str:
    return "n/a" if value is None else fmt.format(value)


def _comments(header: dict) -> list[str]:
    """Return the ``#`` lines that describe the run (both formats print them)."""
    lines = [
        f"# refcoll bench: {header['collective']}, "
        + (f"{header['dtype']} {header['op']}, " if len(header.get("variants") or [0]) == 1
           else f"-d {header['dtype']} -o {header['op']} ({len(header['variants'])} runs), ")
        + f"{header['workers']} ranks" + (f" ({header['world']} with switch processes)"
                                       if header["world"] > header["workers"] else ""),
        f"# machine: {header['machine']['node']} ({header['machine']['arch']}, "
        f"{header['machine']['cpus']} CPUs), {header['machine']['system']}",
        f"# MPI: {header['mpi']['library']} (MPI {header['mpi']['standard']}); "
        + ", ".join(f"{k} {v}" for k, v in header["versions"].items() if v),
        f"# iterations: {header['warmup']} warm-up + {header['iters']} timed per size"
        + (f", {header['agg']} calls back to back in each" if header.get("agg", 1) > 1 else "")
        + "; check: " + _check_label(header),
    ]
    for host in header.get("hosts") or []:
        lines.append(f"# {'OVERSUBSCRIBED' if host['oversubscribed'] else 'cores'}: "
                     f"{host['ranks']} ranks on {host['cores']} cores of {host['host']}")
    forced = (header.get("mpi") or {}).get("algorithm")
    if forced:
        env = " ".join(f"{k}={v}" for k, v in header["mpi"]["forced_env"].items())
        lines.append(f"# MPI algorithm forced: {forced} ({env})")
    nccl_in_force = header.get("nccl")
    if nccl_in_force is not None:
        lines.append(f"# NCCL: NCCL_ALGO={nccl_in_force['algo'] or '(NCCL chooses)'} "
                     f"NCCL_PROTO={nccl_in_force['proto'] or '(NCCL chooses)'}; its choice per "
                     "size from NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=TUNING")
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
    if header.get("topology"):
        lines.append("# nodes: " + "; ".join(
            f"{n['host']} (rack {n['rack']}, {n['ranks']} ranks, link "
            f"{n['link_bits_per_s'] / 1e6:.0f} Mbit/s)" for n in header["topology"]["nodes"])
            + f" ({header['topology']['file']})")
    if header["calibration"]:
        c = header["calibration"]
        across = (f"; across {c['nodes']} nodes of {c['per_node']} ranks: "
                  f"alpha={c['inter_alpha']:.3g} s, beta={c['inter_beta']:.3g} s/B "
                  f"({8 / c['inter_beta'] / 1e6:.0f} Mbit/s)"
                  if c.get("nodes", 0) > 1 and c.get("inter_beta") else "")
        lines.append(f"# auto: alpha={c['alpha']:.3g} s, beta={c['beta']:.3g} s/B, "
                     f"gamma={c['gamma']:.3g} s/element{across} ({c['source']})")
    return lines + [f"# note: {note}" for note in header["notes"]]


def format_header(header: dict, fmt: str = "refcoll") -> str:
    """Return the ``#`` lines that open the table, and the column titles.

    ``fmt``: ``refcoll`` (nccl-tests' thirteen columns, then refcoll's) or
    ``nccl-tests`` (nccl-tests' opening lines exactly, refcoll's on ``#`` lines).
    """
    if fmt == "nccl-tests":
        return "\n".join(nccl_tests.header_lines(header, _comments(header)))
    extra = [(title, unit, width) for title, unit, width, _ in _columns(header)]
    return "\n".join([*_comments(header), *nccl_tests.title_lines("#", extra)])


def _check_label(header: dict) -> str:
    if not header["check"]:
        return "off"
    if header["compressor"]:
        return ("every iteration: each rank's compressed result against the first rank's, "
                "bit for bit (it is approximate, but the same on every rank)")
    return "every iteration, bit for bit"


def format_row(row: dict, header: dict, fmt: str = "refcoll") -> str:
    """Return one row of the table (with ``nccl-tests``: its data line and a ``#`` line).

    With ``nccl-tests`` a row of an algorithm other than the one under test (the
    first of ``header["algorithms"]``) is a ``#`` line too: nccl-tests prints one
    data line per size, and a parser averaging them must get the footer's figure.
    """
    line = nccl_tests.data_line(row, _checked(header))
    if fmt == "nccl-tests":
        shown = [b for b in header.get("baselines", ()) if b["available"]]
        under_test = (header.get("algorithms") or [row["algorithm"]])[0]
        if row["algorithm"] != under_test:  # one data line per size, as nccl-tests prints
            line = nccl_tests.commented(line)
        return line + "\n" + nccl_tests.row_comment(row, shown, header["bound"])
    return line + "".join(f"  {cell(row):>{w}}" for _, _, w, cell in _columns(header))


def format_footer(summary: dict, header: dict | None = None, fmt: str = "refcoll") -> str:
    """Return the closing lines: out-of-bounds values, the average bus bandwidths, the tally.

    ``# Avg bus bandwidth    : X`` is the algorithm under test's, over every row
    and both halves, and ends with its number; with several algorithms each one
    has a labelled line too, and each baseline its own, ``# Avg bus bandwidth
    (MPI_Allreduce) : Y``.
    """
    if fmt == "nccl-tests":
        return "\n".join(nccl_tests.footer_lines(summary, header or {"collective": "?"}))
    bad = summary["out_of_bounds"]
    avg = summary["under_test_avg_busbw"]
    lines = [f"# {'Out of bounds values':<20} : {bad} {'FAILED' if bad else 'OK'}",
             f"# {'Avg bus bandwidth':<20} : {0.0 if avg is None else avg:g}"]
    if len(summary["avg_busbw"]) > 1:
        lines += [f"# Avg bus bandwidth ({name}) : {value:g}"
                  for name, value in summary["avg_busbw"].items()]
    lines += [f"# Avg bus bandwidth ({b['name']}) : {b['avg_busbw']:g}"
              for b in summary["baselines"].values()]
    if summary["wrong"] is None:
        lines.append("# #wrong: not checked")
    else:
        verdict = "OK" if summary["passed"] else "FAILED"
        lines.append(f"# #wrong: {summary['wrong']} of {summary['checked']} elements checked "
                     f"(both halves): {verdict}")
    lines += [f"# {b['name']} #wrong: {b['wrong']}" for b in summary["baselines"].values()
              if b["wrong"] is not None]
    return "\n".join(lines)


def format_table(header: dict, rows: Sequence[dict], fmt: str = "refcoll") -> str:
    """Return the whole report: header lines, one line per row, footer."""
    body = [format_row(row, header, fmt) for row in rows]
    return "\n".join([format_header(header, fmt), *body,
                      format_footer(summarize(rows), header, fmt)])


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
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=[*ROW_FIELDS, *extra])
    writer.writeheader()
    for row in rows:
        values = {k: row.get(k) for k in ROW_FIELDS}
        values.update({column: _base(row, library, key)
                       for column, (library, key) in extra.items()})
        writer.writerow({k: "" if v is None else v for k, v in values.items()})
    writing.write_text(path, text.getvalue())


def plot(rows: Sequence[dict], path: str, *, title: str = "") -> None:
    """Draw busbw against size, log-log, one line per algorithm and baseline, to ``path``.

    Where the run has several dtypes, ops or roots, each is a line of its own (the
    algorithm's name followed by them), as each is a row of its own in the table.

    Raises:
        UsageError: matplotlib is not installed (it is in the ``plot`` extra).
    """
    lines: dict[str, list[tuple[int, float]]] = defaultdict(list)
    base_names = set()
    variants = {(row.get("dtype"), row.get("op"), row.get("root")) for row in rows}

    def label(name: str, row: dict) -> str:
        if len(variants) == 1:
            return name
        parts = [row.get("dtype"), row.get("op")]
        if row.get("root") not in (None, -1):
            parts.append(f"root {row['root']}")
        return f"{name} ({' '.join(str(p) for p in parts if p)})"

    for row in rows:
        lines[label(row["algorithm"], row)].append((row["size"], row["busbw"]))
        for entry in (row.get("baselines") or {}).values():
            name = label(entry["baseline"], row)
            base_names.add(name)
            if all(size != row["size"] for size, _ in lines[name]):
                lines[name].append((row["size"], entry["busbw"]))
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
    save(fig, path, dpi=100)


# --------------------------------------------------------------- a whole report

#: The ``schema`` of ``--json``'s document.
SCHEMA = "refcoll-bench/1"

#: The table's formats (``--format``).
FORMATS = ("refcoll", "nccl-tests")


def run_report(comm, config: BenchConfig, *, line: Callable[[str], None] | None = None,
               progress: Callable[[int, int, int], None] | None = None,
               fmt: str = "refcoll") -> dict:
    """Run the benchmark with its header and summary, on every rank of ``comm``.

    Args:
        comm: an mpi4py communicator (as :func:`~.run.run_bench` takes it).
        config: what to run.
        line: called with each line of the table as soon as it is known: the
            header's, each row's, the footer's (rank 0 passes
            :meth:`TableWriter.line`; the others nothing).
        progress: :func:`~.run.run_bench`'s ``progress``.
        fmt: the table's format, one of :data:`FORMATS`.

    Returns:
        ``--json``'s document: ``{"schema": SCHEMA, "header", "rows", "summary"}``.
    """
    if fmt not in FORMATS:
        raise UsageError(f"unknown format {fmt!r}: choose {' or '.join(FORMATS)}")
    # Before the header is printed: a root outside the data ranks (known only here,
    # inside the job) is refused on every rank with no table begun.
    check_config(config, config.workers or comm.size)
    check_room(config, comm.size)
    show = line if line is not None else (lambda text: None)
    header = bench_header(comm, config)
    show(format_header(header, fmt))
    rows = run_bench(comm, config, on_row=lambda row: show(format_row(row, header, fmt)),
                     progress=progress)
    summary = summarize(rows)
    show(format_footer(summary, header, fmt))
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
