"""``refcoll list``: the algorithms with their costs, auto's calibration and table, ops, dtypes.

auto's table gives, for each collective auto chooses among several algorithms
for and each p of :data:`~refcoll.calls.auto.TABLE_PS`, the algorithm it picks
for the smallest message and every size at which its pick changes
(:func:`~refcoll.calls.auto.auto_table`), priced with the calibration a quiet
job on this host would use and ``REFCOLL_ALGO`` as set: NCCL prints its tuning
table (``NCCL_DEBUG_SUBSYS=TUNING``) the same way, per algorithm and size.
"""

from __future__ import annotations

import math

import click

from .. import algorithms
from ..calls.auto import (
    TABLE_LARGEST,
    TABLE_PS,
    algo_filter,
    auto_table,
    cache_path,
    cached_calibrations,
    calibration_mode,
    candidates,
    choice_table,
    current_calibration,
)
from ..calls.tuned import TUNING_ENV, Table, tuning_path
from ..calls.tuned import read as read_tuning
from ..core.ops import DTYPES, OPS, supports
from ..core.units import human_bytes
from ..transport import cuda_aware
from .calibrate import as_json, describe
from .common import check_output_paths, main, reports_errors, write_json

__all__ = ["list_", "table_lines", "SEPARATOR"]

#: What separates the table's columns.
SEPARATOR = " | "

#: The element type the table is for (its bytes are the first size).
_TABLE_DTYPE = "float32"


def _tuned_json(table: Table) -> dict:
    """Return one tuning table as ``list --json`` writes it: its layout, rules and reach."""
    low, high = table.reach()
    return {"collective": table.collective, "ranks": table.ranks, "nodes": table.nodes,
            "per_node": table.per_node,
            "rules": [{"bytes": r.nbytes, "algorithm": r.algorithm} for r in table.rules],
            "reach_bytes": [max(1, math.ceil(low)), int(high)]}


@main.command("list")
@click.option("--json", "json_file", type=click.Path(dir_okay=False),
              help="Write the listing as JSON.")
@reports_errors
def list_(json_file):
    """List algorithms, collectives, ops and dtypes, with each algorithm's cost.

    Then the calibration auto prices with on this host and auto's table: for
    p = 2 to 64, the algorithm it picks for the smallest message and each
    size at which its pick changes. Ends with the GPU, if any, and how device
    buffers would travel (directly through a CUDA-aware MPI, or staged
    through host memory) and why.
    """
    check_output_paths(json=json_file)
    tuning = read_tuning(tuning_path()) if tuning_path() else None  # refused before any output
    mode, allowed = calibration_mode(), algo_filter()  # (REFCOLL_CALIBRATION, _ALGO: too)
    payload = {"algorithms": [], "ops": list(OPS), "dtypes": {}}
    click.echo("algorithms:")
    for algo in algorithms.REGISTRY.values():
        costs = {c: _cost_text(algo, c) for c in algo.collectives}
        payload["algorithms"].append({"name": algo.name, "summary": algo.summary,
                                      "collectives": list(algo.collectives), "cost": costs,
                                      "spec": algo.spec})
        click.echo(f"  {algo.name:<19} {algo.summary}")
        for coll in algo.collectives:
            click.echo(f"      {coll:<16} {costs[coll]}")
    calibration = current_calibration()
    cached = cached_calibrations()
    itemsize = DTYPES[_TABLE_DTYPE].itemsize
    table = auto_table(calibration, ps=TABLE_PS, itemsize=itemsize, allowed=allowed,
                       largest=TABLE_LARGEST)
    payload["auto"] = {"calibration": as_json(calibration), "mode": mode,
                       "refcoll_algo": allowed.text or None, "cache": str(cache_path()),
                       "cached": [as_json(c) for c in cached],
                       "allreduce_float32": choice_table(calibration),
                       "table": {"dtype": _TABLE_DTYPE, "itemsize": itemsize,
                                 "ps": list(TABLE_PS), "largest_bytes": TABLE_LARGEST,
                                 "collectives": table}}
    payload["auto"]["tuning"] = None if tuning is None else {
        "file": tuning.path, "tables": [_tuned_json(t) for t in tuning.tables]}
    cached_here = "from the cache" if calibration.key else "nothing cached: the defaults"
    steering = [f"REFCOLL_CALIBRATION={mode}" if mode != "cache" else cached_here,
                f"REFCOLL_ALGO={allowed.text}" if allowed.text else ""]
    click.echo(f"auto's calibration in force ({'; '.join(filter(None, steering))}):")
    click.echo(f"  {describe(calibration)}")
    click.echo(f"  key:    {calibration.key or '(fixed defaults: no measurement)'}")
    click.echo(f"  source: {calibration.source}")
    if len(cached) > (1 if calibration.key else 0):
        click.echo(f"  also cached in {cache_path()} (a job uses the entry of its own key):")
        for other in cached:
            if other.key != calibration.key:
                click.echo(f"    {other.key}: {describe(other)}")
    origin = calibration.key or "fixed defaults"
    click.echo(f"auto's table, {_TABLE_DTYPE}, p = {TABLE_PS[0]}…{TABLE_PS[-1]}, with that "
               f"calibration ({origin}"
               + (f"; REFCOLL_ALGO={allowed.text}" if allowed.text else "") + "):")
    click.echo(f"  the algorithm for one element ({itemsize} B), then each algorithm auto "
               f"switches to and the size of each rank's input from which it does (scanned "
               f"to {human_bytes(TABLE_LARGEST, 'g', binary=True)})")
    for collective, rows in table.items():
        click.echo(f"  {collective}")
        for text in table_lines(rows):
            click.echo("    " + text)
    single = [c for c in algorithms.COLLECTIVES if c not in table and allowed.allowed(c)]
    if single:
        click.echo("  " + "; ".join(f"{c}: always {allowed.allowed(c)[0]}" for c in single))
    if tuning is not None:
        click.echo(f"  {TUNING_ENV}={tuning.path}: where one of its tables applies, auto runs "
                   "the rule measured fastest instead of the table above:")
        for t in tuning.tables:
            row = _tuned_json(t)
            click.echo(f"    {t.collective} on {t.ranks} ranks ({t.nodes} nodes x {t.per_node}): "
                       f"{len(t.rules)} rules, for calls of {row['reach_bytes'][0]} to "
                       f"{row['reach_bytes'][1]} B (bench's size: the whole array)")
    click.echo("ops:    " + ", ".join(OPS))
    click.echo("dtypes:")
    for name, dt in DTYPES.items():
        ok = [op for op in OPS if supports(op, dt)]
        payload["dtypes"][name] = ok
        click.echo(f"  {name:<14} {', '.join(ok)}")
    payload["gpu"] = info = cuda_aware.device_path()
    click.echo(f"gpu: {info['gpu'] or 'none (' + str(info['gpu_reason']) + ')'}")
    click.echo(f"device buffers: {info['path']} ({info['why']})")
    write_json(json_file, payload)


def table_lines(rows: list[dict]) -> list[str]:
    """Return one collective's rows of auto's table as lines whose columns line up.

    ``rows``: :func:`~refcoll.calls.auto.auto_table`'s rows for one
    collective. Columns: ``p``; the algorithm from the smallest size; then
    each change, ``algorithm ≥ size``. Every column is as wide as its widest
    cell, and a row with fewer changes has empty cells, so the separators
    stand at the same offsets on every line.
    """
    changes = max((len(row["changes"]) for row in rows), default=1)
    first = rows[0]["changes"][0]["bytes"] if rows and rows[0]["changes"] else 0
    header = ["p", f"from {human_bytes(first, 'g', binary=True)}"] + ["then"] * (changes - 1)
    body = []
    for row in rows:
        cells = [str(row["p"]), row["changes"][0]["algorithm"]]
        cells += [f"{c['algorithm']} ≥ {human_bytes(c['bytes'], '.3g', binary=True)}"
                  for c in row["changes"][1:]]
        body.append(cells + [""] * (changes + 1 - len(cells)))
    widths = [max(len(cells[i]) for cells in [header, *body]) for i in range(changes + 1)]

    def render(cells: list[str]) -> str:
        padded = [cells[0].rjust(widths[0])] + [c.ljust(w) for c, w in zip(cells[1:], widths[1:])]
        return SEPARATOR.join(padded).rstrip()

    return [render(header)] + [render(cells) for cells in body]


def _cost_text(algo, collective: str) -> str:
    """Return the cost ``refcoll list`` shows for ``algo``'s ``collective``."""
    if algo.chooses:  # auto: its cost is the cheapest candidate's, per call
        return "the least modelled time among " + ", ".join(candidates(collective))
    if collective in algo.costs:
        return algo.costs[collective](8, 1 << 18, 4).formula
    return ""
