#!/usr/bin/env python
"""Per-rank bytes of parameters, gradients and optimizer state: DDP against FSDP2, measured.

    python benchmarks/fsdp_memory.py                      # resnet50, world sizes 2 and 4, CPU + gloo
    python benchmarks/fsdp_memory.py -a resnet18 --world-sizes 2 4 8

For each world size it starts that many CPU processes, wraps the model as distributed.py (DDP) and
fsdp_distributed.py (its own shard_model: fully_shard on each stage, then the root) do, takes one
SGD step with momentum on a small batch, and sums the bytes of the tensors each rank then holds:
its parameters, their gradients and the momentum buffers, for FSDP the local shards of these
DTensors (to_local()). It prints a markdown table of the largest rank's bytes. Not counted:
activations, DDP's gradient buckets (a second copy of the gradients for the all-reduce) and FSDP's
parameters while all-gathered (one unit at a time).
"""
import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import torchvision.models as models
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fsdp_distributed  # noqa: E402  (its shard_model)


def local_bytes(tensors):
    """Bytes of the tensors this rank holds: only its shard of a DTensor."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors)


def measure(rank, world_size, method, arch, port, results):
    """One rank: build, wrap, one step; rank 0 puts every rank's (params, grads, optimizer) bytes in results."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = models.get_model(arch, num_classes=1000)
    if method == "DDP":
        model = DDP(model)
    else:
        fsdp_distributed.shard_model(model, init_device_mesh("cpu", (world_size,)),
                                     fsdp_distributed.argument_parser().parse_args([]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    F.cross_entropy(model(torch.randn(2, 3, 32, 32)), torch.tensor([0, 1])).backward()
    optimizer.step()
    params = list(model.parameters())
    sizes = (local_bytes(params), local_bytes(p.grad for p in params),
             local_bytes(t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)))
    gathered = [None] * world_size
    dist.all_gather_object(gathered, sizes)
    if rank == 0:
        results.put(gathered)
    dist.barrier()  # as the trainers' finish(): a rank leaving mid-collective can abort its peer
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-a", "--arch", default="resnet50")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    results = mp.get_context("spawn").SimpleQueue()
    mb = 2 ** 20
    print(f"{args.arch}, 1000 classes, after one SGD step with momentum; MiB on the largest rank\n")
    print("| method | world size | parameters | gradients | optimizer state | total | total / DDP's |")
    print("|---|---|---|---|---|---|---|")
    for world_size in args.world_sizes:
        ddp_total = None
        for method in ("DDP", "FSDP"):
            mp.spawn(measure, args=(world_size, method, args.arch, free_port(), results), nprocs=world_size)
            params, grads, optim = (max(column) for column in zip(*results.get()))
            total = params + grads + optim
            ddp_total = ddp_total or total
            print(f"| {method} | {world_size} | {params / mb:.1f} | {grads / mb:.1f} | {optim / mb:.1f} | "
                  f"{total / mb:.1f} | {total / ddp_total:.3f} (1/{ddp_total / total:.2f}) |", flush=True)


if __name__ == "__main__":
    main()
