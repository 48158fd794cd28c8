"""What the DDP and FSDP2 digits examples share: the model, the batches, the replay.

The replay trains the examples' MLP again on ``p`` simulated ranks in one
process: each simulated rank ``r`` runs the same forward and backward as the
real rank ``r`` (the same initial parameters, the same batches of its rows
``r::p``, one thread), so its local gradients are the real rank's bit for bit;
the reduction the parallel wrapper performs on them is handed to the caller
(``reduce``: DDP's bucket all-reduce or FSDP2's reduce-scatters, on
``refcoll.simulate``), and the optimizer then runs on the same pieces of the
parameters a real rank's optimizer holds (the whole parameters for DDP, rank
``r``'s shard of each for FSDP2), so its elementwise arithmetic sees tensors of
the same shapes. Every step's losses of every simulated rank are the
prediction the examples hold the real run's losses to, bit for bit.
"""

from __future__ import annotations

import hashlib
import math
import sys

import numpy as np

import refcoll

U = 2.0 ** -24  # float32's unit roundoff


def gamma(k: int) -> float:
    """Return Higham's γ_k = k·u / (1 - k·u) for float32."""
    return k * U / (1 - k * U)


def bits_equal(a, b) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(
        a.view(np.uint8), b.view(np.uint8))


def make_model(n_in: int, hidden: int):
    import torch.nn as nn

    return nn.Sequential(nn.Linear(n_in, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def steps_per_epoch(data, p: int, batch: int) -> int:
    """Return the steps of one epoch: the same on every rank (the smallest rank's rows)."""
    return (len(data[0]) // p) // batch


def rank_rows(data, r: int, p: int):
    """Return rank ``r``'s training rows ``r::p`` as tensors ``(x, y)``."""
    import torch

    return torch.from_numpy(data[0][r::p]), torch.from_numpy(data[1][r::p])


def batches(data, r: int, p: int, args):
    """Yield rank ``r``'s ``(x, y)`` of every step: each epoch its own fixed permutation."""
    import torch

    xs, ys = rank_rows(data, r, p)
    per_epoch = steps_per_epoch(data, p, args.batch)
    for epoch in range(args.epochs):
        order = torch.from_numpy(np.random.default_rng([args.seed, epoch]).permutation(len(ys)))
        for b in range(per_epoch):
            rows = order[b * args.batch:(b + 1) * args.batch]
            yield xs[rows], ys[rows]


def local_grads(model, x, y):
    """Run one forward and backward of ``model``; return ``(loss, [each parameter's gradient])``."""
    import torch.nn.functional as F

    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach().clone(), [q.grad.detach().clone() for q in model.parameters()]


def shard_rows(d0: int, p: int, r: int) -> slice:
    """Return the rows of a dim-0 length ``d0`` rank ``r`` holds: torch.chunk's, ⌈d0/p⌉ each."""
    c = -(-d0 // p)
    return slice(min(r * c, d0), min((r + 1) * c, d0))


def replay(initial, data, args, p: int, reduce, *, sharded: bool):
    """Train on ``p`` simulated ranks; return ``(losses, model)``.

    ``losses`` is a float32 array of shape (steps, p): every simulated rank's loss
    at every step. ``reduce(step, local)`` takes ``local[r][i]``, rank ``r``'s
    gradient of parameter ``i``, and returns the gradients each optimizer sees:
    one list per optimizer, of one gradient per parameter (``sharded``: ``p``
    optimizers, rank ``r``'s holding rows :func:`shard_rows` of every parameter;
    else one, over the whole parameters). ``model`` holds the final parameters.
    """
    import torch

    torch.manual_seed(args.seed)
    model = make_model(data[0].shape[1], args.hidden)
    model.load_state_dict(initial)
    params = list(model.parameters())
    owners = range(p) if sharded else [None]
    owned = [[(q.detach()[shard_rows(q.shape[0], p, r)] if sharded else q.detach()).clone()
              .requires_grad_(True) for q in params] for r in owners]
    opts = [torch.optim.SGD(o, lr=args.lr, momentum=args.momentum) for o in owned]
    streams = [batches(data, r, p, args) for r in range(p)]
    losses = []
    for step, rank_batches in enumerate(zip(*streams)):
        local, row = [], []
        for x, y in rank_batches:
            loss, grads = local_grads(model, x, y)
            row.append(loss.numpy())
            local.append(grads)
        losses.append(row)
        for o, grads, opt in zip(owned, reduce(step, local), opts):
            for t, g in zip(o, grads):
                t.grad = g
            opt.step()
        with torch.no_grad():
            for i, q in enumerate(params):
                q.copy_(torch.cat([o[i].detach() for o in owned]))
    return np.array(losses, dtype=np.float32).reshape(-1, p), model


def losses_verdict(actual, predicted) -> tuple[str, bool]:
    """Compare every rank's loss at every step (``actual[r]``: rank r's) with the replay's."""
    actual = np.stack([np.asarray(a, dtype=np.float32) for a in actual], axis=1)
    if actual.shape != predicted.shape:
        return f"FAIL: {actual.shape} losses against the replay's {predicted.shape}", False
    bad = [(s + 1, r) for s, r in zip(*np.nonzero(actual.view(np.uint32)
                                                  != predicted.view(np.uint32)))]
    if bad:
        s, r = bad[0]
        return (f"FAIL: {len(bad)} of {actual.size} losses differ from the replay, first at step "
                f"{s} rank {r}: {actual[s - 1, r]!r} against {predicted[s - 1, r]!r}"), False
    return f"pass ({actual.shape[0]} steps x {actual.shape[1]} ranks, bit for bit)", True


def digest(losses) -> str:
    """Return a short digest of a float32 loss array's bits (equal runs print equal digests)."""
    return hashlib.sha256(np.ascontiguousarray(losses, dtype=np.float32).tobytes()).hexdigest()[:16]


def step1_abs_sums(initial, data, args, p: int, group=None):
    """Return ``Σ_r |g_r|`` (float64) per parameter at step 1, every rank's local gradients.

    Each rank runs the first step's forward and backward on a plain copy of the
    initial model (the same bits as the wrapped model's local gradients) and the
    absolute values are summed over the ranks.
    """
    import torch.distributed as dist

    model = make_model(data[0].shape[1], args.hidden)
    model.load_state_dict(initial)
    x, y = next(batches(data, dist.get_rank(), p, args))
    _, grads = local_grads(model, x, y)
    out = []
    for g in grads:
        total = g.double().abs()
        dist.all_reduce(total, group=group)
        out.append(total)
    return out


def bound_check(pairs, sums, p: int) -> tuple[float, float, bool]:
    """Return ``(max |a - b|, worst |a - b| / bound, holds)`` over ``(a, b)`` pairs.

    The bound, elementwise: ``(γ_p + γ_{p+1}) · Σ_r|g_r| / p`` (``sums``, matched to the pairs).
    """
    worst_diff, worst_ratio, holds = 0.0, 0.0, True
    for (a, b), s in zip(pairs, sums):
        diff = (a.double() - b.double()).abs()
        bound = (gamma(p) + gamma(p + 1)) * s / p
        if diff.numel():
            worst_diff = max(worst_diff, float(diff.max()))
        if bool((diff > bound).any()):
            holds = False
        elif diff.numel() and float(bound.max()) > 0:
            worst_ratio = max(worst_ratio, float((diff / bound.clamp_min(1e-300)).max()))
    return worst_diff, (worst_ratio if holds else math.inf), holds


def all_true(flag: bool, group=None) -> bool:
    """Return whether ``flag`` is true on every rank."""
    import torch.distributed as dist

    every = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, bool(flag), group=group)
    return all(every)


def split(flat, params):
    """Return ``flat`` cut into one view per parameter, shaped like it (the bucket's layout)."""
    if flat.numel() != sum(p.numel() for p in params):
        raise RuntimeError(f"a bucket of {flat.numel()} elements holds parameters of "
                           f"{sum(p.numel() for p in params)}: not a plain concatenation")
    out, at = [], 0
    for p in params:
        out.append(flat[at:at + p.numel()].view_as(p))
        at += p.numel()
    return out


def ddp_reduce(layouts, p: int, algorithm: str):
    """Return the replay's reduction: DDP's default hook, each bucket on ``refcoll.simulate``.

    DDP's reducer copies each gradient into its bucket multiplied by ``1/p``
    (``at::mul_out`` with a double scalar: ``fl(g · fl(1/p))`` in float32) and
    all-reduces the bucket with ``SUM``.
    """
    import torch

    def reduce(step, local):
        grads = [None] * len(local[0])
        for bucket in layouts[step]:
            inputs = [torch.cat([(local[r][i] * (1.0 / p)).reshape(-1) for i in bucket]).numpy()
                      for r in range(p)]
            sim = refcoll.simulate("allreduce", inputs, algorithm=algorithm, op="sum").outputs
            at = 0
            for i in bucket:
                n = local[0][i].numel()
                grads[i] = torch.from_numpy(np.array(sim[0][at:at + n])).view_as(local[0][i])
                at += n
        return [grads]
    return reduce


def replicas_agree(model) -> bool:
    """Return whether every rank's parameters are bitwise the same (a digest compared)."""
    import torch.distributed as dist

    digest = hashlib.sha256()
    for q in model.parameters():
        digest.update(q.detach().numpy().tobytes())
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, digest.hexdigest())
    return len(set(every)) == 1


def abs_sums(params_and_grads):
    """Return ``Σ_r |g_r|`` per parameter (float64, summed over the ranks), keyed by id."""
    import torch.distributed as dist

    out = {}
    for q, g in params_and_grads:
        total = g.double().abs()
        dist.all_reduce(total)
        out[id(q)] = total
    return out


def start(args, model_hidden: int):
    """Start the group (``args.backend``) and the data; return ``(rank, p, data, initial)``.

    ``None`` (after a message, on every rank alike) when ``--batch`` is more than a
    rank's rows. ``initial`` is the model's state, the same seed on every rank.
    """
    import copy

    import torch
    import torch.distributed as dist

    import refcoll.torch as rt
    from refcoll.training.train import load_digits_split

    torch.set_num_threads(1)  # p processes share the cores; also keeps the local sums fixed
    rt.init_process_group(args.backend)
    rank, p = dist.get_rank(), dist.get_world_size()
    data = load_digits_split()
    if steps_per_epoch(data, p, args.batch) < 1:  # the same on every rank: all stop here
        print(f"rank {rank}: --batch {args.batch} is more than a rank's "
              f"{len(data[0]) // p} training rows", file=sys.stderr)
        dist.destroy_process_group()
        return None
    torch.manual_seed(args.seed)
    return rank, p, data, copy.deepcopy(make_model(data[0].shape[1], model_hidden).state_dict())
