#!/usr/bin/env python
"""ImageNet training with nn.DataParallel: one process drives every visible GPU.

    python dataparallel.py --data /path/to/imagenet                  # all visible GPUs
    python dataparallel.py --gpus 0,1 --data /path/to/imagenet       # GPUs 0 and 1

Each step scatters the batch over the GPUs, runs one model replica per GPU in threads and gathers
the outputs and gradients on the first GPU. No launcher, no process group; simpler than DDP but
slower (one Python process, the GIL, and the first GPU does all the gathering). Without a GPU it
trains on the CPU in one process.
"""
import argparse
import difflib
import hashlib
import itertools
import json
import os
import random
import shutil
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.data
import torchvision.datasets as datasets
import torchvision.models as models
import torchvision.transforms as transforms

METHOD = "dataparallel"
RANK = 0  # one process: log() always prints


def gpu_list(text):
    return [int(gpu) for gpu in text.split(",")]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="PyTorch ImageNet training with DataParallel",
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
                        help="batch size per optimizer step, split by DataParallel over the GPUs "
                             "(and over --grad-accum-steps micro-batches)")
    parser.add_argument("--val-batch-size", type=int, default=64,
                        help="evaluation batch per process; the same at every world size, so the val numbers are too")
    parser.add_argument("--grad-accum-steps", type=int, default=1,
                        help="micro-batches per optimizer step (gradients add up on the first GPU)")
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
    parser.add_argument("--output-dir", default="checkpoints", help="where rank 0 writes checkpoints")
    parser.add_argument("--save-every", type=int, default=0, metavar="N",
                        help="also checkpoint every N optimizer steps within an epoch (0: at epoch ends only); "
                             "a run resumed from one skips the batches already trained on")
    parser.add_argument("--resume", default="", metavar="PATH",
                        help="checkpoint to resume from, or 'auto' for the latest in --output-dir (fresh start if none)")
    parser.add_argument("-e", "--evaluate", action="store_true", help="evaluate the model on val and exit")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed everything and use deterministic algorithms (bitwise-reproducible on CPU)")
    parser.add_argument("--cpu", action="store_true", help="use the CPU and gloo even if GPUs are visible")
    parser.add_argument("--gpus", type=gpu_list, default=None, metavar="0,1,...",
                        help="GPU ids to use, the first one holding the model (default: all visible GPUs)")
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
# DataParallel runs in one process: metrics, RNG states and weights are all here already.

def all_reduce_sum(tensor):
    return tensor


def setup_device(args):
    """Check the input and pick the devices: (device, GPU ids for DataParallel, empty on the CPU)."""
    if not args.evaluate and (args.batch_size < args.grad_accum_steps or args.batch_size % args.grad_accum_steps):
        raise UsageError(f"batch -b {args.batch_size} must be a multiple of --grad-accum-steps {args.grad_accum_steps}")
    if not args.evaluate:
        try:
            os.makedirs(args.output_dir, exist_ok=True)
            tempfile.TemporaryFile(dir=args.output_dir).close()
        except OSError as e:
            raise UsageError(f"cannot write checkpoints to --output-dir '{args.output_dir}': {e.strerror}") from None
    accelerator = None if args.cpu else torch.accelerator.current_accelerator(check_available=True)
    count = torch.accelerator.device_count() if accelerator else 0
    if accelerator is None and args.gpus is not None:
        raise UsageError("--gpus needs CUDA GPUs, and none are visible (or --cpu was given): drop --gpus")
    gpus = [] if accelerator is None else args.gpus if args.gpus is not None else list(range(count))
    if len(set(gpus)) != len(gpus) or not all(0 <= gpu < count for gpu in gpus):
        raise UsageError(f"--gpus {','.join(map(str, gpus))}: pass distinct ids of the {count} visible GPUs "
                         f"(0 to {count - 1})")
    # Each replica's BatchNorm normalises over its own chunk of the micro-batch, and DataParallel cuts
    # it as torch.chunk does: 5 images over 4 GPUs make chunks of 2, 2 and 1.
    shares = torch.arange(args.batch_size // args.grad_accum_steps).chunk(max(1, len(gpus)))
    if not args.evaluate and args.norm == "batch" and min(map(len, shares)) < 2:
        raise UsageError(f"-b {args.batch_size} leaves 1 image to a GPU (or micro-batch), too few for BatchNorm's "
                         "statistics: raise -b, or pass --norm group")
    if not gpus:
        log("=> no GPU visible (or --cpu): DataParallel needs GPUs, so this trains on the CPU in one process")
        return torch.device("cpu"), []
    # DataParallel keeps the model and gathers outputs and gradients on the first listed GPU: make
    # it the current device before any GPU work, so nothing lands on GPU 0 by accident.
    torch.accelerator.set_device_index(gpus[0])
    return torch.device(accelerator.type, gpus[0]), gpus


def main(argv=None):
    args = parse_args(argv)
    try:
        main_worker(args)
    except UsageError as e:
        report(e)
        sys.exit(2)


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
    device, gpus = setup_device(args)
    model.to(device)
    if gpus:
        # Every forward copies the weights to each GPU, splits the batch over the replicas and gathers
        # the outputs on gpus[0]; backward sums the gradients there. Only gpus[0]'s replica keeps its
        # BatchNorm running statistics, computed from its share of the batch.
        model = nn.DataParallel(model, device_ids=gpus)
    module = model.module if gpus else model
    devices = [torch.device(device.type, gpu) for gpu in gpus] or [device]  # each runs a replica: all their RNGs
    log(f"=> {METHOD}: one process, GPUs {gpus or 'none'}, device {device.type}, arch {args.arch}, "
        f"batch {args.batch_size} ({args.batch_size // args.grad_accum_steps} per micro-batch "
        f"x {args.grad_accum_steps} micro-batches)")

    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    train_set = SampleSeeded(train_set, seed)
    # One process reads whole batches: distributed.py's sampler as its only replica, so the shuffle is
    # the permutation distributed.py's ranks share out, and runs compare with it directly.
    train_sampler = ResumableSampler(train_set, num_replicas=1, rank=0, shuffle=True, seed=seed, drop_last=True)
    micro_batch = max(1, args.batch_size // args.grad_accum_steps)  # -e skips the -b checks
    loader_kwargs = {"num_workers": args.workers, "pin_memory": device.type != "cpu"}
    train_loader = torch.utils.data.DataLoader(
        train_set, batch_size=micro_batch, sampler=train_sampler, drop_last=True,
        generator=torch.Generator().manual_seed(seed), **loader_kwargs)
    val_loader = torch.utils.data.DataLoader(val_set, batch_size=args.val_batch_size, **loader_kwargs)
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
        resume = os.path.join(args.output_dir, "checkpoint.pth")
        if not os.path.isfile(resume):
            log(f"=> --resume auto: no checkpoint in '{args.output_dir}', starting fresh")
            resume = ""
    if resume:
        checkpoint = load_checkpoint(resume, args.arch)
        try:
            module.load_state_dict(checkpoint["state_dict"])
        except RuntimeError as e:
            raise UsageError(f"checkpoint '{resume}' does not fit this model ({str(e).splitlines()[0]}): "
                             "check -a and the number of classes") from None
        args.start_epoch, start_step = checkpoint["epoch"], checkpoint.get("step", 0)
        if start_step and checkpoint["args"]["batch_size"] != args.batch_size:  # the steps to skip are its batches
            raise UsageError(f"checkpoint '{resume}' stopped in an epoch, after step {start_step} of -b "
                             f"{checkpoint['args']['batch_size']}: resume it with that -b")
        best_acc1 = checkpoint["best_acc1"]
        if not args.evaluate:
            load_optimizer_state(optimizer, checkpoint["optimizer"])
            scheduler.load_state_dict(checkpoint["scheduler"])
            if len(checkpoint["rng"]) == 1:
                set_rng_state(checkpoint["rng"][0], devices)
                train_loader.generator.set_state(checkpoint["rng"][0]["loader"])
            else:
                log(f"=> checkpoint has RNG state for {len(checkpoint['rng'])} ranks, not one process: "
                    "data order stays exact, other random state is reseeded")
        log(f"=> loaded checkpoint '{resume}' (epoch {args.start_epoch}, step {start_step})")

    if args.evaluate:
        val = validate(val_loader, model, device)
        summary("SUMMARY", method=METHOD, launcher="none", world_size=1,
                device=device.type, epoch=args.start_epoch - 1, **{f"val_{k}": v for k, v in val.items()})
        return finish(model)

    def save(epoch, step, loader_state, is_best=False):
        """Checkpoint the state after `step` optimizer steps of `epoch` (a whole epoch: epoch + 1, step 0)."""
        save_checkpoint({"epoch": epoch, "step": step, "arch": args.arch, "state_dict": module.state_dict(),
                         "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                         "best_acc1": best_acc1, "world_size": 1, "rng": [dict(rng_state(devices), loader=loader_state)],
                         "args": vars(args)}, is_best, args.output_dir)

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
        summary("SUMMARY", method=METHOD, launcher="none", world_size=1,
                device=device.type, epoch=epoch, train_loss=train_metrics["loss"], train_acc1=train_metrics["acc1"],
                val_loss=val["loss"], val_acc1=val["acc1"], val_acc5=val["acc5"], val_count=val["count"],
                epoch_time=round(epoch_time, 3), images_per_sec=round(train_metrics["count"] / train_time, 1),
                data_wait=round(data_wait / train_time, 4), lr=optimizer.param_groups[0]["lr"])
    finish(model, best_acc1=best_acc1)


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
        for _ in range(accum):
            t0 = time.perf_counter()
            images, target = next(batches)
            waited = time.perf_counter() - t0
            data_wait += waited
            interval_wait += waited
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
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
    """Exact evaluation: every val image counted once, as (sum, count)."""
    model.eval()  # DataParallel splits the val batches over the GPUs too
    meter = AverageMeter(device)
    with torch.no_grad():
        for images, target in loader:
            images = images.to(device, non_blocking=True)
            target = target.to(device, non_blocking=True)
            output = model(images)
            correct1, correct5 = correct_counts(output, target)
            meter.update(F.cross_entropy(output, target, reduction="none").double().sum(), correct1, correct5,
                         target.size(0))
    metrics = meter.reduced()
    log(f" * Acc@1 {metrics['acc1']:.3f} Acc@5 {metrics['acc5']:.3f} Loss {metrics['loss']:.4f} "
        f"({metrics['count']} images)")
    return metrics


def finish(model, best_acc1=None):
    """Report the final model's digest."""
    module = model.module if isinstance(model, nn.DataParallel) else model
    digests = [state_digest(module)]
    fields = {"method": METHOD, "state_sha256": digests, "ranks_identical": len(set(digests)) == 1}
    if best_acc1 is not None:
        fields["best_acc1"] = best_acc1
    summary("DONE", **fields)


if __name__ == "__main__":
    main()
