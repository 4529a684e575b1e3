"""distributed.py under real launchers: launch, distributed math, exact eval, resume, bad input."""
import importlib.util
import contextlib
import json
import math
import os
import re
import resource
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy
import pytest
import torch
import torchvision
import torchvision.transforms.v2 as transforms
from PIL import Image

from conftest import (EQUIV, EQUIV_TOLERANCE, FAST, FLOAT64, PROGRESS, PYTHON, REPO, RESNET18,
                      assert_epoch_ends_as_one_process, assert_same_checkpoints, bad_inputs, environment,
                      epoch_checkpoint, fault_at, float64_weights, initial_weights, launch_command, load_state,
                      make_data, max_abs_diff, png_header, require_engine, resume_mid_epoch, run, script_module,
                      stall_a_rank, STOP_LINE, stopped_then_resumed)

sys.path.insert(0, str(REPO))
import distributed  # noqa: E402  (the script itself, for its pure helpers)

profile_split = script_module("tools/profile_split.py")


# ---- launching ----

@pytest.mark.parametrize("launcher,nproc", [("python", 1), ("torchrun", 2), ("launch", 2)])
def test_launchers(tiny_data, tmp_path, launcher, nproc):
    out = tmp_path / "ckpt"
    r = run(["--data", tiny_data, "-b", 32, "--epochs", 2, "--output-dir", out] + FAST,
            launcher=launcher, nproc=nproc).check()
    assert [s["epoch"] for s in r.summaries] == [0, 1]
    expected_launcher = {"python": "none", "torchrun": "torchrun", "launch": "torch.distributed.launch"}[launcher]
    for s in r.summaries:
        assert (s["launcher"], s["world_size"], s["device"], s["val_count"]) == (expected_launcher, nproc, "cpu", 37)
        assert s["images_per_sec"] > 0 and 0 <= s["data_wait"] <= 1
    assert r.done["ranks_identical"] and len(r.done["state_sha256"]) == nproc
    assert (out / "checkpoint.pth").is_file() and (out / "model_best.pth").is_file()
    assert not [p for p in os.listdir(out) if p.endswith(".tmp")], "a temporary checkpoint file was left behind"
    assert r.stdout.count("Epoch: [0]") == 1, "progress must be printed by global rank 0 only"


@pytest.mark.parametrize("version,warned", [("2.10.2+cu128", True), ("2.9.1", True), ("2.11.0+cu130", False),
                                            ("2.14.1", False), ("3.0.0", False)])
def test_a_torch_older_than_the_tested_ones_is_one_line(version, warned, monkeypatch, capsys):
    monkeypatch.setattr(torch, "__version__", version)
    args = distributed.argument_parser().parse_args(["--dummy"])
    distributed.report_start(torch.nn.Linear(2, 2), 1, torch.device("cpu"), 256, args)
    lines = [line for line in capsys.readouterr().out.splitlines() if "warning" in line]
    assert lines == ([f"=> warning: torch {version} is older than 2.11, the oldest the cookbook's tests ran on "
                      "(docs/testing.md): it may fail, or train otherwise, unnoticed by them"] if warned else [])


@pytest.mark.parametrize("flag", ["--local-rank=3", "--local_rank=3"])
def test_legacy_local_rank_spellings(flag):
    assert distributed.argument_parser().parse_args([flag]).local_rank == 3


def test_dummy_data_runs_and_gpus_torch_cannot_use_are_an_error_unless_cpu(tmp_path):
    """A fake nvidia-smi lists a GPU that torch does not see (a CUDA_VISIBLE_DEVICES naming no GPU here, as a
    too old driver would): one error line; --cpu trains on the CPU."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvidia-smi").write_text("#!/bin/sh\necho 535.54.03\n")
    (tmp_path / "bin" / "nvidia-smi").chmod(0o755)
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "CUDA_VISIBLE_DEVICES": "GPU-00000000-none"}
    args = ["--dummy", "--dummy-samples", 64, "-b", 16, "--epochs", 1, "--output-dir", tmp_path] + FAST
    refused = run(args, "forked", env=env)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert refused.returncode != 0 and len(errors) == 1, refused.stderr
    assert "nvidia-smi lists 1 GPU(s) (driver 535.54.03) but torch" in errors[0] and "--cpu" in errors[0]
    # On a second node (local rank 0 there, global rank 1): that node says why, as global rank 0 is on another.
    elsewhere = run(args, "forked", env={**env, "RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2"})
    assert elsewhere.returncode == 2 and [line for line in elsewhere.stderr.splitlines() if line.startswith("error:")] \
        == errors, elsewhere.stderr
    r = run(args + ["--cpu"], launcher="torchrun", nproc=2, env=env).check()
    assert r.summaries[0]["val_count"] == 6 and r.summaries[0]["images_per_sec"] > 0


def restarting_torchrun(restarts, args, **env):
    """The command line and environment of distributed.py under `torchrun --max-restarts=restarts`."""
    command = launch_command("distributed.py", "torchrun", 2)
    command[1:1] = [f"--max-restarts={restarts}"]
    # docs/operations.md: restarts need a fresh rendezvous store per attempt on torch 2.14
    return command + [str(a) for a in args], environment(dict(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **env))


def test_torchrun_restarts_a_failing_worker_then_shows_its_traceback(tmp_path):
    """A worker that raises on every attempt (tests/hooks: every optimizer step fails): torchrun
    --max-restarts=1 starts the workers twice, then its failure summary holds the worker's traceback,
    which main's @record puts there."""
    command, env = restarting_torchrun(
        1, ["--dummy", "--dummy-samples", 64, "-b", 16, "--epochs", 1, "--output-dir", tmp_path] + FAST,
        **fault_at("every"))
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert proc.stdout.count("=> ddp: world size 2") == 2, "torchrun restarts the workers once"
    summary = proc.stderr[proc.stderr.index("Root Cause (first observed failure)"):]
    assert "attempt_1" in summary and "To enable traceback" not in summary
    assert 'in train\n      optimizer.step()' in summary
    assert "RuntimeError: injected fault: optimizer step 1 fails" in summary


def worker_pid(marker, rank):
    """The PID of the launched worker of global rank `rank` whose command line holds `marker`."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # gone, or not ours to read
            continue
        if marker.encode() in cmdline and f"RANK={rank}".encode() in environ:
            return int(pid)
    raise AssertionError(f"no worker of rank {rank} running with {marker}")


@pytest.mark.parametrize("stalled", [1, 0])
def test_stalled_rank_is_named(stalled, tmp_path):
    """torchrun's workers: the store the live ranks check in on is torchrun's own."""
    out = str(tmp_path / "out")
    # torchrun would wait 30 s for the stopped worker to take its SIGTERM: kill it once the error is out.
    errors, stderr = stall_a_rank("distributed.py", "torchrun", lambda proc: worker_pid(out, stalled),
                                  ["--output-dir", out], kill_on_error=True)
    assert len(errors) == 1, stderr
    elapsed, line = errors[0]
    assert line.startswith(f"error: rank(s) {stalled} stalled: the others waited --dist-timeout 5 s"), line
    assert 5 <= elapsed <= 25, elapsed


# ---- distributed math ----
# BatchNorm normalises over the per-rank batch, so 2 ranks x 16 images are not the same computation
# as 1 process x 32 images: EQUIV uses --norm group (GroupNorm normalises each image on its own).
# It trains on synthetic random images: the digits' constant black background makes exact max-pool
# ties, where any rounding difference between the batch splits picks another pixel for the gradient.
# And it runs in float64 (conftest.FLOAT64 says why), so the only difference left is the gradient
# averaging under test. test_same_global_batches_at_any_world_size covers the real image pipeline.

def test_single_process_reference_trained(single_process_weights):
    """Guards the equivalence tests: the reference moved well away from its initial weights."""
    torch.set_default_dtype(torch.float64)  # as the float64 reference run built its model
    try:
        initial = initial_weights(EQUIV)
    finally:
        torch.set_default_dtype(torch.float32)
    assert 1e-3 < max_abs_diff(single_process_weights, initial) < 1


def test_same_global_batches_at_any_world_size(tiny_data):
    """Rank r's micro-batches of a step, interleaved, are exactly the batch one process takes:
    same images, same random crops and flips, whatever the world size or loader worker count."""
    args = distributed.argument_parser().parse_args(["--data", str(tiny_data), "--image-size", "32"])
    train_set = distributed.SampleSeeded(distributed.build_datasets(args)[0], seed=0)

    def first_batch(world, rank):
        sampler = distributed.ResumableSampler(train_set, num_replicas=world, rank=rank, seed=0, drop_last=True)
        sampler.set_epoch(1)
        loader = torch.utils.data.DataLoader(train_set, batch_size=32 // world, sampler=sampler, num_workers=rank)
        return next(iter(loader))

    images, labels = first_batch(1, 0)
    shards = [first_batch(2, rank) for rank in range(2)]
    # DistributedSampler deals the permutation out round-robin: rank r holds global positions r, r+2, ...
    assert torch.equal(torch.stack([s[0] for s in shards], dim=1).flatten(0, 1), images)
    assert torch.equal(torch.stack([s[1] for s in shards], dim=1).flatten(0, 1), labels)


def test_exact_evaluation_at_any_world_size(tiny_data, checkpoint):
    results = {}
    for nproc in (1, 2, 3):
        # 5 val batches of 8 (the last of 5) dealt over the ranks: every rank evaluates some.
        r = run(["--data", tiny_data, "-e", "--resume", checkpoint, "--val-batch-size", 8] + FAST,
                launcher="forked" if nproc == 1 else "torchrun", nproc=nproc).check()
        (s,) = r.summaries
        results[nproc] = (s["val_count"], s["val_loss"], s["val_acc1"], s["val_acc5"])
    assert results[1][0] == 37, "every val image must be counted exactly once"
    assert results[1] == results[2] == results[3]


def profiles(r, out, nproc, steps):
    """A --profile run's split (tools/profile_split.py), one record per rank, after checking that each rank's
    trace parses and holds the profiled steps, and that the parts are disjoint: none negative, summing to the step."""
    assert f"python tools/profile_split.py {out}" in r.stdout, r.stdout
    records = [profile_split.split_trace(Path(out) / f"trace-rank{rank}.json") for rank in range(nproc)]
    for rank, p in enumerate(records):
        assert (p["rank"], p["device"], p["steps"]) == (rank, "cpu", steps), p
        parts = [p[k] for k in ("compute", "comm_exposed", "data_wait", "optimizer", "other")]
        assert min(parts + [p["comm_overlapped"]]) >= 0 and abs(sum(parts) - p["step"]) <= 0.01, p
        assert p["other"] < 0.5 * p["step"], p  # on the CPU, the ops cover the step but for gaps between them
    return records


def test_resume_is_bitwise(tiny_data, tmp_path):
    """At the epoch's end, then, for the model's BatchNorm statistics too, in the middle of the next one."""
    args = ["--data", tiny_data, "-b", 32, "--warmup-epochs", 1, "--lr-step-size", 1] + FAST
    # Profiled (steps 2 and 3, of epoch 0): the profiler only observes, the weights stay bitwise those of the split run.
    straight = run(args + ["--epochs", 2, "--output-dir", tmp_path / "straight", "--profile", "2:3"], launcher="torchrun",
            nproc=2).check()
    for p in profiles(straight, tmp_path / "straight", 2, 2):
        assert p["comm_exposed"] + p["comm_overlapped"] > 0, p  # DDP's all-reduces, on gloo's threads
    # The volume the first lines state, computed from the model, is what the trace's all-reduces carried:
    # DDP's float32 gradient buckets, of which a ring all-reduce sends 2(N-1)/N from each rank.
    sent = int(re.search(r"=> communication: ([\d,]+) bytes", straight.stdout)[1].replace(",", ""))
    events = json.loads((tmp_path / "straight" / "trace-rank0.json").read_text())["traceEvents"]
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name", "").startswith("ProfilerStep#")]
    numel = sum(math.prod(dims) for e in events if e.get("name") == "c10d::allreduce_"
                and any(start <= e["ts"] < end for start, end in steps) for dims in e["args"]["Input Dims"][0])
    assert numel > 0 and sent == 2 * (2 - 1) * numel * 4 // 2 // len(steps), (sent, numel)
    run(args + ["--epochs", 1, "--output-dir", tmp_path / "split"], launcher="torchrun", nproc=2).check()
    # Resumed from the epoch's end under torch.distributed.launch, which passes on a SIGTERM from outside: stopped in
    # the next epoch (the resume began at the first one's end) and resumed again under torchrun, it ends with the
    # straight run's weights and BatchNorm statistics (the digests), lr schedule and momentum.
    _, resumed = stopped_then_resumed(args + ["--epochs", 2, "--resume", "auto", "--output-dir", tmp_path / "split"],
                                      "launch", epoch=1, resume_launcher="torchrun")
    assert resumed.done["state_sha256"] == straight.done["state_sha256"]
    assert_same_checkpoints(tmp_path / "straight", tmp_path / "split")


# Rewrites a checkpoint as a GPU run writes one: every storage recorded at cuda:0 (location tags
# decide where torch.load puts a tensor unless told otherwise).
AS_IF_FROM_A_GPU = """
import sys, torch
torch.serialization.register_package(0, lambda storage: "cuda:0", lambda storage, location: None)
torch.save(torch.load(sys.argv[1], weights_only=True), sys.argv[2])
"""


def test_checkpoint_from_a_gpu_resumes_on_the_cpu(tiny_data, checkpoint, tmp_path):
    """The checkpoint is loaded onto the CPU, whatever device wrote it, and load_state_dict copies it
    to the model's device: on GPUs, loading straight onto the GPU failed in torch.set_rng_state (resume_training)."""
    from_gpu = tmp_path / "from-gpu.pth"
    subprocess.run([sys.executable, "-c", AS_IF_FROM_A_GPU, checkpoint, from_gpu], check=True)
    with pytest.raises(RuntimeError, match="on a CUDA device"):  # the file does name cuda:0
        torch.load(from_gpu, weights_only=True)
    r = run(["--data", tiny_data, "-b", 32, "--epochs", 2, "--resume", from_gpu, "--output-dir", tmp_path] + FAST,
            launcher="torchrun", nproc=2).check()
    assert [s["epoch"] for s in r.summaries] == [1]


def test_ddp_equals_one_process_over_a_whole_epoch(tmp_path, single_process_run):
    """DDP on 2 processes trains EQUIV's whole epoch, evaluates it and checkpoints its end as one process does. A
    wrong gradient average would move the weights by more than 1e-3; a val image counted twice or left out, or a
    rank's mean taken for the global one, would change the evaluation."""
    r = run(["--output-dir", tmp_path] + EQUIV, "torchrun", 2, env=FLOAT64).check()
    assert "(16 per process x 1 micro-batches)" in r.stdout and r.done["ranks_identical"]
    assert_epoch_ends_as_one_process(r, tmp_path, single_process_run,
                                     epoch_checkpoint(tmp_path / "checkpoint-epoch1.pth"))


def test_ddp_with_accumulation_equals_one_process_and_resumes_mid_epoch_at_another_world_size(tmp_path,
                                                                                               single_process_weights):
    """DDP on 2 processes trains steps 1 and 2 with 2 micro-batches each (accumulation equals the whole batch),
    stopped by a signal in step 2; 1 process resumes from their checkpoint, skipping the 2 batches already
    trained on, and trains step 3: its weights equal one uninterrupted process's. A wrong gradient average,
    retrained or skipped batches would each move them by more than 1e-3. (Without accumulation, over a whole epoch:
    test_ddp_equals_one_process_over_a_whole_epoch.)"""
    extra = ["--grad-accum-steps", 2]
    r = resume_mid_epoch(tmp_path, lambda args, env: run(args + extra, "torchrun", 2, env=env),
                         lambda args, env: run(args + extra, "forked", env=env))
    assert "(16 per process x 2 micro-batches)" in r.stdout
    assert max_abs_diff(float64_weights(tmp_path), single_process_weights) <= EQUIV_TOLERANCE


def test_mid_epoch_resume_skips_a_damaged_newest_checkpoint_bitwise(tmp_path, single_process_weights):
    """The newest checkpoint cut short (a copy or a file system that lost its tail): --resume auto says
    so in one line and resumes from the one before it, and the run ends bitwise where an uninterrupted
    one does."""
    r = resume_mid_epoch(tmp_path, *[lambda args, env: run(args, "forked", env=env)] * 2,
                         damaged="checkpoint-epoch0-step2.pth")
    resumed = float64_weights(tmp_path)
    assert all(torch.equal(resumed[key], single_process_weights[key]) for key in single_process_weights)
    # metrics.jsonl: the interrupted run logged steps 1 and 2, the resumed one repeated step 2 (its
    # checkpoint was damaged) and logged step 3: step 2 is there once, from the run that kept it.
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["position"]) for r in records] == [
        ("train", [0, 1]), ("train", [0, 3]), ("SUMMARY", [1, 0]), ("DONE", [1, 0])], records
    assert records[2]["val_acc1"] == r.summaries[0]["val_acc1"]
    # Written through temporary files, yet with the mode open() gives under the umask (mkstemp's is 0600).
    umask = os.umask(0o022)
    os.umask(umask)
    written = [p for p in tmp_path.iterdir() if p.name == "metrics.jsonl" or p.name.startswith("checkpoint")]
    assert {p.stat().st_mode & 0o777 for p in written} == {0o666 & ~umask}, written


def test_an_output_dir_in_use_is_refused(tmp_path):
    """A second run while one writes into --output-dir is refused by its lock (torchrun: one line for
    all ranks, before the rendezvous), and the first finishes; a fresh run into the directory it left
    is refused too, naming --resume auto, and leaves every file byte-identical."""
    args = ["--dummy", "--dummy-samples", 64, "-b", 32, "--epochs", 2, "--output-dir", tmp_path] + FAST + ["-j", 1]
    first = subprocess.Popen(launch_command("distributed.py", "python", 1) + [str(a) for a in args + ["-p", 1]],
                             cwd=REPO, env=environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        next(line for line in first.stdout if line.startswith("Epoch: [0]"))  # it is training (with a loader worker)
        os.kill(first.pid, signal.SIGSTOP)  # and stays in its run while the second starts
        second = run(args + ["--resume", "auto"], "torchrun", 2)
        os.kill(first.pid, signal.SIGCONT)
        stdout, stderr = first.communicate(timeout=120)
    finally:
        first.kill()
    errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
    assert second.returncode != 0 and errors == [
        f"error: another run is writing checkpoints in --output-dir '{tmp_path}' (it holds its .lock): wait for it "
        "to end, or pass another --output-dir"], second.stderr
    assert first.returncode == 0 and "DONE" in stdout, stdout + stderr
    files = {path: path.read_bytes() for path in tmp_path.iterdir()}
    third = run(args, "forked")
    assert third.returncode == 2 and third.stderr.splitlines() == [
        f"error: --output-dir '{tmp_path}' holds another run's checkpoints (checkpoint-epoch1.pth): pass --resume "
        "auto to continue that run, or another --output-dir for a new one"], third.stderr
    assert {path: path.read_bytes() for path in tmp_path.iterdir()} == files


def test_torchrun_restarts_a_killed_worker_then_stops_on_sigterm_bitwise(tiny_data, tmp_path):
    """SIGKILL rank 0 from outside, mid-epoch: the worker that writes the checkpoints (torchrun restarts all
    workers alike whichever one dies). torchrun --max-restarts=3 restarts them, and they resume from the last
    --save-every checkpoint. Then SIGTERM torchrun itself in the next epoch, as a cluster ending the job does:
    it passes the signal on, and the workers stop together within a step of it (they check at each progress
    line, -p 1), checkpoint that step and exit. A new run with --resume auto
    ends bitwise where an uninterrupted run does, momentum included."""
    # resnet18: the kill and the signal land a few steps apart as rank 0's progress lines are read; resnet_tiny's
    # steps ran ahead of the reading (kills resumed from step 5).
    args = ["--data", tiny_data, "-b", 16, "--epochs", 2] + FAST + RESNET18 + ["-p", 1, "-j", 1]  # 6 steps per epoch
    # The straight run and the last resume without loader workers, which train the same weights
    # (test_seed_is_deterministic_with_loader_workers) and would each start 4 more interpreters.
    straight = run(args + ["-j", 0, "--output-dir", tmp_path / "straight"], launcher="torchrun", nproc=2).check()
    out = tmp_path / "interrupted"
    command, env = restarting_torchrun(3, args + ["--save-every", 1, "--resume", "auto", "--output-dir", out])
    with open(tmp_path / "stderr", "w+") as stderr:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True)
        stdout = []

        def read_until(found):
            for line in proc.stdout:
                stdout.append(line)
                if found(line):
                    return line
            raise AssertionError(f"the run ended first:\n{''.join(stdout)}")

        def reached(epoch, step):  # rank 0's progress lines: this attempt has done the step
            return lambda line: (m := PROGRESS.match(line)) and (int(m[1]), int(m[2])) >= (epoch, step)
        try:
            read_until(reached(0, 3))
            os.kill(worker_pid(str(out), 0), signal.SIGKILL)
            read_until(lambda line: line.startswith("=> loaded checkpoint"))  # the restarted workers resumed
            signalled_after = int(PROGRESS.match(read_until(reached(1, 2)))[2])
            proc.send_signal(signal.SIGTERM)
            stopped = read_until(lambda line: line.startswith("=> stopped on a signal"))
            stdout.extend(proc.stdout)
            assert proc.wait(timeout=120) != 0  # torchrun reports the signal it got
        finally:
            proc.kill()
    resumes = [tuple(map(int, m)) for m in re.findall(r"=> loaded checkpoint .* \(epoch (\d+), step (\d+)\)",
                                                      "".join(stdout))]
    # A kill right after a progress line may come before that step's checkpoint is written.
    assert len(resumes) == 1 and resumes[0][0] == 0 and resumes[0][1] > 0, resumes
    # The step under way when the signal came is finished; the line read may lag one step behind.
    stopped_after = int(re.search(r"after step (\d+) of epoch 1", stopped)[1])
    assert signalled_after < stopped_after <= signalled_after + 2, (signalled_after, stopped)
    assert load_state(out / "checkpoint.pth")["step"] == stopped_after

    resumed = run(args + ["-j", 0, "--resume", "auto", "--output-dir", out], launcher="torchrun", nproc=2).check()
    assert f"(epoch 1, step {stopped_after})" in resumed.stdout
    assert resumed.done["state_sha256"] == straight.done["state_sha256"]
    assert torch.equal(*(load_state(d / "checkpoint.pth")["optimizer"]["state"][0]["momentum_buffer"]
                         for d in (out, tmp_path / "straight")))


def test_resumable_sampler_skips_the_first_global_batches_at_any_world_size():
    data, batch = list(range(40)), 8
    for world in (1, 2, 4):
        for skip_steps in (0, 1, 3):
            shares = []
            for rank in range(world):
                sampler = distributed.ResumableSampler(data, num_replicas=world, rank=rank, seed=5, drop_last=True)
                sampler.set_epoch(3, skip=skip_steps * batch // world)
                shares.append(list(sampler))
                assert len(sampler) == len(shares[-1]) and {epoch for epoch, _ in shares[-1]} <= {3}
            whole = distributed.ResumableSampler(data, num_replicas=1, rank=0, seed=5, drop_last=True)
            whole.set_epoch(3)
            assert sorted(sum(shares, [])) == sorted(list(whole)[skip_steps * batch:]), (world, skip_steps)


def test_spawned_workers_are_sent_a_small_dataset_at_any_size(tmp_path):
    """A loader worker reads its dataset from a pipe once it has started (spawned, as they were: after importing
    torch); over the pipe's 64 KiB the sender waits for that, worker after worker (on an H100 node, 14 spawned workers
    took 100 s before the first batch). distributed.FileTable keeps the file list in tensors, which go by shared
    memory: the pickle does not grow."""
    from multiprocessing.reduction import ForkingPickler
    sizes = []
    for count in (10, 2000):
        names = [f"image-{i:08d}-with-a-name-as-long-as-imagenets.JPEG" for i in range(count)]
        for split in ("train", "val"):
            folder = tmp_path / str(count) / split / "class-with-a-long-name"
            folder.mkdir(parents=True)
            for name in names:  # ImageFolder lists the files; it reads none
                (folder / name).touch()
        args = distributed.argument_parser().parse_args(["--data", str(tmp_path / str(count))])
        train, val, _ = distributed.build_datasets(args)
        last = tmp_path / str(count) / "train" / folder.name / names[-1]
        assert len(train) == count and train.samples[count - 1] == (str(last), 0)
        sizes.append(len(ForkingPickler.dumps(distributed.SampleSeeded(train, 0))))
    assert sizes[1] < 65536 and abs(sizes[1] - sizes[0]) < 64, sizes


def test_listed_folder_lists_what_image_folder_lists(tmp_path):
    """build_datasets' one walk of the tree (ListedFolder) gives ImageFolder's classes, files, order and labels, on a
    tree with nested folders, a class folder that is a symlink, a link into another class, other extensions, a file
    outside any class and a name that is not UTF-8; and ImageFolder's words for a class without images."""
    root = tmp_path / "train"
    names = ["x.JPEG", "y.jpg", "z.PNG", "notes.txt", ".hidden.jpg", "w.JpEg", "10.jpg", "9.jpg"]
    files = [root / c / n for c in ("b", "a", "c10", "c2", "Z") for n in names] + [
        root / "a" / "sub" / "deeper" / "q.jpg", root / "a" / "sub" / "r.webp", root / "a" / "sub-1" / "t.jpg",
        root / "c2" / "sub" / "u.jpeg", root / "top-level.jpg", tmp_path / "elsewhere" / "inner" / "e.jpg",
        Path(os.fsdecode(bytes(root / "b") + b"/caf\xe9.jpg"))]
    for path in files:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    (root / "linked").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (root / "b" / "to-c2").symlink_to("../c2", target_is_directory=True)
    expected, listed = torchvision.datasets.ImageFolder(str(root)), distributed.ListedFolder(str(root), None, None)
    assert listed.classes == expected.classes and listed.class_to_idx == expected.class_to_idx
    assert [listed.samples[i] for i in range(len(listed))] == expected.samples and len(expected) == 49
    assert listed.targets.tolist() == expected.targets and listed.imgs is listed.samples
    (root / "empty" / "sub").mkdir(parents=True)
    (root / "empty" / "sub" / "readme.txt").touch()
    with pytest.raises(FileNotFoundError) as expected_error:
        torchvision.datasets.ImageFolder(str(root))
    with pytest.raises(FileNotFoundError, match=re.escape(str(expected_error.value))):
        distributed.ListedFolder(str(root), None, None)


def test_a_stopped_or_killed_trainer_leaves_no_loader_process(tiny_data, tmp_path):
    """-j 2: the loader workers' fork server and the workers it forks are in the trainer's process group and session.
    A launcher's SIGTERM to the group stops training after a checkpoint (exit 143): they ignore it. And they end with
    the trainer, also with a SIGKILLed one (the OOM killer): nothing of its session is left, and its stdout ends."""
    def running(pid):  # neither gone nor a zombie
        with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        return False

    for signum, returncode in ((signal.SIGTERM, 143), (signal.SIGKILL, -signal.SIGKILL)):
        args = ["--data", tiny_data, "-b", 16, "--epochs", 2, "-j", 2, "-p", 1, "--image-size", 32, "--seed", 0,
                "--output-dir", tmp_path / signum.name]
        proc = subprocess.Popen(launch_command("distributed.py", "python", 1) + [str(a) for a in args], cwd=REPO,
                                env=environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        lines, session = [], []
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        try:
            for line in proc.stdout:
                lines.append(line)
                if PROGRESS.match(line):
                    break
            session = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc")))
                       if running(pid) and os.getsid(pid) == proc.pid]
            commands = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in session]
            assert sum(b"multiprocessing.forkserver import main" in c for c in commands) == 5, commands  # server, 4
            os.killpg(proc.pid, signum) if signum == signal.SIGTERM else proc.kill()
            reader.start()
            reader.join(timeout=60)  # the stdout's end: no process of the session holds it any longer
            assert proc.wait(timeout=60) == returncode and not reader.is_alive(), "".join(lines)
            deadline = time.monotonic() + 30  # torch's watchdog checks the worker's parent every 5 s
            while any(map(running, session)) and time.monotonic() < deadline:
                time.sleep(0.5)
            assert not any(map(running, session)), [pid for pid in session if running(pid)]
        finally:
            for pid in [proc.pid] + [pid for pid in session if running(pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if signum == signal.SIGTERM:
            assert any(STOP_LINE.match(line) for line in lines) and (tmp_path / "SIGTERM" / "checkpoint.pth").exists()


def test_seed_is_deterministic_with_loader_workers(tiny_data, tmp_path):
    """2 epochs with 2 loader workers train the weights no workers do (the same crops and flips, the
    second epoch's too). The workers are forked by multiprocessing's fork server (never a fork of the threaded
    trainer: CPython gh-112275), once per run: 2 for training and 2 for evaluation, not 4 an epoch."""
    workers = tmp_path / "workers"
    workers.mkdir()

    def digest(seed, name, loader_workers):
        args = ["--data", tiny_data, "-b", 32, "--epochs", 2, "--image-size", 32, "-j", loader_workers, "-p", 1000,
                "--seed", seed, "--output-dir", tmp_path / name]
        env = {"COOKBOOK_RECORD_WORKERS": str(workers)}
        # -j 0 forked (conftest.run): equal to the fresh interpreter with workers, so also a forked run's training.
        return run(args, "forked" if loader_workers == 0 else "python", env=env).check().done["state_sha256"]
    without_workers = digest(7, "b", 0)
    assert digest(7, "a", 2) == without_workers
    started = [path.read_text() for path in workers.iterdir()]
    assert len(started) == 4 and all("from multiprocessing.forkserver import main" in s for s in started), started
    assert digest(8, "c", 0) != without_workers, "a different seed must give different weights"


# ---- helpers ----

def test_shard_batches_count_each_sample_once_in_the_same_batch():
    data = list(range(37))
    single = distributed.shard_batches(len(data), 1, 0, batch_size=8)
    for world in (1, 2, 3, 4, 5):
        batches = [b for r in range(world) for b in distributed.shard_batches(len(data), world, r, batch_size=8)]
        assert sorted(batches) == single and sorted(i for b in batches for i in b) == data


def test_lr_schedule_warmup_then_steps():
    args = distributed.argument_parser().parse_args(["--warmup-epochs", "2", "--lr-step-size", "3",
                                                     "--lr-gamma", "0.1"])
    factor = distributed.lr_schedule(args, steps_per_epoch=10)
    assert factor(0) == pytest.approx(1 / 20) and factor(9) == pytest.approx(0.5)
    assert factor(19) == factor(29) == 1.0
    assert factor(30) == pytest.approx(0.1) and factor(60) == pytest.approx(0.01)


# ---- demo data ----

def test_demo_run_learns(tmp_path):
    data = make_data(tmp_path / "digits", 1436, 361)
    assert sorted(p.name for p in (data / "val").iterdir()) == [str(c) for c in range(10)]
    # README's demo command, cut from 5 epochs (96% measured) to 2 with the lr decay after the first.
    r = run(["--data", data, "-b", 32, "--lr", 0.1, "--epochs", 2, "--lr-step-size", 1, "--min-crop-scale", 0.35,
             "--output-dir", tmp_path / "ckpt"] + FAST + RESNET18, launcher="torchrun", nproc=2).check()
    assert r.summaries[-1]["val_count"] == 361
    assert r.done["best_acc1"] >= 50, "10 classes: chance is 10%"
    assert "data stall" not in r.stdout, "resnet18 on 32 px PNGs is model-bound (about 5% data wait measured)"


def test_data_stall_is_reported(tmp_path):
    """A really input-bound run: ImageNet-sized JPEGs decoded in the training process (-j 0) for a tiny
    model at 32 px (66% data wait measured). After its epoch, one line says so and what to try."""
    subprocess.run([PYTHON, REPO / "tools" / "make_imagenet_like.py", "--out", tmp_path / "d", "--train-count", "64",
                    "--val-count", "8", "--classes", "2"], check=True, capture_output=True)
    r = run(["--data", tmp_path / "d", "-b", 32, "--epochs", 1, "--output-dir", tmp_path / "ckpt", "--profile", "2:2"]
            + FAST + ["-a", "mobilenet_v3_small"], "forked").check()
    # Profiled: one process has no communication at all, and the trace sees the loader's wait too.
    (p,) = profiles(r, tmp_path / "ckpt", 1, 1)
    assert p["comm_exposed"] == p["comm_overlapped"] == 0 and p["data_wait"] > 0.2 * p["step"], p
    assert "=> communication: 0 bytes (0.0 MiB) sent by each rank per optimizer step (one process)" in r.stdout
    stalls = [line for line in r.stdout.splitlines() if line.startswith("=> data stall")]
    assert len(stalls) == 1 and r.summaries[0]["data_wait"] > 0.2, r.stdout
    assert "-j, now 0" in stalls[0] and "--data-backend dali" in stalls[0] and "resize_dataset.py" in stalls[0]


def test_metrics_tensorboard_writes_a_runs_event_files_or_says_what_to_install(tiny_data, tmp_path):
    """tools/metrics_tensorboard.py on a run's --output-dir: event files beside metrics.jsonl where
    tensorboard is installed, else one error line naming the pip command."""
    trained = run(["--data", tiny_data, "-b", 32, "--epochs", 1, "--output-dir", tmp_path] + FAST).check()
    r = subprocess.run([PYTHON, REPO / "tools" / "metrics_tensorboard.py", tmp_path], capture_output=True, text=True)
    if importlib.util.find_spec("tensorboard") is None:
        assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith(
            "error: tools/metrics_tensorboard.py needs the tensorboard package: pip install"), r.stderr
    else:
        assert r.returncode == 0, r.stderr
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
        (val,) = events.Scalars("summary/val_acc1")  # at the global step of epoch 0's end: 3 steps of 32
        assert (val.step, val.value) == (3, pytest.approx(trained.summaries[0]["val_acc1"]))
        assert [s.step for s in events.Scalars("train/loss")] == [3]


def test_divergence_stops_at_the_next_progress_line(tiny_data, checkpoint, tmp_path):
    """An lr far too high from the second epoch on: the loss turns non-finite, and the run stops at
    the progress line after it with one line naming the epoch and step and what to try. It writes no
    checkpoint of non-finite weights (not even one --save-every asks for), so model_best.pth stays the
    last good one. (A resumed run takes its lr from the checkpoint: the test raises it there.)"""
    args = ["--data", tiny_data, "-b", 32, "--output-dir", tmp_path] + FAST
    shutil.copytree(checkpoint.parent, tmp_path, dirs_exist_ok=True)  # a run of the first epoch
    best = (tmp_path / "model_best.pth").read_bytes()
    checkpoint = load_state(tmp_path / "checkpoint.pth")
    checkpoint["scheduler"]["base_lrs"] = [1e30]
    checkpoint["optimizer"]["param_groups"][0]["lr"] = 1e30
    torch.save(checkpoint, tmp_path / "checkpoint-epoch1.pth")  # the one --resume auto takes
    (tmp_path / "checkpoint-epoch1.pth.sha256").unlink()
    r = run(args + ["--epochs", 2, "--resume", "auto", "-p", 1, "--save-every", 1], "torchrun", 2)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode != 0 and len(errors) == 1, r.stderr
    assert re.match(r"error: the training loss is (nan|inf) in epoch 1 at step 2: the training diverged", errors[0])
    assert "lower --lr (the lr was 1e+30)" in errors[0]
    assert (tmp_path / "model_best.pth").read_bytes() == best
    state = load_state(tmp_path / "checkpoint.pth")["state_dict"]
    assert all(t.isfinite().all() for t in state.values() if t.is_floating_point())


# ---- bad input: one clear line, non-zero exit, no traceback ----

BAD = ["missing data dir", "no data at all", "empty data dir", "val class missing", "empty class folder",
       "symlink loop", "unknown arch", "image too small for the arch", "batch below world size",
       "one image per process", "sync-bn on cpu", "other arch checkpoint",
       "truncated checkpoint", "code in checkpoint", "no such checkpoint", "unwritable output dir",
       "metrics.jsonl a directory", "train set below one batch", "negative --save-every",
       "mid-epoch checkpoint, other -b", "resumed with another recipe", "--profile not a range", "--profile with no warm-up",
       "--profile past the run"]


@pytest.mark.parametrize("case", BAD)
def test_bad_input(case, tiny_data, checkpoint, tmp_path):
    args, launcher, message = bad_inputs(tiny_data, checkpoint, tmp_path)[case]
    checkpoint_before = checkpoint.read_bytes()
    out = tmp_path / "out"
    # One process: forked with torch imported (the next test shows it the same as a plain python start).
    r = run(["--output-dir", out] + FAST + args, launcher="forked" if launcher == "python" else launcher,
            nproc=2 if launcher == "torchrun" else 1)
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], r.stderr
    # torchrun adds its own failure report after the worker's line; the worker itself printed no traceback, before
    # its line or, in one process, after it.
    assert "Traceback" not in r.stdout + (r.stderr.split("error:")[0] if launcher == "torchrun" else r.stderr)
    assert not (tmp_path / "code-ran").exists(), "loading a checkpoint ran pickled code"
    assert checkpoint.read_bytes() == checkpoint_before
    assert not list(out.glob("*.pth")) and not list(out.glob(".*.tmp"))


def test_a_forked_run_ends_as_a_python_run(tiny_data, checkpoint, tmp_path):
    """conftest's "forked" runs (tests/zygote.py) give what `python distributed.py` gives: the same output
    and exit status, for an error line, an uncaught exception's traceback, and an exit from argparse. (The
    weights they train: test_seed_is_deterministic_with_loader_workers.)"""
    fault = tmp_path / "fault"
    fault.write_text("raise RuntimeError('a bug')\n")
    for args, script in [(["--data", tmp_path / "nope"], "distributed.py"), ([], fault),
                         (["--epochs", "-1"], "distributed.py")]:
        python, forked = (run(args, launcher, script=script) for launcher in ("python", "forked"))
        assert python.returncode in (1, 2) and (forked.returncode, forked.stdout) == (python.returncode, python.stdout)
        if script == fault:  # the traceback names the frames above the script too: the zygote's and runpy's
            assert forked.stderr.endswith('fault", line 1, in <module>\n' + python.stderr.split("<module>\n")[-1])
        else:
            assert forked.stderr == python.stderr and forked.stderr.count("\n") == 1


@pytest.mark.parametrize("script", ["dataparallel.py", "multiprocessing_distributed.py", "apex_distributed.py",
                                    "horovod_distributed.py", "distributed_slurm_main.py", "fsdp_distributed.py",
                                    "deepspeed_distributed.py"])
def test_a_forked_run_of_each_script_ends_as_a_python_run(script, tmp_path):
    """The other scripts' forked runs (their bad-input cases, test_methods.py's, test_fsdp.py's, test_deepspeed.py's)
    stand for `python X.py` too: a missing data dir gives the same stdout, stderr (one error line) and exit status.
    mp.spawn's one process, as test_methods.py forks it: with 2, whether the launcher logs its SIGTERM to the one
    that has not failed yet is a race."""
    args = ["--data", tmp_path / "nope", "--output-dir", tmp_path / "out"] + FAST
    args += ["--nprocs", 1] if script == "multiprocessing_distributed.py" else []
    python, forked = (run(args, launcher, script=script) for launcher in ("python", "forked"))
    assert python.returncode == 2 and python.stderr.startswith("error:") and python.stderr.count("\n") == 1, \
        python.stdout + python.stderr
    assert (forked.returncode, forked.stdout, forked.stderr) == (python.returncode, python.stdout, python.stderr)


# (launcher, the rank that meets the bad image): (its script, split, image, loader, extra flags). Every
# ending, rank 0 failing (the store host, without torchrun) and rank 1; each backend's check of each split.
BAD_IMAGE = {
    ("torchrun", 0): ("distributed.py", "train", "bomb", "torch", []),
    ("torchrun", 1): ("distributed.py", "train", "truncated", "dali", []),  # DALI fails to decode; PIL names it
    ("spawn", 0): ("multiprocessing_distributed.py", "val", "bomb", "dali", ["-e"]),
    ("spawn", 1): ("multiprocessing_distributed.py", "val", "truncated", "torch", ["-e", "-j", 1]),  # in a worker
    ("horovodrun", 0): ("horovod_distributed.py", "train", "bomb", "torch", []),
    ("horovodrun", 1): ("horovod_distributed.py", "train", "bomb", "torch", []),
    ("deepspeed", 0): ("deepspeed_distributed.py", "train", "bomb", "torch", []),
    ("deepspeed", 1): ("deepspeed_distributed.py", "train", "bomb", "torch", []),
}

ENGINES = {"horovodrun": ("horovod.torch", "bash scripts/install_horovod.sh"),
           "deepspeed": ("deepspeed", "bash scripts/install.sh --tests", {"DS_ACCELERATOR": "cpu"}),
           "dali": ("nvidia.dali", "bash scripts/install.sh --tests")}


@pytest.mark.parametrize("launcher,rank", BAD_IMAGE)
def test_a_bad_image_is_one_error_line_from_the_rank_that_reads_it(launcher, rank, tiny_data, tmp_path):
    """An image only `rank` reads, in its first batch: it prints the one error line, naming the file, and
    the rank it stopped at most a line that is no error line (the peer's own says why); no rank prints a
    traceback, whatever the launcher (torchrun and horovodrun add a report and a traceback of their own)."""
    script, split, kind, backend, flags = BAD_IMAGE[launcher, rank]
    for engine in (launcher, backend):
        if engine in ENGINES:
            require_engine(*ENGINES[engine])
    data = shutil.copytree(tiny_data, tmp_path / "data")
    images = [path for path, _ in torchvision.datasets.ImageFolder(data / split).samples]
    if split == "train":  # the first image of the rank's share of epoch 0, as the scripts shuffle with --seed 0
        sampler = distributed.ResumableSampler(images, 2, rank, seed=0, drop_last=True)
        sampler.set_epoch(0)
        bad = images[next(iter(sampler))[1]]
    else:  # val batches of 8 dealt out in turn: the rank's first
        bad = images[8 * rank]
    if kind == "bomb":  # 45 bytes whose header claims 1.6 G pixels: PIL refuses it (DecompressionBombError)
        Path(bad).write_bytes(png_header(40000, 40000))
        reason = "Image size (1600000000 pixels) exceeds limit"
    else:  # a PNG cut short: its header reads, its pixels not
        Path(bad).write_bytes(Path(bad).read_bytes()[:100])
        reason = "image file is truncated"
    r = run(["--data", data, "-b", 32, "--epochs", 1, "--val-batch-size", 8, "--data-backend", backend,
             "--output-dir", tmp_path / "out"] + FAST + flags, launcher, 2, script)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode != 0 and len(errors) == 1, r.stderr
    assert errors[0].startswith(f"error: cannot read image '{bad}' ({reason}"), errors[0]
    assert len(re.findall("stopped: another rank exited", r.stderr)) <= 1, r.stderr
    assert f'{script}", line' not in r.stdout + r.stderr, r.stderr  # no frame of the script, in any report
    launchers_own = re.findall(r"Traceback \(most recent call last\):\n(.*)", r.stdout + r.stderr)
    assert all(f"bin/{launcher}\"" in line for line in launchers_own), r.stderr


def test_an_error_every_rank_meets_is_printed_by_rank_0_and_the_others_wait_for_it():
    """The others exit only on the launcher's stop signal (after rank 0 exited) or after 10 s: exiting
    first, one had horovodrun kill a rank 0 still importing torch, and the error line was lost (CI)."""
    code = ("import sys, time, distributed as d; d.stop_on_signals(); print('ready', flush=True); "
            "start = time.monotonic(); d.report(d.UsageError('bad')); print(time.monotonic() - start, flush=True); "
            "sys.exit(2)")
    for rank in (0, 1):
        p = subprocess.Popen([PYTHON, "-c", code], cwd=REPO, env={**os.environ, "RANK": str(rank)},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert p.stdout.readline() == "ready\n"
        if rank:
            with pytest.raises(subprocess.TimeoutExpired):  # still waiting, its line left to rank 0
                p.wait(timeout=2)
            p.send_signal(signal.SIGTERM)
        # report() returned on the signal, well before its 10 s deadline (timed in the process: its exit, torch's
        # teardown, took over 7 s on a loaded machine).
        assert float(p.stdout.readline()) < 8
        assert p.wait(timeout=60) == 2
        assert p.stderr.read() == ("" if rank else "error: bad\n")


def test_a_full_disk_at_save_is_one_line_and_keeps_the_last_checkpoint(tiny_data, checkpoint, tmp_path):
    """A disk that fills mid-save (as CI's did): torch.save's own RuntimeError hides the OSError. Here
    RLIMIT_FSIZE makes every write past 100 KB fail (EFBIG), a real failed write in a real run."""
    out = tmp_path / "out"
    out.mkdir()
    shutil.copyfile(checkpoint, out / "checkpoint.pth")
    r = run(["--data", tiny_data, "-b", 32, "--epochs", 2, "--resume", "auto", "--output-dir", out] + FAST,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (10**5, 10**5)))
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"cannot write a checkpoint in '{out}': File too large" in errors[0]
    assert (out / "checkpoint.pth").read_bytes() == checkpoint.read_bytes()
    assert not list(out.glob(".*.tmp"))


def load_image_with_torchvision(path):
    """torchvision.io's decoders, the default where TorchCodec is not installed: deprecated by torchvision 0.29,
    which says so (an error in this suite: pytest.ini) on each call."""
    with pytest.warns(DeprecationWarning, match="TorchCodec"):
        return distributed.load_image(path, "torchvision")


def test_without_torchcodec_the_default_decoder_is_torchvisions(monkeypatch):
    """A site's torch without TorchCodec (None in sys.modules makes the import fail as if absent): torchvision.io by
    default, and --decoder torchcodec is one error line saying what to install."""
    monkeypatch.setitem(sys.modules, "torchcodec.decoders", None)
    assert distributed.pick_decoder(None) == "torchvision" and distributed.pick_decoder("pil") == "pil"
    with pytest.raises(distributed.UsageError, match=f"--decoder torchcodec: TorchCodec cannot be imported .*: pip "
                       f"install the torchcodec for torch {re.escape(torch.__version__)}, or pass --decoder torchvision"):
        distributed.pick_decoder("torchcodec")


def test_odd_images_decode_as_with_pil_and_a_bomb_is_refused_before_decoding(tmp_path):
    """What ImageNet holds besides RGB JPEGs (CMYK and grey JPEGs, a PNG named .JPEG, palette PNGs) gives the
    default decoder (TorchCodec's) PIL's pixels, and torchvision.io's, which it replaced; a 16-bit PNG is scaled to
    8 bits alike by both (PIL's loader saturates it); other formats go to PIL; EXIF rotation is applied by none.
    A 600-byte JPEG whose header claims 20000 x 20000 pixels is refused by PIL's bomb rule in one error naming it,
    before anything is decoded."""
    assert distributed.pick_decoder(None) == "torchcodec"
    rgb = Image.fromarray(numpy.random.default_rng(0).integers(0, 256, (40, 50, 3), dtype=numpy.uint8))
    rotated = Image.Exif()
    rotated[0x0112] = 6  # EXIF orientation: rotate 90 degrees to display
    files = {"cmyk.JPEG": (rgb.convert("CMYK"), "JPEG", {}), "grey.JPEG": (rgb.convert("L"), "JPEG", {}),
             "png.JPEG": (rgb, "PNG", {}), "palette.png": (rgb.convert("P"), "PNG", {"transparency": 3}),
             "exif.JPEG": (rgb, "JPEG", {"exif": rotated}), "rgb.JPEG": (rgb, "JPEG", {"quality": 90}),
             "bmp.JPEG": (rgb, "BMP", {})}
    pixels = lambda decoded: decoded if torch.is_tensor(decoded) else transforms.functional.pil_to_tensor(decoded)
    for name, (image, kind, options) in files.items():
        image.save(tmp_path / name, kind, **options)
        decoded, with_pil = distributed.load_image(tmp_path / name), distributed.load_image(tmp_path / name, "pil")
        assert with_pil.size == (50, 40) and torch.equal(pixels(with_pil), pixels(decoded)), name
        if kind != "BMP":
            assert torch.equal(pixels(decoded), load_image_with_torchvision(tmp_path / name)), name
    wide = numpy.random.default_rng(0).integers(0, 65536, (40, 50), dtype=numpy.uint16)
    Image.fromarray(wide).save(tmp_path / "16-bit.png")
    for decoded in (distributed.load_image(tmp_path / "16-bit.png"), load_image_with_torchvision(tmp_path / "16-bit.png")):
        assert decoded.dtype == torch.uint8 and torch.equal(decoded, torch.from_numpy(wide >> 8).byte().expand(3, -1, -1))
    bomb = bytearray((tmp_path / "grey.JPEG").read_bytes())
    sof = bomb.index(b"\xff\xc0")  # the frame header: precision, then height and width
    bomb[sof + 5:sof + 9] = struct.pack(">HH", 20000, 20000)
    (tmp_path / "bomb.JPEG").write_bytes(bomb)
    with pytest.raises(distributed.LocalError, match=f"cannot read image '{tmp_path / 'bomb.JPEG'}' \\(Image size "
                       r"\(400000000 pixels\) exceeds limit"):
        distributed.load_image(tmp_path / "bomb.JPEG")
    # Before decoding: torchvision would first fill a 1.2 GB tensor with grey (1.4 s measured), then fail.
    # (VmHWM: this process's peak memory, which ru_maxrss is not: exec keeps the peak of the forked pytest.)
    grown = subprocess.run([PYTHON, "-c", "import re, distributed\n"
                            "peak = lambda: int(re.search(r'VmHWM:\\s*(\\d+)', open('/proc/self/status').read())[1])\n"
                            f"before = peak()\ntry:\n    distributed.load_image({str(tmp_path / 'bomb.JPEG')!r})\n"
                            "except distributed.LocalError:\n    print((peak() - before) // 1024)"],
                           cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert int(grown) < 100, f"{grown} MB"
