#!/usr/bin/env python
"""ImageNet's size at the peer's cost: our trainer against pytorch/examples' imagenet main.py on a tree of ImageNet's
shape (1,000 class folders, 1,281 train + 50 val JPEGs each: 1,331,000 files), one process each, the same flags, as a
new user starts them. Two figures per run, side by side: the seconds from launch to the first progress line at or
past step --step, and the run's peak memory, the largest sum of the PSS (/proc/PID/smaps_rollup) of the trainer and
every process below it (loader workers, a fork server), sampled every --interval seconds. A run is stopped (SIGKILL
to its session) once that line is out: what scales with the tree (listing it, the file table, the loader workers'
start) is all before it.

    python benchmarks/imagenet_scale.py                                 # writes data/imagenet-scale first (minutes)
    python benchmarks/imagenet_scale.py --data /tmp/imagenet-scale -j 2 0 --rounds 3
    python benchmarks/imagenet_scale.py --ours distributed.py /tmp/proto/distributed.py   # a changed copy too

Without the tree it writes it with tools/make_imagenet_like.py --distinct (--distinct real JPEGs per split, every
other file a hard link to one of them: no inodes, 122 MB of disk, 2 minutes here for the 1.3 M links).
Ours get --output-dir in a scratch folder; main.py runs in one (its checkpoint.pth.tar). main.py prints at step
1 + k*p, ours at k*p, so with -p S its first line at or past S is step S+1: each row says which step it timed.
Rounds alternate the order of the scripts (the first round ours first), so a drifting load slows each side alike;
the table gives medians over the rounds. The machine's load average is recorded before every run: runs on a
machine shared with other work are only comparable when the load was alike.

The peer is not part of this repository: pytorch/examples' imagenet/main.py, e.g. at commit
77f55b912142e11fcfdf5b530231fb9c52f181e8 (git show 77f55b91:imagenet/main.py > benchmarks/peers/imagenet_main.py;
benchmarks/peers/ is ignored by git). Missing, it is a warning, ours alone are timed and the exit status is 1.
"""
import argparse
import contextlib
import datetime
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
EPOCH_LINE = re.compile(r"Epoch: \[(?P<epoch>\d+)\]\[\s*(?P<step>\d+)/(?P<steps>\d+)\]")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=REPO / "data" / "imagenet-scale",
                   help="ImageFolder with train/ and val/; written if it has no train/ (default: data/imagenet-scale)")
    p.add_argument("--classes", type=int, default=1000, help="class folders of the tree written (default: 1000)")
    p.add_argument("--train-per-class", type=int, default=1281, help="train files a class (default: 1281)")
    p.add_argument("--val-per-class", type=int, default=50, help="val files a class (default: 50)")
    p.add_argument("--distinct", type=int, default=256, help="real JPEGs per split, the rest links (default: 256)")
    p.add_argument("--ours", nargs="+", default=["distributed.py"],
                   help="our trainer scripts, each a column (default: distributed.py)")
    p.add_argument("--main-py", default=str(REPO / "benchmarks" / "peers" / "imagenet_main.py"),
                   help="pytorch/examples' imagenet/main.py (default: benchmarks/peers/imagenet_main.py)")
    p.add_argument("-a", "--arch", default="resnet18", help="model (default: resnet18)")
    p.add_argument("-b", "--batch", type=int, default=32, help="batch, one process (default: 32)")
    p.add_argument("-j", "--workers", type=int, nargs="+", default=[2, 0], help="loader workers, each a row (2 0)")
    p.add_argument("--step", type=int, default=5, help="the step timed (default: 5)")
    p.add_argument("-p", "--print-freq", type=int, help="every script's -p (default: --step)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default: 3)")
    p.add_argument("--interval", type=float, default=0.2, help="seconds between memory samples (default: 0.2)")
    p.add_argument("--run-timeout", type=float, default=600, help="seconds before a run is stopped (default: 600)")
    p.add_argument("--output-dir", type=Path, default=REPO / "logs" / "imagenet_scale")
    args = p.parse_args(argv)
    args.print_freq = args.print_freq or args.step
    if min(args.classes, args.train_per_class, args.val_per_class, args.distinct, args.batch, args.step,
           args.print_freq, args.rounds) < 1 or min(args.workers) < 0 or args.interval <= 0:
        sys.exit("error: counts, -b, --step, -p and --rounds must be at least 1, -j at least 0, --interval above 0")
    args.ours = [str(Path(script).resolve()) if Path(script).is_file() else str(REPO / script) for script in args.ours]
    if not all(map(os.path.isfile, args.ours)):
        sys.exit(f"error: --ours: no such script: {', '.join(s for s in args.ours if not os.path.isfile(s))}")
    return args


def make_tree(args):
    """--data, written by tools/make_imagenet_like.py --distinct unless it already has train/."""
    if (args.data / "train").is_dir():
        return None
    command = [sys.executable, REPO / "tools" / "make_imagenet_like.py", "--out", args.data, "--classes",
               args.classes, "--train-count", args.classes * args.train_per_class, "--val-count",
               args.classes * args.val_per_class, "--distinct", args.distinct]
    print(f"writing {args.data} (minutes) ...", flush=True)
    return subprocess.run([str(c) for c in command], check=True, capture_output=True, text=True).stdout.strip()


def descendants(root):
    """{pid: parent pid} of root and every process below it (by /proc/PID/stat's parent field)."""
    children = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])  # after the command name, which may hold spaces
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = {root: None}, [root]
    while todo:
        parent = todo.pop()
        for pid in children.get(parent, []):
            tree[pid] = parent
            todo.append(pid)
    return tree


def pss_kb(pid):
    """The process's proportional set size in kB (pages shared by N processes count 1/N), 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next((int(line.split()[1]) for line in f if line.startswith("Pss:")), 0)
    except OSError:
        return 0


def alive(pid):
    """Whether the process runs (not ended, nor a zombie waiting for its parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def role(pid, ppid, root):
    """What a process of the run is: the trainer, multiprocessing's helpers (by their command line), or a worker."""
    if pid == root:
        return "trainer"
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read()
    except OSError:
        return "gone"
    if b"resource_tracker import main" in command:
        return "resource tracker"
    return "fork server" if b"forkserver import main" in command and ppid == root else "worker"


def breakdown(sample):
    """{role: (processes, MB)} of one sample [(role, kB)], as one line: 'trainer 1 x 1,350 MB + worker 4 x 380 MB'."""
    roles = {}
    for name, kb in sample:
        count, total = roles.get(name, (0, 0))
        roles[name] = (count + 1, total + kb)
    return " + ".join(f"{name} {count} x {total / 1024:,.0f} MB" for name, (count, total) in sorted(
        roles.items(), key=lambda item: -item[1][1]))


def run(command, cwd, step, interval, timeout):
    """Run command in a session of its own until its first progress line at or past `step`. The result: seconds to
    its first progress line and to that one and their steps (None if it never came); the peak of the summed PSS in
    MB and its processes, by role, and the same at the line (at the last sample before it); how it ended; its lines."""
    start = time.monotonic()
    proc = subprocess.Popen([str(c) for c in command], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    lines, reached, peak, last = [], threading.Event(), [], []

    def read():
        for line in proc.stdout:
            lines.append((time.monotonic() - start, line))
            m = EPOCH_LINE.search(line)
            if m and int(m["step"]) >= step:
                reached.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while not reached.is_set() and proc.poll() is None and time.monotonic() - start < timeout:
        last = [(role(pid, ppid, proc.pid), pss_kb(pid)) for pid, ppid in descendants(proc.pid).items()]
        if sum(kb for _, kb in last) > sum(kb for _, kb in peak):
            peak = last
        reached.wait(interval)
    status = proc.poll()
    below = list(descendants(proc.pid))[1:]  # now, while they are its: a pid seen earlier may be another's by now
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # its session
    for pid in below:  # and any process below it that left the session (a fork server in its own)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30  # the next run starts once this one's processes have ended
    while any(alive(pid) for pid in below) and time.monotonic() < deadline:
        time.sleep(0.05)
    reader.join(timeout=30)
    progress = [(round(t, 2), int(m["step"])) for t, line in lines for m in [EPOCH_LINE.search(line)] if m]
    hit = next(((t, s) for t, s in progress if s >= step), (None, None))
    return {"seconds": hit[0], "step": hit[1], "first_line": progress[0] if progress else None,
            "peak_mb": round(sum(kb for _, kb in peak) / 1024), "processes": len(peak), "peak": breakdown(peak),
            "at_line_mb": round(sum(kb for _, kb in last) / 1024), "at_line": breakdown(last),
            "exit": "stopped at the line" if hit[0] else "timed out" if status is None else f"exit {status}",
            "lines": lines}


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def render(state, out):
    names = state["scripts"]
    lines = [f"# Ours against pytorch/examples' main.py at ImageNet's size, {state['date']}", ""]
    lines += [f"- {line}" for line in state["setup"] + state["notes"]]
    lines += ["", "Medians over the rounds: seconds from launch to the progress line at or past the step, and the peak "
              "of the summed PSS (MB) until then", "", "| -j | " + " | ".join(names) + " |",
              "|---|" + "---:|" * len(names)]
    for workers in state["workers"]:
        cells = []
        for name in names:
            rows = [r for r in state["runs"] if r["script"] == name and r["workers"] == workers and r["seconds"]]
            cells.append(f"{median(r['seconds'] for r in rows):.1f} s / {median(r['peak_mb'] for r in rows):,.0f} MB"
                         if rows else "no line")
        lines.append(f"| {workers} | " + " | ".join(cells) + " |")
    lines += ["", "| round | -j | script | first line: s (step) | line: s (step) | peak MB | at the peak | "
              "at the line | load before | result |", "|---|---|---|---:|---:|---:|---|---|---:|---|"]
    for r in state["runs"]:
        first = f"{r['first_line'][0]} ({r['first_line'][1]})" if r["first_line"] else ""
        line = f"{r['seconds']} ({r['step']})" if r["seconds"] else ""
        lines.append(f"| {r['round']} | {r['workers']} | {r['script']} | {first} | {line} | {r['peak_mb']:,} | "
                     f"{r['peak']} | {r['at_line']} | {r['load']:.1f} | {r['exit']} |")
    text = "\n".join(lines) + "\n"
    (out / "imagenet_scale.md").write_text(text)
    (out / "imagenet_scale.json").write_text(json.dumps(state, indent=1))
    return text


def main(argv=None):
    args = parse_args(argv)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    written = make_tree(args)
    train_classes = sum(entry.is_dir() for entry in os.scandir(args.data / "train"))
    state = {"date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
             "setup": [f"{args.data}: {train_classes} train classes; {args.arch}, -b {args.batch}, -p "
                       f"{args.print_freq}, one process, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}"],
             "notes": [written] if written else [], "workers": args.workers, "runs": []}
    scripts = {Path(path).name if [Path(p).name for p in args.ours].count(Path(path).name) == 1 else path: path
               for path in args.ours}
    missing = not os.path.isfile(args.main_py)
    if missing:
        state["notes"].append(f"**MISSING PEER**: pytorch/examples' main.py not found at {args.main_py}: ours only")
        print(f"imagenet_scale.py: WARNING: {state['notes'][-1]}", file=sys.stderr, flush=True)
    else:
        scripts["main.py"] = args.main_py
    state["scripts"] = list(scripts)
    for n in range(1, args.rounds + 1):
        for workers in args.workers:
            for name in list(scripts)[:: 1 if n % 2 else -1]:
                with tempfile.TemporaryDirectory(prefix="imagenet_scale-") as scratch:
                    common = ["-a", args.arch, "-b", args.batch, "-j", workers, "-p", args.print_freq]
                    command = ([sys.executable, args.main_py, args.data, *common] if name == "main.py" else
                               [sys.executable, scripts[name], "--data", args.data, *common, "--output-dir", scratch])
                    load = os.getloadavg()[0]
                    result = run(command, scratch, args.step, args.interval, args.run_timeout)
                log = args.output_dir / "logs" / f"{n}-j{workers}-{Path(name).name}.log"
                log.parent.mkdir(exist_ok=True)
                log.write_text("".join(f"{t:9.3f} {line}" for t, line in result.pop("lines")))
                state["runs"].append(dict(result, round=n, workers=workers, script=name, load=load, log=str(log)))
                print(f"round {n}, -j {workers}, {name}: {result['seconds']} s to step {result['step']}, peak "
                      f"{result['peak_mb']:,} MB ({result['peak']}; load {load:.1f}; {result['exit']})", flush=True)
                render(state, args.output_dir)
    print("\n" + render(state, args.output_dir), flush=True)
    if missing:
        sys.exit(1)


if __name__ == "__main__":
    main()
