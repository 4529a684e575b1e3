"""dataparallel.py, multiprocessing_distributed.py and apex_distributed.py: distributed.py's battery.

Each test runs the real script the way its users start it: dataparallel.py as one plain process,
multiprocessing_distributed.py spawning its own processes, apex_distributed.py under torchrun.
"""
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import (EQUIV, EQUIV_TOLERANCE, FAST, FLOAT64, RESNET18, environment, OVERFLOW_AT_STEP_1, REPO, assert_bf16_follows_float32,
                      assert_same_checkpoints, bad_inputs, check_first_step_skipped, copy_checkpoint, float64_weights,
                      free_port, launch_command, load_state, max_abs_diff, run, script_module, stall_a_rank,
                      stopped_then_resumed)

DP, MP, AMP = "dataparallel.py", "multiprocessing_distributed.py", "apex_distributed.py"
METHOD = {DP: "dataparallel", MP: "ddp-spawn", AMP: "amp"}
LAUNCHER = {DP: ("python", 1), MP: ("spawn", 2), AMP: ("torchrun", 2)}  # how most tests start each script
LAUNCHER_NAME = {"python": "none", "spawn": "mp.spawn", "torchrun": "torchrun", "launch": "torch.distributed.launch"}
# fp16 turns the GradScaler on, so its state is checkpointed and resumed. CPU fp16 convolutions are
# ~35x slower than fp32 for resnet18 here; squeezenet1_1 keeps the fp16 runs to seconds.
AMP_FP16 = ["--amp-dtype", "float16", "-a", "squeezenet1_1"]


# ---- runs, and resumes bitwise ----

@pytest.mark.parametrize("script,launcher,nproc,extra", [
    (DP, "python", 1, []), (MP, "spawn", 2, []), (AMP, "launch", 2, AMP_FP16)])  # torchrun: in the tests below
def test_runs_and_resumes_bitwise(script, launcher, nproc, extra, tiny_data, tmp_path):
    args = ["--data", tiny_data, "-b", 32, "--warmup-epochs", 1, "--lr-step-size", 1] + FAST + extra
    r = run(args + ["--epochs", 2, "--output-dir", tmp_path / "straight"], launcher, nproc, script).check()
    assert [s["epoch"] for s in r.summaries] == [0, 1]
    for s in r.summaries:
        assert (s["method"], s["launcher"], s["world_size"], s["device"], s["val_count"]) == \
            (METHOD[script], LAUNCHER_NAME[launcher], nproc, "cpu", 37)
    assert r.done["ranks_identical"] and len(r.done["state_sha256"]) == nproc
    assert r.stdout.count("Epoch: [0]") == 1, "progress must be printed by global rank 0 only"
    # The newest 2 (--keep-checkpoints), with their digests; checkpoint.pth names the newest.
    assert {p.name for p in (tmp_path / "straight").iterdir()} == {".lock", "metrics.jsonl", "model_best.pth"} | {
        name + suffix for name in ("checkpoint.pth", "checkpoint-epoch1.pth", "checkpoint-epoch2.pth")
        for suffix in ("", ".sha256")}

    copy_checkpoint(tmp_path / "straight", "checkpoint-epoch1.pth", tmp_path / "split")  # of the first epoch
    r = run(args + ["--epochs", 2, "--output-dir", tmp_path / "split", "--resume", "auto"],
            "forked" if launcher == "python" else launcher, nproc, script).check()
    assert [s["epoch"] for s in r.summaries] == [1]
    straight, split = assert_same_checkpoints(tmp_path / "straight", tmp_path / "split")
    if script == AMP:
        assert straight["scaler"] == split["scaler"]
        # Guards the comparison: the scaler counted its steps without overflow, so a resumed run
        # that started a fresh scaler would differ.
        assert straight["scaler"]["_growth_tracker"] > 0


# ---- training equals one process, and resumes mid-epoch ----

@pytest.mark.parametrize("script,extra,tolerance", [
    # On the CPU dataparallel.py builds no nn.DataParallel (it needs GPUs: tests/test_gpu.py's
    # test_two_gpus_train_as_one[dp] tests it): one process on one device through dataparallel.py's own lines, the
    # very computation of a 1-process distributed.py run, down to the shuffle, so the weights must be bitwise equal.
    (DP, [], 0.0),
    (MP, [], EQUIV_TOLERANCE),  # 2 processes on one node; two nodes below
    (AMP, ["--amp-dtype", "float32"], EQUIV_TOLERANCE),  # autocast and GradScaler off: DDP's numerics exactly
])
def test_training_equals_single_process_and_resumes_mid_epoch(script, extra, tolerance, tmp_path,
                                                                single_process_weights):
    """The script's processes train until a SIGTERM from outside stops them after a step (sent to the one process,
    to mp.spawn's launcher, which passes it on, or to torchrun); the same processes resume from its checkpoint to the
    epoch's end: the weights of one uninterrupted distributed.py process."""
    launcher, nproc = LAUNCHER[script]
    stopped_then_resumed(["--output-dir", tmp_path] + EQUIV + extra, launcher, script, nproc=nproc, env=FLOAT64)
    assert max_abs_diff(float64_weights(tmp_path), single_process_weights) <= tolerance


def test_spawn_across_two_nodes_equals_single_process(tmp_path, single_process_weights):
    """Two "nodes" on this machine, one process each: node 1's process is global rank 1 of node 0's group."""
    args = EQUIV + ["--nnodes", 2, "--port", free_port()]
    node1 = subprocess.Popen(
        launch_command(MP, "spawn", 1) + [str(a) for a in args + ["--node-rank", 1, "--output-dir", tmp_path / "n1"]],
        cwd=REPO, env=environment(FLOAT64), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    r = run(args + ["--node-rank", 0, "--output-dir", tmp_path / "n0"], "spawn", 1, MP, env=FLOAT64)
    out1, err1 = node1.communicate(timeout=300)
    r.check()
    assert node1.returncode == 0, err1
    assert r.summaries[0]["world_size"] == 2 and len(r.done["state_sha256"]) == 2 and r.done["ranks_identical"]
    assert out1 == "", "only global rank 0 prints"
    assert max_abs_diff(float64_weights(tmp_path / "n0"), single_process_weights) <= EQUIV_TOLERANCE


def test_fp16_overflow_in_the_first_step_leaves_momentum_zero(tmp_path):
    """conftest.check_first_step_skipped says why; one step of 2 x 16 images here."""
    args = ["--dummy", "--dummy-samples", 32, "-b", 32, "--epochs", 1, "--output-dir", tmp_path] + FAST + AMP_FP16
    check_first_step_skipped(run(args, *LAUNCHER[AMP], AMP, env=OVERFLOW_AT_STEP_1), args, tmp_path)


def test_amp_fp16_resumes_a_checkpoint_of_unfused_sgd(tiny_data, tmp_path):
    """distributed.py's SGD is not fused; its checkpoint's param groups say so. Loaded as they are,
    they turned apex_distributed.py's fused SGD off, while its GradScaler still handed the step its
    inf check: "Expected grad_scale and found_inf to be None" at the first step."""
    args = ["--data", tiny_data, "-b", 32, "--output-dir", tmp_path] + FAST + ["-a", "squeezenet1_1"]
    run(args + ["--epochs", 1]).check()
    r = run(args + ["--epochs", 2, "--resume", "auto", "--amp-dtype", "float16"], *LAUNCHER[AMP], AMP).check()
    assert [s["epoch"] for s in r.summaries] == [1]
    assert load_state(tmp_path / "checkpoint.pth")["optimizer"]["param_groups"][0]["fused"]


def test_amp_bfloat16_follows_float32(tmp_path, float32_weights):
    """bf16 keeps 8 significant bits: each rounded operand errs by up to 2**-9 (0.2%) relative.

    Forward values such as the loss stay within a few such roundings of fp32. A gradient does not:
    each entry is a sum over the batch and all pixels of products of both signs that mostly cancel,
    and its error is 2**-9 times the sum of the magnitudes, not of the result; bf16 rounding also
    flips some ReLU and max-pool decisions. Measured here: one fp32 gradient and its bf16 version
    differ by 12% (L2, resnet18, GroupNorm, at initialisation), and after these 3 steps the bf16
    update differs from the fp32 update by 26%. That error is noise of random direction, so nearly
    orthogonal to the update in these 11M dimensions: one of relative size e <= 0.5 (twice the
    measured) leaves the cosine 1/sqrt(1+e^2) >= 0.89 and the length sqrt(1+e^2) <= 1.12 times
    fp32's. So: cosine >= 0.85 and length within 0.8-1.25 (measured 0.97 and 1.00). A recipe bug
    moves these far: gradients left scaled (x65536), a step lost (the first one alone is over a
    quarter of the length) or taken twice, a wrong sign. And the update must differ from fp32's at
    all, or autocast did not run.
    """
    r = run(["--output-dir", tmp_path, "--amp-dtype", "bfloat16"] + EQUIV + RESNET18, *LAUNCHER[AMP], AMP).check()
    assert "=> autocast bfloat16, GradScaler off" in r.stdout
    assert_bf16_follows_float32(tmp_path, float32_weights, "autocast")


def test_default_amp_dtype_follows_the_device(monkeypatch, capsys):
    """fp16 on GPUs; bf16 on CPUs with native bf16 (AVX512-BF16 or AMX); float32 (AMP off, with a line
    saying why) on others, where emulated bf16 made a step 23x slower."""
    amp = script_module(AMP)
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    for capabilities, expected in [({"avx512_bf16": True}, "bfloat16"), ({"amx_bf16": True}, "bfloat16"),
                                   ({"avx2": True, "avx512_bf16": False, "amx_bf16": False}, "float32")]:
        monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: capabilities)
        assert amp.default_amp_dtype(cpu) == expected, capabilities
    assert "mixed precision off: this CPU has no native bf16" in capsys.readouterr().out
    assert amp.default_amp_dtype(cuda) == "float16"


def test_compile_trains_as_eager_resumes_bitwise_and_keeps_plain_keys(tmp_path, single_process_weights):
    """--compile (inductor, C++ on this CPU) only fuses and reorders what eager DDP computes: EQUIV in
    float64 on 2 processes ends within EQUIV_TOLERANCE of the same model trained eagerly by one process
    (the compiled kernels round in another order, by ~1e-16). Resumed for a second epoch it ends bitwise
    where a compiled run of 2 epochs straight through does. Compiled in place, the model keeps a plain
    model's state_dict keys, so checkpoints of compiled and eager runs load into each other. The model is
    the suite's, resnet18's stem and first block (conftest.TINY): inductor compiles the whole resnet18 for minutes here,
    and what compiling does to a model does not depend on its depth. (The compiled runs share one graph:
    inductor's cache, on by default, spares the later ones most of the compiling.)"""
    # One compiling thread: a pool's worker processes each import torch first, dearer here than they save.
    env = {**FLOAT64, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    args = EQUIV + ["--compile", "--amp-dtype", "float32"]
    run(["--output-dir", tmp_path / "split"] + args, *LAUNCHER[AMP], AMP, env=env).check()
    compiled = float64_weights(tmp_path / "split")
    assert list(compiled) == list(single_process_weights), "the compiled model's state_dict keys are not a plain model's"
    assert max_abs_diff(compiled, single_process_weights) <= EQUIV_TOLERANCE
    straight = run(["--output-dir", tmp_path / "straight"] + args + ["--epochs", 2], *LAUNCHER[AMP], AMP, env=env)
    resumed = run(["--output-dir", tmp_path / "split", "--resume", "auto"] + args + ["--epochs", 2], *LAUNCHER[AMP],
                  AMP, env=env).check()
    assert resumed.done["state_sha256"] == straight.check().done["state_sha256"]


def test_channels_last_resumes_a_contiguous_checkpoint(tmp_path, single_process_run):
    """A checkpoint keeps its run's memory layout, and distributed.py's is contiguous. Resumed with
    --channels-last on, apex_distributed.py copies the momentum into its parameters' channels_last
    layout, as its fused step takes them to be laid out alike (it does not check on the CPU: the
    update went wrong by up to 0.25 before). In float64 both layouts' kernels agree to ~1e-16."""
    shutil.copytree(single_process_run, tmp_path / "resumed")  # distributed.py's EQUIV run, float64
    run(["--output-dir", tmp_path / "straight"] + EQUIV + ["--epochs", 2], env=FLOAT64).check()
    r = run(["--output-dir", tmp_path / "resumed", "--resume", "auto", "--amp-dtype", "float32", "--channels-last",
             "on"] + EQUIV + ["--epochs", 2], *LAUNCHER[AMP], AMP, env=FLOAT64).check()
    assert "channels_last on" in r.stdout
    assert max_abs_diff(float64_weights(tmp_path / "resumed"), float64_weights(tmp_path / "straight")) <= \
        EQUIV_TOLERANCE


@pytest.mark.parametrize("compression,tolerance", [("fp16", 4e-5), ("bf16", 1e-4)])
def test_gradient_compression_stays_near_the_uncompressed_weights(compression, tolerance, tmp_path,
                                                                  single_process_weights):
    """The gradients cross the wire rounded to fp16 (11 significant bits) or bf16 (8), so each
    all-reduced gradient errs by up to 2**-11 or 2**-9 of its size, and the errors carry on through
    the momentum over EQUIV's 3 steps (float64 otherwise). Measured (resnet_tiny, 2026-11-26): the
    weights end 5.4e-6 (fp16) and 1.3e-5 (bf16) from the uncompressed single-process reference, whose
    update itself is 3.7e-3 at most: a hook that summed without averaging, or lost a rank's gradient,
    would move them by about that much, far beyond the bounds (7x and 8x the measured errors). The
    weights must also differ by more than EQUIV_TOLERANCE, or the hook did not run."""
    run(["--output-dir", tmp_path, "--amp-dtype", "float32", "--grad-compression", compression] + EQUIV,
        *LAUNCHER[AMP], AMP, env=FLOAT64).check()
    assert EQUIV_TOLERANCE < max_abs_diff(float64_weights(tmp_path), single_process_weights) <= tolerance


# ---- exact evaluation ----

def evaluate(script, launcher, nproc, tiny_data, checkpoint):
    """(count, loss, top-1, top-5) of the shared checkpoint; batches of 8 spread the 37 images over 3 ranks.
    apex_distributed.py's in bf16, which does not equal fp32's."""
    amp = ["--amp-dtype", "bfloat16"] if script == AMP else []
    (s,) = run(["--data", tiny_data, "-e", "--resume", checkpoint, "--val-batch-size", 8] + amp + FAST,
               launcher, nproc, script).check().summaries
    return s["val_count"], s["val_loss"], s["val_acc1"], s["val_acc5"]


@pytest.fixture(scope="module")
def reference_eval(tiny_data, checkpoint):
    return evaluate("distributed.py", "forked", 1, tiny_data, checkpoint)


# 3 ranks share the 5 val batches unevenly; fp32 scripts must also equal distributed.py's 1 process.
@pytest.mark.parametrize("script,world_sizes", [(DP, [1]), (MP, [3]), (AMP, [1, 3])])
def test_exact_evaluation_at_any_world_size(script, world_sizes, tiny_data, checkpoint, reference_eval):
    launcher = LAUNCHER[script][0]
    results = [evaluate(script, "forked" if nproc == 1 else launcher, nproc,
                        tiny_data, checkpoint) for nproc in world_sizes]
    assert results[0][0] == 37, "every val image must be counted exactly once"
    if script == AMP:
        assert results[1] == results[0], "bf16 at 3 processes must equal bf16 at 1"
        # The loss is a forward value: bf16 moves it by a few roundings of 2**-9
        # each; 20 layers' worth of them, were they all to add up, is 4%.
        assert results[0][1] == pytest.approx(reference_eval[1], rel=20 * 2 ** -9)
        assert results[0][1] != reference_eval[1], "bf16 evaluated exactly like fp32: autocast did not run"
    else:  # one world size each: distributed.py's one process is what it must equal
        assert results == [reference_eval]


def spawned_pids(parent):
    """The processes torch.multiprocessing.spawn started from `parent`, in start order: local rank order."""
    children = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat, cmdline = Path(f"/proc/{pid}/stat").read_text(), Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # gone
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and b"spawn_main" in cmdline:
            children.append(int(pid))
    return sorted(children)


def test_stalled_rank_0_is_named_under_spawn(tmp_path):
    """mp.spawn's rank 0 hosts the store the live ranks check in on (torchrun's agent hosts it under
    torchrun, where test_distributed.py stalls either rank): when rank 0 is the stalled one, the
    check-in gets no answer and gives up after 15 s, naming rank 0."""
    errors, stderr = stall_a_rank(MP, "spawn", lambda proc: spawned_pids(proc.pid)[0],
                                  ["--output-dir", tmp_path / "out"])
    assert len(errors) == 1, stderr
    elapsed, line = errors[0]
    assert line.startswith("error: rank(s) 0 stalled: the others waited --dist-timeout 5 s"), line
    assert 5 <= elapsed <= 35, elapsed


# ---- bad input: one clear line, non-zero exit, no traceback ----

@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def method_bad_inputs(tiny_data, checkpoint, tmp, busy_port):
    """distributed.py's bad inputs plus the methods' own: {case: (arguments, launcher, message)}."""
    data = ["--data", tiny_data, "-b", 32]
    return dict(bad_inputs(tiny_data, checkpoint, tmp), **{
        "gpus without cuda": (data + ["--gpus", "0,1"], "python", "--gpus needs CUDA GPUs"),
        "one image per replica": (["--data", tiny_data, "-b", 1], "python", "-b 1 leaves 1 image per process"),
        "compile without a compiler": (data + ["--compile"], "python",
                                       "--compile on the CPU needs a C++ compiler, and no-such-c++ is not found"),
        "port in use": (data + ["--port", busy_port], "spawn",
                        f"cannot join the process group at 127.0.0.1:{busy_port}"),
        "two nodes, no port": (data + ["--nnodes", 2], "spawn", "--nnodes > 1 needs --port"),
    })


# The shared helpers raise the same errors in every script (test_consistency.py), and apex_distributed.py
# keeps distributed.py's set-up and error reporting (one case checks its extra lines left them intact);
# these cases go through the other scripts' own lines: DataParallel's set-up, and the spawn launch,
# whose processes all fail alike while only rank 0 reports.
BAD = [(DP, "unwritable output dir"), (DP, "gpus without cuda"), (DP, "one image per replica"),
       (MP, "batch below world size"), (MP, "port in use"), (MP, "two nodes, no port"),
       (AMP, "truncated checkpoint"), (AMP, "compile without a compiler")]


@pytest.mark.parametrize("script,case", BAD)
def test_bad_input(script, case, tiny_data, checkpoint, tmp_path, busy_port):
    args, launcher, message = method_bad_inputs(tiny_data, checkpoint, tmp_path, busy_port)[case]
    if script == MP:
        launcher = "spawn"  # its only launch; distributed.py's cases name torchrun or python
    elif launcher == "python":
        launcher = "forked"  # with torch imported (test_distributed.py shows it the same as a plain python start)
    out = tmp_path / "out"
    env = {"CXX": "no-such-c++"} if case == "compile without a compiler" else None
    r = run(["--output-dir", out] + FAST + args, launcher, 1 if launcher == "forked" else 2, script, env=env)
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], r.stderr
    # torchrun adds its own failure report after the worker's line; the scripts print no traceback.
    assert "Traceback" not in r.stdout + (r.stderr.split("error:")[0] if launcher == "torchrun" else r.stderr)
    assert not list(out.glob("*.pth")) and not list(out.glob(".*.tmp"))


SLURM_STEP = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2"}


@pytest.mark.parametrize("script", ["distributed.py", DP, MP, AMP, "horovod_distributed.py", "fsdp_distributed.py",
                                    "deepspeed_distributed.py"])
def test_a_task_of_a_slurm_step_does_not_train_alone(script, tiny_data, tmp_path):
    """`srun -n 2 python X.py` (Slurm's variables of a 2-task step, no launcher): each task would train alone, world
    size 1. Task 0 says so in one line and what to run; the others exit as quietly (they, too, think they are rank
    0). distributed_slurm_main.py numbers the tasks from these variables (test_slurm.py); torchrun per node too."""
    args = ["--data", tiny_data, "-b", 32, "--output-dir", tmp_path] + FAST + (["--nprocs", 1] if script == MP else [])
    errors = {}
    for task in ("0", "1") if script == "distributed.py" else ("0",):  # the shared helper's: one script enough
        r = run(args, "forked", script=script, env={**SLURM_STEP, "SLURM_PROCID": task})
        errors[task] = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert r.returncode == 2 and not os.listdir(tmp_path) and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert len(errors["0"]) == 1 and not errors.get("1"), errors
    assert "this Slurm step has 2 tasks, but they would train apart, world size 1 each" in errors["0"][0]
