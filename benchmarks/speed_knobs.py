#!/usr/bin/env python
"""apex_distributed.py's speed knobs, each alone and all together, against plain distributed.py.

    .venv/bin/python benchmarks/speed_knobs.py                     # 2 processes, synthetic and demo images
    .venv/bin/python benchmarks/speed_knobs.py --repeats 3 --nproc 2 --image-size 64

Every configuration trains the same workload (resnet18, global batch 32 over --nproc processes of one
thread each) under torchrun, in turn, --repeats times (alternating, so a noisy machine slows all
alike). Steady-state images/s is the median over the epochs after the first (the first pays for
start-up and, with --compile, for compiling); compile time is the first epoch's time minus a steady
epoch's. It prints one markdown table per workload: images/s and the ratio to distributed.py's.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
GPU = torch.cuda.is_available()  # the trainers train on the GPUs where torch sees them, else on the CPU
BF16 = (torch.cuda.is_bf16_supported(including_emulation=False) if GPU
        else any(torch.cpu.get_capabilities().get(isa) for isa in ("avx512_bf16", "amx_bf16")))
# The "all of them" row's autocast: apex_distributed.py's default dtype there (fp16 on GPUs).
FAST = ("float16", "fp16") if GPU else ("bfloat16", "bf16")
# (name, script, flags); apex_distributed.py's autocast is off (float32) and channels_last off unless a row
# turns it on (its default, auto, turns it on on GPUs: every row would measure it).
PLAIN = ["--amp-dtype", "float32", "--channels-last", "off"]
CONFIGS = [
    ("distributed.py", "distributed.py", []),
    *([("amp: fp16 autocast + GradScaler", "apex_distributed.py", ["--amp-dtype", "float16", "--channels-last", "off"])]
      if GPU else []),
    *([("amp: bf16 autocast" + ("" if BF16 else " (emulated here)"), "apex_distributed.py",
        ["--amp-dtype", "bfloat16", "--channels-last", "off"])] if BF16 or not GPU else []),
    ("amp: --compile", "apex_distributed.py", PLAIN + ["--compile"]),
    ("amp: --grad-compression bf16", "apex_distributed.py", PLAIN + ["--grad-compression", "bf16"]),
    ("amp: --grad-compression fp16", "apex_distributed.py", PLAIN + ["--grad-compression", "fp16"]),
    ("amp: --channels-last on", "apex_distributed.py", ["--amp-dtype", "float32", "--channels-last", "on"]),
    (f"amp: all of them ({FAST[1]} autocast, bf16 compression)", "apex_distributed.py",
     ["--amp-dtype", FAST[0], "--compile", "--grad-compression", "bf16", "--channels-last", "on"]),
]

def run(script, flags, workload, nproc, out):
    """One training run: its SUMMARY lines (one per epoch)."""
    command = [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc-per-node={nproc}",
               str(REPO / script)] + workload + flags + ["--output-dir", out]
    proc = subprocess.run(command, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True)
    if proc.returncode:
        sys.exit(f"error: {' '.join(command)} failed:\n{proc.stderr[-2000:]}")
    return [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("SUMMARY ")]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3, help="epochs per run; the first is not counted")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--data", default=str(REPO / "data" / "digits"), help="the demo images (make_demo_data.py)")
    args = parser.parse_args()
    # No --seed: it switches cudnn.benchmark off (deterministic kernels), which the trainers leave on by default.
    common = ["--image-size", str(args.image_size), "-b", "32", "--epochs", str(args.epochs), "-p", "1000000",
              "-j", "1"]
    workloads = {"synthetic (--dummy, 640 images an epoch)": ["--dummy", "--dummy-samples", "640"] + common,
                 f"demo digits ({args.data})": ["--data", args.data, "--min-crop-scale", "0.35"] + common}
    print(f"{args.nproc} processes x 1 thread, resnet18, {args.image_size} px, global batch 32, "
          f"{args.repeats} alternating repeats; {torch.cuda.get_device_name() if GPU else 'CPU'}, native bf16: {BF16}")
    for workload_name, workload in workloads.items():
        steady, compile_time = {name: [] for name, *_ in CONFIGS}, {name: [] for name, *_ in CONFIGS}
        for _ in range(args.repeats):
            for name, script, flags in CONFIGS:
                with tempfile.TemporaryDirectory() as out:
                    epochs = run(script, flags, workload, args.nproc, out)
                later = [s["epoch_time"] for s in epochs[1:]]
                steady[name] += [s["images_per_sec"] for s in epochs[1:]]
                compile_time[name].append(epochs[0]["epoch_time"] - statistics.median(later))
        base = statistics.median(steady["distributed.py"])
        print(f"\n{workload_name}\n\n| configuration | images/s | x distributed.py | first epoch's extra seconds |")
        print("|---|---|---|---|")
        for name, *_ in CONFIGS:
            rate = statistics.median(steady[name])
            print(f"| {name} | {rate:.1f} | {rate / base:.3f} | {statistics.median(compile_time[name]):.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
