"""Test harness: runs the trainers as real subprocesses under real launchers (CPU, gloo, tiny images)."""
import json
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
# Flags every test run shares: 32 px digits, no loader workers unless a test asks, quiet progress.
FAST = ["--image-size", "32", "-j", "0", "-p", "1000", "--seed", "0"]


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    summaries: list = field(default_factory=list)  # one dict per SUMMARY line (rank 0, one per epoch)
    done: dict = None  # the DONE line: per-rank digests of the final model

    def check(self):
        assert self.returncode == 0, f"exit {self.returncode}\nstdout:\n{self.stdout}\nstderr:\n{self.stderr}"
        return self


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
    raise ValueError(launcher)


def run(args, launcher="python", nproc=1, script="distributed.py", env=None, timeout=300):
    """Run a trainer to completion and parse its machine-readable lines."""
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    proc = subprocess.run(launch_command(script, launcher, nproc) + [str(a) for a in args], cwd=REPO,
                          env=full_env, capture_output=True, text=True, timeout=timeout)
    if launcher == "horovodrun":  # it starts each line of rank N's output with "[N]<stdout>:" or "[N]<stderr>:"
        proc.stdout, proc.stderr = (re.sub(r"(?m)^\[\d+\]<std(?:out|err)>:", "", s) for s in (proc.stdout, proc.stderr))
    result = Result(proc.returncode, proc.stdout, proc.stderr)
    for line in proc.stdout.splitlines():
        kind, _, payload = line.partition(" ")
        if kind == "SUMMARY":
            result.summaries.append(json.loads(payload))
        elif kind == "DONE":
            result.done = json.loads(payload)
    return result


def make_data(out, train, val):
    subprocess.run([PYTHON, str(REPO / "tools" / "make_demo_data.py"), "--out", str(out),
                    "--train-count", str(train), "--val-count", str(val)], check=True, capture_output=True)
    return out


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """96 train images (3 global batches of 32) and 37 val images: 37 is divisible by neither 2, 3 nor 4."""
    return make_data(tmp_path_factory.mktemp("data") / "digits", 96, 37)


def load_state(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def max_abs_diff(a, b):
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)
