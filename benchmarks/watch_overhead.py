"""Watch mode's cost, and its false alarms, in real training: DDP and FSDP2 on the digits.

Run under either launcher (two processes on this machine's two cores)::

    mpiexec -n 2 python benchmarks/watch_overhead.py --steps 1000
    torchrun --nproc-per-node 2 benchmarks/watch_overhead.py --steps 1000

What runs. examples/ddp_digits.py's training (MLP 64-128-10, 32 rows per rank
per step, DDP with ``bucket_cap_mb=0.0004``: three buckets, so three
all-reduces a step) on two groups of the same processes, in alternating blocks
of ``--block`` steps so that both see the same machine:

* ``gloo``: DDP on a Gloo group, as a user runs it;
* ``watch``: DDP on a ``"refcoll"`` group with ``REFCOLL_WATCH=gloo``,
  ``REFCOLL_WATCH_SAMPLE=k`` and ``REFCOLL_WATCH_BATCH=b``: the same Gloo
  all-reduces, each judged on ``k`` elements (the samples of ``b`` calls in one
  small allgather over refcoll's own Gloo group).

Each group's step time is the median over its steps (forward, backward with
DDP's all-reduces, optimizer step), per rank, the larger of the ranks, and its
CPU time per step (every thread of the process, the busier rank's): where the
ranks share the cores, each watched call's work shows there first. Then,
with ``--fsdp``, FSDP2 (``fully_shard`` per layer and on the root) trains the
same model on a watched group for the same number of steps: its all-gathers
and reduce-scatters (AVG, which watch mode gives Gloo as a SUM and a division)
are judged too. It prints the calls judged and the findings: a false alarm is
any finding at all, since Gloo's results are right.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="steps per group")
    parser.add_argument("--block", type=int, default=20, help="steps per alternating block")
    parser.add_argument("--sample", type=int, default=64, help="REFCOLL_WATCH_SAMPLE")
    parser.add_argument("--batch", type=int, default=1, help="REFCOLL_WATCH_BATCH")
    parser.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from digits_replay import make_model
    from torch.nn.parallel import DistributedDataParallel as DDP

    import refcoll.torch as rt
    from refcoll.training.train import load_digits_split

    torch.set_num_threads(1)
    rt.init_process_group("gloo")
    rank, p = dist.get_rank(), dist.get_world_size()
    os.environ.update(REFCOLL_WATCH="gloo", REFCOLL_WATCH_SAMPLE=str(args.sample),
                      REFCOLL_WATCH_BATCH=str(args.batch))
    watched = dist.new_group(backend="refcoll")
    del os.environ["REFCOLL_WATCH"]
    x_train, y_train = (torch.from_numpy(a) for a in load_digits_split()[:2])
    xs, ys = x_train[rank::p], y_train[rank::p]
    torch.manual_seed(0)
    initial = make_model(xs.shape[1], 128).state_dict()
    runs = {}
    for name, group in (("gloo", dist.group.WORLD), ("watch", watched)):
        model = make_model(xs.shape[1], 128)
        model.load_state_dict(initial)
        ddp = DDP(model, process_group=group, bucket_cap_mb=0.0004)
        runs[name] = (ddp, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), [])

    cpu = {name: 0.0 for name in runs}  # this process's CPU time (every thread) per group

    def step(name: str, k: int) -> None:
        ddp, opt, times = runs[name]
        rows = torch.from_numpy(__import__("numpy").random.default_rng(k).integers(0, len(ys), 32))
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(xs[rows]), ys[rows]).backward()
        opt.step()
        times.append(time.perf_counter() - start)

    done = 0
    while done < args.steps:
        for name in ("gloo", "watch"):
            began = time.process_time()
            for k in range(done, min(done + args.block, args.steps)):
                step(name, k)
            cpu[name] += time.process_time() - began
        done += args.block
    medians = {name: statistics.median(times[args.block:] or times)
               for name, (_, _, times) in runs.items()}
    every = [None] * p
    dist.all_gather_object(every, (medians, cpu))
    worst = {name: max(m[name] for m, _ in every) for name in medians}
    busiest = {name: max(c[name] for _, c in every) / args.steps for name in cpu}
    ddp_judged, ddp_found = watched.watched.calls, len(watched.watched.findings)
    fsdp_line = ""
    if args.fsdp:
        fsdp_line = fsdp(args, initial, xs, ys, watched)
    if rank == 0:
        ratio = worst["watch"] / worst["gloo"]
        print(f"watch overhead: DDP on the digits (examples/ddp_digits.py's model and buckets), "
              f"{p} processes ({rt.launcher()}), {args.steps} steps per group in blocks of "
              f"{args.block}, REFCOLL_WATCH_SAMPLE={args.sample}, "
              f"REFCOLL_WATCH_BATCH={args.batch}")
        if p > (os.cpu_count() or 1):
            print(f"note: {p} processes on {os.cpu_count()} cores: oversubscribed, suspect")
        print(f"  step time, median (largest rank): Gloo {1e6 * worst['gloo']:.0f} us, watched "
              f"{1e6 * worst['watch']:.0f} us: {ratio:.3f}x ({100 * (ratio - 1):+.1f}%)")
        print(f"  CPU time per step, every thread (busiest rank): Gloo "
              f"{1e6 * busiest['gloo']:.0f} us, watched {1e6 * busiest['watch']:.0f} us: "
              f"{busiest['watch'] / busiest['gloo']:.3f}x")
        print(f"  DDP: {ddp_judged} calls watched (the last batch judged at destroy, start-up "
              f"broadcasts included), {ddp_found} findings")
        if fsdp_line:
            print(fsdp_line)
    bad = ddp_found + len(watched.watched.findings)
    dist.destroy_process_group()
    return 1 if bad else 0


def fsdp(args, initial, xs, ys, watched) -> str:
    """Train FSDP2 on the watched group for ``args.steps`` steps; return the line it reports."""
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from digits_replay import make_model
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    before = watched.watched.calls
    model = make_model(xs.shape[1], 128)
    model.load_state_dict(initial)
    mesh = DeviceMesh.from_group(watched, "cpu")
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for k in range(args.steps):
        rows = torch.from_numpy(np.random.default_rng(k).integers(0, len(ys), 32))
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(xs[rows]), ys[rows]).backward()
        opt.step()
    dist.barrier(watched)
    return (f"  FSDP2: {args.steps} steps, {watched.watched.calls - before} all-gathers and "
            f"reduce-scatters watched, {len(watched.watched.findings)} findings")


if __name__ == "__main__":
    sys.exit(main())
