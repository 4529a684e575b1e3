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
.venv/bin/pip install --quiet --disable-pip-version-check -r requirements.txt -r requirements-dev.txt

if (( tests )); then
    missing=()
    for pkg in slurmctld slurmd slurm-client munge cmake g++ make iproute2; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
    done
    if (( ${#missing[@]} )); then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
    bash scripts/install_horovod.sh .venv/bin/python
    # DeepSpeed from PyPI: DS_BUILD_OPS=0 compiles none of its C++ ops (deepspeed_distributed.py uses none).
    # Its setup.py imports torch, so no build isolation (that would fetch a torch of its own to build with),
    # and requirements.txt as constraints, so pip keeps the pinned torch and torchvision. 22 s here.
    if ! .venv/bin/python -c 'import deepspeed, sys; sys.exit(deepspeed.__version__ != "0.19.8")' 2>/dev/null; then
        DS_BUILD_OPS=0 .venv/bin/pip install --quiet --disable-pip-version-check --no-build-isolation \
            -c requirements.txt deepspeed==0.19.8
    fi
    # TensorBoard for tools/metrics_tensorboard.py (not needed by the trainers; the tests write its event files).
    if ! .venv/bin/python -c 'import tensorboard, sys; sys.exit(tensorboard.__version__ != "2.21.0")' 2>/dev/null; then
        .venv/bin/pip install --quiet --disable-pip-version-check -c requirements.txt tensorboard==2.21.0
    fi
    # NVIDIA DALI for --data-backend dali, the build for torch's CUDA (13; it also runs without a GPU):
    # over 500 MB with nvJPEG and nvImageCodec, so only here, not in the default install.
    if ! .venv/bin/python -c 'import nvidia.dali, sys; sys.exit(nvidia.dali.__version__ != "2.4.0")' 2>/dev/null; then
        .venv/bin/pip install --quiet --disable-pip-version-check -c requirements.txt nvidia-dali-cuda130==2.4.0
    fi
fi
echo "install.sh: done ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
