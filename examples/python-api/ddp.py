"""PyTorch DDP on every node of a cluster, from Python: no YAML job, no torchrun.

    python examples/python-api/ddp.py

The torch plugin sets MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK
on each node and initializes the process group (NCCL on GPU nodes, gloo on
CPU) before train() runs; DistributedSampler gives each rank its part of the
data; only the head prints. The cluster (cluster.yaml beside this file: 2
local nodes) is torn down when the `with` block ends.
"""

from pathlib import Path

import gpuctl


@gpuctl.function
@gpuctl.stdout(only="head")
def train() -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    rank = dist.get_rank()
    world_size = dist.get_world_size()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    torch.manual_seed(0)  # the same data on every rank: the sampler splits it
    model = DDP(nn.Linear(784, 10).to(device))

    x = torch.randn(1000, 784)
    y = torch.randint(0, 10, (1000,))
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank)
    loader = DataLoader(dataset, batch_size=64, sampler=sampler)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(10):
        sampler.set_epoch(epoch)
        for batch_x, batch_y in loader:
            batch_x, batch_y = batch_x.to(device), batch_y.to(device)
            loss = loss_fn(model(batch_x), batch_y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        print(f"Epoch {epoch}: loss={loss.item():.4f}")

    checksum = sum(p.detach().sum().item() for p in model.parameters())  # equal on every rank
    return {"final_loss": loss.item(), "rank": rank, "checksum": checksum}


if __name__ == "__main__":
    with gpuctl.Cluster(Path(__file__).with_name("cluster.yaml"), plugins=[gpuctl.plugins.torch()]) as compute:
        results = train() @ compute

    for r in results:
        print(f"Rank {r['rank']}: loss={r['final_loss']:.4f}")
    assert len({round(r["checksum"], 4) for r in results}) == 1, "the ranks' models differ"
