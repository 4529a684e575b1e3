#!/usr/bin/env bash
# Turn the trainers' logs (start.sh writes LOGDIR/<method>.log) into a markdown table, written to
# stdout and LOGDIR/summary.md, plus LOGDIR/summary.png (images/s and top-1 per method, each labelled with
# what it ran), or a line saying how to get it where matplotlib is not installed (scripts/install.sh installs it).
#
#   bash statistics.sh [LOGDIR]          # default: logs
#
# It reads the SUMMARY/DONE records of each method's metrics log (LOGDIR/<method>.metrics.jsonl, which
# start.sh collects from the trainers' --output-dir/metrics.jsonl), else the SUMMARY/DONE JSON lines
# the trainers print (the benchmarks' logs, logs of older runs). Each run's first epoch is left out of
# s/epoch, images/s and data wait (the share of training time spent waiting for batches; above 0.2
# the input pipeline limits the run, and a line below the table says so) when later epochs exist (it pays
# for start-up). Each row names what it ran, so that rows of different recipes are not compared unawares:
# the model and global batch from the trainer's first line, the precision from apex's and DeepSpeed's own
# lines, else (and the image size, and the GPUs a run used) from the RECIPE line start.sh writes first. Logs with a
# bare.log and a ceiling.log (from start.sh --benchmark) get columns with each method's images/s over the bare DDP
# loop's and over the ceiling's (the same work on independent replicas, with no communication).
# Runs with --profile (start.sh --profile) add the median over ranks of the step time share spent in
# communication not overlapped with compute (LOGDIR/<method>.profile.jsonl: tools/profile_split.py's records).
# Missing, failed or unfinished runs are reported in a line below the table, never crash it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
logdir=${1:-logs}
PY=${PYTHON:-.venv/bin/python}
[[ -x $PY ]] || PY=python3
[[ -d $logdir ]] || { echo "statistics.sh: error: no log directory '$logdir': run start.sh first" >&2; exit 2; }

exec "$PY" - "$logdir" <<'EOF'
import glob
import json
import os
import re
import statistics
import sys

logdir = sys.argv[1]
ORDER = ["dp", "ddp", "launch", "spawn", "amp", "horovod", "slurm", "fsdp", "deepspeed"]
DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
# Every trainer's first line (report_start), apex_distributed.py's autocast line, DeepSpeed's engine line.
START = re.compile(r"=> \S+: world size \d+, device \w+, arch (?P<arch>\S+), global batch (?P<batch>\d+) ")
DTYPE = re.compile(r"=> (?:autocast (?P<amp>\w+),|DeepSpeed \S+: ZeRO stage \d, forward in (?P<ds>\w+))")


def read(path):
    summaries, done, errors, profiles, recipe = [], None, [], [], {}
    with open(path, errors="replace") as f:
        for line in f:
            line = re.sub(r"^\[\d+\]<std(?:out|err)>:", "", line)  # horovodrun's "[rank]<stdout>:" prefix
            kind, _, payload = line.strip().partition(" ")
            try:
                if kind == "SUMMARY":
                    summaries.append(json.loads(payload))
                elif kind == "DONE":
                    done = json.loads(payload)
                elif kind == "RECIPE":
                    recipe.update(json.loads(payload))
            except json.JSONDecodeError:
                errors.append(f"unreadable {kind} line")
            if line.startswith("error:"):
                errors.append(line.strip())
            if match := START.match(line):
                recipe.update(arch=match["arch"], global_batch=int(match["batch"]))
            if match := DTYPE.match(line):  # what the trainer ran, whatever flags it was given
                recipe["trainer_precision"] = match["amp"] or match["ds"]
    base = path[:-len(".log")]
    if os.path.isfile(base + ".profile.jsonl"):
        with open(base + ".profile.jsonl") as f:
            try:
                profiles = [json.loads(line) for line in f]
            except json.JSONDecodeError:
                errors.append("unreadable profile.jsonl line")
    metrics = base + ".metrics.jsonl"
    if os.path.isfile(metrics) and os.path.getsize(metrics):
        summaries, done = [], None
        with open(metrics) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    errors.append("unreadable metrics.jsonl line")
                    continue
                fields = {k: v for k, v in record.items() if k not in ("kind", "position", "time")}
                if record["kind"] == "SUMMARY":
                    summaries.append(fields)
                elif record["kind"] == "DONE":
                    done = fields
    return summaries, done, errors, profiles, recipe


def steady(summaries):
    """Epochs after each run's first (epoch numbers restart at 0 when runs are appended)."""
    later = [s for s in summaries if s.get("epoch", 0) > 0]
    return later or summaries


def median(summaries, key):
    values = [s[key] for s in steady(summaries) if s.get(key) is not None]
    return statistics.median(values) if values else None


def precision(recipe):
    dtype = recipe.get("trainer_precision", recipe.get("precision"))
    return DTYPES.get(dtype, dtype) if dtype else None


runs, notes = {}, []
for path in sorted(glob.glob(os.path.join(logdir, "*.log"))):
    name = os.path.basename(path)[:-4]
    summaries, done, errors, profiles, recipe = read(path)
    summaries = [s for s in summaries if "images_per_sec" in s]
    if not summaries:
        notes.append(f"{name}: no summary line ({errors[0] if errors else 'failed before its first epoch, or still running'})")
        continue
    if name not in ("bare", "ceiling") and done is None:
        notes.append(f"{name}: partial (no DONE line: failed or still running); its finished epochs are counted")
    runs[name] = {"summaries": summaries, "done": done, "profiles": profiles, "recipe": recipe}

bare, ceiling = runs.pop("bare", None), runs.pop("ceiling", None)
if not runs:
    print(f"statistics.sh: no usable logs in {logdir}/")
    for note in notes:
        print(f"- {note}")
    sys.exit(1)

bare_speed = median(bare["summaries"], "images_per_sec") if bare else None
ceiling_speed = median(ceiling["summaries"], "images_per_sec") if ceiling else None
dp_speed = median(runs["dp"]["summaries"], "images_per_sec") if "dp" in runs else None
names = sorted(runs, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n))
header = ["method", "launcher", "world size", "device", "model", "image size", "precision", "global batch", "epochs",
          "median s/epoch", "images/s", "speed-up over DP", "best top-1 %", "data wait"]
if bare_speed:
    header.append("x bare DDP loop")
if ceiling_speed:
    header.append("x ceiling")
profiled = any(run["profiles"] for run in runs.values())
if profiled:
    header.append("exposed comm")
rows, labels = [], []
for name in names:
    summaries, recipe = runs[name]["summaries"], runs[name]["recipe"]
    last = summaries[-1]
    speed = median(summaries, "images_per_sec")
    best = max((s["val_acc1"] for s in summaries if s.get("val_acc1") is not None), default=None)
    epoch_time = median(summaries, "epoch_time")
    data_wait = median(summaries, "data_wait")
    device = last.get("device", "?")
    if device != "cpu" and recipe.get("gpus", 0) > 1:
        device += f" x{recipe['gpus']}"  # DataParallel drives them all from one process: world size 1
    what = [recipe.get("arch"), recipe.get("image_size"), precision(recipe), recipe.get("global_batch")]
    row = [name, last.get("launcher", "?"), str(last.get("world_size", "?")), device,
           *(str(value) if value is not None else "-" for value in what), str(len({s["epoch"] for s in summaries})),
           f"{epoch_time:.1f}" if epoch_time else "-", f"{speed:.1f}",
           f"{speed / dp_speed:.2f}" if dp_speed else "-", f"{best:.1f}" if best is not None else "-",
           f"{data_wait:.2f}" if data_wait is not None else "-"]
    if bare_speed:
        row.append(f"{speed / bare_speed:.3f}")
    if ceiling_speed:
        row.append(f"{speed / ceiling_speed:.3f}")
    if profiled:
        profiles = runs[name]["profiles"]
        shares = [p["comm_exposed"] / p["step"] for p in profiles if p["step"] > 0]
        if shares and last.get("world_size", 1) > 1 and not any(p["comm_exposed"] + p["comm_overlapped"] for p in profiles):
            shares = []  # Horovod: its collectives run on its own thread, which torch.profiler does not trace
            notes.append(f"{name}: no collective in its trace (torch.profiler does not see Horovod's thread): "
                         "its wait for communication counts as optimizer time")
        row.append(f"{statistics.median(shares):.2f}" if shares else "-")
    if data_wait is not None and data_wait > 0.2:
        notes.append(f"{name}: waited for batches {data_wait:.0%} of its training time: its images/s measure its input "
                     "pipeline, not its devices (more -j, or more CPU cores)")
    rows.append(row)
    arch, size, dtype, batch = what
    labels.append(f"{name}: " + ", ".join(part for part in (
        arch, size and f"{size} px", dtype, batch and f"batch {batch}",
        f"world size {last.get('world_size', '?')}", device) if part))

lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
lines += ["| " + " | ".join(row) + " |" for row in rows]
if bare_speed:
    bare_precision = f" ({precision(bare['recipe'])})" if precision(bare["recipe"]) else ""
    lines.append(f"\nbare DDP loop{bare_precision}: {bare_speed:.1f} images/s (median)")
if ceiling_speed:
    lines.append(f"ceiling, {ceiling['summaries'][-1]['world_size']} replicas with no communication: "
                 f"{ceiling_speed:.1f} images/s (median)")
lines += [f"- {note}" for note in notes]
text = "\n".join(lines)
print(text)
with open(os.path.join(logdir, "summary.md"), "w") as f:
    f.write(text + "\n")

try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    # A site-installed torch without the cookbook's install: say how to get the chart, but the table stands.
    print(f"no chart ({os.path.join(logdir, 'summary.png')}): matplotlib is not installed; "
          f"pip install matplotlib, then bash statistics.sh {logdir}")
    sys.exit(0)
# Horizontal bars: each row's label (method and recipe) on a line of its own, however long, where labels
# under vertical bars ran into each other (fsdp and deepspeed).
speed_at, top1_at = header.index("images/s"), header.index("best top-1 %")
fig, (left, right) = plt.subplots(1, 2, figsize=(13, 1.2 + 0.35 * len(rows)), sharey=True,
                                  gridspec_kw={"width_ratios": [2, 1]})
left.barh(range(len(rows)), [float(r[speed_at]) for r in rows])
left.set_yticks(range(len(rows)), labels, fontsize=9)
left.invert_yaxis()  # the table's order, top down
left.set_title("images/s (median epoch)")
right.barh(range(len(rows)), [float(r[top1_at]) if r[top1_at] != "-" else 0 for r in rows])
right.set_title("best val top-1 (%)")
right.set_xlim(0, 100)
fig.tight_layout()
fig.savefig(os.path.join(logdir, "summary.png"), dpi=100)
print(f"chart: {os.path.join(logdir, 'summary.png')}")
EOF
