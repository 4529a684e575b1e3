"""statistics.sh on fixture logs, and start.sh's command lines (--dry-run)."""
import shutil
import subprocess

from conftest import REPO


def bash(*args):
    return subprocess.run(["bash", *map(str, args)], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_statistics_table_from_fixture_logs(tmp_path):
    logs = shutil.copytree(REPO / "tests" / "fixtures" / "logs", tmp_path / "logs")
    r = bash("statistics.sh", logs)
    assert r.returncode == 0, r.stderr
    rows = {line.split(" | ")[0].strip("| "): line.strip("| ").split(" | ") for line in r.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| method")}
    # Medians leave each run's first epoch out: dp (20, 22) s and (70, 66) img/s; ddp (15, 14) s and (140, 150).
    assert rows["dp"] == ["dp", "none", "1", "cpu", "3", "21.0", "68.0", "1.00", "90.5", "0.425"]
    assert rows["ddp"] == ["ddp", "torchrun", "2", "cpu", "3", "14.5", "145.0", "2.13", "96.1", "0.906"]
    assert rows["amp"][4:7] == ["1", "30.0", "55.0"], "a lone first epoch is all there is to count"
    assert "horovod" not in rows
    assert "amp: partial (no DONE line" in r.stdout
    assert "horovod: no summary line (error: global batch -b 1 must be a multiple" in r.stdout  # under horovodrun's prefix
    assert (logs / "summary.md").read_text().startswith("| method |")


def test_statistics_reports_missing_logs(tmp_path):
    assert bash("statistics.sh", tmp_path / "none").returncode == 2
    r = bash("statistics.sh", tmp_path)
    assert r.returncode == 1 and "no usable logs" in r.stdout


def test_start_dry_run_names_every_method(tmp_path):
    r = bash("start.sh", "--dry-run", "--logs", tmp_path, "--epochs", 3)
    assert r.returncode == 0, r.stderr
    for method in ("dp", "ddp", "launch", "spawn", "amp", "horovod", "slurm", "fsdp"):
        assert f"== {method}: " in r.stdout, method
    assert "torch.distributed.launch --nproc_per_node=2" in r.stdout
    assert "--epochs 3" in r.stdout and "--data data/digits" in r.stdout
    r = bash("start.sh", "--methods", "ddp,nope", "--dry-run")
    assert r.returncode == 2 and "unknown method 'nope'" in r.stderr
