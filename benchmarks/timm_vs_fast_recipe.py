#!/usr/bin/env python
"""The fast recipe (apex_distributed.py) against timm's own train.py, with the same three knobs.

Both train resnet18 at 224 px from the same ImageNet-like JPEGs (written here by
tools/make_imagenet_like.py), one process, global batch 32, one loader worker, two epochs, with bf16
autocast, channels_last and torch.compile (inductor), in turn --repeats times. Steady state is the
second epoch: images/s from apex_distributed.py's SUMMARY line and from the average update time on
timm's last progress line of that epoch (both count the whole epoch, loading included). The same
augmentation on both sides: RandomResizedCrop 224 (scale 0.08-1, bilinear) and a flip; timm's
default colour jitter is turned off, as the cookbook has none. timm's loader keeps batches uint8 and
normalises after the loader (its prefetcher, default on); timm's loop also reads the loss every step.

timm is needed only here, never by a trainer; its pip package does not ship train.py, so take the
script from timm's repository at the tag of the installed version:

    .venv/bin/pip install -c requirements.txt timm==1.0.28
    git clone --depth 1 --branch v1.0.28 https://github.com/huggingface/pytorch-image-models /tmp/timm
    .venv/bin/python benchmarks/timm_vs_fast_recipe.py --timm-train /tmp/timm/train.py
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
KNOBS = "bf16 autocast + channels_last + inductor"


def ours(data, out, args):
    command = [sys.executable, str(REPO / "apex_distributed.py"), "--data", data, "-a", "resnet18",
               "--image-size", "224", "-b", "32", "-j", "1", "--epochs", "2", "-p", "1000000", "--seed", "0",
               "--amp-dtype", "bfloat16", "--channels-last", "on", "--compile", "--output-dir", out]
    stdout = run(command)
    summaries = [json.loads(line.split(" ", 1)[1]) for line in stdout.splitlines() if line.startswith("SUMMARY ")]
    return summaries[1]["images_per_sec"]


def timm(data, out, args):
    command = [sys.executable, args.timm_train, "--data-dir", data, "--train-split", "train", "--val-split", "val",
               "--model", "resnet18", "--num-classes", str(args.classes), "--img-size", "224", "-b", "32",
               "--workers", "1", "--epochs", "2", "--device", "cpu", "--amp", "--amp-dtype", "bfloat16",
               "--channels-last", "--torchcompile", "inductor", "--color-jitter", "0",
               "--train-interpolation", "bilinear", "--opt", "sgd", "--sched", "step", "--warmup-epochs", "0",
               "--log-interval", "1000000", "--seed", "0", "--output", out]
    stdout = run(command)
    # "Train: 1 [   3/4 (100%)]  Loss: ...  Time: 1.234s, 25.93/s  (1.300s,  24.61/s)": the average update time.
    last = [line for line in stdout.splitlines() if re.search(r"Train: 1 \[.*\(100%\)\]", line)][-1]
    return 32 / float(re.search(r"\((\d+\.\d+)s,", last).group(1))


def run(command):
    proc = subprocess.run(command, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count() - 1 or 1)),
                          capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"error: {' '.join(command)} failed:\n{proc.stdout[-1500:]}\n{proc.stderr[-2500:]}")
    return proc.stdout + proc.stderr  # timm logs its progress on stderr


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--timm-train", required=True, help="train.py of timm's repository, at the installed tag")
    parser.add_argument("--images", type=int, default=256, help="train images (default: 256, 8 steps an epoch)")
    parser.add_argument("--classes", type=int, default=10, help="classes (default: 10)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each, alternating (default: 1)")
    args = parser.parse_args()
    try:
        import timm as timm_package
    except ImportError:
        sys.exit("error: timm is not installed: .venv/bin/pip install -c requirements.txt timm==1.0.28")
    if not os.path.isfile(args.timm_train):
        sys.exit(f"error: {args.timm_train} is not a file: pass train.py of timm's repository (see --help)")
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "data")
        subprocess.run([sys.executable, str(REPO / "tools" / "make_imagenet_like.py"), "--out", data,
                        "--train-count", str(args.images), "--val-count", "32", "--classes", str(args.classes)],
                       check=True, capture_output=True)
        rates = {"timm train.py": [], "apex_distributed.py": []}
        for r in range(args.repeats):
            rates["timm train.py"].append(timm(data, os.path.join(tmp, f"timm{r}"), args))
            rates["apex_distributed.py"].append(ours(data, os.path.join(tmp, f"ours{r}"), args))
    medians = {name: statistics.median(values) for name, values in rates.items()}
    print(f"resnet18, 224 px, batch 32, one process ({os.cpu_count() - 1 or 1} threads), one loader worker, "
          f"{args.images} ImageNet-like JPEGs, {KNOBS}; second epoch, median of {args.repeats} "
          f"(timm {timm_package.__version__})")
    print("| trainer | images/s | runs |\n|---|---|---|")
    for name, values in rates.items():
        print(f"| {name} | {medians[name]:.1f} | {', '.join(f'{v:.1f}' for v in values)} |")
    print(f"apex_distributed.py / timm train.py: {medians['apex_distributed.py'] / medians['timm train.py']:.2f}x")


if __name__ == "__main__":
    main()
