"""distributed.py across two real network hosts: two network namespaces joined by a veth pair
(scripts/netns_hosts.sh), one torchrun (or legacy launcher) per host. A machine where the namespaces
cannot be created fails these tests."""
import subprocess
from pathlib import Path

import pytest

from conftest import EQUIV, PYTHON, REPO, Result, environment, free_port, run

NETNS = ["bash", str(REPO / "scripts" / "netns_hosts.sh")]
HOSTS = [("cbhost0", "cb0", "10.77.0.1"), ("cbhost1", "cb1", "10.77.0.2")]
MASTER = HOSTS[0][2]
TORCHRUN = str(Path(PYTHON).parent / "torchrun")
# One pair of network hosts on this machine (its fixture creates and deletes them): pytest-xdist runs these tests
# on one worker.
pytestmark = pytest.mark.xdist_group("netns")


@pytest.fixture(scope="module", autouse=True)
def hosts():
    up = subprocess.run(NETNS + ["up"], capture_output=True, text=True)
    if up.returncode != 0:
        pytest.fail(f"cannot create the two network hosts:\n{up.stdout}{up.stderr}")
    yield
    subprocess.run(NETNS + ["down"], check=True)


@pytest.fixture(scope="module")
def one_host_digest(tmp_path_factory):
    """The final weights of the same 2-process run on one host."""
    r = run(["--output-dir", tmp_path_factory.mktemp("one-host")] + EQUIV, launcher="torchrun", nproc=2).check()
    return r.done["state_sha256"]


def launcher_on(node, port, rdzv):
    """Node `node`'s launch command (one process per host) for each way of meeting the other host."""
    addr = HOSTS[node][2]
    if rdzv == "static":
        return [TORCHRUN, "--nnodes=2", f"--node-rank={node}", f"--master-addr={MASTER}", f"--master-port={port}",
                "--nproc-per-node=1"]
    if rdzv == "c10d":
        # is_host: node 0 hosts the store on its veth address; --local-addr: workers are told the
        # veth address, not "localhost" (the note in ../shared/notes/multinode-and-faults.md).
        host = ["--rdzv-conf=is_host=1"] if node == 0 else ["--rdzv-conf=is_host=0"]
        return [TORCHRUN, "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", "--rdzv-id=cookbook",
                f"--rdzv-endpoint={MASTER}:{port}", f"--local-addr={addr}"] + host
    return [PYTHON, "-m", "torch.distributed.launch", "--nnodes=2", f"--node_rank={node}", f"--master_addr={MASTER}",
            f"--master_port={port}", "--nproc_per_node=1"]


@pytest.mark.parametrize("rdzv", ["static", "c10d", "legacy launcher"])
def test_two_hosts_equal_one_host(rdzv, tmp_path, one_host_digest):
    port = free_port()
    procs = []
    for node, (namespace, iface, _) in enumerate(HOSTS):
        # GLOO_SOCKET_IFNAME: this machine's host name resolves to 127.0.0.1, which gloo would
        # advertise to the other host; the veth interface makes it advertise the veth address.
        command = (["ip", "netns", "exec", namespace, "env", f"GLOO_SOCKET_IFNAME={iface}"] + launcher_on(node, port, rdzv)
                   + [str(REPO / "distributed.py"), "--output-dir", str(tmp_path / f"node{node}")] + [str(a) for a in EQUIV])
        procs.append(subprocess.Popen(command, cwd=REPO, env=environment(), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    try:
        outputs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    node0, node1 = (Result.parse(p.returncode, out, err).check() for p, (out, err) in zip(procs, outputs))
    assert node0.done["ranks_identical"] and node0.done["state_sha256"] == one_host_digest
    assert node0.summaries[-1]["world_size"] == 2 and node1.done is None, "rank 0 alone reports"
    assert (tmp_path / "node0" / "checkpoint.pth").is_file() and not (tmp_path / "node1").exists(), \
        "global rank 0 alone writes checkpoints"
