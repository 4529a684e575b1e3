#!/usr/bin/env python
"""ImageNet training with FSDP2 (torch.distributed.fsdp.fully_shard) instead of DDP.

DDP keeps a whole copy of the parameters, gradients and optimizer state on every rank; FSDP keeps
1/N of each (a shard) and all-gathers one block's parameters just for its forward and backward, so
per-rank memory for them falls as 1/N. Checkpoints are sharded (torch.distributed.checkpoint: every
rank writes and reads only its shards), plus a plain single-file state_dict for an unwrapped model.

    torchrun --nproc-per-node=4 fsdp_distributed.py --data /path/to/imagenet
    # ... and every other launch of distributed.py: torch.distributed.launch, --nnodes, plain python

The launcher sets RANK, WORLD_SIZE and LOCAL_RANK (the legacy launcher also passes --local-rank);
this script never guesses them from the number of GPUs. CUDA + NCCL when GPUs are visible, else
CPU + gloo.
"""
import argparse
import difflib
import gc
import glob
import hashlib
import itertools
import json
import os
import pickle
import random
import shutil
import sys
import tempfile
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data
import torchvision.datasets as datasets
import torchvision.models as models
import torchvision.transforms as transforms
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

METHOD = "fsdp"
RANK = int(os.environ.get("RANK", 0))  # global rank, from the launcher


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="PyTorch ImageNet training with FSDP2 (fully_shard)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--data", metavar="DIR", help="dataset root holding train/ and val/ in ImageFolder layout")
    parser.add_argument("--dummy", action="store_true", help="train on synthetic images (benchmarking; no --data)")
    parser.add_argument("--dummy-samples", type=int, default=10000,
                        help="synthetic train images per epoch with --dummy (val gets a tenth)")
    parser.add_argument("-a", "--arch", default="resnet18", help="torchvision classification model")
    parser.add_argument("--norm", choices=["batch", "group"], default="batch",
                        help="BatchNorm, or GroupNorm(32) for ResNets (per-sample, so independent of the per-rank batch)")
    parser.add_argument("--image-size", type=int, default=224,
                        help="train crop size; val resizes to size*256/224 and centre-crops size")
    parser.add_argument("--min-crop-scale", type=float, default=0.08,
                        help="smallest image area fraction RandomResizedCrop keeps (0.08 is the ImageNet "
                             "standard; tiny images such as the demo digits learn faster with ~0.35)")
    parser.add_argument("-j", "--workers", type=int, default=4, help="data loading workers per process")
    parser.add_argument("--epochs", type=int, default=90, help="total epochs to run")
    parser.add_argument("--start-epoch", type=int, default=0, help="manual epoch number (useful on restarts)")
    parser.add_argument("-b", "--batch-size", type=int, default=256,
                        help="GLOBAL batch size per optimizer step, split evenly over all processes "
                             "(and over --grad-accum-steps micro-batches)")
    parser.add_argument("--val-batch-size", type=int, default=64,
                        help="evaluation batch per process; the same at every world size, so the val numbers are too")
    parser.add_argument("--grad-accum-steps", type=int, default=1,
                        help="micro-batches per optimizer step; FSDP reduce-scatters only on the last one")
    parser.add_argument("--lr", "--learning-rate", type=float, default=0.1,
                        help="learning rate for a global batch of 256 images; linear scaling rule "
                             "(Goyal et al. 2017): the lr used is lr * batch-size / 256")
    parser.add_argument("--warmup-epochs", type=float, default=0.0,
                        help="ramp the lr linearly from ~0 to its value over this many epochs, per step")
    parser.add_argument("--lr-step-size", type=int, default=30, help="multiply the lr by --lr-gamma every N epochs")
    parser.add_argument("--lr-gamma", type=float, default=0.1, help="lr decay factor of the step schedule")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    parser.add_argument("--wd", "--weight-decay", type=float, default=1e-4, dest="weight_decay", help="weight decay")
    parser.add_argument("-p", "--print-freq", type=int, default=10,
                        help="print progress (and reduce metrics over ranks) every N optimizer steps")
    parser.add_argument("--output-dir", default="checkpoints",
                        help="where every rank writes its checkpoint shards (on a filesystem all nodes see) and "
                             "rank 0 the single-file checkpoint.pth export")
    parser.add_argument("--save-every", type=int, default=0, metavar="N",
                        help="also checkpoint every N optimizer steps within an epoch (0: at epoch ends only); "
                             "a run resumed from one skips the batches already trained on")
    parser.add_argument("--resume", default="", metavar="PATH",
                        help="sharded checkpoint directory (dcp-epochN) to resume from, or 'auto' for the latest in "
                             "--output-dir (fresh start if none); with -e also a single-file .pth checkpoint")
    parser.add_argument("-e", "--evaluate", action="store_true", help="evaluate the model on val and exit")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed everything and use deterministic algorithms (bitwise-reproducible on CPU)")
    parser.add_argument("--cpu", action="store_true", help="use the CPU and gloo even if GPUs are visible")
    parser.add_argument("--sync-bn", action="store_true", help="SyncBatchNorm across processes (CUDA only)")
    parser.add_argument("--param-dtype", choices=["float32", "bfloat16"],
                        help="FSDP mixed precision: dtype of the all-gathered parameters, so of forward and backward "
                             "(the sharded parameters and the optimizer keep the model's dtype); default: no cast")
    parser.add_argument("--reduce-dtype", choices=["float32", "bfloat16"],
                        help="FSDP mixed precision: dtype of the gradient reduce-scatter; default: --param-dtype's")
    parser.add_argument("--dist-timeout", type=float, default=1800,
                        help="seconds a collective waits for the other ranks before failing")
    # torch.distributed.launch passes --local-rank=N (torch >= 2.0) or --local_rank=N (older); torchrun sets LOCAL_RANK.
    parser.add_argument("--local-rank", "--local_rank", type=int, default=None, dest="local_rank",
                        help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ---- shared helpers: byte-identical in every script of the cookbook (tests/test_consistency.py) ----

class UsageError(Exception):
    """A problem with the user's input, that every rank meets: global rank 0 reports it as one line."""


class LocalError(UsageError):
    """A problem that only some ranks meet (an image in their shard, a node short of GPUs): the rank
    that meets it reports it, and the launcher stops the others."""


def report(error):
    """Print a UsageError as one line, without a traceback: by global rank 0, or where a LocalError arose."""
    if RANK == 0 or isinstance(error, LocalError):
        # Raised in a DataLoader worker, it comes back with the worker's traceback before its message.
        message = str(error).rsplit(f"{type(error).__name__}: ", 1)[-1].strip()
        print(f"error: {message}", file=sys.stderr, flush=True)


def load_image(path):
    """ImageFolder's loader (PIL, RGB), with an error naming a corrupt or truncated file."""
    try:
        return datasets.folder.pil_loader(path)
    except (OSError, SyntaxError, ValueError) as e:  # what PIL raises for undecodable data
        raise LocalError(f"cannot read image '{path}' ({e}): replace or delete the file") from None


def log(*args, **kwargs):
    """Print on global rank 0 only, so N processes do not print N copies."""
    if RANK == 0:
        print(*args, **kwargs, flush=True)


class AverageMeter:
    """Running sum and count kept as a tensor on the training device.

    update() only queues device work; nothing waits for the GPU until the sums are reduced over
    ranks (once per print interval and once per epoch), so logging costs no per-step sync.
    """

    def __init__(self, device, names=("loss", "acc1", "acc5")):
        self.names = names
        # float64 keeps sums of many float32 values exact enough that world size does not show.
        self.sums = torch.zeros(len(names) + 1, dtype=torch.float64, device=device)

    def update(self, loss_sum, correct1, correct5, count):
        self.sums[:-1] += torch.stack([loss_sum.double(), correct1.double(), correct5.double()])
        self.sums[-1] += count  # a Python number: a kernel argument, not a host-to-device copy

    def reduced(self):
        """Sums over all ranks, as a dict of averages (acc in %) plus the global sample count."""
        sums = self.sums.clone()
        all_reduce_sum(sums)
        values = sums.tolist()
        count = values[-1]
        result = {"count": int(count)}
        for name, value in zip(self.names, values):
            result[name] = value / max(count, 1) * (1 if name == "loss" else 100)
        return result


class ProgressMeter:
    def __init__(self, num_batches, prefix=""):
        width = len(str(num_batches))
        self.fmt = "[{:" + str(width) + "d}/" + str(num_batches) + "]"
        self.prefix = prefix

    def display(self, batch, metrics, step_time, data_time):
        log(f"{self.prefix}{self.fmt.format(batch)}  Time {step_time:6.3f}  Data {data_time:6.3f}  "
            f"Loss {metrics['loss']:.4e}  Acc@1 {metrics['acc1']:6.2f}  Acc@5 {metrics['acc5']:6.2f}")


def correct_counts(output, target, topk=(1, 5)):
    """Number of samples whose target is among the top-k predictions, for each k (as tensors)."""
    maxk = min(max(topk), output.size(1))
    pred = output.topk(maxk, dim=1).indices
    hits = pred.eq(target.view(-1, 1))
    return [hits[:, :min(k, maxk)].any(dim=1).sum() for k in topk]


class ShardSampler(torch.utils.data.Sampler):
    """Evaluation batch sampler: the val set is cut into batches of batch_size, and rank r takes
    batches r, r+W, r+2W, ... with NO padding.

    DistributedSampler pads the dataset with duplicates so every rank gets the same count, which
    would count some val images twice. Unequal per-rank counts are fine here because evaluation
    synchronises only once, after the loop. Cutting the batches before dealing them out puts every
    image in the same batch at any world size; kernels may round differently for another batch
    size, so this is what makes the per-image results, and the totals, bitwise identical.
    """

    def __init__(self, dataset, num_replicas, rank, batch_size):
        starts = range(rank * batch_size, len(dataset), num_replicas * batch_size)
        self.batches = [list(range(start, min(start + batch_size, len(dataset)))) for start in starts]

    def __iter__(self):
        return iter(self.batches)

    def __len__(self):
        return len(self.batches)


class ResumableSampler(torch.utils.data.distributed.DistributedSampler):
    """DistributedSampler whose epoch can start part-way: set_epoch(epoch, skip) leaves out the first
    `skip` indices of this rank's share, the samples a mid-epoch checkpoint had already trained on.

    The ranks' shares interleave (rank r takes positions r, r+W, ...), so skipping k*B/W on every
    rank skips exactly the first k global batches of B, at any world size.
    """

    skip = 0

    def set_epoch(self, epoch, skip=0):
        super().set_epoch(epoch)
        self.skip = skip

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self):
        return super().__len__() - self.skip


class SampleSeeded(torch.utils.data.Dataset):
    """Gives every sample's random augmentation its own seed, derived from (seed, epoch, index).

    An image then gets the same crop and flip whatever the world size, worker count or restart,
    so N processes see exactly the batches one process would, and a resumed run continues exactly.
    """

    def __init__(self, dataset, seed):
        self.dataset, self.seed, self.epoch = dataset, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, index):
        with torch.random.fork_rng(devices=[]):
            # Only the CPU generator, which the transforms draw from: torch.manual_seed would also
            # seed every CUDA device, 50x slower per image.
            torch.random.default_generator.manual_seed(
                ((self.seed * 1_000_003 + self.epoch) * 1_000_000_007 + index) % 2**63)
            return self.dataset[index]


class DummyImages(torch.utils.data.Dataset):
    """Synthetic images for benchmarking: a bank of 64 random images, so memory stays bounded."""

    def __init__(self, count, image_size, num_classes):
        generator = torch.Generator().manual_seed(count)
        self.bank = torch.randn(64, 3, image_size, image_size, generator=generator)
        self.count, self.num_classes = count, num_classes

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        return self.bank[index % len(self.bank)], index % self.num_classes


def build_datasets(args):
    """Train and val datasets plus the class count; bad data directories raise UsageError."""
    if args.dummy:
        num_classes = 1000
        return (DummyImages(args.dummy_samples, args.image_size, num_classes),
                DummyImages(max(1, args.dummy_samples // 10), args.image_size, num_classes), num_classes)
    if not args.data:
        raise UsageError("no dataset: pass --data DIR (with DIR/train and DIR/val) or --dummy")
    for split in ("train", "val"):
        path = os.path.join(args.data, split)
        if not os.path.isdir(path):
            raise UsageError(f"{path} is not a directory: --data must hold train/ and val/ in ImageFolder "
                             "layout (python tools/make_demo_data.py writes a demo set)")
    normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
    train_tf = transforms.Compose([transforms.RandomResizedCrop(args.image_size, scale=(args.min_crop_scale, 1.0)),
                                   transforms.RandomHorizontalFlip(), transforms.ToTensor(), normalize])
    val_tf = transforms.Compose([transforms.Resize(args.image_size * 256 // 224), transforms.CenterCrop(args.image_size),
                                 transforms.ToTensor(), normalize])
    try:
        train = datasets.ImageFolder(os.path.join(args.data, "train"), train_tf, loader=load_image)
        val = datasets.ImageFolder(os.path.join(args.data, "val"), val_tf, loader=load_image)
    except FileNotFoundError as e:  # no class folders, or a class folder without images
        raise UsageError(f"bad dataset in {args.data}: {e}") from None
    if val.classes != train.classes:
        missing = sorted(set(train.classes) ^ set(val.classes))
        raise UsageError(f"val classes differ from train classes in {args.data} (e.g. {missing[:5]}): "
                         "both must hold the same class folders")
    return train, val, len(train.classes)


def build_model(args, num_classes):
    known = models.list_models(module=models)
    if args.arch not in known:
        close = difflib.get_close_matches(args.arch, known, n=3)
        hint = f"did you mean {', '.join(close)}?" if close else "see torchvision.models.list_models()"
        raise UsageError(f"unknown --arch '{args.arch}': {hint}")
    kwargs = {"num_classes": num_classes}
    if args.norm == "group":
        if not args.arch.startswith(("resnet", "resnext", "wide_resnet")):
            raise UsageError(f"--norm group needs a ResNet-family --arch, not '{args.arch}'")
        kwargs["norm_layer"] = lambda channels: nn.GroupNorm(32, channels)
    return models.get_model(args.arch, **kwargs)


def lr_schedule(args, steps_per_epoch):
    """Factor on the base lr at optimizer step s: linear warmup, then pytorch/examples' step decay."""
    warmup_steps = args.warmup_epochs * steps_per_epoch

    def factor(step):
        warmup = min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0
        return warmup * args.lr_gamma ** ((step // steps_per_epoch) // args.lr_step_size)
    return factor


def rng_state(devices):
    """Every random generator this process draws from: the CPU's, Python's, and those of the GPUs in
    `devices` (the ones it trains on: --cpu never starts CUDA). CPU tensors, so it loads anywhere."""
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "devices": [torch.get_device_module(d).get_rng_state(d) for d in devices if d.type != "cpu"]}


def set_rng_state(state, devices):
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    # A checkpoint written on the CPU has no GPU state: the GPUs keep their seeded generators.
    for device, device_state in zip([d for d in devices if d.type != "cpu"], state["devices"]):
        torch.get_device_module(device).set_rng_state(device_state, device)


def to_cpu(state):
    """A copy of a (nested) state with every tensor on the CPU, so the checkpoint opens on any machine."""
    if isinstance(state, torch.Tensor):
        return state.cpu()
    if isinstance(state, dict):
        return {key: to_cpu(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(to_cpu(value) for value in state)
    return state


def save_checkpoint(state, is_best, output_dir):
    """Write checkpoint.pth atomically (temp file in the same directory, fsync, os.replace): a crash
    mid-write leaves the previous checkpoint intact, never a truncated one."""
    path = os.path.join(output_dir, "checkpoint.pth")
    fd, tmp = tempfile.mkstemp(dir=output_dir, prefix=".checkpoint.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(to_cpu(state), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        if is_best:
            fd, tmp = tempfile.mkstemp(dir=output_dir, prefix=".model_best.", suffix=".tmp")
            os.close(fd)
            shutil.copyfile(path, tmp)
            os.replace(tmp, os.path.join(output_dir, "model_best.pth"))
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def load_checkpoint(path, arch):
    """Load a checkpoint written by save_checkpoint; weights_only=True never runs pickled code.

    Everything is loaded onto the CPU, whatever device wrote it: load_state_dict then copies the
    weights to the model's device, and the RNG states must stay CPU tensors.
    """
    if not os.path.isfile(path):
        raise UsageError(f"no checkpoint at '{path}': pass an existing file to --resume (or --resume auto)")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"cannot load checkpoint '{path}' (truncated, corrupt or not a plain-tensor "
                         f"checkpoint): {reason}") from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise UsageError(f"'{path}' is not a checkpoint written by this cookbook (no state_dict)")
    if checkpoint.get("arch") != arch:
        raise UsageError(f"checkpoint '{path}' is for arch '{checkpoint.get('arch')}', not '{arch}': "
                         f"pass -a {checkpoint.get('arch')} or another checkpoint")
    return checkpoint


def load_optimizer_state(optimizer, state):
    """optimizer.load_state_dict, but keeping this run's choice of implementation (fused or foreach),
    which the checkpoint's param groups would otherwise replace with the saving run's."""
    chosen = [{key: group[key] for key in ("fused", "foreach") if key in group} for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, keep in zip(optimizer.param_groups, chosen):
        group.update(keep)


def state_digest(module):
    """SHA-256 of every parameter and buffer: equal digests mean bitwise-identical models."""
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def summary(kind, **fields):
    """One machine-readable JSON line (rank 0), for statistics.sh and the tests."""
    log(f"{kind} " + json.dumps(fields, sort_keys=False))

# ---- end of shared helpers ----


# ---- communication: the lines each method does its own way ----

def all_reduce_sum(tensor):
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_gather_objects(obj):
    if dist.is_available() and dist.is_initialized():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, obj)
        return gathered
    return [obj]


def broadcast_buffers(module):
    """Copy rank 0's BatchNorm running statistics to every rank.

    FSDP shards only the parameters: buffers stay whole on every rank, and each rank updates its running
    statistics from its own batch. Evaluating or saving with rank 0's buffers everywhere makes the
    distributed evaluation equal to a single-process evaluation of the saved checkpoint.
    """
    if dist.is_available() and dist.is_initialized():
        for buffer in module.buffers():
            dist.broadcast(buffer, src=0)


def shard_model(model, mesh, args):
    """fully_shard each block, then the root (it takes the rest: a ResNet's stem and fc).

    Each call makes one unit: its parameters are sharded over the ranks, all-gathered together
    just before its forward (and again for its backward) and freed after, and its gradients are
    reduce-scattered, averaged over ranks like DDP's all-reduce, as soon as backward leaves it. So
    only one unit is ever whole, and its communication overlaps the other units' compute; each
    unit costs a collective per pass, so a few large ones: each nn.Sequential child of the model
    (a ResNet's stages layer1-4; features and classifier in VGG, MobileNet, ...).
    """
    # None: no cast, FSDP computes and reduces in the parameters' own dtype.
    param_dtype, reduce_dtype = (getattr(torch, name) if name else None for name in (args.param_dtype, args.reduce_dtype))
    if param_dtype == torch.bfloat16:
        # BatchNorm fails on bf16 weights with its float32 running statistics ("Expected running_mean
        # to have type BFloat16"): each becomes a unit of its own that keeps float32 weights, takes
        # the bf16 activations as they are (as under autocast) and hands bf16 on.
        for norm in model.modules():
            if isinstance(norm, nn.modules.batchnorm._BatchNorm):
                fully_shard(norm, mesh=mesh,
                            mp_policy=MixedPrecisionPolicy(reduce_dtype=reduce_dtype, output_dtype=param_dtype))
    for block in model.children():
        if isinstance(block, nn.Sequential):
            fully_shard(block, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype, reduce_dtype))
    # Under a cast, float32 logits out of the root: the loss and top-k are computed in float32.
    fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype, reduce_dtype,
                                                                 output_dtype=torch.float32 if param_dtype else None))


def unwrapped(model, args, num_classes):
    """A plain torchvision model holding the whole sharded model, on this rank's CPU.

    Collective: full_tensor() all-gathers one sharded parameter at a time, straight to the CPU, so
    no device holds more than one whole parameter beyond its shards. The plain model is built on
    the meta device (no memory, no random init) and takes the gathered tensors as they are.
    """
    with torch.device("meta"):
        plain = build_model(args, num_classes)
    plain.load_state_dict({name: (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).cpu()
                           for name, tensor in model.state_dict().items()}, assign=True)
    return plain


# ---- sharded checkpoints: torch.distributed.checkpoint (DCP) ----
# Every rank writes and reads only its own shards, in parallel, and no rank ever holds the whole
# model or optimizer state. Only tensors go through DCP: it unpickles anything else with
# weights_only=False. The rest (epoch, scheduler, RNG, optimizer hyper-parameters) goes into a
# plain torch.save file in the same directory, loaded with weights_only=True.
SHARDED_PREFIX, TRAINER_STATE = "dcp-epoch", "trainer_state.pth"


def latest_sharded(output_dir):
    """The newest sharded checkpoint directory in output_dir (dcp-epochN at epoch ends, dcp-epochN-stepS
    within epoch N), or "" if there is none."""
    def position(path):  # (epoch, step)
        epoch, _, step = path.rsplit(SHARDED_PREFIX, 1)[1].partition("-step")
        return int(epoch), int(step or 0)
    paths = glob.glob(os.path.join(glob.escape(output_dir), SHARDED_PREFIX + "*"))
    return max(paths, key=position, default="")


def save_sharded(model, optimizer, trainer_state, output_dir):
    """Write output_dir/dcp-epochN[-stepS] atomically: all ranks write into a temporary directory that
    rank 0 renames into place once it is complete (a crash leaves the previous one intact), then rank 0
    removes the older ones."""
    step = f"-step{trainer_state['step']}" if trainer_state["step"] else ""
    path = os.path.join(output_dir, f"{SHARDED_PREFIX}{trainer_state['epoch']}{step}")
    tmp = tempfile.mkdtemp(dir=output_dir, prefix=".dcp.", suffix=".tmp") if RANK == 0 else None
    tmp = all_gather_objects(tmp)[0]  # rank 0's
    optimizer_state = get_optimizer_state_dict(model, optimizer)
    dcp.save({"model": get_model_state_dict(model), "optimizer": optimizer_state["state"]}, checkpoint_id=tmp)
    if RANK == 0:  # dcp.save returns once every rank's shards and rank 0's metadata are written
        with open(os.path.join(tmp, TRAINER_STATE), "wb") as f:
            torch.save(dict(trainer_state, param_groups=optimizer_state["param_groups"]), f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)
        for old in glob.glob(os.path.join(glob.escape(output_dir), SHARDED_PREFIX + "*")):
            if old != path:
                shutil.rmtree(old)


class MetadataUnpickler(pickle.Unpickler):
    """DCP reads a checkpoint's .metadata with a bare pickle.load, which runs whatever code a
    crafted file holds. restore() first reads it with this, which builds only what DCP's tensor
    metadata is made of (no BytesStorageMetadata either: DCP unpickles those entries' data)."""

    ALLOWED = {("torch", "Size"), ("pathlib", "PosixPath"), ("torch.serialization", "_get_layout"),
               ("torch.distributed.checkpoint.filesystem", "_StorageInfo")} | {
        ("torch.distributed.checkpoint.metadata", name) for name in (
            "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "TensorProperties",
            "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")}

    def find_class(self, module, name):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if dtype or (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in DCP metadata")


def restore(path, model, optimizer, device, args):
    """Load --resume PATH into the model (and, to train on, the optimizer); returns the checkpoint's
    other fields (epoch, best_acc1, scheduler, rng).

    PATH is a directory written by save_sharded, from which each rank reads only its shards, at any
    world size (DCP reshards); or, with -e, a single-file checkpoint (this script's export or
    distributed.py's), which each rank reads whole, keeping its shards.
    """
    single_file = os.path.isfile(path) and args.evaluate
    if not single_file and not os.path.isfile(os.path.join(path, TRAINER_STATE)):
        raise UsageError(f"no sharded checkpoint at '{path}': pass a {SHARDED_PREFIX}N directory of --output-dir "
                         "to --resume, or --resume auto (a single-file .pth checkpoint only with -e)")
    checkpoint = load_checkpoint(path, args.arch) if single_file else None
    try:
        if single_file:
            set_model_state_dict(model, checkpoint["state_dict"], options=StateDictOptions(full_state_dict=True))
            return checkpoint
        checkpoint = torch.load(os.path.join(path, TRAINER_STATE), weights_only=True)
        with open(os.path.join(path, ".metadata"), "rb") as f:
            MetadataUnpickler(f).load()
        sharded = {"model": get_model_state_dict(model)}
        if not args.evaluate:
            sharded["optimizer"] = get_optimizer_state_dict(model, optimizer)["state"]
        dcp.load(sharded, checkpoint_id=path)  # in place, into this rank's shards
        set_model_state_dict(model, sharded["model"])
        if not args.evaluate:
            set_optimizer_state_dict(model, optimizer, {"state": sharded["optimizer"],
                                                        "param_groups": checkpoint["param_groups"]})
    except (Exception, dcp.CheckpointException) as e:
        if isinstance(e, dcp.CheckpointException):  # a BaseException wrapping each failed rank's exception
            e = next(iter(e.failures.values()))[0]
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"cannot load checkpoint '{path}' into this model ({reason}): another -a or number of "
                         "classes, or a truncated, corrupt or not plain-tensor checkpoint") from None
    return checkpoint


def setup_distributed(args):
    """Check the launch, pick the device and join the process group: (rank, world, local rank, device).

    Every input check runs before the rendezvous, so a bad flag fails all ranks alike and at once.
    """
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = args.local_rank if args.local_rank is not None else int(os.environ.get("LOCAL_RANK", 0))
    # The accelerator torch was built for (CUDA here) if one is visible, else the CPU; --cpu forces it.
    accelerator = None if args.cpu else torch.accelerator.current_accelerator(check_available=True)
    if args.sync_bn and (accelerator is None or accelerator.type != "cuda"):
        raise UsageError("--sync-bn needs CUDA: SyncBatchNorm works only with CUDA modules (drop --sync-bn on CPU)")
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # processes on this node, from the launcher
    if accelerator is not None and local_world_size > torch.accelerator.device_count():
        # All processes of this node fail alike: its local rank 0 says why (rank 0 may be on another node).
        raise (LocalError if local_rank == 0 else UsageError)(
            f"{local_world_size} processes on this node, which shows {torch.accelerator.device_count()} GPU(s): "
            "start at most one process per GPU")
    if not args.evaluate and (args.batch_size < world_size * args.grad_accum_steps
                              or args.batch_size % (world_size * args.grad_accum_steps)):
        raise UsageError(f"global batch -b {args.batch_size} must be a multiple of world size {world_size} "
                         f"x --grad-accum-steps {args.grad_accum_steps}")
    if (not args.evaluate and args.norm == "batch" and not args.sync_bn
            and args.batch_size == world_size * args.grad_accum_steps):
        raise UsageError(f"-b {args.batch_size} leaves 1 image per process and micro-batch, too few for BatchNorm's "
                         "statistics: raise -b, or pass --norm group (or --sync-bn on GPUs)")
    if RANK == 0 and not args.evaluate:
        try:
            os.makedirs(args.output_dir, exist_ok=True)
            tempfile.TemporaryFile(dir=args.output_dir).close()
        except OSError as e:
            raise UsageError(f"cannot write checkpoints to --output-dir '{args.output_dir}': {e.strerror}") from None
    if accelerator is None:
        device = torch.device("cpu")
    else:
        # Pick this process's GPU before any GPU work, so nothing is allocated on GPU 0 by accident.
        torch.accelerator.set_device_index(local_rank)
        device = torch.device(accelerator.type, local_rank)
    # bf16 also runs on the CPU (gloo carries it; slow without AVX512-BF16/AMX), so the tests cover it there.
    # including_emulation=False: older GPUs run bf16 only emulated (the default True says they support it).
    if ("bfloat16" in (args.param_dtype, args.reduce_dtype) and device.type == "cuda"
            and not torch.cuda.is_bf16_supported(including_emulation=False)):
        raise UsageError("--param-dtype/--reduce-dtype bfloat16 needs an Ampere or newer GPU: leave it out or use float32")
    if world_size > 1:
        try:
            # nccl on GPUs, gloo on the CPU; device_id binds the group to this GPU (none on the CPU).
            dist.init_process_group(dist.get_default_backend_for_device(device),
                                    timeout=timedelta(seconds=args.dist_timeout),
                                    device_id=None if device.type == "cpu" else device)
        except dist.DistNetworkError as e:
            raise UsageError(f"cannot join the process group at {os.environ.get('MASTER_ADDR')}:"
                             f"{os.environ.get('MASTER_PORT')} ({str(e).splitlines()[0]}): if the port is "
                             "in use pass another --master-port to the launcher (or set MASTER_PORT)") from None
    else:
        # fully_shard needs a process group even for one process (a mesh of one rank): one on an
        # in-memory store, so a plain `python fsdp_distributed.py` needs no launcher or port.
        dist.init_process_group(dist.get_default_backend_for_device(device), store=dist.HashStore(), rank=0,
                                world_size=1, device_id=None if device.type == "cpu" else device)
    return RANK, world_size, local_rank, device


def stalled_ranks(grace=5.0):
    """After a collective timed out, the ranks that stalled.

    The timed-out group's connections are closed, so every rank still alive checks in on the
    rendezvous store instead (torchrun's, or rank 0's without it) and, after `grace` seconds for the
    others to time out too, lists who did not. A store that does not answer is rank 0's: rank 0 stalled.
    """
    if "MASTER_ADDR" not in os.environ:  # a file:// rendezvous: no store to meet on
        return []
    key = f"cookbook/alive/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"  # one namespace per torchrun attempt
    world_size, alive = dist.get_world_size(), []

    def check_in():  # in a thread: a client of a stopped store waits for ever, whatever its timeout
        try:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=timedelta(seconds=grace))
            store.set(key + str(RANK), "1")
            time.sleep(grace)
            alive.extend(r for r in range(world_size) if store.check([key + str(r)]))
        except dist.DistError:
            pass

    thread = threading.Thread(target=check_in, daemon=True)
    thread.start()
    thread.join(3 * grace)
    return [r for r in range(world_size) if r not in alive] if alive else [0]


def launcher_name(args):
    if args.local_rank is not None:
        return "torch.distributed.launch"
    return "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "none"


# @record: under torchrun, an uncaught exception's traceback goes into torchrun's failure summary,
# which otherwise only says "To enable traceback see ...".
@record
def main(argv=None):
    args = parse_args(argv)
    try:
        main_worker(args)
        # fully_shard's modules reach themselves through their hooks and state, so they outlive
        # main_worker until a cyclic garbage collection. Left to the one at interpreter exit, their
        # freeing (and that of the gloo work they hold) can abort the process (seen once in CI): free
        # them now, while the interpreter is whole.
        gc.collect()
    except UsageError as e:
        report(e)
        sys.exit(2)
    except RuntimeError as e:
        # gloo's words for a timed-out collective: on the one that waited, or on a later one that
        # found its connections closed by the timeout.
        if not (dist.is_initialized() and ("Timed out waiting" in str(e) or "Application timeout" in str(e))):
            raise
        stalled = stalled_ranks()
        if not stalled:
            raise
        if RANK == min(set(range(dist.get_world_size())) - set(stalled)):  # one line, from the lowest live rank
            print(f"error: rank(s) {', '.join(map(str, stalled))} stalled: the others waited --dist-timeout "
                  f"{args.dist_timeout:g} s for them in a collective (a hang, a stopped process, or far slower "
                  "work: py-spy dump shows where it is)", file=sys.stderr, flush=True)
        sys.exit(1)


def main_worker(args):
    if args.seed is not None:
        # Deterministic kernels; cuBLAS needs this workspace setting before it starts.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        random.seed(args.seed)
        torch.manual_seed(args.seed)
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        torch.backends.cudnn.benchmark = True
    train_set, val_set, num_classes = build_datasets(args)
    model = build_model(args, num_classes)
    rank, world_size, local_rank, device = setup_distributed(args)
    if args.sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model.to(device)
    # Unlike DDP, fully_shard does not broadcast rank 0's initial weights: each rank would keep its
    # own slice of its own random initialisation. Start from rank 0's, as DDP does.
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, src=0)
    # One mesh of all ranks on this process's device type: without one, fully_shard builds it on the
    # accelerator torch was built for, even under --cpu (CUDA tensors, a gloo group: it fails).
    shard_model(model, init_device_mesh(device.type, (world_size,)), args)
    log(f"=> {METHOD}: world size {world_size}, device {device.type}, arch {args.arch}, "
        f"global batch {args.batch_size} ({args.batch_size // world_size // args.grad_accum_steps} per process "
        f"x {args.grad_accum_steps} micro-batches), launcher {launcher_name(args)}")

    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    train_set = SampleSeeded(train_set, seed)
    # DistributedSampler gives each rank a disjoint 1/W of a permutation that depends only on
    # (seed, epoch), so rank r's micro-batches of one step together form the same global batch a
    # single process would take. drop_last: drop the tail instead of padding it with duplicates.
    train_sampler = ResumableSampler(
        train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
    micro_batch = max(1, args.batch_size // world_size // args.grad_accum_steps)  # -e skips the -b checks
    loader_kwargs = {"num_workers": args.workers, "pin_memory": device.type != "cpu"}
    train_loader = torch.utils.data.DataLoader(
        train_set, batch_size=micro_batch, sampler=train_sampler, drop_last=True,
        generator=torch.Generator().manual_seed(seed + rank), **loader_kwargs)
    val_loader = torch.utils.data.DataLoader(
        val_set, batch_sampler=ShardSampler(val_set, world_size, rank, args.val_batch_size), **loader_kwargs)
    steps_per_epoch = len(train_loader) // args.grad_accum_steps
    if steps_per_epoch == 0 and not args.evaluate:
        raise UsageError(f"the train set ({len(train_set)} images) is smaller than one global batch "
                         f"(-b {args.batch_size}): lower -b")
    if args.save_every < 0:
        raise UsageError(f"--save-every {args.save_every}: pass a number of steps, or 0 to checkpoint at epoch "
                         "ends only")

    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), args.lr * args.batch_size / 256,
                                momentum=args.momentum, weight_decay=args.weight_decay)
    for group in optimizer.param_groups:
        group["initial_lr"] = group["lr"]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_schedule(args, max(1, steps_per_epoch)),
                                                  last_epoch=args.start_epoch * steps_per_epoch - 1)

    best_acc1, start_step = 0.0, 0
    resume = args.resume
    if resume == "auto":
        resume = latest_sharded(args.output_dir)
        if not resume:
            log(f"=> --resume auto: no checkpoint in '{args.output_dir}', starting fresh")
    if resume:
        checkpoint = restore(resume, model, optimizer, device, args)
        args.start_epoch, start_step = checkpoint["epoch"], checkpoint.get("step", 0)
        if start_step and checkpoint["args"]["batch_size"] != args.batch_size:  # the steps to skip are its batches
            raise UsageError(f"checkpoint '{resume}' stopped in an epoch, after step {start_step} of -b "
                             f"{checkpoint['args']['batch_size']}: resume it with that -b")
        best_acc1 = checkpoint["best_acc1"]
        if not args.evaluate:
            scheduler.load_state_dict(checkpoint["scheduler"])
            if len(checkpoint["rng"]) == world_size:
                set_rng_state(checkpoint["rng"][rank], [device])
                train_loader.generator.set_state(checkpoint["rng"][rank]["loader"])
            else:
                log(f"=> checkpoint has RNG state for {len(checkpoint['rng'])} ranks, not {world_size}: "
                    "data order stays exact, other random state is reseeded")
        log(f"=> loaded checkpoint '{resume}' (epoch {args.start_epoch}, step {start_step})")

    if args.evaluate:
        val = validate(val_loader, model, device)
        summary("SUMMARY", method=METHOD, launcher=launcher_name(args), world_size=world_size,
                device=device.type, epoch=args.start_epoch - 1, **{f"val_{k}": v for k, v in val.items()})
        return finish(unwrapped(model, args, num_classes))

    def save(epoch, step, loader_state, is_best=False):
        """Checkpoint the state after `step` optimizer steps of `epoch` (a whole epoch: epoch + 1, step 0)."""
        rngs = all_gather_objects(dict(rng_state([device]), loader=loader_state))  # collective: all ranks' RNG
        save_sharded(model, optimizer, {"epoch": epoch, "step": step, "arch": args.arch,
                                        "scheduler": scheduler.state_dict(), "best_acc1": best_acc1,
                                        "world_size": world_size, "rng": rngs, "args": vars(args)}, args.output_dir)
        if step:
            return
        # And the whole model in one file, for an unwrapped model (inference, fine-tuning, distributed.py -e).
        # Collective: each sharded parameter is all-gathered in turn onto rank 0's CPU (the others get {}).
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            save_checkpoint({"epoch": epoch, "arch": args.arch, "state_dict": full,
                             "best_acc1": best_acc1, "world_size": world_size, "args": vars(args)},
                            is_best, args.output_dir)

    for epoch in range(args.start_epoch, args.epochs):
        # set_epoch reshuffles: without it every epoch would visit the data in the same order. After
        # a mid-epoch checkpoint, the batches it had trained on are skipped, not loaded and dropped.
        train_sampler.set_epoch(epoch, skip=start_step * args.grad_accum_steps * micro_batch)
        train_set.set_epoch(epoch)
        # The loader draws its workers' seeds from its generator as the epoch starts: mid-epoch
        # checkpoints keep the state from before that draw, so a resumed epoch makes the same one.
        loader_state = train_loader.generator.get_state()
        start = time.perf_counter()
        train_metrics, train_time, data_wait = train(train_loader, model, criterion, optimizer, scheduler, epoch,
                                                     start_step, steps_per_epoch, device, args,
                                                     lambda step: save(epoch, step, loader_state))
        start_step = 0
        val = validate(val_loader, model, device)
        epoch_time = time.perf_counter() - start

        is_best = val["acc1"] > best_acc1
        best_acc1 = max(val["acc1"], best_acc1)
        save(epoch + 1, 0, train_loader.generator.get_state(), is_best)
        summary("SUMMARY", method=METHOD, launcher=launcher_name(args), world_size=world_size,
                device=device.type, epoch=epoch, train_loss=train_metrics["loss"], train_acc1=train_metrics["acc1"],
                val_loss=val["loss"], val_acc1=val["acc1"], val_acc5=val["acc5"], val_count=val["count"],
                epoch_time=round(epoch_time, 3), images_per_sec=round(train_metrics["count"] / train_time, 1),
                data_wait=round(data_wait / train_time, 4), lr=optimizer.param_groups[0]["lr"])
    finish(unwrapped(model, args, num_classes), best_acc1=best_acc1)


def train(loader, model, criterion, optimizer, scheduler, epoch, first_step, steps, device, args, save):
    """One epoch from optimizer step first_step (after a mid-epoch resume, else 0), calling save(step)
    every --save-every steps. Returns (globally reduced metrics, seconds, seconds spent waiting for data)."""
    model.train()
    meter = AverageMeter(device)
    progress = ProgressMeter(steps, prefix=f"Epoch: [{epoch}]")
    accum = args.grad_accum_steps
    batches = iter(loader)
    data_wait = interval_wait = 0.0
    start = interval_start = time.perf_counter()
    for step in range(first_step, steps):
        for micro in range(accum):
            t0 = time.perf_counter()
            images, target = next(batches)
            waited = time.perf_counter() - t0
            data_wait += waited
            interval_wait += waited
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            # FSDP2's no_sync: on all but the last micro-batch, backward skips the reduce-scatter and
            # accumulates the unsharded gradients locally, so FSDP communicates once per optimizer
            # step instead of once per micro-batch (at the cost of holding whole gradients meanwhile).
            # The last one reduce-scatters the sum, averaged over ranks like DDP's all-reduce.
            model.set_requires_gradient_sync(micro == accum - 1)
            output = model(images)
            loss = criterion(output, target)
            # Dividing by the micro-batch count makes the accumulated gradient the mean over the
            # whole global batch, as if it had been one batch.
            (loss / accum).backward()
            correct1, correct5 = correct_counts(output.detach(), target)
            meter.update(loss.detach() * target.size(0), correct1, correct5, target.size(0))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if (step + 1) % args.print_freq == 0 or step + 1 == steps:
            metrics = meter.reduced()  # the only host sync: once per print interval
            now = time.perf_counter()
            done = min(step % args.print_freq, step - first_step) + 1
            progress.display(step + 1, metrics, (now - interval_start) / done, interval_wait / done)
            interval_start, interval_wait = now, 0.0
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < steps:  # the last: main_worker's
            save(step + 1)
    return meter.reduced(), time.perf_counter() - start, data_wait


def validate(loader, model, device):
    """Exact evaluation: every val image counted once; (sum, count) reduced over ranks, not means."""
    broadcast_buffers(model)
    model.eval()
    meter = AverageMeter(device)
    # Each FSDP forward all-gathers every unit's parameters: collectives all ranks must join, so all
    # run as many forwards as the rank with the most val batches (ShardSampler's counts differ by at
    # most one). A rank out of batches forwards a stand-in image and discards the output.
    rounds = torch.tensor(len(loader), device=device)
    dist.all_reduce(rounds, op=dist.ReduceOp.MAX)
    batches = iter(loader)
    with torch.no_grad():
        for _ in range(int(rounds)):
            images, target = next(batches, (None, None))
            if images is None:
                model(loader.dataset[0][0].unsqueeze(0).to(device))
                continue
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            output = model(images)
            correct1, correct5 = correct_counts(output, target)
            meter.update(F.cross_entropy(output, target, reduction="none").double().sum(), correct1, correct5,
                         target.size(0))
    # The root keeps its parameters gathered after forward, for the backward that follows in
    # training; here none follows, so free them (and give the optimizer its sharded ones back).
    model.reshard()
    metrics = meter.reduced()
    log(f" * Acc@1 {metrics['acc1']:.3f} Acc@5 {metrics['acc5']:.3f} Loss {metrics['loss']:.4f} "
        f"({metrics['count']} images)")
    return metrics


def finish(model, best_acc1=None):
    """Report the digest of the whole final model (every rank's own gathered copy), then leave the
    process group cleanly."""
    digests = all_gather_objects(state_digest(model))
    fields = {"method": METHOD, "state_sha256": digests, "ranks_identical": len(set(digests)) == 1}
    if best_acc1 is not None:
        fields["best_acc1"] = best_acc1
    summary("DONE", **fields)
    if dist.is_available() and dist.is_initialized():
        # A barrier before teardown: a rank that exits while a peer is still in a collective can
        # make the peer abort at interpreter exit.
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
