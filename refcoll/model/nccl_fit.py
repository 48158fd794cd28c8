"""Learn a cluster's unknown constants from its own ``all_reduce_perf`` tables.

What no public source gives about a system (:meth:`System.unknowns`: a cloud
network's latency and achieved fraction of line rate, a host path's bandwidth)
is learnt from measurements of it, as NCCL's own tuner plugins learn from
measured curves. The fitted constants:

* ``intra_rate``: what one GPU's intra-node link carries per direction;
* ``intra_latency``: each intra-node step's latency beyond NCCL's;
* ``nic_efficiency``: the fraction of the NICs' line rate achieved (tables of
  more than one node);
* ``net_latency``: each network step's latency beyond NCCL's (likewise).

They minimise the squared ``ln(predicted / measured)`` over every row of every
table given (each table's own node count), by coordinate descent in the
logarithm of each constant: golden-section search on one at a time, a few
rounds, each bracketed by physical limits (a link carries at most its line
rate). The loss is not unimodal (NCCL's pick jumps as a constant moves), so a
search can end worse than it began: then the description's constants stand.
The model's form (NCCL's algorithm choice, its per-hop constants) is not
fitted, so a fit made on one node count predicts another, and refcoll's own
algorithms, from the same constants.

A constant that no row depends on (a bandwidth, where every size is too small
for bandwidth to count; a latency, where every size is large) cannot be learnt
from the tables: it keeps its described value, and :func:`fit` names it in
``unlearnt``. Rows of one size are taken once (the faster: a stall only ever
adds time), and at most :data:`MAX_FIT_SIZES` sizes are fitted.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..core.errors import UsageError
from ..core.reading import loads_json, read_text
from ..core.units import MAX_BANDWIDTH, MAX_DURATION, MIN_BANDWIDTH
from .nccl_run import NCCL_ALGORITHMS, predict
from .nccl_tests import Table, band_errors, check_ranks, each_size_once
from .systems import System

__all__ = ["FITTED", "fit", "fit_algorithm", "fit_unlearnt", "fit_to_json", "read_fit",
           "MAX_FIT_BYTES", "MAX_FIT_SIZES", "unlearnt", "too_few_sizes", "on_bounds", "Fitted"]

#: The constants a fit may learn, and the bounds of each (the first two in the unit of the
#: constant: bytes/s, seconds, a fraction).
FITTED = {
    "intra_rate": (1e8, 5e12),
    "intra_latency": (0.0, 1e-3),
    "nic_efficiency": (0.02, 1.0),
    "net_latency": (0.0, 5e-3),
}

#: A fit file larger than this is refused.
MAX_FIT_BYTES = 1 << 20

#: The most sizes (over every table) one fit takes: each costs about 0.1 s of search.
MAX_FIT_SIZES = 512

#: A constant is learnt only where moving it (a rate halved, a latency raised by 10 us)
#: moves some row's prediction by at least this fraction.
_SENSITIVE = 0.01

_ROUNDS, _GOLDEN_STEPS = 4, 40


def _shaped(system: System, tables: list[Table]) -> list[tuple[Table, System]]:
    """Return each table beside ``system`` at its rank count (its ``# Rank`` lines, else
    ``system``'s), refusing a count that is not whole nodes, and a table that does not
    say its count among several; each size once."""
    shaped = []
    unsaid = [t.name for t in tables if t.ranks is None]
    if unsaid and len(tables) > 1:
        raise UsageError(f"{', '.join(unsaid)}: no '# Rank' lines say how many ranks ran; "
                         "fitted together, each table must say its own (fit it alone, with "
                         "--nodes and --gpus-per-node)")
    for t in tables:
        ranks = t.ranks or system.ranks
        if ranks % system.gpus_per_node:
            raise UsageError(f"{t.name}: {ranks} ranks are not whole nodes of "
                             f"{system.gpus_per_node} GPUs (--gpus-per-node)")
        check_ranks(t, ranks)
        rows = each_size_once(t.rows)
        shaped.append((replace(t, rows=rows), system.with_shape(ranks // system.gpus_per_node)))
    sizes = sum(len(t.rows) for t, _ in shaped)
    if sizes > MAX_FIT_SIZES:
        raise UsageError(f"{', '.join(t.name for t in tables)}: {sizes} sizes to fit; give at "
                         f"most {MAX_FIT_SIZES} (nccl-tests' -b 8 -e 8G -f 2 is 31)")
    return shaped


def _predictions(tables, fitted: dict, algorithm: str | None) -> list[float]:
    """Return the predicted seconds of every row the model prices, in order."""
    return [p for _, p, _ in _priced(tables, fitted, algorithm)]


def on_bounds(system: System, fitted: dict, unlearnt_names=()) -> list[str]:
    """Return the learnt constants of ``fitted`` that ended on a bound of their search (a
    rate at its link's line rate, a latency at 0, an efficiency at 1): the tables may
    want a value past it, which the model's form cannot give, so say so."""
    out = []
    for name, value in fitted.items():
        if name in unlearnt_names or name not in FITTED:
            continue
        low, high = FITTED[name]
        if name == "intra_rate":
            high = min(high, system.intra_line())
        # a latency is searched itself (golden section ends within 1e-8 of its range of a
        # bound), a rate or fraction by its logarithm (within a factor 1 + 1e-3)
        near = 1e-6 * (high - low) if name.endswith("latency") else None
        if (value <= low + near or value >= high - near) if near is not None else \
                (value <= low * (1 + 1e-3) or value >= high * (1 - 1e-3)):
            out.append(name)
    return out


def unlearnt(tables, fitted: dict, algorithm: str | None) -> list[str]:
    """Return the constants of ``fitted`` on which no row's prediction depends."""
    here = _predictions(tables, fitted, algorithm)
    out = []
    for name, value in fitted.items():
        moved = value + 10e-6 if name.endswith("latency") else value / 2
        there = _predictions(tables, {**fitted, name: moved}, algorithm)
        if all(abs(b / a - 1) < _SENSITIVE for a, b in zip(here, there)):
            out.append(name)
    return out


def too_few_sizes(tables: list[tuple[Table, System]], names) -> list[str]:
    """Return the constants of ``names`` that the tables' sizes cannot tell apart: a level's
    rate (or efficiency) and its latency where that level's tables have a single size
    (one time is any split of the two)."""
    out = []
    for level, pair in (("single", ("intra_rate", "intra_latency")),
                        ("multi", ("nic_efficiency", "net_latency"))):
        sizes = {row.size for table, shaped in tables
                 if (shaped.nodes == 1) == (level == "single") for row in table.rows}
        if len(sizes) == 1:
            out += [name for name in pair if name in names]
    return out


def _priced(tables: list[tuple[Table, System]], fitted: dict,
            algorithm: str | None) -> list[tuple[int, float, float]]:
    """Return ``(size, predicted, measured)`` seconds of every row the model prices, in order,
    each table on its own shape with the constants ``fitted``."""
    out = []
    for table, shaped in tables:
        s = replace(shaped, fitted=dict(fitted))
        for r in table.rows:
            run = predict(s, r.size, algorithm, dtype=r.dtype, op=r.redop)
            if run is not None and r.measured > 0:
                out.append((r.size, run.seconds, r.measured))
    return out


def _loss(tables: list[tuple[Table, System]], fitted: dict, algorithm: str | None) -> float:
    return sum(math.log(p / m) ** 2 for _, p, m in _priced(tables, fitted, algorithm))


def _golden(f, low: float, high: float) -> float:
    """Return the argmin of ``f`` on ``[low, high]`` (unimodal assumed), golden section."""
    ratio = (math.sqrt(5) - 1) / 2
    a, b = low, high
    c, d = b - ratio * (b - a), a + ratio * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(_GOLDEN_STEPS):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - ratio * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + ratio * (b - a)
            fd = f(d)
    return (a + b) / 2


class Fitted(dict):
    """The constants :func:`fit` returns; ``described``: its search ended worse than the
    system's description, whose constants these are."""

    def __init__(self, constants: dict, *, described: bool = False):
        super().__init__(constants)
        self.described = described


def fit(system: System, tables: list[Table], algorithm: str | None = None) -> Fitted:
    """Return the fitted constants for ``system`` measured in ``tables``.

    ``algorithm``: what the tables ran when NCCL was told (``NCCL_ALGO``,
    ``Ring/Simple``...); None: NCCL's own pick. Each table is priced on
    ``system`` with its own rank count (the table's ``# Rank`` lines, or
    ``system``'s when it has none), so tables of several node counts
    of one system fit together. Network constants are fitted only when a table
    spans more than one node. Constants ``system`` was fitted with before
    (``--from-fit``) and not fitted again here are kept.
    """
    shaped = _shaped(system, tables)
    if not _predictions(shaped, {}, algorithm):
        raise UsageError(f"{', '.join(t.name for t in tables)}: no size can be priced "
                         f"{'as ' + algorithm if algorithm else ''} on "
                         f"{system.describe()}, so nothing can be fitted")
    # A node's own constants are learnt from single-node tables, the network's from the
    # others: a table of several nodes alone cannot tell a slow NVLink from a slow NIC.
    names = []
    if any(s.nodes == 1 for _, s in shaped):
        names += ["intra_rate", "intra_latency"]
    if any(s.nodes > 1 for _, s in shaped):
        names += ["nic_efficiency", "net_latency"]
    base = dict(system.fitted)  # an earlier fit's: kept where this one learns nothing
    fitted = dict(base)
    if "intra_rate" in names:
        fitted.update(intra_rate=system.intra_rate(), intra_latency=0.0)
    if "nic_efficiency" in names:
        fitted.update(nic_efficiency=system.net.efficiency, net_latency=system.net.latency)
    for name in names:  # what the fit file may hold (read_fit): the start, and every end
        low, high = FITTED[name]
        if not low <= fitted[name] <= high:
            raise UsageError(f"{system.describe()}: its {name.replace('_', ' ')} is "
                             f"{fitted[name]:.4g}, outside what a fit learns "
                             f"[{low:g}, {high:g}]: describe the hardware within it")
    start = dict(fitted)
    for _ in range(_ROUNDS):
        for name in names:
            low, high = FITTED[name]
            if name == "intra_rate":
                high = min(high, system.intra_line())  # no link carries more than its line
            if name.endswith("latency"):  # search the latency itself, from 0
                fitted[name] = _golden(lambda v, n=name: _loss(
                    shaped, {**fitted, n: v}, algorithm), low, high)
            else:  # rates and fractions: search their logarithm
                best = _golden(lambda v, n=name: _loss(
                    shaped, {**fitted, n: math.exp(v)}, algorithm),
                    math.log(low), math.log(high))
                fitted[name] = math.exp(best)
    described = {"intra_rate": system.intra_rate(), "intra_latency": 0.0,
                 "nic_efficiency": system.net.efficiency, "net_latency": system.net.latency}
    for name in unlearnt(shaped, fitted, algorithm) + too_few_sizes(shaped, names):
        fitted[name] = base.get(name, described[name])  # no row says what it is
    if _loss(shaped, fitted, algorithm) > _loss(shaped, start, algorithm):
        return Fitted(start, described=True)  # worse than it began: the description stands
    return Fitted(fitted)


def fit_to_json(system: System, fitted: dict, tables: list[Table],
                algorithm: str | None = None) -> dict:
    """Return what ``--fit`` writes: the system, the constants, and the fit's own errors."""
    shaped = _shaped(system, tables)
    errors = band_errors(_priced(shaped, fitted, algorithm))
    return {"refcoll_fit": 1,
            "unlearnt": (dull := sorted(set(unlearnt(shaped, fitted, algorithm))
                                        | set(too_few_sizes(shaped, fitted)))),
            "described": (kept := getattr(fitted, "described", False)),
            "on_bounds": [] if kept else on_bounds(system, fitted, dull),
            "system": {"gpus_per_node": system.gpus_per_node, "generation": system.generation,
                       "intra": system.intra, "intra_bw": system.intra_bw,
                       "pcie_gen": system.pcie_gen, "p2p": system.p2p, "nvls": system.nvls,
                       "nics": system.nics, "nic_bw": system.nic_bw,
                       "transport": system.transport, "collnet": system.collnet,
                       "channels": system.channels, "nodes": system.nodes,
                       "intra_alpha": system.intra_alpha, "inter_alpha": system.inter_alpha,
                       "spine_bw": system.spine_bw},
            "fitted": fitted,
            "logs": [t.name for t in tables], "algorithm": algorithm,
            "errors": {k: (None if math.isnan(e) else e) for k, (e, _) in errors.items()}}


#: The system fields a fit file must name: every one :func:`fit_to_json` writes, but the
#: latencies and the spine a file from before they were saved lacks (0 then, as they
#: were priced: no latency beyond NCCL's, no spine that binds).
_SAVED = frozenset({"gpus_per_node", "generation", "intra", "intra_bw", "pcie_gen", "p2p",
                    "nvls", "nics", "nic_bw", "transport", "collnet", "channels", "nodes"})


def _fit_file(path: str) -> dict:
    data = loads_json(read_text(path, max_bytes=MAX_FIT_BYTES, what="fit file (--from-fit)"),
                      source=f"fit file {path}")
    if not isinstance(data, dict) or data.get("refcoll_fit") != 1:
        raise UsageError(f"{path}: not a refcoll model --fit file")
    return data


def fit_algorithm(path: str) -> str | None:
    """Return the algorithm the tables of a ``--fit`` file ran (``--algorithm`` at the fit),
    or None: NCCL's own pick."""
    ran = _fit_file(path).get("algorithm")
    if ran is None or ran == "":
        return None
    name, _, proto = ran.partition("/") if isinstance(ran, str) else ("", "", "")
    if name.lower() not in {a.lower() for a in NCCL_ALGORITHMS} \
            or proto.lower() not in ("", "ll", "ll128", "simple"):
        shown = repr(ran) if len(repr(ran)) <= 40 else repr(ran)[:40] + "..."
        raise UsageError(f"{path}: its algorithm {shown} is not one of NCCL's "
                         f"({', '.join(NCCL_ALGORITHMS)}, optionally /LL, /LL128 or /Simple)")
    return ran


def fit_unlearnt(path: str) -> set[str]:
    """Return the constants a ``--fit`` file's tables said nothing of (their described
    values stand in its ``fitted``); none where the file does not say."""
    names = _fit_file(path).get("unlearnt")
    if not isinstance(names, list):
        return set()
    return {name for name in names if isinstance(name, str) and name in FITTED}


def read_fit(path: str) -> System:
    """Return the fitted system a ``--fit`` file describes (``--from-fit``)."""
    data = _fit_file(path)
    fields, fitted = data.get("system"), data.get("fitted")
    if not isinstance(fields, dict) or not isinstance(fitted, dict):
        raise UsageError(f"{path}: a fit file needs its system and fitted constants")
    clean = {}
    for name, value in fitted.items():
        if name not in FITTED or not isinstance(value, (int, float)) or isinstance(value, bool):
            raise UsageError(f"{path}: fitted constant {name!r} is not one of "
                             f"{', '.join(FITTED)} with a number")
        low, high = FITTED[name]
        if not low <= value <= high:
            raise UsageError(f"{path}: fitted {name} = {value} is outside [{low}, {high}]")
        clean[name] = float(value)
    allowed = set(System.__dataclass_fields__) - {"fitted"}
    if set(fields) - allowed:
        raise UsageError(f"{path}: unknown system fields {sorted(set(fields) - allowed)}")
    missing = sorted(_SAVED - set(fields))
    if missing:  # a default in their place would price other hardware without a word
        raise UsageError(f"{path}: the system lacks {', '.join(missing)}; a fit file names "
                         "every field of the hardware it was fitted on (refcoll model --fit "
                         "writes them)")
    for name, high in (("intra_bw", MAX_BANDWIDTH), ("nic_bw", MAX_BANDWIDTH),
                       ("spine_bw", MAX_BANDWIDTH), ("intra_alpha", MAX_DURATION),
                       ("inter_alpha", MAX_DURATION)):
        value = fields.get(name)  # the bounds the options have (beyond them, times of inf)
        if (isinstance(value, (int, float)) and not isinstance(value, bool)
                and (value > high or (name.endswith("bw") and 0 < value < MIN_BANDWIDTH))):
            low = MIN_BANDWIDTH if name.endswith("bw") else 0.0
            raise UsageError(f"{path}: system field {name} = {value!r} is outside "
                             f"[{low:g}, {high:g}]")
    try:
        system = System(**fields, fitted=clean)
    except TypeError as exc:
        raise UsageError(f"{path}: bad system fields ({exc})") from None
    except UsageError as exc:
        raise UsageError(f"{path}: {exc}") from None
    if clean.get("intra_rate", 0.0) > system.intra_line():
        raise UsageError(f"{path}: fitted intra_rate {clean['intra_rate']:g} B/s is more than "
                         f"the link's line rate, {system.intra_line():g} B/s")
    return system
