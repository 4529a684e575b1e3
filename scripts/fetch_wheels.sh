#!/usr/bin/env bash
# On an online machine (a login node), fill a folder with what the GPU check installs offline on a
# compute node with no network: bash scripts/gpu_check.sh --wheels DIR there.
#
#   bash scripts/fetch_wheels.sh DIR [--python-version 3.12] [--platform manylinux_2_28_x86_64]
#
# DIR gets: DeepSpeed 0.19.8 as a pure-Python wheel (built here with DS_BUILD_OPS=0: it compiles no op,
# so one wheel fits every CUDA), the wheels DeepSpeed, pytest and pytest-xdist (requirements-dev.txt's
# versions) need for the target's Python version and platform, except torch (the site's own is used),
# TorchCodec 0.17.0 (10 MB), the trainers' default decoder: its Linux wheel on PyPI is the CUDA 13 build
# (nvJPEG inside, for the GPU rows of benchmarks/input_pipeline.py), built for torch's stable ABI of 2.11
# on (its README's table: torch >= 2.11 from 0.12 on); and requirements.txt naming what --wheels
# installs. Also Horovod's sdist with its build's Python dependencies: it compiles against the target's
# torch and nvcc there (PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR bash scripts/install_horovod.sh PYTHON). NVIDIA
# DALI is left out: its wheel is over 500 MB. Needs a python with torch here (DeepSpeed's setup.py
# imports it): $PYTHON, else .venv/bin/python.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

die() { echo "fetch_wheels.sh: error: $*" >&2; exit 2; }
dir="" pyver=3.12 platform=manylinux_2_28_x86_64
while (( $# )); do
    case $1 in
        --python-version) pyver=${2:?}; shift 2 ;;
        --platform) platform=${2:?}; shift 2 ;;
        -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) die "unknown option '$1' (see --help)" ;;
        *) [[ -z $dir ]] || die "one folder, not '$dir' and '$1'"; dir=$1; shift ;;
    esac
done
[[ -n $dir ]] || die "name the folder to fill: bash scripts/fetch_wheels.sh DIR"
python=${PYTHON:-.venv/bin/python}
"$python" -c 'import torch' 2>/dev/null || die "$python cannot import torch (DeepSpeed's build needs it): set PYTHON"
mkdir -p "$dir"
pip=("$python" -m pip --disable-pip-version-check)
DS_BUILD_OPS=0 "${pip[@]}" wheel --quiet --no-deps --no-build-isolation -w "$dir" deepspeed==0.19.8
# DeepSpeed's requirements (its requirements.txt, torch left out) and the test runner, for the target.
target=(--only-binary=:all: --python-version "$pyver" --implementation cp --platform "$platform"
        --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"${pip[@]}" download --quiet "${target[@]}" -d "$dir" einops hjson msgpack ninja numpy packaging psutil py-cpuinfo \
    pydantic tqdm nvidia-ml-py pytest==8.4.2 pytest-xdist==3.8.0
# It needs nothing but torch (no Requires-Dist outside its "dev" extra), which the site has.
"${pip[@]}" download --quiet --no-deps "${target[@]}" -d "$dir" torchcodec==0.17.0
"${pip[@]}" download --quiet --no-deps --no-binary=:all: -d "$dir" horovod==0.28.1
"${pip[@]}" download --quiet "${target[@]}" -d "$dir" cloudpickle psutil pyyaml packaging cffi
printf '%s\n' deepspeed==0.19.8 pytest==8.4.2 pytest-xdist==3.8.0 torchcodec==0.17.0 \
    > "$dir/requirements.txt"
echo "fetch_wheels.sh: $dir holds $(ls "$dir" | wc -l) files, $(du -sh "$dir" | cut -f1), for Python $pyver on $platform"
