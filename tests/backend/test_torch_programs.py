"""torch's own layers on the "refcoll" backend, unmodified: functional collectives, DTensor,
DDP with unused parameters, FSDP1. (FSDP2 and DDP's losses are replayed bit for bit by the
examples: tests/test_backend_examples.py.)"""

import torch
import torch.distributed as dist
import torch.nn as nn
from backend_job import world  # noqa: F401 - the fixture


def test_functional_collectives(world):
    import torch.distributed._functional_collectives as fc

    p, r = world.size(), world.rank()
    t = torch.ones(4) * (r + 1)
    total = p * (p + 1) / 2
    assert fc.all_reduce(t, "sum", world).wait().tolist() == [total] * 4
    gathered = fc.all_gather_tensor(t, 0, world).wait()
    assert gathered.tolist() == [float(q + 1) for q in range(p) for _ in range(4)]
    mine = fc.reduce_scatter_tensor(torch.ones(2 * p) * (r + 1), "sum", 0, world).wait()
    assert mine.tolist() == [total] * 2
    assert fc.broadcast(t.clone(), 0, world).wait().tolist() == [1.0] * 4
    swapped = fc.all_to_all_single(torch.arange(p, dtype=torch.float32) + 10 * r, None, None,
                                   world).wait()
    assert swapped.tolist() == [10.0 * q + r for q in range(p)]


def test_dtensor(world):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    p = world.size()
    mesh = DeviceMesh.from_group(world, "cpu")
    x = torch.arange(4.0 * p)
    sharded = distribute_tensor(x, mesh, [Shard(0)])
    assert sharded.to_local().tolist() == x.view(p, 4)[world.rank()].tolist()
    assert torch.equal(sharded.redistribute(mesh, [Replicate()]).to_local(), x)
    assert torch.equal(sharded.full_tensor(), x)
    assert sharded.sum().full_tensor().item() == x.sum().item()


class _WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.unused = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _same_everywhere(tensor) -> bool:
    everyone = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, tensor.detach().contiguous())
    return all(torch.equal(everyone[0], e) for e in everyone)


def test_ddp_with_unused_parameters(world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(_WithUnused(), find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(world.rank())
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(3, 4, generator=g)).sum().backward()
        opt.step()
    assert model.module.unused.weight.grad is None
    assert all(_same_everywhere(q) for q in model.parameters())


def test_fsdp1(world):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
                 device_id=torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(world.rank())
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = model(torch.randn(3, 4, generator=g)).square().sum()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    with FSDP.summon_full_params(model):
        assert all(_same_everywhere(q) for q in model.parameters())
