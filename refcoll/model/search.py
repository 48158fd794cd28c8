"""The automatic search for the best stack, and the sentence that says what wins and why.

:func:`search_stacks` tries every chosen algorithm, dense and with each given
compressor, in each of a ladder of bucket counts (1, 4, 16, 64, 256, PyTorch
DDP's 25 MB buckets, and ``--buckets``), and keeps the quickest step. A row per
compression and bucket count shows the best algorithm it found there. Ties go
to the dense gradient, so compression is kept only when it makes the step
faster. :func:`stack_verdict` says what the search kept and why.
"""

from __future__ import annotations

from dataclasses import replace

from ..core.units import human_bytes, human_time
from .cluster import Cluster, Options, Workload, bucket_limit, buckets_of
from .overlap import StepTime
from .pricing import estimate_name
from .stack import Plan, bucket_estimate, candidates_for, plan, stacked, step_time
from .verdict import allreduce_verdict, distinct_times, step_text, why

__all__ = ["DDP_BUCKET", "bucket_ladder", "search_stacks", "verdict", "stack_verdict",
           "plan_and_search"]

#: PyTorch DDP's default bucket_cap_mb (25 MiB).
DDP_BUCKET = 25 << 20

_LADDER = (1, 4, 16, 64, 256)


def bucket_ladder(workload: Workload, asked: int = 1) -> tuple[int, ...]:
    """Return the bucket counts the search tries, each at most :func:`bucket_limit`."""
    ddp = -(-workload.nbytes // DDP_BUCKET)
    limit = bucket_limit(workload)
    return tuple(sorted({min(b, limit) for b in (*_LADDER, ddp, asked)}))


def search_stacks(cluster: Cluster, workload: Workload,
                  options: Options) -> tuple[tuple[StepTime, ...], StepTime]:
    """Return the rows tried (the best algorithm per compression and bucket count) and the best.

    Each row is labelled ``dense`` or the compressor's spec; the best is the
    least step, dense before compressed when they tie, then the least communication.
    """
    rows, made = [], set()
    for spec in (None, *options.compressors):
        for count in bucket_ladder(workload, options.buckets):
            if (spec, len(buckets_of(workload, count))) in made:
                continue  # layers not split: this count makes buckets already tried
            tried = [step_time(cluster, workload, a, compressor=spec, pattern=options.pattern,
                               buckets=count, inter=options.inter)
                     for a in candidates_for(options, spec)]
            row = min(tried, key=lambda r: (r.step, r.comm))
            made.add((spec, row.buckets))
            rows.append(replace(row, label=spec or "dense"))
    best = min(rows, key=lambda r: (r.step, r.compressor is not None, r.comm))
    return tuple(rows), best


def _bucket_estimates(result: Plan, best: StepTime, other: str):
    """Return the best stack's last bucket priced with its algorithm and with ``other``.

    Rows and estimates name an algorithm as :func:`~.pricing.estimate_name` does
    (``hierarchical(inter=tree)``); the registry name is looked up from it. The bucket
    is priced as the best stack sends it: compressed when it is.
    """
    options = result.options
    names = {estimate_name(a, options.inter): a for a in options.algorithms}
    shapes = buckets_of(result.workload, best.buckets)[-1][0]
    kw = dict(compressor=best.compressor, pattern=options.pattern, inter=options.inter)
    return (bucket_estimate(result.cluster, result.workload, shapes, names[best.algorithm], **kw),
            bucket_estimate(result.cluster, result.workload, shapes, names[other], **kw))


def stack_verdict(result: Plan, best: StepTime | None) -> tuple[str, ...]:
    """Return what the search kept, why its algorithm, and each compressor it did not keep."""
    if best is None:
        return ()
    base = result.stack[0]
    kept = f"compressed with {best.compressor}" if best.compressor else "dense"
    out = [f"best stack found: {best.algorithm}, {kept}, {best.buckets} bucket"
           f"{'s' if best.buckets > 1 else ''}: step {step_text(best.step)}, "
           f"{base.step / best.step:.3f}× NCCL's default one-bucket step "
           f"({step_text(base.step)}); {human_time(best.comm - best.exposed)} of "
           f"{human_time(best.comm)} communication hidden under the backward pass."]
    winner = min(result.dense, key=lambda e: e.seconds).algorithm
    if best.pattern in (None, "allreduce") and best.algorithm != winner and best.buckets > 1:
        mine, theirs = _bucket_estimates(result, best, winner)
        if mine.seconds < theirs.seconds:
            sent = (f", compressed with {best.compressor} to {human_bytes(mine.payload)}"
                    if best.compressor else "")
            tm, tt = distinct_times(mine.seconds, theirs.seconds)
            out.append(f"In buckets of {human_bytes(mine.dense)}{sent}, {best.algorithm} beats "
                       f"{winner} ({tm} against {tt} a bucket): "
                       f"{why(result.cluster, mine, theirs)}.")
    dense = min((r for r in result.search if r.compressor is None), key=lambda r: r.step)
    if best.compressor is not None:
        out.append(f"{best.compressor} is kept: it saves {human_time(dense.step - best.step)} a "
                   f"step against the best dense stack ({step_text(dense.step)}, "
                   f"{dense.algorithm} in {dense.buckets} buckets); the model does not price "
                   f"what compression does to convergence.")
    for spec in result.options.compressors:
        mine = min((r for r in result.search if r.compressor == spec), key=lambda r: r.step)
        if mine.step >= dense.step:
            out.append(f"{spec} is not kept: its best step ({step_text(mine.step)}) is no "
                       f"faster than dense ({step_text(dense.step)}).")
    return tuple(out)


def verdict(result: Plan, best: StepTime | None) -> tuple[str, ...]:
    """Return :func:`~.verdict.allreduce_verdict` and :func:`stack_verdict` together."""
    return allreduce_verdict(result.cluster, result.dense) + stack_verdict(result, best)


def plan_and_search(cluster: Cluster, workload: Workload, options: Options) -> Plan:
    """Return :func:`~refcoll.model.stack.plan` with the search and the verdict."""
    result = plan(cluster, workload, options)
    rows, best = search_stacks(cluster, workload, options)
    base = result.stack[0]  # each row's speed-up over the baseline, gain over the row before
    priced = tuple(stacked(row, row.label, base, previous)
                   for row, previous in zip(rows, (base, *rows)))
    best = priced[[row is best for row in rows].index(True)]
    result = replace(result, search=priced, best=best)
    return replace(result, verdict=verdict(result, best))
