#!/usr/bin/env python
"""Our trainers against their strongest peers, side by side on the same JPEGs: the fast recipe
(apex_distributed.py) against timm, and plain distributed.py against pytorch/examples' imagenet main.py.

    python benchmarks/vs_timm.py                                        # GPU defaults, about 5 minutes
    python benchmarks/vs_timm.py --pairs fast,plain,compiled --rounds 3 --time-budget 900
    python benchmarks/vs_timm.py --data /path/to/imagenet-subset --steps 100

Pairs (each run its own process, one process on one GPU, as a user starts it; no GPU: the CPU):
  fast      apex_distributed.py --amp-dtype float16 --channels-last on, against timm's train.py --amp
            --amp-dtype float16 --channels-last --pin-mem (--amp-dtype picks bfloat16, or float32: no autocast)
  compiled  the same plus apex_distributed.py --compile and train.py --torchcompile (inductor)
  plain     distributed.py (fp32) against main.py (fp32); main.py crops 224 px whatever --image-size says, so this
            pair always trains at 224
The same model (-a; timm's own model of that name for timm: ResNet-50 is the same network in both), batch (-b,
one process), crop, loader workers (-j), optimizer (SGD, momentum 0.9, no Nesterov, weight decay 1e-4, lr
0.1 * b / 256), loss (cross-entropy, no label smoothing) and augmentation: RandomResizedCrop (scale 0.08-1,
ratio 3/4-4/3, bilinear) and a horizontal flip, nothing else (train.py gets --color-jitter 0, --smoothing 0,
--train-interpolation bilinear, --opt momentum --weight-decay 1e-4; its mixup, cutmix, RandAugment and random
erasing are off by default). Each script keeps its own input pipeline (ours: torchvision.io decoding, uint8 to
the GPU; timm: PIL, uint8 through its prefetcher, normalised on the GPU; main.py: PIL, float32 normalised in the
workers), per-step host syncs (timm and main.py read the loss every step, ours every -p steps) and evaluation.

Rate: images/s in the last (by default second) epoch, steady state: this script times each progress line as it
arrives (every -p steps; ours and timm sync the GPU before printing it, main.py every step) and divides the images
trained between the first line at or after step -p and the epoch's last line by the time between them. So the
start of an epoch (loader workers starting, the first batch) and evaluation are left out alike for every script.
Rounds alternate the two sides of a pair (ours first, then the peer first), so a drift slows both; a pair's ratio
is the median of ours over the median of the peer, over the rounds where both were measured.

Without --data it writes a JPEG ImageFolder of ImageNet's sizes with tools/make_imagenet_like.py (1,000 classes,
--steps * -b train images: one epoch; one val image a class) under data/, reused by later runs. --time-budget
covers everything (making the data, compiling); a run that would not fit is skipped, one still running at the
deadline is stopped, and --output-dir's vs_timm.md and vs_timm.json are rewritten after every run, so a run cut
short keeps what it measured. Logs: --output-dir/logs/.

The peers are not part of this repository: put them under benchmarks/peers/ (ignored by git).
  benchmarks/peers/timm_train.py      github.com/huggingface/pytorch-image-models, train.py, at commit
                                      aa4b5850c1543fa488abf260f18390eda46cf85d (2026-08-08; timm 1.0.29.dev0);
                                      it runs with pip's timm 1.0.31. With --timm-train '', or if it fails (one
                                      line says why), timm is a loop on its public API instead: create_model,
                                      create_dataset, create_loader (PIL, its prefetcher, normalisation on the
                                      device), create_optimizer_v2 ("momentum"), NativeScaler for fp16
  benchmarks/peers/imagenet_main.py   github.com/pytorch/examples, imagenet/main.py, at commit
                                      77f55b912142e11fcfdf5b530231fb9c52f181e8 (2025-08-25)
A peer that is missing (the default path, or the one named) is a warning at the start and at the end, a bold
line in the report and exit status 1: the fast pairs then time the API loop, the plain pair is skipped.
For example: git clone https://github.com/huggingface/pytorch-image-models && git -C pytorch-image-models show
aa4b5850:train.py > benchmarks/peers/timm_train.py; the same for examples' 77f55b91:imagenet/main.py ->
benchmarks/peers/imagenet_main.py. Being ignored by git, the folder does not travel with the tracked files:
send it to the GPU machine along with them (docs/measurements.md).

Checked on the 2-core CPU machine (2026-11-26, torch 2.14.1, timm 1.0.31), every path end to end (ours, timm's
train.py, the timm API loop, main.py) with tiny settings: see docs/measurements.md. No end-to-end test: one run of
the four scripts takes minutes on a CPU (tests/test_tools.py checks the missing-peer warning alone).
"""
import argparse
import datetime
import importlib.metadata
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PEERS = REPO / "benchmarks" / "peers"
# A progress line: its epoch (from 0) and step; timm's step counts from 0, the others' from 1.
EPOCH_LINE = re.compile(r"Epoch: \[(?P<epoch>\d+)\]\[\s*(?P<step>\d+)/(?P<steps>\d+)\]")
TIMM_LINE = re.compile(r"Train: (?P<epoch>\d+) \[\s*(?P<step>\d+)/(?P<steps>\d+)")
PAIRS = {"fast": "{}, channels_last", "compiled": "{}, channels_last, torch.compile", "plain": "fp32, 224 px"}
GOAL = 1.10


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="an ImageFolder with train/ and val/ (default: one written under data/)")
    p.add_argument("--pairs", default="fast,plain", help="of: fast, compiled, plain (default: fast,plain)")
    p.add_argument("-a", "--arch", default="resnet50",
                   help="a model both torchvision and timm have (default: resnet50)")
    p.add_argument("--image-size", type=int, default=224, help="train crop of the fast pairs (default: 224)")
    p.add_argument("-b", "--batch", type=int, default=128, help="images per step, one process (default: 128)")
    p.add_argument("--steps", type=int, default=60, help="steps per epoch of the data written (default: 60)")
    p.add_argument("--classes", type=int, default=1000, help="classes of the data written (default: 1000)")
    p.add_argument("-j", "--workers", type=int, default=max(1, len(os.sched_getaffinity(0)) - 2),
                   help="loader workers of every script (default: the cores less 2)")
    p.add_argument("--epochs", type=int, default=2, help="epochs per run; the last is measured (default: 2)")
    p.add_argument("-p", "--print-freq", type=int, default=10, help="steps between progress lines (default: 10)")
    p.add_argument("--amp-dtype", choices=["float16", "bfloat16", "float32"], default="float16",
                   help="autocast of the fast pairs; float32: none (default: float16)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds (default: 2)")
    p.add_argument("--time-budget", type=float, default=280, help="seconds for everything (default: 280)")
    p.add_argument("--run-timeout", type=float, default=240, help="seconds before one run is stopped (default: 240)")
    p.add_argument("--timm-train", default=str(PEERS / "timm_train.py"),
                   help="timm's train.py; '' or absent: the timm API loop (default: benchmarks/peers/timm_train.py)")
    p.add_argument("--main-py", default=str(PEERS / "imagenet_main.py"),
                   help="pytorch/examples' imagenet/main.py (default: benchmarks/peers/imagenet_main.py)")
    p.add_argument("--output-dir", type=Path, default=REPO / "logs" / "vs_timm")
    p.add_argument("--timm-loop", action="store_true", help=argparse.SUPPRESS)  # the child running the API loop
    p.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)  # the API loop's torch.compile
    args = p.parse_args(argv)
    args.pairs = args.pairs.split(",")
    if not set(args.pairs) <= set(PAIRS):
        sys.exit(f"error: --pairs takes fast, compiled and plain, not {','.join(sorted(set(args.pairs) - set(PAIRS)))}")
    if min(args.batch, args.steps, args.classes, args.workers + 1, args.print_freq, args.rounds) < 1 or args.epochs < 2:
        sys.exit("error: -b, --steps, --classes, -p and --rounds must be at least 1, -j at least 0 and --epochs at "
                 "least 2 (the last epoch is measured)")
    return args


def timm_loop(args):
    """timm's public API in a plain training loop, printing our progress lines (the loss read, a host sync, at
    each): the timm row where train.py is not given or fails."""
    import timm
    import torch
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, create_dataset, create_loader
    from timm.optim import create_optimizer_v2
    from timm.utils import NativeScaler

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cudnn.benchmark = True
    dataset = create_dataset("", root=args.data, split="train", is_training=True)
    classes = sum(entry.is_dir() for entry in os.scandir(os.path.join(args.data, "train")))
    model = timm.create_model(args.arch, num_classes=classes).to(device, memory_format=torch.channels_last)
    if args.compile:
        model = torch.compile(model)
    loader = create_loader(dataset, input_size=(3, args.image_size, args.image_size), batch_size=args.batch,
                           is_training=True, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), hflip=0.5, color_jitter=None,
                           interpolation="bilinear", mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD,
                           num_workers=args.workers, pin_memory=device.type == "cuda", device=device,
                           use_prefetcher=True)
    optimizer = create_optimizer_v2(model, "momentum", lr=0.1 * args.batch / 256, weight_decay=1e-4, momentum=0.9)
    dtype = getattr(torch, args.amp_dtype)
    scaler = NativeScaler(device.type) if dtype == torch.float16 else None
    criterion = torch.nn.CrossEntropyLoss()
    for epoch in range(args.epochs):
        model.train()
        for step, (images, target) in enumerate(loader, 1):
            with torch.autocast(device.type, dtype, enabled=dtype != torch.float32):
                loss = criterion(model(images.contiguous(memory_format=torch.channels_last)), target)
            optimizer.zero_grad(set_to_none=True)
            if scaler:
                scaler(loss, optimizer)
            else:
                loss.backward()
                optimizer.step()
            if step % args.print_freq == 0 or step == len(loader):
                print(f"Epoch: [{epoch}][{step}/{len(loader)}]  Loss {loss.item():.4e}", flush=True)


def commands(args, pair, side, timm_train, scratch):
    """(name, command, cwd, progress pattern, step offset) of one side of a pair."""
    py = sys.executable
    common = ["-a", args.arch, "-b", args.batch, "-j", args.workers, "--epochs", args.epochs, "-p", args.print_freq]
    fast = pair != "plain"
    size = args.image_size if fast else 224
    if side == "ours":
        script, flags = (("apex_distributed.py", ["--amp-dtype", args.amp_dtype, "--channels-last", "on"]
                          + ["--compile"] * (pair == "compiled")) if fast else ("distributed.py", []))
        return (script, [py, REPO / script, "--data", args.data, "--image-size", size, *common, *flags,
                         "--output-dir", scratch], REPO, EPOCH_LINE, 0)
    if not fast:
        return ("main.py", [py, args.main_py, args.data, *common], scratch, EPOCH_LINE, 0)
    if not timm_train:
        return ("timm API loop", [py, Path(__file__).resolve(), "--timm-loop", "--data", args.data, "--image-size",
                                  size, *common, "--amp-dtype", args.amp_dtype]
                + ["--compile"] * (pair == "compiled"), scratch, EPOCH_LINE, 0)
    amp = ["--amp", "--amp-dtype", args.amp_dtype] if args.amp_dtype != "float32" else []
    return ("timm train.py", [py, timm_train, args.data, "--model", args.arch, "--num-classes", args.num_classes,
                              "--img-size", size, "--crop-pct", 0.875, "-b", args.batch, "-j", args.workers,
                              "--epochs", args.epochs, "--log-interval", args.print_freq, *amp, "--channels-last",
                              "--pin-mem", "--opt", "momentum", "--momentum", 0.9, "--weight-decay", 1e-4, "--lr",
                              0.1 * args.batch / 256, "--sched", "step", "--warmup-epochs", 0, "--smoothing", 0,
                              "--color-jitter", 0, "--train-interpolation", "bilinear", "--scale", 0.08, 1,
                              "--hflip", 0.5, "--reprob", 0, "--mixup", 0, "--cutmix", 0, "--val-split", "val",
                              "--device", args.device, "--output", scratch, "--experiment", "run",
                              "--checkpoint-hist", 1] + ["--torchcompile"] * (pair == "compiled"),
            scratch, TIMM_LINE, 1)


def run(command, cwd, log, timeout):
    """Run command in its own process group, timing each output line as it arrives; (exit status or 'timed
    out', [(seconds since start, line)], wall seconds). What it leaves running is stopped with it."""
    start = time.monotonic()
    proc = subprocess.Popen([str(c) for c in command], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    lines = []
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic() - start, line) for line in proc.stdout))
    reader.start()
    try:
        status = proc.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        status = "timed out"
    finally:  # also when this script is stopped (SIGTERM, Ctrl-C): the run is in a session of its own
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # loader workers a failed run left behind, or the timed-out run
        except ProcessLookupError:
            pass
        proc.wait()
    reader.join(timeout=30)  # the pipe closes once the process group is gone
    log.write_text("".join(f"{t:9.3f} {line}" for t, line in lines))
    return status, lines, time.monotonic() - start


def steady_rate(lines, pattern, offset, epoch, print_freq, batch):
    """(images/s, first step, last step, seconds) between the first progress line of `epoch` at or after step
    print_freq and its last one, or None unless the epoch's lines reach its last print interval."""
    points = []
    for t, line in lines:
        m = pattern.search(line)
        if m and int(m["epoch"]) == epoch and int(m["step"]) + offset >= print_freq:
            points.append((t, int(m["step"]) + offset, int(m["steps"])))
    if len(points) < 2 or points[-1][1] <= points[-1][2] - print_freq:
        return None
    (t0, s0, _), (t1, s1, _) = points[0], points[-1]
    return (s1 - s0) * batch / (t1 - t0), s0, s1, t1 - t0


def own_rate(lines, epoch):
    """Our trainers' own figure for the epoch (its SUMMARY line: the whole epoch's training time)."""
    for _, line in lines:
        if line.startswith("SUMMARY "):
            fields = json.loads(line.split(" ", 1)[1])
            if fields.get("epoch") == epoch and "images_per_sec" in fields:
                return fields["images_per_sec"]
    return None


def rate(images_per_sec):
    return "" if not images_per_sec else f"{images_per_sec:.1f}" if images_per_sec < 100 else f"{images_per_sec:.0f}"


def render(state, out):
    lines = [f"# Our trainers against timm and pytorch/examples' main.py, {state['date']}", "",
             f"Command: `{state['command']}`", ""] + [f"- {line}" for line in state["setup"] + state["notes"]]
    lines += ["", "| pair | ours | peer | ours images/s | peer images/s | ours / peer | goal |",
              "|---|---|---|---:|---:|---:|---|"]
    for result in state["pairs"]:
        if result.get("ratio"):
            lines.append(f"| {result['pair']} | {result['ours']} | {result['peer']} | {rate(result['ours_rate'])} | "
                         f"{rate(result['peer_rate'])} | **{result['ratio']:.2f}x** | >= {GOAL:.2f}x: "
                         f"{'met' if result['ratio'] >= GOAL else 'not met'} |")
        else:
            lines.append(f"| {result['pair']} | {result['ours']} | {result['peer']} | | | | {result['result']} |")
    lines += ["", "Runs, in the order they ran (own figure: our SUMMARY's images/s over the whole epoch):", "",
              "| round | pair | script | images/s | steps timed | seconds | own figure | run s | result | log |",
              "|---|---|---|---:|---|---:|---:|---:|---|---|"]
    for r in state["runs"]:
        measured = r.get("images_per_sec")
        steps = f"{r['first_step']}-{r['last_step']}" if measured else ""
        seconds = f"{r['seconds']:.2f}" if measured else ""
        lines.append(f"| {r['round']} | {r['pair']} | {r['name']} | {rate(measured)} | {steps} | {seconds} | "
                     f"{rate(r.get('own_images_per_sec'))} | "
                     f"{r['wall']:.0f} | {r['result']} | {r['log']} |")
    commands_run = dict.fromkeys((r["pair"], r["name"], r["command"]) for r in state["runs"])
    lines += ["", "Commands (SCRATCH: a temporary directory, main.py's and train.py's working directory):", ""]
    lines += [f"- {pair}, {name}: `{command}`" for pair, name, command in commands_run]
    for path, text in ((out / "vs_timm.md", "\n".join(lines) + "\n"),
                       (out / "vs_timm.json", json.dumps(state, indent=1))):
        path.with_name(path.name + ".tmp").write_text(text)
        os.replace(path.with_name(path.name + ".tmp"), path)


def summarise(state, args):
    state["pairs"] = []
    for pair in args.pairs:
        rows = [r for r in state["runs"] if r["pair"] == pair]
        names = {side: " / ".join(dict.fromkeys(r["name"] for r in rows if r["side"] == side)) or "not run"
                 for side in ("ours", "peer")}
        both = [n for n in range(1, args.rounds + 1)
                if {r["side"] for r in rows if r["round"] == n and r.get("images_per_sec")} == {"ours", "peer"}]
        autocast = f"{args.amp_dtype} autocast" if args.amp_dtype != "float32" else "fp32"
        result = {"pair": f"{pair} ({PAIRS[pair].format(autocast)})", "ours": names["ours"],
                  "peer": names["peer"], "rounds": both, "result": state["skipped"].get(pair, "no round measured both")}
        if both:
            rate = {side: statistics.median(r["images_per_sec"] for r in rows if r["side"] == side
                                            and r["round"] in both and r.get("images_per_sec"))
                    for side in ("ours", "peer")}
            result.update(ours_rate=rate["ours"], peer_rate=rate["peer"], ratio=rate["ours"] / rate["peer"])
        state["pairs"].append(result)


def make_data(args, state, deadline, logs):
    """The ImageFolder the runs read: --data, or one written by tools/make_imagenet_like.py (reused)."""
    if not args.data:
        args.data = str(REPO / "data" / f"imagenet-like-{args.steps * args.batch}x{args.classes}")
        command = [sys.executable, REPO / "tools" / "make_imagenet_like.py", "--out", args.data, "--train-count",
                   args.steps * args.batch, "--val-count", args.classes, "--classes", args.classes]
        status, lines, wall = run(command, REPO, logs / "make_data.log", deadline - time.monotonic())
        if status != 0:
            sys.exit(f"error: writing the data set failed ({status}; log {logs / 'make_data.log'}): "
                     + (lines[-1][1].strip() if lines else "no output"))
        state["notes"].append(f"tools/make_imagenet_like.py ({wall:.0f} s): {lines[-1][1].strip()}")
    train = Path(args.data) / "train"
    if not train.is_dir() or not (Path(args.data) / "val").is_dir():
        sys.exit(f"error: {args.data} must hold train/ and val/ in ImageFolder layout (or leave out --data)")
    args.num_classes = sum(entry.is_dir() for entry in os.scandir(train))
    images = sum(len(files) for _, _, files in os.walk(train))
    state["setup"].append(f"data: {args.data}, {images} train images in {args.num_classes} classes: "
                          f"{images // args.batch} steps an epoch")


def main(argv=None):
    args = parse_args(argv)
    if args.timm_loop:
        return timm_loop(args)
    deadline = time.monotonic() + args.time_budget
    # Stopped from outside (timeout's SIGTERM), it exits through run()'s clean-up: no training left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(f"error: stopped by SIGTERM; what was measured is in "
                                                       f"{args.output_dir / 'vs_timm.md'}"))
    # The GPU's name from a child: in this process CUDA would hold GPU memory for the whole run.
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available() and "
                            "torch.cuda.get_device_name())"], capture_output=True, text=True)
    if probe.returncode:
        sys.exit(f"error: torch does not import: {probe.stderr.strip().splitlines()[-1]}")
    gpu = probe.stdout.strip()
    args.device = "cpu" if gpu == "False" else "cuda"
    logs = args.output_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    versions = {}
    for package in ("torch", "torchvision", "timm"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    if not versions["timm"]:
        sys.exit("error: timm is not installed: pip install timm")
    device = gpu if args.device == "cuda" else f"no GPU: the CPU ({os.cpu_count()} cores)"
    state = {"date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             "command": " ".join(["python"] + [str(a) for a in sys.argv]), "versions": versions,
             "setup": [f"{device}; torch {versions['torch']}, torchvision {versions['torchvision']}, timm "
                       f"{versions['timm']}, Python {sys.version.split()[0]}",
                       f"{args.arch}, batch {args.batch} in one process, crop {args.image_size} px (plain pair: "
                       f"224), loader workers: {args.workers}, fast pairs' autocast {args.amp_dtype}, rounds: "
                       f"{args.rounds}; images/s of epoch {args.epochs} (steady state, from step {args.print_freq})"],
             "notes": [], "runs": [], "pairs": [], "skipped": {}}
    print(state["setup"][0], flush=True)
    missing = missing_peers(args, state)
    make_data(args, state, deadline, logs)

    timm_train = args.timm_train if args.timm_train and os.path.isfile(args.timm_train) else ""
    for note in state["notes"]:
        print(note, flush=True)
    walls = {}  # the last wall time of each script in each pair: whether another run fits in the budget
    for n in range(1, args.rounds + 1):
        for pair in args.pairs:
            if pair in state["skipped"]:
                continue
            for side in ("ours", "peer") if n % 2 else ("peer", "ours"):
                while True:  # once more, with the timm API loop, if timm's train.py fails
                    with tempfile.TemporaryDirectory(prefix="vs_timm-") as scratch:
                        name, command, cwd, pattern, offset = commands(args, pair, side, timm_train, scratch)
                        left = deadline - time.monotonic()
                        row = {"round": n, "pair": pair, "side": side, "name": name, "wall": 0.0,
                               "log": f"logs/{n}-{pair}-{name.replace(' ', '-')}.log", "command": " ".join(
                                   ["python"] + [str(c).replace(scratch, "SCRATCH") for c in command[1:]])}
                        if walls.get((pair, name), 30) > left:  # 30 s: less than any run takes
                            row.update(result=f"skipped: {max(0, left):.0f} s of --time-budget left", log="")
                            state["runs"].append(row)
                            print(f"round {n}, {pair}: {name}: {row['result']}", flush=True)
                            break
                        status, lines, row["wall"] = run(command, cwd, args.output_dir / row["log"],
                                                         min(args.run_timeout, left))
                    walls[(pair, name)] = row["wall"]
                    measured = steady_rate(lines, pattern, offset, args.epochs - 1, args.print_freq, args.batch)
                    if measured:
                        row.update(zip(("images_per_sec", "first_step", "last_step", "seconds"), measured))
                        row["own_images_per_sec"] = own_rate(lines, args.epochs - 1) if side == "ours" else None
                    ended = f"stopped at {row['wall']:.0f} s" if status == "timed out" else f"exit {status}"
                    row["result"] = ("ok" if measured and status == 0
                                     else ("measured, then " if measured else "") + ended)
                    state["runs"].append(row)
                    summarise(state, args)
                    render(state, args.output_dir)
                    said = f"{rate(measured[0])} images/s" if measured else "no measurement"
                    print(f"round {n}, {pair}: {name}: {said} ({row['result']}, {row['wall']:.0f} s)", flush=True)
                    if name != "timm train.py" or measured or status == "timed out":
                        break
                    last = next((line.strip() for _, line in reversed(lines) if line.strip()), "no output")
                    why = f"{ended}: {last[:200]}" if status else f"no progress line of epoch {args.epochs} to time"
                    note = f"timm's train.py failed ({why}): the timm API loop from here on (log {row['log']})"
                    state["notes"].append(note)
                    print(note, flush=True)
                    timm_train = ""
    summarise(state, args)
    render(state, args.output_dir)
    print("\n" + (args.output_dir / "vs_timm.md").read_text(), flush=True)
    if missing:
        sys.exit("\n".join(missing))


def missing_peers(args, state):
    """The peers asked for (by default or by name) that are absent: each a bold note in the report and a warning
    here, and the exit status is 1, so no one takes the API loop alone, or no plain pair, for the comparison.
    benchmarks/peers/ is ignored by git: a machine sent only the tracked files has no peers."""
    missing = []
    if {"fast", "compiled"} & set(args.pairs) and args.timm_train and not os.path.isfile(args.timm_train):
        missing.append(f"timm's train.py not found at {args.timm_train}: the fast pairs time the timm API loop "
                       "instead of timm's own train.py")
    if "plain" in args.pairs and not os.path.isfile(args.main_py):
        state["skipped"]["plain"] = f"skipped: pytorch/examples' main.py not found at {args.main_py}"
        missing.append(f"pytorch/examples' main.py not found at {args.main_py}: the plain pair is NOT measured")
    state["notes"] += [f"**MISSING PEER**: {line}" for line in missing]
    missing = [f"vs_timm.py: WARNING: missing peer: {line}" for line in missing]
    if missing:
        missing.append("vs_timm.py: benchmarks/peers/ is ignored by git, so a machine sent only the tracked files "
                       "lacks it: send it along (docs/measurements.md), or fetch the files as this script's --help "
                       "says; --timm-train '' asks for the timm API loop, --pairs fast leaves main.py out. Exit "
                       "status 1.")
        print("\n".join(missing), file=sys.stderr, flush=True)
    return missing


if __name__ == "__main__":
    main()
