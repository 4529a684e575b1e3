#!/usr/bin/env python
"""The GPU check's body (bash scripts/gpu_check.sh runs it): is the cookbook correct on this machine's
GPUs, and how fast is it? It installs nothing and uses no network: the torch of the python running it.

1. The machine: GPU, driver, CUDA, cuDNN, NCCL, torch, and each engine's version or "absent" (one line
   each saying how to get it; the checks that need it are skipped, nothing else fails for it).
2. The GPU suite, tests/test_gpu.py (pytest; in parallel with pytest-xdist where installed): one row
   per check, passed / failed / skipped with its reason.
3. The benchmark: ResNet-50 at 224 px on synthetic images (uint8, made by the loader's workers as
   decoded JPEGs would be), one process on one GPU, images/s of the second of two short epochs, each
   trainer's ratio to the bare training loop (benchmarks/bare_ddp.py) of the same precision, and
   timm's ResNet-50 in that loop as a reference row where timm is installed.

--out (markdown) and its .json twin are rewritten after every row, so a run cut short keeps what it
measured. Exit status: 1 if a check or a benchmark run failed, else 0 (also without a GPU: then every
GPU row says skipped, and why).
"""
import argparse
import datetime
import json
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


def version(module):
    probe = subprocess.run([sys.executable, "-c", f"import {module} as m, importlib.metadata as md; print(getattr("
                            f"m, '__version__', None) or md.version('{module.split('.')[0]}'))"],
                           capture_output=True, text=True)
    return probe.stdout.strip() if probe.returncode == 0 else None


def machine():
    import torch
    smi = shutil.which("nvidia-smi") and subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
        capture_output=True, text=True).stdout.strip().splitlines()
    gpus = torch.cuda.device_count()
    info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
            "gpus": gpus, "gpu": smi[0] if smi else "none (nvidia-smi lists no GPU)",
            "cudnn": torch.backends.cudnn.version() if gpus else None,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpus else None,
            "bf16": bool(gpus) and torch.cuda.is_bf16_supported(including_emulation=False)}
    import torchvision
    info["torchvision"] = torchvision.__version__
    return info


def render(state, out):
    """The report as markdown and JSON, each written atomically."""
    m = state["machine"]
    lines = [f"# GPU check, {state['date']}", "", f"Command: `{state['command']}`", "",
             f"- GPU: {m['gpu']} ({m['gpus']} visible to torch)",
             f"- torch {m['torch']} (CUDA {m['cuda']}, cuDNN {m['cudnn']}, NCCL {m['nccl']}), torchvision "
             f"{m['torchvision']}, Python {m['python']}",
             "- " + ", ".join(f"{ENGINES[k][0]} {v or 'absent'}" for k, v in state["engines"].items()), ""]
    lines += [f"- {note}" for note in state["notes"]] + ([""] if state["notes"] else [])
    suite = state["suite"]
    lines += [f"## GPU suite (tests/test_gpu.py): {suite['status']}", "", "| check | result | seconds |", "|---|---|---:|"]
    lines += [f"| `{r['test']}` | {r['outcome']}{': ' + r['reason'] if r['reason'] else ''} | {r['seconds']} |"
              for r in suite["rows"]]
    bench = state["benchmark"]
    lines += ["", f"## Benchmark: {bench['status']}", "", bench["workload"], "",
              "| run | images/s | vs the bare loop | command |", "|---|---:|---:|---|"]
    for row in bench["rows"]:
        rate = f"{row['images_per_sec']:.0f}" if row.get("images_per_sec") else row["result"]
        ratio = f"{row['ratio']:.2f}x" if row.get("ratio") else ""
        lines.append(f"| {row['name']} | {rate} | {ratio} | `{row['command']}` |")
    for path, text in ((out, "\n".join(lines) + "\n"), (out.with_suffix(".json"), json.dumps(state, indent=1))):
        path.with_name(path.name + ".tmp").write_text(text)
        os.replace(path.with_name(path.name + ".tmp"), path)


def run_suite(state, args, out, logs):
    """tests/test_gpu.py under pytest, its rows read from the record conftest.py appends as each test ends."""
    suite = state["suite"]
    if not state["machine"]["gpus"]:
        suite["status"] = "skipped: no CUDA GPU visible to torch"
        return True
    if not state["engines"]["pytest"]:
        suite["status"] = "skipped: pytest absent (" + ENGINES["pytest"][1] + ")"
        return True
    record = logs / "suite.jsonl"
    record.unlink(missing_ok=True)
    workers = ["-n", str(args.suite_workers)] if state["engines"]["xdist"] and args.suite_workers > 1 else []
    command = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "tests/test_gpu.py"] + workers
    suite["status"] = "running"
    start = time.monotonic()
    with open(logs / "suite.log", "w") as log:
        proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, GPU_CHECK_RESULTS=str(record.resolve())))
        while True:
            try:
                proc.wait(timeout=5)
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() - start > args.suite_timeout:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    break
            suite["rows"] = read_rows(record)
            render(state, out)
    suite["rows"] = read_rows(record)
    counts = {k: sum(r["outcome"] == k for r in suite["rows"]) for k in ("passed", "failed", "skipped")}
    took = f"{time.monotonic() - start:.0f} s"
    cut = f"cut short after {args.suite_timeout} s (--suite-timeout), " if proc.returncode == -signal.SIGKILL else ""
    suite["status"] = (f"{cut}{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped in "
                       f"{took} (`{' '.join(command[1:])}`; log {logs / 'suite.log'})")
    return proc.returncode == 0


def read_rows(record):
    return [json.loads(line) for line in open(record)] if record.exists() else []


def benchmark_rows(engines):
    """(name, script, flags, yardstick row name or None); the bare loops come first, their yardsticks."""
    amp = ["--channels-last", "on", "--amp-dtype", "float16"]
    rows = [("bare loop, fp32", "benchmarks/bare_ddp.py", [], None),
            ("bare loop, fp16 autocast + GradScaler, channels_last", "benchmarks/bare_ddp.py", amp, None),
            ("distributed.py (fp32)", "distributed.py", [], "bare loop, fp32"),
            ("apex_distributed.py fp32, channels_last", "apex_distributed.py",
             ["--amp-dtype", "float32", "--channels-last", "on"], "bare loop, fp32"),
            ("apex_distributed.py fp16 + GradScaler, channels_last", "apex_distributed.py", amp,
             "bare loop, fp16 autocast + GradScaler, channels_last"),
            ("apex_distributed.py fp16 + GradScaler, channels_last, --compile", "apex_distributed.py",
             amp + ["--compile"], "bare loop, fp16 autocast + GradScaler, channels_last")]
    if engines["timm"]:
        rows.insert(2, ("timm resnet50 in the bare loop, fp16, channels_last (reference)", "benchmarks/bare_ddp.py",
                        amp + ["-a", "timm:resnet50"], "bare loop, fp16 autocast + GradScaler, channels_last"))
    return rows


def run_benchmark(state, args, out, logs):
    bench = state["benchmark"]
    if not state["machine"]["gpus"]:
        bench["status"] = "skipped: no CUDA GPU visible to torch"
        return True
    ok, rates = True, {}
    workload = ["--dummy", "--dummy-samples", args.batch * args.steps, "-b", args.batch, "--epochs", 2,
                "-a", "resnet50", "--image-size", 224, "-j", args.workers, "-p", 1000]
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
        render(state, out)
        log = logs / f"bench-{len(bench['rows'])}.log"
        try:
            proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=args.bench_timeout)
            log.write_text(proc.stdout + proc.stderr)
            summaries = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines()
                         if line.startswith("SUMMARY ")]
            failed = proc.returncode or len(summaries) < 2
        except subprocess.TimeoutExpired:
            failed, summaries = True, []
            log.write_text(f"timed out after {args.bench_timeout} s")
        if failed:
            ok = False
            row["result"] = f"failed (log {log})"
        else:
            rates[name] = row["images_per_sec"] = summaries[-1]["images_per_sec"]
            row["result"] = "ok"
            if yardstick in rates:
                row["ratio"] = rates[name] / rates[yardstick]
        render(state, out)
    bench["status"] = "done" if ok else "some runs failed"
    return ok


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "gpu_check.md", help="the report (and its .json twin)")
    parser.add_argument("--logs", type=Path, default=REPO / "logs" / "gpu_check")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--suite-workers", type=int, default=min(8, max(1, (os.cpu_count() or 2) // 2)),
                        help="pytest-xdist workers (tests share the GPUs; each starts 1-2 trainer processes)")
    parser.add_argument("--suite-timeout", type=int, default=330, help="seconds before the suite is cut short")
    parser.add_argument("--batch", type=int, default=128, help="benchmark: images per step")
    parser.add_argument("--steps", type=int, default=20, help="benchmark: steps per epoch")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 1) - 2),
                        help="benchmark: loader workers (8 left the trainers waiting for batches on an H100)")
    parser.add_argument("--bench-timeout", type=int, default=240, help="seconds before a benchmark run is stopped")
    parser.add_argument("--command", default="python scripts/gpu_check.py", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.logs.mkdir(parents=True, exist_ok=True)
    engines = {module: version(module) for module in ENGINES}
    state = {"date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", "command": args.command,
             "machine": machine(), "engines": engines,
             "notes": [f"{ENGINES[m][0]} absent: {ENGINES[m][1]}" for m, v in engines.items() if not v],
             "suite": {"status": "not run (--skip-tests)" if args.skip_tests else "waiting", "rows": []},
             "benchmark": {"status": "not run (--skip-bench)" if args.skip_bench else "waiting", "rows": [],
                           "workload": f"ResNet-50, 224 px, synthetic uint8 images made by {args.workers} loader "
                                       f"workers, {args.batch} images per step, {args.steps} steps per epoch, 1 "
                                       "process on 1 GPU: images/s of the 2nd of 2 epochs (training only)"}}
    for note in state["notes"]:
        print(note, flush=True)
    render(state, args.out)
    ok = True
    if not args.skip_tests:
        ok &= run_suite(state, args, args.out, args.logs)
        render(state, args.out)
        print(f"GPU suite: {state['suite']['status']}", flush=True)
    if not args.skip_bench:
        ok &= run_benchmark(state, args, args.out, args.logs)
        render(state, args.out)
    print(args.out.read_text(), flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
