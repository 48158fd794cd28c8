"""The cluster model against published nccl-tests ``all_reduce_perf`` tables.

Run: python benchmarks/model_vs_nccl_tests.py [--data benchmarks/data/nccl_tests]
     [--json FILE] [--plot FILE]

Each table in ``--data`` is ``<id>.txt`` (the output as published) beside
``<id>.json`` (its source: address, commit or date, and the system as the
source describes it). For each table, the error per size band
(``exp(mean |ln(predicted / measured)|) - 1``, sizes <= 64 KiB, between, >= 64
MiB) of:

* **described**: ``refcoll model --sweep`` from the system's description alone;
* **fitted, odd sizes**: ``--fit`` on the table's even powers of two, judged on
  its odd ones;
* **fitted, other node count**: ``--fit`` on another table of the same system
  (same source, another node count), judged on this one.

The measured time of a size is the faster of the table's out-of-place and
in-place columns (:attr:`refcoll.model.nccl_tests.Row.measured`): both time the
same all-reduce, and noise only adds time. Then the same pooled over every
table. Nothing here is tuned: the description
is what the source says, and the model's constants are NCCL's and the
standards' (:mod:`refcoll.model.systems`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from dataclasses import replace

from refcoll.core.plot import figure, save
from refcoll.model.nccl_fit import fit
from refcoll.model.nccl_tests import BANDS, Table, band_errors, compare, read_table
from refcoll.model.systems import System

HERE = os.path.dirname(os.path.abspath(__file__))
BAND_NAMES = [name for name, _, _ in BANDS]


def describe(meta: dict) -> System | None:
    """Return the System a table's sidecar describes, or None when it says too little."""
    s = meta.get("system") or {}
    arch = (s.get("gpu_arch") or "").lower()
    generation = {"ada": "ampere", "turing": "volta"}.get(arch, arch)
    if generation not in ("volta", "ampere", "hopper", "blackwell"):
        return None
    intra = (s.get("intra") or "nvswitch").lower()
    nodes, g = int(s.get("nodes") or 1), int(s.get("gpus_per_node") or 8)
    fields = dict(nodes=nodes, gpus_per_node=g, generation=generation, intra=intra)
    if intra == "pcie":
        fields.update(pcie_gen=int(s.get("pcie_gen") or 4), p2p=bool(s.get("p2p")))
        if arch in ("ada", "turing"):  # a consumer GPU's link: its PCIe, not an SXM NVLink
            fields["generation"] = "ampere"
    elif s.get("nvlink_gbps_bidirectional_per_gpu"):
        fields["intra_bw"] = float(s["nvlink_gbps_bidirectional_per_gpu"]) * 1e9 / 2
    if s.get("nvls") is False:
        fields["nvls"] = False
    if nodes > 1:
        transport = (s.get("inter_transport") or "ib").lower()
        if not s.get("nics_per_node") or not s.get("nic_gbit"):
            return None
        fields.update(nics=int(s["nics_per_node"]), nic_bw=float(s["nic_gbit"]) * 1e9 / 8,
                      transport=transport, collnet=bool(s.get("sharp")))
    return System(**fields)


def told(meta: dict) -> str | None:
    """Return what NCCL was told to run (``NCCL_ALGO``/``NCCL_PROTO`` in the source), or None."""
    text = " ".join(str(meta.get(k) or "") for k in ("env", "command"))
    algo = re.search(r"NCCL_ALGO=([A-Za-z]+)", text)
    proto = re.search(r"NCCL_PROTO=([A-Za-z0-9]+)", text)
    if algo is None:
        return None
    return algo.group(1) + ("/" + proto.group(1) if proto else "")


def load(folder: str) -> list[tuple[str, Table, dict, System]]:
    out = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".json"):
            continue
        ident = name[:-5]
        txt = os.path.join(folder, ident + ".txt")
        if not os.path.exists(txt):
            continue
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            meta = json.load(f)
        system = describe(meta)
        if system is None:
            print(f"# {ident}: its description is too thin to price; skipped", file=sys.stderr)
            continue
        table = read_table(txt)
        ranks = table.ranks
        if ranks and ranks != system.ranks:
            print(f"# {ident}: the table has {ranks} ranks, its description "
                  f"{system.ranks}; the table's count is used", file=sys.stderr)
            system = system.with_shape(max(1, ranks // system.gpus_per_node),
                                       min(system.gpus_per_node, ranks))
        out.append((ident, table, meta, system))
    return out


def _odd_even(table: Table) -> tuple[Table, Table]:
    even = tuple(r for r in table.rows if r.size.bit_length() % 2 == 1)  # 4^k sizes: 1, 4, 16..
    odd = tuple(r for r in table.rows if r.size.bit_length() % 2 == 0)
    return replace(table, rows=even), replace(table, rows=odd)


def _cell(value) -> str:
    return "   -" if value is None or math.isnan(value) else f"{100 * value:4.0f}%"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=os.path.join(HERE, "data", "nccl_tests"))
    ap.add_argument("--json", help="write every table's errors here")
    ap.add_argument("--plot", help="draw every table's measured and predicted busbw in this "
                                   "file, a panel each")
    args = ap.parse_args()
    tables = load(args.data)
    report, panels = [], []
    pooled = {"described": [], "fitted odd": [], "other nodes": []}
    print(f"{'table':<44} {'variant':<12} " + " ".join(f"{b:>16}" for b in BAND_NAMES)
          + f" {'within 30%':>11}")
    for ident, table, meta, system in tables:
        algorithm = told(meta)
        described = compare(table, system, algorithm)
        even, odd = _odd_even(table)
        fitted = replace(system, fitted=fit(system, [even], algorithm))
        odd_cmp = compare(odd, fitted, algorithm)
        rows = {"described": described, "fitted odd": odd_cmp}
        sibling = _sibling(ident, meta, system, tables)
        if sibling is not None:
            other_table, other_meta, other_system = sibling
            rows["other nodes"] = compare(table, replace(system, fitted=fit(
                other_system, [other_table], told(other_meta))), algorithm)
        for variant, c in rows.items():
            print(f"{ident[:44]:<44} {variant:<12} " + " ".join(
                f"{_cell(c.errors[b][0]):>16}" for b in BAND_NAMES)
                + f" {c.within:>4} of {len(c.rows):<4}")
            pooled[variant] += [(r["size"], r["predicted_us"], r["measured_us"])
                                for r in c.rows]
        report.append({"id": ident, "source": meta.get("source"),
                       "commit_or_date": meta.get("commit_or_date"),
                       "system": system.describe(),
                       "unknown": system.unknowns(),
                       **{v: c.to_json() for v, c in rows.items()}})
        panels.append((ident, described, odd_cmp))
    print()
    print()
    print("told: what NCCL was told to run where the source says (NCCL_ALGO), else its pick")
    for variant, pairs in pooled.items():
        errors = band_errors(pairs)
        print(f"{'pooled (' + str(len(tables)) + ' tables)':<44} {variant:<12} " + " ".join(
            f"{_cell(errors[b][0]):>16}" for b in BAND_NAMES)
            + f" {sum(1 for _, p, m in pairs if abs(p / m - 1) <= 0.3):>4} of {len(pairs):<4}")
    if args.plot:
        _plot(args.plot, panels)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)


def _sibling(ident, meta, system, tables):
    """Return (table, system) of the same source's system at another node count, or None."""
    for other, table, m, s in tables:
        if (other != ident and m.get("who") == meta.get("who") and s.nodes != system.nodes
                and s.nodes > 1 and system.nodes > 1
                and s.generation == system.generation and s.transport == system.transport
                and s.gpus_per_node == system.gpus_per_node and s.nics == system.nics):
            return table, m, s
    return None


def _plot(path: str, panels: list) -> None:
    """Draw every table's measured and predicted busbw, one panel each, in one figure."""
    cols = 5
    rows = -(-len(panels) // cols)
    fig = figure(figsize=(3.2 * cols, 2.4 * rows))
    for i, (ident, described, fitted) in enumerate(panels):
        ax = fig.add_subplot(rows, cols, i + 1)
        sizes = [r["size"] for r in described.rows]
        ax.plot(sizes, [r["measured_busbw"] for r in described.rows], "o-", ms=2, lw=1,
                label="measured")
        ax.plot(sizes, [r["predicted_busbw"] for r in described.rows], "--", lw=1,
                label="described")
        ax.plot([r["size"] for r in fitted.rows], [r["predicted_busbw"] for r in fitted.rows],
                "^:", ms=2, lw=1, label="fit (even sizes)")
        ax.set_xscale("log", base=2)
        ax.set_title(ident, fontsize=6)
        ax.tick_params(labelsize=5)
        if i == 0:
            ax.legend(fontsize=5)
            ax.set_ylabel("busbw (GB/s)", fontsize=6)
    fig.tight_layout()
    save(fig, path, dpi=80)


if __name__ == "__main__":
    main()
