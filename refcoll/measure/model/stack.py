"""The stack: a training step's time with each technique added in turn, and the plan.

Rows: baseline (flat ring, dense, one bucket), then ``+topology`` (the fastest
of the chosen algorithms), ``+compression``, ``+overlap``, each with its step
time (``forward + backward + exposed communication``), communication fraction
and speed-up. :func:`plan` is what ``refcoll model`` prints.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

from ... import algorithms
from ...core.errors import UsageError
from ...core.units import human_bytes, human_time
from .cluster import Cluster, Options, Workload, buckets_of, check_buckets
from .compression import chosen_pattern, compressed_estimate, needs_shapes
from .overlap import StepTime, overlap
from .pricing import Estimate, allreduce_estimate, estimate_name

__all__ = ["step_time", "Plan", "plan"]

#: The compressed pattern that runs an all-reduce algorithm over the payload; the
#: others run their own collective, whatever algorithm is named.
_ALLREDUCE_PATTERN = "allreduce"


def _bucket_estimate(cluster: Cluster, workload: Workload, shapes, algorithm: str, *,
                     compressor: str | None, pattern: str | None, inter: str) -> Estimate:
    if compressor is None:
        count = sum(math.prod(s) for s in shapes)
        return allreduce_estimate(cluster, algorithm, count, workload.bytes_per_element,
                                  inter=inter)
    return compressed_estimate(cluster, compressor, shapes, workload.dtype, algorithm,
                               pattern=pattern, inter=inter)


def step_time(cluster: Cluster, workload: Workload, algorithm: str, *,
              compressor: str | None = None, pattern: str | None = None, buckets: int = 1,
              inter: str = "ring", label: str = "") -> StepTime:
    """Return the modelled step with ``algorithm``, an optional compressor and ``buckets``."""
    cut = buckets_of(workload, buckets)
    comm, seen = [], {}  # buckets of the same shapes (all of a flat count's) cost the same
    for shapes, _ in cut:
        if shapes not in seen:
            seen[shapes] = _bucket_estimate(cluster, workload, shapes, algorithm,
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
    """Everything ``refcoll model`` reports for one cluster, workload and options."""

    cluster: Cluster
    workload: Workload
    options: Options
    dense: tuple[Estimate, ...]
    compressed: Estimate | None
    stack: tuple[StepTime, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)

    def to_json(self) -> dict:
        """Return the plan as a JSON-ready dict (the ``--json`` schema)."""
        w = self.workload
        return {
            "cluster": {**asdict(self.cluster), "gpus": self.cluster.gpus},
            "workload": {"parameters": w.elements, "tensors": len(w.shapes),
                         "bytes_per_element": w.bytes_per_element, "bytes": w.nbytes,
                         "forward": w.forward, "backward": w.backward},
            "options": {**asdict(self.options), "algorithms": list(self.options.algorithms)},
            "allreduce": [e.to_json() for e in self.dense],
            "compressed": self.compressed.to_json() if self.compressed else None,
            "stack": [row.to_json() for row in self.stack],
            "notes": list(self.notes),
        }


def _fastest(rows: list[tuple[StepTime, str]]) -> tuple[StepTime, str]:
    """Return the quickest ``(row, algorithm)``: least step, then least communication."""
    return min(rows, key=lambda pair: (pair[0].step, pair[0].comm))


def _stacked(row: StepTime, label: str, baseline: StepTime, previous: StepTime) -> StepTime:
    return replace(row, label=label, speedup=baseline.step / row.step if row.step else 1.0,
                   gain=previous.step / row.step if row.step else 1.0)


def _check_in_network(cluster: Cluster, names) -> None:
    for name in names:
        if algorithms.get(name).needs_in_network and not cluster.in_network:
            raise UsageError(f"algorithm {name!r} needs in-network reduction (--in-network)")


def plan(cluster: Cluster, workload: Workload, options: Options) -> Plan:
    """Price every chosen algorithm, the compressor and overlap, and stack their speed-ups.

    Rows: ``baseline`` (flat ring, dense, one bucket); ``+topology`` (the
    fastest chosen algorithm); ``+compression`` (the compressor's pattern, with
    the fastest algorithm for its payload when the pattern is an all-reduce);
    ``+overlap`` (that, in ``options.buckets`` buckets). A technique that makes
    the step slower is kept in the stack and said so in ``notes``.
    """
    _check_in_network(cluster, options.algorithms)
    check_buckets(options.buckets, workload)
    candidates = options.algorithms
    comp_kw: dict = {}
    if options.compressor is not None:
        comp_kw = dict(compressor=options.compressor, pattern=options.pattern)
        if chosen_pattern(options.compressor, options.pattern) != _ALLREDUCE_PATTERN:
            candidates = candidates[:1]  # the pattern's own collective: one row says it
        if needs_shapes(options.compressor) and not workload.layered:
            raise UsageError(f"compressor {options.compressor!r} compresses each tensor as a "
                             f"matrix, so its ratio comes from the layer shapes: give --layers, "
                             f"not --params")
    elements, itemsize = workload.elements, workload.bytes_per_element
    dense = tuple(allreduce_estimate(cluster, a, elements, itemsize, inter=options.inter)
                  for a in options.algorithms)
    kw = dict(inter=options.inter)
    baseline = step_time(cluster, workload, "ring", label="baseline (flat ring)", **kw)
    rows, notes = [baseline], []
    topology, _ = _fastest([(step_time(cluster, workload, a, **kw), a)
                            for a in options.algorithms])
    rows.append(_stacked(topology, "+topology", baseline, rows[-1]))
    compressed = None
    if options.compressor is not None:
        with_comp, algorithm = _fastest([(step_time(cluster, workload, a, **comp_kw, **kw), a)
                                         for a in candidates])
        compressed = compressed_estimate(cluster, options.compressor, workload.shapes,
                                         workload.dtype, algorithm, pattern=options.pattern,
                                         **kw)
        rows.append(_stacked(with_comp, "+compression", baseline, rows[-1]))
        if with_comp.comm > topology.comm:
            notes.append(_slower_note(cluster, compressed, topology, with_comp))
    if options.buckets > 1:
        overlapped, _ = _fastest([(step_time(cluster, workload, a, buckets=options.buckets,
                                             **comp_kw, **kw), a) for a in candidates])
        rows.append(_stacked(overlapped, "+overlap", baseline, rows[-1]))
        if overlapped.step > rows[-2].step:
            notes.append(f"{overlapped.buckets} buckets make the step slower: each bucket's "
                         f"collective pays all its rounds' latency again "
                         f"({human_time(overlapped.comm)} of communication against "
                         f"{human_time(rows[-2].comm)} in one bucket)")
        if overlapped.buckets < options.buckets:
            notes.append(f"layers are not split across buckets: {overlapped.buckets} buckets "
                         f"made of the {options.buckets} asked")
    return Plan(cluster, workload, options, dense, compressed, tuple(rows), tuple(notes))


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
