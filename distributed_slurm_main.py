#!/usr/bin/env python
"""ImageNet training with DistributedDataParallel (DDP), launched by Slurm's srun (scripts/slurm_train.sbatch).

    srun --nodes=2 --ntasks-per-node=4 --gpus-per-node=4 python distributed_slurm_main.py --data ...  # task per GPU
    srun --nodes=2 --ntasks-per-node=1 --gpus-per-node=4 python distributed_slurm_main.py --nprocs-per-node=4 ...

One process per GPU with CUDA + NCCL (without GPUs: CPU + gloo); the launcher starts and numbers them.
Every script of the cookbook is distributed.py plus its method's lines: `diff distributed.py X.py`.
"""
import argparse
import contextlib
import difflib
import fcntl
import functools
import gc
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta

import numpy
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data
import torchvision.datasets as datasets
import torchvision.models as models
import torchvision.transforms.v2 as transforms
from PIL import Image
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torchvision.io import ImageReadMode, decode_image, read_file

METHOD = "ddp-slurm"
RANK = int(os.environ.get("SLURM_PROCID", 0))  # global rank, from the launcher: log() prints on rank 0 only


def argument_parser():
    """The flags every script shares (training_arguments, at the end of the file), plus DDP's own."""
    parser = training_arguments("PyTorch ImageNet training with DistributedDataParallel")
    parser.add_argument("--sync-bn", action="store_true", help="SyncBatchNorm across processes (CUDA only)")
    parser.add_argument("--dist-timeout", type=number(float, 0, open_low=True), default=1800,
                        help="seconds a collective waits for the other ranks before failing")
    parser.add_argument("--nprocs-per-node", type=number(int, 1), default=1,
                        help="processes each Slurm task spawns (one per GPU) for one task per node; 1: none")
    parser.add_argument("--dist-file", metavar="PATH", help="rendezvous through a file on a filesystem all nodes "
                        "share, not TCP to node 0 (one file per job, step and requeue: a killed run leaves its own)")
    return parser


def setup_distributed(args):
    """Check the launch, pick this process's device and join the process group: (rank, world size, device).
    Every flag check runs before the rendezvous, so a bad flag fails all ranks alike and at once."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    device = pick_device(args, int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    if args.sync_bn and device.type != "cuda":
        raise UsageError("--sync-bn needs CUDA: SyncBatchNorm works only with CUDA modules (drop --sync-bn on CPU)")
    check_slurm_step(world_size)
    check_batch(args, world_size, sync_bn=args.sync_bn and world_size > 1)  # one process: plain BatchNorm
    if world_size > 1:  # the launcher's rendezvous (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE)
        job = ".".join(os.environ.get(k, "0") for k in ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_RESTART_COUNT"))
        join_process_group(device, args, "set MASTER_PORT to a free one (default 10000 + job id % 20000)",
                           init_method=f"file://{os.path.abspath(args.dist_file)}.{job}" if args.dist_file else "env://",
                           world_size=world_size, rank=RANK)
    check_output_dir(args)  # collective: after the processes have joined
    return RANK, world_size, device


def launcher_name(args):
    return "none" if "SLURM_STEP_ID" not in os.environ else "srun+mp.spawn" if args.nprocs_per_node > 1 else "srun"


def first_host(nodelist):
    """First host of a Slurm hostlist, as `scontrol show hostnames` prints it: 'gpu[08-10,12],cpu1' -> 'gpu08'."""
    first = re.match(r"(?:[^,\[]|\[[^\]]*\])+", nodelist).group()  # 'gpu[08-10,12]': up to the first comma outside []
    return re.sub(r"\[([^,\-\]]+)[^\]]*\]", r"\1", first)  # each [...] by its first number


def launch(args):
    """Set what torchrun sets from Slurm's task numbering, then train (or start --nprocs-per-node processes)."""
    env, n = os.environ, args.nprocs_per_node
    if "SLURM_JOB_ID" in env and "SLURM_STEP_ID" not in env:
        raise UsageError("started by the batch script, which Slurm counts as one task whatever the job size: "
                         "launch it with srun (srun python distributed_slurm_main.py ...)")
    tasks, nodes = int(env.get("SLURM_NTASKS", 1)), int(env.get("SLURM_NNODES", 1))
    if n > 1 and tasks != nodes:
        raise UsageError(f"--nprocs-per-node needs one Slurm task per node, not {tasks} on {nodes} node(s): "
                         f"srun --ntasks-per-node=1 -n {nodes}")
    # This node's tasks: SLURM_STEP_TASKS_PER_NODE '2(x3),1' is 2 tasks on each of 3 nodes, then 1.
    counts = re.findall(r"(\d+)(?:\(x(\d+)\))?", env.get("SLURM_STEP_TASKS_PER_NODE", "1"))
    on_node = [int(count) for count, times in counts for _ in range(int(times or 1))][int(env.get("SLURM_NODEID", 0))]
    rank, local_rank, local_size = int(env.get("SLURM_PROCID", 0)) * n, int(env.get("SLURM_LOCALID", 0)), on_node * n
    # A task per GPU takes its own by local rank (pick_device stops tasks that outnumber the GPUs), unless
    # Slurm bound each to its own (--gpus-per-task, --gpu-bind): it sees fewer than SLURM_STEP_GPUS, from 0.
    visible = 0 if args.cpu or n > 1 else torch.accelerator.device_count()
    if 0 < visible < len(env.get("SLURM_STEP_GPUS", "").split(",")):
        local_rank, local_size = local_rank % visible, visible
    env.update(RANK=str(rank), WORLD_SIZE=str(tasks * n), LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(local_size))
    # Rank 0 is on the step's first node; every task derives the same port, and jobs sharing a node other ones.
    env.setdefault("MASTER_ADDR", first_host(env.get("SLURM_STEP_NODELIST", "127.0.0.1")))
    env.setdefault("MASTER_PORT", str(10000 + int(env.get("SLURM_JOB_ID", 0)) % 20000))
    # A task per node starts the node's processes (spawn: a fork could not use CUDA); a task per process trains.
    supervise(mp.spawn(worker, args=(args,), nprocs=n, join=False)) if n > 1 else main_worker(args)


# ---- communication: the lines each method does its own way (no-ops without a process group) ----

def all_reduce_sum(tensor):
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_gather_objects(obj):
    if not dist.is_initialized():
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def gradient_sync(model, last_micro_batch):
    """no_sync: accumulate gradients locally on all but the last micro-batch, so DDP all-reduces once
    per optimizer step instead of once per micro-batch."""
    return contextlib.nullcontext() if last_micro_batch or not isinstance(model, DDP) else model.no_sync()


def broadcast_buffers(model):
    """Rank 0's BatchNorm statistics to every rank: gradients are averaged, statistics are not (each
    rank's come from its own batch). Then the evaluation and the checkpoint are those of one model."""
    if dist.is_initialized():
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)


def main(argv=None):
    run(launch, argument_parser().parse_args(argv))  # the exit status and error line of every way it can end


def worker(index, args):
    global RANK
    RANK = int(os.environ["RANK"]) + index  # launch set the task's first process's ranks
    os.environ.update(RANK=str(RANK), LOCAL_RANK=str(index))  # (one task per node: local rank 0)
    run(main_worker, args)


def main_worker(args):
    stop_on_signals()
    seed_everything(args.seed)
    train_set, val_set, num_classes = build_datasets(args)
    model = build_model(args, num_classes)
    rank, world_size, device = setup_distributed(args)
    if args.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.to(device)
    checkpoint = load_checkpoint(args, model)
    # DDP broadcasts rank 0's weights, then averages the gradients over the ranks during backward,
    # bucket by bucket, so the all-reduce of one bucket overlaps the backward of the next.
    # gradient_as_bucket_view: the gradients live in those buckets, one copy fewer of them in memory.
    parallel_model = DDP(model, gradient_as_bucket_view=True) if world_size > 1 else model
    micro_batch = args.batch_size // world_size // args.grad_accum_steps
    report_start(model, world_size, device, micro_batch, args, ("all_reduce", None, 1))  # DDP: the gradients
    args.seed = common_seed(checkpoint, args)  # every rank shuffles alike: their shares partition the data
    train_sampler, train_loader, val_loader = build_loaders(args, train_set, val_set, world_size, rank, device,
                                                            micro_batch)
    steps_per_epoch = len(train_loader) // args.grad_accum_steps
    criterion = nn.CrossEntropyLoss()
    # fused: one kernel updates every parameter, on GPUs and on CPUs (3x faster than the default loop here).
    optimizer = torch.optim.SGD(model.parameters(), args.lr * args.batch_size / 256, momentum=args.momentum,
                                weight_decay=args.weight_decay, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(args, max(1, steps_per_epoch)))
    start_epoch, start_step, best_acc1 = resume_training(checkpoint, optimizer, scheduler, train_loader, rank,
                                                         world_size, [device], args)
    open_metrics(args, start_epoch, start_step)  # rank 0: metrics.jsonl, past steps only
    start_profile(args, device, start_epoch, start_step, steps_per_epoch)  # --profile: every rank
    if args.evaluate:
        report_epoch(start_epoch - 1, validate(val_loader, model, device), world_size, device, args)
        return finish(model)

    def save(epoch, step, loader_state, is_best=False):
        """Checkpoint the state after `step` optimizer steps of `epoch` (a whole epoch: epoch + 1, step 0)."""
        check_finite(model.parameters(), epoch, step, optimizer.param_groups[0]["lr"])
        rngs = all_gather_objects(dict(rng_state([device]), loader=loader_state))  # collective: every rank's
        state = {"epoch": epoch, "step": step, "arch": args.arch, "scheduler": scheduler.state_dict(),
                 "best_acc1": best_acc1, "world_size": world_size, "rng": rngs, "args": vars(args)}
        if rank == 0:
            save_checkpoint(dict(state, state_dict=model.state_dict(), optimizer=optimizer.state_dict()), is_best, args)

    for epoch in range(start_epoch, args.epochs):
        # set_epoch reshuffles: without it every epoch would visit the data in the same order. After
        # a mid-epoch checkpoint, the batches it had trained on are skipped, not loaded and dropped.
        train_sampler.set_epoch(epoch, skip=start_step * args.grad_accum_steps * micro_batch)
        # The loader draws its workers' seeds from its generator as the epoch starts: mid-epoch
        # checkpoints keep the state from before that draw, so a resumed epoch makes the same one.
        loader_state = train_loader.generator.get_state()
        start = time.perf_counter()
        trained = train(train_loader, parallel_model, criterion, optimizer, scheduler, epoch, start_step,
                        steps_per_epoch, device, args, lambda step: save(epoch, step, loader_state))
        start_step = 0
        val = validate(val_loader, model, device)
        is_best, best_acc1 = val["acc1"] > best_acc1, max(val["acc1"], best_acc1)
        save(epoch + 1, 0, train_loader.generator.get_state(), is_best)
        report_epoch(epoch, val, world_size, device, args, trained, start, optimizer.param_groups[0]["lr"])
    finish(model, best_acc1=best_acc1)


def train(loader, model, criterion, optimizer, scheduler, epoch, first_step, steps, device, args, save):
    """One epoch from optimizer step first_step (after a mid-epoch resume, else 0); between steps Progress
    logs, checks and checkpoints (save). Returns (globally reduced metrics, seconds, seconds of data wait)."""
    model.train()
    progress = Progress(epoch, first_step, steps, device, args, save)
    batches = progress.timed(loader)  # the loader's batches, timing the wait for each
    accum = args.grad_accum_steps
    for step in range(first_step, steps):
        for micro in range(accum):
            images, target = to_device(*next(batches), device)
            with gradient_sync(model, micro == accum - 1):
                output = model(images)
                loss = criterion(output, target)
                # Dividing by the micro-batch count makes the accumulated gradient the mean over the
                # whole global batch, as if it had been one batch.
                (loss / accum).backward()
            progress.update(loss, output, target)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        progress.step_done(step, optimizer.param_groups[0]["lr"])  # may checkpoint, or stop every rank
    return progress.result()


def validate(loader, model, device):
    """Exact evaluation: every val image counted once; (sum, count) reduced over ranks, not means. It
    runs the plain model: the parallel wrapper's collectives, ranks with fewer val batches would not join."""
    broadcast_buffers(model)
    model.eval()
    meter = AverageMeter(device)
    with torch.no_grad():
        for images, target in val_batches(loader, device):
            output = model(images)
            meter.update(F.cross_entropy(output, target, reduction="none").double().sum(),
                         *correct_counts(output, target), target.size(0))
    return meter.evaluated()


def finish(model, best_acc1=None):
    """Report every rank's digest of the final model (run then leaves the process group)."""
    digests = all_gather_objects(state_digest(model))
    summary("DONE", method=METHOD, state_sha256=digests, ranks_identical=len(set(digests)) == 1,
            **({} if best_acc1 is None else {"best_acc1": best_acc1}))


def leave_process_group():
    """A barrier first: a rank that exits while a peer is still in a collective can make the peer abort."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# ---- helpers shared by every script: skip them on a first read ----
# Byte-identical in every script (tests/test_consistency.py); tools/sync_shared.py copies a change.

# ---- flags and errors: the shared flags, one error line for bad input, rank 0's output ----
class UsageError(Exception):
    """Bad input that every rank meets: global rank 0 reports it in one line, without a traceback."""


class LocalError(UsageError):
    """Bad input that only some ranks meet (an image in their shard): each reports it, the launcher stops the rest."""


def report(error):
    if RANK == 0 or isinstance(error, LocalError):
        # Raised in a DataLoader worker, it comes back with the worker's traceback before its message.
        print(f"error: {str(error).rsplit(type(error).__name__ + ': ', 1)[-1].strip()}", file=sys.stderr, flush=True)
        return
    # Rank 0 prints it: a rank exiting first could have its launcher kill rank 0 before its line (seen in CI).
    deadline = time.monotonic() + 10
    while not STOP_SIGNALS and time.monotonic() < deadline:
        time.sleep(0.05)


def log(*args, **kwargs):  # global rank 0 only: N processes would print N copies
    if RANK == 0:
        print(*args, **kwargs, flush=True)


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, as for any bad input, not the usage text too
        report(UsageError(message))
        sys.exit(2)


def number(kind, low, high=None, open_low=False):  # argparse type: kind in [low, high], (low, high] if open_low
    def parse(text):
        value = kind(text)
        if value < low or (open_low and value == low) or (high is not None and value > high):
            bounds = (f"> {low:g}" if open_low else f">= {low:g}") + (f" and <= {high:g}" if high is not None else "")
            raise argparse.ArgumentTypeError(f"{text} is out of range: pass a number {bounds}")
        return value
    parse.__name__, parse.bounds = kind.__name__, (low, high)  # argparse names the type in its errors
    return parse


def step_range(text):  # --profile's argparse type: START:STOP, 2 <= START <= STOP (START - 1 warms it up)
    start, _, stop = text.partition(":")
    if not (start.isdigit() and stop.isdigit() and 2 <= int(start) <= int(stop)):
        raise argparse.ArgumentTypeError(f"'{text}' is not START:STOP with 2 <= START <= STOP: the step before START "
                                         "warms the profiler up (the first pays one-time costs too)")
    return int(start), int(stop)


def training_arguments(description):  # the flags every script shares, named as in pytorch/examples' imagenet
    parser = ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    add("--data", metavar="DIR", help="dataset root holding train/ and val/ in ImageFolder layout")
    add("--dummy", action="store_true", help="synthetic images (random, fixed per index) instead of --data")
    add("--dummy-samples", type=number(int, 1), default=10000, help="--dummy train images (val: a tenth)")
    add("-a", "--arch", default="resnet18", help="torchvision classification model")
    add("--norm", choices=["batch", "group"], default="batch", help="BatchNorm, or GroupNorm(32) for ResNets")
    add("--image-size", type=number(int, 1), default=224, help="train crop; val resizes to size*256/224, crops size")
    add("--min-crop-scale", type=number(float, 0, 1, open_low=True), default=0.08, help="smallest crop area kept")
    add("-j", "--workers", type=number(int, 0), default=4, help="data loading workers (DALI: threads) per process")
    add("--data-backend", choices=["torch", "dali"], default="torch", help="torch's DataLoader, or NVIDIA DALI")
    add("--decoder", choices=["torchcodec", "torchvision", "pil"], help="the DataLoader's JPEG/PNG decoder "
        "(default: torchcodec where it is installed, else torchvision)")
    add("--epochs", type=number(int, 1), default=90, help="total epochs to run")
    add("-b", "--batch-size", type=number(int, 1), default=256, help="GLOBAL batch per optimizer step, over all ranks")
    add("--val-batch-size", type=number(int, 1), default=64, help="evaluation batch per process, at any world size")
    add("--grad-accum-steps", type=number(int, 1), default=1, help="micro-batches per optimizer step")
    add("--lr", "--learning-rate", type=number(float, 0, open_low=True), default=0.1, help="lr at -b 256, scaled by -b")
    add("--warmup-epochs", type=number(float, 0), default=0.0, help="ramp the lr up linearly over these, per step")
    add("--lr-step-size", type=number(int, 1), default=30, help="multiply the lr by --lr-gamma every N epochs")
    add("--lr-gamma", type=number(float, 0, 1, open_low=True), default=0.1, help="lr decay factor")
    add("--momentum", type=number(float, 0, 1), default=0.9, help="SGD momentum")
    add("--wd", "--weight-decay", type=number(float, 0), default=1e-4, dest="weight_decay", help="weight decay")
    add("-p", "--print-freq", type=number(int, 1), default=10, help="print (and reduce metrics) every N steps")
    add("--output-dir", default="checkpoints", help="where checkpoints and metrics.jsonl are written")
    add("--save-every", type=number(int, 0), default=0, metavar="N", help="also checkpoint every N steps")
    add("--keep-checkpoints", type=number(int, 1), default=2, metavar="K", help="keep the newest K checkpoints")
    add("--resume", default="", metavar="PATH", help="checkpoint to resume from; 'auto': --output-dir's newest")
    add("-e", "--evaluate", action="store_true", help="evaluate the model on val and exit")
    add("--seed", type=number(int, 0), help="seed everything, deterministic kernels (bitwise-reproducible on CPU)")
    add("--cpu", action="store_true", help="use the CPU even if GPUs are visible")
    add("--dist-backend", choices=["nccl", "gloo"], help="default: nccl on GPUs, gloo on the CPU (and to share a GPU)")
    add("--profile", type=step_range, metavar="START:STOP",
        help="trace optimizer steps START..STOP (from 1) on every rank into --output-dir/trace-rank<R>.json")
    return parser


# ---- set-up: seeds, devices, the process group, the output directory ----
def seed_everything(seed):  # --seed: seeded generators, deterministic kernels; else cuDNN picks the fastest
    if seed is None:
        torch.backends.cudnn.benchmark = True
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS needs it before it starts
    random.seed(seed)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)


def pick_device(args, local_rank, local_world_size, can_share=True):
    """GPU `local_rank` of this node, else (or with --cpu) the CPU. can_share: processes may share a GPU over gloo."""
    # All processes of a node fail alike here: its local rank 0 says why (global rank 0 may be on another node).
    node_error = LocalError if local_rank == 0 else UsageError
    accelerator = None if args.cpu else torch.accelerator.current_accelerator(check_available=True)
    if accelerator is None:
        if not args.cpu:
            check_no_gpu_left_out(node_error)
        return torch.device("cpu")
    gpus = torch.accelerator.device_count()
    if local_world_size > gpus and (args.dist_backend != "gloo" or not can_share):  # NCCL: one rank per GPU
        raise node_error(f"{local_world_size} processes on this node, which shows {gpus} GPU(s): start at most one "
                         "process per GPU (" + ("--dist-backend gloo lets processes share a GPU, slowly: for tests)"
                                                if can_share else f"{METHOD}'s cannot share one, even over gloo)"))
    torch.accelerator.set_device_index(local_rank % gpus)  # before any GPU work, so nothing lands on GPU 0 by accident
    return torch.device(accelerator.type, local_rank % gpus)


def require_bf16(wanted, device, error):  # bf16 asked of a GPU that only emulates it: one error line
    if wanted and device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise UsageError(error)


def check_no_gpu_left_out(error):  # GPUs nvidia-smi lists and torch cannot see: an error, not a silent CPU run
    if os.environ.get("CUDA_VISIBLE_DEVICES", "all").strip() in ("", "-1") or not shutil.which("nvidia-smi"):
        return  # GPUs hidden on purpose (as the CPU test suite does), or no NVIDIA driver
    try:
        drivers = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=60, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return
    if drivers:
        why = (f"it needs a driver for CUDA {torch.version.cuda}, or CUDA_VISIBLE_DEVICES names none of them"
               if torch.version.cuda else "it is a CPU-only build")
        raise error(f"nvidia-smi lists {len(drivers)} GPU(s) (driver {drivers[0]}) but torch {torch.__version__} "
                    f"sees none ({why}): update the driver or install a torch wheel for its CUDA, or pass --cpu to "
                    "train on the CPU")


def check_slurm_step(world_size):  # N Slurm tasks in a smaller process group train N copies of one run: refused
    env = os.environ
    tasks = int(env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", 1))) if "SLURM_STEP_ID" in env else 1
    if world_size < tasks:
        if env.get("SLURM_PROCID", "0") != "0":  # the others may all say rank 0
            sys.exit(2)
        raise UsageError(f"this Slurm step has {tasks} tasks, but they would train apart, world size {world_size} "
                         f"each: start one task per node running torchrun (sbatch scripts/slurm_train.sbatch does), "
                         f"or srun distributed_slurm_main.py, which numbers the tasks itself")


def check_batch(args, world_size, replicas=1, sync_bn=False):
    """-b splits into processes x --grad-accum-steps (x DataParallel's GPUs: replicas), 2+ images each for BatchNorm."""
    if args.evaluate:
        return
    if args.batch_size % (world_size * args.grad_accum_steps):
        raise UsageError(f"global batch -b {args.batch_size} must be a multiple of world size {world_size} "
                         f"x --grad-accum-steps {args.grad_accum_steps}")
    shares = torch.arange(args.batch_size // world_size // args.grad_accum_steps).chunk(replicas)
    if args.norm == "batch" and not sync_bn and min(len(share) for share in shares) < 2:
        raise UsageError(f"-b {args.batch_size} leaves 1 image per process and micro-batch"
                         f"{' and GPU' if replicas > 1 else ''}, too few for BatchNorm's statistics: raise -b, "
                         "or pass --norm group (or --sync-bn on GPUs)")


def join_process_group(device, args, port_hint, **kwargs):  # NCCL bound to its GPU; a failed rendezvous: one error line
    backend = args.dist_backend or dist.get_default_backend_for_device(device)
    if backend == "nccl" and device.type != "cuda":
        raise UsageError("--dist-backend nccl needs GPUs: leave it out on the CPU (gloo)")
    try:
        dist.init_process_group(backend, device_id=device if backend == "nccl" else None,
                                timeout=timedelta(seconds=args.dist_timeout), **kwargs)
    except dist.DistNetworkError as e:
        raise UsageError(f"cannot join the process group at {os.environ.get('MASTER_ADDR')}:"
                         f"{os.environ.get('MASTER_PORT')} ({str(e).splitlines()[0]}): if the port is in use "
                         f"{port_hint}") from None


def check_output_dir(args):  # rank 0 claims --output-dir now, not after an epoch; all stop on its verdict
    # A str on every rank, "" if fine: Horovod names an object collective by its type.
    if problem := all_gather_objects(claim_output_dir(args) if RANK == 0 and not args.evaluate else "")[0]:
        raise UsageError(problem)


def claim_output_dir(args):  # rank 0's checks (the problem, or ""); it then holds --output-dir's lock for the run
    try:
        os.makedirs(args.output_dir, exist_ok=True)
        lock = os.open(os.path.join(args.output_dir, ".lock"), os.O_WRONLY | os.O_CREAT, 0o666)  # open until exit
        metrics = os.path.join(args.output_dir, "metrics.jsonl")
        if os.path.lexists(metrics):  # open_metrics appends to it after set-up: a directory there fails now
            open(metrics, "a").close()
    except OSError as e:
        return f"cannot write checkpoints to --output-dir '{args.output_dir}': {e.strerror}" + (
            f" ('{e.filename}')" if e.filename else "")
    try:  # flock: the kernel drops it when the process ends, however it ends, so no stale lock outlives a run
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return (f"another run is writing checkpoints in --output-dir '{args.output_dir}' (it holds its .lock): "
                "wait for it to end, or pass another --output-dir")
    except OSError as e:  # a file system without locks (Lustre mounted noflock, NFS without its lock service)
        log(f"=> warning: --output-dir '{args.output_dir}' cannot be locked ({e.strerror}): nothing stops a "
            "second run from writing there at the same time")
    used = sorted(name for name in os.listdir(args.output_dir) if name in ("checkpoint.pth", "model_best.pth")
                  or name.startswith(CHECKPOINT_PREFIXES))
    return (f"--output-dir '{args.output_dir}' holds another run's checkpoints ({used[0]}): pass --resume auto to "
            "continue that run, or another --output-dir for a new one") if used and not args.resume else ""


def common_seed(checkpoint, args):  # every rank's shuffling seed (else shares overlap): rank 0's, or the resumed run's
    return checkpoint["args"]["seed"] if checkpoint else all_gather_objects(
        int.from_bytes(os.urandom(4), "little") if args.seed is None else args.seed)[0]


# ---- data: datasets, the model, samplers, loaders (torch's and DALI's), batches on the device ----
def build_datasets(args):
    if args.data_backend == "dali":
        if args.dummy:
            raise UsageError("--data-backend dali reads image files: pass --data DIR, not --dummy")
        import_dali()  # here, before the rendezvous: without DALI every rank fails at once
    elif args.workers:
        start_fork_server()  # now: its import of torch overlaps the listing of the tree
    if args.dummy:
        val_count = max(1, args.dummy_samples // 10)
        return (SyntheticImages(args.dummy_samples, args.image_size, 1000),
                SyntheticImages(val_count, args.image_size, 1000, offset=args.dummy_samples), 1000)
    if not args.data:
        raise UsageError("no dataset: pass --data DIR (with DIR/train and DIR/val) or --dummy")
    if missing := [top for top in ("train", "val") if not os.path.isdir(os.path.join(args.data, top))]:
        raise UsageError(f"{os.path.join(args.data, missing[0])} is not a directory: --data must hold train/ and val/ "
                         "in ImageFolder layout (python tools/make_demo_data.py writes a demo set)")
    train_tf = transforms.Compose([transforms.RandomResizedCrop(args.image_size, scale=(args.min_crop_scale, 1.0)),
                                   transforms.RandomHorizontalFlip(), transforms.PILToTensor()])
    val_tf = transforms.Compose([transforms.Resize(args.image_size * 256 // 224),
                                 transforms.CenterCrop(args.image_size), transforms.PILToTensor()])
    try:
        args.decoder = pick_decoder(args.decoder)
        loader = functools.partial(load_image, decoder=args.decoder)
        train = ListedFolder(os.path.join(args.data, "train"), train_tf, loader)
        val = ListedFolder(os.path.join(args.data, "val"), val_tf, loader)
    except FileNotFoundError as e:  # no class folders, or a class folder without images
        raise UsageError(f"bad dataset in {args.data}: {e}") from None
    if val.classes != train.classes:
        missing = sorted(set(train.classes) ^ set(val.classes))
        raise UsageError(f"val classes differ from train classes in {args.data} (e.g. {missing[:5]}): "
                         "both must hold the same class folders")
    return train, val, len(train.classes)


class ListedFolder(datasets.ImageFolder):
    """ImageFolder from one walk of the tree into a FileTable, symlink loops refused: half its CPU (docs/input.md)."""

    def __init__(self, root, transform, loader):
        datasets.VisionDataset.__init__(self, root, transform=transform)
        self.loader, self.extensions = loader, datasets.folder.IMG_EXTENSIONS
        self.classes, self.class_to_idx = self.find_classes(root)
        folders = {name: [] for name in self.classes}  # class: its (folder, files), the steps of os.walk(class folder)
        for path, dirs, files in os.walk(root, followlinks=True):
            parts = os.path.relpath(path, root).split(os.sep)
            # A symlink back to a directory above would add every image below it again, until the path is too long.
            above = {os.path.realpath(os.path.join(root, *parts[:i])) for i in range(len(parts) + 1)}
            for name in dirs:
                if os.path.realpath(os.path.join(path, name)) in above:
                    raise UsageError(f"symlink loop in --data: '{os.path.join(path, name)}' leads back to "
                                     f"'{os.path.realpath(os.path.join(path, name))}': remove or replace the link")
            if path != root and parts[0] in folders:
                folders[parts[0]].append((path, os.path.join(path, ""), files))  # prefix + name: 6x os.path.join's pace
        images = [[prefix + file for _, prefix, files in sorted(found) for file in sorted(files)  # ImageFolder's order
                   if file.lower().endswith(self.extensions)] for found in folders.values()]
        if not all(images):  # ImageFolder's words
            raise FileNotFoundError(f"Found no valid file for the classes "
                                    f"{', '.join(name for name, found in zip(self.classes, images) if not found)}. "
                                    f"Supported extensions are: {', '.join(self.extensions)}")
        self.samples = self.imgs = FileTable([path for found in images for path in found],
                                             numpy.repeat(numpy.arange(len(images)), list(map(len, images))))
        self.targets = self.samples.labels


def start_fork_server():
    """The loader workers' parent, which imports torch once (docs/input.md). Never fork this process: its torch threads
    may hold locks a fork copies held for ever (CPython gh-112275: a hang). The stop signals are blocked: launchers
    signal the whole process group, and one would end the server and its workers before the checkpoint."""
    from multiprocessing import forkserver, resource_tracker
    # What a worker imports first; the default, '__main__', imports nothing before CPython's gh-126631 fix.
    forkserver.set_forkserver_preload(["torch", "torchvision"])
    resource_tracker.ensure_running()  # first: starting it unblocks SIGTERM (CPython's guard for that helper)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGUSR1})  # a mask survives exec
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # a signal that came meanwhile is delivered now


def init_worker(worker_id):
    """worker_init_fn. Launchers signal the whole process group: a worker would die before its trainer stopped. The
    fork server lives while a process holds its pipe: a SIGKILLed trainer's server and workers would run on for ever."""
    from multiprocessing import forkserver
    for signum in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)
    server = forkserver._forkserver  # multiprocessing has no public way to this pipe
    if server._forkserver_alive_fd is not None:  # None in a worker not forked by a fork server
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None


class FileTable:
    """ImageFolder's (path, class) list in two tensors, shared with the workers, not pickled to each (docs/gpu.md)."""

    def __init__(self, paths, labels):
        paths = [os.fsencode(path) for path in paths]
        self.ends = torch.from_numpy(numpy.cumsum([0, *map(len, paths)]))
        self.chars = torch.frombuffer(bytearray(b"".join(paths)), dtype=torch.uint8)
        self.labels = torch.as_tensor(labels)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        index = range(len(self.labels))[index]  # a list's indexing: negative indices, IndexError past the end
        return os.fsdecode(self.chars[self.ends[index]:self.ends[index + 1]].numpy().tobytes()), int(self.labels[index])


@contextlib.contextmanager
def open_image(path):  # PIL's Image.open (header only): a file it cannot read, or a bomb, is an error line
    try:
        with Image.open(path) as image:
            yield image
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise LocalError(f"cannot read image '{path}' ({e}): replace or delete the file") from None


def pick_decoder(choice):  # --decoder's; by default TorchCodec where it imports (torchvision 0.29 deprecates its own)
    if choice in (None, "torchcodec"):
        try:
            import torchcodec.decoders  # noqa: F401
            return "torchcodec"
        except (ImportError, RuntimeError, OSError) as e:  # not installed, or not built for this torch
            if choice:
                raise UsageError(f"--decoder torchcodec: TorchCodec cannot be imported ({e}): pip install the "
                                 f"torchcodec for torch {torch.__version__}, or pass --decoder torchvision") from None
    return choice or "torchvision"


def load_image(path, decoder="torchcodec"):
    """JPEGs and PNGs by TorchCodec (or torchvision.io) into uint8 CHW, the rest by PIL, unturned (docs/input.md)."""
    with open_image(path) as image:
        # TorchCodec turns an image by its EXIF orientation, which PIL, torchvision.io and DALI do not: PIL decodes it.
        turned = decoder == "torchcodec" and image.getexif().get(0x0112, 1) != 1
        if decoder != "pil" and image.format in ("JPEG", "PNG") and not turned:
            with contextlib.suppress(RuntimeError):  # a damaged file: PIL's error says what is wrong
                if decoder == "torchcodec":
                    from torchcodec.decoders import decode_image as decode_with_torchcodec
                    decoded = decode_with_torchcodec(path, mode="RGB", output_dtype="auto")  # uint16: 16-bit PNGs
                else:
                    decoded = decode_image(read_file(path), ImageReadMode.RGB)
                return transforms.functional.to_dtype(decoded, torch.uint8, scale=True)  # 16 bits to 8 as before
        return image.convert("RGB")  # as torchvision's pil_loader


class SyntheticImages(torch.utils.data.Dataset):
    """--dummy: random uint8 CHW images and labels, seeded by index on a CPU generator (FakeData's seeds every GPU)."""

    def __init__(self, count, image_size, num_classes, offset=0):
        self.count, self.shape, self.num_classes, self.offset = count, (3, image_size, image_size), num_classes, offset

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        generator = torch.Generator().manual_seed(self.offset + index)
        image = torch.randint(0, 256, self.shape, dtype=torch.uint8, generator=generator)
        return image, int(torch.randint(self.num_classes, (), generator=generator))


def build_model(args, num_classes):
    known = models.list_models(module=models)
    if args.arch not in known:
        close = difflib.get_close_matches(args.arch, known, n=3)
        raise UsageError(f"unknown --arch '{args.arch}': "
                         + (f"did you mean {', '.join(close)}?" if close else "see torchvision.models.list_models()"))
    kwargs = {"num_classes": num_classes}
    if args.norm == "group":
        if not args.arch.startswith(("resnet", "resnext", "wide_resnet")):
            raise UsageError(f"--norm group needs a ResNet-family --arch, not '{args.arch}'")
        kwargs["norm_layer"] = lambda channels: nn.GroupNorm(32, channels)
    with torch.device("meta"):  # shapes only, no memory or compute: an image size the model cannot take fails here
        try:
            models.get_model(args.arch, **kwargs)(torch.empty(2, 3, args.image_size, args.image_size))
        except (RuntimeError, ValueError, AssertionError) as e:
            raise UsageError(f"--image-size {args.image_size} is too small for --arch {args.arch} "
                             f"({str(e).splitlines()[0]}): pass a larger one") from None
    return models.get_model(args.arch, **kwargs)


def build_loaders(args, train_set, val_set, world_size, rank, device, micro_batch):
    train_set = SampleSeeded(train_set, args.seed)  # random crops and flips fixed per (seed, epoch, image)
    train_sampler = ResumableSampler(train_set, world_size, rank, seed=args.seed, drop_last=True)
    if len(train_sampler) < max(1, micro_batch) * args.grad_accum_steps and not args.evaluate:
        raise UsageError(f"the train set ({len(train_set)} images) is smaller than one global batch "
                         f"(-b {args.batch_size}): lower -b")
    val_batches = shard_batches(len(val_set), world_size, rank, args.val_batch_size)
    if args.data_backend == "dali":
        train_batches = torch.utils.data.BatchSampler(train_sampler, max(1, micro_batch), drop_last=True)
        train_loader = DaliLoader(train_set, train_batches, max(1, micro_batch), args, device)
        return train_sampler, train_loader, DaliLoader(val_set, val_batches, args.val_batch_size, args, device)
    # Workers forked by start_fork_server's process (never by this one), once per run (persistent).
    loader_args = dict(num_workers=args.workers, pin_memory=device.type != "cpu", worker_init_fn=init_worker,
                       **(dict(multiprocessing_context="forkserver", persistent_workers=True) if args.workers else {}))
    train_sampler.epoch, val_pending = None, []  # nothing to load yet
    train_loader = torch.utils.data.DataLoader(train_set, max(1, micro_batch), sampler=train_sampler, drop_last=True,
                                               generator=torch.Generator().manual_seed(args.seed + rank), **loader_args)
    val_loader = torch.utils.data.DataLoader(val_set, batch_sampler=val_pending, **loader_args)
    if args.workers:  # their start overlaps the rest of the set-up; with nothing to load yet, they load nothing
        for loader in (val_loader,) if args.evaluate else (train_loader, val_loader):
            iter(loader)
    val_pending += val_batches
    return train_sampler, train_loader, val_loader


class SampleSeeded(torch.utils.data.Dataset):
    """Seeds each sample's crop and flip by (seed, epoch, index): the same at any world size, worker count, restart."""

    def __init__(self, dataset, seed):
        self.dataset, self.seed = dataset, seed

    def __len__(self):
        return len(self.dataset)

    @contextlib.contextmanager
    def seeded(self, epoch, index):
        # The CPU generator only, the transforms' (torch.manual_seed would seed every GPU too: 50x slower per image).
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(((self.seed * 1_000_003 + epoch) * 1_000_000_007 + index) % 2**63)
            yield

    def __getitem__(self, key):  # (epoch, index)
        with self.seeded(*key):
            return self.dataset[key[1]]


class ResumableSampler(torch.utils.data.distributed.DistributedSampler):
    """DistributedSampler of (epoch, index) keys; set_epoch(epoch, skip) skips this rank's first `skip` (a resume)."""

    skip = 0

    def set_epoch(self, epoch, skip=0):
        super().set_epoch(epoch)
        self.skip = skip

    def __iter__(self):
        epoch = self.epoch  # None: nothing to load yet (build_loaders starts the workers)
        indices = [] if epoch is None else itertools.islice(super().__iter__(), self.skip, None)
        return ((epoch, index) for index in indices)

    def __len__(self):
        return super().__len__() - self.skip


def shard_batches(count, num_replicas, rank, batch_size):
    """Rank `rank`'s evaluation batches, round-robin, NOT padded: DistributedSampler's duplicates count twice."""
    starts = range(rank * batch_size, count, num_replicas * batch_size)
    return [list(range(start, min(start + batch_size, count))) for start in starts]


def import_dali():
    try:
        import nvidia.dali
        import nvidia.dali.plugin.pytorch  # noqa: F401 (torch.from_dlpack takes DALI's outputs once it is loaded)
        return nvidia.dali
    except ImportError as e:
        cuda = (torch.version.cuda or "13").split(".")[0]
        raise UsageError(f"--data-backend dali needs NVIDIA DALI, which cannot be imported ({e}): pip install "
                         f"nvidia-dali-cuda{cuda}0 (for this torch's CUDA {cuda}), or --data-backend torch") from None


class DaliLoader:
    """--data-backend dali: DALI decodes, crops, resizes and flips into uint8 NCHW batches on the device; Python picks
    the batches, crops and flips, as the default loader does, so its guarantees hold (docs/input.md)."""

    def __init__(self, dataset, batches, batch_size, args, device):
        self.dali, self.dataset = import_dali(), dataset  # .dataset: FSDP's and ZeRO's validate read a shape from it
        self.seeded = dataset if isinstance(dataset, SampleSeeded) else None  # the train set: random crops
        folder = dataset.dataset if self.seeded else dataset
        self.samples, self.transforms = folder.samples, folder.transform.transforms
        self.batches, self.batch_size, self.args, self.device = batches, batch_size, args, device
        self.generator, self.pipe, self.midway = torch.Generator(), None, False  # generator: checkpointed, unused

    def __len__(self):
        return len(self.batches)

    def source(self):  # the next batch's encoded files and labels (+ crop anchors, shapes and flips to train)
        self.pending.append([key if self.seeded else (None, key) for key in next(self.pass_batches)])  # val: no epoch
        columns = [[], [], [], [], []]
        for epoch, index in self.pending[-1]:
            path, label = self.samples[index]
            columns[0].append(numpy.fromfile(path, dtype=numpy.uint8))
            columns[1].append(numpy.array(label))
            with open_image(path) as image:  # load_image's checks, train and val
                if self.seeded:
                    crop, flip = self.transforms[:2]
                    with self.seeded.seeded(epoch, index):
                        top, left, height, width = crop.get_params(image, crop.scale, crop.ratio)
                        mirror = torch.rand(1) < flip.p
                    for column, value in zip(columns[2:], ([left, top], [width, height], mirror.item())):  # DALI: x, y
                        column.append(numpy.array(value, dtype=numpy.int32))
        return columns if self.seeded else columns[:2]

    def pipeline(self, source):
        fn, types, size, gpu = self.dali.fn, self.dali.types, self.args.image_size, self.device.type == "cuda"
        decoder = "mixed" if gpu else "cpu"  # mixed: nvJPEG decodes on the GPU, the CPU parses the headers

        # exec_dynamic: outputs that live while torch holds them (zero-copy); device_id None: a CPU-only pipeline.
        @self.dali.pipeline_def(batch_size=self.batch_size, num_threads=max(1, self.args.workers), exec_dynamic=True,
                                device_id=self.device.index if gpu else None)
        def pipe():
            files, labels, *window = fn.external_source(source, num_outputs=5 if self.seeded else 2, batch=True)
            decode = dict(device=decoder, output_type=types.RGB, adjust_orientation=False)  # EXIF: as the default
            if self.seeded:
                anchor, shape, mirror = window
                images = fn.decoders.image_slice(files, anchor, shape, normalized_anchor=False, normalized_shape=False,
                                                 **decode)
                images, options = fn.resize(images, resize_x=size, resize_y=size), {"mirror": mirror}
            else:
                images = fn.resize(fn.decoders.image(files, **decode), resize_shorter=self.transforms[0].size[0])
                options = {"crop": (size, size)}
            return fn.crop_mirror_normalize(images, dtype=types.UINT8, output_layout="CHW", **options), labels
        return pipe()

    def __iter__(self):
        self.pass_batches, self.pending = iter(self.batches), []  # pending: read, not yet delivered, oldest first
        # One pipeline, built at the first pass (seconds), reset after each; a pass left midway leaves batches queued.
        if self.pipe is None or self.midway:
            self.pipe = self.pipeline(self.source)
            self.pipe.build()
        self.midway = len(self.batches) > 0
        for left in reversed(range(len(self.batches))):
            batch = self.run()
            if not left:  # the pass ends now (None): train() takes its steps' batches and never asks past the last
                self.run()
            yield batch

    def run(self):  # the pipeline's next batch on the device, or None where the pass is over (then reset)
        try:
            with torch.profiler.record_function("enumerate(DaliLoader)#DaliLoader.__next__"):  # the data wait's span
                images, labels = self.pipe.run()
            self.pending.pop(0)
        except StopIteration:
            self.pipe.reset()
            self.midway = False
            return None
        except RuntimeError as e:  # DALI's report names the operator, not the file: PIL's decode does
            for _, index in itertools.chain(*self.pending):
                load_image(self.samples[index][0])
            where = next((line for line in str(e).splitlines() if "operator" in line), "").rstrip(",")
            raise LocalError(f"DALI cannot decode an image of this rank's next batches ({where}), though PIL "
                             "decodes each: an unsupported file?") from None
        # Zero-copy; the labels copied: DALI may reuse their buffer before to_device's non_blocking copy reads it.
        with self.device:
            return torch.from_dlpack(images.as_tensor()), torch.from_dlpack(labels.as_tensor()).clone()


@functools.cache
def normalization(device, dtype):  # ImageNet's mean, std (pixels in [0, 1]) as (1, 3, 1, 1) tensors, made once
    return tuple(torch.tensor(values, dtype=dtype, device=device).view(1, 3, 1, 1)
                 for values in ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)))


def to_device(images, target, device):  # uint8 (a 4x smaller copy) or [0, 1] floats onto the device, normalised there
    images = images.to(device, non_blocking=True)
    mean, std = normalization(images.device, torch.get_default_dtype())
    if images.dtype == torch.uint8:
        images = images.to(mean.dtype).div(255)
    return (images - mean).div_(std), target.to(device, non_blocking=True)


def val_batches(loader, device, collective_model=None):
    """The loader's batches on the device, then stand-ins for a collective_model (FSDP, ZeRO 3) to match all ranks."""
    stand_ins = max(all_gather_objects(len(loader))) - len(loader) if collective_model else 0  # before a forward
    for images, target in loader:
        yield to_device(images, target, device)
    for _ in range(stand_ins):
        collective_model(torch.zeros(1, *loader.dataset[0][0].shape, device=device))


# ---- the training loop's bookkeeping: lr schedule, progress lines, meters, divergence ----
def lr_schedule(args, steps_per_epoch):  # the lr's factor at step s: linear warm-up, then pytorch/examples' decay
    warmup_steps = args.warmup_epochs * steps_per_epoch
    return lambda step: (min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0) * args.lr_gamma ** (
        step // steps_per_epoch // args.lr_step_size)


class Progress:
    """train()'s bookkeeping: the data wait, every --print-freq steps (the only host sync) the line, checks, signals."""

    started = False  # whether this process's loader workers have delivered their first batch

    def __init__(self, epoch, first_step, steps, device, args, save):
        self.epoch, self.first_step, self.steps, self.args, self.save = epoch, first_step, steps, args, save
        self.meter = AverageMeter(device)
        self.data_wait = self.interval_wait = 0.0
        self.start = self.interval_start = time.perf_counter()
        # A GPU may run queued steps while the host waits: there the data wait is the GPU's idle time (CUDA events).
        self.gpu_waits = [] if device.type == "cuda" else None

    def timed(self, loader):
        start, began = time.perf_counter(), self.gpu_event()
        for batch in itertools.chain(loader, [None]):  # iter(loader) waits for workers started by build_loaders
            waited = time.perf_counter() - start
            if self.args.workers and not Progress.started:  # the workers' (DALI's pipeline's) start-up, said once
                Progress.started, self.start, self.interval_start = True, start + waited, start + waited
                log(f"=> loader start-up: {waited:.1f} s to the first batch (timed as neither training nor data wait)")
                waited, began = 0.0, None
            if began:
                self.gpu_waits.append((began, self.gpu_event()))
            else:
                self.data_wait, self.interval_wait = self.data_wait + waited, self.interval_wait + waited
            if batch is None:
                return
            yield batch
            start, began = time.perf_counter(), self.gpu_event()

    def gpu_event(self):  # on GPUs: an event the current stream reaches once its queued work is done (else None)
        if self.gpu_waits is not None:
            return torch.cuda.current_stream().record_event(torch.cuda.Event(enable_timing=True))

    def update(self, loss, output, target):
        self.meter.update(loss.detach() * target.size(0), *correct_counts(output.detach(), target), target.size(0))

    def step_done(self, step, lr):
        if "profiler" in PROFILE:  # --profile: the trace's step boundary; it stops once the trace is written
            PROFILE["profiler"].step()
            if PROFILE.get("written"):
                PROFILE.pop("profiler").stop()
        epoch, steps, args = self.epoch, self.steps, self.args
        if (step + 1) % args.print_freq == 0 or step + 1 == steps:
            metrics = self.meter.reduced()  # the only host sync: once per print interval
            if self.gpu_waits:  # their events are done now
                idle = sum(began.elapsed_time(ended) for began, ended in self.gpu_waits) / 1000  # ms to s
                self.data_wait, self.interval_wait = self.data_wait + idle, self.interval_wait + idle
                self.gpu_waits.clear()
            now, done = time.perf_counter(), min(step % args.print_freq, step - self.first_step) + 1
            step_time, data_time = (now - self.interval_start) / done, self.interval_wait / done
            log(f"Epoch: [{epoch}][{step + 1:{len(str(steps))}d}/{steps}]  Time {step_time:6.3f}  Data {data_time:6.3f}"
                f"  Loss {metrics['loss']:.4e}  Acc@1 {metrics['acc1']:6.2f}  Acc@5 {metrics['acc5']:6.2f}")
            write_metrics("train", (epoch, step + 1), step_time=round(step_time, 4), data_time=round(data_time, 4),
                          loss=metrics["loss"], acc1=metrics["acc1"], acc5=metrics["acc5"], lr=lr)
            self.interval_start, self.interval_wait = now, 0.0
            if not math.isfinite(metrics["loss"]):
                raise diverged(f"the training loss is {metrics['loss']}", epoch, step + 1, lr)
            if metrics["stop"]:  # a rank got SIGTERM or SIGUSR1: every rank stops after this same step
                self.save(step + 1)
                log(f"=> stopped on a signal after step {step + 1} of epoch {epoch}, checkpoint written: "
                    "--resume auto continues from it")
                raise Stopped()
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < steps:  # the last: main_worker's
            self.save(step + 1)

    def result(self):
        return self.meter.reduced(), time.perf_counter() - self.start, self.data_wait


class AverageMeter:
    """Sums of loss, hits and samples on the device, synced by reduced(), whose "stop": a rank was asked to stop."""

    def __init__(self, device):
        self.sums = torch.zeros(5, dtype=torch.float64, device=device)  # float64: exact enough at any world size

    def update(self, loss_sum, correct1, correct5, count):
        self.sums[:3] += torch.stack([loss_sum.double(), correct1.double(), correct5.double()])
        self.sums[3] += count  # a Python number: a kernel argument, not a host-to-device copy

    def evaluated(self):  # the evaluation's metrics and line
        metrics = self.reduced()
        log(f" * Acc@1 {metrics['acc1']:.3f} Acc@5 {metrics['acc5']:.3f} Loss {metrics['loss']:.4f} "
            f"({metrics['count']} images)")
        return metrics

    def reduced(self):
        self.sums[4] = len(STOP_SIGNALS)
        loss, correct1, correct5, count, stop = all_reduce_sum(self.sums.clone()).tolist()
        per = max(count, 1)
        return {"count": int(count), "loss": loss / per, "acc1": correct1 / per * 100, "acc5": correct5 / per * 100,
                "stop": stop > 0}


def correct_counts(output, target, topk=(1, 5)):  # as tensors: no host sync
    maxk = min(max(topk), output.size(1))
    hits = output.topk(maxk, dim=1).indices.eq(target.view(-1, 1))
    return [hits[:, :min(k, maxk)].any(dim=1).sum() for k in topk]


def diverged(what, epoch, step, lr):
    return UsageError(f"{what} in epoch {epoch} at step {step}: the training diverged (no checkpoint was written "
                      f"since): lower --lr (the lr was {lr:g}), add --warmup-epochs, or train in float32")


# ---- checkpoints: writing, sealing, choosing and loading them ----
# <prefix>N: at the end of epoch N-1, <prefix>N-stepS: in epoch N (.pth files; FSDP's, DeepSpeed's directories).
CHECKPOINT_PREFIXES = ("checkpoint-epoch", "dcp-epoch", "ds-epoch")
UMASK = os.umask(0o022)  # the process's umask: reading it means setting it, once, at import
os.umask(UMASK)
# The flags that change what a run trains (a method's own too, where it has them): a resume must keep them.
RECIPE = ("batch_size", "lr", "warmup_epochs", "lr_step_size", "lr_gamma", "momentum", "weight_decay", "norm",
          "image_size", "min_crop_scale", "amp_dtype", "grad_compression", "fp16_allreduce", "param_dtype",
          "reduce_dtype", "precision")


def check_finite(tensors, epoch, step, lr):  # before a checkpoint: finite weights on every rank (one small collective)
    tensors = [t.to_local() if hasattr(t, "to_local") else getattr(t, "ds_tensor", t) for t in tensors]
    bad = all_reduce_sum(torch.stack([t.detach().isfinite().all().logical_not() for t in tensors]).sum().double())
    if bad.item():
        raise diverged("the weights are not finite", epoch, step, lr)


def rng_state(devices):  # the CPU's, Python's and `devices`' GPU generators (only theirs: --cpu never starts CUDA)
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "devices": [torch.get_device_module(d).get_rng_state(d) for d in devices if d.type != "cpu"]}


def to_cpu(state):  # a copy of a (nested) state with every tensor on the CPU: the checkpoint opens on any machine
    if isinstance(state, dict):
        return {key: to_cpu(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(map(to_cpu, state))
    return state.cpu() if isinstance(state, torch.Tensor) else state


def checkpoint_paths(output_dir, prefix):  # output_dir's checkpoints named prefix..., newest (epoch, step) first
    positions = {}
    for name in os.listdir(output_dir) if os.path.isdir(output_dir) else []:
        epoch, dash, step = name[len(prefix):].removesuffix(".pth").partition("-step")
        if name.startswith(prefix) and epoch.isdigit() and (step.isdigit() or not dash):
            positions[os.path.join(output_dir, name)] = int(epoch), int(step or 0)
    return sorted(positions, key=positions.get, reverse=True)


def digest(path):  # SHA-256 of a checkpoint file (as sha256sum prints it), or of a directory's names and files
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    total = hashlib.sha256()
    for top, _, names in sorted(os.walk(path)):
        for name in sorted(names):
            total.update(os.path.relpath(os.path.join(top, name), path).encode() + bytes.fromhex(
                digest(os.path.join(top, name))))
    return total.hexdigest()


def write_atomically(path, write):  # into a fsync'd temp file renamed over path: a crash leaves the old file whole
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    os.fchmod(fd, 0o666 & ~UMASK)  # open()'s mode, not mkstemp's 0600: colleagues and tools/ can read a run's files
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.remove(tmp)
        raise


def seal(path, keep):  # rank 0, once checkpoint `path` is complete: its digest in .sha256; only the newest `keep` kept
    write_atomically(path + ".sha256", lambda f: f.write(digest(path).encode()))
    directory, name = os.path.split(path)
    for old in checkpoint_paths(directory, name[:name.index("epoch") + 5])[keep:]:
        (shutil.rmtree if os.path.isdir(old) else os.remove)(old)
        with contextlib.suppress(FileNotFoundError):
            os.remove(old + ".sha256")


def intact(paths):  # paths, less those that differ from the digest written beside them (torch's zip checks no CRC)
    for path in paths:
        if (os.path.isdir(path) and os.path.basename(path).startswith(CHECKPOINT_PREFIXES)
                and not os.path.isfile(path + ".sha256")):
            # Written in place (DeepSpeed's tags): the digest comes last, so without it the save was cut short.
            log(f"=> checkpoint '{path}' is incomplete (no .sha256 beside it: its save did not finish): skipping it")
            continue
        if os.path.isfile(path + ".sha256"):
            with open(path + ".sha256") as f:
                if f.read().strip() != digest(path):
                    log(f"=> checkpoint '{path}' is damaged (its SHA-256 differs from the one written with it "
                        "in .sha256): skipping it")
                    continue
        yield path


def save_checkpoint(state, is_best, args):
    """checkpoint-epochN[-stepS].pth, written atomically and sealed; checkpoint.pth the newest; model_best.pth."""
    output_dir, tmp = args.output_dir, os.path.join(args.output_dir, f".checkpoint.{os.getpid()}.tmp")
    name = f"checkpoint-epoch{state['epoch']}" + (f"-step{state['step']}" if state.get("step") else "") + ".pth"
    path = os.path.join(output_dir, name)
    try:
        write_atomically(path, lambda f: torch.save(to_cpu(state), f))
        seal(path, args.keep_checkpoints)
        for suffix in ("", ".sha256"):  # a hard link, no copy (a copy where the file system has none)
            try:
                os.link(path + suffix, tmp)
            except OSError:
                shutil.copyfile(path + suffix, tmp)
            os.replace(tmp, os.path.join(output_dir, "checkpoint.pth" + suffix))
        if is_best:  # a copy: it stays the best one whatever happens to the file it was copied from
            with open(path, "rb") as best:
                write_atomically(os.path.join(output_dir, "model_best.pth"), lambda f: shutil.copyfileobj(best, f))
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        # A full disk: torch.save raises its own RuntimeError while handling the OSError.
        if cause := next((c for c in (e, e.__context__) if isinstance(c, OSError)), None):
            raise LocalError(f"cannot write a checkpoint in '{output_dir}': {cause.strerror or cause} (free space "
                             "there or pass another --output-dir; checkpoints already there are intact)") from None
        raise


def choose_checkpoint(args, newest, found, missing, load):
    """--resume's checkpoint, load(path) plus its "path", checked against -a and RECIPE; None: start fresh. 'auto': the
    first of `newest` that is intact and loads (load raises UsageError to stop); not found(path): error `missing`."""
    if not args.resume:
        return None
    paths = newest if args.resume == "auto" else [os.path.normpath(args.resume)]
    if not paths:
        log(f"=> --resume auto: no checkpoint in '{args.output_dir}', starting fresh")
        return None
    if args.resume != "auto" and not found(paths[0]):
        raise UsageError(missing)
    error = UsageError(f"checkpoint '{paths[0]}' is damaged: pass another to --resume")
    for path in intact(paths):
        try:
            checkpoint = dict(load(path), path=path)
        except UsageError:
            raise
        except Exception as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            error = UsageError(f"cannot load checkpoint '{path}' (truncated, corrupt or not a plain-tensor "
                               f"checkpoint): {reason}")
            if path != paths[-1]:
                log(f"=> {error}: skipping it")
            continue
        if checkpoint.get("arch") != args.arch:
            raise UsageError(f"checkpoint '{path}' is for arch '{checkpoint.get('arch')}', not '{args.arch}': "
                             f"pass -a {checkpoint.get('arch')} or another checkpoint")
        saved = checkpoint["args"]
        changed = [f"--{key.replace('_', '-')} {saved[key]} (now {getattr(args, key)})" for key in RECIPE
                   if key in saved and saved[key] != getattr(args, key, saved[key])]
        if changed and not args.evaluate:  # a run that continued would train neither recipe (LambdaLR keeps its lr)
            raise UsageError(f"checkpoint '{path}' was trained with {', '.join(changed)}: pass another --output-dir "
                             "to start a new run, or those values to continue this one (--epochs may change)")
        return checkpoint
    raise error


def load_checkpoint(args, model):  # loads --resume's checkpoint into model, returns it (None: fresh), no pickled code
    def load(path):
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
            raise UsageError(f"'{path}' is not a checkpoint written by this cookbook (no state_dict)")
        return checkpoint
    newest = checkpoint_paths(args.output_dir, "checkpoint-epoch") or [  # checkpoint.pth alone: an older run's
        path for path in [os.path.join(args.output_dir, "checkpoint.pth")] if os.path.isfile(path)]
    checkpoint = choose_checkpoint(args, newest, os.path.isfile, f"no checkpoint at '{args.resume}': pass an "
                                   "existing file to --resume (or --resume auto)", load)
    if checkpoint is None:
        return None
    try:
        model.load_state_dict(checkpoint["state_dict"])
    except RuntimeError as e:
        raise UsageError(f"checkpoint '{checkpoint['path']}' does not fit this model ({str(e).splitlines()[0]}): "
                         "check -a and the number of classes") from None
    log(f"=> loaded checkpoint '{checkpoint['path']}' (epoch {checkpoint['epoch']}, step {checkpoint.get('step', 0)})")
    return checkpoint


def resume_training(checkpoint, optimizer, scheduler, train_loader, rank, world_size, devices, args):
    """Restore a loaded checkpoint's training state: returns (start epoch, start step, best top-1)."""
    if checkpoint is None:
        return 0, 0, 0.0
    if not args.evaluate:
        if "optimizer" in checkpoint:  # (FSDP's sharded checkpoints restore it from their shards)
            # The saved param groups would also replace this run's choice of implementation (fused, foreach).
            chosen = [{k: group[k] for k in ("fused", "foreach") if k in group} for group in optimizer.param_groups]
            optimizer.load_state_dict(checkpoint["optimizer"])
            for group, keep in zip(optimizer.param_groups, chosen):
                group.update(keep)
            # A checkpoint keeps its writer's memory layout (channels_last or not); the fused step needs its param's.
            for param, state in optimizer.state.items():
                for key, value in state.items():
                    if torch.is_tensor(value) and value.shape == param.shape and value.stride() != param.stride():
                        state[key] = torch.empty_like(param).copy_(value)
        scheduler.load_state_dict(checkpoint["scheduler"])
        if len(checkpoint["rng"]) == world_size:  # rng_state's
            state = checkpoint["rng"][rank]
            torch.set_rng_state(state["torch"])
            random.setstate(state["python"])
            for device, device_state in zip([d for d in devices if d.type != "cpu"], state["devices"]):
                torch.get_device_module(device).set_rng_state(device_state, device)
            train_loader.generator.set_state(state["loader"])
        else:
            log(f"=> checkpoint has RNG state for {len(checkpoint['rng'])} ranks, not {world_size}: "
                "data order stays exact, other random state is reseeded")
    return checkpoint["epoch"], checkpoint.get("step", 0), checkpoint["best_acc1"]


# ---- metrics and profiling: the run's lines, metrics.jsonl, torch.profiler ----
def report_start(model, world_size, device, micro_batch, args, *collectives):
    """The run's first lines. collectives: (kind, dtype: torch's name, fp16, bf16, None/"none": own, count a step)."""
    log(f"=> {METHOD}: world size {world_size}, device {device.type}, arch {args.arch}, global batch {args.batch_size} "
        f"({micro_batch} per process x {args.grad_accum_steps} micro-batches), launcher {launcher_name(args)}"
        + (f", decoder {args.decoder}" if args.decoder and args.data_backend == "torch" else ""))
    if tuple(map(int, torch.__version__.split(".")[:2])) < OLDEST_TORCH:
        log(f"=> warning: torch {torch.__version__} is older than {'.'.join(map(str, OLDEST_TORCH))}, the oldest the "
            "cookbook's tests ran on (docs/testing.md): it may fail, or train otherwise, unnoticed by them")
    params = [p for p in model.parameters() if p.requires_grad]
    numel = sum(getattr(p, "ds_numel", p.numel()) for p in params)  # ZeRO-3 partitions keep the full size in ds_numel
    sent, what = 0, []
    for kind, dtype, count in collectives if world_size > 1 else []:
        name = {"fp16": "float16", "bf16": "bfloat16", "none": None}.get(dtype, dtype)  # apex's --grad-compression
        dtype = getattr(torch, name) if name else None
        size = sum(getattr(p, "ds_numel", p.numel()) * (dtype or p.dtype).itemsize for p in params)
        sent += count * (2 if kind == "all_reduce" else 1) * (world_size - 1) * size // world_size
        what.append(f"{count} x {kind} in {str(dtype or params[0].dtype).removeprefix('torch.')}")
    log(f"=> communication: {sent:,} bytes ({sent / 2 ** 20:.1f} MiB) sent by each rank per optimizer step"
        + (f" ({' + '.join(what)} of {numel:,} parameters, ring algorithms)" if what else " (one process)"))


OLDEST_TORCH = (2, 11)  # the GPU machine's torch: older ones never ran the tests (report_start warns)
METRICS = {}  # rank 0's metrics log (open_metrics): its file, where training is
PROFILE = {}  # --profile's torch.profiler while it runs
DATA_STALL_SHARE = 0.2  # of an epoch's training time waiting for batches: the input limits the run (docs/input.md)


def summary(kind, **fields):  # one JSON line (rank 0) for statistics.sh and the tests, in metrics.jsonl too
    log(f"{kind} " + json.dumps(fields))
    # An epoch's SUMMARY comes after its last step: it sits at the next epoch's start (DONE: where training ended).
    position = (fields["epoch"] + 1, 0) if kind == "SUMMARY" and "epoch" in fields else METRICS.get("position")
    write_metrics(kind, position, **fields)


def report_epoch(epoch, val, world_size, device, args, trained=None, start=None, lr=None):
    """The epoch's SUMMARY line (-e: the evaluation's), then a data stall's. trained: train()'s Progress.result()."""
    fields = dict(method=METHOD, launcher=launcher_name(args), world_size=world_size, device=device.type, epoch=epoch)
    if trained is None:
        return summary("SUMMARY", **fields, **{f"val_{k}": v for k, v in val.items()})
    metrics, train_time, data_wait = trained
    share = data_wait / train_time
    summary("SUMMARY", **fields, train_loss=metrics["loss"], train_acc1=metrics["acc1"], val_loss=val["loss"],
            val_acc1=val["acc1"], val_acc5=val["acc5"], val_count=val["count"],
            epoch_time=round(time.perf_counter() - start, 3), images_per_sec=round(metrics["count"] / train_time, 1),
            data_wait=round(share, 4), lr=lr)
    if share > DATA_STALL_SHARE:
        log(f"=> data stall: {share:.0%} of this epoch's training time was spent waiting for batches: try more "
            f"loader workers (-j, now {args.workers}), --data-backend dali, or resized data (tools/resize_dataset.py)")


def open_metrics(args, epoch, step):  # rank 0: metrics.jsonl cut after (epoch, step), which a resume writes again
    if RANK != 0 or args.evaluate:
        return
    path, kept = os.path.join(args.output_dir, "metrics.jsonl"), []
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                with contextlib.suppress(json.JSONDecodeError):  # the last line of a run killed while writing it
                    record = json.loads(line)
                    if tuple(record["position"] or (0, 0)) <= (epoch, step):
                        kept.append(json.dumps(record) + "\n")
    write_atomically(path, lambda f: f.write("".join(kept).encode()))
    METRICS.update(fd=os.open(path, os.O_WRONLY | os.O_APPEND), position=(epoch, step))


def write_metrics(kind, position, **fields):  # rank 0: a record at (epoch, steps done in it) into metrics.jsonl
    if "fd" not in METRICS:
        return
    METRICS["position"] = position
    try:
        os.write(METRICS["fd"], (json.dumps({"kind": kind, "position": position, "time": round(time.time(), 3),
                                             **fields}) + "\n").encode())
    except OSError as e:  # a full disk or quota: one line, from rank 0, which writes it
        raise LocalError(f"cannot write metrics.jsonl in --output-dir: {e.strerror} (free space there; "
                         "checkpoints already there are intact)") from None


def start_profile(args, device, epoch, step, steps_per_epoch):  # --profile's torch.profiler, recording from step START
    if not args.profile or args.evaluate:
        return
    start, stop = args.profile
    steps = (args.epochs - epoch) * steps_per_epoch - step
    if stop > steps:
        raise UsageError(f"--profile {start}:{stop}: this run has only {steps} optimizer steps: lower STOP (or "
                         "raise --epochs)")

    def write_trace(profiler):  # each rank its own timeline; tools/profile_split.py splits their step time
        profiler.export_chrome_trace(os.path.join(args.output_dir, f"trace-rank{RANK}.json"))
        PROFILE["written"] = True
        log(f"=> profile: steps {start}..{stop} traced in {args.output_dir}/trace-rank<R>.json, one per rank; "
            f"their split: python tools/profile_split.py {args.output_dir}")
    kinds, gpu = torch.profiler.ProfilerActivity, device.type == "cuda"
    PROFILE["profiler"] = torch.profiler.profile(
        activities=[kinds.CPU] + [kinds.CUDA] * gpu, profile_memory=gpu, record_shapes=True, on_trace_ready=write_trace,
        schedule=torch.profiler.schedule(wait=start - 2, warmup=1, active=stop - start + 1, repeat=1))
    PROFILE["profiler"].start()


# ---- exit: exit codes, stalled ranks, stop signals, the final model's digest ----
class Stopped(Exception):
    """Every rank stopped training after the same step, on a signal, and rank 0 wrote a checkpoint."""


# What a collective raises where a peer process has exited (gloo: tcp/pair.cc); any other RuntimeError is a bug.
PEER_EXITED = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "ncclRemoteError",
               "NCCL communicator was aborted", "Horovod has been shut down")
STOP_SIGNALS = []  # the stop signals this process received (stop_on_signals)


@record  # under torchrun: an uncaught exception's traceback into torchrun's failure summary (else: nothing)
def run(main_worker, args):  # train; exit 2: bad input (one line), 143: stopped (checkpointed), 1: stalled ranks named
    try:
        main_worker(args)
        gc.collect()  # FSDP's modules live in reference cycles: freed at interpreter exit, they can abort it (CI)
        # Then the group's last reference is dropped here, without the GIL: dropped by DDP's reducer, it hung (2.11).
        leave_process_group()
        return
    except UsageError as e:
        report(e)
        every_rank = not isinstance(e, LocalError)
    except Stopped:
        leave_process_group()  # no rank leaves before rank 0 has written the checkpoint
        for signum in (signal.SIGTERM, signal.SIGUSR1):  # a launcher's second SIGTERM would end the exit with -15
            signal.signal(signum, signal.SIG_IGN)
        sys.exit(143)  # 128 + SIGTERM, as if the signal had ended the process: not a success, so it is requeued
    except RuntimeError as e:
        if any(words in str(e) for words in PEER_EXITED):  # the peer's own line, or its launcher, says why
            print(f"rank {RANK} stopped: another rank exited (its own message, or the launcher's report, says why)",
                  file=sys.stderr, flush=True)
            sys.exit(1)
        # gloo's words for a timed-out collective, or a later one (NCCL aborts the process: docs/operations.md).
        timed_out = dist.is_initialized() and ("Timed out waiting" in str(e) or "Application timeout" in str(e))
        if not (stalled := timed_out and stalled_ranks()):
            raise
        if RANK == min(set(range(dist.get_world_size())) - set(stalled)):  # one line, from the lowest live rank
            print(f"error: rank(s) {', '.join(map(str, stalled))} stalled: the others waited --dist-timeout "
                  f"{args.dist_timeout:g} s for them in a collective (a hang, a stopped process, or far slower "
                  "work: py-spy dump shows where it is)", file=sys.stderr, flush=True)
        sys.exit(1)
    # Out of the except, main_worker's frames (its traceback's) are gone. Bad input on every rank: leave the group
    # (else NCCL warns at exit); a rank alone would wait for peers training on.
    gc.collect()
    if dist.is_initialized() and every_rank:
        dist.destroy_process_group()
    sys.exit(2)


def stalled_ranks(grace=5.0):  # after a timeout: ranks not checking in on the rendezvous store (no store: rank 0)
    if "MASTER_ADDR" not in os.environ:  # a file:// rendezvous: no store to meet on
        return []
    key = f"cookbook/alive/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"  # one namespace per torchrun attempt
    world_size, alive = dist.get_world_size(), []

    def check_in():  # in a thread: a client of a stopped store waits for ever, whatever its timeout
        with contextlib.suppress(dist.DistError):
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=timedelta(seconds=grace))
            store.set(key + str(RANK), "1")
            time.sleep(grace)
            alive.extend(r for r in range(world_size) if store.check([key + str(r)]))
    thread = threading.Thread(target=check_in, daemon=True)
    thread.start()
    thread.join(3 * grace)
    return [r for r in range(world_size) if r not in alive] if alive else [0]


def stop_on_signals():  # SIGTERM (launchers, Slurm's preemption), SIGUSR1 (Slurm's time limit): checkpoint, stop
    for signum in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, lambda received, frame: STOP_SIGNALS.append(received))
    # Workers ignore them, so multiprocessing's exit would wait for ever: kill them (mp.spawn's run no atexit).
    multiprocessing.util.Finalize(None, lambda: [child.kill() for child in multiprocessing.active_children()],
                                  exitpriority=0)


def supervise(processes):  # mp.spawn(join=False)'s wait; signals to it (Slurm's may reach it alone) go to each process
    for signum in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(signum, lambda received, frame: [os.kill(pid, received) for pid in processes.pids()])
    try:
        while not processes.join(grace_period=10):  # a bad flag fails them all: 10 s for rank 0 to say why
            pass
    except torch.multiprocessing.ProcessExitedException as e:  # a failed one printed its error; a killed one not
        sys.exit(e.exit_code if e.exit_code > 0 else f"error: {e}")


def state_digest(model):  # SHA-256 of all parameters and buffers: FSDP's shards gathered (a collective)
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        digest.update(name.encode() + tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()

# ---- end of shared helpers ----


if __name__ == "__main__":
    main()
