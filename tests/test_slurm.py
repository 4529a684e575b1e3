"""distributed_slurm_main.py, and scripts/slurm_train.sbatch starting apex_distributed.py with torchrun on every
node, on a real Slurm cluster: two slurmd nodes on this machine, started by scripts/slurm_cluster.sh, jobs sent
with srun and sbatch. A cluster that cannot start fails the tests."""
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import FAST, PYTHON, REPO, Result, environment, run

sys.path.insert(0, str(REPO))
import distributed_slurm_main  # noqa: E402  (the script itself, for its pure helpers)

SCRIPT = "distributed_slurm_main.py"
CLUSTER = ["bash", str(REPO / "scripts" / "slurm_cluster.sh")]
# The repo's batch script scaled down to the test cluster: 2 nodes, one task of 1 CPU on each, no GPUs.
SBATCH_SMALL = ["--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--gpus-per-node=0", "--time=10"]
ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING"}
PROGRESS = "Epoch: [0][1/3]"  # the first step's progress line
# One test cluster on this machine (its fixture starts and stops it): pytest-xdist runs these tests on one worker.
pytestmark = pytest.mark.xdist_group("slurm")


@pytest.fixture(scope="module", autouse=True)
def cluster():
    start = subprocess.run(CLUSTER + ["start", "--nodes", "2"], capture_output=True, text=True)
    if start.returncode != 0:
        pytest.fail(f"cannot start the Slurm cluster:\n{start.stdout}{start.stderr}")
    yield
    subprocess.run(CLUSTER + ["stop"], check=True, capture_output=True)


def check_training(r, world_size, launcher, epochs):
    r.check()
    assert [s["epoch"] for s in r.summaries] == list(range(epochs))
    for s in r.summaries:
        assert (s["launcher"], s["world_size"], s["device"], s["val_count"]) == (launcher, world_size, "cpu", 37)
    assert r.done["ranks_identical"] and len(r.done["state_sha256"]) == world_size
    assert r.stdout.count("Epoch: [0]") == 1, "progress must be printed by global rank 0 only"


def check_usage_error(r, message):
    assert r.returncode == 2, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    errors = [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr


# ---- srun: one task per process, and one task per node spawning the processes ----

def test_srun_one_node_two_tasks(tiny_data, tmp_path):
    r = run(["--data", tiny_data, "-b", 32, "--epochs", 2, "--output-dir", tmp_path] + FAST,
            launcher="srun", nproc=2, script=SCRIPT)
    check_training(r, world_size=2, launcher="srun", epochs=2)
    assert (tmp_path / "checkpoint.pth").is_file()


def test_srun_two_nodes_file_rendezvous(tiny_data, tmp_path):
    # An address nobody can reach: the job trains only if the ranks meet through the file.
    r = run(["--data", tiny_data, "-b", 32, "--epochs", 2, "--output-dir", tmp_path, "--dist-file",
             tmp_path / "rendezvous"] + FAST, launcher="srun-nodes", nproc=2, script=SCRIPT,
            env={"MASTER_ADDR": "unreachable.invalid"})
    check_training(r, world_size=2, launcher="srun", epochs=2)


def test_spawn_two_nodes_world_size_four(tiny_data, tmp_path):
    r = run(["--data", tiny_data, "-b", 32, "--epochs", 1, "--output-dir", tmp_path, "--nprocs-per-node", 2] + FAST,
            launcher="srun-nodes", nproc=2, script=SCRIPT)
    check_training(r, world_size=4, launcher="srun+mp.spawn", epochs=1)


# The first case fails in both tasks, before they spawn: exactly one line must come out.
@pytest.mark.parametrize("nproc,nprocs_per_node,message", [
    (2, 2, "needs one Slurm task per node, not 2 on 1 node(s): srun --ntasks-per-node=1 -n 1"),
    (1, 0, "argument --nprocs-per-node: 0 is out of range: pass a number >= 1"),
], ids=["spawn with two tasks on a node", "no processes per node"])
def test_bad_launch(tiny_data, tmp_path, nproc, nprocs_per_node, message):
    r = run(["--data", tiny_data, "-b", 32, "--output-dir", tmp_path, "--nprocs-per-node", nprocs_per_node] + FAST,
            launcher="srun", nproc=nproc, script=SCRIPT)
    check_usage_error(r, message)


@pytest.mark.parametrize("step_gpus,visible,local_id,expected", [
    ("0,1,2,3", 4, 2, ("2", "4")),  # every task sees the node's 4 GPUs: its own by local id
    ("0,1,2,3", 1, 3, ("0", "1")),  # bound (--gpus-per-task=1): it sees only its own, as GPU 0
    ("0,1", 2, 3, ("3", "4")),  # 4 tasks share 2 GPUs: LOCAL_WORLD_SIZE 4 makes pick_device refuse it
    ("", 0, 1, ("1", "4")),  # no GPUs at all: CPU processes
])
def test_local_rank_from_slurm(monkeypatch, step_gpus, visible, local_id, expected):
    """launch's local rank and processes per node, for a step of 4 tasks per node (the 2nd
    node of 3: SLURM_STEP_TASKS_PER_NODE '4(x2),1' means 4, 4 and 1 tasks), with the GPUs a task sees."""
    env = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_NNODES": "3", "SLURM_NTASKS": "9", "SLURM_PROCID": "5",
           "SLURM_LOCALID": str(local_id), "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "4(x2),1",
           "SLURM_STEP_GPUS": step_gpus, "SLURM_STEP_NODELIST": "n[1-3]"}
    monkeypatch.setattr(os, "environ", env)
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: visible)
    monkeypatch.setattr(distributed_slurm_main, "main_worker", lambda args: None)  # the environment only
    distributed_slurm_main.launch(distributed_slurm_main.argument_parser().parse_args([]))
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"]) == ("5", "9", "n1")
    assert (env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == expected


@pytest.mark.parametrize("nodelist", ["n1", "n[1-2]", "n2,n1", "gpu[08-10,12],cpu1", "r[1-2]-n[3-4]"])
def test_first_host_matches_scontrol(nodelist):
    expanded = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    assert distributed_slurm_main.first_host(nodelist) == expanded.stdout.split()[0]


# ---- sbatch: the repo's batch script: torchrun on every node, signalled, requeued ----

def sbatch(tmp, args, env=None, cwd=REPO):
    """Submit a batch job from cwd (where it runs); returns its id and the file its output goes to."""
    proc = subprocess.run(["sbatch", "--parsable", f"--output={tmp}/slurm-%j.out"] + [str(a) for a in args],
                          cwd=cwd, env=environment(env), capture_output=True, text=True, check=True)
    job = proc.stdout.strip().split(";")[0]
    return job, tmp / f"slurm-{job}.out"


def submit_training(tmp, data, script="apex_distributed.py", nproc_per_node=1, trainer_args=()):
    """scripts/slurm_train.sbatch as a user scales it down (sbatch options, knobs in the environment), submitted
    from tmp: its default OUTPUT_DIR is tmp/checkpoints/imagenet-ddp-<job id>. 4 epochs of 3 steps of the tiny
    model: a signal sent at the first step's progress line has 11 more steps to land in."""
    knobs = {"SCRIPT": str(REPO / script), "NPROC_PER_NODE": str(nproc_per_node), "DATA": str(data),
             "ARCH": "resnet_tiny", "EPOCHS": "4", "BATCH_SIZE": "32", "PYTHON": PYTHON}
    return sbatch(tmp, SBATCH_SMALL + [REPO / "scripts" / "slurm_train.sbatch"] + FAST + list(trainer_args),
                  env=knobs, cwd=tmp)


def job_state(job):
    """(state, exit code) from the controller; `sbatch --wait` polls at 2, 8, 32 s..., far too slowly."""
    info = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, check=True).stdout
    return re.search(r"JobState=(\S+)", info).group(1), int(re.search(r"ExitCode=(\d+):", info).group(1))


def wait_until(condition, what, timeout=240):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.2)


def finish(job, log):
    """Wait for a batch job to end; returns its final state and its output as a Result."""
    wait_until(lambda: job_state(job)[0] not in ACTIVE, f"job {job} to end")
    state, code = job_state(job)
    return state, Result.parse(code, log.read_text(), "")


@pytest.fixture(scope="module")
def jobs_dir(tmp_path_factory):
    """Where the apex_distributed.py jobs are submitted from, as a user submits every experiment from one place."""
    return tmp_path_factory.mktemp("jobs")


@pytest.fixture(scope="module")
def batch_training(tiny_data, jobs_dir):
    """An uninterrupted apex_distributed.py job (its Result and id), first in jobs_dir."""
    job, log = submit_training(jobs_dir, tiny_data)
    state, r = finish(job, log)
    assert state == "COMPLETED", r.stdout
    return r, job


def test_sbatch_trains_apex_over_torchrun_on_both_nodes(batch_training, jobs_dir):
    """One torchrun per node, meeting at the first (c10d), one process each: one run of world size 2."""
    r, job = batch_training
    check_training(r, world_size=2, launcher="torchrun", epochs=4)
    assert (jobs_dir / "checkpoints" / f"imagenet-ddp-{job}" / "checkpoint.pth").is_file()


def signal_and_requeue(job, log, out):
    """Slurm's warning before the time limit, mid-training: SIGUSR1 to the batch shell (what #SBATCH
    --signal=B:USR1@300 sends; here scancel --batch). The script passes it on through srun to the task on
    each node, which passes it on to its processes; they stop together after their current step, checkpoint
    it and exit 143, and the script requeues the job. The requeued run (held until its first run's credential
    expired: 11 s on the test cluster, 121 s by default) must resume from that checkpoint in `out` and
    complete. Returns its Result."""
    wait_until(lambda: PROGRESS in (log.read_text() if log.exists() else "") or job_state(job)[0] not in ACTIVE,
               "training to start")
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)
    wait_until(lambda: job_state(job)[0] in {"PENDING", "COMPLETED", "FAILED", "CANCELLED"},
               f"job {job} to requeue itself")
    assert job_state(job)[0] == "PENDING", log.read_text()
    state, r = finish(job, log)
    assert state == "COMPLETED", r.stdout
    stopped = re.search(r"=> stopped on a signal after step (\d+) of epoch (\d+)", r.stdout)
    assert stopped and re.search(rf"slurm_train\.sbatch: stopped on a signal \(trainers exited \d+[^)]*\): "
                                 rf"requeueing job {job}\n", r.stdout), r.stdout
    checkpoint = out / f"checkpoint-epoch{stopped[2]}-step{stopped[1]}.pth"
    assert f"=> loaded checkpoint '{checkpoint}' (epoch {stopped[2]}, step {stopped[1]})" in r.stdout, r.stdout
    return r


def test_signalled_job_checkpoints_requeues_itself_and_resumes_bitwise(tiny_data, jobs_dir, batch_training):
    """apex_distributed.py over torchrun: each node's torchrun passes the signal on to its process (in a session
    of its own, which Slurm's proctrack/cgroup does not signal) and waits for it; the requeued job ends bitwise
    where an uninterrupted one does. Submitted where that one was: its default OUTPUT_DIR is its own, so it
    starts fresh instead of continuing the other job's run."""
    job, log = submit_training(jobs_dir, tiny_data, trainer_args=["-p", 1])
    out = Path("checkpoints") / f"imagenet-ddp-{job}"  # relative: as the job, running in jobs_dir, names it
    r = signal_and_requeue(job, log, out)
    assert f"=> --resume auto: no checkpoint in '{out}', starting fresh" in r.stdout
    assert r.stdout.count("closing signal SIGUSR1") == 2, "each node's torchrun must pass the signal on"
    assert r.done["state_sha256"] == batch_training[0].done["state_sha256"], \
        "the requeued job must end bitwise where an uninterrupted one does"


def test_signalled_spawning_task_waits_for_its_processes_to_checkpoint(tiny_data, tmp_path):
    """SCRIPT=distributed_slurm_main.py: one task per node spawning 2 processes, no torchrun. The signal reaches
    the spawning task, which must pass it on and wait. Killed by it, the task would end the job step before its
    processes had checkpointed."""
    job, log = submit_training(tmp_path, tiny_data, "distributed_slurm_main.py", 2, ["-p", 1])
    r = signal_and_requeue(job, log, Path("checkpoints") / f"imagenet-ddp-{job}")
    assert {(s["launcher"], s["world_size"]) for s in r.summaries} == {("srun+mp.spawn", 4)}
    assert r.done["ranks_identical"] and len(r.done["state_sha256"]) == 4


def test_sbatch_refuses_a_trainer_torchrun_cannot_start(tiny_data, tmp_path):
    state, r = finish(*sbatch(tmp_path, SBATCH_SMALL + [REPO / "scripts" / "slurm_train.sbatch"],
                              env={"SCRIPT": "horovod_distributed.py"}))
    assert (state, r.returncode) == ("FAILED", 2), r.stdout
    assert "slurm_train.sbatch: error: SCRIPT=horovod_distributed.py cannot run under torchrun" in r.stdout


def test_trainer_without_launcher_in_a_step_of_two_tasks_is_refused(tiny_data, tmp_path):
    """srun -n2 python apex_distributed.py: no launcher numbers the two tasks, which would train apart."""
    r = run(["--data", tiny_data, "-b", 32, "--output-dir", tmp_path] + FAST, launcher="srun", nproc=2,
            script="apex_distributed.py")
    check_usage_error(r, "this Slurm step")


def test_batch_script_without_srun_is_refused(tiny_data, tmp_path):
    command = f"{PYTHON} {SCRIPT} --data {tiny_data} -b 32 --output-dir {tmp_path} " + " ".join(FAST)
    state, r = finish(*sbatch(tmp_path, ["--nodes=1", "--ntasks=2", "--wrap", command]))
    assert state == "FAILED"
    check_usage_error(r, "launch it with srun")
