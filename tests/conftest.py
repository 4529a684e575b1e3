"""Test harness: runs the trainers as real subprocesses under real launchers (CPU, gloo, tiny images)."""
import atexit
import fcntl
import functools
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
# The CPU suite runs the CPU code path on every machine, with GPUs or not: no process it starts sees
# a GPU. tests/test_gpu.py gives its runs the GPUs back (env=GPU_ENV; None unsets the variable).
# pytest-xdist's workers inherit the hidden GPUs: the value the session started with is kept for them.
os.environ.setdefault("COOKBOOK_TEST_GPUS", os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))
GPU_ENV = {"CUDA_VISIBLE_DEVICES": None if os.environ["COOKBOOK_TEST_GPUS"] == "unset"
           else os.environ["COOKBOOK_TEST_GPUS"]}
os.environ["CUDA_VISIBLE_DEVICES"] = ""
HOOKS = str(REPO / "tests" / "hooks")
# The CPU suite's model: resnet18's stem and first block (tests/hooks/tiny_resnet.py), a ResNet with
# BatchNorm, or GroupNorm with --norm group, as resnet18 is. What the tests prove (equal weights,
# bitwise resumes, exact evaluation, one error line) does not depend on the depth; resnet18 cost a
# run 4.6 CPU-s more in float64 (11.5 against 6.9, one process, EQUIV) and its checkpoints are 45 MB.
# Tests whose bounds were measured on resnet18, or that show what resnet18 itself does, pass RESNET18
# after FAST (argparse takes the last -a), as every explicit -a must come after FAST.
TINY, RESNET18 = ["-a", "resnet_tiny"], ["-a", "resnet18"]
# Flags every test run shares: 32 px digits, no loader workers unless a test asks, quiet progress.
FAST_RESNET18 = ["--image-size", "32", "-j", "0", "-p", "1000", "--seed", "0"]
FAST = FAST_RESNET18 + TINY


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    summaries: list = field(default_factory=list)  # one dict per SUMMARY line (rank 0, one per epoch)
    done: dict = None  # the DONE line: per-rank digests of the final model
    launcher: str = None  # how run() started it (launch_command's names, or "forked"), and how many processes
    nproc: int = 1

    def check(self):
        assert self.returncode == 0, f"exit {self.returncode}\nstdout:\n{self.stdout}\nstderr:\n{self.stderr}"
        return self

    @classmethod
    def parse(cls, returncode, stdout, stderr, **started):
        """A finished run, with the machine-readable lines of its output collected (started: launcher, nproc)."""
        result = cls(returncode, stdout, stderr, **started)
        for line in stdout.splitlines():
            kind, _, payload = line.partition(" ")
            if kind in ("SUMMARY", "DONE"):
                # raw_decode: a killed job's log can have srun's own message glued after the JSON.
                record = json.JSONDecoder().raw_decode(payload)[0]
                if kind == "SUMMARY":
                    result.summaries.append(record)
                else:
                    result.done = record
        return result


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(script, launcher, nproc):
    """The command line a user types, for each supported way of starting a script."""
    if launcher == "python":
        return [PYTHON, str(REPO / script)]
    if launcher == "torchrun":
        return [str(Path(PYTHON).parent / "torchrun"), "--standalone", f"--nproc-per-node={nproc}", str(REPO / script)]
    if launcher == "horovodrun":  # Horovod's launcher, all ranks on this host, Gloo (no MPI needed)
        return [str(Path(PYTHON).parent / "horovodrun"), "-np", str(nproc), "-H", f"localhost:{nproc}", "--gloo",
                PYTHON, str(REPO / script)]
    if launcher == "launch":
        return [PYTHON, "-m", "torch.distributed.launch", f"--nproc_per_node={nproc}",
                f"--master_port={free_port()}", str(REPO / script)]
    if launcher == "spawn":  # no launcher: the script starts nproc processes itself (torch.multiprocessing.spawn)
        return [PYTHON, str(REPO / script), f"--nprocs={nproc}"]
    if launcher == "deepspeed":
        # DeepSpeed's launcher sets CUDA_VISIBLE_DEVICES=0,...,N-1 itself, GPUs or not: --cpu keeps the
        # suite on the CPU path wherever it runs. --master_port: its default is a fixed 29500.
        return [str(Path(PYTHON).parent / "deepspeed"), f"--num_gpus={nproc}", f"--master_port={free_port()}",
                str(REPO / script), "--cpu"]
    if launcher == "srun":  # Slurm: nproc tasks on one node
        return ["srun", "--nodes=1", f"--ntasks={nproc}", PYTHON, str(REPO / script)]
    if launcher == "srun-nodes":  # Slurm: one task on each of nproc nodes
        return ["srun", f"--nodes={nproc}", "--ntasks-per-node=1", PYTHON, str(REPO / script)]
    raise ValueError(launcher)


# torchvision 0.29 deprecates its image decoders (for TorchCodec's): a run that calls one fails, here as in pytest.ini.
DECODER_DEPRECATED = "error::DeprecationWarning:torchvision.io.image"


def environment(env=None):
    """This process's environment, one thread per process, tests/hooks (before any PYTHONPATH of the site's: a
    site-installed torch stays found) with resnet_tiny, torchvision's deprecated decoders an error, plus `env`,
    whose None values unset."""
    path = os.pathsep.join(filter(None, [HOOKS, os.environ.get("PYTHONPATH")]))
    return {key: value for key, value in dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=path,
                                              COOKBOOK_TINY_RESNET="1", PYTHONWARNINGS=DECODER_DEPRECATED,
                                              **(env or {})).items() if value is not None}


@functools.cache
def zygote():
    """This pytest process's tests/zygote.py: a Python with torch and torchvision imported, which forks the "forked"
    runs. Its environment is every run's; a run's own COOKBOOK_* variables have its child run tests/hooks again."""
    proc = subprocess.Popen([PYTHON, str(REPO / "tests" / "zygote.py")], cwd=REPO, env=environment(),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    atexit.register(proc.stdin.close)  # it ends when its input does
    return proc


def run_forked(command, env, timeout):
    """`python SCRIPT ARGS` (command) as a child of zygote(): the script from its first line, torch already imported."""
    hooks = {key: value for key, value in env.items() if key.startswith("COOKBOOK_")}
    hooks = hooks != {key: value for key, value in environment().items() if key.startswith("COOKBOOK_")}
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        proc = zygote()
        proc.stdin.write(json.dumps(dict(script=command[1], args=command[2:], env=env, cwd=str(REPO), stdout=out,
                                         stderr=err, hooks=os.path.join(HOOKS, "sitecustomize.py") if hooks else None))
                         + "\n")
        proc.stdin.flush()
        pid = json.loads(proc.stdout.readline())["pid"]
        timer = threading.Timer(timeout, os.kill, (pid, signal.SIGKILL))
        timer.start()
        try:
            returncode = json.loads(proc.stdout.readline())["returncode"]
        finally:
            timer.cancel()
        assert returncode != -signal.SIGKILL, f"killed after {timeout} s: {command}"
        return subprocess.CompletedProcess(command, returncode, Path(out).read_text(), Path(err).read_text())


def run(args, launcher="python", nproc=1, script="distributed.py", env=None, timeout=300, preexec_fn=None):
    """Run a trainer to completion and parse its machine-readable lines. launcher "forked": one process, as
    "python", forked from zygote() (test_a_forked_run_ends_as_a_python_run; test_launchers starts a plain python,
    and so do runs with loader workers: their fork server is a Python of its own)."""
    if launcher == "forked":
        proc = run_forked(launch_command(script, "python", 1) + [str(a) for a in args], environment(env), timeout)
        return Result.parse(proc.returncode, proc.stdout, proc.stderr, launcher=launcher)
    proc = subprocess.run(launch_command(script, launcher, nproc) + [str(a) for a in args], cwd=REPO,
                          env=environment(env), capture_output=True, text=True, timeout=timeout,
                          preexec_fn=preexec_fn)
    if launcher == "horovodrun":  # it starts each line of rank N's output with "[N]<stdout>:" or "[N]<stderr>:"
        proc.stdout, proc.stderr = (re.sub(r"(?m)^\[\d+\]<std(?:out|err)>:", "", s) for s in (proc.stdout, proc.stderr))
    return Result.parse(proc.returncode, proc.stdout, proc.stderr, launcher=launcher, nproc=nproc)


# Imports argv[1]; exits 3 where it is not installed (it, or a package above it, is not found), with the error line.
ENGINE_PROBE = """
import importlib, sys
try:
    importlib.import_module(sys.argv[1])
except ModuleNotFoundError as error:
    if not (sys.argv[1] + ".").startswith(f"{error.name}."):
        raise
    print(f"ModuleNotFoundError: {error}", file=sys.stderr)
    sys.exit(3)
"""


@functools.cache  # once per pytest process: each probe is an interpreter importing torch
def import_error(module, env):
    """None where `module` imports in a process the tests would start (env: items), else (absent, the last line of
    the error): absent where it is not installed at all, rather than installed and broken."""
    probe = subprocess.run([PYTHON, "-c", ENGINE_PROBE, module], capture_output=True, text=True,
                           env=environment(dict(env)))
    return (probe.returncode == 3, (probe.stderr.strip().splitlines() or ["?"])[-1]) if probe.returncode else None


def require_engine(module, install, env=None):
    """Skip the test where `module` is not installed, but fail it under CI=1 (README's test command sets it, as
    .ci/run does), so that command never passes without the engine; fail it wherever the engine is installed and
    does not import, so a broken install never passes as a skip (tests/test_gpu.py's needs() and check_engine do the
    same). `install` says how to get it."""
    error = import_error(module, tuple(sorted((env or {}).items())))
    if error is not None:
        absent, line = error
        reason = f"{module} {'is not installed' if absent else 'does not import'} ({line}): {install}"
        if not absent or os.environ.get("CI", "") not in ("", "0", "false"):
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)


def script_module(script):
    """A script of the repository (a trainer, a tool) imported as a module, under its own name (for its
    pure helpers)."""
    spec = importlib.util.spec_from_file_location(Path(script).stem, REPO / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


script_module("tests/hooks/tiny_resnet.py").register()  # -a resnet_tiny in this process too, as in the runs


def make_data(out, train, val):
    subprocess.run([PYTHON, str(REPO / "tools" / "make_demo_data.py"), "--out", str(out),
                    "--train-count", str(train), "--val-count", str(val)], check=True, capture_output=True)
    return out


def once(tmp_path_factory, name, make):
    """The folder make(folder) filled, made once in the whole test session: pytest-xdist's workers each run
    a session fixture, and the first to ask makes it while the others wait (their temporary folders share
    a parent). The tests only read it, or copy it to change it."""
    root = tmp_path_factory.getbasetemp()
    root = root.parent if "PYTEST_XDIST_WORKER" in os.environ else root
    folder = root / f"shared-{name}"
    with open(root / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / f"shared-{name}.done").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            (root / f"shared-{name}.done").touch()
    return folder


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """96 train images (3 global batches of 32) and 37 val images: 37 is divisible by neither 2, 3 nor 4."""
    return once(tmp_path_factory, "data", lambda out: make_data(out / "digits", 96, 37)) / "digits"


def load_state(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_checkpoints(straight_dir, split_dir):
    """Two runs' checkpoints hold the same weights, lr schedule and momentum, bitwise: returns both."""
    straight, split = (load_state(Path(d) / "checkpoint.pth") for d in (straight_dir, split_dir))
    for key in straight["state_dict"]:
        assert torch.equal(straight["state_dict"][key], split["state_dict"][key]), key
    assert straight["scheduler"] == split["scheduler"]
    for pid, state in straight["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"], split["optimizer"]["state"][pid]["momentum_buffer"])
    return straight, split


def max_abs_diff(a, b):
    """The largest |a[k] - b[k]| over two state dicts, which must hold the same keys: a key one side lacks (an export
    that left a weight out) fails, rather than going uncompared."""
    assert a.keys() == b.keys(), f"keys differ: {sorted(a.keys() ^ b.keys())}"
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


# ---- shared by every trainer's tests ----
# EQUIV: the training-equivalence workload; the comment in test_distributed.py says why it is built so.
EQUIV_RESNET18 = ["--dummy", "--dummy-samples", 96, "-b", 32, "--epochs", 1, "--norm", "group", "--lr", 0.1,
                  "--warmup-epochs", 0.5] + FAST_RESNET18
EQUIV = EQUIV_RESNET18 + TINY
# Equivalence runs compute in float64: pass env=FLOAT64 to run(). In float32, 2 ranks x 16 images
# round differently from 1 process x 32 (another batch size, on some CPUs another oneDNN kernel),
# and a ReLU or max-pool decision lying within that rounding of its threshold flips. Measured with
# EQUIV: on an AVX-512 CPU 1 and 2 processes end 1.2e-7 apart; on AVX2 (ATEN_CPU_CAPABILITY=avx2
# ONEDNN_MAX_CPU_ISA=AVX2, and CI's machine) 1.2e-7 after 2 steps but 1.9e-4 after 3. In float64
# the rounding is ~1e-16 and no decision flips (measured 2.2e-16 on both), so the tests demand
# EQUIV_TOLERANCE, far below 1e-5, while a real error (a sum for a mean, a wrong shard, a lost or
# doubled step) moves weights by more than 1e-3.
FLOAT64 = {"COOKBOOK_FLOAT64": "1"}


def fault_at(step):
    """Environment for run(): the step-th optimizer step of each process raises ("every": all do)."""
    return {"COOKBOOK_FAULT_STEP": str(step)}
EQUIV_TOLERANCE = 1e-9


def signal_at(step):
    """Environment for run(): each process sends itself SIGTERM in its step-th optimizer step, as a
    launcher stopping the job would (tests/hooks)."""
    return {"COOKBOOK_SIGNAL_STEP": str(step)}


# A run stopped on a signal: every worker checkpoints, then exits 143, and each launcher reports that its own way
# (measured with signal_at, torch 2.14.1, Horovod 0.28.1, DeepSpeed 0.19.8): {launcher: (its exit status, the line
# giving the status of the first worker to end, the line giving each worker's, where it shows them)}. torchrun and
# torch.distributed.launch exit 1 and list every failed worker in their failure summary ("exitcode  : 143"), the
# first under "Root Cause"; horovodrun exits 1 and prints each worker's status, and the first's again. A launcher
# ends the other workers once one has exited: a worker still finishing then (its interpreter's shutdown restores
# SIGTERM's default action) ends by that SIGTERM (seen: "exitcode  : -15" for rank 1 of 2 under torchrun), or by a
# SIGKILL after the launcher's grace period (horovodrun's is 5 s: runner/common/util/safe_shell_exec.py). The
# deepspeed launcher exits with the first worker's status and prints only that one's (launcher/launch.py,
# sigkill_handler); mp.spawn's launcher, multiprocessing_distributed.supervise, exits with the first's status.
STOPPED = {"python": (143, None, None), "forked": (143, None, None), "spawn": (143, None, None),
           "deepspeed": (143, r"exits with return code = (-?\d+)", r"exits with return code = (-?\d+)"),
           "torchrun": (1, r"Root Cause \(first observed failure\):\n(?:.*\n)*?\s+exitcode\s+: (-?\d+)",
                        r"exitcode\s+: (-?\d+)"),
           "horovodrun": (1, r"The first process to do so was:\nProcess name: .*\nExit code: (-?\d+)",
                          r"Process \d+ exit with status code (-?\d+)\.")}
STOPPED["launch"] = STOPPED["torchrun"]
REPORTS_EVERY_WORKER = {"torchrun", "launch", "horovodrun"}
ENDED_BY_THE_LAUNCHER = {"143", "-15", "137", "-9"}  # its own exit after the stop, the launcher's SIGTERM or SIGKILL


def assert_stopped(r, where):
    """r (a Result of run()) stopped on a signal after `where` ("step 2 of epoch 0") and ended as STOPPED says its
    launcher reports it: the first worker to end exited 143, and every worker the launcher shows exited 143 or was
    ended by it (all of them, where it shows them all). A crash after the stop line (a traceback, exit 1)
    fails, on any worker the launcher shows."""
    output = r.stdout + r.stderr
    status, first, each = STOPPED[r.launcher]
    assert r.returncode == status and f"=> stopped on a signal after {where}" in r.stdout, output
    if first is None:  # no launcher, or one that exits with its first worker's status: no traceback either
        assert "Traceback" not in output, output
    else:
        found, statuses = re.search(first, output), re.findall(each, output)
        assert found and found[1] == "143" and set(statuses) <= ENDED_BY_THE_LAUNCHER, output
        assert r.launcher not in REPORTS_EVERY_WORKER or len(statuses) == r.nproc, output


def resume_mid_epoch(out, interrupted, resumed, damaged=None):
    """EQUIV in float64, stopped by SIGTERM in its 2nd step of 3, with progress (so the ranks' check
    for a stop) after every step: it must stop right after that step, write a checkpoint of it and
    exit with 143, as its launcher reports it (assert_stopped). Then resumed from --output-dir
    out. interrupted(args, env) and resumed(args, env) run the trainer under test; returns the
    resumed run, which must have started at step 2 of epoch 0.

    damaged: the name of the checkpoint of step 2 in out. The run then also checkpoints step 1
    (--save-every 1), and that of step 2 is cut short (a directory's largest file) before the resume,
    which must say so in one line and start at step 1."""
    save_every = ["--save-every", 1] if damaged else []
    r = interrupted(["--output-dir", out] + EQUIV + ["-p", 1] + save_every, {**FLOAT64, **signal_at(2)})
    assert_stopped(r, "step 2 of epoch 0")
    assert "Epoch: [0][3/3]" not in r.stdout
    if damaged:
        newest = Path(out) / damaged
        victim = newest if newest.is_file() else max(newest.iterdir(), key=lambda p: p.stat().st_size)
        victim.write_bytes(victim.read_bytes()[:1000])
    r = resumed(["--output-dir", out, "--resume", "auto"] + EQUIV, FLOAT64).check()
    assert f"(epoch 0, step {1 if damaged else 2})" in r.stdout and "Epoch: [0][3/3]" in r.stdout, r.stdout
    assert not damaged or f"=> checkpoint '{newest}' is damaged" in r.stdout, r.stdout
    return r


def copy_checkpoint(source_dir, name, dest_dir):
    """source_dir's checkpoint `name` (a file, or FSDP's and DeepSpeed's directory) with its digest, copied into
    dest_dir: what a run stopped where that checkpoint was taken leaves behind."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    source = Path(source_dir) / name
    (shutil.copytree if source.is_dir() else shutil.copyfile)(source, dest_dir / name)
    shutil.copyfile(f"{source}.sha256", dest_dir / f"{name}.sha256")


def float64_weights(out):
    """The final weights of an equivalence run written to out; fails if float64 did not reach the trainer."""
    state = load_state(Path(out) / "checkpoint.pth")["state_dict"]
    assert all(v.dtype == torch.float64 for v in state.values() if v.is_floating_point()), "not a float64 run"
    return state


@pytest.fixture(scope="session")
def single_process_run(tmp_path_factory):
    """The output directory of EQUIV trained by one process, in float64 (copy it to resume it)."""
    return once(tmp_path_factory, "single",
                lambda out: run(["--output-dir", out] + EQUIV, "forked", env=FLOAT64).check())


@pytest.fixture(scope="session")
def single_process_weights(single_process_run):
    """EQUIV trained by one process, in float64: the reference of every equivalence test."""
    return float64_weights(single_process_run)


@pytest.fixture(scope="session")
def float32_weights(tmp_path_factory):
    """EQUIV on resnet18 trained by one process in float32 (float64 starts from other random weights): bf16's
    reference (its bounds were measured on resnet18: test_methods.py's test_amp_bfloat16_follows_float32)."""
    out = once(tmp_path_factory, "single-float32",
               lambda out: run(["--output-dir", out] + EQUIV_RESNET18, "forked").check())
    return load_state(out / "checkpoint.pth")["state_dict"]


def initial_weights(args):
    """The weights a seeded trainer run with these arguments starts from (distributed.py's build_model)."""
    sys.path.insert(0, str(REPO))
    import distributed
    parsed = distributed.argument_parser().parse_args([str(a) for a in args])
    torch.manual_seed(parsed.seed)  # as main_worker does before it builds the model
    return distributed.build_model(parsed, distributed.build_datasets(parsed)[2]).state_dict()


OVERFLOW_AT_STEP_1 = {"COOKBOOK_OVERFLOW_STEP": "1"}


def check_first_step_skipped(result, args, out):
    """apex_distributed.py ran one fp16 step, whose gradients overflowed (env=OVERFLOW_AT_STEP_1 injects an
    inf): GradScaler must have skipped it and halved its scale, leaving the initial weights and zero
    momentum. The fused SGD step allocates its momentum buffers uninitialised on its first step and
    returns early on an inf: without the script's zeroed buffers they held leftover memory, different
    on each rank, that the next steps would have added to the weights."""
    assert result.check().done["ranks_identical"]
    checkpoint = load_state(Path(out) / "checkpoint.pth")
    assert checkpoint["scaler"]["scale"] == 2.0 ** 15, "the overflowing step was not skipped"
    momentum = [state["momentum_buffer"] for state in checkpoint["optimizer"]["state"].values()]
    assert momentum and all(not buffer.any() for buffer in momentum)
    amp_dtype = args.index("--amp-dtype") if "--amp-dtype" in args else len(args)
    initial = initial_weights(args[:amp_dtype] + args[amp_dtype + 2:])  # distributed.py's flags only
    # The parameters: the skipped step's forward did move BatchNorm's statistics.
    assert all(torch.equal(checkpoint["state_dict"][key], initial[key]) for key in initial
               if not key.endswith(("running_mean", "running_var", "num_batches_tracked")))


def assert_bf16_follows_float32(out, float32_weights, switch):
    """The bf16 EQUIV run written to out updated the weights nearly as float32 did, yet not equally
    (else `switch` did not apply). test_methods.py's test_amp_bfloat16_follows_float32 argues the bounds."""
    checkpoint = load_state(Path(out) / "checkpoint.pth")
    initial, bf16 = initial_weights(EQUIV + ["-a", checkpoint["arch"]]), checkpoint["state_dict"]
    keys = [k for k in initial if initial[k].is_floating_point()]
    fp32_update = torch.cat([(float32_weights[k].double() - initial[k].double()).flatten() for k in keys])
    bf16_update = torch.cat([(bf16[k].double() - initial[k].double()).flatten() for k in keys])
    cosine = (fp32_update @ bf16_update / (fp32_update.norm() * bf16_update.norm())).item()
    length = (bf16_update.norm() / fp32_update.norm()).item()
    assert cosine >= 0.85 and 0.8 <= length <= 1.25, (cosine, length)
    assert (bf16_update - fp32_update).abs().max() > 1e-4, f"bf16 trained exactly like fp32: {switch} did not apply"


def stall_a_rank(script, launcher, pid_to_stop, args, kill_on_error=False):
    """Train on 2 processes with --dist-timeout 5, SIGSTOP the process pid_to_stop(proc) names once
    training has started (alive and silent: a hang), and read stderr to the end.

    Returns the `error:` lines as (seconds after the stop, line) and the whole stderr. The live ranks
    should fail 5 s (the timeout) + 5 s (their check-in on the store) after the stop.
    """
    command = launch_command(script, launcher, 2) + [str(a) for a in FAST + [
        "--dummy", "--dummy-samples", 100000, "-b", 16, "-p", 5, "--dist-timeout", 5] + args]
    proc = subprocess.Popen(command, cwd=REPO, env=environment(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        next(line for line in proc.stdout if line.startswith("Epoch: [0]"))  # training has started
        pid = pid_to_stop(proc)
        os.kill(pid, signal.SIGSTOP)
        stopped, errors, stderr = time.monotonic(), [], []
        for line in proc.stderr:  # to the end: the launcher exits once the stopped process is gone
            stderr.append(line)
            if line.startswith("error:"):
                errors.append((time.monotonic() - stopped, line))
                if kill_on_error:
                    os.kill(pid, signal.SIGKILL)
        assert proc.wait(timeout=60) != 0
    finally:
        proc.kill()
    return errors, "".join(stderr)


class RunsCode:
    """Unpickling this would create a file: a checkpoint must never execute it."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture(scope="session")
def checkpoint(tiny_data, tmp_path_factory):
    args = ["--data", tiny_data, "-b", 32, "--epochs", 1] + FAST
    out = once(tmp_path_factory, "ckpt", lambda out: run(args + ["--output-dir", out], "forked").check())
    return out / "checkpoint.pth"


def trace_op(name, start, end, thread=1, cat="cpu_op"):
    """A torch.profiler Chrome-trace event (microseconds) on thread `thread` of process 1."""
    return {"ph": "X", "name": name, "cat": cat, "ts": start, "dur": end - start, "pid": 1, "tid": thread}


# Thread 2 of a hand-made trace is gloo's, as torch.profiler names it.
GLOO_THREAD = {"ph": "M", "name": "thread_name", "args": {"name": "thread 2 (pt_gloo_runloop)"}, "pid": 1, "tid": 2}


def png_header(width, height):
    """A PNG's signature, header chunk (8-bit RGB of width x height) and end chunk, with no pixel data."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


def bad_inputs(tiny_data, checkpoint, tmp):
    """{case: (arguments, launcher, expected message fragment)}, building the broken inputs in tmp."""
    empty = tmp / "empty"
    (empty / "train").mkdir(parents=True)
    (empty / "val").mkdir()
    missing_class = shutil.copytree(tiny_data, tmp / "missing_class")
    shutil.rmtree(missing_class / "val" / "3")
    empty_class = shutil.copytree(tiny_data, tmp / "empty_class")
    for image in (empty_class / "train" / "5").iterdir():
        image.unlink()
    metrics_dir = tmp / "metrics-dir"
    (metrics_dir / "metrics.jsonl").mkdir(parents=True)
    truncated = tmp / "truncated.pth"
    truncated.write_bytes(checkpoint.read_bytes()[:5000])
    malicious = tmp / "malicious.pth"
    torch.save({"state_dict": RunsCode(str(tmp / "code-ran"))}, malicious)
    mid_epoch = tmp / "mid-epoch.pth"
    torch.save(dict(load_state(checkpoint), step=1), mid_epoch)  # as if saved after step 1 of a -b 32 epoch
    not_a_dir = tmp / "not-a-dir"
    not_a_dir.write_text("a file, not a directory")
    looped = shutil.copytree(tiny_data, tmp / "looped")
    (looped / "train" / "3" / "back").symlink_to("..", target_is_directory=True)  # train/3/back is train/
    data = ["--data", tiny_data, "-b", 32]
    return {
        "missing data dir": (["--data", tmp / "nope"], "python", "is not a directory"),
        "no data at all": ([], "python", "no dataset: pass --data"),
        "empty data dir": (["--data", empty], "python", "bad dataset"),
        "val class missing": (["--data", missing_class], "python", "val classes differ from train classes"),
        "empty class folder": (["--data", empty_class], "python", "bad dataset"),
        "unknown arch": (data + ["-a", "resnet19"], "python", "unknown --arch 'resnet19': did you mean resnet18"),
        "image too small for the arch": (data + ["-a", "alexnet"], "python",
                                         "--image-size 32 is too small for --arch alexnet"),
        "symlink loop": (["--data", looped, "-b", 32], "python",
                         f"symlink loop in --data: '{looped / 'train' / '3' / 'back'}' leads back to"),
        "batch below world size": (["--data", tiny_data, "-b", 1], "torchrun", "must be a multiple of world size 2"),
        "one image per process": (["--data", tiny_data, "-b", 2], "torchrun", "-b 2 leaves 1 image per process"),
        "sync-bn on cpu": (data + ["--sync-bn"], "python", "--sync-bn needs CUDA"),
        "other arch checkpoint": (data + ["-a", "resnet34", "-e", "--resume", checkpoint], "python",
                                  "is for arch 'resnet_tiny', not 'resnet34'"),
        "truncated checkpoint": (data + ["-e", "--resume", truncated], "python", "cannot load checkpoint"),
        "code in checkpoint": (data + ["-e", "--resume", malicious], "python", "cannot load checkpoint"),
        "no such checkpoint": (data + ["--resume", tmp / "none.pth"], "python", "no checkpoint at"),
        "unwritable output dir": (data + ["--output-dir", not_a_dir / "sub"], "python", "cannot write checkpoints"),
        "metrics.jsonl a directory": (data + ["--output-dir", metrics_dir], "python",
                                      f"Is a directory ('{metrics_dir / 'metrics.jsonl'}')"),
        "negative --save-every": (data + ["--save-every", -1], "python",
                                   "argument --save-every: -1 is out of range: pass a number >= 0"),
        "mid-epoch checkpoint, other -b": (["--data", tiny_data, "-b", 16, "--resume", mid_epoch], "python",
                                           "was trained with --batch-size 32 (now 16): pass another --output-dir"),
        "resumed with another recipe": (data + ["--lr", 0.2, "--wd", 0, "--epochs", 3, "--resume", checkpoint], "python",
                                        f"'{checkpoint}' was trained with --lr 0.1 (now 0.2), --weight-decay 0.0001 "
                                        "(now 0.0): pass another --output-dir"),
        "--profile not a range": (data + ["--profile", "3"], "python", "'3' is not START:STOP"),
        "--profile with no warm-up": (data + ["--profile", "1:2"], "python",
                                      "'1:2' is not START:STOP with 2 <= START <= STOP: the step before START warms"),
        "--profile past the run": (data + ["--epochs", 1, "--profile", "2:4"], "python",
                                   "--profile 2:4: this run has only 3 optimizer steps: lower STOP"),
        "train set below one batch": (["--data", tiny_data, "-b", 128], "python", "smaller than one global batch"),
    }


def pytest_runtest_logreport(report):
    """scripts/gpu_check.py's live record: each test's outcome appended to $GPU_CHECK_RESULTS as it ends
    (under pytest-xdist, in the controller), so a check cut short keeps the rows it had."""
    path = os.environ.get("GPU_CHECK_RESULTS")
    if path and "PYTEST_XDIST_WORKER" not in os.environ and (report.when == "call" or report.outcome != "passed"):
        crash = getattr(report.longrepr, "reprcrash", None)  # a failure's first line: "AssertionError: exit 1"
        reason = (report.longrepr[2].removeprefix("Skipped: ") if report.skipped and isinstance(report.longrepr, tuple)
                  else crash.message.splitlines()[0][:200] if report.failed and crash else "")
        with open(path, "a") as f:
            f.write(json.dumps({"test": report.nodeid.split("::", 1)[-1], "outcome": report.outcome,
                                "seconds": round(report.duration, 1), "reason": reason}) + "\n")


# The fast tier, `pytest -m "not slow"`: the tests that start no training run, and one training run of
# each script under its own launcher. Every other test is marked slow here, a new one too until added.
FAST_TIER = {
    "test_consistency.py", "test_tools.py",
    "test_distributed.py::test_launchers", "test_distributed.py::test_legacy_local_rank_spellings",
    "test_distributed.py::test_lr_schedule_warmup_then_steps",
    "test_distributed.py::test_resumable_sampler_skips_the_first_global_batches_at_any_world_size",
    "test_distributed.py::test_shard_batches_count_each_sample_once_in_the_same_batch",
    "test_methods.py::test_runs_and_resumes_bitwise", "test_methods.py::test_default_amp_dtype_follows_the_device",
    "test_fsdp.py::test_runs_and_resumes_bitwise", "test_deepspeed.py::test_deepspeed_launcher_runs_zero3_on_the_cpu",
    "test_horovod.py::test_horovodrun_two_ranks", "test_slurm.py::test_srun_one_node_two_tasks",
    "test_slurm.py::test_local_rank_from_slurm", "test_slurm.py::test_first_host_matches_scontrol",
    "test_dali.py::test_dali_batches_are_the_default_loaders_up_to_resampling",
}


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(items):
    for item in items:
        module = Path(item.fspath).name
        if module not in FAST_TIER and f"{module}::{item.originalname}" not in FAST_TIER:
            item.add_marker(pytest.mark.slow)


# Float32 too, as users train (float64 takes other oneDNN kernels and paths): DDP (test_deepspeed.py, whose reference it
# is), FSDP and Horovod on 2 processes against 1 on EQUIV's 3 steps on resnet18 (conftest.float32_weights), where
# 2 x 16 images round otherwise than 1 x 32 and from the second step a ReLU or max-pool decision lying within that
# rounding flips. Measured (2026-11-27): 2.5e-4 on this AVX-512 CPU, 5.9e-5 with ATEN_CPU_CAPABILITY=avx2
# ONEDNN_MAX_CPU_ISA=AVX2, alike for the three, whose 2-process runs ended bitwise equal to each other (2.3e-4 on the
# machine of an earlier measurement). A real error moves the weights about 40 times as far: DDP's gradients summed,
# not averaged (a comm hook), 1.3e-2; each rank stepping on its own gradient (no all-reduce, as if a shard were lost),
# 9.8e-3 (both measured alike on both ISAs). The tolerance sits between.
FLOAT32_TOLERANCE = 1e-3


def epoch_checkpoint(path):
    """A checkpoint of an epoch's end as distributed.py writes it: its epoch, step, lr schedule and momentum (by
    parameter name: the names of a model with no buffers, GroupNorm's, in the optimizer's order)."""
    checkpoint = load_state(path)
    names = list(checkpoint["state_dict"])
    assert len(names) == len(checkpoint["optimizer"]["param_groups"][0]["params"]), "a model with buffers"
    return dict(epoch=checkpoint["epoch"], step=checkpoint["step"], scheduler=checkpoint["scheduler"],
                momentum={names[i]: state["momentum_buffer"] for i, state in checkpoint["optimizer"]["state"].items()})


def assert_epoch_ends_as_one_process(r, out, single_process_run, checkpoint):
    """r, EQUIV trained in float64 on several processes into out, ended its epoch as one process did
    (single_process_run): the final weights within EQUIV_TOLERANCE, the same training loss and evaluation (every val
    image once: the count, top-1 and top-5 equal, the losses to float64's rounding), and the same checkpoint of the
    epoch's end (`checkpoint`, as epoch_checkpoint gives it): its epoch, step, lr schedule, and momentum within
    EQUIV_TOLERANCE."""
    assert max_abs_diff(float64_weights(out), float64_weights(single_process_run)) <= EQUIV_TOLERANCE
    records = [json.loads(line) for line in (single_process_run / "metrics.jsonl").read_text().splitlines()]
    (one,), (many,) = [record for record in records if record["kind"] == "SUMMARY"], r.summaries
    assert [many[k] for k in ("epoch", "val_count", "val_acc1", "val_acc5")] == \
        [one[k] for k in ("epoch", "val_count", "val_acc1", "val_acc5")], (many, one)
    assert many["train_loss"] == pytest.approx(one["train_loss"], rel=1e-12), (many, one)
    assert many["val_loss"] == pytest.approx(one["val_loss"], rel=1e-12), (many, one)
    reference = epoch_checkpoint(single_process_run / "checkpoint-epoch1.pth")
    assert [checkpoint[k] for k in ("epoch", "step", "scheduler")] == \
        [reference[k] for k in ("epoch", "step", "scheduler")], (checkpoint, reference)
    assert max_abs_diff(checkpoint["momentum"], reference["momentum"]) <= EQUIV_TOLERANCE


PROGRESS = re.compile(r"Epoch: \[(\d+)\]\[\s*(\d+)/")


# ---- stop signals from outside, through each launcher ----
# A cluster ending a job signals the launcher it started. These runs get SIGTERM from the test as rank 0 prints its
# start report (every rank has joined the group, so handles it): it lands wherever the ranks then are, in the set-up's
# collectives or a step, and the launcher passes it on. conftest.signal_at's hook, each process signalling itself in a
# chosen step, stays for the tests that need that step (a damaged checkpoint of step 2, a profiled step 2).

STOP_LINE = re.compile(r"=> stopped on a signal after step (\d+) of epoch (\d+), checkpoint written")


def assert_stopped_from_outside(r, where):
    """conftest.assert_stopped, for a run whose launcher got the signal itself. torchrun and torch.distributed.launch
    then pass it on and end with a SignalException, exit 1, and list no worker's exit status; they SIGKILL the workers
    still running 30 s after the signal, saying so (torch/distributed/elastic/multiprocessing/api.py, _close): none
    was. DeepSpeed's per-node launcher passes it on, waits up to 30 s for each worker (killing it after) and exits 1,
    naming none (deepspeed/launcher/launch.py, sigkill_handler), and the `deepspeed` command exits with its status.
    horovodrun passes it on and SIGKILLs the workers still running 5 s later (horovod/runner/common/util/
    safe_shell_exec.py, GRACEFUL_TERMINATION_TIME_S), which their exit can overrun after the checkpoint (the stop
    line): a process importing torch took 1-2.6 s to exit here, loaded 7 deep. It reports the status of the workers
    that ended before it, 143 or 137 (128 + SIGKILL), and exits 1, or, racing itself, none and 0. The trainer alone and
    mp.spawn's launcher exit 143 themselves."""
    output = r.stdout + r.stderr
    assert f"=> stopped on a signal after {where}" in r.stdout, output
    if r.launcher in ("torchrun", "launch"):
        assert r.returncode == 1 and "SignalException: Process" in r.stderr and "got signal: 15" in r.stderr, output
        assert "Unable to shutdown process" not in r.stderr, output
    elif r.launcher == "deepspeed":
        assert r.returncode == 1 and "Main process received SIGTERM, exiting" in output, output
    elif r.launcher == "horovodrun":
        statuses = re.findall(r"Process \d+ exit with status code (-?\d+)\.", r.stdout)
        # It lists the workers that ended before it did: one at least (seen: one of two, or both). Or none, and exits
        # 0: its middleman's psutil wait can reap the worker's shell before subprocess's wait, which then reads status
        # 0 (seen in a loaded CI run; safe_shell_exec.py, terminate_executor_shell_and_children).
        assert (r.returncode, statuses) == (0, []) or (
            r.returncode == 1 and 1 <= len(statuses) <= r.nproc and set(statuses) <= {"143", "137"}), output
    else:
        assert_stopped(r, where)


def stopped_from_outside(args, launcher, nproc, script, env=None, target=None, timeout=300):
    """The trainer under `launcher`, sent SIGTERM from outside when rank 0 prints its start report's communication
    line: to the launcher, or to target(launcher's pid). It must stop as every script does: all ranks after the same
    step (rank 0's last progress line: -p 1 makes one at every step), a checkpoint of it, and the launcher's report of
    workers that exited 143 (assert_stopped_from_outside). Returns the run, the epoch and the step it stopped after."""
    command = launch_command(script, launcher, nproc) + [str(a) for a in args + ["-p", 1]]
    with tempfile.TemporaryFile("w+") as stderr:  # a file: the launchers' logs would fill a pipe no one reads yet
        proc = subprocess.Popen(command, cwd=REPO, env=environment(env), stdout=subprocess.PIPE, stderr=stderr,
                                text=True)
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            stdout, signalled = [], False
            for line in proc.stdout:
                stdout.append(line)
                if not signalled and "=> communication:" in line:
                    os.kill(target(proc.pid) if target else proc.pid, signal.SIGTERM)
                    signalled = True
            returncode = proc.wait()
        finally:
            timer.cancel()
            proc.kill()
        assert returncode != -signal.SIGKILL, f"killed after {timeout} s: {command}"
        stderr.seek(0)
        outputs = "".join(stdout), stderr.read()
    if launcher == "horovodrun":  # as conftest.run: "[N]<stdout>:" before each line of rank N
        outputs = (re.sub(r"(?m)^\[\d+\]<std(?:out|err)>:", "", s) for s in outputs)
    r = Result.parse(returncode, *outputs, launcher=launcher, nproc=nproc)
    stopped = STOP_LINE.search(r.stdout)
    assert signalled and stopped, f"not stopped by the signal (sent: {signalled})\n{r.stdout}\n{r.stderr}"
    step, epoch = int(stopped[1]), int(stopped[2])
    assert PROGRESS.findall(r.stdout)[-1] == (str(epoch), str(step)), r.stdout
    assert_stopped_from_outside(r, f"step {step} of epoch {epoch}")
    return r, epoch, step


def stopped_then_resumed(args, launcher, script="distributed.py", epoch=0, nproc=2, env=None, checkpoint=None,
                         resume_launcher=None, target=None):
    """stopped_from_outside in `epoch` (args hold --output-dir), then resumed with --resume auto (under resume_launcher,
    by default the same): the stopped run wrote `checkpoint` (formatted with its epoch and step; default
    distributed.py's), which the resumed run loaded. Returns the stopped run and the resumed one."""
    out = Path(args[args.index("--output-dir") + 1])
    stopped, stopped_epoch, step = stopped_from_outside(args, launcher, nproc, script, env, target)
    checkpoint = (checkpoint or "checkpoint-epoch{epoch}-step{step}.pth").format(epoch=epoch, step=step)
    assert stopped_epoch == epoch and (out / checkpoint).exists() and (out / f"{checkpoint}.sha256").is_file()
    resumed = run(args + ["--resume", "auto"], resume_launcher or launcher, nproc, script, env=env).check()
    assert f"{out / checkpoint}' (epoch {epoch}, step {step})" in resumed.stdout, resumed.stdout
    return stopped, resumed
