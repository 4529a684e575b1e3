#!/usr/bin/env python
"""The yardsticks for `bash start.sh --benchmark`: a bare, minimal DDP training loop, with nothing
but what every method must do per step (load a batch, forward, backward with all-reduce, step), and
with --no-communication the same per-process work with no all-reduce at all: N independent
replicas side by side, the ceiling for any data-parallel method on this machine.

    torchrun --standalone --nproc-per-node=2 benchmarks/bare_ddp.py --dummy --image-size 64 -b 32 --epochs 2
    torchrun --standalone --nproc-per-node=2 benchmarks/bare_ddp.py --no-communication --dummy ...

It takes the trainers' workload flags (the others are ignored) and prints, like them, one SUMMARY
line per epoch with the epoch's training images/s and mean loss (rank 0's), so statistics.sh can divide
each method's throughput by this loop's on the same model, synthetic data, world size and global batch,
and the GPU check can see that it trains. A loss that is not finite ends it with an error, as it ends
the trainers. Its loader is theirs (workers forked by their fork server once per run, persistent, pinned
memory), and so is its optimizer, zeroed momentum included.
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torchvision.models as models
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dummy", action="store_true", help="accepted for symmetry: the data is always synthetic")
    parser.add_argument("--dummy-samples", type=int, default=10000)
    parser.add_argument("-a", "--arch", default="resnet18", help="a torchvision model, or timm:NAME")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("-b", "--batch-size", type=int, default=256, help="global batch")
    parser.add_argument("-j", "--workers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--no-communication", action="store_true", help="independent replicas: no DDP")
    parser.add_argument("--amp-dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                        help="autocast dtype (float16 with a GradScaler): the yardstick of apex_distributed.py's")
    parser.add_argument("--channels-last", choices=["on", "off"], default="off")
    args, _ = parser.parse_known_args()

    accelerator = torch.accelerator.current_accelerator(check_available=True)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if accelerator is None:
        device = torch.device("cpu")
    else:
        torch.accelerator.set_device_index(local_rank)
        device = torch.device(accelerator.type, local_rank)
    torch.backends.cudnn.benchmark = True  # as the trainers do unless --seed
    dist.init_process_group(dist.get_default_backend_for_device(device))
    world, rank = dist.get_world_size(), dist.get_rank()

    # The synthetic uint8 images the trainers' --dummy reads, normalised on the device as theirs are.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from distributed import SyntheticImages, init_worker, start_fork_server, to_device
    data = SyntheticImages(args.dummy_samples, args.image_size, 1000)
    sampler = torch.utils.data.distributed.DistributedSampler(data, drop_last=True)
    # The trainers' loader workers: forked by multiprocessing's fork server (torch and torchvision preloaded), once
    # per run (persistent), so no epoch but the first waits for them; init_worker: they end with this process, even
    # SIGKILLed. The server's blocked stop signals matter only to the trainers, which checkpoint on them; not here.
    if args.workers:
        start_fork_server()
    workers = {"multiprocessing_context": "forkserver", "persistent_workers": True} if args.workers else {}
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size // world, sampler=sampler, drop_last=True,
                                         num_workers=args.workers, pin_memory=device.type != "cpu",
                                         worker_init_fn=init_worker, **workers)
    # timm:NAME: timm's model of that name (where timm is installed), as a reference row.
    model = (__import__("timm").create_model(args.arch[5:], num_classes=1000) if args.arch.startswith("timm:")
             else models.get_model(args.arch, num_classes=1000)).to(device)
    memory_format = torch.channels_last if args.channels_last == "on" else torch.contiguous_format
    model = model.to(memory_format=memory_format)
    dtype = getattr(torch, args.amp_dtype)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    if world > 1 and not args.no_communication:  # as the trainers: no DDP wrapper for one process
        model = DDP(model)
    optimizer = make_optimizer(model, args.batch_size)
    criterion = torch.nn.CrossEntropyLoss()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        images_seen, loss_sum = 0, torch.zeros((), dtype=torch.float64, device=device)
        start = time.perf_counter()
        for images, target in loader:
            images, target = to_device(images, target, device)
            with torch.autocast(device.type, dtype, enabled=dtype != torch.float32):
                loss = criterion(model(images.contiguous(memory_format=memory_format)), target)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            loss_sum += loss.detach() * target.size(0)  # on the device: no host sync per step, as the trainers
            images_seen += target.size(0) * world
        if accelerator is not None:
            torch.accelerator.synchronize()
        seconds, loss = time.perf_counter() - start, loss_sum.item() / max(1, images_seen // world)
        if rank == 0:
            method = "ceiling" if args.no_communication else "bare"
            print("SUMMARY " + json.dumps({"method": method, "launcher": "torchrun", "world_size": world,
                                           "device": device.type, "epoch": epoch, "train_loss": loss,
                                           "images_per_sec": round(images_seen / seconds, 1)}), flush=True)
        if not math.isfinite(loss):  # NaN weights train nothing: GradScaler skips every later step
            sys.exit(f"bare_ddp.py: error: the training loss is {loss} in epoch {epoch} (rank {rank}): this loop does "
                     "not train, so it is no yardstick")
    dist.destroy_process_group()


def make_optimizer(model, batch_size):
    """The trainers' optimizer, with apex_distributed.py's zeroed momentum: when GradScaler skips step 1 (an fp16
    overflow), the fused step leaves the buffers it made with torch.empty_like unwritten (torch/optim/sgd.py,
    _fused_sgd's is_first_step), and step 2 would add that garbage to the weights. Zeros give the same first step."""
    optimizer = torch.optim.SGD(model.parameters(), 0.1 * batch_size / 256, momentum=0.9, weight_decay=1e-4,
                                fused=True)
    optimizer.state.update({param: {"momentum_buffer": torch.zeros_like(param)} for param in model.parameters()})
    return optimizer


if __name__ == "__main__":
    main()
