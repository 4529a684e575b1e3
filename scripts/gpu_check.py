#!/usr/bin/env python
"""The GPU check's body (bash scripts/gpu_check.sh runs it): is the cookbook correct on this machine's
GPUs, and how fast is it? It installs nothing and uses no network: the torch of the python running it.

1. The machine: GPU, driver, CUDA, cuDNN, NCCL, torch, and each engine's version or "absent" (one line
   each saying how to get it; the checks that need it are skipped, nothing else fails for it).
2. The GPU suite, tests/test_gpu.py (pytest; in parallel with pytest-xdist where installed): one row
   per check, passed / failed / skipped with its reason.
3. The benchmark: ResNet-50 at 224 px on synthetic images (uint8, made by the loader's workers as
   decoded JPEGs would be), one process on one GPU, images/s of the second of two epochs (the first is
   the warm-up: loader workers, cuDNN's autotuning), each trainer's ratio to the bare training loop
   (benchmarks/bare_ddp.py) of the same precision and memory format, and timm's ResNet-50 in that loop as
   a reference row where timm is installed. Every row reports its first and last epoch's mean loss; a
   row whose loss is not finite or does not fall did not train: it is marked invalid, and fails the check.

--time-budget covers everything: the suite stops early enough to leave the benchmark --bench-reserve
seconds, a benchmark row that would not fit is skipped, one still running at the deadline is stopped.
Each row (the suite too) runs in a session of its own, and is stopped with every process it started:
torchrun starts its workers in sessions of their own, out of reach of its process group. CUDA is
initialised only in the rows and in one short probe, never in this process, which would hold a context
on the GPU beside every row it times. --out (markdown) and its .json twin are rewritten after every row,
so a run cut short keeps what it measured. Exit status: 1 if a check or a benchmark run failed or was
invalid, else 0 (also without a GPU: then every GPU row says skipped, and why).
"""
import argparse
import contextlib
import ctypes
import datetime
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ENGINES = {  # module: (name, how to get it)
    "deepspeed": ("DeepSpeed", "DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed==0.19.8, or "
                               "--wheels DIR (scripts/fetch_wheels.sh fills DIR on an online machine)"),
    "horovod.torch": ("Horovod", "bash scripts/install_horovod.sh (offline: PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR, "
                                 "DIR from scripts/fetch_wheels.sh, holding its sdist)"),
    "nvidia.dali": ("DALI", "pip install nvidia-dali-cuda130==2.4.0 (over 500 MB: not part of --wheels)"),
    "pytest": ("pytest", "pip install pytest, or --wheels DIR: without it the GPU suite is skipped"),
    "xdist": ("pytest-xdist", "pip install pytest-xdist: without it the suite runs one test at a time (slower)"),
    "timm": ("timm", "pip install timm: the benchmark's reference row"),
}


def versions(modules):
    """Each module's version (its probe's last line: DeepSpeed's import prints a warning first), or None where it does
    not import: every probe its own python, all at once."""
    probes = {module: subprocess.Popen([sys.executable, "-c", f"import {module} as m, importlib.metadata as md; print("
                                        f"getattr(m, '__version__', None) or md.version('{module.split('.')[0]}'))"],
                                       stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
              for module in modules}
    found = {}
    for module, probe in probes.items():
        out = probe.communicate()[0]
        found[module] = out.strip().splitlines()[-1] if probe.returncode == 0 and out.strip() else None
    return found


# Run in a child: in this process CUDA would keep a context, and GPU memory, for the whole check. TorchCodec (the
# trainers' default decoder) is imported, not just looked up: a build for another torch is installed but fails here.
MACHINE_PROBE = """import importlib.metadata, importlib.util, json, sys, torch, torchvision
codec = "not installed"
if importlib.util.find_spec("torchcodec"):
    try:
        import torchcodec
        codec = torchcodec.__version__
    except (ImportError, OSError, RuntimeError) as e:
        codec = importlib.metadata.version("torchcodec") + " (does not load: " + str(e).strip().splitlines()[0] + ")"
gpus = torch.cuda.device_count()
print(json.dumps({"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
                  "gpus": gpus, "cudnn": torch.backends.cudnn.version() if gpus else None,
                  "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpus else None,
                  "bf16": bool(gpus) and torch.cuda.is_bf16_supported(including_emulation=False),
                  "torchvision": torchvision.__version__, "torchcodec": codec}))"""


def machine():
    probe = subprocess.run([sys.executable, "-c", MACHINE_PROBE], capture_output=True, text=True)
    if probe.returncode:
        sys.exit(f"gpu_check.py: error: probing torch failed: {(probe.stderr.strip().splitlines() or ['?'])[-1]}")
    smi = shutil.which("nvidia-smi") and subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        capture_output=True, text=True).stdout.strip().splitlines()
    return {**json.loads(probe.stdout), "gpu": smi[0] if smi else "none (nvidia-smi lists no GPU)"}


def become_subreaper():
    """Make this process the parent of its descendants' orphans (prctl PR_SET_CHILD_SUBREAPER, Linux 3.4): a process
    whose parent dies (torchrun, killed) is then ours, not init's, so stop_descendants() still finds it."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(36, 1, 0, 0, 0):  # 36: PR_SET_CHILD_SUBREAPER (linux/prctl.h)
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def descendants(pid):
    """The live processes below pid, from each one's parent in /proc/PID/stat (zombies left out)."""
    children = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                state, parent = f.read().rsplit(")", 1)[1].split()[:2]  # after "(comm)", which may hold spaces
        except OSError:  # one that has just ended
            continue
        if state != "Z":
            children.setdefault(int(parent), []).append(int(entry.name))
    found, below = [], [pid]
    while below:
        kids = children.get(below.pop(), [])
        found += kids
        below += kids
    return found


def stop_descendants():
    """SIGKILL every process below this one until none is left (10 s at most), reaping those that became ours:
    torchrun's workers and their loader workers, in sessions of their own (torch's elastic subprocess handler
    starts each worker with start_new_session=True), which killing the row's process group does not reach. Killed
    parents' children become ours (become_subreaper), and the next pass kills them. Returns how many were killed."""
    killed, deadline = set(), time.monotonic() + 10
    while (alive := descendants(os.getpid())) and time.monotonic() < deadline:
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed.update(alive)
        time.sleep(0.05)
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
    return len(killed)


def run_row(command, log, timeout, poll=lambda: None, env=None):
    """Run one row in a session of its own, its output to log; poll() every 5 s. Afterwards, ended or timed out, no
    process it started is left: (exit status or None if it was stopped at timeout, seconds, processes killed)."""
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=env)
        try:
            while True:
                try:
                    status = proc.wait(timeout=max(0.1, min(5.0, timeout - (time.monotonic() - start))))
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() - start >= timeout:
                        status = None
                        break
                poll()
        finally:  # also when this script is stopped (SIGTERM, Ctrl-C): the row is in a session of its own
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            killed = stop_descendants()
    return status, time.monotonic() - start, killed


def render(state, out):
    """The report as markdown and JSON, each written atomically."""
    m = state["machine"]
    lines = [f"# GPU check, {state['date']}", "", f"Command: `{state['command']}`", "",
             f"- GPU: {m['gpu']} ({m['gpus']} visible to torch)",
             f"- torch {m['torch']} (CUDA {m['cuda']}, cuDNN {m['cudnn']}, NCCL {m['nccl']}), torchvision "
             f"{m['torchvision']}, TorchCodec {m['torchcodec']}, Python {m['python']}",
             "- " + ", ".join(f"{ENGINES[k][0]} {v or 'absent'}" for k, v in state["engines"].items()), ""]
    lines += [f"- {note}" for note in state["notes"]] + ([""] if state["notes"] else [])
    suite = state["suite"]
    lines += [f"## GPU suite (tests/test_gpu.py): {suite['status']}", "", "| check | result | seconds |", "|---|---|---:|"]
    lines += [f"| `{r['test']}` | {r['outcome']}{': ' + r['reason'] if r['reason'] else ''} | {r['seconds']} |"
              for r in suite["rows"]]
    bench = state["benchmark"]
    lines += ["", f"## Benchmark: {bench['status']}", "", bench["workload"], "",
              "| run | images/s | vs its yardstick | loss, 1st → last epoch | result | command |",
              "|---|---:|---|---|---|---|"]
    for row in bench["rows"]:
        rate = f"{row['images_per_sec']:.0f}" if row.get("images_per_sec") else ""
        ratio = f"{row['ratio']:.2f}x ({row['yardstick']})" if row.get("ratio") else ""
        loss = f"{row['first_loss']:.4f} → {row['last_loss']:.4f}" if "last_loss" in row else ""
        lines.append(f"| {row['name']} | {rate} | {ratio} | {loss} | {row['result']} | `{row['command']}` |")
    for path, text in ((out, "\n".join(lines) + "\n"), (out.with_suffix(".json"), json.dumps(state, indent=1))):
        path.with_name(path.name + ".tmp").write_text(text)
        os.replace(path.with_name(path.name + ".tmp"), path)


def run_suite(state, args, out, logs, deadline):
    """tests/test_gpu.py under pytest, its rows read from the record conftest.py appends as each test ends."""
    suite = state["suite"]
    if not state["machine"]["gpus"]:
        suite["status"] = "skipped: no CUDA GPU visible to torch"
        return True
    if not state["engines"]["pytest"]:
        suite["status"] = "skipped: pytest absent (" + ENGINES["pytest"][1] + ")"
        return True
    limit = min(args.suite_timeout, deadline - time.monotonic() - (0 if args.skip_bench else args.bench_reserve))
    if limit < 30:
        suite["status"] = (f"skipped: --time-budget left it {max(0, limit):.0f} s, less than 30, after the benchmark's "
                           f"--bench-reserve ({args.bench_reserve:.0f} s)")
        return True
    record = logs / "suite.jsonl"
    record.unlink(missing_ok=True)
    workers = ["-n", str(args.suite_workers)] if state["engines"]["xdist"] and args.suite_workers > 1 else []
    command = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "tests/test_gpu.py"] + workers
    suite["status"] = "running"

    def poll():
        suite["rows"] = read_rows(record)
        render(state, out)

    status, seconds, killed = run_row(command, logs / "suite.log", limit, poll,
                                      env=dict(os.environ, GPU_CHECK_RESULTS=str(record.resolve())))
    suite["rows"] = read_rows(record)
    counts = {k: sum(r["outcome"] == k for r in suite["rows"]) for k in ("passed", "failed", "skipped")}
    cut = (f"cut short after {limit:.0f} s (--suite-timeout {args.suite_timeout}, --time-budget {args.time_budget}), "
           if status is None else "")
    stopped = f", {killed} processes it left behind killed" if killed else ""
    suite["status"] = (f"{cut}{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped in "
                       f"{seconds:.0f} s (`{' '.join(command[1:])}`; log {logs / 'suite.log'}{stopped})")
    return status == 0


def read_rows(record):
    return [json.loads(line) for line in open(record)] if record.exists() else []


def benchmark_rows(engines):
    """(name, script, flags, yardstick row name or None), in the order they run: each bare loop (the yardstick: the
    same precision and memory format) before its trainers, the likeliest to be cut by --time-budget last."""
    fp32_cl = ["--amp-dtype", "float32", "--channels-last", "on"]
    fp16_cl = ["--amp-dtype", "float16", "--channels-last", "on"]
    bare = {"fp32": "bare loop, fp32", "fp32 cl": "bare loop, fp32, channels_last",
            "fp16 cl": "bare loop, fp16 autocast + GradScaler, channels_last"}
    rows = [(bare["fp32"], "benchmarks/bare_ddp.py", [], None),
            ("distributed.py (fp32)", "distributed.py", [], bare["fp32"]),
            (bare["fp16 cl"], "benchmarks/bare_ddp.py", fp16_cl, None),
            ("apex_distributed.py fp16 + GradScaler, channels_last", "apex_distributed.py", fp16_cl, bare["fp16 cl"]),
            (bare["fp32 cl"], "benchmarks/bare_ddp.py", fp32_cl, None),
            ("apex_distributed.py fp32, channels_last", "apex_distributed.py", fp32_cl, bare["fp32 cl"]),
            # Its yardstick is not compiled: the ratio includes torch.compile's gain.
            ("apex_distributed.py fp16 + GradScaler, channels_last, --compile", "apex_distributed.py",
             fp16_cl + ["--compile"], bare["fp16 cl"])]
    if engines["timm"]:
        rows.append(("timm resnet50 in the bare loop, fp16, channels_last (reference)", "benchmarks/bare_ddp.py",
                     fp16_cl + ["-a", "timm:resnet50"], bare["fp16 cl"]))
    return rows


def loss_verdict(summaries):
    """(first epoch's mean loss, last epoch's, None or why the run is no measurement): a loss that is not finite or
    does not fall from the first epoch to the last says the run did not train (NaN weights, every step skipped)."""
    first, last = (summaries[i].get("train_loss") for i in (0, -1))
    if first is None or last is None:
        return first, last, "invalid: its SUMMARY lines report no train_loss"
    if not (math.isfinite(first) and math.isfinite(last)):
        return first, last, f"invalid: the loss is not finite ({first} → {last}): it did not train"
    if last >= first:
        return first, last, f"invalid: the loss did not fall ({first:.4f} → {last:.4f}): it did not train"
    return first, last, None


def run_benchmark(state, args, out, logs, deadline):
    bench = state["benchmark"]
    if not state["machine"]["gpus"]:
        bench["status"] = "skipped: no CUDA GPU visible to torch"
        return True
    ok, rates, walls = True, {}, {}
    workload = ["--dummy", "--dummy-samples", args.batch * args.steps, "-b", args.batch, "--epochs", 2,
                "-a", "resnet50", "--image-size", 224, "-j", args.workers, "-p", args.steps]
    bench["status"] = "running"
    for name, script, flags, yardstick in benchmark_rows(state["engines"]):
        if "-a" in flags:  # the reference row's own model
            i = workload.index("-a")
            command = workload[:i] + workload[i + 2:] + flags
        else:
            command = workload + flags
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", script] + [
            str(a) for a in command] + ["--output-dir", str(logs / "bench" / str(len(bench["rows"])))]
        row = {"name": name, "command": " ".join(["torchrun"] + command[3:]), "result": "running"}
        bench["rows"].append(row)
        left = deadline - time.monotonic()
        if walls.get(script, 30) > left:  # 30 s: less than any run takes
            row["result"] = f"skipped: {max(0, left):.0f} s of --time-budget left"
            continue
        render(state, out)
        log = logs / f"bench-{len(bench['rows'])}.log"
        known = script in walls  # measured to fit before: stopped at the deadline, it hung
        status, walls[script], killed = run_row(command, log, min(args.bench_timeout, left))
        summaries = [json.loads(line.split(" ", 1)[1]) for line in log.read_text().splitlines()
                     if line.startswith("SUMMARY ") and '"images_per_sec"' in line]
        stopped = f"; {killed} processes it left behind killed" if killed else ""
        if status is None and left < args.bench_timeout and not known:  # the budget's deadline: as if skipped
            row["result"] = f"skipped: stopped at the --time-budget deadline after {walls[script]:.0f} s (log {log})"
        elif status != 0 or len(summaries) < 2:
            ok = False
            ended = f"stopped at {walls[script]:.0f} s" if status is None else f"exit {status}"
            row["result"] = f"**failed** ({ended}; log {log}{stopped})"
        else:
            row["images_per_sec"] = summaries[-1]["images_per_sec"]
            row["first_loss"], row["last_loss"], invalid = loss_verdict(summaries)
            if invalid:
                ok, row["result"] = False, f"**{invalid}** (log {log}{stopped})"
            else:
                rates[name], row["result"] = row["images_per_sec"], f"ok{stopped}"
                if yardstick in rates:
                    row["ratio"], row["yardstick"] = rates[name] / rates[yardstick], yardstick
                elif yardstick:
                    row["result"] += f"; no ratio: its yardstick ({yardstick}) has no valid rate"
        render(state, out)
    skipped = sum(row["result"].startswith("skipped") for row in bench["rows"])  # for time
    bench["status"] = ("done" if ok else "some runs failed or were invalid") + (
        f", {skipped} skipped for time" if skipped else "")
    return ok


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "gpu_check.md", help="the report (and its .json twin)")
    parser.add_argument("--logs", type=Path, default=REPO / "logs" / "gpu_check")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--time-budget", type=float, default=450,
                        help="seconds for the whole check (default 450: with wheel installs under 8 minutes)")
    parser.add_argument("--suite-workers", type=int, default=min(8, max(1, (os.cpu_count() or 2) // 2)),
                        help="pytest-xdist workers (tests share the GPUs; each starts 1-2 trainer processes)")
    parser.add_argument("--suite-timeout", type=int, default=330, help="seconds before the suite is cut short")
    parser.add_argument("--bench-reserve", type=float, default=180,
                        help="seconds of --time-budget the suite leaves to the benchmark (default 180)")
    parser.add_argument("--batch", type=int, default=128, help="benchmark: images per step")
    parser.add_argument("--steps", type=int, default=100, help="benchmark: steps per epoch (default 100)")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 1) - 2),
                        help="benchmark: loader workers (8 left the trainers waiting for batches on an H100)")
    parser.add_argument("--bench-timeout", type=int, default=240, help="seconds before a benchmark run is stopped")
    parser.add_argument("--command", default="python scripts/gpu_check.py", help=argparse.SUPPRESS)
    args = parser.parse_args()
    deadline = time.monotonic() + args.time_budget
    become_subreaper()
    # Stopped from outside (timeout's SIGTERM), it exits through run_row's clean-up: no row left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(f"gpu_check.py: stopped by SIGTERM; what was measured is in "
                                                       f"{args.out}"))
    args.logs.mkdir(parents=True, exist_ok=True)
    engines = versions(ENGINES)
    state = {"date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", "command": args.command,
             "machine": machine(), "engines": engines,
             "notes": [f"{ENGINES[m][0]} absent: {ENGINES[m][1]}" for m, v in engines.items() if not v],
             "suite": {"status": "not run (--skip-tests)" if args.skip_tests else "waiting", "rows": []},
             "benchmark": {"status": "not run (--skip-bench)" if args.skip_bench else "waiting", "rows": [],
                           "workload": f"ResNet-50, 224 px, synthetic uint8 images made by {args.workers} loader "
                                       f"workers (forked once by a fork server, persistent, in every row), "
                                       f"{args.batch} images per step, {args.steps} steps per epoch, 1 process on 1 "
                                       "GPU: images/s of the 2nd of 2 epochs (the 1st is the warm-up), training "
                                       "only. Each ratio's yardstick is the bare loop of the same precision and "
                                       "memory format; the --compile row's is not compiled, so its ratio includes "
                                       "torch.compile's gain. Loss: the mean of the 1st and of the last epoch (rank "
                                       "0's)."}}
    for note in state["notes"]:
        print(note, flush=True)
    render(state, args.out)
    ok = True
    if not args.skip_tests:
        ok &= run_suite(state, args, args.out, args.logs, deadline)
        render(state, args.out)
        print(f"GPU suite: {state['suite']['status']}", flush=True)
    if not args.skip_bench:
        ok &= run_benchmark(state, args, args.out, args.logs, deadline)
        render(state, args.out)
    print(args.out.read_text(), flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
