"""The oracle's commands: ``gen-inputs``, ``oracle`` and ``check``.

``gen-inputs`` writes deterministic inputs, ``oracle`` writes what an algorithm
returns for them bit for bit, and ``check`` judges another implementation's
outputs (:mod:`refcoll.verify.oracle`).
"""

from __future__ import annotations

import os
import sys

import click
import numpy as np

from .. import algorithms
from ..core.bits import same_bits
from ..core.chunking import chunk_bounds
from ..core.errors import UsageError
from ..core.ops import check_supported, dtype_name, get_dtype, get_op
from ..core.units import counted
from ..core.writing import same_place
from ..verify.evaluators import rank_blockwise
from ..verify.findings import renumbered
from ..verify.formula import FORMULA_KINDS, FormulaInput, Spec, parse_spec, sample_indices
from ..verify.formula import values as formula_values
from ..verify.identify import identify_blocks
from ..verify.inputs import make_input
from ..verify.oracle import (
    BLOCK_BYTES,
    block_length,
    block_operands,
    check_outputs,
    expected_outputs,
    reference_blocks,
    shapes_judged,
    spans_held,
)
from ..verify.rankfiles import (
    Streamed,
    files_dtype,
    load_case,
    load_outputs,
    rank_file_bytes,
    read_elements,
    read_meta,
    write_world,
)
from ..verify.simulation import MAX_SIMULATED_RANKS, simulation_bytes
from .common import (
    check_output_directory,
    check_output_paths,
    main,
    out_of_memory_is_usage,
    reports_errors,
    require_disk,
    require_memory,
    write_json,
)

__all__ = ["gen_inputs", "oracle", "check"]


# -------------------------------------------------------------------- the oracle

_KINDS = ["exact", "random", "adversarial"]


@main.command("gen-inputs")
@click.option("-p", "--procs", "p", type=click.IntRange(min=1), required=True,
              help=f"Number of ranks, 1 to {MAX_SIMULATED_RANKS}.")
@click.option("--count", type=click.IntRange(min=0), required=True, help="Elements per rank.")
@click.option("--dtype", default="float32", show_default=True)
@click.option("--kind", type=click.Choice(_KINDS), default="random", show_default=True)
@click.option("--op", default="sum", show_default=True,
              help="The op the inputs are made exact for.")
@click.option("--seed", type=click.IntRange(min=0, max=2**64 - 1), default=0,
              show_default=True, help="0 to 2**64 - 1.")
@click.option("--formula", is_flag=True,
              help="Write refcoll's formula inputs (spec/inputs.md; exact or adversarial, for "
                   "sum or avg): those `check --inputs KIND:seed=S,p=P,count=N` makes again.")
@click.argument("directory", type=click.Path())
@reports_errors
def gen_inputs(p, count, dtype, kind, op, seed, formula, directory):
    """Write rank<r>.npy inputs for P ranks (and meta.json) into DIRECTORY.

    exact: float results exact in any order (nccl-tests' verifiable inputs);
    random: normal values; adversarial: cancelling large values that expose the
    reduction order. bfloat16 and float8 are stored as their integer bits. -p is at
    most 4096, as for `refcoll simulate`: the oracle runs every rank as a thread.
    These kinds are drawn from NumPy's generator; with --formula they are the
    formula's instead, element i of rank r a function of (seed, r, i), which `check
    --inputs` and a library's own test can make again without the files.
    """
    if formula:
        if kind not in FORMULA_KINDS or get_op(op).name not in ("sum", "avg"):
            raise UsageError(f"--formula makes the kinds {' and '.join(FORMULA_KINDS)} for sum "
                             f"or avg, not --kind {kind} --op {op}")
        # one element first: a kind the dtype cannot take is refused before any file
        FormulaInput(kind, get_dtype(dtype), p, 0, 1, seed=seed).read()
    if p > MAX_SIMULATED_RANKS:
        raise UsageError(f"-p {p}: refcoll's oracle runs every rank as a thread of one "
                         f"process, so a world has at most {MAX_SIMULATED_RANKS} ranks; give "
                         f"-p {MAX_SIMULATED_RANKS} or fewer")
    check_output_directory("DIRECTORY", directory)
    dt = get_dtype(dtype)
    reduction = get_op(op)
    check_supported(reduction, dt)  # inputs for an op the dtype has not: refused, as a run is
    what = f"generating {p} inputs of {count} x {dtype}"
    advice = "lower --count or -p"
    # One rank's input at a time is made and written, beside its generator's draws
    draws = FORMULA_DRAW_BYTES if formula else DRAW_BYTES
    require_memory(count * dt.itemsize + draws * count, what, advice)
    require_disk(directory, p * count * dt.itemsize, what, advice)

    def maker(r):
        if formula:
            return FormulaInput(kind, dt, p, r, count, seed=seed).whole
        return lambda: make_input(kind, dt, count, r, p, op=reduction.name, seed=seed)
    meta = {"count": count, "kind": kind, "op": reduction.name, "seed": seed}
    if formula:
        meta["inputs"] = str(Spec(kind, seed, p, count, dt))
    with out_of_memory_is_usage(what, advice):
        write_world(directory, [maker(r) for r in range(p)], meta=meta)
    made = f"{kind}, as --inputs {meta['inputs']}" if formula else kind
    click.echo(f"wrote {p} inputs of {count} x {dtype} ({made}) to {directory}")


def _collective_options(f):
    f = click.option("--root", type=click.IntRange(min=0), default=None,
                     help="Root of broadcast and reduce [default: 0].")(f)
    f = click.option("--collective", type=click.Choice(list(algorithms.COLLECTIVES)),
                     default="allreduce", show_default=True)(f)
    f = click.option("--op", default=None,
                     help="The reduction of allreduce, reduce_scatter and reduce "
                          "[default: sum].")(f)
    return f


def _collective_args(op, collective: str, root) -> tuple[str, int]:
    """Return ``(op, root)`` with their defaults, refusing what the collective has not: a
    root but for broadcast and reduce, an op for a collective that reduces nothing (as
    ``refcoll simulate`` refuses them), rather than record it in meta.json unused."""
    if root is not None and collective not in ("broadcast", "reduce"):
        raise UsageError(f"--root {root}: {collective} has no root (broadcast and reduce do)")
    if op is not None and collective in ("allgather", "broadcast"):
        raise UsageError(f"--op {op}: {collective} reduces nothing (allreduce, reduce_scatter "
                         "and reduce do)")
    return ("sum" if op is None else op), (0 if root is None else root)


def _supported(op, collective: str, dtype) -> None:
    """Refuse a reduction the dtype has not (float8's prod and avg), as every run does."""
    if collective in ("allreduce", "reduce_scatter", "reduce"):
        check_supported(get_op(op), dtype)


@main.command()
@click.option("--algorithm", required=True, help="The algorithm whose results to predict.")
@_collective_options
@click.argument("in_dir", type=click.Path())
@click.argument("out_dir", type=click.Path())
@reports_errors
def oracle(algorithm, op, collective, root, in_dir, out_dir):
    """Write the expected per-rank outputs of ALGORITHM for IN_DIR's inputs, bit for bit.

    Every algorithm of every collective is written block by block, in bounded memory,
    but for a few reductions (auto under a tuning file, hierarchical on unequal nodes,
    the switch's int mode), which are simulated on whole arrays. IN_DIR has at most 4096
    ranks. OUT_DIR must not be IN_DIR (compared by what they resolve to, links
    followed); each file is written to a temporary name and renamed into place, so a
    link in OUT_DIR is replaced, never written through.
    """
    op, root = _collective_args(op, collective, root)
    check_output_directory("OUT_DIR", out_dir)
    if same_place(in_dir, out_dir):
        raise UsageError(f"OUT_DIR {out_dir} is IN_DIR {in_dir} (the same folder, links "
                         "followed): the outputs would overwrite the inputs")
    algorithms.implementation(algorithm, collective)
    meta = {"algorithm": algorithm, "collective": collective, "op": get_op(op).name,
            "root": root}
    inputs, _, _ = load_case(in_dir, collective=collective, root=root, lazy=True)
    x = inputs[0]
    _supported(op, collective, x.dtype)
    fold = rank_blockwise(collective, len(inputs), x.size, x.dtype.itemsize,
                          algorithm=algorithm, op=get_op(op).name, root=root)
    if fold is not None:  # predicted and written block by block
        require_memory(STREAMED_BYTES, f"predicting {algorithm} {collective}",
                       "predict fewer or smaller inputs")
        held = [len(span) for span in spans_held(collective, len(inputs), x.size,
                                                 root).values()]
        require_disk(out_dir, sum(held) * x.dtype.itemsize,
                     f"writing {len(held)} expected output{'s' * (len(held) > 1)}",
                     "predict fewer or smaller inputs")
        write_world(out_dir, _streamed_outputs(inputs, fold, out_dir, collective, root),
                    meta=meta)
        click.echo(f"wrote {counted(len(held), 'expected output')} of {algorithm} "
                   f"{collective} to {out_dir}")
        return
    require_memory(rank_file_bytes(in_dir), f"reading the rank files of {in_dir}",
                   "predict fewer or smaller inputs")
    inputs = [f.whole() for f in inputs]
    what = f"predicting {algorithm} {collective} for {len(inputs)} ranks"
    advice = "predict fewer or smaller inputs"
    require_memory(simulation_bytes(collective, len(inputs), inputs[0].size,
                                    inputs[0].dtype.itemsize), what, advice)
    with out_of_memory_is_usage(what, advice):
        outputs = expected_outputs(collective, inputs, algorithm=algorithm, op=get_op(op).name,
                                   root=root)
    write_world(out_dir, outputs, meta=meta)
    held = sum(o is not None for o in outputs)
    click.echo(f"wrote {counted(held, 'expected output')} of {algorithm} {collective} to "
               f"{out_dir}")


@main.command()
@click.option("--algorithm", default=None,
              help="Also require bit-exactness against this algorithm.")
@click.option("--any", "any_order", is_flag=True,
              help="Judge without a declared algorithm (the default).")
@click.option("--identify", is_flag=True,
              help="Also name every order refcoll knows that gives these outputs bit for bit "
                   "(or the nearest).")
@_collective_options
@click.option("--inputs", "formula", default=None, metavar="KIND:seed=S,p=P,count=N[,dtype=D]",
              help="Judge against refcoll's formula inputs (spec/inputs.md: exact or "
                   "adversarial), made here, instead of IN_DIR's files: give OUT_DIR alone. "
                   "dtype: the outputs' (default: their meta.json's, else their header's; "
                   "bfloat16 and float8 files hold bits, so name those).")
@click.option("--sample", type=click.IntRange(min=1), default=None, metavar="K",
              help="With --inputs: judge K elements of every rank's output (the first, "
                   "the last and K-2 drawn; a reduce-scatter's K of each chunk), reading "
                   "nothing else of the files.")
@click.option("--json", "json_file", type=click.Path(dir_okay=False),
              help="Write the whole report as JSON.")
@click.argument("folders", nargs=-1, type=click.Path(), metavar="[IN_DIR] OUT_DIR")
@reports_errors
def check(algorithm, any_order, identify, op, collective, root, formula, sample, json_file,
          folders):
    """Judge another implementation's outputs (OUT_DIR/rank<r>.npy) for IN_DIR's inputs.

    With --identify, also simulate every reduction order refcoll knows (each
    algorithm under each of its order options) and name those whose outputs
    equal OUT_DIR's bit for bit, with the library orders recorded as equal to
    them (spec/orders.md), or the nearest. With --inputs, the inputs are
    refcoll's formula of (seed, rank, index), made here (give OUT_DIR alone);
    --sample K then judges K elements of each output. The files are read block by
    block, in bounded memory whatever their size, and --algorithm and --identify
    predict block by block too (but for auto under a tuning file, hierarchical on
    unequal nodes and the switch's int mode, which simulate whole arrays and ask for
    that memory first). Exit 0 conforming, 1 not conforming, 2 the files cannot be
    judged (with the file and the reason: see refcoll.verify.rankfiles).
    """
    op, root = _collective_args(op, collective, root)
    in_dir, out_dir = _folders(folders, formula)
    check_output_paths(json=json_file)
    _refuse_report_over_case(json_file, *(f for f in (in_dir, out_dir) if f))
    if algorithm and any_order:
        raise UsageError("give --algorithm A or --any, not both")
    if algorithm:
        algorithms.implementation(algorithm, collective)
    op = get_op(op).name
    if sample is not None:
        _check_sample(formula, sample, op, collective, root, algorithm, identify, out_dir,
                      json_file)
        return
    if formula is not None:
        inputs, outputs = _formula_case(formula, out_dir, collective=collective, root=root,
                                        op=op)
    else:
        inputs, outputs, _ = load_case(in_dir, out_dir, collective=collective, root=root,
                                       op=op, lazy=True)
    advice = "judge fewer or smaller outputs"
    x = inputs[0]
    _supported(op, collective, x.dtype)
    blocks = algorithm and rank_blockwise(collective, len(inputs), x.size, x.dtype.itemsize,
                                          algorithm=algorithm, op=op) is not None
    # the simulator runs on whole arrays where no block evaluator gives an algorithm's results
    whole = algorithm and not blocks
    if whole:
        require_memory(_whole_bytes(inputs, outputs, collective), f"simulating {len(inputs)} "
                       "ranks' whole inputs (--algorithm, --identify)", advice)
        inputs = [f.whole() for f in inputs]
        outputs = [None if f is None else f.whole() for f in outputs]
    else:  # every file is read block by block
        require_memory(STREAMED_BYTES + (IDENTIFY_BYTES if identify else 0),
                       f"judging {len(inputs)} ranks' outputs", advice)
    with out_of_memory_is_usage(f"judging {len(inputs)} ranks' outputs", advice):
        report = check_outputs(inputs, outputs, collective=collective, op=op,
                               algorithm=algorithm, root=root)
        found = None
        shaped = all(f.passed for f in report.findings if f.check == "shapes and dtypes")
        if identify and shaped:  # every order, block by block
            found = identify_blocks(inputs, outputs, collective=collective, op=op, root=root,
                                    budget=IDENTIFY_BYTES)
    if identify and not shaped:
        report.notes.append("--identify names no order: the outputs are not the shape and "
                            "dtype the collective gives")
    _print_report(report, collective, algorithm, found)
    write_json(json_file, {**report.to_json(),
                           **({"identify": found.to_json()} if found else {})})
    sys.exit(0 if report.conforming else 1)


def _streamed_outputs(inputs: list, fold, out_dir, collective: str, root: int) -> list:
    """Return every rank's output (None for a rank without one) of a collective that
    ``fold`` gives block by block (:func:`~refcoll.verify.evaluators.rank_blockwise`): each
    holder's made from the inputs' blocks over the elements it holds. Where every
    holder holds the whole vector (all-reduce, all-gather, broadcast), another holder's
    is a copy of the first's file when every block of its result was the first's (as
    it usually is), else made in turn."""
    x, p = inputs[0], len(inputs)
    spans = spans_held(collective, p, x.size, root)
    length = block_length(p, x.dtype.itemsize)
    head, *rest = spans
    whole = collective in ("allreduce", "allgather", "broadcast")
    same = [whole] * p  # whether rank r's blocks so far are the first holder's bits
    shape = {"allgather": (p, *x.shape), "reduce_scatter": None}.get(collective, x.shape)

    last = {}  # the last block's results: a reduce-scatter's next rank holds more of it

    def predicted(lo: int, hi: int, q: int) -> list:
        if (lo, hi) not in last:
            last.clear()
            last[lo, hi] = fold(block_operands(collective, inputs, lo, hi, q, x.size, root,
                                               x.dtype), lo)
        return last[lo, hi]

    def made(r: int):
        span = spans[r]

        def blocks():
            try:
                for lo, hi, q in reference_blocks(collective, p, x.size, length):
                    a, b = max(lo, span.start), min(hi, span.stop)
                    if a >= b:
                        continue
                    results = predicted(lo, hi, q)
                    if r == head:
                        for other in rest:
                            same[other] = same[other] and same_bits(results[other],
                                                                    results[head])
                    yield results[r][a - lo:b - lo]
            finally:
                for f in inputs:
                    f.close()
        return Streamed(x.dtype, shape or (len(span),), blocks)

    first = os.path.join(out_dir, f"rank{head}.npy")

    def copy_or_made(r: int):
        return lambda: Streamed(x.dtype, shape, source=first) if same[r] else made(r)
    outputs = [None] * p
    outputs[head] = made(head)
    for r in rest:
        outputs[r] = copy_or_made(r) if whole else made(r)
    return outputs


def _folders(folders: tuple, formula: str | None) -> tuple[str | None, str]:
    """Return ``(IN_DIR, OUT_DIR)``: both without --inputs, OUT_DIR alone with it."""
    if formula is not None:
        if len(folders) != 1:
            raise UsageError("with --inputs the inputs are made here: give OUT_DIR alone")
        return None, folders[0]
    if len(folders) != 2:
        raise UsageError("give IN_DIR and OUT_DIR (or --inputs KIND:seed=S,p=P,count=N OUT_DIR)")
    return folders[0], folders[1]


#: The bytes an element of one rank's input takes to draw, beside the input itself, at most
#: over the kinds and dtypes (tracemalloc's peaks: NumPy's adversarial layout, about eight
#: float64 or int64 arrays, 41; the formula's, which counts its way to every value, 82).
DRAW_BYTES, FORMULA_DRAW_BYTES = 64, 96

#: What a streamed check holds at most beside its code: a few blocks of operands.
STREAMED_BYTES = 8 * BLOCK_BYTES

#: What ``--identify`` of an all-reduce holds beside the check: the blocks of inputs and
#: outputs it compares every order on, and each order's results for them.
IDENTIFY_BYTES = 256 << 20


def _whole_bytes(inputs, outputs, collective: str) -> int:
    """Return the bytes of whole inputs and outputs, and the simulator's copies of them."""
    x = inputs[0]
    held = sum(o.size * o.dtype.itemsize for o in outputs if o is not None)
    return len(inputs) * x.size * x.dtype.itemsize + held + simulation_bytes(
        collective, len(inputs), x.size, x.dtype.itemsize)


def _check_root(root: int, p: int) -> None:
    """Refuse a ``--root`` that is not one of the ``p`` ranks of ``--inputs``."""
    if root >= p:
        raise UsageError(f"--root {root} is not one of the {p} ranks (0 .. {p - 1})")


def _formula_dtype(formula: str, named, out_dir: str, collective: str, root: int):
    """Return the dtype ``--inputs`` judges as: the spec's, else ``meta.json``'s, else the
    files' header's, which must not be ``uint8`` or ``uint16`` (bfloat16 and float8 files
    hold those as their bits: judged as integers, right outputs would fail)."""
    if named is not None:
        return named
    dtype = files_dtype(out_dir, root if collective == "reduce" else None)
    if "dtype" not in read_meta(out_dir) and dtype in (np.uint8, np.uint16):
        raise UsageError(f"{out_dir}: its files hold {dtype_name(dtype)}, which may be the bits "
                         f"of {'bfloat16' if dtype == np.uint16 else 'a float8 type'}, and "
                         f"no meta.json says which: name the type, --inputs {formula.strip()}"
                         f",dtype={dtype_name(dtype)} (or the float type whose bits they are)")
    return dtype


def _formula_case(formula: str, out_dir: str, *, collective: str, root: int, op: str):
    """Return (inputs by formula, OUT_DIR's outputs) for --inputs, both read block by block."""
    kind, seed, p, count, named = parse_spec(formula)
    if p > MAX_SIMULATED_RANKS:
        raise UsageError(f"--inputs p={p}: refcoll judges the outputs of at most "
                         f"{MAX_SIMULATED_RANKS} ranks (a reduce's root file, with --sample K, "
                         "of any p)")
    _check_root(root, p)
    dtype = _formula_dtype(formula, named, out_dir, collective, root)  # held to the files
    inputs = [FormulaInput(kind, dtype, p, r, count, seed=seed) for r in range(p)]
    return inputs, load_outputs(out_dir, p, dtype, collective=collective, root=root, op=op,
                                lazy=True)


def _check_sample(formula, k: int, op: str, collective: str, root: int, algorithm, identify,
                  out_dir, json_file) -> None:
    """Judge ``k`` elements of every rank's output against the formula; exit.

    The output folder is held to the full check's rules first (its listing,
    ``meta.json``, each file's header: the same exit 2), and each output's dtype and
    shape to the collective's (exit 1 when wrong, as the full check), so only the
    values are sampled.
    """
    if formula is None:
        raise UsageError("--sample K judges outputs against --inputs KIND:seed=S,p=P,count=N")
    if algorithm or identify:
        raise UsageError("--sample judges elements on their own: no --algorithm or --identify "
                         "with it (orders depend on every element's place)")
    kind, seed, p, count, named = parse_spec(formula)
    _check_root(root, p)
    each = _sample_size(collective, p, count, k)
    dtype = _formula_dtype(formula, named, out_dir, collective, root)
    _supported(op, collective, dtype)
    files = load_outputs(out_dir, p, dtype, collective=collective, root=root, op=op, lazy=True)
    if not shapes_judged(collective, p, (count,), root, files, dtype).passed:
        # the full check's report, which stops at the shapes: no element is read
        report = check_outputs([FormulaInput(kind, dtype, p, r, count, seed=seed)
                                for r in range(p)], files, collective=collective, op=op,
                               root=root)
        _print_report(report, collective, None)
        write_json(json_file, report.to_json())
        sys.exit(1)
    readers = {"allgather": p * p, "reduce": 1, "reduce_scatter": 1}.get(collective, p)
    require_memory(each * (48 + p * 24 + readers * (dtype.itemsize + 16)),
                   f"--sample {k} of {p} ranks", "sample fewer elements")
    where, asked = _sampled(collective, p, count, each, root, seed)
    inputs = [formula_values(kind, dtype, p, r, where, seed=seed) for r in range(p)]
    outputs = read_elements(files, asked)
    report = check_outputs(inputs, outputs, collective=collective, op=op, root=root)
    in_the_files(report, collective, count, where, asked)
    click.echo(f"refcoll check: sampled {_sample_text(collective, p, count, where, root)} "
               f"(--inputs {formula}); an element below is the outputs' own (the sampled "
               "ones: --json)")
    _print_report(report, collective, None)
    sampled = ({str(r): a.tolist() for r, a in asked.items()} if collective == "reduce_scatter"
               else where.tolist())
    write_json(json_file, {**report.to_json(), "sampled": sampled})
    sys.exit(0 if report.conforming else 1)


def in_the_files(report, collective: str, count: int, where, asked: dict) -> None:
    """Name each finding's elements as the outputs' own, in place: ``check_outputs``
    judged the sampled elements, compacted, and names their places among them.

    ``where``, ``asked``: :func:`_sampled`'s (a reduce-scatter's rank ``R`` element
    ``S`` is ``asked[R][S]`` of its chunk; an all-gather's output is ``p`` inputs'
    samples, one after the other).
    """
    each = where.size

    def real(rank: int | None, whole: bool, s: int) -> int:
        if collective == "reduce_scatter" and rank is not None and not whole:
            return int(asked[rank][s])
        if collective == "allgather":
            return (s // each) * count + int(where[s % each])
        return int(where[s])

    for finding in report.findings:
        finding.detail = renumbered(finding.detail, real)
        data = finding.data or {}
        for entry in [data, *(v for v in data.values() if isinstance(v, dict))]:
            if isinstance(entry.get("index"), int):
                entry["index"] = real(entry.get("rank"), False, entry["index"])


def _sample_size(collective: str, p: int, count: int, k: int) -> int:
    """Return how many elements of each output (a reduce-scatter: of each rank's chunk)
    ``--sample k`` judges: ``k``, or all of them where there are fewer."""
    if collective != "reduce_scatter":
        return min(k, count)
    smallest = min(hi - lo for lo, hi in chunk_bounds(count, p)) if count else 0
    if count and not smallest:
        raise UsageError(f"--sample of a reduce-scatter samples every rank's chunk alike: "
                         f"count={count} leaves rank {p - 1} none (give count >= p={p})")
    return min(k, smallest)


def _sample_text(collective: str, p: int, count: int, where, root: int) -> str:
    """What the sample was, for its report's first line."""
    if collective == "reduce_scatter":
        return f"{where.size // p} elements of each of {p} ranks' chunks of {count}"
    if collective == "allgather":
        return f"{where.size} of {count} elements of each of {p} ranks' inputs, in every output"
    if collective == "reduce":
        return f"{where.size} of {count} elements of the root's output (rank {root}, of {p})"
    return f"{where.size} of {count} elements of each of {p} ranks' outputs"


def _sampled(collective: str, p: int, count: int, each: int, root: int, seed: int) -> tuple:
    """Return the inputs' sampled elements and ``{rank: elements of its output to read}``:
    a smaller call of the same collective, whose outputs are the real ones' there.

    ``each``: :func:`_sample_size`'s. A reduce-scatter samples ``each`` elements of
    each rank's chunk (the inputs' elements are every rank's, chunk after chunk, so
    the smaller call's equal chunks are the real ones' samples); an all-gather reads
    each rank's copy of every input at the sampled elements; a reduce reads the
    root's output alone.
    """
    if collective == "reduce_scatter":
        bounds = chunk_bounds(count, p)
        asked = {r: sample_indices(hi - lo, each, seed=seed) for r, (lo, hi) in enumerate(bounds)}
        return np.concatenate([lo + asked[r] for r, (lo, _) in enumerate(bounds)]), asked
    where = sample_indices(count, each, seed=seed)
    if collective == "allgather":
        return where, dict.fromkeys(range(p), np.concatenate([q * count + where
                                                              for q in range(p)]))
    if collective == "reduce":
        return where, {root: where}
    return where, dict.fromkeys(range(p), where)


def _refuse_report_over_case(json_file: str | None, *folders: str) -> None:
    """Refuse a --json path that is (or links to) a file of the case being judged."""
    if not json_file:
        return
    target = os.path.realpath(json_file)
    name = os.path.basename(target)
    if name != "meta.json" and not name.endswith(".npy"):
        return
    for folder in folders:
        if same_place(os.path.dirname(target), folder):
            raise UsageError(f"--json {json_file}: is {os.path.join(folder, name)}, a file "
                             "being judged; write the report elsewhere")


def _print_report(report, collective: str, algorithm: str | None, found=None) -> None:
    """Print the findings as a table, the report's notes (advice), the orders found
    (``found``, with --identify), then the verdict."""
    against = f", against {algorithm}" if algorithm else ""
    click.echo(f"refcoll check: {collective} {report.op}, {report.ranks} ranks, {report.count} x "
               f"{report.dtype}{against}")
    click.echo(f"{'check':<42} {'result':<7} detail")
    for f in report.findings:
        click.echo(f"{f.check:<42} {'ok' if f.passed else 'FAIL':<7} {f.detail}")
    for note in getattr(report, "notes", []):
        click.echo(f"note: {note}")
    for line in found.summary() if found else ():
        click.echo(f"identify: {line}")
    click.echo("verdict: " + ("conforming" if report.conforming else "not conforming"))
