"""FSDP2 on the digits: ``fully_shard`` on refcoll's backend, replayed bit for bit.

Run on three processes with either launcher (they start the same processes)::

    torchrun --nproc-per-node 3 examples/fsdp_digits.py --against gloo
    mpiexec -n 3 python examples/fsdp_digits.py --against gloo

Needs torch and scikit-learn (``pip install 'refcoll[torch,examples]'``).

What runs. A ``64 → 120 (ReLU) → 10`` torch MLP on scikit-learn's digits
(:func:`refcoll.training.train.load_digits_split`); rank ``r`` of ``p`` trains on the
training rows ``r::p``, ``--batch`` rows a step, momentum SGD at a constant
learning rate. Each ``Linear`` is a ``fully_shard`` unit and so is the root
(which holds no parameters of its own), on a one-dimensional CPU mesh over the
default group, which ``--backend`` makes: ``refcoll`` (the default: the
``"refcoll"`` backend of ``import refcoll.torch``, every collective refcoll's)
or ``gloo``. The example sets ``REFCOLL_ALGO=ring`` unless it is set. Seeds
are fixed (the initial weights, each epoch's batch order) and every process
runs one thread.

What FSDP2 reduces. After each unit's backward, FSDP2 (torch 2.13,
``_fsdp_collectives.foreach_reduce``) cuts each parameter's gradient along dim 0
into ``p`` shards of ``⌈d0/p⌉`` rows, the last ones padded with zeros
(``torch._chunk_cat``), and makes row ``r`` of a ``(p, S)`` input of every
parameter's shard ``r``, in the unit's order; one ``reduce_scatter_single`` per
unit gives rank ``r`` row ``r`` of the reduction, its shards' gradients. For
float32 with no divide factor set, ``_get_gradient_divide_factors`` chooses
``ReduceOp.AVG`` with no pre- or post-division, and the refcoll backend runs
``AVG`` as refcoll's ``op="avg"``: the sum in the algorithm's order, then
divided by ``p``. The ``10 × 120`` output layer at three ranks is cut 4, 4, 2
rows (its bias 4, 4, 2): the padding is real.

The bit check (``--check``, on by default; ``--backend refcoll`` with a named
algorithm). Every rank's loss at every step is gathered to rank 0, which trains
again on ``p`` simulated ranks (``digits_replay.replay``): each simulated rank's
forward and backward on the full parameters give the real rank's local
gradients, each unit's reduce-scatter is ``refcoll.simulate("reduce_scatter",
inputs, algorithm="ring", op="avg")`` on inputs in FSDP2's layout, and each
simulated rank's optimizer steps its shards, as a real rank's does. Every loss
must equal the replay's bit for bit, and so must the step-1 sharded gradients
of every rank and the final parameters.

Against Gloo (``--against gloo``). The same training runs again from the same
parameters and batches with FSDP2 on a Gloo group of the same processes. At
step 1 both reduce the same local gradients ``g_r``: refcoll's ``fl(Σ g_r)/p``
is within ``γ_p · Σ_r|g_r| / p`` of the exact mean (a sum of ``p`` terms in any
order errs by at most ``γ_{p-1} Σ|g_r|``, Higham §4.2; the division rounds
once); Gloo's AVG, a sum then a division or a sum of ``fl(g_r · fl(1/p))``, is
within ``γ_{p+1} · Σ_r|g_r| / p``; ``γ_k = k·u/(1-k·u)``, ``u = 2^-24``. So,
elementwise, on every rank's shards,

    |a_refcoll - a_gloo| <= (γ_p + γ_{p+1}) · Σ_r|g_r| / p        (checked: exit 1 if not)

Exit status: 1 if a bit check or the step-1 bound fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

import refcoll
import refcoll.torch as rt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from digits_replay import (  # noqa: E402
    all_true,
    batches,
    bits_equal,
    bound_check,
    digest,
    losses_verdict,
    make_model,
    replay,
    shard_rows,
    start,
    step1_abs_sums,
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="refcoll", choices=("refcoll", "gloo"),
                        help="the default group's backend (default: refcoll)")
    parser.add_argument("--against", default="none", choices=("none", "refcoll", "gloo"),
                        help="train again on a group of this backend; hold step 1 to the bound")
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                        help="replay the training on simulated ranks, bit for bit (default on)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32, help="rows per rank per step")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--hidden", type=int, default=120)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.batch < 1 or args.hidden < 1:
        parser.error("--epochs, --batch and --hidden must be at least 1")
    if not 0 <= args.momentum < 1 or not args.lr > 0:
        parser.error("--lr must be positive and --momentum in [0, 1)")
    if args.against == args.backend:
        parser.error("--against must name another backend than --backend")
    return args


def units_of(model) -> list[list[int]]:
    """Return each fully_shard unit's parameters (indices into ``model.parameters()``), in order."""
    from torch.distributed.fsdp import FSDPModule

    index = {id(q): i for i, q in enumerate(model.parameters())}
    units = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            for group in m._get_fsdp_state()._fsdp_param_groups:
                units.append([index[id(fp.sharded_param)] for fp in group.fsdp_params])
    return units


def train(args, initial, data, group):
    """Train with FSDP2 over ``group``; return this rank's record of the run."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    rank, p = dist.get_rank(group), dist.get_world_size(group)
    mesh = DeviceMesh.from_group(group, "cpu")
    model = make_model(data[0].shape[1], args.hidden)
    model.load_state_dict(initial)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    losses, first = [], None
    dist.barrier(group)  # time the steps alone, not the set-up or a slower rank's start
    start = time.perf_counter()
    for x, y in batches(data, rank, p, args):
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        losses.append(loss.detach().numpy().copy())
        if first is None:
            first = [q.grad.to_local().detach().clone() for q in model.parameters()]
        opt.step()
    seconds = time.perf_counter() - start
    with torch.no_grad():
        accuracy = (model(torch.from_numpy(data[2])).argmax(1).numpy() == data[3]).mean()
        final = [q.full_tensor().detach().clone() for q in model.parameters()]
    return dict(losses=np.array(losses, dtype=np.float32), first=first, final=final,
                units=units_of(model), accuracy=float(accuracy), seconds=seconds,
                sizes=[tuple(q.shape) for q in model.parameters()])


def fsdp_input(grads, p: int):
    """Return FSDP2's reduce-scatter input for one unit: row r = each gradient's shard r, padded."""
    import torch

    rows = []
    for g in grads:
        c = -(-g.shape[0] // p)
        padded = torch.zeros((c * p, *g.shape[1:]), dtype=g.dtype)
        padded[:g.shape[0]] = g
        rows.append(padded.reshape(p, -1))
    return torch.cat(rows, dim=1)


def fsdp_reduce(units, sizes, p: int, algorithm: str, kept: dict):
    """Return the replay's reduction: each unit's reduce-scatter on ``refcoll.simulate``.

    Gives rank r's optimizer its shards' gradients; ``kept[0]`` gets step 1's.
    """
    import torch

    def reduce(step, local):
        out = [[None] * len(sizes) for _ in range(p)]
        for unit in units:
            inputs = [fsdp_input([local[r][i] for i in unit], p).numpy() for r in range(p)]
            sim = refcoll.simulate("reduce_scatter", inputs, algorithm=algorithm,
                                   op="avg").outputs
            for r in range(p):
                at = 0
                for i in unit:
                    d0, rest = sizes[i][0], sizes[i][1:]
                    c, n = -(-d0 // p), -(-d0 // p) * int(np.prod(rest, dtype=np.int64))
                    held = shard_rows(d0, p, r)
                    whole = torch.from_numpy(np.array(sim[r][at:at + n])).view(c, *rest)
                    out[r][i] = whole[:held.stop - held.start].clone()
                    at += n
        if step == 0:
            kept[0] = out
        return out
    return reduce


def bit_check(run, args, initial, data, p: int, algorithm: str):
    """Gather every rank's losses and step-1 shards to rank 0 and replay there; return a verdict."""
    import torch.distributed as dist

    gathered = [None] * p if dist.get_rank() == 0 else None
    dist.gather_object((run["losses"], run["first"]), gathered, dst=0)
    verdict = [None]
    if dist.get_rank() == 0:
        kept = {}
        predicted, model = replay(initial, data, args, p,
                                  fsdp_reduce(run["units"], run["sizes"], p, algorithm, kept),
                                  sharded=True)
        line, ok = losses_verdict([g[0] for g in gathered], predicted)
        bad = [r for r in range(p) if not all(bits_equal(a.numpy(), b.numpy())
                                              for a, b in zip(gathered[r][1], kept[0][r]))]
        line += "; step-1 sharded gradients " + (f"FAIL on ranks {bad}" if bad else "pass")
        same = all(bits_equal(a.numpy(), b.detach().numpy())
                   for a, b in zip(run["final"], model.parameters()))
        line += "; final parameters " + ("pass" if same else "FAIL")
        verdict[0] = (line, ok and not bad and same, digest(predicted))
    dist.broadcast_object_list(verdict, src=0)
    return verdict[0]


def against(main_run, other_run, args, initial, data, p: int):
    """Return the step-1 comparison's line and whether the bound holds on every rank."""
    import torch.distributed as dist

    sums = step1_abs_sums(initial, data, args, p)
    rank = dist.get_rank()
    mine = [s[shard_rows(s.shape[0], p, rank)] for s in sums]
    diff, ratio, holds = bound_check(list(zip(main_run["first"], other_run["first"])), mine, p)
    every = [None] * p
    dist.all_gather_object(every, (diff, ratio))
    holds = all_true(holds)
    diff, ratio = max(e[0] for e in every), max(e[1] for e in every)
    return (f"{args.backend} vs {args.against}, step-1 averaged gradients (every rank's shards): "
            f"max |difference| {diff:.3e}, {'within' if holds else 'OUTSIDE'} the bound "
            f"(γ_p+γ_{{p+1}})·Σ_r|g_r|/p elementwise (worst element at {ratio:.3f} of its "
            "bound)"), holds


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("REFCOLL_ALGO", "ring")
    import torch.distributed as dist

    started = start(args, args.hidden)
    if started is None:
        return 2
    rank, p, data, initial = started
    n_params = sum(v.numel() for v in initial.values())
    world = dist.group.WORLD
    algorithm = getattr(world, "algorithms", {}).get("reduce_scatter")
    run = train(args, initial, data, world)
    every = [None] * p
    dist.all_gather_object(every, run["losses"])
    losses = np.stack(every, axis=1)
    ok, lines, checked = True, [], 0
    if not args.check:
        verdict = "not run (--no-check)"
    elif args.backend != "refcoll":
        verdict = "n/a (Gloo's code: nothing to simulate)"
    elif algorithm in (None, "auto"):
        verdict = "n/a (REFCOLL_ALGO chose auto for reduce_scatter: name an algorithm)"
    else:
        verdict, passed, predicted = bit_check(run, args, initial, data, p, algorithm)
        ok &= passed
        checked += 1
        verdict += f"; replay digest {predicted}"
    if args.against != "none":
        other = train(args, initial, data, dist.new_group(backend=args.against))
        line, holds = against(run, other, args, initial, data, p)
        lines += [line, f"{args.against}: test accuracy {100 * other['accuracy']:.2f}%, losses "
                        f"digest {digest(np.stack(_all(other['losses'], p), axis=1))}"]
        ok &= holds
        checked += 1
    if rank == 0:
        steps = len(run["losses"])
        print(f"FSDP2 on digits: {p} processes ({rt.launcher()}), backend {args.backend}"
              + (f" (reduce_scatter: {algorithm})" if algorithm else "")
              + f", MLP 64-{args.hidden}-10 ({n_params} parameters), {len(run['units'])} "
              f"fully_shard units with parameters, {args.epochs} epochs = {steps} steps of "
              f"{args.batch} rows per rank, lr {args.lr}, momentum {args.momentum}")
        print(f"losses: digest {digest(losses)}, step 1 mean {losses[0].mean():.6f}, "
              f"last step mean {losses[-1].mean():.6f}")
        print(f"test accuracy {100 * run['accuracy']:.2f}%, steps {run['seconds']:.2f} s")
        print(f"bit check (replay on {p} simulated ranks): {verdict}")
        for line in lines:
            print(line)
        print("\nA CHECK FAILED" if not ok else "\nall checks passed" if checked else
              "\nno check ran (the bit check needs --backend refcoll and a named algorithm; "
              "--against compares with another backend)")
    dist.destroy_process_group()
    return 0 if ok else 1


def _all(value, p: int) -> list:
    import torch.distributed as dist

    every = [None] * p
    dist.all_gather_object(every, value)
    return every


if __name__ == "__main__":
    sys.exit(main())
