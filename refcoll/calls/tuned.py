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

__all__ = ["TUNING_ENV", "REACH", "Rule", "Table", "Tuning", "read", "parse", "from_bench",
           "agreed_tuning", "tuning_path"]

#: The environment variable that names the tuning file.
TUNING_ENV = "REFCOLL_TUNING_FILE"

#: How far beyond the sizes it measured a table reaches: a factor of 2 each way.
REACH = 2.0


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

    def rule(self, nbytes: int) -> Rule | None:
        """Return the rule nearest ``nbytes`` on a log scale (the smaller on a tie), or None
        beyond :data:`REACH` of the sizes measured."""
        low, high = self.rules[0].nbytes, self.rules[-1].nbytes
        if nbytes < low / REACH or nbytes > high * REACH:
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


def parse(text: str, path: str = "") -> Tuning:
    """Return the tuning a file's text holds; :class:`UsageError` names what is wrong in it."""
    where = f"the tuning file {path} ({TUNING_ENV})"
    try:
        data = json.loads(text)
        tables = []
        for entry in data["tables"]:
            rules = tuple(sorted((Rule(int(r["bytes"]), str(r["algorithm"]),
                                       float(r.get("time_us") or 0.0)) for r in entry["rules"]),
                                 key=lambda r: r.nbytes))
            tables.append(Table(str(entry["collective"]), int(entry["ranks"]),
                                int(entry.get("nodes", 1)),
                                int(entry.get("per_node", entry["ranks"])), rules,
                                str(entry.get("dtype", "")), str(entry.get("from", ""))))
    except (ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"{where} is not a refcoll tuning file: {type(exc).__name__}: {exc}; "
                         "write it with refcoll tune") from None
    for table in tables:
        if not table.rules or any(r.nbytes < 1 for r in table.rules):
            raise UsageError(f"{where}: a table of {table.collective} on {table.ranks} ranks "
                             "has no rule, or a rule of no bytes")
        for rule in table.rules:
            try:
                name, _ = check_spelled(rule.algorithm, table.collective)
            except UsageError as exc:
                raise UsageError(f"{where}: the rule at {rule.nbytes} B: {exc}") from None
            if algorithms.get(name).workers is not None or not algorithms.get(name).pinnable:
                raise UsageError(f"{where}: the rule at {rule.nbytes} B names {name}, which "
                                 "auto cannot run (it needs processes beyond the data ranks, "
                                 "or it is auto)")
    return Tuning(tuple(tables), path)


def tuning_path() -> str:
    """Return the tuning file this process's environment names ('' for none)."""
    return os.environ.get(TUNING_ENV, "").strip()


def _text(path: str) -> str:
    """Return a tuning file's text; one that cannot be read is a :class:`UsageError`."""
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError as exc:
        raise UsageError(f"cannot read the tuning file {path} ({TUNING_ENV}): "
                         f"{exc.strerror or exc}") from None


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


def from_bench(reports: list[tuple[str, dict]]) -> dict:
    """Return a tuning file's document from ``refcoll bench --json`` reports ``(name, report)``.

    For each report, at each size, the algorithm with the least out-of-place time
    among those it ran that ``auto`` may run (not ``auto`` itself, none that needs
    processes beyond the data ranks), every check passed. Reports of the same
    collective and layout make one table (two sweeps of sizes); where both
    measured a size, the later report's rule stands.
    """
    tables: dict = {}
    for name, report in reports:
        try:
            header, rows = report["header"], report["rows"]
            hosts = [rank["host"] for rank in header["ranks"]][:header["workers"]]
            collective = header["collective"]
        except (KeyError, TypeError) as exc:
            raise UsageError(f"{name} is not a refcoll bench --json report: {exc}") from None
        counts = {h: hosts.count(h) for h in hosts}
        best: dict[int, tuple[float, str]] = {}
        for row in rows:
            if row.get("wrong") or not row.get("time_us"):
                continue
            try:
                algo, options = check_spelled(row["algorithm"], collective)
            except UsageError:
                continue  # auto, or a name this version does not know
            if algorithms.get(algo).workers is not None or not algorithms.get(algo).pinnable:
                continue
            found = best.get(row["size"])
            if found is None or row["time_us"] < found[0]:
                best[row["size"]] = (row["time_us"], spell(algo, options))
        if not best:
            raise UsageError(f"{name} holds no timed algorithm that auto may run (bench one or "
                             "more by name, not only auto)")
        key = (collective, len(hosts), len(counts), max(counts.values()))
        entry = tables.setdefault(key, {"collective": collective, "ranks": len(hosts),
                                        "nodes": len(counts), "per_node": max(counts.values()),
                                        "dtype": header.get("dtype", ""), "from": [],
                                        "rules": {}})
        entry["from"].append(os.path.basename(name))
        entry["rules"].update({size: {"bytes": size, "algorithm": algo, "time_us": round(t, 3)}
                               for size, (t, algo) in best.items()})
    return {"version": 1, "source": "refcoll tune",
            "tables": [{**entry, "from": ", ".join(entry["from"]),
                        "rules": [entry["rules"][size] for size in sorted(entry["rules"])]}
                       for entry in tables.values()]}
