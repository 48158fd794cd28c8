"""The cluster cost model: all-reduce phases, compression and overlap, for runs no one can try.

Everything here is arithmetic on the exact counts of the algorithms' cost
functions (α terms, β bytes, γ elements) and on the compressors' real
``Payload.nbytes``, priced with the links of a described cluster. ``refcoll
model`` prints it; the formulas are in ``spec/model.md``.

* :mod:`~refcoll.model.cluster`: the machine (:class:`Cluster`: nodes of
  GPUs, an intra-node and an inter-node link each, quoted one way or both), the
  gradient (:class:`Workload`), what to try (:class:`Options`), buckets. The
  algorithms priced are the registry's records with ``price``.
* :mod:`~refcoll.model.phases`: :class:`Phase`, :class:`Estimate` and
  the α-β-γ price of a phase on a link.
* :mod:`~refcoll.model.pricing`: each algorithm's ``price`` says which
  phase runs on which link; :func:`allreduce_estimate` puts α, β and the
  reduction rate on them.
* :mod:`~refcoll.model.channels`: NCCL-style collectives, a ring or
  tree per channel, each crossing on its own NIC (``ring/ch``, ``tree/ch``,
  ``dbtree/ch``, ``pat``).
* :mod:`~refcoll.model.nccl`: NCCL's own tuning model (``latency +
  bytes / bandwidth`` with the constants of its ``src/graph/tuning.cc``): the
  comparison rows, and the stack's baseline (what NCCL picks by default).
* :mod:`~refcoll.model.compression`: the compressed patterns, from the
  compressors' real payloads (:func:`compressed_estimate`, :func:`payload_arrays`).
* :mod:`~refcoll.model.overlap`: buckets all-reduced under the backward pass.
* :mod:`~refcoll.model.stack`: the step time with each technique stacked
  (:func:`step_time`, :func:`plan`).
* :mod:`~refcoll.model.search`: the automatic search for the best stack;
  :mod:`~refcoll.model.verdict`: the sentence that says which
  all-reduce wins and why.
* :mod:`~refcoll.model.buckets`: how many buckets, and the cut.
* :mod:`~refcoll.model.calibrate`: the same counts held to measured
  all-reduces on this machine (``refcoll model --calibrate``), with the one
  :class:`~refcoll.core.calibration.Calibration` record.
* :mod:`~refcoll.model.request`: the command's options read from text.

**Limits** (so that no input makes the model run for ever or exhaust memory):
at most :data:`MAX_GPUS` GPUs and from 1 to ``min(parameters, MAX_BUCKETS)``
buckets. Every number must be finite; counts, bandwidths and sizes positive;
times and latencies may be 0. Units follow :mod:`refcoll.core.units`.
"""

from ..core.calibration import Calibration
from ..core.units import (
    BANDWIDTH_UNITS,
    human_bytes,
    human_time,
    parse_bandwidth,
    parse_count,
    parse_duration,
    parse_size,
    parse_sizes,
)
from .calibrate import (
    CALIBRATE_DEFAULT,
    CALIBRATE_LIMIT,
    Comparison,
    calibrate,
    calibration_choices,
    compare_with_measurement,
    measure_allreduce,
    predict,
)
from .channels import CHANNELLED, channelled_phases, pat_cost
from .cluster import (
    ALGORITHMS,
    GPU_ARCHS,
    INTER_ALGORITHMS,
    MAX_BUCKETS,
    MAX_CHANNELS,
    MAX_GPUS,
    MAX_NICS,
    MODELLED,
    PATTERNS,
    Cluster,
    Options,
    Workload,
    bucket_limit,
    buckets_for_size,
    buckets_of,
    check_buckets,
    choices_text,
    load_layers,
    select_algorithms,
)
from .compression import (
    EXACT_LIMIT,
    SAMPLE,
    chosen_pattern,
    compressed_estimate,
    factor_elements,
    needs_shapes,
    payload_arrays,
    powersgd_elements,
)
from .nccl import NCCL_VERSION, PROTOCOLS, NcclTime, nccl_choice, nccl_times
from .overlap import StepTime, overlap
from .pricing import (
    Estimate,
    Phase,
    allreduce_estimate,
    estimate_name,
    local_phase,
    price_phase,
    steps_phase,
)
from .request import (
    PRESETS,
    QUOTED,
    ModelRequest,
    calibration_options,
    calibration_request,
    preset_notes,
    preset_values,
    quoted_links,
)
from .search import bucket_ladder, plan_and_search, search_stacks, stack_verdict, verdict
from .stack import Plan, baseline_algorithm, plan, step_time
from .verdict import allreduce_verdict, step_text

__all__ = [
    "ALGORITHMS",
    "MODELLED",
    "CHANNELLED",
    "GPU_ARCHS",
    "MAX_CHANNELS",
    "MAX_NICS",
    "NCCL_VERSION",
    "PROTOCOLS",
    "PRESETS",
    "QUOTED",
    "PATTERNS",
    "preset_notes",
    "preset_values",
    "NcclTime",
    "nccl_times",
    "nccl_choice",
    "channelled_phases",
    "pat_cost",
    "bucket_ladder",
    "plan_and_search",
    "search_stacks",
    "verdict",
    "step_text",
    "allreduce_verdict",
    "stack_verdict",
    "baseline_algorithm",
    "INTER_ALGORITHMS",
    "EXACT_LIMIT",
    "SAMPLE",
    "MAX_GPUS",
    "MAX_BUCKETS",
    "CALIBRATE_LIMIT",
    "CALIBRATE_DEFAULT",
    "BANDWIDTH_UNITS",
    "Cluster",
    "Workload",
    "Options",
    "Phase",
    "Estimate",
    "StepTime",
    "Plan",
    "price_phase",
    "local_phase",
    "steps_phase",
    "allreduce_estimate",
    "estimate_name",
    "select_algorithms",
    "choices_text",
    "compressed_estimate",
    "payload_arrays",
    "powersgd_elements",
    "factor_elements",
    "chosen_pattern",
    "needs_shapes",
    "buckets_of",
    "bucket_limit",
    "check_buckets",
    "buckets_for_size",
    "overlap",
    "step_time",
    "plan",
    "ModelRequest",
    "quoted_links",
    "calibration_request",
    "calibration_options",
    "calibration_choices",
    "human_time",
    "human_bytes",
    "parse_count",
    "parse_bandwidth",
    "parse_duration",
    "parse_size",
    "parse_sizes",
    "load_layers",
    "Calibration",
    "Comparison",
    "calibrate",
    "predict",
    "measure_allreduce",
    "compare_with_measurement",
]
