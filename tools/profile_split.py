#!/usr/bin/env python
"""Split the step time of --profile's traces into disjoint parts, per rank, in ms per step.

    python tools/profile_split.py checkpoints/               # every trace-rank<R>.json(.gz) in the folder
    python tools/profile_split.py trace-rank0.json --json    # one JSON record per trace instead of a table

Any torch.profiler Chrome trace with ProfilerStep#N steps will do. The parts, and what each means on
the CPU and on GPUs: docs/profiling.md. The trainers only record the traces; start.sh --profile runs this
on each method's, statistics.sh reads its records, tools/plot_profile.py draws the intervals.
"""
import argparse
import bisect
import gzip
import json
import re
import sys
from pathlib import Path

GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
# A wait for a batch: torch's DataLoader names it enumerate(DataLoader)#<its iterator>.__next__, and the trainers name
# DaliLoader's (--data-backend dali) the same way: enumerate(DaliLoader)#DaliLoader.__next__.
LOADER_FETCHES = ("enumerate(DataLoader)#", "enumerate(DaliLoader)#")
PARTS = ("step", "compute", "comm_exposed", "comm_overlapped", "data_wait", "optimizer", "other")


def union(intervals):
    """Sorted, disjoint (start, end) intervals covering the same time as `intervals`."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [tuple(interval) for interval in merged]


def intersect(a, b):
    """The time in both of two unions (as union returns them)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a, b):
    """The time in a, not in b (both unions)."""
    out, j = [], 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:  # a's intervals come in order: b's passed ones stay passed
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > start:
                out.append((start, b[k][0]))
            start = max(start, b[k][1])
            k += 1
        if start < end:
            out.append((start, end))
    return out


def length(intervals):
    return sum(end - start for start, end in intervals)


def containing(intervals, t):
    """The index of the interval of a union that holds instant t, else None."""
    i = bisect.bisect_right(intervals, (t, float("inf"))) - 1
    return i if i >= 0 and t <= intervals[i][1] else None


def step_split(events, with_intervals=False):
    """Split the profiled steps' time (Chrome trace events, microseconds) into disjoint parts; each
    instant counts once, in the first part of the trace's order that covers it (docs/profiling.md):
    CPU: data wait, optimizer, compute (ops of the training threads), exposed communication (gloo, c10d);
    GPUs: the GPU's steps, optimizer (GPU work launched inside optimizer.step/zero_grad), compute (other
    kernels, copies), exposed communication (NCCL kernels, and the GPU work a collective launched: gloo's
    copies of CUDA tensors to and from the host), data wait (a wait for a batch while no GPU work runs).
    Other: the rest. Also the communication under compute ("comm_overlapped", not a part).
    Returns the parts' totals and the number of steps; with_intervals: also each part's intervals (and
    "steps": each step's window)."""
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e["name"] == "thread_name"}
    kinds = {name: [] for name in ("steps", "data", "optimizer", "cpu", "cpu_comm", "gpu")}
    collectives = {}  # thread -> its communication's intervals (as kinds["cpu_comm"] counts them)
    launches = {}  # CUDA correlation id -> when, and on which thread, the CPU launched that GPU work
    for e in events:
        if e.get("ph") != "X":
            continue
        name, category, interval = e["name"], e.get("cat", ""), (e["ts"], e["ts"] + e.get("dur", 0))
        thread = e["pid"], e["tid"]
        if category == "gpu_user_annotation":
            continue  # a GPU copy of a CPU annotation, spanning only the kernels launched directly inside it
        if category in GPU_WORK:
            kinds["gpu"].append((interval, "nccl" in name.lower(), e.get("args", {}).get("correlation")))
        elif "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = e["ts"], thread  # cudaLaunchKernel, cudaMemcpyAsync, ...
        elif name.startswith("ProfilerStep#"):
            kinds["steps"].append(interval)
        elif name.startswith(LOADER_FETCHES) and name.endswith(".__next__"):
            kinds["data"].append(interval)
        elif name.startswith(("Optimizer.step#", "Optimizer.zero_grad#")):
            kinds["optimizer"].append(interval)
        elif name.startswith(("gloo:", "c10d::")) or "gloo" in threads.get(thread, ""):
            kinds["cpu_comm"].append(interval)
            collectives.setdefault(thread, []).append(interval)
        elif category == "cpu_op":
            kinds["cpu"].append(interval)
    cpu_steps, data, optimizer = sorted(kinds["steps"]), union(kinds["data"]), union(kinds["optimizer"])
    if kinds["gpu"]:
        # On GPUs the kernels are the work: CPU ops only launch them, up to many steps ahead. A step is
        # the GPU's: from the first work launched in its CPU step to the next step's first; the last
        # ends with the last work launched in any.
        first, end, gpu = {}, float("-inf"), {"optimizer": [], "compute": [], "comm_exposed": []}
        collectives = {thread: union(intervals) for thread, intervals in collectives.items()}
        for interval, nccl, correlation in kinds["gpu"]:
            launched, thread = launches.get(correlation, (-1, None))
            step = containing(cpu_steps, launched)
            if step is not None:
                first[step] = min(first.get(step, interval[0]), interval[0])
                end = max(end, interval[1])
            in_optimizer = containing(optimizer, launched) is not None
            # gloo stages a CUDA tensor through pinned host memory: the copy out is launched inside the c10d::* op
            # on the caller's thread, the copy back by gloo's thread; no kernel name says so, the launch does.
            comm = nccl or containing(collectives.get(thread, []), launched) is not None
            gpu["optimizer" if in_optimizer else "comm_exposed" if comm else "compute"].append(interval)
        starts = sorted(first.values())
        steps = list(zip(starts, starts[1:] + [end])) if starts else cpu_steps  # no launch links: the CPU's
        covers = list(gpu.items()) + [("data_wait", data)]
    else:
        steps = cpu_steps
        covers = [("data_wait", data), ("optimizer", optimizer), ("compute", kinds["cpu"]),
                  ("comm_exposed", kinds["cpu_comm"])]
    intervals, taken = {"steps": steps, "step": union(steps)}, []
    for key, cover in covers:
        intervals[key] = subtract(intersect(intervals["step"], union(cover)), taken)
        taken = union(taken + intervals[key])
    comm = dict(covers)["comm_exposed"]
    intervals["comm_overlapped"] = intersect(intersect(intervals["step"], union(comm)), intervals["compute"])
    parts = {key: length(intervals[key]) for key in PARTS[:-1]}
    parts["other"] = parts["step"] - length(taken)
    return (parts, len(cpu_steps), intervals) if with_intervals else (parts, len(cpu_steps))


def read_trace(path):
    """A trace's events and rank (its distributedInfo, else the R of trace-rank<R>.json), or an error line."""
    try:
        data = Path(path).read_bytes()
        trace = json.loads(gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)  # .json.gz: gzipped
        events = trace["traceEvents"]
    except (OSError, EOFError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"error: cannot read a Chrome trace from '{path}' ({e}): pass a trace-rank<R>.json of "
                         "--profile") from None
    rank = (trace.get("distributedInfo") or {}).get("rank")
    match = re.search(r"rank(\d+)", Path(path).name)
    return events, rank if rank is not None else int(match[1]) if match else None


def split_trace(path):
    """One trace's record: its parts in ms per profiled step."""
    events, rank = read_trace(path)
    parts, count = step_split(events)
    if not count:
        raise SystemExit(f"error: '{path}' has no ProfilerStep#N events: pass a trace written by --profile")
    device = "gpu" if any(e.get("cat") in GPU_WORK for e in events) else "cpu"
    return {"rank": rank, "device": device, "steps": count,
            **{key: round(parts[key] / 1000 / count, 3) for key in PARTS}, "trace": str(path)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", type=Path, help="trace files, or folders of trace-rank<R>.json")
    parser.add_argument("--json", action="store_true", help="one JSON record per trace, not a table")
    args = parser.parse_args(argv)
    paths = []
    for path in args.traces:
        found = sorted(path.glob("trace-rank*.json*"), key=lambda p: int(re.sub(r"\D", "", p.name) or 0)) \
            if path.is_dir() else [path]
        if not found:
            sys.exit(f"error: no trace-rank<R>.json in '{path}': pass the --output-dir of a run with --profile")
        paths += found
    records = [split_trace(path) for path in paths]
    if args.json:
        print("\n".join(json.dumps(record) for record in records))
        return
    print("| rank | device | steps | " + " | ".join(p.replace("_", " ") for p in PARTS) + " | trace |")
    print("|" + "---|" * (len(PARTS) + 4))
    for r in records:
        print(f"| {r['rank']} | {r['device']} | {r['steps']} | " + " | ".join(f"{r[p]:.2f}" for p in PARTS)
              + f" | {r['trace']} |")
    print("ms per step; each instant of a step in one part (comm overlapped: under compute, not a part)")


if __name__ == "__main__":
    main()
