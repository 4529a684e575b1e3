#!/usr/bin/env python
"""Cross-check tools/profile_split.py against HolisticTraceAnalysis (HTA) on the same GPU traces.

    python3 -m venv /tmp/hta && /tmp/hta/bin/pip install holistictraceanalysis   # not a dependency of the repo
    /tmp/hta/bin/python benchmarks/hta_crosscheck.py DIR               # traces of a GPU run (--profile)
    /tmp/hta/bin/python benchmarks/hta_crosscheck.py DIR --synthetic   # first write 2 GPU-shaped traces there

HTA's temporal breakdown covers the span of the GPU work launched in the profiled steps (with
include_last_profiler_step, as profile_split.py's steps do) and splits it into idle (no kernel), compute
(kernels other than communication and memory copies/sets) and non-compute; its overlap ratio is the share
of communication kernel time under computation kernels. Per rank, this prints both tools' numbers (us)
and the identities that must hold: HTA's span = our step time, HTA's idle = our data wait + other, HTA's
compute + non-compute = our compute + exposed communication + optimizer: exactly where timestamps are
whole microseconds; HTA rounds each event down to them as it parses, so on a trace with nanoseconds its
idle time is larger by what that rounding drops (3.1 ms over 3,172 kernels: docs/profiling.md). HTA reads
GPU kernels only: a CPU trace (gloo) has nothing it can split.
"""
import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from profile_split import GPU_WORK, read_trace, step_split  # noqa: E402


def synthetic_trace(rank, steps=6, seed=0):
    """A DDP-like GPU timeline: each CPU step waits for its batch (sometimes long), launches a copy, the
    forward, the backward with an NCCL all-reduce per bucket (the last one after the backward: exposed)
    and the optimizer's kernels; the GPU runs them behind the CPU, idle when the CPU falls behind."""
    rng, events, correlation = random.Random(seed * 10 + rank), [], iter(range(1, 10 ** 6))
    cpu, gpu_free, nccl_free = 0, 0, 0

    def cpu_event(name, start, end, cat="user_annotation", **args):
        events.append({"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": 1, "ts": start, "dur": end - start,
                       **({"args": args} if args else {})})

    def launch(name, at, duration, cat="kernel", stream=7, after=0.0):
        nonlocal gpu_free, nccl_free
        c = next(correlation)
        cpu_event("cudaLaunchKernel", at, at + 5, cat="cuda_runtime", correlation=c)
        start = max(at + 5, after, nccl_free if stream == 9 else gpu_free)
        events.append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": start, "dur": duration,
                       "args": {"correlation": c, "stream": stream, "device": 0}})
        if stream == 9:
            nccl_free = start + duration
        else:
            gpu_free = start + duration
        return start + duration

    for step in range(steps):
        begin, wait = cpu, rng.choice([50, 50, 20000, 40000])
        cpu_event("enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__", cpu, cpu + wait)
        cpu += wait
        launch("Memcpy HtoD (Pinned -> Device)", cpu, 300, cat="gpu_memcpy")
        for _ in range(20):
            cpu += 40
            launch("void cudnn::conv_fwd_kernel", cpu, rng.randint(150, 250))
        for bucket in range(4):
            for _ in range(10):
                cpu += 40
                done = launch("void cudnn::conv_bwd_kernel", cpu, rng.randint(250, 400))
            cpu += 20
            launch("ncclDevKernel_AllReduce_Sum_f32_RING_LL", cpu, rng.randint(800, 1500), stream=9, after=done)
        cpu += 20
        cpu_event("Optimizer.step#SGD.step", cpu, cpu + 400)
        for _ in range(5):
            cpu += 60
            launch("void at::native::multi_tensor_apply_kernel", cpu, 120, after=nccl_free)
        cpu += 100
        cpu_event(f"ProfilerStep#{step + 2}", begin, cpu)
    return {"distributedInfo": {"backend": "nccl", "rank": rank, "world_size": 2}, "traceEvents": events}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="a folder of trace-rank<R>.json (HTA reads every trace in it)")
    parser.add_argument("--synthetic", action="store_true", help="first write 2 synthetic GPU traces into it")
    args = parser.parse_args()
    if args.synthetic:
        args.dir.mkdir(parents=True, exist_ok=True)
        for rank in range(2):
            (args.dir / f"trace-rank{rank}.json").write_text(json.dumps(synthetic_trace(rank)))
    for path in args.dir.glob("trace-rank*.json"):
        if not any(e.get("cat") in GPU_WORK for e in read_trace(path)[0]):
            sys.exit(f"error: '{path}' has no GPU kernels: HTA's temporal breakdown needs them (on a CPU trace "
                     "HTA 0.5.0 fails with an IndexError)")
    from hta.trace_analysis import TraceAnalysis  # only this script needs HTA

    analysis = TraceAnalysis(trace_dir=str(args.dir), include_last_profiler_step=True)
    temporal = analysis.get_temporal_breakdown(visualize=False).set_index("rank")
    overlap = analysis.get_comm_comp_overlap(visualize=False).set_index("rank")
    worst = 0.0
    for path in sorted(args.dir.glob("trace-rank*.json")):
        events, rank = read_trace(path)
        ours, _ = step_split(events)
        hta = temporal.loc[rank]
        comm = ours["comm_exposed"] + ours["comm_overlapped"]
        rows = [("span / step time", hta["kernel_time(us)"], ours["step"]),
                ("idle / data wait + other", hta["idle_time(us)"], ours["data_wait"] + ours["other"]),
                ("compute + non-compute / compute + comm exposed + optimizer",
                 hta["compute_time(us)"] + hta["non_compute_time(us)"],
                 ours["compute"] + ours["comm_exposed"] + ours["optimizer"])]
        print(f"rank {rank}: HTA compute {hta['compute_time(us)']:.0f} (no copies), non-compute "
              f"{hta['non_compute_time(us)']:.0f}; ours: {json.dumps({k: round(v) for k, v in ours.items()})}")
        for label, theirs, mine in rows:
            print(f"  {label}: HTA {theirs:.1f} us, ours {mine:.1f} us")
            worst = max(worst, abs(theirs - mine))
        ratio = ours["comm_overlapped"] / comm if comm else float("nan")
        print(f"  communication under compute: HTA {overlap.loc[rank].iloc[0] / 100:.3f}, ours {ratio:.3f} "
              "(ours counts copies as compute and the optimizer's kernels apart)")
    print(f"largest difference in the identities: {worst:.1f} us")


if __name__ == "__main__":
    main()
