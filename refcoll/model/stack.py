"""The stack: a training step's time with each technique added in turn, and the plan.

Rows: the baseline, what NCCL does by default (the algorithm and protocol its
own tuning model picks for the gradient, :mod:`~refcoll.model.nccl`,
priced here with its channels, dense, one bucket), then ``+topology`` (the
fastest of the chosen algorithms), ``+compression`` (the best of the given
compressors), ``+overlap``, each with its step time (``forward + backward +
exposed communication``), communication fraction and speed-up. The stack
keeps what was asked for, even a technique that makes the step slower (a
note says so); :mod:`~refcoll.model.search` finds the best stack and
never keeps such a technique. :func:`plan` is what ``refcoll model`` prints.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from .. import algorithms
from ..core.errors import UsageError
from ..core.units import human_bytes, human_time
from .channels import CHANNELLED
from .cluster import Cluster, Options, Workload, buckets_of, check_buckets
from .compression import chosen_pattern, compressed_estimate, needs_shapes
from .nccl import NCCL_VERSION, NcclTime, nccl_times
from .nccl_run import predict
from .overlap import StepTime, overlap
from .pricing import Estimate, allreduce_estimate, estimate_name
from .systems import as_system
from .verdict import allreduce_verdict

__all__ = ["step_time", "Plan", "plan", "baseline_algorithm", "candidates_for",
           "bucket_estimate"]

#: The compressed pattern that runs an all-reduce algorithm over the payload; the
#: others run their own collective, whatever algorithm is named.
_ALLREDUCE_PATTERN = "allreduce"

#: What the baseline is on one GPU, where NCCL tunes nothing (no message moves).
_SINGLE_RANK = "ring"


def bucket_estimate(cluster: Cluster, workload: Workload, shapes, algorithm: str, *,
                    compressor: str | None, pattern: str | None, inter: str) -> Estimate:
    """Return the estimate of one bucket (tensors ``shapes``), dense or compressed."""
    if compressor is None:
        count = sum(math.prod(s) for s in shapes)
        return allreduce_estimate(cluster, algorithm, count, workload.bytes_per_element,
                                  inter=inter)
    return compressed_estimate(cluster, compressor, shapes, workload.dtype, algorithm,
                               pattern=pattern, inter=inter, layered=workload.layered)


def step_time(cluster: Cluster, workload: Workload, algorithm: str, *,
              compressor: str | None = None, pattern: str | None = None, buckets: int = 1,
              inter: str = "ring", label: str = "") -> StepTime:
    """Return the modelled step with ``algorithm``, an optional compressor and ``buckets``."""
    cut = buckets_of(workload, buckets)
    comm, seen = [], {}  # buckets of the same shapes (all of a flat count's) cost the same
    for shapes, _ in cut:
        if shapes not in seen:
            seen[shapes] = bucket_estimate(cluster, workload, shapes, algorithm,
                                           compressor=compressor, pattern=pattern, inter=inter)
        comm.append(seen[shapes].seconds)
    exposed, _ = overlap([ready * workload.backward for _, ready in cut], comm, workload.backward)
    est = seen[cut[-1][0]]
    # A compressed all-reduce names the bare algorithm; the row names it as a dense one does.
    name = estimate_name(algorithm, inter) if est.algorithm == algorithm else est.algorithm
    return StepTime(label, name, compressor, est.pattern, len(cut), sum(comm), exposed,
                    workload.forward + workload.backward + exposed)


@dataclass(frozen=True)
class Plan:
    """Everything ``refcoll model`` reports for one cluster, workload and options.

    ``nccl`` holds NCCL's tuning model's times for the gradient (each algorithm and
    protocol), ``baseline`` NCCL's pick and what prices it here; ``search`` the
    rows the automatic search tried (the best algorithm of each compression and
    bucket count), ``best`` its pick; ``verdict`` says which all-reduce wins and why.
    """

    cluster: Cluster
    workload: Workload
    options: Options
    dense: tuple[Estimate, ...]
    compressed: Estimate | None
    stack: tuple[StepTime, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)
    nccl: tuple[NcclTime, ...] = ()
    baseline: dict = field(default_factory=dict)
    search: tuple[StepTime, ...] = ()
    best: StepTime | None = None
    verdict: tuple[str, ...] = ()

    def to_json(self) -> dict:
        """Return the plan as a JSON-ready dict (the ``--json`` schema)."""
        w, c = self.workload, self.cluster
        return {
            "cluster": {**asdict(c), "gpus": c.gpus, "nics": c.nic_count,
                        "nics_per_node": c.nic_count, "channels": c.channel_count},
            "workload": {"parameters": w.elements, "tensors": len(w.shapes),
                         "bytes_per_element": w.bytes_per_element, "bytes": w.nbytes,
                         "forward": w.forward, "backward": w.backward},
            "options": {**asdict(self.options), "algorithms": list(self.options.algorithms),
                        "extra_compressors": list(self.options.extra_compressors)},
            "allreduce": [e.to_json() for e in self.dense],
            "compressed": self.compressed.to_json() if self.compressed else None,
            "nccl_model": {"version": NCCL_VERSION, "times": [
                {**asdict(t), "name": t.name} for t in self.nccl]},
            "baseline": self.baseline,
            "stack": [row.to_json() for row in self.stack],
            "search": [row.to_json() for row in self.search],
            "best": self.best.to_json() if self.best else None,
            "notes": list(self.notes),
            "verdict": list(self.verdict),
        }


def _fastest(rows: list[tuple[StepTime, str]]) -> tuple[StepTime, str]:
    """Return the quickest ``(row, algorithm)``: least step, then least communication."""
    return min(rows, key=lambda pair: (pair[0].step, pair[0].comm))


def stacked(row: StepTime, label: str, baseline: StepTime, previous: StepTime) -> StepTime:
    """Return ``row`` labelled, with its speed-up over ``baseline`` and gain over ``previous``."""
    return replace(row, label=label, speedup=baseline.step / row.step if row.step else 1.0,
                   gain=previous.step / row.step if row.step else 1.0)


def _check_in_network(cluster: Cluster, names) -> None:
    for name in names:
        if name not in CHANNELLED and algorithms.get(name).needs_in_network \
                and not cluster.in_network:
            raise UsageError(f"algorithm {name!r} needs in-network reduction (--in-network)")


def baseline_algorithm(cluster: Cluster, nbytes: int):
    """Return the collective that prices NCCL's default for ``nbytes`` (``nccl``: its pick
    among its algorithms and protocols, :mod:`~refcoll.model.nccl_run`), and that pick."""
    if cluster.gpus < 2:
        return _SINGLE_RANK, None
    return "nccl", predict(as_system(cluster), nbytes)


def candidates_for(options: Options, compressor: str | None) -> tuple[str, ...]:
    """Return the algorithms a compressor's pattern can run (all, or one: its own collective)."""
    if compressor is not None and chosen_pattern(compressor, options.pattern) != _ALLREDUCE_PATTERN:
        return options.algorithms[:1]  # the pattern's own collective: one row says it
    return options.algorithms


def _check_compressors(options: Options, workload: Workload) -> None:
    for spec in options.compressors:
        chosen_pattern(spec, options.pattern)
        if needs_shapes(spec) and not workload.layered:
            raise UsageError(f"compressor {spec!r} compresses each tensor as a matrix, so its "
                             f"ratio comes from the layer shapes: give --layers, not --params")


def plan(cluster: Cluster, workload: Workload, options: Options) -> Plan:
    """Price every chosen algorithm, the compressors and overlap, and stack their speed-ups.

    Rows: ``baseline`` (NCCL's default, dense, one bucket); ``+topology`` (the
    fastest chosen algorithm); ``+compression`` (the best of the compressors, with
    the fastest algorithm for its payload when its pattern is an all-reduce);
    ``+overlap`` (that, in ``options.buckets`` buckets). A technique that makes
    the step slower is kept in the stack and said so in ``notes``.
    :func:`~refcoll.model.search.plan_and_search` adds the search.
    """
    _check_in_network(cluster, options.algorithms)
    check_buckets(options.buckets, workload)
    _check_compressors(options, workload)
    elements, itemsize = workload.elements, workload.bytes_per_element
    dense = tuple(allreduce_estimate(cluster, a, elements, itemsize, inter=options.inter)
                  for a in options.algorithms)
    kw = dict(inter=options.inter)
    base_name, choice = baseline_algorithm(cluster, workload.nbytes)
    label = f"baseline (NCCL {choice.name})" if choice else "baseline (one GPU)"
    baseline = step_time(cluster, workload, base_name, label=label, **kw)
    rows, notes = [baseline], []
    topology, _ = _fastest([(step_time(cluster, workload, a, **kw), a)
                            for a in options.algorithms])
    rows.append(stacked(topology, "+topology", baseline, rows[-1]))
    if topology.step > baseline.step:
        notes.append(f"+topology makes the step slower: the fastest algorithm chosen "
                     f"({topology.algorithm}, {human_time(topology.comm)}) is slower than "
                     f"NCCL's default ({baseline.algorithm}, {human_time(baseline.comm)}); "
                     f"add {baseline.algorithm} to --algorithm to stack on it")
    compressed, comp_kw = None, {}
    if options.compressors:
        tried = [(step_time(cluster, workload, a, compressor=spec, pattern=options.pattern,
                            **kw), a)
                 for spec in options.compressors for a in candidates_for(options, spec)]
        with_comp, algorithm = _fastest(tried)
        comp_kw = dict(compressor=with_comp.compressor, pattern=options.pattern)
        compressed = compressed_estimate(cluster, with_comp.compressor, workload.shapes,
                                         workload.dtype, algorithm, pattern=options.pattern,
                                         layered=workload.layered, **kw)
        rows.append(stacked(with_comp, "+compression", baseline, rows[-1]))
        if with_comp.comm > topology.comm:
            notes.append(_slower_note(cluster, compressed, topology, with_comp))
    if options.buckets > 1:
        overlapped, _ = _fastest([(step_time(cluster, workload, a, buckets=options.buckets,
                                             **comp_kw, **kw), a)
                                  for a in candidates_for(options, comp_kw.get("compressor"))])
        rows.append(stacked(overlapped, "+overlap", baseline, rows[-1]))
        if overlapped.step > rows[-2].step:
            notes.append(f"{overlapped.buckets} buckets make the step slower: each bucket's "
                         f"collective pays all its rounds' latency again "
                         f"({human_time(overlapped.comm)} of communication against "
                         f"{human_time(rows[-2].comm)} in one bucket)")
        if overlapped.buckets < options.buckets:
            notes.append(f"layers are not split across buckets: {overlapped.buckets} buckets "
                         f"made of the {options.buckets} asked")
    about = {"algorithm": base_name, "nccl_pick": choice.name if choice else None,
             "nccl_seconds": choice.seconds if choice else None,
             "channels": cluster.channel_count, "rail": cluster.rail}
    return Plan(cluster, workload, options, dense, compressed, tuple(rows), tuple(notes),
                nccl_times(cluster, workload.nbytes), about,
                verdict=allreduce_verdict(cluster, dense))


def _slower_note(cluster: Cluster, compressed: Estimate, dense: StepTime,
                 with_comp: StepTime) -> str:
    p = cluster.gpus
    why = ""
    if compressed.pattern == "gather":
        why = (f": a gathered payload is not reduced on the way, so each GPU receives "
               f"p-1 = {p - 1} payloads of {human_bytes(compressed.payload)} "
               f"({human_bytes((p - 1) * compressed.payload)}) where a ring all-reduce moves "
               f"{human_bytes(2 * (p - 1) * compressed.dense // p)}, and decompresses {p}")
    return (f"compression makes communication slower ({human_time(with_comp.comm)} against "
            f"{human_time(dense.comm)} dense){why}")
