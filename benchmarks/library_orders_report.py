"""The report half of ``benchmarks/library_orders.py``: identify dumps, write the table.

``report`` runs :func:`refcoll.verify.identify.identify` on every rank-file dump
that ``library_orders.py run`` kept and writes ``spec/orders.md`` and
``refcoll/verify/known_orders.json``; ``record`` packs a dump's small runs into
the ``.npz`` files ``tests/test_library_orders.py`` reads. Run it through
``library_orders.py`` (its docstring has the commands).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
from pathlib import Path

import numpy as np

from refcoll.verify.identify import identify
from refcoll.verify.inputs import read_rank_files

REDUCING = ("allreduce", "reduce_scatter", "reduce")


def notes(stderr: str) -> list[str]:
    """Return what a run's stderr says about the variant (MPICH's fallback, an abort)."""
    said = []
    if "cannot be applied" in stderr or "not usable for the provided arguments" in stderr:
        said.append("MPICH fell back to its own choice (the forced algorithm does not apply)")
    lines = stderr.splitlines()
    for mark in ("Assertion failed", "MPI.Exception:", "Abort("):
        found = [ln for ln in lines if mark in ln]
        if found:
            said.append("failed: " + found[0].strip()[:160])
            break
    return said


def _version(directory: Path) -> str:
    """Return the library's name and version from a worker's first version line."""
    files = sorted(directory.glob("library-p*.txt"))
    text = files[0].read_text().strip() if files else ""
    m = re.match(r"MPICH Version:\s*(\S+)", text)
    if m:
        return f"MPICH {m.group(1)}"
    m = re.match(r"Open MPI v(\S+?),", text)
    if m:
        return f"Open MPI {m.group(1)}"
    return text or "unknown library"


def _combine(idents: list) -> dict:
    """Join one case's identifications over the input kinds: the orders matching all."""
    labels, diff, total, seen = [], {}, {}, {}
    for ident in idents:
        for c in ident.candidates:
            if c.label not in diff:
                labels.append(c.label)
                diff[c.label] = total[c.label] = seen[c.label] = 0
            diff[c.label] += c.differing
            total[c.label] += c.total
            seen[c.label] += 1
    matches = [lb for lb in labels if diff[lb] == 0 and seen[lb] == len(idents)]
    rest = [(diff[lb], lb) for lb in labels if lb not in matches]
    near = min(rest) if rest else None
    return {"matches": matches, "every": bool(labels) and len(matches) == len(labels),
            "tried": len(labels),
            "nearest": [near[1], near[0], total[near[1]]] if near else None}


def _identify_variant(directory: Path, record: dict) -> list[dict]:
    found = []
    library = _version(directory)
    for coll in record["collectives"]:
        for pdir in sorted((directory / coll).glob("p*")):
            p = int(pdir.name[1:])
            groups: dict = {}
            for case in sorted(pdir.iterdir()):
                kind, dtype, op = case.name.split("-")
                count = json.loads((case / "in" / "meta.json").read_text())["count"]
                ins = read_rank_files(case / "in", size=p)
                outs = (read_rank_files(case / "out", size=p) if (case / "out").is_dir()
                        else [None] * p)
                ident = identify(ins, outs, collective=coll, op=op, root=0, known=[])
                groups.setdefault((dtype, op), []).append((kind, ident, count))
            for (dtype, op), pairs in groups.items():
                single = len(record["collectives"]) == 1
                desc = record["description"] if single else f"{record['description']} {coll}"
                found.append({"library": library, "library_key": record["library_key"],
                              "variant": record["variant"], "description": desc,
                              "collective": coll, "p": p, "dtype": dtype, "op": op,
                              "kinds": [k for k, _, _ in pairs], "count": pairs[0][2],
                              "notes": record["runs"].get(str(p), {}).get("notes", []),
                              **_combine([i for _, i, _ in pairs])})
    return found


def _cell(entry: dict | None) -> str:
    if entry is None:
        return "not run"
    if entry["every"]:
        return ("equal to refcoll's (no reduction)" if entry["collective"] not in REDUCING
                else f"every order ({entry['tried']}): the inputs cannot tell")
    if entry["matches"]:
        # Plain names first; past four, the rest (equal bits here) only counted.
        shown = sorted(entry["matches"], key=lambda m: "(" in m)
        more = f" (+{len(shown) - 3} more with these bits)" if len(shown) > 4 else ""
        return ", ".join(f"`{m}`" for m in (shown[:3] if more else shown)) + more
    label, diff, total = entry["nearest"]
    return f"unmatched; nearest `{label}`: {diff} of {total} elements differ"


def _table(entries: list[dict], ps: list[int]) -> list[str]:
    rows: dict = {}
    for e in entries:
        rows.setdefault((e["variant"], e["collective"], e["dtype"], e["op"]), {})[e["p"]] = e
    lines = ["| variant | collective | dtype, op | " + " | ".join(f"p = {p}" for p in ps)
             + " | notes |", "|" + "---|" * (len(ps) + 4)]
    for (variant, coll, dtype, op), by_p in rows.items():
        notes = sorted({n for e in by_p.values() for n in e["notes"] if not n.startswith("exit")})
        lines.append(f"| `{variant}` | {coll} | {dtype}, {op} | "
                     + " | ".join(_cell(by_p.get(p)) for p in ps)
                     + f" | {'; '.join(notes)} |")
    return lines


def _failed(dump: Path, libraries: dict) -> list[str]:
    out = []
    for vfile in sorted(dump.glob("*/*/variant.json")):
        rec = json.loads(vfile.read_text())
        for p, r in rec["runs"].items():
            if r["rc"]:
                why = "; ".join(notes(r["stderr_tail"]) + [f"exit {r['rc']}"])
                out.append(f"- {libraries[rec['library_key']]['title']} `{rec['variant']}` "
                           f"p = {p}: {why}")
    return out


def report(args, libraries: dict) -> None:
    """Identify every dump under ``--dump``; write spec/orders.md and known_orders.json."""
    dump = Path(args.dump)
    entries = []
    records = [(json.loads(f.read_text()), f.parent) for f in dump.glob("*/*/variant.json")]
    records.sort(key=lambda rd: (list(libraries).index(rd[0]["library_key"]),
                                 rd[0].get("index", 0)))
    for record, directory in records:
        entries.extend(_identify_variant(directory, record))
    if not entries:
        raise SystemExit(f"{dump}: no runs found (run `library_orders.py run` first)")
    ps = sorted({e["p"] for e in entries})
    order = list(libraries)
    cmd = "python benchmarks/library_orders.py report"
    kinds = sorted({k for e in entries for k in e["kinds"]})
    counts = sorted({e["count"] for e in entries})
    lines = [f"*Generated by `{cmd}` (after its `run` commands): do not edit by hand.*", "",
             "# Which refcoll order each library's collectives use", "",
             "Each cell names the refcoll orders (`refcoll check --identify`'s labels) whose "
             "output equals the library's bit for bit on every rank and on every input kind "
             f"({', '.join(kinds)}; n = {', '.join(map(str, counts))} elements per rank), "
             "or the nearest order and how many "
             "elements differ, summed over the kinds. A row whose notes say MPICH fell back "
             "ran MPICH's own choice, not the variant named.", "",
             f"Run {datetime.date.today().isoformat()} on {os.cpu_count()} cores "
             f"({platform.machine()}, {platform.system()}), ranks oversubscribed.", "",
             "Regenerate (each library from an environment that has it):", "", "```",
             "python benchmarks/library_orders.py run --library mpich",
             "python benchmarks/library_orders.py run --library openmpi "
             "--python OMPI_VENV/bin/python",
             "python benchmarks/library_orders.py run --library gloo", cmd, "```", ""]
    for key in order:
        mine = [e for e in entries if e["library_key"] == key]
        if mine:
            lines += [f"## {mine[0]['library']}", "", *_table(mine, ps), ""]
    failed = _failed(dump, libraries)
    if failed:
        lines += ["## Variants that did not run", "", *failed, ""]
    Path(args.spec).write_text("\n".join(lines))
    known = [{**{k: e[k] for k in ("library", "variant", "description", "collective", "p",
                                   "op", "dtype", "count", "matches")}, "root": 0}
             for e in entries if e["matches"] and not e["every"]
             and not any("fell back" in n for n in e["notes"])]
    Path(args.known).write_text(json.dumps(known, indent=1) + "\n")
    print("\n".join(lines))
    print(f"wrote {args.spec} and {args.known} ({len(known)} library orders)")


def record(args) -> None:
    """Write one ``.npz`` per library variant and collective of a dump, for the tests.

    Keys: ``collective``, ``op``, ``dtype``, ``library``, ``variant``, and per p
    ``p<P>_in`` (p x n inputs, as stored bits) and ``p<P>_out<r>`` (each rank's output).
    """
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for vfile in sorted(Path(args.dump).glob("*/*/variant.json")):
        rec = json.loads(vfile.read_text())
        for case_in in sorted(vfile.parent.glob(f"*/p*/{args.kind}-*/in")):
            coll, pdir, case = case_in.parts[-4:-1]
            _, dtype, op = case.split("-")
            name = f"{rec['library_key']}-{vfile.parent.name}-{coll}-{dtype}-{op}.npz"
            target = out / name
            data = dict(np.load(target)) if target.exists() else {}
            data.update(collective=np.array(coll), op=np.array(op), dtype=np.array(dtype),
                        library=np.array(_version(vfile.parent)), variant=np.array(rec["variant"]))
            ins = [np.load(f) for f in sorted(case_in.glob("rank*.npy"))]
            data[f"{pdir}_in"] = np.stack(ins)
            for f in sorted((case_in.parent / "out").glob("rank*.npy")):
                data[f"{pdir}_out{f.stem[4:]}"] = np.load(f)
            np.savez_compressed(target, **data)
            print(f"wrote {target}")
