"""The conformance battery that ``refcoll verify`` and the tests both run.

Every case runs one collective on every rank of a transport (MPI or simulated)
and checks, on every rank:

* the output has the right shape and dtype, and the input is unchanged (out of
  place) or the result landed in the input (in place);
* integers, ``exact`` float inputs, ``min``/``max``, allgather and broadcast:
  equal to the naive reference (:func:`refcoll.verify.oracle.fold`) bit for bit;
* ``random`` float inputs of ``sum``/``avg``/``prod``: within the summation error
  bound of the exactly computed result, and bit-exact against the simulator's
  prediction for the same algorithm (rank 0 runs the oracle);
* every rank holds bitwise the same all-reduce result;
* no message is left unreceived once every rank has finished.

The modules: :mod:`.cases` (what a case is, the sizes, every case of a
selection), :mod:`.run` (running a case on a transport, each rank's own
checks), :mod:`.judge` (rank 0's verdict, the summary rows), :mod:`.control`
(reports and verdicts between the ranks) and :mod:`.outstanding` (many
non-blocking calls in flight at once). The compressed all-reduce battery is a
tool's, built on these: :mod:`refcoll.compressors.conformance`.
"""

from .cases import LARGE_SIZE, REDUCING, Case, CaseResult, build_cases, case_ranks, default_sizes
from .control import _pack, _unpack
from .judge import group_rows
from .run import run_battery, run_case

__all__ = ["Case", "CaseResult", "build_cases", "case_ranks", "default_sizes", "run_battery",
           "run_case", "group_rows", "LARGE_SIZE", "REDUCING", "_pack", "_unpack"]
