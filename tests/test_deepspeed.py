"""deepspeed_distributed.py on a real DeepSpeed engine (its CPU accelerator over gloo), under the deepspeed
launcher (one node, and two without ssh) and torchrun: ZeRO 0-3 train DDP's weights, exact evaluation,
bitwise and mid-epoch resume, the single-file export, bf16, bad input.

`bash scripts/install.sh --tests` installs DeepSpeed. Where it is not installed the tests that need it skip;
with CI=1 (README's test command) they fail instead, so CI never passes without it; installed and broken, they fail.

Equivalence is checked against distributed.py on the same 2 processes, in float32: DeepSpeed cannot take
the suite's float64 hook (ZeRO 1-3 keep a float32 master copy of the weights, and ZeRO 0 refuses float64
gradients), and in float32 1 process and 2 round differently (conftest.FLOAT64), by 2.3e-4 after EQUIV's
3 steps on this machine. On the same 2 processes every rank sees DDP's batches through the same kernels:
ZeRO 0-3 then end bitwise equal to DDP. With --grad-accum-steps, ZeRO 2 and 3 reduce each micro-batch's
gradients where DDP sums them first: 1.5e-8 apart after one step, and from the next step's forward on that
rounding can flip a ReLU decision lying within it, as between 1 process and 2: 2.5e-4 after EQUIV's 3 steps on
its synthetic images (measured, resnet18, 2026-11-27): so those two are compared after their first step. DDP on
2 processes trains the single process's weights: test_distributed.py shows it in float64.
"""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torchvision

# resnet18 for the equivalence runs: the tolerances and the errors they rule out were measured on it.
from conftest import (EQUIV_RESNET18 as EQUIV, FAST, FLOAT32_TOLERANCE, PYTHON, REPO, RESNET18, Result, RunsCode,
                      assert_bf16_follows_float32, assert_stopped, environment, free_port, load_state, max_abs_diff,
                      copy_checkpoint, require_engine, run, script_module, signal_at, stopped_then_resumed)

sys.path.insert(0, str(REPO))
import distributed  # noqa: E402  (the reference's state_digest)

profile_split = script_module("tools/profile_split.py")

SCRIPT = "deepspeed_distributed.py"
# DeepSpeed on the same 2 processes as DDP, on the same micro-batches: bitwise (measured: ZeRO 0-3 without
# accumulation, ZeRO 0-1 with it), as 2 ranks' sums round alike in any order and the updates are elementwise. ZeRO
# 2-3 with accumulation round differently (the docstring): compared after one step (ONE_STEP), where nothing but
# that rounding differs, 1.5e-8 measured. A real error (a sum for a mean, a lost step or momentum, a batch trained
# twice) moves the weights by more than 1e-3 (a sum for a mean: 3.4e-3 after that one step, measured).
SAME_PROCESSES_TOLERANCE = 0.0
ACCUMULATION_TOLERANCE = 1e-6
ONE_STEP = ["--dummy-samples", 32]  # after EQUIV: one optimizer step of 2 processes x 16 images
# A step schedule that changes the lr at the epoch boundary, so a resume must restore it exactly; val
# batches of 8, so every rank evaluates some of the 37 val images at 2 and 3 processes.
RESUME = ["-b", 32, "--warmup-epochs", 1, "--lr-step-size", 1, "--val-batch-size", 8] + FAST


# Its module-scoped runs are trained once when its tests share one pytest-xdist worker, not once on each.
pytestmark = pytest.mark.xdist_group("deepspeed")


@pytest.fixture(scope="session")
def deepspeed_installed():
    require_engine("deepspeed", "bash scripts/install.sh --tests", {"DS_ACCELERATOR": "cpu"})


def ds(args, launcher="torchrun", nproc=2, env=None, script=SCRIPT):
    """Run a trainer as its users start it (one process: forked, conftest.run). Ranks that disagree on a
    collective wait for each other until --dist-timeout: fail in 3 minutes, not 30."""
    return run(args, "forked" if launcher == "python" else launcher, nproc, script, env, timeout=180)


def ds_two_nodes(args, hostfile, env=None):
    """deepspeed_distributed.py on 2 nodes of one process each, as DeepSpeed's launcher starts them without ssh:
    `deepspeed --hostfile H --no_ssh --node_rank K` on each node. Both nodes are this machine, under two names
    in the hostfile (DeepSpeed keys its nodes by name); rank 0's output is node 0's."""
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    port = free_port()
    nodes = [subprocess.Popen([str(Path(PYTHON).parent / "deepspeed"), f"--hostfile={hostfile}", "--no_ssh",
                               f"--node_rank={node}", "--master_addr=127.0.0.1", f"--master_port={port}",
                               str(REPO / SCRIPT), "--cpu"] + [str(a) for a in args], cwd=REPO, env=environment(env),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in (0, 1)]
    try:
        (out0, err0), (_, err1) = (node.communicate(timeout=180) for node in nodes)
    finally:
        for node in nodes:
            node.kill()
    # Both nodes' exit status where they agree, else 1: a node that ended otherwise fails check() and assert_stopped.
    returncode = nodes[0].returncode if nodes[0].returncode == nodes[1].returncode else 1
    return Result.parse(returncode, out0, err0 + err1, launcher="deepspeed", nproc=2)


def weights(out):
    return load_state(Path(out) / "checkpoint.pth")["state_dict"]


def error_lines(r):
    return [line for line in r.stderr.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def ddp_weights(tmp_path_factory):
    """distributed.py's EQUIV weights on 2 processes, by --grad-accum-steps and flags after EQUIV (each run once)."""
    cache = {}

    def trained(accum, extra=()):
        if (accum, *extra) not in cache:
            out = tmp_path_factory.mktemp(f"ddp-accum{accum}")
            run(["--output-dir", out, "--grad-accum-steps", accum] + EQUIV + list(extra), "torchrun", 2).check()
            cache[accum, *extra] = weights(out)
        return cache[accum, *extra]
    return trained


@pytest.fixture(scope="module")
def straight(deepspeed_installed, tiny_data, tmp_path_factory):
    """ZeRO 3 on 2 processes under the deepspeed launcher, BatchNorm, 2 epochs: (result, output dir, the
    directory torch would compile C++ extensions into)."""
    out, extensions = tmp_path_factory.mktemp("straight"), tmp_path_factory.mktemp("torch_extensions")
    r = ds(["--data", tiny_data, "--epochs", 2, "--zero-stage", 3, "--output-dir", out] + RESUME, launcher="deepspeed",
           env={"TORCH_EXTENSIONS_DIR": str(extensions)})
    return r.check(), out, extensions


# ---- launching, checkpoints, the export ----

def test_deepspeed_launcher_runs_zero3_on_the_cpu(straight):
    r = straight[0]
    assert [s["epoch"] for s in r.summaries] == [0, 1]
    for s in r.summaries:
        assert (s["method"], s["launcher"], s["world_size"], s["device"], s["val_count"]) == \
            ("deepspeed", "deepspeed", 2, "cpu", 37)
    assert "=> DeepSpeed 0.19.8: ZeRO stage 3, forward in float32" in r.stdout
    # BatchNorm statistics differ per rank until broadcast, weights at ZeRO 3 until gathered.
    assert r.done["ranks_identical"] and len(r.done["state_sha256"]) == 2
    assert r.stdout.count("Epoch: [0]") == 1, "progress must be printed by global rank 0 only"


def test_checkpoint_layout(straight):
    """The newest 2 DeepSpeed checkpoints (ZeRO 3: each rank's weights and optimizer state), `latest`
    naming the newest, DeepSpeed's own recovery scripts, and the single-file exports with their best copy."""
    out = straight[1]
    assert {p.name for p in out.iterdir()} == {".lock", "latest", "metrics.jsonl", "model_best.pth", "zero_to_fp32.py",
                                               "zero_to_torch.py"} | {
        name + suffix for name in ("ds-epoch1", "ds-epoch2", "checkpoint.pth", "checkpoint-epoch1.pth",
                                   "checkpoint-epoch2.pth") for suffix in ("", ".sha256")}
    assert (out / "latest").read_text() == "ds-epoch2"
    assert {p.name for p in (out / "ds-epoch2").iterdir()} == {
        f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt" for rank in (0, 1) for kind in ("model", "optim")}


def test_no_deepspeed_op_is_compiled(straight):
    """DeepSpeed's CPU accelerator would JIT-compile its shared-memory all-reduce: a 1-process run took 66 s
    instead of 6.6 (measured on this machine, busy)."""
    assert not list(straight[2].iterdir())


def test_export_loads_into_a_plain_torchvision_model(straight):
    r, out, _ = straight
    plain = torchvision.models.get_model("resnet_tiny", num_classes=10)
    plain.load_state_dict(weights(out))  # strict: every key, every shape (ZeRO 3 would leave empty ones)
    assert distributed.state_digest(plain) == r.done["state_sha256"][0]


def node_launcher(pid):
    """The deepspeed command's one child: its launcher on the node, deepspeed.launcher.launch, which starts the workers
    and passes a SIGTERM on to them. The command itself does not where it starts one node: it handles signals only
    when it starts several through pdsh (deepspeed/launcher/runner.py:631), and a SIGTERM ends it alone."""
    (child,) = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return int(child)


def test_resume_is_bitwise(straight, tiny_data, tmp_path):
    """The straight run's checkpoint of its first epoch, a second one resumed from it under the deepspeed launcher,
    stopped mid-epoch by a SIGTERM to its node's launcher from outside, and resumed again under torchrun: the straight
    run's weights and BatchNorm statistics, bitwise (they depend on the restored ZeRO 3 shards, momentum, lr schedule
    and data order)."""
    r, out, _ = straight
    split = ["--data", tiny_data, "--zero-stage", 3, "--epochs", 2, "--resume", "auto", "--output-dir", tmp_path]
    copy_checkpoint(out, "ds-epoch1", tmp_path)  # the straight run's, of its first epoch
    stopped, resumed = stopped_then_resumed(split + RESUME, "deepspeed", SCRIPT, epoch=1, resume_launcher="torchrun",
                                            checkpoint="ds-epoch{epoch}-step{step}", target=node_launcher)
    assert resumed.done["state_sha256"] == r.done["state_sha256"]
    assert f"=> loaded checkpoint '{tmp_path / 'ds-epoch1'}' (epoch 1, step 0)" in stopped.stdout
    # The same evaluation and lr; its training meters count only the steps the last run took.
    ignore = {"epoch_time": 0, "images_per_sec": 0, "data_wait": 0, "launcher": 0, "train_loss": 0, "train_acc1": 0}
    assert resumed.summaries[0] | ignore == r.summaries[1] | ignore


# ---- training equals DDP ----

@pytest.mark.parametrize("stage,accum", [(1, 1), (1, 2), (2, 2), (3, 1), (3, 2)])
def test_zero_trains_ddps_weights(deepspeed_installed, ddp_weights, tmp_path, stage, accum):
    """conftest's EQUIV workload (ZeRO 2-3 with accumulation: its first step); ZeRO 2 without accumulation:
    test_mid_epoch_resume_at_the_same_world_size."""
    extra, tolerance = (ONE_STEP, ACCUMULATION_TOLERANCE) if stage > 1 and accum > 1 else ([], SAME_PROCESSES_TOLERANCE)
    r = ds(["--output-dir", tmp_path, "--zero-stage", stage, "--grad-accum-steps", accum] + EQUIV + extra).check()
    assert f"({16 // accum} per process x {accum} micro-batches)" in r.stdout and r.done["ranks_identical"]
    assert max_abs_diff(weights(tmp_path), ddp_weights(accum, extra)) <= tolerance


def test_ddp_reference_equals_one_process_in_float32(ddp_weights, float32_weights):
    """The reference above, distributed.py on 2 processes in float32, ends within FLOAT32_TOLERANCE of one process in
    float32 (test_distributed.py measures the rounding between them and what a real error moves): DDP's float32 path,
    which the float64 tests do not take, and with it DeepSpeed's, against one process."""
    assert max_abs_diff(ddp_weights(1), float32_weights) <= FLOAT32_TOLERANCE


# ---- mid-epoch resume ----

def interrupted(out, stage, launch=ds, extra=()):
    """EQUIV on 2 processes, stopped by SIGTERM in its 2nd step of 3 (progress after every step, where the
    ranks check for a stop): it must checkpoint that step and exit with 143, as its launcher reports it."""
    r = launch(["--output-dir", out, "--zero-stage", stage] + EQUIV + ["-p", 1, *extra], env=signal_at(2))
    assert_stopped(r, "step 2 of epoch 0")
    assert "Epoch: [0][3/3]" not in r.stdout and (out / "latest").read_text() == "ds-epoch0-step2"
    return r


def resumed(out, stage, nproc, step=2):
    r = ds(["--output-dir", out, "--zero-stage", stage, "--resume", "auto"] + EQUIV, launcher="torchrun"
           if nproc > 1 else "python", nproc=nproc).check()
    assert f"=> loaded checkpoint '{out / f'ds-epoch0-step{step}'}' (epoch 0, step {step})" in r.stdout
    assert "Epoch: [0][3/3]" in r.stdout
    # The newest 2 (a damaged one stays until a run writes its step again or 2 newer ones).
    assert sorted(p.name for p in out.glob("ds-epoch*") if p.is_dir()) == ["ds-epoch0-step2", "ds-epoch1"]
    return r


@pytest.fixture(scope="module")
def zero0(deepspeed_installed, tmp_path_factory):
    """ZeRO 0 on 2 nodes (ds_two_nodes: DeepSpeed's launcher without ssh), stopped after step 2, resumed on
    1 process: the output directory (shared by the nodes, as it must be), which holds a ZeRO 0 checkpoint
    of the end of the epoch."""
    out, hostfile = tmp_path_factory.mktemp("zero0"), tmp_path_factory.mktemp("hosts") / "hostfile"
    r = interrupted(out, stage=0, launch=lambda args, env: ds_two_nodes(args, hostfile, env), extra=("--profile", "2:2"))
    assert "world size 2, device cpu" in r.stdout and "launcher deepspeed" in r.stdout
    # Profiled step 2: ZeRO 0 all-reduces the gradients after the backward, one bucket after the other,
    # with no computation beside them: a run whose communication cannot overlap, all of it exposed.
    p = profile_split.split_trace(out / "trace-rank0.json")
    assert p["steps"] == 1 and p["comm_overlapped"] == 0 and p["comm_exposed"] > 0, p
    resumed(out, stage=0, nproc=1)
    return out


def test_mid_epoch_resume_at_another_world_size(zero0, ddp_weights):
    """ZeRO 0 keeps whole optimizer state: its checkpoint of 2 processes (on 2 nodes) resumes on 1. The last
    step then runs on 1 process, which rounds differently from 2 (3e-8 measured here; the 1-vs-2-process
    rounding flips a ReLU at worst, 2.3e-4 after 3 whole steps): within 1e-3, while resuming with the
    momentum lost or the trained batches not skipped moved the weights by 5.5e-3 and 4.9e-3 (measured)."""
    assert max_abs_diff(weights(zero0), ddp_weights(1)) <= 1e-3


def test_mid_epoch_resume_at_the_same_world_size(deepspeed_installed, ddp_weights, tmp_path):
    """ZeRO 1-3 checkpoints hold one shard of the optimizer state per rank, which DeepSpeed 0.19.8 does not
    reshard: another world size is refused in one line. The same one resumes DDP's weights, from the
    checkpoint of step 1 when that of step 2 is damaged (its largest file cut short)."""
    interrupted(tmp_path, stage=2, extra=["--save-every", 1])
    refused = run(["--output-dir", tmp_path, "--zero-stage", 2, "--resume", "auto"] + EQUIV, "forked", script=SCRIPT)
    assert refused.returncode != 0 and len(error_lines(refused)) == 1, refused.stderr
    assert "used a DP world size of 2 but the current world size is 1" in error_lines(refused)[0]
    shard = max((tmp_path / "ds-epoch0-step2").iterdir(), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:1000])
    r = resumed(tmp_path, stage=2, nproc=2, step=1)
    assert f"=> checkpoint '{tmp_path / 'ds-epoch0-step2'}' is damaged" in r.stdout
    assert max_abs_diff(weights(tmp_path), ddp_weights(1)) <= SAME_PROCESSES_TOLERANCE


# ---- exact evaluation, bf16 ----

def test_exact_evaluation_at_any_world_size(straight, tiny_data):
    """ZeRO 3 evaluating the export at 1, 2 and 3 processes equals distributed.py on 1 (batches of 8 deal the
    37 images out 2, 2, 1 at 3 processes: the rank short of one runs a stand-in forward)."""
    r, out, _ = straight

    def evaluate(nproc, script=SCRIPT, zero=("--zero-stage", 3)):
        (s,) = ds(["--data", tiny_data, "-e", "--resume", out / "checkpoint.pth", *zero] + RESUME,
                  launcher="torchrun" if nproc > 1 else "python", nproc=nproc, script=script).check().summaries
        return s["val_count"], s["val_loss"], s["val_acc1"], s["val_acc5"]

    expected = evaluate(1, "distributed.py", ())
    assert expected[0] == 37, "every val image must be counted exactly once"
    last = r.summaries[-1]  # the straight run's own evaluation at 2 processes, of the weights it exported
    assert (last["val_count"], last["val_loss"], last["val_acc1"], last["val_acc5"]) == expected
    assert evaluate(1) == expected and evaluate(3) == expected


def test_bfloat16_follows_float32(deepspeed_installed, tmp_path, float32_weights):
    """--precision bfloat16 (DeepSpeed's torch_autocast) against distributed.py's float32, within
    test_methods.py's bounds for autocast bf16. On 2 processes ZeRO 3 ends bitwise as ZeRO 0, which
    reduces the gradients in float32: so ZeRO 3 reduces them, and gathers the weights, in float32 too
    (DeepSpeed's default does both in bf16 for Linear and Conv: 2.1e-3 apart after EQUIV's 3 steps)."""
    zero3, zero0 = (ds(["--output-dir", tmp_path / str(stage), "--precision", "bfloat16", "--zero-stage", stage]
                       + EQUIV).check() for stage in (3, 0))
    assert_bf16_follows_float32(tmp_path / "3", float32_weights, "--precision bfloat16")
    assert zero3.done["state_sha256"] == zero0.done["state_sha256"]


# ---- bad input: one clear line, non-zero exit, no traceback ----

@pytest.mark.parametrize("case", ["unknown stage", "batch DeepSpeed rejects", "DeepSpeed's fp16",
                                  "DeepSpeed's bfloat16", "no such checkpoint", "checkpoint of another arch",
                                  "code in checkpoint"])
def test_bad_input(case, zero0, tiny_data, tmp_path):
    """The checkpoint cases load zero0's (ZeRO 0, whole optimizer state: any world size), on one process."""
    rejected_batch = tmp_path / "ds_config.json"
    rejected_batch.write_text(json.dumps({"train_batch_size": 64}))
    fp16, bfloat16 = tmp_path / "fp16.json", tmp_path / "bfloat16.json"
    fp16.write_text(json.dumps({"fp16": {"enabled": True}}))
    bfloat16.write_text(json.dumps({"bfloat16": {"enabled": True}}))  # bf16's old name, which DeepSpeed still reads
    code = shutil.copytree(zero0 / "ds-epoch1", tmp_path / "code")
    torch.save({"module": RunsCode(str(tmp_path / "code-ran"))}, code / "mp_rank_00_model_states.pt")
    data, equiv = ["--data", tiny_data, "-b", 32], EQUIV + RESNET18 + ["--zero-stage", 0, "-e", "--resume"]
    args, message = {
        "unknown stage": (data + ["--zero-stage", 4], "argument --zero-stage: 4 is out of range"),
        "batch DeepSpeed rejects": (data + ["--deepspeed-config", rejected_batch],
                                    "train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * "
                                    "world_size 64 != 32 * 1 * 1"),
        "DeepSpeed's fp16": (data + ["--deepspeed-config", fp16], '--deepspeed-config enables DeepSpeed\'s "fp16"'),
        "DeepSpeed's bfloat16": (data + ["--deepspeed-config", bfloat16],
                                 '--deepspeed-config enables DeepSpeed\'s "bfloat16"'),
        "no such checkpoint": (data + ["--resume", tmp_path / "none"], "no DeepSpeed checkpoint at"),
        "checkpoint of another arch": (equiv + [zero0 / "ds-epoch1", "-a", "resnet34"],
                                       "Error(s) in loading state_dict for ResNet"),
        "code in checkpoint": (equiv + [code], "Weights only load failed"),
    }[case]
    out = tmp_path / "out"
    r = run(["--output-dir", out] + FAST + args, "forked", script=SCRIPT)  # forked with torch imported: conftest.run
    assert r.returncode != 0
    assert len(error_lines(r)) == 1 and message in error_lines(r)[0], r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert not (tmp_path / "code-ran").exists(), "loading a checkpoint ran pickled code"


def test_without_deepspeed_prints_install_hint(tiny_data, tmp_path):
    """A Python that cannot import deepspeed (None in sys.modules makes the import fail as if absent)."""
    code = ("import runpy, sys; sys.modules['deepspeed'] = None; sys.argv[0] = sys.argv[1]; del sys.argv[1]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    proc = subprocess.run([PYTHON, "-c", code, str(REPO / SCRIPT), "--data", str(tiny_data), "--output-dir",
                           str(tmp_path)] + [str(a) for a in FAST], capture_output=True, text=True, timeout=120,
                          env=environment())
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr  # one line
    assert proc.stderr.startswith("error: cannot import deepspeed")
    assert "DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed==0.19.8" in proc.stderr
