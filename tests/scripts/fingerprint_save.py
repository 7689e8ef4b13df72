"""Under torchrun (2 ranks, gloo, CPU): train two steps on a DistributedSampler loader and
save with ``statekit.save``; the test then resumes with world size 1 (tests/integration/torchrun/test_fingerprint_ranks.py)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import statekit


def main(url: str) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    dataset = torch.utils.data.TensorDataset(torch.arange(40.0).unsqueeze(1))
    sampler = torch.utils.data.DistributedSampler(dataset, shuffle=True, seed=3)
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, sampler=sampler)
    model = torch.nn.Linear(1, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.01)
    for _, (x,) in zip(range(2), loader):
        model(x).sum().backward()
        optim.step()
        optim.zero_grad()
    statekit.save(url, {"model": model, "optim": optim, "loader": loader})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
