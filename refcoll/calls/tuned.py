"""A tuning file: the algorithm measured fastest at each size, which ``auto`` then runs.

The α-β-γ model cannot see everything a machine does (a link's token bucket, the
Python each phase pays, ranks that share cores), so, as MPICH reads a JSON tuning
file and Open MPI a dynamic rules file, ``auto`` can run what a benchmark found
fastest instead. ``refcoll tune BENCH.json... -o FILE`` writes the file from
``refcoll bench --json`` runs (:func:`from_bench`); ``REFCOLL_TUNING_FILE=FILE``
makes ``auto`` read it::

    {"version": 1, "source": "refcoll tune",
     "tables": [{"collective": "allreduce", "ranks": 4, "nodes": 2, "per_node": 2,
                 "dtype": "float32", "from": "bench.json",
                 "rules": [{"bytes": 65536, "algorithm": "hierarchical(inter=recursive_doubling)",
                            "time_us": 612.0}, ...]}]}

A table applies to a call of its collective on its number of ranks, spread over its
nodes (``nodes`` × ``per_node``; 1 × ranks on one machine), any dtype: the rule of
the measured size (bench's: the whole array, as nccl-tests counts it) nearest the
call's on a log scale, where the call's bytes lie within a factor of 2 of the sizes
measured (:data:`REACH`). Elsewhere, or where
``REFCOLL_ALGO`` excludes the rule's algorithm, the cost model chooses as without a
file. Under MPI rank 0 reads the file and sends what it read to the others, so the
ranks of different hosts choose alike; a file that cannot be read or names an
algorithm that cannot run the collective is the same :class:`UsageError` on every
rank. The simulator reads it from the environment, so it predicts the tuned bits.

Both files are read through :mod:`refcoll.core.reading`: a tuning file or a bench
report must be a regular file of at most :data:`~refcoll.core.reading.MAX_JSON_BYTES`
(``/dev/zero`` or a FIFO is refused at once), its JSON finite and shallow, and every
field of the kind and within the range it is documented to have (:data:`MOST_BYTES`,
:data:`MOST_RANKS`); anything else is one :class:`UsageError` naming the file and the
field.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import numpy as np

from .. import algorithms
from ..algorithms.naive import naive_broadcast
from ..algorithms.spelling import check_spelled, spell
from ..core.errors import UsageError
from ..core.reading import MAX_JSON_BYTES, loads_json, number, read_bytes, read_text

__all__ = ["TUNING_ENV", "REACH", "MOST_BYTES", "MOST_RANKS", "Rule", "Table", "Tuning", "read",
           "parse", "from_bench", "read_report", "agreed_tuning", "tuning_path"]

#: The environment variable that names the tuning file.
TUNING_ENV = "REFCOLL_TUNING_FILE"

#: How far beyond the sizes it measured a table reaches: a factor of 2 each way.
REACH = 2.0

#: The largest size a rule or a bench row may name, in bytes (4 EiB: no machine has more).
MOST_BYTES = 1 << 62

#: The most ranks (and nodes, and ranks per node) a table or a bench report may name.
MOST_RANKS = 1 << 24

#: A rule's option values are checked by pricing it (its cost formula refuses what its
#: run would) on tables of at most this many ranks; larger ones are checked as they run.
_PRICED_RANKS = 1024


@dataclass(frozen=True)
class Rule:
    """One measured size (bench's: the whole array), the fastest algorithm there, its time."""

    nbytes: int
    algorithm: str  # spelled: hierarchical(inter=ring,pipeline=8)
    time_us: float


@dataclass(frozen=True)
class Table:
    """The rules of one collective on one layout of ranks, by size."""

    collective: str
    ranks: int
    nodes: int
    per_node: int
    rules: tuple[Rule, ...]
    dtype: str = ""
    origin: str = ""

    def reach(self) -> tuple[float, float]:
        """Return the least and most bytes of a call the table applies to: :data:`REACH`
        beyond the sizes measured, each way."""
        return self.rules[0].nbytes / REACH, self.rules[-1].nbytes * REACH

    def rule(self, nbytes: int) -> Rule | None:
        """Return the rule nearest ``nbytes`` on a log scale (the smaller on a tie), or None
        beyond :meth:`reach`."""
        low, high = self.reach()
        if nbytes < low or nbytes > high:
            return None
        size = max(nbytes, 1)
        return min(self.rules, key=lambda r: (abs(math.log(size / r.nbytes)), r.nbytes))


@dataclass(frozen=True)
class Tuning:
    """A tuning file's tables and where it was read from."""

    tables: tuple[Table, ...]
    path: str = ""

    def choice(self, collective: str, ranks: int, shape, nbytes: int,
               allowed: list[str] | None = None) -> tuple[str, dict] | None:
        """Return ``(algorithm, options)`` for a call, or None where no table applies.

        ``shape`` is the ranks' :class:`~refcoll.algorithms.registry.NodeShape`
        (None on one machine); ``nbytes`` the call's size as bench counts it (the
        whole array); ``allowed``: the algorithms ``REFCOLL_ALGO`` leaves, where it
        names some (a rule of another is not taken).
        """
        nodes, per_node = (1, ranks) if shape is None else (shape.nodes, shape.per_node)
        for table in self.tables:
            if (table.collective, table.ranks, table.nodes, table.per_node) == \
                    (collective, ranks, nodes, per_node):
                rule = table.rule(nbytes)
                if rule is None:
                    return None
                name, options = check_spelled(rule.algorithm, collective)
                return None if allowed is not None and name not in allowed else (name, options)
        return None


def _fields(where: str, entry, kind: str) -> dict:
    """Return ``entry`` if it is a JSON object, else raise one line saying what it is instead."""
    if not isinstance(entry, dict):
        raise UsageError(f"{where}: {kind} must be an object, not {type(entry).__name__} "
                         f"{json.dumps(entry)[:40]}")
    return entry


def _list(where: str, value, kind: str) -> list:
    """Return ``value`` if it is a JSON array, else raise one line naming ``kind``."""
    if not isinstance(value, list):
        raise UsageError(f"{where}: must be a list of {kind}, not {type(value).__name__}")
    return value


def _string(where: str, value) -> str:
    if not isinstance(value, str) or not value:
        raise UsageError(f"{where}: must be a name (a string), not {value!r}"[:200])
    return value


def _table(where: str, entry) -> Table:
    """Return one table of a tuning file, every field checked (one line names the first bad)."""
    entry = _fields(where, entry, "a table")
    if "collective" not in entry or "ranks" not in entry or "rules" not in entry:
        missing = [k for k in ("collective", "ranks", "rules") if k not in entry]
        raise UsageError(f"{where}: a table lacks {', '.join(missing)}")
    collective = _string(f"{where}.collective", entry["collective"])
    ranks = number(entry["ranks"], where=f"{where}.ranks", integer=True, least=1,
                   most=MOST_RANKS)
    nodes = number(entry.get("nodes", 1), where=f"{where}.nodes", integer=True, least=1,
                   most=ranks)
    per_node = number(entry.get("per_node", -(-ranks // nodes)), where=f"{where}.per_node",
                      integer=True, least=1, most=ranks)
    if nodes * per_node < ranks or per_node > ranks - nodes + 1:
        # per_node is the most ranks a node holds: every node holds at least one
        raise UsageError(f"{where}: {ranks} ranks cannot lie on {nodes} node(s) of at most "
                         f"{per_node} rank(s) each, at least one a node; per_node is the "
                         "most ranks any node holds")
    rules = []
    for i, rule in enumerate(_list(f"{where}.rules", entry["rules"], "rules")):
        at = f"{where}.rules[{i}]"
        rule = _fields(at, rule, "a rule")
        if "bytes" not in rule or "algorithm" not in rule:
            raise UsageError(f"{at}: a rule needs bytes and algorithm")
        time_us = rule.get("time_us")
        rules.append(Rule(number(rule["bytes"], where=f"{at}.bytes", integer=True, least=1,
                                 most=MOST_BYTES),
                          _string(f"{at}.algorithm", rule["algorithm"]),
                          0.0 if time_us is None else
                          float(number(time_us, where=f"{at}.time_us", least=0))))
    sizes = [r.nbytes for r in rules]
    if len(set(sizes)) < len(sizes):
        twice = next(size for size in sizes if sizes.count(size) > 1)
        raise UsageError(f"{where}: two rules at {twice} B; a table has one rule a size")
    dtype, origin = entry.get("dtype", ""), entry.get("from", "")
    return Table(collective, ranks, nodes, per_node,
                 tuple(sorted(rules, key=lambda r: r.nbytes)),
                 dtype if isinstance(dtype, str) else "", origin if isinstance(origin, str) else "")


def parse(text: str, path: str = "") -> Tuning:
    """Return the tuning a file's text holds; :class:`UsageError` names what is wrong in it.

    The JSON is parsed within :func:`refcoll.core.reading.loads_json`'s bounds and
    every field checked: sizes whole numbers of 1 to :data:`MOST_BYTES` bytes, ranks,
    nodes and ranks per node whole numbers of 1 to :data:`MOST_RANKS`, times finite
    and not negative, every algorithm one ``auto`` can run for the collective.
    """
    where = f"the tuning file {path} ({TUNING_ENV})"
    data = loads_json(text, source=where)
    if not isinstance(data, dict) or "tables" not in data:
        raise UsageError(f"{where} is not a refcoll tuning file: it must be an object with "
                         "tables; write it with refcoll tune")
    if data.get("version", 1) != 1:
        raise UsageError(f"{where}: version {json.dumps(data['version'])[:20]}; this refcoll "
                         "reads version 1 (write the file again with refcoll tune)")
    tables = [_table(f"{where}: tables[{i}]", entry)
              for i, entry in enumerate(_list(f"{where}: tables", data["tables"], "tables"))]
    layouts: dict = {}  # a second table for a layout would never be read: refused
    for i, table in enumerate(tables):
        layout = (table.collective, table.ranks, table.nodes, table.per_node)
        if layout in layouts:
            raise UsageError(f"{where}: tables[{layouts[layout]}] and tables[{i}] are both for "
                             f"{table.collective} on {table.ranks} ranks, {table.nodes} nodes "
                             f"of {table.per_node}; one table a layout (refcoll tune merges "
                             "the reports of one layout)")
        layouts[layout] = i
    checked: set = set()  # (collective, ranks, spelled algorithm) priced already
    for table in tables:
        if not table.rules:
            raise UsageError(f"{where}: a table of {table.collective} on {table.ranks} ranks "
                             "has no rule")
        for rule in table.rules:
            try:
                name, options = check_spelled(rule.algorithm, table.collective)
                algo = algorithms.get(name)
                if algo.workers is not None or not algo.pinnable:
                    raise UsageError(f"it names {name}, which auto cannot run (it needs "
                                     "processes beyond the data ranks, or it is auto)")
                priced = (table.collective, table.ranks, rule.algorithm)
                if (options and priced not in checked and table.ranks <= _PRICED_RANKS
                        and table.collective in algo.costs):
                    # the cost formula checks the options' values as the run would
                    algo.costs[table.collective](table.ranks, 1, 4, **options)
                    checked.add(priced)
            except UsageError as exc:
                raise UsageError(f"{where}: the rule at {rule.nbytes} B "
                                 f"({rule.algorithm}): {exc}") from None
    return Tuning(tuple(tables), path)


def tuning_path() -> str:
    """Return the tuning file this process's environment names ('' for none)."""
    return os.environ.get(TUNING_ENV, "").strip()


def _text(path: str) -> str:
    """Return a tuning file's text: a regular file of at most :data:`MAX_JSON_BYTES`, UTF-8.

    Anything else (missing, a folder, a FIFO, ``/dev/zero``, too large) is a
    :class:`UsageError` of one line naming the file.
    """
    return read_text(path, max_bytes=MAX_JSON_BYTES, what=f"tuning file ({TUNING_ENV})")


def read(path: str) -> Tuning:
    """Read and check a tuning file; an unreadable or malformed one is a :class:`UsageError`."""
    return parse(_text(path), path)


def agreed_tuning(t, path: str) -> Tuning | None:
    """Return the tuning at ``path`` (None for an empty path), the same on every rank of ``t``.

    Rank 0 reads the file and sends its text, or why it could not, to the others
    (collective: two broadcasts, the length and the bytes), so every rank parses
    the same bytes and raises the same error.
    """
    if not path:
        return None
    if t.rank == 0:
        try:
            payload = json.dumps({"text": _text(path)})
        except UsageError as exc:
            payload = json.dumps({"error": str(exc)})
        data = np.frombuffer(payload.encode(), dtype=np.uint8).copy()
        length = np.array([data.size], dtype=np.int64)
    else:
        length = np.zeros(1, dtype=np.int64)
    naive_broadcast(t, length, root=0)
    if t.rank != 0:
        data = np.zeros(int(length[0]), dtype=np.uint8)
    naive_broadcast(t, data, root=0)
    sent = json.loads(data.tobytes())
    if "error" in sent:
        raise UsageError(f"rank {t.rank}: {sent['error']}")
    return parse(sent["text"], path)


def read_report(path: str) -> dict:
    """Read a ``refcoll bench --json`` report for :func:`from_bench` (a regular JSON file).

    Raises:
        UsageError: the file is not a regular file of at most :data:`MAX_JSON_BYTES`,
            or not JSON within :func:`refcoll.core.reading.loads_json`'s bounds.
    """
    data = read_bytes(path, max_bytes=MAX_JSON_BYTES, what="bench report")
    return loads_json(data, source=f"{path} (a refcoll bench --json report)")


def _report(name: str, report) -> tuple[str, list[str], list[dict]]:
    """Return a bench report's ``(collective, hosts of the data ranks, rows)``, every field checked.

    A row is kept for :func:`from_bench` only as what it claims to be: an object with an
    algorithm (a string), a size (a whole number of 0 to :data:`MOST_BYTES` bytes: bench
    writes rows of 0 B, as nccl-tests does, where a size holds no element a rank) and,
    where it was timed, a finite time not below 0; else one line names the row.
    """
    where = f"{name} (a refcoll bench --json report)"
    report = _fields(where, report, "the report")
    missing = [key for key in ("header", "rows") if key not in report]
    if missing:
        raise UsageError(f"{where}: it lacks {' and '.join(missing)}")
    header = _fields(f"{where}: header", report["header"], "the header")
    for key in ("collective", "ranks", "workers"):
        if key not in header:
            raise UsageError(f"{where}: the header lacks {key}")
    collective = _string(f"{where}: header.collective", header["collective"])
    ranks = _list(f"{where}: header.ranks", header["ranks"], "ranks")
    if not ranks:
        raise UsageError(f"{where}: header.ranks is empty; a report names every rank")
    workers = number(header["workers"], where=f"{where}: header.workers", integer=True,
                     least=1, most=min(len(ranks), MOST_RANKS))
    hosts = []
    for i, rank in enumerate(ranks[:workers]):
        rank = _fields(f"{where}: header.ranks[{i}]", rank, "a rank")
        hosts.append(_string(f"{where}: header.ranks[{i}].host", rank.get("host")))
    rows = []
    for i, row in enumerate(_list(f"{where}: rows", report["rows"], "rows")):
        at = f"{where}: rows[{i}]"
        row = _fields(at, row, "a row")
        for key in ("algorithm", "size"):
            if key not in row:
                raise UsageError(f"{at}: the row lacks {key}")
        _string(f"{at}.algorithm", row["algorithm"])
        number(row["size"], where=f"{at}.size", integer=True, least=0, most=MOST_BYTES)
        if row.get("time_us") is not None:
            number(row["time_us"], where=f"{at}.time_us", least=0)
        rows.append(row)
    return collective, hosts, rows


def from_bench(reports: list[tuple[str, dict]]) -> dict:
    """Return a tuning file's document from ``refcoll bench --json`` reports ``(name, report)``.

    For each report, at each size, the algorithm with the least out-of-place time
    among those it ran that ``auto`` may run (not ``auto`` itself, none that needs
    processes beyond the data ranks), every check passed: a row never checked
    (``bench -c 0``) is left out, and an algorithm with a row wrong at a size, out of
    place or in place, in any dtype, op or root, is left out at that size (a rule
    holds for every dtype). Rows of 0 B time nothing and are left out. Reports of the same
    collective and layout make one table (two sweeps of sizes); where both
    measured a size, the later report's rule stands, among the algorithms no report of
    the table found wrong at that size. A report whose fields are not what bench writes
    (:func:`_report`) is a :class:`UsageError` naming the first.
    """
    tables: dict = {}
    for order, (name, report) in enumerate(reports):
        collective, hosts, rows = _report(name, report)
        header = report["header"]
        counts = {h: hosts.count(h) for h in hosts}
        best: dict[int, tuple[float, str]] = {}
        failed = unchecked = 0
        timed, wrong = [], set()  # (size, time, algorithm); (size, algorithm) found wrong
        for row in rows:
            if not row.get("time_us") or not row["size"]:
                continue
            if row.get("wrong") is None:  # bench -c 0: timed, never judged
                unchecked += 1
                continue
            failing = bool(row["wrong"] or row.get("inplace_wrong"))  # out of place or in place
            failed += failing
            try:
                algo, options = check_spelled(row["algorithm"], collective)
            except UsageError:
                continue  # auto, or a name this version does not know
            if algorithms.get(algo).workers is not None or not algorithms.get(algo).pinnable:
                continue
            if failing:
                wrong.add((row["size"], spell(algo, options)))
            else:
                timed.append((row["size"], row["time_us"], spell(algo, options)))
        for size, time_us, spelled in timed:
            found = best.get(size)
            if (size, spelled) not in wrong and (found is None or time_us < found[0]):
                best[size] = (time_us, spelled)
        if not best:
            never = ("a compressed run, which bench does not judge" if header.get("compressor")
                     else "bench -c 0")
            why = [f"{failed} failed a check" if failed else "",
                   f"{unchecked} were not checked ({never})" if unchecked else ""]
            why = "; ".join(w for w in why if w) or "bench one or more by name, not only auto"
            raise UsageError(f"{name} holds no row auto may take: a timed algorithm auto may "
                             f"run whose every check passed ({why})")
        key = (collective, len(hosts), len(counts), max(counts.values()))
        dtype = header.get("dtype", "")
        entry = tables.setdefault(key, {"collective": collective, "ranks": len(hosts),
                                        "nodes": len(counts), "per_node": max(counts.values()),
                                        "dtype": dtype if isinstance(dtype, str) else "",
                                        "from": [], "timed": [], "wrong": set()})
        entry["from"].append(os.path.basename(name))
        entry["timed"] += [(size, order, t, algo) for size, t, algo in timed]
        entry["wrong"] |= wrong
    out = []
    for entry in tables.values():
        rules = _rules(entry)
        if not rules:
            raise UsageError(f"{', '.join(entry['from'])}: at every size they timed, each "
                             "algorithm auto may run was found wrong in one of them: no rule is "
                             f"left for {entry['collective']} on {entry['ranks']} ranks")
        out.append({key: value for key, value in entry.items() if key not in ("timed", "wrong")}
                   | {"from": ", ".join(entry["from"]), "rules": rules})
    return {"version": 1, "source": "refcoll tune", "tables": out}


def _rules(entry: dict) -> list:
    """Return a table's rules: at each size, the fastest algorithm of the latest report that
    timed one there that no report of the table found wrong there."""
    best: dict = {}
    for size, order, time_us, algo in entry["timed"]:
        if (size, algo) in entry["wrong"]:
            continue
        found = best.get(size)
        if found is None or (-order, time_us) < (-found[0], found[1]):
            best[size] = (order, time_us, algo)
    return [{"bytes": size, "algorithm": best[size][2], "time_us": round(best[size][1], 3)}
            for size in sorted(best)]
