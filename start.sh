#!/usr/bin/env bash
# Run every data-parallel method of the cookbook on the same recipe and compare them.
#
#   bash start.sh                         # every method this machine can run, 4 epochs: on GPUs ResNet-50 on
#                                         # synthetic 224 px images, in fp32; on the CPU resnet18 on the demo digits
#   bash start.sh --methods ddp,spawn     # a subset (dp ddp launch spawn amp horovod slurm fsdp deepspeed)
#   bash start.sh --data /data/imagenet --epochs 90 -- -a resnet50 -j 8   # args after -- go to every trainer
#   bash start.sh --dummy                 # synthetic images
#   bash start.sh --precision bf16        # fp32 (the GPU default), fp16 or bf16 in every method that has it:
#                                         # fp16 amp, bf16 amp fsdp deepspeed; the others train in fp32
#   bash start.sh --benchmark             # images/s of each method against a bare DDP loop and
#                                         # against the ceiling: N replicas with no communication
#   bash start.sh --profile 3:6           # also profile steps 3..6 of each method: trace-rank<R>.json in its
#                                         # checkpoint directory, split by tools/profile_split.py into
#                                         # logs/<method>.profile.jsonl, its exposed-communication share in the table
#   bash start.sh --dry-run               # print the commands only
#   START_GPUS=4 bash start.sh --dry-run  # the commands it would run on 4 GPUs, on any machine
#
# One process per GPU when GPUs are visible, else --nproc CPU processes (default 2). Each method
# logs to logs/<method>.log (benchmark: logs/benchmark/), and checkpoints into logs/checkpoints/<method>/
# (both replaced at each run); statistics.sh turns the logs into a table.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

PY=${PYTHON:-.venv/bin/python}
ALL_METHODS=(dp ddp launch spawn amp horovod slurm fsdp deepspeed)
declare -A DTYPE=([fp32]=float32 [fp16]=float16 [bf16]=bfloat16)  # --precision's, as the trainers name them
methods=$(IFS=,; echo "${ALL_METHODS[*]}")
data="" dummy=0 epochs=4 nproc="" dry_run=0 benchmark=0 repeats=3 logs=logs profile="" precision=""
extra=()

usage() { sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
die() { echo "start.sh: error: $*" >&2; exit 2; }

while (( $# )); do
    case $1 in
        --methods) methods=${2:?}; shift 2 ;;
        --data) data=${2:?}; shift 2 ;;
        --dummy) dummy=1; shift ;;
        --epochs) epochs=${2:?}; shift 2 ;;
        --nproc) nproc=${2:?}; shift 2 ;;
        --benchmark) benchmark=1; shift ;;
        --repeats) repeats=${2:?}; shift 2 ;;
        --logs) logs=${2:?}; shift 2 ;;
        --profile) profile=${2:?}; shift 2 ;;
        --precision) precision=${2:?}; shift 2 ;;
        --dry-run) dry_run=1; shift ;;
        -h|--help) usage ;;
        --) shift; extra=("$@"); break ;;
        *) echo "start.sh: error: unknown option '$1'" >&2; usage 2 ;;
    esac
done
[[ -x $PY ]] || die "$PY not found: run 'bash scripts/install.sh' first (or set PYTHON)"
for m in ${methods//,/ }; do
    [[ " ${ALL_METHODS[*]} " == *" $m "* ]] || die "unknown method '$m' in --methods: pick from ${ALL_METHODS[*]}"
done
[[ $precision =~ ^(|fp32|fp16|bf16)$ ]] || die "--precision '$precision': pick fp32, fp16 or bf16"

if [[ -n ${START_GPUS:-} ]]; then
    # A preview only: trainers started for GPUs this machine lacks would fail, or train ResNet-50 on its CPU.
    (( dry_run )) || die "START_GPUS is for --dry-run: a run uses the GPUs torch sees (fewer: --nproc N)"
    [[ $START_GPUS =~ ^[0-9]+$ ]] || die "START_GPUS='$START_GPUS' is not a number of GPUs"
    gpus=$START_GPUS
else
    gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
fi
if [[ -z $nproc ]]; then
    nproc=$(( gpus > 0 ? gpus : 2 ))
fi
# Each CPU process gets its share of the cores; more threads than cores only thrash.
cores=$(nproc)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / nproc > 0 ? cores / nproc : 1 ))}
# torchrun restarts on torch 2.14 reuse the rendezvous TCP store, whose stale peer addresses made
# restarted workers fail or hang (3 of 5 trials here); a fresh store per attempt fixes it.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

# The recipe every method shares. On GPUs, unless --data: a workload that measures the GPUs, not the
# per-step overhead that 32 px digits at 8 images per GPU measured: ResNet-50 at 224 px, 128 images per GPU,
# 100 steps per epoch of synthetic images. The loader workers draw those on the CPU (docs/gpu.md: 8 workers
# did not keep up with one H100 in fp16), so each process gets its share of the cores but one; the table's
# data-wait column says whether they kept up (on GPUs it is the time the GPU sat idle waiting for a batch).
# On the CPU: the demo digits, ImageNet (--data) with its defaults, or synthetic images (--dummy,
# --benchmark). On the digits the lr drops after epoch 3 (of the default 4): every method measured
# 90-95% top-1 then, in 23-73 s each, 5.5 minutes for all 8 on 2 cores (docs/measurements.md).
dp_workers=""
if (( gpus > 0 )); then
    precision=${precision:-fp32}  # the same for every method: apex_distributed.py alone defaults to fp16 on GPUs
fi
if (( gpus > 0 )) && { (( benchmark || dummy )) || [[ -z $data ]]; }; then
    recipe=(--dummy --dummy-samples $(( 100 * 128 * nproc )) -a resnet50 --image-size 224 -b $(( 128 * nproc ))
            -j $(( cores / nproc > 1 ? cores / nproc - 1 : 1 )))
    dp_workers=$(( cores > 1 ? cores - 1 : 1 ))  # DataParallel: one process feeds every GPU
    if (( benchmark )); then
        recipe+=(--epochs 2 -p 1000000)
        logs=$logs/benchmark
    else
        recipe+=(--epochs "$epochs")
    fi
elif (( benchmark )); then
    recipe=(--dummy --dummy-samples $(( 64 * nproc * 8 )) --image-size 32 -b $(( 16 * nproc )) --epochs 2 -p 1000000)
    logs=$logs/benchmark
elif (( dummy )); then
    recipe=(--dummy --epochs "$epochs")
elif [[ -n $data ]]; then
    recipe=(--data "$data" --epochs "$epochs")
else
    data=data/digits
    recipe=(--data "$data" --image-size 32 -j 1 -b 32 --lr 0.1 --epochs "$epochs" --lr-step-size 3
            --min-crop-scale 0.35)
fi

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }

# Sets cmd to the launch command of method $1, or skip to why this machine cannot run it.
method_command() {
    local m=$1 out=$logs/checkpoints/$1
    cmd=() skip=""
    case $m in
        dp)
            # One process drives --nproc GPUs; on CPU it is plain training, so give it all the cores.
            cmd=(env OMP_NUM_THREADS=$(( OMP_NUM_THREADS * nproc )) "$PY" dataparallel.py)
            if (( gpus > 0 )); then cmd+=(--gpus "$(seq -s, 0 $(( nproc - 1 )))"); fi ;;
        ddp) cmd=("$(dirname "$PY")/torchrun" --standalone --nproc-per-node="$nproc" distributed.py) ;;
        launch)
            cmd=("$PY" -m torch.distributed.launch --nproc_per_node="$nproc" --master_port="$(free_port)"
                 distributed.py) ;;
        spawn) cmd=("$PY" multiprocessing_distributed.py --nprocs "$nproc") ;;
        amp)
            # Its default: fp16 on GPUs; bf16 on CPUs that compute it natively, else float32 (emulated
            # bf16 made a step 23x slower on an AVX2 CPU).
            cmd=("$(dirname "$PY")/torchrun" --standalone --nproc-per-node="$nproc" apex_distributed.py) ;;
        horovod)
            if ! "$PY" -c 'import horovod.torch' 2>/dev/null; then
                skip="Horovod not installed (bash scripts/install_horovod.sh)"
            fi
            cmd=("$(dirname "$PY")/horovodrun" -np "$nproc" -H "localhost:$nproc" --gloo "$PY" horovod_distributed.py) ;;
        slurm)
            if ! command -v srun >/dev/null || ! scontrol ping 2>/dev/null | grep -q UP; then
                skip="no Slurm cluster up (bash scripts/slurm_cluster.sh start)"
            fi
            cmd=(srun -N1 -n"$nproc")
            # With GPUs, ask Slurm for them where it manages them (gres): where it confines jobs to
            # their GPUs, a job that asks for none sees none, and would train on the CPU.
            if (( gpus > 0 )) && sinfo -h -o %G 2>/dev/null | grep -q gpu; then cmd+=(--gres=gpu:"$nproc"); fi
            cmd+=("$PY" distributed_slurm_main.py) ;;
        fsdp) cmd=("$(dirname "$PY")/torchrun" --standalone --nproc-per-node="$nproc" fsdp_distributed.py) ;;
        deepspeed)
            if ! "$PY" -c 'import deepspeed' &>/dev/null; then
                skip="DeepSpeed not installed (bash scripts/install.sh --tests)"
            fi
            # DeepSpeed's own launcher (its default port is a fixed 29500). Without GPUs it still sets
            # CUDA_VISIBLE_DEVICES=0..N-1 for its processes; the script then trains on the CPU.
            cmd=("$(dirname "$PY")/deepspeed" --num_gpus "$nproc" --master_port "$(free_port)"
                 deepspeed_distributed.py) ;;
    esac
    local script
    for script in "${cmd[@]}"; do
        [[ $script == *.py && ! -f $script ]] && skip="$script does not exist yet"
    done
    # --precision where the method has it (apex: autocast; FSDP: bf16 parameters, gradients reduced in fp32 as
    # apex's and DeepSpeed's are; DeepSpeed: bf16 autocast); after the recipe, and the args after -- after both.
    local own=()
    case $precision:$m in
        ?*:amp) own=(--amp-dtype "${DTYPE[$precision]}") ;;
        bf16:fsdp) own=(--param-dtype bfloat16 --reduce-dtype float32) ;;
        bf16:deepspeed) own=(--precision bfloat16) ;;
    esac
    [[ $m == dp && -n $dp_workers ]] && own+=(-j "$dp_workers")
    cmd+=("${recipe[@]}" "${own[@]}" "${extra[@]}" ${profile:+--profile "$profile"} --output-dir "$out")
}

# The log's first line: what each row ran that statistics.sh cannot read from the trainers' own lines (they
# name the model, global batch and world size, and apex and DeepSpeed their dtype): the image size, FSDP's
# and the fp32-only methods' dtype, and the GPUs the run used (DataParallel: all of them, at world size 1).
recipe_line() {
    local size=224 dtype=float32 i
    [[ $1 == amp ]] && dtype=""  # apex_distributed.py's default depends on the device: its own line names it
    for (( i = 0; i < ${#cmd[@]}; i++ )); do  # the last of each flag wins, as in argparse
        case ${cmd[i]} in
            --image-size) size=${cmd[i + 1]} ;;
            --image-size=*) size=${cmd[i]#*=} ;;
            --amp-dtype|--param-dtype|--precision) dtype=${cmd[i + 1]} ;;
            --amp-dtype=*|--param-dtype=*|--precision=*) dtype=${cmd[i]#*=} ;;
        esac
    done
    echo "RECIPE {\"image_size\": $size, \"gpus\": $(( gpus > 0 ? nproc : 0 ))${dtype:+, \"precision\": \"$dtype\"}}"
}

run_method() {  # run_method METHOD: run it, appending to its log, showing its per-epoch lines as it goes
    local m=$1 log=$logs/$1.log
    method_command "$m"
    echo "== $m: ${cmd[*]}"
    (( dry_run )) && return
    # A fresh run each time, as its log: a trainer refuses an --output-dir another run left checkpoints in.
    rm -rf "$logs/checkpoints/$m"
    recipe_line "$m" >>"$log"
    local start=$SECONDS status=0
    "${cmd[@]}" >>"$log" 2>&1 &
    local pid=$!
    # Progress: one short line per finished epoch, and any error line.
    tail -n0 -F --pid=$pid "$log" 2>/dev/null | grep --line-buffered -E '^(\[[0-9]+\]<std(out|err)>:)?(SUMMARY|error)' | sed -u -E \
        -e 's/.*"epoch": ([0-9]+).*"val_acc1": ([0-9]+\.?[0-9]?)[0-9]*.*"epoch_time": ([0-9.]+), "images_per_sec": ([0-9.]+).*/   epoch \1: val top-1 \2 %, \3 s, \4 images\/s/' \
        -e 's/^SUMMARY .*"epoch": ([0-9]+).*"images_per_sec": ([0-9.]+).*/   epoch \1: \2 images\/s/' &
    wait $pid || status=$?
    wait
    # Each repeat's metrics log, kept beside its text log for statistics.sh (the next repeat removes the run's directory).
    [[ -f $logs/checkpoints/$m/metrics.jsonl ]] && cat "$logs/checkpoints/$m/metrics.jsonl" >>"$logs/$m.metrics.jsonl"
    if [[ -n $profile ]] && (( status == 0 )); then
        "$PY" tools/profile_split.py --json "$logs/checkpoints/$m" >>"$logs/$m.profile.jsonl" || status=$?
    fi
    echo "   $m finished in $(( SECONDS - start )) s (exit $status)"
    (( status == 0 )) || failed+=("$m")
}

if [[ $data == data/digits && ! -f $data/demo.json ]] && (( ! dry_run )); then
    "$PY" tools/make_demo_data.py --out "$data"
fi
mkdir -p "$logs"
echo "start.sh: $nproc processes ($( (( gpus > 0 )) && echo "$gpus GPUs" || echo "CPU, $OMP_NUM_THREADS threads each")), logs in $logs/"
case $precision in
    fp32) echo "start.sh: every method in fp32 (amp: --amp-dtype float32); --precision fp16 or bf16: mixed precision" ;;
    fp16) echo "start.sh: amp in fp16, the only method with an fp16 option; the others in fp32" ;;
    bf16) echo "start.sh: amp, fsdp and deepspeed in bf16; the others, which have no bf16 option, in fp32" ;;
esac
runnable=()
for m in ${methods//,/ }; do
    method_command "$m"
    if [[ -n $skip ]]; then
        echo "== $m: skipped: $skip"
    else
        runnable+=("$m")
        (( dry_run )) || { : >"$logs/$m.log" >"$logs/$m.metrics.jsonl"; rm -f "$logs/$m.profile.jsonl"; }
    fi
done
failed=()
if (( benchmark )); then
    # The bare loop in --precision (bare_ddp.py's --amp-dtype; it ignores the trainers' other flags), which the
    # table's line names: with fp16 or bf16 only some methods run it.
    bare=("$(dirname "$PY")/torchrun" --standalone --nproc-per-node="$nproc" benchmarks/bare_ddp.py "${recipe[@]}"
          ${precision:+--amp-dtype "${DTYPE[$precision]}"} "${extra[@]}")
    # The same per-process work with no communication at all: the ceiling of any data-parallel method.
    ceiling=("${bare[@]}" --no-communication)
    if (( ! dry_run )); then cmd=("${bare[@]}"); recipe_line bare | tee "$logs/ceiling.log" >"$logs/bare.log"; fi
    # Alternate the yardsticks and the methods, so a noisy machine slows all alike; statistics.sh
    # takes medians.
    for (( r = 1; r <= repeats; r++ )); do
        echo "== bare (run $r/$repeats): ${bare[*]}"
        (( dry_run )) || "${bare[@]}" >>"$logs/bare.log" 2>&1 || failed+=(bare)
        echo "== ceiling (run $r/$repeats): ${ceiling[*]}"
        (( dry_run )) || "${ceiling[@]}" >>"$logs/ceiling.log" 2>&1 || failed+=(ceiling)
        for m in "${runnable[@]}"; do run_method "$m"; done
    done
else
    for m in "${runnable[@]}"; do run_method "$m"; done
fi
(( dry_run )) && exit 0
bash statistics.sh "$logs"
if (( ${#failed[@]} )); then
    echo "start.sh: error: failed: ${failed[*]} (see their logs in $logs/)" >&2
    exit 1
fi
