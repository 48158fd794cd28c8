"""nccl-tests' terms: ``all_reduce_perf`` tables, read and written, and a model held to them.

``all_reduce_perf`` (NVIDIA/nccl-tests) prints one row per size: ``size count
type redop [root] time algbw busbw #wrong`` out of place, then the same in
place; ``algbw`` is bytes / time and ``busbw`` is ``algbw · 2(p-1)/p``, in GB/s
(1e9 bytes). :func:`read_table` reads such an output (single- or multi-process,
with or without the ``root`` column, rows prefixed by a launcher's rank tag);
:func:`sweep_sizes` gives ``-b``/``-e``/``-f``'s sizes; :func:`predicted_rows`
the model's rows in the same terms; :func:`compare` the error per size band:
``exp(mean |ln(predicted / measured)|) - 1``, the geometric-mean factor by which
a prediction misses, over the sizes at most 64 KiB, between, and at least 64 MiB.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, replace

from ..bench.nccl_tests import half, preamble, title_lines
from ..bench.options import NCCL_TESTS_TYPES
from ..core.errors import UsageError
from ..core.reading import read_text
from .cluster import MODELLED, Cluster
from .nccl_run import busbw_factor, predict
from .pricing import allreduce_estimate
from .systems import System

__all__ = ["Row", "Table", "each_size_once", "read_table", "parse_table", "sweep_sizes",
           "predicted_rows",
           "BANDS", "band_of", "band_errors", "compare", "Comparison", "MAX_LOG_BYTES",
           "table_lines", "DTYPE_BYTES", "price",
           "as_cluster", "check_ranks", "check_comparable", "MAX_COMPARE_SIZES"]

#: A log larger than this is refused (nccl-tests' output is a few KiB a size).
MAX_LOG_BYTES = 8 << 20

#: nccl-tests' data types and their sizes in bytes.
DTYPE_BYTES = {"int8": 1, "uint8": 1, "int32": 4, "uint32": 4, "int64": 8, "uint64": 8,
               "half": 2, "bfloat16": 2, "float": 4, "double": 8, "f8e4m3": 1, "f8e5m2": 1}

#: The size bands errors are reported in: (name, lowest, highest) bytes, inclusive.
BANDS = (("<= 64 KiB", 0, 64 << 10), ("64 KiB - 64 MiB", (64 << 10) + 1, (64 << 20) - 1),
         (">= 64 MiB", 64 << 20, 1 << 62))


@dataclass(frozen=True)
class Row:
    """One size of an ``all_reduce_perf`` table.

    ``time`` in seconds; ``algbw`` and ``busbw`` in bytes/s. ``in_place_time``
    is ``None`` where the table has no in-place columns.
    """

    size: int
    count: int
    dtype: str
    redop: str
    time: float
    algbw: float
    busbw: float
    in_place_time: float | None = None

    @property
    def measured(self) -> float:
        """The all-reduce's time as the model is held to it: the faster of the out-of-place
        and in-place columns, which time the same call at the same size (a stall, a
        neighbour's traffic or a routing change only ever adds time, as the 8 MiB
        out-of-place row of one published 8-node table shows at 4x its in-place twin)."""
        return self.time if self.in_place_time is None else min(self.time, self.in_place_time)


@dataclass(frozen=True)
class Table:
    """An ``all_reduce_perf`` output: its rows and what its header says.

    ``notes``: the lines that looked like rows but were not used, and the rows
    used with something to say (``#wrong`` above 0), each naming its line.
    """

    rows: tuple[Row, ...]
    ranks: int | None  # the "# Rank N" lines counted, or None when the header has none
    name: str = ""
    notes: tuple[str, ...] = ()


# (The launcher's tag takes its own blanks: two runs of blanks side by side would be tried
# at every split where a long blank line fails to match.)
_ROW = re.compile(r"^\s*(?:(?:\[[^\]]*\]<stdout>:|\[\d+\]|\d+:)\s*)?(\d+)\s+(\d+)\s+"
                  r"([A-Za-z_0-9]+)\s+([A-Za-z_]+)\s+(.*)$")
# "#  Rank  0 Group  0 Pid ..." (nccl-tests 2.13 and later), "#   Rank  0 Pid ..." before
_RANK = re.compile(r"#\s+Rank\s+(\d+)\s+(?:Group\s+\d+\s+)?Pid")
_TEST = re.compile(r"#\s*Collective test starting:\s*(\S+)")
# all_reduce_perf, all_reduce_perf_mpi (nccl-tests' MPI build: NAME_SUFFIX=_mpi), ...exe
_ALL_REDUCE_PERF = re.compile(r"all_reduce_perf(?:_\w+)?(?:\.exe)?")

#: The longest line read as a row (a row is about 150 characters; a longer line is not one).
_LONGEST_ROW = 1024

#: The reductions an all-reduce row names (nccl-tests' ``-o``).
_REDOPS = ("sum", "prod", "min", "max", "avg", "mulsum")

#: The least time a row may give: no collective completes within a nanosecond, and
#: nccl-tests prints times to 0.01 us.
_LEAST_TIME = 1e-9

#: The most bytes a row may give (a size_t's half: no buffer holds more).
_MOST_BYTES = 2**63 - 1

#: The least algbw (GB/s, as printed to 0.01) a row's time is held to: there the printed
#: figure has three digits, so size / algbw is the time to within 1 %.
_CHECKED_ALGBW = 1.0


def _time(text: str) -> float:
    """Return a time column in seconds; ValueError where it is no measured time."""
    value = float(text) * 1e-6
    if not math.isfinite(value) or value < _LEAST_TIME:
        raise ValueError(f"time {text} us")
    return value


def _rate(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"bandwidth {text}")
    return value * 1e9


def _counted(text: str) -> bool:
    """Whether a ``#wrong`` cell counts some: ``3``, or ``1.23457e+06`` (``%g`` from a
    million on), not ``0``, ``0e+00`` or ``N/A``, nor the largest deviation that
    nccl-tests of 2019-2022 printed in that column (``5e-07``: not a whole count)."""
    try:
        value = float(text)
    except ValueError:
        return False
    return math.isfinite(value) and value >= 1 and value == math.floor(value)


def _row(line: str, m: re.Match) -> tuple[Row, str | None]:
    """Return the row of a line that looks like one, and a note on it; ValueError with the
    reason where it is not an all-reduce row that can be used."""
    size, count, dtype, redop, rest = m.groups()
    fields = rest.split()
    if fields and fields[0] == "-1":
        fields = fields[1:]  # the root column: -1 for an all-reduce
    elif len(fields) in (5, 9) and re.fullmatch(r"\d+", fields[0]):
        raise ValueError(f"root {fields[0]}: a reduce's or broadcast's row, not an all-reduce's")
    if redop not in _REDOPS:
        raise ValueError(f"redop {redop}: not an all-reduce's row (all_gather_perf and "
                         "others print none)")
    width = DTYPE_BYTES.get(dtype)
    if width is None:
        raise ValueError(f"type {dtype}: not one of nccl-tests' ({', '.join(DTYPE_BYTES)})")
    if int(size) > _MOST_BYTES:
        raise ValueError(f"size {size[:20]}...: more bytes than any buffer holds (2**63)")
    if int(count) * width != int(size):
        raise ValueError(f"{count} elements of {dtype} are not {size} bytes")
    if len(fields) < 4:
        raise ValueError("fewer columns than time, algbw, busbw and #wrong")
    time, algbw, busbw = _time(fields[0]), _rate(fields[1]), _rate(fields[2])
    # -I 1 (nccl-tests 2.19): each half adds i_min, i_max, i_p99 and i_cv% to its four,
    # so its in-place time is the ninth field; columns after the in-place half (refcoll
    # bench's algorithm, MPI's own times, a bound) leave a word or a name there
    half = 8 if len(fields) >= 16 and _numeric(fields[8]) else 4
    note, in_place = None, None
    if len(fields) >= 2 * half and fields[half] != "N/A":
        try:
            in_place = _time(fields[half])
        except ValueError as exc:
            note = f"its in-place {exc} is not used"
    wrong = [f for f in (fields[3], fields[half + 3] if len(fields) >= 2 * half else "0")
             if _counted(f)]
    if wrong:
        note = (f"#wrong {'/'.join(wrong)}: the library's results were wrong at this size; "
                "its time is used")
    return Row(int(size), int(count), dtype, redop, time, algbw, busbw, in_place), note


def _numeric(field: str) -> bool:
    """Return whether a column holds a number (or nccl-tests' ``N/A`` in its place)."""
    try:
        float(field)
    except ValueError:
        return field == "N/A"
    return True


def parse_table(text: str, name: str = "log") -> Table:
    """Return the all-reduce rows of an ``all_reduce_perf`` output.

    A line that looks like a row but cannot be used (a number that is not one, a
    time of 0, a count that is not the size, a cut line) is left out, and said in
    :attr:`Table.notes`.

    Raises:
        UsageError: the output is another collective's (``all_gather_perf``...), or
            no row could be read (naming ``name``).
    """
    rows, ranks, notes = [], set(), []
    for number, line in enumerate(text.splitlines(), 1):
        if len(line) > _LONGEST_ROW:
            continue
        test = _TEST.search(line)
        if test and not _ALL_REDUCE_PERF.fullmatch(test.group(1)):
            raise UsageError(f"{name} line {number}: {test.group(1)}'s output; the model "
                             "prices all-reduce (all_reduce_perf)")
        rank = _RANK.search(line)
        if rank:
            ranks.add(int(rank.group(1)))
            continue
        m = _ROW.match(line)
        if not m or line.lstrip().startswith("#"):
            continue
        try:
            row, note = _row(line, m)
        except ValueError as exc:
            notes.append(f"line {number} left out: {exc}")
            continue
        rows.append(row)
        if note:
            notes.append(f"line {number} (size {row.size}): {note}")
    if not rows:
        detail = f" ({notes[0]})" if notes else ""
        raise UsageError(f"{name}: no all_reduce_perf row found (size count type redop "
                         f"[root] time algbw busbw #wrong ...){detail}")
    rows, said = _in_seconds(rows, name)
    return Table(tuple(rows), len(ranks) or None, name, tuple(notes + said))


def _in_seconds(rows: list, name: str) -> tuple[list, list]:
    """Return the rows with their times in seconds, and a note where they were not printed
    in microseconds. nccl-tests' algbw is the size over the time, so the rows whose
    algbw has three printed digits say the time column's unit: microseconds, or
    milliseconds (nccl-tests of 2017-2019). Any other ratio is no time of the call
    (``-C 1`` prints the host's CPU time there).

    Raises:
        UsageError: the times disagree with size / algbw.
    """
    ratios = [row.size / row.algbw / row.time for row in rows
              if row.algbw >= _CHECKED_ALGBW * 1e9]
    if not ratios:
        return rows, []
    ratio = statistics.median(ratios)
    if 0.9 <= ratio <= 1.1:
        return rows, []
    if 900 <= ratio <= 1100:
        return ([replace(row, time=row.time * 1e3, in_place_time=None if row.in_place_time
                         is None else row.in_place_time * 1e3) for row in rows],
                ["times printed in milliseconds (nccl-tests before 2019, which says so "
                 "by algbw): read as such"])
    raise UsageError(f"{name}: its time column is {ratio:.3g} times what size / algbw gives, "
                     "so it is not the time of the all-reduce (a -C 1 run prints the host's "
                     "CPU time there); give a log of the all-reduce's own time")


def read_table(path: str) -> Table:
    """Read an ``all_reduce_perf`` output file (bounded, a regular file)."""
    return parse_table(read_text(path, max_bytes=MAX_LOG_BYTES,
                                 what="all_reduce_perf output"), str(path))


#: The most sizes one sweep prints.
MAX_SWEEP_SIZES = 4096


def sweep_sizes(begin: int, end: int, factor: int = 2, step: int = 0,
                width: int = 1) -> list[int]:
    """Return nccl-tests' sizes: ``-b begin -e end -f factor`` (or ``-i step``).

    As ``all_reduce_perf`` prints them: each is rounded down to whole elements of
    ``width`` bytes (``-b 6`` of float is 4 bytes, 1 element), the sizes that round
    to the same one printed once.
    """
    if begin < 1 or end < begin:
        raise UsageError(f"sweep sizes: -b {begin} must be at least 1 and at most -e {end}")
    if end > (1 << 63) - 1:
        raise UsageError(f"sweep sizes: -e {end} is past the largest size (2**63 - 1 bytes)")
    if step > 0:
        if (end - begin) // step >= MAX_SWEEP_SIZES:
            raise UsageError(f"sweep sizes: -i makes more than {MAX_SWEEP_SIZES} sizes")
        raw = range(begin, end + 1, step)
    elif factor < 2:
        raise UsageError(f"sweep sizes: -f {factor} must be at least 2 (or give -i)")
    else:
        raw, size = [], begin
        while size <= end:
            raw.append(size)
            size *= factor
    sizes = sorted({size - size % width for size in raw})
    if sizes and sizes[0] == 0:
        raise UsageError(f"sweep sizes: -b {begin} is less than one element ({width} bytes); "
                         f"give -b {width} or more")
    return sizes


def predicted_rows(system: System, sizes, algorithm: str | None = None,
                   dtype: str = "float") -> list[dict]:
    """Return one row per size, nccl-tests' columns and the run priced.

    Each: ``size`` (bytes), ``count``, ``type``, ``redop``, ``time_us``,
    ``algbw`` and ``busbw`` (GB/s), ``algorithm``, ``protocol``, ``channels``,
    ``limit``, and ``asked`` (the ``--algorithm`` asked, or ``pick`` for NCCL's own
    choice: ``nccl`` is refcoll's schedule of that name).
    """
    width, factor = DTYPE_BYTES[dtype], busbw_factor(system.ranks)
    out = []
    for size in sizes:
        priced = price(system, size, algorithm, dtype)
        if priced is None:
            continue
        seconds, name, protocol, channels, limit = priced
        algbw = size / seconds
        out.append({"size": size, "count": size // width, "type": dtype, "redop": "sum",
                    "time_us": seconds * 1e6, "algbw": algbw / 1e9,
                    "busbw": algbw * factor / 1e9, "algorithm": name, "protocol": protocol,
                    "channels": channels, "limit": limit, "asked": algorithm or "pick"})
    return out


def as_cluster(system: System):
    """Return the :class:`~refcoll.model.cluster.Cluster` of ``system``: refcoll's own
    algorithms priced on its links, at their rates and NCCL's Simple hop latencies (or
    the latencies the user gave, ``--intra-latency`` and ``--inter-latency``, where
    longer: a step takes at least that long, as NCCL's runs take them)."""
    nvlink = 3.4e-6 if system.nvlink else 5.7e-6  # hwLat[NVLINK|PCI][Ring][Simple]
    nics = max(system.nics, 1)
    return Cluster(nodes=system.nodes, gpus_per_node=system.gpus_per_node,
                   intra_bw=system.intra_rate(),
                   inter_bw=(system.nic_rate() / nics) if system.nodes > 1 else 1e12,
                   intra_latency=max(nvlink, system.intra_alpha) + system.intra_latency(),
                   inter_latency=max(14e-6, system.inter_alpha)  # hwLat[NET][Ring][Simple]
                   + system.net_latency(),
                   in_network=system.collnet, nics=nics if system.nodes > 1 else None,
                   channels=system.channels, gpu_arch=system.generation)


def price(system: System, size: int, algorithm: str | None = None, dtype: str = "float",
          op: str = "sum"):
    """Return ``(seconds, algorithm, protocol, channels, limit)`` of an all-reduce of
    ``size`` bytes of nccl-tests' ``dtype`` reduced by ``op``: NCCL's pick (None), one of
    NCCL's algorithms as NCCL spells it (``Ring``, ``NVLS``, ``Tree/LL``...), or one of
    refcoll's own schedules, in lower case (``ring``, ``hierarchical``...: priced on the
    system's links, protocol ``-``). None where the algorithm cannot run there."""
    if algorithm in MODELLED:
        width = DTYPE_BYTES.get(dtype, 4)
        est = allreduce_estimate(as_cluster(system), algorithm, max(size // width, 1), width)
        return est.seconds, algorithm, "-", system.channel_count(), "-"
    run = predict(system, size, algorithm, dtype=dtype, op=op)
    if run is None:
        return None
    return run.seconds, run.algorithm, run.protocol, run.channels, run.limit


def table_lines(rows: list[dict], ranks: int) -> list[str]:
    """Return nccl-tests' title and data lines for ``rows`` (one algorithm), in its widths.

    The lines are ``refcoll bench --format nccl-tests``' (:mod:`refcoll.bench.nccl_tests`),
    so what reads ``all_reduce_perf`` reads these (:func:`parse_table` among them); the
    prediction is the same in place, and what NCCL runs is a column after nccl-tests'.
    """
    extra = (("algorithm", "", 24),)
    lines = [f"# all_reduce_perf, predicted on {ranks} ranks", *title_lines(extra=extra)]
    for r in rows:
        how = (f"refcoll {r['algorithm']}" if r["protocol"] == "-" else
               f"{r['algorithm']}/{r['protocol']} x{r['channels']}")
        cells = half(r["time_us"], r["algbw"], r["busbw"], None, checked=False)
        row = {"size": r["size"], "count": r["count"], "dtype": NCCL_TESTS_TYPES[r["type"]],
               "op": r["redop"], "collective": "allreduce"}
        lines.append(f"{preamble(row)}{cells}{cells}  {how:>24}")
    return lines


def band_of(size: int) -> str:
    for name, low, high in BANDS:
        if low <= size <= high:
            return name
    return BANDS[-1][0]


def band_errors(pairs) -> dict:
    """Return ``{band: (error, count)}`` for ``(size, predicted, measured)`` triples.

    The error is ``exp(mean |ln(predicted / measured)|) - 1`` over the band's
    sizes (``nan`` for a band with none); ``"all"`` pools every size.
    """
    logs: dict[str, list[float]] = {name: [] for name, _, _ in BANDS}
    logs["all"] = []
    for size, predicted, measured in pairs:
        if predicted > 0 and measured > 0:
            d = abs(math.log(predicted / measured))
            logs[band_of(size)].append(d)
            logs["all"].append(d)
    return {name: ((math.exp(sum(v) / len(v)) - 1) if v else math.nan, len(v))
            for name, v in logs.items()}


@dataclass
class Comparison:
    """A measured table beside the model's prediction of it."""

    table: Table
    system: System
    rows: list[dict]  # size, measured_us (and both columns), predicted_us, ratio, ...
    errors: dict
    within: int  # sizes predicted within 30 %

    def to_json(self) -> dict:
        return {"log": self.table.name, "system": self.system.describe(), "rows": self.rows,
                "notes": list(self.table.notes),
                "errors": {k: {"error": (None if math.isnan(e) else e), "sizes": n}
                           for k, (e, n) in self.errors.items()},
                "within_30_percent": self.within}


def each_size_once(rows) -> tuple[Row, ...]:
    """Return ``rows`` with each size once, the fastest measured (a stall only ever adds
    time), in order of size; a size of 0 bytes (what ``-b 0`` or ``-b 1`` prints: a call
    with no data, its time the launch alone) is left out."""
    fastest: dict = {}
    for r in rows:
        if r.size == 0:
            continue
        if r.size not in fastest or r.measured < fastest[r.size].measured:
            fastest[r.size] = r
    return tuple(fastest[size] for size in sorted(fastest))


#: The most sizes ``--compare`` prices (at thousands of ranks a refcoll schedule takes
#: seconds a size).
MAX_COMPARE_SIZES = 512

#: How far a row's busbw / algbw may be from ``2(p-1)/p``: each is printed to 0.01 GB/s,
#: and only rows of at least 1 GB/s are read, so rounding moves it by 1 % at most.
_BUS_TOLERANCE = 0.02


def check_ranks(table: Table, ranks: int) -> None:
    """Refuse a table whose rows were measured on another rank count than ``ranks``.

    ``all_reduce_perf`` prints ``busbw = algbw · 2(p-1)/p``, so each row says its rank
    count wherever it prints enough digits (algbw of at least 1 GB/s): another
    collective's output (``sendrecv_perf``'s busbw is its algbw), a log of another
    node count, or two runs of different sizes in one file. The factor tells ``p`` from
    ``2p`` up to about 25 ranks; beyond, the rows' ``# Rank`` lines are its word.
    """
    factor = busbw_factor(ranks)
    for r in table.rows:
        if r.algbw < 1e9 or r.size == 0:
            continue
        said = r.busbw / r.algbw
        if abs(said - factor) > _BUS_TOLERANCE * factor:
            implied = 2.0 / (2.0 - said) if said < 2.0 else math.inf
            more = (f"{implied:.0f} ranks" if 1 <= implied < 1e6 else
                    "no all-reduce of any rank count")
            raise UsageError(f"{table.name}: the row of {r.size} B has busbw/algbw "
                             f"{said:.3f}, which is {more}; an all-reduce on the {ranks} "
                             f"ranks described has {factor:.3f} (another collective's "
                             "output, another node count, or two runs in one file): say "
                             "--nodes and --gpus-per-node, or give one all_reduce_perf run")


def check_comparable(table: Table, ranks: int) -> list[Row]:
    """Refuse a table :func:`compare` cannot set beside ``ranks`` ranks (:func:`check_ranks`,
    more than :data:`MAX_COMPARE_SIZES` sizes); return its sizes, each once."""
    check_ranks(table, ranks)
    sizes = each_size_once(table.rows)
    if len(sizes) > MAX_COMPARE_SIZES:
        raise UsageError(f"{table.name}: {len(sizes)} sizes to price; give at most "
                         f"{MAX_COMPARE_SIZES} (nccl-tests' -b 8 -e 8G -f 2 is 31)")
    return sizes


def compare(table: Table, system: System, algorithm: str | None = None) -> Comparison:
    """Return the model's prediction of every size of ``table`` beside its measurement.

    The measured time is :attr:`Row.measured`, the faster of the out-of-place and
    in-place columns (both are kept beside it), and its busbw is computed from it.
    A size the log holds twice (two runs in one file) is taken once, the faster, and a
    size of 0 bytes not at all (:func:`each_size_once`). A log whose rows say another rank
    count (:func:`check_ranks`), or with more than :data:`MAX_COMPARE_SIZES` sizes, is
    refused (:func:`check_comparable`).
    """
    sizes = check_comparable(table, system.ranks)
    rows, pairs = [], []
    for r in sizes:
        priced = price(system, r.size, algorithm, r.dtype, r.redop)
        if priced is None:
            continue
        seconds, name, protocol = priced[:3]
        rows.append({"size": r.size, "measured_us": r.measured * 1e6,
                     "out_of_place_us": r.time * 1e6,
                     "in_place_us": None if r.in_place_time is None else r.in_place_time * 1e6,
                     "predicted_us": seconds * 1e6, "ratio": seconds / r.measured,
                     "measured_busbw": r.size / r.measured * busbw_factor(system.ranks) / 1e9,
                     "predicted_busbw": r.size / seconds * busbw_factor(system.ranks) / 1e9,
                     "algorithm": name, "protocol": protocol})
        pairs.append((r.size, seconds, r.measured))
    within = sum(1 for _, p, m in pairs if abs(p / m - 1) <= 0.3)
    return Comparison(table, system, rows, band_errors(pairs), within)
