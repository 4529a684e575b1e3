#!/usr/bin/env python
"""Throughput of distributed.py against a bare, minimal DDP loop on the same model, synthetic data,
world size and global batch, both started by torchrun. Prints images/s of each and their ratio.

    python benchmarks/ddp_overhead.py                       # 2 processes, resnet18, 64 px, CPU
    python benchmarks/ddp_overhead.py --nproc 8 --image-size 224 -b 256 --samples 25600   # a GPU node

Each run trains 2 epochs; the second epoch's throughput counts (the first pays for start-up).
The runs alternate --repeats times and the median of each side is compared, so a noisy machine
hits both alike. Target: ratio >= 0.97 (the cookbook's logging, exact metrics and checkpointing
cost at most 3%).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="processes (torchrun --nproc-per-node)")
    p.add_argument("-a", "--arch", default="resnet18")
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("-b", "--batch-size", type=int, default=32, help="global batch")
    p.add_argument("--samples", type=int, default=1024, help="synthetic train images per epoch")
    p.add_argument("-j", "--workers", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one rank of the bare loop
    return p.parse_args(argv)


def bare_worker(args):
    """The minimal DDP loop: what distributed.py does per step, minus everything else."""
    import torch
    import torch.distributed as dist
    import torchvision.models as models
    from torch.nn.parallel import DistributedDataParallel as DDP

    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ["LOCAL_RANK"])
    if use_cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()

    bank = torch.randn(64, 3, args.image_size, args.image_size, generator=torch.Generator().manual_seed(0))
    data = [(bank[i % 64], i % 1000) for i in range(args.samples)]
    sampler = torch.utils.data.distributed.DistributedSampler(data, drop_last=True)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch_size // world, sampler=sampler, drop_last=True,
                                         num_workers=args.workers, pin_memory=use_cuda)
    model = DDP(models.get_model(args.arch, num_classes=1000).to(device),
                device_ids=[local_rank] if use_cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), 0.1 * args.batch_size / 256, momentum=0.9, weight_decay=1e-4)
    criterion = torch.nn.CrossEntropyLoss()
    for epoch in range(2):
        sampler.set_epoch(epoch)
        images_seen = 0
        start = time.perf_counter()
        for images, target in loader:
            images, target = images.to(device, non_blocking=True), target.to(device, non_blocking=True)
            loss = criterion(model(images), target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            images_seen += target.size(0) * world
        if use_cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    if rank == 0:
        print("BARE " + json.dumps({"images_per_sec": images_seen / seconds}), flush=True)
    dist.destroy_process_group()


def torchrun(args, script_args):
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc-per-node={args.nproc}"]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", str(max(1, os.cpu_count() // args.nproc))))
    proc = subprocess.run(cmd + script_args, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"error: benchmark run failed ({' '.join(script_args[:1])}):\n{proc.stderr[-2000:]}")
    return proc.stdout


def run_cookbook(args):
    with tempfile.TemporaryDirectory() as out:
        stdout = torchrun(args, ["distributed.py", "--dummy", "--dummy-samples", str(args.samples),
                                 "-a", args.arch, "--image-size", str(args.image_size), "-b", str(args.batch_size),
                                 "-j", str(args.workers), "--epochs", "2", "-p", "1000000", "--output-dir", out])
    summaries = [json.loads(line[len("SUMMARY "):]) for line in stdout.splitlines() if line.startswith("SUMMARY ")]
    return summaries[-1]["images_per_sec"]


def run_bare(args):
    stdout = torchrun(args, [str(Path(__file__).resolve()), "--worker", "-a", args.arch,
                             "--image-size", str(args.image_size), "-b", str(args.batch_size),
                             "--samples", str(args.samples), "-j", str(args.workers)])
    line = next(line for line in stdout.splitlines() if line.startswith("BARE "))
    return json.loads(line[len("BARE "):])["images_per_sec"]


def main():
    args = parse_args()
    if args.worker:
        return bare_worker(args)
    cookbook, bare = [], []
    for i in range(args.repeats):
        bare.append(run_bare(args))
        cookbook.append(run_cookbook(args))
        print(f"run {i + 1}/{args.repeats}: bare {bare[-1]:8.1f} img/s   distributed.py {cookbook[-1]:8.1f} img/s",
              flush=True)
    ratio = statistics.median(cookbook) / statistics.median(bare)
    print(f"median images/s: bare DDP loop {statistics.median(bare):.1f}, distributed.py "
          f"{statistics.median(cookbook):.1f}; ratio {ratio:.3f} (target >= 0.97)")
    print("RATIO " + json.dumps({"ratio": round(ratio, 4), "bare": bare, "distributed": cookbook,
                                 "nproc": args.nproc, "arch": args.arch, "image_size": args.image_size,
                                 "batch_size": args.batch_size}))


if __name__ == "__main__":
    main()
