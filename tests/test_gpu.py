"""The GPU suite: the CUDA + NCCL lines of every script, run on the GPUs of the machine at hand.

    .venv/bin/python -m pytest -q tests/test_gpu.py     # on a machine with 1 or more CUDA GPUs

Without a CUDA GPU every test here is skipped with one reason, which the test log shows (CI's
machines have none: these tests are not counted there). A GPU that nvidia-smi lists and torch cannot use
fails the module with torch's error instead; DeepSpeed or Horovod not installed skips its tests (under
CI=1 fails them, as conftest.require_engine), and one that does not import fails them. The multi-process
runs take 2 processes: on 2 or more GPUs one per GPU over NCCL; on one GPU both share it over gloo
(--dist-backend gloo: NCCL refuses two ranks on one GPU), so DDP, FSDP2 and ZeRO on CUDA tensors are
still compared with one process. Tests that need 2 GPUs (DataParallel, SyncBatchNorm, Horovod's NCCL),
an Ampere GPU, Horovod built with NCCL or a running Slurm cluster say so when they skip, as they are
collected: before a module fixture trains. The CPU suite runs the same scripts with no GPU visible
(conftest.py hides them). scripts/gpu_check.sh runs this file.
"""
import atexit
import fcntl
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

# resnet18, as this suite has run on GPUs; the CPU suite runs resnet_tiny (conftest.TINY).
from conftest import (EQUIV_RESNET18 as EQUIV, EQUIV_TOLERANCE, FAST_RESNET18 as FAST, FLOAT64, GPU_ENV,
                      OVERFLOW_AT_STEP_1, PYTHON, assert_bf16_follows_float32, check_first_step_skipped,
                      environment, float64_weights, load_state, max_abs_diff, once, resume_mid_epoch, run,
                      script_module)

# What the suite needs to know of the machine, from one interpreter that sees the GPUs. device_count() says 0 (a
# warning at most) for a driver too old, a CPU-only build or a bad CUDA_VISIBLE_DEVICES: where nvidia-smi lists
# GPUs (argv[1] == "1"), torch.cuda.init() raises the reason instead. An engine is None where it imports, "absent"
# where it is simply not installed, else its import's traceback.
PROBE = """
import importlib, json, shutil, subprocess, sys, traceback
import torch
facts = {"gpus": torch.cuda.device_count()}
if facts["gpus"] or sys.argv[1] == "1":
    torch.cuda.init()
def imported(module):
    try:
        importlib.import_module(module)
    except Exception as error:
        absent = isinstance(error, ModuleNotFoundError) and error.name == module.split(".")[0]
        return "absent" if absent else traceback.format_exc()
if facts["gpus"]:
    facts.update(ampere=torch.cuda.is_bf16_supported(including_emulation=False), deepspeed=imported("deepspeed"),
                 horovod=imported("horovod.torch"), slurm=bool(shutil.which("scontrol")) and subprocess.run(
                     ["scontrol", "ping"], capture_output=True).returncode == 0)
    facts["horovod_nccl"] = facts["horovod"] is None and bool(sys.modules["horovod.torch"].nccl_built())
print(json.dumps(facts))  # the last line: DeepSpeed logs to stdout as it imports
"""


def driver_gpus():
    """The GPUs nvidia-smi lists ("GPU 0: ..." lines), 0 where it is absent or fails."""
    smi = shutil.which("nvidia-smi")
    listed = smi and subprocess.run([smi, "-L"], capture_output=True, text=True)
    if not listed or listed.returncode:
        return 0
    return sum(line.startswith("GPU ") for line in listed.stdout.splitlines())


def probe_once(expect_gpus):
    """PROBE's (returncode, stdout, stderr), once per session: pytest-xdist's workers (one test run id) take the
    first's from a file rather than each importing torch, DeepSpeed and Horovod as it collects this module."""
    def probe():
        p = subprocess.run([PYTHON, "-c", PROBE, str(int(expect_gpus))], env=environment(GPU_ENV),
                           capture_output=True, text=True)
        return p.returncode, p.stdout, p.stderr
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id is None:
        return probe()
    path = Path(tempfile.gettempdir()) / f"cookbook-gpu-probe-{run_id}.json"
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        found = f.read()
        if not found:
            found = json.dumps(probe())
            f.write(found)
    atexit.register(path.unlink, missing_ok=True)  # the first worker to exit removes it: a later one probes again
    return json.loads(found)


# A failed probe fails the module with its error (a GPU that the driver lists and torch cannot use, an import
# error): a skip would pass the suite. CUDA_VISIBLE_DEVICES="" at the session's start hides the GPUs on purpose
# (conftest.GPU_ENV keeps it): torch then counts none, and the module skips.
DRIVER_GPUS = driver_gpus() if GPU_ENV["CUDA_VISIBLE_DEVICES"] not in ("", "-1") else 0  # as the trainers read it
_returncode, _stdout, _stderr = probe_once(DRIVER_GPUS > 0)
if _returncode:
    visible = GPU_ENV["CUDA_VISIBLE_DEVICES"]
    pytest.fail(f"the probe of the GPUs failed (nvidia-smi lists {DRIVER_GPUS} GPU(s), CUDA_VISIBLE_DEVICES "
                f"{'unset' if visible is None else repr(visible)}):\n{_stderr}", pytrace=False)
FACTS = json.loads(_stdout.splitlines()[-1])
GPUS, AMPERE, SLURM_UP = FACTS["gpus"], FACTS.get("ampere"), FACTS.get("slurm")
TWO = 2  # processes of the multi-process runs: sharing one GPU over gloo where there is only one
pytestmark = pytest.mark.skipif(GPUS == 0, reason="no CUDA GPU visible: tests/test_gpu.py needs a machine with GPUs")
needs_two = pytest.mark.skipif(GPUS == 1, reason="needs 2 or more GPUs (NCCL, or one replica per GPU)")
CI = os.environ.get("CI", "") not in ("", "0", "false")  # as conftest.require_engine
INSTALL = {"deepspeed": "bash scripts/install.sh --tests", "horovod": "bash scripts/install_horovod.sh"}


def needs(engine):
    """Skips, at collection (before a module fixture trains), the tests of an engine that is not installed; under
    CI=1 they run, and check_engine fails them, as conftest.require_engine does."""
    return pytest.mark.skipif(FACTS.get(engine) == "absent" and not CI,
                              reason=f"{engine} is not installed: {INSTALL[engine]}")


def check_engine(engine):
    """Fails the test where `engine` did not import in the probe: absent under CI=1, or broken (its traceback)."""
    error = FACTS[engine]
    if error == "absent":
        pytest.fail(f"{engine} is not installed (CI=1): {INSTALL[engine]}", pytrace=False)
    if error is not None:
        pytest.fail(f"{engine} does not import in a process that sees the GPUs:\n{error}", pytrace=False)


# Horovod's 2-rank runs: skipped where it is not installed, not built with NCCL, or on one GPU.
needs_horovod_nccl = pytest.mark.skipif(bool(GPUS) and FACTS["horovod"] is None and not FACTS["horovod_nccl"],
                                        reason="Horovod is not built with NCCL here (bash scripts/install_horovod.sh "
                                               "builds it so)")
two_horovod_ranks = pytest.mark.skipif(GPUS == 1, reason="Horovod's 2 ranks need 2 GPUs (its NCCL refuses two ranks "
                                                         "on one GPU)")
HOROVOD_NCCL = [needs("horovod"), needs_horovod_nccl, two_horovod_ranks]
NONDETERMINISTIC = "does not have a deterministic implementation"


def nondeterministic(*runs):
    """The runs' warnings that a kernel without a deterministic CUDA version ran (warn_only=True): why two runs'
    weights would differ in their last bits. None was seen in amp-fp16's runs on the H100 (docs/gpu.md), and no
    run measured one: the bitwise tests show them when they fail rather than fall back to a tolerance."""
    return [line for r in runs for line in r.stderr.splitlines() if NONDETERMINISTIC in line]


METHODS = {  # name: (script, launcher, extra flags)
    "ddp": ("distributed.py", "torchrun", []),
    "dp": ("dataparallel.py", "python", []),
    "spawn": ("multiprocessing_distributed.py", "spawn", []),
    "amp-fp16": ("apex_distributed.py", "torchrun", []),  # CUDA's default: fp16, GradScaler, channels_last, fused
    # amp-fp16's diagnostic counterpart: the same BatchNorm model, channels_last, cuDNN and fused SGD, in fp32 (no
    # GradScaler). amp-fp16 resumed to other weights on an H100 (docs/gpu.md); this one resuming bitwise there puts
    # the cause in the fp16 path, failing puts it in BatchNorm + channels_last + cuDNN.
    "amp-fp32": ("apex_distributed.py", "torchrun", ["--amp-dtype", "float32", "--channels-last", "on"]),
    "fsdp-bf16": ("fsdp_distributed.py", "torchrun", ["--param-dtype", "bfloat16"] if AMPERE else []),
    "horovod": ("horovod_distributed.py", "horovodrun", []),
}
AMP_LOG = {"amp-fp16": "=> autocast float16, GradScaler on, channels_last on",
           "amp-fp32": "=> autocast float32, GradScaler off, channels_last on"}


def gpu_run(args, script="distributed.py", launcher="torchrun", nproc=TWO, env=None, share=True):
    """A trainer run that sees the GPUs: one process per GPU (DataParallel: one process), or, with more
    processes than GPUs, processes sharing them over gloo unless share=False."""
    nproc = 1 if launcher == "python" else nproc
    args = list(args) + (["--dist-backend", "gloo"] if share and nproc > GPUS else [])
    return run(args, launcher, nproc, script, env={**GPU_ENV, **(env or {})})


# On one GPU, what two processes cannot share over gloo (seen on an H100, torch 2.11: docs/gpu.md).
FSDP_SHARED = "FSDP2's 2 ranks need 2 GPUs: its state-dict gather over gloo on CUDA tensors segfaults (torch 2.11)"
DEEPSPEED_SHARED = "DeepSpeed's 2 ranks need 2 GPUs: it takes LOCAL_RANK as its GPU index (runtime/engine.py:1941)"
two_fsdp_ranks = pytest.mark.skipif(GPUS == 1, reason=FSDP_SHARED)


@pytest.mark.parametrize("method", [pytest.param(m, marks=needs("horovod")) if m == "horovod" else m for m in METHODS])
def test_method_trains_resumes_and_evaluates_exactly(method, tiny_data, tmp_path):
    """Trains 2 epochs, and 1 then 1 more resumed: the same weights, bitwise. Then evaluates the checkpoint at 1 and
    at the run's processes: every val image once, and the metrics the training run reported for those weights."""
    script, launcher, extra = METHODS[method]
    if method == "horovod":
        check_engine("horovod")
    # On one GPU, Horovod and FSDP2 run 1 process (FSDP_SHARED, two_horovod_ranks say why), NCCL at world size 1.
    ranks = 1 if launcher == "python" or GPUS == 1 and method in ("horovod", "fsdp-bf16") else TWO
    args = ["--data", tiny_data, "-b", 32, "--warmup-epochs", 1, "--lr-step-size", 1, "--val-batch-size", 8]
    args += extra + FAST
    straight = gpu_run(args + ["--epochs", 2, "--output-dir", tmp_path / "straight"], script, launcher, ranks).check()
    assert [(s["device"], s["val_count"]) for s in straight.summaries] == [("cuda", 37)] * 2
    assert straight.done["ranks_identical"]
    assert AMP_LOG.get(method, "") in straight.stdout, straight.stdout  # the pair differs in fp16 and GradScaler only
    checkpoint = load_state(tmp_path / "straight" / "checkpoint.pth")
    assert all(t.isfinite().all() for t in checkpoint["state_dict"].values() if t.is_floating_point())

    first = gpu_run(args + ["--epochs", 1, "--output-dir", tmp_path / "split"], script, launcher, ranks).check()
    resumed = gpu_run(args + ["--epochs", 2, "--output-dir", tmp_path / "split", "--resume", "auto"], script,
                      launcher, ranks).check()
    assert [s["epoch"] for s in resumed.summaries] == [1]
    assert straight.done["state_sha256"] == resumed.done["state_sha256"], nondeterministic(straight, first, resumed)

    last = straight.summaries[-1]  # the training run's own evaluation of the weights it saved, batches of 8 too
    expected = (37, last["val_loss"], last["val_acc1"], last["val_acc5"])
    for nproc in sorted({1, ranks}):
        (s,) = gpu_run(["--data", tiny_data, "-e", "--resume", tmp_path / "straight" / "checkpoint.pth",
                        "--val-batch-size", 8] + extra + FAST, script, launcher, nproc).check().summaries
        assert (s["val_count"], s["val_loss"], s["val_acc1"], s["val_acc5"]) == expected, nproc


def test_checkpoint_from_the_gpu_opens_without_one(tmp_path, tiny_data):
    """Checkpoints hold CPU tensors (the GPU's RNG state too): a plain torch.load needs no map_location."""
    gpu_run(["--data", tiny_data, "-b", 32, "--epochs", 1, "--output-dir", tmp_path] + FAST).check()
    code = ("import sys, torch; c = torch.load(sys.argv[1], weights_only=True); "
            "print(len(c['rng'][0]['devices']), *sorted({t.device.type for t in c['state_dict'].values()}))")
    opened = subprocess.run([PYTHON, "-c", code, tmp_path / "checkpoint.pth"], env=environment(), capture_output=True,
                            text=True, check=True)  # conftest hides the GPUs from this process
    assert opened.stdout.split() == ["1", "cpu"]


def test_loader_workers_feed_the_gpu_the_same_batches(tiny_data, tmp_path):
    """-j 2: workers forked by the fork server, pinned memory, copies to the GPU without blocking: the weights of
    -j 0."""
    args = ["--data", tiny_data, "-b", 32, "--epochs", 1] + FAST
    runs = [gpu_run(args + ["--output-dir", tmp_path / str(j), "-j", j], nproc=1).check() for j in (0, 2)]
    assert runs[0].done["state_sha256"] == runs[1].done["state_sha256"], nondeterministic(*runs)


def test_profile_records_the_gpu_kernels(tiny_data, tmp_path):
    """--profile on a GPU: the trace holds the CUDA kernels, and tools/profile_split.py splits its steps on
    the GPU's side into disjoint parts that add up to the step."""
    gpu_run(["--data", tiny_data, "-b", 32, "--epochs", 1, "--output-dir", tmp_path, "--profile", "2:3"] + FAST,
            nproc=1).check()
    p = script_module("tools/profile_split.py").split_trace(tmp_path / "trace-rank0.json")
    parts = [p[k] for k in ("compute", "comm_exposed", "data_wait", "optimizer", "other")]
    assert p["device"] == "gpu" and p["steps"] == 2 and p["compute"] > 0, p
    assert min(parts + [p["comm_overlapped"]]) >= 0 and abs(sum(parts) - p["step"]) <= 0.01, p


@pytest.mark.parametrize("script", ["distributed.py", "apex_distributed.py", "fsdp_distributed.py",
                                    pytest.param("deepspeed_distributed.py", marks=needs("deepspeed"))])
def test_cpu_flag_with_gpus_visible_starts_no_cuda(script, tmp_path, tiny_data):
    """--cpu: gloo, CPU tensors, no GPU RNG state saved (reading it would start CUDA); FSDP's mesh and
    DeepSpeed's accelerator too. Every process (launcher and workers) reports as it exits whether it
    started CUDA, i.e. made a context on a GPU (tests/hooks)."""
    if script == "deepspeed_distributed.py":
        check_engine("deepspeed")
    reports, out = tmp_path / "cuda", tmp_path / "out"
    reports.mkdir()
    r = gpu_run(["--data", tiny_data, "-b", 32, "--epochs", 1, "--cpu", "--output-dir", out] + FAST, script,
                env={"COOKBOOK_CUDA_REPORT": str(reports)}).check()
    assert r.summaries[0]["device"] == "cpu"
    started = [p.read_text() for p in reports.iterdir()]
    assert len(started) > TWO and set(started) == {"False"}, started  # torchrun and its TWO workers at least
    if script == "distributed.py":
        assert load_state(out / "checkpoint.pth")["rng"][0]["devices"] == []


def test_more_processes_than_gpus_is_one_error_line(tiny_data, tmp_path):
    r = gpu_run(["--data", tiny_data, "-b", 32, "--output-dir", tmp_path] + FAST, nproc=GPUS + 1, share=False)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode != 0 and len(errors) == 1, r.stderr
    assert f"{GPUS + 1} processes on this node, which shows {GPUS} GPU(s)" in errors[0]


@pytest.mark.parametrize("script", ["fsdp_distributed.py",
                                    pytest.param("deepspeed_distributed.py", marks=needs("deepspeed"))])
def test_methods_that_cannot_share_a_gpu_refuse_gloo_too(script, tiny_data, tmp_path):
    """FSDP2 (a segfault in its checkpoint's all-gather over gloo, docs/gpu.md) and DeepSpeed (GPU LOCAL_RANK) with
    more processes than GPUs and --dist-backend gloo (gpu_run adds it): one line, before any training."""
    r = gpu_run(["--data", tiny_data, "-b", 32, "--output-dir", tmp_path] + FAST, script, nproc=GPUS + 1)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode != 0 and len(errors) == 1 and "cannot share one, even over gloo" in errors[0], r.stderr
    assert "Epoch:" not in r.stdout


def test_an_error_after_an_nccl_rendezvous_is_its_line_alone(tiny_data, tmp_path):
    """FSDP2 joins an NCCL group even as one process. An error after it (another run's checkpoint in --output-dir)
    leaves the group, else NCCL's exit adds "destroy_process_group() was not called" (libtorch_cuda.so)."""
    (tmp_path / "checkpoint.pth").write_bytes(b"another run's")
    r = gpu_run(["--data", tiny_data, "-b", 32, "--output-dir", tmp_path] + FAST, "fsdp_distributed.py", nproc=1)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "holds another run's checkpoints" in errors[0], r.stderr
    assert "destroy_process_group" not in r.stderr, r.stderr


def test_fp16_overflow_in_the_first_step_leaves_momentum_zero(tmp_path):
    """On CUDA's fused SGD kernel: conftest.check_first_step_skipped says why."""
    args = ["--dummy", "--dummy-samples", 64, "-b", 64, "--epochs", 1, "--output-dir", tmp_path] + FAST
    check_first_step_skipped(gpu_run(args, "apex_distributed.py", env=OVERFLOW_AT_STEP_1), args, tmp_path)


@pytest.fixture(scope="module")
def one_gpu_weights(tmp_path_factory):
    """conftest.EQUIV trained by one process on one GPU, in float64: the multi-GPU runs' reference (trained once in
    the session, whatever the number of pytest-xdist workers: conftest.once)."""
    out = once(tmp_path_factory, "gpu-one",
               lambda out: gpu_run(["--output-dir", out] + EQUIV, nproc=1, env=FLOAT64).check())
    return float64_weights(out)


@pytest.mark.parametrize("method", ["ddp", pytest.param("dp", marks=needs_two),
                                    pytest.param("horovod", marks=HOROVOD_NCCL)])
def test_two_gpus_train_as_one(method, tmp_path, one_gpu_weights):
    """NCCL's all-reduce (DDP, Horovod built with NCCL) and DataParallel's gather: the same weights. On one
    GPU, DDP's two processes all-reduce CUDA tensors over gloo. DataParallel runs here alone: on the CPU
    dataparallel.py builds no nn.DataParallel (its CPU tests run its other lines)."""
    if method == "horovod":
        check_engine("horovod")
    script, launcher, _ = METHODS[method]
    profile = ["--profile", "2:2"] if method == "dp" else []
    gpu_run(["--output-dir", tmp_path] + EQUIV + profile, script, launcher, env=FLOAT64).check()
    assert max_abs_diff(float64_weights(tmp_path), one_gpu_weights) <= EQUIV_TOLERANCE
    if method == "dp":
        # nn.DataParallel ran, over every GPU: its forward is a record_function("DataParallel.forward") in the
        # profiled step (torch/nn/parallel/data_parallel.py), and the checkpoint holds an RNG state for each GPU
        # of dataparallel.py's `gpus`, the device_ids it gave DataParallel.
        events = json.loads((tmp_path / "trace-rank0.json").read_text())["traceEvents"]
        assert any(e.get("name") == "DataParallel.forward" for e in events), "no nn.DataParallel forward"
        assert len(load_state(tmp_path / "checkpoint.pth")["rng"][0]["devices"]) == GPUS


@pytest.mark.parametrize("script,launcher,flags,low,high", [
    # Inductor's kernels (Triton) only reorder eager's float64 sums: ~1e-16 apart, as on the CPU.
    pytest.param("apex_distributed.py", "torchrun", ["--amp-dtype", "float32", "--compile"], 0, EQUIV_TOLERANCE,
                 id="compile"),
    # Gradients rounded to 11 / 8 significant bits on the wire: test_methods.py argues these bounds, and
    # that the hook did run only if the weights moved by more than EQUIV_TOLERANCE.
    pytest.param("apex_distributed.py", "torchrun", ["--amp-dtype", "float32", "--grad-compression", "fp16"],
                 EQUIV_TOLERANCE, 1e-3,
                 id="grad-compression-fp16"),
    pytest.param("apex_distributed.py", "torchrun", ["--amp-dtype", "float32", "--grad-compression", "bf16"],
                 EQUIV_TOLERANCE, 4e-3,
                 id="grad-compression-bf16"),
    # test_horovod.py's bounds for the same fp16 rounding on Horovod's NCCL all-reduce.
    pytest.param("horovod_distributed.py", "horovodrun", ["--fp16-allreduce"], 1e-5, 1e-3, id="horovod-fp16-allreduce",
                 marks=HOROVOD_NCCL),
])
def test_speed_knobs_on_nccl_train_as_one_gpu(script, launcher, flags, low, high, tmp_path, one_gpu_weights):
    if launcher == "horovodrun":
        check_engine("horovod")
    gpu_run(["--output-dir", tmp_path] + flags + EQUIV, script, launcher, env=FLOAT64).check()
    assert low <= max_abs_diff(float64_weights(tmp_path), one_gpu_weights) <= high


@pytest.mark.parametrize("method", ["ddp", "amp-fp32", pytest.param("fsdp", marks=two_fsdp_ranks),
                                    pytest.param("horovod", marks=HOROVOD_NCCL)])
def test_signal_mid_epoch_resume_trains_as_one_gpu(method, tmp_path, one_gpu_weights):
    """SIGTERM in step 2 of 3 on every GPU process: a checkpoint of that step (CUDA RNG states, sharded FSDP
    state), then resumed, in float64: the weights of one GPU straight through (conftest.resume_mid_epoch)."""
    script, launcher, extra = {"ddp": ("distributed.py", "torchrun", []),
                               "amp-fp32": ("apex_distributed.py", "torchrun", ["--amp-dtype", "float32"]),
                               "fsdp": ("fsdp_distributed.py", "torchrun", []),
                               "horovod": ("horovod_distributed.py", "horovodrun", [])}[method]
    if method == "horovod":
        check_engine("horovod")
    resume_mid_epoch(tmp_path, *[lambda args, env: gpu_run(args + extra, script, launcher, env=env)] * 2)
    assert max_abs_diff(float64_weights(tmp_path), one_gpu_weights) <= EQUIV_TOLERANCE


ZERO_RANKS = 1 if GPUS == 1 else TWO  # DEEPSPEED_SHARED: on one GPU, ZeRO on CUDA at one process


@pytest.fixture(scope="module")
def ddp_weights(tmp_path_factory):
    """conftest.EQUIV trained by DDP on as many GPU processes as DeepSpeed's, in float32 (once: conftest.once)."""
    out = once(tmp_path_factory, "gpu-ddp",
               lambda out: gpu_run(["--output-dir", out] + EQUIV, nproc=ZERO_RANKS).check())
    return load_state(out / "checkpoint.pth")["state_dict"]


@needs("deepspeed")
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_zero_on_nccl_trains_ddps_weights(stage, tmp_path, ddp_weights):
    """ZeRO's NCCL reduce-scatter / all-gather of the gradients and weights: DDP's update on the same
    processes. On the CPU they agree to 1.2e-7 (test_deepspeed.py); a real error (a sum for a mean, a lost
    shard or step) moves the weights by more than 1e-3. 1e-5 (not yet measured on a GPU) leaves room for
    the GPUs' other reduction order. On one GPU: one process (DEEPSPEED_SHARED), its CUDA path still."""
    check_engine("deepspeed")
    r = gpu_run(["--output-dir", tmp_path, "--zero-stage", stage] + EQUIV, "deepspeed_distributed.py",
                nproc=ZERO_RANKS).check()
    assert r.summaries[0]["device"] == "cuda" and r.done["ranks_identical"]
    assert max_abs_diff(load_state(tmp_path / "checkpoint.pth")["state_dict"], ddp_weights) <= 1e-5


@needs_two
def test_sync_batchnorm_on_two_gpus_equals_batchnorm_on_one(tmp_path):
    """SyncBatchNorm normalises over the global batch: 2 GPUs x 16 images as 1 GPU x 32."""
    args = [a for a in EQUIV if a not in ("--norm", "group")]
    gpu_run(["--output-dir", tmp_path / "one"] + args, nproc=1, env=FLOAT64).check()
    gpu_run(["--output-dir", tmp_path / "two", "--sync-bn"] + args, env=FLOAT64).check()
    assert max_abs_diff(float64_weights(tmp_path / "one"), float64_weights(tmp_path / "two")) <= EQUIV_TOLERANCE


@needs_two
def test_dataparallel_refuses_one_image_per_gpu(tiny_data, tmp_path):
    """3 images over 2 GPUs are chunks of 2 and 1: one replica's BatchNorm would see a single image."""
    r = gpu_run(["--data", tiny_data, "-b", 3, "--output-dir", tmp_path] + FAST, "dataparallel.py", "python")
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1, r.stderr
    assert "leaves 1 image per process and micro-batch and GPU" in errors[0]


def test_bfloat16_autocast_needs_ampere(tmp_path):
    """bf16 autocast on Ampere or newer follows the fp32 update (test_methods.py argues the bounds);
    older GPUs only emulate bf16, and the script says so in one line."""
    args = ["--output-dir", tmp_path / "bf16", "--amp-dtype", "bfloat16"] + EQUIV
    r = gpu_run(args, "apex_distributed.py")
    if not AMPERE:
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert r.returncode != 0 and len(errors) == 1 and "needs an Ampere or newer GPU" in errors[0], r.stderr
        return
    r.check()
    gpu_run(["--output-dir", tmp_path / "fp32"] + EQUIV, nproc=1).check()
    assert_bf16_follows_float32(tmp_path / "bf16", load_state(tmp_path / "fp32" / "checkpoint.pth")["state_dict"],
                                "autocast")


@pytest.mark.skipif(GPUS and not SLURM_UP, reason="no Slurm cluster up (scripts/slurm_cluster.sh start, or a real one)")
def test_srun_trains_on_the_gpus(tiny_data, tmp_path):
    r = run(["--data", tiny_data, "-b", 32, "--epochs", 1, "--output-dir", tmp_path] + FAST, "srun", TWO,
            "distributed_slurm_main.py", env=GPU_ENV).check()
    assert r.summaries[0]["device"] == "cuda" and r.done["ranks_identical"]
