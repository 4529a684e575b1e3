#!/usr/bin/env python
"""Write a run's metrics.jsonl as TensorBoard scalars, in <output-dir>/tensorboard.

    python tools/metrics_tensorboard.py checkpoints/               # once: during a run or after it
    python tools/metrics_tensorboard.py checkpoints/ --follow 30   # again whenever the file changed, every 30 s
    tensorboard --logdir checkpoints/tensorboard

Every number of every record (train/loss, summary/val_acc1, ...) at x = global optimizer step, with the
record's time. The trainers record (rank 0 appends to metrics.jsonl, and a resumed run first drops the
records of the steps it repeats); this tool rewrites the event file from the whole file each time, so
TensorBoard never shows a repeated step. Needs the tensorboard package (pip install tensorboard).
"""
import argparse
import glob
import json
import os
import sys
import time


def read_records(path):
    """metrics.jsonl's records, less a last line still being written (or cut short by a killed run)."""
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def write_events(records, folder):
    """The records' numbers as scalars in a new event file in `folder`, replacing the ones written before."""
    from torch.utils.tensorboard import SummaryWriter
    # Every epoch's last step has a train record (the trainers write one at each epoch's end): its step count.
    steps_per_epoch = max([r["position"][1] for r in records if r["kind"] == "train"] or [1])
    for old in glob.glob(os.path.join(folder, "events.out.tfevents.*")):
        os.remove(old)
    with SummaryWriter(folder) as writer:
        for record in records:
            epoch, step = record["position"] or (0, 0)
            for key, value in record.items():
                if key not in ("position", "time") and type(value) in (int, float):  # bool is no number here
                    writer.add_scalar(f"{record['kind'].lower()}/{key}", value, epoch * steps_per_epoch + step,
                                      walltime=record["time"])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", help="a run's --output-dir, holding metrics.jsonl")
    parser.add_argument("--follow", type=float, metavar="SECONDS", help="keep going: check the file this often")
    args = parser.parse_args(argv)
    path = os.path.join(args.output_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        sys.exit(f"error: no metrics.jsonl in '{args.output_dir}': pass a trainer's --output-dir (rank 0 writes it "
                 "once the run has started)")
    try:
        import torch.utils.tensorboard  # noqa: F401 (only to find out whether it imports)
    except ImportError:
        sys.exit("error: tools/metrics_tensorboard.py needs the tensorboard package: pip install tensorboard")
    written = None
    while True:
        stat = os.stat(path)
        if written != (stat.st_ino, stat.st_size, stat.st_mtime_ns):  # a resumed run replaces the file: new inode
            written = stat.st_ino, stat.st_size, stat.st_mtime_ns
            records = read_records(path)
            write_events(records, os.path.join(args.output_dir, "tensorboard"))
            print(f"{len(records)} records of {path} written to {os.path.join(args.output_dir, 'tensorboard')}",
                  flush=True)
        if not args.follow:
            return
        time.sleep(args.follow)


if __name__ == "__main__":
    main()
