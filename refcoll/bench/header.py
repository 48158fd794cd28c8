"""The description of a ``refcoll bench`` run: machine, libraries, ranks, cores, settings.

:func:`bench_header` captures the run's environment (machine, MPI library and any
algorithm forced on it, versions, the device path on GPUs, auto's calibration,
NCCL's settings) and every rank's process (:func:`rank_info`: pid, host, GPU,
the cores it may run on), from which :func:`oversubscription` says, per host,
whether the ranks outnumber the cores: every figure taken then is suspect, since
ranks wait to be scheduled.
"""

from __future__ import annotations

import os
import platform
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Sequence

import numpy as np

from .. import algorithms
from ..baselines import gloo, nccl
from ..calls import as_transport, device_for
from ..calls.auto import calibration_for
from ..core import topology
from ..core.ops import dtype_name, get_dtype, get_op
from ..core.topology import machine_of
from ..transport import cuda_aware
from ..transport.base import default_timeout
from ..transport.deadline import bounded_barrier, mpi_library_version
from .config import (
    array_module,
    baseline_name,
    baseline_unavailable,
    check_forced_mpi,
    libraries,
    mpi_algorithm,
    op_label,
    rooted,
    use_device,
    variants,
)
from .options import AVERAGE, registry_name
from .tuning import nccl_settings

__all__ = ["bench_header", "rank_info", "oversubscription"]


def rank_info(rank: int, device: int | None = None) -> dict:
    """Return this process's line of nccl-tests' ``Using devices``: pid, host, device, cores.

    ``cores`` are the CPUs this process may run on (``sched_getaffinity``, where
    the system has it; else ``os.cpu_count()``), as a list, so that a host's
    union of them counts what its ranks share.
    """
    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = list(range(os.cpu_count() or 1))
    return {"rank": rank, "pid": os.getpid(), "host": platform.node(), "device": device,
            "cores": cores, "machine": machine_of(platform.node())}


def oversubscription(ranks: Sequence[dict]) -> list[dict]:
    """Return per host ``{host, ranks, cores, oversubscribed}`` from every rank's :func:`rank_info`.

    A host's cores are the union of its ranks' allowed CPUs; it is oversubscribed
    when it runs more ranks than that. The nodes of an emulated cluster are one
    machine (:func:`refcoll.core.topology.machine_of`): their ranks are counted
    against its cores together, though each node alone looks fine.
    """
    hosts: dict[str, dict] = {}
    for info in ranks:
        host = hosts.setdefault(info.get("machine", info["host"]), {"ranks": 0, "cores": set()})
        host["ranks"] += 1
        host["cores"].update(info["cores"])
    return [{"host": name, "ranks": h["ranks"], "cores": len(h["cores"]),
             "oversubscribed": h["ranks"] > len(h["cores"])} for name, h in hosts.items()]


def _package(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _topology() -> dict | None:
    """Return the nodes and links of ``REFCOLL_TOPO_FILE`` for the header (None: unset)."""
    path = os.environ.get(topology.TOPO_ENV, "").strip()
    if not path:
        return None
    found = topology.read(path)
    return {"file": path, **found.to_json()}


def _notes(config, available: list[str], hosts: list[dict]) -> list[str]:
    notes = [
        "timed calls pass validate=False: the argument agreement round trip is not timed",
        "time: each rank's median over the timed "
        + ("iterations" if config.agg == 1 else f"calls ({config.agg} in each iteration)")
        + f", then {AVERAGE[config.average]} (-a {config.average})",
        f"busbw = algbw x nccl-tests' factor for {config.collective}",
    ]
    if config.in_place and config.compressor is None:
        notes.append("in-place: refcoll's call with nccl-tests' in-place layout (out=x; the "
                     "input copied back before each call, untimed); "
                     + ("MPI's with MPI_IN_PLACE" if "mpi" in available
                        else "no library's in-place half"))
    if any(get_op(v.op).name == "avg" for v in variants(config)):
        if "nccl" in available:
            notes.append("avg: NCCL's ncclAvg may scale before summing; the baseline is not "
                         "checked")
        if "mpi" in available:
            notes.append("avg: MPI has no average; the baseline runs MPI_SUM and is not checked")
    if "gloo" in available:
        notes.append("Gloo: torch.distributed's Gloo group of the same processes, on the same "
                     "buffers (torch.from_numpy, no copy); all_reduce and reduce work in place, "
                     "so the input is copied into the result buffer before each call, untimed")
    if "backend" in available:
        notes.append(f"backend: the same torch.distributed calls on a backend=\"refcoll\" group "
                     f"(REFCOLL_ALGO={config.algorithms[0]}): refcoll's schedule over Gloo's "
                     "TCP send/recv, so time/backend against refcoll's own rows (over MPI) "
                     "includes the transport; benchmarks/backend_overhead.py compares it with "
                     "refcoll's direct call over the same Gloo transport")
    if config.device == "gpu":
        notes.append("device time: every timed call ends when the current stream has drained")
    if any(algorithms.get(registry_name(n)).workers is not None for n in config.algorithms):
        notes.append("switch: busbw is the all-reduce's, 2(n-1)/n, n the workers (the ranks "
                     "that hold data)")
    for host in hosts:
        if host["oversubscribed"]:
            notes.append(f"OVERSUBSCRIBED: {host['ranks']} ranks on {host['cores']} cores of "
                         f"{host['host']}: ranks wait to be scheduled, so every figure is "
                         "suspect")
    return notes


def bench_header(comm, config) -> dict:
    """Return the run's description: machine, MPI library, versions, ranks, settings, notes.

    Collective over ``comm``: every rank's process is gathered (``ranks``,
    ``hosts``, ``oversubscribed``), ``auto``'s calibration may be measured here,
    once, and on GPUs each rank's GPU is chosen here, as :func:`run_bench` does.
    ``gpu`` describes the device path (:func:`refcoll.transport.cuda_aware.device_path`:
    the GPU, direct or staged transfers and why) on GPUs, and is None on CPUs.
    """
    from mpi4py import MPI

    workers = config.workers or comm.size
    timeout = default_timeout()
    forced_env = check_forced_mpi(config, comm.rank)  # refused alike on every rank
    device = use_device(comm, config)
    runs = variants(config)
    chosen = libraries(config)
    why = {lib: next((None for v in runs if baseline_unavailable(v, lib) is None),
                     baseline_unavailable(runs[0], lib)) for lib in chosen}
    available = [lib for lib in chosen if why[lib] is None]
    # A bounded MPI_Ibarrier, then the blocking (pickled) allgather of the processes.
    bounded_barrier(comm, "refcoll bench (gathering the ranks' processes)", timeout)
    ranks = comm.allgather(rank_info(comm.rank, device))
    hosts = oversubscription(ranks)
    first = chosen[0] if chosen else None
    forced = mpi_algorithm(config)
    header = {
        "command": "refcoll bench",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"node": platform.node(), "arch": platform.machine(),
                    "system": platform.platform(), "cpus": os.cpu_count(),
                    "processor": MPI.Get_processor_name()},
        "mpi": {"library": mpi_library_version(),
                "standard": "%d.%d" % MPI.Get_version(),
                "algorithm": forced,
                "forced_env": forced_env},
        "versions": {"python": platform.python_version(), "numpy": np.__version__,
                     "mpi4py": _package("mpi4py"), "refcoll": _package("refcoll"),
                     "ml_dtypes": _package("ml_dtypes")},
        "gpu": cuda_aware.device_path() if config.device == "gpu" else None,
        "world": comm.size,
        "workers": workers,
        "ranks": [{k: v for k, v in r.items() if k != "cores"} | {"cores": len(r["cores"])}
                  for r in ranks],
        "hosts": hosts,
        "oversubscribed": any(h["oversubscribed"] for h in hosts),
        "cores": sum(h["cores"] for h in hosts),
        "collective": config.collective,
        "op": op_label(runs[0]) if len(runs) == 1 else str(config.op),
        "dtype": dtype_name(get_dtype(runs[0].dtype)) if len(runs) == 1 else str(config.dtype),
        "variants": [{"dtype": dtype_name(get_dtype(v.dtype)), "op": op_label(v)} for v in runs],
        "root": config.root if rooted(config.collective) else None,
        "average": config.average,
        "in_place": config.in_place and config.compressor is None,
        "algorithms": list(config.algorithms),
        "sizes": list(config.sizes),
        "sweep": list(config.sweep) if config.sweep else None,
        "baseline": baseline_name(config) if first and why[first] is None else None,
        "baseline_note": why[first] if first else "no baseline requested",
        "baselines": [{"against": lib, "name": baseline_name(config, lib),
                       "available": why[lib] is None, "note": why[lib]} for lib in chosen],
        "device": config.device,
        "against": config.against,
        "warmup": config.warmup,
        "iters": config.iters,
        "agg": config.agg,
        "check": bool(config.check),
        "validation": config.check,  # as -c gave it: nccl-tests' header prints it
        "bound": config.bound and config.compressor is None,
        "compressor": config.compressor,
        "validate": False,
        "nccl": nccl_settings(config) if "nccl" in chosen else None,
        "notes": _notes(config, available, hosts),
        "calibration": None,
        "topology": _topology(),
    }
    if "gloo" in chosen:
        header["versions"]["torch"] = gloo.torch_version()
    if config.device == "gpu":
        cupy = array_module("gpu")
        header["versions"]["cupy"] = getattr(cupy, "__version__", None)
        header["versions"]["nccl"] = nccl.nccl_version()
    if any(algorithms.get(registry_name(n)).chooses for n in config.algorithms):
        # MPI has no nonblocking split: a bounded MPI_Ibarrier first.
        bounded_barrier(comm, "refcoll bench (MPI_Comm_split for auto's calibration)", timeout)
        sub = comm.Split(0 if comm.rank < workers else MPI.UNDEFINED, comm.rank)
        if sub != MPI.COMM_NULL:
            # The calibration of the transport the calls run on (device buffers: its wrapper);
            # its messages wait by the transport's deadline.
            template = array_module(config.device).zeros(1, np.uint8)
            cal = calibration_for(device_for(as_transport(sub), template))
            header["calibration"] = {"alpha": cal.alpha, "beta": cal.beta, "gamma": cal.gamma,
                                     "source": cal.source, "inter_alpha": cal.inter_alpha,
                                     "inter_beta": cal.inter_beta, "nodes": cal.nodes,
                                     "per_node": cal.per_node}
            sub.Free()
        # A bounded MPI_Ibarrier (the spare ranks wait here through the calibration),
        # then the blocking (pickled) bcast.
        bounded_barrier(comm, "refcoll bench (sharing auto's calibration)", timeout)
        header["calibration"] = comm.bcast(header["calibration"], root=0)
    return header
