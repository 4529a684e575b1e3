#!/usr/bin/env bash
# Installs Horovod 0.28.1 (PyTorch + Gloo, no MPI) into the project's virtualenv, compiled against
# the torch already installed there, then checks the build and runs a 2-rank Gloo allreduce.
#
#   bash scripts/install_horovod.sh [PYTHON]
#
# PYTHON defaults to <repo>/.venv/bin/python; torch must already be installed in it.
# Horovod's compiled extension is tied to the exact torch build, so the first run compiles a wheel
# (minutes) and caches it under
#   ${HOROVOD_WHEEL_CACHE:-~/.cache/pytorch-distributed-cookbook/horovod}/torch-<version>-<cpu|cuda<toolkit version>-nccl>-<python tag>/
# Later runs with the same key just install that wheel (seconds). Delete the directory to force a
# rebuild. Needs cmake >= 3.21, g++ and make (Debian 12: apt-get install cmake g++ make).
set -euo pipefail

HOROVOD_VERSION=0.28.1
start=$SECONDS
script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo_root=$(dirname "$script_dir")
python=${1:-$repo_root/.venv/bin/python}

die() { echo "install_horovod: error: $*" >&2; exit 1; }

if ! torch_version=$("$python" -c 'import torch; print(torch.__version__)' 2>/dev/null); then
    die "torch is not importable by $python; install requirements first:" \
        "python3 -m venv .venv && .venv/bin/pip install torch==2.14.1 torchvision==0.29.1"
fi

# CUDA build: on GPUs, a Horovod without CUDA/NCCL all-reduces CUDA gradients through a CPU copy it
# starts without waiting for backward (mpi_ops_v2.cc, DoAllreduceCudaOnCPU: the ready event is
# recorded only #if HAVE_GPU), so it trains on stale gradients. So find a CUDA toolkit of torch's
# CUDA major (its cudart is what Horovod links), where the system or pip (nvidia-cuda-nvcc: nvcc under
# site-packages/nvidia/cuNN/) put one, and refuse to build CPU-only beside visible GPUs unless
# HOROVOD_CPU_ONLY=1 asks for it. Horovod guesses the toolkit root from nvcc's location
# (/usr/local/bin/nvcc gives /usr/local: "Could NOT find CUDAToolkit"), so it is always named.
torch_cuda=$("$python" -c 'import torch; print(torch.version.cuda or "")')
toolkit="" toolkit_version="" skipped=()
if [[ -n $torch_cuda && ${HOROVOD_CPU_ONLY:-0} != 1 ]]; then
    site=$("$python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
    nvcc_on_path=$(command -v nvcc || true)
    shopt -s nullglob
    for root in ${HOROVOD_CUDA_HOME:-} ${CUDA_HOME:-} "$site"/nvidia/cu[0-9]* /usr/local/cuda /usr/local/cuda-[0-9]* \
                ${nvcc_on_path:+"$(dirname "$(dirname "$(readlink -f "$nvcc_on_path")")")"}; do
        [[ -x $root/bin/nvcc && -f $root/include/cuda_runtime.h ]] || continue
        version=$("$root/bin/nvcc" --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p')
        if [[ ${version%%.*} == "${torch_cuda%%.*}" ]]; then
            toolkit=$root toolkit_version=$version
            break
        fi
        skipped+=("$root (CUDA ${version:-?})")
    done
    shopt -u nullglob
fi
if [[ -n $toolkit ]]; then
    variant=cuda$toolkit_version-nccl
    export CUDA_HOME=$toolkit HOROVOD_CUDA_HOME=$toolkit
    # Horovod's CUDA kernels for the GPU generations this torch build has kernels for (its
    # get_arch_list: sm_75 ... sm_120 for the pinned cu130 wheel) that this nvcc can compile
    # (--list-gpu-arch), so Horovod runs wherever torch does and an older nvcc does not fail the build.
    HOROVOD_BUILD_CUDA_CC_LIST=$("$python" -c '
import sys, torch
known = {a.split("_", 1)[1] for a in sys.argv[1].split()}
print(",".join(a[3:] for a in torch.cuda.get_arch_list() if a.startswith("sm_") and a[3:] in known))' \
        "$("$toolkit/bin/nvcc" --list-gpu-arch)")
    [[ -n $HOROVOD_BUILD_CUDA_CC_LIST ]] || die "the CUDA $toolkit_version toolkit in $toolkit compiles none of" \
        "torch's GPU archs ($("$python" -c 'import torch; print(*torch.cuda.get_arch_list())')): install a newer one"
    export HOROVOD_BUILD_CUDA_CC_LIST
elif [[ -n $torch_cuda && ${HOROVOD_CPU_ONLY:-0} != 1 ]] && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    die "GPUs are visible (nvidia-smi -L) but no CUDA ${torch_cuda%%.*}.x toolkit (nvcc + headers, the major of" \
        "torch's CUDA $torch_cuda) was found${skipped[*]:+ (only: ${skipped[*]})}: pip install" \
        "nvidia-cuda-nvcc==${torch_cuda}.* or set CUDA_HOME to one; HOROVOD_CPU_ONLY=1 builds a CPU-only Horovod," \
        "which cannot train on the GPUs"
else
    variant=cpu
fi

# Already installed and built for this very torch (and with NCCL where it should be)? metadata.json
# records the torch version Horovod was compiled against; importing horovod.torch loads the
# extension (fails on an ABI mismatch).
if "$python" - "$HOROVOD_VERSION" "$variant" 2>/dev/null <<'EOF'
import json, os, sys
import torch, horovod
import horovod.torch as hvd
with open(os.path.join(os.path.dirname(horovod.__file__), "metadata.json")) as f:
    built_for = json.load(f).get("pytorch")
gpu_ok = (hvd.cuda_built() and hvd.nccl_built()) or sys.argv[2] == "cpu"
sys.exit(not (horovod.__version__ == sys.argv[1] and built_for == torch.__version__ and hvd.gloo_built() and gpu_ok))
EOF
then
    echo "horovod $HOROVOD_VERSION already installed for torch $torch_version ($variant${toolkit:+, CUDA toolkit $toolkit}) in $python; nothing to do"
    exit 0
fi

# horovod's runtime deps (setup.py's install_requires; cffi because the PyTorch extension is on).
# They must be present before the build too: without build isolation setup.py's setup_requires
# would otherwise try to fetch them itself.
"$python" -m pip install --quiet cloudpickle psutil pyyaml packaging cffi

py_tag=$("$python" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
cache_dir=${HOROVOD_WHEEL_CACHE:-$HOME/.cache/pytorch-distributed-cookbook/horovod}/torch-$torch_version-$variant-$py_tag
shopt -s nullglob
cached=("$cache_dir"/horovod-"$HOROVOD_VERSION"-*.whl)

if (( ${#cached[@]} )); then
    wheel=${cached[0]}
    echo "using cached wheel $wheel"
else
    cmake_version=$(cmake --version 2>/dev/null | sed -n 's/^cmake version \([0-9.]*\).*/\1/p')
    # CMake reads the CMAKE_TOOLCHAIN_FILE environment variable only from 3.21 on; Horovod would
    # also pip-install its own CMake 3.13 if the one on PATH were older than that.
    if [[ -z $cmake_version ]] || ! printf '3.21\n%s\n' "$cmake_version" | sort -V -C; then
        die "cmake >= 3.21 is required to build Horovod (found: ${cmake_version:-none}); apt-get install cmake"
    fi
    command -v g++ >/dev/null && command -v make >/dev/null || die "g++ and make are required; apt-get install g++ make"

    echo "building horovod $HOROVOD_VERSION for torch $torch_version ($variant); this takes several minutes"
    # Only the frameworks we use; a framework that is asked for but not found fails the build
    # instead of being silently left out.
    export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
    # Gloo is bundled with Horovod and is all horovodrun --gloo needs: no MPI to install.
    export HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_CPU_OPERATIONS=gloo
    # torch 2.14's headers need C++20 while Horovod's CMake pins C++14; see horovod-cxx20.cmake.
    export CMAKE_TOOLCHAIN_FILE=$script_dir/horovod-cxx20.cmake
    # Horovod always builds RelWithDebInfo: with its debug info the installed package is ~69 MB
    # instead of 5.7 MB. Dropping it at link time (the same as strip --strip-debug on the .so) keeps
    # the cached wheel and the installed extension small, and the wheel's RECORD hashes valid.
    export LDFLAGS="${LDFLAGS:+$LDFLAGS }-Wl,--strip-debug"
    # Without MAKEFLAGS Horovod runs make -j8 whatever the core count.
    export MAKEFLAGS=-j$(nproc)

    mkdir -p "$(dirname "$cache_dir")"
    build_dir=$(mktemp -d "$cache_dir.tmp.XXXXXX")
    trap 'rm -rf "$build_dir"' EXIT
    if [[ $variant != cpu ]]; then
        # GPU tensors all-reduced by NCCL, GPU to GPU (without it: device -> host -> Gloo -> device).
        # The torch wheel brings its NCCL (the nvidia-nccl package: header and libnccl.so.2); a link
        # named libnccl.so lets CMake find it. Linked shared, Horovod then uses the very libnccl.so.2
        # that torch has loaded.
        nccl_dir=$("$python" -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null) \
            || die "torch's NCCL (the nvidia-nccl pip package) is not importable by $python"
        mkdir "$build_dir/nccl-lib"
        ln -s "$nccl_dir/lib/libnccl.so.2" "$build_dir/nccl-lib/libnccl.so"
        export HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_LINK=SHARED \
            HOROVOD_NCCL_INCLUDE=$nccl_dir/include HOROVOD_NCCL_LIB=$build_dir/nccl-lib
    fi
    # No build isolation: the build must see the installed torch (in an isolated build env there is
    # none: "Could NOT find Pytorch").
    "$python" -m pip wheel --no-build-isolation --no-deps --no-cache-dir \
        --wheel-dir "$build_dir" "horovod==$HOROVOD_VERSION"
    # Publish the finished wheel atomically, so an interrupted or concurrent build never leaves a
    # partial wheel in the cache.
    mkdir -p "$cache_dir"
    built=("$build_dir"/horovod-"$HOROVOD_VERSION"-*.whl)
    mv "${built[0]}" "$cache_dir/"
    wheel=$cache_dir/$(basename "${built[0]}")
    echo "built $wheel in $((SECONDS - start)) s"
fi

# Deps were installed above; --no-deps keeps pip from touching anything else in the venv.
"$python" -m pip install --quiet --no-deps --force-reinstall "$wheel"

horovodrun=$("$python" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')/horovodrun
check=$("$horovodrun" --check-build) || die "horovodrun --check-build failed"
echo "$check"
grep -q '\[X\] PyTorch' <<<"$check" || die "horovodrun --check-build does not list PyTorch as available"
grep -q '\[X\] Gloo' <<<"$check" || die "horovodrun --check-build does not list Gloo as available"
if [[ $variant != cpu ]]; then
    grep -q '\[X\] NCCL' <<<"$check" || die "horovodrun --check-build does not list NCCL as available"
fi

"$python" -c 'import horovod.torch as hvd; hvd.init(); print("hvd.init() ok: rank", hvd.rank(), "of", hvd.size())' \
    || die "import horovod.torch / hvd.init() failed in $python"

"$horovodrun" -np 2 -H localhost:2 --gloo "$python" -c "
import horovod.torch as hvd, torch
hvd.init()
t = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)
assert t.item() == 3.0, t
print('ok', hvd.rank())" || die "2-rank Gloo allreduce smoke test failed"

echo "horovod $HOROVOD_VERSION installed for torch $torch_version ($variant${toolkit:+, CUDA toolkit $toolkit}) in $((SECONDS - start)) s"
