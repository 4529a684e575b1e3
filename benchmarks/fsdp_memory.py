#!/usr/bin/env python
"""Per-rank bytes of parameters, gradients and optimizer state: DDP against FSDP2 and DeepSpeed's ZeRO, measured.

    python benchmarks/fsdp_memory.py                      # resnet50, world sizes 2 and 4, CPU + gloo
    python benchmarks/fsdp_memory.py -a resnet18 --world-sizes 2 4 8

For each world size it starts that many CPU processes, wraps the model as distributed.py (DDP),
fsdp_distributed.py (its own shard_model: fully_shard on each stage, then the root) and
deepspeed_distributed.py (deepspeed.initialize with its engine_config, ZeRO stages 0-3) do, takes one
SGD step with momentum on a small batch, and sums the bytes of the tensors each rank then holds:
its parameters, their gradients and the momentum buffers, for FSDP the local shards of these
DTensors (to_local()). DeepSpeed's tensors are counted by storage (its flat buffers hold the views it
hands out): the module's parameters (ZeRO 3: each one's shard, ds_tensor), the gradients as it keeps
them after backward, before the step frees them (its reduced 1/N from ZeRO 1 on), the momentum
buffers, and the float32 copy of this rank's 1/N of the weights its ZeRO optimizer keeps, float32
training or not. It prints a markdown table of the largest rank's bytes. Not counted: activations,
DDP's and DeepSpeed's gradient buckets (a second copy of some gradients for the communication) and
the parameters FSDP and ZeRO 3 all-gather while they run (one unit, or layer, at a time).
"""
import argparse
import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import torchvision.models as models
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import deepspeed_distributed  # noqa: E402  (its engine_config)
import fsdp_distributed  # noqa: E402  (its shard_model)


def local_bytes(tensors):
    """Bytes of the tensors this rank holds: only its shard of a DTensor."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors)


def storage_bytes(tensors):
    """Bytes of the distinct storages behind the tensors: a flat buffer and its views count once."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.numel()}.values())


def deepspeed_bytes(model, stage, world_size, batch):
    """One DeepSpeed step as deepspeed_distributed.py takes it: (params, grads, optimizer, float32 copy) bytes."""
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(dist.get_rank()))  # as the script sets them
    import deepspeed
    deepspeed.ops.__compatible_ops__ = {}
    deepspeed.utils.logger.setLevel("ERROR")
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's, for the collectives DeepSpeed calls
    args = deepspeed_distributed.argument_parser().parse_args(["--zero-stage", str(stage), "-b", str(2 * world_size)])
    engine = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9,
                                                                         weight_decay=1e-4),
                                  config=deepspeed_distributed.engine_config(args, world_size))[0]
    zero = engine.optimizer if stage else None  # DeepSpeed's ZeRO optimizer around the torch one

    def gradient_bytes(*_):
        return storage_bytes([p.grad for p in model.parameters() if p.grad is not None]
                             + [g for group in (zero.averaged_gradients.values() if zero else []) for g in group
                                if g is not None])
    # The most held at once: ZeRO 1 keeps whole gradients until the end of backward, where it reduces them to its
    # 1/N; ZeRO 2 and 3 move each into a bucket as it is computed. (After DeepSpeed's own hooks: registered later.)
    peak = [0]
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(lambda _: peak.append(max(peak.pop(), gradient_bytes())))
    engine.backward(F.cross_entropy(engine(batch[0]), batch[1]))
    grads = max(peak[0], gradient_bytes())
    engine.step()
    optimizer = zero.optimizer if zero else engine.optimizer
    copy = (zero.fp32_partitioned_groups_flat if stage == 3 else zero.single_partition_of_fp32_groups) if zero else []
    return (storage_bytes([getattr(p, "ds_tensor", p) for p in model.parameters()]), grads,
            storage_bytes([t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]),
            storage_bytes(copy))


def measure(rank, world_size, method, arch, port, results):
    """One rank: build, wrap, one step; rank 0 puts every rank's (params, grads, optimizer, float32 copy) bytes
    in results."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = models.get_model(arch, num_classes=1000)
    batch = torch.randn(2, 3, 32, 32), torch.tensor([0, 1])
    if method == "DDP":
        model = DDP(model)
    elif method == "FSDP":
        fsdp_distributed.shard_model(model, init_device_mesh("cpu", (world_size,)),
                                     fsdp_distributed.argument_parser().parse_args([]))
    if method.startswith("ZeRO"):
        sizes = deepspeed_bytes(model, int(method[-1]), world_size, batch)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        F.cross_entropy(model(batch[0]), batch[1]).backward()
        optimizer.step()
        params = list(model.parameters())
        sizes = (local_bytes(params), local_bytes(p.grad for p in params),
                 local_bytes(t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)), 0)
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
    print("| method | world size | parameters | gradients | optimizer state | ZeRO's float32 copy | total | "
          "total / DDP's |")
    print("|---|---|---|---|---|---|---|---|")
    for world_size in args.world_sizes:
        ddp_total = None
        for method in ("DDP", "FSDP", "ZeRO 0", "ZeRO 1", "ZeRO 2", "ZeRO 3"):
            mp.spawn(measure, args=(world_size, method, args.arch, free_port(), results), nprocs=world_size)
            params, grads, optim, copy = (max(column) for column in zip(*results.get()))
            total = params + grads + optim + copy
            ddp_total = ddp_total or total
            print(f"| {method} | {world_size} | {params / mb:.1f} | {grads / mb:.1f} | {optim / mb:.1f} | "
                  f"{copy / mb:.1f} | {total / mb:.1f} | {total / ddp_total:.3f} (1/{ddp_total / total:.2f}) |",
                  flush=True)


if __name__ == "__main__":
    main()
