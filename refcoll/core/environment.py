"""Every environment variable refcoll reads: the one list, from which the docs draw their table.

Each :class:`Variable` names the variable, what it is when unset, what it does,
who sets it (the user, or refcoll itself for its own processes) and the modules
that read it. The modules read the environment themselves; this list only says
what they read, and ``tests/test_docs.py`` fails when a module reads a
``REFCOLL_`` variable the list lacks, or the list holds one that nothing reads.
The reference page *Environment variables* is generated from it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Variable", "VARIABLES", "by_name"]


@dataclass(frozen=True)
class Variable:
    """One environment variable refcoll reads.

    Attributes:
        name: the variable, ``REFCOLL_...``.
        default: what holds when it is unset, in words.
        effect: what it does, and the values it takes (Markdown, one paragraph).
        readers: the modules that read it (``refcoll.calls.auto``...).
        set_by: ``"user"``, or what in refcoll sets it for the processes it
            starts (such a variable is refcoll's own plumbing: a user sets it
            only to stand in for that launcher).
    """

    name: str
    default: str
    effect: str
    readers: tuple[str, ...]
    set_by: str = "user"


#: Every ``REFCOLL_`` variable the package reads, by topic: collectives, calibration,
#: tracing, launching, PyTorch, emulated clusters.
VARIABLES: tuple[Variable, ...] = (
    Variable(
        "REFCOLL_TIMEOUT", "300 (seconds)",
        "The deadline of every blocking wait, in seconds: past it the rank raises "
        "`CollectiveTimeout` naming the call, the exchange, the peer and the bytes it waited "
        "for. `0`, `none` or `inf` wait forever, and so does a number of seconds too large "
        "for the platform's waits (at or beyond `threading.TIMEOUT_MAX`, about 292 years: "
        "`1e10`, `1e400`); anything else that is not a positive number is a `UsageError`. "
        "Under `backend=\"refcoll\"` it replaces the group's own timeout.",
        ("refcoll.transport.base", "refcoll.transport.sim", "refcoll.torch.backend")),
    Variable(
        "REFCOLL_ABORT_ON_TIMEOUT", "unset (a timeout raises in that rank only)",
        "`1` (`true`, `yes`): a rank whose wait times out prints why and calls `MPI_Abort`, "
        "so the whole job ends with status 3, as PyTorch's NCCL watchdog "
        "(`TORCH_NCCL_ASYNC_ERROR_HANDLING`) does.",
        ("refcoll.transport.deadline",)),
    Variable(
        "REFCOLL_ALGO", "unset (auto picks among all its candidates)",
        "Like `NCCL_ALGO`: the algorithms `auto` may pick, `ring,tree`, or never the excluded "
        "ones, `^recursive_doubling`; per collective `allreduce:ring;reduce_scatter:rabenseifner`. "
        "Calls that name an algorithm are not affected. Under `backend=\"refcoll\"` it is the "
        "algorithm of every collective that has it (`ring`), or one per collective "
        "(`allreduce=ring,allgather=bruck`). `auto` is the same as unset. The ranks agree on "
        "it at their first `auto` call.",
        ("refcoll.calls.auto", "refcoll.torch.backend")),
    Variable(
        "REFCOLL_TUNING_FILE", "unset (auto prices with the cost model)",
        "A tuning file written by `refcoll tune` from `refcoll bench --json` runs: for a call "
        "whose collective, ranks and nodes match one of its tables, and whose size lies within "
        "a factor of 2 of those measured, `auto` runs the algorithm measured fastest at the "
        "nearest size (as MPICH's JSON tuning file). Rank 0 reads it and sends it to the "
        "others; the ranks agree on the name at their first `auto` call.",
        ("refcoll.calls.tuned", "refcoll.calls.auto")),
    Variable(
        "REFCOLL_CALIBRATION", "`cache` (the cached calibration, measured once if none)",
        "Where auto's α, β and γ come from: `cache`; `default` (or `fixed`): fixed values and "
        "never a timing, so auto's choice and every float result's bits depend only on the "
        "collective, p, count and dtype (the simulator always works so); `measure`: measure in "
        "this job, ignoring the cache. The ranks agree on it at their first `auto` call.",
        ("refcoll.calls.calibration",)),
    Variable(
        "REFCOLL_CACHE", "`~/.cache/refcoll`",
        "The folder of `calibration.json`, the calibrations auto chooses by, one per key "
        "(host, MPI library, ranks per node, oversubscription).",
        ("refcoll.calls.calibration",)),
    Variable(
        "REFCOLL_PROGRESS", "unset (the thread where MPI gives `MPI_THREAD_MULTIPLE`)",
        "Which engine progresses non-blocking calls: `thread` (a progress thread per "
        "communicator; needs `MPI_THREAD_MULTIPLE`) or `schedule` (a state machine advanced by "
        "`test()` and `wait()`).",
        ("refcoll.calls.progress",)),
    Variable(
        "REFCOLL_BENCH_BAR", "set by `refcoll bench` for its ranks",
        "Where `refcoll bench`'s ranks draw its progress bar: `stdout:COLUMNS`, "
        "`stderr:COLUMNS`, or empty (no bar). Set by the command that starts `mpiexec`; "
        "under a launcher of your own, unset means rank 0 draws on a terminal it finds.",
        ("refcoll.bench.terminal",)),
    Variable(
        "REFCOLL_DEBUG", "unset (nothing per call)",
        "Like `NCCL_DEBUG`, in any case: `INFO` or `TRACE` write one line per call per rank "
        "when the call completes; `WARN`, `VERSION` and `ABORT` write nothing per call. Any "
        "other value is a `UsageError` at the first collective, on every rank, and a command "
        "that starts `mpiexec` refuses it first (exit 2).",
        ("refcoll.calls.debug",)),
    Variable(
        "REFCOLL_DEBUG_FILE", "unset (the lines go to stderr)",
        "The file the `REFCOLL_DEBUG` lines go to, as `NCCL_DEBUG_FILE`: `%h` the host, `%p` "
        "the process id, `%r` the rank, `%%` a percent sign; `trace.%h.%r` gives a file per "
        "rank.",
        ("refcoll.calls.debug",)),
    Variable(
        "REFCOLL_CUDA_AWARE", "unset (detected)",
        "Whether MPI reads device memory: `1` sends CuPy buffers straight to MPI, `0` stages "
        "them through pinned host buffers. Unset: the library's `MPIX_Query_cuda_support()`, "
        "else a probe in a child process.",
        ("refcoll.transport.cuda_aware",)),
    Variable(
        "REFCOLL_MPIEXEC", "unset (the `mpiexec` beside this Python, then on `PATH`)",
        "The `mpiexec` that commands taking `-n N` start their job with, for a system MPI "
        "instead of the `mpich` wheel's.",
        ("refcoll.cli.launch",)),
    Variable(
        "REFCOLL_WORKERS", "unset (every rank holds data)",
        "How many ranks of the world hold data; the others serve an algorithm that needs "
        "processes of its own (the switches of `switch`).",
        ("refcoll.cli.launch",),
        set_by="`refcoll verify` and `refcoll bench` when they start `mpiexec` with extra "
               "ranks"),
    Variable(
        "REFCOLL_EXIT_NOTES", "unset",
        "A folder where each rank of a job a command started under `mpiexec` notes the "
        "status it exits with, so that the command can tell a rank's own status 1 or 2 "
        "from a rank a signal (SIGHUP, SIGINT) ended, whose status MPICH's mpiexec passes "
        "on as the same number.",
        ("refcoll.cli.launch",),
        set_by="every command that re-runs itself under `mpiexec`"),
    Variable(
        "REFCOLL_WATCH", "unset (the `refcoll` backend runs refcoll's algorithms)",
        "Watch mode of the `refcoll` torch backend: the named backend (`gloo`, `nccl`, any "
        "registered one) does every collective, and refcoll judges a sample of each result.",
        ("refcoll.torch.watch",)),
    Variable(
        "REFCOLL_WATCH_SAMPLE", "64",
        "Elements judged per call in watch mode, the same on every rank, drawn afresh for each "
        "call: 1 to 65536.",
        ("refcoll.torch.watch",)),
    Variable(
        "REFCOLL_WATCH_ACTION", "`raise`",
        "What a wrong result does in watch mode: `raise` a `WrongResult` on every rank from "
        "that call's `wait()`, or `log` one line and go on.",
        ("refcoll.torch.watch",)),
    Variable(
        "REFCOLL_WATCH_BATCH", "1",
        "Calls whose samples travel in one exchange in watch mode (1 to 4096); a wrong call is "
        "raised from the wait of the call that closes its batch.",
        ("refcoll.torch.watch",)),
    Variable(
        "REFCOLL_WATCH_CHECKSUMS", "on",
        "Watch mode's block checksums of every element of float sums and averages "
        "(`refcoll.verify.checksums`); off leaves the sample alone.",
        ("refcoll.torch.watch",)),
    Variable(
        "REFCOLL_TOPO_FILE", "unset (no topology: one level, or the hosts alone)",
        "A topology file (nodes, racks, link rates; `refcoll.core.topology`), as "
        "`NCCL_TOPO_FILE`: auto prices the level across nodes from its slowest link and the "
        "racks' uplinks as a third level, `bench` "
        "names the nodes and links in its header, `model --topology` reads the same form.",
        ("refcoll.core.topology",),
        set_by="`refcoll cluster run` for the emulated cluster; by hand for a real one"),
    Variable(
        "REFCOLL_CLUSTER", "unset (not on an emulated cluster)",
        "The state file of the emulated cluster a process runs on: the ranks of every node "
        "count against the one machine's cores.",
        ("refcoll.core.topology",),
        set_by="`refcoll cluster run`"),
    Variable(
        "REFCOLL_CLUSTER_DIR", "`/run/refcoll/clusters`",
        "Where `refcoll cluster` keeps the state of the emulated clusters it made. refcoll "
        "acts only on a real folder (not a link) that no one but root, or the user running "
        "refcoll, can write, and only on state files there of that owner, mode without "
        "group or other write, that name its own pattern of namespaces "
        "([Files from others](../guides/files.md)).",
        ("refcoll.cluster.emulate",)),
    Variable(
        "REFCOLL_CLUSTER_JOB", "unset (not a process of `refcoll cluster run`)",
        "Marks the processes of one `refcoll cluster run`: when the run ends, what it left "
        "running in the cluster's namespaces, and only that, is killed, so another run on "
        "the same cluster goes on.",
        ("refcoll.cluster.emulate",),
        set_by="`refcoll cluster run`"),
)


def by_name() -> dict[str, Variable]:
    """Return :data:`VARIABLES` keyed by name."""
    return {v.name: v for v in VARIABLES}
