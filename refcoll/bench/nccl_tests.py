"""nccl-tests' printed layout, for ``refcoll bench --format nccl-tests`` and its first columns.

nccl-tests (``src/util.cu``: ``writeDeviceReport``, ``writeResultHeader``,
``writeBenchmarkLinePreamble``, ``writeBenchmarkLineBody``, ``writeResultFooter``)
prints a ``# nThread ...`` line, ``# Using devices`` and one ``#  Rank`` line per
rank, three column-title lines, then one data line per size: ``size count type
redop root`` and, out of place then in place, ``time algbw busbw #wrong`` (a
number squeezed into its column by ``getFloatStr``; ``N/A`` under ``#wrong``
when not checking), and closes with ``# Out of bounds values : N OK|FAILED``,
``# Avg bus bandwidth    : X``, ``#``, ``# Collective test concluded`` and ``#``
(``finalizeFooter``). This module prints the same lines from a report, so a
parser of nccl-tests' output reads refcoll's; what only refcoll has (the
algorithm and what ``auto`` chose, the baselines, the bound, NCCL's choice)
goes on ``#`` lines, which such parsers skip. nccl-tests prints one data line
per size (and type, op, root): with several algorithms only the one under test
(the first) has data lines, the others' rows are ``#`` lines
(:func:`commented`), so that the mean of the data lines' busbw is the footer's
``Avg bus bandwidth``.
"""

from __future__ import annotations

from typing import Sequence

from .config import table_count
from .options import program_name, table_type

__all__ = ["float_str", "preamble", "half", "title_lines", "header_lines", "data_line",
           "commented", "footer_lines", "row_comment"]


def float_str(value: float | None, width: int) -> str:
    """Return ``value`` in ``width`` columns as nccl-tests' ``getFloatStr``: 2, 1, 0 decimals, e.

    Its ``snprintf(str, width+1, ...)`` cuts what still does not fit to ``width``.
    """
    if value is None:
        return f"{'N/A':>{width}}"
    for fmt in (".2f", ".1f", ".0f"):
        text = f"{value:{width}{fmt}}"
        if len(text) <= width:
            return text
    return f"{value:{width}{'.1e' if width >= 7 else '.0e'}}"[:width]


def preamble(row: dict) -> str:
    """Return a data line's ``size count type redop root``, in nccl-tests' widths.

    ``count`` is nccl-tests' (:func:`~.config.table_count`: one rank's chunk for
    reduce-scatter and allgather), ``size`` the bytes of the whole array.
    """
    root = row.get("root")
    count = table_count(row.get("collective", ""), row["count"], row.get("ranks") or 1)
    return (f"{row['size']:12d}  {count:12d}  {table_type(row['dtype']):>8}  "
            f"{row['op']:>6}  {-1 if root is None else root:6d}")


def half(time_us, algbw, busbw, wrong, *, checked: bool) -> str:
    """Return one half's ``time algbw busbw #wrong`` (``N/A`` where not checked or not run)."""
    cells = f"  {float_str(time_us, 7)}  {float_str(algbw, 6)}  {float_str(busbw, 6)}"
    if checked and wrong is not None:
        return cells + f"  {float(wrong):6g}"
    return cells + "    N/A"


def data_line(row: dict, checked: bool) -> str:
    """Return nccl-tests' data line of a row: preamble, the out-of-place half, the in-place half."""
    return (preamble(row)
            + half(row["time_us"], row["algbw"], row["busbw"], row["wrong"], checked=checked)
            + half(row.get("inplace_time_us"), row.get("inplace_algbw"),
                   row.get("inplace_busbw"), row.get("inplace_wrong"), checked=checked))


def commented(line: str) -> str:
    """Return a data line as a ``#`` line, its columns where they were (a row not under test)."""
    return "#" + line[1:] if line.startswith(" ") else "# " + line


def title_lines(prefix: str = "#", extra: Sequence[tuple[str, str, int]] = ()) -> list[str]:
    """Return nccl-tests' three title lines, with refcoll's ``extra`` columns after its own.

    ``extra`` is ``(title, unit, width)`` per column (none: exactly nccl-tests').
    """
    more = "".join(f"  {title:>{w}}" for title, _, w in extra)
    units = "".join(f"  {unit:>{w}}" for _, unit, w in extra)
    return [
        f"{prefix} {'':>10}  {'':>12}  {'':>8}  {'':>6}  {'':>6}           out-of-place"
        "                       in-place          ",
        f"{prefix} {'size':>10}  {'count':>12}  {'type':>8}  {'redop':>6}  {'root':>6}  "
        f"{'time':>7}  {'algbw':>6}  {'busbw':>6}  {'#wrong':>6}  {'time':>7}  {'algbw':>6}  "
        f"{'busbw':>6}  {'#wrong':>6} " + more,
        f"{prefix} {'(B)':>10}  {'(elements)':>12}  {'':>8}  {'':>6}  {'':>6}  {'(us)':>7}  "
        f"{'(GB/s)':>6}  {'(GB/s)':>6}  {'':>6}  {'(us)':>7}  {'(GB/s)':>6}  {'(GB/s)':>6}  "
        f"{'':>6} " + units,
    ]


def _sweep(header: dict) -> tuple[int, int, int]:
    """Return ``(minBytes, maxBytes, factor)`` as given (``-b -e -f``), else read off the sizes."""
    if header.get("sweep"):
        return tuple(header["sweep"])
    sizes = header["sizes"]
    factor = sizes[1] // sizes[0] if len(sizes) > 1 and sizes[1] % sizes[0] == 0 else 1
    return sizes[0], sizes[-1], factor


def header_lines(header: dict, comments: Sequence[str]) -> list[str]:
    """Return nccl-tests' opening lines for ``header``, with refcoll's ``comments`` after."""
    low, high, factor = _sweep(header)
    lines = [
        f"# Collective test starting: {program_name(header['collective'])}",
        f"# nThread 1 nGpus 1 minBytes {low} maxBytes {high} step: {factor}(factor) "
        f"warmup iters: {header['warmup']} iters: {header['iters']} agg iters: "
        f"{header.get('agg', 1)} validation: {header.get('validation', int(header['check']))} "
        "graph: 0 unalign: 0",
        "#",
        "# Using devices",
    ]
    gpu = (header.get("gpu") or {}).get("gpu")
    name = gpu or f"{header['machine']['arch']} CPU"
    for rank in header.get("ranks") or []:
        device = rank["device"] if rank.get("device") is not None else -1
        where = "gpu" if gpu else f"{rank['cores']} cores"
        lines.append(f"#  Rank {rank['rank']:2d} Group  0 Pid {rank['pid']:6d} on "
                     f"{rank['host']:>10} device {device:2d} [{where}] {name}")
    return lines + ["#", *comments, *title_lines()]


def _us(value: float) -> str:
    return f"{value:.2f}" if value < 1e5 else f"{value:.0f}"


def row_comment(row: dict, baselines: Sequence[dict], bound: bool) -> str:
    """Return the ``#`` line after a data line: what only refcoll reports about that row."""
    algorithm = (f"{row['algorithm']} -> {row['resolved']}" if row.get("resolved")
                 else row["algorithm"])
    parts = [f"algorithm {algorithm}"]
    for entry in baselines:
        got = (row.get("baselines") or {}).get(entry["against"])
        if got is None:
            continue
        text = f"{got['baseline']} {_us(got['time_us'])} us " \
               f"busbw {got['busbw']:.2f}"
        if got.get("inplace_time_us") is not None:
            text += (f", in place {_us(got['inplace_time_us'])} us busbw "
                     f"{got['inplace_busbw']:.2f}")
        if got.get("time_over") is not None:
            text += f", time/base {got['time_over']:.2f}"
        if got.get("wrong") is not None:
            text += f", #wrong {got['wrong']}" + (
                f" (in place {got['inplace_wrong']})" if got.get("inplace_wrong") is not None
                else "")
        parts.append(text)
    if bound and row.get("bound_us") is not None:
        parts.append(f"bound {_us(row['bound_us'])} us, time/bound "
                     f"{row['time_over_bound']:.2f}")
    if row.get("wire_sent") is not None:
        parts.append(f"wire {row['wire_sent']} B sent (dense {row['dense_sent']} B)")
    if row.get("nccl_algo"):
        parts.append(f"NCCL chose {row['nccl_algo']}/{row['nccl_proto']}"
                     + (f" on {row['nccl_channels']} channels" if row.get("nccl_channels")
                        else ""))
    return "#  ^ refcoll: " + "; ".join(parts)


def footer_lines(summary: dict, header: dict) -> list[str]:
    """Return nccl-tests' closing lines: out-of-bounds count, the average busbw, the end.

    ``# Avg bus bandwidth`` is the algorithm under test's (the first), over every
    row and both halves; the other algorithms' and the baselines' averages come
    before, on ``#`` lines worded so that nothing but that one line matches
    ``Avg bus bandwidth``.
    """
    lines = [f"# refcoll: average busbw of {name}: {value:g} GB/s"
             for name, value in summary["avg_busbw"].items()
             if name != summary["algorithm"] or len(summary["avg_busbw"]) > 1]
    lines += [f"# refcoll: average busbw of baseline {b['name']}: {b['avg_busbw']:g} GB/s"
              + (f", #wrong {b['wrong']}" if b["wrong"] is not None else "")
              for b in summary["baselines"].values()]
    bad = summary["out_of_bounds"]
    avg = summary["under_test_avg_busbw"]
    lines += [f"# {'Out of bounds values':<20} : {bad} {'FAILED' if bad else 'OK'}",
              f"# {'Avg bus bandwidth':<20} : {0.0 if avg is None else avg:g} ",
              "#",
              f"# Collective test concluded: {program_name(header['collective'])}",
              "#"]
    return lines
