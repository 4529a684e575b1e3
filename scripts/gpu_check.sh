#!/usr/bin/env bash
# One command for a machine with NVIDIA GPUs: is the cookbook correct here, and how fast?
#
#   bash scripts/gpu_check.sh                   # offline: the python that has torch, nothing installed
#   bash scripts/gpu_check.sh --wheels DIR      # first installs DIR's wheels (scripts/fetch_wheels.sh), offline
#   bash scripts/gpu_check.sh --install         # online: bash scripts/install.sh --tests first, then .venv's python
#   PYTHON=/path/to/python bash scripts/gpu_check.sh --skip-bench
#
# The python: --python or $PYTHON, else .venv/bin/python where it exists, else python3; it must import
# torch. Offline (the default) nothing is installed and no network is used: DeepSpeed, Horovod, DALI
# and timm are used where installed and their checks skipped where not (one line each says how to
# get it). --wheels DIR installs DIR/requirements.txt (DeepSpeed, pytest) into that python's environment
# with pip --no-index: from DIR alone, keeping what is installed. Other options go to scripts/gpu_check.py
# (--help lists them): the GPU suite (tests/test_gpu.py), then the ResNet-50 benchmark, within its
# --time-budget (450 s: under 8 minutes with the wheels' install). Report: gpu_check.md and
# gpu_check.json, rewritten as each row ends. A GPU machine sent only git's tracked files lacks what git
# ignores: send DIR along, and benchmarks/peers/ for benchmarks/vs_timm.py (docs/measurements.md).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

die() { echo "gpu_check.sh: error: $*" >&2; exit 2; }
command="bash scripts/gpu_check.sh $*" python=${PYTHON:-} wheels="" install=0 rest=()
while (( $# )); do
    case $1 in
        --offline) shift ;;  # the default, accepted to say so
        --install) install=1; shift ;;
        --wheels) wheels=${2:?--wheels needs a folder}; shift 2 ;;
        --python) python=${2:?--python needs a path}; shift 2 ;;
        -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) rest+=("$1"); shift ;;
    esac
done
if (( install )); then
    bash scripts/install.sh --tests
    python=.venv/bin/python
fi
[[ -n $python ]] || { [[ -x .venv/bin/python ]] && python=.venv/bin/python; } || python=python3
"$python" -c 'import torch, torchvision' 2>/dev/null \
    || die "$python cannot import torch and torchvision: pass --python (or PYTHON=) a python that can, or --install"
if [[ -n $wheels ]]; then
    [[ -f $wheels/requirements.txt ]] || die "--wheels $wheels has no requirements.txt: fill it with" \
        "scripts/fetch_wheels.sh $wheels on an online machine"
    # Into the python's own environment, from the folder alone: what is installed already (torch) stays.
    "$python" -m pip install --quiet --disable-pip-version-check --no-index --find-links "$wheels" \
        -r "$wheels/requirements.txt" || die "pip could not install $wheels/requirements.txt from $wheels alone"
    echo "gpu_check.sh: installed $(tr '\n' ' ' < "$wheels/requirements.txt")from $wheels (no network)"
fi
exec "$python" scripts/gpu_check.py --command "$command" "${rest[@]}"
