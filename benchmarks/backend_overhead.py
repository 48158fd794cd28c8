"""What the "refcoll" torch backend costs over refcoll's direct call, on the same Gloo transport.

Run under either launcher::

    mpiexec -n 2 python benchmarks/backend_overhead.py
    torchrun --nproc-per-node 2 benchmarks/backend_overhead.py --algorithm rabenseifner

Three all-reduces of the same float32 tensor, interleaved (each iteration runs
the three in a rotated order), at each size from ``--min`` to ``--max``:

* ``direct``: ``refcoll.torch.allreduce(t, group=gloo, algorithm=A, out=t)``:
  refcoll's call over a Gloo group's send/recv (:class:`~refcoll.transport.torch.TorchTransport`);
* ``backend``: ``dist.all_reduce(t, group=refcoll)`` on a ``backend="refcoll"``
  group made with ``REFCOLL_ALGO=A``: the same algorithm over the same kind of
  transport (the group's own Gloo), behind torch's API, its Work and the progress engine;
* ``gloo``: ``dist.all_reduce(t, group=gloo)``: Gloo's own all-reduce.

Every call validates its arguments (the agreement round trip is timed in both
refcoll columns). Each figure is the median over ``--iters`` calls per rank,
then the larger of the ranks; the ratio ``backend/direct`` is of those medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", default="ring")
    parser.add_argument("--min", type=int, default=1 << 20, help="smallest size in bytes")
    parser.add_argument("--max", type=int, default=64 << 20, help="largest size in bytes")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    import refcoll.torch as rt

    torch.set_num_threads(1)
    rt.init_process_group("gloo")
    rank, p = dist.get_rank(), dist.get_world_size()
    os.environ["REFCOLL_ALGO"] = f"allreduce={args.algorithm}"
    backend = dist.new_group(backend="refcoll")
    gloo = dist.group.WORLD
    calls = {
        "direct": lambda t: rt.allreduce(t, group=gloo, algorithm=args.algorithm, out=t),
        "backend": lambda t: dist.all_reduce(t, group=backend),
        "gloo": lambda t: dist.all_reduce(t, group=gloo),
    }
    rows = []
    size = args.min
    while size <= args.max:
        t = torch.ones(size // 4)
        times = {name: [] for name in calls}
        for it in range(args.iters + 2):
            names = list(calls)
            names = names[it % 3:] + names[:it % 3]
            for name in names:
                t.fill_(1.0)
                dist.barrier(gloo)
                start = time.perf_counter()
                calls[name](t)
                if it >= 2:  # two warm-up iterations
                    times[name].append(time.perf_counter() - start)
                assert t[0].item() == p, (name, t[0].item())
        medians = {name: statistics.median(v) for name, v in times.items()}
        every = [None] * p
        dist.all_gather_object(every, medians)
        rows.append((size, {name: max(m[name] for m in every) for name in calls}))
        size *= 4
    if rank == 0:
        print(f"backend overhead: all-reduce of float32, {p} processes ({rt.launcher()}), "
              f"algorithm {args.algorithm}, {args.iters} calls per size, interleaved")
        if p > (os.cpu_count() or 1):
            print(f"note: {p} processes on {os.cpu_count()} cores: oversubscribed, suspect")
        print(f"{'bytes':>10} {'direct us':>11} {'backend us':>11} {'gloo us':>10} "
              f"{'backend/direct':>15} {'backend/gloo':>13}")
        for size, m in rows:
            print(f"{size:>10} {1e6 * m['direct']:>11.0f} {1e6 * m['backend']:>11.0f} "
                  f"{1e6 * m['gloo']:>10.0f} {m['backend'] / m['direct']:>15.3f} "
                  f"{m['backend'] / m['gloo']:>13.3f}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
