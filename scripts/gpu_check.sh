#!/usr/bin/env bash
# One command for a machine with 1-8 NVIDIA GPUs: is the cookbook correct here, and how fast?
#
#   bash scripts/gpu_check.sh                  # install, GPU suite, benchmark; report in gpu_check.md
#   bash scripts/gpu_check.sh --skip-install --steps 10 --out report.md
#
# 1. bash scripts/install.sh --tests (Horovod compiled for these GPUs, DeepSpeed, the test tools);
# 2. the GPU suite, tests/test_gpu.py (its skips say why: one GPU, pre-Ampere, no Slurm, ...);
# 3. a benchmark at ImageNet shapes: ResNet-50, 224 px, synthetic images (--dummy, made on the CPU by
#    the DataLoader workers, as real images would be decoded), 64 images per GPU and step; each method
#    in float32 and in its mixed precision (apex: fp16 autocast; FSDP and DeepSpeed: bf16 on Ampere or
#    newer), on 1 GPU and on all of them. images/s of the second of 2 short epochs (the first pays
#    for start-up and cudnn.benchmark's search).
# The report: the GPU model, driver, CUDA, torch, NCCL, Horovod and DeepSpeed versions, the suite's
# result and the benchmark table. Exits non-zero if the suite or a benchmark run failed, and at once
# (exit 2) on a machine without NVIDIA GPUs. Logs: logs/gpu_check/; the runs write (and overwrite)
# start.sh's checkpoints/<method>.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

out=gpu_check.md steps=20 install=1 tests=1 logs=logs/gpu_check
die() { echo "gpu_check.sh: error: $*" >&2; exit 2; }
while (( $# )); do
    case $1 in
        --out) out=${2:?}; shift 2 ;;
        --steps) steps=${2:?}; shift 2 ;;
        --skip-install) install=0; shift ;;
        --skip-tests) tests=0; shift ;;
        -h|--help) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option '$1' (see bash scripts/gpu_check.sh --help)" ;;
    esac
done
[[ $steps =~ ^[1-9][0-9]*$ ]] || die "--steps must be a positive integer, not '$steps'"

gpus=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
(( gpus > 0 )) || die "no NVIDIA GPU here (nvidia-smi lists none): this checks GPU machines; on a CPU one run .ci/run"

(( install )) && bash scripts/install.sh --tests
PY=.venv/bin/python
[[ -x $PY ]] || die "$PY not found: run without --skip-install"
seen=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
(( seen > 0 )) || die "nvidia-smi lists $gpus GPU(s) but torch sees none: a driver too old for torch's CUDA" \
    "($("$PY" -c 'import torch; print(torch.version.cuda)')) or CUDA_VISIBLE_DEVICES hides them"
rm -rf "$logs" && mkdir -p "$logs"

suite="not run (--skip-tests)" failed=()
if (( tests )); then
    echo "== GPU suite: tests/test_gpu.py on $seen GPU(s), log in $logs/gpu_suite.log"
    if "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_gpu.py >"$logs/gpu_suite.log" 2>&1; then
        suite="passed"
    else
        suite="FAILED" failed+=(gpu-suite)
    fi
    suite="$suite: $(tail -n 1 "$logs/gpu_suite.log")"
    echo "   $suite"
fi

ampere=$("$PY" -c 'import torch; print(int(torch.cuda.is_bf16_supported(including_emulation=False)))')
workers=$(( $(nproc) / seen > 1 ? $(nproc) / seen : 1 ))
for n in $(printf '%s\n' 1 "$seen" | sort -un); do
    recipe=(--dummy-samples $(( 64 * n * steps )) -b $(( 64 * n )) --epochs 2 -a resnet50 --image-size 224
            -j "$workers")
    for precision in float32 mixed; do
        for m in dp ddp spawn amp horovod fsdp deepspeed; do
            case $m/$precision in
                amp/float32) flags=(--amp-dtype float32) ;;
                amp/mixed) flags=(--amp-dtype float16) ;;
                fsdp/mixed) (( ampere )) || continue; flags=(--param-dtype bfloat16) ;;
                deepspeed/mixed) (( ampere )) || continue; flags=(--precision bfloat16) ;;
                */float32) flags=() ;;
                *) continue ;;  # no mixed precision of its own
            esac
            dir=$logs/$n-gpu/$precision
            mkdir -p "$dir"
            echo "== $m, $precision, $n GPU(s)"
            bash start.sh --dummy --methods "$m" --nproc "$n" --logs "$dir" -- "${recipe[@]}" "${flags[@]}" \
                >"$dir.$m.start.log" 2>&1 || failed+=("$m/$precision/$n-gpu")
        done
    done
done

"$PY" - "$logs" "$out" "$suite" "$steps" "${failed[*]:-}" <<'EOF'
import datetime, glob, json, os, re, subprocess, sys

import torch

logs, out, suite, steps, failed = sys.argv[1:]


def version(module):
    try:
        return __import__(module).__version__
    except ImportError:
        return "not installed"


def images_per_sec(log):
    """The last epoch's images/s in a trainer's log (its SUMMARY lines), or None."""
    summaries = [re.match(r"(\[\d+\]<stdout>:)?SUMMARY (\{.*\})$", line.rstrip())
                 for line in open(log, errors="replace")]
    rates = [json.loads(m[2])["images_per_sec"] for m in summaries if m]  # horovodrun: "[0]<stdout>:SUMMARY"
    return rates[-1] if rates else None


smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip().splitlines()
rows, counts = {}, sorted({int(d.split("-")[0]) for d in os.listdir(logs) if d.endswith("-gpu")})
for log in glob.glob(f"{logs}/*-gpu/*/*.log"):
    n, precision, method = int(log.split("/")[-3].split("-")[0]), log.split("/")[-2], os.path.basename(log)[:-4]
    rows.setdefault((method, precision), {})[n] = images_per_sec(log)
order = ["dp", "ddp", "spawn", "amp", "horovod", "fsdp", "deepspeed"]
lines = [f"# GPU check, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", "",
         f"- GPUs: {len(smi)} x {smi[0].split(', ')[0]} ({smi[0].split(', ')[2]}), driver {smi[0].split(', ')[1]}",
         f"- torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, NCCL "
         f"{'.'.join(map(str, torch.cuda.nccl.version()))}), Horovod {version('horovod')}, DeepSpeed "
         f"{version('deepspeed')}",
         f"- GPU suite (tests/test_gpu.py): {suite}", "",
         f"Benchmark: ResNet-50, 224 px, synthetic images, 64 images per GPU and step, {steps} steps per epoch; "
         "images/s of the 2nd epoch (training only). mixed: apex fp16 autocast + GradScaler, FSDP/DeepSpeed bf16.",
         "", "| method | precision | " + " | ".join(f"{n} GPU images/s" for n in counts)
         + (f" | scaling {counts[-1]} vs 1 |" if len(counts) > 1 else " |"),
         "|---|---|" + "---:|" * (len(counts) + (len(counts) > 1))]
for method, precision in sorted(rows, key=lambda k: (order.index(k[0]) if k[0] in order else 99, k[1])):
    rate = rows[method, precision]
    cells = [f"{rate[n]:.0f}" if rate.get(n) else "failed" if n in rate else "-" for n in counts]
    if len(counts) > 1:
        one, many = rate.get(1), rate.get(counts[-1])
        cells.append(f"{many / one / counts[-1]:.0%} of linear" if one and many else "")
    lines.append(f"| {method} | {precision} | " + " | ".join(cells) + " |")
if failed:
    lines += ["", f"Failed: {failed} (logs in {logs}/)"]
with open(out + ".tmp", "w") as f:
    f.write("\n".join(lines) + "\n")
os.replace(out + ".tmp", out)
print("\n".join(lines))
EOF
if (( ${#failed[@]} )); then
    echo "gpu_check.sh: error: failed: ${failed[*]} (logs in $logs/)" >&2
    exit 1
fi
echo "gpu_check.sh: report in $out"
