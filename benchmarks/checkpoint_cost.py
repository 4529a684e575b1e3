#!/usr/bin/env python
"""What keeping K checkpoints with a SHA-256 each costs per save, side by side in one process.

    python benchmarks/checkpoint_cost.py --arch resnet18 --saves 8

Alternates, on the same state (a model and its SGD momentum): a plain atomic save of one
checkpoint.pth (temp file, fsync, os.replace: what the trainers did before #23), and the trainers'
save_checkpoint with --keep-checkpoints 2 (named file, its SHA-256 read back and written beside it,
checkpoint.pth linked to it, the oldest deleted). Prints the medians, their ratio, and what the
SHA-256 check costs a rank at resume.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torchvision.models as models

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import distributed  # noqa: E402  (the trainers' shared save_checkpoint and digest)


def plain_save(state, output_dir):
    fd, tmp = tempfile.mkstemp(dir=output_dir, prefix=".checkpoint.", suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(output_dir, "plain.pth"))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--saves", type=int, default=8)
    args = parser.parse_args()
    model = models.get_model(args.arch)
    optimizer = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9)
    model(torch.randn(2, 3, 64, 64)).sum().backward()
    optimizer.step()  # momentum buffers: a checkpoint as large as the trainers'
    state = {"epoch": 0, "step": 0, "state_dict": model.state_dict(), "optimizer": optimizer.state_dict()}
    plain, kept = [], []
    with tempfile.TemporaryDirectory(dir=".") as output_dir:
        options = argparse.Namespace(output_dir=output_dir, keep_checkpoints=2)
        for epoch in range(args.saves):
            state["epoch"] = epoch
            start = time.perf_counter()
            plain_save(state, output_dir)
            plain.append(time.perf_counter() - start)
            start = time.perf_counter()
            distributed.save_checkpoint(state, False, options)
            kept.append(time.perf_counter() - start)
        path = os.path.join(output_dir, "checkpoint.pth")
        start = time.perf_counter()
        distributed.digest(path)
        verify = time.perf_counter() - start
        size = os.path.getsize(path) / 1e6
    print(f"{args.arch}: checkpoint {size:.0f} MB, {args.saves} saves each, alternated")
    print(f"plain atomic save: median {statistics.median(plain):.3f} s")
    print(f"save_checkpoint, K=2 + SHA-256: median {statistics.median(kept):.3f} s "
          f"({statistics.median(kept) / statistics.median(plain):.2f}x)")
    print(f"SHA-256 check at resume: {verify:.3f} s per rank")


if __name__ == "__main__":
    main()
