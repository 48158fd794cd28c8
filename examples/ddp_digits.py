"""DistributedDataParallel on the digits: DDP's own all-reduce beside refcoll's comm hooks.

Run on four processes with either launcher (they start the same processes)::

    torchrun --nproc-per-node 4 examples/ddp_digits.py
    mpiexec -n 4 python examples/ddp_digits.py
    mpiexec -n 3 python examples/ddp_digits.py --backend refcoll    # refcoll's backend

Needs torch and scikit-learn (``pip install 'refcoll[torch,examples]'``).

What runs. A ``64 → 128 (ReLU) → 10`` torch MLP on scikit-learn's digits, split
as ``refcoll train`` splits them (:func:`refcoll.training.train.load_digits_split`); rank
``r`` of ``p`` trains on the training rows ``r::p``, ``--batch`` rows a step,
momentum SGD at a constant learning rate, wrapped in
``torch.nn.parallel.DistributedDataParallel`` on the Gloo backend. DDP closes
a bucket once it holds ``bucket_cap_mb`` or more, so the default 0.0004 MB
(419 bytes) sends this model's four tensors in three buckets (after DDP's
rebuild: ``[b2, W2]``, ``[b1]``, ``[W1]``; step 1 runs in the one bucket DDP
starts with, so the last step's check also covers the hook carrying each
parameter's compressor state into the rebuilt buckets). Seeds are fixed: the initial weights
(``torch.manual_seed``), each epoch's batch order, the compressors'. ``--hook`` picks
the gradient all-reduce; ``all`` (the default) runs each in turn from the same
initial parameters and the same batches:

* ``default``: no hook registered: DDP's own (Gloo's) all-reduce.
* ``ring``: ``refcoll.torch.comm_hook(algorithm="ring")``.
* ``ef(topk:ratio=0.01)``, ``powersgd:rank=2``: ``comm_hook(algorithm="ring",
  compressor=...)``.

What it reports, per hook:

* test accuracy of the trained model (every rank's replica is checked to be
  bitwise the same first);
* bytes sent per rank per step: for refcoll's hooks, measured
  (``HookState.sent``: every byte the hook's calls put on the wire, argument
  agreement included, divided by the steps, averaged over the ranks); for DDP's
  default hook nothing is measured: the figure is *modelled* as a ring
  all-reduce of the whole gradient, ``2(p-1)/p × 4 bytes × parameters``;
* the bit check of the last step: every rank's bucket inputs (the undivided
  local gradients, ``HookState(record=True).last``) are gathered to rank 0 and
  all-reduced there again on simulated ranks; every rank's averaged bucket must
  equal that bit for bit, and so must the gradients DDP left in the parameters.
  For ``ring`` the oracle is ``refcoll.simulate("allreduce", inputs,
  algorithm="ring", op="avg")``. A compressed hook's call carries a
  per-rank ``CompressorState`` from earlier steps (the error-feedback residual,
  PowerSGD's warm-start ``Q``), and ``refcoll.simulate`` hands one set of
  keyword arguments to every simulated rank, so it cannot give each rank its own
  state (without one ``ef(...)`` is refused and PowerSGD starts from a fresh
  ``Q``). Each rank's hook state is therefore copied just before the last step,
  gathered with the inputs and the buckets' layouts, and the hook's own
  reduction of a bucket (``refcoll.torch.hooks.average``: the compressed
  all-reduce of the bucket, or of each parameter's view in its shape for
  PowerSGD) runs on a ``refcoll.SimWorld`` of ``p`` ranks, the world
  ``refcoll.simulate`` runs on. On Gloo, DDP's default hook is Gloo's code,
  not refcoll's: nothing to simulate (``refcoll verify --backend torch`` judges it).

On refcoll's backend (``--backend refcoll``; the example sets
``REFCOLL_ALGO=ring`` unless it is set) every collective of the job is
refcoll's, DDP's own all-reduce in the ``default`` row included, unmodified:
DDP's reducer copies each local gradient into its bucket times ``1/p``
(``fl(g_r · fl(1/p))``) and all-reduces the bucket with ``SUM``. That row's
check covers every step: rank 0 gathers every rank's losses and each step's
buckets (``ddp.reducer._get_zeros_like_grad_buckets()`` after the forward
pass, so after DDP's rebuild at step 2) and trains again on ``p`` simulated
ranks (``digits_replay.replay``), each bucket ``refcoll.simulate("allreduce",
[fl(g_r/p) concatenated], algorithm="ring", op="sum")``; every rank's every
loss and the final parameters must match bit for bit. ``--against gloo`` (the
default there) trains the ``default`` row again on a Gloo group of the same
processes (``default@gloo``) and holds its step-1 gradients to the bound below:
both are ``fl(Σ fl(g_r·fl(1/p)))`` in two orders, which differ by at most
``2γ_{p-1}(1+γ_2)·Σ_r|g_r|/p``, less than it.

Ring against default (with ``all``). The two runs start from the same
parameters and batches, so at step 1 every rank's local gradients ``g_r`` are
bitwise the same in both, and the two averaged gradients are two floating-point
sums of the same ``p`` numbers and a scaling: refcoll's ``fl(Σ g_r)/p`` and DDP's
``fl(Σ fl(g_r · fl(1/p)))``. refcoll's is within ``γ_p · Σ_r|g_r| / p`` of the
exact mean (any summation order of ``p`` terms errs by at most ``γ_{p-1} Σ|g_r|``,
Higham, *Accuracy and Stability of Numerical Algorithms*, §4.2; the division
adds one rounding), DDP's within ``γ_{p+1} · Σ_r|g_r| / p`` (``fl(1/p)`` and the
product round once each; for ``p`` a power of two both are exact),
``γ_k = k·u/(1-k·u)``, ``u = 2^-24``. So, elementwise,

    |a_ring - a_default| <= (γ_p + γ_{p+1}) · Σ_r|g_r| / p        (checked: exit 1 if not)

After step 1 the runs evaluate their gradients at (slightly) different
parameters, and no bound on the final parameters follows without the training
map's Lipschitz constant. The final parameters' ``max |w_ring - w_default|`` is
printed beside the step-1 bound propagated through the updates as if the
gradients did not depend on the parameters, ``lr/(1-μ) · Σ_s (γ_p + γ_{p+1}) Σ_r|g_{r,s}|/p``:
a first-order estimate of the scale, reported, not a check.

Exit status: 1 if a bit check, a replica check or a step-1 bound fails.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time

import numpy as np

import refcoll
import refcoll.torch as rt

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from digits_replay import (  # noqa: E402
    abs_sums,
    all_true,
    batches,
    bits_equal,
    bound_check,
    ddp_reduce,
    digest,
    gamma,
    losses_verdict,
    make_model,
    replay,
    replicas_agree,
    split,
    start,
    step1_abs_sums,
    steps_per_epoch,
)

#: ``--hook`` choices: ``None`` is DDP's default (no hook); otherwise (algorithm, compressor)
#: for :func:`refcoll.torch.comm_hook`. Every refcoll hook reduces with the ring.
HOOKS = {"default": None, "ring": ("ring", None),
         "ef(topk:ratio=0.01)": ("ring", "ef(topk:ratio=0.01)"),
         "powersgd:rank=2": ("ring", "powersgd:rank=2")}
PLAIN = "ring"  # the uncompressed refcoll hook, compared with DDP's default

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hook", default="all", choices=(*HOOKS, "all"),
                        help="the gradient all-reduce to train with (default: all, in turn)")
    parser.add_argument("--backend", default="gloo", choices=("gloo", "refcoll"),
                        help="the default group's backend (default: gloo)")
    parser.add_argument("--against", choices=("none", "gloo"),
                        help="with --backend refcoll, train the default hook again on a Gloo "
                             "group and hold step 1 to the bound (default: gloo there)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32, help="rows per rank per step")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--bucket-cap-mb", type=float, default=0.0004,
                        help="DDP's bucket size limit (small: several buckets)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.epochs < 1 or args.batch < 1 or args.hidden < 1:
        parser.error("--epochs, --batch and --hidden must be at least 1")
    if not 0 <= args.momentum < 1 or not args.lr > 0:
        parser.error("--lr must be positive and --momentum in [0, 1)")
    if args.against is None:
        args.against = "gloo" if args.backend == "refcoll" else "none"
    if args.against != "none" and args.backend == "gloo":
        parser.error("--against gloo needs --backend refcoll")
    return args


class Recorder:
    """A comm hook around :func:`refcoll.torch.refcoll_hook` that keeps what the checks need.

    At step 1 it keeps each bucket's parameters and undivided local gradients
    (for ``Σ_r|g_r|``); at every step it adds ``|g|`` per parameter (for the
    accumulated estimate); at the last step it keeps each bucket's parameters
    and layouts and, for a compressor, a copy of the hook's state before the step.
    """

    def __init__(self, last_step: int):
        self.step = 0
        self.last_step = last_step
        self.first = {}   # bucket index -> (params, local gradients) at step 1
        self.params = {}  # bucket index -> params at the last step
        self.layouts = {}  # bucket index -> the bucket's layout at the last step
        self.before = None  # a copy of the HookState before the last step (compressors)
        self.abs_sum = {}  # id(param) -> Σ_s |g_s| of this rank, float64

    def hook(self, state, bucket):
        index, params, buffer = bucket.index(), bucket.parameters(), bucket.buffer()
        local = buffer.detach().clone()  # read before the hook's call changes it in place
        for p, g in zip(params, split(local, params)):
            self.abs_sum[id(p)] = self.abs_sum.get(id(p), 0) + g.double().abs()
        if self.step == 1:
            self.first[index] = (params, local)
        if self.step == self.last_step:
            self.params[index] = params
            self.layouts[index] = rt.hooks.bucket_layout(bucket)
            if state.compressor is not None and self.before is None:
                # Every compressor state as the last step finds it: the first bucket of
                # the step comes first, and the hook's earlier calls have all finished
                # (DDP waited for them before the optimizer step).
                self.before = copy.deepcopy(state)
        return rt.refcoll_hook(state, bucket)


def train_one(name, args, initial, data, group=None, layouts=False):
    """Train with hook ``name`` from ``initial`` over ``group``; return this rank's record.

    ``layouts``: keep each step's buckets (parameter indices, as DDP's reducer
    holds them once the forward pass has run: after its rebuild at step 2).
    """
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, p = dist.get_rank(group), dist.get_world_size(group)
    total = steps_per_epoch(data, p, args.batch) * args.epochs
    model = make_model(data[0].shape[1], args.hidden)
    model.load_state_dict(initial)
    ddp = DDP(model, bucket_cap_mb=args.bucket_cap_mb, process_group=group)
    index = {id(q): i for i, q in enumerate(model.parameters())}
    recorder, state, losses, steps = Recorder(total), None, [], []
    if HOOKS[name] is not None:
        algorithm, compressor = HOOKS[name]
        state, _ = rt.comm_hook(algorithm=algorithm, compressor=compressor, seed=args.seed,
                                record=True)
        ddp.register_comm_hook(state, recorder.hook)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    first_grads, grads_used = None, True
    dist.barrier(group)  # time the steps alone, not DDP's set-up or a slower rank's start
    start = time.perf_counter()
    for x, y in batches(data, rank, p, args):
        recorder.step += 1
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x), y)
        if layouts:
            buckets = ddp.reducer._get_zeros_like_grad_buckets()
            steps.append([[index[id(q)] for q in b.parameters()] for b in buckets])
            if any(b.buffer().numel() != sum(q.numel() for q in b.parameters())
                   for b in buckets):
                raise RuntimeError("a DDP bucket is not a plain concatenation of its parameters")
        loss.backward()
        losses.append(loss.detach().numpy().copy())
        if recorder.step == 1:
            first_grads = [q.grad.clone() for q in model.parameters()]
        if recorder.step == total and state is not None:  # DDP used the hook's output
            for i, params in recorder.params.items():
                out = np.concatenate([q.grad.numpy().reshape(-1) for q in params])
                grads_used &= bits_equal(out, state.last[i][1])
        opt.step()
    seconds = time.perf_counter() - start
    with torch.no_grad():
        accuracy = (model(torch.from_numpy(data[2])).argmax(1).numpy() == data[3]).mean()
    return dict(name=name, state=state, recorder=recorder, model=model, steps=total,
                accuracy=float(accuracy), first_grads=first_grads, grads_used=grads_used,
                seconds=seconds, losses=np.array(losses, dtype=np.float32), layouts=steps)


def default_bit_check(run, args, initial, data, p: int, algorithm: str):
    """DDP's own all-reduce on the refcoll backend: every step's losses against the replay."""
    import torch.distributed as dist

    gathered = [None] * p if dist.get_rank() == 0 else None
    dist.gather_object((run["losses"], run["layouts"]), gathered, dst=0)
    verdict = [None]
    if dist.get_rank() == 0:
        if any(g[1] != gathered[0][1] for g in gathered):
            verdict[0] = ("FAIL: the ranks' buckets differ", False)
        else:
            predicted, model = replay(initial, data, args, p,
                                      ddp_reduce(gathered[0][1], p, algorithm), sharded=False)
            line, ok = losses_verdict([g[0] for g in gathered], predicted)
            same = all(bits_equal(a.detach().numpy(), b.detach().numpy())
                       for a, b in zip(run["model"].parameters(), model.parameters()))
            buckets = "/".join(str(len(b)) for b in (gathered[0][1][0], gathered[0][1][-1]))
            verdict[0] = (f"losses {line}; final parameters {'pass' if same else 'FAIL'} "
                          f"(buckets first/last step: {buckets}; replay digest "
                          f"{digest(predicted)})", ok and same)
    dist.broadcast_object_list(verdict, src=0)
    return verdict[0]


def bit_check(run, p: int):
    """Gather the last step's buckets to rank 0 and hold them to the simulator; return a verdict."""
    import torch.distributed as dist

    state, recorder = run["state"], run["recorder"]
    if state is None:
        return "n/a (Gloo's code)", True
    mine = {i: (x, y, recorder.before, recorder.layouts[i]) for i, (x, y) in state.last.items()}
    gathered = [None] * p if dist.get_rank() == 0 else None
    dist.gather_object((mine, run["grads_used"]), gathered, dst=0)
    verdict = [None]
    if dist.get_rank() == 0:
        ok, failed = True, []
        for index in sorted(gathered[0][0]):
            inputs = [g[0][index][0] for g in gathered]
            outputs = [g[0][index][1] for g in gathered]
            if state.compressor is None:
                sim = refcoll.simulate("allreduce", inputs, algorithm=state.algorithm,
                                       op="avg").outputs
            else:
                # The hook's own reduction of the bucket (rt.hooks.average), on simulated
                # ranks, each with its rank's state and layout from before the step.
                def replay(t, x, before, layout, index=index):
                    rt.hooks.average(before, x, layout, index, t)
                    return x
                sim = refcoll.SimWorld(p).run(replay, [
                    (g[0][index][0].copy(), g[0][index][2], g[0][index][3]) for g in gathered])
            bad = [r for r in range(p) if not bits_equal(outputs[r], sim[r])]
            if bad:
                ok = False
                failed.append(f"bucket {index} on ranks {bad}")
        unused = [r for r, g in enumerate(gathered) if not g[1]]
        if unused:
            ok = False
            failed.append(f"parameters' gradients differ from the hook's output on ranks {unused}")
        buckets = len(gathered[0][0])
        verdict[0] = (f"pass ({buckets} buckets)" if ok else "FAIL: " + "; ".join(failed), ok)
    dist.broadcast_object_list(verdict, src=0)
    return verdict[0]


def bytes_per_step(run, n_params: int, p: int):
    """Return (bytes sent per rank per step, ``measured`` or ``modelled``).

    refcoll's hooks: ``HookState.sent`` (every byte of the hook's calls, argument
    agreement included) over the steps, the mean of the ranks. DDP's default:
    nothing measured; a ring all-reduce of every float32 gradient, ``2(p-1)/p·4·n``.
    """
    import torch.distributed as dist

    if run["state"] is None:
        return dense_bytes(n_params, p), "modelled"
    every = [None] * p
    dist.all_gather_object(every, run["state"].sent)
    return sum(every) / p / run["steps"], "measured"


def dense_bytes(n_params: int, p: int) -> float:
    """Return the bytes a rank sends in a ring all-reduce of ``n_params`` float32 values."""
    return 2 * (p - 1) / p * 4 * n_params


def compare_ring_default(ring, default, args, p: int):
    """Return the lines comparing ring with default, and whether the step-1 bound holds."""
    import torch.distributed as dist

    first = []
    for params, local in ring["recorder"].first.values():
        first += list(zip(params, split(local, params)))
    s1 = abs_sums(first)  # Σ_r|g_r| at step 1, per parameter
    s_all = abs_sums([(q, ring["recorder"].abs_sum[id(q)]) for q in ring["model"].parameters()])
    worst_ratio, worst_diff, final_diff, estimate = 0.0, 0.0, 0.0, 0.0
    ring_params = list(ring["model"].parameters())
    for q, a, b in zip(ring_params, ring["first_grads"], default["first_grads"]):
        diff = (a.double() - b.double()).abs()
        bound = (gamma(p) + gamma(p + 1)) * s1[id(q)] / p
        worst_diff = max(worst_diff, float(diff.max()))
        over = diff > bound
        if bool(over.any()):
            worst_ratio = math.inf
        elif float(bound.max()) > 0:
            worst_ratio = max(worst_ratio, float((diff / bound.clamp_min(1e-300)).max()))
    for q, d in zip(ring_params, default["model"].parameters()):
        final_diff = max(final_diff, float((q.detach().double() - d.detach().double()).abs().max()))
        est = args.lr / (1 - args.momentum) * (gamma(p) + gamma(p + 1)) * s_all[id(q)] / p
        estimate = max(estimate, float(est.max()))
    holds = math.isfinite(worst_ratio)
    all_hold = [None] * dist.get_world_size()
    dist.all_gather_object(all_hold, holds)
    holds = all(all_hold)
    lines = [
        "ring vs default, step-1 averaged gradients: max |difference| "
        f"{worst_diff:.3e}, {'within' if holds else 'OUTSIDE'} the bound "
        "(γ_p+γ_{p+1})·Σ_r|g_r|/p "
        f"elementwise (worst element at {worst_ratio:.3f} of its bound)",
        f"ring vs default, final parameters: max |difference| {final_diff:.3e}; "
        f"first-order estimate lr/(1-μ)·Σ_s (γ_p+γ_{{p+1}})·Σ_r|g_r,s|/p: {estimate:.3e} "
        "(an estimate, not a bound: see the docstring)",
    ]
    return lines, holds


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.backend == "refcoll":
        os.environ.setdefault("REFCOLL_ALGO", "ring")
    import torch.distributed as dist

    started = start(args, args.hidden)
    if started is None:
        return 2
    rank, p, data, initial = started
    algorithm = getattr(dist.group.WORLD, "algorithms", {}).get("allreduce")
    n_params = sum(v.numel() for v in initial.values())
    names = list(HOOKS) if args.hook == "all" else [args.hook]
    if args.against == "gloo" and "default" in names:
        names.insert(names.index("default") + 1, "default@gloo")
    rows, runs, ok, notes = [], {}, True, []
    for name in names:
        own = args.backend == "refcoll" and name == "default" and algorithm not in (None, "auto")
        group = dist.new_group(backend="gloo") if name == "default@gloo" else None
        run = train_one(name.partition("@")[0], args, initial, data, group, layouts=own)
        same = replicas_agree(run["model"])
        if own:  # DDP's own all-reduce on the refcoll backend: every step replayed
            verdict, passed = default_bit_check(run, args, initial, data, p, algorithm)
        else:
            verdict, passed = bit_check(run, p)
        sent, how = bytes_per_step(run, n_params, p)
        ok &= passed and same
        runs[name] = run
        rows.append((name, run["accuracy"] if same else math.nan, sent, how,
                     verdict if same else "FAIL: replicas differ", run["seconds"]))
        if how == "measured" and name != PLAIN and PLAIN in runs:
            plain = runs[PLAIN]["state"].sent
            if 0 < plain <= run["state"].sent:
                why = (" (it compresses matrices, and the hook hands it each bucket as one "
                       "flat vector, which it sends uncompressed)"
                       if run["state"].compressor.matrices else "")
                notes.append(f"note: {name} sent no fewer bytes than the uncompressed "
                             f"{PLAIN} hook{why}")
    if "default" in runs and PLAIN in runs:
        lines, holds = compare_ring_default(runs[PLAIN], runs["default"], args, p)
        notes = lines + notes
        ok &= holds
    if "default@gloo" in runs:
        sums = step1_abs_sums(initial, data, args, p)
        diff, ratio, holds = bound_check(zip(runs["default"]["first_grads"],
                                             runs["default@gloo"]["first_grads"]), sums, p)
        holds = all_true(holds)
        notes.insert(0, f"default ({args.backend}) vs default@gloo, step-1 averaged gradients: "
                        f"max |difference| {diff:.3e}, {'within' if holds else 'OUTSIDE'} the "
                        "bound (γ_p+γ_{p+1})·Σ_r|g_r|/p elementwise (worst element at "
                        f"{ratio:.3f} of its bound)")
        ok &= holds
    digests = []
    for name, run in runs.items():
        every = [None] * p
        dist.all_gather_object(every, run["losses"])
        digests.append(f"{name} {digest(np.stack(every, axis=1))}")
    notes.insert(0, "losses digest (every rank, every step): " + ", ".join(digests))
    if rank == 0:
        report(args, p, n_params, runs, rows, notes, ok)
    dist.destroy_process_group()
    return 0 if ok else 1


def report(args, p, n_params, runs, rows, notes, ok) -> None:
    """Print the run's settings, the notes and the table (rank 0)."""
    steps = next(iter(runs.values()))["steps"]
    algo = (f" (REFCOLL_ALGO {os.environ.get('REFCOLL_ALGO')})" if args.backend == "refcoll"
            else "")
    print(f"DDP on digits: {p} processes ({rt.launcher()}), {args.backend}{algo}, "
          f"MLP 64-{args.hidden}-10 "
          f"({n_params} parameters), {args.epochs} epochs = {steps} steps of {args.batch} rows "
          f"per rank, lr {args.lr}, momentum {args.momentum}, bucket_cap_mb {args.bucket_cap_mb}")
    print("bytes/rank/step: refcoll's hooks measured (HookState.sent, argument agreement "
          "included, mean of the ranks); default modelled, nothing measured: a ring "
          f"all-reduce of the gradients, 2(p-1)/p x 4 B x {n_params} = "
          f"{dense_bytes(n_params, p):.0f} B")
    if any(r["state"] is not None and r["state"].compressor is not None for r in runs.values()):
        print("bit check of compressed hooks: the hook's reduction of each bucket "
              "(refcoll.torch.hooks.average) on a SimWorld of p ranks, each rank's hook state "
              "as it was before the last step (refcoll.simulate gives every rank the same "
              "keyword arguments, so it cannot take one state per rank)")
    for line in notes:
        print(line)
    print()
    print(f"{'hook':<22} {'test acc':>8} {'bytes/rank/step':>26} {'steps s':>7}  "
          "bit check (last step)")
    for name, acc, sent, how, verdict, seconds in rows:
        print(f"{name:<22} {100 * acc:7.2f}% {sent:>15.0f} ({how:<8}) {seconds:>7.2f}  "
              f"{verdict}")
    print("\nall checks passed" if ok else "\nA CHECK FAILED")


if __name__ == "__main__":
    sys.exit(main())
