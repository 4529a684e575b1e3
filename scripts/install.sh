#!/usr/bin/env bash
# Creates .venv and installs what the cookbook needs. Safe to re-run: finished steps are skipped.
#
#   bash scripts/install.sh           # trainers, demo data, start.sh's chart: requirements.txt, requirements-dev.txt
#   bash scripts/install.sh --tests   # also the engines the tests start for real: the Slurm, munge and
#                                     # iproute2 Debian packages, Horovod compiled against this torch, and
#                                     # DeepSpeed, NVIDIA DALI (--data-backend dali) and TensorBoard (tools/metrics_tensorboard.py)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

tests=0
case "${1:-}" in
    "") ;;
    --tests) tests=1 ;;
    *) echo "usage: bash scripts/install.sh [--tests]" >&2; exit 2 ;;
esac

[[ -x .venv/bin/python ]] || python3 -m venv .venv

apt_job=""
if (( tests )); then
    missing=()
    for pkg in slurmctld slurmd slurm-client munge cmake g++ make iproute2; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
    done
    if (( ${#missing[@]} )); then  # beside pip's install below, with which it shares no file
        { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            "${missing[@]}" >/dev/null; } &
        apt_job=$!
    fi
fi

# pip compiles each module it installs, one after the other (40 s of torch's 100 here); compileall does it on
# every core. Before anything imports torch: a Python that may not write bytecode would compile it at each start.
# A file that does not compile is left as pip leaves it (torch ships one in Python 3.12's syntax, for its tests).
.venv/bin/pip install --quiet --disable-pip-version-check --no-compile -r requirements.txt -r requirements-dev.txt
.venv/bin/python -c 'import compileall, sysconfig; compileall.compile_dir(sysconfig.get_path("purelib"), quiet=2, workers=0)'

if (( tests )); then
    if [[ -n $apt_job ]] && ! wait "$apt_job"; then
        echo "install.sh: error: apt-get install ${missing[*]} failed (see above)" >&2
        exit 1
    fi
    bash scripts/install_horovod.sh .venv/bin/python
    # In one pip call (each costs seconds of resolving):
    # - DeepSpeed from PyPI: DS_BUILD_OPS=0 compiles none of its C++ ops (deepspeed_distributed.py uses none).
    #   Its setup.py imports torch, so no build isolation (that would fetch a torch of its own to build with),
    #   and requirements.txt as constraints, so pip keeps the pinned torch and torchvision;
    # - TensorBoard for tools/metrics_tensorboard.py (not needed by the trainers; the tests write its event files);
    # - NVIDIA DALI for --data-backend dali, the build for torch's CUDA (13; it also runs without a GPU):
    #   over 500 MB with nvJPEG and nvImageCodec, so only here, not in the default install.
    wanted=()
    for spec in deepspeed==0.19.8 tensorboard==2.21.0 nvidia-dali-cuda130==2.4.0; do
        .venv/bin/python -c 'import importlib.metadata as m, sys; n, v = sys.argv[1].split("=="); sys.exit(m.version(n) != v)' \
            "$spec" 2>/dev/null || wanted+=("$spec")
    done
    if (( ${#wanted[@]} )); then
        DS_BUILD_OPS=0 .venv/bin/pip install --quiet --disable-pip-version-check --no-build-isolation \
            -c requirements.txt "${wanted[@]}"
    fi
fi
echo "install.sh: done ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
