"""The benchmark harness behind ``refcoll bench``: nccl-tests' numbers for refcoll's collectives.

Its modules: :mod:`.config` (what to run: :class:`BenchConfig`, sizes, bus factors, the
baselines, the MPI library's forced algorithm), :mod:`.options` (nccl-tests' names
for types and ops, ``all``, ``-a``, ``--against mpi:ALGO``), :mod:`.data` (each size's
buffers, out of place and in place, and the calls on them), :mod:`.run` (the timing
loop: :func:`run_bench`), :mod:`.rows` (every rank's timings into rows), :mod:`.replay`
(the transport bound: schedules from the simulator, replayed on bare MPI),
:mod:`.header` (:func:`bench_header`: machine, libraries, ranks and cores),
:mod:`.report` (table, footer, CSV, plot; :func:`run_report` runs a whole report),
:mod:`.nccl_tests` (nccl-tests' printed layout), :mod:`.tuning` (what NCCL chose,
from its TUNING log) and :mod:`.terminal` (rank 0's table and progress bar). The
MPI library's, NCCL's and Gloo's collectives are :mod:`refcoll.baselines`'.

For each message size of a sweep (``-b MIN -e MAX -f FACTOR``, as nccl-tests takes
them; sizes read by :func:`refcoll.core.units.parse_size`: ``K M G T`` and ``KiB``...
are powers of 1024, ``kB MB GB TB`` of 1000), and for each type and op (``-d``,
``-o``, each may be ``all``), every selected algorithm runs ``warmup + iters``
times on preallocated buffers, out of place and in place, interleaved with the
MPI library's own collective on the same inputs (out of place and with
``MPI_IN_PLACE``): each iteration visits every timed item in an order rotated by
one per iteration, each after a barrier of its participants, so all of them see
the same machine noise. With ``-m M`` (nccl-tests' aggregated iterations) a timed
iteration makes each item's call M times back to back, after one barrier: a call
then meets the network as the call before it left it, as in a training loop's
stream of all-reduces, and each of the M calls is one timed sample.

What is reported, per size and algorithm (nccl-tests' ``doc/PERFORMANCE.md``), for
each half, as nccl-tests' row ``size count type redop root | time algbw busbw
#wrong | time algbw busbw #wrong`` (the root of broadcast and reduce, -1 otherwise):

* ``time``: each rank's median over the timed iterations, then over the ranks as
  nccl-tests' ``-a`` says: 0 rank 0's, 1 the mean, 2 the smallest, 3 the largest
  (refcoll's default, the slowest rank; nccl-tests' is 1); every rank's median is
  kept in the JSON (``rank_times_us``);
* ``algbw = S / time``, ``S`` the bytes of the whole array: the buffer of an
  all-reduce, broadcast and reduce, the full input of a reduce-scatter, the full
  output of an allgather (so reduce-scatter and allgather trim each rank's chunk
  to a whole number of 16-byte words, as nccl-tests does: the size column is the
  whole array, the count column one rank's chunk, nccl-tests' ``paramcount``;
  the JSON's ``count`` stays the whole array's elements);
* ``busbw = algbw · factor`` with :func:`~.config.bus_factor`: all-reduce ``2(n-1)/n``
  (in-network too, ``switch``, with ``n`` the workers, as nccl-tests prices NVLS and
  CollNet), reduce-scatter and allgather ``(n-1)/n``, broadcast and reduce ``1``;
* ``#wrong``: with checking on, the elements that differ bit for bit from the
  expected result, summed over every iteration (warm-up included) and rank;
  ``N/A`` with ``-c 0``, as nccl-tests prints it. The inputs are ``exact``
  (:mod:`refcoll.verify.inputs`: integer-valued floats whose every partial result
  is exact), so the expected result is the naive fold of all ranks' inputs,
  computed once per size, and any correct algorithm matches it bit for bit.
  Before each out-of-place call the result buffer is filled with the bitwise
  complement of the expected result, so an element left unwritten counts as
  wrong; before each in-place call the input is copied back into the buffer (an
  element left unwritten then holds this rank's input).
* in place: nccl-tests' layouts (``src/common.cu``): ``out=x`` for all-reduce,
  broadcast and reduce; ``out=`` this rank's chunk of the input for
  reduce-scatter; ``x`` this rank's row of ``out`` for allgather
  (:mod:`.data`). MPI's in-place half uses ``MPI_IN_PLACE``; NCCL's and Gloo's
  rows have no in-place half.
* the baselines (``MPI_Allreduce``, ``MPI_Reduce_scatter_block``, ``MPI_Allgather``,
  ``MPI_Bcast``, ``MPI_Reduce``; ``MPI_Allreduce[ring]`` with ``--against
  mpi:ring``, which forces the MPI library's algorithm through its environment,
  :mod:`refcoll.baselines.mpi_algorithms`) time, busbw and ``time/base`` (below 1:
  refcoll is faster). ``avg`` has no MPI op: the baseline runs ``MPI_SUM`` and is
  not checked. Types MPI lacks (bfloat16, float8) have no baseline.
* Gloo's (``against="gloo"``, or in a list: ``"mpi,gloo"`` times both, each
  interleaved with the rest): torch.distributed's ``all_reduce``,
  ``reduce_scatter_tensor``, ``all_gather_into_tensor``, ``broadcast`` and
  ``reduce`` on a Gloo group of the same processes
  (:func:`refcoll.torch.launch.init_process_group`), over the same NumPy buffers
  seen as tensors (``torch.from_numpy``, no copy). ``all_reduce`` and ``reduce``
  work in place: the input is copied into the result buffer before each call,
  after the poisoning and outside the clock. Its results are checked as MPI's
  are, ``avg`` included (Gloo sums, then divides). Types Gloo lacks (16-bit
  integers, uint32, uint64, float8) and integer averages have no Gloo baseline:
  the header says why (:func:`refcoll.baselines.gloo.gloo_unavailable`).
* on GPUs (``device="gpu"``): the buffers are CuPy arrays on this rank's GPU,
  refcoll's collectives move them as :func:`refcoll.transport.device.device_transport`
  decides (directly through a CUDA-aware MPI, else staged through pinned host
  memory), and every timed call ends by synchronising the current stream, so
  the time is the device's, not the launch's. The baseline is NCCL
  (``against="nccl"``: ``ncclAllReduce``... through ``cupy.cuda.nccl``, one
  process per GPU, the communicator's unique id broadcast over MPI), with
  ``NCCL_ALGO``/``NCCL_PROTO`` passed through and what NCCL chose at each size
  read from its TUNING log (:mod:`.tuning`), or the MPI library's collective on
  the device buffers, which needs a CUDA-aware MPI. The expected results stay on
  the host; results are copied there to be checked, outside the timed region.
* with ``bound``: the transport bound of each algorithm, the time of the bare
  point-to-point exchanges its schedule needs plus its local reductions (the
  schedule from the simulator's ledger, replayed with nonblocking MPI calls step
  by step on preallocated buffers, see :data:`~.replay.Replay`), and ``time/bound``:
  what the implementation costs beyond its messages and arithmetic.
* with a compressor (all-reduce only): the time, the effective algbw and busbw of
  the dense size, and the bytes this rank put on the wire (largest over ranks);
  no in-place half. ``#wrong`` counts the elements whose bits differ from the
  first rank's result (lossy by design, but the same on every rank).

The footer is nccl-tests': ``# Out of bounds values : N OK|FAILED`` (the results,
one per row, half and rank, with a wrong element) and ``# Avg bus bandwidth    : X``,
the mean busbw over every row and both halves of the algorithm under test (the
first of ``algorithms``); each other algorithm and each baseline has a line of its
own. The header says, per host, how many ranks share how many cores, and when
they outnumber them (every figure is then suspect).

Timed calls pass ``validate=False``: the argument agreement round trip is a
separate cost, not part of the algorithm's.

JSON (``--json``): ``{"schema": "refcoll-bench/1", "header": {...}, "rows": [...],
"summary": {...}}``. ``header`` describes the run (machine, MPI library and
versions (CuPy's and NCCL's on GPUs), ``mpi.algorithm`` and ``mpi.forced_env``,
``world``, ``workers``, ``ranks`` (each rank's pid, host, device and cores),
``hosts`` (ranks and cores per host), ``oversubscribed``, collective, op, dtype,
``variants``, ``root``, ``average``, ``in_place``, sizes, iterations, the
baseline, ``nccl`` (algorithm and protocol in force), notes; on GPUs ``gpu``: the
device and how its buffers travel, from :func:`refcoll.transport.cuda_aware.device_path`);
each row has the fields of :data:`~.config.ROW_FIELDS` (``None`` where not
applicable: the out-of-place half, the ``inplace_*`` half, the ``base_*`` ones
from the first library of ``against``, ``nccl_algo``/``nccl_proto``/``nccl_channels``),
``rank_times_us`` and ``inplace_rank_times_us`` (every rank's median, None where a
rank sat out), ``wrong_ranks`` and ``inplace_wrong_ranks``, and ``baselines``:
``library -> {baseline, time_us, busbw, wrong, checked, time_over, rank_times_us,
inplace_time_us, inplace_busbw, inplace_wrong, inplace_checked,
inplace_rank_times_us}`` for every library that ran (``header`` has ``baselines``:
``[{against, name, available, note}]``); ``summary`` has ``avg_busbw`` per
algorithm (both halves), ``algorithm`` and ``under_test_avg_busbw`` (the
footer's figure), ``base_avg_busbw`` for the first baseline, ``baselines`` (each
library's ``name``, ``avg_busbw``, ``wrong``, ``checked``), ``wrong``, ``checked``
(elements compared, both halves), ``out_of_bounds`` and ``passed`` (refcoll's
results only). ``--csv`` writes the rows with the fields of :data:`~.config.ROW_FIELDS`,
then ``gloo_time_us``... for each further library.
"""

from __future__ import annotations

from ..core.bits import count_wrong
from .config import (
    BASELINES,
    GLOO_BASELINES,
    LIBRARIES,
    NCCL_BASELINES,
    ROW_FIELDS,
    SIZE_RULE,
    BenchConfig,
    array_module,
    baseline_checked,
    baseline_name,
    baseline_unavailable,
    bus_factor,
    check_config,
    element_count,
    forced_mpi_env,
    libraries,
    mpi_algorithm,
    parse_size,
    size_sweep,
    use_device,
    variants,
)
from .header import bench_header, oversubscription, rank_info
from .options import AVERAGE, NCCL_TESTS_TYPES, extra_ranks, over_ranks, parse_dtypes, parse_ops
from .replay import Replay, schedule
from .report import (
    FORMATS,
    format_footer,
    format_header,
    format_row,
    format_table,
    plot,
    run_report,
    save_report,
    summarize,
    write_csv,
)

# The private names are the ones the tests reach for (the timed item, its buffers, the groups).
from .run import _Groups, _Item, _make_data, _reduce_items, run_bench  # noqa: F401 - re-exported for tests
from .terminal import TableWriter, bar_target, rank_writer
from .tuning import NcclLog

__all__ = [
    "BenchConfig",
    "ROW_FIELDS",
    "SIZE_RULE",
    "FORMATS",
    "AVERAGE",
    "NCCL_TESTS_TYPES",
    "parse_dtypes",
    "parse_ops",
    "over_ranks",
    "variants",
    "mpi_algorithm",
    "forced_mpi_env",
    "oversubscription",
    "rank_info",
    "NcclLog",
    "BASELINES",
    "parse_size",
    "size_sweep",
    "bus_factor",
    "element_count",
    "count_wrong",
    "NCCL_BASELINES",
    "GLOO_BASELINES",
    "LIBRARIES",
    "libraries",
    "baseline_checked",
    "array_module",
    "use_device",
    "check_config",
    "baseline_name",
    "baseline_unavailable",
    "extra_ranks",
    "schedule",
    "Replay",
    "run_bench",
    "run_report",
    "save_report",
    "bench_header",
    "summarize",
    "format_header",
    "format_row",
    "format_footer",
    "format_table",
    "write_csv",
    "plot",
    "bar_target",
    "TableWriter",
    "rank_writer",
]
