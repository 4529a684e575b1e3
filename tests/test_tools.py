"""statistics.sh on fixture logs, start.sh's command lines (--dry-run), gpu_check.sh's refusal without GPUs;
profile_split.py and plot_profile.py on hand-made traces, metrics_tensorboard.py on a hand-made metrics.jsonl;
README's computed table column, its snippets of the scripts, and the links of README and docs/."""
import gzip
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from xml.etree import ElementTree

import pytest

from conftest import GLOO_THREAD, PYTHON, REPO, script_module, trace_op

readme_table = script_module("tools/readme_table.py")
profile_split = script_module("tools/profile_split.py")


def bash(*args):
    return subprocess.run(["bash", *map(str, args)], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_statistics_table_from_fixture_logs(tmp_path):
    logs = shutil.copytree(REPO / "tests" / "fixtures" / "logs", tmp_path / "logs")
    r = bash("statistics.sh", logs)
    assert r.returncode == 0, r.stderr
    rows = {line.split(" | ")[0].strip("| "): line.strip("| ").split(" | ") for line in r.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| method")}
    # Medians leave each run's first epoch out: dp (20, 22) s and (70, 66) img/s; ddp (15, 14) s and (140, 150);
    # the bare loop 160 img/s, the ceiling 200.
    # dp's data wait: the median of 0.3 and 0.5 (its first epoch's 0.9 left out).
    # Logs of older runs: no RECIPE line, no trainer's first line (but DeepSpeed's), so "-" for what they ran.
    assert rows["dp"] == ["dp", "none", "1", "cpu", "-", "-", "-", "-", "3", "21.0", "68.0", "1.00", "90.5", "0.40",
                          "0.425", "0.340"]
    assert rows["ddp"] == ["ddp", "torchrun", "2", "cpu", "-", "-", "-", "-", "3", "14.5", "145.0", "2.13", "96.1",
                           "0.01", "0.906", "0.725"]
    assert rows["amp"][8:11] == ["1", "30.0", "55.0"], "a lone first epoch is all there is to count"
    # DeepSpeed's launcher prints its own lines among the trainer's.
    assert rows["deepspeed"] == ["deepspeed", "deepspeed", "2", "cpu", "resnet18", "-", "fp32", "32", "2", "20.0",
                                 "96.0", "1.41", "93.5", "0.01", "0.600", "0.480"]
    assert "ceiling, 2 replicas with no communication: 200.0 images/s (median)" in r.stdout
    assert "horovod" not in rows
    assert "amp: partial (no DONE line" in r.stdout
    assert "horovod: no summary line (error: global batch -b 1 must be a multiple" in r.stdout  # under horovodrun's prefix
    assert (logs / "summary.md").read_text().startswith("| method |")
    assert f"chart: {logs / 'summary.png'}" in r.stdout, "no chart drawn: scripts/install.sh installs matplotlib"
    assert (logs / "summary.png").read_bytes().startswith(b"\x89PNG")


def test_statistics_without_matplotlib_says_how_to_get_the_chart(tmp_path):
    """A site-installed torch without the cookbook's install: the table, and one line naming the missing chart."""
    logs = shutil.copytree(REPO / "tests" / "fixtures" / "logs", tmp_path / "logs")
    (tmp_path / "matplotlib").mkdir()  # on PYTHONPATH, it shadows the installed one as if it were missing
    (tmp_path / "matplotlib" / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    r = subprocess.run(["bash", "statistics.sh", logs], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert "| dp | none |" in r.stdout
    assert (f"no chart ({logs / 'summary.png'}): matplotlib is not installed; pip install matplotlib, then "
            f"bash statistics.sh {logs}") in r.stdout
    assert not (logs / "summary.png").exists()


def test_statistics_reads_the_metrics_log(tmp_path):
    """With ddp.metrics.jsonl beside it, the ddp row comes from its records: the same row as from the
    text log's lines, which are removed here so that only the metrics log can have given it."""
    logs = shutil.copytree(REPO / "tests" / "fixtures" / "logs", tmp_path / "logs")
    text = (logs / "ddp.log").read_text().splitlines(keepends=True)
    with open(logs / "ddp.metrics.jsonl", "w") as f:
        for line in text:
            kind, _, payload = line.partition(" ")
            if kind in ("SUMMARY", "DONE"):
                fields = json.loads(payload)
                position = [fields["epoch"] + 1, 0] if kind == "SUMMARY" else None
                f.write(json.dumps({"kind": kind, "position": position, "time": 0, **fields}) + "\n")
                f.write(json.dumps({"kind": "train", "position": [0, 1], "time": 0, "loss": 1.0}) + "\n")
    (logs / "ddp.log").write_text("".join(line for line in text if not line.startswith(("SUMMARY", "DONE"))))
    # A --profile run's records (tools/profile_split.py's, one per rank): the table's last column is the median
    # of their exposed shares.
    (logs / "ddp.profile.jsonl").write_text("".join(
        json.dumps({"rank": rank, "step": 200.0, "comm_exposed": exposed, "comm_overlapped": 1.0}) + "\n"
        for rank, exposed in enumerate((30.0, 50.0))))
    # A run of 2 ranks whose trace holds no collective (Horovod's): no share, and a note saying why.
    (logs / "deepspeed.profile.jsonl").write_text('{"rank": 0, "step": 200.0, "comm_exposed": 0.0, '
                                                  '"comm_overlapped": 0.0}\n')
    r = bash("statistics.sh", logs)
    assert r.returncode == 0, r.stderr
    assert "| ddp | torchrun | 2 | cpu | - | - | - | - | 3 | 14.5 | 145.0 | 2.13 | 96.1 | 0.01 | 0.906 | 0.725 | 0.20 |" \
        in r.stdout
    assert "| 0.600 | 0.480 | - |" in r.stdout and "deepspeed: no collective in its trace" in r.stdout
    assert "exposed comm |" in r.stdout and "| dp | none | 1 | cpu | - | - | - | - | 3 | 21.0 |" in r.stdout
    assert "ddp: partial" not in r.stdout


def test_statistics_reports_missing_logs(tmp_path):
    assert bash("statistics.sh", tmp_path / "none").returncode == 2
    r = bash("statistics.sh", tmp_path)
    assert r.returncode == 1 and "no usable logs" in r.stdout


def gpu_logs(logs):
    """start.sh's logs of all 9 methods on 4 GPUs: its RECIPE line, each trainer's first line, SUMMARY and DONE."""
    logs.mkdir()
    for name in ("dp", "ddp", "launch", "spawn", "amp", "horovod", "slurm", "fsdp", "deepspeed"):
        world = 1 if name == "dp" else 4
        lines = ['RECIPE {"image_size": 224, "gpus": 4, "precision": "%s"}'
                 % ("bfloat16" if name == "fsdp" else "float32"),
                 f"=> {name}: world size {world}, device cuda, arch resnet50, global batch 512 "
                 f"({512 // world} per process x 1 micro-batches), launcher torchrun"]
        if name == "amp":  # what apex_distributed.py ran wins over start.sh's line
            lines.append("=> autocast float16, GradScaler on, channels_last on, compile off")
        if name == "deepspeed":
            lines.append("=> DeepSpeed 0.19.8: ZeRO stage 2, forward in bfloat16")
        lines += ["SUMMARY " + json.dumps({"method": name, "launcher": "none" if name == "dp" else "torchrun",
                                           "world_size": world,
                                           "device": "cuda", "epoch": epoch, "val_acc1": 0.1, "epoch_time": 10.0,
                                           "images_per_sec": 1000.0 + 100 * epoch,
                                           "data_wait": 0.5 if name == "horovod" else 0.01})
                  for epoch in range(3)]
        (logs / f"{name}.log").write_text("\n".join(lines + ['DONE {"best_acc1": 0.1}']) + "\n")
    return logs


def test_statistics_names_each_rows_recipe_and_its_chart_labels_do_not_overlap(tmp_path):
    """Rows of other precisions, models or batches are not compared unawares: the table and the chart name them.
    The chart's text is measured by wrapping statistics.sh's Python: its labels' boxes, within the figure."""
    logs = gpu_logs(tmp_path / "logs")
    (tmp_path / "chart.py").write_text(f"""import json, sys
import matplotlib
matplotlib.use("Agg")
from matplotlib.figure import Figure
save = Figure.savefig
def savefig(fig, *args, **kwargs):
    save(fig, *args, **kwargs)
    renderer = fig.canvas.get_renderer()
    def drawn(labels, limits, xy):  # the locator's ticks beyond the axis' limits are not drawn
        return [text for text in labels if min(limits) <= text.get_position()[xy] <= max(limits)]
    texts = [text for ax in fig.axes for text in [ax.title, *drawn(ax.get_xticklabels(), ax.get_xlim(), 0),
                                                  *drawn(ax.get_yticklabels(), ax.get_ylim(), 1)]
             if text.get_visible() and text.get_text()]
    with open({str(tmp_path / "boxes.json")!r}, "w") as f:
        json.dump({{"figure": list(fig.bbox.extents), "texts": [[text.get_text(), *text.get_window_extent(renderer).extents]
                                                          for text in texts]}}, f)
Figure.savefig = savefig
sys.argv = sys.argv[1:]  # statistics.sh runs "$PY - LOGDIR": its program on stdin
exec(compile(sys.stdin.read(), "statistics.sh", "exec"), {{"__name__": "__main__"}})
""")
    (tmp_path / "python").write_text(f"#!/bin/sh\nexec {PYTHON} {tmp_path / 'chart.py'} \"$@\"\n")
    (tmp_path / "python").chmod(0o755)
    r = subprocess.run(["bash", "statistics.sh", logs], cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHON": str(tmp_path / "python")})
    assert r.returncode == 0, r.stderr
    assert "| model | image size | precision | global batch |" in r.stdout
    assert "| dp | none | 1 | cuda x4 | resnet50 | 224 | fp32 | 512 | 3 |" in r.stdout, "dp drives 4 GPUs"
    assert "| ddp | torchrun | 4 | cuda x4 | resnet50 | 224 | fp32 | 512 |" in r.stdout
    assert "| amp | torchrun | 4 | cuda x4 | resnet50 | 224 | fp16 |" in r.stdout, "apex's own line wins"
    assert "| fsdp | torchrun | 4 | cuda x4 | resnet50 | 224 | bf16 |" in r.stdout
    assert "| deepspeed | torchrun | 4 | cuda x4 | resnet50 | 224 | bf16 |" in r.stdout
    assert "horovod: waited for batches 50% of its training time" in r.stdout
    assert "launch: waited" not in r.stdout
    chart = json.loads((tmp_path / "boxes.json").read_text())
    labels = [text for text, *_ in chart["texts"]]
    assert "fsdp: resnet50, 224 px, bf16, batch 512, world size 4, cuda x4" in labels
    assert "dp: resnet50, 224 px, fp32, batch 512, world size 1, cuda x4" in labels
    left, bottom, right, top = chart["figure"]
    boxes = [(text, box) for text, *box in chart["texts"]]
    for text, (x0, y0, x1, y1) in boxes:
        assert left <= x0 and x1 <= right and bottom <= y0 and y1 <= top, f"'{text}' is cut off"
    for i, (text, (x0, y0, x1, y1)) in enumerate(boxes):
        for other, (u0, v0, u1, v1) in boxes[i + 1:]:
            assert x1 <= u0 or u1 <= x0 or y1 <= v0 or v1 <= y0, f"'{text}' overlaps '{other}'"


def test_step_split_of_a_known_cpu_timeline():
    """A hand-made CPU trace (microseconds): a 100 us step, data 0-10, compute 10-50 and 60-70, a gloo
    all-reduce 40-65 (15 under compute, 10 exposed), the optimizer 80-95 with an op inside it."""
    op = trace_op
    events = [GLOO_THREAD, op("ProfilerStep#0", 0, 100, cat="user_annotation"),
              op("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 0, 10, cat="user_annotation"),
              op("aten::copy_", 2, 8), op("aten::convolution", 10, 50), op("aten::mul", 20, 30), op("aten::add", 60, 70),
              op("gloo:all_reduce", 40, 65, thread=2), op("Optimizer.step#SGD.step", 80, 95, cat="user_annotation"),
              op("aten::_fused_sgd_", 82, 90)]
    assert profile_split.step_split(events) == ({"step": 100, "compute": 50, "comm_exposed": 10, "comm_overlapped": 15,
                                                 "data_wait": 10, "optimizer": 15, "other": 15}, 1)
    assert profile_split.step_split([op("ProfilerStep#0", 0, 100, cat="user_annotation")])[0]["other"] == 100


def gpu_trace(correlated=True):
    """A hand-made GPU trace of 2 steps (CPU 0-100, 100-200) whose GPU runs behind the CPU: step 1's
    backward kernel (60-110) and NCCL all-reduce (90-130) still run while the CPU waits for step 2's batch
    (100-160), and its GPU-side copy of ProfilerStep#2 (as torch.profiler writes one) runs to 260."""
    def launch(at, correlation):  # the CPU's launch of GPU work: the link from a kernel to its step
        return {**trace_op("cudaLaunchKernel", at, at + 2, cat="cuda_runtime"), "args": {"correlation": correlation}}

    def gpu(name, start, end, correlation, cat="kernel", stream=7):
        return {"ph": "X", "name": name, "cat": cat, "ts": start, "dur": end - start, "pid": 0, "tid": stream,
                "args": {"correlation": correlation} if correlated else {}}
    op, wait = trace_op, "enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__"
    return [op("ProfilerStep#1", 0, 100, cat="user_annotation"), op("ProfilerStep#2", 100, 200, cat="user_annotation"),
            gpu("ProfilerStep#1", 20, 60, None, cat="gpu_user_annotation"),
            gpu("ProfilerStep#2", 170, 260, None, cat="gpu_user_annotation"),
            op(wait, 0, 10, cat="user_annotation"), op(wait, 100, 160, cat="user_annotation"),
            op("Optimizer.step#SGD.step", 30, 40, cat="user_annotation"),
            op("Optimizer.step#SGD.step", 180, 190, cat="user_annotation"),
            launch(12, 1), gpu("Memcpy HtoD (Pinned -> Device)", 20, 25, 1, cat="gpu_memcpy"),
            launch(15, 2), gpu("void cudnn::conv_fwd", 25, 60, 2), launch(20, 3), gpu("void cudnn::conv_bwd", 60, 110, 3),
            launch(25, 4), gpu("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 90, 130, 4, stream=9),
            launch(32, 5), gpu("void multi_tensor_apply_kernel", 130, 140, 5),
            launch(165, 6), gpu("Memcpy HtoD (Pinned -> Device)", 170, 175, 6, cat="gpu_memcpy"),
            launch(170, 7), gpu("void cudnn::conv_fwd", 175, 190, 7),
            launch(182, 8), gpu("void multi_tensor_apply_kernel", 190, 200, 8)]


def test_step_split_of_a_known_gpu_timeline():
    """On GPUs the steps are the GPU's: 20 (step 1's first copy) to 200 (step 2's last kernel), not the
    CPU's 0-200 nor the GPU-side ProfilerStep copy's 260. The CPU's wait for step 2's batch (100-160)
    counts as data wait only where no GPU work runs (140-160); NCCL 90-110 is under the backward, 110-130
    exposed; the optimizer's kernels (launched inside optimizer.step) 130-140 and 190-200; the GPU idles
    160-170 (other: the CPU launching step 2)."""
    parts, steps = profile_split.step_split(gpu_trace())
    assert steps == 2 and parts == {"step": 180, "compute": 110, "comm_exposed": 20, "comm_overlapped": 20,
                                    "data_wait": 20, "optimizer": 20, "other": 10}
    # A trace without the launch links (correlation ids): the CPU's steps, the GPU's work still the parts.
    parts, _ = profile_split.step_split(gpu_trace(correlated=False))
    assert parts["step"] == 200 and parts["data_wait"] == 30 and parts["optimizer"] == 0


def test_profile_split_counts_dalis_fetch_as_data_wait():
    """--data-backend dali has no DataLoader: the trainers name DaliLoader's fetch as torch names the
    DataLoader's, and it is data wait as that one is, on the CPU and on GPUs; another loader's is not."""
    op, dali = trace_op, "enumerate(DaliLoader)#DaliLoader.__next__"
    cpu = [op("ProfilerStep#0", 0, 100, cat="user_annotation"), op(dali, 0, 10, cat="user_annotation"),
           op("aten::convolution", 10, 50)]
    assert profile_split.step_split(cpu)[0]["data_wait"] == 10
    other_loader = op("MyLoader.__next__", 0, 10, cat="user_annotation")
    assert profile_split.step_split(cpu[:1] + [other_loader])[0]["other"] == 100
    wait = "enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__"
    renamed = [{**e, "name": dali} if e["name"] == wait else e for e in gpu_trace()]
    assert sum(e["name"] == dali for e in renamed) == 2
    assert profile_split.step_split(renamed) == profile_split.step_split(gpu_trace())


def test_profile_split_counts_gloos_device_copies_as_communication():
    """gloo over CUDA tensors (2 ranks sharing a GPU) stages each through pinned host memory: the c10d op
    launches the copy out (on a side stream), gloo's thread runs the collective on the CPU, then launches
    the copy back. Those copies are communication, told by the thread and op that launched them: the
    batch's copy, of the same name, is compute, and so is a backward kernel launched (by the main thread)
    and running while gloo's collective runs. A hand-made step (CPU 0-100): the batch's copy 20-25,
    forward 25-50, backward 50-70 with the bucket's copy out 50-55 under it (overlapped), the copy back
    80-85 (exposed), the optimizer's kernel 90-95; the GPU idles 70-80 (gloo's ring) and 85-90."""
    def launch(at, correlation, thread=1):
        return {**trace_op("cudaMemcpyAsync", at, at + 1, thread=thread, cat="cuda_runtime"),
                "args": {"correlation": correlation}}

    def gpu(name, start, end, correlation, cat="gpu_memcpy", stream=7):
        return {"ph": "X", "name": name, "cat": cat, "ts": start, "dur": end - start, "pid": 0, "tid": stream,
                "args": {"correlation": correlation}}
    op, htod = trace_op, "Memcpy HtoD (Pinned -> Device)"
    events = [GLOO_THREAD, op("ProfilerStep#1", 0, 100, cat="user_annotation"), launch(12, 1), gpu(htod, 20, 25, 1),
              launch(14, 2), gpu("void cudnn::conv_fwd", 25, 50, 2, cat="kernel"),
              launch(41, 3), gpu("void cudnn::conv_bwd", 50, 70, 3, cat="kernel"),
              op("c10d::allreduce_", 30, 34), launch(31, 4), gpu("Memcpy DtoH (Device -> Pinned)", 50, 55, 4, stream=9),
              op("gloo:all_reduce", 40, 79, thread=2), launch(78, 5, thread=2), gpu(htod, 80, 85, 5, stream=9),
              op("Optimizer.step#SGD.step", 86, 95, cat="user_annotation"), launch(87, 6),
              gpu("void multi_tensor_apply_kernel", 90, 95, 6, cat="kernel")]
    assert profile_split.step_split(events) == ({"step": 75, "compute": 50, "comm_exposed": 5, "comm_overlapped": 5,
                                                 "data_wait": 0, "optimizer": 5, "other": 15}, 1)


def test_profile_split_reads_a_run_folder(tmp_path):
    """The command line: a folder of trace-rank<R>.json gives one row (or JSON record) per rank, in ms
    per step (a gzipped trace too); a file that is not a trace, or a folder without any, is one error line."""
    (tmp_path / "trace-rank0.json").write_text(json.dumps({"traceEvents": gpu_trace()}))
    (tmp_path / "trace-rank1.json.gz").write_bytes(gzip.compress(json.dumps({"traceEvents": gpu_trace(),
                                                                              "distributedInfo": {"rank": 1}}).encode()))
    r = subprocess.run([PYTHON, REPO / "tools" / "profile_split.py", tmp_path, "--json"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(p["rank"], p["device"], p["steps"], p["step"], p["data_wait"]) for p in records] == [
        (0, "gpu", 2, 0.09, 0.01), (1, "gpu", 2, 0.09, 0.01)]
    r = subprocess.run([PYTHON, REPO / "tools" / "profile_split.py", tmp_path / "trace-rank1.json.gz"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "| 1 | gpu | 2 | 0.09 | " in r.stdout, r.stdout
    (tmp_path / "empty").mkdir()
    for bad in (tmp_path / "empty", REPO / "README.md"):
        r = subprocess.run([PYTHON, REPO / "tools" / "profile_split.py", bad], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 1 and r.stderr.startswith("error: ") and len(r.stderr.splitlines()) == 1, r.stderr


def test_plot_profile_draws_each_part_of_a_trace(tmp_path):
    """tools/plot_profile.py on a hand-made trace: one lane per part, with the shares profile_split gives
    (a 100 us step: data 10, compute 40, a gloo all-reduce 40-65 of which 10 exposed, optimizer 15)."""
    op = trace_op
    events = [GLOO_THREAD, op("ProfilerStep#0", 0, 100, cat="user_annotation"),
              op("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 0, 10, cat="user_annotation"),
              op("aten::convolution", 10, 50), op("gloo:all_reduce", 40, 65, thread=2),
              op("Optimizer.step#SGD.step", 80, 95, cat="user_annotation")]
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": events}))
    r = subprocess.run([PYTHON, REPO / "tools" / "plot_profile.py", tmp_path / "trace.json", "--out", tmp_path / "t.svg"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    root = ElementTree.parse(tmp_path / "t.svg").getroot()
    labels = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    for label in ("data wait 10%", "compute 40%", "communication, overlapped 10%", "communication, exposed 15%",
                  "optimizer 15%"):
        assert label in labels, labels
    r = subprocess.run([PYTHON, REPO / "tools" / "plot_profile.py", tmp_path / "t.svg", "--out", tmp_path / "x.svg"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.startswith("error: cannot read a Chrome trace"), r.stderr


def test_start_dry_run_names_every_method(tmp_path):
    r = bash("start.sh", "--dry-run", "--logs", tmp_path, "--epochs", 3)
    assert r.returncode == 0, r.stderr
    for method in ("dp", "ddp", "launch", "spawn", "amp", "horovod", "slurm", "fsdp", "deepspeed"):
        assert f"== {method}: " in r.stdout, method
    assert "torch.distributed.launch --nproc_per_node=2" in r.stdout
    assert re.search(r"== deepspeed: \S*/deepspeed --num_gpus 2 --master_port \d+ deepspeed_distributed.py ", r.stdout)
    assert "--epochs 3" in r.stdout and "--data data/digits" in r.stdout
    r = bash("start.sh", "--methods", "ddp,nope", "--dry-run")
    assert r.returncode == 2 and "unknown method 'nope'" in r.stderr
    r = bash("start.sh", "--dry-run", "--benchmark", "--repeats", 1, "--methods", "ddp", "--logs", tmp_path,
             "--profile", "3:6")
    assert re.search(r"== ceiling \(run 1/1\): \S*/torchrun .* benchmarks/bare_ddp.py .* --no-communication", r.stdout)
    assert "--no-communication --profile" not in r.stdout and "distributed.py" in r.stdout
    assert all("--profile 3:6 --output-dir" in line for line in r.stdout.splitlines() if "distributed.py" in line)
    assert not list(tmp_path.glob("*.log")), "a dry run writes no logs"


def test_start_dry_run_sizes_the_recipe_for_gpus(tmp_path):
    """On GPUs (START_GPUS fakes 4 here): ResNet-50 at 224 px, 128 images per GPU, one precision for every method."""
    methods = ("--methods", "dp,ddp,amp,fsdp,deepspeed", "--logs", tmp_path)
    r = subprocess.run(["bash", "start.sh", "--dry-run", *methods], cwd=REPO, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "START_GPUS": "4"})
    assert r.returncode == 0, r.stderr
    commands = {line.split(":")[0][3:]: line for line in r.stdout.splitlines() if line.startswith("== ")}
    assert sorted(commands) == ["amp", "ddp", "deepspeed", "dp", "fsdp"], r.stdout
    for line in commands.values():
        assert re.search(r" --dummy --dummy-samples 51200 -a resnet50 --image-size 224 -b 512 -j \d+ --epochs 4 ", line)
        assert "float16" not in line and "bfloat16" not in line, line
    assert "--nproc-per-node=4 apex_distributed.py " in commands["amp"] and "--amp-dtype float32 " in commands["amp"]
    assert "--gpus 0,1,2,3 " in commands["dp"]
    assert "every method in fp32" in r.stdout
    r = subprocess.run(["bash", "start.sh", "--dry-run", *methods, "--precision", "bf16", "--", "-b", "256"],
                       cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, "START_GPUS": "4"})
    assert r.returncode == 0, r.stderr
    commands = {line.split(":")[0][3:]: line for line in r.stdout.splitlines() if line.startswith("== ")}
    assert "--amp-dtype bfloat16 -b 256 --output-dir" in commands["amp"], "args after -- come last, so they win"
    assert "--param-dtype bfloat16 --reduce-dtype float32 -b 256 " in commands["fsdp"]
    assert "--precision bfloat16 -b 256 " in commands["deepspeed"]
    assert "dtype" not in commands["ddp"] and "--precision" not in commands["ddp"]
    r = subprocess.run(["bash", "start.sh", "--methods", "ddp"], cwd=REPO, capture_output=True, text=True,
                       timeout=120, env={**os.environ, "START_GPUS": "4"})
    assert r.returncode == 2 and "START_GPUS is for --dry-run" in r.stderr
    # No GPU: the demo digits, as before, and no precision flag (apex picks its own on the CPU).
    r = subprocess.run(["bash", "start.sh", "--dry-run", "--methods", "dp,ddp,amp", "--logs", tmp_path], cwd=REPO,
                       capture_output=True, text=True, timeout=120, env={**os.environ, "START_GPUS": "0"})
    assert r.returncode == 0, r.stderr
    assert "--data data/digits --image-size 32 -j 1 -b 32 " in r.stdout
    assert "resnet50" not in r.stdout and "dtype" not in r.stdout and "fp32" not in r.stdout


def test_start_writes_what_each_row_ran(tmp_path):
    """A real run (dp, on the CPU): its log opens with start.sh's RECIPE line, and the table names the model, image
    size, precision and global batch it ran (here the args after --, which come last)."""
    r = bash("start.sh", "--methods", "dp", "--dummy", "--epochs", 1, "--logs", tmp_path, "--precision", "fp32",
             "--", "--dummy-samples", 32, "--image-size", 32, "-b", 16, "-j", 0, "--val-batch-size", 16)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "dp.log").read_text().startswith('RECIPE {"image_size": 32, "gpus": 0, "precision": "float32"}\n')
    assert "| dp | none | 1 | cpu | resnet18 | 32 | fp32 | 16 | 1 |" in r.stdout

def test_imagenet_like_set_matches_imagenet_and_resizes(tmp_path):
    """tools/make_imagenet_like.py: ImageFolder layout, ImageNet's mean size (about 400x350, 110 KB) and
    encoding (quality 96, 4:4:4), the same bytes from the same seed, written by 1 process or 2;
    tools/resize_dataset.py caps the shorter side."""
    from PIL import Image, JpegImagePlugin

    def make(out, jobs):
        return subprocess.run([PYTHON, REPO / "tools" / "make_imagenet_like.py", "--out", out, "--train-count", "24",
                               "--val-count", "6", "--classes", "3", "-j", jobs], capture_output=True, text=True,
                              check=True)

    r = make(tmp_path / "a", "1")
    assert "mean " in r.stdout and "KB" in r.stdout
    train = sorted((tmp_path / "a" / "train").glob("*/*.JPEG"))
    assert len(train) == 24 and len(list((tmp_path / "a" / "val").glob("*/*.JPEG"))) == 6
    assert sorted(p.name for p in (tmp_path / "a" / "val").iterdir()) == ["class00", "class01", "class02"]
    images = [Image.open(p) for p in train]
    assert 350 < sum(i.width for i in images) / 24 < 450 and 300 < sum(i.height for i in images) / 24 < 400
    assert 80e3 < sum(p.stat().st_size for p in train) / 24 < 140e3
    reference = tmp_path / "q96.jpg"
    images[0].save(reference, quality=96, subsampling=0)
    assert all(JpegImagePlugin.get_sampling(i) == 0 for i in images)  # 4:4:4
    assert all(i.quantization == Image.open(reference).quantization for i in images)  # quality 96's tables
    make(tmp_path / "b", "2")
    assert all((tmp_path / "b" / p.relative_to(tmp_path / "a")).read_bytes() == p.read_bytes() for p in train)

    subprocess.run([PYTHON, REPO / "tools" / "resize_dataset.py", tmp_path / "a", tmp_path / "r", "--size", "288"],
                   check=True, capture_output=True)
    resized = [Image.open(tmp_path / "r" / p.relative_to(tmp_path / "a")) for p in train]
    assert all(min(i.size) == min(288, min(o.size)) for i, o in zip(resized, images))
    assert all(abs(i.width / i.height - o.width / o.height) < 0.01 for i, o in zip(resized, images))


FAKE_TRAINER = """import json, os, sys, time
with open(os.path.join(os.environ["FAKE_LOG"], os.path.basename(__file__) + ".json"), "w") as f:
    json.dump(sys.argv[1:], f)
print("Epoch: [0][ 1/9]", flush=True)
r, w = os.pipe()
if os.fork() == 0:  # a loader worker: 64 MB of its own, then it waits to be killed with the run
    held = bytearray(64 << 20)
    held[::4096] = b"x" * len(held[::4096])
    os.write(w, str(os.getpid()).encode())
    time.sleep(600)
worker = os.read(r, 16).decode()
with open(os.path.join(os.environ["FAKE_LOG"], os.path.basename(__file__) + ".pid"), "w") as f:
    f.write(worker)
time.sleep(1)  # for the samples to see it
print("Epoch: [0][ 3/9]", flush=True)
time.sleep(600)
"""


def test_imagenet_scale_times_and_weighs_each_script_on_a_linked_tree(tmp_path):
    """tools/make_imagenet_like.py --distinct: every file past the first N of a split is a hard link to one of them
    (no inode of its own). benchmarks/imagenet_scale.py gives every script the same flags, times its line at the step,
    sums its processes' PSS (a forked worker's 64 MB counts), kills what it started, and says a missing peer loudly."""
    tree = tmp_path / "tree"
    subprocess.run([PYTHON, REPO / "tools" / "make_imagenet_like.py", "--out", tree, "--classes", "3", "--train-count",
                    "12", "--val-count", "5", "--distinct", "2", "-j", "1"], check=True, capture_output=True)
    for split, count in (("train", 12), ("val", 5)):
        files = sorted((tree / split).glob("*/*.JPEG"))
        assert len(files) == count and len({f.stat().st_ino for f in files}) == 2
        assert sorted(p.name for p in (tree / split).iterdir()) == ["class00", "class01", "class02"]
        assert (tree / split / "class02" / f"{split}_000002.JPEG").samefile(tree / split / "class00" /
                                                                             f"{split}_000000.JPEG")
    for name in ("ours.py", "main.py"):
        (tmp_path / name).write_text(FAKE_TRAINER)
    command = [PYTHON, REPO / "benchmarks" / "imagenet_scale.py", "--data", tree, "--ours", tmp_path / "ours.py",
               "--main-py", tmp_path / "main.py", "-j", "1", "--rounds", "1", "--step", "3", "--interval", "0.05",
               "--run-timeout", "60", "--output-dir", tmp_path / "out"]
    r = subprocess.run(command, capture_output=True, text=True, timeout=180, env=dict(os.environ, FAKE_LOG=tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    runs = json.loads((tmp_path / "out" / "imagenet_scale.json").read_text())["runs"]
    assert [(run["script"], run["step"], run["first_line"][1]) for run in runs] == [("ours.py", 3, 1),
                                                                                     ("main.py", 3, 1)]
    imagenet_scale = script_module("benchmarks/imagenet_scale.py")
    for run in runs:
        assert 1 <= run["seconds"] < 60 and run["exit"] == "stopped at the line"
        assert run["peak_mb"] >= 64 and re.search(r"worker 1 x (6\d|7\d) MB", run["at_line"]), run
        assert not imagenet_scale.alive(int((tmp_path / (run["script"] + ".pid")).read_text()))  # killed with its run
    flags = ["-a", "resnet18", "-b", "32", "-j", "1", "-p", "3"]
    assert json.loads((tmp_path / "main.py.json").read_text()) == [str(tree), *flags]
    assert json.loads((tmp_path / "ours.py.json").read_text())[:len(flags) + 2] == ["--data", str(tree), *flags]
    assert "| 1 | " in (tmp_path / "out" / "imagenet_scale.md").read_text()
    command[command.index("--main-py") + 1] = tmp_path / "absent.py"
    r = subprocess.run(command, capture_output=True, text=True, timeout=180, env=dict(os.environ, FAKE_LOG=tmp_path))
    assert r.returncode == 1 and "WARNING: **MISSING PEER**: pytorch/examples' main.py not found" in r.stderr
    assert [run["script"] for run in json.loads((tmp_path / "out" / "imagenet_scale.json").read_text())["runs"]] == [
        "ours.py"]


def test_gpu_check_runs_offline_on_a_cpu_machine_and_says_what_it_skipped(tmp_path):
    """The offline check (the default) on a machine without GPUs: it installs nothing and uses no network
    (a proxy that refuses every connection), writes both reports, one line per absent engine, and every GPU
    row skipped with the reason. A --wheels folder that fetch_wheels.sh did not fill is one error line."""
    site = Path(PYTHON).parent.parent / "lib"
    before = sorted(p.name for p in site.glob("python*/site-packages/*"))
    offline = {**os.environ, "PYTHON": PYTHON, "PIP_NO_INDEX": "1", "https_proxy": "http://127.0.0.1:9",
               "http_proxy": "http://127.0.0.1:9"}
    r = subprocess.run(["bash", REPO / "scripts" / "gpu_check.sh", "--offline", "--out", tmp_path / "check.md",
                        "--logs", tmp_path / "logs"], capture_output=True, text=True, env=offline)
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "check.json").read_text())
    assert report["machine"]["gpus"] == 0
    assert report["suite"]["status"] == report["benchmark"]["status"] == "skipped: no CUDA GPU visible to torch"
    assert "## GPU suite (tests/test_gpu.py): skipped: no CUDA GPU" in (tmp_path / "check.md").read_text()
    absent = [line for line in r.stdout.splitlines() if " absent: " in line and not line.startswith("- ")]
    assert [line.split(" absent: ")[0] for line in absent] == [
        name for name, version in zip(("DeepSpeed", "Horovod", "DALI", "pytest", "pytest-xdist", "timm"),
                                      report["engines"].values()) if version is None]
    assert sorted(p.name for p in site.glob("python*/site-packages/*")) == before
    r = subprocess.run(["bash", REPO / "scripts" / "gpu_check.sh", "--wheels", tmp_path], capture_output=True,
                       text=True, env=offline)
    assert r.returncode == 2 and r.stderr.splitlines() == [
        f"gpu_check.sh: error: --wheels {tmp_path} has no requirements.txt: fill it with scripts/fetch_wheels.sh "
        f"{tmp_path} on an online machine"]


def test_gpu_check_stops_what_a_row_started_in_sessions_of_their_own(tmp_path):
    """A row stopped at its timeout leaves nothing running: not even a process in a session of its own whose parent
    is killed, as torchrun's workers are (torch's elastic subprocess handler starts them with start_new_session)."""
    (tmp_path / "worker.py").write_text("import os, sys, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\n"
                                        "time.sleep(120)\n")
    (tmp_path / "launcher.py").write_text(  # torchrun's part: the worker in a new session, then it waits
        "import os, subprocess, sys, time\nsubprocess.Popen([sys.executable] + sys.argv[1:], start_new_session=True)\n"
        "while not os.path.exists(sys.argv[2]):\n    time.sleep(0.05)\ntime.sleep(120)\n")
    pid_file = tmp_path / "worker.pid"
    row = (f"import importlib.util, json, sys\nspec = importlib.util.spec_from_file_location('gpu_check', "
           f"{str(REPO / 'scripts' / 'gpu_check.py')!r})\ngpu_check = importlib.util.module_from_spec(spec)\n"
           "spec.loader.exec_module(gpu_check)\ngpu_check.become_subreaper()\n"
           f"status, seconds, killed = gpu_check.run_row([sys.executable, {str(tmp_path / 'launcher.py')!r}, "
           f"{str(tmp_path / 'worker.py')!r}, {str(pid_file)!r}], {str(tmp_path / 'row.log')!r}, 8)\n"
           "print(json.dumps([status, killed]))\n")
    r = subprocess.run([PYTHON, "-c", row], capture_output=True, text=True, timeout=60)
    worker = int(pid_file.read_text())
    alive = Path(f"/proc/{worker}").exists()
    if alive:
        os.kill(worker, 9)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [None, 1] and not alive  # stopped at its timeout; the worker killed with it


def test_gpu_check_takes_a_run_whose_loss_does_not_fall_for_no_measurement():
    """A benchmark row's verdict from its first and last epoch's mean loss: one that is not finite or does not fall
    says the run did not train (NaN weights, every step skipped), so its images/s measure nothing."""
    verdict = script_module("scripts/gpu_check.py").loss_verdict
    assert verdict([{"train_loss": 7.2}, {"train_loss": 6.9}]) == (7.2, 6.9, None)
    assert "did not fall" in verdict([{"train_loss": 6.9}, {"train_loss": 6.9}])[2]
    assert "not finite" in verdict([{"train_loss": 7.2}, {"train_loss": float("nan")}])[2]
    assert "no train_loss" in verdict([{"images_per_sec": 1.0}, {"images_per_sec": 1.0}])[2]


def test_bare_loop_trains_on_after_an_fp16_overflow_in_its_first_step(monkeypatch):
    """GradScaler skipping step 1 leaves bare_ddp.py's fused SGD with zeroed momentum, as the trainers'. Without the
    zeros, the fused step keeps the torch.empty_like buffers it made, unwritten: here NaN, as memory may hold."""
    import torch
    make_optimizer = script_module("benchmarks/bare_ddp.py").make_optimizer
    monkeypatch.setattr(torch, "empty_like", lambda t, *args, **kwargs: torch.full_like(t, float("nan")))
    model = torch.nn.Linear(8, 4)
    optimizer = make_optimizer(model, 256)
    model(torch.ones(2, 8)).sum().backward()
    for found_inf in (1.0, 0.0):  # what GradScaler.step hands a fused optimizer: step 1 overflowed, step 2 did not
        optimizer.grad_scale, optimizer.found_inf = torch.ones(()), torch.tensor(found_inf)
        optimizer.step()
    assert all(p.isfinite().all() for p in model.parameters())


def test_vs_timm_says_loudly_which_peer_is_missing(tmp_path, capsys):
    """A peer asked for and absent (benchmarks/peers/ is ignored by git: a machine sent only the tracked files has
    none) is a bold line of the report and a warning, and the run's exit status is 1."""
    vs_timm = script_module("benchmarks/vs_timm.py")
    args = vs_timm.parse_args(["--timm-train", str(tmp_path / "train.py"), "--main-py", str(tmp_path / "main.py")])
    state = {"notes": [], "skipped": {}}
    missing = vs_timm.missing_peers(args, state)
    assert [line for line in state["notes"] if line.startswith("**MISSING PEER**")] == state["notes"]
    assert [line.split(" not found")[0] for line in state["notes"]] == [
        "**MISSING PEER**: timm's train.py", "**MISSING PEER**: pytorch/examples' main.py"]
    assert state["skipped"] == {"plain": f"skipped: pytorch/examples' main.py not found at {tmp_path / 'main.py'}"}
    assert capsys.readouterr().err.splitlines() == missing and len(missing) == 3
    (tmp_path / "main.py").touch()
    state = {"notes": [], "skipped": {}}
    args = vs_timm.parse_args(["--timm-train", "", "--main-py", str(tmp_path / "main.py")])
    assert vs_timm.missing_peers(args, state) == [] and state == {"notes": [], "skipped": {}}


# ---- README: its table's diff column, its snippets, its links and docs/'s ----

def test_readme_diff_column_is_what_diff_counts(tmp_path):
    """tools/readme_table.py --check passes on README.md, whose column is what the shell pipeline
    counts for every script, and whose count of the shared block's lines is `wc -l` minus the banner's
    line; on a copy with a count changed it fails naming the line, and a rewrite restores the count."""
    tool = REPO / "tools" / "readme_table.py"
    r = subprocess.run([PYTHON, tool, "--check"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rows = readme_table.table_rows((REPO / "README.md").read_text())
    assert sorted(script for _, script, _, _ in rows) == sorted(p.name for p in REPO.glob("*.py"))
    for _, script, row, column in rows:
        shell = subprocess.run(f"diff distributed.py {script} | grep -c '^[<>]'", shell=True, cwd=REPO,
                               capture_output=True, text=True)
        assert row[column] == shell.stdout.strip(), script
    shell = subprocess.run("echo $(($(wc -l < distributed.py) - $(grep -n 'helpers shared by every script' "
                           "distributed.py | head -1 | cut -d: -f1)))", shell=True, cwd=REPO, capture_output=True,
                           text=True)
    block = f"{int(shell.stdout):,}"
    assert f"The block is **{block} lines**" in (REPO / "README.md").read_text()

    i, script, row, column = rows[-1]
    lines = (REPO / "README.md").read_text().splitlines(keepends=True)
    wrong = int(row[column]) + 1
    lines[i] = lines[i].replace(f"| {row[column]} |", f"| {wrong} |")
    stated = next(k for k, line in enumerate(lines) if f"The block is **{block} lines**" in line)
    lines[stated] = lines[stated].replace(f"**{block} lines**", "**7 lines**")
    copy = tmp_path / "README.md"
    copy.write_text("".join(lines))
    r = subprocess.run([PYTHON, tool, "--check", "--readme", copy], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr.splitlines() == [f"README.md:{i + 1}: {script}: the table says {wrong}, diff gives {row[column]}",
                                     f"README.md:{stated + 1}: the shared block: README says 7 lines, it has {block}"]
    subprocess.run([PYTHON, tool, "--readme", copy], check=True, capture_output=True, timeout=60)
    assert copy.read_text() == (REPO / "README.md").read_text()


def test_readme_snippets_are_lines_of_their_scripts():
    assert readme_table.check_snippets((REPO / "README.md").read_text()) == []


def test_an_altered_snippet_is_reported_with_its_readme_line():
    """A changed line, a line left out of a run (which is then no longer contiguous in the script),
    a marker gone: each is one problem, naming the README line, or the script left without a snippet."""
    text = (REPO / "README.md").read_text()
    lines = text.splitlines()
    first, script, block = next(s for s in readme_table.snippets(text) if "..." not in s[2][:3])

    lines[first] = block[1] + "  # changed"  # the run's second line
    [problem] = readme_table.check_snippets("\n".join(lines))
    assert problem.startswith(f"README.md:{first + 1}: not a line of {script} where the snippet puts it (after "
                              f"{script}:") and problem.endswith("# changed'"), problem

    del lines[first]  # the second line left out: the third follows the first in the README, not in the script
    [problem] = readme_table.check_snippets("\n".join(lines))
    assert problem.startswith(f"README.md:{first + 1}: not a line of {script}") and block[2].strip() in problem

    [problem] = readme_table.check_snippets(text.replace(f"<!-- snippet: {script} -->", ""))
    assert problem == f"README.md: {script} has no snippet (a ```python block after <!-- snippet: {script} -->)"


def test_a_flag_the_docs_give_a_trainer_must_be_in_its_parser(tmp_path):
    """Each way a page gives a trainer a flag, checked against the trainer's argument parser: a made-up flag in a
    command (joined over a backslash), in a code span over two lines, in a table of flags (the title's trainer), under
    a heading naming a trainer, is one problem naming the line; a launcher's flags, and another program's after a
    pipe, are not the trainer's. On a README copy whose table of methods names a made-up flag, --check fails."""
    page = tmp_path / "page.md"
    page.write_text("# Knobs of apex_distributed.py\n\n```\n"
                    "torchrun --standalone --nproc-per-node=2 distributed.py --data D -j 2 \\\n"
                    "    --no-such-flag 1 --save-every=5  # --in-a-comment\n"
                    "python distributed.py --data D | tee log --append\n```\n\n"
                    "Run `python dataparallel.py --gpus 0,1\n--made-up` and `--standalone` alone.\n\n"
                    "| flag | meaning |\n|---|---|\n| `--compile`, `-e --resume PATH\\|auto` | yes |\n"
                    "| `--made-up-knob X` | no |\n\n"
                    "### `horovod_distributed.py`: Horovod\n\n`--fp16-allreduce`, not `--zero-stage 2`.\n")
    assert readme_table.check_flags(page.read_text(), "page.md") == [
        "page.md:4: --no-such-flag is not a flag of distributed.py",
        "page.md:9: --made-up is not a flag of dataparallel.py",
        "page.md:15: --made-up-knob is not a flag of apex_distributed.py",
        "page.md:19: --zero-stage is not a flag of horovod_distributed.py"]

    lines = (REPO / "README.md").read_text().splitlines(keepends=True)
    row = next(i for i, line in enumerate(lines) if line.startswith("| `horovod_distributed.py`"))
    assert "`--fp16-allreduce`" in lines[row]
    lines[row] = lines[row].replace("`--fp16-allreduce`", "`--fp16-all-reduce`")
    copy = tmp_path / "README.md"
    copy.write_text("".join(lines))
    r = subprocess.run([PYTHON, REPO / "tools" / "readme_table.py", "--check", "--readme", copy], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1
    assert f"README.md:{row + 1}: --fp16-all-reduce is not a flag of horovod_distributed.py" in r.stderr.splitlines()


def markdown_lines(path):
    """(line number, line) of a Markdown file outside its fenced code blocks."""
    fenced = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield number, line


def anchors(path):
    """The #anchors GitHub gives a Markdown file's headings: lower case, punctuation dropped, spaces to -."""
    return {re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for _, line in markdown_lines(path) if re.match(r"#{1,6} ", line)}


def broken_links(paths):
    """'FILE:LINE: target' for each relative link (or image) of these Markdown files that leads to no
    file, or to no heading of it."""
    broken = []
    for path in paths:
        for number, line in markdown_lines(path):
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"[a-z]+:", target):
                    continue
                file, _, anchor = target.partition("#")
                linked = (path.parent / file).resolve() if file else path
                if not linked.is_file() or (anchor and anchor not in anchors(linked)):
                    broken.append(f"{os.path.relpath(path, REPO)}:{number}: {target}")
    return broken


def test_readme_and_docs_links_lead_somewhere(tmp_path):
    assert broken_links([REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]) == []
    page = tmp_path / "page.md"
    page.write_text("# A page\n\n[ok](#a-page) [gone](missing.md) [no heading](page.md#nowhere)\n"
                    "```\n[in code](missing.md)\n```\n![image](https://example.org/x.png)\n")
    assert [line.split(": ", 1)[1] for line in broken_links([page])] == ["missing.md", "page.md#nowhere"]


def test_metrics_tensorboard_follows_a_resumed_run_without_repeating_steps(tmp_path):
    """--follow: the event file is rewritten once metrics.jsonl changes; a resumed run's rewrite of it
    (its repeated steps dropped, a new file in their place) leaves one point per step, the new ones."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def record(kind, epoch, step, **fields):
        return json.dumps({"kind": kind, "position": [epoch, step], "time": 1e9 + 10 * epoch + step, **fields}) + "\n"
    metrics = tmp_path / "metrics.jsonl"
    # 4 steps an epoch, printed every 2; then a run killed while writing its last line.
    metrics.write_text(record("train", 0, 2, loss=2.0) + record("train", 0, 4, loss=1.5)
                       + record("SUMMARY", 1, 0, val_acc1=40.0, ranks_identical=True, method="ddp")
                       + record("train", 1, 2, loss=1.2) + '{"kind": "train", "posi')
    follow = subprocess.Popen([PYTHON, REPO / "tools" / "metrics_tensorboard.py", tmp_path, "--follow", "0.1"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert follow.stdout.readline().startswith("4 records of"), follow.stderr.read()
        # Resumed from the end of epoch 0: step 2 of epoch 1 again, with another loss (os.replace, as open_metrics).
        resumed = tmp_path / "new.jsonl"
        resumed.write_text("".join(metrics.read_text().splitlines(keepends=True)[:3]) + record("train", 1, 2, loss=1.1))
        os.replace(resumed, metrics)
        assert follow.stdout.readline().startswith("4 records of")
    finally:
        follow.kill()
        follow.wait()
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert [(s.step, s.value) for s in events.Scalars("train/loss")] == [(2, 2.0), (4, 1.5), (6, pytest.approx(1.1))]
    assert [(s.step, s.value) for s in events.Scalars("summary/val_acc1")] == [(4, 40.0)]
    assert "summary/ranks_identical" not in events.Tags()["scalars"]


def test_input_pipeline_runs_its_cpu_rows_side_by_side_and_says_why_each_gpu_row_skipped(tmp_path):
    """benchmarks/input_pipeline.py on 40 small JPEGs, with no CUDA device: every CPU row measured (median, range)
    with the trainers' default (TorchCodec here) beside torchvision.io's, their round-by-round ratio, each GPU row one
    line saying why it skipped, and torchvision's notice that TorchCodec supersedes it named once, with its rows."""
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(0)
    for split, count in (("train", 20), ("val", 2)):
        for label in ("a", "b"):
            (tmp_path / split / label).mkdir(parents=True)
            for i in range(count):
                pixels = rng.integers(0, 256, (80, 96, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(tmp_path / split / label / f"{i}.JPEG", quality=90)
    r = subprocess.run([PYTHON, REPO / "benchmarks" / "input_pipeline.py", "--data", tmp_path, "--images", "40",
                        "--rounds", "2", "--max-workers", "0", "--sweep-images", "32"], cwd=REPO, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr
    rows = {cells[0]: cells[1:] for cells in (line.strip("| ").split(" | ") for line in r.stdout.splitlines()
                                              if line.startswith("| ") and "| backend |" not in line)}
    measured = ["today", "default", "default --decoder torchvision", "default --decoder pil", "tc-decode", "tv-decode",
                "pil-draft", "normalise"]
    assert list(rows)[:12] == measured[:-1] + ["dali-cpu", "normalise", "dali-mixed", "tv-decode-cuda",
                                               "torchcodec-cuda"]
    assert rows["default"][0] == "the trainers' default, --decoder torchcodec: uint8"
    for name in measured:  # dali-cpu left out: it runs where DALI is installed
        median, low, high = map(float, re.fullmatch(r"(\d+) \((\d+)-(\d+)\)", rows[name][1]).groups())
        assert low <= median <= high, rows[name]
        assert float(rows[name][2]) == pytest.approx(1000 / median, rel=0.01, abs=0.006), rows[name]  # CPU ms/image
    for name in ("dali-mixed", "tv-decode-cuda", "torchcodec-cuda"):
        assert rows[name][1:] == ["skipped: no CUDA device"]  # its empty cells stripped with the line's "| "
    assert re.search(r"^default \(--decoder torchcodec\) / default --decoder torchvision, per core, round by round: "
                     r"median \d\.\d\d \(range \d\.\d\d-\d\.\d\d\)$", r.stdout, re.M)
    warned = [line for line in r.stdout.splitlines() if line.startswith("warned by ")]
    assert len(warned) == 1 and warned[0].startswith(
        "warned by default --decoder torchvision, tv-decode: DeprecationWarning: The image decoding and encoding "
        "capabilities of TorchVision are deprecated"), warned


def test_gpu_check_names_the_torchcodec_it_found_next_to_torch(tmp_path, monkeypatch):
    """The machine lines name TorchCodec's version as the probe's torch imports it, and a TorchCodec that is installed
    but does not load with this torch (a build for another one) as such, with the first line of its error."""
    gpu_check = script_module("scripts/gpu_check.py")
    found = gpu_check.machine()
    state = {"date": "today", "command": "check", "machine": found, "engines": {}, "notes": [],
             "suite": {"status": "not run", "rows": []}, "benchmark": {"status": "not run", "workload": "", "rows": []}}
    gpu_check.render(state, tmp_path / "check.md")
    import torchcodec
    assert f", torchvision {found['torchvision']}, TorchCodec {torchcodec.__version__}, Python " in (
        tmp_path / "check.md").read_text()
    (tmp_path / "torchcodec").mkdir()  # on PYTHONPATH, it shadows the installed one as a build for another torch would
    (tmp_path / "torchcodec" / "__init__.py").write_text(
        "raise OSError('libtorchcodec_image.so: undefined symbol: torch_new_api\\nmore')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    from importlib.metadata import version
    assert gpu_check.machine()["torchcodec"] == (f"{version('torchcodec')} (does not load: libtorchcodec_image.so: "
                                                 "undefined symbol: torch_new_api)")
