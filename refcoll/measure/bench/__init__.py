"""The benchmark harness behind ``refcoll bench``: nccl-tests' numbers for refcoll's collectives.

Its modules: :mod:`.config` (what to run: :class:`BenchConfig`, sizes, bus factors),
:mod:`.run` (the timing loop: :func:`run_bench`), :mod:`.replay` (the transport bound:
schedules from the simulator, replayed on bare MPI) and :mod:`.report` (header,
table, CSV, plot; :func:`run_report` runs a whole report), with :mod:`.terminal`
(rank 0's table and progress bar). The MPI library's, NCCL's and Gloo's collectives
are :mod:`refcoll.baselines`'.

For each message size of a sweep (``-b MIN -e MAX -f FACTOR``, as nccl-tests takes
them) every selected algorithm runs ``warmup + iters`` times on preallocated
buffers, interleaved with the MPI library's own collective on the same inputs:
each iteration visits every timed item (our algorithms, the baseline, the
transport bounds) in an order rotated by one per iteration, each after a barrier
of its participants, so all of them see the same machine noise.

What is reported, per size and algorithm (nccl-tests' ``doc/PERFORMANCE.md``):

* ``time``: the maximum over ranks of each rank's median over the timed iterations;
* ``algbw = S / time``, ``S`` the bytes of the whole array: the buffer of an
  all-reduce, broadcast and reduce, the full input of a reduce-scatter, the full
  output of an allgather (so reduce-scatter and allgather round the element count
  down to a multiple of ``n``, as nccl-tests does);
* ``busbw = algbw · factor`` with :func:`~.config.bus_factor`: all-reduce ``2(n-1)/n``,
  in-network all-reduce (``switch``) ``(n-1)/(n+1)`` with ``n`` the workers,
  reduce-scatter and allgather ``(n-1)/n``, broadcast and reduce ``1``;
* ``#wrong``: with checking on, the elements that differ bit for bit from the
  expected result, summed over every iteration (warm-up included) and rank. The
  inputs are ``exact`` (:mod:`refcoll.verify.inputs`: integer-valued floats whose every
  partial result is exact), so the expected result is the naive fold of all
  ranks' inputs, computed once per size, and any correct algorithm matches it
  bit for bit. Before each call the result buffer is filled with the bitwise
  complement of the expected result, so an element left unwritten counts as wrong.
* the baseline (``MPI_Allreduce``, ``MPI_Reduce_scatter_block``, ``MPI_Allgather``,
  ``MPI_Bcast``, ``MPI_Reduce``) time, busbw and ``time/base`` (below 1: refcoll
  is faster). ``avg`` has no MPI op: the baseline runs ``MPI_SUM`` and is not
  checked. Types MPI lacks (bfloat16, float8) have no baseline.
* Gloo's (``against="gloo"``, or in a list: ``"mpi,gloo"`` times both, each
  interleaved with the rest): torch.distributed's ``all_reduce``,
  ``reduce_scatter_tensor``, ``all_gather_into_tensor``, ``broadcast`` and
  ``reduce`` on a Gloo group of the same processes
  (:func:`refcoll.torch.launch.init_process_group`), over the same NumPy buffers
  seen as tensors (``torch.from_numpy``, no copy). ``all_reduce`` and ``reduce``
  work in place: the input is copied into the result buffer before each call,
  after the poisoning and outside the clock (so an element Gloo left unwritten
  would hold this rank's input: wrong wherever the others' inputs are not all
  zero). Its results are checked as MPI's
  are, ``avg`` included (Gloo sums, then divides). Types Gloo lacks (16-bit
  integers, uint32, uint64, float8) and integer averages have no Gloo baseline:
  the header says why (:func:`refcoll.baselines.gloo.gloo_unavailable`).
* on GPUs (``device="gpu"``): the buffers are CuPy arrays on this rank's GPU,
  refcoll's collectives move them as :func:`refcoll.transport.device.device_transport`
  decides (directly through a CUDA-aware MPI, else staged through pinned host
  memory), and every timed call ends by synchronising the current stream, so
  the time is the device's, not the launch's. The baseline is NCCL
  (``against="nccl"``: ``ncclAllReduce``... through ``cupy.cuda.nccl``, one
  process per GPU, the communicator's unique id broadcast over MPI) or the MPI
  library's collective on the device buffers, which needs a CUDA-aware MPI.
  The expected results stay on the host; results are copied there to be
  checked, outside the timed region.
* with ``bound``: the transport bound of each algorithm, the time of the bare
  point-to-point exchanges its schedule needs plus its local reductions (the
  schedule from the simulator's ledger, replayed with nonblocking MPI calls step
  by step on preallocated buffers, see :data:`~.replay.Replay`), and ``time/bound``:
  what the implementation costs beyond its messages and arithmetic.
* with a compressor (all-reduce only): the time, the effective algbw and busbw of
  the dense size, and the bytes this rank put on the wire (largest over ranks).

Timed calls pass ``validate=False``: the argument agreement round trip is a
separate cost, not part of the algorithm's. Roots are rank 0.

JSON (``--json``): ``{"schema": "refcoll-bench/1", "header": {...}, "rows": [...],
"summary": {...}}``. ``header`` describes the run (machine, MPI library and
versions (CuPy's and NCCL's on GPUs), ranks, collective, op, dtype, sizes,
iterations, the baseline, notes; on GPUs ``gpu``: the device and how its
buffers travel, from :func:`refcoll.transport.cuda_aware.device_path`); each row has
the fields of :data:`~.config.ROW_FIELDS` (``None`` where not applicable), the ``base_*``
ones from the first library of ``against``, and ``baselines``: ``library -> {baseline,
time_us, busbw, wrong, checked, time_over}`` for every library that ran (``header``
has ``baselines``: ``[{against, name, available, note}]``); ``summary`` has
``avg_busbw`` per algorithm and for the first baseline, ``baselines`` (each
library's ``name``, ``avg_busbw``, ``wrong``, ``checked``), ``wrong``, ``checked``
(elements compared) and ``passed`` (refcoll's results only). ``--csv`` writes the
rows with the same fields, then ``gloo_time_us``... for each further library.
"""

from __future__ import annotations

from ...core.bits import count_wrong
from .config import (BASELINES, GLOO_BASELINES, LIBRARIES, NCCL_BASELINES, ROW_FIELDS,
                     BenchConfig, array_module, baseline_checked, baseline_name,
                     baseline_unavailable, bus_factor, check_config, element_count, extra_ranks,
                     libraries, parse_size, size_sweep, use_device)
from .replay import Replay, schedule
from .report import (bench_header, format_footer, format_header, format_row, format_table, plot,
                     run_report, save_report, summarize, write_csv)
# The private names are the ones the tests reach for (the timed item, its buffers, the groups).
from .run import _Groups, _Item, _make_data, _reduce_items, run_bench
from .terminal import TableWriter, bar_target, rank_writer

__all__ = [
    "BenchConfig",
    "ROW_FIELDS",
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
